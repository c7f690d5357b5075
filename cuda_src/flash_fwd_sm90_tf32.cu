// flash_fwd_sm90_tf32.cu — FlashAttention forward for float32 inputs on Hopper warpgroup MMA (wgmma.m64nNk8
// .tf32, sm_90a): issue 12's precision="tf32" and "3xtf32" (docs/precision.md, "The wgmma forward").
//
// The algorithm, products and sums of the mma.sync TF32 forward (flash_fwd_tf32.cu), on the wgmma instruction:
//   kPrec = 1 ("tf32"):   operands cvt.rna'd to tf32, one wgmma per product;
//   kPrec = 3 ("3xtf32"): x = hi + lo (hi = cvt.rna(x), lo = cvt.rna(x − hi)), a_lo·b_hi + a_hi·b_lo + a_hi·b_hi
//                         with every k8 step's small products first (gemm_s_tf32), and P V_j of each key tile
//                         summed in a zeroed accumulator added to O in fp32 (O = O · correction + P V_j: the tensor
//                         cores truncate their sums, docs/precision.md, "Default").
// One thread block per (query tile Q_i of Br = 128 rows, batch entry): two warpgroups, warpgroup w owning rows
// [64w, 64w + 64) of Q_i (one wgmma m64 row block; a row's softmax statistics stay in one quad); tf32 at d 64 two
// blocks per SM (kMinBlocks). Per key tile j:
//   S_ij = Q_i K_jᵀ   d/8 k8 steps × (1 or 3) wgmma.m64n{Bc}k8: 3xtf32's Q hi A fragments held in registers for
//                     the whole key loop (.rs), its Q lo (and tf32's Q) read from Q's plane (.ss); K_j's planes
//                     K-major in 128B-swizzled shared memory;
//   online softmax on the accumulator fragments (flash_fwd_sm90_softmax.cuh, as the 16-bit wgmma forward);
//   O_i += P_ij V_j   Bc/8 k8 steps × (1 or 3) wgmma.m64n{dv}k8 .rs: P's A fragments from the S accumulator,
//                     V_j transposed (tf32 wgmma reads K-major operands only) into Vtᵀ planes; 3xtf32 at d 128
//                     in two column blocks of N = 64 (kPvN), each summed and added to O apart (registers).
// 3xtf32 at d 128 runs Bc = 32 (the host's rule): its planes fit 227 KB only with Q's raw / hi plane over the two
// stages (kQOverStages), read once into the fragments before the first key tile is copied there.
// The tf32 A fragment (a0 = A[g][t], a1 = A[g+8][t], a2 = A[g][t+4], a3 = A[g+8][t+4]) is not the accumulator's
// column pair (2t, 2t+1): P V's k index is permuted instead of exchanging lanes — a0/a1 take P's column 2t, a2/a3
// column 2t+1 of the n8 tile, so the Vt planes hold key 8kk + 2p at position 8kk + p and key 8kk + 2p + 1 at
// 8kk + 4 + p (flash_fwd_tf32.cu does the same with its B fragments).
//
// Shared memory (byte offsets; 1024-byte aligned pieces, the dynamic base rounded up to 1024 on the GPU):
//   stage s = 0, 1 at s · 2·Bc·d·4: K_j raw → its hi plane in place, then V_j raw. cp.async into the stage of the
//       next tile while this one is computed. K in the 128B-swizzled K-major layout (flash_sm90_common.cuh: row r
//       of a 32-float panel at 128·r, 16-byte chunk c at c ^ (r mod 8)); V raw row-major (dv floats per row).
//   K_j lo plane (3xtf32) and the Vt planes (dv rows × Bc keys, 128B-swizzled K-major, permuted keys).
//   Q_i: raw → hi in place, and its lo plane (3xtf32), 128B-swizzled K-major (Br rows per panel); with
//       kQOverStages the raw / hi plane at offset 0 (over the stages), the lo plane alone at kQOffset.
// Per key tile: wait for the copies, barrier (every thread's copies visible, every warpgroup done with tile j+1's
// planes), prefetch tile j−1, convert K_j (each thread the chunks it copied: hi in place, lo) and transpose V_j
// into the Vt planes (transpose_v), fence.proxy.async, barrier, the wgmmas.
//
// Dense calls only (the host's rule: cuda_forward_tf32.wgmma_tile): 16-byte aligned rows, padded head dims up to
// 128 computed at d = dv = 64 or 128 with the tiles zero-filled past D, Dv; no extensions. Arguments:
// flash_fwd_tf32_kernel's, so the host lays out both alike.
#include "fa_port.cuh"
#include "flash_kernel_traits.cuh"
#include "flash_block_info.cuh"
#include "flash_mask.cuh"
#include "flash_softmax.cuh"
#include "flash_fwd_tiles.cuh"
#include "flash_fwd_copy.cuh"           // TileCopy
#include "flash_ext.cuh"
#include "flash_tf32_split.cuh"         // tf32_operand, convert_chunk
#include "flash_fwd_sm90_softmax.cuh"   // Sm90KeyTiles, softmax_tile_sm90, finish_rows_sm90
#include "flash_sm90_common.cuh"        // sw128_offset, load_sw128, sw128_desc

