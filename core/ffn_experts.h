// The σ-MoE FFN experts held by one process: for every selection s of a batch of input rows,
//     out[row_s] += weight_s · ReLU(rows[row_s] · keys[e_s]) · values[e_s]
// with e_s a local expert index. Where the rows come from (this process's tokens, or tokens
// received from other ranks) is the dispatcher's business, not this piece's.
#pragma once
#include <cstdint>
#include <vector>

#include "kernels/cvmm.h"

namespace moeut {

template <typename T>
struct ExpertWork {
  const T* rows = nullptr;  // [n_rows, d], kept alive by the caller until backward
  int64_t n_rows = 0;
  CvmmSelection up, down;   // up: row -> hidden row s; down: hidden row s -> row
  std::vector<T> weight;    // [selections]
  std::vector<T> hidden;    // [selections, es], after ReLU

  // Selections s = 0..n-1 read row[s] with local expert expert[s]; n_experts local experts.
  void set_selections(const int32_t* row, const int32_t* expert, const T* w, int64_t n, int64_t n_experts);
};

template <typename T>
struct ExpertParams {
  const T* keys;    // [local experts, d, es]
  const T* values;  // [local experts, es, d]
  T* dkeys;         // gradients, accumulated
  T* dvalues;
  int64_t d, es;
};

// out [n_rows, d] is accumulated into.
template <typename T>
void ffn_experts_forward(ExpertWork<T>& work, const ExpertParams<T>& p, T* out, CvmmWorkspace<T>& ws);

// din [n_rows, d] is accumulated into; dweight [selections] is overwritten; dout may alias din.
template <typename T>
void ffn_experts_backward(ExpertWork<T>& work, const ExpertParams<T>& p, const T* dout, T* din, T* dweight,
                          std::vector<T>& dhidden, CvmmWorkspace<T>& ws);

}  // namespace moeut
