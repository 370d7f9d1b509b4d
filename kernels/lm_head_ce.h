// The LM head (logits = x W^T + bias) fused with next-token cross-entropy. Rows are processed
// in chunks so that only [chunk, V] logits exist at a time.
#pragma once
#include <cstdint>
#include <vector>

namespace moeut {

// logits [n, V] = x [n, d] · Wᵀ + bias [V].
template <typename T>
void lm_head_logits(T* logits, const T* x, const T* W, const T* bias, int64_t n, int64_t d, int64_t V);

// x [n, d], W [V, d], bias [V], targets [n]. Returns the sum over rows of
// logsumexp(logits) - logits[target]; row_loss [n] receives each row's term when not null.
// When dx is not null, also accumulates the gradient of grad_scale * (that sum) into
// dx [n, d], dW [V, d] and dbias [V]. scratch holds one chunk of logits.
template <typename T>
double lm_head_ce(T* dx, T* dW, T* dbias, double* row_loss, const T* x, const T* W,
                  const T* bias, const int32_t* targets, int64_t n, int64_t d, int64_t V,
                  T grad_scale, std::vector<T>& scratch);

}  // namespace moeut
