// flash_bwd.cu — FlashAttention-2 backward on tensor cores (fp16, bf16; fp32 accumulation).
//
//   Q_i   Br x D    dO_i  Br x Dv    L_i, D_i  Br     (query side, block i; smem)
//   K_j   Bc x D    V_j   Bc x Dv                     (key side, block j; smem)
//   P_ij^T, dS_ij^T  Bc x Br   (dK/dV kernel; recomputed per block pair, in registers as mma A
//                               fragments, through smem when several warps share a 16-key row tile)
//   dS_ij            Br x Bc   (dQ kernel; the same rule per 16-query row tile)
// Every matrix product is mma.sync m16n8k16 with operands loaded by ldmatrix from shared memory:
//   S^T  = K_j Q_i^T        A = K_j      (row-major)       B = Q_i  stored N x K  (ldmatrix)
//   dP^T = V_j dO_i^T       A = V_j                        B = dO_i stored N x K
//   dV_j += P^T dO_i        A = P^T      (row-major)       B = dO_i stored K x N  (ldmatrix.trans)
//   dK_j += dS^T Q_i        A = dS^T                       B = Q_i  stored K x N  (.trans)
//   dQ_i += dS K_j          A = dS: stored transposed (.trans) or row-major     B = K_j (.trans)
// Global -> shared copies use cp.async (16-byte chunks) when every row is 16-byte aligned,
// element loads otherwise (head dims that are not multiples of 8, odd strides).
//
// Kernels:
//   flash_bwd_dkv_kernel: one block per (key block j, K/V batch entry); K_j, V_j stay in shared
//     memory while the block walks the query blocks (and the query batch entries of the
//     MQA/GQA group). dK_j, dV_j accumulate in registers, split over the warps as
//     (Bc / 16 row tiles) x kSplit column slices. kAtomicDQ: dQ_i += dS K_j with float atomics
//     into the padded, fragment-ordered accumulator (DQAccumLayout, flash_bwd_common.cuh; the
//     conversion pass applies the scale). Epilogues (both kernels) go through shared memory:
//     16-byte row stores of dK, dV (dQ) when rows are aligned.
//   flash_bwd_dq_kernel (deterministic dQ): one block per (query block i, batch), walking the key
//     blocks and recomputing S, P, dP, dS; dQ_i in registers; no atomics.
#include "flash_bwd_mma.cuh"  // tile copies, warp_mma, fragment layouts
#include "flash_bwd_ext.cuh"  // the extensions (kExt != 0): ext_p_ds, dropout bits, QueryTileWalk

namespace fa_bwd {

// Column slices of a kCols-wide register accumulator shared by kSplit warps: the largest divisor
// s of kSplit such that every slice is whole n16 steps (kCols % (16 s) == 0). Warps wn >= s own
// no columns of it. tiles_bwd.tc_split mirrors this.
__host__ __device__ constexpr int column_slices(int kCols, int kSplit) {
    int s = kSplit;
    while (s > 1 && (kSplit % s != 0 || kCols % (16 * s) != 0)) --s;
    return s;
}

// Shared-memory layout in bytes; flasharray/_private/tiles_bwd.py (tc_smem) mirrors it.
// kStages = 2 double-buffers the streamed tiles (Q_i, dO_i in the dK/dV kernel; K_j, V_j in the
// dQ kernel) so the next block's cp.async copies overlap this block's math.
// kNoPt: the dK/dV kernel with one warp per 16-key row tile (kScoresInRegs) keeps P^T in registers and
// needs no P^T buffer.
template <int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN, bool kDKV, int kStages, bool kNoPt = false>
struct TcSmem {
    static_assert(kStages == 1 || kStages == 2, "one or two buffers for the streamed tiles");
    static constexpr int kElem = 2;  // fp16 / bf16
    static constexpr int kPitchD = kHeadDim + kTcPad;
    static constexpr int kPitchDv = kHeadDimV + kTcPad;
    static constexpr int kStagesQ = kDKV ? kStages : 1;  // buffers of Q_i, dO_i
    static constexpr int kStagesK = kDKV ? 1 : kStages;  // buffers of K_j, V_j
    static constexpr int kQStage = kBlockM * kPitchD;    // elements of one Q_i buffer (and K_j, dO_i, V_j below)
    static constexpr int kdOStage = kBlockM * kPitchDv;
    static constexpr int kKStage = kBlockN * kPitchD;
    static constexpr int kVStage = kBlockN * kPitchDv;
    // dK/dV kernel: P^T and dS^T are Bc x Br; dQ kernel: dS is Br x Bc.
    static constexpr int kScoreRows = kDKV ? kBlockN : kBlockM;
    static constexpr int kPitchS = (kDKV ? kBlockM : kBlockN) + kTcPad;
    static constexpr int kQ = 0;                                                  // Q_i  Br x D (x kStagesQ)
    static constexpr int kdO = kQ + align16(kStagesQ * kQStage * kElem);         // dO_i Br x Dv
    static constexpr int kK = kdO + align16(kStagesQ * kdOStage * kElem);        // K_j  Bc x D (x kStagesK)
    static constexpr int kV = kK + align16(kStagesK * kKStage * kElem);          // V_j  Bc x Dv
    static constexpr int kP = kV + align16(kStagesK * kVStage * kElem);          // P^T  (dkv only)
    static constexpr int kdS = kP + (kDKV && !kNoPt ? align16(kScoreRows * kPitchS * kElem) : 0);  // dS^T / dS
    static constexpr int kL = kdS + align16(kScoreRows * kPitchS * kElem);       // L_i*log2e  Br
    static constexpr int kDelta = kL + align16(kBlockM * 4);                      // D_i  Br
    static constexpr int kBytes = kDelta + align16(kBlockM * 4);
};

// -- score strips -------------------------------------------------------------------------------
// Every warp computes whole 16 x kW strips of the scores (kW a multiple of 16): each k16 step loads
// one A fragment for kW / 8 MMAs, and the strip's P and dS come back as A fragments (kW / 16 k16
// steps), ready for the next product from registers or for one store to shared memory.

// Dropout's Z of an element whose dS factor f >= 0 grid_scores negated where it is dropped (-0 for a dropped zero).
__device__ __forceinline__ float dropout_z(float f, float scale) { return __float_as_uint(f) >> 31 ? 0.0f : scale; }

// dK/dV kernel: keys kt*16 .. +15 (rows) by queries q0 .. q0 + kW - 1 (columns) of
// S^T = K_j Q_i^T and dP^T = V_j dO_i^T, then P^T = exp2(S^T scale log2e - L_i log2e) and
// dS^T = P^T o (dP^T - D_i) (L_i, D_i per column). A block mask is looked up once per n8 tile (16 keys from a
// multiple of 16 by 8 queries from a multiple of 8 lie in one block) and passed to ext_p_ds (P = 0, so dS = 0, outside
// it), whose per-element checks are the geometry's (as grid_scores and the forward do).
template <typename T, class L, int kW, int kHeadDim, int kHeadDimV, class M, class Drop>
__device__ __forceinline__ void dkv_scores(uint32_t (&P_a)[kW / 16][4], uint32_t (&dS_a)[kW / 16][4],
                                           const T* K_s, const T* V_s, const T* Q_s, const T* dO_s,
                                           const float* lse2_s, const float* delta_s, int kt, int q0,
                                           float scale_log2, const M& mask, const Drop& drop, int r0, int c0) {
    const int lane = (int)threadIdx.x % 32, g = lane / 4, t = lane % 4;
    float s[kW / 8][4], dp[kW / 8][4];  // S^T, dP^T strips (C layout)
    zero_acc(s);
    zero_acc(dp);
    warp_mma<T, kHeadDim, kW, false, false>(s, K_s + kt * 16 * L::kPitchD, L::kPitchD,
                                             Q_s + q0 * L::kPitchD, L::kPitchD);
    warp_mma<T, kHeadDimV, kW, false, false>(dp, V_s + kt * 16 * L::kPitchDv, L::kPitchDv,
                                              dO_s + q0 * L::kPitchDv, L::kPitchDv);
    constexpr bool kDropout = flash::HasExt<MaskExt<M>::value, flash::kExtDropout>::value;
    uint32_t keep[kW / 8];  // dropout's keep bits per n8 tile (dropout_bits_t)
    if constexpr (kDropout) dropout_bits_t<kW>(keep, drop.rng, r0 + q0, c0 + kt * 16, lane);
    (void)drop; (void)keep;
    const auto& geo = geometry_of(mask);  // the mask less its block mask (the mask itself without one)
#pragma unroll
    for (int nt = 0; nt < kW / 8; ++nt) {
        // This lane's two query columns r, r + 1: L_i and D_i of both in one 8-byte load each (r is even).
        const int r = q0 + nt * 8 + 2 * t;
        const float2 lse2 = *reinterpret_cast<const float2*>(lse2_s + r);
        const float2 delta_r = *reinterpret_cast<const float2*>(delta_s + r);
        const bool in_block = mask.block_visible(r0 + q0 + 16 * (nt / 2), c0 + kt * 16);  // per pair of n8 tiles (block_visible)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int c = kt * 16 + g + (e / 2) * 8;  // key within K_j (row of S^T)
            if constexpr (MaskExt<M>::value == 0) {
                const float p = p_from_score(s[nt][e], scale_log2, e % 2 ? lse2.y : lse2.x,
                                             mask.is_visible(r0 + r + e % 2, c0 + c));
                dp[nt][e] = p * (dp[nt][e] - (e % 2 ? delta_r.y : delta_r.x));  // dS^T, from the unrounded P^T
                s[nt][e] = p;
            } else {
                float z = 1.0f;  // dropout's Z = keep / (1 − p)
                if constexpr (kDropout) z = (keep[nt] >> e) & 1u ? drop.scale : 0.0f;
                ext_p_ds(s[nt][e], dp[nt][e], e % 2 ? lse2.y : lse2.x, e % 2 ? delta_r.y : delta_r.x, z,
                         scale_log2, geo, r0 + r + e % 2, c0 + c, in_block);
            }
        }
    }
    c_to_a<T, kW / 16>(P_a, s);
    c_to_a<T, kW / 16>(dS_a, dp);
}

