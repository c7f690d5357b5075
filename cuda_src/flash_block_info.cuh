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

// Causal dense grids of one block per (query tile, batch entry) — grid (n_m, nb1·nb2, nb0), whose blocks the
// hardware starts in increasing L = x + n_m·(y + gridDim.y·z), the next where one ends — with n_groups > 0: block
// L takes the L-th tile of a grouped longest-first order. The entries (e = y + gridDim.y·z) form n_groups groups
// of consecutive entries, sizes within one of each other (the larger first); group by group, the query tiles from
// the last one down (the longest: bottom-right alignment), the group's entries inner. Longest first within a group
// keeps the SMs evenly busy; the groups bound the K / V the running blocks read (the host sizes them:
// tiles.causal_groups). Otherwise (n_groups = 0, not causal, or a variant that keeps its grid: Is_groupable
// false) query_tile's order, entry by entry, and from_grid.
// grid_tile_at: the same for block (x, y, z) (ctaid_reread's, where the caller needs the tile late: ptxas
// re-reads blockIdx where used, but keeps what a division made of it live).
template <bool Is_causal, bool Is_groupable>
__device__ __forceinline__ void grid_tile_at(int x, int y, int z, int n_m, int nb2, int n_groups, int& m_block,
                                             BatchIndex& b) {
  const int ny = static_cast<int>(gridDim.y), n_e = ny * static_cast<int>(gridDim.z);
  if (!(Is_causal && Is_groupable) || n_groups <= 0) {
    m_block = query_tile<Is_causal>(x, n_m);
    b.b0 = z, b.b1 = y / nb2, b.b2 = y % nb2;   // BatchIndex::from_grid
    return;
  }
  const int groups = n_groups < n_e ? n_groups : n_e;
  const int L = x + n_m * (y + ny * z);
  const int base = n_e / groups, big = n_e % groups;  // groups 0 .. big − 1 hold base + 1 entries
  const int big_tiles = big * (base + 1) * n_m;
  const bool in_big = L < big_tiles;
  const int size = in_big ? base + 1 : base;
  const int e0 = in_big ? L / (size * n_m) * size : big * (base + 1) + (L - big_tiles) / (size * n_m) * size;
  const int within = L - e0 * n_m, level = within / size, e = e0 + within - level * size;
  m_block = n_m - 1 - level;
  b.b0 = e / ny;
  b.b1 = (e - b.b0 * ny) / nb2;
  b.b2 = (e - b.b0 * ny) % nb2;
}

template <bool Is_causal, bool Is_groupable>
__device__ __forceinline__ void grid_tile(int n_m, int nb2, int n_groups, int& m_block, BatchIndex& b) {
  grid_tile_at<Is_causal, Is_groupable>(static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y),
                                        static_cast<int>(blockIdx.z), n_m, nb2, n_groups, m_block, b);
}

// blockIdx read through volatile moves (the device compiler cannot reuse an earlier read, so values derived from
// it are recomputed where they are used instead of held in registers; the emulator: blockIdx).
__device__ __forceinline__ void ctaid_reread(int& x, int& y, int& z) {
#if defined(__CUDA_ARCH__)
  unsigned ux, uy, uz;
  asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(ux));
  asm volatile("mov.u32 %0, %%ctaid.y;\n" : "=r"(uy));
  asm volatile("mov.u32 %0, %%ctaid.z;\n" : "=r"(uz));
  x = static_cast<int>(ux), y = static_cast<int>(uy), z = static_cast<int>(uz);
#else
  x = static_cast<int>(blockIdx.x), y = static_cast<int>(blockIdx.y), z = static_cast<int>(blockIdx.z);
#endif
}

// x itself, through a volatile move the device compiler cannot see through: what is derived from the result is
// recomputed, not taken from registers holding what was derived from x before (the emulator: x).
__device__ __forceinline__ int opaque_int(int x) {
#if defined(__CUDA_ARCH__)
  asm volatile("mov.b32 %0, %0;\n" : "+r"(x));
#endif
  return x;
}

// The rows [row_begin, row_begin + rows_valid) of a tile of kRows rows starting at row_begin
// that exist in a sequence of length seq_len (the rest are zero-filled when loaded and never
// stored).
__device__ __forceinline__ int rows_in_tile(int row_begin, int kRows, int seq_len) {
  const int left = seq_len - row_begin;
  return left < 0 ? 0 : (left < kRows ? left : kRows);
}

}  // namespace flash
