#include <stdexcept>

#include "kernels/cuda_check.h"
#include "kernels/routing_cuda.h"

namespace moeut::cuda {
namespace {

constexpr int kWarps = 8, kMaxPerLane = 32;  // E <= 32 * 32

// One warp per (row, group): each lane holds experts lane, lane + 32, ...; k rounds of a warp
// arg-max (larger logit, then lower index) pick the experts in order.
__global__ void topk_kernel(int32_t* index, float* weight, const float* logits, int64_t rows, int E, int k) {
  const int64_t r = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const float* z = logits + r * E;
  uint32_t taken = 0;
  for (int j = 0; j < k; ++j) {
    float best = -INFINITY;
    int best_e = 0x7fffffff;
    for (int q = 0; q < kMaxPerLane; ++q) {
      const int e = lane + 32 * q;
      if (e >= E) break;
      if (!(taken >> q & 1u) && (z[e] > best || (z[e] == best && e < best_e))) {
        best = z[e];
        best_e = e;
      }
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
      if (ob > best || (ob == best && oe < best_e)) {
        best = ob;
        best_e = oe;
      }
    }
    if (best_e % 32 == lane) taken |= 1u << (best_e / 32);
    if (lane == 0) {
      index[r * k + j] = best_e;
      weight[r * k + j] = 1.f / (1.f + __expf(-best));
    }
  }
}

__global__ void topk_backward_kernel(float* dlogits, const float* dweight, const int32_t* index, const float* weight,
                                     int64_t rows, int E, int k) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * k) return;
  const float w = weight[i];
  dlogits[(i / k) * E + index[i]] += dweight[i] * w * (1.f - w);
}

}  // namespace

void topk_sigmoid_forward(int32_t* index, float* weight, const float* logits, int64_t n, int64_t groups, int64_t E,
                          int64_t k, cudaStream_t stream) {
  if (E > 32 * kMaxPerLane || k > 32 || k > E) throw std::invalid_argument("topk_sigmoid_forward: needs k <= E <= 1024, k <= 32");
  const int64_t rows = n * groups;
  if (rows == 0) return;
  topk_kernel<<<unsigned((rows + kWarps - 1) / kWarps), kWarps * 32, 0, stream>>>(index, weight, logits, rows, int(E), int(k));
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

void topk_sigmoid_backward(float* dlogits, const float* dweight, const int32_t* index, const float* weight, int64_t n,
                           int64_t groups, int64_t E, int64_t k, cudaStream_t stream) {
  const int64_t total = n * groups * k;
  if (total == 0) return;
  topk_backward_kernel<<<unsigned((total + 255) / 256), 256, 0, stream>>>(dlogits, dweight, index, weight, n * groups,
                                                                         int(E), int(k));
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeut::cuda
