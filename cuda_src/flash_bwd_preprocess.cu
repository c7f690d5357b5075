// flash_bwd_preprocess.cu — the backward's first pass: D_i = rowsum(dO_i o O_i).
//
//   dO   Lq x Dv  (element type T, strided)      O  Lq x Dv  (T, strided)
//   D    Lq       (AccT, strided by batch, contiguous rows)
// dS = P o (dP - D) needs D_i = sum_j P_ij dP_ij = rowsum(dO_i o O_i) (the identity of the
// FlashAttention backward), computed here in one pass over dO and O. In the atomic dQ mode the
// same pass clears the AccT dQ accumulator the dK/dV kernel adds into, so that no separate memset
// is needed: n_accum contiguous elements per batch entry (Lq x D row-major for the SIMT kernel;
// the padded ceil(Lq / Br) * Br x padded-D DQAccumLayout for the tensor-core kernel, then the
// ordered mode's int32 counters, DQOrderCounters), each block a contiguous slice of whole
// 32-element runs, consecutive threads consecutive elements (coalesced whatever the layout).
//
// One warp per row: lanes stride over the row, a butterfly shuffle sums the 32 partial sums
// (a fixed order, so D is bitwise reproducible).
#include "flash_bwd_common.cuh"

namespace fa_bwd {
constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
}  // namespace fa_bwd
using namespace fa_bwd;

template <typename T, typename AccT, int kNThreads, bool kZeroDQAccum>
__global__ void __launch_bounds__(kNThreads) flash_bwd_preprocess_kernel(
    const T* __restrict__ dout, long long do_b0, long long do_b1, long long do_b2, long long do_row,
    const T* __restrict__ out, long long o_b0, long long o_b1, long long o_b2, long long o_row,
    AccT* __restrict__ delta, long long d_b0, long long d_b1, long long d_b2,
    AccT* __restrict__ dq_accum, long long dqa_b0, long long dqa_b1, long long dqa_b2,
    long long n_accum, int Lq, int Dv, int nb2) {
    static_assert(kNThreads % kWarpSize == 0, "preprocess: block must be whole warps");
    constexpr int kRowsPerBlock = kNThreads / kWarpSize;  // one warp per row

    const BatchIndex b = BatchIndex::from_grid(nb2);

    // -- atomic dQ modes: clear this block's slice of the batch entry's accumulator (and the
    //    ordered mode's counters after it), slices of whole 32-element runs so that warps store
    //    whole sectors. Before any warp leaves.
    if (kZeroDQAccum) {
        const long long per_block = ((n_accum + gridDim.x - 1) / gridDim.x + 31) / 32 * 32;
        const long long lo = min((long long)blockIdx.x * per_block, n_accum);
        const long long hi = min(lo + per_block, n_accum);
        AccT* acc = dq_accum + b.offset({dqa_b0, dqa_b1, dqa_b2, 0});
        for (long long e = lo + (int)threadIdx.x; e < hi; e += kNThreads) fa::gstore(acc + e, AccT(0));
    }

    const int warp = (int)threadIdx.x / kWarpSize;
    const int lane = (int)threadIdx.x % kWarpSize;
    const int row = (int)blockIdx.x * kRowsPerBlock + warp;
    if (row >= Lq) return;  // whole warp leaves together: no shuffle is left waiting

    const T* dO_i = dout + b.offset({do_b0, do_b1, do_b2, do_row}) + (long long)row * do_row;
    const T* O_i = out + b.offset({o_b0, o_b1, o_b2, o_row}) + (long long)row * o_row;

    // -- D_i = sum_d dO_i[d] * O_i[d], each lane a strided slice, then a fixed butterfly.
    AccT partial = AccT(0);
    for (int d = lane; d < Dv; d += kWarpSize)
        partial += to_acc(fa::gload(dO_i + d)) * to_acc(fa::gload(O_i + d));
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
        partial += __shfl_xor_sync(kFullMask, partial, offset);
    if (lane == 0)
        fa::gstore(delta + b.offset({d_b0, d_b1, d_b2, 0}) + row, partial);
}
