// moeut-prepare-data: turns plain text or JSON lines into the token files the trainer reads, or
// converts llm.c / nanoGPT token files (--from_llmc). Text: reads the inputs, splits them into
// train/validation (rule in docs/DATA.md), trains a SentencePiece unigram model on a bounded
// sample of the train split (or reuses --tokenizer), encodes both splits in a second pass to
// DIR/train.bin (or shards of --shard_tokens) and DIR/val.bin, and reports the validation
// perplexity of a unigram model as a baseline that any trained language model has to beat. The
// input streams through: memory is bounded whatever the corpus size (docs/DATA.md).
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
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/token_file.h"
#include "launch/llmc_import.h"
#include "launch/prepare_encode.h"
#include "launch/prepare_input.h"
#include "parallel/run_errors.h"

namespace {

namespace po = boost::program_options;
namespace fs = std::filesystem;
using moeut::DataError;

// Lines per split block: long enough to keep paragraphs mostly whole, short enough that the
// validation split samples the whole corpus (Brown, for one, is ordered by genre).
constexpr size_t kBlockLines = 50;
// The longest sentence SentencePiece trains on (its max_sentence_length default); longer text is
// cut for training at a space, so that documents of a JSON-lines corpus are not skipped.
constexpr size_t kMaxSentenceBytes = 4192;

struct Options {
  moeut::InputSpec input{.paths = {}, .format = "", .text_field = "text"};
  fs::path out_dir;
  int64_t vocab_size = 8000;
  bool vocab_size_given = false;
  std::string tokenizer;
  int64_t shard_tokens = 0;
  int64_t sample_sentences = 200000;
  double val_fraction = 0.05;
  int64_t seed = 1;
  int64_t threads = 2;
  std::vector<std::string> from_llmc;
  std::string out;
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
      "input", po::value<std::vector<std::string>>(&opt.input.paths)->multitoken()->composing(),
      "text files (one sentence or paragraph per line) or JSON-lines files (one object per line)")(
      "format", po::value<std::string>(&opt.input.format), "text or jsonl (default: jsonl for a .jsonl file, else text)")(
      "text_field", po::value<std::string>(&opt.input.text_field)->default_value(opt.input.text_field),
      "the string field of each JSON line that holds its text")(
      "out_dir", po::value<std::string>(), "output directory (created if missing)")(
      "vocab_size", po::value<int64_t>(&opt.vocab_size)->default_value(opt.vocab_size),
      "SentencePiece vocabulary size; with --from_llmc the tokens' vocabulary (required there)")(
      "tokenizer", po::value<std::string>(&opt.tokenizer), "an existing SentencePiece model to encode with (no training)")(
      "shard_tokens", po::value<int64_t>(&opt.shard_tokens)->default_value(opt.shard_tokens),
      "split the train output into train_00000.bin, ... of this many tokens (0: one train.bin)")(
      "sample_sentences", po::value<int64_t>(&opt.sample_sentences)->default_value(opt.sample_sentences),
      "at most this many train sentences, sampled, train the SentencePiece model")(
      "val_fraction", po::value<double>(&opt.val_fraction)->default_value(opt.val_fraction, "0.05"),
      "share of 50-line blocks sent to validation, in (0, 0.5]")(
      "seed", po::value<int64_t>(&opt.seed)->default_value(opt.seed), "SentencePiece random seed")(
      "threads", po::value<int64_t>(&opt.threads)->default_value(opt.threads), "threads for training and encoding")(
      "from_llmc", po::value<std::vector<std::string>>(&opt.from_llmc)->multitoken()->composing(),
      "llm.c or nanoGPT uint16 token files to convert (with --vocab_size and --out)")(
      "out", po::value<std::string>(&opt.out), "the token file --from_llmc writes");
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
  if (vm.count("out_dir")) opt.out_dir = vm["out_dir"].as<std::string>();
  opt.vocab_size_given = !vm["vocab_size"].defaulted();
  return true;
}

