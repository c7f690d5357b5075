// flash_fwd_simt.cu — FlashAttention forward with CUDA-core (FMA) math.
//
// Used for fp32 and fp64 (accumulating in fp32 / fp64), and as the fallback for fp16/bf16 on
// GPUs without the needed tensor-core instructions (bf16 before sm_80). Same algorithm and
// tiling idea as the tensor-core kernel (flash_fwd.cu): one thread block per (query tile, batch
// entry); K_j and V_j stream through shared memory with cp.async, the load of V_j overlapping
// S_ij = Q_i K_jᵀ and the load of K_{j+1} overlapping the softmax and O_i += P_ij V_j; online
// softmax in registers with exp2 and log2(e) folded into the scale; O_i normalised once.
//
// Symbols and shapes (d, dv rounded up to multiples of 16, zero-filled past D, Dv):
//   Q_i  Br × d   shared (sQ)            K_j  Bc × d   shared (sK)
//   V_j  Bc × dv  shared (sV)            P_ij Br × Bc  shared (sP, AccT; exchanged inside a warp)
//   S_ij Br × Bc  registers: TM × TN per thread (columns tn, tn + kThreadsN, ...)
//   O_i  Br × dv  registers: TM × TE per thread (AccT; TE = dv/kThreadsN columns in runs of one
//                 16-byte vector where TE allows, ColRuns: each key's V_j values are 16-byte loads)
//   m_i, l_i      registers: TM per thread (l_i partial over the thread's columns)
// Output: O (Lq × Dv, element type) and LSE (Lq, AccT, natural log).
//
// kExt (docs/extensions.md; default 0, the dense kernel unchanged): the extension bits of
// flash_ext.cuh with their trailing FLASH_EXT_PARAMS, as in flash_fwd.cu — lengths, window, block
// mask, softcap and ALiBi in the Mask, key tiles outside the band or all-False in the block mask
// never loaded (KeyTileWalk, ascending here), dropout on P before it goes to shared memory.
//
// KV cache (Has_seqlens_k, Is_paged; as in flash_fwd.cu, not combined with kExt): each block's
// entry e = b0·e_b0 + b1·e_b1 + b2·e_b2 sees seqlens_k[e] keys (Lk from there on: mask, tail
// tile), and, paged, its K_j / V_j rows are read in place through the entry's block-table row
// (k, v are then the page pools, batch strides = head strides): aligned rows with the tensor-core
// forward's PagedTileCopy, one table read per page, key tile and warp; others with load_tile_paged.
#include "fa_port.cuh"
#include "flash_kernel_traits.cuh"
#include "flash_block_info.cuh"
#include "flash_mask.cuh"
#include "flash_softmax.cuh"
#include "flash_fwd_copy.cuh"
#include "flash_fwd_tiles.cuh"
#include "flash_ext.cuh"

