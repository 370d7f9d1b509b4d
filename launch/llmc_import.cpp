// llm.c / nanoGPT token files -> MoEUT token file (launch/llmc_import.h).
#include "launch/llmc_import.h"

#include <algorithm>
#include <fstream>
#include <iostream>
#include <span>

#include "core/token_file.h"

namespace moeut {
namespace {

constexpr uint32_t kLlmcMagic = 20240520;
constexpr uint64_t kLlmcHeaderBytes = 256 * 4;

// Where the tokens of one input start and how many there are.
struct Layout {
  uint64_t header_bytes;
  uint64_t count;
};

// llm.c's header when the file starts with its magic, else a headerless nanoGPT array.
Layout detect_layout(const std::string& path, std::ifstream& in, uint64_t file_bytes) {
  unsigned char h[kLlmcHeaderBytes] = {};
  in.read(reinterpret_cast<char*>(h), std::streamsize(std::min(file_bytes, kLlmcHeaderBytes)));
  in.clear();
  in.seekg(0);
  if (file_bytes < 4 || load_le32(h) != kLlmcMagic) {
    if (file_bytes % 2 != 0)
      throw DataError(path + ": no llm.c header and an odd size (" + std::to_string(file_bytes) +
                      " bytes), so not an array of uint16 tokens");
    return {0, file_bytes / 2};
  }
  if (file_bytes < kLlmcHeaderBytes)
    throw DataError(path + ": truncated llm.c header: " + std::to_string(file_bytes) + " bytes, less than 1024");
  const uint32_t version = load_le32(h + 4), count = load_le32(h + 8);
  if (version != 1 && version != 2)
    throw DataError(path + ": llm.c header version " + std::to_string(version) + " is not supported (1 or 2: uint16 tokens)");
  const uint64_t expected = kLlmcHeaderBytes + 2 * uint64_t(count);
  if (file_bytes != expected)
    throw DataError(path + ": llm.c header says " + std::to_string(count) + " tokens (" + std::to_string(expected) +
                    " bytes) but the file has " + std::to_string(file_bytes) + " bytes");
  return {kLlmcHeaderBytes, count};
}

// Appends the tokens of one input to out, in chunks, checking each against the vocabulary.
void copy_tokens(const std::string& path, std::ifstream& in, const Layout& layout, uint32_t vocab_size,
                 TokenFileWriter& out) {
  constexpr uint64_t kChunk = 1 << 16;
  std::vector<unsigned char> bytes(2 * kChunk);
  std::vector<uint32_t> tokens(kChunk);
  in.seekg(std::streamoff(layout.header_bytes));
  for (uint64_t first = 0; first < layout.count; first += kChunk) {
    const size_t n = size_t(std::min(kChunk, layout.count - first));
    if (!in.read(reinterpret_cast<char*>(bytes.data()), std::streamsize(2 * n)))
      throw DataError(path + ": read error at token " + std::to_string(first));
    for (size_t k = 0; k < n; ++k) {
      tokens[k] = load_le16(bytes.data() + 2 * k);
      if (tokens[k] >= vocab_size)
        throw DataError(path + ": token out of vocabulary: token " + std::to_string(first + k) + " (byte offset " +
                        std::to_string(layout.header_bytes + 2 * (first + k)) + ") is " + std::to_string(tokens[k]) +
                        " but --vocab_size is " + std::to_string(vocab_size));
    }
    out.append(std::span<const uint32_t>(tokens.data(), n));
  }
}

}  // namespace

void import_llmc(const LlmcImport& job) {
  TokenFileWriter out(job.out, job.vocab_size);
  for (const std::string& path : job.inputs) {
    std::ifstream in(path, std::ios::binary | std::ios::ate);
    if (!in) throw DataError(path + ": cannot open for reading");
    const auto file_bytes = uint64_t(in.tellg());
    in.seekg(0);
    const Layout layout = detect_layout(path, in, file_bytes);
    copy_tokens(path, in, layout, job.vocab_size, out);
    std::cout << path << ": " << (layout.header_bytes ? "llm.c header" : "no header (nanoGPT)") << ", "
              << layout.count << " tokens\n";
  }
  out.finish();
  std::cout << job.out << ": " << out.count() << " tokens, vocab_size " << job.vocab_size << "\n";
}

}  // namespace moeut
