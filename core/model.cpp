#include "core/model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <span>

#include "core/rng.h"
#include "kernels/attention.h"
#include "kernels/embedding.h"
#include "kernels/entropy_reg.h"
#include "kernels/gemm.h"
#include "kernels/layernorm.h"
#include "kernels/lm_head_ce.h"
#include "kernels/rope.h"
#include "kernels/routing.h"

namespace moeut {
namespace {

template <typename T>
void zero(std::vector<T>& v) { std::fill(v.begin(), v.end(), T(0)); }

template <typename T>
void resize(std::vector<T>& v, int64_t n) { v.assign(size_t(n), T(0)); }

// Unbiased standard deviation, as torch.Tensor.std().
template <typename T>
double stddev(const T* x, int64_t n) {
  double mean = 0, ss = 0;
  for (int64_t i = 0; i < n; ++i) mean += x[i];
  mean /= double(n);
  for (int64_t i = 0; i < n; ++i) ss += (x[i] - mean) * (x[i] - mean);
  return std::sqrt(ss / double(n - 1));
}

template <typename T>
double row_norm(const T* x, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += double(x[i]) * x[i];
  return std::sqrt(s);
}

// Fills `sel` for `groups` routing groups of E experts with k choices each per token:
// selection (t*groups + g)*k + j uses expert g*E + index, reading in_row and writing out_row.
template <typename F, typename G>
void build_selection(CvmmSelection& sel, const int32_t* index, int64_t n, int64_t groups,
                     int64_t E, int64_t k, F in_row, G out_row) {
  sel.resize(n * groups * k);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t j = 0; j < k; ++j) {
        const int64_t i = (t * groups + g) * k + j;
        sel.expert[i] = int32_t(g * E + index[i]);
        sel.in_row[i] = int32_t(in_row(t, g, i));
        sel.out_row[i] = int32_t(out_row(t, g, i));
      }
  sel.group(groups * E);
}

}  // namespace

ModelBytes model_bytes(const ModelConfig& m, int64_t experts, int64_t B) {
  const double d = double(m.d_model), V = double(m.n_tokens), G = double(m.group_size), L = double(m.n_layers);
  const double hd = double(m.n_heads * m.d_head), he = double(m.n_heads) * double(m.att_n_experts);
  const double hk = double(m.n_heads * m.att_k), kf = double(m.ff_k), Ef = double(m.ff_n_experts);
  const double es = double(m.ff_expert_size), T = double(m.context), N = double(B) * T;
  // ParamLayout: embedding and head, per physical layer the norms, attention and routers, and
  // the held experts' keys and values.
  const double params = 2 * V * d + V + 2 * d +
                        G * (4 * d + 2 * hd * d + 2 * he * d + 2 * he * d * double(m.d_head) + Ef * d +
                             2 * double(experts) * d * es);
  // plan(): per logical layer its saved activations (ints counted as one element each); the
  // residual streams; the shared gradient buffers; the FFN's hidden rows and their gradient; a
  // chunk of logits.
  const double per_layer = 3 * N * d + 4 * N + 4 * N * hd + double(B) * double(m.n_heads) * T * T + 4 * N * he +
                           4 * N * hk + 2 * N * Ef + 2 * N * kf;
  const double shared = (L + 1) * N * d + 4 * N * d + 2 * N + 4 * N * hd + N * he + N * hk + N * Ef + N * kf +
                        2 * N * kf * es + std::min(N, 256.0) * V;
  return {.parameters = 2 * params * sizeof(float), .activations = (L * per_layer + shared) * sizeof(float)};
}

template <typename T>
Model<T>::Model(const ModelConfig& config)
    : Model(config, expert_shard(config.ff_n_experts, 1, 0)) {}

template <typename T>
Model<T>::Model(const ModelConfig& config, ExpertShard shard)
    : cfg_((validate(config), config)), layout_(cfg_, shard), load_layout_(cfg_),
      expert_load_(size_t(2 * load_layout_.size()), 0.0) {
  if (shard.count == cfg_.ff_n_experts) dispatcher_ = std::make_unique<LocalDispatcher<T>>(cfg_.ff_n_experts);
  params.assign(size_t(layout_.total()), T(0));
  grads.assign(size_t(layout_.total()), T(0));
}

