// How ZeRO stage 1 splits the parameter buffer among ranks; one partition serves the CPU and
// GPU optimizers and the checkpoints. The replicated range is shared by the world group, the
// expert range by the expert-data-parallel group. Each range is cut into buckets (one
// collective per bucket, not per tensor) and every bucket into one chunk per rank of its group;
// a rank owns its chunk of every bucket: it keeps the fp32 master and AdamW moments for it.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/params.h"
#include "parallel/communicator.h"

namespace moeut {

enum class ZeroGroup { kWorld, kExpertDataParallel };

struct ZeroBucket {
  int64_t offset = 0, length = 0;  // in the parameter buffer
  ZeroGroup group = ZeroGroup::kWorld;
  std::vector<int64_t> chunks;     // elements per rank of the group
  int64_t mine_offset = 0;         // this rank's chunk, from the bucket's start
  int64_t state_offset = 0;        // this rank's chunk, in the concatenation of its chunks
  int64_t mine = 0;                // elements in this rank's chunk
};

class ZeroPartition {
 public:
  static constexpr int64_t kDefaultBucket = int64_t(1) << 22;
  ZeroPartition(const ParamLayout& layout, const ProcessGroups& groups, int64_t bucket_elements = kDefaultBucket);
  const std::vector<ZeroBucket>& buckets() const { return buckets_; }
  int64_t owned_elements() const { return owned_; }  // sum of this rank's chunks

 private:
  void add_range(int64_t begin, int64_t end, ZeroGroup group, const Communicator& comm, int64_t bucket_elements);
  std::vector<ZeroBucket> buckets_;
  int64_t owned_ = 0;
};

// What one rank's optimizer owns, as checkpoints save and load it: for each of its chunks, in
// state order, the fp32 master values and AdamW moments.
struct OptimizerShard {
  std::vector<float> master, m, v;  // ZeroPartition::owned_elements() each
  int64_t steps = 0;                // optimizer steps taken (AdamW bias correction)
};

inline ZeroPartition::ZeroPartition(const ParamLayout& layout, const ProcessGroups& groups, int64_t bucket_elements) {
  add_range(0, layout.replicated(), ZeroGroup::kWorld, *groups.world, bucket_elements);
  add_range(layout.replicated(), layout.total(), ZeroGroup::kExpertDataParallel, *groups.expert_data_parallel,
            bucket_elements);
}

inline void ZeroPartition::add_range(int64_t begin, int64_t end, ZeroGroup group, const Communicator& comm,
                                     int64_t bucket_elements) {
  const int64_t ranks = comm.size();
  for (int64_t off = begin; off < end; off += bucket_elements) {
    ZeroBucket b;
    b.offset = off;
    b.length = std::min(bucket_elements, end - off);
    b.group = group;
    for (int64_t r = 0; r < ranks; ++r) b.chunks.push_back(b.length / ranks + (r < b.length % ranks ? 1 : 0));
    for (int64_t r = 0; r < comm.rank(); ++r) b.mine_offset += b.chunks[size_t(r)];
    b.mine = b.chunks[size_t(comm.rank())];
    b.state_offset = owned_;
    owned_ += b.mine;
    buckets_.push_back(std::move(b));
  }
}

// Calls fn(tensor, offset, state_offset, count) for each piece of a tensor of `layout` that lies
// in this rank's chunks: `tensor` indexes layout.tensors(), `offset` is the piece's start in the
// parameter buffer and `state_offset` in the concatenation of this rank's chunks.
template <typename Fn>
void for_each_owned_piece(const ParamLayout& layout, const ZeroPartition& partition, Fn fn) {
  const std::vector<TensorSpec>& tensors = layout.tensors();
  for (const ZeroBucket& b : partition.buckets()) {
    const int64_t begin = b.offset + b.mine_offset, end = begin + b.mine;
    for (size_t t = 0; t < tensors.size(); ++t) {
      const int64_t lo = std::max(begin, tensors[t].offset), hi = std::min(end, tensors[t].offset + tensors[t].numel);
      if (lo < hi) fn(t, lo, b.state_offset + (lo - begin), hi - lo);
    }
  }
}

}  // namespace moeut
