// Expert-load counting: a histogram of selections per expert, with routing-weight sums.
// Layout: one block-wide shared histogram of the experts_per_group · groups experts a call
// covers (at most kMaxExperts), filled by a grid-stride loop over the n · groups · k selections
// with shared-memory atomics; then each block adds its non-zero bins into the global counters
// (64-bit integers, doubles), so global atomics number blocks × experts, not selections.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/cuda_check.h"
#include "kernels/expert_load_cuda.h"

namespace moeut::cuda {
namespace {

constexpr int kThreads = 256, kMaxExperts = 4096;

__global__ void count_kernel(unsigned long long* counts, double* weights, const int32_t* index, const float* weight,
                             int64_t selections, int groups, int experts_per_group, int k) {
  __shared__ unsigned int bin_count[kMaxExperts];
  __shared__ float bin_weight[kMaxExperts];
  const int experts = groups * experts_per_group;
  for (int e = threadIdx.x; e < experts; e += blockDim.x) bin_count[e] = 0, bin_weight[e] = 0.f;
  __syncthreads();
  for (int64_t s = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; s < selections; s += int64_t(gridDim.x) * blockDim.x) {
    const int e = int(s / k % groups) * experts_per_group + index[s];
    atomicAdd(&bin_count[e], 1u);
    atomicAdd(&bin_weight[e], weight[s]);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < experts; e += blockDim.x)
    if (bin_count[e]) {
      atomicAdd(&counts[e], (unsigned long long)bin_count[e]);
      atomicAdd(&weights[e], double(bin_weight[e]));
    }
}

}  // namespace

ExpertLoadCounter::ExpertLoadCounter(int64_t size) : counts_(size_t(size)), weights_(size_t(size)) {
  MOEUT_CUDA_CHECK(cudaMemset(counts_.get(), 0, counts_.size() * sizeof(unsigned long long)));
  MOEUT_CUDA_CHECK(cudaMemset(weights_.get(), 0, weights_.size() * sizeof(double)));
}

void ExpertLoadCounter::count(int64_t offset, const int32_t* index, const float* weight, int64_t n, int64_t groups,
                              int64_t experts_per_group, int64_t k, cudaStream_t stream) {
  if (groups * experts_per_group > kMaxExperts || offset + groups * experts_per_group > int64_t(counts_.size()))
    throw std::invalid_argument("ExpertLoadCounter::count: " + std::to_string(groups * experts_per_group) +
                                " experts at offset " + std::to_string(offset) + " exceed the counters");
  const int64_t selections = n * groups * k;
  if (selections == 0) return;
  // A few blocks per multiprocessor's worth of work: each adds every expert once at the end.
  const int blocks = int(std::min<int64_t>((selections + kThreads - 1) / kThreads, 264));
  count_kernel<<<blocks, kThreads, 0, stream>>>(counts_.get() + offset, weights_.get() + offset, index, weight,
                                                 selections, int(groups), int(experts_per_group), int(k));
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

std::vector<double> ExpertLoadCounter::take(cudaStream_t stream) {
  const size_t n = counts_.size();
  std::vector<unsigned long long> counts(n);
  std::vector<double> out(2 * n);
  MOEUT_CUDA_CHECK(cudaMemcpyAsync(counts.data(), counts_.get(), n * sizeof(unsigned long long), cudaMemcpyDeviceToHost, stream));
  MOEUT_CUDA_CHECK(cudaMemcpyAsync(out.data() + n, weights_.get(), n * sizeof(double), cudaMemcpyDeviceToHost, stream));
  MOEUT_CUDA_CHECK(cudaMemsetAsync(counts_.get(), 0, n * sizeof(unsigned long long), stream));
  MOEUT_CUDA_CHECK(cudaMemsetAsync(weights_.get(), 0, n * sizeof(double), stream));
  MOEUT_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::transform(counts.begin(), counts.end(), out.begin(), [](unsigned long long c) { return double(c); });
  return out;
}

}  // namespace moeut::cuda
