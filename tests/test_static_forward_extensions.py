"""Static checks of the forward kernels with extensions (kExt != 0) with NVRTC (no GPU needed).

Every dtype x head dim {64, 256} x causal, with all six extension bits (window, ALiBi, softcap,
block mask, dropout, lengths: the heaviest variant), dropout alone and the score-only bits
(window | ALiBi | softcap), plus the split-KV tensor-core variant with all bits, compiles with
``-Xptxas=-v``: zero spills, no local stack, no static shared memory, registers x threads within the
register file. Default: sm_80; ``-m slow``: sm_75, sm_86, sm_89, sm_90 too (the CI time budget).
"""
import numpy as np
import pytest

from flasharray._private import cuda_forward, launch, nvrtc, tiles
from conftest import requires_nvrtc

REGISTER_FILE = 64 * 1024
DTYPES = ("float16", "bfloat16", "float32", "float64")
ALL = sum(cuda_forward.EXT_BITS.values())
VARIANTS = (ALL, cuda_forward.EXT_BITS["dropout"],
            cuda_forward.EXT_BITS["window"] | cuda_forward.EXT_BITS["alibi"] | cuda_forward.EXT_BITS["softcap"])

pytestmark = requires_nvrtc


def instantiations(arch, dtypes=DTYPES, head_dims=(64, 256), variants=VARIANTS):
    """{source: {name_expression: FwdTile}} of the extension variants on ``arch``."""
    found = {}
    for dt in dtypes:
        for d in head_dims:
            t = tiles.forward_tile(dt, d, d, arch, ext=True)
            for causal in (False, True):
                for bits in variants:
                    name = cuda_forward.forward_name_expression(t, causal, True, ext=bits)
                    found.setdefault(t.source, {})[name] = t
                if t.kernel == "tensor_core":
                    name = cuda_forward.forward_name_expression(t, causal, True, split=True, ext=ALL)
                    found.setdefault(t.source, {})[name] = t
    return found


def _check_arch(arch, **which):
    rows, problems = [], []
    for source, items in instantiations(arch, **which).items():
        res = nvrtc.compile_cubin(launch.kernel_source(source), "sm_%d" % arch, list(items),
                                  options=["--use_fast_math"])
        for name, t in sorted(items.items()):
            k = res.kernel(name)
            rows.append("sm_%d %-90s regs %3d  spill %d/%d  stack %d" % (
                arch, name, k.registers, k.spill_stores, k.spill_loads, k.stack_frame))
            if k.spill_stores or k.spill_loads or k.stack_frame:
                problems.append("%s: spills %d/%d, stack %d" % (name, k.spill_stores, k.spill_loads, k.stack_frame))
            if k.static_smem:
                problems.append("%s: %d bytes of static shared memory" % (name, k.static_smem))
            if k.registers * t.n_threads > REGISTER_FILE or k.registers > 255:
                problems.append("%s: %d registers x %d threads" % (name, k.registers, t.n_threads))
    print("\n".join(rows))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("arch", [80])
def test_extension_variants_compile_without_spills(arch):
    _check_arch(arch)


@pytest.mark.slow
@pytest.mark.parametrize("arch", [75, 86, 89, 90])
def test_extension_variants_compile_without_spills_slow(arch):
    _check_arch(arch)
    _check_arch(arch, head_dims=(96, 128))


@pytest.mark.parametrize("arch,d", [(86, 96), (80, 128)])
def test_single_buffered_extension_tiles_compile_without_spills(arch, d):
    """The square tile single-buffered for extension calls where that fits two blocks per SM (tiles.forward_tile's
    two-blocks rule): every extension at once (and split-KV), fp16."""
    assert tiles.forward_tile("float16", d, d, arch, ext=True).stages == 1
    _check_arch(arch, dtypes=("float16",), head_dims=(d,), variants=(ALL,))


def test_ext_bits_match_header():
    """EXT_BITS (Python) equals the kExt* constants of flash_ext.cuh."""
    text = launch.kernel_source("flash_ext.cuh")
    names = {"window": "kExtWindow", "alibi": "kExtAlibi", "softcap": "kExtSoftcap", "block_mask": "kExtBlockMask",
             "dropout": "kExtDropout", "seqlens": "kExtSeqlens"}
    for feature, const in names.items():
        assert "constexpr int %s = %d;" % (const, cuda_forward.EXT_BITS[feature]) in text
    assert len(set(cuda_forward.EXT_BITS.values())) == 6 and np.bitwise_or.reduce(list(cuda_forward.EXT_BITS.values())) == ALL
