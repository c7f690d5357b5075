// flash_bwd_sm90_tf32.cu — FlashAttention backward dK/dV (+ atomic dQ) for float32 inputs on Hopper warpgroup
// MMA (wgmma.m64nNk8 .tf32, sm_90a): issue 12's precision="tf32" and "3xtf32" (docs/precision.md, "The wgmma
// backward").
//
// The mma.sync TF32 dK/dV kernel's algorithm and arguments (flash_bwd_tf32.cu: one block per key block j and
// K/V batch entry, the query blocks i of the n_group query entries visited in turn, P^T and dS^T recomputed from
// the saved LSE, dQ_i by float atomics into the DQAccumLayout accumulator, in key-block order when kOrderedDQ),
// its operands (kPrec 1: cvt.rna'd; 3: hi + lo, A_lo·B_hi + A_hi·B_lo + A_hi·B_hi; S^T and dP^T take every k8
// step's small products first, gemm_regs) and its accumulation rule for 3xtf32 (each visit's dK_j, dV_j summed in a
// zeroed accumulator and added in fp32), on the wgmma instruction. tf32 wgmma reads K-major operands only, so every product is arranged with its reduction
// dimension contiguous in shared memory, or its A operand gathered into registers:
//
//   S^T  = K_j Q_i^T     M = Bc keys,  N = Br,  K = d:   A = K_j (hi in registers, once per block; lo plane)
//                                                          B = Q_i plane
//   dP^T = V_j dO_i^T    M = Bc keys,  N = Br,  K = dv:  A = V_j (as K_j)  B = dO_i plane
//   dV_j^T += dO_i^T P   M = dv,       N = Bc,  K = Br:  A = dO_i^T gathered from dO_i's plane  B = P^T plane
//   dK_j^T += Q_i^T dS   M = d,        N = Bc,  K = Br:  A = Q_i^T gathered from Q_i's plane    B = dS^T plane
//   dQ_i  = dS K_j       M = Br,       N = d/2 per warpgroup, K = Bc:  A = dS gathered from dS^T's plane,
//                                                                      B = K_j^T plane (built once per block)
//
// Two warpgroups (Bc = 64 keys, Br = 64 queries, d = dv = 64: calls at smaller padded head dims run zero-filled,
// the dQ accumulator at their padded D, kDQDim). Warpgroup 0 computes S^T, writes P^T's planes,
// then dV^T; warpgroup 1 computes dP^T, then (P^T written: named barrier 1) dS^T = P^T ∘ (dP^T − D_i) into its
// planes, then dK^T; both then (dS^T written: named barrier 2) half of dQ_i's columns each, added by atomics.
// Named barriers 3 / 4 (one warpgroup each) make a warpgroup's own plane writes visible to its wgmmas. The gathered
// products load step ks + 1's A fragments while step ks's wgmmas run (gemm_gathered).
//
// Shared-memory planes: the 32-byte-swizzle K-major layout (one 32-byte row = one k8 step of 8 floats: element
// (r, c) of a kRows-row plane at 32·kRows·(c / 8) + 32 r + 16 ((c mod 8) / 4 ^ (r / 4 mod 2)) + 4 (c mod 4); the
// wgmma descriptor: SBO 256, swizzle 32B). The gathers of an A fragment (4 rows t × 8 columns g per 32-bit
// load) then read 128 contiguous bytes, and the accumulators' 8-byte pairs go to 256 contiguous bytes per warp:
// no bank conflicts. Q_i and dO_i arrive by cp.async as raw fp32 into staging planes (the next visit's while this
// one is computed) and are converted at the visit's start by the threads that copied each chunk (hi, lo).
//
// Dense calls (no extensions), 16-byte aligned rows (the host's rule: cuda_backward_tf32.wgmma_tile).
#include "flash_bwd_mma.cuh"  // zero_acc, DQAccumLayout, DQOrderCounters, DQOrderOf, load_row_stats_exp, ...
#include "flash_ext.cuh"
#include "flash_bwd_ext.cuh"
#include "flash_tf32_split.cuh"  // tf32_operand

