"""flash::FastDiv (flash_mask.cuh): the block mask's division by its block sizes as a multiply-high and a
shift. Known answers against NumPy's floor division on the emulator (the kernels' own C++), the same kernel on
a GPU where one is visible, and the SASS: no integer-division sequence left."""
import numpy as np
import pytest

from flasharray import emulator
from flasharray._private import launch, sass
from conftest import requires_gpu, requires_nvrtc

SRC = r'''
#include "flash_mask.cuh"
// Block b divides every x[0 .. nx) by d[b]: out[b * nx + i] = x[i] / d[b].
__global__ void fastdiv_test(const int* d, const int* x, int nx, int* out) {
    const flash::FastDiv div(fa::gload(d + blockIdx.x));
    for (int i = threadIdx.x; i < nx; i += blockDim.x) fa::gstore(out + blockIdx.x * nx + i, div(fa::gload(x + i)));
}
'''
NAME = "fastdiv_test"
INT_MAX = 2 ** 31 - 1


def _divisors():
    """Every block size the API takes up to 4096 (multiples of 16), larger ones, powers of two and their
    neighbours (the multiplier's extremes), and small odd ones (the rule holds for any d >= 2)."""
    d = set(range(16, 4097, 16)) | {2, 3, 5, 7, 15, 17, 255, 257, 1000, 65535, 65536, 65537, 10 ** 6, 2 ** 30,
                                    2 ** 30 + 16, INT_MAX}
    d |= {2 ** k + e for k in range(5, 31) for e in (-16, 0, 16)}
    return np.array(sorted(d), np.int32)


def _dividends(divisors, rng):
    """Multiples of the divisors and their neighbours (where a wrong multiplier rounds the wrong way), the
    largest int, and random values over the whole non-negative range."""
    x = {0, 1, INT_MAX, INT_MAX - 1}
    for k in (1, 2, 3, 1000, 2 ** 20):
        for d in divisors[::7]:
            for e in (-1, 0, 1):
                if 0 <= k * int(d) + e <= INT_MAX:
                    x.add(k * int(d) + e)
    x |= set(rng.integers(0, INT_MAX, 1500, dtype=np.int64).tolist())
    return np.array(sorted(x), np.int32)


def _check(run):
    d = _divisors()
    x = _dividends(d, np.random.default_rng(0))
    out = np.full(len(d) * len(x), -1, np.int32)
    run(d, x, out)
    want = (x[None, :].astype(np.int64) // d[:, None].astype(np.int64)).astype(np.int32)
    bad = np.argwhere(out.reshape(len(d), len(x)) != want)
    assert len(bad) == 0, ["%d / %d" % (x[j], d[i]) for i, j in bad[:5]]


def test_known_answers_on_the_emulator():
    mod = emulator.Module(SRC, name_expressions=[NAME], include_dirs=[str(launch.cuda_src_dir())])
    _check(lambda d, x, out: mod.launch(NAME, len(d), 128, (d, x, np.int32(len(x)), out)))


@requires_nvrtc
def test_no_integer_division_in_the_sass():
    """The quotient is a multiply-high and a shift: none of the I2F / MUFU.RCP / F2I sequence of a division
    by a run-time int (which the block-mask lookups compiled to before)."""
    from flasharray._private import nvrtc
    if not sass.available()[0]:
        pytest.skip("SASS report unavailable: %s" % sass.available()[1])
    res = nvrtc.compile_cubin(SRC, "sm_80", [NAME], include_dirs=[str(launch.cuda_src_dir())])
    body = sass.parse(sass.disassemble(res.cubin))[res.kernel(NAME).lowered_name]
    loop = sass.key_loop(body, "ldg")
    ops = [i.base for i in body if loop.start <= i.address <= loop.end]
    assert "IMAD" in ops and not {"I2F", "F2I", "MUFU"} & set(ops), ops


@requires_gpu
@requires_nvrtc
@pytest.mark.gpu
def test_known_answers_on_the_gpu():
    import cupy
    from flasharray._private import nvrtc
    arch = "".join(cupy.cuda.Device().compute_capability)
    res = nvrtc.compile_cubin(SRC, "sm_%s" % arch, [NAME], include_dirs=[str(launch.cuda_src_dir())])
    module = cupy.cuda.function.Module()
    module.load(res.cubin)

    def run(d, x, out):
        dev = cupy.asarray(out)
        module.get_function(res.lowered_names[NAME])((len(d), 1, 1), (128, 1, 1),
                                                     (cupy.asarray(d), cupy.asarray(x), np.int32(len(x)), dev))
        out[...] = cupy.asnumpy(dev)
    _check(run)


@requires_nvrtc
def test_block_mask_key_loops_have_no_integer_division():
    """The block-mask lookups of the fp16 forward (d 64) and of the row-tile dK/dV kernel (d 128, ordered dQ) divide
    by FastDiv: their key-tile loops hold no I2F / F2I (each integer division by a run-time int brought one of each;
    the forward's loop had 20 before, docs/performance.md, forty-eighth session)."""
    from flasharray._private import cuda_backward, cuda_forward, nvrtc, tiles, tiles_bwd
    if not sass.available()[0]:
        pytest.skip("SASS report unavailable: %s" % sass.available()[1])
    bm = cuda_forward.EXT_BITS["block_mask"]
    t = tiles.forward_tile("float16", 64, 64, 80, ext=True)
    kernels = [(t.source, cuda_forward.forward_name_expression(t, False, True, ext=bm))]
    grid = tiles_bwd.GRID_LAYOUT
    try:
        tiles_bwd.GRID_LAYOUT = False
        plan = cuda_backward.kernel_plan("float16", 128, 128, causal=False, deterministic=True, arch=80, ext=bm,
                                         ordered=True)
    finally:
        tiles_bwd.GRID_LAYOUT = grid
    kernels.append(plan["dkv"][:2])
    for source, name in kernels:
        res = nvrtc.compile_cubin(launch.kernel_source(source), "sm_80", [name], options=["--use_fast_math"])
        body = sass.parse(sass.disassemble(res.cubin))[res.kernel(name).lowered_name]
        loop = sass.key_loop(body)
        ops = [i.base for i in body if loop.start <= i.address <= loop.end]
        assert ops.count("HMMA") > 0 and not {"I2F", "F2I"} & set(ops), (name, sorted(set(ops)))
