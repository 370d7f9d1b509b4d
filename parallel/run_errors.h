// Errors that end a run on every rank together, and moeut-train's exit statuses for them
// (docs/RELIABILITY.md). A rank that meets an error the others may not see (its own part of the
// data, its own shard of the parameters) must not end alone: the others would wait for it in
// their next collective, and an MPI abort prints a banner that buries the message. The ranks
// agree instead, and one of them reports the error.
#pragma once
#include <exception>
#include <functional>
#include <span>
#include <stdexcept>
#include <string>

#include "parallel/communicator.h"

namespace moeut {

// moeut-train's exit statuses besides 0, 1 (any other error) and kExitStopped (core/stop_request.h).
inline constexpr int kExitConfig = 2;      // the configuration, or a path or resource it asks for, is refused
inline constexpr int kExitNonFinite = 3;   // the loss, a gradient or the updated parameters are not finite
inline constexpr int kExitDataError = 65;  // a token file is malformed (sysexits' EX_DATAERR)

// Thrown by an optimizer's step() on every rank together when its update left a parameter that
// is not finite (nothing has been saved from that state).
struct NonFiniteUpdate : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Thrown on every rank together; `report` on exactly one of them, which prints what() once.
struct AgreedError : std::runtime_error {
  AgreedError(const std::string& what, int status, bool report)
      : std::runtime_error(what), status(status), report(report) {}
  int status;  // moeut-train's exit status
  bool report;
};

// The exit status for an error: kExitConfig for ConfigError, kExitDataError for DataError, 1
// for any other.
int exit_status(const std::exception& e);

// status_by_rank: world.size() entries, already summed over the ranks, each rank's exit status
// for the error it met (0: none). Returns when every entry is 0; otherwise every rank throws
// AgreedError with the status of the lowest failing rank, which reports its `error` (naming its
// rank when not every rank failed).
void end_together(std::span<const double> status_by_rank, const Communicator& world, const std::string& error);

// Runs `local` (no collectives in it) on every rank of world, then agrees on the outcome
// (one all-reduce): an exception anywhere ends every rank through end_together.
void agree_on(Communicator& world, const std::function<void()>& local);

}  // namespace moeut