namespace flash {

// A thread's TE columns of O_i (and of V_j in P V): TE / kRun runs of kRun consecutive columns, run r of
// lane tn at column (r·kThreadsN + tn)·kRun, kRun elements being one 16-byte vector where TE allows (else
// 8 bytes, else one element). A row group's lanes then read consecutive vectors of a V_j row (conflict-
// free) and store consecutive vectors of an O_i row (whole 32-byte sectors).
template <typename T, int TE, int kThreadsN>
struct ColRuns {
  static constexpr int kV16 = 16 / (int)sizeof(T), kV8 = 8 / (int)sizeof(T);
  static constexpr int kRun = TE % kV16 == 0 ? kV16 : (kV8 >= 1 && TE % kV8 == 0) ? kV8 : 1;
  static constexpr int kRuns = TE / kRun;
  static __device__ __forceinline__ int col(int r, int tn) { return (r * kThreadsN + tn) * kRun; }
};

// dst[0 .. kN) = src[0 .. kN) in AccT by one kN-element load (src aligned to it: a ColRuns run).
template <int kN, typename AccT, typename T>
__device__ __forceinline__ void load_run(AccT* dst, const T* src) {
  struct alignas(kN * sizeof(T)) Unit { T v[kN]; };
  const Unit x = *reinterpret_cast<const Unit*>(src);
#pragma unroll
  for (int i = 0; i < kN; ++i) dst[i] = to_acc<AccT>(x.v[i]);
}

// dst[0 .. min(n, kN)) = src[0 .. kN) * mult as T: one kN-element store where all kN are stored and dst
// is aligned to it (a ColRuns run of an aligned row), else element by element.
template <int kN, typename T, typename AccT>
__device__ __forceinline__ void store_run(T* dst, const AccT* src, AccT mult, int n) {
  constexpr int kBytes = kN * (int)sizeof(T);
  if (kN > 1 && n >= kN && reinterpret_cast<unsigned long long>(dst) % kBytes == 0) {
    struct alignas(kBytes) Unit { T v[kN]; };
    Unit x;
#pragma unroll
    for (int i = 0; i < kN; ++i) x.v[i] = from_acc<T>(src[i] * mult);
    fa::gstore(reinterpret_cast<Unit*>(dst), x);
    return;
  }
#pragma unroll
  for (int e = 0; e < kN; ++e)
    if (e < n) fa::gstore(dst + e, from_acc<T>(src[e] * mult));
}

template <typename T, int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN, int kThreadsM, int kThreadsN,
          bool Is_causal, bool Is_aligned, int kExt = 0, bool Has_seqlens_k = false, bool Is_paged = false>
__global__ void __launch_bounds__(kThreadsM * kThreadsN, kMinBlocksPerSm)
flash_fwd_simt_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                      T* __restrict__ o, typename AccumType<T>::type* __restrict__ lse,
                      int Lq, int Lk, int D, int Dv, int nb2,
                      long long q_b0, long long q_b1, long long q_b2, long long q_row,
                      long long k_b0, long long k_b1, long long k_b2, long long k_row,
                      long long v_b0, long long v_b1, long long v_b2, long long v_row,
                      long long o_b0, long long o_b1, long long o_b2, long long o_row,
                      long long lse_b0, long long lse_b1, long long lse_b2,
                      typename AccumType<T>::type scale_log2,
                      const int* __restrict__ seqlens_k, const int* __restrict__ block_table,
                      long long e_b0, long long e_b1, long long e_b2, long long table_row, int page_size,
                      long long k_page, long long v_page, FLASH_EXT_PARAMS(typename AccumType<T>::type)) {
  using Traits = FwdSimtTraits<T, kHeadDim, kHeadDimV, kBlockM, kBlockN, kThreadsM, kThreadsN>;
  using AccT = typename Traits::AccT;
  constexpr int kNThreads = Traits::kNThreads;
  constexpr int TM = Traits::kRowsPerThread;   // rows of S_ij / O_i per thread
  constexpr int TN = Traits::kColsPerThread;   // columns of S_ij per thread
  constexpr int TE = Traits::kColsVPerThread;  // columns of O_i per thread
  constexpr int kVec = Traits::kElemsPerCopy;  // elements per 16-byte shared-memory vector

  FA_DYNAMIC_SMEM(smem);
  T* sQ = reinterpret_cast<T*>(smem + Traits::kSmemQOffset);        // Q_i  Br × d
  T* sK = reinterpret_cast<T*>(smem + Traits::kSmemKOffset);        // K_j  Bc × d
  T* sV = reinterpret_cast<T*>(smem + Traits::kSmemVOffset);        // V_j  Bc × dv
  AccT* sP = reinterpret_cast<AccT*>(smem + Traits::kSmemPOffset);  // P_ij Br × Bc

  const int tid = static_cast<int>(threadIdx.x);
  const int tm = tid / kThreadsN;  // row group: rows tm·TM .. tm·TM + TM − 1
  const int tn = tid % kThreadsN;  // lane in the row group: columns tn, tn + kThreadsN, ...
  const int m0 = query_tile<Is_causal>(static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x)) * kBlockM;  // first query row of Q_i

  // ---- where this block's tensors live --------------------------------------------------------
  const BatchIndex bidx = BatchIndex::from_grid(nb2);
  const TensorStrides q_s{q_b0, q_b1, q_b2, q_row}, k_s{k_b0, k_b1, k_b2, k_row};
  const TensorStrides v_s{v_b0, v_b1, v_b2, v_row}, o_s{o_b0, o_b1, o_b2, o_row};
  const TensorStrides lse_s{lse_b0, lse_b1, lse_b2, 1};
  const T* q_i = q + bidx.offset(q_s) + m0 * q_row;
  const T* k_base = k + bidx.offset(k_s);
  const T* v_base = v + bidx.offset(v_s);
  T* o_i = o + bidx.offset(o_s) + m0 * o_row;
  AccT* lse_i = lse + bidx.offset(lse_s) + m0;

  // KV cache: the entry's key count (and its block-table row).
  KvRows<Has_seqlens_k, Is_paged> kv{seqlens_k, block_table, {e_b0, e_b1, e_b2, 0}, table_row, page_size};
  Lk = kv.keys(bidx, Lk);
  // Paged K/V with 16-byte aligned rows: the tensor-core forward's copy (flash_fwd_copy.cuh) —
  // each thread a fixed 16-byte chunk of rows r0 + p·kRowsPerPass, each 16-row group's page looked
  // up once per key tile (PageTable: one table read per page the tile touches, per warp; the kernel
  // relies on page_size being a multiple of 16, which forward_kvcache checks). K_j and V_j share the
  // lookup: `span` is made when K_j is loaded and kept for V_j (loaded at the top of the next
  // iteration). Unaligned rows, and tiles the plan does not take (Bc = 8), keep KvRows'
  // load_tile_paged (a lookup per row). Dense: Absent, no code.
  constexpr bool kPagedCopy = Is_paged && Is_aligned &&
                              paged_tile_copy_fits<T, kBlockN, kHeadDim, kNThreads>() &&
                              paged_tile_copy_fits<T, kBlockN, kHeadDimV, kNThreads>();
  using Pages = typename Pick<kPagedCopy, PageTable, Absent>::type;
  using PagedK = typename Pick<kPagedCopy, PagedTileCopy<T, kBlockN, kHeadDim, Traits::kStrideK, kNThreads>, Absent>::type;
  using PagedV = typename Pick<kPagedCopy, PagedTileCopy<T, kBlockN, kHeadDimV, Traits::kStrideV, kNThreads>, Absent>::type;
  const Pages pages(kv.block_table, page_size);
  const PagedK paged_k(k_row, D, tid);
  const PagedV paged_v(v_row, Dv, tid);
  PageSpan span{0, 0};  // K_j's pages, for V_j (lane g: group g's)
  static_assert(kExt == 0 || !Has_seqlens_k, "kExt is not combined with the KV cache");
  // Extensions: the entry's lengths (rows at or past Lq_b write out 0, lse −inf) and state.
  const ExtArgs<AccT> ext = FLASH_EXT_ARGS(AccT);
  Lk = ext.template seqlen_k<kExt>(bidx, Lk);
  const int Lq_b = ext.template seqlen_q<kExt>(bidx, Lq);
  const Mask<Is_causal, kExt, AccT> mask = make_mask<Is_causal, kExt>(Lq_b, Lk, ext, bidx);
  // Causal: key tiles entirely above the diagonal (for every row of Q_i) are never loaded.
  const int n_block_max = mask.n_block_max(m0, kBlockM, kBlockN);
  // Extensions: tiles visited upwards from the window's first one, all-False block-mask tiles
  // skipped (dense: every tile from 0).
  const KeyTileWalk<Is_causal, kExt, AccT> walk{mask, m0, kBlockM, kBlockN, mask.n_block_min(m0, kBlockN)};
  const int n_block_first = kExt == 0 ? 0 : walk.next(walk.lo - 1, n_block_max);
  const DropoutRng rng = ext.dropout(bidx);

  AccT acc_o[TM][TE];  // O_i, unnormalised
  OnlineSoftmaxRow<AccT> stat[TM];
