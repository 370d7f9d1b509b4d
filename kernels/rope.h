// Rotary position encoding on the first n_rot dimensions of every head ("rotate half" style):
// r = u*cos + rot(u)*sin with rot(u) = concat(-u[n/2:], u[:n/2]), angle = pos * base^(-2i/n).
#pragma once
#include <cstdint>

namespace moeut {

// In place on x [B, T, H, dh]; position of token t is t. Dimensions n_rot.. pass unchanged.
template <typename T>
void rope_forward(T* x, int64_t B, int64_t T_len, int64_t H, int64_t dh, int64_t n_rot,
                  double base = 10000.0);

// In place on the gradient: the transpose of a rotation is the rotation by the opposite angle.
template <typename T>
void rope_backward(T* dx, int64_t B, int64_t T_len, int64_t H, int64_t dh, int64_t n_rot,
                   double base = 10000.0);

}  // namespace moeut
