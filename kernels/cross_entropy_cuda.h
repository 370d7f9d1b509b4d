// Cross-entropy over a chunk of LM-head logits, fused with its gradient: the GPU half of
// lm_head_ce.h (the products around it run on cuBLAS), so no full fp32 logits tensor is kept.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moeut::cuda {

// z[r] = logits[r] (fp32 [m, V]) + bias (bf16 [V], when not null): row_loss[r] = logsumexp(z[r]) -
// z[r][target[r]]; when dlogits is not null it receives grad_scale · (softmax(z[r]) -
// onehot(target[r])) in bf16.
void cross_entropy(float* row_loss, __nv_bfloat16* dlogits, const float* logits, const __nv_bfloat16* bias,
                   const int32_t* targets, int64_t m, int64_t V, float grad_scale, cudaStream_t stream);

}  // namespace moeut::cuda
