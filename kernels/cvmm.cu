// cvmm on the GPU: see cvmm_cuda.h. Hopper tensor-core tiles (wgmma, bf16 -> fp32) over the
// selections of one expert; row gathers happen in the tile loads, weights and scatters in the
// epilogue (row products) or in shared memory (weight gradients).
#include <algorithm>
#include <map>
#include <tuple>
#include <type_traits>
#include <vector>

#include <cstdio>
#include <stdexcept>
#include <string>

#include "kernels/cuda_check.h"
#include "kernels/cvmm_cuda.h"
#include "kernels/named_barrier.cuh"
#include "kernels/tma.cuh"
#include "kernels/wgmma.cuh"
#include "kernels/lane_reduce.cuh"

namespace moeut::cuda {
namespace {

using bf16 = __nv_bfloat16;

__host__ __device__ inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// 16-byte vector access needs both a row width that keeps rows 16-byte apart (multiple of 8
// elements) and a 16-byte aligned base: tensors inside one parameter buffer need not start on
// one.
__host__ __device__ inline bool vectorizable(const void* base, int64_t width) {
  return width % 8 == 0 && reinterpret_cast<uintptr_t>(base) % 16 == 0;
}
constexpr int kPadC = 4;  // fp32 epilogue rows 16 bytes apart in banks

// 16-byte asynchronous copy; src_bytes 0 writes zeros without reading (rows past a tile's end).
__device__ inline void cp_async16(void* smem, const void* gmem, int src_bytes = 16) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(gmem), "r"(src_bytes));
}
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ inline void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Copies 8 consecutive bf16 from src (valid: how many of them exist) into dst; 16-byte
// asynchronous copy when whole and aligned (zeros when none is valid), element by element with
// zero fill otherwise.
__device__ inline void load8(bf16* dst, const bf16* src, int valid, bool aligned) {
  if (valid <= 0 || (valid >= 8 && aligned)) {
    cp_async16(dst, src, valid > 0 ? 16 : 0);
  } else {
    for (int i = 0; i < 8; ++i) dst[i] = i < valid ? src[i] : __float2bfloat16(0.f);
  }
}

// Three stages keep two blocks per SM (96 KB each; registers allow no more), and give products
// with K <= 128 (two k-steps) both steps' copies in flight at once.
constexpr int kStages = 3;

// The main loop shared by the kernels below: `steps` steps through a cp.async pipeline of kStages
// shared-memory stages, copies issued kStages - 1 steps ahead. load(stage, step) issues a step's
// copies; landed(stage, step) runs in each thread on its own copies once they have landed;
// mma(stage) issues the warpgroup's products and commits them. Each step waits for its products
// before the next begins, so a stage is refilled only after a barrier that every thread reaches
// with its products done. (Leaving one group of products running would need a fourth stage, which
// costs the second block per SM.)
template <class Load, class Landed, class Mma>
__device__ __forceinline__ void pipeline(int steps, Load load, Landed landed, Mma mma) {
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < steps) load(s, s);
    cp_async_commit();
  }
  for (int t = 0; t < steps; ++t) {
    cp_async_wait<kStages - 2>();
    landed(t % kStages, t);
    wgmma::fence_shared_for_async();
    __syncthreads();
    mma(t % kStages);
    if (t + kStages - 1 < steps) load((t + kStages - 1) % kStages, t + kStages - 1);
    cp_async_commit();
    wgmma::wait<0>();
  }
  cp_async_wait<0>();
  __syncthreads();
}

// The row products' pieces: 128 selections of one expert x 128 output columns per tile, two
// warpgroups (wgmma m64n128k16, 64 rows each), K in slabs of 64 in the 128-byte swizzled layout.
// A (gathered rows) is K-major; B is K-major when W_e is stored [N][K] (kTransW) and MN-major when
// stored [K][N].
constexpr int BM = kCvmmTileRows, BN = 128, BK = 64, kRowsThreads = 256;
constexpr int kSlabA = BM * BK * 2, kSlabB = BN * BK * 2, kStageBytes = kSlabA + kSlabB, kCStride = BN + kPadC;
constexpr size_t kSmemAlign = 1024;  // swizzled slabs start 1024-byte aligned
__device__ __forceinline__ unsigned char* aligned_smem(unsigned char* raw) {
  return reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(raw) + kSmemAlign - 1) & ~uintptr_t(kSmemAlign - 1));
}

// A tile's selections, looked up once into shared memory: input and output rows, the selection
// itself (routing-weight gradients) and its routing weight.
template <int R>
struct TileRowsOf {
  int32_t in[R], out[R], sel[R];
  float weight[R];
};
using TileRows = TileRowsOf<BM>;
// The R rows from position `first`, `rows` of them live, looked up by `threads` threads of which
// this is `thread`.
template <int R>
__device__ __forceinline__ void look_up_rows(TileRowsOf<R>& t, const CvmmPlan& plan, const float* weight, int first,
                                             int rows, int thread, int threads) {
  for (int r = thread; r < R; r += threads) {
    const bool live = r < rows;
    const int s = live ? plan.by_expert[first + r] : -1;
    t.sel[r] = s;
    t.in[r] = live ? plan.in_row[first + r] : -1;
    t.out[r] = live ? plan.out_row[first + r] : -1;
    t.weight[r] = live && weight ? weight[s] : 1.f;
  }
}
// Plan tile `tile` into t by the whole block; returns how many rows are live.
__device__ int load_tile_rows(TileRows& t, const CvmmPlan& plan, const float* weight, int tile, int& expert) {
  expert = plan.tile_expert[tile];
  const int first = plan.tile_first[tile];
  const int rows = int(min64(BM, plan.expert_begin[expert + 1] - first));
  look_up_rows(t, plan, weight, first, rows, threadIdx.x, blockDim.x);
  __syncthreads();
  return rows;
}

// One 64-deep slab of the tile's BM gathered rows, from column k0 of X [*, K], by the block.
__device__ __forceinline__ void load_rows_slab(unsigned char* as, const bf16* X, const int32_t* in, int64_t K, int64_t k0,
                                               bool aligned) {
  for (int c = threadIdx.x; c < BM * BK / 8; c += kRowsThreads) {
    const int r = c / (BK / 8), kc = c % (BK / 8);
    const int valid = in[r] < 0 ? 0 : int(min64(8, K - (k0 + kc * 8)));
    load8(reinterpret_cast<bf16*>(as + wgmma::swizzled_chunk(r, kc)), X + int64_t(max(in[r], 0)) * K + k0 + kc * 8,
          valid, aligned);
  }
}
// One 64-deep slab of W_e's 128 columns from n0: [N][K] rows n (kTransW), or [K][N] rows k as two
// slabs of 64 n.
template <bool kTransW>
__device__ __forceinline__ void load_weight_slab(unsigned char* bs, const bf16* We, int64_t K, int64_t N, int64_t k0,
                                                 int64_t n0, bool aligned) {
  if constexpr (kTransW) {
    for (int c = threadIdx.x; c < BN * BK / 8; c += kRowsThreads) {
      const int n = c / (BK / 8), kc = c % (BK / 8);
      const int valid = n0 + n < N ? int(min64(8, K - (k0 + kc * 8))) : 0;
      load8(reinterpret_cast<bf16*>(bs + wgmma::swizzled_chunk(n, kc)), We + (n0 + n) * K + k0 + kc * 8, valid, aligned);
    }
  } else {
    for (int c = threadIdx.x; c < BK * BN / 8; c += kRowsThreads) {
      const int k = c / (BN / 8), nc = c % (BN / 8);
      const int valid = k0 + k < K ? int(min64(8, N - (n0 + nc * 8))) : 0;
      load8(reinterpret_cast<bf16*>(bs + (nc / 8) * (BK * 128) + wgmma::swizzled_chunk(k, nc % 8)),
            We + (k0 + k) * N + n0 + nc * 8, valid, aligned);
    }
  }
}
// acc += the 64 rows from row0 of the slab at `as` times the weight slab at `bs`.
template <bool kTransW>
__device__ __forceinline__ void mma_slab(float (&acc)[64], const unsigned char* as, const unsigned char* bs, int row0) {
  const uint32_t a_addr = wgmma::smem_address(as + row0 * 128), b_addr = wgmma::smem_address(bs);
#pragma unroll
  for (int k16 = 0; k16 < BK / 16; ++k16) {
    const uint64_t b = kTransW ? wgmma::k_major(b_addr, k16) : wgmma::mn_major(b_addr, BK * 128, k16);
    wgmma::mma_m64n128k16<0, kTransW ? 0 : 1>(acc, wgmma::k_major(a_addr, k16), b, true);
  }
}

