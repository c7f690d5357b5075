// flash_bwd_simt.cu — FlashAttention-2 backward without tensor cores (fp32, fp64; also any T as
// a fallback), scalar FMAs on shared-memory tiles.
//
//   Q_i  Br x D   dO_i Br x Dv   L_i, D_i  Br      (query side, block i)
//   K_j  Bc x D   V_j  Bc x Dv                     (key side, block j)
//   P_ij, dS_ij  Br x Bc  (shared memory, AccT; recomputed from Q_i, K_j and L_i)
// Two kernels:
//   flash_bwd_dkv_simt_kernel: one block per (key block j, batch). K_j, V_j stay in shared memory
//     while the block walks the query blocks i (and the query batch entries of the MQA/GQA group
//     that share K_j, V_j): dV_j += P_ij^T dO_i, dK_j += dS_ij^T Q_i * scale, accumulated in
//     registers, written once. With kAtomicDQ it also adds dS_ij K_j * scale into an AccT dQ
//     accumulator with atomics (fast, not bitwise reproducible).
//   flash_bwd_dq_simt_kernel (deterministic dQ): one block per (query block i, batch); Q_i, dO_i
//     stay in shared memory while the block walks the key blocks j, recomputing P_ij and dS_ij:
//     dQ_i += dS_ij K_j * scale in registers, written once. No atomics: bitwise reproducible.
#include "flash_bwd_common.cuh"
#include "flash_bwd_ext.cuh"  // the extensions (kExt != 0): ext_p_ds, BwdDropout, QueryTileWalk

namespace fa_bwd {

// Shared-memory tile pitch: one extra element (at least one 4-byte word) per row, so the
// threads of a warp that read the same column of consecutive rows hit different banks.
template <typename T, int kCols>
struct SimtPitch {
    static constexpr int value = kCols + (sizeof(T) >= 4 ? 1 : 4 / (int)sizeof(T));
};

// Shared-memory layout of the SIMT backward, in bytes; flasharray/_private/tiles_bwd.py mirrors it.
// (The dQ kernel does not use P_ij; both kernels share one layout and one smem formula.)
template <typename T, typename AccT, int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN>
struct SimtSmem {
    static constexpr int kPitchD = SimtPitch<T, kHeadDim>::value;
    static constexpr int kPitchDv = SimtPitch<T, kHeadDimV>::value;
    static constexpr int kQ = 0;                                                       // Q_i  Br x D
    static constexpr int kdO = kQ + align16(kBlockM * kPitchD * (int)sizeof(T));       // dO_i Br x Dv
    static constexpr int kK = kdO + align16(kBlockM * kPitchDv * (int)sizeof(T));      // K_j  Bc x D
    static constexpr int kV = kK + align16(kBlockN * kPitchD * (int)sizeof(T));        // V_j  Bc x Dv
    static constexpr int kP = kV + align16(kBlockN * kPitchDv * (int)sizeof(T));       // P_ij Br x Bc
    static constexpr int kdS = kP + align16(kBlockM * kBlockN * (int)sizeof(AccT));    // dS_ij Br x Bc
    static constexpr int kL = kdS + align16(kBlockM * kBlockN * (int)sizeof(AccT));    // L_i*log2e  Br
    static constexpr int kDelta = kL + align16(kBlockM * (int)sizeof(AccT));           // D_i  Br
    static constexpr int kBytes = kDelta + align16(kBlockM * (int)sizeof(AccT));
};

// Copy a rows x cols tile of a strided global matrix into shared memory (pitch `pitch`),
// zero-filling rows >= n_rows and columns >= n_cols (the padded head dimension).
template <typename T, int kRows, int kCols, int kPitch, int kNThreads>
__device__ __forceinline__ void load_tile(T* smem, const T* gmem, long long row_stride, int n_rows,
                                          int n_cols) {
    for (int e = (int)threadIdx.x; e < kRows * kCols; e += kNThreads) {
        const int r = e / kCols, c = e % kCols;
        smem[r * kPitch + c] =
            (r < n_rows && c < n_cols) ? fa::gload(gmem + (long long)r * row_stride + c) : FromAcc<T>::convert(0);
    }
}

// Dot product of two kN-element rows in AccT with kDotLanes independent partial sums combined
// pairwise: S and dP are sums over the whole head dim (up to 256 terms), where one running sum
// loses ~kN/kDotLanes times more to rounding than the recomputed P can afford (P = exp(S - L)
// turns an absolute error of S into a relative error of P). Also kDotLanes-way ILP.
constexpr int kDotLanes = 8;
template <typename AccT, int kN, typename T>
__device__ __forceinline__ AccT dot(const T* a, const T* b) {
    static_assert(kN % kDotLanes == 0, "head dims are padded to multiples of 16");
    AccT part[kDotLanes];
#pragma unroll
    for (int l = 0; l < kDotLanes; ++l) part[l] = AccT(0);
    for (int d = 0; d < kN; d += kDotLanes)
#pragma unroll
        for (int l = 0; l < kDotLanes; ++l) part[l] += to_acc(a[d + l]) * to_acc(b[d + l]);
#pragma unroll
    for (int w = kDotLanes / 2; w > 0; w /= 2)
#pragma unroll
        for (int l = 0; l < w; ++l) part[l] += part[l + w];
    return part[0];
}

// P_ij and dS_ij for one (query block, key block) pair, into shared memory.
//   S = Q_i K_j^T, P = exp2(S scale log2e - L_i log2e), dP = dO_i V_j^T, dS = P o (dP - D_i).
template <typename T, typename AccT, int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN,
          int kNThreads, bool kStoreP, class M, class Drop>
__device__ __forceinline__ void compute_p_ds(const T* Q_s, const T* dO_s, const T* K_s, const T* V_s,
                                             const AccT* lse2_s, const AccT* delta_s, AccT* P_s,
                                             AccT* dS_s, int r0, int c0,
                                             const M& mask, const Drop& drop, AccT scale_log2) {
    using L = SimtSmem<T, AccT, kHeadDim, kHeadDimV, kBlockM, kBlockN>;
    for (int e = (int)threadIdx.x; e < kBlockM * kBlockN; e += kNThreads) {
        const int r = e / kBlockN, c = e % kBlockN;
        AccT s = dot<AccT, kHeadDim>(Q_s + r * L::kPitchD, K_s + c * L::kPitchD);
        AccT dp = dot<AccT, kHeadDimV>(dO_s + r * L::kPitchDv, V_s + c * L::kPitchDv);
        if constexpr (MaskExt<M>::value == 0) {
            const AccT p = recompute_p(s, scale_log2, lse2_s[r],
                                       mask.is_visible(r0 + r, c0 + c));
            if (kStoreP) P_s[e] = p;
            dS_s[e] = p * (dp - delta_s[r]);
        } else {
            AccT z = AccT(1);  // dropout's Z = keep / (1 − p)
            if constexpr (flash::HasExt<MaskExt<M>::value, flash::kExtDropout>::value) z = drop.z(r0 + r, c0 + c);
            // The fp32 forward's precise softcap tanh (flash_fwd_simt.cu: score<T is float>; float is
            // the only 4-byte T).
            ext_p_ds<sizeof(T) == 4>(s, dp, lse2_s[r], delta_s[r], z, scale_log2, mask, r0 + r, c0 + c);
            if (kStoreP) P_s[e] = s;  // P ∘ Z
            dS_s[e] = dp;
        }
        (void)drop;
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
          int kBlockN, int kNThreads, bool kIsCausal, bool kAtomicDQ, int kExt = 0>
__global__ void __launch_bounds__(kNThreads, kMinBlocksPerSm) flash_bwd_dkv_simt_kernel(
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
    using L = SimtSmem<T, AccT, kHeadDim, kHeadDimV, kBlockM, kBlockN>;
    // dK_j, dV_j live in registers: thread t owns elements t, t + kNThreads, ... of each.
    constexpr int kDKPerThread = (kBlockN * kHeadDim + kNThreads - 1) / kNThreads;
    constexpr int kDVPerThread = (kBlockN * kHeadDimV + kNThreads - 1) / kNThreads;

    FA_DYNAMIC_SMEM(smem);
    T* Q_s = reinterpret_cast<T*>(smem + L::kQ);           // Br x D
    T* dO_s = reinterpret_cast<T*>(smem + L::kdO);         // Br x Dv
    T* K_s = reinterpret_cast<T*>(smem + L::kK);           // Bc x D
    T* V_s = reinterpret_cast<T*>(smem + L::kV);           // Bc x Dv
    AccT* P_s = reinterpret_cast<AccT*>(smem + L::kP);     // Br x Bc
    AccT* dS_s = reinterpret_cast<AccT*>(smem + L::kdS);   // Br x Bc
    AccT* lse2_s = reinterpret_cast<AccT*>(smem + L::kL);  // Br
    AccT* delta_s = reinterpret_cast<AccT*>(smem + L::kDelta);  // Br

    const BatchIndex b = BatchIndex::from_grid(nb2);
    const int c0 = (int)blockIdx.x * kBlockN;  // first key of K_j
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

    AccT dK_acc[kDKPerThread];  // dK_j (Bc x D), this thread's elements
    AccT dV_acc[kDVPerThread];  // dV_j (Bc x Dv), this thread's elements
#pragma unroll
    for (int n = 0; n < kDKPerThread; ++n) dK_acc[n] = AccT(0);
#pragma unroll
    for (int n = 0; n < kDVPerThread; ++n) dV_acc[n] = AccT(0);

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
            compute_p_ds<T, AccT, kHeadDim, kHeadDimV, kBlockM, kBlockN, kNThreads, true>(
                Q_s, dO_s, K_s, V_s, lse2_s, delta_s, P_s, dS_s, r0, c0, mask, drop, scale_log2);
            // Barrier: P_ij, dS_ij complete before they are read down their columns.
            __syncthreads();

            // -- dV_j += P_ij^T dO_i
#pragma unroll
            for (int n = 0; n < kDVPerThread; ++n) {
                const int e = (int)threadIdx.x + n * kNThreads;
                if (e >= kBlockN * kHeadDimV) continue;  // last partial round
                const int c = e / kHeadDimV, d = e % kHeadDimV;
                AccT acc = AccT(0);
                for (int r = 0; r < kBlockM; ++r) acc += P_s[r * kBlockN + c] * to_acc(dO_s[r * L::kPitchDv + d]);
                dV_acc[n] += acc;
            }
            // -- dK_j += dS_ij^T Q_i   (times scale at the end)
#pragma unroll
            for (int n = 0; n < kDKPerThread; ++n) {
                const int e = (int)threadIdx.x + n * kNThreads;
                if (e >= kBlockN * kHeadDim) continue;  // last partial round
                const int c = e / kHeadDim, d = e % kHeadDim;
                AccT acc = AccT(0);
                for (int r = 0; r < kBlockM; ++r) acc += dS_s[r * kBlockN + c] * to_acc(Q_s[r * L::kPitchD + d]);
                dK_acc[n] += acc;
            }
            // -- atomic mode: dQ_i += dS_ij K_j * scale, straight into the AccT accumulator.
            if (kAtomicDQ) {
                AccT* dqa_g0 = dq_accum + b.offset({dqa_b0, dqa_b1, dqa_b2, 0}) + (long long)g * dqa_g;
                for (int e = (int)threadIdx.x; e < kBlockM * kHeadDim; e += kNThreads) {
                    const int r = e / kHeadDim, d = e % kHeadDim;
                    if (r0 + r >= Lq || d >= D) continue;
                    AccT acc = AccT(0);
                    for (int c = 0; c < kBlockN; ++c) acc += dS_s[r * kBlockN + c] * to_acc(K_s[c * L::kPitchD + d]);
                    fa::atomic_add(dqa_g0 + (long long)(r0 + r) * dqa_row + d, acc * scale);
                }
            }
        }
    }

    // -- epilogue: dK_j * scale and dV_j to global memory (rows < Lk, columns < D / Dv).
    OutT* dK_j = dk + b.offset({dk_b0, dk_b1, dk_b2, dk_row}) + (long long)c0 * dk_row;
    OutT* dV_j = dv + b.offset({dv_b0, dv_b1, dv_b2, dv_row}) + (long long)c0 * dv_row;
#pragma unroll
    for (int n = 0; n < kDKPerThread; ++n) {
        const int e = (int)threadIdx.x + n * kNThreads;
        const int c = e / kHeadDim, d = e % kHeadDim;
        if (e < kBlockN * kHeadDim && c0 + c < Lk && d < D)
            fa::gstore(dK_j + (long long)c * dk_row + d, FromAcc<OutT>::convert(dK_acc[n] * scale));
    }
#pragma unroll
    for (int n = 0; n < kDVPerThread; ++n) {
        const int e = (int)threadIdx.x + n * kNThreads;
        const int c = e / kHeadDimV, d = e % kHeadDimV;
        if (e < kBlockN * kHeadDimV && c0 + c < Lk && d < Dv)
            fa::gstore(dV_j + (long long)c * dv_row + d, FromAcc<OutT>::convert(dV_acc[n]));
    }
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
    using L = SimtSmem<T, AccT, kHeadDim, kHeadDimV, kBlockM, kBlockN>;
    constexpr int kDQPerThread = (kBlockM * kHeadDim + kNThreads - 1) / kNThreads;

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

    AccT dQ_acc[kDQPerThread];  // dQ_i (Br x D), this thread's elements
#pragma unroll
    for (int n = 0; n < kDQPerThread; ++n) dQ_acc[n] = AccT(0);

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
#pragma unroll
        for (int n = 0; n < kDQPerThread; ++n) {
            const int e = (int)threadIdx.x + n * kNThreads;
            if (e >= kBlockM * kHeadDim) continue;  // last partial round
            const int r = e / kHeadDim, d = e % kHeadDim;
            AccT acc = AccT(0);
            for (int c = 0; c < kBlockN; ++c) acc += dS_s[r * kBlockN + c] * to_acc(K_s[c * L::kPitchD + d]);
            dQ_acc[n] += acc;
        }
    }

    // -- epilogue: dQ_i * scale (rows < Lq, columns < D). A row that sees no key writes zeros.
    OutT* dQ_i = dq + b.offset({dq_b0, dq_b1, dq_b2, dq_row}) + (long long)r0 * dq_row;
#pragma unroll
    for (int n = 0; n < kDQPerThread; ++n) {
        const int e = (int)threadIdx.x + n * kNThreads;
        const int r = e / kHeadDim, d = e % kHeadDim;
        if (e < kBlockM * kHeadDim && r0 + r < Lq && d < D)
            fa::gstore(dQ_i + (long long)r * dq_row + d, FromAcc<OutT>::convert(dQ_acc[n] * scale));
    }
}
