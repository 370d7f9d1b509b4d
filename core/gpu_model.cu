#include "core/gpu_model.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>

#include "core/gpu_activations.h"
#include "core/gpu_local_dispatcher.h"
#include "core/hang_watchdog.h"
#include "core/nvtx_range.h"
#include "kernels/cast_cuda.h"
#include "kernels/cuda_check.h"
#include "kernels/embedding_cuda.h"
#include "kernels/layernorm_cuda.h"
#include "kernels/rope_cuda.h"
#include "kernels/routing_cuda.h"

namespace moeut {

namespace {

using bf16 = __nv_bfloat16;
using cuda::DeviceBuffer;
using cuda::check_cublas;

}  // namespace

using Kind = DeviceLedger::Kind;

GpuModel::GpuModel(const ModelConfig& config, int64_t batch)
    : GpuModel(config, batch, expert_shard(config.ff_n_experts, 1, 0), nullptr, nullptr) {}

GpuModel::GpuModel(const ModelConfig& config, int64_t batch, ExpertShard shard,
                   const GpuDispatcherFactory& make_dispatcher, cudaStream_t stream)
    : cfg_((validate(config), config)),
      layout_(cfg_, shard),
      batch_(batch),
      B_(batch),
      stream_(stream),
      own_stream_(stream == nullptr),
      load_layout_(cfg_),
      expert_load_(load_layout_.size()) {
  if (own_stream_) MOEUT_CUDA_CHECK(cudaStreamCreate(&stream_));
  dense_ = std::make_unique<DenseProducts>(cfg_.d_model, stream_);
  for (int64_t l = 0; l < cfg_.n_layers; ++l)
    layer_range_names_.push_back({.forward = "layer " + std::to_string(l) + " forward",
                                  .backward = "layer " + std::to_string(l) + " backward"});
  side_ = std::make_unique<SideStream>(stream_);
  const int64_t T = cfg_.context, N = batch * T, d = cfg_.d_model, H = cfg_.n_heads;
  const int64_t hd = H * cfg_.d_head, he = H * cfg_.att_n_experts, hk = H * cfg_.att_k;
  const int64_t Ef = layout_.shard().count, kf = cfg_.ff_k, total = layout_.total();
  if (make_dispatcher) {
    dispatcher_ = make_dispatcher(N, stream_);
  } else if (Ef != cfg_.ff_n_experts) {
    throw std::invalid_argument("GpuModel: a shard of " + std::to_string(Ef) + " of " +
                                std::to_string(cfg_.ff_n_experts) + " FFN experts needs a token dispatcher");
  } else {
    dispatcher_ = std::make_unique<LocalGpuDispatcher>(N);
  }
  const int64_t M = dispatcher_->max_rows();  // token rows the FFN experts here may see
  grads_ = ledger_.allocate<float>(Kind::kGradients, size_t(total));
  zero_gradients();
  working_ = ledger_.allocate<bf16>(Kind::kWeights, size_t(total));
  params_ = tensors_in(working_.get(), layout_, cfg_.group_size);
  param_grads_ = tensors_in(grads_.get(), layout_, cfg_.group_size);
  planner_ = std::make_unique<cuda::CvmmPlanner>(std::max(M * kf, N * hk), std::max(Ef, he), std::max(M, N));
  act_ = std::make_unique<GpuActivations>(cfg_, batch, *dispatcher_, *planner_, ledger_);
  pass_clock_ = PassClock(stream_);
  profiler_ = StepProfiler(ledger_, size_t(64 * cfg_.n_layers + 64), stream_);  // a layer's passes make about 30 marks
  if (const char* off = std::getenv("MOEUT_NO_GRAPHS"); off && std::string(off) == "1") graphs_on_ = false;
  // Router products on rows not a multiple of 8 read a padded copy of their weight.
  bf16* copy = act_->padded_routers.get();
  auto router = [&](const bf16* param, int64_t rows) {
    RouterWeight r{.param = param, .rows = rows};
    if (router_rows_ld(rows) != rows) r.padded = std::exchange(copy, copy + act_->router_logits_ld * d);
    return r;
  };
  for (const LayerTensors<bf16>& P : params_.layers) {
    routers_.push_back({.ffn = router(P.expert_sel, cfg_.ff_n_experts), .attention = router(P.sel_v, 2 * he)});
    // q, k and the two routers are stacked by one copy (see copy_weights), and their weight
    // gradient is one product.
    if (P.k != P.q + hd * d || P.sel_v != P.q + 2 * hd * d || P.sel_o != P.q + (2 * hd + he) * d)
      throw std::logic_error("GpuModel: attention q, k and router weights are expected adjacent in the layout");
  }
  attention_ = std::make_unique<cuda::CausalAttention>(dense_->handle(), batch, T, H, cfg_.d_head);
  const int64_t G = cfg_.group_size, R = cfg_.repeats();
  reg_ffn_ = std::make_unique<cuda::EntropyReg>(G, batch, T, 1, cfg_.ff_n_experts, R);
  reg_att_v_ = std::make_unique<cuda::EntropyReg>(G, batch, T, H, cfg_.att_n_experts, R);
  reg_att_o_ = std::make_unique<cuda::EntropyReg>(G, batch, T, H, cfg_.att_n_experts, R);
  head_ = std::make_unique<cuda::LmHeadCE>(dense_->handle(), cfg_.n_tokens, d);
  ledger_.add(Kind::kWorkspace, planner_->device_bytes() + attention_->device_bytes() + reg_ffn_->device_bytes() +
                                    reg_att_v_->device_bytes() + reg_att_o_->device_bytes() + head_->device_bytes());
  ledger_.add(Kind::kExchange, dispatcher_->device_bytes());
  ledger_.add(Kind::kWorkspace, expert_load_.device_bytes());
}

void GpuModel::set_expert_counting(bool on) {
  if (on == counting_experts_) return;
  counting_experts_ = on;
  graphs_.clear();  // captured passes count or not as they were captured
}

GpuModel::~GpuModel() {
  graphs_.clear();  // before the stream they ran on
  head_.reset();  // the products' users, then the products, before the stream they are bound to
  attention_.reset();
  dense_.reset();
  if (own_stream_) cudaStreamDestroy(stream_);
}

void GpuModel::set_parameters(const std::vector<float>& params) {
  if (int64_t(params.size()) != layout_.total())
    throw std::invalid_argument("GpuModel: " + std::to_string(params.size()) + " parameters for a layout of " +
                                std::to_string(layout_.total()));
  const DeviceBuffer<float> fp32(params);
  cuda::to_bf16(working_.get(), fp32.get(), int64_t(params.size()), stream_);
  MOEUT_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

std::vector<float> GpuModel::gradients() {
  zero_unwritten_expert_grads();
  MOEUT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return grads_.download();
}

void GpuModel::zero_gradients() {
  MOEUT_CUDA_CHECK(cudaMemsetAsync(grads_.get(), 0, size_t(layout_.replicated()) * sizeof(float), stream_));
  expert_grads_written_.assign(size_t(cfg_.group_size), 0);
}

void GpuModel::zero_unwritten_expert_grads() {
  const int64_t numel = layout_.shard().count * cfg_.d_model * cfg_.ff_expert_size;  // of keys, and of values
  for (int64_t g = 0; g < int64_t(expert_grads_written_.size()); ++g) {
    if (expert_grads_written_[size_t(g)]) continue;
    for (float* t : {param_grads_.layers[g].keys, param_grads_.layers[g].values})
      MOEUT_CUDA_CHECK(cudaMemsetAsync(t, 0, size_t(numel) * sizeof(float), stream_));
    expert_grads_written_[size_t(g)] = 1;
  }
}

// y [rows, out] (row-major) = alpha · x [rows, d] · Wᵀ, W [out, d]: column-major y [out, rows].
void GpuModel::copy_weights(bool training) {
  const int64_t d = cfg_.d_model;
  for (const LayerRouters& R : routers_)
    for (const RouterWeight* r : {&R.ffn, &R.attention})
      if (r->padded)
        MOEUT_CUDA_CHECK(cudaMemcpyAsync(r->padded, r->param, size_t(r->rows * d) * sizeof(bf16),
                                         cudaMemcpyDeviceToDevice, stream_));
  if (!training) return;
  const int64_t hd = cfg_.n_heads * cfg_.d_head, he = cfg_.n_heads * cfg_.att_n_experts;
  for (int64_t g = 0; g < cfg_.group_size; ++g)
    MOEUT_CUDA_CHECK(cudaMemcpyAsync(act_->attn_in_weights.get() + g * act_->attn_in_ld * d, params_.layers[g].q,
                                     size_t((2 * hd + 2 * he) * d) * sizeof(bf16), cudaMemcpyDeviceToDevice, stream_));
}

void GpuModel::route(const bf16* x, const bf16* W, std::initializer_list<Routing> routers, bool beside) {
  int64_t out = 0;
  for (const Routing& r : routers) out += r.groups * r.E;
  const int64_t N = B_ * cfg_.context, ld = router_rows_ld(out);
  // One router on unpadded rows writes its own z; otherwise the product goes into act_->router_logits
  // and each top-k packs its router's columns into z.
  const bool direct = routers.size() == 1 && ld == out;
  float* const logits = direct ? routers.begin()->z : act_->router_logits.get();
  mark(Part::kDense);
  dense_->forward(x, W, N, ld, 1.f, logits, CUDA_R_32F, ld, "router product");
  mark(Part::kRouting);
  if (beside) side_->fork();
  cudaStream_t const stream = beside ? side_->get() : stream_;
  int64_t column = 0;
  for (const Routing& r : routers) {
    cuda::topk_sigmoid_forward(r.index, r.w, logits + column, N, r.groups, r.E, r.k, stream, ld, direct ? nullptr : r.z,
                               r.means);
    if (counting_experts_ && backward_ && r.load_offset >= 0)
      expert_load_.count(r.load_offset, r.index, r.w, N, r.groups, r.E, r.k, stream);
    column += r.groups * r.E;
  }
}

void GpuModel::attention_forward(int64_t l) {
  GpuLayerActivations& L = act_->layers[l];
  const int64_t g = l % cfg_.group_size;
  const LayerTensors<bf16>& P = params_.layers[g];
  const int64_t T = cfg_.context, N = B_ * T, d = cfg_.d_model, H = cfg_.n_heads, dh = cfg_.d_head;
  const int64_t hd = H * dh, Ea = cfg_.att_n_experts, ka = cfg_.att_k;
  mark(Part::kOther);
  // xb: the raw residual in bf16, which the value experts read (the output experts then add into
  // the residual in place).
  cuda::layernorm_forward(act_->xn.get(), L.rstd1.get(), act_->residual, P.ln1_weight, P.ln1_bias, N, d, stream_,
                          L.xb.get(), backward_ ? L.xhat1.get() : nullptr);
  // The value and output routers (adjacent in the layout) in one product. Their top-ks and plans,
  // small kernels bound by latency, run on the side stream beside q, k and RoPE; the output
  // experts' plan, needed only after the attention, is built beside the value experts too.
  route(act_->xn.get(), routers_[g].attention.get(),
        {{.groups = H, .E = Ea, .k = ka, .z = L.zv.get(), .index = L.iv.get(), .w = L.wv.get(),
          .means = reg_means(*reg_att_v_, l, L.zv_lse.get()),
          .load_offset = load_layout_.offset(g, ExpertKind::kAttentionValue)},
         {.groups = H, .E = Ea, .k = ka, .z = L.zo.get(), .index = L.io.get(), .w = L.wo.get(),
          .means = reg_means(*reg_att_o_, l, L.zo_lse.get()),
          .load_offset = load_layout_.offset(g, ExpertKind::kAttentionOutput)}},
        true);
  planner_->build(L.plan_v, L.iv.get(), N, H, Ea, ka, cuda::CvmmRoute::kGatherToGroupRows, side_->get());
  side_->mark();
  planner_->build(L.plan_o, L.io.get(), N, H, Ea, ka, cuda::CvmmRoute::kGroupRowsToTokens, side_->get());
  const float s = float(std::pow(double(dh), -0.25));
  mark(Part::kDense);
  // q and k (adjacent in the layout) in one product; their 2·H heads side by side take RoPE alike.
  dense_->forward(act_->xn.get(), P.q, N, 2 * hd, s, L.qk.get(), CUDA_R_16BF, 0, "q and k product");
  mark(Part::kAttention);
  cuda::rope_forward(L.qk.get(), B_, T, 2 * H, dh, cfg_.rope_dims(), stream_);
  mark(Part::kExperts);
  side_->join_marked();
  cuda::cvmm_rows(cuda::at_selections(L.plan_v.view()),
                  {.X = L.xb.get(), .W = P.v, .weight = nullptr, .out = L.v_sel.get(), .out_f32 = nullptr,
                   .dweight = nullptr, .dot_rows = nullptr, .K = d, .N = dh, .transpose_w = false, .accumulate = false},
                  stream_);
  cuda::cvmm_sum_selections(L.v.get(), L.v_sel.get(), L.wv.get(), L.iv.get(), N * H, ka, dh, stream_);
  mark(Part::kAttention);
  attention_->forward(L.heads.get(), L.lse.get(), L.qk.get(), L.qk.get() + hd, L.v.get(), stream_, 2 * hd);
  mark(Part::kExperts);
  side_->join();
  cuda::cvmm_rows(L.plan_o.view(),
                  {.X = L.heads.get(), .W = P.o, .weight = L.wo.get(), .out = nullptr,
                   .out_f32 = act_->residual, .dweight = nullptr, .dot_rows = nullptr, .K = dh, .N = d,
                   .transpose_w = false, .accumulate = true, .out_rows = N},
                  stream_);
}

void GpuModel::ffn_forward(int64_t l) {
  GpuLayerActivations& L = act_->layers[l];
  const int64_t g = l % cfg_.group_size;
  const LayerTensors<bf16>& P = params_.layers[g];
  const int64_t N = B_ * cfg_.context, d = cfg_.d_model, Ef = cfg_.ff_n_experts, kf = cfg_.ff_k;
  float* y = act_->residual;  // the FFN experts add into it in place
  mark(Part::kOther);
  cuda::layernorm_forward(act_->xn.get(), L.rstd2.get(), y, P.ln2_weight, P.ln2_bias, N, d, stream_,
                          L.x_mid, backward_ ? L.xhat2.get() : nullptr);
  route(act_->xn.get(), routers_[g].ffn.get(),
        {{.groups = 1, .E = Ef, .k = kf, .z = L.z.get(), .index = L.i_ff.get(), .w = L.w_ff.get(),
          .means = reg_means(*reg_ffn_, l, L.z_lse.get()), .load_offset = load_layout_.offset(g, ExpertKind::kFfn)}});
  mark(Part::kExperts);
  L.experts = dispatcher_->dispatch(
      *L.route, {.x = L.x_mid, .index = L.i_ff.get(), .weight = L.w_ff.get(), .rows = N, .out = y});
  experts_forward(l);
  dispatcher_->combine(*L.route);
}

void GpuModel::experts_forward(int64_t l) {
  GpuLayerActivations& L = act_->layers[l];
  const LayerTensors<bf16>& P = params_.layers[l % cfg_.group_size];
  const int64_t d = cfg_.d_model, E = layout_.shard().count, kf = cfg_.ff_k, es = cfg_.ff_expert_size;
  const GpuTokenDispatcher::Rows& in = L.experts;
  mark(Part::kExperts);
  planner_->build(L.plan_ff, in.index, in.rows, 1, E, kf, cuda::CvmmRoute::kGatherToPositions, stream_);
  dispatcher_->await(*L.route);  // the rows, which arrived beside the plan
  cuda::cvmm_rows(L.plan_ff.view(),
                  {.X = in.x, .W = P.keys, .weight = nullptr, .out = L.hidden.get(), .out_f32 = nullptr,
                   .dweight = nullptr, .dot_rows = nullptr, .K = d, .N = es, .transpose_w = false, .accumulate = false,
                   .relu = cuda::CvmmRowsArgs::Relu::kApply},
                  stream_);
  cuda::cvmm_rows(L.plan_ff.view(true),
                  {.X = L.hidden.get(), .W = P.values, .weight = in.weight, .out = nullptr,
                   .out_f32 = in.out, .dweight = nullptr, .dot_rows = nullptr, .K = es, .N = d, .transpose_w = false,
                   .accumulate = true, .out_rows = in.rows},
                  stream_);
}

LossParts GpuModel::run(const int32_t* tokens, int64_t B, double weight, Pass pass, GradientSync* sync) {
  if (!(weight > 0)) throw std::invalid_argument("GpuModel: weight must be positive");
  // The regularisers average over the planned batch: losses and training need all of it.
  if (B > batch_ || (pass != Pass::kEvaluate && B != batch_))
    throw std::invalid_argument("GpuModel: batch of " + std::to_string(B) + " sequences, planned for " +
                                std::to_string(batch_));
  const int64_t T = cfg_.context, N = B * T;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      act_->inputs_host.get()[b * T + t] = tokens[b * (T + 1) + t];
      act_->targets_host.get()[b * T + t] = tokens[b * (T + 1) + t + 1];
    }
  profiler_.clear();  // the profile is the last pass's
  if (graphs() && pass != Pass::kEvaluate) enqueue_graphed(B, weight, pass, sync);
  else enqueue(B, weight, pass, sync);
  {
    const Waiting waiting("the GPU's pass (its expert exchanges among its work)", "expert-parallel");
    MOEUT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  LossParts out;
  out.ce = std::accumulate(act_->row_loss_host.get(), act_->row_loss_host.get() + N, 0.0) / double(N);
  out.reg_ffn = act_->reg_loss_host.get()[0] / weight;
  out.reg_att = act_->reg_loss_host.get()[1] / weight;
  if (pass == Pass::kTrain) {
    out.residual_std = residual_std_of(act_->rstd_f_host.get(), N);
    for (const GpuLayerActivations& L : act_->layers) rows_received_ += L.experts.rows;
    pass_clock_.add_to(pass_seconds_);
  }
  return out;
}

void GpuModel::enqueue_graphed(int64_t B, double weight, Pass pass, GradientSync* sync) {
  // The dispatcher counts its bytes on the host as it queues an exchange, so a replay, which
  // queues nothing, adds what its captured pass sent.
  const int64_t sent_before = dispatcher_->bytes_sent();
  graphs_.run(
      {.pass = pass,
       .B = B,
       .weight = weight,
       .profiled = profiler_.on(),
       .synced = sync != nullptr,
       .written_before = expert_grads_written_},
      stream_, [&] { enqueue(B, weight, pass, sync); },
      [&] {
        PassState state{.written = expert_grads_written_,
                        .mark_parts = profiler_.parts(),
                        .experts = {},
                        .dispatch_bytes = dispatcher_->bytes_sent() - sent_before};
        for (const GpuLayerActivations& L : act_->layers) state.experts.push_back(L.experts);
        return state;
      },
      [&](const PassState& after) {
        expert_grads_written_ = after.written;
        profiler_.set_parts(after.mark_parts);
        for (size_t l = 0; l < act_->layers.size(); ++l) act_->layers[l].experts = after.experts[l];
        if (dispatcher_->bytes_sent() == sent_before) replayed_dispatch_bytes_ += after.dispatch_bytes;
      });
}

void GpuModel::enqueue(int64_t B, double weight, Pass pass, GradientSync* sync) {
  const bool backward = pass == Pass::kTrain;
  B_ = B;
  regularised_ = pass != Pass::kEvaluate;
  backward_ = backward;
  if (backward) pass_clock_.mark(PassClock::kStart);
  mark(Part::kAttention);
  attention_->set_batch(B);
  const int64_t T = cfg_.context, N = B * T, d = cfg_.d_model;
  mark(Part::kOther);
  MOEUT_CUDA_CHECK(cudaMemcpyAsync(act_->inputs.get(), act_->inputs_host.get(), size_t(N) * sizeof(int32_t),
                                   cudaMemcpyHostToDevice, stream_));
  MOEUT_CUDA_CHECK(cudaMemcpyAsync(act_->targets.get(), act_->targets_host.get(), size_t(N) * sizeof(int32_t),
                                   cudaMemcpyHostToDevice, stream_));
  copy_weights(backward);
  cuda::embedding_forward(act_->residual, act_->inputs.get(), params_.embedding, N, d, stream_);
  if (regularised_) {
    mark(Part::kRouting);
    for (cuda::EntropyReg* reg : {reg_ffn_.get(), reg_att_v_.get(), reg_att_o_.get()}) reg->clear(stream_);
  }
  for (int64_t l = 0; l < cfg_.n_layers; ++l) {
    const NvtxRange range(layer_range_names_[l].forward.c_str());
    attention_forward(l);
    ffn_forward(l);
  }
  // The regularisers' losses and gradient weights, once every use has added its softmax means, on
  // the side stream: the output LayerNorm and the LM head beside them need none of their work,
  // and the backward pass none of it before the join below.
  mark(Part::kRouting);
  MOEUT_CUDA_CHECK(cudaMemsetAsync(act_->reg_loss.get(), 0, 2 * sizeof(double), stream_));
  side_->fork();
  for (int64_t g = 0; g < (regularised_ ? cfg_.group_size : 0); ++g) {
    reg_ffn_->finish(g, weight * cfg_.entropy_reg, act_->reg_loss.get(), side_->get());
    reg_att_v_->finish(g, weight * cfg_.att_entropy_reg, act_->reg_loss.get() + 1, side_->get());
    reg_att_o_->finish(g, weight * cfg_.att_entropy_reg, act_->reg_loss.get() + 1, side_->get());
  }
  mark(Part::kOther);
  cuda::layernorm_forward(act_->xf.get(), act_->rstd_f.get(), act_->residual, params_.out_norm_weight,
                          params_.out_norm_bias, N, d, stream_, nullptr, backward ? act_->xhat_f.get() : nullptr);
  // The cross-entropy gradient starts the backward pass at the output LayerNorm.
  mark(Part::kDense);
  head_->run(act_->row_loss.get(), backward ? act_->dxf.get() : nullptr, param_grads_.lm_head_weight,
             param_grads_.lm_head_bias, act_->xf.get(), params_.lm_head_weight, params_.lm_head_bias,
             act_->targets.get(), N, float(weight / double(N)), stream_);
  mark(Part::kRouting);
  side_->join();
  if (backward) {
    pass_clock_.mark(PassClock::kBackward);
    mark(Part::kOther);
    MOEUT_CUDA_CHECK(cudaMemsetAsync(act_->dres, 0, size_t(N * d) * sizeof(float), stream_));
    cuda::layernorm_backward(act_->dres, param_grads_.out_norm_weight, param_grads_.out_norm_bias,
                             act_->dxf.get(), act_->xhat_f.get(), params_.out_norm_weight, act_->rstd_f.get(), N, d,
                             stream_, act_->dresb);
    GpuTokenDispatcher::GradRows ffn_grads = dispatch_ffn_grad(cfg_.n_layers - 1);
    for (int64_t l = cfg_.n_layers - 1; l >= 0; --l) {
      const NvtxRange range(layer_range_names_[l].backward.c_str());
      ffn_backward(l, ffn_grads);
      if (sync && l < cfg_.group_size) sync->experts_final(l, grads_.get());
      attention_backward(l);
      // The layer below's output gradient travels to its experts beside this layer's weight
      // gradients.
      if (l > 0) ffn_grads = dispatch_ffn_grad(l - 1);
      attention_weight_grad(l);
    }
    mark(Part::kOther);
    cuda::embedding_backward(param_grads_.embedding, act_->dres, act_->inputs.get(), N, d, stream_);
    fold_router_grads();
    side_->join();  // the first layer's value-expert weight gradient
    if (sync) sync->pass_end();
    pass_clock_.mark(PassClock::kEnd);
  }
  mark(Part::kCount);
  MOEUT_CUDA_CHECK(cudaMemcpyAsync(act_->row_loss_host.get(), act_->row_loss.get(), size_t(N) * sizeof(float),
                                   cudaMemcpyDeviceToHost, stream_));
  MOEUT_CUDA_CHECK(cudaMemcpyAsync(act_->reg_loss_host.get(), act_->reg_loss.get(), 2 * sizeof(double),
                                   cudaMemcpyDeviceToHost, stream_));
  if (backward)
    MOEUT_CUDA_CHECK(cudaMemcpyAsync(act_->rstd_f_host.get(), act_->rstd_f.get(), size_t(N) * sizeof(float),
                                     cudaMemcpyDeviceToHost, stream_));
}

float* GpuModel::ffn_router_grad(int64_t group) const {
  if (act_->router_grads_padded.size() == 0) return param_grads_.layers[group].expert_sel;
  return act_->router_grads_padded.get() + group * router_rows_ld(cfg_.ff_n_experts) * cfg_.d_model;
}

void GpuModel::fold_router_grads() {
  if (act_->router_grads_padded.size() == 0) return;
  mark(Part::kDense);
  for (int64_t g = 0; g < cfg_.group_size; ++g)
    dense_->add(ffn_router_grad(g), param_grads_.layers[g].expert_sel, cfg_.ff_n_experts * cfg_.d_model,
                "FFN router gradient");
  MOEUT_CUDA_CHECK(
      cudaMemsetAsync(act_->router_grads_padded.get(), 0, act_->router_grads_padded.size() * sizeof(float), stream_));
}

void GpuModel::routing_grad(const cuda::SoftmaxGrad& reg, const int32_t* index, const float* w, int64_t groups,
                            int64_t E, int64_t k, bf16* dzb, int64_t ld) {
  mark(Part::kRouting);
  cuda::topk_sigmoid_backward(dzb, ld, reg, act_->dw.get(), index, w, B_ * cfg_.context, groups, E, k, stream_);
}

GpuTokenDispatcher::GradRows GpuModel::dispatch_ffn_grad(int64_t l) {
  const int64_t N = B_ * cfg_.context, kf = cfg_.ff_k;
  // dres holds d/d(layer output), and dresb its bf16 copy (written by the LayerNorm backward that
  // finished it). The FFN input is the raw x_mid: its expert gradient adds straight onto dres, and
  // so does LN2's.
  mark(Part::kOther);
  MOEUT_CUDA_CHECK(cudaMemsetAsync(act_->dw.get(), 0, size_t(N * kf) * sizeof(float), stream_));
  mark(Part::kExperts);
  return dispatcher_->dispatch_grad(*act_->layers[l].route,
                                    {.dy = act_->dresb, .dx = act_->dres, .dw = act_->dw.get()});
}

void GpuModel::ffn_backward(int64_t l, const GpuTokenDispatcher::GradRows& grads) {
  GpuLayerActivations& L = act_->layers[l];
  const int64_t g = l % cfg_.group_size;
  const LayerTensors<bf16>& P = params_.layers[g];
  const LayerTensors<float>& dP = param_grads_.layers[g];
  const int64_t N = B_ * cfg_.context, d = cfg_.d_model, Ef = cfg_.ff_n_experts, kf = cfg_.ff_k;
  mark(Part::kExperts);
  dispatcher_->await(*L.route);
  experts_backward(l, grads);
  dispatcher_->combine_grad(*L.route);  // beside the experts' weight gradients
  // The router: its gradient's rows padded to router_rows_ld (zeros past Ef), its weight likewise.
  const int64_t ld = router_rows_ld(Ef);
  routing_grad(reg_ffn_->gradient(g, L.z.get(), L.z_lse.get()), L.i_ff.get(), L.w_ff.get(),
               1, Ef, kf, act_->dzb.get(), ld);
  mark(Part::kDense);
  dense_->input_grad(act_->dzb.get(), ld, routers_[g].ffn.get(), ld, N, act_->dxn.get());
  mark(Part::kOther);
  side_->join();  // the experts' weight gradients read dY, which is dresb or holds it
  // LN2's backward also writes LN2's output again (bit for bit the forward's) into act_->xn, for the
  // router's weight gradient.
  cuda::layernorm_backward(act_->dres, dP.ln2_weight, dP.ln2_bias, act_->dxn.get(), L.xhat2.get(), P.ln2_weight,
                           L.rstd2.get(), N, d, stream_, act_->dresb, P.ln2_bias, act_->xn.get());
  mark(Part::kDense);
  dense_->weight_grad(act_->dzb.get(), ld, act_->xn.get(), ffn_router_grad(g), N, ld);
}

GpuModel::WeightGradTurn GpuModel::weight_grad_turn(int64_t l) const {
  const int64_t r = l / cfg_.group_size, from_top = cfg_.repeats() - 1 - r;
  if (from_top % 2 == 1) return WeightGradTurn::kWithDeferred;
  return r > 0 ? WeightGradTurn::kDefer : WeightGradTurn::kAlone;
}

void GpuModel::experts_backward(int64_t l, const GpuTokenDispatcher::GradRows& grads) {
  GpuLayerActivations& L = act_->layers[l];
  const int64_t g = l % cfg_.group_size, G = cfg_.group_size;
  const LayerTensors<bf16>& P = params_.layers[g];
  const int64_t d = cfg_.d_model, E = layout_.shard().count, es = cfg_.ff_expert_size;
  const GpuTokenDispatcher::Rows& in = L.experts;
  const bf16* const dY = grads.dy;
  float* const dX = grads.dx;
  float* const dw = grads.dw;
  const WeightGradTurn turn = weight_grad_turn(l);
  // A deferring use keeps its output gradient and hidden-unit gradient in its physical layer's
  // slot until the use below runs the weight gradients of both.
  const int64_t dy_slot = act_->deferred_dy.size() / G, dh_slot = act_->deferred_dhidden.size() / G;
  bf16* const deferred_dy = turn == WeightGradTurn::kAlone ? nullptr : act_->deferred_dy.get() + g * dy_slot;
  bf16* const deferred_dh = turn == WeightGradTurn::kAlone ? nullptr : act_->deferred_dhidden.get() + g * dh_slot;
  bf16* const dhidden = turn == WeightGradTurn::kDefer ? deferred_dh : act_->dhidden.get();
  // The first weight gradient of this physical layer since zero_gradients() writes dW.
  const bool overwrite = turn != WeightGradTurn::kDefer && !expert_grads_written_[size_t(g)];
  mark(Part::kExperts);
  if (turn == WeightGradTurn::kDefer)
    MOEUT_CUDA_CHECK(cudaMemcpyAsync(deferred_dy, dY, size_t(in.rows * d) * sizeof(bf16), cudaMemcpyDeviceToDevice,
                                     stream_));
  // Each weight gradient runs on the side stream beside the input gradient that shares its
  // inputs, and on beside the exchange that returns the input gradients: the caller joins the
  // side stream before dY or dhidden is written again. deferred(U): the same product's plan and
  // arguments for the deferred use U.
  auto weight_grad = [&](const cuda::CvmmPlan& plan, const cuda::CvmmWeightGradArgs& a, auto deferred) {
    if (turn == WeightGradTurn::kDefer) return;
    side_->fork();
    if (turn == WeightGradTurn::kAlone) {
      cuda::cvmm_weight_grad(plan, a, side_->get());
    } else {
      const auto [deferred_plan, deferred_args] = deferred(act_->layers[l + G]);
      cuda::cvmm_weight_grad(deferred_plan, deferred_args, plan, a, side_->get());
    }
  };
  float* const dvalues = param_grads_.layers[g].values;
  weight_grad(L.plan_ff.view(true),
              {.A = L.hidden.get(), .B = dY, .weight = in.weight, .a_by_in_row = true, .dW = dvalues, .K = es, .N = d,
               .n_experts = E, .overwrite = overwrite},
              [&](const GpuLayerActivations& U) {
                return std::pair{U.plan_ff.view(true),
                                 cuda::CvmmWeightGradArgs{.A = U.hidden.get(), .B = deferred_dy,
                                                          .weight = U.experts.weight,
                                                          .a_by_in_row = true, .dW = dvalues, .K = es, .N = d,
                                                          .n_experts = E, .overwrite = overwrite}};
              });
  // dhidden comes out already through the ReLU's gradient (masked where hidden is 0); the
  // routing-weight gradient is the same either way, its dot products reading hidden itself.
  cuda::cvmm_rows(L.plan_ff.view(),
                  {.X = dY, .W = P.values, .weight = in.weight, .out = dhidden, .out_f32 = nullptr,
                   .dweight = dw, .dot_rows = L.hidden.get(), .K = d, .N = es, .transpose_w = true, .accumulate = false,
                   .relu = cuda::CvmmRowsArgs::Relu::kMaskByDotRows},
                  stream_);
  float* const dkeys = param_grads_.layers[g].keys;
  weight_grad(L.plan_ff.view(),
              {.A = in.x, .B = dhidden, .weight = nullptr, .a_by_in_row = true, .dW = dkeys, .K = d, .N = es,
               .n_experts = E, .overwrite = overwrite},
              [&](const GpuLayerActivations& U) {
                return std::pair{U.plan_ff.view(),
                                 cuda::CvmmWeightGradArgs{.A = U.experts.x, .B = deferred_dh, .weight = nullptr,
                                                          .a_by_in_row = true, .dW = dkeys, .K = d, .N = es,
                                                          .n_experts = E, .overwrite = overwrite}};
              });
  if (turn != WeightGradTurn::kDefer) expert_grads_written_[size_t(g)] = 1;
  cuda::cvmm_rows(L.plan_ff.view(true),
                  {.X = dhidden, .W = P.keys, .weight = nullptr, .out = nullptr, .out_f32 = dX, .dweight = nullptr,
                   .dot_rows = nullptr, .K = es, .N = d, .transpose_w = true, .accumulate = true, .out_rows = in.rows},
                  stream_);
}

void GpuModel::attention_backward(int64_t l) {
  GpuLayerActivations& L = act_->layers[l];
  const int64_t g = l % cfg_.group_size;
  const LayerTensors<bf16>& P = params_.layers[g];
  const LayerTensors<float>& dP = param_grads_.layers[g];
  const int64_t T = cfg_.context, N = B_ * T, d = cfg_.d_model, H = cfg_.n_heads, dh = cfg_.d_head;
  const int64_t hd = H * dh, Ea = cfg_.att_n_experts, ka = cfg_.att_k;
  mark(Part::kOther);  // dresb: the bf16 copy of dres, from LN2's backward
  // Output experts: head gradients (ka selections per head row: accumulated in fp32).
  MOEUT_CUDA_CHECK(cudaMemsetAsync(act_->dheads_f32.get(), 0, size_t(N * hd) * sizeof(float), stream_));
  MOEUT_CUDA_CHECK(cudaMemsetAsync(act_->dw.get(), 0, size_t(N * H * ka) * sizeof(float), stream_));
  mark(Part::kExperts);
  // The expert weight gradients run on the side stream (see experts_backward) until the
  // LayerNorm backward below writes dresb again.
  side_->fork();
  cuda::cvmm_weight_grad(L.plan_o.view(),
                         {.A = L.heads.get(), .B = act_->dresb, .weight = L.wo.get(), .a_by_in_row = true,
                          .dW = dP.o, .K = dh, .N = d, .n_experts = H * Ea, .staging = act_->att_dw_staging.get()},
                         side_->get());
  cuda::cvmm_rows(L.plan_o.view(true),
                  {.X = act_->dresb,
                   .W = P.o,
                   .weight = L.wo.get(),
                   .out = nullptr,
                   .out_f32 = act_->dheads_f32.get(),
                   .dweight = act_->dw.get(),
                   .dot_rows = L.heads.get(),
                   .K = d,
                   .N = dh,
                   .transpose_w = true,
                   .accumulate = true,
                   .out_rows = N * H},
                  stream_);
  // The gradients of LN1's four readers go side by side into act_->attn_in_grad (see gpu_model.h):
  // dq, dk, the value router's, the output router's.
  bf16* const dq = act_->attn_in_grad.get();
  bf16* const dk = dq + hd;
  bf16* const dz_v = dq + 2 * hd;
  bf16* const dz_o = dz_v + H * Ea;
  routing_grad(reg_att_o_->gradient(g, L.zo.get(), L.zo_lse.get()), L.io.get(), L.wo.get(), H, Ea, ka, dz_o,
               act_->attn_in_ld);
  mark(Part::kAttention);
  // q and k were scaled by s in the forward pass: dq and dk come scaled alike, the gradients of
  // the products before the scale.
  const float s = float(std::pow(double(dh), -0.25));
  attention_->backward(dq, dk, act_->dv.get(), act_->dheads_f32.get(), L.heads.get(), L.lse.get(), L.qk.get(),
                       L.qk.get() + hd, L.v.get(), stream_, act_->attn_in_ld, s, 2 * hd);
  // Value experts read the raw residual: their input gradient adds onto dres. Their routing-weight
  // gradient dots dv with each selection's kept row.
  mark(Part::kExperts);
  cuda::cvmm_rows(L.plan_v.view(true),
                  {.X = act_->dv.get(), .W = P.v, .weight = L.wv.get(), .out = nullptr,
                   .out_f32 = act_->dres, .dweight = nullptr, .dot_rows = nullptr, .K = dh, .N = d,
                   .transpose_w = true, .accumulate = true, .out_rows = N},
                  stream_);
  cuda::cvmm_selection_dots(act_->dw.get(), L.v_sel.get(), act_->dv.get(), L.iv.get(), N * H * ka, ka, dh, stream_);
  routing_grad(reg_att_v_->gradient(g, L.zv.get(), L.zv_lse.get()), L.iv.get(), L.wv.get(), H, Ea, ka, dz_v,
               act_->attn_in_ld);
  mark(Part::kAttention);
  cuda::rope_backward(dq, B_, T, 2 * H, dh, cfg_.rope_dims(), stream_, act_->attn_in_ld);  // dq and dk's 2·H heads
  mark(Part::kDense);
  // The input gradient is one product over all four.
  dense_->input_grad(act_->attn_in_grad.get(), act_->attn_in_ld, act_->attn_in_weights.get() + g * act_->attn_in_ld * d,
                     act_->attn_in_ld, N, act_->dxn.get());
  side_->join();
  mark(Part::kOther);
  // dresb for the layer below (none below the first: the embedding's gradient reads dres), and
  // LN1's output again (bit for bit the forward's) into act_->xn for the weight gradients.
  cuda::layernorm_backward(act_->dres, dP.ln1_weight, dP.ln1_bias, act_->dxn.get(), L.xhat1.get(), P.ln1_weight,
                           L.rstd1.get(), N, d, stream_, l > 0 ? act_->dresb : nullptr, P.ln1_bias,
                           act_->xn.get());
  // The value experts' weight gradient runs on the side stream beside this layer's dense weight
  // gradients and the next layer's FFN backward, whose join comes before act_->dv is written again.
  mark(Part::kExperts);
  side_->fork();
  cuda::cvmm_weight_grad(L.plan_v.view(),
                         {.A = L.xb.get(), .B = act_->dv.get(), .weight = L.wv.get(), .a_by_in_row = true,
                          .dW = dP.v, .K = d, .N = dh, .n_experts = H * Ea, .staging = act_->att_dw_staging.get()},
                         side_->get());
}

void GpuModel::attention_weight_grad(int64_t l) {
  const int64_t N = B_ * cfg_.context, hd = cfg_.n_heads * cfg_.d_head, he = cfg_.n_heads * cfg_.att_n_experts;
  mark(Part::kDense);
  // q, k and the two routers are adjacent in the layout (checked at construction): one product
  // of their gradients (act_->attn_in_grad) and LN1's output, which attention_backward wrote
  // again into act_->xn.
  dense_->weight_grad(act_->attn_in_grad.get(), act_->attn_in_ld, act_->xn.get(),
                      param_grads_.layers[l % cfg_.group_size].q, N, 2 * hd + 2 * he);
}

}  // namespace moeut
