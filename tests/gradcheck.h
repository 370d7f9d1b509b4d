// Central finite differences against analytic gradients, in double precision.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include "core/rng.h"

namespace moeut::test {

inline constexpr double kGradTolerance = 1e-6;

// Relative error ||analytic - numeric|| / max(||analytic||, ||numeric||) over x[0..n), where
// numeric[i] = (loss(x + h e_i) - loss(x - h e_i)) / 2h. Restores x.
inline double gradient_error(const std::function<double()>& loss, double* x, const double* analytic,
                             int64_t n, double h = 1e-6) {
  double diff = 0, na = 0, nn = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double keep = x[i];
    x[i] = keep + h;
    const double up = loss();
    x[i] = keep - h;
    const double down = loss();
    x[i] = keep;
    const double numeric = (up - down) / (2 * h);
    diff += (analytic[i] - numeric) * (analytic[i] - numeric);
    na += analytic[i] * analytic[i];
    nn += numeric * numeric;
  }
  return std::sqrt(diff) / std::max({std::sqrt(na), std::sqrt(nn), 1e-300});
}

inline std::vector<double> random_vector(int64_t n, uint64_t key, double scale = 1.0) {
  Rng rng(key);
  std::vector<double> v(static_cast<size_t>(n));
  for (auto& x : v) x = scale * rng.normal();
  return v;
}

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

}  // namespace moeut::test
