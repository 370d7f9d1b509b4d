// The training loop on one process: sampling, gradient accumulation, optimizer step, logging,
// validation.
#pragma once
#include <cstdint>
#include <fstream>

#include "core/config.h"
#include "core/model.h"
#include "core/optimizer.h"
#include "core/token_file.h"

namespace moeut {

// Sequences first..first+count-1 of global batch `step`, each context + 1 tokens, into out.
// Sequence i starts at a position drawn from its own stream keyed by (seed, step, i), so any
// split of a batch across micro-batches or processes reads the same tokens.
void sample_batch(const TokenFile& data, uint64_t seed, int64_t step, int64_t first, int64_t count,
                  int64_t context, int32_t* out);

// Mean cross-entropy over the predictions of consecutive windows of context + 1 tokens
// (window i starts at token i * context, so every token but the first is predicted once), in
// micro-batches of micro_batch windows; max_windows = 0 takes every window.
double evaluate(Model<float>& model, const TokenFile& data, int64_t micro_batch, int64_t max_windows);

// Opens a token file for a model and checks it fits: same vocabulary, long enough.
TokenFile open_data(const std::string& path, const char* option, const ModelConfig& m);

class Trainer {
 public:
  explicit Trainer(const Config& config);  // opens the data, builds and initialises the model
  // Trains every step, logging each; returns the loss over the whole validation file.
  double run();
  Model<float>& model() { return model_; }

 private:
  void log_step(int64_t step, const LossParts& loss, double lr, double grad_norm, double tokens_per_s);
  void log_validation(int64_t step, double loss, bool final);

  Config cfg_;
  TokenFile train_, val_;
  Model<float> model_;
  AdamW optimizer_;
  std::ofstream metrics_;
};

}  // namespace moeut
