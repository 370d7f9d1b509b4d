// Model and training configuration: read from a config file plus command-line overrides
// (Boost.Program_options), every value validated with an error naming the option and the rule.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace moeut {

// Names follow the official MoEUT constructor's arguments; they are also the attribute names of
// an exported weights file.
struct ModelConfig {
  int64_t n_tokens = 8000;       // vocabulary size V
  int64_t d_model = 128;         // d
  int64_t n_layers = 4;          // L, logical layers
  int64_t group_size = 2;        // G, physical layers shared across depth
  int64_t n_heads = 4;           // H
  int64_t d_head = 32;           // dh
  int64_t att_n_experts = 4;     // Ea, per head
  int64_t att_k = 2;             // ka
  int64_t ff_n_experts = 32;     // Ef
  int64_t ff_k = 4;              // kf
  int64_t ff_expert_size = 128;  // es
  double entropy_reg = 0.01;     // gamma, FFN selection entropy coefficient
  double att_entropy_reg = 0.001;  // delta, attention selection entropy coefficient
  int64_t context = 128;         // T, training sequence length

  int64_t repeats() const { return n_layers / group_size; }
  // Training FLOPs per token, the spec's formula (what benchmarks report MFU with):
  // 6·N_active + 12·L·H·dh·T with N_active = L·(2·d·H·dh + 2·H·ka·d·dh + 2·kf·d·es + Ef·d
  // + 2·H·Ea·d) + d·V.
  double training_flops_per_token() const {
    const double L = double(n_layers), d = double(d_model), H = double(n_heads), dh = double(d_head);
    const double active = L * (2 * d * H * dh + 2 * H * att_k * d * dh + 2.0 * ff_k * d * ff_expert_size +
                               double(ff_n_experts) * d + 2 * H * att_n_experts * d) + d * double(n_tokens);
    return 6 * active + 12 * L * H * dh * double(context);
  }
  // Dimensions of each head that get RoPE: half of dh, rounded down to even.
  int64_t rope_dims() const { return (d_head / 2) - (d_head / 2) % 2; }
};

struct TrainConfig {
  bool writes_weights() const { return out_weights != "none"; }
  std::string train_data;        // token file (docs/DATA.md)
  std::string val_data;
  std::string out_weights = "runs/weights.h5";  // none: no weights file (writes_weights())
  std::string metrics = "runs/metrics.jsonl";
  int64_t steps = 100;
  int64_t batch_size = 16;       // global batch, sequences of `context` tokens
  int64_t micro_batch_size = 8;  // sequences per forward/backward (gradient accumulation)
  double lr = 2.5e-4;
  double min_lr_ratio = 0.1;     // cosine decays to this multiple of lr
  int64_t warmup_steps = 10;
  double weight_decay = 0.01;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.999;
  double adam_eps = 1e-8;
  double grad_clip = 0.25;       // global L2 norm; 0 disables
  // A step whose gradient norm exceeds this multiple of the median of the previous steps' is
  // reported with each tensor's gradient norm; 0 disables.
  double grad_jump_factor = 0;
  uint64_t seed = 1;
  int64_t eval_every = 50;       // steps between validation reports; 0 disables
  int64_t eval_batches = 8;      // micro-batches of the validation file per periodic report
  int64_t log_experts_every = 0; // steps between expert-load reports (docs/METRICS.md); 0 disables
  int64_t threads = 0;           // CPU threads; 0 keeps OpenMP's default
  int64_t ep = 1;                // expert-parallel group size (ranks sharing one set of experts)
  std::string device = "auto";   // cpu, cuda, or auto (cuda when built with it and a GPU is there)
  // Expert-parallel token dispatch: all_to_all, all_gather, or auto (all_gather on GPU ranks whose
  // expert-parallel groups each lie on one machine, all_to_all otherwise; docs/DESIGN.md says why).
  std::string dispatcher = "auto";
  // Sharded checkpoints (docs/CHECKPOINTS.md).
  std::string checkpoint_dir;    // where step_<N>/ directories go; empty: no checkpoints
  int64_t checkpoint_every = 0;  // steps between checkpoints; 0: only at the end
  int64_t keep_checkpoints = 0;  // the newest checkpoints kept; 0: all
  // A step_<N> directory; "latest", the newest in checkpoint_dir; or "auto", the newest there
  // or a fresh start when there is none (what a requeued job passes every time).
  std::string resume;
  // An interchange weights file (checkpoints/weights_file.h) the run starts from instead of a
  // fresh initialisation, with fresh optimizer state. A checkpoint that --resume auto finds wins.
  std::string init_weights;
  // Resuming a step_<N> older than the newest in checkpoint_dir deletes the newer ones (a corrupt
  // newest checkpoint otherwise blocks continuing from the one before it); false: refused.
  bool discard_newer_checkpoints = false;
  // Seconds of wall clock the training steps may take, counted from the first step this process
  // runs (start-up and loading not included): the run saves and stops (kExitStopped) while twice
  // its longest step (validation and saves included) still fits; 0: no limit.
  double time_limit = 0;
  // Seconds a rank may wait in one collective, or for its device's work with the collectives in
  // it, before the run ends naming the rank, group and operation (core/hang_watchdog.h); 0: off.
  double hang_timeout = 600;
};

struct Config {
  ModelConfig model;
  TrainConfig train;
};

// Thrown for any invalid configuration; what() names the option and the rule it breaks.
struct ConfigError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The longest value an option may have (a path's PATH_MAX): a longer one is refused.
inline constexpr size_t kLongestOptionValue = 4096;
// A value as error messages show it: up to 200 characters, then a note of its full length.
std::string shown(const std::string& value);

void validate(const ModelConfig& m);
void validate(const Config& c);

// Parses `--config FILE` (optional: a readable regular text file) and the command line;
// command-line values override the file. No argument or line of the file may be longer than
// kLongestOptionValue.
// Returns false when --help was asked (help text already printed).
bool parse_train_args(int argc, const char* const* argv, Config& out);

// The configuration of a profile file, e.g. configs/tiny.cfg, with no command-line overrides.
Config load_config_file(const std::string& path);

}  // namespace moeut
