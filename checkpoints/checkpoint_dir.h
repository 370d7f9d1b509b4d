// The checkpoint directory (docs/CHECKPOINTS.md): the names in it, the lock of the run that
// saves there, and the housekeeping of what killed saves and deletions leave behind.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace moeut {

std::string step_directory(const std::string& checkpoint_dir, int64_t step);  // <dir>/step_<NNNNNNNN>
// The complete checkpoints of checkpoint_dir by step: step_<digits> directories that hold a
// manifest. Directories being written or deleted (.step_<N>.tmp, .step_<N>.deleting) do not count.
std::map<int64_t, std::filesystem::path> complete_checkpoints(const std::string& checkpoint_dir);
// The complete checkpoint of the highest step in checkpoint_dir, "" when there is none.
std::string latest_checkpoint(const std::string& checkpoint_dir);

// Beside a step directory, a name that no reader takes for a checkpoint: .step_<N>.<what>
std::filesystem::path hidden(const std::filesystem::path& step_dir, const char* what);
// Deletes a checkpoint: renamed to .step_<N>.deleting first, so that a kill while deleting never
// leaves a partial step_<N> directory that looks complete.
void discard_checkpoint(const std::filesystem::path& step_dir);
// Removes the .step_<N>.tmp and .step_<N>.deleting directories of checkpoint_dir (what killed or
// failed saves and deletions leave); returns their paths. Only for the holder of its lock.
std::vector<std::string> remove_stale_directories(const std::string& checkpoint_dir);

// The lock of a checkpoint directory, held by the run that saves there: the file <dir>/.lock
// holds "<host> <pid>". A lock left by a process of this host that is gone is taken over (told
// to `note`); one of a live process, or of another host, is refused with a message naming both.
// The destructor removes the file.
class CheckpointLock {
 public:
  CheckpointLock(const std::string& checkpoint_dir, const std::function<void(const std::string&)>& note);
  ~CheckpointLock();
  CheckpointLock(const CheckpointLock&) = delete;
  CheckpointLock& operator=(const CheckpointLock&) = delete;
  static const char* file_name() { return ".lock"; }

 private:
  std::string path_, owner_;
};

}  // namespace moeut
