// flash_bwd_sm90.cu — FlashAttention backward dK/dV (+ atomic dQ) on Hopper warpgroup MMA (wgmma, sm_90a),
// fp16 / bf16 in, fp32 accumulate (issue 13; docs/hopper.md, "Backward").
//
//   Q_i   Br x d     dO_i  Br x dv    L_i, D_i  Br      (query block i, streamed: two stages)
//   K_j   Bc x d     V_j   Bc x dv                      (key block j, resident)
//   S^T, dP^T, P^T, dS^T   Bc x Br   (per visit; the warpgroup's 64 keys x Br in registers)
//   dK_j  Bc x d     dV_j  Bc x dv   (registers, written once)      dQ_i  Br x d (fp32 atomics)
//
// One thread block per (key block j, K/V batch entry), as flash_bwd_dkv_kernel (flash_bwd.cu) with the
// atomic dQ: Bc / 64 warpgroups, warpgroup w owning keys [64w, 64w + 64) of K_j — the M = 64 of
// wgmma.m64nNk16 — and their rows of dK_j, dV_j. Per visited query block i (and query batch entry of
// an MQA/GQA group):
//   S^T  = K_j Q_i^T     d/16 x wgmma.m64n{Br}k16 .ss   (K_j, Q_i K-major)
//   P^T  = exp2(S^T·scale·log2e − L_i·log2e)   0 where not visible (causal, keys ≥ Lk) and for rows
//          with L_i = −inf (L_i·log2e stored as +inf: exp2(−inf) = 0, load_row_stats_exp)
//   dP^T = V_j dO_i^T    dv/16 x wgmma.m64n{Br}k16 .ss   (V_j, dO_i K-major)          } one batch
//   dV_j += P^T dO_i     Br/16 x wgmma.m64n{dv}k16 .rs   (P^T rounded in registers;  }
//                                                        dO_i MN-major: .tnspB)
//   dS^T = P^T ∘ (dP^T − D_i)   (from the unrounded P^T, as flash_bwd.cu)
//   dK_j += dS^T Q_i     Br/16 x wgmma.m64n{d}k16 .rs    (dS^T rounded; Q_i MN-major)
//   dQ_i^T += K_j^T dS^T  Bc/16 x wgmma.m64n{Br}k16 .ss  (warpgroup w: head-dim rows [64w, 64w + 64);
//          A = K_j MN-major (.tnspA), B = dS^T staged in shared memory, MN-major (.tnspB)), added
//          to the fp32 accumulator by atomics (unscaled; the conversion pass applies the scale).
// "RS": A from registers — the accumulator of n8 tiles 2k, 2k+1 rounded to 16 bits is the A fragment
// of k16 step k (the identity the forward uses for P). dQ is computed transposed (FlashAttention-3's
// dQ_swapAB) so that M = the head dim: with Br = 64 queries one m64 block of dQ_i would leave one
// of two warpgroups idle or split the key sum over warpgroups (two partial sums per element: no fixed
// order); transposed, every dQ element is produced by one thread in one wgmma chain, which the ordered
// (deterministic) mode needs. At d = 64 only warpgroup 0 computes dQ in the cp.async kernel; the ws kernel splits it
// by queries (Sm90BwdWsTraits::kDQSplitQ: N = 32 per warpgroup, dS^T in two 64B-swizzled half tiles).
//
// Head dims above 128 (Sm90BwdTraits::kSplitD, "the head-dim split"): the layout above would hold dK_j and
// dV_j of 64 keys x 256 columns in 256 registers per thread. Instead Bc = 64 keys, seen by both warpgroups
// (key_row without the 64w): each computes all of S^T, P^T, dP^T, dS^T (the same values; half of each
// warpgroup's wgmmas of S^T and dP^T are the other's), and warpgroup w owns head dims [w·d/2, (w + 1)·d/2)
// of dK_j (B = those panels of Q_i) and of dQ^T (d/128 m64 blocks), [w·dv/2, ..) of dV_j (B = panels of
// dO_i): d/4 + dv/4 accumulator registers, those of d = dv = 128. Each warpgroup stores half of dS^T's
// columns. d, dv are 128 or 256 (the host pads the smaller to 128: whole panels per half).
// FlashAttention-3 (hdim 256) instead splits S / dP over the warpgroups and takes P, dS through shared
// memory into dK^T, dV^T with M = head dim (dKV_swapAB); no duplicated work, a barrier more per visit. The ws
// kernel's query split (kQSplit, below) splits S^T / dP^T by queries instead: P^T and dS^T go through shared
// memory into the other warpgroup's k16 steps of dV_j, dK_j, behind the barrier the visit already has.
//
// dQ accumulator: DQAccumWg<kDQDim> (flash_bwd_common.cuh's DQAccumLayout with rows inner: the transposed dQ^T
// fragment stores 128 contiguous bytes per element and warp; kDQDim = the head dim padded to 16, as the host allocates
// it and flash_bwd_convert_dq_tc_kernel<..., kRowsInner = true> reads it), query blocks of Br = 64 rows.
// Each accumulator element goes to its offset (head dims past kDQDim are skipped: K_j is zero there,
// so are those dQ columns). kOrderedDQ: key block n adds only after key blocks n_lo(i) .. n − 1 have
// (n_lo(i) = 0, or with a window its left edge's key block: DQOrder::turn with the mask; with a block mask the
// visitors past its holes: flash_bwd_ext.cuh's dq_turn; fa::sem_wait / fa::sem_post on DQOrderCounters, the rule
// of flash_bwd.cu's flash_bwd_dkv_kernel):
// bitwise reproducible.
//
// Shared memory (1024-byte aligned pieces; the dynamic base rounded up to 1024 bytes on the GPU as in
// flash_fwd_sm90.cu): K_j, V_j, two stages of Q_i and dO_i, dS^T (Bc x Br), all in the 128B-swizzled
// layout of flash_sm90_common.cuh (panels of 64 columns), then per stage L_i·log2e and D_i (floats).
// Copies: cp.async (load_sw128) when rows are 16-byte aligned, element loads otherwise; the next query
// block's Q_i, dO_i are fetched into the other stage while this one is computed. Barriers per visit:
// one after the copies land (+ fence.proxy.async: generic-proxy writes, async-proxy wgmma reads), one
// after dS^T is staged (sem_wait's in the ordered mode).
//
// Two kernels share these steps: flash_bwd_sm90_dkv_kernel (cp.async, above; both dQ modes, any aligned or
// element-wise layout) and flash_bwd_sm90_ws_kernel (below: a producer warpgroup issuing TMA boxes onto
// mbarriers, setmaxnreg; both dQ modes, where the tensors fit tensor maps).
//
// Extensions (docs/extensions.md; docs/hopper.md, "Backward with extensions"): both kernels take `int kExt` as
// their last template argument (default 0: the dense instantiations keep their names and code). The entry's
// lengths, window and block mask narrow the visited query blocks (QueryTileWalk; the host launches one query
// batch entry per block); P^T and dS^T come from flash_bwd_ext.cuh's ext_p_ds once dP^T is complete
// (ext_pt_dst_sm90), with the dropout bits of flash_bwd.cu's S^T strips (dropout_bits_t: the accumulator's
// layout is that strip's). Both atomic dQ modes, the ordered one with every bit (dq_turn).
//
// Not yet: overlap of one batch's wgmmas with the
// next step's math (every batch is waited for before its result is used), head dims above 256, the recompute
// dQ mode, the cp.async kernel's head-dim split without its duplicated S^T / dP^T, extensions in the head-dim split.
//
// Arguments: exactly flash_bwd_dkv_kernel's (cuda_backward._Passes.dkv lays them out; the ws kernel adds
// tma_sel and four tensor maps), the extension tail FLASH_EXT_PARAMS(float) included.
#include "flash_bwd_common.cuh"   // DQAccumWg, DQOrderCounters, load_row_stats_exp, FromAcc, Mask
#include "flash_bwd_ext.cuh"      // kExt != 0: ext_p_ds, BwdDropout, dropout_bits_t, QueryTileWalk
#include "flash_ext.cuh"          // FLASH_EXT_PARAMS
#include "flash_fwd_copy.cuh"     // flash::store_tile: the epilogue's coalesced 16-byte stores
#include "flash_sm90_common.cuh"  // sw128 layout, load_sw128, wgmma wrappers, gemm_qk_sm90, tma_load_tile

namespace fa_bwd {

template <typename T, int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN>
struct Sm90BwdTraits {
  static_assert(sizeof(T) == 2, "the wgmma backward takes 16-bit inputs");
  static_assert(kBlockM == 64, "Br = 64: the N of S^T, dP^T and dQ^T, one 128-byte panel of dS^T");
  // The head-dim split (d or dv above 128): Bc = 64 keys, seen by both warpgroups (S^T, dP^T computed by
  // each), warpgroup w owning head dims [w·d/2, (w + 1)·d/2) of dK_j and dQ^T and [w·dv/2, ..) of dV_j: its
  // accumulators are d/4 + dv/4 registers, those of d = dv = 128 with key ownership (256 would not fit).
  static constexpr bool kSplitD = kHeadDim > 128 || kHeadDimV > 128;
  static_assert(kSplitD || kBlockN == 64 || kBlockN == 128, "Bc: one or two warpgroups of 64 keys");
  static_assert(kSplitD || ((kHeadDim == 64 || kHeadDim == 128) && (kHeadDimV == 64 || kHeadDimV == 128)),
                "d, dv: the N of the dK / dV wgmma, whole 128-byte swizzle panels, 64 or 128");
  static_assert(!kSplitD || (kBlockN == 64 && (kHeadDim == 128 || kHeadDim == 256) &&
                             (kHeadDimV == 128 || kHeadDimV == 256)),
                "head-dim split: Bc = 64, d, dv 128 or 256 (each warpgroup's half whole 64-column panels)");
  static constexpr int kBc = kBlockN;
  static constexpr int kWarpgroups = kSplitD ? 2 : kBlockN / 64;
  static constexpr int kNThreads = 128 * kWarpgroups;
  static constexpr int kWgKeys = kSplitD ? 0 : 64;                     // warpgroup w's keys start at w·kWgKeys
  static constexpr int kDkN = kSplitD ? kHeadDim / 2 : kHeadDim;      // N of warpgroup's dK_j (its columns)
  static constexpr int kDvN = kSplitD ? kHeadDimV / 2 : kHeadDimV;    // N of warpgroup's dV_j
  static constexpr int kDQWarpgroups = kSplitD ? 2 : kHeadDim / 64;   // warpgroups computing dQ^T
  static constexpr int kDQBlocks = kSplitD ? kHeadDim / 128 : 1;      // m64 blocks of dQ^T per warpgroup
  static_assert(kDQWarpgroups <= kWarpgroups, "one warpgroup per 64 rows of dQ^T");
  static constexpr int kStages = 2;
  static constexpr int kAtomBytes = 1024;  // the swizzle pattern's repeat
  static constexpr int kKBytes = kBlockN * kHeadDim * 2;
  static constexpr int kVBytes = kBlockN * kHeadDimV * 2;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;    // one stage
  static constexpr int kdOBytes = kBlockM * kHeadDimV * 2;  // one stage
  static constexpr int kK = 0;
  static constexpr int kV = kK + kKBytes;
  static constexpr int kQ = kV + kVBytes;
  static constexpr int kdO = kQ + kStages * kQBytes;
  static constexpr int kdS = kdO + kStages * kdOBytes;           // dS^T  Bc x Br
  static constexpr int kStats = kdS + kBlockN * kBlockM * 2;     // per stage: L_i·log2e [Br], D_i [Br]
  // Head-dim split (cp.async kernel): dk's and dv's batch offsets, written by thread 0, read by the epilogue.
  static constexpr int kEpiOffsets = kStats + kStages * 2 * kBlockM * 4;
  static constexpr int kSmemBytes = kEpiOffsets + (kSplitD ? 2 * 8 : 0) + kAtomBytes;
  static_assert(kStats % kAtomBytes == 0, "every swizzled tile starts on the pattern's repeat");
  // Epilogue: dK_j (Bc x d) and dV_j (Bc x dv) rounded to 16 bits, staged over K_j, V_j, Q_i, dO_i (idle by
  // then) at a pitch of 8 elements more than a row: 16-byte rows, 8 consecutive rows on 8 distinct 16-byte
  // bank groups (the row pitch is an odd number of 16-byte chunks), so stmatrix writes without conflicts.
  static constexpr int kStrideDk = kHeadDim + 8;
  static constexpr int kStrideDv = kHeadDimV + 8;
  static constexpr int kEpiDv = kBlockN * kStrideDk * 2;          // sdV's byte offset (sdK at 0)
  static constexpr int kEpiBytes = kEpiDv + kBlockN * kStrideDv * 2;
  static_assert(kEpiBytes <= kdS, "the staged dK_j, dV_j fit in the operand tiles (K_j .. dO_i)");
  static_assert((kStrideDk / 8) % 2 == 1 && (kStrideDv / 8) % 2 == 1 && kEpiDv % 16 == 0,
                "staged rows: an odd number of 16-byte chunks apart, 16-byte aligned");
};

// ---- One visit's wgmma steps, shared by the cp.async kernel and the warp-specialized one ----------------
// Thread layout (both kernels): the warpgroup's 64 keys, this thread's key rows key_row and key_row + 8
// (key_row = 64·wg + 16·warp + g), query columns 8j + 2t, +1 of n8 tile j. (P^T and dS^T stay written out in
// each kernel's loop: as __forceinline__ functions ptxas scheduled the loop 18-33 instructions longer per
// visit, measured on the cp.async kernel.)

// One batch, issued and committed (the caller waits): dV_j += P^T dO_i and dK_j += dS^T Q_i (RS; dO_i, Q_i
// MN-major: queries 16ks.. at 2048·ks bytes, head-dim panels Br·128 bytes apart). a_p[ks], a_ds[ks] hold the k16
// step ks ^ kx (the head-dim split's warpgroup 1: kx = Br/32, its own queries first, the order of the ws kernel's
// query split, so that the two kernels' dK_j, dV_j stay the same bits).
template <typename T, int kHeadDim, int kHeadDimV, int kBlockM>  // (the warpgroup's N: Sm90BwdTraits' kDkN, kDvN)
__device__ __forceinline__ void issue_dv_dk_sm90(float (&acc_dv)[kHeadDimV / 2], float (&acc_dk)[kHeadDim / 2],
                                                 const uint32_t (&a_p)[kBlockM / 16][4],
                                                 const uint32_t (&a_ds)[kBlockM / 16][4],
                                                 const unsigned char* sdO_i, const unsigned char* sQ_i, int kx = 0) {
  fa::wgmma_fence_operand(acc_dv);
  fa::wgmma_fence_operand(acc_dk);
  fa::wgmma_fence();
  // (descriptors encoded per step: advancing two bases held through the batch spilled the d 128 consumers with
  // the lengths extension)
#pragma unroll
  for (int ks = 0; ks < kBlockM / 16; ++ks)
    flash::wgmma_rs<T, kHeadDimV, true>(acc_dv, a_p[ks], flash::sw128_desc(sdO_i + (ks ^ kx) * 2048, kBlockM * 128), 1);
#pragma unroll
  for (int ks = 0; ks < kBlockM / 16; ++ks)
    flash::wgmma_rs<T, kHeadDim, true>(acc_dk, a_ds[ks], flash::sw128_desc(sQ_i + (ks ^ kx) * 2048, kBlockM * 128), 1);
  fa::wgmma_commit_group();
}

__device__ __forceinline__ void swap_if(bool c, uint32_t& x, uint32_t& y) {
  const uint32_t a = c ? y : x, b = c ? x : y;
  x = a, y = b;
}

// One RS batch, issued and committed: acc += A B over Br/16 k16 steps (A from registers; B MN-major, queries
// 16ks.. at 2048·ks bytes, head-dim panels Br·128 bytes apart): dV_j += P^T dO_i or dK_j += dS^T Q_i.
// kSteps: fewer k16 steps than Br/16 (the query split: the warpgroup's own queries; sB then starts at its first).
template <typename T, int N, int kBlockM, int kSteps = kBlockM / 16>
__device__ __forceinline__ void issue_rs_sm90(float (&acc)[N / 2], const uint32_t (&a)[kSteps][4],
                                              const unsigned char* sB) {
  fa::wgmma_fence_operand(acc);
  fa::wgmma_fence();
  const uint64_t d_b = flash::sw128_desc(sB, kBlockM * 128);
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks)
    flash::wgmma_rs<T, N, true>(acc, a[ks], fa::wgmma_desc_advance(d_b, ks * 2048), 1);
  fa::wgmma_commit_group();
}

