// The CUDA cvmm kernels against the CPU reference (kernels/cvmm.cpp) on random inputs: the four
// expert products of a σ-MoE layer, forward and backward, at several shapes, including widths
// that are not multiples of 8, skewed routing and experts that receive nothing; the FFN's ReLU
// options; the scatter product with a routing-weight gradient; weight gradients over two uses of
// the same expert weights, added or written (a gradient's first contribution); rows kept per
// selection, with their weighted sums and dots (the attention value experts). bf16 operands are
// rounded once on the host and the reference computes on the same rounded values.
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "core/rng.h"
#include "gpu_test.h"
#include "kernels/cvmm.h"
#include "kernels/cvmm_cuda.h"
#include "kernels/cvmm_dev.h"

namespace moeut {
namespace {

using cuda::DeviceBuffer;
using namespace gpu_test;

struct Shape {
  int64_t tokens, experts, k, d, es;
  bool skewed;      // every token picks among the first quarter of the experts
  bool misaligned;  // expert weights start 8 bytes past a 16-byte boundary, as they may inside
                    // the parameter buffer
  // The up product's outputs (hidden rows) at the selections' positions in expert order, as the
  // model stores them, so the weight gradients take them by tensor copies; else at the
  // selections' own rows, gathered.
  bool by_position = false;
  // Tokens a chunk of the plan's tile list covers: fewer than the tokens make the scatters run
  // the chunks one after the other (CvmmPlan::chunk_first_tile).
  int64_t tokens_per_chunk = cuda::kCvmmChunkTokens;
};

// A device copy of v whose first element sits `pad` elements into the allocation.
std::pair<DeviceBuffer<bf16>, const bf16*> placed(const std::vector<float>& v, size_t pad) {
  std::vector<float> padded(pad, 0.f);
  padded.insert(padded.end(), v.begin(), v.end());
  DeviceBuffer<bf16> buf(to_bf16(padded));
  const bf16* p = buf.get() + pad;
  return {std::move(buf), p};
}

// n tokens' selections of k experts each, drawn by `draw` and drawn again while one repeats an
// expert of its token, as a top-k picks them (the device planner relies on it). -1 (an expert of
// another rank) may repeat.
template <class Draw>
std::vector<int32_t> distinct_per_token(int64_t n, int64_t k, Draw draw) {
  std::vector<int32_t> index(size_t(n * k));
  for (size_t i = 0; i < index.size(); ++i) {
    const auto token_begin = index.begin() + int64_t(i) / k * k, here = index.begin() + int64_t(i);
    do index[i] = draw();
    while (index[i] >= 0 && std::find(token_begin, here, index[i]) != here);
  }
  return index;
}

// A random routing of s: the up product's selections (k distinct experts per token, rows by
// token in, by selection or by position out), the down product's (in and out swapped) and the
// routing weights.
struct Routing {
  CvmmSelection up, down;
  std::vector<float> w;
};
Routing random_routing(const Shape& s, Rng& rng) {
  const int64_t n = s.tokens, k = s.k, E = s.experts, sels = n * k;
  const int64_t pool = s.skewed ? std::max<int64_t>(k, E / 4) : E;
  Routing r;
  CvmmSelection& up = r.up;
  up.resize(sels);
  up.expert = distinct_per_token(n, k, [&] { return int32_t(rng.next() % uint64_t(pool)); });
  r.w.resize(size_t(sels));
  for (int64_t i = 0; i < sels; ++i) {
    up.in_row[i] = int32_t(i / k);
    up.out_row[i] = int32_t(i);
    r.w[i] = float(rng.uniform());
  }
  up.group(E);
  if (s.by_position)
    for (int64_t i = 0; i < sels; ++i) up.out_row[size_t(i)] = up.position[size_t(i)];
  r.down = up;
  std::swap(r.down.in_row, r.down.out_row);
  return r;
}

void check(const Shape& s) {
  SCOPED_TRACE("tokens " + std::to_string(s.tokens) + " experts " + std::to_string(s.experts) + " k " +
               std::to_string(s.k) + " d " + std::to_string(s.d) + " es " + std::to_string(s.es) +
               (s.skewed ? " skewed" : "") + (s.misaligned ? " misaligned" : "") + (s.by_position ? " by position" : "") +
               " tokens per chunk " + std::to_string(s.tokens_per_chunk));
  Rng rng{uint64_t(s.tokens * 131 + s.d)};
  const int64_t n = s.tokens, k = s.k, d = s.d, es = s.es, E = s.experts, sels = n * k;
  const Routing routing = random_routing(s, rng);
  const CvmmSelection &up = routing.up, &down = routing.down;
  const std::vector<float>& w = routing.w;
  const cuda::DeviceCvmmPlan plan_up(up, s.tokens_per_chunk), plan_down(down, s.tokens_per_chunk);

  const auto X = random_bf16_values(n * d, rng, 1.0), Wk = random_bf16_values(E * d * es, rng, 0.05);
  const auto Wv = random_bf16_values(E * es * d, rng, 0.05), H = random_bf16_values(sels * es, rng, 1.0);
  const auto dY = random_bf16_values(n * d, rng, 1.0), dH = random_bf16_values(sels * es, rng, 1.0);
  const DeviceBuffer<bf16> gX(to_bf16(X)), gH(to_bf16(H)), gdY(to_bf16(dY)), gdH(to_bf16(dH));
  const auto [keys_buffer, keys] = placed(Wk, s.misaligned ? 4 : 0);
  const auto [values_buffer, values] = placed(Wv, s.misaligned ? 4 : 0);
  const DeviceBuffer<float> gw(w);
  const DeviceBuffer<int32_t> gindex(up.expert);  // [n, k]: every selection computed here
  CvmmWorkspace<float> ws;

  {  // up: H = X[t] · keys_e, one row per selection (stored, poisoned first)
    std::vector<float> ref(sels * es, 0.f);
    cvmm_forward(ref.data(), X.data(), Wk.data(), static_cast<const float*>(nullptr), up, d, es, ws);
    DeviceBuffer<bf16> out(std::vector<bf16>(sels * es, __float2bfloat16(NAN)));
    cuda::cvmm_rows(plan_up.view(),
                    {.X = gX.get(), .W = keys, .weight = nullptr, .out = out.get(), .out_f32 = nullptr,
                     .dweight = nullptr, .dot_rows = nullptr, .K = d, .N = es, .transpose_w = false,
                     .accumulate = false},
                    0);
    EXPECT_LE(rel_error(to_float(out.download()), ref), 1e-2) << "up forward";
  }
  {  // down: Y[t] += Σ w · H[s] · values_e (scatter-added onto a non-zero output)
    const auto init = random_bf16_values(n * d, rng, 1.0);
    std::vector<float> ref = init;
    cvmm_forward(ref.data(), H.data(), Wv.data(), w.data(), down, es, d, ws);
    DeviceBuffer<float> out(init);
    cuda::cvmm_rows(plan_down.view(),
                    {.X = gH.get(), .W = values, .weight = gw.get(), .out = nullptr, .out_f32 = out.get(),
                     .dweight = nullptr, .dot_rows = nullptr, .K = es, .N = d, .transpose_w = false, .accumulate = true,
                     .out_rows = n},
                    0);
    EXPECT_LE(rel_error(out.download(), ref), 1e-3) << "down forward";
  }
  {  // down backward: dH = w · dY[t] · values_eᵀ, dw = (dY[t] · values_eᵀ) · H[s], dValues
    std::vector<float> dH_ref(sels * es, 0.f), dWv_ref(E * es * d), dw_ref(sels);
    const auto dWv_init = random_bf16_values(E * es * d, rng, 1.0);
    dWv_ref = dWv_init;
    cvmm_backward(dH_ref.data(), dWv_ref.data(), dw_ref.data(), dY.data(), H.data(), Wv.data(), w.data(), down, es, d, ws);
    DeviceBuffer<bf16> gdHout(std::vector<bf16>(sels * es, __float2bfloat16(NAN)));
    DeviceBuffer<float> gdw(std::vector<float>(sels, 0.f)), gdWv(dWv_init);
    cuda::cvmm_rows(plan_down.view(true),
                    {.X = gdY.get(), .W = values, .weight = gw.get(), .out = gdHout.get(), .out_f32 = nullptr,
                     .dweight = gdw.get(), .dot_rows = gH.get(), .K = d, .N = es, .transpose_w = true,
                     .accumulate = false},
                    0);
    cuda::cvmm_weight_grad(plan_down.view(),
                           {.A = gH.get(), .B = gdY.get(), .weight = gw.get(), .a_by_in_row = true, .dW = gdWv.get(),
                            .K = es, .N = d, .n_experts = E},
                           0);
    EXPECT_LE(rel_error(to_float(gdHout.download()), dH_ref), 1e-2) << "down: input gradient";
    EXPECT_LE(rel_error(gdw.download(), dw_ref), 1e-3) << "down: routing-weight gradient";
    EXPECT_LE(rel_error(gdWv.download(), dWv_ref), 1e-2) << "down: expert-weight gradient";
    // Its selection rows weighted and laid out by position first (staging, poisoned): the kernel
    // then copies them by tensor copies and weights nothing, for the same operands in shared
    // memory, so the same bits.
    DeviceBuffer<bf16> staging(std::vector<bf16>(sels * es, __float2bfloat16(NAN)));
    DeviceBuffer<float> gdWv_staged(dWv_init);
    cuda::cvmm_weight_grad(plan_down.view(),
                           {.A = gH.get(), .B = gdY.get(), .weight = gw.get(), .a_by_in_row = true,
                            .dW = gdWv_staged.get(), .K = es, .N = d, .n_experts = E, .staging = staging.get()},
                           0);
    EXPECT_EQ(gdWv_staged.download(), gdWv.download()) << "down: expert-weight gradient, its rows staged";
  }
  {  // The FFN's ReLU: up stores max(0, ·); the down input gradient is masked where those hidden
     // units are 0, and its routing-weight gradient dots with them (the GPU's own hidden units
     // feed both, so their zeros are the same).
    using Relu = cuda::CvmmRowsArgs::Relu;
    std::vector<float> relu_ref(sels * es, 0.f);
    cvmm_forward(relu_ref.data(), X.data(), Wk.data(), static_cast<const float*>(nullptr), up, d, es, ws);
    for (float& v : relu_ref) v = std::max(v, 0.f);
    DeviceBuffer<bf16> gHr(std::vector<bf16>(sels * es, __float2bfloat16(NAN)));
    cuda::cvmm_rows(plan_up.view(),
                    {.X = gX.get(), .W = keys, .weight = nullptr, .out = gHr.get(), .out_f32 = nullptr,
                     .dweight = nullptr, .dot_rows = nullptr, .K = d, .N = es, .transpose_w = false,
                     .accumulate = false, .relu = Relu::kApply},
                    0);
    const std::vector<float> Hr = to_float(gHr.download());
    EXPECT_LE(rel_error(Hr, relu_ref), 1e-2) << "up forward, ReLU applied";
    std::vector<float> dH_ref(sels * es, 0.f), dWv_ref(E * es * d, 0.f), dw_ref(sels);
    cvmm_backward(dH_ref.data(), dWv_ref.data(), dw_ref.data(), dY.data(), Hr.data(), Wv.data(), w.data(), down, es, d, ws);
    for (size_t i = 0; i < dH_ref.size(); ++i)
      if (!(Hr[i] > 0.f)) dH_ref[i] = 0.f;
    DeviceBuffer<bf16> gdHout(std::vector<bf16>(sels * es, __float2bfloat16(NAN)));
    DeviceBuffer<float> gdw(std::vector<float>(sels, 0.f));
    cuda::cvmm_rows(plan_down.view(true),
                    {.X = gdY.get(), .W = values, .weight = gw.get(), .out = gdHout.get(), .out_f32 = nullptr,
                     .dweight = gdw.get(), .dot_rows = gHr.get(), .K = d, .N = es, .transpose_w = true,
                     .accumulate = false, .relu = Relu::kMaskByDotRows},
                    0);
    EXPECT_LE(rel_error(to_float(gdHout.download()), dH_ref), 1e-2) << "down: input gradient masked by the ReLU";
    EXPECT_LE(rel_error(gdw.download(), dw_ref), 1e-3) << "down: routing-weight gradient on the ReLU's output";
  }
  {  // Gathered, weighted and added into fp32 rows (the attention's value product and output
     // input gradient have this shape, their rows being added into twice): Y[s] += w · X[t] ·
     // keys_e, and dH[s] += w · dY[t] · values_eᵀ with its routing-weight gradient, onto non-zero
     // outputs.
    const auto y_init = random_bf16_values(sels * es, rng, 1.0);
    std::vector<float> y_ref = y_init;
    cvmm_forward(y_ref.data(), X.data(), Wk.data(), w.data(), up, d, es, ws);
    DeviceBuffer<float> gy(y_init);
    cuda::cvmm_rows(plan_up.view(),
                    {.X = gX.get(), .W = keys, .weight = gw.get(), .out = nullptr, .out_f32 = gy.get(),
                     .dweight = nullptr, .dot_rows = nullptr, .K = d, .N = es, .transpose_w = false, .accumulate = true,
                     .out_rows = sels},
                    0);
    EXPECT_LE(rel_error(gy.download(), y_ref), 1e-3) << "up, weighted, added into fp32 rows";
    std::vector<float> dH_ref = y_init, dWv_ref(E * es * d, 0.f), dw_ref(sels);
    cvmm_backward(dH_ref.data(), dWv_ref.data(), dw_ref.data(), dY.data(), H.data(), Wv.data(), w.data(), down, es, d, ws);
    DeviceBuffer<float> gdH(y_init), gdw(std::vector<float>(sels, 0.f));
    cuda::cvmm_rows(plan_down.view(true),
                    {.X = gdY.get(), .W = values, .weight = gw.get(), .out = nullptr, .out_f32 = gdH.get(),
                     .dweight = gdw.get(), .dot_rows = gH.get(), .K = d, .N = es, .transpose_w = true,
                     .accumulate = true, .out_rows = sels},
                    0);
    EXPECT_LE(rel_error(gdH.download(), dH_ref), 1e-3) << "down: input gradient added into fp32 rows";
    EXPECT_LE(rel_error(gdw.download(), dw_ref), 1e-3) << "down: routing-weight gradient, rows added into";
  }
  {  // Each selection's unweighted row kept (the attention's value experts): rows[i] = X[t] · keys_e
     // at the selection's own row, then their weighted fp32 sums per token in bf16, and the dots
     // of each row with its token's row of D (the routing-weight gradient).
    std::vector<float> rows_ref(sels * es, 0.f);
    CvmmSelection own = up;  // out: the selection itself
    for (int64_t i = 0; i < sels; ++i) own.out_row[size_t(i)] = int32_t(i);
    cvmm_forward(rows_ref.data(), X.data(), Wk.data(), static_cast<const float*>(nullptr), own, d, es, ws);
    DeviceBuffer<bf16> rows(std::vector<bf16>(sels * es, __float2bfloat16(NAN)));
    cuda::cvmm_rows(cuda::at_selections(plan_up.view()),
                    {.X = gX.get(), .W = keys, .weight = nullptr, .out = rows.get(), .out_f32 = nullptr,
                     .dweight = nullptr, .dot_rows = nullptr, .K = d, .N = es, .transpose_w = false,
                     .accumulate = false},
                    0);
    const std::vector<float> got_rows = to_float(rows.download());
    EXPECT_LE(rel_error(got_rows, rows_ref), 1e-2) << "rows at their selections";
    std::vector<float> sum_ref(n * es, 0.f), dw_ref(sels);
    const auto D = random_bf16_values(n * es, rng, 1.0);
    for (int64_t i = 0; i < sels; ++i)
      for (int64_t c = 0; c < es; ++c) {
        sum_ref[(i / k) * es + c] += w[i] * got_rows[i * es + c];
        dw_ref[i] += D[(i / k) * es + c] * got_rows[i * es + c];
      }
    DeviceBuffer<bf16> sum(std::vector<bf16>(n * es, __float2bfloat16(NAN)));
    cuda::cvmm_sum_selections(sum.get(), rows.get(), gw.get(), gindex.get(), n, k, es, 0);
    EXPECT_LE(rel_error(to_float(sum.download()), sum_ref), 1e-2) << "weighted sums of the rows";
    const DeviceBuffer<bf16> gD(to_bf16(D));
    DeviceBuffer<float> dots(std::vector<float>(sels, NAN));
    cuda::cvmm_selection_dots(dots.get(), rows.get(), gD.get(), gindex.get(), sels, k, es, 0);
    EXPECT_LE(rel_error(dots.download(), dw_ref), 1e-4) << "dots of the rows";
  }
  {  // up backward: dX[t] += Σ dH[s] · keys_eᵀ, dKeys
    const auto dX_init = random_bf16_values(n * d, rng, 1.0), dWk_init = random_bf16_values(E * d * es, rng, 1.0);
    std::vector<float> dX_ref = dX_init, dWk_ref = dWk_init;
    cvmm_backward(dX_ref.data(), dWk_ref.data(), static_cast<float*>(nullptr), dH.data(), X.data(), Wk.data(),
                  static_cast<const float*>(nullptr), up, d, es, ws);
    DeviceBuffer<float> gdX(dX_init), gdWk(dWk_init);
    cuda::cvmm_rows(plan_up.view(true),
                    {.X = gdH.get(), .W = keys, .weight = nullptr, .out = nullptr, .out_f32 = gdX.get(),
                     .dweight = nullptr, .dot_rows = nullptr, .K = es, .N = d, .transpose_w = true, .accumulate = true,
                     .out_rows = n},
                    0);
    cuda::cvmm_weight_grad(plan_up.view(),
                           {.A = gX.get(), .B = gdH.get(), .weight = nullptr, .a_by_in_row = true, .dW = gdWk.get(),
                            .K = d, .N = es, .n_experts = E},
                           0);
    EXPECT_LE(rel_error(gdX.download(), dX_ref), 1e-3) << "up: input gradient";
    EXPECT_LE(rel_error(gdWk.download(), dWk_ref), 1e-3) << "up: expert-weight gradient";
  }
  {  // Two uses of the same expert weights in one product (two layers sharing them): dValues and
     // dKeys over both routings.
    const Routing other = random_routing(s, rng);
    const cuda::DeviceCvmmPlan other_up(other.up), other_down(other.down);
    const auto X2 = random_bf16_values(n * d, rng, 1.0), H2 = random_bf16_values(sels * es, rng, 1.0);
    const auto dY2 = random_bf16_values(n * d, rng, 1.0), dH2 = random_bf16_values(sels * es, rng, 1.0);
    const DeviceBuffer<bf16> gX2(to_bf16(X2)), gH2(to_bf16(H2)), gdY2(to_bf16(dY2)), gdH2(to_bf16(dH2));
    const DeviceBuffer<float> gw2(other.w);
    // The sums over both uses, from zero: added onto non-zero gradients, and written (overwrite,
    // a gradient's first contribution) over poisoned ones, which also sets the experts without
    // selections (the skewed shapes have them) to 0.
    std::vector<float> dWv_sum(E * es * d, 0.f), dWk_sum(E * d * es, 0.f), scratch(std::max(n * d, sels * es)),
        dw_scratch(sels);
    cvmm_backward(scratch.data(), dWv_sum.data(), dw_scratch.data(), dY.data(), H.data(), Wv.data(), w.data(), down, es, d,
                  ws);
    cvmm_backward(scratch.data(), dWv_sum.data(), dw_scratch.data(), dY2.data(), H2.data(), Wv.data(), other.w.data(),
                  other.down, es, d, ws);
    cvmm_backward(scratch.data(), dWk_sum.data(), static_cast<float*>(nullptr), dH.data(), X.data(), Wk.data(),
                  static_cast<const float*>(nullptr), up, d, es, ws);
    cvmm_backward(scratch.data(), dWk_sum.data(), static_cast<float*>(nullptr), dH2.data(), X2.data(), Wk.data(),
                  static_cast<const float*>(nullptr), other.up, d, es, ws);
    for (const bool overwrite : {false, true}) {
      SCOPED_TRACE(overwrite ? "written" : "added");
      const auto dWv_init = overwrite ? std::vector<float>(E * es * d, NAN) : random_bf16_values(E * es * d, rng, 1.0);
      const auto dWk_init = overwrite ? std::vector<float>(E * d * es, NAN) : random_bf16_values(E * d * es, rng, 1.0);
      std::vector<float> dWv_ref = dWv_sum, dWk_ref = dWk_sum;
      if (!overwrite) {
        for (size_t i = 0; i < dWv_ref.size(); ++i) dWv_ref[i] += dWv_init[i];
        for (size_t i = 0; i < dWk_ref.size(); ++i) dWk_ref[i] += dWk_init[i];
      }
      DeviceBuffer<float> gdWv(dWv_init), gdWk(dWk_init);
      cuda::cvmm_weight_grad(plan_down.view(),
                             {.A = gH.get(), .B = gdY.get(), .weight = gw.get(), .a_by_in_row = true, .dW = gdWv.get(),
                              .K = es, .N = d, .n_experts = E, .overwrite = overwrite},
                             other_down.view(),
                             {.A = gH2.get(), .B = gdY2.get(), .weight = gw2.get(), .a_by_in_row = true,
                              .dW = gdWv.get(), .K = es, .N = d, .n_experts = E, .overwrite = overwrite},
                             0);
      cuda::cvmm_weight_grad(plan_up.view(),
                             {.A = gX.get(), .B = gdH.get(), .weight = nullptr, .a_by_in_row = true, .dW = gdWk.get(),
                              .K = d, .N = es, .n_experts = E, .overwrite = overwrite},
                             other_up.view(),
                             {.A = gX2.get(), .B = gdH2.get(), .weight = nullptr, .a_by_in_row = true,
                              .dW = gdWk.get(), .K = d, .N = es, .n_experts = E, .overwrite = overwrite},
                             0);
      EXPECT_LE(rel_error(gdWv.download(), dWv_ref), 1e-2) << "down: expert-weight gradient over two uses";
      EXPECT_LE(rel_error(gdWk.download(), dWk_ref), 1e-3) << "up: expert-weight gradient over two uses";
    }
  }
  // The same, weighted, with the routing-weight gradient (the attention value experts' shape):
  // dX[t] += Σ w · dH[s] · keys_eᵀ, dw = (dH[s] · keys_eᵀ) · X[t]. Told its output has 2^30 rows,
  // more than L2 holds, the scatter adds into it one band at a time instead of two.
  for (const int64_t out_rows : {n, int64_t(1) << 30}) {
    SCOPED_TRACE("out_rows " + std::to_string(out_rows));
    const auto dX_init = random_bf16_values(n * d, rng, 1.0);
    std::vector<float> dX_ref = dX_init, dWk_ref(E * d * es, 0.f), dw_ref(sels);
    cvmm_backward(dX_ref.data(), dWk_ref.data(), dw_ref.data(), dH.data(), X.data(), Wk.data(), w.data(), up, d, es, ws);
    DeviceBuffer<float> gdX(dX_init), gdw(std::vector<float>(sels, 0.f));
    cuda::cvmm_rows(plan_up.view(true),
                    {.X = gdH.get(), .W = keys, .weight = gw.get(), .out = nullptr, .out_f32 = gdX.get(),
                     .dweight = gdw.get(), .dot_rows = gX.get(), .K = es, .N = d, .transpose_w = true,
                     .accumulate = true, .out_rows = out_rows},
                    0);
    EXPECT_LE(rel_error(gdX.download(), dX_ref), 1e-3) << "up, weighted: input gradient";
    EXPECT_LE(rel_error(gdw.download(), dw_ref), 1e-3) << "up, weighted: routing-weight gradient";
  }
  MOEUT_CUDA_CHECK(cudaDeviceSynchronize());
  // The gathers take tile pairs and the scatters tail tiles from the plans' counters, which each
  // launch must leave zeroed for the next (the products above run several on each plan).
  for (const cuda::DeviceCvmmPlan* plan : {&plan_up, &plan_down})
    for (const uint32_t c : plan->tail_counters.download()) EXPECT_EQ(c, 0u) << "tail counters left for the next launch";
}

TEST_F(GpuTest, CvmmMatchesTheCpuReference) {
  for (const Shape& s : {Shape{300, 12, 3, 64, 32, false, false}, Shape{517, 40, 4, 412, 128, true, false, true},  // 44M d
                         Shape{200, 24, 2, 82, 96, false, false},                                                    // 44M dh
                         Shape{333, 20, 4, 320, 64, false, false, true},  // three column tiles, the last partial
                         Shape{300, 12, 3, 64, 32, false, true}, Shape{2048, 565, 24, 1536, 128, false, false, true},
                         Shape{1024, 565, 24, 1536, 128, true, false},
                         Shape{300, 16, 4, 256, 192, false, false, true},  // scatters deeper than 128: the general kernel
                         Shape{2048, 565, 24, 1536, 128, false, false, true, 600},  // 4 chunks of the tokens
                         Shape{1024, 565, 24, 1536, 128, true, false, false, 300}})
    check(s);
}

// The scatter kernel's phase clock (moeut-bench-cvmm --phases): the product is the same with it,
// every phase is clocked, and the items it counts are the plan's row tiles times the output's
// bands (one band at a time: told its output has more rows than L2 holds), each once: its blocks
// share their last tiles through the plan's counters, which each launch leaves zeroed.
TEST_F(GpuTest, ScatterPhaseClockCountsEveryItem) {
  const Shape s{1024, 565, 24, 1536, 128, false, false};
  Rng rng(11);
  const Routing routing = random_routing(s, rng);
  const int64_t n = s.tokens, d = s.d, es = s.es, E = s.experts, sels = n * s.k, bands = (d + 127) / 128;
  const auto dH = random_bf16_values(sels * es, rng, 1.0), Wk = random_bf16_values(E * d * es, rng, 0.05);
  const DeviceBuffer<bf16> gdH(to_bf16(dH)), gWk(to_bf16(Wk));
  const cuda::DeviceCvmmPlan plan(routing.up);
  std::vector<int64_t> rows_of(size_t(E), 0);
  for (const int32_t e : routing.up.expert) ++rows_of[size_t(e)];
  int64_t tiles = 0;
  for (const int64_t rows : rows_of) tiles += (rows + cuda::kCvmmTileRows - 1) / cuda::kCvmmTileRows;

  DeviceBuffer<float> plain_dx(std::vector<float>(size_t(n * d), 0.f)), clocked_dx(std::vector<float>(size_t(n * d), 0.f));
  cuda::CvmmRowsArgs a{.X = gdH.get(), .W = gWk.get(), .weight = nullptr, .out = nullptr, .out_f32 = plain_dx.get(),
                       .dweight = nullptr, .dot_rows = nullptr, .K = es, .N = d, .transpose_w = true,
                       .accumulate = true, .out_rows = int64_t(1) << 30};
  ASSERT_TRUE(cuda::cvmm_on_scatter_kernel(a));
  cuda::cvmm_rows(plan.view(true), a, 0);
  constexpr int P = cuda::kScatterPhases;
  a.out_f32 = clocked_dx.get();
  const std::vector<unsigned long long> got = cuda::cvmm_scatter_phase_cycles(plan.view(true), a, 0).cycles;
  EXPECT_LE(rel_error(clocked_dx.download(), plain_dx.download()), 1e-5) << "the product with the clock";
  const int blocks = int(got.size() / P);
  std::vector<unsigned long long> total(P, 0);
  for (size_t i = 0; i < got.size(); ++i) total[i % P] += got[i];
  EXPECT_EQ(int64_t(total[cuda::kItems]), tiles * bands) << "items counted";
  EXPECT_EQ(int64_t(total[cuda::kRows]), sels * bands) << "rows counted";
  for (int p = 0; p < cuda::kItems; ++p) {
    if (p == cuda::kDweight) continue;  // no routing-weight gradient here: next to no cycles
    EXPECT_GT(total[p], 0u) << cuda::kScatterPhaseNames[p];
  }
  for (int b = 0; b < blocks; ++b) {
    unsigned long long multiplying = 0;
    for (int p = 0; p < cuda::kWaitTileFull; ++p) multiplying += got[size_t(b) * P + p];
    EXPECT_EQ(multiplying > 0, got[size_t(b) * P + cuda::kItems] > 0) << "block " << b << ": clocked where it has items";
  }
  // A block per multiprocessor, all resident at once: each names a different one.
  std::vector<unsigned long long> sms;
  for (int b = 0; b < blocks; ++b) sms.push_back(got[size_t(b) * P + cuda::kSm]);
  std::sort(sms.begin(), sms.end());
  EXPECT_EQ(std::unique(sms.begin(), sms.end()), sms.end()) << "multiprocessors named twice";
  for (const uint32_t c : plan.tail_counters.download()) EXPECT_EQ(c, 0u) << "tail counters left for the next launch";
}

// The routing-weight gradient's dots at 44M's d_head (82, rows not 16-byte multiples) and at
// 128, with selections left out (index -1, dot 0).
TEST_F(GpuTest, SelectionDotsMatchAtEveryRowWidth) {
  Rng rng{21};
  for (const int64_t N : {int64_t(82), int64_t(128)}) {
    SCOPED_TRACE("N " + std::to_string(N));
    const int64_t dot_rows = 37, per_row = 3, sels = dot_rows * per_row;
    const auto rows = random_bf16_values(size_t(sels * N), rng, 1.0), D = random_bf16_values(size_t(dot_rows * N), rng, 1.0);
    std::vector<int32_t> index(static_cast<size_t>(sels));
    std::vector<float> ref(size_t(sels), 0.f);
    for (int64_t i = 0; i < sels; ++i) {
      index[size_t(i)] = i % 5 == 0 ? -1 : int32_t(i % 7);
      if (index[size_t(i)] >= 0)
        for (int64_t c = 0; c < N; ++c) ref[size_t(i)] += D[size_t((i / per_row) * N + c)] * rows[size_t(i * N + c)];
    }
    const DeviceBuffer<bf16> grows(to_bf16(rows)), gD(to_bf16(D));
    const DeviceBuffer<int32_t> gindex(index);
    DeviceBuffer<float> dots(std::vector<float>(size_t(sels), NAN));
    cuda::cvmm_selection_dots(dots.get(), grows.get(), gD.get(), gindex.get(), sels, per_row, N, 0);
    EXPECT_LE(rel_error(dots.download(), ref), 1e-4);
  }
}

// Expert parallelism hands the planner selections whose expert lives on another rank (index
// -1): the device-built plan must leave exactly those out, and compute the rest as the reference.
// The FFN's hidden rows are written at the selections' positions in expert order, so the live
// ones fill the first rows and the rest of the buffer is left as it was. The weight gradient that
// takes those rows by tensor copies must not let the rows past them in.
TEST_F(GpuTest, DevicePlanLeavesOutSelectionsOfOtherRanks) {
  const int64_t n = 700, k = 6, E = 40, d = 128, es = 64, sels = n * k;
  Rng rng{11};
  const std::vector<int32_t> index =
      distinct_per_token(n, k, [&] { return rng.next() % 3 == 0 ? -1 : int32_t(rng.next() % uint64_t(E)); });
  CvmmSelection mine;
  std::vector<int64_t> live_index;  // the q-th live selection's index
  for (int64_t i = 0; i < sels; ++i) {
    if (index[i] < 0) continue;
    mine.expert.push_back(index[i]);
    mine.in_row.push_back(int32_t(i / k));
    live_index.push_back(i);
  }
  const int64_t live = mine.size();
  mine.out_row.assign(size_t(live), 0);
  mine.group(E);
  // The device plan sorts (expert, selection) stably and puts other ranks' selections last, so a
  // live selection's position there is its position here.
  for (int64_t q = 0; q < live; ++q) mine.out_row[size_t(q)] = mine.position[size_t(q)];
  const auto X = random_bf16_values(n * d, rng, 1.0), W = random_bf16_values(E * d * es, rng, 0.05);
  std::vector<float> ref(size_t(live * es), 0.f);
  CvmmWorkspace<float> ws;
  cvmm_forward(ref.data(), X.data(), W.data(), static_cast<const float*>(nullptr), mine, d, es, ws);

  cuda::CvmmPlanner planner(sels, E, n);
  cuda::CvmmPlanBuffers plan = planner.make_buffers();
  const DeviceBuffer<int32_t> gindex(index);
  planner.build(plan, gindex.get(), n, 1, E, k, cuda::CvmmRoute::kGatherToPositions, 0);
  // By expert as a stable sort puts them, then the other ranks' selections in index order.
  std::vector<int32_t> by_expert_ref;
  for (int64_t q = 0; q < live; ++q) by_expert_ref.push_back(int32_t(live_index[size_t(mine.by_expert[size_t(q)])]));
  for (int64_t i = 0; i < sels; ++i)
    if (index[i] < 0) by_expert_ref.push_back(int32_t(i));
  EXPECT_EQ(plan.by_expert.download(), by_expert_ref);
  const DeviceBuffer<bf16> gX(to_bf16(X)), gW(to_bf16(W));
  DeviceBuffer<bf16> hidden(std::vector<bf16>(size_t(sels * es), __float2bfloat16(NAN)));
  cuda::cvmm_rows(plan.view(),
                  {.X = gX.get(), .W = gW.get(), .weight = nullptr, .out = hidden.get(), .out_f32 = nullptr,
                   .dweight = nullptr, .dot_rows = nullptr, .K = d, .N = es, .transpose_w = false, .accumulate = false},
                  0);
  const std::vector<float> got = to_float(hidden.download());
  const std::vector<float> got_live(got.begin(), got.begin() + live * es);
  const int64_t untouched = std::count_if(got.begin() + live * es, got.end(), [](float v) { return std::isnan(v); });
  EXPECT_EQ(untouched, (sels - live) * es) << "rows past the live positions were written";
  EXPECT_LE(rel_error(got_live, ref), 1e-2);

  // dW_e = Σ hidden[position]ᵀ · dY[token]: hidden by tensor copies, NaN past the live rows.
  CvmmSelection back = mine;
  std::swap(back.in_row, back.out_row);
  const auto dY = random_bf16_values(n * d, rng, 1.0), Wv = random_bf16_values(E * es * d, rng, 0.05);
  std::vector<float> dH(size_t(live * es), 0.f), dW_ref(size_t(E * es * d), 0.f);
  cvmm_backward(dH.data(), dW_ref.data(), static_cast<float*>(nullptr), dY.data(), got_live.data(), Wv.data(),
                static_cast<const float*>(nullptr), back, es, d, ws);
  const DeviceBuffer<bf16> gdY(to_bf16(dY));
  DeviceBuffer<float> gdW(std::vector<float>(size_t(E * es * d), 0.f));
  cuda::cvmm_weight_grad(plan.view(true),
                         {.A = hidden.get(), .B = gdY.get(), .weight = nullptr, .a_by_in_row = true, .dW = gdW.get(),
                          .K = es, .N = d, .n_experts = E},
                         0);
  EXPECT_LE(rel_error(gdW.download(), dW_ref), 1e-2) << "weight gradient over hidden rows by position";

  // Rows kept at their selections: other ranks' selections are never written (NaN here); the sums
  // leave them out and their dots are 0.
  DeviceBuffer<bf16> rows(std::vector<bf16>(size_t(sels * es), __float2bfloat16(NAN)));
  cuda::cvmm_rows(cuda::at_selections(plan.view()),
                  {.X = gX.get(), .W = gW.get(), .weight = nullptr, .out = rows.get(), .out_f32 = nullptr,
                   .dweight = nullptr, .dot_rows = nullptr, .K = d, .N = es, .transpose_w = false, .accumulate = false},
                  0);
  std::vector<float> w(static_cast<size_t>(sels)), sum_ref(size_t(n * es), 0.f), dw_ref(size_t(sels), 0.f);
  for (float& v : w) v = float(rng.uniform());
  const auto D = random_bf16_values(n * es, rng, 1.0);
  for (int64_t q = 0; q < live; ++q) {
    const int64_t i = live_index[size_t(q)], p = mine.position[size_t(q)];
    for (int64_t c = 0; c < es; ++c) {
      sum_ref[(i / k) * es + c] += w[i] * got[p * es + c];
      dw_ref[i] += D[(i / k) * es + c] * got[p * es + c];
    }
  }
  const DeviceBuffer<float> gw(w);
  const DeviceBuffer<bf16> gD(to_bf16(D));
  DeviceBuffer<bf16> sum(std::vector<bf16>(size_t(n * es), __float2bfloat16(NAN)));
  DeviceBuffer<float> dots(std::vector<float>(size_t(sels), NAN));
  cuda::cvmm_sum_selections(sum.get(), rows.get(), gw.get(), gindex.get(), n, k, es, 0);
  cuda::cvmm_selection_dots(dots.get(), rows.get(), gD.get(), gindex.get(), sels, k, es, 0);
  EXPECT_LE(rel_error(to_float(sum.download()), sum_ref), 1e-2) << "sums of rows at selections, other ranks' left out";
  EXPECT_LE(rel_error(dots.download(), dw_ref), 1e-4) << "dots of rows at selections, other ranks' 0";
}

// The device planner lists the same tiles and tile pairs, in the same order and chunks, as the
// host plan that the tests and moeut-bench-cvmm use, so the benchmark measures the training's
// schedule; and places the selections as the host plan's stable grouping does.
// Skewed routing gives one expert many pairs and leaves others empty; more experts than the
// planner's block scans at once. Routing groups (attention heads) with few experts each, and
// token counts that leave the planner's last chunk of 32 tokens partial.
TEST_F(GpuTest, DevicePlanListsTheHostPlansTiles) {
  struct Case {
    int64_t n, groups, E, k, tokens_per_chunk;
    bool skewed;
  };
  for (const Case& c : {Case{3000, 1, 300, 4, 1000, true}, Case{1001, 6, 12, 2, 400, false}}) {
    SCOPED_TRACE("tokens " + std::to_string(c.n) + " groups " + std::to_string(c.groups));
    const int64_t sels = c.n * c.groups * c.k, experts = c.groups * c.E;
    Rng rng{uint64_t(12 + c.groups)};
    // Each (token, group) row picks k distinct experts of its group.
    const std::vector<int32_t> index = distinct_per_token(c.n * c.groups, c.k, [&] {
      return c.skewed && rng.next() % 3 == 0 ? 7 : int32_t(rng.next() % uint64_t(c.E / 2) * 2);
    });
    CvmmSelection sel;
    for (int64_t i = 0; i < sels; ++i) {
      sel.expert.push_back(int32_t(i / c.k % c.groups * c.E + index[i]));
      sel.in_row.push_back(int32_t(i / c.k / c.groups));
      sel.out_row.push_back(0);
    }
    sel.group(experts);
    for (int64_t q = 0; q < sels; ++q) sel.out_row[size_t(q)] = sel.position[size_t(q)];
    const cuda::DeviceCvmmPlan host(sel, c.tokens_per_chunk);
    cuda::CvmmPlanner planner(sels, experts, c.n, c.tokens_per_chunk);
    cuda::CvmmPlanBuffers device = planner.make_buffers();
    const DeviceBuffer<int32_t> gindex(index);
    planner.build(device, gindex.get(), c.n, c.groups, c.E, c.k, cuda::CvmmRoute::kGatherToPositions, 0);
    const int32_t tiles = host.live_tiles.download()[0], pairs = host.live_pairs.download()[0];
    if (c.skewed) {
      ASSERT_GT(sel.expert_begin[8] - sel.expert_begin[7], int64_t(8 * cuda::kCvmmTileRows));
    }
    EXPECT_EQ(device.live_tiles.download()[0], tiles);
    EXPECT_EQ(device.live_pairs.download()[0], pairs);
    EXPECT_EQ(device.expert_begin.download(), host.expert_begin.download());
    auto first = [](const DeviceBuffer<int32_t>& b, int64_t count) {
      std::vector<int32_t> all = b.download();
      return std::vector<int32_t>(all.begin(), all.begin() + count);
    };
    EXPECT_EQ(first(device.tile_expert, tiles), first(host.tile_expert, tiles));
    EXPECT_EQ(first(device.tile_first, tiles), first(host.tile_first, tiles));
    EXPECT_EQ(first(device.pair_tile, pairs), first(host.pair_tile, pairs));
    ASSERT_EQ(host.chunks, 3);
    EXPECT_EQ(device.chunks, host.chunks);
    EXPECT_EQ(first(device.chunk_first_tile, host.chunks + 1), host.chunk_first_tile.download());
    EXPECT_EQ(first(device.by_expert, sels), sel.by_expert);
    EXPECT_EQ(first(device.in_row, sels), first(host.in_row, sels));
    EXPECT_EQ(first(device.out_row, sels), first(host.out_row, sels));
  }
}

}  // namespace
}  // namespace moeut
