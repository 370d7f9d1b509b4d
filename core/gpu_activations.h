// The device memory GpuModel plans once for its batch, besides its parameters and gradients:
// what each logical layer keeps from its forward pass for its backward (GpuLayerActivations),
// and the buffers the layers share (GpuActivations). Every buffer is allocated through the
// model's ledger under its kind, so the start-up line can say where the memory goes.
//
// N = batch · context token rows; M = the rows the FFN experts here may be given by one dispatch
// (the dispatcher's max_rows: N locally, more under expert parallelism).
#pragma once
#include <cuda_bf16.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "core/config.h"
#include "core/device_ledger.h"
#include "core/gpu_token_dispatcher.h"
#include "kernels/cvmm_cuda.h"
#include "kernels/device_buffer.h"

namespace moeut {

struct GpuLayerActivations {
  using bf16 = __nv_bfloat16;
  template <typename T>
  using Buffer = cuda::DeviceBuffer<T>;
  // qk: q's and k's rows side by side, [N, 2·H·dh], as one product writes them; v: the values
  // [N, H·dh], kept for the backward (so that it need not sum them again).
  // xb, x_mid: the residual entering the layer and after its attention, in bf16 (the value and
  // FFN experts' input); x_mid lies where the dispatcher reads its rows (token_rows), in
  // x_mid_own where it names no place. xhat1, xhat2: LN1's and LN2's x̂ in bf16, which their
  // backward reads. hidden: the FFN experts' hidden units [M·k, ff_expert_size].
  Buffer<bf16> qk, v, heads, xb, x_mid_own, xhat1, xhat2, hidden;
  bf16* x_mid = nullptr;
  // The value experts' unweighted rows, one per selection [N·H·ka, dh] (see cuda::at_selections):
  // the values are summed from them, and their routing-weight gradient dots them.
  Buffer<bf16> v_sel;
  // zv, zo, z: the routing logits, from which the top-k backward makes the regulariser's gradient,
  // with their rows' log-sum-exps zv_lse, zo_lse, z_lse; wv, wo, w_ff and iv, io, i_ff: the top-k
  // weights and experts; rstd1, rstd2: the LayerNorms' reciprocal deviations.
  Buffer<float> rstd1, zv, zo, wv, wo, rstd2, z, w_ff;
  Buffer<float> zv_lse, zo_lse, z_lse;
  Buffer<float> lse;  // attention's row log-sum-exp, for its backward
  Buffer<int32_t> iv, io, i_ff;
  cuda::CvmmPlanBuffers plan_v, plan_o, plan_ff;  // the expert products' plans
  // The FFN dispatch: where its tokens went, and the rows it gave the experts here.
  std::unique_ptr<GpuTokenDispatcher::Route> route;
  GpuTokenDispatcher::Rows experts{};
};

struct GpuActivations {
  using bf16 = __nv_bfloat16;
  template <typename T>
  using Buffer = cuda::DeviceBuffer<T>;

  // Plans for `batch` sequences, the FFN layers dispatched by `dispatcher`, the expert products
  // planned by `planner`.
  GpuActivations(const ModelConfig& cfg, int64_t batch, const GpuTokenDispatcher& dispatcher,
                 const cuda::CvmmPlanner& planner, DeviceLedger& ledger);

  std::vector<GpuLayerActivations> layers;  // per logical layer
  Buffer<int32_t> inputs, targets;          // the staged batch [N]
  // The residual stream, which the output experts and the FFN experts add into in place: a
  // layer's backward reads its LayerNorms' x̂ and its bf16 copies, never the fp32 residual. It
  // lies where the dispatcher adds this rank's expert outputs (places().out), in residual_own
  // where it names no place.
  Buffer<float> residual_own;
  float* residual = nullptr;
  Buffer<bf16> xf, xhat_f;  // the output LayerNorm's output and x̂
  Buffer<float> rstd_f, row_loss;
  // A layer's LayerNorm output (bf16), for the products that read it; in the backward pass the
  // LayerNorm backward writes it again from the kept x̂, for the weight gradients that follow
  // it, instead of keeping one per layer.
  Buffer<bf16> xn;
  // Per physical layer, a deferring use's output gradient [M, d] and hidden-unit gradient
  // (see GpuModel::WeightGradTurn); none when every physical layer is used once.
  Buffer<bf16> deferred_dy, deferred_dhidden;
  // Backward scratch, shared by the layers: the residual's gradient dres (fp32) and its bf16
  // copy dresb, which lie where the dispatcher adds the FFN experts' input gradients and reads
  // their output gradients (places().dx, .dy; in dres_own, dresb_own where it names none), the
  // output LayerNorm's, the routing weights', the attention heads' in fp32.
  Buffer<float> dres_own, dxf, dw, dheads_f32;
  float* dres = nullptr;
  bf16* dresb = nullptr;
  // dxn: a LayerNorm output's gradient, as the products that read the output give it (bf16, as
  // their other activations: the LayerNorm backward reads it once).
  Buffer<bf16> dresb_own, dhidden, dzb, dv, dxn;
  // The attention experts' weight gradients lay out their per-selection operand here, weighted
  // and by position (see cuda::CvmmWeightGradArgs::staging).
  Buffer<bf16> att_dw_staging;
  // Router products on rows not a multiple of 8 (see router_rows_ld) read padded copies of their
  // weights (zero past each router's rows), write their logits [N, router_logits_ld] before each
  // top-k packs its router's columns into its z, and (the FFN routers) accumulate their weight
  // gradients padded, one per physical layer, folded into the parameters' gradients after each
  // backward (cuBLAS's product on 565 rows picks a slower sm80 kernel with a split-K pass).
  // dzb: the routing logits' gradient, rows router_logits_ld apart.
  Buffer<bf16> padded_routers;
  Buffer<float> router_logits, router_grads_padded;
  int64_t router_logits_ld;  // the widest router product's rows, padded
  // The gradients of the four products that read LN1's output, side by side in one matrix
  // [N, attn_in_ld] (dq, dk, the value router's, the output router's; zero past them), and those
  // products' weights stacked to match [attn_in_ld, d] per physical layer: their input gradient
  // is one product.
  Buffer<bf16> attn_in_grad, attn_in_weights;
  int64_t attn_in_ld;
  Buffer<double> reg_loss;  // the regularisers' sums
  // Tokens in and losses out, staged in pinned memory so their copies are part of a graph.
  cuda::PinnedBuffer<int32_t> inputs_host, targets_host;
  cuda::PinnedBuffer<float> row_loss_host, rstd_f_host;  // rstd_f_host: the output LayerNorm's, for residual_std
  cuda::PinnedBuffer<double> reg_loss_host;
};

// cuBLAS falls back to slow unaligned kernels (sm75 `align1`) when a product's dimension or rows
// are not multiples of 8 elements, as with 565 experts: router products run on padded rows.
inline int64_t router_rows_ld(int64_t rows) { return (rows + 7) / 8 * 8; }

}  // namespace moeut
