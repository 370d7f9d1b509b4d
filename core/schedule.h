// The learning-rate schedule.
#pragma once
#include <cstdint>

#include "core/config.h"

namespace moeut {

// Linear warm-up from lr/warmup to lr over warmup_steps, then cosine decay to
// min_lr_ratio * lr at the last step. step is 0-based.
double learning_rate(int64_t step, const TrainConfig& t);

}  // namespace moeut
