// Expert plans for the cvmm products (CvmmPlan in cvmm_cuda.h): selections grouped by expert,
// with their rows, expert offsets and row tiles, built on the device from top-k indices
// (CvmmPlanner). Tests and benchmarks also build them on the host (DeviceCvmmPlan,
// cvmm_host_plan.cu).
#include <cub/block/block_scan.cuh>

#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cuda_check.h"
#include "kernels/cvmm_cuda.h"
#include "kernels/cvmm_device.cuh"

namespace moeut::cuda {

DeviceBuffer<uint32_t> zeroed_tail_counters() {
  return DeviceBuffer<uint32_t>(std::vector<uint32_t>(kCvmmTailCounters + 1, 0));
}

CvmmPlan CvmmPlanBuffers::view(bool swapped) const {
  return {by_expert.get(), swapped ? out_row.get() : in_row.get(), swapped ? in_row.get() : out_row.get(),
          expert_begin.get(), tile_expert.get(), tile_first.get(), live_tiles.get(), pair_tile.get(), live_pairs.get(),
          chunk_first_tile.get(), tiles, chunks, swapped ? out_by_position : in_by_position,
          swapped ? in_by_position : out_by_position, positions, tail_counters.get()};
}

namespace {

// The device planner places each selection where a stable sort by expert would, without sorting.
// A token selects an expert of a group at most once (top-k), so one expert's selections in index
// order are in token order, and a selection's position is
//   begin[e] + (selections of e by the tokens of earlier chunks) + (those by earlier tokens of
//   its own chunk),
// the last a population count of the chunk's mask of e: bit t set when the chunk's token t
// selected e. Selections of other ranks' experts (index -1) follow all the live ones, in index
// order. Counting positions so costs less than a radix sort of the selections by expert.
constexpr int kMaskTokens = 32;  // tokens of a chunk: one bit each in a 32-bit mask
constexpr int kMaskThreads = 256;
constexpr int64_t kMaxMaskExperts = 48 * 1024 / sizeof(uint32_t);  // without opting in to more shared memory

// The column of chunk_count that selection i (= (t·groups + g)·k + j, expert e within group g)
// counts in: its expert over all groups, or `experts` for another rank's (e = -1).
__device__ inline int selection_column(int32_t e, int64_t i, int groups, int E, int k) {
  return e < 0 ? groups * E : int(i / k % groups) * E + e;
}

// One block a chunk: the masks of the chunk's tokens by expert, kept in shared memory. Writes
// each selection's rank among its expert's selections in the chunk (`rank`), and the chunk's
// selections of each expert, those of other ranks last (`chunk_count` row c, experts + 1 wide).
// Each thread takes a run of consecutive selections, so that the other ranks' selections are
// ranked in index order by one scan of the runs.
__global__ void __launch_bounds__(kMaskThreads)
    chunk_masks(int32_t* chunk_count, int32_t* rank, const int32_t* index, int64_t n, int groups, int E, int k) {
  extern __shared__ uint32_t mask[];  // [experts]
  using Scan = cub::BlockScan<int32_t, kMaskThreads>;
  __shared__ typename Scan::TempStorage scratch;
  const int experts = groups * E, per_token = groups * k;
  const int64_t t0 = int64_t(blockIdx.x) * kMaskTokens, i0 = t0 * per_token;
  const int sels = int(min(int64_t(kMaskTokens), n - t0)) * per_token;
  const int run = (sels + kMaskThreads - 1) / kMaskThreads, first = int(threadIdx.x) * run;
  const int last = min(first + run, sels);
  for (int e = int(threadIdx.x); e < experts; e += kMaskThreads) mask[e] = 0;
  __syncthreads();
  const auto column = [&](int s) { return selection_column(index[i0 + s], i0 + s, groups, E, k); };
  for (int s = first; s < last; ++s) {
    const int e = column(s);
    if (e < experts) atomicOr(&mask[e], 1u << (s / per_token));
  }
  int others = 0;  // this run's selections of other ranks' experts
  for (int s = first; s < last; ++s) others += column(s) == experts;
  int others_before, others_total;
  Scan(scratch).ExclusiveSum(others, others_before, others_total);
  __syncthreads();
  for (int s = first; s < last; ++s) {
    const int e = column(s);
    rank[i0 + s] = e == experts ? others_before++ : __popc(mask[e] & ((1u << (s / per_token)) - 1u));
  }
  int32_t* counts = chunk_count + int64_t(blockIdx.x) * (experts + 1);
  for (int e = int(threadIdx.x); e < experts; e += kMaskThreads) counts[e] = __popc(mask[e]);
  if (threadIdx.x == 0) counts[experts] = others_total;
}

// For each expert (a column of chunk_count, experts + 1 wide with the other ranks' column last),
// the selections of the chunks before each chunk, in place; and the expert's total, into counts.
// A block takes 32 columns, a lane each, and its 32 warps take equal runs of the chunks.
constexpr int kScanWarps = 32;
__global__ void __launch_bounds__(kScanWarps * 32)
    scan_chunk_counts(int32_t* chunk_count, int32_t* counts, int chunks, int columns) {
  __shared__ int32_t run_sum[kScanWarps][32];  // [warp][lane]: each warp's run of chunks summed
  const int lane = int(threadIdx.x % 32), warp = int(threadIdx.x / 32);
  const int column = int(blockIdx.x) * 32 + lane, run = (chunks + kScanWarps - 1) / kScanWarps;
  const int c0 = warp * run, c1 = min(c0 + run, chunks);
  int32_t sum = 0;
  if (column < columns)
    for (int c = c0; c < c1; ++c) sum += chunk_count[int64_t(c) * columns + column];
  run_sum[warp][lane] = sum;
  __syncthreads();
  int32_t before = 0;
  for (int w = 0; w < warp; ++w) before += run_sum[w][lane];
  if (column >= columns) return;
  for (int c = c0; c < c1; ++c) {
    int32_t& count = chunk_count[int64_t(c) * columns + column];
    const int32_t here = count;
    count = before;
    before += here;
  }
  if (warp == kScanWarps - 1) counts[column] = before;
}

// Expert offsets, row tiles and tile pairs from the counts, in one block: a scan of the counts
// over the experts, 256 at a time; then for each chunk, scans of the experts' tile and pair
// counts in the chunk, and each thread lists its expert's tiles and pairs there (the order of
// tile_lists on the host). No host round trip.
constexpr int kPlanThreads = 256;
__global__ void __launch_bounds__(kPlanThreads)
    offsets_and_tiles(int64_t* begin, int32_t* tile_expert, int32_t* tile_first, int32_t* live_tiles,
                      int32_t* pair_tile, int32_t* live_pairs, int32_t* chunk_first_tile, const int32_t* counts,
                      int experts, int chunks) {
  using Scan = cub::BlockScan<int64_t, kPlanThreads>;
  __shared__ typename Scan::TempStorage scratch;
  __shared__ int64_t done_rows, done_tiles, done_pairs;  // totals of the experts (chunks) before this pass
  if (threadIdx.x == 0) done_rows = done_tiles = done_pairs = 0;
  __syncthreads();
  for (int e0 = 0; e0 < experts; e0 += kPlanThreads) {
    const int e = e0 + int(threadIdx.x);
    int64_t first_row, pass_rows;
    Scan(scratch).ExclusiveSum(e < experts ? int64_t(counts[e]) : 0, first_row, pass_rows);
    if (e < experts) begin[e] = done_rows + first_row;  // read back below by this thread only
    __syncthreads();
    if (threadIdx.x == 0) done_rows += pass_rows;
    __syncthreads();
  }
  for (int c = 0; c < chunks; ++c) {
    if (threadIdx.x == 0) chunk_first_tile[c] = int32_t(done_tiles);
    for (int e0 = 0; e0 < experts; e0 += kPlanThreads) {
      const int e = e0 + int(threadIdx.x);
      const int64_t tiles = e < experts ? (counts[e] + kCvmmTileRows - 1) / kCvmmTileRows : 0;
      const int64_t rank0 = cvmm_chunk_rank_begin(c, tiles, chunks), here = cvmm_chunk_rank_begin(c + 1, tiles, chunks) - rank0;
      int64_t first_tile, first_pair, pass_tiles, pass_pairs;
      Scan(scratch).ExclusiveSum(here, first_tile, pass_tiles);
      __syncthreads();
      Scan(scratch).ExclusiveSum((here + 1) / 2, first_pair, pass_pairs);  // rank0 is even
      first_tile += done_tiles, first_pair += done_pairs;
      for (int64_t i = 0; i < here; ++i) {
        tile_expert[first_tile + i] = e;
        tile_first[first_tile + i] = int32_t(begin[e] + (rank0 + i) * kCvmmTileRows);
        if (i % 2 == 0) pair_tile[first_pair + i / 2] = int32_t(first_tile + i);
      }
      __syncthreads();
      if (threadIdx.x == 0) done_tiles += pass_tiles, done_pairs += pass_pairs;
      __syncthreads();
    }
  }
  if (threadIdx.x == 0) {
    begin[experts] = done_rows;
    chunk_first_tile[chunks] = int32_t(done_tiles);
    *live_tiles = int32_t(done_tiles);
    *live_pairs = int32_t(done_pairs);
  }
}

// Each selection to its position (see chunk_masks).
__global__ void place_selections(int32_t* by_expert, const int32_t* index, const int32_t* rank,
                                 const int32_t* chunk_before, const int64_t* begin, int64_t n_sel, int groups, int E,
                                 int k) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_sel) return;
  const int64_t t = i / k / groups;  // i = (t·groups + g)·k + j
  const int column = selection_column(index[i], i, groups, E, k);
  by_expert[begin[column] + chunk_before[t / kMaskTokens * (groups * E + 1) + column] + rank[i]] = int32_t(i);
}

