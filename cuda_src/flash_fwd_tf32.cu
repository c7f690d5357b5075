// flash_fwd_tf32.cu — FlashAttention forward for float32 inputs on TF32 tensor cores (sm_80+),
// issue 12's precision="tf32" and precision="3xtf32".
//
// Same algorithm, work split and pipeline as the fp16/bf16 tensor-core forward (flash_fwd.cu,
// kStages = 1): one thread block per (query tile Q_i, batch entry), kNWarps warps each owning one
// 16-row slab of Q_i, S_ij, P_ij and O_i (a row's softmax statistics stay in one quad); V_j is
// fetched while S_ij = Q_i K_jᵀ runs, K_{j−1} while the softmax and O_i += P_ij V_j run; key tiles
// last first, only the tiles crossing the causal diagonal or the sequence end pay for the mask;
// online softmax in fp32 with exp2 and log2(e) folded into the scale; O_i divided by l_i once;
// fp32 out and fp32 LSE (natural log). Every product is mma.sync.m16n8k8 .tf32 (fp32 accumulate):
//
//   kPrec = 1 ("tf32"):   operands rounded to tf32 with cvt.rna (ties away), one mma per product;
//   kPrec = 3 ("3xtf32"): each operand x split into x_hi = cvt(x), x_lo = cvt(x − x_hi)
//                         (|x − x_hi − x_lo| <= 2^-22 |x|), the product taken as
//                         a_lo·b_hi + a_hi·b_lo + a_hi·b_hi (small terms first), fp32 accumulation:
//                         the dropped a_lo·b_lo is <= 2^-22 |a·b|, so accuracy is close to fp32.
//
// Operands are converted once where they are shared, never per mma:
//   K_j, V_j (B operands, read by every warp): after its cp.async lands, each thread converts the
//     chunks it copied itself (no extra barrier: its own copies are visible to it after the wait;
//     the barrier that publishes the tile to the other warps publishes the converted values) —
//     tf32 in place; 3xtf32 hi in place and lo into a second plane (sK_lo, sV_lo).
//   Q_i (A operand, one slab per warp): tf32 converted in place once in the prologue; 3xtf32 with
//     kQSplit split once there into hi (in place) and lo planes (a second ldmatrix per k8 step);
//     3xtf32 without it (where a Q lo plane costs the tile its second block per SM, e.g. d = 128)
//     kept raw and split in registers right after the ldmatrix: ~28 instructions per k8 step
//     (4 × cvt, sub, cvt), shared by the step's Bc/8 n8 tiles × 3 mma.
//   P_ij (A operand of P V, in registers): converted / split once per key tile.
//
// Fragments (docs/emulator.md, m16n8k8 tf32; g = lane / 4, t = lane % 4):
//   A 16×8 row:  a0 = A[g][t], a1 = A[g+8][t], a2 = A[g][t+4], a3 = A[g+8][t+4]
//   B 8×8 col:   b0 = B[t][g], b1 = B[t+4][g]
//   C 16×8:      c0, c1 = C[g][2t, 2t+1], c2, c3 = C[g+8][2t, 2t+1]
// ldmatrix (.b16) on fp32 data gives lane l word l%4 of row l/4 of each 8×4-float matrix, i.e.
// element (g, t): Q (A) and K (B stored n×k) come from ldmatrix.x4 with the fp16 kernel's row
// addresses (16 bytes = 4 floats per row chunk). P·V needs no lane exchange: the k index of the
// product is permuted — lane (g, t) holds P[·][2t] and P[·][2t+1] of an n8 tile of S, used as
// a0/a1 (mma k = t) and a2/a3 (mma k = t+4), so b0/b1 must be V rows 2t and 2t+1: two 32-bit
// shared loads per B fragment (V's row pitch dv + 4 floats ≡ 4 mod 16 words: the 32 lanes
// (2t·pitch + g) hit 32 distinct banks).
//
// Shapes: d, dv (head dims padded to multiples of 16, zero-filled past D, Dv) <= 256;
// Br = 16·kNWarps; Bc a multiple of 16. Wide tiles (d or dv > 128, kWide): O's accumulator alone is
// dv/2 registers per thread (128 at dv 256), so the host caps Bc (tf32 32, 3xtf32 16) and the
// per-tile conversion and element-wise copy loops stay rolled (unrolled, the compiler batched their
// loads and 3xtf32 spilled at d 256); d, dv <= 128 compile exactly as before. Row pitches d + 4 /
// dv + 4 floats: the 8 rows an ldmatrix phase reads start in 8 distinct 16-byte bank groups (d/4 + 1 odd). The FLASH_EXT_PARAMS tail is
// taken (the SIMT kernel's argument list, so the host lays out both alike); kExt (docs/extensions.md,
// the bits of flash_ext.cuh; 0 by default: the dense instantiations keep their names and code)
// turns its parts on, exactly as in flash_fwd.cu: the entry's lengths (seqlens), window, block mask,
// softcap and ALiBi live in the Mask; key tiles outside the window band, past the entry's keys or
// with an all-False block mask are never loaded (KeyTileWalk); dropout drops P in registers
// (dropout_mma, the same Philox counter per element as every kernel). The S accumulator here is
// the m16n8k16 kernels' C layout (acc_s[nt][i] = S[g + 8(i/2)][8nt + 2t + i%2]: m16n8k8 has the
// same C fragment), so their per-fragment code applies unchanged with one slab per warp. Softcap
// takes Mask::cap's precise tanh, as every kernel; flash_bwd_tf32.cu recomputes P with the same one.
#include "fa_port.cuh"
#include "flash_kernel_traits.cuh"
#include "flash_block_info.cuh"
#include "flash_mask.cuh"
#include "flash_softmax.cuh"
#include "flash_fwd_copy.cuh"
#include "flash_fwd_tiles.cuh"
#include "flash_ext.cuh"
#include "flash_tf32_split.cuh"  // tf32_operand, convert_chunk

