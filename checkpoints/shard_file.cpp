#include "checkpoints/shard_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <numeric>

namespace moeut {
namespace {

using h5::check;
using h5::Handle;

constexpr const char* kFormat = "moeut-checkpoint-shard";

// Test hook (tests/cli_checkpoints.sh): MOEUT_TEST_KILL_DURING_SAVE=<rank>:<step> makes that
// rank kill itself with SIGKILL after writing part of its file for that step, as a crash would.
void test_hook_kill_during_save(int64_t rank, int64_t step) {
  const char* v = std::getenv("MOEUT_TEST_KILL_DURING_SAVE");
  long long r = -1, s = -1;
  if (v && std::sscanf(v, "%lld:%lld", &r, &s) == 2 && r == rank && s == step) std::raise(SIGKILL);
}

void fsync_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  const bool ok = fd >= 0 && ::fsync(fd) == 0;
  const int err = errno;
  if (fd >= 0) ::close(fd);
  check(ok, path, std::string("cannot fsync: ") + std::strerror(err));
}

// The root attributes of a rank file against what the manifest says of it: the same rank, layout,
// step, optimizer steps and seed, so that no field of the manifest goes unchecked against the
// files it describes.
void check_header(hid_t root, const std::string& path, const ShardHeader& expected) {
  check(H5Aexists(root, "format") > 0 && h5::read_string_attr(root, "format", path) == kFormat, path,
        "not a checkpoint rank file");
  const std::pair<const char*, int64_t> fields[] = {
      {"rank", expected.rank},
      {"world_size", expected.world_size},
      {"ep", expected.ep},
      {"expert_begin", expected.experts.begin},
      {"expert_count", expected.experts.count},
      {"step", expected.step},
      {"optimizer_steps", expected.optimizer_steps},
      {"seed", std::bit_cast<int64_t>(expected.seed)}};
  for (const auto& [name, value] : fields) {
    const int64_t here = h5::read_int_attr(root, name, path);
    check(here == value, path,
          std::string("attribute '") + name + "' is " + std::to_string(here) + " here, " + std::to_string(value) +
              " in the manifest: the file does not belong to this checkpoint, or one of them is corrupt");
  }
}

std::string dataset_name(const std::string& tensor, Kind k, int64_t i) {
  return tensor + "/" + kind_name(k) + "/" + std::to_string(i);
}

}  // namespace

void write_shard_file(const std::string& path, const ShardHeader& h, const ParamLayout& full,
                      const std::vector<OwnedRange>& ranges, const OptimizerShard& shard) {
  {
    Handle file = h5::create_file(path);
    const hid_t root = file.get();
    h5::write_string_attr(root, "format", kFormat, path);
    h5::write_int_attr(root, "rank", h.rank, path);
    h5::write_int_attr(root, "world_size", h.world_size, path);
    h5::write_int_attr(root, "ep", h.ep, path);
    h5::write_int_attr(root, "expert_begin", h.experts.begin, path);
    h5::write_int_attr(root, "expert_count", h.experts.count, path);
    h5::write_int_attr(root, "step", h.step, path);
    h5::write_int_attr(root, "optimizer_steps", h.optimizer_steps, path);
    h5::write_int_attr(root, "seed", std::bit_cast<int64_t>(h.seed), path);
    // /<tensor>/<kind>/ groups come with their first dataset.
    Handle lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
    check(lcpl.ok() && H5Pset_create_intermediate_group(lcpl.get(), 1) >= 0, path, "cannot set up groups");
    std::map<std::string, int64_t> boxes_of;  // boxes written so far per tensor
    bool first = true;
    for (const OwnedRange& r : ranges) {
      const TensorSpec& t = full.at(r.tensor);
      for (const Box& box : flat_range_boxes(t.shape, r.begin, r.begin + r.count)) {
        const int64_t i = boxes_of[r.tensor]++;
        const int64_t at = r.state_offset + flat_index(t.shape, box.start) - r.begin;
        const int64_t n = std::accumulate(box.count.begin(), box.count.end(), int64_t(1), std::multiplies<>());
        for (Kind k : kKinds) {
          const float* data = (k == Kind::kParam ? shard.master : k == Kind::kExpAvg ? shard.m : shard.v).data() + at;
          const std::string name = dataset_name(r.tensor, k, i);
          const std::vector<hsize_t> dims(box.count.begin(), box.count.end());
          Handle space(H5Screate_simple(int(dims.size()), dims.data(), nullptr), H5Sclose);
          Handle dset(H5Dcreate2(root, name.c_str(), H5T_IEEE_F32LE, space.get(), lcpl.get(), H5P_DEFAULT, H5P_DEFAULT),
                      H5Dclose);
          check(dset.ok() && H5Dwrite(dset.get(), H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) >= 0, path,
                "cannot write dataset '" + name + "'");
          h5::write_ints_attr(dset.get(), "start", box.start, path);
          h5::write_int_attr(dset.get(), "crc32", h5::crc32_of(data, n), path);
          if (first) {
            check(H5Fflush(root, H5F_SCOPE_GLOBAL) >= 0, path, "cannot flush");
            test_hook_kill_during_save(h.rank, h.step);
            first = false;
          }
        }
      }
    }
    check(H5Fflush(root, H5F_SCOPE_GLOBAL) >= 0, path, "cannot flush");
    h5::close_file(file, path);
  }
  fsync_file(path);
}

