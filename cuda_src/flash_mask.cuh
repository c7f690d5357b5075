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
//   n_block_min   — (window) key tiles before it are invisible to every row: never loaded;
//   m_block_min / m_block_max — the query tiles that see any column of a key tile (backward);
//   needs_mask    — whether any score of the (query tile, key tile) pair is invisible by the
//                   causal / window / length geometry; only those tiles pay for the
//                   per-element test below;
//   block_cover   — (block mask) whether the tile's blocks are all False (never loaded), all
//                   True, or mixed (element mask).
// Element-level: `score(s, row, col)` (softcap, ALiBi) and `apply(s, row, col)` (s or -inf).
//
// The extensions (docs/extensions.md, flash_ext.cuh) are template bits of the struct
// (Mask<Is_causal, kExt, AccT>): the lengths Lq, Lk are the entry's (seqlens), windows narrow the
// band, the block mask and ALiBi / softcap are per-entry members read once per block. With
// kExt = 0 (every dense kernel) none of it exists. Scores are UNSCALED (q·k): softcap and slope
// arrive divided by the softmax scale, so kernels keep folding the scale into their exp2.
#pragma once
#include "fa_port.cuh"
#include "flash_block_info.cuh"
#include "flash_ext.cuh"

namespace flash {

// Tile classes of the block mask.
enum BlockCover : int { kCoverNone = 0, kCoverSome = 1, kCoverAll = 2 };

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }

// x / d for a divisor fixed at run time (the block mask's block sizes, d >= 2) as a multiply-high (fa::umulhi) and a shift
// (Granlund & Montgomery, rounding the multiplier up): s = ceil(log2 d), m = ceil(2^(31+s) / d) < 2^32, and for
// 0 <= x < 2^31, x / d = ((x m) >> 32) >> (s − 1). Exact: m d − 2^(31+s) = e < d <= 2^s, so x m / 2^(31+s) =
// x / d + x e / (d 2^(31+s)) exceeds x / d by less than 1/d. The compiler's signed division by a run-time int is
// ~20 instructions (I2F, MUFU.RCP, F2I and fix-ups); this is two. Negative x are not allowed (the emulator's
// checked memory catches the lookup such an x would make).
struct FastDiv {
  uint32_t m;
  int s1;  // s − 1
  FastDiv() = default;
  __device__ __forceinline__ explicit FastDiv(int d) {
    int s = 1;
    while ((1u << s) < static_cast<unsigned>(d)) ++s;
    m = static_cast<uint32_t>(((1ull << (31 + s)) + static_cast<unsigned>(d) - 1) / static_cast<unsigned>(d));
    s1 = s - 1;
  }
  __device__ __forceinline__ int operator()(int x) const {
    return static_cast<int>(fa::umulhi(static_cast<uint32_t>(x), m) >> s1);
  }
};

template <bool Is_causal, int kExt = 0, typename AccT = float>
struct Mask {
  static constexpr bool kWindow = HasExt<kExt, kExtWindow>::value;
  static constexpr bool kAlibi = HasExt<kExt, kExtAlibi>::value;
  static constexpr bool kSoftcap = HasExt<kExt, kExtSoftcap>::value;
  static constexpr bool kBlockMask = HasExt<kExt, kExtBlockMask>::value;
  static constexpr bool kSeqlens = HasExt<kExt, kExtSeqlens>::value;
  // Scores change before the mask (softcap, ALiBi): every tile pays for score().
  static constexpr bool kScoreMod = kAlibi || kSoftcap;

  int Lq;             // number of query rows (the entry's, with seqlens)
  int Lk;             // number of key columns (the entry's, with seqlens)
  int causal_offset;  // Lk - Lq: row i sees columns j <= i + causal_offset
  // Extensions (unused members cost nothing: the kernels hold a Mask in registers).
  int window_left, window_right;  // −1: unbounded
  AccT softcap, inv_softcap;      // unscaled units
  AccT slope;                     // ALiBi slope, unscaled units
  const bool* bm;                 // the entry's block mask
  long long bm_row, bm_col;
  FastDiv div_q, div_k;           // by the block sizes block_q, block_k

  __device__ __forceinline__ Mask(int Lq_, int Lk_) : Lq(Lq_), Lk(Lk_), causal_offset(Lk_ - Lq_) {}

