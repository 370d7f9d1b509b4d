// MoEUT on one GPU, mixed precision: bf16 working parameters and activations, fp32 residual
// stream, fp32 routing logits / LayerNorm statistics / losses, fp32 gradients (the fp32 master
// weights live in the optimizer, parallel/gpu_sharded_optimizer.h). Same parameter layout as
// Model (core/params.h), so parameters move between the two as one buffer. The forward pass
// keeps, per logical layer, what the backward pass needs (core/gpu_activations.h; of the residual
// stream, only bf16 copies and the LayerNorms' x̂: the stream itself is added into in place).
#pragma once

#include <algorithm>
#include <array>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/config.h"
#include "core/dense_products.h"
#include "core/device_ledger.h"
#include "core/expert_load.h"
#include "core/gpu_token_dispatcher.h"
#include "core/model.h"
#include "core/param_tensors.h"
#include "core/params.h"
#include "core/pass_graph_cache.h"
#include "core/side_stream.h"
#include "core/step_profiler.h"
#include "kernels/attention_cuda.h"
#include "kernels/cvmm_cuda.h"
#include "kernels/device_buffer.h"
#include "kernels/entropy_reg_cuda.h"
#include "kernels/expert_load_cuda.h"
#include "kernels/lm_head_ce_cuda.h"

namespace moeut {

struct GpuActivations;

class GpuModel {
 public:
  // Buffers planned for `batch` sequences, every FFN expert held here, work on a stream of its own.
  GpuModel(const ModelConfig& config, int64_t batch);
  // This rank holds `shard` of the FFN experts; its dispatcher (made by make_dispatcher) exchanges
  // tokens with the ranks that hold the others (every one of them must make the same calls).
  // Without make_dispatcher the shard must be every expert, dispatched by LocalGpuDispatcher.
  // Work runs on `stream` (one of its own when null).
  GpuModel(const ModelConfig& config, int64_t batch, ExpertShard shard, const GpuDispatcherFactory& make_dispatcher,
           cudaStream_t stream);
  ~GpuModel();
  GpuModel(const GpuModel&) = delete;
  GpuModel& operator=(const GpuModel&) = delete;

  const ModelConfig& config() const { return cfg_; }
  const ParamLayout& layout() const { return layout_; }
  // What the model keeps on the device, by kind (its own buffers and its kernels').
  const DeviceLedger& ledger() const { return ledger_; }
  // The bf16 working copy of every parameter (the fp32 master copy lives in the optimizer).
  void set_parameters(const std::vector<float>& params);
  std::vector<float> gradients();
  // Zeroes the replicated gradients; the FFN experts' (the layout's last range: most of the
  // model's) are written, not added to, by their first weight gradient in the next backward pass,
  // which then needs neither a memset of them nor a read of dW.
  void zero_gradients();
  __nv_bfloat16* working() { return working_.get(); }
  // Every gradient holding its value: expert gradients left unwritten since zero_gradients()
  // are zeroed first.
  float* grads() {
    zero_unwritten_expert_grads();
    return grads_.get();
  }
  cudaStream_t stream() const { return stream_; }
  // Training and loss passes over the planned batch replay as CUDA graphs: a pass runs eagerly
  // the first time its kind, weight and gradient state are seen, is captured the second time,
  // and is replayed from then on, so its thousands of launches cost one. Not with a dispatcher
  // that waits on the host (see GpuTokenDispatcher::host_synchronous), nor after
  // set_graphs(false) or with MOEUT_NO_GRAPHS=1 in the environment.
  void set_graphs(bool on) { graphs_on_ = on; }
  // Whether training and loss passes replay.
  bool graphs() const { return graphs_on_ && !dispatcher_->host_synchronous(); }
  // How many kinds of pass are captured (replayed on their next sight).
  int64_t captured_passes() const { return graphs_.captured(); }
  // Sent to other ranks (replayed passes included).
  int64_t dispatch_bytes() const { return dispatcher_->bytes_sent() + replayed_dispatch_bytes_; }
  // Token rows the FFN experts here were given in training passes (their own and received).
  int64_t expert_rows_received() const { return rows_received_; }
  // Expert-load counting (core/expert_load.h) in training passes, on the device beside each
  // top-k; off until switched on. take_expert_load() reads and restarts the counts (waits for
  // the stream).
  void set_expert_counting(bool on);
  std::vector<double> take_expert_load() { return expert_load_.take(stream_); }
  // Device seconds of the training passes' forwards and backwards since the last call.
  PassSeconds take_pass_seconds() { return std::exchange(pass_seconds_, {}); }

  // Where a pass spends device time, by part (moeut-bench; see StepProfiler). Off by default.
  using Part = StepProfiler::Part;
  static const char* part_name(Part p) { return StepProfiler::part_name(p); }
  void set_profiling(bool on) { profiler_.set_on(on); }
  // Device seconds per part of the last pass (waits for the work).
  std::array<double, size_t(Part::kCount)> take_profile() { return profiler_.take(); }

