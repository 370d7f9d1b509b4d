#include "kernels/grad_norm.h"

#include <algorithm>
#include <vector>

namespace moeut {

template <typename T>
double sum_of_squares(const T* x, int64_t n) {
  constexpr int64_t kChunk = 1 << 16;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> partial(size_t(chunks), 0.0);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    double s = 0;
    for (int64_t i = c * kChunk, end = std::min(n, (c + 1) * kChunk); i < end; ++i)
      s += double(x[i]) * double(x[i]);
    partial[c] = s;
  }
  double total = 0;
  for (double p : partial) total += p;
  return total;
}

double clip_coefficient(double norm, double max_norm) {
  if (max_norm <= 0) return 1.0;
  return std::min(1.0, max_norm / (norm + 1e-6));
}

template double sum_of_squares<float>(const float*, int64_t);
template double sum_of_squares<double>(const double*, int64_t);

}  // namespace moeut
