// LayerNorm on the GPU: fp32 residual in, bf16 out (the input of the next products), fp32
// statistics; the output's gradient in fp32 or bf16 (as the products that read the output give
// it), the others in fp32.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moeut::cuda {

// x_bf16, when not null, also receives x in bf16 (a copy the products read, made in the same pass),
// and x_copy x itself (the residual buffer that a sublayer's output is then added into starts as
// its input without a copy pass reading x again).
void layernorm_forward(__nv_bfloat16* out, float* mean, float* rstd, const float* x, const __nv_bfloat16* weight,
                       const __nv_bfloat16* bias, int64_t n, int64_t d, cudaStream_t stream,
                       __nv_bfloat16* x_bf16 = nullptr, float* x_copy = nullptr);

// Accumulates into dx [n, d], dweight [d] and dbias [d]. dx_bf16, when not null, also receives the
// accumulated dx in bf16; out, when not null, the forward's output again (with bias), for weight
// gradients that read it after the backward pass instead of a forward pass recomputing it;
// x_bf16, when not null, the input x in bf16 (for products that read it after the backward).
void layernorm_backward(float* dx, float* dweight, float* dbias, const float* dout, const float* x,
                        const __nv_bfloat16* weight, const float* mean, const float* rstd, int64_t n, int64_t d,
                        cudaStream_t stream, __nv_bfloat16* dx_bf16 = nullptr, const __nv_bfloat16* bias = nullptr,
                        __nv_bfloat16* out = nullptr, __nv_bfloat16* x_bf16 = nullptr);
void layernorm_backward(float* dx, float* dweight, float* dbias, const __nv_bfloat16* dout, const float* x,
                        const __nv_bfloat16* weight, const float* mean, const float* rstd, int64_t n, int64_t d,
                        cudaStream_t stream, __nv_bfloat16* dx_bf16 = nullptr, const __nv_bfloat16* bias = nullptr,
                        __nv_bfloat16* out = nullptr, __nv_bfloat16* x_bf16 = nullptr);

}  // namespace moeut::cuda
