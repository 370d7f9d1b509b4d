#include "parallel/gpu_all_gather_dispatcher.h"

#include <stdexcept>
#include <string>

#include "kernels/cast_cuda.h"
#include "kernels/cuda_check.h"

namespace moeut {

namespace {

using bf16 = __nv_bfloat16;

// This rank's chunk of the gathered routing: per row its k global expert ids and the k weights'
// bits, rows past N without a selection.
__global__ void stage_routing(int32_t* meta, const int32_t* index, const float* weight, int N, int max_tokens,
                              int k) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(max_tokens) * k) return;
  const int64_t row = i / k, j = i % k;
  const bool token = row < N;
  meta[row * 2 * k + j] = token ? index[i] : -1;
  meta[row * 2 * k + k + j] = token ? __float_as_int(weight[i]) : 0;
}

// The gathered routing as the experts here read it: ids local to [begin, begin + count), -1
// elsewhere, and the weights.
__global__ void unpack_routing(int32_t* index, float* weight, const int32_t* meta, int64_t rows, int k, int begin,
                               int count) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * k) return;
  const int64_t row = i / k, j = i % k;
  const int e = meta[row * 2 * k + j];
  index[i] = e >= begin && e < begin + count ? e - begin : -1;
  weight[i] = __int_as_float(meta[row * 2 * k + k + j]);
}

// One block per token n of this rank: out[n] += Σ_r partial_r[n] in rank order, rank `rank`'s
// own from `own` (fp32, its rows at rank·max_tokens; none when null: out holds it already) and
// the others' from `back` (bf16, packed without this rank's: rank r's at (r < rank ? r : r − 1)·
// max_tokens), four columns a thread (d a multiple of 4); likewise slots_out[n] += Σ_r slot
// partials (rank r's at r·max_tokens in both) when slots_out is given.
__global__ void add_partials(float* out, float* slots_out, const bf16* back, const float* own,
                             const float* back_slots, const float* own_slots, int max_tokens, int d, int k, int ranks,
                             int rank) {
  const int64_t n = blockIdx.x;
  for (int c = threadIdx.x * 4; c < d; c += blockDim.x * 4) {
    float4 acc = *reinterpret_cast<const float4*>(out + n * d + c);
    for (int r = 0; r < ranks; ++r) {
      float4 v;
      if (r == rank) {
        if (!own) continue;
        v = *reinterpret_cast<const float4*>(own + (int64_t(r) * max_tokens + n) * d + c);
      } else {
        const int64_t at = (int64_t(r < rank ? r : r - 1) * max_tokens + n) * d + c;
        const uint2 raw = *reinterpret_cast<const uint2*>(back + at);
        const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
        const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
        v = make_float4(lo.x, lo.y, hi.x, hi.y);
      }
      acc.x += v.x;
      acc.y += v.y;
      acc.z += v.z;
      acc.w += v.w;
    }
    *reinterpret_cast<float4*>(out + n * d + c) = acc;
  }
  if (!slots_out) return;
  for (int j = threadIdx.x; j < k; j += blockDim.x) {
    float s = 0.f;
    for (int r = 0; r < ranks; ++r) {
      const int64_t row = int64_t(r) * max_tokens + n;
      s += (r == rank ? own_slots : back_slots)[row * k + j];
    }
    slots_out[n * k + j] += s;
  }
}

template <typename T>
void copy_rows(T* to, const T* from, int64_t elements, cudaStream_t stream) {
  if (elements > 0)
    MOEUT_CUDA_CHECK(cudaMemcpyAsync(to, from, size_t(elements) * sizeof(T), cudaMemcpyDeviceToDevice, stream));
}

uint16_t* bits(bf16* p) { return reinterpret_cast<uint16_t*>(p); }

}  // namespace

