// cvmm_rows for the gathered products of one band (N = 128, K a multiple of 64 above 128, 16-byte
// aligned rows and weights), stored or added into fp32 rows: the FFN's up product and its down
// input gradient, the attention's value product and output input gradient. The
// per-tile kernel reads its expert's weight once per 128-row tile, half of what it moves through
// L2 at 1B (393 KB per tile). A 256-row tile halves that, but at one block per SM the per-tile
// kernel's step barriers go uncovered, and copying warps issuing every 16-byte copy could not
// keep up. So:
// - Persistent blocks take the plan's tile pairs (256 rows of one expert) in order from the plan's
//   counter, each as it finishes one, so the blocks in flight share their experts' weights in L2. (The
//   pairs are not listed rank by rank for the token rows' sake: sharing the weights matters more.)
// - Two copying warpgroups (40 registers a thread, `setmaxnreg`) fill four 48 KB stages, as far
//   ahead as the stages allow: a pair's row lookups into its slot (two slots), then per 64-deep
//   step the gathered rows' slab (32 KB) by cp.async and the weight slab (16 KB) by one thread's
//   tensor copy.
//   Stage s is full on its mbarrier: each copying thread's copies arrive on it as they land
//   (cp.async.mbarrier.arrive.noinc), the slab by its byte count.
// - Two multiplying warpgroups (216 registers a thread), 128 rows each, store their rows from the
//   accumulators while the copies of the next pair go on.
// - Named barriers: stage s empty (products done), slot j free (its pair's outputs stored). Each
//   counts all 512 threads; nobody arrives at one that no one will wait on.
#include <map>
#include <tuple>

#include "kernels/cuda_check.h"
#include "kernels/cvmm_cuda.h"
#include "kernels/cvmm_device.cuh"
#include "kernels/lane_reduce.cuh"
#include "kernels/named_barrier.cuh"
#include "kernels/tma.cuh"
#include "kernels/wgmma.cuh"

