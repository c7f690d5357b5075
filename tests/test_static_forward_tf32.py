"""Static checks of the TF32 forward (cuda_src/flash_fwd_tf32.cu) with NVRTC (no GPU needed).

Every instantiation the library uses compiles for sm_80, sm_86, sm_89 and sm_90 with zero spills,
no local stack, no static shared memory, registers x threads within the register file and dynamic
shared memory within the arch's opt-in maximum; the key-tile loop (sass.key_loop) holds exactly
the HMMA.1688.F32.TF32 instructions of one key tile (kPrec per product: 1 tf32, 3 3xtf32) and no
other HMMA; sm_75 is refused at compile time (fa::mma_m16n8k8_tf32 needs sm_80+) and by the host.

Default: d = dv in {64, 128} (3xtf32 on sm_80/90: Q split at 64, raw at 128), both precisions,
(non-causal, cp.async) and (causal, element-wise loads); the extension instantiations (kExt in
``EXT_SETS``, each on forward_tile's tile for it: Bc 16 for a window with a block mask) at
d 64 / 128, causal, cp.async; the wide tiles (``WIDE_DEFAULT``: d, dv up to 256, dv != d) and
tf32's wide extension tiles (Bc 16) at d 256. ``-m slow``: every padded head dim
16..128 x causal x aligned, dense and with ``EXT_SETS + EXT_SETS_SLOW``; ``WIDE_ALL`` (every padded
d = dv 144..256 and 12 pairs) dense x 4 flags, ``WIDE_EXT`` with the extension sets.
"""
import numpy as np
import pytest

from flasharray._private import cuda_forward_tf32 as T
from flasharray._private import launch, nvrtc, sass, tiles
from conftest import requires_nvrtc, static_archs

pytestmark = requires_nvrtc
SASS_OK, SASS_WHY = sass.available()
ARCHS = (80, 86, 89, 90)
#: The default run's archs: sm_80 and sm_90 (conftest.static_archs; the CI time budget), and sm_86 for the plain
#: kernels' own tiles (BASE_ARCHS). sm_89 compiles as sm_86 (same ISA, shared memory and tiles).
DEFAULT_ARCHS = static_archs(ARCHS)
BASE_ARCHS = static_archs(ARCHS, own=(86,))
REGISTER_FILE = 64 * 1024


ALL_FLAGS = [(c, a) for c in (False, True) for a in (False, True)]


#: kExt sets of the extension instantiations checked (cuda_forward.EXT_BITS): all but the block
#: mask, all but the window (both at the dense Bc), dropout, and a window with a block mask alone
#: and with every other extension (T.NARROW_EXT: Bc 16). ``-m slow`` adds the window and the block
#: mask alone.
EXT_SETS = (63 & ~8, 63 & ~1, 16, 1 | 8, 63)
EXT_SETS_SLOW = (1, 8)


#: Wide head dims (padded d or dv above 128): d = dv and pairs with dv != d both ways (O's accumulator
#: is dv/2 registers: dv 256 with a small d is the tightest, e.g. tf32 d 128 dv 256 spilled at Bc 32).
WIDE_DEFAULT = ((256, 256), (64, 256))
WIDE_ALL = tuple((d, d) for d in range(144, 257, 16)) + (
    (16, 256), (64, 256), (128, 256), (144, 256), (256, 16), (256, 64), (256, 128), (256, 144),
    (64, 224), (128, 240), (224, 128), (200, 136))
#: The wide extension instantiations checked by ``-m slow`` (tf32 only: 3xtf32 runs SIMT there).
WIDE_EXT = ((144, 144), (192, 192), (208, 208), (256, 256), (16, 256), (64, 256), (128, 256), (256, 64))


def instantiations(arch, head_dims, flags, exts=(0,)):
    """Name expression -> tile of every (precision, head dims, kExt, flags) the library runs: head_dims
    holds d (= dv) or (d, dv) pairs; calls that run SIMT (forward_tile None) are left out."""
    found = {}
    for precision in T.PREC:
        for hd in head_dims:
            d, dv = hd if isinstance(hd, tuple) else (hd, hd)
            for e in exts:
                t = T.forward_tile(precision, np.float32, d, dv, arch, ext=e, wgmma=False)  # (the wgmma one: its own file)
                if t is None:
                    continue
                for causal, aligned in flags:
                    found[t.name_expression(causal, aligned, e)] = t
    return found