namespace {

// x[i] = T(draw(r)) for i in [0, n), where r is `rng` past the per·i draws that elements before i
// take: chunks of the stream drawn in parallel (Rng::skip), the values of drawing it in turn.
template <typename T, typename Draw>
void fill_from_stream(T* x, int64_t n, const Rng& rng, int64_t per, Draw draw) {
  constexpr int64_t kChunk = int64_t(1) << 16;
#pragma omp parallel for schedule(static)
  for (int64_t begin = 0; begin < n; begin += kChunk) {
    Rng r = rng;
    r.skip(uint64_t(begin * per));
    for (int64_t i = begin; i < std::min(n, begin + kChunk); ++i) x[i] = T(draw(r));
  }
}

}  // namespace

template <typename T>
void init_parameters(const ModelConfig& cfg, const ParamLayout& layout, uint64_t seed, T* params) {
  const double d = double(cfg.d_model), c = std::sqrt(2.0 / double(cfg.n_layers));
  for (const TensorSpec& t : layout.tensors()) {
    T* x = params + t.offset;
    const Rng rng(hash_mix(seed, hash_string(t.name)));
    auto normal = [&](double std) { fill_from_stream(x, t.numel, rng, 2, [std](Rng& r) { return std * r.normal(); }); };
    auto uniform = [&](double bound) {
      fill_from_stream(x, t.numel, rng, 1, [bound](Rng& r) { return bound * (2.0 * r.uniform() - 1.0); });
    };
    const std::string& n = t.name;
    if (t.expert) {
      // One stream per expert, so that a rank holding a shard draws the same values as a
      // process holding them all; the experts in parallel. FFN keys and values are plain normals.
      const ExpertShard shard = layout.shard();
      const int64_t per_expert = t.numel / shard.count;
      const double std = n.ends_with("ffn.values") ? c / std::sqrt(double(cfg.ff_n_experts * cfg.ff_expert_size))
                                                   : c / std::sqrt(d);
#pragma omp parallel for schedule(dynamic)
      for (int64_t e = 0; e < shard.count; ++e) {
        Rng expert_rng(hash_mix(hash_mix(seed, hash_string(n)), uint64_t(shard.begin + e)));
        for (int64_t i = 0; i < per_expert; ++i) x[e * per_expert + i] = T(std * expert_rng.normal());
      }
      continue;
    }
    auto ends = [&](const char* suffix) { return n.ends_with(suffix); };
    if (n == "embedding.weight") normal(1.0 / std::sqrt(d));
    else if (n.starts_with("lm_head.")) uniform(1.0 / std::sqrt(d));
    else if (ends("norm.weight") || ends("ln1.weight") || ends("ln2.weight")) std::fill_n(x, t.numel, T(1));
    else if (ends("norm.bias") || ends("ln1.bias") || ends("ln2.bias")) std::fill_n(x, t.numel, T(0));
    else if (ends("attention.o")) normal(c / std::sqrt(double(cfg.n_heads * cfg.d_head)));
    else normal(c / std::sqrt(d));  // expert_sel, sel_v, sel_o, q, k, v

    const int64_t rows = t.shape[0], width = t.numel / rows;
    if (ends("ffn.expert_sel")) {
      // Every row to the same norm, overall std kept (official renorm_keep_std).
      const double std_before = stddev(x, t.numel);
      for (int64_t r = 0; r < rows; ++r) {
        const double nr = row_norm(x + r * width, width);
        for (int64_t i = 0; i < width; ++i) x[r * width + i] = T(x[r * width + i] / nr);
      }
      const double f = std_before / stddev(x, t.numel);
      for (int64_t i = 0; i < t.numel; ++i) x[i] = T(x[i] * f);
    } else if (ends("attention.sel_v") || ends("attention.sel_o")) {
      // Each row divided by its norm, then times (its former std / the new overall std)
      // (official renorm_rows).
      std::vector<double> row_std(static_cast<size_t>(rows));
      for (int64_t r = 0; r < rows; ++r) {
        row_std[r] = stddev(x + r * width, width);
        const double nr = row_norm(x + r * width, width);
        for (int64_t i = 0; i < width; ++i) x[r * width + i] = T(x[r * width + i] / nr);
      }
      const double std_all = stddev(x, t.numel);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < width; ++i)
          x[r * width + i] = T(x[r * width + i] * (row_std[r] / std_all));
    }
  }
}

