// flash_f64_mma.cuh — the DMMA steps of the float64 tensor-core kernels (flash_fwd_f64.cu, flash_bwd_f64.cu).
//
// dmma: one k4 step of one m8 tile (mma.sync.m8n8k4.f64, sm_80+). dmma16: four k4 steps of two m8 tiles at once
// (mma.sync.m16n8k16.f64, SASS DMMA.16x8x16, sm_90+): the m16n8k16 fragments are the m8n8k4 ones of m8 tiles
// 0 / 1 (rows g / g + 8) and k4 steps 0..3 (columns t + 4s), so a kernel whose warp holds two m8 tiles gives it
// the registers it had for eight m8n8k4 — a[v0 + 2 v1] = step v1's A element of m8 tile v0, b[v] = step v's B
// element, d0 / d1 the two tiles' accumulators — and, the steps in the order the eight were issued, the same
// bits (each element one fp64 FMA chain over k: docs/emulator.md). One instruction for 4096 flops instead of
// eight for 512 each: fewer issue slots and a quarter of the register-file reads per flop (the accumulator is
// read and written once per 16 k instead of per 4).
#pragma once
#include "fa_port.cuh"

namespace flash {

// D += A·B, m8n8k4 f64.
__device__ __forceinline__ void dmma(double (&d)[2], double a, double b) {
    const double av[1] = {a}, bv[1] = {b}, c[2] = {d[0], d[1]};
    fa::mma_m8n8k4_f64(d, av, bv, c);
}

// (d0; d1) += A·B over four k4 steps, m16n8k16 f64 (sm_90+): a[v0 + 2 v1] = m8 tile v0's A element of step v1,
// b[v] = step v's B element. (A template: instantiated only where used, i.e. never in an sm_80 compile.)
template <class Sm90 = void>
__device__ __forceinline__ void dmma16(double (&d0)[2], double (&d1)[2], const double (&a)[8], const double (&b)[4]) {
    const double c[4] = {d0[0], d0[1], d1[0], d1[1]};
    double d[4];
    fa::mma_m16n8k16_f64<Sm90>(d, a, b, c);
    d0[0] = d[0], d0[1] = d[1], d1[0] = d[2], d1[1] = d[3];
}

}  // namespace flash
