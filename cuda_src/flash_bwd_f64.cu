// flash_bwd_f64.cu — FlashAttention-2 backward for float64 inputs on the double-precision tensor
// cores (DMMA, mma.sync.m8n8k4.f64, sm_80+; m16n8k16 on sm_90, below), issue 12: the dK/dV kernel with atomic dQ.
//
// Same algorithm and work split as the fp16/bf16 tensor-core kernel flash_bwd_dkv_kernel
// (flash_bwd.cu; read the comment above it): one block per (key block j, K/V batch entry); K_j,
// V_j stay in shared memory while the block walks the query blocks i (and the n_group query batch
// entries of an MQA/GQA group); per block pair S^T = K_j Q_i^T and dP^T = V_j dO_i^T are
// recomputed, P^T = exp2(S^T·scale·log2e − L_i·log2e), dS^T = P^T ∘ (dP^T − D_i) stay in
// registers as the A operands of dV_j += P^T dO_i and dK_j += dS^T Q_i; dS goes to shared memory
// for dQ_i += dS K_j, added by double atomics into the fragment-ordered accumulator
// DQAccumLayout<kHeadDim> (flash_bwd_common.cuh; unscaled: flash_bwd_convert.cu applies the scale).
// kOrderedDQ: the same atomics in key-block order (fa::sem_wait / fa::sem_post on the
// DQOrderCounters ints after each entry's blocks): bitwise deterministic. Everything is IEEE fp64:
// DMMA products (fp64 fma chains), double accumulation, P by flash_f64_exp.cuh's exp2_nonpositive
// (its argument is <= 0 up to rounding for the forward's LSE; the argument is clamped at 1024 so
// that the routine's domain, x <= 1023.5, always holds: an LSE below the scores by more than
// 700 nats gives +inf, as exp2 does from 1024 on).
//
// Warps: warp w owns keys w·8·kMT .. +8·kMT−1 of K_j (kMT m8 tiles: rows g, g + 8), all Br queries
// of the score strip, and all columns of its dK_j, dV_j rows: Bc = 8·kMT·kNWarps.
// Fragments (m8n8k4 f64; g = lane / 4, t = lane % 4):
//   A 8×4 row:  a0 = A[g][t]      B 4×8 col:  b0 = B[t][g]      C 8×8:  c0, c1 = C[g][2t, 2t+1]
// Each shared-memory read is one 16-byte load (two doubles) feeding two k4 steps, by permuting the
// indices a product sums over (or that only relabel output columns):
//   S^T = K Q^T, dP^T = V dO^T, per 16 head-dim columns c: lane (g, t) loads the rows' columns
//     16c + 4t + 2h, +1 (h = 0, 1) of both operands; k4 step (h, e) uses element e of load h — the
//     same permutation of the head dim for A and B (pitch ≡ 2 mod 4 doubles: the 8 lanes of a
//     16-byte phase, rows g ∈ {0, 1} × t, hit the 16-byte bank groups 2t + g·pitch/2, distinct).
//   dV += P^T dO, dK += dS^T Q: lane (g, t) holds P^T[key g][query 8nt + 2t + e] (C layout) and
//     uses it as a0 of k4 step e (k index t = query 8nt + 2t + e), so b0 = dO[8nt + 2t + e][·]: one
//     16-byte load of dO[query][16p + 2g, +1] feeds output n8 tiles 2p, 2p + 1 (B column g of tile
//     2p + h is column 16p + 2g + h), and C element j of tile 2p + h is column 16p + 4t + 2j + h
//     (pitch ≡ 2 mod 8: the phase's groups t·pitch + g... = 2t + g, distinct).
//   dQ += dS K: A = dS (Br × Bc, row-major, swizzled: below; pitch Bc + 8 ≡ 8 mod 16: groups
//     4g + t), natural k order (16-byte load of keys 8kc + 2t, +1); B = K[8kc + 2t + e][col g],
//     8-byte loads (phases of 16 lanes: 8-byte slots 4t + g with pitch ≡ 2 mod 16), so the C tiles
//     are DQAccumLayout's m16n8 fragments unpermuted (two m8 tiles = rows g, g + 8).
// Row pitches (doubles): Q_i, K_j d + 2; dO_i, V_j dv + 2; dS Bc + 8, swizzled: key column c of
// row r at column c ^ 4·((r / 2) mod 4). The dS stores from the C layout (8 bytes, lane (g, t) at
// rows 8nt + 2t + e: XOR 4t) then hit 16 distinct 8-byte slots per 16-lane phase (2 wavefronts per
// instruction; 8 unswizzled, where rows 2t share the banks); the dQ loads' XOR, 4·((g / 2) mod 4),
// keeps their 8-lane phases conflict-free (rows g, g + 1 half a bank row apart, t over the rest).
//
// Per visit: barrier; cp.async copies of Q_i, dO_i, L_i, D_i — kStages = 2: the next visit's into
// the other buffer (they land during this visit's products; this visit's were started one visit
// earlier), kStages = 1: this visit's; L_i·log2e converted in place; barrier; S^T, dP^T, P^T, dS^T
// (tiles crossing the diagonal or the key end masked); dV_j += P^T dO_i; dS to shared memory;
// barrier (ordered: sem_wait); dQ atomics (sem_post); dK_j += dS^T Q_i. dK_j, dV_j
// by blocked summation: each visit's Br-term sums start from zero and are then added (the error
// grows with Br + Lq / Br terms, not Lq). dV_j lives in shared memory (Tr::kDVSmem, each lane its
// own elements) where kMT·(d + dv) > 128 — in registers ptxas spilled from d = dv = 96. Epilogue:
// a quad exchange, then 16-byte stores of whole 64-byte row segments.
//
// sm_90, kDmmaK = 16 (mma.sync.m16n8k16.f64, DMMA.16x8x16: two m8 tiles and four k4 steps per instruction; tiles
// with kMT = 1, 4 warps, d and dv multiples of 32): m16n8k16 needs 16 rows of A per warp, and a warp owns 8 keys.
// So warps 2h, 2h + 1 share keys 16h .. 16h + 15: each computes the score strip of those keys for half of the Br
// queries (gemm_abt's m16n8k16 path; V_j stored in key pairs, load_tile_f64_pairs, so dP^T's A fragments load in
// place), writes P and dS to shared memory (dS's layout), and after the barrier takes dK_j, dV_j for half of the
// columns, the A fragments (both strips of its 16 keys) read back from P and dS by 8-byte loads
// (visit_k16). Each product's k4 steps are the m8n8k4 kernel's, in its order, so the emulator gives the same bits
// (tests/test_cuda_backward_f64.py). dK_j, dV_j use natural columns (no epilogue exchange); dV_j is in shared
// memory where d + dv > 96, at pitch dv + 8. The ordered mode adds one barrier per visit (dV_j before the turn).
//
// Shapes: d, dv (head dims padded to multiples of 16, zero-filled past D, Dv) <= 128; Br a
// multiple of 16; kMT ∈ {1, 2}; kStages ∈ {1, 2} (the host takes 2 where the second buffer costs
// no resident warps). The FLASH_EXT_PARAMS tail is taken (the host's dense argument
// list) and ignored: calls with extensions run the SIMT kernel.
// flasharray/_private/cuda_backward_f64.py mirrors BwdF64Traits::kBytes and picks the tiles.
#include "flash_bwd_mma.cuh"       // load_tile_tc, ceil_div_c, align16, DQAccumLayout, DQOrderCounters
#include "flash_kernel_traits.cuh"  // flash::Vec16
#include "flash_ext.cuh"            // FLASH_EXT_PARAMS
#include "flash_f64_exp.cuh"        // flash::exp2_nonpositive
#include "flash_f64_mma.cuh"        // flash::dmma

