// Passes replayed as CUDA graphs, keyed by what the captured work depends on. A pass runs eagerly
// the first time its key is seen (which also settles cuBLAS's choices and any set-up done on
// first use before a capture), is captured the second time, and is replayed from then on. The
// host state that a pass leaves behind (and a replay does not) is kept with its graph and
// restored after each replay.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/cuda_check.h"

namespace moeut {

// Key: equality-comparable; State: the host state a pass leaves, copyable.
template <class Key, class State>
class PassGraphCache {
 public:
  PassGraphCache() = default;
  ~PassGraphCache() { clear(); }
  PassGraphCache(const PassGraphCache&) = delete;
  PassGraphCache& operator=(const PassGraphCache&) = delete;

  // The pass of `key` on `stream`: enqueue() queues its work; save() returns the state it left,
  // restore(state) sets it again after a replay.
  template <class Enqueue, class Save, class Restore>
  void run(const Key& key, cudaStream_t stream, Enqueue&& enqueue, Save&& save, Restore&& restore) {
    auto graph = std::find_if(graphs_.begin(), graphs_.end(), [&](const Graph& g) { return g.key == key; });
    if (graph == graphs_.end()) {
      // First sight: eagerly. Kinds of pass are few (a step's first micro-batch, the others, the
      // loss alone); a caller varying a key's value would add one a value, so the oldest goes first.
      if (graphs_.size() == kMaxGraphs) {
        if (graphs_.front().exec) MOEUT_CUDA_CHECK(cudaGraphExecDestroy(graphs_.front().exec));
        graphs_.erase(graphs_.begin());
      }
      graphs_.push_back({.key = key, .after = {}});
      enqueue();
      return;
    }
    if (!graph->exec) {
      cudaGraph_t captured = nullptr;
      MOEUT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      try {
        enqueue();
      } catch (...) {
        cudaStreamEndCapture(stream, &captured);
        if (captured) cudaGraphDestroy(captured);
        throw;
      }
      MOEUT_CUDA_CHECK(cudaStreamEndCapture(stream, &captured));
      const cudaError_t made = cudaGraphInstantiate(&graph->exec, captured, 0);
      cudaGraphDestroy(captured);
      MOEUT_CUDA_CHECK(made);
      graph->after = save();
    }
    MOEUT_CUDA_CHECK(cudaGraphLaunch(graph->exec, stream));
    restore(graph->after);
  }

  // How many keys are captured (replayed on their next sight).
  int64_t captured() const {
    return std::count_if(graphs_.begin(), graphs_.end(), [](const Graph& g) { return g.exec != nullptr; });
  }
  // Forgets every key, destroying their graphs.
  void clear() {
    for (Graph& g : graphs_)
      if (g.exec) cudaGraphExecDestroy(g.exec);
    graphs_.clear();
  }

 private:
  static constexpr size_t kMaxGraphs = 8;
  struct Graph {
    Key key;
    State after;                     // as the captured pass left it
    cudaGraphExec_t exec = nullptr;  // none until the key is seen a second time
  };
  std::vector<Graph> graphs_;
};

}  // namespace moeut
