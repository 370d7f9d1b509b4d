// Typed pointers to every parameter in a buffer of the layout (core/params.h), looked up by name
// once: the working weights (bf16) or the gradients (fp32) of the GPU model.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/params.h"

namespace moeut {

// One physical layer's parameters.
template <typename T>
struct LayerTensors {
  T *ln1_weight, *ln1_bias, *ln2_weight, *ln2_bias;
  T *q, *k, *sel_v, *sel_o;       // attention q, k and its value and output routers
  T *v, *o;                       // the attention's value and output experts
  T *expert_sel, *keys, *values;  // the FFN's router and its experts (the layout's shard of them)
};

template <typename T>
struct ModelTensors {
  T *embedding, *out_norm_weight, *out_norm_bias, *lm_head_weight, *lm_head_bias;
  std::vector<LayerTensors<T>> layers;  // per physical layer
};

// The parameters of `layout` (of group_size physical layers) in `buffer`.
template <typename T>
ModelTensors<T> tensors_in(T* buffer, const ParamLayout& layout, int64_t group_size) {
  auto at = [&](const std::string& name) { return buffer + layout.at(name).offset; };
  ModelTensors<T> t{.embedding = at("embedding.weight"),
                    .out_norm_weight = at("out_norm.weight"),
                    .out_norm_bias = at("out_norm.bias"),
                    .lm_head_weight = at("lm_head.weight"),
                    .lm_head_bias = at("lm_head.bias"),
                    .layers = {}};
  for (int64_t g = 0; g < group_size; ++g) {
    const std::string p = layer_prefix(g);
    t.layers.push_back({.ln1_weight = at(p + "ln1.weight"),
                        .ln1_bias = at(p + "ln1.bias"),
                        .ln2_weight = at(p + "ln2.weight"),
                        .ln2_bias = at(p + "ln2.bias"),
                        .q = at(p + "attention.q.weight"),
                        .k = at(p + "attention.k.weight"),
                        .sel_v = at(p + "attention.sel_v"),
                        .sel_o = at(p + "attention.sel_o"),
                        .v = at(p + "attention.v"),
                        .o = at(p + "attention.o"),
                        .expert_sel = at(p + "ffn.expert_sel"),
                        .keys = at(p + "ffn.keys"),
                        .values = at(p + "ffn.values")});
  }
  return t;
}

}  // namespace moeut
