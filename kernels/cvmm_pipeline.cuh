// The cvmm kernels' copies and scheduling (private to kernels/cvmm_*.cu): cp.async copies and the
// kStages pipeline, tensor maps, the release of the plan's tail counters, the device's facts and
// the launch with dynamic shared memory.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda_check.h"
#include "kernels/cvmm_cuda.h"
#include "kernels/tma.cuh"
#include "kernels/wgmma.cuh"

namespace moeut::cuda {

using bf16 = __nv_bfloat16;

// 16-byte asynchronous copy; src_bytes 0 writes zeros without reading (rows past a tile's end).
__device__ inline void cp_async16(void* smem, const void* gmem, int src_bytes = 16) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(gmem), "r"(src_bytes));
}
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ inline void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Copies 8 consecutive bf16 from src (valid: how many of them exist) into dst; 16-byte
// asynchronous copy when whole and aligned (zeros when none is valid), element by element with
// zero fill otherwise.
__device__ inline void load8(bf16* dst, const bf16* src, int valid, bool aligned) {
  if (valid <= 0 || (valid >= 8 && aligned)) {
    cp_async16(dst, src, valid > 0 ? 16 : 0);
  } else {
    for (int i = 0; i < 8; ++i) dst[i] = i < valid ? src[i] : __float2bfloat16(0.f);
  }
}

// Three stages keep two blocks per SM (96 KB each; registers allow no more), and give products
// with K <= 128 (two k-steps) both steps' copies in flight at once.
inline constexpr int kStages = 3;

// The main loop of the per-tile and weight-gradient kernels: `steps` steps through a cp.async
// pipeline of kStages shared-memory stages, copies issued kStages - 1 steps ahead. load(stage,
// step) issues a step's copies; landed(stage, step) runs in each thread on its own copies once
// they have landed; mma(stage) issues the warpgroup's products and commits them. Each step waits
// for its products before the next begins, so a stage is refilled only after a barrier that every
// thread reaches with its products done. (Leaving one group of products running would need a fourth stage, which
// costs the second block per SM.)
template <class Load, class Landed, class Mma>
__device__ __forceinline__ void pipeline(int steps, Load load, Landed landed, Mma mma) {
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < steps) load(s, s);
    cp_async_commit();
  }
  for (int t = 0; t < steps; ++t) {
    cp_async_wait<kStages - 2>();
    landed(t % kStages, t);
    wgmma::fence_shared_for_async();
    __syncthreads();
    mma(t % kStages);
    if (t + kStages - 1 < steps) load((t + kStages - 1) % kStages, t + kStages - 1);
    cp_async_commit();
    wgmma::wait<0>();
  }
  cp_async_wait<0>();
  __syncthreads();
}

// Called by one thread of each block once the block is done with the plan's counters (every
// atomic it sent them answered and its value used, so no fence is needed before the count; a
// fence here would make ptxas keep the kernels' float atomics as ATOMG, each waiting for its
// reply): the launch's last block zeroes the first `used` counters
// and the count of finished blocks, tail_counters[kCvmmTailCounters], for the next launch.
__device__ __forceinline__ void release_tail_counters(const CvmmPlan& plan, int used) {
  if (atomicAdd(&plan.tail_counters[kCvmmTailCounters], 1u) == gridDim.x - 1) {
    for (int g = 0; g < used; ++g) plan.tail_counters[g] = 0;
    plan.tail_counters[kCvmmTailCounters] = 0;
  }
}

template <class Kernel, class... Args>
void launch_with_smem(Kernel kernel, dim3 grid, int threads, size_t smem_bytes, cudaStream_t stream, const Args&... args) {
  MOEUT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem_bytes)));
  kernel<<<grid, threads, smem_bytes, stream>>>(args...);
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

// The current device's SM count and L2 size, asked of the runtime only when the device changes
// (the persistent kernel launches one block per SM, over a hundred times per 1B step).
struct DeviceFacts {
  int multiprocessors = 0, l2_bytes = 0;
};
inline DeviceFacts device_facts() {
  thread_local int device_seen = -1;
  thread_local DeviceFacts facts;
  int device = 0;
  MOEUT_CUDA_CHECK(cudaGetDevice(&device));
  if (device != device_seen) {
    MOEUT_CUDA_CHECK(cudaDeviceGetAttribute(&facts.multiprocessors, cudaDevAttrMultiProcessorCount, device));
    MOEUT_CUDA_CHECK(cudaDeviceGetAttribute(&facts.l2_bytes, cudaDevAttrL2CacheSize, device));
    device_seen = device;
  }
  return facts;
}

// A bf16 matrix [rows, width] in boxes of box_rows x 64 columns, 128-byte swizzle.
inline CUtensorMap tensor_map(const bf16* base, int64_t width, int64_t rows, int box_rows) {
  return tma::bf16_map<2>(base, {cuuint64_t(width), cuuint64_t(rows)}, {cuuint64_t(width) * sizeof(bf16)},
                          {64, cuuint32_t(box_rows)});
}

}  // namespace moeut::cuda
