// LayerNorm over the last dimension with weight and bias, eps 1e-5 (as torch.nn.LayerNorm).
#pragma once
#include <cstdint>

namespace moeut {

inline constexpr double kLayerNormEps = 1e-5;

// x, out [n, d]; mean, rstd [n] are saved for the backward pass.
template <typename T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* x, const T* weight, const T* bias,
                       int64_t n, int64_t d);

// Accumulates into dx [n, d], dweight [d] and dbias [d].
template <typename T>
void layernorm_backward(T* dx, T* dweight, T* dbias, const T* dout, const T* x, const T* weight,
                        const T* mean, const T* rstd, int64_t n, int64_t d);

}  // namespace moeut
