// moeut-export: a sharded checkpoint directory (saved by any number of ranks) to the
// consolidated interchange weights file that moeut-eval and the official code read.
#include <cstdio>

#include "checkpoints/checkpoint.h"
#include "checkpoints/weights_file.h"
#include "launch/options.h"
#include "parallel/run_errors.h"

namespace po = boost::program_options;

int main(int argc, char** argv) {
  using namespace moeut;
  std::string checkpoint, out;
  po::options_description opts("moeut-export options");
  opts.add_options()("help,h", "show this help")
      ("checkpoint", po::value(&checkpoint)->required(), "checkpoint step directory (<checkpoint_dir>/step_<N>)")
      ("out", po::value(&out)->required(), "HDF5 weights file to write (interchange format)");
  try {
    if (!parse_options(argc, argv, opts)) return 0;
  } catch (const po::error& e) {
    std::fprintf(stderr, "moeut-export: %s\nrun with --help for the options\n", e.what());
    return kExitConfig;
  }
  try {
    const CheckpointWeights w = read_checkpoint_weights(checkpoint);
    write_weights(out, w.model, w.params.data());
    std::printf("exported %s (step %lld, %zu parameters) to %s\n", checkpoint.c_str(), (long long)w.step,
                w.params.size(), out.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moeut-export: error: %s\n", e.what());
    return 1;
  }
}
