// fp32 -> bf16 copies on the GPU: the bf16 operands the products read. (The GPU's ReLU lives in
// the expert products' epilogues: see CvmmRowsArgs::relu.)
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moeut::cuda {

// The bf16 copy of an fp32 tensor that the products read (the residual stream, its gradient).
void to_bf16(__nv_bfloat16* out, const float* x, int64_t n, cudaStream_t stream);

}  // namespace moeut::cuda
