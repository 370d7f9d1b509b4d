// The routers' choices counted on the GPU (core/expert_load.h defines the buffer and is the CPU
// reference): each top-k's selections are added, with their routing weights, into device
// counters that stay there until a report reads them, so counting needs no host synchronisation
// and can be part of a captured CUDA graph.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "kernels/device_buffer.h"

namespace moeut::cuda {

class ExpertLoadCounter {
 public:
  explicit ExpertLoadCounter(int64_t size);  // counters: ExpertLoadLayout::size()
  // Adds n tokens' selections at `offset`: index [n, groups, k] numbered within each group of
  // experts_per_group (expert g · experts_per_group + index), weight alike.
  void count(int64_t offset, const int32_t* index, const float* weight, int64_t n, int64_t groups,
             int64_t experts_per_group, int64_t k, cudaStream_t stream);
  // The counts and then the weight sums since the last take (ExpertLoadLayout's buffer), once
  // the work on `stream` has finished; the counters start again from zero.
  std::vector<double> take(cudaStream_t stream);
  int64_t device_bytes() const { return int64_t(counts_.size() * sizeof(unsigned long long) + weights_.size() * sizeof(double)); }

 private:
  DeviceBuffer<unsigned long long> counts_;
  DeviceBuffer<double> weights_;
};

}  // namespace moeut::cuda
