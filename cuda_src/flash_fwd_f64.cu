// flash_fwd_f64.cu — FlashAttention forward for float64 inputs on the double-precision tensor cores
// (DMMA, mma.sync.m8n8k4.f64, sm_80+; m16n8k16.f64 on sm_90), issue 12.
//
// Same algorithm, work split and pipeline as the TF32 forward (flash_fwd_tf32.cu): one thread block
// per (query tile Q_i, batch entry), kNWarps warps each owning one 16-row slab of Q_i, S_ij, P_ij
// and O_i (two m8 tiles: rows g and g + 8 of the slab, so a row's softmax statistics stay in one
// quad); V_j is fetched while S_ij = Q_i K_jᵀ runs, K_{j−1} while the softmax and O_i += P_ij V_j
// run (one K and one V buffer: two barriers per key tile — fp64 tiles are twice the fp32 ones, and
// double-buffering them would cost the block its second slot per SM); key tiles last first, only
// the tiles crossing the causal diagonal or the sequence end pay for the mask. Everything is IEEE
// fp64: every product is a DMMA (fp64 fused multiply-add chains, fp64 accumulation), the online
// softmax runs in double (log2(e) folded into the scale by one fma per score; the weights by
// flash_f64_exp.cuh's exp2_nonpositive, more accurate than exp2(double) on their range at under a third
// of its instructions, its 2^(j/16) table in shared memory after V_j; the row statistics by exp2 / log2(double) as in the SIMT fp64 kernel), O_i is
// divided by l_i once; fp64 out and fp64 LSE (natural log).
//
// Fragments (docs/emulator.md, m8n8k4 f64; g = lane / 4, t = lane % 4):
//   A 8×4 row:  a0 = A[g][t]      B 4×8 col:  b0 = B[t][g]      C 8×8:  c0, c1 = C[g][2t, 2t+1]
// Each shared-memory read is one 16-byte load (two doubles) feeding two DMMA k4 steps, by
// permuting indices the products sum over (or that only relabel output columns):
//   S = Q Kᵀ, per k8 step kk: lane (g, t) loads Q[row g][8kk + 2t, +1] and K[key g][8kk + 2t, +1];
//     DMMA step e ∈ {0, 1} takes element e of both, i.e. its k index t is head-dim column
//     8kk + 2t + e — the same permutation for A and B, so the sum is Q Kᵀ's (in another order).
//   O += P V, per n8 tile nt of S: lane (g, t) holds P[g][8nt + 2t + e] (C layout, e = 0, 1) and
//     uses it as a0 of DMMA step e, whose k index t is key 8nt + 2t + e, so b0 must be
//     V[8nt + 2t + e][·]: no lane exchange. The B column g of output n8 tiles 2p and 2p + 1 is dv
//     column 16p + 2g + h (h = 0, 1): one 16-byte load of V[key][16p + 2g, +1] feeds both, and C
//     element j of tile 2p + h is dv column 16p + 4t + 2j + h — lane (g, t) holds 4 consecutive
//     columns 16p + 4t .. +3 of O (a quad exchange in the epilogue turns them into stores of whole
//     64-byte row segments).
// sm_90 (kDmmaK = 16): the same k4 steps four at a time, two m8 tiles at once, by mma.m16n8k16.f64 (DMMA.16x8x16,
//   flash_f64_mma.cuh): S's steps of k8 groups 2kp, 2kp + 1, P V's of n8 tiles 2np, 2np + 1, in the order above —
//   the same bits, one instruction per eight. (The fragments' registers are interleaved by m8 tile; ptxas moves
//   the 16-byte loads' halves into place.)
// Row pitches (doubles): Q, K d + 8 (≡ 8 mod 16: the 8 lanes of a 16-byte-load phase, g ∈ {0, 1} ×
// t, hit 8 distinct 16-byte bank groups: 4·(g mod 2) + t), V dv + 2 (≡ 2 mod 8: groups 2t + g).
//
// Register blocking per warp and k step: each A fragment (16 bytes: two k steps) feeds the Bc/8
// n8 tiles of S, each B fragment both m8 tiles; P V's A fragments come from registers and each V
// load feeds 2 n8 tiles × 2 m8 tiles. Per thread: O_i 2 × dv/4 doubles, S_ij 2 × Bc/4 doubles.
//
// Shapes: d, dv (head dims padded to multiples of 16, zero-filled past D, Dv) <= 128;
// Br = 16·kNWarps, Bc a multiple of 8. The FLASH_EXT_PARAMS tail is taken (the SIMT kernel's
// dense argument list, so the host lays out both alike) and ignored: calls with extensions,
// split-KV or a KV cache run the SIMT kernel.
#include "fa_port.cuh"
#include "flash_kernel_traits.cuh"
#include "flash_block_info.cuh"
#include "flash_mask.cuh"
#include "flash_softmax.cuh"
#include "flash_fwd_copy.cuh"
#include "flash_fwd_tiles.cuh"
#include "flash_ext.cuh"
#include "flash_f64_exp.cuh"
#include "flash_f64_mma.cuh"

