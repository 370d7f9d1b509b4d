// moeut-prepare-data: turns plain text into the token files the trainer reads.
// Reads the inputs, splits them into train/validation (rule in docs/DATA.md), trains a
// SentencePiece unigram model on the train split only, encodes both splits to DIR/train.bin and
// DIR/val.bin, and reports the validation perplexity of a unigram model as a baseline that any
// trained language model has to beat.
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <boost/program_options.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/token_file.h"

namespace {

namespace po = boost::program_options;
namespace fs = std::filesystem;
using moeut::DataError;

// Lines per split block: long enough to keep paragraphs mostly whole, short enough that the
// validation split samples the whole corpus (Brown, for one, is ordered by genre).
constexpr size_t kBlockLines = 50;

struct Options {
  std::vector<std::string> inputs;
  fs::path out_dir;
  int64_t vocab_size = 8000;
  double val_fraction = 0.05;
  int64_t seed = 1;
  int64_t threads = 2;
};

struct Splits {
  std::vector<std::string> train, val;
};

// Thrown for bad command-line values; main reports it and exits with status 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Fills opt; returns false when --help was asked for (the usage is printed then).
bool parse_options(int argc, char** argv, Options& opt) {
  po::options_description desc("moeut-prepare-data options");
  desc.add_options()("help,h", "show this help")(
      "input", po::value<std::vector<std::string>>(&opt.inputs)->multitoken()->composing()->required(),
      "one or more plain-text files, one sentence or paragraph per line")(
      "out_dir", po::value<std::string>()->required(), "output directory (created if missing)")(
      "vocab_size", po::value<int64_t>(&opt.vocab_size)->default_value(opt.vocab_size), "SentencePiece vocabulary size")(
      "val_fraction", po::value<double>(&opt.val_fraction)->default_value(opt.val_fraction, "0.05"),
      "share of 50-line blocks sent to validation, in (0, 0.5]")(
      "seed", po::value<int64_t>(&opt.seed)->default_value(opt.seed), "SentencePiece random seed")(
      "threads", po::value<int64_t>(&opt.threads)->default_value(opt.threads), "threads for training and encoding");
  po::variables_map vm;
  try {
    po::store(po::parse_command_line(argc, argv, desc), vm);
    if (vm.count("help")) {
      std::cout << desc << "\n";
      return false;
    }
    po::notify(vm);
  } catch (const po::error& e) {
    std::ostringstream usage;
    usage << e.what() << "\n" << desc;
    throw UsageError(usage.str());
  }
  opt.out_dir = vm["out_dir"].as<std::string>();
  return true;
}

std::string format_number(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

void validate(const Options& opt) {
  // 3 ids are reserved (unk, bos, eos); fewer than a handful of real pieces cannot cover text.
  if (opt.vocab_size < 8 || opt.vocab_size > (int64_t{1} << 31))
    throw UsageError("--vocab_size must be between 8 and 2^31, got " + std::to_string(opt.vocab_size));
  if (!(opt.val_fraction > 0.0 && opt.val_fraction <= 0.5))
    throw UsageError("--val_fraction must be in (0, 0.5], got " + format_number(opt.val_fraction));
  // UINT32_MAX is SentencePiece's "seed from std::random_device" marker, so it is not a seed.
  if (opt.seed < 0 || opt.seed >= int64_t{UINT32_MAX})
    throw UsageError("--seed must be in [0, 4294967294], got " + std::to_string(opt.seed));
  // SentencePiece's trainer accepts 1..128 threads.
  if (opt.threads < 1 || opt.threads > 128)
    throw UsageError("--threads must be in [1, 128], got " + std::to_string(opt.threads));
}

bool is_blank(const std::string& s) { return s.find_first_not_of(" \t\r\n\v\f") == std::string::npos; }

// Appends the non-blank lines of one file; blank lines carry no text and would skew blocks.
size_t read_lines(const std::string& path, std::vector<std::string>& lines) {
  std::error_code ec;
  const auto status = fs::status(path, ec);
  if (!fs::exists(status)) throw DataError(path + ": cannot read: no such file");
  if (!fs::is_regular_file(status)) throw DataError(path + ": cannot read: not a regular file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(path + ": cannot open for reading");
  size_t kept = 0;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();  // tolerate CRLF text
    if (is_blank(line)) continue;
    lines.push_back(std::move(line));
    ++kept;
  }
  if (in.bad()) throw DataError(path + ": read error");
  return kept;
}

std::vector<std::string> read_inputs(const std::vector<std::string>& paths) {
  std::vector<std::string> lines;
  for (const auto& p : paths)
    if (read_lines(p, lines) == 0) std::cerr << "warning: " << p << ": no non-blank text\n";
  if (lines.empty()) {
    std::string names;
    for (const auto& p : paths) names += (names.empty() ? "" : ", ") + p;
    throw DataError(names + ": no non-blank text in the input");
  }
  return lines;
}

// Blocks of kBlockLines consecutive lines; block b goes to validation when
// b % period == period - 1, period = round(1 / val_fraction). Deterministic and independent of
// the seed, so the same text always gives the same validation set.
Splits split_lines(std::vector<std::string> lines, double val_fraction) {
  const size_t period = static_cast<size_t>(std::llround(1.0 / val_fraction));
  Splits s;
  for (size_t i = 0; i < lines.size(); ++i) {
    const size_t block = i / kBlockLines;
    (block % period == period - 1 ? s.val : s.train).push_back(std::move(lines[i]));
  }
  if (s.val.empty())
    throw DataError("input too small for a validation split: " + std::to_string(lines.size()) +
                    " non-blank lines, but validation takes every " + std::to_string(period) +
                    "th block of " + std::to_string(kBlockLines) + " lines, so at least " +
                    std::to_string(period * kBlockLines - kBlockLines + 1) + " lines are needed");
  return s;
}

void write_lines(const fs::path& path, const std::vector<std::string>& lines) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw DataError(path.string() + ": cannot create");
  for (const auto& l : lines) out << l << '\n';
  out.close();
  if (!out) throw DataError(path.string() + ": write failed");
}

// SentencePiece reports the largest possible vocabulary in its message; quote it when present.
std::string too_large_hint(const std::string& sp_message) {
  const auto at = sp_message.find("<= ");
  if (at == std::string::npos) return "try a smaller --vocab_size";
  const auto end = sp_message.find_first_not_of("0123456789", at + 3);
  return "try --vocab_size " + sp_message.substr(at + 3, end - (at + 3)) + " or smaller";
}

void train_sentencepiece(const Options& opt, const fs::path& train_txt, const fs::path& prefix) {
  sentencepiece::SetRandomGeneratorSeed(static_cast<unsigned>(opt.seed));
  const std::unordered_map<std::string, std::string> args = {
      {"input", train_txt.string()},
      {"model_prefix", prefix.string()},
      {"model_type", "unigram"},
      {"vocab_size", std::to_string(opt.vocab_size)},
      {"character_coverage", "1.0"},
      {"pad_id", "-1"},
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"num_threads", std::to_string(opt.threads)},
      {"minloglevel", "1"},  // warnings and errors only; INFO prints every EM iteration
  };
  const auto status = sentencepiece::SentencePieceTrainer::Train(args);
  if (status.ok()) return;
  const std::string msg = status.message();
  if (msg.find("too high") != std::string::npos)
    throw DataError("vocabulary size " + std::to_string(opt.vocab_size) + " is too large for " +
                    train_txt.string() + ": " + too_large_hint(msg) + " (SentencePiece: " + msg + ")");
  if (msg.find("smaller than required_chars") != std::string::npos)
    throw DataError("vocabulary size " + std::to_string(opt.vocab_size) + " is smaller than the " +
                    "number of distinct characters in " + train_txt.string() +
                    ": raise --vocab_size (SentencePiece: " + msg + ")");
  throw DataError("SentencePiece training on " + train_txt.string() + " failed: " + msg);
}

