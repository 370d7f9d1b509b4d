#include "core/stop_request.h"

#include <signal.h>

#include <csignal>
#include <initializer_list>

namespace moeut {
namespace {

volatile std::sig_atomic_t caught = 0;

extern "C" void record_signal(int signal) { caught = signal; }

}  // namespace

void install_stop_handlers() {
  struct sigaction action {};
  action.sa_handler = record_signal;
  sigemptyset(&action.sa_mask);
  for (int signal : {SIGTERM, SIGUSR1}) sigaction(signal, &action, nullptr);
}

int stop_signal() { return int(caught); }

}  // namespace moeut
