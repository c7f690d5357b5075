// flash_bwd_convert.cu — the atomic dQ mode's last pass: dQ (AccT accumulator, Lq x D, summed
// with atomics by the dK/dV kernel, already times scale) -> dQ in the element type T, strided.
// grid = (ceil(Lq / kRowsPerBlock), nb1 * nb2, nb0).
#include "flash_bwd_common.cuh"

using namespace fa_bwd;

template <typename T, typename AccT, int kNThreads, int kRowsPerBlock>
__global__ void __launch_bounds__(kNThreads) flash_bwd_convert_dq_kernel(
    const AccT* __restrict__ dq_accum, long long a_b0, long long a_b1, long long a_b2, long long a_row,
    T* __restrict__ dq, long long dq_b0, long long dq_b1, long long dq_b2, long long dq_row,
    int Lq, int D, int nb2) {
    static_assert(kNThreads % 32 == 0, "convert: block must be whole warps");
    static_assert(kRowsPerBlock >= 1, "convert: at least one row per block");
    const BatchIndex b = BatchIndex::from_grid(nb2);
    const int r0 = (int)blockIdx.x * kRowsPerBlock;
    const AccT* src = dq_accum + b.offset({a_b0, a_b1, a_b2, a_row});
    T* dst = dq + b.offset({dq_b0, dq_b1, dq_b2, dq_row});
    for (int e = (int)threadIdx.x; e < kRowsPerBlock * D; e += kNThreads) {
        const int r = r0 + e / D, d = e % D;
        if (r < Lq)
            fa::gstore(dst + (long long)r * dq_row + d,
                       FromAcc<T>::convert(fa::gload(src + (long long)r * a_row + d)));
    }
}
