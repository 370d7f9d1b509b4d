// moeut-train: trains a MoEUT profile on the CPU and writes the interchange weights file.
#include <cstdio>
#include <exception>

#include "checkpoints/weights_file.h"
#include "core/trainer.h"

int main(int argc, char** argv) {
  using namespace moeut;
  try {
    Config config;
    if (!parse_train_args(argc, argv, config)) return 0;
    Trainer trainer(config);
    trainer.run();
    write_weights(config.train.out_weights, config.model, trainer.model().params.data());
    std::printf("weights written to %s\n", config.train.out_weights.c_str());
    return 0;
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "moeut-train: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moeut-train: error: %s\n", e.what());
    return 1;
  }
}
