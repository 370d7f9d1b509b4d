// Sigmoid top-k routing on the GPU, fp32 (see routing.h for the definition, including the
// order: descending weight, ties to the lower expert index).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moeut::cuda {

// logits [n, groups * E], token rows ld apart (0: groups * E) -> index, weight [n, groups, k];
// E <= 1024, k <= 32. packed (optional) receives the logits as [n, groups * E]: a padded
// product's output is read once, by this kernel.
void topk_sigmoid_forward(int32_t* index, float* weight, const float* logits, int64_t n, int64_t groups, int64_t E,
                          int64_t k, cudaStream_t stream, int64_t ld = 0, float* packed = nullptr);
// The logits' gradient in bf16, token rows ld apart (columns past groups * E untouched): the
// regulariser's gradient dz_reg [n, groups * E] plus dweight * w * (1 - w) at the selected
// experts.
void topk_sigmoid_backward(__nv_bfloat16* dlogits, int64_t ld, const float* dz_reg, const float* dweight,
                           const int32_t* index, const float* weight, int64_t n, int64_t groups, int64_t E, int64_t k,
                           cudaStream_t stream);

}  // namespace moeut::cuda
