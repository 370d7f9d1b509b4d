#include <stdexcept>

#include "kernels/cuda_check.h"
#include "kernels/routing_cuda.h"
#include "kernels/with_ceiling.h"

namespace moeut::cuda {
namespace {

constexpr int kWarps = 8, kMaxPerLane = 32;  // E <= 32 * 32

// Logits as unsigned keys in the same order (NaN lowest; -0 and +0 equal, as compared in fp32).
__device__ __forceinline__ uint32_t order_key(float z) {
  const uint32_t u = z == 0.f ? 0u : __float_as_uint(z);
  return isnan(z) ? 0u : (u & 0x80000000u) ? ~u : u | 0x80000000u;
}

// One warp per (row, group); lane holds the keys of experts lane, lane + 32, ... in registers
// (P >= E / 32 of them) and knows the best of those not yet taken. Each of the k rounds takes the
// warp's largest key (ties to the lower expert index) with two warp reductions, and only the
// lane that gave it looks again. (Measured against rounds of shuffled arg-max over the logits
// and a bitwise k-th-largest search: docs/PERFORMANCE.md v12.)
template <int P>
__global__ void __launch_bounds__(kWarps * 32) topk_kernel(int32_t* index, float* weight, const float* logits,
                                                           int64_t rows, int E, int k) {
  const int lane = threadIdx.x % 32;
  const int64_t r = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (r >= rows) return;
  const float* z = logits + r * E;
  uint32_t key[P], taken = 0;  // taken: slots already chosen, or past E
#pragma unroll
  for (int q = 0; q < P; ++q) {
    const bool live = lane + 32 * q < E;
    key[q] = live ? order_key(z[lane + 32 * q]) : 0u;
    taken |= live ? 0u : 1u << q;
  }
  uint32_t best = 0;
  int slot = -1;  // this lane's best untaken slot (the lower one on ties), -1 when none is left
  auto look = [&] {
    slot = -1;
#pragma unroll
    for (int q = 0; q < P; ++q)
      if (!(taken >> q & 1u) && (slot < 0 || key[q] > best)) best = key[q], slot = q;
  };
  look();
  int mine = 0;  // lane j < k: the expert taken in round j
  for (int j = 0; j < k; ++j) {
    const uint32_t top = __reduce_max_sync(0xffffffffu, slot >= 0 ? best : 0u);
    const int winner = int(__reduce_min_sync(0xffffffffu, slot >= 0 && best == top ? unsigned(lane + 32 * slot) : ~0u));
    if (lane == j) mine = winner;
    if (lane == winner % 32) {
      taken |= 1u << slot;
      look();
    }
  }
  if (lane < k) {
    index[r * k + lane] = mine;
    weight[r * k + lane] = 1.f / (1.f + __expf(-z[mine]));
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
  // P: the logits a lane holds, at or above E / 32.
  with_ceiling<1, 2, 4, 8, 12, 16, 20, 24, 28, kMaxPerLane>((E + 31) / 32, [&](auto P) {
    topk_kernel<P><<<unsigned((rows + kWarps - 1) / kWarps), kWarps * 32, 0, stream>>>(index, weight, logits, rows,
                                                                                       int(E), int(k));
  });
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
