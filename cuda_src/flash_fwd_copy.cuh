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
// kSwizzle: element c of row r is stored at column c ^ 8·(r mod 8) (16-byte chunk c/8 at chunk c/8 ^ (r mod 8);
// kCols a multiple of 64, rows unpadded: FwdTensorCoreTraits::kSwizzleQ).
template <int kStride, bool kSwizzle, typename T>
__device__ __forceinline__ T* smem_at(T* smem, int r, int c) {
  if constexpr (kSwizzle) return smem + r * kStride + (c ^ ((r & 7) * 8));
  return smem + r * kStride + c;
}

template <typename T, int kRows, int kCols, int kStride, int kNThreads, bool Is_aligned, bool kSwizzle = false,
          typename RowPtr>
__device__ __forceinline__ void load_tile_rows(T* smem, RowPtr row_ptr, const T* fallback, int rows_valid,
                                               int cols_valid, int tid) {
  static_assert(!kSwizzle || (kCols % 64 == 0 && kStride == kCols && sizeof(T) == 2),
                "a swizzled tile has unpadded 16-bit rows of whole 8-chunk groups");
  if constexpr (Is_aligned) {
    constexpr int kElemsPerCopy = kCopyBytes / sizeof(T);
    static_assert(kCols % kElemsPerCopy == 0, "tile width must be whole 16-byte chunks");
    constexpr int kChunksPerRow = kCols / kElemsPerCopy;
    constexpr int kChunks = kRows * kChunksPerRow;
    if (fa::kSyncCopy && cols_valid >= kCols) {
      // sm_75 (fa::kSyncCopy), every chunk whole: a compile-time byte count (16 or 0) and a
      // compile-time trip count, so the thread's loads are all issued before its first store
      constexpr int kIters = (kChunks + kNThreads - 1) / kNThreads;
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const int idx = tid + it * kNThreads;
        const int r = idx / kChunksPerRow, c = (idx % kChunksPerRow) * kElemsPerCopy;
        const bool in = r < rows_valid;
        if (kChunks % kNThreads == 0 || idx < kChunks)
          fa::cp_async<kCopyBytes>(smem_at<kStride, kSwizzle>(smem, r, c), in ? row_ptr(r) + c : fallback,
                                   in ? kCopyBytes : 0);
      }
      return;
    }
    for (int idx = tid; idx < kChunks; idx += kNThreads) {
      const int r = idx / kChunksPerRow;
      const int c = (idx % kChunksPerRow) * kElemsPerCopy;
      int elems = cols_valid - c;
      elems = elems < 0 ? 0 : (elems > kElemsPerCopy ? kElemsPerCopy : elems);
      if (r >= rows_valid) elems = 0;
      const T* src = elems > 0 ? row_ptr(r) + c : fallback;
      fa::cp_async<kCopyBytes>(smem_at<kStride, kSwizzle>(smem, r, c), src, elems * static_cast<int>(sizeof(T)));
    }
  } else {
    constexpr int kElems = kRows * kCols;
    for (int idx = tid; idx < kElems; idx += kNThreads) {
      const int r = idx / kCols;
      const int c = idx % kCols;
      *smem_at<kStride, kSwizzle>(smem, r, c) =
          (r < rows_valid && c < cols_valid) ? fa::gload(row_ptr(r) + c) : zero_value<T>();
    }
  }
}

