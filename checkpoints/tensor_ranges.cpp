#include "checkpoints/tensor_ranges.h"

#include <algorithm>
#include <functional>
#include <numeric>

namespace moeut {

std::vector<Box> flat_range_boxes(const std::vector<int64_t>& shape, int64_t begin, int64_t end) {
  std::vector<Box> out;
  // Tiles [begin, end) of the sub-tensor shape[dim:] whose first element has index `prefix`
  // in the leading dimensions.
  std::function<void(size_t, std::vector<int64_t>, int64_t, int64_t)> tile =
      [&](size_t dim, std::vector<int64_t> prefix, int64_t lo, int64_t hi) {
        if (lo >= hi) return;
        const int64_t inner =
            std::accumulate(shape.begin() + int64_t(dim) + 1, shape.end(), int64_t(1), std::multiplies<>());
        auto box = [&](int64_t first, int64_t rows) {  // whole rows [first, first + rows) of this dim
          Box b{prefix, std::vector<int64_t>(dim, 1)};
          b.start.push_back(first);
          b.count.push_back(rows);
          for (size_t d = dim + 1; d < shape.size(); ++d) {
            b.start.push_back(0);
            b.count.push_back(shape[d]);
          }
          out.push_back(std::move(b));
        };
        int64_t row = lo / inner;
        const int64_t last = hi / inner;  // rows before `last` may be whole
        auto descend = [&](int64_t r, int64_t from, int64_t to) {
          std::vector<int64_t> p = prefix;
          p.push_back(r);
          tile(dim + 1, std::move(p), from - r * inner, to - r * inner);
        };
        if (lo % inner != 0 || row == last) {  // a partial first row
          descend(row, lo, std::min(hi, (row + 1) * inner));
          ++row;
        }
        if (row < last) box(row, last - row);
        if (row <= last && last * inner < hi) descend(last, last * inner, hi);  // a partial last row
      };
  tile(0, {}, begin, end);
  return out;
}

int64_t flat_index(const std::vector<int64_t>& shape, const std::vector<int64_t>& index) {
  int64_t flat = 0;
  for (size_t d = 0; d < shape.size(); ++d) flat = flat * shape[d] + index[d];
  return flat;
}

std::vector<OwnedRange> owned_ranges(const ParamLayout& local, const ZeroPartition& partition) {
  std::vector<OwnedRange> out;
  for_each_owned_piece(local, partition, [&](size_t i, int64_t offset, int64_t state_offset, int64_t count) {
    const TensorSpec& t = local.tensors()[i];
    // A rank's expert tensors hold rows [shard.begin, shard.begin + shard.count) of the global
    // [E, ...] tensor, so its flat ranges shift by shard.begin rows.
    const int64_t row = std::accumulate(t.shape.begin() + 1, t.shape.end(), int64_t(1), std::multiplies<>());
    const int64_t shift = t.expert ? local.shard().begin * row : 0;
    out.push_back({t.name, offset - t.offset + shift, count, state_offset});
  });
  return out;
}

}  // namespace moeut