namespace flash {

template <int kHeadDim_, int kHeadDimV_, int kBlockM_, int kBlockN_, int kNWarps_>
struct FwdF64Traits {
  static constexpr int kHeadDim = kHeadDim_, kHeadDimV = kHeadDimV_;
  static constexpr int kBlockM = kBlockM_, kBlockN = kBlockN_, kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * kWarpSize;
  static constexpr int kStrideQ = kHeadDim + 8, kStrideK = kHeadDim + 8;  // doubles per row
  static constexpr int kStrideV = kHeadDimV + 2;
  static constexpr int kSmemQOffset = 0;
  static constexpr int kSmemKOffset = Align16<kBlockM * kStrideQ * 8>::value;
  static constexpr int kSmemVOffset = kSmemKOffset + Align16<kBlockN * kStrideK * 8>::value;
  static constexpr int kSmemTableOffset = kSmemVOffset + Align16<kBlockN * kStrideV * 8>::value;  // 2^(j/16)
  static constexpr int kSmemBytes = kSmemTableOffset + kExp2TableBytes;
  static constexpr int kMTiles = 2;               // m8 tiles per warp (rows g, g + 8 of its slab)
  static constexpr int kNTilesS = kBlockN / 8;    // n8 tiles across Bc (= k8 groups of P V)
  static constexpr int kNTilesO = kHeadDimV / 8;  // n8 tiles across dv
  static constexpr int kK8StepsS = kHeadDim / 8;  // 16-byte k groups (2 DMMA k4 steps) of Q Kᵀ

