#include "checkpoints/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <random>
#include <thread>

#include "checkpoints/hdf5_common.h"
#include "checkpoints/shard_file.h"
#include "checkpoints/weights_file.h"
#include "core/write_error.h"
#include "parallel/run_errors.h"

namespace fs = std::filesystem;

namespace moeut {
namespace {

constexpr const char* kManifest = "manifest.h5";

[[noreturn]] void fail(const std::string& path, const std::string& what) { throw CheckpointError(path + ": " + what); }

// Runs `local` (no collectives in it) on every rank, then agrees on the outcome: if it threw
// anywhere, every rank throws the error of the lowest failing rank, with its message: a
// WriteError as such, anything else as CheckpointError.
void agree(Communicator& world, const std::function<void()>& local) {
  std::string error;
  bool write_error = false;
  try {
    local();
  } catch (const WriteError& e) {
    error = *e.what() ? e.what() : "unknown error";
    write_error = true;
  } catch (const std::exception& e) {
    error = *e.what() ? e.what() : "unknown error";
  }
  // Each rank's message length, then whether it was a WriteError.
  const size_t n = size_t(world.size());
  std::vector<double> lengths(2 * n, 0.0);
  lengths[size_t(world.rank())] = double(error.size());
  lengths[n + size_t(world.rank())] = write_error ? 1 : 0;
  world.all_reduce_sum(lengths);
  const auto first = std::find_if(lengths.begin(), lengths.begin() + ptrdiff_t(n), [](double x) { return x > 0; });
  if (first == lengths.begin() + ptrdiff_t(n)) return;
  std::vector<int64_t> counts(lengths.begin(), lengths.begin() + ptrdiff_t(n));
  std::vector<int64_t> offsets(counts.size(), 0);
  for (size_t r = 1; r < counts.size(); ++r) offsets[r] = offsets[r - 1] + counts[r - 1];
  std::vector<int32_t> text(size_t(offsets.back() + counts.back()));
  std::copy(error.begin(), error.end(), text.begin() + offsets[size_t(world.rank())]);
  world.all_gather_v(std::span<int32_t>(text), counts);
  const size_t r = size_t(first - lengths.begin());
  const std::string message(text.begin() + offsets[r], text.begin() + offsets[r] + counts[r]);
  if (lengths[n + r] > 0) throw WriteError(message);
  throw CheckpointError(message);
}

// Runs one part of a save: whatever fails in it is a failed write (WriteError).
void writing(const std::function<void()>& part) {
  try {
    part();
  } catch (const WriteError&) {
    throw;
  } catch (const std::exception& e) {
    throw WriteError(e.what());
  }
}

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  const bool ok = fd >= 0 && ::fsync(fd) == 0;
  const std::string reason = std::strerror(errno);
  if (fd >= 0) ::close(fd);
  if (!ok) fail(path, "cannot fsync: " + reason);
}

// The checks every rank makes before reading a byte of tensor data; the model is compared
// when one is given.
Manifest open_checkpoint(const std::string& dir, const ModelConfig* model) {
  if (!fs::exists(dir)) fail(dir, "no such checkpoint directory");
  if (!fs::is_directory(dir)) fail(dir, "not a checkpoint (not a directory)");
  const std::string manifest_path = (fs::path(dir) / kManifest).string();
  if (!fs::exists(manifest_path)) fail(dir, std::string("not a checkpoint (no ") + kManifest + ")");
  Manifest m = read_manifest(manifest_path);
  const std::string diff = model ? h5::model_difference(m.model, "the checkpoint", *model, "this run") : "";
  if (!diff.empty()) fail(manifest_path, "saved from another model: " + diff);
  for (size_t r = 0; r < m.files.size(); ++r) {
    const std::string path = (fs::path(dir) / m.files[r]).string();
    if (!fs::exists(path)) fail(path, "missing (the manifest lists it)");
    const int64_t bytes = int64_t(fs::file_size(path));
    if (bytes != m.file_bytes[r])
      fail(path, std::string(bytes < m.file_bytes[r] ? "truncated" : "changed") + ": " + std::to_string(bytes) +
                     " bytes, the manifest says " + std::to_string(m.file_bytes[r]));
  }
  return m;
}

// Elements [begin, begin + count) of `tensor` go to dst.
struct Need {
  std::string tensor;
  int64_t begin = 0, count = 0;
  float* dst = nullptr;
};

// Fills every need of `kind` from the pieces that overlap it, reading each such piece once:
// straight into place when one need holds all of it (a layout reading its own pieces), else
// into a scratch buffer to copy from.
void read_needs(PieceReader& reader, const Manifest& m, Kind kind, const std::vector<Need>& needs) {
  std::map<std::string, std::vector<const Need*>> wanted;
  for (const Need& n : needs) wanted[n.tensor].push_back(&n);
  std::vector<float> scratch;
  for (const Piece& p : m.pieces) {
    const auto it = p.kind == kind ? wanted.find(p.tensor) : wanted.end();
    if (it == wanted.end()) continue;
    const int64_t end = p.offset + p.elements;
    std::vector<const Need*> overlapping;
    for (const Need* n : it->second)
      if (std::max(p.offset, n->begin) < std::min(end, n->begin + n->count)) overlapping.push_back(n);
    if (overlapping.empty()) continue;
    const Need* whole = overlapping.front();
    if (overlapping.size() == 1 && whole->begin <= p.offset && end <= whole->begin + whole->count) {
      reader.read(p, whole->dst + (p.offset - whole->begin));
      continue;
    }
    scratch.resize(size_t(p.elements));
    reader.read(p, scratch.data());
    for (const Need* n : overlapping) {
      const int64_t lo = std::max(p.offset, n->begin), hi = std::min(end, n->begin + n->count);
      std::copy_n(scratch.data() + (lo - p.offset), hi - lo, n->dst + (lo - n->begin));
    }
  }
}

// This rank's part of the optimizer state, all zero: fresh moments, no steps taken.
OptimizerShard zero_shard(const ZeroPartition& partition) {
  const size_t n = size_t(partition.owned_elements());
  return {.master = std::vector<float>(n), .m = std::vector<float>(n), .v = std::vector<float>(n), .steps = 0};
}

// The interchange file `path` for a run of `run`; refuses (ConfigError naming the option, the
// file and the problem) one that cannot be read or holds another model.
Weights read_initial_weights(const std::string& path, const ModelConfig& run) {
  Weights w;
  try {
    w = read_weights(path);
  } catch (const WeightsError& e) {
    throw ConfigError(std::string("--init_weights ") + e.what());
  }
  w.config.context = run.context;  // not part of the file
  const std::string diff = h5::model_difference(w.config, "the file", run, "this run");
  if (!diff.empty()) throw ConfigError("--init_weights " + path + ": " + diff);
  return w;
}

}  // namespace

