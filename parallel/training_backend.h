// What the training loop needs from a model and its optimizer, whatever device holds them:
// the CPU backend (Model, a token dispatcher, ZeRO-sharded AdamW over MPI ranks) and the GPU
// backend (GpuModel and ZeRO-sharded AdamW over NCCL, one GPU per rank).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/model.h"
#include "core/params.h"
#include "parallel/zero_partition.h"

namespace moeut {

class TrainingBackend {
 public:
  virtual ~TrainingBackend() = default;
  virtual const char* device() const = 0;  // what the rank trains on, as its start-up line says
  // Where the rank's device memory goes, by kind, for the start-up lines; empty on the CPU.
  virtual std::string memory_plan() const { return {}; }
  // The device's bf16 product peak in FLOP/s, measured at start (what MFU is counted against),
  // and its memory in use now in bytes: 0 on the CPU, which reports neither.
  virtual double peak_flops() const = 0;
  virtual int64_t device_memory_in_use() const = 0;
  virtual const ParamLayout& layout() const = 0;  // this rank's part of the model
  virtual void zero_gradients() = 0;
  // Accumulates the gradient of weight · (mean CE + regularisers) of B sequences. last: the
  // step's last micro-batch, whose backward pass may begin synchronising the gradients.
  virtual LossParts forward_backward(const int32_t* tokens, int64_t B, double weight, bool last) = 0;
  virtual double forward_ce_sum(const int32_t* tokens, int64_t B) = 0;
  // One optimizer step at learning rate lr; returns the global gradient norm before clipping.
  virtual double step(double lr, const TrainConfig& t) = 0;
  // Per tensor of layout(), this rank's share of the squared norm of the last step's gradient
  // (before clipping); summed over the world's ranks, each tensor's squared gradient norm.
  virtual std::vector<double> gradient_square_sums() = 0;
  virtual std::vector<float> parameters() = 0;  // in layout() order
  virtual int64_t optimizer_state_bytes() const = 0;
  virtual int64_t dispatch_bytes() const = 0;  // expert-parallel token traffic sent so far
  // Token rows this rank's FFN experts were given so far (its own and the group's tokens).
  virtual int64_t expert_rows_received() const = 0;
  // The routers' choices over this rank's tokens since the last call (core/expert_load.h's
  // layout: counts, then routing-weight sums); counting starts afresh.
  virtual std::vector<double> take_expert_load() = 0;
  // The forwards' and backwards' seconds of the training passes since the last call (device time
  // on a GPU).
  virtual PassSeconds take_pass_seconds() = 0;
  virtual double take_communication_seconds() { return 0; }  // device time in collectives since the last call
  // Checkpoints: how the optimizer splits layout()'s buffer over the ranks, this rank's part
  // (fp32 master and moments, in partition order), and installing such a part, after which
  // every rank holds the same parameters (a collective).
  virtual const ZeroPartition& partition() const = 0;
  virtual OptimizerShard optimizer_shard() = 0;
  virtual void load_optimizer_shard(const OptimizerShard& shard) = 0;
};

// CPU: this rank's shard of the experts, the dispatcher its group needs, sharded AdamW.
std::unique_ptr<TrainingBackend> make_cpu_backend(const Config& c, const ProcessGroups& groups);
// GPU: one GPU per rank (chosen by the rank within its node), micro-batches of
// c.train.micro_batch_size, ZeRO-sharded AdamW over NCCL.
std::unique_ptr<TrainingBackend> make_gpu_backend(const Config& c, const ProcessGroups& groups);
bool gpu_backend_available();  // built with CUDA and a device present

}  // namespace moeut
