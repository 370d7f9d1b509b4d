// cvmm on the GPU: see cvmm_cuda.h. Tensor-core (WMMA, bf16 -> fp32) tiles over the selections
// of one expert; row gathers happen in the tile loads, weights and scatters in the epilogue.
#include <cub/device/device_radix_sort.cuh>
#include <mma.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include <cstdio>
#include <stdexcept>
#include <string>

#include "kernels/cuda_check.h"
#include "kernels/cvmm_cuda.h"

namespace moeut::cuda {
namespace {

using namespace nvcuda;
using bf16 = __nv_bfloat16;

constexpr int BM = kCvmmTileRows, BN = 128, BK = 32, kThreads = 128;

__host__ __device__ inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// 16-byte vector access needs both a row width that keeps rows 16-byte apart (multiple of 8
// elements) and a 16-byte aligned base: tensors inside one parameter buffer need not start on
// one.
__host__ __device__ inline bool vectorizable(const void* base, int64_t width) {
  return width % 8 == 0 && reinterpret_cast<uintptr_t>(base) % 16 == 0;
}
constexpr int kPadA = 8, kPadC = 4;  // keeps rows 16 bytes apart in banks; ldm multiples for WMMA

__device__ inline void cp_async16(void* smem, const void* gmem) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(addr), "l"(gmem));
}
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ inline void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Copies 8 consecutive bf16 from src (valid: how many of them exist) into dst; 16-byte
// asynchronous copy when whole and aligned, element by element with zero fill otherwise.
__device__ inline void load8(bf16* dst, const bf16* src, int valid, bool aligned) {
  if (valid >= 8 && aligned) {
    cp_async16(dst, src);
  } else {
    for (int i = 0; i < 8; ++i) dst[i] = i < valid ? src[i] : __float2bfloat16(0.f);
  }
}

