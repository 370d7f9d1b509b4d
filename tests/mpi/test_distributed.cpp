// Multi-rank behaviour, run under `mpirun -np N` with --ep=E (tests/CMakeLists.txt): training
// over N ranks with expert parallelism E equals the single-process run; the all-to-all
// dispatcher equals local dispatch with skewed routing and with ranks that send nothing; ZeRO-1
// optimizer state falls as 1/dp.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>

#include "core/rng.h"
#include "parallel/trainer.h"
#include "mpi/mpi_test.h"
#include "parallel/all_gather_dispatcher.h"
#include "parallel/all_to_all_dispatcher.h"
#include "parallel/mpi_communicator.h"
#include "parallel/run_errors.h"
#include "parallel/sharded_optimizer.h"

namespace moeut {
namespace {

std::string temp_file(const std::string& name) {
  // Per layout and rank: ctest may run several layouts at once.
  return (std::filesystem::path(testing::TempDir()) / ("moeut_mpi_np" + std::to_string(world_size()) + "_ep" +
                                                        std::to_string(g_ep) + "_r" + std::to_string(world_rank()) +
                                                        "_" + name))
      .string();
}

Config small_run() {
  return mpi_small_run(10, temp_file("train.bin"), temp_file("val.bin"), temp_file("metrics.jsonl"));
}

double relative(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-30); }

class Distributed : public ::testing::TestWithParam<const char*> {};

TEST_P(Distributed, TrainingEqualsTheSingleProcessRun) {
  Config c = small_run();
  c.train.dispatcher = GetParam();
  const ProcessGroups single = ProcessGroups::single();
  Trainer reference(c, single);
  const double ref_val = reference.run();
  const std::vector<float> ref_params = reference.full_parameters();

  c.train.ep = g_ep;
  const ProcessGroups groups = mpi_process_groups(MPI_COMM_WORLD, g_ep);
  Trainer trainer(c, groups);
  const double val = trainer.run();
  const std::vector<float> params = trainer.full_parameters();

  ASSERT_EQ(trainer.losses().size(), reference.losses().size());
  for (size_t s = 0; s < trainer.losses().size(); ++s)
    EXPECT_LE(relative(trainer.losses()[s], reference.losses()[s]), 1e-5) << "step " << s + 1;
  EXPECT_LE(relative(val, ref_val), 1e-5);
  double worst_loss = 0, worst_param = 0;
  for (size_t s = 0; s < trainer.losses().size(); ++s)
    worst_loss = std::max(worst_loss, relative(trainer.losses()[s], reference.losses()[s]));
  const ParamLayout layout(c.model);
  for (const TensorSpec& t : layout.tensors()) {
    double diff = 0, norm = 0;
    for (int64_t i = t.offset; i < t.offset + t.numel; ++i) {
      diff += double(params[i] - ref_params[i]) * (params[i] - ref_params[i]);
      norm += double(ref_params[i]) * ref_params[i];
    }
    EXPECT_LE(std::sqrt(diff / norm), 1e-5) << t.name;
    worst_param = std::max(worst_param, std::sqrt(diff / norm));
  }
  if (world_rank() == 0)
    std::printf("np %d ep %d %s: largest relative difference to one process: loss %.2e, parameter tensor %.2e\n",
                world_size(), g_ep, GetParam(), worst_loss, worst_param);
}

INSTANTIATE_TEST_SUITE_P(Dispatchers, Distributed, ::testing::Values("all_to_all", "all_gather"));

// Each rank routes its own tokens through the all-to-all dispatcher holding a shard of the
// experts; the reference runs the same tokens through a local dispatcher holding all of them.
void check_dispatch(const char* strategy, int64_t n_tokens, const std::function<int32_t(int64_t t, int64_t j)>& route) {
  SCOPED_TRACE(strategy);
  const ProcessGroups groups = mpi_process_groups(MPI_COMM_WORLD, g_ep);
  Communicator& ep = *groups.expert_parallel;
  const int64_t E = 10, k = 3, d = 6, es = 4;
  const ExpertShard shard = expert_shard(E, ep.size(), ep.rank());
  Rng rng(42);  // the same full expert weights on every rank
  std::vector<float> keys(E * d * es), values(E * es * d);
  for (auto& v : keys) v = float(rng.normal());
  for (auto& v : values) v = float(rng.normal());
  Rng mine(1000 + uint64_t(ep.rank()));
  std::vector<float> x(n_tokens * d), w(n_tokens * k), dy(n_tokens * d);
  std::vector<int32_t> I(n_tokens * k);
  for (auto& v : x) v = float(mine.normal());
  for (auto& v : dy) v = float(mine.normal());
  for (auto& v : w) v = float(mine.uniform());
  for (int64_t t = 0; t < n_tokens; ++t)
    for (int64_t j = 0; j < k; ++j) I[t * k + j] = route(t, j);

  std::vector<float> dkeys_ref(keys.size(), 0.f), dvalues_ref(values.size(), 0.f);
  LocalDispatcher<float> local(E);
  const ExpertParams<float> full{keys.data(), values.data(), dkeys_ref.data(), dvalues_ref.data(), d, es};
  std::vector<float> y_ref(x.size(), 0.f), dx_ref(x.size(), 0.f), dw_ref(w.size(), 0.f);
  local.forward(0, x.data(), I.data(), w.data(), n_tokens, k, full, y_ref.data());
  local.backward(0, dy.data(), dx_ref.data(), dw_ref.data(), full);
  // Expert gradients sum over every rank's tokens.
  ep.all_reduce_sum(std::span<float>(dkeys_ref));
  ep.all_reduce_sum(std::span<float>(dvalues_ref));

  std::vector<float> my_keys(keys.begin() + shard.begin * d * es, keys.begin() + (shard.begin + shard.count) * d * es);
  std::vector<float> my_values(values.begin() + shard.begin * es * d,
                               values.begin() + (shard.begin + shard.count) * es * d);
  std::vector<float> dkeys(my_keys.size(), 0.f), dvalues(my_values.size(), 0.f);
  const ExpertParams<float> part{my_keys.data(), my_values.data(), dkeys.data(), dvalues.data(), d, es};
  std::unique_ptr<TokenDispatcher<float>> dispatcher;
  if (std::string(strategy) == "all_gather") dispatcher = std::make_unique<AllGatherDispatcher>(ep, E);
  else dispatcher = std::make_unique<AllToAllDispatcher>(ep, E);
  std::vector<float> y(x.size(), 0.f), dx(x.size(), 0.f), dw(w.size(), 0.f);
  dispatcher->forward(0, x.data(), I.data(), w.data(), n_tokens, k, part, y.data());
  dispatcher->backward(0, dy.data(), dx.data(), dw.data(), part);

  for (size_t i = 0; i < y.size(); ++i) ASSERT_NEAR(y[i], y_ref[i], 1e-5f * (1 + std::abs(y_ref[i]))) << i;
  for (size_t i = 0; i < dx.size(); ++i) ASSERT_NEAR(dx[i], dx_ref[i], 1e-5f * (1 + std::abs(dx_ref[i]))) << i;
  for (size_t i = 0; i < dw.size(); ++i) ASSERT_NEAR(dw[i], dw_ref[i], 1e-5f * (1 + std::abs(dw_ref[i]))) << i;
  for (size_t i = 0; i < dkeys.size(); ++i)
    ASSERT_NEAR(dkeys[i], dkeys_ref[shard.begin * d * es + i], 1e-4f * (1 + std::abs(dkeys_ref[shard.begin * d * es + i])));
  for (size_t i = 0; i < dvalues.size(); ++i)
    ASSERT_NEAR(dvalues[i], dvalues_ref[shard.begin * es * d + i], 1e-4f * (1 + std::abs(dvalues_ref[shard.begin * es * d + i])));
}

class Dispatcher : public ::testing::TestWithParam<const char*> {};

TEST_P(Dispatcher, UniformRoutingMatchesLocalDispatch) {
  check_dispatch(GetParam(), 37, [](int64_t t, int64_t j) { return int32_t((t * 7 + j * 3) % 10); });
}

TEST_P(Dispatcher, SkewedRoutingToTheExpertsOfOneRankMatchesLocalDispatch) {
  // Experts 0..2 belong to expert-parallel rank 0 whatever the group size: every other rank
  // receives no tokens, and its experts none (their gradients must stay zero).
  check_dispatch(GetParam(), 29, [](int64_t t, int64_t j) { return int32_t((t + j) % 3); });
}

TEST_P(Dispatcher, ARankWithNoTokensStillTakesPart) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  check_dispatch(GetParam(), rank % 2 == 1 ? 0 : 23, [](int64_t t, int64_t j) { return int32_t((t * 5 + j * 4) % 10); });
}

