#include "kernels/relu.h"

namespace moeut {

template <typename T>
void relu_forward(T* x, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] > T(0) ? x[i] : T(0);
}

template <typename T>
void relu_backward(T* dx, const T* dout, const T* out, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) dx[i] = out[i] > T(0) ? dout[i] : T(0);
}

template void relu_forward<float>(float*, int64_t);
template void relu_forward<double>(double*, int64_t);
template void relu_backward<float>(float*, const float*, const float*, int64_t);
template void relu_backward<double>(double*, const double*, const double*, int64_t);

}  // namespace moeut
