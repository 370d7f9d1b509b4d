// LayerNorm on the GPU: fp32 residual in, bf16 out (the input of the next products), fp32 rstd;
// the output's gradient in fp32 or bf16 (as the products that read the output give it), the
// others in fp32.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moeut::cuda {

// The backward pass reads x̂ = (x - mean)·rstd rounded to bf16 (xhat, when not null, receives it)
// instead of x in fp32: the residual stream is then added into in place, and a layer keeps 2 bytes
// an element of its LayerNorm's input instead of 4. The output is made from that rounded x̂ in
// both passes. x_bf16, when not null, also receives x in bf16 (a copy the products read, made in
// the same pass).
void layernorm_forward(__nv_bfloat16* out, float* rstd, const float* x, const __nv_bfloat16* weight,
                       const __nv_bfloat16* bias, int64_t n, int64_t d, cudaStream_t stream,
                       __nv_bfloat16* x_bf16 = nullptr, __nv_bfloat16* xhat = nullptr);

// Accumulates into dx [n, d], dweight [d] and dbias [d]. dx_bf16, when not null, also receives the
// accumulated dx in bf16; out, when not null, the forward's output again (bit for bit), for weight
// gradients that read it after the backward pass instead of a forward pass keeping it.
void layernorm_backward(float* dx, float* dweight, float* dbias, const float* dout, const __nv_bfloat16* xhat,
                        const __nv_bfloat16* weight, const float* rstd, int64_t n, int64_t d, cudaStream_t stream,
                        __nv_bfloat16* dx_bf16 = nullptr, const __nv_bfloat16* bias = nullptr,
                        __nv_bfloat16* out = nullptr);
void layernorm_backward(float* dx, float* dweight, float* dbias, const __nv_bfloat16* dout, const __nv_bfloat16* xhat,
                        const __nv_bfloat16* weight, const float* rstd, int64_t n, int64_t d, cudaStream_t stream,
                        __nv_bfloat16* dx_bf16 = nullptr, const __nv_bfloat16* bias = nullptr,
                        __nv_bfloat16* out = nullptr);

}  // namespace moeut::cuda
