// The whole model's total loss (cross-entropy plus both entropy terms) against central finite
// differences, for every parameter of a tiny configuration, in double precision.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdio>

#include "core/model.h"
#include "core/rng.h"
#include "gradcheck.h"

namespace moeut {
namespace {

ModelConfig tiny_grad_config() {
  ModelConfig m;
  m.n_tokens = 11;
  m.d_model = 8;
  m.n_layers = 4;
  m.group_size = 2;  // two physical layers, each used twice
  m.n_heads = 2;
  m.d_head = 6;      // RoPE on 2 of 6 dims: rounding of dh/2 = 3 down to even
  m.att_n_experts = 3;
  m.att_k = 2;
  m.ff_n_experts = 5;
  m.ff_k = 2;
  m.ff_expert_size = 4;
  m.entropy_reg = 0.3;  // large, so the regularisers' gradients are visible in the check
  m.att_entropy_reg = 0.2;
  m.context = 5;
  return m;
}

// The tiny model in double precision, initialised, with a batch of B uniformly drawn sequences.
struct TinyModelAndBatch {
  TinyModelAndBatch() : cfg(tiny_grad_config()), model(cfg), tokens(size_t(B * (cfg.context + 1))) {
    model.init(7);
    Rng rng(3);
    for (auto& t : tokens) t = int32_t(rng.next() % uint64_t(cfg.n_tokens));
  }
  const int64_t B = 2;
  ModelConfig cfg;
  Model<double> model;
  std::vector<int32_t> tokens;
};

TEST(ModelGradient, TotalLossMatchesFiniteDifferencesForEveryParameter) {
  TinyModelAndBatch tiny;
  const int64_t B = tiny.B;
  Model<double>& model = tiny.model;
  const std::vector<int32_t>& tokens = tiny.tokens;

  const double weight = 0.5;  // a micro-batch's share of the global batch
  std::fill(model.grads.begin(), model.grads.end(), 0.0);
  const LossParts parts = model.forward_backward(tokens.data(), B, weight);
  EXPECT_LT(parts.reg_ffn, 0.0);  // negative entropies, positive coefficients
  EXPECT_LT(parts.reg_att, 0.0);
  const std::vector<double> analytic = model.grads;
  auto loss = [&] {
    std::fill(model.grads.begin(), model.grads.end(), 0.0);
    return weight * model.forward_backward(tokens.data(), B, weight).total();
  };
  for (const TensorSpec& t : model.layout().tensors()) {
    const double err = test::gradient_error(loss, model.params.data() + t.offset,
                                            analytic.data() + t.offset, t.numel);
    EXPECT_LE(err, test::kGradTolerance) << t.name;
    std::printf("%-40s %.3e\n", t.name.c_str(), err);
  }
}

// The value and FFN expert paths read the raw residual and the routers its LayerNorm, so the
// model is homogeneous in the embedding's scale: scaled, the last residual's spread (residual_std)
// scales alike while the output LayerNorm leaves the loss as it was (up to the LayerNorms' eps).
// This is why a growing residual shows in residual_std and not in the loss.
TEST(Model, ResidualStdFollowsTheEmbeddingScaleWhileTheLossDoesNot) {
  TinyModelAndBatch tiny;
  const int64_t B = tiny.B;
  Model<double>& model = tiny.model;
  const std::vector<int32_t>& tokens = tiny.tokens;
  const LossParts before = model.forward_backward(tokens.data(), B, 1.0);
  const TensorSpec& embedding = model.layout().at("embedding.weight");
  for (int64_t i = 0; i < embedding.numel; ++i) model.params[size_t(embedding.offset + i)] *= 1000.0;
  const LossParts after = model.forward_backward(tokens.data(), B, 1.0);
  EXPECT_GT(before.residual_std, 0.0);
  EXPECT_NEAR(after.residual_std, 1000.0 * before.residual_std, 1e-3 * 1000.0 * before.residual_std);
  EXPECT_NEAR(after.ce, before.ce, 1e-3 * before.ce);
}

TEST(Model, AShardWithoutADispatcherIsRefusedClearly) {
  ModelConfig cfg = tiny_grad_config();
  Model<float> shard(cfg, expert_shard(cfg.ff_n_experts, 2, 1));
  shard.init(1);
  std::vector<int32_t> tokens(size_t(cfg.context + 1), 1);
  try {
    shard.forward_ce_sum(tokens.data(), 1);
    ADD_FAILURE() << "a shard without a dispatcher ran";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("no token dispatcher"), std::string::npos) << e.what();
  }
}

// The GPU backend initialises each rank's shard on its own and relies on this: a shard's
// initial values are exactly its slice of a one-process model (each expert has its own stream).
TEST(Model, AShardIsInitialisedAsItsSliceOfTheWholeModel) {
  const ModelConfig cfg = tiny_grad_config();
  Model<float> whole(cfg);
  whole.init(7);
  const ParamLayout full(cfg);
  for (int64_t r = 0; r < 3; ++r) {  // 5 experts over 3 ranks: 2, 2, 1
    const ExpertShard shard = expert_shard(cfg.ff_n_experts, 3, r);
    Model<float> part(cfg, shard);
    part.init(7);
    for (const TensorSpec& t : part.layout().tensors()) {
      const TensorSpec& g = full.at(t.name);
      const int64_t skip = t.expert ? shard.begin * (g.numel / cfg.ff_n_experts) : 0;
      const std::vector<float> want(whole.params.begin() + g.offset + skip,
                                    whole.params.begin() + g.offset + skip + t.numel);
      const std::vector<float> got(part.params.begin() + t.offset, part.params.begin() + t.offset + t.numel);
      EXPECT_EQ(got, want) << t.name << " on rank " << r;
    }
  }
}

// The initialisation draws in parallel and must not depend on how: with one thread or several,
// the same bits, and a long tensor's values those of drawing its stream in turn (the embedding,
// longer than one chunk of the parallel draw, against the spec's std / sqrt(d) normals).
TEST(Model, InitialisationIsTheSameWhateverTheThreads) {
  ModelConfig cfg = tiny_grad_config();
  cfg.n_tokens = 40000;  // an embedding of 320,000 values: five chunks of the parallel draw
  const ParamLayout layout(cfg);
  const int threads = omp_get_max_threads();
  std::vector<float> one(size_t(layout.total())), several(size_t(layout.total()));
  omp_set_num_threads(1);
  init_parameters(cfg, layout, 11, one.data());
  omp_set_num_threads(4);
  init_parameters(cfg, layout, 11, several.data());
  omp_set_num_threads(threads);
  EXPECT_EQ(one, several);
  const TensorSpec& e = layout.at("embedding.weight");
  Rng rng(hash_mix(11, hash_string(e.name)));
  std::vector<float> in_turn(size_t(e.numel));
  for (float& x : in_turn) x = float(rng.normal() / std::sqrt(double(cfg.d_model)));
  EXPECT_EQ(std::vector<float>(several.begin() + e.offset, several.begin() + e.offset + e.numel), in_turn);
}

}  // namespace
}  // namespace moeut
