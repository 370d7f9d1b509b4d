// Checkpoints over MPI ranks, run under `mpirun -np N` with --ep=E (tests/CMakeLists.txt): the
// same layout resumes bit-exactly; with 4 ranks, a checkpoint of (np, ep) = (4, 4) resumes on
// (2, 1), whose checkpoint resumes on (1, 1), with the losses of the original layout; and a
// corrupt piece that one rank alone reads makes every rank refuse, with that rank's message.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "checkpoints/checkpoint.h"
#include "mpi/mpi_test.h"
#include "parallel/mpi_communicator.h"

namespace fs = std::filesystem;

namespace moeut {
namespace {

// A directory every rank sees, empty; its name holds the world size, as ctest runs the
// np 1, 2 and 4 variants at the same time.
std::string shared_dir(const std::string& name) {
  const fs::path d = fs::path(testing::TempDir()) / ("moeut_mpi_ckpt_np" + std::to_string(world_size()) + "_" + name);
  if (world_rank() == 0) fs::remove_all(d);
  MPI_Barrier(MPI_COMM_WORLD);
  return d.string();
}

std::string rank_file(const std::string& name) {
  return (fs::path(testing::TempDir()) /
          ("moeut_mpi_ckpt_np" + std::to_string(world_size()) + "_ep" + std::to_string(g_ep) + "_r" +
           std::to_string(world_rank()) + "_" + name))
      .string();
}

Config small_run(const std::string& tag) {
  return mpi_small_run(20, rank_file("train.bin"), rank_file("val.bin"), rank_file("metrics_" + tag + ".jsonl"));
}

struct Outcome {
  std::vector<double> losses;
  std::vector<float> params;
};

Outcome train(const Config& c, const ProcessGroups& groups) {
  Trainer trainer(c, groups);
  setup_checkpoints(trainer);
  trainer.run();
  return {trainer.losses(), trainer.full_parameters()};
}

double relative(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-30); }

TEST(SameLayout, ResumesBitExactly) {
  const ProcessGroups groups = mpi_process_groups(MPI_COMM_WORLD, g_ep);
  Config c = small_run("straight");
  c.train.ep = g_ep;
  const Outcome reference = train(c, groups);

  c.train.metrics = rank_file("metrics_saving.jsonl");
  c.train.checkpoint_dir = shared_dir("exact");
  c.train.checkpoint_every = 10;
  const Outcome saving = train(c, groups);
  EXPECT_EQ(saving.losses, reference.losses) << "saving changed the run";

  Config resumed = small_run("resumed");
  resumed.train.ep = g_ep;
  resumed.train.resume = step_directory(c.train.checkpoint_dir, 10);
  const Outcome second = train(resumed, groups);
  ASSERT_EQ(second.losses.size(), 10u);
  for (size_t s = 0; s < 10; ++s) EXPECT_EQ(second.losses[s], reference.losses[10 + s]) << "step " << 11 + s;
  EXPECT_TRUE(second.params == reference.params) << "parameters after 20 steps differ";
}

TEST(Resharding, FourFourThenTwoOneThenOneOne) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  Config c = small_run("reshard44");
  c.train.steps = 30;
  c.train.checkpoint_every = 10;
  c.train.ep = 4;
  c.train.checkpoint_dir = shared_dir("reshard44");
  const std::string dir21 = shared_dir("reshard21");
  Outcome original;
  {
    const ProcessGroups groups = mpi_process_groups(MPI_COMM_WORLD, 4);
    original = train(c, groups);
  }
  ASSERT_EQ(original.losses.size(), 30u);
  double worst21 = 0, worst11 = 0, worst_param = 0;

