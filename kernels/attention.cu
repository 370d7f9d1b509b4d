#include <stdexcept>
#include <string>

#include "kernels/attention_cuda.h"
#include "kernels/cuda_check.h"

namespace moeut::cuda {
namespace {

using bf16 = __nv_bfloat16;

// Column-major product per head, batched over the H heads of one sequence:
// C_h = op(A_h) · op(B_h), with A_h, B_h, C_h at strides sa, sb, sc from a, b, c.
void batched(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k,
             const void* a, cudaDataType at, int64_t lda, int64_t sa, const void* b, int64_t ldb, int64_t sb, void* c,
             cudaDataType ct, int64_t ldc, int64_t sc, int64_t batch) {
  const float one = 1.f, zero = 0.f;
  check_cublas(cublasGemmStridedBatchedEx(h, ta, tb, int(m), int(n), int(k), &one, a, at, int(lda), sa, b, CUDA_R_16BF,
                                          int(ldb), sb, &zero, c, ct, int(ldc), sc, int(batch), CUBLAS_COMPUTE_32F,
                                          CUBLAS_GEMM_DEFAULT),
               "attention product");
}

// One warp per score row i: P[i, j] = softmax over j <= i of S[i, :], zero above the diagonal.
__global__ void causal_softmax(bf16* P, const float* S, int64_t rows, int T) {
  const int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const int i = int(r % T);
  const float* s = S + r * T;
  float mx = -INFINITY;
  for (int j = lane; j <= i; j += 32) mx = fmaxf(mx, s[j]);
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float sum = 0.f;
  for (int j = lane; j <= i; j += 32) sum += __expf(s[j] - mx);
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  const float inv = 1.f / sum;
  for (int j = lane; j < T; j += 32) P[r * T + j] = __float2bfloat16(j <= i ? __expf(s[j] - mx) * inv : 0.f);
}

// dS[i, j] = P[i, j] (dP[i, j] - Σ_j' P[i, j'] dP[i, j']), written over P.
__global__ void causal_softmax_backward(bf16* P_then_dS, const float* dP, int64_t rows, int T) {
  const int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const int i = int(r % T);
  bf16* p = P_then_dS + r * T;
  const float* dp = dP + r * T;
  float dot = 0.f;
  for (int j = lane; j <= i; j += 32) dot += __bfloat162float(p[j]) * dp[j];
  for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
  for (int j = lane; j <= i; j += 32) p[j] = __float2bfloat16(__bfloat162float(p[j]) * (dp[j] - dot));
}

}  // namespace

CausalAttention::CausalAttention(cublasHandle_t cublas, int64_t B, int64_t T, int64_t H, int64_t dh)
    : cublas_(cublas), capacity_(B), B_(B), T_(T), H_(H), dh_(dh), scores_(size_t(B * H * T * T)),
      probs_(size_t(B * H * T * T)) {}

void CausalAttention::set_batch(int64_t B) {
  if (B < 0 || B > capacity_)
    throw std::invalid_argument("CausalAttention: batch " + std::to_string(B) + " exceeds the planned " + std::to_string(capacity_));
  B_ = B;
}

// Row-major [T, dh] head matrices with row stride H·dh are column-major [dh, T] with ld H·dh;
// a row-major [T, T] score matrix is the column-major transpose. Hence the operand order below.
void CausalAttention::scores_and_probs(const bf16* q, const bf16* k, cudaStream_t stream) {
  check_cublas(cublasSetStream(cublas_, stream), "cublasSetStream");
  if (B_ == 0) return;
  const int64_t ld = H_ * dh_, seq = T_ * ld, tt = T_ * T_;
  for (int64_t b = 0; b < B_; ++b)  // S = Q Kᵀ  <=>  Sᵀ(cm) = Kᵀ(cm)ᵀ · Qᵀ(cm)
    batched(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, T_, T_, dh_, k + b * seq, CUDA_R_16BF, ld, dh_, q + b * seq, ld, dh_,
            scores_.get() + b * H_ * tt, CUDA_R_32F, T_, tt, H_);
  const int64_t rows = B_ * H_ * T_;
  causal_softmax<<<unsigned((rows + 7) / 8), 256, 0, stream>>>(probs_.get(), scores_.get(), rows, int(T_));
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

void CausalAttention::forward(bf16* out, const bf16* q, const bf16* k, const bf16* v, cudaStream_t stream) {
  scores_and_probs(q, k, stream);
  const int64_t ld = H_ * dh_, seq = T_ * ld, tt = T_ * T_;
  for (int64_t b = 0; b < B_; ++b)  // O = P V  <=>  Oᵀ(cm) = Vᵀ(cm) · Pᵀ(cm)
    batched(cublas_, CUBLAS_OP_N, CUBLAS_OP_N, dh_, T_, T_, v + b * seq, CUDA_R_16BF, ld, dh_,
            probs_.get() + b * H_ * tt, T_, tt, out + b * seq, CUDA_R_16BF, ld, dh_, H_);
}

void CausalAttention::backward(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q, const bf16* k,
                               const bf16* v, cudaStream_t stream) {
  scores_and_probs(q, k, stream);
  const int64_t ld = H_ * dh_, seq = T_ * ld, tt = T_ * T_;
  float* dP = scores_.get();
  for (int64_t b = 0; b < B_; ++b) {
    // dP = dO Vᵀ (as S); dV = Pᵀ dO  <=>  dVᵀ(cm) = dOᵀ(cm) · P(cm)
    batched(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, T_, T_, dh_, v + b * seq, CUDA_R_16BF, ld, dh_, dout + b * seq, ld, dh_,
            dP + b * H_ * tt, CUDA_R_32F, T_, tt, H_);
    batched(cublas_, CUBLAS_OP_N, CUBLAS_OP_T, dh_, T_, T_, dout + b * seq, CUDA_R_16BF, ld, dh_,
            probs_.get() + b * H_ * tt, T_, tt, dv + b * seq, CUDA_R_16BF, ld, dh_, H_);
  }
  const int64_t rows = B_ * H_ * T_;
  if (rows == 0) return;
  causal_softmax_backward<<<unsigned((rows + 7) / 8), 256, 0, stream>>>(probs_.get(), dP, rows, int(T_));
  MOEUT_CUDA_CHECK(cudaGetLastError());
  const bf16* dS = probs_.get();
  for (int64_t b = 0; b < B_; ++b) {
    // dQ = dS K  <=>  dQᵀ(cm) = Kᵀ(cm) · dSᵀ(cm);  dK = dSᵀ Q  <=>  dKᵀ(cm) = Qᵀ(cm) · dS(cm)
    batched(cublas_, CUBLAS_OP_N, CUBLAS_OP_N, dh_, T_, T_, k + b * seq, CUDA_R_16BF, ld, dh_, dS + b * H_ * tt, T_, tt,
            dq + b * seq, CUDA_R_16BF, ld, dh_, H_);
    batched(cublas_, CUBLAS_OP_N, CUBLAS_OP_T, dh_, T_, T_, q + b * seq, CUDA_R_16BF, ld, dh_, dS + b * H_ * tt, T_, tt,
            dk + b * seq, CUDA_R_16BF, ld, dh_, H_);
  }
}

}  // namespace moeut::cuda