// The query split (head-dim split, kQSplit): the k16 steps ks0 .. ks0 + kSteps − 1 of dV_j += P^T dO_i and
// dK_j += dS^T Q_i that belong to the other warpgroup's queries, A = its P^T / dS^T staged in shared memory (Bc x
// Br, one 128-byte swizzled panel, read K-major: k16 step k at bytes 32k of each row), B as in issue_rs_sm90.
// Issued and committed (the caller waits).
template <typename T, int kDvN, int kDkN, int kBlockM, int kSteps>
__device__ __forceinline__ void issue_dv_dk_ss_sm90(float (&acc_dv)[kDvN / 2], float (&acc_dk)[kDkN / 2],
                                                    const unsigned char* sP, const unsigned char* sdS, int ks0,
                                                    const unsigned char* sdO_i, const unsigned char* sQ_i) {
  fa::wgmma_fence_operand(acc_dv);
  fa::wgmma_fence_operand(acc_dk);
  fa::wgmma_fence();
  // A: k16 step k at 32·k bytes of each row of the staged tile; B: at 2048·k bytes (each batch's bases live only
  // through its loop: all four at once spilled the d 256 consumers)
  {
    const uint64_t d_p = flash::sw128_desc(sP + 32 * ks0, 16);
    const uint64_t d_do = flash::sw128_desc(sdO_i + ks0 * 2048, kBlockM * 128);
#pragma unroll
    for (int ks = 0; ks < kSteps; ++ks)
      flash::wgmma_ss<T, kDvN, true>(acc_dv, fa::wgmma_desc_advance(d_p, 32 * ks),
                                     fa::wgmma_desc_advance(d_do, ks * 2048), 1);
  }
  const uint64_t d_ds = flash::sw128_desc(sdS + 32 * ks0, 16);
  const uint64_t d_q = flash::sw128_desc(sQ_i + ks0 * 2048, kBlockM * 128);
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks)
    flash::wgmma_ss<T, kDkN, true>(acc_dk, fa::wgmma_desc_advance(d_ds, 32 * ks),
                                   fa::wgmma_desc_advance(d_q, ks * 2048), 1);
  fa::wgmma_commit_group();
}

// dQ_i^T += K_j^T dS^T for head-dim rows [64p, 64p + 64) and kN queries (A = K_j panel p MN-major: keys 16ks.. at
// 2048·ks bytes; B = dS^T MN-major: kN = Br, the 128B-swizzled Bc x Br tile; kN = 32, the dQ query split's half tile,
// Bc x 32 64B-swizzled — one swizzle atom wide, keys 16ks.. at 1024·ks bytes), then the atomics: acc_dq[4j + e] is
// dQ_i (query 8j + 2t + (e & 1) of the kN, head dim row + 8(e >> 1); row = 64p + 16·warp + g). dqa_i: the query
// block's accumulator + this lane's part of DQAccumWg::offset (see the kernels): each element adds a constant,
// one address then immediates.
// (dq_desc_b_sm90: the descriptor of k16 step 0; step ks is kDQStepBytes<kN> · ks further.)
template <int kN, int kBlockN>
__device__ __forceinline__ uint64_t dq_desc_b_sm90(const unsigned char* sdS) {
  static_assert(kN == 64 || kN == 32, "dS^T: the 128B-swizzled 64-query tile or a 64B-swizzled 32-query half");
  if constexpr (kN == 32) return fa::wgmma_desc(sdS, kBlockN * 64, 512, fa::kWgmmaSwizzle64B);
  else return flash::sw128_desc(sdS, kBlockN * 128);
}
template <int kN>
constexpr int kDQStepBytes = kN == 32 ? 1024 : 2048;

template <typename T, int kN, int kBlockN>
__device__ __forceinline__ void dq_issue_sm90(float (&acc_dq)[kN / 2], const unsigned char* sK,
                                              const unsigned char* sdS, int p) {  // (issued and committed)
  fa::wgmma_fence_operand(acc_dq);
  fa::wgmma_fence();
  const uint64_t d_k = flash::sw128_desc(sK + p * kBlockN * 128, kBlockN * 128);
  const uint64_t d_ds = dq_desc_b_sm90<kN, kBlockN>(sdS);
#pragma unroll
  for (int ks = 0; ks < kBlockN / 16; ++ks)
    flash::wgmma_ss<T, kN, true, true>(acc_dq, fa::wgmma_desc_advance(d_k, ks * 2048),
                                       fa::wgmma_desc_advance(d_ds, ks * kDQStepBytes<kN>), ks > 0);
  fa::wgmma_commit_group();
}

// The same batch with A = K_j^T from registers (the ws kernel's kKtRegs: load_at_frags_sm90's fragments of every
// key), B as above: RS wgmmas, K_j's panel no longer read per visit.
template <typename T, int kN, int kBlockN>
__device__ __forceinline__ void dq_issue_rs_sm90(float (&acc_dq)[kN / 2], const uint32_t (&a_kt)[kBlockN / 16][4],
                                                 const unsigned char* sdS) {  // (issued and committed)
  fa::wgmma_fence_operand(acc_dq);
  fa::wgmma_fence();
  const uint64_t d_ds = dq_desc_b_sm90<kN, kBlockN>(sdS);
#pragma unroll
  for (int ks = 0; ks < kBlockN / 16; ++ks)
    flash::wgmma_rs<T, kN, true>(acc_dq, a_kt[ks], fa::wgmma_desc_advance(d_ds, ks * kDQStepBytes<kN>), ks > 0);
  fa::wgmma_commit_group();
}

template <typename T, int kN, int kBlockN>
__device__ __forceinline__ void dq_wgmma_sm90(float (&acc_dq)[kN / 2], const unsigned char* sK,
                                              const unsigned char* sdS, int p) {
  dq_issue_sm90<T, kN, kBlockN>(acc_dq, sK, sdS, p);
  fa::wgmma_wait_group<0>();
  fa::wgmma_fence_operand(acc_dq);
}
template <typename T, int kN, int kBlockN>
__device__ __forceinline__ void dq_wgmma_sm90(float (&acc_dq)[kN / 2], const uint32_t (&a_kt)[kBlockN / 16][4],
                                              const unsigned char* sdS) {
  dq_issue_rs_sm90<T, kN, kBlockN>(acc_dq, a_kt, sdS);
  fa::wgmma_wait_group<0>();
  fa::wgmma_fence_operand(acc_dq);
}

template <int kDQDim, int kHeadDim, int kN>
__device__ __forceinline__ void dq_add_sm90(const float (&acc_dq)[kN / 2], int row, float* dqa_i) {
  using Acc = DQAccumWg<kDQDim>;
#pragma unroll
  for (int e = 0; e < kN / 2; ++e) {
    if (kDQDim == kHeadDim || row + 8 * ((e % 4) >> 1) < kDQDim)
      fa::atomic_add(dqa_i + Acc::offset(8 * (e / 4) + (e & 1), 8 * ((e % 4) >> 1)), acc_dq[e]);
  }
}

template <typename T, int kDQDim, int kHeadDim, int kN, int kBlockN>
__device__ __forceinline__ void dq_atomics_sm90(const unsigned char* sK, const unsigned char* sdS, int p,
                                                int row, float* dqa_i) {
  float acc_dq[kN / 2];
  dq_wgmma_sm90<T, kN, kBlockN>(acc_dq, sK, sdS, p);
  dq_add_sm90<kDQDim, kHeadDim, kN>(acc_dq, row, dqa_i);
}

// The head-dim split's two m64 blocks of dQ^T (panels p, p + 1; rows row, row + 64): both batches issued, the
// first block's atomics while the second computes (the query split leaves the registers for both accumulators).
// `issued`: called between the two batches' issue and the first wait (the ws kernel's kSplitOverlap: its wait for the
// dV_j, dK_j batch, which the dQ^T batches now queue behind).
template <typename T, int kDQDim, int kHeadDim, int kBlockM, int kBlockN, typename Issued = flash::NoOp>
__device__ __forceinline__ void dq_atomics2_sm90(const unsigned char* sK, const unsigned char* sdS, int p, int row,
                                                 float* dqa_i, Issued issued = Issued()) {
  float acc0[kBlockM / 2], acc1[kBlockM / 2];
  dq_issue_sm90<T, kBlockM, kBlockN>(acc0, sK, sdS, p);
  dq_issue_sm90<T, kBlockM, kBlockN>(acc1, sK, sdS, p + 1);
  issued();
  fa::wgmma_wait_group<1>();
  fa::wgmma_fence_operand(acc0);
  dq_add_sm90<kDQDim, kHeadDim, kBlockM>(acc0, row, dqa_i);
  fa::wgmma_wait_group<0>();
  fa::wgmma_fence_operand(acc1);
  dq_add_sm90<kDQDim, kHeadDim, kBlockM>(acc1, row + 64, dqa_i + DQAccumWg<kDQDim>::offset(0, 64));
}

// The head-dim split's bulk dQ (the ws kernel's Is_dq_bulk at d = dv = kDQDim = 256, kDQStaged): warpgroup w's two
// m64 blocks of dQ_i^T (head dims [128w, 128w + 128): dq_atomics2_sm90's batches) stored in DQAccumWg<128>'s
// order over its own panels of the stage (sQ_w: Q_i's panels 2w, 2w + 1, row tiles 0, 1; sdO_w: dO_i's, row tiles
// 2, 3; 16 KB each: after the warpgroup's dV, dK batches nothing reads them). The dQ warp adds them
// (dq_bulk_adds_sm90) once every consumer thread has arrived on the stage's dq_full. lane_off: this lane's
// DQAccumWg<128>::offset(2t, 16·warp + g). `issued`: as dq_atomics2_sm90's (it must wait for the dV_j, dK_j batch
// that reads those panels before the stores).
template <typename T, int kBlockM, int kBlockN, typename Issued = flash::NoOp>
__device__ __forceinline__ void dq_staged_sm90(const unsigned char* sK, const unsigned char* sdS, int w, int lane_off,
                                               unsigned char* sQ_w, unsigned char* sdO_w, Issued issued = Issued()) {
  using Stage = DQAccumWg<128>;
  static_assert(kBlockM == 64, "four 16-row tiles: two per 16 KB half");
  float acc0[kBlockM / 2], acc1[kBlockM / 2];
  dq_issue_sm90<T, kBlockM, kBlockN>(acc0, sK, sdS, 2 * w);
  dq_issue_sm90<T, kBlockM, kBlockN>(acc1, sK, sdS, 2 * w + 1);
  issued();
  float* q_half = reinterpret_cast<float*>(sQ_w) + lane_off;
  float* do_half = reinterpret_cast<float*>(sdO_w) + lane_off - 2 * 4 * Stage::kTileFloats;  // (row tiles 2, 3)
  const auto store = [&](const float (&acc)[kBlockM / 2], int col) {
#pragma unroll
    for (int e = 0; e < kBlockM / 2; ++e)
      (e / 8 < 2 ? q_half : do_half)[Stage::offset(8 * (e / 4) + (e & 1), col + 8 * ((e % 4) >> 1))] = acc[e];
  };
  fa::wgmma_wait_group<1>();
  fa::wgmma_fence_operand(acc0);
  store(acc0, 0);
  fa::wgmma_wait_group<0>();
  fa::wgmma_fence_operand(acc1);
  store(acc1, 64);
}

// Is_dq_bulk (the ws kernel): the dQ^T tile (dq_wgmma_sm90's acc_dq), stored to the shared dQ buffer in the
// accumulator's own layout (sdq_i: the buffer + this lane's part of DQAccumWg::offset, as dqa_i) once the dQ warp
// has released it (dq_empty, parity `empty_parity`); the bulk reduce-add of the dQ warp moves the whole tile.
template <int kDQDim, int kHeadDim, int kN>
__device__ __forceinline__ void dq_to_smem_sm90(const float (&acc_dq)[kN / 2], int row, float* sdq_i,
                                                uint64_t* dq_empty, int empty_parity) {
  using Acc = DQAccumWg<kDQDim>;
  fa::mbarrier_wait_parity(dq_empty, empty_parity);
#pragma unroll
  for (int e = 0; e < kN / 2; ++e) {
    if (kDQDim == kHeadDim || row + 8 * ((e % 4) >> 1) < kDQDim)
      sdq_i[Acc::offset(8 * (e / 4) + (e & 1), 8 * ((e % 4) >> 1))] = acc_dq[e];
  }
}

// dK_j·scale and dV_j from the accumulators (keys < Lk, columns < D / Dv); key0 = c0 + key_row; kHeadDim,
// kHeadDimV: the warpgroup's N (kDkN, kDvN), its columns from col_k0 / col_v0 (the head-dim split's half).
template <typename OutT, int kHeadDim, int kHeadDimV>
__device__ __forceinline__ void store_dk_dv_sm90(const float (&acc_dk)[kHeadDim / 2], const float (&acc_dv)[kHeadDimV / 2],
                                                 OutT* dk_j, long long dk_row, OutT* dv_j, long long dv_row, int key0,
                                                 int t, int Lk, int D, int Dv, float scale, int col_k0 = 0,
                                                 int col_v0 = 0) {
#pragma unroll
  for (int e = 0; e < kHeadDim / 2; ++e) {
    const int key = key0 + 8 * ((e % 4) >> 1), col = col_k0 + 8 * (e / 4) + 2 * t + (e & 1);
    if (key < Lk && col < D) fa::gstore(dk_j + key * dk_row + col, FromAcc<OutT>::convert(acc_dk[e] * scale));
  }
#pragma unroll
  for (int e = 0; e < kHeadDimV / 2; ++e) {
    const int key = key0 + 8 * ((e % 4) >> 1), col = col_v0 + 8 * (e / 4) + 2 * t + (e & 1);
    if (key < Lk && col < Dv) fa::gstore(dv_j + key * dv_row + col, FromAcc<OutT>::convert(acc_dv[e]));
  }
}

// Extensions (kExt != 0; docs/hopper.md, "Backward with extensions"): P^T and dS^T of one visit element by
// element once dP^T is complete (ext_p_ds: the score's softcap and ALiBi, the mask, the softcap's 1 − tanh², the
// dropout factor Z): acc_dp (dP^T) becomes dS^T, and P^T ∘ Z, the A operand of dV += (P ∘ Z)^T dO_i, goes
// straight to its rounded fragments a_p (k16 step by k16 step, so that the float P^T dies as it is made: the
// consumers' registers are within a few of their ceiling at d = 128). The warp's fragment is flash_bwd.cu's S^T
// strip (16 keys x Br queries, m16n8 layout: acc[4j + e] is key key0 + 8((e % 4) >> 1), query r0 + 8j + 2t +
// (e & 1)), so dropout_bits_t gives its keep bits as it stands (bit e of its word j: KeepBits, ext_keep_sm90, drawn
// before the visit's products: the Philox calls' registers are then not live with S^T and dP^T). key0 = c0 + key_row.
// The block mask is looked up once per pair of n8 tiles (16 keys by 16 queries, each from a multiple of 16, lie in
// one block: block sizes are multiples of 16; Mask::block_visible), not per element: ext_p_ds gets `geo`, the mask without
// kExtBlockMask (the same state otherwise), and a tile outside the mask gets P = dS = 0 (selects: a score the
// row's lse never saw may overflow exp2). Per element the 32 lookups of a visit were in flight together and
// their addresses cost ~40 registers.
template <typename T, int kBlockM, class M, class G, class Drop, class Keep>
__device__ __forceinline__ void ext_pt_dst_sm90(float (&acc_s)[kBlockM / 2], float (&acc_dp)[kBlockM / 2],
                                                uint32_t (&a_p)[kBlockM / 16][4], const Keep& keep,
                                                const float* lse2_s, const float* delta_s, float scale_log2,
                                                const M& mask, const G& geo, const Drop& drop, int r0, int key0,
                                                int lane) {
  const int g = lane >> 2, t = lane & 3;
  constexpr bool kDropout = flash::HasExt<MaskExt<M>::value, flash::kExtDropout>::value;
  (void)keep; (void)drop; (void)g;
#pragma unroll
  for (int j = 0; j < kBlockM / 8; ++j) {
    const float2 lse2 = *reinterpret_cast<const float2*>(lse2_s + 8 * j + 2 * t);  // queries 8j + 2t, +1
    const float2 delta2 = *reinterpret_cast<const float2*>(delta_s + 8 * j + 2 * t);
    const bool in_block = mask.block_visible(r0 + 16 * (j / 2), key0 - g);  // (true without a block mask)
#pragma unroll
    for (int e = 4 * j; e < 4 * j + 4; ++e) {
      float z = 1.0f;  // Z = keep / (1 − p)
      if constexpr (kDropout) z = keep.bit(j, e % 4) ? drop.scale : 0.0f;
      ext_p_ds(acc_s[e], acc_dp[e], e & 1 ? lse2.y : lse2.x, e & 1 ? delta2.y : delta2.x, z, scale_log2, geo,
               r0 + 8 * j + 2 * t + (e & 1), key0 + 8 * ((e % 4) >> 1));
      if constexpr (M::kBlockMask) acc_s[e] = in_block ? acc_s[e] : 0.0f, acc_dp[e] = in_block ? acc_dp[e] : 0.0f;
    }
    if (j % 2 == 1)  // n8 tiles j − 1, j: k16 step j / 2 of P^T
#pragma unroll
      for (int r = 0; r < 4; ++r) a_p[j / 2][r] = fa::pack2<T>(acc_s[8 * (j / 2) + 2 * r], acc_s[8 * (j / 2) + 2 * r + 1]);
  }
}