namespace fa_bwd {

template <int kHeadDim_, int kHeadDimV_, int kBlockM_, int kBlockN_, int kNWarps_, int kStages_ = 1, int kDmmaK_ = 4>
struct BwdF64Traits {
    static constexpr int kHeadDim = kHeadDim_, kHeadDimV = kHeadDimV_;
    static constexpr int kBlockM = kBlockM_, kBlockN = kBlockN_, kNWarps = kNWarps_, kStages = kStages_;
    static constexpr int kDmmaK = kDmmaK_;
    static constexpr bool kK16 = kDmmaK == 16;
    static constexpr int kNThreads = kNWarps * 32;
    static constexpr int kMT = kBlockN / (8 * kNWarps);  // m8 key tiles per warp
    static constexpr int kNT = kBlockM / 8;              // n8 query tiles of the score strip
    // The warp's part (kK16: the warp pair 2h, 2h + 1 shares keys 16h .. 16h + 15; each computes the scores of
    // half of the queries and dK_j, dV_j for half of the columns): m8 key tiles, n8 query tiles of its score
    // strip, dK_j / dV_j columns.
    static constexpr int kWarpMT = kK16 ? 2 : kMT, kWarpNT = kK16 ? kNT / 2 : kNT;
    static constexpr int kWarpD = kK16 ? kHeadDim / 2 : kHeadDim, kWarpDv = kK16 ? kHeadDimV / 2 : kHeadDimV;
    static constexpr int kPitchD = kHeadDim + 2, kPitchDv = kHeadDimV + 2, kPitchS = kBlockN + 8;  // doubles
    // dV_j's pitch in shared memory (kK16: ≡ 8 mod 16 doubles, its natural column layout's 16-byte accesses
    // conflict-free).
    static constexpr int kPitchDvAcc = kK16 ? kHeadDimV + 8 : kPitchDv;
    // kK16: V_j in key pairs (load_tile_f64_pairs), rows of kHeadDimV + 1 16-byte units (odd: conflict-free A loads);
    // Bc/2 × (dv + 1) × 16 bytes, inside the region of the row-major tile.
    static constexpr int kPitchVPairs = kHeadDimV + 1;
    // The streamed tiles, kStages buffers each (doubles per buffer; every buffer 16-byte aligned).
    static constexpr int kQStage = kBlockM * kPitchD, kdOStage = kBlockM * kPitchDv, kRowStage = kBlockM;
    static constexpr int kQ = 0;                                            // Q_i  Br × d   × kStages
    static constexpr int kdO = kQ + align16(kStages * kQStage * 8);         // dO_i Br × dv  × kStages
    static constexpr int kK = kdO + align16(kStages * kdOStage * 8);        // K_j  Bc × d
    static constexpr int kV = kK + align16(kBlockN * kPitchD * 8);          // V_j  Bc × dv
    static constexpr int kdS = kV + align16(kBlockN * kPitchDv * 8);        // dS   Br × Bc (swizzled)
    static constexpr int kL = kdS + align16(kBlockM * kPitchS * 8);         // L_i·log2e  Br × kStages
    static constexpr int kDelta = kL + align16(kStages * kRowStage * 8);     // D_i        Br × kStages
    // dV_j in shared memory (Bc × dv, pitch dv + 2; each lane updates its own elements) where dK_j
    // and dV_j together would take more than 128 of the thread's registers: ptxas then spills.
    static constexpr bool kDVSmem = kMT * (kHeadDim + kHeadDimV) > (kK16 ? 96 : 128);
    static constexpr int kdV = kDelta + align16(kStages * kRowStage * 8);    // dV_j       Bc × dv
    static constexpr int kP = kdV + (kDVSmem ? align16(kBlockN * kPitchDvAcc * 8) : 0);  // kK16: P  Br × Bc (as dS)
    static constexpr int kExpTab = kP + (kK16 ? align16(kBlockM * kPitchS * 8) : 0);      // 2^(j/16)
    static constexpr int kBytes = kExpTab + flash::kExp2TableBytes;

    static_assert(kBlockN == 8 * kMT * kNWarps && (kMT == 1 || kMT == 2), "Bc = 8·kMT·warps, kMT in {1, 2}");
    static_assert(kBlockM % 16 == 0, "Br: whole 16-row dQ tiles");
    static_assert(kHeadDim % 16 == 0 && kHeadDimV % 16 == 0 && kHeadDim <= 128 && kHeadDimV <= 128,
                  "d, dv: multiples of 16, at most 128");
    static_assert(kPitchD % 8 == 2 && kPitchDv % 8 == 2 && kPitchS % 16 == 8,
                  "pitches: conflict-free 16-byte fragment loads");
    static_assert(kBlockN % 16 == 0, "dS swizzle: column ^ 4·((row / 2) mod 4) stays inside the row");
    static_assert(kStages == 1 || kStages == 2, "one or two buffers of Q_i, dO_i, L_i, D_i");
    static_assert(kBlockM <= kNThreads, "L_i, D_i: one element per thread");
    static_assert(kDmmaK == 4 || (kDmmaK == 16 && kMT == 1 && kNWarps == 4 && kHeadDim % 32 == 0 &&
                                  kHeadDimV % 32 == 0),
                  "kDmmaK: 4, or 16 with one m8 key tile per warp, 4 warps, d and dv multiples of 32");
};

using Dbl2 = flash::Vec16<double>;

using flash::dmma;  // flash_f64_mma.cuh: D += A·B, m8n8k4 f64

// Two doubles from shared memory (one 16-byte load).
__device__ __forceinline__ Dbl2 lds2(const double* p) { return *reinterpret_cast<const Dbl2*>(p); }

// 2^x for the softmax weights: exp2_nonpositive (its table at exp_tab) on its domain
// (x < 1023 + 31/32); x >= 1024 -> +inf (as exp2); NaN stays NaN.
__device__ __forceinline__ double exp2_weight(double x, const double* exp_tab) {
    return flash::exp2_nonpositive(x > 1024.0 ? 1024.0 : x, exp_tab);
}

template <int kMT, int kN>
__device__ __forceinline__ void zero_f64(double (&acc)[kMT][kN][2]) {
#pragma unroll
    for (int m = 0; m < kMT; ++m)
#pragma unroll
        for (int n = 0; n < kN; ++n) acc[m][n][0] = acc[m][n][1] = 0.0;
}

// acc (8·kMT rows × 8·kNT columns) += A B^T over kCols columns, A rows at A_l (the warp's first
// row, this lane's offset applied), B rows at B_l (0..8 kNT−1): the A' order of the header.
// A_l = A_s + g·pitch + 4t, B_l = B_s + g·pitch + 4t.
// kK16 (kMT = 2): per 16 columns and n8 tile one m16n8k16 — the k4 steps (h, e) in the same order (dmma16's
// a[mt + 2(2h + e)] = a[mt][h].v[e], b[2h + e] = b_h.v[e]), so the same bits.
template <int kMT, int kNT, int kCols, int kPitch, bool kK16 = false>
__device__ __forceinline__ void gemm_abt(double (&acc)[kMT][kNT][2], const double* A_l, const double* B_l) {
#pragma unroll
    for (int c = 0; c < kCols / 16; ++c) {
        Dbl2 a[kMT][2];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) a[mt][h] = lds2(A_l + 8 * mt * kPitch + 16 * c + 2 * h);
        if constexpr (kK16) {
            static_assert(kMT == 2, "m16n8k16: two m8 tiles");
            const double a16[8] = {a[0][0].v[0], a[1][0].v[0], a[0][0].v[1], a[1][0].v[1],
                                   a[0][1].v[0], a[1][1].v[0], a[0][1].v[1], a[1][1].v[1]};
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) {
                const Dbl2 b0 = lds2(B_l + 8 * nt * kPitch + 16 * c), b1 = lds2(B_l + 8 * nt * kPitch + 16 * c + 2);
                const double b16[4] = {b0.v[0], b0.v[1], b1.v[0], b1.v[1]};
                flash::dmma16(acc[0][nt], acc[1][nt], a16, b16);
            }
        } else {
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const Dbl2 b = lds2(B_l + 8 * nt * kPitch + 16 * c + 2 * h);
#pragma unroll
                    for (int e = 0; e < 2; ++e)
#pragma unroll
                        for (int mt = 0; mt < kMT; ++mt) dmma(acc[mt][nt], a[mt][h].v[e], b.v[e]);
                }
        }
    }
}

