#include "parallel/all_gather_dispatcher.h"

#include <algorithm>
#include <numeric>

namespace moeut {

AllGatherDispatcher::AllGatherDispatcher(Communicator& expert_parallel, int64_t n_experts)
    : ep_(expert_parallel), shard_(expert_shard(n_experts, expert_parallel.size(), expert_parallel.rank())) {}

void AllGatherDispatcher::forward(int64_t use, const float* x, const int32_t* I, const float* w, int64_t n, int64_t k,
                                  const ExpertParams<float>& p, float* y) {
  if (int64_t(uses_.size()) <= use) uses_.resize(size_t(use + 1));
  Use& u = uses_[use];
  const int64_t d = p.d;
  u.k = k;
  u.tokens = ep_.all_to_all(std::vector<int64_t>(size_t(ep_.size()), n));  // everyone's n
  const int64_t total = std::accumulate(u.tokens.begin(), u.tokens.end(), int64_t(0));
  u.first = std::accumulate(u.tokens.begin(), u.tokens.begin() + ep_.rank(), int64_t(0));
  const int64_t others = ep_.size() - 1;
  rows_received_ += total;
  bytes_sent_ += int64_t(sizeof(float)) * (others * n * (d + 2 * k) + (total - n) * d);

  u.rows.resize(size_t(total * d));
  std::copy_n(x, n * d, u.rows.begin() + u.first * d);
  ep_.all_gather_v(std::span<float>(u.rows), scaled_counts(u.tokens, d));
  all_index_.resize(size_t(total * k));
  all_weight_.resize(size_t(total * k));
  std::copy_n(I, n * k, all_index_.begin() + u.first * k);
  std::copy_n(w, n * k, all_weight_.begin() + u.first * k);
  ep_.all_gather_v(std::span<int32_t>(all_index_), scaled_counts(u.tokens, k));
  ep_.all_gather_v(std::span<float>(all_weight_), scaled_counts(u.tokens, k));

  // This rank's experts over every selection of the group that names one of them.
  u.origin.clear();
  sel_row_.clear();
  sel_expert_.clear();
  sel_weight_.clear();
  for (int64_t i = 0; i < total * k; ++i) {
    const int32_t e = all_index_[i];
    if (e < shard_.begin || e >= shard_.begin + shard_.count) continue;
    u.origin.push_back(int32_t(i));
    sel_row_.push_back(int32_t(i / k));
    sel_expert_.push_back(int32_t(e - shard_.begin));
    sel_weight_.push_back(all_weight_[i]);
  }
  u.work.rows = u.rows.data();
  u.work.n_rows = total;
  u.work.set_selections(sel_row_.data(), sel_expert_.data(), sel_weight_.data(), int64_t(u.origin.size()), shard_.count);
  out_.assign(size_t(total * d), 0.f);
  ffn_experts_forward(u.work, p, out_.data(), ws_);
  mine_.resize(size_t(n * d));
  ep_.reduce_scatter_sum(out_, mine_, scaled_counts(u.tokens, d));
  for (int64_t i = 0; i < n * d; ++i) y[i] += mine_[i];
}

void AllGatherDispatcher::backward(int64_t use, const float* dy, float* dx, float* dw, const ExpertParams<float>& p) {
  Use& u = uses_.at(use);
  const int64_t d = p.d, k = u.k, n = u.tokens[ep_.rank()];
  const int64_t total = std::accumulate(u.tokens.begin(), u.tokens.end(), int64_t(0));
  bytes_sent_ += int64_t(sizeof(float)) * ((ep_.size() - 1) * n * d + (total - n) * (d + k));
  // Every read of dy happens here, before dx (possibly the same buffer) is written.
  out_.resize(size_t(total * d));  // every output-row gradient of the group
  std::copy_n(dy, n * d, out_.begin() + u.first * d);
  ep_.all_gather_v(std::span<float>(out_), scaled_counts(u.tokens, d));

  din_.assign(size_t(total * d), 0.f);
  dweight_.resize(u.origin.size());
  ffn_experts_backward(u.work, p, out_.data(), din_.data(), dweight_.data(), dhidden_, ws_);
  mine_.resize(size_t(n * d));
  ep_.reduce_scatter_sum(din_, mine_, scaled_counts(u.tokens, d));
  for (int64_t i = 0; i < n * d; ++i) dx[i] += mine_[i];

  // Each selection's weight gradient comes from the one rank owning its expert.
  out_.assign(size_t(total * k), 0.f);
  for (size_t s = 0; s < u.origin.size(); ++s) out_[u.origin[s]] = dweight_[s];
  mine_.resize(size_t(n * k));
  ep_.reduce_scatter_sum(std::span<const float>(out_.data(), size_t(total * k)), mine_, scaled_counts(u.tokens, k));
  std::copy_n(mine_.begin(), n * k, dw);
}

}  // namespace moeut