namespace flash {

template <int kHeadDim_, int kBlockN_, int kPrec_>
struct Sm90Tf32FwdTraits {
  static constexpr int kHeadDim = kHeadDim_, kHeadDimV = kHeadDim_, kBlockN = kBlockN_, kPrec = kPrec_;
  static constexpr int kBlockM = 128, kNThreads = 256, kNWarps = 8;
  static constexpr int kPlanes = kPrec == 3 ? 2 : 1;
  // Blocks per SM the launch bounds ask for: two where two blocks' shared memory fits an SM (tf32 at d 64: 2 x
  // 114 KB of 228): 128 registers, and each block's conversion and softmax run beside the other's wgmmas.
  static constexpr int kMinBlocks = kPrec == 1 && kHeadDim == 64 ? 2 : 1;
  // Q_i's (hi) A fragments in registers for the key loop (.rs) in 3xtf32 (its Q lo read through a descriptor,
  // .ss); tf32 reads Q through descriptors (at d 128 its fragments would be 64 registers, at d 64 the two-block
  // kernel's 128 spilled 36-40 bytes with them).
  static constexpr bool kQRegs = kPrec == 3;
  static constexpr int kTileBytes = kBlockN * kHeadDim * 4;      // one plane of K_j, V_j or Vt_j
  static constexpr int kStageBytes = 2 * kTileBytes;             // K_j raw / hi, V_j raw
  static constexpr int kVRawOffset = kTileBytes;                 // within a stage
  static constexpr int kKLoOffset = 2 * kStageBytes;
  static constexpr int kVtOffset = kKLoOffset + (kPrec == 3 ? kTileBytes : 0);
  static constexpr int kQOffset = kVtOffset + kPlanes * kTileBytes;
  static constexpr int kQPlaneBytes = kBlockM * kHeadDim * 4;   // Q_i raw → hi in place, then its lo plane
  // Q_i's raw / hi plane over the two stages (3xtf32 at d 128): read once into the hi fragments (kQRegs) before
  // the first key tile is copied; only Q's lo plane keeps its own room.
  static constexpr bool kQOverStages = kQRegs && kQPlaneBytes <= 2 * kStageBytes && kHeadDim == 128;
  static constexpr int kQHiOffset = kQOverStages ? 0 : kQOffset;
  static constexpr int kQLoOffset = kQOverStages ? kQOffset : kQOffset + kQPlaneBytes;
  static constexpr int kAtomBytes = 1024;
  // + the alignment slack of the GPU's dynamic shared memory base (cuda_forward_tf32.wgmma_smem_bytes).
  static constexpr int kSmemBytes = kQOffset + (kPlanes - (kQOverStages ? 1 : 0)) * kQPlaneBytes + kAtomBytes;
  static constexpr int kKSteps = kHeadDim / 8;   // k8 steps of S = Q Kᵀ
  static constexpr int kPvSteps = kBlockN / 8;   // k8 steps of P V
  static constexpr int kPvN = kPrec == 3 && kHeadDimV == 128 ? 64 : kHeadDimV;  // 3xtf32's P V_j column block
  static constexpr int kVPasses = (kHeadDimV / 32) * (kBlockN / 4) / kNWarps;  // transpose_v's passes

