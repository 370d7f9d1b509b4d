// The model's parameters as named tensors in one contiguous buffer, with the names, shapes and
// element order of the official implementation's state dict (../shared/spec/MOEUT.md,
// "Interchange names"). Replicated tensors come first, expert tensors (FFN keys and values)
// last, so each class is one contiguous range.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/config.h"

namespace moeut {

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = 0;  // in elements, into the parameter buffer
  int64_t numel = 0;
  bool expert = false;  // FFN expert weights: sharded by expert in expert parallelism
};

class ParamLayout {
 public:
  explicit ParamLayout(const ModelConfig& m);
  const std::vector<TensorSpec>& tensors() const { return tensors_; }
  const TensorSpec& at(const std::string& name) const;  // throws std::out_of_range
  int64_t total() const { return total_; }

 private:
  std::vector<TensorSpec> tensors_;
  int64_t total_ = 0;
};

std::string layer_prefix(int64_t g);  // "transformer.layers.{g}."

}  // namespace moeut
