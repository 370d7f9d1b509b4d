#include "parallel/trainer.h"

#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <numeric>
#include <thread>

#include "core/expert_load.h"
#include "core/nvtx_range.h"
#include "core/rng.h"
#include "core/schedule.h"
#include "core/stop_request.h"
#include "core/write_error.h"
#include "parallel/run_checks.h"
#include "parallel/run_errors.h"

namespace moeut {

void sample_batch(const TokenFiles& data, uint64_t seed, int64_t step, int64_t first, int64_t count,
                  int64_t context, int32_t* out) {
  const uint64_t starts = data.size() - uint64_t(context);  // valid start positions
  for (int64_t i = 0; i < count; ++i) {
    Rng rng(hash_mix(hash_mix(seed, uint64_t(step)), uint64_t(first + i)));
    data.read(rng.next() % starts, std::span<int32_t>(out + i * (context + 1), size_t(context + 1)));
  }
}

double evaluate(const CrossEntropySum& ce_sum, int64_t context, const TokenFiles& data, int64_t micro_batch,
                int64_t max_windows, Communicator& world) {
  const int64_t T = context, ranks = world.size();
  int64_t windows = int64_t((data.size() - 1) / uint64_t(T));
  if (max_windows > 0) windows = std::min(windows, max_windows);
  // Rank r takes a contiguous run of windows; runs differ by at most one window.
  const int64_t first = windows * world.rank() / ranks, mine = windows * (world.rank() + 1) / ranks - first;
  const int64_t most = (windows + ranks - 1) / ranks;  // windows of the busiest rank
  const int64_t calls = (most + micro_batch - 1) / micro_batch;
  std::vector<int32_t> tokens(size_t(micro_batch * (T + 1)));
  double sum = 0;
  for (int64_t c = 0; c < calls; ++c) {
    const int64_t B = std::clamp(mine - c * micro_batch, int64_t(0), micro_batch);
    for (int64_t b = 0; b < B; ++b)
      data.read(uint64_t((first + c * micro_batch + b) * T), std::span<int32_t>(tokens.data() + b * (T + 1), size_t(T + 1)));
    sum += ce_sum(tokens.data(), B);
  }
  world.all_reduce_sum(std::span<double>(&sum, 1));
  return sum / double(windows * T);
}

TokenFiles open_data(const std::string& spec, const char* option, const ModelConfig& m) {
  TokenFiles f(spec);
  if (int64_t(f.vocab_size()) != m.n_tokens)
    throw ConfigError("invalid configuration: n_tokens: is " + std::to_string(m.n_tokens) + " but " + option +
                      " '" + spec + "' has a vocabulary of " + std::to_string(f.vocab_size()));
  if (f.size() < uint64_t(m.context + 2))
    throw DataError(spec + ": " + std::to_string(f.size()) + " tokens, fewer than context + 2 = " +
                    std::to_string(m.context + 2));
  return f;
}

namespace {

// x in `format` for a metrics record, or null where it overflowed (a gradient norm, a residual's
// spread), so the record stays JSON.
std::string json_number(double x, const char* format) {
  if (!std::isfinite(x)) return "null";
  char out[32];
  std::snprintf(out, sizeof out, format, x);
  return out;
}

// Seconds as the step line shows the time left: 45s, 12m05s, 3h07m.
std::string eta_text(double seconds) {
  const long long s = std::llround(std::max(0.0, seconds));
  char out[32];
  if (s < 60) std::snprintf(out, sizeof out, "%llds", s);
  else if (s < 3600) std::snprintf(out, sizeof out, "%lldm%02llds", s / 60, s % 60);
  else std::snprintf(out, sizeof out, "%lldh%02lldm", s / 3600, s % 3600 / 60);
  return out;
}

bool use_gpu(const Config& c) {
  return c.train.device == "cuda" || (c.train.device == "auto" && gpu_backend_available());
}

// The configuration, after the checks that involve the process layout, with its automatic token
// dispatcher chosen: the all-gather one on GPU ranks whose expert-parallel groups each lie on one
// machine (no host round trip, bf16 partial sums, every row over the machine's links), the
// all-to-all one otherwise (CPU ranks; groups across machines, where it sends fewer bytes from 32
// ranks up and keeps fewer rows).
Config checked(Config c, const ProcessGroups& g) {
  validate(c);
  if (c.train.dispatcher == "auto") {
    const bool within = g.expert_groups_within_machines();  // a collective: every rank, whatever its device
    c.train.dispatcher = use_gpu(c) && within ? "all_gather" : "all_to_all";
  }
  const int64_t world = g.world->size(), ep = g.ep();
  if (c.train.ep != ep)
    throw ConfigError("invalid configuration: ep: is " + std::to_string(c.train.ep) + " but the expert-parallel group has " +
                      std::to_string(ep) + " ranks");
  if (ep > c.model.ff_n_experts)
    throw ConfigError("invalid configuration: ep: " + std::to_string(ep) + " ranks cannot share " +
                      std::to_string(c.model.ff_n_experts) + " FFN experts (at most one rank per expert)");
  if (c.train.batch_size % (world * c.train.micro_batch_size) != 0)
    throw ConfigError("invalid configuration: batch_size: " + std::to_string(c.train.batch_size) +
                      " sequences do not split into micro-batches of " + std::to_string(c.train.micro_batch_size) +
                      " over " + std::to_string(world) + " ranks (need a multiple of " +
                      std::to_string(world * c.train.micro_batch_size) + ")");
  if (c.train.device == "cuda" && !gpu_backend_available())
    throw ConfigError("invalid configuration: device: cuda asked for, but no GPU is available to this build");
  return c;
}

}  // namespace

Trainer::Trainer(const Config& config, const ProcessGroups& groups)
    : cfg_(checked(config, groups)),
      groups_(groups),
      local_batch_(cfg_.train.batch_size / groups.world->size()) {
  if (cfg_.train.threads > 0) omp_set_num_threads(int(cfg_.train.threads));
  // What one rank alone may find wrong (the files as it sees them, its memory) ends every rank
  // together, before the backend's collectives and before the first step.
  agree_on(*groups_.world, [&] {
    train_ = open_data(cfg_.train.train_data, "train_data", cfg_.model);  // its tokens are checked as read
    val_ = open_data(cfg_.train.val_data, "val_data", cfg_.model);
    val_.check_vocabulary();
    check_outputs(cfg_.train, leader());
    if (!use_gpu(cfg_)) check_host_memory(cfg_, groups_);
    if (!leader()) return;
    // A resumed run continues the metrics of the run it resumes.
    metrics_.open(cfg_.train.metrics, cfg_.train.resume.empty() ? std::ios::trunc : std::ios::app);
    if (!metrics_)
      throw std::runtime_error("cannot write metrics file '" + shown(cfg_.train.metrics) + "': " + std::strerror(errno));
  });
  backend_ = use_gpu(cfg_) ? make_gpu_backend(cfg_, groups) : make_cpu_backend(cfg_, groups);
}

void Trainer::start_at(int64_t steps_done) {
  start_step_ = steps_done;
  if (!leader()) return;
  const std::filesystem::path path(cfg_.train.metrics), kept(cfg_.train.metrics + ".resumed");
  metrics_.close();
  {
    std::ifstream in(path);
    std::ofstream out(kept, std::ios::trunc);
    std::string line;
    while (std::getline(in, line)) {
      long long step = 0;
      const bool numbered = std::sscanf(line.c_str(), "{\"step\": %lld", &step) == 1;
      if (numbered && (step > steps_done || line.find("\"final\": true") != std::string::npos)) continue;
      out << line << '\n';
    }
    if (!out.flush()) throw std::runtime_error("cannot write metrics file '" + kept.string() + "'");
  }
  std::filesystem::rename(kept, path);
  metrics_.open(path, std::ios::app);
  if (!metrics_) throw std::runtime_error("cannot write metrics file '" + cfg_.train.metrics + "'");
}

double Trainer::validation_loss(int64_t max_windows) {
  return evaluate([&](const int32_t* tokens, int64_t B) { return backend_->forward_ce_sum(tokens, B); },
                  cfg_.model.context, val_, cfg_.train.micro_batch_size, max_windows, *groups_.world);
}

double Trainer::run() {
  try {
    return train();
  } catch (const AgreedError&) {
    if (agreed_stop_) agreed_stop_();
    throw;
  }
}

double Trainer::train() {
  const TrainConfig& t = cfg_.train;
  const int64_t T = cfg_.model.context, micro = t.micro_batch_size;
  const ExpertShard& shard = backend_->layout().shard();
  if (leader())
    std::printf("topology: world %d | ep %d (%s dispatcher) | dp %d (replicated), %d (experts) | experts per rank "
                "%lld..%lld of %lld\n"
                "model: %lld parameters on rank 0 (fp32) | optimizer state %.1f MB on rank 0 | device %s | %d threads per rank "
                "| set up in %.1f s\n",
                groups_.world->size(), groups_.ep(), groups_.ep() > 1 ? t.dispatcher.c_str() : "local", groups_.dp(),
                groups_.expert_data_parallel->size(),
                (long long)expert_shard(cfg_.model.ff_n_experts, groups_.ep(), groups_.ep() - 1).count,
                (long long)shard.count, (long long)cfg_.model.ff_n_experts, (long long)backend_->layout().total(),
                backend_->optimizer_state_bytes() / 1e6, backend_->device(), omp_get_max_threads(),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - constructed_).count());
  if (const std::string memory = backend_->memory_plan(); leader() && !memory.empty())
    std::printf("GPU memory on rank 0: %s | bf16 product peak measured %.0f TFLOP/s (MFU's base)\n", memory.c_str(),
                backend_->peak_flops() / 1e12);
  warn_if_bound_to_one_cpu();
  std::vector<int32_t> tokens(size_t(micro * (T + 1)));
  const int64_t first_sequence = groups_.world->rank() * local_batch_;
  const auto run_start = std::chrono::steady_clock::now();
  double longest_iteration = 0;  // seconds of a step with its validation and hook (saves)
  expert_window_start_ = start_step_;
  for (int64_t step = start_step_; step < t.steps; ++step) {
    const auto start = std::chrono::steady_clock::now();
    const double elapsed = std::chrono::duration<double>(start - run_start).count();
    const int64_t dispatched = backend_->dispatch_bytes();
    backend_->zero_gradients();
    // ce, reg_ffn, reg_att, residual_std, weighted by share of the global batch; then the ranks that
    // caught a stop signal and those that see the time limit coming, so every rank stops after the
    // same step; whether rank 0 failed to write the metrics of the step before; then each rank's
    // data error (its exit status, 0: none).
    std::vector<double> parts(size_t(7 + groups_.world->size()), 0.0);
    parts[6] = metrics_error_.empty() ? 0.0 : 1.0;
    std::string data_error;  // this rank's first bad token of the step
    for (int64_t first = 0; first < local_batch_; first += micro) {
      try {
        sample_batch(train_, t.seed, step, first_sequence + first, micro, T, tokens.data());
      } catch (const DataError& e) {
        // Agreed on with the step's losses below; meanwhile tokens that are valid keep this
        // rank's collectives in step with the others'.
        if (data_error.empty()) data_error = e.what();
        std::fill(tokens.begin(), tokens.end(), 0);
        parts[size_t(7 + groups_.world->rank())] = kExitDataError;
      }
      const double share = double(micro) / double(t.batch_size);
      const NvtxRange range("forward and backward");
      const LossParts part = backend_->forward_backward(tokens.data(), micro, share, first + micro >= local_batch_);
      parts[0] += share * part.ce;
      parts[1] += share * part.reg_ffn;
      parts[2] += share * part.reg_att;
      parts[3] += share * part.residual_std;
    }
    parts[4] = stop_signal() != 0 ? 1 : 0;
    parts[5] = t.time_limit > 0 && elapsed + 2 * longest_iteration > t.time_limit ? 1 : 0;
    groups_.world->all_reduce_sum(std::span<double>(parts));
    fail_if_metrics_lost(parts[6]);
    end_together(std::span<const double>(parts).subspan(7), *groups_.world, data_error);
    stopping_ = parts[4] > 0 || parts[5] > 0;
    const LossParts loss{.ce = parts[0], .reg_ffn = parts[1], .reg_att = parts[2], .residual_std = parts[3]};
    const double lr = learning_rate(step, t);
    const auto update_start = std::chrono::steady_clock::now();
    const double norm = [&] {
      const NvtxRange range("optimizer");
      return update(step + 1, lr, loss);
    }();
    const double comm = backend_->take_communication_seconds();
    const auto end = std::chrono::steady_clock::now();
    const double seconds = std::chrono::duration<double>(end - start).count();
    losses_.push_back(loss.total());
    log_step(step + 1, loss, lr, norm,
             {.seconds = seconds,
              .passes = backend_->take_pass_seconds(),
              .update = std::chrono::duration<double>(end - update_start).count()},
             gather_traffic(comm, backend_->dispatch_bytes() - dispatched));
    if (t.grad_jump_factor > 0) watch_gradient_norm(step + 1, norm);
    watch_residual(step + 1, loss.residual_std);
    if (t.log_experts_every > 0 && (step + 1) % t.log_experts_every == 0) log_expert_load(step + 1);
    if (t.eval_every > 0 && (step + 1) % t.eval_every == 0 && step + 1 < t.steps && !stopping_)
      log_validation(step + 1, [&] {
        const NvtxRange range("validation");
        return validation_loss(t.eval_batches * micro);
      }(), false);
    if (after_step_) {
      const NvtxRange range("after the step (checkpoint saves)");
      after_step_(step + 1);
    }
    longest_iteration = std::max(
        longest_iteration, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    if (stopping_) {
      if (leader()) {
        if (parts[4] > 0)
          std::printf("stopped after step %lld: a stop signal reached %.0f of %d ranks\n", (long long)(step + 1),
                      parts[4], groups_.world->size());
        else
          std::printf("stopped after step %lld: the time limit of %.0f s leaves less than twice the longest step "
                      "(%.1f s) after %.0f s\n",
                      (long long)(step + 1), t.time_limit, longest_iteration, elapsed + seconds);
        std::fflush(stdout);
      }
      agree_on_metrics();
      return std::numeric_limits<double>::quiet_NaN();
    }
  }
  const double final_loss = validation_loss(0);
  log_validation(t.steps, final_loss, true);
  agree_on_metrics();
  return final_loss;
}

double Trainer::update(int64_t step, double lr, const LossParts& loss) {
  // The loss and the norm are the same on every rank, the parameters' check is agreed on in the
  // optimizer: every rank stops together, before the step's after_step hook (saves).
  char loss_text[32];
  std::snprintf(loss_text, sizeof loss_text, "%.6g", loss.total());
  const std::string at = "step " + std::to_string(step) + ": ";
  const std::string none_saved = "; stopped before anything of this step was saved";
  double norm = 0;
  try {
    norm = backend_->step(lr, cfg_.train);
  } catch (const NonFiniteUpdate& e) {
    const std::vector<float> params = backend_->parameters();
    const std::vector<TensorSpec>& tensors = backend_->layout().tensors();
    std::vector<double> flags(tensors.size(), 0.0);  // NaN where a value is not finite; NaN survives the sum
    for (size_t i = 0; i < tensors.size(); ++i) {
      const float* begin = params.data() + tensors[i].offset;
      if (!std::all_of(begin, begin + tensors[i].numel, [](float x) { return std::isfinite(x); })) flags[i] = NAN;
    }
    groups_.world->all_reduce_sum(std::span<double>(flags));
    throw AgreedError(at + e.what() + ": " + non_finite_tensors(backend_->layout(), flags) + "; loss " + loss_text +
                          "; a lower lr or a larger adam_eps avoids it" + none_saved,
                      kExitNonFinite, leader());
  }
  if (std::isfinite(loss.total()) && std::isfinite(norm)) return norm;
  std::vector<double> sums = backend_->gradient_square_sums();
  groups_.world->all_reduce_sum(std::span<double>(sums));
  const std::string what = std::isfinite(loss.total()) ? "the gradient is not finite (loss " + std::string(loss_text) + ")"
                                                       : "loss is not finite (" + std::string(loss_text) + ")";
  const bool named = std::any_of(sums.begin(), sums.end(), [](double s) { return !std::isfinite(s); });
  throw AgreedError(at + what + (named ? "; gradient not finite in " + non_finite_tensors(backend_->layout(), sums)
                                       : "; every tensor's gradient is finite") +
                        none_saved,
                    kExitNonFinite, leader());
}

void Trainer::write_metrics(const std::string& line) {
  if (!metrics_error_.empty()) return;
  errno = 0;
  metrics_ << line << std::flush;
  if (!metrics_)
    metrics_error_ = cfg_.train.metrics + ": cannot write the metrics: " +
                     (errno != 0 ? std::strerror(errno) : "the stream failed");
}

void Trainer::fail_if_metrics_lost(double failed_ranks) const {
  if (failed_ranks == 0) return;
  throw WriteError(leader() ? metrics_error_ : cfg_.train.metrics + ": rank 0 cannot write the metrics");
}

void Trainer::agree_on_metrics() {
  double failed[1] = {metrics_error_.empty() ? 0.0 : 1.0};
  groups_.world->all_reduce_sum(std::span<double>(failed, 1));
  fail_if_metrics_lost(failed[0]);
}

std::vector<float> Trainer::full_parameters() {
  const ParamLayout full(cfg_.model);
  const ParamLayout& local = backend_->layout();
  const std::vector<float> params = backend_->parameters();
  std::vector<float> out(size_t(full.total()));
  Communicator& ep = *groups_.expert_parallel;
  std::vector<int64_t> counts(size_t(ep.size()));
  for (const TensorSpec& t : full.tensors()) {
    const TensorSpec& mine = local.at(t.name);
    float* dst = out.data() + t.offset;
    if (!t.expert) {
      std::copy_n(params.data() + mine.offset, t.numel, dst);
      continue;
    }
    // Expert shards are consecutive slices of the [E, ...] tensor, in rank order.
    const int64_t per_expert = t.numel / cfg_.model.ff_n_experts;
    for (int r = 0; r < ep.size(); ++r) counts[r] = expert_shard(cfg_.model.ff_n_experts, ep.size(), r).count * per_expert;
    std::copy_n(params.data() + mine.offset, mine.numel, dst + local.shard().begin * per_expert);
    ep.all_gather_v(std::span<float>(dst, size_t(t.numel)), counts);
  }
  return out;
}

std::vector<Trainer::Spread> Trainer::spread_over_ranks(std::initializer_list<double> mine) {
  Communicator& world = *groups_.world;
  const size_t ranks = size_t(world.size()), n = mine.size();
  std::vector<double> each(n * ranks, 0.0);  // value i of rank r at i · ranks + r
  for (size_t i = 0; i < n; ++i) each[i * ranks + size_t(world.rank())] = std::data(mine)[i];
  if (ranks > 1) world.all_reduce_sum(std::span<double>(each));
  std::vector<Spread> out(n);
  for (size_t i = 0; i < n; ++i) {
    const auto begin = each.begin() + ptrdiff_t(i * ranks), end = begin + ptrdiff_t(ranks);
    out[i] = {.max = *std::max_element(begin, end), .mean = std::accumulate(begin, end, 0.0) / double(ranks)};
  }
  return out;
}

Trainer::Traffic Trainer::gather_traffic(double comm_seconds, int64_t dispatch_bytes) {
  const std::vector<Spread> s = spread_over_ranks({comm_seconds, double(dispatch_bytes)});
  return {.comm_seconds = comm_seconds, .dispatch_bytes = dispatch_bytes, .comm = s[0], .dispatch = s[1]};
}

void Trainer::log_step(int64_t step, const LossParts& loss, double lr, double grad_norm, const StepTime& time,
                       const Traffic& traffic) {
  if (!leader()) return;
  const double seconds = time.seconds;
  // The time left: the steps to go at the mean of the last (up to 20) steps' seconds.
  if (recent_seconds_.size() == 20) recent_seconds_.erase(recent_seconds_.begin());
  recent_seconds_.push_back(seconds);
  const double eta = double(cfg_.train.steps - step) * std::accumulate(recent_seconds_.begin(), recent_seconds_.end(), 0.0) /
                     double(recent_seconds_.size());
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  const double tokens_per_s = double(cfg_.train.batch_size * cfg_.model.context) / seconds;
  // GPU ranks: MFU (the spec's FLOPs over the ranks' measured bf16 peaks) and rank 0's memory.
  const double peak = backend_->peak_flops() * groups_.world->size();
  const double mfu = peak > 0 ? tokens_per_s * cfg_.model.training_flops_per_token() / peak : NAN;
  const double gib = double(backend_->device_memory_in_use()) / double(1ull << 30);
  memory_peak_gib_ = std::max(memory_peak_gib_, gib);
  std::printf("step %5lld/%lld | loss %.4f | ce %.4f | reg %.5f | lr %.3e | grad_norm %.4f | residual_std %.3g | "
              "%.0f tok/s",
              (long long)step, (long long)cfg_.train.steps, loss.total(), loss.ce, loss.reg_ffn + loss.reg_att, lr,
              grad_norm, loss.residual_std, tokens_per_s);
  std::printf(" | fwd/bwd/update %.0f/%.0f/%.0f ms", time.passes.forward * 1e3, time.passes.backward * 1e3,
              time.update * 1e3);
  if (peak > 0) std::printf(" | MFU %.1f%% | %.1f GiB", 100 * mfu, gib);
  if (traffic.comm_seconds > 0)
    std::printf(" | comm %.0f ms (%.0f%%) | dispatch %.1f MB", traffic.comm_seconds * 1e3,
                100 * traffic.comm_seconds / seconds, double(traffic.dispatch_bytes) / 1e6);
  std::printf(" | eta %s\n", eta_text(eta).c_str());
  std::fflush(stdout);
  char line[1536];
  std::snprintf(line, sizeof line,
                "{\"step\": %lld, \"loss\": %.8g, \"ce\": %.8g, \"reg_ffn\": %.8g, \"reg_att\": %.8g, "
                "\"lr\": %.8g, \"grad_norm\": %s, \"residual_std\": %s, \"step_s\": %.6g, \"forward_s\": %.6g, "
                "\"backward_s\": %.6g, \"update_s\": %.6g, \"tokens_per_s\": %.1f, "
                "\"eta_s\": %.1f, \"time\": %.3f, \"comm_s\": %.6g, \"comm_s_max\": %.6g, \"comm_s_mean\": %.6g, "
                "\"dispatch_bytes\": %lld, \"dispatch_bytes_max\": %.0f, \"dispatch_bytes_mean\": %.0f, \"mfu\": %s, "
                "\"gpu_memory_gib\": %s, \"gpu_memory_peak_gib\": %s}\n",
                (long long)step, loss.total(), loss.ce, loss.reg_ffn, loss.reg_att, lr,
                json_number(grad_norm, "%.8g").c_str(), json_number(loss.residual_std, "%.6g").c_str(), seconds,
                time.passes.forward, time.passes.backward, time.update, tokens_per_s, eta, now, traffic.comm_seconds, traffic.comm.max, traffic.comm.mean,
                (long long)traffic.dispatch_bytes, traffic.dispatch.max, traffic.dispatch.mean,
                json_number(mfu, "%.5f").c_str(), json_number(peak > 0 ? gib : NAN, "%.3f").c_str(),
                json_number(peak > 0 ? memory_peak_gib_ : NAN, "%.3f").c_str());
  write_metrics(line);
}

void Trainer::warn_if_bound_to_one_cpu() {
  cpu_set_t mask;
  CPU_ZERO(&mask);
  const int cpus = sched_getaffinity(0, sizeof mask, &mask) == 0 ? CPU_COUNT(&mask) : 0;
  const unsigned machine = std::thread::hardware_concurrency();
  double bound[1] = {cpus == 1 && machine > 1 ? 1.0 : 0.0};
  groups_.world->all_reduce_sum(std::span<double>(bound, 1));
  if (!leader() || bound[0] == 0) return;
  std::printf("warning: %.0f of %d ranks are each bound to a single CPU of the machine's %u (OpenMP threads per rank: "
              "%d): mpirun binds each rank to one core by default; start with --bind-to none (or --map-by "
              "slot:PE=<cores per rank>) and set OMP_NUM_THREADS to the cores per rank\n",
              bound[0], groups_.world->size(), machine, omp_get_max_threads());
  std::fflush(stdout);
}

std::string residual_growth_warning(int64_t step, double residual_std, int64_t first_step, double first) {
  const bool finite = std::isfinite(residual_std);
  if (finite && !(residual_std > kResidualGrowthWarning * first)) return "";
  char spread[128], line[512];
  if (finite)
    std::snprintf(spread, sizeof spread, "%.3g, %.2g times its value at step %lld (%.3g)", residual_std,
                  residual_std / first, (long long)first_step, first);
  else
    std::snprintf(spread, sizeof spread, "not finite (%.3g at step %lld)", first, (long long)first_step);
  std::snprintf(line, sizeof line,
                "warning: step %lld: residual_std %s: the residual stream is growing without bound, the growth "
                "that precedes a collapse to unigram-level loss (docs/DESIGN.md, \"Training stability\"); a "
                "longer warm-up or a lower learning rate avoids it",
                (long long)step, spread);
  return line;
}

void Trainer::log_expert_load(int64_t step) {
  const ExpertLoadLayout layout(cfg_.model);
  std::vector<double> load = backend_->take_expert_load();
  Communicator& world = *groups_.world;
  world.all_reduce_sum(std::span<double>(load));
  // Spread over the ranks: the token rows each rank's experts were given, and the FFN selections
  // they computed (the summed counts over the experts it holds).
  const int64_t received = backend_->expert_rows_received();
  const ExpertShard shard = backend_->layout().shard();
  double selections = 0;
  for (int64_t layer = 0; layer < layout.layers(); ++layer)
    for (int64_t e = 0; e < shard.count; ++e)
      selections += load[size_t(layout.offset(layer, ExpertKind::kFfn) + shard.begin + e)];
  const std::vector<Spread> spread = spread_over_ranks({double(received - rows_received_before_), selections});
  rows_received_before_ = received;
  const int64_t first = expert_window_start_ + 1;
  expert_window_start_ = step;
  if (!leader()) return;
  auto json = [](const Spread& s) {
    return "{\"max\": " + json_number(s.max, "%.10g") + ", \"mean\": " + json_number(s.mean, "%.10g") + "}";
  };
  const std::vector<ExpertLoadStats> stats = expert_load_stats(layout, load);
  std::string line = "{\"step\": " + std::to_string(step) + ", \"expert_load\": {\"first_step\": " +
                     std::to_string(first) + ", \"layers\": [";
  for (size_t i = 0; i < stats.size(); ++i) {
    const ExpertLoadStats& s = stats[i];
    line += std::string(i ? ", " : "") + "{\"layer\": " + std::to_string(s.layer) + ", \"kind\": \"" +
            expert_kind_name(s.kind) + "\", \"experts\": " + std::to_string(s.experts) +
            ", \"selections\": " + json_number(s.selections, "%.10g") + ", \"dead\": " + std::to_string(s.dead) +
            ", \"usage_perplexity\": " + json_number(s.usage_perplexity, "%.6g") +
            ", \"max_over_mean\": " + json_number(s.max_over_mean, "%.6g") +
            ", \"mean_weight\": " + json_number(s.mean_weight, "%.6g") + ", \"counts\": [";
    const double* counts = load.data() + layout.offset(s.layer, s.kind);
    for (int64_t e = 0; e < s.experts; ++e) {
      if (e) line += ',';
      line += json_number(counts[e], "%.10g");
    }
    line += "]}";
  }
  line += "], \"rank_rows_received\": " + json(spread[0]) + ", \"rank_ffn_selections\": " + json(spread[1]) + "}}\n";
  write_metrics(line);
  // The summary: per kind, dead experts and usage perplexity summed over the physical layers.
  std::printf("experts, steps %lld-%lld:", (long long)first, (long long)step);
  for (ExpertKind kind : kExpertKinds) {
    int64_t dead = 0, experts = 0;
    double perplexity = 0, worst = 0;
    for (const ExpertLoadStats& s : stats)
      if (s.kind == kind) dead += s.dead, experts += s.experts, perplexity += s.usage_perplexity,
                          worst = std::max(worst, s.max_over_mean);
    std::printf(" %s dead %lld/%lld, usage perplexity %.1f/%lld, busiest %.2fx mean%s", expert_kind_name(kind),
                (long long)dead, (long long)experts, perplexity, (long long)experts, worst,
                kind == ExpertKind::kAttentionOutput ? "" : " |");
  }
  if (groups_.ep() > 1) std::printf(" | rows received per rank: max %.3gx mean", spread[0].max / spread[0].mean);
  std::printf("\n");
  std::fflush(stdout);
}

void Trainer::watch_residual(int64_t step, double residual_std) {
  if (first_residual_step_ == 0) {
    first_residual_step_ = step;
    first_residual_std_ = residual_std;
    return;
  }
  if (residual_warned_ || !leader()) return;
  const std::string warning = residual_growth_warning(step, residual_std, first_residual_step_, first_residual_std_);
  if (warning.empty()) return;
  residual_warned_ = true;
  std::printf("%s\n", warning.c_str());
  std::fflush(stdout);
}

void Trainer::watch_gradient_norm(int64_t step, double grad_norm) {
  constexpr size_t kWindow = 20, kFewest = 10;  // steps the median is taken over, and needs
  std::vector<double> sorted = recent_norms_;
  if (recent_norms_.size() == kWindow) recent_norms_.erase(recent_norms_.begin());
  recent_norms_.push_back(grad_norm);
  if (sorted.size() < kFewest) return;
  std::nth_element(sorted.begin(), sorted.begin() + ptrdiff_t(sorted.size() / 2), sorted.end());
  const double median = sorted[sorted.size() / 2];
  if (!(grad_norm > cfg_.train.grad_jump_factor * median)) return;
  std::vector<double> sums = backend_->gradient_square_sums();
  groups_.world->all_reduce_sum(std::span<double>(sums));
  if (!leader()) return;
  const std::vector<TensorSpec>& tensors = backend_->layout().tensors();
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), size_t(0));
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return sums[a] > sums[b]; });
  std::printf("gradient norm jump at step %lld: %.4g, %.1fx the median %.4g of the %zu steps before; largest by tensor:",
              (long long)step, grad_norm, grad_norm / median, median, sorted.size());
  for (size_t i = 0; i < std::min<size_t>(6, order.size()); ++i)
    std::printf(" %s %.3g%s", tensors[order[i]].name.c_str(), std::sqrt(sums[order[i]]), i < 5 ? "," : "");
  std::printf("\n");
  std::fflush(stdout);
  std::string line = "{\"step\": " + std::to_string(step) + ", \"grad_norm_jump\": " + json_number(grad_norm, "%.8g") +
                     ", \"tensor_grad_norms\": {";
  for (size_t t = 0; t < tensors.size(); ++t)
    line += (t ? ", \"" : "\"") + tensors[t].name + "\": " + json_number(std::sqrt(sums[t]), "%.6g");
  write_metrics(line + "}}\n");
}

void Trainer::log_validation(int64_t step, double loss, bool final) {
  if (!leader()) return;
  std::printf("%s step %lld | val_loss %.6f | val_ppl %.2f\n", final ? "final validation" : "validation",
              (long long)step, loss, std::exp(loss));
  std::fflush(stdout);
  char line[256];
  std::snprintf(line, sizeof line, "{\"step\": %lld, \"val_loss\": %.10g, \"val_ppl\": %.8g, \"final\": %s}\n",
                (long long)step, loss, std::exp(loss), final ? "true" : "false");
  write_metrics(line);
}

}  // namespace moeut
