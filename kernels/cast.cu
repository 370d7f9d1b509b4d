// fp32 -> bf16 copies on the GPU (see cast_cuda.h).
#include <algorithm>

#include "kernels/cuda_check.h"
#include "kernels/cast_cuda.h"

namespace moeut::cuda {
namespace {

constexpr int kThreads = 256, kBlocks = 2048;

__global__ void to_bf16_kernel(__nv_bfloat16* out, const float* x, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16(x[i]);
}

__global__ void to_bf16_rows_kernel(__nv_bfloat16* out, int64_t out_ld, const float* x, int64_t rows, int64_t cols) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x)
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) out[r * out_ld + c] = __float2bfloat16(x[r * cols + c]);
}

}  // namespace

void to_bf16(__nv_bfloat16* out, const float* x, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  to_bf16_kernel<<<kBlocks, kThreads, 0, stream>>>(out, x, n);
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

void to_bf16_rows(__nv_bfloat16* out, int64_t out_ld, const float* x, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  to_bf16_rows_kernel<<<unsigned(std::min<int64_t>(rows, 65535)), kThreads, 0, stream>>>(out, out_ld, x, rows, cols);
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeut::cuda