// The epilogues go through shared memory in fp32, a [128][kCStride] tile over the finished stages.
constexpr size_t kSmemBytes = kSmemAlign + std::max<size_t>(size_t(kStages) * kStageBytes, sizeof(float) * BM * kCStride);

// This warpgroup's accumulators into its 64 rows of the tile.
__device__ __forceinline__ void store_acc(float* Cs, const float (&acc)[64], int wg) {
#pragma unroll
  for (int j = 0; j < 64; ++j) Cs[(wg * 64 + wgmma::acc_row(j)) * kCStride + wgmma::acc_col(j)] = acc[j];
}

// dst(r)[0, n) += Cs[r][0, n) (add) or = Cs[r][0, n) for r < rows, by the L2's bulk reduction or
// bulk copy: one asynchronous copy of a whole row per thread. Needs n % 4 == 0 and 16-byte aligned
// destinations. Returns once shared memory has been read.
template <class Row>
__device__ __forceinline__ void write_rows_async(const float* Cs, int rows, int n, Row dst, bool add) {
  wgmma::fence_shared_for_async();  // this thread's writes to Cs, visible to the copy engine
  __syncthreads();
  for (int r = threadIdx.x; r < rows; r += blockDim.x) {
    if (add)
      tma::bulk_add_f32(dst(r), Cs + r * kCStride, n * 4);
    else
      tma::bulk_store(dst(r), Cs + r * kCStride, n * 4);
  }
  tma::bulk_commit();
  tma::bulk_wait_read();
}
__host__ __device__ inline bool rows_addable(const float* base, int64_t width, int64_t n) {
  return width % 4 == 0 && n % 4 == 0 && reinterpret_cast<uintptr_t>(base) % 16 == 0;
}

// The routing-weight gradient (see CvmmRowsArgs) of a tile: dweight[sel(r)] += Σ_n C[r][n] ·
// dot_rows[out(r)][n0 + n] over its live rows, from the unweighted fp32 tile C, whose 16-byte
// chunk c (columns 4c to 4c + 3) of row r is at c_chunk(r, c). Threads 0-255 take part: 16 per
// row, 8 columns each (one 16-byte load of dot_rows), summed by shuffles within the 16. A thread
// loads all its rows before summing any, so that no load waits behind the previous row's atomic
// in an L2 the scatter keeps busy.
template <class Chunk>
__device__ __forceinline__ void routing_weight_grad(const CvmmRowsArgs& a, Chunk c_chunk, const int32_t* out,
                                                    const int32_t* sel, int rows, int64_t N, int n0, int n_valid) {
  constexpr int kRowsPerThread = BM / (kRowsThreads / 16);
  const int n = (threadIdx.x % 16) * 8;
  const bool whole = n_valid == BN && vectorizable(a.dot_rows, N);
  uint4 dots[kRowsPerThread];
#pragma unroll
  for (int p = 0; p < kRowsPerThread; ++p) {
    const int r = threadIdx.x / 16 + p * (kRowsThreads / 16);
    const bf16* dot = a.dot_rows + int64_t(max(out[r], 0)) * N + n0 + n;
    if (r >= rows) {
      dots[p] = make_uint4(0, 0, 0, 0);
    } else if (whole) {
      dots[p] = *reinterpret_cast<const uint4*>(dot);
    } else {
      alignas(16) bf16 v[8];
      for (int j = 0; j < 8; ++j) v[j] = n + j < n_valid ? dot[j] : __float2bfloat16(0.f);
      dots[p] = *reinterpret_cast<const uint4*>(v);
    }
  }
#pragma unroll
  for (int p = 0; p < kRowsPerThread; ++p) {
    const int r = threadIdx.x / 16 + p * (kRowsThreads / 16);
    const __nv_bfloat162* v = reinterpret_cast<const __nv_bfloat162*>(&dots[p]);
    const float4 c0 = *reinterpret_cast<const float4*>(c_chunk(r, n / 4)),
                 c1 = *reinterpret_cast<const float4*>(c_chunk(r, n / 4 + 1));
    const float2 v0 = __bfloat1622float2(v[0]), v1 = __bfloat1622float2(v[1]), v2 = __bfloat1622float2(v[2]),
                 v3 = __bfloat1622float2(v[3]);
    float sum = c0.x * v0.x + c0.y * v0.y + c0.z * v1.x + c0.w * v1.y + c1.x * v2.x + c1.y * v2.y + c1.z * v3.x +
                c1.w * v3.y;
    sum = group_sum<16>(sum);
    if (threadIdx.x % 16 == 0 && r < rows) atomicAdd(a.dweight + sel[r], sum);
  }
}

