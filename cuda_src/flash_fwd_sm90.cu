// flash_fwd_sm90.cu — FlashAttention forward on Hopper warpgroup MMA (wgmma, sm_90a), fp16 / bf16 in,
// fp32 accumulate (issue 13; docs/hopper.md).
//
// One thread block per (query tile Q_i, batch entry): kBlockM / 64 consumer warpgroups (128 threads
// each), warpgroup w owning query rows [64w, 64w + 64) of Q_i — one wgmma m64 row block — so its
// softmax statistics never leave the warpgroup (a row lives in the 4 lanes of one quad). Per key
// tile j:
//   S_ij = Q_i K_jᵀ  d/16 × wgmma.m64n{Bc}k16 .ss   (Q, K K-major in 128-byte-swizzled shared memory)
//   online softmax on the S accumulator fragments (exp2, scale·log2(e) folded into one fma)
//   P_ij → 16-bit register A fragments (the accumulator layout of n8 pairs is the A layout of k16)
//   O_i += P_ij V_j  Bc/16 × wgmma.m64n{dv}k16 .rs  (V MN-major: transposed B from shared memory)
// O_i is divided by l_i once at the end; LSE = (m_i + log2 l_i)·ln 2 (natural log, fp32); a row
// that sees no key ends with out 0, lse −inf (flash_softmax.cuh). Causal is bottom-right aligned
// (flash_mask.cuh); key tiles above the diagonal are never loaded, only the tiles crossing the
// diagonal or the sequence end are masked, and they run first (FlashAttention-2's order).
//
// Shared memory (all 1024-byte aligned pieces; the dynamic base is rounded up to 1024 bytes on the
// GPU, where it is a shared-window address; on the emulator it is offset 0 already):
//   sQ  Br × d            panels of 64 columns (128 bytes per row), row r of a panel at 128·r, its
//   sK  2 stages × Bc × d  16-byte chunk c stored at chunk c ^ (r mod 8): the canonical 128B-swizzle
//   sV  2 stages × Bc × dv layout (CuTe Swizzle<3,4,3>). Q and K are K-major operands (rows = M / N,
//       SBO = 1024 = 8 rows, the k16 step advances the start address by 32 bytes inside a panel);
//       V is the MN-major B operand of P V (rows = keys = K, each 64-column panel one LBO apart,
//       SBO = 1024 = 8 keys, the k16 step advances by 2048 bytes). One layout, one copy routine.
//   epilogue: sO Br × (dv + 8) (stmatrix from the accumulators, then 16-byte coalesced stores) and
//       the tile's Br LSE values, over the (then idle) Q / K / V space.
//
// Two kernels share the tiles, the wgmma helpers and the softmax:
//  * flash_fwd_sm90_kernel (cp.async; the fallback for layouts a tensor map cannot describe): every
//    thread copies 16-byte chunks with cp.async straight to their swizzled addresses (the emulator checks
//    that the bytes wgmma reads through its descriptors are the ones written), into a two-stage ring:
//    tile j−1 is fetched into the other stage while tile j is computed; the ring's completion is
//    cp.async.wait_group + fence.proxy.async (generic-proxy writes, async-proxy wgmma reads) + one
//    barrier per key tile.
//  * flash_fwd_sm90_ws_kernel (below; kernel="wgmma" takes it where the layout is TMA-legal): a producer
//    warpgroup issues TMA boxes completing on mbarriers, two (Br = 192: three) consumer warpgroups compute;
//    setmaxnreg moves registers from the producer to the consumers (FlashAttention-3's warp specialization).
//    The tensor maps are by-value __grid_constant__ CUtensorMap parameters encoded per call by the plan.
//    Is_tma_store (where the output is TMA-legal): O staged in the 128B-swizzled panels and written by TMA
//    stores of a fourth map (one thread per consumer warpgroup, after fence.proxy.async and a named barrier);
//    else the staged row stores. LSE one row per thread from the registers in both.
//
// The ws kernel ping-pongs its consumer warpgroups (named barriers: one's softmax under the others'
// GEMMs) and, by default (Is_overlap), overlaps each warpgroup's softmax of tile j with its own
// O += P_{j−1} V_{j−1} wgmmas (FlashAttention-3's intra-warpgroup overlap, wgmma_wait_group<1>); the
// cp.async kernel and the ws kernel without Is_overlap wait for every batch (wgmma_wait_group<0>).
//
// Arguments of flash_fwd_sm90_kernel: exactly flash_fwd_kernel's (flash_fwd.cu), so ForwardPlan lays them out as for the
// mma.sync forward; the GQA-packing, KV-cache and extension arguments are accepted and unused (the
// host takes this kernel only for dense calls).
#include "fa_port.cuh"
#include "flash_kernel_traits.cuh"
#include "flash_block_info.cuh"
#include "flash_mask.cuh"
#include "flash_softmax.cuh"
#include "flash_fwd_copy.cuh"
#include "flash_fwd_tiles.cuh"
#include "flash_ext.cuh"
#include "flash_fwd_sm90_softmax.cuh"  // Sm90KeyTiles, the online softmax on the accumulators
#include "flash_sm90_common.cuh"  // the 128B-swizzled layout, its copy routine, descriptors, wgmma wrappers,
                                   // gemm_qk_sm90, tma_load_tile, the ws register split

