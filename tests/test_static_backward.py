"""Static checks of the CUDA backward kernels with NVRTC (no GPU needed).

Every backward instantiation the tests in ``test_cuda_backward.py`` launch compiles for sm_75
(fp16 tensor cores + SIMT), sm_80, sm_86, sm_89 and sm_90 — with that arch's tiles from
``tiles_bwd`` — under ``-Xptxas=-v``: zero spill stores/loads, no local stack frame, no static
shared memory (dynamic only), registers x threads within one SM's register file, dynamic shared
memory within the arch's opt-in maximum. The register / shared-memory table is printed (``-s``).
The Python shared-memory formulas are checked against the C++ layouts on the emulator.

Default: the matrix tests' instantiations on sm_75 (Turing's own copies), sm_80 and sm_90 (sm_86 and sm_89:
``-m slow``, the CI time budget; conftest.static_archs), the other tests' on the arch they run with (sm_80 tiles,
and sm_75 for the sm_75 test). ``-m slow``: the full matrix, everything on
every arch.
"""
import itertools

import numpy as np
import pytest

from flasharray._private import cuda_backward as cb
from flasharray._private import launch, nvrtc, tiles_bwd
from flasharray._private.dtypes import canonical_dtype

import test_cuda_backward as tb
from conftest import requires_nvrtc, static_archs

REGISTER_FILE = 64 * 1024




def _vec(D, Dv):
    return D % 8 == 0 and Dv % 8 == 0  # the tests' arrays are 16-byte aligned with rows of D elements


# (dtype, D, Dv, causal, deterministic, kernel, acc_dkv, acc_dq) of the default tests beyond CASES.
EXTRA = (
    [(dt, D, Dv, True, True, None, False, False) for dt in ("float16", "float32") for D, Dv in ((64, 32), (32, 96), (16, 192))]
    + [("float32", 32, 32, True, det, None, True, False) for det in (True, False)]      # k, v broadcast differently
    + [("float16", 64, 64, False, True, None, False, True), ("float64", 64, 64, False, False, None, False, True)]
    + [("float32", 64, 64, False, True, None, False, True)]                             # q broadcast, SIMT ordered
    + [("float16", 64, 64, False, False, None, False, True)]                            # q broadcast, atomic dQ
    + [("float16", D, D, True, False, None, False, False) for D in (59, 80, 40)]         # padded dQ accumulator
    + [("float16", 32, 32, True, True, None, False, False)]                             # many batch dims
    + [(dt, 64, 64, True, True, None, False, False) for dt in ("float16", "float32")]    # masked rows
    + [(dt, 64, 64, True, True, "simt", False, False) for dt in ("float16", "bfloat16")]
    + [(dt, 64, 64, True, det, None, False, False) for dt in ("float16", "float32") for det in (True, False)]
    + [(dt, 32, 32, True, False, None, False, False) for dt in ("float16", "float64")]
    + [(dt, D, D, c, det, None, False, False) for dt, D in (("float16", 64), ("float32", 32), ("float64", 16))
       for c in (False, True) for det in (True, False)]
    + [("float16", 59, 59, False, True, None, False, False)]
    + [("float16", 64, 64, True, det, None, False, False) for det in (True, False)]     # stages
)


# test_backward_tensor_core_stages also forces single-buffered tiles for these (dtype, D, causal).
FORCED_ONE_STAGE = {("float16", 64, True)}
# test_backward_sm75_tiles runs these with the sm_75 tiles.
SM75 = [("float16", 128, 128, True, True, None, False, False), ("float64", 128, 128, False, True, None, False, False)]


def _configs(arch, full):
    """Configurations of the matrix tests (CASES, or FULL with ``full``) on every arch; those of
    the other default tests on the arch they run with (all archs with ``full``)."""
    cases = tb.FULL if full else tb.CASES
    out = set()
    for dt, D, _, causal, bcast, _, det in cases:
        out.add((canonical_dtype(tb.DTYPE_NAMES[dt]).name, D, D, causal, det, None, False, False))
    if full or arch == tiles_bwd.EMULATOR_ARCH:
        out.update(EXTRA)
    if full or arch == 75:
        out.update(SM75)
    return sorted(out, key=str)