// The rows of the selection at each position, in position order: the products' tiles read
// them with one load each instead of a second load through by_expert. A pass of its own, so
// that these stores are in order (place_selections' are scattered).
__global__ void rows_by_position(int32_t* in_row, int32_t* out_row, const int32_t* by_expert, int64_t n_sel,
                                 int groups, int k, CvmmRoute route) {
  const int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p >= n_sel) return;
  const int64_t i = by_expert[p], tg = i / k, t = tg / groups;  // i = (t·groups + g)·k + j
  in_row[p] = int32_t(route == CvmmRoute::kGroupRowsToTokens ? tg : t);
  out_row[p] = int32_t(route == CvmmRoute::kGatherToGroupRows ? tg : route == CvmmRoute::kGatherToPositions ? p : t);
}

int32_t max_tiles(int64_t selections, int64_t experts) {
  return int32_t((selections + kCvmmTileRows - 1) / kCvmmTileRows + experts);
}

}  // namespace

CvmmPlanner::CvmmPlanner(int64_t max_selections, int64_t max_experts, int64_t max_tokens, int64_t tokens_per_chunk)
    : max_selections_(max_selections), max_experts_(max_experts), max_tokens_(max_tokens),
      tokens_per_chunk_(tokens_per_chunk), rank_(size_t(max_selections)),
      chunk_count_(size_t((max_tokens + kMaskTokens - 1) / kMaskTokens * (max_experts + 1))),
      counts_(size_t(max_experts + 1)) {
  if (tokens_per_chunk < 1)
    throw std::invalid_argument("CvmmPlanner: tokens_per_chunk " + std::to_string(tokens_per_chunk) + " is not positive");
  if (max_experts > kMaxMaskExperts)
    throw std::invalid_argument("CvmmPlanner: " + std::to_string(max_experts) + " experts exceed the " +
                                std::to_string(kMaxMaskExperts) + " whose token masks a block's shared memory holds");
}

