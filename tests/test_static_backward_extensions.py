"""Static checks of the backward kernels with extensions (kExt != 0) with NVRTC (no GPU).

Tensor cores and SIMT (fp16, bf16, fp32, fp64 with each arch's kernel choice) x head dim {64, 128, 256} x causal, deterministic (dK/dV + dQ kernels),
atomic (dK/dV with atomic dQ) and ordered (fp16 / bf16 tensor cores and SIMT: the atomic dQ in
key-block order, with the bits it takes), with all six extension bits (the heaviest variant) — ordered:
lengths, ALiBi, softcap and dropout — compiles with
``-Xptxas=-v``: zero spills, no local stack, no static shared memory, registers x threads within the
register file. Default: sm_80, all bits, causal (~1 min of NVRTC: CI time); ``-m slow``: non-causal,
sm_75, sm_86, sm_89, sm_90 too, and dropout alone / the score-only bits (window | ALiBi | softcap).
The extension subsets that spilled before the spill audit (``SPILLED``; benchmarks/spill_audit.py
checks all 63 subsets): fp16 on sm_80 and sm_90 by default, the other archs and bf16 with ``-m slow``.
"""
import pytest

from flasharray._private import cuda_backward, cuda_forward, launch, nvrtc
from conftest import requires_nvrtc, static_archs

REGISTER_FILE = 64 * 1024
ALL = sum(cuda_forward.EXT_BITS.values())
#: the fp16 / bf16 ordered dQ mode's bits (lengths, ALiBi, softcap, dropout; above head dim 128
#: without ALiBi)
ORDERED = cuda_backward.TC_ORDERED_EXT
ORDERED_WIDE = cuda_backward.TC_ORDERED_EXT_WIDE
SIMT_ORDERED = cuda_backward.SIMT_ORDERED_EXT
SCORE_ONLY = cuda_forward.EXT_BITS["window"] | cuda_forward.EXT_BITS["alibi"] | cuda_forward.EXT_BITS["softcap"]

pytestmark = requires_nvrtc


def instantiations(arch, variants, causals=(False, True), ordered_variants=()):
    """{source: {name_expression: BwdTiles}} of the backward's extension variants: ``variants`` in
    the deterministic (dQ kernel) and atomic modes, ``ordered_variants`` in the ordered dQ mode
    (the fp16 / bf16 tensor cores and the SIMT kernels)."""
    found = {}
    modes = [(bits, det, False) for bits in variants for det in (True, False)]
    modes += [(bits, True, True) for bits in ordered_variants]
    for dt in ("float16", "bfloat16", "float32", "float64"):  # bf16 on sm_75: the SIMT kernels
        for d in (64, 128, 256):
            for causal in causals:
                for bits, det, ordered in modes:
                    kernel = cuda_backward.default_kernel(dt, arch)
                    if ordered and not cuda_backward._family_orders(kernel, bits, d):
                        continue
                    plan = cuda_backward.kernel_plan(dt, d, d, causal=causal, deterministic=det, arch=arch,
                                                     ext=bits, ordered=ordered)
                    for role in ("dkv", "dq"):
                        if role in plan:
                            source, name, t = plan[role]
                            found.setdefault(source, {})[name] = t
    return found


#: Extension subsets that spilled at the 255-register cap on sm_80 or sm_90 before the spill audit
#: (benchmarks/spill_audit.py, docs/performance.md "Spill audit of the extension subsets"), fp16,
#: causal: (role, head dim, kExt) — "dq" the recomputing dQ kernel, "atomic" the dK/dV kernel with
#: atomic dQ, "dkv" the recomputing mode's dK/dV kernel. Softcap, dropout, ALiBi (and lengths) at
#: head dim 128; all four at 256 (sm_80); at 256 on sm_90, ALiBi with the others in the atomic
#: dK/dV kernel and ALiBi with lengths in the recomputing one (double-buffered: now single,
#: ``cuda_backward._dkv_stages``).
SPILLED = ([("dq", 128, bits) for bits in (4, 16, 18, 20, 22, 36, 48, 50, 52, 54)]
           + [("atomic", 128, 54), ("dq", 256, 54)]
           + [("atomic", 256, bits) for bits in (2, 18, 22, 34, 50, 54)]
           + [("dkv", 256, bits) for bits in (34, 38, 50, 54)])


def spilled_instantiations(arch, cases=SPILLED, dtype="float16"):
    """{source: {name_expression: BwdTiles}} of ``cases`` (role, head dim, kExt), causal."""
    found = {}
    for role, d, bits in cases:
        plan = cuda_backward.kernel_plan(dtype, d, d, causal=True, deterministic=role != "atomic", arch=arch,
                                         ext=bits)
        source, name, t = plan["dq" if role == "dq" else "dkv"]
        found.setdefault(source, {})[name] = t
    return found


