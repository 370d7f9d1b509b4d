#include "parallel/training_backend.h"
#include "parallel/all_gather_dispatcher.h"
#include "parallel/all_to_all_dispatcher.h"
#include "parallel/communicator.h"
#include "parallel/sharded_optimizer.h"

namespace moeut {
namespace {

class CpuBackend final : public TrainingBackend {
 public:
  CpuBackend(const Config& c, const ProcessGroups& g)
      : model_(c.model, expert_shard(c.model.ff_n_experts, g.ep(), g.expert_parallel->rank())),
        optimizer_(model_.layout(), g) {
    if (g.ep() > 1 && c.train.dispatcher == "all_gather")
      model_.set_dispatcher(std::make_unique<AllGatherDispatcher>(*g.expert_parallel, c.model.ff_n_experts));
    else if (g.ep() > 1)
      model_.set_dispatcher(std::make_unique<AllToAllDispatcher>(*g.expert_parallel, c.model.ff_n_experts));
    model_.init(c.train.seed);
    model_.set_expert_counting(c.train.log_experts_every > 0);
  }
  const char* device() const override { return "cpu"; }
  double peak_flops() const override { return 0; }
  int64_t device_memory_in_use() const override { return 0; }
  const ParamLayout& layout() const override { return model_.layout(); }
  void zero_gradients() override { std::fill(model_.grads.begin(), model_.grads.end(), 0.f); }
  LossParts forward_backward(const int32_t* tokens, int64_t B, double weight, bool /*last*/) override {
    return model_.forward_backward(tokens, B, weight);
  }
  double forward_ce_sum(const int32_t* tokens, int64_t B) override { return model_.forward_ce_sum(tokens, B); }
  double step(double lr, const TrainConfig& t) override { return optimizer_.step(model_.params, model_.grads, lr, t); }
  std::vector<double> gradient_square_sums() override { return optimizer_.tensor_square_sums(model_.layout()); }
  std::vector<float> parameters() override { return model_.params; }
  int64_t optimizer_state_bytes() const override { return optimizer_.state_bytes(); }
  int64_t dispatch_bytes() const override { return model_.dispatcher()->bytes_sent(); }
  int64_t expert_rows_received() const override { return model_.dispatcher()->rows_received(); }
  std::vector<double> take_expert_load() override { return model_.take_expert_load(); }
  PassSeconds take_pass_seconds() override { return model_.take_pass_seconds(); }
  const ZeroPartition& partition() const override { return optimizer_.partition(); }
  OptimizerShard optimizer_shard() override { return optimizer_.shard(model_.params); }
  void load_optimizer_shard(const OptimizerShard& s) override { optimizer_.load(s, model_.params); }

 private:
  Model<float> model_;
  ShardedAdamW optimizer_;
};

}  // namespace

std::unique_ptr<TrainingBackend> make_cpu_backend(const Config& c, const ProcessGroups& groups) {
  return std::make_unique<CpuBackend>(c, groups);
}

#ifndef MOEUT_HAVE_CUDA
bool gpu_backend_available() { return false; }
std::unique_ptr<TrainingBackend> make_gpu_backend(const Config&, const ProcessGroups&) {
  throw ConfigError("invalid configuration: device: cuda asked for, but this build has no CUDA backend");
}
#endif

}  // namespace moeut
