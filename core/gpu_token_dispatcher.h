// Expert dispatch between GPU ranks as GpuModel's FFN layers see it, the device counterpart of
// TokenDispatcher (token_dispatcher.h): the model routes its tokens, the dispatcher takes each
// token row to the ranks that hold its selected experts and brings their outputs back, and the
// backward pass sends gradients the same way. parallel/gpu_all_to_all_dispatcher.h implements it
// over a device communicator; a model holding every expert needs none (GpuModel computes its
// experts in place).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>

namespace moeut {

class GpuTokenDispatcher {
 public:
  // Where one dispatch sent each token: made once per layer, kept from its forward to its
  // backward pass; only the dispatcher that made it reads it.
  class Route {
   public:
    virtual ~Route() = default;
    virtual int64_t device_bytes() const = 0;
  };

  virtual ~GpuTokenDispatcher() = default;
  virtual std::unique_ptr<Route> make_route() const = 0;
  virtual int64_t max_received() const = 0;  // token rows a rank can receive in one dispatch

  // Sends x [tokens, d] with index/weight [tokens, k] (global expert ids); fills recv_x
  // [received, d], recv_index [received, k] (local ids, -1: not here) and recv_weight.
  // Returns the number of rows received.
  virtual int64_t dispatch(Route& route, const __nv_bfloat16* x, const int32_t* index, const float* weight,
                           int64_t tokens, __nv_bfloat16* recv_x, int32_t* recv_index, float* recv_weight) = 0;
  // Returns recv_y [received, d] to the senders; out [tokens, d] += the rows of each token.
  virtual void combine(const Route& route, const float* recv_y, float* out) = 0;
  // Backward: dy [tokens, d] to the same ranks as the forward rows, into recv_dy.
  virtual void dispatch_grad(const Route& route, const __nv_bfloat16* dy, __nv_bfloat16* recv_dy) = 0;
  // Returns recv_dx [received, d] and recv_dw [received, k]; dx [tokens, d] += the rows of each
  // token, and dw [tokens, k] receives each slot's routing-weight gradient from its expert's rank.
  virtual void combine_grad(const Route& route, const float* recv_dx, const float* recv_dw, float* dx, float* dw) = 0;

  virtual int64_t bytes_sent() const = 0;  // to other ranks, since construction
  virtual int64_t device_bytes() const = 0;  // its own buffers (routes report theirs)
};

// Makes the dispatcher of a model that holds a shard of the experts: for up to max_tokens token
// rows a call, ordered on `stream` (the model's).
using GpuDispatcherFactory =
    std::function<std::unique_ptr<GpuTokenDispatcher>(int64_t max_tokens, cudaStream_t stream)>;

}  // namespace moeut
