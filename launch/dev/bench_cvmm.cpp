// moeut-bench-cvmm: TFLOP/s of the CUDA expert kernels at the 1B profile's shapes (the FFN experts:
// 565 experts, top-24, d 1536, expert size 128; the attention value and output experts: 6 heads x
// 12 experts, top-2 per head) beside the bf16 matrix-product peak measured by cuBLAS in the same
// run, and the FFN backward's products on two streams as the model runs them. Usage:
// moeut-bench-cvmm [TOKENS [REPS]] [--phases] [--stride-routing]; REPS 1 runs each product once
// with no warm-up (for a profiler); --phases adds, for each product on the scatter kernel, the
// clock cycles an item spends in each of its phases (kernels/cvmm_dev.h). Each token's
// experts are drawn at random, as a router with random weights picks them; --stride-routing takes
// them at a fixed stride instead (launch/dev/bench_routing.h).
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/rng.h"
#include "core/side_stream.h"
#include "kernels/cvmm_dev.h"
#include "launch/dev/bench_routing.h"
#include "core/dense_products.h"
#include "launch/dev/cuda_timing.h"

namespace {

using namespace moeut;
using bench::median_ms;
using bench::random_device;
using bf16 = __nv_bfloat16;

struct Product {
  const char* name;
  std::function<void()> run;
};

// Times each product (median of reps after warm-up) and prints its TFLOP/s; flop: per product.
void report(const std::vector<Product>& products, double flop, double peak, int reps) {
  double total_ms = 0;
  for (const Product& p : products) {
    const double ms = median_ms(p.run, reps, reps > 1 ? 3 : 0);
    total_ms += ms;
    std::printf("  %-40s %8.3f ms  %6.1f TFLOP/s  (%.1f%% of peak)\n", p.name, ms, flop / (ms * 1e-3) / 1e12,
                100.0 * flop / (ms * 1e-3) / 1e12 / peak);
  }
  std::printf("  all %zu: %.3f ms, %.1f TFLOP/s\n", products.size(), total_ms,
              double(products.size()) * flop / (total_ms * 1e-3) / 1e12);
}

// --phases: where a scatter's items spend their time, from one run with the scatter kernel's phase
// clock: cycles an item in each phase, over all blocks, and each phase's share of its warps' time.
// First the blocks' loops (the adding warps' cycles: they run to the block's last item) against
// the run's time: a slowest block far above the mean is imbalance, and with the blocks even the
// clock rate they imply is the SM clock's. Then the blocks' work, items and rows added: whether
// the slowest block is the one given the most; and the multiprocessors of the slowest blocks,
// which tell, run to run and product to product, whether the same SMs are the slow ones.
void report_phases(const char* name, const cuda::CvmmPlan& plan, const cuda::CvmmRowsArgs& a) {
  if (!cuda::cvmm_on_scatter_kernel(a)) return;
  constexpr int P = cuda::kScatterPhases;
  const cuda::ScatterPhaseClock clock = cuda::cvmm_scatter_phase_cycles(plan, a, 0);
  const std::vector<unsigned long long>& per_block = clock.cycles;
  const double blocks = double(per_block.size() / P);
  std::vector<double> total(P, 0.0);
  for (size_t i = 0; i < per_block.size(); ++i) total[i % P] += double(per_block[i]);
  const double items = total[cuda::kItems];
  const double mean_loop = std::max(1.0, (total[cuda::kWaitTileFull] + total[cuda::kAdditions]) / blocks);
  double most_items = 0, most_rows = 0;
  std::vector<std::pair<double, size_t>> by_loop;  // (loop / average, block's first slot), slowest first
  for (size_t b = 0; b < per_block.size(); b += P) {
    by_loop.emplace_back(double(per_block[b + cuda::kWaitTileFull] + per_block[b + cuda::kAdditions]) / mean_loop, b);
    most_items = std::max(most_items, double(per_block[b + cuda::kItems]));
    most_rows = std::max(most_rows, double(per_block[b + cuda::kRows]));
  }
  std::sort(by_loop.rbegin(), by_loop.rend());
  const double slowest_loop = by_loop.front().first * mean_loop;
  const size_t slowest = by_loop.front().second;
  std::printf("  %s: blocks' loops %.0f cycles on average, %.0f the slowest (%.3fx); run %.3f ms: %.0f MHz at the slowest\n",
              name, mean_loop, slowest_loop, by_loop.front().first, clock.ms, slowest_loop / (double(clock.ms) * 1e3));
  std::printf("    a block's items: %.1f on average, %.0f the most, %llu the slowest's; rows: %.0f, %.0f, %llu\n",
              items / blocks, most_items, per_block[slowest + cuda::kItems], total[cuda::kRows] / blocks, most_rows,
              per_block[slowest + cuda::kRows]);
  std::printf("    slowest SMs (loop / average):");
  for (size_t i = 0; i < std::min<size_t>(10, by_loop.size()); ++i)
    std::printf(" %llu (%.3f)", per_block[by_loop[i].second + cuda::kSm], by_loop[i].first);
  std::printf("\n");
  auto multiplying = [](int p) { return p < cuda::kWaitTileFull; };
  double role_total[2] = {};  // multiplying, adding
  for (int p = 0; p < cuda::kItems; ++p) role_total[multiplying(p) ? 0 : 1] += total[p];
  std::printf("  %s: %.0f items, %.1f a block; clock cycles an item by phase:\n", name, items, items / blocks);
  for (int p = 0; p < cuda::kItems; ++p)
    std::printf("    %-40s %8.0f  (%4.1f%% of its warps' time)\n", cuda::kScatterPhaseNames[p],
                items > 0 ? total[p] / items : 0.0, 100.0 * total[p] / std::max(1.0, role_total[multiplying(p) ? 0 : 1]));
}

// The FFN experts: 565 experts, top-24, d 1536, expert size 128.
void ffn_products(int64_t tokens, double peak, int reps, bool phases, bool random_routing, Rng& rng) {
  const int64_t E = bench::kFfnExperts, k = bench::kFfnTopK, d = 1536, es = 128, sels = tokens * k;
  const CvmmSelection up = bench::ffn_routing(tokens, random_routing ? &rng : nullptr);
  std::vector<float> w(static_cast<size_t>(sels));
  for (float& x : w) x = float(rng.uniform());
  CvmmSelection down = up;
  std::swap(down.in_row, down.out_row);
  const cuda::DeviceCvmmPlan pu(up), pd(down);
  auto X = random_device<bf16>(size_t(tokens * d), rng, 1.f), dY = random_device<bf16>(size_t(tokens * d), rng, 1.f);
  auto Wk = random_device<bf16>(size_t(E * d * es), rng, 0.05f), Wv = random_device<bf16>(size_t(E * es * d), rng, 0.05f);
  auto H = random_device<bf16>(size_t(sels * es), rng, 1.f), dH = random_device<bf16>(size_t(sels * es), rng, 1.f);
  cuda::DeviceBuffer<float> gw(w), Yf{size_t(tokens * d)}, dwf{size_t(sels)}, dWk{size_t(E * d * es)}, dWv{size_t(E * es * d)};
  cuda::DeviceBuffer<bf16> Hout{size_t(sels * es)};
  std::printf("FFN experts: %lld tokens, %lld experts, top-%lld (%.0f rows per expert)\n", (long long)tokens,
              (long long)E, (long long)k, double(sels) / double(E));
  const cuda::CvmmRowsArgs up_args{.X = X.get(), .W = Wk.get(), .weight = nullptr, .out = Hout.get(),
                                   .out_f32 = nullptr, .dweight = nullptr, .dot_rows = nullptr, .K = d, .N = es,
                                   .transpose_w = false, .accumulate = false};
  const cuda::CvmmRowsArgs down_args{.X = H.get(), .W = Wv.get(), .weight = gw.get(), .out = nullptr,
                                     .out_f32 = Yf.get(), .dweight = nullptr, .dot_rows = nullptr, .K = es, .N = d,
                                     .transpose_w = false, .accumulate = true, .out_rows = tokens};
  const cuda::CvmmRowsArgs down_dx_args{.X = dY.get(), .W = Wv.get(), .weight = gw.get(), .out = Hout.get(),
                                        .out_f32 = nullptr, .dweight = dwf.get(), .dot_rows = H.get(), .K = d, .N = es,
                                        .transpose_w = true, .accumulate = false};
  const cuda::CvmmWeightGradArgs down_dw_args{.A = H.get(), .B = dY.get(), .weight = gw.get(), .a_by_in_row = true,
                                              .dW = dWv.get(), .K = es, .N = d, .n_experts = E};
  const cuda::CvmmRowsArgs up_dx_args{.X = dH.get(), .W = Wk.get(), .weight = nullptr, .out = nullptr,
                                      .out_f32 = Yf.get(), .dweight = nullptr, .dot_rows = nullptr, .K = es, .N = d,
                                      .transpose_w = true, .accumulate = true, .out_rows = tokens};
  const cuda::CvmmWeightGradArgs up_dw_args{.A = X.get(), .B = dH.get(), .weight = nullptr, .a_by_in_row = true,
                                            .dW = dWk.get(), .K = d, .N = es, .n_experts = E};
  report({
      {"up      [m,1536]x[1536,128]  gather", [&] { cuda::cvmm_rows(pu.view(), up_args, 0); }},
      {"down    [m,128]x[128,1536]   w+scatter", [&] { cuda::cvmm_rows(pd.view(), down_args, 0); }},
      {"down dX [m,1536]x[1536,128]  +dw", [&] { cuda::cvmm_rows(pd.view(true), down_dx_args, 0); }},
      {"down dW [128,m]x[m,1536]", [&] { cuda::cvmm_weight_grad(pd.view(), down_dw_args, 0); }},
      {"up dX   [m,128]x[128,1536]   scatter", [&] { cuda::cvmm_rows(pu.view(true), up_dx_args, 0); }},
      {"up dW   [1536,m]x[m,128]", [&] { cuda::cvmm_weight_grad(pu.view(), up_dw_args, 0); }},
  }, 2.0 * double(sels) * double(d) * double(es), peak, reps);
  if (phases) {
    report_phases("down", pd.view(), down_args);
    report_phases("up dX", pu.view(true), up_dx_args);
  }
  // The weight gradients over two uses of the same weights (two layers sharing them, as GpuModel
  // runs them), each use with its own operands: against twice the single-use rows above.
  auto X2 = random_device<bf16>(size_t(tokens * d), rng, 1.f), dY2 = random_device<bf16>(size_t(tokens * d), rng, 1.f);
  auto H2 = random_device<bf16>(size_t(sels * es), rng, 1.f), dH2 = random_device<bf16>(size_t(sels * es), rng, 1.f);
  const cuda::CvmmWeightGradArgs down_dw2_args{.A = H2.get(), .B = dY2.get(), .weight = gw.get(), .a_by_in_row = true,
                                               .dW = dWv.get(), .K = es, .N = d, .n_experts = E};
  const cuda::CvmmWeightGradArgs up_dw2_args{.A = X2.get(), .B = dH2.get(), .weight = nullptr, .a_by_in_row = true,
                                             .dW = dWk.get(), .K = d, .N = es, .n_experts = E};
  std::printf("FFN weight gradients over two uses of the weights:\n");
  report({
      {"down dW, two uses", [&] { cuda::cvmm_weight_grad(pd.view(), down_dw_args, pd.view(), down_dw2_args, 0); }},
      {"up dW, two uses", [&] { cuda::cvmm_weight_grad(pu.view(), up_dw_args, pu.view(), up_dw2_args, 0); }},
  }, 4.0 * double(sels) * double(d) * double(es), peak, reps);
  // The FFN backward as GpuModel runs it (core/gpu_model.cu): each weight gradient (two uses) on a
  // side stream, forked just before the input gradient that shares its inputs, so the persistent
  // input-gradient kernels start on the SMs the weight gradients leave them. Against the sum of
  // the same products alone above: what the overlap saves, and whether a kernel's blocks are
  // dealt their work for SMs they do not all get at once.
  SideStream side(nullptr);
  std::printf("FFN backward, the weight gradients on a side stream beside the input gradients:\n");
  report({
      {"down dX, up dX beside dW two uses", [&] {
         side.fork();
         cuda::cvmm_weight_grad(pd.view(), down_dw_args, pd.view(), down_dw2_args, side.get());
         cuda::cvmm_rows(pd.view(true), down_dx_args, 0);
         side.fork();
         cuda::cvmm_weight_grad(pu.view(), up_dw_args, pu.view(), up_dw2_args, side.get());
         cuda::cvmm_rows(pu.view(true), up_dx_args, 0);
         side.join(); }},
  }, 12.0 * double(sels) * double(d) * double(es), peak, reps);
}

// The attention value and output experts: 6 heads with 12 experts each, top-2 per head, d 1536,
// head size 128; the calls of GpuModel (core/gpu_model.cu).
void attention_products(int64_t tokens, double peak, int reps, bool phases, bool random_routing, Rng& rng) {
  const int64_t H = 6, Ea = 12, ka = 2, d = 1536, dh = 128, sels = tokens * H * ka, E = H * Ea;
  CvmmSelection v;  // in: token row; out: (token, head) row
  v.resize(sels);
  std::vector<float> w(static_cast<size_t>(sels));
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < H; ++h) {
      int32_t drawn[ka];  // two distinct experts of the head's twelve
      if (random_routing) bench::random_distinct_experts(drawn, Ea, ka, rng);
      for (int64_t j = 0; j < ka; ++j) {
        const int64_t i = (t * H + h) * ka + j;
        v.expert[i] = int32_t(h * Ea + (random_routing ? drawn[j] : (t * 5 + h * 7 + j * 5) % Ea));
        v.in_row[i] = int32_t(t);
        v.out_row[i] = int32_t(t * H + h);
        w[i] = float(rng.uniform());
      }
    }
  v.group(E);
  CvmmSelection o = v;  // in: (token, head) row; out: token row
  for (int64_t i = 0; i < sels; ++i) o.in_row[i] = v.out_row[i], o.out_row[i] = v.in_row[i];
  const cuda::DeviceCvmmPlan pv(v), po(o);
  auto X = random_device<bf16>(size_t(tokens * d), rng, 1.f), dY = random_device<bf16>(size_t(tokens * d), rng, 1.f);
  auto heads = random_device<bf16>(size_t(tokens * H * dh), rng, 1.f), dv = random_device<bf16>(size_t(tokens * H * dh), rng, 1.f);
  auto Wv = random_device<bf16>(size_t(E * d * dh), rng, 0.05f), Wo = random_device<bf16>(size_t(E * dh * d), rng, 0.05f);
  cuda::DeviceBuffer<float> gw(w), Yf{size_t(tokens * d)}, heads_f{size_t(tokens * H * dh)}, dwf{size_t(sels)},
      dWv{size_t(E * d * dh)}, dWo{size_t(E * dh * d)};
  // The weight gradients' scratch, as the model gives it (CvmmWeightGradArgs::staging): their
  // rows time the staging kernel and the product of the staged operand together.
  cuda::DeviceBuffer<bf16> v_rows{size_t(sels * dh)}, values{size_t(tokens * H * dh)}, staging{size_t(sels * 128)};
  const cuda::DeviceBuffer<int32_t> v_index(v.expert);
  std::printf("attention experts: %lld tokens, %lld heads x %lld experts, top-%lld per head (%.0f rows per expert)\n",
              (long long)tokens, (long long)H, (long long)Ea, (long long)ka, double(sels) / double(E));
  const cuda::CvmmRowsArgs v_args{.X = X.get(), .W = Wv.get(), .weight = nullptr, .out = v_rows.get(),
                                  .out_f32 = nullptr, .dweight = nullptr, .dot_rows = nullptr, .K = d, .N = dh,
                                  .transpose_w = false, .accumulate = false};
  const cuda::CvmmRowsArgs o_args{.X = heads.get(), .W = Wo.get(), .weight = gw.get(), .out = nullptr,
                                  .out_f32 = Yf.get(), .dweight = nullptr, .dot_rows = nullptr, .K = dh, .N = d,
                                  .transpose_w = false, .accumulate = true, .out_rows = tokens};
  const cuda::CvmmWeightGradArgs o_dw_args{.A = heads.get(), .B = dY.get(), .weight = gw.get(), .a_by_in_row = true,
                                           .dW = dWo.get(), .K = dh, .N = d, .n_experts = E, .staging = staging.get()};
  const cuda::CvmmRowsArgs o_dx_args{.X = dY.get(), .W = Wo.get(), .weight = gw.get(), .out = nullptr,
                                     .out_f32 = heads_f.get(), .dweight = dwf.get(), .dot_rows = heads.get(), .K = d,
                                     .N = dh, .transpose_w = true, .accumulate = true, .out_rows = tokens * H};
  const cuda::CvmmWeightGradArgs v_dw_args{.A = X.get(), .B = dv.get(), .weight = gw.get(), .a_by_in_row = true,
                                           .dW = dWv.get(), .K = d, .N = dh, .n_experts = E, .staging = staging.get()};
  const cuda::CvmmRowsArgs v_dx_args{.X = dv.get(), .W = Wv.get(), .weight = gw.get(), .out = nullptr,
                                     .out_f32 = Yf.get(), .dweight = nullptr, .dot_rows = nullptr, .K = dh, .N = d,
                                     .transpose_w = true, .accumulate = true, .out_rows = tokens};
  report({
      {"v       [m,1536]x[1536,128]  gather+sums", [&] {
         cuda::cvmm_rows(cuda::at_selections(pv.view()), v_args, 0);
         cuda::cvmm_sum_selections(values.get(), v_rows.get(), gw.get(), v_index.get(), tokens * H, ka, dh, 0); }},
      {"o       [m,128]x[128,1536]   w+scatter", [&] { cuda::cvmm_rows(po.view(), o_args, 0); }},
      {"o dW    [128,m]x[m,1536]     staged", [&] { cuda::cvmm_weight_grad(po.view(), o_dw_args, 0); }},
      {"o dX    [m,1536]x[1536,128]  +dw", [&] { cuda::cvmm_rows(po.view(true), o_dx_args, 0); }},
      {"v dW    [1536,m]x[m,128]     staged", [&] { cuda::cvmm_weight_grad(pv.view(), v_dw_args, 0); }},
      {"v dX    [m,128]x[128,1536]   scatter+dots", [&] {
         cuda::cvmm_rows(pv.view(true), v_dx_args, 0);
         cuda::cvmm_selection_dots(dwf.get(), v_rows.get(), dv.get(), v_index.get(), sels, ka, dh, 0); }},
  }, 2.0 * double(sels) * double(d) * double(dh), peak, reps);
  if (phases) {
    report_phases("o", po.view(), o_args);
    report_phases("v dX", pv.view(true), v_dx_args);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  auto take_flag = [&](const char* name) {
    const auto flag = std::find(args.begin(), args.end(), name);
    if (flag == args.end()) return false;
    args.erase(flag);
    return true;
  };
  const bool phases = take_flag("--phases"), random_routing = !take_flag("--stride-routing");
  try {
    const int64_t tokens = args.size() > 0 ? std::stoll(args[0]) : 16384;
    const int reps = args.size() > 1 ? std::stoi(args[1]) : 20;
    const double peak = measure_bf16_peak_tflops();
    std::printf("bf16 peak (cuBLAS 8192^3): %.1f TFLOP/s\n", peak);
    Rng rng(1);
    std::printf("routing: each token's experts %s\n", random_routing ? "drawn at random" : "at a fixed stride");
    ffn_products(tokens, peak, reps, phases, random_routing, rng);
    attention_products(tokens, peak, reps, phases, random_routing, rng);
    MOEUT_CUDA_CHECK(cudaDeviceSynchronize());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moeut-bench-cvmm: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
