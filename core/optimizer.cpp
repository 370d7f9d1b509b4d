#include "core/optimizer.h"

#include <cmath>
#include <numbers>

#include "kernels/adamw.h"
#include "kernels/grad_norm.h"

namespace moeut {

double learning_rate(int64_t step, const TrainConfig& t) {
  if (step < t.warmup_steps) return t.lr * double(step + 1) / double(t.warmup_steps);
  const int64_t decay_steps = std::max<int64_t>(1, t.steps - t.warmup_steps - 1);
  const double progress = std::min(1.0, double(step - t.warmup_steps) / double(decay_steps));
  const double cosine = 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  return t.lr * (t.min_lr_ratio + (1.0 - t.min_lr_ratio) * cosine);
}

double AdamW::step(std::span<float> params, std::span<const float> grads, double lr, const TrainConfig& t) {
  const double norm = std::sqrt(sum_of_squares(grads.data(), int64_t(grads.size())));
  const AdamWHyper h{lr, t.adam_beta1, t.adam_beta2, t.adam_eps, t.weight_decay};
  adamw_update(params.data(), grads.data(), m_.data(), v_.data(), int64_t(params.size()), h, ++steps_,
               clip_coefficient(norm, t.grad_clip));
  return norm;
}

}  // namespace moeut
