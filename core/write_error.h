// A write the system refused (disk full, I/O error, file size limit), and the exit status that
// moeut-train ends with after one: the run stops cleanly, with nothing it had written lost.
#pragma once
#include <stdexcept>

namespace moeut {

// what() names the file and gives the system's reason (strerror). The trainer and the
// checkpoint writer throw it on every rank together, so that no rank is left in a collective.
struct WriteError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// moeut-train's exit status after a WriteError (sysexits' EX_IOERR). A failed save leaves no
// partial checkpoint, and the checkpoints before it are whole.
constexpr int kExitWriteFailed = 74;

}  // namespace moeut
