"""Static checks of the CUDA forward kernels with NVRTC (no GPU needed).

Every forward instantiation the tests use compiles for sm_75 (fp16 tensor cores + SIMT), sm_80,
sm_86, sm_89 and sm_90 with ``-Xptxas=-v``: zero spill stores/loads, no local stack, no static
shared memory (dynamic only), registers x threads within one SM's register file, dynamic shared
memory within the arch's opt-in maximum. The register / shared-memory table is printed (run with
``-s`` or ``-rP`` to see it). The Python smem formula is checked against the C++ traits on the
emulator.

Default run: every dtype x head dims {64, 256} (+ Dv != D) x causal x aligned, all five
archs but sm_89 (it compiles as sm_86: same ISA, shared memory and tiles). ``-m slow``: sm_89 too,
and every padded head dim {16, 32, 64, 96, 128, 256}.
"""
import numpy as np
import pytest

from flasharray._private import launch, tiles
from flasharray._private import nvrtc
from conftest import requires_nvrtc, static_archs

REGISTER_FILE = 64 * 1024
DTYPES = ("float16", "bfloat16", "float32", "float64")


pytestmark = requires_nvrtc


def instantiations(arch, head_dims):
    """{source: [(FwdTile, name_expression)]} of the forward kernels the tests launch on ``arch``."""
    shapes = [(d, d) for d in head_dims] + [(40, 24)]  # Dv != D (tests: D=40, Dv=24)
    found = {}
    for dt in DTYPES:
        for d, dv in shapes:
            kernels = [None]
            if arch == tiles.EMULATOR_ARCH and dt in ("float16", "bfloat16"):
                kernels.append("simt")  # the forced SIMT fallback of the 16-bit types
            for kernel in kernels:
                t = tiles.forward_tile(dt, d, dv, arch, kernel=kernel)
                for causal in (False, True):
                    for aligned in (False, True):
                        found.setdefault(t.source, {})[t.name_expression(causal, aligned)] = t
    for block_m in tiles.IO_TILES:  # benchmarks/io.py's tiles, where they fit
        for dt in ("float16", "bfloat16"):
            t = tiles.forward_tile(dt, 64, 64, arch, block_m=block_m)
            if t.smem <= tiles.smem_limit(arch) and tiles.tensor_cores_available(dt, arch):
                for causal in (False, True):
                    found.setdefault(t.source, {})[t.name_expression(causal, True)] = t
    return {src: sorted(v.items()) for src, v in found.items()}


def _check_arch(arch, head_dims):
    rows, problems = [], []
    limit = tiles.smem_limit(arch)
    for source, items in instantiations(arch, head_dims).items():
        names = [n for n, _ in items]
        res = nvrtc.compile_cubin(launch.kernel_source(source), "sm_%d" % arch, names,
                                  options=["--use_fast_math"])
        for name, t in items:
            k = res.kernel(name)
            rows.append("sm_%d %-72s regs %3d  spill %d/%d  stack %d  static smem %d  dyn smem %6d%s" % (
                arch, name, k.registers, k.spill_stores, k.spill_loads, k.stack_frame, k.static_smem,
                t.smem, " (opt-in)" if t.needs_opt_in else ""))
            if k.spill_stores or k.spill_loads or k.stack_frame:
                problems.append("%s: spills %d/%d, stack %d" % (name, k.spill_stores, k.spill_loads, k.stack_frame))
            if k.static_smem:
                problems.append("%s: %d bytes of static shared memory" % (name, k.static_smem))
            if k.registers * t.n_threads > REGISTER_FILE or k.registers > 255:
                problems.append("%s: %d registers x %d threads" % (name, k.registers, t.n_threads))
            if t.smem > limit:
                problems.append("%s: %d bytes smem > %d on sm_%d" % (name, t.smem, limit, arch))
    print("\n".join(rows))
    assert not problems, "\n".join(problems)
    return rows


@pytest.mark.parametrize("arch", static_archs(tiles.ARCHS, own=(75,)))   # Turing: its own copies, no bf16 mma
def test_forward_compiles_without_spills(arch):
    _check_arch(arch, (64, 256))


