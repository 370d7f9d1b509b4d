#include <mpi.h>

#include "core/gpu_model.h"
#include "core/training_backend.h"
#include "kernels/cuda_check.h"
#include "parallel/gpu_sharded_optimizer.h"
#include "parallel/mpi_communicator.h"
#include "parallel/nccl_communicator.h"

namespace moeut {
namespace {

// One GPU per rank, chosen by the rank's index among the ranks of its node. Every rank learns
// whether every node has enough GPUs before any of them starts work, so all refuse together.
void select_local_gpu(const ProcessGroups& groups) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  int local_rank = 0, local_ranks = 1, ok = 1;
  auto* world = dynamic_cast<MpiCommunicator*>(groups.world.get());
  if (world) {
    MPI_Comm node = MPI_COMM_NULL;
    if (MPI_Comm_split_type(world->comm(), MPI_COMM_TYPE_SHARED, world->rank(), MPI_INFO_NULL, &node) != MPI_SUCCESS)
      throw CommError("MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) failed on rank " + std::to_string(world->rank()));
    MPI_Comm_rank(node, &local_rank);
    MPI_Comm_size(node, &local_ranks);
    MPI_Comm_free(&node);
    ok = devices >= local_ranks ? 1 : 0;
    int all_ok = ok;
    if (MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, world->comm()) != MPI_SUCCESS)
      throw CommError("MPI_Allreduce of the GPU check failed on rank " + std::to_string(world->rank()));
    if (!all_ok)
      throw ConfigError("invalid configuration: device: " + std::to_string(local_ranks) + " ranks on a node with " +
                        std::to_string(devices) + " GPU(s) (rank " + std::to_string(world->rank()) +
                        "'s node); GPU ranks need one GPU each: start at most as many ranks per node as it has GPUs");
  }
  MOEUT_CUDA_CHECK(cudaSetDevice(local_rank));
}

class GpuBackend final : public TrainingBackend {
 public:
  GpuBackend(const Config& c, const ProcessGroups& host_groups)
      : micro_(c.train.micro_batch_size),
        ep_(host_groups.ep()),
        model_((select_local_gpu(host_groups), c.model), micro_),
        groups_(nccl_process_groups(host_groups, model_.stream())),
        optimizer_(model_.layout(), groups_, initial_parameters(c), model_.stream()) {
    if (ep_ > 1) throw ConfigError("invalid configuration: ep: expert parallelism on GPU ranks is not built yet; use --ep 1");
    model_.set_parameters(initial_parameters(c));
  }
  const char* device() const override { return "cuda"; }
  const ParamLayout& layout() const override { return model_.layout(); }
  void zero_gradients() override { model_.zero_gradients(); }
  LossParts forward_backward(const int32_t* tokens, int64_t B, double weight) override {
    if (B != micro_) throw std::invalid_argument("GPU backend: training batches are micro_batch_size sequences");
    return model_.forward_backward(tokens, weight);
  }
  // A rank whose share of the validation windows has run out gets B = 0.
  double forward_ce_sum(const int32_t* tokens, int64_t B) override {
    return B == 0 ? 0.0 : model_.forward_ce_sum(tokens, B);
  }
  double step(double lr, const TrainConfig& t) override { return optimizer_.step(model_.working(), model_.grads(), lr, t); }
  std::vector<float> parameters() override { return optimizer_.parameters(); }
  int64_t optimizer_state_bytes() const override { return optimizer_.state_bytes(); }
  const ZeroPartition& partition() const override { return optimizer_.partition(); }
  OptimizerShard optimizer_shard() override { return optimizer_.shard(); }
  void load_optimizer_shard(const OptimizerShard& s) override { optimizer_.load(s, model_.working()); }

 private:
  // The spec's initialisation, drawn on the host as the CPU path draws it (every rank alike).
  static std::vector<float> initial_parameters(const Config& c) {
    Model<float> init(c.model);
    init.init(c.train.seed);
    return init.params;
  }

  int64_t micro_;
  int ep_;
  GpuModel model_;
  ProcessGroups groups_;  // device communicators, ordered on the model's stream
  GpuShardedAdamW optimizer_;
};

}  // namespace

bool gpu_backend_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

std::unique_ptr<TrainingBackend> make_gpu_backend(const Config& c, const ProcessGroups& groups) {
  return std::make_unique<GpuBackend>(c, groups);
}

}  // namespace moeut