  static_assert(kBlockM == 16 * kNWarps, "one 16-row slab (two m8 tiles) per warp");
  static_assert(kBlockN % 8 == 0, "Bc: whole n8 tiles");
  static_assert(kHeadDim % 16 == 0 && kHeadDimV % 16 == 0 && kHeadDim <= 128 && kHeadDimV <= 128,
                "d, dv: multiples of 16, at most 128");
  static_assert(kStrideQ % 16 == 8 && kStrideV % 8 == 2, "pitches: conflict-free 16-byte fragment loads");
};

// Two doubles from shared memory (one 16-byte load).
__device__ __forceinline__ Vec16<double> lds2(const double* p) { return *reinterpret_cast<const Vec16<double>*>(p); }

// kDmmaK: 4 — every product by m8n8k4 (sm_80+); 16 — by m16n8k16 (sm_90+: flash_f64_mma.cuh's dmma16, the same
// steps in the same order, so the same bits).
template <int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN, int kNWarps, bool Is_causal, bool Is_aligned,
          int kDmmaK = 4>
__global__ void __launch_bounds__(kNWarps * 32, kMinBlocksPerSm)
flash_fwd_f64_kernel(const double* __restrict__ q, const double* __restrict__ k, const double* __restrict__ v,
                     double* __restrict__ o, double* __restrict__ lse,
                     int Lq, int Lk, int D, int Dv, int nb2,
                     long long q_b0, long long q_b1, long long q_b2, long long q_row,
                     long long k_b0, long long k_b1, long long k_b2, long long k_row,
                     long long v_b0, long long v_b1, long long v_b2, long long v_row,
                     long long o_b0, long long o_b1, long long o_b2, long long o_row,
                     long long lse_b0, long long lse_b1, long long lse_b2,
                     double scale_log2, FLASH_EXT_PARAMS(double)) {
  using Traits = FwdF64Traits<kHeadDim, kHeadDimV, kBlockM, kBlockN, kNWarps>;
  constexpr int kNThreads = Traits::kNThreads;
  constexpr int kMT = Traits::kMTiles;
  constexpr int kNTilesS = Traits::kNTilesS;
  constexpr int kNTilesO = Traits::kNTilesO;
  constexpr int kQuad = 4;
  static_assert(kDmmaK == 4 || (kDmmaK == 16 && kMT == 2 && kBlockN % 16 == 0), "kDmmaK: 4, or 16 with Bc % 16 == 0");

  FA_DYNAMIC_SMEM(smem);
  double* sQ = reinterpret_cast<double*>(smem + Traits::kSmemQOffset);  // Q_i  Br × d
  double* sK = reinterpret_cast<double*>(smem + Traits::kSmemKOffset);  // K_j  Bc × d
  double* sV = reinterpret_cast<double*>(smem + Traits::kSmemVOffset);  // V_j  Bc × dv
  double* sTab = reinterpret_cast<double*>(smem + Traits::kSmemTableOffset);  // exp2_nonpositive's table

  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32, lane = tid % 32;
  const int g = lane >> 2, t = lane & 3;
  const int warp_row0 = warp * 16;
  const int m0 = query_tile<Is_causal>(static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x)) * kBlockM;
  exp2_table_fill(sTab, tid);  // read after the key loop's first barrier

  const BatchIndex bidx = BatchIndex::from_grid(nb2);
  const TensorStrides q_s{q_b0, q_b1, q_b2, q_row}, k_s{k_b0, k_b1, k_b2, k_row};
  const TensorStrides v_s{v_b0, v_b1, v_b2, v_row}, o_s{o_b0, o_b1, o_b2, o_row};
  const TensorStrides lse_s{lse_b0, lse_b1, lse_b2, 1};
  const double* q_i = q + bidx.offset(q_s) + m0 * q_row;
  const double* k_base = k + bidx.offset(k_s);
  const double* v_base = v + bidx.offset(v_s);
  double* o_i = o + bidx.offset(o_s) + m0 * o_row;
  double* lse_i = lse + bidx.offset(lse_s) + m0;
  const ExtArgs<double> ext = FLASH_EXT_ARGS(double);  // kExt = 0: unused
  (void)ext;

  const Mask<Is_causal, 0, double> mask(Lq, Lk);
  const int n_block_max = mask.n_block_max(m0, kBlockM, kBlockN);
  const int n_block_unmasked = unmasked_key_tiles<Is_causal>(mask, m0, kBlockN, n_block_max);