  static_assert(kPrec == 1 || kPrec == 3, "kPrec: 1 (tf32) or 3 (3xtf32)");
  static_assert(kHeadDim == 64 || kHeadDim == 128, "d = dv: the N of the O wgmma, 64 or 128");
  static_assert(kBlockN == 32 || kBlockN == 64 || kBlockN == 128, "Bc: the N of the S wgmma, 32, 64 or 128");
  static_assert((kHeadDimV / 32) * (kBlockN / 4) % kNWarps == 0, "whole V passes");
  static_assert(kSmemBytes <= 227 * 1024, "one block's shared memory");
};

// V_j raw is Bc × dv floats row-major (TileCopy, stride dv). After the barrier that follows the copies' wait (so
// every thread's copies are visible), the Vt planes' 16-byte chunks are built from it: chunk (n, kk, h) holds the
// keys at positions 8kk + 4h .. + 3, i.e. keys 8kk + h + 2j (j = 0..3), of dv column n — four 32-bit loads down
// the column, one 16-byte store per plane. Warp w's pass p takes (kk, h) = u div (dv/32) and columns 32 (u mod dv/32)
// + lane for u = w + 8p: the loads read 128 contiguous bytes of a row, the stores 32 rows at one chunk (8 rows
// per phase at 8 distinct swizzled chunks): no bank conflicts either way.
template <class Tr>
__device__ __forceinline__ void transpose_v(unsigned char* sVt, const float* sV, int warp, int lane) {
  constexpr int kColGroups = Tr::kHeadDimV / 32;
#pragma unroll
  for (int p = 0; p < Tr::kVPasses; ++p) {
    const int u = warp + Tr::kNWarps * p;
    const int n = 32 * (u % kColGroups) + lane, kh = u / kColGroups;  // kh = 2kk + h
    const float* col = sV + ((kh >> 1) * 8 + (kh & 1)) * Tr::kHeadDimV + n;
    Vec16<float> hi, lo;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t h, l = 0;
      tf32_operand<Tr::kPrec>(col[2 * j * Tr::kHeadDimV], h, l);
      hi.v[j] = __uint_as_float(h);
      lo.v[j] = __uint_as_float(l);
    }
    unsigned char* at = sVt + sw128_offset<Tr::kHeadDimV>(n, kh);
    *reinterpret_cast<Vec16<float>*>(at) = hi;
    if constexpr (Tr::kPrec == 3) *reinterpret_cast<Vec16<float>*>(at + Tr::kTileBytes) = lo;
  }
}

// The chunks this thread copied with load_sw128<float, kRows, kCols, ...> (aligned): hi in place, lo at
// lo_bytes past each chunk (3xtf32).
template <int kPrec, int kRows, int kCols, int kNThreads>
__device__ __forceinline__ void convert_sw128(unsigned char* s_tile, int lo_bytes, int tid) {
  constexpr int kChunksPerRow = kCols / 4;
  constexpr int kRowsPerPass = kNThreads / kChunksPerRow;
  const int chunk = tid % kChunksPerRow, r0 = tid / kChunksPerRow;
#pragma unroll
  for (int p = 0; p < kRows / kRowsPerPass; ++p)
    convert_chunk<kPrec>(reinterpret_cast<float*>(s_tile + sw128_offset<kRows>(r0 + p * kRowsPerPass, chunk)),
                         lo_bytes / 4);
}

// Q_i's (hi) A fragments of the warp's 16 rows (row0 = its first row in the tile) for every k8 step, from the
// converted 128B-swizzled hi plane.
template <class Tr>
__device__ __forceinline__ void load_q_frags(uint32_t (&q_hi)[Tr::kKSteps][4], const unsigned char* sQ, int row0,
                                             int g, int t) {
#pragma unroll
  for (int ks = 0; ks < Tr::kKSteps; ++ks)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = row0 + g + 8 * (i & 1), c = 8 * ks + t + 4 * (i >> 1);
      q_hi[ks][i] = *reinterpret_cast<const uint32_t*>(sQ + sw128_offset<Tr::kBlockM>(r, c >> 2) + (c & 3) * 4);
    }
}

