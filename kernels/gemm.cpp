#include "kernels/gemm.h"

#include <algorithm>
#include <vector>

namespace moeut {
namespace {

// Tile sizes: a [kBlockK x kBlockN] block of B (128 KiB in fp32) stays in L2 while kRowTile rows
// of A stream past it; the C row segment being updated stays in L1.
constexpr int64_t kBlockK = 128;
constexpr int64_t kBlockN = 256;
constexpr int64_t kRowTile = 32;

// Row-major copy of the transpose of src ([rows, cols] with leading dimension ld).
template <typename T>
const T* transposed(const T* src, int64_t rows, int64_t cols, int64_t ld, std::vector<T>& buf) {
  buf.resize(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) buf[c * rows + r] = src[r * ld + c];
  return buf.data();
}

}  // namespace

template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
          int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  // Transposed operands are packed once (O(MK + KN) copies against O(MNK) work), so a single
  // cache-blocked kernel serves all four cases.
  thread_local std::vector<T> a_buf, b_buf;
  if (trans_a) { A = transposed(A, K, M, lda, a_buf); lda = K; }
  if (trans_b) { B = transposed(B, N, K, ldb, b_buf); ldb = N; }

  const int64_t row_tiles = (M + kRowTile - 1) / kRowTile;
#pragma omp parallel for schedule(static)
  for (int64_t tile = 0; tile < row_tiles; ++tile) {
    const int64_t i_begin = tile * kRowTile, i_end = std::min(M, i_begin + kRowTile);
    for (int64_t i = i_begin; i < i_end; ++i) {
      T* c = C + i * ldc;
      if (beta == T(0)) std::fill(c, c + N, T(0));
      else if (beta != T(1)) for (int64_t j = 0; j < N; ++j) c[j] *= beta;
    }
    for (int64_t j0 = 0; j0 < N; j0 += kBlockN) {
      const int64_t nb = std::min(kBlockN, N - j0);
      for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
        const int64_t kb = std::min(kBlockK, K - k0);
        for (int64_t i = i_begin; i < i_end; ++i) {
          T* __restrict c = C + i * ldc + j0;
          const T* a = A + i * lda + k0;
          for (int64_t k = 0; k < kb; ++k) {
            const T s = alpha * a[k];
            const T* __restrict b = B + (k0 + k) * ldb + j0;
            for (int64_t j = 0; j < nb; ++j) c[j] += s * b[j];
          }
        }
      }
    }
  }
}

template void gemm<float>(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t,
                          const float*, int64_t, float, float*, int64_t);
template void gemm<double>(bool, bool, int64_t, int64_t, int64_t, double, const double*, int64_t,
                           const double*, int64_t, double, double*, int64_t);

}  // namespace moeut
