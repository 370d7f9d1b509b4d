// Token embedding lookup.
#pragma once
#include <cstdint>

namespace moeut {

// out[i] = table[tokens[i]]; table [V, d], out [n, d].
template <typename T>
void embedding_forward(T* out, const int32_t* tokens, const T* table, int64_t n, int64_t d);

// dtable[tokens[i]] += dout[i] (accumulates; rows in token order, so repeated tokens sum
// deterministically).
template <typename T>
void embedding_backward(T* dtable, const T* dout, const int32_t* tokens, int64_t n, int64_t d);

}  // namespace moeut