// A tile of rows at a fixed row stride from gmem (row 0 of the tile always exists).
template <typename T, int kRows, int kCols, int kStride, int kNThreads, bool Is_aligned, bool kSwizzle = false>
__device__ __forceinline__ void load_tile(T* smem, const T* gmem, long long row_stride,
                                          int rows_valid, int cols_valid, int tid) {
  load_tile_rows<T, kRows, kCols, kStride, kNThreads, Is_aligned, kSwizzle>(
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
//
// kWholePath (sm_75, fa::kSyncCopy): threads whose chunk is whole take load()'s separate path; a kernel
// turns it off where the chunks' registers in flight would spill.
template <typename T, int kRows, int kCols, int kStride, int kNThreads, bool kWholePath = true>
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
    // fa::kSyncCopy (sm_75): a thread whose chunk is whole (or absent) copies with a byte count known
    // at compile time, so its passes' loads are all issued before the first store
    if (fa::kSyncCopy && kWholePath && bytes == kCopyBytes)
      passes<kCopyBytes>(full, smem_tile, gmem_tile, rows_valid);
    else if (fa::kSyncCopy && kWholePath && bytes == 0)
      passes<0>(full, smem_tile, gmem_tile, rows_valid);
    else
      passes<-1>(full, smem_tile, gmem_tile, rows_valid);
  }

  // A whole tile (every row exists) in two halves, for the pipelined loop of sm_75 (fa::ChunkStage):
  // stage() reads it, land() writes it to smem_tile, and the caller's work in between hides the loads.
  // Threads whose chunk is not whole (the head dim ends inside it or before it) copy at stage() and land
  // nothing. sm_80+: stage() is load(true, ...) and land() nothing.
  using Stage = fa::ChunkStage<kPasses>;
  __device__ __forceinline__ bool staged() const { return fa::kSyncCopy && kWholePath && bytes == kCopyBytes; }
  __device__ __forceinline__ void stage(Stage& st, T* smem_tile, const T* gmem_tile) const {
    if (kChunksPerRow != kThreadsPerRow && !active) return;
    if (!staged()) {
      load(true, smem_tile, gmem_tile, kRows);
      return;
    }
    const T* src = gmem_tile + src_offset;
    const long long pass_stride = kRowsPerPass * row_stride;
    T* dst = smem_tile + smem_offset;
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      if (!kEvenPasses && r0 + p * kRowsPerPass >= kRows) break;
      st.stage(p, dst + p * kRowsPerPass * kStride, src, kCopyBytes);
      src += pass_stride;
    }
  }
  __device__ __forceinline__ void land(Stage& st, T* smem_tile) const {
    if ((kChunksPerRow != kThreadsPerRow && !active) || !staged()) return;
    T* dst = smem_tile + smem_offset;
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      if (!kEvenPasses && r0 + p * kRowsPerPass >= kRows) break;
      st.land(p, dst + p * kRowsPerPass * kStride);
    }
  }

  // kBytes: the chunk's bytes when the caller tested them (kCopyBytes or 0), else -1 (run time)
  template <int kBytes>
  __device__ __forceinline__ void passes(bool full, T* smem_tile, const T* gmem_tile, int rows_valid) const {
    const T* src = gmem_tile + src_offset;
    const long long pass_stride = kRowsPerPass * row_stride;
    T* dst = smem_tile + smem_offset;
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      const int r = r0 + p * kRowsPerPass;
      if (!kEvenPasses && r >= kRows) break;
      const bool row_ok = full || r < rows_valid;
      const int n = row_ok ? (kBytes >= 0 ? kBytes : bytes) : 0;
      fa::cp_async<kCopyBytes>(dst + p * kRowsPerPass * kStride, row_ok ? src : gmem_tile, n);
      // A running pointer (one 64-bit add per pass) rather than src + p·pass_stride: the products
      // would be hoisted out of the key loop into kPasses 64-bit registers per tile.
      src += pass_stride;
    }
  }
};

}  // namespace flash

