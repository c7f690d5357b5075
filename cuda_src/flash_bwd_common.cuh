// flash_bwd_common.cuh — helpers shared by every backward kernel (preprocess, dK/dV, dQ, convert).
//
// Symbols (paper names, FlashAttention-2 backward):
//   Q_i   Br x D    query block i          dO_i  Br x Dv   output-gradient block i
//   K_j   Bc x D    key block j            V_j   Bc x Dv   value block j
//   L_i   Br        saved log-sum-exp (natural log, AccT; -inf for a row that sees no key)
//   D_i   Br        rowsum(dO_i o O_i)  (flash_bwd_preprocess.cu)
//   P_ij  Br x Bc   exp(S_ij * scale - L_i), recomputed, never stored in global memory
//   dS_ij Br x Bc   P_ij o (dP_ij - D_i)
// Batch convention (shared with the forward): grid = (blocks, nb1 * nb2, nb0),
// b0 = blockIdx.z, b1 = blockIdx.y / nb2, b2 = blockIdx.y % nb2; every tensor carries element
// strides for b0, b1, b2 and its rows; the last axis is contiguous; stride 0 = broadcast.
#pragma once
#include "fa_port.cuh"
#include "flash_block_info.cuh"  // flash::TensorStrides, flash::BatchIndex (shared with the forward)
#include "flash_mask.cuh"        // flash::Mask: causal / sequence-end visibility and tile skipping
#include "flash_softmax.cuh"     // flash::exp2_acc, flash::log2e_acc, flash::neg_inf

namespace fa_bwd {

using flash::BatchIndex;
using flash::Mask;
using flash::TensorStrides;

// __launch_bounds__ minimum resident blocks per SM. 1 lets ptxas use up to 255 registers per
// thread: the backward keeps dK_j, dV_j (or dQ_i) in registers, and without it ptxas caps the
// count from the SM's thread limit (64 on sm_75 for 256 threads) and spills.
constexpr int kMinBlocksPerSm = 1;

// Element type -> accumulation type (identity for float and double; fa::to_float narrows double).
__device__ __forceinline__ float to_acc(fa_half x) { return fa::to_float(x); }
__device__ __forceinline__ float to_acc(fa_bf16 x) { return fa::to_float(x); }
__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }

// Accumulation type -> element type, round to nearest (identity for float and double).
template <typename T> struct FromAcc {
    static __device__ __forceinline__ T convert(float x) { return fa::from_float<T>(x); }
};
template <> struct FromAcc<double> {
    static __device__ __forceinline__ double convert(double x) { return x; }
};

// Saved LSE in base 2: L_i * log2(e). A row that saw no key has L_i = -inf; keep it -inf so that
// recompute_p can test for it instead of evaluating exp2(-inf - (-inf)) = exp2(nan).
template <typename AccT>
__device__ __forceinline__ AccT lse_log2(AccT lse) {
    return lse == flash::neg_inf<AccT>() ? lse : lse * flash::log2e_acc(AccT(0));
}

// P_ij = exp2(S_ij * scale * log2(e) - L_i * log2(e)); zero when masked or when the row saw no key.
template <typename AccT>
__device__ __forceinline__ AccT recompute_p(AccT s, AccT scale_log2, AccT lse2, bool visible) {
    return (visible && lse2 != flash::neg_inf<AccT>()) ? flash::exp2_acc(s * scale_log2 - lse2)
                                                        : AccT(0);
}

// Load L_i (as L_i * log2 e, -inf kept) and D_i for rows r0 .. r0 + Br - 1.
template <typename AccT, int kBlockM, int kNThreads>
__device__ __forceinline__ void load_row_stats(AccT* lse2_s, AccT* delta_s, const AccT* lse,
                                               const AccT* delta, int r0, int Lq) {
    for (int r = (int)threadIdx.x; r < kBlockM; r += kNThreads) {
        const bool in = r0 + r < Lq;
        lse2_s[r] = in ? lse_log2(fa::gload(lse + r0 + r)) : flash::neg_inf<AccT>();
        delta_s[r] = in ? fa::gload(delta + r0 + r) : AccT(0);
    }
}

// Tensor-core kernels: L_i * log2 e with +inf (not -inf) for a row that saw no key and for rows past
// Lq, so that P_ij = exp2(S_ij * scale * log2 e - L_i * log2 e) is exp2(-inf) = 0 there with no test
// per element (S_ij is finite: Q, K are finite and zero-filled past D and the sequence ends).
// Compile-time trip count (rows tid, tid + kNThreads, ...: usually one, for threads < kBlockM), so
// no run-time loop (which the compiler unrolls 4x plus a remainder) sits in the dK/dV kernel's
// query-block loop.
// L_i * log2 e as load_row_stats_exp stores it, from the raw L_i: +inf for a row that saw no key (-inf).
__device__ __forceinline__ float lse2_of(float l) {
    return l == flash::neg_inf<float>() ? INFINITY : l * flash::kLog2e;
}