// Grid-layout dK/dV kernel (flash_bwd_dkv_grid_kernel; dense, or lengths / window / ALiBi / softcap / block mask): the
// warp's 32 keys (32 wk..) by kSQ queries (kSQ wq..) of S^T and dP^T, then P^T and dS^T = P^T o (dP^T - D_i) exactly
// as dkv_scores computes them (dS from the unrounded P), rounded to T and stored to P^T_s, dS^T_s (Bc x Br, pitch
// L::kPitchS). lse_s holds the raw L_i (the kernel's cp.async copies; lse2_of here), delta_s D_i.
// Dropout: the keep bits of each 16-key m tile (dropout_bits_t, the row-tile kernel's) in the softcap pass below.
// A block mask is looked up once per pair of n8 tiles of each 16-key m tile (16 keys by 16 queries, each from a
// multiple of 16, lie in one block: block sizes are multiples of 16), not per element, as ext_pt_dst_sm90 does:
// P = 0 outside it (dS = P o ... = 0 follows), the per-element checks on the geometry (rows past Lq get P from a
// zero L_i and zero Q_i, dO_i rows: nothing in dK_j, dV_j, dQ_i, as without a block mask).
// S^T runs on both 16-key m tiles at once (each Q_i fragment feeds 4 MMAs); dP^T one m tile at a time, so
// that only 16 of its accumulators are live beside P^T's 32 floats and dK_j, dV_j (both m tiles at once
// spilled 4-52 bytes at the 255-register cap; this reloads the dO_i fragments once: 160 ldmatrix per
// 320 MMA instead of 144).
template <typename T, class L, int kSQ, int kHeadDim, int kHeadDimV, class M, class Drop, bool kSwz = false>
__device__ __forceinline__ void grid_scores(T* Pt_s, T* dSt_s, const T* K_s, const T* V_s, const T* Q_s,
                                            const T* dO_s, const float* lse_s, const float* delta_s, int wk,
                                            int wq, float scale_log2, const M& mask, const Drop& drop, int r0,
                                            int c0) {
    constexpr bool kDropout = flash::HasExt<MaskExt<M>::value, flash::kExtDropout>::value;
    const int lane = (int)threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int k0 = 32 * wk, q0 = kSQ * wq;
    constexpr int kQD = kSwz ? kHeadDim : L::kPitchD, kQDv = kSwz ? kHeadDimV : L::kPitchDv;  // Q_i / dO_i pitches
    const auto geo = geometry_of(mask);  // the mask less its block mask (the mask itself without one)
    float p[2][kSQ / 8][4];  // S^T, then P^T (C layout; two 16-key m tiles)
    zero_acc(p[0]); zero_acc(p[1]);
    warp_mma_m<T, 2, kHeadDim, kSQ, false, false, false, kSwz>(p, K_s + k0 * L::kPitchD, L::kPitchD, Q_s + q0 * kQD,
                                                               kQD);
    // The per-m-tile pass (below): softcap, dropout, and at d 128 (kSQ 32) a block mask, whose both-tiles pass
    // spilled in every set there (with this one ten of the 32 sets compile clean: tiles_bwd._BM128).
    constexpr bool kPerMTile = M::kSoftcap || kDropout || (M::kBlockMask && kSQ == 32);
    if constexpr (!kPerMTile) {
        // P^T in place (with extensions: the forward's score — ALiBi — and visibility — lengths, window).
#pragma unroll
        for (int nt = 0; nt < kSQ / 8; ++nt) {
            const int r = q0 + nt * 8 + 2 * t;  // this lane's query columns r, r + 1
            const float2 lse_r = *reinterpret_cast<const float2*>(lse_s + r);
            const float2 lse2 = {lse2_of(lse_r.x), lse2_of(lse_r.y)};
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                const bool in_block = mask.block_visible_guarded(r0 + q0 + 16 * (nt / 2), c0 + k0 + 16 * mt);  // true without one
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = r0 + r + e % 2, col = c0 + k0 + 16 * mt + g + (e / 2) * 8;
                    if constexpr (!M::kScoreMod)  // dense, lengths, window, block mask: visibility only
                        p[mt][nt][e] = p_from_score(p[mt][nt][e], scale_log2, e % 2 ? lse2.y : lse2.x,
                                                    geo.is_visible(row, col) && in_block);
                    else
                        p[mt][nt][e] = sel_block(in_block, ext_ds_factor(p[mt][nt][e], e % 2 ? lse2.y : lse2.x,
                                                                         scale_log2, geo, row, col));
                }
            }
        }
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            uint32_t a[kSQ / 16][4];
            c_to_a<T, kSQ / 16>(a, p[mt]);
            store_a<T, kSQ / 16>(Pt_s + (k0 + 16 * mt) * L::kPitchS + q0, L::kPitchS, a);
        }
    } else {
        // Softcap, dropout (or a block mask at d 128): P^T (dropout: P o Z) stored one m tile at a time, and dS's
        // factor f = P o (1 - tanh^2) (P without softcap; ext_p_factor: ext_ds_factor's P and f) kept in place —
        // with dropout, negated where the element is dropped (f >= 0: its sign bit carries Z to the dS pass,
        // dropout_z, and no keep bits stay live across dP^T's product). The keep bits of each m tile are
        // dkv_scores's (dropout_bits_t: 16 keys by kSQ queries), so P o Z and dS are the row-tile kernel's bits.
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            uint32_t keep[kSQ / 8];  // dropout's keep bits per n8 tile
            if constexpr (kDropout) dropout_bits_t<kSQ>(keep, drop.rng, r0 + q0, c0 + k0 + 16 * mt, lane);
            float pm[kSQ / 8][4];
#pragma unroll
            for (int nt = 0; nt < kSQ / 8; ++nt) {
                const int r = q0 + nt * 8 + 2 * t;
                const float2 lse_r = *reinterpret_cast<const float2*>(lse_s + r);
                const float2 lse2 = {lse2_of(lse_r.x), lse2_of(lse_r.y)};
                const bool in_block = mask.block_visible_guarded(r0 + q0 + 16 * (nt / 2), c0 + k0 + 16 * mt);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    pm[nt][e] = sel_block(in_block, ext_p_factor(p[mt][nt][e], e % 2 ? lse2.y : lse2.x, scale_log2,
                                                                 geo, r0 + r + e % 2, c0 + k0 + 16 * mt + g + (e / 2) * 8));
                    p[mt][nt][e] = sel_block(in_block, p[mt][nt][e]);
                    if constexpr (kDropout) {
                        const bool kept = (keep[nt] >> e) & 1u;
                        pm[nt][e] *= kept ? drop.scale : 0.0f;
                        p[mt][nt][e] = kept ? p[mt][nt][e] : -p[mt][nt][e];
                    }
                }
            }
            uint32_t a[kSQ / 16][4];
            c_to_a<T, kSQ / 16>(a, pm);
            store_a<T, kSQ / 16>(Pt_s + (k0 + 16 * mt) * L::kPitchS + q0, L::kPitchS, a);
        }
    }
    // dP^T, then dS^T, kMTdP m tiles at a time: one at d <= 128 (see above); both at d 256, whose 16-query score
    // tiles leave the registers (16 floats each; 0.75 ldmatrix per MMA of dP^T instead of 1)
    constexpr int kMTdP = kSQ <= 16 ? 2 : 1;
#pragma unroll
    for (int m0 = 0; m0 < 2; m0 += kMTdP) {
        float dp[kMTdP][kSQ / 8][4];  // dP^T of m tiles m0 ..
#pragma unroll
        for (int mt = 0; mt < kMTdP; ++mt) zero_acc(dp[mt]);
        warp_mma_m<T, kMTdP, kHeadDimV, kSQ, false, false, false, kSwz>(dp, V_s + (k0 + 16 * m0) * L::kPitchDv,
                                                                        L::kPitchDv, dO_s + q0 * kQDv, kQDv);
#pragma unroll
        for (int mt = 0; mt < kMTdP; ++mt) {
#pragma unroll
            for (int nt = 0; nt < kSQ / 8; ++nt) {
                const float2 delta_r = *reinterpret_cast<const float2*>(delta_s + q0 + nt * 8 + 2 * t);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float f = p[m0 + mt][nt][e], delta = e % 2 ? delta_r.y : delta_r.x;
                    if constexpr (kDropout)  // ext_p_ds's P o (dP Z - D_i), Z from f's sign (above)
                        dp[mt][nt][e] = fabsf(f) * (dp[mt][nt][e] * dropout_z(f, drop.scale) - delta);
                    else
                        dp[mt][nt][e] = f * (dp[mt][nt][e] - delta);
                }
            }
            uint32_t a[kSQ / 16][4];
            c_to_a<T, kSQ / 16>(a, dp[mt]);
            store_a<T, kSQ / 16>(dSt_s + (k0 + 16 * (m0 + mt)) * L::kPitchS + q0, L::kPitchS, a);
        }
    }
}

// dQ kernel: queries qt*16 .. +15 (rows) by keys k0 .. k0 + kW - 1 (columns) of S = Q_i K_j^T and
// dP = dO_i V_j^T, then dS = P o (dP - D_i) (L_i, D_i per row).
template <typename T, class L, int kW, int kHeadDim, int kHeadDimV, class M, class Drop>
__device__ __forceinline__ void dq_scores(uint32_t (&dS_a)[kW / 16][4], const T* Q_s, const T* dO_s,
                                          const T* K_s, const T* V_s, const float* lse2_s,
                                          const float* delta_s, int qt, int k0, float scale_log2,
                                          const M& mask, const Drop& drop, int r0, int c0) {
    const int lane = (int)threadIdx.x % 32, g = lane / 4, t = lane % 4;
    float s[kW / 8][4], dp[kW / 8][4];  // S, dP strips (C layout)
    zero_acc(s);
    zero_acc(dp);
    if constexpr (MaskExt<M>::value == 0) {
        warp_mma<T, kHeadDim, kW, false, false>(s, Q_s + qt * 16 * L::kPitchD, L::kPitchD,
                                                 K_s + k0 * L::kPitchD, L::kPitchD);
        warp_mma<T, kHeadDimV, kW, false, false>(dp, dO_s + qt * 16 * L::kPitchDv, L::kPitchDv,
                                                  V_s + k0 * L::kPitchDv, L::kPitchDv);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = qt * 16 + g + 8 * h;  // query within Q_i (rows g and g + 8)
            const float lse2 = lse2_s[r], delta_r = delta_s[r];
#pragma unroll
            for (int nt = 0; nt < kW / 8; ++nt)
#pragma unroll
                for (int e = 2 * h; e < 2 * h + 2; ++e) {
                    const int c = k0 + nt * 8 + 2 * t + (e % 2);  // key within K_j
                    const float p = p_from_score(s[nt][e], scale_log2, lse2, mask.is_visible(r0 + r, c0 + c));
                    dp[nt][e] = p * (dp[nt][e] - delta_r);
                }
        }
        (void)drop;
    } else if constexpr (kW < 64) {
        // Extensions, narrow strips: S and dP, then P and dS per element (ext_p_ds).
        warp_mma<T, kHeadDim, kW, false, false>(s, Q_s + qt * 16 * L::kPitchD, L::kPitchD,
                                                 K_s + k0 * L::kPitchD, L::kPitchD);
        warp_mma<T, kHeadDimV, kW, false, false>(dp, dO_s + qt * 16 * L::kPitchDv, L::kPitchDv,
                                                  V_s + k0 * L::kPitchDv, L::kPitchDv);
        constexpr bool kDropout = flash::HasExt<MaskExt<M>::value, flash::kExtDropout>::value;
        // Dropout's Z = keep / (1 − p) in the C layout (rows are queries: the forward's dropout_mma).
        float z[1][kDropout ? kW / 8 : 1][4];
        if constexpr (kDropout) {
#pragma unroll
            for (int nt = 0; nt < kW / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) z[0][nt][e] = drop.scale;
            flash::dropout_mma<1, kW / 8>(z, drop.rng, r0 + qt * 16, c0 + k0, lane);
        }
        (void)drop; (void)z;
        const auto& geo = geometry_of(mask);  // a block mask: looked up once per n8 tile (dkv_scores)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = qt * 16 + g + 8 * h;  // query within Q_i (rows g and g + 8)
            const float lse2 = lse2_s[r], delta_r = delta_s[r];
#pragma unroll
            for (int nt = 0; nt < kW / 8; ++nt) {
                const bool in_block = mask.block_visible(r0 + qt * 16, c0 + k0 + 16 * (nt / 2));
#pragma unroll
                for (int e = 2 * h; e < 2 * h + 2; ++e) {
                    ext_p_ds(s[nt][e], dp[nt][e], lse2, delta_r, kDropout ? z[0][kDropout ? nt : 0][e] : 1.0f,
                             scale_log2, geo, r0 + r, c0 + k0 + nt * 8 + 2 * t + (e % 2), in_block);
                }
            }
        }
    } else {
        // Extensions, wide strips (kW >= 64: one warp per 16-query row tile holding every key of
        // the block; the dQ kernel up to head dim 128 on sm_80 / sm_90): S first, and at once its
        // factor of dS, f = P ∘ (1 − tanh²) (ext_ds_factor), in place; then dP, and dS = f ∘ (dP ∘ Z
        // − D_i). One value per element waits for dP (P and tanh did with ext_p_ds), and dropout's
        // keep bits are 4 words, not 32 floats of Z (with the running K/V pointers of the kernel
        // body: softcap, ALiBi, dropout at head dim 128 spilled 8-80 bytes at the 255 cap).
        constexpr bool kDropout = flash::HasExt<MaskExt<M>::value, flash::kExtDropout>::value;
        warp_mma<T, kHeadDim, kW, false, false>(s, Q_s + qt * 16 * L::kPitchD, L::kPitchD,
                                                 K_s + k0 * L::kPitchD, L::kPitchD);
        const auto& geo = geometry_of(mask);  // a block mask: looked up once per n8 tile (dkv_scores)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = qt * 16 + g + 8 * h;
            const float lse2 = lse2_s[r];
#pragma unroll
            for (int nt = 0; nt < kW / 8; ++nt) {
                const bool in_block = mask.block_visible(r0 + qt * 16, c0 + k0 + 16 * (nt / 2));
#pragma unroll
                for (int e = 2 * h; e < 2 * h + 2; ++e)
                    s[nt][e] = sel_block(in_block, ext_ds_factor(s[nt][e], lse2, scale_log2, geo, r0 + r,
                                                                 c0 + k0 + nt * 8 + 2 * t + e % 2));
            }
        }
        // Dropout's keep bits in the C layout (rows are queries: the forward's draw), as bits.
        uint32_t keep[kDropout ? kW / 16 : 1];
        if constexpr (kDropout) dropout_bits_mma<kW / 8>(keep, drop.rng, r0 + qt * 16, c0 + k0, lane);
        (void)drop; (void)keep;
        warp_mma<T, kHeadDimV, kW, false, false>(dp, dO_s + qt * 16 * L::kPitchDv, L::kPitchDv,
                                                  V_s + k0 * L::kPitchDv, L::kPitchDv);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float delta_r = delta_s[qt * 16 + g + 8 * h];
