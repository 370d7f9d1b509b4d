// Sharded checkpoints (docs/CHECKPOINTS.md): every rank writes what it owns in the ZeRO
// partition as boxes of the logical tensors, rank 0 adds the manifest, and the step directory
// appears by one rename when all of it is on disk. Any layout reads any checkpoint back.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "checkpoints/checkpoint_dir.h"
#include "checkpoints/manifest.h"
#include "parallel/trainer.h"
#include "parallel/training_backend.h"

namespace moeut {

// A checkpoint that cannot be saved or loaded; what() names the file and the problem. The
// collective functions below throw it on every rank together, with the message of the lowest
// failing rank, so that no rank is left waiting in a collective.
struct CheckpointError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct SaveReport {
  std::string directory;
  int64_t step = 0;
  int64_t files = 0, bytes = 0;  // rank files and manifest
  double seconds = 0;            // from the save's start until the checkpoint was whole
  double stall_seconds = 0;      // of those, the time training waited for it
};

// Saves with the rank files written beside training. start() takes the backend's state after
// `step` steps off the device (the only part the step waits for) and writes this rank's file on
// a thread of its own; finish() waits for every rank's file, rank 0 adds the manifest, the step
// directory appears by one rename, and the oldest checkpoints beyond `keep` (0: none) go. One
// save at a time: start() finishes the one before. A step directory that exists is refused: a
// checkpoint is never overwritten. Both are collective over groups.world. A save that fails to
// be written on any rank (disk full, I/O error) throws WriteError (core/write_error.h) on every
// rank, with the path and the system's reason, after rank 0 removed its .tmp directory.
class CheckpointWriter {
 public:
  CheckpointWriter(std::string checkpoint_dir, int64_t keep, const Config& c, const ProcessGroups& groups,
                   TrainingBackend& backend);
  // A save still being written is left unfinished (its hidden .tmp directory stays, and the
  // checkpoint before it is whole).
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;
  // Returns the report of the save it finished first, if there was one.
  std::optional<SaveReport> start(int64_t step);
  std::optional<SaveReport> finish();  // the pending save's report; none when nothing is pending
  double copy_seconds() const { return copy_seconds_; }  // the last start()'s wait for the state

 private:
  struct Pending;
  void agree_or_discard(const Pending& p, const std::function<void()>& local);
  std::string dir_;
  int64_t keep_;
  const Config& config_;
  const ProcessGroups& groups_;
  TrainingBackend& backend_;
  std::unique_ptr<Pending> pending_;
  double copy_seconds_ = 0;
};

// One save, whole before it returns (start() and finish() of a CheckpointWriter).
SaveReport save_checkpoint(const std::string& checkpoint_dir, int64_t step, int64_t keep, const Config& c,
                           const ProcessGroups& groups, TrainingBackend& backend);

// Loads the checkpoint in step directory `dir`, saved by any layout, into the backend (whose
// model must be c.model); returns its manifest. Refuses a directory that is not a checkpoint,
// another model, and missing, truncated or corrupt rank files before the backend is touched.
// Collective over groups.world.
Manifest load_checkpoint(const std::string& dir, const Config& c, const ProcessGroups& groups,
                         TrainingBackend& backend);

// Sets the backend's parameters (each rank its expert shard) from the interchange weights file
// `path` (checkpoints/weights_file.h), with fresh optimizer state: --init_weights. Refuses, on
// every rank together (AgreedError with kExitConfig), a file that cannot be read or whose model
// differs from c.model, naming the option, the file and the first differing attribute.
// Collective over groups.world.
void load_initial_weights(const std::string& path, const Config& c, const ProcessGroups& groups,
                          TrainingBackend& backend);

// The parameters (fp32 master values) of the checkpoint in `dir`, in ParamLayout(model) order,
// with their checksums verified: what moeut-export writes as an interchange file.
struct CheckpointWeights {
  ModelConfig model;
  int64_t step = 0;
  std::vector<float> params;
};
CheckpointWeights read_checkpoint_weights(const std::string& dir);

// Wires checkpoints into a trainer from its configuration: resumes from train.resume, or starts
// from train.init_weights when no checkpoint was resumed (every refusal happens here, before
// any step) and saves into train.checkpoint_dir every
// checkpoint_every steps and after the last step. Rank 0 logs what it loads and saves.
// Collective over the trainer's world group.
void setup_checkpoints(Trainer& trainer);

}  // namespace moeut
