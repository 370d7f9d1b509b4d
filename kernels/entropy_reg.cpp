#include "kernels/entropy_reg.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace moeut {
namespace {

// log(sum(exp(x))) of x[0..n) with the given stride, computed stably.
double logsumexp(const double* x, int64_t n) {
  double mx = -INFINITY;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, x[i]);
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += std::exp(x[i] - mx);
  return mx + std::log(s);
}

}  // namespace

template <typename T>
double entropy_reg_forward_backward(std::span<T* const> duses, std::span<const T* const> uses,
                                    int64_t B, int64_t T_len, int64_t groups, int64_t E,
                                    double coef) {
  const int64_t R = int64_t(uses.size());
  const int64_t S = T_len * R;  // positions averaged over
  const double count = double(B * groups);
  std::vector<double> neg_entropy(static_cast<size_t>(B * groups));
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < groups; ++g) {
      // logp [S, E] of this (b, g); log m[e] = logsumexp_s(logp[s, e]) - log S.
      std::vector<double> logp(static_cast<size_t>(S * E)), column(static_cast<size_t>(S));
      std::vector<double> log_m(static_cast<size_t>(E));
      for (int64_t r = 0; r < R; ++r)
        for (int64_t t = 0; t < T_len; ++t) {
          const T* z = uses[r] + ((b * T_len + t) * groups + g) * E;
          double* lp = logp.data() + (r * T_len + t) * E;
          for (int64_t e = 0; e < E; ++e) lp[e] = double(z[e]);
          const double lse = logsumexp(lp, E);
          for (int64_t e = 0; e < E; ++e) lp[e] -= lse;
        }
      double h = 0;  // sum_e m_e log m_e = -entropy(m)
      for (int64_t e = 0; e < E; ++e) {
        for (int64_t s = 0; s < S; ++s) column[s] = logp[s * E + e];
        log_m[e] = logsumexp(column.data(), S) - std::log(double(S));
        h += std::exp(log_m[e]) * log_m[e];
      }
      neg_entropy[b * groups + g] = h;
      // d(h)/d m_e = log m_e + 1; d m_e / d p[s,e] = 1/S; softmax backward per position:
      // dz[s,e] = p[s,e] * (dp[s,e] - sum_e' p[s,e'] dp[s,e']).
      const double scale = coef / count / double(S);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t t = 0; t < T_len; ++t) {
          const double* lp = logp.data() + (r * T_len + t) * E;
          double dot = 0;
          for (int64_t e = 0; e < E; ++e) dot += std::exp(lp[e]) * (log_m[e] + 1.0);
          T* dz = duses[r] + ((b * T_len + t) * groups + g) * E;
          for (int64_t e = 0; e < E; ++e)
            dz[e] += T(scale * std::exp(lp[e]) * ((log_m[e] + 1.0) - dot));
        }
    }
  double total = 0;
  for (double v : neg_entropy) total += v;
  return coef * total / count;
}

template double entropy_reg_forward_backward<float>(std::span<float* const>,
                                                    std::span<const float* const>, int64_t,
                                                    int64_t, int64_t, int64_t, double);
template double entropy_reg_forward_backward<double>(std::span<double* const>,
                                                     std::span<const double* const>, int64_t,
                                                     int64_t, int64_t, int64_t, double);

}  // namespace moeut
