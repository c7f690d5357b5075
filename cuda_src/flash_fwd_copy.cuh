// flash_fwd_copy.cuh — global → shared tile loads used by the forward kernels.
//
// A tile is kRows × kCols elements of T (kCols = the padded head dim) copied into shared memory
// with row stride kStride. Rows at or past rows_valid and columns at or past cols_valid (the true
// head dim) are zero-filled, so padded head-dim columns contribute 0 to every dot product and
// rows past the sequence end hold zeros (never NaN garbage that 0·x would propagate).
//
// Two paths, chosen on the host per launch (template flag Is_aligned):
//   * aligned: every row start is 16-byte aligned → cp.async of 16-byte chunks with
//     src_bytes < 16 (down to 0) for the chunk that crosses cols_valid and for missing rows.
//     The copy is asynchronous: the caller commits and waits (cp_async_commit / cp_async_wait)
//     and then needs a __syncthreads() before other threads read the tile.
//   * unaligned (e.g. D = 59 packed contiguously): element-wise fa::gload; synchronous, but the
//     same barriers make it visible.
// Either way each existing element is read from global memory exactly once per tile load, which
// the emulator's byte counters confirm.
#pragma once
#include "fa_port.cuh"
#include "flash_kernel_traits.cuh"

namespace flash {

template <typename T, int kRows, int kCols, int kStride, int kNThreads, bool Is_aligned>
__device__ __forceinline__ void load_tile(T* smem, const T* gmem, long long row_stride,
                                          int rows_valid, int cols_valid, int tid) {
  if constexpr (Is_aligned) {
    constexpr int kElemsPerCopy = kCopyBytes / sizeof(T);
    static_assert(kCols % kElemsPerCopy == 0, "tile width must be whole 16-byte chunks");
    constexpr int kChunksPerRow = kCols / kElemsPerCopy;
    constexpr int kChunks = kRows * kChunksPerRow;
    for (int idx = tid; idx < kChunks; idx += kNThreads) {
      const int r = idx / kChunksPerRow;
      const int c = (idx % kChunksPerRow) * kElemsPerCopy;
      int elems = cols_valid - c;
      elems = elems < 0 ? 0 : (elems > kElemsPerCopy ? kElemsPerCopy : elems);
      if (r >= rows_valid) elems = 0;
      // A chunk with nothing to read still gets a valid source address (row 0 of the tile,
      // which always exists); with src_bytes = 0 it is not read.
      const T* src = elems > 0 ? gmem + r * row_stride + c : gmem;
      fa::cp_async<kCopyBytes>(smem + r * kStride + c, src, elems * static_cast<int>(sizeof(T)));
    }
  } else {
    constexpr int kElems = kRows * kCols;
    for (int idx = tid; idx < kElems; idx += kNThreads) {
      const int r = idx / kCols;
      const int c = idx % kCols;
      smem[r * kStride + c] = (r < rows_valid && c < cols_valid) ? fa::gload(gmem + r * row_stride + c)
                                                                 : zero_value<T>();
    }
  }
}

}  // namespace flash
