// Token dispatch for the FFN experts: takes each token of this process to the experts it
// selected, wherever they live, and brings the weighted results back. The model calls it once
// per logical layer in forward and backward; implementations keep what backward needs per use.
// LocalDispatcher (here) serves a process that holds every expert; parallel/ adds the
// all-to-all dispatcher for expert parallelism.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "core/ffn_experts.h"

namespace moeut {

template <typename T>
class TokenDispatcher {
 public:
  virtual ~TokenDispatcher() = default;
  // y[t] += Σ_j w[t,j] · expert_{I[t,j]}(x[t]) for t < n, I holding global expert ids, k per
  // token. x must stay unchanged until backward(use).
  virtual void forward(int64_t use, const T* x, const int32_t* I, const T* w, int64_t n, int64_t k,
                       const ExpertParams<T>& p, T* y) = 0;
  // dx[t] += d/dx[t]; dw[t,j] = d/dw[t,j]; expert gradients accumulated into p. dy may alias dx.
  virtual void backward(int64_t use, const T* dy, T* dx, T* dw, const ExpertParams<T>& p) = 0;
  // This rank's traffic so far: bytes of its data that other ranks received, and the token rows
  // its experts were given in forward passes (its own tokens among them).
  virtual int64_t bytes_sent() const = 0;
  virtual int64_t rows_received() const = 0;
};

template <typename T>
class LocalDispatcher final : public TokenDispatcher<T> {
 public:
  explicit LocalDispatcher(int64_t n_experts) : n_experts_(n_experts) {}
  void forward(int64_t use, const T* x, const int32_t* I, const T* w, int64_t n, int64_t k,
               const ExpertParams<T>& p, T* y) override;
  void backward(int64_t use, const T* dy, T* dx, T* dw, const ExpertParams<T>& p) override;
  int64_t bytes_sent() const override { return 0; }
  int64_t rows_received() const override { return rows_received_; }

 private:
  int64_t n_experts_;
  int64_t rows_received_ = 0;
  std::vector<ExpertWork<T>> work_;  // per use
  std::vector<int32_t> rows_;
  std::vector<T> dhidden_;
  CvmmWorkspace<T> ws_;
};

}  // namespace moeut
