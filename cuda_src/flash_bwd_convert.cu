// flash_bwd_convert.cu — the atomic dQ mode's last pass: the AccT dQ accumulator the dK/dV kernel
// summed with atomics -> dQ in the output type, strided.
//
//   flash_bwd_convert_dq_kernel     (SIMT dK/dV kernel) row-major Lq x D accumulator, already
//                                   times scale; grid = (ceil(Lq / kRowsPerBlock), nb1 * nb2, nb0).
//   flash_bwd_convert_dq_tc_kernel  (tensor-core dK/dV kernel) the padded, fragment-ordered
//                                   accumulator of flash_bwd_common.cuh's DQAccumLayout (kRowsInner: the
//                                   wgmma kernels' DQAccumWg), unscaled;
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

// The double accumulator of the DMMA dK/dV kernel (flash_bwd_f64.cu) -> dQ (double): each thread
// converts 4 consecutive columns c .. c + 3 (c = 8 n + 4 s) of one row g + 8 h of a 16 x kDQCols
// tile: in DQAccumLayout one 16-byte load of lane elements 4 g + 2 s, +1 of (n, 2 h) (columns c, c + 2)
// and one of (n, 2 h + 1) (c + 1, c + 3). Items are dealt so that the 16 threads s = j % 2,
// g = j / 2 % 8 of one chunk n cover 256 contiguous bytes per load; a pair exchange (lane ^ 1) makes
// each 16-byte store instruction write whole 64-byte row segments: lane s stores columns 8 n + 2 s,
// +1, then 8 n + 4 + 2 s, +1. kVec: D % 8 == 0 and 16-byte aligned rows, else element stores.
template <typename OutT, int kNThreads, int kBlockM, int kHeadDim, bool kVec>
__device__ __forceinline__ void convert_dq_tc_f64(const double* __restrict__ dq_accum, long long a_b0, long long a_b1,
                                                  long long a_b2, OutT* __restrict__ dq, long long dq_b0,
                                                  long long dq_b1, long long dq_b2, long long dq_row, int Lq, int D,
                                                  int nb2, double scale) {
    using A = DQAccumLayout<kHeadDim>;
    using Dbl2 = flash::Vec16<double>;
    static_assert(sizeof(OutT) == 8, "convert: a double accumulator gives double dQ");
    constexpr int kChunksPerRow = kHeadDim / 8;
    constexpr int kItems = kBlockM * kChunksPerRow * 2;  // 4-column items; a multiple of 64
    static_assert(kItems % 32 == 0, "warp-uniform trip counts (the pair exchange)");
    const BatchIndex b = BatchIndex::from_grid(nb2);
    const int r0 = (int)blockIdx.x * kBlockM;
    const double* src = dq_accum + b.offset({a_b0, a_b1, a_b2, 0}) + (long long)r0 * kHeadDim;
    OutT* dst = dq + b.offset({dq_b0, dq_b1, dq_b2, dq_row}) + (long long)r0 * dq_row;
#pragma unroll 1
    for (int j = (int)threadIdx.x; j < kItems; j += kNThreads) {
        // j = (((tm * 2 + h) * kChunksPerRow + chunk) * 8 + g) * 2 + s
        const int s = j % 2, g = (j / 2) % 8, chunk = (j / 16) % kChunksPerRow, h = (j / (16 * kChunksPerRow)) % 2;
        const int tm = j / (32 * kChunksPerRow);
        const int r = tm * 16 + 8 * h + g, c = chunk * 8 + 4 * s;
        // Rows < Lq and 8-column chunks starting below D are read (as the float path); every thread
        // takes part in the exchange (both lanes of a pair share the row and the chunk).
        const bool in = r0 + r < Lq && chunk * 8 < D;
        Dbl2 even{{0.0, 0.0}}, odd{{0.0, 0.0}};
        if (in) {
            const double* p = src + A::offset(r, c);
            even = fa::gload(reinterpret_cast<const Dbl2*>(p));      // columns c, c + 2
            odd = fa::gload(reinterpret_cast<const Dbl2*>(p + 32));  // columns c + 1, c + 3
        }
        const double v[4] = {even.v[0] * scale, odd.v[0] * scale, even.v[1] * scale, odd.v[1] * scale};
        // the partner's half: s = 0 needs partner's columns 0, 1 (its v[0], v[1]) for columns 8n + 4, 5;
        // s = 1 needs partner's v[2], v[3] (columns 8n + 2, 3)
        const double w0 = __shfl_xor_sync(0xffffffffu, s ? v[0] : v[2], 1);
        const double w1 = __shfl_xor_sync(0xffffffffu, s ? v[1] : v[3], 1);
        if (!in) continue;
        OutT* d = dst + (long long)r * dq_row + chunk * 8;
        if (kVec) {
            const Dbl2 first = s ? Dbl2{{w0, w1}} : Dbl2{{v[0], v[1]}};   // columns 2s, 2s + 1
            const Dbl2 second = s ? Dbl2{{v[2], v[3]}} : Dbl2{{w0, w1}};  // columns 4 + 2s, +1
            fa::gstore(reinterpret_cast<Dbl2*>(d + 2 * s), first);
            fa::gstore(reinterpret_cast<Dbl2*>(d + 4 + 2 * s), second);
        } else {
#pragma unroll
            for (int i = 0; i < 4; ++i)
                if (c + i < D) fa::gstore(d + 4 * s + i, v[i]);
        }
    }
}

