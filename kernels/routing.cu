#include <stdexcept>
#include <type_traits>

#include "kernels/cuda_check.h"
#include "kernels/fast_exp.cuh"
#include "kernels/lane_reduce.cuh"
#include "kernels/routing_cuda.h"
#include "kernels/with_ceiling.h"

namespace moeut::cuda {
namespace {

constexpr int kWarps = 8, kMaxPerLane = 32;  // E <= 32 * 32

// Logits as unsigned keys in the same order: the sign bit flipped for z >= 0, every bit for z < 0
// (NaN lowest, as key 0; -0 + 0 is +0, so -0 and +0 are equal, as compared in fp32). Shifts and
// logic instead of tests and selects: the top-k kernels are bound by the ALU pipe.
__device__ __forceinline__ uint32_t order_key(float z) {
  const uint32_t u = __float_as_uint(__fadd_rn(z, 0.f));
  return isnan(z) ? 0u : u ^ (uint32_t(int32_t(u) >> 31) | 0x80000000u);
}
// The logit of a key (NaN's key gives a NaN, zeros +0): the selection weights come from the keys
// instead of a second read of the row.
__device__ __forceinline__ float key_logit(uint32_t key) {
  return __uint_as_float(key ^ (~uint32_t(int32_t(key) >> 31) | 0x80000000u));
}
// count += (key >= 2^32 - minus) (nothing for minus 0): key + minus carries exactly then, and the
// carry is added straight into the count, with no predicate made into an integer (ptxas pairs two
// keys an IADD3.X).
__device__ __forceinline__ void count_carry(uint32_t& count, uint32_t key, uint32_t minus) {
  asm("{\n .reg .u32 t;\n add.cc.u32 t, %1, %2;\n addc.u32 %0, %0, 0;\n}\n" : "+r"(count) : "r"(key), "r"(minus));
}
__device__ __forceinline__ float key_sigmoid(uint32_t key) { return 1.f / (1.f + __expf(-key_logit(key))); }

// The keys of a row held by L lanes: lane `sub` of them holds experts sub, sub + L, ... (P >= E / L
// slots); bit q of the result marks slot q past E. The row's logits are copied to `packed` when
// given, after all of them are loaded (interleaved, each load would wait for the store before it,
// which may alias).
template <int P, int L>
__device__ __forceinline__ uint32_t load_keys(uint32_t (&key)[P], const float* z, float* packed, int sub, int E) {
  float v[P];
#pragma unroll
  for (int q = 0; q < P; ++q) v[q] = sub + L * q < E ? z[sub + L * q] : 0.f;
  uint32_t dead = 0;
#pragma unroll
  for (int q = 0; q < P; ++q) {
    const int e = sub + L * q;
    const bool live = e < E;
    if (live && packed) packed[e] = v[q];
    key[q] = live ? order_key(v[q]) : 0u;
    dead |= live ? 0u : 1u << q;
  }
  return dead;
}

// The row (r / groups, r % groups) of logits whose token rows are ld apart (without a division
// when they are packed).
__device__ __forceinline__ const float* row_logits(const float* logits, int64_t r, int groups, int64_t ld, int E) {
  if (ld == int64_t(groups) * E) return logits + r * E;
  const uint32_t token = uint32_t(r) / uint32_t(groups);  // rows < 2^32, checked by the launcher
  return logits + int64_t(token) * ld + int64_t(uint32_t(r) - token * uint32_t(groups)) * E;
}

// A block's rows: kWarps · 32 / L consecutive tokens of one sequence b and one group g, L lanes
// each, so that they share one row (b, g) of the regulariser's means. Rows past the sequence's end
// are not live: their lanes redo its last row unwritten, taking part in the warp's shuffles and
// the block's barriers.
struct BlockRow {
  int64_t r;         // the lanes' row (token, g) of [n, groups]
  int64_t mean_row;  // b * groups + g
  bool live;
};
__host__ __device__ constexpr int rows_per_block(int L) { return kWarps * 32 / L; }
template <int L>
__device__ __forceinline__ BlockRow block_row(int64_t T, int groups) {
  constexpr int kRows = rows_per_block(L);
  const int64_t chunks = (T + kRows - 1) / kRows, chunk = blockIdx.x % chunks, bg = blockIdx.x / chunks;
  const int64_t b = bg / groups, t = chunk * kRows + threadIdx.x / L;
  return {(b * T + min(t, T - 1)) * groups + bg % groups, bg, t < T};
}

// The regulariser's softmax of a row, from the keys (the logits' bits, -0 as +0) and the row's
// largest key: exp(z - max) into the row's P·L floats of shared memory (slot q of lane sub at
// sub + L·q; dead slots hold garbage), their sum into `sum`. Returns the row's log-sum-exp. Each
// exponential is made once and stored without a test: the means are sums of these rows times
// 1 / (S·sum) (topk_kernel), not atomics into one row, which would multiply this function's
// instructions a row.
template <int P, int L>
__device__ __forceinline__ float row_exponentials(float* exps, float& sum, const uint32_t (&key)[P], uint32_t dead,
                                                  uint32_t row_top, int sub) {
  const float mx = key_logit(row_top), offset = mx * kLog2e;
  float s = 0.f;
#pragma unroll
  for (int q = 0; q < P; ++q) {
    const float e = fast_exp2(fmaf(key_logit(key[q]), kLog2e, -offset));
    exps[sub + L * q] = e;
    s += dead >> q & 1u ? 0.f : e;
  }
  sum = group_sum<L>(s);
  return mx + __logf(sum);
}

// Small k: each lane knows the best of its keys not yet taken; each of the k rounds takes the
// row's largest key (ties to the lower expert index) with two reductions over the row's L lanes,
// and only the lane that gave it looks again.
template <int P, int L>
__device__ __forceinline__ void select_by_rounds(int32_t* index, float* weight, const uint32_t (&key)[P], uint32_t dead,
                                                 int sub, bool live, int k) {
  uint32_t taken = dead;  // chosen, or past E
  uint32_t best = 0;
  int slot = -1;  // this lane's best untaken slot (the lower one on ties), -1 when none is left
  auto look = [&] {
    slot = -1;
#pragma unroll
    for (int q = 0; q < P; ++q)
      if (!(taken >> q & 1u) && (slot < 0 || key[q] > best)) best = key[q], slot = q;
  };
  look();
  int mine = 0;  // lane j < k: the expert taken in round j, and its key
  uint32_t mine_key = 0;
  for (int j = 0; j < k; ++j) {
    const uint32_t top = group_extreme_u32<L, true>(slot >= 0 ? best : 0u);
    const int winner = int(group_extreme_u32<L, false>(slot >= 0 && best == top ? unsigned(sub + L * slot) : ~0u));
    if (sub == j) mine = winner, mine_key = top;
    if (sub == winner % L) {
      taken |= 1u << slot;
      look();
    }
  }
  if (live && sub < k) {
    index[sub] = mine;
    weight[sub] = key_sigmoid(mine_key);
  }
}

// Large k: the k-th largest key is searched bit by bit from the top, counting the keys at or
// above each candidate (one warp sum per bit), and the search stops as soon as exactly k keys are
// at or above it (usually long before the last bit: the k-th and (k+1)-th largest logits rarely
// share many leading bits). Ties at the k-th key go to the lower expert indices; the k chosen are
// then ranked (descending key, ties to the lower index) through the warp's shared slots.
template <int P>
__device__ __forceinline__ void select_by_search(int32_t* index, float* weight, const uint32_t (&key)[P], uint32_t dead,
                                                 uint32_t lane_top, uint32_t row_top, int lane, int k,
                                                 uint32_t* chosen_key, int* chosen_expert) {
  // The k-th largest key lies between the lowest of the lanes' largest keys (each lane holds one at
  // or above it, so at least 32 >= k keys are) and the row's largest, so it shares their leading
  // bits, and the search starts below them.
  const uint32_t low = group_extreme_u32<32, false>(lane_top);
  const int known = __clz(int(row_top ^ low));  // 32 when they are equal
  uint32_t prefix = known == 32 ? row_top : row_top & ~(0xffffffffu >> known);  // the k-th key's known bits
  bool exact = false;  // exactly k keys are at or above prefix
  for (int b = 31 - known; b >= 0; --b) {
    const uint32_t candidate = prefix | 1u << b;  // above 0, so no dead slot counts
    // Two counts: a chain of P dependent additions is the loop's latency.
    const uint32_t minus = 0u - candidate;
    uint32_t part[2] = {0, 0};
#pragma unroll
    for (int q = 0; q < P; ++q) count_carry(part[q % 2], key[q], minus);
    int count = int(__reduce_add_sync(0xffffffffu, part[0] + part[1]));
    if (count >= k) {
      prefix = candidate;
      if (count == k) {
        exact = true;
        break;
      }
    }
  }
  uint32_t chosen = 0;  // bit q: slot q is among the k
#pragma unroll
  for (int q = 0; q < P; ++q)
    if (!(dead >> q & 1u) && (exact ? key[q] >= prefix : key[q] > prefix)) chosen |= 1u << q;
  if (!exact) {  // keys equal to the k-th fill the rest, lower expert index (slot, then lane) first
    int need = k - int(__reduce_add_sync(0xffffffffu, unsigned(__popc(chosen))));
    const uint32_t below = (1u << lane) - 1u;
#pragma unroll
    for (int q = 0; q < P; ++q) {
      if (need <= 0) break;
      const uint32_t tie = __ballot_sync(0xffffffffu, !(dead >> q & 1u) && key[q] == prefix);
      if ((tie >> lane & 1u) && __popc(tie & below) < need) chosen |= 1u << q;
      need -= __popc(tie);
    }
  }
  int filled = 0;  // compact the k into shared memory, in slot-major order
#pragma unroll
  for (int q = 0; q < P; ++q) {
    const uint32_t mask = __ballot_sync(0xffffffffu, chosen >> q & 1u);
    if (chosen >> q & 1u) {
      const int at = filled + __popc(mask & ((1u << lane) - 1u));
      chosen_key[at] = key[q];
      chosen_expert[at] = lane + 32 * q;
    }
    filled += __popc(mask);
  }
  if (lane >= k) chosen_key[lane] = 0;  // below every chosen key: the counts below read 4 at a time
  __syncwarp();
  // Each of the k ranks its key: the chosen keys above it (counted from carries, 2^32 - (mine + 1)
  // being ~mine), then, only if two of them are equal (the ranks then do not add up to k(k-1)/2),
  // the keys equal to it at a lower position, which is a lower expert: the compaction above was
  // slot-major. One comparison a key instead of a lexicographic one: the kernel is bound by the
  // ALU pipe.
  const uint32_t mine = chosen_key[lane];
  uint32_t above[2] = {0, 0};
  for (int i = 0; i < k; i += 4) {
    const uint4 other = *reinterpret_cast<const uint4*>(chosen_key + i);
    count_carry(above[0], other.x, ~mine);
    count_carry(above[1], other.y, ~mine);
    count_carry(above[0], other.z, ~mine);
    count_carry(above[1], other.w, ~mine);
  }
  int rank = int(above[0] + above[1]);
  if (int(__reduce_add_sync(0xffffffffu, lane < k ? unsigned(rank) : 0u)) != k * (k - 1) / 2) {
#pragma unroll 1
    for (int i = 0; i < min(lane, k); ++i) rank += chosen_key[i] == mine;
  }
  if (lane < k) {
    index[rank] = chosen_expert[lane];
    weight[rank] = key_sigmoid(mine);
  }
}

// L lanes per (row, group) (the search: a whole warp), blocks as block_row lays them out; with
// means.mean, each row's exponentials and their scale 1 / (S·sum) (0 for a row that is not live)
// go to dynamic shared memory, and after the block's barrier each column's scaled sum over the
// rows is added to the block's mean row. Attention's 12 experts take 16 lanes, so a warp does two
// rows: with a warp a row, 20 of its lanes would idle through the regulariser's softmax. Four
// blocks an SM up to 20 keys a lane (640 experts), which 64 registers hold without spilling: the
// FFN's search would take 80 registers (three blocks) for its stored exponentials, and five
// blocks leave too few (48). Above that, the registers the kernel needs.
template <int P, int L, bool kSearch>
__global__ void __launch_bounds__(kWarps * 32, P <= 20 ? 4 : 1) topk_kernel(int32_t* index, float* weight, const float* logits,
                                                                            float* packed, int groups, int64_t ld,
                                                                            int E, int k, SoftmaxMeans means) {
  static_assert(!kSearch || L == 32, "the search takes a warp a row");
  constexpr int kRows = rows_per_block(L), kRowFloats = P * L;
  extern __shared__ float exps[];  // [kRows][kRowFloats], then scale[kRows]
  float* const scale = exps + kRows * kRowFloats;
  __shared__ alignas(16) uint32_t chosen_key[kSearch ? kWarps : 1][32];
  __shared__ int chosen_expert[kSearch ? kWarps : 1][32];
  const int lane = threadIdx.x % 32, sub = lane % L, warp = threadIdx.x / 32, slot = threadIdx.x / L;
  const BlockRow row = block_row<L>(means.T, groups);
  // A warp a row: a dead row is a dead warp, which skips it. Several rows a warp: each group's
  // lanes take part in the warp's shuffles, and write only for a live row. (Keeping the first
  // form for L = 32 holds the FFN's top-k at 64 registers instead of 80.)
  const bool live = L == 32 || row.live;
  if (L < 32 || row.live) {
    const int64_t r = row.r;
    uint32_t key[P];
    const uint32_t dead =
        load_keys<P, L>(key, row_logits(logits, r, groups, ld, E), packed && live ? packed + r * E : nullptr, sub, E);
    uint32_t lane_top = 0;  // a dead slot's key 0 is below every live key (but NaN's, whose row is NaN anyway)
#pragma unroll
    for (int q = 0; q < P; ++q) lane_top = max(lane_top, key[q]);
    const uint32_t row_top = group_extreme_u32<L, true>(lane_top);
    if (means.mean) {
      float sum;
      const float lse = row_exponentials<P, L>(exps + slot * kRowFloats, sum, key, dead, row_top, sub);
      if (sub == 0) scale[slot] = live ? means.inv_S / sum : 0.f;
      if (sub == 0 && live) means.lse[r] = lse;
    }
    if constexpr (kSearch)
      select_by_search(index + r * k, weight + r * k, key, dead, lane_top, row_top, lane, k, chosen_key[warp],
                       chosen_expert[warp]);
    else
      select_by_rounds<P, L>(index + r * k, weight + r * k, key, dead, sub, live, k);
  } else if (means.mean && sub == 0) {
    scale[slot] = 0.f;  // a dead warp's row, its exponentials never written
  }
  if (means.mean) {
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      float sum = 0.f;
#pragma unroll 8
      for (int j = 0; j < kRows; ++j) sum = scale[j] != 0.f ? fmaf(scale[j], exps[j * kRowFloats + e], sum) : sum;
      atomicAdd(&means.mean[row.mean_row * E + e], sum);
    }
  }
}

// A row's E logits at z handled by L lanes of a warp, about kExpertsPerLane each (L: the power of
// two at or above E / kExpertsPerLane, from 4 to 32), 32 / L rows at a time: attention's 12
// experts take 4 lanes, 3 each, so that a warp covers up to 8 of its groups at once.
constexpr int64_t kExpertsPerLane = 4;
int64_t lane_target(int64_t E) { return (E + kExpertsPerLane - 1) / kExpertsPerLane; }

// One warp per token: the regulariser's gradient of its groups (L lanes a group) into the warp's
// part of shared memory, the selected experts' terms added (distinct within a group, so without
// atomics), the row written in bf16.
template <int L>
__global__ void __launch_bounds__(kWarps * 32) topk_backward_kernel(__nv_bfloat16* dlogits, int64_t ld, SoftmaxGrad reg,
                                                                    const float* dweight, const int32_t* index,
                                                                    const float* weight, int64_t n, int groups, int E,
                                                                    int k) {
  extern __shared__ float rows[];
  const int lane = threadIdx.x % 32, cols = groups * E, picks = groups * k;
  const int64_t t = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (t >= n) return;
  float* const row = rows + (threadIdx.x / 32) * cols;
  if (reg.z) {
    const float* const c = reg.c + t / reg.T * cols;
    for (int g0 = 0; g0 < groups; g0 += 32 / L) {  // lanes past the last group redo it, unwritten
      const bool mine = g0 + lane / L < groups;
      const int g = min(g0 + lane / L, groups - 1), sub = lane % L;
      const float* const z = reg.z + t * cols + g * E;
      const float* const cg = c + g * E;
      const float lse = reg.lse[t * groups + g];
      float dot = 0.f;
      for (int e = sub; e < E; e += L) {
        const float p = __expf(z[e] - lse);
        if (mine) row[g * E + e] = p;
        dot += p * cg[e];
      }
      dot = group_sum<L>(dot);
      if (mine)
        for (int e = sub; e < E; e += L) row[g * E + e] = reg.scale * row[g * E + e] * (cg[e] - dot);
    }
  } else {
    for (int c = lane; c < cols; c += 32) row[c] = 0.f;
  }
  __syncwarp();
  for (int j = lane; j < picks; j += 32) {
    const int64_t i = t * picks + j;
    const float w = weight[i];
    row[(j / k) * E + index[i]] += dweight[i] * w * (1.f - w);
  }
  __syncwarp();
  for (int c = lane; c < cols; c += 32) dlogits[t * ld + c] = __float2bfloat16(row[c]);
}

}  // namespace

