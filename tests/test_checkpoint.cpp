// Sharded checkpoints in one process: the box decomposition and ownership maps they are built
// on, bit-exact resume, the manifest's virtual datasets read through HDF5 itself, rotation,
// export, and every refusal with a message naming the file and the problem. Multi-rank saving,
// resharding and agreement on errors are in tests/mpi/test_checkpoint.cpp; a kill during a
// save in tests/cli_checkpoints.sh.
#include <gtest/gtest.h>
#include <hdf5.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>

#include "checkpoints/checkpoint.h"
#include "checkpoints/tensor_ranges.h"
#include "small_config.h"

namespace fs = std::filesystem;

namespace moeut {
namespace {

fs::path temp(const std::string& name) { return fs::path(testing::TempDir()) / ("moeut_ckpt_" + name); }

fs::path fresh_dir(const std::string& name) {
  const fs::path d = temp(name);
  fs::remove_all(d);
  return d;
}

Config small_run(const std::string& tag) {
  return test::small_run(test::kCheckpointModel,
                         {.steps = 20, .batch_size = 4, .micro_batch_size = 2, .warmup_steps = 3,
                          .train_data = temp("train_" + tag + ".bin").string(),
                          .val_data = temp("val_" + tag + ".bin").string(),
                          .metrics = temp("metrics_" + tag + ".jsonl").string()});
}

using Outcome = test::TrainedRun;
constexpr auto train = &test::train_with_checkpoints;

// A 6-step run saved at steps 3 and 6 into a directory of its own.
Config saved_run(const std::string& name) {
  Config c = small_run(name);
  c.train.steps = 6;
  c.train.checkpoint_every = 3;
  c.train.checkpoint_dir = fresh_dir(name).string();
  train(c);
  return c;
}

// A copy of a saved checkpoint to break.
std::string copy_of(const std::string& step_dir, const std::string& name) {
  const fs::path d = fresh_dir(name);
  fs::copy(step_dir, d, fs::copy_options::recursive);
  return d.string();
}

void expect_load_refused(const std::string& dir, const Config& c, const std::vector<std::string>& words) {
  const ProcessGroups g = ProcessGroups::single();
  Trainer trainer(c, g);
  try {
    load_checkpoint(dir, c, g, trainer.backend());
    ADD_FAILURE() << dir << " was loaded";
  } catch (const CheckpointError& e) {
    for (const std::string& w : words) EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what();
  }
}

TEST(FlatRangeBoxes, TileEveryRangeInOrderWithAtMostTwoPerDimensionLessOne) {
  for (const std::vector<int64_t>& shape :
       std::vector<std::vector<int64_t>>{{7}, {3, 4}, {2, 3, 4}, {3, 1, 5}, {2, 3, 2, 3}}) {
    const int64_t n = std::accumulate(shape.begin(), shape.end(), int64_t(1), std::multiplies<>());
    for (int64_t b = 0; b <= n; ++b)
      for (int64_t e = b; e <= n; ++e) {
        const std::vector<Box> boxes = flat_range_boxes(shape, b, e);
        EXPECT_LE(boxes.size(), 2 * shape.size() - 1);
        int64_t next = b;
        for (const Box& box : boxes) {
          ASSERT_EQ(box.start.size(), shape.size());
          const int64_t count = std::accumulate(box.count.begin(), box.count.end(), int64_t(1), std::multiplies<>());
          std::vector<int64_t> last(shape.size());
          for (size_t d = 0; d < shape.size(); ++d) {
            ASSERT_GT(box.count[d], 0);
            last[d] = box.start[d] + box.count[d] - 1;
            ASSERT_LT(last[d], shape[d]);
          }
          EXPECT_EQ(flat_index(shape, box.start), next) << "range " << b << ".." << e;
          EXPECT_EQ(flat_index(shape, last), next + count - 1) << "not contiguous";
          next += count;
        }
        EXPECT_EQ(next, e);
      }
  }
}

TEST(OwnedRanges, CoverEveryElementOnceWithExpertsInGlobalCoordinates) {
  const ModelConfig m = small_run("owned").model;
  const ParamLayout full(m);
  const ProcessGroups g = ProcessGroups::single();
  const ParamLayout local(m, expert_shard(m.ff_n_experts, 3, 1));  // experts 2, 3 of 6
  const ZeroPartition partition(local, g, 500);                      // several buckets
  std::map<std::string, std::vector<int64_t>> hits;
  int64_t state = 0;
  for (const OwnedRange& r : owned_ranges(local, partition)) {
    EXPECT_EQ(r.state_offset, state);
    state += r.count;
    std::vector<int64_t>& h = hits[r.tensor];
    h.resize(size_t(full.at(r.tensor).numel));
    for (int64_t i = r.begin; i < r.begin + r.count; ++i) ++h[size_t(i)];
  }
  EXPECT_EQ(state, partition.owned_elements());
  for (const TensorSpec& t : local.tensors()) {
    const std::vector<int64_t>& h = hits.at(t.name);
    const int64_t row = t.expert ? t.numel / t.shape[0] : 0;
    for (int64_t i = 0; i < int64_t(h.size()); ++i) {
      const bool mine = !t.expert || (i >= 2 * row && i < 4 * row);
      ASSERT_EQ(h[size_t(i)], mine ? 1 : 0) << t.name << " element " << i;
    }
  }
}

TEST(Checkpoint, ResumeContinuesBitExactly) {
  Config straight = small_run("straight");
  const Outcome reference = train(straight);

  Config saving = small_run("saving");
  saving.train.checkpoint_dir = fresh_dir("exact").string();
  saving.train.checkpoint_every = 10;
  const Outcome first = train(saving);
  EXPECT_EQ(first.losses, reference.losses) << "saving changed the run";
  EXPECT_TRUE(fs::exists(step_directory(saving.train.checkpoint_dir, 10)));
  EXPECT_TRUE(fs::exists(step_directory(saving.train.checkpoint_dir, 20)));

  Config resumed = small_run("resumed");
  resumed.train.resume = step_directory(saving.train.checkpoint_dir, 10);
  const Outcome second = train(resumed);
  ASSERT_EQ(second.losses.size(), 10u);
  for (size_t s = 0; s < 10; ++s) EXPECT_EQ(second.losses[s], reference.losses[10 + s]) << "step " << 11 + s;
  EXPECT_TRUE(second.params == reference.params) << "parameters after 20 steps differ";
  EXPECT_TRUE(read_checkpoint_weights(step_directory(saving.train.checkpoint_dir, 20)).params == reference.params);
}

// Reads a whole dataset of the manifest, through its virtual dataset mappings.
std::vector<float> read_virtual(const std::string& manifest, const std::string& name, std::vector<hsize_t>& dims) {
  hid_t f = H5Fopen(manifest.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  hid_t d = H5Dopen2(f, name.c_str(), H5P_DEFAULT);
  hid_t space = H5Dget_space(d), dcpl = H5Dget_create_plist(d);
  EXPECT_EQ(H5Pget_layout(dcpl), H5D_VIRTUAL) << name;
  dims.assign(size_t(H5Sget_simple_extent_ndims(space)), 0);
  H5Sget_simple_extent_dims(space, dims.data(), nullptr);
  std::vector<float> out(size_t(H5Sget_simple_extent_npoints(space)));
  EXPECT_GE(H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()), 0) << name;
  H5Pclose(dcpl);
  H5Sclose(space);
  H5Dclose(d);
  H5Fclose(f);
  return out;
}

TEST(Checkpoint, ManifestPresentsEveryTensorAsOneVirtualDatasetThatMovesWithTheDirectory) {
  const Config c = saved_run("vds");
  const std::string moved = copy_of(step_directory(c.train.checkpoint_dir, 6), "vds_moved");
  const std::string manifest = (fs::path(moved) / "manifest.h5").string();
  const CheckpointWeights w = read_checkpoint_weights(moved);
  const ParamLayout layout(c.model);
  const fs::path cwd = fs::current_path();
  fs::current_path(fs::temp_directory_path());  // relative source names resolve beside the manifest
  for (const TensorSpec& t : layout.tensors()) {
    std::vector<hsize_t> dims;
    const std::vector<float> values = read_virtual(manifest, t.name, dims);
    EXPECT_EQ(std::vector<int64_t>(dims.begin(), dims.end()), t.shape) << t.name;
    EXPECT_EQ(0, std::memcmp(values.data(), w.params.data() + t.offset, size_t(t.numel) * sizeof(float))) << t.name;
    for (const std::string moment : {"exp_avg", "exp_avg_sq"}) {
      const std::vector<float> m = read_virtual(manifest, moment + "/" + t.name, dims);
      const bool squares = moment == "exp_avg_sq";
      EXPECT_TRUE(std::all_of(m.begin(), m.end(), [&](float x) { return std::isfinite(x) && (!squares || x >= 0); }))
          << moment << "/" << t.name << " has unmapped (NaN) elements, or negative squares";
    }
  }
  fs::current_path(cwd);
}

TEST(Checkpoint, KeepsTheNewestAndIgnoresUnfinishedDirectories) {
  Config c = small_run("keep");
  c.train.steps = 8;
  c.train.checkpoint_every = 2;
  c.train.keep_checkpoints = 2;
  c.train.checkpoint_dir = fresh_dir("keep").string();
  train(c);
  std::vector<std::string> names;
  for (const fs::directory_entry& e : fs::directory_iterator(c.train.checkpoint_dir))
    names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"step_00000006", "step_00000008"}));

  // What a killed save or deletion leaves behind is not a checkpoint.
  fs::create_directories(fs::path(c.train.checkpoint_dir) / ".step_00000010.tmp");
  fs::create_directories(fs::path(c.train.checkpoint_dir) / ".step_00000002.deleting");
  fs::create_directories(fs::path(c.train.checkpoint_dir) / "step_00000012");  // no manifest
  EXPECT_EQ(latest_checkpoint(c.train.checkpoint_dir), step_directory(c.train.checkpoint_dir, 8));
}

