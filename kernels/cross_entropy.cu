#include "kernels/cross_entropy_cuda.h"
#include "kernels/cuda_check.h"
#include "kernels/lane_reduce.cuh"

namespace moeut::cuda {
namespace {

constexpr int kThreads = 256;

__device__ inline float block_reduce(float v, bool is_max, float* scratch) {
  v = is_max ? warp_max(v) : warp_sum(v);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = threadIdx.x < kThreads / 32 ? scratch[threadIdx.x] : (is_max ? -INFINITY : 0.f);
    v = is_max ? warp_max(v) : warp_sum(v);
    if (threadIdx.x == 0) scratch[0] = v;
  }
  __syncthreads();
  const float out = scratch[0];
  __syncthreads();
  return out;
}

// One block per row. The bias (when given) is added here, as the row is read, instead of into
// the logits before the product: the product then writes its logits without reading them first.
__global__ void cross_entropy_kernel(float* row_loss, __nv_bfloat16* dlogits, const float* logits,
                                     const __nv_bfloat16* bias, const int32_t* targets, int V, float scale) {
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x;
  const float* z = logits + r * V;
  auto logit = [&](int v) { return bias ? z[v] + __bfloat162float(bias[v]) : z[v]; };
  float mx = -INFINITY;
  for (int v = threadIdx.x; v < V; v += kThreads) mx = fmaxf(mx, logit(v));
  mx = block_reduce(mx, true, scratch);
  float s = 0.f;
  for (int v = threadIdx.x; v < V; v += kThreads) s += __expf(logit(v) - mx);
  s = block_reduce(s, false, scratch);
  const float lse = mx + __logf(s);
  const int target = targets[r];
  if (threadIdx.x == 0) row_loss[r] = lse - logit(target);
  if (!dlogits) return;
  for (int v = threadIdx.x; v < V; v += kThreads)
    dlogits[r * V + v] = __float2bfloat16(scale * (__expf(logit(v) - lse) - (v == target ? 1.f : 0.f)));
}

}  // namespace

void cross_entropy(float* row_loss, __nv_bfloat16* dlogits, const float* logits, const __nv_bfloat16* bias,
                   const int32_t* targets, int64_t m, int64_t V, float grad_scale, cudaStream_t stream) {
  if (m == 0) return;
  cross_entropy_kernel<<<unsigned(m), kThreads, 0, stream>>>(row_loss, dlogits, logits, bias, targets, int(V),
                                                             grad_scale);
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeut::cuda
