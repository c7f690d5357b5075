// flash_block_info.cuh — where one thread block's tiles live in global memory.
//
// Batch convention (shared by every flasharray kernel): the leading batch dims of every tensor
// are merged on the host into at most three, (nb0, nb1, nb2), and the launch grid is
//     grid = (blocks along the sequence, nb1 * nb2, nb0)
// so that b0 = blockIdx.z, b1 = blockIdx.y / nb2, b2 = blockIdx.y % nb2.
// Every tensor carries its own element strides for b0, b1, b2 and for its rows; its last axis
// (the head dimension) is contiguous. A batch stride of 0 broadcasts the tensor along that dim,
// which is how MQA/GQA reach the kernels (K and V shared by a group of query heads).
#pragma once
#include "fa_port.cuh"

namespace flash {

// Integer ceiling division for non-negative operands.
__device__ __forceinline__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// The query tile block x of n_m computes. Causal blocks take the tiles longest first: with the
// diagonal (bottom-right aligned) tile m sees about m + 1 key tiles, and blocks are dispatched in
// increasing x, so in-order tiles leave the longest ones for the end of the grid (its last wave
// runs a few long blocks on an otherwise idle GPU). Reversed, the short tiles fill the tail
// (FlashAttention-3's order; the persistent Hopper scheduler does the same). Not causal: in order.
template <bool Is_causal>
__device__ __forceinline__ int query_tile(int x, int n_m) {
  return Is_causal ? n_m - 1 - x : x;
}

// Element strides of one tensor: three merged batch dims and the row (sequence) dim.
struct TensorStrides {
  long long b0, b1, b2, row;
};

// The batch coordinates (b0, b1, b2) of the calling thread block.
struct BatchIndex {
  int b0, b1, b2;

  __device__ __forceinline__ static BatchIndex from_grid(int nb2) {
    BatchIndex b;
    b.b0 = static_cast<int>(blockIdx.z);
    b.b1 = static_cast<int>(blockIdx.y) / nb2;
    b.b2 = static_cast<int>(blockIdx.y) % nb2;
    return b;
  }

  // Element offset of this batch entry's (row 0, column 0) in a tensor with strides s.
  __device__ __forceinline__ long long offset(const TensorStrides& s) const {
    return static_cast<long long>(b0) * s.b0 + static_cast<long long>(b1) * s.b1 +
           static_cast<long long>(b2) * s.b2;
  }
};

// The rows [row_begin, row_begin + rows_valid) of a tile of kRows rows starting at row_begin
// that exist in a sequence of length seq_len (the rest are zero-filled when loaded and never
// stored).
__device__ __forceinline__ int rows_in_tile(int row_begin, int kRows, int seq_len) {
  const int left = seq_len - row_begin;
  return left < 0 ? 0 : (left < kRows ? left : kRows);
}

}  // namespace flash
