// flash_bwd_mma.cuh — warp-level building blocks of the tensor-core backward (flash_bwd.cu):
// tile copies global -> shared, warp matrix products on mma.sync m16n8k16, and the register
// layouts that connect them.
//
// Everything here is written so that, after inlining into a kernel, every loop has a compile-time
// trip count and is fully unrolled: fragment arrays are indexed by constants only (a run-time
// index into a register array forces it to local memory), and each ldmatrix / cp.async address is
// a per-lane base computed once plus an immediate offset. That is what keeps the instructions per
// HMMA of the backward's query/key-tile loop low (docs/performance.md).
//
// Fragment layouts (/work/shared/ptx_semantics.md), lane = 4 g + t:
//   C (m16n8, fp32):  c[0], c[1] = (row g, cols 2t, 2t+1); c[2], c[3] = (row g+8, same cols)
//   A (m16k16, 2 x 16-bit per register): a[0] = (row g, k 2t..2t+1), a[1] = (row g+8, k 2t..),
//                                        a[2] = (row g, k 2t+8..),   a[3] = (row g+8, k 2t+8..)
// so the C tiles of two adjacent n8 columns, rounded to 16 bits, are one k16 step of an A operand
// (how P and dS feed the next product without a trip through shared memory).
#pragma once
#include "flash_bwd_common.cuh"

namespace fa_bwd {

constexpr int kTcPad = 8;  // elements of row padding: rows stay 16-byte aligned, banks rotate

// Swizzled tiles (kSwz, the grid-layout kernel's Q_i, dO_i: tiles_bwd.GRID_SWIZZLE): rows unpadded (pitch = the head dim, a
// multiple of 64 elements: 128-byte lines), 16-byte chunk c of row r stored at chunk c ^ (r mod 8) within its
// group of 8 — FlashAttention-2's layout. The copies then fill whole 128-byte lines (the H100 read the padded rows'
// copies at 1.5x the global sectors: docs/emulator.md, "What the copies cost on an H100"), and each ldmatrix phase
// (8 rows r..r+7 of one chunk column) still hits 8 distinct 16-byte bank groups.
// The element offset of chunk `chunk` (8 elements) of row r in a swizzled tile of pitch `pitch`.
__device__ __forceinline__ int swz_chunk_offset(int r, int chunk, int pitch) {
    return r * pitch + ((chunk & ~7) | ((chunk ^ r) & 7)) * 8;
}

__host__ __device__ constexpr int ceil_div_c(int a, int b) { return (a + b - 1) / b; }

// The 16-byte chunks of a kRows x kCols tile (row stride row_stride elements; shared pitch kPitch) that
// thread threadIdx.x copies: f(it, smem_dst, gmem_src, src_bytes) for it < TileChunks::kIters, src_bytes 16,
// or 0 (zero fill) for rows >= n_rows and columns >= n_cols, the source then the tile origin (never read).
// The caller guarantees 16-byte aligned rows and n_cols % 8 == 0.
// kSwz: the destination is a swizzled tile (swz_chunk_offset; the rows a thread copies are 8 apart, so its chunk's
// place is one per-thread offset).
template <typename T, int kRows, int kCols, int kPitch, int kNThreads, bool kSwz = false>
struct TileChunks {
    static constexpr int kChunk = 16 / (int)sizeof(T);  // elements per 16-byte copy
    static_assert(kCols % kChunk == 0, "tile width must be whole 16-byte chunks");
    static constexpr int kChunksPerRow = kCols / kChunk;
    static constexpr int kChunks = kRows * kChunksPerRow;
    static constexpr int kIters = ceil_div_c(kChunks, kNThreads);
    static_assert(!kSwz || (kPitch == kCols && kCols % 64 == 0 && sizeof(T) == 2 && kNThreads % kChunksPerRow == 0 &&
                            (kNThreads / kChunksPerRow) % 8 == 0),
                  "a swizzled tile: unpadded 16-bit rows of whole 8-chunk groups, each thread's rows 8 apart");