#pragma unroll
            for (int nt = 0; nt < kW / 8; ++nt)
#pragma unroll
                for (int e = 2 * h; e < 2 * h + 2; ++e) {
                    float z = 1.0f;  // dropout's Z = keep / (1 − p)
                    if constexpr (kDropout) z = keep_bit(keep, nt, e) ? drop.scale : 0.0f;
                    dp[nt][e] = s[nt][e] * (dp[nt][e] * z - delta_r);
                }
        }
    }
    c_to_a<T, kW / 16>(dS_a, dp);
}

// Tile `it` of the calling warp when tiles (tm, tn), tn < kCols, are dealt round-robin to kNWarps
// warps (tile = warp + it * kNWarps): split so that the part that depends on `it` is a constant.
template <int kNWarps, int kCols>
__device__ __forceinline__ void warp_tile(int warp, int it, int& tm, int& tn) {
    if constexpr (kNWarps % kCols == 0) {
        tm = warp / kCols + it * (kNWarps / kCols), tn = warp % kCols;
    } else if constexpr (kCols % kNWarps == 0) {
        tm = it / (kCols / kNWarps), tn = it % (kCols / kNWarps) * kNWarps + warp;
    } else {
        tm = (warp + it * kNWarps) / kCols, tn = (warp + it * kNWarps) % kCols;
    }
}

// Atomic mode: dQ_i += dS K_j into the float accumulator of query block i (DQAccumLayout,
// flash_bwd_common.cuh: no bounds test per atomic, each warp-wide RED 128 contiguous bytes), 16 x
// kDQCols tiles dealt round-robin to the warps; A = dS (Br x Bc) read from dS^T (stored Bc x Br)
// with ldmatrix.trans. Unscaled: the conversion pass applies the scale once.
template <typename T, class L, int kHeadDim, int kBlockM, int kBlockN, int kNWarps>
__device__ __forceinline__ void atomic_dq(float* dqa_i, const T* dSt_s, const T* K_s) {
    using A = DQAccumLayout<kHeadDim>;
    constexpr int kDQCols = A::kDQCols;
    constexpr int kDQTiles = (kBlockM / 16) * A::kColTiles;
    const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32;
    // Tile warp + it * kNWarps of the block: one per-lane address, then constant offsets.
    float* dst = dqa_i + warp * A::kTileFloats + lane;
#pragma unroll
    for (int it = 0; it < ceil_div_c(kDQTiles, kNWarps); ++it) {
        if (kDQTiles % kNWarps != 0 && warp + it * kNWarps >= kDQTiles) break;
        int tm, tn;
        warp_tile<kNWarps, A::kColTiles>(warp, it, tm, tn);
        float dq[kDQCols / 8][4];
        zero_acc(dq);
        warp_mma<T, kBlockN, kDQCols, true, true>(dq, dSt_s + tm * 16, L::kPitchS, K_s + tn * kDQCols, L::kPitchD);
#pragma unroll
        for (int n = 0; n < kDQCols / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                fa::atomic_add(dst + it * kNWarps * A::kTileFloats + (n * 4 + e) * 32, dq[n][e]);
    }
}

}  // namespace fa_bwd
using namespace fa_bwd;

// ---------------------------------------------------------------------------------------------
// dK_j, dV_j (and, with kAtomicDQ, atomic dQ): grid = (Tc, nb1 * nb2, nb0); n_group query batch
// entries share K_j, V_j (group strides on the query-side tensors).
// kOrderedDQ (the deterministic mode): the atomic dQ in a fixed order. Key block n adds dS K_j to
// query block i's accumulator only when key blocks 0 .. n-1 have added theirs (fa::sem_wait on
// query block i's counter until it equals n, fa::sem_post after), so every float sum of dQ runs
// n = 0, 1, 2, ... whatever the block timing (causal without lengths: descending, n_max(i), ..., 1,
// 0, with block x computing key block Tc - 1 - x; DQOrder): bitwise reproducible with 5 products per block pair
// (the separate dQ kernel recomputes S and dP: 7). The visitors of query block i are exactly key
// blocks n_lo(i) .. n_max(i) (dense and causal: n_lo = 0, key block n starts at m_block_min,
// nondecreasing in n, and visits every query block from there; so with the extensions that keep the
// visits — lengths, ALiBi, softcap, dropout; a window: n_lo(i) its left edge's key block, DQOrder's
// turn(i, Br, Bc, mask)), so counting visits is counting key blocks. A block mask's holes (tiles
// never visited) break the count: its instantiations wait for the previous visitor's rank instead
// (flash_bwd_ext.cuh's dq_turn: posts of rank(n) − rank(prev), the turn found past the holes). A block
// waits only for blocks of its batch entry with a smaller blockIdx.x, dispatched before it
// (fa::sem_wait's rule: no deadlock however few blocks are resident). The grid-layout kernel below can take its
// blocks entries first (kEntriesFirst, tiles_bwd.ENTRIES_FIRST: grid_pos, flash_bwd_common.cuh); this one spilled
// with it (8 bytes at d 96 causal) and keeps the grid's order. The counters are the
// DQOrderCounters ints after each batch entry's ceil(Lq / Br) * Br x D floats, cleared with them.
template <typename T, typename OutT, int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN,
          int kNWarps, bool kIsCausal, bool kAtomicDQ, bool kVecLoad, int kStages, int kExt = 0,
          bool kOrderedDQ = false>
