#include "kernels/cvmm.h"

#include <algorithm>
#include <stdexcept>

#include "kernels/gemm.h"

namespace moeut {

void CvmmSelection::resize(int64_t n) {
  in_row.resize(size_t(n));
  expert.resize(size_t(n));
  out_row.resize(size_t(n));
}

void CvmmSelection::group(int64_t n_experts) {
  const int64_t n = size();
  expert_begin.assign(size_t(n_experts + 1), 0);
  for (int64_t i = 0; i < n; ++i) {
    if (expert[i] < 0 || expert[i] >= n_experts)
      throw std::out_of_range("cvmm: expert index " + std::to_string(expert[i]) +
                              " outside [0, " + std::to_string(n_experts) + ")");
    ++expert_begin[expert[i] + 1];
  }
  for (int64_t e = 0; e < n_experts; ++e) expert_begin[e + 1] += expert_begin[e];
  by_expert.resize(size_t(n));
  position.resize(size_t(n));
  std::vector<int64_t> next(expert_begin.begin(), expert_begin.end() - 1);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = next[expert[i]]++;
    by_expert[p] = int32_t(i);
    position[i] = int32_t(p);
  }
}

namespace {

// Copies rows[by_expert[p]] of src for p in [begin, end) into dst, contiguous.
template <typename T>
void gather_rows(T* dst, const T* src, int64_t width, const std::vector<int32_t>& rows,
                 const CvmmSelection& sel, int64_t begin, int64_t end) {
  for (int64_t p = begin; p < end; ++p)
    std::copy_n(src + int64_t(rows[sel.by_expert[p]]) * width, width, dst + (p - begin) * width);
}

int64_t n_experts_of(const CvmmSelection& sel) { return int64_t(sel.expert_begin.size()) - 1; }

}  // namespace

template <typename T>
void cvmm_forward(T* Y, const T* X, const T* W, const T* weight, const CvmmSelection& sel,
                  int64_t K, int64_t N, CvmmWorkspace<T>& ws) {
  const int64_t n = sel.size(), E = n_experts_of(sel);
  ws.results.resize(size_t(n * N));
  T* results = ws.results.data();
#pragma omp parallel for schedule(dynamic)
  for (int64_t e = 0; e < E; ++e) {
    const int64_t begin = sel.expert_begin[e], m = sel.expert_begin[e + 1] - begin;
    if (m == 0) continue;
    thread_local std::vector<T> rows;
    rows.resize(size_t(m * K));
    gather_rows(rows.data(), X, K, sel.in_row, sel, begin, begin + m);
    gemm(false, false, m, N, K, T(1), rows.data(), K, W + e * K * N, N, T(0),
         results + begin * N, N);
  }
  // Scatter in selection order: several selections may share an output row, and a fixed order
  // keeps the sum reproducible.
  for (int64_t i = 0; i < n; ++i) {
    const T w = weight ? weight[i] : T(1);
    const T* r = results + int64_t(sel.position[i]) * N;
    T* y = Y + int64_t(sel.out_row[i]) * N;
    for (int64_t j = 0; j < N; ++j) y[j] += w * r[j];
  }
}

template <typename T>
void cvmm_backward(T* dX, T* dW, T* dweight, const T* dY, const T* X, const T* W,
                   const T* weight, const CvmmSelection& sel, int64_t K, int64_t N,
                   CvmmWorkspace<T>& ws) {
  const int64_t n = sel.size(), E = n_experts_of(sel);
  ws.results.resize(size_t(n * K));
  T* dx_rows = ws.results.data();  // gradient of each selection's input row, in expert order
#pragma omp parallel for schedule(dynamic)
  for (int64_t e = 0; e < E; ++e) {
    const int64_t begin = sel.expert_begin[e], m = sel.expert_begin[e + 1] - begin;
    if (m == 0) continue;
    thread_local std::vector<T> x, g;
    x.resize(size_t(m * K));
    g.resize(size_t(m * N));
    gather_rows(x.data(), X, K, sel.in_row, sel, begin, begin + m);
    gather_rows(g.data(), dY, N, sel.out_row, sel, begin, begin + m);
    const T* We = W + e * K * N;
    T* dxe = dx_rows + begin * K;
    // Unweighted input gradient g @ W_e^T; the routing-weight gradient is its dot product with
    // the input row (= g . (x @ W_e)), so no product is recomputed.
    gemm(false, true, m, K, N, T(1), g.data(), N, We, N, T(0), dxe, K);
    if (weight) {
      for (int64_t r = 0; r < m; ++r) {
        const int64_t i = sel.by_expert[begin + r];
        T dot = 0;
        for (int64_t c = 0; c < K; ++c) dot += dxe[r * K + c] * x[r * K + c];
        dweight[i] = dot;
        const T w = weight[i];
        for (int64_t c = 0; c < K; ++c) dxe[r * K + c] *= w;
        for (int64_t c = 0; c < N; ++c) g[r * N + c] *= w;
      }
    }
    gemm(true, false, K, N, m, T(1), x.data(), K, g.data(), N, T(1), dW + e * K * N, N);
  }
  for (int64_t i = 0; i < n; ++i) {
    const T* r = dx_rows + int64_t(sel.position[i]) * K;
    T* dx = dX + int64_t(sel.in_row[i]) * K;
    for (int64_t c = 0; c < K; ++c) dx[c] += r[c];
  }
}

#define MOEUT_INSTANTIATE(T)                                                                  \
  template struct CvmmWorkspace<T>;                                                            \
  template void cvmm_forward<T>(T*, const T*, const T*, const T*, const CvmmSelection&,        \
                                int64_t, int64_t, CvmmWorkspace<T>&);                          \
  template void cvmm_backward<T>(T*, T*, T*, const T*, const T*, const T*, const T*,           \
                                 const CvmmSelection&, int64_t, int64_t, CvmmWorkspace<T>&);
MOEUT_INSTANTIATE(float)
MOEUT_INSTANTIATE(double)

}  // namespace moeut