std::vector<Piece> read_shard_index(const std::string& path, const std::string& file_name, const ShardHeader& expected,
                                    const ParamLayout& full) {
  Handle file = h5::open_file(path);
  const hid_t root = file.get();
  check_header(root, path, expected);
  std::vector<Piece> out;
  for (const TensorSpec& t : full.tensors()) {
    if (H5Lexists(root, t.name.c_str(), H5P_DEFAULT) <= 0) continue;
    for (Kind k : kKinds) {
      const std::string group = t.name + "/" + kind_name(k);
      check(H5Lexists(root, group.c_str(), H5P_DEFAULT) > 0, path, "missing group '" + group + "'");
      for (int64_t i = 0;; ++i) {
        const std::string name = dataset_name(t.name, k, i);
        if (H5Lexists(root, name.c_str(), H5P_DEFAULT) <= 0) break;
        Handle dset = h5::open_float_dataset(root, name, path);
        Piece p{t.name, k, file_name, name, 0, 0, 0, {}};
        p.box.count = h5::dataset_shape(dset.get(), "dataset '" + name + "'", path);
        Handle attr(H5Aopen(dset.get(), "start", H5P_DEFAULT), H5Aclose);
        p.box.start.resize(t.shape.size());
        check(attr.ok() && p.box.count.size() == t.shape.size() &&
                  H5Aread(attr.get(), H5T_NATIVE_INT64, p.box.start.data()) >= 0,
              path, "dataset '" + name + "' has no box start of " + std::to_string(t.shape.size()) + " dimensions");
        p.crc32 = uint32_t(h5::read_int_attr(dset.get(), "crc32", path));
        p.elements = std::accumulate(p.box.count.begin(), p.box.count.end(), int64_t(1), std::multiplies<>());
        std::vector<int64_t> last(t.shape.size());
        bool inside = true;
        for (size_t d = 0; d < t.shape.size(); ++d) {
          last[d] = p.box.start[d] + p.box.count[d] - 1;
          inside = inside && p.box.start[d] >= 0 && p.box.count[d] > 0 && last[d] < t.shape[d];
        }
        p.offset = inside ? flat_index(t.shape, p.box.start) : 0;
        // The readers rely on a box being one contiguous run of the tensor's flat order.
        check(inside && flat_index(t.shape, last) - p.offset + 1 == p.elements, path,
              "dataset '" + name + "' is not a contiguous box of " + t.name);
        out.push_back(std::move(p));
      }
    }
  }
  return out;
}

PieceReader::PieceReader(std::string dir, const Manifest& m) : dir_(std::move(dir)), manifest_(m) {}

hid_t PieceReader::file(const std::string& name) {
  auto it = files_.find(name);
  if (it != files_.end()) return it->second.get();
  const std::string path = (std::filesystem::path(dir_) / name).string();
  const auto listed = std::find(manifest_.files.begin(), manifest_.files.end(), name);
  check(listed != manifest_.files.end(), path, "not a rank file of this checkpoint");
  const int64_t rank = listed - manifest_.files.begin();
  Handle f = h5::open_file(path);
  check_header(f.get(), path,
               {.rank = rank,
                .world_size = manifest_.world_size,
                .ep = manifest_.ep,
                .experts = manifest_.expert_shards[size_t(rank % manifest_.ep)],
                .step = manifest_.step,
                .optimizer_steps = manifest_.optimizer_steps,
                .seed = manifest_.train.seed});
  return files_.emplace(name, std::move(f)).first->second.get();
}

void PieceReader::read(const Piece& p, float* dst) {
  const std::string path = (std::filesystem::path(dir_) / p.file).string();
  const hid_t f = file(p.file);
  Handle dset = h5::open_float_dataset(f, p.dataset, path);
  const std::vector<int64_t> shape = h5::dataset_shape(dset.get(), "dataset '" + p.dataset + "'", path);
  const int64_t n = std::accumulate(shape.begin(), shape.end(), int64_t(1), std::multiplies<>());
  check(n == p.elements, path,
        "dataset '" + p.dataset + "' holds " + std::to_string(n) + " elements, the manifest says " + std::to_string(p.elements));
  check(H5Dread(dset.get(), H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, dst) >= 0, path,
        "cannot read dataset '" + p.dataset + "' (truncated or corrupt?)");
  const uint32_t crc = h5::crc32_of(dst, n);
  char what[160];
  std::snprintf(what, sizeof what, "checksum mismatch (crc32 %08x, the manifest says %08x)", crc, p.crc32);
  check(crc == p.crc32, path, "dataset '" + p.dataset + "': " + what);
}

}  // namespace moeut
