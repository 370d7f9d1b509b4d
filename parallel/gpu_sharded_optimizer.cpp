#include "parallel/gpu_sharded_optimizer.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "core/hang_watchdog.h"
#include "kernels/adamw_cuda.h"
#include "kernels/cuda_check.h"
#include "kernels/grad_norm.h"
#include "kernels/cast_cuda.h"
#include "parallel/run_errors.h"

namespace moeut {

GpuShardedAdamW::GpuShardedAdamW(const ParamLayout& layout, const ProcessGroups& groups,
                                 const std::vector<float>& initial, cudaStream_t stream, int64_t bucket_elements)
    : partition_(layout, groups, bucket_elements),
      world_(*groups.world),
      expert_data_parallel_(*groups.expert_data_parallel),
      stream_(stream),
      total_(layout.total()),
      master_(size_t(partition_.owned_elements())),
      m_(size_t(partition_.owned_elements())),
      v_(size_t(partition_.owned_elements())),
      sq_(1),
      non_finite_(1) {
  if (int64_t(initial.size()) != total_)
    throw std::invalid_argument("GpuShardedAdamW: " + std::to_string(initial.size()) + " initial values for " +
                                std::to_string(total_) + " parameters");
  for (const ZeroBucket& b : partition_.buckets())
    MOEUT_CUDA_CHECK(cudaMemcpy(master_.get() + b.state_offset, initial.data() + b.offset + b.mine_offset,
                                size_t(b.mine) * sizeof(float), cudaMemcpyHostToDevice));
  MOEUT_CUDA_CHECK(cudaMemset(m_.get(), 0, m_.size() * sizeof(float)));
  MOEUT_CUDA_CHECK(cudaMemset(v_.get(), 0, v_.size() * sizeof(float)));
  MOEUT_CUDA_CHECK(cudaMemset(non_finite_.get(), 0, sizeof(float)));
  for (const ZeroBucket& b : partition_.buckets()) {
    int64_t first = -1;  // the lowest physical layer whose expert tensors the bucket holds
    if (b.group == ZeroGroup::kExpertDataParallel && comm(b).size() > 1)
      for (int64_t g = 0; g < layout.physical_layers() && first < 0; ++g) {
        const auto [begin, end] = layout.expert_range(g);
        if (b.offset < end && begin < b.offset + b.length) first = g;
      }
    final_after_layer_.push_back(first);
  }
}

void GpuShardedAdamW::reduce_final_experts(float* grads, int64_t g) {
  const std::vector<ZeroBucket>& buckets = partition_.buckets();
  expert_data_parallel_.defer_joins();
  for (size_t i = 0; i < buckets.size(); ++i) {
    const ZeroBucket& b = buckets[i];
    if (final_after_layer_[i] == g) reduce(b, grads);
  }
}

void GpuShardedAdamW::reduce(const ZeroBucket& b, float* grads) {
  comm(b).reduce_scatter_sum(std::span<const float>(grads + b.offset, size_t(b.length)),
                             std::span<float>(grads + b.offset + b.mine_offset, size_t(b.mine)), b.chunks);
}

void GpuShardedAdamW::join_reduces() { expert_data_parallel_.join_deferred(); }

double GpuShardedAdamW::step(__nv_bfloat16* working, float* grads, double lr, const TrainConfig& t,
                             bool experts_reduced) {
  const std::vector<ZeroBucket>& buckets = partition_.buckets();
  // Each owner's chunk of the summed gradient lands in place, in its own part of grads.
  for (size_t i = 0; i < buckets.size(); ++i) {
    const ZeroBucket& b = buckets[i];
    if (comm(b).size() > 1 && !(experts_reduced && final_after_layer_[i] >= 0)) reduce(b, grads);
  }
  MOEUT_CUDA_CHECK(cudaMemsetAsync(sq_.get(), 0, sizeof(double), stream_));
  for (const ZeroBucket& b : buckets) cuda::sum_of_squares(sq_.get(), grads + b.offset + b.mine_offset, b.mine, stream_);
  world_.all_reduce_sum(std::span<double>(sq_.get(), 1));
  double sq = 0;
  MOEUT_CUDA_CHECK(cudaMemcpyAsync(&sq, sq_.get(), sizeof(double), cudaMemcpyDeviceToHost, stream_));
  {
    const Waiting waiting("the GPU's gradient reduce-scatter and norm", world_.name());
    MOEUT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  const double norm = std::sqrt(sq);
  if (!std::isfinite(norm)) return norm;  // the same on every rank: the caller stops
  const AdamWHyper h{lr, t.adam_beta1, t.adam_beta2, t.adam_eps, t.weight_decay};
  const double coef = clip_coefficient(norm, t.grad_clip);
  ++steps_;
  // Each bucket's working copy is all-gathered on its group's stream while the next bucket updates.
  world_.defer_joins();
  expert_data_parallel_.defer_joins();
  for (const ZeroBucket& b : buckets) {
    const int64_t at = b.offset + b.mine_offset;
    cuda::adamw_update(master_.get() + b.state_offset, working + at, grads + at, m_.get() + b.state_offset,
                       v_.get() + b.state_offset, b.mine, h, steps_, coef, non_finite_.get(), stream_);
    gather_working(b, working);
  }
  world_.all_reduce_sum(std::span<float>(non_finite_.get(), 1));
  world_.join_deferred();
  expert_data_parallel_.join_deferred();
  float non_finite = 0;  // ranks whose update left a master value that is not finite
  MOEUT_CUDA_CHECK(cudaMemcpyAsync(&non_finite, non_finite_.get(), sizeof(float), cudaMemcpyDeviceToHost, stream_));
  {
    const Waiting waiting("the GPU's update and parameter all-gather", world_.name());
    MOEUT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  if (non_finite > 0)
    throw NonFiniteUpdate("the update left parameters that are not finite (on " + std::to_string(int(non_finite)) +
                          " of " + std::to_string(world_.size()) + " ranks)");
  return norm;
}

std::vector<double> GpuShardedAdamW::tensor_square_sums(const ParamLayout& layout, const float* grads) {
  cuda::DeviceBuffer<double> sums(layout.tensors().size());
  MOEUT_CUDA_CHECK(cudaMemsetAsync(sums.get(), 0, sums.size() * sizeof(double), stream_));
  for_each_owned_piece(layout, partition_, [&](size_t t, int64_t offset, int64_t, int64_t count) {
    cuda::sum_of_squares(sums.get() + t, grads + offset, count, stream_);
  });
  MOEUT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return sums.download();
}

OptimizerShard GpuShardedAdamW::shard() const {
  MOEUT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return {master_.download(), m_.download(), v_.download(), steps_};
}

void GpuShardedAdamW::load(const OptimizerShard& s, __nv_bfloat16* working) {
  if (s.master.size() != master_.size() || s.m.size() != m_.size() || s.v.size() != v_.size() || s.steps < 0)
    throw std::invalid_argument("optimizer shard of " + std::to_string(s.master.size()) +
                                " elements for a partition of " + std::to_string(master_.size()));
  MOEUT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  master_.upload(s.master);
  m_.upload(s.m);
  v_.upload(s.v);
  steps_ = s.steps;
  for (const ZeroBucket& b : partition_.buckets()) {
    cuda::to_bf16(working + b.offset + b.mine_offset, master_.get() + b.state_offset, b.mine, stream_);
    gather_working(b, working);
  }
}

void GpuShardedAdamW::gather_working(const ZeroBucket& b, __nv_bfloat16* working) {
  comm(b).all_gather_v(std::span<uint16_t>(reinterpret_cast<uint16_t*>(working + b.offset), size_t(b.length)),
                       b.chunks);
}

std::vector<float> GpuShardedAdamW::parameters() {
  // One bucket at a time through a bucket-sized buffer: no second full copy on the device.
  std::vector<float> all(static_cast<size_t>(total_));
  int64_t largest = 0;
  for (const ZeroBucket& b : partition_.buckets()) largest = std::max(largest, b.length);
  cuda::DeviceBuffer<float> bucket(static_cast<size_t>(largest));
  for (const ZeroBucket& b : partition_.buckets()) {
    MOEUT_CUDA_CHECK(cudaMemcpyAsync(bucket.get() + b.mine_offset, master_.get() + b.state_offset,
                                     size_t(b.mine) * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
    comm(b).all_gather_v(std::span<float>(bucket.get(), size_t(b.length)), b.chunks);
    MOEUT_CUDA_CHECK(cudaMemcpyAsync(all.data() + b.offset, bucket.get(), size_t(b.length) * sizeof(float),
                                     cudaMemcpyDeviceToHost, stream_));
    MOEUT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  return all;
}

}  // namespace moeut
