"""CUDA forward kernels (flash_fwd.cu tensor cores, flash_fwd_simt.cu FMA) on the emulator and GPU.

Every case runs the real kernel source: on the CPU emulator (always), and on a GPU through CuPy
(tests marked ``gpu``, skipped without a device) with the same test bodies. Correctness uses the
DESIGN.md rule via ``flasharray.testing.assert_attention_close`` (out and lse).

Default run: a representative subset (awkward sizes, every dtype, causal, GQA broadcasting,
transposed views, > 3 batch dims, unaligned rows, the sm_75 tile table, schedules, counters).
``-m slow``: the full product dtype × D × (Lq, Lk) × causal × layout.
"""
import itertools

import numpy as np
import pytest

from flasharray._private import cuda_forward, cuda_forward_f64, launch, tiles
from flasharray._private.dtypes import bfloat16
from flasharray.testing import assert_attention_close

from conftest import flag_set, gpu_available, older_arch_ptx, thin

DTYPES = {"fp16": np.float16, "bf16": bfloat16, "fp32": np.float32, "fp64": np.float64}
HEAD_DIMS = [16, 32, 59, 64, 96, 128, 256]
LENGTHS = [(1, 1), (17, 63), (64, 64), (65, 127), (128, 257), (257, 128), (113, 203)]


# ---- shared bodies ---------------------------------------------------------------------------------

def make_inputs(dtype, D, Lq, Lk, *, Dv=None, layout="bhsd", gqa=False, seed=0, batch=(1, 2)):
    """q (*batch, Lq, D), k (*batch_k, Lk, D), v (*batch_k, Lk, Dv) as NumPy arrays.

    layout="bshd": views of (B, L, H, D)-contiguous arrays (row stride H·D, not contiguous).
    gqa=True: k and v have 1 head against q's heads (broadcast, stride 0 in the kernel).
    """
    rng = np.random.default_rng(seed)
    Dv = D if Dv is None else Dv
    B, H = batch
    Hk = 1 if gqa else H

    def one(h, L, d):
        if layout == "bshd":
            x = rng.standard_normal((B, L, h, d)).astype(dtype)
            return np.swapaxes(x, 1, 2)
        return rng.standard_normal((B, h, L, d)).astype(dtype)

    return one(H, Lq, D), one(Hk, Lk, D), one(Hk, Lk, Dv)