  // With the extensions of kExt: Lq_, Lk_ are the entry's lengths (ExtArgs::seqlen_q/_k).
  __device__ __forceinline__ Mask(int Lq_, int Lk_, const ExtArgs<AccT>& a, const BatchIndex& b)
      : Lq(Lq_), Lk(Lk_), causal_offset(Lk_ - Lq_) {
    if constexpr (kWindow) {
      window_left = a.window_left;
      window_right = a.window_right;
    }
    if constexpr (kSoftcap) {
      softcap = a.softcap;
      inv_softcap = AccT(1) / a.softcap;
    }
    if constexpr (kAlibi) slope = a.alibi_slope(b);
    if constexpr (kBlockMask) {
      bm = a.block_mask_of(b);
      bm_row = a.bm_s.row;
      bm_col = a.bm_col;
      div_q = FastDiv(a.block_q);
      div_k = FastDiv(a.block_k);
    }
  }

  // Number of key columns [0, n) visible to query row `row` (may be <= 0 for causal rows
  // above the diagonal when Lq > Lk).
  __device__ __forceinline__ int visible_keys(int row) const {
    if (!Is_causal && !kWindow) return Lk;
    if constexpr (!kWindow) {
      const int n = row + causal_offset + 1;
      return n < Lk ? n : Lk;
    } else {
      int n = Lk;
      if (Is_causal) n = imin(n, row + causal_offset + 1);
      if (window_right >= 0) n = imin(n, row + causal_offset + window_right + 1);
      return n;
    }
  }

  // First key column visible to query row `row` (window left edge), else 0.
  __device__ __forceinline__ int first_key(int row) const {
    if constexpr (kWindow)
      if (window_left >= 0) return imax(0, row + causal_offset - window_left);
    (void)row;
    return 0;
  }

  // One past the last key tile (of width Bc) that any of the query rows [m0, m0 + Br) sees.
  // Returns 0 when no row of the tile sees any key.
  __device__ __forceinline__ int n_block_max(int m0, int Br, int Bc) const {
    if constexpr (kSeqlens)
      if (m0 >= Lq) return 0;  // every row of the tile is past the entry's length
    const int last_row = (m0 + Br < Lq ? m0 + Br : Lq) - 1;
    const int n = visible_keys(last_row);
    return n <= 0 ? 0 : ceil_div(n, Bc);
  }

  // The first key tile any row of [m0, ...) sees (window left edge of row m0), else 0.
  __device__ __forceinline__ int n_block_min(int m0, int Bc) const { return first_key(m0) / Bc; }

  // First query tile (of height Br) in which some row sees a column of the key tile [n0, n0+Bc):
  // row i sees column n0 iff i >= n0 - causal_offset (causal), i >= n0 - causal_offset - right
  // (window).
  __device__ __forceinline__ int m_block_min(int n0, int Br) const {
    if (!Is_causal && !kWindow) return 0;
    int first_row = Is_causal ? n0 - causal_offset : 0;
    if constexpr (kWindow)
      if (window_right >= 0) first_row = imax(first_row, n0 - causal_offset - window_right);
    return first_row <= 0 ? 0 : first_row / Br;
  }

  // One past the last query tile in which some row sees a column of the key tile [n0, n_end):
  // row i sees column n_end − 1 only if i <= n_end − 1 − causal_offset + left (window).
  __device__ __forceinline__ int m_block_max(int n_end, int Br) const {
    int rows = Lq;
    if constexpr (kWindow)
      if (window_left >= 0) rows = imin(rows, n_end - causal_offset + window_left);
    return rows <= 0 ? 0 : ceil_div(rows, Br);
  }

  // Whether some score of query rows [m0, m0+Br) × key columns [n0, n0+Bc) is invisible by the
  // geometry (sequence end, causal, window). Rows past Lq are not checked: they are never stored.
  __device__ __forceinline__ bool needs_mask(int m0, int n0, int Br, int Bc) const {
    const int n_end = n0 + Bc;  // one past the last column of the tile
    if (n_end > Lk) return true;                                 // sequence end
    if (Is_causal && n_end - 1 > m0 + causal_offset) return true;  // crosses the diagonal
    if constexpr (kWindow) {
      const int last_row = (m0 + Br < Lq ? m0 + Br : Lq) - 1;
      if (window_right >= 0 && n_end - 1 > m0 + causal_offset + window_right) return true;
      if (window_left >= 0 && n0 < last_row + causal_offset - window_left) return true;
    }
    (void)Br;
    return false;
  }

