// CUDA kernels against their CPU references on random inputs at several sizes: LayerNorm,
// RoPE, sigmoid top-k routing, AdamW and the gradient norm. Outputs are poisoned first. Also the
// device buffers' error when the device is full.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "core/expert_load.h"
#include "gpu_test.h"
#include "kernels/adamw.h"
#include "kernels/adamw_cuda.h"
#include "kernels/attention.h"
#include "kernels/attention_cuda.h"
#include "kernels/cross_entropy_cuda.h"
#include "kernels/device_buffer.h"
#include "kernels/embedding.h"
#include "kernels/embedding_cuda.h"
#include "kernels/entropy_reg.h"
#include "kernels/entropy_reg_cuda.h"
#include "kernels/expert_load_cuda.h"
#include "kernels/grad_norm.h"
#include "kernels/layernorm.h"
#include "kernels/layernorm_cuda.h"
#include "kernels/lm_head_ce.h"
#include "kernels/lm_head_ce_cuda.h"
#include "kernels/rope.h"
#include "kernels/rope_cuda.h"
#include "kernels/routing.h"
#include "kernels/routing_cuda.h"

namespace moeut {
namespace {

using cuda::DeviceBuffer;
using namespace gpu_test;

TEST_F(GpuTest, AnAllocationPastTheDeviceSaysHowMuchItAsked) {
  size_t free_bytes = 0, total_bytes = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
  const size_t n = total_bytes / sizeof(float) * 2;  // twice the device's memory
  char asked[64];
  std::snprintf(asked, sizeof asked, "GPU out of memory: %.2f GiB asked, ", double(n * sizeof(float)) / double(1ull << 30));
  try {
    DeviceBuffer<float> too_big(n);
    FAIL() << "an allocation of twice the device's memory succeeded";
  } catch (const cuda::OutOfMemory& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind(asked, 0), 0u) << what;
    EXPECT_NE(what.find(" free of "), std::string::npos) << what;
  }
  // The failed allocation leaves the device usable.
  const DeviceBuffer<float> small(std::vector<float>{1.f, 2.f});
  EXPECT_EQ(small.download(), (std::vector<float>{1.f, 2.f}));
}

TEST_F(GpuTest, LayerNormMatchesTheCpuReference) {
  // d 82 and 602: the one-column path (rows not 16 bytes apart); the others take four columns at a
  // time. d 602 and 2312 have columns past those a lane keeps in registers (512 and 2048).
  for (auto [n, d] : {std::pair<int64_t, int64_t>{37, 64}, {50, 82}, {1000, 412}, {4096, 1536}, {40, 602}, {30, 2312}}) {
    SCOPED_TRACE("n " + std::to_string(n) + " d " + std::to_string(d));
    Rng rng{uint64_t(n + d)};
    const auto x = random_bf16_values(n * d, rng, 2.0), w = random_bf16_values(d, rng, 1.0),
               b = random_bf16_values(d, rng, 1.0), dout = random_bf16_values(n * d, rng, 1.0),
               dx0 = random_bf16_values(n * d, rng, 1.0);
    std::vector<float> out(n * d), mean(n), rstd(n), dx = dx0, dw(d, 0.5f), db(d, -0.5f);
    layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), n, d);
    layernorm_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(), mean.data(), rstd.data(), n, d);
    std::vector<float> xhat(n * d);
    for (int64_t i = 0; i < n * d; ++i) xhat[i] = (x[i] - mean[i / d]) * rstd[i / d];

    DeviceBuffer<float> gx(x), grstd(std::vector<float>(n, NAN)), gdout(dout), gdx(dx0),
        gdw(std::vector<float>(d, 0.5f)), gdb(std::vector<float>(d, -0.5f));
    DeviceBuffer<bf16> gw(to_bf16(w)), gb(to_bf16(b)), gout(std::vector<bf16>(n * d, __float2bfloat16(NAN))),
        gxb(gout.download()), gxhat(gout.download()), gdxb(gout.download()), gout_again(gout.download());
    cuda::layernorm_forward(gout.get(), grstd.get(), gx.get(), gw.get(), gb.get(), n, d, 0, gxb.get(), gxhat.get());
    cuda::layernorm_backward(gdx.get(), gdw.get(), gdb.get(), gdout.get(), gxhat.get(), gw.get(), grstd.get(), n, d, 0,
                             gdxb.get(), gb.get(), gout_again.get());
    // The copies: x exactly (its values are bf16), dx rounded from the fp32 result; the backward
    // pass's output bit for bit the forward's (the same expression on the same x̂).
    EXPECT_EQ(to_float(gout_again.download()), to_float(gout.download())) << "output again, from the backward pass";
    EXPECT_EQ(to_float(gxb.download()), x) << "bf16 copy of x";
    EXPECT_EQ(to_float(gdxb.download()), to_float(to_bf16(gdx.download()))) << "bf16 copy of dx";
    EXPECT_LE(rel_error(to_float(gxhat.download()), xhat), 4e-3) << "x̂ (bf16)";
    EXPECT_LE(rel_error(to_float(gout.download()), out), 1e-2) << "output (bf16)";
    EXPECT_LE(rel_error(grstd.download(), rstd), 1e-5) << "rstd";
    // x̂ in bf16: each of the weight gradient's terms is off by x̂'s rounding, hence its looser
    // bound than the input gradient's.
    EXPECT_LE(rel_error(gdx.download(), dx), 1e-3) << "input gradient";
    EXPECT_LE(rel_error(gdw.download(), dw), 5e-3) << "weight gradient";
    EXPECT_LE(rel_error(gdb.download(), db), 1e-4) << "bias gradient";
    // The output's gradient in bf16 (its values are bf16): the same results.
    DeviceBuffer<bf16> gdout_bf16(to_bf16(dout));
    DeviceBuffer<float> gdx2(dx0), gdw2(std::vector<float>(d, 0.5f)), gdb2(std::vector<float>(d, -0.5f));
    cuda::layernorm_backward(gdx2.get(), gdw2.get(), gdb2.get(), gdout_bf16.get(), gxhat.get(), gw.get(), grstd.get(),
                             n, d, 0);
    // dx row by row as before; the parameter gradients' blocks add in any order.
    EXPECT_EQ(gdx2.download(), gdx.download()) << "input gradient, bf16 output gradient";
    EXPECT_LE(rel_error(gdw2.download(), gdw.download()), 1e-6) << "weight gradient, bf16 output gradient";
    EXPECT_LE(rel_error(gdb2.download(), gdb.download()), 1e-6) << "bias gradient, bf16 output gradient";
  }
}