namespace flash {

template <typename T, int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN>
struct Sm90FwdTraits {
  static_assert(sizeof(T) == 2, "the wgmma forward takes 16-bit inputs");
  static_assert(kBlockM == 64 || kBlockM == 128 || kBlockM == 192,
                "one to three consumer warpgroups of 64 rows (three: the ws kernel only)");
  static_assert(kBlockN == 64 || kBlockN == 80 || kBlockN == 128 || kBlockN == 176 || kBlockN == 192 ||
                    kBlockN == 256,
                "Bc is the N of the S wgmma: 64, 80, 128, 176, 192 or 256 (wide key tiles: multiples of 16, the k of P V)");
  static_assert(kHeadDimV == 64 || kHeadDimV == 128 || kHeadDimV == 192 || kHeadDimV == 256,
                "dv is the N of the O wgmma: 64, 128, 192 or 256");
  static_assert(kHeadDim % 64 == 0 && kHeadDim <= 256, "d: whole 128-byte swizzle panels");
  static constexpr int kWarpgroups = kBlockM / 64;
  static constexpr int kNThreads = kWarpgroups * 128;
  static constexpr int kStages = 2;
  static constexpr int kRowBytes = 128;   // one swizzle panel row: 64 elements
  static constexpr int kAtomBytes = 1024; // 8 rows: SBO, and the swizzle pattern's repeat
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kKBytes = kBlockN * kHeadDim * 2;   // one stage
  static constexpr int kVBytes = kBlockN * kHeadDimV * 2;  // one stage
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kQBytes;
  static constexpr int kVOffset = kKOffset + kStages * kKBytes;
  static constexpr int kLoopBytes = kVOffset + kStages * kVBytes;
  static constexpr int kStrideO = kHeadDimV + 8;  // staged O rows: 16-byte rows, 8 rows on 8 bank groups
  static constexpr int kLseOffset = kBlockM * kStrideO * 2;
  static constexpr int kEpilogueBytes = kLseOffset + kBlockM * 4;
  // + the alignment slack of the GPU's dynamic shared memory base (cuda_forward_sm90.smem_bytes).
  static constexpr int kSmemBytes = (kLoopBytes > kEpilogueBytes ? kLoopBytes : kEpilogueBytes) + kAtomBytes;
};

// P_ij rounded to T as the A fragments of O += P V_j: the fragment of k16 step ks is the accumulator of
// S's n8 tiles 2ks, 2ks+1 (a0 row g cols 2t.., a1 row g+8, a2 / a3 the same of the second tile).
template <typename T, int kBlockN>
__device__ __forceinline__ void pack_p_sm90(uint32_t (&a_p)[kBlockN / 16][4], const float (&acc_s)[kBlockN / 2]) {
#pragma unroll
  for (int ks = 0; ks < kBlockN / 16; ++ks)
#pragma unroll
    for (int i = 0; i < 4; ++i) a_p[ks][i] = fa::pack2<T>(acc_s[8 * ks + 2 * i], acc_s[8 * ks + 2 * i + 1]);
}

// Issues O += P V_j as one committed batch, Bc/16 × wgmma .rs: V_j MN-major, keys 16ks.. at 2048·ks
// bytes, dv panels kBlockN·128 bytes apart (LBO). acc_o and a_p stay untouched until a wait covers it.
template <typename T, int kHeadDimV, int kBlockN>
__device__ __forceinline__ void issue_pv_sm90(float (&acc_o)[kHeadDimV / 2], const uint32_t (&a_p)[kBlockN / 16][4],
                                              const unsigned char* sV_j) {
  fa::wgmma_fence_operand(acc_o);
  fa::wgmma_fence();
  const uint64_t dv0 = sw128_desc(sV_j, kBlockN * 128);
#pragma unroll
  for (int ks = 0; ks < kBlockN / 16; ++ks)
    wgmma_rs<T, kHeadDimV, true>(acc_o, a_p[ks], fa::wgmma_desc_advance(dv0, ks * 2048), 1);
  fa::wgmma_commit_group();
}

// O += P V_j from the S accumulator holding P; waits for the result.
template <typename T, int kHeadDimV, int kBlockN>
__device__ __forceinline__ void gemm_pv_sm90(float (&acc_o)[kHeadDimV / 2], const float (&acc_s)[kBlockN / 2],
                                             const unsigned char* sV_j) {
  uint32_t a_p[kBlockN / 16][4];
  pack_p_sm90<T, kBlockN>(a_p, acc_s);
  issue_pv_sm90<T, kHeadDimV, kBlockN>(acc_o, a_p, sV_j);
  fa::wgmma_wait_group<0>();
  fa::wgmma_fence_operand(acc_o);
}

// O / l rounded to T by stmatrix.x4, one per 16 columns: matrices rows 0-7 / 8-15 of n8 tiles 2p, 2p+1 of the
// warp's 16 rows; lane l addresses row l mod 8 of matrix m = l / 8, i.e. row warp_row + 8(m mod 2) + l mod 8,
// 16-byte chunk 2p + m / 2. `at(row, chunk)`: that chunk's address in the staged tile.
template <typename T, int kHeadDimV, typename At>
__device__ __forceinline__ void stmatrix_o_sm90(const float (&acc_o)[kHeadDimV / 2], const float (&inv_l)[2],
                                                int warp_row, int lane, At at) {
  const int m = lane / 8;
  const int row = warp_row + 8 * (m % 2) + lane % 8;
#pragma unroll
  for (int p = 0; p < kHeadDimV / 16; ++p) {
    uint32_t regs[4];
    stmatrix_regs_sm90<T, kHeadDimV>(regs, acc_o, p, inv_l[0], inv_l[1]);
    fa::stmatrix<4, false>(at(row, 2 * p + m / 2), regs);
  }
}

// Epilogue, per thread: O / l into sO, rows of kStrideO elements, and the row's LSE (lane t = 0) into sLse
// (the cp.async kernel's). warp_row: the warp's first row in Q_i.
// Extensions: finish_rows_sm90<kExt> (rows past the entry's Lq_b, dropout's factor); m0: the tile's first row.
template <typename T, int kHeadDimV, int kStrideO, int kExt = 0>
__device__ __forceinline__ void stage_o_sm90(T* sO, float* sLse, const float (&acc_o)[kHeadDimV / 2],
                                             const OnlineSoftmaxRow<float> (&stat)[2], int warp_row, int lane,
                                             const ExtArgs<float>& ext, int m0, int Lq_b) {
  const int g = lane >> 2, t = lane & 3;
  float inv_l[2], lse[2];
  finish_rows_sm90<kExt>(inv_l, lse, stat, ext, m0 + warp_row + g, Lq_b);
#pragma unroll
  for (int r = 0; r < 2; ++r)
    if (t == 0) sLse[warp_row + g + 8 * r] = lse[r];
  stmatrix_o_sm90<T, kHeadDimV>(acc_o, inv_l, warp_row, lane,
                                [&](int row, int chunk) { return sO + row * kStrideO + 8 * chunk; });
}

template <typename T, int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN, bool Is_causal, bool Is_aligned,
          int kExt = 0>
__global__ void __launch_bounds__(kBlockM / 64 * 128, 1)
flash_fwd_sm90_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                      T* __restrict__ o, float* __restrict__ lse,
                      int Lq, int Lk, int D, int Dv, int nb2,
                      long long q_b0, long long q_b1, long long q_b2, long long q_row,
                      long long k_b0, long long k_b1, long long k_b2, long long k_row,
                      long long v_b0, long long v_b1, long long v_b2, long long v_row,
                      long long o_b0, long long o_b1, long long o_b2, long long o_row,
                      long long lse_b0, long long lse_b1, long long lse_b2,
                      float scale_log2, int rows_per_group, int causal_groups,
                      const int* __restrict__ seqlens_k, const int* __restrict__ block_table,
                      long long e_b0, long long e_b1, long long e_b2, long long table_row, int page_size,
                      long long k_page, long long v_page, FLASH_EXT_PARAMS(float)) {
  using Tr = Sm90FwdTraits<T, kHeadDim, kHeadDimV, kBlockM, kBlockN>;
  constexpr int kNThreads = Tr::kNThreads;
  (void)rows_per_group; (void)causal_groups; (void)seqlens_k; (void)block_table; (void)e_b0; (void)e_b1; (void)e_b2;
  (void)table_row; (void)page_size; (void)k_page; (void)v_page;

  FA_DYNAMIC_SMEM(smem_raw);
  // Swizzled tiles must start on the pattern's repeat in the shared window (GPU; offset 0 already on
  // the emulator). The shared address's bits 4-13 are read from a descriptor (bits 0-13: address >> 4),
  // the one shared-address query both branches of fa_port.cuh provide.
  const int misalign = static_cast<int>(fa::wgmma_desc(smem_raw, 0, 0, fa::kWgmmaSwizzleNone) & 0x3f) * 16;
  unsigned char* smem = smem_raw + (Tr::kAtomBytes - misalign) % Tr::kAtomBytes;
  unsigned char* sQ = smem + Tr::kQOffset;
  unsigned char* sK = smem + Tr::kKOffset;
  unsigned char* sV = smem + Tr::kVOffset;

  const int tid = static_cast<int>(threadIdx.x);
  // consumer warpgroup: rows [64 wg, 64 wg + 64) of Q_i; broadcast from lane 0 so that the compiler knows it is
  // warp-uniform (CUTLASS's canonical_warp_group_idx): sQ's descriptors then live in uniform registers
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);
  const int warp_row = wg * 64 + ((tid % 128) / 32) * 16;  // first of the warp's 16 rows
  const int lane = tid % 32;
  const int g = lane >> 2, t = lane & 3;
  const int m0 = query_tile<Is_causal>(static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x)) * kBlockM;

  const BatchIndex bidx = BatchIndex::from_grid(nb2);
  const TensorStrides q_s{q_b0, q_b1, q_b2, q_row}, k_s{k_b0, k_b1, k_b2, k_row};
  const TensorStrides v_s{v_b0, v_b1, v_b2, v_row}, o_s{o_b0, o_b1, o_b2, o_row};
  const TensorStrides lse_s{lse_b0, lse_b1, lse_b2, 1};
  const T* q_i = q + bidx.offset(q_s) + m0 * q_row;
  const T* k_base = k + bidx.offset(k_s);
  const T* v_base = v + bidx.offset(v_s);
  T* o_i = o + bidx.offset(o_s) + m0 * o_row;
  float* lse_i = lse + bidx.offset(lse_s) + m0;

  // Extensions: the entry's lengths (Lq stays the launch's for the stores), its mask and key tiles.
  const ExtArgs<float> ext = FLASH_EXT_ARGS(float);
  const int Lq_b = ext.seqlen_q<kExt>(bidx, Lq);
  const Mask<Is_causal, kExt> mask = make_mask<Is_causal, kExt>(Lq_b, ext.seqlen_k<kExt>(bidx, Lk), ext, bidx);
  const int n_block_max = mask.n_block_max(m0, kBlockM, kBlockN);
  const int n_block_unmasked = unmasked_key_tiles<Is_causal>(mask, m0, kBlockN, n_block_max);
  const Sm90KeyTiles<Is_causal, kExt> tiles{mask, m0, kBlockM, kBlockN, n_block_max, n_block_unmasked};
  const DropoutRng rng = ext.dropout(bidx);

  float acc_s[kBlockN / 2];     // S_ij, then P_ij, of the warpgroup's 64 rows (accumulator layout)
  float acc_o[kHeadDimV / 2];   // O_i, unnormalised
  OnlineSoftmaxRow<float> stat[2];
