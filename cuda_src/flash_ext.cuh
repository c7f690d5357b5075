// flash_ext.cuh — the extensions of docs/extensions.md as the kernels see them.
//
// Compile time: one `int kExt` template parameter per kernel, a set of the bits below (appended
// last to the template parameters, default 0: a kernel without a feature carries none of its
// instructions, and the dense instantiations keep their names and code).
//
// Run time: one trailing block of arguments, FLASH_EXT_PARAMS(AccT) (the same in every kernel that
// takes it; a dense launch passes zeros and never-read one-element arrays), gathered in the kernel
// body by FLASH_EXT_ARGS(AccT) into an ExtArgs<AccT>. Per-entry data is reached through batch
// strides walked by the host like every tensor's (flash_block_info.cuh):
//   seqlens  Lq_b = seqlens_q[e], Lk_b = seqlens_k[e], e = b0·e_b0 + b1·e_b1 + b2·e_b2 (the entry
//            along the first batch dim; the host passes an array of Lq / Lk for a missing one);
//   window   (left, right), −1 = unbounded;
//   softcap  softcap / scale: the kernels transform the UNSCALED score q·k (see Mask::score);
//   alibi    slope of the entry = alibi[b·alibi_s] · alibi_scale (alibi_scale = 1 / scale: the
//            bias in unscaled units, FlashAttention-2's trick);
//   block    block_mask[b·bm_s + (i / block_q)·bm_row + (j / block_k)·bm_col] (bool);
//   dropout  Philox key (seed_lo, seed_hi), offset, threshold (flash_philox.cuh), bh = bh_base +
//            b·bh_s (the flat C-order index of the entry), dropout_scale = 1 / (1 − p).
// The per-block state built from these lives in Mask<Is_causal, kExt, AccT> (flash_mask.cuh:
// lengths, window, block mask, softcap, ALiBi) and DropoutRng (flash_philox.cuh); the forward's
// helpers to walk key tiles and to drop P in the mma layout are in flash_fwd_tiles.cuh.
#pragma once
#include "fa_port.cuh"
#include "flash_block_info.cuh"
#include "flash_philox.cuh"

namespace flash {

// The feature bits of kExt (flasharray/_private/cuda_forward.py EXT_BITS mirrors them).
constexpr int kExtWindow = 1;     // sliding window (left, right)
constexpr int kExtAlibi = 2;      // ALiBi bias −slope·|i + off − j|
constexpr int kExtSoftcap = 4;    // softcap·tanh(s / softcap)
constexpr int kExtBlockMask = 8;  // block-sparse mask (tiles whose blocks are all False skipped)
constexpr int kExtDropout = 16;   // dropout on P (Philox4x32-10)
constexpr int kExtSeqlens = 32;   // per-entry lengths seqlens_q / seqlens_k (first batch dim)

template <int kExt, int kBit> struct HasExt { static constexpr bool value = (kExt & kBit) != 0; };
// How many extensions kExt enables.
__host__ __device__ constexpr int ext_count(int ext) { return ext == 0 ? 0 : (ext & 1) + ext_count(ext >> 1); }

// The argument tail of every kernel taking kExt, in this order.
#define FLASH_EXT_PARAMS(AccT)                                                                        \
  const int* __restrict__ ext_seqlens_q, const int* __restrict__ ext_seqlens_k,                      \
      long long ext_e_b0, long long ext_e_b1, long long ext_e_b2,                                     \
      int ext_window_left, int ext_window_right, AccT ext_softcap,                                    \
      const AccT* __restrict__ ext_alibi, long long ext_alibi_b0, long long ext_alibi_b1,             \
      long long ext_alibi_b2, AccT ext_alibi_scale,                                                   \
      const bool* __restrict__ ext_block_mask, long long ext_bm_b0, long long ext_bm_b1,              \
      long long ext_bm_b2, long long ext_bm_row, long long ext_bm_col, int ext_block_q,               \
      int ext_block_k, unsigned int ext_seed_lo, unsigned int ext_seed_hi, unsigned int ext_offset,   \
      unsigned int ext_threshold, AccT ext_dropout_scale, long long ext_bh_base, long long ext_bh_b0, \
      long long ext_bh_b1, long long ext_bh_b2

// The tail gathered into an ExtArgs<AccT> (in the body of a kernel declared with FLASH_EXT_PARAMS).
#define FLASH_EXT_ARGS(AccT)                                                                          \
  ExtArgs<AccT> {                                                                                     \
    ext_seqlens_q, ext_seqlens_k, TensorStrides{ext_e_b0, ext_e_b1, ext_e_b2, 0}, ext_window_left,    \
        ext_window_right, ext_softcap, ext_alibi, TensorStrides{ext_alibi_b0, ext_alibi_b1,           \
        ext_alibi_b2, 0}, ext_alibi_scale, ext_block_mask,                                            \
        TensorStrides{ext_bm_b0, ext_bm_b1, ext_bm_b2, ext_bm_row}, ext_bm_col, ext_block_q,          \
        ext_block_k, ext_seed_lo, ext_seed_hi, ext_offset, ext_threshold, ext_dropout_scale,          \
        ext_bh_base, TensorStrides{ext_bh_b0, ext_bh_b1, ext_bh_b2, 0}                                \
  }

template <typename AccT>
struct ExtArgs {
  const int* seqlens_q;
  const int* seqlens_k;
  TensorStrides entry;  // element strides of the entry index e (first batch dim)
  int window_left, window_right;
  AccT softcap;  // softcap / scale (unscaled units)
  const AccT* alibi;
  TensorStrides alibi_s;
  AccT alibi_scale;  // 1 / scale
  const bool* block_mask;
  TensorStrides bm_s;  // batch strides, row = stride between query blocks
  long long bm_col;    // stride between key blocks
  int block_q, block_k;
  uint32_t seed_lo, seed_hi, offset, threshold;
  AccT dropout_scale;  // 1 / (1 − p)
  long long bh_base;
  TensorStrides bh_s;