// The block's Mask: the entry's lengths (ExtArgs::seqlen_q / _k) with extensions; dense, Mask(Lq, Lk) with the
// dense kernel's calls only (reading Lq through seqlen_q<0>, or any extra inlined call, changed the code
// generated for some dense ws and head-dim split instantiations: their SASS is kept bit for bit).
template <bool Is_causal, int kExt>
__device__ __forceinline__ flash::Mask<Is_causal, kExt, float> entry_mask_sm90(const flash::ExtArgs<float>& ext,
                                                                               const BatchIndex& b, int Lq, int Lk) {
  if constexpr (kExt != 0)
    return flash::make_mask<Is_causal, kExt, float>(ext.template seqlen_q<kExt>(b, Lq),
                                                    ext.template seqlen_k<kExt>(b, Lk), ext, b);
  else
    return flash::make_mask<Is_causal, kExt, float>(Lq, Lk, ext, b);
}

// The lane index read again where it is used (a volatile read of %laneid): the loop-invariant values derived
// from it (dropout_bits_t's shuffle sources and counters) are then recomputed per visit rather than kept live
// across the query-block loop, which at the consumers' register ceiling spilled them. The emulator reads
// threadIdx.
__device__ __forceinline__ int lane_reread() {
#if defined(__CUDA_ARCH__)
  unsigned lane;
  asm volatile("mov.u32 %0, %%laneid;\n" : "=r"(lane));
  return static_cast<int>(lane);
#else
  return static_cast<int>(threadIdx.x % 32);
#endif
}

// Dropout's keep bits of a visit: bit e of n8 tile j (dropout_bits_t's word j), kept as Br / 8 words or, kPacked,
// packed into one word at bit 4j + e. The ws kernel packs them with a window: at d = 128 its consumers spilled
// 8 bytes with window + dropout in the words, and the packed word spilled block mask + dropout without a window
// (ptxas's allocation; thirty-eighth session's audit, docs/hopper.md, "Backward with extensions").
template <int kBlockM, bool kPacked>
struct KeepBits {
  static_assert(!kPacked || kBlockM / 8 * 4 <= 32, "the packed keep bits of a visit: four per n8 tile, one word");
  uint32_t w[kPacked ? 1 : kBlockM / 8];
  __device__ __forceinline__ bool bit(int j, int e) const {
    return ((kPacked ? w[0] >> (4 * j + e) : w[j] >> e) & 1u) != 0;
  }
};

// The keep bits of the warp's S^T strip for query block r0 (dropout_bits_t: keys k16 .. + 15, k16 = the warp's
// first key, a multiple of 16, by the Br queries); nothing without kExtDropout.
template <int kBlockM, bool kDropout, bool kPacked>
__device__ __forceinline__ void ext_keep_sm90(KeepBits<kBlockM, kPacked>& keep,
                                              const BwdDropout<kDropout, float>& drop, int r0, int k16) {
  if constexpr (kDropout) {
    uint32_t words[kBlockM / 8];
    dropout_bits_t<kBlockM>(words, drop.rng, r0, k16, lane_reread());
    keep.w[0] = 0;
#pragma unroll
    for (int j = 0; j < kBlockM / 8; ++j) {
      if constexpr (kPacked) keep.w[0] |= words[j] << (4 * j);
      else keep.w[j] = words[j];
    }
  }
  (void)keep; (void)drop; (void)r0; (void)k16;
}

// Epilogue step 1, per warp: its 16 rows of an accumulator tile (rows warp_row.. of the staged tile, columns
// col0 .. col0 + N) times mult, rounded to T (as FromAcc: round to nearest even), into sTile (pitch kStride
// elements) by stmatrix.x4, one per 16 columns: matrices rows 0-7 / 8-15 of n8 tiles 2p, 2p + 1, lane l
// addressing row l mod 8 of matrix l / 8 (flash_fwd_sm90.cu's stage_o_sm90). acc[4j + e] is (row g + 8(e >> 1),
// column 8j + 2t + (e & 1)): the accumulator's rows are the output's (keys), no transpose.
template <typename T, int N, int kStride>
__device__ __forceinline__ void stage_acc_sm90(T* sTile, const float (&acc)[N / 2], float mult, int warp_row,
                                               int col0, int lane) {
  const int m = lane / 8;
  T* row_addr = sTile + (warp_row + 8 * (m % 2) + lane % 8) * kStride + col0 + 8 * (m / 2);
#pragma unroll
  for (int p = 0; p < N / 16; ++p) {
    uint32_t regs[4];
    flash::stmatrix_regs_sm90<T, N>(regs, acc, p, mult, mult);
    fa::stmatrix<4, false>(row_addr + 16 * p, regs);
  }
}

// The dK_j / dV_j epilogue of both kernels (16-bit outputs; float partial sums take store_dk_dv_sm90).
// sync() is a barrier over the kNThreads math threads, etid this thread's index among them, wg_row its
// warpgroup's first key in the tile, col_k0 / col_v0 its first columns (head-dim split: its half). First barrier:
// every warpgroup is done with K_j, V_j, Q_i, dO_i (its last dQ^T wgmma, reading K_j, and its dV / dK wgmmas
// were waited for; no copy or TMA box is in flight), which the staged tiles overwrite. Each warpgroup stages
// its keys (head-dim split: its columns), dK_j·scale and dV_j; second barrier: the tiles are complete before
// the threads read whole rows of them. Then flash::store_tile: consecutive threads store consecutive 16-byte
// chunks of a row (full 32-byte sectors), keys < Lk, columns < D / Dv. The callers take it only where that is
// legal: 16-byte rows (D, Dv multiples of 8: the cp.async kernel's kVec, the ws kernel's tensor maps) — dk, dv
// are the plan's contiguous buffers, rows of D, Dv elements. (A run-time check with an element-wise path from
// shared memory compiled in as well made ptxas spill 4-20 bytes in the loop at d = 256.) dk_j, dv_j: the
// tiles' first keys (c0). smem: the kernel's dynamic shared-memory base, not the
// 1024-aligned one (stmatrix and the 16-byte reads need 16-byte rows only; the base is a constant ptxas need
// not keep live across the loop); the staged tiles end below the operand tiles' end (kEpiBytes <= kdS).
template <typename Tr, typename OutT, int kNThreads, typename Sync>
__device__ __forceinline__ void epilogue_dk_dv_sm90(unsigned char* smem, const float (&acc_dk)[Tr::kDkN / 2],
                                                    const float (&acc_dv)[Tr::kDvN / 2], OutT* dk_j, long long dk_row,
                                                    OutT* dv_j, long long dv_row, int rows_valid, int D, int Dv,
                                                    float scale, int wg_row, int col_k0, int col_v0, int etid,
                                                    Sync sync) {
  static_assert(sizeof(OutT) == 2, "stmatrix stages 16-bit elements");
  constexpr int kBlockN = Tr::kBc;
  // This warp's first row (its warpgroup's first, wg_row, + 16 per warp) and lane, from etid after the loop
  // (written so that ptxas does not keep the prologue's warp index live across the loop: at 255 registers,
  // d = 256, that spilled 4 bytes).
  const int warp_row = wg_row + ((etid & 0x60) >> 1), lane = etid & 31;
  OutT* sdK = reinterpret_cast<OutT*>(smem);
  OutT* sdV = reinterpret_cast<OutT*>(smem + Tr::kEpiDv);
  sync();
  stage_acc_sm90<OutT, Tr::kDkN, Tr::kStrideDk>(sdK, acc_dk, scale, warp_row, col_k0, lane);
  stage_acc_sm90<OutT, Tr::kDvN, Tr::kStrideDv>(sdV, acc_dv, 1.0f, warp_row, col_v0, lane);
  sync();
  flash::store_tile<OutT, kBlockN, Tr::kStrideDk - 8, Tr::kStrideDk, kNThreads>(dk_j, dk_row, sdK, rows_valid, D,
                                                                               true, etid);
  flash::store_tile<OutT, kBlockN, Tr::kStrideDv - 8, Tr::kStrideDv, kNThreads>(dv_j, dv_row, sdV, rows_valid, Dv,
                                                                               true, etid);
}


// The ws kernel's dK_j / dV_j epilogue by TMA stores (Is_tma_store: 16-bit outputs whose tensor maps the host
// could encode; docs/hopper.md, "dK/dV epilogue"). Step 1, per warp: as stage_acc_sm90, but into Bc x N of
// 128B-swizzled panels (the layout of K_j / V_j, flash_sm90_common.cuh: 16-byte chunk c of row r of a
// 64-column panel at chunk c ^ (r mod 8), panels kRows·128 bytes apart) — what a CU_TENSOR_MAP_SWIZZLE_128B
// store reads. A stmatrix phase (8 lanes: rows r .. r + 7 of one chunk) hits 8 distinct chunks: no conflicts.
template <typename T, int kRows, int N>
__device__ __forceinline__ void stage_acc_sw128_sm90(unsigned char* sTile, const float (&acc)[N / 2], float mult,
                                                     int warp_row, int col0, int lane) {
  const int m = lane / 8, row = warp_row + 8 * (m % 2) + lane % 8;
#pragma unroll
  for (int p = 0; p < N / 16; ++p) {
    uint32_t regs[4];
    flash::stmatrix_regs_sm90<T, N>(regs, acc, p, mult, mult);
    fa::stmatrix<4, false>(sTile + flash::sw128_offset<kRows>(row, col0 / 8 + 2 * p + m / 2), regs);
  }
}

// One tile staged by stage_acc_sw128_sm90 (kCols columns in 64-column panels) to global memory: one TMA store
// per panel holding a column below cols (rows at or past the map's Lk and columns past its D are clipped by
// the TMA unit). Coordinates: column 64p, row row0, batch b2, b1, b0.
template <int kRows, int kCols>
__device__ __forceinline__ void tma_store_tile(const CUtensorMap* map, const unsigned char* s_tile, int cols,
                                               int row0, int b2, int b1, int b0) {
#pragma unroll
  for (int p = 0; p < kCols / 64; ++p)
    if (64 * p < cols) fa::tma_store_5d(map, 64 * p, row0, b2, b1, b0, s_tile + p * kRows * 128);
}

// Batch coordinates of a map (its dims 2, 3, 4).
struct BatchCoords {
  int b2, b1, b0;
};

// Map m's coordinate of batch dim d (tma_sel, above the ws kernel) for group entry grp of batch entry b.
__device__ __forceinline__ int tma_coord(long long tma_sel, int m, int d, int grp, const BatchIndex& b) {
  const int which = static_cast<int>(tma_sel >> (9 * m + 3 * d)) & 7;
  return which == 1 ? grp : which == 2 ? b.b2 : which == 3 ? b.b1 : which == 4 ? b.b0 : 0;
}

// The epilogue: barrier (operand tiles idle, as epilogue_dk_dv_sm90's first), dK_j·scale into the K_j tile
// and dV_j into the V_j tile (sKV: the 1024-aligned K_j, V_j at + kKBytes: the swizzle is taken from the
// address bits), fence.proxy.async (the stmatrix writes are generic-proxy stores, the TMA store reads through
// the async proxy), barrier (every warp's rows staged); then thread etid 0 alone issues d/64 + dv/64 stores
// (panels past D / Dv skipped), commits them as one bulk group and waits for their reads of shared memory
// (cp.async.bulk.wait_group.read 0) before it exits: the block's shared memory lives until its last thread
// exits. coords(m): map m's (0: dK, 1: dV) batch coordinates, evaluated by that thread only.
template <typename Tr, typename OutT, typename Sync, typename Coords>
__device__ __forceinline__ void epilogue_dk_dv_tma_sm90(unsigned char* sKV, const float (&acc_dk)[Tr::kDkN / 2],
                                                        const float (&acc_dv)[Tr::kDvN / 2], const CUtensorMap* map_dk,
                                                        const CUtensorMap* map_dv, int c0, int D, int Dv, float scale,
                                                        int etid, Sync sync, Coords coords) {
  static_assert(sizeof(OutT) == 2, "stmatrix stages 16-bit elements");
  constexpr int kBlockN = Tr::kBc;
  // The warpgroup (its keys; head-dim split: its columns), the warp's first row and the lane, all from etid
  // after the loop: the consumer warpgroup index kept from the prologue spilled 4-8 bytes at d = 256.
  const int cw = etid >> 7, col_k0 = Tr::kSplitD ? cw * Tr::kDkN : 0, col_v0 = Tr::kSplitD ? cw * Tr::kDvN : 0;
  const int warp_row = cw * Tr::kWgKeys + ((etid & 0x60) >> 1), lane = etid & 31;
  sync();
  stage_acc_sw128_sm90<OutT, kBlockN, Tr::kDkN>(sKV, acc_dk, scale, warp_row, col_k0, lane);
  stage_acc_sw128_sm90<OutT, kBlockN, Tr::kDvN>(sKV + Tr::kKBytes, acc_dv, 1.0f, warp_row, col_v0, lane);
  fa::fence_proxy_async();
  sync();
  if (etid == 0) {
    const BatchCoords bk = coords(0), bv = coords(1);
    tma_store_tile<kBlockN, Tr::kKBytes / (kBlockN * 2)>(map_dk, sKV, D, c0, bk.b2, bk.b1, bk.b0);
    tma_store_tile<kBlockN, Tr::kVBytes / (kBlockN * 2)>(map_dv, sKV + Tr::kKBytes, Dv, c0, bv.b2, bv.b1, bv.b0);
    fa::tma_store_commit();
    fa::tma_store_wait<0>();
  }
}

// Lengths in the ws kernel: rows [r_lo, kRows) of a kRows x kCols 128B-swizzled tile (64-column panels kRows·128
// bytes apart) set to zero by nthreads threads (etid: this one's index): the rows past the entry's Lq_b or Lk_b,
// which the TMA boxes (bounded by the launch's Lq, Lk) brought in. A row's 16-byte chunks stay in its own 128
// bytes of each panel whatever the swizzle, so whole rows are zeroed without it.
template <int kRows, int kCols>
__device__ __forceinline__ void zero_rows_sw128(unsigned char* tile, int r_lo, int etid, int nthreads) {
  constexpr int kChunks = kCols / 8;  // 16-byte chunks per row, over the panels
  r_lo = r_lo < 0 ? 0 : r_lo;
  for (int idx = etid; idx < (kRows - r_lo) * kChunks; idx += nthreads) {
    const int r = r_lo + idx / kChunks, c = idx % kChunks;
    *reinterpret_cast<uint4*>(tile + (c / 8) * kRows * 128 + r * 128 + (c % 8) * 16) = uint4{0u, 0u, 0u, 0u};
  }
}

// Both tiles of a pair (K_j, V_j or Q_i, dO_i: kRows rows, kCols / kColsV columns) zeroed from row r_lo by the
// ws kernel's consumers (etid: the thread's index among them), made visible to the wgmmas of both warpgroups.
template <typename Tr, int kRows, int kCols, int kColsV>
__device__ __forceinline__ void zero_past_sm90(unsigned char* tile, unsigned char* tile_v, int r_lo, int etid) {
  zero_rows_sw128<kRows, kCols>(tile, r_lo, etid, Tr::kConsumerThreads);
  zero_rows_sw128<kRows, kColsV>(tile_v, r_lo, etid, Tr::kConsumerThreads);
  fa::fence_proxy_async();  // the generic zeros visible to the wgmmas (async proxy) ...
  fa::named_barrier_sync(Tr::kConsumerBarrier, Tr::kConsumerThreads);  // ... of both warpgroups
}

// The query blocks key block c0 visits: i from i_begin to end − 1 (the query batch entries of the group outer),
// n_visits in all. Dense: from the first block that sees the key block (causal) to the last. With extensions
// (kExt != 0; the host launches them with n_group = 1) QueryTileWalk's: the entry's lengths, the causal / window
// band, query blocks whose block-mask blocks are all False skipped (the loops step by walk.next).
struct QueryVisits {
  int i_begin, end, n_visits;
};
template <int kExt, int kBlockM, class M>
__device__ __forceinline__ QueryVisits query_visits_sm90(const QueryTileWalk<M>& walk, int Lq, int n_group) {
  const int i_begin = walk.mask.m_block_min(walk.n0, kBlockM);
  if constexpr (kExt != 0) {
    const int end = walk.end();
    const int first = walk.next(i_begin - 1, end);
    return {first, end, walk.count(first, end)};
  } else {
    const int end = (Lq + kBlockM - 1) / kBlockM;
    return {i_begin, end, (end > i_begin ? end - i_begin : 0) * n_group};
  }
}

}  // namespace fa_bwd
using namespace fa_bwd;

template <typename T, typename OutT, int kHeadDim, int kHeadDimV, int kDQDim, int kBlockM, int kBlockN,
          bool Is_causal, bool kVec, bool kOrderedDQ, int kExt = 0>
