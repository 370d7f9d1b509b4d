// ReLU, the activation between the FFN experts' two products.
#pragma once
#include <cstdint>

namespace moeut {

template <typename T>
void relu_forward(T* x, int64_t n);  // in place

// dx = dout where the forward output was positive, else 0 (in place on dout allowed).
template <typename T>
void relu_backward(T* dx, const T* dout, const T* out, int64_t n);

}  // namespace moeut