CvmmPlanBuffers CvmmPlanner::make_buffers() const {
  CvmmPlanBuffers p;
  const size_t n = size_t(max_selections_);
  p.in_row = DeviceBuffer<int32_t>(n);
  p.out_row = DeviceBuffer<int32_t>(n);
  p.by_expert = DeviceBuffer<int32_t>(n);
  p.tiles = max_tiles(max_selections_, max_experts_);
  p.tile_expert = DeviceBuffer<int32_t>(size_t(p.tiles));
  p.tile_first = DeviceBuffer<int32_t>(size_t(p.tiles));
  p.live_tiles = DeviceBuffer<int32_t>(1);
  p.pair_tile = DeviceBuffer<int32_t>(size_t(p.tiles));
  p.live_pairs = DeviceBuffer<int32_t>(1);
  p.chunk_first_tile = DeviceBuffer<int32_t>(size_t(kCvmmMaxChunks + 1));
  p.expert_begin = DeviceBuffer<int64_t>(size_t(max_experts_ + 1));
  p.tail_counters = zeroed_tail_counters();
  return p;
}

void CvmmPlanner::build(CvmmPlanBuffers& plan, const int32_t* index, int64_t n, int64_t groups, int64_t E, int64_t k,
                        CvmmRoute route, cudaStream_t stream) {
  const int64_t sels = n * groups * k, experts = groups * E;
  if (sels > max_selections_ || experts > max_experts_ || n > max_tokens_)
    throw std::invalid_argument("CvmmPlanner: " + std::to_string(sels) + " selections of " + std::to_string(n) +
                                " tokens over " + std::to_string(experts) + " experts exceed the planned " +
                                std::to_string(max_selections_) + " of " + std::to_string(max_tokens_) + " over " +
                                std::to_string(max_experts_));
  plan.tiles = max_tiles(sels, experts);
  plan.in_by_position = false;
  plan.out_by_position = route == CvmmRoute::kGatherToPositions;
  plan.positions = sels;
  plan.chunks = cvmm_chunks(n, tokens_per_chunk_);
  const int mask_chunks = int((n + kMaskTokens - 1) / kMaskTokens), columns = int(experts + 1);
  if (sels > 0) {
    chunk_masks<<<unsigned(mask_chunks), kMaskThreads, size_t(experts) * sizeof(uint32_t), stream>>>(
        chunk_count_.get(), rank_.get(), index, n, int(groups), int(E), int(k));
    MOEUT_CUDA_CHECK(cudaGetLastError());
  }
  // With no selections the scan still runs: it writes the zero counts the tiles are made from.
  scan_chunk_counts<<<unsigned((columns + 31) / 32), kScanWarps * 32, 0, stream>>>(chunk_count_.get(), counts_.get(),
                                                                                   sels > 0 ? mask_chunks : 0, columns);
  MOEUT_CUDA_CHECK(cudaGetLastError());
  offsets_and_tiles<<<1, kPlanThreads, 0, stream>>>(plan.expert_begin.get(), plan.tile_expert.get(), plan.tile_first.get(),
                                                    plan.live_tiles.get(), plan.pair_tile.get(), plan.live_pairs.get(),
                                                    plan.chunk_first_tile.get(), counts_.get(), int(experts),
                                                    int(plan.chunks));
  MOEUT_CUDA_CHECK(cudaGetLastError());
  if (sels > 0) {
    const unsigned blocks = unsigned((sels + 255) / 256);
    place_selections<<<blocks, 256, 0, stream>>>(plan.by_expert.get(), index, rank_.get(), chunk_count_.get(),
                                                  plan.expert_begin.get(), sels, int(groups), int(E), int(k));
    MOEUT_CUDA_CHECK(cudaGetLastError());
    rows_by_position<<<blocks, 256, 0, stream>>>(plan.in_row.get(), plan.out_row.get(), plan.by_expert.get(), sels,
                                                 int(groups), int(k), route);
    MOEUT_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace moeut::cuda
