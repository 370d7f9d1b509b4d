#include "parallel/sharded_optimizer.h"

#include <algorithm>
#include <cmath>

#include "kernels/adamw.h"
#include "kernels/grad_norm.h"

namespace moeut {

ShardedAdamW::ShardedAdamW(const ParamLayout& layout, const ProcessGroups& groups, int64_t bucket_elements)
    : world_(*groups.world) {
  add_range(0, layout.replicated(), *groups.world, bucket_elements);
  add_range(layout.replicated(), layout.total(), *groups.expert_data_parallel, bucket_elements);
  int64_t state = 0;
  for (Bucket& b : buckets_) {
    b.state_offset = state;
    state += b.chunks[b.comm->rank()];
  }
  grad_shard_.assign(size_t(state), 0.f);
  m_.assign(size_t(state), 0.f);
  v_.assign(size_t(state), 0.f);
}

void ShardedAdamW::add_range(int64_t begin, int64_t end, Communicator& comm, int64_t bucket_elements) {
  const int64_t ranks = comm.size();
  for (int64_t off = begin; off < end; off += bucket_elements) {
    Bucket b{off, std::min(bucket_elements, end - off), &comm, {}, 0, 0};
    for (int64_t r = 0; r < ranks; ++r) b.chunks.push_back(b.length / ranks + (r < b.length % ranks ? 1 : 0));
    for (int64_t r = 0; r < comm.rank(); ++r) b.mine_offset += b.chunks[r];
    buckets_.push_back(std::move(b));
  }
}

double ShardedAdamW::step(std::span<float> params, std::span<float> grads, double lr, const TrainConfig& t) {
  for (const Bucket& b : buckets_)
    b.comm->reduce_scatter_sum(grads.subspan(size_t(b.offset), size_t(b.length)),
                               std::span<float>(grad_shard_).subspan(size_t(b.state_offset),
                                                                     size_t(b.chunks[b.comm->rank()])),
                               b.chunks);
  double sq = sum_of_squares(grad_shard_.data(), int64_t(grad_shard_.size()));
  world_.all_reduce_sum(std::span<double>(&sq, 1));
  const double norm = std::sqrt(sq);
  const AdamWHyper h{lr, t.adam_beta1, t.adam_beta2, t.adam_eps, t.weight_decay};
  const double coef = clip_coefficient(norm, t.grad_clip);
  ++steps_;
  for (const Bucket& b : buckets_) {
    const int64_t n = b.chunks[b.comm->rank()];
    adamw_update(params.data() + b.offset + b.mine_offset, grad_shard_.data() + b.state_offset,
                 m_.data() + b.state_offset, v_.data() + b.state_offset, n, h, steps_, coef);
  }
  for (const Bucket& b : buckets_) b.comm->all_gather_v(params.subspan(size_t(b.offset), size_t(b.length)), b.chunks);
  return norm;
}

}  // namespace moeut
