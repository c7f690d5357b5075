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
#include "flash_block_info.cuh"

namespace flash {

// Smallest power of two >= n (n >= 1).
__host__ __device__ constexpr int next_pow2(int n) { return n <= 1 ? 1 : 2 * next_pow2((n + 1) / 2); }

// A kRows x kCols tile into shared memory (row pitch kStride), global row r at row_ptr(r) (called
// only for r < rows_valid); fallback is an address that always exists. Rows at or past rows_valid
// and columns at or past cols_valid are zero-filled. Aligned: cp.async 16-byte chunks (a chunk with
// nothing to read still gets the valid fallback address and src_bytes = 0, so it is not read);
// otherwise element-wise.
template <typename T, int kRows, int kCols, int kStride, int kNThreads, bool Is_aligned, typename RowPtr>
__device__ __forceinline__ void load_tile_rows(T* smem, RowPtr row_ptr, const T* fallback, int rows_valid,
                                               int cols_valid, int tid) {
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
      const T* src = elems > 0 ? row_ptr(r) + c : fallback;
      fa::cp_async<kCopyBytes>(smem + r * kStride + c, src, elems * static_cast<int>(sizeof(T)));
    }
  } else {
    constexpr int kElems = kRows * kCols;
    for (int idx = tid; idx < kElems; idx += kNThreads) {
      const int r = idx / kCols;
      const int c = idx % kCols;
      smem[r * kStride + c] = (r < rows_valid && c < cols_valid) ? fa::gload(row_ptr(r) + c) : zero_value<T>();
    }
  }
}

// A tile of rows at a fixed row stride from gmem (row 0 of the tile always exists).
template <typename T, int kRows, int kCols, int kStride, int kNThreads, bool Is_aligned>
__device__ __forceinline__ void load_tile(T* smem, const T* gmem, long long row_stride,
                                          int rows_valid, int cols_valid, int tid) {
  load_tile_rows<T, kRows, kCols, kStride, kNThreads, Is_aligned>(
      smem, [&](int r) { return gmem + r * row_stride; }, gmem, rows_valid, cols_valid, tid);
}

// The epilogue's copy back: a kRows × kCols tile in shared memory (pitch kStride) to global rows
// [0, rows_valid) × columns [0, cols_valid) at row_stride. vec (block-uniform: cols_valid a whole
// number of 16-byte chunks and every row 16-byte aligned): consecutive threads store consecutive
// 16-byte chunks of a row, so a warp writes whole rows — full 32-byte sectors — and an 8-lane
// phase reads one row's consecutive chunks (conflict-free for rows of >= 8 chunks). Otherwise
// (odd head dims, unaligned strides) element by element, consecutive threads consecutive
// elements. The caller puts a barrier between staging the tile and this copy.
template <typename T, int kRows, int kCols, int kStride, int kNThreads>
__device__ __forceinline__ void store_tile(T* gmem, long long row_stride, const T* smem, int rows_valid,
                                           int cols_valid, bool vec, int tid) {
  if (vec) {
    constexpr int kElemsPerCopy = kCopyBytes / sizeof(T);
    static_assert(kCols % kElemsPerCopy == 0, "tile width must be whole 16-byte chunks");
    constexpr int kChunksPerRow = kCols / kElemsPerCopy;
    constexpr int kChunks = kRows * kChunksPerRow;
    constexpr int kIters = (kChunks + kNThreads - 1) / kNThreads;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int idx = tid + it * kNThreads;
      const int r = idx / kChunksPerRow, c = (idx % kChunksPerRow) * kElemsPerCopy;
      if ((kChunks % kNThreads == 0 || idx < kChunks) && r < rows_valid && c < cols_valid)
        fa::gstore(reinterpret_cast<uint4*>(gmem + r * row_stride + c),
                   *reinterpret_cast<const uint4*>(smem + r * kStride + c));
    }
  } else {
    for (int idx = tid; idx < kRows * kCols; idx += kNThreads) {
      const int r = idx / kCols, c = idx % kCols;
      if (r < rows_valid && c < cols_valid) fa::gstore(gmem + r * row_stride + c, smem[r * kStride + c]);
    }
  }
}

}  // namespace flash