// The descriptor of k8 step ks of a 128B-swizzled K-major operand of kRows rows per panel: its step-0 descriptor
// plus k8_step<kRows>(ks), the start address (bits 0-13, 16-byte units) of panel ks / 4 (kRows·128 bytes apart),
// byte 32 (ks mod 4): one descriptor per operand, the steps' immediate increments. (A 64-bit add of a constant:
// ptxas folds it into the uniform registers better than fa::wgmma_desc_advance's 32-bit add here, which costs a
// UMOV per HGMMA to re-pair the words: 844 → 906 loop instructions at 3xtf32 d 128.)
template <int kRows>
__device__ __forceinline__ constexpr uint64_t k8_step(int ks) {
  return static_cast<uint64_t>(((ks / 4) * kRows * 128 + (ks % 4) * 32) >> 4);
}

// S = Q_w K_jᵀ for the warpgroup's 64 rows in precision kPrec, one committed batch, waited for. q_hi: Q's (hi)
// fragments (Tr::kQRegs), sQ_w / sQlo_w: its hi and lo planes at the warpgroup's rows; sK: K_j's hi plane,
// its lo at k_lo_bytes. 3xtf32: every step's Q_lo·K_hi (.ss) and Q_hi·K_lo (.rs) first, then the Q_hi·K_hi: the
// tensor cores truncate each partial sum, and the small terms summed first are truncated while the sum is small.
template <class Tr>
__device__ __forceinline__ void gemm_s_tf32(float (&acc)[Tr::kBlockN / 2], const uint32_t (&q_hi)[Tr::kKSteps][4],
                                            const unsigned char* sQ_w, const unsigned char* sQlo_w,
                                            const unsigned char* sK, int k_lo_bytes) {
  constexpr int kN = Tr::kBlockN, kM = Tr::kBlockM;
  const uint64_t k_hi = sw128_desc(sK, 16);
  fa::wgmma_fence_operand(acc);
  fa::wgmma_fence();
  if constexpr (Tr::kPrec == 3) {
    const uint64_t q_lo = sw128_desc(sQlo_w, 16), k_lo = sw128_desc(sK + k_lo_bytes, 16);
#pragma unroll
    for (int ks = 0; ks < Tr::kKSteps; ++ks) {
      fa::wgmma_m64nNk8_f32_tf32_ss<kN>(acc, q_lo + k8_step<kM>(ks), k_hi + k8_step<kN>(ks), ks > 0 ? 1 : 0);
      fa::wgmma_m64nNk8_f32_tf32_rs<kN>(acc, q_hi[ks], k_lo + k8_step<kN>(ks), 1);
    }
  }
  const uint64_t q_d = sw128_desc(sQ_w, 16);
#pragma unroll
  for (int ks = 0; ks < Tr::kKSteps; ++ks) {
    const int scale = Tr::kPrec == 3 || ks > 0 ? 1 : 0;
    if constexpr (Tr::kQRegs) fa::wgmma_m64nNk8_f32_tf32_rs<kN>(acc, q_hi[ks], k_hi + k8_step<kN>(ks), scale);
    else fa::wgmma_m64nNk8_f32_tf32_ss<kN>(acc, q_d + k8_step<kM>(ks), k_hi + k8_step<kN>(ks), scale);
  }
  (void)k_lo_bytes; (void)q_d; (void)sQlo_w;
  fa::wgmma_commit_group();
  fa::wgmma_wait_group<0>();
  fa::wgmma_fence_operand(acc);
}

