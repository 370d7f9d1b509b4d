// cvmm: the expert-indexed matrix product behind every MoE product of the model (FFN keys and
// values, attention value and output experts). Each selection i contributes
//     Y[out_row[i]] += weight[i] * X[in_row[i]] @ W[expert[i]]
// with X [*, K], W [E, K, N], Y [*, N]. Selections are grouped by expert once per routing
// decision (CvmmSelection::group) so that each expert runs one product over its gathered rows.
#pragma once
#include <cstdint>
#include <vector>

namespace moeut {

struct CvmmSelection {
  std::vector<int32_t> in_row, expert, out_row;  // one entry per selection
  // Filled by group(): selections ordered by expert (stable), where each expert's run starts,
  // and the position of each selection in that order.
  std::vector<int32_t> by_expert;
  std::vector<int64_t> expert_begin;  // n_experts + 1
  std::vector<int32_t> position;

  int64_t size() const { return int64_t(in_row.size()); }
  void resize(int64_t n);
  void group(int64_t n_experts);  // call after filling in_row, expert, out_row
};

// Scratch rows the products gather into; grows on first use and is reused afterwards.
template <typename T>
struct CvmmWorkspace {
  std::vector<T> results;  // [selections, max(K, N)], in expert order
};

// Y += ...; weight may be null (all ones).
template <typename T>
void cvmm_forward(T* Y, const T* X, const T* W, const T* weight, const CvmmSelection& sel,
                  int64_t K, int64_t N, CvmmWorkspace<T>& ws);

// Accumulates dX [*, K] and dW [E, K, N]; overwrites dweight [selections] when weight is given.
template <typename T>
void cvmm_backward(T* dX, T* dW, T* dweight, const T* dY, const T* X, const T* W,
                   const T* weight, const CvmmSelection& sel, int64_t K, int64_t N,
                   CvmmWorkspace<T>& ws);

}  // namespace moeut
