// flash_fwd_sm90_softmax.cuh — the Hopper forwards' key-tile walk and online softmax on wgmma accumulator
// fragments (m64nN: acc[4j + e] is S[row0 + 8(e >> 1)][n0 + 8j + 2t + (e & 1)] of the thread's rows row0 and
// row0 + 8), shared by the 16-bit wgmma forward (flash_fwd_sm90.cu) and the tf32 one (flash_fwd_sm90_tf32.cu):
// Sm90KeyTiles, softmax_tile_sm90 / softmax_sm90, dropout_sm90, rescale_o_sm90, finish_rows_sm90.
#pragma once
#include "fa_port.cuh"
#include "flash_mask.cuh"
#include "flash_softmax.cuh"
#include "flash_fwd_tiles.cuh"
#include "flash_ext.cuh"

namespace flash {

// The key tiles one query tile visits, from the last visible one down (FlashAttention-2's order: the tiles
// needing the element mask first). Dense (kExt = 0): n_block_max − 1 .. 0, masked at or above
// n_block_unmasked. Extensions: KeyTileWalk's (window band from lo, block-mask tiles all False skipped,
// masked(n) per tile: window edges and mixed blocks too).
template <bool Is_causal, int kExt>
struct Sm90KeyTiles {
  KeyTileWalk<Is_causal, kExt, float> walk;
  int n_block_max, n_block_unmasked;

  __device__ __forceinline__ Sm90KeyTiles(const Mask<Is_causal, kExt>& mask, int m0, int Br, int Bc, int n_max,
                                          int n_unmasked)
      : walk{mask, m0, Br, Bc, kExt == 0 ? 0 : mask.n_block_min(m0, Bc)}, n_block_max(n_max),
        n_block_unmasked(n_unmasked) {}
  __device__ __forceinline__ int lo() const { return kExt == 0 ? 0 : walk.lo; }
  __device__ __forceinline__ int prev(int n) const { return kExt == 0 ? n - 1 : walk.prev(n); }
  __device__ __forceinline__ int first() const { return prev(n_block_max); }
  __device__ __forceinline__ bool any() const { return kExt == 0 ? n_block_max > 0 : first() >= lo(); }
  // Whether a tile follows tile n in the walk.
  __device__ __forceinline__ bool more(int n) const { return kExt == 0 ? n > 0 : prev(n) >= lo(); }
  __device__ __forceinline__ bool masked(int n) const { return kExt == 0 ? n >= n_block_unmasked : walk.masked(n); }

  // Calls f(n, next, masked) for each tile n of the walk in order (next: the tile after it, below lo() when none).
  // With the block mask each tile's cover is read once (prev / more / masked would read it up to three times:
  // every consumer thread reads the mask's bytes of a tile's blocks per call).
  template <class F>
  __device__ __forceinline__ void for_each(F f) const {
    if constexpr (!HasExt<kExt, kExtBlockMask>::value) {
      for (int n = first(); n >= lo(); n = prev(n)) f(n, prev(n), masked(n));
    } else {
      BlockCover cover;
      for (int n = prev_cover(n_block_max, cover); n >= lo();) {
        BlockCover next_cover;
        const int next = prev_cover(n, next_cover);
        f(n, next, cover == kCoverSome || walk.mask.needs_mask(walk.m0, n * walk.Bc, walk.Br, walk.Bc));
        n = next;
        cover = next_cover;
      }
    }
  }