#pragma unroll
  for (int i = 0; i < kHeadDimV / 2; ++i) acc_o[i] = 0.0f;
#pragma unroll
  for (int i = 0; i < kBlockN / 2; ++i) acc_s[i] = 0.0f;
  stat[0].init();
  stat[1].init();

  auto load_kv = [&](bool full, int stage, int n_block) {
    const int n0 = n_block * kBlockN;
    const int rows = rows_in_tile(n0, kBlockN, Lk);
    load_sw128<T, kBlockN, kHeadDim, kNThreads, Is_aligned>(sK + stage * Tr::kKBytes, k_base + n0 * k_row, k_row,
                                                             rows, D, full, tid);
    load_sw128<T, kBlockN, kHeadDimV, kNThreads, Is_aligned>(sV + stage * Tr::kVBytes, v_base + n0 * v_row, v_row,
                                                              rows, Dv, full, tid);
  };

  // Key tiles from the last visible one down (the masked ones first); prologue: Q_i and that tile.
  int n_block = tiles.first();
  if (n_block >= tiles.lo()) {
    load_sw128<T, kBlockM, kHeadDim, kNThreads, Is_aligned>(sQ, q_i, q_row, rows_in_tile(m0, kBlockM, Lq), D,
                                                             false, tid);
    load_kv(false, 0, n_block);
    fa::cp_async_commit();
  }
  int stage = 0;
  for (; n_block >= tiles.lo(); n_block = tiles.prev(n_block)) {
    fa::cp_async_wait<0>();
    // The thread's copies (and element-wise stores) of tile j are visible to the async proxy that
    // wgmma reads through; the barrier makes every thread's so, and every warpgroup has finished
    // tile j+1 (its wgmmas were waited for), so the other stage may receive tile j−1.
    fa::fence_proxy_async();
    __syncthreads();
    const int next = tiles.prev(n_block);
    if (next >= tiles.lo()) load_kv(true, stage ^ 1, next);  // below the top tile every tile is full
    fa::cp_async_commit();

    gemm_qk_sm90<T, kHeadDim, kBlockM, kBlockN>(acc_s, sQ + wg * 64 * 128, sK + stage * Tr::kKBytes);
    softmax_sm90<Is_causal, kBlockN, kHeadDimV>(acc_s, acc_o, stat, mask, tiles.masked(n_block),
                                                m0 + warp_row + g, n_block * kBlockN, t, scale_log2);
    dropout_sm90<kExt, kBlockN>(acc_s, rng, m0 + warp_row + g, n_block * kBlockN, lane);
    gemm_pv_sm90<T, kHeadDimV, kBlockN>(acc_o, acc_s, sV + stage * Tr::kVBytes);
    stage ^= 1;
  }

  // Epilogue: no copy is in flight (the last tile prefetches nothing) and every wgmma has completed;
  // the barrier lets sO / sLse overwrite the operand tiles.
  T* sO = reinterpret_cast<T*>(smem);
  float* sLse = reinterpret_cast<float*>(smem + Tr::kLseOffset);
  fa::cp_async_wait<0>();
  __syncthreads();
  stage_o_sm90<T, kHeadDimV, Tr::kStrideO, kExt>(sO, sLse, acc_o, stat, warp_row, lane, ext, m0, Lq_b);
  __syncthreads();
  const int rows = rows_in_tile(m0, kBlockM, Lq);
  const bool vec = Dv % 8 == 0 && o_row % 8 == 0 && reinterpret_cast<unsigned long long>(o_i) % kCopyBytes == 0;
  store_tile<T, kBlockM, kHeadDimV, Tr::kStrideO, kNThreads>(o_i, o_row, sO, rows, Dv, vec, tid);
  for (int row = tid; row < rows; row += kNThreads) fa::gstore(lse_i + row, sLse[row]);
}

}  // namespace flash

