// The routing entropy regulariser on the GPU, fp32 (see entropy_reg.h for the definition): the
// R uses of a physical layer together, loss returned and gradients written per use.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "kernels/device_buffer.h"

namespace moeut::cuda {

class EntropyReg {
 public:
  // Scratch for batches of B sequences, `groups` routing groups of E experts.
  EntropyReg(int64_t B, int64_t groups, int64_t E);
  // uses[r], duses[r]: device logits and gradients [B, T, groups * E] of use r. Writes coef times
  // the gradient into duses, which may be the uses themselves (the model keeps the gradient in
  // place of the logits it no longer needs); *loss (device double) receives
  // coef · mean_{b,g} of -entropy(m).
  void forward_backward(const std::vector<float*>& duses, const std::vector<const float*>& uses, int64_t T,
                        double coef, double* loss, cudaStream_t stream);

 private:
  int64_t B_, groups_, E_;
  DeviceBuffer<float> mean_;  // [B, groups, E]: the mean distribution m, then log m + 1
};

}  // namespace moeut::cuda