template void init_parameters<float>(const ModelConfig&, const ParamLayout&, uint64_t, float*);
template void init_parameters<double>(const ModelConfig&, const ParamLayout&, uint64_t, double*);

template <typename T>
void Model<T>::init(uint64_t seed) {
  init_parameters(cfg_, layout_, seed, params.data());
}

template <typename T>
void Model<T>::plan(int64_t B) {
  if (B == B_) return;
  B_ = B;
  const int64_t Tn = cfg_.context, N = B * Tn, d = cfg_.d_model, L = cfg_.n_layers;
  const int64_t hd = cfg_.n_heads * cfg_.d_head, he = cfg_.n_heads * cfg_.att_n_experts;
  const int64_t hk = cfg_.n_heads * cfg_.att_k, kf = cfg_.ff_k, Ef = cfg_.ff_n_experts;
  inputs_.resize(size_t(N));
  targets_.resize(size_t(N));
  xs_.assign(size_t(L + 1), std::vector<T>(size_t(N * d)));
  acts_.assign(size_t(L), LayerActs{});
  for (LayerActs& a : acts_) {
    for (auto* v : {&a.xn1, &a.x_mid, &a.xn2}) resize(*v, N * d);
    for (auto* v : {&a.mean1, &a.rstd1, &a.mean2, &a.rstd2}) resize(*v, N);
    for (auto* v : {&a.q, &a.k, &a.v, &a.heads}) resize(*v, N * hd);
    resize(a.probs, B * cfg_.n_heads * Tn * Tn);
    for (auto* v : {&a.zv, &a.zo, &a.dz_reg_v, &a.dz_reg_o}) resize(*v, N * he);
    for (auto* v : {&a.wv, &a.wo}) resize(*v, N * hk);
    for (auto* v : {&a.iv, &a.io}) resize(*v, N * hk);
    for (auto* v : {&a.z, &a.dz_reg_ff}) resize(*v, N * Ef);
    resize(a.w_ff, N * kf);
    resize(a.i_ff, N * kf);
  }
  for (auto* v : {&xf_, &s_.dxn, &s_.dxf, &s_.dres}) resize(*v, N * d);
  for (auto* v : {&mean_f_, &rstd_f_}) resize(*v, N);
  for (auto* v : {&s_.dq, &s_.dk, &s_.dv, &s_.dheads}) resize(*v, N * hd);
  resize(s_.dz_att, N * he);
  resize(s_.dw_att, N * hk);
  resize(s_.dz_ff, N * Ef);
  resize(s_.dw_ff, N * kf);
}

