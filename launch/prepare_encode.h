// moeut-prepare-data's second pass: documents encoded in batches and their tokens written as they
// come, to DIR/val.bin and to DIR/train.bin or its shards, so the corpus is never held whole.
#pragma once
#include <sentencepiece_processor.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/token_file.h"

namespace moeut {

// How often each token id occurs in a split, for the unigram baseline.
using TokenCounts = std::vector<uint64_t>;
uint64_t total(const TokenCounts& counts);

// The train split's token files: DIR/train.bin, or with shard_tokens > 0 DIR/train_00000.bin,
// train_00001.bin, ... of shard_tokens tokens each (the last may hold fewer).
class TrainWriter {
 public:
  TrainWriter(std::filesystem::path dir, uint32_t vocab_size, uint64_t shard_tokens);
  void append(std::span<const uint32_t> tokens);
  // Finishes the last file; removes shards numbered past it, left by an earlier run, so that a
  // glob over the directory reads this run's alone. Returns the number of files.
  size_t finish();

 private:
  std::filesystem::path dir_;
  uint32_t vocab_size_;
  uint64_t limit_;  // tokens per file
  size_t written_ = 0;
  std::unique_ptr<TokenFileWriter> open_;

  std::filesystem::path name(size_t i) const;
  void close();
};

// Encodes each split in batches of about kBatchBytes of text on `threads` threads (the output
// does not depend on their number), an eos after every document so the model learns where
// documents end, and counts the tokens.
class Encoder {
 public:
  static constexpr size_t kBatchBytes = size_t{8} << 20;

  Encoder(const sentencepiece::SentencePieceProcessor& sp, size_t threads, TrainWriter& train, TokenFileWriter& val);
  void add(const std::string& doc, bool is_val);
  void flush();  // encodes and writes what add() has gathered

  uint64_t train_docs() const { return train_docs_; }
  uint64_t val_docs() const { return val_docs_; }
  const TokenCounts& train_counts() const { return train_counts_; }
  const TokenCounts& val_counts() const { return val_counts_; }

 private:
  const sentencepiece::SentencePieceProcessor& sp_;
  size_t threads_;
  TrainWriter& train_;
  TokenFileWriter& val_;
  std::vector<std::string> train_batch_, val_batch_;
  size_t bytes_ = 0;
  uint64_t train_docs_ = 0, val_docs_ = 0;
  TokenCounts train_counts_, val_counts_;
};

}  // namespace moeut