namespace flash {

// ---- The warp-specialized variant: TMA loads completing on mbarriers (flash_fwd_sm90_ws_kernel) -----------
// Three warpgroups (four at Br = 192). Warpgroup 0 is the producer: after setmaxnreg.dec to kProducerRegs registers,
// one elected thread of its warp 0 issues every load as TMA boxes (cp.async.bulk.tensor.5d, the 128B swizzle
// done by the copy engine, rows past the sequence and columns past D zero-filled by it): Q_i once, then
// K_j and V_j into a ring of kStages stages, each completing on that stage's full barrier
// (arrive.expect_tx of the tile's bytes). Warpgroups 1, 2 (, 3) are the consumers of the cp.async kernel above
// (rows [64(w−1), 64w) of Q_i), raised to kConsumerRegs registers: wait on full_k[s] before S = Q K_jᵀ, on
// full_v[s] before O += P V_j, and arrive on empty_k[s] once their S batch (Is_overlap) or both batches
// have completed and on empty_v[s] (Is_overlap only; else the same barrier) once their P V_j wgmmas have,
// which is what lets the producer refill stage s. No block-wide barrier in the key loop and no copy
// instruction in the consumers.
//
// Tensor maps (flasharray/_private/cuda_forward_sm90.py): rank 5, innermost first (column, row, b2, b1,
// b0); box (64 columns = one 128-byte swizzle panel, rows of the tile, 1, 1, 1). A batch dim along which
// the tensor is broadcast (stride 0, which a tensor map cannot hold) is described with extent 1 and its
// bit in `bcast` (bit 3t + i: tensor t = q, k, v; i = b2, b1, b0) makes its coordinate 0.
template <typename T, int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN, bool Is_overlap, bool Is_persistent = false>
struct Sm90WsTraits : Sm90FwdTraits<T, kHeadDim, kHeadDimV, kBlockM, kBlockN> {
  using Base = Sm90FwdTraits<T, kHeadDim, kHeadDimV, kBlockM, kBlockN>;
  static_assert(kBlockM == 128 || kBlockM == 192, "the producer warpgroup feeds two or three consumer warpgroups");
  static constexpr int kConsumerWarpgroups = kBlockM / 64;
  static constexpr int kConsumerThreads = Base::kNThreads;
  static constexpr int kNThreads = 128 + kConsumerThreads;
  // Two consumers: 24 + 2 × 240 registers per thread-slot of a warpgroup, 64,512 of the SM's 65,536; three
  // (Br = 192, cuda_forward_sm90.THREE_WARPGROUPS): 32 + 3 × 160 = all of them (FlashAttention-3's splits).
  static constexpr int kProducerRegs = kConsumerWarpgroups == 2 ? kWsProducerRegs : 32;
  static constexpr int kConsumerRegs = kConsumerWarpgroups == 2 ? kWsConsumerRegs : 160;
  static_assert((kProducerRegs + kConsumerWarpgroups * kConsumerRegs) * 128 <= 65536,
                "the register file holds every warpgroup");
  static_assert(kBlockM <= 256 && kBlockN <= 256, "a TMA box has at most 256 rows");
  static constexpr int kBlockM_ = kBlockM, kBlockN_ = kBlockN;
  // mbarriers: Q, then full_k, full_v, empty_k per stage and, overlapped, empty_v per stage (K_j is released
  // when its S batch completes, V_j a step later); persistent: empty_q (sQ free for the next tile's Q) and, with
  // sO over the V ring (kOOverV), empty_o (the epilogue done with sO: the next tile's V may land).
  static constexpr int kBarsBase = 1 + (Is_overlap ? 4 : 3) * Base::kStages + (Is_persistent ? 1 : 0);
  // The O staging region: the row stores' padded rows (the TMA store's swizzled panels, Br·dv·2 bytes, fit).
  static constexpr int kOBytes = kBlockM * Base::kStrideO * 2;
  static constexpr int kSmemLimit = 227 * 1024;
  // Persistent: sO in its own region past the K / V ring where it fits (the next tile's Q may land while
  // the epilogue runs); else over the V ring where it holds sO (kOOverV: the wide key tiles at d 128 / 256,
  // FlashAttention-3's aliasing of O with V): the producer issues a tile's first V only once the previous tile's
  // epilogue is done with sO (empty_o), while the next tile's Q and first K land during the epilogue; else over
  // sQ, grown downwards by kOPad bytes so that it covers nothing of the ring (the producer keeps streaming K / V
  // during the epilogue; Q waits for it). Not persistent: sO over the (then idle) Q / K / V space from offset 0.
  static constexpr bool kSeparateO = Is_persistent &&
                                     Base::kLoopBytes + kOBytes + kBarsBase * 8 + Base::kAtomBytes <= kSmemLimit;
  static constexpr bool kOOverV = Is_persistent && !kSeparateO && kOBytes <= Base::kStages * Base::kVBytes;
  static constexpr bool kOOverQ = Is_persistent && !kSeparateO && !kOOverV;
  static constexpr int kBars = kBarsBase + (kOOverV ? 1 : 0);
  static constexpr int kOPad = kOOverQ && kOBytes > Base::kQBytes ? (kOBytes - Base::kQBytes + 1023) / 1024 * 1024 : 0;
  static constexpr int kQOffset = kOPad;
  static constexpr int kKOffset = kOPad + Base::kKOffset;
  static constexpr int kVOffset = kOPad + Base::kVOffset;
  static constexpr int kOOffset = kSeparateO ? Base::kLoopBytes : 0;
  static constexpr int kBarOffset = Is_persistent ? kOPad + Base::kLoopBytes + (kSeparateO ? kOBytes : 0)
                                                  : ((Base::kLoopBytes > Base::kEpilogueBytes ? Base::kLoopBytes
                                                                                              : Base::kEpilogueBytes) + 7) / 8 * 8;
  static constexpr int kSmemBytes = kBarOffset + kBars * 8 + Base::kAtomBytes;
  static_assert(kSmemBytes <= kSmemLimit, "shared memory");
  static_assert(!kOOverQ || kOBytes <= kOPad + Base::kQBytes, "aliased sO covers sQ only");
  static constexpr int kConsumerBarrier = 1;   // named barrier of the 256 / 384 consumer threads (epilogue)
  // Ping-pong (FlashAttention-3 §3.1): consumer warpgroup c issues its S wgmmas (overlapped: its S and
  // P V wgmmas) only in its turn, named barrier kTurnBarrier + c (its 128 threads sync, the 128 of the
  // warpgroup before it in the round, c − 1 mod kConsumerWarpgroups, arrive), and hands the turn to the next
  // one as soon as they are issued, so one warpgroup's softmax runs under the others' GEMMs (three warpgroups:
  // each softmax under two warpgroups' GEMMs, two warps per scheduler in their softmax at a time).
  static constexpr bool kPingPong = true;
  static constexpr int kTurnBarrier = 2;       // ids 2, 3 (and 4): warpgroup 0's, 1's (and 2's) turn
  static constexpr int kTurnThreads = 2 * 128;
  // Is_tma_store: consumer warpgroup c's 128 threads sync on named barrier kStoreBarrier + c once its 64 rows
  // of O are staged (the 128B-swizzled panels one TMA box each reads), then one of them stores them.
  static constexpr int kStoreBarrier = kTurnBarrier + kConsumerWarpgroups;   // ids 4, 5 (three: 5, 6, 7)
  static_assert(kStoreBarrier + kConsumerWarpgroups <= 16, "16 named barriers");
  static_assert(kHeadDimV * 2 * kBlockM <= Base::kLseOffset, "the swizzled sO fits the padded one's space");
};

// The ws kernel's shared memory: operand tiles, O's staging region and the mbarriers.
struct Sm90WsSmem {
  unsigned char* sQ;
  unsigned char* sK;
  unsigned char* sV;
  unsigned char* sO;
  uint64_t* bar_q;    // Q_i landed (one phase per tile)
  uint64_t* full_k;   // [kStages]: K_j landed (the producer's expect_tx + the TMA bytes)
  uint64_t* full_v;   // [kStages]: V_j landed
  uint64_t* empty_k;  // [kStages]: every consumer thread is done with K_j (not overlapped: with the stage)
  uint64_t* empty_v;  // [kStages]: ... done with V_j (not overlapped: empty_k)
  uint64_t* empty_q;  // persistent: every consumer thread is done with sQ (and, aliased over it, with sO)
  uint64_t* empty_o;  // sO over the V ring (kOOverV): every consumer thread is done with the tile's sO
};

template <typename Tr, bool Is_overlap>
__device__ __forceinline__ Sm90WsSmem ws_smem_layout(unsigned char* smem) {
  Sm90WsSmem s;
  s.sQ = smem + Tr::kQOffset;
  s.sK = smem + Tr::kKOffset;
  s.sV = smem + Tr::kVOffset;
  s.sO = smem + Tr::kOOffset;
  s.bar_q = reinterpret_cast<uint64_t*>(smem + Tr::kBarOffset);
  s.full_k = s.bar_q + 1;
  s.full_v = s.full_k + Tr::kStages;
  s.empty_k = s.full_v + Tr::kStages;
  s.empty_v = Is_overlap ? s.empty_k + Tr::kStages : s.empty_k;
  s.empty_q = s.empty_v + Tr::kStages;
  s.empty_o = s.empty_q + 1;
  return s;
}

// Work tiles: (query tile m_block, batch entry). Not persistent: one per block, blockIdx.x (causal: longest
// first, query_tile) and the grid's y / z. Persistent (static scheduler): the block's k-th tile is w = blockIdx.x +
// k·gridDim.x (k = 0, 1, ...) of a linear order of n_m query tiles × n_bh batch entries (paired: below):
// * not causal: batch entry outer, query tile inner (neighbouring blocks share one entry's K and V);
// * causal, group == 0: longest first — query tiles from the last one down (bottom-right alignment: the last
//   sees the most keys), all batch entries of one query tile together (FlashAttention-3's load balance);
// * causal, group > 0 (kPairs: dense calls — with every extension the producer's walk spilled 16 bytes at its 24
//   registers —, where the host finds every block two tiles or more: cuda_forward_sm90.causal_group):
//   **paired tiles in L2 groups**. Query tiles m and n_m − 1 − m of one entry see n_m + 1 key tiles together
//   (bottom-right: m + 1 and n_m − m), so the pairs cost alike and the blocks take whole pairs round-robin
//   (the block's tiles k = 2j, 2j + 1 are pair blockIdx.x + j·gridDim.x, its long tile first; w counts the
//   tiles of the paired order: pair u holds w = 2u, 2u + 1). Pairs are
//   ordered by group of `group` entries (the host sizes it so that the group's K and V fit in L2), pair index,
//   then entry: the blocks running at once read the K / V of about two groups, where longest-first order had
//   them read gridDim.x different entries'. An odd n_m leaves each entry's middle tile, paired across
//   entries after all pairs (the last unit can hold one tile). decode() is mirrored by causal_pair_tile.
template <bool Is_causal, bool Is_persistent, bool kPairs = false>
struct Sm90WsScheduler {
  int n_m, n_bh, nb12, nb2, group;
  __device__ __forceinline__ bool is_paired() const { return kPairs && Is_causal && Is_persistent && group > 0; }
  // w: the block's first tile (paired: its position in the paired order, pair blockIdx.x's long tile)
  __device__ __forceinline__ int first() const { return static_cast<int>(blockIdx.x) << (is_paired() ? 1 : 0); }
  // the block's tile after w, its k-th (paired: from the long tile of a pair to the short one, then to the long
  // tile of the pair gridDim.x further)
  __device__ __forceinline__ int next(int w, int k) const {
    if (is_paired()) return k & 1 ? w + 2 * static_cast<int>(gridDim.x) - 1 : w + 1;
    return w + (Is_persistent ? static_cast<int>(gridDim.x) : n_bh);
  }
  __device__ __forceinline__ bool valid(int w) const {
    if constexpr (!Is_persistent) return w == first();
    return w < n_m * n_bh;
  }
  __device__ __forceinline__ void decode(int w, int& m_block, BatchIndex& b) const {
    if constexpr (!Is_persistent) {
      m_block = query_tile<Is_causal>(w, n_m);
      b = BatchIndex::from_grid(nb2);
      return;
    }
    int bh;
    if (is_paired()) {
      const int pairs = n_m >> 1, u = w >> 1;
      if (u < pairs * n_bh) {   // pair p of entry bh: tiles n_m − 1 − p, then p
        const int g = u / (pairs * group), e0 = g * group, in_g = min(group, n_bh - e0), r = u - g * pairs * group;
        const int p = r / in_g;
        bh = e0 + r - p * in_g;
        m_block = w & 1 ? p : n_m - 1 - p;
      } else {                  // the middle tiles of an odd n_m
        bh = w - 2 * pairs * n_bh;
        m_block = pairs;
      }
    } else if (Is_causal) {
      m_block = n_m - 1 - w / n_bh;
      bh = w % n_bh;
    } else {
      bh = w / n_m;
      m_block = w % n_m;
    }
    b.b0 = bh / nb12;
    b.b1 = bh % nb12 / nb2;
    b.b2 = bh % nb2;
  }
};

// The producer's loads of one work tile (one elected thread): Q_i onto bar_q and, per key tile in the
// consumers' order (last visible first), K_j and V_j into stage v mod kStages of the ring, v the block's
// running visit count (never reset: stages and parities continue across tiles). Visit v waits for the
// (v / kStages)-th phase of its stage's empty barriers (parity ((v / kStages) & 1) ^ 1, which a fresh barrier
// passes at once). Persistent: Q of the block's k-th tile after empty_q's phase k − 1 (the consumers are done
// with sQ), issued after the first K (FlashAttention-3's order: the ring keeps streaming), and always (a tile
// without visible keys too: one bar_q phase per tile).
// Extensions: the tiles of the consumers' walk (Sm90KeyTiles over the same mask geometry).
template <typename Tr, bool Is_overlap, bool Is_persistent, int kHeadDim, int kHeadDimV, bool Is_causal, int kExt>
__device__ __forceinline__ void ws_load_tile(const Sm90WsSmem& sm, const CUtensorMap* tq, const CUtensorMap* tk,
                                             const CUtensorMap* tv, int m0, const BatchIndex& bidx, int bcast,
                                             const Sm90KeyTiles<Is_causal, kExt>& tiles, int k_tile, int& visit) {
  constexpr int kStages = Tr::kStages, kBlockM = Tr::kBlockM_, kBlockN = Tr::kBlockN_;
  auto coord = [&](int t, int i, int b) { return (bcast >> (3 * t + i)) & 1 ? 0 : b; };
  const int kb2 = coord(1, 0, bidx.b2), kb1 = coord(1, 1, bidx.b1), kb0 = coord(1, 2, bidx.b0);
  const int vb2 = coord(2, 0, bidx.b2), vb1 = coord(2, 1, bidx.b1), vb0 = coord(2, 2, bidx.b0);
  bool q_pending = Is_persistent || tiles.any();
  auto load_q = [&] {
    if (Is_persistent && k_tile > 0) fa::mbarrier_wait_parity(sm.empty_q, (k_tile - 1) & 1);
    fa::mbarrier_arrive_expect_tx(sm.bar_q, Tr::kQBytes);
    tma_load_tile<kBlockM, kHeadDim>(sm.sQ, tq, m0, coord(0, 0, bidx.b2), coord(0, 1, bidx.b1), coord(0, 2, bidx.b0),
                                     sm.bar_q);
    q_pending = false;
  };
  if (!Is_persistent && q_pending) load_q();
  for (int n_block = tiles.first(); n_block >= tiles.lo(); n_block = tiles.prev(n_block), ++visit) {
    const int s = visit % kStages, phase = (visit / kStages) & 1;
    fa::mbarrier_wait_parity(sm.empty_k + s, phase ^ 1);
    fa::mbarrier_arrive_expect_tx(sm.full_k + s, Tr::kKBytes);
    tma_load_tile<kBlockN, kHeadDim>(sm.sK + s * Tr::kKBytes, tk, n_block * kBlockN, kb2, kb1, kb0, sm.full_k + s);
    if (Is_persistent && q_pending) load_q();
    if (Is_overlap) fa::mbarrier_wait_parity(sm.empty_v + s, phase ^ 1);
    if (Tr::kOOverV && k_tile > 0 && n_block == tiles.first())   // the previous tile's sO lies over the V ring
      fa::mbarrier_wait_parity(sm.empty_o, (k_tile - 1) & 1);
    fa::mbarrier_arrive_expect_tx(sm.full_v + s, Tr::kVBytes);
    tma_load_tile<kBlockN, kHeadDimV>(sm.sV + s * Tr::kVBytes, tv, n_block * kBlockN, vb2, vb1, vb0, sm.full_v + s);
  }
  if (Is_persistent && q_pending) load_q();
}

// The consumer warpgroups of the ws kernel: per work tile the key loop (with or without the
// intra-warpgroup overlap), the ping-pong turns, the epilogue.
template <typename T, int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN, bool Is_causal, bool Is_overlap,
          bool Is_persistent, int kExt>
struct Sm90WsConsumer {
  using Tr = Sm90WsTraits<T, kHeadDim, kHeadDimV, kBlockM, kBlockN, Is_overlap, Is_persistent>;
  using Tiles = Sm90KeyTiles<Is_causal, kExt>;
  static constexpr int kStages = Tr::kStages;
  Sm90WsSmem sm;
  Mask<Is_causal, kExt> mask;   // dense: the launch's; extensions: the current tile's entry (tile())
  ExtArgs<float> ext;
  DropoutRng rng;               // the current tile's entry (kExtDropout)
  int Lq, Lk;                   // the launch's lengths (rows stored: Lq)
  int cwg, ctid, warp_row, lane, g, t;
  float scale_log2;

