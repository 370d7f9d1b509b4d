#include <algorithm>

#include "core/gpu_activations.h"
#include "kernels/cuda_check.h"

namespace moeut {

namespace {

template <typename T>
void zero(cuda::DeviceBuffer<T>& b) {
  MOEUT_CUDA_CHECK(cudaMemset(b.get(), 0, b.size() * sizeof(T)));
}

}  // namespace

GpuActivations::GpuActivations(const ModelConfig& cfg, int64_t batch, const GpuTokenDispatcher& dispatcher,
                               const cuda::CvmmPlanner& planner, DeviceLedger& ledger) {
  using Kind = DeviceLedger::Kind;
  const int64_t N = batch * cfg.context, d = cfg.d_model, H = cfg.n_heads;
  const int64_t hd = H * cfg.d_head, he = H * cfg.att_n_experts, hk = H * cfg.att_k, kf = cfg.ff_k;
  const int64_t M = dispatcher.max_rows(), G = cfg.group_size, hidden = M * kf * cfg.ff_expert_size;
  auto activations = [&]<typename T>(Buffer<T>& b, int64_t n) {
    b = ledger.allocate<T>(Kind::kActivations, size_t(n));
  };
  auto workspace = [&]<typename T>(Buffer<T>& b, int64_t n) { b = ledger.allocate<T>(Kind::kWorkspace, size_t(n)); };

  workspace(inputs, N);
  workspace(targets, N);
  // The token rows the dispatcher offers to keep where its exchange reads and adds them.
  const GpuTokenDispatcher::Places places = dispatcher.places();
  auto place = [&]<typename T>(T*& at, T* offered, Buffer<T>& own, Kind kind) {
    at = offered;
    if (at) return;
    own = ledger.allocate<T>(kind, size_t(N * d));
    at = own.get();
  };
  place(residual, places.out, residual_own, Kind::kActivations);
  layers.resize(size_t(cfg.n_layers));
  for (GpuLayerActivations& L : layers) {
    for (auto* plan : {&L.plan_v, &L.plan_o, &L.plan_ff}) {
      *plan = planner.make_buffers();
      ledger.add(Kind::kActivations, plan->device_bytes());
    }
    for (auto* b : {&L.xb, &L.xhat1, &L.xhat2}) activations(*b, N * d);
    activations(L.qk, N * 2 * hd);
    activations(L.v, N * hd);
    activations(L.heads, N * hd);
    activations(L.v_sel, N * hk * cfg.d_head);
    activations(L.hidden, hidden);
    L.route = dispatcher.make_route();
    ledger.add(Kind::kExchange, L.route->device_bytes());
    place(L.x_mid, dispatcher.token_rows(*L.route), L.x_mid_own, Kind::kActivations);
    for (auto* b : {&L.rstd1, &L.rstd2}) activations(*b, N);
    activations(L.lse, N * H);
    for (auto* b : {&L.zv, &L.zo}) activations(*b, N * he);
    for (auto* b : {&L.zv_lse, &L.zo_lse}) activations(*b, N * H);
    activations(L.z_lse, N);
    for (auto* b : {&L.wv, &L.wo}) activations(*b, N * hk);
    for (auto* b : {&L.iv, &L.io}) activations(*b, N * hk);
    activations(L.z, N * cfg.ff_n_experts);
    activations(L.w_ff, N * kf);
    activations(L.i_ff, N * kf);
  }
  activations(xf, N * d);
  workspace(xn, N * d);
  activations(xhat_f, N * d);
  if (cfg.repeats() > 1) {  // some uses defer their expert weight gradients
    workspace(deferred_dy, G * M * d);
    workspace(deferred_dhidden, G * hidden);
  }
  activations(rstd_f, N);
  workspace(row_loss, N);
  inputs_host = cuda::PinnedBuffer<int32_t>(size_t(N));
  targets_host = cuda::PinnedBuffer<int32_t>(size_t(N));
  row_loss_host = cuda::PinnedBuffer<float>(size_t(N));
  reg_loss_host = cuda::PinnedBuffer<double>(2);
  rstd_f_host = cuda::PinnedBuffer<float>(size_t(N));
  workspace(reg_loss, 2);
  place(dres, places.dx, dres_own, Kind::kWorkspace);
  workspace(dxf, N * d);
  workspace(dxn, N * d);
  workspace(dw, N * std::max(kf, hk));
  // The FFN router, and the attention's two routers in one product.
  router_logits_ld = router_rows_ld(std::max(cfg.ff_n_experts, 2 * he));
  workspace(router_logits, N * router_logits_ld);
  workspace(dzb, N * router_logits_ld);
  zero(dzb);  // its padding stays zero
  workspace(dheads_f32, N * hd);
  workspace(att_dw_staging, N * hk * 128);  // positions x 128 (see CvmmWeightGradArgs::staging)
  place(dresb, places.dy, dresb_own, Kind::kWorkspace);
  workspace(dhidden, hidden);
  workspace(dv, N * hd);
  attn_in_ld = router_rows_ld(2 * hd + 2 * he);  // rows 16-byte multiples, for cuBLAS's aligned kernels
  workspace(attn_in_grad, N * attn_in_ld);
  workspace(attn_in_weights, G * attn_in_ld * d);
  zero(attn_in_grad);
  zero(attn_in_weights);
  const int64_t padded = (router_rows_ld(cfg.ff_n_experts) != cfg.ff_n_experts) + (router_rows_ld(2 * he) != 2 * he);
  workspace(padded_routers, G * padded * router_logits_ld * d);
  zero(padded_routers);
  if (const int64_t ld = router_rows_ld(cfg.ff_n_experts); ld != cfg.ff_n_experts) {
    workspace(router_grads_padded, G * ld * d);
    zero(router_grads_padded);
  }
}

}  // namespace moeut