__global__ void __launch_bounds__((kHeadDim > 128 || kHeadDimV > 128 ? 2 : kBlockN / 64) * 128, 1) flash_bwd_sm90_dkv_kernel(
    const T* __restrict__ q, long long q_b0, long long q_b1, long long q_b2, long long q_g, long long q_row,
    const T* __restrict__ k, long long k_b0, long long k_b1, long long k_b2, long long k_row,
    const T* __restrict__ v, long long v_b0, long long v_b1, long long v_b2, long long v_row,
    const T* __restrict__ dout, long long do_b0, long long do_b1, long long do_b2, long long do_g, long long do_row,
    const float* __restrict__ lse, long long l_b0, long long l_b1, long long l_b2, long long l_g,
    const float* __restrict__ delta, long long d_b0, long long d_b1, long long d_b2, long long d_g,
    float* __restrict__ dq_accum, long long dqa_b0, long long dqa_b1, long long dqa_b2, long long dqa_g,
    long long dqa_row /* = kDQDim (DQAccumWg); unused */,
    OutT* __restrict__ dk, long long dk_b0, long long dk_b1, long long dk_b2, long long dk_row,
    OutT* __restrict__ dv, long long dv_b0, long long dv_b1, long long dv_b2, long long dv_row,
    int Lq, int Lk, int D, int Dv, int nb2, int n_group, float scale, FLASH_EXT_PARAMS(float)) {
  using Tr = Sm90BwdTraits<T, kHeadDim, kHeadDimV, kBlockM, kBlockN>;
  using Acc = DQAccumWg<kDQDim>;
  constexpr int kNThreads = Tr::kNThreads;
  static_assert(kDQDim % 16 == 0 && kDQDim <= kHeadDim, "the accumulator's head dim: D padded to 16");
  (void)dqa_row;

  FA_DYNAMIC_SMEM(smem_raw);
  // Swizzled tiles start on the pattern's repeat in the shared window (flash_fwd_sm90.cu's rule).
  const int misalign = static_cast<int>(fa::wgmma_desc(smem_raw, 0, 0, fa::kWgmmaSwizzleNone) & 0x3f) * 16;
  unsigned char* smem = smem_raw + (Tr::kAtomBytes - misalign) % Tr::kAtomBytes;
  unsigned char* sK = smem + Tr::kK;
  unsigned char* sV = smem + Tr::kV;
  unsigned char* sQ = smem + Tr::kQ;    // [stage]
  unsigned char* sdO = smem + Tr::kdO;  // [stage]
  unsigned char* sdS = smem + Tr::kdS;
  float* stats = reinterpret_cast<float*>(smem + Tr::kStats);  // [stage][L_i·log2e | D_i][Br]

  const int tid = static_cast<int>(threadIdx.x);
  // Keys [64 wg, 64 wg + 64) of K_j (head-dim split: all Bc = 64 keys, head-dim half wg). Broadcast from
  // lane 0 so that the compiler knows it is warp-uniform (CUTLASS's canonical_warp_group_idx): the
  // descriptors built from it then live in uniform registers.
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);
  const int lane = tid % 32, g = lane >> 2, t = lane & 3;
  const int key_row = wg * Tr::kWgKeys + ((tid % 128) / 32) * 16 + g;  // this thread's keys: key_row, key_row + 8
  // The key block: blockIdx.x, or in the ordered causal mode Tc - 1 - blockIdx.x (DQOrder).
  using Order = DQOrderOf<Is_causal, kOrderedDQ, kExt>;
  const Order dq_order = Order::make();
  const int c0 = dq_order.n * kBlockN;
  const float scale_log2 = scale * flash::kLog2e;
  const BatchIndex b = BatchIndex::from_grid(nb2);
  // Extensions: the entry's lengths Lq_b, Lk_b (rows and keys past them are zero-filled, never read; their
  // gradients are zeros), window, block mask, softcap, ALiBi (the mask), dropout. kExt = 0: Lq_b = Lq,
  // Lk_b = Lk, the dense mask.
  const flash::ExtArgs<float> ext = FLASH_EXT_ARGS(float);
  int Lq_b = Lq, Lk_b = Lk;  // (dense: no ExtArgs call, entry_mask_sm90's rule)
  if constexpr (kExt != 0) Lq_b = ext.template seqlen_q<kExt>(b, Lq), Lk_b = ext.template seqlen_k<kExt>(b, Lk);
  const auto mask = flash::make_mask<Is_causal, kExt, float>(Lq_b, Lk_b, ext, b);
  const QueryTileWalk<decltype(mask)> walk{mask, c0, kBlockM, kBlockN};

  // Visits (query batch entry grp of the group, query block i): i from the first block that sees key
  // block j (causal) to Tr − 1, grp outer (extensions: query_visits_sm90).
  const QueryVisits visits = query_visits_sm90<kExt, kBlockM>(walk, Lq, n_group);
  const int i_begin = visits.i_begin, n_qblocks = visits.end, n_visits = visits.n_visits;
  const T* q_b = q + b.offset({q_b0, q_b1, q_b2, q_row});
  const T* do_b = dout + b.offset({do_b0, do_b1, do_b2, do_row});
  const float* lse_b = lse + b.offset({l_b0, l_b1, l_b2, 0});
  const float* delta_b = delta + b.offset({d_b0, d_b1, d_b2, 0});
  auto dqa_entry = [&](int grp) { return dq_accum + b.offset({dqa_b0, dqa_b1, dqa_b2, 0}) + grp * dqa_g; };
  const DQOrderCounters<kBlockM, kDQDim> order{Lq};
  // This lane's part of DQAccumWg::offset(query 8j + 2t + (e & 1), head dim key_row + 8(e >> 1)) (the
  // dQ^T accumulator's rows are head dims laid out as the key rows): the query's 2t and the head dim's
  // key_row occupy bits the element's constants (8j + (e & 1), 8(e >> 1)) leave untouched, so the offset
  // of element e is dq_lane + offset(8j + (e & 1), 8(e >> 1)). Head-dim split: this thread's dQ^T row in
  // the warpgroup's first m64 block; block pp's rows are 64pp further, offset(0, 64pp) further.
  const int dq_row = (Tr::kSplitD ? wg * Tr::kDQBlocks * 64 : 0) + key_row;
  const int dq_lane = dq_row < kDQDim ? Acc::offset(2 * t, dq_row) : 0;
  // This lane's byte in the swizzled dS^T (sw128_offset<Bc>(key_row, chunk) + 4t with Br = 64: one
  // panel): chunk c of the row is at 128·key_row + 16(c ^ g) + 4t = (128·key_row + 16g + 4t) ^ 16c
  // (the bits of 16c are those of 16g only), and key_row + 8 is 1024 bytes further: one XOR per store.
  const int ds_lane = key_row * 128 + (g << 4) + 4 * t;
  static_assert(kBlockM == 64, "dS^T: one 64-column panel");

  // Q_i, dO_i of (grp, i) into stage s (cp.async or element loads), L_i·log2e and D_i (plain stores).
  auto load_query_block = [&](int grp, int i, int s) {
    const int r0 = i * kBlockM;
    flash::load_sw128<T, kBlockM, kHeadDim, kNThreads, kVec>(sQ + s * Tr::kQBytes, q_b + grp * q_g + r0 * q_row, q_row,
                                                      Lq_b - r0, D, false, tid);
    flash::load_sw128<T, kBlockM, kHeadDimV, kNThreads, kVec>(sdO + s * Tr::kdOBytes, do_b + grp * do_g + r0 * do_row,
                                                       do_row, Lq_b - r0, Dv, false, tid);
    load_row_stats_exp<kBlockM, kNThreads>(stats + s * 2 * kBlockM, stats + (s * 2 + 1) * kBlockM,
                                           lse_b + grp * l_g, delta_b + grp * d_g, r0, Lq_b);
  };

  // Head-dim split: dk's and dv's batch offsets through shared memory to the epilogue (the ws kernel's
  // batch_off): computed there, the batch index stayed live across the loop, which at 255 registers spilled
  // it (4 bytes, d = 256, plain atomics). Thread 0's stores are ordered before the epilogue's reads by the
  // loop's barriers and the epilogue's first.
  long long* epi_off = reinterpret_cast<long long*>(smem + Tr::kEpiOffsets);
  if (Tr::kSplitD && tid == 0)
    epi_off[0] = b.offset({dk_b0, dk_b1, dk_b2, dk_row}), epi_off[1] = b.offset({dv_b0, dv_b1, dv_b2, dv_row});

  // -- prologue: K_j, V_j (resident) and the first query block.
  flash::load_sw128<T, kBlockN, kHeadDim, kNThreads, kVec>(sK, k + b.offset({k_b0, k_b1, k_b2, k_row}) + c0 * k_row, k_row,
                                                    Lk_b - c0, D, false, tid);
  flash::load_sw128<T, kBlockN, kHeadDimV, kNThreads, kVec>(sV, v + b.offset({v_b0, v_b1, v_b2, v_row}) + c0 * v_row,
                                                     v_row, Lk_b - c0, Dv, false, tid);
  if (n_visits > 0) load_query_block(0, i_begin, 0);
  fa::cp_async_commit();

  // The warpgroup's head-dim columns of dK_j, dV_j (head-dim split: its half; else all) and their panels in
  // Q_i, dO_i (the B of the dK / dV wgmma).
  const int col_k0 = Tr::kSplitD ? wg * Tr::kDkN : 0, col_v0 = Tr::kSplitD ? wg * Tr::kDvN : 0;
  const int q_panel = col_k0 / 64 * kBlockM * 128, do_panel = col_v0 / 64 * kBlockM * 128;
  float acc_dk[Tr::kDkN / 2];   // dK_j, the warpgroup's 64 keys x d (accumulator layout), unscaled
  float acc_dv[Tr::kDvN / 2];   // dV_j, 64 keys x dv (head-dim split: x d/2, x dv/2)
#pragma unroll
  for (int e = 0; e < Tr::kDkN / 2; ++e) acc_dk[e] = 0.0f;
#pragma unroll
  for (int e = 0; e < Tr::kDvN / 2; ++e) acc_dv[e] = 0.0f;

  int grp = 0, i = i_begin;
  for (int visit = 0; visit < n_visits; ++visit) {
    const int s = visit & 1;
    const bool wrap = i + 1 == n_qblocks;
    int i_n = wrap ? i_begin : i + 1, grp_n = wrap ? grp + 1 : grp;
    // Extensions: one query batch entry per block (grp stays 0), block-mask tiles skipped.
    if constexpr (kExt != 0) i_n = walk.next(i, n_qblocks), grp_n = 0;
    const unsigned char* sQ_i = sQ + s * Tr::kQBytes;
    const unsigned char* sdO_i = sdO + s * Tr::kdOBytes;
    const float* lse2_s = stats + s * 2 * kBlockM;
    const float* delta_s = lse2_s + kBlockM;
    fa::cp_async_wait<0>();
    // The copies of this visit (first: also K_j, V_j) and L_i, D_i are visible to every thread and to
    // the async proxy wgmma reads through; every warpgroup is done with the previous visit (its stage,
    // which the prefetch below refills, and dS^T: its dQ wgmmas were waited for).
    fa::fence_proxy_async();
    __syncthreads();
    if (visit + 1 < n_visits) load_query_block(grp_n, i_n, s ^ 1);  // overlaps this visit's math
    fa::cp_async_commit();

    // -- S^T = K_j Q_i^T (SS; A = the warpgroup's 64 keys, B = Q_i, both K-major: the forward's
    //    gemm_qk_sm90 with Q and K swapped).
    const int r0 = i * kBlockM;
    KeepBits<kBlockM, false> keep;  // extensions: dropout's keep bits (ext_keep_sm90)
    // (dropout's generator made per visit from the arguments: kept across the loop it spilled at d = 128)
    const auto drop = BwdDropout<flash::HasExt<kExt, flash::kExtDropout>::value, float>::make(ext, b);
    if constexpr (kExt != 0) ext_keep_sm90(keep, drop, r0, (c0 + key_row) & ~7);
    float acc_s[kBlockM / 2];
    flash::gemm_qk_sm90<T, kHeadDim, kBlockN, kBlockM>(acc_s, sK + wg * Tr::kWgKeys * 128, sQ_i);

    // -- P^T = exp2(S^T·scale·log2e − L_i·log2e): acc_s[4j + e] is (key key_row + 8(e >> 1), query
    //    8j + 2t + (e & 1)); 0 where the key is not visible to the query (causal, keys past Lk).
    //    (Extensions: after dP^T, ext_pt_dst_sm90.)
    if constexpr (kExt == 0) {
#pragma unroll
      for (int j = 0; j < kBlockM / 8; ++j) {
        const float2 lse2 = *reinterpret_cast<const float2*>(lse2_s + 8 * j + 2 * t);  // queries 8j + 2t, +1
#pragma unroll
        for (int e = 4 * j; e < 4 * j + 4; ++e) {
          const int col = 8 * j + 2 * t + (e & 1);
          const int key = c0 + key_row + 8 * ((e % 4) >> 1);
          acc_s[e] = p_from_score(acc_s[e], scale_log2, e & 1 ? lse2.y : lse2.x, mask.is_visible(r0 + col, key));
        }
      }
    }
    // -- dP^T = V_j dO_i^T (SS, both K-major).
    float acc_dp[kBlockM / 2];
    flash::gemm_qk_sm90<T, kHeadDimV, kBlockN, kBlockM>(acc_dp, sV + wg * Tr::kWgKeys * 128, sdO_i);

    // -- dS^T = P^T ∘ (dP^T − D_i) from the unrounded P^T; P^T and dS^T rounded to the A fragments of
    //    dV += P^T dO_i and dK += dS^T Q_i, and dS^T staged for dQ: word r of k16 step ks is (key
    //    key_row + 8(r % 2), queries 16ks + 8(r / 2) + 2t, +1), one 4-byte store into 16-byte chunk
    //    2ks + r / 2 of that key's swizzled row. (dP^T waited for before dV is issued: P^T's float and
    //    rounded copies are never live together with dP^T in flight — 16 registers less at the peak.)
    uint32_t a_p[kBlockM / 16][4], a_ds[kBlockM / 16][4];
    if constexpr (kExt == 0) {
#pragma unroll
      for (int j = 0; j < kBlockM / 8; ++j) {
        const float2 delta2 = *reinterpret_cast<const float2*>(delta_s + 8 * j + 2 * t);
#pragma unroll
        for (int e = 4 * j; e < 4 * j + 4; ++e) acc_dp[e] = acc_s[e] * (acc_dp[e] - (e & 1 ? delta2.y : delta2.x));
      }
    } else {
      ext_pt_dst_sm90<T, kBlockM>(acc_s, acc_dp, a_p, keep, lse2_s, delta_s, scale_log2, mask, geometry(mask), drop,
                                  r0, c0 + key_row, lane);
    }
#pragma unroll
    for (int ks = 0; ks < kBlockM / 16; ++ks)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        if constexpr (kExt == 0) a_p[ks][r] = fa::pack2<T>(acc_s[8 * ks + 2 * r], acc_s[8 * ks + 2 * r + 1]);
        a_ds[ks][r] = fa::pack2<T>(acc_dp[8 * ks + 2 * r], acc_dp[8 * ks + 2 * r + 1]);
        // (head-dim split: both warpgroups hold all of dS^T; each stores half of its columns)
        if (!Tr::kSplitD || ks / (kBlockM / 32) == wg)
          *reinterpret_cast<uint32_t*>(sdS + ((ds_lane ^ ((2 * ks + r / 2) << 4)) + 1024 * (r % 2))) = a_ds[ks][r];
      }
    // -- dV_j += P^T dO_i, dK_j += dS^T Q_i: one batch, waited for after the barrier below (the head-dim split's
    //    warpgroup 1 from its own queries' k16 steps on: the ws kernel's order).
    int kx = 0;
    if constexpr (Tr::kSplitD) {
      kx = wg == 1 ? kBlockM / 32 : 0;
#pragma unroll
      for (int ks = 0; ks < kBlockM / 32; ++ks)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          swap_if(kx != 0, a_p[ks][r], a_p[ks + kBlockM / 32][r]);
          swap_if(kx != 0, a_ds[ks][r], a_ds[ks + kBlockM / 32][r]);
        }
    }
    issue_dv_dk_sm90<T, Tr::kDkN, Tr::kDvN, kBlockM>(acc_dv, acc_dk, a_p, a_ds, sdO_i + do_panel, sQ_i + q_panel, kx);

    // dS^T complete and visible to the async proxy before any warpgroup's dQ wgmma reads it (ordered:
    // also our turn for query block i — sem_wait ends in a block barrier).
    fa::fence_proxy_async();
    const DQTurn turn = kOrderedDQ ? dq_turn(dq_order, i, walk) : DQTurn{0, 1};
    if constexpr (kOrderedDQ)
      fa::sem_wait(order.counter(dqa_entry(grp), i), turn.expected);
    else
      __syncthreads();
    // dV, dK complete (they ran during the barrier) before the dQ batch: the A fragments of P^T and dS^T
    // are then dead while dQ^T's accumulator is live (32 registers less at the peak; no spills at d = 128).
    fa::wgmma_wait_group<0>();
    fa::wgmma_fence_operand(acc_dv);
    fa::wgmma_fence_operand(acc_dk);

    // -- dQ_i^T += K_j^T dS^T (warpgroups wg < d/64; head-dim split: both, d/128 blocks of 64 rows each) and
    //    its atomics.
    if (wg < Tr::kDQWarpgroups)
