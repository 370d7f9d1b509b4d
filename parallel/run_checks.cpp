#include "parallel/run_checks.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>

#include "core/model.h"
#include "core/output_paths.h"

namespace moeut {
namespace {

// A number from a /proc or /sys file: the value after `key` ("" for the whole file), in the
// file's unit times `unit`; infinity when the file, the key or a number is missing (no limit).
double read_quantity(const char* path, const std::string& key, double unit) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.compare(0, key.size(), key) != 0) continue;
    std::istringstream rest(line.substr(key.size()));
    double value = 0;
    if (rest >> value) return value * unit;
  }
  return std::numeric_limits<double>::infinity();
}

// Bytes this process can still allocate without swapping: the machine's available memory, or
// less under a control group's limit.
double available_bytes() {
  const double machine = read_quantity("/proc/meminfo", "MemAvailable:", 1024);
  const double limit = read_quantity("/sys/fs/cgroup/memory.max", "", 1);
  const double used = read_quantity("/sys/fs/cgroup/memory.current", "", 1);
  return std::min(machine, std::isfinite(limit) && std::isfinite(used) ? limit - used : machine);
}

std::string gib(double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3g GiB", bytes / double(int64_t(1) << 30));
  return text;
}

}  // namespace

void check_outputs(const TrainConfig& t, bool leader) {
  if (leader) {
    if (t.writes_weights()) check_output_file("out_weights", t.out_weights);
    check_output_file("metrics", t.metrics);
  }
  if (!t.checkpoint_dir.empty()) check_output_directory("checkpoint_dir", t.checkpoint_dir);
}

void check_host_memory(const Config& c, const ProcessGroups& groups) {
  const ModelConfig& m = c.model;
  const int64_t experts = expert_shard(m.ff_n_experts, groups.ep(), groups.expert_parallel->rank()).count;
  const ModelBytes model = model_bytes(m, experts, c.train.micro_batch_size);
  // ShardedAdamW keeps three fp32 values (gradient, two moments) per owned element: the
  // parameters' bytes (values and gradients) times 3/2, shared over the world.
  const double optimizer = 1.5 * model.parameters / double(groups.world->size());
  const double need = model.parameters + optimizer + model.activations, have = available_bytes();
  if (need <= have) return;
  throw ConfigError(
      "invalid configuration: memory: a CPU rank of this model needs about " + gib(need) + " (parameters and "
      "gradients " + gib(model.parameters) + ", optimizer state " + gib(optimizer) + ", activations of micro_batch_size " +
      std::to_string(c.train.micro_batch_size) + " sequences of " + std::to_string(m.context) + " tokens " +
      gib(model.activations) + ") but " + gib(have) + " is available; lower micro_batch_size (a step accumulates "
      "micro-batches up to batch_size) or context, choose a smaller model (d_model, n_layers, ff_n_experts), or "
      "spread the experts over more ranks with --ep");
}

std::string non_finite_tensors(const ParamLayout& layout, std::span<const double> values) {
  constexpr size_t kNamed = 4;
  std::string names;
  size_t count = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    if (std::isfinite(values[i])) continue;
    if (++count <= kNamed) names += (count > 1 ? ", " : "") + layout.tensors()[i].name;
  }
  if (count > kNamed) names += " and " + std::to_string(count - kNamed) + " more";
  return names + " (" + std::to_string(count) + " of " + std::to_string(values.size()) + " tensors)";
}

}  // namespace moeut
