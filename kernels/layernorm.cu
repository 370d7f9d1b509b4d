#include <algorithm>
#include <initializer_list>
#include <stdexcept>
#include <type_traits>

#include "kernels/cuda_check.h"
#include "kernels/layernorm.h"
#include "kernels/layernorm_cuda.h"
#include "kernels/lane_reduce.cuh"

namespace moeut::cuda {
namespace {

constexpr int kWarps = 8, kBackwardWarps = 4;

// V consecutive columns (V = 4: one 16-byte load of fp32, 8 bytes of bf16; V = 1 otherwise).
template <int V>
struct Cols {
  float v[V];
};
template <int V>
__device__ __forceinline__ Cols<V> load_cols(const float* p) {
  if constexpr (V == 4) {
    const float4 t = *reinterpret_cast<const float4*>(p);
    return {{t.x, t.y, t.z, t.w}};
  } else {
    return {{p[0]}};
  }
}
template <int V>
__device__ __forceinline__ void store_cols(float* p, const Cols<V>& c) {
  if constexpr (V == 4) *reinterpret_cast<float4*>(p) = make_float4(c.v[0], c.v[1], c.v[2], c.v[3]);
  else p[0] = c.v[0];
}
template <int V>
__device__ __forceinline__ Cols<V> load_cols(const __nv_bfloat16* p) {
  if constexpr (V == 4) {
    const uint2 t = *reinterpret_cast<const uint2*>(p);
    const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&t.x));
    const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&t.y));
    return {{lo.x, lo.y, hi.x, hi.y}};
  } else {
    return {{__bfloat162float(p[0])}};
  }
}
template <int V>
__device__ __forceinline__ void store_cols(__nv_bfloat16* p, const Cols<V>& c) {
  if constexpr (V == 4) {
    const __nv_bfloat162 lo = __floats2bfloat162_rn(c.v[0], c.v[1]), hi = __floats2bfloat162_rn(c.v[2], c.v[3]);
    uint2 t;
    t.x = *reinterpret_cast<const uint32_t*>(&lo);
    t.y = *reinterpret_cast<const uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(p) = t;
  } else {
    p[0] = __float2bfloat16(c.v[0]);
  }
}

// x̂ = (x - mean)·rstd of V columns, rounded to bf16: what the backward pass keeps of x, and what
// the output is made from in both passes.
template <int V>
__device__ __forceinline__ Cols<V> normalized_input(const Cols<V>& xv, float mu, float rs) {
  Cols<V> h;
#pragma unroll
  for (int k = 0; k < V; ++k) h.v[k] = __bfloat162float(__float2bfloat16((xv.v[k] - mu) * rs));
  return h;
}

// The LayerNorm's output x̂·w + b of V columns from the rounded x̂, one expression for the forward
// kernel and the backward's second writing of it, so that the two agree bit for bit.
template <int V>
__device__ __forceinline__ Cols<V> output_of(const Cols<V>& xhat, const Cols<V>& wv, const Cols<V>& bv) {
  Cols<V> o;
#pragma unroll
  for (int k = 0; k < V; ++k) o.v[k] = xhat.v[k] * wv.v[k] + bv.v[k];
  return o;
}

// V = 4 needs d a multiple of 4 and every row start aligned for its loads.
bool four_wide(int64_t d, std::initializer_list<const void*> fp32, std::initializer_list<const void*> bf16) {
  bool ok = d % 4 == 0;
  for (const void* p : fp32) ok = ok && reinterpret_cast<uintptr_t>(p) % 16 == 0;
  for (const void* p : bf16) ok = ok && reinterpret_cast<uintptr_t>(p) % 8 == 0;
  return ok;
}

// One warp per row, V columns per lane at a time. A lane keeps its first kRegisterChunks chunks of
// the row in registers, so the row is read from memory once, with all of a lane's loads in
// flight together (a loop over the row three times would keep one load in flight per lane).
// Columns past them (d > 32·V·kRegisterChunks) are read again in each pass. x_bf16, when not
// null, receives a bf16 copy of x, and xhat the rounded x̂. Held to 128 registers, two blocks per
// SM: with the copies the compiler would take 144 (one block), and every call would run at half
// the warps, the backward pass's copy-less ones too.
constexpr int kRegisterChunks = 16;
template <int V>
__global__ void __launch_bounds__(kWarps * 32, 2)
    layernorm_forward_kernel(__nv_bfloat16* __restrict__ out, __nv_bfloat16* __restrict__ x_bf16,
                             __nv_bfloat16* __restrict__ xhat, float* rstd, const float* __restrict__ x,
                             const __nv_bfloat16* w, const __nv_bfloat16* b, int64_t n, int d) {
  const int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n) return;
  const float* xr = x + row * d;
  constexpr int kStride = 32 * V, kHeld = kStride * kRegisterChunks;
  Cols<V> held[kRegisterChunks];
