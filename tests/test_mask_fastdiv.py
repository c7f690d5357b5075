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
