#include <algorithm>

#include "kernels/cuda_check.h"
#include "kernels/layernorm.h"
#include "kernels/layernorm_cuda.h"

namespace moeut::cuda {
namespace {

__device__ inline float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

constexpr int kWarps = 8;

// One warp per row.
__global__ void layernorm_forward_kernel(__nv_bfloat16* out, float* mean, float* rstd, const float* x,
                                         const __nv_bfloat16* w, const __nv_bfloat16* b, int64_t n, int d) {
  const int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n) return;
  const float* xr = x + row * d;
  float s = 0.f;
  for (int i = lane; i < d; i += 32) s += xr[i];
  const float mu = warp_sum(s) / float(d);
  float v = 0.f;
  for (int i = lane; i < d; i += 32) v += (xr[i] - mu) * (xr[i] - mu);
  const float rs = rsqrtf(warp_sum(v) / float(d) + float(kLayerNormEps));
  for (int i = lane; i < d; i += 32)
    out[row * d + i] = __float2bfloat16((xr[i] - mu) * rs * __bfloat162float(w[i]) + __bfloat162float(b[i]));
  if (lane == 0) {
    mean[row] = mu;
    rstd[row] = rs;
  }
}

// One warp per row, rows strided over the grid; each block sums its rows' parameter gradients
// in shared memory and adds them to the global ones once.
__global__ void layernorm_backward_kernel(float* dx, float* dw, float* db, const float* dout, const float* x,
                                          const __nv_bfloat16* w, const float* mean, const float* rstd, int64_t n,
                                          int d) {
  extern __shared__ float acc[];  // [2][d]
  for (int i = threadIdx.x; i < 2 * d; i += blockDim.x) acc[i] = 0.f;
  __syncthreads();
  const int lane = threadIdx.x % 32;
  for (int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; row < n; row += int64_t(gridDim.x) * kWarps) {
    const float* xr = x + row * d;
    const float* gr = dout + row * d;
    const float mu = mean[row], rs = rstd[row];
    float g_mean = 0.f, gx_mean = 0.f;
    for (int i = lane; i < d; i += 32) {
      const float g = gr[i] * __bfloat162float(w[i]);
      g_mean += g;
      gx_mean += g * (xr[i] - mu) * rs;
    }
    g_mean = warp_sum(g_mean) / float(d);
    gx_mean = warp_sum(gx_mean) / float(d);
    for (int i = lane; i < d; i += 32) {
      const float xhat = (xr[i] - mu) * rs;
      dx[row * d + i] += rs * (gr[i] * __bfloat162float(w[i]) - g_mean - xhat * gx_mean);
      atomicAdd(&acc[i], gr[i] * xhat);
      atomicAdd(&acc[d + i], gr[i]);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    atomicAdd(dw + i, acc[i]);
    atomicAdd(db + i, acc[d + i]);
  }
}

}  // namespace

void layernorm_forward(__nv_bfloat16* out, float* mean, float* rstd, const float* x, const __nv_bfloat16* weight,
                       const __nv_bfloat16* bias, int64_t n, int64_t d, cudaStream_t stream) {
  if (n == 0) return;
  layernorm_forward_kernel<<<unsigned((n + kWarps - 1) / kWarps), kWarps * 32, 0, stream>>>(out, mean, rstd, x, weight,
                                                                                           bias, n, int(d));
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

void layernorm_backward(float* dx, float* dweight, float* dbias, const float* dout, const float* x,
                        const __nv_bfloat16* weight, const float* mean, const float* rstd, int64_t n, int64_t d,
                        cudaStream_t stream) {
  if (n == 0) return;
  const unsigned blocks = unsigned(std::min<int64_t>((n + kWarps - 1) / kWarps, 264));
  layernorm_backward_kernel<<<blocks, kWarps * 32, 2 * d * sizeof(float), stream>>>(dx, dweight, dbias, dout, x, weight,
                                                                                   mean, rstd, n, int(d));
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeut::cuda