// Eight consecutive dQ columns c .. c + 7 of one row (v: already times scale) at d: one 16-byte store (OutT 16-bit;
// float: two) where kVec (D % 8 == 0, 16-byte aligned rows), else the columns below D one by one.
template <typename OutT, bool kVec>
__device__ __forceinline__ void store_dq8(OutT* d, const float (&v)[8], int c, int D) {
    if (kVec) {
        if constexpr (sizeof(OutT) == 2) {
            const uint4 w = {fa::pack2<OutT>(v[0], v[1]), fa::pack2<OutT>(v[2], v[3]), fa::pack2<OutT>(v[4], v[5]),
                             fa::pack2<OutT>(v[6], v[7])};
            fa::gstore(reinterpret_cast<uint4*>(d), w);
        } else {
            static_assert(sizeof(OutT) == 4, "convert: 16-bit or float output");
            fa::gstore(reinterpret_cast<float4*>(d), float4{v[0], v[1], v[2], v[3]});
            fa::gstore(reinterpret_cast<float4*>(d) + 1, float4{v[4], v[5], v[6], v[7]});
        }
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i)
            if (c + i < D) fa::gstore(d + i, FromAcc<OutT>::convert(v[i]));
    }
}

// The wgmma kernels' accumulator (DQAccumWg: each 32-float group holds 4 rows x 8 columns row-major, the group
// (c % kDQCols / 8, r % 16 / 8, r % 2)), float only. A warp converts 1 KB at a time: the 8 groups of column blocks
// cq0, cq0 + 1 of one 16 x kDQCols tile (16 rows x 16 columns), by two float4 loads per lane of 512 contiguous bytes
// each. Lane l then holds row 8 (l / 16) + 2 ((l % 8) / 2) + (l / 8) % 2 of the tile at columns 8 cq0 + 4 (l % 2) .. +3
// (first load) and 8 further (second). A pair exchange (lane ^ 1) gives lane s = l % 2 the row's columns 8 (cq0 + s)
// .. +7 (store_dq8): 32 contiguous bytes of fp16 per pair.
template <typename OutT, int kNThreads, int kBlockM, int kHeadDim, bool kVec>
__device__ __forceinline__ void convert_dq_tc_wg(const float* __restrict__ src, OutT* __restrict__ dst, long long dq_row,
                                                 int rows, int D, float scale) {
    using A = DQAccumWg<kHeadDim>;
    static_assert(kNThreads % 32 == 0, "convert: block must be whole warps");
    constexpr int kUnits = kBlockM * kHeadDim / 256;  // 1 KB units of the query block
    const int lane = static_cast<int>(threadIdx.x) % 32, s = lane % 2;
    const int r_in = 8 * (lane / 16) + 2 * ((lane % 8) / 2) + (lane / 8) % 2;  // the lane's row in the 16-row tile
#pragma unroll 1
    for (int u = static_cast<int>(threadIdx.x) / 32; u < kUnits; u += kNThreads / 32) {  // (warp-uniform)
        const float4* p = reinterpret_cast<const float4*>(src + 256 * u) + lane;
        const float4 a = fa::gload(p), b = fa::gload(p + 32);
        const float4 x = s ? a : b;  // the partner's half: s = 0 needs its a (columns 4..7), s = 1 its b (8..11)
        const float4 y = {__shfl_xor_sync(0xffffffffu, x.x, 1), __shfl_xor_sync(0xffffffffu, x.y, 1),
                          __shfl_xor_sync(0xffffffffu, x.z, 1), __shfl_xor_sync(0xffffffffu, x.w, 1)};
        const float4 lo = s ? y : a, hi = s ? b : y;  // columns 8 (cq0 + s) .. +3, +4 .. +7
        const int tile = 256 * u / A::kTileFloats, cq0 = (256 * u % A::kTileFloats) / 128;
        const int r = (tile / A::kColTiles) * 16 + r_in, c = (tile % A::kColTiles) * A::kDQCols + 8 * (cq0 + s);
        if (r >= rows || c >= D) continue;
        const float v[8] = {lo.x * scale, lo.y * scale, lo.z * scale, lo.w * scale,
                            hi.x * scale, hi.y * scale, hi.z * scale, hi.w * scale};
        store_dq8<OutT, kVec>(dst + static_cast<long long>(r) * dq_row + c, v, c, D);
    }
}

