#include "core/step_profiler.h"

#include <stdexcept>

#include "kernels/cuda_check.h"

namespace moeut {

namespace {

// The GPU's clock (ns) into *at, for the profile's marks.
__global__ void read_clock(uint64_t* at) {
  uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  *at = ns;
}

}  // namespace

StepProfiler::StepProfiler(DeviceLedger& ledger, size_t slots, cudaStream_t stream)
    : stream_(stream), clocks_(ledger.allocate<uint64_t>(DeviceLedger::Kind::kWorkspace, slots)) {}

const char* StepProfiler::part_name(Part p) {
  static const char* names[] = {"attention", "experts", "routing", "dense", "other"};
  return names[size_t(p)];
}

void StepProfiler::mark(Part p) {
  if (!on_) return;
  if (!parts_.empty() && parts_.back() == p) return;
  if (parts_.size() == clocks_.size())
    throw std::logic_error("StepProfiler: more changes of part in one pass than the profile has slots");
  read_clock<<<1, 1, 0, stream_>>>(clocks_.get() + parts_.size());
  MOEUT_CUDA_CHECK(cudaGetLastError());
  parts_.push_back(p);
}

void PassClock::mark(Mark m) {
  read_clock<<<1, 1, 0, stream_>>>(ns_.get() + m);  // pinned host memory, written through UVA
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

void PassClock::add_to(PassSeconds& into) const {
  const volatile uint64_t* ns = ns_.get();
  into.forward += double(ns[kBackward] - ns[kStart]) * 1e-9;
  into.backward += double(ns[kEnd] - ns[kBackward]) * 1e-9;
}

std::array<double, size_t(StepProfiler::Part::kCount)> StepProfiler::take() {
  std::array<double, size_t(Part::kCount)> seconds{};
  std::vector<uint64_t> ns(parts_.size());
  MOEUT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (!ns.empty())
    MOEUT_CUDA_CHECK(cudaMemcpy(ns.data(), clocks_.get(), ns.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost));
  for (size_t i = 0; i + 1 < ns.size(); ++i)
    if (parts_[i] != Part::kCount) seconds[size_t(parts_[i])] += double(ns[i + 1] - ns[i]) * 1e-9;
  parts_.clear();
  return seconds;
}

}  // namespace moeut
