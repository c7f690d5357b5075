// flash_sm90_common.cuh — Hopper (sm_90a) pieces shared by the wgmma forward (flash_fwd_sm90.cu) and
// backward (flash_bwd_sm90.cu): the 128-byte-swizzled shared-memory layout (panels of 64 16-bit
// columns, row r of a panel at 128·r, its 16-byte chunk c at chunk c ^ (r mod 8): CuTe
// Swizzle<3,4,3>), the copy routine that fills it, wgmma descriptors for it, the f16 / bf16
// wgmma wrappers, the K-major SS GEMM both use (S = Q Kᵀ forward; Sᵀ = K Qᵀ and dPᵀ = V dOᵀ backward),
// the TMA tile load and the warp-specialized kernels' register split (docs/hopper.md, "Shared-memory
// layouts", "Warp specialization and TMA").
#pragma once
#include "fa_port.cuh"
#include "flash_kernel_traits.cuh"  // IsSame, zero_value, kCopyBytes

namespace flash {

// Byte offset of 16-byte chunk `chunk` (= column / 8) of row r in a 128B-swizzled tile of kRows rows.
template <int kRows>
__device__ __forceinline__ int sw128_offset(int r, int chunk) {
  return (chunk >> 3) * (kRows * 128) + r * 128 + (((chunk & 7) ^ (r & 7)) << 4);
}

// A kRows × kCols tile (row r of global memory at g_tile + r·row_stride) into its swizzled layout;
// rows at or past rows_valid and columns at or past cols_valid zero-filled. Aligned (16-byte rows):
// thread tid copies chunk tid mod (kCols/kChunk) of rows tid / (kCols/kChunk) + p·(rows per pass) by cp.async
// (the caller commits, waits, fences the proxy and syncs); where those chunks do not divide the threads
// (16-bit kCols 192), one 128-byte panel after the other. full: every row exists (the row test folds away).
// Otherwise element-wise, synchronous. kChunk = 16 / sizeof(T) elements per 16-byte chunk (8 for 16-bit
// types, 4 for float: a panel row holds 64 or 32 elements).
template <typename T, int kRows, int kCols, int kNThreads, bool Is_aligned>
__device__ __forceinline__ void load_sw128(unsigned char* s_tile, const T* g_tile, long long row_stride,
                                           int rows_valid, int cols_valid, bool full, int tid) {
  constexpr int kChunk = 16 / static_cast<int>(sizeof(T));
  constexpr int kPanelCols = 8 * kChunk;
  constexpr int kChunksPerRow = kCols / kChunk;
  if constexpr (Is_aligned && kNThreads % kChunksPerRow != 0) {
    static_assert(kCols % kPanelCols == 0, "whole 128-byte panels");
#pragma unroll
    for (int p = 0; p < kCols / kPanelCols; ++p)
      load_sw128<T, kRows, kPanelCols, kNThreads, true>(s_tile + p * kRows * 128, g_tile + p * kPanelCols, row_stride,
                                                        rows_valid, cols_valid - p * kPanelCols, full, tid);
  } else if constexpr (Is_aligned) {
    static_assert(kNThreads % kChunksPerRow == 0, "a fixed column chunk per thread");
    constexpr int kRowsPerPass = kNThreads / kChunksPerRow;
    static_assert(kRows % kRowsPerPass == 0, "whole passes");
    const int chunk = tid % kChunksPerRow, r0 = tid / kChunksPerRow;
    int elems = cols_valid - chunk * kChunk;
    elems = elems < 0 ? 0 : (elems > kChunk ? kChunk : elems);
    const int bytes = elems * static_cast<int>(sizeof(T));
    const T* src = g_tile + r0 * row_stride + (elems > 0 ? chunk * kChunk : 0);
#pragma unroll
    for (int p = 0; p < kRows / kRowsPerPass; ++p) {
      const int r = r0 + p * kRowsPerPass;
      const bool row_ok = full || r < rows_valid;
      fa::cp_async<kCopyBytes>(s_tile + sw128_offset<kRows>(r, chunk), row_ok ? src : g_tile, row_ok ? bytes : 0);
      src += kRowsPerPass * row_stride;
    }
  } else {
    (void)full;
#pragma unroll 1  // (unrolled 4x by ptxas, the wgmma backward's d 128 cp.async kernel spilled 4 bytes around it)
    for (int idx = tid; idx < kRows * kCols; idx += kNThreads) {
      const int r = idx / kCols, c = idx % kCols;
      const T x = (r < rows_valid && c < cols_valid) ? fa::gload(g_tile + r * row_stride + c) : zero_value<T>();
      *reinterpret_cast<T*>(s_tile + sw128_offset<kRows>(r, c / kChunk) + (c % kChunk) * sizeof(T)) = x;
    }
  }
}

// Descriptor of a 128B-swizzled operand at byte address p: SBO = 8 rows, LBO = the next 64-column
// panel (MN-major only; K-major ignores it: 16).
__device__ __forceinline__ uint64_t sw128_desc(const unsigned char* p, uint32_t lbo_bytes) {
  return fa::wgmma_desc(p, lbo_bytes, 1024, fa::kWgmmaSwizzle128B);
}

// SS wgmma: A and B through descriptors; TransA / TransB: the operand is MN-major (transposed).
template <typename T, int N, bool TransB, bool TransA = false>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t da, uint64_t db, int scale_d) {
  if constexpr (IsSame<T, fa_half>::value) fa::wgmma_m64nNk16_f32_f16_ss<N, TransA, TransB>(d, da, db, scale_d);
  else fa::wgmma_m64nNk16_f32_bf16_ss<N, TransA, TransB>(d, da, db, scale_d);
}

