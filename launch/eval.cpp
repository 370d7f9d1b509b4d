// moeut-eval: mean cross-entropy and perplexity of an interchange weights file on a token file.
#include <omp.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "checkpoints/weights_file.h"
#include "core/write_error.h"
#include "parallel/run_errors.h"
#include "parallel/trainer.h"
#include "launch/options.h"

namespace po = boost::program_options;

namespace {

// The logits of the file's first window as a NumPy .npy file: little-endian float32
// [context, n_tokens] (what launch/dev/torch-check.sh compares with the official model's).
void dump_logits(const std::string& path, moeut::Model<float>& model, const moeut::TokenFiles& data,
                 int64_t context) {
  std::vector<int32_t> window(size_t(context + 1));
  data.read(0, window);
  const std::vector<float> logits = model.logits(window.data(), 1);
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + std::to_string(context) + ", " +
                       std::to_string(model.config().n_tokens) + "), }";
  header.append(63 - (10 + header.size()) % 64, ' ').push_back('\n');  // the data starts 64-byte aligned
  std::ofstream out(path, std::ios::binary);
  const uint16_t header_len = uint16_t(header.size());
  out.write("\x93NUMPY\x01\x00", 8).write(reinterpret_cast<const char*>(&header_len), 2).write(header.data(),
                                                                                             std::streamsize(header.size()));
  out.write(reinterpret_cast<const char*>(logits.data()), std::streamsize(logits.size() * sizeof(float)));
  out.close();
  if (!out) throw moeut::WriteError(path + ": cannot write the logits");
}

}  // namespace

int main(int argc, char** argv) {
  using namespace moeut;
  std::string weights_path, data_path, logits_path;
  int64_t context = 1024, batch = 8, max_windows = 0, threads = 0;
  po::options_description opts("moeut-eval options");
  opts.add_options()("help,h", "show this help")
      ("weights", po::value(&weights_path)->required(), "HDF5 weights file (interchange format)")
      ("data", po::value(&data_path)->required(), "token file (docs/DATA.md)")
      ("context", po::value(&context)->default_value(context), "window length T")
      ("micro_batch_size", po::value(&batch)->default_value(batch), "windows per forward pass")
      ("max_windows", po::value(&max_windows)->default_value(max_windows), "evaluate at most this many windows (0: all)")
      ("threads", po::value(&threads)->default_value(threads), "CPU threads (0: OpenMP default)")
      ("dump_logits", po::value(&logits_path), "also write the first window's logits [context, n_tokens] as .npy");
  try {
    if (!parse_options(argc, argv, opts)) return 0;
    if (context <= 0 || batch <= 0 || max_windows < 0 || threads < 0)
      throw ConfigError("context and micro_batch_size must be positive; max_windows and threads >= 0");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moeut-eval: %s\n%s", e.what(), "run with --help for the options\n");
    return kExitConfig;
  }
  try {
    if (threads > 0) omp_set_num_threads(int(threads));
    Weights w = read_weights(weights_path);
    w.config.context = context;
    Model<float> model(w.config);
    model.params = std::move(w.params);
    const TokenFiles data = open_data(data_path, "data", w.config);
    SelfCommunicator world("world");
    const double loss = evaluate([&](const int32_t* tokens, int64_t B) { return model.forward_ce_sum(tokens, B); },
                                 context, data, batch, max_windows, world);
    if (!logits_path.empty()) dump_logits(logits_path, model, data, context);
    std::printf("eval %s on %s | context %lld | loss %.6f | ppl %.2f\n", weights_path.c_str(), data_path.c_str(),
                (long long)context, loss, std::exp(loss));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moeut-eval: error: %s\n", e.what());
    return 1;
  }
}