// kK16's dP^T = V_j dO_i^T with V_j in key pairs (load_tile_f64_pairs): one 16-byte load gives the A fragment's
// rows g and g + 8 of one k4 step, adjacent as m16n8k16 takes them (row-major rows needed a register move per
// element). The same columns in the same order as gemm_abt (k4 step v1 = 2h + e: column 16c + 4t + v1), at unit
// 16c + 4t + (v1 ^ 2(t / 2)) of the warp's row pair g: A_l = A_s + 2((key0 / 2 + g)·kPitchUnits + 4t).
template <int kNT, int kCols, int kPitchUnits, int kPitch>
__device__ __forceinline__ void gemm_abt_pairs(double (&acc)[2][kNT][2], const double* A_l, const double* B_l) {
    const int sw = (int)threadIdx.x % 4 / 2 * 2;
    const double* A_v[2] = {A_l + 2 * sw, A_l + 2 * (2 ^ sw)};  // k4 steps 0, 1 and 2, 3
#pragma unroll
    for (int c = 0; c < kCols / 16; ++c) {
        double a16[8];
#pragma unroll
        for (int v1 = 0; v1 < 4; ++v1) {
            const Dbl2 x = lds2(A_v[v1 / 2] + 2 * (16 * c + v1 % 2));
            a16[2 * v1] = x.v[0], a16[2 * v1 + 1] = x.v[1];
        }
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
            const Dbl2 b0 = lds2(B_l + 8 * nt * kPitch + 16 * c), b1 = lds2(B_l + 8 * nt * kPitch + 16 * c + 2);
            const double b16[4] = {b0.v[0], b0.v[1], b1.v[0], b1.v[1]};
            flash::dmma16(acc[0][nt], acc[1][nt], a16, b16);
        }
    }
}

// acc's 16-column pair p += one visit's sums part[mt][h][j] (n8 tile 2p + h, element j): the blocked summation's
// second step, for registers (gemm_rab, and gemm_rab16's sinks).
template <int kMT, int kN>
__device__ __forceinline__ void add_pair(double (&acc)[kMT][kN][2], int p, const double (&part)[kMT][2][2]) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int j = 0; j < 2; ++j) acc[mt][2 * p + h][j] += part[mt][h][j];
}

// acc (8·kMT rows × kCols columns, permuted: tile 2p + h, element j = column 16p + 4t + 2j + h)
// += A (registers: C layout of 8·kMT × 8·kNT) · B (8·kNT × kCols in shared memory, row-major).
// B_l = B_s + 2t·pitch + 2g.
template <int kMT, int kNT, int kCols, int kPitch>
__device__ __forceinline__ void gemm_rab(double (&acc)[kMT][kCols / 8][2], const double (&a)[kMT][kNT][2],
                                         const double* B_l) {
    // Per 16-column pair: this visit's Br-term sums from zero, then added to dK_j / dV_j (blocked
    // summation: the error grows with Br + Lq / Br terms, not Lq).
#pragma unroll
    for (int p = 0; p < kCols / 16; ++p) {
        double part[kMT][2][2];
        zero_f64(part);
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const Dbl2 b = lds2(B_l + (8 * nt + e) * kPitch + 16 * p);
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int mt = 0; mt < kMT; ++mt) dmma(part[mt][h], a[mt][nt][e], b.v[h]);
            }
        add_pair(acc, p, part);
    }
}

// As gemm_rab with the accumulator in shared memory (Tr::kDVSmem): per 16-column pair p, this lane's
// elements (rows g + 8mt, columns 16p + 4t .. +3 = two 16-byte words) are loaded, updated by every
// k4 step and stored back. C_l = C_s + g·pitch + 4t (the warp's first row); only this lane touches them.
template <int kMT, int kNT, int kCols, int kPitch>
__device__ __forceinline__ void gemm_rab_smem(double* C_l, const double (&a)[kMT][kNT][2], const double* B_l) {
#pragma unroll
    for (int p = 0; p < kCols / 16; ++p) {
        double acc[kMT][2][2];  // [mt][h][j]: column 16p + 4t + 2j + h; this visit's sums (as gemm_rab)
        zero_f64(acc);
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const Dbl2 b = lds2(B_l + (8 * nt + e) * kPitch + 16 * p);
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int mt = 0; mt < kMT; ++mt) dmma(acc[mt][h], a[mt][nt][e], b.v[h]);
            }
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
            Dbl2* c = reinterpret_cast<Dbl2*>(C_l + 8 * mt * kPitch + 16 * p);
            const Dbl2 lo = c[0], hi = c[1];
            c[0] = Dbl2{{lo.v[0] + acc[mt][0][0], lo.v[1] + acc[mt][1][0]}};
            c[1] = Dbl2{{hi.v[0] + acc[mt][0][1], hi.v[1] + acc[mt][1][1]}};
        }
    }
}

// kK16: the A fragments of dV_j += P^T dO_i and dK_j += dS^T Q_i (the warp's 16 keys × Br queries, k = queries),
// loaded from shared memory for the whole visit: a[s][v0 + 2 v1] = A^T[key g + 8 v0][query 16s + 8(v1 / 2) + 2t +
// v1 % 2], i.e. gemm_rab's k4 steps (nt, e) = (2s + v1 / 2, v1 % 2) in its order; 8-byte loads straight into the
// fragment's registers (16-byte ones took a register move per element).
// From P or dS (query-major, store_ds's swizzle): key column (key0 + g + 8 v0) ^ 4t of rows 16s + 8b + 2t + e (their
// (row / 2) mod 4 is t), i.e. column key0 + (g ^ 4(t % 2)) + 8(v0 ^ t / 2): dS_l = dS_s + 2t·kPitch + key0 +
// (g ^ 4(t % 2)), hi = t / 2. Lanes g × t of a 16-lane phase hit 16 distinct 8-byte slots.
template <int kKSteps, int kPitch>
__device__ __forceinline__ void load_a_queries(double (&a)[kKSteps][8], const double* dS_l, int hi) {
    const double* col[2] = {dS_l + 8 * hi, dS_l + 8 * (1 - hi)};
#pragma unroll
    for (int s = 0; s < kKSteps; ++s)
#pragma unroll
        for (int v0 = 0; v0 < 2; ++v0)
#pragma unroll
            for (int v1 = 0; v1 < 4; ++v1) a[s][v0 + 2 * v1] = col[v0][(16 * s + 8 * (v1 / 2) + v1 % 2) * kPitch];
}

// kK16: gemm_rab for the warp's 16 keys (two m8 tiles) × kCols columns by m16n8k16 — the same k4 steps in the same
// order — A from a (load_a_queries), B (Br × kCols, row-major) by 8-byte loads at B_l = B_s + 2t·kPitch + g + the
// warp's first column: natural columns (tile n = 2p + h, element j: column 16p + 8h + 2t + j), a 16-lane phase's
// slots 4t + g distinct (kPitch ≡ 2 mod 16). Per pair p, this visit's Br-term sums from zero are handed to
// sink(p, part) (part[mt][h][j]; gemm_rab's blocked summation).
template <int kKSteps, int kCols, int kPitch, class Sink>
__device__ __forceinline__ void gemm_rab16(const double (&a)[kKSteps][8], const double* B_l, const Sink& sink) {
#pragma unroll
    for (int p = 0; p < kCols / 16; ++p) {
        double part[2][2][2];
        zero_f64(part);
#pragma unroll
        for (int s = 0; s < kKSteps; ++s)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                double b[4];
#pragma unroll
                for (int v = 0; v < 4; ++v) b[v] = B_l[(16 * s + 8 * (v / 2) + v % 2) * kPitch + 16 * p + 8 * h];
                flash::dmma16(part[0][h], part[1][h], a[s], b);
            }
        sink(p, part);
    }
}