// Columns [c0, c0 + width) of the rows of a matrix whose rows are ld apart.
std::vector<float> columns(const std::vector<float>& m, int64_t ld, int64_t c0, int64_t width) {
  std::vector<float> out;
  for (size_t r = 0; r < m.size() / size_t(ld); ++r)
    out.insert(out.end(), m.begin() + int64_t(r) * ld + c0, m.begin() + int64_t(r) * ld + c0 + width);
  return out;
}

TEST_F(GpuTest, RopeMatchesTheCpuReference) {
  for (auto [T, dh] : {std::pair<int64_t, int64_t>{1024, 128}, {64, 82}}) {
    const int64_t B = 2, H = 3, n_rot = (dh / 2) - (dh / 2) % 2, n = B * T * H * dh;
    SCOPED_TRACE("T " + std::to_string(T) + " dh " + std::to_string(dh));
    Rng rng{uint64_t(T)};
    const auto x = random_bf16_values(n, rng, 1.0);
    std::vector<float> fwd = x, bwd = x;
    rope_forward(fwd.data(), B, T, H, dh, n_rot);
    rope_backward(bwd.data(), B, T, H, dh, n_rot);
    DeviceBuffer<bf16> g1(to_bf16(x)), g2(to_bf16(x));
    cuda::rope_forward(g1.get(), B, T, H, dh, n_rot, 0);
    cuda::rope_backward(g2.get(), B, T, H, dh, n_rot, 0);
    EXPECT_LE(rel_error(to_float(g1.download()), fwd), 1e-2) << "forward";
    EXPECT_LE(rel_error(to_float(g2.download()), bwd), 1e-2) << "backward";
    // Backward in place on token rows ld apart, beside other columns (poisoned: left alone).
    const int64_t hd = H * dh, ld = hd + 24;
    std::vector<float> wide(size_t(B * T * ld), NAN);
    for (int64_t r = 0; r < B * T; ++r) std::copy(x.begin() + r * hd, x.begin() + (r + 1) * hd, wide.begin() + r * ld + 8);
    DeviceBuffer<bf16> g3(to_bf16(wide));
    cuda::rope_backward(g3.get() + 8, B, T, H, dh, n_rot, 0, ld);
    const std::vector<float> got = to_float(g3.download());
    EXPECT_LE(rel_error(columns(got, ld, 8, hd), bwd), 1e-2) << "backward, rows ld apart";
    for (int64_t c : {int64_t(0), hd + 8})
      for (float v : columns(got, ld, c, 8)) EXPECT_TRUE(std::isnan(v)) << "columns beside the heads";
  }
}

