// Global gradient-norm clipping.
#pragma once
#include <cstdint>

namespace moeut {

// Sum of squares of x[0..n) in double, summed in fixed-size chunks combined in a fixed order:
// the result does not depend on the thread count.
template <typename T>
double sum_of_squares(const T* x, int64_t n);

// The factor gradients are multiplied by so their global norm is at most max_norm
// (torch.nn.utils.clip_grad_norm_: max_norm / (norm + 1e-6), capped at 1). max_norm <= 0: 1.
double clip_coefficient(double norm, double max_norm);

}  // namespace moeut
