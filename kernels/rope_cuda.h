// RoPE on the GPU, in place on bf16 q or k [B, T, H, dh] (see rope.h for the definition); token rows
// ld elements apart (0: H·dh).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moeut::cuda {

void rope_forward(__nv_bfloat16* x, int64_t B, int64_t T, int64_t H, int64_t dh, int64_t n_rot, cudaStream_t stream);
void rope_backward(__nv_bfloat16* dx, int64_t B, int64_t T, int64_t H, int64_t dh, int64_t n_rot, cudaStream_t stream,
                   int64_t ld = 0);

}  // namespace moeut::cuda
