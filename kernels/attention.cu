// CausalAttention (see attention_cuda.h): which implementation runs when, and the cuBLAS one.
// Head sizes up to 128: flash-style kernels, forward and backward, with no scores in memory; head
// sizes 97..128 on wgmma when tensor copies can take the rows (attention_flash_wgmma.cu), others
// on mma.sync (attention_flash_mma.cu). Above 128: per (sequence, head), cuBLAS products for the
// scores and the weighted sum with a fused causal softmax between them, one layer's scores in a
// workspace, recomputed by the backward pass (here).
#include <algorithm>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "kernels/attention_cuda.h"
#include "kernels/attention_device.cuh"
#include "kernels/cast_cuda.h"
#include "kernels/cuda_check.h"
#include "kernels/with_ceiling.h"
#include "kernels/lane_reduce.cuh"

namespace moeut::cuda {
namespace {

// Column-major product per head, batched over the H heads of one sequence:
// C_h = op(A_h) · op(B_h), with A_h, B_h, C_h at strides sa, sb, sc from a, b, c.
void batched(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k,
             const void* a, cudaDataType at, int64_t lda, int64_t sa, const void* b, int64_t ldb, int64_t sb, void* c,
             cudaDataType ct, int64_t ldc, int64_t sc, int64_t batch, float alpha = 1.f) {
  const float zero = 0.f;
  check_cublas(cublasGemmStridedBatchedEx(h, ta, tb, int(m), int(n), int(k), &alpha, a, at, int(lda), sa, b, CUDA_R_16BF,
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
  mx = warp_max(mx);
  float sum = 0.f;
  for (int j = lane; j <= i; j += 32) sum += __expf(s[j] - mx);
  const float inv = 1.f / warp_sum(sum);
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
  dot = warp_sum(dot);
  for (int j = lane; j <= i; j += 32) p[j] = __float2bfloat16(__bfloat162float(p[j]) * (dp[j] - dot));
}

// ---- Flash-style backward ----
// dO in bf16 from its fp32 values, and D[bh, t] = Σ_d dO[t, d] · O[t, d] (the row term of the
// softmax gradient, over the rounded dO that the flash backward reads) in the same pass. One warp
// per row; four columns at a time when `quads` (dh and H·dh multiples of 4).
__global__ void output_grad_rows(float* D, bf16* dout, const float* dout_f32, const bf16* out, int64_t rows, int T,
                                 int H, int dh, bool quads) {
  const int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (r >= rows) return;
  const int64_t bh = r / T, t = r % T, b = bh / H, h = bh % H;
  const int64_t at = (b * T + t) * int64_t(H) * dh + h * dh;
  float sum = 0.f;
  if (quads) {
    for (int d = 4 * (threadIdx.x % 32); d < dh; d += 128) {
      const float4 g = *reinterpret_cast<const float4*>(dout_f32 + at + d);
      const __nv_bfloat162 lo = __floats2bfloat162_rn(g.x, g.y), hi = __floats2bfloat162_rn(g.z, g.w);
      __nv_bfloat162* to = reinterpret_cast<__nv_bfloat162*>(dout + at + d);
      to[0] = lo, to[1] = hi;
      const __nv_bfloat162* o = reinterpret_cast<const __nv_bfloat162*>(out + at + d);
      const float2 glo = __bfloat1622float2(lo), ghi = __bfloat1622float2(hi);
      const float2 olo = __bfloat1622float2(o[0]), ohi = __bfloat1622float2(o[1]);
      sum += glo.x * olo.x + glo.y * olo.y + ghi.x * ohi.x + ghi.y * ohi.y;
    }
  } else {
    for (int d = threadIdx.x % 32; d < dh; d += 32) {
      const bf16 g = __float2bfloat16(dout_f32[at + d]);
      dout[at + d] = g;
      sum += __bfloat162float(g) * __bfloat162float(out[at + d]);
    }
  }
  sum = warp_sum(sum);
  if (threadIdx.x % 32 == 0) D[r] = sum;
}

// dq (bf16, rows grad_ld apart, times scale) from its fp32 accumulator [rows, hd]: blocks over
// the rows, threads over a row's columns, four at a time when `quads` (hd and grad_ld multiples of
// 4, dq 8-byte aligned).
__global__ void flash_dq_to_bf16(bf16* dq, const float* acc, int64_t rows, int hd, int64_t grad_ld, float scale,
                                 bool quads) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* a = acc + r * hd;
    bf16* o = dq + r * grad_ld;
    if (quads) {
      for (int c = 4 * threadIdx.x; c < hd; c += 4 * blockDim.x) {
        const float4 v = *reinterpret_cast<const float4*>(a + c);
        __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(o + c);
        out[0] = __floats2bfloat162_rn(scale * v.x, scale * v.y);
        out[1] = __floats2bfloat162_rn(scale * v.z, scale * v.w);
      }
    } else {
      for (int c = threadIdx.x; c < hd; c += blockDim.x) o[c] = __float2bfloat16(scale * a[c]);
    }
  }
}

// Whether tensor copies can take the heads' rows: dh, the rows' strides and every tensor's start
// in whole 16 bytes (the rows of v, dout and out are H·dh apart).
bool head_rows_by_tensor_copies(int64_t dh, int64_t qk_ld, std::initializer_list<const bf16*> tensors) {
  return dh % 8 == 0 && qk_ld % 8 == 0 &&
         std::all_of(tensors.begin(), tensors.end(),
                     [](const bf16* x) { return reinterpret_cast<uintptr_t>(x) % 16 == 0; });
}

template <int kD>
void launch_flash_forward(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int64_t B, int64_t T,
                          int64_t H, int64_t dh, int64_t qk_ld, cudaStream_t stream) {
  if (kD == 128 && head_rows_by_tensor_copies(dh, qk_ld, {q, k, v, out}))
    launch_flash_forward_wgmma(out, lse, q, k, v, B, T, H, dh, qk_ld, stream);
  else
    launch_flash_forward_mma<kD>(out, lse, q, k, v, B, T, H, dh, qk_ld, stream);
}

template <int kD>
void launch_flash_backward(bf16* dk, bf16* dv, float* dq_acc, const bf16* dout, const float* lse, const float* D,
                           const bf16* q, const bf16* k, const bf16* v, int64_t B, int64_t T, int64_t H, int64_t dh,
                           int64_t grad_ld, float grad_scale, int64_t qk_ld, cudaStream_t stream) {
  if (kD == 128 && head_rows_by_tensor_copies(dh, qk_ld, {q, k, v, dout}))
    launch_flash_backward_wgmma(dk, dv, dq_acc, dout, lse, D, q, k, v, B, T, H, dh, grad_ld, grad_scale, qk_ld, stream);
  else
    launch_flash_backward_mma<kD>(dk, dv, dq_acc, dout, lse, D, q, k, v, B, T, H, dh, grad_ld, grad_scale, qk_ld,
                                  stream);
}

}  // namespace

CausalAttention::CausalAttention(cublasHandle_t cublas, int64_t B, int64_t T, int64_t H, int64_t dh)
    : cublas_(cublas), capacity_(B), B_(B), T_(T), H_(H), dh_(dh) {
  dout_ = DeviceBuffer<bf16>(size_t(B * T * H * dh));
  if (flash()) {
    row_dots_ = DeviceBuffer<float>(size_t(B * H * T));
    dq_acc_ = DeviceBuffer<float>(size_t(B * T * H * dh));
  } else {
    scores_ = DeviceBuffer<float>(size_t(B * H * T * T));
    probs_ = DeviceBuffer<bf16>(size_t(B * H * T * T));
  }
}

void CausalAttention::set_batch(int64_t B) {
  if (B < 0 || B > capacity_)
    throw std::invalid_argument("CausalAttention: batch " + std::to_string(B) + " exceeds the planned " + std::to_string(capacity_));
  B_ = B;
}

// Row-major [T, dh] head matrices with row stride H·dh (qk_ld for q and k) are column-major
// [dh, T] with that ld; a row-major [T, T] score matrix is the column-major transpose. Hence the
// operand order below.
void CausalAttention::scores_and_probs(const bf16* q, const bf16* k, int64_t qk_ld, cudaStream_t stream) {
  check_cublas(cublasSetStream(cublas_, stream), "cublasSetStream");
  if (B_ == 0) return;
  const int64_t qk_seq = T_ * qk_ld, tt = T_ * T_;
  for (int64_t b = 0; b < B_; ++b)  // S = Q Kᵀ  <=>  Sᵀ(cm) = Kᵀ(cm)ᵀ · Qᵀ(cm)
    batched(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, T_, T_, dh_, k + b * qk_seq, CUDA_R_16BF, qk_ld, dh_, q + b * qk_seq,
            qk_ld, dh_, scores_.get() + b * H_ * tt, CUDA_R_32F, T_, tt, H_);
  const int64_t rows = B_ * H_ * T_;
  causal_softmax<<<unsigned((rows + 7) / 8), 256, 0, stream>>>(probs_.get(), scores_.get(), rows, int(T_));
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

int64_t CausalAttention::row_stride(int64_t ld, const char* rows) const {
  if (ld == 0) return H_ * dh_;
  if (ld < H_ * dh_)
    throw std::invalid_argument(std::string("CausalAttention: ") + rows + " rows narrower than the heads");
  return ld;
}

void CausalAttention::forward(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, cudaStream_t stream,
                              int64_t qk_ld) {
  if (B_ == 0) return;
  qk_ld = row_stride(qk_ld, "q and k");
  if (flash()) {
    with_ceiling<32, 64, 96, 128>(dh_, [&](auto kD) {
      launch_flash_forward<kD>(out, lse, q, k, v, B_, T_, H_, dh_, qk_ld, stream);
    });
    return;
  }
  scores_and_probs(q, k, qk_ld, stream);
  const int64_t ld = H_ * dh_, seq = T_ * ld, tt = T_ * T_;
  for (int64_t b = 0; b < B_; ++b)  // O = P V  <=>  Oᵀ(cm) = Vᵀ(cm) · Pᵀ(cm)
    batched(cublas_, CUBLAS_OP_N, CUBLAS_OP_N, dh_, T_, T_, v + b * seq, CUDA_R_16BF, ld, dh_,
            probs_.get() + b * H_ * tt, T_, tt, out + b * seq, CUDA_R_16BF, ld, dh_, H_);
}

void CausalAttention::backward(bf16* dq, bf16* dk, bf16* dv, const float* dout, const bf16* out, const float* lse,
                               const bf16* q, const bf16* k, const bf16* v, cudaStream_t stream, int64_t grad_ld,
                               float grad_scale, int64_t qk_ld) {
  if (B_ == 0) return;
  qk_ld = row_stride(qk_ld, "q and k");
  grad_ld = row_stride(grad_ld, "gradient");
  if (flash()) {
    const int64_t rows = B_ * H_ * T_, n = B_ * T_ * H_ * dh_;
    const bool dout_quads = dh_ % 4 == 0 && reinterpret_cast<uintptr_t>(dout) % 16 == 0 &&
                            reinterpret_cast<uintptr_t>(out) % 8 == 0;
    output_grad_rows<<<unsigned((rows + 7) / 8), 256, 0, stream>>>(row_dots_.get(), dout_.get(), dout, out, rows,
                                                                   int(T_), int(H_), int(dh_), dout_quads);
    MOEUT_CUDA_CHECK(cudaGetLastError());
    MOEUT_CUDA_CHECK(cudaMemsetAsync(dq_acc_.get(), 0, size_t(n) * sizeof(float), stream));
    with_ceiling<32, 64, 96, 128>(dh_, [&](auto kD) {
      launch_flash_backward<kD>(dk, dv, dq_acc_.get(), dout_.get(), lse, row_dots_.get(), q, k, v, B_, T_, H_, dh_,
                                grad_ld, grad_scale, qk_ld, stream);
    });
    const int64_t tokens = B_ * T_, hd = H_ * dh_;
    const bool quads = hd % 4 == 0 && grad_ld % 4 == 0 && reinterpret_cast<uintptr_t>(dq) % 8 == 0;
    flash_dq_to_bf16<<<unsigned(std::min<int64_t>(tokens, 1 << 16)), 128, 0, stream>>>(dq, dq_acc_.get(), tokens, int(hd),
                                                                                       grad_ld, grad_scale, quads);
    MOEUT_CUDA_CHECK(cudaGetLastError());
    return;
  }
  scores_and_probs(q, k, qk_ld, stream);
  const int64_t ld = H_ * dh_, seq = T_ * ld, qk_seq = T_ * qk_ld, tt = T_ * T_;
  to_bf16(dout_.get(), dout, B_ * seq, stream);
  float* dP = scores_.get();
  for (int64_t b = 0; b < B_; ++b) {
    // dP = dO Vᵀ (as S); dV = Pᵀ dO  <=>  dVᵀ(cm) = dOᵀ(cm) · P(cm)
    batched(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, T_, T_, dh_, v + b * seq, CUDA_R_16BF, ld, dh_, dout_.get() + b * seq, ld, dh_,
            dP + b * H_ * tt, CUDA_R_32F, T_, tt, H_);
    batched(cublas_, CUBLAS_OP_N, CUBLAS_OP_T, dh_, T_, T_, dout_.get() + b * seq, CUDA_R_16BF, ld, dh_,
            probs_.get() + b * H_ * tt, T_, tt, dv + b * seq, CUDA_R_16BF, ld, dh_, H_);
  }
  const int64_t rows = B_ * H_ * T_;
  if (rows == 0) return;
  causal_softmax_backward<<<unsigned((rows + 7) / 8), 256, 0, stream>>>(probs_.get(), dP, rows, int(T_));
  MOEUT_CUDA_CHECK(cudaGetLastError());
  const bf16* dS = probs_.get();
  for (int64_t b = 0; b < B_; ++b) {
    // dQ = dS K  <=>  dQᵀ(cm) = Kᵀ(cm) · dSᵀ(cm);  dK = dSᵀ Q  <=>  dKᵀ(cm) = Qᵀ(cm) · dS(cm)
    batched(cublas_, CUBLAS_OP_N, CUBLAS_OP_N, dh_, T_, T_, k + b * qk_seq, CUDA_R_16BF, qk_ld, dh_, dS + b * H_ * tt, T_,
            tt, dq + b * T_ * grad_ld, CUDA_R_16BF, grad_ld, dh_, H_, grad_scale);
    batched(cublas_, CUBLAS_OP_N, CUBLAS_OP_T, dh_, T_, T_, q + b * qk_seq, CUDA_R_16BF, qk_ld, dh_, dS + b * H_ * tt, T_,
            tt, dk + b * T_ * grad_ld, CUDA_R_16BF, grad_ld, dh_, H_, grad_scale);
  }
}

}  // namespace moeut::cuda
