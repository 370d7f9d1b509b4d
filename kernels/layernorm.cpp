#include "kernels/layernorm.h"

#include <cmath>

namespace moeut {

template <typename T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* x, const T* weight, const T* bias,
                       int64_t n, int64_t d) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const T* xi = x + i * d;
    double sum = 0;
    for (int64_t j = 0; j < d; ++j) sum += xi[j];
    const double mu = sum / d;
    double var = 0;
    for (int64_t j = 0; j < d; ++j) var += (xi[j] - mu) * (xi[j] - mu);
    const double rs = 1.0 / std::sqrt(var / d + kLayerNormEps);
    mean[i] = T(mu);
    rstd[i] = T(rs);
    T* oi = out + i * d;
    for (int64_t j = 0; j < d; ++j) oi[j] = T((xi[j] - mu) * rs) * weight[j] + bias[j];
  }
}

template <typename T>
void layernorm_backward(T* dx, T* dweight, T* dbias, const T* dout, const T* x, const T* weight,
                        const T* mean, const T* rstd, int64_t n, int64_t d) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const T* xi = x + i * d;
    const T* gi = dout + i * d;
    // With xhat = (x - mean) * rstd and g = dout * weight:
    // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).
    double g_mean = 0, gx_mean = 0;
    for (int64_t j = 0; j < d; ++j) {
      const double g = double(gi[j]) * weight[j];
      g_mean += g;
      gx_mean += g * (xi[j] - mean[i]) * rstd[i];
    }
    g_mean /= d;
    gx_mean /= d;
    T* dxi = dx + i * d;
    for (int64_t j = 0; j < d; ++j) {
      const double xhat = (double(xi[j]) - mean[i]) * rstd[i];
      dxi[j] += T(rstd[i] * (double(gi[j]) * weight[j] - g_mean - xhat * gx_mean));
    }
  }
  // Parameter gradients sum over rows: done row by row so the order is fixed.
  for (int64_t i = 0; i < n; ++i) {
    const T* xi = x + i * d;
    const T* gi = dout + i * d;
    for (int64_t j = 0; j < d; ++j) {
      dweight[j] += gi[j] * ((xi[j] - mean[i]) * rstd[i]);
      dbias[j] += gi[j];
    }
  }
}

#define MOEUT_INSTANTIATE(T)                                                                  \
  template void layernorm_forward<T>(T*, T*, T*, const T*, const T*, const T*, int64_t,        \
                                     int64_t);                                                 \
  template void layernorm_backward<T>(T*, T*, T*, const T*, const T*, const T*, const T*,      \
                                      const T*, int64_t, int64_t);
MOEUT_INSTANTIATE(float)
MOEUT_INSTANTIATE(double)

}  // namespace moeut