#pragma unroll
  for (int c = 0; c < kRegisterChunks; ++c)
    if (const int i = lane * V + c * kStride; i < d) held[c] = load_cols<V>(xr + i);
  // f(i, columns) over this lane's chunks in column order: the held ones, then those read again.
  auto each_chunk = [&](auto f) {
#pragma unroll
    for (int c = 0; c < kRegisterChunks; ++c)
      if (const int i = lane * V + c * kStride; i < d) f(i, held[c]);
    for (int i = kHeld + lane * V; i < d; i += kStride) f(i, load_cols<V>(xr + i));
  };
  // The copy, as soon as the row is in.
  if (x_bf16) each_chunk([&](int i, const Cols<V>& xv) { store_cols<V>(x_bf16 + row * d + i, xv); });
  float s = 0.f;
  each_chunk([&](int, const Cols<V>& xv) {
#pragma unroll
    for (int k = 0; k < V; ++k) s += xv.v[k];
  });
  const float mu = warp_sum(s) / float(d);
  float v = 0.f;
  each_chunk([&](int, const Cols<V>& xv) {
#pragma unroll
    for (int k = 0; k < V; ++k) v += (xv.v[k] - mu) * (xv.v[k] - mu);
  });
  const float rs = rsqrtf(warp_sum(v) / float(d) + float(kLayerNormEps));
  each_chunk([&](int i, const Cols<V>& xv) {
    const Cols<V> h = normalized_input<V>(xv, mu, rs);
    if (xhat) store_cols<V>(xhat + row * d + i, h);
    store_cols<V>(out + row * d + i, output_of<V>(h, load_cols<V>(w + i), load_cols<V>(b + i)));
  });
  if (lane == 0) rstd[row] = rs;
}

// One warp per row, rows strided over the grid, V columns per lane at a time. As in the forward
// kernel, a lane keeps its first kBackwardRegisterChunks chunks of the row's gradient, x̂ and dx
// (which it adds into) in registers, all of a lane's loads in flight together. Each warp adds its
// rows' parameter gradients into its own slice of shared memory (lanes own their columns, so no
// atomics), and the block adds the slices into the global gradients once. out, when not null,
// receives the forward's output again (from the same x̂, as the forward kernel), its operands read
// in the second pass anyway.
constexpr int kBackwardRegisterChunks = 12;
template <int V, class Grad>
__global__ void __launch_bounds__(kBackwardWarps * 32, 2)
    layernorm_backward_kernel(float* dx, __nv_bfloat16* dx_bf16, __nv_bfloat16* out, float* dw, float* db,
                              const Grad* dout, const __nv_bfloat16* xhat, const __nv_bfloat16* w,
                              const __nv_bfloat16* b, const float* rstd, int64_t n, int d) {
  extern __shared__ float acc[];  // [kBackwardWarps][2][d]
  for (int i = threadIdx.x; i < kBackwardWarps * 2 * d; i += blockDim.x) acc[i] = 0.f;
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* dw_acc = acc + warp * 2 * d;
  float* db_acc = dw_acc + d;
  constexpr int kStride = 32 * V, kHeld = kStride * kBackwardRegisterChunks;
  for (int64_t row = int64_t(blockIdx.x) * kBackwardWarps + warp; row < n; row += int64_t(gridDim.x) * kBackwardWarps) {
    const __nv_bfloat16* hr = xhat + row * d;
    const Grad* gr = dout + row * d;
    Cols<V> g_held[kBackwardRegisterChunks], h_held[kBackwardRegisterChunks], dx_held[kBackwardRegisterChunks];
#pragma unroll
    for (int c = 0; c < kBackwardRegisterChunks; ++c)
      if (const int i = lane * V + c * kStride; i < d)
        g_held[c] = load_cols<V>(gr + i), h_held[c] = load_cols<V>(hr + i), dx_held[c] = load_cols<V>(dx + row * d + i);
    // f(i, gradient, x̂, dx) over this lane's chunks in column order: the held ones, then those read
    // again.
    auto each_chunk = [&](auto f) {
#pragma unroll
      for (int c = 0; c < kBackwardRegisterChunks; ++c)
        if (const int i = lane * V + c * kStride; i < d) f(i, g_held[c], h_held[c], dx_held[c]);
      for (int i = kHeld + lane * V; i < d; i += kStride)
        f(i, load_cols<V>(gr + i), load_cols<V>(hr + i), load_cols<V>(dx + row * d + i));
    };
    const float rs = rstd[row];
    float g_mean = 0.f, gx_mean = 0.f;
    each_chunk([&](int i, const Cols<V>& gv, const Cols<V>& hv, const Cols<V>&) {
      const Cols<V> wv = load_cols<V>(w + i);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float g = gv.v[k] * wv.v[k];
        g_mean += g;
        gx_mean += g * hv.v[k];
      }
    });
    g_mean = warp_sum(g_mean) / float(d);
    gx_mean = warp_sum(gx_mean) / float(d);
    each_chunk([&](int i, const Cols<V>& gv, const Cols<V>& hv, Cols<V> dxv) {
      const Cols<V> wv = load_cols<V>(w + i);
      Cols<V> dwv = load_cols<V>(dw_acc + i), dbv = load_cols<V>(db_acc + i);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        dxv.v[k] += rs * (gv.v[k] * wv.v[k] - g_mean - hv.v[k] * gx_mean);
        dwv.v[k] += gv.v[k] * hv.v[k];
        dbv.v[k] += gv.v[k];
      }
      store_cols<V>(dx + row * d + i, dxv);
      if (dx_bf16) store_cols<V>(dx_bf16 + row * d + i, dxv);
      if (out) store_cols<V>(out + row * d + i, output_of<V>(hv, wv, load_cols<V>(b + i)));
      store_cols<V>(dw_acc + i, dwv);
      store_cols<V>(db_acc + i, dbv);
    });
  }
  __syncthreads();
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    float sw = 0.f, sb = 0.f;
#pragma unroll
    for (int k = 0; k < kBackwardWarps; ++k) sw += acc[k * 2 * d + i], sb += acc[k * 2 * d + d + i];
    atomicAdd(dw + i, sw);
    atomicAdd(db + i, sb);
  }
}

}  // namespace