// cvmm_rows: one block per (row tile, 128 output columns), K through the cp.async pipeline. The
// epilogue weights the tile's rows, then stores them in bf16 or adds them into fp32 rows.
template <bool kTransW>
__global__ void __launch_bounds__(kRowsThreads) cvmm_rows_kernel(CvmmPlan plan, CvmmRowsArgs a) {
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = aligned_smem(smem_raw);
  float* Cs = reinterpret_cast<float*>(smem);  // [BM][kCStride], after the loop
  __shared__ TileRows tr;

  if (int(blockIdx.x) >= *plan.live_tiles) return;  // past this plan's tiles (see CvmmPlan)
  int e;
  const int rows = load_tile_rows(tr, plan, a.weight, blockIdx.x, e);
  const int n0 = blockIdx.y * BN;
  const int64_t K = a.K, N = a.N;
  const bf16* We = a.W + int64_t(e) * K * N;
  const bool x_aligned = vectorizable(a.X, K), w_aligned = vectorizable(We, kTransW ? K : N);

  const int wg = threadIdx.x / 128;
  const bool wg_live = wg * 64 < rows;  // a warpgroup whose 64 rows are all past the tile's end idles
  float acc[64];
#pragma unroll
  for (auto& v : acc) v = 0.f;
  pipeline(
      int((K + BK - 1) / BK),
      [&](int stage, int kt) {
        unsigned char* as = smem + stage * kStageBytes;
        load_rows_slab(as, a.X, tr.in, K, int64_t(kt) * BK, x_aligned);
        load_weight_slab<kTransW>(as + kSlabA, We, K, N, int64_t(kt) * BK, n0, w_aligned);
      },
      [](int, int) {},
      [&](int stage) {
        if (!wg_live) return;
        const unsigned char* as = smem + stage * kStageBytes;
        wgmma::fence();
        mma_slab<kTransW>(acc, as, as + kSlabA, wg * 64);
        wgmma::commit();
      });
  store_acc(Cs, acc, wg);
  __syncthreads();

  const int n_valid = int(min64(BN, N - n0));
  if (a.dweight)
    routing_weight_grad(a, [&](int r, int c) { return Cs + r * kCStride + 4 * c; }, tr.out, tr.sel, rows, N, n0, n_valid);
  if (a.accumulate && rows_addable(a.out_f32, N, n_valid)) {
    // Scatter: weight the rows in place (once the routing-weight gradient, if any, has read
    // them), then add each into its output row.
    if (a.weight) {
      if (a.dweight) __syncthreads();
      for (int i = threadIdx.x; i < rows * (BN / 4); i += kRowsThreads) {
        float4* c = reinterpret_cast<float4*>(Cs + (i / (BN / 4)) * kCStride) + i % (BN / 4);
        const float w = tr.weight[i / (BN / 4)];
        *c = make_float4(w * c->x, w * c->y, w * c->z, w * c->w);
      }
    }
    write_rows_async(Cs, rows, n_valid, [&](int r) { return a.out_f32 + int64_t(tr.out[r]) * N + n0; }, true);
    return;
  }
  // A stored output element: weighted, then through the ReLU options (see CvmmRowsArgs); dot is
  // the element of dot_rows at the same place (read only for kMaskByDotRows).
  using Relu = CvmmRowsArgs::Relu;
  auto stored = [&](float v, bf16 dot) {
    if (a.relu == Relu::kApply) return __float2bfloat16(fmaxf(v, 0.f));
    if (a.relu == Relu::kMaskByDotRows && !(__bfloat162float(dot) > 0.f)) return __float2bfloat16(0.f);
    return __float2bfloat16(v);
  };
  const bool masked = a.relu == Relu::kMaskByDotRows;
  if (!a.accumulate && n_valid == BN && vectorizable(a.out, N) && (!masked || vectorizable(a.dot_rows, N))) {
    // Rows of bf16: 16 threads per row, 8 columns each: two 16-byte reads of the tile, one
    // 16-byte store (and one 16-byte read of dot_rows when masked).
    for (int i = threadIdx.x; i < rows * (BN / 8); i += kRowsThreads) {
      const int r = i / (BN / 8), n = (i % (BN / 8)) * 8;
      const float w = tr.weight[r];
      const int64_t at = int64_t(tr.out[r]) * N + n0 + n;
      const float4* c = reinterpret_cast<const float4*>(Cs + r * kCStride + n);
      const float4 c0 = c[0], c1 = c[1];
      const float cv[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
      alignas(16) bf16 dot[8] = {}, v[8];
      if (masked) *reinterpret_cast<uint4*>(dot) = *reinterpret_cast<const uint4*>(a.dot_rows + at);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = stored(w * cv[j], dot[j]);
      *reinterpret_cast<uint4*>(a.out + at) = *reinterpret_cast<const uint4*>(v);
    }
    return;
  }
  for (int r = 0; r < rows; ++r) {  // one row at a time: consecutive threads, consecutive columns
    const float w = tr.weight[r];
    const int64_t base = int64_t(tr.out[r]) * N + n0;
    for (int n = threadIdx.x; n < n_valid; n += kRowsThreads) {
      const float v = w * Cs[r * kCStride + n];
      if (a.accumulate) atomicAdd(a.out_f32 + base + n, v);
      else a.out[base + n] = stored(v, masked ? a.dot_rows[base + n] : bf16{});
    }
  }
}

// cvmm_rows for the scatters with K <= 128: the FFN's down product and up input gradient, the
// attention's output product and value input gradient. An item is a row tile x 128 output
// columns; with K <= 128 its product is two slabs, and its time goes to its loads and to the
// additions into L2, so the kernel runs them side by side:
// - Persistent blocks, one per SM, take the items by groups of G bands, G = 1 or 2 (output
//   columns [n0, n0 + 128·G) of every row tile before the next group, so the band being added
//   into stays in L2: 8 MB per band at 1B and 16k tokens), and within a group by the plan's
//   chunks of the tokens (CvmmPlan::chunk_first_tile: 16k tokens each, so at 64k tokens a quarter
//   of the band is added into at a time); within a chunk each block takes a run of consecutive
//   row tiles, the G bands of a tile in turn. Those items share the tile's row slabs (at 1B the
//   FFN's 100 MB of rows do not stay in L2: read once per pair of bands, not once per band), and
//   consecutive tiles mostly share their expert, so a band's weight slab is loaded once per
//   expert, not once per item. G = 2 when two bands of a chunk's share of the output fit in half
//   of L2. The last two tiles a block of each chunk and group are shared instead: taken one at a
//   time from a counter by the blocks that get there first (the shared tail, below), as blocks
//   given even shares do not end together.
// - Two warpgroups load (row slabs: two stages, one per tile; weight slabs: two buffers, item s
//   in buffer s % 2) and multiply; a third adds each finished tile into its rows with 16-byte vector
//   atomics while the first two go on with the next items. The tile passes between them
//   through one fp32 buffer, its 16-byte chunks swizzled by row, guarded by two named barriers.
//   When a caller asks for the routing-weight gradient (training takes the value experts' from
//   cvmm_selection_dots instead), the first two take it from that buffer while the third adds the
//   tile: in the adding warpgroup it would make that warpgroup the bottleneck.
// - The indices are looked up ahead, one level of indirection per item, so no load waits on
//   another within an iteration: item s + 5's tile (expert, first position), item s + 4's end,
//   item s + 3's rows, item s + 1's routing weights. A block's item s lives in slot s % 4.
constexpr int kScatterSlots = 4, kOperandBytes = 2 * kSlabA;  // a row or weight slab pair: K <= 128
constexpr int kScatterThreads = kRowsThreads + 128;            // + the adding warpgroup
static_assert(kSlabA == kSlabB, "row and weight slabs are the same size");
// Two row stages, two weight buffers, the fp32 tile.
constexpr size_t kScatterSmemBytes = kSmemAlign + 4 * size_t(kOperandBytes) + sizeof(float) * BM * BN;
enum ScatterBarrier { kProducts = 1, kTileFull, kTileEmpty };  // 0 is __syncthreads'

// An item as looked up, level by level (in registers, then in its slot). No item (past the
// block's items, or a band past N): expert -1, live 0.
struct ScatterItem {
  int expert, first, n0;
  int live;          // rows of the tile (-1: not yet known)
  bool first_band;   // the first of its group of bands: loads the row slabs
  int row_stage;     // the row stage holding its row slabs: (s / G) % 2
  bool new_weights;  // its weight buffer holds another slab: loads it
  bool past_end;     // past the block's last item: the loops end here
};
struct ScatterSlot {
  TileRows rows;
  ScatterItem item;
};

// The phase clock (kClock, CvmmRowsArgs::phase_cycles): each thread sums the clock cycles of its
// phases, in the order of kScatterPhaseNames; threads 0 (multiplying) and kRowsThreads (adding)
// add them into the block's slots at the end. Without kClock the clock compiles away.
template <bool kClock>
struct PhaseClock {
  long long last = 0;
  unsigned long long cycles[kScatterPhases] = {};
  __device__ __forceinline__ void start() {
    if constexpr (kClock) last = clock64();
  }
  __device__ __forceinline__ void stamp(int phase) {  // the time since the last stamp, to `phase`
    if constexpr (kClock) {
      const long long now = clock64();
      cycles[phase] += now - last;
      last = now;
    }
  }
  __device__ __forceinline__ void count_item() {
    if constexpr (kClock) ++cycles[kItems];
  }
  __device__ __forceinline__ void count_rows(int rows) {
    if constexpr (kClock) cycles[kRows] += unsigned(rows);
  }
  __device__ __forceinline__ void add_into(unsigned long long* block_slots, int first, int end) const {
    if constexpr (kClock)
      for (int p = first; p < end; ++p) block_slots[p] += cycles[p];
  }
};

// The shared tail: in each chunk of each group of bands the last kTailTilesPerBlock · blocks row
// tiles are not split in advance but taken one at a time from the plan's counter of that chunk
// and group by whichever blocks get there first, as blocks given even shares end apart from the
// SMs' speed alone.
constexpr int kTailTilesPerBlock = 2;

// Called by one thread of each block once the block is done with the plan's counters (every
// atomic it sent them answered and its value used, so no fence is needed before the count; a
// fence here would make ptxas keep the kernels' float atomics as ATOMG, each waiting for its
// reply): the launch's last block zeroes the first `used` counters
// and the count of finished blocks, tail_counters[kCvmmTailCounters], for the next launch.
__device__ __forceinline__ void release_tail_counters(const CvmmPlan& plan, int used) {
  if (atomicAdd(&plan.tail_counters[kCvmmTailCounters], 1u) == gridDim.x - 1) {
    for (int g = 0; g < used; ++g) plan.tail_counters[g] = 0;
    plan.tail_counters[kCvmmTailCounters] = 0;
  }
}

template <bool kTransW, bool kClock>
__global__ void __launch_bounds__(kScatterThreads, 1) cvmm_scatter_kernel(CvmmPlan plan, CvmmRowsArgs a, int group) {
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = aligned_smem(smem_raw);
  unsigned char* row_stage = smem;                        // [2][kOperandBytes]
  unsigned char* weight_buffer = smem + 2 * kOperandBytes;  // [2][kOperandBytes]
  float* Cs = reinterpret_cast<float*>(smem + 4 * kOperandBytes);  // [BM][BN], swizzled
  __shared__ ScatterSlot slot[kScatterSlots];
  const int64_t K = a.K, N = a.N;
  // This block's row tiles in every chunk of every group of bands: of the chunk's tiles [base,
  // base + split + tail), [tile0, tile_end) of the first `split`, then tiles base + split + i
  // taken from the chunk's counter in the group while i < tail; each tile's G bands in turn.
  const int bands = int((N + BN - 1) / BN), band_groups = (bands + group - 1) / group, chunks = plan.chunks;
  int base = 0, split = 0, tail = 0, tile0 = 0, tile_end = 0;
  auto enter_chunk = [&](int c) {  // once per chunk and group: the divisions stay off the items' path
    base = plan.chunk_first_tile[c];
    const int tiles = plan.chunk_first_tile[c + 1] - base;
    split = max(0, tiles - kTailTilesPerBlock * int(gridDim.x)), tail = tiles - split;
    tile0 = base + int(int64_t(split) * blockIdx.x / gridDim.x);
    tile_end = base + int(int64_t(split) * (blockIdx.x + 1) / gridDim.x);
  };
  // Row rr's 16-byte chunk c of the tile buffer.
  auto chunk_at = [&](int rr, int c) { return Cs + rr * BN + ((c ^ (rr % 8)) * 4); };

  PhaseClock<kClock> clock;
  unsigned long long* const block_slots = kClock ? a.phase_cycles + blockIdx.x * kScatterPhases : nullptr;
  if (threadIdx.x >= kRowsThreads) {  // the adding warpgroup: warp w adds rows w, w + 4, ...
    const int warp = (threadIdx.x - kRowsThreads) / 32, lane = threadIdx.x % 32;
    constexpr int kWarps = (kScatterThreads - kRowsThreads) / 32;
    bar_arrive(kTileEmpty, kScatterThreads);  // the buffer starts empty
    clock.start();
    for (int s = 0;; ++s) {
      bar_sync(kTileFull, kScatterThreads);
      clock.stamp(kWaitTileFull);
      const ScatterSlot& sl = slot[s % kScatterSlots];
      if (sl.item.past_end) break;
      const int n0 = sl.item.n0;
      if (4 * lane < int(min64(BN, N - n0))) {
        for (int rr = warp; rr < sl.item.live; rr += kWarps) {
          const float4 c = *reinterpret_cast<const float4*>(chunk_at(rr, lane));
          const float w = sl.rows.weight[rr];
          atomicAdd(reinterpret_cast<float4*>(a.out_f32 + int64_t(sl.rows.out[rr]) * N + n0 + 4 * lane),
                    make_float4(w * c.x, w * c.y, w * c.z, w * c.w));
        }
      }
      clock.stamp(kAdditions);
      clock.count_rows(sl.item.live);
      bar_arrive(kTileEmpty, kScatterThreads);
    }
    if (threadIdx.x == kRowsThreads) {
      clock.add_into(block_slots, kWaitTileFull, kAdditions + 1);
      clock.add_into(block_slots, kRows, kRows + 1);
    }
    return;
  }

  // The loading and multiplying warpgroups.
  const int r = threadIdx.x;  // threads below BM look up row r
  const int wg = threadIdx.x / 128;
  // Items are looked up for s = 0, 1, 2, ... in turn, so a cursor steps through their (tile, band,
  // row stage) in the order above with no division (this runs every item, on the multiplying
  // warps' path): row tile cursor_tile, band G·cursor_group + cursor_band, in chunk cursor_chunk.
  enter_chunk(0);
  int cursor_tile = 0, cursor_band = 0, cursor_group = 0, cursor_chunk = 0, cursor_stage = 0, next_tile = tile0;
  // Tail tiles: thread 0 asks the counter of the chunk in the group for one (`asked`) as soon as
  // the block starts the chunk or takes the tile it had, and writes the answer into taken[k % 2]
  // for the k-th ask at the end of that iteration (the next one's first barrier shows it to the
  // others); an answer needed sooner is written at once, behind a barrier of the multiplying
  // warps, which all take the same path. Two boxes: the one written next was last read before a
  // barrier.
  __shared__ int taken[2];
  int asks = 0, asked = 0;
  bool answered = true;
  auto ask = [&] {
    if (r == 0) asked = int(atomicAdd(&plan.tail_counters[cursor_group * chunks + cursor_chunk], 1u));
    answered = false;
    ++asks;
  };
  auto answer = [&] {  // writes the last ask's answer (once it has come back)
    if (!answered && r == 0) taken[(asks - 1) % 2] = asked;
    answered = true;
  };
  auto take_tile = [&] {  // the next tile of this block, advancing the chunk and group; -1: none left
    while (cursor_group < band_groups) {
      if (next_tile < tile_end) return next_tile++;
      if (!answered) {
        answer();
        bar_sync(kProducts, kRowsThreads);
      }
      const int i = taken[(asks - 1) % 2];
      if (i < tail) {
        ask();
        return base + split + i;
      }
      if (++cursor_chunk == chunks) cursor_chunk = 0, ++cursor_group;
      if (cursor_group < band_groups) enter_chunk(cursor_chunk), next_tile = tile0, ask();
    }
    return -1;
  };
  ask();
  // First level: the tile's expert and first position, and whether its weight buffer needs
  // loading after item s - 2, the buffer's previous user.
  auto item_of = [&](int s, const ScatterItem& before2) {
    ScatterItem t{};
    t.expert = -1;
    if (cursor_band == 0) cursor_tile = take_tile();
    const int band = cursor_tile < 0 ? bands : group * cursor_group + cursor_band;
    const int tile = cursor_tile, stage = cursor_stage;
    const bool first_band = cursor_band == 0;
    t.past_end = tile < 0;
    if (!t.past_end && ++cursor_band == group) {
      cursor_band = 0;
      cursor_stage ^= 1;
    }
    if (band < bands) {
      t.expert = plan.tile_expert[tile];
      t.first = plan.tile_first[tile];
      t.n0 = band * BN;
      t.live = -1;
      t.first_band = first_band;
      t.row_stage = stage;
      t.new_weights = s < 2 || t.expert != before2.expert || t.n0 != before2.n0;
    }
    return t;
  };
  auto item_end = [&](ScatterItem& t) {  // second level: how many rows it has
    if (t.live < 0) t.live = int(min64(BM, plan.expert_begin[t.expert + 1] - t.first));
  };
  struct RowLookup {
    int32_t in = -1, out = -1, sel = -1;
  };
  auto rows_of = [&](const ScatterItem& t) {  // third level: row r's input, output and selection
    RowLookup l;
    if (r < BM && r < t.live) l = {plan.in_row[t.first + r], plan.out_row[t.first + r], plan.by_expert[t.first + r]};
    return l;
  };
  auto put_rows = [&](int s, const ScatterItem& t, const RowLookup& l) {
    ScatterSlot& sl = slot[s % kScatterSlots];
    if (r < BM) sl.rows.in[r] = l.in, sl.rows.out[r] = l.out, sl.rows.sel[r] = l.sel;
    if (r == 0) sl.item = t;
  };
  auto weight_of = [&](int s) {  // fourth level: row r's routing weight
    const int sel = r < BM ? slot[s % kScatterSlots].rows.sel[r] : -1;
    return a.weight && sel >= 0 ? a.weight[sel] : 1.f;
  };
  auto put_weight = [&](int s, float w) {
    if (r < BM) slot[s % kScatterSlots].rows.weight[r] = w;
  };
  // Item s's row slabs into stage (s / G) % 2 (its row_stage) when it is the first of its group
  // (the others use them too), and its weight slabs into buffer s % 2 when that holds another
  // slab. The stage's and the buffer's previous users ended at item s - 2 at the latest, whose
  // products are done.
  auto load_item = [&](int s) {
    const ScatterItem& t = slot[s % kScatterSlots].item;
    if (t.live > 0) {
      if (t.first_band) {
        const bool x_aligned = vectorizable(a.X, K);
        for (int kt = 0; kt < 2; ++kt)
          load_rows_slab(row_stage + t.row_stage * kOperandBytes + kt * kSlabA, a.X, slot[s % kScatterSlots].rows.in,
                         K, kt * BK, x_aligned);
      }
      if (t.new_weights) {
        const bf16* We = a.W + int64_t(t.expert) * K * N;
        const bool w_aligned = vectorizable(We, kTransW ? K : N);
        for (int kt = 0; kt < 2; ++kt)
          load_weight_slab<kTransW>(weight_buffer + (s % 2) * kOperandBytes + kt * kSlabB, We, K, N, kt * BK, t.n0,
                                    w_aligned);
      }
    }
    cp_async_commit();
  };

  // Prologue: items 0-2 looked up to their rows, item 0 to its weights, items 3 and 4 as far as
  // the loop expects them; items 0 and 1 loading.
  ScatterItem first3[3]{};  // first3[0] also stands for "item s - 2" of items 0 and 1, never read
  for (int s = 0; s < 3; ++s) {
    first3[s] = item_of(s, first3[max(s - 2, 0)]);
    item_end(first3[s]);
    put_rows(s, first3[s], rows_of(first3[s]));
  }
  ScatterItem ahead3 = item_of(3, first3[1]);
  ScatterItem ahead4 = item_of(4, first3[2]);
  item_end(ahead3);
  answer();
  bar_sync(kProducts, kRowsThreads);
  put_weight(0, weight_of(0));
  load_item(0);
  load_item(1);

  clock.start();
  for (int s = 0;; ++s) {
    cp_async_wait<1>();  // item s has landed (this thread's copies)
    wgmma::fence_shared_for_async();
    bar_sync(kProducts, kRowsThreads);
    if (slot[s % kScatterSlots].item.past_end) {  // to the adding warps, once done with s - 1
      bar_sync(kTileEmpty, kScatterThreads);
      bar_arrive(kTileFull, kScatterThreads);
      break;
    }
    clock.stamp(kWaitOperands);
    clock.count_item();
    // This iteration's lookups, each on what earlier iterations found.
    const ScatterItem next5 = item_of(s + 5, ahead3);
    item_end(ahead4);
    const RowLookup rows3 = rows_of(ahead3);
    const float w1 = weight_of(s + 1);
    clock.stamp(kLookups);

    const ScatterItem& t = slot[s % kScatterSlots].item;
    float acc[64];
#pragma unroll
    for (auto& v : acc) v = 0.f;
    if (wg * 64 < t.live) {
      wgmma::fence();
      for (int kt = 0; kt < 2; ++kt)
        mma_slab<kTransW>(acc, row_stage + t.row_stage * kOperandBytes + kt * kSlabA,
                          weight_buffer + (s % 2) * kOperandBytes + kt * kSlabB, wg * 64);
      wgmma::commit();
      wgmma::wait<0>();
    }
    clock.stamp(kProductsDone);
    // Once the adding warpgroup is done with item s - 1 (and both products here with their
    // operands): the tile to it, the lookups to their slots, item s + 2's loads.
    bar_sync(kTileEmpty, kScatterThreads);
    clock.stamp(kWaitTileEmpty);
#pragma unroll
    for (int j = 0; j < 64; j += 2) {
      const int rr = wg * 64 + wgmma::acc_row(j), c = wgmma::acc_col(j);
      *reinterpret_cast<float2*>(chunk_at(rr, c / 4) + c % 4) = make_float2(acc[j], acc[j + 1]);
    }
    // The routing-weight gradient reads rows the other warpgroup wrote.
    if (a.dweight) bar_sync(kProducts, kRowsThreads);
    put_rows(s + 3, ahead3, rows3);
    put_weight(s + 1, w1);
    bar_arrive(kTileFull, kScatterThreads);
    clock.stamp(kTileWritten);
    ahead3 = ahead4;
    ahead4 = next5;
    load_item(s + 2);
    clock.stamp(kLoadsIssued);
    if (a.dweight && t.live > 0) {
      const TileRows& tr = slot[s % kScatterSlots].rows;
      routing_weight_grad(a, chunk_at, tr.out, tr.sel, t.live, N, t.n0, int(min64(BN, N - t.n0)));
    }
    clock.stamp(kDweight);
    answer();
  }
  cp_async_wait<0>();
  if (r == 0) release_tail_counters(plan, band_groups * chunks);  // every ask answered
  if (kClock && threadIdx.x == 0) {
    clock.add_into(block_slots, kWaitOperands, kDweight + 1);
    clock.add_into(block_slots, kItems, kItems + 1);
    unsigned sm;
    asm("mov.u32 %0, %%smid;" : "=r"(sm));
    block_slots[kSm] = sm;
  }
}

// cvmm_sum_selections: a thread per kVec columns of an output row (8: 16-byte accesses).
template <int kVec>
__global__ void sum_selections_kernel(bf16* out, const bf16* rows, const float* weight, const int32_t* index,
                                      int64_t out_rows, int per_row, int64_t N) {
  const int64_t chunks = N / kVec, i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= out_rows * chunks) return;
  const int64_t r = i / chunks, n = (i % chunks) * kVec;
  float acc[kVec] = {};
  for (int s = 0; s < per_row; ++s) {
    const int64_t sel = r * per_row + s;
    if (index[sel] < 0) continue;
    alignas(16) bf16 x[kVec];
    if constexpr (kVec == 8) *reinterpret_cast<uint4*>(x) = *reinterpret_cast<const uint4*>(rows + sel * N + n);
    else x[0] = rows[sel * N + n];
    const float w = weight[sel];
#pragma unroll
    for (int v = 0; v < kVec; ++v) acc[v] += w * __bfloat162float(x[v]);
  }
  alignas(16) bf16 y[kVec];
#pragma unroll
  for (int v = 0; v < kVec; ++v) y[v] = __float2bfloat16(acc[v]);
  if constexpr (kVec == 8) *reinterpret_cast<uint4*>(out + r * N + n) = *reinterpret_cast<const uint4*>(y);
  else out[r * N + n] = y[0];
}

