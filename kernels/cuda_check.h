// Checks the result of every CUDA runtime and cuBLAS call: a failure throws naming the call (and,
// for the runtime, the file and the line).
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace moeut::cuda {

[[noreturn]] inline void cuda_fail(cudaError_t e, const char* call, const char* file, int line) {
  throw std::runtime_error(std::string("CUDA error ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) +
                           ") in " + call + " at " + file + ":" + std::to_string(line));
}

// A device allocation that did not fit. Callers that know what the memory was for (the
// training backend, the benchmark) add how to make it fit.
class OutOfMemory : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

inline void check_cublas(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("cuBLAS error ") + std::to_string(int(s)) + " in " + what);
}

}  // namespace moeut::cuda

#define MOEUT_CUDA_CHECK(call)                                                               \
  do {                                                                                       \
    const cudaError_t moeut_err_ = (call);                                                   \
    if (moeut_err_ != cudaSuccess) ::moeut::cuda::cuda_fail(moeut_err_, #call, __FILE__, __LINE__); \
  } while (0)
