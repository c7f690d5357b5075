// flash_bwd_tf32.cu — FlashAttention-2 backward dK/dV (+ atomic dQ) for float32 inputs on TF32
// tensor cores (sm_80+), issue 12's precision="tf32" and precision="3xtf32".
//
// Same algorithm and work split as the fp16/bf16 dK/dV kernel (flash_bwd.cu, flash_bwd_dkv_kernel
// with kAtomicDQ and one warp per 16-key row tile): one block per (key block j, K/V batch entry);
// K_j, V_j resident in shared memory; the block walks the query blocks i (and the n_group query
// batch entries of an MQA/GQA group); P^T and dS^T are recomputed per block pair from the saved
// LSE; dK_j, dV_j accumulate in registers (warp w: keys 16w .. 16w + 15, every column; shared
// memory where max(d, dv) > 128); dQ_i += dS
// K_j by float atomics into the fragment-ordered accumulator (DQAccumLayout; the conversion pass
// applies the scale); kOrderedDQ adds them in key-block order (fa::sem_wait / fa::sem_post on
// DQOrderCounters, the rule of the long comment above flash_bwd_dkv_kernel): bitwise deterministic.
// Every product is mma.sync.m16n8k8 .tf32 (fp32 accumulate), operands as in flash_fwd_tf32.cu:
//
//   kPrec = 1 ("tf32"):   operands rounded to tf32 (cvt.rna), one mma per product;
//   kPrec = 3 ("3xtf32"): x = hi + lo (hi = cvt(x), lo = cvt(x − hi)), a·b ≈ a_lo·b_hi + a_hi·b_lo +
//                         a_hi·b_hi (small terms first): the dropped a_lo·b_lo is <= 2^-22 |a·b|.
//
//   S^T  = K_j Q_i^T      A = K_j (16 keys of the warp, ldmatrix)   B = Q_i stored N x K (ldmatrix)
//   dP^T = V_j dO_i^T     A = V_j                                    B = dO_i stored N x K
//   dV_j += P^T dO_i      A = P^T from registers (k permuted)        B = dO_i stored K x N (32-bit)
//   dK_j += dS^T Q_i      A = dS^T from registers (k permuted)       B = Q_i stored K x N (32-bit)
//   dQ_i += dS K_j        A = dS read from dS^T in smem (32-bit)     B = K_j stored K x N (32-bit)
//
// Fragments (m16n8k8 tf32; lane = 4 g + t): A a0 = A[g][t], a1 = A[g+8][t], a2 = A[g][t+4],
// a3 = A[g+8][t+4]; B b0 = B[t][g], b1 = B[t+4][g]; C c0, c1 = C[g][2t, 2t+1], c2, c3 = C[g+8][..].
// ldmatrix (.b16) on fp32 rows gives lane l word l % 4 of row l / 4 of each 8 x 4-float matrix,
// i.e. element (g, t): the A (row-major) and B (N x K) fragments of the first two products come
// from ldmatrix.x4 with 16-byte (4-float) row chunks. The k-permutation: lane (g, t) holds C
// columns 2t, 2t + 1 of each n8 tile, used as a0/a1 (mma k = t) and a2/a3 (mma k = t + 4), so the
// B rows must be 2t and 2t + 1: two 32-bit shared loads per B fragment. dQ uses the same permuted
// k on both operands (A: dS^T rows 2t, 2t + 1; B: K_j rows 2t, 2t + 1). With row pitches ≡ 4
// (mod 16) floats the 32 lanes of every such load, (2t · pitch + g) words apart, hit 32 distinct
// banks; the ldmatrix phases read 8 rows starting in 8 distinct 16-byte bank groups (pitch / 4
// odd).
//
// Conversion once where shared, never per mma: every tile copied to shared memory (K_j, V_j once;
// Q_i, dO_i per visit) is converted by the thread that copied each chunk, right after its
// cp.async wait (its own copies are visible to it; the barrier that publishes the tile publishes
// the converted values): tf32 in place; 3xtf32 with kLoPlanes = 1 hi in place + lo in a second
// plane; 3xtf32 with kLoPlanes = 0 (where the lo planes cost too much shared memory) kept raw and
// split in registers after each load; kLoPlanes = 2: Q_i, dO_i with lo planes, K_j, V_j and dS^T raw
// (LoPlanes: the A operands of S^T, dP^T and dQ, each split fragment feeding several mma; the
// planes' shared memory kept a second block off the SM). The split is the same cvt.rna pair either
// way, so the operands and the sums are the same bits. P^T, dS^T are split / converted in
// registers once per k8 step (a step's A fragment feeds dv/8 or d/8 n8 tiles); dS^T is stored to
// shared memory already converted (tf32), as hi/lo planes or raw (3xtf32, by LoPlanes).
//
// Shapes: d, dv (padded to multiples of 16, zero-filled past D, Dv) <= 256 (above 128 in either, and
// 3xtf32 at every d: dK_j, dV_j accumulate in shared memory, SmemAcc, not registers); Bc = 16 kNWarps;
// Br a multiple of 16. The FLASH_EXT_PARAMS tail is the fp16 kernel's argument list; kExt (the
// bits of flash_ext.cuh, 0 by default: the dense instantiations keep their names and code) turns
// on the extensions of docs/extensions.md exactly as flash_bwd_dkv_kernel does: the entry's
// lengths, window, block mask, softcap and ALiBi in the Mask, the query tiles of QueryTileWalk,
// one element's P and dS by ext_p_ds (softcap with the precise tanh, as flash_fwd_tf32.cu's
// forward that made L_i), dropout's keep bits by dropout_bits_t (S^T here is the fp16 kernel's
// C layout: m16n8k8's accumulator fragment is m16n8k16's, so the same Philox counter per element).
// The ordered dQ mode takes every kExt: its turns are dq_turn's (a window's first visitor of query block i is
// its left edge's key block; a block mask's holes take no turn).
// flasharray/_private/cuda_backward_tf32.py mirrors the shared-memory layout (Tf32BwdSmem) and
// chooses the tiles.
#include "flash_bwd_mma.cuh"  // load_tile_tc, zero_acc, store_acc, DQAccumLayout, DQOrderCounters, ...
#include "flash_ext.cuh"
#include "flash_bwd_ext.cuh"  // ext_p_ds, BwdDropout, dropout_bits_t, QueryTileWalk, MaskExt

