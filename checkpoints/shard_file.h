// One rank's file of a sharded checkpoint: what the rank owns in the ZeRO partition, as boxes
// of the logical tensors (/<tensor>/<kind>/<i>, each with its box start and CRC-32 as
// attributes), and its place in the run (rank, layout, step, seed) as root attributes.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "checkpoints/hdf5_common.h"
#include "checkpoints/manifest.h"
#include "checkpoints/tensor_ranges.h"
#include "parallel/zero_partition.h"

namespace moeut {

struct ShardHeader {
  int64_t rank = 0, world_size = 1, ep = 1;
  ExpertShard experts;
  // Where the run stands: the data order and the schedule are functions of (seed, step), so
  // these are the data-loader position and the random state.
  int64_t step = 0, optimizer_steps = 0;
  uint64_t seed = 0;
};

// Writes `ranges` of shard (master values and both moments) as boxes of the tensors of `full`
// (the whole model's layout), flushes and fsyncs. Throws h5::FileError naming the file.
void write_shard_file(const std::string& path, const ShardHeader& header, const ParamLayout& full,
                      const std::vector<OwnedRange>& ranges, const OptimizerShard& shard);

// The pieces a rank file holds, read back from its attributes (for the manifest). Checks that
// the file is the one expected (its root attributes equal `expected`) and that every box lies
// in its tensor.
std::vector<Piece> read_shard_index(const std::string& path, const std::string& file_name, const ShardHeader& expected,
                                    const ParamLayout& full);

// Reads pieces from the rank files of one checkpoint directory, keeping each file open. Each
// file's root attributes are checked against the manifest when it is opened: rank, layout,
// expert shard, step, optimizer steps and seed.
class PieceReader {
 public:
  PieceReader(std::string dir, const Manifest& m);
  // Reads the piece's p.elements values into dst, checking its size and its CRC-32 against
  // the manifest's (dst holds garbage when that throws).
  void read(const Piece& p, float* dst);

 private:
  hid_t file(const std::string& name);
  std::string dir_;
  const Manifest& manifest_;
  std::map<std::string, h5::Handle> files_;
};

}  // namespace moeut
