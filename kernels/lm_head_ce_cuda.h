// The LM head fused with cross-entropy on the GPU (see lm_head_ce.h): cuBLAS products around
// the cross-entropy kernel, chunks of rows so that only [chunk, V] fp32 logits exist at a time.
#pragma once
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/device_buffer.h"

namespace moeut::cuda {

class LmHeadCE {
 public:
  LmHeadCE(cublasHandle_t cublas, int64_t V, int64_t d, int64_t chunk = 4096);
  // x bf16 [n, d], W bf16 [V, d], bias bf16 [V]; row_loss fp32 [n] receives each row's loss.
  // When dx is not null: dx fp32 [n, d] is overwritten, dW fp32 [V, d] and dbias fp32 [V] are
  // accumulated, with the gradient of grad_scale · Σ row losses.
  void run(float* row_loss, float* dx, float* dW, float* dbias, const __nv_bfloat16* x, const __nv_bfloat16* W,
           const __nv_bfloat16* bias, const int32_t* targets, int64_t n, float grad_scale, cudaStream_t stream);

  int64_t device_bytes() const { return logits_.bytes() + dlogits_.bytes(); }

 private:
  cublasHandle_t cublas_;
  int64_t V_, d_, chunk_;
  DeviceBuffer<float> logits_;
  DeviceBuffer<__nv_bfloat16> dlogits_;
};

}  // namespace moeut::cuda
