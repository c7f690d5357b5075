// flash_fwd.cu — FlashAttention-2 forward on tensor cores (fp16 / bf16 in, fp32 accumulate).
//
// One thread block per (query tile Q_i, batch entry); kNWarps warps, warp w owns kSlabs
// consecutive 16-row slabs of Q_i, S_ij, P_ij and O_i (rows [w·16·kSlabs, (w+1)·16·kSlabs)),
// so the softmax statistics of a row never leave the 4 lanes (a quad) that hold it, and each
// K_j / V_j fragment loaded by ldmatrix feeds kSlabs mma instructions. K_j and V_j arrive by
// cp.async, software-pipelined in one of two ways (kStages, chosen by the tile table from the
// shared memory the arch has):
//   kStages = 2: double-buffered ring — tile j+1 is fetched into the other stage while all of
//                tile j is computed; one barrier per key tile;
//   kStages = 1: one buffer each (FlashAttention-2) — V_j is fetched while S_ij = Q_i K_jᵀ runs,
//                K_{j+1} while the softmax and O_i += P_ij V_j run; two barriers per key tile.
// P_ij never touches shared memory: the S accumulator registers of an m16n8 pair are exactly the
// A-operand registers of the next m16n8k16 (FlashAttention-2's register reuse).
// Online softmax in fp32 registers with exp2 and log2(e) folded into the scale; O_i is divided
// by l_i once at the end; LSE = (m_i + log2 l_i)·ln 2 (natural log, fp32).
//
// Symbols and shapes (d, dv = head dims rounded up to multiples of 16, zero-filled past D, Dv):
//   Q_i  Br × d   shared sQ, read per k16 step with ldmatrix.x4   (A operand, row-major)
//   K_j  Bc × d   shared sK (per stage), ldmatrix.x4 non-trans    (B operand stored N×K)
//   V_j  Bc × dv  shared sV (per stage), ldmatrix.x4.trans        (B operand stored K×N)
//   S_ij, P_ij 16 × Bc per slab: acc_s[kSlabs][Bc/8][4] fp32 per lane
//   O_i  16 × dv per slab: acc_o[kSlabs][dv/8][4] fp32 per lane
//   m_i, l_i  rows g and g+8 of each slab (g = lane / 4): 2·kSlabs per lane
// Register layouts of the mma fragments: ptx_semantics.md (g = lane >> 2, t = lane & 3).
#include "fa_port.cuh"
#include "flash_kernel_traits.cuh"
#include "flash_block_info.cuh"
#include "flash_mask.cuh"
#include "flash_softmax.cuh"
#include "flash_fwd_copy.cuh"
#include "flash_fwd_tiles.cuh"
#include "flash_ext.cuh"

