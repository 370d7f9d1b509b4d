// cvmm_sum_selections and cvmm_selection_dots (see cvmm_cuda.h), on the rows of at_selections plans.
// cvmm_sum_selections: a thread per kVec columns of an output row (8: 16-byte accesses).
// cvmm_selection_dots: a warp per selection, lanes over the columns.
#include "kernels/cuda_check.h"
#include "kernels/cvmm_cuda.h"
#include "kernels/cvmm_device.cuh"
#include "kernels/lane_reduce.cuh"

namespace moeut::cuda {
namespace {

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

}  // namespace

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

}  // namespace moeut::cuda