 private:
  // KeyTileWalk::prev with the found tile's block cover.
  __device__ __forceinline__ int prev_cover(int n, BlockCover& cover) const {
    for (--n; n >= lo(); --n) {
      cover = walk.mask.block_cover(walk.m0, n * walk.Bc, walk.Br, walk.Bc);
      if (cover != kCoverNone) break;
    }
    return n;
  }
};


// OnlineSoftmaxRow::update_max (the same values, bit for bit) with the exp2 taken unconditionally and
// the "both −inf" case a select: update_max's `m_new == −inf ? 1 : exp2(..)` compiles to a branch around
// the exp2, which would split the overlapped loop's softmax into basic blocks.
__device__ __forceinline__ float update_max_select(OnlineSoftmaxRow<float>& stat, float tile_max) {
  const float m_new = fmaxf(stat.m, tile_max);
  const bool none = m_new == -INFINITY;   // the row has seen nothing visible yet: factor 1, no NaN
  const float e = exp2f(none ? 0.0f : stat.m - m_new);
  const float correction = none ? 1.0f : e;
  stat.m = m_new;
  stat.l *= correction;
  return correction;
}

// Mask (masked tiles only) and online softmax of one key tile on the thread's rows row0 (r = 0) and
// row0 + 8 (r = 1): acc_s[4j + e] is S[row0 + 8(e >> 1)][n0 + 8j + 2t + (e & 1)]. Leaves P =
// exp2(S·scale·log2e − m) in acc_s (l rescaled and summed per lane; the quad is reduced at the end) and
// each row's factor for O in correction[r]. kDeferO: O is not touched (the overlapped ws loop rescales it
// once the P V wgmmas reading it have completed: rescale_o_sm90); else each row of O is rescaled here.
//
// Extensions (kExt, deduced from the mask; flash_mask.cuh): softcap / ALiBi transform every score of every
// tile first; masked tiles then test the geometry per element and the block mask once per n8 tile (its 16
// rows x 8 columns lie in one block: block sizes are multiples of 16; the warp's 16 rows start at row0
// rounded down to 16, as m0 and the warp's row offset are multiples of 16 and g < 8).
template <bool Is_causal, int kBlockN, int kHeadDimV, bool kDeferO, int kExt = 0>
__device__ __forceinline__ void softmax_tile_sm90(float (&acc_s)[kBlockN / 2], float (&acc_o)[kHeadDimV / 2],
                                                  OnlineSoftmaxRow<float> (&stat)[2], float (&correction)[2],
                                                  const Mask<Is_causal, kExt>& mask, bool masked, int row0, int n0,
                                                  int t, float scale_log2) {
  auto row_of = [&](int i) { return row0 + 8 * ((i % 4) >> 1); };
  auto col_of = [&](int i) { return n0 + 8 * (i / 4) + 2 * t + (i & 1); };
  if constexpr (Mask<Is_causal, kExt>::kScoreMod) {
#pragma unroll
    for (int i = 0; i < kBlockN / 2; ++i) acc_s[i] = mask.score(acc_s[i], row_of(i), col_of(i));
  }
  if (masked) {
    if constexpr (Mask<Is_causal, kExt>::kBlockMask) {
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
        const bool block = mask.block_visible(row0 & ~15, n0 + 16 * (j / 2));
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = 4 * j + e;
          acc_s[i] = block && mask.is_visible_geometry(row_of(i), col_of(i)) ? acc_s[i] : -INFINITY;
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < kBlockN / 2; ++i) acc_s[i] = mask.apply(acc_s[i], row_of(i), col_of(i));
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float tile_max = acc_s[2 * r];
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j)
      tile_max = fmaxf(tile_max, fmaxf(acc_s[4 * j + 2 * r], acc_s[4 * j + 2 * r + 1]));
    tile_max = group_allreduce_max<4>(tile_max);
    if constexpr (kDeferO) {
      correction[r] = update_max_select(stat[r], tile_max * scale_log2);
    } else {
      correction[r] = stat[r].update_max(tile_max * scale_log2);
#pragma unroll
      for (int j = 0; j < kHeadDimV / 8; ++j) {
        acc_o[4 * j + 2 * r] *= correction[r];
        acc_o[4 * j + 2 * r + 1] *= correction[r];
      }
    }
    const float m_sub = stat[r].max_for_exp();
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
      for (int e = 2 * r; e < 2 * r + 2; ++e) {
        const float p = OnlineSoftmaxRow<float>::prob_unscaled(acc_s[4 * j + e], scale_log2, m_sub);
        stat[r].l += p;
        acc_s[4 * j + e] = p;
      }
  }
}

