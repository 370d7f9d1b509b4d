// Timing helpers of the GPU benchmarks: event-timed medians and random device operands (the bf16
// peak that MFU is measured against: measure_bf16_peak_tflops, core/dense_products.h).
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

}  // namespace moeut::bench
