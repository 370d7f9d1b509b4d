// Hopper warpgroup matrix products (wgmma, sm_90a) on bf16 tiles in shared memory, and the
// 128-byte swizzled tile layout they read. Device code only.
//
// Tile layout: a tile of R rows x C columns (C a multiple of 64) is stored as C/64 slabs, each
// R rows of 64 bf16 (128 bytes); inside a group of 8 rows, 16-byte chunk c of row r sits at
// chunk c ^ (r % 8) (the hardware's 128-byte swizzle). Slabs start 1024-byte aligned.
// The same layout serves both operand orders of wgmma:
//  - K-major (rows are M or N, columns are K, one slab of 64 K): rows 128 bytes apart, groups of 8
//    rows 1024 bytes apart; the k-th 16-deep step starts 32·k bytes in.
//  - MN-major (rows are K, columns are M or N): 64 M/N per slab, slabs `slab_bytes` apart (the
//    descriptor's leading offset), groups of 8 K-rows 1024 bytes apart (its stride offset); the
//    k-th 16-deep step starts 2048·k bytes in.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

namespace moeut::cuda::wgmma {

// Byte offset of 16-byte chunk `chunk` (0..7 within its 64-column slab) of row `row`.
__device__ __forceinline__ uint32_t swizzled_chunk(uint32_t row, uint32_t chunk) {
  return row * 128 + ((chunk ^ (row & 7)) << 4);
}

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Shared-memory matrix descriptor with the 128-byte swizzle.
__device__ __forceinline__ uint64_t descriptor(uint32_t smem_addr, uint32_t leading_bytes, uint32_t stride_bytes) {
  return uint64_t((smem_addr & 0x3FFFF) >> 4) | uint64_t((leading_bytes >> 4) & 0x3FFF) << 16 |
         uint64_t((stride_bytes >> 4) & 0x3FFF) << 32 | uint64_t(1) << 62;
}
// K-major operand: the 64 rows starting at `rows_addr`, k-step `k16`.
__device__ __forceinline__ uint64_t k_major(uint32_t rows_addr, int k16) {
  return descriptor(rows_addr + 32 * k16, 16, 1024);
}
// MN-major operand: slabs from `slab_addr`, `slab_bytes` apart, k-step `k16`.
__device__ __forceinline__ uint64_t mn_major(uint32_t slab_addr, uint32_t slab_bytes, int k16) {
  return descriptor(slab_addr + 2048 * k16, slab_bytes, 1024);
}

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Shared memory written by ordinary or cp.async stores, read next by wgmma (the async proxy).
__device__ __forceinline__ void fence_shared_for_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Accumulator element j (0..63) of a thread in an m64n128 fragment: row and column in the tile.
__device__ __forceinline__ int acc_row(int j) { return int(threadIdx.x % 128 / 32) * 16 + int(threadIdx.x % 32 / 4) + 8 * ((j / 2) % 2); }
__device__ __forceinline__ int acc_col(int j) { return (j / 4) * 8 + int(threadIdx.x % 4) * 2 + (j % 2); }

// The 64 fp32 accumulators of an m64n128 product, as inline-assembly operands %0..%63.
#define MOEUT_WGMMA_D64_OPERANDS                                                              \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                   \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "          \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "          \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
#define MOEUT_WGMMA_D64(d)                                                                    \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),      \
  "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),    \
  "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),    \
  "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),    \
  "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),    \
  "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),    \
  "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),    \
  "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// The 32 fp32 accumulators of an m64n64 product, as operands %0..%31.
#define MOEUT_WGMMA_D32_OPERANDS                                                              \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                   \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
#define MOEUT_WGMMA_D32(d)                                                                    \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),      \
  "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),    \
  "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),    \
  "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

// d[64x128] (+)= A[64x16] · B[16x128], fp32 accumulators, bf16 operands from shared memory.
// kTransA/kTransB: 1 when that operand is MN-major. accumulate = false overwrites d.
template <int kTransA, int kTransB>
__device__ __forceinline__ void mma_m64n128k16(float (&d)[64], uint64_t a, uint64_t b, bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      MOEUT_WGMMA_D64_OPERANDS
      "%64, %65, p, 1, 1, %67, %68;\n}\n"
      : MOEUT_WGMMA_D64(d)
      : "l"(a), "l"(b), "r"(int(accumulate)), "n"(kTransA), "n"(kTransB));
}

// The same with A from registers: a[4] holds this thread's part of A[64x16] in the layout of an
// m64n16 accumulator's elements 0..7 packed as bf16 pairs (so an accumulator, rounded, can be
// the A operand of the next product, as flash attention's P is for P·V).
template <int kTransB>
__device__ __forceinline__ void mma_m64n128k16_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"  // always accumulates
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      MOEUT_WGMMA_D64_OPERANDS
      "{%64, %65, %66, %67}, %68, p, 1, 1, %69;\n}\n"
      : MOEUT_WGMMA_D64(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(kTransB));
}

// d[64x64] (+)= A[64x16] · B[16x64], both from shared memory; as mma_m64n128k16.
template <int kTransA, int kTransB>
__device__ __forceinline__ void mma_m64n64k16(float (&d)[32], uint64_t a, uint64_t b, bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      MOEUT_WGMMA_D32_OPERANDS
      "%32, %33, p, 1, 1, %35, %36;\n}\n"
      : MOEUT_WGMMA_D32(d)
      : "l"(a), "l"(b), "r"(int(accumulate)), "n"(kTransA), "n"(kTransB));
}

}  // namespace moeut::cuda::wgmma