namespace fa_bwd {

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kPrec_>
struct Sm90Tf32BwdTraits {
    static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_, kPrec = kPrec_;
    static constexpr int kNThreads = 256;
    static constexpr int kPlanes = kPrec == 3 ? 2 : 1;
    static constexpr int kQPlane = kBlockM * kHeadDim * 4;   // bytes of one plane of Q_i (and dO_i: dv = d)
    static constexpr int kKtPlane = kHeadDim * kBlockN * 4;  // K_j^T
    static constexpr int kSPlane = kBlockN * kBlockM * 4;    // P^T, dS^T
    static constexpr int kQ = 0;
    static constexpr int kdO = kQ + kPlanes * kQPlane;
    static constexpr int kQRaw = kdO + kPlanes * kQPlane;
    static constexpr int kdORaw = kQRaw + kQPlane;
    static constexpr int kKt = kdORaw + kQPlane;
    // 3xtf32: K_j's and V_j's lo planes (the A of the lo · hi products through descriptors: their hi fragments
    // stay in registers); tf32: P^T's raw fp32 plane after its tf32 one (dS^T from the unrounded P; 3xtf32 takes
    // hi + lo, within 2^-22 of it).
    static constexpr int kKVLo = kKt + kPlanes * kKtPlane;
    static constexpr int kKVLoPlane = kBlockN * kHeadDim * 4;
    static constexpr int kPt = kKVLo + (kPrec == 3 ? 2 * kKVLoPlane : 0);
    static constexpr int kPRaw = kPrec == 3 ? 0 : kSPlane;   // from kPt: the raw plane (tf32)
    static constexpr int kdSt = kPt + 2 * kSPlane;
    static constexpr int kStats = kdSt + kPlanes * kSPlane;   // L_i log2 e, D_i: Br floats each
    static constexpr int kKVRaw = kPt;                          // prologue: K_j, V_j raw (over P^T, dS^T)
    static constexpr int kAtomBytes = 1024;
    // + the alignment slack of the GPU's dynamic shared memory base (cuda_backward_tf32.wgmma_smem_bytes).
    static constexpr int kSmemBytes = kStats + 2 * kBlockM * 4 + kAtomBytes;
    static constexpr int kKSteps = kHeadDim / 8;  // k8 steps over d (S^T, dP^T)
    static constexpr int kMSteps = kBlockM / 8;   // over Br (dV^T, dK^T)
    static constexpr int kNSteps = kBlockN / 8;   // over Bc (dQ)

    static_assert(kPrec == 1 || kPrec == 3, "kPrec: 1 (tf32) or 3 (3xtf32)");
    static_assert(kHeadDim == 64 && kBlockM == 64 && kBlockN == 64, "d = dv = Br = Bc = 64: one wgmma M each");
    static_assert(2 * kBlockN * kHeadDim * 4 <= 2 * kSPlane + kPlanes * kSPlane, "K_j, V_j raw fit over P^T, dS^T");
    static_assert(kSmemBytes <= 227 * 1024, "one block's shared memory");
};

// Byte offset of element (r, c) of a 32-byte-swizzle K-major plane of kRows rows (module comment).
template <int kRows>
__device__ __forceinline__ int sw32_offset(int r, int c) {
    return (c >> 3) * (32 * kRows) + r * 32 + ((((c & 7) >> 2) ^ ((r >> 2) & 1)) << 4) + (c & 3) * 4;
}

// The descriptor of k8 step ks of such a plane from row `row` on (a multiple of 8).
template <int kRows>
__device__ __forceinline__ uint64_t sw32_desc(const unsigned char* plane, int ks, int row = 0) {
    return fa::wgmma_desc(plane + ks * 32 * kRows + row * 32, 16, 256, fa::kWgmmaSwizzle32B);
}

// The chunk (row, 4-float column group) thread (warp, lane) copies in pass p of a kRows x kCols tile: per warp and
// pass a 16-row group and one 8-float k8 column block, lane l row l / 2 of it and half l mod 2 — lane pairs read
// 32 contiguous bytes of a row, and a quarter warp writes 128 contiguous bytes of the plane.
template <int kRows, int kCols>
struct Sw32Chunk {
    static constexpr int kRowGroups = kRows / 16;
    static_assert(8 % kRowGroups == 0, "a warp's 16-row group is the same in every pass");
    static constexpr int kPasses = kRowGroups * (kCols / 8) / 8;
    static_assert(kRowGroups * (kCols / 8) % 8 == 0, "whole passes of 8 warps");
    int r, c;  // pass p: row r, column c + 8 (8 / kRowGroups) p
    __device__ __forceinline__ Sw32Chunk(int warp, int lane)
        : r(16 * (warp % kRowGroups) + lane / 2), c(8 * (warp / kRowGroups) + 4 * (lane & 1)) {}
    static __host__ __device__ constexpr int col_step(int p) { return 8 * (8 / kRowGroups) * p; }
};

// A kRows x kCols fp32 tile into its 32-byte-swizzle layout by cp.async (Sw32Chunk's chunks); rows at or past
// rows_valid and columns at or past cols_valid zero-filled.
template <int kRows, int kCols>
__device__ __forceinline__ void load_sw32(unsigned char* s_tile, const float* g_tile, long long row_stride,
                                          int rows_valid, int cols_valid, int warp, int lane) {
    using Ch = Sw32Chunk<kRows, kCols>;
    const Ch ch(warp, lane);
    const bool row_ok = ch.r < rows_valid;
    const float* src = g_tile + (row_ok ? ch.r * row_stride : 0);
    unsigned char* dst = s_tile + sw32_offset<kRows>(ch.r, ch.c);
#pragma unroll
    for (int p = 0; p < Ch::kPasses; ++p) {
        const int c = ch.c + Ch::col_step(p);
        int elems = cols_valid - c;
        elems = elems < 0 ? 0 : (elems > 4 ? 4 : elems);
        const bool ok = row_ok && elems > 0;
        // column c: k8 block c / 8, p (8 / kRowGroups) blocks after the first (32 kRows bytes each)
        fa::cp_async<16>(dst + Ch::col_step(p) / 8 * 32 * kRows, ok ? src + c : g_tile, ok ? elems * 4 : 0);
    }
}

// The chunks this thread copied with load_sw32 from `raw`, split: hi into `hi` (unless kLoOnly) and, 3xtf32, lo into
// `lo` (the same offsets).
template <int kPrec, int kRows, int kCols, bool kLoOnly = false>
__device__ __forceinline__ void split_sw32(unsigned char* hi, unsigned char* lo, const unsigned char* raw, int warp,
                                           int lane) {
    using Ch = Sw32Chunk<kRows, kCols>;
    const Ch ch(warp, lane);
    const int off0 = sw32_offset<kRows>(ch.r, ch.c);
#pragma unroll
    for (int p = 0; p < Ch::kPasses; ++p) {
        const int off = off0 + Ch::col_step(p) / 8 * 32 * kRows;
        const flash::Vec16<float> x = *reinterpret_cast<const flash::Vec16<float>*>(raw + off);
        flash::Vec16<float> h4, l4;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            uint32_t h, l = 0;
            flash::tf32_operand<kPrec>(x.v[e], h, l);
            h4.v[e] = __uint_as_float(h);
            l4.v[e] = __uint_as_float(l);
        }
        if constexpr (!kLoOnly) *reinterpret_cast<flash::Vec16<float>*>(hi + off) = h4;
        if constexpr (kPrec == 3) *reinterpret_cast<flash::Vec16<float>*>(lo + off) = l4;
    }
}

