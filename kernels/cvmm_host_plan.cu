// Expert plans built on the host from a grouped CvmmSelection (DeviceCvmmPlan, cvmm_dev.h), for
// tests and benchmarks: the selections' rows by position, and the tile lists in the order the
// device planner (cvmm_plan.cu) writes them.
#include <algorithm>
#include <vector>

#include "kernels/cvmm_dev.h"
#include "kernels/cvmm_device.cuh"

namespace moeut::cuda {
namespace {

// The plan's tile lists, built on the host in the device planner's order (offsets_and_tiles):
// chunk by chunk, expert by expert, each tile's expert and first position, the tiles that start
// a pair (see CvmmPlan::pair_tile), and where each chunk's tiles begin.
struct TileLists {
  std::vector<int32_t> expert, first, pair_tile, chunk_first;
};
TileLists tile_lists(const CvmmSelection& sel, int32_t chunks) {
  TileLists l;
  for (int32_t c = 0; c < chunks; ++c) {
    l.chunk_first.push_back(int32_t(l.expert.size()));
    for (size_t e = 0; e + 1 < sel.expert_begin.size(); ++e) {
      const int64_t begin = sel.expert_begin[e];
      const int64_t tiles = (sel.expert_begin[e + 1] - begin + kCvmmTileRows - 1) / kCvmmTileRows;
      for (int64_t r = cvmm_chunk_rank_begin(c, tiles, chunks); r < cvmm_chunk_rank_begin(c + 1, tiles, chunks); ++r) {
        if (r % 2 == 0) l.pair_tile.push_back(int32_t(l.expert.size()));
        l.expert.push_back(int32_t(e));
        l.first.push_back(int32_t(begin + r * kCvmmTileRows));
      }
    }
  }
  l.chunk_first.push_back(int32_t(l.expert.size()));
  return l;
}

}  // namespace

DeviceCvmmPlan::DeviceCvmmPlan(const CvmmSelection& sel, int64_t tokens_per_chunk) {
  std::vector<int32_t> in_by_position_rows(sel.by_expert.size()), out_by_position_rows(sel.by_expert.size());
  for (size_t p = 0; p < sel.by_expert.size(); ++p) {
    in_by_position_rows[p] = sel.in_row[size_t(sel.by_expert[p])];
    out_by_position_rows[p] = sel.out_row[size_t(sel.by_expert[p])];
  }
  in_row = DeviceBuffer<int32_t>(in_by_position_rows);
  out_row = DeviceBuffer<int32_t>(out_by_position_rows);
  by_expert = DeviceBuffer<int32_t>(sel.by_expert);
  const auto rows = [](const std::vector<int32_t>& r) { return r.empty() ? 0 : 1 + int64_t(*std::max_element(r.begin(), r.end())); };
  chunks = cvmm_chunks(std::min(rows(sel.in_row), rows(sel.out_row)), tokens_per_chunk);
  const TileLists lists = tile_lists(sel, chunks);
  tile_expert = DeviceBuffer<int32_t>(lists.expert);
  tile_first = DeviceBuffer<int32_t>(lists.first);
  pair_tile = DeviceBuffer<int32_t>(lists.pair_tile);
  chunk_first_tile = DeviceBuffer<int32_t>(lists.chunk_first);
  expert_begin = DeviceBuffer<int64_t>(sel.expert_begin);
  tiles = int32_t(lists.expert.size());
  live_tiles = DeviceBuffer<int32_t>(std::vector<int32_t>{tiles});
  live_pairs = DeviceBuffer<int32_t>(std::vector<int32_t>{int32_t(lists.pair_tile.size())});
  tail_counters = zeroed_tail_counters();
  in_by_position = out_by_position = true;
  for (size_t p = 0; p < sel.by_expert.size(); ++p) {
    in_by_position &= in_by_position_rows[p] == int32_t(p);
    out_by_position &= out_by_position_rows[p] == int32_t(p);
  }
  positions = int64_t(sel.by_expert.size());
}

}  // namespace moeut::cuda
