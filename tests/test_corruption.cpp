// Random corruption of the files a run reads (docs/RELIABILITY.md): a seeded loop of bit flips
// and truncations over a small checkpoint's manifest and rank file, over a weights file and over
// a token file's header. Each trial runs in a child process of its own, with a time limit, and
// must end either refused with a message or with results identical to the untouched files':
// never a crash, a hang, or a silently different result. The counts are printed.
#include <gtest/gtest.h>
#include <omp.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <thread>

#include "checkpoints/checkpoint.h"
#include "checkpoints/hdf5_common.h"
#include "checkpoints/weights_file.h"
#include "small_config.h"

namespace fs = std::filesystem;

namespace moeut {
namespace {

// How a trial ended, as the child's exit status says (or its signal, or the time limit).
enum Outcome { kRefused = 10, kIdentical = 11, kDifferent = 12, kSilentRefusal = 13, kCrash, kHang };

struct Counts {
  int tried = 0, refused = 0, identical = 0, crashes = 0, hangs = 0, silent = 0;
  void add(Outcome o) {
    ++tried;
    refused += o == kRefused;
    identical += o == kIdentical;
    crashes += o == kCrash;
    hangs += o == kHang;
    silent += o == kDifferent || o == kSilentRefusal;
  }
};

// Runs `trial` in a child process: it returns whether the results equal the untouched run's,
// or throws (a refusal, which must say something).
Outcome run_trial(const std::function<bool()>& trial) {
  std::fflush(stdout);
  const pid_t child = fork();
  if (child < 0) return kCrash;
  if (child == 0) {
    omp_set_num_threads(1);  // the parent's OpenMP threads are not in the child
    std::freopen("/dev/null", "w", stdout);
    int status = kIdentical;
    try {
      status = trial() ? kIdentical : kDifferent;
    } catch (const std::exception& e) {
      status = *e.what() ? kRefused : kSilentRefusal;
    }
    std::_Exit(status);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  int status = 0;
  while (waitpid(child, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(child, SIGKILL);
      waitpid(child, &status, 0);
      return kHang;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  if (!WIFEXITED(status)) return kCrash;
  const int code = WEXITSTATUS(status);
  return code >= kRefused && code <= kSilentRefusal ? Outcome(code) : kCrash;
}

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// A copy of `bytes` with one bit flipped in [begin, end), or cut to a random shorter length.
std::string corrupt(std::string bytes, std::mt19937_64& rng, size_t begin, size_t end, bool truncate) {
  if (truncate) {
    bytes.resize(std::uniform_int_distribution<size_t>(0, bytes.size() - 1)(rng));
    return bytes;
  }
  const size_t at = std::uniform_int_distribution<size_t>(begin, end - 1)(rng);
  bytes[at] = char(bytes[at] ^ (1 << std::uniform_int_distribution<int>(0, 7)(rng)));
  return bytes;
}

void report(const char* what, const Counts& c) {
  std::printf("corruption of %s: tried %d | refused %d | identical %d | crashes %d | hangs %d | silent differences %d\n",
              what, c.tried, c.refused, c.identical, c.crashes, c.hangs, c.silent);
  EXPECT_EQ(c.refused + c.identical, c.tried) << what;
  EXPECT_EQ(c.crashes + c.hangs + c.silent, 0) << what;
}

fs::path work_dir(const std::string& name) { return test::fresh_test_dir("moeut_corruption_" + name); }

Config small_run(const fs::path& work) { return test::checkpoint_run(work, 4); }

// The parameters at the end of a run of c with its checkpoints.
std::vector<float> train(const Config& c) { return test::train_with_checkpoints(c).params; }

TEST(Corruption, CheckpointFilesAreRefusedOrResumeIdentically) {
  const fs::path work = work_dir("checkpoint");
  Config c = small_run(work);
  c.train.checkpoint_dir = (work / "ckpt").string();
  c.train.checkpoint_every = 2;
  train(c);
  const fs::path saved = step_directory(c.train.checkpoint_dir, 2);
  Config resume = c;
  resume.train.checkpoint_dir.clear();
  resume.train.checkpoint_every = 0;
  resume.train.resume = (work / "trial").string();
  fs::copy(saved, resume.train.resume, fs::copy_options::recursive);
  const std::vector<float> untouched = train(resume);

  std::mt19937_64 rng(50);
  Counts counts;
  const auto begin = std::chrono::steady_clock::now();
  for (int trial = 0; trial < 240; ++trial) {
    const char* name = trial % 2 == 0 ? "manifest.h5" : "rank_0.h5";
    const std::string bytes = read_bytes(saved / name);
    fs::remove_all(resume.train.resume);
    fs::copy(saved, resume.train.resume, fs::copy_options::recursive);
    std::ofstream(fs::path(resume.train.resume) / name, std::ios::binary | std::ios::trunc)
        << corrupt(bytes, rng, 0, bytes.size(), trial % 6 >= 4);
    counts.add(run_trial([&] { return train(resume) == untouched; }));
  }
  std::printf("%.1f s\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count());
  report("checkpoint files (manifest.h5, rank_0.h5)", counts);
}

TEST(Corruption, WeightsFilesAreRefusedOrReadIdentically) {
  const fs::path work = work_dir("weights");
  const ModelConfig m = small_run(work).model;
  Model<float> model(m);
  model.init(3);
  const fs::path good = work / "weights.h5", trial_path = work / "trial.h5";
  write_weights(good.string(), m, model.params.data());
  const std::string bytes = read_bytes(good);
  std::mt19937_64 rng(50);
  Counts counts;
  for (int trial = 0; trial < 200; ++trial) {
    std::ofstream(trial_path, std::ios::binary | std::ios::trunc) << corrupt(bytes, rng, 0, bytes.size(), trial % 5 == 4);
    counts.add(run_trial([&] {
      const Weights w = read_weights(trial_path.string());
      ModelConfig read = w.config;
      read.context = m.context;
      return h5::model_difference(read, "the file", m, "the original").empty() && w.params == model.params;
    }));
  }
  report("weights files", counts);
}

TEST(Corruption, TokenFileHeadersAreRefusedOrReadIdentically) {
  const fs::path work = work_dir("tokens");
  const Config c = small_run(work);
  const TokenFile original(c.train.val_data);
  std::vector<int32_t> tokens(original.size());
  original.read(0, tokens);
  const std::string bytes = read_bytes(c.train.val_data);
  const fs::path trial_path = work / "trial.bin";
  std::mt19937_64 rng(50);
  Counts counts;
  for (int trial = 0; trial < 200; ++trial) {
    // The 32-byte header, and truncations. The tokens themselves carry no checksum in this
    // format (docs/DATA.md): a flipped token within the vocabulary cannot be told from data.
    std::ofstream(trial_path, std::ios::binary | std::ios::trunc) << corrupt(bytes, rng, 0, 32, trial % 5 == 4);
    counts.add(run_trial([&] {
      const TokenFiles f = open_data(trial_path.string(), "val_data", c.model);
      std::vector<int32_t> back(f.size());
      f.read(0, back);
      return back == tokens;
    }));
  }
  report("token file headers", counts);
}

}  // namespace
}  // namespace moeut
