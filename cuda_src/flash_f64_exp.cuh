// flash_f64_exp.cuh — 2^x in fp64 for the softmax weights of the DMMA kernels (flash_fwd_f64.cu,
// flash_bwd_f64.cu).
//
// The weights are p = 2^x with x = s·scale − m <= 0 (m the running row max; x = −inf for masked
// scores; the fma may leave x a rounding error above 0 for the max itself). CUDA's exp2(double)
// serves the whole double range (overflow, subnormal results, a slow path for large |x|): ~50
// instructions per call in the key loop. On sm_80+ the DMMA and every other fp64 instruction (DFMA,
// DADD, DMUL, DSETP, FRND, conversions) issue through one shared pipe, so each fp64 instruction of
// the softmax takes a slot from the tensor core: the routine below spends 14 of them per weight.
//
//   k = rint(16x) by the 1.5·2^52 shifter (its low word is k, two's complement),
//   r = x − k/16 ∈ [−1/32, 1/32] (exact),  k = 16n + j (j = k & 15),
//   2^x = 2^n · 2^(j/16) · 2^r,  2^r − 1 = q = r·Σ_{i=1..7} (ln 2)^i r^(i−1) / i!  (Horner, 6 fma and a
//   multiply; the truncated tail is < 1.2e-18, 0.01 ulp),
//   2^(j/16) = T_hi[j] + T_lo[j] (a double-double table in shared memory: T_hi rounded to nearest,
//   T_lo the rest), 2^(j/16 + r) = T_hi + fma(T_hi, q, T_lo): one rounding at the end,
//   2^n built from its exponent bits (n >= −1022 for x >= −1022) and applied by one exact multiply.
//
// The earlier routine (n = rint(x), 2^f by its Taylor series to degree 13) took 19 fp64
// instructions. x < −1022 returns 0: such a weight is below 2^−1022 while the row's largest weight
// is 1, so it changes neither l (>= 1) nor O by anything representable (IEEE exp2 would give a
// subnormal). x = 0 gives exactly 1, −inf gives 0, NaN gives NaN; the domain is x < 1023 + 31/32
// (k <= 16383; from there 2^n is +inf, as exp2's 2^1024 is: the backward clamps its arguments at 1024).
// Accuracy is measured against a long-double reference over [−1022, 1023.96] by
// tests/test_cuda_forward_f64.py: max 0.55 ulp (the host libm's exp2: 0.68).
#pragma once
#include "fa_port.cuh"

namespace flash {

// (ln 2)^i / i!, i = 1..7: the Taylor coefficients of (2^r − 1) / r.
constexpr double kExp2Coef[7] = {
    0x1.62e42fefa39efp-1, 0x1.ebfbdff82c58fp-3, 0x1.c6b08d704a0c0p-5, 0x1.3b2ab6fba4e77p-7,
    0x1.5d87fe78a6731p-10, 0x1.430912f86c787p-13, 0x1.ffcbfc588b0c7p-17,
};

// 2^(j/16), j = 0..15: T_hi (rounded to nearest), then T_lo = 2^(j/16) − T_hi (rounded).
constexpr int kExp2TableSize = 16;
constexpr int kExp2TableBytes = 2 * kExp2TableSize * 8;
constexpr double kExp2Table[2 * kExp2TableSize] = {
    0x1.0000000000000p+0, 0x1.0b5586cf9890fp+0, 0x1.172b83c7d517bp+0, 0x1.2387a6e756238p+0,
    0x1.306fe0a31b715p+0, 0x1.3dea64c123422p+0, 0x1.4bfdad5362a27p+0, 0x1.5ab07dd485429p+0,
    0x1.6a09e667f3bcdp+0, 0x1.7a11473eb0187p+0, 0x1.8ace5422aa0dbp+0, 0x1.9c49182a3f090p+0,
    0x1.ae89f995ad3adp+0, 0x1.c199bdd85529cp+0, 0x1.d5818dcfba487p+0, 0x1.ea4afa2a490dap+0,
    0x0.0p+0, 0x1.8a62e4adc610bp-54, -0x1.19041b9d78a76p-55, 0x1.9b07eb6c70573p-54,
    0x1.6f46ad23182e4p-55, 0x1.ada0911f09ebcp-55, 0x1.d4397afec42e2p-56, 0x1.6324c054647adp-54,
    -0x1.bdd3413b26456p-54, -0x1.41577ee04992fp-55, 0x1.6e9f156864b27p-54, 0x1.c7c46b071f2bep-56,
    0x1.7a1cd345dcc81p-54, 0x1.11065895048ddp-55, 0x1.2ed02d75b3707p-55, -0x1.e9c23179c2893p-54,
};

// The table into shared memory (kExp2TableBytes, 8-byte aligned) by the threads tid < 32 of the
// block; a barrier must separate it from the first exp2_nonpositive. The T_hi reads of a warp then
// hit 16 distinct 8-byte bank pairs: conflict-free whatever the weights' j.
__device__ __forceinline__ void exp2_table_fill(double* table, int tid) {
#pragma unroll
  for (int i = 0; i < 2 * kExp2TableSize; ++i)
    if (tid == i) table[i] = kExp2Table[i];
}

__device__ __forceinline__ double exp2_nonpositive(double x, const double* table) {
  constexpr double kShifter = 0x1.8p52;
  const double t = fma(x, 16.0, kShifter);
  const double kd = t - kShifter;           // rint(16x)
  const double r = fma(kd, -0.0625, x);     // exact: x and k/16 are within a factor 2, or k = 0
  unsigned long long t_bits;
  memcpy(&t_bits, &t, sizeof(t_bits));
  const int k = static_cast<int>(static_cast<unsigned>(t_bits));
  const int j = k & (kExp2TableSize - 1);
  double p = kExp2Coef[6];
#pragma unroll
  for (int i = 5; i >= 0; --i) p = fma(p, r, kExp2Coef[i]);
  const double q = p * r;
  const double hi = table[j], lo = table[kExp2TableSize + j];
  const double y = hi + fma(hi, q, lo);
  // 2^n: biased exponent n + 1023 in bits 52..62 (k >> 4 = n, arithmetic; x < -1022 is discarded below).
  const unsigned long long bits = static_cast<unsigned long long>(static_cast<unsigned>((k >> 4) + 1023) & 0x7ffu) << 52;
  double scale;
  memcpy(&scale, &bits, sizeof(scale));
  return x < -1022.0 ? 0.0 : y * scale;
}

}  // namespace flash
