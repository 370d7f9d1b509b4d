// The gradient synchronisation that a step's last backward pass begins (GpuModel::GradientSync,
// GpuShardedAdamW::reduce_final_experts): a physical layer's FFN expert gradients are final when
// the pass says so, the last layers first, in eager passes and in replays of captured ones; and
// reducing the expert buckets there, beside the pass, updates the parameters exactly as reducing
// them all at the step does (the same reductions of the same values), across the ranks of an
// expert-data-parallel group (mpirun -np 2 or more); and that reduction sums each owner's chunk.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

#include "core/gpu_model.h"
#include "gpu_model_test.h"
#include "gpu_test.h"
#include "mpi/mpi_test.h"
#include "parallel/gpu_sharded_optimizer.h"
#include "parallel/mpi_communicator.h"
#include "parallel/nccl_communicator.h"

namespace moeut {
namespace {

// Copies each layer's expert gradients, in stream order, when the pass calls them final.
class SnapshotSync final : public GpuModel::GradientSync {
 public:
  SnapshotSync(const ParamLayout& layout, int64_t layers, cudaStream_t stream) : layout_(layout), stream_(stream) {
    for (int64_t g = 0; g < layers; ++g) {
      const auto [begin, end] = layout.expert_range(g);
      snapshots_.emplace_back(size_t(end - begin));
    }
  }
  void experts_final(int64_t g, float* grads) override {
    calls_.push_back(g);
    const auto [begin, end] = layout_.expert_range(g);
    MOEUT_CUDA_CHECK(cudaMemcpyAsync(snapshots_[size_t(g)].get(), grads + begin, size_t(end - begin) * sizeof(float),
                                     cudaMemcpyDeviceToDevice, stream_));
  }
  void pass_end() override { calls_.push_back(-1); }
  std::vector<int64_t> calls_;  // the layers in call order, -1 for pass_end
  std::vector<cuda::DeviceBuffer<float>> snapshots_;

