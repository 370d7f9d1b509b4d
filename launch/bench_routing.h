// The FFN experts' routing that the GPU benchmarks time at the 1B shapes, in one place so that the
// expert kernels (moeut-bench-cvmm) and their scatter floor (moeut-bench-scatter-floor) see the
// same rows: 565 experts, top-24, uniform (each token takes k distinct experts at a fixed
// stride). Selection i = t·k + j reads token row t and writes the row of its position in expert
// order, as the model's hidden rows are stored; grouped.
#pragma once
#include <cstdint>

#include "kernels/cvmm.h"

namespace moeut::bench {

inline constexpr int64_t kFfnExperts = 565, kFfnTopK = 24;

inline CvmmSelection uniform_ffn_routing(int64_t tokens) {
  CvmmSelection sel;
  sel.resize(tokens * kFfnTopK);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < kFfnTopK; ++j) {
      const int64_t i = t * kFfnTopK + j;
      sel.expert[i] = int32_t((t * 7919 + j * 23) % kFfnExperts);
      sel.in_row[i] = int32_t(t);
    }
  sel.group(kFfnExperts);
  for (int64_t i = 0; i < sel.size(); ++i) sel.out_row[size_t(i)] = sel.position[size_t(i)];
  return sel;
}

}  // namespace moeut::bench
