#include "kernels/cuda_check.h"
#include "kernels/entropy_reg_cuda.h"
#include "kernels/lane_reduce.cuh"

namespace moeut::cuda {
namespace {

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

}  // namespace

EntropyReg::EntropyReg(int64_t layers, int64_t B, int64_t T, int64_t groups, int64_t E, int64_t R)
    : B_(B), T_(T), groups_(groups), E_(E), R_(R), mean_(size_t(layers * B * groups * E)), coef_(size_t(layers), 0.0) {}

void EntropyReg::clear(cudaStream_t stream) {
  MOEUT_CUDA_CHECK(cudaMemsetAsync(mean_.get(), 0, mean_.size() * sizeof(float), stream));
}

SoftmaxMeans EntropyReg::means(int64_t layer, float* lse) const {
  return {mean(layer), lse, T_, float(1.0 / double(T_ * R_))};
}

void EntropyReg::finish(int64_t layer, double coef, double* loss, cudaStream_t stream) {
  coef_.at(size_t(layer)) = coef;
  const int64_t rows = B_ * groups_;
  if (rows == 0) return;
  entropy_terms<<<unsigned((rows + 7) / 8), 256, 0, stream>>>(mean(layer), loss, int(rows), int(E_),
                                                              coef / double(rows));
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

SoftmaxGrad EntropyReg::gradient(int64_t layer, const float* z, const float* lse) const {
  return {z, lse, mean(layer), T_, float(coef_.at(size_t(layer)) / double(B_ * groups_) / double(T_ * R_))};
}

}  // namespace moeut::cuda
