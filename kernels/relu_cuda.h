// ReLU on the GPU, in place on bf16 (see relu.h).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moeut::cuda {

void relu_forward(__nv_bfloat16* x, int64_t n, cudaStream_t stream);
// dx = dout where out > 0, else 0; dx may be dout.
void relu_backward(__nv_bfloat16* dx, const __nv_bfloat16* dout, const __nv_bfloat16* out, int64_t n, cudaStream_t stream);
// The bf16 copy of an fp32 tensor that the products read (the residual stream, its gradient).
void to_bf16(__nv_bfloat16* out, const float* x, int64_t n, cudaStream_t stream);
// The same for x [rows, cols] into rows `out_ld` elements apart, zeros in the padding (for
// aligned products).
void to_bf16_rows(__nv_bfloat16* out, int64_t out_ld, const float* x, int64_t rows, int64_t cols, cudaStream_t stream);

}  // namespace moeut::cuda
