// cvmm_rows (see cvmm_cuda.h) and its per-tile kernel. Scatters that cvmm_on_scatter_kernel takes
// go to the persistent scatter kernel (cvmm_scatter.cu); deeper products of one band over whole
// 64-deep slabs, with 16-byte aligned rows, to the persistent gather kernel (cvmm_gather.cu); the
// rest to the per-tile one, here.
// cvmm_rows: one block per (row tile, 128 output columns), K through the cp.async pipeline
// (cvmm_pipeline.cuh), its warpgroups and slabs as the row products' pieces (cvmm_device.cuh). The
// epilogue weights the tile's rows, then stores them in bf16 or adds them into fp32 rows.
#include <stdexcept>
#include <string>

#include "kernels/cuda_check.h"
#include "kernels/cvmm_cuda.h"
#include "kernels/cvmm_device.cuh"

namespace moeut::cuda {
namespace {

// Plan tile `tile` into t by the whole block; returns how many rows are live.
__device__ int load_tile_rows(TileRows& t, const CvmmPlan& plan, const float* weight, int tile, int& expert) {
  expert = plan.tile_expert[tile];
  const int first = plan.tile_first[tile];
  const int rows = int(min64(BM, plan.expert_begin[expert + 1] - first));
  look_up_rows(t, plan, weight, first, rows, threadIdx.x, blockDim.x);
  __syncthreads();
  return rows;
}

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

template <bool kTransW>
void launch_rows(const CvmmPlan& plan, const CvmmRowsArgs& a, cudaStream_t stream) {
  const dim3 grid(unsigned(plan.tiles), unsigned((a.N + BN - 1) / BN));
  launch_with_smem(cvmm_rows_kernel<kTransW>, grid, kRowsThreads, kSmemBytes, stream, plan, a);
}

}  // namespace

void cvmm_rows(const CvmmPlan& plan, const CvmmRowsArgs& a, cudaStream_t stream) {
  if (plan.tiles == 0) return;
  if (a.accumulate ? !a.out_f32 : !a.out) throw std::invalid_argument("cvmm_rows: output buffer missing");
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

}  // namespace moeut::cuda