namespace flash {

template <int kHeadDim_, int kHeadDimV_, int kBlockM_, int kBlockN_, int kNWarps_, int kPrec_, bool kQSplit_ = false,
          bool kOSmem_ = false>
struct FwdTf32Traits {
  static constexpr int kHeadDim = kHeadDim_, kHeadDimV = kHeadDimV_;
  static constexpr int kBlockM = kBlockM_, kBlockN = kBlockN_, kNWarps = kNWarps_, kPrec = kPrec_;
  static constexpr int kNThreads = kNWarps * kWarpSize;
  static constexpr int kPlanes = kPrec == 3 ? 2 : 1;   // K_j, V_j: hi (and lo) planes
  static constexpr bool kQSplit = kQSplit_;            // 3xtf32: Q_i split once into hi/lo planes
  static constexpr int kQPlanes = kQSplit ? 2 : 1;
  static constexpr int kPad = 4;                       // floats (16 bytes) per row
  static constexpr int kStrideQ = kHeadDim + kPad, kStrideK = kHeadDim + kPad, kStrideV = kHeadDimV + kPad;
  static constexpr int kQPlane = kBlockM * kStrideQ;   // floats between the hi and lo planes
  static constexpr int kKPlane = kBlockN * kStrideK;
  static constexpr int kVPlane = kBlockN * kStrideV;
  static constexpr int kSmemQOffset = 0;
  static constexpr int kSmemKOffset = Align16<kQPlanes * kQPlane * 4>::value;
  static constexpr int kSmemVOffset = kSmemKOffset + Align16<kPlanes * kKPlane * 4>::value;
  // kOSmem (3xtf32, dv > 128): O_i in shared memory after V_j, each lane's float4 of an n8 tile at
  // (warp · 16 · dv + dt · 128 + lane · 4) floats (only its lane touches it: no barrier).
  static constexpr bool kOSmem = kOSmem_;
  static constexpr int kSmemOOffset = kSmemVOffset + Align16<kPlanes * kVPlane * 4>::value;
  static constexpr int kSmemBytes = kSmemOOffset + (kOSmem ? kBlockM * kHeadDimV * 4 : 0);
  static constexpr int kNTilesS = kBlockN / 8;   // n8 tiles across Bc (= k8 steps of P V)
  static constexpr int kNTilesO = kHeadDimV / 8; // n8 tiles across dv
  static constexpr int kKStepsS = kHeadDim / 8;  // k8 steps of Q Kᵀ
  static constexpr bool kWide = kHeadDim > 128 || kHeadDimV > 128;  // conversion / copy loops rolled

