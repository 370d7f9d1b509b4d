// Expert dispatch as GpuModel's FFN layers see it, the device counterpart of TokenDispatcher
// (token_dispatcher.h): the router picks each token's experts, the dispatcher says where the
// experts held here read their rows and write their outputs, and brings the outputs back to the
// tokens; the backward pass the same way for the gradients. LocalGpuDispatcher
// (core/gpu_local_dispatcher.h), for a model holding every expert, lets the experts read and
// write the tokens' own buffers; between ranks, GpuAllToAllDispatcher
// (parallel/gpu_all_to_all_dispatcher.h) sends each row to the ranks holding its experts, and
// GpuAllGatherDispatcher (parallel/gpu_all_gather_dispatcher.h) gives every rank of the group
// every row, with no host round trip.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>

namespace moeut {

class GpuTokenDispatcher {
 public:
  // A layer's dispatch, made once per layer and kept from its forward to its backward pass:
  // what it sent where, and the rows its experts were given. Only the dispatcher that made it
  // reads it.
  class Route {
   public:
    virtual ~Route() = default;
    virtual int64_t device_bytes() const = 0;
  };

  // Token rows with their routing, for the FFN experts: x [rows, d] with index and weight
  // [rows, k]; the experts' weighted outputs are added into out [rows, d] (fp32). Passed to
  // dispatch in token order with global expert ids; returned where the experts here read and add,
  // with their local ids (-1 where the expert is elsewhere). The returned x, index and weight stay
  // valid until the route's next dispatch (the backward pass reads them), out until combine.
  struct Rows {
    const __nv_bfloat16* x;
    const int32_t* index;
    const float* weight;
    int64_t rows;
    float* out;
  };
  // Their backward: dy [rows, d], the gradient of the outputs; dx [rows, d] (fp32) += the input
  // gradients; dw [rows, k] += the routing-weight gradients. Passed to dispatch_grad in token
  // order (dw zeroed by the caller), for the rows of the forward's dispatch; returned where the
  // expert backward reads and adds, valid until combine_grad.
  struct GradRows {
    const __nv_bfloat16* dy;
    float* dx;
    float* dw;
  };

  virtual ~GpuTokenDispatcher() = default;
  virtual std::unique_ptr<Route> make_route() const = 0;
  virtual int64_t max_rows() const = 0;  // token rows the experts here may be given in one dispatch
  // Whether dispatch waits on the host (exchanged counts size the buffers), which a CUDA graph
  // cannot capture.
  virtual bool host_synchronous() const = 0;

  // The returned rows' x may still be arriving (index and weight are there): the caller's work
  // that reads x comes after await(route), and the work before it (the experts' plan, from the
  // routing) runs beside their arrival. Likewise dispatch_grad's dy.
  virtual Rows dispatch(Route& route, const Rows& tokens) = 0;
  virtual void await(Route&) {}
  // The experts' outputs, in the out that dispatch returned, added into the tokens' out.
  virtual void combine(Route& route) = 0;
  virtual GradRows dispatch_grad(Route& route, const GradRows& tokens) = 0;
  // The expert backward's dx and dw, where dispatch_grad returned them, added into the tokens'.
  virtual void combine_grad(Route& route) = 0;

  // Where the caller may keep its token rows so that the exchange reads and adds them in place
  // (each null where the caller keeps them in its own buffer; each holds the dispatcher's
  // max_tokens rows). token_rows: the bf16 rows it will dispatch through `route` (dispatch then
  // copies none), valid as long as the route. places(): out, the fp32 rows it passes as
  // dispatch's out, into which the experts then add this rank's own rows' outputs directly; dy
  // and dx likewise for dispatch_grad; valid as long as the dispatcher.
  struct Places {
    float* out;
    __nv_bfloat16* dy;
    float* dx;
  };
  virtual __nv_bfloat16* token_rows(Route&) const { return nullptr; }
  virtual Places places() const { return {}; }

  virtual int64_t bytes_sent() const = 0;  // to other ranks, since construction
  virtual int64_t device_bytes() const = 0;  // its own buffers (routes report theirs)
};

// Makes the dispatcher of a model that holds a shard of the experts: for up to max_tokens token
// rows a call, ordered on `stream` (the model's).
using GpuDispatcherFactory =
    std::function<std::unique_ptr<GpuTokenDispatcher>(int64_t max_tokens, cudaStream_t stream)>;

}  // namespace moeut