TEST(Checkpoint, ResumeLatestContinuesTheNewest) {
  Config c = saved_run("latest");
  c.train.steps = 8;
  c.train.resume = "latest";
  c.train.metrics = temp("metrics_latest_resumed.jsonl").string();
  const Outcome r = train(c);  // steps 7 and 8, saved as step 8
  EXPECT_EQ(r.losses.size(), 2u);
  EXPECT_EQ(latest_checkpoint(c.train.checkpoint_dir), step_directory(c.train.checkpoint_dir, 8));
}

TEST(CheckpointRefusal, MissingShardFile) {
  const Config c = saved_run("refuse_missingshardfile");
  const std::string dir = copy_of(step_directory(c.train.checkpoint_dir, 6), "missing");
  fs::remove(fs::path(dir) / "rank_0.h5");
  expect_load_refused(dir, c, {"rank_0.h5", "missing"});
}

TEST(CheckpointRefusal, TruncatedShardFile) {
  const Config c = saved_run("refuse_truncatedshardfile");
  const std::string dir = copy_of(step_directory(c.train.checkpoint_dir, 6), "truncated");
  const fs::path shard = fs::path(dir) / "rank_0.h5";
  fs::resize_file(shard, fs::file_size(shard) / 2);
  expect_load_refused(dir, c, {"rank_0.h5", "truncated"});
}

