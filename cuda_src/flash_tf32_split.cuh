// flash_tf32_split.cuh — float32 operands as TF32 tensor-core operands (issue 12): one value as its tf32
// (precision "tf32") or hi + lo pair ("3xtf32"), and a 16-byte shared-memory chunk converted in place (hi) with
// its lo plane; shared by the mma.sync forward (flash_fwd_tf32.cu) and the wgmma one (flash_fwd_sm90_tf32.cu).
#pragma once
#include "fa_port.cuh"
#include "flash_kernel_traits.cuh"  // Vec16

namespace flash {

// x as the mma operands of precision kPrec: hi = cvt.rna(x) and, 3xtf32, lo = cvt.rna(x − hi).
template <int kPrec>
__device__ __forceinline__ void tf32_operand(float x, uint32_t& hi, uint32_t& lo) {
  if constexpr (kPrec == 3) {
    float h, l;
    fa::split_tf32(x, h, l);
    hi = __float_as_uint(h);
    lo = __float_as_uint(l);
  } else {
    hi = __float_as_uint(fa::cvt_tf32(x));
    (void)lo;
  }
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
