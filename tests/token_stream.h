// A token file with structure to learn, for training tests: token i+1 is usually
// (token i * 3 + 1) mod V.
#pragma once
#include <string>
#include <vector>

#include "core/rng.h"
#include "core/token_file.h"

namespace moeut::test {

inline void write_token_stream(const std::string& path, uint32_t V, int64_t n, uint64_t seed) {
  std::vector<uint32_t> tokens(static_cast<size_t>(n));
  Rng rng(seed);
  uint32_t t = 0;
  for (auto& x : tokens) x = t = rng.uniform() < 0.8 ? (t * 3 + 1) % V : uint32_t(rng.next() % V);
  write_token_file(path, V, tokens);
}

}  // namespace moeut::test
