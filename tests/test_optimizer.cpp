// AdamW, clipping and the learning-rate schedule against values worked out by hand from
// torch.optim.AdamW's and clip_grad_norm_'s definitions.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/schedule.h"
#include "parallel/sharded_optimizer.h"
#include "kernels/adamw.h"
#include "kernels/grad_norm.h"

namespace moeut {
namespace {

TEST(AdamW, TwoStepsMatchTheDefinition) {
  const AdamWHyper h{.lr = 0.1, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01};
  double p = 1.0, m = 0, v = 0;
  const double g1 = 0.5, g2 = -0.2;
  EXPECT_TRUE(adamw_update(&p, &g1, &m, &v, 1, h, 1, 1.0));
  // step 1: p *= 1 - lr*wd; m = 0.1 g; v = 0.001 g^2; mhat = g, vhat = g^2 -> p -= lr * g/(|g| + eps)
  double expect = 1.0 * (1 - 0.1 * 0.01) - 0.1 * 0.5 / (0.5 + 1e-8);
  EXPECT_NEAR(p, expect, 1e-12);
  EXPECT_TRUE(adamw_update(&p, &g2, &m, &v, 1, h, 2, 1.0));
  const double m2 = 0.9 * 0.05 + 0.1 * g2, v2 = 0.999 * 0.00025 + 0.001 * g2 * g2;
  expect = expect * (1 - 0.001) - 0.1 * (m2 / (1 - 0.81)) / (std::sqrt(v2 / (1 - 0.999 * 0.999)) + 1e-8);
  EXPECT_NEAR(p, expect, 1e-12);
}

TEST(AdamW, GradScaleIsAppliedBeforeTheMoments) {
  const AdamWHyper h{.lr = 0.1, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.0};
  double p1 = 0, m1 = 0, v1 = 0, p2 = 0, m2 = 0, v2 = 0;
  const double g = 4.0, half = 2.0;
  EXPECT_TRUE(adamw_update(&p1, &g, &m1, &v1, 1, h, 1, 0.5));
  EXPECT_TRUE(adamw_update(&p2, &half, &m2, &v2, 1, h, 1, 1.0));
  EXPECT_DOUBLE_EQ(m1, m2);
  EXPECT_DOUBLE_EQ(v1, v2);
  EXPECT_DOUBLE_EQ(p1, p2);
}

// The update reports, from its own pass, a parameter it left non-finite: here a float overflowed
// by a step larger than float can hold.
TEST(AdamW, ReportsAParameterItLeftNonFinite) {
  const AdamWHyper h{.lr = 1e39, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.0};
  std::vector<float> p = {1, 2, 3}, m(3, 0.f), v(3, 0.f);
  const std::vector<float> g = {0.f, 1.f, 0.f};
  EXPECT_FALSE(adamw_update(p.data(), g.data(), m.data(), v.data(), 3, h, 1, 1.0));
  EXPECT_FALSE(std::isfinite(p[1]));
  const AdamWHyper small{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.0};
  std::vector<float> q = {1, 2, 3};
  EXPECT_TRUE(adamw_update(q.data(), g.data(), m.data(), v.data(), 3, small, 1, 1.0));
}

TEST(GradNorm, SumOfSquaresAndClipCoefficient) {
  std::vector<float> g(200000, 0.5f);
  EXPECT_DOUBLE_EQ(sum_of_squares(g.data(), int64_t(g.size())), 50000.0);
  EXPECT_NEAR(clip_coefficient(1.0, 0.25), 0.25 / (1.0 + 1e-6), 1e-15);
  EXPECT_EQ(clip_coefficient(0.1, 0.25), 1.0);
  EXPECT_EQ(clip_coefficient(10.0, 0.0), 1.0);  // clipping off
}

TEST(LearningRate, WarmupThenCosineToTheMinimum) {
  TrainConfig t;
  t.lr = 1e-3;
  t.warmup_steps = 10;
  t.steps = 111;  // decay over steps 10..110: step 60 is half way
  t.min_lr_ratio = 0.1;
  EXPECT_DOUBLE_EQ(learning_rate(0, t), 1e-4);
  EXPECT_DOUBLE_EQ(learning_rate(9, t), 1e-3);
  EXPECT_DOUBLE_EQ(learning_rate(10, t), 1e-3);
  EXPECT_NEAR(learning_rate(60, t), 1e-3 * (0.1 + 0.9 * 0.5), 1e-15);
  EXPECT_NEAR(learning_rate(110, t), 1e-4, 1e-15);
  for (int64_t s = 11; s < 111; ++s) EXPECT_LT(learning_rate(s, t), learning_rate(s - 1, t));
}

TEST(ShardedAdamW, OneProcessClipsByGlobalNormAndReportsTheNormBeforeClipping) {
  TrainConfig t;
  t.grad_clip = 1.0;
  t.weight_decay = 0;
  ModelConfig m;
  m.n_tokens = 2; m.d_model = 1; m.n_layers = 1; m.group_size = 1; m.n_heads = 1; m.d_head = 4;
  m.att_n_experts = 1; m.att_k = 1; m.ff_n_experts = 1; m.ff_k = 1; m.ff_expert_size = 1;
  const ParamLayout layout(m);
  std::vector<float> p(size_t(layout.total()), 0.f), g(size_t(layout.total()), 0.f);
  g[0] = 3.f;
  g[1] = 4.f;
  const ProcessGroups groups = ProcessGroups::single();
  ShardedAdamW opt(layout, groups);
  EXPECT_DOUBLE_EQ(opt.step(p, g, 0.1, t), 5.0);
  EXPECT_EQ(opt.steps_taken(), 1);
  EXPECT_EQ(opt.state_bytes(), int64_t(2 * layout.total() * sizeof(float)));
  // First Adam step moves each parameter by lr * sign(g) whatever the scale.
  EXPECT_NEAR(p[0], -0.1f, 1e-6);
  EXPECT_NEAR(p[1], -0.1f, 1e-6);
}

}  // namespace
}  // namespace moeut
