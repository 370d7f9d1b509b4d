#include "kernels/cuda_check.h"
#include "kernels/rope_cuda.h"

namespace moeut::cuda {
namespace {

// One thread per rotated pair (b, t, h, i < n_rot/2). Frequencies in fp32 as the official
// implementation computes them: 1 / base^(2i/n), angle = t * freq.
__global__ void rope_kernel(__nv_bfloat16* x, int64_t pairs, int T, int H, int dh, int64_t ld, int n_rot,
                            float direction) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= pairs) return;
  const int half = n_rot / 2;
  const int i = int(idx % half);
  const int64_t head = idx / half;  // (b, t, h)
  const int t = int((head / H) % T);
  const float freq = 1.f / powf(10000.f, float(2 * i) / float(n_rot));
  float s, c;
  sincosf(float(t) * freq, &s, &c);
  s *= direction;
  __nv_bfloat16* u = x + head / H * ld + head % H * dh;
  const float lo = __bfloat162float(u[i]), hi = __bfloat162float(u[i + half]);
  u[i] = __float2bfloat16(lo * c - hi * s);
  u[i + half] = __float2bfloat16(hi * c + lo * s);
}

void launch(__nv_bfloat16* x, int64_t B, int64_t T, int64_t H, int64_t dh, int64_t ld, int64_t n_rot, float direction,
            cudaStream_t stream) {
  const int64_t pairs = B * T * H * (n_rot / 2);
  if (pairs == 0) return;
  rope_kernel<<<unsigned((pairs + 255) / 256), 256, 0, stream>>>(x, pairs, int(T), int(H), int(dh), ld ? ld : H * dh,
                                                                 int(n_rot), direction);
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
