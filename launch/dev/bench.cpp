// moeut-bench: training steps (forward, backward, AdamW) of a profile on one GPU; prints
// tokens/s, TFLOP/s and MFU (the spec's FLOP formula over the bf16 peak measured in the same
// run), peak GPU memory and the split between forward, backward and optimizer. With
// MOEUT_BENCH_COUNT_EXPERTS=1 in the environment the steps count the experts' load as
// --log_experts_every does (launch/dev/gpu-compare.sh --env MOEUT_BENCH_COUNT_EXPERTS: its cost).
#include <boost/program_options.hpp>
#include <cuda_profiler_api.h>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <iostream>

#include "core/gpu_model.h"
#include "core/model.h"
#include "core/dense_products.h"
#include "launch/dev/cuda_timing.h"
#include "parallel/gpu_sharded_optimizer.h"

namespace po = boost::program_options;
using namespace moeut;

int main(int argc, char** argv) {
  std::string config_path;
  // Three untimed steps: a pass runs eagerly the first time, is captured as a CUDA graph the
  // second, and its first replay can take tens of ms more than the next ones.
  int64_t batch = 16, steps = 5, warmup = 3;
  po::options_description opts("moeut-bench options");
  opts.add_options()("help,h", "show this help")
      ("config", po::value(&config_path)->required(), "profile, e.g. configs/1B.cfg")
      ("batch", po::value(&batch)->default_value(batch), "sequences per step")
      ("steps", po::value(&steps)->default_value(steps), "timed steps")
      ("warmup", po::value(&warmup)->default_value(warmup), "untimed steps first");
  try {
    po::variables_map vm;
    po::store(po::parse_command_line(argc, argv, opts), vm);
    if (vm.count("help")) { std::cout << opts << "\n"; return 0; }
    po::notify(vm);
    if (batch <= 0 || steps <= 0 || warmup < 0) throw ConfigError("batch and steps must be positive, warmup >= 0");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moeut-bench: %s\n", e.what());
    return 2;
  }
  try {
    const Config cfg = load_config_file(config_path);
    const ModelConfig& m = cfg.model;
    const double peak = measure_bf16_peak_tflops();
    cudaDeviceProp prop;
    MOEUT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    const ParamLayout layout(m);
    std::vector<float> params(size_t(layout.total()));
    init_parameters(m, layout, cfg.train.seed, params.data());  // the spec's initialisation, on the host
    GpuModel model(m, batch);
    const char* count_experts = std::getenv("MOEUT_BENCH_COUNT_EXPERTS");
    model.set_expert_counting(count_experts && std::string(count_experts) == "1");
    std::printf("%s | %s | batch %lld x %lld | bf16 peak measured %.1f TFLOP/s | CUDA graphs %s\n", prop.name,
                config_path.c_str(), (long long)batch, (long long)m.context, peak, model.graphs() ? "on" : "off");
    if (count_experts) std::printf("expert-load counting: %s\n", std::string(count_experts) == "1" ? "on" : "off");
    model.set_parameters(params);
    const ProcessGroups one = ProcessGroups::single();
    GpuShardedAdamW optimizer(model.layout(), one, params, model.stream());
    std::vector<int32_t> tokens(size_t(batch * (m.context + 1)));
    Rng rng(7);
    for (auto& t : tokens) t = int32_t(rng.next() % uint64_t(m.n_tokens));

    using clock = std::chrono::steady_clock;
    auto seconds = [](clock::time_point a, clock::time_point b) { return std::chrono::duration<double>(b - a).count(); };
    // One training step: a forward-only pass (timed apart, for the forward / backward split), then
    // forward + backward and the optimizer. With ncu_range, the training work is the range that
    // ncu --profile-from-start off profiles.
    using Split = std::array<double, size_t(GpuModel::Part::kCount)>;
    struct StepTimes {
      double forward, train, optimizer;
      Split forward_parts, train_parts;
    };
    LossParts loss;
    auto train_step = [&](bool ncu_range) {
      StepTimes s;
      const auto t0 = clock::now();
      model.forward(tokens.data());
      const auto t1 = clock::now();
      s.forward_parts = model.take_profile();
      model.zero_gradients();
      if (ncu_range) MOEUT_CUDA_CHECK(cudaProfilerStart());
      const auto t2 = clock::now();
      loss = model.forward_backward(tokens.data(), 1.0);
      const auto t3 = clock::now();
      s.train_parts = model.take_profile();
      optimizer.step(model.working(), model.grads(), cfg.train.lr, cfg.train);
      MOEUT_CUDA_CHECK(cudaStreamSynchronize(model.stream()));
      const auto t4 = clock::now();
      if (ncu_range) MOEUT_CUDA_CHECK(cudaProfilerStop());
      s.forward = seconds(t0, t1), s.train = seconds(t2, t3), s.optimizer = seconds(t3, t4);
      return s;
    };
    // The timed steps run as training runs them (as CUDA graphs unless MOEUT_NO_GRAPHS=1). The
    // split comes from as many steps again, with the clock read at each change of part (its
    // marks, about 30 a layer, are kernels of their own), and they are not in the step time.
    double fwd = 0, total = 0, opt = 0, split_step = 0, split_opt = 0;
    Split parts{}, forward_parts{};
    for (int64_t s = 0; s < warmup + steps; ++s) {
      const StepTimes t = train_step(false);
      if (s < warmup) continue;
      fwd += t.forward, total += t.train, opt += t.optimizer;
    }
    model.set_profiling(true);
    for (int64_t s = 0; s < warmup + steps; ++s) {
      const StepTimes t = train_step(s + 1 == warmup + steps);
      if (s < warmup) continue;
      split_step += t.train + t.optimizer, split_opt += t.optimizer;
      for (size_t i = 0; i < parts.size(); ++i) parts[i] += t.train_parts[i], forward_parts[i] += t.forward_parts[i];
    }
    split_step /= double(steps), split_opt /= double(steps);
    fwd /= double(steps), total /= double(steps), opt /= double(steps);
    const double step = total + opt, tokens_per_step = double(batch * m.context);
    const double tflops = m.training_flops_per_token() * tokens_per_step / step / 1e12;
    size_t free_bytes = 0, total_bytes = 0;
    MOEUT_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    std::printf("loss %.4f (ce %.4f) | step %.1f ms: forward %.1f, backward %.1f, optimizer %.1f\n", loss.total(),
                loss.ce, step * 1e3, fwd * 1e3, (total - fwd) * 1e3, opt * 1e3);
    std::printf("%.0f tokens/s | %.1f TFLOP/s | MFU %.1f%% | GPU memory in use %.1f GiB\n", tokens_per_step / step,
                tflops, 100.0 * tflops / peak, double(total_bytes - free_bytes) / double(1ull << 30));
    // The split of the step: forward + backward by part (device time between changes of part),
    // then the optimizer, as shares of the profiled steps; and the forward-only pass's split.
    std::printf("step split (ms, %% of a profiled step, %.1f ms):", split_step * 1e3);
    for (size_t i = 0; i < parts.size(); ++i) {
      const double ms = parts[i] / double(steps) * 1e3;
      std::printf(" %s %.1f (%.0f%%) |", GpuModel::part_name(GpuModel::Part(i)), ms, ms / (split_step * 1e3) * 100);
    }
    std::printf(" optimizer %.1f (%.0f%%)\nforward-only pass split (ms):", split_opt * 1e3, split_opt / split_step * 100);
    for (size_t i = 0; i < forward_parts.size(); ++i)
      std::printf(" %s %.1f%s", GpuModel::part_name(GpuModel::Part(i)), forward_parts[i] / double(steps) * 1e3,
                  i + 1 < forward_parts.size() ? " |" : "\n");
    return 0;
  } catch (const cuda::OutOfMemory& e) {
    std::fprintf(stderr, "moeut-bench: error: %s: the step at --batch %lld does not fit; try a smaller --batch\n",
                 e.what(), (long long)batch);
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moeut-bench: error: %s\n", e.what());
    return 1;
  }
}
