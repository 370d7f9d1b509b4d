#include "parallel/gpu_all_to_all_dispatcher.h"

#include <cub/device/device_scan.cuh>

#include <numeric>

#include "core/hang_watchdog.h"
#include "kernels/cuda_check.h"

namespace moeut {
namespace {

using bf16 = __nv_bfloat16;

// The rank holding expert e, and the first expert of rank r, for expert_shard()'s split: the
// first E % ranks ranks hold one expert more.
__device__ int owner_of(int e, int E, int ranks) {
  const int q = E / ranks, rem = E % ranks;
  return e < (q + 1) * rem ? e / (q + 1) : rem + (e - (q + 1) * rem) / q;
}
__device__ int first_expert(int r, int E, int ranks) { return r * (E / ranks) + min(r, E % ranks); }

// flags[r·N + n] = 1 when token n selected an expert of rank r; counts[r] = tokens for rank r.
__global__ void mark_destinations(int32_t* flags, int32_t* counts, const int32_t* index, int N, int k, int E,
                                  int ranks) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  for (int r = 0; r < ranks; ++r) flags[r * N + n] = 0;
  for (int j = 0; j < k; ++j) flags[owner_of(index[n * k + j], E, ranks) * N + n] = 1;
  for (int r = 0; r < ranks; ++r)
    if (flags[r * N + n]) atomicAdd(counts + r, 1);
}

__global__ void unmark(int32_t* position, const int32_t* flags, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n && !flags[i]) position[i] = -1;
}

// One block per (rank, token) slot: the token's row into its send position, and its routing
// slots with ids local to the destination rank.
__global__ void pack(bf16* send_x, int32_t* send_index, float* send_weight, const int32_t* position, const bf16* x,
                     const int32_t* index, const float* weight, int N, int d, int k, int E, int ranks) {
  const int slot = blockIdx.x, p = position[slot];
  if (p < 0) return;
  const int r = slot / N, n = slot % N;
  const uint4* src = reinterpret_cast<const uint4*>(x + int64_t(n) * d);
  uint4* dst = reinterpret_cast<uint4*>(send_x + int64_t(p) * d);
  for (int c = threadIdx.x; c < d / 8; c += blockDim.x) dst[c] = src[c];
  if (!send_index) return;
  const int begin = first_expert(r, E, ranks);
  for (int j = threadIdx.x; j < k; j += blockDim.x) {
    const int e = index[n * k + j];
    send_index[int64_t(p) * k + j] = owner_of(e, E, ranks) == r ? e - begin : -1;
    send_weight[int64_t(p) * k + j] = weight[n * k + j];
  }
}

// out[n] += Σ_r rows[position[r·N + n]]; slots_out[n] += Σ_r slots[...] (one rank holds each
// slot's expert; the others returned zero for it).
__global__ void gather_back(float* out, float* slots_out, const float* rows, const float* slots,
                            const int32_t* position, int N, int d, int k, int ranks) {
  const int n = blockIdx.x;
  for (int c = threadIdx.x; c < d / 4; c += blockDim.x) {
    float4 acc = reinterpret_cast<float4*>(out + int64_t(n) * d)[c];
    for (int r = 0; r < ranks; ++r) {
      const int p = position[r * N + n];
      if (p < 0) continue;
      const float4 v = reinterpret_cast<const float4*>(rows + int64_t(p) * d)[c];
      acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
    }
    reinterpret_cast<float4*>(out + int64_t(n) * d)[c] = acc;
  }
  if (!slots_out) return;
  for (int j = threadIdx.x; j < k; j += blockDim.x) {
    float s = 0.f;
    for (int r = 0; r < ranks; ++r) {
      const int p = position[r * N + n];
      if (p >= 0) s += slots[int64_t(p) * k + j];
    }
    slots_out[int64_t(n) * k + j] += s;
  }
}

}  // namespace