// cvmm_selection_dots: a warp per selection, lanes over the columns.
__global__ void selection_dots_kernel(float* dweight, const bf16* rows, const bf16* dot_rows, const int32_t* index,
                                      int64_t selections, int per_row, int64_t N) {
  const int64_t sel = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  const bool live = sel < selections && index[sel] >= 0;
  float sum = 0.f;
  if (live) {
    const bf16* a = rows + sel * N;
    const bf16* b = dot_rows + (sel / per_row) * N;
    for (int64_t n = lane; n < N; n += 32) sum += __bfloat162float(a[n]) * __bfloat162float(b[n]);
  }
  sum = warp_sum(sum);  // every lane of the warp takes part, live or not
  if (lane == 0 && sel < selections) dweight[sel] = live ? sum : 0.f;
}

// cvmm_rows for the gathered products of one band (N = 128, K a multiple of 64 above 128, 16-byte
// aligned rows and weights), stored or added into fp32 rows: the FFN's up product and its down
// input gradient, the attention's value product and output input gradient. The
// per-tile kernel reads its expert's weight once per 128-row tile, half of what it moves through
// L2 at 1B (393 KB per tile). A 256-row tile halves that, but at one block per SM the per-tile
// kernel's step barriers go uncovered, and copying warps issuing every 16-byte copy could not
// keep up. So:
// - Persistent blocks take the plan's tile pairs (256 rows of one expert), pair blockIdx.x first,
//   then every gridDim.x-th, so the blocks in flight share their experts' weights in L2. (The
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