void topk_sigmoid_forward(int32_t* index, float* weight, const float* logits, int64_t n, int64_t groups, int64_t E,
                          int64_t k, cudaStream_t stream, int64_t ld, float* packed, const SoftmaxMeans& means) {
  if (E > 32 * kMaxPerLane || k > 32 || k > E) throw std::invalid_argument("topk_sigmoid_forward: needs k <= E <= 1024, k <= 32");
  if (ld == 0) ld = groups * E;
  if (ld < groups * E) throw std::invalid_argument("topk_sigmoid_forward: logit rows ld apart need ld >= groups * E");
  const int64_t rows = n * groups;
  if (rows == 0) return;
  if (rows >= int64_t(1) << 32) throw std::invalid_argument("topk_sigmoid_forward: needs n * groups < 2^32");
  if (means.mean && (!means.lse || means.T <= 0 || n % means.T != 0))
    throw std::invalid_argument("topk_sigmoid_forward: the means need their lse and n a multiple of their T");
  SoftmaxMeans at = means;
  if (!at.mean) at.T = n;  // the blocks' layout takes one sequence then
  // P: the logits a lane holds, at or above E / 32. Rounds cost k passes over a lane's P keys,
  // the search one per bit it needs: rounds for k up to 4 (fewer passes than a full 32-bit
  // search), the search above. Rows of up to 16 experts take a lane each of a group of 4, 8 or 16.
  // (P is rounded up to the next listed ceiling: for the FFN's 565 experts 20 rather than 18,
  // which holds the kernel at 64 registers where 18 would take 78.)
  with_ceiling<1, 2, 4, 8, 12, 16, 20, 24, 28, kMaxPerLane>((E + 31) / 32, [&](auto P) {
    // topk_kernel<P, L, search> on the grid that block_row<L> lays out.
    auto launch = [&](auto L, auto search) {
      const int64_t rows = rows_per_block(L), blocks = n / at.T * groups * ((at.T + rows - 1) / rows);
      const size_t shared = at.mean ? size_t(rows * (P * L + 1)) * sizeof(float) : 0;  // topk_kernel's exps, scale
      topk_kernel<P, L, search><<<unsigned(blocks), kWarps * 32, shared, stream>>>(
          index, weight, logits, packed, int(groups), ld, int(E), int(k), at);
    };
    constexpr std::integral_constant<int, 32> kWarpRow;
    if (k > 4) {
      launch(kWarpRow, std::true_type{});
    } else if constexpr (P == 1) {
      with_ceiling<4, 8, 16, 32>(E, [&](auto L) { launch(L, std::false_type{}); });
    } else {
      launch(kWarpRow, std::false_type{});
    }
  });
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

void topk_sigmoid_backward(__nv_bfloat16* dlogits, int64_t ld, const SoftmaxGrad& reg, const float* dweight,
                           const int32_t* index, const float* weight, int64_t n, int64_t groups, int64_t E, int64_t k,
                           cudaStream_t stream) {
  if (n == 0) return;
  const int64_t cols = groups * E;
  if (ld < cols) throw std::invalid_argument("topk_sigmoid_backward: gradient rows ld apart need ld >= groups * E");
  if (reg.z && (!reg.lse || !reg.c || reg.T <= 0 || n % reg.T != 0))
    throw std::invalid_argument("topk_sigmoid_backward: the regulariser needs its lse, c and n a multiple of its T");
  const size_t shared = size_t(kWarps * cols) * sizeof(float);
  if (shared > 48 * 1024) throw std::invalid_argument("topk_sigmoid_backward: needs groups * E <= 1536");
  with_ceiling<4, 8, 16, 32>(lane_target(E), [&](auto L) {
    topk_backward_kernel<L><<<unsigned((n + kWarps - 1) / kWarps), kWarps * 32, shared, stream>>>(
        dlogits, ld, reg, dweight, index, weight, n, int(groups), int(E), int(k));
  });
  MOEUT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeut::cuda
