#include "parallel/nccl_communicator.h"

#include <algorithm>
#include <array>
#include <cstring>

#include "kernels/cuda_check.h"

namespace moeut {

NcclCommunicator::NcclCommunicator(Communicator& host, cudaStream_t caller) : host_(host), caller_(caller) {
  // Rank 0's unique id to every rank of the group: an all-gather in which rank 0 alone holds data.
  static_assert(sizeof(ncclUniqueId) % sizeof(int32_t) == 0, "the unique id travels as int32 words");
  ncclUniqueId id{};
  std::array<int32_t, sizeof id / sizeof(int32_t)> words{};
  if (rank() == 0) {
    check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    std::memcpy(words.data(), &id, sizeof id);
  }
  std::vector<int64_t> counts(size_t(size()), 0);
  counts[0] = int64_t(words.size());
  host_.all_gather_v(std::span<int32_t>(words), counts);
  std::memcpy(&id, words.data(), sizeof id);
  check(ncclCommInitRank(&comm_, size(), id, rank()), "ncclCommInitRank");
  MOEUT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  MOEUT_CUDA_CHECK(cudaEventCreateWithFlags(&queued_, cudaEventDisableTiming));
  MOEUT_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
}

NcclCommunicator::~NcclCommunicator() {
  for (auto* list : {&timed_, &spare_})
    for (auto [start, end] : *list) {
      cudaEventDestroy(start);
      cudaEventDestroy(end);
    }
  if (comm_) ncclCommDestroy(comm_);
  if (queued_) cudaEventDestroy(queued_);
  if (done_) cudaEventDestroy(done_);
  if (stream_) cudaStreamDestroy(stream_);
}

void NcclCommunicator::check(ncclResult_t rc, const char* op) const {
  if (rc == ncclSuccess || rc == ncclInProgress) return;
  std::string detail = ncclGetErrorString(rc);
  if (comm_) {
    const char* last = ncclGetLastError(comm_);
    if (last && *last) detail += std::string(": ") + last;
  }
  throw CommError(std::string(op) + " failed on rank " + std::to_string(rank()) + " of group '" + name() +
                  "' (size " + std::to_string(size()) + "): " + detail);
}

template <typename Enqueue>
void NcclCommunicator::run(const char* op, Enqueue&& enqueue) {
  MOEUT_CUDA_CHECK(cudaEventRecord(queued_, caller_));
  MOEUT_CUDA_CHECK(cudaStreamWaitEvent(stream_, queued_, 0));
  // A collective captured into a CUDA graph is not timed: its events would mark the capture, not
  // the replays.
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  MOEUT_CUDA_CHECK(cudaStreamIsCapturing(caller_, &capturing));
  const bool timed = capturing == cudaStreamCaptureStatusNone;
  if (timed) {
    if (spare_.empty()) {
      std::pair<cudaEvent_t, cudaEvent_t> pair;
      MOEUT_CUDA_CHECK(cudaEventCreate(&pair.first));
      MOEUT_CUDA_CHECK(cudaEventCreate(&pair.second));
      spare_.push_back(pair);
    }
    timed_.push_back(spare_.back());
    spare_.pop_back();
    MOEUT_CUDA_CHECK(cudaEventRecord(timed_.back().first, stream_));
  }
  check(ncclGroupStart(), op);
  enqueue();
  check(ncclGroupEnd(), op);
  if (timed) MOEUT_CUDA_CHECK(cudaEventRecord(timed_.back().second, stream_));
  if (!deferring_) join_deferred();
}

void NcclCommunicator::join_deferred() {
  deferring_ = false;
  MOEUT_CUDA_CHECK(cudaEventRecord(done_, stream_));
  MOEUT_CUDA_CHECK(cudaStreamWaitEvent(caller_, done_, 0));
}

double NcclCommunicator::take_seconds() {
  double seconds = 0;
  for (auto [start, end] : timed_) {
    MOEUT_CUDA_CHECK(cudaEventSynchronize(end));
    float ms = 0;
    MOEUT_CUDA_CHECK(cudaEventElapsedTime(&ms, start, end));
    seconds += ms / 1e3;
    spare_.push_back({start, end});
  }
  timed_.clear();
  return seconds;
}

void NcclCommunicator::all_reduce_sum(std::span<double> data) {
  run("ncclAllReduce(double)", [&] {
    check(ncclAllReduce(data.data(), data.data(), data.size(), ncclDouble, ncclSum, comm_, stream_), "ncclAllReduce");
  });
}

void NcclCommunicator::all_reduce_sum(std::span<float> data) {
  run("ncclAllReduce(float)", [&] {
    check(ncclAllReduce(data.data(), data.data(), data.size(), ncclFloat, ncclSum, comm_, stream_), "ncclAllReduce");
  });
}

void NcclCommunicator::all_to_all_v(const void* send, std::span<const int64_t> sc, void* recv,
                                    std::span<const int64_t> rc, ncclDataType_t type, size_t bytes, const char* op) {
  run(op, [&] {
    size_t soff = 0, roff = 0;
    for (int r = 0; r < size(); ++r) {
      if (sc[r] > 0) check(ncclSend(static_cast<const char*>(send) + soff * bytes, size_t(sc[r]), type, r, comm_, stream_), op);
      if (rc[r] > 0) check(ncclRecv(static_cast<char*>(recv) + roff * bytes, size_t(rc[r]), type, r, comm_, stream_), op);
      soff += size_t(sc[r]);
      roff += size_t(rc[r]);
    }
  });
}

void NcclCommunicator::all_to_all_v(const float* send, std::span<const int64_t> sc, float* recv,
                                    std::span<const int64_t> rc) {
  all_to_all_v(send, sc, recv, rc, ncclFloat, sizeof(float), "ncclSend/ncclRecv(float)");
}

void NcclCommunicator::all_to_all_v(const int32_t* send, std::span<const int64_t> sc, int32_t* recv,
                                    std::span<const int64_t> rc) {
  all_to_all_v(send, sc, recv, rc, ncclInt32, sizeof(int32_t), "ncclSend/ncclRecv(int32)");
}

void NcclCommunicator::all_to_all_v(const uint16_t* send, std::span<const int64_t> sc, uint16_t* recv,
                                    std::span<const int64_t> rc) {
  all_to_all_v(send, sc, recv, rc, ncclBfloat16, sizeof(uint16_t), "ncclSend/ncclRecv(bf16)");
}

// One reduce per owner, grouped into one launch: it serves chunks equal or one element apart (a
// range's last ZeRO bucket) alike, where ncclReduceScatter takes equal chunks only. `mine` may
// alias this rank's chunk.
void NcclCommunicator::reduce_scatter_sum(std::span<const float> data, std::span<float> mine,
                                          std::span<const int64_t> counts) {
  run("ncclReduce (reduce-scatter)", [&] {
    size_t off = 0;
    for (int r = 0; r < size(); ++r) {
      void* out = r == rank() ? static_cast<void*>(mine.data()) : const_cast<float*>(data.data() + off);
      check(ncclReduce(data.data() + off, out, size_t(counts[r]), ncclFloat, ncclSum, r, comm_, stream_), "ncclReduce");
      off += size_t(counts[r]);
    }
  });
}

// Equal chunks (the token exchange's): one in-place ncclAllGather, every link busy both ways at
// once. Otherwise one in-place broadcast per chunk owner, grouped.
void NcclCommunicator::all_gather_v(void* data, std::span<const int64_t> counts, ncclDataType_t type, size_t bytes,
                                    const char* op) {
  const bool equal = std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == counts[0]; });
  if (equal && counts[0] > 0) {
    const size_t chunk = size_t(counts[0]);
    char* all = static_cast<char*>(data);
    run("ncclAllGather", [&] {
      check(ncclAllGather(all + size_t(rank()) * chunk * bytes, all, chunk, type, comm_, stream_), "ncclAllGather");
    });
    return;
  }
  run(op, [&] {
    size_t off = 0;
    for (int r = 0; r < size(); ++r) {
      char* chunk = static_cast<char*>(data) + off * bytes;
      check(ncclBroadcast(chunk, chunk, size_t(counts[r]), type, r, comm_, stream_), op);
      off += size_t(counts[r]);
    }
  });
}

