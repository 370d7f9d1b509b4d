// GpuModel's expert dispatchers (core/gpu_token_dispatcher.h) compute the same model: the same
// parameters and batches run through LocalGpuDispatcher (every expert here, nothing moves) and
// through GpuAllToAllDispatcher and GpuAllGatherDispatcher over an NCCL group of one rank (each
// row sent to itself and back), and give the same losses, gradients and expert rows; each MPI
// rank runs that comparison on its own GPU and its own group of one. Across the ranks (under
// mpirun -np 2 or more), with the experts sharded over them, the all-gather dispatcher gives the
// all-to-all's losses and gradients, its passes captured as CUDA graphs.
#include <gtest/gtest.h>

#include "core/gpu_model.h"
#include "gpu_model_test.h"
#include "gpu_test.h"
#include "mpi/mpi_test.h"
#include "parallel/gpu_all_gather_dispatcher.h"
#include "parallel/gpu_all_to_all_dispatcher.h"
#include "parallel/mpi_communicator.h"
#include "parallel/nccl_communicator.h"

namespace moeut {
namespace {

// A factory of GpuDispatcher D over `exchange`, for cfg's FFN layers.
template <class D>
GpuDispatcherFactory factory(Communicator& exchange, const ModelConfig& cfg) {
  return [&exchange, cfg](int64_t max_tokens, cudaStream_t s) {
    return std::make_unique<D>(exchange, cfg.ff_n_experts, max_tokens, cfg.d_model, cfg.ff_k, s);
  };
}

// Bounds: see gpu_test::expect_same_steps.
template <class D>
void expect_local_results(const char* name, bool graphs) {
  if (gpu_count() < world_size()) GTEST_SKIP() << "skipped: no GPU for every rank";
  MOEUT_CUDA_CHECK(cudaSetDevice(world_rank()));
  const ModelConfig cfg = gpu_test::small_config(true);  // no routing choice can flip
  const int64_t B = 4;
  const ProcessGroups alone = mpi_process_groups(MPI_COMM_WORLD, 1);  // expert-parallel groups of one rank
  cudaStream_t stream;
  MOEUT_CUDA_CHECK(cudaStreamCreate(&stream));
  {
    NcclCommunicator exchange(*alone.expert_parallel, stream);
    GpuModel local(cfg, B);
    GpuModel exchanged(cfg, B, expert_shard(cfg.ff_n_experts, 1, 0), factory<D>(exchange, cfg), stream);
    EXPECT_TRUE(local.graphs());
    EXPECT_EQ(exchanged.graphs(), graphs) << name << ": passes captured as CUDA graphs";
    EXPECT_EQ(local.ledger().bytes(DeviceLedger::Kind::kExchange), 0);
    EXPECT_GT(exchanged.ledger().bytes(DeviceLedger::Kind::kExchange), 0);
    const std::vector<float> initial = gpu_test::initial_parameters(cfg, local.layout(), uint64_t(11 + world_rank()));
    local.set_parameters(initial);
    exchanged.set_parameters(initial);
    Rng rng{uint64_t(23 + world_rank())};
    // Training and loss passes run eagerly, are captured, then replayed (see
    // GpuModel::set_graphs); evaluations run eagerly between them.
    gpu_test::expect_same_steps(local, "local", exchanged, name, B, 3, rng);
    // Every token row of a training pass reached the experts once per layer (an evaluation's
    // rows are not counted); none left the rank.
    EXPECT_EQ(local.expert_rows_received(), 3 * 2 * cfg.n_layers * B * cfg.context);
    EXPECT_EQ(exchanged.expert_rows_received(), local.expert_rows_received());
    EXPECT_EQ(local.dispatch_bytes(), 0);
    EXPECT_EQ(exchanged.dispatch_bytes(), 0);
  }
  MOEUT_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(GpuModelDispatchers, AllToAllOnOneRankMatchesLocalDispatch) {
  expect_local_results<GpuAllToAllDispatcher>("all-to-all", false);  // it waits on the host for counts
}

TEST(GpuModelDispatchers, AllGatherOnOneRankMatchesLocalDispatch) {
  expect_local_results<GpuAllGatherDispatcher>("all-gather", true);
}

// The world's ranks as one expert-parallel group, each holding a shard: the all-gather
// dispatcher's partial sums travel in bf16 (the all-to-all's in fp32), which the losses see at
// about 2^-9 of a partial: their bound here is 1e-3 relative, the gradients' 1e-2 as elsewhere.
TEST(GpuModelDispatchers, AllGatherAcrossRanksMatchesAllToAll) {
  if (world_size() < 2) GTEST_SKIP() << "skipped: needs mpirun -np 2 or more";
  if (gpu_count() < world_size()) GTEST_SKIP() << "skipped: no GPU for every rank";
  MOEUT_CUDA_CHECK(cudaSetDevice(world_rank()));
  const ModelConfig cfg = gpu_test::small_config(true);
  const int64_t B = 4;
  const ProcessGroups group = mpi_process_groups(MPI_COMM_WORLD, world_size());  // ep = world
  const ExpertShard shard = expert_shard(cfg.ff_n_experts, world_size(), world_rank());
  cudaStream_t stream;
  MOEUT_CUDA_CHECK(cudaStreamCreate(&stream));
  {
    NcclCommunicator to_all(*group.expert_parallel, stream), gathered(*group.expert_parallel, stream);
    GpuModel a(cfg, B, shard, factory<GpuAllToAllDispatcher>(to_all, cfg), stream);
    GpuModel b(cfg, B, shard, factory<GpuAllGatherDispatcher>(gathered, cfg), stream);
    EXPECT_TRUE(b.graphs());
    const std::vector<float> initial = gpu_test::initial_parameters(cfg, a.layout(), 11);
    a.set_parameters(initial);
    b.set_parameters(initial);
    Rng rng{uint64_t(23 + world_rank())};
    gpu_test::expect_same_steps(a, "all-to-all", b, "all-gather", B, 3, rng, 1e-3);
    EXPECT_EQ(b.expert_rows_received(), 3 * 2 * cfg.n_layers * world_size() * B * cfg.context);
    // Every row (of the planned B) to every other rank, a layer: forward, its bf16 row with k ids
    // and weights, and its bf16 partial back; backward, the bf16 output gradient, and the input
    // gradient's bf16 partial with k fp32 routing-weight gradients back. Three steps of two
    // training passes, a loss pass and an evaluation (replayed passes counted as captured).
    const int64_t rows = B * cfg.context * (world_size() - 1), d = cfg.d_model, k = cfg.ff_k;
    const int64_t forward = rows * ((2 * d + 8 * k) + 2 * d), backward = rows * (2 * d + (2 * d + 4 * k));
    EXPECT_EQ(b.dispatch_bytes(), 3 * cfg.n_layers * (2 * (forward + backward) + 2 * forward));
    EXPECT_GT(a.dispatch_bytes(), 0);
  }
  MOEUT_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace moeut
