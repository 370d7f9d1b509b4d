// The dispatcher of a model that holds every FFN expert: nothing moves. The experts read the
// tokens' rows and routing where the router left them and add straight into the tokens' outputs
// and gradients, so dispatch and combine launch no work, and passes can be captured as CUDA
// graphs.
#pragma once
#include <memory>
#include <stdexcept>
#include <string>

#include "core/gpu_token_dispatcher.h"

namespace moeut {

class LocalGpuDispatcher final : public GpuTokenDispatcher {
 public:
  explicit LocalGpuDispatcher(int64_t max_tokens) : max_tokens_(max_tokens) {}

  std::unique_ptr<Route> make_route() const override { return std::make_unique<Nothing>(); }
  int64_t max_rows() const override { return max_tokens_; }
  bool host_synchronous() const override { return false; }

  // The tokens' rows as they are (global expert ids are local ones here).
  Rows dispatch(Route&, const Rows& tokens) override {
    if (tokens.rows > max_tokens_)
      throw std::invalid_argument("LocalGpuDispatcher: " + std::to_string(tokens.rows) + " tokens, planned for " +
                                  std::to_string(max_tokens_));
    return tokens;
  }
  void combine(Route&) override {}
  GradRows dispatch_grad(Route&, const GradRows& tokens) override { return tokens; }
  void combine_grad(Route&) override {}

  int64_t bytes_sent() const override { return 0; }
  int64_t device_bytes() const override { return 0; }

 private:
  struct Nothing final : Route {
    int64_t device_bytes() const override { return 0; }
  };
  int64_t max_tokens_;
};

}  // namespace moeut