@pytest.mark.slow
@pytest.mark.parametrize("arch", tiles.ARCHS)
def test_forward_compiles_without_spills_all_head_dims(arch):
    _check_arch(arch, (16, 32, 64, 96, 128, 256))


def test_bf16_tensor_cores_not_on_sm75():
    """sm_75 has no bf16 mma: the table must never pick the tensor-core kernel for it there."""
    for d in (16, 64, 128, 256):
        assert tiles.forward_tile("bfloat16", d, d, 75).kernel == "simt"
        assert tiles.forward_tile("float16", d, d, 75).kernel == "tensor_core"
        assert tiles.forward_tile("bfloat16", d, d, 80).kernel == "tensor_core"


def test_tile_table_fits_every_arch():
    for arch, dt, hd, t in tiles.table(head_dims=(16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 256)):
        assert t.smem <= tiles.smem_limit(arch), (arch, dt, hd, t)
        assert t.reason


_PROBE = r"""
#include "flash_kernel_traits.cuh"
template <typename T, int D, int DV, int BM, int BN, int NW, int ST>
__global__ void probe_tc(int* out) {
  if (threadIdx.x == 0) fa::gstore(out, flash::FwdTensorCoreTraits<T, D, DV, BM, BN, NW, ST>::kSmemBytes);
}
template <typename T, int D, int DV, int BM, int BN, int TM, int TN>
__global__ void probe_simt(int* out) {
  if (threadIdx.x == 0) fa::gstore(out, flash::FwdSimtTraits<T, D, DV, BM, BN, TM, TN>::kSmemBytes);
}
"""


def test_python_smem_matches_traits():
    """tiles.py's smem formula equals the C++ traits' kSmemBytes for every table entry (emulator)."""
    from flasharray import emulator
    ctype = {"float16": "fa_half", "bfloat16": "fa_bf16", "float32": "float", "float64": "double"}
    entries = {}
    wide = [(a, "float16", d, tiles.forward_tile("float16", d, dv, a, wide=True))  # sm_86/89 d 128: sQ swizzled
            for a in tiles.ARCHS for d, dv in ((96, 96), (128, 128), (128, 64))]
    for arch, dt, hd, t in tiles.table(head_dims=(16, 48, 64, 128, 256)) + wide:
        if t.kernel == "tensor_core":
            expr = "probe_tc<%s, %d, %d, %d, %d, %d, %d>" % (ctype[dt], t.head_dim, t.head_dim_v, t.block_m,
                                                            t.block_n, t.threads_m, t.stages)
        else:
            expr = "probe_simt<%s, %d, %d, %d, %d, %d, %d>" % (ctype[dt], t.head_dim, t.head_dim_v, t.block_m,
                                                              t.block_n, t.threads_m, t.threads_n)
        entries[expr] = t.smem
    mod = emulator.Module(_PROBE, name_expressions=list(entries), include_dirs=[str(launch.cuda_src_dir())],
                          options=["-std=c++17"])
    for expr, smem in entries.items():
        out = np.zeros(1, np.int32)
        mod.launch(expr, (1,), (32,), (out,))
        assert int(out[0]) == smem, expr


# ---- the wide-row tiles (tiles.WIDE_ROWS: Br = 128; Bc = 64 single-buffered where two blocks fit, else 32) ---
#: The variants a wide-row plan can launch (cuda_forward.wide_rows: non-causal, aligned, no extensions,
#: no paged cache): dense, split-KV, per-entry key lengths (KV cache), split + lengths.
WIDE_VARIANTS = (dict(), dict(split=True), dict(seqlens_k=True), dict(split=True, seqlens_k=True))


