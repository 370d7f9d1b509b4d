// What a GPU rank keeps on its device, by kind: each buffer is allocated through the ledger when
// the model is planned, so the start-up line can say where the memory goes.
#pragma once
#include <array>
#include <cstdint>
#include <cstdio>
#include <string>

#include "kernels/device_buffer.h"

namespace moeut {

class DeviceLedger {
 public:
  enum class Kind {
    kWeights,      // the bf16 working copy of every parameter
    kGradients,    // fp32, every parameter
    kOptimizer,    // fp32 master values and AdamW moments of this rank's ZeRO chunks
    kActivations,  // what the forward pass keeps for the backward pass
    kWorkspace,    // scratch of one layer at a time, kernels' own buffers, staging
    kExchange,     // expert parallelism: rows sent to and received from other ranks
  };
  static constexpr int kKinds = 6;

  template <typename T>
  cuda::DeviceBuffer<T> allocate(Kind kind, size_t n) {
    add(kind, int64_t(n * sizeof(T)));
    return cuda::DeviceBuffer<T>(n);
  }
  void add(Kind kind, int64_t bytes) { bytes_[size_t(kind)] += bytes; }
  int64_t bytes(Kind kind) const { return bytes_[size_t(kind)]; }
  int64_t total() const {
    int64_t sum = 0;
    for (int64_t b : bytes_) sum += b;
    return sum;
  }
  // "weights 2.08 | gradients 4.16 | ... | total 37.1 GiB"
  std::string summary() const {
    static constexpr const char* kNames[kKinds] = {"weights", "gradients", "optimizer", "activations", "workspace",
                                                   "exchange"};
    std::string out;
    char part[64];
    for (int k = 0; k < kKinds; ++k) {
      if (bytes_[size_t(k)] == 0) continue;
      std::snprintf(part, sizeof part, "%s %.2f | ", kNames[k], gib(bytes_[size_t(k)]));
      out += part;
    }
    std::snprintf(part, sizeof part, "total %.2f GiB", gib(total()));
    return out + part;
  }

 private:
  static double gib(int64_t bytes) { return double(bytes) / double(int64_t(1) << 30); }
  std::array<int64_t, kKinds> bytes_{};
};

}  // namespace moeut
