#include "parallel/all_to_all_dispatcher.h"

#include <algorithm>
#include <numeric>

namespace moeut {
namespace {

int64_t total(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t(0)); }

}  // namespace

AllToAllDispatcher::AllToAllDispatcher(Communicator& expert_parallel, int64_t n_experts)
    : ep_(expert_parallel), owner_(size_t(n_experts)) {
  for (int r = 0; r < ep_.size(); ++r) {
    shards_.push_back(expert_shard(n_experts, ep_.size(), r));
    std::fill_n(owner_.begin() + shards_[r].begin, shards_[r].count, r);
  }
}

template <typename T>
void AllToAllDispatcher::exchange(const T* send, const std::vector<int64_t>& send_counts, T* recv,
                                  const std::vector<int64_t>& recv_counts, int64_t width) {
  const std::vector<int64_t> sc = scaled_counts(send_counts, width), rc = scaled_counts(recv_counts, width);
  ep_.all_to_all_v(send, sc, recv, rc);
  bytes_sent_ += (total(sc) - sc[ep_.rank()]) * int64_t(sizeof(T));
}

void AllToAllDispatcher::forward(int64_t use, const float* x, const int32_t* I, const float* w, int64_t n,
                                 int64_t k, const ExpertParams<float>& p, float* y) {
  if (int64_t(routes_.size()) <= use) routes_.resize(size_t(use + 1));
  Route& r = routes_[use];
  const int P = ep_.size();
  const int64_t d = p.d;

  // Routes: for each destination in rank order, each token with a selection there, once.
  r.copy_token.clear();
  r.sel_origin.clear();
  r.send_copies.assign(size_t(P), 0);
  r.send_sels.assign(size_t(P), 0);
  send_meta_.clear();
  send_w_.clear();
  for (int dest = 0; dest < P; ++dest)
    for (int64_t t = 0; t < n; ++t) {
      bool copied = false;
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = I[t * k + j];
        if (owner_[e] != dest) continue;
        if (!copied) {
          r.copy_token.push_back(int32_t(t));
          ++r.send_copies[dest];
          copied = true;
        }
        send_meta_.push_back(int32_t(r.send_copies[dest] - 1));                // copy within dest's block
        send_meta_.push_back(int32_t(e - shards_[dest].begin));                // expert on dest
        send_w_.push_back(w[t * k + j]);
        r.sel_origin.push_back(int32_t(t * k + j));
        ++r.send_sels[dest];
      }
    }
  r.recv_copies = ep_.all_to_all(r.send_copies);
  r.recv_sels = ep_.all_to_all(r.send_sels);

  const int64_t n_send = int64_t(r.copy_token.size()), n_recv = total(r.recv_copies);
  rows_received_ += n_recv;
  send_rows_.resize(size_t(n_send * d));
  for (int64_t c = 0; c < n_send; ++c) std::copy_n(x + int64_t(r.copy_token[c]) * d, d, send_rows_.data() + c * d);
  r.rows.resize(size_t(n_recv * d));
  const int64_t n_recv_sels = total(r.recv_sels);
  recv_meta_.resize(size_t(2 * n_recv_sels));
  recv_w_.resize(size_t(n_recv_sels));
  exchange(send_rows_.data(), r.send_copies, r.rows.data(), r.recv_copies, d);
  exchange(send_meta_.data(), r.send_sels, recv_meta_.data(), r.recv_sels, 2);
  exchange(send_w_.data(), r.send_sels, recv_w_.data(), r.recv_sels, 1);

  // Received selections name a copy within their sender's block: offset them into r.rows.
  sel_row_.resize(size_t(n_recv_sels));
  sel_expert_.resize(size_t(n_recv_sels));
  int64_t s = 0, row_base = 0;
  for (int src = 0; src < P; ++src) {
    for (int64_t i = 0; i < r.recv_sels[src]; ++i, ++s) {
      sel_row_[s] = int32_t(row_base + recv_meta_[2 * s]);
      sel_expert_[s] = recv_meta_[2 * s + 1];
    }
    row_base += r.recv_copies[src];
  }
  r.work.rows = r.rows.data();
  r.work.n_rows = n_recv;
  r.work.set_selections(sel_row_.data(), sel_expert_.data(), recv_w_.data(), n_recv_sels, shards_[ep_.rank()].count);
  recv_rows_.assign(size_t(n_recv * d), 0.f);
  ffn_experts_forward(r.work, p, recv_rows_.data(), ws_);

  // Results travel back along the same routes; each copy's partial sum joins its token's row.
  send_rows_.resize(size_t(n_send * d));
  exchange(recv_rows_.data(), r.recv_copies, send_rows_.data(), r.send_copies, d);
  for (int64_t c = 0; c < n_send; ++c) {
    float* row = y + int64_t(r.copy_token[c]) * d;
    const float* part = send_rows_.data() + c * d;
    for (int64_t i = 0; i < d; ++i) row[i] += part[i];
  }
}

void AllToAllDispatcher::backward(int64_t use, const float* dy, float* dx, float* dw, const ExpertParams<float>& p) {
  Route& r = routes_.at(use);
  const int64_t d = p.d;
  const int64_t n_send = int64_t(r.copy_token.size()), n_recv = r.work.n_rows;
  // Every read of dy happens here, before dx (possibly the same buffer) is written.
  send_rows_.resize(size_t(n_send * d));
  for (int64_t c = 0; c < n_send; ++c) std::copy_n(dy + int64_t(r.copy_token[c]) * d, d, send_rows_.data() + c * d);
  std::vector<float>& dout = recv_rows_;
  dout.resize(size_t(n_recv * d));
  exchange(send_rows_.data(), r.send_copies, dout.data(), r.recv_copies, d);

  din_.assign(size_t(n_recv * d), 0.f);
  dweight_.resize(size_t(r.work.up.size()));
  ffn_experts_backward(r.work, p, dout.data(), din_.data(), dweight_.data(), dhidden_, ws_);

  exchange(din_.data(), r.recv_copies, send_rows_.data(), r.send_copies, d);
  for (int64_t c = 0; c < n_send; ++c) {
    float* row = dx + int64_t(r.copy_token[c]) * d;
    const float* part = send_rows_.data() + c * d;
    for (int64_t i = 0; i < d; ++i) row[i] += part[i];
  }
  send_w_.resize(r.sel_origin.size());
  exchange(dweight_.data(), r.recv_sels, send_w_.data(), r.send_sels, 1);
  for (size_t s = 0; s < r.sel_origin.size(); ++s) dw[r.sel_origin[s]] = send_w_[s];
}

}  // namespace moeut
