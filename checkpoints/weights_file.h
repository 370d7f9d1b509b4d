// Consolidated weights in the interchange format of docs/MODEL.md: one HDF5 file, one
// fp32 dataset per parameter under the official state-dict name and shape, and the model
// configuration as root attributes named like the official constructor's arguments.
#pragma once
#include <stdexcept>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/params.h"

namespace moeut {

// A missing, unreadable or mismatching weights file; what() names the file and the problem.
struct WeightsError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Written to a temporary name and renamed into place, so an interrupted write never leaves a
// partial file under `path`. Throws WriteError (core/write_error.h) when it cannot be written,
// after removing the temporary file.
void write_weights(const std::string& path, const ModelConfig& m, const float* params);

struct Weights {
  ModelConfig config;          // context keeps its default: it is not part of the format
  std::vector<float> params;   // in ParamLayout(config) order
};
// Refuses (WeightsError naming the dataset) datasets that are not 32-bit floats, that hold a
// non-finite value, or that are reached through a soft or external link or keep their data in
// other files (external storage, virtual datasets).
Weights read_weights(const std::string& path);

}  // namespace moeut
