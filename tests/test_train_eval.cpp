// The training loop end to end on a small model: deterministic for a seed, independent of how the
// batch is split into micro-batches, learning, and its exported weights evaluate to the
// training's final validation loss.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <vector>

#include "checkpoints/weights_file.h"
#include "core/rng.h"
#include "parallel/run_errors.h"
#include "parallel/trainer.h"
#include "small_config.h"

namespace moeut {
namespace {

std::string temp(const std::string& name) {
  return (std::filesystem::path(testing::TempDir()) / ("moeut_" + name)).string();
}

Config small_run(const std::string& tag) {
  return test::small_run({.d_model = 24, .n_layers = 2, .group_size = 1, .ff_n_experts = 8, .ff_k = 2,
                          .ff_expert_size = 16},
                         {.steps = 30, .batch_size = 8, .micro_batch_size = 4, .warmup_steps = 3,
                          // Per tag: ctest runs tests as parallel processes, which must not share files.
                          .train_data = temp("train_" + tag + ".bin"), .val_data = temp("val_" + tag + ".bin"),
                          .metrics = temp("metrics_" + tag + ".jsonl")});
}

TEST(Training, IsDeterministicForASeedAndLearns) {
  Config c = small_run("a");
  const ProcessGroups g = ProcessGroups::single();
  Trainer first(c, g);
  const double loss_a = first.run();
  Trainer second(c, g);
  const double loss_b = second.run();
  EXPECT_EQ(first.full_parameters(), second.full_parameters());
  EXPECT_EQ(loss_a, loss_b);
  // Uniform guessing over 40 tokens costs log 40 = 3.69; the stream is 80% predictable.
  EXPECT_LT(loss_a, 0.8 * std::log(40.0)) << "validation loss " << loss_a;
}

TEST(Training, MicroBatchSplitDoesNotChangeTheResult) {
  Config whole = small_run("whole"), split = small_run("split");
  whole.train.steps = split.train.steps = 5;
  whole.train.micro_batch_size = 8;
  split.train.micro_batch_size = 2;
  const ProcessGroups g = ProcessGroups::single();
  Trainer a(whole, g), b(split, g);
  const double la = a.run(), lb = b.run();
  EXPECT_NEAR(la, lb, 1e-5 * std::abs(la));
  double max_rel = 0;
  const std::vector<float> pa = a.full_parameters(), pb = b.full_parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    const double x = pa[i], y = pb[i];
    max_rel = std::max(max_rel, std::abs(x - y) / std::max(1e-3, std::abs(x)));
  }
  EXPECT_LT(max_rel, 1e-3);
}

TEST(Training, ExportedWeightsEvaluateToTheFinalValidationLoss) {
  const Config c = small_run("export");
  const ProcessGroups g = ProcessGroups::single();
  Trainer trainer(c, g);
  const double final_loss = trainer.run();
  const std::string path = temp("export.h5");
  write_weights(path, c.model, trainer.full_parameters().data());
  Weights w = read_weights(path);
  w.config.context = c.model.context;
  Model<float> model(w.config);
  model.params = w.params;
  SelfCommunicator world("world");
  const double again = evaluate([&](const int32_t* t, int64_t B) { return model.forward_ce_sum(t, B); }, c.model.context,
                                TokenFiles(c.train.val_data), 3 /* another batching */, 0, world);
  EXPECT_NEAR(again, final_loss, 1e-12 * final_loss);
}

// Start-up errors end every rank together (AgreedError), reported once, with their exit status.
TEST(Training, RefusesDataOfAnotherVocabulary) {
  Config c = small_run("vocab");
  c.model.n_tokens = 50;
  try {
    const ProcessGroups g = ProcessGroups::single();
    Trainer t(c, g);
    ADD_FAILURE() << "accepted data of vocabulary 40 for n_tokens 50";
  } catch (const AgreedError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.status, kExitConfig);
    EXPECT_TRUE(e.report);
    EXPECT_NE(msg.find("n_tokens"), std::string::npos) << msg;
    EXPECT_NE(msg.find(c.train.train_data), std::string::npos) << msg;
  }
}

TEST(Training, RefusesMissingData) {
  Config c = small_run("missing");
  c.train.val_data = "/no/such/val.bin";
  const ProcessGroups g = ProcessGroups::single();
  try {
    Trainer t(c, g);
    ADD_FAILURE() << "accepted a missing validation file";
  } catch (const AgreedError& e) {
    EXPECT_EQ(e.status, kExitDataError);
    EXPECT_NE(std::string(e.what()).find("/no/such/val.bin: cannot open"), std::string::npos) << e.what();
  }
}

// Runs c, which must stop with kExitNonFinite before its first after_step hook (saves), with a
// message holding each of `words`.
void expect_non_finite_stop(const Config& c, const std::vector<std::string>& words) {
  const ProcessGroups g = ProcessGroups::single();
  Trainer t(c, g);
  int64_t hooks = 0;
  t.after_step([&](int64_t) { ++hooks; });
  try {
    t.run();
    ADD_FAILURE() << "trained through a value that is not finite";
  } catch (const AgreedError& e) {
    EXPECT_EQ(e.status, kExitNonFinite);
    for (const std::string& w : words) EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what();
  }
  EXPECT_EQ(hooks, 0);
}

// A gradient that is not finite names the step and the tensors whose gradient is not finite.
TEST(Training, StopsAtANonFiniteGradientNamingTheTensors) {
  Config c = small_run("nonfinite");
  c.model.entropy_reg = 1e300;  // the regulariser's gradient overflows float
  expect_non_finite_stop(c, {"step 1: the gradient is not finite", "gradient not finite in embedding.weight",
                             " of 18 tensors)"});
}

// An update that leaves parameters non-finite (float overflow of a huge step) names the tensors.
TEST(Training, StopsAtAnUpdateThatLeavesParametersNonFinite) {
  Config c = small_run("nonfinite_update");
  c.train.lr = 1e39;
  c.train.warmup_steps = 0;
  expect_non_finite_stop(c, {"step 1: the update left parameters that are not finite", "embedding.weight"});
}

TEST(Training, WarnsWhenTheResidualGrowsPastTheBoundOrOverflows) {
  const double first = 0.037;
  EXPECT_EQ(residual_growth_warning(40, 2e4, 1, first), "");  // a recovering run's peak
  EXPECT_EQ(residual_growth_warning(40, first * kResidualGrowthWarning, 1, first), "");
  const std::string grown = residual_growth_warning(60, first * kResidualGrowthWarning * 2, 1, first);
  EXPECT_NE(grown.find("step 60: residual_std 7.4e+04, 2e+06 times its value at step 1 (0.037)"), std::string::npos)
      << grown;
  const std::string overflow = residual_growth_warning(61, std::numeric_limits<double>::infinity(), 1, first);
  EXPECT_NE(overflow.find("residual_std not finite (0.037 at step 1)"), std::string::npos) << overflow;
  EXPECT_NE(residual_growth_warning(62, std::nan(""), 1, first), "");
}

}  // namespace
}  // namespace moeut
