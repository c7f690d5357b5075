"""Run your own CUDA kernel on a laptop without a GPU.

flasharray's emulator compiles a CUDA source with the host C++ compiler and runs it on the CPU
with the CUDA execution model: every thread is a fiber, ``__syncthreads()`` is a block barrier,
warp shuffles / ``ldmatrix`` / ``mma.sync`` are evaluated once per warp with the PTX semantics,
and every global memory access is bounds-checked and counted. This script

1. writes a row-wise softmax kernel (one warp per row, warp-shuffle reductions),
2. runs it on the emulator and checks it against NumPy,
3. prints what the kernel did (global bytes read/written, shuffles, blocks),
4. runs a version with a classic bug (a missing bounds check) and shows the error the emulator
   reports instead of silently corrupting memory.

The only requirement on the kernel: include ``fa_port.cuh`` and touch global memory through
``fa::gload`` / ``fa::gstore`` (plain loads and stores on a real GPU).

Run:  python examples/emulate_kernel.py
"""
import numpy as np

try:
    from flasharray import emulator
except ImportError:   # running from a source checkout without installing
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from flasharray import emulator

# -- 1. the kernel -----------------------------------------------------------------------------------
# out[r, :] = softmax(x[r, :]) for an (n_rows, n_cols) float32 matrix; one warp per row, each lane
# strides over the columns, then the row max and the row sum are reduced with __shfl_xor_sync.
SOURCE = r"""
#include "fa_port.cuh"

constexpr int kWarpsPerBlock = 4;
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
    return v;
}
__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullMask, v, offset);
    return v;
}

template <bool kCheckRows>
__global__ void row_softmax(float* out, const float* x, int n_rows, int n_cols) {
    const int lane = threadIdx.x % 32;
    const int row = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
    if (kCheckRows && row >= n_rows) return;           // the whole warp leaves together
    const float* x_r = x + (long long)row * n_cols;
    float m = -INFINITY;
    for (int c = lane; c < n_cols; c += 32) m = fmaxf(m, fa::gload(x_r + c));
    m = warp_max(m);
    float l = 0.0f;
    for (int c = lane; c < n_cols; c += 32) l += expf(fa::gload(x_r + c) - m);
    l = warp_sum(l);
    for (int c = lane; c < n_cols; c += 32)
        fa::gstore(out + (long long)row * n_cols + c, expf(fa::gload(x_r + c) - m) / l);
}
"""

WARPS_PER_BLOCK = 4
mod = emulator.Module(SOURCE, name_expressions=["row_softmax<true>", "row_softmax<false>"])

# -- 2. run it and compare with NumPy -------------------------------------------------------------
rng = np.random.default_rng(0)
n_rows, n_cols = 37, 100                        # 37 rows: the last block has a partly idle warp set
x = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
out = np.zeros_like(x)
grid = (-(-n_rows // WARPS_PER_BLOCK),)
counters = mod.launch("row_softmax<true>", grid, (32 * WARPS_PER_BLOCK,),
                      (out, x, np.int32(n_rows), np.int32(n_cols)), schedule="random", seed=1)

e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
reference = e / e.sum(axis=1, keepdims=True)
err = np.abs(out - reference).max()
print("backend: flasharray emulator (CPU), host compiler %s (CXX= picks another)" % emulator.host_compiler())
print("max |emulator - numpy| = %.2e" % err)
assert err < 1e-6

# -- 3. what the kernel did ------------------------------------------------------------------------
print("blocks: %d   warp shuffles: %d   time: %.1f ms" % (counters.blocks, counters.shuffles, 1e3 * counters.seconds))
print("global memory: %d bytes read (x is %d bytes, read 3 times), %d bytes written"
      % (counters.global_read_bytes, x.nbytes, counters.global_write_bytes))
for index, traffic in counters.buffers.items():
    print("  argument %d: read %d bytes, wrote %d bytes" % (index, traffic.read_bytes, traffic.write_bytes))

# -- 4. the same kernel without the row check --------------------------------------------------------
# The warps of the last block that have no row read (and write) past the end of the arrays. On a GPU
# that is silent corruption or a crash much later; the emulator stops at the first bad access.
try:
    mod.launch("row_softmax<false>", grid, (32 * WARPS_PER_BLOCK,), (out, x, np.int32(n_rows), np.int32(n_cols)))
except emulator.EmulatorError as error:
    print("\nthe buggy kernel was caught:\n%s" % error)
else:
    raise AssertionError("the out-of-bounds access should have been reported")
