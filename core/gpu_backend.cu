#include "core/gpu_model.h"
#include "core/training_backend.h"
#include "kernels/cuda_check.h"

namespace moeut {
namespace {

class GpuBackend final : public TrainingBackend {
 public:
  explicit GpuBackend(const Config& c)
      : micro_(c.train.micro_batch_size),
        model_(c.model, micro_),
        partition_(model_.layout(), ProcessGroups::single()),
        optimizer_(model_.layout().total()) {
    Model<float> init(c.model);  // the spec's initialisation, drawn on the host as the CPU path does
    init.init(c.train.seed);
    model_.set_parameters(init.params);
  }
  const char* device() const override { return "cuda"; }
  const ParamLayout& layout() const override { return model_.layout(); }
  void zero_gradients() override { model_.zero_gradients(); }
  LossParts forward_backward(const int32_t* tokens, int64_t B, double weight) override {
    if (B != micro_) throw std::invalid_argument("GPU backend: training batches are micro_batch_size sequences");
    return model_.forward_backward(tokens, weight);
  }
  double forward_ce_sum(const int32_t* tokens, int64_t B) override { return model_.forward_ce_sum(tokens, B); }
  double step(double lr, const TrainConfig& t) override { return optimizer_.step(model_, lr, t); }
  std::vector<float> parameters() override { return model_.parameters(); }
  int64_t optimizer_state_bytes() const override { return 2 * model_.layout().total() * int64_t(sizeof(float)); }
  const ZeroPartition& partition() const override { return partition_; }
  OptimizerShard optimizer_shard() override { return optimizer_.shard(model_); }
  void load_optimizer_shard(const OptimizerShard& s) override { optimizer_.load(s, model_); }

 private:
  int64_t micro_;
  GpuModel model_;
  ZeroPartition partition_;  // one process owns everything
  GpuAdamW optimizer_;
};

}  // namespace

bool gpu_backend_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

std::unique_ptr<TrainingBackend> make_gpu_backend(const Config& c) { return std::make_unique<GpuBackend>(c); }

}  // namespace moeut
