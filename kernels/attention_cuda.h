// Causal attention on the GPU (see attention.h for the definition). Head sizes up to 128:
// flash-style kernels, forward and backward, with no scores in memory (the forward keeps each
// row's log-sum-exp for the backward). Above 128: per (sequence, head), cuBLAS products for the
// scores and the weighted sum with a fused causal softmax between them, one layer's scores in a
// workspace, recomputed by the backward pass.
#pragma once
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/device_buffer.h"

namespace moeut::cuda {

class CausalAttention {
 public:
  // q, k, v, out: bf16 [B, T, H, dh]; scale 1 (folded into q and k by the caller). q's and k's
  // token rows are qk_ld elements apart (0: H·dh), so that one product can write them side by
  // side. The workspace is sized for B sequences; set_batch runs later calls on fewer.
  CausalAttention(cublasHandle_t cublas, int64_t B, int64_t T, int64_t H, int64_t dh);
  void set_batch(int64_t B);
  int64_t device_bytes() const {
    return dout_.bytes() + row_dots_.bytes() + dq_acc_.bytes() + scores_.bytes() + probs_.bytes();
  }
  // lse [B, H, T] (fp32): written by the flash forward for its backward (log2 of each row's
  // softmax denominator); unused above head size 128.
  void forward(__nv_bfloat16* out, float* lse, const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
               cudaStream_t stream, int64_t qk_ld = 0);
  // Overwrites dq, dk, dv. dout: the output's gradient in fp32 (as the output experts' input
  // gradient accumulates it); its bf16 copy, which the products read, is made in the same pass as
  // the softmax gradient's row terms. out and lse: the forward's. dq and dk come multiplied by
  // grad_scale (the scale the caller folded into q and k), their token rows grad_ld elements apart
  // (0: H·dh), so that a caller can place them side by side in one matrix.
  void backward(__nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, const float* dout,
                const __nv_bfloat16* out, const float* lse, const __nv_bfloat16* q, const __nv_bfloat16* k,
                const __nv_bfloat16* v, cudaStream_t stream, int64_t grad_ld = 0, float grad_scale = 1.f,
                int64_t qk_ld = 0);

 private:
  bool flash() const { return dh_ <= 128; }
  // A tensor's token-row stride ld, checked (rows: what the error names) and 0 resolved to H·dh.
  int64_t row_stride(int64_t ld, const char* rows) const;
  void scores_and_probs(const __nv_bfloat16* q, const __nv_bfloat16* k, int64_t qk_ld, cudaStream_t stream);

  cublasHandle_t cublas_;
  int64_t capacity_, B_, T_, H_, dh_;
  DeviceBuffer<__nv_bfloat16> dout_;  // the output's gradient in bf16
  // Flash path: the softmax gradient's row terms and dq's fp32 accumulator.
  DeviceBuffer<float> row_dots_, dq_acc_;
  // cuBLAS path (head sizes above 128):
  DeviceBuffer<float> scores_;         // [B, H, T, T] fp32; the probability gradient in backward
  DeviceBuffer<__nv_bfloat16> probs_;  // [B, H, T, T]; the score gradient in backward
};

}  // namespace moeut::cuda