// Encodes lines[begin, end) into out, an eos after every line so the model learns where
// sentences end.
void encode_range(const sentencepiece::SentencePieceProcessor& sp, const std::vector<std::string>& lines,
                  size_t begin, size_t end, std::vector<uint32_t>& out, std::string& error) {
  std::vector<int> ids;
  for (size_t i = begin; i < end; ++i) {
    const auto status = sp.Encode(lines[i], &ids);
    if (!status.ok()) {
      error = "encoding line " + std::to_string(i + 1) + " failed: " + status.message();
      return;
    }
    out.insert(out.end(), ids.begin(), ids.end());
    out.push_back(static_cast<uint32_t>(sp.eos_id()));
  }
}

// Encodes in contiguous chunks, one per thread, and concatenates them in order so that the output
// does not depend on the thread count.
std::vector<uint32_t> encode_lines(const sentencepiece::SentencePieceProcessor& sp,
                                   const std::vector<std::string>& lines, size_t n_threads) {
  n_threads = std::max<size_t>(1, std::min(n_threads, lines.size()));
  std::vector<std::vector<uint32_t>> parts(n_threads);
  std::vector<std::string> errors(n_threads);
  std::vector<std::thread> workers;
  for (size_t t = 0; t < n_threads; ++t) {
    const size_t begin = lines.size() * t / n_threads, end = lines.size() * (t + 1) / n_threads;
    workers.emplace_back(encode_range, std::cref(sp), std::cref(lines), begin, end, std::ref(parts[t]),
                         std::ref(errors[t]));
  }
  for (auto& w : workers) w.join();
  std::vector<uint32_t> all;
  for (size_t t = 0; t < n_threads; ++t) {
    if (!errors[t].empty()) throw DataError(errors[t]);
    all.insert(all.end(), parts[t].begin(), parts[t].end());
  }
  return all;
}

