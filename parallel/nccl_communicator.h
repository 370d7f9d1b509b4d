// The NCCL backend of Communicator, for GPU tensors: every pointer is a device pointer. Each
// group has its own NCCL communicator and its own CUDA stream, so expert-parallel and
// data-parallel traffic never share either. A call makes the group's stream wait for the work
// queued so far on the caller's stream, and the caller's stream wait for the collective: to the
// caller it reads as a call in stream order, and the host does not block. The exception is
// all_to_all of counts, which is host data and goes over the same ranks' host group (MPI).
#pragma once
#include <cuda_runtime.h>
#include <nccl.h>

#include "parallel/communicator.h"

namespace moeut {

class NcclCommunicator final : public Communicator {
 public:
  // A collective over the ranks of `host`, a host group (MPI, which must outlive it): rank 0's
  // NCCL unique id is shared over it. `caller` is the stream this group's calls are ordered
  // against.
  NcclCommunicator(Communicator& host, cudaStream_t caller);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;
  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }
  const std::string& name() const override { return host_.name(); }

  void all_reduce_sum(std::span<double> data) override;
  void all_reduce_sum(std::span<float> data) override;
  std::vector<int64_t> all_to_all(std::span<const int64_t> send) override { return host_.all_to_all(send); }
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
  void defer_joins() override { deferring_ = true; }
  void join_deferred() override;
  // Seconds this group's collectives ran on the device since the last call (waits for them);
  // collectives replayed within a CUDA graph are not counted.
  double take_seconds();

 private:
  template <typename Enqueue>
  void run(const char* op, Enqueue&& enqueue);
  void check(ncclResult_t rc, const char* op) const;
  void all_to_all_v(const void* send, std::span<const int64_t> sc, void* recv, std::span<const int64_t> rc,
                    ncclDataType_t type, size_t bytes, const char* op);
  void all_gather_v(void* data, std::span<const int64_t> counts, ncclDataType_t type, size_t bytes, const char* op);

  Communicator& host_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t caller_, stream_ = nullptr;
  cudaEvent_t queued_ = nullptr, done_ = nullptr;
  bool deferring_ = false;  // see Communicator::defer_joins
  std::vector<std::pair<cudaEvent_t, cudaEvent_t>> timed_, spare_;  // (start, end) of each call
};

// The device group of one rank: a collective is a copy of device memory, on the caller's stream.
class DeviceSelfCommunicator final : public SelfCommunicator {
 public:
  DeviceSelfCommunicator(std::string name, cudaStream_t caller) : SelfCommunicator(std::move(name)), caller_(caller) {}

 private:
  void copy(void* to, const void* from, size_t bytes) override;
  cudaStream_t caller_;
};

// The device groups of a GPU rank: ProcessGroups whose communicators are NCCL's, and those NCCL
// communicators by type, for the device time of their collectives.
struct NcclProcessGroups : ProcessGroups {
  std::vector<NcclCommunicator*> nccl;  // the groups of several ranks (a group of one has no NCCL)
  // Seconds their collectives ran on the device since the last call (waits for them).
  double take_seconds();
};

// Device communicators for the groups of `host` (MPI groups, which must outlive them): NCCL for
// groups of several ranks, DeviceSelfCommunicator for a group of one; the same node place.
NcclProcessGroups nccl_process_groups(const ProcessGroups& host, cudaStream_t caller);

}  // namespace moeut