// P^T (in s) and dS^T (in dp) from the strip's S^T, dP^T (keys key_w + 8mt + g, queries
// r0 + 8nt + 2t + e). kMasked: the tile crosses the causal diagonal or the key sequence end (rows
// past Lq need no test: their L_i·log2e is +inf, so P = 0).
template <class Tr, bool kMasked, class M>
__device__ __forceinline__ void p_ds_f64(double (&s)[Tr::kWarpMT][Tr::kWarpNT][2], double (&dp)[Tr::kWarpMT][Tr::kWarpNT][2],
                                         const double* lse2_s, const double* delta_s, const double* exp_tab,
                                         double scale_log2, const M& mask, int r0, int key_w) {
    const int lane = (int)threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int nt = 0; nt < Tr::kWarpNT; ++nt) {
        const Dbl2 lse2 = lds2(lse2_s + 8 * nt + 2 * t), delta = lds2(delta_s + 8 * nt + 2 * t);
#pragma unroll
        for (int mt = 0; mt < Tr::kWarpMT; ++mt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                double x = s[mt][nt][e];
                if constexpr (kMasked) x = mask.apply(x, r0 + 8 * nt + 2 * t + e, key_w + 8 * mt + g);
                const double p = exp2_weight(fma(x, scale_log2, -lse2.v[e]), exp_tab);
                dp[mt][nt][e] = p * (dp[mt][nt][e] - delta.v[e]);  // dS^T
                s[mt][nt][e] = p;                                     // P^T
            }
    }
}

// The warp's score strip (Tr::kWarpMT m8 key tiles × Tr::kWarpNT n8 query tiles): S^T = K_j Q_i^T and
// dP^T = V_j dO_i^T, then P^T (in s), dS^T (in dp).
template <class Tr, class M>
__device__ __forceinline__ void scores_f64(double (&s)[Tr::kWarpMT][Tr::kWarpNT][2], double (&dp)[Tr::kWarpMT][Tr::kWarpNT][2],
                                           const double* K_l, const double* V_l, const double* Q_l,
                                           const double* dO_l, const double* lse2_s, const double* delta_s,
                                           const double* exp_tab, double scale_log2, const M& mask, bool masked,
                                           int r0, int key_w) {
    zero_f64(s);
    zero_f64(dp);
    gemm_abt<Tr::kWarpMT, Tr::kWarpNT, Tr::kHeadDim, Tr::kPitchD, Tr::kK16>(s, K_l, Q_l);
    if constexpr (Tr::kK16)  // V_l: the warp's row pairs (load_tile_f64_pairs)
        gemm_abt_pairs<Tr::kWarpNT, Tr::kHeadDimV, Tr::kPitchVPairs, Tr::kPitchDv>(dp, V_l, dO_l);
    else
        gemm_abt<Tr::kWarpMT, Tr::kWarpNT, Tr::kHeadDimV, Tr::kPitchDv>(dp, V_l, dO_l);
    if (masked)
        p_ds_f64<Tr, true>(s, dp, lse2_s, delta_s, exp_tab, scale_log2, mask, r0, key_w);
    else
        p_ds_f64<Tr, false>(s, dp, lse2_s, delta_s, exp_tab, scale_log2, mask, r0, key_w);
}

// n8 tiles per dQ work unit (kUnitN8 consecutive n8 tiles of one 16 × kDQCols tile; the units are dealt
// round-robin to the warps): the divisor of kDQCols / 8 that puts the fewest n8 tiles on the busiest warp;
// ties take the larger unit (fewer rounds of the unit loop, fewer reloads of the dS fragments). Whole tiles
// as units left warps idle at d = 16, 32 (2 tiles for 4 warps: 1 and 2 n8 tiles per warp instead of 2
// and 4), 48, 80 and 96 (3 instead of 4).
template <int kTiles, int kN8, int kWarps>
__host__ __device__ constexpr int dq_unit_n8() {
    int best = kN8, best_cost = 1 << 30;
    for (int unit = 1; unit <= kN8; ++unit) {
        if (kN8 % unit != 0) continue;
        const int cost = (kTiles * (kN8 / unit) + kWarps - 1) / kWarps * unit;
        if (cost <= best_cost) best = unit, best_cost = cost;
    }
    return best;
}

// dQ_i += dS K_j with double atomics into query block i's accumulator dqa_i (DQAccumLayout:
// 16 × kDQCols tiles, each atomic a warp-wide 256 contiguous bytes), in work units of kUnitN8 n8 tiles of
// one tile (dq_unit_n8) dealt round-robin to the warps. A unit is done kNGroup n8 tiles at a time (fewer
// live accumulators next to dK_j, dV_j; each pass reloads the dS fragments).
template <class Tr, int kUnitN8, int kNGroup>
__device__ __forceinline__ void atomic_dq_f64(double* dqa_i, const double* dS_s, const double* K_s) {
    using A = DQAccumLayout<Tr::kHeadDim>;
    constexpr int kUnitsPerTile = A::kDQCols / 8 / kUnitN8;
    constexpr int kUnits = (Tr::kBlockM / 16) * A::kColTiles * kUnitsPerTile;
    static_assert((A::kDQCols / 8) % kUnitN8 == 0 && kUnitN8 % kNGroup == 0, "whole units, whole groups");
    const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32, g = lane / 4, t = lane % 4;
    // Not unrolled: with a partial last round (kUnits % warps != 0) ptxas hoisted the second unit's
    // loads past the guard and spilled (d = 48, Br = 32; d = 96, 112 on 2 warps).
#pragma unroll 1
    for (int it = 0; it < ceil_div_c(kUnits, Tr::kNWarps); ++it) {
        const int u = warp + it * Tr::kNWarps;
        if (kUnits % Tr::kNWarps != 0 && u >= kUnits) break;
        const int tt = u / kUnitsPerTile, u0 = u % kUnitsPerTile * kUnitN8;  // tile, its first n8 tile
        const int tm = tt / A::kColTiles, tn = tt % A::kColTiles;
        // dS rows 16tm + g (+ 8), keys 8kc + 2t, +1 at columns (8kc + 2t) ^ sw (store_ds's swizzle,
        // sw = 4·((g / 2) mod 4)) = 8·(kc ^ hi) + lo: one base pointer for even kc, one for odd.
        const int sw = 4 * ((g >> 1) & 3), lo = (2 * t) ^ (sw & 7), hi = sw >> 3;
        const double* A_even = dS_s + (16 * tm + g) * Tr::kPitchS + lo + 8 * hi;
        const double* A_odd = A_even - 16 * hi;
        const double* B_l = K_s + 2 * t * Tr::kPitchD + tn * A::kDQCols + 8 * u0 + g;  // the unit's n8 tiles
        double* dst = dqa_i + tt * A::kTileFloats + u0 * 4 * 32 + lane;
#pragma unroll
        for (int n0 = 0; n0 < kUnitN8; n0 += kNGroup) {
            double acc[2][kNGroup][2];
            zero_f64(acc);
            if constexpr (Tr::kK16) {  // key chunks kc = 2s, 2s + 1 in one m16n8k16: the same steps, same order
#pragma unroll
                for (int s = 0; s < Tr::kBlockN / 16; ++s) {
                    double a16[8];
#pragma unroll
                    for (int b = 0; b < 2; ++b)
#pragma unroll
                        for (int mt = 0; mt < 2; ++mt) {
                            const Dbl2 x = lds2((b ? A_odd : A_even) + 8 * mt * Tr::kPitchS + 8 * (2 * s + b));
                            a16[mt + 4 * b] = x.v[0], a16[mt + 4 * b + 2] = x.v[1];
                        }
#pragma unroll
                    for (int n = 0; n < kNGroup; ++n) {
                        double b16[4];
#pragma unroll
                        for (int v = 0; v < 4; ++v) b16[v] = B_l[(16 * s + 8 * (v / 2) + v % 2) * Tr::kPitchD + 8 * (n0 + n)];
                        flash::dmma16(acc[0][n], acc[1][n], a16, b16);
                    }
                }
            } else {
#pragma unroll
                for (int kc = 0; kc < Tr::kBlockN / 8; ++kc) {
                    Dbl2 a[2];
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt) a[mt] = lds2((kc % 2 ? A_odd : A_even) + 8 * mt * Tr::kPitchS + 8 * kc);
#pragma unroll
                    for (int n = 0; n < kNGroup; ++n)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const double b = B_l[(8 * kc + e) * Tr::kPitchD + 8 * (n0 + n)];
#pragma unroll
                            for (int mt = 0; mt < 2; ++mt) dmma(acc[mt][n], a[mt].v[e], b);
                        }
                }
            }
#pragma unroll
            for (int n = 0; n < kNGroup; ++n)
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                    for (int j = 0; j < 2; ++j) fa::atomic_add(dst + ((n0 + n) * 4 + 2 * mt + j) * 32, acc[mt][n][j]);
        }
    }
}

