#include "core/ffn_experts.h"

#include <algorithm>

#include "kernels/relu.h"

namespace moeut {

template <typename T>
void ExpertWork<T>::set_selections(const int32_t* row, const int32_t* expert, const T* w, int64_t n,
                                   int64_t n_experts) {
  up.resize(n);
  for (int64_t s = 0; s < n; ++s) {
    up.in_row[s] = row[s];
    up.expert[s] = expert[s];
    up.out_row[s] = int32_t(s);
  }
  up.group(n_experts);
  down = up;
  std::swap(down.in_row, down.out_row);
  weight.assign(w, w + n);
}

template <typename T>
void ffn_experts_forward(ExpertWork<T>& work, const ExpertParams<T>& p, T* out, CvmmWorkspace<T>& ws) {
  work.hidden.assign(size_t(work.up.size() * p.es), T(0));
  cvmm_forward(work.hidden.data(), work.rows, p.keys, static_cast<const T*>(nullptr), work.up, p.d, p.es, ws);
  relu_forward(work.hidden.data(), int64_t(work.hidden.size()));
  cvmm_forward(out, work.hidden.data(), p.values, work.weight.data(), work.down, p.es, p.d, ws);
}

template <typename T>
void ffn_experts_backward(ExpertWork<T>& work, const ExpertParams<T>& p, const T* dout, T* din, T* dweight,
                          std::vector<T>& dhidden, CvmmWorkspace<T>& ws) {
  // The values product reads all of dout before the keys product adds into din, so they may
  // be the same buffer (the residual gradient).
  dhidden.assign(work.hidden.size(), T(0));
  cvmm_backward(dhidden.data(), p.dvalues, dweight, dout, work.hidden.data(), p.values, work.weight.data(),
                work.down, p.es, p.d, ws);
  relu_backward(dhidden.data(), dhidden.data(), work.hidden.data(), int64_t(dhidden.size()));
  cvmm_backward(din, p.dkeys, static_cast<T*>(nullptr), dhidden.data(), work.rows, p.keys,
                static_cast<const T*>(nullptr), work.up, p.d, p.es, ws);
}

#define MOEUT_INSTANTIATE(T)                                                                              \
  template struct ExpertWork<T>;                                                                          \
  template void ffn_experts_forward<T>(ExpertWork<T>&, const ExpertParams<T>&, T*, CvmmWorkspace<T>&);    \
  template void ffn_experts_backward<T>(ExpertWork<T>&, const ExpertParams<T>&, const T*, T*, T*,         \
                                        std::vector<T>&, CvmmWorkspace<T>&);
MOEUT_INSTANTIATE(float)
MOEUT_INSTANTIATE(double)

}  // namespace moeut