void layernorm_forward(__nv_bfloat16* out, float* rstd, const float* x, const __nv_bfloat16* weight,
                       const __nv_bfloat16* bias, int64_t n, int64_t d, cudaStream_t stream, __nv_bfloat16* x_bf16,
                       __nv_bfloat16* xhat) {
  if (n == 0) return;
  const unsigned blocks = unsigned((n + kWarps - 1) / kWarps);
  if (four_wide(d, {x}, {out, weight, bias, x_bf16, xhat}))
    layernorm_forward_kernel<4>
        <<<blocks, kWarps * 32, 0, stream>>>(out, x_bf16, xhat, rstd, x, weight, bias, n, int(d));
  else
    layernorm_forward_kernel<1>
        <<<blocks, kWarps * 32, 0, stream>>>(out, x_bf16, xhat, rstd, x, weight, bias, n, int(d));
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

namespace {

template <class Grad>
void launch_backward(float* dx, float* dweight, float* dbias, const Grad* dout, const __nv_bfloat16* xhat,
                     const __nv_bfloat16* weight, const float* rstd, int64_t n, int64_t d, cudaStream_t stream,
                     __nv_bfloat16* dx_bf16, const __nv_bfloat16* bias, __nv_bfloat16* out) {
  if (n == 0) return;
  if (out && !bias) throw std::invalid_argument("layernorm_backward: the forward output needs the bias");
  // At most 1056 blocks (8 per SM of 132 SMs): each block's partial sums cost one pass of atomics
  // over d at its end.
  const unsigned blocks = unsigned(std::min<int64_t>((n + kBackwardWarps - 1) / kBackwardWarps, 1056));
  const size_t smem = size_t(kBackwardWarps) * 2 * size_t(d) * sizeof(float);
  auto launch = [&](auto kernel) {
    MOEUT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    kernel<<<blocks, kBackwardWarps * 32, smem, stream>>>(dx, dx_bf16, out, dweight, dbias, dout, xhat, weight, bias,
                                                          rstd, n, int(d));
  };
  constexpr bool kGradBf16 = std::is_same_v<Grad, __nv_bfloat16>;
  const bool wide = kGradBf16 ? four_wide(d, {dx}, {dout, xhat, weight, dx_bf16, bias, out})
                              : four_wide(d, {dx, dout}, {xhat, weight, dx_bf16, bias, out});
  if (wide) launch(layernorm_backward_kernel<4, Grad>);
  else launch(layernorm_backward_kernel<1, Grad>);
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void layernorm_backward(float* dx, float* dweight, float* dbias, const float* dout, const __nv_bfloat16* xhat,
                        const __nv_bfloat16* weight, const float* rstd, int64_t n, int64_t d, cudaStream_t stream,
                        __nv_bfloat16* dx_bf16, const __nv_bfloat16* bias, __nv_bfloat16* out) {
  launch_backward(dx, dweight, dbias, dout, xhat, weight, rstd, n, d, stream, dx_bf16, bias, out);
}

void layernorm_backward(float* dx, float* dweight, float* dbias, const __nv_bfloat16* dout, const __nv_bfloat16* xhat,
                        const __nv_bfloat16* weight, const float* rstd, int64_t n, int64_t d, cudaStream_t stream,
                        __nv_bfloat16* dx_bf16, const __nv_bfloat16* bias, __nv_bfloat16* out) {
  launch_backward(dx, dweight, dbias, dout, xhat, weight, rstd, n, d, stream, dx_bf16, bias, out);
}

}  // namespace moeut::cuda
