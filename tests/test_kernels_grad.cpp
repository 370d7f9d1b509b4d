// Every CPU kernel's backward against central finite differences of its forward, in double.
// Each check uses loss = sum(probe * output) with a random probe, so dout = probe.
#include <gtest/gtest.h>

#include <numeric>

#include "gradcheck.h"
#include "kernels/attention.h"
#include "kernels/cvmm.h"
#include "kernels/embedding.h"
#include "kernels/entropy_reg.h"
#include "kernels/gemm.h"
#include "kernels/layernorm.h"
#include "kernels/lm_head_ce.h"
#include "kernels/relu.h"
#include "kernels/rope.h"
#include "kernels/routing.h"

namespace moeut {
namespace {

using test::gradient_error;
using test::kGradTolerance;
using test::random_vector;
using Vec = std::vector<double>;

TEST(Gemm, AllTransposesMatchNaiveProduct) {
  const int64_t M = 37, N = 300, K = 150;  // crosses the kernel's tile edges
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const Vec A = random_vector(M * K, 1), B = random_vector(K * N, 2);
      Vec C = random_vector(M * N, 3), expect = C;
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) {
          double s = 0;
          for (int64_t k = 0; k < K; ++k) s += (ta ? A[k * M + i] : A[i * K + k]) * (tb ? B[j * K + k] : B[k * N + j]);
          expect[i * N + j] = 0.5 * s + 2.0 * expect[i * N + j];
        }
      gemm(ta, tb, M, N, K, 0.5, A.data(), ta ? M : K, B.data(), tb ? K : N, 2.0, C.data(), N);
      for (int64_t i = 0; i < M * N; ++i) ASSERT_NEAR(C[i], expect[i], 1e-10) << ta << tb << " at " << i;
    }
}

TEST(KernelGradient, Embedding) {
  const int64_t V = 7, d = 5, n = 9;
  std::vector<int32_t> tokens = {0, 3, 3, 6, 1, 3, 0, 2, 5};
  Vec table = random_vector(V * d, 1), probe = random_vector(n * d, 2), out(n * d);
  auto loss = [&] { embedding_forward(out.data(), tokens.data(), table.data(), n, d); return test::dot(out, probe); };
  Vec dtable(V * d, 0.0);
  embedding_backward(dtable.data(), probe.data(), tokens.data(), n, d);
  EXPECT_LE(gradient_error(loss, table.data(), dtable.data(), V * d), kGradTolerance);
}

TEST(KernelGradient, LayerNorm) {
  const int64_t n = 6, d = 10;
  Vec x = random_vector(n * d, 1, 2.0), w = random_vector(d, 2), b = random_vector(d, 3), probe = random_vector(n * d, 4);
  Vec out(n * d), mean(n), rstd(n);
  auto loss = [&] {
    layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), n, d);
    return test::dot(out, probe);
  };
  loss();
  Vec dx(n * d, 0.0), dw(d, 0.0), db(d, 0.0);
  layernorm_backward(dx.data(), dw.data(), db.data(), probe.data(), x.data(), w.data(), mean.data(), rstd.data(), n, d);
  EXPECT_LE(gradient_error(loss, x.data(), dx.data(), n * d), kGradTolerance);
  EXPECT_LE(gradient_error(loss, w.data(), dw.data(), d), kGradTolerance);
  EXPECT_LE(gradient_error(loss, b.data(), db.data(), d), kGradTolerance);
}

TEST(KernelGradient, RopeOnHalfOfEachHead) {
  const int64_t B = 2, T = 5, H = 2, dh = 10, n_rot = 4;
  Vec x = random_vector(B * T * H * dh, 1), probe = random_vector(B * T * H * dh, 2);
  auto loss = [&] { Vec y = x; rope_forward(y.data(), B, T, H, dh, n_rot); return test::dot(y, probe); };
  Vec dx = probe;
  rope_backward(dx.data(), B, T, H, dh, n_rot);
  EXPECT_LE(gradient_error(loss, x.data(), dx.data(), int64_t(x.size())), kGradTolerance);
}

TEST(Rope, RotatesFirstDimsAsRotateHalfAndLeavesTheRest) {
  // One head of 8 dims, 4 rotated: frequencies 10000^(-2i/4) for i = 0, 1.
  const int64_t T = 3, dh = 8, n_rot = 4;
  Vec x = random_vector(T * dh, 5), y = x;
  rope_forward(y.data(), 1, T, 1, dh, n_rot);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < 2; ++i) {
      const double a = t * std::pow(10000.0, -2.0 * i / 4.0);
      const double lo = x[t * dh + i], hi = x[t * dh + i + 2];
      EXPECT_NEAR(y[t * dh + i], lo * std::cos(a) - hi * std::sin(a), 1e-12);
      EXPECT_NEAR(y[t * dh + i + 2], hi * std::cos(a) + lo * std::sin(a), 1e-12);
    }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = n_rot; c < dh; ++c) EXPECT_EQ(y[t * dh + c], x[t * dh + c]);
}

