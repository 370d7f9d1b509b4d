#include "core/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace moeut {

double learning_rate(int64_t step, const TrainConfig& t) {
  if (step < t.warmup_steps) return t.lr * double(step + 1) / double(t.warmup_steps);
  const int64_t decay_steps = std::max<int64_t>(1, t.steps - t.warmup_steps - 1);
  const double progress = std::min(1.0, double(step - t.warmup_steps) / double(decay_steps));
  const double cosine = 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  return t.lr * (t.min_lr_ratio + (1.0 - t.min_lr_ratio) * cosine);
}

}  // namespace moeut
