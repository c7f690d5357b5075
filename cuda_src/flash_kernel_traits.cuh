// flash_kernel_traits.cuh — every tile choice of the forward kernels and its invariants.
//
// The numbers themselves come from ONE table in Python (flasharray/_private/tiles.py), which
// also computes the dynamic shared-memory size; here they become compile-time constants with
// a static_assert (and a message) for every invariant the kernels rely on.
//
// Symbols (paper names):
//   Br = kBlockM   query rows per thread block (tile Q_i, O_i: Br × d)
//   Bc = kBlockN   key rows per iteration      (tiles K_j: Bc × d, V_j: Bc × dv)
//   d  = kHeadDim  head dim of Q and K, rounded up to a multiple of 16 (zero-filled past D)
//   dv = kHeadDimV head dim of V and O, rounded up to a multiple of 16
#pragma once
#include "fa_port.cuh"

namespace flash {

// ---- small type utilities (NVRTC has no <type_traits>) -------------------------------------
template <typename A, typename B> struct IsSame { static constexpr bool value = false; };
template <typename A> struct IsSame<A, A> { static constexpr bool value = true; };

// Accumulation type: fp32 for fp16/bf16/fp32, fp64 for fp64.
template <typename T> struct AccumType { using type = float; };
template <> struct AccumType<double> { using type = double; };

template <typename T> struct Is16BitFloat {
  static constexpr bool value = IsSame<T, fa_half>::value || IsSame<T, fa_bf16>::value;
};

// Element → accumulation type, and back with round-to-nearest.
template <typename AccT, typename T>
__device__ __forceinline__ AccT to_acc(T x) {
  if constexpr (Is16BitFloat<T>::value) return static_cast<AccT>(fa::to_float(x));
  else return static_cast<AccT>(x);
}
template <typename T, typename AccT>
__device__ __forceinline__ T from_acc(AccT x) {
  if constexpr (Is16BitFloat<T>::value) return fa::from_float<T>(static_cast<float>(x));
  else return static_cast<T>(x);
}
template <typename T>
__device__ __forceinline__ T zero_value() {
  if constexpr (Is16BitFloat<T>::value) return fa::from_float<T>(0.0f);
  else return T(0);
}

constexpr int kCopyBytes = 16;  // one cp.async / one vector shared-memory access
constexpr int kWarpSize = 32;
// __launch_bounds__ minimum blocks per SM. 1 lets ptxas use up to 255 registers per thread:
// without it ptxas's occupancy heuristic capped some SIMT instantiations at 80-128 registers
// and spilled (seen with -Xptxas=-v); the static checks require zero spills.
constexpr int kMinBlocksPerSm = 1;

// 16 bytes of elements, read from shared memory as one vector access (ld.shared.v4).
template <typename T>
struct alignas(kCopyBytes) Vec16 {
  T v[kCopyBytes / sizeof(T)];
};

// Round a byte count up to a multiple of 16 (every shared-memory region starts 16-byte aligned
// so cp.async and ldmatrix rows are aligned).
template <int kBytes> struct Align16 { static constexpr int value = (kBytes + 15) / 16 * 16; };

// ---- tensor-core forward (fp16 / bf16, mma.sync m16n8k16) ------------------------------------
//
// Work split: kNWarps warps, warp w owns kSlabsPerWarp consecutive 16-row slabs (the mma M
// dimension) of Q_i, S_ij, P_ij and O_i, across the full Bc columns of S and dv columns of O.
// Shared memory: sQ (Br × d), sK (Bc × d), sV (Bc × dv), each row padded by kSmemPad elements
// (16 bytes): a row is then 2·d + 16 bytes, and because d is a multiple of 16 the 8 rows an
// ldmatrix phase reads start in 8 distinct 16-byte bank groups (row r → group r·(d/8+1) mod 8,
// d/8 + 1 odd) — no bank conflicts for any d, unlike an XOR swizzle, which needs d ≥ 64.
template <typename T, int kHeadDim_, int kHeadDimV_, int kBlockM_, int kBlockN_, int kNWarps_, int kStages_ = 1>
struct FwdTensorCoreTraits {
  using Element = T;
  using AccT = float;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kStages = kStages_;  // shared-memory buffers per K_j / V_j tile
  static constexpr int kNThreads = kNWarps * kWarpSize;

