// Dense matrix product on the CPU, the one product every linear layer and expert kernel uses.
#pragma once
#include <cstdint>

namespace moeut {

// C = alpha * op(A) * op(B) + beta * C, all row-major; op(A) is [M, K], op(B) is [K, N].
// Every element of C is accumulated in the same order whatever the thread count, so results are
// reproducible bit for bit.
template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
          int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc);

}  // namespace moeut
