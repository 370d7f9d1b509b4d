// ZeRO stage-1 AdamW on GPU ranks: the twin of ShardedAdamW (sharded_optimizer.h) over the same
// ZeroPartition, with device communicators (nccl_communicator.h). Each rank keeps the fp32
// master values and AdamW moments of its chunks only; the model keeps the bf16 working copy of
// every parameter and the fp32 gradients. A step reduces each bucket's gradient chunks to their
// owners (in place), takes the global norm over the owned chunks (every element once), updates
// the owned master chunks and their working copy, and all-gathers the working copy in bf16 (each
// bucket's beside the next bucket's update).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "core/config.h"
#include "kernels/device_buffer.h"
#include "parallel/zero_partition.h"

namespace moeut {

class GpuShardedAdamW {
 public:
  // initial: every parameter of `layout` (host, fp32); this rank keeps its chunks as the master
  // copy. groups: device communicators, ordered on `stream`.
  GpuShardedAdamW(const ParamLayout& layout, const ProcessGroups& groups, const std::vector<float>& initial,
                  cudaStream_t stream, int64_t bucket_elements = int64_t(1) << 26);
  // grads: this rank's gradient (summed over its micro-batches), undefined afterwards. Leaves
  // the updated working copy on every rank; returns the global norm before clipping (one
  // device-to-host read), without updating when it is not finite. The update flags a master
  // value it leaves non-finite in its own pass; the flag, summed over the world, is read back
  // after the working copy's all-gather (the step's end, where the trainer waits for its
  // collectives anyway), and NonFiniteUpdate (parallel/run_errors.h) thrown on every rank
  // together when it is set.
  //
  // experts_reduced: reduce_final_experts() ran for every physical layer in the step's last
  // backward pass (and join_reduces() after them), so the buckets it reduced are not reduced again.
  double step(__nv_bfloat16* working, float* grads, double lr, const TrainConfig& t, bool experts_reduced = false);
  // In the step's last backward pass, once physical layer g's FFN expert gradients are final:
  // reduces to their owners the expert buckets that held nothing else still to come, on the
  // expert-data-parallel group's stream, while the pass goes on (the caller's stream does not
  // wait for them until join_reduces()). Layers come last first, as the backward pass finishes
  // them.
  void reduce_final_experts(float* grads, int64_t g);
  void join_reduces();
  // Per tensor of `layout`, the sum of squares of this rank's chunks of the summed gradient of
  // the last step (grads as step() left it: each owned chunk keeps its sum until the next
  // backward pass). Summed over the world's ranks, the squares of the tensors' gradient norms.
  std::vector<double> tensor_square_sums(const ParamLayout& layout, const float* grads);
  int64_t state_bytes() const { return 3 * partition_.owned_elements() * int64_t(sizeof(float)); }
  const ZeroPartition& partition() const { return partition_; }
  OptimizerShard shard() const;
  // Installs a shard for this partition and rebuilds every rank's working copy (a collective).
  void load(const OptimizerShard& shard, __nv_bfloat16* working);
  // Every fp32 master value, gathered from the owners, in layout order (a collective).
  std::vector<float> parameters();

 private:
  Communicator& comm(const ZeroBucket& b) const {
    return b.group == ZeroGroup::kWorld ? world_ : expert_data_parallel_;
  }
  // Bucket b's working copy, every owner's chunk to every rank of its group.
  void gather_working(const ZeroBucket& b, __nv_bfloat16* working);
  // Bucket b's gradient chunks summed over its group, each into its owner's chunk of grads.
  void reduce(const ZeroBucket& b, float* grads);

  ZeroPartition partition_;
  Communicator &world_, &expert_data_parallel_;
  cudaStream_t stream_;
  int64_t total_;
  // Per bucket, the physical layer after whose FFN experts reduce_final_experts() reduces it (the
  // lowest layer whose expert gradients it holds), or -1: a bucket step() reduces.
  std::vector<int64_t> final_after_layer_;
  cuda::DeviceBuffer<float> master_, m_, v_;
  cuda::DeviceBuffer<double> sq_;
  cuda::DeviceBuffer<float> non_finite_;  // set by the update (adamw_update), never cleared: the run stops
  int64_t steps_ = 0;
};

}  // namespace moeut
