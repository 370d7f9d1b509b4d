// Timing helpers of the GPU benchmarks: event-timed medians and the bf16 matrix-product peak
// that MFU is measured against, both measured in the benchmark's own run.
#pragma once
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <functional>
#include <stdexcept>
#include <vector>

#include "core/rng.h"
#include "kernels/device_buffer.h"

namespace moeut::bench {

// Median milliseconds of fn over `reps` runs after `warmup` runs, timed with events on stream 0.
inline double median_ms(const std::function<void()>& fn, int reps = 20, int warmup = 3) {
  cudaEvent_t a, b;
  MOEUT_CUDA_CHECK(cudaEventCreate(&a));
  MOEUT_CUDA_CHECK(cudaEventCreate(&b));
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<float> ms(static_cast<size_t>(reps));
  for (auto& m : ms) {
    MOEUT_CUDA_CHECK(cudaEventRecord(a));
    fn();
    MOEUT_CUDA_CHECK(cudaEventRecord(b));
    MOEUT_CUDA_CHECK(cudaEventSynchronize(b));
    MOEUT_CUDA_CHECK(cudaEventElapsedTime(&m, a, b));
  }
  std::sort(ms.begin(), ms.end());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms[ms.size() / 2];
}

template <typename T>
cuda::DeviceBuffer<T> random_device(size_t n, Rng& rng, float scale) {
  std::vector<T> h(n);
  for (auto& x : h) x = T(scale * float(rng.normal()));
  return cuda::DeviceBuffer<T>(h);
}

// TFLOP/s of a bf16 8192³ product through cuBLAS (fp32 accumulation), on random data.
inline double cublas_peak_tflops() {
  const int n = 8192;
  Rng rng(5);
  auto A = random_device<__nv_bfloat16>(size_t(n) * n, rng, 1.f), B = random_device<__nv_bfloat16>(size_t(n) * n, rng, 1.f);
  cuda::DeviceBuffer<__nv_bfloat16> C{size_t(n) * n};
  cublasHandle_t h;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) throw std::runtime_error("cublasCreate failed");
  const float one = 1.f, zero = 0.f;
  const double ms = median_ms([&] {
    if (cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, A.get(), CUDA_R_16BF, n, B.get(), CUDA_R_16BF, n, &zero,
                     C.get(), CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS)
      throw std::runtime_error("cublasGemmEx failed");
  });
  cublasDestroy(h);
  return 2.0 * n * double(n) * n / (ms * 1e-3) / 1e12;
}

}  // namespace moeut::bench