// Eight bf16 values (16 bytes) times a routing weight, in fp32, rounded back to bf16: the
// weight-gradient kernel's weighting of its copies, and stage_weighted_rows', which must agree
// bit for bit.
__device__ __forceinline__ uint4 weighted_chunk(uint4 v, float w) {
  __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __bfloat1622float2(pairs[j]);
    pairs[j] = __floats2bfloat162_rn(w * f.x, w * f.y);
  }
  return v;
}

// dW_e[k0.., n0..] += Σ_s A[a_row(s)][k]·w_s·B[b_row(s)][n]: a 128 (K) x 128 (N) tile per block,
// two warpgroups of 64 K-rows each (wgmma m64n128k16, both operands MN-major: selections are the
// reduction), selections taken 64 at a time through the pipeline. Each thread scales the A
// chunks it copied by their routing weights once they land, so weighting costs no barrier.
constexpr int WM = 128, WN = 128, WS = 64;
// The blocks run a group of 4 tiles (128-column slices) of every expert before the next group,
// so the blocks in flight gather from 4 slices of the token rows (at 1B, 4 x 4 MB of a 50 MB
// matrix), which L2 can hold; each expert's other operand is then read once per group. With all
// 12 tiles of an expert together the blocks would gather from whole rows, which miss L2; smaller
// groups read the other operand more often.
constexpr int kWeightGradTileGroup = 4;
static_assert((WM + WN) * WS * 2 == kStageBytes, "weight-gradient stages share the row products' size");

