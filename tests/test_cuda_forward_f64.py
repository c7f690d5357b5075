"""The float64 forward on the DMMA tensor cores (cuda_src/flash_fwd_f64.cu, issue 12) on the emulator.

The kernel is IEEE fp64 (DMMA = fp64 fused multiply-add chains, exp2 in double), so it is held to
the DESIGN.md rule for float64 (``assert_attention_close``: the naive float64 error is the
reference's own, so the bound is its atol, 1e-12), and its max error against the float64
reference is compared with the SIMT fp64 kernel's on the same inputs (both at the 1e-16 level).

Default run: a representative subset (D 16/32/59/64/128, Dv != D, Lq 1/17/64/77/65, Lk 45/63/130,
causal with fully masked rows, GQA broadcast, BSHD strided views, the element-wise copy path);
``-m slow``: head dims x lengths x causal.
"""
import numpy as np
import pytest

import flasharray as fa
from flasharray import reference
from flasharray._private import cuda_forward, cuda_forward_f64, tiles
from flasharray.testing import assert_attention_close

from conftest import flag_set
from test_cuda_forward import make_inputs, run_forward


def check(D, Lq, Lk, causal, *, Dv=None, layout="bhsd", gqa=False, seed=0, **opts):
    q, k, v = make_inputs(np.float64, D, Lq, Lk, Dv=Dv, layout=layout, gqa=gqa, seed=seed)
    q0, k0, v0 = q.copy(), k.copy(), v.copy()
    out, lse = run_forward("emulator", q, k, v, causal=causal, **opts)
    assert out.dtype == np.float64 and lse.dtype == np.float64
    assert out.shape == q.shape[:-1] + (v.shape[-1],) and lse.shape == q.shape[:-1]
    assert_attention_close(out, q, k, v, causal=causal, lse=lse)
    for a, b in ((q, q0), (k, k0), (v, v0)):
        np.testing.assert_array_equal(a, b)
    return out, lse