struct CheckpointWriter::Pending {
  int64_t step = 0, optimizer_steps = 0;
  std::string target;
  fs::path tmp;
  std::chrono::steady_clock::time_point begin;
  double stall = 0;
  std::thread writer;  // this rank's file
  std::string error;   // what the writer threw, if it did
  double bytes = 0;    // of this rank's file
};

// Agrees on `local` (agree() above). When it failed anywhere, rank 0 removes what the save had
// written (its .tmp directory), so that a failed save leaves nothing but the checkpoints before it.
void CheckpointWriter::agree_or_discard(const Pending& p, const std::function<void()>& local) {
  Communicator& world = *groups_.world;
  try {
    agree(world, local);
  } catch (const std::exception&) {
    std::error_code ec;
    if (world.rank() == 0 && fs::remove_all(p.tmp, ec) == static_cast<std::uintmax_t>(-1))
      std::fprintf(stderr, "warning: %s: cannot remove the failed save: %s\n", p.tmp.c_str(), ec.message().c_str());
    throw;
  }
}

CheckpointWriter::CheckpointWriter(std::string checkpoint_dir, int64_t keep, const Config& c,
                                   const ProcessGroups& groups, TrainingBackend& backend)
    : dir_(std::move(checkpoint_dir)), keep_(keep), config_(c), groups_(groups), backend_(backend) {}