// load_row_stats_exp (below) in two halves: fetch reads this thread's L_i, D_i into registers, put stores them
// (lse2, D_i) into shared memory (sm_75's single-buffered backward fetches the next visit's during this
// visit's math, fa::ChunkPrefetch's pattern with plain loads).
template <int kBlockM, int kNThreads>
struct RowStats {
    static constexpr int kIters = (kBlockM + kNThreads - 1) / kNThreads;
    float l[kIters], d[kIters];

    __device__ __forceinline__ void fetch(const float* lse, const float* delta, int r0, int Lq) {
#pragma unroll
        for (int it = 0; it < kIters; ++it) {
            const int r = (int)threadIdx.x + it * kNThreads;
            if (kBlockM % kNThreads != 0 && r >= kBlockM) break;
            const bool in = r0 + r < Lq;
            l[it] = in ? fa::gload(lse + r0 + r) : flash::neg_inf<float>();
            d[it] = in ? fa::gload(delta + r0 + r) : 0.0f;
        }
    }
    __device__ __forceinline__ void put(float* lse2_s, float* delta_s) const {
#pragma unroll
        for (int it = 0; it < kIters; ++it) {
            const int r = (int)threadIdx.x + it * kNThreads;
            if (kBlockM % kNThreads != 0 && r >= kBlockM) break;
            lse2_s[r] = lse2_of(l[it]);
            delta_s[r] = d[it];
        }
    }
};

template <int kBlockM, int kNThreads>
__device__ __forceinline__ void load_row_stats_exp(float* lse2_s, float* delta_s, const float* lse,
                                                   const float* delta, int r0, int Lq) {
#pragma unroll
    for (int it = 0; it < (kBlockM + kNThreads - 1) / kNThreads; ++it) {
        const int r = (int)threadIdx.x + it * kNThreads;
        if (kBlockM % kNThreads != 0 && r >= kBlockM) break;
        const bool in = r0 + r < Lq;
        const float l = in ? fa::gload(lse + r0 + r) : flash::neg_inf<float>();
        lse2_s[r] = lse2_of(l);
        delta_s[r] = in ? fa::gload(delta + r0 + r) : 0.0f;
    }
}

// P_ij from a score and the row's lse2 as load_row_stats_exp stores it; 0 where not visible.
__device__ __forceinline__ float p_from_score(float s, float scale_log2, float lse2, bool visible) {
    return visible ? flash::exp2_acc(s * scale_log2 - lse2) : 0.0f;
}
// The same value with no branch: exp2's argument selected (-inf where not visible: ex2.approx.ftz(-inf) = +0, the
// same bits). The wgmma backward's visibility is not known at compile time in its loop (keys past Lk), and there
// ptxas turned p_from_score's select into a branch around each FFMA / MUFU pair (BSSY, BRA, BSYNC and register
// moves: 112 of the d 128 ws consumer loop's 558 instructions); the mma.sync kernels keep p_from_score, whose
// loops this form made 0-3 % longer.
__device__ __forceinline__ float p_from_score_sel(float s, float scale_log2, float lse2, bool visible) {
    return flash::exp2_acc(visible ? s * scale_log2 - lse2 : flash::neg_inf<float>());
}

