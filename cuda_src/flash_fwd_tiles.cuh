// flash_fwd_tiles.cuh — which key tiles of the tensor-core forward need the element mask.
//
// For a query tile Q_i (rows [m0, m0 + Br)) the visible key tiles are j < n_block_max
// (Mask::n_block_max). Of those, the tiles that need no element mask form a prefix
// j < n_block_unmasked: tiles that end at or before the sequence end and (causal) whose last
// column is visible to the tile's first row. The kernel runs the masked suffix first (last tile
// first, as FlashAttention-2) and then the unmasked prefix without any per-element mask work.
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

}  // namespace flash
