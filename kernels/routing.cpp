#include "kernels/routing.h"

#include <algorithm>
#include <cmath>

namespace moeut {

template <typename T>
void topk_sigmoid_forward(int32_t* index, T* weight, const T* logits, int64_t n, int64_t groups,
                          int64_t E, int64_t k) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n * groups; ++r) {
    const T* z = logits + r * E;
    int32_t* idx = index + r * k;
    // Insertion into a sorted list of k: k is small (2..24) and sigmoid is monotone, so the
    // logits themselves are compared.
    int64_t filled = 0;
    for (int64_t e = 0; e < E; ++e) {
      int64_t pos = filled;
      while (pos > 0 && z[idx[pos - 1]] < z[e]) --pos;
      if (pos >= k) continue;
      for (int64_t q = std::min(filled, k - 1); q > pos; --q) idx[q] = idx[q - 1];
      idx[pos] = int32_t(e);
      if (filled < k) ++filled;
    }
    for (int64_t j = 0; j < k; ++j) weight[r * k + j] = T(1) / (T(1) + std::exp(-z[idx[j]]));
  }
}

template <typename T>
void topk_sigmoid_backward(T* dlogits, const T* dweight, const int32_t* index, const T* weight,
                           int64_t n, int64_t groups, int64_t E, int64_t k) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n * groups; ++r)
    for (int64_t j = 0; j < k; ++j) {
      const T w = weight[r * k + j];
      dlogits[r * E + index[r * k + j]] += dweight[r * k + j] * w * (T(1) - w);
    }
}

#define MOEUT_INSTANTIATE(T)                                                                  \
  template void topk_sigmoid_forward<T>(int32_t*, T*, const T*, int64_t, int64_t, int64_t,     \
                                        int64_t);                                              \
  template void topk_sigmoid_backward<T>(T*, const T*, const int32_t*, const T*, int64_t,      \
                                         int64_t, int64_t, int64_t);
MOEUT_INSTANTIATE(float)
MOEUT_INSTANTIATE(double)

}  // namespace moeut