// One block: 64 selections of one expert x 128 output columns. 4 warps, each 32 x 64.
template <bool kTransW>
__global__ void __launch_bounds__(kThreads) cvmm_rows_kernel(CvmmPlan plan, CvmmRowsArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int a_stride = BK + kPadA;
  constexpr int b_rows = kTransW ? BN : BK, b_stride = kTransW ? BK + kPadA : BN + kPadA;
  bf16* As = reinterpret_cast<bf16*>(smem);                  // [2][BM][a_stride]
  bf16* Bs = As + 2 * BM * a_stride;                          // [2][b_rows][b_stride]
  float* Cs = reinterpret_cast<float*>(smem);                 // [BM][BN + kPadC], after the loop
  __shared__ int32_t s_in[BM], s_out[BM], s_sel[BM];

  if (int(blockIdx.x) >= *plan.live_tiles) return;  // past this plan's tiles (see CvmmPlan)
  const int tile = blockIdx.x, n0 = blockIdx.y * BN;
  const int e = plan.tile_expert[tile], first = plan.tile_first[tile];
  const int rows = int(min64(BM, plan.expert_begin[e + 1] - first));
  const int64_t K = a.K, N = a.N;
  for (int r = threadIdx.x; r < BM; r += kThreads) {
    const int s = r < rows ? plan.by_expert[first + r] : -1;
    s_sel[r] = s;
    s_in[r] = s >= 0 ? plan.in_row[s] : -1;
    s_out[r] = s >= 0 ? plan.out_row[s] : -1;
  }
  __syncthreads();
  const bf16* We = a.W + int64_t(e) * K * N;
  const bool x_aligned = vectorizable(a.X, K), w_aligned = vectorizable(We, kTransW ? K : N);

  auto load_tiles = [&](int buf, int64_t k0) {
    bf16* as = As + buf * BM * a_stride;
    for (int c = threadIdx.x; c < BM * BK / 8; c += kThreads) {  // A: gathered rows
      const int r = c / (BK / 8), kc = (c % (BK / 8)) * 8;
      const int valid = s_in[r] < 0 ? 0 : int(min64(8, K - (k0 + kc)));
      load8(as + r * a_stride + kc, a.X + int64_t(max(s_in[r], 0)) * K + k0 + kc, valid, x_aligned);
    }
    bf16* bs = Bs + buf * b_rows * b_stride;
    if constexpr (!kTransW) {  // B[k][n] = W_e[k0 + k][n0 + n]
      for (int c = threadIdx.x; c < BK * BN / 8; c += kThreads) {
        const int k = c / (BN / 8), nc = (c % (BN / 8)) * 8;
        const int valid = k0 + k < K ? int(min64(8, N - (n0 + nc))) : 0;
        load8(bs + k * b_stride + nc, We + (k0 + k) * N + n0 + nc, valid, w_aligned);
      }
    } else {  // stored [n][k]: W_e is [N, K]
      for (int c = threadIdx.x; c < BN * BK / 8; c += kThreads) {
        const int n = c / (BK / 8), kc = (c % (BK / 8)) * 8;
        const int valid = n0 + n < N ? int(min64(8, K - (k0 + kc))) : 0;
        load8(bs + n * b_stride + kc, We + (n0 + n) * K + k0 + kc, valid, w_aligned);
      }
    }
    cp_async_commit();
  };

  const int warp = threadIdx.x / 32, wm = (warp / 2) * 32, wn = (warp % 2) * 64;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][4];
  for (auto& row : acc)
    for (auto& f : row) wmma::fill_fragment(f, 0.f);
  using BLayout = std::conditional_t<kTransW, wmma::col_major, wmma::row_major>;

  const int64_t k_tiles = (K + BK - 1) / BK;
  load_tiles(0, 0);
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    if (kt + 1 < k_tiles) {
      load_tiles(int((kt + 1) & 1), (kt + 1) * BK);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const bf16* as = As + (kt & 1) * BM * a_stride;
    const bf16* bs = Bs + (kt & 1) * b_rows * b_stride;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa[2];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, BLayout> fb[4];
#pragma unroll
      for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(fa[i], as + (wm + 16 * i) * a_stride + kk, a_stride);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const bf16* p = kTransW ? bs + (wn + 16 * j) * b_stride + kk : bs + kk * b_stride + wn + 16 * j;
        wmma::load_matrix_sync(fb[j], p, b_stride);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
    __syncthreads();
  }

  constexpr int c_stride = BN + kPadC;
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
      wmma::store_matrix_sync(Cs + (wm + 16 * i) * c_stride + wn + 16 * j, acc[i][j], c_stride, wmma::mem_row_major);
  __syncthreads();

  const int n_valid = int(min64(BN, N - n0));
  if (a.dweight) {  // two threads per row, 64 columns each, combined by a shuffle
    const int r = threadIdx.x / 2, half = threadIdx.x % 2;
    float sum = 0.f;
    if (s_sel[r] >= 0)
      for (int n = half * 64; n < min(n_valid, half * 64 + 64); ++n)
        sum += Cs[r * c_stride + n] * __bfloat162float(a.dot_rows[int64_t(s_out[r]) * N + n0 + n]);
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    if (half == 0 && s_sel[r] >= 0) atomicAdd(a.dweight + s_sel[r], sum);
  }
  if (a.accumulate && N % 4 == 0 && n_valid % 4 == 0 && reinterpret_cast<uintptr_t>(a.out_f32) % 16 == 0) {
    // Scatter: 32 threads per row, 4 columns each, one 16-byte vector atomic per thread.
    for (int r = threadIdx.x / 32; r < rows; r += kThreads / 32) {
      const float w = a.weight ? a.weight[s_sel[r]] : 1.f;
      float* base = a.out_f32 + int64_t(s_out[r]) * N + n0;
      for (int n = (threadIdx.x % 32) * 4; n < n_valid; n += 128) {
        const float* c = Cs + r * c_stride + n;
        atomicAdd(reinterpret_cast<float4*>(base + n), make_float4(w * c[0], w * c[1], w * c[2], w * c[3]));
      }
    }
    return;
  }
  for (int r = 0; r < rows; ++r) {  // one row at a time: consecutive threads, consecutive columns
    const float w = a.weight ? a.weight[s_sel[r]] : 1.f;
    const int64_t base = int64_t(s_out[r]) * N + n0;
    for (int n = threadIdx.x; n < n_valid; n += kThreads) {
      const float v = w * Cs[r * c_stride + n];
      if (a.accumulate) atomicAdd(a.out_f32 + base + n, v);
      else a.out[base + n] = __float2bfloat16(v);
    }
  }
}