INSTANTIATE_TEST_SUITE_P(Strategies, Dispatcher, ::testing::Values("all_to_all", "all_gather"));

TEST(ShardedOptimizer, StateFallsAsOneOverTheDataParallelDegree) {
  // Groups of 1, 2, ... ranks carved out of the world: the moments each rank keeps shrink in
  // proportion.
  Config c = small_run();
  const ParamLayout layout(c.model);
  const int64_t full_bytes = 2 * layout.total() * int64_t(sizeof(float));
  for (int dp = 1; dp <= world_size(); dp *= 2) {
    MPI_Comm sub;
    MPI_Comm_split(MPI_COMM_WORLD, world_rank() / dp, world_rank(), &sub);
    const ProcessGroups groups = mpi_process_groups(sub, 1);
    MPI_Comm_free(&sub);
    ShardedAdamW opt(layout, groups, 1000);
    const double expected = double(full_bytes) / dp;
    EXPECT_NEAR(double(opt.state_bytes()), expected, 0.01 * expected) << "dp " << dp;
    if (world_rank() == 0)
      std::printf("dp %d: optimizer state %lld bytes per rank (%.3f of one process)\n", dp,
                  (long long)opt.state_bytes(), double(opt.state_bytes()) / double(full_bytes));
  }
}

TEST(ProcessGroups, NodePlaceIsTheRanksOfThisMachineInWorldOrder) {
  // mpirun starts every rank on this machine: each rank's place is its world rank among all. A
  // group carved out of the world counts the machine's ranks of that group alone.
  const ProcessGroups groups = mpi_process_groups(MPI_COMM_WORLD, g_ep);
  EXPECT_EQ(groups.node.rank, world_rank());
  EXPECT_EQ(groups.node.ranks, world_size());
  EXPECT_EQ(groups.node.first, 0);
  MPI_Comm pair;
  ASSERT_EQ(MPI_Comm_split(MPI_COMM_WORLD, world_rank() / 2, world_rank(), &pair), MPI_SUCCESS);
  const ProcessGroups in_pair = mpi_process_groups(pair, 1);
  MPI_Comm_free(&pair);
  EXPECT_EQ(in_pair.node.rank, world_rank() % 2);
  EXPECT_EQ(in_pair.node.ranks, std::min(2, world_size()));
  EXPECT_EQ(in_pair.node.first, 0);
}