TEST_F(GpuTest, SigmoidTopKMatchesTheCpuReference) {
  // coarse: logits on a grid of 0.5, so that many tie, at the k-th largest too, and some token
  // rows all equal or all zeros of both signs (which compare equal). k <= 4 takes the rounds
  // kernel, larger k the bit search (E 20: lanes without a live key). pad: the logits' token rows
  // are that many columns wider (a padded product's output), and the packed copy is checked; the
  // gradient's bf16 rows are as much wider, their padding left as it was. No regulariser here
  // (see the next test).
  struct Case { int64_t n, groups, E, k; bool coarse; int64_t pad; };
  for (const Case& c : {Case{4096, 1, 565, 24, false, 11}, Case{1000, 6, 12, 2, false, 0}, Case{300, 1, 40, 32, false, 0},
                        Case{500, 1, 1024, 32, false, 0}, Case{777, 1, 387, 16, true, 5}, Case{999, 6, 12, 2, true, 8},
                        Case{600, 2, 100, 8, true, 3}, Case{400, 1, 33, 5, false, 0}, Case{300, 2, 20, 6, true, 0}}) {
    SCOPED_TRACE("E " + std::to_string(c.E) + " k " + std::to_string(c.k) + (c.coarse ? " coarse" : "") + " pad " +
                 std::to_string(c.pad));
    Rng rng{uint64_t(c.E)};
    const int64_t cols = c.groups * c.E, ld = cols + c.pad;
    std::vector<float> z(c.n * cols);
    for (auto& v : z) v = c.coarse ? float(std::round(2 * rng.normal()) / 2) : float(rng.normal());
    for (int64_t i = 0; i < c.n; i += 7) z[i * cols + 1] = z[i * cols];  // ties
    for (int64_t i = 3; c.coarse && i < c.n; i += 11) std::fill(z.begin() + i * cols, z.begin() + (i + 1) * cols, 0.75f);
    for (int64_t i = 5; c.coarse && i < c.n; i += 11)
      for (int64_t j = 0; j < cols; ++j) z[i * cols + j] = j % 3 ? 0.f : -0.f;
    std::vector<float> padded(c.n * ld, NAN);
    for (int64_t t = 0; t < c.n; ++t) std::copy(z.begin() + t * cols, z.begin() + (t + 1) * cols, padded.begin() + t * ld);
    const int64_t sel = c.n * c.groups * c.k;
    std::vector<int32_t> idx(sel);
    std::vector<float> w(sel), dw(sel), dz(z.size(), 0.f);
    for (auto& v : dw) v = float(rng.normal());
    topk_sigmoid_forward(idx.data(), w.data(), z.data(), c.n, c.groups, c.E, c.k);
    topk_sigmoid_backward(dz.data(), dw.data(), idx.data(), w.data(), c.n, c.groups, c.E, c.k);
    DeviceBuffer<float> gz(padded), gpacked(std::vector<float>(z.size(), NAN)), gw(std::vector<float>(sel, NAN)), gdw(dw);
    DeviceBuffer<int32_t> gidx(std::vector<int32_t>(sel, -1));
    DeviceBuffer<bf16> gdz(to_bf16(std::vector<float>(c.n * ld, 7.f)));
    cuda::topk_sigmoid_forward(gidx.get(), gw.get(), gz.get(), c.n, c.groups, c.E, c.k, 0, ld, c.pad ? gpacked.get() : nullptr);
    cuda::topk_sigmoid_backward(gdz.get(), ld, {}, gdw.get(), gidx.get(), gw.get(), c.n, c.groups, c.E, c.k, 0);
    EXPECT_EQ(gidx.download(), idx) << "indices";
    EXPECT_LE(rel_error(gw.download(), w), 1e-6) << "weights";
    if (c.pad) {
      EXPECT_EQ(gpacked.download(), z) << "packed logits";
    }
    const std::vector<float> got = to_float(gdz.download());
    std::vector<float> rows, expected = to_float(to_bf16(dz));
    for (int64_t t = 0; t < c.n; ++t) {
      rows.insert(rows.end(), got.begin() + t * ld, got.begin() + t * ld + cols);
      for (int64_t j = cols; j < ld; ++j) ASSERT_EQ(got[t * ld + j], 7.f) << "padding of row " << t;
    }
    EXPECT_LE(rel_error(rows, expected), 4e-3) << "logit gradient (bf16)";
  }
}