template <typename T, int N, bool TransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t db, int scale_d) {
  if constexpr (IsSame<T, fa_half>::value) fa::wgmma_m64nNk16_f32_f16_rs<N, TransB>(d, a, db, scale_d);
  else fa::wgmma_m64nNk16_f32_bf16_rs<N, TransB>(d, a, db, scale_d);
}

struct NoOp {
  __device__ __forceinline__ void operator()() const {}
};

// gemm_qk_sm90's batch (below), issued and committed (the caller waits): the ws backward's S^T issued behind the
// previous visit's dQ^T (kScoresAhead).
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kRowsB = kBlockN, bool kAdvance = true>
__device__ __forceinline__ void issue_qk_sm90(float (&acc_s)[kBlockN / 2], const unsigned char* sQ_w,
                                              const unsigned char* sK_j) {
  fa::wgmma_fence_operand(acc_s);
  fa::wgmma_fence();
  const uint64_t da0 = sw128_desc(sQ_w, 16), db0 = sw128_desc(sK_j, 16);
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks) {
    const int k_bytes = (ks % 4) * 32;
    const int a_bytes = (ks / 4) * kBlockM * 128 + k_bytes, b_bytes = (ks / 4) * kRowsB * 128 + k_bytes;
    const uint64_t da = kAdvance ? fa::wgmma_desc_advance(da0, a_bytes) : sw128_desc(sQ_w + a_bytes, 16);
    const uint64_t db = kAdvance ? fa::wgmma_desc_advance(db0, b_bytes) : sw128_desc(sK_j + b_bytes, 16);
    wgmma_ss<T, kBlockN, false>(acc_s, da, db, ks > 0 ? 1 : 0);
  }
  fa::wgmma_commit_group();
}