#pragma unroll
      for (int pp = 0; pp < Tr::kDQBlocks; ++pp)
        dq_atomics_sm90<T, kDQDim, kHeadDim, kBlockM, kBlockN>(
            sK, sdS, wg * Tr::kDQBlocks + pp, dq_row + 64 * pp,
            dqa_entry(grp) + static_cast<long long>(r0) * kDQDim + dq_lane + Acc::offset(0, 64 * pp));
    if constexpr (kOrderedDQ) fa::sem_post(order.counter(dqa_entry(grp), i), turn.add);
    i = i_n, grp = grp_n;
  }
  fa::cp_async_wait<0>();  // no copy outlives the kernel when no query block was visited

  // -- epilogue: dK_j·scale and dV_j (keys < Lk, columns < D / Dv): 16-bit outputs staged in shared memory
  //    and stored in 16-byte chunks (epilogue_dk_dv_sm90); float partial sums (K/V broadcast over the grid)
  //    from the accumulators (2-byte stores), and so, in this kernel, element-wise layouts (!kVec: rows not
  //    16-byte aligned) and d or dv = 128 without the head-dim split: there the loop runs at 253-255 of 255
  //    registers and ptxas spilled 4-40 bytes in one of the four fp16 instantiations with the staged epilogue
  //    after it, in each of the five arrangements measured. (This kernel runs only where the ws kernel's
  //    tensor maps cannot: cuda_backward_sm90.tma_args.)
  constexpr bool kStaged = sizeof(OutT) == 2 && kVec && (Tr::kSplitD || (kHeadDim < 128 && kHeadDimV < 128));
  OutT* dk_b = dk + (Tr::kSplitD ? epi_off[0] : b.offset({dk_b0, dk_b1, dk_b2, dk_row}));
  OutT* dv_b = dv + (Tr::kSplitD ? epi_off[1] : b.offset({dv_b0, dv_b1, dv_b2, dv_row}));
  if constexpr (kStaged)
    epilogue_dk_dv_sm90<Tr, OutT, kNThreads>(smem_raw, acc_dk, acc_dv, dk_b + static_cast<long long>(c0) * dk_row, dk_row,
                                             dv_b + static_cast<long long>(c0) * dv_row, dv_row, Lk - c0, D, Dv, scale,
                                             wg * Tr::kWgKeys, col_k0, col_v0, tid, [] { __syncthreads(); });
  else
    store_dk_dv_sm90<OutT, Tr::kDkN, Tr::kDvN>(acc_dk, acc_dv, dk_b, dk_row, dv_b, dv_row, c0 + key_row, t, Lk, D,
                                              Dv, scale, col_k0, col_v0);
}

// ---- The warp-specialized variant: TMA loads completing on mbarriers (flash_bwd_sm90_ws_kernel) -----------
// 384 threads. Warpgroup 0 is the producer (setmaxnreg.dec to kProducerRegs): its warp 0 fills a ring of
// kStages stages, per visit one stage: the 32 lanes load L_i·log2e and D_i (load_row_stats_exp: two floats
// each, the −inf rows turned into +inf) and arrive on full[s]; the lane chosen by elect.sync arrives with
// expect_tx(Q_i + dO_i bytes) and issues Q_i and dO_i as TMA boxes completing on full[s] (so full[s]
// expects 32 arrivals and the boxes' bytes). Before the first visit it loads K_j and V_j once, on bar_kv.
// Warpgroups 1 and 2 are the consumers of the cp.async kernel's math (keys [64(w−1), 64w) of K_j), raised to
// kConsumerRegs: wait on bar_kv once and on full[s] per visit, and arrive on empty[s] (256 arrivals) once
// the stage's last readers (the dV / dK wgmmas) have completed (the staged bulk dQ: the dQ warp arrives, once its
// adds have read the stage). No copy instruction and no block-wide barrier
// in their loop: the barrier between dS^T staged and the dQ wgmma is named barrier 1 over the 256 consumer
// threads, and dS^T is double-buffered by stage (a warpgroup writing visit v + 1's dS^T while the other still
// runs visit v's dQ wgmma would overwrite what it reads; with two buffers the barrier of visit v + 1 orders
// the write of visit v + 2 after that read).
// Both dQ modes. Ordered (kOrderedDQ) with the consumers' atomics (no Is_dq_bulk; with it the dQ warp takes the
// turn, dq_bulk_writer_sm90, at every head dim): the consumers take their turn at query block i with the group
// semaphore fa::sem_wait_group / fa::sem_post_group over named barrier 1 and the 256 consumer threads (the
// leader, thread 256, polls the counter and posts it). The block-wide fa::sem_wait / fa::sem_post would make
// the producer meet the consumers' loop at every turn; code reachable from both roles is register-allocated
// at the launch bound (168), and that loop spilled 500-700 bytes at d = 128 (measured). With the group
// version the producer never touches the counters.
//
// Tensor maps (flasharray/_private/cuda_backward_sm90.py): q, dout rank 5 (column, row, three batch dims)
// with box (64 columns, Br rows, 1, 1, 1); k, v the same with Bc rows. The three batch dims of a map are the
// tensor's batch dims of extent above 1 (the group dim walked in the block and the grid's b2, b1, b0; at most
// three, else the host takes the cp.async kernel); tma_sel says for each (bits 9m + 3d .. +2, map m = q, dout,
// k, v, dk, dv; batch dim d) which coordinate it takes: 0 none (extent 1: coordinate 0), 1 the group entry,
// 2 b2, 3 b1, 4 b0. Broadcast dims (stride 0) have extent 1 in the map. dk, dv (Is_tma_store: the epilogue's
// TMA stores): rank 5 with box (64 columns, Bc rows, 1, 1, 1), 128-byte swizzle, over the outputs' D / Dv
// columns and Lk rows (the TMA unit clips the tile's rows past Lk); without Is_tma_store the host passes the
// q and dout maps in their places (unused).
namespace fa_bwd {

template <typename T, int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN, bool Is_dq_bulk = false,
          bool kDQSplitOn = true, int kDQBufsMax = 2>
struct Sm90BwdWsTraits : Sm90BwdTraits<T, kHeadDim, kHeadDimV, kBlockM, kBlockN> {
  using Base = Sm90BwdTraits<T, kHeadDim, kHeadDimV, kBlockM, kBlockN>;
  // The dQ query split (d = 64, two warpgroups of keys; kDQSplitOn): dQ^T is one m64 block of head-dim rows there,
  // which left one warpgroup Bc/16 more wgmmas per visit than the other (the cp.async kernel's layout). Instead
  // warpgroup w computes dQ^T for the queries [32w, 32w + 32) (N = 32) of all 64 head-dim rows, and dS^T is
  // staged as two Bc x 32 tiles, 64B-swizzled (one swizzle atom wide: each warpgroup's B a whole canonical tile).
  // Every dQ element is still one thread's one wgmma chain over the keys: the ordered mode's bits are unchanged.
  static constexpr bool kDQSplitQ = kDQSplitOn && !Base::kSplitD && kHeadDim == 64 && kBlockN == 128;
  static constexpr int kDQN = kDQSplitQ ? kBlockM / 2 : kBlockM;  // the N of a warpgroup's dQ^T wgmma
  static constexpr int kDQWarpgroups = kDQSplitQ ? 2 : Base::kDQWarpgroups;  // warpgroups computing dQ^T
  // Is_dq_bulk in the head-dim split (d = dv = 256 only): dQ staged by the consumers over the stage's own panels
  // (dq_staged_sm90) and added from there by the dQ warp, which then releases the stage: no dQ buffers, the
  // stage's dq_full barrier (dq_bulk_writer_sm90)
  static constexpr bool kDQStaged = Is_dq_bulk && Base::kSplitD;
  static_assert(!kDQStaged || (kHeadDim == 256 && kHeadDimV == 256), "the staged bulk dQ: d = dv = 256");
  static_assert(Base::kWarpgroups == 2, "the producer warpgroup feeds two consumer warpgroups");
  static constexpr int kConsumerThreads = Base::kNThreads;
  static constexpr int kNThreads = 128 + kConsumerThreads;
  // setmaxnreg's counts: FlashAttention-3's 24 / 240, but in the head-dim split 32 / 232 (its consumers use up to 216
  // registers; at 24 the producer warpgroup spilled 4 bytes in the causal kernels: kDQStaged holding the loader's and
  // the dQ warp's state, the consumers' atomics (d 256 with DQ_BULK off, D = 200) the loader's alone)
  static constexpr int kSplitProducerRegs = 32, kSplitConsumerRegs = 232;
  static constexpr int kProducerRegs = Base::kSplitD ? kSplitProducerRegs : flash::kWsProducerRegs;
  static constexpr int kConsumerRegs = Base::kSplitD ? kSplitConsumerRegs : flash::kWsConsumerRegs;
  static_assert((kProducerRegs + 2 * kConsumerRegs) * 128 <= 65536, "the register file holds all three warpgroups");
  static constexpr int kProducerLanes = 32;  // full[s]'s arrivals: warp 0 of the producer
  static constexpr int kdSBytes = kBlockN * kBlockM * 2;
  static constexpr int kdS = Base::kdS;                                   // [stage] dS^T, Bc x Br
  // The head-dim split: P^T per stage as well, the query split's operand of the other warpgroup (kQSplitOn;
  // reserved either way).
  static constexpr int kP = kdS + Base::kStages * kdSBytes;                // [stage] P^T, Bc x Br
  static constexpr int kStats = kP + (Base::kSplitD ? Base::kStages * kdSBytes : 0);  // per stage: L_i·log2e, D_i
  // Is_dq_bulk: kDQBufs buffers of one query block's dQ tile (fp32, DQAccumWg, Br x d bytes reserved): the most
  // of kDQBufsMax, 2, 1 that fit in the opt-in maximum (the consumers run up to kDQBufs - 1 visits ahead of the dQ
  // warp: in the ordered mode, of its turns).
  static constexpr int kDQAcc = kStats + Base::kStages * 2 * kBlockM * 4;
  static constexpr int kDQTileBytes = kBlockM * kHeadDim * 4;
  static constexpr int kSmemLimit = 227 * 1024;
  // batch offsets (elements) in shared memory: head-dim split dq_accum's, dk's, dv's; Is_dq_bulk dq_accum's
  static constexpr int kOffsetsBytes = Base::kSplitD ? 3 * 8 : Is_dq_bulk ? 8 : 0;
  static constexpr int kTurnBytes = 24;  // ordered dQ: the counters' base (a pointer), DQOrder's key block, Tc, Lk - Lq
  static constexpr int kRest = 8 * (1 + 2 * Base::kStages) + kTurnBytes + kOffsetsBytes + Base::kAtomBytes;
  static constexpr int kDQBufsFit = (kSmemLimit - kRest - kDQAcc) / (kDQTileBytes + 16);  // (how many fit)
  static constexpr int kDQBufs = !Is_dq_bulk || kDQStaged ? 0 : kDQBufsFit >= kDQBufsMax ? kDQBufsMax
                                                                  : kDQBufsFit >= 2 ? 2 : 1;
  static constexpr int kBarOffset = kDQAcc + kDQBufs * kDQTileBytes;
  // kv, full[stage], empty[stage], then dQ full/empty[buffer] (kDQStaged: dQ full[stage]; the stage's empty frees it)
  static constexpr int kBars = 1 + 2 * Base::kStages + (kDQStaged ? Base::kStages : 2 * kDQBufs);
  static constexpr int kTurnOffset = kBarOffset + kBars * 8;               // ordered dQ: the counters' base
  static constexpr int kOffsetsOffset = kTurnOffset + kTurnBytes;  // head-dim split: dq_accum's, dk's, dv's batch offsets
  static constexpr int kSmemBytes = kOffsetsOffset + kOffsetsBytes + Base::kAtomBytes;
  static constexpr int kConsumerBarrier = 1;  // named barrier of the 256 consumer threads
  static constexpr int kDQBarrier = 2;        // Is_dq_bulk, ordered: the dQ warp's group semaphore
  static constexpr int kWgBarrier = 3;        // ids 3, 4: consumer warpgroup 0's, 1's own (the split overlap)
  static constexpr int kDQThreads = 128 * kDQWarpgroups;  // dq_full's arrivals: the dQ^T warpgroups
  static_assert(kStats % Base::kAtomBytes == 0, "every swizzled tile starts on the pattern's repeat");
  static_assert(kBlockM <= 256 && kBlockN <= 256, "a TMA box has at most 256 rows");
  static_assert(kDQAcc % 128 == 0 && kDQTileBytes % 128 == 0, "the dQ buffers: 16-byte (bulk copy) aligned");
  static_assert(kSmemBytes <= kSmemLimit, "shared memory within the opt-in maximum");
};

// The ws kernel's dV batch, issued between the dP^T batch's commit and its wait (gemm_qk_sm90's `issued`).
template <typename T, int kHeadDimV, int kBlockM, int kSteps = kBlockM / 16>
struct IssueDvSm90 {
  float (&acc_dv)[kHeadDimV / 2];
  const uint32_t (&a_p)[kSteps][4];
  const unsigned char* sdO_i;
  __device__ __forceinline__ void operator()() const {
    issue_rs_sm90<T, kHeadDimV, kBlockM, kSteps>(acc_dv, a_p, sdO_i);
  }
};

// The query split (Sm90BwdWsTraits::kQSplit): one visit's scores for the warpgroup's Br/2 queries [q_off, q_off +
// Br/2) of all Bc keys, up to its own half of dV_j, dK_j. S^T = K_j Q_i^T and dP^T = V_j dO_i^T with N = Br/2 (no
// wgmma duplicated between the warpgroups), P^T and dS^T staged (sP, sdS: the other warpgroup's A operand, read
// after the barrier by issue_dv_dk_ss_sm90), the RS batches of dV_j and dK_j over the own k16 steps issued (dV's
// behind dP^T's, as in the ws kernel's other modes); the caller waits, holding a_p, a_ds (the RS batches' A
// registers, read until then). acc_s[4j + e]: key key_row + 8((e % 4) >> 1), query q_off + 8j + 2t + (e & 1).
// kOverlap (kSplitOverlapOn): dP^T issued right behind S^T, so that it computes under the softmax of P^T, and the
// dV batch after P^T's staging (where the default issues dP^T behind that staging, the dV batch with it).
template <typename T, typename Tr, int kHeadDim, int kHeadDimV, int kBlockM, bool kOverlap, class M>
__device__ __forceinline__ void visit_scores_qsplit_sm90(
    float (&acc_dv)[Tr::kDvN / 2], float (&acc_dk)[Tr::kDkN / 2], uint32_t (&a_p)[kBlockM / 32][4],
    uint32_t (&a_ds)[kBlockM / 32][4], const unsigned char* sK, const unsigned char* sV,
    const unsigned char* sQ_i, const unsigned char* sdO_i, unsigned char* sP_s, unsigned char* sdS_s,
    const float* lse2_s, const float* delta_s, float scale_log2, const M& mask, int r0, int key0, int q_off,
    int ds_lane, int t, int q_panel, int do_panel) {
  constexpr int kQ = kBlockM / 2, kSteps = kQ / 16;
  const int ks0 = q_off / 16;  // the own k16 steps of the Br queries
  float acc_s[kQ / 2], acc_dp[kQ / 2];
  if constexpr (kOverlap) {
    flash::issue_qk_sm90<T, kHeadDim, Tr::kBc, kQ, kBlockM>(acc_s, sK, sQ_i + q_off * 128);
    flash::issue_qk_sm90<T, kHeadDimV, Tr::kBc, kQ, kBlockM>(acc_dp, sV, sdO_i + q_off * 128);
    fa::wgmma_wait_group<1>();  // S^T (dP^T runs on)
    fa::wgmma_fence_operand(acc_s);
  } else {
    flash::gemm_qk_sm90<T, kHeadDim, Tr::kBc, kQ, flash::NoOp, 0, kBlockM>(acc_s, sK, sQ_i + q_off * 128);
  }
#pragma unroll
  for (int j = 0; j < kQ / 8; ++j) {
    const float2 lse2 = *reinterpret_cast<const float2*>(lse2_s + q_off + 8 * j + 2 * t);
#pragma unroll
    for (int e = 4 * j; e < 4 * j + 4; ++e) {
      const int col = q_off + 8 * j + 2 * t + (e & 1), key = key0 + 8 * ((e % 4) >> 1);
      acc_s[e] = p_from_score(acc_s[e], scale_log2, e & 1 ? lse2.y : lse2.x, mask.is_visible(r0 + col, key));
    }
  }
  // acc rounded to the A fragments of the own k16 steps and staged (the cp.async kernel's dS^T layout) by one
  // stmatrix.x4 per step (ds_lane: this lane's row address, the kernel's kDsStmatrix form; the step's chunks a XOR)
  const auto round_and_stage = [&](uint32_t (&a)[kSteps][4], const float (&acc)[kQ / 2], unsigned char* tile) {
#pragma unroll
    for (int ks = 0; ks < kSteps; ++ks) {
#pragma unroll
      for (int r = 0; r < 4; ++r) a[ks][r] = fa::pack2<T>(acc[8 * ks + 2 * r], acc[8 * ks + 2 * r + 1]);
      fa::stmatrix<4, false>(tile + (ds_lane ^ ((ks0 + ks) << 5)), a[ks]);
    }
  };
  round_and_stage(a_p, acc_s, sP_s);
  const IssueDvSm90<T, Tr::kDvN, kBlockM, kSteps> issue_dv{acc_dv, a_p, sdO_i + do_panel + ks0 * 2048};
  if constexpr (kOverlap) {
    issue_dv();
    fa::wgmma_wait_group<1>();  // dP^T (dV runs on)
    fa::wgmma_fence_operand(acc_dp);
  } else {
    flash::gemm_qk_sm90<T, kHeadDimV, Tr::kBc, kQ, IssueDvSm90<T, Tr::kDvN, kBlockM, kSteps>, 1, kBlockM>(
        acc_dp, sV, sdO_i + q_off * 128, issue_dv);
  }
#pragma unroll
  for (int j = 0; j < kQ / 8; ++j) {
    const float2 delta2 = *reinterpret_cast<const float2*>(delta_s + q_off + 8 * j + 2 * t);
#pragma unroll
    for (int e = 4 * j; e < 4 * j + 4; ++e) acc_dp[e] = acc_s[e] * (acc_dp[e] - (e & 1 ? delta2.y : delta2.x));
  }
  round_and_stage(a_ds, acc_dp, sdS_s);
  issue_rs_sm90<T, Tr::kDkN, kBlockM, kSteps>(acc_dk, a_ds, sQ_i + q_panel + ks0 * 2048);
}

// The dQ warp's turn at query block i (DQOrder::turn) in dense calls, its key block, Tc and the mask's causal offset
// read from shared memory after the counters' base at the wait (at 24 registers, the three live across the loop
// spilled 8 bytes; read from blockIdx / gridDim there, 12). Extensions: the caller's turn with the mask (a window
// moves query block i's first visitor to its left edge), dq_bulk_writer_sm90's `ext_turn`.
template <class Order, int kBlockM, int kBlockN>
__device__ __forceinline__ int dq_warp_turn(int* const* turn0, int i) {
  const int* a = reinterpret_cast<const int*>(turn0 + 1);
  return Order{a[0], a[1]}.turn(i, kBlockM, kBlockN, a[2]);
}

// The dQ warp's bulk reduce-adds of one query block's tile (dq_i: its accumulator), from buffer bf: the dQ buffer
// (one add of the whole Br x kDQDim tile), or kDQStaged stage bf (dq_staged_sm90's panels: per warpgroup w and
// 16-row tile tm, columns [128w, 128w + 128) are 8 KB in a row of DQAccumWg<256>, 8 KB in the stage).
template <typename Tr, int kDQDim, int kBlockM>
__device__ __forceinline__ void dq_bulk_adds_sm90(float* dq_i, const unsigned char* smem, int bf) {
  if constexpr (Tr::kDQStaged) {
    constexpr int kTile = 4 * DQAccumWg<128>::kTileFloats * 4;  // 16 rows x 128 columns, bytes
    static_assert(Tr::kQBytes == Tr::kdOBytes, "stage bf's dO_i at a constant distance from its Q_i");
    const unsigned char* sQ_bf = smem + Tr::kQ + bf * Tr::kQBytes;
#pragma unroll
    for (int w = 0; w < 2; ++w)
#pragma unroll
      for (int tm = 0; tm < kBlockM / 16; ++tm)
        fa::bulk_reduce_add_f32(dq_i + DQAccumWg<256>::offset(16 * tm, 128 * w),
                                sQ_bf + (tm < 2 ? 0 : Tr::kdO - Tr::kQ) + w * 2 * kBlockM * 128 + (tm % 2) * kTile,
                                kTile);
  } else {
    fa::bulk_reduce_add_f32(dq_i, smem + Tr::kDQAcc + bf * Tr::kDQTileBytes, kBlockM * kDQDim * 4);
  }
}

// Is_dq_bulk: the dQ warp (warp 1 of the producer warpgroup, at its setmaxnreg count). Per visit (query block i
// of group entry grp, in the consumers' order): wait until the consumers filled buffer visit mod kBufs (dq_full:
// their generic stores, fenced for the async proxy, then released by the arrival; kDQStaged: the buffers are the
// stages); ordered, take the turn at (grp, i) (the group semaphore over this warp); lane 0 adds the tile to the
// accumulator (dq_bulk_adds_sm90), waits for the source's read and frees the buffer (dq_empty; kDQStaged: the
// stage's empty, whose one arrival this is). Ordered, it waits for the adds' completion (wait_group 0, not
// .read) before the post passes the turn on: the next key block's adds must land after them (a post after .read
// alone would publish adds still in flight). The consumers never wait for the turn: they run up to kBufs
// visits ahead. The accumulator of group entry 0 is dq_accum + dqa_off[0] and its counter of query block 0
// *turn0 (both 4-byte elements: (grp, i) is grp·dqa_g + i counters further, the consumers' rule); both read
// from shared memory where used (at 24 registers, values live from the kernel's prologue spilled: 8 bytes,
// measured). Extensions (kExt != 0: one group entry, n_group = 1): the query blocks of the consumers' walk
// (`walk.next`: block-mask tiles skipped) and the turn `ext_turn(i)` (dq_turn: the wait's count and the post's).
template <typename Tr, int kDQDim, int kBlockM, int kBlockN, bool kOrderedDQ, class Order, int kExt = 0,
          class Walk = flash::NoOp, class ExtTurn = flash::NoOp>
__device__ __forceinline__ void dq_bulk_writer_sm90(const unsigned char* smem, uint64_t* dq_full, uint64_t* dq_empty,
                                                    float* dq_accum, const long long* dqa_off, int* const* turn0,
                                                    long long dqa_g, int n_visits, int i_begin, int n_qblocks,
                                                    const Walk& walk = Walk(), const ExtTurn& ext_turn = ExtTurn()) {
  constexpr int kBufs = Tr::kDQStaged ? Tr::kStages : Tr::kDQBufs;
  const bool issuer = threadIdx.x % 32 == 0;
  // (grp_off: the group entry's offset grp·dqa_g, kept as a running sum: 3-5 instructions fewer than the product)
  long long grp_off = 0;
  for (int visit = 0, i = i_begin; visit < n_visits; ++visit) {
    const int bf = visit % kBufs;
    fa::mbarrier_wait_parity(dq_full + bf, (visit / kBufs) & 1);
    DQTurn turn{0, 1};  // (ext_turn's with a block mask, else posts of 1)
    if constexpr (kOrderedDQ && kExt != 0) {
      turn = ext_turn(i);
      fa::sem_wait_group(*turn0 + i, turn.expected, Tr::kDQBarrier, 32);
    } else if constexpr (kOrderedDQ)
      fa::sem_wait_group(*turn0 + grp_off + i, dq_warp_turn<Order, kBlockM, kBlockN>(turn0, i), Tr::kDQBarrier, 32);
    if (issuer) {
      dq_bulk_adds_sm90<Tr, kDQDim, kBlockM>(dq_accum + *dqa_off + grp_off + static_cast<long long>(i) * kBlockM * kDQDim,
                                             smem, bf);
      fa::bulk_commit();
      fa::bulk_wait_read<0>();
      fa::mbarrier_arrive(dq_empty + bf);  // the source read: the consumers may refill the buffer
      if constexpr (kOrderedDQ) fa::bulk_wait<0>();  // the adds complete before the turn passes on
    }
    if constexpr (kOrderedDQ)
      fa::sem_post_group(*turn0 + grp_off + i, Tr::kDQBarrier, 32, turn.add);
    else
      __syncwarp();
    if constexpr (kExt != 0) {
      i = walk.next(i, n_qblocks);
    } else {
      const bool wrap = i + 1 == n_qblocks;
      i = wrap ? i_begin : i + 1, grp_off = wrap ? grp_off + dqa_g : grp_off;
    }
  }
  if (issuer) fa::bulk_wait<0>();
}

}  // namespace fa_bwd

