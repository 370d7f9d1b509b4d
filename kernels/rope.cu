#include <type_traits>

#include "kernels/cuda_check.h"
#include "kernels/rope_cuda.h"

namespace moeut::cuda {
namespace {

// V consecutive bf16, loaded and stored as one access of 2·V bytes.
template <int V>
struct Pack {
  using Word = std::conditional_t<V == 8, uint4, std::conditional_t<V == 4, uint2, std::conditional_t<V == 2, uint32_t, unsigned short>>>;
  union {
    Word word;
    __nv_bfloat16 v[V];
  };
};

// One thread per token row (b, t) and V consecutive rotated pairs i0 .. i0 + V - 1: their angles are
// computed once for all H heads (the heads share them), and each head's two halves move in one
// access each. Frequencies in fp32 as the official implementation computes them: 1 / base^(2i/n),
// angle = t * freq. (One thread per pair and head, with 2-byte accesses, would recompute the
// sines and powers per head and spend much of its time on them.)
template <int V>
__global__ void rope_kernel(__nv_bfloat16* x, int64_t rows, int T, int H, int dh, int64_t ld, int n_rot,
                            float direction) {
  const int half = n_rot / 2, groups = half / V;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * groups) return;
  const int64_t row = idx / groups;
  const int i0 = int(idx % groups) * V, t = int(row % T);
  float c[V], s[V];
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const float freq = 1.f / powf(10000.f, float(2 * (i0 + k)) / float(n_rot));
    sincosf(float(t) * freq, &s[k], &c[k]);
    s[k] *= direction;
  }
  for (int h = 0; h < H; ++h) {
    __nv_bfloat16* u = x + row * ld + int64_t(h) * dh + i0;
    Pack<V> lo, hi;
    lo.word = *reinterpret_cast<const typename Pack<V>::Word*>(u);
    hi.word = *reinterpret_cast<const typename Pack<V>::Word*>(u + half);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float a = __bfloat162float(lo.v[k]), b = __bfloat162float(hi.v[k]);
      lo.v[k] = __float2bfloat16(a * c[k] - b * s[k]);
      hi.v[k] = __float2bfloat16(b * c[k] + a * s[k]);
    }
    *reinterpret_cast<typename Pack<V>::Word*>(u) = lo.word;
    *reinterpret_cast<typename Pack<V>::Word*>(u + half) = hi.word;
  }
}

void launch(__nv_bfloat16* x, int64_t B, int64_t T, int64_t H, int64_t dh, int64_t ld, int64_t n_rot, float direction,
            cudaStream_t stream) {
  const int64_t rows = B * T, half = n_rot / 2;
  if (rows == 0 || half == 0) return;
  ld = ld ? ld : H * dh;
  // The widest access that every head's halves allow: half, dh and ld multiples of V elements,
  // x aligned to 2·V bytes.
  auto fits = [&](int V) {
    return half % V == 0 && dh % V == 0 && ld % V == 0 && reinterpret_cast<uintptr_t>(x) % (2 * V) == 0;
  };
  auto run = [&](auto kernel, int V) {
    const int64_t threads = rows * (half / V);
    kernel<<<unsigned((threads + 255) / 256), 256, 0, stream>>>(x, rows, int(T), int(H), int(dh), ld, int(n_rot),
                                                                direction);
  };
  if (fits(8)) run(rope_kernel<8>, 8);
  else if (fits(4)) run(rope_kernel<4>, 4);
  else if (fits(2)) run(rope_kernel<2>, 2);
  else run(rope_kernel<1>, 1);
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void rope_forward(__nv_bfloat16* x, int64_t B, int64_t T, int64_t H, int64_t dh, int64_t n_rot, cudaStream_t stream) {
  launch(x, B, T, H, dh, 0, n_rot, 1.f, stream);
}

void rope_backward(__nv_bfloat16* dx, int64_t B, int64_t T, int64_t H, int64_t dh, int64_t n_rot, cudaStream_t stream,
                   int64_t ld) {
  launch(dx, B, T, H, dh, ld, n_rot, -1.f, stream);
}

}  // namespace moeut::cuda