// S = Q_w K_jᵀ for the warpgroup's 64 rows (sQ_w: row 64w of panel 0; panels kBlockM rows apart):
// k16 step ks reads bytes 32·(ks mod 4) of panel ks / 4 of both operands. Waits for the result (with
// kPending: for every batch but the kPending committed by `issued` after it). kRowsB: the rows of sK_j's
// panels where N (kBlockN) is a part of them (the backward's query split: N = 32 of Br = 64 rows).
// kAdvance: each step's descriptors advanced from the first's (fa::wgmma_desc_advance, one add each), else encoded
// from the address per step (the wgmma backward with extensions: the two bases held through the batch spilled a
// d 128 instantiation).
template <typename T, int kHeadDim, int kBlockM, int kBlockN, typename Issued = NoOp, int kPending = 0,
          int kRowsB = kBlockN, bool kAdvance = true>
__device__ __forceinline__ void gemm_qk_sm90(float (&acc_s)[kBlockN / 2], const unsigned char* sQ_w,
                                             const unsigned char* sK_j, Issued issued = Issued()) {
  issue_qk_sm90<T, kHeadDim, kBlockM, kBlockN, kRowsB, kAdvance>(acc_s, sQ_w, sK_j);
  issued();  // between the issue and the wait (the ws kernel's ping-pong hand-over; the backward's dV batch)
  fa::wgmma_wait_group<kPending>();
  fa::wgmma_fence_operand(acc_s);
}

// The wgmma register-A fragments (m64nNk16, 16-bit: per warp the mma.sync m16n8k16 A layout, warp w of the
// warpgroup holding rows 16w .. 16w + 15) of 64 rows of a 128B-swizzled tile (kRows rows per panel), every k16 step
// of kCols columns, by ldmatrix.x4: lane l addresses row row0 + l % 8 + 8·((l / 8) % 2) (row0: the warp's first
// row) at chunk 2·ks + l / 16, so a[ks][r] holds (row g or g + 8, columns 16 ks + 2t or 16 ks + 8 + 2t).
template <int kRows, int kCols>
__device__ __forceinline__ void load_a_frags_sm90(uint32_t (&a)[kCols / 16][4], const unsigned char* s_tile, int row0,
                                                  int lane) {
  const int r = row0 + (lane & 7) + (lane & 8);
#pragma unroll
  for (int ks = 0; ks < kCols / 16; ++ks) fa::ldmatrix<4, false>(a[ks], s_tile + sw128_offset<kRows>(r, 2 * ks + (lane >> 4)));
}

// The transposed tile's register-A fragments: A = Tᵀ for a 128B-swizzled tile T of kRows rows (one 64-column panel;
// A's k dimension is T's rows), warp w holding A's rows 16w .. 16w + 15 (T's columns), every k16 step of T's kRows
// rows, by ldmatrix.x4.trans: lane l addresses T's row 16 ks + l % 8 + 8·(l / 16) at chunk 2w + (l / 8) % 2, so
// a[ks][r] holds (A row g or g + 8, columns 16 ks + 2t or 16 ks + 8 + 2t), as load_a_frags_sm90's.
template <int kRows>
__device__ __forceinline__ void load_at_frags_sm90(uint32_t (&a)[kRows / 16][4], const unsigned char* s_tile, int w,
                                                   int lane) {
  const int chunk = 2 * w + ((lane >> 3) & 1), r = (lane & 7) + 8 * (lane >> 4);
#pragma unroll
  for (int ks = 0; ks < kRows / 16; ++ks) fa::ldmatrix<4, true>(a[ks], s_tile + sw128_offset<kRows>(16 * ks + r, chunk));
}

// issue_qk_sm90 with A from registers (RS): acc_s = A · Bᵀ, A the k16 steps' register fragments (load_a_frags_sm90),
// B the K-major kBlockN-row tile sB; issued and committed (the caller waits).
template <typename T, int kHeadDim, int kBlockN>
__device__ __forceinline__ void issue_qk_rs_sm90(float (&acc_s)[kBlockN / 2], const uint32_t (&a)[kHeadDim / 16][4],
                                                 const unsigned char* sB) {
  fa::wgmma_fence_operand(acc_s);
  fa::wgmma_fence();
  const uint64_t db0 = sw128_desc(sB, 16);
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks)
    wgmma_rs<T, kBlockN, false>(acc_s, a[ks], fa::wgmma_desc_advance(db0, (ks / 4) * kBlockN * 128 + (ks % 4) * 32),
                                ks > 0 ? 1 : 0);
  fa::wgmma_commit_group();
}