template <typename T, typename OutT, int kHeadDim, int kHeadDimV, int kDQDim, int kBlockM, int kBlockN,
          bool Is_causal, bool kOrderedDQ, bool Is_tma_store, bool Is_dq_bulk, int kExt = 0, bool kKVRegsOn = true,
          bool kQSplitOn = true, bool kEntriesFirstOn = true, bool kDQSplitOn = true, bool kKtRegsOn = true,
          bool kScoresAheadOn = false, int kDQBufsMax = 2, bool kSplitOverlapOn = false>
__global__ void __launch_bounds__(128 + (kHeadDim > 128 || kHeadDimV > 128 ? 2 : kBlockN / 64) * 128, 1)
flash_bwd_sm90_ws_kernel(
    const T* __restrict__ q, long long q_b0, long long q_b1, long long q_b2, long long q_g, long long q_row,
    const T* __restrict__ k, long long k_b0, long long k_b1, long long k_b2, long long k_row,
    const T* __restrict__ v, long long v_b0, long long v_b1, long long v_b2, long long v_row,
    const T* __restrict__ dout, long long do_b0, long long do_b1, long long do_b2, long long do_g, long long do_row,
    const float* __restrict__ lse, long long l_b0, long long l_b1, long long l_b2, long long l_g,
    const float* __restrict__ delta, long long d_b0, long long d_b1, long long d_b2, long long d_g,
    float* __restrict__ dq_accum, long long dqa_b0, long long dqa_b1, long long dqa_b2, long long dqa_g,
    long long dqa_row /* = kDQDim (DQAccumWg); unused */,
    OutT* __restrict__ dk, long long dk_b0, long long dk_b1, long long dk_b2, long long dk_row,
    OutT* __restrict__ dv, long long dv_b0, long long dv_b1, long long dv_b2, long long dv_row,
    int Lq, int Lk, int D, int Dv, int nb2, int n_group, float scale, FLASH_EXT_PARAMS(float), long long tma_sel,
    const __grid_constant__ CUtensorMap tmap_q, const __grid_constant__ CUtensorMap tmap_do,
    const __grid_constant__ CUtensorMap tmap_k, const __grid_constant__ CUtensorMap tmap_v,
    const __grid_constant__ CUtensorMap tmap_dk, const __grid_constant__ CUtensorMap tmap_dv) {
  using Tr = Sm90BwdWsTraits<T, kHeadDim, kHeadDimV, kBlockM, kBlockN, Is_dq_bulk, kDQSplitOn, kDQBufsMax>;
  using IssueDv = IssueDvSm90<T, Tr::kDvN, kBlockM>;
  constexpr bool kDQWarp = Is_dq_bulk;  // the bulk dQ by the dQ warp (from its buffers, or kDQStaged the stages)
  // kMaskTurns: the dQ warp takes the ordered mode's turns past a block mask's holes (dq_turn: block_any's lookups,
  // the Mask's FastDiv members). At the producer's 24 registers that warp spilled 4 bytes (forty-eighth session);
  // it gets the head-dim split's 32 / 232 (cuda_backward_sm90.ws_regs(mask_turns=True)).
  constexpr bool kMaskTurns = kDQWarp && kOrderedDQ && flash::HasExt<kExt, flash::kExtBlockMask>::value;
  constexpr int kProducerRegs = kMaskTurns ? Tr::kSplitProducerRegs : Tr::kProducerRegs;
  constexpr int kConsumerRegs = kMaskTurns ? Tr::kSplitConsumerRegs : Tr::kConsumerRegs;
  static_assert((kProducerRegs + 2 * kConsumerRegs) * 128 <= 65536, "the register file holds all three warpgroups");
  constexpr int kStages = Tr::kStages;
  static_assert(kDQDim % 16 == 0 && kDQDim <= kHeadDim, "the accumulator's head dim: D padded to 16");
  static_assert(!Is_tma_store || sizeof(OutT) == 2, "TMA stores of dK_j, dV_j: 16-bit outputs");
  static_assert(kExt == 0 || !Is_dq_bulk || !Tr::kSplitD, "extensions with the bulk dQ: no head-dim split");
  // q, k, v, dout are read through the maps; their pointers and strides stay in the argument list so that
  // the host lays out the cp.async kernel's arguments for both.
  (void)q; (void)q_b0; (void)q_b1; (void)q_b2; (void)q_g; (void)q_row; (void)k; (void)k_b0; (void)k_b1;
  (void)k_b2; (void)k_row; (void)v; (void)v_b0; (void)v_b1; (void)v_b2; (void)v_row; (void)dout; (void)do_b0;
  (void)do_b1; (void)do_b2; (void)do_g; (void)do_row;
  (void)dqa_row;

  FA_DYNAMIC_SMEM(smem_raw);
  // The swizzled boxes start on the pattern's repeat in the shared window (as in the cp.async kernel).
  const int misalign = static_cast<int>(fa::wgmma_desc(smem_raw, 0, 0, fa::kWgmmaSwizzleNone) & 0x3f) * 16;
  unsigned char* smem = smem_raw + (Tr::kAtomBytes - misalign) % Tr::kAtomBytes;
  unsigned char* sK = smem + Tr::kK;
  unsigned char* sV = smem + Tr::kV;
  unsigned char* sQ = smem + Tr::kQ;    // [stage]
  unsigned char* sdO = smem + Tr::kdO;  // [stage]
  unsigned char* sdS = smem + Tr::kdS;  // [stage]
  unsigned char* sP = smem + Tr::kP;    // [stage] (the query split)
  float* stats = reinterpret_cast<float*>(smem + Tr::kStats);  // [stage][L_i·log2e | D_i][Br]
  uint64_t* bar_kv = reinterpret_cast<uint64_t*>(smem + Tr::kBarOffset);  // K_j, V_j landed
  uint64_t* full = bar_kv + 1;        // [stage]: Q_i, dO_i landed, L_i, D_i stored
  uint64_t* empty = full + kStages;   // [stage]: every consumer thread is done with the stage
  uint64_t* dq_full = empty + kStages;      // Is_dq_bulk [buffer] (kDQStaged [stage]): the dQ^T warpgroups stored
  uint64_t* dq_empty = dq_full + Tr::kDQBufs;  // [buffer]: the dQ warp's bulk reduce has read it
  float* sdQ = reinterpret_cast<float*>(smem + Tr::kDQAcc);  // [buffer] one query block's dQ (DQAccumWg)
  // Ordered dQ: the counter of (group entry 0, query block 0); (grp, i) is grp·dqa_g + i further (counters
  // and accumulator elements are both 4 bytes). Kept in shared memory, read where the leader needs it: a
  // pointer live across the consumers' loop costs the registers its peak does not have (spills at d = 128).
  int* const* turn0 = reinterpret_cast<int* const*>(smem + Tr::kTurnOffset);
  // Head-dim split: the batch offsets (elements) of dq_accum (+ it: dqa_entry(0)), dk and dv likewise, read
  // per visit / in the epilogue: computed there they kept the batch index live across the consumers' loop,
  // which spilled (20/28 bytes, causal). Offsets, not pointers: a pointer read from shared memory is generic,
  // and the atomics became ATOM through the generic space (2.5x the loop's instructions).
  const long long* batch_off = reinterpret_cast<const long long*>(smem + Tr::kOffsetsOffset);

  const int tid = static_cast<int>(threadIdx.x);
  // 0: the producer; 1, 2: consumers of keys [64(wg − 1), 64 wg). Warp-uniform (see the cp.async kernel).
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);
  // The key block: the grid's x (ordered: entries first, grid_pos), or in the ordered causal mode Tc - 1 - x (DQOrder).
  using Order = DQOrderOf<Is_causal, kOrderedDQ, kExt>;
  constexpr bool kEntriesFirst = kOrderedDQ && kEntriesFirstOn;  // (grid_pos)
  const GridPos gpos = grid_pos<kEntriesFirst>();
  const Order dq_order = Order::make(gpos.x);
  const int c0 = dq_order.n * kBlockN;
  const BatchIndex b = batch_index_at(gpos, nb2);
  // Extensions (the cp.async kernel's). With lengths the boxes still bring rows up to Lq, Lk: the consumers zero
  // those at or past the entry's Lq_b, Lk_b before any product reads them (zero_rows_sw128).
  const flash::ExtArgs<float> ext = FLASH_EXT_ARGS(float);
  const auto mask = entry_mask_sm90<Is_causal, kExt>(ext, b, Lq, Lk);
  const QueryTileWalk<decltype(mask)> walk{mask, c0, kBlockM, kBlockN};
  const QueryVisits visits = query_visits_sm90<kExt, kBlockM>(walk, Lq, n_group);
  const int i_begin = visits.i_begin, n_qblocks = visits.end, n_visits = visits.n_visits;
  auto dqa_entry = [&](int grp) { return dq_accum + b.offset({dqa_b0, dqa_b1, dqa_b2, 0}) + grp * dqa_g; };
  const DQOrderCounters<kBlockM, kDQDim> order{Lq};

  if (tid == 0) {
    fa::mbarrier_init(bar_kv, 1);
    for (int s = 0; s < kStages; ++s) {
      fa::mbarrier_init(full + s, Tr::kProducerLanes);
      fa::mbarrier_init(empty + s, Tr::kDQStaged ? 1 : Tr::kConsumerThreads);  // (staged: the dQ warp's)
      if constexpr (Tr::kDQStaged) fa::mbarrier_init(dq_full + s, Tr::kDQThreads);
    }
    for (int bf = 0; bf < Tr::kDQBufs; ++bf) {
      fa::mbarrier_init(dq_full + bf, Tr::kDQThreads);
      fa::mbarrier_init(dq_empty + bf, 1);
    }
    fa::fence_mbarrier_init();  // the inits visible to the TMA unit before any box completes on them
    if constexpr (kOrderedDQ) {
      *const_cast<int**>(turn0) = order.counter(dqa_entry(0), 0);
      int* turn_args = const_cast<int*>(reinterpret_cast<const int*>(turn0 + 1));  // dq_warp_turn's
      turn_args[0] = dq_order.n, turn_args[1] = dq_order.tc, turn_args[2] = mask.causal_offset;
    }
    if constexpr (Is_dq_bulk) const_cast<long long*>(batch_off)[0] = b.offset({dqa_b0, dqa_b1, dqa_b2, 0});
    if constexpr (Tr::kSplitD) {
      long long* off = const_cast<long long*>(batch_off);
      off[0] = b.offset({dqa_b0, dqa_b1, dqa_b2, 0}), off[1] = b.offset({dk_b0, dk_b1, dk_b2, dk_row});
      off[2] = b.offset({dv_b0, dv_b1, dv_b2, dv_row});
    }
  }
  __syncthreads();              // ... and to every thread before its first wait or arrival

  // ---- producer state: warp 0 loads (its elected lane issues the boxes) ----
  const bool loader = tid < 32;
  // Map m's coordinate of batch dim d for the group entry grp_v (tma_sel, above).
  auto coord = [&](int m, int d, int grp_v) { return tma_coord(tma_sel, m, d, grp_v, b); };
  // q, dout: their batch coordinates, fixed per block but for the group entry, which (when a map has that
  // dim) is its first batch dim (the host lists it first): taken per visit.
  // (q0, o0: −1 where that first dim is the group entry's: one value per map held by the producer, whose 24
  // registers spilled with a flag beside it)
  const int q0 = (tma_sel & 7) == 1 ? -1 : coord(0, 0, 0), q1 = coord(0, 1, 0), q2 = coord(0, 2, 0);
  const int o0 = ((tma_sel >> 9) & 7) == 1 ? -1 : coord(1, 0, 0), o1 = coord(1, 1, 0), o2 = coord(1, 2, 0);
  const float* lse_b = lse + b.offset({l_b0, l_b1, l_b2, 0});
  const float* delta_b = delta + b.offset({d_b0, d_b1, d_b2, 0});
  // Visit `visit` (query block i_v of group entry grp_v) into stage visit mod kStages, once the consumers
  // released its previous use (visit − kStages: phase visit / kStages − 1 of empty; a fresh barrier passes
  // parity 1 at once).
  auto produce = [&](int visit, int grp_v, int i_v, bool leader) {
    const int s = visit % kStages;
    fa::mbarrier_wait_parity(empty + s, ((visit / kStages) & 1) ^ 1);
    const int r0 = i_v * kBlockM;
    load_row_stats_exp<kBlockM, 32>(stats + s * 2 * kBlockM, stats + (s * 2 + 1) * kBlockM, lse_b + grp_v * l_g,
                                    delta_b + grp_v * d_g, r0, mask.Lq);
    if (leader) {
      fa::mbarrier_arrive_expect_tx(full + s, Tr::kQBytes + Tr::kdOBytes);
      flash::tma_load_tile<kBlockM, kHeadDim>(sQ + s * Tr::kQBytes, &tmap_q, r0, q0 < 0 ? grp_v : q0, q1, q2,
                                              full + s);
      flash::tma_load_tile<kBlockM, kHeadDimV>(sdO + s * Tr::kdOBytes, &tmap_do, r0, o0 < 0 ? grp_v : o0, o1, o2,
                                               full + s);
    } else {
      fa::mbarrier_arrive(full + s);  // after this lane's L_i, D_i stores (arrive: release, wait: acquire)
    }
  };

  if (wg == 0) {
    // ---- producer: K_j, V_j once, then the visits one stage ahead of the consumers ----
    fa::setmaxnreg_dec<kProducerRegs>();
    if (!loader) {  // warps 1-3: nothing to do but Is_dq_bulk's dQ warp (warp 1)
      if constexpr (kDQWarp)
        if (tid / 32 == 1)
          dq_bulk_writer_sm90<Tr, kDQDim, kBlockM, kBlockN, kOrderedDQ, Order, kExt>(
              smem, dq_full, Tr::kDQStaged ? empty : dq_empty, dq_accum, batch_off, turn0, dqa_g, n_visits, i_begin,
              n_qblocks, walk, [&](int i) { return dq_turn(dq_order, i, walk); });
      return;
    }
    const bool leader = fa::elect_one();
    if (n_visits > 0 && leader) {
      fa::mbarrier_arrive_expect_tx(bar_kv, Tr::kKBytes + Tr::kVBytes);
      flash::tma_load_tile<kBlockN, kHeadDim>(sK, &tmap_k, c0, coord(2, 0, 0), coord(2, 1, 0), coord(2, 2, 0), bar_kv);
      flash::tma_load_tile<kBlockN, kHeadDimV>(sV, &tmap_v, c0, coord(3, 0, 0), coord(3, 1, 0), coord(3, 2, 0), bar_kv);
    }
    for (int visit = 0, grp = 0, i = i_begin; visit < n_visits; ++visit) {
      produce(visit, grp, i, leader);
      if constexpr (kExt != 0) {
        i = walk.next(i, n_qblocks);  // one group entry (the consumers' order)
      } else {
        const bool wrap = i + 1 == n_qblocks;
        i = wrap ? i_begin : i + 1, grp = wrap ? grp + 1 : grp;
      }
    }
    return;
  }

  // ---- consumers ----
  fa::setmaxnreg_inc<kConsumerRegs>();
  const int cwg = wg - 1;  // keys [64 cwg, 64 cwg + 64) of K_j (head-dim split: all 64, head-dim half cwg)
  const int lane = tid % 32, g = lane >> 2, t = lane & 3;
  const int key_row = cwg * Tr::kWgKeys + ((tid % 128) / 32) * 16 + g;  // this thread's keys: key_row, key_row + 8
  const float scale_log2 = scale * flash::kLog2e;
  // dQ accumulator and dS^T addresses as lane part + constants (the cp.async kernel's). The dQ query split: every
  // warpgroup's rows are head dims 0..63, its queries [32 cwg, 32 cwg + 32) (offset() is linear in whole 16-row
  // tiles), its B the half tile cwg of dS^T, whose rows are 64 bytes (the 64B swizzle: chunk c of row r at
  // c ^ ((r >> 1) & 3); key_row + 8 is 512 bytes further).
  const int dq_row = (Tr::kSplitD ? cwg * Tr::kDQBlocks * 64 : 0) + key_row - (Tr::kDQSplitQ ? 64 * cwg : 0);
  const int dq_q0 = Tr::kDQSplitQ ? Tr::kDQN * cwg : 0;
  const int dq_lane = dq_row < kDQDim ? DQAccumWg<kDQDim>::offset(2 * t + dq_q0, dq_row) : 0;
  // kQSplit (the head-dim split, dense; kQSplitOn): warpgroup w computes S^T, P^T, dP^T, dS^T for the queries
  // [32w, 32w + 32) of the visit only (visit_scores_qsplit_sm90), where the duplicated mode computes all of them in
  // both (40 % more tensor work than the visit needs); the other warpgroup's k16 steps of dV_j, dK_j read its
  // P^T, dS^T from shared memory after the consumers' barrier (issue_dv_dk_ss_sm90).
  constexpr bool kQSplit = kQSplitOn && kExt == 0 && Tr::kSplitD;
  // kSplitOverlap (the query split at d = 256, kSplitOverlapOn): fewer idle tensor cores in the visit's chain. dP^T is
  // issued right behind S^T and computes under the softmax (visit_scores_qsplit_sm90's kOverlap), and the two dQ^T
  // batches are issued behind the SS dV_j, dK_j batch before the wait for it (dkv_done), where the default waits for
  // that batch first. Same wgmma chains, same bits.
  constexpr bool kSplitOverlap = kSplitOverlapOn && kQSplit && Tr::kDQBlocks == 2;
  // kDsStmatrix (dense calls): dS^T (the query split: P^T too) goes by stmatrix, lane l addressing row l mod 8 of
  // matrix l / 8, i.e. key st_key (+8 in matrices 1, 3) and chunk l / 16 of the k16 step, swizzled (64B in the dQ
  // split's half tiles, else 128B). Else word by word from the fragment's own (key, query) (extensions: with
  // stmatrix the d 128 kernels with seqlens spilled 8 bytes).
  constexpr bool kDsStmatrix = (!Tr::kSplitD && kExt == 0) || kQSplit;  // (the query split's P^T and dS^T too)
  const int st_key = cwg * Tr::kWgKeys + ((tid % 128) / 32) * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
  const int ds_lane = kDsStmatrix ? (Tr::kDQSplitQ ? st_key * 64 + (((lane >> 4) ^ ((st_key >> 1) & 3)) << 4)
                                                   : st_key * 128 + (((lane >> 4) ^ (st_key & 7)) << 4))
                                  : (Tr::kDQSplitQ ? key_row * 64 + (((g >> 1) & 3) << 4) + 4 * t
                                                   : key_row * 128 + (g << 4) + 4 * t);
  const int dq_panel = Tr::kDQSplitQ ? 0 : cwg * Tr::kDQBlocks;  // K_j's panel: the head-dim rows of dQ^T
  const int dq_half = Tr::kDQSplitQ ? cwg * kBlockN * 64 : 0;     // the warpgroup's B in dS^T (bytes)
  // The warpgroup's head-dim columns of dK_j, dV_j (head-dim split: its half; else all) and their panels in
  // Q_i, dO_i (the B of the dK / dV wgmma).
  const int col_k0 = Tr::kSplitD ? cwg * Tr::kDkN : 0, col_v0 = Tr::kSplitD ? cwg * Tr::kDvN : 0;
  const int q_panel = col_k0 / 64 * kBlockM * 128, do_panel = col_v0 / 64 * kBlockM * 128;
  float acc_dk[Tr::kDkN / 2];   // dK_j, the warpgroup's 64 keys x d (accumulator layout), unscaled
  float acc_dv[Tr::kDvN / 2];   // dV_j, 64 keys x dv (head-dim split: x d/2, x dv/2)