namespace flash {

// Epilogue rows. Lane (g, t) holds row g + 8r of a 16-row slab of O_i (r = 0, 1), columns 2t and
// 2t + 1 of each n8 tile: acc[dt][2r], acc[dt][2r + 1]; inv_l normalises the row.

// The row into the staged O_i tile (sO_row: its row in shared memory), rounded to T: one 4-byte
// word per n8 tile; the 8 rows g of an instruction start 4 mod 8 words apart (kStrideO), the 4
// lanes t take consecutive words: 32 distinct banks.
template <typename T, int kNTilesO>
__device__ __forceinline__ void stage_o_row(T* sO_row, const float (&acc)[kNTilesO][4], int r, float inv_l, int t) {
#pragma unroll
  for (int dt = 0; dt < kNTilesO; ++dt)
    *reinterpret_cast<uint32_t*>(sO_row + 8 * dt + 2 * t) =
        fa::pack2<T>(acc[dt][2 * r] * inv_l, acc[dt][2 * r + 1] * inv_l);
}

// The row straight to global memory (dst_row: its row of O; columns < Dv): the split-KV fp32
// workspace, and O_i when the staged tile does not fit. pairs: a column pair as one store (two
// elements of T in a word, or a float2), else element by element (odd Dv, odd row stride).
template <typename OutT, int kNTilesO>
__device__ __forceinline__ void store_o_row(OutT* dst_row, const float (&acc)[kNTilesO][4], int r, float inv_l,
                                            int t, int Dv, bool pairs) {
#pragma unroll
  for (int dt = 0; dt < kNTilesO; ++dt) {
    const int col = 8 * dt + 2 * t;
    OutT* dst = dst_row + col;
    const float lo = acc[dt][2 * r] * inv_l, hi = acc[dt][2 * r + 1] * inv_l;
    if (pairs && col + 1 < Dv) {
      if constexpr (IsSame<OutT, float>::value) fa::gstore(reinterpret_cast<float2*>(dst), float2{lo, hi});
      else fa::gstore(reinterpret_cast<uint32_t*>(dst), fa::pack2<OutT>(lo, hi));
    } else {
      if (col < Dv) fa::gstore(dst, from_acc<OutT>(lo));
      if (col + 1 < Dv) fa::gstore(dst + 1, from_acc<OutT>(hi));
    }
  }
}

// Is_split (split-KV, "flash-decoding"; off by default, so the dense instantiations and their
// name expressions are unchanged): the grid's x dimension is (query tiles) × (splits), block x
// takes query tile x % Tr and split s = x / Tr of the key tiles (Tr = ceil(Lq / Br)), and the
// output arguments are an fp32 workspace instead of out / lse:
//   o   → O_s  (*batch, splits, Lq, Dv) float: O of the split's keys, normalised by its own l
//   lse → L_s  (*batch, splits, Lq)     float: natural-log LSE of the split's keys (−inf: none)
// (batch strides as passed, o_row = Dv; a split's slab is Lq rows further). The key tiles
// [0, ceil(Lk / Bc)) are cut into equal runs of ceil(tiles / splits) (the same cut for every
// query tile); a split with no visible tile writes O_s = 0, L_s = −inf. flash_fwd_combine.cu
// merges the splits by log-sum-exp into out / lse.
//
// Is_packed (GQA packing with the causal mask; off by default): the rows are the G query heads of
// a KV head stacked, row r being query position r mod Lg of head r div Lg (Lg = rows_per_group,
// the original Lq; Lq is then G·Lg). The mask sees each row's position: causal_offset = Lk − Lg,
// a query tile's key range is that of its largest position (Lg − 1 when it spans two heads) and
// its unmasked tiles those of its smallest (0 when it spans two heads). rows_per_group is unused
// otherwise (the host passes Lq).
//
// kExt (the extensions of docs/extensions.md; 0 by default, so the dense instantiations and their
// code are unchanged): a bit set of flash_ext.cuh, its arguments the trailing FLASH_EXT_PARAMS.
// Lengths, window, block mask, softcap and ALiBi live in the Mask; key tiles outside the window
// band, past the entry's keys or with an all-False block mask are never loaded (KeyTileWalk);
// dropout drops P in registers (dropout_mma). Not combined with Is_packed or Has_seqlens_k.
template <typename T, int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN, int kNWarps, int kStages,
          bool Is_causal, bool Is_aligned, bool Is_split = false, bool Is_packed = false,
          bool Has_seqlens_k = false, bool Is_paged = false, int kExt = 0>
__global__ void __launch_bounds__(kNWarps * 32, kMinBlocksPerSm)
flash_fwd_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                 typename SplitOutput<T, Is_split>::type* __restrict__ o, float* __restrict__ lse,
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
  using Traits = FwdTensorCoreTraits<T, kHeadDim, kHeadDimV, kBlockM, kBlockN, kNWarps, kStages>;
  constexpr int kNThreads = Traits::kNThreads;
  constexpr int kNTilesS = Traits::kNTilesS;  // n8 tiles across Bc
  constexpr int kNTilesO = Traits::kNTilesO;  // n8 tiles across dv
  constexpr int kSlabs = Traits::kSlabsPerWarp;
  constexpr int kRowsPerLane = 2;             // rows g and g + 8 of the slab
  constexpr int kQuad = 4;                    // lanes sharing one row of an mma fragment

  FA_DYNAMIC_SMEM(smem);
  T* sQ = reinterpret_cast<T*>(smem + Traits::kSmemQOffset);  // Q_i  Br × d
  T* sK = reinterpret_cast<T*>(smem + Traits::kSmemKOffset);  // K_j  kStages × Bc × d
  T* sV = reinterpret_cast<T*>(smem + Traits::kSmemVOffset);  // V_j  kStages × Bc × dv
  constexpr int kKStage = Traits::kSmemKStageElems;            // elements between K stages
  constexpr int kVStage = Traits::kSmemVStageElems;            // elements between V stages

  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane >> 2;  // fragment row group
  const int t = lane & 3;   // thread in group: fragment columns 2t, 2t + 1
  const int warp_row0 = warp * Traits::kRowsPerWarp;    // first row of this warp's slabs in Q_i
  // Split-KV: block x is query tile x % Tr of split x / Tr (dense: query tile x, one split; causal:
  // longest first, query_tile). Causal dense calls (no split, packing, cache or extension) with
  // causal_groups > 0: the grouped longest-first order over the whole grid (grid_tile).
  const int n_m_blocks = Is_split ? ceil_div(Lq, kBlockM) : static_cast<int>(gridDim.x);
  int m_block;
  BatchIndex bidx;  // ---- where this block's tensors live
  if constexpr (Is_split) {
    m_block = query_tile<Is_causal>(static_cast<int>(blockIdx.x) % n_m_blocks, n_m_blocks);
    bidx = BatchIndex::from_grid(nb2);
  } else {
    grid_tile<Is_causal, !Is_packed && !Has_seqlens_k && kExt == 0>(n_m_blocks, nb2, causal_groups, m_block, bidx);
  }
  const int m0 = m_block * kBlockM;  // first query row of Q_i

