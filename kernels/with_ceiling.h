// Run-time choice among a kernel's compile-time instantiations.
#pragma once
#include <cstdint>
#include <type_traits>

namespace moeut::cuda {

// Calls f(std::integral_constant<int, C>) with C the first of Cs (ascending) at or above v, or
// the last of them when none is.
template <int C, int... Cs, class F>
void with_ceiling(int64_t v, F&& f) {
  if constexpr (sizeof...(Cs) > 0) {
    if (v > C) return with_ceiling<Cs...>(v, f);
  }
  f(std::integral_constant<int, C>{});
}

}  // namespace moeut::cuda