CheckpointWriter::~CheckpointWriter() {
  if (pending_ && pending_->writer.joinable()) pending_->writer.join();
}

std::optional<SaveReport> CheckpointWriter::start(int64_t step) {
  std::optional<SaveReport> previous = finish();
  Communicator& world = *groups_.world;
  auto p = std::make_unique<Pending>();
  p->begin = std::chrono::steady_clock::now();
  p->step = step;
  p->target = step_directory(dir_, step);
  p->tmp = hidden(p->target, "tmp");
  const bool leader = world.rank() == 0;
  agree(world, [&] {
    if (leader && fs::exists(p->target)) fail(p->target, "exists already; a checkpoint is never overwritten");
  });
  agree_or_discard(*p, [&] {
    if (!leader) return;
    writing([&] {
      fs::remove_all(p->tmp);  // left by a save that was killed
      fs::create_directories(p->tmp);
    });
  });
  OptimizerShard shard;
  agree_or_discard(*p, [&] { shard = backend_.optimizer_shard(); });  // off the device, if there
  p->optimizer_steps = shard.steps;
  const std::string path = (p->tmp / rank_file_name(world.rank())).string();
  const ShardHeader header{world.rank(), world.size(), groups_.ep(), backend_.layout().shard(), step, shard.steps,
                           config_.train.seed};
  std::vector<OwnedRange> ranges = owned_ranges(backend_.layout(), backend_.partition());
  Pending* const q = p.get();
  // Nothing thrown leaves the thread: finish() hands what it caught to every rank.
  p->writer = std::thread([q, path, header, ranges = std::move(ranges), shard = std::move(shard), model = config_.model] {
    try {
      write_shard_file(path, header, ParamLayout(model), ranges, shard);
      q->bytes = double(fs::file_size(path));
    } catch (const std::exception& e) {
      q->error = *e.what() ? e.what() : "unknown error";
    }
  });
  copy_seconds_ = p->stall = std::chrono::duration<double>(std::chrono::steady_clock::now() - p->begin).count();
  pending_ = std::move(p);
  return previous;
}

std::optional<SaveReport> CheckpointWriter::finish() {
  if (!pending_) return std::nullopt;
  const std::unique_ptr<Pending> p = std::move(pending_);
  const auto wait_begin = std::chrono::steady_clock::now();
  p->writer.join();
  Communicator& world = *groups_.world;
  agree_or_discard(*p, [&] {
    if (!p->error.empty()) throw WriteError(p->error);
  });
  double bytes = p->bytes;
  world.all_reduce_sum(std::span<double>(&bytes, 1));
  SaveReport report{p->target, p->step, world.size() + 1, int64_t(bytes), 0, 0};
  agree_or_discard(*p, [&] {
    if (world.rank() != 0) return;
    const ParamLayout full(config_.model);
    Manifest m;
    m.model = config_.model;
    m.train = config_.train;
    m.step = p->step;
    m.optimizer_steps = p->optimizer_steps;
    m.world_size = world.size();
    m.ep = groups_.ep();
    for (int64_t j = 0; j < m.ep; ++j) m.expert_shards.push_back(expert_shard(config_.model.ff_n_experts, m.ep, j));
    for (int64_t r = 0; r < m.world_size; ++r) {
      const std::string name = rank_file_name(r), path = (p->tmp / name).string();
      const ShardHeader expected{.rank = r,
                                 .world_size = m.world_size,
                                 .ep = m.ep,
                                 .experts = m.expert_shards[size_t(r % m.ep)],
                                 .step = m.step,
                                 .optimizer_steps = m.optimizer_steps,
                                 .seed = m.train.seed};
      const std::vector<Piece> pieces = read_shard_index(path, name, expected, full);
      m.pieces.insert(m.pieces.end(), pieces.begin(), pieces.end());
      m.files.push_back(name);
      m.file_bytes.push_back(int64_t(fs::file_size(path)));
    }
    writing([&] {
      const std::string manifest = (p->tmp / kManifest).string();
      write_manifest(manifest, m);
      fsync_path(manifest, false);
      fsync_path(p->tmp.string(), true);
      report.bytes += int64_t(fs::file_size(manifest));
      fs::rename(p->tmp, p->target);  // the checkpoint appears whole, or not at all
      fsync_path(dir_, true);
      // Rotation: the oldest beyond `keep` go.
      std::map<int64_t, fs::path> all = complete_checkpoints(dir_);
      for (auto it = all.begin(); keep_ > 0 && int64_t(all.size()) > keep_; it = all.erase(it))
        discard_checkpoint(it->second);
    });
  });
  const auto now = std::chrono::steady_clock::now();
  report.seconds = std::chrono::duration<double>(now - p->begin).count();
  report.stall_seconds = p->stall + std::chrono::duration<double>(now - wait_begin).count();
  return report;
}

