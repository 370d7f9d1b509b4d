#include "core/hang_watchdog.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>

namespace moeut {
namespace {

using Clock = std::chrono::steady_clock;

// The wait in progress, if any: its start (0: none), and its operation and group, written under
// the mutex before the start is published.
struct Watch {
  std::atomic<bool> running{false};
  double timeout = 0;
  int rank = 0;
  std::atomic<int64_t> since{0};  // Clock ticks; 0 when no wait is in progress
  std::mutex names;
  char operation[96] = {}, group[96] = {};
};

Watch& watch() {
  static Watch w;
  return w;
}

void check_forever() {
  Watch& w = watch();
  const auto poll = std::chrono::milliseconds(std::clamp(int64_t(w.timeout * 100), int64_t(10), int64_t(1000)));
  for (;;) {
    std::this_thread::sleep_for(poll);
    const int64_t since = w.since.load();
    if (since == 0) continue;
    const double waited = std::chrono::duration<double>(Clock::now().time_since_epoch() - Clock::duration(since)).count();
    if (waited < w.timeout) continue;
    std::lock_guard<std::mutex> lock(w.names);
    if (w.since.load() != since) continue;  // that wait ended meanwhile
    std::fprintf(stderr,
                 "moeut-train: rank %d: no progress for %.0f s in %s on group '%s' (--hang_timeout %.0f s): a rank "
                 "of the group has stopped, died or fallen far behind; ending with status %d\n",
                 w.rank, waited, w.operation, w.group, w.timeout, kExitHang);
    std::fflush(stderr);
    std::fflush(stdout);
    // Not exit(): the main thread is inside a collective that never returns, and MPI's and
    // CUDA's teardown would wait on it too.
    _exit(kExitHang);
  }
}

}  // namespace

void start_hang_watchdog(double timeout_seconds, int world_rank) {
  Watch& w = watch();
  if (timeout_seconds <= 0 || w.running.exchange(true)) return;
  w.timeout = timeout_seconds;
  w.rank = world_rank;
  std::thread(check_forever).detach();
}

Waiting::Waiting(const char* operation, const std::string& group) {
  Watch& w = watch();
  outer_ = w.running.load() && w.since.load() == 0;
  if (!outer_) return;
  {
    std::lock_guard<std::mutex> lock(w.names);
    std::snprintf(w.operation, sizeof w.operation, "%s", operation);
    std::snprintf(w.group, sizeof w.group, "%s", group.c_str());
  }
  w.since.store(std::max<int64_t>(1, Clock::now().time_since_epoch().count()));
}

Waiting::~Waiting() {
  if (outer_) watch().since.store(0);
}

}  // namespace moeut
