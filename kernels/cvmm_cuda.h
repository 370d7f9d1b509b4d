// cvmm on the GPU (see cvmm.h for the operation): bf16 operands, fp32 accumulation on tensor
// cores, token rows gathered inside the product's tile loads (no [selections, K] copy), the
// routing weight applied in the epilogue, results stored or scatter-added into their rows.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cvmm.h"
#include "kernels/device_buffer.h"

namespace moeut::cuda {

// Selections grouped by expert, on the device. Row tiles of kCvmmTileRows consecutive
// selections of one expert are the unit of work; tile_expert/tile_first list them.
struct CvmmPlan {
  const int32_t* in_row;     // [n] row of the product's input read by each selection
  const int32_t* out_row;    // [n] row of the output each selection writes
  const int32_t* by_expert;  // [n] selections ordered by expert
  const int64_t* expert_begin;  // [experts + 1] offsets into by_expert
  const int32_t* tile_expert;   // [tiles]
  const int32_t* tile_first;    // [tiles] first position (into by_expert) of the tile
  int32_t tiles;
};
inline constexpr int kCvmmTileRows = 64;

// out[out_row] (+)= weight · X[in_row] · op(W_e). W holds [E, K, N] (op = identity) or
// [E, N, K] (transposed: op(W_e) = W_eᵀ). weight may be null (ones).
// accumulate = false: out is bf16 [*, N] and each row is written once (rows distinct).
// accumulate = true: out_f32 [*, N] is added into atomically (several selections per row).
// dweight, when not null, receives Σ_n (X[in_row]·op(W_e))[n] · dot_rows[out_row][n] per
// selection (before weighting): the routing-weight gradient of the transposed product.
struct CvmmRowsArgs {
  const __nv_bfloat16* X;
  const __nv_bfloat16* W;
  const float* weight;
  __nv_bfloat16* out;
  float* out_f32;
  float* dweight;
  const __nv_bfloat16* dot_rows;
  int64_t K, N;
  bool transpose_w, accumulate;
};
void cvmm_rows(const CvmmPlan& plan, const CvmmRowsArgs& a, cudaStream_t stream);

// dW_e += Σ_{selections s of e} A[a_row(s)]ᵀ · (weight_s · B[b_row(s)]), A [*, K], B [*, N],
// dW fp32 [E, K, N]: the expert-weight gradient, with both operands gathered.
struct CvmmWeightGradArgs {
  const __nv_bfloat16* A;
  const __nv_bfloat16* B;
  const float* weight;   // may be null
  bool a_by_in_row;      // A rows: in_row (true) or out_row (false); B rows: the other
  float* dW;
  int64_t K, N, n_experts;
};
void cvmm_weight_grad(const CvmmPlan& plan, const CvmmWeightGradArgs& a, cudaStream_t stream);

// Device copies of a grouped CvmmSelection (CPU-built) and its row tiles.
class DeviceCvmmPlan {
 public:
  explicit DeviceCvmmPlan(const CvmmSelection& sel);
  // swapped: in_row and out_row exchanged, for the transposed product of a backward pass.
  CvmmPlan view(bool swapped = false) const;

 private:
  DeviceBuffer<int32_t> in_row_, out_row_, by_expert_, tile_expert_, tile_first_;
  DeviceBuffer<int64_t> expert_begin_;
};

}  // namespace moeut::cuda