TEST(KernelGradient, CausalAttention) {
  const int64_t B = 2, T = 6, H = 2, dh = 3, n = B * T * H * dh;
  Vec q = random_vector(n, 1), k = random_vector(n, 2), v = random_vector(n, 3), probe = random_vector(n, 4);
  Vec out(n), probs(B * H * T * T);
  auto loss = [&] {
    attention_forward(out.data(), probs.data(), q.data(), k.data(), v.data(), B, T, H, dh);
    return test::dot(out, probe);
  };
  loss();
  Vec dq(n), dk(n), dv(n);
  attention_backward(dq.data(), dk.data(), dv.data(), probe.data(), probs.data(), q.data(), k.data(), v.data(), B, T, H, dh);
  EXPECT_LE(gradient_error(loss, q.data(), dq.data(), n), kGradTolerance);
  EXPECT_LE(gradient_error(loss, k.data(), dk.data(), n), kGradTolerance);
  EXPECT_LE(gradient_error(loss, v.data(), dv.data(), n), kGradTolerance);
  // Causality: the first token attends only to itself.
  for (int64_t c = 0; c < dh; ++c) EXPECT_DOUBLE_EQ(out[c], v[c]);
}

TEST(Routing, PicksTheKLargestPerGroupInDescendingOrder) {
  const Vec logits = {0.1, 2.0, -1.0, 2.0, 0.5,   /* group 1 */ 3.0, -2.0, 0.0, 1.0, 4.0};
  std::vector<int32_t> index(4);
  Vec weight(4);
  topk_sigmoid_forward(index.data(), weight.data(), logits.data(), 1, 2, 5, 2);
  EXPECT_EQ(index, (std::vector<int32_t>{1, 3, 4, 0}));  // tie 2.0/2.0 goes to the lower index first
  EXPECT_NEAR(weight[2], 1 / (1 + std::exp(-4.0)), 1e-15);
}

TEST(KernelGradient, SigmoidTopKWeights) {
  const int64_t n = 5, groups = 2, E = 6, k = 3;
  Vec logits = random_vector(n * groups * E, 1), probe = random_vector(n * groups * k, 2), w(n * groups * k);
  std::vector<int32_t> index(n * groups * k);
  auto loss = [&] { topk_sigmoid_forward(index.data(), w.data(), logits.data(), n, groups, E, k); return test::dot(w, probe); };
  loss();
  Vec dlogits(logits.size(), 0.0);
  topk_sigmoid_backward(dlogits.data(), probe.data(), index.data(), w.data(), n, groups, E, k);
  EXPECT_LE(gradient_error(loss, logits.data(), dlogits.data(), int64_t(logits.size())), kGradTolerance);
}

// cvmm in the two patterns the model uses: one input row read by several selections (up
// projection, no weights) and several selections summed into one output row (down projection,
// routing weights). Expert 3 receives nothing and must get a zero gradient.
void check_cvmm(bool weighted) {
  const int64_t tokens = 6, k = 2, E = 4, K = 5, N = 3, n = tokens * k;
  CvmmSelection sel;
  sel.resize(n);
  const int32_t experts[n] = {0, 2, 1, 0, 2, 1, 0, 1, 2, 0, 1, 2};
  for (int64_t i = 0; i < n; ++i) {
    sel.expert[i] = experts[i];
    sel.in_row[i] = int32_t(weighted ? i : i / k);
    sel.out_row[i] = int32_t(weighted ? i / k : i);
  }
  sel.group(E);
  const int64_t x_rows = weighted ? n : tokens, y_rows = weighted ? tokens : n;
  Vec X = random_vector(x_rows * K, 1), W = random_vector(E * K * N, 2), weight = random_vector(n, 3);
  Vec probe = random_vector(y_rows * N, 4), Y(y_rows * N);
  CvmmWorkspace<double> ws;
  const double* wptr = weighted ? weight.data() : nullptr;
  auto loss = [&] {
    std::fill(Y.begin(), Y.end(), 0.0);
    cvmm_forward(Y.data(), X.data(), W.data(), weighted ? weight.data() : nullptr, sel, K, N, ws);
    return test::dot(Y, probe);
  };
  Vec dX(X.size(), 0.0), dW(W.size(), 0.0), dweight(n, 0.0);
  cvmm_backward(dX.data(), dW.data(), weighted ? dweight.data() : nullptr, probe.data(), X.data(), W.data(), wptr,
                sel, K, N, ws);
  EXPECT_LE(gradient_error(loss, X.data(), dX.data(), int64_t(X.size())), kGradTolerance);
  EXPECT_LE(gradient_error(loss, W.data(), dW.data(), int64_t(W.size())), kGradTolerance);
  if (weighted) {
    EXPECT_LE(gradient_error(loss, weight.data(), dweight.data(), n), kGradTolerance);
  }
  for (int64_t i = 3 * K * N; i < 4 * K * N; ++i) EXPECT_EQ(dW[i], 0.0);
}

