// Named barriers: the warps of a block that call bar_sync(id, threads) wait until `threads`
// threads in all have synced or arrived at barrier id (0 is __syncthreads'); bar_arrive counts
// without waiting. Warp-specialised kernels hand work between warpgroups with them.
#pragma once

namespace moeut::cuda {

__device__ __forceinline__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace moeut::cuda
