// Where a rank's optimizer shard sits in the model's logical tensors, and how a flat range of a
// row-major tensor splits into boxes (HDF5 hyperslabs). Checkpoints store logical tensors, never
// flat optimizer buffers: a rank writes each range it owns as boxes of the global tensor, and a
// reader of any other layout finds its own ranges among them.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/params.h"
#include "parallel/zero_partition.h"

namespace moeut {

// start[i] .. start[i] + count[i] - 1 along each dimension.
struct Box {
  std::vector<int64_t> start, count;
};

// The boxes that tile elements [begin, end) of a row-major tensor of `shape`, in element order:
// at most 2·ndim − 1 of them, each a contiguous run of the flat order.
std::vector<Box> flat_range_boxes(const std::vector<int64_t>& shape, int64_t begin, int64_t end);
// The flat (row-major) index of the element at `index`.
int64_t flat_index(const std::vector<int64_t>& shape, const std::vector<int64_t>& index);

// A run of one tensor that a rank owns: elements [begin, begin + count) of `tensor` in its
// global shape (expert tensors as the whole [E, ...] array) sit at state_offset of the rank's
// OptimizerShard vectors.
struct OwnedRange {
  std::string tensor;
  int64_t begin = 0, count = 0, state_offset = 0;
};

// The ranges of `partition` (a partition of `local`, this rank's layout), in state order.
std::vector<OwnedRange> owned_ranges(const ParamLayout& local, const ZeroPartition& partition);

}  // namespace moeut
