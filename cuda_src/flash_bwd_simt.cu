// flash_bwd_simt.cu — FlashAttention-2 backward without tensor cores (fp32, fp64; also any T as
// a fallback), scalar FMAs on shared-memory tiles. Every product is a register-blocked micro-GEMM
// (micro_gemm: a TM x TN output block per thread, 16-byte shared loads, compile-time trip counts;
// docs/performance.md, "SIMT backward (issue 12)").
//
//   Q_i  Br x D   dO_i Br x Dv   L_i, D_i  Br      (query side, block i)
//   K_j  Bc x D   V_j  Bc x Dv                     (key side, block j)
//   P_ij, dS_ij  Br x Bc  (shared memory, AccT; recomputed from Q_i, K_j and L_i)
// Two kernels:
//   flash_bwd_dkv_simt_kernel: one block per (key block j, batch). K_j, V_j stay in shared memory
//     while the block walks the query blocks i (and the query batch entries of the MQA/GQA group
//     that share K_j, V_j): dV_j += P_ij^T dO_i, dK_j += dS_ij^T Q_i * scale, accumulated in
//     registers, written once. With kAtomicDQ it also adds dS_ij K_j * scale into an AccT dQ
//     accumulator with atomics (fast, not bitwise reproducible); with kOrderedDQ too the same
//     atomics in key-block order (fa::sem_wait / fa::sem_post on one int counter per query block,
//     stored after the entry's Lq accumulator rows: the host adds ceil(Tr / D) rows; the preprocess
//     clears them with the accumulator): bitwise reproducible with the atomic mode's 5 products
//     (the dQ kernel below recomputes S and dP: 7). The order is flash_bwd_common.cuh's DQOrder
//     (descending key blocks for causal without per-entry lengths), as in the tensor-core kernels.
//   flash_bwd_dq_simt_kernel (deterministic dQ): one block per (query block i, batch); Q_i, dO_i
//     stay in shared memory while the block walks the key blocks j, recomputing P_ij and dS_ij:
//     dQ_i += dS_ij K_j * scale in registers, written once. No atomics: bitwise reproducible.
#include "flash_bwd_common.cuh"
#include "flash_bwd_ext.cuh"  // the extensions (kExt != 0): ext_p_ds, BwdDropout, QueryTileWalk