  double acc_o[kMT][kNTilesO][2];
  OnlineSoftmaxRow<double> stat[kMT];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    stat[mt].init();
#pragma unroll
    for (int dt = 0; dt < kNTilesO; ++dt) acc_o[mt][dt][0] = acc_o[mt][dt][1] = 0.0;
  }

  // Fragment addresses: Q rows warp_row0 + g (+8), K key g, columns 2t of each k8 group; V key
  // rows 2t (+1) of each n8 tile, dv columns 2g of each 16-column pair of n8 tiles.
  const double* sQ_lane = sQ + (warp_row0 + g) * Traits::kStrideQ + 2 * t;
  const double* sK_lane = sK + g * Traits::kStrideK + 2 * t;
  const double* sV_lane = sV + 2 * t * Traits::kStrideV + 2 * g;

  using CopyK = TileCopy<double, kBlockN, kHeadDim, Traits::kStrideK, kNThreads>;
  using CopyV = TileCopy<double, kBlockN, kHeadDimV, Traits::kStrideV, kNThreads>;
  const CopyK copy_k(k_row, D, tid);
  const CopyV copy_v(v_row, Dv, tid);
  auto load_k = [&](bool full, int n0) {
    if constexpr (Is_aligned) copy_k.load(full, sK, k_base + n0 * k_row, rows_in_tile(n0, kBlockN, Lk));
    else load_tile<double, kBlockN, kHeadDim, Traits::kStrideK, kNThreads, false>(
        sK, k_base + n0 * k_row, k_row, rows_in_tile(n0, kBlockN, Lk), D, tid);
  };
  auto load_v = [&](bool full, int n0) {
    if constexpr (Is_aligned) copy_v.load(full, sV, v_base + n0 * v_row, rows_in_tile(n0, kBlockN, Lk));
    else load_tile<double, kBlockN, kHeadDimV, Traits::kStrideV, kNThreads, false>(
        sV, v_base + n0 * v_row, v_row, rows_in_tile(n0, kBlockN, Lk), Dv, tid);
  };

  using TileS = double[kMT][kNTilesS][2];
  // S_ij = Q_i K_jᵀ: per k8 group the warp's two Q fragments, then per n8 tile one K fragment
  // feeding 2 k4 steps × 2 m8 tiles.
  auto gemm_qk = [&](TileS& acc_s) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNTilesS; ++nt) acc_s[mt][nt][0] = acc_s[mt][nt][1] = 0.0;
    if constexpr (kDmmaK == 16) {
      // k4 step s = 2h + e of k8 groups 2kp, 2kp + 1: element e of load h (as below, four steps per instruction)
#pragma unroll
      for (int kp = 0; kp < Traits::kK8StepsS / 2; ++kp) {
        Vec16<double> q[kMT][2];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h) q[mt][h] = lds2(sQ_lane + 8 * mt * Traits::kStrideQ + 8 * (2 * kp + h));
        double a[8];
#pragma unroll
        for (int v = 0; v < 8; ++v) a[v] = q[v & 1][v >> 2].v[(v >> 1) & 1];
#pragma unroll
        for (int nt = 0; nt < kNTilesS; ++nt) {
          const Vec16<double> k0 = lds2(sK_lane + 8 * nt * Traits::kStrideK + 16 * kp);
          const Vec16<double> k1 = lds2(sK_lane + 8 * nt * Traits::kStrideK + 16 * kp + 8);
          const double b[4] = {k0.v[0], k0.v[1], k1.v[0], k1.v[1]};
          dmma16(acc_s[0][nt], acc_s[1][nt], a, b);
        }
      }
      return;
    }
#pragma unroll
    for (int kk = 0; kk < Traits::kK8StepsS; ++kk) {
      Vec16<double> a[kMT];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) a[mt] = lds2(sQ_lane + 8 * mt * Traits::kStrideQ + 8 * kk);