// kByTma: which operand comes by tensor copies (its rows are positions: one 64 x 64 box per slab
// and step), 0 for none. The box's rows past the expert's end belong to the next expert (or lie
// past the tensor, read as zeros); each thread zeroes its chunk of those rows once they land.
// `uses` (1 or 2) plans and operands share dW (two layers that share the expert weights): a tile
// runs the first use's steps, then the second's, into one accumulator, and adds it to dW once
// (or writes it, a0.overwrite: then the tiles of an expert without selections write zeros).
enum WeightGradTma { kGatherBoth = 0, kTmaA = 1, kTmaB = 2 };
template <int kByTma>
__global__ void __launch_bounds__(kRowsThreads, 2)
    cvmm_weight_grad_kernel(CvmmPlan plan0, CvmmWeightGradArgs a0, CvmmPlan plan1, CvmmWeightGradArgs a1, int uses,
                            int tile_group, const __grid_constant__ CUtensorMap by_position0,
                            const __grid_constant__ CUtensorMap by_position1) {
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = aligned_smem(smem_raw);
  __shared__ alignas(8) uint64_t full[kStages];  // the tensor copies of each stage
  const int64_t K = a0.K, N = a0.N;
  const int64_t n_tiles_n = (N + WN - 1) / WN, tiles = (K + WM - 1) / WM * n_tiles_n, E = a0.n_experts;
  // Block b: tile `tile` of expert e, in groups of tile_group tiles of every expert (see
  // kWeightGradTileGroup); a group past the last tile is cut to the tiles left.
  const int64_t g = int64_t(blockIdx.x) / (E * tile_group), in_group = min64(tile_group, tiles - g * tile_group);
  const int64_t rem = int64_t(blockIdx.x) - g * E * tile_group, tile = g * tile_group + rem % in_group;
  const int e = int(rem / in_group);
  const int64_t k0 = (tile / n_tiles_n) * WM, n0 = (tile % n_tiles_n) * WN;
  const int64_t begin0 = plan0.expert_begin[e], end0 = plan0.expert_begin[e + 1];
  const int64_t begin1 = uses > 1 ? plan1.expert_begin[e] : 0, end1 = uses > 1 ? plan1.expert_begin[e + 1] : 0;
  if (begin0 == end0 && begin1 == end1 && !a0.overwrite) return;
  const int steps0 = int((end0 - begin0 + WS - 1) / WS), steps = steps0 + int((end1 - begin1 + WS - 1) / WS);
  if constexpr (kByTma != kGatherBoth) {
    if (threadIdx.x < kStages) tma::mbar_init(&full[threadIdx.x], 1);
    tma::fence_barrier_init();
    __syncthreads();
  }
  const bool a_aligned = vectorizable(a0.A, K) && (uses < 2 || vectorizable(a1.A, K));
  const bool b_aligned = vectorizable(a0.B, N) && (uses < 2 || vectorizable(a1.B, N));
  // This thread's copies in every step: chunk `chunk` (8 columns) of rows row0 + 16·i, i < 4,
  // of both operands; the 128 columns of a row are two slabs of 64.
  const int chunk = threadIdx.x % 16, row0 = threadIdx.x / 16;
  constexpr int kSlabBytes = WS * 128;
  auto chunk_offset = [&](int r) { return (chunk / 8) * kSlabBytes + wgmma::swizzled_chunk(r, chunk % 8); };
  // A step's use (the second's steps follow the first's), its first position and its use's end.
  auto second = [&](int step) { return step >= steps0; };
  auto step_first = [&](int step) {
    return second(step) ? begin1 + int64_t(step - steps0) * WS : begin0 + int64_t(step) * WS;
  };
  auto step_end = [&](int step) { return second(step) ? end1 : end0; };

  // The rows and routing weights of a step are looked up one step ahead, so the index loads
  // overlap the products instead of stalling the copies that need them; a weight needs its
  // selection first, so selections are looked up one step further ahead (a weight's load never
  // waits on the selection's).
  int32_t arow[4], brow[4];
  float w[4];
  int sel[4];  // the selections of the step after the one last looked up
  auto look_up_selections = [&](int step) {
    const int32_t* by_expert = second(step) ? plan1.by_expert : plan0.by_expert;
    const int64_t first = step_first(step) + row0, end = step_end(step);
#pragma unroll
    for (int i = 0; i < 4; ++i) sel[i] = a0.weight && first + 16 * i < end ? by_expert[first + 16 * i] : -1;
  };
  auto look_up = [&](int step) {
    const int32_t* in_row = second(step) ? plan1.in_row : plan0.in_row;
    const int32_t* out_row = second(step) ? plan1.out_row : plan0.out_row;
    const float* weight = second(step) ? a1.weight : a0.weight;
    const int64_t first = step_first(step) + row0, end = step_end(step);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t p = first + 16 * i;
      const bool live = p < end;
      arow[i] = !live ? -1 : a0.a_by_in_row ? in_row[p] : out_row[p];
      brow[i] = !live ? -1 : a0.a_by_in_row ? out_row[p] : in_row[p];
      w[i] = sel[i] >= 0 ? weight[sel[i]] : 1.f;
    }
    look_up_selections(step + 1);
  };
  __shared__ float s_weight[kStages][WS];  // each thread's own rows: written and read by it alone
  auto load = [&](int stage, int step) {
    unsigned char* as = smem + stage * kStageBytes;
    unsigned char* bs = as + WS * WM * 2;
    if constexpr (kByTma != kGatherBoth) {
      if (threadIdx.x == 0) {
        tma::mbar_expect_tx(&full[stage], 2 * kSlabBytes);
        const int col0 = int(kByTma == kTmaA ? k0 : n0), row = int(step_first(step));
        const CUtensorMap* map = second(step) ? &by_position1 : &by_position0;
        for (int h = 0; h < 2; ++h)
          tma::load_2d((kByTma == kTmaA ? as : bs) + h * kSlabBytes, map, col0 + 64 * h, row, &full[stage]);
      }
    }
    const bf16* A = second(step) ? a1.A : a0.A;
    const bf16* B = second(step) ? a1.B : a0.B;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = row0 + 16 * i;
      const bool live = arow[i] >= 0;
      if (kByTma != kTmaA)
        load8(reinterpret_cast<bf16*>(as + chunk_offset(r)), A + int64_t(max(arow[i], 0)) * K + k0 + chunk * 8,
              live ? int(min64(8, K - (k0 + chunk * 8))) : 0, a_aligned);
      if (kByTma != kTmaB)
        load8(reinterpret_cast<bf16*>(bs + chunk_offset(r)), B + int64_t(max(brow[i], 0)) * N + n0 + chunk * 8,
              live ? int(min64(8, N - (n0 + chunk * 8))) : 0, b_aligned);
      s_weight[stage][r] = w[i];
    }
    look_up(step + 1);
  };
  auto landed = [&](int stage, int step) {
    if constexpr (kByTma != kGatherBoth) {
      tma::mbar_wait(&full[stage], (step / kStages) % 2);
      unsigned char* copied = smem + stage * kStageBytes + (kByTma == kTmaA ? 0 : WS * WM * 2);
      const int64_t first = step_first(step) + row0, end = step_end(step);
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (first + 16 * i >= end) *reinterpret_cast<uint4*>(copied + chunk_offset(row0 + 16 * i)) = make_uint4(0, 0, 0, 0);
    }
    if (!a0.weight) return;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = row0 + 16 * i;
      const float wr = s_weight[stage][r];
      // One 16-byte read and write per chunk: element-wise, the shared-memory traffic of this
      // pass would outweigh the step's products.
      uint4* chunk_at = reinterpret_cast<uint4*>(smem + stage * kStageBytes + chunk_offset(r));
      *chunk_at = weighted_chunk(*chunk_at, wr);
    }
  };
  look_up_selections(0);
  look_up(0);
  const int wg = threadIdx.x / 128;
  float acc[64];
