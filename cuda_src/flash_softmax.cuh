// flash_softmax.cuh — the online softmax of FlashAttention, one query row at a time.
//
// Scores arrive already multiplied by scale·log2(e) (folded into one multiply), so the
// softmax is computed with exp2:  exp(scale·s − scale·m) = exp2(s·scale·log2e − m·scale·log2e).
// For each row the kernel keeps
//   m_i — the running maximum of the (log2-scaled) scores seen so far,
//   l_i — the running sum of exp2(score − m_i) (each thread may keep a partial sum over the
//         columns it owns; the partial sums are combined once, at the end),
// and, after every new key tile with row maximum m̃, rescales O_i and l_i by exp2(m_i − m_new)
// (the correction of Algorithm 1, line 11). At the end O_i is divided by l_i once, and the
// log-sum-exp in natural log is  lse = (m_i + log2 l_i) · ln 2.
//
// -inf guards: a row whose scores so far are all masked has m_i = -inf; then
//   * exp2(s − m_i) would be exp2(-inf − -inf) = NaN, so the subtrahend is taken as 0 instead
//     (all s are -inf too, so every p = exp2(-inf) = 0);
//   * the correction exp2(m_old − m_new) with both -inf would be NaN; it is taken as 1
//     (O_i and l_i are still 0, any factor works);
//   * a row that never sees a key ends with l_i = 0: out = 0, lse = -inf.
#pragma once
#include "fa_port.cuh"
#include "flash_ext.cuh"