// acc (+)= A·Bᵀ over k8 steps in precision kPrec (3xtf32: every step's A_lo·B_hi and A_hi·B_lo, then the
// A_hi·B_hi, as gemm_s_tf32), one committed batch, waited for: A the register fragments (hi, lo) of each step, B's
// planes at b_hi (lo at b_lo_bytes past it; 128B-swizzled K-major, kN rows from b_hi of kPanelRows per 32-float
// panel). zero: scale_d 0 on the first wgmma (acc starts at 0). P V.
template <int kPrec, int kN, int kSteps, int kPanelRows = kN>
__device__ __forceinline__ void gemm_rs_tf32(float (&acc)[kN / 2], const uint32_t (&a_hi)[kSteps][4],
                                             const uint32_t (&a_lo)[kSteps][4], const unsigned char* b_hi,
                                             int b_lo_bytes, bool zero) {
  const uint64_t bh = sw128_desc(b_hi, 16);
  fa::wgmma_fence_operand(acc);
  fa::wgmma_fence();
  if constexpr (kPrec == 3) {
    const uint64_t bl = sw128_desc(b_hi + b_lo_bytes, 16);
#pragma unroll
    for (int ks = 0; ks < kSteps; ++ks) {
      fa::wgmma_m64nNk8_f32_tf32_rs<kN>(acc, a_lo[ks], bh + k8_step<kPanelRows>(ks), zero && ks == 0 ? 0 : 1);
      fa::wgmma_m64nNk8_f32_tf32_rs<kN>(acc, a_hi[ks], bl + k8_step<kPanelRows>(ks), 1);
    }
  } else {
    (void)a_lo; (void)b_lo_bytes;
  }
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks)
    fa::wgmma_m64nNk8_f32_tf32_rs<kN>(acc, a_hi[ks], bh + k8_step<kPanelRows>(ks),
                                      kPrec == 3 || !zero || ks > 0 ? 1 : 0);
  fa::wgmma_commit_group();
  fa::wgmma_wait_group<0>();
  fa::wgmma_fence_operand(acc);
}

// P_ij (in acc_s) as the A fragments of P V: k8 step kk takes n8 tile kk, a0/a1 its column 2t (rows g, g + 8),
// a2/a3 column 2t + 1 (the Vt planes' key order). tf32_operand_finite: cvt.rna's bits for P's finite values.
template <int kPrec, int kBlockN>
__device__ __forceinline__ void p_frags(uint32_t (&p_hi)[kBlockN / 8][4], uint32_t (&p_lo)[kBlockN / 8][4],
                                        const float (&acc_s)[kBlockN / 2]) {
#pragma unroll
  for (int kk = 0; kk < kBlockN / 8; ++kk)
#pragma unroll
    for (int i = 0; i < 4; ++i)
      tf32_operand_finite<kPrec>(acc_s[4 * kk + 2 * (i & 1) + (i >> 1)], p_hi[kk][i], p_lo[kk][i]);
}

template <int kHeadDim, int kBlockN, int kPrec, bool Is_causal>
__global__ void __launch_bounds__(256, (Sm90Tf32FwdTraits<kHeadDim, kBlockN, kPrec>::kMinBlocks))
flash_fwd_sm90_tf32_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                           float* __restrict__ o, float* __restrict__ lse,
                           int Lq, int Lk, int D, int Dv, int nb2,
                           long long q_b0, long long q_b1, long long q_b2, long long q_row,
                           long long k_b0, long long k_b1, long long k_b2, long long k_row,
                           long long v_b0, long long v_b1, long long v_b2, long long v_row,
                           long long o_b0, long long o_b1, long long o_b2, long long o_row,
                           long long lse_b0, long long lse_b1, long long lse_b2,
                           float scale_log2, FLASH_EXT_PARAMS(float)) {
  using Tr = Sm90Tf32FwdTraits<kHeadDim, kBlockN, kPrec>;
  constexpr int kBlockM = Tr::kBlockM, kHeadDimV = Tr::kHeadDimV;
  FA_DYNAMIC_SMEM(smem_raw);
  // Swizzled tiles start on the pattern's repeat in the shared window (flash_fwd_sm90.cu's rounding).
  const int misalign = static_cast<int>(fa::wgmma_desc(smem_raw, 0, 0, fa::kWgmmaSwizzleNone) & 0x3f) * 16;
  unsigned char* smem = smem_raw + (Tr::kAtomBytes - misalign) % Tr::kAtomBytes;
  unsigned char* sKlo = smem + Tr::kKLoOffset;
  unsigned char* sVt = smem + Tr::kVtOffset;

  const int tid = static_cast<int>(threadIdx.x);
  // the warpgroup index from lane 0 (CUTLASS's canonical_warp_group_idx): ptxas then keeps the descriptors of Q's
  // planes in uniform registers
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0), warp = tid / 32, lane = tid % 32;
  const int warp_row = wg * 64 + (warp % 4) * 16;   // first of the warp's 16 rows in Q_i
  const int g = lane >> 2, t = lane & 3;
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
  const ExtArgs<float> ext = FLASH_EXT_ARGS(float);  // dense: unused
  (void)ext;

  const Mask<Is_causal, 0> mask = make_mask<Is_causal, 0>(Lq, Lk, ext, bidx);
  const int n_block_max = mask.n_block_max(m0, kBlockM, kBlockN);
  const int n_block_unmasked = unmasked_key_tiles<Is_causal>(mask, m0, kBlockN, n_block_max);
  const Sm90KeyTiles<Is_causal, 0> tiles{mask, m0, kBlockM, kBlockN, n_block_max, n_block_unmasked};

  float acc_o[kHeadDimV / 2];   // O_i, unnormalised
  OnlineSoftmaxRow<float> stat[2];