#pragma unroll
  for (auto& v : acc) v = 0.f;
  pipeline(steps, load, landed, [&](int stage) {
    const unsigned char* as = smem + stage * kStageBytes;
    const uint32_t a_addr = wgmma::smem_address(as + wg * kSlabBytes), b_addr = wgmma::smem_address(as + WS * WM * 2);
    wgmma::fence();
#pragma unroll
    for (int k16 = 0; k16 < WS / 16; ++k16)
      wgmma::mma_m64n128k16<1, 1>(acc, wgmma::mn_major(a_addr, kSlabBytes, k16), wgmma::mn_major(b_addr, kSlabBytes, k16),
                                  true);
    wgmma::commit();
  });

  float* dWe = a0.dW + int64_t(e) * K * N;
  const int n_valid = int(min64(WN, N - n0));
  if (rows_addable(dWe, N, n_valid)) {  // through the finished stages, added (or copied) by the L2
    float* Cs = reinterpret_cast<float*>(smem);
    store_acc(Cs, acc, wg);
    write_rows_async(Cs, int(min64(WM, K - k0)), n_valid, [&](int r) { return dWe + (k0 + r) * N + n0; },
                     !a0.overwrite);
    return;
  }
  // Straight from the accumulators: each thread owns pairs of adjacent columns.
  const bool pairs = N % 2 == 0 && reinterpret_cast<uintptr_t>(dWe) % 8 == 0;
#pragma unroll
  for (int j = 0; j < 64; j += 2) {
    const int64_t k = k0 + wg * 64 + wgmma::acc_row(j), n = n0 + wgmma::acc_col(j);
    if (k >= K) continue;
    float* out = dWe + k * N + n;
    const float base0 = a0.overwrite || n >= N ? 0.f : out[0], base1 = a0.overwrite || n + 1 >= N ? 0.f : out[1];
    if (pairs && n + 1 < N) {
      *reinterpret_cast<float2*>(out) = make_float2(base0 + acc[j], base1 + acc[j + 1]);
    } else {
      if (n < N) out[0] = base0 + acc[j];
      if (n + 1 < N) out[1] = base1 + acc[j + 1];
    }
  }
}

template <class Kernel, class... Args>
void launch_with_smem(Kernel kernel, dim3 grid, int threads, size_t smem_bytes, cudaStream_t stream, const Args&... args) {
  MOEUT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem_bytes)));
  kernel<<<grid, threads, smem_bytes, stream>>>(args...);
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

template <bool kTransW>
void launch_rows(const CvmmPlan& plan, const CvmmRowsArgs& a, cudaStream_t stream) {
  const dim3 grid(unsigned(plan.tiles), unsigned((a.N + BN - 1) / BN));
  launch_with_smem(cvmm_rows_kernel<kTransW>, grid, kRowsThreads, kSmemBytes, stream, plan, a);
}

// The current device's SM count and L2 size, asked of the runtime only when the device changes
// (the persistent kernel launches one block per SM, over a hundred times per 1B step).
struct DeviceFacts {
  int multiprocessors = 0, l2_bytes = 0;
};
DeviceFacts device_facts() {
  thread_local int device_seen = -1;
  thread_local DeviceFacts facts;
  int device = 0;
  MOEUT_CUDA_CHECK(cudaGetDevice(&device));
  if (device != device_seen) {
    MOEUT_CUDA_CHECK(cudaDeviceGetAttribute(&facts.multiprocessors, cudaDevAttrMultiProcessorCount, device));
    MOEUT_CUDA_CHECK(cudaDeviceGetAttribute(&facts.l2_bytes, cudaDevAttrL2CacheSize, device));
    device_seen = device;
  }
  return facts;
}

template <bool kTransW>
void launch_scatter(const CvmmPlan& plan, const CvmmRowsArgs& a, cudaStream_t stream) {
  const DeviceFacts facts = device_facts();
  // Bands in pairs when two of them fit in half of L2: a pair reads its row slabs once, but two
  // bands that L2 cannot hold would be added into from DRAM.
  // A chunk of the plan adds into about 1/chunks of the output's rows at a time (its tokens').
  const int64_t chunk_rows = (a.out_rows + plan.chunks - 1) / plan.chunks;
  const int group = 2 * BN * sizeof(float) * chunk_rows <= int64_t(facts.l2_bytes) / 2 ? 2 : 1;
  if ((a.N + group * BN - 1) / (group * BN) > kCvmmMaxBandGroups)
    throw std::invalid_argument("cvmm_rows: a scatter over " + std::to_string(a.N) + " columns exceeds the " +
                                std::to_string(kCvmmMaxBandGroups * group * BN) + " the scatter kernel counts tail tiles for");
  const auto kernel = a.phase_cycles ? cvmm_scatter_kernel<kTransW, true> : cvmm_scatter_kernel<kTransW, false>;
  launch_with_smem(kernel, dim3(unsigned(facts.multiprocessors)), kScatterThreads,
                   kScatterSmemBytes, stream, plan, a, group);
}

// A bf16 matrix [rows, width] in boxes of box_rows x 64 columns, 128-byte swizzle.
CUtensorMap tensor_map(const bf16* base, int64_t width, int64_t rows, int box_rows) {
  return tma::bf16_map<2>(base, {cuuint64_t(width), cuuint64_t(rows)}, {cuuint64_t(width) * sizeof(bf16)},
                          {64, cuuint32_t(box_rows)});
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

template <bool kTransW>
void launch_gather(const CvmmPlan& plan, const CvmmRowsArgs& a, cudaStream_t stream) {
  launch_with_smem(cvmm_gather_kernel<kTransW>, dim3(unsigned(device_facts().multiprocessors)), kGatherThreads,
                   kGatherSmemBytes, stream, plan, a, weight_map(a));
}

}  // namespace

// Scatters whose product is at most two slabs deep and whose rows take 16-byte additions (with N
// as the band width too: every band but the last is 128 wide, and the last is N mod 128, a
// multiple of 4 when N is).
bool cvmm_on_scatter_kernel(const CvmmRowsArgs& a) {
  return a.accumulate && a.K <= 2 * BK && rows_addable(a.out_f32, a.N, a.N);
}

ScatterPhaseClock cvmm_scatter_phase_cycles(const CvmmPlan& plan, CvmmRowsArgs a, cudaStream_t stream) {
  if (!cvmm_on_scatter_kernel(a)) throw std::invalid_argument("cvmm_scatter_phase_cycles: not a scatter-kernel product");
  DeviceBuffer<unsigned long long> slots(std::vector<unsigned long long>(size_t(device_facts().multiprocessors) * kScatterPhases, 0));
  a.phase_cycles = slots.get();
  cudaEvent_t begin, end;
  MOEUT_CUDA_CHECK(cudaEventCreate(&begin));
  MOEUT_CUDA_CHECK(cudaEventCreate(&end));
  MOEUT_CUDA_CHECK(cudaEventRecord(begin, stream));
  cvmm_rows(plan, a, stream);
  MOEUT_CUDA_CHECK(cudaEventRecord(end, stream));
  MOEUT_CUDA_CHECK(cudaEventSynchronize(end));
  ScatterPhaseClock clock{slots.download()};
  MOEUT_CUDA_CHECK(cudaEventElapsedTime(&clock.ms, begin, end));
  MOEUT_CUDA_CHECK(cudaEventDestroy(begin));
  MOEUT_CUDA_CHECK(cudaEventDestroy(end));
  return clock;
}