__global__ void __launch_bounds__(kNWarps * 32, kMinBlocksPerSm) flash_bwd_dkv_kernel(
    const T* __restrict__ q, long long q_b0, long long q_b1, long long q_b2, long long q_g, long long q_row,
    const T* __restrict__ k, long long k_b0, long long k_b1, long long k_b2, long long k_row,
    const T* __restrict__ v, long long v_b0, long long v_b1, long long v_b2, long long v_row,
    const T* __restrict__ dout, long long do_b0, long long do_b1, long long do_b2, long long do_g, long long do_row,
    const float* __restrict__ lse, long long l_b0, long long l_b1, long long l_b2, long long l_g,
    const float* __restrict__ delta, long long d_b0, long long d_b1, long long d_b2, long long d_g,
    float* __restrict__ dq_accum, long long dqa_b0, long long dqa_b1, long long dqa_b2, long long dqa_g,
    long long dqa_row /* = kHeadDim (DQAccumLayout); unused */,
    OutT* __restrict__ dk, long long dk_b0, long long dk_b1, long long dk_b2, long long dk_row,
    OutT* __restrict__ dv, long long dv_b0, long long dv_b1, long long dv_b2, long long dv_row,
    int Lq, int Lk, int D, int Dv, int nb2, int n_group, float scale, FLASH_EXT_PARAMS(float)) {
    constexpr int kNThreads = kNWarps * 32;
    constexpr int kRowTiles = kBlockN / 16;         // 16-key row tiles of dK_j, dV_j
    constexpr int kSplit = kNWarps / kRowTiles;     // warps per row tile
    // Column slices of dK_j / dV_j per row tile: one per warp where the head dim divides evenly,
    // fewer otherwise (the remaining warps then own no dK_j / dV_j columns).
    constexpr int kSplitK = column_slices(kHeadDim, kSplit);
    constexpr int kSplitV = column_slices(kHeadDimV, kSplit);
    constexpr int kColsK = kHeadDim / kSplitK;      // dK_j columns per warp
    constexpr int kColsV = kHeadDimV / kSplitV;     // dV_j columns per warp
    // Score strips (dkv_scores): 16 keys x kW queries; one per warp where Br splits into kSplit
    // whole n16 steps, else 16 x 16 tiles spread over the warps.
    constexpr int kW = kBlockM % (16 * kSplit) == 0 ? kBlockM / kSplit : 16;
    constexpr int kStrips = kRowTiles * (kBlockM / kW);
    // One warp per 16-key row tile (kSplit = 1): its strip is every query of its dK_j, dV_j rows.
    constexpr bool kScoresInRegs = kSplit == 1;
    static_assert(kBlockM % 16 == 0 && kBlockN % 16 == 0, "Br and Bc must be multiples of 16 (mma tiles)");
    static_assert(kHeadDim % 16 == 0 && kHeadDimV % 16 == 0, "head dims are padded to multiples of 16");
    static_assert(kHeadDim <= 256 && kHeadDimV <= 256, "head dims up to 256");
    static_assert(kNWarps >= kRowTiles && kNWarps % kRowTiles == 0,
                  "warps must cover the Bc/16 row tiles of dK_j, dV_j an integer number of times");
    static_assert(!kScoresInRegs || (kW == kBlockM && kColsK == kHeadDim && kColsV == kHeadDimV),
                  "P^T, dS^T in registers need the warp's strip to span all of Br and its dK_j, dV_j rows");
    static_assert(kColsK % 16 == 0 && kColsV % 16 == 0 && kColsK * kSplitK == kHeadDim &&
                  kColsV * kSplitV == kHeadDimV, "each warp's dK/dV column slice must be whole n16 steps");
    static_assert(!kOrderedDQ || kAtomicDQ, "ordered dQ: the atomic mode's accumulator (turns: dq_turn)");
    using L = TcSmem<kHeadDim, kHeadDimV, kBlockM, kBlockN, true, kStages, kScoresInRegs>;

    FA_DYNAMIC_SMEM(smem);
    T* Q_buf = reinterpret_cast<T*>(smem + L::kQ);           // kStages x (Br x D)
    T* dO_buf = reinterpret_cast<T*>(smem + L::kdO);         // kStages x (Br x Dv)
    T* K_s = reinterpret_cast<T*>(smem + L::kK);             // Bc x D
    T* V_s = reinterpret_cast<T*>(smem + L::kV);             // Bc x Dv
    T* Pt_s = reinterpret_cast<T*>(smem + L::kP);            // P_ij^T  Bc x Br (none with kScoresInRegs)
    T* dSt_s = reinterpret_cast<T*>(smem + L::kdS);          // dS_ij^T Bc x Br
    float* lse2_s = reinterpret_cast<float*>(smem + L::kL);  // L_i * log2 e   Br
    float* delta_s = reinterpret_cast<float*>(smem + L::kDelta);  // D_i       Br

    const BatchIndex b = BatchIndex::from_grid(nb2);
    const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;  // mma C layout: rows g, g + 8; columns 2t, 2t + 1
    const int wm = warp / kSplit, wn = warp % kSplit;  // this warp's dK/dV row tile and slice
    const bool own_dK = wn < kSplitK, own_dV = wn < kSplitV;  // warp-uniform
    // The key block: blockIdx.x, or in the ordered causal mode Tc - 1 - blockIdx.x (DQOrder).
    using Order = DQOrderOf<kIsCausal, kOrderedDQ, kExt>;
    const Order dq_order = Order::make();
    const int c0 = dq_order.n * kBlockN;               // first key of K_j
    const float scale_log2 = scale * flash::kLog2e;
    // Extensions: the entry's lengths Lq_b, Lk_b (rows / keys past them are zero-filled, never
    // read; their gradients are written as zeros), window, block mask, softcap, ALiBi, dropout.
    // Without them (kExt = 0) Lq_b = Lq, Lk_b = Lk and the mask is the dense one.
    const flash::ExtArgs<float> ext = FLASH_EXT_ARGS(float);
    const int Lq_b = ext.template seqlen_q<kExt>(b, Lq), Lk_b = ext.template seqlen_k<kExt>(b, Lk);
    const auto mask = flash::make_mask<kIsCausal, kExt, float>(Lq_b, Lk_b, ext, b);
    const auto drop = BwdDropout<flash::HasExt<kExt, flash::kExtDropout>::value, float>::make(ext, b);
    const QueryTileWalk<decltype(mask)> walk{mask, c0, kBlockM, kBlockN};

    // The block visits (query batch entry grp of the group, query block i) pairs, i from i_begin
    // (causal: blocks above the diagonal are skipped) to Tr - 1, grp outer. With extensions (the
    // host launches them with n_group = 1): the tiles of QueryTileWalk.
    int i_begin = mask.m_block_min(c0, kBlockM);
    int Tr = (Lq + kBlockM - 1) / kBlockM;
    if constexpr (kExt != 0) {
        Tr = walk.end();
        i_begin = walk.next(i_begin - 1, Tr);
    }
    const int blocks_per_entry = kExt != 0 ? walk.count(i_begin, Tr) : (Tr > i_begin ? Tr - i_begin : 0);
    const int n_visits = kExt != 0 ? blocks_per_entry : blocks_per_entry * n_group;
    // Atomic modes: the accumulator of query batch entry grp (DQAccumLayout blocks, then, ordered,
    // the counters).
    auto dqa_entry = [&](int grp) {
        return dq_accum + b.offset({dqa_b0, dqa_b1, dqa_b2, 0}) + (long long)grp * dqa_g;
    };
    const DQOrderCounters<kBlockM, kHeadDim> order{Lq};
    // Query block i of group entry grp: Q_i, dO_i in global memory.
    auto q_block = [&](int grp, int i) {
        return q + b.offset({q_b0, q_b1, q_b2, q_row}) + (long long)grp * q_g + (long long)(i * kBlockM) * q_row;
    };
    auto do_block = [&](int grp, int i) {
        return dout + b.offset({do_b0, do_b1, do_b2, do_row}) + (long long)grp * do_g + (long long)(i * kBlockM) * do_row;
    };
    // Start the copies of query block i of group entry grp into buffer `buf` (cp.async, or loads).
    auto load_query_block = [&](int grp, int i, int buf) {
        const int r0 = i * kBlockM;
        load_tile_tc<T, kBlockM, kHeadDim, L::kPitchD, kNThreads, kVecLoad>(
            Q_buf + buf * L::kQStage, q_block(grp, i), q_row, Lq_b - r0, D);
        load_tile_tc<T, kBlockM, kHeadDimV, L::kPitchDv, kNThreads, kVecLoad>(
            dO_buf + buf * L::kdOStage, do_block(grp, i), do_row, Lq_b - r0, Dv);
    };
    // sm_75 (fa::kSyncCopy), single-buffered, dense: the next visit's Q_i, dO_i, L_i, D_i fetched during this
    // visit's math and put into shared memory at the next visit's start (fa::ChunkPrefetch, RowStats: loads
    // into registers, then stores), not loaded with the whole block waiting. Elsewhere load_query_block and
    // load_row_stats_exp (the emulator, whose kSyncCopy is true, runs the sm_75 path; its ChunkPrefetch::put
    // is the cp.async of load_query_block).
    // Only where a thread's chunks are one column of rows (kNThreads a multiple of the chunks per row: d 16,
    // 32, 64, 128, 256): at d 80 the other chunk order took the ordered kernel to 255 registers and 16 bytes
    // of spills.
    constexpr bool kPrefetchQ = fa::kSyncCopy && kStages == 1 && kExt == 0 && kVecLoad &&
                                kNThreads % (kHeadDim / 8) == 0 && kNThreads % (kHeadDimV / 8) == 0;
    TilePrefetch<T, kBlockM, kHeadDim, L::kPitchD, kNThreads> q_pf;
    TilePrefetch<T, kBlockM, kHeadDimV, L::kPitchDv, kNThreads> do_pf;
    auto lse_entry = [&](int grp) { return lse + b.offset({l_b0, l_b1, l_b2, 0}) + (long long)grp * l_g; };
    auto delta_entry = [&](int grp) { return delta + b.offset({d_b0, d_b1, d_b2, 0}) + (long long)grp * d_g; };
    RowStats<kBlockM, kNThreads> stats_pf;  // kPrefetchQ: the next visit's L_i, D_i
    // put = false: fetch query block i of entry grp (during the previous visit); true: put it (the same block)
    auto prefetch_query_block = [&](bool put, int grp, int i) {
        const int r0 = i * kBlockM;
        if (put)
            stats_pf.put(lse2_s, delta_s);
        else
            stats_pf.fetch(lse_entry(grp), delta_entry(grp), r0, Lq_b);
        prefetch_tile_tc<T, kBlockM, kHeadDim, L::kPitchD, kNThreads, kVecLoad>(q_pf, put, Q_buf, q_block(grp, i), q_row,
                                                                               Lq_b - r0, D);
        prefetch_tile_tc<T, kBlockM, kHeadDimV, L::kPitchDv, kNThreads, kVecLoad>(do_pf, put, dO_buf, do_block(grp, i),
                                                                                 do_row, Lq_b - r0, Dv);
    };

    // -- prologue: K_j, V_j (and, double-buffered, the first Q_i, dO_i) into shared memory.
    load_tile_tc<T, kBlockN, kHeadDim, L::kPitchD, kNThreads, kVecLoad>(
        K_s, k + b.offset({k_b0, k_b1, k_b2, k_row}) + (long long)c0 * k_row, k_row, Lk_b - c0, D);
    load_tile_tc<T, kBlockN, kHeadDimV, L::kPitchDv, kNThreads, kVecLoad>(
        V_s, v + b.offset({v_b0, v_b1, v_b2, v_row}) + (long long)c0 * v_row, v_row, Lk_b - c0, Dv);
    if (kStages == 2 && n_visits > 0) load_query_block(0, i_begin, 0);
    if (kPrefetchQ && n_visits > 0) prefetch_query_block(false, 0, i_begin);
    fa::cp_async_commit();

    float dK_acc[kColsK / 8][4];  // dK_j rows 16 wm.., columns kColsK wn..
    float dV_acc[kColsV / 8][4];  // dV_j rows 16 wm.., columns kColsV wn..
    zero_acc(dK_acc);
    zero_acc(dV_acc);

    // Visit (grp, i) and the next one (grp_n, i_n), stepped without divisions.
    int grp = 0, i = i_begin;
    int* posted = nullptr;  // ordered: the counter of the previous visit, posted after the next barrier
    int posted_add = 1;     // ... and thread 0's count to post (dq_turn: 1 without a block mask)
    // Ordered: thread 0 polls for its turn at query block i of entry grp (fa::sem_wait's first half).
    auto acquire_turn = [&](int grp, int i) {
        const DQTurn turn = dq_turn(dq_order, i, walk);
        fa::sem_acquire(order.counter(dqa_entry(grp), i), turn.expected);
        posted_add = turn.add;
    };
    for (int visit = 0; visit < n_visits; ++visit) {
        const int r0 = i * kBlockM;
        const bool wrap = i + 1 == Tr;
        int i_n = wrap ? i_begin : i + 1, grp_n = wrap ? grp + 1 : grp;
        if constexpr (flash::HasExt<kExt, flash::kExtBlockMask>::value) i_n = walk.next(i, Tr);
        // Extensions: one query batch entry per block (n_group = 1, the host's rule), so grp stays 0
        // and the group strides drop out of the loop (registers: the atomic kernel at head dim 128
        // with ALiBi, softcap, dropout and lengths spilled 12 bytes).
        if constexpr (kExt != 0) grp_n = 0;
        const int buf = kStages == 2 ? visit % 2 : 0;
        const T* Q_s = Q_buf + buf * L::kQStage;     // Q_i  Br x D
        const T* dO_s = dO_buf + buf * L::kdOStage;  // dO_i Br x Dv
        // Barrier: every warp is done with the previous visit: its Q_i/dO_i buffer (about to be
        // refilled), P^T_s, dS^T_s, L_i and D_i, and has issued its dQ atomics.
        __syncthreads();
        // Ordered: thread 0 posts the previous visit's turn (fa::sem_post's second half: this barrier followed
        // every thread's atomics), its release fence overlapping the other warps' copies instead of a barrier.
        if constexpr (kOrderedDQ)
            if (visit > 0 && threadIdx.x == 0) fa::sem_release(posted, posted_add);
        const bool prefetch = kStages == 2 && visit + 1 < n_visits;
        if (kPrefetchQ)
            prefetch_query_block(true, grp, i);
        else if (kStages == 1)
            load_query_block(grp, i, 0);
        if (prefetch) load_query_block(grp_n, i_n, buf ^ 1);  // overlaps this visit's math
        fa::cp_async_commit();
        if (!kPrefetchQ)
            load_row_stats_exp<kBlockM, kNThreads>(lse2_s, delta_s, lse_entry(grp), delta_entry(grp), r0, Lq_b);
        // This thread's copies of this visit's Q_i, dO_i (first time also K_j, V_j) landed; the
        // newest group (the prefetch) may still be in flight.
        if (prefetch)
            fa::cp_async_wait<1>();
        else
            fa::cp_async_wait<0>();
        // Barrier: every thread's copies and L_i, D_i are visible to every warp.
        __syncthreads();
        if (kPrefetchQ && visit + 1 < n_visits) prefetch_query_block(false, grp_n, i_n);  // put at the next visit's start

        if constexpr (kScoresInRegs) {
            // -- the warp's strip covers every query of its 16 keys: P^T, dS^T stay in registers as
            //    the A operands of dV_j += P^T dO_i and dK_j += dS^T Q_i (scale applied at the end).
            uint32_t P_a[kBlockM / 16][4], dS_a[kBlockM / 16][4];
            dkv_scores<T, L, kBlockM, kHeadDim, kHeadDimV>(P_a, dS_a, K_s, V_s, Q_s, dO_s, lse2_s, delta_s,
                                                          wm, 0, scale_log2, mask, drop, r0, c0);
            if (kAtomicDQ) {
                store_a<T, kBlockM / 16>(dSt_s + wm * 16 * L::kPitchS, L::kPitchS, dS_a);
                if constexpr (kOrderedDQ) {
                    // dV_j += P^T dO_i and dK_j += dS^T Q_i before the turn's wait (tensor-core work while
                    // the turn comes; P^T's and dS^T's registers free during dQ); then fa::sem_wait's first
                    // half, thread 0's poll, which the barrier below extends to the block. (Polling before
                    // the products, for other warps to overlap it, took 12-112 bytes of spills.)
                    warp_mma_rA<T, kBlockM, kColsV, true>(dV_acc, P_a, dO_s, L::kPitchDv);
                    warp_mma_rA<T, kBlockM, kColsK, true>(dK_acc, dS_a, Q_s, L::kPitchD);
                    if (threadIdx.x == 0) acquire_turn(grp, i);
                }
                // Barrier: dS^T complete before warps read its columns for dQ (ordered: and our turn).
                __syncthreads();
                // Atomic mode: dQ first, dV's and dK's dO_i / Q_i fragments then loaded after the barrier,
                // not held across the dQ product (ptxas overlaps products across the barrier, past the
                // 255-register cap at D = 64).
                atomic_dq<T, L, kHeadDim, kBlockM, kBlockN, kNWarps>(dqa_entry(grp) + (long long)r0 * kHeadDim,
                                                                     dSt_s, K_s);
                if constexpr (kOrderedDQ) posted = order.counter(dqa_entry(grp), i);  // released after the next barrier
            }
            if constexpr (!kOrderedDQ) {
                warp_mma_rA<T, kBlockM, kColsV, true>(dV_acc, P_a, dO_s, L::kPitchDv);
                warp_mma_rA<T, kBlockM, kColsK, true>(dK_acc, dS_a, Q_s, L::kPitchD);
            }
        } else {
            // -- S^T, dP^T in 16 x kW strips spread over the warps; P^T, dS^T to shared memory.
#pragma unroll
            for (int it = 0; it < ceil_div_c(kStrips, kNWarps); ++it) {
                if (kStrips % kNWarps != 0 && warp + it * kNWarps >= kStrips) break;
                int kt, q0;  // key row tile, first query of the strip
                warp_tile<kNWarps, kBlockM / kW>(warp, it, kt, q0);
                q0 *= kW;
                uint32_t P_a[kW / 16][4], dS_a[kW / 16][4];
                dkv_scores<T, L, kW, kHeadDim, kHeadDimV>(P_a, dS_a, K_s, V_s, Q_s, dO_s, lse2_s, delta_s,
                                                         kt, q0, scale_log2, mask, drop, r0, c0);
                store_a<T, kW / 16>(Pt_s + kt * 16 * L::kPitchS + q0, L::kPitchS, P_a);
                store_a<T, kW / 16>(dSt_s + kt * 16 * L::kPitchS + q0, L::kPitchS, dS_a);
            }
            // Barrier: P^T and dS^T complete before warps read them across strips.
            __syncthreads();
            // -- dV_j += P^T dO_i,  dK_j += dS^T Q_i  (scale applied once, at the end)
            if (own_dV)
                warp_mma<T, kBlockM, kColsV, false, true>(dV_acc, Pt_s + wm * 16 * L::kPitchS, L::kPitchS,
                                                           dO_s + wn * kColsV, L::kPitchDv);
            if (own_dK)
                warp_mma<T, kBlockM, kColsK, false, true>(dK_acc, dSt_s + wm * 16 * L::kPitchS, L::kPitchS,
                                                           Q_s + wn * kColsK, L::kPitchD);
            // -- atomic mode: dQ_i += dS K_j into the float accumulator (ordered: in turn, fa::sem_wait's halves:
            //    thread 0's poll, then the barrier extending it to the block).
            if constexpr (kOrderedDQ) {
                if (threadIdx.x == 0) acquire_turn(grp, i);
                __syncthreads();
            }
            if (kAtomicDQ)
                atomic_dq<T, L, kHeadDim, kBlockM, kBlockN, kNWarps>(dqa_entry(grp) + (long long)r0 * kHeadDim,
                                                                     dSt_s, K_s);
            if constexpr (kOrderedDQ) posted = order.counter(dqa_entry(grp), i);  // released after the next barrier
        }
        i = i_n, grp = grp_n;
    }
    // Ordered: the last visit's post (fa::sem_post).
    if constexpr (kOrderedDQ)
        if (n_visits > 0) fa::sem_post(posted, posted_add);

    fa::cp_async_wait<0>();  // no copy outlives the kernel when no query block was visited

    // -- epilogue: dK_j * scale and dV_j (rows < Lk, columns < D / Dv).
    if constexpr (kVecLoad && sizeof(OutT) == 2) {
        // Through shared memory: K_s and V_s (Bc x D, Bc x Dv at the same pitches) take the rounded
        // tiles, then every thread stores 16-byte chunks of whole rows (coalesced). dK, dV are
        // the driver's contiguous, aligned buffers; kVecLoad implies D, Dv % 8 == 0.
        OutT* dK_s = reinterpret_cast<OutT*>(K_s);
        OutT* dV_s = reinterpret_cast<OutT*>(V_s);
        // Barrier: every warp is done reading K_j, V_j (the last visit's products).
        __syncthreads();
        if (own_dK) stage_acc<OutT>(dK_s + wm * 16 * L::kPitchD + wn * kColsK, L::kPitchD, dK_acc, scale);
        if (own_dV) stage_acc<OutT>(dV_s + wm * 16 * L::kPitchDv + wn * kColsV, L::kPitchDv, dV_acc, 1.0f);
        // Barrier: the staged tiles are complete before threads read whole rows of them.
        __syncthreads();
        store_tile_vec<OutT, kBlockN, kHeadDim, L::kPitchD, kNThreads>(
            dk + b.offset({dk_b0, dk_b1, dk_b2, dk_row}) + (long long)c0 * dk_row, dk_row, dK_s, Lk - c0, D);
        store_tile_vec<OutT, kBlockN, kHeadDimV, L::kPitchDv, kNThreads>(
            dv + b.offset({dv_b0, dv_b1, dv_b2, dv_row}) + (long long)c0 * dv_row, dv_row, dV_s, Lk - c0, Dv);
    } else {
        // Element stores in the C layout (unaligned rows, or AccT partial sums).
        const int c_w = c0 + wm * 16;  // first key of this warp's row tile
        if (own_dK)
            store_acc<OutT>(dk + b.offset({dk_b0, dk_b1, dk_b2, dk_row}) + (long long)c_w * dk_row + wn * kColsK,
                            dk_row, dK_acc, scale, Lk - c_w, D - wn * kColsK);
        if (own_dV)
            store_acc<OutT>(dv + b.offset({dv_b0, dv_b1, dv_b2, dv_row}) + (long long)c_w * dv_row + wn * kColsV,
                            dv_row, dV_acc, 1.0f, Lk - c_w, Dv - wn * kColsV);
    }
}

