#include "kernels/embedding.h"

#include <algorithm>

namespace moeut {

template <typename T>
void embedding_forward(T* out, const int32_t* tokens, const T* table, int64_t n, int64_t d) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) std::copy_n(table + int64_t(tokens[i]) * d, d, out + i * d);
}

template <typename T>
void embedding_backward(T* dtable, const T* dout, const int32_t* tokens, int64_t n, int64_t d) {
  for (int64_t i = 0; i < n; ++i) {
    T* row = dtable + int64_t(tokens[i]) * d;
    const T* g = dout + i * d;
    for (int64_t j = 0; j < d; ++j) row[j] += g[j];
  }
}

#define MOEUT_INSTANTIATE(T)                                                               \
  template void embedding_forward<T>(T*, const int32_t*, const T*, int64_t, int64_t);      \
  template void embedding_backward<T>(T*, const T*, const int32_t*, int64_t, int64_t);
MOEUT_INSTANTIATE(float)
MOEUT_INSTANTIATE(double)

}  // namespace moeut
