// cvmm_weight_grad (see cvmm_cuda.h).
// dW_e[k0.., n0..] += Σ_s A[a_row(s)][k]·w_s·B[b_row(s)][n]: a 128 (K) x 128 (N) tile per block,
// two warpgroups of 64 K-rows each (wgmma m64n128k16, both operands MN-major: selections are the
// reduction), selections taken 64 at a time through the pipeline (cvmm_pipeline.cuh). Each thread
// scales the A chunks it copied by their routing weights once they land, so weighting costs no
// barrier.
// kByTma: which operand comes by tensor copies (its rows are positions: one 64 x 64 box per slab
// and step), 0 for none. The box's rows past the expert's end belong to the next expert (or lie
// past the tensor, read as zeros); each thread zeroes its chunk of those rows once they land.
// `uses` (1 or 2) plans and operands share dW (two layers that share the expert weights): a tile
// runs the first use's steps, then the second's, into one accumulator, and adds it to dW once
// (or writes it, a0.overwrite: then the tiles of an expert without selections write zeros).
#include <stdexcept>

#include "kernels/cuda_check.h"
#include "kernels/cvmm_cuda.h"
#include "kernels/cvmm_device.cuh"
#include "kernels/tma.cuh"
#include "kernels/wgmma.cuh"

namespace moeut::cuda {
namespace {

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

constexpr int WM = 128, WN = 128, WS = 64;
// The blocks run a group of 4 tiles (128-column slices) of every expert before the next group,
// so the blocks in flight gather from 4 slices of the token rows (at 1B, 4 x 4 MB of a 50 MB
// matrix), which L2 can hold; each expert's other operand is then read once per group. With all
// 12 tiles of an expert together the blocks would gather from whole rows, which miss L2; smaller
// groups read the other operand more often.
constexpr int kWeightGradTileGroup = 4;
static_assert((WM + WN) * WS * 2 == kStageBytes, "weight-gradient stages share the row products' size");

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
