// moeut-grad-compare: the GPU model's gradients against the CPU model's (fp32, the exact
// reference) on the same parameters and tokens, tensor by tensor: relative error, cosine, and
// the GPU's own run-to-run spread (two passes; the fp32 atomic sums add in no fixed order). The
// parameters are a weights file's (a model mid-training) or the spec's initialisation, rounded to
// bf16 so that both models compute with the same values.
#include <cuda_bf16.h>
#include <omp.h>

#include <cmath>
#include <cstdio>

#include "checkpoints/weights_file.h"
#include "core/gpu_model.h"
#include "parallel/trainer.h"
#include "launch/options.h"

namespace po = boost::program_options;

int main(int argc, char** argv) {
  using namespace moeut;
  std::string weights_path, config_path, data_path;
  int64_t batch = 1, step = 0, threads = 0;
  uint64_t seed = 1;
  po::options_description opts("moeut-grad-compare options");
  opts.add_options()("help,h", "show this help")
      ("weights", po::value(&weights_path), "HDF5 weights file (interchange format); else --config's initialisation")
      ("config", po::value(&config_path), "model configuration file, initialised with --seed (without --weights)")
      ("seed", po::value(&seed)->default_value(seed), "initialisation and batch-sampling seed")
      ("data", po::value(&data_path)->required(), "token file the batch is drawn from (docs/DATA.md)")
      ("step", po::value(&step)->default_value(step), "the training step whose batch is drawn (as moeut-train draws it)")
      ("batch", po::value(&batch)->default_value(batch), "sequences in the batch")
      ("threads", po::value(&threads)->default_value(threads), "CPU threads (0: OpenMP default)");
  try {
    if (!parse_options(argc, argv, opts)) return 0;
    if (weights_path.empty() == config_path.empty()) throw ConfigError("give exactly one of --weights and --config");
    if (batch <= 0 || step < 0 || threads < 0) throw ConfigError("batch must be positive; step and threads >= 0");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moeut-grad-compare: %s\n%s", e.what(), "run with --help for the options\n");
    return 2;
  }
  try {
    if (threads > 0) omp_set_num_threads(int(threads));
    ModelConfig cfg;
    std::vector<float> params;
    if (!weights_path.empty()) {
      Weights w = read_weights(weights_path);
      cfg = w.config;
      params = std::move(w.params);
    } else {
      cfg = load_config_file(config_path).model;
    }
    Model<float> cpu(cfg);
    if (params.empty()) {
      cpu.init(seed);
    } else {
      cpu.params = std::move(params);
    }
    for (float& p : cpu.params) p = __bfloat162float(__float2bfloat16(p));
    const TokenFiles data = open_data(data_path, "data", cfg);
    std::vector<int32_t> tokens(size_t(batch * (cfg.context + 1)));
    sample_batch(data, seed, step, 0, batch, cfg.context, tokens.data());

    const LossParts ref = cpu.forward_backward(tokens.data(), batch, 1.0);
    GpuModel gpu(cfg, batch);
    gpu.set_parameters(cpu.params);
    std::vector<float> runs[2];
    LossParts got;
    for (auto& g : runs) {
      gpu.zero_gradients();
      got = gpu.forward_backward(tokens.data(), 1.0);
      g = gpu.gradients();
    }
    std::printf("loss: CPU ce %.6f reg %.6f | GPU ce %.6f reg %.6f\n", ref.ce, ref.reg_ffn + ref.reg_att, got.ce,
                got.reg_ffn + got.reg_att);
    std::printf("%-42s %11s %9s %9s %11s\n", "tensor", "CPU norm", "rel.err", "cosine", "GPU spread");
    for (const TensorSpec& t : cpu.layout().tensors()) {
      double d = 0, n = 0, g2 = 0, dot = 0, spread = 0;
      for (int64_t i = t.offset; i < t.offset + t.numel; ++i) {
        const double c = cpu.grads[size_t(i)], a = runs[0][size_t(i)], b = runs[1][size_t(i)];
        d += (a - c) * (a - c);
        n += c * c;
        g2 += a * a;
        dot += a * c;
        spread += (a - b) * (a - b);
      }
      std::printf("%-42s %11.4e %9.2e %9.6f %11.2e\n", t.name.c_str(), std::sqrt(n), std::sqrt(d / n),
                  dot / std::sqrt(n * g2), std::sqrt(spread / n));
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moeut-grad-compare: error: %s\n", e.what());
    return 1;
  }
}
