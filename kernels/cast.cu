// fp32 -> bf16 copies on the GPU (see cast_cuda.h).
#include "kernels/cuda_check.h"
#include "kernels/cast_cuda.h"

namespace moeut::cuda {
namespace {

constexpr int kThreads = 256, kBlocks = 2048;

__global__ void to_bf16_kernel(__nv_bfloat16* out, const float* x, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16(x[i]);
}

}  // namespace

void to_bf16(__nv_bfloat16* out, const float* x, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  to_bf16_kernel<<<kBlocks, kThreads, 0, stream>>>(out, x, n);
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeut::cuda