// The wgmma A fragment (m16n8k8 tf32 on the warp's rows 16w..: a0 = A[g][t], a1 = A[g+8][t], a2 = A[g][t+4],
// a3 = A[g+8][t+4]) of k8 step ks of A = Xᵀ, X a kRows-row plane (rows = A's k, columns = A's m): element (m, k)
// of A is X's (8 ks + k, m0 + m). hi from `plane`, lo lo_bytes further (3xtf32). Each load: 4 rows x 8 columns,
// 128 contiguous bytes.
// Row 8 ks + r of a plane is 256 ks bytes after row r, in the same swizzle phase (r < 8): the step's offsets are
// step 0's plus 256 ks.
template <int kPrec, int kRows>
__device__ __forceinline__ void gather_at(uint32_t (&hi)[4], uint32_t (&lo)[4], const unsigned char* plane,
                                          int lo_bytes, int ks, int m0, int g, int t) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned char* p = plane + sw32_offset<kRows>(t + 4 * (i >> 1), m0 + g + 8 * (i & 1)) + 256 * ks;
        hi[i] = *reinterpret_cast<const uint32_t*>(p);
        if constexpr (kPrec == 3) lo[i] = *reinterpret_cast<const uint32_t*>(p + lo_bytes);
    }
    (void)lo_bytes;
}

// One k8 step of acc (+)= A·B in precision kPrec: A from registers (hi, lo), B's planes through descriptors.
// first: scale_d 0 on the first wgmma (acc starts at 0).
template <int kPrec, int kN>
__device__ __forceinline__ void wgmma_step(float (&acc)[kN / 2], const uint32_t (&a_hi)[4], const uint32_t (&a_lo)[4],
                                           uint64_t b_hi, uint64_t b_lo, bool first) {
    if constexpr (kPrec == 3) {
        fa::wgmma_m64nNk8_f32_tf32_rs<kN>(acc, a_lo, b_hi, first ? 0 : 1);
        fa::wgmma_m64nNk8_f32_tf32_rs<kN>(acc, a_hi, b_lo, 1);
        fa::wgmma_m64nNk8_f32_tf32_rs<kN>(acc, a_hi, b_hi, 1);
    } else {
        (void)a_lo; (void)b_lo;
        fa::wgmma_m64nNk8_f32_tf32_rs<kN>(acc, a_hi, b_hi, first ? 0 : 1);
    }
}