def instantiations(arch, full=False):
    """{source: {name_expression: BwdTiles or None}} of the backward kernels the tests launch."""
    found = {}
    for dt, D, Dv, causal, det, kernel, acc_dkv, acc_dq in _configs(arch, full):
        if (kernel or ("tc" if canonical_dtype(dt).itemsize == 2 else "simt")) == "tc" and dt == "bfloat16" and arch < 80:
            continue  # bf16 has no tensor cores before sm_80 (the driver raises NotImplementedError)
        orders = (kernel or cb.default_kernel(canonical_dtype(dt), arch)) in ("tc", "simt")
        # deterministic runs: ordered atomics (the default) and the recomputing dQ kernel
        modes = (True, False) if det and orders else (False,)
        for stages, ordered in itertools.product(
                [None] + ([1] if (dt, D, causal) in FORCED_ONE_STAGE and arch == tiles_bwd.EMULATOR_ARCH else []),
                modes):
            plan = cb.kernel_plan(dt, D, Dv, causal=causal, deterministic=det, arch=arch, kernel=kernel,
                                  acc_dkv=acc_dkv, acc_dq=acc_dq, vec=_vec(D, Dv), stages=stages, ordered=ordered)
            for source, name, t in plan.values():
                found.setdefault(source, {})[name] = t
    return found


def _check_arch(arch, full=False):
    rows, problems = [], []
    limit = tiles_bwd.smem_limit(arch)
    for source, items in sorted(instantiations(arch, full).items()):
        res = nvrtc.compile_cubin(launch.kernel_source(source), "sm_%d" % arch, sorted(items),
                                  options=["--use_fast_math"])
        for name, t in sorted(items.items()):
            k = res.kernel(name)
            threads = t.n_threads if t else tiles_bwd.ROW_THREADS
            smem = t.smem if t else 0
            rows.append("sm_%d %-82s regs %3d  spill %d/%d  stack %d  static smem %d  dyn smem %6d%s" % (
                arch, name, k.registers, k.spill_stores, k.spill_loads, k.stack_frame, k.static_smem,
                smem, " (opt-in)" if t and t.needs_opt_in else ""))
            if k.spill_stores or k.spill_loads or k.stack_frame:
                problems.append("%s: spills %d/%d, stack %d" % (name, k.spill_stores, k.spill_loads, k.stack_frame))
            if k.static_smem:
                problems.append("%s: %d bytes of static shared memory" % (name, k.static_smem))
            if k.registers * threads > REGISTER_FILE or k.registers > 255:
                problems.append("%s: %d registers x %d threads" % (name, k.registers, threads))
            if smem > limit:
                problems.append("%s: %d bytes smem > %d on sm_%d" % (name, smem, limit, arch))
    print("\n".join(rows))
    assert not problems, "\n".join(problems)
    return rows


@requires_nvrtc
@pytest.mark.parametrize("arch", static_archs(tiles_bwd.ARCHS, own=(75,)))
def test_backward_compiles_without_spills(arch):
    rows = _check_arch(arch)
    assert any("flash_bwd_dkv_kernel<fa_half" in r for r in rows)
    assert any("flash_bwd_dq_simt_kernel<double" in r for r in rows)
    assert any("flash_bwd_dkv_simt_kernel<float" in r and ", true> " in r for r in rows)  # ordered SIMT


@requires_nvrtc
@pytest.mark.slow
@pytest.mark.parametrize("arch", tiles_bwd.ARCHS)
def test_backward_compiles_without_spills_full(arch):
    _check_arch(arch, full=True)


def test_backward_tile_table_fits_every_arch():
    for arch in tiles_bwd.ARCHS:
        for dt in ("float16", "float32", "float64"):
            for d, dv in itertools.product((16, 32, 64, 96, 128, 160, 192, 256), repeat=2):
                for kern in ("dkv", "dq"):
                    if dt == "float16":
                        t = tiles_bwd.tc_tiles(kern, d, dv, arch)
                    else:
                        t = tiles_bwd.simt_tiles(kern, dt, d, dv, arch)
                    assert t.smem <= tiles_bwd.smem_limit(arch), (arch, dt, d, dv, kern, t)
                    assert t.reason


def test_backward_wide_key_tiles():
    """The dK/dV kernel's wide-key tiles (tiles_bwd.TC_WIDE_KEYS): 128 keys x 32 queries at padded head
    dims 64-128 with one above 64, 64 x 32 at d 256, where their shared memory fits; not with extensions,
    not at d 64 (128 x 64 there), d 112 or 192 (they spill), not on sm_75 (shared memory); the dQ kernel
    unchanged."""
    for arch, d, dv, ext, expect in (("sm_80", 128, 128, False, (32, 128, 2)), ("sm_90", 96, 128, False, (32, 128, 2)),
                                     ("sm_86", 80, 80, False, (32, 128, 2)), ("sm_80", 128, 64, False, (32, 128, 2)),
                                     ("sm_86", 128, 128, False, (32, 128, 1)), ("sm_80", 112, 112, False, (64, 128, 2)),
                                     ("sm_80", 64, 64, False, (64, 128, 2)), ("sm_80", 128, 128, True, (64, 64, 2)),
                                     ("sm_75", 128, 128, False, (32, 64, 1)), ("sm_80", 256, 256, False, (32, 64, 2)),
                                     ("sm_90", 256, 256, False, (32, 64, 2)), ("sm_86", 256, 256, False, (32, 32, 1)),
                                     ("sm_80", 192, 192, False, (64, 32, 2)), ("sm_80", 256, 256, True, (64, 32, 1))):
        t = tiles_bwd.tc_tiles("dkv", d, dv, arch, ext=ext)
        assert (t.block_m, t.block_n, t.stages) == expect, (arch, d, dv, ext, t)
        assert t.n_threads == 256 and t.smem == tiles_bwd.tc_smem("dkv", d, dv, t.block_m, t.block_n, t.stages, warps=8)
    assert tiles_bwd.tc_tiles("dkv", 128, 128, "sm_80", stages=1).stages == 1
    t = tiles_bwd.tc_tiles("dq", 128, 128, "sm_80")
    assert (t.block_m, t.block_n) == (128, 64)


