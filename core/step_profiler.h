// Where a pass spends device time, by part (moeut-bench): the stream's clock read by a one-thread
// kernel at each change of part (a kernel, unlike an event, is replayed within a CUDA graph), read
// back only when asked for. Off by default.
#pragma once
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <vector>

#include "core/device_ledger.h"
#include "core/model.h"
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

// A training pass's forward and backward device time, always on: the stream's clock read into
// pinned host memory at the pass's start, where its backward starts and at its end (three
// one-thread kernels a pass, replayed within a CUDA graph as the rest of it is).
class PassClock {
 public:
  enum Mark { kStart, kBackward, kEnd, kMarks };
  PassClock() = default;
  explicit PassClock(cudaStream_t stream) : stream_(stream), ns_(kMarks) {}
  void mark(Mark m);
  // Once the pass's work is done: its marks' seconds added into `into`.
  void add_to(PassSeconds& into) const;

 private:
  cudaStream_t stream_ = nullptr;
  cuda::PinnedBuffer<uint64_t> ns_;
};

}  // namespace moeut