  // tokens (host): [batch, context + 1]. Mean losses of the batch.
  LossParts forward(const int32_t* tokens) { return run(tokens, batch_, 1.0, Pass::kLoss); }
  // Gradient synchronisation that a training pass begins while its backward goes on:
  // experts_final(g, grads) is called in stream order once physical layer g's FFN expert-weight
  // gradients are final for the pass (its first use's backward done: the last layers first), and
  // pass_end() before the pass ends, for the pass to wait for what they began. With CUDA graphs
  // the calls are made while a pass is captured and their work replays with it.
  class GradientSync {
   public:
    virtual ~GradientSync() = default;
    virtual void experts_final(int64_t g, float* grads) = 0;  // grads: the gradient buffer, layout order
    virtual void pass_end() = 0;
  };
  // Also accumulates into the gradients that of weight · (mean CE + regularisers), as
  // Model::forward_backward; `sync`, when given, begins synchronising them (the step's last pass).
  LossParts forward_backward(const int32_t* tokens, double weight, GradientSync* sync = nullptr) {
    return run(tokens, batch_, weight, Pass::kTrain, sync);
  }
  // Sum of the cross-entropy over B <= batch sequences (no regularisers, no gradients).
  double forward_ce_sum(const int32_t* tokens, int64_t B) {
    return run(tokens, B, 1.0, Pass::kEvaluate).ce * double(B * cfg_.context);
  }

 private:
  using bf16 = __nv_bfloat16;
  enum class Pass { kEvaluate, kLoss, kTrain };
  LossParts run(const int32_t* tokens, int64_t B, double weight, Pass pass, GradientSync* sync = nullptr);
  // A pass's device work, from the staged tokens to its losses copied back into pinned memory.
  void enqueue(int64_t B, double weight, Pass pass, GradientSync* sync);
  // enqueue() through the graph cache (see set_graphs).
  void enqueue_graphed(int64_t B, double weight, Pass pass, GradientSync* sync);
  void attention_forward(int64_t l);
  void ffn_forward(int64_t l);
  // The FFN's backward in two steps: dispatch_ffn_grad(l) sends layer l's output gradient to its
  // experts, an exchange that may run beside the work queued next; ffn_backward(l, grads) runs
  // the experts on what it returned, and the rest of the FFN's backward.
  GpuTokenDispatcher::GradRows dispatch_ffn_grad(int64_t l);
  void ffn_backward(int64_t l, const GpuTokenDispatcher::GradRows& grads);
  // The FFN experts held here over layer l's rows as its dispatch gave them (kept in the layer):
  // their out += the weighted expert outputs.
  void experts_forward(int64_t l);
  // Their backward from grads.dy, the gradient of their outputs: grads.dx += input gradients,
  // grads.dw += routing-weight gradients, and the expert-weight gradients, these left running on
  // the side stream (the caller joins it).
  void experts_backward(int64_t l, const GpuTokenDispatcher::GradRows& grads);
  // The FFN expert-weight gradients of two uses of a physical layer run as one product (see
  // cuda::cvmm_weight_grad): going down, a use with an unpaired use below it defers its own,
  // keeping its output and hidden-unit gradients in its physical layer's slot, and the use below
  // runs both (with an odd number of uses the lowest runs alone). Each expert tile then makes one
  // read-modify-write of the fp32 gradient where two products made two.
  enum class WeightGradTurn { kAlone, kDefer, kWithDeferred };
  WeightGradTurn weight_grad_turn(int64_t l) const;
  void zero_unwritten_expert_grads();  // see grads()
  // The attention's backward but for its dense weight gradient (q, k and the routers), which
  // attention_weight_grad(l) adds once the layer below's FFN gradient is on its way.
  void attention_backward(int64_t l);
  void attention_weight_grad(int64_t l);
  // The routing logits' gradient, dz = regulariser gradient + routing backward, in bf16 into dzb
  // [rows, groups·E] with rows ld elements apart.
  void routing_grad(const cuda::SoftmaxGrad& reg, const int32_t* index, const float* w, int64_t groups, int64_t E,
                    int64_t k, bf16* dzb, int64_t ld);
  // Copies of working weights in the shapes their products want, one per physical layer, made at
  // the start of each pass (the weights change only between passes): routers whose row count is
  // not a multiple of 8, padded (see router_rows_ld); and, when training, the four products that
  // read LN1's output, stacked as GpuActivations::attn_in_weights.
  void copy_weights(bool training);
  // A router product's weight: the parameter, `rows` rows from its first router on (for the
  // routers that route() multiplies together), and its padded copy when rows is not a multiple
  // of 8 (see router_rows_ld).
  struct RouterWeight {
    const bf16* param;
    int64_t rows;
    bf16* padded = nullptr;
    const bf16* get() const { return padded ? padded : param; }  // what the product reads
  };
  struct LayerRouters {
    RouterWeight ffn, attention;  // attention: the value and output routers, one product
  };
  // One router's outputs: logits z [N, groups·E] (kept for the regularisers and the backward
  // pass) and the top k of each group, index and w [N, groups, k]; its regulariser's means, which
  // the top-k adds into (none when their mean is null).
  struct Routing {
    int64_t groups, E, k;
    float* z;
    int32_t* index;
    float* w;
    cuda::SoftmaxMeans means;
    int64_t load_offset = -1;  // where expert-load counting adds its selections (-1: not counted)
  };
  // Routing by routers whose weights lie one after another in W (a RouterWeight's): one product
  // x·Wᵀ for all of them, in fp32 (see router_rows_ld), then each one's top k: on the main
  // stream, or with `beside`, forked after the product onto the side stream (the caller joins it).
  void route(const bf16* x, const bf16* W, std::initializer_list<Routing> routers, bool beside = false);
  // The means that layer l's router adds into through reg (none in an evaluation pass); lse
  // receives its rows' log-sum-exps.
  cuda::SoftmaxMeans reg_means(const cuda::EntropyReg& reg, int64_t l, float* lse) const {
    return regularised_ ? reg.means(l % cfg_.group_size, lse) : cuda::SoftmaxMeans{};
  }
  // The work queued on the main stream from here on belongs to p (kCount: none).
  void mark(Part p) { profiler_.mark(p); }
  // Where a physical layer's FFN router weight gradient accumulates: its rows in
  // GpuActivations::router_grads_padded when that exists, else the parameter's gradient.
  float* ffn_router_grad(int64_t group) const;
  void fold_router_grads();

