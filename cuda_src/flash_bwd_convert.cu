// flash_bwd_convert.cu — the atomic dQ mode's last pass: the AccT dQ accumulator the dK/dV kernel
// summed with atomics -> dQ in the output type, strided.
//
//   flash_bwd_convert_dq_kernel     (SIMT dK/dV kernel) row-major Lq x D accumulator, already
//                                   times scale; grid = (ceil(Lq / kRowsPerBlock), nb1 * nb2, nb0).
//   flash_bwd_convert_dq_tc_kernel  (tensor-core dK/dV kernel) the padded, fragment-ordered
//                                   accumulator of flash_bwd_common.cuh's DQAccumLayout, unscaled;
//                                   grid = (ceil(Lq / kBlockM), nb1 * nb2, nb0), one query block each.
#include "flash_bwd_common.cuh"
#include "flash_kernel_traits.cuh"  // flash::Vec16 (two doubles)

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

// One query block: each thread converts 16-byte-of-fp16 chunks, 8 consecutive columns of one row
// (8 n + 0..7 of row g + 8 h of a 16 x kDQCols tile). In DQAccumLayout those 8 elements are two
// runs of 4 consecutive lanes' elements (n, 2 h + 0) and (n, 2 h + 1): columns 0, 2, 4, 6 and
// 1, 3, 5, 7 (AccT = float: one float4 each; double: two double2 each). Chunks are dealt so that a
// warp's 32 threads take rows g = 0..7 (lane % 8) of 4 consecutive column chunks (lane / 8): each
// 16-byte load of 8 threads covers 128 contiguous bytes, and each row's 4 chunks are 64 contiguous
// bytes of dQ (fp16). kVec: 16-byte stores (OutT = T: one of 8 x 2 bytes; float: two; double:
// four) — the caller guarantees 16-byte aligned rows, D % 8 == 0; otherwise element stores.
// AccT: the accumulator's type, float (fp16/bf16 dK/dV kernel) or double (flash_bwd_f64.cu).
template <typename OutT, int kNThreads, int kBlockM, int kHeadDim, bool kVec, typename AccT = float>
__global__ void __launch_bounds__(kNThreads) flash_bwd_convert_dq_tc_kernel(
    const AccT* __restrict__ dq_accum, long long a_b0, long long a_b1, long long a_b2,
    OutT* __restrict__ dq, long long dq_b0, long long dq_b1, long long dq_b2, long long dq_row,
    int Lq, int D, int nb2, AccT scale) {
    using A = DQAccumLayout<kHeadDim>;
    using Dbl2 = flash::Vec16<double>;
    static_assert(kNThreads % 32 == 0, "convert: block must be whole warps");
    static_assert(kBlockM % 16 == 0, "convert: query blocks are whole 16-row tiles");
    constexpr int kChunksPerRow = kHeadDim / 8;
    constexpr int kChunks = kBlockM * kChunksPerRow;  // 8-column chunks of the query block
    const BatchIndex b = BatchIndex::from_grid(nb2);
    const int r0 = (int)blockIdx.x * kBlockM;
    const AccT* src = dq_accum + b.offset({a_b0, a_b1, a_b2, 0}) + (long long)r0 * kHeadDim;
    OutT* dst = dq + b.offset({dq_b0, dq_b1, dq_b2, dq_row}) + (long long)r0 * dq_row;
#pragma unroll 1
    for (int j = (int)threadIdx.x; j < kChunks; j += kNThreads) {
        // j = ((tm * 2 + h) * kChunksPerRow + chunk) * 8 + g
        const int g = j % 8, chunk = (j / 8) % kChunksPerRow, h = (j / (8 * kChunksPerRow)) % 2;
        const int tm = j / (16 * kChunksPerRow);
        const int r = tm * 16 + 8 * h + g, c = chunk * 8;
        if (r0 + r >= Lq || c >= D) continue;
        const AccT* s = src + A::offset(r, c);  // column c (even: e % 2 = 0) of row r, lane 4 g
        AccT v[8];                              // columns c .. c + 7
        if constexpr (sizeof(AccT) == 4) {
            const float4 even = fa::gload(reinterpret_cast<const float4*>(s));      // columns c, c+2, c+4, c+6
            const float4 odd = fa::gload(reinterpret_cast<const float4*>(s + 32));  // columns c+1, c+3, ...
            const float w[8] = {even.x, odd.x, even.y, odd.y, even.z, odd.z, even.w, odd.w};
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = w[i];
        } else {
            static_assert(sizeof(AccT) == 8, "convert: float or double accumulator");
#pragma unroll
            for (int k = 0; k < 2; ++k) {  // columns c + 4k, +2 (even) and c + 4k + 1, +3 (odd)
                const Dbl2 even = fa::gload(reinterpret_cast<const Dbl2*>(s) + k);
                const Dbl2 odd = fa::gload(reinterpret_cast<const Dbl2*>(s + 32) + k);
                v[4 * k] = even.v[0], v[4 * k + 1] = odd.v[0], v[4 * k + 2] = even.v[1], v[4 * k + 3] = odd.v[1];
            }
        }
        OutT* d = dst + (long long)r * dq_row + c;
        if (kVec) {
            if constexpr (sizeof(OutT) == 2) {
                const uint4 w = {fa::pack2<OutT>(v[0] * scale, v[1] * scale), fa::pack2<OutT>(v[2] * scale, v[3] * scale),
                                 fa::pack2<OutT>(v[4] * scale, v[5] * scale), fa::pack2<OutT>(v[6] * scale, v[7] * scale)};
                fa::gstore(reinterpret_cast<uint4*>(d), w);
            } else if constexpr (sizeof(OutT) == 4) {
                fa::gstore(reinterpret_cast<float4*>(d), float4{v[0] * scale, v[1] * scale, v[2] * scale, v[3] * scale});
                fa::gstore(reinterpret_cast<float4*>(d) + 1, float4{v[4] * scale, v[5] * scale, v[6] * scale, v[7] * scale});
            } else {
                static_assert(sizeof(OutT) == 8, "convert: 16-bit, float or double output");
#pragma unroll
                for (int k = 0; k < 4; ++k)
                    fa::gstore(reinterpret_cast<Dbl2*>(d) + k, Dbl2{{v[2 * k] * scale, v[2 * k + 1] * scale}});
            }
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i)
                if (c + i < D) fa::gstore(d + i, FromAcc<OutT>::convert(v[i] * scale));
        }
    }
}