 private:
  const ParamLayout& layout_;
  cudaStream_t stream_;
};

TEST(GpuGradientSync, ExpertGradientsAreFinalWhenThePassSaysSo) {
  if (gpu_count() < world_size()) GTEST_SKIP() << "skipped: no GPU for every rank";
  MOEUT_CUDA_CHECK(cudaSetDevice(world_rank()));
  const ModelConfig cfg = gpu_test::small_config();  // 4 layers, 2 physical: the second repeat defers
  const int64_t B = 2;
  cudaStream_t stream;
  MOEUT_CUDA_CHECK(cudaStreamCreate(&stream));
  {
    GpuModel model(cfg, B, expert_shard(cfg.ff_n_experts, 1, 0), nullptr, stream);
    model.set_parameters(gpu_test::initial_parameters(cfg, model.layout(), 5));
    SnapshotSync sync(model.layout(), cfg.group_size, stream);
    Rng rng{9};
    std::vector<int32_t> tokens(size_t(B * (cfg.context + 1)));
    // Step 0 runs eagerly, step 1 is captured, step 2 replays (see GpuModel::set_graphs).
    for (int step = 0; step < 3; ++step) {
      model.zero_gradients();
      for (int micro = 0; micro < 2; ++micro) {
        for (auto& t : tokens) t = int32_t(rng.next() % uint64_t(cfg.n_tokens));
        model.forward_backward(tokens.data(), 0.5, micro == 1 ? &sync : nullptr);
      }
      const std::vector<float> grads = model.gradients();
      for (int64_t g = 0; g < cfg.group_size; ++g) {
        const auto [begin, end] = model.layout().expert_range(g);
        const std::vector<float> seen = sync.snapshots_[size_t(g)].download();
        EXPECT_TRUE(std::equal(seen.begin(), seen.end(), grads.begin() + begin))
            << "step " << step << ": layer " << g << "'s expert gradients changed after the pass called them final";
      }
    }
    // Captured once, replayed after: the host saw the eager and the captured pass.
    EXPECT_EQ(sync.calls_, (std::vector<int64_t>{1, 0, -1, 1, 0, -1}));
  }
  MOEUT_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(GpuGradientSync, ReducingExpertsInTheBackwardUpdatesAsTheStepDoes) {
  if (world_size() < 2) GTEST_SKIP() << "needs two ranks or more (mpirun -np 2)";
  if (gpu_count() < world_size()) GTEST_SKIP() << "skipped: no GPU for every rank";
  MOEUT_CUDA_CHECK(cudaSetDevice(world_rank()));
  const ModelConfig cfg = gpu_test::small_config();
  const ParamLayout layout(cfg);  // every expert on every rank: ep 1, the experts' data-parallel group the world
  const ProcessGroups host = mpi_process_groups(MPI_COMM_WORLD, 1);
  cudaStream_t stream;
  MOEUT_CUDA_CHECK(cudaStreamCreate(&stream));
  {
    const NcclProcessGroups groups = nccl_process_groups(host, stream);
    const std::vector<float> initial = gpu_test::initial_parameters(cfg, layout, 3);
    Rng rng{uint64_t(40 + world_rank())};  // each rank its own gradients
    std::vector<float> grads(size_t(layout.total()));
    for (float& v : grads) v = float(rng.normal() * 1e-2);
    // Small buckets: several per layer, and some holding the end of one layer and the start of the next.
    const int64_t bucket = 3001;
    TrainConfig t;
    t.lr = 1e-3;
    std::vector<std::vector<uint16_t>> working(2);
    std::vector<double> norms;
    for (const bool early : {false, true}) {
      GpuShardedAdamW optimizer(layout, groups, initial, stream, bucket);
      cuda::DeviceBuffer<__nv_bfloat16> w(size_t(layout.total()));
      cuda::DeviceBuffer<float> g(grads);
      if (early) {
        for (int64_t layer = cfg.group_size - 1; layer >= 0; --layer) optimizer.reduce_final_experts(g.get(), layer);
        optimizer.join_reduces();
      }
      norms.push_back(optimizer.step(w.get(), g.get(), t.lr, t, early));
      std::vector<__nv_bfloat16> out = w.download();
      working[early].resize(out.size());
      std::memcpy(working[early].data(), out.data(), out.size() * sizeof(uint16_t));
    }
    EXPECT_EQ(norms[1], norms[0]);
    EXPECT_EQ(working[1], working[0]) << "the working copy after the step differs";
  }
  MOEUT_CUDA_CHECK(cudaStreamDestroy(stream));
}

// The reduction every ZeRO bucket takes, on the expert-data-parallel group's NCCL communicator
// (one reduce per owner, grouped): each rank's chunk, in place, becomes the sum of that chunk over
// the ranks, for equal chunks and chunks one element apart alike. Small integers keep the sums
// exact in any order.
TEST(GpuGradientSync, ReduceScatterSumsEachOwnersChunkInPlace) {
  if (world_size() < 2) GTEST_SKIP() << "needs two ranks or more (mpirun -np 2)";
  if (gpu_count() < world_size()) GTEST_SKIP() << "skipped: no GPU for every rank";
  MOEUT_CUDA_CHECK(cudaSetDevice(world_rank()));
  const ProcessGroups host = mpi_process_groups(MPI_COMM_WORLD, 1);
  cudaStream_t stream;
  MOEUT_CUDA_CHECK(cudaStreamCreate(&stream));
  {
    const NcclProcessGroups groups = nccl_process_groups(host, stream);
    Communicator& comm = *groups.expert_data_parallel;
    const int P = comm.size(), me = comm.rank();
    auto value = [](int rank, int64_t i) { return float((rank + 1) * (i % 97)); };
    for (const int64_t length : {int64_t(4096) * P, int64_t(4096) * P + 1}) {
      std::vector<int64_t> chunks;
      for (int r = 0; r < P; ++r) chunks.push_back(length / P + (r < length % P ? 1 : 0));
      int64_t mine = 0;
      for (int r = 0; r < me; ++r) mine += chunks[size_t(r)];
      std::vector<float> data(static_cast<size_t>(length));
      for (int64_t i = 0; i < length; ++i) data[size_t(i)] = value(me, i);
      cuda::DeviceBuffer<float> d(data);
      comm.reduce_scatter_sum(std::span<const float>(d.get(), size_t(length)),
                              std::span<float>(d.get() + mine, size_t(chunks[size_t(me)])), chunks);
      MOEUT_CUDA_CHECK(cudaStreamSynchronize(stream));
      const std::vector<float> out = d.download();
      int64_t wrong = 0;
      for (int64_t i = mine; i < mine + chunks[size_t(me)]; ++i) {
        float want = 0.f;
        for (int r = 0; r < P; ++r) want += value(r, i);
        wrong += out[size_t(i)] != want;
      }
      EXPECT_EQ(wrong, 0) << "elements of rank " << me << "'s chunk not the sum, bucket of " << length;
    }
  }
  MOEUT_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace moeut
