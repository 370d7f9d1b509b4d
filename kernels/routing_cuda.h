// Sigmoid top-k routing on the GPU, fp32 (see routing.h for the definition, including the
// order: descending weight, ties to the lower expert index), with the entropy regulariser's
// per-row work (entropy_reg.h) riding on the same kernels: its softmax means in the forward
// kernel, its logit gradient in the backward one, so that no pass of its own reads the logits.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moeut::cuda {

// The regulariser's share of the forward: softmax(z) / S of each (token, group) row added into
// mean [B, groups, E], for n = B·T tokens, and each row's log-sum-exp written to lse [n, groups]
// for the backward. Neither when mean is null.
struct SoftmaxMeans {
  float* mean = nullptr;
  float* lse = nullptr;
  int64_t T = 0;
  float inv_S = 0.f;
};
// The regulariser's share of the backward: scale · p (c − Σ_e p c) with p = exp(z − lse) for each
// row of the logits z [n, groups·E], lse [n, groups] as the forward wrote it, c [B, groups, E]
// (n = B·T tokens). None when z is null.
struct SoftmaxGrad {
  const float* z = nullptr;
  const float* lse = nullptr;
  const float* c = nullptr;
  int64_t T = 0;
  float scale = 0.f;
};

// logits [n, groups * E], token rows ld apart (0: groups * E) -> index, weight [n, groups, k];
// E <= 1024, k <= 32. packed (optional) receives the logits as [n, groups * E]: a padded
// product's output is read once, by this kernel.
void topk_sigmoid_forward(int32_t* index, float* weight, const float* logits, int64_t n, int64_t groups, int64_t E,
                          int64_t k, cudaStream_t stream, int64_t ld = 0, float* packed = nullptr,
                          const SoftmaxMeans& means = {});
// The logits' gradient in bf16, token rows ld apart (columns past groups * E untouched): the
// regulariser's gradient (zero when reg.z is null) plus dweight * w * (1 - w) at the selected
// experts.
void topk_sigmoid_backward(__nv_bfloat16* dlogits, int64_t ld, const SoftmaxGrad& reg, const float* dweight,
                           const int32_t* index, const float* weight, int64_t n, int64_t groups, int64_t E, int64_t k,
                           cudaStream_t stream);

}  // namespace moeut::cuda
