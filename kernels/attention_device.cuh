// The pieces that the flash attention kernels share, on mma.sync (attention_flash_mma.cu) and on
// wgmma (attention_flash_wgmma.cu), and their launches, which CausalAttention picks
// (attention.cu). Private to those files; the kernels' block order is in attention_schedule.cuh.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/fast_exp.cuh"
#include "kernels/lane_reduce.cuh"

namespace moeut::cuda {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// One key tile's step of a flash forward's online softmax for a thread's two query rows, a and b.
// s holds the tile's kS scores and o the kO output accumulators as mma accumulators hold them, in
// groups of four (a, a, b, b). The scores become probabilities exp2((s − max)·log2 e) in place
// (the max taken in the scores' units: the base-2 scale is positive, so it commutes, and each
// exponent is one fused multiply-add); the running maxima and sums move on, and o is rescaled to
// the new maxima. The sums are partial: the 4 threads of a row add theirs at the end.
template <int kS, int kO>
__device__ __forceinline__ void online_softmax_step(float* s, float* o, float& m_a, float& m_b, float& l_a, float& l_b) {
  float mx_a = m_a, mx_b = m_b;
#pragma unroll
  for (int j = 0; j < kS; j += 4) {
    mx_a = fmaxf(mx_a, fmaxf(s[j], s[j + 1]));
    mx_b = fmaxf(mx_b, fmaxf(s[j + 2], s[j + 3]));
  }
  mx_a = group_max<4>(mx_a), mx_b = group_max<4>(mx_b);  // the 4 threads of a row
  // Every row sees key 0 of the first tile, so the running max is finite from the first tile
  // on; the first correction is exp2(-inf) = 0.
  const float corr_a = fast_exp2((m_a - mx_a) * kLog2e), corr_b = fast_exp2((m_b - mx_b) * kLog2e);
  m_a = mx_a, m_b = mx_b;
  const float off_a = mx_a * kLog2e, off_b = mx_b * kLog2e;
  float sum_a = 0.f, sum_b = 0.f;
#pragma unroll
  for (int j = 0; j < kS; j += 4) {
    s[j] = fast_exp2(fmaf(s[j], kLog2e, -off_a)), s[j + 1] = fast_exp2(fmaf(s[j + 1], kLog2e, -off_a));
    s[j + 2] = fast_exp2(fmaf(s[j + 2], kLog2e, -off_b)), s[j + 3] = fast_exp2(fmaf(s[j + 3], kLog2e, -off_b));
    sum_a += s[j] + s[j + 1], sum_b += s[j + 2] + s[j + 3];
  }
  l_a = l_a * corr_a + sum_a, l_b = l_b * corr_b + sum_b;
#pragma unroll
  for (int j = 0; j < kO; j += 4) o[j] *= corr_a, o[j + 1] *= corr_a, o[j + 2] *= corr_b, o[j + 3] *= corr_b;
}

// The per-thread steps that both flash backward kernels share. Their fragments are the
// accumulators of mma.sync's m16n8 products or of wgmma's m64nN ones, which lay out a warp's part
// alike: group j of four elements (a, a, b, b) covers columns 8j + 2c and 8j + 2c + 1 (c = lane %
// 4) of the thread's rows a and b = a + 8.

// Pᵀ and dSᵀ in place, over kGroups groups of a key x query tile: element (key, query) with key
// key_a or key_a + 8 and query = query0 + column; p holds Sᵀ, dp holds dPᵀ. Pᵀ = exp2(Sᵀ log2 e −
// lse), dSᵀ = Pᵀ (dPᵀ − D). The causal mask only where the tile crosses the warp's diagonal.
template <int kGroups>
__device__ __forceinline__ void softmax_grad_tile(float* p, float* dp, int key_a, int query0, bool diagonal,
                                                  const float* Lt, const float* Dt) {
  const int c = threadIdx.x % 4;
#pragma unroll
  for (int j = 0; j < kGroups; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = j * 8 + 2 * c + (e % 2), query = query0 + col, key = key_a + (e < 2 ? 0 : 8);
      const float pe = !diagonal || key <= query ? fast_exp2(fmaf(p[4 * j + e], kLog2e, -Lt[col])) : 0.f;
      p[4 * j + e] = pe;
      dp[4 * j + e] = pe * (dp[4 * j + e] - Dt[col]);
    }
}

// The thread's dK (times grad_scale, rows grad_ld apart) and dV (rows ld apart) rows key_a and
// key_b, kGroups groups of 8 head dims, into the head's rows.
template <int kGroups>
__device__ __forceinline__ void store_dk_dv(bf16* dk_head, bf16* dv_head, const float* dk_acc, const float* dv_acc,
                                            int key_a, int T, int dh, int64_t grad_ld, int64_t ld, float grad_scale) {
  const int c = threadIdx.x % 4;
#pragma unroll
  for (int n = 0; n < kGroups; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = key_a + (e < 2 ? 0 : 8), d = n * 8 + 2 * c + (e % 2);
      if (key < T && d < dh) {
        dk_head[int64_t(key) * grad_ld + d] = __float2bfloat16(grad_scale * dk_acc[4 * n + e]);
        dv_head[int64_t(key) * ld + d] = __float2bfloat16(dv_acc[4 * n + e]);
      }
    }
}

// The flash kernels' launches: on mma.sync for kD (the head size padded: 32, 64, 96 or 128), and
// on wgmma for head size 128.
template <int kD>
void launch_flash_forward_mma(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int64_t B, int64_t T,
                              int64_t H, int64_t dh, int64_t qk_ld, cudaStream_t stream);
void launch_flash_forward_wgmma(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int64_t B,
                                int64_t T, int64_t H, int64_t dh, int64_t qk_ld, cudaStream_t stream);
template <int kD>
void launch_flash_backward_mma(bf16* dk, bf16* dv, float* dq_acc, const bf16* dout, const float* lse, const float* D,
                               const bf16* q, const bf16* k, const bf16* v, int64_t B, int64_t T, int64_t H, int64_t dh,
                               int64_t grad_ld, float grad_scale, int64_t qk_ld, cudaStream_t stream);
void launch_flash_backward_wgmma(bf16* dk, bf16* dv, float* dq_acc, const bf16* dout, const float* lse, const float* D,
                                 const bf16* q, const bf16* k, const bf16* v, int64_t B, int64_t T, int64_t H,
                                 int64_t dh, int64_t grad_ld, float grad_scale, int64_t qk_ld, cudaStream_t stream);

}  // namespace moeut::cuda
