// The second pass of moeut-prepare-data (launch/prepare_encode.h).
#include "launch/prepare_encode.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <numeric>
#include <thread>

namespace moeut {
namespace {

namespace fs = std::filesystem;

// Encodes lines[begin, end) into out, an eos after every document.
void encode_range(const sentencepiece::SentencePieceProcessor& sp, const std::vector<std::string>& lines,
                  size_t begin, size_t end, std::vector<uint32_t>& out, std::string& error) {
  std::vector<int> ids;
  for (size_t i = begin; i < end; ++i) {
    const auto status = sp.Encode(lines[i], &ids);
    if (!status.ok()) {
      error = "encoding \"" + lines[i].substr(0, 60) + "\" failed: " + status.message();
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

// Encodes docs, counts their tokens and hands them to sink.
void encode_batch(const sentencepiece::SentencePieceProcessor& sp, size_t threads, const std::vector<std::string>& docs,
                  TokenCounts& counts, const std::function<void(std::span<const uint32_t>)>& sink) {
  if (docs.empty()) return;
  const std::vector<uint32_t> tokens = encode_lines(sp, docs, threads);
  for (uint32_t t : tokens) ++counts[t];
  sink(tokens);
}

}  // namespace

uint64_t total(const TokenCounts& counts) { return std::accumulate(counts.begin(), counts.end(), uint64_t{0}); }

TrainWriter::TrainWriter(fs::path dir, uint32_t vocab_size, uint64_t shard_tokens)
    : dir_(std::move(dir)), vocab_size_(vocab_size), limit_(shard_tokens > 0 ? shard_tokens : UINT64_MAX) {}

void TrainWriter::append(std::span<const uint32_t> tokens) {
  while (!tokens.empty()) {
    if (!open_) open_ = std::make_unique<TokenFileWriter>(name(written_).string(), vocab_size_);
    const size_t n = size_t(std::min<uint64_t>(tokens.size(), limit_ - open_->count()));
    open_->append(tokens.first(n));
    tokens = tokens.subspan(n);
    if (open_->count() == limit_) close();
  }
}

size_t TrainWriter::finish() {
  if (open_) close();
  if (written_ == 0) throw DataError(name(0).string() + ": no train tokens to write");
  for (size_t i = written_; limit_ != UINT64_MAX && fs::remove(name(i));) ++i;
  return written_;
}

fs::path TrainWriter::name(size_t i) const {
  if (limit_ == UINT64_MAX) return dir_ / "train.bin";
  char buf[32];
  std::snprintf(buf, sizeof buf, "train_%05zu.bin", i);
  return dir_ / buf;
}

void TrainWriter::close() {
  open_->finish();
  open_.reset();
  ++written_;
}

Encoder::Encoder(const sentencepiece::SentencePieceProcessor& sp, size_t threads, TrainWriter& train,
                 TokenFileWriter& val)
    : sp_(sp), threads_(threads), train_(train), val_(val),
      train_counts_(size_t(sp.GetPieceSize()), 0), val_counts_(size_t(sp.GetPieceSize()), 0) {}

void Encoder::add(const std::string& doc, bool is_val) {
  (is_val ? val_batch_ : train_batch_).push_back(doc);
  ++(is_val ? val_docs_ : train_docs_);
  bytes_ += doc.size();
  if (bytes_ >= kBatchBytes) flush();
}

void Encoder::flush() {
  encode_batch(sp_, threads_, train_batch_, train_counts_, [&](std::span<const uint32_t> t) { train_.append(t); });
  encode_batch(sp_, threads_, val_batch_, val_counts_, [&](std::span<const uint32_t> t) { val_.append(t); });
  train_batch_.clear();
  val_batch_.clear();
  bytes_ = 0;
}

}  // namespace moeut