  // Per-entry key lengths (KV cache): this block's entry e = b0·e_b0 + b1·e_b1 + b2·e_b2 sees
  // seqlens_k[e] keys; from here on Lk is that count (mask, tail tile, split ranges). Paged K/V:
  // the entry's row of the block table (k, v are then the page pools: batch strides = head
  // strides, the entry's stride 0).
  const int* table = nullptr;
  if constexpr (Has_seqlens_k) {
    const long long entry = bidx.offset(TensorStrides{e_b0, e_b1, e_b2, 0});
    Lk = fa::gload(seqlens_k + entry);
    if constexpr (Is_paged) table = block_table + entry * table_row;
  } else {
    (void)seqlens_k; (void)e_b0; (void)e_b1; (void)e_b2;
  }
  static_assert(!Is_paged || Has_seqlens_k, "Is_paged needs Has_seqlens_k");
  if constexpr (!Is_paged) { (void)block_table; (void)table_row; (void)page_size; (void)k_page; (void)v_page; (void)table; }
  // Extensions: the entry's lengths (seqlens; Lq stays the launch's for the stores: rows at or past
  // Lq_b write out 0, lse −inf), the per-entry state in the Mask.
  static_assert(kExt == 0 || (!Is_packed && !Has_seqlens_k), "kExt is not combined with GQA packing or the KV cache");
  const ExtArgs<float> ext = FLASH_EXT_ARGS(float);
  Lk = ext.seqlen_k<kExt>(bidx, Lk);
  const int Lq_b = ext.seqlen_q<kExt>(bidx, Lq);
  const TensorStrides q_s{q_b0, q_b1, q_b2, q_row}, k_s{k_b0, k_b1, k_b2, k_row};
  const TensorStrides v_s{v_b0, v_b1, v_b2, v_row}, o_s{o_b0, o_b1, o_b2, o_row};
  const TensorStrides lse_s{lse_b0, lse_b1, lse_b2, 1};
  const T* q_i = q + bidx.offset(q_s) + m0 * q_row;
  const T* k_base = k + bidx.offset(k_s);
  const T* v_base = v + bidx.offset(v_s);
  auto* o_i = o + bidx.offset(o_s) + m0 * o_row;  // split-KV: + the split's slab (epilogue)
  float* lse_i = lse + bidx.offset(lse_s) + m0;

  // GQA packing (causal): the mask works on query positions, row mod rows_per_group.
  static_assert(!Is_packed || Is_causal, "Is_packed is the causal packed variant");
  const Mask<Is_causal, kExt> mask = make_mask<Is_causal, kExt>(Is_packed ? rows_per_group : Lq_b, Lk, ext, bidx);
  // The positions of Q_i's first / last rows (packed: 0 / Lg − 1 when Q_i spans two heads).
  const PackedRows packed_rows = PackedRows::of<Is_packed>(m0, kBlockM, Lq, rows_per_group);
  // Causal: key tiles entirely above the diagonal (for every row of Q_i) are never loaded.
  int n_block_max = Is_packed ? packed_rows.n_block_max(mask, kBlockN) : mask.n_block_max(m0, kBlockM, kBlockN);
  // Split-KV: only this split's run of key tiles [split_block_min, n_block_max) (maybe empty). The
  // dense kernel's first tile is the literal 0: every use below reads (Is_split ? split_block_min
  // : 0), since even a variable that is always 0 changed the dense loop's SASS (+9 instructions).
  // A window's first tile moves it too (kMinVaries).
  constexpr bool kMinVaries = Is_split || HasExt<kExt, kExtWindow>::value;
  int split_block_min = 0;
  if constexpr (Is_split)
    split_key_tiles(split_block_min, n_block_max, ceil_div(Lk, kBlockN), static_cast<int>(blockIdx.x) / n_m_blocks,
                    static_cast<int>(gridDim.x) / n_m_blocks);
  if constexpr (HasExt<kExt, kExtWindow>::value) split_block_min = imax(split_block_min, mask.n_block_min(m0, kBlockN));