// dW_e[k0.., n0..] += Σ_s A[a_row(s)][k]·w_s·B[b_row(s)][n]: tile 64 (K) x 128 (N) per block,
// selections taken 32 at a time through a two-stage cp.async pipeline; the routing weight
// scales the (smaller) A chunk in shared memory once it has landed.
constexpr int WK = 64, WS = 32;
__global__ void __launch_bounds__(kThreads) cvmm_weight_grad_kernel(CvmmPlan plan, CvmmWeightGradArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int at_stride = WK + kPadA, bt_stride = BN + kPadA, ct_stride = BN + kPadC;
  bf16* At = reinterpret_cast<bf16*>(smem);   // [2][WS][at_stride]: rows selections, cols k
  bf16* Bt = At + 2 * WS * at_stride;          // [2][WS][bt_stride]: rows selections, cols n
  float* Ct = reinterpret_cast<float*>(smem);  // [WK][ct_stride], after the loop
  const int64_t K = a.K, N = a.N;
  const int64_t n_tiles_n = (N + BN - 1) / BN;
  const int64_t k0 = (blockIdx.x / n_tiles_n) * WK, n0 = (blockIdx.x % n_tiles_n) * BN;
  const int e = blockIdx.y;
  const int64_t begin = plan.expert_begin[e], end = plan.expert_begin[e + 1];
  if (begin == end) return;
  const bool a_aligned = vectorizable(a.A, K), b_aligned = vectorizable(a.B, N);

  auto rows_of = [&](int64_t p, int64_t& arow, int64_t& brow) {
    const int s = plan.by_expert[p];
    arow = a.a_by_in_row ? plan.in_row[s] : plan.out_row[s];
    brow = a.a_by_in_row ? plan.out_row[s] : plan.in_row[s];
  };
  auto load_chunk = [&](int buf, int64_t p0) {
    bf16* at = At + buf * WS * at_stride;
    bf16* bt = Bt + buf * WS * bt_stride;
    for (int c = threadIdx.x; c < WS * WK / 8; c += kThreads) {
      const int r = c / (WK / 8), kc = (c % (WK / 8)) * 8;
      int64_t arow = 0, brow = 0;
      const bool live = p0 + r < end;
      if (live) rows_of(p0 + r, arow, brow);
      load8(at + r * at_stride + kc, a.A + arow * K + k0 + kc, live ? int(min64(8, K - (k0 + kc))) : 0, a_aligned);
    }
    for (int c = threadIdx.x; c < WS * BN / 8; c += kThreads) {
      const int r = c / (BN / 8), nc = (c % (BN / 8)) * 8;
      int64_t arow = 0, brow = 0;
      const bool live = p0 + r < end;
      if (live) rows_of(p0 + r, arow, brow);
      load8(bt + r * bt_stride + nc, a.B + brow * N + n0 + nc, live ? int(min64(8, N - (n0 + nc))) : 0, b_aligned);
    }
    cp_async_commit();
  };

  const int warp = threadIdx.x / 32, wm = (warp / 2) * 32, wn = (warp % 2) * 64;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][4];
  for (auto& row : acc)
    for (auto& f : row) wmma::fill_fragment(f, 0.f);
  load_chunk(0, begin);
  for (int64_t p0 = begin, chunk = 0; p0 < end; p0 += WS, ++chunk) {
    const int buf = int(chunk & 1);
    if (p0 + WS < end) {
      load_chunk(buf ^ 1, p0 + WS);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    bf16* at = At + buf * WS * at_stride;
    if (a.weight) {  // 4 threads per selection row, 16 columns each
      const int r = threadIdx.x / 4, c0 = (threadIdx.x % 4) * 16;
      if (p0 + r < end) {
        const float w = a.weight[plan.by_expert[p0 + r]];
        for (int c = c0; c < c0 + 16; ++c) at[r * at_stride + c] = __float2bfloat16(w * __bfloat162float(at[r * at_stride + c]));
      }
      __syncthreads();
    }
    const bf16* bt = Bt + buf * WS * bt_stride;
#pragma unroll
    for (int kk = 0; kk < WS; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::col_major> fa[2];  // Aᵀ
      wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> fb[4];
#pragma unroll
      for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(fa[i], at + kk * at_stride + wm + 16 * i, at_stride);
#pragma unroll
      for (int j = 0; j < 4; ++j) wmma::load_matrix_sync(fb[j], bt + kk * bt_stride + wn + 16 * j, bt_stride);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
      wmma::store_matrix_sync(Ct + (wm + 16 * i) * ct_stride + wn + 16 * j, acc[i][j], ct_stride, wmma::mem_row_major);
  __syncthreads();
  float* dWe = a.dW + int64_t(e) * K * N;
  for (int c = threadIdx.x; c < WK * BN; c += kThreads) {
    const int k = c / BN, n = c % BN;
    if (k0 + k < K && n0 + n < N) dWe[(k0 + k) * N + n0 + n] += Ct[k * ct_stride + n];
  }
}

}  // namespace

namespace {

std::vector<int32_t> tile_list(const CvmmSelection& sel, bool experts) {
  std::vector<int32_t> out;
  for (size_t e = 0; e + 1 < sel.expert_begin.size(); ++e)
    for (int64_t p = sel.expert_begin[e]; p < sel.expert_begin[e + 1]; p += kCvmmTileRows)
      out.push_back(experts ? int32_t(e) : int32_t(p));
  return out;
}

}  // namespace

DeviceCvmmPlan::DeviceCvmmPlan(const CvmmSelection& sel) {
  in_row = DeviceBuffer<int32_t>(sel.in_row);
  out_row = DeviceBuffer<int32_t>(sel.out_row);
  by_expert = DeviceBuffer<int32_t>(sel.by_expert);
  const std::vector<int32_t> experts = tile_list(sel, true);
  tile_expert = DeviceBuffer<int32_t>(experts);
  tile_first = DeviceBuffer<int32_t>(tile_list(sel, false));
  expert_begin = DeviceBuffer<int64_t>(sel.expert_begin);
  tiles = int32_t(experts.size());
  live_tiles = DeviceBuffer<int32_t>(std::vector<int32_t>{tiles});
}

CvmmPlan CvmmPlanBuffers::view(bool swapped) const {
  return {swapped ? out_row.get() : in_row.get(), swapped ? in_row.get() : out_row.get(), by_expert.get(),
          expert_begin.get(), tile_expert.get(), tile_first.get(), live_tiles.get(), tiles};
}

namespace {

__global__ void route_keys(int32_t* key, int32_t* order, int32_t* in_row, int32_t* out_row, const int32_t* index,
                           int64_t n_sel, int groups, int E, int k, CvmmRoute route) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_sel) return;
  const int64_t tg = i / k, t = tg / groups;  // tg = t·groups + g
  const int g = int(tg % groups);
  // A negative index is a selection this rank does not compute (its expert lives on another
  // rank): it sorts past the last expert and no tile covers it.
  key[i] = index[i] < 0 ? groups * E : g * E + index[i];
  order[i] = int32_t(i);
  in_row[i] = int32_t(route == CvmmRoute::kGroupRowsToTokens ? tg : t);
  out_row[i] = int32_t(route == CvmmRoute::kGatherToGroupRows ? tg : route == CvmmRoute::kGatherToSelections ? i : t);
}