TEST(CheckpointRefusal, ChecksumMismatch) {
  const Config c = saved_run("refuse_checksummismatch");
  const std::string dir = copy_of(step_directory(c.train.checkpoint_dir, 6), "corrupt");
  const std::string shard = (fs::path(dir) / "rank_0.h5").string();
  const std::string dataset = "transformer.layers.0.ffn.keys/exp_avg/0";
  hid_t f = H5Fopen(shard.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  hid_t d = H5Dopen2(f, dataset.c_str(), H5P_DEFAULT);
  const haddr_t at = H5Dget_offset(d);
  H5Dclose(d);
  H5Fclose(f);
  ASSERT_NE(at, HADDR_UNDEF);
  std::fstream bytes(shard, std::ios::in | std::ios::out | std::ios::binary);
  bytes.seekg(std::streamoff(at) + 5);
  const char old = char(bytes.get());
  bytes.seekp(std::streamoff(at) + 5);
  bytes.put(char(old ^ 0x10));  // one bit of one moment: a size check cannot see it
  bytes.close();
  expect_load_refused(dir, c, {"rank_0.h5", dataset, "checksum mismatch"});
  try {
    read_checkpoint_weights(dir);  // export reads only parameters: not the corrupt moment
  } catch (const CheckpointError& e) {
    ADD_FAILURE() << e.what();
  }
}

TEST(CheckpointRefusal, ManifestOfAnotherModel) {
  const Config c = saved_run("refuse_manifestofanothermodel");
  Config other = small_run("other");
  other.model.ff_expert_size = 12;
  expect_load_refused(step_directory(c.train.checkpoint_dir, 6), other,
                      {"manifest.h5", "another model", "ff_expert_size is 8 in the checkpoint, 12 in this run"});
}

TEST(CheckpointRefusal, DirectoriesThatAreNotCheckpoints) {
  const Config c = saved_run("refuse_directoriesthatarenotcheckpoints");
  const fs::path empty = fresh_dir("empty");
  fs::create_directories(empty);
  expect_load_refused(empty.string(), c, {empty.string(), "not a checkpoint (no manifest.h5)"});
  expect_load_refused(temp("nowhere").string(), c, {temp("nowhere").string(), "no such checkpoint directory"});
  expect_load_refused(c.train.train_data, c, {c.train.train_data, "not a directory"});
  // An HDF5 file that is no manifest (a rank file under the manifest's name).
  const std::string dir = copy_of(step_directory(c.train.checkpoint_dir, 6), "foreign");
  fs::copy_file(fs::path(dir) / "rank_0.h5", fs::path(dir) / "manifest.h5", fs::copy_options::overwrite_existing);
  expect_load_refused(dir, c, {"manifest.h5", "not a checkpoint manifest"});
}

void expect_setup_refused(const Config& c, const std::vector<std::string>& words) {
  const ProcessGroups g = ProcessGroups::single();
  Trainer trainer(c, g);
  try {
    setup_checkpoints(trainer);
    ADD_FAILURE() << "set up";
  } catch (const CheckpointError& e) {
    for (const std::string& w : words) EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what();
  }
}

TEST(CheckpointRefusal, ResumeLatestWithoutACheckpoint) {
  Config c = small_run("none");
  c.train.checkpoint_dir = fresh_dir("none").string();
  c.train.resume = "latest";
  expect_setup_refused(c, {c.train.checkpoint_dir, "no complete checkpoint"});
}

TEST(CheckpointRefusal, ResumeBeyondTheLastStep) {
  Config c = saved_run("refuse_resumebeyondthelaststep");
  c.train.steps = 5;
  c.train.resume = step_directory(c.train.checkpoint_dir, 6);
  c.train.checkpoint_dir.clear();
  c.train.checkpoint_every = 0;
  expect_setup_refused(c, {"step_00000006", "beyond --steps 5"});
}

TEST(CheckpointRefusal, NeverOverwritesAGoodCheckpoint) {
  const Config saved = saved_run("refuse_neveroverwritesagoodcheckpoint");
  const std::string good = step_directory(saved.train.checkpoint_dir, 6);
  const auto before = fs::last_write_time(fs::path(good) / "manifest.h5");
  // A fresh run into a directory that holds checkpoints: refused before any step.
  Config fresh = small_run("fresh");
  fresh.train.checkpoint_dir = saved.train.checkpoint_dir;
  expect_setup_refused(fresh, {saved.train.checkpoint_dir, "step_00000006", "--resume latest"});
  // Resuming an older step would save over a newer one: refused before any step.
  Config older = saved;
  older.train.resume = step_directory(saved.train.checkpoint_dir, 3);
  expect_setup_refused(older, {good, "beyond the resumed step 3"});
  // And a save into an existing step directory refuses, leaving it as it was.
  const ProcessGroups g = ProcessGroups::single();
  Trainer trainer(small_run("overwrite"), g);
  try {
    save_checkpoint(saved.train.checkpoint_dir, 6, 0, trainer.config(), g, trainer.backend());
    ADD_FAILURE() << "overwrote " << good;
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("never overwritten"), std::string::npos) << e.what();
  }
  EXPECT_EQ(fs::last_write_time(fs::path(good) / "manifest.h5"), before);
  EXPECT_NO_THROW(read_checkpoint_weights(good));
}

}  // namespace
}  // namespace moeut