// dS (queries × keys, row-major, pitch kPitchS) from the warp's dS^T fragments, swizzled: key
// column c of row r at column c ^ 4·((r / 2) mod 4) (header). Lane (g, t) writes rows 8nt + 2t + e,
// so its XOR is 4t for every element: per 16-lane phase (g 0..3 or 4..7, t 0..3) the 8-byte slots
// (8e + (key ^ 4t)) mod 16 are all distinct — 2 wavefronts per store instead of 4.
// kK16: the warp's queries start at q0 (a multiple of 8: the XOR stays 4t).
template <class Tr>
__device__ __forceinline__ void store_ds(double* dS_s, const double (&ds)[Tr::kWarpMT][Tr::kWarpNT][2], int key_w_local,
                                         int q0 = 0) {
    const int lane = (int)threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int mt = 0; mt < Tr::kWarpMT; ++mt) {
        double* d_l = dS_s + (q0 + 2 * t) * Tr::kPitchS + ((key_w_local + 8 * mt + g) ^ (4 * t));
#pragma unroll
        for (int nt = 0; nt < Tr::kWarpNT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) d_l[(8 * nt + e) * Tr::kPitchS] = ds[mt][nt][e];
    }
}

// A kRows × kCols tile of doubles into shared memory (load_tile_tc: 16-byte cp.async chunks when
// kVec, zero-filled past n_rows, n_cols). Where the block's threads do not divide into whole rows
// of chunks (d / 2 chunks per row: d = 48 on 128 threads, 96, 112 on 64), a rolled loop: unrolled,
// its per-chunk 64-bit addresses were hoisted into registers and the kernel spilled.
template <int kRows, int kCols, int kPitch, int kNThreads, bool kVec>
__device__ __forceinline__ void load_tile_f64(double* smem, const double* gmem, long long row_stride, int n_rows,
                                              int n_cols) {
    constexpr int kChunksPerRow = kCols / 2;
    if constexpr (!kVec || kNThreads % kChunksPerRow == 0) {
        load_tile_tc<double, kRows, kCols, kPitch, kNThreads, kVec>(smem, gmem, row_stride, n_rows, n_cols);
    } else {
#pragma unroll 1
        for (int e = (int)threadIdx.x; e < kRows * kChunksPerRow; e += kNThreads) {
            const int r = e / kChunksPerRow, c = (e % kChunksPerRow) * 2;
            const bool in = r < n_rows && c < n_cols;
            fa::cp_async<16>(smem + r * kPitch + c, in ? gmem + (long long)r * row_stride + c : gmem, in ? 16 : 0);
        }
    }
}

// kK16: a kRows × kCols tile of doubles in key pairs: rows 16b + r and 16b + 8 + r (r < 8) side by side, element
// (row, c) at double 2((8b + r)·kPitchUnits + u(c)) + (row / 8) % 2 with u(c) = c ^ 2((c / 8) % 2) (the bank
// swizzle of gemm_abt_pairs' loads). 8-byte cp.async copies, zero-filled past n_rows, n_cols: lane pairs take
// the two rows of a pair, so a warp's copies fill 256 contiguous bytes and read two 128-byte row segments.
template <int kRows, int kCols, int kPitchUnits, int kNThreads>
__device__ __forceinline__ void load_tile_f64_pairs(double* smem, const double* gmem, long long row_stride,
                                                    int n_rows, int n_cols) {
    static_assert(kRows % 16 == 0 && kCols % 16 == 0, "whole row pairs, whole swizzle groups");
#pragma unroll 4
    for (int e = (int)threadIdx.x; e < kRows * kCols; e += kNThreads) {
        const int hh = e % 2, c = e / 2 % kCols, rp = e / 2 / kCols;  // row pair rp = 8b + r
        const int row = rp / 8 * 16 + hh * 8 + rp % 8;
        const bool in = row < n_rows && c < n_cols;
        fa::cp_async<8>(smem + 2 * (rp * kPitchUnits + (c ^ (c >> 3 & 1) * 2)) + hh,
                        in ? gmem + (long long)row * row_stride + c : gmem, in ? 8 : 0);
    }
}

// L_i and D_i of query block i into shared memory: 8-byte cp.async copies (zero-filled past Lq),
// thread r copying row r; converted in place by convert_row_stats_f64 once they landed.
template <int kBlockM>
__device__ __forceinline__ void load_row_stats_f64(double* lse_s, double* delta_s, const double* lse,
                                                   const double* delta, int r0, int Lq) {
    const int r = (int)threadIdx.x;
    if (r < kBlockM) {
        const bool in = r0 + r < Lq;
        fa::cp_async<8>(lse_s + r, in ? lse + r0 + r : lse, in ? 8 : 0);
        fa::cp_async<8>(delta_s + r, in ? delta + r0 + r : delta, in ? 8 : 0);
    }
}

// L_i → L_i·log2e in place, by the thread that copied it (its own cp.async has landed): +inf for a
// row that saw no key (L_i = −inf) and for rows past Lq, so that P = exp2(−inf) = 0 there; D_i
// past Lq is 0 (zero-filled).
template <int kBlockM>
__device__ __forceinline__ void convert_row_stats_f64(double* lse_s, int r0, int Lq) {
    const int r = (int)threadIdx.x;
    if (r < kBlockM) {
        const double l = lse_s[r];
        lse_s[r] = r0 + r >= Lq || l == -static_cast<double>(INFINITY) ? static_cast<double>(INFINITY)
                                                                      : l * flash::kLog2eD;
    }
}

// threadIdx.x read afresh (the epilogue's key rows are recomputed after the query-block loop
// instead of being held across it: at d = dv = 128 ptxas otherwise spills them).
__device__ __forceinline__ int tid_fresh() {
#if defined(__CUDA_ARCH__)
    int x;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(x));
    return x;
#else
    return (int)threadIdx.x;
#endif
}

// The epilogue's sources of columns 16p + 4t .. +3 of rows 8mt + g of the warp's dK_j / dV_j rows:
// register accumulators (acc[mt][2p + h][j] is column 16p + 4t + 2j + h) or dV_j in shared memory.
// kNatural (kK16): acc[mt][2p + h][j] is column 16p + 8h + 2t + j, and x = columns 16p + 2t, +1, 16p + 8 + 2t, +1.
template <int kMT, int kN, bool kNatural = false>
struct AccFromRegs {
    const double (&acc)[kMT][kN][2];
    __device__ __forceinline__ void operator()(int mt, int p, int, int, int, double (&x)[4]) const {
        if constexpr (kNatural)
            x[0] = acc[mt][2 * p][0], x[1] = acc[mt][2 * p][1], x[2] = acc[mt][2 * p + 1][0], x[3] = acc[mt][2 * p + 1][1];
        else
            x[0] = acc[mt][2 * p][0], x[1] = acc[mt][2 * p + 1][0], x[2] = acc[mt][2 * p][1], x[3] = acc[mt][2 * p + 1][1];
    }
};
// The warp's first dK_j / dV_j row in K_j and first column: kMT m8 tiles, every column; kK16: warps 2h, 2h + 1
// share keys 16h .. 16h + 15, each kCols (half of the) columns.
struct RowCol {
    int row, col;
};
template <bool kK16, int kMT, int kCols>
__device__ __forceinline__ RowCol dkv_origin(int warp) {
    return kK16 ? RowCol{16 * (warp / 2), warp % 2 * kCols} : RowCol{warp * 8 * kMT, 0};
}