TEST_F(GpuTest, ExpertLoadCountsMatchTheCpuReference) {
  // Two calls into one counter, as a layer's FFN router and its attention's value router (four
  // heads of 10) add theirs, then a take that must also reset the counters.
  struct Call { int64_t offset, n, groups, E, k; };
  const Call calls[] = {{0, 16384, 1, 565, 24}, {565, 5000, 4, 10, 2}};
  const int64_t size = 565 + 40;
  std::vector<double> expected(2 * size, 0.0);
  cuda::ExpertLoadCounter counter(size);
  std::vector<DeviceBuffer<int32_t>> indexes;
  std::vector<DeviceBuffer<float>> weights;
  Rng rng(17);
  for (const Call& c : calls) {
    std::vector<int32_t> index(size_t(c.n * c.groups * c.k));
    std::vector<float> weight(index.size());
    for (size_t s = 0; s < index.size(); ++s) {
      index[s] = int32_t(rng.next() % uint64_t(c.E));
      weight[s] = float(rng.uniform());
    }
    count_selections(expected.data() + c.offset, expected.data() + size + c.offset, index.data(), weight.data(), c.n,
                     c.groups, c.E, c.k);
    indexes.emplace_back(index);
    weights.emplace_back(weight);
    counter.count(c.offset, indexes.back().get(), weights.back().get(), c.n, c.groups, c.E, c.k, 0);
  }
  const std::vector<double> got = counter.take(0);
  ASSERT_EQ(got.size(), expected.size());
  for (int64_t e = 0; e < size; ++e) {
    ASSERT_EQ(got[e], expected[e]) << "count of expert " << e;
    EXPECT_NEAR(got[size + e], expected[size + e], 1e-5 * expected[size + e]) << "weight sum of expert " << e;
  }
  for (double v : counter.take(0)) ASSERT_EQ(v, 0.0) << "a take leaves the counters at zero";
}

TEST_F(GpuTest, AdamWAndGradientNormMatchTheCpuReference) {
  const int64_t n = 3'000'001;
  Rng rng(9);
  const auto p0 = random_bf16_values(n, rng, 1.0), g = random_bf16_values(n, rng, 0.1);
  std::vector<float> p = p0, m(n, 0.f), v(n, 0.f);
  const AdamWHyper h{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01};
  for (int64_t t = 1; t <= 3; ++t) ASSERT_TRUE(adamw_update(p.data(), g.data(), m.data(), v.data(), n, h, t, 0.5));
  DeviceBuffer<float> gp(p0), gg(g), gm(std::vector<float>(n, 0.f)), gv(std::vector<float>(n, 0.f));
  DeviceBuffer<bf16> gwork(std::vector<bf16>(n, __float2bfloat16(NAN)));
  DeviceBuffer<float> non_finite(std::vector<float>{0.f});
  for (int64_t t = 1; t <= 3; ++t)
    cuda::adamw_update(gp.get(), gwork.get(), gg.get(), gm.get(), gv.get(), n, h, t, 0.5, non_finite.get(), 0);
  EXPECT_EQ(non_finite.download()[0], 0.f) << "finite update flagged";
  EXPECT_LE(rel_error(gp.download(), p), 1e-6) << "master weights";
  EXPECT_LE(rel_error(gm.download(), m), 1e-6) << "first moment";
  EXPECT_LE(rel_error(gv.download(), v), 1e-6) << "second moment";
  EXPECT_LE(rel_error(to_float(gwork.download()), p), 1e-2) << "bf16 working copy";
  // A step larger than float holds overflows the parameters: the update's own pass flags it.
  const AdamWHyper huge{.lr = 1e39, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01};
  cuda::adamw_update(gp.get(), nullptr, gg.get(), gm.get(), gv.get(), n, huge, 4, 0.5, non_finite.get(), 0);
  EXPECT_EQ(non_finite.download()[0], 1.f) << "overflowed update not flagged";

  DeviceBuffer<double> sum(std::vector<double>{0.0});
  cuda::sum_of_squares(sum.get(), gg.get(), n, 0);
  const double expect = sum_of_squares(g.data(), n);
  EXPECT_NEAR(sum.download()[0], expect, 1e-5 * expect);
}

