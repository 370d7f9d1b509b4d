// AdamW as torch.optim.AdamW: decoupled weight decay, bias-corrected moments.
#pragma once
#include <cstdint>

namespace moeut {

struct AdamWHyper {
  double lr, beta1, beta2, eps, weight_decay;
};

// One update of n parameters at step t (1-based). grad_scale multiplies every gradient first
// (the clipping coefficient). Returns whether every updated parameter is finite.
template <typename T>
bool adamw_update(T* param, const T* grad, T* m, T* v, int64_t n, const AdamWHyper& h, int64_t t,
                  double grad_scale);

}  // namespace moeut
