#include "checkpoints/manifest.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>

#include "checkpoints/hdf5_common.h"

namespace moeut {
namespace {

using h5::check;
using h5::Handle;

constexpr const char* kFormat = "moeut-checkpoint";
// Version 2 adds the checksum block; version 1 manifests (without it) are still read.
constexpr int64_t kVersion = 2;

// The manifest's first kChecksumBlock bytes (an HDF5 userblock, which HDF5 readers skip) hold
// one line: kChecksumTag, the CRC-32 of every byte after the block, and the file's size. Every
// field of the manifest is covered, and checked before HDF5 parses a byte of it.
constexpr hsize_t kChecksumBlock = 512;
constexpr const char* kChecksumTag = "moeut-checkpoint-manifest crc32";
constexpr unsigned char kHdf5Signature[8] = {0x89, 'H', 'D', 'F', '\r', '\n', 0x1a, '\n'};

uint32_t crc32_after_block(const std::string& bytes) {
  return uint32_t(crc32_z(0, reinterpret_cast<const Bytef*>(bytes.data()) + kChecksumBlock,
                          bytes.size() - kChecksumBlock));
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  check(!in.bad(), path, std::string("cannot read: ") + std::strerror(errno));
  return bytes;
}

// Writes the checksum line into the block of the closed file at `path`.
void seal(const std::string& path) {
  const std::string bytes = read_bytes(path);
  check(bytes.size() > kChecksumBlock, path, "shorter than its checksum block");
  char line[kChecksumBlock] = {};
  std::snprintf(line, sizeof line, "%s %08x bytes %zu\n", kChecksumTag, crc32_after_block(bytes), bytes.size());
  const int fd = ::open(path.c_str(), O_WRONLY);
  const bool ok = fd >= 0 && ::pwrite(fd, line, sizeof line, 0) == ssize_t(sizeof line);
  const int err = errno;
  check((fd < 0 || ::close(fd) == 0) && ok, path, std::string("cannot write its checksum: ") + std::strerror(err));
}

// The format version the checksum block implies (1: none, the file starts as HDF5), after
// checking the checksum and the size it states.
int64_t check_seal(const std::string& path) {
  const std::string bytes = read_bytes(path);
  if (bytes.size() >= sizeof kHdf5Signature && std::memcmp(bytes.data(), kHdf5Signature, sizeof kHdf5Signature) == 0)
    return 1;
  unsigned crc = 0;
  size_t size = 0;
  const std::string format = std::string(kChecksumTag) + " %8x bytes %zu";
  check(bytes.size() > kChecksumBlock && std::sscanf(bytes.c_str(), format.c_str(), &crc, &size) == 2, path,
        "not a checkpoint manifest (no checksum line '" + std::string(kChecksumTag) + " ...' at its start)");
  check(size == bytes.size(), path,
        "has " + std::to_string(bytes.size()) + " bytes, its checksum line says " + std::to_string(size) +
            " (truncated or extended)");
  char what[160];
  std::snprintf(what, sizeof what, "checksum mismatch (crc32 %08x, its checksum line says %08x): the manifest is corrupt",
                crc32_after_block(bytes), crc);
  check(crc32_after_block(bytes) == crc, path, what);
  return kVersion;
}

// The training fields that decide how a run continues: data order, schedule, optimizer.
struct TrainInt { const char* name; int64_t TrainConfig::*field; };
struct TrainReal { const char* name; double TrainConfig::*field; };
constexpr TrainInt kTrainInts[] = {{"steps", &TrainConfig::steps},
                                   {"batch_size", &TrainConfig::batch_size},
                                   {"micro_batch_size", &TrainConfig::micro_batch_size},
                                   {"warmup_steps", &TrainConfig::warmup_steps}};
constexpr TrainReal kTrainReals[] = {
    {"lr", &TrainConfig::lr},                   {"min_lr_ratio", &TrainConfig::min_lr_ratio},
    {"weight_decay", &TrainConfig::weight_decay}, {"adam_beta1", &TrainConfig::adam_beta1},
    {"adam_beta2", &TrainConfig::adam_beta2},   {"adam_eps", &TrainConfig::adam_eps},
    {"grad_clip", &TrainConfig::grad_clip}};

Handle create_group(hid_t loc, const char* name, const std::string& path) {
  Handle g(H5Gcreate2(loc, name, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose);
  check(g.ok(), path, std::string("cannot create group '") + name + "'");
  return g;
}

Handle open_group(hid_t loc, const char* name, const std::string& path) {
  check(H5Lexists(loc, name, H5P_DEFAULT) > 0, path, std::string("missing group '") + name + "'");
  Handle g(H5Gopen2(loc, name, H5P_DEFAULT), H5Gclose);
  check(g.ok(), path, std::string("cannot open group '") + name + "'");
  return g;
}

// The virtual dataset of one (tensor, kind): the tensor's global shape, each box mapped from
// the whole source dataset of a rank file. Source file names are relative, so HDF5 looks for
// them beside the manifest and the directory can move. A missing source reads as NaN.
void write_virtual(hid_t loc, const std::string& name, const std::vector<int64_t>& shape,
                   const std::vector<const Piece*>& pieces, const std::string& path) {
  const std::vector<hsize_t> dims(shape.begin(), shape.end());
  Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  const float nan = std::nanf("");
  check(dcpl.ok() && H5Pset_fill_value(dcpl.get(), H5T_NATIVE_FLOAT, &nan) >= 0, path, "cannot set up " + name);
  for (const Piece* p : pieces) {
    Handle vspace(H5Screate_simple(int(dims.size()), dims.data(), nullptr), H5Sclose);
    const std::vector<hsize_t> start(p->box.start.begin(), p->box.start.end()), count(p->box.count.begin(), p->box.count.end());
    Handle source(H5Screate_simple(int(count.size()), count.data(), nullptr), H5Sclose);
    check(H5Sselect_hyperslab(vspace.get(), H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr) >= 0 &&
              H5Pset_virtual(dcpl.get(), vspace.get(), p->file.c_str(), p->dataset.c_str(), source.get()) >= 0,
          path, "cannot map " + p->file + ":" + p->dataset + " into virtual dataset '" + name + "'");
  }
  Handle space(H5Screate_simple(int(dims.size()), dims.data(), nullptr), H5Sclose);
  Handle dset(H5Dcreate2(loc, name.c_str(), H5T_IEEE_F32LE, space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT),
              H5Dclose);
  check(dset.ok(), path, "cannot create virtual dataset '" + name + "'");
}

// Every element of every (tensor, kind) in exactly one piece.
void check_tiling(const Manifest& m, const std::string& path) {
  const ParamLayout layout(m.model);
  std::map<std::pair<std::string, Kind>, std::vector<const Piece*>> by_tensor;
  for (const Piece& p : m.pieces) {
    try {
      layout.at(p.tensor);
    } catch (const std::out_of_range&) {
      check(false, path, "piece '" + p.dataset + "' of " + p.file + " belongs to '" + p.tensor + "', not a parameter of this model");
    }
    check(std::find(m.files.begin(), m.files.end(), p.file) != m.files.end(), path,
          "piece '" + p.dataset + "' names file '" + p.file + "', not a file of this checkpoint");
    by_tensor[{p.tensor, p.kind}].push_back(&p);
  }
  for (const TensorSpec& t : layout.tensors())
    for (Kind k : kKinds) {
      std::vector<const Piece*>& list = by_tensor[{t.name, k}];
      std::sort(list.begin(), list.end(), [](const Piece* a, const Piece* b) { return a->offset < b->offset; });
      int64_t next = 0;
      for (const Piece* p : list) {
        check(p->offset == next && p->elements > 0, path,
              "the pieces of " + t.name + " (" + kind_name(k) + ") overlap or leave a gap at element " + std::to_string(next));
        next += p->elements;
      }
      check(next == t.numel, path,
            "the pieces of " + t.name + " (" + kind_name(k) + ") cover " + std::to_string(next) + " of " +
                std::to_string(t.numel) + " elements");
    }
}

}  // namespace

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kParam: return "param";
    case Kind::kExpAvg: return "exp_avg";
    case Kind::kExpAvgSq: return "exp_avg_sq";
  }
  return "?";
}