def wide_instantiations(arch, pairs, dtypes=("float16", "bfloat16")):
    from flasharray._private import cuda_forward
    names = {}
    for dt in dtypes:
        if not tiles.tensor_cores_available(dt, arch):
            continue
        for d, dv in pairs:
            t = tiles.forward_tile(dt, d, dv, arch, wide=True)
            if t.block_m != 128 or max(t.head_dim, t.head_dim_v) <= 64:
                continue  # the table's tile (sm_75: two stages do not fit; d <= 64: its own 128 x 64)
            hd = max(t.head_dim, t.head_dim_v)
            two_fit = {(bc, st): tiles._two_blocks_fit(tiles.tc_smem(t.head_dim, t.head_dim_v, 128, bc, st), arch)
                       for bc, st in ((64, 1), (32, 2), (32, 1))}
            if hd <= 128 and t.head_dim >= t.head_dim_v and two_fit[64, 1]:
                assert (t.block_n, t.stages, t.threads_m) == (64, 1, 4)   # FlashAttention-2's 128 x 64
            elif hd <= 128 and two_fit[32, 1] and not two_fit[32, 2]:
                assert (t.block_n, t.stages, t.threads_m) == (32, 1, 4)   # sm_86/89: two single-buffered blocks
            elif hd > 128 and tiles.WIDE_BC64_LARGE:
                assert (t.block_n, t.stages, t.threads_m) == (64, 1, 8)   # FlashAttention-2's d 192-256 tile
            else:
                assert (t.block_n, t.stages, t.threads_m) == (32, 2, 4 if hd <= 128 else 8)
            for flags in WIDE_VARIANTS:
                names[cuda_forward.forward_name_expression(t, False, True, **flags)] = t
            if tiles.causal_takes_wide(dt, d, dv, arch):  # causal too, its variants with GQA packing (Is_packed)
                tc = tiles.forward_tile(dt, d, dv, arch, wide=True, causal=True)
                tv = tiles.forward_tile(dt, d, dv, arch, wide=True, causal=True, plain=False)
                if hd <= 128 and t.head_dim == t.head_dim_v and two_fit[64, 1]:  # the plain one: 128 x 64 (d = dv)
                    assert (tc.block_n, tc.stages) == (64, 1)
                else:
                    assert tc == tv
                expect = (128, 32, 2 if arch in tiles.WIDE_CAUSAL_ARCHS else 1)
                if hd > 128 and tiles.WIDE_BC64_LARGE:
                    expect = (128, 64, 1)   # every variant (the audit of the twenty-fifth session)
                assert (tv.block_m, tv.block_n, tv.stages) == expect
                names[cuda_forward.forward_name_expression(tc, True, True)] = tc
                for flags in WIDE_VARIANTS[1:] + (dict(packed=True), dict(split=True, packed=True),
                                                  dict(packed=True, seqlens_k=True)):
                    names[cuda_forward.forward_name_expression(tv, True, True, **flags)] = tv
    return names


def _check_wide(arch, pairs, dtypes=("float16", "bfloat16"), bf16_pairs=None):
    names = wide_instantiations(arch, pairs, [dt for dt in dtypes if dt != "bfloat16" or bf16_pairs is None])
    if bf16_pairs is not None and "bfloat16" in dtypes:
        names.update(wide_instantiations(arch, bf16_pairs, ("bfloat16",)))
    if not names:
        assert arch == 75, "the wide-row tile fits every arch but sm_75"
        return
    res = nvrtc.compile_cubin(launch.kernel_source("flash_fwd.cu"), "sm_%d" % arch, sorted(names),
                              options=["--use_fast_math"])
    problems = []
    for name, t in names.items():
        k = res.kernel(name)
        if k.spill_stores or k.spill_loads or k.stack_frame or k.registers > 255:
            problems.append("%s: %d registers, spills %d/%d" % (name, k.registers, k.spill_stores, k.spill_loads))
        if t.smem > tiles.smem_limit(arch):
            problems.append("%s: %d bytes smem" % (name, t.smem))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("arch", static_archs(tiles.ARCHS, own=(75, 86)))   # sm_86: two single-buffered blocks
def test_wide_row_tile_compiles_without_spills(arch):
    # bf16 (the same code with another mma type) at the two pairs of the default tiles; -m slow: every pair
    _check_wide(arch, [(128, 128), (96, 96), (128, 64), (32, 128), (256, 256), (192, 64), (144, 16)],
                bf16_pairs=[(128, 128), (256, 256)])


@pytest.mark.slow
@pytest.mark.parametrize("arch", tiles.ARCHS)
def test_wide_row_tile_every_head_dim_pair(arch):
    dims = range(16, 257, 16)
    _check_wide(arch, [(d, dv) for d in dims for dv in dims if max(d, dv) > 64], ("float16",))
    _check_wide(arch, [(d, d) for d in dims if d > 64], ("bfloat16",))