  // Captured passes (see set_graphs), keyed by what the captured work depends on: the pass, its
  // batch, its weight, whether it is profiled, and which physical layers' expert gradients are
  // written (which decides whether their first weight gradient writes or adds). A replay leaves
  // that state, the parts of its marks, and the rows each layer's dispatch gave the experts (which
  // run() counts) as the captured pass did, and counts the bytes it sent.
  struct PassKey {
    Pass pass;
    int64_t B;
    double weight;
    bool profiled;
    bool synced;  // with a GradientSync (whose collectives the graph holds)
    std::vector<char> written_before;
    bool operator==(const PassKey&) const = default;
  };
  struct PassState {
    std::vector<char> written;
    std::vector<Part> mark_parts;
    std::vector<GpuTokenDispatcher::Rows> experts;  // per logical layer
    int64_t dispatch_bytes = 0;                      // sent to other ranks
  };

  ModelConfig cfg_;
  ParamLayout layout_;
  DeviceLedger ledger_;  // every buffer below is allocated through it
  std::unique_ptr<GpuTokenDispatcher> dispatcher_;  // the FFN layers' (see the constructor)
  int64_t batch_, B_;  // buffers are planned for batch_ sequences; B_ <= batch_ run now
  // The pass being enqueued has the regularisers (all but evaluation), and a backward pass (its
  // forward keeps the LayerNorms' x̂ for it).
  bool regularised_ = false, backward_ = false;
  cudaStream_t stream_ = nullptr;
  bool own_stream_ = false;
  std::unique_ptr<DenseProducts> dense_;
  cuda::DeviceBuffer<float> grads_;
  // Per physical layer: whether its FFN expert gradients hold a value since zero_gradients()
  // (until then its first weight gradient writes them instead of adding).
  std::vector<char> expert_grads_written_;
  cuda::DeviceBuffer<bf16> working_;
  // The parameters in working_ and their gradients in grads_; q, k and the attention's two routers
  // are adjacent in the layout (checked at construction).
  ModelTensors<bf16> params_;
  ModelTensors<float> param_grads_;
  // Activations and workspace, planned for batch_ sequences (core/gpu_activations.h).
  std::unique_ptr<GpuActivations> act_;
  std::vector<LayerRouters> routers_;  // per physical layer, their copies in act_->padded_routers
  std::unique_ptr<cuda::CausalAttention> attention_;
  // The regularisers' means per physical layer: the FFN router's and the attention's two.
  std::unique_ptr<cuda::EntropyReg> reg_ffn_, reg_att_v_, reg_att_o_;
  std::unique_ptr<cuda::LmHeadCE> head_;
  std::unique_ptr<cuda::CvmmPlanner> planner_;
  // Work beside the main stream: the attention's top-ks and plans in the forward pass (beside q,
  // k and RoPE), the expert weight gradients in the backward (beside the input gradients).
  std::unique_ptr<SideStream> side_;
  PassGraphCache<PassKey, PassState> graphs_;  // captured passes (see PassKey)
  bool graphs_on_ = true;
  StepProfiler profiler_;  // on the main stream
  PassClock pass_clock_;   // on the main stream, in training passes
  PassSeconds pass_seconds_;
  ExpertLoadLayout load_layout_;
  cuda::ExpertLoadCounter expert_load_;
  bool counting_experts_ = false;
  int64_t rows_received_ = 0;
  int64_t replayed_dispatch_bytes_ = 0;  // see dispatch_bytes
  struct LayerRangeNames {
    std::string forward, backward;
  };
  std::vector<LayerRangeNames> layer_range_names_;  // NVTX ranges, per logical layer
};

}  // namespace moeut
