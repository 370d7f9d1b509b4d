// The manifest of a sharded checkpoint (docs/CHECKPOINTS.md): what was trained (model and
// training configuration, step, layout), which rank file holds which box of every logical
// tensor with its checksum, and one HDF5 virtual dataset per tensor over those boxes.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "checkpoints/tensor_ranges.h"
#include "core/config.h"
#include "core/params.h"

namespace moeut {

// What a rank file stores for every parameter element: the fp32 (master) value and the AdamW
// moments, named as in torch.optim.AdamW's state.
enum class Kind { kParam, kExpAvg, kExpAvgSq };
inline constexpr Kind kKinds[] = {Kind::kParam, Kind::kExpAvg, Kind::kExpAvgSq};
const char* kind_name(Kind k);  // "param", "exp_avg", "exp_avg_sq"

// One dataset of a rank file: a box of a logical tensor, elements [offset, offset + elements)
// of its flat order.
struct Piece {
  std::string tensor;
  Kind kind = Kind::kParam;
  std::string file, dataset;  // file name within the checkpoint directory, dataset path in it
  int64_t offset = 0, elements = 0;
  uint32_t crc32 = 0;  // zlib CRC-32 of the little-endian fp32 bytes
  Box box;             // where the dataset sits in the tensor (for the virtual datasets)
};

struct Manifest {
  ModelConfig model;
  TrainConfig train;  // only the fields that shape the run (train_fields)
  int64_t step = 0, optimizer_steps = 0, world_size = 1, ep = 1;
  std::vector<ExpertShard> expert_shards;  // of each expert-parallel rank
  std::vector<std::string> files;          // rank_<r>.h5 of each rank
  std::vector<int64_t> file_bytes;
  std::vector<Piece> pieces;               // box left empty when read back
};

std::string rank_file_name(int64_t rank);  // rank_<r>.h5

// Throws h5::FileError naming the file. read_manifest checks that the pieces tile every
// tensor of the model exactly once for every kind.
void write_manifest(const std::string& path, const Manifest& m);
Manifest read_manifest(const std::string& path);

// "<field> <saved> -> <now>" for each stored training field that differs.
std::vector<std::string> train_differences(const TrainConfig& saved, const TrainConfig& now);

}  // namespace moeut
