#include <algorithm>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/gpu_model.h"
#include "core/model.h"
#include "parallel/training_backend.h"
#include "kernels/cuda_check.h"
#include "parallel/gpu_all_gather_dispatcher.h"
#include "parallel/gpu_all_to_all_dispatcher.h"
#include "parallel/gpu_sharded_optimizer.h"
#include "parallel/nccl_communicator.h"

namespace moeut {
namespace {

// One GPU per rank. A rank that sees as many GPUs as its node has ranks or more (the scheduler
// shows every rank all of them) takes the one of its index among the node's ranks; a rank that
// sees exactly one (srun --gpus-per-task=1, or CUDA_VISIBLE_DEVICES set per rank) takes that
// one. The ranks of a node then compare their GPUs' UUIDs: two ranks on one GPU are refused. Every
// rank learns every rank's outcome (one all-gather over the world) before any starts work, so all
// refuse together.
void select_local_gpu(const ProcessGroups& groups) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  const NodePlace& node = groups.node;
  const int device = devices >= node.ranks ? node.rank : devices == 1 ? 0 : -1;
  // What each rank sees, as int32 words: its node (first rank and size), its GPU count, the GPU
  // it takes (-1: none) and that GPU's UUID (zeros when none).
  enum Field { kNode, kNodeRanks, kDevices, kDevice, kUuid, kFields = kUuid + 4 };
  static_assert(sizeof(cudaUUID_t) == 4 * sizeof(int32_t), "a UUID is four words");
  Communicator& world = *groups.world;
  std::vector<int32_t> seen(size_t(kFields) * size_t(world.size()), 0);
  const auto of = [&](int r) { return seen.data() + ptrdiff_t(kFields) * r; };
  int32_t* mine = of(world.rank());
  mine[kNode] = node.first, mine[kNodeRanks] = node.ranks, mine[kDevices] = devices, mine[kDevice] = device;
  if (device >= 0) {
    cudaDeviceProp prop{};
    MOEUT_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    std::memcpy(mine + kUuid, &prop.uuid, sizeof prop.uuid);
  }
  world.all_gather_v(std::span<int32_t>(seen), std::vector<int64_t>(size_t(world.size()), kFields));
  // The first rank with no GPU of its own, and the first with a GPU that a lower rank of its node has.
  int without = -1, shared = -1;
  for (int r = 0; r < world.size(); ++r) {
    if (of(r)[kDevice] < 0) {
      if (without < 0) without = r;
      continue;
    }
    for (int q = 0; q < r && shared < 0; ++q)
      if (of(q)[kNode] == of(r)[kNode] && std::equal(of(r) + kUuid, of(r) + kFields, of(q) + kUuid)) shared = r;
  }
  if (shared >= 0)
    throw ConfigError("invalid configuration: device: two ranks of one node were given the same GPU (rank " +
                      std::to_string(shared) + " and a lower one); GPU ranks need one GPU each (check "
                      "CUDA_VISIBLE_DEVICES or the scheduler's GPU binding)");
  if (without >= 0)
    throw ConfigError("invalid configuration: device: a rank sees neither one GPU nor as many as its node has ranks "
                      "(rank " + std::to_string(without) + " sees " + std::to_string(of(without)[kDevices]) +
                      " on a node of " + std::to_string(of(without)[kNodeRanks]) + " ranks); GPU ranks need one GPU "
                      "each: show each rank all of the node's GPUs (at most as many ranks as GPUs) or exactly one of "
                      "its own (srun --gpus-per-task=1, CUDA_VISIBLE_DEVICES per rank)");
  MOEUT_CUDA_CHECK(cudaSetDevice(device));
}

// The expert-parallel group's token exchange (--dispatcher); none for a group of one, which holds
// every expert (GpuModel then dispatches locally).
GpuDispatcherFactory expert_dispatcher(const Config& c, Communicator& expert_parallel) {
  if (expert_parallel.size() == 1) return nullptr;
  const ModelConfig& m = c.model;
  return [E = m.ff_n_experts, d = m.d_model, k = m.ff_k, all_gather = c.train.dispatcher == "all_gather",
          &expert_parallel](int64_t max_tokens, cudaStream_t stream) -> std::unique_ptr<GpuTokenDispatcher> {
    if (all_gather) return std::make_unique<GpuAllGatherDispatcher>(expert_parallel, E, max_tokens, d, k, stream);
    return std::make_unique<GpuAllToAllDispatcher>(expert_parallel, E, max_tokens, d, k, stream);
  };
}

class GpuBackend final : public TrainingBackend {
 public:
  GpuBackend(const Config& c, const ProcessGroups& host_groups)
      : stream_(host_groups),
        micro_(c.train.micro_batch_size),
        groups_(nccl_process_groups(host_groups, stream_.get())),
        model_(c.model, micro_,
               expert_shard(c.model.ff_n_experts, groups_.expert_parallel->size(), groups_.expert_parallel->rank()),
               expert_dispatcher(c, *groups_.expert_parallel), stream_.get()) {
    // The spec's initialisation, drawn on the host as the CPU path draws it: each expert from
    // its own stream, so this rank's shard equals its slice of a one-process model.
    std::vector<float> initial(size_t(model_.layout().total()));
    init_parameters(c.model, model_.layout(), c.train.seed, initial.data());
    model_.set_parameters(initial);
    model_.set_expert_counting(c.train.log_experts_every > 0);
    optimizer_ = std::make_unique<GpuShardedAdamW>(model_.layout(), groups_, initial, stream_.get());
    // Where the device's memory goes: the model's ledger, the optimizer state, and what the device
    // reports in use (which adds cuBLAS's, NCCL's and CUDA's own).
    DeviceLedger ledger = model_.ledger();
    ledger.add(DeviceLedger::Kind::kOptimizer, optimizer_->state_bytes());
    size_t free_bytes = 0, total_bytes = 0;
    MOEUT_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    char in_use[64];
    std::snprintf(in_use, sizeof in_use, " (the device reports %.2f GiB in use)",
                  double(total_bytes - free_bytes) / double(int64_t(1) << 30));
    memory_ = ledger.summary() + in_use;
  }
  const char* device() const override { return model_.graphs() ? "cuda (passes replayed as CUDA graphs)" : "cuda"; }
  std::string memory_plan() const override { return memory_; }
  double peak_flops() const override { return peak_flops_; }
  int64_t device_memory_in_use() const override {
    size_t free_bytes = 0, total_bytes = 0;
    MOEUT_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    return int64_t(total_bytes - free_bytes);
  }
  const ParamLayout& layout() const override { return model_.layout(); }
  void zero_gradients() override { model_.zero_gradients(); }
  LossParts forward_backward(const int32_t* tokens, int64_t B, double weight, bool last) override {
    if (B != micro_) throw std::invalid_argument("GPU backend: training batches are micro_batch_size sequences");
    experts_reduced_ = last;
    return model_.forward_backward(tokens, weight, last ? &sync_ : nullptr);
  }
  // A rank whose share of the validation windows has run out gets B = 0. With expert
  // parallelism it still runs a forward pass (on one sequence of whatever the buffer holds) so
  // that its group's token exchanges match, and counts nothing.
  double forward_ce_sum(const int32_t* tokens, int64_t B) override {
    if (B > 0) return model_.forward_ce_sum(tokens, B);
    if (groups_.ep() > 1) {
      const std::vector<int32_t> filler(size_t(model_.config().context + 1), 0);
      model_.forward_ce_sum(filler.data(), 1);
    }
    return 0.0;
  }
  double step(double lr, const TrainConfig& t) override {
    const bool reduced = std::exchange(experts_reduced_, false);
    return optimizer_->step(model_.working(), model_.grads(), lr, t, reduced);
  }
  std::vector<double> gradient_square_sums() override {
    return optimizer_->tensor_square_sums(model_.layout(), model_.grads());
  }
  std::vector<float> parameters() override { return optimizer_->parameters(); }
  int64_t optimizer_state_bytes() const override { return optimizer_->state_bytes(); }
  const ZeroPartition& partition() const override { return optimizer_->partition(); }
  OptimizerShard optimizer_shard() override { return optimizer_->shard(); }
  void load_optimizer_shard(const OptimizerShard& s) override { optimizer_->load(s, model_.working()); }
  int64_t dispatch_bytes() const override { return model_.dispatch_bytes(); }
  int64_t expert_rows_received() const override { return model_.expert_rows_received(); }
  std::vector<double> take_expert_load() override { return model_.take_expert_load(); }
  PassSeconds take_pass_seconds() override { return model_.take_pass_seconds(); }
  double take_communication_seconds() override { return groups_.take_seconds(); }

