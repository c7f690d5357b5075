// gemm_fp16.cu — C = A · B on tensor cores: the emulator's end-to-end test kernel.
//
//   A  (M × K) fp16, row-major          C  (M × N) fp32, row-major
//   B  (K × N) fp16, row-major          requires K % 8 == 0 and N % 8 == 0 (16-byte rows chunks)
//
// One block computes a kBM × kBN tile of C with 4 warps in a 2 × 2 arrangement (32 × 32 each,
// i.e. 2 × 4 m16n8 accumulator tiles per warp). K is walked in kBK steps through a
// double-buffered shared-memory pipeline: cp.async brings tile k+1 while tile k is multiplied.
// A fragments come from ldmatrix.x4, B fragments (k-major rows, n contiguous) from
// ldmatrix.x2.trans; mma.m16n8k16 accumulates in fp32.
//
// kBug deliberately breaks the synchronisation so the tests can show the emulator catches it:
//   0  correct
//   1  no __syncthreads() after the cp.async wait  (read-after-write race on the new stage)
//   2  no __syncthreads() at the end of an iteration (write-after-read race on the old stage)
//   3  no cp_async_wait (reads a stage whose copies have not landed)
#include "fa_port.cuh"

namespace gemm {
constexpr int kBM = 64;                       // rows of C per block
constexpr int kBN = 64;                       // columns of C per block
constexpr int kBK = 32;                       // k per pipeline stage
constexpr int kWarpM = 32, kWarpN = 32;       // tile of C per warp
constexpr int kWarps = (kBM / kWarpM) * (kBN / kWarpN);
constexpr int kThreads = 32 * kWarps;
constexpr int kChunk = 8;                     // halfs per 16-byte cp.async
constexpr int kPad = 8;                       // halfs of padding per smem row (keeps 16-B alignment)
constexpr int kStrideA = kBK + kPad;          // smem row stride of the A stage (halfs)
constexpr int kStrideB = kBN + kPad;          // smem row stride of the B stage (halfs)
constexpr int kStageA = kBM * kStrideA;       // halfs per A stage
constexpr int kStageB = kBK * kStrideB;       // halfs per B stage
constexpr int kStages = 2;
constexpr int kSmemBytes = kStages * (kStageA + kStageB) * 2;

static_assert(kWarps == 4, "the tile shape is laid out for 4 warps");
static_assert(kWarpM % 16 == 0 && kWarpN % 8 == 0 && kBK % 16 == 0, "tiles must be whole m16n8k16 steps");
static_assert((kStrideA * 2) % 16 == 0 && (kStrideB * 2) % 16 == 0, "ldmatrix rows must stay 16-byte aligned");
static_assert((kBM * kBK / kChunk) % kThreads == 0, "A stage must split evenly over the threads");
static_assert((kBK * kBN / kChunk) % kThreads == 0, "B stage must split evenly over the threads");

// Issue the cp.async copies of the A and B tiles starting at (m0, k0) and (k0, n0).
// Chunks past the matrix edge are zero-filled (src_bytes < 16), so edge tiles need no masking.
__device__ __forceinline__ void load_stage(fa_half* sA, fa_half* sB, const fa_half* A, const fa_half* B,
                                           int M, int N, int K, int m0, int n0, int k0, int tid) {
    for (int c = tid; c < kBM * kBK / kChunk; c += kThreads) {
        const int r = c / (kBK / kChunk), col = (c % (kBK / kChunk)) * kChunk;
        const int gr = m0 + r, gc = k0 + col;
        const int bytes = (gr < M && gc < K) ? 2 * (K - gc < kChunk ? K - gc : kChunk) : 0;
        fa::cp_async<16>(sA + r * kStrideA + col, bytes ? A + (long long)gr * K + gc : A, bytes);
    }
    for (int c = tid; c < kBK * kBN / kChunk; c += kThreads) {
        const int r = c / (kBN / kChunk), col = (c % (kBN / kChunk)) * kChunk;
        const int gr = k0 + r, gc = n0 + col;
        const int bytes = (gr < K && gc < N) ? 2 * (N - gc < kChunk ? N - gc : kChunk) : 0;
        fa::cp_async<16>(sB + r * kStrideB + col, bytes ? B + (long long)gr * N + gc : B, bytes);
    }
}
}  // namespace gemm

