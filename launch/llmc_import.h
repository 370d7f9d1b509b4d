// Token files of llm.c and nanoGPT made into this project's token files (docs/DATA.md): uint16
// tokens, after llm.c's 1024-byte header (256 int32: magic 20240520, version 1 or 2, token count)
// or with no header at all (nanoGPT's raw uint16 arrays).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace moeut {

struct LlmcImport {
  std::vector<std::string> inputs;  // read in this order, concatenated
  uint32_t vocab_size;              // every token must be below it
  std::string out;
};

// Streams the inputs into one token file; prints each input's layout and token count. Throws
// DataError naming the file (and for a bad token its index, byte offset and value).
void import_llmc(const LlmcImport& job);

}  // namespace moeut