 private:
  // The rank's GPU, chosen before anything touches it, and the stream all its work runs on;
  // declared first, so it outlives the communicators, model and optimizer that use it.
  class Stream {
   public:
    explicit Stream(const ProcessGroups& host_groups) {
      select_local_gpu(host_groups);
      MOEUT_CUDA_CHECK(cudaStreamCreate(&stream_));
    }
    ~Stream() { cudaStreamDestroy(stream_); }
    Stream(const Stream&) = delete;
    Stream& operator=(const Stream&) = delete;
    cudaStream_t get() const { return stream_; }

   private:
    cudaStream_t stream_ = nullptr;
  };

  Stream stream_;
  int64_t micro_;
  NcclProcessGroups groups_;  // device communicators, ordered on stream_
  GpuModel model_;
  std::string memory_;  // see memory_plan()
  double peak_flops_ = measure_bf16_peak_tflops() * 1e12;
  std::unique_ptr<GpuShardedAdamW> optimizer_;
  // The step's last backward pass reduces each physical layer's expert gradients as it finishes
  // them, beside the layers it has left (GpuShardedAdamW::reduce_final_experts).
  class ExpertGradientSync final : public GpuModel::GradientSync {
   public:
    explicit ExpertGradientSync(std::unique_ptr<GpuShardedAdamW>& optimizer) : optimizer_(optimizer) {}
    void experts_final(int64_t g, float* grads) override { optimizer_->reduce_final_experts(grads, g); }
    void pass_end() override { optimizer_->join_reduces(); }

   private:
    std::unique_ptr<GpuShardedAdamW>& optimizer_;
  } sync_{optimizer_};
  bool experts_reduced_ = false;  // by the last forward_backward, for step()
};

}  // namespace

bool gpu_backend_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

std::unique_ptr<TrainingBackend> make_gpu_backend(const Config& c, const ProcessGroups& groups) {
  try {
    return std::make_unique<GpuBackend>(c, groups);
  } catch (const cuda::OutOfMemory& e) {
    throw cuda::OutOfMemory(std::string(e.what()) +
                            ": each GPU holds its share of the model, gradients and optimizer state and the "
                            "activations of micro_batch_size " + std::to_string(c.train.micro_batch_size) +
                            " sequences of " + std::to_string(c.model.context) +
                            " tokens; lower micro_batch_size (a step accumulates micro-batches up to batch_size), "
                            "or spread the experts over more GPUs with --ep");
  }
}

}  // namespace moeut