TEST(ProcessGroups, ExpertGroupsWithinMachinesWhenTheirRanksShareOne) {
  // Every rank on this machine: every group lies within it. Each rank made a machine of its own:
  // a group of two ranks or more spans machines, on every rank's answer.
  ProcessGroups groups = mpi_process_groups(MPI_COMM_WORLD, g_ep);
  EXPECT_TRUE(groups.expert_groups_within_machines());
  groups.node.first = world_rank();
  EXPECT_EQ(groups.expert_groups_within_machines(), g_ep == 1);
}

TEST(ShardedOptimizer, TensorGradientNormsSumOverTheRanksToTheGlobalNorm) {
  // Every rank adds the same gradient, so the summed one is world_size() times it. Buckets of
  // 1000 elements cut tensors across buckets and ranks: each tensor's pieces, summed over the
  // ranks, give its norm, and the tensors' norms the global one that step() returns.
  Config c = small_run();
  const ParamLayout layout(c.model);
  const ProcessGroups groups = mpi_process_groups(MPI_COMM_WORLD, 1);
  ShardedAdamW opt(layout, groups, 1000);
  std::vector<float> params(size_t(layout.total()), 0.f), grads(size_t(layout.total()));
  for (size_t i = 0; i < grads.size(); ++i) grads[i] = float(int64_t(i % 17) - 8) / 8.f;
  const std::vector<float> local = grads;
  const double norm = opt.step(params, grads, 1e-3, c.train);
  std::vector<double> sums = opt.tensor_square_sums(layout);
  groups.world->all_reduce_sum(std::span<double>(sums));
  double total = 0;
  for (size_t t = 0; t < layout.tensors().size(); ++t) {
    const TensorSpec& spec = layout.tensors()[t];
    double expected = 0;
    for (int64_t i = spec.offset; i < spec.offset + spec.numel; ++i)
      expected += double(local[size_t(i)]) * local[size_t(i)] * world_size() * world_size();
    EXPECT_NEAR(sums[t], expected, 1e-9 * expected + 1e-12) << spec.name;
    total += sums[t];
  }
  EXPECT_NEAR(std::sqrt(total), norm, 1e-9 * norm);
}

// A data error on the last rank alone ends every rank together (no rank left in a collective),
// with its status, reported once by that rank and naming it when others did not fail.
TEST(RunErrors, AnErrorOnOneRankEndsEveryRankReportedOnce) {
  const ProcessGroups groups = mpi_process_groups(MPI_COMM_WORLD, g_ep);
  const int last = world_size() - 1;
  try {
    agree_on(*groups.world, [&] {
      if (world_rank() == last) throw DataError("x.bin: token out of vocabulary");
    });
    ADD_FAILURE() << "no error after one rank failed";
  } catch (const AgreedError& e) {
    EXPECT_EQ(e.status, kExitDataError);
    EXPECT_EQ(e.report, world_rank() == last);
    if (e.report) {
      EXPECT_EQ(std::string(e.what()),
                (world_size() > 1 ? "rank " + std::to_string(last) + ": " : std::string()) + "x.bin: token out of vocabulary");
    }
  }
  agree_on(*groups.world, [] {});  // nothing failed: returns on every rank
}

}  // namespace
}  // namespace moeut
