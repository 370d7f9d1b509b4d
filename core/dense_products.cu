#include "core/dense_products.h"

#include "kernels/cuda_check.h"

namespace moeut {

using cuda::check_cublas;

DenseProducts::DenseProducts(int64_t d, cudaStream_t stream) : d_(d) {
  check_cublas(cublasCreate(&handle_), "cublasCreate");
  check_cublas(cublasSetStream(handle_, stream), "cublasSetStream");
}

DenseProducts::~DenseProducts() {
  if (handle_) cublasDestroy(handle_);
}

void DenseProducts::forward(const bf16* x, const bf16* W, int64_t rows, int64_t out, float alpha, void* y,
                            cudaDataType y_type, int64_t y_ld, const char* what) const {
  const float zero = 0.f;
  check_cublas(cublasGemmEx(handle_, CUBLAS_OP_T, CUBLAS_OP_N, int(out), int(rows), int(d_), &alpha, W, CUDA_R_16BF,
                            int(d_), x, CUDA_R_16BF, int(d_), &zero, y, y_type, int(y_ld ? y_ld : out),
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               what);
}

void DenseProducts::weight_grad(const bf16* dy, int64_t dy_ld, const bf16* x, float* dW, int64_t rows,
                                int64_t out) const {
  const float one = 1.f;
  // dW [out, d] += dyᵀ x  <=>  cm [d, out] += x(cm [d, rows]) · dy(cm [out, rows])ᵀ
  check_cublas(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_T, int(d_), int(out), int(rows), &one, x, CUDA_R_16BF,
                            int(d_), dy, CUDA_R_16BF, int(dy_ld), &one, dW, CUDA_R_32F, int(d_), CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT),
               "dense weight gradient");
}

void DenseProducts::input_grad(const bf16* dy, int64_t dy_ld, const bf16* W, int64_t k, int64_t rows, bf16* dx) const {
  const float one = 1.f, zero = 0.f;
  // dx [rows, d] = dy W  <=>  cm [d, rows] = W(cm [d, k]) · dy(cm [k, rows])
  check_cublas(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, int(d_), int(rows), int(k), &one, W, CUDA_R_16BF,
                            int(d_), dy, CUDA_R_16BF, int(dy_ld), &zero, dx, CUDA_R_16BF, int(d_), CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT),
               "dense input gradient");
}

void DenseProducts::add(const float* x, float* y, int64_t n, const char* what) const {
  const float one = 1.f;
  check_cublas(cublasSaxpy(handle_, int(n), &one, x, 1, y, 1), what);
}

}  // namespace moeut