SaveReport save_checkpoint(const std::string& checkpoint_dir, int64_t step, int64_t keep, const Config& c,
                           const ProcessGroups& groups, TrainingBackend& backend) {
  CheckpointWriter writer(checkpoint_dir, keep, c, groups, backend);
  writer.start(step);
  return *writer.finish();
}

Manifest load_checkpoint(const std::string& dir, const Config& c, const ProcessGroups& groups,
                         TrainingBackend& backend) {
  Manifest m;
  OptimizerShard shard;
  agree(*groups.world, [&] {
    m = open_checkpoint(dir, &c.model);
    const std::vector<OwnedRange> ranges = owned_ranges(backend.layout(), backend.partition());
    shard = zero_shard(backend.partition());
    shard.steps = m.optimizer_steps;
    PieceReader reader(dir, m);
    for (Kind k : kKinds) {
      std::vector<float>& to = k == Kind::kParam ? shard.master : k == Kind::kExpAvg ? shard.m : shard.v;
      std::vector<Need> needs;
      for (const OwnedRange& r : ranges) needs.push_back({r.tensor, r.begin, r.count, to.data() + r.state_offset});
      read_needs(reader, m, k, needs);
    }
  });
  backend.load_optimizer_shard(shard);
  return m;
}

void load_initial_weights(const std::string& path, const Config& c, const ProcessGroups& groups,
                          TrainingBackend& backend) {
  OptimizerShard shard;
  agree_on(*groups.world, [&] {
    const Weights w = read_initial_weights(path, c.model);
    const ParamLayout full(c.model);
    shard = zero_shard(backend.partition());
    for (const OwnedRange& r : owned_ranges(backend.layout(), backend.partition()))
      std::copy_n(w.params.data() + full.at(r.tensor).offset + r.begin, r.count, shard.master.data() + r.state_offset);
  });
  backend.load_optimizer_shard(shard);
}

CheckpointWeights read_checkpoint_weights(const std::string& dir) {
  try {
    const Manifest m = open_checkpoint(dir, nullptr);
    CheckpointWeights w{m.model, m.step, {}};
    const ParamLayout layout(w.model);
    w.params.resize(size_t(layout.total()));
    std::vector<Need> needs;
    for (const TensorSpec& t : layout.tensors()) needs.push_back({t.name, 0, t.numel, w.params.data() + t.offset});
    PieceReader reader(dir, m);
    read_needs(reader, m, Kind::kParam, needs);
    return w;
  } catch (const CheckpointError&) {
    throw;
  } catch (const std::exception& e) {
    throw CheckpointError(e.what());
  }
}

