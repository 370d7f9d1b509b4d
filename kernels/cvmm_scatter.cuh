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
// - A clock type marks the points of an item as the kernel passes them (NoClock, below, lists
//   them): training launches it with NoClock, whose marks compile away (cvmm_scatter.cu); the
//   benchmarks' phase clock is another instantiation, built into their library alone
//   (cvmm_scatter_phases.cu).
#pragma once
#include <stdexcept>
#include <string>

#include "kernels/cuda_check.h"
#include "kernels/cvmm_cuda.h"
#include "kernels/cvmm_device.cuh"
#include "kernels/named_barrier.cuh"

namespace moeut::cuda::scatter {

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

// The clock of a launch that marks nothing: the points the kernel marks, in the order it passes
// them. The adding warpgroup: start, then per item tile_full (a tile is in the buffer) and
// tile_added (its rows added), and finish_adding (thread kRowsThreads, at the end). The
// multiplying warpgroups: start, then per item operands_landed, looked_up (the lookups ahead),
// multiplied, tile_empty (the buffer is free), tile_written, loads_issued and weight_grad_done,
// and finish_multiplying (thread 0, at the end).
struct NoClock {
  __device__ __forceinline__ void start() {}
  __device__ __forceinline__ void tile_full() {}
  __device__ __forceinline__ void tile_added(int /*rows*/) {}
  __device__ __forceinline__ void finish_adding() {}
  __device__ __forceinline__ void operands_landed() {}
  __device__ __forceinline__ void looked_up() {}
  __device__ __forceinline__ void multiplied() {}
  __device__ __forceinline__ void tile_empty() {}
  __device__ __forceinline__ void tile_written() {}
  __device__ __forceinline__ void loads_issued() {}
  __device__ __forceinline__ void weight_grad_done() {}
  __device__ __forceinline__ void finish_multiplying() {}
};

// The shared tail: in each chunk of each group of bands the last kTailTilesPerBlock · blocks row
// tiles are not split in advance but taken one at a time from the plan's counter of that chunk
// and group by whichever blocks get there first, as blocks given even shares end apart from the
// SMs' speed alone.
constexpr int kTailTilesPerBlock = 2;

template <bool kTransW, class Clock>
__global__ void __launch_bounds__(kScatterThreads, 1)
    cvmm_scatter_kernel(CvmmPlan plan, CvmmRowsArgs a, int group, Clock clock) {
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

  if (threadIdx.x >= kRowsThreads) {  // the adding warpgroup: warp w adds rows w, w + 4, ...
    const int warp = (threadIdx.x - kRowsThreads) / 32, lane = threadIdx.x % 32;
    constexpr int kWarps = (kScatterThreads - kRowsThreads) / 32;
    bar_arrive(kTileEmpty, kScatterThreads);  // the buffer starts empty
    clock.start();
    for (int s = 0;; ++s) {
      bar_sync(kTileFull, kScatterThreads);
      clock.tile_full();
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
      clock.tile_added(sl.item.live);
      bar_arrive(kTileEmpty, kScatterThreads);
    }
    if (threadIdx.x == kRowsThreads) clock.finish_adding();
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
    clock.operands_landed();
    // This iteration's lookups, each on what earlier iterations found.
    const ScatterItem next5 = item_of(s + 5, ahead3);
    item_end(ahead4);
    const RowLookup rows3 = rows_of(ahead3);
    const float w1 = weight_of(s + 1);
    clock.looked_up();

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
    clock.multiplied();
    // Once the adding warpgroup is done with item s - 1 (and both products here with their
    // operands): the tile to it, the lookups to their slots, item s + 2's loads.
    bar_sync(kTileEmpty, kScatterThreads);
    clock.tile_empty();
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
    clock.tile_written();
    ahead3 = ahead4;
    ahead4 = next5;
    load_item(s + 2);
    clock.loads_issued();
    if (a.dweight && t.live > 0) {
      const TileRows& tr = slot[s % kScatterSlots].rows;
      routing_weight_grad(a, chunk_at, tr.out, tr.sel, t.live, N, t.n0, int(min64(BN, N - t.n0)));
    }
    clock.weight_grad_done();
    answer();
  }
  cp_async_wait<0>();
  if (r == 0) release_tail_counters(plan, band_groups * chunks);  // every ask answered
  if (threadIdx.x == 0) clock.finish_multiplying();
}

// Launches the product of `a` on the kernel with `clock`: a block per SM, the bands in pairs when
// two of them fit in half of L2 (a pair reads its row slabs once, but two bands that L2 cannot
// hold would be added into from DRAM). A chunk of the plan adds into about 1/chunks of the
// output's rows at a time (its tokens').
template <bool kTransW, class Clock>
void launch(const CvmmPlan& plan, const CvmmRowsArgs& a, Clock clock, cudaStream_t stream) {
  const DeviceFacts facts = device_facts();
  const int64_t chunk_rows = (a.out_rows + plan.chunks - 1) / plan.chunks;
  const int group = 2 * BN * sizeof(float) * chunk_rows <= int64_t(facts.l2_bytes) / 2 ? 2 : 1;
  if ((a.N + group * BN - 1) / (group * BN) > kCvmmMaxBandGroups)
    throw std::invalid_argument("cvmm_rows: a scatter over " + std::to_string(a.N) + " columns exceeds the " +
                                std::to_string(kCvmmMaxBandGroups * group * BN) + " the scatter kernel counts tail tiles for");
  launch_with_smem(cvmm_scatter_kernel<kTransW, Clock>, dim3(unsigned(facts.multiprocessors)), kScatterThreads,
                   kScatterSmemBytes, stream, plan, a, group, clock);
}

}  // namespace moeut::cuda::scatter