namespace flash {

// K_j / V_j tiles of the tensor-core forward: the same copy as load_tile's aligned path, planned
// once per thread so that the key-tile loop holds only the cp.async instructions themselves.
//
// The threads form rows of kThreadsPerRow lanes (the chunks per row rounded up to a power of two,
// which divides kNThreads), so thread tid copies the SAME column chunk c = tid % kThreadsPerRow of
// rows r0 + p·kRowsPerPass (r0 = tid / kThreadsPerRow) in every pass p: the chunk's byte count
// (cut at the true head dim) is one loop-invariant register, the shared-memory destinations are
// compile-time offsets from one per-thread base, and the global sources are one per-thread
// pointer plus p·(kRowsPerPass rows). The passes are fully unrolled (compile-time trip count),
// so no loop with a run-time start appears in the key loop. When the chunks per row are not a
// power of two (d = 48, 80, 96, ...) the lanes past the row's last chunk copy nothing.
template <typename T, int kRows, int kCols, int kStride, int kNThreads>
struct TileCopy {
  static constexpr int kElemsPerCopy = kCopyBytes / sizeof(T);
  static_assert(kCols % kElemsPerCopy == 0, "tile width must be whole 16-byte chunks");
  static constexpr int kChunksPerRow = kCols / kElemsPerCopy;
  static constexpr int kThreadsPerRow = next_pow2(kChunksPerRow);
  static_assert(kNThreads % kThreadsPerRow == 0,
                "each thread must own one fixed column chunk: threads a multiple of the row's lanes");
  static constexpr int kRowsPerPass = kNThreads / kThreadsPerRow;
  static constexpr int kPasses = (kRows + kRowsPerPass - 1) / kRowsPerPass;
  // Small tiles (e.g. Bc = 16 at d = 16 with 256 threads) have fewer rows than a pass: then the
  // last (only) pass is predicated on the thread's row existing in the tile.
  static constexpr bool kEvenPasses = kRows % kRowsPerPass == 0;

  bool active;        // this lane has a chunk of the row (false past kChunksPerRow)
  int r0;             // first tile row this thread copies
  int smem_offset;    // element offset of (r0, c) in a shared-memory tile
  int bytes;          // bytes of the chunk that exist (head dim cut), 0..16
  long long src_offset;  // element offset of (r0, c) from a tile's row 0 in global memory (c = 0
                         // when nothing of the chunk exists, so the address stays valid)
  long long row_stride;  // global elements between rows

  __device__ __forceinline__ TileCopy(long long row_stride_, int cols_valid, int tid) : row_stride(row_stride_) {
    r0 = tid / kThreadsPerRow;
    active = tid % kThreadsPerRow < kChunksPerRow;
    const int c = (tid % kThreadsPerRow) * kElemsPerCopy;
    int elems = cols_valid - c;
    elems = elems < 0 ? 0 : (elems > kElemsPerCopy ? kElemsPerCopy : elems);
    bytes = elems * static_cast<int>(sizeof(T));
    smem_offset = r0 * kStride + c;
    src_offset = r0 * row_stride + (elems > 0 ? c : 0);
  }

