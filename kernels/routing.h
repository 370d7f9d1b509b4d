// Sigmoid top-k routing: per token and per group (a head, or the whole FFN layer), the k experts
// with the largest sigmoid(logit) and those sigmoid values as differentiable weights. The choice
// itself carries no gradient.
#pragma once
#include <cstdint>

namespace moeut {

// logits [n, groups * E]; index, weight [n, groups, k]; index is within the group (0..E-1),
// ordered by descending weight, ties to the lower expert index.
template <typename T>
void topk_sigmoid_forward(int32_t* index, T* weight, const T* logits, int64_t n, int64_t groups,
                          int64_t E, int64_t k);

// Accumulates dlogits[selected] += dweight * w * (1 - w).
template <typename T>
void topk_sigmoid_backward(T* dlogits, const T* dweight, const int32_t* index, const T* weight,
                           int64_t n, int64_t groups, int64_t E, int64_t k);

}  // namespace moeut
