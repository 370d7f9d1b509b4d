// The GPU model against the CPU model on the same parameters and tokens: losses (and, with the
// backward pass, gradients) agree to bf16 precision.
#include <gtest/gtest.h>

#include "core/gpu_model.h"
#include "core/model.h"
#include "gpu_test.h"

namespace moeut {
namespace {

ModelConfig small_config() {
  ModelConfig m;
  m.n_tokens = 500;
  m.d_model = 64;
  m.n_layers = 4;
  m.group_size = 2;
  m.n_heads = 2;
  m.d_head = 32;
  m.att_n_experts = 4;
  m.att_k = 2;
  m.ff_n_experts = 16;
  m.ff_k = 4;
  m.ff_expert_size = 32;
  m.context = 64;
  return m;
}

TEST_F(GpuTest, ModelForwardLossMatchesTheCpuModel) {
  const ModelConfig cfg = small_config();
  const int64_t B = 4;
  Model<float> cpu(cfg);
  cpu.init(5);
  // Parameters exactly representable in bf16, so both models compute with the same weights.
  for (auto& p : cpu.params) p = __bfloat162float(__float2bfloat16(p));
  std::vector<int32_t> tokens(size_t(B * (cfg.context + 1)));
  Rng rng{17};
  for (auto& t : tokens) t = int32_t(rng.next() % uint64_t(cfg.n_tokens));
  const LossParts ref = cpu.forward_backward(tokens.data(), B, 1.0);

  GpuModel gpu(cfg, B);
  gpu.set_parameters(cpu.params);
  const LossParts got = gpu.forward(tokens.data());
  std::printf("loss: CPU ce %.6f reg_ffn %.6f reg_att %.6f | GPU ce %.6f reg_ffn %.6f reg_att %.6f\n", ref.ce,
              ref.reg_ffn, ref.reg_att, got.ce, got.reg_ffn, got.reg_att);
  EXPECT_NEAR(got.ce, ref.ce, 1e-2 * std::abs(ref.ce));
  EXPECT_NEAR(got.reg_ffn, ref.reg_ffn, 1e-2 * std::abs(ref.reg_ffn));
  EXPECT_NEAR(got.reg_att, ref.reg_att, 1e-2 * std::abs(ref.reg_att));
}

}  // namespace
}  // namespace moeut