__global__ void count_experts(int32_t* counts, const int32_t* key, int64_t n_sel, int experts) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n_sel && key[i] < experts) atomicAdd(counts + key[i], 1);
}

// One thread: offsets from counts, then the row tiles of every expert in order. Experts are at
// most a few thousand and tiles n/64 + experts: microseconds, and no host round trip.
__global__ void offsets_and_tiles(int64_t* begin, int32_t* tile_expert, int32_t* tile_first, int32_t* live_tiles,
                                  const int32_t* counts, int experts) {
  int64_t pos = 0;
  int32_t tiles = 0;
  for (int e = 0; e < experts; ++e) {
    begin[e] = pos;
    for (int64_t p = pos; p < pos + counts[e]; p += kCvmmTileRows) {
      tile_expert[tiles] = e;
      tile_first[tiles] = int32_t(p);
      ++tiles;
    }
    pos += counts[e];
  }
  begin[experts] = pos;
  *live_tiles = tiles;
}

int32_t max_tiles(int64_t selections, int64_t experts) {
  return int32_t((selections + kCvmmTileRows - 1) / kCvmmTileRows + experts);
}

}  // namespace

CvmmPlanner::CvmmPlanner(int64_t max_selections, int64_t max_experts)
    : max_selections_(max_selections), max_experts_(max_experts), keys_(size_t(max_selections)),
      sorted_keys_(size_t(max_selections)), order_(size_t(max_selections)), counts_(size_t(max_experts)) {
  size_t bytes = 0;
  MOEUT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, keys_.get(), sorted_keys_.get(), order_.get(),
                                                   order_.get(), int(max_selections)));
  sort_scratch_ = DeviceBuffer<unsigned char>(std::max<size_t>(bytes, 1));
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
  p.expert_begin = DeviceBuffer<int64_t>(size_t(max_experts_ + 1));
  return p;
}

