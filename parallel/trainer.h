// The training loop: sampling, gradient accumulation, the optimizer step, logging, validation.
// One process or many: each rank trains on its own part of every global batch, through a
// TrainingBackend (CPU ranks with expert parallelism, or one GPU).
#pragma once
#include <chrono>
#include <cstdint>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/token_files.h"
#include "parallel/training_backend.h"
#include "parallel/communicator.h"

namespace moeut {

// Sequences first..first+count-1 of global batch `step`, each context + 1 tokens, into out.
// Sequence i starts at a position drawn from its own stream keyed by (seed, step, i), so any
// split of a batch across micro-batches or processes reads the same tokens.
void sample_batch(const TokenFiles& data, uint64_t seed, int64_t step, int64_t first, int64_t count,
                  int64_t context, int32_t* out);

// The residual stream's spread (LossParts::residual_std) grows without bound before a run
// collapses to unigram level (docs/DESIGN.md, "Training stability"): the warning for a step whose
// spread is not finite or has grown kResidualGrowthWarning times past `first` (the first step the
// run trained), or "" when it has not. Runs that recovered grew less than that.
inline constexpr double kResidualGrowthWarning = 1e6;
std::string residual_growth_warning(int64_t step, double residual_std, int64_t first_step, double first);

// Sum of the cross-entropy over the predictions of B windows of context + 1 tokens.
using CrossEntropySum = std::function<double(const int32_t* tokens, int64_t B)>;

// Mean cross-entropy over the predictions of consecutive windows of context + 1 tokens
// (window i starts at token i * context, so every token but the first is predicted once);
// max_windows = 0 takes every window. The windows are split over the ranks of `world`, which
// all make the same number of calls (an expert-parallel model needs every rank in each).
double evaluate(const CrossEntropySum& ce_sum, int64_t context, const TokenFiles& data, int64_t micro_batch,
                int64_t max_windows, Communicator& world);

// Opens the token files a data option names (a path, a list, globs: core/token_files.h) for a
// model and checks they fit: same vocabulary, long enough together (not their tokens:
// TokenFiles::read and check_vocabulary do).
TokenFiles open_data(const std::string& spec, const char* option, const ModelConfig& m);

class Trainer {
 public:
  // Checks the configuration against the groups and the device, opens the data, builds and
  // initialises this rank's part of the model. Throws ConfigError before any collective when
  // they do not fit.
  Trainer(const Config& config, const ProcessGroups& groups);
  // Trains every step from the start step on (rank 0 logs); returns the loss over the whole
  // validation file. A stop request (core/stop_request.h, or TrainConfig::time_limit) ends the
  // run after the step every rank is in, after its after_step hook (which sees stopping()), and
  // returns NaN without the final validation. A metrics record that cannot be written (disk
  // full) ends the run at the next step, or before run() returns, with WriteError on every rank.
  double run();
  bool stopping() const { return stopping_; }  // the current step is the last: a stop was requested
  const std::vector<double>& losses() const { return losses_; }  // total loss of every step run() trained
  // Every parameter of the model, expert shards gathered over the expert-parallel group (a
  // collective over it). In ParamLayout(config.model) order.
  std::vector<float> full_parameters();

  // For checkpoints (checkpoints/checkpoint.h), which save and load the backend's state.
  const Config& config() const { return cfg_; }
  const ProcessGroups& groups() const { return groups_; }
  TrainingBackend& backend() { return *backend_; }
  // Continues a run whose first `steps_done` steps are in the backend's (loaded) state: the
  // schedule and the data order are functions of the step, so nothing else is needed.
  // Training continues after steps_done (a resumed run). Its metrics file keeps the rows of the
  // steps up to there; those of later steps and the final validation (a run that went on past
  // the checkpoint it resumes) are removed.
  void start_at(int64_t steps_done);
  // Called on every rank after each step (its update and any validation report) with the
  // number of steps done.
  void after_step(std::function<void(int64_t steps_done)> hook) { after_step_ = std::move(hook); }
  // Called on every rank when run() ends with an error the ranks agreed on (AgreedError: a
  // value that is not finite, bad data), before it leaves run(): every rank is there, so the
  // hook may make collectives (the checkpoint writer finishes the save written beside training).
  void on_agreed_stop(std::function<void()> hook) { agreed_stop_ = std::move(hook); }