_PROBE = r"""
#include "flash_bwd_simt.cu"
#include "flash_bwd.cu"
template <typename T, typename AccT, int D, int DV, int BM, int BN, bool DKV>
__global__ void probe_simt(int* out) {
  if (threadIdx.x == 0) fa::gstore(out, fa_bwd::SimtSmem<T, AccT, D, DV, BM, BN, DKV>::kBytes);
}
template <int D, int DV, int BM, int BN, bool DKV, int ST, bool NOPT>
__global__ void probe_tc(int* out) {
  if (threadIdx.x == 0) fa::gstore(out, fa_bwd::TcSmem<D, DV, BM, BN, DKV, ST, NOPT>::kBytes);
}
"""


def test_python_smem_matches_layouts():
    """tiles_bwd's shared-memory formulas equal the kernels' SimtSmem / TcSmem kBytes (emulator)."""
    from flasharray import emulator
    ctype = {"float16": ("fa_half", "float"), "float32": ("float", "float"), "float64": ("double", "double")}
    entries = {}
    for arch in tiles_bwd.ARCHS:
        for dt in ctype:
            for d, dv in ((16, 16), (64, 32), (96, 96), (128, 128), (256, 256)):
                for kern in ("dkv", "dq"):
                    if dt == "float16":
                        for stages in (1, 2):
                            t = tiles_bwd.tc_tiles(kern, d, dv, arch, stages)
                            no_pt = kern == "dkv" and t.n_threads // 32 == t.block_n // 16  # P^T in registers
                            expr = "probe_tc<%d, %d, %d, %d, %s, %d, %s>" % (
                                d, dv, t.block_m, t.block_n, "true" if kern == "dkv" else "false", stages,
                                "true" if no_pt else "false")
                            entries[expr] = t.smem
                    t = tiles_bwd.simt_tiles(kern, dt, d, dv, arch)
                    expr = "probe_simt<%s, %s, %d, %d, %d, %d, %s>" % (*ctype[dt], d, dv, t.block_m, t.block_n,
                                                                       "true" if kern == "dkv" else "false")
                    entries[expr] = t.smem
    mod = emulator.Module(_PROBE, name_expressions=sorted(entries), include_dirs=[str(launch.cuda_src_dir())],
                          options=["-std=c++17"])
    for expr, smem in sorted(entries.items()):
        out = np.zeros(1, np.int32)
        mod.launch(expr, (1,), (32,), (out,))
        assert int(out[0]) == smem, expr


@requires_nvrtc
def test_simt_two_blocks_compile_to_two_blocks_per_sm():
    """Every float32 SIMT dK/dV instantiation tiles_bwd.SIMT_TWO_BLOCKS selects (dense, each padded head dim of
    SIMT_TWO_BLOCKS_HEAD_DIMS, causal or not, ordered / atomic / recompute mode) compiles with zero spills to at
    most 128 registers: two blocks, 16 warps, share an SM (sass.occupancy with its shared memory)."""
    from flasharray._private import sass
    for arch, dims in sorted(tiles_bwd.SIMT_TWO_BLOCKS_HEAD_DIMS.items()):
        tiles = {}
        for d, causal, (det, ordered) in itertools.product(dims, (False, True), ((True, True), (False, False),
                                                                                  (True, False))):
            _, name, t = cb.kernel_plan(np.float32, d, d, causal=causal, deterministic=det, arch=arch,
                                        kernel="simt", ordered=ordered)["dkv"]
            assert t.blocks_per_sm == 2 and name.endswith(", 2>"), (arch, d, name)
            tiles[name] = t
        res = nvrtc.compile_cubin(launch.kernel_source("flash_bwd_simt.cu"), "sm_%d" % arch, sorted(tiles),
                                  options=["--use_fast_math"])
        for name, t in sorted(tiles.items()):
            k = res.kernel(name)
            occ = sass.occupancy(arch, k.registers, t.n_threads, t.smem + k.static_smem)
            assert (k.spill_stores, k.spill_loads, k.registers <= 128, occ.blocks) == (0, 0, True, 2), (arch, name, k)