template <int kMT, int kPitch, bool kK16 = false, int kCols = 0>
struct AccFromSmem {
    const double* C_s;
    __device__ __forceinline__ void operator()(int mt, int p, int warp, int g, int t, double (&x)[4]) const {
        const RowCol o = dkv_origin<kK16, kMT, kCols>(warp);
        // kK16: natural columns (16p + 2t, +1 and 16p + 8 + 2t, +1), else the permuted 16p + 4t .. +3.
        const double* r = C_s + (o.row + 8 * mt + g) * kPitch + o.col + 16 * p + (kK16 ? 2 : 4) * t;
        const Dbl2 lo = lds2(r), hi = lds2(r + (kK16 ? 8 : 2));
        x[0] = lo.v[0], x[1] = lo.v[1], x[2] = hi.v[0], x[3] = hi.v[1];
    }
};

// Epilogue: the warp's rows (keys key0 + 8mt + g) of dK_j or dV_j times mult; lane (g, t) holds
// columns 16p + 4t .. +3 = get(mt, p, ...) (registers: acc[mt][2p + h][j] is column 16p + 4t + 2j +
// h; shared memory: two 16-byte words). A quad exchange (as the forward's epilogue) makes each store
// instruction write whole 64-byte row segments: lane t stores columns 16p + 2t, +1 (elements
// 2(t%2), +1 of quad lane t/2) and 16p + 8 + 2t, +1 (of quad lane 2 + t/2). Rows < Lk, columns <
// n_cols: 16-byte stores when the rows are 16-byte aligned and n_cols is even, else element stores.
// kCols: the warp's columns (from dkv_origin's first; kK16: half of them). kK16: the lane holds its columns
// already (natural layout: x = columns 16p + 2t, +1, 16p + 8 + 2t, +1), no exchange.
template <int kMT, int kCols, bool kK16 = false, class Get>
__device__ __forceinline__ void store_dkv(double* dst, long long row_stride, const Get& get, double mult, int c0,
                                          int Lk, int n_cols) {
    const int tid = tid_fresh(), lane = tid % 32, g = lane / 4, t = lane % 4;
    const RowCol o = dkv_origin<kK16, kMT, kCols>(tid / 32);
    const int key0 = c0 + o.row;  // the warp's first key
    const bool vec = row_stride % 2 == 0 && reinterpret_cast<unsigned long long>(dst) % 16 == 0 && n_cols % 2 == 0;
    const int src_lo = (lane & ~3) | (t >> 1), src_hi = src_lo + 2;
    const bool odd = (t & 1) != 0;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
        const int key = key0 + 8 * mt + g;
        double* d_row = dst + (long long)key * row_stride;
#pragma unroll
        for (int p = 0; p < kCols / 16; ++p) {
            double x[4], y[4];
            get(mt, p, tid / 32, g, t, x);
            if constexpr (kK16) {
                if (key >= Lk) continue;
#pragma unroll
                for (int q = 0; q < 4; ++q) y[q] = x[q] * mult;
            } else {
                double lo[4], hi[4];
#pragma unroll
                for (int q = 0; q < 4; ++q) {  // every lane shuffles (rows past Lk included)
                    lo[q] = __shfl_sync(0xffffffffu, x[q], src_lo);
                    hi[q] = __shfl_sync(0xffffffffu, x[q], src_hi);
                }
                if (key >= Lk) continue;
                y[0] = (odd ? lo[2] : lo[0]) * mult, y[1] = (odd ? lo[3] : lo[1]) * mult;
                y[2] = (odd ? hi[2] : hi[0]) * mult, y[3] = (odd ? hi[3] : hi[1]) * mult;
            }
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int c = o.col + 16 * p + 8 * half + 2 * t;
                if (vec) {
                    if (c < n_cols) fa::gstore(reinterpret_cast<Dbl2*>(d_row + c), Dbl2{{y[2 * half], y[2 * half + 1]}});
                } else {
                    if (c < n_cols) fa::gstore(d_row + c, y[2 * half]);
                    if (c + 1 < n_cols) fa::gstore(d_row + c + 1, y[2 * half + 1]);
                }
            }
        }
    }
}

// kK16: one visit's products after its copies landed. The warp's score strip (keys kw .. kw + 15, queries q0 ..
// q0 + Br/2 − 1) by gemm_abt's m16n8k16; P and dS to shared memory (store_ds's layout); barrier; dV_j += P^T dO_i
// and dK_j += dS^T Q_i for the warp's half of the columns, A fragments from shared memory (the warp pair's two
// strips); add_dq(): dQ_i's atomics between them (ordered: their turn). Every product's k4 steps in the order of
// the m8n8k4 kernel's (the same bits on the emulator).
template <class Tr, class DK, class DVSink, class AddDQ, class M>
__device__ __forceinline__ void visit_k16(DK& dK_acc, const DVSink& dv_sink, const AddDQ& add_dq, double* P_s,
                                          double* dS_s, const double* K_l, const double* V_l, const double* Q_s,
                                          const double* dO_s, const double* lse2_s, const double* delta_s,
                                          const double* exp_tab, double scale_log2, const M& mask, bool masked, int r0,
                                          int c0, int kw, int q0) {
    const int lane = (int)threadIdx.x % 32, g = lane / 4, t = lane % 4, half = (int)threadIdx.x / 32 % 2;
    constexpr int kSteps = Tr::kBlockM / 16;
    {
        double p[2][Tr::kWarpNT][2], ds[2][Tr::kWarpNT][2];
        scores_f64<Tr>(p, ds, K_l, V_l, Q_s + (q0 + g) * Tr::kPitchD + 4 * t, dO_s + (q0 + g) * Tr::kPitchDv + 4 * t,
                       lse2_s + q0, delta_s + q0, exp_tab, scale_log2, mask, masked, r0 + q0, c0 + kw);
        store_ds<Tr>(P_s, p, kw, q0);
        store_ds<Tr>(dS_s, ds, kw, q0);
    }
    __syncthreads();  // both strips of P and dS written
    const int a_l = 2 * t * Tr::kPitchS + kw + (g ^ (4 * (t & 1)));  // load_a_queries's lane offset
    double a[kSteps][8];
    load_a_queries<kSteps, Tr::kPitchS>(a, P_s + a_l, t >> 1);
    gemm_rab16<kSteps, Tr::kWarpDv, Tr::kPitchDv>(a, dO_s + 2 * t * Tr::kPitchDv + g + half * Tr::kWarpDv, dv_sink);
    add_dq();
    load_a_queries<kSteps, Tr::kPitchS>(a, dS_s + a_l, t >> 1);
    gemm_rab16<kSteps, Tr::kWarpD, Tr::kPitchD>(a, Q_s + 2 * t * Tr::kPitchD + g + half * Tr::kWarpD,
                                               [&](int pp, const double (&part)[2][2][2]) { add_pair(dK_acc, pp, part); });
}

}  // namespace fa_bwd
using namespace fa_bwd;

// dK_j, dV_j and atomic dQ: grid = (Tc, nb1 * nb2, nb0); the argument list of flash_bwd_dkv_kernel
// (T = OutT = AccT = double). kVecLoad: q, k, v, dout rows 16-byte aligned, D and Dv even (cp.async
// 16-byte chunks), else element loads. kOrderedDQ: dQ's atomics in key-block order (see above).
// kStages: buffers of Q_i, dO_i, L_i, D_i (2: the next visit's copies overlap this visit's products).
// kDmmaK: 4 — every product by m8n8k4; 16 — by m16n8k16 (sm_90+; visit_k16: warp pairs share 16 keys).
template <int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN, int kNWarps, bool kIsCausal, bool kVecLoad,
          bool kOrderedDQ, int kStages = 1, int kDmmaK = 4>