template <typename T>
void Model<T>::attention_forward(int64_t l) {
  LayerActs& a = acts_[l];
  const std::string p = layer_prefix(l % cfg_.group_size);
  const int64_t Tn = cfg_.context, N = B_ * Tn, d = cfg_.d_model, H = cfg_.n_heads;
  const int64_t dh = cfg_.d_head, hd = H * dh, Ea = cfg_.att_n_experts, ka = cfg_.att_k;
  const T* x = xs_[l].data();
  layernorm_forward(a.xn1.data(), a.mean1.data(), a.rstd1.data(), x, param(p + "ln1.weight"),
                    param(p + "ln1.bias"), N, d);
  // q and k carry dh^-1/4 each, so the attention itself uses scale 1.
  const T s = T(std::pow(double(dh), -0.25));
  gemm(false, true, N, hd, d, s, a.xn1.data(), d, param(p + "attention.q.weight"), d, T(0), a.q.data(), hd);
  gemm(false, true, N, hd, d, s, a.xn1.data(), d, param(p + "attention.k.weight"), d, T(0), a.k.data(), hd);
  rope_forward(a.q.data(), B_, Tn, H, dh, cfg_.rope_dims());
  rope_forward(a.k.data(), B_, Tn, H, dh, cfg_.rope_dims());

  // Value experts read the raw residual; output experts read the heads. Both are routed from
  // the normalised input, per head.
  gemm(false, true, N, H * Ea, d, T(1), a.xn1.data(), d, param(p + "attention.sel_v"), d, T(0), a.zv.data(), H * Ea);
  gemm(false, true, N, H * Ea, d, T(1), a.xn1.data(), d, param(p + "attention.sel_o"), d, T(0), a.zo.data(), H * Ea);
  topk_sigmoid_forward(a.iv.data(), a.wv.data(), a.zv.data(), N, H, Ea, ka);
  topk_sigmoid_forward(a.io.data(), a.wo.data(), a.zo.data(), N, H, Ea, ka);
  build_selection(a.sel_v, a.iv.data(), N, H, Ea, ka,
                  [](int64_t t, int64_t, int64_t) { return t; },
                  [H](int64_t t, int64_t h, int64_t) { return t * H + h; });
  build_selection(a.sel_o, a.io.data(), N, H, Ea, ka,
                  [H](int64_t t, int64_t h, int64_t) { return t * H + h; },
                  [](int64_t t, int64_t, int64_t) { return t; });
  zero(a.v);
  cvmm_forward(a.v.data(), x, param(p + "attention.v"), a.wv.data(), a.sel_v, d, dh, s_.cvmm);
  moeut::attention_forward(a.heads.data(), a.probs.data(), a.q.data(), a.k.data(), a.v.data(), B_, Tn, H, dh);
  std::copy(xs_[l].begin(), xs_[l].end(), a.x_mid.begin());
  cvmm_forward(a.x_mid.data(), a.heads.data(), param(p + "attention.o"), a.wo.data(), a.sel_o, dh, d, s_.cvmm);
}

template <typename T>
void Model<T>::ffn_forward(int64_t l) {
  LayerActs& a = acts_[l];
  const std::string p = layer_prefix(l % cfg_.group_size);
  const int64_t N = B_ * cfg_.context, d = cfg_.d_model, Ef = cfg_.ff_n_experts;
  const int64_t kf = cfg_.ff_k;
  layernorm_forward(a.xn2.data(), a.mean2.data(), a.rstd2.data(), a.x_mid.data(),
                    param(p + "ln2.weight"), param(p + "ln2.bias"), N, d);
  gemm(false, true, N, Ef, d, T(1), a.xn2.data(), d, param(p + "ffn.expert_sel"), d, T(0), a.z.data(), Ef);
  topk_sigmoid_forward(a.i_ff.data(), a.w_ff.data(), a.z.data(), N, 1, Ef, kf);
  std::copy(a.x_mid.begin(), a.x_mid.end(), xs_[l + 1].begin());
  if (!dispatcher_)
    throw std::logic_error("Model holds FFN experts " + std::to_string(layout_.shard().begin) + ".." +
                           std::to_string(layout_.shard().begin + layout_.shard().count - 1) +
                           " only and has no token dispatcher to reach the others (set_dispatcher)");
  dispatcher_->forward(l, a.x_mid.data(), a.i_ff.data(), a.w_ff.data(), N, kf, expert_params(l), xs_[l + 1].data());
}

template <typename T>
ExpertParams<T> Model<T>::expert_params(int64_t l) {
  const std::string p = layer_prefix(l % cfg_.group_size);
  return {param(p + "ffn.keys"), param(p + "ffn.values"), grad(p + "ffn.keys"), grad(p + "ffn.values"),
          cfg_.d_model, cfg_.ff_expert_size};
}

