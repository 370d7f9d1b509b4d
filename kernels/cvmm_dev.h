// For tests and benchmarks only (tests/gpu/, launch/dev/; library moeut_kernels_cuda_dev):
// production code does not include this header. Expert plans built on the host, and the scatter
// kernel's phase clock.
#pragma once
#include <iterator>
#include <vector>

#include "kernels/cvmm.h"
#include "kernels/cvmm_cuda.h"

namespace moeut::cuda {

// Device copies of a grouped CvmmSelection built on the host. The tokens, which the chunks of the
// tile list divide, are the rows of the product's side with fewer: a token's rows on one side,
// its selections' or its groups' on the other (CvmmRoute).
struct DeviceCvmmPlan : CvmmPlanBuffers {
  explicit DeviceCvmmPlan(const CvmmSelection& sel, int64_t tokens_per_chunk = kCvmmChunkTokens);
};

// The phases of a scatter-kernel item, as ScatterPhaseClock::cycles holds them: the multiplying
// warps' seven in the order they run, then the adding warps' two, then the items and the rows
// they added, and the multiprocessor the block ran on.
enum ScatterPhase { kWaitOperands, kLookups, kProductsDone, kWaitTileEmpty, kTileWritten, kLoadsIssued, kDweight,
                    kWaitTileFull, kAdditions, kItems, kRows, kSm };
inline constexpr const char* kScatterPhaseNames[] = {
    "multiplying: wait for the operands", "multiplying: lookups", "multiplying: products",
    "multiplying: wait for the tile buffer", "multiplying: tile into the buffer", "multiplying: loads issued",
    "multiplying: routing-weight gradient", "adding: wait for a tile", "adding: additions", "items", "rows", "multiprocessor"};
inline constexpr int kScatterPhases = int(std::size(kScatterPhaseNames));
static_assert(kScatterPhases == kSm + 1, "a name for every phase");

// The scatter kernel's phase clock (moeut-bench-cvmm --phases): runs the product of `a` (one that
// cvmm_on_scatter_kernel takes) once on the kernel's clocked instantiation, each block summing
// the clock cycles of every phase of its items and counting them: cycles[block · kScatterPhases +
// phase], a block per multiprocessor, and the run's time (events around the launch alone).
struct ScatterPhaseClock {
  std::vector<unsigned long long> cycles;
  float ms = 0;
};
ScatterPhaseClock cvmm_scatter_phase_cycles(const CvmmPlan& plan, const CvmmRowsArgs& a, cudaStream_t stream);

}  // namespace moeut::cuda
