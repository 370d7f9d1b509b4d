// AdamW and the gradient norm on the GPU: fp32 master weights and moments, the bf16 working
// copy the products read rewritten in the same pass.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/adamw.h"

namespace moeut::cuda {

// non_finite (device, may be null): set to 1 when an updated master value is not finite, in the
// update's own pass (never cleared here).
void adamw_update(float* master, __nv_bfloat16* working, const float* grad, float* m, float* v, int64_t n,
                  const AdamWHyper& h, int64_t t, double grad_scale, float* non_finite, cudaStream_t stream);

// Adds the sum of squares of x[0..n) into *out (device, double).
void sum_of_squares(double* out, const float* x, int64_t n, cudaStream_t stream);

}  // namespace moeut::cuda
