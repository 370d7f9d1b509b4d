// Expert-parallel token dispatch over an all-to-all exchange. Each rank of the expert-parallel
// group holds a contiguous shard of the FFN experts (expert_shard). Forward: for every token,
// one copy goes to each rank that owns at least one of its selected experts, with those
// experts' local ids and routing weights; counts are exchanged first. The receiver runs its
// experts over everything it received and returns one weighted partial sum per copy, which the
// sender adds into the token's row. Backward mirrors it: output gradients go out along the same
// routes; input-row and routing-weight gradients come back.
#pragma once
#include <cstdint>
#include <vector>

#include "core/params.h"
#include "core/token_dispatcher.h"
#include "parallel/communicator.h"

namespace moeut {

class AllToAllDispatcher final : public TokenDispatcher<float> {
 public:
  AllToAllDispatcher(Communicator& expert_parallel, int64_t n_experts);
  void forward(int64_t use, const float* x, const int32_t* I, const float* w, int64_t n, int64_t k,
               const ExpertParams<float>& p, float* y) override;
  void backward(int64_t use, const float* dy, float* dx, float* dw, const ExpertParams<float>& p) override;

  // Bytes sent through the exchanges: token rows, metadata, results.
  int64_t bytes_sent() const override { return bytes_sent_; }
  int64_t rows_received() const override { return rows_received_; }

 private:
  struct Route {  // one use of one FFN layer
    std::vector<int32_t> copy_token;       // token of each copy sent, grouped by destination
    std::vector<int32_t> sel_origin;       // t*k + j of each selection sent, grouped by destination
    std::vector<int64_t> send_copies, send_sels, recv_copies, recv_sels;  // per peer
    std::vector<float> rows;               // token rows received
    ExpertWork<float> work;                // this rank's experts over the received rows
  };
  template <typename T>
  void exchange(const T* send, const std::vector<int64_t>& send_counts, T* recv,
                const std::vector<int64_t>& recv_counts, int64_t width);

  Communicator& ep_;
  std::vector<ExpertShard> shards_;  // of every rank of the group
  std::vector<int32_t> owner_;       // rank owning each global expert
  std::vector<Route> routes_;        // per use
  std::vector<float> send_rows_, recv_rows_, send_w_, recv_w_, din_, dweight_, dhidden_;
  std::vector<int32_t> send_meta_, recv_meta_, sel_row_, sel_expert_;
  CvmmWorkspace<float> ws_;
  int64_t bytes_sent_ = 0, rows_received_ = 0;
};

}  // namespace moeut
