// Where a pass spends device time, by part (moeut-bench): the stream's clock read by a one-thread
// kernel at each change of part (a kernel, unlike an event, is replayed within a CUDA graph), read
// back only when asked for. Off by default.
#pragma once
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <vector>

#include "core/device_ledger.h"
#include "kernels/device_buffer.h"

namespace moeut {

class StepProfiler {
 public:
  enum class Part { kAttention, kExperts, kRouting, kDense, kOther, kCount };
  static const char* part_name(Part p);

  StepProfiler() = default;
  // Room for `slots` marks a pass (allocated through ledger), read on `stream`.
  StepProfiler(DeviceLedger& ledger, size_t slots, cudaStream_t stream);

  void set_on(bool on) { on_ = on; }
  bool on() const { return on_; }
  // The work queued on the stream from here on belongs to p (kCount: none). Nothing when off.
  void mark(Part p);
  void clear() { parts_.clear(); }  // a new pass starts
  // Device seconds per part of the marks since clear() (waits for the work).
  std::array<double, size_t(Part::kCount)> take();
  // The part that each mark of the pass starts: a replayed CUDA graph leaves them as its
  // captured pass did.
  const std::vector<Part>& parts() const { return parts_; }
  void set_parts(const std::vector<Part>& parts) { parts_ = parts; }

 private:
  cudaStream_t stream_ = nullptr;
  bool on_ = false;
  cuda::DeviceBuffer<uint64_t> clocks_;  // the clock at each mark of the pass (ns)
  std::vector<Part> parts_;
};

}  // namespace moeut