// ---------------------------------------------------------------------------------------------
// dK_j, dV_j with atomic dQ (plain or ordered) in FlashAttention-2's warp grid (dense calls, or with window,
// ALiBi, softcap, block mask, dropout and per-entry lengths: tiles_bwd.GRID_EXT, less the sets that spilled):
// Bc = 32 kWK keys, 8 warps. Each product runs on 32-row warp tiles, so each ldmatrix feeds more MMAs
// than the row-tile kernel above (one warp per 16 keys: 16 x Br strips), whose products are bound by
// shared-memory reads (0.65 ldmatrix.x4 per MMA at d 128, 4 cycles each against ~2 per MMA):
//   S^T, dP^T   kWK x kWQ warps, each 32 keys x Br / kWQ queries (A = K_j / V_j rows, B = Q_i / dO_i rows);
//               P^T and dS^T go to shared memory (Bc x Br each);
//   dV_j, dK_j  kWK x kWQ warps, each 32 keys x D / kWQ (Dv / kWQ) columns, A = P^T / dS^T from shared
//               memory, B = dO_i / Q_i — dK_j, dV_j stay in registers (every visit, as above);
//   dQ_i        Br / 32 x 8 / (Br / 32) warps, each 32 queries x D / (8 / (Br / 32)) columns (d 64 / 128: one
//               DQAccumLayout tile per 16 rows, d 256: two, one pass each; the warp-wide atomics of the kernel
//               above), the first pass computed before the ordered mode's turn, so that only the atomics wait for it.
// Tiles (tiles_bwd.GRID_TILES): Bc x Br = 128 x 128 at d 64, 128 x 64 at d 128, 64 x 64 at d 256 (FlashAttention-2's
// d 256 tile: 32 x 16 score warp tiles, 32 x 64 dK / dV ones).
// Same grid, same visits (causal: from m_block_min; GQA: n_group entries; a block mask: QueryTileWalk's tiles, the
// ordered turns of dq_turn), same accumulator and counters,
// same rounding (P^T, dS^T rounded once to T; dS from the unrounded P) as flash_bwd_dkv_kernel (softcap:
// dS = f o (dP - D_i) with f = P o (1 - tanh^2) from the score's pass, ext_p_factor: another float association),
// same dropout bits (dropout_bits_t per 16-key m tile; P o Z and dS = P o (dP Z - D_i) as ext_p_ds computes them).
template <typename T, typename OutT, int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN,
          bool kIsCausal, bool kVecLoad, int kStages, bool kOrderedDQ, int kExt = 0, bool kSwizzle = false,
          bool kEntriesFirst = false>