def run_forward(device, q, k, v, *, causal, scale=None, **opts):
    """Call cuda_forward.forward the way the public API does (batch dims already aligned). float32
    runs precision="ieee" here (the SIMT kernel this file tests; also the default) unless a test passes
    another: the TF32 kernels are tests/test_cuda_forward_tf32.py's."""
    if np.dtype(q.dtype) == np.float32:
        opts.setdefault("precision", "ieee")
    batch_shape = tuple(np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    if device == "cuda":
        import cupy
        q, k, v = (cupy.asarray(x) for x in (q, k, v))
    return cuda_forward.forward(q, k, v, causal=causal, scale=scale, batch_shape=batch_shape,
                                device=device, **opts)


def check_case(device, dtype, D, Lq, Lk, causal, *, Dv=None, layout="bhsd", gqa=False, seed=0, **opts):
    q, k, v = make_inputs(dtype, D, Lq, Lk, Dv=Dv, layout=layout, gqa=gqa, seed=seed)
    q0, k0, v0 = q.copy(), k.copy(), v.copy()
    out, lse = run_forward(device, q, k, v, causal=causal, **opts)
    if device == "cuda":
        out, lse = out.get(), lse.get()
    assert out.shape == q.shape[:-1] + (v.shape[-1],) and out.dtype == q.dtype
    assert lse.shape == q.shape[:-1]
    assert lse.dtype == (np.float64 if q.dtype == np.float64 else np.float32)
    assert_attention_close(out, q, k, v, causal=causal, lse=lse)
    # inputs never modified
    for a, b in ((q, q0), (k, k0), (v, v0)):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    return out, lse


# ---- the default (representative) subset -------------------------------------------------------------
# (dtype, D, Lq, Lk, causal, layout, gqa): each dtype sees small/odd/large head dims, unaligned
# D=59, causal with Lq > Lk (fully masked rows) and Lq < Lk, transposed views and GQA.
SUBSET = [
    ("fp16", 64, 65, 127, True, "bhsd", False),
    ("fp16", 59, 17, 63, False, "bshd", True),
    ("fp16", 128, 257, 128, True, "bhsd", False),
    ("fp16", 16, 1, 1, False, "bhsd", False),
    ("fp16", 256, 64, 64, False, "bhsd", True),
    ("bf16", 96, 113, 203, True, "bshd", False),
    ("bf16", 32, 64, 64, False, "bhsd", True),
    ("fp32", 64, 65, 127, True, "bhsd", True),
    ("fp32", 59, 113, 203, False, "bshd", False),
    ("fp32", 128, 17, 63, True, "bhsd", False),
    ("fp64", 32, 257, 128, True, "bhsd", False),
    ("fp64", 96, 17, 63, False, "bshd", True),
]


def _id(case):
    dt, D, Lq, Lk, causal, layout, gqa = case
    return "%s-d%d-%dx%d%s-%s%s" % (dt, D, Lq, Lk, "-causal" if causal else "", layout, "-gqa" if gqa else "")


@pytest.mark.parametrize("case", thin(SUBSET), ids=[_id(c) for c in SUBSET])
def test_forward_emulator(case):
    dt, D, Lq, Lk, causal, layout, gqa = case
    check_case("emulator", DTYPES[dt], D, Lq, Lk, causal, layout=layout, gqa=gqa)


@pytest.mark.parametrize("dt", ["fp16", "bf16", "fp32"])
def test_forward_dv_differs(dt):
    """Dv != D (both awkward): separate padded head dims for q·k and for v."""
    check_case("emulator", DTYPES[dt], 40, 33, 70, True, Dv=24)


def test_forward_simt_fallback_16bit():
    """fp16/bf16 on the SIMT kernel (what GPUs without the tensor-core instruction run)."""
    check_case("emulator", np.float16, 64, 65, 127, True, kernel="simt")
    check_case("emulator", bfloat16, 59, 17, 63, False, kernel="simt")


def test_forward_sm75_tiles():
    """The sm_75 table: fp16 D=256 on tensor cores with Bc=16; bf16 falls back to SIMT."""
    t = cuda_forward.kernel_for(np.float16, 256, arch=75)
    assert (t.kernel, t.block_n) == ("tensor_core", 16) and t.smem <= tiles.MAX_SMEM[75]
    assert cuda_forward.kernel_for(bfloat16, 64, arch=75).kernel == "simt"
    check_case("emulator", np.float16, 256, 33, 40, True, arch=75)
    check_case("emulator", bfloat16, 64, 33, 40, False, arch=75)


@pytest.mark.parametrize("block_m", [384, 512])
def test_forward_io_tiles(block_m):
    """The IO-oriented tensor-core tiles (8 warps x 3 or 4 slabs): correct, partial last block."""
    t = cuda_forward.kernel_for(np.float16, 64, block_m=block_m)
    assert (t.block_m, t.n_threads) == (block_m, 256)
    check_case("emulator", np.float16, 64, block_m + 77, 150, True, block_m=block_m)
    check_case("emulator", bfloat16, 48, 100, 90, False, block_m=block_m)


def test_forward_many_batch_dims():
    """Five batch dims that cannot all merge: the host loops over the outer ones."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 3, 2, 2, 2, 9, 32)).astype(np.float32)
    k = rng.standard_normal((2, 1, 2, 1, 2, 11, 32)).astype(np.float32)
    v = rng.standard_normal((1, 3, 2, 1, 2, 11, 32)).astype(np.float32)
    out, lse = run_forward("emulator", q, k, v, causal=False)
    assert_attention_close(out, q, k, v, causal=False, lse=lse)


@pytest.mark.parametrize("limit", [5, 3, 2])
def test_forward_grid_limit_splits_launches(monkeypatch, limit):
    """grid.y / grid.z are capped (65535 on a GPU): batches beyond it become host loops or chunks.
    The cap is shrunk here so small batches exercise every path (outer loop, chunked lone dim)."""
    from flasharray._private import launch
    monkeypatch.setattr(launch, "MAX_GRID_YZ", limit)
    rng = np.random.default_rng(11)
    q = rng.standard_normal((3, 4, 5, 16)).astype(np.float32)
    k = rng.standard_normal((3, 1, 7, 16)).astype(np.float32)
    v = rng.standard_normal((3, 1, 7, 16)).astype(np.float32)
    counters = []
    out, lse = run_forward("emulator", q, k, v, causal=True, counters=counters)
    assert len(counters) > 1
    assert_attention_close(out, q, k, v, causal=True, lse=lse)
    q2 = rng.standard_normal((13, 5, 16)).astype(np.float32)  # one merged dim of 13 > limit
    out2, lse2 = run_forward("emulator", q2, q2, q2, causal=False)
    assert_attention_close(out2, q2, q2, q2, causal=False, lse=lse2)


def test_forward_unaligned_and_sliced_rows():
    """D=59 packed (rows not 16-byte aligned: element loads) and D=59 sliced from D=64 rows
    (aligned rows: cp.async with a partial last chunk) give the same, correct result."""
    rng = np.random.default_rng(5)
    base = [rng.standard_normal((1, 2, L, 64)).astype(np.float16) for L in (40, 50, 50)]
    sliced = [x[..., :59] for x in base]
    packed = [np.ascontiguousarray(x) for x in sliced]
    assert cuda_forward._is_aligned(sliced) and not cuda_forward._is_aligned(packed)
    o1, l1 = run_forward("emulator", *sliced, causal=True)
    o2, l2 = run_forward("emulator", *packed, causal=True)
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(l1, l2)
    assert_attention_close(o1, *packed, causal=True, lse=l1)


def test_forward_fully_masked_rows():
    """Causal with Lq > Lk: the first Lq − Lk rows see no key: out = 0, lse = -inf."""
    for dt in (np.float16, np.float32):
        out, lse = check_case("emulator", dt, 32, 40, 7, True)
        assert np.all(out[..., :33, :] == 0) and np.all(np.isneginf(lse[..., :33]))
        assert np.all(np.isfinite(lse[..., 33:]))


@pytest.mark.parametrize("dt,D,arch", [("fp16", 64, 80), ("fp16", 128, 75), ("fp32", 64, 80)],
                         ids=["tc-2stage", "tc-1stage-sm75", "simt"])
def test_forward_schedules_identical(dt, D, arch):
    """Reverse and random fiber schedules give bit-identical results (no missing barrier), for the
    double-buffered and the single-buffered tensor-core pipelines and the SIMT kernel."""
    q, k, v = make_inputs(DTYPES[dt], D, 70, 90, gqa=True)
    stages = cuda_forward.kernel_for(DTYPES[dt], D, D, arch).stages
    assert stages == (2 if (dt, arch) == ("fp16", 80) else 1)
    ref = run_forward("emulator", q, k, v, causal=True, arch=arch)
    for schedule, seed in (("reverse", 0), ("random", 1), ("random", 7)):
        got = run_forward("emulator", q, k, v, causal=True, arch=arch, schedule=schedule, seed=seed)
        np.testing.assert_array_equal(got[0], ref[0])
        np.testing.assert_array_equal(got[1], ref[1])


@pytest.mark.parametrize("dt,D,Lq,Lk", [("fp16", 64, 130, 200), ("bf16", 128, 64, 65), ("fp16", 128, 130, 200),
                                       ("fp32", 59, 70, 33), ("fp64", 32, 33, 100)])
def test_forward_counters_match_analytic(dt, D, Lq, Lk):
    """Emulator byte counters of a non-causal forward equal the tiling's analytic count:
    Q once, K and V once per query block, O and LSE written once."""
    dtype = DTYPES[dt]
    q, k, v = make_inputs(dtype, D, Lq, Lk)
    counters = []
    run_forward("emulator", q, k, v, causal=False, counters=counters)
    # float64 runs the DMMA kernel on the emulator's sm_80 (cuda_forward_f64), fp16 D 128 over 64 rows the
    # wide-row tile (K and V read once per 128 query rows), the others the table's
    table = cuda_forward.kernel_for(dtype, D, D, tiles.EMULATOR_ARCH)
    tile = cuda_forward_f64.forward_tile(None, dtype, D, D, tiles.EMULATOR_ARCH) or cuda_forward.kernel_for(
        dtype, D, D, tiles.EMULATOR_ARCH, wide=cuda_forward.wide_rows(table, False, True, Lq, None))
    if (dt, D, Lq) == ("fp16", 128, 130):
        assert (tile.block_m, tile.block_n, tile.stages) == (128, 64, 1)
    reads, writes = cuda_forward.analytic_global_bytes(2, Lq, Lk, D, D, dtype, tile)
    assert sum(c["global_read_bytes"] for c in counters) == reads
    assert sum(c["global_write_bytes"] for c in counters) == writes


# ---- the wide-row tiles (tiles.WIDE_ROWS: Br = 128; at 64 < d <= 128 Bc = 64 where two blocks fit) ------

def _plan(q, k, v, causal, **opts):
    return cuda_forward.plan(q, k, v, causal=causal, scale=q.shape[-1] ** -0.5, batch_shape=q.shape[:-2],
                             device="emulator", **opts)


@pytest.mark.parametrize("dt,D,Dv,Lq,Lk,layout,gqa", [("fp16", 128, 128, 257, 128, "bhsd", False),
                                                     ("bf16", 96, 128, 130, 203, "bshd", True),
                                                     ("fp16", 80, 48, 65, 33, "bhsd", False),
                                                     ("bf16", 256, 256, 130, 100, "bhsd", True),
                                                     ("fp16", 200, 136, 97, 70, "bshd", False)])
def test_forward_wide_row_tile(dt, D, Dv, Lq, Lk, layout, gqa):
    """Non-causal, aligned, > 64 query rows: the plan takes a 128-row tile (64 < d <= 128 on the emulator's sm_80:
    FlashAttention-2's 128 x 64, 4 warps x 2 slabs, single-buffered K/V, where d >= dv, else 128 x 32; 128 < d <=
    256: FlashAttention-2's 128 x 64, 8 warps x 1 slab, single-buffered, tiles.WIDE_BC64_LARGE) and meets the rule;
    reverse / random schedules give its bits (no missing barrier)."""
    q, k, v = make_inputs(DTYPES[dt], D, Lq, Lk, Dv=Dv, layout=layout, gqa=gqa)
    t = _plan(q, k, v, False).tile
    want = ((128, 64, 4, 1) if max(D, Dv) <= 128 and D >= Dv else (128, 32, 4, 2) if max(D, Dv) <= 128
            else (128, 64, 8, 1))
    assert (t.kernel, t.block_m, t.block_n, t.threads_m, t.stages) == ("tensor_core",) + want
    ref = check_case("emulator", DTYPES[dt], D, Lq, Lk, False, Dv=Dv, layout=layout, gqa=gqa)
    for schedule, seed in (("reverse", 0), ("random", 3)):
        got = run_forward("emulator", q, k, v, causal=False, schedule=schedule, seed=seed)
        np.testing.assert_array_equal(got[0], ref[0])
        np.testing.assert_array_equal(got[1], ref[1])


@pytest.mark.parametrize("order", ["grows", "first", "random"])
@pytest.mark.parametrize("dtype,D,Lq,causal", [(np.float16, 128, 130, False), (np.float16, 64, 70, True),
                                               (np.float64, 64, 70, False)])
def test_forward_rescale_only_when_a_max_moves(order, dtype, D, Lq, causal):
    """O_i is rescaled only when some row of the warp gets a new max (flash_fwd.cu softmax_step; a factor
    of exactly 1 elsewhere): keys whose scores grow in the visiting order (last key tile first: every tile
    moves every row's max), keys whose largest scores lie in the first visited tile (no later tile moves
    any), and random keys (some warps, some tiles) all meet the rule, with the same bits under the
    reverse and random schedules (fp16: the mma.sync kernel; fp64: the DMMA one)."""
    rng = np.random.default_rng(7)
    Lk = 300
    u = rng.standard_normal(D).astype(np.float32)
    q = (np.abs(rng.standard_normal((1, 2, Lq, 1))) * u + 0.1 * rng.standard_normal((1, 2, Lq, D))).astype(dtype)
    j = np.arange(Lk, dtype=np.float32)[:, None]
    growth = {"grows": 1.0 + 2.0 * (Lk - 1 - j) / Lk, "first": 1.0 + 2.0 * j / Lk, "random": None}[order]
    k = rng.standard_normal((1, 2, Lk, D)).astype(np.float32)
    if growth is not None:
        k = growth * u / np.sqrt(D) * 4.0 + 0.05 * k
    k = k.astype(dtype)
    v = rng.standard_normal((1, 2, Lk, D)).astype(dtype)
    out, lse = run_forward("emulator", q, k, v, causal=causal)
    assert_attention_close(out, q, k, v, causal=causal, lse=lse)
    for schedule, seed in (("reverse", 0), ("random", 5)):
        got = run_forward("emulator", q, k, v, causal=causal, schedule=schedule, seed=seed)
        np.testing.assert_array_equal(got[0], out)
        np.testing.assert_array_equal(got[1], lse)


@pytest.mark.parametrize("dt,D,Lq,Lk,batch,arch", [("fp16", 128, 257, 300, (1, 2), 80), ("bf16", 256, 130, 100, (1, 2), 80),
                                                  ("fp16", 112, 40, 100, (1, 2, 4), 80),
                                                  ("bf16", 128, 40, 100, (1, 2, 4), 86), ("fp16", 120, 150, 70, (1, 2), 89)])
def test_forward_wide_row_tile_causal_sm80(dt, D, Lq, Lk, batch, arch):
    """Causal on sm_80 (tiles.WIDE_CAUSAL_ARCHS) and on sm_86/89 at padded d 128 (tiles.causal_takes_wide: two blocks of
    the swizzled single-buffered 128 x 32 tile per SM where the square tile runs one): the wide tiles, also with Lq > Lk
    (rows that see no key) and GQA-packed (4 query heads x 40 rows = 160 packed rows: the Is_packed variant); reverse
    schedule bits."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal(batch + (Lq, D)).astype(DTYPES[dt])
    k, v = (rng.standard_normal(batch[:2] + (1,) * (len(batch) - 2) + (Lk, D)).astype(DTYPES[dt]) for _ in "kv")
    t = _plan(q, k, v, True, arch=arch).tile  # 128 x 32: sm_86 / 89, GQA-packed or split (Lq 257, 2 heads); d 256: 128 x 64
    assert (t.block_m, t.block_n, t.threads_m) == ((128, 32, 4) if D <= 128 else (128, 64, 8))
    assert t.stages == (2 if arch == 80 and D <= 128 else 1)
    out, lse = run_forward("emulator", q, k, v, causal=True, arch=arch)
    assert_attention_close(out, q, k, v, causal=True, lse=lse)
    got = run_forward("emulator", q, k, v, causal=True, arch=arch, schedule="reverse")
    np.testing.assert_array_equal(got[0], out)
    np.testing.assert_array_equal(got[1], lse)
    if len(batch) > 2:
        p = _plan(q, k, v, True, arch=arch)
        assert p.gqa_group == 4 and p.launches[0].name.endswith("true, true, false, true>")  # Is_packed


@pytest.mark.parametrize("dt,D,Lq,Lk,layout,arch", [("fp16", 128, 257, 300, "bhsd", 80), ("bf16", 96, 300, 200, "bhsd", 90),
                                                   ("fp16", 120, 130, 330, "bshd", 80)])
def test_forward_wide_bc64_causal(dt, D, Lq, Lk, layout, arch):
    """Causal calls on sm_80 / sm_90 with d = dv run FlashAttention-2's 128 x 64 single-buffered tile
    (tiles.WIDE_BC64_CAUSAL) in the plain instantiation: Lq > Lk (rows that see no key) and Lq < Lk (the
    diagonal inside a key tile), the rule, and the same bits under reverse and random schedules. A split-KV,
    GQA-packed or key-lengths call, d != dv, or the switch off keep the 128 x 32 tile (whose variants compile
    without spills)."""
    kern = dict(kernel="tensor_core") if arch == 90 else {}
    q, k, v = make_inputs(DTYPES[dt], D, Lq, Lk, layout=layout)
    p = _plan(q, k, v, True, arch=arch, num_splits=1, **kern)
    assert (p.tile.block_m, p.tile.block_n, p.tile.stages, p.tile.threads_m) == (128, 64, 1, 4)
    out, lse = run_forward("emulator", q, k, v, causal=True, arch=arch, num_splits=1, **kern)
    assert_attention_close(out, q, k, v, causal=True, lse=lse)
    for schedule, seed in (("reverse", 0), ("random", 2)):
        got = run_forward("emulator", q, k, v, causal=True, arch=arch, num_splits=1, schedule=schedule, seed=seed,
                          **kern)
        np.testing.assert_array_equal(got[0], out)
        np.testing.assert_array_equal(got[1], lse)
    # where 128 x 32 stays: an automatic split (3 query tiles x 2 heads on 108 / 132 SMs, Lk >= 300), a forced one
    auto = _plan(q, k, v, True, arch=arch, **kern)
    assert (auto.num_splits > 1) == (Lk >= 300) and auto.tile.block_n == (32 if Lk >= 300 else 64)
    t = _plan(q, k, v, True, arch=arch, num_splits=2, **kern).tile
    assert (t.block_m, t.block_n) == (128, 32)
    with flag_set(tiles, "WIDE_BC64_CAUSAL", False):
        assert _plan(q, k, v, True, arch=arch, num_splits=1, **kern).tile.block_n == 32
    qg, kg, vg = make_inputs(DTYPES[dt], D, 40, Lk, gqa=True, batch=(1, 4))   # GQA-packed: 160 rows, Is_packed
    pg = _plan(qg, kg, vg, True, arch=arch, num_splits=1, **kern)
    assert pg.gqa_group == 4 and (pg.tile.block_m, pg.tile.block_n) == (128, 32)
    qv, kv_, vv = make_inputs(DTYPES[dt], D, Lq, Lk, Dv=64)                    # d > dv
    assert _plan(qv, kv_, vv, True, arch=arch, num_splits=1, **kern).tile.block_n == 32
    assert _plan(qv, kv_, vv, False, arch=arch, num_splits=1, **kern).tile.block_n == 64   # non-causal: d >= dv


def _causal_groups_arg(plan):
    """The ``causal_groups`` argument of a plan's flash_fwd_kernel launch (after scale_log2 and rows_per_group)."""
    (rec,) = [r for r in plan.launches if r.name.startswith("flash::flash_fwd_kernel<")]
    return int(rec.template[31])


@pytest.mark.parametrize("dt,D,Lq,Lk,batch,groups,arch", [
    ("fp16", 64, 200, 200, (3, 3), 2, 80),     # 9 entries in groups of 5 and 4, 4 query tiles of 64 rows
    ("bf16", 128, 300, 200, (1, 5), 3, 90),    # Lq > Lk: tiles with no visible key; groups of 2, 2, 1
    ("fp16", 96, 130, 330, (2, 2), 4, 80),     # one entry per group
])
def test_forward_causal_groups(dt, D, Lq, Lk, batch, groups, arch):
    """Causal dense calls on the mma.sync kernel walk the grouped longest-first grid order (grid_tile with
    causal_groups > 0; host mirror tiles.grid_tile_order): the bits of the entry-by-entry order (CAUSAL_GROUPS
    off) under reverse and random schedules, for group counts that split the entries unevenly; the launch carries
    tiles.causal_groups' count (here forced), 0 with the switch off, non-causal or split calls."""
    kern = dict(kernel="tensor_core", num_splits=1) if arch == 90 else dict(num_splits=1)
    q, k, v = make_inputs(DTYPES[dt], D, Lq, Lk, batch=batch)
    with flag_set(tiles, "CAUSAL_GROUPS", False):
        base = run_forward("emulator", q, k, v, causal=True, arch=arch, **kern)
        assert _causal_groups_arg(_plan(q, k, v, True, arch=arch, **kern)) == 0
    assert_attention_close(base[0], q, k, v, causal=True, lse=base[1])
    with flag_set(tiles, "causal_groups", lambda *a: groups):
        assert _causal_groups_arg(_plan(q, k, v, True, arch=arch, **kern)) == groups
        assert _causal_groups_arg(_plan(q, k, v, False, arch=arch, **kern)) == 0
        assert _causal_groups_arg(_plan(q, k, v, True, arch=arch, **dict(kern, num_splits=2))) == 0
        for schedule, seed in (("reverse", 0), ("random", 3)):
            got = run_forward("emulator", q, k, v, causal=True, arch=arch, schedule=schedule, seed=seed, **kern)
            np.testing.assert_array_equal(got[0], base[0])
            np.testing.assert_array_equal(got[1], base[1])


def test_causal_groups_rule_and_order():
    """tiles.causal_groups: entries // max(the entries whose K / V fit CAUSAL_GROUP_BYTES, 2·slots / n_m); 0 for one
    query tile or the switch off. grid_tile_order: every (query tile, entry) once; within a group the query tiles
    from the last down, entries inner; under a list-scheduling model the busiest of 132 slots stays within 1.5 % of
    the mean at (B, 16, 4096, 128) where entry by entry is 7 % above."""
    import heapq
    mb = 1 << 20
    assert tiles.causal_groups(32, 64, 4096, 128, 128, 2, 132) == 64 // max(20 * mb // (2 * mb), -(-264 // 32))
    assert tiles.causal_groups(1, 64, 128, 128, 128, 2, 132) == 0
    assert tiles.causal_groups(8, 4, 1024, 64, 64, 2, 264) == 1       # few entries: one group, longest first
    with flag_set(tiles, "CAUSAL_GROUPS", False):
        assert tiles.causal_groups(32, 64, 4096, 128, 128, 2, 132) == 0
    for n_m, entries, groups in ((4, 9, 2), (3, 5, 3), (7, 16, 5), (5, 3, 7), (6, 4, 0)):
        order = tiles.grid_tile_order(n_m, entries, groups)
        assert sorted(order) == [(m, e) for m in range(n_m) for e in range(entries)]
    assert tiles.grid_tile_order(3, 5, 2)[:6] == [(2, 0), (2, 1), (2, 2), (1, 0), (1, 1), (1, 2)]

    def busiest(order):
        slots = [0.0] * 132
        for m, _ in order:
            heapq.heapreplace(slots, slots[0] + m + 2)
        return max(slots) / (sum(slots) / 132)
    n_m, entries = 32, 64
    grouped = tiles.grid_tile_order(n_m, entries, tiles.causal_groups(n_m, entries, 4096, 128, 128, 2, 132))
    assert busiest(grouped) < 1.015 and busiest(tiles.grid_tile_order(n_m, entries, 0)) > 1.06


def test_forward_two_blocks_per_sm_at_small_head_dims():
    """d <= 128 (tiles.TWO_BLOCKS_MAX_HEAD_DIM): a single-buffered tile where that lets two blocks share an SM and
    the double-buffered one does not (sm_86/89 d <= 112, the wide 128 x 32 tile too; sm_80 d 128's square tile);
    sm_90 (two fit anyway) and sm_75 (neither does) keep theirs, as do extensions. The sm_86 d 64, sm_86 d 96 (wide)
    and sm_80 d 128 kernels meet the rule and give the same bits under a reverse or random schedule."""
    for arch, stages in ((75, 2), (80, 2), (86, 1), (89, 1), (90, 2)):
        t = tiles.forward_tile("float16", 64, 64, arch)
        assert (t.block_m, t.block_n, t.stages) == (128, 64, stages), arch
    assert tiles.forward_tile("float16", 32, 32, 86).stages == 2           # 30 KB: two fit double-buffered
    for arch, d, stages in ((80, 128, 1), (80, 112, 2), (86, 96, 1), (86, 128, 2), (90, 128, 2), (75, 80, 2)):
        t = tiles.forward_tile("float16", d, d, arch)                      # the square tile up to d 128
        assert (t.block_m, t.block_n, t.stages) == (64, 64, stages), (arch, d)
    t = tiles.forward_tile("float16", 128, 128, 80, wide=True)        # the wide tile: two single-buffered fit
    assert (t.block_n, t.stages) == (64, 1)
    t = tiles.forward_tile("float16", 128, 128, 86, wide=True)        # sm_86: one does; 128 x 32 with sQ swizzled
    assert (t.block_n, t.stages, t.smem) == (32, 1, 50176)
    for arch, d, dv in ((86, 96, 96), (89, 112, 112), (86, 128, 64)):  # two single-buffered 128 x 32 blocks fit
        t = tiles.forward_tile("float16", d, dv, arch, wide=True)
        assert (t.block_m, t.block_n, t.stages) == (128, 32, 1), (arch, d, dv)
    t = tiles.forward_tile("float16", 96, 96, 80, wide=True, causal=True, plain=False)  # a causal variant: 128 x 32,
    assert (t.block_n, t.stages) == (32, 2)                                                # sm_80: two fit anyway
    assert tiles.forward_tile("float16", 128, 128, 80, two_blocks=False).stages == 2  # paged caches
    assert tiles.forward_tile("float16", 64, 64, 86, ext=True).stages == 2  # the extensions' 64 x 64 tile
    q, k, v = make_inputs(np.float16, 64, 150, 200, gqa=True)
    assert _plan(q, k, v, True, arch=86).tile.stages == 1
    out, lse = run_forward("emulator", q, k, v, causal=True, arch=86)
    assert_attention_close(out, q, k, v, causal=True, lse=lse)
    got = run_forward("emulator", q, k, v, causal=True, arch=86, schedule="reverse")
    np.testing.assert_array_equal(got[0], out)
    np.testing.assert_array_equal(got[1], lse)
    q, k, v = make_inputs(np.float16, 96, 150, 200, layout="bshd")      # sm_86 d 96: the 128 x 32 wide tile
    assert (_plan(q, k, v, False, arch=86).tile.block_m, _plan(q, k, v, False, arch=86).tile.stages) == (128, 1)
    out, lse = run_forward("emulator", q, k, v, causal=False, arch=86)
    assert_attention_close(out, q, k, v, causal=False, lse=lse)
    got = run_forward("emulator", q, k, v, causal=False, arch=86, schedule="random", seed=2)
    np.testing.assert_array_equal(got[0], out)
    np.testing.assert_array_equal(got[1], lse)
    q, k, v = make_inputs(np.float16, 128, 40, 200)                      # 40 rows: not the wide tile
    assert _plan(q, k, v, False).tile.stages == 1
    out, lse = run_forward("emulator", q, k, v, causal=False)
    assert_attention_close(out, q, k, v, causal=False, lse=lse)
    got = run_forward("emulator", q, k, v, causal=False, schedule="reverse")
    np.testing.assert_array_equal(got[0], out)


@pytest.mark.parametrize("D,Dv,Lq,Lk,gqa", [(128, 128, 150, 200, False), (120, 64, 257, 70, True)])
def test_forward_swizzled_q_tile(D, Dv, Lq, Lk, gqa):
    """sm_86/89's wide tile at padded d 128 (tiles.swizzled_q, FwdTensorCoreTraits::kSwizzleQ): 128 x 32
    single-buffered with sQ unpadded and XOR-swizzled, 50 KB at d = dv = 128, so two blocks share the 100 KB SM.
    It meets the rule (D 120: the partial chunk of every row zero-filled through the swizzle; Lq tails), gives the
    same bits under reverse / random schedules, and every ldmatrix and cp.async is conflict-free (shared-memory
    wavefronts = the ideal; on the padded layout too)."""
    q, k, v = make_inputs(np.float16, D, Lq, Lk, Dv=Dv, gqa=gqa)
    t = _plan(q, k, v, False, arch=86).tile
    assert (t.block_m, t.block_n, t.stages) == (128, 32, 1) and tiles.swizzled_q(t.head_dim, 128, 32, 1)
    assert tiles._two_blocks_fit(t.smem, 86) and not tiles._two_blocks_fit(tiles.tc_smem(128, 128, 128, 32, 2), 86)
    assert tiles.tc_smem(128, 128, 128, 32, 1) == 50176            # 51 KB padded: two would need 104 KB
    counters = []
    out, lse = run_forward("emulator", q, k, v, causal=False, arch=86, counters=counters)
    assert_attention_close(out, q, k, v, causal=False, lse=lse)
    for c in counters:
        assert c.ldmatrix_wavefronts == c.ldmatrix_wavefronts_ideal > 0, c.ldmatrix_conflict_factor
        if D % 64 == 0:  # (D 120: the zero-filled last chunk of a row counts above the ideal, swizzled or not)
            assert c.cp_async_smem_wavefronts == c.cp_async_smem_wavefronts_ideal > 0
    for schedule, seed in (("reverse", 0), ("random", 4)):
        got = run_forward("emulator", q, k, v, causal=False, arch=86, schedule=schedule, seed=seed)
        np.testing.assert_array_equal(got[0], out)
        np.testing.assert_array_equal(got[1], lse)


def test_forward_wide_row_tile_where_it_applies():
    """Causal (but on sm_80 / sm_90 and where tiles.causal_takes_wide), unaligned rows, <= 64 query rows, extensions,
    d <= 64, sm_75 and WIDE_ROWS = False keep the table's tile (sm_90: the mma.sync forward, ``kernel="tensor_core"``)."""
    from flasharray._private.extensions import Extensions
    q, k, v = make_inputs(np.float16, 128, 200, 200)
    assert _plan(q, k, v, False).tile.block_m == 128
    assert _plan(q, k, v, True, arch=90, kernel="tensor_core").tile.block_m == 128  # causal (measured on an H200)
    assert _plan(q, k, v, True, arch=89).tile.block_m == 128             # sm_89 d 128: two wide blocks, one square
    assert _plan(q, k, v, True, arch=86).tile.block_m == 128              # sm_86 d 128: two wide blocks, one square
    q96, k96, v96 = make_inputs(np.float16, 96, 200, 200)
    assert _plan(q96, k96, v96, True, arch=86).tile.block_m == 64        # d 96: two square blocks fit already
    assert not tiles.causal_takes_wide("float16", 96, 96, 86) and tiles.causal_takes_wide("float16", 128, 128, 89)
    assert _plan(q, k, v, True).tile.block_m == 128                      # causal on sm_80: 2 blocks per SM
    assert _plan(q[..., :64, :], k, v, False).tile.block_m == 64         # 64 rows
    assert _plan(q, k, v, False, arch=75).tile.block_n == 64             # sm_75: not taken
    ext = Extensions(window=(50, 50))
    assert _plan(q, k, v, False, ext=ext).tile.block_m == 64             # extensions
    q59, k59, v59 = make_inputs(np.float16, 59, 200, 200)
    assert _plan(q59, k59, v59, False).tile.block_m == 128               # d <= 64: the table's 128 x 64
    assert _plan(q59, k59, v59, False).tile.block_n == 64
    qu, ku, vu = make_inputs(np.float16, 120, 200, 200)                  # 240-byte rows: aligned
    assert _plan(qu, ku, vu, False).tile.block_m == 128
    qo, ko, vo = make_inputs(np.float16, 100, 200, 200)                  # 200-byte rows: not aligned
    assert _plan(qo, ko, vo, False).tile.block_m == 64
    q2, k2, v2 = make_inputs(np.float16, 256, 200, 200)
    assert _plan(q2, k2, v2, False).tile.threads_m == 8                 # d 256: the 8-warp tile
    assert _plan(q2, k2, v2, False, arch=86).tile.block_m == 64          # 132 KB: not on sm_86 / 89
    assert _plan(q2, k2, v2, True, arch=90, kernel="tensor_core").tile.block_m == 64  # causal on sm_90: d <= 128
    assert _plan(q2, k2, v2, True).tile.threads_m == 8                  # causal on sm_80
    assert _plan(q2, k2, v2, True, arch=86).tile.block_m == 64          # causal on sm_86 (one block either way)
    with flag_set(tiles, "WIDE_CAUSAL_ARCHS", {80: 256}):
        assert _plan(q, k, v, True, arch=90, kernel="tensor_core").tile.block_m == 64
    with flag_set(tiles, "WIDE_ROWS", False):
        assert _plan(q, k, v, False).tile.block_m == 64


@pytest.mark.parametrize("dt,Lq,Lk", [("fp16", 256, 256), ("fp16", 300, 40), ("fp32", 40, 300),
                                       ("bf16", 333, 129)])
def test_forward_causal_skips_blocks(dt, Lq, Lk):
    """Causal reads fewer bytes: key tiles above the diagonal and query tiles that see no key
    (Lq > Lk) are never loaded; the count equals the analytic one."""
    dtype = DTYPES[dt]
    q, k, v = make_inputs(dtype, 64, Lq, Lk)
    full, causal = [], []
    run_forward("emulator", q, k, v, causal=False, counters=full)
    run_forward("emulator", q, k, v, causal=True, counters=causal)
    tile = cuda_forward.kernel_for(dtype, 64, 64, tiles.EMULATOR_ARCH)
    reads, writes = cuda_forward.analytic_global_bytes(2, Lq, Lk, 64, 64, dtype, tile, causal=True)
    full_reads, _ = cuda_forward.analytic_global_bytes(2, Lq, Lk, 64, 64, dtype, tile, causal=False)
    assert causal[0]["global_read_bytes"] == reads
    assert causal[0]["global_write_bytes"] == writes
    assert full[0]["global_read_bytes"] == full_reads
    if Lk <= Lq:  # some key tile is above the diagonal for the first query tile
        assert reads < full_reads


def test_forward_tensor_cores_used():
    """fp16 runs the mma kernel (mma and ldmatrix counted), fp32 the SIMT one (none)."""
    for dt, expect_mma in ((np.float16, True), (np.float32, False)):
        q, k, v = make_inputs(dt, 32, 20, 20)
        c = []
        run_forward("emulator", q, k, v, causal=False, counters=c)
        assert (c[0]["mma"] > 0) == expect_mma and (c[0]["ldmatrix"] > 0) == expect_mma


def _fake_cupy(log, arrays):
    """A stand-in for the parts of CuPy the CUDA launch path touches, backed by the emulator.

    RawModule / get_function / RawKernel.max_dynamic_shared_size_bytes / RawKernel.kernel.ptr /
    kernel(grid, block, args, shared_mem=...) / cuda.driver.launchKernel / cuda.get_current_stream /
    cuda.runtime.memGetInfo follow CuPy's documented API; a launch asking for more than 48 KB of
    dynamic shared memory without the opt-in fails, as cuLaunchKernel would, and so does a driver
    launch on a thread that made no runtime call first (no current context). Arrays stay NumPy.
    Array arguments arrive as device addresses (``numpy.uint64``, what the launcher passes for a
    ``T*``; in a kernel-parameter block, 8 bytes); the stand-in maps each back to the memory of the
    array that holds it (``arrays``: the inputs, plus everything ``cupy.empty`` allocates) so the
    emulator can check the accesses. ``launchKernel`` reads each argument from the ``kernelParams``
    array by the kernel's parameter types (the emulator's signature): bytes the library packed
    wrongly reach the emulator as wrong values, or fail its checks.
    """
    import ctypes
    import threading
    import types
    from flasharray import emulator
    from flasharray._private.launch import flat_view

    def buffer_at(addr):
        for a in arrays:
            span = flat_view(a)
            base = span.ctypes.data
            if base <= addr < base + span.nbytes:
                assert (addr - base) % a.itemsize == 0
                return span[(addr - base) // a.itemsize:]
        raise AssertionError("pointer argument 0x%x is in no array the caller owns" % addr)

    def empty(*a, **kw):
        arrays.append(np.empty(*a, **kw))
        return arrays[-1]

    functions, ready, driver_launches = {}, threading.local(), []

    class RawKernel:
        def __init__(self, module, name):
            self._module, self._name = module, name
            self.max_dynamic_shared_size_bytes = 48 * 1024
            self.kernel = types.SimpleNamespace(ptr=0x1000 + len(functions))
            functions[self.kernel.ptr] = self

        def __call__(self, grid, block, args, shared_mem=0):
            assert isinstance(grid, tuple) and isinstance(block, tuple) and isinstance(args, tuple)
            self._run(grid, block, tuple(buffer_at(int(x)) if isinstance(x, np.uint64) else x for x in args),
                      shared_mem)

        def _run(self, grid, block, args, shared_mem):
            if shared_mem > self.max_dynamic_shared_size_bytes:
                raise RuntimeError("CUDA_ERROR_INVALID_VALUE: %d bytes of dynamic shared memory without "
                                   "the opt-in" % shared_mem)
            log.append((self._name, shared_mem, self.max_dynamic_shared_size_bytes))
            self._module.launch(self._name, grid, block, args, shared_mem=shared_mem)

    def read_argument(address, code):
        if code.startswith("*"):
            return buffer_at(ctypes.c_uint64.from_address(address).value)
        dtype = {c: n for n, c in emulator._DTYPE_CODES.items()}[code]
        return np.frombuffer(ctypes.string_at(address, np.dtype(dtype).itemsize), dtype)[0]

    def launch_kernel(f, gx, gy, gz, bx, by, bz, shared_mem, stream, kernel_params, extra):
        assert extra == 0 and stream == 0 and isinstance(kernel_params, int)
        if not getattr(ready, "context", False):
            raise RuntimeError("CUDA_ERROR_INVALID_CONTEXT: no current context on this thread")
        fn = functions[f]
        driver_launches.append(fn._name)
        sig = fn._module._sigs[fn._name]
        argv = (ctypes.c_uint64 * len(sig)).from_address(kernel_params)
        fn._run((gx, gy, gz), (bx, by, bz), tuple(read_argument(argv[i], c) for i, c in enumerate(sig)), shared_mem)

    class RawModule:
        def __init__(self, code=None, options=(), name_expressions=None):
            assert "-std=c++17" in options and any(o.startswith("-DFLASHARRAY_SOURCE_DIGEST=") for o in options)
            incs = [o[2:] for o in options if o.startswith("-I")]
            self._mod = emulator.Module(code, name_expressions=list(name_expressions), include_dirs=incs,
                                        options=["-std=c++17"])

        def get_function(self, name):
            return RawKernel(self._mod, name)

    class Device:
        id = 0
        compute_capability = "80"
        attributes = {"MultiProcessorCount": 108}

        def __init__(self, device_id=None):
            assert device_id in (None, 0)

    def mem_get_info():
        ready.context = True
        return 0, 0

    cupy = types.ModuleType("cupy")
    cupy.RawModule = RawModule
    cupy.cuda = types.SimpleNamespace(
        Device=Device, runtime=types.SimpleNamespace(getDevice=lambda: 0, memGetInfo=mem_get_info),
        driver=types.SimpleNamespace(launchKernel=launch_kernel),
        get_current_stream=lambda: types.SimpleNamespace(ptr=0))
    cupy.empty, cupy.lib = empty, np.lib
    cupy.ascontiguousarray = lambda a: empty(a.shape, a.dtype).__setitem__(Ellipsis, a) or arrays[-1]
    cupy.driver_launches = driver_launches  # what came through launchKernel (plans: all of it)
    return cupy


@pytest.mark.parametrize("dt,D", [("fp16", 128), ("fp32", 64)])
def test_cupy_launch_path_with_fake_cupy(monkeypatch, dt, D):
    """The device="cuda" code path (CupyLauncher: RawModule options, name expressions, the
    >48 KB opt-in, the kernel-parameter block read back by the kernel's parameter types) run end
    to end against a CuPy stand-in backed by the emulator."""
    import sys
    from flasharray._private import launch
    log, arrays = [], []
    fake = _fake_cupy(log, arrays)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(launch.CupyLauncher, "_modules", {})
    monkeypatch.setattr(launch, "_launchers", {})
    q, k, v = make_inputs(DTYPES[dt], D, 70, 90, gqa=True)
    arrays += [q, k, v]
    batch_shape = q.shape[:-2]
    for _ in range(2):  # planned, then the plan replayed: the block's slots rewritten
        out, lse = cuda_forward.forward(q, k, v, causal=True, scale=D ** -0.5, batch_shape=batch_shape,
                                        device="cuda", precision="ieee" if dt == "fp32" else None)
        assert_attention_close(out, q, k, v, causal=True, lse=lse)
    tile = cuda_forward.kernel_for(DTYPES[dt], D, D, 80, wide=True, causal=True)  # causal, 70 rows: sm_80's wide tile
    assert log and all(name == tile.name_expression(True, True) and smem == tile.smem for name, smem, _ in log)
    assert fake.driver_launches == [name for name, _, _ in log]  # every launch through launchKernel
    if tile.needs_opt_in:
        assert all(optin >= tile.smem for _, _, optin in log)


def test_arg_block_layouts():
    """launch.ArgBlock: every argument at an 8-byte aligned offset (128 for a 128-byte CUtensorMap), its
    bytes those of its NumPy scalar (Python int / float / bool: 64-bit, as CuPy passes them; types without
    a struct code, bfloat16, as their bytes), the slots zeros until written; an argument with no by-value
    bytes is a TypeError."""
    import ml_dtypes
    from flasharray._private import launch as L
    tmpl = [L.Ptr(0), np.int32(5), np.int64(-7), np.float32(1.5), np.float64(2.25), np.uint64(2 ** 63 + 5),
            np.bool_(True), L.Val("seed", np.uint32), np.uint32(9), 3, 2.5, True, L.Map(1, 0, None), np.int32(-1),
            L.Ptr(2, 4), np.uint8(7), np.float16(0.5), ml_dtypes.bfloat16(1.0)]
    offsets = (0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 128, 256, 264, 272, 280, 288)
    data = bytearray(296)
    python = {bool: np.bool_, int: np.int64, float: np.float64}
    for a, off in zip(tmpl, offsets):
        if not isinstance(a, (L.Ptr, L.Map, L.Val)):
            raw = python[type(a)](a).tobytes() if type(a) in python else a.tobytes()
            data[off:off + len(raw)] = raw
    block = L.ArgBlock(tmpl)
    assert block.offsets == offsets and block.words.view(np.uint8).tobytes() == bytes(data)
    assert data[8:12] == np.int32(5).tobytes() and data[72:80] == np.int64(3).tobytes()
    assert data[128:256] == bytes(128)  # the Map slot: zeros until encoded
    assert block.base % 128 == 0 and [int(a) - block.base for a in block.argv] == list(offsets)
    block.scalar(7, np.uint32)[0] = 0xDEADBEEF
    assert block.argument(7, 4) == np.uint32(0xDEADBEEF).tobytes()
    assert block.argument(17, 2) == ml_dtypes.bfloat16(1.0).tobytes()
    with pytest.raises(TypeError, match="kernel argument of type str has no by-value bytes"):
        L.ArgBlock([np.int32(1), "x"])


class _MapLauncher:
    """A packing launcher for :class:`launch.Packed` whose map encoder is ``encode(words, address)``;
    counts the encodings."""

    def __new__(cls, encode):
        from flasharray._private import launch as L

        class Launcher(L.NullLauncher):
            encodes = 0

            def encode_map(self, template, dest, dest_address, address):
                type(self).encodes += 1
                encode(dest, address)

        return Launcher()


def _map_packed(launcher):
    """A :class:`launch.Packed` of a launch with a pointer (array 0) and a tensor map (array 1, 8
    elements in), and its map's 16 words."""
    from flasharray._private import launch as L, tensor_map
    tmpl = tensor_map.TiledTemplate(np.float16, (64, 40), (128,), (64, 128), 128)
    rec = L.Recorded(launcher, "flash_fwd.cu", "k", (1, 1, 1), (32, 1, 1), [L.Ptr(0), L.Map(1, 8, tmpl)])
    packed = L.Packed(launcher, rec)
    return packed, packed.block.words[16:32], tmpl


@pytest.mark.parametrize("layout", ["plain", "emulator"])
def test_packed_tensor_maps_write_the_address_word(layout):
    """A map whose encodings differ only in one word holding the address itself (the driver's layout,
    checked per template at the plan's first call; the emulator's) is encoded once: a call writes its
    address there, and the 16 words equal a fresh encoding at that address."""
    from flasharray._private import launch as L
    if layout == "plain":
        def encode(words, address):
            words[:] = np.arange(100, 116, dtype=np.uint64)
            words[5] = address
        launcher = _MapLauncher(encode)
    else:
        launcher = L.NullLauncher()
        encode = None
    packed, words, tmpl = _map_packed(launcher)
    assert packed.map_ptrs == ((packed.block.word(1) + (5 if layout == "plain" else 1), 1, 8),)
    assert packed.maps == ()
    encodes = getattr(launcher, "encodes", None)
    for base in (0x7000_0000, 0x7000_1000, 0x6000_0100):
        packed([(0x1000, 2), (base, 2)])
        expect = np.zeros(16, np.uint64)
        (encode or (lambda w, a: tmpl.emulator_encode(w, a)))(expect, base + 16)
        assert np.array_equal(words, expect) and int(packed.block.words[0]) == 0x1000
    if encodes is not None:
        assert launcher.encodes == encodes  # no encoding per call
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        packed([(0x1000, 2), (0x7000_0008, 2)])


@pytest.mark.parametrize("layout", ["two words", "shifted", "refuses"])
def test_packed_tensor_maps_encoded_per_call_otherwise(layout):
    """An encoder that writes the address in two words, or not as itself, or refuses the probe
    addresses, keeps the per-call encoding (launch.Launcher.map_address_word is None)."""
    def encode(words, address):
        if layout == "refuses" and address != 0x7000_0010:
            raise RuntimeError("cuTensorMapEncodeTiled failed with CUresult 1")
        words[:] = 7
        words[3] = address >> 4 if layout == "shifted" else address
        if layout == "two words":
            words[9] = address ^ 1
    launcher = _MapLauncher(encode)
    if layout == "refuses":
        from flasharray._private import launch as L
        assert launcher.map_address_word(_map_packed(L.NullLauncher())[2]) is None
        return
    packed, words, _ = _map_packed(launcher)
    assert packed.map_ptrs == () and len(packed.maps) == 1
    before = launcher.encodes
    packed([(0x1000, 2), (0x7000_0000, 2)])
    assert launcher.encodes == before + 1 and int(words[3]) == (0x7000_0010 >> 4 if layout == "shifted"
                                                                else 0x7000_0010)


def test_cupy_launch_path_without_packed_launches(monkeypatch):
    """launch.PACKED_LAUNCHES = False (a switch for a GPU's verdict): plans launch through CuPy's
    RawKernel with argument tuples, with the same results."""
    import sys
    from flasharray._private import launch
    log, arrays = [], []
    fake = _fake_cupy(log, arrays)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(launch.CupyLauncher, "_modules", {})
    monkeypatch.setattr(launch, "_launchers", {})
    monkeypatch.setattr(launch, "PACKED_LAUNCHES", False)
    launch._clear_plans()
    q, k, v = make_inputs(np.float16, 64, 40, 50)
    arrays += [q, k, v]
    out, lse = cuda_forward.forward(q, k, v, causal=True, scale=0.125, batch_shape=q.shape[:-2], device="cuda")
    assert_attention_close(out, q, k, v, causal=True, lse=lse, scale=0.125)
    assert log and not fake.driver_launches
    launch._clear_plans()


def test_cupy_launch_path_binds_the_context_per_thread(monkeypatch):
    """The driver's launch needs the thread's context current: a call from a new thread makes the
    runtime call that binds it first (the stand-in refuses a launch on a thread without one)."""
    import sys
    import threading
    from flasharray._private import launch
    log, arrays = [], []
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(log, arrays))
    monkeypatch.setattr(launch.CupyLauncher, "_modules", {})
    monkeypatch.setattr(launch, "_launchers", {})
    q, k, v = make_inputs(np.float16, 64, 40, 40)
    arrays += [q, k, v]
    results = []

    def call():
        results.append(cuda_forward.forward(q, k, v, causal=False, scale=0.125, batch_shape=q.shape[:-2],
                                            device="cuda"))

    for _ in range(2):
        t = threading.Thread(target=call)
        t.start()
        t.join()
    assert len(results) == 2 and len(log) == 2
    for out, lse in results:
        assert_attention_close(out, q, k, v, causal=False, lse=lse)


# ---- the full product (slow) -----------------------------------------------------------------------

FULL = list(itertools.product(list(DTYPES), HEAD_DIMS, LENGTHS, [False, True]))


@pytest.mark.slow
@pytest.mark.parametrize("dt,D,lengths,causal", FULL,
                         ids=["%s-d%d-%dx%d%s" % (dt, D, a, b, "-causal" if c else "")
                              for dt, D, (a, b), c in FULL])
def test_forward_emulator_full(dt, D, lengths, causal):
    Lq, Lk = lengths
    # layout and GQA alternate over the product so both appear with every size
    i = FULL.index((dt, D, lengths, causal))
    check_case("emulator", DTYPES[dt], D, Lq, Lk, causal, layout=("bhsd", "bshd")[i % 2], gqa=bool(i // 2 % 2))


# ---- GPU (same bodies) -----------------------------------------------------------------------------

requires_gpu = pytest.mark.skipif(not gpu_available(), reason="no CUDA device visible to CuPy")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("case", SUBSET, ids=[_id(c) for c in SUBSET])
def test_forward_gpu(case):
    dt, D, Lq, Lk, causal, layout, gqa = case
    check_case("cuda", DTYPES[dt], D, Lq, Lk, causal, layout=layout, gqa=gqa)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.slow
@pytest.mark.parametrize("dt,D,lengths,causal", FULL)
def test_forward_gpu_full(dt, D, lengths, causal):
    Lq, Lk = lengths
    i = FULL.index((dt, D, lengths, causal))
    check_case("cuda", DTYPES[dt], D, Lq, Lk, causal, layout=("bhsd", "bshd")[i % 2], gqa=bool(i // 2 % 2))


@pytest.mark.gpu
@requires_gpu
def test_forward_gpu_matches_emulator():
    """GPU vs emulator on the same kernel: equal up to a few fp32 ulps (mma order unspecified)."""
    q, k, v = make_inputs(np.float16, 64, 100, 150, gqa=True)
    emu = run_forward("emulator", q, k, v, causal=True)
    gpu = run_forward("cuda", q, k, v, causal=True)
    np.testing.assert_allclose(gpu[0].get().astype(np.float32), emu[0].astype(np.float32), rtol=0, atol=2e-3)
    np.testing.assert_allclose(gpu[1].get(), emu[1], rtol=1e-5, atol=1e-5)


#: The mma.sync forward's tiles on any GPU (kernel="tensor_core": sm_90 would take the wgmma kernel): (dt, D, Dv, Lq,
#: Lk, causal) -> the tile (Br, Bc, stages) the plan takes on sm_80 / sm_90. d 128 / 96 non-causal: the single-
#: buffered 128 x 64 tile (its loop copies whole V tiles, the first one in the prologue; Lk 300 / 203 end in a
#: partial tile), causal too where it runs unsplit (Lk < 256: tiles.WIDE_BC64_CAUSAL; Lq > Lk: rows that see no key),
#: d < dv and split causal calls: 128 x 32, <= 64 rows: the square tile; d > 128: the 8-warp 128 x 64
#: (tiles.WIDE_BC64_LARGE), d = dv and d < dv.
MMA_GPU_CASES = [("fp16", 128, 128, 257, 300, False), ("bf16", 96, 96, 200, 203, False),
                 ("fp16", 64, 128, 130, 77, False), ("fp16", 128, 128, 200, 333, True),
                 ("bf16", 128, 128, 40, 200, False), ("fp16", 128, 128, 300, 200, True),
                 ("bf16", 96, 96, 130, 250, True), ("fp16", 256, 256, 200, 300, False),
                 ("bf16", 192, 256, 130, 203, False)]


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dt,D,Dv,Lq,Lk,causal", MMA_GPU_CASES)
def test_forward_gpu_mma_tiles(dt, D, Dv, Lq, Lk, causal):
    """The mma.sync tiles (FlashAttention-2's 128 x 64 where it applies) on the device: the rule, and the GPU's
    output within a few ulps of the emulator's on the same kernel."""
    import cupy
    q, k, v = make_inputs(DTYPES[dt], D, Lq, Lk, Dv=Dv)
    out, lse = check_case("cuda", DTYPES[dt], D, Lq, Lk, causal, Dv=Dv, kernel="tensor_core")
    arch = int(cupy.cuda.Device().compute_capability)      # the emulator plans the device's tile
    emu = run_forward("emulator", q, k, v, causal=causal, kernel="tensor_core", arch=arch)
    ref = emu[0].astype(np.float32)   # a few ulps of the output's scale (the mma's summation order is unspecified)
    ulp = float(np.finfo(np.float16).eps if dt == "fp16" else 2.0 ** -7) * float(np.abs(ref).max())
    np.testing.assert_allclose(out.astype(np.float32), ref, rtol=0, atol=4 * ulp)
    np.testing.assert_allclose(lse, emu[1], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("D,Lq,Lk,causal,gqa", [(64, 200, 300, False, True), (128, 130, 257, True, False),
                                                (96, 100, 190, False, False), (256, 70, 90, True, False),
                                                (59, 65, 127, False, False)])
def test_forward_gpu_sm75_code(D, Lq, Lk, causal, gqa):
    """sm_75's code on a newer GPU (arch=75: sm_75's tiles and PTX, which the driver compiles for the GPU:
    fa::cp_async as loads and stores, the staged K / V copies, m16n8k8 MMAs): the rule, and the emulator's
    output for sm_75 within a few ulps."""
    _gpu_matches_emulator(75, D, D, Lq, Lk, causal, gqa)


def _gpu_matches_emulator(arch, D, Dv, Lq, Lk, causal, gqa):
    """An older arch's code on the GPU (arch=: its tiles and NVRTC's PTX for it) meets the rule and gives the
    emulator's output for that arch within a few fp16 ulps (the lse within 1e-5)."""
    with older_arch_ptx():
        out, lse = check_case("cuda", np.float16, D, Lq, Lk, causal, Dv=Dv, gqa=gqa, arch=arch)
    q, k, v = make_inputs(np.float16, D, Lq, Lk, Dv=Dv, gqa=gqa)
    emu = run_forward("emulator", q, k, v, causal=causal, arch=arch)
    ref = emu[0].astype(np.float32)
    ulp = float(np.finfo(np.float16).eps) * float(np.abs(ref).max())
    np.testing.assert_allclose(out.astype(np.float32), ref, rtol=0, atol=4 * ulp)
    np.testing.assert_allclose(lse, emu[1], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("D,Dv,Lq,Lk,causal,gqa", [(128, 128, 300, 257, False, False), (128, 128, 200, 333, True, True),
                                                   (96, 96, 130, 190, False, False), (120, 64, 257, 70, False, True)])
def test_forward_gpu_sm86_code(D, Dv, Lq, Lk, causal, gqa):
    """sm_86/89's wide tiles on a newer GPU (arch=86: sm_86's tiles and PTX): the single-buffered 128 x 32 tile, with sQ
    XOR-swizzled at padded d 128 (tiles.swizzled_q), causal too at d 128 (tiles.causal_takes_wide). The rule, and the
    emulator's sm_86 output within a few ulps: the swizzle reads on hardware what it wrote."""
    q, k, v = make_inputs(np.float16, D, Lq, Lk, Dv=Dv, gqa=gqa)
    t = _plan(q, k, v, causal, arch=86).tile
    assert (t.block_m, t.block_n, t.stages) == (128, 32, 1)
    assert tiles.swizzled_q(t.head_dim, 128, 32, 1) == (t.head_dim == 128)
    _gpu_matches_emulator(86, D, Dv, Lq, Lk, causal, gqa)


@pytest.mark.gpu
@requires_gpu
def test_forward_gpu_newer_arch_is_an_error():
    """arch newer than the GPU's cannot run (its PTX would not load): a ValueError naming both."""
    import cupy
    arch = int(cupy.cuda.Device().compute_capability)
    q, k, v = make_inputs(np.float16, 64, 8, 8)
    with pytest.raises(ValueError, match="needs a GPU of that architecture or newer"):
        run_forward("cuda", q, k, v, causal=False, arch=arch + 10)


def test_sm75_ptx_is_what_an_older_arch_launch_loads():
    """What CupyLauncher(arch=75) loads on a newer GPU (no GPU needed): the PTX NVRTC gives for sm_75, whose
    copies are loads and stores (no cp.async) and whose MMAs are m16n8k8."""
    from flasharray._private import launch, nvrtc
    if not nvrtc.available()[0]:
        pytest.skip("NVRTC unavailable")
    t = cuda_forward.kernel_for(np.float16, 128, 128, 75)
    name = t.name_expression(False, True)
    ptx = nvrtc.compile_cubin(launch.kernel_source(t.source), "sm_75", [name], options=launch.cuda_compile_options()).ptx
    assert ".target sm_75" in ptx and "cp.async" not in ptx and "mma.sync.aligned.m16n8k8" in ptx


def test_mma_gpu_cases_take_their_tiles():
    """The tiles MMA_GPU_CASES exercise, as the plan takes them on sm_80 and sm_90 (emulator planning, no GPU)."""
    want = [(128, 64, 1), (128, 64, 1), (128, 32, 2), (128, 32, 2), (64, 64, None), (128, 64, 1), (128, 64, 1),
            (128, 64, 1), (128, 64, 1)]
    assert len(want) == len(MMA_GPU_CASES)
    for (dt, D, Dv, Lq, Lk, causal), w in zip(MMA_GPU_CASES, want):
        q, k, v = make_inputs(DTYPES[dt], D, Lq, Lk, Dv=Dv)
        for arch in (80, 90):
            t = _plan(q, k, v, causal, arch=arch, kernel="tensor_core").tile
            assert (t.block_m, t.block_n) == w[:2] and (w[2] is None or t.stages == w[2]), (arch, t)
