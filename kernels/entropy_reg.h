// The MoEUT routing regulariser: the negative entropy of the mean selection distribution.
// For each sequence b and group g (a head, or the whole FFN layer): p = softmax over the E
// experts of the raw selection logits at every one of the S positions (T tokens times the R
// uses of the physical layer); m = mean over the S positions of p, computed in log space;
// the term is -entropy(m), averaged over sequences and groups.
#pragma once
#include <cstdint>
#include <span>

namespace moeut {

// uses[r] holds the raw logits of use r as [B, T, groups * E]. Returns coef * mean_{b,g} of
// -entropy(m) and accumulates coef times its gradient into duses[r] (same layout).
template <typename T>
double entropy_reg_forward_backward(std::span<T* const> duses, std::span<const T* const> uses,
                                    int64_t B, int64_t T_len, int64_t groups, int64_t E,
                                    double coef);

}  // namespace moeut