TEST_F(GpuTest, EntropyRegulariserOnTheRoutingKernelsMatchesTheCpuReference) {
  // Each use's top-k adds its softmax into the means, finish() makes the loss, and each use's top-k
  // backward makes the regulariser's gradient: with dweight zero that gradient alone (compared at
  // bf16's precision), then with the selections' terms added. T not a multiple of 8 leaves
  // partial blocks, T under 8 blocks of one sequence part dead; pad: logit rows wider, packed by
  // the top-k. The means are the second of two layers'.
  struct Case { int64_t B, T, groups, E, k, R; double coef; int64_t pad; };
  for (const Case& c : {Case{3, 50, 1, 565, 24, 4, 0.01, 3}, Case{2, 100, 6, 12, 2, 9, 0.001, 0},
                        Case{2, 37, 3, 8, 2, 2, 0.001, 5}, Case{1, 21, 4, 4, 3, 3, 0.001, 0},
                        Case{2, 64, 1, 387, 16, 2, 0.01, 0}, Case{3, 5, 2, 40, 5, 2, 0.01, 0}}) {
    SCOPED_TRACE("groups " + std::to_string(c.groups) + " E " + std::to_string(c.E) + " T " + std::to_string(c.T));
    Rng rng{uint64_t(c.E + c.T)};
    const int64_t n = c.B * c.T, cols = c.groups * c.E, ld = cols + c.pad, sel = n * c.groups * c.k;
    std::vector<std::vector<float>> z(size_t(c.R)), dz(size_t(c.R));
    std::vector<const float*> uses;
    std::vector<float*> duses;
    for (int64_t r = 0; r < c.R; ++r) {
      z[r] = random_bf16_values(n * cols, rng, 2.0);
      dz[r].assign(size_t(n * cols), 0.f);
      uses.push_back(z[r].data());
      duses.push_back(dz[r].data());
    }
    const double loss = entropy_reg_forward_backward<float>(duses, uses, c.B, c.T, c.groups, c.E, c.coef);
    cuda::EntropyReg reg(2, c.B, c.T, c.groups, c.E, c.R);
    reg.clear(0);
    std::vector<DeviceBuffer<float>> gz, gpacked, glse;
    std::vector<DeviceBuffer<int32_t>> gidx;
    std::vector<DeviceBuffer<float>> gw;
    for (int64_t r = 0; r < c.R; ++r) {
      std::vector<float> padded(size_t(n * ld), NAN);
      for (int64_t t = 0; t < n; ++t) std::copy(z[r].begin() + t * cols, z[r].begin() + (t + 1) * cols, padded.begin() + t * ld);
      gz.emplace_back(padded);
      gpacked.emplace_back(std::vector<float>(size_t(n * cols), NAN));
      gidx.emplace_back(std::vector<int32_t>(size_t(sel), -1));
      gw.emplace_back(std::vector<float>(size_t(sel), NAN));
      glse.emplace_back(std::vector<float>(size_t(n * c.groups), NAN));
      cuda::topk_sigmoid_forward(gidx[r].get(), gw[r].get(), gz[r].get(), n, c.groups, c.E, c.k, 0, ld,
                                 c.pad ? gpacked[r].get() : nullptr, reg.means(1, glse[r].get()));
    }
    DeviceBuffer<double> gloss(std::vector<double>{0.0});
    reg.finish(1, c.coef, gloss.get(), 0);
    EXPECT_NEAR(gloss.download()[0], loss, 1e-5 * std::abs(loss)) << "loss";
    for (const bool with_selections : {false, true}) {
      SCOPED_TRACE(with_selections ? "with the selections' terms" : "the regulariser's gradient alone");
      for (int64_t r = 0; r < c.R; ++r) {
        std::vector<int32_t> idx(sel);
        std::vector<float> w(sel), dw(sel, 0.f), expected = dz[r];
        if (with_selections)
          for (auto& v : dw) v = float(rng.normal());
        topk_sigmoid_forward(idx.data(), w.data(), z[r].data(), n, c.groups, c.E, c.k);
        topk_sigmoid_backward(expected.data(), dw.data(), idx.data(), w.data(), n, c.groups, c.E, c.k);
        ASSERT_EQ(gidx[r].download(), idx) << "indices of use " << r;
        const DeviceBuffer<float> gdw(dw);
        DeviceBuffer<bf16> gdz(to_bf16(std::vector<float>(size_t(n * ld), 7.f)));
        const float* logits = c.pad ? gpacked[r].get() : gz[r].get();
        cuda::topk_sigmoid_backward(gdz.get(), ld, reg.gradient(1, logits, glse[r].get()), gdw.get(), gidx[r].get(), gw[r].get(),
                                    n, c.groups, c.E, c.k, 0);
        const std::vector<float> got = to_float(gdz.download());
        std::vector<float> rows;
        for (int64_t t = 0; t < n; ++t) {
          rows.insert(rows.end(), got.begin() + t * ld, got.begin() + t * ld + cols);
          for (int64_t j = cols; j < ld; ++j) ASSERT_EQ(got[t * ld + j], 7.f) << "padding of row " << t;
        }
        EXPECT_LE(rel_error(rows, expected), 4e-3) << "logit gradient (bf16) of use " << r;
      }
    }
  }
}

