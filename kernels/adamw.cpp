#include "kernels/adamw.h"

#include <cmath>

namespace moeut {

template <typename T>
bool adamw_update(T* param, const T* grad, T* m, T* v, int64_t n, const AdamWHyper& h, int64_t t,
                  double grad_scale) {
  const double bc1 = 1.0 - std::pow(h.beta1, double(t));
  const double bc2 = 1.0 - std::pow(h.beta2, double(t));
  const double step = h.lr / bc1;
  const double decay = 1.0 - h.lr * h.weight_decay;
  bool finite = true;
#pragma omp parallel for schedule(static) reduction(&& : finite)
  for (int64_t i = 0; i < n; ++i) {
    const double g = double(grad[i]) * grad_scale;
    const double mi = h.beta1 * m[i] + (1.0 - h.beta1) * g;
    const double vi = h.beta2 * v[i] + (1.0 - h.beta2) * g * g;
    m[i] = T(mi);
    v[i] = T(vi);
    param[i] = T(param[i] * decay - step * mi / (std::sqrt(vi / bc2) + h.eps));
    finite = finite && std::isfinite(param[i]);
  }
  return finite;
}

template bool adamw_update<float>(float*, const float*, float*, float*, int64_t,
                                  const AdamWHyper&, int64_t, double);
template bool adamw_update<double>(double*, const double*, double*, double*, int64_t,
                                   const AdamWHyper&, int64_t, double);

}  // namespace moeut
