// Sigmoid top-k routing on the GPU, fp32 (see routing.h for the definition, including the
// order: descending weight, ties to the lower expert index).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace moeut::cuda {

// logits [n, groups * E] -> index, weight [n, groups, k]; E <= 1024, k <= 32.
void topk_sigmoid_forward(int32_t* index, float* weight, const float* logits, int64_t n, int64_t groups, int64_t E,
                          int64_t k, cudaStream_t stream);
// dlogits[selected] += dweight * w * (1 - w).
void topk_sigmoid_backward(float* dlogits, const float* dweight, const int32_t* index, const float* weight, int64_t n,
                           int64_t groups, int64_t E, int64_t k, cudaStream_t stream);

}  // namespace moeut::cuda
