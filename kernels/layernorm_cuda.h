// LayerNorm on the GPU: fp32 residual in, bf16 out (the input of the next products), fp32
// statistics; gradients in fp32.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moeut::cuda {

void layernorm_forward(__nv_bfloat16* out, float* mean, float* rstd, const float* x, const __nv_bfloat16* weight,
                       const __nv_bfloat16* bias, int64_t n, int64_t d, cudaStream_t stream);

// Accumulates into dx [n, d], dweight [d] and dbias [d].
void layernorm_backward(float* dx, float* dweight, float* dbias, const float* dout, const float* x,
                        const __nv_bfloat16* weight, const float* mean, const float* rstd, int64_t n, int64_t d,
                        cudaStream_t stream);

}  // namespace moeut::cuda
