// flash_fwd_tiles.cuh — which key tiles of the tensor-core forward need the element mask.
//
// For a query tile Q_i (rows [m0, m0 + Br)) the visible key tiles are j < n_block_max
// (Mask::n_block_max). Of those, the tiles that need no element mask form a prefix
// j < n_block_unmasked: tiles that end at or before the sequence end and (causal) whose last
// column is visible to the tile's first row. The kernel runs the masked suffix first (last tile
// first, as FlashAttention-2) and then the unmasked prefix without any per-element mask work.
//
// Split-KV (flash_fwd_kernel's Is_split): split_key_tiles is the run of key tiles one split
// visits, and SplitOutput the element type of the kernel's output argument (the fp32 workspace).
// GQA packing with the causal mask (Is_packed): PackedRows, the query positions of a tile.
#pragma once
#include "fa_port.cuh"
#include "flash_mask.cuh"

namespace flash {

// Number of key tiles j (from 0) for which Mask::needs_mask(m0, j·Bc, ...) is false, at most
// n_block_max. Tile j is unmasked iff (j+1)·Bc <= Lk and, causal, (j+1)·Bc − 1 <= m0 + Lk − Lq.
template <bool Is_causal>
__device__ __forceinline__ int unmasked_key_tiles(const Mask<Is_causal>& mask, int m0, int Bc, int n_block_max) {
  int n = mask.Lk / Bc;  // tiles that end at or before the sequence end
  if (Is_causal) {
    const int last_visible = m0 + mask.causal_offset;  // last column row m0 sees
    const int by_diagonal = last_visible < 0 ? 0 : (last_visible + 1) / Bc;
    n = n < by_diagonal ? n : by_diagonal;
  }
  return n < n_block_max ? n : n_block_max;
}

// Split-KV: the run of key tiles [n_min, n_max) split `split` of `splits` visits. The key tiles
// [0, n_key_tiles) are cut into runs of ceil(n_key_tiles / splits) tiles — one cut for every
// query tile, so the combine merges the same partition in every row; n_max comes in as the tiles
// the query tile sees at all (Mask::n_block_max) and is clipped to the run. Empty (n_max <= n_min)
// when the run starts past the tiles the query tile sees, or past the last tile (more splits
// than tiles).
__device__ __forceinline__ void split_key_tiles(int& n_min, int& n_max, int n_key_tiles, int split, int splits) {
  const int per_split = ceil_div(n_key_tiles, splits);
  n_min = split * per_split;
  n_max = n_min + per_split < n_max ? n_min + per_split : n_max;
}

// GQA packing with the causal mask: the query positions of a tile's rows [m0, m0 + Br) when row r
// is position r mod Lg of head r div Lg (Lg = rows per head, total rows Lq = G·Lg). Within one
// head the positions run with the rows; a tile that crosses into the next head holds position
// Lg − 1 and position 0, so its key range is the whole of the last position's and its unmasked
// tiles those of position 0.
struct PackedRows {
  int first, last;  // smallest and largest query position among the tile's rows

  template <bool Is_packed>
  __device__ __forceinline__ static PackedRows of(int m0, int Br, int Lq, int Lg) {
    PackedRows p{m0, m0};
    if constexpr (Is_packed) {
      const int end = (m0 + Br < Lq ? m0 + Br : Lq) - 1;  // last existing row of the tile
      if (m0 / Lg == end / Lg) {
        p.first = m0 % Lg;
        p.last = end % Lg;
      } else {
        p.first = 0;
        p.last = Lg - 1;
      }
    } else {
      (void)Br; (void)Lq; (void)Lg;
    }
    return p;
  }

  // One past the last key tile (width Bc) the tile's largest position sees (0: none).
  template <bool Is_causal>
  __device__ __forceinline__ int n_block_max(const Mask<Is_causal>& mask, int Bc) const {
    const int n = mask.visible_keys(last);
    return n <= 0 ? 0 : ceil_div(n, Bc);
  }
};

// Element type of the forward kernel's output argument: T (out), or float for the split-KV
// workspace O_s.
template <typename T, bool Is_split> struct SplitOutput { using type = T; };
template <typename T> struct SplitOutput<T, true> { using type = float; };

}  // namespace flash
