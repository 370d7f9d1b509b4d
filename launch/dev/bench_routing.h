// The FFN experts' routing that the GPU benchmarks time at the 1B shapes, in one place so that the
// expert kernels (moeut-bench-cvmm) and their scatter floor (moeut-bench-scatter-floor) see the
// same rows: 565 experts, top-24. Random (the default): each token's k distinct experts drawn at
// random, as a router with random weights picks them, so the experts' rows vary (binomially: about
// ±4% at 16k tokens) and with them the number and fill of their row tiles. Stride: each token takes
// k distinct experts at a fixed stride, so every expert has the same rows (to one), which misleads:
// kernels whose order depends on the rows (the gather's counters) run otherwise on the router's
// random rows. Selection i = t·k + j
// reads token row t and writes the row of its position in expert order, as the model's hidden
// rows are stored; grouped.
#pragma once
#include <algorithm>
#include <cstdint>

#include "core/rng.h"
#include "kernels/cvmm.h"

namespace moeut::bench {

inline constexpr int64_t kFfnExperts = 565, kFfnTopK = 24;

// Token t's k distinct experts of E, drawn at random, into experts[0..k).
inline void random_distinct_experts(int32_t* experts, int64_t E, int64_t k, Rng& rng) {
  for (int64_t j = 0; j < k; ++j) {
    bool taken;
    do {
      experts[j] = int32_t(rng.next() % uint64_t(E));
      taken = false;
      for (int64_t q = 0; q < j; ++q) taken |= experts[q] == experts[j];
    } while (taken);
  }
}

// rng null: stride; otherwise random.
inline CvmmSelection ffn_routing(int64_t tokens, Rng* rng) {
  CvmmSelection sel;
  sel.resize(tokens * kFfnTopK);
  for (int64_t t = 0; t < tokens; ++t) {
    int32_t* const experts = sel.expert.data() + t * kFfnTopK;
    if (rng) random_distinct_experts(experts, kFfnExperts, kFfnTopK, *rng);
    else
      for (int64_t j = 0; j < kFfnTopK; ++j) experts[j] = int32_t((t * 7919 + j * 23) % kFfnExperts);
    std::fill_n(sel.in_row.begin() + t * kFfnTopK, kFfnTopK, int32_t(t));
  }
  sel.group(kFfnExperts);
  for (int64_t i = 0; i < sel.size(); ++i) sel.out_row[size_t(i)] = sel.position[size_t(i)];
  return sel;
}

}  // namespace moeut::bench
