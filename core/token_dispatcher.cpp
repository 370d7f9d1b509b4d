#include "core/token_dispatcher.h"

namespace moeut {

template <typename T>
void LocalDispatcher<T>::forward(int64_t use, const T* x, const int32_t* I, const T* w, int64_t n, int64_t k,
                                 const ExpertParams<T>& p, T* y) {
  if (int64_t(work_.size()) <= use) work_.resize(size_t(use + 1));
  ExpertWork<T>& work = work_[use];
  work.rows = x;
  work.n_rows = n;
  rows_received_ += n;
  rows_.resize(size_t(n * k));
  for (int64_t s = 0; s < n * k; ++s) rows_[s] = int32_t(s / k);
  work.set_selections(rows_.data(), I, w, n * k, n_experts_);
  ffn_experts_forward(work, p, y, ws_);
}

template <typename T>
void LocalDispatcher<T>::backward(int64_t use, const T* dy, T* dx, T* dw, const ExpertParams<T>& p) {
  ffn_experts_backward(work_.at(use), p, dy, dx, dw, dhidden_, ws_);
}

template class LocalDispatcher<float>;
template class LocalDispatcher<double>;

}  // namespace moeut
