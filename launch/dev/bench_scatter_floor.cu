// moeut-bench-scatter-floor [TOKENS]: the floor of the FFN scatters (down product, up input
// gradient) at the 1B shapes: the additions of their 128 x 128 fp32 tiles into token rows
// of [TOKENS, 1536] alone, with no product and no loads. The routing of moeut-bench-cvmm
// (launch/dev/bench_routing.h: each token's experts drawn at random, seed 1), row tiles of 128 selections of one expert (the last of an expert
// padded with its first row), the additions made three ways, with tiles taken band by band
// (every tile of output columns [n0, n0 + 128) before the next band: the cvmm kernels' order)
// and row by row:
//  - the L2's bulk reduction from shared memory, one 512-byte row per copy;
//  - 16-byte vector atomics from the threads;
//  - plain 16-byte stores (no addition), for the bandwidth of the same access pattern;
//  - 16-byte vector atomics of bf16 pairs into bf16 rows: what the scatters would cost with their
//    sums kept in bf16 (half the bytes), which the training does not do: what that precision
//    would be worth.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include "kernels/cuda_check.h"
#include "kernels/device_buffer.h"
#include "launch/dev/bench_routing.h"
#include "launch/dev/cuda_timing.h"

namespace {

constexpr int kD = 1536, kTile = 128, kThreads = 256, kPad = 4;
enum class Add { kBulk, kVector, kStore, kVectorBf16 };

// Element type of the rows added into.
template <Add kAdd>
using Out = std::conditional_t<kAdd == Add::kVectorBf16, __nv_bfloat16, float>;

template <Add kAdd>
__global__ void __launch_bounds__(kThreads) add_tiles(Out<kAdd>* out, const int32_t* rows, int tiles, bool by_band) {
  extern __shared__ __align__(128) float tile[];  // [kTile][kTile + kPad]
  const int t = by_band ? int(blockIdx.x) % tiles : int(blockIdx.x) / (kD / kTile);
  const int n0 = (by_band ? int(blockIdx.x) / tiles : int(blockIdx.x) % (kD / kTile)) * kTile;
  const int32_t* r = rows + int64_t(t) * kTile;
  if constexpr (kAdd == Add::kBulk) {
    for (int i = threadIdx.x; i < kTile * (kTile + kPad); i += kThreads) tile[i] = 1.f;
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    if (threadIdx.x < kTile)
      asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(
                       out + int64_t(r[threadIdx.x]) * kD + n0),
                   "r"(static_cast<unsigned>(__cvta_generic_to_shared(tile + threadIdx.x * (kTile + kPad)))),
                   "r"(kTile * 4)
                   : "memory");
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
  } else if constexpr (kAdd == Add::kVectorBf16) {
    const uint32_t one = 0x3f803f80u;  // two bf16 ones
    for (int i = threadIdx.x; i < kTile * kTile / 8; i += kThreads) {
      __nv_bfloat16* at = out + int64_t(r[i / (kTile / 8)]) * kD + n0 + (i % (kTile / 8)) * 8;
      asm volatile("red.global.add.noftz.v4.bf16x2 [%0], {%1, %1, %1, %1};\n" ::"l"(at), "r"(one) : "memory");
    }
  } else {
    for (int i = threadIdx.x; i < kTile * kTile / 4; i += kThreads) {
      float4* at = reinterpret_cast<float4*>(out + int64_t(r[i / (kTile / 4)]) * kD + n0 + (i % (kTile / 4)) * 4);
      const float4 v = make_float4(1.f, 1.f, 1.f, 1.f);
      if constexpr (kAdd == Add::kVector) atomicAdd(at, v);
      else *at = v;
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  using namespace moeut;
  const int64_t tokens = argc > 1 ? std::atoll(argv[1]) : 16384;
  Rng rng(1);
  const CvmmSelection sel = bench::ffn_routing(tokens, &rng);
  std::vector<int32_t> rows;  // each expert's token rows, its last tile padded with its first row
  for (int64_t e = 0; e < bench::kFfnExperts; ++e)
    for (int64_t p = sel.expert_begin[e]; p < sel.expert_begin[e + 1]; p += kTile)
      for (int64_t i = 0; i < kTile; ++i)
        rows.push_back(sel.in_row[size_t(sel.by_expert[size_t(p + i < sel.expert_begin[e + 1] ? p + i : p)])]);
  const int tiles = int(rows.size() / kTile);
  const cuda::DeviceBuffer<int32_t> d_rows(rows);
  cuda::DeviceBuffer<float> out(size_t(tokens) * kD);
  MOEUT_CUDA_CHECK(cudaMemset(out.get(), 0, out.size() * sizeof(float)));
  // bf16 rows [tokens, kD] over the first half of the same buffer.
  __nv_bfloat16* out_bf16 = reinterpret_cast<__nv_bfloat16*>(out.get());
  const int smem = kTile * (kTile + kPad) * sizeof(float);
  const double bytes = double(rows.size()) * kD * sizeof(float);
  std::printf("%lld tokens, %d experts, top-%d: %d row tiles (%zu rows with padding), %.2f GB of fp32 additions\n",
              static_cast<long long>(tokens), int(bench::kFfnExperts), int(bench::kFfnTopK), tiles, rows.size(), bytes / 1e9);
  // The bytes added are half as many for bf16 rows.
  auto time = [&](const char* name, auto kernel, auto* rows_out, bool by_band) {
    MOEUT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const double ms = bench::median_ms([&] {
      kernel<<<unsigned(tiles * (kD / kTile)), kThreads, smem>>>(rows_out, d_rows.get(), tiles, by_band);
      MOEUT_CUDA_CHECK(cudaGetLastError());
    });
    const double added = bytes * sizeof(*rows_out) / sizeof(float);
    std::printf("  %-28s %-12s %7.3f ms  %5.2f TB/s\n", name, by_band ? "band by band" : "row by row", ms,
                added / (ms * 1e-3) / 1e12);
  };
  for (const bool by_band : {true, false}) {
    time("bulk reduction (f32)", add_tiles<Add::kBulk>, out.get(), by_band);
    time("16-byte vector atomics", add_tiles<Add::kVector>, out.get(), by_band);
    time("16-byte stores (no add)", add_tiles<Add::kStore>, out.get(), by_band);
    time("16-byte atomics, bf16 rows", add_tiles<Add::kVectorBf16>, out_bf16, by_band);
  }
  return 0;
}
