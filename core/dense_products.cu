#include "core/dense_products.h"

#include <algorithm>
#include <vector>

#include "kernels/cuda_check.h"
#include "kernels/device_buffer.h"

namespace moeut {
namespace {

// Values in [-1, 1) from a hash of the index: the product's timing should see busy operands.
__global__ void fill_pseudo_random(__nv_bfloat16* x, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u;
    h ^= h >> 15;
    h *= 2246822519u;
    x[i] = __float2bfloat16(float(h >> 8) * (2.f / 16777216.f) - 1.f);
  }
}

}  // namespace

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

double measure_bf16_peak_tflops() {
  constexpr int n = 8192, untimed = 3, timed = 20;
  cuda::DeviceBuffer<__nv_bfloat16> a(size_t(n) * n), b(size_t(n) * n), c(size_t(n) * n);
  for (__nv_bfloat16* x : {a.get(), b.get()}) {
    fill_pseudo_random<<<1024, 256>>>(x, int64_t(n) * n);
    MOEUT_CUDA_CHECK(cudaGetLastError());
  }
  cublasHandle_t handle = nullptr;
  check_cublas(cublasCreate(&handle), "cublasCreate");
  cudaEvent_t begin, end;
  MOEUT_CUDA_CHECK(cudaEventCreate(&begin));
  MOEUT_CUDA_CHECK(cudaEventCreate(&end));
  const float one = 1.f, zero = 0.f;
  std::vector<float> ms(timed);
  for (int i = 0; i < untimed + timed; ++i) {
    MOEUT_CUDA_CHECK(cudaEventRecord(begin));
    check_cublas(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a.get(), CUDA_R_16BF, n, b.get(),
                              CUDA_R_16BF, n, &zero, c.get(), CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "bf16 peak product");
    MOEUT_CUDA_CHECK(cudaEventRecord(end));
    MOEUT_CUDA_CHECK(cudaEventSynchronize(end));
    if (i >= untimed) MOEUT_CUDA_CHECK(cudaEventElapsedTime(&ms[i - untimed], begin, end));
  }
  cudaEventDestroy(begin);
  cudaEventDestroy(end);
  cublasDestroy(handle);
  std::nth_element(ms.begin(), ms.begin() + timed / 2, ms.end());
  return 2.0 * n * double(n) * n / (double(ms[timed / 2]) * 1e-3) / 1e12;
}

}  // namespace moeut
