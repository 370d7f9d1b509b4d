// Sharded checkpoints (docs/CHECKPOINTS.md): every rank writes what it owns in the ZeRO
// partition as boxes of the logical tensors, rank 0 adds the manifest, and the step directory
// appears by one rename when all of it is on disk. Any layout reads any checkpoint back.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "checkpoints/manifest.h"
#include "core/trainer.h"
#include "core/training_backend.h"

namespace moeut {

// A checkpoint that cannot be saved or loaded; what() names the file and the problem. The
// collective functions below throw it on every rank together, with the message of the lowest
// failing rank, so that no rank is left waiting in a collective.
struct CheckpointError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::string step_directory(const std::string& checkpoint_dir, int64_t step);  // <dir>/step_<NNNNNNNN>
// The complete checkpoint of the highest step in checkpoint_dir, "" when there is none.
// Directories being written or deleted (.step_<N>.tmp, .step_<N>.deleting) do not count.
std::string latest_checkpoint(const std::string& checkpoint_dir);

struct SaveReport {
  std::string directory;
  int64_t files = 0, bytes = 0;  // rank files and manifest
  double seconds = 0;
};

// Saves the backend's state after `step` steps into step_directory(checkpoint_dir, step), then
// deletes the oldest checkpoints beyond `keep` (0: none). Refuses a step directory that exists:
// a checkpoint is never overwritten. Collective over groups.world.
SaveReport save_checkpoint(const std::string& checkpoint_dir, int64_t step, int64_t keep, const Config& c,
                           const ProcessGroups& groups, TrainingBackend& backend);

// Loads the checkpoint in step directory `dir`, saved by any layout, into the backend (whose
// model must be c.model); returns its manifest. Refuses a directory that is not a checkpoint,
// another model, and missing, truncated or corrupt rank files before the backend is touched.
// Collective over groups.world.
Manifest load_checkpoint(const std::string& dir, const Config& c, const ProcessGroups& groups,
                         TrainingBackend& backend);

// The parameters (fp32 master values) of the checkpoint in `dir`, in ParamLayout(model) order,
// with their checksums verified: what moeut-export writes as an interchange file.
struct CheckpointWeights {
  ModelConfig model;
  int64_t step = 0;
  std::vector<float> params;
};
CheckpointWeights read_checkpoint_weights(const std::string& dir);

// Wires checkpoints into a trainer from its configuration: resumes from train.resume (every
// refusal happens here, before any step) and saves into train.checkpoint_dir every
// checkpoint_every steps and after the last step. Rank 0 logs what it loads and saves.
// Collective over the trainer's world group.
void setup_checkpoints(Trainer& trainer);

}  // namespace moeut