  __device__ __forceinline__ Sm90WsConsumer(const Sm90WsSmem& sm_, int Lq_, int Lk_, int tid, float scale_log2_,
                                            const ExtArgs<float>& ext_)
      // cwg broadcast from lane 0: warp-uniform to the compiler, so sQ's descriptors live in uniform registers
      : sm(sm_), mask(Lq_, Lk_), ext(ext_), Lq(Lq_), Lk(Lk_), cwg(__shfl_sync(0xffffffffu, tid / 128 - 1, 0)),
        ctid(tid - 128),
        warp_row(cwg * 64 + ((ctid % 128) / 32) * 16), lane(tid % 32), g(lane >> 2), t(lane & 3),
        scale_log2(scale_log2_) {}

  // Ping-pong, round robin: warpgroup 0 has the first turn of a tile (the last warpgroup's opening arrival),
  // then 1 (, 2), 0, ...; each warpgroup takes n turns and hands over n times except the last warpgroup's last,
  // so every turn barrier sees n complete phases per tile (the epilogue's barrier keeps the warpgroups in the
  // same tile).
  static constexpr int kLastWg = Tr::kConsumerWarpgroups - 1;
  __device__ __forceinline__ void open_turns(const Tiles& tiles) const {
    if (Tr::kPingPong && cwg == kLastWg && tiles.any()) fa::named_barrier_arrive(Tr::kTurnBarrier, Tr::kTurnThreads);
  }
  __device__ __forceinline__ void our_turn() const {
    if (Tr::kPingPong) fa::named_barrier_sync(Tr::kTurnBarrier + cwg, Tr::kTurnThreads);
  }
  // more: a key tile of this work tile follows the current one (Sm90KeyTiles::more).
  __device__ __forceinline__ void their_turn(bool more) const {
    if (Tr::kPingPong && (cwg != kLastWg || more))
      fa::named_barrier_arrive(Tr::kTurnBarrier + (cwg == kLastWg ? 0 : cwg + 1), Tr::kTurnThreads);
  }