namespace flash {

constexpr float kLog2e = 1.4426950408889634f;  // log2(e): exp(x) = exp2(x · log2(e))
constexpr float kLn2 = 0.6931471805599453f;    // ln(2):   log(x) = log2(x) · ln(2)
constexpr double kLog2eD = 1.4426950408889634;
constexpr double kLn2D = 0.6931471805599453;

template <typename AccT> __device__ __forceinline__ AccT neg_inf() { return -static_cast<AccT>(INFINITY); }

// exp2 and log2 in the accumulation type (fast hardware exp2 for float).
__device__ __forceinline__ float exp2_acc(float x) { return exp2f(x); }
__device__ __forceinline__ double exp2_acc(double x) { return exp2(x); }
__device__ __forceinline__ float log2_acc(float x) { return log2f(x); }
__device__ __forceinline__ double log2_acc(double x) { return log2(x); }
__device__ __forceinline__ float fma_acc(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double fma_acc(double a, double b, double c) { return fma(a, b, c); }
__device__ __forceinline__ float max_acc(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_acc(double a, double b) { return a > b ? a : b; }
__device__ __forceinline__ float ln2_acc(float) { return kLn2; }
__device__ __forceinline__ double ln2_acc(double) { return kLn2D; }
__device__ __forceinline__ float log2e_acc(float) { return kLog2e; }
__device__ __forceinline__ double log2e_acc(double) { return kLog2eD; }

// All-reduce over kWidth consecutive lanes (a power of two <= 32) that share one row:
// every lane of the group ends with the group's max / sum.
template <int kWidth, typename AccT>
__device__ __forceinline__ AccT group_allreduce_max(AccT x) {
  static_assert(kWidth >= 1 && kWidth <= 32 && (kWidth & (kWidth - 1)) == 0,
                "row group width must be a power of two <= 32");
#pragma unroll
  for (int offset = kWidth / 2; offset > 0; offset /= 2)
    x = max_acc(x, __shfl_xor_sync(0xffffffffu, x, offset, kWidth));
  return x;
}

template <int kWidth, typename AccT>
__device__ __forceinline__ AccT group_allreduce_sum(AccT x) {
  static_assert(kWidth >= 1 && kWidth <= 32 && (kWidth & (kWidth - 1)) == 0,
                "row group width must be a power of two <= 32");
#pragma unroll
  for (int offset = kWidth / 2; offset > 0; offset /= 2)
    x += __shfl_xor_sync(0xffffffffu, x, offset, kWidth);
  return x;
}

// Running statistics (m_i, l_i) of one query row, in log2-scaled score units.
template <typename AccT>
struct OnlineSoftmaxRow {
  AccT m;  // running max of scaled scores (-inf until a visible score arrives)
  AccT l;  // running (possibly per-thread partial) sum of exp2(score - m)

  __device__ __forceinline__ void init() {
    m = neg_inf<AccT>();
    l = AccT(0);
  }

  // Fold in a new tile whose row max (already reduced over the row's threads) is tile_max.
  // Returns the factor exp2(m_old − m_new) by which the caller rescales its O_i row;
  // l_i is rescaled here.
  __device__ __forceinline__ AccT update_max(AccT tile_max) {
    return update_max(tile_max, [](AccT x) { return exp2_acc(x); });
  }

  // The same with the caller's 2^x for x <= 0 (the DMMA kernels' flash_f64_exp.cuh routine).
  template <class Exp2>
  __device__ __forceinline__ AccT update_max(AccT tile_max, const Exp2& exp2_nonpositive) {
    const AccT m_new = max_acc(m, tile_max);
    // Both -inf: the row has seen nothing visible yet; any factor works, avoid NaN.
    const AccT correction = (m_new == neg_inf<AccT>()) ? AccT(1) : exp2_nonpositive(m - m_new);
    m = m_new;
    l *= correction;
    return correction;
  }

  // The value subtracted from scores before exp2: m_i, or 0 for an all-masked row so that
  // exp2(-inf − 0) = 0 rather than exp2(-inf − -inf) = NaN.
  __device__ __forceinline__ AccT max_for_exp() const { return m == neg_inf<AccT>() ? AccT(0) : m; }

  // p = exp2(s − m_i) for a scaled score s; m_sub is max_for_exp().
  __device__ __forceinline__ static AccT prob(AccT s, AccT m_sub) { return exp2_acc(s - m_sub); }

  // p = exp2(s·scale − m_i) for an UNSCALED score s (scale = softmax scale · log2(e) > 0): the
  // scale folds into one fused multiply-add per score (FlashAttention-2's trick). The row max
  // may be taken on unscaled scores: scale > 0 keeps the order, so max(s)·scale = max(s·scale).
  __device__ __forceinline__ static AccT prob_unscaled(AccT s, AccT scale, AccT m_sub) {
    return exp2_acc(fma_acc(s, scale, -m_sub));
  }

  // After l has been summed over the row's threads: 1/l_i (0 for a row that saw no key).
  __device__ __forceinline__ AccT inv_sum(AccT l_total) const {
    return l_total == AccT(0) ? AccT(0) : AccT(1) / l_total;
  }

  // Natural-log log-sum-exp of the row's scaled scores; -inf for a row that saw no key.
  __device__ __forceinline__ AccT lse(AccT l_total) const {
    if (l_total == AccT(0) || m == neg_inf<AccT>()) return neg_inf<AccT>();
    return (m + log2_acc(l_total)) * ln2_acc(AccT(0));
  }
};

// 1/l_i of a row at the end, with the extensions of kExt: times 1 / (1 − p) with dropout (the
// kept entries of P are scaled once, on O_i), and 0 for a row that is not `live` (at or past the
// entry's seqlens_q: out = 0). Plain inv_sum for kExt = 0.
template <int kExt, typename AccT>
__device__ __forceinline__ AccT ext_inv_sum(const OnlineSoftmaxRow<AccT>& stat, AccT l_total, bool live,
                                            const ExtArgs<AccT>& ext) {
  AccT inv = stat.inv_sum(l_total);
  if constexpr (HasExt<kExt, kExtDropout>::value) inv *= ext.dropout_scale;
  if constexpr (HasExt<kExt, kExtSeqlens>::value) inv = live ? inv : AccT(0);
  (void)live; (void)ext;
  return inv;
}

}  // namespace flash
