// Gradient synchronisation and ZeRO stage-1 AdamW on CPU ranks, over the partition of
// zero_partition.h: gradients are reduce-scattered to each chunk's owner, which alone keeps AdamW
// moments for it, updates it and all-gathers it back. Optimizer state per rank therefore falls
// as 1/dp. The gradient norm for clipping sums the owned chunks over the world, so every element
// counts exactly once.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "core/config.h"
#include "core/params.h"
#include "parallel/communicator.h"
#include "parallel/zero_partition.h"

namespace moeut {

class ShardedAdamW {
 public:
  ShardedAdamW(const ParamLayout& layout, const ProcessGroups& groups,
               int64_t bucket_elements = ZeroPartition::kDefaultBucket);
  // Sums grads over the ranks, clips to t.grad_clip by global norm, updates, and leaves the new
  // parameters on every rank. grads holds this rank's gradient (summed over its micro-batches)
  // on entry and is undefined afterwards. Returns the global norm before clipping; when it is
  // not finite, without updating. Throws NonFiniteUpdate (parallel/run_errors.h) on every rank
  // together when the update left a parameter that is not finite (each rank's own chunks are
  // then updated, the others' not gathered).
  double step(std::span<float> params, std::span<float> grads, double lr, const TrainConfig& t);
  // Per tensor of `layout`, the sum of squares of this rank's chunks of the last step's summed
  // gradient; summed over the world's ranks, the squares of the tensors' gradient norms.
  std::vector<double> tensor_square_sums(const ParamLayout& layout) const;
  int64_t state_bytes() const { return int64_t((m_.size() + v_.size()) * sizeof(float)); }
  int64_t steps_taken() const { return steps_; }
  const ZeroPartition& partition() const { return partition_; }
  // This rank's chunks of params with their moments.
  OptimizerShard shard(std::span<const float> params) const;
  // Installs a shard for this partition into params and the moments, then all-gathers the
  // chunks so that every rank holds the same parameters. Throws std::invalid_argument when the
  // shard's sizes do not fit the partition.
  void load(const OptimizerShard& shard, std::span<float> params);

 private:
  void all_gather(std::span<float> params);
  Communicator& comm(const ZeroBucket& b) const {
    return b.group == ZeroGroup::kWorld ? world_ : expert_data_parallel_;
  }

  ZeroPartition partition_;
  Communicator &world_, &expert_data_parallel_;
  std::vector<float> grad_shard_, m_, v_;
  int64_t steps_ = 0;
};

}  // namespace moeut