namespace moeut::cuda {
namespace {

constexpr int kGatherRows = 2 * BM, kGatherStages = 4, kGatherCopyThreads = 256;
constexpr int kGatherThreads = 2 * 128 + kGatherCopyThreads;
constexpr int kGatherSlabA = kGatherRows * BK * 2, kGatherStageBytes = kGatherSlabA + kSlabB;
constexpr size_t kGatherSmemBytes = kSmemAlign + size_t(kGatherStages) * kGatherStageBytes;
enum GatherBarrier { kStageEmpty = 1, kSlotFree = kStageEmpty + kGatherStages, kSlotWritten = kSlotFree + 2 };
static_assert(kSlotWritten < 16, "16 named barriers per block");

template <bool kTransW>
__global__ void __launch_bounds__(kGatherThreads, 1)
    cvmm_gather_kernel(CvmmPlan plan, CvmmRowsArgs a, const __grid_constant__ CUtensorMap weights) {
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = aligned_smem(smem_raw);
  __shared__ TileRowsOf<kGatherRows> slot[2];
  // Stage s is full when every copying thread's row copies and the weight slab's tensor copy
  // have landed.
  __shared__ alignas(8) uint64_t full[kGatherStages];
  if (threadIdx.x < kGatherStages) tma::mbar_init(&full[threadIdx.x], kGatherCopyThreads + 1);
  tma::fence_barrier_init();
  __syncthreads();
  const int64_t K = a.K, N = a.N;
  const int steps = int(K / BK), pairs = *plan.live_pairs;
  // The blocks take the pairs in order from the plan's counter (tail_counters[0]), each as it
  // gets to them, so that they end together however late each starts and whatever its pairs
  // cost (a fixed round-robin deal leaves late-starting blocks ending last), and the blocks in
  // flight still share their experts' weights in L2.
  // The copying warps take pair j + 1 while they load pair j and tell the multiplying ones each
  // pair's rows through pair_rows[j % 2] (-1: no pair j, the end), which the stage barrier of
  // its first step covers.
  __shared__ int pair_rows[2], pair_index[2];
  struct Pair {
    int expert, first, rows;
  };
  auto pair_at = [&](int index) {
    const int tile = plan.pair_tile[index];
    Pair p{plan.tile_expert[tile], plan.tile_first[tile], 0};
    p.rows = int(min64(kGatherRows, plan.expert_begin[p.expert + 1] - p.first));
    return p;
  };

  if (threadIdx.x >= 2 * 128) {  // the copying warpgroups
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    const int thread = threadIdx.x - 2 * 128;
    // A copying thread brings the same 16-byte chunk (column kc) of kCopyRows rows of the pair,
    // every kRowStride-th from row0, in every step. Issuing these copies bounds this kernel, so
    // the rows are read from the slot once per pair, and as K is whole slabs and the rows 16-byte
    // aligned, each copy is whole (zeros for rows past the pair's end) at a shared-memory offset
    // fixed for the pair: a multiply-add and the copy.
    constexpr int kChunks = BK / 8, kRowStride = kGatherCopyThreads / kChunks, kCopyRows = kGatherRows / kRowStride;
    const int kc = thread % kChunks, row0 = thread / kChunks, Kc = int(K);
    const uint32_t chunk_at = wgmma::swizzled_chunk(row0, kc);  // row row0 + i·kRowStride: + i·kRowStride·128
    int g = 0;  // steps issued
    // Thread 0 takes pair j + 1 once pair j's copies are issued: its wait for the reply then falls
    // where the copying warps wait for a free slot anyway.
    if (thread == 0) pair_index[0] = int(atomicAdd(&plan.tail_counters[0], 1u));
    for (int j = 0;; ++j) {
      TileRowsOf<kGatherRows>& sl = slot[j % 2];
      if (j >= 2) bar_sync(kSlotFree + j % 2, kGatherThreads);  // pair j - 2's outputs are stored
      bar_sync(kSlotWritten, kGatherCopyThreads);  // pair j's index to every copying thread
      const int index = pair_index[j % 2];
      const int stage = g % kGatherStages;
      if (index >= pairs) {
        // The end: step g's stage, once free, completes with no copies, and pair_rows says -1.
        // Then the arrivals the multiplying warps made for nobody yet: the last three steps'
        // stages and pair j - 1's slot.
        if (g >= kGatherStages) bar_sync(kStageEmpty + stage, kGatherThreads);
        if (thread == 0) {
          pair_rows[j % 2] = -1;
          tma::mbar_expect_tx(&full[stage], 0);
        }
        tma::mbar_arrive_on_copies(&full[stage]);
        for (int later = g + 1; later < g + kGatherStages; ++later)
          if (later >= kGatherStages) bar_sync(kStageEmpty + later % kGatherStages, kGatherThreads);
        if (j >= 1) bar_sync(kSlotFree + (j + 1) % 2, kGatherThreads);
        break;
      }
      const Pair p = pair_at(index);
      if (thread == 0) pair_rows[j % 2] = p.rows;
      look_up_rows(sl, plan, a.weight, p.first, p.rows, thread, kGatherCopyThreads);
      bar_sync(kSlotWritten, kGatherCopyThreads);  // every copying thread gathers rows another one looked up
      int32_t rows[kCopyRows];
#pragma unroll
      for (int i = 0; i < kCopyRows; ++i) rows[i] = sl.in[row0 + i * kRowStride];
      for (int kt = 0; kt < steps; ++kt, ++g) {
        const int stage = g % kGatherStages;
        if (g >= kGatherStages) bar_sync(kStageEmpty + stage, kGatherThreads);  // step g - 4's products done
        unsigned char* as = smem + stage * kGatherStageBytes;
        if (thread == 0) {  // the weight slab: one tensor copy ([N][K]: 128 rows of 64) or two ([K][N]: 64 x 64 each)
          tma::mbar_expect_tx(&full[stage], kSlabB);
          if constexpr (kTransW) {
            tma::load_2d(as + kGatherSlabA, &weights, kt * BK, p.expert * int(N), &full[stage]);
          } else {
            for (int h = 0; h < 2; ++h)
              tma::load_2d(as + kGatherSlabA + h * (BK * 128), &weights, h * 64, p.expert * int(K) + kt * BK, &full[stage]);
          }
        }
        const bf16* x = a.X + kt * BK + kc * 8;
#pragma unroll
        for (int i = 0; i < kCopyRows; ++i)
          cp_async16(as + chunk_at + i * kRowStride * 128, x + int64_t(max(rows[i], 0)) * Kc, rows[i] < 0 ? 0 : 16);
        tma::mbar_arrive_on_copies(&full[stage]);
      }
      if (thread == 0) pair_index[(j + 1) % 2] = int(atomicAdd(&plan.tail_counters[0], 1u));
    }
    if (thread == 0) release_tail_counters(plan, 1);  // every pair taken answered
    return;
  }

  // The multiplying warpgroups: warpgroup wg's fragment f holds rows (2·wg + f)·64 onwards.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 216;\n" ::: "memory");
  const int wg = threadIdx.x / 128;
  auto fragment_row = [&](int f) { return (2 * wg + f) * 64; };
  using Relu = CvmmRowsArgs::Relu;
  const bool masked = a.relu == Relu::kMaskByDotRows;
  int g = 0;  // steps consumed
  for (int j = 0;; ++j) {
    tma::mbar_wait(&full[g % kGatherStages], (g / kGatherStages) % 2);  // pair j's first step, or the end
    const int rows = pair_rows[j % 2];
    if (rows < 0) break;
    float acc[2][64];
#pragma unroll
    for (auto& fragment : acc)
#pragma unroll
      for (auto& v : fragment) v = 0.f;
    // A warpgroup whose rows are all past the pair's end idles; one with some multiplies both
    // fragments (rows past the end are zeros: a branch per fragment serialises the products,
    // ptxas C7520).
    const bool live = fragment_row(0) < rows;
    for (int kt = 0; kt < steps; ++kt, ++g) {
      const int stage = g % kGatherStages;
      tma::mbar_wait(&full[stage], (g / kGatherStages) % 2);
      wgmma::fence_shared_for_async();  // the copies' writes, before the products read them
      if (live) {
        const unsigned char* as = smem + stage * kGatherStageBytes;
        wgmma::fence();
#pragma unroll
        for (int f = 0; f < 2; ++f) mma_slab<kTransW>(acc[f], as, as + kGatherSlabA, fragment_row(f));
        wgmma::commit();
        wgmma::wait<0>();
      }
      bar_arrive(kStageEmpty + stage, kGatherThreads);  // the copying warps sync every one, at the end too
    }
    // Outputs from the accumulators: a thread holds two rows per fragment (accumulator elements
    // e with e / 2 even and odd), two adjacent columns per element pair. The routing-weight
    // gradient sums each row over its 4 threads' columns.
    const TileRowsOf<kGatherRows>& sl = slot[j % 2];
#pragma unroll
    for (int f = 0; f < 2; ++f) {
      // The fragment's dot_rows pairs, all loaded before any is used (one at a time, each load
      // would wait behind the previous pair's store).
      uint32_t dots[32];
#pragma unroll
      for (int e = 0; e < 64; e += 2) {
        const int r = fragment_row(f) + wgmma::acc_row(e);
        dots[e / 2] = (a.dweight || masked) && r < rows
                          ? *reinterpret_cast<const uint32_t*>(a.dot_rows + int64_t(sl.out[r]) * N + wgmma::acc_col(e))
                          : 0u;
      }
      float dot_sum[2] = {0.f, 0.f};
#pragma unroll
      for (int e = 0; e < 64; e += 2) {
        const int r = fragment_row(f) + wgmma::acc_row(e), c = wgmma::acc_col(e);
        if (r >= rows) continue;
        const int64_t at = int64_t(sl.out[r]) * N + c;
        const float2 dot = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&dots[e / 2]));
        dot_sum[(e / 2) % 2] += acc[f][e] * dot.x + acc[f][e + 1] * dot.y;
        const float w = sl.weight[r];
        float v0 = w * acc[f][e], v1 = w * acc[f][e + 1];
        if (a.relu == Relu::kApply) v0 = fmaxf(v0, 0.f), v1 = fmaxf(v1, 0.f);
        if (masked) v0 = dot.x > 0.f ? v0 : 0.f, v1 = dot.y > 0.f ? v1 : 0.f;
        if (a.accumulate) atomicAdd(reinterpret_cast<float2*>(a.out_f32 + at), make_float2(v0, v1));
        else *reinterpret_cast<__nv_bfloat162*>(a.out + at) = __floats2bfloat162_rn(v0, v1);
      }
      if (a.dweight) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float sum = group_sum<4>(dot_sum[h]);
          const int r = fragment_row(f) + wgmma::acc_row(2 * h);
          if (threadIdx.x % 4 == 0 && r < rows) atomicAdd(a.dweight + sl.sel[r], sum);
        }
      }
    }
    bar_arrive(kSlotFree + j % 2, kGatherThreads);
  }
}

