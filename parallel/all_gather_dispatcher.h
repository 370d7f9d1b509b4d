// Expert-parallel token dispatch by all-gather: every rank of the expert-parallel group receives
// every token of the group with its routing decision, runs its own experts over the selections
// that name them, and the partial outputs are summed back to the tokens' ranks by a
// reduce-scatter. Each rank receives all P·n rows where the all-to-all sends only the copies
// needed, but there is no routing-dependent exchange pattern. Backward mirrors it.
#pragma once
#include <cstdint>
#include <vector>

#include "core/params.h"
#include "core/token_dispatcher.h"
#include "parallel/communicator.h"

namespace moeut {

class AllGatherDispatcher final : public TokenDispatcher<float> {
 public:
  AllGatherDispatcher(Communicator& expert_parallel, int64_t n_experts);
  void forward(int64_t use, const float* x, const int32_t* I, const float* w, int64_t n, int64_t k,
               const ExpertParams<float>& p, float* y) override;
  void backward(int64_t use, const float* dy, float* dx, float* dw, const ExpertParams<float>& p) override;
  // Bytes: this rank's rows, selections and gradients as the other ranks receive them in the
  // gathers, and its partial sums for them in the reduce-scatters.
  int64_t bytes_sent() const override { return bytes_sent_; }
  int64_t rows_received() const override { return rows_received_; }

 private:
  struct Use {
    std::vector<int64_t> tokens;      // per rank of the group
    int64_t first = 0, k = 0;         // this rank's first row among the gathered ones
    std::vector<float> rows;          // every token row of the group
    std::vector<int32_t> origin;      // gathered t·k + j of each local selection
    ExpertWork<float> work;
  };

  Communicator& ep_;
  ExpertShard shard_;
  std::vector<Use> uses_;
  std::vector<int32_t> all_index_, sel_row_, sel_expert_;
  std::vector<float> all_weight_, sel_weight_, out_, mine_, din_, dweight_, dhidden_;
  CvmmWorkspace<float> ws_;
  int64_t bytes_sent_ = 0, rows_received_ = 0;
};

}  // namespace moeut