// The softmax of one key tile with O rescaled at once (the loops that wait for every wgmma batch).
template <bool Is_causal, int kBlockN, int kHeadDimV, int kExt = 0>
__device__ __forceinline__ void softmax_sm90(float (&acc_s)[kBlockN / 2], float (&acc_o)[kHeadDimV / 2],
                                             OnlineSoftmaxRow<float> (&stat)[2], const Mask<Is_causal, kExt>& mask,
                                             bool masked, int row0, int n0, int t, float scale_log2) {
  float correction[2];
  softmax_tile_sm90<Is_causal, kBlockN, kHeadDimV, false>(acc_s, acc_o, stat, correction, mask, masked, row0, n0, t,
                                                          scale_log2);
}

// Dropout (kExtDropout) on P_ij in acc_s, after the softmax has summed the undropped P into l: the
// accumulator of the warp's 16 rows (from row0 rounded down to 16) is the mma.sync layout of one slab, so
// the forward's dropout_mma applies as it is (the same keep bits as every other kernel: one Philox call per
// row and 8 columns). Nothing without the bit.
template <int kExt, int kBlockN>
__device__ __forceinline__ void dropout_sm90(float (&acc_s)[kBlockN / 2], const DropoutRng& rng, int row0, int n0,
                                             int lane) {
  if constexpr (HasExt<kExt, kExtDropout>::value)
    dropout_mma<1, kBlockN / 8>(reinterpret_cast<float (&)[1][kBlockN / 8][4]>(acc_s), rng, row0 & ~15, n0, lane);
  (void)acc_s; (void)rng; (void)row0; (void)n0; (void)lane;
}

// O_i rows row0 (r = 0) and row0 + 8 (r = 1) times correction[r] (after softmax_tile_sm90<..., true>),
// skipped when no row of the warp got a new max (every factor exactly 1: no bit changes).
template <int kHeadDimV>
__device__ __forceinline__ void rescale_o_sm90(float (&acc_o)[kHeadDimV / 2], const float (&correction)[2]) {
  if (!__any_sync(0xffffffffu, correction[0] != 1.0f || correction[1] != 1.0f)) return;
#pragma unroll
  for (int j = 0; j < kHeadDimV / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_o[4 * j + e] *= correction[e >> 1];
}

// The epilogue's per-row values of the thread's rows g (r = 0) and g + 8 (r = 1): 1/l (O's factor) and the
// natural-log LSE, after the sum of l over the quad (every lane of the quad gets both).
__device__ __forceinline__ void finish_rows_sm90(float (&inv_l)[2], float (&lse)[2], const OnlineSoftmaxRow<float> (&stat)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l_total = group_allreduce_sum<4>(stat[r].l);
    inv_l[r] = stat[r].inv_sum(l_total);
    lse[r] = stat[r].lse(l_total);
  }
}

// The same with the extensions of kExt: rows row0 + 8r at or past the entry's length Lq_b (seqlens) are
// out 0 and lse −inf, and dropout's 1 / (1 − p) joins 1/l (ext_inv_sum). The dense one for kExt = 0.
template <int kExt>
__device__ __forceinline__ void finish_rows_sm90(float (&inv_l)[2], float (&lse)[2], const OnlineSoftmaxRow<float> (&stat)[2],
                                                 const ExtArgs<float>& ext, int row0, int Lq_b) {
  if constexpr (kExt == 0) {
    (void)ext; (void)row0; (void)Lq_b;
    finish_rows_sm90(inv_l, lse, stat);
  } else {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float l_total = group_allreduce_sum<4>(stat[r].l);
      const bool live = row0 + 8 * r < Lq_b;
      inv_l[r] = ext_inv_sum<kExt>(stat[r], l_total, live, ext);
      lse[r] = live ? stat[r].lse(l_total) : -INFINITY;
    }
  }
}


}  // namespace flash
