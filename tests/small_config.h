// Small models and CPU training runs for tests: each test names the sizes it uses; 2 heads of
// 8 with 3 attention experts choosing 2 are common to all.
#pragma once
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "checkpoints/checkpoint.h"
#include "core/config.h"
#include "parallel/trainer.h"
#include "token_stream.h"

namespace moeut::test {

struct SmallModel {
  int64_t d_model, n_layers, group_size, ff_n_experts, ff_k, ff_expert_size;
  int64_t n_tokens = 40;
};

inline ModelConfig small_model(const SmallModel& s) {
  ModelConfig m;
  m.n_tokens = s.n_tokens;
  m.d_model = s.d_model;
  m.n_layers = s.n_layers;
  m.group_size = s.group_size;
  m.n_heads = 2;
  m.d_head = 8;
  m.att_n_experts = 3;
  m.att_k = 2;
  m.ff_n_experts = s.ff_n_experts;
  m.ff_k = s.ff_k;
  m.ff_expert_size = s.ff_expert_size;
  return m;
}

// The schedule, and files of the test's own: ctest runs tests in parallel processes.
struct SmallRun {
  int64_t steps, batch_size, micro_batch_size, warmup_steps;
  std::string train_data, val_data, metrics;
};

// Context 16, lr 1e-2, no periodic evaluation, on token streams written afresh.
inline Config small_run(const SmallModel& model, const SmallRun& run) {
  Config c;
  c.model = small_model(model);
  c.model.context = 16;
  TrainConfig& t = c.train;
  t.train_data = run.train_data;
  t.val_data = run.val_data;
  write_token_stream(t.train_data, uint32_t(model.n_tokens), 20000, 1);
  write_token_stream(t.val_data, uint32_t(model.n_tokens), 2000, 2);
  t.metrics = run.metrics;
  t.steps = run.steps;
  t.batch_size = run.batch_size;
  t.micro_batch_size = run.micro_batch_size;
  t.lr = 1e-2;
  t.warmup_steps = run.warmup_steps;
  t.eval_every = 0;
  t.device = "cpu";  // exact CPU results, also on machines with a GPU
  return c;
}

// The model the checkpoint tests save, resume and damage.
inline constexpr SmallModel kCheckpointModel{.d_model = 16, .n_layers = 2, .group_size = 1, .ff_n_experts = 6,
                                             .ff_k = 2, .ff_expert_size = 8};

// small_run of kCheckpointModel: `steps` steps of 4 sequences in micro-batches of 2, warm-up 3,
// its token files and metrics in `work`.
inline Config checkpoint_run(const std::filesystem::path& work, int64_t steps) {
  return small_run(kCheckpointModel, {.steps = steps, .batch_size = 4, .micro_batch_size = 2, .warmup_steps = 3,
                                      .train_data = (work / "train.bin").string(),
                                      .val_data = (work / "val.bin").string(),
                                      .metrics = (work / "metrics.jsonl").string()});
}

// A run of c in this process with its checkpoints (setup_checkpoints: resume, saves): the total
// loss of every step it trained, and its parameters at the end.
struct TrainedRun {
  std::vector<double> losses;
  std::vector<float> params;
};
inline TrainedRun train_with_checkpoints(const Config& c) {
  const ProcessGroups g = ProcessGroups::single();
  Trainer trainer(c, g);
  setup_checkpoints(trainer);
  trainer.run();
  return {trainer.losses(), trainer.full_parameters()};
}

// An empty directory under the tests' temporary directory; `name` its own to the test (ctest
// runs tests in parallel processes).
inline std::filesystem::path fresh_test_dir(const std::string& name) {
  const std::filesystem::path d = std::filesystem::path(testing::TempDir()) / name;
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

}  // namespace moeut::test