namespace flash {

// ---- paged K/V tiles of the tensor-core forward (KV cache, Is_paged) ------------------------------
// The library's page sizes are multiples of 16 rows (flash_attention_with_kvcache refuses others),
// and key tiles start at multiples of Bc (a multiple of 16), so every 16-row group of a key tile
// lies inside one page: the page is looked up once per group, not once per row or 16-byte chunk,
// and once per page the tile touches (once per tile when the page holds the tile).

// n / d for a block-uniform divisor d >= 1 and dividends n in [0, 2^31): a 32 × 32 → 64-bit multiply
// and a shift instead of a ~20-instruction integer division in the key loop. Granlund & Montgomery:
// with l = ceil(log2 d) and m = ceil(2^(31+l) / d) (< 2^32), m·d − 2^(31+l) < d <= 2^l, so
// n·m / 2^(31+l) stays below floor(n / d) + 1 for every n < 2^31.
struct DivideBy {
  unsigned mul;  // m
  int shift;     // 31 + l

  __device__ __forceinline__ explicit DivideBy(int d) {
    int l = 0;
    while ((1u << l) < static_cast<unsigned>(d)) ++l;
    shift = 31 + l;
    mul = static_cast<unsigned>(((1ull << shift) + static_cast<unsigned>(d) - 1) / static_cast<unsigned>(d));
  }
  __device__ __forceinline__ int operator()(int n) const {
    return static_cast<int>((static_cast<unsigned long long>(static_cast<unsigned>(n)) * mul) >> shift);
  }
};

// Pick<B, A, C>::type: A when B, else C; with Absent, a member the kernel only has in some
// instantiations (declared in all, constructed and used only where it exists).
template <bool B, typename A, typename C> struct Pick { using type = A; };
template <typename A, typename C> struct Pick<false, A, C> { using type = C; };
struct Absent {
  template <typename... Args> __device__ __forceinline__ explicit Absent(Args...) {}
};

// Where 16-row group `lane` of a key tile lives (meaningful in lanes < kRows / 16): its page and
// the page row the group starts at.
struct PageSpan {
  int page;
  int row;
};

// One entry's row of the block table (table[p] = page of logical rows [p·page_size, (p+1)·page_size)).
struct PageTable {
  const int* table;
  int page_size;
  DivideBy per_page;

  __device__ __forceinline__ PageTable(const int* table_, int page_size_)
      : table(table_), page_size(page_size_), per_page(page_size_) {}

  // The pages of the key tile of rows [n0, n0 + kRows), rows_valid of which exist: lane l of every
  // warp gets group l's PageSpan. Only the lane of a page's first group in the tile (or lane 0, for
  // the page the tile starts in) reads the table; the other lanes of that page take it from that
  // lane: one 4-byte read per page the tile touches, per warp (one per tile when the page holds the
  // tile). Groups past rows_valid read no table entry, so entries past the entry's pages are never
  // read; they get page 0 or a page an earlier lane read (their copies read nothing, and row `row`
  // of either page is an address that exists). Every lane of the warp calls this (a shuffle).
  template <int kRows>
  __device__ __forceinline__ PageSpan lookup(int n0, int rows_valid, int lane) const {
    static_assert(kRows % 16 == 0 && kRows / 16 <= 32, "one lane per 16-row group of the key tile");
    const int key = n0 + 16 * lane;
    const int p = per_page(key);
    const int row = key - p * page_size;  // multiple of 16
    const bool reads = lane < kRows / 16 && 16 * lane < rows_valid && (lane == 0 || row == 0);
    const int own = reads ? fa::gload(table + p) : 0;
    // the page starts row / 16 lanes below (or before the tile: lane 0 read it)
    const int from = lane - (row >> 4);
    return {__shfl_sync(0xffffffffu, own, from < 0 ? 0 : from), row};
  }
};

// A paged K_j / V_j tile: TileCopy's plan (each thread a fixed column chunk of rows r0 + p·kRowsPerPass,
// compile-time shared-memory offsets, a loop-invariant byte count) with the global source of each
// row taken from its 16-row group's start, which lane g of the warp computed from the tile's
// PageSpan (page·page_stride + row·row_stride) and shuffles: 16 rows per pass or more (d <= 64),
// one shuffle of the group's start per pass; fewer (d = 128: 8, d = 256: 4), one per group and a
// running pointer across the group's passes, as TileCopy's. Every lane of the warp calls load()
// (the shuffles), lanes without a chunk then copy nothing.
template <typename T, int kRows, int kCols, int kStride, int kNThreads, bool kWholePath = true>
struct PagedTileCopy {
  using Plan = TileCopy<T, kRows, kCols, kStride, kNThreads>;
  static constexpr int kGroupRows = 16;
  static constexpr int kGroups = kRows / kGroupRows;
  static constexpr int kRowsPerPass = Plan::kRowsPerPass;
  static constexpr int kPasses = Plan::kPasses;
  static_assert(kRows % kGroupRows == 0, "paged key tiles are whole 16-row groups");
  static_assert(kRowsPerPass % kGroupRows == 0 || kGroupRows % kRowsPerPass == 0,
                "a pass covers whole groups, or a group whole passes");

