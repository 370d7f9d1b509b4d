// Configuration: every profile file loads, the layouts have the spec's parameter counts, and
// every invalid value is refused with a message naming the option and the rule.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/config.h"
#include "core/params.h"

namespace moeut {
namespace {

const std::string kConfigs = MOEUT_SOURCE_DIR "/configs/";

TEST(Profiles, EveryProfileLoadsAndValidates) {
  for (const char* name : {"tiny", "44M", "126M", "244M", "318M", "727M", "1B"})
    EXPECT_NO_THROW(load_config_file(kConfigs + name + ".cfg")) << name;
}

TEST(Profiles, ParameterCountsMatchTheSpec) {
  EXPECT_EQ(ParamLayout(load_config_file(kConfigs + "244M.cfg").model).total(), 243326784);
  EXPECT_EQ(ParamLayout(load_config_file(kConfigs + "1B.cfg").model).total(), 1040319296);
}

// Each physical layer's expert tensors (keys, then values) follow the replicated ones in layer
// order, with or without a shard of the experts: the ZeRO buckets' per-layer reductions rely on it.
TEST(Profiles, ExpertRangesFollowTheReplicatedParametersLayerByLayer) {
  const ModelConfig m = load_config_file(kConfigs + "1B.cfg").model;
  for (const ExpertShard shard : {expert_shard(m.ff_n_experts, 1, 0), expert_shard(m.ff_n_experts, 4, 3)}) {
    const ParamLayout layout(m, shard);
    ASSERT_EQ(layout.physical_layers(), m.group_size);
    int64_t at = layout.replicated();
    for (int64_t g = 0; g < layout.physical_layers(); ++g) {
      const auto [begin, end] = layout.expert_range(g);
      EXPECT_EQ(begin, at) << "layer " << g << ", " << shard.count << " experts";
      EXPECT_EQ(end - begin, 2 * shard.count * m.d_model * m.ff_expert_size) << "layer " << g;
      at = end;
    }
    EXPECT_EQ(at, layout.total()) << shard.count << " experts";
  }
}

TEST(Profiles, TrainingFlopsPerTokenMatchTheSpec) {
  EXPECT_NEAR(load_config_file(kConfigs + "244M.cfg").model.training_flops_per_token(), 1.007e9, 0.0005e9);
  EXPECT_NEAR(load_config_file(kConfigs + "1B.cfg").model.training_flops_per_token(), 4.216e9, 0.0005e9);
}

TEST(Profiles, RopeWidthOf44MIsRoundedDownToEven) {
  EXPECT_EQ(load_config_file(kConfigs + "44M.cfg").model.rope_dims(), 40);
}

// Runs the command-line parser on tiny.cfg plus the given overrides; returns the error text
// ("" when accepted).
std::string parse_error(std::vector<std::string> overrides) {
  std::vector<std::string> args = {"moeut-train", "--config", kConfigs + "tiny.cfg", "--train_data", "t.bin",
                                   "--val_data", "v.bin"};
  args.insert(args.end(), overrides.begin(), overrides.end());
  std::vector<const char*> argv;
  for (auto& a : args) argv.push_back(a.c_str());
  Config c;
  try {
    parse_train_args(int(argv.size()), argv.data(), c);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(ConfigValidation, AcceptsTinyWithOverrides) {
  EXPECT_EQ(parse_error({"--d_model", "64"}), "");
}

TEST(ConfigValidation, CommandLineOverridesTheFile) {
  std::vector<const char*> argv = {"moeut-train", "--config", nullptr, "--steps", "7", "--train_data", "a",
                                   "--val_data", "b"};
  const std::string path = kConfigs + "tiny.cfg";
  argv[2] = path.c_str();
  Config c;
  ASSERT_TRUE(parse_train_args(int(argv.size()), argv.data(), c));
  EXPECT_EQ(c.train.steps, 7);
  EXPECT_EQ(c.model.d_model, 128);  // from the file
}

struct Case {
  std::vector<std::string> args;
  std::string option, rule;
};

TEST(ConfigValidation, RefusesEachBrokenRuleNamingOptionAndRule) {
  const std::vector<Case> cases = {
      {{"--n_layers", "5"}, "n_layers", "divisible by group_size"},
      {{"--group_size", "0"}, "group_size", "positive"},
      {{"--ff_k", "33"}, "ff_k", "must not exceed ff_n_experts"},
      {{"--att_k", "5"}, "att_k", "must not exceed att_n_experts"},
      {{"--d_head", "3"}, "d_head", "RoPE"},
      {{"--att_n_experts", "1", "--att_k", "1"}, "att_n_experts", "official MoEUTLM builds a dense attention"},
      {{"--d_model", "-1"}, "d_model", "positive"},
      {{"--n_tokens", "0"}, "n_tokens", "positive"},
      {{"--ff_expert_size", "0"}, "ff_expert_size", "positive"},
      {{"--context", "0"}, "context", "positive"},
      {{"--entropy_reg", "-0.1"}, "entropy_reg", ">= 0"},
      {{"--att_entropy_reg", "nan"}, "att_entropy_reg", "finite"},
      {{"--batch_size", "12"}, "batch_size", "multiple of micro_batch_size"},
      {{"--micro_batch_size", "0"}, "micro_batch_size", "positive"},
      {{"--steps", "0"}, "steps", "positive"},
      {{"--lr", "0"}, "lr", "> 0"},
      {{"--min_lr_ratio", "1.5"}, "min_lr_ratio", "[0, 1]"},
      {{"--warmup_steps", "-3"}, "warmup_steps", ">= 0"},
      {{"--adam_beta2", "1"}, "adam_beta2", "[0, 1)"},
      {{"--grad_clip", "-1"}, "grad_clip", ">= 0"},
      {{"--weight_decay", "-1"}, "weight_decay", ">= 0"},
      {{"--eval_batches", "0"}, "eval_batches", "positive"},
      {{"--device", "tpu"}, "device", "must be cpu, cuda or auto"},
      {{"--dispatcher", "broadcast"}, "dispatcher", "must be all_to_all, all_gather or auto"},
      {{"--checkpoint_dir", "c", "--checkpoint_every", "-1"}, "checkpoint_every", ">= 0"},
      {{"--checkpoint_dir", "c", "--keep_checkpoints", "-2"}, "keep_checkpoints", ">= 0"},
      {{"--checkpoint_every", "10"}, "checkpoint_every", "needs checkpoint_dir"},
      {{"--keep_checkpoints", "3"}, "keep_checkpoints", "needs checkpoint_dir"},
      {{"--resume", "latest"}, "resume", "latest needs checkpoint_dir"},
      {{"--init_weights", "w.h5", "--resume", "runs/c/step_00000010"}, "init_weights", "the checkpoint holds the weights"},
  };
  for (const Case& c : cases) {
    const std::string err = parse_error(c.args);
    EXPECT_NE(err.find(c.option + ":"), std::string::npos) << c.args[0] << " gave: " << err;
    EXPECT_NE(err.find(c.rule), std::string::npos) << c.args[0] << " gave: " << err;
  }
}

TEST(ConfigValidation, AcceptsCheckpointOptions) {
  EXPECT_EQ(parse_error({"--checkpoint_dir", "c", "--checkpoint_every", "10", "--keep_checkpoints", "2", "--resume",
                         "latest"}),
            "");
  EXPECT_EQ(parse_error({"--resume", "runs/c/step_00000010"}), "");  // a directory needs no checkpoint_dir
  // A requeued job passes both every time: the weights file until a checkpoint exists.
  EXPECT_EQ(parse_error({"--checkpoint_dir", "c", "--resume", "auto", "--init_weights", "w.h5"}), "");
}

TEST(ConfigValidation, RequiresTheDataFiles) {
  Config c = load_config_file(kConfigs + "tiny.cfg");
  c.train.val_data = "v.bin";
  EXPECT_THROW(
      try { validate(c); } catch (const ConfigError& e) {
        EXPECT_NE(std::string(e.what()).find("train_data: is required"), std::string::npos) << e.what();
        throw;
      },
      ConfigError);
}

TEST(ConfigValidation, RefusesUnknownOptionsAndBadValuesAndMissingFiles) {
  EXPECT_NE(parse_error({"--d_modle", "64"}).find("d_modle"), std::string::npos);
  EXPECT_NE(parse_error({"--d_model", "wide"}).find("d_model"), std::string::npos);
  try {
    load_config_file("/no/such.cfg");
    ADD_FAILURE() << "accepted a missing file";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("/no/such.cfg"), std::string::npos) << e.what();
  }
  const auto dir = std::filesystem::path(testing::TempDir());
  const std::string bad = (dir / "moeut_bad.cfg").string();
  std::ofstream(bad) << "d_model = 64\nexperts = 3\n";
  try {
    load_config_file(bad);
    ADD_FAILURE() << "accepted an unknown key";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("experts"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace moeut