// acc = A·Bᵀ over kSteps k8 steps: S^T, dP^T. A = K_j or V_j: its hi fragments from registers, (3xtf32) its lo
// plane a_lo (kRowsA rows) through descriptors; B a plane pair (hi, lo lo_bytes further) of kRowsB rows. 3xtf32:
// every step's A_lo·B_hi (.ss) and A_hi·B_lo first, then the A_hi·B_hi: the tensor cores truncate each partial
// sum, and the small terms summed first are truncated while the sum is small (kSteps truncations of the full-size
// sum instead of 3 kSteps − 1 with the terms step by step). One committed batch, waited for.
template <int kPrec, int kN, int kSteps, int kRowsA, int kRowsB>
__device__ __forceinline__ void gemm_regs(float (&acc)[kN / 2], const uint32_t (&a_hi)[kSteps][4],
                                          const unsigned char* a_lo, const unsigned char* b, int lo_bytes) {
    fa::wgmma_fence_operand(acc);
    fa::wgmma_fence();
    // k8 step ks: the start address (descriptor bits 0-13, in 16-byte units) 32·kRows·ks bytes further
    const uint64_t b_hi = sw32_desc<kRowsB>(b, 0);
    if constexpr (kPrec == 3) {
        const uint64_t a0 = sw32_desc<kRowsA>(a_lo, 0), b_lo = sw32_desc<kRowsB>(b + lo_bytes, 0);
#pragma unroll
        for (int ks = 0; ks < kSteps; ++ks) {
            fa::wgmma_m64nNk8_f32_tf32_ss<kN>(acc, a0 + 2 * kRowsA * ks, b_hi + 2 * kRowsB * ks, ks > 0 ? 1 : 0);
            fa::wgmma_m64nNk8_f32_tf32_rs<kN>(acc, a_hi[ks], b_lo + 2 * kRowsB * ks, 1);
        }
    } else {
        (void)a_lo; (void)lo_bytes;
    }
#pragma unroll
    for (int ks = 0; ks < kSteps; ++ks)
        fa::wgmma_m64nNk8_f32_tf32_rs<kN>(acc, a_hi[ks], b_hi + 2 * kRowsB * ks, kPrec == 3 || ks > 0 ? 1 : 0);
    fa::wgmma_commit_group();
    fa::wgmma_wait_group<0>();
    fa::wgmma_fence_operand(acc);
}

// acc = Xᵀ·Bᵀ over kSteps k8 steps, A = Xᵀ gathered per step from X's planes (kRowsA rows, columns m0..m0 + 63 of
// it), B a plane pair of kRowsB rows from row b_row: dV^T, dK^T, dQ. Per step (3xtf32) A_lo·B_hi, A_hi·B_lo,
// A_hi·B_hi in one committed batch; two register sets: step ks + 1's A is gathered while step ks's batch runs
// (wait_group<1> first: step ks − 1's batch, the other set's reader, has completed).
template <int kPrec, int kN, int kSteps, int kRowsA, int kRowsB>
__device__ __forceinline__ void gemm_gathered(float (&acc)[kN / 2], const unsigned char* x, int x_lo_bytes, int m0,
                                              const unsigned char* b, int b_lo_bytes, int b_row, int g, int t) {
    fa::wgmma_fence_operand(acc);
    const uint64_t b_hi0 = sw32_desc<kRowsB>(b, 0, b_row);  // step ks: + 32·kRowsB·ks bytes (2·kRowsB units)
    const uint64_t b_lo0 = kPrec == 3 ? sw32_desc<kRowsB>(b + b_lo_bytes, 0, b_row) : 0;
    uint32_t a_hi[2][4], a_lo[2][4];
    gather_at<kPrec, kRowsA>(a_hi[0], a_lo[0], x, x_lo_bytes, 0, m0, g, t);
#pragma unroll
    for (int ks = 0; ks < kSteps; ++ks) {
        fa::wgmma_fence();
        wgmma_step<kPrec, kN>(acc, a_hi[ks % 2], a_lo[ks % 2], b_hi0 + 2 * kRowsB * ks, b_lo0 + 2 * kRowsB * ks,
                              ks == 0);
        fa::wgmma_commit_group();
        fa::wgmma_wait_group<1>();
        if (ks + 1 < kSteps) gather_at<kPrec, kRowsA>(a_hi[(ks + 1) % 2], a_lo[(ks + 1) % 2], x, x_lo_bytes, ks + 1, m0, g, t);
    }
    fa::wgmma_wait_group<0>();
    fa::wgmma_fence_operand(acc);
}

