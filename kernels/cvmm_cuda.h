// cvmm on the GPU (see cvmm.h for the operation): bf16 operands, fp32 accumulation on tensor
// cores, token rows gathered inside the product's tile loads (no [selections, K] copy), the
// routing weight applied in the epilogue, results stored or scatter-added into their rows.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cvmm.h"
#include "kernels/device_buffer.h"

namespace moeut::cuda {

// Selections grouped by expert, on the device. Row tiles of kCvmmTileRows consecutive
// selections of one expert are the unit of work; tile_expert/tile_first list them. Kernels
// launch `tiles` blocks (an upper bound known on the host) and those past *live_tiles (the
// count, known on the device) return at once, so planning needs no host synchronisation.
struct CvmmPlan {
  const int32_t* by_expert;  // [n] selections ordered by expert
  // [n] in by_expert's order: the row of the product's input that the selection at each position
  // reads, and the row of the output it writes.
  const int32_t* in_row;
  const int32_t* out_row;
  const int64_t* expert_begin;  // [experts + 1] offsets into by_expert
  const int32_t* tile_expert;   // [tiles]
  const int32_t* tile_first;    // [tiles] first position (into by_expert) of the tile
  const int32_t* live_tiles;    // [1]
  // Tile pairs: the first tile of every two consecutive tiles of one expert (an expert's last
  // tile alone when its count is odd), for kernels that take 2·kCvmmTileRows rows at a time.
  const int32_t* pair_tile;     // [tiles], *live_pairs used
  const int32_t* live_pairs;    // [1]
  // The tiles are listed by chunks of the tokens: chunk c holds, expert by expert, the tiles of
  // each expert's c-th share of its rows (cvmm_chunk_rank_begin), tiles [chunk_first_tile[c],
  // chunk_first_tile[c + 1]). An expert's rows are in token order, so a chunk's tiles cover about
  // 1/chunks of the tokens, and a scatter that runs the chunks one after the other adds into
  // that part of its output only, which L2 can hold.
  const int32_t* chunk_first_tile;  // [chunks + 1]
  int32_t tiles;
  int32_t chunks;
  // Rows that equal their position (in_row[p] == p, or out_row[p] == p) for every live position
  // below `positions`: such an operand's rows of one expert are one contiguous run, which the
  // weight gradient brings by tensor copies instead of gathering.
  bool in_by_position = false, out_by_position = false;
  int64_t positions = 0;
  // The counters by which the scatter kernel's blocks share tail tiles and the gather kernel's
  // take tile pairs (kernels/cvmm_scatter.cuh, cvmm_gather.cu), zero between launches: one scatter or gather on a plan at
  // a time.
  uint32_t* tail_counters = nullptr;  // [kCvmmTailCounters + 1]
};
inline constexpr int kCvmmTileRows = 128;
// Groups of 128-column bands the scatter kernel counts tail tiles for: outputs up to 8192
// columns (16384 with two bands a group).
inline constexpr int kCvmmMaxBandGroups = 64;
// Tokens a chunk of the tile list covers (CvmmPlan::chunk_first_tile): a 128-column fp32 band of
// 16k rows is 8 MB, which the scatters keep in L2. At most kCvmmMaxChunks chunks: past 256k
// tokens a chunk covers more.
inline constexpr int64_t kCvmmChunkTokens = 16384;
inline constexpr int kCvmmMaxChunks = 16;
// A tail counter for each chunk of each band group, then the count of finished blocks.
inline constexpr int kCvmmTailCounters = kCvmmMaxBandGroups * kCvmmMaxChunks;

// The chunks that cover `tokens` tokens, kCvmmChunkTokens (or `tokens_per_chunk`) each.
inline int32_t cvmm_chunks(int64_t tokens, int64_t tokens_per_chunk = kCvmmChunkTokens) {
  const int64_t chunks = (tokens + tokens_per_chunk - 1) / tokens_per_chunk;
  return int32_t(chunks < 1 ? 1 : chunks > kCvmmMaxChunks ? kCvmmMaxChunks : chunks);
}
// The first of an expert's `tiles` tile ranks in chunk c of `chunks`: an even rank, so the two
// tiles of a pair (CvmmPlan::pair_tile) stay in one chunk; chunk `chunks` begins at `tiles`.
__host__ __device__ inline int64_t cvmm_chunk_rank_begin(int64_t c, int64_t tiles, int64_t chunks) {
  const int64_t rank = 2 * ((c * ((tiles + 1) / 2) + chunks - 1) / chunks);
  return rank < tiles ? rank : tiles;
}

// out[out_row] (+)= weight · X[in_row] · op(W_e). W holds [E, K, N] (op = identity) or
// [E, N, K] (transposed: op(W_e) = W_eᵀ). weight may be null (ones).
// accumulate = false: out is bf16 [*, N] and each row is written once (rows distinct).
// accumulate = true: out_f32 [*, N] is added into atomically (several selections per row).
// dweight, when not null, receives Σ_n (X[in_row]·op(W_e))[n] · dot_rows[out_row][n] per
// selection (before weighting): the routing-weight gradient of the transposed product.
struct CvmmRowsArgs {
  const __nv_bfloat16* X;
  const __nv_bfloat16* W;
  const float* weight;
  __nv_bfloat16* out;
  float* out_f32;
  float* dweight;
  const __nv_bfloat16* dot_rows;
  int64_t K, N;
  bool transpose_w, accumulate;
  // Scatters (accumulate) only: rows of out_f32 (0: not given, taken as few), which sets how
  // many 128-column bands of it the additions work in at once (what L2 must hold).
  int64_t out_rows = 0;
  // Stored (bf16) outputs only: kApply stores max(0, ·) (the FFN's hidden units); kMaskByDotRows
  // stores 0 where dot_rows <= 0 (the gradient through that ReLU, dot_rows being its output).
  enum class Relu { kNone, kApply, kMaskByDotRows } relu = Relu::kNone;
};
void cvmm_rows(const CvmmPlan& plan, const CvmmRowsArgs& a, cudaStream_t stream);
// Whether cvmm_rows runs these arguments on the scatter kernel.
bool cvmm_on_scatter_kernel(const CvmmRowsArgs& a);

// Each selection's product kept in a row of its own: a plan whose output row is the selection's
// index, for cvmm_rows's stored outputs. The attention's value experts keep their rows so (two
// per token and head): their routing-weight gradient is then a 128-wide dot product
// (cvmm_selection_dots) instead of one over the 1536-wide token rows in the scatter's epilogue,
// which would slow that scatter down.
inline CvmmPlan at_selections(CvmmPlan plan) {
  plan.out_row = plan.by_expert;
  plan.out_by_position = false;
  return plan;
}
// out[r] = Σ weight[i] · rows[i] (bf16 out, fp32 sums) over the selections i = r·per_row + s,
// s < per_row, with index[i] >= 0; N columns, r < out_rows.
void cvmm_sum_selections(__nv_bfloat16* out, const __nv_bfloat16* rows, const float* weight, const int32_t* index,
                         int64_t out_rows, int64_t per_row, int64_t N, cudaStream_t stream);
// dweight[i] = Σ_n dot_rows[i / per_row][n] · rows[i][n] for the selections i < selections with
// index[i] >= 0, and 0 for the others; N columns.
void cvmm_selection_dots(float* dweight, const __nv_bfloat16* rows, const __nv_bfloat16* dot_rows, const int32_t* index,
                         int64_t selections, int64_t per_row, int64_t N, cudaStream_t stream);

// dW_e += Σ_{selections s of e} A[a_row(s)]ᵀ · (weight_s · B[b_row(s)]), A [*, K], B [*, N],
// dW fp32 [E, K, N]: the expert-weight gradient, with both operands gathered.
struct CvmmWeightGradArgs {
  const __nv_bfloat16* A;
  const __nv_bfloat16* B;
  const float* weight;   // may be null
  bool a_by_in_row;      // A rows: in_row (true) or out_row (false); B rows: the other
  float* dW;
  int64_t K, N, n_experts;
  // dW_e = the sum instead of dW_e += it, experts without selections set to 0: a gradient's first
  // contribution, which then needs neither zeroing beforehand nor reading dW.
  bool overwrite = false;
  // Scratch for the plan's positions x 128 bf16, or null. With it, a weighted product of one use
  // whose operands are both gathered first lays out one operand of at most 128 columns (a
  // multiple of 8; the narrower when both are) weighted and by position there: the kernel then
  // brings that operand by tensor copies and weights neither, for the same bits (the attention
  // experts' weight gradients).
  __nv_bfloat16* staging = nullptr;
};
void cvmm_weight_grad(const CvmmPlan& plan, const CvmmWeightGradArgs& a, cudaStream_t stream);
// Two uses of the same expert weights (two layers that share them) in one product: dW_e += the
// sum over both uses' selections. a and b name the same dW, shapes, weighting and overwrite. Each
// tile then runs both uses' rows between its prologue and a single fp32 read-modify-write of dW,
// where two products would do two.
void cvmm_weight_grad(const CvmmPlan& plan_a, const CvmmWeightGradArgs& a, const CvmmPlan& plan_b,
                      const CvmmWeightGradArgs& b, cudaStream_t stream);

// A plan's device arrays. view(swapped): in_row and out_row exchanged, for the transposed
// product of a backward pass.
struct CvmmPlanBuffers {
  DeviceBuffer<int32_t> in_row, out_row, by_expert, tile_expert, tile_first, live_tiles, pair_tile, live_pairs,
      chunk_first_tile;
  DeviceBuffer<int64_t> expert_begin;
  DeviceBuffer<uint32_t> tail_counters;  // zeroed at creation (see CvmmPlan)
  int32_t tiles = 0, chunks = 1;
  bool in_by_position = false, out_by_position = false;  // see CvmmPlan
  int64_t positions = 0;
  CvmmPlan view(bool swapped = false) const;
  int64_t device_bytes() const {
    return in_row.bytes() + out_row.bytes() + by_expert.bytes() + tile_expert.bytes() + tile_first.bytes() +
           live_tiles.bytes() + pair_tile.bytes() + live_pairs.bytes() + chunk_first_tile.bytes() +
           expert_begin.bytes() + tail_counters.bytes();
  }
};

// How the selections of a routing decision map to rows. Selection i = (t·groups + g)·k + j of
// token t, routing group g (a head, or the whole layer), choice j.
enum class CvmmRoute {
  kGatherToGroupRows,    // in: token row t; out: group row t·groups + g (attention value experts)
  kGroupRowsToTokens,    // in: group row t·groups + g; out: token row t (attention output experts)
  // in: token row t; out: the selection's position in expert order (FFN keys; values use it
  // swapped), so the hidden rows of one expert are contiguous.
  kGatherToPositions,
};

// Builds plans on the device from top-k indices, no host synchronisation: each selection placed
// where a stable sort by expert would put it (kernels/cvmm_plan.cu), then expert offsets and row
// tiles. A token selects an expert of a group at most once, as a top-k does.
class CvmmPlanner {
 public:
  // max_tokens: the most tokens (index rows) a plan covers. tokens_per_chunk: the tokens a chunk
  // of the tile list covers (CvmmPlan::chunk_first_tile).
  CvmmPlanner(int64_t max_selections, int64_t max_experts, int64_t max_tokens,
              int64_t tokens_per_chunk = kCvmmChunkTokens);
  // Buffers sized for one plan of up to max_selections selections over max_experts experts.
  CvmmPlanBuffers make_buffers() const;
  // index [n, groups, k]: expert within its group, or -1 for a selection left out (its expert
  // is on another rank). Writes the plan into `plan` (from make_buffers).
  void build(CvmmPlanBuffers& plan, const int32_t* index, int64_t n, int64_t groups, int64_t E, int64_t k,
             CvmmRoute route, cudaStream_t stream);
  int64_t device_bytes() const { return rank_.bytes() + chunk_count_.bytes() + counts_.bytes(); }

 private:
  int64_t max_selections_, max_experts_, max_tokens_, tokens_per_chunk_;
  // Each selection's rank in its chunk of tokens; per chunk of tokens and expert (and the other
  // ranks' experts last), the selections, then the selections of the chunks before; per expert,
  // the selections.
  DeviceBuffer<int32_t> rank_, chunk_count_, counts_;
};

}  // namespace moeut::cuda
