// Token file reader (mmap) and atomic writer. The format is specified in docs/DATA.md.
#include "core/token_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

namespace moeut {
namespace {

constexpr char kMagic[8] = {'M', 'O', 'E', 'U', 'T', 'T', 'O', 'K'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 32;

[[noreturn]] void fail(const std::string& path, const std::string& problem) {
  throw DataError(path + ": " + problem);
}

std::string errno_text() { return std::strerror(errno); }

// The format is little-endian on disk whatever the host is, so bytes are assembled explicitly
// (load_le16 and load_le32 in the header).
uint64_t load_le64(const unsigned char* p) { return load_le32(p) | uint64_t(load_le32(p + 4)) << 32; }
void store_le32(unsigned char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
void store_le64(unsigned char* p, uint64_t v) {
  store_le32(p, static_cast<uint32_t>(v));
  store_le32(p + 4, static_cast<uint32_t>(v >> 32));
}

// The width rule is part of the format, so a reader can reject a file whose writer got it wrong.
uint32_t token_bytes_for(uint32_t vocab_size) { return vocab_size <= 65536 ? 2 : 4; }

struct Header {
  uint32_t version;
  uint32_t vocab_size;
  uint32_t token_bytes;
  uint64_t count;
};

// Checks everything the header alone can tell, then that the file is exactly as long as it says.
Header parse_header(const std::string& path, const unsigned char* h, uint64_t file_bytes) {
  if (std::memcmp(h, kMagic, sizeof kMagic) != 0) fail(path, "bad magic: not a MoEUT token file (expected \"MOEUTTOK\")");
  Header hd{load_le32(h + 8), load_le32(h + 12), load_le32(h + 16), load_le64(h + 24)};
  if (hd.version != kVersion)
    fail(path, "unsupported version " + std::to_string(hd.version) + " (this build reads version " +
                   std::to_string(kVersion) + ")");
  if (hd.vocab_size == 0) fail(path, "invalid header: vocab_size is 0");
  if (hd.token_bytes != 2 && hd.token_bytes != 4)
    fail(path, "invalid header: token_bytes is " + std::to_string(hd.token_bytes) + " (must be 2 or 4)");
  if (hd.token_bytes != token_bytes_for(hd.vocab_size))
    fail(path, "invalid header: token_bytes " + std::to_string(hd.token_bytes) + " does not match vocab_size " +
                   std::to_string(hd.vocab_size) + " (expected " + std::to_string(token_bytes_for(hd.vocab_size)) + ")");
  if (hd.count == 0) fail(path, "empty: header says 0 tokens");
  // Guards the multiplication below against a corrupt count overflowing 64 bits.
  const uint64_t max_count = (UINT64_MAX - kHeaderBytes) / hd.token_bytes;
  const uint64_t expected = hd.count <= max_count ? kHeaderBytes + hd.count * hd.token_bytes : UINT64_MAX;
  const std::string claim = "header says " + std::to_string(hd.count) + " tokens (" +
                            (expected == UINT64_MAX ? std::string("overflow") : std::to_string(expected)) +
                            " bytes) but the file has " + std::to_string(file_bytes) + " bytes";
  if (file_bytes < expected) fail(path, "truncated: " + claim);
  if (file_bytes > expected) fail(path, "trailing bytes: " + claim);
  return hd;
}

// Owns a file descriptor so that every early throw closes it.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

TokenFile::TokenFile(const std::string& path) : path_(path) {
  Fd f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd < 0) fail(path, "cannot open: " + errno_text());
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) fail(path, "cannot stat: " + errno_text());
  if (!S_ISREG(st.st_mode)) fail(path, "not a regular file");
  const auto file_bytes = static_cast<uint64_t>(st.st_size);
  if (file_bytes < kHeaderBytes)
    fail(path, "truncated: the file has " + std::to_string(file_bytes) + " bytes, less than the " +
                   std::to_string(kHeaderBytes) + "-byte header");

  void* map = ::mmap(nullptr, file_bytes, PROT_READ, MAP_SHARED, f.fd, 0);
  if (map == MAP_FAILED) fail(path, "cannot mmap: " + errno_text());
  // The mapping stays valid after close(); the descriptor is not needed past this point.
  map_ = map;
  map_bytes_ = file_bytes;
  try {
    const auto* bytes = static_cast<const unsigned char*>(map);
    const Header hd = parse_header(path, bytes, file_bytes);
    vocab_size_ = hd.vocab_size;
    token_bytes_ = hd.token_bytes;
    count_ = hd.count;
    tokens_ = bytes + kHeaderBytes;
  } catch (...) {
    ::munmap(map_, map_bytes_);
    map_ = nullptr;
    throw;
  }
  // Training reads windows at random offsets; say so, so the kernel does not read ahead in vain.
  // Advice only: failure changes nothing but speed.
  (void)::madvise(map_, map_bytes_, MADV_RANDOM);
}

TokenFile::~TokenFile() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

TokenFile::TokenFile(TokenFile&& other) noexcept
    : path_(std::move(other.path_)),
      vocab_size_(other.vocab_size_),
      token_bytes_(other.token_bytes_),
      count_(other.count_),
      map_(std::exchange(other.map_, nullptr)),
      map_bytes_(std::exchange(other.map_bytes_, 0)),
      tokens_(std::exchange(other.tokens_, nullptr)) {
  other.count_ = 0;
}

TokenFile& TokenFile::operator=(TokenFile&& other) noexcept {
  if (this != &other) {
    if (map_ != nullptr) ::munmap(map_, map_bytes_);
    path_ = std::move(other.path_);
    vocab_size_ = other.vocab_size_;
    token_bytes_ = other.token_bytes_;
    count_ = std::exchange(other.count_, 0);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    tokens_ = std::exchange(other.tokens_, nullptr);
  }
  return *this;
}

uint32_t TokenFile::at(uint64_t i) const {
  if (i >= count_)
    fail(path_, "token index out of range: " + std::to_string(i) + " >= " + std::to_string(count_) + " tokens");
  const unsigned char* p = tokens_ + i * token_bytes_;
  return token_bytes_ == 2 ? load_le16(p) : load_le32(p);
}

void TokenFile::out_of_vocabulary(uint64_t i, uint32_t token) const {
  fail(path_, "token out of vocabulary: token " + std::to_string(i) + " (byte offset " +
                  std::to_string(kHeaderBytes + i * token_bytes_) + ") is " + std::to_string(token) +
                  " but vocab_size is " + std::to_string(vocab_size_));
}

void TokenFile::read(uint64_t begin, std::span<int32_t> out) const {
  // Written so that a huge begin cannot wrap around: begin <= count_ is checked first.
  if (begin > count_ || out.size() > count_ - begin)
    fail(path_, "read out of range: tokens [" + std::to_string(begin) + ", " + std::to_string(begin + out.size()) +
                    ") of " + std::to_string(count_));
  const unsigned char* p = tokens_ + begin * token_bytes_;
  uint32_t largest = 0;
  if (token_bytes_ == 2) {
    for (size_t k = 0; k < out.size(); ++k, p += 2) {
      const uint32_t t = load_le16(p);
      largest = std::max(largest, t);
      out[k] = static_cast<int32_t>(t);
    }
  } else {
    for (size_t k = 0; k < out.size(); ++k, p += 4) {
      const uint32_t t = load_le32(p);
      largest = std::max(largest, t);
      out[k] = static_cast<int32_t>(t);
    }
  }
  // The loop above only keeps the largest token, so that the common case costs one comparison.
  if (largest >= vocab_size_)
    for (size_t k = 0; k < out.size(); ++k)
      if (uint32_t(out[k]) >= vocab_size_) out_of_vocabulary(begin + k, uint32_t(out[k]));
}

void TokenFile::check_vocabulary() const {
  constexpr uint64_t kChunk = 1 << 16;
  std::vector<int32_t> buf(size_t(std::min(kChunk, count_)));
  for (uint64_t begin = 0; begin < count_; begin += kChunk)
    read(begin, std::span<int32_t>(buf.data(), size_t(std::min(kChunk, count_ - begin))));
}

namespace {

// Writes all of buf or throws; fwrite may write part and set an error.
void write_all(std::FILE* f, const std::string& path, const unsigned char* buf, size_t n) {
  if (n > 0 && std::fwrite(buf, 1, n, f) != n) fail(path, "write failed: " + errno_text());
}

void write_header(std::FILE* f, const std::string& path, uint32_t vocab_size, uint64_t count) {
  unsigned char header[kHeaderBytes] = {};
  std::memcpy(header, kMagic, sizeof kMagic);
  store_le32(header + 8, kVersion);
  store_le32(header + 12, vocab_size);
  store_le32(header + 16, token_bytes_for(vocab_size));
  store_le32(header + 20, 0);  // reserved
  store_le64(header + 24, count);
  write_all(f, path, header, sizeof header);
}

void write_tokens(std::FILE* f, const std::string& path, uint32_t token_bytes, std::span<const uint32_t> tokens) {
  // Encodes in chunks: a per-token fwrite would be slow, a whole-piece buffer would double memory.
  constexpr size_t kChunk = 1 << 16;
  std::vector<unsigned char> buf(std::min(kChunk, tokens.size()) * token_bytes);
  for (size_t start = 0; start < tokens.size(); start += kChunk) {
    const size_t n = std::min(kChunk, tokens.size() - start);
    unsigned char* p = buf.data();
    for (size_t k = 0; k < n; ++k, p += token_bytes) {
      const uint32_t t = tokens[start + k];
      p[0] = static_cast<unsigned char>(t);
      p[1] = static_cast<unsigned char>(t >> 8);
      if (token_bytes == 4) {
        p[2] = static_cast<unsigned char>(t >> 16);
        p[3] = static_cast<unsigned char>(t >> 24);
      }
    }
    write_all(f, path, buf.data(), n * token_bytes);
  }
}

}  // namespace

TokenFileWriter::TokenFileWriter(const std::string& path, uint32_t vocab_size)
    : path_(path), tmp_(path + ".tmp"), vocab_size_(vocab_size), token_bytes_(token_bytes_for(vocab_size)) {
  if (vocab_size == 0) fail(path, "invalid vocab_size 0");
  file_ = std::fopen(tmp_.c_str(), "wb");
  if (file_ == nullptr) fail(tmp_, "cannot create: " + errno_text());
  write_header(file_, tmp_, vocab_size_, 0);  // the count is written by finish()
}

TokenFileWriter::~TokenFileWriter() {
  if (file_ == nullptr) return;
  std::fclose(file_);
  std::remove(tmp_.c_str());
}

void TokenFileWriter::append(std::span<const uint32_t> tokens) {
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] >= vocab_size_)
      fail(path_, "token out of vocabulary: token " + std::to_string(count_ + i) + " is " + std::to_string(tokens[i]) +
                      " but vocab_size is " + std::to_string(vocab_size_));
  write_tokens(file_, tmp_, token_bytes_, tokens);
  count_ += tokens.size();
}

void TokenFileWriter::finish() {
  if (count_ == 0) fail(path_, "empty: refusing to write a file with 0 tokens");
  if (std::fseek(file_, 0, SEEK_SET) != 0) fail(tmp_, "cannot seek: " + errno_text());
  write_header(file_, tmp_, vocab_size_, count_);
  if (std::fflush(file_) != 0) fail(tmp_, "write failed: " + errno_text());
  // fsync before rename: otherwise a crash could leave the new name pointing at missing data.
  if (::fsync(::fileno(file_)) != 0) fail(tmp_, "fsync failed: " + errno_text());
  const int closed = std::fclose(std::exchange(file_, nullptr));
  if (closed != 0 || std::rename(tmp_.c_str(), path_.c_str()) != 0) {
    const std::string err = errno_text();
    std::remove(tmp_.c_str());
    fail(path_, (closed != 0 ? "close of " + tmp_ + " failed: " : "cannot rename " + tmp_ + " to it: ") + err);
  }
}

void write_token_file(const std::string& path, uint32_t vocab_size, std::span<const uint32_t> tokens) {
  TokenFileWriter out(path, vocab_size);
  out.append(tokens);
  out.finish();
}

}  // namespace moeut
