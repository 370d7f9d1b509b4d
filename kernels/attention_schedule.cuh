// The flash attention kernels' blocks (private to kernels/attention_flash_*.cu): the rows a block
// owns and streams, and the order in which the blocks take the (sequence, head) pairs.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace moeut::cuda {

// kFlashBlockRows: the rows a block owns (queries in the forward pass, keys in the backward);
// kFlashTileRows: the rows of the tiles it streams past them.
inline constexpr int kFlashBlockRows = 128, kFlashTileRows = 64, kFlashThreads = 256;

// The flash kernels' block order, over a 1D grid of tiles x (batch, head) blocks. Causal tiles
// differ in length up to `tiles` times, so within each chunk of kChunkHeads (batch, head) pairs
// every pair's longest tile goes first and the short ones fill the chunk's last wave (rank 0: the
// longest). A chunk (128 blocks at T 1024: a wave of the backward kernel, half of the
// forward's) reads the rows of its pairs only, so they stay in L2 while it runs.
inline constexpr int kChunkHeads = 16;
struct FlashBlock {
  int rank, bh;
};
__device__ __forceinline__ FlashBlock flash_block(int tiles, int heads) {
  const int span = kChunkHeads * tiles, chunk = int(blockIdx.x) / span, rem = int(blockIdx.x) % span;
  const int in_chunk = min(kChunkHeads, heads - chunk * kChunkHeads);
  return {rem / in_chunk, chunk * kChunkHeads + rem % in_chunk};
}
__host__ inline unsigned flash_blocks(int64_t B, int64_t T, int64_t H) {
  return unsigned((T + kFlashBlockRows - 1) / kFlashBlockRows * B * H);
}
// A flash block's (sequence, head) and its rank among that head's `tiles` blocks of 128 rows (0:
// the longest, see flash_block), with where the head's rows start in the [B, T, H, dh] tensors.
struct FlashHead {
  int tiles, rank, bh, b, h;
  int64_t ld, base;
  // In the forward pass: the block's first query row (rank 0 takes the last query block, which
  // attends to the most keys), and the last key tile of `key_rows` rows that its rows see.
  __device__ int forward_rows() const { return (tiles - 1 - rank) * kFlashBlockRows; }
  __device__ int last_key_tile(int T, int key_rows) const {
    return min(T - 1, forward_rows() + kFlashBlockRows - 1) / key_rows;
  }
  // Where the head's rows start in a tensor whose token rows are row_ld elements apart (q and k).
  __device__ int64_t base_in(int T, int dh, int64_t row_ld) const { return int64_t(b) * T * row_ld + int64_t(h) * dh; }
};
__device__ __forceinline__ FlashHead flash_head(int T, int H, int dh) {
  const int tiles = (T + kFlashBlockRows - 1) / kFlashBlockRows;
  const FlashBlock blk = flash_block(tiles, int(gridDim.x) / tiles);
  const int b = blk.bh / H, h = blk.bh % H;
  const int64_t ld = int64_t(H) * dh;
  return {tiles, blk.rank, blk.bh, b, h, ld, int64_t(b) * T * ld + int64_t(h) * dh};
}

}  // namespace moeut::cuda