#pragma unroll
      for (int nt = 0; nt < kNTilesS; ++nt) {
        const Vec16<double> b = lds2(sK_lane + 8 * nt * Traits::kStrideK + 8 * kk);
#pragma unroll
        for (int e = 0; e < 2; ++e)
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) dmma(acc_s[mt][nt], a[mt].v[e], b.v[e]);
      }
    }
  };

  // Mask (tiles crossing the diagonal or the sequence end), online softmax of rows g, g + 8:
  // acc_s[mt][nt][e] = S[8·mt + g][8·nt + 2t + e]; P_ij replaces S_ij (unnormalised).
  // O_i is rescaled only when some row of the warp got a new max (a factor of exactly 1 elsewhere: no bit
  // changes; flash_fwd.cu).
  auto softmax_step = [&](bool tile_masked, TileS& acc_s, int n0) {
    double correction[kMT];
    bool moved = false;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      if (tile_masked) {
#pragma unroll
        for (int nt = 0; nt < kNTilesS; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            acc_s[mt][nt][e] = mask.apply(acc_s[mt][nt][e], m0 + warp_row0 + 8 * mt + g, n0 + 8 * nt + 2 * t + e);
      }
      double tile_max = acc_s[mt][0][0];
#pragma unroll
      for (int nt = 0; nt < kNTilesS; ++nt) tile_max = max_acc(tile_max, max_acc(acc_s[mt][nt][0], acc_s[mt][nt][1]));
      tile_max = group_allreduce_max<kQuad>(tile_max);
      correction[mt] = stat[mt].update_max(tile_max * scale_log2, [&](double x) { return exp2_nonpositive(x, sTab); });
      moved |= correction[mt] != 1.0;
    }
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int dt = 0; dt < kNTilesO; ++dt) {
          acc_o[mt][dt][0] *= correction[mt];
          acc_o[mt][dt][1] *= correction[mt];
        }
    }
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      const double m_sub = stat[mt].max_for_exp();
#pragma unroll
      for (int nt = 0; nt < kNTilesS; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const double x = fma(acc_s[mt][nt][e], scale_log2, -m_sub);
          const double p = exp2_nonpositive(x, sTab);
          stat[mt].l += p;
          acc_s[mt][nt][e] = p;
        }
    }
  };

  // O_i += P_ij V_j: k4 step (nt, e) is keys 8nt + 2t + e; one V load per n8 tile pair of dv.
  auto gemm_pv = [&](const TileS& acc_s) {
    if constexpr (kDmmaK == 16) {
      // k4 step s = 2h + e of n8 tiles 2np, 2np + 1: keys 8(2np + h) + 2t + e; the 16-byte V loads and output
      // columns as below (each load's element h feeds n8 tile 2p + h).
#pragma unroll
      for (int np = 0; np < kNTilesS / 2; ++np) {
        double a[8];
#pragma unroll
        for (int v = 0; v < 8; ++v) a[v] = acc_s[v & 1][2 * np + (v >> 2)][(v >> 1) & 1];
#pragma unroll
        for (int p = 0; p < kNTilesO / 2; ++p) {
          Vec16<double> vb[4];
#pragma unroll
          for (int s = 0; s < 4; ++s) vb[s] = lds2(sV_lane + (16 * np + 8 * (s >> 1) + (s & 1)) * Traits::kStrideV + 16 * p);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const double b[4] = {vb[0].v[h], vb[1].v[h], vb[2].v[h], vb[3].v[h]};
            dmma16(acc_o[0][2 * p + h], acc_o[1][2 * p + h], a, b);
          }
        }
      }
      return;
    }