 private:
  double train();  // run() without its on_agreed_stop hook
  // A quantity's largest value and mean over the ranks.
  struct Spread {
    double max = 0, mean = 0;
  };
  // Each of this rank's values spread over the world's ranks (one all-reduce; a collective).
  std::vector<Spread> spread_over_ranks(std::initializer_list<double> mine);
  // What a step sent between ranks: device time in collectives (GPU ranks) and expert-parallel
  // token traffic, this rank's and their spread over the ranks.
  struct Traffic {
    double comm_seconds = 0;
    int64_t dispatch_bytes = 0;
    Spread comm, dispatch;
  };
  // This rank's traffic with the ranks' largest and mean (a collective).
  Traffic gather_traffic(double comm_seconds, int64_t dispatch_bytes);
  // The optimizer step after step `step`'s forward and backward passes: returns the gradient
  // norm; throws AgreedError (kExitNonFinite, parallel/run_errors.h) on every rank when the loss,
  // the gradient or the updated parameters are not finite, naming the tensors.
  double update(int64_t step, double lr, const LossParts& loss);
  // Where this rank's step went: all of it, its passes' forwards and backwards (PassSeconds), and
  // the update (gradient synchronisation and the optimizer).
  struct StepTime {
    double seconds = 0;
    PassSeconds passes;
    double update = 0;
  };
  void log_step(int64_t step, const LossParts& loss, double lr, double grad_norm, const StepTime& time,
                const Traffic& traffic);
  void log_validation(int64_t step, double loss, bool final);
  // Rank 0 appends a record to the metrics file; the first failure is kept in metrics_error_
  // (with the system's reason), and every rank throws WriteError at the next agreement: the
  // next step's, or agree_on_metrics() (a collective) before run() returns.
  void write_metrics(const std::string& line);
  void fail_if_metrics_lost(double failed_ranks) const;
  void agree_on_metrics();
  // With TrainConfig::grad_jump_factor: when this step's gradient norm exceeds that multiple of
  // the median of the steps' before it (up to 20, once 10 are known), logs each tensor's
  // gradient norm (a collective: every rank decides alike, from the same global norms).
  void watch_gradient_norm(int64_t step, double grad_norm);
  // With TrainConfig::log_experts_every: the experts' load over the steps since the last report
  // (core/expert_load.h), summed over the ranks, and each rank's received rows and FFN
  // selections (max and mean over the ranks); rank 0 prints a summary and writes the counts to
  // the metrics file (a collective).
  void log_expert_load(int64_t step);
  // Rank 0 prints residual_growth_warning once, the first time it is not empty.
  void watch_residual(int64_t step, double residual_std);
  // Rank 0 warns when ranks are bound to one CPU of a machine that has more (a collective).
  void warn_if_bound_to_one_cpu();
  double validation_loss(int64_t max_windows);
  bool leader() const { return groups_.world->rank() == 0; }

  // When the trainer began: the start-up line reports how long the set-up took (configuration
  // checks, data, the backend with its communicators and initial parameters, a resumed checkpoint).
  const std::chrono::steady_clock::time_point constructed_ = std::chrono::steady_clock::now();
  Config cfg_;
  const ProcessGroups& groups_;
  int64_t local_batch_;  // sequences of each global batch this rank trains on
  TokenFiles train_, val_;
  std::unique_ptr<TrainingBackend> backend_;
  std::ofstream metrics_;
  std::string metrics_error_;
  std::vector<double> losses_;
  std::vector<double> recent_norms_;  // the last steps' gradient norms, for watch_gradient_norm
  std::vector<double> recent_seconds_;  // the last steps' seconds, for the estimate of the time left
  double memory_peak_gib_ = 0;          // the most device memory in use seen at a step's end
  int64_t start_step_ = 0;
  int64_t expert_window_start_ = 0;  // the first step of log_expert_load's window
  int64_t rows_received_before_ = 0;  // expert_rows_received() at that step
  int64_t first_residual_step_ = 0;  // for watch_residual: the first step trained, and its spread
  double first_residual_std_ = 0;
  bool residual_warned_ = false;
  bool stopping_ = false;
  std::function<void(int64_t)> after_step_;
  std::function<void()> agreed_stop_;
};

}  // namespace moeut
