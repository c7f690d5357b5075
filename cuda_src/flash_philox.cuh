// flash_philox.cuh — Philox4x32-10 and dropout's keep test, bit-identical to
// flasharray/_private/philox.py (the reference's generator; the definition is there and in
// docs/extensions.md):
//   key = (seed lo, seed hi), counter = (col >> 3, row, bh, offset)
//   column col takes the 16-bit half (col & 1) of output word (col & 7) >> 1; kept iff >= threshold.
// One Philox call serves 8 consecutive columns of one row: kernels call philox_row8 once per
// (row, 8-column group) and pick the columns they hold with dropout_bits.
#pragma once
#include "fa_port.cuh"

namespace flash {

struct Philox4 {
  uint32_t x[4];
};

__device__ __forceinline__ uint32_t philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi) {
  const unsigned long long p = static_cast<unsigned long long>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  return static_cast<uint32_t>(p);
}

// Philox4x32-10 of counter (c0, c1, c2, c3) under key (k0, k1).
__device__ __forceinline__ Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                                 uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = philox_mulhilo(0xD2511F53u, c0, hi0);
    const uint32_t lo1 = philox_mulhilo(0xCD9E8D57u, c2, hi1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;  // the bump after the last round is never used
    k1 += 0xBB67AE85u;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// Dropout's generator state for one batch entry (bh: its flat index in the output's batch shape).
struct DropoutRng {
  uint32_t k0, k1, bh, offset;
  uint32_t threshold;  // drop iff the 16-bit value < threshold (threshold = min(round(p·65536), 65535))

  // The 8 values (two per word) of row `row`, columns (col8 << 3) .. + 7.
  __device__ __forceinline__ Philox4 row8(int row, int col8) const {
    return philox4x32_10(static_cast<uint32_t>(col8), static_cast<uint32_t>(row), bh, offset, k0, k1);
  }
  // Whether column `col` (any column of the 8-group that produced `r`) is kept.
  __device__ __forceinline__ bool keep(const Philox4& r, int col) const {
    const uint32_t w = r.x[(col & 7) >> 1];
    return ((w >> (16 * (col & 1))) & 0xFFFFu) >= threshold;
  }
  __device__ __forceinline__ bool keep(int row, int col) const { return keep(row8(row, col >> 3), col); }
};

}  // namespace flash
