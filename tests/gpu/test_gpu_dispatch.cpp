// The GPU expert dispatchers between GPU ranks over NCCL (run under mpirun, one GPU per rank),
// all-to-all and all-gather, against a host computation: each receiving rank plays "experts" whose output for a row is
// Σ_j w_j · (global expert id + 1) · row over the slots that are its own, so the sender's
// combined result tells whether every row went to the right ranks with the right local ids and
// weights and came back to the right token. Uniform routing, routing skewed onto rank 0's
// experts (the other ranks receive nothing from the all-to-all), and a rank with no tokens; the
// backward pass too; and a dispatch of more tokens than planned, refused.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>

#include "gpu_test.h"
#include "mpi/mpi_test.h"
#include "core/params.h"
#include "parallel/gpu_all_gather_dispatcher.h"
#include "parallel/gpu_all_to_all_dispatcher.h"
#include "parallel/mpi_communicator.h"
#include "parallel/nccl_communicator.h"

namespace moeut {
namespace {

using namespace gpu_test;
using cuda::DeviceBuffer;

enum class Routing { kUniform, kSkewed, kRankOneEmpty };

// The dispatcher under test and its bound on the combined results' relative error: the
// all-gather one returns partial sums in bf16 (2^-9 of a partial), the all-to-all one in fp32.
struct Exchange {
  bool all_gather;
  double bound;
};
constexpr Exchange kAllToAll{.all_gather = false, .bound = 1e-6}, kAllGather{.all_gather = true, .bound = 4e-3};

std::unique_ptr<GpuTokenDispatcher> make_dispatcher(Exchange x, Communicator& group, int64_t E, int64_t max_tokens,
                                                    int64_t d, int64_t k, cudaStream_t stream) {
  if (x.all_gather) return std::make_unique<GpuAllGatherDispatcher>(group, E, max_tokens, d, k, stream);
  return std::make_unique<GpuAllToAllDispatcher>(group, E, max_tokens, d, k, stream);
}

// The test's "experts" over `rows` rows x / dy of width d with k slots each (global expert ids,
// -1 for a slot that is not computed here): outputs Σ_j w_j·(e_j + 1)·x, input gradients
// Σ_j w_j·(e_j + 1)·dy, routing-weight gradients (e_j + 1)·Σ dy.
struct Played {
  std::vector<float> y, dx, dw;
};
Played play_experts(int64_t rows, int64_t d, int64_t k, const std::vector<int32_t>& experts,
                    const std::vector<float>& weight, const std::vector<float>& x, const std::vector<float>& dy) {
  Played p{std::vector<float>(x.size(), 0.f), std::vector<float>(x.size(), 0.f),
           std::vector<float>(weight.size(), 0.f)};
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t j = 0; j < k; ++j) {
      if (experts[m * k + j] < 0) continue;
      const float scale = float(experts[m * k + j] + 1), w = weight[m * k + j];
      float dy_sum = 0.f;
      for (int64_t c = 0; c < d; ++c) {
        p.y[m * d + c] += w * scale * x[m * d + c];
        p.dx[m * d + c] += w * scale * dy[m * d + c];
        dy_sum += dy[m * d + c];
      }
      p.dw[m * k + j] = scale * dy_sum;
    }
  return p;
}

// n elements at a device pointer, after the work queued on `stream`.
template <typename T>
std::vector<T> download(const T* p, int64_t n, cudaStream_t stream) {
  std::vector<T> v(static_cast<size_t>(n));
  MOEUT_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (n > 0) MOEUT_CUDA_CHECK(cudaMemcpy(v.data(), p, size_t(n) * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

// Overwrites what the dispatcher gave the experts with v (their result), in stream order.
void upload(float* p, const std::vector<float>& v, cudaStream_t stream) {
  if (v.empty()) return;
  MOEUT_CUDA_CHECK(cudaMemcpyAsync(p, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice, stream));
  MOEUT_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void check_dispatch(Routing routing, Exchange exchange) {
  if (gpu_count() < world_size()) GTEST_SKIP() << "skipped: no GPU for every rank";
  MOEUT_CUDA_CHECK(cudaSetDevice(world_rank()));
  const int ranks = world_size(), me = world_rank();
  const int64_t E = 13, k = 3, d = 16;  // 13 experts: uneven over 2 or 4 ranks, rank 0 holding k or more
  const int64_t N = routing == Routing::kRankOneEmpty && me == 1 ? 0 : 50 + 13 * me;
  const int64_t max_tokens = 50 + 13 * (ranks - 1);  // the last rank's N: every rank's fits the plan
  const ProcessGroups host = mpi_process_groups(MPI_COMM_WORLD, ranks);
  cudaStream_t stream;
  MOEUT_CUDA_CHECK(cudaStreamCreate(&stream));
  {
    const NcclProcessGroups device = nccl_process_groups(host, stream);
    const std::unique_ptr<GpuTokenDispatcher> made =
        make_dispatcher(exchange, *device.expert_parallel, E, max_tokens, d, k, stream);
    GpuTokenDispatcher& dispatcher = *made;
    const ExpertShard shard0 = expert_shard(E, ranks, 0), mine = expert_shard(E, ranks, me);
    Rng rng(uint64_t(17 + me));
    std::vector<int32_t> index(size_t(N * k));
    std::vector<float> weight(size_t(N * k));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < k; ++j) {
        // Distinct experts per token; skewed routing picks only rank 0's (3 or more of them).
        const int64_t pool = routing == Routing::kSkewed ? shard0.count : E;
        index[n * k + j] = int32_t((n + j) % pool);
        weight[n * k + j] = float(rng.uniform());
      }
    const auto x = random_bf16_values(size_t(N * d), rng, 1.0), dy = random_bf16_values(size_t(N * d), rng, 1.0);
    const DeviceBuffer<bf16> gx(to_bf16(x)), gdy(to_bf16(dy));
    const DeviceBuffer<int32_t> gindex(index);
    const DeviceBuffer<float> gweight(weight);
    const std::unique_ptr<GpuTokenDispatcher::Route> route = dispatcher.make_route();
    DeviceBuffer<float> out(std::vector<float>(size_t(N * d), 0.f)), dx(std::vector<float>(size_t(N * d), 0.f));
    DeviceBuffer<float> dw(std::vector<float>(size_t(N * k), 0.f));
    const GpuTokenDispatcher::Rows rows = dispatcher.dispatch(
        *route, {.x = gx.get(), .index = gindex.get(), .weight = gweight.get(), .rows = N, .out = out.get()});
    const int64_t received = rows.rows;
    dispatcher.await(*route);
    if (routing == Routing::kSkewed && me != 0 && !exchange.all_gather) {
      EXPECT_EQ(received, 0) << "rank " << me << " holds none of the chosen experts";
    }
    const auto rx = to_float(download(rows.x, received * d, stream));
    std::vector<int32_t> rexperts = download(rows.index, received * k, stream);  // local ids, then global ones
    const std::vector<float> rweight = download(rows.weight, received * k, stream);
    EXPECT_EQ(download(rows.out, received * d, stream), std::vector<float>(size_t(received * d), 0.f))
        << "rank " << me << ": the experts' outputs start at zero";
    for (int64_t i = 0; i < received * k; ++i) {
      if (rexperts[i] < 0) continue;
      ASSERT_LT(rexperts[i], mine.count);
      rexperts[i] += int32_t(mine.begin);
    }
    // This rank's "experts" over what it received, forward (their outputs added into rows.out),
    // then backward.
    const std::vector<float> no_dy(size_t(received * d), 0.f);
    upload(rows.out, play_experts(received, d, k, rexperts, rweight, rx, no_dy).y, stream);
    dispatcher.combine(*route);
    const GpuTokenDispatcher::GradRows grads =
        dispatcher.dispatch_grad(*route, {.dy = gdy.get(), .dx = dx.get(), .dw = dw.get()});
    dispatcher.await(*route);
    const auto rdy = to_float(download(grads.dy, received * d, stream));
    EXPECT_EQ(download(grads.dx, received * d, stream), std::vector<float>(size_t(received * d), 0.f))
        << "rank " << me << ": the experts' input gradients start at zero";
    EXPECT_EQ(download(grads.dw, received * k, stream), std::vector<float>(size_t(received * k), 0.f))
        << "rank " << me << ": the experts' routing-weight gradients start at zero";
    const Played here = play_experts(received, d, k, rexperts, rweight, rx, rdy);
    upload(grads.dx, here.dx, stream);
    upload(grads.dw, here.dw, stream);
    dispatcher.combine_grad(*route);
    MOEUT_CUDA_CHECK(cudaStreamSynchronize(stream));

    const Played want = play_experts(N, d, k, index, weight, x, dy);
    if (N > 0) {
      EXPECT_LE(rel_error(out.download(), want.y), exchange.bound) << "rank " << me << ": combined outputs";
      EXPECT_LE(rel_error(dx.download(), want.dx), exchange.bound) << "rank " << me << ": input gradients";
      EXPECT_LE(rel_error(dw.download(), want.dw), 1e-6) << "rank " << me << ": routing-weight gradients";
    }
  }
  MOEUT_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(GpuDispatch, UniformRouting) { check_dispatch(Routing::kUniform, kAllToAll); }
TEST(GpuDispatch, EveryTokenToRankZerosExperts) { check_dispatch(Routing::kSkewed, kAllToAll); }
TEST(GpuDispatch, ARankWithNoTokensStillTakesPart) { check_dispatch(Routing::kRankOneEmpty, kAllToAll); }
TEST(GpuDispatch, AllGatherUniformRouting) { check_dispatch(Routing::kUniform, kAllGather); }
TEST(GpuDispatch, AllGatherEveryTokenToRankZerosExperts) { check_dispatch(Routing::kSkewed, kAllGather); }
TEST(GpuDispatch, AllGatherARankWithNoTokensStillTakesPart) { check_dispatch(Routing::kRankOneEmpty, kAllGather); }

// More tokens than the dispatcher was planned for: refused before anything is exchanged, on
// every rank alike (each is given too many), and the dispatcher still works after. Gathered
// rows combined before they were awaited are refused too.
TEST(GpuDispatch, MoreTokensThanPlannedAreRefused) {
  if (gpu_count() < world_size()) GTEST_SKIP() << "skipped: no GPU for every rank";
  MOEUT_CUDA_CHECK(cudaSetDevice(world_rank()));
  const ProcessGroups host = mpi_process_groups(MPI_COMM_WORLD, world_size());
  cudaStream_t stream;
  MOEUT_CUDA_CHECK(cudaStreamCreate(&stream));
  {
    const NcclProcessGroups device = nccl_process_groups(host, stream);
    for (Exchange x : {kAllToAll, kAllGather}) {
      const std::unique_ptr<GpuTokenDispatcher> dispatcher =
          make_dispatcher(x, *device.expert_parallel, 7, 8, 16, 3, stream);
      const std::unique_ptr<GpuTokenDispatcher::Route> route = dispatcher->make_route();
      const DeviceBuffer<bf16> rows(size_t(9 * 16));
      const DeviceBuffer<int32_t> index(std::vector<int32_t>(9 * 3, 0));
      const DeviceBuffer<float> weight(size_t(9 * 3)), out(size_t(9 * 16));
      const GpuTokenDispatcher::Rows nine{.x = rows.get(), .index = index.get(), .weight = weight.get(), .rows = 9,
                                          .out = out.get()};
      try {
        dispatcher->dispatch(*route, nine);
        ADD_FAILURE() << (x.all_gather ? "all-gather" : "all-to-all") << ": 9 tokens dispatched, 8 planned";
      } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("9 tokens, planned for 8"), std::string::npos) << e.what();
      }
      GpuTokenDispatcher::Rows eight = nine;
      eight.rows = 8;
      EXPECT_NO_THROW(dispatcher->dispatch(*route, eight));
      if (x.all_gather) {  // the rows still arriving: combining them is a caller's error
        EXPECT_THROW(dispatcher->combine(*route), std::logic_error);
      }
      dispatcher->await(*route);
      dispatcher->combine(*route);
      MOEUT_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
  }
  MOEUT_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace moeut
