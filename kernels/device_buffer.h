// An owned device allocation of n elements of T, with checked copies to and from the host.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cuda_check.h"

namespace moeut::cuda {

// cudaMalloc, checked; when the device is full, the error says how much was asked and how much
// was free (and the failed call is cleared, so the context stays usable).
inline void* device_allocate(size_t bytes) {
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes);
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    size_t free_bytes = 0, total_bytes = 0;
    int device = 0;
    cudaMemGetInfo(&free_bytes, &total_bytes);
    cudaGetDevice(&device);
    auto gib = [](size_t b) {
      char s[32];
      std::snprintf(s, sizeof s, "%.2f GiB", double(b) / double(1ull << 30));
      return std::string(s);
    };
    throw OutOfMemory("GPU out of memory: " + gib(bytes) + " asked, " + gib(free_bytes) + " free of " +
                      gib(total_bytes) + " on device " + std::to_string(device));
  }
  if (e != cudaSuccess) cuda_fail(e, "cudaMalloc", __FILE__, __LINE__);
  return p;
}

template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : n_(n) { if (n) ptr_ = static_cast<T*>(device_allocate(n * sizeof(T))); }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { if (ptr_) cudaFree(ptr_); }
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), n_(o.n_) { o.ptr_ = nullptr; o.n_ = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept { std::swap(ptr_, o.ptr_); std::swap(n_, o.n_); return *this; }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return ptr_; }
  size_t size() const { return n_; }
  int64_t bytes() const { return int64_t(n_ * sizeof(T)); }
  void upload(const std::vector<T>& host) {
    if (host.size() != n_) throw std::invalid_argument("DeviceBuffer::upload: size mismatch");
    if (n_) MOEUT_CUDA_CHECK(cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    if (n_) MOEUT_CUDA_CHECK(cudaMemcpy(host.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  T* ptr_ = nullptr;
  size_t n_ = 0;
};

// Page-locked host memory of n elements of T: copies between it and the device run
// asynchronously, so they can be queued on a stream and captured in a CUDA graph.
template <typename T>
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(size_t n) : n_(n) {
    void* p = nullptr;
    if (n) MOEUT_CUDA_CHECK(cudaMallocHost(&p, n * sizeof(T)));
    ptr_.reset(static_cast<T*>(p));
  }

  T* get() const { return ptr_.get(); }
  size_t size() const { return n_; }

 private:
  struct Free {
    void operator()(T* p) const { cudaFreeHost(p); }
  };
  std::unique_ptr<T, Free> ptr_;
  size_t n_ = 0;
};

}  // namespace moeut::cuda
