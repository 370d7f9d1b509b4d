// Several token files read as one stream: what --train_data and --val_data name. A large corpus
// comes as shards (train_00000.bin, train_00001.bin, ...); the trainer sees their concatenation.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/token_file.h"

namespace moeut {

// The files a data option names, in stream order: the option's value when it names a file as it
// stands; otherwise comma-separated items, each a path or a glob pattern (* ? [) whose matches are
// taken sorted by name. Throws DataError naming the pattern when it matches no file.
std::vector<std::string> expand_token_paths(const std::string& spec);

class TokenFiles {
 public:
  TokenFiles() = default;  // no file: size() is 0
  // Maps every file expand_token_paths(spec) gives; throws DataError naming the file whose
  // vocabulary differs from the first file's.
  explicit TokenFiles(const std::string& spec);

  const std::string& spec() const { return spec_; }
  uint32_t vocab_size() const { return files_.empty() ? 0 : files_.front().vocab_size(); }
  uint64_t size() const { return starts_.empty() ? 0 : starts_.back(); }  // tokens in all files
  // As TokenFile::read over the concatenation; a range may span files.
  void read(uint64_t begin, std::span<int32_t> out) const;
  void check_vocabulary() const;

 private:
  std::string spec_;
  std::vector<TokenFile> files_;
  std::vector<uint64_t> starts_;  // files_.size() + 1 entries: file i holds tokens [starts_[i], starts_[i+1])
};

}  // namespace moeut