template <typename T>
void Model<T>::forward(const int32_t* tokens, int64_t B) {
  plan(B);
  const int64_t Tn = cfg_.context, N = B * Tn, d = cfg_.d_model;
  for (int64_t b = 0; b < B; ++b) {
    std::copy_n(tokens + b * (Tn + 1), Tn, inputs_.begin() + b * Tn);
    std::copy_n(tokens + b * (Tn + 1) + 1, Tn, targets_.begin() + b * Tn);
  }
  for (int64_t i = 0; i < N; ++i)
    if (inputs_[i] < 0 || inputs_[i] >= cfg_.n_tokens || targets_[i] < 0 || targets_[i] >= cfg_.n_tokens)
      throw std::out_of_range("token id outside the vocabulary of " + std::to_string(cfg_.n_tokens));
  embedding_forward(xs_[0].data(), inputs_.data(), param("embedding.weight"), N, d);
  for (int64_t l = 0; l < cfg_.n_layers; ++l) {
    attention_forward(l);
    ffn_forward(l);
  }
  layernorm_forward(xf_.data(), mean_f_.data(), rstd_f_.data(), xs_.back().data(),
                    param("out_norm.weight"), param("out_norm.bias"), N, d);
}

template <typename T>
LossParts Model<T>::regularisers(double weight) {
  // Each physical layer's term covers all R of its uses; the gradient w.r.t. each use's logits
  // is kept for that layer's backward pass.
  LossParts out;
  const int64_t G = cfg_.group_size, R = cfg_.repeats(), H = cfg_.n_heads;
  for (int64_t g = 0; g < G; ++g) {
    std::vector<const T*> zf, zv, zo;
    std::vector<T*> dzf, dzv, dzo;
    for (int64_t r = 0; r < R; ++r) {
      LayerActs& a = acts_[r * G + g];
      for (auto* v : {&a.dz_reg_ff, &a.dz_reg_v, &a.dz_reg_o}) zero(*v);
      zf.push_back(a.z.data()); dzf.push_back(a.dz_reg_ff.data());
      zv.push_back(a.zv.data()); dzv.push_back(a.dz_reg_v.data());
      zo.push_back(a.zo.data()); dzo.push_back(a.dz_reg_o.data());
    }
    auto term = [&](std::vector<T*>& dz, std::vector<const T*>& z, int64_t groups, int64_t E, double coef) {
      return entropy_reg_forward_backward<T>(dz, z, B_, cfg_.context, groups, E, coef * weight) / weight;
    };
    out.reg_ffn += term(dzf, zf, 1, cfg_.ff_n_experts, cfg_.entropy_reg);
    out.reg_att += term(dzv, zv, H, cfg_.att_n_experts, cfg_.att_entropy_reg);
    out.reg_att += term(dzo, zo, H, cfg_.att_n_experts, cfg_.att_entropy_reg);
  }
  return out;
}

template <typename T>
void Model<T>::count_expert_load(int64_t N) {
  double* counts = expert_load_.data();
  double* weights = counts + load_layout_.size();
  const int64_t H = cfg_.n_heads, Ea = cfg_.att_n_experts, ka = cfg_.att_k;
  for (int64_t l = 0; l < cfg_.n_layers; ++l) {
    const LayerActs& a = acts_[l];
    const int64_t g = l % cfg_.group_size;
    auto at = [&](ExpertKind kind) { return load_layout_.offset(g, kind); };
    count_selections(counts + at(ExpertKind::kFfn), weights + at(ExpertKind::kFfn), a.i_ff.data(), a.w_ff.data(), N,
                     1, cfg_.ff_n_experts, cfg_.ff_k);
    count_selections(counts + at(ExpertKind::kAttentionValue), weights + at(ExpertKind::kAttentionValue),
                     a.iv.data(), a.wv.data(), N, H, Ea, ka);
    count_selections(counts + at(ExpertKind::kAttentionOutput), weights + at(ExpertKind::kAttentionOutput),
                     a.io.data(), a.wo.data(), N, H, Ea, ka);
  }
}

template <typename T>
std::vector<double> Model<T>::take_expert_load() {
  std::vector<double> out(expert_load_.size(), 0.0);
  out.swap(expert_load_);
  return out;
}