GpuAllGatherDispatcher::GpuAllGatherDispatcher(Communicator& expert_parallel, int64_t n_experts, int64_t max_tokens,
                                               int64_t d, int64_t k, cudaStream_t stream)
    : comm_(expert_parallel),
      ranks_(expert_parallel.size()),
      rank_(expert_parallel.rank()),
      shard_(expert_shard(n_experts, ranks_, rank_)),
      max_tokens_(max_tokens),
      d_(d),
      k_(k),
      stream_(stream),
      meta_(size_t(max_rows() * 2 * k)),
      out_f32_(size_t(max_rows() * d)),
      dx_f32_(size_t(max_rows() * d)),
      dw_(size_t(max_rows() * k)),
      back_dw_(size_t(max_rows() * k)),
      send_(size_t((ranks_ - 1) * max_tokens * d)),
      back_(size_t((ranks_ - 1) * max_tokens * d)),
      dy_(size_t(max_rows() * d)) {
  if (d % 4 != 0) throw std::invalid_argument("GpuAllGatherDispatcher: d_model must be a multiple of 4");
}

std::unique_ptr<GpuTokenDispatcher::Route> GpuAllGatherDispatcher::make_route() const {
  auto r = std::make_unique<Gathered>();
  r->x = cuda::DeviceBuffer<bf16>(size_t(max_rows() * d_));
  r->index = cuda::DeviceBuffer<int32_t>(size_t(max_rows() * k_));
  r->weight = cuda::DeviceBuffer<float>(size_t(max_rows() * k_));
  return r;
}

std::vector<int64_t> GpuAllGatherDispatcher::chunks(int64_t width, bool to_others) const {
  std::vector<int64_t> c(size_t(ranks_), max_tokens_ * width);
  if (to_others) c[size_t(rank_)] = 0;
  return c;
}

GpuTokenDispatcher::Rows GpuAllGatherDispatcher::dispatch(Route& made, const Rows& in) {
  check_awaited("dispatch");
  Gathered& route = static_cast<Gathered&>(made);
  if (in.rows > max_tokens_)
    throw std::invalid_argument("GpuAllGatherDispatcher: " + std::to_string(in.rows) + " tokens, planned for " +
                                std::to_string(max_tokens_));
  route.tokens = in.rows;
  route.out = in.out;
  const int64_t M = max_rows();
  if (in.x != token_rows(route)) copy_rows(token_rows(route), in.x, in.rows * d_, stream_);
  stage_routing<<<unsigned((max_tokens_ * k_ + 255) / 256), 256, 0, stream_>>>(
      meta_.get() + own_chunk(2 * k_), in.index, in.weight, int(in.rows), int(max_tokens_), int(k_));
  MOEUT_CUDA_CHECK(cudaGetLastError());
  // The routing first; the rows after it, joined in await, arrive while the caller plans.
  comm_.all_gather_v(std::span<int32_t>(meta_.get(), size_t(M * 2 * k_)), chunks(2 * k_));
  comm_.defer_joins();
  comm_.all_gather_v(std::span<uint16_t>(bits(route.x.get()), size_t(M * d_)), chunks(d_));
  arriving_ = &route;
  bytes_sent_ += (ranks_ - 1) * max_tokens_ * (d_ * int64_t(sizeof(bf16)) + 2 * k_ * int64_t(sizeof(int32_t)));
  unpack_routing<<<unsigned((M * k_ + 255) / 256), 256, 0, stream_>>>(
      route.index.get(), route.weight.get(), meta_.get(), M, int(k_), int(shard_.begin), int(shard_.count));
  MOEUT_CUDA_CHECK(cudaGetLastError());
  zero_partials(out_f32_.get(), in.out);
  return {.x = route.x.get(), .index = route.index.get(), .weight = route.weight.get(), .rows = M,
          .out = out_f32_.get()};
}

void GpuAllGatherDispatcher::await(Route& route) {
  if (arriving_ != &route) return;
  comm_.join_deferred();
  arriving_ = nullptr;
}