namespace fa_bwd {

// Which tiles keep a lo plane (3xtf32): kLoPlanes 1 every tile, 2 Q_i and dO_i (K_j, V_j, dS^T raw), 0 none.
template <int kPrec, int kLoPlanes>
struct LoPlanes {
    static_assert(kLoPlanes >= 0 && kLoPlanes <= 2, "kLoPlanes: 0, 1 or 2");
    static constexpr bool kQ = kPrec == 3 && kLoPlanes != 0;   // Q_i, dO_i
    static constexpr bool kKV = kPrec == 3 && kLoPlanes == 1;  // K_j, V_j, dS^T
};

// Shared-memory layout in bytes (floats, rows padded by 4): Q_i, dO_i (kStages buffers), K_j, V_j,
// dS^T (Bc x Br), each 1 or 2 planes (3xtf32, LoPlanes: hi, then lo), then L_i log2 e and D_i.
template <int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN, int kPrec, int kLoPlanes, int kStages = 1>
struct Tf32BwdSmem {
    static_assert(kStages == 1 || kStages == 2, "one or two buffers of Q_i, dO_i");
    static constexpr int kPad = 4;
    static constexpr int kPitchD = kHeadDim + kPad, kPitchDv = kHeadDimV + kPad, kPitchS = kBlockM + kPad;
    static constexpr int kQPlanes = LoPlanes<kPrec, kLoPlanes>::kQ ? 2 : 1;   // Q_i, dO_i
    static constexpr int kKPlanes = LoPlanes<kPrec, kLoPlanes>::kKV ? 2 : 1;  // K_j, V_j, dS^T
    static constexpr int kQPlane = kBlockM * kPitchD;    // floats from a tile's hi plane to its lo plane
    static constexpr int kdOPlane = kBlockM * kPitchDv;
    static constexpr int kKPlane = kBlockN * kPitchD;
    static constexpr int kVPlane = kBlockN * kPitchDv;
    static constexpr int kSPlane = kBlockN * kPitchS;
    static constexpr int kQStage = kQPlanes * kQPlane;    // floats of one Q_i buffer (hi [, lo])
    static constexpr int kdOStage = kQPlanes * kdOPlane;
    static constexpr int kQ = 0;
    static constexpr int kdO = kQ + align16(kStages * kQStage * 4);
    static constexpr int kK = kdO + align16(kStages * kdOStage * 4);
    static constexpr int kV = kK + align16(kKPlanes * kKPlane * 4);
    static constexpr int kdS = kV + align16(kKPlanes * kVPlane * 4);
    static constexpr int kL = kdS + align16(kKPlanes * kSPlane * 4);
    static constexpr int kDelta = kL + align16(kBlockM * 4);
    // Wide head dims (max(d, dv) > 128) and 3xtf32: dK_j, dV_j in shared memory (SmemAcc), after D_i.
    static constexpr bool kAccSmem = kHeadDim > 128 || kHeadDimV > 128 || kPrec == 3;
    static constexpr int kAccK = kDelta + align16(kBlockM * 4);
    static constexpr int kAccV = kAccK + (kAccSmem ? kBlockN * kHeadDim * 4 : 0);
    static constexpr int kBytes = kAccV + (kAccSmem ? kBlockN * kHeadDimV * 4 : 0);
    static_assert(kPitchD % 16 == 4 || kPitchD % 16 == 12, "pitches: conflict-free 32-bit B loads");
    static_assert(kPitchS % 16 == 4 || kPitchS % 16 == 12, "dS^T pitch: conflict-free 32-bit A loads");
};

// ---- operands ------------------------------------------------------------------------------------

// x as the mma operand(s) of precision kPrec: hi = cvt.rna(x) and, 3xtf32, lo = cvt.rna(x − hi).
template <int kPrec>
__device__ __forceinline__ void tf32_op(float x, uint32_t& hi, uint32_t& lo) {
    if constexpr (kPrec == 3) {
        float h, l;
        fa::split_tf32(x, h, l);
        hi = __float_as_uint(h), lo = __float_as_uint(l);
    } else {
        hi = __float_as_uint(fa::cvt_tf32(x));
        (void)lo;
    }
}

// One 32-bit operand word from a converted tile in shared memory (p: hi plane; plane: floats to
// the lo plane). tf32: converted in place; 3xtf32: lo plane, or split here (raw tile).
template <int kPrec, bool kLoPlanes>
__device__ __forceinline__ void lds_op(const float* p, int plane, uint32_t& hi, uint32_t& lo) {
    if constexpr (kPrec == 3 && !kLoPlanes) {
        tf32_op<3>(p[0], hi, lo);
    } else {
        hi = __float_as_uint(p[0]);
        if constexpr (kPrec == 3) lo = __float_as_uint(p[plane]);
        else (void)lo;
    }
    (void)plane;
}

// An ldmatrix.x4 of operand words (four 8 x 4-float matrices) from such a tile.
template <int kPrec, bool kLoPlanes>
__device__ __forceinline__ void ldm_op(const float* p, int plane, uint32_t (&hi)[4], uint32_t (&lo)[4]) {
    fa::ldmatrix<4, false>(hi, p);
    if constexpr (kPrec == 3 && kLoPlanes) {
        fa::ldmatrix<4, false>(lo, p + plane);
    } else if constexpr (kPrec == 3) {
#pragma unroll
        for (int i = 0; i < 4; ++i) tf32_op<3>(__uint_as_float(hi[i]), hi[i], lo[i]);
    }
    (void)plane;
}

// D += A·B in precision kPrec (3xtf32: lo·hi + hi·lo + hi·hi, small terms first).
template <int kPrec>
__device__ __forceinline__ void mma_op(float (&d)[4], const uint32_t (&a_hi)[4], const uint32_t (&a_lo)[4],
                                       const uint32_t (&b_hi)[2], const uint32_t (&b_lo)[2]) {
    if constexpr (kPrec == 3) {
        const float c0[4] = {d[0], d[1], d[2], d[3]};
        fa::mma_m16n8k8_tf32(d, a_lo, b_hi, c0);
        const float c1[4] = {d[0], d[1], d[2], d[3]};
        fa::mma_m16n8k8_tf32(d, a_hi, b_lo, c1);
    } else {
        (void)a_lo, (void)b_lo;
    }
    const float c[4] = {d[0], d[1], d[2], d[3]};
    fa::mma_m16n8k8_tf32(d, a_hi, b_hi, c);
}

// One float in shared memory: hi in place (and lo at p + plane, 3xtf32).
template <int kPrec>
__device__ __forceinline__ void convert_word(float* p, int plane) {
    uint32_t h, l = 0;
    tf32_op<kPrec>(*p, h, l);
    *p = __uint_as_float(h);
    if constexpr (kPrec == 3) p[plane] = __uint_as_float(l);
    else (void)plane;
}

// In-place conversion of the 16-byte chunks this thread copied with load_tile_tf32 (the same
// index walk: idx = tid + it · kNThreads). No-op for the
// element-wise path (converted while loading) and for 3xtf32 without lo planes (raw tiles).
template <int kPrec, bool kLoPlanes, int kRows, int kCols, int kPitch, int kNThreads, bool kVec>
__device__ __forceinline__ void convert_tile(float* s, int plane) {
    if constexpr (kPrec == 3 && !kLoPlanes) {
        (void)s, (void)plane;
    } else {
        const int tid = (int)threadIdx.x;
        if constexpr (kVec) {
            constexpr int kUnitsPerRow = kCols / 4, kUnits = kRows * kUnitsPerRow;
            // Rolled: not in the products' way (unrolled, ptxas hoists these loads and stores
            // into the previous products' register pressure).
#pragma unroll 1
            for (int idx = tid; idx < kUnits; idx += kNThreads) {
                float* p = s + (idx / kUnitsPerRow) * kPitch + (idx % kUnitsPerRow) * 4;
#pragma unroll
                for (int e = 0; e < 4; ++e) convert_word<kPrec>(p + e, plane);
            }
        } else {
            (void)tid;  // element-wise tiles are converted as they are loaded (load_tile_tf32)
        }
    }
}

// A kRows x kCols tile into shared memory (pitch kPitch; zero past n_rows, n_cols): kVec: cp.async
// 16-byte chunks (converted after the wait by convert_tile); else element loads,
// converted on the way (tf32 / hi + lo planes / raw), one rolled loop.
template <int kPrec, bool kLoPlanes, int kRows, int kCols, int kPitch, int kNThreads, bool kVec>
__device__ __forceinline__ void load_tile_tf32(float* s, int plane, const float* gmem, long long row_stride,
                                               int n_rows, int n_cols) {
    if constexpr (kVec) {
        // As load_tile_tc's chunks (idx = tid + it · kNThreads), rolled: per-chunk 64-bit
        // addresses unrolled next to the products cost registers the products need.
        constexpr int kUnitsPerRow = kCols / 4;
#pragma unroll 1
        for (int idx = (int)threadIdx.x; idx < kRows * kUnitsPerRow; idx += kNThreads) {
            const int r = idx / kUnitsPerRow, c = (idx % kUnitsPerRow) * 4;
            const bool in = r < n_rows && c < n_cols;
            // Out-of-range chunks copy 0 bytes (zero fill) from the tile origin, never read.
            fa::cp_async<16>(s + r * kPitch + c, in ? gmem + (long long)r * row_stride + c : gmem, in ? 16 : 0);
        }
        (void)plane;
    } else {
#pragma unroll 1
        for (int e = (int)threadIdx.x; e < kRows * kCols; e += kNThreads) {
            const int r = e / kCols, c = e % kCols;
            float* p = s + r * kPitch + c;
            *p = (r < n_rows && c < n_cols) ? fa::gload(gmem + (long long)r * row_stride + c) : 0.0f;
            if constexpr (kPrec == 1 || kLoPlanes) convert_word<kPrec>(p, plane);
            else (void)plane;
        }
    }
}

// ---- warp products -----------------------------------------------------------------------------

// acc (16 x kN) += A (16 x kK, row-major at A_s) · B^T (B stored kN rows x kK at B_s): ldmatrix
// for both; per k8 step one A fragment, then the kN/16 pairs of n8 tiles. kALo, kBLo: the operands'
// tiles have lo planes (3xtf32; else split after the load).
template <int kPrec, bool kALo, bool kBLo, int kK, int kN>
__device__ __forceinline__ void mma_nk(float (&acc)[kN / 8][4], const float* A_s, int a_pitch, int a_plane,
                                       const float* B_s, int b_pitch, int b_plane) {
    const int lane = (int)threadIdx.x % 32;
    const float* A_l = A_s + (lane % 16) * a_pitch + (lane / 16) * 4;
    const float* B_l = B_s + ((lane / 16) * 8 + lane % 8) * b_pitch + ((lane / 8) % 2) * 4;
    auto steps = [&](float (&c)[kN / 8][4], int ks0, int ks1) {
#pragma unroll
        for (int ks = ks0; ks < ks1; ++ks) {
            uint32_t a_hi[4], a_lo[4] = {};
            ldm_op<kPrec, kALo>(A_l + ks * 8, a_plane, a_hi, a_lo);
#pragma unroll
            for (int np = 0; np < kN / 16; ++np) {
                uint32_t b_hi[4], b_lo[4] = {};  // n8 tiles 2np (0, 1) and 2np + 1 (2, 3)
                ldm_op<kPrec, kBLo>(B_l + np * 16 * b_pitch + ks * 8, b_plane, b_hi, b_lo);
                const uint32_t bh0[2] = {b_hi[0], b_hi[1]}, bh1[2] = {b_hi[2], b_hi[3]};
                const uint32_t bl0[2] = {b_lo[0], b_lo[1]}, bl1[2] = {b_lo[2], b_lo[3]};
                mma_op<kPrec>(c[2 * np], a_hi, a_lo, bh0, bl0);
                mma_op<kPrec>(c[2 * np + 1], a_hi, a_lo, bh1, bl1);
            }
        }
    };
    // 3xtf32: Sᵀ, dPᵀ in partial sums of kChunk k8 steps, each in a zeroed fragment added in fp32 (the tensor cores
    // truncate their sums: over d = 256 inside the mma the gradients were 2-3x the float32 rule's bound under the
    // emulator's model of it, at d 64 / 128 up to 1.4x the test file's). 4 steps up to k = 128 (7 at d 112), 8 above
    // (10 at d 160 and 240, 6 at d 144): the chunk sizes the spill audit left without spills.
    constexpr int kSteps = kK / 8;
    constexpr int kChunk = kPrec != 3 ? kSteps
                           : kK <= 128 ? (kSteps % 4 != 0 && kSteps % 7 == 0 ? 7 : 4)
                           : kSteps % 8 == 0 ? 8 : kSteps % 10 == 0 ? 10 : kSteps % 6 == 0 ? 6 : 8;
    if constexpr (kChunk >= kSteps) {
        steps(acc, 0, kSteps);
    } else {
#pragma unroll
        for (int kc = 0; kc < kSteps; kc += kChunk) {
            float part[kN / 8][4];
            zero_acc(part);
            steps(part, kc, kc + kChunk < kSteps ? kc + kChunk : kSteps);
#pragma unroll
            for (int n = 0; n < kN / 8; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[n][i] += part[n][i];
        }
    }
}

// acc (16 x kN) += C (16 x kK, a C-layout accumulator in registers, as A with k permuted) · B
// (stored kK x kN at B_s: rows 2t, 2t + 1 of each k8 step, 32-bit loads).
template <int kPrec, bool kLoPlanes, int kK, int kN>
__device__ __forceinline__ void mma_rk(float (&acc)[kN / 8][4], const float (&c)[kK / 8][4], const float* B_s,
                                       int b_pitch, int b_plane) {
    const int lane = (int)threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const float* B_l = B_s + 2 * t * b_pitch + g;
#pragma unroll
    for (int ks = 0; ks < kK / 8; ++ks) {
        uint32_t a_hi[4], a_lo[4] = {};
        const float a[4] = {c[ks][0], c[ks][2], c[ks][1], c[ks][3]};  // (g, 2t), (g+8, 2t), (g, 2t+1), (g+8, 2t+1)
#pragma unroll
        for (int i = 0; i < 4; ++i) tf32_op<kPrec>(a[i], a_hi[i], a_lo[i]);
#pragma unroll
        for (int nt = 0; nt < kN / 8; ++nt) {
            const float* b = B_l + ks * 8 * b_pitch + nt * 8;
            uint32_t b_hi[2], b_lo[2] = {};
            lds_op<kPrec, kLoPlanes>(b, b_plane, b_hi[0], b_lo[0]);
            lds_op<kPrec, kLoPlanes>(b + b_pitch, b_plane, b_hi[1], b_lo[1]);
            mma_op<kPrec>(acc[nt], a_hi, a_lo, b_hi, b_lo);
        }
    }
}

// ---- dK_j, dV_j accumulators ---------------------------------------------------------------------
//
// tf32, d, dv <= 128: registers (float[k/8][4], C fragments of the warp's 16 rows). Wide head dims
// (max(d, dv) > 128: (d + dv) / 2 accumulator floats per thread do not fit next to the strips) and
// 3xtf32 at every head dim: shared memory, as the f64 DMMA backward keeps dV_j (flash_bwd_f64.cu) —
// a SmemAcc: the warp's 16 x kN floats in C-fragment order, lane l's float4 of n8 tile nt at
// (nt · 32 + l) · 4, so only the owning lane ever touches its words (no barrier; 128-bit accesses,
// conflict-free) and each product reads and writes an n8 tile once per visit (all Br/8 k-steps in
// between). 3xtf32 sums a visit's k-steps in a zeroed fragment, added to the running sum in fp32:
// the tensor cores truncate their sums (docs/precision.md, *Default*), so a running sum kept inside
// the mma across every query tile drifts by an ulp of itself per mma, growing with Lq; 3xtf32's
// dK, dV failed the float32 rule that way on an H200 (N 512-4096) in registers.
template <int kN>
struct SmemAcc {
    float* p;  // this lane's first float4
};
template <bool kSmem, int kN>
struct AccOf {
    using type = float[kN / 8][4];
};
template <int kN>
struct AccOf<true, kN> {
    using type = SmemAcc<kN>;
};

template <int kN>
__device__ __forceinline__ void acc_init(float (&acc)[kN / 8][4], unsigned char*) {
    zero_acc(acc);
}
template <int kN>
__device__ __forceinline__ void acc_init(SmemAcc<kN>& acc, unsigned char* base) {
    acc.p = reinterpret_cast<float*>(base) + ((int)threadIdx.x / 32) * 16 * kN + ((int)threadIdx.x % 32) * 4;
#pragma unroll 1
    for (int nt = 0; nt < kN / 8; ++nt) *reinterpret_cast<float4*>(acc.p + nt * 128) = float4{0.f, 0.f, 0.f, 0.f};
}

template <int kN>
__device__ __forceinline__ void acc_store(float* gmem, long long row_stride, const float (&acc)[kN / 8][4], float mult,
                                          int n_rows, int n_cols) {
    store_acc<float>(gmem, row_stride, acc, mult, n_rows, n_cols);
}
template <int kN>
__device__ __forceinline__ void acc_store(float* gmem, long long row_stride, const SmemAcc<kN>& acc, float mult,
                                          int n_rows, int n_cols) {
    const int lane = (int)threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll 1
    for (int n = 0; n < kN / 8; ++n) {
        const float4 v = *reinterpret_cast<const float4*>(acc.p + n * 128);
        const float a[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = g + (e / 2) * 8, c = n * 8 + 2 * t + (e % 2);
            if (r < n_rows && c < n_cols) fa::gstore(gmem + (long long)r * row_stride + c, a[e] * mult);
        }
    }
}

// acc += C · B (mma_rk) into registers, or into a SmemAcc: the Br/8 A fragments converted once,
// then per n8 tile one 128-bit load, the k-steps, one 128-bit store (3xtf32: the k-steps into a
// zeroed fragment, then the load and 4 FADD).
template <int kPrec, bool kLoPlanes, int kK, int kN>
__device__ __forceinline__ void acc_rk(float (&acc)[kN / 8][4], const float (&c)[kK / 8][4], const float* B_s,
                                       int b_pitch, int b_plane) {
    mma_rk<kPrec, kLoPlanes, kK, kN>(acc, c, B_s, b_pitch, b_plane);
}
template <int kPrec, bool kLoPlanes, int kK, int kN>
__device__ __forceinline__ void acc_rk(SmemAcc<kN>& acc, const float (&c)[kK / 8][4], const float* B_s, int b_pitch,
                                       int b_plane) {
    const int lane = (int)threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const float* B_l = B_s + 2 * t * b_pitch + g;
    uint32_t a_hi[kK / 8][4], a_lo[kK / 8][4] = {};
#pragma unroll
    for (int ks = 0; ks < kK / 8; ++ks) {
        const float a[4] = {c[ks][0], c[ks][2], c[ks][1], c[ks][3]};
#pragma unroll
        for (int i = 0; i < 4; ++i) tf32_op<kPrec>(a[i], a_hi[ks][i], a_lo[ks][i]);
    }
#pragma unroll
    for (int nt = 0; nt < kN / 8; ++nt) {
        float4* p = reinterpret_cast<float4*>(acc.p + nt * 128);
        // 3xtf32: a zeroed fragment, added after (above); tf32 (its own, looser bound) sums in place.
        constexpr bool kFlush = kPrec == 3;
        float4 v = kFlush ? float4{0.f, 0.f, 0.f, 0.f} : *p;
        float d[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int ks = 0; ks < kK / 8; ++ks) {
            const float* b = B_l + ks * 8 * b_pitch + nt * 8;
            uint32_t b_hi[2], b_lo[2] = {};
            lds_op<kPrec, kLoPlanes>(b, b_plane, b_hi[0], b_lo[0]);
            lds_op<kPrec, kLoPlanes>(b + b_pitch, b_plane, b_hi[1], b_lo[1]);
            mma_op<kPrec>(d, a_hi[ks], a_lo[ks], b_hi, b_lo);
        }
        if (kFlush) {
            v = *p;
            d[0] += v.x, d[1] += v.y, d[2] += v.z, d[3] += v.w;
        }
        *p = float4{d[0], d[1], d[2], d[3]};
    }
}

// ---- per block pair ------------------------------------------------------------------------------

// The warp's strip: keys 16 w .. 16 w + 15 (rows) x the Br queries (columns) of S^T = K_j Q_i^T and
// dP^T = V_j dO_i^T, then P^T = exp2(S^T scale log2 e − L_i log2 e) into s and dS^T = P^T ∘ (dP^T −
// D_i) into dp (L_i, D_i per column). Extensions (the Mask's kExt): P^T ∘ Z and dS^T of ext_p_ds.
template <class L, int kPrec, int kLoPlanes, int kHeadDim, int kHeadDimV, int kBlockM, class M, class Drop>
__device__ __forceinline__ void tf32_dkv_scores(float (&s)[kBlockM / 8][4], float (&dp)[kBlockM / 8][4],
                                                const float* K_w, const float* V_w, const float* Q_s,
                                                const float* dO_s, const float* lse2_s, const float* delta_s,
                                                float scale_log2, const M& mask, const Drop& drop, int r0, int c_w) {
    const int lane = (int)threadIdx.x % 32, g = lane / 4, t = lane % 4;
    zero_acc(s);
    zero_acc(dp);
    using Lo = LoPlanes<kPrec, kLoPlanes>;
    mma_nk<kPrec, Lo::kKV, Lo::kQ, kHeadDim, kBlockM>(s, K_w, L::kPitchD, L::kKPlane, Q_s, L::kPitchD, L::kQPlane);
    mma_nk<kPrec, Lo::kKV, Lo::kQ, kHeadDimV, kBlockM>(dp, V_w, L::kPitchDv, L::kVPlane, dO_s, L::kPitchDv,
                                                       L::kdOPlane);
    constexpr bool kDropout = flash::HasExt<MaskExt<M>::value, flash::kExtDropout>::value;
    uint32_t keep[kBlockM / 8];  // dropout's keep bits per n8 tile (keys c_w.., queries r0..)
    if constexpr (kDropout) dropout_bits_t<kBlockM>(keep, drop.rng, r0, c_w, lane);
    (void)drop; (void)keep;
    const auto& geo = geometry_of(mask);  // a block mask: looked up once per n8 tile (flash_bwd.cu's dkv_scores)
#pragma unroll
    for (int nt = 0; nt < kBlockM / 8; ++nt) {
        const int r = nt * 8 + 2 * t;  // this lane's query columns r, r + 1 (r even: 8-byte loads)
        const float2 lse2 = *reinterpret_cast<const float2*>(lse2_s + r);
        const float2 delta_r = *reinterpret_cast<const float2*>(delta_s + r);
        const bool in_block = mask.block_visible(r0 + 16 * (nt / 2), c_w);  // 16 keys by 16 queries: one block
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int c = c_w + g + (e / 2) * 8;  // key (row of S^T)
            if constexpr (MaskExt<M>::value == 0) {
                const float p = p_from_score(s[nt][e], scale_log2, e % 2 ? lse2.y : lse2.x,
                                             mask.is_visible(r0 + r + e % 2, c));
                dp[nt][e] = p * (dp[nt][e] - (e % 2 ? delta_r.y : delta_r.x));  // dS^T, from the unrounded P^T
                s[nt][e] = p;
            } else {
                float z = 1.0f;  // dropout's Z = keep / (1 − p)
                if constexpr (kDropout) z = (keep[nt] >> e) & 1u ? drop.scale : 0.0f;
                ext_p_ds(s[nt][e], dp[nt][e], e % 2 ? lse2.y : lse2.x, e % 2 ? delta_r.y : delta_r.x, z,
                         scale_log2, geo, r0 + r + e % 2, c, in_block);
            }
        }
    }
}

// The warp's 16 rows of dS^T into shared memory (Bc x Br, row pitch kPitchS) as dQ's operand:
// tf32-converted, hi/lo planes or raw (3xtf32, LoPlanes::kKV).
template <class L, int kPrec, int kLoPlanes, int kBlockM>
__device__ __forceinline__ void store_dst(float* dSt_w, const float (&ds)[kBlockM / 8][4]) {
    const int lane = (int)threadIdx.x % 32, g = lane / 4, t = lane % 4;
    float* s_l = dSt_w + g * L::kPitchS + 2 * t;
#pragma unroll
    for (int nt = 0; nt < kBlockM / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float* p = s_l + (e / 2) * 8 * L::kPitchS + nt * 8 + e % 2;
            if constexpr (kPrec == 3 && !LoPlanes<kPrec, kLoPlanes>::kKV) {
                *p = ds[nt][e];
            } else {
                uint32_t h, l = 0;
                tf32_op<kPrec>(ds[nt][e], h, l);
                p[0] = __uint_as_float(h);
                if constexpr (kPrec == 3) p[L::kSPlane] = __uint_as_float(l);
            }
        }
}

// Tile `it` of the calling warp when tiles (tm, tn), tn < kCols, are dealt round-robin to kNWarps
// warps (flash_bwd.cu's warp_tile: the part that depends on `it` is a constant).
template <int kNWarps, int kCols>
__device__ __forceinline__ void tf32_warp_tile(int warp, int it, int& tm, int& tn) {
    if constexpr (kNWarps % kCols == 0) {
        tm = warp / kCols + it * (kNWarps / kCols), tn = warp % kCols;
    } else if constexpr (kCols % kNWarps == 0) {
        tm = it / (kCols / kNWarps), tn = it % (kCols / kNWarps) * kNWarps + warp;
    } else {
        tm = (warp + it * kNWarps) / kCols, tn = (warp + it * kNWarps) % kCols;
    }
}

// dQ_i += dS K_j into query block i's float accumulator (DQAccumLayout: 16 x kDQCols tiles dealt
// round-robin to the warps, each warp-wide atomic 32 consecutive floats). A = dS read from dS^T
// (rows 2t, 2t + 1 of each k8 step: the permuted k), B = K_j rows 2t, 2t + 1. Unscaled.
template <class L, int kPrec, int kLoPlanes, int kHeadDim, int kBlockM, int kBlockN, int kNWarps>
__device__ __forceinline__ void tf32_atomic_dq(float* dqa_i, const float* dSt_s, const float* K_s) {
    using A = DQAccumLayout<kHeadDim>;
    constexpr bool kLo = LoPlanes<kPrec, kLoPlanes>::kKV;  // dS^T, K_j
    constexpr int kDQCols = A::kDQCols;
    constexpr int kDQTiles = (kBlockM / 16) * A::kColTiles;
    const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32, g = lane / 4, t = lane % 4;
    float* dst = dqa_i + warp * A::kTileFloats + lane;
    const float* A_l = dSt_s + 2 * t * L::kPitchS + g;
    const float* B_l = K_s + 2 * t * L::kPitchD + g;
    // Rounds of tiles rolled (no register array depends on `it`): unrolled, ptxas overlaps two
    // rounds' fragments and accumulators past 255 registers (3xtf32, d = 128, 2 warps).
#pragma unroll 1
    for (int it = 0; it < ceil_div_c(kDQTiles, kNWarps); ++it) {
        if (kDQTiles % kNWarps != 0 && warp + it * kNWarps >= kDQTiles) break;
        int tm, tn;
        tf32_warp_tile<kNWarps, A::kColTiles>(warp, it, tm, tn);
        float dq[kDQCols / 8][4];
        zero_acc(dq);
        const float* a_t = A_l + tm * 16;
        const float* b_t = B_l + tn * kDQCols;
#pragma unroll
        for (int ks = 0; ks < kBlockN / 8; ++ks) {
            const float* a = a_t + ks * 8 * L::kPitchS;
            uint32_t a_hi[4], a_lo[4] = {};
            lds_op<kPrec, kLo>(a, L::kSPlane, a_hi[0], a_lo[0]);                // (g, key 2t)
            lds_op<kPrec, kLo>(a + 8, L::kSPlane, a_hi[1], a_lo[1]);            // (g + 8, key 2t)
            lds_op<kPrec, kLo>(a + L::kPitchS, L::kSPlane, a_hi[2], a_lo[2]);   // (g, key 2t + 1)
            lds_op<kPrec, kLo>(a + L::kPitchS + 8, L::kSPlane, a_hi[3], a_lo[3]);
#pragma unroll
            for (int n = 0; n < kDQCols / 8; ++n) {
                const float* b = b_t + ks * 8 * L::kPitchD + n * 8;
                uint32_t b_hi[2], b_lo[2] = {};
                lds_op<kPrec, kLo>(b, L::kKPlane, b_hi[0], b_lo[0]);
                lds_op<kPrec, kLo>(b + L::kPitchD, L::kKPlane, b_hi[1], b_lo[1]);
                mma_op<kPrec>(dq[n], a_hi, a_lo, b_hi, b_lo);
            }
        }
#pragma unroll
        for (int n = 0; n < kDQCols / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                fa::atomic_add(dst + it * kNWarps * A::kTileFloats + (n * 4 + e) * 32, dq[n][e]);
    }
}

// One block pair (query block i, key block j) for the calling warp (keys 16 w..), Q_i, dO_i, L_i,
// D_i in shared memory and visible to every warp: the scores, then dV_j += P^T dO_i (P^T dies),
// dS^T to shared memory, dQ_i += dS K_j by atomics into dqa_i (ordered: waiting for `counter` to
// reach this block's turn `turn.expected` (dq_turn), posting turn.add after), then dK_j += dS^T Q_i (the scale of
// dK applied once, at the end). This order keeps every instantiation under 255 registers without spills (measured:
// dK before dQ spilled 8-24 bytes in two 3xtf32 cp.async + plain-atomic variants).
template <class L, int kPrec, int kLoPlanes, int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN, int kNWarps,
          bool kOrderedDQ, class M, class Drop, class AccK, class AccV>
__device__ __forceinline__ void dkv_visit(AccK& dK_acc, AccV& dV_acc,
                                          const float* K_s, const float* V_s, const float* Q_s, const float* dO_s,
                                          float* dSt_s, const float* lse2_s, const float* delta_s, float* dqa_i,
                                          int* counter, DQTurn turn, float scale_log2, const M& mask, const Drop& drop,
                                          int r0, int c0) {
    const int warp = (int)threadIdx.x / 32;
    float s[kBlockM / 8][4], ds[kBlockM / 8][4];  // P^T, dS^T of the warp's 16 keys (C layout)
    tf32_dkv_scores<L, kPrec, kLoPlanes, kHeadDim, kHeadDimV, kBlockM>(
        s, ds, K_s + warp * 16 * L::kPitchD, V_s + warp * 16 * L::kPitchDv, Q_s, dO_s, lse2_s, delta_s,
        scale_log2, mask, drop, r0, c0 + warp * 16);
    constexpr bool kQLo = LoPlanes<kPrec, kLoPlanes>::kQ;
    acc_rk<kPrec, kQLo, kBlockM, kHeadDimV>(dV_acc, s, dO_s, L::kPitchDv, L::kdOPlane);
    store_dst<L, kPrec, kLoPlanes, kBlockM>(dSt_s + warp * 16 * L::kPitchS, ds);
    // Barrier: dS^T complete before warps read its columns for dQ (ordered: and our turn).
    if constexpr (kOrderedDQ)
        fa::sem_wait(counter, turn.expected);
    else
        __syncthreads();
    tf32_atomic_dq<L, kPrec, kLoPlanes, kHeadDim, kBlockM, kBlockN, kNWarps>(dqa_i, dSt_s, K_s);
    if constexpr (kOrderedDQ) fa::sem_post(counter, turn.add);
    else (void)counter;
    acc_rk<kPrec, kQLo, kBlockM, kHeadDim>(dK_acc, ds, Q_s, L::kPitchD, L::kQPlane);
}

}  // namespace fa_bwd
using namespace fa_bwd;

// ---------------------------------------------------------------------------------------------
// dK_j, dV_j and atomic dQ: grid = (Tc, nb1 * nb2, nb0), kNWarps = Bc / 16 warps (warp w: keys
// 16 w..); n_group query batch entries share K_j, V_j (group strides on the query-side tensors).
// The argument list is flash_bwd_dkv_kernel's with T = OutT = float.
template <int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN, int kNWarps, int kPrec, bool kIsCausal,
          bool kVecLoad, bool kOrderedDQ, int kLoPlanes = 1, int kStages = 1, int kExt = 0>
__global__ void __launch_bounds__(kNWarps * 32, kMinBlocksPerSm) flash_bwd_dkv_tf32_kernel(
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
    constexpr int kNThreads = kNWarps * 32;
    static_assert(kPrec == 1 || kPrec == 3, "kPrec: 1 (tf32) or 3 (3xtf32)");
    static_assert(kBlockN == 16 * kNWarps, "one warp per 16-key row tile of dK_j, dV_j");
    static_assert(kBlockM % 16 == 0, "Br: whole n16 pairs (ldmatrix.x4 of Q_i, dO_i)");
    static_assert(kHeadDim % 16 == 0 && kHeadDimV % 16 == 0 && kHeadDim <= 256 && kHeadDimV <= 256,
                  "d, dv: multiples of 16, at most 256 (above 128: dK_j, dV_j in shared memory)");
    using L = Tf32BwdSmem<kHeadDim, kHeadDimV, kBlockM, kBlockN, kPrec, kLoPlanes, kStages>;
    using Lo = LoPlanes<kPrec, kLoPlanes>;
    (void)dqa_row;

    FA_DYNAMIC_SMEM(smem);
    float* Q_buf = reinterpret_cast<float*>(smem + L::kQ);        // Q_i   Br x d   [hi, lo] x kStages
    float* dO_buf = reinterpret_cast<float*>(smem + L::kdO);      // dO_i  Br x dv  [hi, lo] x kStages
    float* K_s = reinterpret_cast<float*>(smem + L::kK);          // K_j   Bc x d   [hi, lo]
    float* V_s = reinterpret_cast<float*>(smem + L::kV);          // V_j   Bc x dv  [hi, lo]
    float* dSt_s = reinterpret_cast<float*>(smem + L::kdS);       // dS^T  Bc x Br  [hi, lo]
    float* lse2_s = reinterpret_cast<float*>(smem + L::kL);       // L_i log2 e     Br
    float* delta_s = reinterpret_cast<float*>(smem + L::kDelta);  // D_i            Br

    const BatchIndex b = BatchIndex::from_grid(nb2);
    const int warp = (int)threadIdx.x / 32;
    // The key block: blockIdx.x, or in the ordered causal mode Tc - 1 - blockIdx.x (DQOrder).
    using Order = DQOrderOf<kIsCausal, kOrderedDQ, kExt>;
    const Order dq_order = Order::make();
    const int c0 = dq_order.n * kBlockN;       // first key of K_j
    const int c_w = c0 + warp * 16;            // first key of this warp's rows
    const float scale_log2 = scale * flash::kLog2e;
    // Extensions: the entry's lengths Lq_b, Lk_b (rows / keys past them are zero-filled, never read;
    // their gradients are written as zeros), window, block mask, softcap, ALiBi, dropout. Without
    // them (kExt = 0) Lq_b = Lq, Lk_b = Lk and the mask is the dense one (Mask(Lq, Lk, ...) sets
    // only the lengths). Spelled so that kExt = 0 compiles to the SASS it had before the extensions:
    // make_mask and the seqlen calls there changed the ordered-dQ instantiations.
    const flash::ExtArgs<float> ext = FLASH_EXT_ARGS(float);
    const int Lq_b = kExt == 0 ? Lq : ext.template seqlen_q<kExt>(b, Lq);
    const int Lk_b = kExt == 0 ? Lk : ext.template seqlen_k<kExt>(b, Lk);
    const flash::Mask<kIsCausal, kExt, float> mask(Lq_b, Lk_b, ext, b);
    const auto drop = BwdDropout<flash::HasExt<kExt, flash::kExtDropout>::value, float>::make(ext, b);
    const QueryTileWalk<decltype(mask)> walk{mask, c0, kBlockM, kBlockN};

    // Visits (grp, i): i from i_begin (causal: blocks above the diagonal skipped) to Tr − 1, grp outer.
    // With extensions (launched with n_group = 1): the tiles of QueryTileWalk.
    int i_begin = mask.m_block_min(c0, kBlockM);
    int Tr = (Lq + kBlockM - 1) / kBlockM;
    if constexpr (kExt != 0) {
        Tr = walk.end();
        i_begin = walk.next(i_begin - 1, Tr);
    }
    const int blocks_per_entry = kExt != 0 ? walk.count(i_begin, Tr) : (Tr > i_begin ? Tr - i_begin : 0);
    const int n_visits = blocks_per_entry * n_group;
    const DQOrderCounters<kBlockM, kHeadDim> order{Lq};
    auto dqa_entry = [&](int grp) {
        return dq_accum + b.offset({dqa_b0, dqa_b1, dqa_b2, 0}) + (long long)grp * dqa_g;
    };

    // -- prologue: K_j, V_j into shared memory, converted by the copying threads.
    load_tile_tf32<kPrec, Lo::kKV, kBlockN, kHeadDim, L::kPitchD, kNThreads, kVecLoad>(
        K_s, L::kKPlane, k + b.offset({k_b0, k_b1, k_b2, k_row}) + (long long)c0 * k_row, k_row, Lk_b - c0, D);
    load_tile_tf32<kPrec, Lo::kKV, kBlockN, kHeadDimV, L::kPitchDv, kNThreads, kVecLoad>(
        V_s, L::kVPlane, v + b.offset({v_b0, v_b1, v_b2, v_row}) + (long long)c0 * v_row, v_row, Lk_b - c0, Dv);
    // Start the copies of query block i of group entry grp into buffer `buf` (cp.async, or loads
    // converted on the way).
    auto load_query_block = [&](int grp, int i, int buf) {
        const int r0 = i * kBlockM;
        load_tile_tf32<kPrec, Lo::kQ, kBlockM, kHeadDim, L::kPitchD, kNThreads, kVecLoad>(
            Q_buf + buf * L::kQStage, L::kQPlane,
            q + b.offset({q_b0, q_b1, q_b2, q_row}) + (long long)grp * q_g + (long long)r0 * q_row, q_row, Lq_b - r0, D);
        load_tile_tf32<kPrec, Lo::kQ, kBlockM, kHeadDimV, L::kPitchDv, kNThreads, kVecLoad>(
            dO_buf + buf * L::kdOStage, L::kdOPlane,
            dout + b.offset({do_b0, do_b1, do_b2, do_row}) + (long long)grp * do_g + (long long)r0 * do_row, do_row,
            Lq_b - r0, Dv);
    };
    fa::cp_async_commit();
    if (kStages == 2 && n_visits > 0) load_query_block(0, i_begin, 0);  // the first visit's, in flight
    fa::cp_async_commit();
    fa::cp_async_wait<1>();  // K_j, V_j (this thread's copies)
    convert_tile<kPrec, Lo::kKV, kBlockN, kHeadDim, L::kPitchD, kNThreads, kVecLoad>(K_s, L::kKPlane);
    convert_tile<kPrec, Lo::kKV, kBlockN, kHeadDimV, L::kPitchDv, kNThreads, kVecLoad>(V_s, L::kVPlane);

    // dK_j rows c_w.., every column, and dV_j: registers, or shared memory (L::kAccSmem).
    typename AccOf<L::kAccSmem, kHeadDim>::type dK_acc;
    typename AccOf<L::kAccSmem, kHeadDimV>::type dV_acc;
    acc_init<kHeadDim>(dK_acc, smem + L::kAccK);
    acc_init<kHeadDimV>(dV_acc, smem + L::kAccV);

    // Visit (grp, i) and the next one (grp_n, i_n), stepped without divisions.
    int grp = 0, i = i_begin;
    for (int visit = 0; visit < n_visits; ++visit) {
        const int r0 = i * kBlockM;
        const bool wrap = i + 1 == Tr;
        int i_n = wrap ? i_begin : i + 1, grp_n = wrap ? grp + 1 : grp;
        if constexpr (flash::HasExt<kExt, flash::kExtBlockMask>::value) i_n = walk.next(i, Tr), grp_n = grp;
        const int buf = kStages == 2 ? visit % 2 : 0;
        float* Q_s = Q_buf + buf * L::kQStage;     // Q_i  Br x d
        float* dO_s = dO_buf + buf * L::kdOStage;  // dO_i Br x dv
        // Barrier: every warp is done with the previous visit (its Q_i / dO_i buffer, about to be
        // refilled, dS^T, L_i, D_i).
        __syncthreads();
        const bool prefetch = kStages == 2 && visit + 1 < n_visits;
        if (kStages == 1) load_query_block(grp, i, 0);
        if (prefetch) load_query_block(grp_n, i_n, buf ^ 1);  // overlaps this visit's products
        fa::cp_async_commit();
        load_row_stats_exp<kBlockM, kNThreads>(
            lse2_s, delta_s, lse + b.offset({l_b0, l_b1, l_b2, 0}) + (long long)grp * l_g,
            delta + b.offset({d_b0, d_b1, d_b2, 0}) + (long long)grp * d_g, r0, Lq_b);
        // This thread's copies of this visit's Q_i, dO_i landed (the prefetch may be in flight).
        if (prefetch)
            fa::cp_async_wait<1>();
        else
            fa::cp_async_wait<0>();
        convert_tile<kPrec, Lo::kQ, kBlockM, kHeadDim, L::kPitchD, kNThreads, kVecLoad>(Q_s, L::kQPlane);
        convert_tile<kPrec, Lo::kQ, kBlockM, kHeadDimV, L::kPitchDv, kNThreads, kVecLoad>(dO_s, L::kdOPlane);
        // Barrier: every thread's copies (converted), L_i and D_i are visible to every warp.
        __syncthreads();

        dkv_visit<L, kPrec, kLoPlanes, kHeadDim, kHeadDimV, kBlockM, kBlockN, kNWarps, kOrderedDQ>(
            dK_acc, dV_acc, K_s, V_s, Q_s, dO_s, dSt_s, lse2_s, delta_s, dqa_entry(grp) + (long long)r0 * kHeadDim,
            kOrderedDQ ? order.counter(dqa_entry(grp), i) : nullptr,
            kOrderedDQ ? dq_turn(dq_order, i, walk) : DQTurn{0, 1}, scale_log2, mask, drop, r0, c0);

        i = i_n, grp = grp_n;
    }

    fa::cp_async_wait<0>();  // no copy outlives the kernel when no query block was visited

    // -- epilogue: dK_j · scale and dV_j, rows < Lk, columns < D / Dv (zeros where no query block
    //    was visited).
    acc_store<kHeadDim>(dk + b.offset({dk_b0, dk_b1, dk_b2, dk_row}) + (long long)c_w * dk_row, dk_row, dK_acc,
                        scale, Lk - c_w, D);
    acc_store<kHeadDimV>(dv + b.offset({dv_b0, dv_b1, dv_b2, dv_row}) + (long long)c_w * dv_row, dv_row, dV_acc,
                         1.0f, Lk - c_w, Dv);
}