std::string rank_file_name(int64_t rank) { return "rank_" + std::to_string(rank) + ".h5"; }

void write_manifest(const std::string& path, const Manifest& m) {
  Handle file = h5::create_file(path, kChecksumBlock);
  const hid_t root = file.get();
  h5::write_string_attr(root, "format", kFormat, path);
  h5::write_int_attr(root, "format_version", kVersion, path);
  h5::write_int_attr(root, "step", m.step, path);
  h5::write_int_attr(root, "optimizer_steps", m.optimizer_steps, path);
  h5::write_int_attr(root, "world_size", m.world_size, path);
  h5::write_int_attr(root, "ep", m.ep, path);
  h5::write_model_attrs(root, m.model, path);
  h5::write_int_attr(root, "context", m.model.context, path);
  {
    Handle train = create_group(root, "train", path);
    h5::write_int_attr(train.get(), "seed", std::bit_cast<int64_t>(m.train.seed), path);
    for (const TrainInt& f : kTrainInts) h5::write_int_attr(train.get(), f.name, m.train.*f.field, path);
    for (const TrainReal& f : kTrainReals) h5::write_real_attr(train.get(), f.name, m.train.*f.field, path);
  }
  {
    Handle layout = create_group(root, "layout", path);
    std::vector<int64_t> begin, count;
    for (const ExpertShard& s : m.expert_shards) {
      begin.push_back(s.begin);
      count.push_back(s.count);
    }
    h5::write_ints(layout.get(), "expert_begin", begin, path);
    h5::write_ints(layout.get(), "expert_count", count, path);
  }
  {
    Handle files = create_group(root, "files", path);
    h5::write_strings(files.get(), "name", m.files, path);
    h5::write_ints(files.get(), "bytes", m.file_bytes, path);
  }
  {
    Handle pieces = create_group(root, "pieces", path);
    std::vector<std::string> tensor, kind, file, dataset;
    std::vector<int64_t> offset, elements, crc;
    for (const Piece& p : m.pieces) {
      tensor.push_back(p.tensor);
      kind.push_back(kind_name(p.kind));
      file.push_back(p.file);
      dataset.push_back(p.dataset);
      offset.push_back(p.offset);
      elements.push_back(p.elements);
      crc.push_back(p.crc32);
    }
    h5::write_strings(pieces.get(), "tensor", tensor, path);
    h5::write_strings(pieces.get(), "kind", kind, path);
    h5::write_strings(pieces.get(), "file", file, path);
    h5::write_strings(pieces.get(), "dataset", dataset, path);
    h5::write_ints(pieces.get(), "offset", offset, path);
    h5::write_ints(pieces.get(), "elements", elements, path);
    h5::write_ints(pieces.get(), "crc32", crc, path);
  }
  // The parameters at the root under their state-dict names, the moments in groups beside.
  Handle exp_avg = create_group(root, "exp_avg", path), exp_avg_sq = create_group(root, "exp_avg_sq", path);
  const ParamLayout layout(m.model);
  for (const TensorSpec& t : layout.tensors())
    for (Kind k : kKinds) {
      std::vector<const Piece*> mine;
      for (const Piece& p : m.pieces)
        if (p.tensor == t.name && p.kind == k) mine.push_back(&p);
      const hid_t loc = k == Kind::kParam ? root : k == Kind::kExpAvg ? exp_avg.get() : exp_avg_sq.get();
      write_virtual(loc, t.name, t.shape, mine, path);
    }
  check(H5Fflush(root, H5F_SCOPE_GLOBAL) >= 0, path, "cannot flush");
  check(exp_avg.close() >= 0 && exp_avg_sq.close() >= 0, path, "cannot close the groups of the moments");
  h5::close_file(file, path);
  seal(path);
}