// exp of the mean negative log-probability of the validation tokens under the add-one-smoothed
// unigram distribution of the train tokens, over the full vocabulary (unseen pieces included).
double unigram_perplexity(const std::vector<uint32_t>& train, const std::vector<uint32_t>& val, uint32_t vocab) {
  std::vector<uint64_t> counts(vocab, 0);
  for (uint32_t t : train) ++counts[t];
  const double denom = static_cast<double>(train.size()) + vocab;
  double nll = 0.0;
  for (uint32_t t : val) nll -= std::log((static_cast<double>(counts[t]) + 1.0) / denom);
  return std::exp(nll / static_cast<double>(val.size()));
}

void write_number(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  if (!out) throw DataError(path.string() + ": cannot create");
  out << text << '\n';
  out.close();
  if (!out) throw DataError(path.string() + ": write failed");
}

std::string format_2dp(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f", v);
  return buf;
}

void run(const Options& opt) {
  using clock = std::chrono::steady_clock;
  std::error_code ec;
  fs::create_directories(opt.out_dir, ec);
  if (ec) throw DataError(opt.out_dir.string() + ": cannot create directory: " + ec.message());

  auto t0 = clock::now();
  Splits splits = split_lines(read_inputs(opt.inputs), opt.val_fraction);
  const fs::path train_txt = opt.out_dir / "train.txt";
  write_lines(train_txt, splits.train);
  std::cout << "lines: train " << splits.train.size() << ", validation " << splits.val.size() << " ("
            << format_2dp(seconds_since(t0)) << " s)\n";

  t0 = clock::now();
  const fs::path prefix = opt.out_dir / "spm";
  train_sentencepiece(opt, train_txt, prefix);
  std::cout << "trained SentencePiece unigram model " << prefix.string() << ".model, " << opt.vocab_size
            << " pieces (" << format_2dp(seconds_since(t0)) << " s)\n";

  t0 = clock::now();
  sentencepiece::SentencePieceProcessor sp;
  const auto status = sp.Load(prefix.string() + ".model");
  if (!status.ok()) throw DataError(prefix.string() + ".model: cannot load: " + status.message());
  const auto vocab = static_cast<uint32_t>(sp.GetPieceSize());
  const auto threads = static_cast<size_t>(opt.threads);
  const std::vector<uint32_t> train = encode_lines(sp, splits.train, threads);
  const std::vector<uint32_t> val = encode_lines(sp, splits.val, threads);
  moeut::write_token_file((opt.out_dir / "train.bin").string(), vocab, train);
  moeut::write_token_file((opt.out_dir / "val.bin").string(), vocab, val);
  std::cout << "tokens: train " << train.size() << ", validation " << val.size() << " ("
            << format_2dp(seconds_since(t0)) << " s)\n";

  const std::string ppl = format_2dp(unigram_perplexity(train, val, vocab));
  write_number(opt.out_dir / "unigram_ppl.txt", ppl);
  std::cout << "unigram perplexity (validation): " << ppl << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Options opt;
    if (!parse_options(argc, argv, opt)) return 0;
    validate(opt);
    run(opt);
    return 0;
  } catch (const UsageError& e) {
    std::cerr << "moeut-prepare-data: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "moeut-prepare-data: error: " << e.what() << "\n";
    return 1;
  }
}