void CvmmPlanner::build(CvmmPlanBuffers& plan, const int32_t* index, int64_t n, int64_t groups, int64_t E, int64_t k,
                        CvmmRoute route, cudaStream_t stream) {
  const int64_t sels = n * groups * k, experts = groups * E;
  if (sels > max_selections_ || experts > max_experts_)
    throw std::invalid_argument("CvmmPlanner: " + std::to_string(sels) + " selections over " + std::to_string(experts) +
                                " experts exceed the planned " + std::to_string(max_selections_) + " over " +
                                std::to_string(max_experts_));
  plan.tiles = max_tiles(sels, experts);
  MOEUT_CUDA_CHECK(cudaMemsetAsync(counts_.get(), 0, size_t(experts) * sizeof(int32_t), stream));
  if (sels > 0) {
    const unsigned blocks = unsigned((sels + 255) / 256);
    route_keys<<<blocks, 256, 0, stream>>>(keys_.get(), order_.get(), plan.in_row.get(), plan.out_row.get(), index, sels,
                                           int(groups), int(E), int(k), route);
    MOEUT_CUDA_CHECK(cudaGetLastError());
    int end_bit = 1;
    while ((int64_t(1) << end_bit) <= experts) ++end_bit;  // keys run to `experts` (not computed here)
    size_t bytes = sort_scratch_.size();
    // Stable: selections of one expert keep their order, so results repeat run to run.
    MOEUT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(sort_scratch_.get(), bytes, keys_.get(), sorted_keys_.get(),
                                                     order_.get(), plan.by_expert.get(), int(sels), 0, end_bit, stream));
    count_experts<<<blocks, 256, 0, stream>>>(counts_.get(), keys_.get(), sels, int(experts));
    MOEUT_CUDA_CHECK(cudaGetLastError());
  }
  offsets_and_tiles<<<1, 1, 0, stream>>>(plan.expert_begin.get(), plan.tile_expert.get(), plan.tile_first.get(),
                                         plan.live_tiles.get(), counts_.get(), int(experts));
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

void cvmm_rows(const CvmmPlan& plan, const CvmmRowsArgs& a, cudaStream_t stream) {
  if (plan.tiles == 0) return;
  if (a.accumulate ? !a.out_f32 : !a.out) throw std::invalid_argument("cvmm_rows: output buffer missing");
  const dim3 grid(unsigned(plan.tiles), unsigned((a.N + BN - 1) / BN));
  const size_t loop_bytes = sizeof(bf16) * 2 * (BM * (BK + kPadA) + (a.transpose_w ? BN * (BK + kPadA) : BK * (BN + kPadA)));
  const size_t bytes = std::max(loop_bytes, sizeof(float) * BM * (BN + kPadC));
  if (a.transpose_w) cvmm_rows_kernel<true><<<grid, kThreads, bytes, stream>>>(plan, a);
  else cvmm_rows_kernel<false><<<grid, kThreads, bytes, stream>>>(plan, a);
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

void cvmm_weight_grad(const CvmmPlan& plan, const CvmmWeightGradArgs& a, cudaStream_t stream) {
  const dim3 grid(unsigned(((a.K + WK - 1) / WK) * ((a.N + BN - 1) / BN)), unsigned(a.n_experts));
  const size_t bytes = std::max(sizeof(bf16) * 2 * WS * (WK + kPadA + BN + kPadA), sizeof(float) * WK * (BN + kPadC));
  cvmm_weight_grad_kernel<<<grid, kThreads, bytes, stream>>>(plan, a);
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeut::cuda