__global__ void __launch_bounds__(256, kMinBlocksPerSm) flash_bwd_dkv_grid_kernel(
    const T* __restrict__ q, long long q_b0, long long q_b1, long long q_b2, long long q_g, long long q_row,
    const T* __restrict__ k, long long k_b0, long long k_b1, long long k_b2, long long k_row,
    const T* __restrict__ v, long long v_b0, long long v_b1, long long v_b2, long long v_row,
    const T* __restrict__ dout, long long do_b0, long long do_b1, long long do_b2, long long do_g, long long do_row,
    const float* __restrict__ lse, long long l_b0, long long l_b1, long long l_b2, long long l_g,
    const float* __restrict__ delta, long long d_b0, long long d_b1, long long d_b2, long long d_g,
    float* __restrict__ dq_accum, long long dqa_b0, long long dqa_b1, long long dqa_b2, long long dqa_g,
    long long dqa_row /* = kHeadDim (DQAccumLayout); unused */,
    OutT* __restrict__ dk, long long dk_b0, long long dk_b1, long long dk_b2, long long dk_row,
    OutT* __restrict__ dv, long long dv_b0, long long dv_b1, long long dv_b2, long long dv_row,
    int Lq, int Lk, int D, int Dv, int nb2, int n_group, float scale, FLASH_EXT_PARAMS(float)) {
    constexpr int kNWarps = 8, kNThreads = 256;
    constexpr int kWK = kBlockN / 32;                // warps along the keys (scores, dK_j / dV_j)
    constexpr int kWQ = kNWarps / kWK;               // ... along the queries (scores) / columns (dK, dV)
    constexpr int kSQ = kBlockM / kWQ;               // queries per warp's score tile
    constexpr int kCK = kHeadDim / kWQ, kCV = kHeadDimV / kWQ;  // dK_j / dV_j columns per warp
    constexpr int kQW = kBlockM / 32;                // dQ: warps along the queries
    constexpr int kDQW = kHeadDim / (kNWarps / kQW);  // dQ: columns per warp (kDQW / kDQCols accumulator tiles)
    using A = DQAccumLayout<kHeadDim>;
    static_assert(kBlockN % 32 == 0 && kNWarps % kWK == 0 && kBlockM % (16 * kWQ) == 0 && kSQ % 16 == 0,
                  "grid layout: 32-key warp tiles, score tiles of whole n16 steps");
    static_assert(kCK % 16 == 0 && kCV % 16 == 0, "grid layout: dK / dV column slices of whole n16 steps");
    static_assert(kBlockM % 32 == 0 && kNWarps % kQW == 0 && kHeadDim % (kNWarps / kQW) == 0 &&
                  kDQW % A::kDQCols == 0,
                  "grid layout: each warp's dQ tile is 32 rows of whole DQAccumLayout column tiles");
    static_assert(kStages == 1 && kBlockM <= 128, "grid layout: one buffer of Q_i, dO_i, refilled during dQ");
    static_assert(kExt == 0 || kVecLoad, "grid layout: extensions with 16-byte row copies (tiles_bwd.GRID_EXT)");
    using L = TcSmem<kHeadDim, kHeadDimV, kBlockM, kBlockN, true, kStages, false>;
    // kSwizzle: Q_i and dO_i, the tiles copied every visit, unpadded and XOR-swizzled (swz_chunk_offset) in their
    // padded buffers; K_j, V_j (copied once per block) keep the padded rows
    static_assert(!kSwizzle || (kVecLoad && kHeadDim % 64 == 0 && kHeadDimV % 64 == 0),
                  "grid layout: swizzled tiles need 16-byte row copies and head dims of whole 128-byte lines");
    constexpr int kSD = kSwizzle ? kHeadDim : L::kPitchD, kSDv = kSwizzle ? kHeadDimV : L::kPitchDv;  // Q_i, dO_i

    FA_DYNAMIC_SMEM(smem);
    T* Q_buf = reinterpret_cast<T*>(smem + L::kQ);
    T* dO_buf = reinterpret_cast<T*>(smem + L::kdO);
    T* K_s = reinterpret_cast<T*>(smem + L::kK);
    T* V_s = reinterpret_cast<T*>(smem + L::kV);
    T* Pt_s = reinterpret_cast<T*>(smem + L::kP);             // P_ij^T  Bc x Br
    T* dSt_s = reinterpret_cast<T*>(smem + L::kdS);           // dS_ij^T Bc x Br
    float* lse_s = reinterpret_cast<float*>(smem + L::kL);     // L_i (raw)  Br
    float* delta_s = reinterpret_cast<float*>(smem + L::kDelta);

    static_assert(!kEntriesFirst || kOrderedDQ, "entries first: the ordered dQ mode's block order (grid_pos)");
    const GridPos gpos = grid_pos<kEntriesFirst>();
    const BatchIndex b = batch_index_at(gpos, nb2);
    const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32;
    const int wk = warp / kWQ, wq = warp % kWQ;        // scores and dK/dV: keys 32 wk.., queries / columns
    const int wr = warp / (kNWarps / kQW), wc = warp % (kNWarps / kQW);  // dQ: rows 32 wr.., column tile wc
    using Order = DQOrderOf<kIsCausal, kOrderedDQ, kExt>;
    const Order dq_order = Order::make(gpos.x);
    const int c0 = dq_order.n * kBlockN;
    const float scale_log2 = scale * flash::kLog2e;
    const flash::ExtArgs<float> ext = FLASH_EXT_ARGS(float);
    // Per-entry lengths (kExt = kExtSeqlens): rows / keys past them zero-filled, never visited, their gradients
    // written as zeros; the host launches such calls with n_group = 1.
    const int Lq_b = ext.template seqlen_q<kExt>(b, Lq), Lk_b = ext.template seqlen_k<kExt>(b, Lk);
    const auto mask = flash::make_mask<kIsCausal, kExt, float>(Lq_b, Lk_b, ext, b);
    const auto drop = BwdDropout<flash::HasExt<kExt, flash::kExtDropout>::value, float>::make(ext, b);
    const QueryTileWalk<decltype(mask)> walk{mask, c0, kBlockM, kBlockN};
    constexpr bool kBlockMask = flash::HasExt<kExt, flash::kExtBlockMask>::value;
    const int Tr = kExt != 0 ? walk.end() : (Lq + kBlockM - 1) / kBlockM;
    // A block mask: the query tiles whose blocks are all False are skipped (QueryTileWalk::next), the first too.
    const int i_begin = kBlockMask ? walk.next(mask.m_block_min(c0, kBlockM) - 1, Tr) : mask.m_block_min(c0, kBlockM);
    const int n_visits = kBlockMask ? walk.count(i_begin, Tr) : (Tr > i_begin ? Tr - i_begin : 0) * n_group;
    auto dqa_entry = [&](int grp) { return dq_accum + b.offset({dqa_b0, dqa_b1, dqa_b2, 0}) + (long long)grp * dqa_g; };
    const DQOrderCounters<kBlockM, kHeadDim> order{Lq};
    // Q_i, dO_i and the raw L_i, D_i of query block i of group entry grp (cp.async; L_i, D_i as 4-byte copies by
    // threads 0 .. Br - 1 and 128 .. 127 + Br, zero past the entry's rows, read by grid_scores through lse2_of:
    // with zero-filled Q_i, dO_i rows a zero L_i gives P = 1 there and dS = 0, no term in dK_j, dV_j or dQ_i).
    auto load_query_block = [&](int grp, int i) {
        const int r0 = i * kBlockM;
        load_tile_tc<T, kBlockM, kHeadDim, kSD, kNThreads, kVecLoad, kSwizzle>(
            Q_buf, q + b.offset({q_b0, q_b1, q_b2, q_row}) + (long long)grp * q_g + (long long)r0 * q_row, q_row,
            Lq_b - r0, D);
        load_tile_tc<T, kBlockM, kHeadDimV, kSDv, kNThreads, kVecLoad, kSwizzle>(
            dO_buf, dout + b.offset({do_b0, do_b1, do_b2, do_row}) + (long long)grp * do_g + (long long)r0 * do_row,
            do_row, Lq_b - r0, Dv);
        const int r = (int)threadIdx.x % 128;
        if (r < kBlockM) {
            const bool in = r0 + r < Lq_b, is_lse = threadIdx.x < 128;
            const float* src = is_lse ? lse + b.offset({l_b0, l_b1, l_b2, 0}) + (long long)grp * l_g
                                      : delta + b.offset({d_b0, d_b1, d_b2, 0}) + (long long)grp * d_g;
            fa::cp_async<4>((is_lse ? lse_s : delta_s) + r, in ? src + r0 + r : src, in ? 4 : 0);
        }
    };

    load_tile_tc<T, kBlockN, kHeadDim, L::kPitchD, kNThreads, kVecLoad>(
        K_s, k + b.offset({k_b0, k_b1, k_b2, k_row}) + (long long)c0 * k_row, k_row, Lk_b - c0, D);
    load_tile_tc<T, kBlockN, kHeadDimV, L::kPitchDv, kNThreads, kVecLoad>(
        V_s, v + b.offset({v_b0, v_b1, v_b2, v_row}) + (long long)c0 * v_row, v_row, Lk_b - c0, Dv);
    if (n_visits > 0) load_query_block(0, i_begin);
    fa::cp_async_commit();

    float dK_acc[2][kCK / 8][4];  // dK_j rows 32 wk.., columns kCK wq..
    float dV_acc[2][kCV / 8][4];
    zero_acc(dK_acc[0]); zero_acc(dK_acc[1]);
    zero_acc(dV_acc[0]); zero_acc(dV_acc[1]);

    int grp = 0, i = i_begin;
    int* posted = nullptr;  // ordered: the counter of the previous visit, posted after the next barrier
    int posted_add = 1;     // ... and thread 0's count to post (dq_turn: 1 without a block mask)
    for (int visit = 0; visit < n_visits; ++visit) {
        const int r0 = i * kBlockM;
        const bool wrap = i + 1 == Tr;
        const int i_n = kBlockMask ? walk.next(i, Tr) : wrap ? i_begin : i + 1;
        const int grp_n = kExt != 0 ? 0 : wrap ? grp + 1 : grp;
        const T* Q_s = Q_buf;
        const T* dO_s = dO_buf;
        // This visit's Q_i, dO_i, L_i, D_i: copies started in the prologue or in the previous visit, once its
        // last product had read them (below), overlapping its dQ product, atomics and turn.
        fa::cp_async_wait<0>();
        // Barrier: every thread's copies are visible to every warp (and every warp is done with the previous
        // visit's P^T, dS^T and has issued its dQ atomics).
        __syncthreads();
        // Ordered: thread 0 posts the previous visit's turn (fa::sem_post's two halves: this barrier followed every
        // thread's atomics), its release overlapping the other warps' work instead of holding a barrier.
        if constexpr (kOrderedDQ)
            if (visit > 0 && threadIdx.x == 0) fa::sem_release(posted, posted_add);
        grid_scores<T, L, kSQ, kHeadDim, kHeadDimV, decltype(mask), decltype(drop), kSwizzle>(
            Pt_s, dSt_s, K_s, V_s, Q_s, dO_s, lse_s, delta_s, wk, wq, scale_log2, mask, drop, r0, c0);
        // Barrier: P^T and dS^T complete before warps read them across score tiles.
        __syncthreads();
        // (swizzled: the column origin apart from the tile, LaneCols)
        warp_mma_m<T, 2, kBlockM, kCV, false, true, false, kSwizzle>(dV_acc, Pt_s + 32 * wk * L::kPitchS, L::kPitchS,
                                                                     dO_s + (kSwizzle ? 0 : wq * kCV), kSDv, 0,
                                                                     kSwizzle ? wq * kCV : 0);
        warp_mma_m<T, 2, kBlockM, kCK, false, true, false, kSwizzle>(dK_acc, dSt_s + 32 * wk * L::kPitchS, L::kPitchS,
                                                                     Q_s + (kSwizzle ? 0 : wq * kCK), kSD, 0,
                                                                     kSwizzle ? wq * kCK : 0);
        if (visit + 1 < n_visits) {
            // Barrier: every warp is done reading Q_i, dO_i, L_i, D_i; the next visit's copies overlap dQ.
            __syncthreads();
            load_query_block(grp_n, i_n);
            fa::cp_async_commit();
        }
        // Ordered: fa::sem_wait in its two halves — thread 0 polls for the turn now, while the other warps run
        // their dQ products; the barrier after them extends what it acquired to the block.
        if constexpr (kOrderedDQ)
            if (threadIdx.x == 0) {
                const DQTurn turn = dq_turn(dq_order, i, walk);
                fa::sem_acquire(order.counter(dqa_entry(grp), i), turn.expected);
                posted_add = turn.add;
            }
        float* dqa_i = dqa_entry(grp) + (long long)r0 * kHeadDim;
        // The warp's kDQW columns in passes of one DQAccumLayout column tile (d 256: two; their 64 floats at once
        // beside dK_j, dV_j spilled 136-188 bytes, two passes unrolled 64-128 in the atomic mode: a rolled loop);
        // the ordered turn before the first pass's atomics.
#pragma unroll 1
        for (int ps = 0; ps < kDQW / A::kDQCols; ++ps) {
            float dq[2][A::kDQCols / 8][4];  // dQ_i rows 32 wr.., one column tile (dS K_j, unscaled)
            zero_acc(dq[0]); zero_acc(dq[1]);
            const int ct = wc * (kDQW / A::kDQCols) + ps;  // its DQAccumLayout column tile
            warp_mma_m<T, 2, kBlockN, A::kDQCols, true, true>(dq, dSt_s + 32 * wr, L::kPitchS,
                                                              K_s + ct * A::kDQCols, L::kPitchD);
            // Barrier: our turn, for every thread.
            if constexpr (kOrderedDQ)
                if (ps == 0) __syncthreads();
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                float* dst = dqa_i + ((2 * wr + mt) * A::kColTiles + ct) * A::kTileFloats + lane;
#pragma unroll
                for (int n = 0; n < A::kDQCols / 8; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) fa::atomic_add(dst + (n * 4 + e) * 32, dq[mt][n][e]);
            }
        }
        if constexpr (kOrderedDQ) posted = order.counter(dqa_entry(grp), i);  // released after the next barrier
        i = i_n, grp = grp_n;
    }
    // Ordered: the last visit's post (fa::sem_post).
    if constexpr (kOrderedDQ)
        if (n_visits > 0) fa::sem_post(posted, posted_add);

    fa::cp_async_wait<0>();
    // -- epilogue: dK_j * scale and dV_j (rows < Lk, columns < D / Dv).
    const int c_w = 32 * wk;  // first key of this warp's rows
    if constexpr (kVecLoad && sizeof(OutT) == 2) {
        OutT* dK_s = reinterpret_cast<OutT*>(K_s);
        OutT* dV_s = reinterpret_cast<OutT*>(V_s);
        // Barrier: every warp is done reading K_j, V_j.
        __syncthreads();
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            stage_acc<OutT>(dK_s + (c_w + 16 * mt) * L::kPitchD + wq * kCK, L::kPitchD, dK_acc[mt], scale);
            stage_acc<OutT>(dV_s + (c_w + 16 * mt) * L::kPitchDv + wq * kCV, L::kPitchDv, dV_acc[mt], 1.0f);
        }
        // Barrier: the staged tiles are complete before threads read whole rows of them.
        __syncthreads();
        store_tile_vec<OutT, kBlockN, kHeadDim, L::kPitchD, kNThreads>(
            dk + b.offset({dk_b0, dk_b1, dk_b2, dk_row}) + (long long)c0 * dk_row, dk_row, dK_s, Lk - c0, D);
        store_tile_vec<OutT, kBlockN, kHeadDimV, L::kPitchDv, kNThreads>(
            dv + b.offset({dv_b0, dv_b1, dv_b2, dv_row}) + (long long)c0 * dv_row, dv_row, dV_s, Lk - c0, Dv);
    } else {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            const int c_m = c0 + c_w + 16 * mt;
            store_acc<OutT>(dk + b.offset({dk_b0, dk_b1, dk_b2, dk_row}) + (long long)c_m * dk_row + wq * kCK,
                            dk_row, dK_acc[mt], scale, Lk - c_m, D - wq * kCK);
            store_acc<OutT>(dv + b.offset({dv_b0, dv_b1, dv_b2, dv_row}) + (long long)c_m * dv_row + wq * kCV,
                            dv_row, dV_acc[mt], 1.0f, Lk - c_m, Dv - wq * kCV);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Deterministic dQ: grid = (Tr, nb1 * nb2, nb0). Recomputes S and dP per key block (2 of the 5
// backward products again), dQ_i in registers split as (Br / 16 row tiles) x kSplit slices.
template <typename T, typename OutT, int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN,
          int kNWarps, bool kIsCausal, bool kVecLoad, int kStages, int kExt = 0>
__global__ void __launch_bounds__(kNWarps * 32, kMinBlocksPerSm) flash_bwd_dq_kernel(
    const T* __restrict__ q, long long q_b0, long long q_b1, long long q_b2, long long q_row,
    const T* __restrict__ k, long long k_b0, long long k_b1, long long k_b2, long long k_row,
    const T* __restrict__ v, long long v_b0, long long v_b1, long long v_b2, long long v_row,
    const T* __restrict__ dout, long long do_b0, long long do_b1, long long do_b2, long long do_row,
    const float* __restrict__ lse, long long l_b0, long long l_b1, long long l_b2,
    const float* __restrict__ delta, long long d_b0, long long d_b1, long long d_b2,
    OutT* __restrict__ dq, long long dq_b0, long long dq_b1, long long dq_b2, long long dq_row,
    int Lq, int Lk, int D, int Dv, int nb2, float scale, FLASH_EXT_PARAMS(float)) {
    constexpr int kNThreads = kNWarps * 32;
    constexpr int kRowTiles = kBlockM / 16;       // 16-row tiles of dQ_i
    constexpr int kSplit = kNWarps / kRowTiles;   // warps per row tile
    // Column slices of dQ_i per row tile (fewer than kSplit when D does not divide evenly).
    constexpr int kSplitQ = column_slices(kHeadDim, kSplit);
    constexpr int kColsQ = kHeadDim / kSplitQ;    // dQ_i columns per warp
    // Score strips (dq_scores): 16 queries x kW keys; one per warp where Bc splits into kSplit
    // whole n16 steps, else 16 x 16 tiles spread over the warps.
    constexpr int kW = kBlockN % (16 * kSplit) == 0 ? kBlockN / kSplit : 16;
    constexpr int kStrips = kRowTiles * (kBlockN / kW);
    // One warp per 16-query row tile (kSplit = 1): its strip is every key of its dQ_i rows.
    constexpr bool kScoresInRegs = kSplit == 1;
    static_assert(kBlockM % 16 == 0 && kBlockN % 16 == 0, "Br and Bc must be multiples of 16 (mma tiles)");
    static_assert(kHeadDim % 16 == 0 && kHeadDimV % 16 == 0, "head dims are padded to multiples of 16");
    static_assert(kHeadDim <= 256 && kHeadDimV <= 256, "head dims up to 256");
    static_assert(kNWarps >= kRowTiles && kNWarps % kRowTiles == 0,
                  "warps must cover the Br/16 row tiles of dQ_i an integer number of times");
    static_assert(kColsQ % 16 == 0 && kColsQ * kSplitQ == kHeadDim,
                  "each warp's dQ column slice must be whole n16 steps");
    static_assert(!kScoresInRegs || (kW == kBlockN && kColsQ == kHeadDim),
                  "dS in registers needs the warp's strip to span all of Bc and its dQ_i rows");
    using L = TcSmem<kHeadDim, kHeadDimV, kBlockM, kBlockN, false, kStages>;

    FA_DYNAMIC_SMEM(smem);
    T* Q_s = reinterpret_cast<T*>(smem + L::kQ);             // Br x D
    T* dO_s = reinterpret_cast<T*>(smem + L::kdO);           // Br x Dv
    T* K_buf = reinterpret_cast<T*>(smem + L::kK);           // kStages x (Bc x D)
    T* V_buf = reinterpret_cast<T*>(smem + L::kV);           // kStages x (Bc x Dv)
    T* dS_s = reinterpret_cast<T*>(smem + L::kdS);           // dS_ij Br x Bc
    float* lse2_s = reinterpret_cast<float*>(smem + L::kL);  // L_i * log2 e   Br
    float* delta_s = reinterpret_cast<float*>(smem + L::kDelta);  // D_i       Br

    const BatchIndex b = BatchIndex::from_grid(nb2);
    const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;  // mma C layout: rows g, g + 8; columns 2t, 2t + 1
    const int wm = warp / kSplit, wn = warp % kSplit;  // this warp's dQ row tile and slice
    const bool own_dQ = wn < kSplitQ;                  // warp-uniform
    const int r0 = (int)blockIdx.x * kBlockM;          // first row of Q_i
    const float scale_log2 = scale * flash::kLog2e;
    // Extensions: as in the dK/dV kernel (Lq_b = Lq, Lk_b = Lk and the dense mask without them).
    const flash::ExtArgs<float> ext = FLASH_EXT_ARGS(float);
    const int Lq_b = ext.template seqlen_q<kExt>(b, Lq), Lk_b = ext.template seqlen_k<kExt>(b, Lk);
    const auto mask = flash::make_mask<kIsCausal, kExt, float>(Lq_b, Lk_b, ext, b);
    const auto drop = BwdDropout<flash::HasExt<kExt, flash::kExtDropout>::value, float>::make(ext, b);

    // -- prologue: Q_i, dO_i, L_i, D_i into shared memory, once.
    load_tile_tc<T, kBlockM, kHeadDim, L::kPitchD, kNThreads, kVecLoad>(
        Q_s, q + b.offset({q_b0, q_b1, q_b2, q_row}) + (long long)r0 * q_row, q_row, Lq_b - r0, D);
    load_tile_tc<T, kBlockM, kHeadDimV, L::kPitchDv, kNThreads, kVecLoad>(
        dO_s, dout + b.offset({do_b0, do_b1, do_b2, do_row}) + (long long)r0 * do_row, do_row, Lq_b - r0, Dv);
    load_row_stats_exp<kBlockM, kNThreads>(lse2_s, delta_s, lse + b.offset({l_b0, l_b1, l_b2, 0}),
                                           delta + b.offset({d_b0, d_b1, d_b2, 0}), r0, Lq_b);

    float dQ_acc[kColsQ / 8][4];  // dQ_i rows 16 wm.., columns kColsQ wn..
    zero_acc(dQ_acc);

    const T* k_b = k + b.offset({k_b0, k_b1, k_b2, k_row});
    const T* v_b = v + b.offset({v_b0, v_b1, v_b2, v_row});
    const int Tc = mask.n_block_max(r0, kBlockM, kBlockN);  // causal: blocks right of the diagonal skipped
    // Extensions: key tiles from the window's left edge, all-False block-mask tiles skipped.
    const flash::KeyTileWalk<kIsCausal, kExt, float> walk{mask, r0, kBlockM, kBlockN, 0};
    int j_first = 0;
    if constexpr (kExt != 0) j_first = walk.next(mask.n_block_min(r0, kBlockN) - 1, Tc);
    // Start the copies of key block j's K_j, V_j (rows k_j, v_j) into buffer `buf` (cp.async, or loads).
    auto load_key_block = [&](int j, const T* k_j, const T* v_j, int buf) {
        const int c0 = j * kBlockN;
        load_tile_tc<T, kBlockN, kHeadDim, L::kPitchD, kNThreads, kVecLoad>(
            K_buf + buf * L::kKStage, k_j, k_row, Lk_b - c0, D);
        load_tile_tc<T, kBlockN, kHeadDimV, L::kPitchDv, kNThreads, kVecLoad>(
            V_buf + buf * L::kVStage, v_j, v_row, Lk_b - c0, Dv);
    };
    const long long k_step = kBlockN * k_row, v_step = kBlockN * v_row;
    if (kStages == 2 && Tc > j_first)
        load_key_block(j_first, k_b + (long long)j_first * k_step, v_b + (long long)j_first * v_step, 0);
    fa::cp_async_commit();  // one group: Q_i, dO_i (and, double-buffered, K_0, V_0)
    // The next key block to load (j + 1 double-buffered, else j): running pointers, one 64-bit add
    // per block instead of a 64-bit multiply (extensions: from the visited tile's index).
    const T* k_load = kStages == 2 ? k_b + k_step : k_b;
    const T* v_load = kStages == 2 ? v_b + v_step : v_b;
    // Extensions: set per visit from the tile's index (below), or, without a block mask (the visited
    // tiles are j_first, j_first + 1, ...), running from j_first where that spills less: the
    // one-warp-per-row-tile or single-buffered kernels (softcap, ALiBi, dropout at head dim 128 on
    // sm_80 / sm_90 and 256 on sm_80 spilled without it; the double-buffered d 256 one on sm_90
    // spills with it).
    constexpr bool kRunningExt = kExt != 0 && !flash::HasExt<kExt, flash::kExtBlockMask>::value &&
                                 (kScoresInRegs || kStages == 1);
    if constexpr (kRunningExt) {
        k_load += (long long)j_first * k_step;
        v_load += (long long)j_first * v_step;
    }
    // sm_75 (fa::kSyncCopy), single-buffered, dense: the next key block's K_j, V_j fetched during this
    // block's math and put into shared memory at the next block's start (fa::ChunkPrefetch), as the dK/dV
    // kernel's query blocks; elsewhere load_key_block.
    constexpr bool kPrefetchK = fa::kSyncCopy && kStages == 1 && kExt == 0 && kVecLoad &&
                                kNThreads % (kHeadDim / 8) == 0 && kNThreads % (kHeadDimV / 8) == 0;
    TilePrefetch<T, kBlockN, kHeadDim, L::kPitchD, kNThreads> k_pf;
    TilePrefetch<T, kBlockN, kHeadDimV, L::kPitchDv, kNThreads> v_pf;
    // put = false: fetch key block j (during the previous block); true: put it (the same block)
    auto prefetch_key_block = [&](bool put, int j, const T* k_j, const T* v_j) {
        const int c0 = j * kBlockN;
        prefetch_tile_tc<T, kBlockN, kHeadDim, L::kPitchD, kNThreads, kVecLoad>(k_pf, put, K_buf, k_j, k_row, Lk_b - c0, D);
        prefetch_tile_tc<T, kBlockN, kHeadDimV, L::kPitchDv, kNThreads, kVecLoad>(v_pf, put, V_buf, v_j, v_row, Lk_b - c0,
                                                                                 Dv);
    };
    if (kPrefetchK && Tc > j_first) prefetch_key_block(false, j_first, k_load, v_load);
    // sm_75, double-buffered, dense: the next key block staged (fa::ChunkStage) into the free buffer at the
    // block's start and landed at its end, so its loads overlap the block's math (elsewhere the cp.async at
    // the start, as load_key_block).
    constexpr bool kStageNextK = fa::kSyncCopy && kStages == 2 && kExt == 0 && kVecLoad &&
                                 kNThreads % (kHeadDim / 8) == 0 && kNThreads % (kHeadDimV / 8) == 0;
    using KStage = TileStage<T, kBlockN, kHeadDim, L::kPitchD, kNThreads>;
    using VStage = TileStage<T, kBlockN, kHeadDimV, L::kPitchDv, kNThreads>;
    // land = false: stage key block j into buffer buf (free); true: land it (the same block)
    auto stage_key_block = [&](bool land, KStage& k_st, VStage& v_st, int j, const T* k_j, const T* v_j, int buf) {
        const int c0 = j * kBlockN;
        stage_tile_tc<T, kBlockN, kHeadDim, L::kPitchD, kNThreads>(k_st, land, K_buf + buf * L::kKStage, k_j, k_row,
                                                                   Lk_b - c0, D);
        stage_tile_tc<T, kBlockN, kHeadDimV, L::kPitchDv, kNThreads>(v_st, land, V_buf + buf * L::kVStage, v_j, v_row,
                                                                     Lk_b - c0, Dv);
    };

    int visit = 0;  // visits so far (= j without extensions): the double buffer's parity
    for (int j = j_first; j < Tc; ++visit) {
        const int j_next = walk.next(j, Tc);  // j + 1 without a block mask
        const int c0 = j * kBlockN;
        const int buf = kStages == 2 ? (kExt == 0 ? j : visit) % 2 : 0;
        const T* K_s = K_buf + buf * L::kKStage;  // K_j Bc x D
        const T* V_s = V_buf + buf * L::kVStage;  // V_j Bc x Dv
        // Barrier: every warp is done with the previous key block: its K/V buffer (about to be
        // refilled) and dS_s.
        __syncthreads();
        const bool prefetch = kStages == 2 && j_next < Tc;
        if constexpr (kExt != 0 && !kRunningExt) {
            k_load = k_b + (long long)(kStages == 2 ? j_next : j) * k_step;
            v_load = v_b + (long long)(kStages == 2 ? j_next : j) * v_step;
        }
        if (kPrefetchK)
            prefetch_key_block(true, j, k_load, v_load);
        else if (kStages == 1)
            load_key_block(j, k_load, v_load, 0);
        KStage k_st;
        VStage v_st;
        const T* const k_next = k_load;
        const T* const v_next = v_load;
        if (prefetch) {  // overlaps this block's math
            if constexpr (kStageNextK)
                stage_key_block(false, k_st, v_st, j_next, k_next, v_next, buf ^ 1);
            else
                load_key_block(j_next, k_load, v_load, buf ^ 1);
        }
        k_load += k_step;
        v_load += v_step;
        fa::cp_async_commit();
        // This thread's copies of K_j, V_j (first time also Q_i, dO_i) landed; the newest group
        // (the prefetch) may still be in flight.
        if (prefetch)
            fa::cp_async_wait<1>();
        else
            fa::cp_async_wait<0>();
        // Barrier: every thread's copies are visible to every warp.
        __syncthreads();
        if (kPrefetchK && j_next < Tc) prefetch_key_block(false, j_next, k_load, v_load);  // put at the next block's start

        if constexpr (kScoresInRegs) {
            // -- the warp's strip covers every key of its 16 queries: dS stays in registers as the
            //    A operand of dQ_i += dS K_j (scale applied once, at the end).
            uint32_t dS_a[kBlockN / 16][4];
            dq_scores<T, L, kBlockN, kHeadDim, kHeadDimV>(dS_a, Q_s, dO_s, K_s, V_s, lse2_s, delta_s, wm, 0,
                                                         scale_log2, mask, drop, r0, c0);
            warp_mma_rA<T, kBlockN, kColsQ, true>(dQ_acc, dS_a, K_s, L::kPitchD);
        } else {
            // -- S, dP in 16 x kW strips spread over the warps; dS to shared memory.
#pragma unroll
            for (int it = 0; it < ceil_div_c(kStrips, kNWarps); ++it) {
                if (kStrips % kNWarps != 0 && warp + it * kNWarps >= kStrips) break;
                int qt, k0;  // query row tile, first key of the strip
                warp_tile<kNWarps, kBlockN / kW>(warp, it, qt, k0);
                k0 *= kW;
                uint32_t dS_a[kW / 16][4];
                dq_scores<T, L, kW, kHeadDim, kHeadDimV>(dS_a, Q_s, dO_s, K_s, V_s, lse2_s, delta_s, qt, k0,
                                                        scale_log2, mask, drop, r0, c0);
                store_a<T, kW / 16>(dS_s + qt * 16 * L::kPitchS + k0, L::kPitchS, dS_a);
            }
            // Barrier: dS complete before warps read whole rows of it.
            __syncthreads();
            // -- dQ_i += dS K_j  (scale applied once, at the end)
            if (own_dQ)
                warp_mma<T, kBlockN, kColsQ, false, true>(dQ_acc, dS_s + wm * 16 * L::kPitchS, L::kPitchS,
                                                           K_s + wn * kColsQ, L::kPitchD);
        }
        if (kStageNextK && prefetch) stage_key_block(true, k_st, v_st, j_next, k_next, v_next, buf ^ 1);
        j = j_next;
    }

    fa::cp_async_wait<0>();  // no copy outlives the kernel when no key block was visited

    // -- epilogue: dQ_i * scale (rows < Lq, columns < D); a row that sees no key writes zeros.
    if constexpr (kVecLoad && sizeof(OutT) == 2) {
        // Through shared memory (Q_s: Br x D at the same pitch), then 16-byte chunks of whole rows.
        OutT* dQ_s = reinterpret_cast<OutT*>(Q_s);
        // Barrier: every warp is done reading Q_i (the last key block's products).
        __syncthreads();
        if (own_dQ) stage_acc<OutT>(dQ_s + wm * 16 * L::kPitchD + wn * kColsQ, L::kPitchD, dQ_acc, scale);
        // Barrier: the staged tile is complete before threads read whole rows of it.
        __syncthreads();
        store_tile_vec<OutT, kBlockM, kHeadDim, L::kPitchD, kNThreads>(
            dq + b.offset({dq_b0, dq_b1, dq_b2, dq_row}) + (long long)r0 * dq_row, dq_row, dQ_s, Lq - r0, D);
    } else {
        const int r_w = r0 + wm * 16;
        if (own_dQ)
            store_acc<OutT>(dq + b.offset({dq_b0, dq_b1, dq_b2, dq_row}) + (long long)r_w * dq_row + wn * kColsQ,
                            dq_row, dQ_acc, scale, Lq - r_w, D - wn * kColsQ);
    }
}
