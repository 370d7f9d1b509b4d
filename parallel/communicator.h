// Collective communication within one group of ranks. One interface for every backend: MPI for
// CPU tensors (mpi_communicator.h), NCCL for GPU tensors (nccl_communicator.h: the pointers are
// device pointers, and the calls are ordered on the caller's CUDA stream), and a
// single-process group (here). Every call's failure throws CommError naming the rank, the
// group and the operation.
#pragma once
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace moeut {

struct CommError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const std::string& name() const = 0;  // what the group holds: "world", "expert-parallel", ...

  virtual void all_reduce_sum(std::span<double> data) = 0;
  virtual void all_reduce_sum(std::span<float> data) = 0;
  // send[i] goes to rank i; returns what each rank sent to this one.
  virtual std::vector<int64_t> all_to_all(std::span<const int64_t> send) = 0;
  // send holds consecutive blocks of send_counts[i] elements for rank i; recv receives blocks of
  // recv_counts[i] elements from rank i, in rank order.
  virtual void all_to_all_v(const float* send, std::span<const int64_t> send_counts, float* recv,
                            std::span<const int64_t> recv_counts) = 0;
  virtual void all_to_all_v(const int32_t* send, std::span<const int64_t> send_counts, int32_t* recv,
                            std::span<const int64_t> recv_counts) = 0;
  virtual void all_to_all_v(const uint16_t* send, std::span<const int64_t> send_counts, uint16_t* recv,
                            std::span<const int64_t> recv_counts) = 0;  // bf16 bit patterns
  // data holds consecutive chunks of counts[i] elements; sums data over the group and leaves the
  // sum of chunk rank() in `mine`.
  virtual void reduce_scatter_sum(std::span<const float> data, std::span<float> mine,
                                  std::span<const int64_t> counts) = 0;
  // data holds consecutive chunks of counts[i] elements, chunk rank() filled in by this rank;
  // afterwards every rank has every chunk.
  virtual void all_gather_v(std::span<float> data, std::span<const int64_t> counts) = 0;
  virtual void all_gather_v(std::span<int32_t> data, std::span<const int64_t> counts) = 0;
  virtual void all_gather_v(std::span<uint16_t> data, std::span<const int64_t> counts) = 0;  // bf16 bit patterns

  // A device group's collectives are ordered after the caller's work queued before them, and the
  // caller's later work after them. Between defer_joins() and join_deferred(), the caller's work
  // does not wait for them (it may run beside them, and must not touch their data) until
  // join_deferred(), after which it waits for all of them. A host group's collectives are done
  // when the call returns: nothing to defer.
  virtual void defer_joins() {}
  virtual void join_deferred() {}
};

// Per-rank element counts for rows of `width` elements: counts[i] * width.
inline std::vector<int64_t> scaled_counts(const std::vector<int64_t>& counts, int64_t width) {
  std::vector<int64_t> out(counts.size());
  for (size_t i = 0; i < counts.size(); ++i) out[i] = counts[i] * width;
  return out;
}

// The group of one process: every collective is a copy, of host memory (a device group's
// DeviceSelfCommunicator copies device memory).
class SelfCommunicator : public Communicator {
 public:
  explicit SelfCommunicator(std::string name) : name_(std::move(name)) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const std::string& name() const override { return name_; }
  void all_reduce_sum(std::span<double>) override {}
  void all_reduce_sum(std::span<float>) override {}
  std::vector<int64_t> all_to_all(std::span<const int64_t> send) override { return {send.begin(), send.end()}; }
  void all_to_all_v(const float* send, std::span<const int64_t> sc, float* recv, std::span<const int64_t>) override {
    copy(recv, send, size_t(sc[0]) * sizeof(float));
  }
  void all_to_all_v(const int32_t* send, std::span<const int64_t> sc, int32_t* recv,
                    std::span<const int64_t>) override {
    copy(recv, send, size_t(sc[0]) * sizeof(int32_t));
  }
  void all_to_all_v(const uint16_t* send, std::span<const int64_t> sc, uint16_t* recv,
                    std::span<const int64_t>) override {
    copy(recv, send, size_t(sc[0]) * sizeof(uint16_t));
  }
  void reduce_scatter_sum(std::span<const float> data, std::span<float> mine, std::span<const int64_t>) override {
    copy(mine.data(), data.data(), data.size_bytes());
  }
  void all_gather_v(std::span<float>, std::span<const int64_t>) override {}
  void all_gather_v(std::span<int32_t>, std::span<const int64_t>) override {}
  void all_gather_v(std::span<uint16_t>, std::span<const int64_t>) override {}

 protected:
  virtual void copy(void* to, const void* from, size_t bytes) {
    if (to != from && bytes > 0) std::memmove(to, from, bytes);
  }

 private:
  std::string name_;
};

// Where a rank sits among the ranks of its machine, which share the machine's GPUs: its index
// among them (in world-rank order), their number, and the world rank of the first of them, which
// names the machine.
struct NodePlace {
  int rank = 0, ranks = 1, first = 0;
};

// The groups a run needs, created once at start-up. world: every rank (replicated parameters
// are synchronised over it). expert_parallel: the `ep` consecutive ranks that together hold all
// FFN experts and exchange tokens. expert_data_parallel: the ranks holding the same experts
// (rank % ep equal), over which expert gradients are synchronised. node: this rank's place on
// its machine, by which a GPU rank picks its GPU.
struct ProcessGroups {
  std::unique_ptr<Communicator> world, expert_parallel, expert_data_parallel;
  NodePlace node;

  int ep() const { return expert_parallel->size(); }
  int dp() const { return world->size(); }  // data-parallel degree of replicated parameters
  // Whether every expert-parallel group's ranks share one machine (node.first alike), so that
  // its token exchange stays on the machine's links: the same answer on every rank (a collective).
  bool expert_groups_within_machines() const;
  static ProcessGroups single();
};

inline bool ProcessGroups::expert_groups_within_machines() const {
  std::vector<int32_t> first(size_t(ep()), 0);
  first[size_t(expert_parallel->rank())] = node.first;
  expert_parallel->all_gather_v(std::span<int32_t>(first), std::vector<int64_t>(first.size(), 1));
  double spanning = std::equal(first.begin() + 1, first.end(), first.begin()) ? 0.0 : 1.0;
  world->all_reduce_sum(std::span<double>(&spanning, 1));
  return spanning == 0.0;
}

inline ProcessGroups ProcessGroups::single() {
  ProcessGroups g;
  g.world = std::make_unique<SelfCommunicator>("world");
  g.expert_parallel = std::make_unique<SelfCommunicator>("expert-parallel");
  g.expert_data_parallel = std::make_unique<SelfCommunicator>("expert-data-parallel");
  return g;
}

}  // namespace moeut