// gemm_qk_sm90 with A from registers (RS): issue_qk_rs_sm90, then as gemm_qk_sm90 (issued, the wait).
template <typename T, int kHeadDim, int kBlockN, typename Issued = NoOp, int kPending = 0>
__device__ __forceinline__ void gemm_qk_rs_sm90(float (&acc_s)[kBlockN / 2], const uint32_t (&a)[kHeadDim / 16][4],
                                                const unsigned char* sB, Issued issued = Issued()) {
  issue_qk_rs_sm90<T, kHeadDim, kBlockN>(acc_s, a, sB);
  issued();
  fa::wgmma_wait_group<kPending>();
  fa::wgmma_fence_operand(acc_s);
}

// One tile (kRows × kCols, 64-column panels kRows·128 bytes apart) as kCols/64 TMA boxes onto `bar`.
template <int kRows, int kCols>
__device__ __forceinline__ void tma_load_tile(unsigned char* s_tile, const CUtensorMap* map, int row, int b2,
                                              int b1, int b0, uint64_t* bar) {
#pragma unroll
  for (int p = 0; p < kCols / 64; ++p) fa::tma_load_5d(s_tile + p * kRows * 128, map, 64 * p, row, b2, b1, b0, bar);
}

// kCols columns of a staged 128B-swizzled tile (64-column panels kPanelRows·128 bytes apart, s_tile at the
// first row to store) as kCols/64 TMA stores of one box each (the map's box: 64 columns × the rows to store),
// into one bulk async-group once committed. The caller fences the proxy after the generic writes before,
// and commits and waits (fa::tma_store_wait) after.
template <int kPanelRows, int kCols>
__device__ __forceinline__ void tma_store_tile(const CUtensorMap* map, const unsigned char* s_tile, int row, int b2,
                                               int b1, int b0) {
#pragma unroll
  for (int p = 0; p < kCols / 64; ++p) fa::tma_store_5d(map, 64 * p, row, b2, b1, b0, s_tile + p * kPanelRows * 128);
}

// The four registers of one stmatrix.x4 of a wgmma accumulator fragment (acc: N / 2 floats per thread): columns
// [16p, 16p + 16), i.e. matrices rows 0-7 / 8-15 of n8 tiles 2p and 2p + 1, rounded to T after scaling rows g by
// mult_lo and rows g + 8 by mult_hi. Shared by the forward's O / l and the backward's dK / dV epilogues.
template <typename T, int N>
__device__ __forceinline__ void stmatrix_regs_sm90(uint32_t (&regs)[4], const float (&acc)[N / 2], int p,
                                                   float mult_lo, float mult_hi) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int base = 4 * (2 * p + i / 2) + 2 * (i % 2);  // n8 tile 2p + i/2, rows g + 8(i mod 2)
    const float mult = i % 2 ? mult_hi : mult_lo;
    regs[i] = fa::pack2<T>(acc[base] * mult, acc[base + 1] * mult);
  }
}

// Warp-specialized kernels (384 threads, __launch_bounds__(384, 1): 168 registers at launch): the producer
// warpgroup drops to kWsProducerRegs, the two consumer warpgroups rise to kWsConsumerRegs (setmaxnreg):
// 24 + 2 × 240 registers per thread slot, 64,512 of the SM's 65,536 (FlashAttention-3's split).
constexpr int kWsProducerRegs = 24;
constexpr int kWsConsumerRegs = 240;
static_assert((kWsProducerRegs + 2 * kWsConsumerRegs) * 128 <= 65536, "the register file holds all three warpgroups");

}  // namespace flash