TEST_F(GpuTest, EmbeddingMatchesTheCpuReference) {
  const int64_t V = 1000, d = 412, n = 4000;
  Rng rng{3};
  const auto table = random_bf16_values(V * d, rng, 1.0), dout = random_bf16_values(n * d, rng, 1.0);
  std::vector<int32_t> tokens(n);
  for (auto& t : tokens) t = int32_t(rng.next() % 50);  // many repeats
  std::vector<float> out(n * d), dtable(V * d, 0.25f);
  embedding_forward(out.data(), tokens.data(), table.data(), n, d);
  embedding_backward(dtable.data(), dout.data(), tokens.data(), n, d);
  DeviceBuffer<bf16> gtable(to_bf16(table));
  DeviceBuffer<int32_t> gtokens(tokens);
  DeviceBuffer<float> gout(std::vector<float>(n * d, NAN)), gdout(dout), gdtable(std::vector<float>(V * d, 0.25f));
  cuda::embedding_forward(gout.get(), gtokens.get(), gtable.get(), n, d, 0);
  cuda::embedding_backward(gdtable.get(), gdout.get(), gtokens.get(), n, d, 0);
  EXPECT_EQ(gout.download(), out);
  EXPECT_LE(rel_error(gdtable.download(), dtable), 1e-6);
}

TEST_F(GpuTest, CrossEntropyMatchesADoublePrecisionReference) {
  for (int64_t V : {37, 8000})
    for (bool with_bias : {false, true}) {
      SCOPED_TRACE("V " + std::to_string(V) + (with_bias ? ", bias" : ", no bias"));
      const int64_t m = 300;
      Rng rng{uint64_t(V)};
      const auto logits = random_bf16_values(m * V, rng, 3.0), bias = random_bf16_values(V, rng, 1.0);
      std::vector<int32_t> targets(m);
      for (auto& t : targets) t = int32_t(rng.next() % uint64_t(V));
      const float scale = 1.f / 4096.f;
      std::vector<float> loss(m), grad(m * V);
      for (int64_t r = 0; r < m; ++r) {
        auto z = [&](int64_t v) { return double(logits[r * V + v]) + (with_bias ? double(bias[v]) : 0.0); };
        double mx = -INFINITY, s = 0;
        for (int64_t v = 0; v < V; ++v) mx = std::max(mx, z(v));
        for (int64_t v = 0; v < V; ++v) s += std::exp(z(v) - mx);
        const double lse = mx + std::log(s);
        loss[r] = float(lse - z(targets[r]));
        for (int64_t v = 0; v < V; ++v) grad[r * V + v] = float(scale * (std::exp(z(v) - lse) - (v == targets[r])));
      }
      DeviceBuffer<float> glogits(logits), gloss(std::vector<float>(m, NAN));
      const DeviceBuffer<bf16> gbias(to_bf16(bias));
      DeviceBuffer<int32_t> gtargets(targets);
      DeviceBuffer<bf16> ggrad(std::vector<bf16>(m * V, __float2bfloat16(NAN)));
      cuda::cross_entropy(gloss.get(), ggrad.get(), glogits.get(), with_bias ? gbias.get() : nullptr, gtargets.get(), m, V,
                          scale, 0);
      EXPECT_LE(rel_error(gloss.download(), loss), 1e-5);
      EXPECT_LE(rel_error(to_float(ggrad.download()), grad), 1e-2);
    }
}