namespace {

// Every rank must see one checkpoint directory (each writes its own file of a checkpoint there,
// and a resumed run reads them all): rank 0 leaves a probe file named by a token this run drew,
// and every rank looks for it.
void check_shared(Communicator& world, const std::string& dir) {
  std::random_device entropy;
  double token[1] = {world.rank() == 0 ? double(entropy()) : 0.0};
  world.all_reduce_sum(std::span<double>(token, 1));
  char name[48];
  std::snprintf(name, sizeof name, ".moeut-shared-probe-%.0f", token[0]);
  const fs::path probe = fs::path(dir) / name;
  agree(world, [&] {
    if (world.rank() != 0) return;
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) fail(dir, "cannot create the checkpoint directory: " + ec.message());
    std::FILE* f = std::fopen(probe.c_str(), "w");
    if (!f || std::fclose(f) != 0) fail(dir, "cannot write in the checkpoint directory");
  });
  try {
    agree(world, [&] {
      if (!fs::exists(probe))
        fail(dir, "is not the directory rank 0 sees (rank " + std::to_string(world.rank()) +
                      " finds no " + name + " there): checkpoint_dir must be on a filesystem every rank shares, "
                      "at the same path");
    });
  } catch (...) {
    std::error_code ignored;
    if (world.rank() == 0) fs::remove(probe, ignored);
    throw;
  }
  std::error_code ignored;
  if (world.rank() == 0) fs::remove(probe, ignored);
}

// --init_weights: the run's parameters from the file, unless a checkpoint was resumed (`resumed`),
// which wins. Rank 0 says which.
void start_from_weights(Trainer& trainer, bool resumed) {
  const TrainConfig& t = trainer.config().train;
  const bool leader = trainer.groups().world->rank() == 0;
  if (resumed) {
    if (leader) std::printf("--init_weights %s not read: the resumed checkpoint holds the weights\n", t.init_weights.c_str());
  } else {
    const auto begin = std::chrono::steady_clock::now();
    load_initial_weights(t.init_weights, trainer.config(), trainer.groups(), trainer.backend());
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    if (leader) std::printf("initial weights from %s | fresh optimizer state | loaded in %.3f s\n", t.init_weights.c_str(), seconds);
  }
  std::fflush(stdout);
}

}  // namespace