  // Key loop without the overlap: every wgmma batch waited for; visit v = visit0 + i in stage v mod kStages.
  // Returns the visits made (the tile's key tiles).
  __device__ __forceinline__ int mainloop_plain(float (&acc_o)[kHeadDimV / 2], OnlineSoftmaxRow<float> (&stat)[2],
                                                int m0, const Tiles& tiles, int visit0) {
    float acc_s[kBlockN / 2];
#pragma unroll
    for (int i = 0; i < kBlockN / 2; ++i) acc_s[i] = 0.0f;
    int v = visit0;
    tiles.for_each([&](int n_block, int next, bool masked) {
      const int s = v % kStages, phase = (v / kStages) & 1;
      fa::mbarrier_wait_parity(sm.full_k + s, phase);   // K_j has landed (TMA: async proxy, as wgmma's reads)
      our_turn();
      gemm_qk_sm90<T, kHeadDim, kBlockM, kBlockN>(acc_s, sm.sQ + cwg * 64 * 128, sm.sK + s * Tr::kKBytes,
                                                  [&] { their_turn(next >= tiles.lo()); });  // issued: hand over
      softmax_sm90<Is_causal, kBlockN, kHeadDimV>(acc_s, acc_o, stat, mask, masked, m0 + warp_row + g,
                                                  n_block * kBlockN, t, scale_log2);
      dropout_sm90<kExt, kBlockN>(acc_s, rng, m0 + warp_row + g, n_block * kBlockN, lane);
      fa::mbarrier_wait_parity(sm.full_v + s, phase);   // V_j has landed
      gemm_pv_sm90<T, kHeadDimV, kBlockN>(acc_o, acc_s, sm.sV + s * Tr::kVBytes);
      fa::mbarrier_arrive(sm.empty_k + s);              // both wgmma batches on stage s completed: refill it
      ++v;
    });
    release_q_early();
    return v - visit0;
  }

  // sO not over sQ (persistent): sQ is free once the tile's last S batch has completed.
  __device__ __forceinline__ void release_q_early() const {
    if (Is_persistent && !Tr::kOOverQ) fa::mbarrier_arrive(sm.empty_q);
  }

  __device__ __forceinline__ int mainloop_overlap(float (&acc_o)[kHeadDimV / 2], OnlineSoftmaxRow<float> (&stat)[2],
                                                  int m0, const Tiles& tiles, int visit0);

  template <bool Is_tma_store>
  __device__ __forceinline__ void epilogue(const float (&acc_o)[kHeadDimV / 2], const OnlineSoftmaxRow<float> (&stat)[2],
                                           int m0, const BatchIndex& bidx, T* o, float* lse, int Dv,
                                           const TensorStrides& o_s, const TensorStrides& lse_s,
                                           const CUtensorMap* tmap_o, unsigned char* sO_base) const;