  float acc_o[kSlabs][kNTilesO][4];  // O_i slabs, unnormalised (C/D fragment layout)
  OnlineSoftmaxRow<float> stat[kSlabs][kRowsPerLane];
#pragma unroll
  for (int sl = 0; sl < kSlabs; ++sl) {
#pragma unroll
    for (int dt = 0; dt < kNTilesO; ++dt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc_o[sl][dt][i] = 0.0f;
#pragma unroll
    for (int r = 0; r < kRowsPerLane; ++r) stat[sl][r].init();
  }

  // ldmatrix row addresses (ptx_semantics.md): lane l supplies one 16-byte row.
  //   Q (A, x4):        rows 16·slab + l%16,              k offset 8·(l/16)
  //   K (B, x4, 2 n8):  rows 8·(l/16) + l%8 of the n16 pair, k offset 8·((l/8)%2)
  //   V (B, x4.trans):  rows (l%8) + 8·((l/8)%2) of the k16 step, dv offset 8·(l/16)
  // Swizzled sQ (Traits::kSwizzleQ): the lane's chunk 2·ks + l/16 of a row r ≡ l (mod 8) sits at chunk
  // (2·ks + l/16) ^ (l % 8) = 8·(ks / 4) + ((2·(ks % 4) + l/16) ^ (l % 8)): one row address per ks % 4.
  constexpr int kQLanes = Traits::kSwizzleQ ? 4 : 1;
  const T* sQ_lane[kQLanes];
#pragma unroll
  for (int k4 = 0; k4 < kQLanes; ++k4)
    sQ_lane[k4] = sQ + (warp_row0 + lane % 16) * Traits::kStrideQ +
                  (Traits::kSwizzleQ ? ((2 * k4 + lane / 16) ^ (lane % 8)) : lane / 16) * 8;
  const int k_lane = ((lane / 16) * 8 + lane % 8) * Traits::kStrideK + ((lane / 8) % 2) * 8;
  const int v_lane = (lane % 8 + ((lane / 8) % 2) * 8) * Traits::kStrideV + (lane / 16) * 8;

  // ---- the steps of one key tile j ----------------------------------------------------------------
  using TileS = float[kSlabs][kNTilesS][4];  // S_ij, then P_ij, of the warp's slabs

  // K_j / V_j (rows n0 .. n0+Bc of this batch entry) → one shared-memory stage. Aligned rows:
  // per-thread copy plans (TileCopy), made once here, outside the key loop.
  // sm_75: whole chunks' loads in flight together (TileCopy's kWholePath), except at d 256 with four or
  // more extensions, where their registers spilled 12-44 bytes
  constexpr bool kWholeCopies = kHeadDim <= 128 || ext_count(kExt) <= 3;
  using CopyK = TileCopy<T, kBlockN, kHeadDim, Traits::kStrideK, kNThreads, kWholeCopies>;
  using CopyV = TileCopy<T, kBlockN, kHeadDimV, Traits::kStrideV, kNThreads, kWholeCopies>;
  const CopyK copy_k(k_row, D, tid);
  const CopyV copy_v(v_row, Dv, tid);
  // Paged K/V with aligned rows: the same plans, each 16-row group's page looked up once per tile
  // (PageTable, PagedTileCopy: one table read per page the tile touches, per warp; the kernel relies
  // on page_size being a multiple of 16, which flash_attention_with_kvcache checks). Unaligned rows
  // keep load_tile_paged (element-wise, a lookup per element's row). Dense: Absent, no code.
  constexpr bool kPagedCopy = Is_paged && Is_aligned;
  using Pages = typename Pick<kPagedCopy, PageTable, Absent>::type;
  using PagedK = typename Pick<kPagedCopy, PagedTileCopy<T, kBlockN, kHeadDim, Traits::kStrideK, kNThreads,
                                                          kWholeCopies>, Absent>::type;
  using PagedV = typename Pick<kPagedCopy, PagedTileCopy<T, kBlockN, kHeadDimV, Traits::kStrideV, kNThreads,
                                                          kWholeCopies>, Absent>::type;
  const Pages pages(table, page_size);
  const PagedK paged_k(k_row, D, tid);
  const PagedV paged_v(v_row, Dv, tid);
  // full: every row of the tile exists (every tile but the last one, n0 + Bc <= Lk); a literal or
  // a block-uniform flag, so the row test folds away or is one branch-free select per copy.
  auto paged_rows = [&](bool full, int n0) { return full ? kBlockN : rows_in_tile(n0, kBlockN, Lk); };
  auto load_k = [&](bool full, T* sK_dst, int n0) {
    if constexpr (kPagedCopy) {
      const int rows = paged_rows(full, n0);
      paged_k.load(full, sK_dst, k_base, k_page, pages.template lookup<kBlockN>(n0, rows, lane), rows);
    } else if constexpr (Is_paged)
      load_tile_paged<T, kBlockN, kHeadDim, Traits::kStrideK, kNThreads, Is_aligned>(
          sK_dst, k_base, k_row, k_page, table, page_size, n0, rows_in_tile(n0, kBlockN, Lk), D, tid);
    else if constexpr (Is_aligned)
      copy_k.load(full, sK_dst, k_base + n0 * k_row, rows_in_tile(n0, kBlockN, Lk));
    else
      load_tile<T, kBlockN, kHeadDim, Traits::kStrideK, kNThreads, false>(
          sK_dst, k_base + n0 * k_row, k_row, rows_in_tile(n0, kBlockN, Lk), D, tid);
  };
  auto load_v = [&](bool full, T* sV_dst, int n0) {
    if constexpr (kPagedCopy) {
      const int rows = paged_rows(full, n0);
      paged_v.load(full, sV_dst, v_base, v_page, pages.template lookup<kBlockN>(n0, rows, lane), rows);
    } else if constexpr (Is_paged)
      load_tile_paged<T, kBlockN, kHeadDimV, Traits::kStrideV, kNThreads, Is_aligned>(
          sV_dst, v_base, v_row, v_page, table, page_size, n0, rows_in_tile(n0, kBlockN, Lk), Dv, tid);
    else if constexpr (Is_aligned)
      copy_v.load(full, sV_dst, v_base + n0 * v_row, rows_in_tile(n0, kBlockN, Lk));
    else
      load_tile<T, kBlockN, kHeadDimV, Traits::kStrideV, kNThreads, false>(
          sV_dst, v_base + n0 * v_row, v_row, rows_in_tile(n0, kBlockN, Lk), Dv, tid);
  };
  // The single-buffered loop's whole-tile copies in two halves (TileCopy::stage / land, fa::ChunkStage):
  // on sm_75 the loads are issued at stage_* and the stores at land_*, after the GEMM in between; on
  // sm_80+, for paged or unaligned rows, with extensions and at d > 128, stage_* is load_*(true, ...) and
  // land_* nothing (sm_75: the staged chunks' registers spilled 8-280 bytes in 229 of the 756 extension
  // variants at d 80-128, and 188 bytes in the 64 x 16 tile of d 256).
  constexpr bool kStagedCopy = Is_aligned && !Is_paged && kExt == 0 && kHeadDim <= 128 && kHeadDimV <= 128;
  using StageK = typename CopyK::Stage;
  using StageV = typename CopyV::Stage;
  auto stage_k = [&](StageK& st, T* sK_dst, int n0) {
    if constexpr (kStagedCopy) copy_k.stage(st, sK_dst, k_base + n0 * k_row);
    else load_k(true, sK_dst, n0);
  };
  auto stage_v = [&](StageV& st, T* sV_dst, int n0) {
    if constexpr (kStagedCopy) copy_v.stage(st, sV_dst, v_base + n0 * v_row);
    else load_v(true, sV_dst, n0);
  };
  auto land_k = [&](StageK& st, T* sK_dst) {
    if constexpr (kStagedCopy) copy_k.land(st, sK_dst);
  };
  auto land_v = [&](StageV& st, T* sV_dst) {
    if constexpr (kStagedCopy) copy_v.land(st, sV_dst);
  };
  // Paged K_j and V_j together (the two-stage ring): one page lookup for both.
  auto load_kv_paged = [&](bool full, T* sK_dst, T* sV_dst, int n0) {
    if constexpr (kPagedCopy) {
      const int rows = paged_rows(full, n0);
      const PageSpan span = pages.template lookup<kBlockN>(n0, rows, lane);
      paged_k.load(full, sK_dst, k_base, k_page, span, rows);
      paged_v.load(full, sV_dst, v_base, v_page, span, rows);
    }
  };

  // S_ij = Q_i K_jᵀ: per k16 step one A fragment of Q per slab, then the Bc/8 n8 tiles of K_j,
  // each B fragment shared by the warp's kSlabs slabs.
  auto gemm_qk = [&](TileS& acc_s, const T* sK_j) {
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
      for (int nt = 0; nt < kNTilesS; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc_s[sl][nt][i] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < Traits::kKStepsS; ++ks) {
      uint32_t a_q[kSlabs][4];
#pragma unroll
      for (int sl = 0; sl < kSlabs; ++sl)
        fa::ldmatrix<4, false>(a_q[sl], Traits::kSwizzleQ
                                            ? sQ_lane[ks % kQLanes] + sl * Traits::kMmaM * Traits::kStrideQ + ks / 4 * 64
                                            : sQ_lane[0] + sl * Traits::kMmaM * Traits::kStrideQ + ks * Traits::kMmaK);
#pragma unroll
      for (int np = 0; np < kNTilesS / 2; ++np) {
        uint32_t b_k[4];  // B fragments of n8 tiles 2np (b_k[0..1]) and 2np+1 (b_k[2..3])
        fa::ldmatrix<4, false>(b_k, sK_j + k_lane + np * 16 * Traits::kStrideK + ks * Traits::kMmaK);
        const uint32_t b_lo[2] = {b_k[0], b_k[1]}, b_hi[2] = {b_k[2], b_k[3]};
#pragma unroll
        for (int sl = 0; sl < kSlabs; ++sl) {
          float(&s_lo)[4] = acc_s[sl][2 * np];
          float(&s_hi)[4] = acc_s[sl][2 * np + 1];
          const float c_lo[4] = {s_lo[0], s_lo[1], s_lo[2], s_lo[3]};
          const float c_hi[4] = {s_hi[0], s_hi[1], s_hi[2], s_hi[3]};
          fa::mma_m16n8k16<T>(s_lo, a_q[sl], b_lo, c_lo);
          fa::mma_m16n8k16<T>(s_hi, a_q[sl], b_hi, c_hi);
        }
      }
    }
  };

  // Mask (only tiles that cross the diagonal or the sequence end), online softmax on rows g, g+8
  // of each slab: update m_i, rescale O_i and l_i, P_ij = exp2(S_ij·scale·log2(e) − m_i). S stays
  // unscaled until the exp2 (one fma per score; the row max of unscaled scores times the scale
  // is the max of the scaled ones, the scale being > 0). m_i is kept in scaled units.
  // acc_s[sl][nt][i] holds S[16·sl + g + 8·(i/2)][8·nt + 2t + i%2] of the warp's rows.
  // The query position of row `row` of the problem (packed: its position within its head).
  auto query_position = [&](int row) { return Is_packed ? row % rows_per_group : row; };
  auto softmax_step = [&](bool tile_masked, TileS& acc_s, int n0) {
    if constexpr (Mask<Is_causal, kExt>::kScoreMod) {  // softcap / ALiBi: every score of every tile
#pragma unroll
      for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
        for (int nt = 0; nt < kNTilesS; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i)
            acc_s[sl][nt][i] = mask.score(acc_s[sl][nt][i], m0 + warp_row0 + sl * Traits::kMmaM + g + 8 * (i / 2),
                                          n0 + 8 * nt + 2 * t + (i % 2));
    }
    if (tile_masked) {
      if constexpr (Mask<Is_causal, kExt>::kBlockMask) {
        // Block mask: a slab's 16 rows × an n8 tile's 8 columns lie in one block: one lookup each.
#pragma unroll
        for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
          for (int nt = 0; nt < kNTilesS; ++nt) {
            const int row0 = m0 + warp_row0 + sl * Traits::kMmaM;
            const bool block = mask.block_visible(row0, n0 + 16 * (nt / 2));
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const bool ok = block && mask.is_visible_geometry(row0 + g + 8 * (i / 2), n0 + 8 * nt + 2 * t + (i % 2));
              acc_s[sl][nt][i] = ok ? acc_s[sl][nt][i] : -INFINITY;
            }
          }
      } else {
#pragma unroll
        for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
          for (int nt = 0; nt < kNTilesS; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i)
              acc_s[sl][nt][i] = mask.apply(acc_s[sl][nt][i], query_position(m0 + warp_row0 + sl * Traits::kMmaM + g + 8 * (i / 2)),
                                            n0 + 8 * nt + 2 * t + (i % 2));
      }
    }
    // The rows' new maxima first; O_i is rescaled only when some row of the warp has a new one (a
    // factor of exactly 1 elsewhere: skipping it changes no bit). Past the first key tiles a row's
    // max rarely moves, and the rescale is kHeadDimV / 2 multiplies per row and lane.
    float correction[kSlabs][kRowsPerLane];
    bool moved = false;
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
      for (int r = 0; r < kRowsPerLane; ++r) {
        float tile_max = acc_s[sl][0][2 * r];
#pragma unroll
        for (int nt = 0; nt < kNTilesS; ++nt)
          tile_max = fmaxf(tile_max, fmaxf(acc_s[sl][nt][2 * r], acc_s[sl][nt][2 * r + 1]));
        tile_max = group_allreduce_max<kQuad>(tile_max);  // the quad holding the row
        correction[sl][r] = stat[sl][r].update_max(tile_max * scale_log2);
        moved |= correction[sl][r] != 1.0f;
      }
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
      for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
        for (int r = 0; r < kRowsPerLane; ++r)
#pragma unroll
          for (int dt = 0; dt < kNTilesO; ++dt) {
            acc_o[sl][dt][2 * r] *= correction[sl][r];
            acc_o[sl][dt][2 * r + 1] *= correction[sl][r];
          }
    }
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
      for (int r = 0; r < kRowsPerLane; ++r) {
        const float m_sub = stat[sl][r].max_for_exp();
#pragma unroll
        for (int nt = 0; nt < kNTilesS; ++nt)
#pragma unroll
          for (int i = 2 * r; i < 2 * r + 2; ++i) {
            const float p = OnlineSoftmaxRow<float>::prob_unscaled(acc_s[sl][nt][i], scale_log2, m_sub);
            stat[sl][r].l += p;  // partial over this lane's columns; the quad is summed at the end
            acc_s[sl][nt][i] = p;
          }
      }
  };

  // O_i += P_ij V_j: P (16 × Bc per slab) as A fragments straight from the S registers; each
  // V_j fragment is shared by the warp's slabs.
  auto gemm_pv = [&](const TileS& acc_s, const T* sV_j) {
#pragma unroll
    for (int ks = 0; ks < Traits::kKStepsO; ++ks) {
      // A rows g / g+8, k columns 2t.. of n8 tiles 2ks (A0, A1) and 2ks+1 (A2, A3).
      uint32_t a_p[kSlabs][4];
#pragma unroll
      for (int sl = 0; sl < kSlabs; ++sl) {
        const float(&p_lo)[4] = acc_s[sl][2 * ks];
        const float(&p_hi)[4] = acc_s[sl][2 * ks + 1];
        a_p[sl][0] = fa::pack2<T>(p_lo[0], p_lo[1]);
        a_p[sl][1] = fa::pack2<T>(p_lo[2], p_lo[3]);
        a_p[sl][2] = fa::pack2<T>(p_hi[0], p_hi[1]);
        a_p[sl][3] = fa::pack2<T>(p_hi[2], p_hi[3]);
      }
#pragma unroll
      for (int dp = 0; dp < kNTilesO / 2; ++dp) {
        uint32_t b_v[4];  // B fragments of dv n8 tiles 2dp (b_v[0..1]) and 2dp+1 (b_v[2..3])
        fa::ldmatrix<4, true>(b_v, sV_j + v_lane + ks * Traits::kMmaK * Traits::kStrideV + dp * 16);
        const uint32_t b_lo[2] = {b_v[0], b_v[1]}, b_hi[2] = {b_v[2], b_v[3]};
#pragma unroll
        for (int sl = 0; sl < kSlabs; ++sl) {
          float(&o_lo)[4] = acc_o[sl][2 * dp];
          float(&o_hi)[4] = acc_o[sl][2 * dp + 1];
          const float c_lo[4] = {o_lo[0], o_lo[1], o_lo[2], o_lo[3]};
          const float c_hi[4] = {o_hi[0], o_hi[1], o_hi[2], o_hi[3]};
          fa::mma_m16n8k16<T>(o_lo, a_p[sl], b_lo, c_lo);
          fa::mma_m16n8k16<T>(o_hi, a_p[sl], b_hi, c_hi);
        }
      }
    }
  };

  // ---- main loop over the visible key tiles, last tile first -------------------------------------
  // FlashAttention-2's order: the tiles that need the element mask (crossing the causal diagonal
  // or the sequence end) are the last ones, so they run first; every tile after them is a full
  // tile without masking (j < n_block_unmasked: a block-uniform branch skips the mask). Only
  // the first tile loaded (the prologue's) can be partial, so the prefetches inside the loop
  // copy whole rows with no bounds checks. One loop, not a masked and an unmasked copy as in
  // FlashAttention-2: the two copies cost up to 30 more registers and spilled the 8-warp and
  // sm_75 tiles (docs/performance.md).
  const int n_block_unmasked =
      unmasked_key_tiles<Is_causal>(mask, Is_packed ? packed_rows.first : m0, kBlockN, n_block_max);
  // Extensions: the tiles to visit and which need the mask (block-mask tiles all False skipped).
  const KeyTileWalk<Is_causal, kExt, float> walk{mask, m0, kBlockM, kBlockN, (kMinVaries ? split_block_min : 0)};
  // Dropout: the entry's generator; P is dropped after the softmax has summed it into l_i.
  const DropoutRng rng = ext.dropout(bidx);
  auto drop = [&](TileS& acc_s, int n0) {
    if constexpr (HasExt<kExt, kExtDropout>::value) dropout_mma<kSlabs, kNTilesS>(acc_s, rng, m0 + warp_row0, n0, lane);
  };
  // The first tile: below the first tile when no key is visible (no loop).
  int n_block = kExt == 0 ? n_block_max - 1 : walk.prev(n_block_max);
  if constexpr (kStages == 1) {
    // One buffer each for K_j and V_j (FlashAttention-2's pipeline): V_j is fetched while
    // S_ij = Q_i K_jᵀ runs, K_{j−1} while the softmax and P_ij V_j run. Two barriers per tile.
    // The first tile's V_j comes with Q_i and K_j: only that tile can be partial (the sequence's last), so
    // the loop's V_j copies are whole tiles with no row checks (per-pass row indices held in registers
    // through the loop spilled the 128 x 64 tile at d 128).
    const int n_first = n_block;
    if (n_block >= (kMinVaries ? split_block_min : 0)) {
      load_tile<T, kBlockM, kHeadDim, Traits::kStrideQ, kNThreads, Is_aligned, Traits::kSwizzleQ>(
          sQ, q_i, q_row, rows_in_tile(m0, kBlockM, Lq_b), D, tid);
      load_k(false, sK, n_block * kBlockN);
      load_v(false, sV, n_block * kBlockN);
      fa::cp_async_commit();
    }
    auto iteration = [&](bool masked, int n_block, int next) {
      const int n0 = n_block * kBlockN;  // first key row of K_j, V_j
      fa::cp_async_wait<0>();
      // Barrier: Q_i and K_j have landed for every thread's copies, and every warp has finished
      // reading V_{j+1} (previous iteration), so sV may be overwritten.
      __syncthreads();
      const bool new_v = n_block != n_first;  // a whole tile (the first one's came with K_j)
      StageV st_v;
      if (new_v) stage_v(st_v, sV, n0);
      fa::cp_async_commit();

      TileS acc_s;
      gemm_qk(acc_s, sK);
      if (new_v) land_v(st_v, sV);

      fa::cp_async_wait<0>();
      // Barrier: V_j has landed for every thread's copies, and every warp has finished reading
      // K_j, so sK may receive K_{j−1} while we do the softmax and P_ij V_j.
      __syncthreads();
      // The next tile (the one below, or the walk's next): always a full tile.
      const bool more = kExt == 0 ? n_block > (kMinVaries ? split_block_min : 0) : next >= walk.lo;
      StageK st_k;
      if (more) stage_k(st_k, sK, kExt == 0 ? n0 - kBlockN : next * kBlockN);
      fa::cp_async_commit();

      softmax_step(masked, acc_s, n0);
      drop(acc_s, n0);
      gemm_pv(acc_s, sV);
      if (more) land_k(st_k, sK);
    };
    if constexpr (kExt == 0) {
      for (; n_block >= (kMinVaries ? split_block_min : 0); --n_block) iteration(n_block >= n_block_unmasked, n_block, 0);
    } else {
      while (n_block >= walk.lo) {
        const int next = walk.prev(n_block);
        iteration(walk.masked(n_block), n_block, next);
        n_block = next;
      }
    }
  } else {
    // Two-stage ring: K_{j−1} and V_{j−1} are fetched into the other stage while all of tile j
    // is computed. One barrier per tile.
    static_assert(kStages == 2, "kStages must be 1 or 2");
    if (n_block >= (kMinVaries ? split_block_min : 0)) {
      load_tile<T, kBlockM, kHeadDim, Traits::kStrideQ, kNThreads, Is_aligned, Traits::kSwizzleQ>(
          sQ, q_i, q_row, rows_in_tile(m0, kBlockM, Lq_b), D, tid);
      if constexpr (kPagedCopy) {
        load_kv_paged(false, sK, sV, n_block * kBlockN);
      } else {
        load_k(false, sK, n_block * kBlockN);
        load_v(false, sV, n_block * kBlockN);
      }
      fa::cp_async_commit();
    }
    int stage = 0;  // shared-memory stage holding tile j
    auto iteration = [&](bool masked, int n_block, int next) {
      const int n0 = n_block * kBlockN;  // first key row of K_j, V_j
      fa::cp_async_wait<0>();
      // Barrier: Q_i, K_j and V_j have landed for every thread's copies, and every warp has
      // finished tile j+1, so its stage (the other one) may receive tile j−1.
      __syncthreads();
      if (kExt == 0 ? n_block > (kMinVaries ? split_block_min : 0) : next >= walk.lo) {
        const int n_next = kExt == 0 ? n0 - kBlockN : next * kBlockN;  // a full tile
        if constexpr (kPagedCopy) {
          load_kv_paged(true, sK + (stage ^ 1) * kKStage, sV + (stage ^ 1) * kVStage, n_next);
        } else {
          load_k(true, sK + (stage ^ 1) * kKStage, n_next);
          load_v(true, sV + (stage ^ 1) * kVStage, n_next);
        }
      }
      fa::cp_async_commit();

      TileS acc_s;
      gemm_qk(acc_s, sK + stage * kKStage);
      softmax_step(masked, acc_s, n0);
      drop(acc_s, n0);
      gemm_pv(acc_s, sV + stage * kVStage);
      stage ^= 1;
    };
    if constexpr (kExt == 0) {
      for (; n_block >= (kMinVaries ? split_block_min : 0); --n_block) iteration(n_block >= n_block_unmasked, n_block, 0);
    } else {
      while (n_block >= walk.lo) {
        const int next = walk.prev(n_block);
        iteration(walk.masked(n_block), n_block, next);
        n_block = next;
      }
    }
  }

  // ---- epilogue: O_i / l_i once, LSE = (m_i + log2 l_i)·ln 2 ------------------------------------
  // FlashAttention-2's: once every warp has left the key loop all of shared memory is free; the
  // warps write O_i (normalised, rounded to T) and the tile's Br LSE values there, and the block
  // copies them out in 16-byte row chunks and one float per thread: whole 32-byte sectors, where
  // the fragments' own stores (4 bytes per lane, 8 rows per instruction) filled half of each.
  // Split-KV: split s's slab of the workspace is s·Lq rows further (o_row = Dv, lse row = 1); the
  // split index is re-derived here rather than kept live through the key loop (registers). Its
  // fp32 O_s keeps the fragment stores: a quad's four 8-byte pairs fill a 32-byte sector.
  if constexpr (Is_split) {
    const long long slab = static_cast<long long>(static_cast<int>(blockIdx.x) / ceil_div(Lq, kBlockM)) * Lq;
    o_i += slab * o_row;
    lse_i += slab;
  }
  // The grouped causal order: the tile's coordinates decoded again here from a re-read blockIdx (kept from the
  // start, they spilled 44 bytes at 255 registers: sm_90's causal 128 x 64 tile at d 96).
  constexpr bool kGroupable = Is_causal && !Is_split && !Is_packed && !Has_seqlens_k && kExt == 0;
  if constexpr (kGroupable) {
    int cx, cy, cz, m_e;
    BatchIndex b_e;
    ctaid_reread(cx, cy, cz);
    grid_tile_at<Is_causal, true>(cx, cy, cz, static_cast<int>(gridDim.x), nb2, causal_groups, m_e, b_e);
    o_i = o + b_e.offset(o_s) + m_e * kBlockM * o_row;
    lse_i = lse + b_e.offset(lse_s) + m_e * kBlockM;
  }
  constexpr bool kStageO = !Is_split && Traits::kStageO;
  T* sO = reinterpret_cast<T*>(smem);                                       // O_i  Br × dv (kStageO)
  float* sLse = reinterpret_cast<float*>(smem + Traits::kSmemLseOffset);   // LSE  Br
  // Fragment stores: a pair as one word (8 bytes for fp32) when every row of O starts aligned to
  // it (even row stride; O is allocated by the host, so its batch strides are multiples of it).
  const bool o_pairs = (o_row % 2 == 0) && (reinterpret_cast<unsigned long long>(o_i) % (2 * sizeof(*o_i)) == 0);
  fa::cp_async_wait<0>();
  // Barrier: every warp has finished its last reads of sQ, sK and sV (no copy is in flight: the
  // last key tile prefetches nothing), so the staged O_i and LSE may overwrite them.
  __syncthreads();
