// GPU tests skip themselves, visibly, on machines without a GPU (CI).
#pragma once
#include <cuda_runtime.h>
#include <gtest/gtest.h>

namespace moeut {

inline bool gpu_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gpu_available()) GTEST_SKIP() << "skipped: no GPU";
  }
};

}  // namespace moeut
