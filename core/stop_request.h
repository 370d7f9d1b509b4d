// A request to stop training early: SIGTERM or SIGUSR1 (what a scheduler sends before it ends or
// preempts a job; SLURM's --signal), caught by a handler that only records the signal. The
// trainer reads it once a step and, with every rank agreeing, finishes the step, saves a
// checkpoint and returns (moeut-train then exits with kExitStopped).
#pragma once

namespace moeut {

// moeut-train's exit status after an early stop that saved what it had (the sysexits
// "temporary failure" code: a job script may requeue and resume with --resume auto).
constexpr int kExitStopped = 75;

void install_stop_handlers();  // SIGTERM and SIGUSR1
int stop_signal();             // the signal caught so far, 0 when none

}  // namespace moeut