Manifest read_manifest(const std::string& path) {
  const int64_t sealed = check_seal(path);
  Handle file = h5::open_file(path);
  const hid_t root = file.get();
  check(H5Aexists(root, "format") > 0 && h5::read_string_attr(root, "format", path) == kFormat, path,
        std::string("not a checkpoint manifest (no format attribute '") + kFormat + "')");
  const int64_t version = h5::read_int_attr(root, "format_version", path);
  check(version == sealed, path,
        "format_version " + std::to_string(version) + (sealed == 1 ? " without" : " with") +
            " a checksum line; this build reads version 1 without one and version " + std::to_string(kVersion) +
            " with one");
  Manifest m;
  m.step = h5::read_int_attr(root, "step", path);
  m.optimizer_steps = h5::read_int_attr(root, "optimizer_steps", path);
  m.world_size = h5::read_int_attr(root, "world_size", path);
  m.ep = h5::read_int_attr(root, "ep", path);
  m.model = h5::read_model_attrs(root, path);
  m.model.context = h5::read_int_attr(root, "context", path);
  try {
    validate(m.model);
  } catch (const ConfigError& e) {
    check(false, path, std::string("describes an ") + e.what());
  }
  check(m.step >= 0 && m.optimizer_steps >= 0, path, "negative step");
  check(m.world_size >= 1 && m.ep >= 1 && m.world_size % m.ep == 0 && m.ep <= m.model.ff_n_experts, path,
        "impossible layout: world_size " + std::to_string(m.world_size) + ", ep " + std::to_string(m.ep));
  {
    Handle train = open_group(root, "train", path);
    m.train.seed = std::bit_cast<uint64_t>(h5::read_int_attr(train.get(), "seed", path));
    for (const TrainInt& f : kTrainInts) m.train.*f.field = h5::read_int_attr(train.get(), f.name, path);
    for (const TrainReal& f : kTrainReals) m.train.*f.field = h5::read_real_attr(train.get(), f.name, path);
  }
  {
    Handle layout = open_group(root, "layout", path);
    const std::vector<int64_t> begin = h5::read_ints(layout.get(), "expert_begin", path);
    const std::vector<int64_t> count = h5::read_ints(layout.get(), "expert_count", path);
    check(begin.size() == size_t(m.ep) && count.size() == size_t(m.ep), path, "expert shards do not match ep");
    for (size_t j = 0; j < begin.size(); ++j) m.expert_shards.push_back({begin[j], count[j]});
  }
  {
    Handle files = open_group(root, "files", path);
    m.files = h5::read_strings(files.get(), "name", path);
    m.file_bytes = h5::read_ints(files.get(), "bytes", path);
    check(m.files.size() == size_t(m.world_size) && m.file_bytes.size() == m.files.size(), path,
          "lists " + std::to_string(m.files.size()) + " rank files for a world of " + std::to_string(m.world_size));
    // Names, not paths: nothing outside the checkpoint directory is opened.
    for (size_t r = 0; r < m.files.size(); ++r)
      check(m.files[r] == rank_file_name(int64_t(r)), path,
            "lists '" + m.files[r] + "' as the file of rank " + std::to_string(r) + ", not " + rank_file_name(int64_t(r)));
  }
  {
    Handle pieces = open_group(root, "pieces", path);
    const std::vector<std::string> tensor = h5::read_strings(pieces.get(), "tensor", path);
    const std::vector<std::string> kind = h5::read_strings(pieces.get(), "kind", path);
    const std::vector<std::string> file = h5::read_strings(pieces.get(), "file", path);
    const std::vector<std::string> dataset = h5::read_strings(pieces.get(), "dataset", path);
    const std::vector<int64_t> offset = h5::read_ints(pieces.get(), "offset", path);
    const std::vector<int64_t> elements = h5::read_ints(pieces.get(), "elements", path);
    const std::vector<int64_t> crc = h5::read_ints(pieces.get(), "crc32", path);
    const size_t n = tensor.size();
    check(kind.size() == n && file.size() == n && dataset.size() == n && offset.size() == n && elements.size() == n &&
              crc.size() == n,
          path, "the columns of /pieces differ in length");
    for (size_t i = 0; i < n; ++i) {
      Piece p{tensor[i], Kind::kParam, file[i], dataset[i], offset[i], elements[i], uint32_t(crc[i]), {}};
      const auto k = std::find_if(std::begin(kKinds), std::end(kKinds), [&](Kind x) { return kind[i] == kind_name(x); });
      check(k != std::end(kKinds) && crc[i] >= 0 && crc[i] <= int64_t(UINT32_MAX), path,
            "piece " + std::to_string(i) + " has kind '" + kind[i] + "' or checksum " + std::to_string(crc[i]));
      p.kind = *k;
      const std::string prefix = p.tensor + "/" + kind[i] + "/";
      check(p.dataset.size() > prefix.size() && p.dataset.compare(0, prefix.size(), prefix) == 0 &&
                std::all_of(p.dataset.begin() + ptrdiff_t(prefix.size()), p.dataset.end(),
                            [](char c) { return c >= '0' && c <= '9'; }),
            path, "piece " + std::to_string(i) + " names dataset '" + p.dataset + "', not " + prefix + "<i>");
      m.pieces.push_back(std::move(p));
    }
  }
  check_tiling(m, path);
  return m;
}

std::vector<std::string> train_differences(const TrainConfig& saved, const TrainConfig& now) {
  std::vector<std::string> out;
  auto note = [&](const char* name, auto a, auto b) {
    std::ostringstream s;
    s << name << " " << a << " -> " << b;
    out.push_back(s.str());
  };
  if (saved.seed != now.seed) note("seed", saved.seed, now.seed);
  for (const TrainInt& f : kTrainInts)
    if (saved.*f.field != now.*f.field) note(f.name, saved.*f.field, now.*f.field);
  for (const TrainReal& f : kTrainReals)
    if (saved.*f.field != now.*f.field) note(f.name, saved.*f.field, now.*f.field);
  return out;
}

}  // namespace moeut
