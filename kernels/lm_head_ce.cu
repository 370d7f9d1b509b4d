#include <algorithm>
#include <string>

#include "kernels/cross_entropy_cuda.h"
#include "kernels/cuda_check.h"
#include "kernels/lm_head_ce_cuda.h"

namespace moeut::cuda {
namespace {

// dbias[v] += Σ_r dlogits[r, v]: a thread per column and slice of kSumRows rows, added in
// atomically, so that enough loads are in flight.
constexpr int kSumRows = 256;
__global__ void column_sums(float* dbias, const __nv_bfloat16* dlogits, int64_t m, int V) {
  const int v = blockIdx.x * blockDim.x + threadIdx.x;
  if (v >= V) return;
  const int64_t r0 = int64_t(blockIdx.y) * kSumRows, r1 = r0 + kSumRows < m ? r0 + kSumRows : m;
  float s = 0.f;
  for (int64_t r = r0; r < r1; ++r) s += __bfloat162float(dlogits[r * V + v]);
  atomicAdd(dbias + v, s);
}

}  // namespace

LmHeadCE::LmHeadCE(cublasHandle_t cublas, int64_t V, int64_t d, int64_t chunk)
    : cublas_(cublas), V_(V), d_(d), chunk_(chunk), logits_(size_t(chunk * V)), dlogits_(size_t(chunk * V)) {}

void LmHeadCE::run(float* row_loss, float* dx, float* dW, float* dbias, const __nv_bfloat16* x, const __nv_bfloat16* W,
                   const __nv_bfloat16* bias, const int32_t* targets, int64_t n, float grad_scale, cudaStream_t stream) {
  check_cublas(cublasSetStream(cublas_, stream), "cublasSetStream");
  const float one = 1.f, zero = 0.f;
  for (int64_t r0 = 0; r0 < n; r0 += chunk_) {
    const int64_t m = std::min(chunk_, n - r0);
    // logits [m, V] (row-major) = x Wᵀ  <=>  column-major [V, m] = W(cm [d, V])ᵀ · x(cm [d, m]); the
    // cross-entropy adds the bias as it reads them.
    check_cublas(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, int(V_), int(m), int(d_), &one, W, CUDA_R_16BF, int(d_),
                              x + r0 * d_, CUDA_R_16BF, int(d_), &zero, logits_.get(), CUDA_R_32F, int(V_),
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "LM head logits");
    cross_entropy(row_loss + r0, dx ? dlogits_.get() : nullptr, logits_.get(), bias, targets + r0, m, V_, grad_scale,
                  stream);
    if (!dx) continue;
    // dx [m, d] = dlogits W  <=>  cm [d, m] = W(cm [d, V]) · dlogits(cm [V, m])
    check_cublas(cublasGemmEx(cublas_, CUBLAS_OP_N, CUBLAS_OP_N, int(d_), int(m), int(V_), &one, W, CUDA_R_16BF, int(d_),
                              dlogits_.get(), CUDA_R_16BF, int(V_), &zero, dx + r0 * d_, CUDA_R_32F, int(d_),
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "LM head input gradient");
    // dW [V, d] += dlogitsᵀ x  <=>  cm [d, V] += x(cm [d, m]) · dlogits(cm [V, m])ᵀ
    check_cublas(cublasGemmEx(cublas_, CUBLAS_OP_N, CUBLAS_OP_T, int(d_), int(V_), int(m), &one, x + r0 * d_, CUDA_R_16BF,
                              int(d_), dlogits_.get(), CUDA_R_16BF, int(V_), &one, dW, CUDA_R_32F, int(d_),
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "LM head weight gradient");
    column_sums<<<dim3(unsigned((V_ + 255) / 256), unsigned((m + kSumRows - 1) / kSumRows)), 256, 0, stream>>>(
        dbias, dlogits_.get(), m, int(V_));
    MOEUT_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace moeut::cuda