#pragma unroll
    for (int nt = 0; nt < kNTilesS; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const double* sV_k = sV_lane + (8 * nt + e) * Traits::kStrideV;
#pragma unroll
        for (int p = 0; p < kNTilesO / 2; ++p) {
          const Vec16<double> b = lds2(sV_k + 16 * p);
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) dmma(acc_o[mt][2 * p + h], acc_s[mt][nt][e], b.v[h]);
        }
      }
  };

  // ---- prologue: Q_i and the last key tile in flight ---------------------------------------------
  // The first tile's V_j comes with K_j: only that tile can be partial, so the loop's V_j copies are whole tiles
  // (no row checks; flash_fwd.cu's single-buffered loop).
  int n_block = n_block_max - 1;
  const int n_first = n_block;
  if (n_block >= 0) {
    load_tile<double, kBlockM, kHeadDim, Traits::kStrideQ, kNThreads, Is_aligned>(
        sQ, q_i, q_row, rows_in_tile(m0, kBlockM, Lq), D, tid);
    load_k(false, n_block * kBlockN);
    load_v(false, n_block * kBlockN);
    fa::cp_async_commit();
  }

  // ---- key loop, last tile first (the masked tiles first); two barriers per tile -----------------
  for (; n_block >= 0; --n_block) {
    const int n0 = n_block * kBlockN;
    const bool masked = n_block >= n_block_unmasked;
    fa::cp_async_wait<0>();
    // Barrier: K_j (and Q_i) landed for every thread's copies; every warp has finished reading
    // V_{j+1}, so sV may be overwritten.
    __syncthreads();
    if (n_block != n_first) load_v(true, n0);  // a whole tile (the first one's came with K_j)
    fa::cp_async_commit();

    TileS acc_s;
    gemm_qk(acc_s);

    fa::cp_async_wait<0>();
    // Barrier: V_j landed for every thread's copies; every warp has finished reading K_j.
    __syncthreads();
    if (n_block > 0) load_k(true, n0 - kBlockN);
    fa::cp_async_commit();

    softmax_step(masked, acc_s, n0);
    gemm_pv(acc_s);
  }

  // ---- epilogue: O_i / l_i once, fp64 from the fragments; LSE by the quad's lane 0 ----------------
  // Lane (g, t) holds columns 16p + 4t .. +3 of each 16-column pair p; a quad exchange makes each
  // store instruction write whole rows of 64 bytes (full 32-byte sectors): lane t stores columns
  // 16p + 2t, +1 (elements 2(t%2), +1 of quad lane t/2) and 16p + 8 + 2t, +1 (of quad lane 2 + t/2).
  const bool vec = (o_row % 2 == 0) && (reinterpret_cast<unsigned long long>(o_i) % 16 == 0) && Dv % 2 == 0;
  const int src_lo = (lane & ~3) | (t >> 1), src_hi = src_lo + 2;
  const bool odd = (t & 1) != 0;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    const double l_total = group_allreduce_sum<kQuad>(stat[mt].l);
    const double inv_l = stat[mt].inv_sum(l_total);
    const int row = warp_row0 + 8 * mt + g;  // in the tile
    double* dst = o_i + row * o_row;
#pragma unroll
    for (int p = 0; p < kNTilesO / 2; ++p) {
      // columns 16p + 4t + 2j + h: acc_o[mt][2p + h][j]
      const double x[4] = {acc_o[mt][2 * p][0] * inv_l, acc_o[mt][2 * p + 1][0] * inv_l,
                           acc_o[mt][2 * p][1] * inv_l, acc_o[mt][2 * p + 1][1] * inv_l};
      double lo[4], hi[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {  // every lane shuffles (rows past Lq included)
        lo[c] = __shfl_sync(0xffffffffu, x[c], src_lo);
        hi[c] = __shfl_sync(0xffffffffu, x[c], src_hi);
      }
      if (m0 + row >= Lq) continue;
      const double y[4] = {odd ? lo[2] : lo[0], odd ? lo[3] : lo[1], odd ? hi[2] : hi[0], odd ? hi[3] : hi[1]};
      const int col = 16 * p + 2 * t;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int c0 = col + 8 * half;
        if (vec) {
          if (c0 < Dv) fa::gstore(reinterpret_cast<Vec16<double>*>(dst + c0), Vec16<double>{{y[2 * half], y[2 * half + 1]}});
        } else {
          if (c0 < Dv) fa::gstore(dst + c0, y[2 * half]);
          if (c0 + 1 < Dv) fa::gstore(dst + c0 + 1, y[2 * half + 1]);
        }
      }
    }
    if (t == 0 && m0 + row < Lq) fa::gstore(lse_i + row, stat[mt].lse(l_total));
  }
}

}  // namespace flash