  bool active;           // this lane has a chunk of the row (false past kChunksPerRow)
  int r0;                // first tile row this thread copies
  int smem_offset;       // element offset of (r0, c) in a shared-memory tile
  int bytes;             // bytes of the chunk that exist (head dim cut), 0..16
  long long src_offset;  // element offset of (r0, c) from its group's first row (c = 0 when nothing
                         // of the chunk exists)
  long long row_stride;  // global elements between rows of a page

  __device__ __forceinline__ PagedTileCopy(long long row_stride_, int cols_valid, int tid) : row_stride(row_stride_) {
    // tid % kNThreads (= tid): tells the compiler r0 < kRowsPerPass, so that the group a pass
    // reads is a compile-time lane when a pass is one group (r0 / 16 = 0)
    r0 = (tid % kNThreads) / Plan::kThreadsPerRow;
    active = tid % Plan::kThreadsPerRow < Plan::kChunksPerRow;
    const int c = (tid % Plan::kThreadsPerRow) * Plan::kElemsPerCopy;
    int elems = cols_valid - c;
    elems = elems < 0 ? 0 : (elems > Plan::kElemsPerCopy ? Plan::kElemsPerCopy : elems);
    bytes = elems * static_cast<int>(sizeof(T));
    smem_offset = r0 * kStride + c;
    src_offset = (r0 % kGroupRows) * row_stride + (elems > 0 ? c : 0);
  }

  // Copies the tile whose groups span describes (PageTable::lookup) from the pool at base (page 0,
  // row 0 of this head; page_stride elements between pages) into smem_tile. full: every row exists
  // (a literal); else rows at or past rows_valid are zero-filled (src_bytes = 0; their source
  // address is a row of a looked-up page or of page 0, which exists).
  __device__ __forceinline__ void load(bool full, T* smem_tile, const T* base, long long page_stride, PageSpan span,
                                       int rows_valid) const {
    // fa::kSyncCopy (sm_75): whole (or absent) chunks with a compile-time byte count, as TileCopy's
    if (fa::kSyncCopy && kWholePath && bytes == kCopyBytes)
      passes<kCopyBytes>(full, smem_tile, base, page_stride, span, rows_valid);
    else if (fa::kSyncCopy && kWholePath && bytes == 0)
      passes<0>(full, smem_tile, base, page_stride, span, rows_valid);
    else
      passes<-1>(full, smem_tile, base, page_stride, span, rows_valid);
  }

