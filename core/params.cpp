#include "core/params.h"

#include <algorithm>
#include <stdexcept>

namespace moeut {

std::string layer_prefix(int64_t g) { return "transformer.layers." + std::to_string(g) + "."; }

ExpertShard expert_shard(int64_t n_experts, int64_t ranks, int64_t rank) {
  const int64_t base = n_experts / ranks, extra = n_experts % ranks;
  return {rank * base + std::min(rank, extra), base + (rank < extra ? 1 : 0)};
}

ParamLayout::ParamLayout(const ModelConfig& m) : ParamLayout(m, expert_shard(m.ff_n_experts, 1, 0)) {}

ParamLayout::ParamLayout(const ModelConfig& m, ExpertShard shard) : shard_(shard), physical_layers_(m.group_size) {
  const int64_t d = m.d_model, V = m.n_tokens, hd = m.n_heads * m.d_head;
  const int64_t he = m.n_heads * m.att_n_experts, E = m.ff_n_experts, es = m.ff_expert_size;
  auto add = [&](std::string name, std::vector<int64_t> shape, bool expert = false) {
    TensorSpec t{std::move(name), std::move(shape), 0, 1, expert};
    for (int64_t s : t.shape) t.numel *= s;
    tensors_.push_back(std::move(t));
  };
  add("embedding.weight", {V, d});
  for (int64_t g = 0; g < m.group_size; ++g) {
    const std::string p = layer_prefix(g);
    add(p + "ln1.weight", {d});
    add(p + "ln1.bias", {d});
    add(p + "ln2.weight", {d});
    add(p + "ln2.bias", {d});
    // The four products that read LN1's output, adjacent: the GPU path takes their weight
    // gradient as one product.
    add(p + "attention.q.weight", {hd, d});
    add(p + "attention.k.weight", {hd, d});
    add(p + "attention.sel_v", {he, d});
    add(p + "attention.sel_o", {he, d});
    add(p + "attention.v", {he, d, m.d_head});
    add(p + "attention.o", {he, m.d_head, d});
    add(p + "ffn.expert_sel", {E, d});
  }
  add("out_norm.weight", {d});
  add("out_norm.bias", {d});
  add("lm_head.weight", {V, d});
  add("lm_head.bias", {V});
  for (int64_t g = 0; g < m.group_size; ++g) {
    add(layer_prefix(g) + "ffn.keys", {shard.count, d, es}, true);
    add(layer_prefix(g) + "ffn.values", {shard.count, es, d}, true);
  }
  for (auto& t : tensors_) {
    t.offset = total_;
    total_ += t.numel;
    if (!t.expert) replicated_ = total_;
  }
}

std::pair<int64_t, int64_t> ParamLayout::expert_range(int64_t g) const {
  const TensorSpec& values = at(layer_prefix(g) + "ffn.values");
  return {at(layer_prefix(g) + "ffn.keys").offset, values.offset + values.numel};
}

const TensorSpec& ParamLayout::at(const std::string& name) const {
  for (const auto& t : tensors_)
    if (t.name == name) return t;
  throw std::out_of_range("no parameter named '" + name + "'");
}

}  // namespace moeut
