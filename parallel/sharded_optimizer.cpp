#include "parallel/sharded_optimizer.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "kernels/adamw.h"
#include "kernels/grad_norm.h"
#include "parallel/run_errors.h"

namespace moeut {

ShardedAdamW::ShardedAdamW(const ParamLayout& layout, const ProcessGroups& groups, int64_t bucket_elements)
    : partition_(layout, groups, bucket_elements),
      world_(*groups.world),
      expert_data_parallel_(*groups.expert_data_parallel),
      grad_shard_(size_t(partition_.owned_elements()), 0.f),
      m_(size_t(partition_.owned_elements()), 0.f),
      v_(size_t(partition_.owned_elements()), 0.f) {}

double ShardedAdamW::step(std::span<float> params, std::span<float> grads, double lr, const TrainConfig& t) {
  const std::vector<ZeroBucket>& buckets = partition_.buckets();
  for (const ZeroBucket& b : buckets)
    comm(b).reduce_scatter_sum(grads.subspan(size_t(b.offset), size_t(b.length)),
                               std::span<float>(grad_shard_).subspan(size_t(b.state_offset), size_t(b.mine)), b.chunks);
  double sq = sum_of_squares(grad_shard_.data(), int64_t(grad_shard_.size()));
  world_.all_reduce_sum(std::span<double>(&sq, 1));
  const double norm = std::sqrt(sq);
  if (!std::isfinite(norm)) return norm;  // the same on every rank: the caller stops
  const AdamWHyper h{lr, t.adam_beta1, t.adam_beta2, t.adam_eps, t.weight_decay};
  const double coef = clip_coefficient(norm, t.grad_clip);
  ++steps_;
  double non_finite = 0;  // ranks whose update left a parameter that is not finite
  for (const ZeroBucket& b : buckets)
    if (!adamw_update(params.data() + b.offset + b.mine_offset, grad_shard_.data() + b.state_offset,
                      m_.data() + b.state_offset, v_.data() + b.state_offset, b.mine, h, steps_, coef))
      non_finite = 1;
  world_.all_reduce_sum(std::span<double>(&non_finite, 1));
  if (non_finite > 0)
    throw NonFiniteUpdate("the update left parameters that are not finite (on " + std::to_string(int(non_finite)) +
                          " of " + std::to_string(world_.size()) + " ranks)");
  all_gather(params);
  return norm;
}

std::vector<double> ShardedAdamW::tensor_square_sums(const ParamLayout& layout) const {
  std::vector<double> sums(layout.tensors().size(), 0.0);
  for_each_owned_piece(layout, partition_, [&](size_t t, int64_t, int64_t state_offset, int64_t count) {
    sums[t] += sum_of_squares(grad_shard_.data() + state_offset, count);
  });
  return sums;
}

void ShardedAdamW::all_gather(std::span<float> params) {
  for (const ZeroBucket& b : partition_.buckets())
    comm(b).all_gather_v(params.subspan(size_t(b.offset), size_t(b.length)), b.chunks);
}

OptimizerShard ShardedAdamW::shard(std::span<const float> params) const {
  OptimizerShard s{{}, m_, v_, steps_};
  s.master.resize(m_.size());
  for (const ZeroBucket& b : partition_.buckets())
    std::copy_n(params.data() + b.offset + b.mine_offset, b.mine, s.master.data() + b.state_offset);
  return s;
}

void ShardedAdamW::load(const OptimizerShard& s, std::span<float> params) {
  const size_t n = size_t(partition_.owned_elements());
  if (s.master.size() != n || s.m.size() != n || s.v.size() != n || s.steps < 0)
    throw std::invalid_argument("optimizer shard of " + std::to_string(s.master.size()) + " elements for a partition of " +
                                std::to_string(n));
  for (const ZeroBucket& b : partition_.buckets())
    std::copy_n(s.master.data() + b.state_offset, b.mine, params.data() + b.offset + b.mine_offset);
  m_ = s.m;
  v_ = s.v;
  steps_ = s.steps;
  all_gather(params);
}

}  // namespace moeut
