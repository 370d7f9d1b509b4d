// What checkpoints promise beyond a plain save and load (docs/RELIABILITY.md): a save that
// cannot be written ends cleanly with the system's reason and leaves the checkpoints before it
// whole; the manifest is checksummed and cross-checked with the rank files; it names no file
// outside its directory; one run at a time saves into a directory (the lock); what killed saves
// leave is cleared; an older checkpoint can be continued when the newer ones are given up.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <omp.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "checkpoints/checkpoint.h"
#include "checkpoints/shard_file.h"
#include "core/write_error.h"
#include "parallel/run_errors.h"
#include "small_config.h"

namespace fs = std::filesystem;

namespace moeut {
namespace {

fs::path fresh_dir(const std::string& name) { return test::fresh_test_dir("moeut_safety_" + name); }

// Saves every 2 steps of 4 into <work>/ckpt.
Config small_run(const fs::path& work) {
  Config c = test::checkpoint_run(work, 4);
  c.train.checkpoint_dir = (work / "ckpt").string();
  c.train.checkpoint_every = 2;
  return c;
}

// The parameters at the end of a run of c with its checkpoints.
std::vector<float> train(const Config& c) { return test::train_with_checkpoints(c).params; }

template <class Error>
std::string refusal(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(not refused)";
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// A run of its own that saved steps 2 and 4; step 4's directory and manifest.
struct Saved {
  Config config;
  std::string dir, manifest;
};

Saved saved_run(const std::string& name) {
  const Config c = small_run(fresh_dir(name));
  train(c);
  const std::string dir = step_directory(c.train.checkpoint_dir, 4);
  return {c, dir, (fs::path(dir) / "manifest.h5").string()};
}

#define EXPECT_HAS(text, word) EXPECT_NE(std::string(text).find(word), std::string::npos) << (text)

TEST(SaveFailure, AFullDiskEndsCleanlyNamingTheFileAndReasonAndKeepsTheCheckpointBefore) {
  const fs::path work = fresh_dir("full");
  Config c = small_run(work);
  c.train.steps = 2;
  train(c);  // step 2, whole
  const uintmax_t rank_file = fs::file_size(fs::path(step_directory(c.train.checkpoint_dir, 2)) / "rank_0.h5");
  c.train.steps = 4;
  c.train.resume = "latest";
  // The save of step 4 meets a file size limit halfway through its rank file (EFBIG, as ENOSPC
  // would be), in a child process that ends as moeut-train does: exit() runs HDF5's clean-up.
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    omp_set_num_threads(1);  // the parent's OpenMP threads are not in the child
    std::signal(SIGXFSZ, SIG_IGN);
    const rlimit limit{rank_file / 2, rank_file / 2};
    setrlimit(RLIMIT_FSIZE, &limit);
    std::string message = "no error";
    int status = 0;
    try {
      train(c);
    } catch (const WriteError& e) {
      message = e.what();
      status = kExitWriteFailed;
    } catch (const std::exception& e) {
      message = e.what();
      status = 1;
    }
    std::ofstream(work / "message.txt") << message;
    std::exit(status);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "ended by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), kExitWriteFailed);
  const std::string message = read_text(work / "message.txt");
  EXPECT_HAS(message, ".step_00000004.tmp/rank_0.h5");
  EXPECT_HAS(message, std::strerror(EFBIG));
  EXPECT_FALSE(fs::exists(work / "ckpt" / ".step_00000004.tmp")) << "the failed save was left";
  EXPECT_FALSE(fs::exists(step_directory(c.train.checkpoint_dir, 4)));
  EXPECT_EQ(latest_checkpoint(c.train.checkpoint_dir), step_directory(c.train.checkpoint_dir, 2));
  EXPECT_NO_THROW(read_checkpoint_weights(step_directory(c.train.checkpoint_dir, 2)));
  EXPECT_FALSE(fs::exists(work / "ckpt" / CheckpointLock::file_name())) << "the lock outlived the run";
}

// A run that stops at a value that is not finite while an earlier step's save is being written
// beside it finishes that save: the checkpoint is whole, not left as a hidden .tmp directory.
TEST(SaveFailure, ANonFiniteStopFinishesTheSaveWrittenBesideIt) {
  const fs::path work = fresh_dir("nonfinite");
  Config c = small_run(work);
  c.train.checkpoint_every = 1;  // step 1's save is written beside step 2
  c.train.lr = 3e37;  // step 1 moves the parameters to about 1e37 (finite), and step 2's products overflow
  try {
    train(c);
    ADD_FAILURE() << "trained through a value that is not finite";
  } catch (const AgreedError& e) {
    EXPECT_EQ(e.status, kExitNonFinite);
    EXPECT_HAS(e.what(), "step 2");
  }
  EXPECT_FALSE(fs::exists(work / "ckpt" / ".step_00000001.tmp")) << "the save beside step 2 was left unfinished";
  EXPECT_EQ(latest_checkpoint(c.train.checkpoint_dir), step_directory(c.train.checkpoint_dir, 1));
  EXPECT_NO_THROW(read_checkpoint_weights(step_directory(c.train.checkpoint_dir, 1)));
  EXPECT_FALSE(fs::exists(work / "ckpt" / CheckpointLock::file_name())) << "the lock outlived the run";
}

TEST(SaveFailure, MetricsThatCannotBeWrittenEndTheRun) {
  const fs::path work = fresh_dir("metrics");
  Config c = small_run(work);
  c.train.checkpoint_dir.clear();
  c.train.checkpoint_every = 0;
  c.train.metrics = "/dev/full";
  const std::string message = refusal<WriteError>([&] { train(c); });
  EXPECT_HAS(message, "/dev/full: cannot write the metrics: ");
  EXPECT_HAS(message, std::strerror(ENOSPC));
}

// The first byte offset at which `value` is stored (int64, little-endian) after the name of an
// attribute in an HDF5 file.
size_t attribute_value_offset(const std::string& bytes, const std::string& name, int64_t value) {
  const size_t at = bytes.find(name);
  if (at == std::string::npos) return at;
  char le[8];
  std::memcpy(le, &value, 8);
  return bytes.find(std::string(le, 8), at + name.size());
}

TEST(ManifestIntegrity, ABitOfAnyFieldIsRefusedBeforeTheRunChanges) {
  Saved s = saved_run("flip");
  Config& c = s.config;
  const fs::path manifest = s.manifest;
  std::string bytes = read_text(manifest);
  const size_t at = attribute_value_offset(bytes, "optimizer_steps", 4);
  ASSERT_NE(at, std::string::npos);
  bytes[at] = 5;  // optimizer_steps 4 -> 5, the user's report
  std::ofstream(manifest, std::ios::binary) << bytes;
  c.train.steps = 6;
  c.train.resume = "latest";
  const std::string message = refusal<CheckpointError>([&] { train(c); });
  EXPECT_HAS(message, manifest.string());
  EXPECT_HAS(message, "checksum mismatch");
}

// The manifest of the one-rank checkpoint in `dir`, with the boxes of its pieces (which
// read_manifest leaves out) from the rank file, to write again.
Manifest rewritable_manifest(const std::string& dir) {
  Manifest m = read_manifest((fs::path(dir) / "manifest.h5").string());
  m.pieces = read_shard_index((fs::path(dir) / "rank_0.h5").string(), "rank_0.h5",
                              {.rank = 0, .world_size = 1, .ep = 1, .experts = m.expert_shards[0], .step = m.step,
                               .optimizer_steps = m.optimizer_steps, .seed = m.train.seed},
                              ParamLayout(m.model));
  return m;
}

TEST(ManifestIntegrity, EveryFieldIsCrossCheckedWithTheRankFiles) {
  const Saved s = saved_run("cross");
  const Config& c = s.config;
  const std::string &dir = s.dir, &path = s.manifest;
  const Manifest saved = rewritable_manifest(dir);
  // Manifests that are whole (a valid checksum) but say another thing than the rank files.
  const std::vector<std::pair<std::string, std::function<void(Manifest&)>>> edits = {
      {"'optimizer_steps' is 4 here, 5 in the manifest", [](Manifest& m) { m.optimizer_steps = 5; }},
      {"'step' is 4 here, 3 in the manifest", [](Manifest& m) { m.step = 3; }},
      {"'seed' is", [](Manifest& m) { m.train.seed += 1; }},
      {"'expert_count' is 6 here, 5 in the manifest", [](Manifest& m) { m.expert_shards[0].count = 5; }}};
  for (const auto& [words, edit] : edits) {
    Manifest m = saved;
    edit(m);
    fs::remove(path);
    write_manifest(path, m);
    const ProcessGroups g = ProcessGroups::single();
    Trainer trainer(c, g);
    const std::string message = refusal<CheckpointError>([&] { load_checkpoint(dir, c, g, trainer.backend()); });
    EXPECT_HAS(message, (fs::path(dir) / "rank_0.h5").string());
    EXPECT_HAS(message, words);
  }
}

herr_t copy_attribute(hid_t from, const char* name, const H5A_info_t*, void* to) {
  const hid_t a = H5Aopen(from, name, H5P_DEFAULT), type = H5Aget_type(a), space = H5Aget_space(a);
  std::vector<char> value(H5Aget_storage_size(a) + 1);
  H5Aread(a, type, value.data());
  const hid_t b = H5Acreate2(*static_cast<hid_t*>(to), name, type, space, H5P_DEFAULT, H5P_DEFAULT);
  const herr_t written = H5Awrite(b, type, value.data());
  H5Aclose(b);
  H5Sclose(space);
  H5Tclose(type);
  H5Aclose(a);
  return written;
}

// Checkpoints saved before manifests had a checksum line (format version 1) still load.
TEST(ManifestIntegrity, VersionOneManifestsWithoutAChecksumLineAreStillRead) {
  Saved s = saved_run("v1");
  Config& c = s.config;
  const std::string &dir = s.dir, &path = s.manifest, v1 = path + ".v1";
  // What a version 1 writer wrote: the same groups and root attributes, no userblock.
  hid_t from = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  hid_t to = H5Fcreate(v1.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  for (const char* group : {"train", "layout", "files", "pieces"})
    ASSERT_GE(H5Ocopy(from, group, to, group, H5P_DEFAULT, H5P_DEFAULT), 0);
  ASSERT_GE(H5Aiterate2(from, H5_INDEX_NAME, H5_ITER_NATIVE, nullptr, copy_attribute, &to), 0);
  const int64_t one = 1;
  const hid_t version = H5Aopen(to, "format_version", H5P_DEFAULT);
  H5Awrite(version, H5T_NATIVE_INT64, &one);
  H5Aclose(version);
  H5Fclose(to);
  H5Fclose(from);
  fs::rename(v1, path);
  const CheckpointWeights w = read_checkpoint_weights(dir);
  c.train.checkpoint_dir.clear();
  c.train.checkpoint_every = 0;
  c.train.steps = 4;
  c.train.resume = dir;
  EXPECT_TRUE(train(c) == w.params) << "the version 1 manifest's checkpoint resumed to other parameters";
}

TEST(ManifestIntegrity, NamesNoFileOutsideItsDirectory) {
  const Saved s = saved_run("paths");
  const std::string& path = s.manifest;
  const Manifest saved = rewritable_manifest(s.dir);
  for (const std::string& name : std::vector<std::string>{"../step_00000002/rank_0.h5", "/etc/passwd", "rank_0.h5/../rank_0.h5"}) {
    Manifest m = saved;
    m.files[0] = name;
    for (Piece& p : m.pieces) p.file = name;
    fs::remove(path);
    write_manifest(path, m);
    const std::string message = refusal<std::runtime_error>([&] { read_manifest(path); });
    EXPECT_HAS(message, "lists '" + name + "' as the file of rank 0, not rank_0.h5");
  }
}

TEST(CheckpointLock, ALiveRunOfThisOrAnotherHostIsRefusedAndAGoneOneTakenOver) {
  const fs::path work = fresh_dir("lock");
  Config c = small_run(work);
  fs::create_directories(c.train.checkpoint_dir);
  const fs::path lock = fs::path(c.train.checkpoint_dir) / CheckpointLock::file_name();
  char host[256] = {};
  ASSERT_EQ(gethostname(host, sizeof host - 1), 0);
  const ProcessGroups g = ProcessGroups::single();
  for (const std::string& owner : {std::string(host) + " " + std::to_string(getpid()), std::string("elsewhere 4242")}) {
    std::ofstream(lock) << owner << "\n";
    Trainer trainer(c, g);
    const std::string message = refusal<CheckpointError>([&] { setup_checkpoints(trainer); });
    const std::string pid = owner.substr(owner.find(' ') + 1), on = owner.substr(0, owner.find(' '));
    EXPECT_HAS(message, "is in use by process " + pid + " on host " + on);
    EXPECT_EQ(read_text(lock), owner + "\n") << "a refused run touched the lock";
  }
  // A process of this host that is gone.
  const pid_t gone = fork();
  if (gone == 0) std::_Exit(0);
  ASSERT_EQ(waitpid(gone, nullptr, 0), gone);
  std::ofstream(lock) << host << " " << gone << "\n";
  {
    Trainer trainer(c, g);
    testing::internal::CaptureStdout();
    setup_checkpoints(trainer);
    const std::string out = testing::internal::GetCapturedStdout();
    EXPECT_HAS(out, "taking over the lock of " + c.train.checkpoint_dir + " from process " + std::to_string(gone));
    EXPECT_EQ(read_text(lock), std::string(host) + " " + std::to_string(getpid()) + "\n");
    trainer.run();
  }
  EXPECT_FALSE(fs::exists(lock)) << "the lock outlived the run";
}

TEST(CheckpointHousekeeping, WhatKilledSavesAndDeletionsLeaveIsRemovedAtStart) {
  const fs::path work = fresh_dir("stale");
  Config c = small_run(work);
  const fs::path dir = c.train.checkpoint_dir;
  for (const char* name : {".step_00000002.tmp", ".step_00000008.tmp", ".step_00000001.deleting"}) {
    fs::create_directories(dir / name);
    std::ofstream(dir / name / "rank_0.h5") << "partial";
  }
  testing::internal::CaptureStdout();
  train(c);
  const std::string out = testing::internal::GetCapturedStdout();
  std::vector<std::string> names;
  for (const fs::directory_entry& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"step_00000002", "step_00000004"}));
  EXPECT_HAS(out, "removed " + (dir / ".step_00000008.tmp").string() + ", left by a save or deletion that did not finish");
}

TEST(CheckpointHousekeeping, AnOlderCheckpointContinuesWhenTheNewerAreGivenUp) {
  const fs::path work = fresh_dir("older");
  Config c = small_run(work);
  const std::vector<float> straight = train(c);
  const fs::path newest = step_directory(c.train.checkpoint_dir, 4);
  fs::resize_file(newest / "rank_0.h5", fs::file_size(newest / "rank_0.h5") - 100);  // corrupt
  c.train.resume = "latest";
  EXPECT_HAS(refusal<CheckpointError>([&] { train(c); }),
             "; to continue from the checkpoint before it: --resume " + step_directory(c.train.checkpoint_dir, 2) +
                 " --discard_newer_checkpoints");
  c.train.resume = step_directory(c.train.checkpoint_dir, 2);
  EXPECT_HAS(refusal<CheckpointError>([&] { train(c); }),
             newest.string() + ": is beyond the resumed step 2 and would be overwritten; --discard_newer_checkpoints");
  c.train.discard_newer_checkpoints = true;
  EXPECT_TRUE(train(c) == straight) << "the continuation differs from the run never interrupted";
  EXPECT_NO_THROW(read_checkpoint_weights(newest.string()));
}

}  // namespace
}  // namespace moeut
