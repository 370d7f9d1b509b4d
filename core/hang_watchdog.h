// A rank that makes no progress: a thread that ends the process when one wait (a collective, or
// the device's work with its collectives) has lasted longer than a timeout, naming the rank, the
// group and the operation, so that a stopped or dead peer ends the job with a message and a
// status of its own (kExitHang) instead of leaving every other rank spinning forever. The waits
// mark themselves with a Waiting scope; nothing is checked while no watchdog runs.
#pragma once
#include <string>

namespace moeut {

inline constexpr int kExitHang = 4;  // moeut-train's status when a wait outlasts --hang_timeout

// Starts the watchdog thread of this process (once; later calls change nothing). A timeout of 0
// leaves it off.
void start_hang_watchdog(double timeout_seconds, int world_rank);

// Marks the calling thread as waiting in `operation` on `group` while it lives. Waits do not
// nest: the outermost scope is the one named and timed.
class Waiting {
 public:
  Waiting(const char* operation, const std::string& group);
  ~Waiting();
  Waiting(const Waiting&) = delete;
  Waiting& operator=(const Waiting&) = delete;

 private:
  bool outer_;
};

}  // namespace moeut