TEST(KernelGradient, CvmmGatherUnweighted) { check_cvmm(false); }
TEST(KernelGradient, CvmmScatterWeighted) { check_cvmm(true); }

TEST(KernelGradient, Relu) {
  const int64_t n = 20;
  Vec x = random_vector(n, 1), probe = random_vector(n, 2);
  auto loss = [&] { Vec y = x; relu_forward(y.data(), n); return test::dot(y, probe); };
  Vec y = x, dx(n);
  relu_forward(y.data(), n);
  relu_backward(dx.data(), probe.data(), y.data(), n);
  EXPECT_LE(gradient_error(loss, x.data(), dx.data(), n), kGradTolerance);
}

TEST(KernelGradient, EntropyRegularisationOverAllUses) {
  const int64_t B = 2, T = 3, groups = 2, E = 4, per_use = B * T * groups * E;
  Vec z0 = random_vector(per_use, 1, 2.0), z1 = random_vector(per_use, 2, 2.0);
  const double coef = 0.7;
  Vec d0(per_use), d1(per_use);
  auto run = [&] {
    std::fill(d0.begin(), d0.end(), 0.0);
    std::fill(d1.begin(), d1.end(), 0.0);
    const double* uses[] = {z0.data(), z1.data()};
    double* duses[] = {d0.data(), d1.data()};
    return entropy_reg_forward_backward<double>(duses, uses, B, T, groups, E, coef);
  };
  run();
  const Vec g0 = d0, g1 = d1;
  EXPECT_LE(gradient_error(run, z0.data(), g0.data(), per_use), kGradTolerance);
  EXPECT_LE(gradient_error(run, z1.data(), g1.data(), per_use), kGradTolerance);
}

TEST(EntropyRegularisation, IsMinusLogEForUniformRouting) {
  // Equal logits: m is uniform, entropy log E, and the term is -coef * log E.
  const int64_t B = 3, T = 4, E = 5;
  Vec z(B * T * E, 0.25), dz(B * T * E, 0.0);
  const double* uses[] = {z.data()};
  double* duses[] = {dz.data()};
  EXPECT_NEAR(entropy_reg_forward_backward<double>(duses, uses, B, T, 1, E, 0.5), -0.5 * std::log(5.0), 1e-12);
}

TEST(KernelGradient, LmHeadCrossEntropy) {
  const int64_t n = 300, d = 4, V = 9;  // n crosses the 256-row chunk edge
  Vec x = random_vector(n * d, 1), W = random_vector(V * d, 2), bias = random_vector(V, 3);
  std::vector<int32_t> targets(n);
  for (int64_t i = 0; i < n; ++i) targets[i] = int32_t((i * 7) % V);
  std::vector<double> scratch;
  const double scale = 1.0 / n;
  auto loss = [&] {
    return scale * lm_head_ce<double>(nullptr, nullptr, nullptr, nullptr, x.data(), W.data(), bias.data(),
                                      targets.data(), n, d, V, 0.0, scratch);
  };
  Vec dx(n * d, 0.0), dW(V * d, 0.0), db(V, 0.0), rows(n);
  const double sum = lm_head_ce<double>(dx.data(), dW.data(), db.data(), rows.data(), x.data(), W.data(), bias.data(),
                                        targets.data(), n, d, V, scale, scratch);
  EXPECT_NEAR(sum, std::accumulate(rows.begin(), rows.end(), 0.0), 1e-9);
  EXPECT_LE(gradient_error(loss, x.data(), dx.data(), n * d), kGradTolerance);
  EXPECT_LE(gradient_error(loss, W.data(), dW.data(), V * d), kGradTolerance);
  EXPECT_LE(gradient_error(loss, bias.data(), db.data(), V), kGradTolerance);
}

}  // namespace
}  // namespace moeut