namespace fa_bwd {

// Shared-memory tile pitch: 16 bytes of padding per row. Rows stay 16-byte aligned for the
// vector loads of the micro-GEMMs (SimtRun), and a row is an odd number of 16-byte units (the
// padded head dims are multiples of 16 elements, 32 bytes or more), so the lanes that read one
// 16-byte vector each of consecutive rows hit different banks.
template <typename T, int kCols>
struct SimtPitch {
    static constexpr int value = kCols + 16 / (int)sizeof(T);
};

// Elements of one register-blocked step: 16 bytes of AccT (fp32: 4, fp64: 2). The k loops of the
// micro-GEMMs advance by this many, and the vector-grouped output dims come in runs of it.
template <typename AccT>
struct SimtVec {
    static constexpr int value = 16 / (int)sizeof(AccT);
};

// Shared-memory layout of the SIMT backward, in bytes; flasharray/_private/tiles_bwd.py mirrors it.
// P_ij (kHasP) only in the dK/dV kernel. P_ij and dS_ij are not padded: they are read by
// broadcast (all lanes of a quarter warp read the same 16 bytes) and written once per visit.
template <typename T, typename AccT, int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN, bool kHasP>
struct SimtSmem {
    static constexpr int kPitchD = SimtPitch<T, kHeadDim>::value;
    static constexpr int kPitchDv = SimtPitch<T, kHeadDimV>::value;
    static constexpr int kPitchS = kBlockN;                                            // P_ij, dS_ij
    static constexpr int kQ = 0;                                                       // Q_i  Br x D
    static constexpr int kdO = kQ + align16(kBlockM * kPitchD * (int)sizeof(T));       // dO_i Br x Dv
    static constexpr int kK = kdO + align16(kBlockM * kPitchDv * (int)sizeof(T));      // K_j  Bc x D
    static constexpr int kV = kK + align16(kBlockN * kPitchD * (int)sizeof(T));        // V_j  Bc x Dv
    static constexpr int kP = kV + align16(kBlockN * kPitchDv * (int)sizeof(T));       // P_ij Br x Bc
    static constexpr int kdS = kP + (kHasP ? align16(kBlockM * kPitchS * (int)sizeof(AccT)) : 0);  // dS_ij
    static constexpr int kL = kdS + align16(kBlockM * kPitchS * (int)sizeof(AccT));    // L_i*log2e  Br
    static constexpr int kDelta = kL + align16(kBlockM * (int)sizeof(AccT));           // D_i  Br
    static constexpr int kBytes = kDelta + align16(kBlockM * (int)sizeof(AccT));
};

// Copy a rows x cols tile of a strided global matrix into shared memory (pitch `pitch`),
// zero-filling rows >= n_rows and columns >= n_cols (the padded head dimension). Compile-time
// trip count, up to 16 passes unrolled (all 48 of d = 192 in flight held a register and a 64-bit
// address each and spilled); when the block covers whole rows per pass (kNThreads % kCols == 0)
// a thread keeps one column and steps down the rows (no per-element index math).
template <typename T, int kRows, int kCols, int kPitch, int kNThreads>
__device__ __forceinline__ void load_tile(T* smem, const T* gmem, long long row_stride, int n_rows,
                                          int n_cols) {
    constexpr int kPasses = (kRows * kCols + kNThreads - 1) / kNThreads;
    const int tid = (int)threadIdx.x;
    if constexpr (kNThreads % kCols == 0) {
        constexpr int kRowStep = kNThreads / kCols;
        const int c = tid % kCols, r0 = tid / kCols;
        const bool col_in = c < n_cols;
#pragma unroll 16
        for (int it = 0; it < kPasses; ++it) {
            const int r = r0 + it * kRowStep;
            if (kRows % kRowStep == 0 || r < kRows)
                smem[r * kPitch + c] = (col_in && r < n_rows) ? fa::gload(gmem + (long long)r * row_stride + c)
                                                              : FromAcc<T>::convert(0);
        }
    } else {
#pragma unroll 16
        for (int it = 0; it < kPasses; ++it) {
            const int e = tid + it * kNThreads;
            const int r = e / kCols, c = e % kCols;
            if ((kRows * kCols) % kNThreads == 0 || e < kRows * kCols)
                smem[r * kPitch + c] = (r < n_rows && c < n_cols) ? fa::gload(gmem + (long long)r * row_stride + c)
                                                                  : FromAcc<T>::convert(0);
        }
    }
}

// ---- register-blocked micro-GEMMs on shared-memory tiles ----------------------------------------
// C (kM x kN) += A (kM x kK) B (kK x kN), A and B in shared memory, each thread owning a TM x TN
// block of C in registers. An operand is "k-contiguous" (element (x, k) at p[x * pitch + k]:
// Q_i, K_j, dO_i, V_j in S and dP, dS_ij in dQ) or "x-contiguous" (at p[k * pitch + x]: P_ij and
// dS_ij read as P^T, dS^T; Q_i, dO_i, K_j as the B of dK, dV, dQ). Per step of kVec k's a thread
// loads TM + TN 16-byte runs of one operand layout and does TM * TN * kVec FMAs, all unrolled with
// compile-time trip counts.

// kN contiguous elements from 16-byte (or 8-byte: fp16/bf16 fallback) aligned shared memory, one
// vector load.
template <typename E, int kN>
struct alignas(kN * sizeof(E)) SimtRun {
    E v[kN];
};

// The largest power of two <= cap that divides n.
__host__ __device__ constexpr int pow2_divisor(int n, int cap) {
    return (cap > 1 && n % cap == 0) ? cap : (cap > 1 ? pow2_divisor(n, cap / 2) : 1);
}

// How kNThreads threads split a kM x kN product. Along a dim whose operand is x-contiguous
// (kGroup), a thread owns runs of kVec consecutive indices, the runs of the kT threads of that
// dim interleaved (thread t: runs t, t + kT, ...: 16-byte loads of consecutive lanes are
// consecutive, conflict-free); along a k-contiguous one it owns indices t, t + kT, ... (the lanes
// read consecutive rows, an odd number of 16-byte units apart: conflict-free). Threads
// >= kThreads (tiles smaller than the block) idle.
template <int kM, int kN, bool kMGroup, bool kNGroup, int kVec, int kNThreads>
struct MicroLayout {
    static constexpr int kUM = kMGroup ? kM / kVec : kM, kUN = kNGroup ? kN / kVec : kN;
    // 16 threads along N (32 when M has too few units to occupy the block otherwise).
    static constexpr int kCapN = kUM * 16 < kNThreads ? 32 : 16;
    static constexpr int kTN = pow2_divisor(kUN, kUN < kCapN ? kUN : kCapN);
    static constexpr int kTM = pow2_divisor(kUM, kUM < kNThreads / kTN ? kUM : kNThreads / kTN);
    static constexpr int kThreads = kTM * kTN;
    static constexpr int TM = kM / kTM, TN = kN / kTN;
    static constexpr bool kGroupM = kMGroup, kGroupN = kNGroup;
    static_assert(kTM * TM == kM && kTN * TN == kN, "the tile splits evenly");
    static_assert(!kMGroup || TM % kVec == 0, "whole runs along M");
    static_assert(!kNGroup || TN % kVec == 0, "whole runs along N");
    static __device__ __forceinline__ int idx(bool group, int kT, int t, int a) {
        return group ? ((a / kVec) * kT + t) * kVec + a % kVec : a * kT + t;
    }
    static __device__ __forceinline__ int row(int tm, int a) { return idx(kMGroup, kTM, tm, a); }
    static __device__ __forceinline__ int col(int tn, int b) { return idx(kNGroup, kTN, tn, b); }
};

// One operand's values for kVec consecutive k's, k0 .. k0 + kVec - 1, at the kX indices x(t, a):
// frag[a][kk] = operand(x(t, a), k0 + kk), in AccT.
template <typename E, typename AccT, int kPitch, bool kKContig, int kX, int kVec, int kT>
__device__ __forceinline__ void load_frag(AccT (&frag)[kX][kVec], const E* p, int t, int k0) {
    using Run = SimtRun<E, kVec>;
    // One run-time offset per step; every load adds a compile-time one to it.
    const E* base = p + (kKContig ? t * kPitch + k0 : t * kVec + k0 * kPitch);
    if constexpr (kKContig) {
#pragma unroll
        for (int a = 0; a < kX; ++a) {
            const Run r = *reinterpret_cast<const Run*>(base + a * kT * kPitch);
#pragma unroll
            for (int kk = 0; kk < kVec; ++kk) frag[a][kk] = to_acc(r.v[kk]);
        }
    } else {
#pragma unroll
        for (int kk = 0; kk < kVec; ++kk)
#pragma unroll
            for (int v = 0; v < kX / kVec; ++v) {
                const Run r = *reinterpret_cast<const Run*>(base + kk * kPitch + v * kT * kVec);
#pragma unroll
                for (int e = 0; e < kVec; ++e) frag[v * kVec + e][kk] = to_acc(r.v[e]);
            }
    }
}

template <typename AccT, int kM, int kN>
__device__ __forceinline__ void zero(AccT (&c)[kM][kN]) {
#pragma unroll
    for (int a = 0; a < kM; ++a)
#pragma unroll
        for (int b = 0; b < kN; ++b) c[a][b] = AccT(0);
}

template <typename AccT, int kM, int kN>
__device__ __forceinline__ void add_into(AccT (&acc)[kM][kN], const AccT (&c)[kM][kN]) {
#pragma unroll
    for (int a = 0; a < kM; ++a)
#pragma unroll
        for (int b = 0; b < kN; ++b) acc[a][b] += c[a][b];
}

// One step of the micro-GEMM: c += A B over k = k0 .. k0 + kVec - 1.
template <class Lay, int kVec, int kPA, int kPB, typename EA, typename EB, typename AccT>
__device__ __forceinline__ void micro_step(AccT (&c)[Lay::TM][Lay::TN], const EA* A, const EB* B, int tm, int tn,
                                           int k0) {
    AccT fa[Lay::TM][kVec], fb[Lay::TN][kVec];
    load_frag<EA, AccT, kPA, !Lay::kGroupM, Lay::TM, kVec, Lay::kTM>(fa, A, tm, k0);
    load_frag<EB, AccT, kPB, !Lay::kGroupN, Lay::TN, kVec, Lay::kTN>(fb, B, tn, k0);
#pragma unroll
    for (int kk = 0; kk < kVec; ++kk)
#pragma unroll
        for (int a = 0; a < Lay::TM; ++a)
#pragma unroll
            for (int b = 0; b < Lay::TN; ++b) c[a][b] += fa[a][kk] * fb[b][kk];
}

// c += A B over k = 0 .. kK - 1, ascending k; with kSumSteps > 0 in partial sums of kSumSteps
// steps (kSumSteps * kVec k's: 16 in fp32 for S, dP) added to c one after the other. kRolled: the
// partial sums unrolled and each one's steps a rolled loop instead (the same additions in the same
// order, so the same bits): kernels capped at 128 registers (two blocks per SM) spilled 16-80 bytes
// with a partial sum's steps unrolled (the later steps' loads hoisted), and a flush behind a branch
// in one rolled loop hid its cost from the SASS report's static estimate. S and dP are
// sums over the whole head dim (up to 256 terms): P = exp(S - L) turns an absolute error of S into
// a relative error of P, and one running fp32 sum over d = 256 exceeded the test rule at Lk = 1
// (where the naive softmax gives P = 1 exactly); 256 = 16 partial sums of 16 terms rounds about as
// the old kernels' 8 lanes of 32 terms combined pairwise. dV, dK, dQ need none: each visit's block product is
// already a fresh partial sum (accumulate). One rolled loop, its body fully unrolled.
template <class Lay, int kK, int kVec, int kPA, int kPB, int kSumSteps, bool kRolled = false, typename EA,
          typename EB, typename AccT>
__device__ __forceinline__ void micro_gemm(AccT (&c)[Lay::TM][Lay::TN], const EA* A, const EB* B, int tm, int tn) {
    if constexpr (kSumSteps == 0) {
#pragma unroll 1
        for (int k0 = 0; k0 < kK; k0 += kVec) micro_step<Lay, kVec, kPA, kPB>(c, A, B, tm, tn, k0);
    } else if constexpr (kRolled) {
        constexpr int kSumK = kSumSteps * kVec < kK ? kSumSteps * kVec : kK;
        static_assert(kK % kSumK == 0, "whole partial sums of whole steps");
#pragma unroll
        for (int kc = 0; kc < kK; kc += kSumK) {
            AccT part[Lay::TM][Lay::TN];
            zero(part);
#pragma unroll 1
            for (int k0 = 0; k0 < kSumK; k0 += kVec) micro_step<Lay, kVec, kPA, kPB>(part, A, B, tm, tn, kc + k0);
            add_into(c, part);
        }
    } else {
        constexpr int kSumK = kSumSteps * kVec < kK ? kSumSteps * kVec : kK;
        static_assert(kK % kSumK == 0, "whole partial sums of whole steps");
#pragma unroll 1
        for (int kc = 0; kc < kK; kc += kSumK) {
            AccT part[Lay::TM][Lay::TN];
            zero(part);
#pragma unroll
            for (int k0 = 0; k0 < kSumK; k0 += kVec) micro_step<Lay, kVec, kPA, kPB>(part, A, B, tm, tn, kc + k0);
            add_into(c, part);
        }
    }
}

// The thread layouts of the five products (Br = kBlockM, Bc = kBlockN, 16-byte runs of AccT).
template <typename AccT, int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN, int kNThreads>
struct SimtProducts {
    static constexpr int kVec = SimtVec<AccT>::value;
    using Score = MicroLayout<kBlockM, kBlockN, false, false, kVec, kNThreads>;  // S, dP: Br x Bc
    using DV = MicroLayout<kBlockN, kHeadDimV, true, true, kVec, kNThreads>;     // dV += P^T dO
    using DK = MicroLayout<kBlockN, kHeadDim, true, true, kVec, kNThreads>;      // dK += dS^T Q
    using DQ = MicroLayout<kBlockM, kHeadDim, false, true, kVec, kNThreads>;     // dQ += dS K
};

// P_ij and dS_ij for one (query block, key block) pair, into shared memory (pitch kPitchS).
//   S = Q_i K_j^T, P = exp2(S scale log2e - L_i log2e), dP = dO_i V_j^T, dS = P o (dP - D_i).
// Each thread computes a TM x TN block of S and dP with the micro-GEMM (kRolled: micro_gemm's).
template <typename T, typename AccT, int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN,
          int kNThreads, bool kStoreP, bool kRolled = false, class M, class Drop>
__device__ __forceinline__ void compute_p_ds(const T* Q_s, const T* dO_s, const T* K_s, const T* V_s,
                                             const AccT* lse2_s, const AccT* delta_s, AccT* P_s,
                                             AccT* dS_s, int r0, int c0,
                                             const M& mask, const Drop& drop, AccT scale_log2) {
    using L = SimtSmem<T, AccT, kHeadDim, kHeadDimV, kBlockM, kBlockN, kStoreP>;
    using Lay = typename SimtProducts<AccT, kHeadDim, kHeadDimV, kBlockM, kBlockN, kNThreads>::Score;
    constexpr int kVec = SimtVec<AccT>::value;
    // Partial sums of 16 k's (4 steps of 4 fp32) from d = 64 on; else 2 steps (fp64: registers near
    // the cap; d < 64: one fully unrolled 16-k sum made ptxas hoist all its loads and spill).
    constexpr int kSumStepsD = sizeof(AccT) == 4 && kHeadDim >= 64 ? 4 : 2;
    constexpr int kSumStepsDv = sizeof(AccT) == 4 && kHeadDimV >= 64 ? 4 : 2;
    const int tid = (int)threadIdx.x;
    if (tid >= Lay::kThreads) return;
    const int tm = tid / Lay::kTN, tn = tid % Lay::kTN;
    AccT s[Lay::TM][Lay::TN], dp[Lay::TM][Lay::TN];
    zero(s);
    zero(dp);
    micro_gemm<Lay, kHeadDim, kVec, L::kPitchD, L::kPitchD, kSumStepsD, kRolled>(s, Q_s, K_s, tm, tn);
    if constexpr (kRolled && kStoreP && MaskExt<M>::value == 0) {
        // Two blocks per SM (128 registers): P to shared memory before dP's micro-GEMM, which then
        // runs without S's registers; each thread reads back only its own P (no barrier).
#pragma unroll
        for (int a = 0; a < Lay::TM; ++a) {
            const int r = Lay::row(tm, a);
            const AccT lse2 = lse2_s[r];
#pragma unroll
            for (int b = 0; b < Lay::TN; ++b) {
                const int c = Lay::col(tn, b);
                P_s[r * L::kPitchS + c] = recompute_p(s[a][b], scale_log2, lse2, mask.is_visible(r0 + r, c0 + c));
            }
        }
        micro_gemm<Lay, kHeadDimV, kVec, L::kPitchDv, L::kPitchDv, kSumStepsDv, kRolled>(dp, dO_s, V_s, tm, tn);
#pragma unroll
        for (int a = 0; a < Lay::TM; ++a) {
            const int r = Lay::row(tm, a);
            const AccT delta = delta_s[r];
#pragma unroll
            for (int b = 0; b < Lay::TN; ++b) {
                const int c = Lay::col(tn, b);
                dS_s[r * L::kPitchS + c] = P_s[r * L::kPitchS + c] * (dp[a][b] - delta);
            }
        }
        (void)drop;
        return;
    }
    micro_gemm<Lay, kHeadDimV, kVec, L::kPitchDv, L::kPitchDv, kSumStepsDv, kRolled>(dp, dO_s, V_s, tm, tn);
#pragma unroll
    for (int a = 0; a < Lay::TM; ++a) {
        const int r = Lay::row(tm, a);
        const AccT lse2 = lse2_s[r], delta = delta_s[r];
#pragma unroll
        for (int b = 0; b < Lay::TN; ++b) {
            const int c = Lay::col(tn, b);
            AccT sv = s[a][b], dv = dp[a][b];
            if constexpr (MaskExt<M>::value == 0) {
                sv = recompute_p(sv, scale_log2, lse2, mask.is_visible(r0 + r, c0 + c));
                dv = sv * (dv - delta);
            } else {
                AccT z = AccT(1);  // dropout's Z = keep / (1 − p)
                if constexpr (flash::HasExt<MaskExt<M>::value, flash::kExtDropout>::value) z = drop.z(r0 + r, c0 + c);
                // sv becomes P o Z, dv dS.
                ext_p_ds(sv, dv, lse2, delta, z, scale_log2, mask, r0 + r, c0 + c);
            }
            if (kStoreP) P_s[r * L::kPitchS + c] = sv;
            dS_s[r * L::kPitchS + c] = dv;
        }
    }
    (void)drop;
}

// acc += this thread's block of A B (a fresh partial sum per visit, added once: the old kernels'
// per-block sums, so the rounding of dK, dV, dQ does not grow with the sequence length).
template <class Lay, int kK, int kPA, int kPB, typename EA, typename EB, typename AccT>
__device__ __forceinline__ void accumulate(AccT (&acc)[Lay::TM][Lay::TN], const EA* A, const EB* B) {
    const int tid = (int)threadIdx.x;
    if (tid >= Lay::kThreads) return;
    AccT c[Lay::TM][Lay::TN];
    zero(c);
    micro_gemm<Lay, kK, SimtVec<AccT>::value, kPA, kPB, 0>(c, A, B, tid / Lay::kTN, tid % Lay::kTN);
    add_into(acc, c);
}

// A thread's block of a rows x cols accumulator (times scale) to global memory, rows < n_rows,
// columns < n_cols.
template <class Lay, typename OutT, typename AccT>
__device__ __forceinline__ void store_block(OutT* g, long long row_stride, const AccT (&acc)[Lay::TM][Lay::TN],
                                            AccT scale, int n_rows, int n_cols) {
    const int tid = (int)threadIdx.x;
    if (tid >= Lay::kThreads) return;
    const int tm = tid / Lay::kTN, tn = tid % Lay::kTN;
#pragma unroll
    for (int a = 0; a < Lay::TM; ++a)
#pragma unroll
        for (int b = 0; b < Lay::TN; ++b) {
            const int r = Lay::row(tm, a), c = Lay::col(tn, b);
            if (r < n_rows && c < n_cols)
                fa::gstore(g + (long long)r * row_stride + c, FromAcc<OutT>::convert(acc[a][b] * scale));
        }
}

// Atomic mode: dQ_i += dS_ij K_j * scale into the AccT accumulator (rows < n_rows, columns < n_cols).
template <class Lay, int kBlockN, int kPS, int kPD, bool kPredicated, typename T, typename AccT>
__device__ __forceinline__ void atomic_dq(AccT* g, long long row_stride, const AccT* dS_s, const T* K_s,
                                          AccT scale, int n_rows, int n_cols) {
    const int tid = (int)threadIdx.x;
    if (tid >= Lay::kThreads) return;
    const int tm = tid / Lay::kTN, tn = tid % Lay::kTN;
    AccT c[Lay::TM][Lay::TN];
    zero(c);
    micro_gemm<Lay, kBlockN, SimtVec<AccT>::value, kPS, kPD, 0>(c, dS_s, K_s, tm, tn);
    // row(tm, a) = row(tm, 0) + row(0, a), the same for columns: one pointer per row of the micro-tile, the columns
    // immediate offsets (the address computed per element, inside each bounds test, cost ptxas ~15 instructions
    // per atomic: a branch around each, with the parameters reloaded)
    const int r0 = Lay::row(tm, 0), d0 = Lay::col(tn, 0);
    AccT* g0 = g + (long long)r0 * row_stride + d0;
#pragma unroll
    for (int a = 0; a < Lay::TM; ++a) {
        AccT* ga = g0 + (long long)Lay::row(0, a) * row_stride;
        const bool row_ok = r0 + Lay::row(0, a) < n_rows;
#pragma unroll
        for (int b = 0; b < Lay::TN; ++b)
            if constexpr (kPredicated)
                fa::atomic_add_if(row_ok && d0 + Lay::col(0, b) < n_cols, ga + Lay::col(0, b), c[a][b] * scale);
            else if (row_ok && d0 + Lay::col(0, b) < n_cols)
                fa::atomic_add(ga + Lay::col(0, b), c[a][b] * scale);
    }
}

}  // namespace fa_bwd
using namespace fa_bwd;