__global__ void __launch_bounds__(kNWarps * 32, kMinBlocksPerSm) flash_bwd_dkv_f64_kernel(
    const double* __restrict__ q, long long q_b0, long long q_b1, long long q_b2, long long q_g, long long q_row,
    const double* __restrict__ k, long long k_b0, long long k_b1, long long k_b2, long long k_row,
    const double* __restrict__ v, long long v_b0, long long v_b1, long long v_b2, long long v_row,
    const double* __restrict__ dout, long long do_b0, long long do_b1, long long do_b2, long long do_g,
    long long do_row,
    const double* __restrict__ lse, long long l_b0, long long l_b1, long long l_b2, long long l_g,
    const double* __restrict__ delta, long long d_b0, long long d_b1, long long d_b2, long long d_g,
    double* __restrict__ dq_accum, long long dqa_b0, long long dqa_b1, long long dqa_b2, long long dqa_g,
    long long dqa_row /* = kHeadDim (DQAccumLayout); unused */,
    double* __restrict__ dk, long long dk_b0, long long dk_b1, long long dk_b2, long long dk_row,
    double* __restrict__ dv, long long dv_b0, long long dv_b1, long long dv_b2, long long dv_row,
    int Lq, int Lk, int D, int Dv, int nb2, int n_group, double scale, FLASH_EXT_PARAMS(double)) {
    using Tr = BwdF64Traits<kHeadDim, kHeadDimV, kBlockM, kBlockN, kNWarps, kStages, kDmmaK>;
    constexpr int kNThreads = Tr::kNThreads, kMT = Tr::kMT, kNT = Tr::kNT, kWMT = Tr::kWarpMT;
    // dQ's work units (dq_unit_n8) and n8 tiles per pass: 1 where dK_j, dV_j take 128 registers or more.
    using DQA = DQAccumLayout<kHeadDim>;
    constexpr int kDQUnit = dq_unit_n8<(kBlockM / 16) * DQA::kColTiles, DQA::kDQCols / 8, kNWarps>();
    constexpr int kDQGroup = kMT * (kHeadDim + kHeadDimV) >= 256 ? 1 : kDQUnit;
    (void)dqa_row;

    FA_DYNAMIC_SMEM(smem);
    double* Q_buf = reinterpret_cast<double*>(smem + Tr::kQ);       // Q_i  Br × d   × kStages
    double* dO_buf = reinterpret_cast<double*>(smem + Tr::kdO);     // dO_i Br × dv  × kStages
    double* K_s = reinterpret_cast<double*>(smem + Tr::kK);         // K_j  Bc × d
    double* V_s = reinterpret_cast<double*>(smem + Tr::kV);         // V_j  Bc × dv
    double* dS_s = reinterpret_cast<double*>(smem + Tr::kdS);       // dS   Br × Bc
    double* lse2_buf = reinterpret_cast<double*>(smem + Tr::kL);    // L_i·log2e  Br × kStages
    double* delta_buf = reinterpret_cast<double*>(smem + Tr::kDelta);  // D_i    Br × kStages
    double* exp_tab = reinterpret_cast<double*>(smem + Tr::kExpTab);   // exp2_nonpositive's table
    flash::exp2_table_fill(exp_tab, (int)threadIdx.x);                  // read after the first visit's barrier

    const BatchIndex b = BatchIndex::from_grid(nb2);
    const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    // The key block: blockIdx.x, or in the ordered causal mode Tc - 1 - blockIdx.x (DQOrder).
    using Order = DQOrderOf<kIsCausal, kOrderedDQ, 0>;
    const Order dq_order = Order::make();
    const int c0 = dq_order.n * kBlockN;       // first key of K_j
    const RowCol o_w = dkv_origin<Tr::kK16, kMT, 0>(warp);
    const int kw = o_w.row;                     // the warp's first key in K_j
    const int q0 = Tr::kK16 ? warp % 2 * kBlockM / 2 : 0;  // kK16: the warp's first query of the score strip
    const double scale_log2 = scale * flash::kLog2eD;
    const Mask<kIsCausal, 0, double> mask(Lq, Lk);

    // Visits (grp, i): i from i_begin (causal: blocks above the diagonal skipped) to Tr − 1, grp outer.
    const int i_begin = mask.m_block_min(c0, kBlockM);
    const int n_q_blocks = (Lq + kBlockM - 1) / kBlockM;
    const int n_visits = (n_q_blocks > i_begin ? n_q_blocks - i_begin : 0) * n_group;
    auto dqa_entry = [&](int grp) { return dq_accum + b.offset({dqa_b0, dqa_b1, dqa_b2, 0}) + (long long)grp * dqa_g; };
    const DQOrderCounters<kBlockM, kHeadDim> order{Lq};

    // -- prologue: K_j, V_j into shared memory, once.
    load_tile_f64<kBlockN, kHeadDim, Tr::kPitchD, kNThreads, kVecLoad>(
        K_s, k + b.offset({k_b0, k_b1, k_b2, k_row}) + (long long)c0 * k_row, k_row, Lk - c0, D);
    if constexpr (Tr::kK16)
        load_tile_f64_pairs<kBlockN, kHeadDimV, Tr::kPitchVPairs, kNThreads>(
            V_s, v + b.offset({v_b0, v_b1, v_b2, v_row}) + (long long)c0 * v_row, v_row, Lk - c0, Dv);
    else
        load_tile_f64<kBlockN, kHeadDimV, Tr::kPitchDv, kNThreads, kVecLoad>(
            V_s, v + b.offset({v_b0, v_b1, v_b2, v_row}) + (long long)c0 * v_row, v_row, Lk - c0, Dv);
    // Start the copies of query block i of group entry grp (Q_i, dO_i, L_i, D_i) into buffer buf.
    auto load_query_block = [&](int grp, int i, int buf) {
        const int r0 = i * kBlockM;
        load_tile_f64<kBlockM, kHeadDim, Tr::kPitchD, kNThreads, kVecLoad>(
            Q_buf + buf * Tr::kQStage,
            q + b.offset({q_b0, q_b1, q_b2, q_row}) + (long long)grp * q_g + (long long)r0 * q_row, q_row, Lq - r0, D);
        load_tile_f64<kBlockM, kHeadDimV, Tr::kPitchDv, kNThreads, kVecLoad>(
            dO_buf + buf * Tr::kdOStage,
            dout + b.offset({do_b0, do_b1, do_b2, do_row}) + (long long)grp * do_g + (long long)r0 * do_row, do_row,
            Lq - r0, Dv);
        load_row_stats_f64<kBlockM>(lse2_buf + buf * Tr::kRowStage, delta_buf + buf * Tr::kRowStage,
                                    lse + b.offset({l_b0, l_b1, l_b2, 0}) + (long long)grp * l_g,
                                    delta + b.offset({d_b0, d_b1, d_b2, 0}) + (long long)grp * d_g, r0, Lq);
    };
    fa::cp_async_commit();
    if (kStages == 2 && n_visits > 0) load_query_block(0, i_begin, 0);  // the first visit's, in flight
    fa::cp_async_commit();

    // Per-lane fragment offsets (header; plus the visit's buffer): A' order for S^T, dP^T (Q_l,
    // dO_l), C-layout rows for dV, dK (Qb_l, dOb_l).
    const double* K_l = K_s + (kw + g) * Tr::kPitchD + 4 * t;
    const double* V_l = Tr::kK16 ? V_s + 2 * ((kw / 2 + g) * Tr::kPitchVPairs + 4 * t)  // row pairs (kK16)
                                 : V_s + (kw + g) * Tr::kPitchDv + 4 * t;
    const int Q_l = g * Tr::kPitchD + 4 * t, dO_l = g * Tr::kPitchDv + 4 * t;
    const int Qb_l = 2 * t * Tr::kPitchD + 2 * g, dOb_l = 2 * t * Tr::kPitchDv + 2 * g;

    // dK_j, dV_j rows kw + 8mt + g, the warp's columns (kK16: half of them; dV_j in shared memory where
    // Tr::kDVSmem: this lane's elements).
    double dK_acc[kWMT][Tr::kWarpD / 8][2], dV_acc[kWMT][Tr::kDVSmem ? 2 : Tr::kWarpDv / 8][2];
    double* dV_l = reinterpret_cast<double*>(smem + Tr::kdV) + (kw + g) * Tr::kPitchDvAcc +
                   (Tr::kK16 ? 2 * t + warp % 2 * Tr::kWarpDv : 4 * t);
    zero_f64(dK_acc);
    zero_f64(dV_acc);
    if constexpr (Tr::kDVSmem) {
#pragma unroll
        for (int mt = 0; mt < kWMT; ++mt)
#pragma unroll
            for (int c = 0; c < Tr::kWarpDv; c += 2) {
                if (c % 16 == 0 || c % 16 == (Tr::kK16 ? 8 : 2))  // this lane's 16-byte words (kK16: natural)
                    *reinterpret_cast<Dbl2*>(dV_l + 8 * mt * Tr::kPitchDvAcc + c) = Dbl2{{0.0, 0.0}};
            }
    }

    // Visit (grp, i) and the next one (grp_n, i_n), stepped without divisions.
    int grp = 0, i = i_begin;
    for (int visit = 0; visit < n_visits; ++visit) {
        const int r0 = i * kBlockM;
        const bool wrap = i + 1 == n_q_blocks;
        const int i_n = wrap ? i_begin : i + 1, grp_n = wrap ? grp + 1 : grp;
        const int buf = kStages == 2 ? visit % 2 : 0;
        const double* Q_s = Q_buf + buf * Tr::kQStage;       // Q_i  Br × d
        const double* dO_s = dO_buf + buf * Tr::kdOStage;    // dO_i Br × dv
        double* lse2_s = lse2_buf + buf * Tr::kRowStage;     // L_i·log2e
        const double* delta_s = delta_buf + buf * Tr::kRowStage;  // D_i
        // Barrier: every warp is done with the previous visit (its buffers, about to be refilled, and dS).
        __syncthreads();
        const bool prefetch = kStages == 2 && visit + 1 < n_visits;
        if (kStages == 1) load_query_block(grp, i, 0);
        if (prefetch) load_query_block(grp_n, i_n, buf ^ 1);  // overlaps this visit's products
        fa::cp_async_commit();
        // This thread's copies of this visit's tiles landed (first visit: also K_j, V_j; the
        // prefetch may be in flight).
        if (prefetch)
            fa::cp_async_wait<1>();
        else
            fa::cp_async_wait<0>();
        convert_row_stats_f64<kBlockM>(lse2_s, r0, Lq);
        // Barrier: every thread's copies and L_i·log2e are visible to every warp.
        __syncthreads();

        if constexpr (Tr::kK16) {
            const auto add_dq = [&] {  // after visit_k16's barrier (ordered: the turn, a second barrier)
                if constexpr (kOrderedDQ)
                    fa::sem_wait(order.counter(dqa_entry(grp), i), dq_order.turn(i, kBlockM, kBlockN, mask.causal_offset));
                atomic_dq_f64<Tr, kDQUnit, kDQGroup>(dqa_entry(grp) + (long long)r0 * kHeadDim, dS_s, K_s);
                if constexpr (kOrderedDQ) fa::sem_post(order.counter(dqa_entry(grp), i));
            };
            const auto dv_sink = [&](int pp, const double (&part)[2][2][2]) {  // dV_j += this visit's sums
                if constexpr (Tr::kDVSmem) {  // natural columns 16pp + 8h + 2t, +1
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            Dbl2* c = reinterpret_cast<Dbl2*>(dV_l + 8 * mt * Tr::kPitchDvAcc + 16 * pp + 8 * h);
                            const Dbl2 x = *c;
                            *c = Dbl2{{x.v[0] + part[mt][h][0], x.v[1] + part[mt][h][1]}};
                        }
                } else {
                    add_pair(dV_acc, pp, part);
                }
            };
            visit_k16<Tr>(dK_acc, dv_sink, add_dq, reinterpret_cast<double*>(smem + Tr::kP), dS_s, K_l, V_l, Q_s,
                          dO_s, lse2_s, delta_s, exp_tab, scale_log2, mask, mask.needs_mask(r0, c0, kBlockM, kBlockN),
                          r0, c0, kw, q0);
        } else {
            double p[kMT][kNT][2], ds[kMT][kNT][2];
            scores_f64<Tr>(p, ds, K_l, V_l, Q_s + Q_l, dO_s + dO_l, lse2_s, delta_s, exp_tab, scale_log2, mask,
                           mask.needs_mask(r0, c0, kBlockM, kBlockN), r0, c0 + kw);
            // dV_j += P^T dO_i first (P^T dies before dQ's registers are live; the barrier below keeps
            // ptxas from overlapping the products).
            if constexpr (Tr::kDVSmem)
                gemm_rab_smem<kMT, kNT, kHeadDimV, Tr::kPitchDv>(dV_l, p, dO_s + dOb_l);
            else
                gemm_rab<kMT, kNT, kHeadDimV, Tr::kPitchDv>(dV_acc, p, dO_s + dOb_l);
            store_ds<Tr>(dS_s, ds, kw);
            // Barrier: dS complete before warps read its rows for dQ (ordered: and our turn).
            if constexpr (kOrderedDQ)
                fa::sem_wait(order.counter(dqa_entry(grp), i),
                             dq_order.turn(i, kBlockM, kBlockN, mask.causal_offset));
            else
                __syncthreads();
            atomic_dq_f64<Tr, kDQUnit, kDQGroup>(dqa_entry(grp) + (long long)r0 * kHeadDim, dS_s, K_s);
            if constexpr (kOrderedDQ) fa::sem_post(order.counter(dqa_entry(grp), i));
            // dK_j += dS^T Q_i (scale applied once, at the end).
            gemm_rab<kMT, kNT, kHeadDim, Tr::kPitchD>(dK_acc, ds, Q_s + Qb_l);
        }

        i = i_n, grp = grp_n;
    }
    fa::cp_async_wait<0>();  // no copy outlives the kernel when no query block was visited

    // -- epilogue: dK_j · scale and dV_j (rows < Lk, columns < D / Dv).
    constexpr bool kK16 = Tr::kK16;
    store_dkv<kWMT, Tr::kWarpD, kK16>(dk + b.offset({dk_b0, dk_b1, dk_b2, dk_row}), dk_row,
                                      AccFromRegs<kWMT, Tr::kWarpD / 8, kK16>{dK_acc}, scale, c0, Lk, D);
    if constexpr (Tr::kDVSmem) {
        // This lane's own elements (no barrier: written by this lane only), read afresh.
        const AccFromSmem<kWMT, Tr::kPitchDvAcc, kK16, Tr::kWarpDv> from_smem{
            reinterpret_cast<const double*>(smem + Tr::kdV)};
        store_dkv<kWMT, Tr::kWarpDv, kK16>(dv + b.offset({dv_b0, dv_b1, dv_b2, dv_row}), dv_row, from_smem, 1.0, c0, Lk, Dv);
    } else {
        store_dkv<kWMT, Tr::kWarpDv, kK16>(dv + b.offset({dv_b0, dv_b1, dv_b2, dv_row}), dv_row,
                                           AccFromRegs<kWMT, Tr::kDVSmem ? 2 : Tr::kWarpDv / 8, kK16>{dV_acc}, 1.0,
                                           c0, Lk, Dv);
    }
}