  static constexpr int kMmaM = 16, kMmaN = 8, kMmaK = 16;         // mma.sync m16n8k16
  static constexpr int kRowsPerWarp = kBlockM / kNWarps;          // rows of Q_i per warp
  static constexpr int kSlabsPerWarp = kRowsPerWarp / kMmaM;      // 16-row mma slabs per warp
  static constexpr int kElemsPerCopy = kCopyBytes / sizeof(T);    // 8 halves per 16 bytes
  static constexpr int kSmemPad = kElemsPerCopy;                  // one 16-byte chunk per row
  // kSwizzleQ: sQ's rows unpadded, chunk c of row r stored at chunk c ^ (r mod 8) (also conflict-free
  // for ldmatrix: an 8-row phase reads one chunk column, which lands in 8 distinct chunks). Only the
  // single-buffered 128 x 32 tile at d = 64·k takes it: sm_86/89's wide tile, where the 2 KB saved
  // (d 128: 50 KB instead of 51) let two blocks share the 100 KB SM (tiles.tc_smem mirrors this rule).
  static constexpr bool kSwizzleQ = kStages == 1 && kBlockM == 128 && kBlockN == 32 && kHeadDim % 64 == 0;
  static constexpr int kStrideQ = kSwizzleQ ? kHeadDim : kHeadDim + kSmemPad;  // sQ row stride (elements)
  static constexpr int kStrideK = kHeadDim + kSmemPad;
  static constexpr int kStrideV = kHeadDimV + kSmemPad;

  static constexpr int kNTilesS = kBlockN / kMmaN;   // n8 tiles of one S slab (16 × Bc)
  static constexpr int kNTilesO = kHeadDimV / kMmaN; // n8 tiles of one O slab (16 × dv)
  static constexpr int kKStepsS = kHeadDim / kMmaK;  // k16 steps of S = Q Kᵀ
  static constexpr int kKStepsO = kBlockN / kMmaK;   // k16 steps of O += P V

  // Layout: sQ | sK stage 0 .. kStages−1 | sV stage 0 .. kStages−1 (each region 16-byte aligned).
  static constexpr int kSmemKStageBytes = Align16<kBlockN * kStrideK * (int)sizeof(T)>::value;
  static constexpr int kSmemVStageBytes = Align16<kBlockN * kStrideV * (int)sizeof(T)>::value;
  static constexpr int kSmemKStageElems = kSmemKStageBytes / (int)sizeof(T);
  static constexpr int kSmemVStageElems = kSmemVStageBytes / (int)sizeof(T);
  static constexpr int kSmemQOffset = 0;
  static constexpr int kSmemKOffset = kSmemQOffset + Align16<kBlockM * kStrideQ * (int)sizeof(T)>::value;
  static constexpr int kSmemVOffset = kSmemKOffset + kStages * kSmemKStageBytes;
  static constexpr int kSmemBytes = kSmemVOffset + kStages * kSmemVStageBytes;

  // Epilogue (after the key loop every buffer above is free): O_i (Br × dv, as T) staged from the
  // mma fragments at the start of shared memory with sV's pitch — 4-byte fragment words land in
  // distinct banks because the pitch is 4 mod 8 words (dv + 8 elements, dv a multiple of 16) —
  // then the tile's Br LSE values (fp32). kStageO: the staged O_i fits in the kernel's shared
  // memory (always when dv <= d; a large dv with a small d may not fit: fragment stores then).
  static constexpr int kStrideO = kStrideV;
  static constexpr int kSmemOBytes = Align16<kBlockM * kStrideO * (int)sizeof(T)>::value;
  static constexpr bool kStageO = kSmemOBytes + kBlockM * (int)sizeof(float) <= kSmemBytes;
  static constexpr int kSmemLseOffset = kStageO ? kSmemOBytes : 0;

