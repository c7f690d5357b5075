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
// Extensions (kExt != 0, flash_ext.cuh): KeyTileWalk, the key tiles a query tile visits (window
// band, block-mask skips) and which of them need the element mask; dropout_mma, dropout on P in
// the registers of the mma layout.
#pragma once
#include "fa_port.cuh"
#include "flash_mask.cuh"
#include "flash_philox.cuh"

namespace flash {

// Number of key tiles j (from 0) for which Mask::needs_mask(m0, j·Bc, ...) is false, at most
// n_block_max. Tile j is unmasked iff (j+1)·Bc <= Lk and, causal, (j+1)·Bc − 1 <= m0 + Lk − Lq.
template <bool Is_causal, int kExt, typename AccT>
__device__ __forceinline__ int unmasked_key_tiles(const Mask<Is_causal, kExt, AccT>& mask, int m0, int Bc, int n_block_max) {
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
  template <bool Is_causal, int kExt, typename AccT>
  __device__ __forceinline__ int n_block_max(const Mask<Is_causal, kExt, AccT>& mask, int Bc) const {
    const int n = mask.visible_keys(last);
    return n <= 0 ? 0 : ceil_div(n, Bc);
  }
};

// The key tiles a query tile (rows [m0, m0 + Br)) visits with the extensions, downwards from
// n_block_max − 1 to lo (the window's first tile, or a split's): prev(n) is the next tile to visit
// below n — tiles whose block-mask blocks are all False are skipped, never loaded — or lo − 1
// when none is left. masked(n): whether tile n needs the element mask (geometry: sequence end,
// causal diagonal, window edges; or a block-mask tile with mixed blocks). Without a block mask,
// prev(n) is n − 1 and costs nothing.
template <bool Is_causal, int kExt, typename AccT>
struct KeyTileWalk {
  const Mask<Is_causal, kExt, AccT>& mask;
  int m0, Br, Bc, lo;

  __device__ __forceinline__ int prev(int n) const {
    --n;
    if constexpr (HasExt<kExt, kExtBlockMask>::value)
      while (n >= lo && !mask.block_any(m0, n * Bc, Br, Bc)) --n;
    return n;
  }
  // Ascending walk (SIMT forward): the next tile to visit above n, or hi when none is left.
  __device__ __forceinline__ int next(int n, int hi) const {
    ++n;
    if constexpr (HasExt<kExt, kExtBlockMask>::value)
      while (n < hi && !mask.block_any(m0, n * Bc, Br, Bc)) ++n;
    return n;
  }
  __device__ __forceinline__ bool masked(int n) const {
    if (mask.needs_mask(m0, n * Bc, Br, Bc)) return true;
    if constexpr (HasExt<kExt, kExtBlockMask>::value) return mask.block_cover(m0, n * Bc, Br, Bc) == kCoverSome;
    return false;
  }
};

// Dropout on P_ij held in the registers of the mma layout: acc_s[sl][nt][i] is row
// row0 + 16·sl + g + 8·(i / 2), column n0 + 8·nt + 2t + (i % 2) (g = lane / 4, t = lane % 4).
// One Philox call serves one row and 8 columns (an n8 tile's row, held by the 4 lanes of a quad),
// so per pair of n8 tiles the quad needs 4 calls — rows g, g + 8 × tiles 2np, 2np + 1 — and each
// lane makes one: lane t the call of row half t & 1 and tile 2np + (t >> 1). It turns the call's
// 8 values into 8 keep bits, the quad gathers the four bytes into one word (2 shuffles), and every
// lane picks the bits of its columns. Dropped entries become 0; the caller has already summed the
// undropped P into l_i (the LSE is that of the undropped scores) and scales O_i by 1 / (1 − p)
// at the end.
template <int kSlabs, int kNTilesS>
__device__ __forceinline__ void dropout_mma(float (&acc_s)[kSlabs][kNTilesS][4], const DropoutRng& rng, int row0,
                                            int n0, int lane) {
  static_assert(kNTilesS % 2 == 0, "dropout_mma pairs the n8 tiles of Bc");
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
    for (int np = 0; np < kNTilesS / 2; ++np) {
      const int row = row0 + 16 * sl + g + 8 * (t & 1);
      const Philox4 r = rng.row8(row, (n0 >> 3) + 2 * np + (t >> 1));
      uint32_t byte = 0;
#pragma unroll
      for (int c = 0; c < 8; ++c) byte |= static_cast<uint32_t>(rng.keep(r, c)) << c;
      uint32_t bits = byte << (8 * t);  // byte c of the quad's word: the call of lane c
      bits |= __shfl_xor_sync(0xffffffffu, bits, 1);
      bits |= __shfl_xor_sync(0xffffffffu, bits, 2);
      const uint32_t mine = bits >> (2 * t);  // bit 8c + h: column 2t + h of lane c's call
#pragma unroll
      for (int c = 0; c < 4; ++c)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float& p = acc_s[sl][2 * np + (c >> 1)][2 * (c & 1) + h];
          p = ((mine >> (8 * c + h)) & 1u) ? p : 0.0f;
        }
    }
}

// Element type of the forward kernel's output argument: T (out), or float for the split-KV
// workspace O_s.
template <typename T, bool Is_split> struct SplitOutput { using type = T; };
template <typename T> struct SplitOutput<T, true> { using type = float; };

}  // namespace flash