  // One work tile: Q_i waited for (its bar_q phase k_tile), the key loop, the epilogue; visit advanced by
  // the tile's key tiles. Aliased sO (persistent): sQ released after the epilogue.
  template <bool Is_tma_store>
  __device__ __forceinline__ void tile(int m_block, const BatchIndex& bidx, int k_tile, int& visit, T* o, float* lse,
                                       int Dv, const TensorStrides& o_s, const TensorStrides& lse_s,
                                       const CUtensorMap* tmap_o) {
    const int m0 = m_block * kBlockM;
    if constexpr (kExt != 0) {   // the entry's lengths, mask and generator
      mask = make_mask<Is_causal, kExt>(ext.seqlen_q<kExt>(bidx, Lq), ext.seqlen_k<kExt>(bidx, Lk), ext, bidx);
      rng = ext.dropout(bidx);
    }
    const int n_block_max = mask.n_block_max(m0, kBlockM, kBlockN);
    const Tiles tiles(mask, m0, kBlockM, kBlockN, n_block_max, unmasked_key_tiles<Is_causal>(mask, m0, kBlockN,
                                                                                            n_block_max));
    float acc_o[kHeadDimV / 2];   // O_i, unnormalised
    OnlineSoftmaxRow<float> stat[2];
#pragma unroll
    for (int i = 0; i < kHeadDimV / 2; ++i) acc_o[i] = 0.0f;
    stat[0].init();
    stat[1].init();
    if (Is_persistent || tiles.any()) fa::mbarrier_wait_parity(sm.bar_q, k_tile & 1);
    open_turns(tiles);
    int visits = 0;
    if constexpr (Is_overlap) {
      if (tiles.any()) visits = mainloop_overlap(acc_o, stat, m0, tiles, visit);
      else release_q_early();
    } else {
      visits = mainloop_plain(acc_o, stat, m0, tiles, visit);
    }
    visit += kExt == 0 ? n_block_max : visits;   // dense: every tile below n_block_max
    epilogue<Is_tma_store>(acc_o, stat, m0, bidx, o, lse, Dv, o_s, lse_s, tmap_o, Tr::kOOverV ? sm.sV : sm.sO);
    if (Tr::kOOverV || Tr::kOOverQ)
      fa::fence_proxy_async();   // the staged O's generic accesses before the async-proxy writes of the next loads
    if (Tr::kOOverV) fa::mbarrier_arrive(sm.empty_o);   // the next tile's first V may land on sO
    if (Tr::kOOverQ) fa::mbarrier_arrive(sm.empty_q);
  }
};

// Intra-warpgroup overlap (FlashAttention-3 §3.2): visit i issues S_i = Q K_iᵀ, then O += P_{i−1} V_{i−1}
// (both in the warpgroup's turn), waits for S_i only (wait_group 1) and runs its softmax while the P V
// batch is in flight. The wait for that batch (wait_group 0), O's rescale by visit i's factor and the
// packing of P_i come at the top of visit i + 1, after its wait for K_{i+1}: that mbarrier spin is a
// branch, and ptxas, which schedules a wait_group freely inside a basic block (it hoisted it above the
// softmax there: docs/hopper.md), keeps it below. Per row the arithmetic is the plain loop's,
// O ← O·c_i + P_i V_i in the same fp32 operations and order. The softmax must not touch O
// (softmax_tile_sm90<..., true>) nor P_{i−1}'s A fragments (a_p) before the wait. Visit i of the tile is
// the block's visit visit0 + i (stage and parity).
template <typename T, int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN, bool Is_causal, bool Is_overlap,
          bool Is_persistent, int kExt>
__device__ __forceinline__ int Sm90WsConsumer<T, kHeadDim, kHeadDimV, kBlockM, kBlockN, Is_causal, Is_overlap,
                                               Is_persistent, kExt>::mainloop_overlap(float (&acc_o)[kHeadDimV / 2],
                                                                                OnlineSoftmaxRow<float> (&stat)[2],
                                                                                int m0, const Tiles& tiles, int visit0) {
  float acc_s[kBlockN / 2];        // S_ij, then P_ij, of the warpgroup's 64 rows (accumulator layout)
  uint32_t a_p[kBlockN / 16][4];   // P_{i−1}: the A fragments of the P V batch in flight
  float correction[2];             // visit i's factor for O, applied once P_{i−1} V_{i−1} has completed
  const int row0 = m0 + warp_row + g;
  auto stage = [&](int i) { return (visit0 + i) % kStages; };
  auto parity = [&](int i) { return ((visit0 + i) / kStages) & 1; };
  // visit 0: S_0 and its softmax, nothing else in flight
  const int first = tiles.first();
  fa::mbarrier_wait_parity(sm.full_k + stage(0), parity(0));
  our_turn();
  gemm_qk_sm90<T, kHeadDim, kBlockM, kBlockN>(acc_s, sm.sQ + cwg * 64 * 128, sm.sK + stage(0) * Tr::kKBytes,
                                              [&] { their_turn(tiles.more(first)); });
  fa::mbarrier_arrive(sm.empty_k + stage(0));     // S_0 completed: K_0's stage may be refilled
  softmax_tile_sm90<Is_causal, kBlockN, kHeadDimV, true>(acc_s, acc_o, stat, correction, mask, tiles.masked(first),
                                                         row0, first * kBlockN, t, scale_log2);
  dropout_sm90<kExt, kBlockN>(acc_s, rng, row0, first * kBlockN, lane);
  // P_{i−1} V_{i−1} completed (visit i − 2's stage free for V), O rescaled by c_{i−1}, P_{i−1} packed
  auto finish_previous = [&](int i) {
    fa::wgmma_wait_group<0>();
    fa::wgmma_fence_operand(acc_o);
    if (i >= 2) fa::mbarrier_arrive(sm.empty_v + stage(i - 2));
    rescale_o_sm90<kHeadDimV>(acc_o, correction);
    pack_p_sm90<T, kBlockN>(a_p, acc_s);
  };
  // Visit i ≥ 1 of key tile n_block in stage s (visit i − 1 used stage sp).
  auto visit = [&](int n_block, int i, bool masked) {
    const int s = stage(i), sp = stage(i - 1), phase_p = parity(i - 1);
    fa::mbarrier_wait_parity(sm.full_k + s, parity(i));
    finish_previous(i);
    our_turn();
    auto issue_pv = [&] {  // after S_i's batch, in our turn: O += P_{i−1} V_{i−1}; then hand over
      fa::mbarrier_wait_parity(sm.full_v + sp, phase_p);
      issue_pv_sm90<T, kHeadDimV, kBlockN>(acc_o, a_p, sm.sV + sp * Tr::kVBytes);
      their_turn(tiles.more(n_block));
    };
    // waits for all but the last committed batch: S_i has completed, P_{i−1} V_{i−1} may be in flight
    gemm_qk_sm90<T, kHeadDim, kBlockM, kBlockN, decltype(issue_pv), 1>(acc_s, sm.sQ + cwg * 64 * 128,
                                                                       sm.sK + s * Tr::kKBytes, issue_pv);
    fa::mbarrier_arrive(sm.empty_k + s);
    softmax_tile_sm90<Is_causal, kBlockN, kHeadDimV, true>(acc_s, acc_o, stat, correction, mask, masked, row0,
                                                           n_block * kBlockN, t, scale_log2);
    dropout_sm90<kExt, kBlockN>(acc_s, rng, row0, n_block * kBlockN, lane);
  };
  int n_block = tiles.prev(first), i = 1;
  if constexpr (kExt == 0) {
    // Masked tiles (first in the order) and unmasked ones run as two copies of the loop (the outer loop is
    // unrolled), so `masked` is a compile-time constant in each and no branch splits the softmax.
#pragma unroll
    for (int masked = 1; masked >= 0; --masked)
      for (; n_block >= (masked ? tiles.n_block_unmasked : 0); --n_block, ++i) visit(n_block, i, masked != 0);
  } else {
    // Extensions: masked tiles anywhere in the walk (window edges, mixed block-mask tiles): one loop, the
    // mask a run-time branch.
    for (; n_block >= tiles.lo(); n_block = tiles.prev(n_block), ++i) visit(n_block, i, tiles.masked(n_block));
  }
  release_q_early();   // every S batch of the tile has completed
  // the last P V (visit i − 1's)
  finish_previous(i);
  const int sp = stage(i - 1);
  fa::mbarrier_wait_parity(sm.full_v + sp, parity(i - 1));
  issue_pv_sm90<T, kHeadDimV, kBlockN>(acc_o, a_p, sm.sV + sp * Tr::kVBytes);
  fa::wgmma_wait_group<0>();
  fa::wgmma_fence_operand(acc_o);
  fa::mbarrier_arrive(sm.empty_v + sp);
  return i;
}

// Epilogue (consumers only): every load of the tile has landed (each was waited for) and every wgmma
// completed; the named barrier lets sO overwrite the operand tiles once both warpgroups are past their last
// tile (persistent: and the previous tile's TMA store has read sO: its thread waited before arriving). The
// LSE: one row per thread (lanes t = 0, 1 of each quad: rows g, g + 8), straight to global memory.
template <typename T, int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN, bool Is_causal, bool Is_overlap,
          bool Is_persistent, int kExt>
template <bool Is_tma_store>
__device__ __forceinline__ void Sm90WsConsumer<T, kHeadDim, kHeadDimV, kBlockM, kBlockN, Is_causal, Is_overlap,
                                               Is_persistent, kExt>::epilogue(const float (&acc_o)[kHeadDimV / 2],
                                                                        const OnlineSoftmaxRow<float> (&stat)[2],
                                                                        int m0, const BatchIndex& bidx, T* o,
                                                                        float* lse, int Dv, const TensorStrides& o_s,
                                                                        const TensorStrides& lse_s,
                                                                        const CUtensorMap* tmap_o,
                                                                        unsigned char* sO_base) const {
  const int rows = rows_in_tile(m0, kBlockM, kExt == 0 ? mask.Lq : Lq);   // extensions: mask.Lq is the entry's
  // The thread's coordinates (the members' values, shadowed here), derived again in the persistent kernel from an
  // opaque copy of its consumer index: its epilogue runs once per work tile, and what ptxas derives from the
  // members would otherwise be hoisted out of the tile loop and held through the key loop (register spills).
  const int ctid = Is_persistent ? opaque_int(this->ctid) : this->ctid;
  const int lane = ctid % 32, g = lane >> 2, t = lane & 3, cwg = ctid / 128;
  const int warp_row = cwg * 64 + ((ctid % 128) / 32) * 16;
  fa::named_barrier_sync(Tr::kConsumerBarrier, Tr::kConsumerThreads);
  float inv_l[2], lse_r[2];
  finish_rows_sm90<kExt>(inv_l, lse_r, stat, ext, m0 + warp_row + g, mask.Lq);
  if (t < 2 && warp_row + g + 8 * t < rows)
    fa::gstore(lse + bidx.offset(lse_s) + m0 + warp_row + g + 8 * t, t == 0 ? lse_r[0] : lse_r[1]);
  if constexpr (Is_tma_store) {
    // O / l into 128B-swizzled panels of 64 columns (chunk c of row r at c ^ (r mod 8): the layout a box of
    // tmap_o reads), made visible to the async proxy, then one thread per warpgroup stores its 64 rows as
    // dv / 64 boxes (rows past Lq and columns past Dv are clipped by the copy engine) and waits until they
    // have read shared memory (before the block exits and releases it, or the next tile overwrites it).
    unsigned char* sO = sO_base;
    stmatrix_o_sm90<T, kHeadDimV>(acc_o, inv_l, warp_row, lane,
                                  [&](int row, int chunk) { return sO + sw128_offset<kBlockM>(row, chunk); });
    fa::fence_proxy_async();
    fa::named_barrier_sync(Tr::kStoreBarrier + cwg, 128);
    if (ctid % 128 == 0 && 64 * cwg < rows) {
      tma_store_tile<kBlockM, kHeadDimV>(tmap_o, sO + cwg * 64 * 128, m0 + 64 * cwg, bidx.b2, bidx.b1, bidx.b0);
      fa::tma_store_commit();
      fa::tma_store_wait<0>();
    }
  } else {
    (void)tmap_o;  // the host passes q's map: this instantiation stores rows
    T* o_i = o + bidx.offset(o_s) + m0 * o_s.row;
    T* sO = reinterpret_cast<T*>(sO_base);
    stmatrix_o_sm90<T, kHeadDimV>(acc_o, inv_l, warp_row, lane,
                                  [&](int row, int chunk) { return sO + row * Tr::kStrideO + 8 * chunk; });
    fa::named_barrier_sync(Tr::kConsumerBarrier, Tr::kConsumerThreads);
    const bool vec = Dv % 8 == 0 && o_s.row % 8 == 0 && reinterpret_cast<unsigned long long>(o_i) % kCopyBytes == 0;
    store_tile<T, kBlockM, kHeadDimV, Tr::kStrideO, Tr::kConsumerThreads>(o_i, o_s.row, sO, rows, Dv, vec, ctid);
  }
}

// Is_persistent (cuda_forward_sm90.PERSISTENT): a grid of min(work tiles, SMs) blocks, each walking the
// static scheduler's tiles (Sm90WsScheduler): the producer and the consumers walk the same sequence, the
// K / V ring's visits counted across tiles, one bar_q and (persistent) one empty_q phase per tile. nb12 =
// nb1·nb2 and n_bh = nb0·nb1·nb2 (the batch entries; unused unless persistent); group: the causal scheduler's
// entries per L2 group (0: longest first; unused unless causal and persistent).
//
// kExt (the extensions of docs/extensions.md, flash_ext.cuh; 0 by default: the dense instantiations keep their
// names and code): the FLASH_EXT_PARAMS tail after the maps. Per work tile the consumers build the entry's
// mask (lengths, window, block mask, softcap, ALiBi) and dropout generator; the producer walks the same key
// tiles from the geometry bits alone (kWalkExt: window, block mask, lengths).
template <typename T, int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN, bool Is_causal, bool Is_overlap,
          bool Is_tma_store = false, bool Is_persistent = false, int kExt = 0>
__global__ void __launch_bounds__(128 + kBlockM / 64 * 128, 1)
flash_fwd_sm90_ws_kernel(T* __restrict__ o, float* __restrict__ lse, int Lq, int Lk, int Dv, int nb2,
                         long long o_b0, long long o_b1, long long o_b2, long long o_row,
                         long long lse_b0, long long lse_b1, long long lse_b2, float scale_log2, int bcast,
                         int nb12, int n_bh, int group,
                         const __grid_constant__ CUtensorMap tmap_q, const __grid_constant__ CUtensorMap tmap_k,
                         const __grid_constant__ CUtensorMap tmap_v, const __grid_constant__ CUtensorMap tmap_o,
                         FLASH_EXT_PARAMS(float)) {
  using Tr = Sm90WsTraits<T, kHeadDim, kHeadDimV, kBlockM, kBlockN, Is_overlap, Is_persistent>;
  constexpr int kStages = Tr::kStages;

  FA_DYNAMIC_SMEM(smem_raw);
  // The swizzled boxes start on the pattern's repeat in the shared window (as in flash_fwd_sm90_kernel).
  const int misalign = static_cast<int>(fa::wgmma_desc(smem_raw, 0, 0, fa::kWgmmaSwizzleNone) & 0x3f) * 16;
  unsigned char* smem = smem_raw + (Tr::kAtomBytes - misalign) % Tr::kAtomBytes;
  const Sm90WsSmem sm = ws_smem_layout<Tr, Is_overlap>(smem);
  const int tid = static_cast<int>(threadIdx.x);
  const int wg = tid / 128;   // 0: producer; 1, 2 (, 3): consumers of rows [64(wg−1), 64 wg) of Q_i
  const Sm90WsScheduler<Is_causal, Is_persistent, kExt == 0> sched{(Lq + kBlockM - 1) / kBlockM, n_bh, nb12, nb2, group};

  if (tid == 0) {
    // the tensor maps (kernel parameters) into the TMA unit's cache before their first use (a hint)
    fa::tma_prefetch(&tmap_q);
    fa::tma_prefetch(&tmap_k);
    fa::tma_prefetch(&tmap_v);
    if (Is_tma_store) fa::tma_prefetch(&tmap_o);
    fa::mbarrier_init(sm.bar_q, 1);
    for (int s = 0; s < kStages; ++s) {
      fa::mbarrier_init(sm.full_k + s, 1);
      fa::mbarrier_init(sm.full_v + s, 1);
      fa::mbarrier_init(sm.empty_k + s, Tr::kConsumerThreads);
      if (Is_overlap) fa::mbarrier_init(sm.empty_v + s, Tr::kConsumerThreads);
    }
    if (Is_persistent) fa::mbarrier_init(sm.empty_q, Tr::kConsumerThreads);
    if (Tr::kOOverV) fa::mbarrier_init(sm.empty_o, Tr::kConsumerThreads);
    fa::fence_mbarrier_init();  // the inits visible to the TMA unit before any load completes on them
  }
  __syncthreads();              // ... and to every thread before its first wait or arrival

  const ExtArgs<float> ext = FLASH_EXT_ARGS(float);
  constexpr int kWalkExt = kExt & (kExtWindow | kExtBlockMask | kExtSeqlens);
  int visit = 0;   // the block's K / V visits so far (ring stage and parity), across its tiles
  if (wg == 0) {
    // ---- producer: one elected thread of warp 0 issues the whole block's loads ----
    fa::setmaxnreg_dec<Tr::kProducerRegs>();
    if (tid < 32 && fa::elect_one()) {
      for (int w = sched.first(), k_tile = 0; sched.valid(w); w = sched.next(w, k_tile), ++k_tile) {
        int m_block;
        BatchIndex bidx;
        sched.decode(w, m_block, bidx);
        const int m0 = m_block * kBlockM;
        const Mask<Is_causal, kWalkExt> mask = make_mask<Is_causal, kWalkExt>(
            ext.seqlen_q<kExt>(bidx, Lq), ext.seqlen_k<kExt>(bidx, Lk), ext, bidx);
        const Sm90KeyTiles<Is_causal, kWalkExt> tiles(mask, m0, kBlockM, kBlockN,
                                                      mask.n_block_max(m0, kBlockM, kBlockN), 0);
        ws_load_tile<Tr, Is_overlap, Is_persistent, kHeadDim, kHeadDimV>(sm, &tmap_q, &tmap_k, &tmap_v, m0, bidx,
                                                                         bcast, tiles, k_tile, visit);
      }
    }
    return;
  }

  // ---- consumers ----
  fa::setmaxnreg_inc<Tr::kConsumerRegs>();
  Sm90WsConsumer<T, kHeadDim, kHeadDimV, kBlockM, kBlockN, Is_causal, Is_overlap, Is_persistent, kExt> consumer(
      sm, Lq, Lk, tid, scale_log2, ext);
  const TensorStrides o_s{o_b0, o_b1, o_b2, o_row}, lse_s{lse_b0, lse_b1, lse_b2, 1};
  auto run = [&](int w, int k_tile) {
    int m_block;
    BatchIndex bidx;
    sched.decode(w, m_block, bidx);
    consumer.template tile<Is_tma_store>(m_block, bidx, k_tile, visit, o, lse, Dv, o_s, lse_s, &tmap_o);
  };
  if constexpr (Is_persistent) {
    for (int w = sched.first(), k_tile = 0; sched.valid(w); w = sched.next(w, k_tile), ++k_tile) run(w, k_tile);
  } else {
    run(sched.first(), 0);   // one work tile: no loop around the consumers' code
  }
}

}  // namespace flash