// ---------------------------------------------------------------------------------------------
// dK_j, dV_j (and, with kAtomicDQ, atomic dQ): grid = (Tc, nb1 * nb2, nb0).
// The query-side tensors (Q, dO, L, D, dQ accumulator) also carry a group stride: the n_group
// query batch entries that share this K_j, V_j (MQA/GQA) are walked inside the block, so dK_j and
// dV_j are summed over them in registers, in a fixed order.
template <typename T, typename AccT, typename OutT, int kHeadDim, int kHeadDimV, int kBlockM,
          int kBlockN, int kNThreads, bool kIsCausal, bool kAtomicDQ, int kExt = 0, bool kOrderedDQ = false,
          int kBlocksPerSm = kMinBlocksPerSm>
__global__ void __launch_bounds__(kNThreads, kBlocksPerSm) flash_bwd_dkv_simt_kernel(
    const T* __restrict__ q, long long q_b0, long long q_b1, long long q_b2, long long q_g, long long q_row,
    const T* __restrict__ k, long long k_b0, long long k_b1, long long k_b2, long long k_row,
    const T* __restrict__ v, long long v_b0, long long v_b1, long long v_b2, long long v_row,
    const T* __restrict__ dout, long long do_b0, long long do_b1, long long do_b2, long long do_g, long long do_row,
    const AccT* __restrict__ lse, long long l_b0, long long l_b1, long long l_b2, long long l_g,
    const AccT* __restrict__ delta, long long d_b0, long long d_b1, long long d_b2, long long d_g,
    AccT* __restrict__ dq_accum, long long dqa_b0, long long dqa_b1, long long dqa_b2, long long dqa_g, long long dqa_row,
    OutT* __restrict__ dk, long long dk_b0, long long dk_b1, long long dk_b2, long long dk_row,
    OutT* __restrict__ dv, long long dv_b0, long long dv_b1, long long dv_b2, long long dv_row,
    int Lq, int Lk, int D, int Dv, int nb2, int n_group, AccT scale, FLASH_EXT_PARAMS(AccT)) {
    static_assert(kHeadDim % 16 == 0 && kHeadDimV % 16 == 0, "head dims are padded to multiples of 16");
    static_assert(kHeadDim <= 256 && kHeadDimV <= 256, "head dims up to 256");
    static_assert(kNThreads % 32 == 0, "block must be whole warps");
    using L = SimtSmem<T, AccT, kHeadDim, kHeadDimV, kBlockM, kBlockN, true>;
    // dK_j, dV_j live in registers: a TM x TN block of each per thread (SimtProducts' layouts).
    using Prod = SimtProducts<AccT, kHeadDim, kHeadDimV, kBlockM, kBlockN, kNThreads>;
    using DK = typename Prod::DK;
    using DV = typename Prod::DV;

    FA_DYNAMIC_SMEM(smem);
    T* Q_s = reinterpret_cast<T*>(smem + L::kQ);           // Br x D
    T* dO_s = reinterpret_cast<T*>(smem + L::kdO);         // Br x Dv
    T* K_s = reinterpret_cast<T*>(smem + L::kK);           // Bc x D
    T* V_s = reinterpret_cast<T*>(smem + L::kV);           // Bc x Dv
    AccT* P_s = reinterpret_cast<AccT*>(smem + L::kP);     // Br x Bc
    AccT* dS_s = reinterpret_cast<AccT*>(smem + L::kdS);   // Br x Bc
    AccT* lse2_s = reinterpret_cast<AccT*>(smem + L::kL);  // Br
    AccT* delta_s = reinterpret_cast<AccT*>(smem + L::kDelta);  // Br

    static_assert(kAtomicDQ || !kOrderedDQ, "the ordered dQ mode orders the atomic mode's atomics");
    const BatchIndex b = BatchIndex::from_grid(nb2);
    // The key block: blockIdx.x, or in the ordered causal mode Tc - 1 - blockIdx.x (DQOrder).
    using Order = DQOrderOf<kIsCausal, kOrderedDQ, kExt>;
    const Order dq_order = Order::make();
    const int c0 = dq_order.n * kBlockN;  // first key of K_j
    const AccT scale_log2 = scale * flash::log2e_acc(AccT(0));
    // Extensions (as in flash_bwd.cu): the entry's lengths Lq_b, Lk_b, the mask, dropout; without
    // them Lq_b = Lq, Lk_b = Lk and the dense mask.
    const flash::ExtArgs<AccT> ext = FLASH_EXT_ARGS(AccT);
    const int Lq_b = ext.template seqlen_q<kExt>(b, Lq), Lk_b = ext.template seqlen_k<kExt>(b, Lk);
    const auto mask = flash::make_mask<kIsCausal, kExt, AccT>(Lq_b, Lk_b, ext, b);
    const auto drop = BwdDropout<flash::HasExt<kExt, flash::kExtDropout>::value, AccT>::make(ext, b);
    const QueryTileWalk<decltype(mask)> walk{mask, c0, kBlockM, kBlockN};

    // -- prologue: K_j, V_j into shared memory, once.
    load_tile<T, kBlockN, kHeadDim, L::kPitchD, kNThreads>(
        K_s, k + b.offset({k_b0, k_b1, k_b2, k_row}) + (long long)c0 * k_row, k_row, Lk_b - c0, D);
    load_tile<T, kBlockN, kHeadDimV, L::kPitchDv, kNThreads>(
        V_s, v + b.offset({v_b0, v_b1, v_b2, v_row}) + (long long)c0 * v_row, v_row, Lk_b - c0, Dv);

    AccT dK_acc[DK::TM][DK::TN];  // dK_j (Bc x D), this thread's block
    AccT dV_acc[DV::TM][DV::TN];  // dV_j (Bc x Dv), this thread's block
    zero(dK_acc);
    zero(dV_acc);

    int i_begin = mask.m_block_min(c0, kBlockM);  // causal: blocks above the diagonal skipped
    int Tr = (Lq + kBlockM - 1) / kBlockM;
    if constexpr (kExt != 0) {  // the query tiles that see K_j (window, lengths, block mask)
        Tr = walk.end();
        i_begin = walk.next(i_begin - 1, Tr);
    }
    for (int g = 0; g < n_group; ++g) {
        const T* q_g0 = q + b.offset({q_b0, q_b1, q_b2, q_row}) + (long long)g * q_g;
        const T* do_g0 = dout + b.offset({do_b0, do_b1, do_b2, do_row}) + (long long)g * do_g;
        const AccT* l_g0 = lse + b.offset({l_b0, l_b1, l_b2, 0}) + (long long)g * l_g;
        const AccT* d_g0 = delta + b.offset({d_b0, d_b1, d_b2, 0}) + (long long)g * d_g;
        for (int i = i_begin; i < Tr; i = walk.next(i, Tr)) {  // i + 1 without a block mask
            const int r0 = i * kBlockM;
            // Barrier: every thread is done reading Q_s, dO_s, P_s, dS_s of the previous step.
            __syncthreads();
            load_tile<T, kBlockM, kHeadDim, L::kPitchD, kNThreads>(
                Q_s, q_g0 + (long long)r0 * q_row, q_row, Lq_b - r0, D);
            load_tile<T, kBlockM, kHeadDimV, L::kPitchDv, kNThreads>(
                dO_s, do_g0 + (long long)r0 * do_row, do_row, Lq_b - r0, Dv);
            load_row_stats<AccT, kBlockM, kNThreads>(lse2_s, delta_s, l_g0, d_g0, r0, Lq_b);
            // Barrier: Q_i, dO_i, L_i, D_i (and, first time, K_j, V_j) are in shared memory.
            __syncthreads();

            // -- P_ij and dS_ij = P_ij o (dO_i V_j^T - D_i)
            compute_p_ds<T, AccT, kHeadDim, kHeadDimV, kBlockM, kBlockN, kNThreads, true, (kBlocksPerSm > 1)>(
                Q_s, dO_s, K_s, V_s, lse2_s, delta_s, P_s, dS_s, r0, c0, mask, drop, scale_log2);
            // Barrier: P_ij, dS_ij complete before they are read down their columns.
            __syncthreads();

            // -- dV_j += P_ij^T dO_i, dK_j += dS_ij^T Q_i   (dK times scale at the end)
            accumulate<DV, kBlockM, L::kPitchS, L::kPitchDv>(dV_acc, P_s, dO_s);
            accumulate<DK, kBlockM, L::kPitchS, L::kPitchD>(dK_acc, dS_s, Q_s);
            // -- atomic mode: dQ_i += dS_ij K_j * scale, straight into the AccT accumulator (ordered:
            //    after the key blocks before this one in DQOrder's order, then the next one's turn).
            if constexpr (kAtomicDQ) {
                AccT* dqa = dq_accum + b.offset({dqa_b0, dqa_b1, dqa_b2, 0}) + (long long)g * dqa_g;
                int* turn = reinterpret_cast<int*>(dqa + (long long)Lq * dqa_row) + i;  // kOrderedDQ only
                const DQTurn t = kOrderedDQ ? dq_turn(dq_order, i, walk) : DQTurn{0, 1};
                if constexpr (kOrderedDQ) fa::sem_wait(turn, t.expected);
                atomic_dq<typename Prod::DQ, kBlockN, L::kPitchS, L::kPitchD, (kBlocksPerSm == 1)>(
                    dqa + (long long)r0 * dqa_row, dqa_row, dS_s, K_s, scale, Lq - r0, D);
                if constexpr (kOrderedDQ) fa::sem_post(turn, t.add);
            }
        }
    }

    // -- epilogue: dK_j * scale and dV_j to global memory (rows < Lk, columns < D / Dv).
    OutT* dK_j = dk + b.offset({dk_b0, dk_b1, dk_b2, dk_row}) + (long long)c0 * dk_row;
    OutT* dV_j = dv + b.offset({dv_b0, dv_b1, dv_b2, dv_row}) + (long long)c0 * dv_row;
    store_block<DK>(dK_j, dk_row, dK_acc, scale, Lk - c0, D);
    store_block<DV>(dV_j, dv_row, dV_acc, AccT(1), Lk - c0, Dv);
}