// An m64 accumulator (N / 2 floats; rows 16w + g + 8 (e / 2), columns 8j + 2t + e mod 2) into a kRows-row plane as
// (row, column) pairs: hi / lo planes by tf32_operand, and the raw values at raw_bytes when kRaw (P^T).
template <int kPrec, int kN, int kRows, bool kRaw>
__device__ __forceinline__ void store_planes(unsigned char* plane, int lo_bytes, int raw_bytes, const float (&acc)[kN / 2],
                                             int row0, int g, int t) {
    const int base[2] = {sw32_offset<kRows>(row0 + g, 2 * t), sw32_offset<kRows>(row0 + g + 8, 2 * t)};
#pragma unroll
    for (int j = 0; j < kN / 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int off = base[h] + j * 32 * kRows;  // column 8j + 2t: k8 block j
            const float x0 = acc[4 * j + 2 * h], x1 = acc[4 * j + 2 * h + 1];
            uint32_t hi[2], lo[2] = {0u, 0u};
            flash::tf32_operand<kPrec>(x0, hi[0], lo[0]);
            flash::tf32_operand<kPrec>(x1, hi[1], lo[1]);
            *reinterpret_cast<uint2*>(plane + off) = uint2{hi[0], hi[1]};
            if constexpr (kPrec == 3) *reinterpret_cast<uint2*>(plane + lo_bytes + off) = uint2{lo[0], lo[1]};
            if constexpr (kRaw) *reinterpret_cast<float2*>(plane + raw_bytes + off) = float2{x0, x1};
        }
    (void)lo_bytes; (void)raw_bytes;
}

// The hi A fragments of every k8 step of rows 16w.. of a raw 32-byte-swizzle tile (kRows rows, kSteps·8
// columns): K_j, V_j, the A operands of S^T, dP^T for the whole block.
template <int kPrec, int kRows, int kSteps>
__device__ __forceinline__ void load_a_rows(uint32_t (&hi)[kSteps][4], const unsigned char* raw, int row0, int g,
                                            int t) {
#pragma unroll
    for (int ks = 0; ks < kSteps; ++ks)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float x = *reinterpret_cast<const float*>(
                raw + sw32_offset<kRows>(row0 + g + 8 * (i & 1), 8 * ks + t + 4 * (i >> 1)));
            uint32_t lo;
            flash::tf32_operand<1>(x, hi[ks][i], lo);
        }
}

// K_j^T's planes (kCols rows = dims, kRows columns = keys) from raw K_j (kRows keys x kCols dims, 32-byte
// swizzle): chunk (n, keys 4q .. 4q + 3) from four 32-bit loads down column n, one 16-byte store per plane.
template <int kPrec, int kRows, int kCols>
__device__ __forceinline__ void transpose_planes(unsigned char* planes, const unsigned char* raw, int tid) {
    constexpr int kChunks = kCols * kRows / 4;
#pragma unroll
    for (int idx = tid; idx < kChunks; idx += 256) {
        const int n = idx % kCols, q = idx / kCols;
        flash::Vec16<float> hi, lo;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            uint32_t h, l = 0;
            flash::tf32_operand<kPrec>(*reinterpret_cast<const float*>(raw + sw32_offset<kRows>(4 * q + j, n)), h, l);
            hi.v[j] = __uint_as_float(h);
            lo.v[j] = __uint_as_float(l);
        }
        const int off = sw32_offset<kCols>(n, 4 * q);
        *reinterpret_cast<flash::Vec16<float>*>(planes + off) = hi;
        if constexpr (kPrec == 3) *reinterpret_cast<flash::Vec16<float>*>(planes + kCols * kRows * 4 + off) = lo;
    }
}

// dK_j^T / dV_j^T (rows = dims, columns = keys; registers) times mult into dK / dV (rows = keys < n_rows, columns
// = dims < n_cols).
template <int kN>
__device__ __forceinline__ void store_transposed(float* gmem, long long row_stride, const float (&acc)[kN / 2],
                                                 float mult, int row0, int g, int t, int n_rows, int n_cols) {
#pragma unroll
    for (int j = 0; j < kN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int dim = row0 + g + 8 * (e >> 1), key = 8 * j + 2 * t + (e & 1);
            if (key < n_rows && dim < n_cols) fa::gstore(gmem + (long long)key * row_stride + dim, acc[4 * j + e] * mult);
        }
}

}  // namespace fa_bwd
using namespace fa_bwd;

