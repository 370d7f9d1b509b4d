#include <cmath>

#include "kernels/cuda_check.h"
#include "kernels/entropy_reg_cuda.h"
#include "kernels/with_ceiling.h"
#include "kernels/lane_reduce.cuh"

namespace moeut::cuda {
namespace {

constexpr int kThreads = 256;

// accumulate_mean's positions per block, for L lanes per position. 16 at 32 lanes, so that the
// FFN's 16 x 1024 positions make 1,024 blocks (with 64: 256 blocks, under two per SM, 46.5 us a
// call against 26.3, H100, PERFORMANCE v21). 64 below: attention's (b, g) rows have few experts,
// and more blocks per row contend on the same E means (13.6 us a call at 64, 17.6 at 16).
__host__ __device__ constexpr int positions_per_block(int L) { return L == 32 ? 16 : 64; }

// A position's E logits are handled by L lanes of a warp, about kExpertsPerLane each (L: the
// power of two at or above E / kExpertsPerLane, from 4 to 32), 32 / L positions per warp:
// attention's 12 experts take 4 lanes, 3 each, instead of 16 lanes with 4 idle, so a warp covers
// 8 positions and each lane has 3 loads in flight (these kernels wait on memory latency at such
// small rows: 14–23 µs a call for 4.7 MB at 1B b16). Every lane of a warp runs each reduction
// (positions past the end with a clamped row, their results unused).
constexpr int64_t kExpertsPerLane = 4;
int64_t lane_target(int64_t E) { return (E + kExpertsPerLane - 1) / kExpertsPerLane; }
// Log-sum-exp over the E logits at z; lane: this lane's index within its L.
template <int L>
__device__ inline float position_lse(const float* z, int E, int lane) {
  float mx = -INFINITY;
  for (int e = lane; e < E; e += L) mx = fmaxf(mx, z[e]);
  mx = group_max<L>(mx);
  float s = 0.f;
  for (int e = lane; e < E; e += L) s += __expf(z[e] - mx);
  return mx + __logf(group_sum<L>(s));
}

// Sums softmax(z) over the positions of (b, g) into mean[b, g, :]; block (chunk, g, b). The
// warp's positions are summed by shuffles first (lanes L, 2L, ... apart hold the same expert), so
// its first L lanes alone add into shared memory.
template <int L>
__global__ void accumulate_mean(float* mean, const float* z, int T, int groups, int E, float inv_S) {
  extern __shared__ float part[];  // [E]
  constexpr int kPerWarp = 32 / L;
  const int g = blockIdx.y, b = blockIdx.z, lane = threadIdx.x % L, warp = threadIdx.x / 32;
  for (int e = threadIdx.x; e < E; e += blockDim.x) part[e] = 0.f;
  __syncthreads();
  constexpr int kPositions = positions_per_block(L);
  const int t_end = min(T, int(blockIdx.x + 1) * kPositions);
  for (int t0 = int(blockIdx.x) * kPositions + warp * kPerWarp; t0 < t_end; t0 += kThreads / L) {
    const int t = t0 + threadIdx.x % 32 / L;
    const float* zp = z + ((int64_t(b) * T + min(t, t_end - 1)) * groups + g) * E;
    const float lse = position_lse<L>(zp, E, lane);
    for (int e0 = 0; e0 < E; e0 += L) {  // the same steps in every lane, for the shuffles
      const int e = e0 + lane;
      float p = t < t_end && e < E ? __expf(zp[e] - lse) * inv_S : 0.f;
#pragma unroll
      for (int o = L; o < 32; o *= 2) p += __shfl_xor_sync(0xffffffffu, p, o);
      if (threadIdx.x % 32 < L && e < E) atomicAdd(&part[e], p);
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) atomicAdd(&mean[(int64_t(b) * groups + g) * E + e], part[e]);
}

// Per (b, g): loss += coef/count · Σ m log m; mean becomes log m + 1 (the entropy's gradient
// w.r.t. m, up to the factor). One warp per (b, g).
__global__ void entropy_terms(float* mean, double* loss, int rows, int E, double scale) {
  const int r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (r >= rows) return;
  float* m = mean + int64_t(r) * E;
  float h = 0.f;
  for (int e = lane; e < E; e += 32) {
    const float lm = __logf(m[e]);
    h += m[e] * lm;
    m[e] = lm + 1.f;
  }
  h = warp_sum(h);
  if (lane == 0) atomicAdd(loss, scale * double(h));
}

// dz[s, e] = scale · p[s, e] · (c[e] − Σ_e' p[s, e'] c[e']); L lanes per position. dz may be z:
// each lane reads its logits for the sums before it overwrites them.
template <int L>
__global__ void entropy_grad(float* dz, const float* z, const float* c, int64_t positions, int T, int groups, int E,
                             float scale) {
  const int64_t first = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32 * 32 / L;  // the warp's first
  if (first >= positions) return;  // whole warps only
  const int64_t pos = first + threadIdx.x % 32 / L;  // (b, t, g)
  const int lane = threadIdx.x % L;
  const int64_t at = min(pos, positions - 1);
  const int g = int(at % groups);
  const int64_t b = at / groups / T;
  const float* zp = z + at * E;
  const float* cp = c + (b * groups + g) * E;
  const float lse = position_lse<L>(zp, E, lane);
  float dot = 0.f;
  for (int e = lane; e < E; e += L) dot += __expf(zp[e] - lse) * cp[e];
  dot = group_sum<L>(dot);
  if (pos < positions)
    for (int e = lane; e < E; e += L) dz[pos * E + e] = scale * __expf(zp[e] - lse) * (cp[e] - dot);
}

}  // namespace

EntropyReg::EntropyReg(int64_t B, int64_t groups, int64_t E)
    : B_(B), groups_(groups), E_(E), mean_(size_t(B * groups * E)) {}

void EntropyReg::forward_backward(const std::vector<float*>& duses, const std::vector<const float*>& uses, int64_t T,
                                  double coef, double* loss, cudaStream_t stream) {
  const int64_t R = int64_t(uses.size()), S = T * R, rows = B_ * groups_;
  if (rows == 0) return;
  MOEUT_CUDA_CHECK(cudaMemsetAsync(mean_.get(), 0, mean_.size() * sizeof(float), stream));
  with_ceiling<4, 8, 16, 32>(lane_target(E_), [&](auto L) {
    constexpr int kPositions = positions_per_block(L);
    const dim3 grid(unsigned((T + kPositions - 1) / kPositions), unsigned(groups_), unsigned(B_));
    for (const float* z : uses)
      accumulate_mean<L><<<grid, kThreads, E_ * sizeof(float), stream>>>(mean_.get(), z, int(T), int(groups_), int(E_),
                                                                          float(1.0 / double(S)));
  });
  MOEUT_CUDA_CHECK(cudaGetLastError());
  entropy_terms<<<unsigned((rows + 7) / 8), 256, 0, stream>>>(mean_.get(), loss, int(rows), int(E_), coef / double(rows));
  MOEUT_CUDA_CHECK(cudaGetLastError());
  const int64_t positions = B_ * T * groups_;
  with_ceiling<4, 8, 16, 32>(lane_target(E_), [&](auto L) {
    const int64_t per_block = 256 / L;
    for (int64_t r = 0; r < R; ++r)
      entropy_grad<L><<<unsigned((positions + per_block - 1) / per_block), 256, 0, stream>>>(
          duses[r], uses[r], mean_.get(), positions, int(T), int(groups_), int(E_), float(coef / double(rows) / double(S)));
  });
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeut::cuda