  // (2, 1) from step 10 of (4, 4): ranks 0 and 1, every expert on each, ZeRO over 2.
  MPI_Comm pair;
  MPI_Comm_split(MPI_COMM_WORLD, world_rank() < 2 ? 0 : 1, world_rank(), &pair);
  if (world_rank() < 2) {
    const ProcessGroups groups = mpi_process_groups(pair, 1);
    Config c21 = small_run("reshard21");
    c21.train.steps = 30;
    c21.train.checkpoint_every = 10;
    c21.train.resume = step_directory(c.train.checkpoint_dir, 10);
    c21.train.checkpoint_dir = dir21;
    const Outcome r = train(c21, groups);
    ASSERT_EQ(r.losses.size(), 20u);
    for (size_t s = 0; s < 20; ++s) {
      EXPECT_LE(relative(r.losses[s], original.losses[10 + s]), 1e-5) << "(2, 1) step " << 11 + s;
      worst21 = std::max(worst21, relative(r.losses[s], original.losses[10 + s]));
    }
  }
  MPI_Comm_free(&pair);
  MPI_Barrier(MPI_COMM_WORLD);

  // (1, 1) from step 20 of (2, 1): rank 0 alone.
  if (world_rank() == 0) {
    const ProcessGroups single = ProcessGroups::single();
    Config c11 = small_run("reshard11");
    c11.train.steps = 30;
    c11.train.resume = step_directory(dir21, 20);
    const Outcome r = train(c11, single);
    ASSERT_EQ(r.losses.size(), 10u);
    for (size_t s = 0; s < 10; ++s) {
      EXPECT_LE(relative(r.losses[s], original.losses[20 + s]), 1e-5) << "(1, 1) step " << 21 + s;
      worst11 = std::max(worst11, relative(r.losses[s], original.losses[20 + s]));
    }
    const ParamLayout layout(c.model);
    for (const TensorSpec& t : layout.tensors()) {
      double diff = 0, norm = 0;
      for (int64_t i = t.offset; i < t.offset + t.numel; ++i) {
        diff += double(r.params[i] - original.params[i]) * (r.params[i] - original.params[i]);
        norm += double(original.params[i]) * original.params[i];
      }
      EXPECT_LE(std::sqrt(diff / norm), 1e-5) << t.name;
      worst_param = std::max(worst_param, std::sqrt(diff / norm));
    }
    std::printf("resharding (4,4) -> (2,1) -> (1,1): largest relative loss difference to the (4,4) run: "
                "%.2e on (2,1), %.2e on (1,1); parameter tensor after 30 steps %.2e\n",
                worst21, worst11, worst_param);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(Refusal, EveryRankRefusesACorruptPieceThatOneRankReads) {
  if (world_size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const ProcessGroups groups = mpi_process_groups(MPI_COMM_WORLD, g_ep);
  Config c = small_run("agree");
  c.train.ep = g_ep;
  c.train.steps = 2;
  c.train.checkpoint_dir = shared_dir("agree");
  train(c, groups);
  const std::string dir = step_directory(c.train.checkpoint_dir, 2);
  // The same layout reads back exactly what each rank wrote: a bad byte in the last rank's
  // file is found by that rank only.
  const std::string victim = "rank_" + std::to_string(world_size() - 1) + ".h5";
  if (world_rank() == 0) {
    const Manifest m = read_manifest((fs::path(dir) / "manifest.h5").string());
    const auto piece = std::find_if(m.pieces.begin(), m.pieces.end(), [&](const Piece& p) { return p.file == victim; });
    ASSERT_NE(piece, m.pieces.end());
    const std::string path = (fs::path(dir) / victim).string();
    hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    hid_t d = H5Dopen2(f, piece->dataset.c_str(), H5P_DEFAULT);
    const haddr_t at = H5Dget_offset(d);
    H5Dclose(d);
    H5Fclose(f);
    ASSERT_NE(at, HADDR_UNDEF);
    std::fstream bytes(path, std::ios::in | std::ios::out | std::ios::binary);
    bytes.seekg(std::streamoff(at));
    const char old = char(bytes.get());
    bytes.seekp(std::streamoff(at));
    bytes.put(char(old ^ 0x01));
  }
  MPI_Barrier(MPI_COMM_WORLD);
  Trainer trainer(c, groups);
  try {
    load_checkpoint(dir, c, groups, trainer.backend());
    ADD_FAILURE() << "rank " << world_rank() << " loaded a corrupt checkpoint";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find(victim), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("checksum mismatch"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace moeut