  // Lq_b / Lk_b of this block's entry (kExtSeqlens), else the launch's Lq / Lk.
  template <int kExt>
  __device__ __forceinline__ int seqlen_q(const BatchIndex& b, int Lq) const {
    if constexpr (HasExt<kExt, kExtSeqlens>::value) return fa::gload(seqlens_q + b.offset(entry));
    return Lq;
  }
  template <int kExt>
  __device__ __forceinline__ int seqlen_k(const BatchIndex& b, int Lk) const {
    if constexpr (HasExt<kExt, kExtSeqlens>::value) return fa::gload(seqlens_k + b.offset(entry));
    return Lk;
  }
  // The entry's ALiBi slope in unscaled score units.
  __device__ __forceinline__ AccT alibi_slope(const BatchIndex& b) const {
    return fa::gload(alibi + b.offset(alibi_s)) * alibi_scale;
  }
  // The entry's block mask, (ceil(Lq/Bq), ceil(Lk/Bk)) at strides (bm_s.row, bm_col).
  __device__ __forceinline__ const bool* block_mask_of(const BatchIndex& b) const {
    return block_mask + b.offset(bm_s);
  }
  // Dropout's generator for the entry (bh: its flat index in the output's batch shape).
  __device__ __forceinline__ DropoutRng dropout(const BatchIndex& b) const {
    return DropoutRng{seed_lo, seed_hi, static_cast<uint32_t>(bh_base + b.offset(bh_s)), offset, threshold};
  }
};

// Dropout's keep test of one element (row, col): one Philox call, the column's word picked by
// selects (DropoutRng::keep(r, col) indexes Philox4::x with a run-time index, which puts the words
// in local memory when col is not a compile-time constant).
__device__ __forceinline__ bool dropout_keep(const DropoutRng& rng, int row, int col) {
  const Philox4 r = rng.row8(row, col >> 3);
  const int w = (col & 7) >> 1;
  const uint32_t word = w == 0 ? r.x[0] : (w == 1 ? r.x[1] : (w == 2 ? r.x[2] : r.x[3]));
  return ((word >> (16 * (col & 1))) & 0xFFFFu) >= rng.threshold;
}

}  // namespace flash
