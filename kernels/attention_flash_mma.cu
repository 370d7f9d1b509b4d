// Flash-style attention on mma.sync, forward and backward: head sizes up to 96, and 97..128 where
// tensor copies cannot take the rows (else attention_flash_wgmma.cu).
// ---- Flash-style forward: no T×T scores in memory ----
// One block: 128 query rows of one (sequence, head), 8 warps of 16 rows, keys taken 64 at a time
// (causal: only tiles at or below the diagonal; a warp skips a tile that is all above its rows).
// Per tile: S = Q Kᵀ on mma.sync m16n8k16, an online softmax in registers (running max and sum
// per row), P rounded to bf16 and O += P V. 128 rows per block read each key tile once for twice
// the rows of a 64-row block, and two such blocks per SM keep 16 warps in flight.
// kD: the head size padded to a multiple of 16 (zeros in the padding). Shared memory rows are
// padded by 8 elements so ldmatrix's 8 row addresses fall in different banks.
// ---- Flash-style backward ----
// Head sizes up to 96 (above: flash_backward_wgmma, attention_flash_wgmma.cu). One block: 128 keys
// of one (sequence, head), 8 warps of 16 keys, dK and dV accumulated in registers over the 64-row
// query tiles at and below the diagonal (a warp whose keys all come after a tile's queries skips
// it). Per query tile: Sᵀ = K Qᵀ, Pᵀ = exp2(Sᵀ - lse),
// dV += Pᵀ dO, dPᵀ = V dOᵀ, dSᵀ = Pᵀ (dPᵀ - D), dK += dSᵀ Q; dSᵀ goes through shared memory for
// dQ += dS K (each warp 16 queries x half the head dims, over the live keys), which is added into
// an fp32 accumulator atomically (every key tile adds to the same query rows): 128 keys per block
// halve those additions against 64. dk: rows grad_ld apart, times grad_scale.
#include "kernels/attention_device.cuh"
#include "kernels/attention_schedule.cuh"
#include "kernels/cuda_check.h"
#include "kernels/fast_exp.cuh"
#include "kernels/lane_reduce.cuh"

namespace moeut::cuda {
namespace {

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

}  // namespace

template <int kD>
void launch_flash_forward_mma(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int64_t B, int64_t T,
                              int64_t H, int64_t dh, int64_t qk_ld, cudaStream_t stream) {
  const size_t bytes = sizeof(bf16) * (kFlashBlockRows + 4 * kFlashTileRows) * (kD + 8);
  MOEUT_CUDA_CHECK(cudaFuncSetAttribute(flash_forward<kD>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
  flash_forward<kD><<<flash_blocks(B, T, H), kFlashThreads, bytes, stream>>>(out, lse, q, k, v, int(T), int(H), int(dh),
                                                                              qk_ld);
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

template <int kD>
void launch_flash_backward_mma(bf16* dk, bf16* dv, float* dq_acc, const bf16* dout, const float* lse, const float* D,
                               const bf16* q, const bf16* k, const bf16* v, int64_t B, int64_t T, int64_t H, int64_t dh,
                               int64_t grad_ld, float grad_scale, int64_t qk_ld, cudaStream_t stream) {
  const size_t bytes = sizeof(bf16) * ((2 * kFlashBlockRows + 4 * kFlashTileRows) * (kD + 8) +
                                       kFlashBlockRows * (kFlashTileRows + 8)) +
                       sizeof(float) * 4 * kFlashTileRows;
  MOEUT_CUDA_CHECK(cudaFuncSetAttribute(flash_backward<kD>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
  flash_backward<kD><<<flash_blocks(B, T, H), kFlashThreads, bytes, stream>>>(
      dk, dv, dq_acc, dout, lse, D, q, k, v, int(T), int(H), int(dh), grad_ld, grad_scale, qk_ld);
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

// The head sizes CausalAttention runs (with_ceiling<32, 64, 96, 128>).
template void launch_flash_forward_mma<32>(bf16*, float*, const bf16*, const bf16*, const bf16*, int64_t, int64_t,
                                           int64_t, int64_t, int64_t, cudaStream_t);
template void launch_flash_forward_mma<64>(bf16*, float*, const bf16*, const bf16*, const bf16*, int64_t, int64_t,
                                           int64_t, int64_t, int64_t, cudaStream_t);
template void launch_flash_forward_mma<96>(bf16*, float*, const bf16*, const bf16*, const bf16*, int64_t, int64_t,
                                           int64_t, int64_t, int64_t, cudaStream_t);
template void launch_flash_forward_mma<128>(bf16*, float*, const bf16*, const bf16*, const bf16*, int64_t, int64_t,
                                            int64_t, int64_t, int64_t, cudaStream_t);
template void launch_flash_backward_mma<32>(bf16*, bf16*, float*, const bf16*, const float*, const float*, const bf16*,
                                            const bf16*, const bf16*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                            float, int64_t, cudaStream_t);
template void launch_flash_backward_mma<64>(bf16*, bf16*, float*, const bf16*, const float*, const float*, const bf16*,
                                            const bf16*, const bf16*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                            float, int64_t, cudaStream_t);
template void launch_flash_backward_mma<96>(bf16*, bf16*, float*, const bf16*, const float*, const float*, const bf16*,
                                            const bf16*, const bf16*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                            float, int64_t, cudaStream_t);
template void launch_flash_backward_mma<128>(bf16*, bf16*, float*, const bf16*, const float*, const float*, const bf16*,
                                             const bf16*, const bf16*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                             float, int64_t, cudaStream_t);

}  // namespace moeut::cuda
