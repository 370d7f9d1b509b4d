// moeut-train: trains a MoEUT profile, in one process or over MPI ranks
// (mpirun -np N moeut-train --ep E ...), with sharded checkpoints to resume from, and writes the
// interchange weights file.
#include <mpi.h>

#include <cstdio>
#include <exception>

#include "checkpoints/checkpoint.h"
#include "checkpoints/weights_file.h"
#include "core/hang_watchdog.h"
#include "core/stop_request.h"
#include "core/write_error.h"
#include "parallel/mpi_communicator.h"
#include "parallel/run_errors.h"
#include "parallel/trainer.h"

int main(int argc, char** argv) {
  using namespace moeut;
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int status = 0;
  try {
    Config config;
    if (parse_train_args(argc, argv, config)) {
      const ProcessGroups groups = mpi_process_groups(MPI_COMM_WORLD, int(config.train.ep));
      install_stop_handlers();
      start_hang_watchdog(config.train.hang_timeout, rank);
      Trainer trainer(config, groups);
      setup_checkpoints(trainer);
      trainer.run();
      if (trainer.stopping()) {
        // Stopped early: the checkpoint (if any) holds the state; no weights file is written.
        if (rank == 0 && config.train.checkpoint_dir.empty())
          std::printf("no checkpoint_dir: nothing of this run was saved\n");
        status = kExitStopped;
      } else if (!config.train.writes_weights()) {
        if (rank == 0) std::printf("no weights file written (out_weights none)\n");
      } else {
        const std::vector<float> params = trainer.full_parameters();
        if (rank == 0) {
          write_weights(config.train.out_weights, config.model, params.data());
          std::printf("weights written to %s\n", config.train.out_weights.c_str());
        }
      }
    }
  } catch (const AgreedError& e) {
    // Every rank throws it together, and one of them reports it (parallel/run_errors.h): a data
    // error, a refused path or resource, a non-finite loss, gradient or update.
    if (e.report) std::fprintf(stderr, "moeut-train: %s\n", e.what());
    status = e.status;
  } catch (const ConfigError& e) {
    // Every rank reads the same configuration and refuses it alike, before any collective.
    if (rank == 0) std::fprintf(stderr, "moeut-train: %s\n", e.what());
    status = kExitConfig;
  } catch (const WriteError& e) {
    // Every rank throws it together (a save, the metrics), or rank 0 alone after the last
    // collective (the weights file).
    if (rank == 0) std::fprintf(stderr, "moeut-train: write failed: %s\n", e.what());
    status = kExitWriteFailed;
  } catch (const CheckpointError& e) {
    // Every rank throws it together, with the same message (checkpoint.h).
    if (rank == 0) std::fprintf(stderr, "moeut-train: checkpoint: %s\n", e.what());
    status = 1;
  } catch (const std::invalid_argument& e) {  // a layout that cannot be built, e.g. --ep
    if (rank == 0) std::fprintf(stderr, "moeut-train: invalid configuration: %s\n", e.what());
    status = kExitConfig;
  } catch (const std::exception& e) {
    // Possibly this rank alone: the others may be waiting in a collective, so stop them all.
    std::fprintf(stderr, "moeut-train: rank %d: error: %s\n", rank, e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
  return status;
}