// dK_j, dV_j and atomic dQ on wgmma: grid = (Tc, nb1 * nb2, nb0), 256 threads (two warpgroups); the argument
// list is flash_bwd_dkv_tf32_kernel's.
// kDQDim: the dQ accumulator's padded head dim (DQAccumLayout<kDQDim>), the call's padded D <= kHeadDim (the
// products run at d = 64 with Q_i, K_j zero-filled past D; columns of dQ at or past kDQDim are not added).
template <int kHeadDim, int kBlockM, int kBlockN, int kPrec, bool kIsCausal, bool kOrderedDQ, int kDQDim = kHeadDim>
__global__ void __launch_bounds__(256, 1) flash_bwd_dkv_sm90_tf32_kernel(
    const float* __restrict__ q, long long q_b0, long long q_b1, long long q_b2, long long q_g, long long q_row,
    const float* __restrict__ k, long long k_b0, long long k_b1, long long k_b2, long long k_row,
    const float* __restrict__ v, long long v_b0, long long v_b1, long long v_b2, long long v_row,
    const float* __restrict__ dout, long long do_b0, long long do_b1, long long do_b2, long long do_g, long long do_row,
    const float* __restrict__ lse, long long l_b0, long long l_b1, long long l_b2, long long l_g,
    const float* __restrict__ delta, long long d_b0, long long d_b1, long long d_b2, long long d_g,
    float* __restrict__ dq_accum, long long dqa_b0, long long dqa_b1, long long dqa_b2, long long dqa_g,
    long long dqa_row /* = kHeadDim (DQAccumLayout); unused */,
    float* __restrict__ dk, long long dk_b0, long long dk_b1, long long dk_b2, long long dk_row,
    float* __restrict__ dv, long long dv_b0, long long dv_b1, long long dv_b2, long long dv_row,
    int Lq, int Lk, int D, int Dv, int nb2, int n_group, float scale, FLASH_EXT_PARAMS(float)) {
    using Tr = Sm90Tf32BwdTraits<kHeadDim, kBlockM, kBlockN, kPrec>;
    static_assert(kDQDim % 16 == 0 && kDQDim <= kHeadDim, "the accumulator's head dim: padded D");
    using A = DQAccumLayout<kDQDim>;
    constexpr int kHalf = kHeadDim / 2;  // dQ columns per warpgroup
    (void)dqa_row;

    FA_DYNAMIC_SMEM(smem_raw);
    const int misalign = static_cast<int>(fa::wgmma_desc(smem_raw, 0, 0, fa::kWgmmaSwizzleNone) & 0x3f) * 16;
    unsigned char* smem = smem_raw + (Tr::kAtomBytes - misalign) % Tr::kAtomBytes;
    unsigned char* sQ = smem + Tr::kQ;
    unsigned char* sdO = smem + Tr::kdO;
    unsigned char* sKt = smem + Tr::kKt;
    unsigned char* sPt = smem + Tr::kPt;
    unsigned char* sdSt = smem + Tr::kdSt;
    float* lse2_s = reinterpret_cast<float*>(smem + Tr::kStats);
    float* delta_s = lse2_s + kBlockM;

    const int tid = (int)threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int wg = tid / 128, row0 = (warp % 4) * 16;  // the warp's first row of its warpgroup's m64 products
    const BatchIndex b = BatchIndex::from_grid(nb2);
    using Order = DQOrderOf<kIsCausal, kOrderedDQ, 0>;
    const Order dq_order = Order::make();
    const int c0 = dq_order.n * kBlockN;
    const float scale_log2 = scale * flash::kLog2e;
    const flash::ExtArgs<float> ext = FLASH_EXT_ARGS(float);
    const flash::Mask<kIsCausal, 0, float> mask(Lq, Lk, ext, b);
    const int i_begin = mask.m_block_min(c0, kBlockM);
    const int Tr_ = (Lq + kBlockM - 1) / kBlockM;
    const int n_visits = (Tr_ > i_begin ? Tr_ - i_begin : 0) * n_group;
    const DQOrderCounters<kBlockM, kDQDim> order{Lq};
    auto dqa_entry = [&](int grp) {
        return dq_accum + b.offset({dqa_b0, dqa_b1, dqa_b2, 0}) + (long long)grp * dqa_g;
    };
    auto load_query_block = [&](int grp, int i) {
        const int r0 = i * kBlockM;
        load_sw32<kBlockM, kHeadDim>(smem + Tr::kQRaw, q + b.offset({q_b0, q_b1, q_b2, q_row}) + (long long)grp * q_g +
                                                           (long long)r0 * q_row, q_row, Lq - r0, D, warp, lane);
        load_sw32<kBlockM, kHeadDim>(smem + Tr::kdORaw, dout + b.offset({do_b0, do_b1, do_b2, do_row}) +
                                                            (long long)grp * do_g + (long long)r0 * do_row,
                                     do_row, Lq - r0, Dv, warp, lane);
    };

    // -- prologue: K_j, V_j raw (over the P^T / dS^T planes); warpgroup 0 keeps K_j's A fragments, warpgroup 1
    //    V_j's, for the whole block; K_j^T's planes for dQ. The first visit's Q_i, dO_i in flight.
    uint32_t kv_hi[Tr::kKSteps][4];
    unsigned char* kv_lo = smem + Tr::kKVLo + wg * Tr::kKVLoPlane;  // warpgroup 0: K_j's, 1: V_j's (3xtf32)
    {
        unsigned char* k_raw = smem + Tr::kKVRaw;
        unsigned char* v_raw = k_raw + kBlockN * kHeadDim * 4;
        load_sw32<kBlockN, kHeadDim>(k_raw, k + b.offset({k_b0, k_b1, k_b2, k_row}) + (long long)c0 * k_row, k_row,
                                     Lk - c0, D, warp, lane);
        load_sw32<kBlockN, kHeadDim>(v_raw, v + b.offset({v_b0, v_b1, v_b2, v_row}) + (long long)c0 * v_row, v_row,
                                     Lk - c0, Dv, warp, lane);
        if (n_visits > 0) load_query_block(0, i_begin);
        fa::cp_async_commit();
        fa::cp_async_wait<0>();
        __syncthreads();
        load_a_rows<kPrec, kBlockN, Tr::kKSteps>(kv_hi, wg == 0 ? k_raw : v_raw, row0, g, t);
        if constexpr (kPrec == 3) {
            split_sw32<3, kBlockN, kHeadDim, true>(nullptr, smem + Tr::kKVLo, k_raw, warp, lane);
            split_sw32<3, kBlockN, kHeadDim, true>(nullptr, smem + Tr::kKVLo + Tr::kKVLoPlane, v_raw, warp, lane);
        }
        transpose_planes<kPrec, kBlockN, kHeadDim>(sKt, k_raw, tid);
        fa::fence_proxy_async();  // K_j^T's planes, the K_j / V_j lo planes → the wgmmas
        __syncthreads();          // every thread is done with the raw K_j, V_j (the P^T / dS^T planes reuse them)
    }

    float dkv[kBlockN / 2];  // warpgroup 0: dV_j^T, warpgroup 1: dK_j^T (rows = dims, columns = keys)
#pragma unroll
    for (int x = 0; x < kBlockN / 2; ++x) dkv[x] = 0.0f;

    int grp = 0, i = i_begin;
    for (int visit = 0; visit < n_visits; ++visit) {
        const int r0 = i * kBlockM;
        const bool wrap = i + 1 == Tr_;
        const int i_n = wrap ? i_begin : i + 1, grp_n = wrap ? grp + 1 : grp;
        fa::cp_async_wait<0>();  // this thread's copies of Q_i, dO_i
        // Barrier: every warpgroup is done with the previous visit (its planes, L_i, D_i).
        __syncthreads();
        split_sw32<kPrec, kBlockM, kHeadDim>(sQ, sQ + Tr::kQPlane, smem + Tr::kQRaw, warp, lane);
        split_sw32<kPrec, kBlockM, kHeadDim>(sdO, sdO + Tr::kQPlane, smem + Tr::kdORaw, warp, lane);
        load_row_stats_exp<kBlockM, 256>(lse2_s, delta_s, lse + b.offset({l_b0, l_b1, l_b2, 0}) + (long long)grp * l_g,
                                         delta + b.offset({d_b0, d_b1, d_b2, 0}) + (long long)grp * d_g, r0, Lq);
        fa::fence_proxy_async();
        // Barrier: Q_i's and dO_i's planes, L_i and D_i visible; the staging planes free for the next visit.
        __syncthreads();
        if (visit + 1 < n_visits) load_query_block(grp_n, i_n);
        fa::cp_async_commit();

        float sc[kBlockM / 2];  // warpgroup 0: S^T then P^T; warpgroup 1: dP^T then dS^T (rows = keys)
        if (wg == 0) {
            gemm_regs<kPrec, kBlockM, Tr::kKSteps, kBlockN, kBlockM>(sc, kv_hi, kv_lo, sQ, Tr::kQPlane);
#pragma unroll
            for (int j = 0; j < kBlockM / 8; ++j) {
                const float2 lse2 = *reinterpret_cast<const float2*>(lse2_s + 8 * j + 2 * t);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int qr = 8 * j + 2 * t + (e & 1), key = c0 + row0 + g + 8 * (e >> 1);
                    sc[4 * j + e] = p_from_score(sc[4 * j + e], scale_log2, e & 1 ? lse2.y : lse2.x,
                                                 mask.is_visible(r0 + qr, key));
                }
            }
            store_planes<kPrec, kBlockM, kBlockN, kPrec == 1>(sPt, Tr::kSPlane, Tr::kPRaw, sc, row0, g, t);
            fa::fence_proxy_async();
            fa::named_barrier_arrive(1, 256);  // P^T ready for warpgroup 1
            fa::named_barrier_sync(3, 128);    // ... and for this warpgroup's wgmmas
            float tmp[kBlockN / 2];            // dV_j^T += dO_i^T P: this visit's sum apart, added in fp32
            gemm_gathered<kPrec, kBlockN, Tr::kMSteps, kBlockM, kBlockN>(tmp, sdO, Tr::kQPlane, row0, sPt, Tr::kSPlane,
                                                                         0, g, t);
#pragma unroll
            for (int x = 0; x < kBlockN / 2; ++x) dkv[x] += tmp[x];
            fa::named_barrier_sync(2, 256);    // dS^T written
        } else {
            gemm_regs<kPrec, kBlockM, Tr::kKSteps, kBlockN, kBlockM>(sc, kv_hi, kv_lo, sdO, Tr::kQPlane);
            fa::named_barrier_sync(1, 256);    // P^T written
            const int base[2] = {sw32_offset<kBlockN>(row0 + g, 2 * t), sw32_offset<kBlockN>(row0 + g + 8, 2 * t)};
#pragma unroll
            for (int j = 0; j < kBlockM / 8; ++j) {
                const float2 dl = *reinterpret_cast<const float2*>(delta_s + 8 * j + 2 * t);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const unsigned char* at = sPt + base[h] + j * 32 * kBlockN;
                    float2 p = *reinterpret_cast<const float2*>(at + Tr::kPRaw);  // tf32: the raw plane
                    if constexpr (kPrec == 3) {  // hi + lo
                        const float2 lo = *reinterpret_cast<const float2*>(at + Tr::kSPlane);
                        p.x += lo.x, p.y += lo.y;
                    }
                    sc[4 * j + 2 * h] = p.x * (sc[4 * j + 2 * h] - dl.x);
                    sc[4 * j + 2 * h + 1] = p.y * (sc[4 * j + 2 * h + 1] - dl.y);
                }
            }
            store_planes<kPrec, kBlockM, kBlockN, false>(sdSt, Tr::kSPlane, 0, sc, row0, g, t);
            fa::fence_proxy_async();
            fa::named_barrier_arrive(2, 256);  // dS^T ready for warpgroup 0
            fa::named_barrier_sync(4, 128);    // ... and for this warpgroup's wgmmas
            float tmp[kBlockN / 2];            // dK_j^T += Q_i^T dS
            gemm_gathered<kPrec, kBlockN, Tr::kMSteps, kBlockM, kBlockN>(tmp, sQ, Tr::kQPlane, row0, sdSt, Tr::kSPlane,
                                                                         0, g, t);
#pragma unroll
            for (int x = 0; x < kBlockN / 2; ++x) dkv[x] += tmp[x];
        }
        // dQ_i's columns [wg · d/2, + d/2) = dS K_j: A = dS gathered from dS^T's planes, B = K_j^T's rows.
        float dq[kHalf / 2];
        gemm_gathered<kPrec, kHalf, Tr::kNSteps, kBlockN, kHeadDim>(dq, sdSt, Tr::kSPlane, row0, sKt, Tr::kKtPlane,
                                                                    wg * kHalf, g, t);
        float* dqa_i = dqa_entry(grp) + (long long)r0 * kDQDim;
        if constexpr (kOrderedDQ) fa::sem_wait(order.counter(dqa_entry(grp), i), dq_order.turn(i, kBlockM, kBlockN, mask));
#pragma unroll
        for (int j = 0; j < kHalf / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = wg * kHalf + 8 * j + 2 * t + (e & 1);
                if (kDQDim == kHeadDim || col < kDQDim)
                    fa::atomic_add(dqa_i + A::offset(row0 + g + 8 * (e >> 1), col), dq[4 * j + e]);
            }
        if constexpr (kOrderedDQ) fa::sem_post(order.counter(dqa_entry(grp), i));
        i = i_n, grp = grp_n;
    }
    fa::cp_async_wait<0>();

    // -- epilogue: dK_j = (dK_j^T)ᵀ · scale (warpgroup 1), dV_j (warpgroup 0); zeros where nothing was visited.
    if (wg == 0)
        store_transposed<kBlockN>(dv + b.offset({dv_b0, dv_b1, dv_b2, dv_row}) + (long long)c0 * dv_row, dv_row, dkv,
                                  1.0f, row0, g, t, Lk - c0, Dv);
    else
        store_transposed<kBlockN>(dk + b.offset({dk_b0, dk_b1, dk_b2, dk_row}) + (long long)c0 * dk_row, dk_row, dkv,
                                  scale, row0, g, t, Lk - c0, D);
}