  static_assert(kPrec == 1 || kPrec == 3, "kPrec: 1 (tf32) or 3 (3xtf32)");
  static_assert(!kQSplit || kPrec == 3, "kQSplit: 3xtf32 only (tf32 converts Q in place)");
  static_assert(!kOSmem || kPrec == 3, "kOSmem: 3xtf32 only (its per-tile sums at dv > 128)");
  static_assert(kBlockM == 16 * kNWarps, "one 16-row slab per warp");
  static_assert(kBlockN % 16 == 0, "Bc: whole n16 pairs (ldmatrix.x4 of K)");
  static_assert(kHeadDim % 16 == 0 && kHeadDimV % 16 == 0 && kHeadDim <= 256 && kHeadDimV <= 256,
                "d, dv: multiples of 16, at most 256");
  static_assert(kStrideV % 16 == 4 || kStrideV % 16 == 12, "V pitch: conflict-free 32-bit B loads");
};

// ---- operand conversion -------------------------------------------------------------------------

// One element (the element-wise copy path).
template <int kPrec>
__device__ __forceinline__ void convert_elem(float* x, int lo_plane) {
  uint32_t h, l = 0;
  tf32_operand<kPrec>(*x, h, l);
  *x = __uint_as_float(h);
  if constexpr (kPrec == 3) x[lo_plane] = __uint_as_float(l);
  else (void)lo_plane;
}

// Converts exactly what this thread copied with load_tile<float, kRows, kCols, kStride, kNThreads,
// Is_aligned> (16-byte chunks, or elements): after its cp.async wait (or the synchronous copy)
// those values are visible to it without a barrier. kRolled (d or dv > 128): the loop kept rolled,
// so the compiler does not batch the loads of several chunks while the 128-float O accumulator is
// live (the unrolled loop spilled 3xtf32 at d 256).
template <int kPrec, int kRows, int kCols, int kStride, int kNThreads, bool Is_aligned, bool kRolled = false>
__device__ __forceinline__ void convert_loaded(float* tile, int lo_plane, int tid) {
  constexpr int kChunksPerRow = kCols / 4;
  if constexpr (Is_aligned && kRolled) {
#pragma unroll 1
    for (int idx = tid; idx < kRows * kChunksPerRow; idx += kNThreads)
      convert_chunk<kPrec>(tile + (idx / kChunksPerRow) * kStride + (idx % kChunksPerRow) * 4, lo_plane);
  } else if constexpr (Is_aligned) {
    for (int idx = tid; idx < kRows * kChunksPerRow; idx += kNThreads)
      convert_chunk<kPrec>(tile + (idx / kChunksPerRow) * kStride + (idx % kChunksPerRow) * 4, lo_plane);
  } else if constexpr (kRolled) {
#pragma unroll 1
    for (int idx = tid; idx < kRows * kCols; idx += kNThreads)
      convert_elem<kPrec>(tile + (idx / kCols) * kStride + idx % kCols, lo_plane);
  } else {
    for (int idx = tid; idx < kRows * kCols; idx += kNThreads)
      convert_elem<kPrec>(tile + (idx / kCols) * kStride + idx % kCols, lo_plane);
  }
}

// load_tile's element-wise path (rows past rows_valid, columns past cols_valid zero-filled) with
// the loop kept rolled: the wide tiles' key loop (d or dv > 128), where the unrolled loop's batched
// global loads spilled 3xtf32 at dv 256 (24-56 bytes on sm_80).
template <int kRows, int kCols, int kStride, int kNThreads>
__device__ __forceinline__ void load_elems_rolled(float* smem, const float* gmem, long long row_stride,
                                                  int rows_valid, int cols_valid, int tid) {
#pragma unroll 1
  for (int idx = tid; idx < kRows * kCols; idx += kNThreads) {
    const int r = idx / kCols, c = idx % kCols;
    smem[r * kStride + c] = (r < rows_valid && c < cols_valid) ? fa::gload(gmem + r * row_stride + c) : 0.0f;
  }
}

// The same for a TileCopy (the aligned K_j / V_j copies of the key loop): its fixed column chunk
// of rows r0 + p·kRowsPerPass.
template <int kPrec, typename Copy, int kRows, int kStride, int kUnroll = Copy::kPasses>
__device__ __forceinline__ void convert_copied(const Copy& copy, float* tile, int lo_plane) {
  if (Copy::kChunksPerRow != Copy::kThreadsPerRow && !copy.active) return;
#pragma unroll (kUnroll)
  for (int p = 0; p < Copy::kPasses; ++p) {
    if (!Copy::kEvenPasses && copy.r0 + p * Copy::kRowsPerPass >= kRows) break;
    convert_chunk<kPrec>(tile + copy.smem_offset + p * Copy::kRowsPerPass * kStride, lo_plane);
  }
}

// D += A·B in precision kPrec (3xtf32: lo·hi + hi·lo + hi·hi, small terms first).
template <int kPrec>
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a_hi)[4], const uint32_t (&a_lo)[4],
                                         const uint32_t (&b_hi)[2], const uint32_t (&b_lo)[2]) {
  if constexpr (kPrec == 3) {
    const float c0[4] = {d[0], d[1], d[2], d[3]};
    fa::mma_m16n8k8_tf32(d, a_lo, b_hi, c0);
    const float c1[4] = {d[0], d[1], d[2], d[3]};
    fa::mma_m16n8k8_tf32(d, a_hi, b_lo, c1);
  } else {
    (void)a_lo; (void)b_lo;
  }
  const float c[4] = {d[0], d[1], d[2], d[3]};
  fa::mma_m16n8k8_tf32(d, a_hi, b_hi, c);
}

// ---- the kernel -----------------------------------------------------------------------------------
template <int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN, int kNWarps, int kPrec, bool Is_causal,
          bool Is_aligned, bool kQSplit = false, int kExt = 0, bool kOSmem = false>
