// GpuModel's two expert dispatchers (core/gpu_token_dispatcher.h) compute the same model: the
// same parameters and batches run through LocalGpuDispatcher (every expert here, nothing moves)
// and through GpuAllToAllDispatcher over an NCCL group of one rank (each row sent to itself and
// back), and give the same losses, gradients and expert rows. Each MPI rank runs the comparison
// on its own GPU and its own group of one.
#include <gtest/gtest.h>

#include "core/gpu_model.h"
#include "core/model.h"
#include "gpu_model_test.h"
#include "gpu_test.h"
#include "mpi/mpi_test.h"
#include "parallel/gpu_all_to_all_dispatcher.h"
#include "parallel/mpi_communicator.h"
#include "parallel/nccl_communicator.h"

namespace moeut {
namespace {

int devices() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

// Bounds: see gpu_test::expect_same_steps.
TEST(GpuModelDispatchers, AllToAllOnOneRankMatchesLocalDispatch) {
  if (devices() < world_size()) GTEST_SKIP() << "skipped: no GPU for every rank";
  MOEUT_CUDA_CHECK(cudaSetDevice(world_rank()));
  const ModelConfig cfg = gpu_test::small_config(true);  // no routing choice can flip
  const int64_t B = 4;
  const ProcessGroups alone = mpi_process_groups(MPI_COMM_WORLD, 1);  // expert-parallel groups of one rank
  cudaStream_t stream;
  MOEUT_CUDA_CHECK(cudaStreamCreate(&stream));
  {
    NcclCommunicator exchange(*alone.expert_parallel, stream);
    const GpuDispatcherFactory all_to_all = [&](int64_t max_tokens, cudaStream_t s) {
      return std::make_unique<GpuAllToAllDispatcher>(exchange, cfg.ff_n_experts, max_tokens, cfg.d_model, cfg.ff_k, s);
    };
    GpuModel local(cfg, B);
    GpuModel exchanged(cfg, B, expert_shard(cfg.ff_n_experts, 1, 0), all_to_all, stream);
    EXPECT_TRUE(local.graphs());
    EXPECT_FALSE(exchanged.graphs()) << "the all-to-all dispatcher waits on the host";
    EXPECT_EQ(local.ledger().bytes(DeviceLedger::Kind::kExchange), 0);
    EXPECT_GT(exchanged.ledger().bytes(DeviceLedger::Kind::kExchange), 0);
    Model<float> init(cfg);
    init.init(uint64_t(11 + world_rank()));
    local.set_parameters(init.params);
    exchanged.set_parameters(init.params);
    Rng rng{uint64_t(23 + world_rank())};
    // The local model's training and loss passes run eagerly, are captured, then replayed (see
    // GpuModel::set_graphs); its evaluations run eagerly between them.
    gpu_test::expect_same_steps(local, "local", exchanged, "all-to-all", B, 3, rng);
    // Every token row of a training pass reached the experts once per layer (an evaluation's
    // rows are not counted); none left the rank.
    EXPECT_EQ(local.expert_rows_received(), 3 * 2 * cfg.n_layers * B * cfg.context);
    EXPECT_EQ(exchanged.expert_rows_received(), local.expert_rows_received());
    EXPECT_EQ(local.dispatch_bytes(), 0);
    EXPECT_EQ(exchanged.dispatch_bytes(), 0);
  }
  MOEUT_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace moeut
