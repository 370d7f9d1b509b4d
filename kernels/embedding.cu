#include "kernels/cuda_check.h"
#include "kernels/embedding_cuda.h"

namespace moeut::cuda {
namespace {

__global__ void embedding_forward_kernel(float* out, const int32_t* tokens, const __nv_bfloat16* table, int d) {
  const int64_t row = blockIdx.x;
  const __nv_bfloat16* src = table + int64_t(tokens[row]) * d;
  for (int i = threadIdx.x; i < d; i += blockDim.x) out[row * d + i] = __bfloat162float(src[i]);
}

__global__ void embedding_backward_kernel(float* dtable, const float* dout, const int32_t* tokens, int d) {
  const int64_t row = blockIdx.x;
  float* dst = dtable + int64_t(tokens[row]) * d;
  for (int i = threadIdx.x; i < d; i += blockDim.x) atomicAdd(dst + i, dout[row * d + i]);
}

}  // namespace

void embedding_forward(float* out, const int32_t* tokens, const __nv_bfloat16* table, int64_t n, int64_t d,
                       cudaStream_t stream) {
  if (n == 0) return;
  embedding_forward_kernel<<<unsigned(n), 256, 0, stream>>>(out, tokens, table, int(d));
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

void embedding_backward(float* dtable, const float* dout, const int32_t* tokens, int64_t n, int64_t d,
                        cudaStream_t stream) {
  if (n == 0) return;
  embedding_backward_kernel<<<unsigned(n), 256, 0, stream>>>(dtable, dout, tokens, int(d));
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeut::cuda
