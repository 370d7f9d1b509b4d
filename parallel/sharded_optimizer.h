// Gradient synchronisation and ZeRO stage-1 AdamW. The parameter buffer's replicated range is
// synchronised over the world group, its expert range over the expert-data-parallel group.
// Each range is cut into buckets (one collective per bucket, not per tensor), and every bucket
// into one chunk per rank of its group: gradients are reduce-scattered to the chunk's owner,
// which alone keeps AdamW moments for it, updates it and all-gathers it back. Optimizer state
// per rank therefore falls as 1/dp. The gradient norm for clipping sums the owned chunks over
// the world, so every element counts exactly once.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "core/config.h"
#include "core/params.h"
#include "parallel/communicator.h"

namespace moeut {

class ShardedAdamW {
 public:
  ShardedAdamW(const ParamLayout& layout, const ProcessGroups& groups, int64_t bucket_elements = int64_t(1) << 22);
  // Sums grads over the ranks, clips to t.grad_clip by global norm, updates, and leaves the new
  // parameters on every rank. grads holds this rank's gradient (summed over its micro-batches)
  // on entry and is undefined afterwards. Returns the global norm before clipping.
  double step(std::span<float> params, std::span<float> grads, double lr, const TrainConfig& t);
  int64_t state_bytes() const { return int64_t((m_.size() + v_.size()) * sizeof(float)); }
  int64_t steps_taken() const { return steps_; }

 private:
  struct Bucket {
    int64_t offset, length;          // in the parameter buffer
    Communicator* comm;
    std::vector<int64_t> chunks;     // elements per rank of comm
    int64_t mine_offset, state_offset;  // this rank's chunk in the bucket, and in the shard state
  };
  void add_range(int64_t begin, int64_t end, Communicator& comm, int64_t bucket_elements);

  std::vector<Bucket> buckets_;
  Communicator& world_;
  std::vector<float> grad_shard_, m_, v_;
  int64_t steps_ = 0;
};

}  // namespace moeut
