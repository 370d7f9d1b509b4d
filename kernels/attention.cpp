#include "kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace moeut {

template <typename T>
void attention_forward(T* out, T* probs, const T* q, const T* k, const T* v, int64_t B,
                       int64_t T_len, int64_t H, int64_t dh) {
  const int64_t row = H * dh;  // stride between consecutive tokens of one head
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t base = b * T_len * row + h * dh;
      T* P = probs + (b * H + h) * T_len * T_len;
      for (int64_t i = 0; i < T_len; ++i) {
        const T* qi = q + base + i * row;
        T* p = P + i * T_len;
        T max_score = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          const T* kj = k + base + j * row;
          T s = 0;
          for (int64_t c = 0; c < dh; ++c) s += qi[c] * kj[c];
          p[j] = s;
          max_score = std::max(max_score, s);
        }
        T sum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += (p[j] = std::exp(p[j] - max_score));
        const T inv = T(1) / sum;
        for (int64_t j = 0; j <= i; ++j) p[j] *= inv;
        std::fill(p + i + 1, p + T_len, T(0));
        T* oi = out + base + i * row;
        std::fill(oi, oi + dh, T(0));
        for (int64_t j = 0; j <= i; ++j) {
          const T* vj = v + base + j * row;
          for (int64_t c = 0; c < dh; ++c) oi[c] += p[j] * vj[c];
        }
      }
    }
}

template <typename T>
void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* probs, const T* q,
                        const T* k, const T* v, int64_t B, int64_t T_len, int64_t H, int64_t dh) {
  const int64_t row = H * dh;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t base = b * T_len * row + h * dh;
      const T* P = probs + (b * H + h) * T_len * T_len;
      for (int64_t i = 0; i < T_len; ++i) {
        std::fill(dq + base + i * row, dq + base + i * row + dh, T(0));
        std::fill(dk + base + i * row, dk + base + i * row + dh, T(0));
        std::fill(dv + base + i * row, dv + base + i * row + dh, T(0));
      }
      std::vector<T> dp(static_cast<size_t>(T_len));
      for (int64_t i = 0; i < T_len; ++i) {
        const T* p = P + i * T_len;
        const T* gi = dout + base + i * row;
        // dP_ij = dout_i . v_j ; dv_j += P_ij dout_i
        T dot = 0;  // sum_j P_ij dP_ij, for the softmax backward
        for (int64_t j = 0; j <= i; ++j) {
          const T* vj = v + base + j * row;
          T* dvj = dv + base + j * row;
          T s = 0;
          for (int64_t c = 0; c < dh; ++c) {
            s += gi[c] * vj[c];
            dvj[c] += p[j] * gi[c];
          }
          dp[j] = s;
          dot += p[j] * s;
        }
        // dS_ij = P_ij (dP_ij - dot); dq_i += dS_ij k_j; dk_j += dS_ij q_i
        const T* qi = q + base + i * row;
        T* dqi = dq + base + i * row;
        for (int64_t j = 0; j <= i; ++j) {
          const T ds = p[j] * (dp[j] - dot);
          const T* kj = k + base + j * row;
          T* dkj = dk + base + j * row;
          for (int64_t c = 0; c < dh; ++c) {
            dqi[c] += ds * kj[c];
            dkj[c] += ds * qi[c];
          }
        }
      }
    }
}

#define MOEUT_INSTANTIATE(T)                                                                   \
  template void attention_forward<T>(T*, T*, const T*, const T*, const T*, int64_t, int64_t,    \
                                     int64_t, int64_t);                                         \
  template void attention_backward<T>(T*, T*, T*, const T*, const T*, const T*, const T*,       \
                                      const T*, int64_t, int64_t, int64_t, int64_t);
MOEUT_INSTANTIATE(float)
MOEUT_INSTANTIATE(double)

}  // namespace moeut