TEST_F(GpuTest, LmHeadCrossEntropyMatchesTheCpuReference) {
  const int64_t n = 700, d = 96, V = 8000;  // 700 rows cross the 256-row chunks given below
  Rng rng{11};
  const auto x = random_bf16_values(n * d, rng, 1.0), W = random_bf16_values(V * d, rng, 0.1),
             bias = random_bf16_values(V, rng, 0.1);
  std::vector<int32_t> targets(n);
  for (auto& t : targets) t = int32_t(rng.next() % uint64_t(V));
  const float scale = 1.f / float(n);
  std::vector<float> dx(n * d, 0.f), dW(V * d, 0.f), db(V, 0.f), scratch;
  std::vector<double> rows(n);
  lm_head_ce(dx.data(), dW.data(), db.data(), rows.data(), x.data(), W.data(), bias.data(), targets.data(), n, d, V, scale,
             scratch);
  cublasHandle_t cublas;
  ASSERT_EQ(cublasCreate(&cublas), CUBLAS_STATUS_SUCCESS);
  const DeviceBuffer<bf16> gx(to_bf16(x)), gW(to_bf16(W)), gb(to_bf16(bias));
  const DeviceBuffer<int32_t> gt(targets);
  DeviceBuffer<float> gloss(std::vector<float>(n, NAN)), gdx(std::vector<float>(n * d, NAN)),
      gdW(std::vector<float>(V * d, 0.f)), gdb(std::vector<float>(V, 0.f));
  cuda::LmHeadCE head(cublas, V, d, 256);
  head.run(gloss.get(), gdx.get(), gdW.get(), gdb.get(), gx.get(), gW.get(), gb.get(), gt.get(), n, scale, 0);
  EXPECT_LE(rel_error(gloss.download(), std::vector<float>(rows.begin(), rows.end())), 1e-4) << "row losses";
  EXPECT_LE(rel_error(gdx.download(), dx), 1e-2) << "input gradient";
  EXPECT_LE(rel_error(gdW.download(), dW), 1e-2) << "weight gradient";
  EXPECT_LE(rel_error(gdb.download(), db), 1e-2) << "bias gradient";
  cublasDestroy(cublas);
}

