// The model's dense products on cuBLAS: bf16 operands with d-element rows (d = d_model) and fp32
// accumulation, a layer input x [rows, d] against a weight W [out, d], and the two halves of the
// product's backward. Owns the cuBLAS handle, bound to the model's stream; the attention and the
// LM head take the same handle.
#pragma once
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moeut {

class DenseProducts {
 public:
  using bf16 = __nv_bfloat16;
  DenseProducts(int64_t d, cudaStream_t stream);
  ~DenseProducts();
  DenseProducts(const DenseProducts&) = delete;
  DenseProducts& operator=(const DenseProducts&) = delete;
  cublasHandle_t handle() const { return handle_; }

  // y [rows, out] = alpha · x Wᵀ, y of y_type (fp32 or bf16) with rows y_ld elements apart
  // (0: out); what names the product in errors.
  void forward(const bf16* x, const bf16* W, int64_t rows, int64_t out, float alpha, void* y, cudaDataType y_type,
               int64_t y_ld, const char* what) const;
  // The backward, dy [rows, *] with rows dy_ld elements apart: dW [out, d] += dyᵀ x, and
  // dx [rows, d] = dy[:, :k] · W [k, d].
  void weight_grad(const bf16* dy, int64_t dy_ld, const bf16* x, float* dW, int64_t rows, int64_t out) const;
  void input_grad(const bf16* dy, int64_t dy_ld, const bf16* W, int64_t k, int64_t rows, bf16* dx) const;
  // y += x over n fp32 values.
  void add(const float* x, float* y, int64_t n, const char* what) const;

 private:
  int64_t d_;
  cublasHandle_t handle_ = nullptr;
};

// TFLOP/s of a bf16 8192³ product through cuBLAS (fp32 accumulation) on pseudo-random data, the
// median of 20 after 3 untimed: the peak that MFU is counted against, measured on this GPU now
// (it varies by several percent between GPUs of one kind).
double measure_bf16_peak_tflops();

}  // namespace moeut