#pragma unroll
  for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
    for (int r = 0; r < kRowsPerLane; ++r) {
      const float l_total = group_allreduce_sum<kQuad>(stat[sl][r].l);
      const int row_in_tile = warp_row0 + sl * Traits::kMmaM + g + 8 * r;
      // Extensions: rows at or past the entry's Lq_b are out 0, lse −inf; dropout scales O_i.
      const bool live = kExt == 0 || m0 + row_in_tile < Lq_b;
      const float inv_l = ext_inv_sum<kExt>(stat[sl][r], l_total, live, ext);
      if constexpr (kStageO)
        stage_o_row<T>(sO + row_in_tile * Traits::kStrideO, acc_o[sl], r, inv_l, t);
      else if (m0 + row_in_tile < Lq)
        store_o_row(o_i + row_in_tile * o_row, acc_o[sl], r, inv_l, t, Dv, o_pairs);
      if (t == 0) sLse[row_in_tile] = live ? stat[sl][r].lse(l_total) : -INFINITY;
    }
  // Barrier: the staged O_i and LSE of every warp are complete.
  __syncthreads();
  const int rows = rows_in_tile(m0, kBlockM, Lq);  // rows of O_i that exist
  if constexpr (kStageO) {
    // 16-byte chunks when Dv is whole chunks and every row of O starts 16-byte aligned.
    const bool vec = Dv % Traits::kElemsPerCopy == 0 && o_row % Traits::kElemsPerCopy == 0 &&
                     reinterpret_cast<unsigned long long>(o_i) % kCopyBytes == 0;
    store_tile<T, kBlockM, kHeadDimV, Traits::kStrideO, kNThreads>(o_i, o_row, sO, rows, Dv, vec, tid);
  }
  for (int row = tid; row < rows; row += kNThreads) fa::gstore(lse_i + row, sLse[row]);
}

}  // namespace flash
