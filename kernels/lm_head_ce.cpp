#include "kernels/lm_head_ce.h"

#include <algorithm>
#include <cmath>

#include "kernels/gemm.h"

namespace moeut {

template <typename T>
void lm_head_logits(T* logits, const T* x, const T* W, const T* bias, int64_t n, int64_t d, int64_t V) {
  for (int64_t r = 0; r < n; ++r) std::copy_n(bias, V, logits + r * V);
  gemm(false, true, n, V, d, T(1), x, d, W, d, T(1), logits, V);
}

template <typename T>
double lm_head_ce(T* dx, T* dW, T* dbias, double* row_loss, const T* x, const T* W,
                  const T* bias, const int32_t* targets, int64_t n, int64_t d, int64_t V,
                  T grad_scale, std::vector<T>& scratch) {
  constexpr int64_t kChunk = 256;
  scratch.resize(size_t(std::min(n, kChunk) * V));
  double total = 0;
  for (int64_t r0 = 0; r0 < n; r0 += kChunk) {
    const int64_t m = std::min(kChunk, n - r0);
    T* logits = scratch.data();
    lm_head_logits(logits, x + r0 * d, W, bias, m, d, V);
    std::vector<double> losses(static_cast<size_t>(m));
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < m; ++r) {
      T* z = logits + r * V;
      const T mx = *std::max_element(z, z + V);
      double sum = 0;
      for (int64_t v = 0; v < V; ++v) sum += std::exp(double(z[v] - mx));
      const double lse = double(mx) + std::log(sum);
      losses[r] = lse - double(z[targets[r0 + r]]);
      if (dx) {  // logits become their gradient: grad_scale * (softmax - onehot)
        for (int64_t v = 0; v < V; ++v) z[v] = T(grad_scale * std::exp(double(z[v]) - lse));
        z[targets[r0 + r]] -= grad_scale;
      }
    }
    for (int64_t r = 0; r < m; ++r) {
      total += losses[r];
      if (row_loss) row_loss[r0 + r] = losses[r];
    }
    if (!dx) continue;
    gemm(false, false, m, d, V, T(1), logits, V, W, d, T(1), dx + r0 * d, d);
    gemm(true, false, V, d, m, T(1), logits, V, x + r0 * d, d, T(1), dW, d);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t v = 0; v < V; ++v) dbias[v] += logits[r * V + v];
  }
  return total;
}

template void lm_head_logits<float>(float*, const float*, const float*, const float*, int64_t, int64_t, int64_t);
template void lm_head_logits<double>(double*, const double*, const double*, const double*, int64_t, int64_t,
                                     int64_t);
template double lm_head_ce<float>(float*, float*, float*, double*, const float*, const float*,
                                  const float*, const int32_t*, int64_t, int64_t, int64_t, float,
                                  std::vector<float>&);
template double lm_head_ce<double>(double*, double*, double*, double*, const double*,
                                   const double*, const double*, const int32_t*, int64_t, int64_t,
                                   int64_t, double, std::vector<double>&);

}  // namespace moeut
