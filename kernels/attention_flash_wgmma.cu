// Flash-style attention on wgmma, forward and backward: head sizes 97..128 when tensor copies can
// take the rows (else attention_flash_mma.cu).
// ---- Flash-style forward on wgmma (head size 128) ----
// One block: 128 query rows of one (sequence, head) in two warpgroups of 64, keys taken 128 at a
// time. S = Q Kᵀ reads Q and the key tile from shared memory; P, rounded to bf16 in registers, is
// the A operand of O += P V (an m64n128 accumulator's layout is the A fragment's, 16 keys per
// step). Against the mma.sync kernel (attention_flash_mma.cu), each key tile is read from shared
// memory once per 64 rows instead of once per 16. Tiles use wgmma.cuh's 128-byte swizzled layout,
// two 64-column slabs per 128-wide head; K and V in three stages (32 KB each), Q 32 KB: 224 KB,
// one block per SM.
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
#include "kernels/attention_device.cuh"
#include "kernels/attention_schedule.cuh"
#include "kernels/cuda_check.h"
#include "kernels/fast_exp.cuh"
#include "kernels/lane_reduce.cuh"
#include "kernels/named_barrier.cuh"
#include "kernels/tma.cuh"
#include "kernels/wgmma.cuh"

namespace moeut::cuda {
namespace {

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

}  // namespace

void launch_flash_forward_wgmma(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int64_t B,
                                int64_t T, int64_t H, int64_t dh, int64_t qk_ld, cudaStream_t stream) {
  const CUtensorMap q_map = head_rows_map(q, B, T, H, dh, qk_ld, kWgKeys),
                    k_map = head_rows_map(k, B, T, H, dh, qk_ld, kWgKeys),
                    v_map = head_rows_map(v, B, T, H, dh, H * dh, kWgKeys);
  MOEUT_CUDA_CHECK(cudaFuncSetAttribute(flash_forward_wgmma, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kFwdSmem)));
  flash_forward_wgmma<<<flash_blocks(B, T, H), kFwdThreads, kFwdSmem, stream>>>(out, lse, int(T), int(H), int(dh), q_map,
                                                                                k_map, v_map);
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

void launch_flash_backward_wgmma(bf16* dk, bf16* dv, float* dq_acc, const bf16* dout, const float* lse, const float* D,
                                 const bf16* q, const bf16* k, const bf16* v, int64_t B, int64_t T, int64_t H,
                                 int64_t dh, int64_t grad_ld, float grad_scale, int64_t qk_ld, cudaStream_t stream) {
  const CUtensorMap q_map = head_rows_map(q, B, T, H, dh, qk_ld, kWgQueries),
                    dout_map = head_rows_map(dout, B, T, H, dh, H * dh, kWgQueries),
                    k_map = head_rows_map(k, B, T, H, dh, qk_ld, kWgKeys),
                    v_map = head_rows_map(v, B, T, H, dh, H * dh, kWgKeys);
  MOEUT_CUDA_CHECK(
      cudaFuncSetAttribute(flash_backward_wgmma, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kWgBackwardSmem)));
  flash_backward_wgmma<<<flash_blocks(B, T, H), kBwdThreads, kWgBackwardSmem, stream>>>(
      dk, dv, dq_acc, lse, D, int(T), int(H), int(dh), grad_ld, grad_scale, q_map, dout_map, k_map, v_map);
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeut::cuda
