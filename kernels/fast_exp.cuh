// Exponentials by the SFU alone, for softmaxes whose inputs are at or below their row's maximum.
#pragma once
#include <cuda_runtime.h>

namespace moeut::cuda {

constexpr float kLog2e = 1.4426950408889634f;

// 2^x by the SFU alone (exp2f adds range handling around it; results below 2^-126 flush to 0,
// which a probability that small may).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace moeut::cuda
