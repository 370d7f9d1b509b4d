#include "core/expert_load.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace moeut {

const char* expert_kind_name(ExpertKind kind) {
  switch (kind) {
    case ExpertKind::kFfn: return "ffn";
    case ExpertKind::kAttentionValue: return "attention_value";
    case ExpertKind::kAttentionOutput: return "attention_output";
  }
  return "?";
}

ExpertLoadLayout::ExpertLoadLayout(const ModelConfig& c)
    : layers_(c.group_size),
      ffn_(c.ff_n_experts),
      attention_(c.n_heads * c.att_n_experts),
      ffn_k_(c.ff_k),
      attention_k_(c.n_heads * c.att_k),
      size_(c.group_size * (c.ff_n_experts + 2 * c.n_heads * c.att_n_experts)) {}

int64_t ExpertLoadLayout::experts(ExpertKind kind) const { return kind == ExpertKind::kFfn ? ffn_ : attention_; }

int64_t ExpertLoadLayout::selections_per_token(ExpertKind kind) const {
  return kind == ExpertKind::kFfn ? ffn_k_ : attention_k_;
}

int64_t ExpertLoadLayout::offset(int64_t layer, ExpertKind kind) const {
  const int64_t start = layer * (ffn_ + 2 * attention_);
  switch (kind) {
    case ExpertKind::kFfn: return start;
    case ExpertKind::kAttentionValue: return start + ffn_;
    case ExpertKind::kAttentionOutput: return start + ffn_ + attention_;
  }
  return start;
}

std::vector<ExpertLoadStats> expert_load_stats(const ExpertLoadLayout& layout, std::span<const double> load) {
  if (int64_t(load.size()) != 2 * layout.size())
    throw std::invalid_argument("expert load of " + std::to_string(load.size()) + " values, the layout holds " +
                                std::to_string(2 * layout.size()));
  std::vector<ExpertLoadStats> out;
  for (int64_t layer = 0; layer < layout.layers(); ++layer)
    for (ExpertKind kind : kExpertKinds) {
      const int64_t E = layout.experts(kind), at = layout.offset(layer, kind);
      const double* counts = load.data() + at;
      const double* weights = load.data() + layout.size() + at;
      ExpertLoadStats s{.layer = layer, .kind = kind, .experts = E};
      double weight_sum = 0, busiest = 0;
      for (int64_t e = 0; e < E; ++e) {
        s.selections += counts[e];
        weight_sum += weights[e];
        busiest = std::max(busiest, counts[e]);
        if (counts[e] == 0) ++s.dead;
      }
      if (s.selections > 0) {
        double entropy = 0;
        for (int64_t e = 0; e < E; ++e)
          if (counts[e] > 0) entropy -= counts[e] / s.selections * std::log(counts[e] / s.selections);
        s.usage_perplexity = std::exp(entropy);
        s.max_over_mean = busiest / (s.selections / double(E));
        s.mean_weight = weight_sum / s.selections;
      }
      out.push_back(s);
    }
  return out;
}

}  // namespace moeut
