// Token embedding on the GPU: bf16 table rows into the fp32 residual stream; gradient rows
// added into the fp32 table gradient (atomically: tokens repeat).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moeut::cuda {

void embedding_forward(float* out, const int32_t* tokens, const __nv_bfloat16* table, int64_t n, int64_t d,
                       cudaStream_t stream);
void embedding_backward(float* dtable, const float* dout, const int32_t* tokens, int64_t n, int64_t d,
                        cudaStream_t stream);

}  // namespace moeut::cuda