  // kBytes: the chunk's bytes when the caller tested them (kCopyBytes or 0), else -1 (run time)
  template <int kBytes>
  __device__ __forceinline__ void passes(bool full, T* smem_tile, const T* base, long long page_stride, PageSpan span,
                                         int rows_valid) const {
    const int whole = kBytes >= 0 ? kBytes : bytes;
    // lane g: the byte offset of group g's first row from base (page and row are >= 0: unsigned
    // widening). Offsets, not addresses, are shuffled: base + offset keeps the source a read-only
    // global pointer (LDG, predicated byte copies on sm_75; a shuffled address would be generic).
    const long long group_bytes =
        static_cast<long long>((static_cast<unsigned long long>(static_cast<unsigned>(span.page)) * page_stride +
                                static_cast<unsigned long long>(static_cast<unsigned>(span.row)) * row_stride) *
                               sizeof(T));
    const char* thread_src = reinterpret_cast<const char*>(base + src_offset);  // + group offset = source
    auto group_of = [&](int g) {
      return reinterpret_cast<const T*>(thread_src + __shfl_sync(0xffffffffu, group_bytes, g));
    };
    T* dst = smem_tile + smem_offset;
    const bool copies = Plan::kChunksPerRow == Plan::kThreadsPerRow || active;
    if constexpr (kRowsPerPass >= kGroupRows) {
#pragma unroll
      for (int p = 0; p < kPasses; ++p) {
        const int r = r0 + p * kRowsPerPass;
        const T* src = group_of(r0 / kGroupRows + p * (kRowsPerPass / kGroupRows));
        const bool row_ok = full || r < rows_valid;
        if (copies && (Plan::kEvenPasses || r < kRows))
          fa::cp_async<kCopyBytes>(dst + p * kRowsPerPass * kStride, src, row_ok ? whole : 0);
      }
    } else {
      constexpr int kPassesPerGroup = kGroupRows / kRowsPerPass;
      const long long pass_stride = kRowsPerPass * row_stride;
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
        const T* src = group_of(g);
#pragma unroll
        for (int q = 0; q < kPassesPerGroup; ++q) {
          const int p = g * kPassesPerGroup + q;
          const bool row_ok = full || r0 + p * kRowsPerPass < rows_valid;
          if (copies) fa::cp_async<kCopyBytes>(dst + p * kRowsPerPass * kStride, src, row_ok ? whole : 0);
          src += pass_stride;  // a running pointer, as TileCopy's
        }
      }
    }
  }
};

// Whether PagedTileCopy (and PageTable::lookup) take a kRows × kCols tile copied by kNThreads
// threads — the conditions of their static_asserts, for kernels whose tile table has tiles they do
// not take (the SIMT forward's Bc = 8 with 64 threads at fp64 d = 256 on sm_75: a row has more
// 16-byte chunks than the block has threads), which keep load_tile_paged.
template <typename T, int kRows, int kCols, int kNThreads>
__host__ __device__ constexpr bool paged_tile_copy_fits() {
  constexpr int kElemsPerCopy = kCopyBytes / static_cast<int>(sizeof(T));
  constexpr int kThreadsPerRow = next_pow2(kCols / kElemsPerCopy);
  return kCols % kElemsPerCopy == 0 && kRows % 16 == 0 && kRows / 16 <= 32 && kNThreads % kThreadsPerRow == 0 &&
         ((kNThreads / kThreadsPerRow) % 16 == 0 || 16 % (kNThreads / kThreadsPerRow) == 0);
}

}  // namespace flash

namespace flash {

// Paged K/V (KV cache): the tile of key rows [n0, n0 + kRows) of one entry whose logical row r
// lives in page table[r / page_size] at row r % page_size; base is the pool's (page 0, row 0) of
// this head, page_stride the elements between pages. The page is looked up per copied row (any
// page size, down to one row; the library asks for multiples of 16), so a key tile may span
// several pages and pages are read in place, never gathered. Used by both forwards for unaligned
// rows (the SIMT one through KvRows, also for its Bc = 8 tile); aligned rows take PagedTileCopy
// (above). Rows at or past rows_valid are zero-filled and their page is not looked up (the table is
// read only for existing rows); the copies are those of load_tile (cp.async 16-byte chunks when
// aligned, element-wise otherwise).
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
// of key rows [n0, n0 + kRows): through the table (load_tile_paged: the SIMT forward's unaligned
// rows; its aligned ones take PageTable / PagedTileCopy) or contiguous (load_tile).
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
