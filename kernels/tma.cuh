// Hopper's tensor memory access (TMA) and the shared-memory barriers its copies complete on: the
// device side (mbarriers, box copies in, bulk copies and reductions out) and the host side
// (tensor maps of bf16 tensors, 128-byte swizzled boxes of 64 columns: the layout wgmma.cuh's
// descriptors read).
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>

#include <stdexcept>
#include <string>

#include "kernels/cuda_check.h"
#include "kernels/wgmma.cuh"

namespace moeut::cuda::tma {

// ---- Device: mbarriers (shared memory, 8 bytes) ----
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(wgmma::smem_address(bar)), "r"(count) : "memory");
}
// Makes barriers just initialised visible to the tensor copies (the async proxy).
__device__ __forceinline__ void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// One arrival that also tells the barrier `bytes` more are to land in this phase.
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(wgmma::smem_address(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(wgmma::smem_address(bar)) : "memory");
}
// Arrives once all of this thread's earlier cp.async copies have landed (counted in the init).
__device__ __forceinline__ void mbar_arrive_on_copies(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(wgmma::smem_address(bar)) : "memory");
}
// Waits for the end of the barrier's phase of this parity.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(wgmma::smem_address(bar)), "r"(parity)
      : "memory");
}

// ---- Device: box copies into shared memory, completing on an mbarrier ----
__device__ __forceinline__ void load_2d(void* dst, const CUtensorMap* map, int c0, int c1, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          wgmma::smem_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(wgmma::smem_address(bar))
      : "memory");
}
__device__ __forceinline__ void load_4d(void* dst, const CUtensorMap* map, int c0, int c1, int c2, int c3, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(wgmma::smem_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(wgmma::smem_address(bar))
      : "memory");
}

// ---- Device: bulk copies of shared memory out to global memory, in this thread's bulk group ----
// dst[0, bytes) += src[0, bytes) as fp32, added by the L2 (bytes and both addresses in whole 16 bytes).
__device__ __forceinline__ void bulk_add_f32(float* dst, const float* src, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(wgmma::smem_address(src)), "r"(bytes)
               : "memory");
}
// dst[0, bytes) = src[0, bytes), fp32 rows copied as they are (bytes and both addresses in whole
// 16 bytes).
__device__ __forceinline__ void bulk_store(float* dst, const float* src, int bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(wgmma::smem_address(src)),
               "r"(bytes)
               : "memory");
}
// Closes this thread's bulk group; then waits until its copies have read shared memory (which may
// then be overwritten), or until they have completed.
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// ---- Host: tensor maps ----
// cuTensorMapEncodeTiled, from the driver (the runtime does not link it).
inline PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    MOEUT_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
    if (!fn || found != cudaDriverEntryPointSuccess) throw std::runtime_error("cuTensorMapEncodeTiled not found");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// A bf16 tensor of kRank dimensions (dims[0] contiguous; strides in bytes for dims 1.., each a
// multiple of 16) in boxes of `box` elements whose first extent is 64 (128 bytes, the swizzle's
// span). Reads past any dimension's end land as zeros.
template <int kRank>
CUtensorMap bf16_map(const __nv_bfloat16* base, const cuuint64_t (&dims)[kRank], const cuuint64_t (&strides)[kRank - 1],
                     const cuuint32_t (&box)[kRank]) {
  cuuint32_t unit[kRank];
  for (cuuint32_t& u : unit) u = 1;
  CUtensorMap map;
  const CUresult r = encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, kRank, const_cast<__nv_bfloat16*>(base), dims,
                               strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) throw std::runtime_error("cuTensorMapEncodeTiled failed: " + std::to_string(int(r)));
  return map;
}

}  // namespace moeut::cuda::tma