template <int kBug>
__global__ void __launch_bounds__(gemm::kThreads)
gemm_fp16(float* __restrict__ C, const fa_half* __restrict__ A, const fa_half* __restrict__ B,
          int M, int N, int K) {
    using namespace gemm;
    FA_DYNAMIC_SMEM(smem);
    fa_half* sA = reinterpret_cast<fa_half*>(smem);         // [kStages][kBM][kStrideA]
    fa_half* sB = sA + kStages * kStageA;                    // [kStages][kBK][kStrideB]

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int wm = (warp / (kBN / kWarpN)) * kWarpM;         // warp's row offset in the block tile
    const int wn = (warp % (kBN / kWarpN)) * kWarpN;         // warp's column offset
    const int m0 = blockIdx.y * kBM, n0 = blockIdx.x * kBN;
    const int k_tiles = (K + kBK - 1) / kBK;

    float acc[kWarpM / 16][kWarpN / 8][4] = {};              // m16n8 fp32 accumulators

    load_stage(sA, sB, A, B, M, N, K, m0, n0, 0, tid);
    fa::cp_async_commit();
    for (int kt = 0; kt < k_tiles; ++kt) {
        const int cur = kt % kStages, nxt = (kt + 1) % kStages;
        if (kt + 1 < k_tiles)
            load_stage(sA + nxt * kStageA, sB + nxt * kStageB, A, B, M, N, K, m0, n0, (kt + 1) * kBK, tid);
        fa::cp_async_commit();   // one group per iteration (maybe empty) keeps wait<1> counting uniform
        if constexpr (kBug != 3) fa::cp_async_wait<1>();   // this thread's copies of stage `cur` landed
        if constexpr (kBug != 1) __syncthreads();          // ... and every other thread's too

        const fa_half* tA = sA + cur * kStageA;
        const fa_half* tB = sB + cur * kStageB;
        for (int kk = 0; kk < kBK; kk += 16) {
            uint32_t a[kWarpM / 16][4], b[kWarpN / 8][2];
            for (int mi = 0; mi < kWarpM / 16; ++mi)   // lanes 0-15: rows, k 0-7; lanes 16-31: rows, k 8-15
                fa::ldmatrix<4, false>(a[mi], tA + (wm + mi * 16 + lane % 16) * kStrideA + kk + (lane / 16) * 8);
            for (int ni = 0; ni < kWarpN / 8; ++ni)    // lanes 0-7: k 0-7, lanes 8-15: k 8-15 (n contiguous)
                fa::ldmatrix<2, true>(b[ni], tB + (kk + lane % 16) * kStrideB + wn + ni * 8);
            for (int mi = 0; mi < kWarpM / 16; ++mi)
                for (int ni = 0; ni < kWarpN / 8; ++ni) fa::mma_m16n8k16<fa_half>(acc[mi][ni], a[mi], b[ni], acc[mi][ni]);
        }
        if constexpr (kBug != 2) __syncthreads();          // all reads of stage `cur` done before it is refilled
    }

    // c0 = C[g][2t], c1 = C[g][2t+1], c2 = C[g+8][2t], c3 = C[g+8][2t+1]
    const int g = lane / 4, t = lane % 4;
    for (int mi = 0; mi < kWarpM / 16; ++mi) {
        for (int ni = 0; ni < kWarpN / 8; ++ni) {
            for (int h = 0; h < 2; ++h) {
                const int row = m0 + wm + mi * 16 + g + 8 * h;
                const int col = n0 + wn + ni * 8 + 2 * t;
                if (row < M && col < N) fa::gstore(C + (long long)row * N + col, acc[mi][ni][2 * h]);
                if (row < M && col + 1 < N) fa::gstore(C + (long long)row * N + col + 1, acc[mi][ni][2 * h + 1]);
            }
        }
    }
}
