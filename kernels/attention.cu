#include <algorithm>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "kernels/attention_cuda.h"
#include "kernels/cast_cuda.h"
#include "kernels/cuda_check.h"
#include "kernels/fast_exp.cuh"
#include "kernels/with_ceiling.h"
#include "kernels/lane_reduce.cuh"
#include "kernels/named_barrier.cuh"
#include "kernels/tma.cuh"
#include "kernels/wgmma.cuh"

namespace moeut::cuda {
namespace {

using bf16 = __nv_bfloat16;

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

// ---- Flash-style forward: no T×T scores in memory ----
// One block: 128 query rows of one (sequence, head), 8 warps of 16 rows, keys taken 64 at a time
// (causal: only tiles at or below the diagonal; a warp skips a tile that is all above its rows).
// Per tile: S = Q Kᵀ on mma.sync m16n8k16, an online softmax in registers (running max and sum
// per row), P rounded to bf16 and O += P V. 128 rows per block read each key tile once for twice
// the rows of a 64-row block, and two such blocks per SM keep 16 warps in flight.
// kD: the head size padded to a multiple of 16 (zeros in the padding). Shared memory rows are
// padded by 8 elements so ldmatrix's 8 row addresses fall in different banks.
// kFlashBlockRows: the rows a block owns (queries in the forward pass, keys in the backward);
// kFlashTileRows: the rows of the tiles it streams past them.
constexpr int kFlashBlockRows = 128, kFlashTileRows = 64, kFlashThreads = 256;

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
// d (16x8, fp32) += a (16x16, bf16, row) · b (16x8, bf16, col).
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
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

// Rows [row0, row0 + kRows) of one head ([T] rows, `ld` elements apart, dh used) into smem rows
// of kD + 8, zeros past dh and past T; 16-byte copies when rows allow them.
template <int kD, int kRows>
__device__ void load_head_tile(bf16* dst, const bf16* src, int64_t ld, int row0, int T, int dh, bool vec) {
  constexpr int kStride = kD + 8, kChunks = kD / 8;
  for (int c = threadIdx.x; c < kRows * kChunks; c += kFlashThreads) {
    const int r = c / kChunks, d0 = (c % kChunks) * 8;
    bf16* to = dst + r * kStride + d0;
    const bf16* from = src + int64_t(row0 + r) * ld + d0;
    const bool row_ok = row0 + r < T;
    if (vec && row_ok && d0 + 8 <= dh) {
      const unsigned addr = smem_u32(to);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(addr), "l"(from));
    } else {
      for (int i = 0; i < 8; ++i) to[i] = row_ok && d0 + i < dh ? from[i] : __float2bfloat16(0.f);
    }
  }
}

// The flash kernels' block order, over a 1D grid of tiles x (batch, head) blocks. Causal tiles
// differ in length up to `tiles` times, so within each chunk of kChunkHeads (batch, head) pairs
// every pair's longest tile goes first and the short ones fill the chunk's last wave (rank 0: the
// longest). A chunk (128 blocks at T 1024: a wave of the backward kernel, half of the
// forward's) reads the rows of its pairs only, so they stay in L2 while it runs.
constexpr int kChunkHeads = 16;
struct FlashBlock {
  int rank, bh;
};
__device__ __forceinline__ FlashBlock flash_block(int tiles, int heads) {
  const int span = kChunkHeads * tiles, chunk = int(blockIdx.x) / span, rem = int(blockIdx.x) % span;
  const int in_chunk = min(kChunkHeads, heads - chunk * kChunkHeads);
  return {rem / in_chunk, chunk * kChunkHeads + rem % in_chunk};
}
__host__ inline unsigned flash_blocks(int64_t B, int64_t T, int64_t H) {
  return unsigned((T + kFlashBlockRows - 1) / kFlashBlockRows * B * H);
}
// A flash block's (sequence, head) and its rank among that head's `tiles` blocks of 128 rows (0:
// the longest, see flash_block), with where the head's rows start in the [B, T, H, dh] tensors.
struct FlashHead {
  int tiles, rank, bh, b, h;
  int64_t ld, base;
  // In the forward pass: the block's first query row (rank 0 takes the last query block, which
  // attends to the most keys), and the last key tile of `key_rows` rows that its rows see.
  __device__ int forward_rows() const { return (tiles - 1 - rank) * kFlashBlockRows; }
  __device__ int last_key_tile(int T, int key_rows) const {
    return min(T - 1, forward_rows() + kFlashBlockRows - 1) / key_rows;
  }
  // Where the head's rows start in a tensor whose token rows are row_ld elements apart (q and k).
  __device__ int64_t base_in(int T, int dh, int64_t row_ld) const { return int64_t(b) * T * row_ld + int64_t(h) * dh; }
};
__device__ __forceinline__ FlashHead flash_head(int T, int H, int dh) {
  const int tiles = (T + kFlashBlockRows - 1) / kFlashBlockRows;
  const FlashBlock blk = flash_block(tiles, int(gridDim.x) / tiles);
  const int b = blk.bh / H, h = blk.bh % H;
  const int64_t ld = int64_t(H) * dh;
  return {tiles, blk.rank, blk.bh, b, h, ld, int64_t(b) * T * ld + int64_t(h) * dh};
}
// Whether the head's rows in q and k (qk_ld apart, from qk_base) and in every other tensor given
// allow 16-byte copies.
template <class... Tensors>
__device__ __forceinline__ bool rows_16_bytes(const FlashHead& f, int dh, int64_t qk_ld, int64_t qk_base, const bf16* q,
                                              const bf16* k, const Tensors*... x) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return dh % 8 == 0 && f.ld % 8 == 0 && qk_ld % 8 == 0 && aligned(q + qk_base) && aligned(k + qk_base) &&
         (aligned(x + f.base) && ...);
}

