// Sums and extremes over aligned groups of L lanes of a warp (L a power of two, at most 32) by xor
// shuffles: every lane of a group ends with the group's result. All 32 lanes must take part.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace moeut::cuda {

template <int L>
__device__ __forceinline__ float group_sum(float v) {
  static_assert(L > 0 && L <= 32 && (L & (L - 1)) == 0, "L: a power of two up to 32");
#pragma unroll
  for (int o = L / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <int L>
__device__ __forceinline__ float group_max(float v) {
  static_assert(L > 0 && L <= 32 && (L & (L - 1)) == 0, "L: a power of two up to 32");
#pragma unroll
  for (int o = L / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Unsigned maximum (kMax) or minimum: one instruction for a whole warp.
template <int L, bool kMax>
__device__ __forceinline__ uint32_t group_extreme_u32(uint32_t v) {
  static_assert(L > 0 && L <= 32 && (L & (L - 1)) == 0, "L: a power of two up to 32");
  if constexpr (L == 32) {
    return kMax ? __reduce_max_sync(0xffffffffu, v) : __reduce_min_sync(0xffffffffu, v);
  } else {
#pragma unroll
    for (int o = L / 2; o > 0; o >>= 1) {
      const uint32_t other = __shfl_xor_sync(0xffffffffu, v, o);
      v = kMax ? max(v, other) : min(v, other);
    }
    return v;
  }
}

__device__ __forceinline__ float warp_sum(float v) { return group_sum<32>(v); }
__device__ __forceinline__ float warp_max(float v) { return group_max<32>(v); }

}  // namespace moeut::cuda