__global__ void __launch_bounds__(kNWarps * 32, kMinBlocksPerSm)
flash_fwd_tf32_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                      float* __restrict__ o, float* __restrict__ lse,
                      int Lq, int Lk, int D, int Dv, int nb2,
                      long long q_b0, long long q_b1, long long q_b2, long long q_row,
                      long long k_b0, long long k_b1, long long k_b2, long long k_row,
                      long long v_b0, long long v_b1, long long v_b2, long long v_row,
                      long long o_b0, long long o_b1, long long o_b2, long long o_row,
                      long long lse_b0, long long lse_b1, long long lse_b2,
                      float scale_log2, FLASH_EXT_PARAMS(float)) {
  using Traits = FwdTf32Traits<kHeadDim, kHeadDimV, kBlockM, kBlockN, kNWarps, kPrec, kQSplit, kOSmem>;
  constexpr int kNThreads = Traits::kNThreads;
  constexpr int kNTilesS = Traits::kNTilesS;
  constexpr int kNTilesO = Traits::kNTilesO;
  constexpr int kQuad = 4;

  FA_DYNAMIC_SMEM(smem);
  float* sQ = reinterpret_cast<float*>(smem + Traits::kSmemQOffset);  // Q_i  hi [, lo] (3xtf32 unsplit: raw)
  float* sK = reinterpret_cast<float*>(smem + Traits::kSmemKOffset);  // K_j  hi [, lo]  Bc × d
  float* sV = reinterpret_cast<float*>(smem + Traits::kSmemVOffset);  // V_j  hi [, lo]  Bc × dv

  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32, lane = tid % 32;
  const int g = lane >> 2, t = lane & 3;
  const int warp_row0 = warp * 16;
  const int m0 = query_tile<Is_causal>(static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x)) * kBlockM;

  const BatchIndex bidx = BatchIndex::from_grid(nb2);
  const TensorStrides q_s{q_b0, q_b1, q_b2, q_row}, k_s{k_b0, k_b1, k_b2, k_row};
  const TensorStrides v_s{v_b0, v_b1, v_b2, v_row}, o_s{o_b0, o_b1, o_b2, o_row};
  const TensorStrides lse_s{lse_b0, lse_b1, lse_b2, 1};
  const float* q_i = q + bidx.offset(q_s) + m0 * q_row;
  const float* k_base = k + bidx.offset(k_s);
  const float* v_base = v + bidx.offset(v_s);
  float* o_i = o + bidx.offset(o_s) + m0 * o_row;
  float* lse_i = lse + bidx.offset(lse_s) + m0;
  // Extensions: the entry's lengths (seqlens; Lq stays the launch's for the stores: rows at or past
  // Lq_b write out 0, lse −inf), the per-entry state in the Mask (kExt = 0: Mask(Lq, Lk)).
  const ExtArgs<float> ext = FLASH_EXT_ARGS(float);
  Lk = ext.seqlen_k<kExt>(bidx, Lk);
  const int Lq_b = ext.seqlen_q<kExt>(bidx, Lq);

  const Mask<Is_causal, kExt> mask = make_mask<Is_causal, kExt>(Lq_b, Lk, ext, bidx);
  const int n_block_max = mask.n_block_max(m0, kBlockM, kBlockN);
  const int n_block_unmasked = unmasked_key_tiles<Is_causal>(mask, m0, kBlockN, n_block_max);
  // Extensions: the tiles to visit (from the window's first one; block-mask tiles all False
  // skipped) and which need the element mask; dropout's generator of the entry.
  constexpr bool kWindow = HasExt<kExt, kExtWindow>::value;
  const KeyTileWalk<Is_causal, kExt, float> walk{mask, m0, kBlockM, kBlockN, kWindow ? mask.n_block_min(m0, kBlockN) : 0};
  const DropoutRng rng = ext.dropout(bidx);

  // O_i: registers, or (kOSmem) this lane's float4 per n8 tile in shared memory, with the online softmax's
  // correction of rows g, g + 8 kept for gemm_pv, which rescales and adds in one pass.
  float acc_o[kNTilesO][4];  // (unused with kOSmem)
  float* const o_lane = reinterpret_cast<float*>(smem + Traits::kSmemOOffset) + warp * 16 * kHeadDimV + lane * 4;
  float corr_o[2] = {1.0f, 1.0f};
  OnlineSoftmaxRow<float> stat[2];  // rows g and g + 8 of the warp's slab
  if constexpr (kOSmem) {
#pragma unroll 1
    for (int dt = 0; dt < kNTilesO; ++dt) *reinterpret_cast<float4*>(o_lane + dt * 128) = float4{0.f, 0.f, 0.f, 0.f};
  } else {
#pragma unroll
    for (int dt = 0; dt < kNTilesO; ++dt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc_o[dt][i] = 0.0f;
  }
  stat[0].init();
  stat[1].init();

  // ldmatrix row addresses: Q (A, x4) rows l%16, k offset 4·(l/16); K (B, x4, an n16 pair) rows
  // 8·(l/16) + l%8, k offset 4·((l/8)%2). V (32-bit loads): rows 2t, 2t+1, column g of an n8 tile.
  const float* sQ_lane = sQ + (warp_row0 + lane % 16) * Traits::kStrideQ + (lane / 16) * 4;
  const int k_lane = ((lane / 16) * 8 + lane % 8) * Traits::kStrideK + ((lane / 8) % 2) * 4;
  const int v_lane = 2 * t * Traits::kStrideV + g;

  using CopyK = TileCopy<float, kBlockN, kHeadDim, Traits::kStrideK, kNThreads>;
  using CopyV = TileCopy<float, kBlockN, kHeadDimV, Traits::kStrideV, kNThreads>;
  const CopyK copy_k(k_row, D, tid);
  const CopyV copy_v(v_row, Dv, tid);
  // K_j / V_j → shared memory (full: every row exists), and after the wait the conversion of what
  // this thread copied.
  auto load_k = [&](bool full, int n0) {
    if constexpr (Is_aligned) copy_k.load(full, sK, k_base + n0 * k_row, rows_in_tile(n0, kBlockN, Lk));
    else if constexpr (Traits::kWide) load_elems_rolled<kBlockN, kHeadDim, Traits::kStrideK, kNThreads>(
        sK, k_base + n0 * k_row, k_row, rows_in_tile(n0, kBlockN, Lk), D, tid);
    else load_tile<float, kBlockN, kHeadDim, Traits::kStrideK, kNThreads, false>(
        sK, k_base + n0 * k_row, k_row, rows_in_tile(n0, kBlockN, Lk), D, tid);
  };
  auto load_v = [&](bool full, int n0) {
    if constexpr (Is_aligned) copy_v.load(full, sV, v_base + n0 * v_row, rows_in_tile(n0, kBlockN, Lk));
    else if constexpr (Traits::kWide) load_elems_rolled<kBlockN, kHeadDimV, Traits::kStrideV, kNThreads>(
        sV, v_base + n0 * v_row, v_row, rows_in_tile(n0, kBlockN, Lk), Dv, tid);
    else load_tile<float, kBlockN, kHeadDimV, Traits::kStrideV, kNThreads, false>(
        sV, v_base + n0 * v_row, v_row, rows_in_tile(n0, kBlockN, Lk), Dv, tid);
  };
  auto convert_k = [&]() {
    if constexpr (Is_aligned) convert_copied<kPrec, CopyK, kBlockN, Traits::kStrideK, Traits::kWide ? 1 : CopyK::kPasses>(copy_k, sK, Traits::kKPlane);
    else convert_loaded<kPrec, kBlockN, kHeadDim, Traits::kStrideK, kNThreads, false, Traits::kWide>(sK, Traits::kKPlane, tid);
  };
  auto convert_v = [&]() {
    if constexpr (Is_aligned) convert_copied<kPrec, CopyV, kBlockN, Traits::kStrideV, Traits::kWide ? 1 : CopyV::kPasses>(copy_v, sV, Traits::kVPlane);
    else convert_loaded<kPrec, kBlockN, kHeadDimV, Traits::kStrideV, kNThreads, false, Traits::kWide>(sV, Traits::kVPlane, tid);
  };

  using TileS = float[kNTilesS][4];
  // S_ij = Q_i K_jᵀ: per k8 step one A fragment of Q (3xtf32: split here), then the Bc/8 n8 tiles.
  // kOSmem with d > 128: partial sums of kSChunk k8 steps, each in a zeroed fragment added to S in fp32 (the
  // tensor cores truncate their sums: summed inside the mma over d = 256, S's error alone put O over the
  // float32 rule under the emulator's model of it).
  constexpr int kSChunk = kOSmem && kHeadDim > 128 ? 8 : Traits::kKStepsS;
  auto gemm_qk_steps = [&](TileS& acc_s, int ks0) {
#pragma unroll
    for (int ks = ks0; ks < ks0 + kSChunk && ks < Traits::kKStepsS; ++ks) {  // (the last chunk may be short)
      uint32_t a_hi[4], a_lo[4] = {};
      fa::ldmatrix<4, false>(a_hi, sQ_lane + ks * 8);
      if constexpr (kQSplit) {
        fa::ldmatrix<4, false>(a_lo, sQ_lane + Traits::kQPlane + ks * 8);
      } else if constexpr (kPrec == 3) {
#pragma unroll
        for (int i = 0; i < 4; ++i) tf32_operand<3>(__uint_as_float(a_hi[i]), a_hi[i], a_lo[i]);
      }
#pragma unroll
      for (int np = 0; np < kNTilesS / 2; ++np) {
        uint32_t b_hi[4], b_lo[4] = {};  // n8 tiles 2np (0, 1) and 2np + 1 (2, 3)
        const float* sK_k = sK + k_lane + np * 16 * Traits::kStrideK + ks * 8;
        fa::ldmatrix<4, false>(b_hi, sK_k);
        if constexpr (kPrec == 3) fa::ldmatrix<4, false>(b_lo, sK_k + Traits::kKPlane);
        const uint32_t bh0[2] = {b_hi[0], b_hi[1]}, bh1[2] = {b_hi[2], b_hi[3]};
        const uint32_t bl0[2] = {b_lo[0], b_lo[1]}, bl1[2] = {b_lo[2], b_lo[3]};
        mma_tf32<kPrec>(acc_s[2 * np], a_hi, a_lo, bh0, bl0);
        mma_tf32<kPrec>(acc_s[2 * np + 1], a_hi, a_lo, bh1, bl1);
      }
    }
  };
  auto gemm_qk = [&](TileS& acc_s) {
#pragma unroll
    for (int nt = 0; nt < kNTilesS; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc_s[nt][i] = 0.0f;
    if constexpr (kSChunk == Traits::kKStepsS) {
      gemm_qk_steps(acc_s, 0);
    } else {
#pragma unroll
      for (int kc = 0; kc < Traits::kKStepsS; kc += kSChunk) {
        TileS part;
#pragma unroll
        for (int nt = 0; nt < kNTilesS; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) part[nt][i] = 0.0f;
        gemm_qk_steps(part, kc);
#pragma unroll
        for (int nt = 0; nt < kNTilesS; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc_s[nt][i] += part[nt][i];
      }
    }
  };

  // Mask (tiles crossing the diagonal or the sequence end), online softmax of rows g, g + 8:
  // acc_s[nt][i] = S[g + 8·(i/2)][8·nt + 2t + i%2]; P_ij replaces S_ij (unnormalised).
  auto softmax_step = [&](bool tile_masked, TileS& acc_s, int n0) {
    if constexpr (Mask<Is_causal, kExt>::kScoreMod) {  // softcap / ALiBi: every score of every tile
#pragma unroll
      for (int nt = 0; nt < kNTilesS; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i)
          acc_s[nt][i] = mask.score(acc_s[nt][i], m0 + warp_row0 + g + 8 * (i / 2),
                                                   n0 + 8 * nt + 2 * t + (i % 2));
    }
    if (tile_masked) {
      if constexpr (Mask<Is_causal, kExt>::kBlockMask) {
        // Block mask: the slab's 16 rows × an n8 tile's 8 columns lie in one block: one lookup each.
        const int row0 = m0 + warp_row0;
#pragma unroll
        for (int nt = 0; nt < kNTilesS; ++nt) {
          const bool block = mask.block_visible(row0, n0 + 16 * (nt / 2));
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const bool ok = block && mask.is_visible_geometry(row0 + g + 8 * (i / 2), n0 + 8 * nt + 2 * t + (i % 2));
            acc_s[nt][i] = ok ? acc_s[nt][i] : -INFINITY;
          }
        }
      } else {
#pragma unroll
        for (int nt = 0; nt < kNTilesS; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i)
            acc_s[nt][i] = mask.apply(acc_s[nt][i], m0 + warp_row0 + g + 8 * (i / 2), n0 + 8 * nt + 2 * t + (i % 2));
      }
    }
    // O_i rescaled only when some row of the warp got a new max (flash_fwd.cu: factors of exactly 1 skipped);
    // with extensions always (3xtf32 with lengths, ALiBi, softcap, dropout spilled 8 bytes at d 128 with the test)
    float correction[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float tile_max = acc_s[0][2 * r];
#pragma unroll
      for (int nt = 0; nt < kNTilesS; ++nt) tile_max = fmaxf(tile_max, fmaxf(acc_s[nt][2 * r], acc_s[nt][2 * r + 1]));
      tile_max = group_allreduce_max<kQuad>(tile_max);
      correction[r] = stat[r].update_max(tile_max * scale_log2);
    }
    if constexpr (kOSmem) {
      corr_o[0] = correction[0], corr_o[1] = correction[1];  // applied by gemm_pv
    } else if (kExt != 0 || __any_sync(0xffffffffu, correction[0] != 1.0f || correction[1] != 1.0f)) {
#pragma unroll
      for (int dt = 0; dt < kNTilesO; ++dt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc_o[dt][i] *= correction[i / 2];
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_sub = stat[r].max_for_exp();
#pragma unroll
      for (int nt = 0; nt < kNTilesS; ++nt)
#pragma unroll
        for (int i = 2 * r; i < 2 * r + 2; ++i) {
          const float p = OnlineSoftmaxRow<float>::prob_unscaled(acc_s[nt][i], scale_log2, m_sub);
          stat[r].l += p;
          acc_s[nt][i] = p;
        }
    }
  };

  // O_i += P_ij V_j, k permuted within each k8 step: mma k = t ↔ key 2t, mma k = t + 4 ↔ key 2t + 1.
  auto gemm_pv = [&](const TileS& acc_s) {
    if constexpr (kPrec == 3 && (kHeadDimV <= 128 || kOSmem)) {
      // 3xtf32: the tile's A fragments first, then per n8 tile of O one zeroed fragment summed over the
      // tile's k8 steps inside the mma, added to O in fp32. The tensor cores do not round their sums to
      // nearest (truncation: Fasi et al. 2021, V100 to A100); summed inside the mma over every key, O was
      // up to 6x the float32 rule's bound at N 4096 on an H200 (docs/precision.md). Per key tile, the
      // truncation stays within the tile and the running sum is rounded to nearest (the emulator's model,
      // FLASHARRAY_EMULATOR_MMA_SUM=truncate, reproduces both). dv > 128: O in shared memory (kOSmem; in
      // registers the fragment spilled 44-140 bytes at 255 registers), rescaled and added per n8 tile
      // (a 128-bit load, 4 FMUL + 4 FADD, a 128-bit store); without kOSmem the old sum (tf32 only).
      uint32_t a_hi[kNTilesS][4], a_lo[kNTilesS][4];
#pragma unroll
      for (int ks = 0; ks < kNTilesS; ++ks) {
        const float p[4] = {acc_s[ks][0], acc_s[ks][2], acc_s[ks][1], acc_s[ks][3]};  // a0..a3
#pragma unroll
        for (int i = 0; i < 4; ++i) tf32_operand<kPrec>(p[i], a_hi[ks][i], a_lo[ks][i]);
      }
#pragma unroll
      for (int dt = 0; dt < kNTilesO; ++dt) {
        float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int ks = 0; ks < kNTilesS; ++ks) {
          const float* b = sV + v_lane + ks * 8 * Traits::kStrideV + dt * 8;
          const uint32_t b_hi[2] = {__float_as_uint(b[0]), __float_as_uint(b[Traits::kStrideV])};
          const uint32_t b_lo[2] = {__float_as_uint(b[Traits::kVPlane]),
                                    __float_as_uint(b[Traits::kVPlane + Traits::kStrideV])};
          mma_tf32<kPrec>(t, a_hi[ks], a_lo[ks], b_hi, b_lo);
        }
        if constexpr (kOSmem) {
          float4* p = reinterpret_cast<float4*>(o_lane + dt * 128);
          float4 o4 = *p;
          o4.x = o4.x * corr_o[0], o4.y = o4.y * corr_o[0], o4.z = o4.z * corr_o[1], o4.w = o4.w * corr_o[1];
          *p = float4{o4.x + t[0], o4.y + t[1], o4.z + t[2], o4.w + t[3]};
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i) acc_o[dt][i] += t[i];
        }
      }
      return;
    }
#pragma unroll
    for (int ks = 0; ks < kNTilesS; ++ks) {
      uint32_t a_hi[4], a_lo[4] = {};
      const float p[4] = {acc_s[ks][0], acc_s[ks][2], acc_s[ks][1], acc_s[ks][3]};  // a0..a3
#pragma unroll
      for (int i = 0; i < 4; ++i) tf32_operand<kPrec>(p[i], a_hi[i], a_lo[i]);
      const float* sV_k = sV + v_lane + ks * 8 * Traits::kStrideV;
#pragma unroll
      for (int dt = 0; dt < kNTilesO; ++dt) {
        const float* b = sV_k + dt * 8;
        const uint32_t b_hi[2] = {__float_as_uint(b[0]), __float_as_uint(b[Traits::kStrideV])};
        uint32_t b_lo[2] = {0u, 0u};
        if constexpr (kPrec == 3)
          b_lo[0] = __float_as_uint(b[Traits::kVPlane]), b_lo[1] = __float_as_uint(b[Traits::kVPlane + Traits::kStrideV]);
        mma_tf32<kPrec>(acc_o[dt], a_hi, a_lo, b_hi, b_lo);
      }
    }
  };

  // ---- prologue: Q_i (converted / split once, unless 3xtf32 splits it per k8 step) and the last key
  // tile in flight ------------------------------------------------------------------------------------
  // The first tile (below walk.lo when no key is visible: no loop).
  // Dense tiles up to d 128 (kVFirst): the first tile's V_j comes with K_j — only that tile can be partial, so the
  // loop's V_j copies are whole tiles (no row checks; flash_fwd.cu's single-buffered loop). With extensions or
  // the wide tiles that order spilled 16-48 bytes (window + block mask at d 128, d 64 / dv 256): V_j per tile.
  constexpr bool kVFirst = kExt == 0 && !Traits::kWide;
  int n_block = kExt == 0 ? n_block_max - 1 : walk.prev(n_block_max);
  const int n_first = n_block;
  if (n_block >= (kExt == 0 ? 0 : walk.lo)) {
    load_tile<float, kBlockM, kHeadDim, Traits::kStrideQ, kNThreads, Is_aligned>(
        sQ, q_i, q_row, rows_in_tile(m0, kBlockM, Lq_b), D, tid);
    fa::cp_async_commit();
    load_k(false, n_block * kBlockN);
    if constexpr (kVFirst) load_v(false, n_block * kBlockN);
    fa::cp_async_commit();
    if constexpr (kPrec == 1 || kQSplit) {
      fa::cp_async_wait<1>();  // Q_i (this thread's copies)
      convert_loaded<kPrec, kBlockM, kHeadDim, Traits::kStrideQ, kNThreads, Is_aligned, Traits::kWide>(sQ, Traits::kQPlane, tid);
    }
  }

  // ---- key loop, last tile first (the masked tiles first); two barriers per tile -------------------
  // The tile below: kExt = 0 n_block − 1; extensions the walk's next (below walk.lo when none is
  // left), found where K of that tile is prefetched. The body is written in the loop, not in a
  // per-tile lambda: so the dense instantiations keep the SASS they had before the extensions (the
  // lambda changed 8 of them: NVVM formed n_block > 0 differently after inlining).
  int next = 0;  // extensions only
  for (; n_block >= (kExt == 0 ? 0 : walk.lo); n_block = kExt == 0 ? n_block - 1 : next) {
    const int n0 = n_block * kBlockN;
    const bool masked = kExt == 0 ? n_block >= n_block_unmasked : walk.masked(n_block);
    fa::cp_async_wait<0>();
    convert_k();
    // Barrier: K_j (and Q_i) copied and converted by every thread; every warp has finished reading
    // V_{j+1}, so sV may be overwritten.
    __syncthreads();
    if constexpr (kVFirst) {
      if (n_block != n_first) load_v(true, n0);  // a whole tile (the first one's came with K_j)
    } else {
      (void)n_first;
      load_v(!masked, n0);
    }
    fa::cp_async_commit();

    TileS acc_s;
    gemm_qk(acc_s);

    fa::cp_async_wait<0>();
    convert_v();
    // Barrier: V_j copied and converted by every thread; every warp has finished reading K_j.
    __syncthreads();
    if constexpr (kExt == 0) {
      if (n_block > 0) load_k(true, n0 - kBlockN);
    } else {
      next = walk.prev(n_block);
      if (next >= walk.lo) load_k(true, next * kBlockN);
    }
    fa::cp_async_commit();

    softmax_step(masked, acc_s, n0);
    if constexpr (HasExt<kExt, kExtDropout>::value)  // P is dropped after l_i has summed it
      dropout_mma<1, kNTilesS>(*reinterpret_cast<float(*)[1][kNTilesS][4]>(&acc_s), rng, m0 + warp_row0, n0, lane);
    gemm_pv(acc_s);
  }

  // ---- epilogue: O_i / l_i once, fp32 straight from the fragments; LSE by the quad's lane 0 ---------
  const bool pairs = (o_row % 2 == 0) && (reinterpret_cast<unsigned long long>(o_i) % 8 == 0) && Dv % 2 == 0;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l_total = group_allreduce_sum<kQuad>(stat[r].l);
    const int row = warp_row0 + g + 8 * r;  // in the tile
    // Extensions: rows at or past the entry's Lq_b are out 0, lse −inf; dropout scales O_i.
    const bool live = kExt == 0 || m0 + row < Lq_b;
    const float inv_l = ext_inv_sum<kExt>(stat[r], l_total, live, ext);
    if (m0 + row >= Lq) continue;
    float* dst = o_i + row * o_row;
#pragma unroll
    for (int dt = 0; dt < kNTilesO; ++dt) {
      const int col = 8 * dt + 2 * t;
      float o0, o1;
      if constexpr (kOSmem) {
        const float2 o2 = *reinterpret_cast<const float2*>(o_lane + dt * 128 + 2 * r);
        o0 = o2.x, o1 = o2.y;
      } else {
        o0 = acc_o[dt][2 * r], o1 = acc_o[dt][2 * r + 1];
      }
      const float lo = o0 * inv_l, hi = o1 * inv_l;
      if (pairs) {
        if (col < Dv) fa::gstore(reinterpret_cast<float2*>(dst + col), float2{lo, hi});
      } else {
        if (col < Dv) fa::gstore(dst + col, lo);
        if (col + 1 < Dv) fa::gstore(dst + col + 1, hi);
      }
    }
    if (t == 0) fa::gstore(lse_i + row, live ? stat[r].lse(l_total) : -INFINITY);
  }
}

}  // namespace flash