#pragma unroll
  for (int a = 0; a < TM; ++a) {
    stat[a].init();
#pragma unroll
    for (int e = 0; e < TE; ++e) acc_o[a][e] = AccT(0);
  }

  // ---- prologue: Q_i and K_0 in flight ----------------------------------------------------------
  if (kExt == 0 ? n_block_max > 0 : n_block_first < n_block_max) {
    load_tile<T, kBlockM, kHeadDim, Traits::kStrideQ, kNThreads, Is_aligned>(
        sQ, q_i, q_row, rows_in_tile(m0, kBlockM, Lq_b), D, tid);
    if constexpr (kPagedCopy) {
      const int n0 = n_block_first * kBlockN;
      const int rows = rows_in_tile(n0, kBlockN, Lk);
      span = pages.template lookup<kBlockN>(n0, rows, tid % kWarpSize);
      paged_k.load(false, sK, k_base, k_page, span, rows);
    } else {
      kv.template load<T, kBlockN, kHeadDim, Traits::kStrideK, kNThreads, Is_aligned>(
          sK, k_base, k_row, k_page, n_block_first * kBlockN, rows_in_tile(n_block_first * kBlockN, kBlockN, Lk), D,
          tid);
    }
    fa::cp_async_commit();
  }

  int next = 0;  // extensions: the tile after K_j (dense: n_block + 1)
  for (int n_block = n_block_first; n_block < n_block_max; n_block = (kExt == 0 ? n_block + 1 : next)) {
    if constexpr (kExt != 0) next = walk.next(n_block, n_block_max);
    const int n0 = n_block * kBlockN;  // first key row of K_j, V_j

    fa::cp_async_wait<0>();
    // Barrier: Q_i and K_j have landed for every thread's copies, and every thread has finished
    // reading V_{j−1} (previous iteration), so sV may be overwritten.
    __syncthreads();
    if constexpr (kPagedCopy)
      paged_v.load(false, sV, v_base, v_page, span, rows_in_tile(n0, kBlockN, Lk));  // K_j's lookup
    else
      kv.template load<T, kBlockN, kHeadDimV, Traits::kStrideV, kNThreads, Is_aligned>(
          sV, v_base, v_row, v_page, n0, rows_in_tile(n0, kBlockN, Lk), Dv, tid);
    fa::cp_async_commit();

    // -- S_ij = Q_i K_jᵀ (raw dot products) --
    AccT acc_s[TM][TN];
#pragma unroll
    for (int a = 0; a < TM; ++a)
#pragma unroll
      for (int b = 0; b < TN; ++b) acc_s[a][b] = AccT(0);
#pragma unroll 2
    for (int dk = 0; dk < kHeadDim; dk += kVec) {
      Vec16<T> qv[TM], kv[TN];
#pragma unroll
      for (int a = 0; a < TM; ++a)
        qv[a] = *reinterpret_cast<const Vec16<T>*>(sQ + (tm * TM + a) * Traits::kStrideQ + dk);
#pragma unroll
      for (int b = 0; b < TN; ++b)
        kv[b] = *reinterpret_cast<const Vec16<T>*>(sK + (b * kThreadsN + tn) * Traits::kStrideK + dk);
#pragma unroll
      for (int x = 0; x < kVec; ++x)
#pragma unroll
        for (int a = 0; a < TM; ++a)
#pragma unroll
          for (int b = 0; b < TN; ++b)
            acc_s[a][b] += to_acc<AccT>(qv[a].v[x]) * to_acc<AccT>(kv[b].v[x]);
    }

    fa::cp_async_wait<0>();
    // Barrier: V_j has landed for every thread's copies, and every thread has finished reading
    // K_j, so sK may receive K_{j+1} while we do the softmax and P_ij V_j.
    __syncthreads();
    if (kExt == 0 ? n_block + 1 < n_block_max : next < n_block_max) {
      const int n1 = kExt == 0 ? n0 + kBlockN : next * kBlockN;
      if constexpr (kPagedCopy) {
        const int rows = rows_in_tile(n1, kBlockN, Lk);
        span = pages.template lookup<kBlockN>(n1, rows, tid % kWarpSize);  // kept for V_{j+1}
        paged_k.load(false, sK, k_base, k_page, span, rows);
      } else {
        kv.template load<T, kBlockN, kHeadDim, Traits::kStrideK, kNThreads, Is_aligned>(
            sK, k_base, k_row, k_page, n1, rows_in_tile(n1, kBlockN, Lk), D, tid);
      }
    }
    fa::cp_async_commit();

    // -- scale by scale·log2(e), mask only tiles that cross the diagonal or the sequence end --
    // (extensions: softcap / ALiBi on every score, the walk says which tiles need the mask)
    const bool tile_masked = kExt == 0 ? mask.needs_mask(m0, n0, kBlockM, kBlockN) : walk.masked(n_block);
#pragma unroll
    for (int a = 0; a < TM; ++a)
#pragma unroll
      for (int b = 0; b < TN; ++b) {
        AccT s = acc_s[a][b];
        if constexpr (Mask<Is_causal, kExt, AccT>::kScoreMod) s = mask.score(s, m0 + tm * TM + a, n0 + b * kThreadsN + tn);
        s *= scale_log2;
        if (tile_masked) s = mask.apply(s, m0 + tm * TM + a, n0 + b * kThreadsN + tn);
        acc_s[a][b] = s;
      }

    // -- online softmax: update m_i, rescale O_i and l_i, P_ij = exp2(S_ij − m_i) --
#pragma unroll
    for (int a = 0; a < TM; ++a) {
      AccT tile_max = acc_s[a][0];
#pragma unroll
      for (int b = 1; b < TN; ++b) tile_max = max_acc(tile_max, acc_s[a][b]);
      tile_max = group_allreduce_max<kThreadsN>(tile_max);
      const AccT correction = stat[a].update_max(tile_max);
#pragma unroll
      for (int e = 0; e < TE; ++e) acc_o[a][e] *= correction;
      const AccT m_sub = stat[a].max_for_exp();
#pragma unroll
      for (int b = 0; b < TN; ++b) {
        AccT p = OnlineSoftmaxRow<AccT>::prob(acc_s[a][b], m_sub);
        stat[a].l += p;  // undropped: the LSE is that of the undropped scores
        if constexpr (HasExt<kExt, kExtDropout>::value)  // one Philox call per element (simple)
          p = dropout_keep(rng, m0 + tm * TM + a, n0 + b * kThreadsN + tn) ? p : AccT(0);
        sP[(tm * TM + a) * Traits::kStrideP + b * kThreadsN + tn] = p;
      }
    }
    // Warp barrier: a row of P_ij is written by the kThreadsN lanes of its row group (one warp)
    // and read by all of them below.
    __syncwarp(0xffffffffu);

    // -- O_i += P_ij V_j, keys ascending: per kPVec keys one 16-byte load of each of the thread's
    //    P rows (its row group reads the same vector: a broadcast), then per key its TE columns of
    //    V_j (ColRuns: 16-byte loads where they are whole vectors) --
    constexpr int kPVec = Traits::kPVec;
    using Runs = ColRuns<T, TE, kThreadsN>;
#pragma unroll 2
    for (int c0 = 0; c0 < kBlockN; c0 += kPVec) {
      Vec16<AccT> p[TM];
#pragma unroll
      for (int a = 0; a < TM; ++a)
        p[a] = *reinterpret_cast<const Vec16<AccT>*>(sP + (tm * TM + a) * Traits::kStrideP + c0);
#pragma unroll
      for (int cc = 0; cc < kPVec; ++cc) {
        AccT ve[TE];
#pragma unroll
        for (int r = 0; r < Runs::kRuns; ++r)
          load_run<Runs::kRun>(ve + r * Runs::kRun, sV + (c0 + cc) * Traits::kStrideV + Runs::col(r, tn));
#pragma unroll
        for (int e = 0; e < TE; ++e)
#pragma unroll
          for (int a = 0; a < TM; ++a) acc_o[a][e] += p[a].v[cc] * ve[e];
      }
    }
    // Warp barrier: every lane has read this row group's P_ij before the next iteration
    // overwrites it.
    __syncwarp(0xffffffffu);
  }

  // ---- epilogue: O_i / l_i once, LSE = (m_i + log2 l_i)·ln 2 ------------------------------------
#pragma unroll
  for (int a = 0; a < TM; ++a) {
    const AccT l_total = group_allreduce_sum<kThreadsN>(stat[a].l);
    // Extensions: rows past the entry's length are not live (out 0, lse −inf).
    const bool live = kExt == 0 || m0 + tm * TM + a < Lq_b;
    const AccT inv_l = ext_inv_sum<kExt>(stat[a], l_total, live, ext);
    const int row = m0 + tm * TM + a;
    if (row < Lq) {
      using Runs = ColRuns<T, TE, kThreadsN>;
#pragma unroll
      for (int r = 0; r < Runs::kRuns; ++r)
        store_run<Runs::kRun>(o_i + (tm * TM + a) * o_row + Runs::col(r, tn), acc_o[a] + r * Runs::kRun, inv_l,
                              Dv - Runs::col(r, tn));
      if (tn == 0) fa::gstore(lse_i + tm * TM + a, live ? stat[a].lse(l_total) : neg_inf<AccT>());
    }
  }
}

}  // namespace flash
