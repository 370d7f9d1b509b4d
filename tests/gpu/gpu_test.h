// GPU tests skip themselves, visibly, on machines without a GPU (CI).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/rng.h"

namespace moeut {

// GPUs this process sees (0 where the driver answers nothing, as on CI).
inline int gpu_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

inline bool gpu_available() { return gpu_count() > 0; }

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gpu_available()) GTEST_SKIP() << "skipped: no GPU";
  }
};

namespace gpu_test {

using bf16 = __nv_bfloat16;

// n calls of rng.normal(), scaled and rounded to bf16, so CPU reference and GPU kernel see the
// same inputs; drawn in parallel, the same values as in turn (an expert weight at 1B is 111 M of
// them, slow to draw in turn, and the GPU tests draw several per shape).
inline std::vector<float> random_bf16_values(size_t n, Rng& rng, double scale) {
  std::vector<float> v(n);
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; ++i)
    v[i] = __bfloat162float(__float2bfloat16(float(scale * Rng::normal_of(rng.peek(2 * i), rng.peek(2 * i + 1)))));
  rng.skip(2 * n);
  return v;
}

inline std::vector<bf16> to_bf16(const std::vector<float>& v) {
  std::vector<bf16> out(v.size());
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < v.size(); ++i) out[i] = __float2bfloat16(v[i]);
  return out;
}

inline std::vector<float> to_float(const std::vector<bf16>& v) {
  std::vector<float> out(v.size());
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < v.size(); ++i) out[i] = __bfloat162float(v[i]);
  return out;
}

// ‖a − b‖ / ‖b‖; NaN anywhere (an unwritten, poisoned output) gives NaN, which fails any bound.
inline double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, n = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d += double(a[i] - b[i]) * (a[i] - b[i]);
    n += double(b[i]) * b[i];
  }
  return std::sqrt(d / n);
}

}  // namespace gpu_test
}  // namespace moeut