  // Block mask: whether the blocks under rows [m0, m0+Br) ∩ [0, Lq) × columns [n0, n0+Bc) ∩
  // [0, Lk) are all False (the tile is never loaded), mixed, or all True. Every thread reads the
  // same few bytes (a broadcast, cached).
  __device__ __forceinline__ BlockCover block_cover(int m0, int n0, int Br, int Bc) const {
    if constexpr (kBlockMask) {
      const int r_last = imin(m0 + Br, Lq) - 1, c_last = imin(n0 + Bc, Lk) - 1;
      if (r_last < m0 || c_last < n0) return kCoverNone;
      bool any = false, all = true;
      for (int qb = div_q(m0); qb <= div_q(r_last); ++qb)
        for (int kb = div_k(n0); kb <= div_k(c_last); ++kb) {
          const bool x = fa::gload(bm + qb * bm_row + kb * bm_col);
          any = any || x;
          all = all && x;
        }
      return !any ? kCoverNone : (all ? kCoverAll : kCoverSome);
    }
    (void)m0; (void)n0; (void)Br; (void)Bc;
    return kCoverAll;
  }

  // Block mask: whether any block under the tile (block_cover's ranges) is True — block_cover(...) != kCoverNone,
  // stopping at the first True (the backward's walks and ordered-dQ turns need no more).
  __device__ __forceinline__ bool block_any(int m0, int n0, int Br, int Bc) const {
    if constexpr (kBlockMask) {
      const int r_last = imin(m0 + Br, Lq) - 1, c_last = imin(n0 + Bc, Lk) - 1;
      if (r_last < m0 || c_last < n0) return false;
      for (int qb = div_q(m0); qb <= div_q(r_last); ++qb)
        for (int kb = div_k(n0); kb <= div_k(c_last); ++kb)
          if (fa::gload(bm + qb * bm_row + kb * bm_col)) return true;
      return false;
    }
    (void)m0; (void)n0; (void)Br; (void)Bc;
    return true;
  }

  __device__ __forceinline__ bool is_visible(int row, int col) const {
    bool ok = is_visible_geometry(row, col);
    if constexpr (kBlockMask) ok = ok && block_visible(row, col);
    return ok;
  }

  // Visibility by the sequence end, causal diagonal and window (everything but the block mask).
  __device__ __forceinline__ bool is_visible_geometry(int row, int col) const {
    bool ok = col < Lk && (!Is_causal || col <= row + causal_offset);
    if constexpr (kWindow) {
      if (window_left >= 0) ok = ok && col >= row + causal_offset - window_left;
      if (window_right >= 0) ok = ok && col <= row + causal_offset + window_right;
    }
    return ok;
  }

  // The block-mask entry of (row, col) (true without kExtBlockMask). Kernels whose fragments lie
  // inside one block (16 rows from a multiple of 16, 8 columns from a multiple of 8: block sizes
  // are multiples of 16) look it up once per fragment, and n8 tiles 2p, 2p + 1 (16 rows or columns
  // from a multiple of 16) once per pair: they pass the pair's first row / column, 16 (nt / 2), so
  // the two lookups are one expression (the compiler cannot see that div_k(c + 8) == div_k(c)). Rows
  // past Lq and columns past Lk are outside the mask (the load reads the clamped entry: no branch per
  // lookup; the last row / column of an empty entry: row 0, always in the array). (A pair's second tile past them
  // takes the first's entry: the geometry hides columns past Lk, and rows past Lq are never stored,
  // their Q_i, dO_i, L_i zero in the backward: nothing reaches dK, dV, dQ, as without a block mask.)
  __device__ __forceinline__ bool block_visible(int row, int col) const {
    if constexpr (kBlockMask) {
      const int r = imax(imin(row, Lq - 1), 0), c = imax(imin(col, Lk - 1), 0);
      const bool v = fa::gload(bm + div_q(r) * bm_row + div_k(c) * bm_col);
      return (row < Lq) & (col < Lk) & v;
    }
    (void)row; (void)col;
    return true;
  }
  // block_visible with the load behind the bounds test (a branch per lookup instead of the clamps): the grid-layout
  // dK/dV kernel's, at the 255-register cap, where the clamped form spilled in more extension sets (docs/performance.md,
  // forty-eighth session).
  __device__ __forceinline__ bool block_visible_guarded(int row, int col) const {
    if constexpr (kBlockMask) return row < Lq && col < Lk && fa::gload(bm + div_q(row) * bm_row + div_k(col) * bm_col);
    (void)row; (void)col;
    return true;
  }