template <int kD>
__global__ void __launch_bounds__(kFlashThreads, 2) flash_forward(bf16* out, float* lse, const bf16* q, const bf16* k,
                                                                   const bf16* v, int T, int H, int dh, int64_t qk_ld) {
  constexpr int kStride = kD + 8, kTile = kFlashTileRows * kStride;
  extern __shared__ __align__(16) unsigned char flash_smem[];
  bf16* Qs = reinterpret_cast<bf16*>(flash_smem);    // [128][kStride]
  bf16* Ks = Qs + kFlashBlockRows * kStride;          // [2][64][kStride]
  bf16* Vs = Ks + 2 * kTile;                          // [2][64][kStride]
  const FlashHead f = flash_head(T, H, dh);
  const int bh = f.bh, q0 = f.forward_rows(), last_kt = f.last_key_tile(T, kFlashTileRows);
  const int64_t ld = f.ld, base = f.base, qk_base = f.base_in(T, dh, qk_ld);
  const bool vec = rows_16_bytes(f, dh, qk_ld, qk_base, q, k, v);

  load_head_tile<kD, kFlashBlockRows>(Qs, q + qk_base, qk_ld, q0, T, dh, vec);
  load_head_tile<kD, kFlashTileRows>(Ks, k + qk_base, qk_ld, 0, T, dh, vec);
  load_head_tile<kD, kFlashTileRows>(Vs, v + base, ld, 0, T, dh, vec);
  asm volatile("cp.async.commit_group;\n" ::);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int warp_row0 = q0 + warp * 16, row_a = warp_row0 + g, row_b = row_a + 8;  // this thread's two query rows
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f;
  float o[kD / 8][4];
#pragma unroll
  for (auto& t : o) t[0] = t[1] = t[2] = t[3] = 0.f;

  for (int kt = 0; kt <= last_kt; ++kt) {
    const int buf = kt & 1, key0 = kt * kFlashTileRows;
    if (kt < last_kt) {  // the next key tile streams in while this one is used
      load_head_tile<kD, kFlashTileRows>(Ks + (buf ^ 1) * kTile, k + qk_base, qk_ld, key0 + kFlashTileRows, T, dh, vec);
      load_head_tile<kD, kFlashTileRows>(Vs + (buf ^ 1) * kTile, v + base, ld, key0 + kFlashTileRows, T, dh, vec);
    }
    asm volatile("cp.async.commit_group;\n" ::);
    asm volatile("cp.async.wait_group 1;\n" ::);
    __syncthreads();
    if (key0 > warp_row0 + 15) {  // every key of the tile is after every row of this warp
      __syncthreads();                // (the barrier that ends the other path)
      continue;
    }
    const bf16* Kt = Ks + buf * kTile;
    const bf16* Vt = Vs + buf * kTile;

    // S (16 x 64 per warp) = Q Kᵀ: 8 tiles of 8 keys.
    float s[8][4];
#pragma unroll
    for (auto& t : s) t[0] = t[1] = t[2] = t[3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      uint32_t a[4];
      ldmatrix_x4(a, Qs + (warp * 16 + lane % 16) * kStride + kk * 16 + (lane / 16) * 8);
#pragma unroll
      for (int j = 0; j < 8; j += 2) {  // keys 8j..8j+15: (b0, b1) for two key tiles
        uint32_t bk[4];
        ldmatrix_x4(bk, Kt + (j * 8 + lane % 8 + (lane / 16) * 8) * kStride + kk * 16 + ((lane / 8) % 2) * 8);
        mma_16816(s[j], a, bk[0], bk[1]);
        mma_16816(s[j + 1], a, bk[2], bk[3]);
      }
    }
    // Causal mask, only on a tile that crosses the warp's diagonal (a warp-uniform branch).
    if (key0 + kFlashTileRows - 1 > warp_row0) {
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (key0 + j * 8 + 2 * c + (e % 2) > (e < 2 ? row_a : row_b)) s[j][e] = -INFINITY;
    }
    online_softmax_step<32, kD / 2>(&s[0][0], &o[0][0], m_a, m_b, l_a, l_b);
    // O += P V: P's accumulators become the A operand directly (16 keys = two 8-key tiles).
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const uint32_t a[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                             pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int n = 0; n < kD / 8; n += 2) {  // head dims 8n..8n+15
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, Vt + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * kStride + n * 8 + (lane / 16) * 8);
        mma_16816(o[n], a, bv[0], bv[1]);
        mma_16816(o[n + 1], a, bv[2], bv[3]);
      }
    }
    __syncthreads();  // this tile's buffers are refilled by the next step's copies
  }
  asm volatile("cp.async.wait_group 0;\n" ::);
  l_a = group_sum<4>(l_a), l_b = group_sum<4>(l_b);
  const float inv_a = 1.f / l_a, inv_b = 1.f / l_b;
  if (c == 0) {  // log2 of each row's softmax denominator, in the base-2 units of the scores
    if (row_a < T) lse[int64_t(bh) * T + row_a] = m_a * kLog2e + log2f(l_a);
    if (row_b < T) lse[int64_t(bh) * T + row_b] = m_b * kLog2e + log2f(l_b);
  }
#pragma unroll
  for (int n = 0; n < kD / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = e < 2 ? row_a : row_b, d = n * 8 + 2 * c + (e % 2);
      if (row < T && d < dh) out[base + int64_t(row) * ld + d] = __float2bfloat16(o[n][e] * (e < 2 ? inv_a : inv_b));
    }
}

// ---- Flash-style forward on wgmma (head size 128) ----
// One block: 128 query rows of one (sequence, head) in two warpgroups of 64, keys taken 128 at a
// time. S = Q Kᵀ reads Q and the key tile from shared memory; P, rounded to bf16 in registers, is
// the A operand of O += P V (an m64n128 accumulator's layout is the A fragment's, 16 keys per
// step). Against the mma.sync kernel above, each key tile is read from shared memory once per
// 64 rows instead of once per 16. Tiles use wgmma.cuh's 128-byte swizzled layout, two 64-column
// slabs per 128-wide head; K and V in three stages (32 KB each), Q 32 KB: 224 KB, one block
// per SM.
constexpr int kWgKeys = 128, kWgThreads = 256;
constexpr uint32_t kWgSlab = 128 * 128;        // bytes of one 64-column slab of a 128-row tile
constexpr uint32_t kWgTile = 2 * kWgSlab;      // a 128 x 128 tile

// An accumulator's columns, rounded to bf16, as register A operands of the next product
// (wgmma.cuh's mma_m64n128k16_rs): step kk takes columns 16kk .. 16kk + 15, its elements 8kk ..
// 8kk + 7 in pairs.
template <int kSteps>
__device__ __forceinline__ void a_fragments(uint32_t (&a)[kSteps][4], const float* acc) {
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk)
#pragma unroll
    for (int i = 0; i < 4; ++i) a[kk][i] = pack_bf16(acc[8 * kk + 2 * i], acc[8 * kk + 2 * i + 1]);
}