TEST_F(GpuTest, CausalAttentionMatchesTheCpuReference) {
  cublasHandle_t cublas;
  ASSERT_EQ(cublasCreate(&cublas), CUBLAS_STATUS_SUCCESS);
  struct Case { int64_t B, T, H, dh; };
  // Head sizes of every profile (the flash kernels pad them to 32, 96 or 128), sequence lengths
  // on and off their 128-row blocks and 64-row tiles (320: two and a half blocks, five tiles),
  // and one head size above 128 (the cuBLAS path). 128, 120 and 112 (with an odd T) take the
  // wgmma kernels, their rows by tensor copies (120 and 112 below 128 columns); 100, its rows not
  // 16 bytes apart, the mma.sync kernels.
  for (const Case& c : {Case{2, 1024, 2, 128}, Case{3, 100, 4, 82}, Case{2, 130, 3, 96}, Case{4, 64, 2, 32},
                        Case{2, 320, 2, 64}, Case{1, 70, 2, 136}, Case{2, 200, 3, 120}, Case{1, 150, 2, 100},
                        Case{2, 77, 2, 112}}) {
    SCOPED_TRACE("T " + std::to_string(c.T) + " dh " + std::to_string(c.dh));
    Rng rng{uint64_t(c.T + c.dh)};
    const int64_t n = c.B * c.T * c.H * c.dh;
    const auto q = random_bf16_values(n, rng, 0.3), k = random_bf16_values(n, rng, 0.3),
               v = random_bf16_values(n, rng, 1.0), dout = random_bf16_values(n, rng, 1.0);
    std::vector<float> out(n), probs(c.B * c.H * c.T * c.T), dq(n), dk(n), dv(n);
    attention_forward(out.data(), probs.data(), q.data(), k.data(), v.data(), c.B, c.T, c.H, c.dh);
    attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), probs.data(), q.data(), k.data(), v.data(), c.B,
                       c.T, c.H, c.dh);
    const DeviceBuffer<bf16> gq(to_bf16(q)), gk(to_bf16(k)), gv(to_bf16(v));
    const DeviceBuffer<float> gdout(dout);  // fp32, as the model accumulates it (values bf16 already)
    const std::vector<bf16> poison(n, __float2bfloat16(NAN));
    DeviceBuffer<bf16> gout(poison), gdq(poison), gdk(poison), gdv(poison);
    cuda::CausalAttention att(cublas, c.B, c.T, c.H, c.dh);
    DeviceBuffer<float> lse(size_t(c.B * c.H * c.T));
    att.forward(gout.get(), lse.get(), gq.get(), gk.get(), gv.get(), 0);
    att.backward(gdq.get(), gdk.get(), gdv.get(), gdout.get(), gout.get(), lse.get(), gq.get(), gk.get(), gv.get(), 0);
    EXPECT_LE(rel_error(to_float(gout.download()), out), 1e-2) << "output";
    EXPECT_LE(rel_error(to_float(gdq.download()), dq), 1e-2) << "dq";
    EXPECT_LE(rel_error(to_float(gdk.download()), dk), 1e-2) << "dk";
    EXPECT_LE(rel_error(to_float(gdv.download()), dv), 1e-2) << "dv";
    // dq and dk side by side in one matrix, scaled, beside columns that stay poisoned.
    const int64_t hd = c.H * c.dh, ld = 2 * hd + 8;
    DeviceBuffer<bf16> gdqk(std::vector<bf16>(size_t(c.B * c.T * ld), __float2bfloat16(NAN)));
    att.backward(gdqk.get(), gdqk.get() + hd, gdv.get(), gdout.get(), gout.get(), lse.get(), gq.get(), gk.get(), gv.get(),
                 0, ld, 0.5f);
    const std::vector<float> dqk = to_float(gdqk.download());
    std::vector<float> half_dq = dq, half_dk = dk;
    for (auto* g : {&half_dq, &half_dk})
      for (float& v : *g) v *= 0.5f;
    EXPECT_LE(rel_error(columns(dqk, ld, 0, hd), half_dq), 1e-2) << "dq, scaled, rows ld apart";
    EXPECT_LE(rel_error(columns(dqk, ld, hd, hd), half_dk), 1e-2) << "dk, scaled, rows ld apart";
    for (float v : columns(dqk, ld, 2 * hd, 8)) EXPECT_TRUE(std::isnan(v)) << "columns past dq and dk";
    // q and k read side by side from one matrix, rows qk_ld apart (as one product writes them),
    // beside poisoned columns that must not be read.
    const int64_t qk_ld = 2 * hd + 8;
    std::vector<float> qk(size_t(c.B * c.T * qk_ld), NAN);
    for (int64_t r = 0; r < c.B * c.T; ++r) {
      std::copy(q.begin() + r * hd, q.begin() + (r + 1) * hd, qk.begin() + r * qk_ld);
      std::copy(k.begin() + r * hd, k.begin() + (r + 1) * hd, qk.begin() + r * qk_ld + hd);
    }
    const DeviceBuffer<bf16> gqk(to_bf16(qk));
    DeviceBuffer<bf16> gout2(poison), gdq2(poison), gdk2(poison);
    att.forward(gout2.get(), lse.get(), gqk.get(), gqk.get() + hd, gv.get(), 0, qk_ld);
    att.backward(gdq2.get(), gdk2.get(), gdv.get(), gdout.get(), gout2.get(), lse.get(), gqk.get(), gqk.get() + hd,
                 gv.get(), 0, 0, 1.f, qk_ld);
    EXPECT_LE(rel_error(to_float(gout2.download()), out), 1e-2) << "output, q and k rows qk_ld apart";
    EXPECT_LE(rel_error(to_float(gdq2.download()), dq), 1e-2) << "dq, q and k rows qk_ld apart";
    EXPECT_LE(rel_error(to_float(gdk2.download()), dk), 1e-2) << "dk, q and k rows qk_ld apart";
  }
  cublasDestroy(cublas);
}

}  // namespace
}  // namespace moeut