GpuAllToAllDispatcher::GpuAllToAllDispatcher(Communicator& expert_parallel, int64_t n_experts, int64_t max_tokens,
                                             int64_t d, int64_t k, cudaStream_t stream)
    : comm_(expert_parallel),
      ranks_(expert_parallel.size()),
      rank_(expert_parallel.rank()),
      n_experts_(n_experts),
      max_tokens_(max_tokens),
      d_(d),
      k_(k),
      stream_(stream),
      flags_(size_t(ranks_ * max_tokens)),
      send_index_(size_t(ranks_ * max_tokens * k)),
      send_counts_(size_t(ranks_)),
      send_x_(size_t(ranks_ * max_tokens * d)),
      send_weight_(size_t(ranks_ * max_tokens * k)),
      back_rows_(size_t(ranks_ * max_tokens * d)),
      back_weight_(size_t(ranks_ * max_tokens * k)),
      recv_rows_(size_t(ranks_ * max_tokens * d)),
      recv_dw_(size_t(ranks_ * max_tokens * k)),
      recv_dy_(size_t(ranks_ * max_tokens * d)) {
  if (d % 8 != 0) throw std::invalid_argument("GpuAllToAllDispatcher: d_model must be a multiple of 8");
  size_t bytes = 0;
  MOEUT_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, bytes, flags_.get(), flags_.get(), int(flags_.size())));
  scan_scratch_ = cuda::DeviceBuffer<unsigned char>(std::max<size_t>(bytes, 1));
}

std::unique_ptr<GpuTokenDispatcher::Route> GpuAllToAllDispatcher::make_route() const {
  auto r = std::make_unique<Sends>();
  r->position = cuda::DeviceBuffer<int32_t>(size_t(ranks_ * max_tokens_));
  r->recv_x = cuda::DeviceBuffer<bf16>(size_t(max_rows() * d_));
  r->recv_index = cuda::DeviceBuffer<int32_t>(size_t(max_rows() * k_));
  r->recv_weight = cuda::DeviceBuffer<float>(size_t(max_rows() * k_));
  return r;
}

void GpuAllToAllDispatcher::count(int64_t row_bytes, const std::vector<int64_t>& rows) {
  for (int r = 0; r < ranks_; ++r)
    if (r != rank_) bytes_sent_ += rows[size_t(r)] * row_bytes;
}

GpuTokenDispatcher::Rows GpuAllToAllDispatcher::dispatch(Route& made, const Rows& in) {
  Sends& route = static_cast<Sends&>(made);
  if (in.rows > max_tokens_)
    throw std::invalid_argument("GpuAllToAllDispatcher: " + std::to_string(in.rows) + " tokens, planned for " +
                                std::to_string(max_tokens_));
  const int N = int(in.rows), slots = ranks_ * N;
  route.tokens = in.rows;
  route.out = in.out;
  std::vector<int32_t> counts(size_t(ranks_), 0);
  MOEUT_CUDA_CHECK(cudaMemsetAsync(send_counts_.get(), 0, size_t(ranks_) * sizeof(int32_t), stream_));
  if (N > 0) {
    mark_destinations<<<(N + 255) / 256, 256, 0, stream_>>>(flags_.get(), send_counts_.get(), in.index, N, int(k_),
                                                            int(n_experts_), ranks_);
    MOEUT_CUDA_CHECK(cudaGetLastError());
    size_t bytes = scan_scratch_.size();
    MOEUT_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(scan_scratch_.get(), bytes, flags_.get(), route.position.get(), slots,
                                                   stream_));
    unmark<<<(slots + 255) / 256, 256, 0, stream_>>>(route.position.get(), flags_.get(), slots);
    MOEUT_CUDA_CHECK(cudaGetLastError());
    pack<<<slots, 128, 0, stream_>>>(send_x_.get(), send_index_.get(), send_weight_.get(), route.position.get(), in.x,
                                     in.index, in.weight, N, int(d_), int(k_), int(n_experts_), ranks_);
    MOEUT_CUDA_CHECK(cudaGetLastError());
  }
  MOEUT_CUDA_CHECK(cudaMemcpyAsync(counts.data(), send_counts_.get(), size_t(ranks_) * sizeof(int32_t),
                                   cudaMemcpyDeviceToHost, stream_));
  {
    const Waiting waiting("the GPU's work before a token exchange (the previous exchanges among it)", comm_.name());
    MOEUT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  route.sent.assign(counts.begin(), counts.end());
  route.received = comm_.all_to_all(route.sent);
  route.received_rows = std::accumulate(route.received.begin(), route.received.end(), int64_t(0));
  comm_.all_to_all_v(reinterpret_cast<const uint16_t*>(send_x_.get()), scaled_counts(route.sent, d_),
                     reinterpret_cast<uint16_t*>(route.recv_x.get()), scaled_counts(route.received, d_));
  comm_.all_to_all_v(send_index_.get(), scaled_counts(route.sent, k_), route.recv_index.get(),
                     scaled_counts(route.received, k_));
  comm_.all_to_all_v(send_weight_.get(), scaled_counts(route.sent, k_), route.recv_weight.get(),
                     scaled_counts(route.received, k_));
  count(d_ * int64_t(sizeof(bf16)) + k_ * int64_t(sizeof(int32_t) + sizeof(float)), route.sent);
  // The experts add into their rows, which go back to the senders.
  MOEUT_CUDA_CHECK(cudaMemsetAsync(recv_rows_.get(), 0, size_t(route.received_rows * d_) * sizeof(float), stream_));
  return {.x = route.recv_x.get(), .index = route.recv_index.get(), .weight = route.recv_weight.get(),
          .rows = route.received_rows, .out = recv_rows_.get()};
}