void cvmm_rows(const CvmmPlan& plan, const CvmmRowsArgs& a, cudaStream_t stream) {
  if (plan.tiles == 0) return;
  if (a.accumulate ? !a.out_f32 : !a.out) throw std::invalid_argument("cvmm_rows: output buffer missing");
  // Scatters that cvmm_on_scatter_kernel takes go to the persistent scatter kernel; deeper
  // products of one band over whole 64-deep slabs, with 16-byte aligned rows, to the persistent
  // gather kernel; the rest to the per-tile one.
  const bool scatter = cvmm_on_scatter_kernel(a);
  const bool gather = a.N == BN && a.K % BK == 0 && vectorizable(a.X, a.K) &&
                      (a.accumulate ? rows_addable(a.out_f32, a.N, a.N) : vectorizable(a.out, a.N)) &&
                      (!a.dot_rows || vectorizable(a.dot_rows, a.N)) && vectorizable(a.W, a.K);
  if ((scatter || gather) && !plan.tail_counters)
    throw std::invalid_argument(std::string("cvmm_rows: a ") + (scatter ? "scatter" : "gather") +
                                " on a plan without tail counters");
  if (scatter && (!plan.chunk_first_tile || plan.chunks < 1 || plan.chunks > kCvmmMaxChunks))
    throw std::invalid_argument("cvmm_rows: a scatter on a plan without its chunks of tiles (" +
                                std::to_string(plan.chunks) + " chunks)");
  if (scatter) {
    if (a.transpose_w) launch_scatter<true>(plan, a, stream);
    else launch_scatter<false>(plan, a, stream);
  } else if (gather) {
    if (a.transpose_w) launch_gather<true>(plan, a, stream);
    else launch_gather<false>(plan, a, stream);
  } else if (a.transpose_w) {
    launch_rows<true>(plan, a, stream);
  } else {
    launch_rows<false>(plan, a, stream);
  }
}

void cvmm_sum_selections(bf16* out, const bf16* rows, const float* weight, const int32_t* index, int64_t out_rows,
                         int64_t per_row, int64_t N, cudaStream_t stream) {
  if (out_rows == 0 || N == 0) return;
  auto launch = [&](auto kernel, int vec) {
    const int64_t threads = out_rows * (N / vec);
    kernel<<<unsigned((threads + 255) / 256), 256, 0, stream>>>(out, rows, weight, index, out_rows, int(per_row), N);
    MOEUT_CUDA_CHECK(cudaGetLastError());
  };
  if (vectorizable(rows, N) && vectorizable(out, N)) launch(sum_selections_kernel<8>, 8);
  else launch(sum_selections_kernel<1>, 1);
}

void cvmm_selection_dots(float* dweight, const bf16* rows, const bf16* dot_rows, const int32_t* index,
                         int64_t selections, int64_t per_row, int64_t N, cudaStream_t stream) {
  if (selections == 0) return;
  constexpr int kWarpsPerBlock = 8;
  selection_dots_kernel<<<unsigned((selections + kWarpsPerBlock - 1) / kWarpsPerBlock), 32 * kWarpsPerBlock, 0,
                          stream>>>(dweight, rows, dot_rows, index, selections, int(per_row), N);
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

namespace {

// staging[p] = weight[by_expert[p]] · src[rows[p]] for the live positions p (below the last
// expert's end), rows of `width` bf16 (a multiple of 8), a thread per 8 columns, weighted as the
// weight-gradient kernel weights its copies (weighted_chunk).
__global__ void stage_weighted_rows(bf16* staging, const CvmmPlan plan, const int32_t* rows, const bf16* src,
                                    const float* weight, int64_t experts, int width) {
  const int per_row = width / 8;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, p = i / per_row, c = (i % per_row) * 8;
  if (p >= plan.expert_begin[experts]) return;
  *reinterpret_cast<uint4*>(staging + p * width + c) =
      weighted_chunk(*reinterpret_cast<const uint4*>(src + int64_t(rows[p]) * width + c), weight[plan.by_expert[p]]);
}

// The weight gradient over `uses` (1 or 2) plans and operands sharing dW.
void launch_weight_grad(const CvmmPlan* plans, const CvmmWeightGradArgs* args, int uses, cudaStream_t stream) {
  const CvmmWeightGradArgs& a = args[0];
  for (int u = 1; u < uses; ++u)
    if (args[u].dW != a.dW || args[u].K != a.K || args[u].N != a.N || args[u].n_experts != a.n_experts ||
        args[u].a_by_in_row != a.a_by_in_row || !args[u].weight != !a.weight || args[u].overwrite != a.overwrite)
      throw std::invalid_argument("cvmm_weight_grad: two uses with different gradients, shapes, weighting or overwrite");
  const int64_t tiles = ((a.K + WM - 1) / WM) * ((a.N + WN - 1) / WN);
  if (plans[0].tiles == 0 && (uses < 2 || plans[1].tiles == 0)) {  // no selections: dW += 0, or dW = 0
    if (a.overwrite)
      MOEUT_CUDA_CHECK(cudaMemsetAsync(a.dW, 0, size_t(a.n_experts * a.K * a.N) * sizeof(float), stream));
    return;
  }
  // An operand whose rows are positions (the FFN's hidden rows) comes by tensor copies, when it
  // does in every use. Its maps are made per call: the live positions change with every routing
  // (a few microseconds).
  auto by_tma = [&](int u) {
    const CvmmPlan& plan = plans[u];
    const bool a_by_position = args[u].a_by_in_row ? plan.in_by_position : plan.out_by_position;
    const bool b_by_position = args[u].a_by_in_row ? plan.out_by_position : plan.in_by_position;
    if (plan.positions > 0 && a_by_position && vectorizable(args[u].A, a.K)) return kTmaA;
    if (plan.positions > 0 && b_by_position && vectorizable(args[u].B, a.N)) return kTmaB;
    return kGatherBoth;
  };
  WeightGradTma tma = by_tma(0);
  for (int u = 1; u < uses; ++u)
    if (by_tma(u) != tma) tma = kGatherBoth;
  // Both operands gathered and weighted: the narrower one weighted and by position first (see
  // CvmmWeightGradArgs::staging), then the product of the staged operand by tensor copies.
  auto stageable = [&](bool is_a) {
    const int64_t width = is_a ? a.K : a.N;
    return width <= 128 && vectorizable(is_a ? a.A : a.B, width) && vectorizable(a.staging, width);
  };
  const bool stage_a = stageable(true) && (!stageable(false) || a.K <= a.N);  // the narrower
  const int64_t width = stage_a ? a.K : a.N;
  if (uses == 1 && tma == kGatherBoth && a.staging && a.weight && stageable(stage_a) && plans[0].positions > 0) {
    CvmmPlan plan = plans[0];
    const bool in_rows = stage_a == a.a_by_in_row;  // which of the plan's rows the staged operand reads
    const int64_t threads = plan.positions * (width / 8);
    stage_weighted_rows<<<unsigned((threads + 255) / 256), 256, 0, stream>>>(
        a.staging, plan, in_rows ? plan.in_row : plan.out_row, stage_a ? a.A : a.B, a.weight, a.n_experts, int(width));
    MOEUT_CUDA_CHECK(cudaGetLastError());
    (in_rows ? plan.in_by_position : plan.out_by_position) = true;
    CvmmWeightGradArgs staged = a;
    (stage_a ? staged.A : staged.B) = a.staging;
    staged.weight = nullptr;
    staged.staging = nullptr;
    launch_weight_grad(&plan, &staged, 1, stream);
    return;
  }
  CUtensorMap maps[2] = {};
  for (int u = 0; u < uses && tma != kGatherBoth; ++u)
    maps[u] = tma == kTmaA ? tensor_map(args[u].A, a.K, plans[u].positions, WS)
                           : tensor_map(args[u].B, a.N, plans[u].positions, WS);
  const int second = uses > 1 ? 1 : 0;
  auto launch = [&](auto kernel) {
    launch_with_smem(kernel, dim3(unsigned(tiles * a.n_experts)), kRowsThreads, kSmemBytes, stream, plans[0], args[0],
                     plans[second], args[second], uses, kWeightGradTileGroup, maps[0], maps[second]);
  };
  if (tma == kTmaA) launch(cvmm_weight_grad_kernel<kTmaA>);
  else if (tma == kTmaB) launch(cvmm_weight_grad_kernel<kTmaB>);
  else launch(cvmm_weight_grad_kernel<kGatherBoth>);
}

}  // namespace

void cvmm_weight_grad(const CvmmPlan& plan, const CvmmWeightGradArgs& a, cudaStream_t stream) {
  launch_weight_grad(&plan, &a, 1, stream);
}

void cvmm_weight_grad(const CvmmPlan& plan_a, const CvmmWeightGradArgs& a, const CvmmPlan& plan_b,
                      const CvmmWeightGradArgs& b, cudaStream_t stream) {
  const CvmmPlan plans[2] = {plan_a, plan_b};
  const CvmmWeightGradArgs args[2] = {a, b};
  launch_weight_grad(plans, args, 2, stream);
}

}  // namespace moeut::cuda
