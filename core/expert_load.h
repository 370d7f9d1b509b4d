// Which experts the routers chose, counted over the steps since the last report: per physical
// layer (over all its uses), for the FFN experts and the attention's value and output experts.
// Counts and routing-weight sums lie in one flat buffer (ExpertLoadLayout), so ranks add theirs
// with one collective and a device can count into the same layout.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/config.h"

namespace moeut {

enum class ExpertKind { kFfn, kAttentionValue, kAttentionOutput };
inline constexpr ExpertKind kExpertKinds[] = {ExpertKind::kFfn, ExpertKind::kAttentionValue,
                                              ExpertKind::kAttentionOutput};
const char* expert_kind_name(ExpertKind kind);  // "ffn", "attention_value", "attention_output"

// The buffer: per physical layer, per kind, one count per expert; then the routing-weight sums
// in the same order (at size() onwards).
class ExpertLoadLayout {
 public:
  explicit ExpertLoadLayout(const ModelConfig& c);
  // Experts of a kind: Ef for the FFN; n_heads · att_n_experts for the attention's (each head
  // routes among its own att_n_experts).
  int64_t experts(ExpertKind kind) const;
  int64_t selections_per_token(ExpertKind kind) const;  // ff_k, or n_heads · att_k
  int64_t offset(int64_t layer, ExpertKind kind) const;  // of this layer's counts
  int64_t size() const { return size_; }  // counts; the buffer holds twice as many values
  int64_t layers() const { return layers_; }

 private:
  int64_t layers_, ffn_, attention_, ffn_k_, attention_k_, size_;
};

// Adds n tokens' selections to `counts` and their routing weights to `weight_sums` (both at a
// layer and kind's offset): index[(t · groups + g) · k + j] is an expert of group g, numbered
// within it (the attention's groups are its heads), so it counts as g · experts_per_group + index.
template <typename W>
void count_selections(double* counts, double* weight_sums, const int32_t* index, const W* weight, int64_t n,
                      int64_t groups, int64_t experts_per_group, int64_t k) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t j = 0; j < k; ++j) {
        const int64_t s = (t * groups + g) * k + j, e = g * experts_per_group + index[s];
        counts[e] += 1;
        weight_sums[e] += double(weight[s]);
      }
}

// One layer and kind's load over the window.
struct ExpertLoadStats {
  int64_t layer = 0;
  ExpertKind kind = ExpertKind::kFfn;
  int64_t experts = 0;
  double selections = 0;  // summed counts
  int64_t dead = 0;       // experts never selected
  // exp(entropy) of the usage distribution (counts / selections): experts' worth of even use,
  // from 1 (one expert takes everything) to `experts` (all alike).
  double usage_perplexity = 0;
  double max_over_mean = 0;  // the busiest expert's count over the mean count
  double mean_weight = 0;    // the routing weight of a selection, on average
};
std::vector<ExpertLoadStats> expert_load_stats(const ExpertLoadLayout& layout, std::span<const double> load);

}  // namespace moeut
