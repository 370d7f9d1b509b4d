// What a run checks before its first step (besides the configuration's own rules, core/config.h)
// and how it names the tensors a non-finite value was found in.
#pragma once
#include <span>
#include <string>

#include "core/config.h"
#include "core/params.h"
#include "parallel/communicator.h"

namespace moeut {

// The files and directories the run will write (core/output_paths.h): out_weights and metrics,
// which the leader writes, and checkpoint_dir, which every rank writes into.
void check_outputs(const TrainConfig& t, bool leader);

// A CPU rank's model, gradients, optimizer shard and activations must fit the memory the machine
// (or the process's control group) has available: ConfigError saying what to lower otherwise.
void check_host_memory(const Config& c, const ProcessGroups& groups);

// The tensors of `layout` whose entry of `values` (one per tensor) is not finite, in layout
// order, for a message: the first few names and how many there are in all.
std::string non_finite_tensors(const ParamLayout& layout, std::span<const double> values);

}  // namespace moeut
