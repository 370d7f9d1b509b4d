#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/adamw_cuda.h"
#include "kernels/cuda_check.h"
#include "kernels/lane_reduce.cuh"

namespace moeut::cuda {
namespace {

struct AdamWArgs {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps, step, decay, bc2, scale;
};

__device__ __forceinline__ void adamw_element(float& p, float& m, float& v, float g, const AdamWArgs& a) {
  const float gi = g * a.scale;
  m = a.beta1 * m + a.one_minus_beta1 * gi;
  v = a.beta2 * v + a.one_minus_beta2 * gi * gi;
  p = p * a.decay - a.step * m / (sqrtf(v / a.bc2) + a.eps);
}

__device__ __forceinline__ void adamw_at(int64_t i, float* p, __nv_bfloat16* working, const float* g, float* m, float* v,
                                         const AdamWArgs& a) {
  float pi = p[i], mi = m[i], vi = v[i];
  adamw_element(pi, mi, vi, g[i], a);
  m[i] = mi, v[i] = vi, p[i] = pi;
  if (working) working[i] = __float2bfloat16(pi);
}

// Memory-bound (30 bytes per element): with `head` >= 0, elements [head, n) go four at a time by
// 16-byte accesses (every pointer is then 16-byte aligned at head, working 8-byte), the few before
// and after one thread each; with head < 0, every element alone (the pointers' alignments differ).
__global__ void adamw_kernel(float* p, __nv_bfloat16* working, const float* g, float* m, float* v, int64_t n,
                             int64_t head, AdamWArgs a) {
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  if (head < 0) {
    for (int64_t i = tid; i < n; i += stride) adamw_at(i, p, working, g, m, v, a);
    return;
  }
  const int64_t quads = (n - head) / 4, done = head + 4 * quads;
  for (int64_t j = tid; j < quads; j += stride) {
    const int64_t i = head + 4 * j;
    float4 p4 = *reinterpret_cast<const float4*>(p + i), m4 = *reinterpret_cast<const float4*>(m + i);
    float4 v4 = *reinterpret_cast<const float4*>(v + i);
    const float4 g4 = *reinterpret_cast<const float4*>(g + i);
    adamw_element(p4.x, m4.x, v4.x, g4.x, a);
    adamw_element(p4.y, m4.y, v4.y, g4.y, a);
    adamw_element(p4.z, m4.z, v4.z, g4.z, a);
    adamw_element(p4.w, m4.w, v4.w, g4.w, a);
    *reinterpret_cast<float4*>(m + i) = m4;
    *reinterpret_cast<float4*>(v + i) = v4;
    *reinterpret_cast<float4*>(p + i) = p4;
    if (working) {
      __nv_bfloat162* w2 = reinterpret_cast<__nv_bfloat162*>(working + i);
      w2[0] = __floats2bfloat162_rn(p4.x, p4.y);
      w2[1] = __floats2bfloat162_rn(p4.z, p4.w);
    }
  }
  if (tid < head) adamw_at(tid, p, working, g, m, v, a);
  else if (tid - head < n - done) adamw_at(done + tid - head, p, working, g, m, v, a);
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
                  const AdamWHyper& h, int64_t t, double grad_scale, cudaStream_t stream) {
  if (n == 0) return;
  const double bc1 = 1.0 - std::pow(h.beta1, double(t)), bc2 = 1.0 - std::pow(h.beta2, double(t));
  // 1 - beta in double: float(0.999) is 0.99900001, and 1 - that is 1.3e-5 away from 0.001.
  const AdamWArgs a{float(h.beta1), float(h.beta2), float(1.0 - h.beta1), float(1.0 - h.beta2), float(h.eps),
                    float(h.lr / bc1), float(1.0 - h.lr * h.weight_decay), float(bc2), float(grad_scale)};
  // Elements to the first 16-byte boundary, the same for every pointer or none is vectorised.
  auto misaligned = [](const void* x, size_t bytes) { return int64_t(reinterpret_cast<uintptr_t>(x) / bytes % 4); };
  const int64_t off = misaligned(master, 4);
  const bool same = misaligned(grad, 4) == off && misaligned(m, 4) == off && misaligned(v, 4) == off &&
                    (!working || misaligned(working, 2) == off) && reinterpret_cast<uintptr_t>(master) % 4 == 0 &&
                    (!working || reinterpret_cast<uintptr_t>(working) % 2 == 0);
  const int64_t head = same ? std::min<int64_t>(n, (4 - off) % 4) : -1;
  adamw_kernel<<<kBlocks, kThreads, 0, stream>>>(master, working, grad, m, v, n, head, a);
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

void sum_of_squares(double* out, const float* x, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  sum_of_squares_kernel<<<kBlocks, kThreads, 0, stream>>>(out, x, n);
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeut::cuda