#pragma unroll
  for (int i = 0; i < kHeadDimV / 2; ++i) acc_o[i] = 0.0f;
  stat[0].init();
  stat[1].init();

  const TileCopy<float, kBlockN, kHeadDimV, kHeadDimV, 256> copy_v(v_row, Dv, tid);
  auto load_kv = [&](bool full, int stage, int n_block) {
    const int n0 = n_block * kBlockN;
    const int rows = rows_in_tile(n0, kBlockN, Lk);
    unsigned char* s = smem + stage * Tr::kStageBytes;
    load_sw128<float, kBlockN, kHeadDim, 256, true>(s, k_base + n0 * k_row, k_row, rows, D, full, tid);
    copy_v.load(full, reinterpret_cast<float*>(s + Tr::kVRawOffset), v_base + n0 * v_row, rows);
  };

  // Prologue: Q_i and the first key tile; Q converted (hi in place, lo plane) by the threads that copied it, then
  // (kQRegs) Q's hi fragments into registers for the whole loop. Q's hi plane over the stages (kQOverStages):
  // the first key tile is copied after every warp has read its fragments.
  unsigned char* sQ = smem + Tr::kQHiOffset;
  unsigned char* sQlo = smem + Tr::kQLoOffset;
  uint32_t q_hi[Tr::kKSteps][4];
  int n_block = tiles.first();
  if (n_block >= tiles.lo()) {
    load_sw128<float, kBlockM, kHeadDim, 256, true>(sQ, q_i, q_row, rows_in_tile(m0, kBlockM, Lq), D, false, tid);
    if constexpr (!Tr::kQOverStages) load_kv(false, 0, n_block);
    fa::cp_async_commit();
    fa::cp_async_wait<0>();
    convert_sw128<kPrec, kBlockM, kHeadDim, 256>(sQ, static_cast<int>(sQlo - sQ), tid);
    __syncthreads();
    if constexpr (Tr::kQRegs) load_q_frags<Tr>(q_hi, sQ, warp_row, g, t);
    if constexpr (Tr::kQOverStages) {
      __syncthreads();  // every warp's fragments read: stage 0 may be overwritten
      load_kv(false, 0, n_block);
      fa::cp_async_commit();
    }
  }
  int stage = 0;
  for (; n_block >= tiles.lo(); n_block = tiles.prev(n_block)) {
    fa::cp_async_wait<0>();
    // Every warpgroup is done with tile j+1's planes (its wgmmas were waited for): they and the other stage may
    // be rewritten.
    __syncthreads();
    const int next = tiles.prev(n_block);
    if (next >= tiles.lo()) load_kv(true, stage ^ 1, next);  // below the top tile every tile is full
    fa::cp_async_commit();
    unsigned char* sK = smem + stage * Tr::kStageBytes;
    convert_sw128<kPrec, kBlockN, kHeadDim, 256>(sK, static_cast<int>(sKlo - sK), tid);
    transpose_v<Tr>(sVt, reinterpret_cast<const float*>(sK + Tr::kVRawOffset), warp, lane);
    fa::fence_proxy_async();  // the planes (and, the first time, Q's) generic-proxy stores → the wgmmas' reads
    __syncthreads();

    float acc_s[kBlockN / 2];
    gemm_s_tf32<Tr>(acc_s, q_hi, sQ + wg * 64 * 128, sQlo + wg * 64 * 128, sK, static_cast<int>(sKlo - sK));
    const int row0 = m0 + warp_row + g, n0 = n_block * kBlockN;
    uint32_t p_hi[Tr::kPvSteps][4], p_lo[Tr::kPvSteps][4];
    if constexpr (kPrec == 3) {
      float correction[2];
      softmax_tile_sm90<Is_causal, kBlockN, kHeadDimV, true>(acc_s, acc_o, stat, correction, mask,
                                                             tiles.masked(n_block), row0, n0, t, scale_log2);
      p_frags<kPrec, kBlockN>(p_hi, p_lo, acc_s);
      // P V_j alone (zeroed by the first wgmma), then added to O in fp32; in column blocks of kPvN (d 128: two
      // of 64, each its own batch: a 64-register P V_j spilled next to Q's fragments)
      constexpr int kPvN = Tr::kPvN;
#pragma unroll
      for (int h = 0; h < kHeadDimV / kPvN; ++h) {
        float acc_pv[kPvN / 2];
        gemm_rs_tf32<kPrec, kPvN, Tr::kPvSteps, kHeadDimV>(acc_pv, p_hi, p_lo, sVt + h * kPvN * 128, Tr::kTileBytes,
                                                          true);
#pragma unroll
        for (int i = 0; i < kPvN / 2; ++i)
          acc_o[h * kPvN / 2 + i] = fmaf(acc_o[h * kPvN / 2 + i], correction[(i % 4) >> 1], acc_pv[i]);
      }
    } else {
      softmax_sm90<Is_causal, kBlockN, kHeadDimV>(acc_s, acc_o, stat, mask, tiles.masked(n_block), row0, n0, t,
                                                  scale_log2);
      p_frags<kPrec, kBlockN>(p_hi, p_lo, acc_s);
      gemm_rs_tf32<kPrec, kHeadDimV, Tr::kPvSteps>(acc_o, p_hi, p_lo, sVt, 0, false);
    }
    stage ^= 1;
  }

  // Epilogue: O / l and the LSE straight from the accumulator fragments (rows g, g + 8 of the warp; columns
  // 8j + 2t, + 1: one 8-byte store per pair where rows and out are 8-byte aligned — a warp's store then fills
  // its 32-byte sectors), rows at or past Lq and columns at or past Dv not written.
  float inv_l[2], lse_r[2];
  finish_rows_sm90(inv_l, lse_r, stat);
  const bool pairs = Dv % 2 == 0 && o_row % 2 == 0 && reinterpret_cast<unsigned long long>(o) % 8 == 0;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = warp_row + g + 8 * r;
    if (m0 + row >= Lq) continue;
    if (t == 0) fa::gstore(lse_i + row, lse_r[r]);
    float* o_row_r = o_i + row * o_row;
#pragma unroll
    for (int j = 0; j < kHeadDimV / 8; ++j) {
      const int col = 8 * j + 2 * t;
      const float x0 = acc_o[4 * j + 2 * r] * inv_l[r], x1 = acc_o[4 * j + 2 * r + 1] * inv_l[r];
      if (pairs && col < Dv) {
        fa::gstore(reinterpret_cast<float2*>(o_row_r + col), float2{x0, x1});
      } else if (!pairs) {
        if (col < Dv) fa::gstore(o_row_r + col, x0);
        if (col + 1 < Dv) fa::gstore(o_row_r + col + 1, x1);
      }
    }
  }
}

}  // namespace flash
