// flash_tf32_split.cuh — float32 operands as TF32 tensor-core operands (issue 12): one value as its tf32
// (precision "tf32") or hi + lo pair ("3xtf32"), and a 16-byte shared-memory chunk converted in place (hi) with
// its lo plane; shared by the mma.sync forward (flash_fwd_tf32.cu) and the wgmma one (flash_fwd_sm90_tf32.cu).
#pragma once
#include "fa_port.cuh"
#include "flash_kernel_traits.cuh"  // Vec16

namespace flash {

// x rounded to tf32 as cvt.rna does for a finite x (ties away from zero): half a tf32 ulp added to the magnitude's
// bits, the low 13 cleared (2 instructions; cvt.rna.tf32.f32 is 4 on sm_80-90, its guard keeping NaN a NaN).
__device__ __forceinline__ uint32_t tf32_rna_finite(float x) { return (__float_as_uint(x) + 0x1000u) & 0xffffe000u; }

// x as the mma operands of precision kPrec: hi = cvt.rna(x) and, 3xtf32, lo = cvt.rna(x − hi), the latter by
// tf32_rna_finite: the same bits wherever x is finite (x − hi is then finite, or −inf where hi rounded up to inf,
// which it keeps); a non-finite x keeps its inf / NaN in hi (its lo, −0, is not needed for that).
template <int kPrec>
__device__ __forceinline__ void tf32_operand(float x, uint32_t& hi, uint32_t& lo) {
  hi = __float_as_uint(fa::cvt_tf32(x));
  if constexpr (kPrec == 3) lo = tf32_rna_finite(x - __uint_as_float(hi));
  else (void)lo;
}

// tf32_operand with tf32_rna_finite: the same bits for a finite x. For P_ij (exp2 values in [0, 1]): a NaN P may
// come out as a number here, but then its row's sum l is NaN, and so is the row's output.
template <int kPrec>
__device__ __forceinline__ void tf32_operand_finite(float x, uint32_t& hi, uint32_t& lo) {
  hi = tf32_rna_finite(x);
  if constexpr (kPrec == 3) lo = tf32_rna_finite(x - __uint_as_float(hi));
  else (void)lo;
}

// In shared memory, one 16-byte chunk: x → hi in place (and lo at chunk + lo_plane, 3xtf32).
template <int kPrec>
__device__ __forceinline__ void convert_chunk(float* chunk, int lo_plane) {
  Vec16<float> x = *reinterpret_cast<Vec16<float>*>(chunk), hi, lo;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    uint32_t h, l = 0;
    tf32_operand<kPrec>(x.v[e], h, l);
    hi.v[e] = __uint_as_float(h);
    lo.v[e] = __uint_as_float(l);
  }
  *reinterpret_cast<Vec16<float>*>(chunk) = hi;
  if constexpr (kPrec == 3) *reinterpret_cast<Vec16<float>*>(chunk + lo_plane) = lo;
  else (void)lo_plane;
}

}  // namespace flash
