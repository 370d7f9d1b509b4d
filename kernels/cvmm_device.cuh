// cvmm on the GPU: see cvmm_cuda.h. Hopper tensor-core tiles (wgmma, bf16 -> fp32) over the
// selections of one expert; row gathers happen in the tile loads, weights and scatters in the
// epilogue (row products) or in shared memory (weight gradients).
// The pieces that the per-tile, scatter, gather and weight-gradient kernels share (private to
// kernels/cvmm_*.cu); their copies and scheduling are in cvmm_pipeline.cuh.
#pragma once
#include <algorithm>
#include <cstdint>

#include "kernels/cvmm_cuda.h"
#include "kernels/cvmm_pipeline.cuh"
#include "kernels/lane_reduce.cuh"
#include "kernels/tma.cuh"
#include "kernels/wgmma.cuh"

namespace moeut::cuda {

__host__ __device__ inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// 16-byte vector access needs both a row width that keeps rows 16-byte apart (multiple of 8
// elements) and a 16-byte aligned base: tensors inside one parameter buffer need not start on
// one.
__host__ __device__ inline bool vectorizable(const void* base, int64_t width) {
  return width % 8 == 0 && reinterpret_cast<uintptr_t>(base) % 16 == 0;
}
inline constexpr int kPadC = 4;  // fp32 epilogue rows 16 bytes apart in banks

// The row products' pieces: 128 selections of one expert x 128 output columns per tile, two
// warpgroups (wgmma m64n128k16, 64 rows each), K in slabs of 64 in the 128-byte swizzled layout.
// A (gathered rows) is K-major; B is K-major when W_e is stored [N][K] (kTransW) and MN-major when
// stored [K][N].
inline constexpr int BM = kCvmmTileRows, BN = 128, BK = 64, kRowsThreads = 256;
inline constexpr int kSlabA = BM * BK * 2, kSlabB = BN * BK * 2, kStageBytes = kSlabA + kSlabB, kCStride = BN + kPadC;
inline constexpr size_t kSmemAlign = 1024;  // swizzled slabs start 1024-byte aligned
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
inline constexpr size_t kSmemBytes =
    kSmemAlign + std::max<size_t>(size_t(kStages) * kStageBytes, sizeof(float) * BM * kCStride);

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

// A plan's tail counters (CvmmPlan::tail_counters), zeroed as every plan starts (cvmm_plan.cu).
DeviceBuffer<uint32_t> zeroed_tail_counters();

// The persistent kernels' launches (cvmm_scatter.cu, cvmm_gather.cu), which cvmm_rows picks
// (cvmm_rows.cu).
template <bool kTransW>
void launch_scatter(const CvmmPlan& plan, const CvmmRowsArgs& a, cudaStream_t stream);
template <bool kTransW>
void launch_gather(const CvmmPlan& plan, const CvmmRowsArgs& a, cudaStream_t stream);

}  // namespace moeut::cuda
