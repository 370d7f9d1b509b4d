// Expert-parallel token dispatch between GPU ranks, the device twin of AllToAllDispatcher
// (all_to_all_dispatcher.h). Each rank routes its own tokens; every token row goes once to each
// rank that owns at least one of its selected experts (deduplicated), with its k routing slots
// carrying the local expert id (or -1 where that slot's expert lives elsewhere) and the routing
// weight. Counts are exchanged first (one host synchronisation per dispatch), then the rows,
// over the expert-parallel communicator. The receiving rank runs its experts over everything it
// received and returns one fp32 row per received row, which the sender adds up. The backward
// pass reuses the forward's route: output gradients go the same way, input gradients and
// routing-weight gradients come back. The exchanged counts size the rows on the host, so passes
// through it are not captured as CUDA graphs.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "core/gpu_token_dispatcher.h"
#include "kernels/device_buffer.h"
#include "parallel/communicator.h"

namespace moeut {

class GpuAllToAllDispatcher final : public GpuTokenDispatcher {
 public:
  // Tokens per call up to max_tokens, rows of width d, k selections among n_experts split over
  // the ranks of `expert_parallel` as expert_shard() splits them.
  GpuAllToAllDispatcher(Communicator& expert_parallel, int64_t n_experts, int64_t max_tokens, int64_t d, int64_t k,
                        cudaStream_t stream);

  std::unique_ptr<Route> make_route() const override;
  int64_t max_rows() const override { return ranks_ * max_tokens_; }
  bool host_synchronous() const override { return true; }
  Rows dispatch(Route& route, const Rows& tokens) override;
  void combine(Route& route) override;
  GradRows dispatch_grad(Route& route, const GradRows& grads) override;
  void combine_grad(Route& route) override;
  int64_t bytes_sent() const override { return bytes_sent_; }
  int64_t device_bytes() const override {
    return flags_.bytes() + send_index_.bytes() + send_counts_.bytes() + scan_scratch_.bytes() + send_x_.bytes() +
           send_weight_.bytes() + back_rows_.bytes() + back_weight_.bytes() + recv_rows_.bytes() + recv_dw_.bytes() +
           recv_dy_.bytes();
  }

 private:
  // This dispatcher's Route: each token's row in the send buffer per rank, the rows sent to and
  // received from each rank, the rows received (the experts read them again in the backward
  // pass), and where combine and combine_grad add in token order.
  struct Sends final : Route {
    cuda::DeviceBuffer<int32_t> position;  // [ranks, max_tokens]: row in the send buffer, or -1
    cuda::DeviceBuffer<__nv_bfloat16> recv_x;  // [max_rows, d]
    cuda::DeviceBuffer<int32_t> recv_index;    // [max_rows, k]
    cuda::DeviceBuffer<float> recv_weight;     // [max_rows, k]
    std::vector<int64_t> sent, received;   // rows per rank
    int64_t tokens = 0, received_rows = 0;
    float* out = nullptr;
    GradRows grads{};
    int64_t device_bytes() const override {
      return position.bytes() + recv_x.bytes() + recv_index.bytes() + recv_weight.bytes();
    }
  };
  void count(int64_t rows_per_rank_bytes, const std::vector<int64_t>& rows);

  Communicator& comm_;
  int ranks_, rank_;
  int64_t n_experts_, max_tokens_, d_, k_;
  cudaStream_t stream_;
  cuda::DeviceBuffer<int32_t> flags_, send_index_, send_counts_;
  cuda::DeviceBuffer<unsigned char> scan_scratch_;
  cuda::DeviceBuffer<__nv_bfloat16> send_x_;
  cuda::DeviceBuffer<float> send_weight_, back_rows_, back_weight_;
  // The experts' side of the current exchange, shared by the layers (each combines before the
  // next dispatches): their outputs or input gradients, routing-weight gradients, and the output
  // gradients they read.
  cuda::DeviceBuffer<float> recv_rows_, recv_dw_;
  cuda::DeviceBuffer<__nv_bfloat16> recv_dy_;
  int64_t bytes_sent_ = 0;
};

}  // namespace moeut
