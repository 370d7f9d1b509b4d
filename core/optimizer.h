// AdamW over the whole parameter buffer, the learning-rate schedule and global-norm clipping.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "core/config.h"

namespace moeut {

// Linear warm-up from lr/warmup to lr over warmup_steps, then cosine decay to
// min_lr_ratio * lr at the last step. step is 0-based.
double learning_rate(int64_t step, const TrainConfig& t);

class AdamW {
 public:
  explicit AdamW(int64_t n) : m_(size_t(n), 0.f), v_(size_t(n), 0.f) {}
  // Clips the gradients to t.grad_clip by global norm and applies one update at learning rate
  // lr. Returns the gradient norm before clipping.
  double step(std::span<float> params, std::span<const float> grads, double lr, const TrainConfig& t);
  int64_t steps_taken() const { return steps_; }
  int64_t state_bytes() const { return int64_t((m_.size() + v_.size()) * sizeof(float)); }

 private:
  std::vector<float> m_, v_;
  int64_t steps_ = 0;
};

}  // namespace moeut