// Atomic dQ mode of the tensor-core kernels: layout of the float dQ accumulator. Every query block
// of kBlockM rows owns kBlockM x kHeadDim floats (rows padded to a multiple of Br, columns to the
// padded head dim: the host allocates ceil(Lq / Br) * Br x kHeadDim per batch entry), split into
// 16 x kDQCols tiles; tile tt = tm * kColTiles + tn (rows 16 tm.., columns kDQCols tn..) starts at
// tt * kTileFloats, and inside it the mma C fragment element e (0..3) of n8 tile n held by lane
// l = 4 g + t (row g + 8 (e / 2), column 8 n + 2 t + e % 2) is at (n * 4 + e) * 32 + l. The dK/dV
// kernel's warp-wide atomics thus each cover 32 consecutive floats (four whole 32-byte sectors)
// and need no bounds test (padding receives exact zeros); flash_bwd_convert.cu reads it back.
// kRowsInner (the wgmma kernels, flash_bwd_sm90.cu: DQAccumWg): the same tiles, each 32-float group (c % kDQCols / 8,
// r % 16 / 8, and the row's parity r % 2 where the mma.sync layout has the column's) holding 4 rows x 8 columns
// row-major, (r % 8 / 2) * 8 + c % 8. Their dQ^T fragment is the transpose of mma.sync's C (lane 4g + t: head dim g,
// queries 2t, 2t + 1), and per element its 32 lanes then cover 32 consecutive floats (8t + g): conflict-free shared
// stores, 128-byte REDs (the mma.sync layout gave them 2-way bank conflicts and 8 sectors per 128 bytes).
template <int kHeadDim, bool kRowsInner = false>
struct DQAccumLayout {
    static_assert(kHeadDim % 16 == 0, "the accumulator's columns are the padded head dim");
    static constexpr int kDQCols = kHeadDim % 32 == 0 ? 32 : 16;  // tile width
    static constexpr int kColTiles = kHeadDim / kDQCols;
    static constexpr int kTileFloats = 16 * kDQCols;
    // Offset of (row r, column c) inside a query block's kBlockM x kHeadDim floats.
    static __host__ __device__ constexpr int offset(int r, int c) {
        return ((r / 16) * kColTiles + c / kDQCols) * kTileFloats +
               (((c % kDQCols) / 8) * 4 + ((r % 16) / 8) * 2 + (kRowsInner ? r % 2 : c % 2)) * 32 +
               (kRowsInner ? ((r % 8) / 2) * 8 + c % 8 : (r % 8) * 4 + (c % 8) / 2);
    }
};
template <int kHeadDim>
using DQAccumWg = DQAccumLayout<kHeadDim, true>;

// The ordered dQ mode's counters (flash_bwd_dkv_kernel, kOrderedDQ): one int per query block,
// stored after a batch entry's ceil(Lq / Br) query blocks of Br x D accumulator elements (float or
// double; the host adds ceil(Tr / D) rows of D elements; the preprocess clears them with the
// accumulator: +0.0 is int 0).
template <int kBlockM, int kHeadDim>
struct DQOrderCounters {
    int Lq;
    // AccT: float (fp16/bf16 kernels) or double (flash_bwd_f64.cu), the accumulator's element type.
    template <typename AccT>
    __device__ __forceinline__ int* counter(AccT* entry, int i) const {
        const long long blocks = (Lq + kBlockM - 1) / kBlockM;
        return reinterpret_cast<int*>(entry + blocks * kBlockM * kHeadDim) + i;
    }
};

// The ordered dQ mode's order of the key blocks adding to one query block i (kOrderedDQ kernels;
// the grid's x is the key blocks). Ascending — key block n after 0 .. n-1: turn(i) = n — except
// causal without per-entry lengths (kDescending): there key block n starts at query block
// i_begin(n) = m_block_min(n Bc), nondecreasing in n, so it reaches query block i at its visit
// i - i_begin(n), after the key blocks above it. Ascending, block n idled about n visits before
// each turn (measured on an H200: the ordered causal backward ran at 0.41-0.50x FlashAttention-2,
// the atomic one at 0.88-0.93x). Descending — key block n after the visitors of i above it:
// turn(i) = visitors(i) - 1 - n, where visitors(i) counts the key blocks n' with
// m_block_min(n' Bc) <= i, i.e. n' Bc - causal_offset < (i + 1) Br. Block x then computes key
// block Tc - 1 - x, so a block still waits only for blocks dispatched before it (fa::sem_wait's
// rule). Lengths (kExtSeqlens) keep the ascending order: their entries' key blocks past Lk_b visit
// nothing, which this count does not know.
// A window (kExtWindow; turn(i, Br, Bc, mask), called by the mma.sync, TF32, SIMT and wgmma dK/dV kernels)
// moves the first visitor of query block i from key block 0 to the window's left edge, n_lo(i) = mask.n_block_min(i Br, Bc) = first_key(i Br) / Bc:
// key block n visits i iff m_block_max of its columns passes i, i.e. i Br + causal_offset - left < (n+1) Bc,
// i.e. n >= n_lo(i) — the same inequality (the visitors of i stay one contiguous run of key blocks). So the
// ascending turn is n - n_lo(i); the descending one (causal) is unchanged: with causal the window's right
// edge never binds, and the visitors above n are still n + 1 .. n_max(i).
template <bool kDescending>
struct DQOrder {
    int n;   // the key block this block computes
    int tc;  // key blocks launched
    // x: the block's key-block coordinate (blockIdx.x, or grid_pos's).
    __device__ __forceinline__ static DQOrder make(int x = static_cast<int>(blockIdx.x)) {
        const int tc = static_cast<int>(gridDim.x);
        return DQOrder{kDescending ? tc - 1 - x : x, tc};
    }
    // The rank of key block m in the order (the grid's x of the block computing it; rank(rank(m)) = m).
    __device__ __forceinline__ int rank(int m) const { return kDescending ? tc - 1 - m : m; }
    // causal_offset: the mask's (Lk - Lq: row r sees keys <= r + causal_offset).
    __device__ __forceinline__ int turn(int i, int Br, int Bc, int causal_offset) const {
        if constexpr (!kDescending) {
            (void)i, (void)Br, (void)Bc, (void)causal_offset;
            return n;
        } else {
            const int lim = (i + 1) * Br + causal_offset;  // key blocks n' with n' Bc < lim visit i
            const int visitors = lim <= 0 ? 0 : flash::imin(tc, (lim + Bc - 1) / Bc);
            return visitors - 1 - n;
        }
    }
    // The turn with the call's mask: the window's first visitor of query block i subtracted in the ascending
    // order (a Mask without a window: n_block_min is 0, the turn above).
    template <class MaskT>
    __device__ __forceinline__ int turn(int i, int Br, int Bc, const MaskT& mask) const {
        const int t = turn(i, Br, Bc, mask.causal_offset);
        if constexpr (!kDescending && MaskT::kWindow) return t - mask.n_block_min(i * Br, Bc);
        return t;
    }
};