// The expert weights as a 2D tensor for the gather kernel's weight slabs, 128-byte swizzled
// boxes: [N][K] (kTransW) as rows of K with boxes of 128 rows x 64, [K][N] as rows of N with boxes
// of 64 x 64. Made once per weight (the parameters do not move).
CUtensorMap weight_map(const CvmmRowsArgs& a) {
  thread_local std::map<std::tuple<const void*, int64_t, int64_t, bool>, CUtensorMap> maps;
  const auto key = std::make_tuple(static_cast<const void*>(a.W), a.K, a.N, a.transpose_w);
  if (auto it = maps.find(key); it != maps.end()) return it->second;
  // Rows: an upper bound on every expert's (the expert count is not passed). The bound only
  // matters to boxes that cross the tensor's end, and every box lies inside one expert's weight.
  const CUtensorMap map = tensor_map(a.W, a.transpose_w ? a.K : a.N, int64_t(1) << 30, a.transpose_w ? BN : BK);
  maps.emplace(key, map);
  return map;
}

}  // namespace

template <bool kTransW>
void launch_gather(const CvmmPlan& plan, const CvmmRowsArgs& a, cudaStream_t stream) {
  launch_with_smem(cvmm_gather_kernel<kTransW>, dim3(unsigned(device_facts().multiprocessors)), kGatherThreads,
                   kGatherSmemBytes, stream, plan, a, weight_map(a));
}
template void launch_gather<true>(const CvmmPlan&, const CvmmRowsArgs&, cudaStream_t);
template void launch_gather<false>(const CvmmPlan&, const CvmmRowsArgs&, cudaStream_t);

}  // namespace moeut::cuda
