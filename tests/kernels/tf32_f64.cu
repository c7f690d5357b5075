// Known-answer kernels for the tf32 and fp64 tensor-core wrappers of fa_port.cuh (one warp each;
// tests/test_emulator_tf32_f64.py, tests/test_static_tf32_f64.py).
#include "fa_port.cuh"

// out[i] = bit pattern of fa::cvt_tf32(in[i]); hi/lo = fa::split_tf32(in[i]).
__global__ void cvt_tf32_test(uint32_t* out, float* hi, float* lo, const float* in, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float x = fa::gload(in + i);
    fa::gstore(out + i, __float_as_uint(fa::cvt_tf32(x)));
    float h, l;
    fa::split_tf32(x, h, l);
    fa::gstore(hi + i, h);
    fa::gstore(lo + i, l);
}

// Lane t passes a[4t..4t+3], b[2t..2t+1], c[4t..4t+3] as its registers; d likewise.
__global__ void mma_tf32_test(float* d, const uint32_t* a, const uint32_t* b, const float* c) {
    const int t = threadIdx.x;
    uint32_t ra[4], rb[2];
    float rc[4], rd[4];
    for (int i = 0; i < 4; ++i) ra[i] = fa::gload(a + 4 * t + i);
    for (int i = 0; i < 2; ++i) rb[i] = fa::gload(b + 2 * t + i);
    for (int i = 0; i < 4; ++i) rc[i] = fa::gload(c + 4 * t + i);
    fa::mma_m16n8k8_tf32(rd, ra, rb, rc);
    for (int i = 0; i < 4; ++i) fa::gstore(d + 4 * t + i, rd[i]);
}

// 3xTF32: the fp32 registers split into tf32 hi + lo; D = lo_a hi_b + hi_a lo_b + hi_a hi_b + C,
// the small terms first.
__global__ void mma_3xtf32_test(float* d, const float* a, const float* b, const float* c) {
    const int t = threadIdx.x;
    uint32_t ah[4], al[4], bh[2], bl[2];
    float rc[4], rd[4];
    for (int i = 0; i < 4; ++i) {
        float h, l;
        fa::split_tf32(fa::gload(a + 4 * t + i), h, l);
        ah[i] = __float_as_uint(h);
        al[i] = __float_as_uint(l);
    }
    for (int i = 0; i < 2; ++i) {
        float h, l;
        fa::split_tf32(fa::gload(b + 2 * t + i), h, l);
        bh[i] = __float_as_uint(h);
        bl[i] = __float_as_uint(l);
    }
    for (int i = 0; i < 4; ++i) rc[i] = fa::gload(c + 4 * t + i);
    fa::mma_m16n8k8_tf32(rd, al, bh, rc);
    fa::mma_m16n8k8_tf32(rd, ah, bl, rd);
    fa::mma_m16n8k8_tf32(rd, ah, bh, rd);
    for (int i = 0; i < 4; ++i) fa::gstore(d + 4 * t + i, rd[i]);
}

// Lane t passes a[t], b[t], c[2t..2t+1]; d[2t..2t+1] receives its accumulators.
__global__ void mma_f64_test(double* d, const double* a, const double* b, const double* c) {
    const int t = threadIdx.x;
    double ra[1] = {fa::gload(a + t)}, rb[1] = {fa::gload(b + t)};
    double rc[2] = {fa::gload(c + 2 * t), fa::gload(c + 2 * t + 1)}, rd[2];
    fa::mma_m8n8k4_f64(rd, ra, rb, rc);
    fa::gstore(d + 2 * t, rd[0]);
    fa::gstore(d + 2 * t + 1, rd[1]);
}

// m16n8k16 f64 (sm_90; a template, instantiated only where named, so that the sm_80 compile of this file
// never sees it): lane t passes a[8t..8t+7], b[4t..4t+3], c[4t..4t+3]; d likewise.
template <int kUnused>
__global__ void mma_f64_k16_test(double* d, const double* a, const double* b, const double* c) {
    const int t = threadIdx.x;
    double ra[8], rb[4], rc[4], rd[4];
    for (int i = 0; i < 8; ++i) ra[i] = fa::gload(a + 8 * t + i);
    for (int i = 0; i < 4; ++i) rb[i] = fa::gload(b + 4 * t + i), rc[i] = fa::gload(c + 4 * t + i);
    fa::mma_m16n8k16_f64(rd, ra, rb, rc);
    for (int i = 0; i < 4; ++i) fa::gstore(d + 4 * t + i, rd[i]);
}