template <typename T>
void Model<T>::ffn_backward(int64_t l, T* dx) {
  LayerActs& a = acts_[l];
  const std::string p = layer_prefix(l % cfg_.group_size);
  const int64_t N = B_ * cfg_.context, d = cfg_.d_model, Ef = cfg_.ff_n_experts;
  const int64_t kf = cfg_.ff_k;
  // dx holds d/d(layer output); the FFN input is the raw x_mid, so the expert gradient adds
  // straight onto the residual gradient.
  dispatcher_->backward(l, dx, dx, s_.dw_ff.data(), expert_params(l));
  std::copy(a.dz_reg_ff.begin(), a.dz_reg_ff.end(), s_.dz_ff.begin());
  topk_sigmoid_backward(s_.dz_ff.data(), s_.dw_ff.data(), a.i_ff.data(), a.w_ff.data(), N, 1, Ef, kf);
  gemm(true, false, Ef, d, N, T(1), s_.dz_ff.data(), Ef, a.xn2.data(), d, T(1), grad(p + "ffn.expert_sel"), d);
  gemm(false, false, N, d, Ef, T(1), s_.dz_ff.data(), Ef, param(p + "ffn.expert_sel"), d, T(0), s_.dxn.data(), d);
  layernorm_backward(dx, grad(p + "ln2.weight"), grad(p + "ln2.bias"), s_.dxn.data(), a.x_mid.data(),
                     param(p + "ln2.weight"), a.mean2.data(), a.rstd2.data(), N, d);
}

template <typename T>
void Model<T>::attention_backward(int64_t l, T* dx) {
  LayerActs& a = acts_[l];
  const std::string p = layer_prefix(l % cfg_.group_size);
  const int64_t Tn = cfg_.context, N = B_ * Tn, d = cfg_.d_model, H = cfg_.n_heads;
  const int64_t dh = cfg_.d_head, hd = H * dh, Ea = cfg_.att_n_experts, ka = cfg_.att_k;
  const T* x = xs_[l].data();
  // Output experts, then attention, then value experts (which read the raw residual).
  zero(s_.dheads);
  cvmm_backward(s_.dheads.data(), grad(p + "attention.o"), s_.dw_att.data(), dx, a.heads.data(),
                param(p + "attention.o"), a.wo.data(), a.sel_o, dh, d, s_.cvmm);
  std::copy(a.dz_reg_o.begin(), a.dz_reg_o.end(), s_.dz_att.begin());
  topk_sigmoid_backward(s_.dz_att.data(), s_.dw_att.data(), a.io.data(), a.wo.data(), N, H, Ea, ka);
  // d(xn1) collects the routers' and q/k's gradients; dx collects the value experts'.
  gemm(true, false, H * Ea, d, N, T(1), s_.dz_att.data(), H * Ea, a.xn1.data(), d, T(1), grad(p + "attention.sel_o"), d);
  gemm(false, false, N, d, H * Ea, T(1), s_.dz_att.data(), H * Ea, param(p + "attention.sel_o"), d, T(0), s_.dxn.data(), d);

  moeut::attention_backward(s_.dq.data(), s_.dk.data(), s_.dv.data(), s_.dheads.data(), a.probs.data(),
                            a.q.data(), a.k.data(), a.v.data(), B_, Tn, H, dh);
  cvmm_backward(dx, grad(p + "attention.v"), s_.dw_att.data(), s_.dv.data(), x, param(p + "attention.v"),
                a.wv.data(), a.sel_v, d, dh, s_.cvmm);
  std::copy(a.dz_reg_v.begin(), a.dz_reg_v.end(), s_.dz_att.begin());
  topk_sigmoid_backward(s_.dz_att.data(), s_.dw_att.data(), a.iv.data(), a.wv.data(), N, H, Ea, ka);
  gemm(true, false, H * Ea, d, N, T(1), s_.dz_att.data(), H * Ea, a.xn1.data(), d, T(1), grad(p + "attention.sel_v"), d);
  gemm(false, false, N, d, H * Ea, T(1), s_.dz_att.data(), H * Ea, param(p + "attention.sel_v"), d, T(1), s_.dxn.data(), d);

  rope_backward(s_.dq.data(), B_, Tn, H, dh, cfg_.rope_dims());
  rope_backward(s_.dk.data(), B_, Tn, H, dh, cfg_.rope_dims());
  const T s = T(std::pow(double(dh), -0.25));
  gemm(true, false, hd, d, N, s, s_.dq.data(), hd, a.xn1.data(), d, T(1), grad(p + "attention.q.weight"), d);
  gemm(true, false, hd, d, N, s, s_.dk.data(), hd, a.xn1.data(), d, T(1), grad(p + "attention.k.weight"), d);
  gemm(false, false, N, d, hd, s, s_.dq.data(), hd, param(p + "attention.q.weight"), d, T(1), s_.dxn.data(), d);
  gemm(false, false, N, d, hd, s, s_.dk.data(), hd, param(p + "attention.k.weight"), d, T(1), s_.dxn.data(), d);
  layernorm_backward(dx, grad(p + "ln1.weight"), grad(p + "ln1.bias"), s_.dxn.data(), x,
                     param(p + "ln1.weight"), a.mean1.data(), a.rstd1.data(), N, d);
}

