#include "parallel/run_errors.h"

#include <algorithm>
#include <vector>

#include "core/config.h"
#include "core/token_file.h"

namespace moeut {

int exit_status(const std::exception& e) {
  if (dynamic_cast<const ConfigError*>(&e)) return kExitConfig;
  if (dynamic_cast<const DataError*>(&e)) return kExitDataError;
  return 1;
}

void end_together(std::span<const double> status_by_rank, const Communicator& world, const std::string& error) {
  const auto first = std::find_if(status_by_rank.begin(), status_by_rank.end(), [](double s) { return s != 0; });
  if (first == status_by_rank.end()) return;
  const int reporter = int(first - status_by_rank.begin());
  const bool all = std::none_of(status_by_rank.begin(), status_by_rank.end(), [](double s) { return s == 0; });
  const bool report = world.rank() == reporter;
  std::string what = "an error on rank " + std::to_string(reporter);
  if (report) what = (all ? "" : "rank " + std::to_string(reporter) + ": ") + error;
  throw AgreedError(what, int(*first), report);
}

void agree_on(Communicator& world, const std::function<void()>& local) {
  std::string error;
  std::vector<double> status(size_t(world.size()), 0.0);
  try {
    local();
  } catch (const std::exception& e) {
    error = e.what();
    status[size_t(world.rank())] = exit_status(e);
  }
  world.all_reduce_sum(std::span<double>(status));
  end_together(status, world, error);
}

}  // namespace moeut
