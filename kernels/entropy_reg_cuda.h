// The routing entropy regulariser on the GPU, fp32 (see entropy_reg.h for the definition). Its
// per-row work rides on the routing kernels (routing_cuda.h): each use's top-k adds its softmax
// into the means, and each use's top-k backward makes its logit gradient from them. This class
// holds the means of every physical layer and turns them into the loss and the gradient's
// weights once all R uses of a layer have run.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "kernels/device_buffer.h"
#include "kernels/routing_cuda.h"

namespace moeut::cuda {

class EntropyReg {
 public:
  // Means for `layers` physical layers, each over R uses of batches of B sequences of T tokens,
  // `groups` routing groups of E experts.
  EntropyReg(int64_t layers, int64_t B, int64_t T, int64_t groups, int64_t E, int64_t R);
  // Zeroes every layer's means: before a pass's first use.
  void clear(cudaStream_t stream);
  // What each use's top-k of physical layer `layer` adds its softmax into; lse [B·T, groups]
  // receives the use's row log-sum-exps, which its gradient needs.
  SoftmaxMeans means(int64_t layer, float* lse) const;
  // After the layer's R uses: *loss (device double) += coef · mean_{b,g} of -entropy(m), and the
  // means become log m + 1, the weights of its gradient. The layer keeps coef for gradient().
  void finish(int64_t layer, double coef, double* loss, cudaStream_t stream);
  // The gradient of what the layer's last finish() added, for the use whose logits are
  // z [B, T, groups * E] (lse: what means() had written for it).
  SoftmaxGrad gradient(int64_t layer, const float* z, const float* lse) const;
  int64_t device_bytes() const { return mean_.bytes(); }

 private:
  float* mean(int64_t layer) const { return mean_.get() + layer * B_ * groups_ * E_; }
  int64_t B_, T_, groups_, E_, R_;
  DeviceBuffer<float> mean_;  // [layers, B, groups, E]: the mean distribution m, then log m + 1
  std::vector<double> coef_;  // per layer, as finish() last had it
};

}  // namespace moeut::cuda
