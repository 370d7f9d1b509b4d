// Tokenised data files (format in docs/DATA.md): a fixed header followed by little-endian token
// ids, read by memory-mapping so that a multi-gigabyte corpus costs no load time.
#pragma once
#include <cstdint>
#include <cstdio>
#include <span>
#include <stdexcept>
#include <string>

namespace moeut {

// Little-endian integers from bytes whatever the host is: the token files' format, and the
// formats imported into it (launch/llmc_import.cpp).
inline uint32_t load_le16(const unsigned char* p) { return uint32_t(p[0]) | uint32_t(p[1]) << 8; }
inline uint32_t load_le32(const unsigned char* p) { return load_le16(p) | load_le16(p + 2) << 16; }

// Thrown for a missing, truncated or malformed token file; what() names the file and the problem.
struct DataError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class TokenFile {
 public:
  TokenFile() = default;                        // no file: size() is 0
  explicit TokenFile(const std::string& path);  // maps the file; throws DataError
  ~TokenFile();
  TokenFile(TokenFile&& other) noexcept;
  TokenFile& operator=(TokenFile&& other) noexcept;
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  const std::string& path() const { return path_; }
  uint32_t vocab_size() const { return vocab_size_; }
  uint64_t size() const { return count_; }  // number of tokens
  uint32_t at(uint64_t i) const;            // token i, i < size()
  // Copies tokens [begin, begin + out.size()) into out; throws DataError when out of range or
  // when a token is not below vocab_size() (naming the file, the token's offset and its value).
  void read(uint64_t begin, std::span<int32_t> out) const;
  // Reads every token: throws DataError, as read() does, at the first one not below vocab_size().
  void check_vocabulary() const;

 private:
  std::string path_;
  uint32_t vocab_size_ = 0;
  uint32_t token_bytes_ = 0;  // 2 or 4
  uint64_t count_ = 0;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const unsigned char* tokens_ = nullptr;
  [[noreturn]] void out_of_vocabulary(uint64_t i, uint32_t token) const;
};

// Writes a token file piece by piece, so that a corpus never has to be held whole: the tokens go
// to path.tmp, finish() writes their count into the header, fsyncs and renames it to path. A
// writer destroyed before finish() (an error) removes path.tmp. uint16 tokens when vocab_size
// fits, else uint32. Throws DataError when a token is not below vocab_size or on I/O failure.
class TokenFileWriter {
 public:
  TokenFileWriter(const std::string& path, uint32_t vocab_size);
  ~TokenFileWriter();
  TokenFileWriter(const TokenFileWriter&) = delete;
  TokenFileWriter& operator=(const TokenFileWriter&) = delete;

  // Checks every token of the piece before writing any of it.
  void append(std::span<const uint32_t> tokens);
  uint64_t count() const { return count_; }  // tokens appended so far
  void finish();                              // throws DataError ("empty") when none were appended

 private:
  std::string path_, tmp_;
  uint32_t vocab_size_;
  uint32_t token_bytes_;
  uint64_t count_ = 0;
  std::FILE* file_ = nullptr;
};

// Writes a whole token file at once through TokenFileWriter.
void write_token_file(const std::string& path, uint32_t vocab_size, std::span<const uint32_t> tokens);

}  // namespace moeut
