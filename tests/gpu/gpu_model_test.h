// Shared by the GPU model tests: a small configuration, and two GPU models that should compute
// the same thing (the same parameters, run two ways) run through the same training steps.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "core/gpu_model.h"
#include "core/model.h"
#include "gpu_test.h"

namespace moeut::gpu_test {

// The spec's initial parameters of `layout` (every expert's, or a shard's), as set_parameters
// and the optimizer take them.
inline std::vector<float> initial_parameters(const ModelConfig& cfg, const ParamLayout& layout, uint64_t seed) {
  std::vector<float> params(size_t(layout.total()));
  init_parameters(cfg, layout, seed, params.data());
  return params;
}

// all_experts: top-k over every expert, so that no routing choice can flip between the bf16
// GPU and the fp32 CPU (a flip changes which experts a token uses, and their gradients
// entirely; the choice itself is tested exactly at kernel level). Router widths (13 and 6, or 7
// and 6) are not multiples of 8, so the padded router products run too.
inline ModelConfig small_config(bool all_experts = false) {
  ModelConfig m;
  m.n_tokens = 500;
  m.d_model = 64;
  m.n_layers = 4;
  m.group_size = 2;
  m.n_heads = 2;
  m.d_head = 32;
  m.att_n_experts = 4;
  m.att_k = 2;
  m.ff_n_experts = 13;
  m.ff_k = 4;
  m.ff_expert_size = 32;
  m.context = 64;
  if (all_experts) {
    m.ff_n_experts = m.ff_k = 7;
    m.att_n_experts = m.att_k = 3;
  }
  return m;
}

// Each step zeroes the gradients and runs two micro-batches of new tokens (the first writes the
// FFN experts' gradients, the second adds to them; see GpuModel::zero_gradients), a loss pass
// and an evaluation of B - 1 sequences. Bounds: losses within loss_bound (relative; 1e-4 unless
// a model rounds more, as bf16 exchanges do), gradients within 1e-2. The
// sums' fp32 atomics run in no fixed order, so two runs of one model differ in the last bits
// too; with every expert selected no routing choice flips. A wrong row, a lost or doubled sum, or
// a gradient written where it should be added to would be off by order one.
inline void expect_same_steps(GpuModel& a, const char* a_name, GpuModel& b, const char* b_name, int64_t B, int steps,
                              Rng& rng, double loss_bound = 1e-4) {
  const ModelConfig& cfg = a.config();
  std::vector<int32_t> tokens(size_t(B * (cfg.context + 1)));
  for (int step = 0; step < steps; ++step) {
    a.zero_gradients();
    b.zero_gradients();
    for (int micro = 0; micro < 2; ++micro) {
      for (auto& t : tokens) t = int32_t(rng.next() % uint64_t(cfg.n_tokens));
      const LossParts la = a.forward_backward(tokens.data(), 0.5);
      const LossParts lb = b.forward_backward(tokens.data(), 0.5);
      EXPECT_NEAR(lb.total(), la.total(), loss_bound * std::abs(la.total())) << "step " << step << ", micro-batch " << micro;
    }
    const LossParts la = a.forward(tokens.data()), lb = b.forward(tokens.data());
    EXPECT_NEAR(lb.total(), la.total(), loss_bound * std::abs(la.total())) << "step " << step << ", loss pass";
    const double err = rel_error(b.gradients(), a.gradients());
    std::printf("step %d: loss %.6f %s, %.6f %s; gradients' rel. error %.2e\n", step, la.total(), a_name, lb.total(),
                b_name, err);
    EXPECT_LE(err, 1e-2) << "step " << step;
    const double ce = a.forward_ce_sum(tokens.data(), B - 1);
    EXPECT_NEAR(b.forward_ce_sum(tokens.data(), B - 1), ce, loss_bound * ce) << "step " << step << ", evaluation";
  }
}

}  // namespace moeut::gpu_test