std::string format_number(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

void validate_llmc(const Options& opt) {
  if (!opt.input.paths.empty() || !opt.out_dir.empty()) throw UsageError("--from_llmc takes --out, not --input or --out_dir");
  if (opt.out.empty()) throw UsageError("--from_llmc needs --out FILE");
  if (!opt.vocab_size_given) throw UsageError("--from_llmc needs --vocab_size, the vocabulary of its tokens");
  if (opt.vocab_size < 1 || opt.vocab_size > int64_t{UINT32_MAX})
    throw UsageError("--vocab_size must be between 1 and 2^32 - 1, got " + std::to_string(opt.vocab_size));
}

void validate_text(const Options& opt) {
  if (opt.input.paths.empty()) throw UsageError("--input is required (or --from_llmc)");
  if (opt.out_dir.empty()) throw UsageError("--out_dir is required");
  if (!opt.out.empty()) throw UsageError("--out goes with --from_llmc; text input writes to --out_dir");
  if (!opt.input.format.empty() && opt.input.format != "text" && opt.input.format != "jsonl")
    throw UsageError("--format must be text or jsonl, got " + opt.input.format);
  // 3 ids are reserved (unk, bos, eos); fewer than a handful of real pieces cannot cover text.
  if (opt.vocab_size < 8 || opt.vocab_size > (int64_t{1} << 31))
    throw UsageError("--vocab_size must be between 8 and 2^31, got " + std::to_string(opt.vocab_size));
  if (opt.shard_tokens < 0) throw UsageError("--shard_tokens must be 0 or more, got " + std::to_string(opt.shard_tokens));
  if (opt.sample_sentences < 1000)
    throw UsageError("--sample_sentences must be at least 1000, got " + std::to_string(opt.sample_sentences));
  if (!(opt.val_fraction > 0.0 && opt.val_fraction <= 0.5))
    throw UsageError("--val_fraction must be in (0, 0.5], got " + format_number(opt.val_fraction));
  // UINT32_MAX is SentencePiece's "seed from std::random_device" marker, so it is not a seed.
  if (opt.seed < 0 || opt.seed >= int64_t{UINT32_MAX})
    throw UsageError("--seed must be in [0, 4294967294], got " + std::to_string(opt.seed));
  // SentencePiece's trainer accepts 1..128 threads.
  if (opt.threads < 1 || opt.threads > 128)
    throw UsageError("--threads must be in [1, 128], got " + std::to_string(opt.threads));
}

// Blocks of kBlockLines consecutive documents; block b goes to validation when
// b % period == period - 1, period = round(1 / val_fraction). Deterministic and independent of
// the seed, so the same text always gives the same validation set.
struct SplitRule {
  size_t period;
  explicit SplitRule(double val_fraction) : period(static_cast<size_t>(std::llround(1.0 / val_fraction))) {}
  bool is_val(uint64_t index) const { return (index / kBlockLines) % period == period - 1; }
  void check(uint64_t docs, uint64_t val_docs) const {
    if (val_docs > 0) return;
    throw DataError("input too small for a validation split: " + std::to_string(docs) +
                    " non-blank lines, but validation takes every " + std::to_string(period) + "th block of " +
                    std::to_string(kBlockLines) + " lines, so at least " +
                    std::to_string(period * kBlockLines - kBlockLines + 1) + " lines are needed");
  }
};

// One document as SentencePiece training sentences: a line per line of the document, each cut at
// a space (or else at a character boundary) to at most kMaxSentenceBytes.
void write_training_text(std::ofstream& out, std::string_view doc) {
  while (!doc.empty()) {
    const size_t newline = std::min(doc.find('\n'), doc.size());
    std::string_view part = doc.substr(0, newline);
    doc.remove_prefix(std::min(newline + 1, doc.size()));
    while (part.size() > kMaxSentenceBytes) {
      size_t cut = part.rfind(' ', kMaxSentenceBytes);
      if (cut == std::string_view::npos || cut == 0) {
        cut = kMaxSentenceBytes;
        while (cut > 1 && (static_cast<unsigned char>(part[cut]) & 0xC0) == 0x80) --cut;  // a UTF-8 continuation byte
      }
      if (!moeut::is_blank(part.substr(0, cut))) out << part.substr(0, cut) << '\n';
      part.remove_prefix(cut);
    }
    if (!moeut::is_blank(part)) out << part << '\n';
  }
}

// First pass: the train split's text into train_txt; returns the documents of each split.
std::pair<uint64_t, uint64_t> write_train_text(const Options& opt, const SplitRule& rule, const fs::path& train_txt) {
  std::ofstream out(train_txt, std::ios::binary | std::ios::trunc);
  if (!out) throw DataError(train_txt.string() + ": cannot create");
  uint64_t train = 0, val = 0;
  moeut::for_each_document(opt.input, [&](const std::string& doc, uint64_t index) {
    if (rule.is_val(index)) {
      ++val;
      return;
    }
    ++train;
    write_training_text(out, doc);
  });
  out.close();
  if (!out) throw DataError(train_txt.string() + ": write failed");
  rule.check(train + val, val);
  return {train, val};
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
      // The memory bound: SentencePiece keeps a uniform sample of this many sentences.
      {"input_sentence_size", std::to_string(opt.sample_sentences)},
      {"shuffle_input_sentence", "true"},
      {"max_sentence_length", std::to_string(kMaxSentenceBytes)},
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

// Loads a model and checks it can encode for training: it has an eos piece and, when
// --vocab_size was given, that many pieces.
void load_tokenizer(const Options& opt, const fs::path& model, sentencepiece::SentencePieceProcessor& sp) {
  const auto status = sp.Load(model.string());
  if (!status.ok()) throw DataError(model.string() + ": cannot load as a SentencePiece model: " + status.message());
  if (sp.eos_id() < 0) throw DataError(model.string() + ": the model has no eos piece, which ends every document");
  if (opt.vocab_size_given && sp.GetPieceSize() != opt.vocab_size)
    throw DataError(model.string() + ": the model has " + std::to_string(sp.GetPieceSize()) +
                    " pieces but --vocab_size is " + std::to_string(opt.vocab_size));
}

// Puts a reused model beside the output, as training would have: DIR/spm.model and DIR/spm.vocab
// (a piece and its score a line).
void place_tokenizer(const sentencepiece::SentencePieceProcessor& sp, const fs::path& model, const fs::path& prefix) {
  const fs::path target = prefix.string() + ".model";
  std::error_code ec;
  if (!fs::equivalent(model, target, ec)) fs::copy_file(model, target, fs::copy_options::overwrite_existing, ec);
  if (ec) throw DataError(target.string() + ": cannot copy " + model.string() + " to it: " + ec.message());
  const fs::path vocab = prefix.string() + ".vocab";
  std::ofstream out(vocab, std::ios::trunc);
  for (int id = 0; id < sp.GetPieceSize(); ++id) out << sp.IdToPiece(id) << '\t' << sp.GetScore(id) << '\n';
  out.close();
  if (!out) throw DataError(vocab.string() + ": write failed");
}

// exp of the mean negative log-probability of the validation tokens under the add-one-smoothed
// unigram distribution of the train tokens, over the full vocabulary (unseen pieces included).
double unigram_perplexity(const moeut::TokenCounts& train, const moeut::TokenCounts& val) {
  const double denom = static_cast<double>(moeut::total(train)) + static_cast<double>(train.size());
  double nll = 0.0;
  for (size_t t = 0; t < val.size(); ++t)
    nll -= static_cast<double>(val[t]) * std::log((static_cast<double>(train[t]) + 1.0) / denom);
  return std::exp(nll / static_cast<double>(moeut::total(val)));
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

// The model to encode with: --tokenizer's, placed beside the output, or one trained on the
// train split's sample (first pass).
void make_tokenizer(const Options& opt, const SplitRule& rule, sentencepiece::SentencePieceProcessor& sp) {
  using clock = std::chrono::steady_clock;
  const fs::path prefix = opt.out_dir / "spm";
  if (!opt.tokenizer.empty()) {
    load_tokenizer(opt, opt.tokenizer, sp);
    place_tokenizer(sp, opt.tokenizer, prefix);
    std::cout << "tokenizer " << opt.tokenizer << ", " << sp.GetPieceSize() << " pieces, copied to "
              << prefix.string() << ".model\n";
    return;
  }
  auto t0 = clock::now();
  const fs::path train_txt = opt.out_dir / "train.txt";
  const auto [train, val] = write_train_text(opt, rule, train_txt);
  std::cout << "lines: train " << train << ", validation " << val << " (" << format_2dp(seconds_since(t0)) << " s)\n";
  t0 = clock::now();
  train_sentencepiece(opt, train_txt, prefix);
  load_tokenizer(opt, prefix.string() + ".model", sp);
  std::cout << "trained SentencePiece unigram model " << prefix.string() << ".model, " << opt.vocab_size
            << " pieces (" << format_2dp(seconds_since(t0)) << " s)\n";
}

void run_text(const Options& opt) {
  std::error_code ec;
  fs::create_directories(opt.out_dir, ec);
  if (ec) throw DataError(opt.out_dir.string() + ": cannot create directory: " + ec.message());
  const SplitRule rule(opt.val_fraction);
  sentencepiece::SentencePieceProcessor sp;
  make_tokenizer(opt, rule, sp);

  const auto t0 = std::chrono::steady_clock::now();
  const auto vocab = static_cast<uint32_t>(sp.GetPieceSize());
  moeut::TrainWriter train(opt.out_dir, vocab, uint64_t(opt.shard_tokens));
  moeut::TokenFileWriter val((opt.out_dir / "val.bin").string(), vocab);
  moeut::Encoder enc(sp, size_t(opt.threads), train, val);
  moeut::for_each_document(opt.input, [&](const std::string& doc, uint64_t index) { enc.add(doc, rule.is_val(index)); });
  enc.flush();
  rule.check(enc.train_docs() + enc.val_docs(), enc.val_docs());
  const size_t shards = train.finish();
  val.finish();
  if (!opt.tokenizer.empty()) std::cout << "lines: train " << enc.train_docs() << ", validation " << enc.val_docs() << "\n";
  std::cout << "tokens: train " << moeut::total(enc.train_counts()) << (shards > 1 ? " in " + std::to_string(shards) + " shards" : "")
            << ", validation " << moeut::total(enc.val_counts()) << " (" << format_2dp(seconds_since(t0)) << " s)\n";

  const std::string ppl = format_2dp(unigram_perplexity(enc.train_counts(), enc.val_counts()));
  write_number(opt.out_dir / "unigram_ppl.txt", ppl);
  std::cout << "unigram perplexity (validation): " << ppl << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Options opt;
    if (!parse_options(argc, argv, opt)) return 0;
    if (!opt.from_llmc.empty()) {
      validate_llmc(opt);
      moeut::import_llmc({.inputs = opt.from_llmc, .vocab_size = uint32_t(opt.vocab_size), .out = opt.out});
      return 0;
    }
    validate_text(opt);
    run_text(opt);
    return 0;
  } catch (const UsageError& e) {
    std::cerr << "moeut-prepare-data: " << e.what() << "\n";
    return moeut::kExitConfig;
  } catch (const DataError& e) {
    std::cerr << "moeut-prepare-data: error: " << e.what() << "\n";
    return moeut::kExitDataError;
  } catch (const std::exception& e) {
    std::cerr << "moeut-prepare-data: error: " << e.what() << "\n";
    return 1;
  }
}
