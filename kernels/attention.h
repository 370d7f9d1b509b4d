// Causal softmax attention, one score matrix per (sequence, head), scale 1 (the dh^-1/2 factor
// is already folded into q and k by the caller).
#pragma once
#include <cstdint>

namespace moeut {

// q, k, v, out: [B, T, H, dh]; probs [B, H, T, T] (upper triangle zero) saved for backward.
template <typename T>
void attention_forward(T* out, T* probs, const T* q, const T* k, const T* v, int64_t B,
                       int64_t T_len, int64_t H, int64_t dh);

// Overwrites dq, dk, dv [B, T, H, dh].
template <typename T>
void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* probs, const T* q,
                        const T* k, const T* v, int64_t B, int64_t T_len, int64_t H, int64_t dh);

}  // namespace moeut
