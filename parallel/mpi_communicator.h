// The MPI backend of Communicator, for CPU tensors, and the process groups built over MPI.
#pragma once
#include <mpi.h>

#include "parallel/communicator.h"

namespace moeut {

class MpiCommunicator final : public Communicator {
 public:
  // Takes ownership of comm (freed on destruction unless it is MPI_COMM_WORLD).
  MpiCommunicator(MPI_Comm comm, std::string name);
  ~MpiCommunicator() override;
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  MPI_Comm comm() const { return comm_; }

  void all_reduce_sum(std::span<double> data) override;
  void all_reduce_sum(std::span<float> data) override;
  std::vector<int64_t> all_to_all(std::span<const int64_t> send) override;
  void all_to_all_v(const float* send, std::span<const int64_t> send_counts, float* recv,
                    std::span<const int64_t> recv_counts) override;
  void all_to_all_v(const int32_t* send, std::span<const int64_t> send_counts, int32_t* recv,
                    std::span<const int64_t> recv_counts) override;
  void all_to_all_v(const uint16_t* send, std::span<const int64_t> send_counts, uint16_t* recv,
                    std::span<const int64_t> recv_counts) override;
  void reduce_scatter_sum(std::span<const float> data, std::span<float> mine,
                          std::span<const int64_t> counts) override;
  void all_gather_v(std::span<float> data, std::span<const int64_t> counts) override;
  void all_gather_v(std::span<int32_t> data, std::span<const int64_t> counts) override;
  void all_gather_v(std::span<uint16_t> data, std::span<const int64_t> counts) override;

 private:
  void all_gather_v(void* data, std::span<const int64_t> counts, MPI_Datatype type, const char* op);
  void check(int rc, const char* op) const;
  std::vector<int> to_int(std::span<const int64_t> counts, const char* op) const;
  void all_to_all_v(const void* send, std::span<const int64_t> sc, void* recv, std::span<const int64_t> rc,
                    MPI_Datatype type, const char* op);

  MPI_Comm comm_;
  std::string name_;
  int rank_ = 0, size_ = 1;
};

// Splits `base` into the groups of ProcessGroups with expert-parallel size ep. Throws
// std::invalid_argument, naming the sizes, when ep does not divide the size of base.
ProcessGroups mpi_process_groups(MPI_Comm base, int ep);

}  // namespace moeut
