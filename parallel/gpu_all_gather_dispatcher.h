// Expert dispatch among GPU ranks without a host round trip: every rank of the expert-parallel
// group gets every token of the group (an all-gather of rows of max_tokens per rank, padded),
// runs its experts on the selections it holds, and returns one bf16 partial sum per row to the
// row's rank, which adds the group's partials in fp32, in rank order (its own partial in fp32).
// With MoEUT's many selections a token (ff_k) nearly every token needs every rank of a small
// group, so the all-to-all's routing saves few rows; here the exchange has a fixed size, needs
// no counts on the host, and a pass through it can be captured as a CUDA graph.
//
// The routing travels first and the rows after it, so that the experts' plan is built while the
// rows arrive (await). Rows: the gathered buffer holds rank r's tokens at rows [r·max_tokens,
// r·max_tokens + N_r); rows past a rank's N_r carry no selection (index -1). Backward: output
// gradients are gathered the same way, also awaited; input gradients go back in bf16 and
// routing-weight gradients in fp32. A caller that keeps its rows where token_rows and places()
// say spares their copies, and the experts add its own rows' outputs (input gradients) straight
// into its out (dx).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/gpu_token_dispatcher.h"
#include "core/params.h"
#include "kernels/device_buffer.h"
#include "parallel/communicator.h"

namespace moeut {

class GpuAllGatherDispatcher final : public GpuTokenDispatcher {
 public:
  // Tokens per call up to max_tokens, rows of width d, k selections among n_experts split over
  // the ranks of `expert_parallel` (a device communicator) as expert_shard() splits them.
  GpuAllGatherDispatcher(Communicator& expert_parallel, int64_t n_experts, int64_t max_tokens, int64_t d, int64_t k,
                         cudaStream_t stream);

  std::unique_ptr<Route> make_route() const override;
  int64_t max_rows() const override { return ranks_ * max_tokens_; }
  bool host_synchronous() const override { return false; }
  Rows dispatch(Route& route, const Rows& tokens) override;
  void await(Route& route) override;
  void combine(Route& route) override;
  GradRows dispatch_grad(Route& route, const GradRows& grads) override;
  void combine_grad(Route& route) override;
  __nv_bfloat16* token_rows(Route& route) const override {
    return static_cast<Gathered&>(route).x.get() + own_chunk(d_);
  }
  Places places() const override {
    const int64_t mine = own_chunk(d_);
    return {.out = out_f32_.get() + mine, .dy = dy_.get() + mine, .dx = dx_f32_.get() + mine};
  }
  int64_t bytes_sent() const override { return bytes_sent_; }
  int64_t device_bytes() const override {
    return meta_.bytes() + out_f32_.bytes() + dx_f32_.bytes() + dw_.bytes() + send_.bytes() + back_.bytes() +
           back_dw_.bytes() + dy_.bytes();
  }

 private:
  // A layer's gathered rows, kept from its forward to its backward pass.
  struct Gathered final : Route {
    cuda::DeviceBuffer<__nv_bfloat16> x;  // [max_rows, d]
    cuda::DeviceBuffer<int32_t> index;    // [max_rows, k]: local expert ids, -1 where elsewhere
    cuda::DeviceBuffer<float> weight;     // [max_rows, k]
    int64_t tokens = 0;                   // this rank's N
    float* out = nullptr;
    GradRows grads{};
    int64_t device_bytes() const override { return x.bytes() + index.bytes() + weight.bytes(); }
  };
  // Every rank's chunk of `width` elements a row, max_tokens rows each; to_others: none for
  // this rank (the partials' rows, which travel packed without it).
  std::vector<int64_t> chunks(int64_t width, bool to_others = false) const;
  // Where this rank's chunk begins in a gathered buffer of `width` elements a row.
  int64_t own_chunk(int64_t width) const { return rank_ * max_tokens_ * width; }
  // Whether out, a caller's rows, is this rank's chunk of `partials` (see places()).
  bool is_own_chunk(const float* out, const float* partials) const { return out == partials + own_chunk(d_); }
  // Refuses `call` while a dispatch's rows are arriving (a caller's error: the exchanges would
  // no longer be joined in order).
  void check_awaited(const char* call) const;
  // The partial sums in `partials` (out_f32_ or dx_f32_) of the other ranks' rows to those ranks
  // in bf16, theirs for this rank's rows back into back_; then out[n] += every rank's partial in
  // rank order, this rank's own from `partials` in fp32 unless out is its own chunk there (the
  // experts added it in place). Backward, dw_'s routing-weight gradients travel too (fp32) and
  // are added into slots_out (which may be null on a rank without tokens: every rank of the group
  // makes the same collectives whatever its tokens).
  void return_partials(float* partials, float* out, float* slots_out, int64_t tokens, bool backward);
  // Zeroes `partials` but for this rank's chunk when out is that chunk (the caller's rows).
  void zero_partials(float* partials, const float* out);

  Communicator& comm_;
  int ranks_, rank_;
  ExpertShard shard_;
  int64_t max_tokens_, d_, k_;
  cudaStream_t stream_;
  int64_t bytes_sent_ = 0;
  Gathered* arriving_ = nullptr;  // the route whose rows' gather is not yet joined (see await)
  cuda::DeviceBuffer<int32_t> meta_;  // [max_rows, 2k]: global ids (-1: padding), then weights' bits
  // The experts' side, shared by the layers (each combines before the next dispatches): their
  // outputs and their input gradients (fp32, [max_rows, d]; this rank's chunk may be the
  // caller's rows, see places()), their routing-weight gradients, the bf16 partials going back
  // and those coming back (the other ranks' rows only), the gathered output gradients.
  cuda::DeviceBuffer<float> out_f32_, dx_f32_, dw_, back_dw_;
  cuda::DeviceBuffer<__nv_bfloat16> send_, back_, dy_;
};

}  // namespace moeut