// One query block: each thread converts 16-byte-of-fp16 chunks, 8 consecutive columns of one row
// (8 n + 0..7 of row g + 8 h of a 16 x kDQCols tile). In DQAccumLayout those 8 floats are two
// float4 of 4 consecutive lanes' elements (n, 2 h + 0) and (n, 2 h + 1): columns 0, 2, 4, 6 and
// 1, 3, 5, 7. Chunks are dealt so that a warp's 32 threads take rows g = 0..7 (lane % 8) of 4
// consecutive column chunks (lane / 8): each float4 load of 8 threads covers 128 contiguous bytes,
// and each row's 4 chunks are 64 contiguous bytes of dQ (fp16). kVec: one 16-byte store per
// chunk (OutT = T: 8 x 2 bytes; OutT = float: two) — the caller guarantees 16-byte aligned rows,
// D % 8 == 0; otherwise element stores.
// AccT: the accumulator's type, float (the fp16/bf16 dK/dV kernel) or double (flash_bwd_f64.cu:
// convert_dq_tc_f64 above). kRowsInner: the wgmma kernels' DQAccumWg (convert_dq_tc_wg above; float).
template <typename OutT, int kNThreads, int kBlockM, int kHeadDim, bool kVec, typename AccT = float,
          bool kRowsInner = false>
__global__ void __launch_bounds__(kNThreads) flash_bwd_convert_dq_tc_kernel(
    const AccT* __restrict__ dq_accum, long long a_b0, long long a_b1, long long a_b2,
    OutT* __restrict__ dq, long long dq_b0, long long dq_b1, long long dq_b2, long long dq_row,
    int Lq, int D, int nb2, AccT scale) {
    static_assert(!kRowsInner || sizeof(AccT) == 4, "DQAccumWg: the float accumulator of the wgmma kernels");
    if constexpr (kRowsInner) {
        const BatchIndex b = BatchIndex::from_grid(nb2);
        const int r0 = (int)blockIdx.x * kBlockM;
        convert_dq_tc_wg<OutT, kNThreads, kBlockM, kHeadDim, kVec>(
            dq_accum + b.offset({a_b0, a_b1, a_b2, 0}) + (long long)r0 * kHeadDim,
            dq + b.offset({dq_b0, dq_b1, dq_b2, dq_row}) + (long long)r0 * dq_row, dq_row, Lq - r0, D, scale);
    } else if constexpr (sizeof(AccT) == 8) {
        convert_dq_tc_f64<OutT, kNThreads, kBlockM, kHeadDim, kVec>(dq_accum, a_b0, a_b1, a_b2, dq, dq_b0, dq_b1,
                                                                     dq_b2, dq_row, Lq, D, nb2, scale);
    } else {
        using A = DQAccumLayout<kHeadDim>;
        static_assert(kNThreads % 32 == 0, "convert: block must be whole warps");
        static_assert(kBlockM % 16 == 0, "convert: query blocks are whole 16-row tiles");
        constexpr int kChunksPerRow = kHeadDim / 8;
        constexpr int kChunks = kBlockM * kChunksPerRow;  // 8-column chunks of the query block
        const BatchIndex b = BatchIndex::from_grid(nb2);
        const int r0 = (int)blockIdx.x * kBlockM;
        const float* src = dq_accum + b.offset({a_b0, a_b1, a_b2, 0}) + (long long)r0 * kHeadDim;
        OutT* dst = dq + b.offset({dq_b0, dq_b1, dq_b2, dq_row}) + (long long)r0 * dq_row;
    #pragma unroll 1
        for (int j = (int)threadIdx.x; j < kChunks; j += kNThreads) {
            // j = ((tm * 2 + h) * kChunksPerRow + chunk) * 8 + g
            const int g = j % 8, chunk = (j / 8) % kChunksPerRow, h = (j / (8 * kChunksPerRow)) % 2;
            const int tm = j / (16 * kChunksPerRow);
            const int r = tm * 16 + 8 * h + g, c = chunk * 8;
            if (r0 + r >= Lq || c >= D) continue;
            const float* s = src + A::offset(r, c);  // column c (even: e % 2 = 0) of row r, lane 4 g
            const float4 even = fa::gload(reinterpret_cast<const float4*>(s));       // columns c, c+2, c+4, c+6
            const float4 odd = fa::gload(reinterpret_cast<const float4*>(s + 32));   // columns c+1, c+3, ...
            const float v[8] = {even.x * scale, odd.x * scale, even.y * scale, odd.y * scale,
                                even.z * scale, odd.z * scale, even.w * scale, odd.w * scale};
            store_dq8<OutT, kVec>(dst + (long long)r * dq_row + c, v, c, D);
        }
    }
}
