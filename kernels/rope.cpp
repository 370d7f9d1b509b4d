#include "kernels/rope.h"

#include <cmath>

namespace moeut {
namespace {

template <typename T>
void rotate(T* x, int64_t B, int64_t T_len, int64_t H, int64_t dh, int64_t n_rot, double base,
            double direction) {
  const int64_t half = n_rot / 2;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T_len; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const double angle = double(t) * std::pow(base, -2.0 * double(i) / double(n_rot));
      const T c = T(std::cos(angle)), s = T(direction * std::sin(angle));
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h) {
          T* u = x + ((b * T_len + t) * H + h) * dh;
          const T lo = u[i], hi = u[i + half];
          u[i] = lo * c - hi * s;
          u[i + half] = hi * c + lo * s;
        }
    }
  }
}

}  // namespace

template <typename T>
void rope_forward(T* x, int64_t B, int64_t T_len, int64_t H, int64_t dh, int64_t n_rot,
                  double base) {
  rotate(x, B, T_len, H, dh, n_rot, base, +1.0);
}

template <typename T>
void rope_backward(T* dx, int64_t B, int64_t T_len, int64_t H, int64_t dh, int64_t n_rot,
                   double base) {
  rotate(dx, B, T_len, H, dh, n_rot, base, -1.0);
}

#define MOEUT_INSTANTIATE(T)                                                                  \
  template void rope_forward<T>(T*, int64_t, int64_t, int64_t, int64_t, int64_t, double);      \
  template void rope_backward<T>(T*, int64_t, int64_t, int64_t, int64_t, int64_t, double);
MOEUT_INSTANTIATE(float)
MOEUT_INSTANTIATE(double)

}  // namespace moeut