void GpuAllGatherDispatcher::check_awaited(const char* call) const {
  if (arriving_)
    throw std::logic_error(std::string("GpuAllGatherDispatcher: ") + call +
                           " while the last dispatch's rows (or gradients) were not awaited");
}

void GpuAllGatherDispatcher::zero_partials(float* partials, const float* out) {
  const int64_t mine = own_chunk(d_), after = mine + max_tokens_ * d_;
  if (!is_own_chunk(out, partials)) {
    MOEUT_CUDA_CHECK(cudaMemsetAsync(partials, 0, size_t(max_rows() * d_) * sizeof(float), stream_));
    return;
  }
  MOEUT_CUDA_CHECK(cudaMemsetAsync(partials, 0, size_t(mine) * sizeof(float), stream_));
  MOEUT_CUDA_CHECK(cudaMemsetAsync(partials + after, 0, size_t(max_rows() * d_ - after) * sizeof(float), stream_));
}

void GpuAllGatherDispatcher::return_partials(float* partials, float* out, float* slots_out, int64_t tokens,
                                             bool backward) {
  // Only the other ranks' rows travel, packed in rank order without this rank's (a chunk of none
  // for itself); its own partials are added from `partials` in fp32, or are in out already.
  const int64_t mine = own_chunk(d_), after = mine + max_tokens_ * d_;
  cuda::to_bf16(send_.get(), partials, mine, stream_);
  cuda::to_bf16(send_.get() + mine, partials + after, max_rows() * d_ - after, stream_);
  comm_.all_to_all_v(bits(send_.get()), chunks(d_, true), bits(back_.get()), chunks(d_, true));
  bytes_sent_ += (ranks_ - 1) * max_tokens_ * d_ * int64_t(sizeof(bf16));
  if (backward) {
    comm_.all_to_all_v(dw_.get(), chunks(k_), back_dw_.get(), chunks(k_));
    bytes_sent_ += (ranks_ - 1) * max_tokens_ * k_ * int64_t(sizeof(float));
  }
  if (tokens == 0) return;
  const float* own = is_own_chunk(out, partials) ? nullptr : partials;
  add_partials<<<unsigned(tokens), 128, 0, stream_>>>(out, slots_out, back_.get(), own, back_dw_.get(), dw_.get(),
                                                      int(max_tokens_), int(d_), int(k_), ranks_, rank_);
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

void GpuAllGatherDispatcher::combine(Route& made) {
  const Gathered& route = static_cast<const Gathered&>(made);
  check_awaited("combine");
  return_partials(out_f32_.get(), route.out, nullptr, route.tokens, false);
}

GpuTokenDispatcher::GradRows GpuAllGatherDispatcher::dispatch_grad(Route& made, const GradRows& grads) {
  check_awaited("dispatch_grad");
  Gathered& route = static_cast<Gathered&>(made);
  route.grads = grads;
  const int64_t M = max_rows();
  if (grads.dy != places().dy) copy_rows(places().dy, grads.dy, route.tokens * d_, stream_);
  comm_.defer_joins();  // joined in await, as dispatch's rows
  comm_.all_gather_v(std::span<uint16_t>(bits(dy_.get()), size_t(M * d_)), chunks(d_));
  arriving_ = &route;
  bytes_sent_ += (ranks_ - 1) * max_tokens_ * d_ * int64_t(sizeof(bf16));
  zero_partials(dx_f32_.get(), grads.dx);
  MOEUT_CUDA_CHECK(cudaMemsetAsync(dw_.get(), 0, size_t(dw_.bytes()), stream_));
  return {.dy = dy_.get(), .dx = dx_f32_.get(), .dw = dw_.get()};
}

void GpuAllGatherDispatcher::combine_grad(Route& made) {
  check_awaited("combine_grad");
  const Gathered& route = static_cast<const Gathered&>(made);
  return_partials(dx_f32_.get(), route.grads.dx, route.grads.dw, route.tokens, true);
}

}  // namespace moeut