// ---------------------------------------------------------------------------------------------
// Deterministic dQ: grid = (Tr, nb1 * nb2, nb0). Recomputes P_ij and dS_ij (S and dP again:
// 2 of the backward's 5 matrix products a second time) and keeps dQ_i in registers. OutT is T,
// or AccT when q is broadcast and dQ is summed over its broadcast dims afterwards.
template <typename T, typename AccT, typename OutT, int kHeadDim, int kHeadDimV, int kBlockM,
          int kBlockN, int kNThreads, bool kIsCausal, int kExt = 0>
__global__ void __launch_bounds__(kNThreads, kMinBlocksPerSm) flash_bwd_dq_simt_kernel(
    const T* __restrict__ q, long long q_b0, long long q_b1, long long q_b2, long long q_row,
    const T* __restrict__ k, long long k_b0, long long k_b1, long long k_b2, long long k_row,
    const T* __restrict__ v, long long v_b0, long long v_b1, long long v_b2, long long v_row,
    const T* __restrict__ dout, long long do_b0, long long do_b1, long long do_b2, long long do_row,
    const AccT* __restrict__ lse, long long l_b0, long long l_b1, long long l_b2,
    const AccT* __restrict__ delta, long long d_b0, long long d_b1, long long d_b2,
    OutT* __restrict__ dq, long long dq_b0, long long dq_b1, long long dq_b2, long long dq_row,
    int Lq, int Lk, int D, int Dv, int nb2, AccT scale, FLASH_EXT_PARAMS(AccT)) {
    static_assert(kHeadDim % 16 == 0 && kHeadDimV % 16 == 0, "head dims are padded to multiples of 16");
    static_assert(kHeadDim <= 256 && kHeadDimV <= 256, "head dims up to 256");
    static_assert(kNThreads % 32 == 0, "block must be whole warps");
    using L = SimtSmem<T, AccT, kHeadDim, kHeadDimV, kBlockM, kBlockN, false>;
    using DQ = typename SimtProducts<AccT, kHeadDim, kHeadDimV, kBlockM, kBlockN, kNThreads>::DQ;

    FA_DYNAMIC_SMEM(smem);
    T* Q_s = reinterpret_cast<T*>(smem + L::kQ);           // Br x D
    T* dO_s = reinterpret_cast<T*>(smem + L::kdO);         // Br x Dv
    T* K_s = reinterpret_cast<T*>(smem + L::kK);           // Bc x D
    T* V_s = reinterpret_cast<T*>(smem + L::kV);           // Bc x Dv
    AccT* dS_s = reinterpret_cast<AccT*>(smem + L::kdS);   // Br x Bc
    AccT* lse2_s = reinterpret_cast<AccT*>(smem + L::kL);  // Br
    AccT* delta_s = reinterpret_cast<AccT*>(smem + L::kDelta);  // Br

    const BatchIndex b = BatchIndex::from_grid(nb2);
    const int r0 = (int)blockIdx.x * kBlockM;  // first row of Q_i
    const AccT scale_log2 = scale * flash::log2e_acc(AccT(0));
    // Extensions (as in flash_bwd.cu): the entry's lengths Lq_b, Lk_b, the mask, dropout; without
    // them Lq_b = Lq, Lk_b = Lk and the dense mask.
    const flash::ExtArgs<AccT> ext = FLASH_EXT_ARGS(AccT);
    const int Lq_b = ext.template seqlen_q<kExt>(b, Lq), Lk_b = ext.template seqlen_k<kExt>(b, Lk);
    const auto mask = flash::make_mask<kIsCausal, kExt, AccT>(Lq_b, Lk_b, ext, b);
    const auto drop = BwdDropout<flash::HasExt<kExt, flash::kExtDropout>::value, AccT>::make(ext, b);

    // -- prologue: Q_i, dO_i, L_i, D_i into shared memory, once.
    load_tile<T, kBlockM, kHeadDim, L::kPitchD, kNThreads>(
        Q_s, q + b.offset({q_b0, q_b1, q_b2, q_row}) + (long long)r0 * q_row, q_row, Lq_b - r0, D);
    load_tile<T, kBlockM, kHeadDimV, L::kPitchDv, kNThreads>(
        dO_s, dout + b.offset({do_b0, do_b1, do_b2, do_row}) + (long long)r0 * do_row, do_row, Lq_b - r0, Dv);
    load_row_stats<AccT, kBlockM, kNThreads>(lse2_s, delta_s, lse + b.offset({l_b0, l_b1, l_b2, 0}),
                                             delta + b.offset({d_b0, d_b1, d_b2, 0}), r0, Lq_b);

    AccT dQ_acc[DQ::TM][DQ::TN];  // dQ_i (Br x D), this thread's block
    zero(dQ_acc);

    const T* k_b = k + b.offset({k_b0, k_b1, k_b2, k_row});
    const T* v_b = v + b.offset({v_b0, v_b1, v_b2, v_row});
    const int Tc = mask.n_block_max(r0, kBlockM, kBlockN);  // causal: blocks right of the diagonal skipped
    // Extensions: key tiles from the window's left edge, all-False block-mask tiles skipped.
    const flash::KeyTileWalk<kIsCausal, kExt, AccT> walk{mask, r0, kBlockM, kBlockN, 0};
    int j_first = 0;
    if constexpr (kExt != 0) j_first = walk.next(mask.n_block_min(r0, kBlockN) - 1, Tc);
    for (int j = j_first; j < Tc; j = walk.next(j, Tc)) {  // j + 1 without a block mask
        const int c0 = j * kBlockN;
        // Barrier: every thread is done reading K_s and dS_s of the previous key block.
        __syncthreads();
        load_tile<T, kBlockN, kHeadDim, L::kPitchD, kNThreads>(K_s, k_b + (long long)c0 * k_row, k_row, Lk_b - c0, D);
        load_tile<T, kBlockN, kHeadDimV, L::kPitchDv, kNThreads>(V_s, v_b + (long long)c0 * v_row, v_row, Lk_b - c0, Dv);
        // Barrier: K_j, V_j (and, first time, Q_i, dO_i, L_i, D_i) are in shared memory.
        __syncthreads();

        // -- dS_ij = P_ij o (dO_i V_j^T - D_i)
        compute_p_ds<T, AccT, kHeadDim, kHeadDimV, kBlockM, kBlockN, kNThreads, false>(
            Q_s, dO_s, K_s, V_s, lse2_s, delta_s, nullptr, dS_s, r0, c0, mask, drop, scale_log2);
        // Barrier: dS_ij complete before it is read along its rows by other threads.
        __syncthreads();

        // -- dQ_i += dS_ij K_j   (times scale at the end)
        accumulate<DQ, kBlockN, L::kPitchS, L::kPitchD>(dQ_acc, dS_s, K_s);
    }

    // -- epilogue: dQ_i * scale (rows < Lq, columns < D). A row that sees no key writes zeros.
    OutT* dQ_i = dq + b.offset({dq_b0, dq_b1, dq_b2, dq_row}) + (long long)r0 * dq_row;
    store_block<DQ>(dQ_i, dq_row, dQ_acc, scale, Lq - r0, D);
}
