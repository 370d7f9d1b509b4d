#include "parallel/mpi_communicator.h"

#include <limits>
#include <numeric>

#include "core/hang_watchdog.h"

namespace moeut {

MpiCommunicator::MpiCommunicator(MPI_Comm comm, std::string name) : comm_(comm), name_(std::move(name)) {
  // Errors come back as return codes and are reported with the rank and the group.
  check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
  check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
}

MpiCommunicator::~MpiCommunicator() {
  if (comm_ != MPI_COMM_WORLD && comm_ != MPI_COMM_SELF && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

void MpiCommunicator::check(int rc, const char* op) const {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw CommError(std::string(op) + " failed on rank " + std::to_string(rank_) + " of group '" + name_ +
                  "' (size " + std::to_string(size_) + "): " + std::string(text, size_t(len)));
}

std::vector<int> MpiCommunicator::to_int(std::span<const int64_t> counts, const char* op) const {
  std::vector<int> out(counts.size());
  for (size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] < 0 || counts[i] > std::numeric_limits<int>::max())
      throw CommError(std::string(op) + " on rank " + std::to_string(rank_) + " of group '" + name_ +
                      "': count " + std::to_string(counts[i]) + " does not fit an MPI int");
    out[i] = int(counts[i]);
  }
  return out;
}

void MpiCommunicator::all_reduce_sum(std::span<double> data) {
  const Waiting waiting("MPI_Allreduce", name_);
  check(MPI_Allreduce(MPI_IN_PLACE, data.data(), int(data.size()), MPI_DOUBLE, MPI_SUM, comm_), "MPI_Allreduce");
}

void MpiCommunicator::all_reduce_sum(std::span<float> data) {
  const Waiting waiting("MPI_Allreduce", name_);
  check(MPI_Allreduce(MPI_IN_PLACE, data.data(), int(data.size()), MPI_FLOAT, MPI_SUM, comm_), "MPI_Allreduce");
}

std::vector<int64_t> MpiCommunicator::all_to_all(std::span<const int64_t> send) {
  std::vector<int64_t> recv(static_cast<size_t>(size_));
  const Waiting waiting("MPI_Alltoall", name_);
  check(MPI_Alltoall(send.data(), 1, MPI_INT64_T, recv.data(), 1, MPI_INT64_T, comm_), "MPI_Alltoall");
  return recv;
}

void MpiCommunicator::all_to_all_v(const void* send, std::span<const int64_t> sc, void* recv,
                                   std::span<const int64_t> rc, MPI_Datatype type, const char* op) {
  const std::vector<int> scount = to_int(sc, op), rcount = to_int(rc, op);
  std::vector<int> sdispl(scount.size(), 0), rdispl(rcount.size(), 0);
  std::exclusive_scan(scount.begin(), scount.end(), sdispl.begin(), 0);
  std::exclusive_scan(rcount.begin(), rcount.end(), rdispl.begin(), 0);
  const Waiting waiting(op, name_);
  check(MPI_Alltoallv(send, scount.data(), sdispl.data(), type, recv, rcount.data(), rdispl.data(), type, comm_), op);
}

void MpiCommunicator::all_to_all_v(const float* send, std::span<const int64_t> sc, float* recv,
                                   std::span<const int64_t> rc) {
  all_to_all_v(send, sc, recv, rc, MPI_FLOAT, "MPI_Alltoallv(float)");
}

void MpiCommunicator::all_to_all_v(const int32_t* send, std::span<const int64_t> sc, int32_t* recv,
                                   std::span<const int64_t> rc) {
  all_to_all_v(send, sc, recv, rc, MPI_INT32_T, "MPI_Alltoallv(int32)");
}

void MpiCommunicator::all_to_all_v(const uint16_t* send, std::span<const int64_t> sc, uint16_t* recv,
                                   std::span<const int64_t> rc) {
  all_to_all_v(send, sc, recv, rc, MPI_UINT16_T, "MPI_Alltoallv(uint16)");
}

void MpiCommunicator::reduce_scatter_sum(std::span<const float> data, std::span<float> mine,
                                         std::span<const int64_t> counts) {
  const std::vector<int> c = to_int(counts, "MPI_Reduce_scatter");
  const Waiting waiting("MPI_Reduce_scatter", name_);
  check(MPI_Reduce_scatter(data.data(), mine.data(), c.data(), MPI_FLOAT, MPI_SUM, comm_), "MPI_Reduce_scatter");
}

void MpiCommunicator::all_gather_v(void* data, std::span<const int64_t> counts, MPI_Datatype type, const char* op) {
  const std::vector<int> c = to_int(counts, op);
  std::vector<int> displ(c.size(), 0);
  std::exclusive_scan(c.begin(), c.end(), displ.begin(), 0);
  const Waiting waiting(op, name_);
  check(MPI_Allgatherv(MPI_IN_PLACE, 0, type, data, c.data(), displ.data(), type, comm_), op);
}

void MpiCommunicator::all_gather_v(std::span<float> data, std::span<const int64_t> counts) {
  all_gather_v(data.data(), counts, MPI_FLOAT, "MPI_Allgatherv(float)");
}

void MpiCommunicator::all_gather_v(std::span<int32_t> data, std::span<const int64_t> counts) {
  all_gather_v(data.data(), counts, MPI_INT32_T, "MPI_Allgatherv(int32)");
}

void MpiCommunicator::all_gather_v(std::span<uint16_t> data, std::span<const int64_t> counts) {
  all_gather_v(data.data(), counts, MPI_UINT16_T, "MPI_Allgatherv(uint16)");
}

ProcessGroups mpi_process_groups(MPI_Comm base, int ep) {
  int rank = 0, size = 1;
  auto check = [&](int rc, const std::string& op) {
    if (rc != MPI_SUCCESS)
      throw CommError(op + " failed on rank " + std::to_string(rank) + " while creating the process groups");
  };
  check(MPI_Comm_rank(base, &rank), "MPI_Comm_rank");
  check(MPI_Comm_size(base, &size), "MPI_Comm_size");
  if (ep < 1 || size % ep != 0)
    throw std::invalid_argument("--ep " + std::to_string(ep) + " must divide the number of ranks (" +
                                std::to_string(size) + ")");
  auto split = [&](int color, const char* name) {
    MPI_Comm comm = MPI_COMM_NULL;
    check(MPI_Comm_split(base, color, rank, &comm), std::string("MPI_Comm_split of group '") + name + "'");
    return std::make_unique<MpiCommunicator>(comm, name);
  };
  ProcessGroups g;
  MPI_Comm world = MPI_COMM_NULL;
  check(MPI_Comm_dup(base, &world), "MPI_Comm_dup of group 'world'");
  g.world = std::make_unique<MpiCommunicator>(world, "world");
  g.expert_parallel = split(rank / ep, "expert-parallel");
  g.expert_data_parallel = split(rank % ep, "expert-data-parallel");
  // The machine's ranks, in world-rank order; only this rank's place among them is kept.
  MPI_Comm shared = MPI_COMM_NULL;
  check(MPI_Comm_split_type(base, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &shared),
        "MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) of group 'node'");
  MpiCommunicator node(shared, "node");
  std::vector<int32_t> world_ranks(size_t(node.size()), 0);
  world_ranks[size_t(node.rank())] = rank;
  node.all_gather_v(std::span<int32_t>(world_ranks), std::vector<int64_t>(world_ranks.size(), 1));
  g.node = {.rank = node.rank(), .ranks = node.size(), .first = world_ranks[0]};
  return g;
}

}  // namespace moeut
