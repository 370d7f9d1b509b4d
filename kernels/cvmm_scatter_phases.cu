// The scatter kernel (cvmm_scatter.cuh) instantiated with the phase clock, for the benchmarks and
// tests alone (cvmm_dev.h): each thread sums the clock cycles between the kernel's marks, by
// phase (ScatterPhase); threads 0 (multiplying) and kRowsThreads (adding) add them into their
// block's slots at the end.
#include <vector>

#include "kernels/cvmm_dev.h"
#include "kernels/cvmm_scatter.cuh"

namespace moeut::cuda {
namespace {

struct PhaseClock {
  unsigned long long* slots;  // [blocks][kScatterPhases]
  long long last = 0;
  unsigned long long cycles[kScatterPhases] = {};

  __device__ __forceinline__ void start() { last = clock64(); }
  __device__ __forceinline__ void stamp(ScatterPhase phase) {  // the time since the last mark, to `phase`
    const long long now = clock64();
    cycles[phase] += now - last;
    last = now;
  }
  __device__ __forceinline__ void add_into_block(int first, int end) const {
    for (int p = first; p < end; ++p) slots[blockIdx.x * kScatterPhases + p] += cycles[p];
  }

  __device__ __forceinline__ void tile_full() { stamp(kWaitTileFull); }
  __device__ __forceinline__ void tile_added(int rows) {
    stamp(kAdditions);
    cycles[kRows] += unsigned(rows);
  }
  __device__ __forceinline__ void finish_adding() {
    add_into_block(kWaitTileFull, kAdditions + 1);
    add_into_block(kRows, kRows + 1);
  }
  __device__ __forceinline__ void operands_landed() {
    stamp(kWaitOperands);
    ++cycles[kItems];
  }
  __device__ __forceinline__ void looked_up() { stamp(kLookups); }
  __device__ __forceinline__ void multiplied() { stamp(kProductsDone); }
  __device__ __forceinline__ void tile_empty() { stamp(kWaitTileEmpty); }
  __device__ __forceinline__ void tile_written() { stamp(kTileWritten); }
  __device__ __forceinline__ void loads_issued() { stamp(kLoadsIssued); }
  __device__ __forceinline__ void weight_grad_done() { stamp(kDweight); }
  __device__ __forceinline__ void finish_multiplying() {
    add_into_block(kWaitOperands, kDweight + 1);
    add_into_block(kItems, kItems + 1);
    unsigned sm;
    asm("mov.u32 %0, %%smid;" : "=r"(sm));
    slots[blockIdx.x * kScatterPhases + kSm] = sm;
  }
};

}  // namespace

ScatterPhaseClock cvmm_scatter_phase_cycles(const CvmmPlan& plan, const CvmmRowsArgs& a, cudaStream_t stream) {
  if (!cvmm_on_scatter_kernel(a)) throw std::invalid_argument("cvmm_scatter_phase_cycles: not a scatter-kernel product");
  DeviceBuffer<unsigned long long> slots(std::vector<unsigned long long>(size_t(device_facts().multiprocessors) * kScatterPhases, 0));
  const PhaseClock clock{.slots = slots.get()};
  cudaEvent_t begin, end;
  MOEUT_CUDA_CHECK(cudaEventCreate(&begin));
  MOEUT_CUDA_CHECK(cudaEventCreate(&end));
  MOEUT_CUDA_CHECK(cudaEventRecord(begin, stream));
  if (a.transpose_w) scatter::launch<true>(plan, a, clock, stream);
  else scatter::launch<false>(plan, a, clock, stream);
  MOEUT_CUDA_CHECK(cudaEventRecord(end, stream));
  MOEUT_CUDA_CHECK(cudaEventSynchronize(end));
  ScatterPhaseClock clocked{slots.download()};
  MOEUT_CUDA_CHECK(cudaEventElapsedTime(&clocked.ms, begin, end));
  MOEUT_CUDA_CHECK(cudaEventDestroy(begin));
  MOEUT_CUDA_CHECK(cudaEventDestroy(end));
  return clocked;
}

}  // namespace moeut::cuda
