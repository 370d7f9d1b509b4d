#include "core/trainer.h"

#include <omp.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>

#include "core/rng.h"

namespace moeut {

void sample_batch(const TokenFile& data, uint64_t seed, int64_t step, int64_t first, int64_t count,
                  int64_t context, int32_t* out) {
  const uint64_t starts = data.size() - uint64_t(context);  // valid start positions
  for (int64_t i = 0; i < count; ++i) {
    Rng rng(hash_mix(hash_mix(seed, uint64_t(step)), uint64_t(first + i)));
    data.read(rng.next() % starts, std::span<int32_t>(out + i * (context + 1), size_t(context + 1)));
  }
}

double evaluate(Model<float>& model, const TokenFile& data, int64_t micro_batch, int64_t max_windows) {
  const int64_t T = model.config().context;
  int64_t windows = int64_t((data.size() - 1) / uint64_t(T));
  if (max_windows > 0) windows = std::min(windows, max_windows);
  std::vector<int32_t> tokens(size_t(micro_batch * (T + 1)));
  double sum = 0;
  for (int64_t w0 = 0; w0 < windows; w0 += micro_batch) {
    const int64_t B = std::min(micro_batch, windows - w0);
    for (int64_t b = 0; b < B; ++b)
      data.read(uint64_t((w0 + b) * T), std::span<int32_t>(tokens.data() + b * (T + 1), size_t(T + 1)));
    sum += model.forward_ce_sum(tokens.data(), B);
  }
  return sum / double(windows * T);
}

TokenFile open_data(const std::string& path, const char* option, const ModelConfig& m) {
  TokenFile f(path);
  if (int64_t(f.vocab_size()) != m.n_tokens)
    throw ConfigError("invalid configuration: n_tokens: is " + std::to_string(m.n_tokens) + " but " + option +
                      " '" + path + "' has a vocabulary of " + std::to_string(f.vocab_size()));
  if (f.size() < uint64_t(m.context + 2))
    throw DataError(path + ": " + std::to_string(f.size()) + " tokens, fewer than context + 2 = " +
                    std::to_string(m.context + 2));
  return f;
}

Trainer::Trainer(const Config& config)
    : cfg_((validate(config), config)),
      train_(open_data(cfg_.train.train_data, "train_data", cfg_.model)),
      val_(open_data(cfg_.train.val_data, "val_data", cfg_.model)),
      model_(cfg_.model),
      optimizer_(model_.layout().total()) {
  if (cfg_.train.threads > 0) omp_set_num_threads(int(cfg_.train.threads));
  model_.init(cfg_.train.seed);
  const std::filesystem::path metrics(cfg_.train.metrics);
  if (metrics.has_parent_path()) std::filesystem::create_directories(metrics.parent_path());
  metrics_.open(metrics, std::ios::trunc);
  if (!metrics_) throw std::runtime_error("cannot write metrics file '" + cfg_.train.metrics + "'");
}

double Trainer::run() {
  const TrainConfig& t = cfg_.train;
  const int64_t T = cfg_.model.context, micro = t.micro_batch_size;
  std::printf("model: %lld parameters (%s), optimizer state %.1f MB, %d threads\n",
              (long long)model_.layout().total(), "fp32", optimizer_.state_bytes() / 1e6, omp_get_max_threads());
  std::vector<int32_t> tokens(size_t(micro * (T + 1)));
  for (int64_t step = 0; step < t.steps; ++step) {
    const auto start = std::chrono::steady_clock::now();
    std::fill(model_.grads.begin(), model_.grads.end(), 0.f);
    LossParts loss;
    for (int64_t first = 0; first < t.batch_size; first += micro) {
      sample_batch(train_, t.seed, step, first, micro, T, tokens.data());
      const double share = double(micro) / double(t.batch_size);
      const LossParts part = model_.forward_backward(tokens.data(), micro, share);
      loss.ce += share * part.ce;
      loss.reg_ffn += share * part.reg_ffn;
      loss.reg_att += share * part.reg_att;
    }
    if (!std::isfinite(loss.total()))
      throw std::runtime_error("step " + std::to_string(step + 1) + ": loss is not finite (" +
                               std::to_string(loss.total()) + "); stopping before the weights are updated");
    const double lr = learning_rate(step, t);
    const double norm = optimizer_.step(model_.params, model_.grads, lr, t);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    log_step(step + 1, loss, lr, norm, double(t.batch_size * T) / seconds);
    if (t.eval_every > 0 && (step + 1) % t.eval_every == 0 && step + 1 < t.steps)
      log_validation(step + 1, evaluate(model_, val_, micro, t.eval_batches * micro), false);
  }
  const double final_loss = evaluate(model_, val_, micro, 0);
  log_validation(t.steps, final_loss, true);
  return final_loss;
}

void Trainer::log_step(int64_t step, const LossParts& loss, double lr, double grad_norm, double tokens_per_s) {
  std::printf("step %5lld/%lld | loss %.4f | ce %.4f | reg %.5f | lr %.3e | grad_norm %.4f | %.0f tok/s\n",
              (long long)step, (long long)cfg_.train.steps, loss.total(), loss.ce, loss.reg_ffn + loss.reg_att, lr,
              grad_norm, tokens_per_s);
  std::fflush(stdout);
  char line[512];
  std::snprintf(line, sizeof line,
                "{\"step\": %lld, \"loss\": %.8g, \"ce\": %.8g, \"reg_ffn\": %.8g, \"reg_att\": %.8g, "
                "\"lr\": %.8g, \"grad_norm\": %.8g, \"tokens_per_s\": %.1f}\n",
                (long long)step, loss.total(), loss.ce, loss.reg_ffn, loss.reg_att, lr, grad_norm, tokens_per_s);
  metrics_ << line << std::flush;
}

void Trainer::log_validation(int64_t step, double loss, bool final) {
  std::printf("%s step %lld | val_loss %.6f | val_ppl %.2f\n", final ? "final validation" : "validation",
              (long long)step, loss, std::exp(loss));
  std::fflush(stdout);
  char line[256];
  std::snprintf(line, sizeof line, "{\"step\": %lld, \"val_loss\": %.10g, \"val_ppl\": %.8g, \"final\": %s}\n",
                (long long)step, loss, std::exp(loss), final ? "true" : "false");
  metrics_ << line << std::flush;
}

}  // namespace moeut
