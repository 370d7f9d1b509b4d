// The model's parameters as named tensors in one contiguous buffer, with the names, shapes and
// element order of the official implementation's state dict (docs/MODEL.md,
// "Interchange names"). Replicated tensors come first, expert tensors (FFN keys and values)
// last, so each class is one contiguous range.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
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

// The FFN experts [begin, begin + count) of every physical layer that one process holds.
struct ExpertShard {
  int64_t begin = 0, count = 0;
};
// Contiguous split of n_experts over `ranks`; the first n_experts % ranks ranks hold one more
// (565 over 8: five ranks of 71, three of 70).
ExpertShard expert_shard(int64_t n_experts, int64_t ranks, int64_t rank);

class ParamLayout {
 public:
  explicit ParamLayout(const ModelConfig& m);  // every expert
  ParamLayout(const ModelConfig& m, ExpertShard shard);  // expert tensors hold only the shard
  const std::vector<TensorSpec>& tensors() const& { return tensors_; }
  void tensors() && = delete;  // a temporary layout would leave the reference dangling
  const TensorSpec& at(const std::string& name) const;  // throws std::out_of_range
  int64_t total() const { return total_; }
  int64_t replicated() const { return replicated_; }  // elements before the first expert tensor
  const ExpertShard& shard() const { return shard_; }
  int64_t physical_layers() const { return physical_layers_; }
  // Physical layer g's FFN expert tensors, its keys then its values, adjacent: elements
  // [first, second). The layers' ranges follow each other from replicated() to total().
  std::pair<int64_t, int64_t> expert_range(int64_t g) const;

 private:
  std::vector<TensorSpec> tensors_;
  int64_t total_ = 0, replicated_ = 0, physical_layers_ = 0;
  ExpertShard shard_;
};

std::string layer_prefix(int64_t g);  // "transformer.layers.{g}."

}  // namespace moeut
