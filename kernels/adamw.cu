#include <cmath>

#include "kernels/adamw_cuda.h"
#include "kernels/cuda_check.h"
#include "kernels/lane_reduce.cuh"

namespace moeut::cuda {
namespace {

__global__ void adamw_kernel(float* p, __nv_bfloat16* working, const float* g, float* m, float* v, int64_t n,
                             float beta1, float beta2, float one_minus_beta1, float one_minus_beta2, float eps,
                             float step, float decay, float bc2, float scale, float* non_finite) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float gi = g[i] * scale;
    const float mi = beta1 * m[i] + one_minus_beta1 * gi;
    const float vi = beta2 * v[i] + one_minus_beta2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const float pi = p[i] * decay - step * mi / (sqrtf(vi / bc2) + eps);
    p[i] = pi;
    if (working) working[i] = __float2bfloat16(pi);
    // Every thread that sees one stores the same value: no atomic needed.
    if (non_finite && !isfinite(pi)) *non_finite = 1.f;
  }
}

__global__ void sum_of_squares_kernel(double* out, const float* x, int64_t n) {
  float s = 0.f;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    s += x[i] * x[i];
  s = warp_sum(s);
  __shared__ float warp_sums[32];
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0;
    for (int w = 0; w < blockDim.x / 32; ++w) total += warp_sums[w];
    atomicAdd(out, total);
  }
}

constexpr int kThreads = 256, kBlocks = 1024;

}  // namespace

void adamw_update(float* master, __nv_bfloat16* working, const float* grad, float* m, float* v, int64_t n,
                  const AdamWHyper& h, int64_t t, double grad_scale, float* non_finite, cudaStream_t stream) {
  if (n == 0) return;
  const double bc1 = 1.0 - std::pow(h.beta1, double(t)), bc2 = 1.0 - std::pow(h.beta2, double(t));
  // 1 - beta in double: float(0.999) is 0.99900001, and 1 - that is 1.3e-5 away from 0.001.
  adamw_kernel<<<kBlocks, kThreads, 0, stream>>>(master, working, grad, m, v, n, float(h.beta1), float(h.beta2),
                                                float(1.0 - h.beta1), float(1.0 - h.beta2), float(h.eps), float(h.lr / bc1), float(1.0 - h.lr * h.weight_decay),
                                                float(bc2), float(grad_scale), non_finite);
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

void sum_of_squares(double* out, const float* x, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  sum_of_squares_kernel<<<kBlocks, kThreads, 0, stream>>>(out, x, n);
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeut::cuda