#pragma unroll
  for (int e = 0; e < Tr::kDkN / 2; ++e) acc_dk[e] = 0.0f;
#pragma unroll
  for (int e = 0; e < Tr::kDvN / 2; ++e) acc_dv[e] = 0.0f;
  if (n_visits > 0) fa::mbarrier_wait_parity(bar_kv, 0);  // K_j, V_j landed
  constexpr bool kLengths = flash::HasExt<kExt, flash::kExtSeqlens>::value;
  if (kLengths && n_visits > 0 && c0 + kBlockN > mask.Lk)  // keys past Lk_b
    zero_past_sm90<Tr, kBlockN, kHeadDim, kHeadDimV>(sK, sV, mask.Lk - c0, tid - 128);
  // kKVRegs (d = dv = 64, dense): the warpgroup's 64 rows of K_j and V_j as the register A of S^T and dP^T (RS
  // wgmma; 32 registers, read once per block): each visit's S^T / dP^T batches then read only Q_i / dO_i from
  // shared memory, where SS read the K_j / V_j panels again per wgmma (32 KB of a visit's ~190 KB).
  constexpr bool kKVRegs = kKVRegsOn && kExt == 0 && !Tr::kSplitD && kHeadDim == 64 && kHeadDimV == 64;
  uint32_t a_k[kKVRegs ? kHeadDim / 16 : 1][4], a_v[kKVRegs ? kHeadDimV / 16 : 1][4];
  if constexpr (kKVRegs) {
    if (n_visits > 0) {
      const int row0 = cwg * Tr::kWgKeys + ((tid % 128) / 32) * 16;
      flash::load_a_frags_sm90<kBlockN, kHeadDim>(a_k, sK, row0, lane);
      flash::load_a_frags_sm90<kBlockN, kHeadDimV>(a_v, sV, row0, lane);
    }
  }
  // kKtRegs (the dQ query split: d = 64, Bc = 128, dense; kKtRegsOn): K_j^T, all 128 keys x the 64 head dims, as the
  // register A of dQ^T = K_j^T dS^T (RS; 32 registers, read once per block), where SS read K_j's panel again per
  // wgmma in both warpgroups (32 KB of a visit's ~176 KB of shared-memory operand and staging traffic).
  constexpr bool kKtRegs = kKtRegsOn && kExt == 0 && Tr::kDQSplitQ;
  uint32_t a_kt[kKtRegs ? kBlockN / 16 : 1][4];
  if constexpr (kKtRegs)
    if (n_visits > 0) flash::load_at_frags_sm90<kBlockN>(a_kt, sK, (tid % 128) / 32, lane);

  // Is_dq_bulk outside the head-dim split: a visit's dQ^T tile for the dQ warp, its batch issued (over the warpgroup's
  // part of the stage's dS^T, sdS_v) and, once waited for, stored in the dQ buffer of visit v and handed over.
  const auto dq_issue_visit = [&](const unsigned char* sdS_v, float (&acc_dq)[Tr::kDQN / 2]) {
    if constexpr (kKtRegs)
      dq_issue_rs_sm90<T, Tr::kDQN, kBlockN>(acc_dq, a_kt, sdS_v);
    else
      dq_issue_sm90<T, Tr::kDQN, kBlockN>(acc_dq, sK, sdS_v, dq_panel);
  };
  const auto dq_hand_over = [&](int v, const float (&acc_dq)[Tr::kDQN / 2]) {
    const int bf = v % Tr::kDQBufs;
    dq_to_smem_sm90<kDQDim, kHeadDim, Tr::kDQN>(acc_dq, dq_row, sdQ + bf * (Tr::kDQTileBytes / 4) + dq_lane,
                                                dq_empty + bf, ((v / Tr::kDQBufs) & 1) ^ 1);
    fa::fence_proxy_async();            // the generic stores visible to the bulk reduce (async proxy) ...
    fa::mbarrier_arrive(dq_full + bf);  // ... before the dQ warp, acquiring, issues it
  };
  // kScoresAhead (kScoresAheadOn: the dQ query split at d = 64 with the dQ warp, dense calls): a visit starts by
  // issuing the previous visit's dQ^T batch, then its own S^T, and waits for dQ^T alone: the tensor cores compute S^T
  // while the warpgroup stores dQ^T for the dQ warp (the last visit's dQ^T follows the loop). Every dQ^T element is
  // the same wgmma chain as before: the same bits, handed over in the same order. The in-flight S^T and dQ^T need
  // registers at the visit's start: the visit takes FlashAttention-3's order below (P^T rounded after the dS^T math,
  // dV's batch with dK's), without which the consumers spilled 48-60 bytes and ptxas serialized the wgmmas (C7512).
  // (d = dv = 128 spilled 52-120 bytes even so.)
  constexpr bool kScoresAhead = kScoresAheadOn && kDQWarp && kExt == 0 && Tr::kDQSplitQ;

  int grp = 0, i = i_begin;
  for (int visit = 0; visit < n_visits; ++visit) {
    const int s = visit % kStages, phase = (visit / kStages) & 1;
    const int r0 = i * kBlockM;
    const unsigned char* sQ_i = sQ + s * Tr::kQBytes;
    const unsigned char* sdO_i = sdO + s * Tr::kdOBytes;
    unsigned char* sdS_s = sdS + s * Tr::kdSBytes;
    const float* lse2_s = stats + s * 2 * kBlockM;
    const float* delta_s = lse2_s + kBlockM;
    fa::mbarrier_wait_parity(full + s, phase);  // Q_i, dO_i landed (async proxy, as wgmma reads), L_i, D_i stored
    if (kLengths && r0 + kBlockM > mask.Lq)  // queries past Lq_b
      zero_past_sm90<Tr, kBlockM, kHeadDim, kHeadDimV>(sQ + s * Tr::kQBytes, sdO + s * Tr::kdOBytes, mask.Lq - r0,
                                                       flash::opaque_int(tid - 128));
    uint32_t a_pq[kQSplit ? kBlockM / 32 : 1][4], a_dsq[kQSplit ? kBlockM / 32 : 1][4];  // (the query split's)
    // (P^T's and dS^T's A fragments otherwise: declared at this level, not in the branch, as the dV / dK batches the
    // branch issues read them until dkv_done's wait below. A C++ array ends with its block: on the emulator, a
    // fragment that has ended may share its stack slot with a later variable, which the in-flight check reports.)
    uint32_t a_p[kQSplit ? 1 : kBlockM / 16][4], a_ds[kQSplit ? 1 : kBlockM / 16][4];
    if constexpr (kQSplit) {
      visit_scores_qsplit_sm90<T, Tr, kHeadDim, kHeadDimV, kBlockM, kSplitOverlap>(
          acc_dv, acc_dk, a_pq, a_dsq, sK, sV, sQ_i, sdO_i, sP + s * Tr::kdSBytes, sdS_s, lse2_s, delta_s, scale_log2, mask, r0,
          c0 + key_row, cwg * (kBlockM / 2), ds_lane, t, q_panel, do_panel);
    } else {
      // -- S^T = K_j Q_i^T (SS; A = the warpgroup's 64 keys, B = Q_i, both K-major: the forward's
      //    gemm_qk_sm90 with Q and K swapped).
      KeepBits<kBlockM, flash::HasExt<kExt, flash::kExtWindow>::value> keep;  // extensions: dropout's keep bits
      // (dropout's generator made per visit from the arguments: kept across the loop it spilled at d = 128)
      const auto drop = BwdDropout<flash::HasExt<kExt, flash::kExtDropout>::value, float>::make(ext, b);
      if constexpr (kExt != 0) ext_keep_sm90(keep, drop, r0, (c0 + key_row) & ~7);
      float acc_s[kBlockM / 2];
      if constexpr (kScoresAhead) {
        float acc_dq[Tr::kDQN / 2];
        if (visit > 0) dq_issue_visit(sdS + ((visit - 1) % kStages) * Tr::kdSBytes + dq_half, acc_dq);
        if constexpr (kKVRegs)
          flash::issue_qk_rs_sm90<T, kHeadDim, kBlockM>(acc_s, a_k, sQ_i);
        else
          flash::issue_qk_sm90<T, kHeadDim, kBlockN, kBlockM>(acc_s, sK + cwg * Tr::kWgKeys * 128, sQ_i);
        fa::wgmma_wait_group<1>();  // the previous visit's dQ^T (visit 0: nothing), S^T runs on
        fa::wgmma_fence_operand(acc_dq);
        if (visit > 0) dq_hand_over(visit - 1, acc_dq);
        fa::wgmma_wait_group<0>();
        fa::wgmma_fence_operand(acc_s);
      } else if constexpr (kKVRegs)
        flash::gemm_qk_rs_sm90<T, kHeadDim, kBlockM>(acc_s, a_k, sQ_i);
      else
        flash::gemm_qk_sm90<T, kHeadDim, kBlockN, kBlockM, flash::NoOp, 0, kBlockM, kExt == 0>(
            acc_s, sK + cwg * Tr::kWgKeys * 128, sQ_i);

      // -- P^T = exp2(S^T·scale·log2e − L_i·log2e): acc_s[4j + e] is (key key_row + 8(e >> 1), query
      //    8j + 2t + (e & 1)); 0 where the key is not visible to the query (causal, keys past Lk).
      //    (Extensions: P^T and dS^T together once dP^T is complete, ext_pt_dst_sm90; the dV batch then goes with
      //    the dK one.)
      if constexpr (kExt == 0) {
#pragma unroll
        for (int j = 0; j < kBlockM / 8; ++j) {
          const float2 lse2 = *reinterpret_cast<const float2*>(lse2_s + 8 * j + 2 * t);  // queries 8j + 2t, +1
#pragma unroll
          for (int e = 4 * j; e < 4 * j + 4; ++e) {
            const int col = 8 * j + 2 * t + (e & 1);
            const int key = c0 + key_row + 8 * ((e % 4) >> 1);
            acc_s[e] = p_from_score_sel(acc_s[e], scale_log2, e & 1 ? lse2.y : lse2.x,
                                        mask.is_visible(r0 + col, key));
          }
        }
      }
      // -- P^T rounded to the A fragments of dV += P^T dO_i; dP^T = V_j dO_i^T (SS, both K-major), and the dV
      //    batch issued behind it (the consumers' registers allow P^T's float and rounded copies to live with
      //    dP^T in flight): waiting for dP^T leaves dV running under the dS^T math.
      float acc_dp[kBlockM / 2];
      if constexpr (kExt == 0) {
#pragma unroll
        for (int ks = 0; ks < kBlockM / 16; ++ks)
#pragma unroll
          for (int r = 0; r < 4; ++r)
            if constexpr (!kScoresAhead) a_p[ks][r] = fa::pack2<T>(acc_s[8 * ks + 2 * r], acc_s[8 * ks + 2 * r + 1]);
        // (kScoresAhead: FlashAttention-3's order, dP^T alone, P^T rounded after the dS^T math and the dV batch issued
        // with dK's: P^T's fragments are not live through that math, the registers the in-flight S^T and dQ^T need)
        if constexpr (kScoresAhead && kKVRegs)
          flash::gemm_qk_rs_sm90<T, kHeadDimV, kBlockM>(acc_dp, a_v, sdO_i);
        else if constexpr (kScoresAhead)
          flash::gemm_qk_sm90<T, kHeadDimV, kBlockN, kBlockM>(acc_dp, sV + cwg * Tr::kWgKeys * 128, sdO_i);
        else if constexpr (kKVRegs)
          flash::gemm_qk_rs_sm90<T, kHeadDimV, kBlockM, IssueDv, 1>(acc_dp, a_v, sdO_i,
                                                                   IssueDv{acc_dv, a_p, sdO_i + do_panel});
        else
          flash::gemm_qk_sm90<T, kHeadDimV, kBlockN, kBlockM, IssueDv, 1>(acc_dp, sV + cwg * Tr::kWgKeys * 128, sdO_i,
                                                                          IssueDv{acc_dv, a_p, sdO_i + do_panel});

        // -- dS^T = P^T ∘ (dP^T − D_i) from the unrounded P^T, rounded to the A fragments of dK += dS^T Q_i and
        //    staged for dQ (the cp.async kernel's layout), then the dK batch.
#pragma unroll
        for (int j = 0; j < kBlockM / 8; ++j) {
          const float2 delta2 = *reinterpret_cast<const float2*>(delta_s + 8 * j + 2 * t);
#pragma unroll
          for (int e = 4 * j; e < 4 * j + 4; ++e) acc_dp[e] = acc_s[e] * (acc_dp[e] - (e & 1 ? delta2.y : delta2.x));
        }
        if constexpr (kScoresAhead) {
#pragma unroll
          for (int ks = 0; ks < kBlockM / 16; ++ks)
#pragma unroll
            for (int r = 0; r < 4; ++r) a_p[ks][r] = fa::pack2<T>(acc_s[8 * ks + 2 * r], acc_s[8 * ks + 2 * r + 1]);
        }
      } else {
        flash::gemm_qk_sm90<T, kHeadDimV, kBlockN, kBlockM, flash::NoOp, 0, kBlockM, false>(
            acc_dp, sV + cwg * Tr::kWgKeys * 128, sdO_i);
        ext_pt_dst_sm90<T, kBlockM>(acc_s, acc_dp, a_p, keep, lse2_s, delta_s, scale_log2, mask, geometry(mask), drop,
                                    r0, c0 + key_row, lane);
      }
#pragma unroll
      for (int ks = 0; ks < kBlockM / 16; ++ks) {
#pragma unroll
        for (int r = 0; r < 4; ++r) a_ds[ks][r] = fa::pack2<T>(acc_dp[8 * ks + 2 * r], acc_dp[8 * ks + 2 * r + 1]);
        // kDsStmatrix: one stmatrix.x4 per k16 step (ds_lane: this lane's row of the four 8 x 8 matrices, the
        // step's chunks a constant XOR); else word by word. The dQ split's queries 32h.. in half tile h = ks / 2.
        if constexpr (kDsStmatrix && Tr::kDQSplitQ) {
          fa::stmatrix<4, false>(sdS_s + (ks / 2) * kBlockN * 64 + (ds_lane ^ ((2 * (ks % 2)) << 4)), a_ds[ks]);
        } else if constexpr (kDsStmatrix) {
          fa::stmatrix<4, false>(sdS_s + (ds_lane ^ (ks << 5)), a_ds[ks]);
        } else {
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            if constexpr (Tr::kDQSplitQ)  // (chunk 2(ks mod 2) + r / 2)
              *reinterpret_cast<uint32_t*>(sdS_s + (ks / 2) * kBlockN * 64 +
                                           ((ds_lane ^ ((2 * (ks % 2) + r / 2) << 4)) + 512 * (r % 2))) = a_ds[ks][r];
            else if (!Tr::kSplitD || ks / (kBlockM / 32) == cwg)  // (head-dim split: each warpgroup stores half)
              *reinterpret_cast<uint32_t*>(sdS_s + ((ds_lane ^ ((2 * ks + r / 2) << 4)) + 1024 * (r % 2))) = a_ds[ks][r];
          }
        }
      }
      if constexpr (kScoresAhead)
        IssueDv{acc_dv, a_p, sdO_i + do_panel}();
      if constexpr (kExt == 0)
        issue_rs_sm90<T, Tr::kDkN, kBlockM>(acc_dk, a_ds, sQ_i + q_panel);
      else
        issue_dv_dk_sm90<T, Tr::kDkN, Tr::kDvN, kBlockM>(acc_dv, acc_dk, a_p, a_ds, sdO_i + do_panel, sQ_i + q_panel);
    }
    // dS^T of both warpgroups staged (generic stores made visible to the async proxy) before either's dQ
    // wgmma reads it: the consumers' named barrier (the producer is not in it). Ordered: the same barrier
    // ends the consumers' wait for their turn at query block i (the group semaphore: thread 256 polls,
    // the producer runs on).
    fa::fence_proxy_async();
    const DQTurn turn = kOrderedDQ && !kDQWarp ? dq_turn(dq_order, i, walk) : DQTurn{0, 1};
    if constexpr (kOrderedDQ && !kDQWarp)
      fa::sem_wait_group(*turn0 + grp * dqa_g + i, turn.expected, Tr::kConsumerBarrier, Tr::kConsumerThreads);
    else
      fa::named_barrier_sync(Tr::kConsumerBarrier, Tr::kConsumerThreads);
    if constexpr (kQSplit)  // the other warpgroup's queries: its P^T, dS^T staged before the barrier
      issue_dv_dk_ss_sm90<T, Tr::kDvN, Tr::kDkN, kBlockM, kBlockM / 32>(acc_dv, acc_dk, sP + s * Tr::kdSBytes, sdS_s,
                                                                      (1 - cwg) * (kBlockM / 32), sdO_i + do_panel,
                                                                      sQ_i + q_panel);
    if constexpr (kSplitOverlap) fa::wgmma_wait_group<1>();  // the own RS batches: their A registers free for dQ^T
    // dV, dK (they ran during the barrier): Q_i, dO_i no longer read (kSplitOverlap: behind the dQ^T batches' issue,
    // the two of them pending; staged, every warp of the warpgroup past its wait before any overwrites the panels
    // the batch read: the dQ^T batch's issue, a rendezvous of the four warps, no longer follows the wait)
    const auto dkv_done = [&] {
      fa::wgmma_wait_group<kSplitOverlap ? 2 : 0>();
      fa::wgmma_fence_operand(acc_dv);
      fa::wgmma_fence_operand(acc_dk);
      if constexpr (kSplitOverlap && Tr::kDQStaged) fa::named_barrier_sync(Tr::kWgBarrier + cwg, 128);
      if constexpr (!Tr::kDQStaged) fa::mbarrier_arrive(empty + s);  // the stage (Q_i, dO_i, L_i, D_i) may be refilled
    };
    const auto dq_issued = [&] {
      if constexpr (kSplitOverlap) dkv_done();
    };
    if constexpr (!kSplitOverlap) dkv_done();
    if constexpr (Tr::kDQStaged) {  // (the head-dim split: dQ^T over the warpgroup's own panels of the stage)
      dq_staged_sm90<T, kBlockM, kBlockN>(sK, sdS_s, cwg, DQAccumWg<128>::offset(2 * t, key_row),
                                          sQ + s * Tr::kQBytes + cwg * 2 * kBlockM * 128,
                                          sdO + s * Tr::kdOBytes + cwg * 2 * kBlockM * 128, dq_issued);
      fa::fence_proxy_async();           // the generic stores visible to the bulk reduce (async proxy) ...
      fa::mbarrier_arrive(dq_full + s);  // ... before the dQ warp, acquiring, issues it (and frees the stage)
    } else if constexpr (kDQWarp) {
      if (!kScoresAhead && cwg < Tr::kDQWarpgroups) {  // (no head-dim split: one m64 block of dQ^T per warpgroup, or
                                                       // its half; kScoresAhead: at the next visit's start)
        float acc_dq[Tr::kDQN / 2];
        dq_issue_visit(sdS_s + dq_half, acc_dq);
        fa::wgmma_wait_group<0>();
        fa::wgmma_fence_operand(acc_dq);
        dq_hand_over(visit, acc_dq);
      }
    } else if constexpr (kQSplit && Tr::kDQBlocks == 2) {  // (both consumer warpgroups compute dQ^T here)
      dq_atomics2_sm90<T, kDQDim, kHeadDim, kBlockM, kBlockN>(
          sK, sdS_s, cwg * 2, dq_row,
          dq_accum + batch_off[0] + grp * dqa_g + static_cast<long long>(r0) * kDQDim + dq_lane, dq_issued);
    } else if (cwg < Tr::kDQWarpgroups) {
      float* const dqa_i = (Tr::kSplitD ? dq_accum + batch_off[0] + grp * dqa_g : dqa_entry(grp)) +
                           static_cast<long long>(r0) * kDQDim + dq_lane;
#pragma unroll
      for (int pp = 0; pp < Tr::kDQBlocks; ++pp) {
        float acc_dq[Tr::kDQN / 2];
        if constexpr (kKtRegs)
          dq_wgmma_sm90<T, Tr::kDQN, kBlockN>(acc_dq, a_kt, sdS_s + dq_half);
        else
          dq_wgmma_sm90<T, Tr::kDQN, kBlockN>(acc_dq, sK, sdS_s + dq_half, dq_panel + pp);
        dq_add_sm90<kDQDim, kHeadDim, Tr::kDQN>(acc_dq, dq_row + 64 * pp, dqa_i + DQAccumWg<kDQDim>::offset(0, 64 * pp));
      }
    }
    // Ordered: both warpgroups' atomics done (the barrier), then one release add passes the turn on.
    if constexpr (kOrderedDQ && !kDQWarp)
      fa::sem_post_group(*turn0 + grp * dqa_g + i, Tr::kConsumerBarrier, Tr::kConsumerThreads, turn.add);
    if constexpr (kExt != 0) {
      i = walk.next(i, n_qblocks);  // one group entry: grp stays 0; block-mask tiles skipped
    } else {
      const bool wrap = i + 1 == n_qblocks;
      i = wrap ? i_begin : i + 1, grp = wrap ? grp + 1 : grp;
    }
  }

  // -- epilogue: dK_j·scale and dV_j (keys < Lk, columns < D / Dv); its barriers are the consumers' named
  //    barrier (the producer has exited; every box it issued was waited for). Is_tma_store (16-bit outputs,
  //    maps 4 and 5 of tma_sel): staged in the K_j / V_j tiles' swizzled layout and written by TMA stores.
  //    Otherwise as the cp.async kernel's: 16-bit outputs by the 16-byte path (the host takes this kernel only
  //    with 16-byte rows: tma_args), float partial sums from the fragments.
  if constexpr (kScoresAhead) {  // the last visit's dQ^T
    if (n_visits > 0) {
      float acc_dq[Tr::kDQN / 2];
      dq_issue_visit(sdS + ((n_visits - 1) % kStages) * Tr::kdSBytes + dq_half, acc_dq);
      fa::wgmma_wait_group<0>();
      fa::wgmma_fence_operand(acc_dq);
      dq_hand_over(n_visits - 1, acc_dq);
    }
  }
  const auto consumer_sync = [] { fa::named_barrier_sync(Tr::kConsumerBarrier, Tr::kConsumerThreads); };
  // kDQStaged: the dQ warp's last adds read the last visit's stage (and, in order, every earlier one) before the
  // epilogue's staging overwrites the operand tiles: that stage's release (the dQ warp's arrival on empty).
  if constexpr (Tr::kDQStaged)
    if (n_visits > 0) fa::mbarrier_wait_parity(empty + (n_visits - 1) % kStages, ((n_visits - 1) / kStages) & 1);
  if constexpr (Is_tma_store) {
    epilogue_dk_dv_tma_sm90<Tr, OutT>(sK, acc_dk, acc_dv, &tmap_dk, &tmap_dv, c0, D, Dv, scale,
                                      tid - 128, consumer_sync, [&](int m) {
                                        const BatchIndex e = batch_index_reread<kEntriesFirst>(nb2);
                                        return BatchCoords{tma_coord(tma_sel, 4 + m, 0, 0, e),
                                                           tma_coord(tma_sel, 4 + m, 1, 0, e),
                                                           tma_coord(tma_sel, 4 + m, 2, 0, e)};
                                      });
    return;
  }
  // (Is_dq_bulk: the batch index re-read from blockIdx; carried across the loop it spilled 4/8 bytes at d = 128
  // ordered with this epilogue, measured)
  const BatchIndex be = Is_dq_bulk ? batch_index_reread<kEntriesFirst>(nb2) : b;
  OutT* dk_b = dk + (Tr::kSplitD ? batch_off[1] : be.offset({dk_b0, dk_b1, dk_b2, dk_row}));
  OutT* dv_b = dv + (Tr::kSplitD ? batch_off[2] : be.offset({dv_b0, dv_b1, dv_b2, dv_row}));
  if constexpr (sizeof(OutT) == 2)
    epilogue_dk_dv_sm90<Tr, OutT, Tr::kConsumerThreads>(
        smem_raw, acc_dk, acc_dv, dk_b + static_cast<long long>(c0) * dk_row, dk_row,
        dv_b + static_cast<long long>(c0) * dv_row, dv_row, Lk - c0, D, Dv, scale, cwg * Tr::kWgKeys, col_k0, col_v0,
        tid - 128, consumer_sync);
  else
    store_dk_dv_sm90<OutT, Tr::kDkN, Tr::kDvN>(acc_dk, acc_dv, dk_b, dk_row, dv_b, dv_row, c0 + key_row, t, Lk, D,
                                              Dv, scale, col_k0, col_v0);
}