    template <typename F>
    __device__ __forceinline__ static void each(T* smem, const T* gmem, long long row_stride, int n_rows,
                                                int n_cols, F&& f) {
        const int tid = (int)threadIdx.x;
        if constexpr (kNThreads % kChunksPerRow == 0) {
            // A thread always copies the same column chunk, of rows r_t, r_t + kRowStep, ...: one
            // address computation, then constant offsets per chunk.
            constexpr int kRowStep = kNThreads / kChunksPerRow;
            const int r_t = tid / kChunksPerRow, c = (tid % kChunksPerRow) * kChunk;
            const bool col_in = c < n_cols;
            const T* src = gmem + (long long)r_t * row_stride + c;
            const long long pass_stride = kRowStep * row_stride;
            T* dst;
            if constexpr (kSwz)
                dst = smem + swz_chunk_offset(r_t, c / kChunk, kPitch);
            else
                dst = smem + r_t * kPitch + c;
#pragma unroll
            for (int it = 0; it < kIters; ++it) {
                const int r = r_t + it * kRowStep;
                if (kChunks % kNThreads == 0 || r < kRows) {
                    const bool in = col_in && r < n_rows;
                    f(it, dst + it * kRowStep * kPitch, in ? src : gmem, in ? 16 : 0);
                }
                // A running pointer (one 64-bit add per pass), not src + it * pass_stride: that
                // costs a 64-bit multiply-add and a byte scaling per chunk.
                src += pass_stride;
            }
        } else {
            static_assert(!kSwz, "a swizzled tile: each thread copies one column chunk");
#pragma unroll
            for (int it = 0; it < kIters; ++it) {
                const int e = tid + it * kNThreads;
                const int r = e / kChunksPerRow, c = (e % kChunksPerRow) * kChunk;
                if (kChunks % kNThreads == 0 || e < kChunks) {
                    const bool in = r < n_rows && c < n_cols;
                    f(it, smem + r * kPitch + c, in ? gmem + (long long)r * row_stride + c : gmem, in ? 16 : 0);
                }
            }
        }
    }
};

// Copy a kRows x kCols tile (row stride row_stride elements) into shared memory with pitch kPitch,
// zero-filling rows >= n_rows and columns >= n_cols. kVec: 16-byte cp.async chunks (TileChunks; the
// caller guarantees 16-byte aligned rows and n_cols % 8 == 0); else element loads.
template <typename T, int kRows, int kCols, int kPitch, int kNThreads, bool kVec, bool kSwz = false>
__device__ __forceinline__ void load_tile_tc(T* smem, const T* gmem, long long row_stride,
                                             int n_rows, int n_cols) {
    static_assert(!kSwz || kVec, "a swizzled tile is copied in 16-byte chunks");
    if (kVec) {
        TileChunks<T, kRows, kCols, kPitch, kNThreads, kSwz>::each(
            smem, gmem, row_stride, n_rows, n_cols,
            [](int, T* dst, const T* src, int bytes) { fa::cp_async<16>(dst, src, bytes); });
    } else {
        const int tid = (int)threadIdx.x;
        for (int e = tid; e < kRows * kCols; e += kNThreads) {
            const int r = e / kCols, c = e % kCols;
            smem[r * kPitch + c] =
                (r < n_rows && c < n_cols) ? fa::gload(gmem + (long long)r * row_stride + c) : FromAcc<T>::convert(0.0f);
        }
    }
}

// load_tile_tc's 16-byte copies (kVec) as a staged pair for a free buffer (fa::ChunkStage): stage_tile_tc with
// land = false, then, after other work, with land = true and the same arguments; sm_75 loads at the first and
// stores at the second, sm_80+ issues the cp.async at the first (the second: nothing).
template <typename T, int kRows, int kCols, int kPitch, int kNThreads>
using TileStage = fa::ChunkStage<TileChunks<T, kRows, kCols, kPitch, kNThreads>::kIters>;

template <typename T, int kRows, int kCols, int kPitch, int kNThreads, class S>
__device__ __forceinline__ void stage_tile_tc(S& st, bool land, T* smem, const T* gmem, long long row_stride,
                                              int n_rows, int n_cols) {
    TileChunks<T, kRows, kCols, kPitch, kNThreads>::each(smem, gmem, row_stride, n_rows, n_cols,
                                                         [&](int it, T* dst, const T* src, int bytes) {
                                                             if (land)
                                                                 st.land(it, dst);
                                                             else
                                                                 st.stage(it, dst, src, bytes);
                                                         });
}

// load_tile_tc in two halves for a tile whose buffer is still in use (sm_75's prefetch, fa::ChunkPrefetch):
// prefetch_tile_tc with put = false reads the chunks (sm_75: into registers; elsewhere nothing), then, once
// the buffer is free, with put = true and the same arguments writes them (sm_75: the registers; elsewhere
// load_tile_tc's copies). !kVec: nothing, then load_tile_tc.
template <typename T, int kRows, int kCols, int kPitch, int kNThreads>
using TilePrefetch = fa::ChunkPrefetch<TileChunks<T, kRows, kCols, kPitch, kNThreads>::kIters>;

template <typename T, int kRows, int kCols, int kPitch, int kNThreads, bool kVec, class P>
__device__ __forceinline__ void prefetch_tile_tc(P& pf, bool put, T* smem, const T* gmem, long long row_stride,
                                                 int n_rows, int n_cols) {
    if constexpr (kVec) {
        TileChunks<T, kRows, kCols, kPitch, kNThreads>::each(smem, gmem, row_stride, n_rows, n_cols,
                                                             [&](int it, T* dst, const T* src, int bytes) {
                                                                 if (put)
                                                                     pf.put(it, dst, src, bytes);
                                                                 else
                                                                     pf.fetch(it, src, bytes);
                                                             });
    } else if (put) {
        load_tile_tc<T, kRows, kCols, kPitch, kNThreads, false>(smem, gmem, row_stride, n_rows, n_cols);
    }
}

template <int kN>
__device__ __forceinline__ void zero_acc(float (&acc)[kN][4]) {
#pragma unroll
    for (int n = 0; n < kN; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
}

// This lane's row address for an x4 ldmatrix of a B operand (two adjacent n8 tiles of one k16
// step), relative to the operand's origin; add kk (N x K) or kk * pitch (K x N) and n0 offsets.
//   kBTrans = false: B[k][n] = B_s[n * pitch + k] (stored N x K, ldmatrix):
//                    matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
//   kBTrans = true:  B[k][n] = B_s[k * pitch + n] (stored K x N, ldmatrix.trans):
//                    matrices (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15)
template <bool kBTrans>
__device__ __forceinline__ int b_lane_offset(int pitch) {
    const int lane = (int)threadIdx.x % 32, mat = lane / 8, mrow = lane % 8;
    return kBTrans ? (mrow + (mat % 2) * 8) * pitch + (mat / 2) * 8 : (mrow + (mat / 2) * 8) * pitch + (mat % 2) * 8;
}

// acc (16 x kN, C layout per n8 tile) += A (16 x kK, k16 steps of A fragments in registers) * B.
template <typename T, int kK, int kN, bool kBTrans>
__device__ __forceinline__ void warp_mma_rA(float (&acc)[kN / 8][4], const uint32_t (&a)[kK / 16][4],
                                            const T* B_s, int b_pitch) {
    static_assert(kK % 16 == 0, "warp_mma: k must be a multiple of 16 (one mma k-step)");
    static_assert(kN % 16 == 0, "warp_mma: n must be a multiple of 16 (pairs of n8 tiles per ldmatrix.x4)");
    const T* B_l = B_s + b_lane_offset<kBTrans>(b_pitch);
#pragma unroll
    for (int ks = 0; ks < kK / 16; ++ks)
#pragma unroll
        for (int n0 = 0; n0 < kN; n0 += 16) {
            uint32_t b[4];
            fa::ldmatrix<4, kBTrans>(b, B_l + (kBTrans ? ks * 16 * b_pitch + n0 : n0 * b_pitch + ks * 16));
            const uint32_t b_lo[2] = {b[0], b[1]};  // n tile n0
            const uint32_t b_hi[2] = {b[2], b[3]};  // n tile n0 + 8
            fa::mma_m16n8k16<T>(acc[n0 / 8], a[ks], b_lo, acc[n0 / 8]);
            fa::mma_m16n8k16<T>(acc[n0 / 8 + 1], a[ks], b_hi, acc[n0 / 8 + 1]);
        }
}

// acc (16 x kN) += A (16 x kK) * B (kK x kN) for the calling warp, both operands in shared memory.
//   A: kATrans = false: A[m][k] = A_s[m * a_pitch + k]   (stored row-major, ldmatrix)
//      kATrans = true:  A[m][k] = A_s[k * a_pitch + m]   (stored transposed, ldmatrix.trans)
//   B: as b_lane_offset.
// One k16 step at a time: its A fragment is loaded, then used by every n16 pair of the step.
template <typename T, int kK, int kN, bool kATrans, bool kBTrans>
__device__ __forceinline__ void warp_mma(float (&acc)[kN / 8][4], const T* A_s, int a_pitch,
                                         const T* B_s, int b_pitch) {
    const int lane = (int)threadIdx.x % 32;
    const int mat = lane / 8, mrow = lane % 8;  // which 8x8 matrix this lane addresses, and its row
    // !kATrans matrices: (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15);
    // kATrans (stored rows are k): (k 0-7, m 0-7), (k 0-7, m 8-15), (k 8-15, m 0-7), (k 8-15, m 8-15).
    const T* A_l = kATrans ? A_s + (mrow + (mat / 2) * 8) * a_pitch + (mat % 2) * 8
                           : A_s + (lane % 16) * a_pitch + (lane / 16) * 8;
#pragma unroll
    for (int ks = 0; ks < kK / 16; ++ks) {
        uint32_t a[1][4];
        fa::ldmatrix<4, kATrans>(a[0], A_l + (kATrans ? ks * 16 * a_pitch : ks * 16));
        warp_mma_rA<T, 16, kN, kBTrans>(acc, a, kBTrans ? B_s + ks * 16 * b_pitch : B_s + ks * 16, b_pitch);
    }
}

// One lane's ldmatrix addresses in a swizzled operand tile (swz_chunk_offset): the row r_lane it addresses (its 8x8
// matrix's row; the rows a call adds are multiples of 8) and the 16-byte chunk lane_chunk (0 or 1) its matrix adds,
// from the tile's column origin col0. at(c) is the lane's chunk c (even, a compile-time count) chunks further, at its
// swizzled place: one XOR with a constant per c mod 8, provided col0's chunk index within its group of 8 and the c of
// a call use disjoint bits (col0 a multiple of the call's column extent, a power of two: the grid kernel's warp
// slices). kSwz = false: nothing (a plain operand keeps warp_mma_m's lane pointer and immediate offsets).
template <typename T, bool kSwz>
struct LaneCols {
    const T* p = nullptr;  // the lane's row at col0's group of 8 chunks
    unsigned z = 0;        // the lane's chunk within the group, XOR its row's swizzle (r_lane mod 8)
    __device__ __forceinline__ LaneCols(const T* tile, int r_lane, int lane_chunk, int col0, int pitch) {
        if constexpr (kSwz) {
            p = tile + r_lane * pitch + ((col0 / 8) & ~7) * 8;
            z = static_cast<unsigned>((col0 / 8) ^ lane_chunk ^ r_lane) & 7u;
        }
    }
    __device__ __forceinline__ const T* at(int c) const {
        return p + ((z ^ static_cast<unsigned>(c & 7)) * 8u) + (c & ~7) * 8;
    }
};

// acc (16 kMT x kN) += A (16 kMT x kK) * B (kK x kN), both operands in shared memory (layouts as
// warp_mma): kMT m16 tiles per warp, so each B fragment (one ldmatrix.x4: two n8 tiles of a k16 step)
// feeds 2 kMT MMAs instead of 2 — the grid-layout dK/dV kernel's products (flash_bwd_dkv_grid_kernel:
// 32 x 32 warp tiles, 0.5 ldmatrix per MMA where a 16-row strip of the same product needs 0.75).
// A_s, B_s: the operands' first rows and (plain) columns; a_col0, b_col0: a swizzled operand's first column (kSwzA,
// kSwzB: LaneCols; a plain one has its column in the pointer and 0 here).
template <typename T, int kMT, int kK, int kN, bool kATrans, bool kBTrans, bool kSwzA = false, bool kSwzB = false>
__device__ __forceinline__ void warp_mma_m(float (&acc)[kMT][kN / 8][4], const T* A_s, int a_pitch,
                                           const T* B_s, int b_pitch, int a_col0 = 0, int b_col0 = 0) {
    static_assert(kK % 16 == 0 && kN % 16 == 0, "warp_mma_m: k16 steps and pairs of n8 tiles");
    const int lane = (int)threadIdx.x % 32;
    const int mat = lane / 8, mrow = lane % 8;
    // !kATrans matrices: (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15): row lane % 16;
    // kATrans (stored rows are k): (k 0-7, m 0-7), (k 0-7, m 8-15), (k 8-15, m 0-7), (k 8-15, m 8-15).
    // plain operands: one lane pointer plus immediate offsets (their columns in the pointer, a_col0 = b_col0 = 0);
    // swizzled ones: LaneCols
    const T* A_l = kATrans ? A_s + (mrow + (mat / 2) * 8) * a_pitch + (mat % 2) * 8
                           : A_s + (lane % 16) * a_pitch + (lane / 16) * 8;
    const T* B_l = B_s + b_lane_offset<kBTrans>(b_pitch);
    const LaneCols<T, kSwzA> a_sw = kATrans ? LaneCols<T, kSwzA>(A_s, mrow + (mat / 2) * 8, mat % 2, a_col0, a_pitch)
                                            : LaneCols<T, kSwzA>(A_s, lane % 16, lane / 16, a_col0, a_pitch);
    const LaneCols<T, kSwzB> b_sw = kBTrans ? LaneCols<T, kSwzB>(B_s, mrow + (mat % 2) * 8, mat / 2, b_col0, b_pitch)
                                            : LaneCols<T, kSwzB>(B_s, mrow + (mat / 2) * 8, mat % 2, b_col0, b_pitch);
#pragma unroll
    for (int ks = 0; ks < kK / 16; ++ks) {
        uint32_t a[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
            const T* a_addr;
            if constexpr (kSwzA)
                a_addr = kATrans ? a_sw.at(2 * mt) + ks * 16 * a_pitch : a_sw.at(2 * ks) + (mt * 16) * a_pitch;
            else
                a_addr = A_l + (kATrans ? ks * 16 * a_pitch + mt * 16 : (mt * 16) * a_pitch + ks * 16);
            fa::ldmatrix<4, kATrans>(a[mt], a_addr);
        }
#pragma unroll
        for (int n0 = 0; n0 < kN; n0 += 16) {
            uint32_t b[4];
            const T* b_addr;
            if constexpr (kSwzB)
                b_addr = kBTrans ? b_sw.at(n0 / 8) + ks * 16 * b_pitch : b_sw.at(2 * ks) + n0 * b_pitch;
            else
                b_addr = B_l + (kBTrans ? ks * 16 * b_pitch + n0 : n0 * b_pitch + ks * 16);
            fa::ldmatrix<4, kBTrans>(b, b_addr);
            const uint32_t b_lo[2] = {b[0], b[1]};
            const uint32_t b_hi[2] = {b[2], b[3]};
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
                fa::mma_m16n8k16<T>(acc[mt][n0 / 8], a[mt], b_lo, acc[mt][n0 / 8]);
                fa::mma_m16n8k16<T>(acc[mt][n0 / 8 + 1], a[mt], b_hi, acc[mt][n0 / 8 + 1]);
            }
        }
    }
}

// Round a 16 x (16 kK) C-layout accumulator (kK k16 steps = 2 kK n8 tiles) to A fragments.
template <typename T, int kK>
__device__ __forceinline__ void c_to_a(uint32_t (&a)[kK][4], const float (&c)[2 * kK][4]) {
#pragma unroll
    for (int ks = 0; ks < kK; ++ks) {
        a[ks][0] = fa::pack2<T>(c[2 * ks][0], c[2 * ks][1]);          // row g,   k 2t, 2t+1
        a[ks][1] = fa::pack2<T>(c[2 * ks][2], c[2 * ks][3]);          // row g+8
        a[ks][2] = fa::pack2<T>(c[2 * ks + 1][0], c[2 * ks + 1][1]);  // row g,   k 2t+8, 2t+9
        a[ks][3] = fa::pack2<T>(c[2 * ks + 1][2], c[2 * ks + 1][3]);  // row g+8
    }
}

// Store A fragments (a 16 x 16 kK tile) row-major to shared memory with pitch `pitch` (elements).
template <typename T, int kK>
__device__ __forceinline__ void store_a(T* s, int pitch, const uint32_t (&a)[kK][4]) {
    const int lane = (int)threadIdx.x % 32, g = lane / 4, t = lane % 4;
    T* s_l = s + g * pitch + 2 * t;
#pragma unroll
    for (int ks = 0; ks < kK; ++ks)
#pragma unroll
        for (int j = 0; j < 4; ++j)
            *reinterpret_cast<uint32_t*>(s_l + (j % 2) * 8 * pitch + ks * 16 + (j / 2) * 8) = a[ks][j];
}

// Epilogue through shared memory, step 1: a warp's 16 x (8 * kN) accumulator tile times `mult`,
// rounded to the 16-bit OutT, into shared memory at `s` (pitch in elements), C layout: lane (g, t)
// writes rows g, g + 8, columns 2t, 2t + 1 of each n8 tile as one 4-byte word. With the kernels'
// pitches (head dim + kTcPad: pitch / 2 words = 4 mod 8) the 8 rows g of one store start in 8
// different 4-bank groups and t picks the bank inside: conflict-free.
template <typename OutT, int kN>
__device__ __forceinline__ void stage_acc(OutT* s, int pitch, const float (&acc)[kN][4], float mult) {
    static_assert(sizeof(OutT) == 2, "stage_acc: 16-bit output (pairs packed into one word)");
    const int lane = (int)threadIdx.x % 32, g = lane / 4, t = lane % 4;
    OutT* s_l = s + g * pitch + 2 * t;
#pragma unroll
    for (int n = 0; n < kN; ++n)
#pragma unroll
        for (int h = 0; h < 2; ++h)
            *reinterpret_cast<uint32_t*>(s_l + h * 8 * pitch + n * 8) =
                fa::pack2<OutT>(acc[n][2 * h] * mult, acc[n][2 * h + 1] * mult);
}

// Epilogue step 2: a kRows x kCols tile from shared memory (pitch kPitch) to global memory in
// 16-byte chunks, rows < n_rows and columns < n_cols (caller guarantees n_cols % 8 == 0 and
// 16-byte aligned global rows). Consecutive threads take consecutive chunks of a row, so a warp
// writes whole rows (full 32-byte sectors); as load_tile_tc, a thread keeps one column chunk
// (one address, constant row steps) when the block's threads divide into whole rows.
template <typename T, int kRows, int kCols, int kPitch, int kNThreads>
__device__ __forceinline__ void store_tile_vec(T* gmem, long long row_stride, const T* smem, int n_rows,
                                               int n_cols) {
    constexpr int kChunk = 16 / (int)sizeof(T);  // elements per 16-byte store
    static_assert(kCols % kChunk == 0, "tile width must be whole 16-byte chunks");
    constexpr int kChunksPerRow = kCols / kChunk;
    constexpr int kChunks = kRows * kChunksPerRow;
    constexpr int kIters = ceil_div_c(kChunks, kNThreads);
    const int tid = (int)threadIdx.x;
    if constexpr (kNThreads % kChunksPerRow == 0) {
        constexpr int kRowStep = kNThreads / kChunksPerRow;
        const int r_t = tid / kChunksPerRow, c = (tid % kChunksPerRow) * kChunk;
        if (c >= n_cols) return;
        T* dst = gmem + (long long)r_t * row_stride + c;
        const T* src = smem + r_t * kPitch + c;
#pragma unroll
        for (int it = 0; it < kIters; ++it) {
            const int r = r_t + it * kRowStep;
            if ((kChunks % kNThreads == 0 || r < kRows) && r < n_rows)
                fa::gstore(reinterpret_cast<uint4*>(dst + (long long)(it * kRowStep) * row_stride),
                           *reinterpret_cast<const uint4*>(src + it * kRowStep * kPitch));
        }
    } else {
#pragma unroll
        for (int it = 0; it < kIters; ++it) {
            const int e = tid + it * kNThreads;
            const int r = e / kChunksPerRow, c = (e % kChunksPerRow) * kChunk;
            if ((kChunks % kNThreads == 0 || e < kChunks) && r < n_rows && c < n_cols)
                fa::gstore(reinterpret_cast<uint4*>(gmem + (long long)r * row_stride + c),
                           *reinterpret_cast<const uint4*>(smem + r * kPitch + c));
        }
    }
}

// Store a warp's 16 x (8 * kN) accumulator tile times `mult` to global memory (rows < n_rows,
// columns < n_cols), C layout: lane (g, t) holds rows g, g + 8 and columns 2t, 2t + 1 per n8 tile.
template <typename OutT, int kN>
__device__ __forceinline__ void store_acc(OutT* gmem, long long row_stride, const float (&acc)[kN][4],
                                          float mult, int n_rows, int n_cols) {
    const int lane = (int)threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int n = 0; n < kN; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = g + (e / 2) * 8, c = n * 8 + 2 * t + (e % 2);
            if (r < n_rows && c < n_cols)
                fa::gstore(gmem + (long long)r * row_stride + c, FromAcc<OutT>::convert(acc[n][e] * mult));
        }
}

}  // namespace fa_bwd
