// flash_fwd_combine.cu — the second kernel of split-KV ("flash-decoding"): merges the partial
// results of the key splits by log-sum-exp.
//
// flash_fwd_kernel<..., Is_split = true> leaves, for every batch entry b, split s and query row i,
//   O_s[b, s, i, :]  fp32, attention of row i over split s's keys (normalised by its own sum),
//   L_s[b, s, i]     fp32, natural-log log-sum-exp of those scores (−inf: the split saw no key).
// The exact attention over all keys is then (the same formula as flasharray.merge_attention)
//   lse = log Σ_s exp(L_s),   out = Σ_s exp(L_s − lse) · O_s.
// A split with L_s = −inf has weight 0 and is skipped (its O_s is never multiplied, so nothing
// it holds can make a NaN); a row with L_s = −inf in every split gets out = 0, lse = −inf.
//
// One thread block of kNWarps warps per kNWarps query rows of one batch entry (the batch grid
// convention of flash_block_info.cuh: grid = (ceil(Lq / kNWarps), nb1·nb2, nb0)).
//   Phase 1: warp w owns row r0 + w; its lanes walk the splits (s = lane, lane + 32, ...) for the
//            max and the sum of exp(L_s − max) (warp all-reduces), lane 0 writes lse, and each
//            split's weight exp(L_s − lse) goes to shared memory (splits × kNWarps floats,
//            dynamic: the host passes splits · kNWarps · 4 bytes).
//   Phase 2: the block's threads walk the kNWarps × Dv outputs, consecutive threads on consecutive
//            columns (coalesced O_s reads and out writes), Σ_s w_s · O_s in fp32, one rounding.
#include "fa_port.cuh"
#include "flash_kernel_traits.cuh"
#include "flash_block_info.cuh"
#include "flash_softmax.cuh"

namespace flash {

template <typename T, int kNWarps>
__global__ void __launch_bounds__(kNWarps * 32, kMinBlocksPerSm)
flash_fwd_combine_kernel(const float* __restrict__ o_acc, const float* __restrict__ lse_acc,
                         T* __restrict__ o, float* __restrict__ lse,
                         int Lq, int Dv, int splits, int nb2,
                         long long oa_b0, long long oa_b1, long long oa_b2, long long oa_row,
                         long long la_b0, long long la_b1, long long la_b2,
                         long long o_b0, long long o_b1, long long o_b2, long long o_row,
                         long long lse_b0, long long lse_b1, long long lse_b2) {
  constexpr int kNThreads = kNWarps * kWarpSize;
  constexpr int kRows = kNWarps;  // query rows per block
  FA_DYNAMIC_SMEM(smem);
  float* s_weight = reinterpret_cast<float*>(smem);  // [splits][kRows]

  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  const int r0 = static_cast<int>(blockIdx.x) * kRows;

  const BatchIndex bidx = BatchIndex::from_grid(nb2);
  const TensorStrides oa_s{oa_b0, oa_b1, oa_b2, oa_row}, la_s{la_b0, la_b1, la_b2, 1};
  const TensorStrides o_s{o_b0, o_b1, o_b2, o_row}, lse_s{lse_b0, lse_b1, lse_b2, 1};
  // Split s of row i: O_s at (s·Lq + i)·oa_row, L_s at s·Lq + i (workspace (*batch, splits, Lq, ·)).
  const float* oa = o_acc + bidx.offset(oa_s);
  const float* la = lse_acc + bidx.offset(la_s);
  const long long split_rows = Lq;

  // ---- phase 1: per row, the merged lse and every split's weight ------------------------------
  {
    const int row = r0 + warp;
    float m = -INFINITY;
    if (row < Lq)
      for (int s = lane; s < splits; s += kWarpSize) m = fmaxf(m, fa::gload(la + s * split_rows + row));
    m = group_allreduce_max<kWarpSize>(m);
    // −inf: no split saw a key (take 0 so that no −inf − (−inf) is formed).
    const float m_safe = m == -INFINITY ? 0.0f : m;
    float sum = 0.0f;
    if (row < Lq)
      for (int s = lane; s < splits; s += kWarpSize) {
        const float l_s = fa::gload(la + s * split_rows + row);
        if (l_s != -INFINITY) sum += expf(l_s - m_safe);
      }
    sum = group_allreduce_sum<kWarpSize>(sum);
    const float lse_row = sum == 0.0f ? -INFINITY : m_safe + logf(sum);
    if (row < Lq) {
      for (int s = lane; s < splits; s += kWarpSize) {
        const float l_s = fa::gload(la + s * split_rows + row);
        s_weight[s * kRows + warp] = (l_s == -INFINITY || sum == 0.0f) ? 0.0f : expf(l_s - lse_row);
      }
      if (lane == 0) fa::gstore(lse + bidx.offset(lse_s) + row, lse_row);
    }
  }
  __syncthreads();

  // ---- phase 2: out = Σ_s w_s · O_s, rounded once --------------------------------------------------
  T* o_blk = o + bidx.offset(o_s);
  const int rows = Lq - r0 < kRows ? Lq - r0 : kRows;
  for (int idx = tid; idx < rows * Dv; idx += kNThreads) {
    const int r = idx / Dv, c = idx % Dv;
    const int row = r0 + r;
    float acc = 0.0f;
    for (int s = 0; s < splits; ++s) {
      const float w = s_weight[s * kRows + r];
      if (w != 0.0f) acc += w * fa::gload(oa + (s * split_rows + row) * oa_row + c);
    }
    fa::gstore(o_blk + row * o_row + c, from_acc<T>(acc));
  }
}

}  // namespace flash