def _check_arch(arch, variants, causals=(False, True), ordered_variants=(ORDERED, ORDERED_WIDE, SIMT_ORDERED)):
    _check(arch, instantiations(arch, variants, causals, ordered_variants))


#: Names per NVRTC program in :func:`_check`: one program of the slow grid test's ~1,000 instantiations grew to 14 GB
#: (its worker was killed for memory on a 23 GB machine, fiftieth session); chunks keep each program small.
CHUNK = 96


def _check(arch, found):
    rows, problems = [], []
    for source, items in found.items():
        names = sorted(items)
        kernels = {}
        for i in range(0, len(names), CHUNK):
            res = nvrtc.compile_cubin(launch.kernel_source(source), "sm_%d" % arch, names[i:i + CHUNK],
                                      options=["--use_fast_math"])
            kernels.update((n, res.kernel(n)) for n in names[i:i + CHUNK])
        for name, t in sorted(items.items()):
            k = kernels[name]
            rows.append("sm_%d %-100s regs %3d  spill %d/%d  stack %d" % (
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
def test_backward_extension_variants_compile_without_spills(arch):
    # the causal kernels carry the most (mask + band); every bit, and the ordered dQ mode's set
    _check_arch(arch, (ALL,), causals=(True,))


@pytest.mark.parametrize("arch", static_archs((80, 86, 89, 90), default=(80,)))
def test_backward_lengths_compile_without_spills(arch):
    # per-entry lengths alone: the fp16 / bf16 dK/dV kernel's wide-key tiles (tiles_bwd.WIDE_KEYS_EXT), every mode
    lengths = cuda_forward.EXT_BITS["seqlens"]
    _check_arch(arch, (lengths,), ordered_variants=(lengths,))


def wide_key_ext_instantiations(arch, dtypes=("float16",)):
    """{source: {name: BwdTiles}} of the dK/dV kernels tiles_bwd.WIDE_KEYS_EXT_BY_MODE puts on the wide-key tiles:
    each set in each of its dQ modes at each of its head dims (d = dv), causal and not; asserts each is the
    wide-key tile, or the grid layout where that takes the set (tiles_bwd.grid_tile: softcap at d 128 in the
    atomic modes), or where the arch refuses it (tiles_bwd.WIDE_KEYS_EXT_SPILLED) a candidate tile of <= 64 keys."""
    from flasharray._private import tiles_bwd
    found = {}
    for bits, (modes, dims) in tiles_bwd.WIDE_KEYS_EXT_BY_MODE.items():
        for dt in dtypes:
            for d in dims:
                for mode in modes:
                    for causal in (False, True):
                        plan = cuda_backward.kernel_plan(dt, d, d, causal=causal, deterministic=mode != "atomic",
                                                         arch=arch, ext=bits, ordered=mode == "ordered")
                        source, name, t = plan["dkv"]
                        if t.layout == "grid":
                            assert tiles_bwd.grid_tile(d, d, arch, ext=bits, mode=mode) == t, (name, t)
                        elif not tiles_bwd.wide_keys_take(bits, d, d, mode, arch):  # WIDE_KEYS_EXT_SPILLED
                            assert t.block_n <= 64, (name, t)
                        else:
                            assert t.block_m == 32 and t.block_n >= 32 * (1 + (d < 256)), (name, t)
                        found.setdefault(source, {})[name] = t
    return found


@pytest.mark.parametrize("arch", static_archs((80, 86, 89, 90), default=(80,)))
def test_backward_wide_key_extension_sets_compile_without_spills(arch):
    # softcap alone (every mode) and dropout alone (atomic modes) on the fp16 / bf16 wide-key tiles
    _check(arch, wide_key_ext_instantiations(arch, ("float16",) if arch == 80 else ("float16", "bfloat16")))


@pytest.mark.slow
@pytest.mark.parametrize("arch", [75, 80, 86, 89, 90])
def test_backward_extension_variants_compile_without_spills_slow(arch):
    _check_arch(arch, (ALL, cuda_forward.EXT_BITS["dropout"], SCORE_ONLY))


@pytest.mark.parametrize("arch", [80, 90])
def test_backward_extension_subsets_that_spilled(arch):
    # the subsets of the spill audit that spilled on sm_80 / sm_90 (fp16, causal), ~6 s of NVRTC each
    _check(arch, spilled_instantiations(arch))


@pytest.mark.slow
@pytest.mark.parametrize("arch", [75, 80, 86, 89, 90])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_backward_extension_subsets_that_spilled_slow(arch, dtype):
    if dtype == "bfloat16" and arch < 80:
        pytest.skip("bf16 runs the SIMT kernels before sm_80")
    if dtype == "float16" and arch in (80, 90):
        pytest.skip("the default test")
    _check(arch, spilled_instantiations(arch, dtype=dtype))


def grid_ext_instantiations(arch, dtypes=("float16",), dims=(64, 128, 256), causals=(False, True), partial=(False,)):
    """{source: {name: BwdTiles}} of the grid-layout dK/dV kernels with extensions (tiles_bwd.GRID_EXT, less
    tiles_bwd.GRID_EXT_SPILLED): every allowed set of window / ALiBi / softcap / lengths at ``dims``, both dQ
    modes (the ordered one where it runs the set: no ALiBi above d 128); ``partial``: also the float-output
    (broadcast K/V partial sums) instantiations."""
    import itertools
    from flasharray._private import tiles_bwd
    sets = [b for b in range(1, tiles_bwd.GRID_EXT + 1) if not b & ~tiles_bwd.GRID_EXT]
    found = {}
    for dt, d, causal, ordered, acc in itertools.product(dtypes, dims, causals, (False, True), partial):
        for bits in sets:
            if tiles_bwd.grid_tile(d, d, arch, ext=bits, mode="ordered" if ordered else "atomic", partial=acc) is None:
                continue
            if ordered and not cuda_backward._family_orders("tc", bits, d):
                continue
            source, name, t = cuda_backward.kernel_plan(dt, d, d, causal=causal, deterministic=ordered, arch=arch,
                                                        ext=bits, ordered=ordered, acc_dkv=acc)["dkv"]
            assert name.startswith("flash_bwd_dkv_grid_kernel<") and t.layout == "grid", name
            found.setdefault(source, {})[name] = t
    return found


@pytest.mark.parametrize("d, count", [(128, 2 * 9 + 2 * 6 + 2 * 6 + 2 * 6), (256, 20 + 10 + 19 + 7 + 15)])
def test_grid_layout_extension_sets_compile_without_spills(d, count):
    # every set the grid layout takes at d 128 / 256 (where sets spilled), causal (most of the spills), fp16, sm_80:
    # d 128 both modes x the 15 sets without a block mask or dropout less 6 spilled, x the 6 with dropout and softcap,
    # and x the 10 block-mask sets of tiles_bwd._BM128 (the per-m-tile pass) less the 4 of _GRID_FASTDIV_SPILLED; d 256
    # the 31 sets without dropout less 4 spilled without a block mask and 7 with one (atomic), less ALiBi's (ordered),
    # and the 32 with dropout less 13 spilled (atomic; ordered: less ALiBi's); then the sets of tiles_bwd._GRID_LET_BACK
    # (fiftieth session): d 128 six in both modes, d 256 five in both and five with ALiBi (atomic only)
    found = grid_ext_instantiations(80, dims=(d,), causals=(True,))
    assert len(found["flash_bwd.cu"]) == count
    _check(80, found)


def test_d256_dropout_alibi_lengths_float_output_takes_the_row_tile():
    """d 256 dropout + ALiBi + lengths in float output (K/V broadcast): the grid kernel spilled 32 bytes on sm_90
    (causal, atomic; found by the slow test below, fifty-first session), so tiles_bwd.GRID_EXT_SPILLED_PARTIAL refuses
    it there and the row-tile kernel runs it, without spills; the T output keeps the grid."""
    from flasharray._private import tiles_bwd
    bits = 16 | 2 | 32
    assert bits in tiles_bwd.GRID_EXT_SPILLED_PARTIAL[256]
    assert tiles_bwd.grid_tile(256, 256, 90, ext=bits, mode="atomic", partial=True) is None
    assert tiles_bwd.grid_tile(256, 256, 90, ext=bits, mode="atomic") is not None
    found = {}
    for acc in (False, True):
        source, name, t = cuda_backward.kernel_plan("float16", 256, 256, causal=True, deterministic=False, arch=90,
                                                    ext=bits, ordered=False, acc_dkv=acc)["dkv"]
        assert t.layout == ("rows" if acc else "grid"), name
        found.setdefault(source, {})[name] = t
    _check(90, found)


@pytest.mark.slow
@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_grid_layout_extension_sets_compile_without_spills_slow(arch, dtype):
    # the whole audit of tiles_bwd.GRID_EXT_SPILLED: d 64, 128 and 256, causal or not, T and float outputs
    _check(arch, grid_ext_instantiations(arch, (dtype,), partial=(False, True)))