template <typename T>
LossParts Model<T>::forward_backward(const int32_t* tokens, int64_t B, double weight) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  forward(tokens, B);
  const int64_t N = B * cfg_.context, d = cfg_.d_model;
  if (counting_experts_) count_expert_load(N);
  if (!(weight > 0)) throw std::invalid_argument("forward_backward: weight must be positive");
  LossParts loss = regularisers(weight);
  // The cross-entropy gradient starts the backward pass at the output LayerNorm.
  zero(s_.dxf);
  const double ce_sum = lm_head_ce(s_.dxf.data(), grad("lm_head.weight"), grad("lm_head.bias"), nullptr,
                                   xf_.data(), param("lm_head.weight"), param("lm_head.bias"), targets_.data(),
                                   N, d, cfg_.n_tokens, T(weight / double(N)), s_.logits);
  loss.ce = ce_sum / double(N);
  loss.residual_std = residual_std_of(rstd_f_.data(), N);
  const auto backward_start = Clock::now();
  T* dx = s_.dres.data();  // gradient w.r.t. the residual stream, carried down the layers
  zero(s_.dres);
  layernorm_backward(dx, grad("out_norm.weight"), grad("out_norm.bias"), s_.dxf.data(), xs_.back().data(),
                     param("out_norm.weight"), mean_f_.data(), rstd_f_.data(), N, d);
  for (int64_t l = cfg_.n_layers - 1; l >= 0; --l) {
    ffn_backward(l, dx);
    attention_backward(l, dx);
  }
  embedding_backward(grad("embedding.weight"), dx, inputs_.data(), N, d);
  pass_seconds_.forward += std::chrono::duration<double>(backward_start - start).count();
  pass_seconds_.backward += std::chrono::duration<double>(Clock::now() - backward_start).count();
  return loss;
}

template <typename T>
double Model<T>::forward_ce_sum(const int32_t* tokens, int64_t B) {
  forward(tokens, B);
  return lm_head_ce<T>(nullptr, nullptr, nullptr, nullptr, xf_.data(), param("lm_head.weight"),
                       param("lm_head.bias"), targets_.data(), B * cfg_.context, cfg_.d_model,
                       cfg_.n_tokens, T(0), s_.logits);
}

template <typename T>
std::vector<T> Model<T>::logits(const int32_t* tokens, int64_t B) {
  forward(tokens, B);
  const int64_t n = B * cfg_.context, V = cfg_.n_tokens;
  std::vector<T> out(size_t(n * V));
  lm_head_logits(out.data(), xf_.data(), param("lm_head.weight"), param("lm_head.bias"), n, cfg_.d_model, V);
  return out;
}

template class Model<float>;
template class Model<double>;

}  // namespace moeut