void NcclCommunicator::all_gather_v(std::span<float> data, std::span<const int64_t> counts) {
  all_gather_v(data.data(), counts, ncclFloat, sizeof(float), "ncclBroadcast (all-gather, float)");
}

void NcclCommunicator::all_gather_v(std::span<int32_t> data, std::span<const int64_t> counts) {
  all_gather_v(data.data(), counts, ncclInt32, sizeof(int32_t), "ncclBroadcast (all-gather, int32)");
}

void NcclCommunicator::all_gather_v(std::span<uint16_t> data, std::span<const int64_t> counts) {
  all_gather_v(data.data(), counts, ncclBfloat16, sizeof(uint16_t), "ncclBroadcast (all-gather, bf16)");
}

void DeviceSelfCommunicator::copy(void* to, const void* from, size_t bytes) {
  if (to != from && bytes > 0)
    MOEUT_CUDA_CHECK(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToDevice, caller_));
}

double NcclProcessGroups::take_seconds() {
  double seconds = 0;
  for (NcclCommunicator* c : nccl) seconds += c->take_seconds();
  return seconds;
}

NcclProcessGroups nccl_process_groups(const ProcessGroups& host, cudaStream_t caller) {
  NcclProcessGroups g;
  auto device = [&](Communicator& c) -> std::unique_ptr<Communicator> {
    if (c.size() == 1) return std::make_unique<DeviceSelfCommunicator>(c.name(), caller);
    auto nccl = std::make_unique<NcclCommunicator>(c, caller);
    g.nccl.push_back(nccl.get());
    return nccl;
  };
  g.world = device(*host.world);
  g.expert_parallel = device(*host.expert_parallel);
  g.expert_data_parallel = device(*host.expert_data_parallel);
  g.node = host.node;
  return g;
}

}  // namespace moeut
