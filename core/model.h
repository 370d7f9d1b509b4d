// MoEUT (docs/MODEL.md) on the CPU: explicit forward and backward, activations kept
// per logical layer in buffers planned for the batch shape, gradients of a physical layer
// summed over all its uses. T is float for training, double for gradient checks.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "core/config.h"
#include "core/expert_load.h"
#include "core/params.h"
#include "core/token_dispatcher.h"
#include "kernels/cvmm.h"

namespace moeut {

// Mean losses of one batch: cross-entropy per predicted token, and the two regularisers
// (already multiplied by their coefficients, summed over physical layers). residual_std, the
// mean over tokens of the standard deviation of the last residual (the output LayerNorm's input),
// is not a loss but watches the residual stream, which the value and FFN expert paths read raw.
struct LossParts {
  double ce = 0, reg_ffn = 0, reg_att = 0;
  double residual_std = 0;
  double total() const { return ce + reg_ffn + reg_att; }
};

// Seconds a model spent in training passes since it was last asked: the forward (embedding to
// the loss and its gradient at the LM head) and the backward (output LayerNorm to embedding).
struct PassSeconds {
  double forward = 0, backward = 0;
};

// residual_std of `rows` rows from the output LayerNorm's 1 / sqrt(var + eps) of each.
template <typename T>
double residual_std_of(const T* rstd, int64_t rows) {
  double sum = 0;
  for (int64_t i = 0; i < rows; ++i) sum += 1.0 / double(rstd[i]);
  return sum / double(rows);
}

// Host memory a Model<float> takes, in bytes, computed in floating point so that no size
// overflows: parameters and their gradients (holding `experts` of the FFN experts), and the
// activations and gradient buffers of a batch of B sequences, as Model::plan sizes them.
struct ModelBytes {
  double parameters, activations;
};
ModelBytes model_bytes(const ModelConfig& m, int64_t experts, int64_t B);

// The spec's initialisation (docs/MODEL.md) of every parameter of `layout`, into params
// (layout.total() values). Each tensor, and each expert of an expert tensor, draws its own
// stream, so a rank holding a shard gets the values of a process holding every expert; the draws
// run in parallel (OpenMP) and give the values of drawing each stream in turn.
template <typename T>
void init_parameters(const ModelConfig& cfg, const ParamLayout& layout, uint64_t seed, T* params);

template <typename T>
class Model {
 public:
  // Holds the FFN experts of `shard` (all of them by default). Holding all of them, it
  // dispatches tokens locally; holding only a shard, it needs a dispatcher that reaches the
  // other shards (set_dispatcher) before it runs.
  explicit Model(const ModelConfig& config);
  Model(const ModelConfig& config, ExpertShard shard);
  void set_dispatcher(std::unique_ptr<TokenDispatcher<T>> d) { dispatcher_ = std::move(d); }
  const TokenDispatcher<T>* dispatcher() const { return dispatcher_.get(); }

  const ModelConfig& config() const { return cfg_; }
  const ParamLayout& layout() const { return layout_; }
  T* param(const std::string& name) { return params.data() + layout_.at(name).offset; }
  T* grad(const std::string& name) { return grads.data() + layout_.at(name).offset; }

  void init(uint64_t seed);  // the spec's initialisation (init_parameters)

  // tokens: [B, context + 1]; positions 0..context-1 are the input, 1..context the targets.
  // Accumulates into grads the gradient of weight * (mean CE + regularisers) of this batch, so
  // micro-batches of a global batch each pass weight = their share of its sequences.
  LossParts forward_backward(const int32_t* tokens, int64_t B, double weight);

  // Sum of the cross-entropy over the B * context predictions (no regularisers, no gradients).
  double forward_ce_sum(const int32_t* tokens, int64_t B);
  // The logits [B * context, n_tokens] of the B windows' inputs (no gradients).
  std::vector<T> logits(const int32_t* tokens, int64_t B);

  // Expert-load counting (core/expert_load.h) in forward_backward, off until switched on; the
  // routers' choices since the last take (ExpertLoadLayout's counts, then routing-weight sums),
  // and a fresh count from there.
  void set_expert_counting(bool on) { counting_experts_ = on; }
  std::vector<double> take_expert_load();
  // Seconds of forward_backward's forwards and backwards since the last call.
  PassSeconds take_pass_seconds() { return std::exchange(pass_seconds_, {}); }

  std::vector<T> params, grads;

 private:
  // What the backward pass of logical layer l needs, saved by its forward pass.
  struct LayerActs {
    std::vector<T> xn1, mean1, rstd1;        // LN1 of the residual entering the layer
    std::vector<T> q, k, v, probs, heads;    // attention ([N, H*dh]; probs [B, H, T, T])
    std::vector<T> zv, zo, wv, wo;           // value/output routing logits and weights
    std::vector<int32_t> iv, io;
    CvmmSelection sel_v, sel_o;
    std::vector<T> x_mid;                    // residual after attention
    std::vector<T> xn2, mean2, rstd2;
    std::vector<T> z, w_ff;                  // FFN routing logits [N, Ef] and weights [N, kf]
    std::vector<int32_t> i_ff;
    std::vector<T> dz_reg_v, dz_reg_o, dz_reg_ff;  // regulariser gradients w.r.t. the logits
  };
  // Gradient buffers reused by every layer's backward pass.
  struct Scratch {
    std::vector<T> dres, dxn, dq, dk, dv, dheads, dz_att, dw_att, dz_ff, dw_ff, dxf;
    std::vector<T> logits;
    CvmmWorkspace<T> cvmm;
  };

  void plan(int64_t B);
  void forward(const int32_t* tokens, int64_t B);
  void attention_forward(int64_t l);
  void ffn_forward(int64_t l);
  LossParts regularisers(double weight);
  void ffn_backward(int64_t l, T* dx);
  void count_expert_load(int64_t N);  // the last forward pass's N tokens into expert_load_
  void attention_backward(int64_t l, T* dx);
  ExpertParams<T> expert_params(int64_t l);

  ModelConfig cfg_;
  ParamLayout layout_;
  int64_t B_ = -1;                  // batch the buffers are planned for (a rank may run B = 0)
  std::vector<int32_t> inputs_, targets_;
  std::vector<std::vector<T>> xs_;  // residual stream entering each layer, and the final one
  std::vector<LayerActs> acts_;
  std::vector<T> xf_, mean_f_, rstd_f_;  // output LayerNorm
  Scratch s_;
  std::unique_ptr<TokenDispatcher<T>> dispatcher_;
  ExpertLoadLayout load_layout_;
  std::vector<double> expert_load_;  // see take_expert_load
  bool counting_experts_ = false;
  PassSeconds pass_seconds_;
};

}  // namespace moeut
