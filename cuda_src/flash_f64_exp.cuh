// flash_f64_exp.cuh — 2^x in fp64 for the softmax weights of the DMMA forward (flash_fwd_f64.cu).
//
// The weights are p = 2^x with x = s·scale − m <= 0 (m the running row max; x = −inf for masked
// scores; the fma may leave x a rounding error above 0 for the max itself — the routine holds for
// any x <= 1023). CUDA's exp2(double) serves the whole double range (overflow, subnormal results, a slow
// path for large |x|): ~50 instructions per call in the key loop, more than the DMMA work per
// score at d <= 32. For x <= 0 a short routine is as accurate:
//
//   n = rint(x), f = x − n ∈ [−1/2, 1/2];  2^f = Σ_{k<=13} (f·ln 2)^k / k!  (Horner in f, 13 fma;
//   the truncated tail is < 4.1e-18 relative, far below an ulp, 1.1e-16);  2^x = 2^f · 2^n with
//   2^n built from its exponent bits (exact for n >= −1022).
//
// x < −1022 returns 0: such a weight is below 2^−1022 while the row's largest weight is 1, so it
// changes neither l (>= 1) nor O by anything representable (IEEE exp2 would give a subnormal).
// x = 0 gives exactly 1, −inf gives 0, NaN gives NaN. Accuracy is measured against a long-double
// reference over [−1100, 0] by tests/test_cuda_forward_f64.py (max error in ulps, vs exp2's).
#pragma once
#include "fa_port.cuh"

namespace flash {

// ln(2)^k / k!, k = 0..13 (the Taylor coefficients of 2^f), rounded to double.
constexpr double kExp2Coef[14] = {
    1.0,
    0.6931471805599453094172321,
    0.2402265069591007123335513,
    0.0555041086648215799531423,
    0.0096181291076284771619791,
    0.0013333558146428443423412,
    1.540353039338160995443710e-4,
    1.525273380405984028002544e-5,
    1.321548679014430948840376e-6,
    1.017808600923969972749001e-7,
    7.054911620801123329875392e-9,
    4.445538271870811497596409e-10,
    2.567843599348820514199480e-11,
    1.369148885390412888089195e-12,
};

__device__ __forceinline__ double exp2_nonpositive(double x) {
  const double n = rint(x);
  const double f = x - n;
  double p = kExp2Coef[13];
#pragma unroll
  for (int k = 12; k >= 0; --k) p = fma(p, f, kExp2Coef[k]);
  // 2^n: biased exponent n + 1023 in bits 52..62 (n >= -1022; anything else is discarded below).
  const double n_clamped = x >= -1022.0 ? n : 0.0;  // keeps the int conversion defined for -inf, NaN
  const unsigned long long bits = static_cast<unsigned long long>(static_cast<long long>(n_clamped) + 1023) << 52;
  double scale;
  memcpy(&scale, &bits, sizeof(scale));
  return x < -1022.0 ? 0.0 : p * scale;
}

}  // namespace flash