void GpuAllToAllDispatcher::combine(Route& made) {
  const Sends& route = static_cast<const Sends&>(made);
  comm_.all_to_all_v(recv_rows_.get(), scaled_counts(route.received, d_), back_rows_.get(),
                     scaled_counts(route.sent, d_));
  count(d_ * int64_t(sizeof(float)), route.received);
  if (route.tokens == 0) return;
  gather_back<<<unsigned(route.tokens), 128, 0, stream_>>>(route.out, nullptr, back_rows_.get(), nullptr,
                                                          route.position.get(), int(route.tokens), int(d_), int(k_),
                                                          ranks_);
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

GpuTokenDispatcher::GradRows GpuAllToAllDispatcher::dispatch_grad(Route& made, const GradRows& grads) {
  Sends& route = static_cast<Sends&>(made);
  route.grads = grads;
  const int N = int(route.tokens);
  if (N > 0) {
    pack<<<ranks_ * N, 128, 0, stream_>>>(send_x_.get(), nullptr, nullptr, route.position.get(), grads.dy, nullptr,
                                          nullptr, N, int(d_), int(k_), int(n_experts_), ranks_);
    MOEUT_CUDA_CHECK(cudaGetLastError());
  }
  comm_.all_to_all_v(reinterpret_cast<const uint16_t*>(send_x_.get()), scaled_counts(route.sent, d_),
                     reinterpret_cast<uint16_t*>(recv_dy_.get()), scaled_counts(route.received, d_));
  count(d_ * int64_t(sizeof(bf16)), route.sent);
  // The expert backward adds into both, which go back to the senders.
  MOEUT_CUDA_CHECK(cudaMemsetAsync(recv_rows_.get(), 0, size_t(route.received_rows * d_) * sizeof(float), stream_));
  MOEUT_CUDA_CHECK(cudaMemsetAsync(recv_dw_.get(), 0, size_t(route.received_rows * k_) * sizeof(float), stream_));
  return {.dy = recv_dy_.get(), .dx = recv_rows_.get(), .dw = recv_dw_.get()};
}

void GpuAllToAllDispatcher::combine_grad(Route& made) {
  const Sends& route = static_cast<const Sends&>(made);
  comm_.all_to_all_v(recv_rows_.get(), scaled_counts(route.received, d_), back_rows_.get(),
                     scaled_counts(route.sent, d_));
  comm_.all_to_all_v(recv_dw_.get(), scaled_counts(route.received, k_), back_weight_.get(),
                     scaled_counts(route.sent, k_));
  count((d_ + k_) * int64_t(sizeof(float)), route.received);
  if (route.tokens == 0) return;
  gather_back<<<unsigned(route.tokens), 128, 0, stream_>>>(route.grads.dx, route.grads.dw, back_rows_.get(),
                                                          back_weight_.get(), route.position.get(), int(route.tokens),
                                                          int(d_), int(k_), ranks_);
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeut
