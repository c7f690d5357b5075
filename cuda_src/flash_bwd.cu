// flash_bwd.cu — FlashAttention-2 backward on tensor cores (fp16, bf16; fp32 accumulation).
//
//   Q_i   Br x D    dO_i  Br x Dv    L_i, D_i  Br     (query side, block i; smem)
//   K_j   Bc x D    V_j   Bc x Dv                     (key side, block j; smem)
//   P_ij^T, dS_ij^T  Bc x Br   (dK/dV kernel; smem, element type, recomputed per block pair)
//   dS_ij            Br x Bc   (dQ kernel)
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
//     (Bc / 16 row tiles) x kSplit column slices. kAtomicDQ: dQ_i += dS K_j * scale with
//     float atomics into the AccT accumulator.
//   flash_bwd_dq_kernel (deterministic dQ): one block per (query block i, batch), walking the key
//     blocks and recomputing S, P, dP, dS; dQ_i in registers; no atomics.
#include "flash_bwd_common.cuh"

namespace fa_bwd {

constexpr int kTcPad = 8;  // elements of row padding: rows stay 16-byte aligned, banks rotate

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
template <int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN, bool kDKV, int kStages>
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
    static constexpr int kdS = kP + (kDKV ? align16(kScoreRows * kPitchS * kElem) : 0);  // dS^T / dS
    static constexpr int kL = kdS + align16(kScoreRows * kPitchS * kElem);       // L_i*log2e  Br
    static constexpr int kDelta = kL + align16(kBlockM * 4);                      // D_i  Br
    static constexpr int kBytes = kDelta + align16(kBlockM * 4);
};

// Copy a kRows x kCols tile (row stride row_stride elements) into shared memory with pitch kPitch,
// zero-filling rows >= n_rows and columns >= n_cols. kVec: 16-byte cp.async chunks (caller
// guarantees 16-byte aligned rows and n_cols % 8 == 0); else element loads.
template <typename T, int kRows, int kCols, int kPitch, int kNThreads, bool kVec>
__device__ __forceinline__ void load_tile_tc(T* smem, const T* gmem, long long row_stride,
                                             int n_rows, int n_cols) {
    if (kVec) {
        constexpr int kChunk = 16 / (int)sizeof(T);  // elements per 16-byte copy
        static_assert(kCols % kChunk == 0, "tile width must be whole 16-byte chunks");
        constexpr int kChunksPerRow = kCols / kChunk;
        for (int e = (int)threadIdx.x; e < kRows * kChunksPerRow; e += kNThreads) {
            const int r = e / kChunksPerRow, c = (e % kChunksPerRow) * kChunk;
            const bool in = r < n_rows && c < n_cols;
            // Out-of-range chunks copy 0 bytes (zero fill) from the tile origin, never read.
            fa::cp_async<16>(smem + r * kPitch + c, in ? gmem + (long long)r * row_stride + c : gmem,
                             in ? 16 : 0);
        }
    } else {
        for (int e = (int)threadIdx.x; e < kRows * kCols; e += kNThreads) {
            const int r = e / kCols, c = e % kCols;
            smem[r * kPitch + c] =
                (r < n_rows && c < n_cols) ? fa::gload(gmem + (long long)r * row_stride + c) : FromAcc<T>::convert(0.0f);
        }
    }
}

// acc (16 x kN, mma C layout per n8 tile) += A (16 x kK) * B (kK x kN) for the calling warp.
//   A: kATrans = false: A[m][k] = A_s[m * a_pitch + k]   (stored row-major, ldmatrix)
//      kATrans = true:  A[m][k] = A_s[k * a_pitch + m]   (stored transposed, ldmatrix.trans)
//   B: kBTrans = false: B[k][n] = B_s[n * b_pitch + k]   (stored N x K, ldmatrix)
//      kBTrans = true:  B[k][n] = B_s[k * b_pitch + n]   (stored K x N, ldmatrix.trans)
// Register layouts as /work/shared/ptx_semantics.md: an x4 ldmatrix gives A0..A3 of one k16
// step, or the (b0, b1) pairs of two adjacent n8 tiles.
template <typename T, int kK, int kN, bool kATrans, bool kBTrans>
__device__ __forceinline__ void warp_mma(float (&acc)[kN / 8][4], const T* A_s, int a_pitch,
                                         const T* B_s, int b_pitch) {
    static_assert(kK % 16 == 0, "warp_mma: k must be a multiple of 16 (one mma k-step)");
    static_assert(kN % 16 == 0, "warp_mma: n must be a multiple of 16 (pairs of n8 tiles per ldmatrix.x4)");
    const int lane = (int)threadIdx.x % 32;
    const int mat = lane / 8, mrow = lane % 8;  // which 8x8 matrix this lane addresses, and its row
    // k steps stay a loop: unrolled, ptxas hoists every step's fragments and runs out of registers.
#pragma unroll 1
    for (int kk = 0; kk < kK; kk += 16) {
        uint32_t a[4];
        if (!kATrans)  // matrices: (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15)
            fa::ldmatrix<4, false>(a, A_s + (lane % 16) * a_pitch + kk + (lane / 16) * 8);
        else  // stored rows are k: (k 0-7, m 0-7), (k 0-7, m 8-15), (k 8-15, m 0-7), (k 8-15, m 8-15)
            fa::ldmatrix<4, true>(a, A_s + (kk + mrow + (mat / 2) * 8) * a_pitch + (mat % 2) * 8);
#pragma unroll
        for (int n0 = 0; n0 < kN; n0 += 16) {
            uint32_t b[4];
            if (!kBTrans)  // stored rows are n: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
                fa::ldmatrix<4, false>(b, B_s + (n0 + mrow + (mat / 2) * 8) * b_pitch + kk + (mat % 2) * 8);
            else  // stored rows are k: (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15)
                fa::ldmatrix<4, true>(b, B_s + (kk + mrow + (mat % 2) * 8) * b_pitch + n0 + (mat / 2) * 8);
            const uint32_t b_lo[2] = {b[0], b[1]};  // n tile n0
            const uint32_t b_hi[2] = {b[2], b[3]};  // n tile n0 + 8
            fa::mma_m16n8k16<T>(acc[n0 / 8], a, b_lo, acc[n0 / 8]);
            fa::mma_m16n8k16<T>(acc[n0 / 8 + 1], a, b_hi, acc[n0 / 8 + 1]);
        }
    }
}

template <int kN>
__device__ __forceinline__ void zero_acc(float (&acc)[kN][4]) {
#pragma unroll
    for (int n = 0; n < kN; ++n)
        for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
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
        for (int e = 0; e < 4; ++e) {
            const int r = g + (e / 2) * 8, c = n * 8 + 2 * t + (e % 2);
            if (r < n_rows && c < n_cols)
                fa::gstore(gmem + (long long)r * row_stride + c, FromAcc<OutT>::convert(acc[n][e] * mult));
        }
}

}  // namespace fa_bwd
using namespace fa_bwd;

// ---------------------------------------------------------------------------------------------
// dK_j, dV_j (and, with kAtomicDQ, atomic dQ): grid = (Tc, nb1 * nb2, nb0); n_group query batch
// entries share K_j, V_j (group strides on the query-side tensors).
template <typename T, typename OutT, int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN,
          int kNWarps, bool kIsCausal, bool kAtomicDQ, bool kVecLoad, int kStages>
__global__ void __launch_bounds__(kNWarps * 32, kMinBlocksPerSm) flash_bwd_dkv_kernel(
    const T* __restrict__ q, long long q_b0, long long q_b1, long long q_b2, long long q_g, long long q_row,
    const T* __restrict__ k, long long k_b0, long long k_b1, long long k_b2, long long k_row,
    const T* __restrict__ v, long long v_b0, long long v_b1, long long v_b2, long long v_row,
    const T* __restrict__ dout, long long do_b0, long long do_b1, long long do_b2, long long do_g, long long do_row,
    const float* __restrict__ lse, long long l_b0, long long l_b1, long long l_b2, long long l_g,
    const float* __restrict__ delta, long long d_b0, long long d_b1, long long d_b2, long long d_g,
    float* __restrict__ dq_accum, long long dqa_b0, long long dqa_b1, long long dqa_b2, long long dqa_g, long long dqa_row,
    OutT* __restrict__ dk, long long dk_b0, long long dk_b1, long long dk_b2, long long dk_row,
    OutT* __restrict__ dv, long long dv_b0, long long dv_b1, long long dv_b2, long long dv_row,
    int Lq, int Lk, int D, int Dv, int nb2, int n_group, float scale) {
    constexpr int kNThreads = kNWarps * 32;
    constexpr int kRowTiles = kBlockN / 16;         // 16-key row tiles of dK_j, dV_j
    constexpr int kSplit = kNWarps / kRowTiles;     // warps per row tile
    // Column slices of dK_j / dV_j per row tile: one per warp where the head dim divides evenly,
    // fewer otherwise (the remaining warps then own no dK_j / dV_j columns).
    constexpr int kSplitK = column_slices(kHeadDim, kSplit);
    constexpr int kSplitV = column_slices(kHeadDimV, kSplit);
    constexpr int kColsK = kHeadDim / kSplitK;      // dK_j columns per warp
    constexpr int kColsV = kHeadDimV / kSplitV;     // dV_j columns per warp
    constexpr int kScoreTiles = (kBlockN / 16) * (kBlockM / 16);  // 16x16 tiles of S^T
    constexpr int kDQCols = kHeadDim % 32 == 0 ? 32 : 16;         // atomic dQ tile width
    static_assert(kBlockM % 16 == 0 && kBlockN % 16 == 0, "Br and Bc must be multiples of 16 (mma tiles)");
    static_assert(kHeadDim % 16 == 0 && kHeadDimV % 16 == 0, "head dims are padded to multiples of 16");
    static_assert(kHeadDim <= 256 && kHeadDimV <= 256, "head dims up to 256");
    static_assert(kNWarps >= kRowTiles && kNWarps % kRowTiles == 0,
                  "warps must cover the Bc/16 row tiles of dK_j, dV_j an integer number of times");
    static_assert(kColsK % 16 == 0 && kColsV % 16 == 0 && kColsK * kSplitK == kHeadDim &&
                  kColsV * kSplitV == kHeadDimV, "each warp's dK/dV column slice must be whole n16 steps");
    using L = TcSmem<kHeadDim, kHeadDimV, kBlockM, kBlockN, true, kStages>;

    FA_DYNAMIC_SMEM(smem);
    T* Q_buf = reinterpret_cast<T*>(smem + L::kQ);           // kStages x (Br x D)
    T* dO_buf = reinterpret_cast<T*>(smem + L::kdO);         // kStages x (Br x Dv)
    T* K_s = reinterpret_cast<T*>(smem + L::kK);             // Bc x D
    T* V_s = reinterpret_cast<T*>(smem + L::kV);             // Bc x Dv
    T* Pt_s = reinterpret_cast<T*>(smem + L::kP);            // P_ij^T  Bc x Br
    T* dSt_s = reinterpret_cast<T*>(smem + L::kdS);          // dS_ij^T Bc x Br
    float* lse2_s = reinterpret_cast<float*>(smem + L::kL);  // L_i * log2 e   Br
    float* delta_s = reinterpret_cast<float*>(smem + L::kDelta);  // D_i       Br

    const BatchIndex b = BatchIndex::from_grid(nb2);
    const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;  // mma C layout: rows g, g + 8; columns 2t, 2t + 1
    const int wm = warp / kSplit, wn = warp % kSplit;  // this warp's dK/dV row tile and slice
    const bool own_dK = wn < kSplitK, own_dV = wn < kSplitV;  // warp-uniform
    const int c0 = (int)blockIdx.x * kBlockN;          // first key of K_j
    const float scale_log2 = scale * flash::kLog2e;
    const Mask<kIsCausal> mask(Lq, Lk);

    // The block visits (query batch entry grp of the group, query block i) pairs, i from i_begin
    // (causal: blocks above the diagonal are skipped) to Tr - 1, grp outer.
    const int i_begin = mask.m_block_min(c0, kBlockM);
    const int Tr = (Lq + kBlockM - 1) / kBlockM;
    const int blocks_per_entry = Tr > i_begin ? Tr - i_begin : 0;
    const int n_visits = blocks_per_entry * n_group;
    // Start the copies of visit `visit`'s Q_i, dO_i into buffer `buf` (cp.async, or loads).
    auto load_query_block = [&](int visit, int buf) {
        const int grp = visit / blocks_per_entry, r0 = (i_begin + visit % blocks_per_entry) * kBlockM;
        load_tile_tc<T, kBlockM, kHeadDim, L::kPitchD, kNThreads, kVecLoad>(
            Q_buf + buf * L::kQStage,
            q + b.offset({q_b0, q_b1, q_b2, q_row}) + (long long)grp * q_g + (long long)r0 * q_row, q_row, Lq - r0, D);
        load_tile_tc<T, kBlockM, kHeadDimV, L::kPitchDv, kNThreads, kVecLoad>(
            dO_buf + buf * L::kdOStage,
            dout + b.offset({do_b0, do_b1, do_b2, do_row}) + (long long)grp * do_g + (long long)r0 * do_row,
            do_row, Lq - r0, Dv);
    };

    // -- prologue: K_j, V_j (and, double-buffered, the first Q_i, dO_i) into shared memory.
    load_tile_tc<T, kBlockN, kHeadDim, L::kPitchD, kNThreads, kVecLoad>(
        K_s, k + b.offset({k_b0, k_b1, k_b2, k_row}) + (long long)c0 * k_row, k_row, Lk - c0, D);
    load_tile_tc<T, kBlockN, kHeadDimV, L::kPitchDv, kNThreads, kVecLoad>(
        V_s, v + b.offset({v_b0, v_b1, v_b2, v_row}) + (long long)c0 * v_row, v_row, Lk - c0, Dv);
    if (kStages == 2 && n_visits > 0) load_query_block(0, 0);
    fa::cp_async_commit();

    float dK_acc[kColsK / 8][4];  // dK_j rows 16 wm.., columns kColsK wn..
    float dV_acc[kColsV / 8][4];  // dV_j rows 16 wm.., columns kColsV wn..
    zero_acc(dK_acc);
    zero_acc(dV_acc);

    for (int visit = 0; visit < n_visits; ++visit) {
        const int grp = visit / blocks_per_entry, r0 = (i_begin + visit % blocks_per_entry) * kBlockM;
        const int buf = kStages == 2 ? visit % 2 : 0;
        const T* Q_s = Q_buf + buf * L::kQStage;     // Q_i  Br x D
        const T* dO_s = dO_buf + buf * L::kdOStage;  // dO_i Br x Dv
        // Barrier: every warp is done with the previous visit: its Q_i/dO_i buffer (about to be
        // refilled), P^T_s, dS^T_s, L_i and D_i.
        __syncthreads();
        const bool prefetch = kStages == 2 && visit + 1 < n_visits;
        if (kStages == 1) load_query_block(visit, 0);
        if (prefetch) load_query_block(visit + 1, buf ^ 1);  // overlaps this visit's math
        fa::cp_async_commit();
        load_row_stats<float, kBlockM, kNThreads>(
            lse2_s, delta_s, lse + b.offset({l_b0, l_b1, l_b2, 0}) + (long long)grp * l_g,
            delta + b.offset({d_b0, d_b1, d_b2, 0}) + (long long)grp * d_g, r0, Lq);
        // This thread's copies of this visit's Q_i, dO_i (first time also K_j, V_j) landed; the
        // newest group (the prefetch) may still be in flight.
        if (prefetch)
            fa::cp_async_wait<1>();
        else
            fa::cp_async_wait<0>();
        // Barrier: every thread's copies and L_i, D_i are visible to every warp.
        __syncthreads();

        // -- S^T = K_j Q_i^T and dP^T = V_j dO_i^T in 16x16 tiles; P^T, dS^T to shared memory.
        for (int tile = warp; tile < kScoreTiles; tile += kNWarps) {
            const int tm = tile / (kBlockM / 16), tn = tile % (kBlockM / 16);  // key tile, query tile
            float s[2][4], dp[2][4];
            zero_acc(s);
            zero_acc(dp);
            warp_mma<T, kHeadDim, 16, false, false>(s, K_s + tm * 16 * L::kPitchD, L::kPitchD,
                                                     Q_s + tn * 16 * L::kPitchD, L::kPitchD);
            warp_mma<T, kHeadDimV, 16, false, false>(dp, V_s + tm * 16 * L::kPitchDv, L::kPitchDv,
                                                      dO_s + tn * 16 * L::kPitchDv, L::kPitchDv);
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int c = tm * 16 + g + 8 * h;       // key within K_j
                    const int r = tn * 16 + nt * 8 + 2 * t;  // query within Q_i (and r + 1)
                    const float p0 = recompute_p(s[nt][2 * h], scale_log2, lse2_s[r],
                                                 mask.is_visible(r0 + r, c0 + c));
                    const float p1 = recompute_p(s[nt][2 * h + 1], scale_log2, lse2_s[r + 1],
                                                 mask.is_visible(r0 + r + 1, c0 + c));
                    const float ds0 = p0 * (dp[nt][2 * h] - delta_s[r]);
                    const float ds1 = p1 * (dp[nt][2 * h + 1] - delta_s[r + 1]);
                    *reinterpret_cast<uint32_t*>(Pt_s + c * L::kPitchS + r) = fa::pack2<T>(p0, p1);
                    *reinterpret_cast<uint32_t*>(dSt_s + c * L::kPitchS + r) = fa::pack2<T>(ds0, ds1);
                }
        }
        // Barrier: P^T and dS^T complete before warps read them across tiles.
        __syncthreads();

        // -- dV_j += P^T dO_i,  dK_j += dS^T Q_i  (scale applied once, at the end)
        if (own_dV)
            warp_mma<T, kBlockM, kColsV, false, true>(dV_acc, Pt_s + wm * 16 * L::kPitchS, L::kPitchS,
                                                       dO_s + wn * kColsV, L::kPitchDv);
        if (own_dK)
            warp_mma<T, kBlockM, kColsK, false, true>(dK_acc, dSt_s + wm * 16 * L::kPitchS, L::kPitchS,
                                                       Q_s + wn * kColsK, L::kPitchD);

        // -- atomic mode: dQ_i += dS K_j * scale into the float accumulator.
        if (kAtomicDQ) {
            float* dqa_i = dq_accum + b.offset({dqa_b0, dqa_b1, dqa_b2, 0}) + (long long)grp * dqa_g +
                           (long long)r0 * dqa_row;
            constexpr int kDQTiles = (kBlockM / 16) * (kHeadDim / kDQCols);
            for (int tile = warp; tile < kDQTiles; tile += kNWarps) {
                const int tm = tile / (kHeadDim / kDQCols), tn = tile % (kHeadDim / kDQCols);
                float dq[kDQCols / 8][4];
                zero_acc(dq);
                // A = dS (Br x Bc) read from dS^T (stored Bc x Br) with ldmatrix.trans.
                warp_mma<T, kBlockN, kDQCols, true, true>(dq, dSt_s + tm * 16, L::kPitchS,
                                                          K_s + tn * kDQCols, L::kPitchD);
#pragma unroll
                for (int n = 0; n < kDQCols / 8; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int r = tm * 16 + g + (e / 2) * 8, d = tn * kDQCols + n * 8 + 2 * t + (e % 2);
                        if (r0 + r < Lq && d < D)
                            fa::atomic_add(dqa_i + (long long)r * dqa_row + d, dq[n][e] * scale);
                    }
            }
        }
    }

    fa::cp_async_wait<0>();  // no copy outlives the kernel when no query block was visited

    // -- epilogue: dK_j * scale and dV_j (rows < Lk, columns < D / Dv).
    const int c_w = c0 + wm * 16;  // first key of this warp's row tile
    if (own_dK)
        store_acc<OutT>(dk + b.offset({dk_b0, dk_b1, dk_b2, dk_row}) + (long long)c_w * dk_row + wn * kColsK,
                        dk_row, dK_acc, scale, Lk - c_w, D - wn * kColsK);
    if (own_dV)
        store_acc<OutT>(dv + b.offset({dv_b0, dv_b1, dv_b2, dv_row}) + (long long)c_w * dv_row + wn * kColsV,
                        dv_row, dV_acc, 1.0f, Lk - c_w, Dv - wn * kColsV);
}

// ---------------------------------------------------------------------------------------------
// Deterministic dQ: grid = (Tr, nb1 * nb2, nb0). Recomputes S and dP per key block (2 of the 5
// backward products again), dQ_i in registers split as (Br / 16 row tiles) x kSplit slices.
template <typename T, typename OutT, int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN,
          int kNWarps, bool kIsCausal, bool kVecLoad, int kStages>
__global__ void __launch_bounds__(kNWarps * 32, kMinBlocksPerSm) flash_bwd_dq_kernel(
    const T* __restrict__ q, long long q_b0, long long q_b1, long long q_b2, long long q_row,
    const T* __restrict__ k, long long k_b0, long long k_b1, long long k_b2, long long k_row,
    const T* __restrict__ v, long long v_b0, long long v_b1, long long v_b2, long long v_row,
    const T* __restrict__ dout, long long do_b0, long long do_b1, long long do_b2, long long do_row,
    const float* __restrict__ lse, long long l_b0, long long l_b1, long long l_b2,
    const float* __restrict__ delta, long long d_b0, long long d_b1, long long d_b2,
    OutT* __restrict__ dq, long long dq_b0, long long dq_b1, long long dq_b2, long long dq_row,
    int Lq, int Lk, int D, int Dv, int nb2, float scale) {
    constexpr int kNThreads = kNWarps * 32;
    constexpr int kRowTiles = kBlockM / 16;       // 16-row tiles of dQ_i
    constexpr int kSplit = kNWarps / kRowTiles;   // warps per row tile
    // Column slices of dQ_i per row tile (fewer than kSplit when D does not divide evenly).
    constexpr int kSplitQ = column_slices(kHeadDim, kSplit);
    constexpr int kColsQ = kHeadDim / kSplitQ;    // dQ_i columns per warp
    constexpr int kScoreTiles = (kBlockM / 16) * (kBlockN / 16);  // 16x16 tiles of S
    static_assert(kBlockM % 16 == 0 && kBlockN % 16 == 0, "Br and Bc must be multiples of 16 (mma tiles)");
    static_assert(kHeadDim % 16 == 0 && kHeadDimV % 16 == 0, "head dims are padded to multiples of 16");
    static_assert(kHeadDim <= 256 && kHeadDimV <= 256, "head dims up to 256");
    static_assert(kNWarps >= kRowTiles && kNWarps % kRowTiles == 0,
                  "warps must cover the Br/16 row tiles of dQ_i an integer number of times");
    static_assert(kColsQ % 16 == 0 && kColsQ * kSplitQ == kHeadDim,
                  "each warp's dQ column slice must be whole n16 steps");
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
    const Mask<kIsCausal> mask(Lq, Lk);

    // -- prologue: Q_i, dO_i, L_i, D_i into shared memory, once.
    load_tile_tc<T, kBlockM, kHeadDim, L::kPitchD, kNThreads, kVecLoad>(
        Q_s, q + b.offset({q_b0, q_b1, q_b2, q_row}) + (long long)r0 * q_row, q_row, Lq - r0, D);
    load_tile_tc<T, kBlockM, kHeadDimV, L::kPitchDv, kNThreads, kVecLoad>(
        dO_s, dout + b.offset({do_b0, do_b1, do_b2, do_row}) + (long long)r0 * do_row, do_row, Lq - r0, Dv);
    load_row_stats<float, kBlockM, kNThreads>(lse2_s, delta_s, lse + b.offset({l_b0, l_b1, l_b2, 0}),
                                              delta + b.offset({d_b0, d_b1, d_b2, 0}), r0, Lq);

    float dQ_acc[kColsQ / 8][4];  // dQ_i rows 16 wm.., columns kColsQ wn..
    zero_acc(dQ_acc);

    const T* k_b = k + b.offset({k_b0, k_b1, k_b2, k_row});
    const T* v_b = v + b.offset({v_b0, v_b1, v_b2, v_row});
    const int Tc = mask.n_block_max(r0, kBlockM, kBlockN);  // causal: blocks right of the diagonal skipped
    // Start the copies of key block j's K_j, V_j into buffer `buf` (cp.async, or loads).
    auto load_key_block = [&](int j, int buf) {
        const int c0 = j * kBlockN;
        load_tile_tc<T, kBlockN, kHeadDim, L::kPitchD, kNThreads, kVecLoad>(
            K_buf + buf * L::kKStage, k_b + (long long)c0 * k_row, k_row, Lk - c0, D);
        load_tile_tc<T, kBlockN, kHeadDimV, L::kPitchDv, kNThreads, kVecLoad>(
            V_buf + buf * L::kVStage, v_b + (long long)c0 * v_row, v_row, Lk - c0, Dv);
    };
    if (kStages == 2 && Tc > 0) load_key_block(0, 0);
    fa::cp_async_commit();  // one group: Q_i, dO_i (and, double-buffered, K_0, V_0)

    for (int j = 0; j < Tc; ++j) {
        const int c0 = j * kBlockN;
        const int buf = kStages == 2 ? j % 2 : 0;
        const T* K_s = K_buf + buf * L::kKStage;  // K_j Bc x D
        const T* V_s = V_buf + buf * L::kVStage;  // V_j Bc x Dv
        // Barrier: every warp is done with the previous key block: its K/V buffer (about to be
        // refilled) and dS_s.
        __syncthreads();
        const bool prefetch = kStages == 2 && j + 1 < Tc;
        if (kStages == 1) load_key_block(j, 0);
        if (prefetch) load_key_block(j + 1, buf ^ 1);  // overlaps this block's math
        fa::cp_async_commit();
        // This thread's copies of K_j, V_j (first time also Q_i, dO_i) landed; the newest group
        // (the prefetch) may still be in flight.
        if (prefetch)
            fa::cp_async_wait<1>();
        else
            fa::cp_async_wait<0>();
        // Barrier: every thread's copies are visible to every warp.
        __syncthreads();

        // -- S = Q_i K_j^T, dP = dO_i V_j^T in 16x16 tiles; dS = P o (dP - D_i) to shared memory.
        for (int tile = warp; tile < kScoreTiles; tile += kNWarps) {
            const int tm = tile / (kBlockN / 16), tn = tile % (kBlockN / 16);  // query tile, key tile
            float s[2][4], dp[2][4];
            zero_acc(s);
            zero_acc(dp);
            warp_mma<T, kHeadDim, 16, false, false>(s, Q_s + tm * 16 * L::kPitchD, L::kPitchD,
                                                     K_s + tn * 16 * L::kPitchD, L::kPitchD);
            warp_mma<T, kHeadDimV, 16, false, false>(dp, dO_s + tm * 16 * L::kPitchDv, L::kPitchDv,
                                                      V_s + tn * 16 * L::kPitchDv, L::kPitchDv);
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = tm * 16 + g + 8 * h;       // query within Q_i
                    const int c = tn * 16 + nt * 8 + 2 * t;  // key within K_j (and c + 1)
                    const float p0 = recompute_p(s[nt][2 * h], scale_log2, lse2_s[r], mask.is_visible(r0 + r, c0 + c));
                    const float p1 = recompute_p(s[nt][2 * h + 1], scale_log2, lse2_s[r], mask.is_visible(r0 + r, c0 + c + 1));
                    const float ds0 = p0 * (dp[nt][2 * h] - delta_s[r]);
                    const float ds1 = p1 * (dp[nt][2 * h + 1] - delta_s[r]);
                    *reinterpret_cast<uint32_t*>(dS_s + r * L::kPitchS + c) = fa::pack2<T>(ds0, ds1);
                }
        }
        // Barrier: dS complete before warps read whole rows of it.
        __syncthreads();

        // -- dQ_i += dS K_j  (scale applied once, at the end)
        if (own_dQ)
            warp_mma<T, kBlockN, kColsQ, false, true>(dQ_acc, dS_s + wm * 16 * L::kPitchS, L::kPitchS,
                                                       K_s + wn * kColsQ, L::kPitchD);
    }

    fa::cp_async_wait<0>();  // no copy outlives the kernel when no key block was visited

    // -- epilogue: dQ_i * scale (rows < Lq, columns < D); a row that sees no key writes zeros.
    const int r_w = r0 + wm * 16;
    if (own_dQ)
        store_acc<OutT>(dq + b.offset({dq_b0, dq_b1, dq_b2, dq_row}) + (long long)r_w * dq_row + wn * kColsQ,
                        dq_row, dQ_acc, scale, Lq - r_w, D - wn * kColsQ);
}