// The DQOrder of a kernel: descending for the ordered causal mode without per-entry lengths.
template <bool kIsCausal, bool kOrderedDQ, int kExt>
using DQOrderOf = DQOrder<kIsCausal && kOrderedDQ && !flash::HasExt<kExt, flash::kExtSeqlens>::value>;

// The block's (key block x, entry y, z) in a dK/dV kernel's grid (Tc, nb1·nb2, nb0). kEntriesFirst (the ordered dQ
// mode of the wgmma ws kernel and the mma.sync dK/dV kernels: cuda_backward_sm90.ENTRIES_FIRST,
// tiles_bwd.ENTRIES_FIRST): the blocks the hardware starts in increasing L = x + X·(y + Y·z) taken entries first,
// as (L / (Y·Z), L mod (Y·Z)): the blocks running at once are the first key blocks of many entries, not one entry's
// first key blocks. Key block n waits for n − 1 (ascending) or n + 1 (the causal descending order)
// of its entry at each query block; from the grid's x, the waits chain up to every running block (a wave of 132
// lagging one dQ turn each behind the next), entries first only those of one entry (key blocks L, L − Y·Z, ...:
// still dispatched earlier, fa::sem_wait's rule). ctaid / nctaid read by volatile asm where `reread` (the
// TMA-store epilogue: ptxas does not merge them with the prologue's reads, so the prologue's values are not kept
// live across the loop; with them, d = 256 causal ordered spilled 4/8 bytes). The emulator reads blockIdx.
struct GridPos {
    int x, y, z;
};
template <bool kEntriesFirst, bool kReread = false>
__device__ __forceinline__ GridPos grid_pos() {
    unsigned x, y, z, nx, ny, nz;
#if defined(__CUDA_ARCH__)
    if constexpr (kReread) {
        asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(x));
        asm volatile("mov.u32 %0, %%ctaid.y;\n" : "=r"(y));
        asm volatile("mov.u32 %0, %%ctaid.z;\n" : "=r"(z));
    } else {
        x = blockIdx.x, y = blockIdx.y, z = blockIdx.z;
    }
#else
    x = blockIdx.x, y = blockIdx.y, z = blockIdx.z;
#endif
    if constexpr (!kEntriesFirst) return GridPos{static_cast<int>(x), static_cast<int>(y), static_cast<int>(z)};
    nx = gridDim.x, ny = gridDim.y, nz = gridDim.z;
    const unsigned entries = ny * nz, linear = x + nx * (y + ny * z), e = linear % entries;
    return GridPos{static_cast<int>(linear / entries), static_cast<int>(e % ny), static_cast<int>(e / ny)};
}

__device__ __forceinline__ BatchIndex batch_index_at(const GridPos& g, int nb2) {
    BatchIndex b;
    b.b0 = g.z, b.b1 = g.y / nb2, b.b2 = g.y % nb2;
    return b;
}

// The batch entry read again after the consumers' loop (grid_pos's kReread).
template <bool kEntriesFirst = false>
__device__ __forceinline__ BatchIndex batch_index_reread(int nb2) {
    return batch_index_at(grid_pos<kEntriesFirst, true>(), nb2);
}

// Round a byte offset up to 16 bytes (cp.async / ldmatrix alignment of every shared tile).
__host__ __device__ constexpr int align16(int bytes) { return (bytes + 15) / 16 * 16; }

}  // namespace fa_bwd