// The forward's rows come by tensor copies (TMA), so no thread spends its issue slots copying and
// no block barrier holds the two warpgroups together. One thread of a third, copying warpgroup
// (40 registers a thread by `setmaxnreg`, which leaves the multiplying ones 232) loads Q once and
// streams the key and value tiles through kFwdStages stages, each full on its mbarrier (by byte
// count) and empty once all 256 multiplying threads have arrived after their products.
// The two warpgroups take turns at the tensor cores through two named barriers, as in
// FlashAttention-3: a warpgroup issues O += P V for the previous tile and S = Q Kᵀ for this one
// back to back, hands the turn over, and computes this tile's softmax while the other's products
// run. Reads past dh or T land as zeros (head_rows_map), as the mma.sync kernels' copies write them.
constexpr int kFwdStages = 3, kFwdThreads = kWgThreads + 128;
constexpr size_t kFwdSmem = (1 + 2 * kFwdStages) * kWgTile + 1024;  // Q, K and V stages, room to align
constexpr int kTurnBarrier0 = 1;  // named barriers 1 and 2: warpgroup 0's and 1's turn (0 is __syncthreads)

__global__ void __launch_bounds__(kFwdThreads, 1)
    flash_forward_wgmma(bf16* out, float* lse, int T, int H, int dh,
                        const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                        const __grid_constant__ CUtensorMap v_map) {
  extern __shared__ __align__(16) unsigned char flash_smem[];
  unsigned char* const Qs = flash_smem + (1024 - smem_u32(flash_smem) % 1024) % 1024;  // slabs 1024-aligned
  unsigned char* const Ks = Qs + kWgTile;                  // [kFwdStages] tiles
  unsigned char* const Vs = Ks + kFwdStages * kWgTile;     // [kFwdStages] tiles
  __shared__ alignas(8) uint64_t q_full, kv_full[kFwdStages], kv_empty[kFwdStages];
  const FlashHead f = flash_head(T, H, dh);
  const int bh = f.bh, q0 = f.forward_rows(), last_kt = f.last_key_tile(T, kWgKeys);
  if (threadIdx.x == 0) {
    tma::mbar_init(&q_full, 1);
    for (int st = 0; st < kFwdStages; ++st) tma::mbar_init(&kv_full[st], 1), tma::mbar_init(&kv_empty[st], kWgThreads);
    tma::fence_barrier_init();
  }
  __syncthreads();

  if (threadIdx.x >= kWgThreads) {  // the copying warpgroup
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (threadIdx.x == kWgThreads) {
      tma::mbar_expect_tx(&q_full, int(kWgTile));
      for (int half = 0; half < 2; ++half) tma::load_4d(Qs + half * kWgSlab, &q_map, 64 * half, f.h, q0, f.b, &q_full);
      for (int kt = 0; kt <= last_kt; ++kt) {
        const int st = kt % kFwdStages;
        if (kt >= kFwdStages) tma::mbar_wait(&kv_empty[st], (kt / kFwdStages - 1) % 2);
        tma::mbar_expect_tx(&kv_full[st], int(2 * kWgTile));
        for (int half = 0; half < 2; ++half) {
          tma::load_4d(Ks + st * kWgTile + half * kWgSlab, &k_map, 64 * half, f.h, kt * kWgKeys, f.b, &kv_full[st]);
          tma::load_4d(Vs + st * kWgTile + half * kWgSlab, &v_map, 64 * half, f.h, kt * kWgKeys, f.b, &kv_full[st]);
        }
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  const int wg = threadIdx.x / 128;
  const int wg_row0 = q0 + 64 * wg;                  // this warpgroup's first query row
  const int row_a = wg_row0 + wgmma::acc_row(0), row_b = row_a + 8;  // this thread's two rows
  // Accumulator element j belongs to row_a when (j / 2) % 2 == 0, else to row_b.
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f;
  float o[64], s[64];
  uint32_t p[8][4];  // the previous tile's probabilities, as A fragments
#pragma unroll
  for (float& x : o) x = 0.f;
  const uint32_t q_rows = smem_u32(Qs) + 64 * 128 * wg;
  // S (64 x 128 keys per warpgroup) = Q Kᵀ for the tile in stage st, 8 steps of 16 head dims.
  const auto issue_scores = [&](int st) {
    const uint32_t k_tile = smem_u32(Ks + st * kWgTile);
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
      wgmma::mma_m64n128k16<0, 0>(s, wgmma::k_major(q_rows + (kk / 4) * kWgSlab, kk % 4),
                                  wgmma::k_major(k_tile + (kk / 4) * kWgSlab, kk % 4), kk > 0);
  };
  // O += P V for the tile in stage st: keys 16kk..16kk+15 are P's fragments p[kk]; V (keys x head
  // dims) is the MN-major B operand.
  const auto issue_values = [&](int st) {
    const uint32_t v_tile = smem_u32(Vs + st * kWgTile);
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) wgmma::mma_m64n128k16_rs<1>(o, p[kk], wgmma::mn_major(v_tile, kWgSlab, kk));
  };
  // The tile's scores, landed in s, become probabilities in p (o rescaled to the new maxima).
  const auto softmax = [&](int kt) {
    const int key0 = kt * kWgKeys;
    if (key0 + kWgKeys - 1 > wg_row0) {  // causal mask on a tile that crosses the warpgroup's diagonal
#pragma unroll
      for (int j = 0; j < 64; ++j)
        if (key0 + wgmma::acc_col(j) > ((j / 2) % 2 ? row_b : row_a)) s[j] = -INFINITY;
    }
    online_softmax_step<64, 64>(s, o, m_a, m_b, l_a, l_b);
    a_fragments(p, s);
  };
  const int my_turn = kTurnBarrier0 + wg, their_turn = kTurnBarrier0 + 1 - wg;
  if (wg == 1) bar_arrive(their_turn, kWgThreads);  // warpgroup 0 goes first
  tma::mbar_wait(&q_full, 0);
  tma::mbar_wait(&kv_full[0], 0);
  bar_sync(my_turn, kWgThreads);
  wgmma::fence();
  issue_scores(0);
  wgmma::commit();
  bar_arrive(their_turn, kWgThreads);
  wgmma::wait<0>();
  softmax(0);
  // Step kt: O += P V for tile kt - 1 and S = Q Kᵀ for tile kt issued back to back in this
  // warpgroup's turn; past their wait, tile kt - 1's stage is free and S becomes P.
  for (int kt = 1; kt <= last_kt; ++kt) {
    const int st = kt % kFwdStages, prev = (kt - 1) % kFwdStages;
    tma::mbar_wait(&kv_full[st], (kt / kFwdStages) % 2);
    bar_sync(my_turn, kWgThreads);
    wgmma::fence();
    issue_values(prev);
    issue_scores(st);
    wgmma::commit();
    bar_arrive(their_turn, kWgThreads);
    wgmma::wait<0>();
    tma::mbar_arrive(&kv_empty[prev]);
    softmax(kt);
  }
  bar_sync(my_turn, kWgThreads);
  wgmma::fence();
  issue_values(last_kt % kFwdStages);
  wgmma::commit();
  if (wg == 0) bar_arrive(their_turn, kWgThreads);  // warpgroup 1's last turn hands over to nobody
  wgmma::wait<0>();
  l_a = group_sum<4>(l_a), l_b = group_sum<4>(l_b);
  const float inv_a = 1.f / l_a, inv_b = 1.f / l_b;
  if (threadIdx.x % 4 == 0) {  // log2 of each row's softmax denominator, in the base-2 units of the scores
    if (row_a < T) lse[int64_t(bh) * T + row_a] = m_a * kLog2e + log2f(l_a);
    if (row_b < T) lse[int64_t(bh) * T + row_b] = m_b * kLog2e + log2f(l_b);
  }
#pragma unroll
  for (int j = 0; j < 64; j += 2) {  // elements j, j + 1: adjacent head dims of one row (dh even)
    const bool second = (j / 2) % 2;
    const int row = second ? row_b : row_a, d = wgmma::acc_col(j);
    const float inv = second ? inv_b : inv_a;
    if (row < T && d < dh)
      *reinterpret_cast<__nv_bfloat162*>(out + f.base + int64_t(row) * f.ld + d) =
          __floats2bfloat162_rn(o[j] * inv, o[j + 1] * inv);
  }
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

// The three per-thread steps that both flash backward kernels share. Their fragments are the
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

// A warp's dQ fragment (kGroups groups of 8 head dims from d0, rows query_a and query_a + 8) into
// the head's fp32 accumulator (rows ld apart), 4 columns per 16-byte atomic (a quarter of the
// atomics of one per element): lanes c and c ^ 1 trade pairs, so the even one holds row a's
// columns 2c to 2c + 3 and the odd one row b's.
template <int kGroups>
__device__ __forceinline__ void add_dq(float* dq_head, const float* dq, int query_a, int d0, int T, int dh, int64_t ld,
                                       bool vec4) {
  const int c = threadIdx.x % 4;
  const bool even = c % 2 == 0;
  const int query = query_a + (even ? 0 : 8);
#pragma unroll
  for (int n = 0; n < kGroups; ++n) {
    const float* g = dq + 4 * n;
    const float r0 = __shfl_xor_sync(0xffffffffu, even ? g[2] : g[0], 1),
                r1 = __shfl_xor_sync(0xffffffffu, even ? g[3] : g[1], 1);
    const float4 v = even ? make_float4(g[0], g[1], r0, r1) : make_float4(r0, r1, g[2], g[3]);
    const int d = d0 + n * 8 + 2 * (c & ~1);
    if (query >= T || d >= dh) continue;
    float* const at = dq_head + int64_t(query) * ld + d;
    if (vec4 && d + 3 < dh) {
      atomicAdd(reinterpret_cast<float4*>(at), v);
    } else {
      const float part[4] = {v.x, v.y, v.z, v.w};
      for (int i = 0; i < 4 && d + i < dh; ++i) atomicAdd(at + i, part[i]);
    }
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

// Head sizes up to 96 (above: flash_backward_wgmma below). One block: 128 keys of one
// (sequence, head), 8 warps of 16 keys, dK and dV accumulated in registers over the 64-row query tiles at and below the diagonal (a warp whose keys all come
// after a tile's queries skips it). Per query tile: Sᵀ = K Qᵀ, Pᵀ = exp2(Sᵀ - lse),
// dV += Pᵀ dO, dPᵀ = V dOᵀ, dSᵀ = Pᵀ (dPᵀ - D), dK += dSᵀ Q; dSᵀ goes through shared memory for
// dQ += dS K (each warp 16 queries x half the head dims, over the live keys), which is added into
// an fp32 accumulator atomically (every key tile adds to the same query rows): 128 keys per block
// halve those additions against 64. dk: rows grad_ld apart, times grad_scale.
template <int kD>
__global__ void __launch_bounds__(kFlashThreads) flash_backward(bf16* dk, bf16* dv, float* dq_acc, const bf16* dout,
                                                                 const float* lse, const float* D, const bf16* q,
                                                                 const bf16* k, const bf16* v, int T, int H, int dh,
                                                                 int64_t grad_ld, float grad_scale, int64_t qk_ld) {
  constexpr int kStride = kD + 8, kTile = kFlashTileRows * kStride, kSStride = kFlashTileRows + 8;
  extern __shared__ __align__(16) unsigned char flash_smem[];
  bf16* Ks = reinterpret_cast<bf16*>(flash_smem);  // [128][kStride]
  bf16* Vs = Ks + kFlashBlockRows * kStride;        // [128][kStride]
  bf16* Qs = Vs + kFlashBlockRows * kStride;        // [2][64][kStride]
  bf16* dOs = Qs + 2 * kTile;                       // [2][64][kStride]
  bf16* dSs = dOs + 2 * kTile;                      // [128 keys][kSStride]
  float* Ls = reinterpret_cast<float*>(dSs + kFlashBlockRows * kSStride);  // [2][64]
  float* Ds = Ls + 2 * kFlashTileRows;                                     // [2][64]

  const int tiles = (T + kFlashTileRows - 1) / kFlashTileRows;
  const FlashHead f = flash_head(T, H, dh);
  const int kt = f.rank, bh = f.bh, b = f.b, h = f.h;  // the first key tile meets the most queries
  const int64_t ld = f.ld, base = f.base, qk_base = f.base_in(T, dh, qk_ld);
  const bool vec = rows_16_bytes(f, dh, qk_ld, qk_base, q, k, v, dout);
  const bool dq_vec4 = dh % 4 == 0 && ld % 4 == 0 && reinterpret_cast<uintptr_t>(dq_acc + base) % 16 == 0;
  const int k0 = kt * kFlashBlockRows, first_qt = k0 / kFlashTileRows;
  auto load_query_tile = [&](int buf, int qt) {
    load_head_tile<kD, kFlashTileRows>(Qs + buf * kTile, q + qk_base, qk_ld, qt * kFlashTileRows, T, dh, vec);
    load_head_tile<kD, kFlashTileRows>(dOs + buf * kTile, dout + base, ld, qt * kFlashTileRows, T, dh, vec);
    for (int r = threadIdx.x; r < kFlashTileRows; r += kFlashThreads) {  // rows past T: finite, contribute 0
      const int t = qt * kFlashTileRows + r;
      Ls[buf * kFlashTileRows + r] = t < T ? lse[int64_t(bh) * T + t] : 0.f;
      Ds[buf * kFlashTileRows + r] = t < T ? D[int64_t(bh) * T + t] : 0.f;
    }
  };
  load_head_tile<kD, kFlashBlockRows>(Ks, k + qk_base, qk_ld, k0, T, dh, vec);
  load_head_tile<kD, kFlashBlockRows>(Vs, v + base, ld, k0, T, dh, vec);
  load_query_tile(0, first_qt);
  asm volatile("cp.async.commit_group;\n" ::);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int warp_key0 = k0 + warp * 16, key_a = warp_key0 + g;  // this thread's keys: key_a, key_a + 8
  float dk_acc[kD / 8][4], dv_acc[kD / 8][4];
#pragma unroll
  for (int n = 0; n < kD / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk_acc[n][e] = dv_acc[n][e] = 0.f;

  for (int qt = first_qt; qt < tiles; ++qt) {
    const int buf = (qt - first_qt) & 1, query0 = qt * kFlashTileRows, query_last = query0 + kFlashTileRows - 1;
    if (qt + 1 < tiles) load_query_tile(buf ^ 1, qt + 1);
    asm volatile("cp.async.commit_group;\n" ::);
    asm volatile("cp.async.wait_group 1;\n" ::);
    __syncthreads();
    const bf16* Qt = Qs + buf * kTile;
    const bf16* dOt = dOs + buf * kTile;
    const float* Lt = Ls + buf * kFlashTileRows;
    const float* Dt = Ds + buf * kFlashTileRows;
    // Warps 0 .. live_warps - 1 hold keys that some query of this tile sees (at least half of
    // them: the first query tile starts at the block's first key).
    const int live_warps = min(kFlashThreads / 32, (query_last - k0) / 16 + 1);
    if (warp < live_warps) {
      // Sᵀ (16 keys x 64 queries per warp) and dPᵀ = V dOᵀ, both over the head dims.
      float p[8][4], dp[8][4];
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) p[j][e] = dp[j][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        uint32_t ak[4], av[4];
        ldmatrix_x4(ak, Ks + (warp * 16 + lane % 16) * kStride + kk * 16 + (lane / 16) * 8);
        ldmatrix_x4(av, Vs + (warp * 16 + lane % 16) * kStride + kk * 16 + (lane / 16) * 8);
#pragma unroll
        for (int j = 0; j < 8; j += 2) {
          uint32_t bq[4], bo[4];
          ldmatrix_x4(bq, Qt + (j * 8 + lane % 8 + (lane / 16) * 8) * kStride + kk * 16 + ((lane / 8) % 2) * 8);
          ldmatrix_x4(bo, dOt + (j * 8 + lane % 8 + (lane / 16) * 8) * kStride + kk * 16 + ((lane / 8) % 2) * 8);
          mma_16816(p[j], ak, bq[0], bq[1]);
          mma_16816(p[j + 1], ak, bq[2], bq[3]);
          mma_16816(dp[j], av, bo[0], bo[1]);
          mma_16816(dp[j + 1], av, bo[2], bo[3]);
        }
      }
      softmax_grad_tile<8>(&p[0][0], &dp[0][0], key_a, query0, warp_key0 + 15 > query0, Lt, Dt);
      // dV += Pᵀ dO and dK += dSᵀ Q: Pᵀ, dSᵀ as A operands (16 queries a step), dO, Q as B (trans).
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const uint32_t ap[4] = {pack_bf16(p[2 * kk][0], p[2 * kk][1]), pack_bf16(p[2 * kk][2], p[2 * kk][3]),
                                pack_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                                pack_bf16(p[2 * kk + 1][2], p[2 * kk + 1][3])};
        const uint32_t as[4] = {pack_bf16(dp[2 * kk][0], dp[2 * kk][1]), pack_bf16(dp[2 * kk][2], dp[2 * kk][3]),
                                pack_bf16(dp[2 * kk + 1][0], dp[2 * kk + 1][1]),
                                pack_bf16(dp[2 * kk + 1][2], dp[2 * kk + 1][3])};
#pragma unroll
        for (int n = 0; n < kD / 8; n += 2) {
          uint32_t bo[4], bq[4];
          const int row = kk * 16 + lane % 8 + ((lane / 8) % 2) * 8, col = n * 8 + (lane / 16) * 8;
          ldmatrix_x4_trans(bo, dOt + row * kStride + col);
          ldmatrix_x4_trans(bq, Qt + row * kStride + col);
          mma_16816(dv_acc[n], ap, bo[0], bo[1]);
          mma_16816(dv_acc[n + 1], ap, bo[2], bo[3]);
          mma_16816(dk_acc[n], as, bq[0], bq[1]);
          mma_16816(dk_acc[n + 1], as, bq[2], bq[3]);
        }
      }
      // dSᵀ (bf16) to shared memory: rows keys, columns queries.
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int col = j * 8 + 2 * c;
        *reinterpret_cast<uint32_t*>(dSs + (warp * 16 + g) * kSStride + col) = pack_bf16(dp[j][0], dp[j][1]);
        *reinterpret_cast<uint32_t*>(dSs + (warp * 16 + g + 8) * kSStride + col) = pack_bf16(dp[j][2], dp[j][3]);
      }
    }
    __syncthreads();
    // dQ = dS K over the live keys (the dSᵀ rows the live warps wrote): warp w takes queries
    // 16 (w % 4) .. + 15 and head dims kHalf (w / 4) .. + kHalf - 1. dS from dSᵀ (trans), K as B
    // (trans).
    constexpr int kHalf = kD / 2;
    const int q_row0 = (warp % 4) * 16, d0 = (warp / 4) * kHalf;
    float dq[kHalf / 8][4];
#pragma unroll
    for (int n = 0; n < kHalf / 8; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kFlashBlockRows / 16; ++kk) {
      if (kk >= live_warps) break;
      uint32_t a[4];
      ldmatrix_x4_trans(a, dSs + (kk * 16 + lane % 8 + (lane / 16) * 8) * kSStride + q_row0 + ((lane / 8) % 2) * 8);
#pragma unroll
      for (int n = 0; n < kHalf / 8; n += 2) {
        uint32_t bk[4];
        ldmatrix_x4_trans(bk, Ks + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * kStride + d0 + n * 8 + (lane / 16) * 8);
        mma_16816(dq[n], a, bk[0], bk[1]);
        mma_16816(dq[n + 1], a, bk[2], bk[3]);
      }
    }
    add_dq<kHalf / 8>(dq_acc + base, &dq[0][0], query0 + q_row0 + g, d0, T, dh, ld, dq_vec4);
    __syncthreads();  // Q, dO, dSᵀ of this tile are overwritten next
  }
  asm volatile("cp.async.wait_group 0;\n" ::);
  store_dk_dv<kD / 8>(dk + int64_t(b) * T * grad_ld + int64_t(h) * dh, dv + base, &dk_acc[0][0], &dv_acc[0][0], key_a, T,
                      dh, grad_ld, ld, grad_scale);
}

// ---- Flash-style backward on wgmma (head size 128) ----
// One block: 128 keys of one (sequence, head) in two warpgroups of 64, dK and dV accumulated in
// registers (m64n128 each) over the 64-row query tiles at and below the diagonal. Per query tile,
// each warpgroup whose keys some query sees: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (m64n64, keys x queries,
// from shared memory), Pᵀ and dSᵀ in registers (softmax_grad_tile), then dV += Pᵀ dO and
// dK += dSᵀ Q with Pᵀ and dSᵀ, rounded to bf16, as the register A operand (as the forward's P)
// and dO, Q as MN-major B. dSᵀ also goes to shared memory, where dQ = dS K (64 queries x 64 head
// dims per warpgroup, over the block's 128 keys; dS the MN-major A, K the MN-major B) is added
// into an fp32 accumulator (every key block adds to the same query rows). Against the mma.sync
// kernel, each query tile is read from shared memory once per 64 keys instead of once per 16.
// Shared memory: K, V (32 KB each), Q, dO and dSᵀ double-buffered (16 KB each), lse and D, the
// staged dQ tile (34 KB): 195 KB, one block per SM. K, V and each query tile's Q and dO come by
// tensor copies, and dQ goes out by bulk reductions, so no multiplying thread spends issue slots
// or load/store queue entries on either.
constexpr int kWgQueries = 64;
constexpr uint32_t kWgQuerySlab = kWgQueries * 128;  // bytes of one 64-column slab of a 64-row tile
constexpr uint32_t kWgQueryTile = 2 * kWgQuerySlab;
constexpr int kDqStride = 128 + 8;  // floats a row of the staged dQ tile: 16-byte aligned rows, float2 stores of 16 lanes on 32 banks
constexpr size_t kWgBackwardSmem = 2 * kWgTile + 6 * kWgQueryTile + 4 * kWgQueries * sizeof(float) +
                                   kWgQueries * kDqStride * sizeof(float) + 1024;  // K, V, Q x 2, dO x 2, dSᵀ x 2, lse, D, dQ
constexpr int kBwdThreads = kWgThreads + 128;  // two multiplying warpgroups and a copying one
constexpr int kDsBarrier = 1;                  // named barrier: both warpgroups' dSᵀ rows of a tile written

// A copying warpgroup (`setmaxnreg` 24; the multiplying ones 240, as FlashAttention-3's backward
// has them) keeps two query tiles ahead: one thread issues Q's and dO's tensor copies, and two
// warps put lse and D into the stage, which is full on its mbarrier when both have landed and
// empty once the 256 multiplying threads have arrived after the tile's last product. dSᵀ is
// double-buffered, so the one barrier a tile left is between the two multiplying warpgroups
// (both halves of dSᵀ written before dQ = dS K reads them); the loads do not hold them. dQ goes
// as FlashAttention-3 adds it: the multiplying warpgroups stage each tile's dQ in shared memory,
// and a third copying warp adds its rows into the fp32 accumulator by the L2's bulk reduction,
// so no multiplying thread issues an atomic.
__global__ void __launch_bounds__(kBwdThreads, 1)
    flash_backward_wgmma(bf16* dk, bf16* dv, float* dq_acc, const float* lse, const float* D, int T, int H, int dh,
                         int64_t grad_ld, float grad_scale, const __grid_constant__ CUtensorMap q_map,
                         const __grid_constant__ CUtensorMap dout_map, const __grid_constant__ CUtensorMap k_map,
                         const __grid_constant__ CUtensorMap v_map) {
  extern __shared__ __align__(16) unsigned char flash_smem[];
  unsigned char* const Ks = flash_smem + (1024 - smem_u32(flash_smem) % 1024) % 1024;  // slabs 1024-aligned
  unsigned char* const Vs = Ks + kWgTile;
  unsigned char* const Qs = Vs + kWgTile;              // [2] tiles
  unsigned char* const dOs = Qs + 2 * kWgQueryTile;    // [2] tiles
  unsigned char* const dSs = dOs + 2 * kWgQueryTile;   // [2] x [128 keys][64 queries], one slab each
  float* const Ls = reinterpret_cast<float*>(dSs + 2 * kWgQueryTile);  // [2][64]
  float* const Ds = Ls + 2 * kWgQueries;                              // [2][64]
  float* const dQs = Ds + 2 * kWgQueries;                             // [64 queries][kDqStride]
  __shared__ alignas(8) uint64_t kv_full, full[2], empty[2], dq_full, dq_empty;

  const int tiles = (T + kWgQueries - 1) / kWgQueries;
  const FlashHead f = flash_head(T, H, dh);
  const int bh = f.bh;
  const int64_t ld = f.ld, base = f.base;
  const int k0 = f.rank * kFlashBlockRows, first_qt = k0 / kWgQueries;  // rank 0 meets the most queries
  if (threadIdx.x == 0) {
    tma::mbar_init(&kv_full, 1);
    for (int st = 0; st < 2; ++st) tma::mbar_init(&full[st], 1 + 64), tma::mbar_init(&empty[st], kWgThreads);
    tma::mbar_init(&dq_full, kWgThreads), tma::mbar_init(&dq_empty, 1);
    tma::fence_barrier_init();
  }
  __syncthreads();

  if (threadIdx.x >= kWgThreads) {  // the copying warpgroup
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
    const int r = threadIdx.x - kWgThreads;  // warps 0-1: the loads (lse and D of row r), warp 2: dQ
    if (r >= 64) {
      if (r >= 96) return;
      // dQ: each staged tile's rows added into the fp32 accumulator by the L2's bulk reduction.
      // Tensor copies took these rows, so dh % 8 == 0 and the rows start 16-byte aligned.
      const int lane = r - 64;
      for (int qt = first_qt, i = 0; qt < tiles; ++qt, ++i) {
        tma::mbar_wait(&dq_full, i % 2);
        for (int q = lane; q < kWgQueries && qt * kWgQueries + q < T; q += 32)
          tma::bulk_add_f32(dq_acc + base + int64_t(qt * kWgQueries + q) * ld, dQs + q * kDqStride, dh * 4);
        tma::bulk_commit();
        tma::bulk_wait_read();
        __syncwarp();
        if (lane == 0) tma::mbar_arrive(&dq_empty);
      }
      tma::bulk_wait();
      return;
    }
    if (r == 0) {
      tma::mbar_expect_tx(&kv_full, int(2 * kWgTile));
      for (int half = 0; half < 2; ++half) {
        tma::load_4d(Ks + half * kWgSlab, &k_map, 64 * half, f.h, k0, f.b, &kv_full);
        tma::load_4d(Vs + half * kWgSlab, &v_map, 64 * half, f.h, k0, f.b, &kv_full);
      }
    }
    for (int qt = first_qt, i = 0; qt < tiles; ++qt, ++i) {
      const int st = i % 2;
      if (i >= 2) tma::mbar_wait(&empty[st], (i / 2 - 1) % 2);
      if (r == 0) {
        tma::mbar_expect_tx(&full[st], int(2 * kWgQueryTile));
        for (int half = 0; half < 2; ++half) {
          const uint32_t at = st * kWgQueryTile + half * kWgQuerySlab;
          tma::load_4d(Qs + at, &q_map, 64 * half, f.h, qt * kWgQueries, f.b, &full[st]);
          tma::load_4d(dOs + at, &dout_map, 64 * half, f.h, qt * kWgQueries, f.b, &full[st]);
        }
      }
      const int t = qt * kWgQueries + r;  // rows past T: finite, contribute 0
      Ls[st * kWgQueries + r] = t < T ? lse[int64_t(bh) * T + t] : 0.f;
      Ds[st * kWgQueries + r] = t < T ? D[int64_t(bh) * T + t] : 0.f;
      tma::mbar_arrive(&full[st]);
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");
  const int wg = threadIdx.x / 128, wg_key0 = k0 + 64 * wg;  // this warpgroup's first key
  const int warp_key0 = wg_key0 + (threadIdx.x % 128 / 32) * 16;
  const int key_a = wg_key0 + wgmma::acc_row(0);  // this thread's keys: key_a, key_a + 8
  const uint32_t k_rows = smem_u32(Ks) + 64 * 128 * wg, v_rows = smem_u32(Vs) + 64 * 128 * wg;
  float dk_acc[64], dv_acc[64];
#pragma unroll
  for (int j = 0; j < 64; ++j) dk_acc[j] = dv_acc[j] = 0.f;

  tma::mbar_wait(&kv_full, 0);
  for (int qt = first_qt, i = 0; qt < tiles; ++qt, ++i) {
    const int st = i % 2, query0 = qt * kWgQueries;
    unsigned char* const dS = dSs + st * kWgQueryTile;
    tma::mbar_wait(&full[st], (i / 2) % 2);
    const uint32_t q_tile = smem_u32(Qs + st * kWgQueryTile), do_tile = smem_u32(dOs + st * kWgQueryTile);
    if (wg_key0 <= query0 + kWgQueries - 1) {  // some query of the tile sees some key of this warpgroup
      // Sᵀ and dPᵀ, 8 steps of 16 head dims each (4 per slab), issued together.
      float s[32], dp[32];
      wgmma::fence();
#pragma unroll
      for (int kk = 0; kk < 8; ++kk)
        wgmma::mma_m64n64k16<0, 0>(s, wgmma::k_major(k_rows + (kk / 4) * kWgSlab, kk % 4),
                                   wgmma::k_major(q_tile + (kk / 4) * kWgQuerySlab, kk % 4), kk > 0);
#pragma unroll
      for (int kk = 0; kk < 8; ++kk)
        wgmma::mma_m64n64k16<0, 0>(dp, wgmma::k_major(v_rows + (kk / 4) * kWgSlab, kk % 4),
                                   wgmma::k_major(do_tile + (kk / 4) * kWgQuerySlab, kk % 4), kk > 0);
      wgmma::commit();
      wgmma::wait<0>();
      softmax_grad_tile<8>(s, dp, key_a, query0, warp_key0 + 15 > query0, Ls + st * kWgQueries, Ds + st * kWgQueries);
      // Pᵀ and dSᵀ as A fragments, 16 queries a step, packed whole before the products; dSᵀ
      // also into shared memory (row: key, chunk: 8 queries).
      uint32_t pa[4][4], sa[4][4];
      a_fragments(pa, s);
      a_fragments(sa, dp);
#pragma unroll
      for (int j = 0; j < 32; j += 2) {  // elements j, j + 1: adjacent queries of one key
        const int row = 64 * wg + wgmma::acc_row(j), col = wgmma::acc_col(j);
        *reinterpret_cast<uint32_t*>(dS + wgmma::swizzled_chunk(row, col / 8) + 2 * (col % 8)) = sa[j / 8][(j % 8) / 2];
      }
      wgmma::fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma::mma_m64n128k16_rs<1>(dv_acc, pa[kk], wgmma::mn_major(do_tile, kWgQuerySlab, kk));
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma::mma_m64n128k16_rs<1>(dk_acc, sa[kk], wgmma::mn_major(q_tile, kWgQuerySlab, kk));
      wgmma::commit();
    } else {  // every key of this warpgroup comes after every query of the tile: dSᵀ rows zero
      for (int j = threadIdx.x % 128; j < 64 * 8; j += 128)
        *reinterpret_cast<uint4*>(dS + wgmma::swizzled_chunk(64 * wg + j / 8, j % 8)) = make_uint4(0, 0, 0, 0);
    }
    wgmma::fence_shared_for_async();
    bar_sync(kDsBarrier, kWgThreads);
    // dQ = dS K: warpgroup wg takes head dims 64 wg .. 64 wg + 63, 8 steps of 16 keys.
    float dq[32];
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
      wgmma::mma_m64n64k16<1, 1>(dq, wgmma::mn_major(smem_u32(dS), kWgQueryTile, kk),
                                 wgmma::mn_major(smem_u32(Ks) + wg * kWgSlab, kWgSlab, kk), kk > 0);
    wgmma::commit();
    wgmma::wait<0>();  // dV and dK's products too
    tma::mbar_arrive(&empty[st]);
    // This warpgroup's half of dQ staged for the copying warpgroup, once it has read the last tile.
    if (i > 0) tma::mbar_wait(&dq_empty, (i - 1) % 2);
#pragma unroll
    for (int j = 0; j < 32; j += 2)
      *reinterpret_cast<float2*>(dQs + wgmma::acc_row(j) * kDqStride + 64 * wg + wgmma::acc_col(j)) =
          make_float2(dq[j], dq[j + 1]);
    wgmma::fence_shared_for_async();
    tma::mbar_arrive(&dq_full);
  }
  store_dk_dv<16>(dk + int64_t(f.b) * T * grad_ld + int64_t(f.h) * dh, dv + base, dk_acc, dv_acc, key_a, T, dh, grad_ld,
                  ld, grad_scale);
}

// One head's rows of a [B, T, H, dh] tensor whose token rows are row_ld elements apart, as the
// 4D tensor {dh, H, T, B} in boxes of 64 head dims x box_rows rows of one head: reads past dh or T
// land as zeros.
CUtensorMap head_rows_map(const bf16* x, int64_t B, int64_t T, int64_t H, int64_t dh, int64_t row_ld, int box_rows) {
  const cuuint64_t e = sizeof(bf16);
  return tma::bf16_map<4>(x, {cuuint64_t(dh), cuuint64_t(H), cuuint64_t(T), cuuint64_t(B)},
                          {dh * e, row_ld * e, T * row_ld * e}, {64, 1, cuuint32_t(box_rows), 1});
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
  // Head sizes 97..128 on wgmma when tensor copies can take the rows, others on mma.sync.
  if (kD == 128 && head_rows_by_tensor_copies(dh, qk_ld, {q, k, v, out})) {
    const CUtensorMap q_map = head_rows_map(q, B, T, H, dh, qk_ld, kWgKeys),
                      k_map = head_rows_map(k, B, T, H, dh, qk_ld, kWgKeys),
                      v_map = head_rows_map(v, B, T, H, dh, H * dh, kWgKeys);
    MOEUT_CUDA_CHECK(cudaFuncSetAttribute(flash_forward_wgmma, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kFwdSmem)));
    flash_forward_wgmma<<<flash_blocks(B, T, H), kFwdThreads, kFwdSmem, stream>>>(out, lse, int(T), int(H), int(dh), q_map,
                                                                                  k_map, v_map);
  } else {
    const size_t bytes = sizeof(bf16) * (kFlashBlockRows + 4 * kFlashTileRows) * (kD + 8);
    MOEUT_CUDA_CHECK(cudaFuncSetAttribute(flash_forward<kD>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
    flash_forward<kD><<<flash_blocks(B, T, H), kFlashThreads, bytes, stream>>>(out, lse, q, k, v, int(T), int(H), int(dh),
                                                                                qk_ld);
  }
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

template <int kD>
void launch_flash_backward(bf16* dk, bf16* dv, float* dq_acc, const bf16* dout, const float* lse, const float* D,
                           const bf16* q, const bf16* k, const bf16* v, int64_t B, int64_t T, int64_t H, int64_t dh,
                           int64_t grad_ld, float grad_scale, int64_t qk_ld, cudaStream_t stream) {
  if (kD == 128 && head_rows_by_tensor_copies(dh, qk_ld, {q, k, v, dout})) {
    const CUtensorMap q_map = head_rows_map(q, B, T, H, dh, qk_ld, kWgQueries),
                      dout_map = head_rows_map(dout, B, T, H, dh, H * dh, kWgQueries),
                      k_map = head_rows_map(k, B, T, H, dh, qk_ld, kWgKeys),
                      v_map = head_rows_map(v, B, T, H, dh, H * dh, kWgKeys);
    MOEUT_CUDA_CHECK(
        cudaFuncSetAttribute(flash_backward_wgmma, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kWgBackwardSmem)));
    flash_backward_wgmma<<<flash_blocks(B, T, H), kBwdThreads, kWgBackwardSmem, stream>>>(
        dk, dv, dq_acc, lse, D, int(T), int(H), int(dh), grad_ld, grad_scale, q_map, dout_map, k_map, v_map);
  } else {
    const size_t bytes = sizeof(bf16) * ((2 * kFlashBlockRows + 4 * kFlashTileRows) * (kD + 8) +
                                         kFlashBlockRows * (kFlashTileRows + 8)) +
                         sizeof(float) * 4 * kFlashTileRows;
    MOEUT_CUDA_CHECK(cudaFuncSetAttribute(flash_backward<kD>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
    flash_backward<kD><<<flash_blocks(B, T, H), kFlashThreads, bytes, stream>>>(
        dk, dv, dq_acc, dout, lse, D, q, k, v, int(T), int(H), int(dh), grad_ld, grad_scale, qk_ld);
  }
  MOEUT_CUDA_CHECK(cudaGetLastError());
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