def expected_hmma(t):
    """mma per key tile and warp: S (d/8 k-steps x Bc/8 n-tiles) + O (Bc/8 k-steps x dv/8 n-tiles)."""
    return (t.head_dim // 8 * t.block_n // 8 + t.block_n // 8 * t.head_dim_v // 8) * T.PREC[t.precision]


def _check(arch, head_dims, flags=ALL_FLAGS, exts=(0,)):
    found = instantiations(arch, head_dims, flags, exts)
    res = nvrtc.compile_cubin(launch.kernel_source(T.SOURCE), "sm_%d" % arch, list(found),
                              options=["--use_fast_math"])
    fns = sass.parse(sass.disassemble(res.cubin)) if SASS_OK else None
    problems, rows = [], []
    for name, t in found.items():
        k = res.kernel(name)
        line = "sm_%d %-66s regs %3d spill %d/%d smem %6d" % (arch, name, k.registers, k.spill_stores,
                                                                k.spill_loads, t.smem)
        if k.spill_stores or k.spill_loads or k.stack_frame or k.static_smem:
            problems.append("%s: spills %d/%d stack %d static smem %d" % (name, k.spill_stores, k.spill_loads,
                                                                         k.stack_frame, k.static_smem))
        if k.registers * t.n_threads > REGISTER_FILE or t.smem > tiles.smem_limit(arch):
            problems.append("%s: %d regs, %d bytes smem" % (name, k.registers, t.smem))
        if fns is not None:
            body = fns[k.lowered_name]
            loop = sass.key_loop(body)
            tf32 = sum(1 for i in body if i.opcode == "HMMA.1688.F32.TF32" and loop.start <= i.address <= loop.end)
            line += "  key loop %d instr, %d HMMA (%.2f/HMMA)" % (loop.stats.instructions, loop.stats.hmma,
                                                                 loop.per_hmma)
            if not (tf32 == loop.stats.hmma == expected_hmma(t)):
                problems.append("%s: key loop %d HMMA.1688.F32.TF32 of %d HMMA, expected %d"
                                % (name, tf32, loop.stats.hmma, expected_hmma(t)))
        rows.append(line)
    print("\n".join(rows))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("arch", BASE_ARCHS)
def test_tf32_forward_compiles(arch):
    _check(arch, (64, 128), [(False, True), (True, False)])


@pytest.mark.parametrize("arch", DEFAULT_ARCHS)
def test_tf32_forward_ext_compiles(arch):
    """The kExt instantiations (every extension; docs/precision.md has the figures): zero spills,
    the same HMMA per key tile."""
    _check(arch, (64, 128), [(True, True)], exts=EXT_SETS)


@pytest.mark.parametrize("arch", DEFAULT_ARCHS)
def test_tf32_forward_wide_compiles(arch):
    """Wide tiles (d or dv in 129..256): zero spills, the key loop's HMMA count; tf32 with extensions
    at Bc 16 (3xtf32 with extensions, and 3xtf32 where Br 64 does not fit sm_86/89, run SIMT)."""
    _check(arch, WIDE_DEFAULT, [(False, True), (True, False)])
    _check(arch, ((256, 256),), [(True, True)], exts=EXT_SETS)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_tf32_forward_wide_compiles_all_head_dims(arch):
    _check(arch, WIDE_ALL)
    _check(arch, WIDE_EXT, [(True, True), (False, False)], exts=EXT_SETS + EXT_SETS_SLOW)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_tf32_forward_ext_compiles_all_head_dims(arch):
    _check(arch, (16, 32, 48, 64, 80, 96, 112, 128), ALL_FLAGS, exts=EXT_SETS + EXT_SETS_SLOW)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_tf32_forward_compiles_all_head_dims(arch):
    _check(arch, (16, 32, 48, 64, 80, 96, 112, 128))


def test_sm75_refused():
    t = T.forward_tile("tf32", np.float32, 64, 64, 80)
    with pytest.raises(Exception, match="needs sm_80"):
        nvrtc.compile_cubin(launch.kernel_source(T.SOURCE), "sm_75", [t.name_expression(False, True)])
    for precision in T.PREC:
        with pytest.raises(NotImplementedError, match="sm_75"):
            T.forward_tile(precision, np.float32, 64, 64, 75)
