// flash_mask.cuh — which scores a query row may see, and which tiles need looking at.
//
// Causal attention is bottom-right aligned (FlashAttention >= 2.1): query row i sees key
// column j iff  j <= i + (Lk - Lq).  Columns j >= Lk never exist (the last key tile is
// zero-filled past Lk and must be masked). A row that sees no key at all ends with
// out = 0 and lse = -inf (see flash_softmax.cuh for the -inf guards).
//
// Tile-level questions answered here, for a query tile of Br rows starting at m0 and a
// key tile of Bc columns starting at n0:
//   n_block_max   — key tiles at or past it are entirely invisible to every row of the
//                   query tile: they are never loaded (causal skip, and the sequence end);
//   m_block_min   — the first query tile that sees any column of a key tile (backward);
//   needs_mask    — whether any score of the (query tile, key tile) pair is invisible; only
//                   those tiles pay for the per-element test below.
// Element-level: `apply(s, row, col)` returns s or -inf.
//
// Extension point: the score step of every kernel is  s = scale·log2(e)·(q·k)  followed by
// Mask::apply. Windows (left/right), block-sparse masks, ALiBi biases and softcap belong in
// this struct (new members and a richer apply/needs_mask), so kernels keep calling the same
// three functions.
#pragma once
#include "fa_port.cuh"
#include "flash_block_info.cuh"

namespace flash {

template <bool Is_causal>
struct Mask {
  int Lq;             // number of query rows
  int Lk;             // number of key columns
  int causal_offset;  // Lk - Lq: row i sees columns j <= i + causal_offset

  __device__ __forceinline__ Mask(int Lq_, int Lk_) : Lq(Lq_), Lk(Lk_), causal_offset(Lk_ - Lq_) {}

  // Number of key columns [0, n) visible to query row `row` (may be <= 0 for causal rows
  // above the diagonal when Lq > Lk).
  __device__ __forceinline__ int visible_keys(int row) const {
    if (!Is_causal) return Lk;
    const int n = row + causal_offset + 1;
    return n < Lk ? n : Lk;
  }

  // One past the last key tile (of width Bc) that any of the query rows [m0, m0 + Br) sees.
  // Returns 0 when no row of the tile sees any key.
  __device__ __forceinline__ int n_block_max(int m0, int Br, int Bc) const {
    const int last_row = (m0 + Br < Lq ? m0 + Br : Lq) - 1;
    const int n = visible_keys(last_row);
    return n <= 0 ? 0 : ceil_div(n, Bc);
  }

  // First query tile (of height Br) in which some row sees a column of the key tile [n0, n0+Bc):
  // row i sees column n0 iff i >= n0 - causal_offset.
  __device__ __forceinline__ int m_block_min(int n0, int Br) const {
    if (!Is_causal) return 0;
    const int first_row = n0 - causal_offset;
    return first_row <= 0 ? 0 : first_row / Br;
  }

  // Whether some score of query rows [m0, m0+Br) × key columns [n0, n0+Bc) is invisible.
  // Rows past Lq are not checked: they are never stored.
  __device__ __forceinline__ bool needs_mask(int m0, int n0, int Br, int Bc) const {
    const int n_end = n0 + Bc;  // one past the last column of the tile
    if (n_end > Lk) return true;                                 // sequence end
    if (Is_causal && n_end - 1 > m0 + causal_offset) return true;  // crosses the diagonal
    (void)Br;
    return false;
  }

  __device__ __forceinline__ bool is_visible(int row, int col) const {
    return col < Lk && (!Is_causal || col <= row + causal_offset);
  }

  // The score if (row, col) is visible, else -inf (exp2(-inf) = 0 removes it from the softmax).
  template <typename AccT>
  __device__ __forceinline__ AccT apply(AccT s, int row, int col) const {
    return is_visible(row, col) ? s : -static_cast<AccT>(INFINITY);
  }
};

}  // namespace flash