  // The score if (row, col) is visible, else -inf (exp2(-inf) = 0 removes it from the softmax).
  template <typename T>
  __device__ __forceinline__ T apply(T s, int row, int col) const {
    return is_visible(row, col) ? s : -static_cast<T>(INFINITY);
  }

  // softcap·tanh(s / softcap) on an unscaled score (identity without kExtSoftcap), with a tanh
  // accurate to a few fp32 ulp in every kernel: --use_fast_math turns tanhf into MUFU.TANH, whose
  // ~2^-11 relative error is hidden by an fp16 out but not by the fp32 lse (measured on an H200: the
  // fp16 kernels' lse 6.2e-6 off with a bound of 3.4e-6; the emulator's host tanhf had hidden it).
  __device__ __forceinline__ AccT cap(AccT s) const {
    if constexpr (kSoftcap) return softcap * tanh_acc(s * inv_softcap);
    return s;
  }
  // s − slope·|row + off − col| (identity without kExtAlibi).
  __device__ __forceinline__ AccT alibi(AccT s, int row, int col) const {
    if constexpr (kAlibi) {
      const int dist = row + causal_offset - col;
      return s - slope * static_cast<AccT>(dist < 0 ? -dist : dist);
    }
    (void)row; (void)col;
    return s;
  }
  // The score of docs/extensions.md in unscaled units: softcap first, then ALiBi.
  __device__ __forceinline__ AccT score(AccT s, int row, int col) const {
    return alibi(cap(s), row, col);
  }

 private:
  // tanh to ~2 fp32 ulp with few registers: |x| < 0.55 the Taylor series to x^15 (the next term is
  // below an ulp there), else 1 − 2 / (e^{2|x|} + 1) with the sign of x (>= 0.5: no cancellation;
  // |x| capped at 10, where tanh rounds to 1). 1.7 ulp at most against float64 on a 2.2·10^6-point
  // sweep with an exact exp2 (tests/test_softcap_tanh.py); MUFU.EX2's error adds under an ulp.
  // (expm1f's e / (e + 2) was as accurate but spilled the d 256 forward with every extension.)
  __device__ __forceinline__ static float tanh_acc(float x) {
    const float ax = fabsf(x), x2 = x * x;
    float p = -929569.0f / 638512875.0f;
    p = fmaf(p, x2, 21844.0f / 6081075.0f);
    p = fmaf(p, x2, -1382.0f / 155925.0f);
    p = fmaf(p, x2, 62.0f / 2835.0f);
    p = fmaf(p, x2, -17.0f / 315.0f);
    p = fmaf(p, x2, 2.0f / 15.0f);
    p = fmaf(p, x2, -1.0f / 3.0f);
    p = fmaf(p, x2, 1.0f);
    const float e = exp2f(2.8853900817779268f * fminf(ax, 10.0f));  // e^{2|x|}
    return ax < 0.55f ? p * x : copysignf(1.0f - 2.0f / (e + 1.0f), x);
  }
  __device__ __forceinline__ static double tanh_acc(double x) { return tanh(x); }
};

// The Mask of a kernel with extensions kExt: the dense Mask(Lq, Lk) for kExt = 0, else with the
// block's per-entry state from the extension arguments.
template <bool Is_causal, int kExt, typename AccT>
__device__ __forceinline__ Mask<Is_causal, kExt, AccT> make_mask(int Lq, int Lk, const ExtArgs<AccT>& a,
                                                                 const BatchIndex& b) {
  if constexpr (kExt == 0) {
    (void)a; (void)b;
    return Mask<Is_causal, kExt, AccT>(Lq, Lk);
  } else {
    return Mask<Is_causal, kExt, AccT>(Lq, Lk, a, b);
  }
}

}  // namespace flash