def f64_plan(q, k, v, causal, **kw):
    batch = tuple(np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    return cuda_forward.plan(q, k, v, causal=causal, scale=0.125, batch_shape=batch, device="emulator", **kw)


# (D, Lq, Lk, causal, layout, gqa): Lq = 1 (GQA-packed), Lq > Lk causal (fully masked rows), Lk not a
# multiple of Bc, BSHD views (row stride H·D), D = 59 (odd: the element-wise copies).
SUBSET = [
    (64, 77, 130, False, "bhsd", False),
    (32, 1, 130, True, "bhsd", True),
    (128, 65, 63, True, "bhsd", False),
    (59, 17, 45, False, "bshd", False),
    (16, 64, 64, True, "bshd", True),
    (128, 17, 130, False, "bshd", True),
]


def _id(c):
    D, Lq, Lk, causal, layout, gqa = c
    return "d%d-%dx%d%s-%s%s" % (D, Lq, Lk, "-causal" if causal else "", layout, "-gqa" if gqa else "")


@pytest.mark.parametrize("case", SUBSET, ids=[_id(c) for c in SUBSET])
def test_forward_f64(case):
    D, Lq, Lk, causal, layout, gqa = case
    q, k, v = make_inputs(np.float64, D, Lq, Lk, layout=layout, gqa=gqa)
    assert f64_plan(q, k, v, causal).tile.kernel == "f64"
    check(D, Lq, Lk, causal, layout=layout, gqa=gqa)


def test_forward_f64_dv_differs():
    check(40, 33, 70, True, Dv=24)
    check(32, 20, 50, False, Dv=128)


def test_precision_ieee_is_dmma():
    """precision="ieee" on float64 is the DMMA kernel too (IEEE fp64 either way); kernel="simt" forces SIMT."""
    q, k, v = make_inputs(np.float64, 64, 17, 33, batch=(1, 1))
    assert f64_plan(q, k, v, False, precision="ieee").tile.kernel == "f64"
    assert f64_plan(q, k, v, False, kernel="simt").tile.kernel == "simt"
    check(64, 17, 33, False, precision="ieee")


def test_f64_kernel_runs_its_dmma():
    """The DMMA kernel (not SIMT) runs: one m8n8k4 per 8x8x4 block of each product; every element of
    q, k, v read once per tile load (emulator bytes = the analytic count)."""
    q, k, v = make_inputs(np.float64, 64, 64, 128, batch=(1, 1))
    p = f64_plan(q, k, v, False)
    assert p.tile.kernel == "f64"
    counters = []
    p.run(q, k, v, counters)
    # S: 64x128 outputs in m8n8 blocks, k 64 in k4 steps; O: 64x64, k 128
    assert sum(c["mma"] for c in counters) == 8 * 16 * 16 + 8 * 8 * 32
    reads, writes = cuda_forward.analytic_global_bytes(1, 64, 128, 64, 64, np.float64, p.tile)
    assert sum(c["global_read_bytes"] for c in counters) == reads
    assert sum(c["global_write_bytes"] for c in counters) == writes


@pytest.mark.parametrize("Lq,Lk", [(200, 70), (70, 200), (129, 129)])
def test_f64_causal_skips_key_tiles(Lq, Lk):
    """Causal: key tiles above the diagonal (and query tiles that see no key) are never loaded; the
    emulator's bytes equal the analytic count for the DMMA tile (below the non-causal one when Lk <= Lq)."""
    q, k, v = make_inputs(np.float64, 64, Lq, Lk)
    full, causal = [], []
    run_forward("emulator", q, k, v, causal=False, counters=full)
    run_forward("emulator", q, k, v, causal=True, counters=causal)
    tile = cuda_forward_f64.forward_tile(None, np.float64, 64, 64, tiles.EMULATOR_ARCH)
    reads, writes = cuda_forward.analytic_global_bytes(2, Lq, Lk, 64, 64, np.float64, tile, causal=True)
    full_reads, _ = cuda_forward.analytic_global_bytes(2, Lq, Lk, 64, 64, np.float64, tile, causal=False)
    assert causal[0]["global_read_bytes"] == reads
    assert causal[0]["global_write_bytes"] == writes
    assert full[0]["global_read_bytes"] == full_reads
    if Lk <= Lq:  # some key tile is above the diagonal for the first query tile
        assert reads < full_reads


def aligned256(a):
    """A C-contiguous copy of ``a`` starting on a 256-byte boundary."""
    buf = np.empty(a.nbytes + 256, np.uint8)
    off = -buf.ctypes.data % 256
    out = buf[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


@pytest.mark.parametrize("D", [16, 40, 64, 128])
def test_f64_memory_efficiency(D):
    """Loads >= 0.9 of the ideal sectors, cp.async destinations conflict-free, and O and LSE stores
    whole sectors (the epilogue's quad exchange: 64-byte row segments per store instruction). Inputs
    256-byte aligned, as CuPy allocates (NumPy's 16-byte alignment would split rows across sectors)."""
    q, k, v = (aligned256(a) for a in make_inputs(np.float64, D, 128, 128, batch=(1, 1)))
    counters = []
    out, lse = cuda_forward.forward(q, k, v, causal=False, scale=0.125, batch_shape=(1, 1), device="emulator",
                                    counters=counters)
    (c,) = counters
    assert c.load_sector_efficiency >= 0.9 and c.cp_async_conflict_factor == 1
    assert c.buffers[3].write_sector_efficiency == 1.0  # O
    assert c.buffers[4].write_sector_efficiency == 1.0  # LSE


@pytest.mark.parametrize("schedule", ["reverse", "random"])
def test_f64_schedules_identical(schedule):
    """A missing barrier (a tile overwritten while another warp reads it) would change the result."""
    q, k, v = make_inputs(np.float64, 64, 77, 130)
    ref = run_forward("emulator", q, k, v, causal=True)
    got = run_forward("emulator", q, k, v, causal=True, schedule=schedule, seed=3)
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(a, b)


def max_errors(D, Lq, Lk, causal, seed=1):
    """Max |out − ref64| and |lse − ref64| (finite rows) of the DMMA and the SIMT kernels."""
    q, k, v = make_inputs(np.float64, D, Lq, Lk, seed=seed)
    ref_out, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    finite = np.isfinite(ref_lse)
    errs = {}
    for kernel in (None, "simt"):
        out, lse = run_forward("emulator", q, k, v, causal=causal, kernel=kernel)
        errs[kernel or "dmma"] = (np.abs(out - ref_out).max(), np.abs(lse[finite] - ref_lse[finite]).max())
    return errs, np.abs(ref_out).max()


@pytest.mark.parametrize("D,Lq,Lk,causal", [(64, 77, 130, False), (128, 65, 63, True)])
def test_f64_error_at_simt_fp64_level(D, Lq, Lk, causal):
    """The DMMA kernel's max error vs the float64 reference is at the SIMT fp64 kernel's level: within
    2x of it, with a floor of a few fp64 ulps of the output's magnitude (both are ~1e-16)."""
    errs, mag = max_errors(D, Lq, Lk, causal)
    ulp = np.finfo(np.float64).eps * max(1.0, mag)
    for i in (0, 1):
        assert errs["dmma"][i] <= 2 * max(errs["simt"][i], 4 * ulp), errs
    assert errs["dmma"][0] < 1e-14, errs


def test_unsupported_shapes_fall_back_to_simt():
    """Head dims above 128, sm_75, forced kernels and extensions run the SIMT kernel (also fp64)."""
    q, k, v = make_inputs(np.float64, 160, 17, 33, batch=(1, 1))
    assert f64_plan(q, k, v, False).tile.kernel == "simt"
    check(160, 17, 33, False)
    q, k, v = make_inputs(np.float64, 64, 17, 33, batch=(1, 1))
    assert f64_plan(q, k, v, False, arch=75).tile.kernel == "simt"
    check(64, 17, 33, True, arch=75)
    out = fa.flash_attention(q, k, v, backend="emulator", window=(4, 0))
    assert_attention_close(out, q, k, v, window=(4, 0))


def test_tile_table():
    """Every d, dv <= 128 has a tile on every sm_80+ arch within its shared memory; above 128, below
    sm_80, other dtypes and precisions none."""
    for arch in (80, 86, 89, 90):
        for d in range(1, 129, 7):
            t = cuda_forward_f64.forward_tile(None, np.float64, d, 128 - d // 2, arch)
            assert t.smem <= tiles.smem_limit(arch) and t.block_m == 64 and t.block_n in (8, 16, 32, 64)
            assert t.smem == cuda_forward_f64.smem_bytes(t.head_dim, t.head_dim_v, t.block_m, t.block_n)
        assert cuda_forward_f64.forward_tile(None, np.float64, 129, 64, arch) is None
        assert cuda_forward_f64.forward_tile(None, np.float32, 64, 64, arch) is None
        assert cuda_forward_f64.forward_tile("ieee", np.float64, 64, 64, arch).kernel == "f64"
    assert cuda_forward_f64.forward_tile(None, np.float64, 64, 64, 75) is None
    assert cuda_forward_f64.forward_tile(None, np.float64, 128, 128, 86).block_n == 8  # 99 KB per block


_PROBE = r"""
#include "flash_fwd_f64.cu"
template <int D, int DV, int BM, int BN, int NW>
__global__ void probe_f64(int* out) {
  if (threadIdx.x == 0) fa::gstore(out, flash::FwdF64Traits<D, DV, BM, BN, NW>::kSmemBytes);
}
"""


def test_python_smem_matches_traits():
    from flasharray import emulator
    from flasharray._private import launch
    entries = {}
    for d, dv, arch in ((16, 16, 80), (64, 64, 80), (128, 128, 80), (48, 112, 86), (128, 128, 86), (96, 32, 90)):
        t = cuda_forward_f64.forward_tile(None, np.float64, d, dv, arch)
        entries["probe_f64<%d, %d, %d, %d, %d>" % (t.head_dim, t.head_dim_v, t.block_m, t.block_n, t.threads_m)] = t.smem
    mod = emulator.Module(_PROBE, name_expressions=list(entries), include_dirs=[str(launch.cuda_src_dir())],
                          options=["-std=c++17"])
    for expr, smem in entries.items():
        out = np.zeros(1, np.int32)
        mod.launch(expr, (1,), (32,), (out,))
        assert int(out[0]) == smem, expr


def test_bc8_and_sm90_d128_tiles_run():
    """The Bc = 8 tile (d = 128 on sm_86/89) and sm_90's Bc = 16 tile at dv > 112 on the emulator."""
    check(128, 40, 50, True, arch=86)
    assert cuda_forward_f64.forward_tile(None, np.float64, 128, 128, 90).block_n == 16
    check(128, 40, 70, True, arch=90)
    check(120, 65, 33, False, Dv=128, arch=90, layout="bshd")


def test_sm90_tiles_take_m16n8k16():
    """sm_90 runs every product as mma.m16n8k16.f64 (DMMA.16x8x16): the tile says so and names kDmmaK = 16;
    sm_80/86/89 keep m8n8k4 (the shape does not exist there); DMMA_K16 = False gives m8n8k4 on sm_90 too."""
    for d, dv in ((16, 16), (64, 64), (128, 128), (96, 32), (40, 24)):
        t = cuda_forward_f64.forward_tile(None, np.float64, d, dv, 90)
        assert t.dmma_k == 16 and t.name_expression(True, True).endswith(", true, true, 16>"), t
        assert t.name_expression(True, False).endswith(", true, false>")   # element-wise copies: m8n8k4 (spills)
        assert "m16n8k16" in t.reason and "m16n8k16" in t.describe()
        for arch in (80, 86, 89):
            t = cuda_forward_f64.forward_tile(None, np.float64, d, dv, arch)
            assert t.dmma_k == 4 and t.name_expression(False, True).endswith(", false, true>"), t


@pytest.mark.parametrize("D,Dv,Lq,Lk,causal,layout", [
    (64, 64, 77, 130, False, "bhsd"),     # Bc 64
    (128, 128, 65, 70, True, "bhsd"),     # Bc 16, fully masked rows
    (40, 24, 33, 70, True, "bshd"),       # d != dv, odd lengths
    (16, 16, 1, 45, False, "bhsd"),       # Lq 1 (GQA-packed path off: no GQA here), d 16: one k16 step
])
def test_sm90_m16n8k16_gives_the_m8n8k4_bits(D, Dv, Lq, Lk, causal, layout):
    """The m16n8k16 kernel issues the m8n8k4 kernel's k4 steps in the same order (flash_f64_mma.cuh), so
    under the emulator's model of both (one fp64 FMA chain per element) its outputs are the same bits, with
    one mma per eight."""
    q, k, v = make_inputs(np.float64, D, Lq, Lk, Dv=Dv, layout=layout, seed=3)
    runs = {}
    for k16 in (True, False):
        with flag_set(cuda_forward_f64, "DMMA_K16", k16):
            assert f64_plan(q, k, v, causal, arch=90).tile.dmma_k == (16 if k16 else 4)
            counters = []
            out, lse = run_forward("emulator", q, k, v, causal=causal, arch=90, counters=counters)
        runs[k16] = out, lse, sum(c["mma"] for c in counters)
    np.testing.assert_array_equal(runs[True][0], runs[False][0])
    np.testing.assert_array_equal(runs[True][1], runs[False][1])
    assert runs[True][2] * 8 == runs[False][2] > 0
    assert_attention_close(runs[True][0], q, k, v, causal=causal, lse=runs[True][1])


def test_f64_benchmark_table():
    """benchmarks/precision.py --f64 (docs/precision.md's table) runs the DMMA and SIMT kernels."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "precision.py"
    spec = importlib.util.spec_from_file_location("precision_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    dmma, simt = bench.f64_errors(bench.F64_SHAPES[0]), bench.f64_errors(bench.F64_SHAPES[0], "simt")
    assert dmma[0] == "f64" and simt[0] == "simt" and dmma[1] < 1e-14 and simt[1] < 1e-14
    assert "| D 64, 77 x 130 |" in bench.f64_accuracy_table(bench.F64_SHAPES[:1])


_EXP_PROBE = r"""
#include "flash_f64_exp.cuh"
__global__ void probe_exp2(const double* x, double* y, int n) {
  FA_DYNAMIC_SMEM(smem);
  double* table = reinterpret_cast<double*>(smem);
  flash::exp2_table_fill(table, static_cast<int>(threadIdx.x));
  __syncthreads();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) fa::gstore(y + i, flash::exp2_nonpositive(fa::gload(x + i), table));
}
"""


def test_exp2_nonpositive_accuracy():
    """The softmax weights' 2^x (flash_f64_exp.cuh) on [−1022, 0] and up to the domain's end is within
    0.6 ulp of a long-double reference (measured 0.55; the host libm's exp2: 0.68; CUDA documents
    exp2(double) to 2 ulp; without the table's low parts it would be ~1 ulp); 2^0 = 1 exactly,
    x < −1022 and −inf give 0, NaN stays NaN, 2^1024 (the backward's clamp) is +inf."""
    from flasharray import emulator
    from flasharray._private import launch
    mod = emulator.Module(_EXP_PROBE, name_expressions=["probe_exp2"], include_dirs=[str(launch.cuda_src_dir())],
                          options=["-std=c++17"])
    rng = np.random.default_rng(0)
    special = np.array([1023.96, 1024.0, 0.0, -0.0, 1e-17, -1e-300, -0.5, -1.0, -1022.0, -1022.5, -1100.0,
                        -np.inf, np.nan])
    x = np.concatenate([-rng.uniform(0, 1022, 50000), -rng.uniform(0, 1, 20000), -rng.uniform(0, 1 / 16, 5000),
                        rng.uniform(0, 1023.96, 1000), special])
    y = np.empty_like(x)
    mod.launch("probe_exp2", (-(-x.size // 128),), (128,), (x, y, np.int32(x.size)),
               shared_mem=2 * 16 * 8)  # flash_f64_exp.cuh's kExp2TableBytes
    ok = (x >= -1022) & (x < 1024)
    ref = np.exp2(x[ok].astype(np.longdouble))
    ulps = np.abs(y[ok].astype(np.longdouble) - ref) / np.spacing(ref.astype(np.float64))
    assert ulps.max() <= 0.6, ulps.max()
    assert y[-11] == y[-10] == y[-9] == 1.0 and y[-6] == 0.5
    assert np.all(y[x < -1022] == 0) and np.isnan(y[-1])
    assert np.isfinite(y[-13]) and y[-12] == np.inf


# ---- exhaustive (slow) ---------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("D", [8, 16, 32, 40, 59, 64, 80, 96, 111, 128])
@pytest.mark.parametrize("lengths", [(1, 1), (17, 63), (63, 64), (64, 65), (127, 129), (129, 127), (257, 255)])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_f64_full(D, lengths, causal):
    check(D, lengths[0], lengths[1], causal, gqa=D % 2 == 1, layout="bshd" if D % 3 == 0 else "bhsd")


@pytest.mark.parametrize("D", [64, 128])
def test_cupy_launch_path_with_fake_cupy(monkeypatch, D):
    """device="cuda" (CupyLauncher: the device's sm_80, name expressions, the >48 KB opt-in) end to end
    against test_cuda_forward's CuPy stand-in backed by the emulator."""
    import sys
    from flasharray._private import launch
    from test_cuda_forward import _fake_cupy
    log, arrays = [], []
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(log, arrays))
    monkeypatch.setattr(launch.CupyLauncher, "_modules", {})
    monkeypatch.setattr(launch, "_launchers", {})
    q, k, v = make_inputs(np.float64, D, 70, 90, gqa=True)
    arrays += [q, k, v]
    out, lse = cuda_forward.forward(q, k, v, causal=True, scale=D ** -0.5, batch_shape=q.shape[:-2], device="cuda")
    assert_attention_close(out, q, k, v, causal=True, lse=lse)
    tile = cuda_forward_f64.forward_tile(None, np.float64, D, D, 80)
    assert tile.needs_opt_in
    assert log and all(name == tile.name_expression(True, True) and smem == tile.smem and optin >= smem
                       for name, smem, optin in log)