  static_assert(Is16BitFloat<T>::value, "the tensor-core forward takes fa_half or fa_bf16");
  static_assert(kStages == 1 || kStages == 2, "K_j / V_j are single- or double-buffered");
  static_assert(kHeadDim % kMmaK == 0 && kHeadDim > 0 && kHeadDim <= 256,
                "kHeadDim must be a multiple of 16 in [16, 256] (the host rounds D up)");
  static_assert(kHeadDimV % kMmaK == 0 && kHeadDimV > 0 && kHeadDimV <= 256,
                "kHeadDimV must be a multiple of 16 in [16, 256] (the host rounds Dv up)");
  static_assert(kBlockM % (kNWarps * kMmaM) == 0 && kSlabsPerWarp >= 1 && kSlabsPerWarp <= 4,
                "Br must be 1 to 4 16-row slabs per warp");
  static_assert(kBlockN % (2 * kMmaN) == 0,
                "Bc must be a multiple of 16: K_j is read two n8 tiles per ldmatrix.x4 and "
                "P_ij feeds the second mma as k16 steps");
  static_assert(kHeadDimV % (2 * kMmaN) == 0, "V_j is read two n8 tiles per ldmatrix.x4.trans");
  static_assert((kStrideQ * (int)sizeof(T)) % kCopyBytes == 0 && (kStrideV * (int)sizeof(T)) % kCopyBytes == 0,
                "smem rows must stay 16-byte aligned for cp.async and ldmatrix");
  static_assert((kSwizzleQ || ((kStrideQ * (int)sizeof(T) / kCopyBytes) & 1) == 1) &&
                ((kStrideK * (int)sizeof(T) / kCopyBytes) & 1) == 1 &&
                ((kStrideV * (int)sizeof(T) / kCopyBytes) & 1) == 1,
                "padded row length in 16-byte units must be odd for conflict-free ldmatrix");
};

// ---- SIMT forward (fp32 / fp64, and the fallback for 16-bit types without tensor cores) -----
//
// Work split: kThreadsM × kThreadsN threads; thread (tm, tn) with tid = tm·kThreadsN + tn owns
// the rows r = tm·TM + a (a < TM) of S_ij, P_ij, O_i; in S it owns the columns c = b·kThreadsN + tn
// (b < TN), in O the columns e·kThreadsN + tn. The kThreadsN threads of a row group are
// consecutive lanes of one warp, so row max/sum are width-kThreadsN shuffles and P_ij travels
// through shared memory only inside a warp (__syncwarp). Columns interleaved by kThreadsN make
// a row group's V_j reads consecutive; the Q/K reads are 16-byte vectors along d with rows
// padded by one 16-byte chunk (odd number of chunks per row: conflict-free).
template <typename T, int kHeadDim_, int kHeadDimV_, int kBlockM_, int kBlockN_, int kThreadsM_, int kThreadsN_>
struct FwdSimtTraits {
  using Element = T;
  using AccT = typename AccumType<T>::type;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kThreadsM = kThreadsM_;
  static constexpr int kThreadsN = kThreadsN_;
  static constexpr int kNThreads = kThreadsM * kThreadsN;
  static constexpr int kRowsPerThread = kBlockM / kThreadsM;    // TM
  static constexpr int kColsPerThread = kBlockN / kThreadsN;    // TN (columns of S)
  static constexpr int kColsVPerThread = kHeadDimV / kThreadsN; // columns of O

  static constexpr int kElemsPerCopy = kCopyBytes / sizeof(T);
  static constexpr int kSmemPad = kElemsPerCopy;
  static constexpr int kStrideQ = kHeadDim + kSmemPad;
  static constexpr int kStrideK = kHeadDim + kSmemPad;
  static constexpr int kStrideV = kHeadDimV + kSmemPad;
  // P_ij rows (AccT), unpadded: 16-byte aligned for the P V product's vector loads (each row group
  // reads its own rows: broadcasts). The two row groups of a warp store P rows TM·Bc apart, the same
  // banks for fp32 (2 wavefronts per store, TM·TN stores per key tile); a 16-byte pad would spread
  // them but cost sm_80's fp32 d 128 tile its third block per SM (54.0 + 1 KB x 3 > 164 KB).
  static constexpr int kPVec = kCopyBytes / (int)sizeof(AccT);
  static constexpr int kStrideP = kBlockN;

  static constexpr int kSmemQOffset = 0;
  static constexpr int kSmemKOffset = kSmemQOffset + Align16<kBlockM * kStrideQ * (int)sizeof(T)>::value;
  static constexpr int kSmemVOffset = kSmemKOffset + Align16<kBlockN * kStrideK * (int)sizeof(T)>::value;
  static constexpr int kSmemPOffset = kSmemVOffset + Align16<kBlockN * kStrideV * (int)sizeof(T)>::value;
  static constexpr int kSmemBytes = kSmemPOffset + Align16<kBlockM * kStrideP * (int)sizeof(AccT)>::value;

  static_assert(kHeadDim % 16 == 0 && kHeadDim > 0 && kHeadDim <= 256,
                "kHeadDim must be a multiple of 16 in [16, 256] (the host rounds D up)");
  static_assert(kHeadDimV % 16 == 0 && kHeadDimV > 0 && kHeadDimV <= 256,
                "kHeadDimV must be a multiple of 16 in [16, 256] (the host rounds Dv up)");
  static_assert(kThreadsN >= 1 && kThreadsN <= kWarpSize && (kThreadsN & (kThreadsN - 1)) == 0,
                "a row group must be a power-of-two number of lanes inside one warp");
  static_assert(kNThreads % kWarpSize == 0, "the block must be whole warps");
  static_assert(kBlockM % kThreadsM == 0, "Br must split evenly over kThreadsM row groups");
  static_assert(kBlockN % kThreadsN == 0, "Bc must split evenly over the kThreadsN lanes of a row group");
  static_assert(kHeadDimV % kThreadsN == 0, "dv must split evenly over the lanes of a row group");
  static_assert(kHeadDim % kElemsPerCopy == 0, "d must be whole 16-byte vectors");
  static_assert(((kStrideK * (int)sizeof(T) / kCopyBytes) & 1) == 1,
                "padded K row length in 16-byte units must be odd for conflict-free vector reads");
  static_assert(kBlockN % kPVec == 0, "P_ij rows are read in whole 16-byte vectors");
};

}  // namespace flash