void setup_checkpoints(Trainer& trainer) {
  const Config& c = trainer.config();
  const TrainConfig& t = c.train;
  const ProcessGroups& groups = trainer.groups();
  Communicator& world = *groups.world;
  const bool leader = world.rank() == 0;
  int64_t start = 0;
  // Rank 0 holds the directory's lock from here until the trainer lets go of its hook.
  std::shared_ptr<CheckpointLock> lock;
  if (!t.checkpoint_dir.empty()) {
    check_shared(world, t.checkpoint_dir);
    agree(world, [&] {
      if (!leader) return;
      auto note = [](const std::string& what) { std::printf("note: %s\n", what.c_str()); };
      lock = std::make_shared<CheckpointLock>(t.checkpoint_dir, note);
      for (const std::string& path : remove_stale_directories(t.checkpoint_dir))
        note("removed " + path + ", left by a save or deletion that did not finish");
      std::fflush(stdout);
    });
  }
  std::string dir = t.resume;
  agree(world, [&] {
    if (t.resume != "latest" && t.resume != "auto") return;
    dir = latest_checkpoint(t.checkpoint_dir);
    if (dir.empty() && t.resume == "latest")
      fail(t.checkpoint_dir, "--resume latest: no complete checkpoint (step_<N>/manifest.h5) here");
  });
  if (dir.empty() && leader && t.resume == "auto") {
    std::printf("--resume auto: no complete checkpoint in %s, starting fresh\n", t.checkpoint_dir.c_str());
    std::fflush(stdout);
  }
  if (!dir.empty()) {
    const auto begin = std::chrono::steady_clock::now();
    const Manifest m = [&] {
      try {
        return load_checkpoint(dir, c, groups, trainer.backend());
      } catch (const CheckpointError& e) {
        // The same on every rank: they see the same directory.
        const std::map<int64_t, fs::path> all = complete_checkpoints(t.checkpoint_dir);
        if (t.resume != "latest" && t.resume != "auto") throw;
        if (all.size() < 2) throw;
        throw CheckpointError(std::string(e.what()) + "; to continue from the checkpoint before it: --resume " +
                              std::prev(all.end(), 2)->second.string() + " --discard_newer_checkpoints");
      }
    }();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    if (m.step > t.steps)  // the same on every rank: they read the same manifest
      fail(dir, "is at step " + std::to_string(m.step) + ", beyond --steps " + std::to_string(t.steps));
    start = m.step;
    trainer.start_at(start);
    if (leader) {
      std::printf("resumed from %s: step %lld, saved by world %lld, ep %lld | loaded in %.3f s\n", dir.c_str(),
                  (long long)m.step, (long long)m.world_size, (long long)m.ep, seconds);
      for (const std::string& d : train_differences(m.train, t)) std::printf("  training option changed: %s\n", d.c_str());
      std::fflush(stdout);
    }
  }
  if (!t.init_weights.empty()) start_from_weights(trainer, !dir.empty());
  if (t.checkpoint_dir.empty()) return;
  // Saves go to steps after `start`; a complete checkpoint there belongs to another run (or
  // to this one beyond the step resumed from), and would be overwritten or rotated away.
  // With --discard_newer_checkpoints, rank 0 deletes those beyond the resumed step instead.
  agree(world, [&] {
    const std::map<int64_t, fs::path> all = complete_checkpoints(t.checkpoint_dir);
    const auto beyond = all.upper_bound(start);
    if (beyond == all.end()) return;
    if (start == 0)
      fail(t.checkpoint_dir, "holds checkpoints already (the newest is " + all.rbegin()->second.filename().string() +
                                 "); continue them with --resume latest, or choose another checkpoint_dir");
    if (!t.discard_newer_checkpoints)
      fail(beyond->second.string(), "is beyond the resumed step " + std::to_string(start) +
                                        " and would be overwritten; --discard_newer_checkpoints deletes the "
                                        "checkpoints beyond it, or choose another checkpoint_dir");
  });
  agree(world, [&] {
    if (!leader || !t.discard_newer_checkpoints) return;
    const std::map<int64_t, fs::path> all = complete_checkpoints(t.checkpoint_dir);
    for (auto it = all.upper_bound(start); it != all.end(); ++it) {
      std::printf("--discard_newer_checkpoints: deleting %s (beyond the resumed step %lld)\n", it->second.c_str(),
                  (long long)start);
      std::fflush(stdout);
      discard_checkpoint(it->second);
    }
  });
  // Saves before the last are written beside the steps that follow (the next save, or the last,
  // finishes them); the last one, and one for a stop, is whole before the run goes on.
  auto writer = std::make_shared<CheckpointWriter>(t.checkpoint_dir, t.keep_checkpoints, c, groups, trainer.backend());
  auto report = [leader](const SaveReport& r) {
    if (!leader) return;
    std::printf("checkpoint step %lld -> %s | %lld files, %.2f MB | whole after %.3f s, training waited %.3f s\n",
                (long long)r.step, r.directory.c_str(), (long long)r.files, r.bytes / 1e6, r.seconds, r.stall_seconds);
    std::fflush(stdout);
  };
  // The hooks hold the lock (rank 0) and the writer for as long as the trainer holds them.
  trainer.after_step([&trainer, writer, lock, leader, report](int64_t step) {
    const TrainConfig& t = trainer.config().train;
    const bool last = step == t.steps || trainer.stopping();
    if (!(last || (t.checkpoint_every > 0 && step % t.checkpoint_every == 0))) return;
    if (const auto done = writer->start(step)) report(*done);
    if (last) {
      report(*writer->finish());
    } else if (leader) {
      std::printf("checkpoint step %lld: state taken in %.3f s, written beside training\n", (long long)step,
                  writer->copy_seconds());
      std::fflush(stdout);
    }
  });
  // A run stopped by a non-finite value or bad data keeps the save of an earlier step that was
  // being written beside it: it is finished, whole, before the run ends.
  trainer.on_agreed_stop([writer, lock, report] {
    if (const auto done = writer->finish()) report(*done);
  });
}

}  // namespace moeut