  // Copies the tile whose row 0 is gmem_tile into smem_tile. full: every row exists (rows_valid
  // is ignored; a literal at every call, so the row test folds away); else rows at or past
  // rows_valid are zero-filled (src_bytes = 0, the source then being row 0 of the tile, which
  // always exists).
  __device__ __forceinline__ void load(bool full, T* smem_tile, const T* gmem_tile, int rows_valid) const {
    if (kChunksPerRow != kThreadsPerRow && !active) return;
    const T* src = gmem_tile + src_offset;
    const long long pass_stride = kRowsPerPass * row_stride;
    T* dst = smem_tile + smem_offset;
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      const int r = r0 + p * kRowsPerPass;
      if (!kEvenPasses && r >= kRows) break;
      const bool row_ok = full || r < rows_valid;
      fa::cp_async<kCopyBytes>(dst + p * kRowsPerPass * kStride, row_ok ? src : gmem_tile, row_ok ? bytes : 0);
      // A running pointer (one 64-bit add per pass) rather than src + p·pass_stride: the products
      // would be hoisted out of the key loop into kPasses 64-bit registers per tile.
      src += pass_stride;
    }
  }
};

}  // namespace flash

namespace flash {

// Paged K/V (KV cache): the tile of key rows [n0, n0 + kRows) of one entry whose logical row r
// lives in page table[r / page_size] at row r % page_size; base is the pool's (page 0, row 0) of
// this head, page_stride the elements between pages. The page is looked up per copied row (any
// page size, down to one row; the library asks for multiples of 16), so a key tile may span
// several pages and pages are read in place, never gathered. Rows at or past rows_valid are
// zero-filled and their page is not looked up (the table is read only for existing rows); the
// copies are those of load_tile (cp.async 16-byte chunks when aligned, element-wise otherwise).
template <typename T, int kRows, int kCols, int kStride, int kNThreads, bool Is_aligned>
__device__ __forceinline__ void load_tile_paged(T* smem, const T* base, long long row_stride, long long page_stride,
                                                const int* table, int page_size, int n0, int rows_valid,
                                                int cols_valid, int tid) {
  auto row_ptr = [&](int r) {  // global address of tile row r (r < rows_valid)
    const int key = n0 + r;
    const int page = fa::gload(table + key / page_size);
    return base + page * page_stride + (key % page_size) * row_stride;
  };
  // the fallback: the pool's first row, which exists whenever a tile is loaded
  load_tile_rows<T, kRows, kCols, kStride, kNThreads, Is_aligned>(smem, row_ptr, base, rows_valid, cols_valid, tid);
}

// The KV-cache state of one block (the SIMT forward's; flash_fwd.cu spells the same out inline):
// the entry's key count seqlens_k[e] (Has_seqlens_k) and block-table row (Is_paged), and the copy
// of key rows [n0, n0 + kRows): through the table (load_tile_paged) or contiguous (load_tile).
// Without a KV cache keys() is Lk and load() is load_tile at row n0.
template <bool Has_seqlens_k, bool Is_paged>
struct KvRows {
  static_assert(!Is_paged || Has_seqlens_k, "Is_paged needs Has_seqlens_k");
  const int* seqlens_k;
  const int* block_table;
  TensorStrides entry;  // e_b0, e_b1, e_b2 (row stride unused)
  long long table_row;
  int page_size;

  __device__ __forceinline__ int keys(const BatchIndex& b, int Lk) {
    if constexpr (Has_seqlens_k) {
      const long long e = b.offset(entry);
      if constexpr (Is_paged) block_table += e * table_row;
      return fa::gload(seqlens_k + e);
    } else {
      return Lk;
    }
  }

  template <typename T, int kRows, int kCols, int kStride, int kNThreads, bool Is_aligned>
  __device__ __forceinline__ void load(T* smem, const T* base, long long row_stride, long long page_stride, int n0,
                                       int rows_valid, int cols_valid, int tid) const {
    if constexpr (Is_paged) {
      load_tile_paged<T, kRows, kCols, kStride, kNThreads, Is_aligned>(smem, base, row_stride, page_stride, block_table,
                                                                        page_size, n0, rows_valid, cols_valid, tid);
    } else {
      (void)page_stride;
      load_tile<T, kRows, kCols, kStride, kNThreads, Is_aligned>(smem, base + n0 * row_stride, row_stride, rows_valid,
                                                                 cols_valid, tid);
    }
  }
};

}  // namespace flash
