// Deterministic random numbers: splitmix64, keyed by (seed, purpose), so that every stream
// (a tensor's initialisation, a batch's sampling) is reproducible on its own, independent of
// the order in which streams are used or of how work is split across processes.
#pragma once
#include <cmath>
#include <cstdint>
#include <numbers>
#include <string_view>

namespace moeut {

inline constexpr uint64_t kSplitmixGamma = 0x9E3779B97F4A7C15ull;  // splitmix64's increment

inline uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += kSplitmixGamma);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline uint64_t hash_mix(uint64_t a, uint64_t b) {
  uint64_t s = a ^ (b * 0xD6E8FEB86659FD93ull);
  return splitmix64(s);
}

inline uint64_t hash_string(std::string_view s) {  // FNV-1a
  uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001B3ull;
  return h;
}

class Rng {
 public:
  explicit Rng(uint64_t key) : state_(key) {}
  uint64_t next() { return splitmix64(state_); }
  double uniform() { return uniform_of(next()); }  // [0, 1)
  double normal() {  // Box-Muller; the second value is dropped to keep streams simple
    const uint64_t a = next(), b = next();
    return normal_of(a, b);
  }
  // splitmix64 is a counter: the value next() returns i calls from now, without drawing it, and
  // a jump over n draws. Long streams can so be drawn in parallel, the same values as in turn.
  uint64_t peek(uint64_t i) const {
    uint64_t s = state_ + i * kSplitmixGamma;
    return splitmix64(s);
  }
  void skip(uint64_t n) { state_ += n * kSplitmixGamma; }
  static double uniform_of(uint64_t bits) { return double(bits >> 11) * 0x1.0p-53; }
  // normal() from its two draws.
  static double normal_of(uint64_t a, uint64_t b) {
    const double u1 = 1.0 - uniform_of(a), u2 = uniform_of(b);
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
  }

 private:
  uint64_t state_;
};

}  // namespace moeut
