"""The extensions of docs/extensions.md in the Hopper wgmma forward (cuda_src/flash_fwd_sm90.cu, kExt) on
the emulator (arch sm_90, ``kernel="wgmma"``).

Each case is held to the DESIGN.md rule against the brute-force specification of
tests/test_cuda_forward_extensions.py (``check_case``: materialized S and P, dropout from
``philox.keep_mask``); ``test_plan_takes_the_ws_kernel_with_the_bits`` checks the instantiation the plan
launches. Default run: every feature alone and in combinations (all six at once) on the warp-specialized TMA
kernel (overlapped and persistent as dense calls with window, seqlens, ALiBi, softcap alone; with the block
mask or dropout overlapped and persistent at d 64, above it every wgmma batch waited for; the wide key tiles
with lengths, ALiBi, softcap and at d 256 the window), fp16 and bf16, d 32 / 59 / 64 / 128 / 200, causal and
not, Lq != Lk off the tiles, GQA broadcast, BSHD strides, four batch dims; the same calls give the same bits on
the ws kernel without the overlap, without the persistent scheduler or on 2 SMs, with row stores instead of the TMA
store, and on the cp.async kernel (``USE_TMA`` off); permuted schedules give the same bits; the dropout mask is
Philox's bit for bit; fully masked rows; block-mask and window tiles are never loaded (TMA and wgmma
counters); the refusals; zero spills in the instantiations the tile table picks. ``-m slow``: every pair of
features x dtype x causal, every kExt subset compiled.
"""
import itertools

import numpy as np
import pytest

from flasharray._private import cuda_forward, cuda_forward_sm90 as S, launch
from flasharray._private.extensions import Extensions

from flasharray._private.dtypes import bfloat16

from conftest import requires_nvrtc, thin
from test_gpu_sm90 import requires_sm90
from test_cuda_forward_extensions import CASES as MMA_CASES, DTYPES, check_case, check_close, ext_kw, make_inputs, run
from test_cuda_forward_extensions import check_dropout_is_philox

WGMMA = dict(kernel="wgmma", arch="sm_90")


def _plan(q, k, v, causal, kw):
    batch = tuple(np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    return cuda_forward.plan(q, k, v, causal=causal, scale=0.125, batch_shape=batch, device="emulator",
                             ext=Extensions(**kw), **WGMMA)


# ---- the DESIGN.md rule, feature by feature ---------------------------------------------------------------
# The tensor-core cases of the mma.sync forward's file (no split-KV, no forced kernel), then head dims the
# wgmma tiles treat apart: 128 (Bc 128, dv 128), 200 (padded 256: Bc 64), long key ranges (several tiles).
CASES = [c for c in MMA_CASES if c[0] in ("fp16", "bf16") and not {"num_splits", "kernel"} & set(c[6])] + [
    ("bf16", 128, 133, 70, False, ("window", "alibi"), {}),
    ("fp16", 64, 200, 300, True, ("block_mask",), {"batch": (2, 2)}),
    ("fp16", 128, 70, 290, True, ("window", "seqlens", "dropout"), {}),
    ("bf16", 200, 70, 150, True, ("window", "alibi", "softcap", "block_mask", "dropout", "seqlens"), {}),
    ("fp16", 128, 150, 290, False, ("window", "seqlens"), {"layout": "bshd"}),
    ("fp16", 200, 70, 150, False, ("softcap", "seqlens"), {}),   # d 256 overlapped and persistent
    # the wide key tiles (WIDE_EXT): two of 192 (d 64), three of 176 (d 128, the last one 48 keys), three of 80
    # (d 256 causal with a window)
    ("fp16", 64, 150, 380, False, ("alibi", "softcap", "seqlens"), {}),
    ("bf16", 128, 133, 400, False, ("softcap", "seqlens"), {"layout": "bshd"}),
    ("bf16", 200, 150, 230, True, ("window", "alibi", "softcap"), {}),
]


def _id(case):
    dt, D, Lq, Lk, causal, features, opts = case
    extra = "".join("-%s%s" % (k, v) for k, v in sorted(opts.items()))
    return "%s-d%d-%dx%d%s-%s%s" % (dt, D, Lq, Lk, "-causal" if causal else "", "+".join(features), extra)


@pytest.mark.parametrize("case", thin(CASES), ids=[_id(c) for c in CASES])
def test_wgmma_extensions(case):
    dt, D, Lq, Lk, causal, features, opts = case
    check_case("emulator", dt, D, Lq, Lk, causal, features, **opts, **WGMMA)


def test_plan_takes_the_ws_kernel_with_the_bits():
    """The call runs the warp-specialized kernel with kExt = the features' bits as its last template
    argument (overlapped and persistent at d 64, dropout too); a dense call keeps the dense name (no kExt,
    overlapped)."""
    q, k, v = make_inputs(np.float16, 64, 70, 133, batch=(2, 3))
    kw = ext_kw(("window", "dropout"), (2, 3), 70, 133, np.float16)
    p = _plan(q, k, v, True, kw)
    bits = cuda_forward.EXT_BITS["window"] + cuda_forward.EXT_BITS["dropout"]
    names = [launch.name for launch in p.launches]
    assert p.tile.tma and p.tile.persistent and p.tile.overlap
    assert names == ["flash::flash_fwd_sm90_ws_kernel<fa_half, 64, 64, 128, 128, true, true, true, true, %d>" % bits]
    light = _plan(q, k, v, True, ext_kw(("window", "seqlens"), (2, 3), 70, 133, np.float16))
    assert light.tile.overlap and light.tile.persistent
    score = _plan(q, k, v, True, ext_kw(("alibi", "softcap"), (2, 3), 70, 133, np.float16))
    assert score.tile.overlap and score.tile.persistent   # d 64
    assert light.launches[0].name.endswith(", true, true, true, true, %d>" % (cuda_forward.EXT_BITS["window"] +
                                                                            cuda_forward.EXT_BITS["seqlens"]))
    dense = _plan(q, k, v, True, {})
    assert [launch.name for launch in dense.launches] == [
        "flash::flash_fwd_sm90_ws_kernel<fa_half, 64, 64, 128, 128, true, true, true, true>"]


# ---- the variants give the same bits ----------------------------------------------------------------------
VARIANTS = {
    "no-overlap": {"OVERLAP": False},   # where the route overlaps (d 64, or no block mask and no dropout)
    "not-persistent": {"PERSISTENT": False},
    "persistent-2-sms": {"SM_COUNT": 2},
    "row-stores": {"USE_TMA_STORE": False},
    "cp-async": {"USE_TMA": False},
}
BITS_CASES = [
    ("fp16", 64, 200, 290, True, ("window", "alibi", "softcap", "block_mask", "dropout", "seqlens")),
    ("bf16", 128, 150, 290, False, ("window", "block_mask", "dropout")),
    ("fp16", 128, 200, 290, True, ("window", "seqlens")),   # overlapped, persistent
    ("bf16", 128, 150, 290, True, ("alibi", "softcap")),   # overlapped, persistent
    ("fp16", 64, 150, 380, False, ("alibi", "softcap", "seqlens")),   # the wide key tile (192), persistent
]


@pytest.fixture
def fresh_plans():
    """Plans are cached by call signature, not by the modules' flags: cleared when the flags change and again
    after the test (after monkeypatch has restored them)."""
    launch._clear_plans()
    yield launch._clear_plans
    launch._clear_plans()


def _launches(q, k, v, causal, kw):
    p = _plan(q, k, v, causal, kw)
    return [(r.name, r.grid) for r in p.launches], p.tile.block_n


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("case", thin(BITS_CASES), ids=lambda c: "%s-d%d-%s" % (c[0], c[1], "+".join(c[5])))
def test_variants_bit_identical(monkeypatch, fresh_plans, case, variant):
    """The default instantiation and each variant compute every row with the same fp32 operations in the same
    order where their key tiles are equal: identical out and lse bits (the cp.async kernel at d 128 takes Bc 64
    with extensions: within the rule). A variant that launches the default's kernels for the case (the overlap
    switch where extensions turn it off; the SM count of a kernel that is not persistent) is skipped."""
    dt, D, Lq, Lk, causal, features = case
    dtype = DTYPES[dt]
    q, k, v = make_inputs(dtype, D, Lq, Lk, batch=(2, 2))
    kw = ext_kw(features, (2, 2), Lq, Lk, dtype)
    base, base_lse, scale = run("emulator", q, k, v, causal, kw, **WGMMA)
    base_launches, base_bc = _launches(q, k, v, causal, kw)
    for name, value in VARIANTS[variant].items():
        monkeypatch.setattr(S, name, value)
    fresh_plans()
    launches, bc = _launches(q, k, v, causal, kw)
    if launches == base_launches:
        pytest.skip("%s launches the default's kernels here" % variant)
    out, lse, _ = run("emulator", q, k, v, causal, kw, **WGMMA)
    if bc == base_bc:
        np.testing.assert_array_equal(out.view(np.uint16), base.view(np.uint16))
        np.testing.assert_array_equal(lse, base_lse)
    check_close(out, lse, q, k, v, causal, scale, kw)


@pytest.mark.parametrize("schedule,seed", [("reverse", 0), ("random", 3)])
def test_schedules_bit_identical(schedule, seed):
    q, k, v = make_inputs(np.float16, 64, 150, 290, batch=(1, 2))
    kw = ext_kw(("dropout", "block_mask", "window", "softcap"), (1, 2), 150, 290, np.float16)
    base, _, _ = run("emulator", q, k, v, True, kw, **WGMMA)
    other, _, _ = run("emulator", q, k, v, True, kw, schedule=schedule, seed=seed, **WGMMA)
    np.testing.assert_array_equal(base.view(np.uint16), other.view(np.uint16))


# ---- dropout bits, masked rows ------------------------------------------------------------------------------

@pytest.mark.parametrize("dt", ["fp16", "bf16"])
def test_dropout_mask_is_philox(dt):
    """q = 0 (uniform P) and v = identity: out[i, j] != 0 exactly where philox.keep_mask keeps (i, j); Lq 170:
    two work tiles of 128 rows."""
    check_dropout_is_philox(dt, Lq=170, **WGMMA)


def test_dropout_equals_the_mma_sync_forward():
    """The same seed drops the same entries in the wgmma and the mma.sync forward: outputs agree to the
    rounding of the two kernels (both within the rule; here against each other, elementwise)."""
    q, k, v = make_inputs(np.float16, 64, 150, 200, batch=(2, 2))
    kw = ext_kw(("dropout",), (2, 2), 150, 200, np.float16)
    a, lse_a, _ = run("emulator", q, k, v, True, kw, **WGMMA)
    b, lse_b, _ = run("emulator", q, k, v, True, kw)
    np.testing.assert_array_equal(a == 0, b == 0)
    np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=2e-2, atol=2e-3)
    np.testing.assert_allclose(lse_a, lse_b, rtol=1e-5, atol=1e-5)


def test_fully_masked_rows():
    """Rows that see no key (window (0, 0) with Lq > Lk; seqlens_q = 0; an all-False block row) are out 0,
    lse -inf, no NaN; a whole work tile without keys (entry 0) too."""
    batch, Lq, Lk = (2, 2), 150, 40
    q, k, v = make_inputs(np.float16, 32, Lq, Lk, batch=batch)
    bm = np.ones(batch + (10, 3), bool)
    bm[..., 2, :] = False
    kw = dict(window=(0, 0), seqlens_q=np.array([0, 141], np.int32), seqlens_k=np.array([40, 31], np.int32),
              block_mask=bm, block_size=(16, 16))
    out, lse, scale = run("emulator", q, k, v, True, kw, **WGMMA)
    assert not np.isnan(out.astype(np.float64)).any() and not np.isnan(lse).any()
    assert np.all(out[0] == 0) and np.all(np.isneginf(lse[0]))
    assert np.all(out[1, :, 32:48] == 0) and np.all(np.isneginf(lse[1, :, 32:48]))
    assert np.all(out[1, :, 141:] == 0) and np.all(np.isneginf(lse[1, :, 141:]))
    check_close(out, lse, q, k, v, True, scale, kw)


# ---- tiles never loaded (emulator counters: TMA boxes, wgmma) ---------------------------------------------------

def _visited(q, k, v, kw):
    """Key tiles loaded (TMA boxes past the work tiles' Q boxes, two per tile: K and V) and key tiles
    computed (wgmma: d/16 + Bc/16 per tile and consumer warpgroup) of one persistent launch."""
    counters = []
    cuda_forward.forward(q, k, v, causal=False, scale=0.1, batch_shape=q.shape[:-2], device="emulator",
                         ext=Extensions(**kw), counters=counters, **WGMMA)
    (c,) = counters
    work_tiles = -(-q.shape[-2] // S.BLOCK_M) * int(np.prod(q.shape[:-2]))
    assert (c.tma_loads - work_tiles) % 2 == 0   # persistent: every work tile loads its Q box
    return (c.tma_loads - work_tiles) // 2, c.wgmma // (2 * (q.shape[-1] // 16 + 128 // 16))


def test_block_mask_and_window_skip_tiles():
    """Visited key tiles = those of the block mask not all False and of the window band, exactly: the
    producer loads (K, V boxes) just the tiles the consumers compute."""
    bm_, bn = S.BLOCK_M, 128
    Lq, Lk = 2 * bm_, 4 * bn
    q, k, v = make_inputs(np.float16, 64, Lq, Lk, batch=(1, 1))
    rng = np.random.default_rng(5)
    for density in (1.0, 0.5, 0.0):
        bm = rng.random((1, 1, 2, 4)) < density
        assert _visited(q, k, v, dict(block_mask=bm, block_size=(bm_, bn))) == (int(bm.sum()),) * 2
    seen = []
    for left, right in ((-1, -1), (bn, 8), (0, 0)):
        tiles = sum((-(-min(Lk, m0 + bm_ + right) // bn) if right >= 0 else Lk // bn)
                    - (0 if left < 0 else max(0, m0 - left) // bn) for m0 in range(0, Lq, bm_))
        seen.append(_visited(q, k, v, dict(window=(left, right))))
        assert seen[-1] == (tiles, tiles)
    assert seen[0][0] == 8 and seen[-1][0] == 2


# ---- refusals --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("opts,match", [({"block_m": 64}, "block_m"), ({"num_splits": 2}, "num_splits")])
def test_still_refused_with_extensions(opts, match):
    q, k, v = make_inputs(np.float16, 64, 70, 133, batch=(2, 3))
    kw = ext_kw(("window",), (2, 3), 70, 133, np.float16)
    with pytest.raises(NotImplementedError, match=match):
        run("emulator", q, k, v, False, kw, **WGMMA, **opts)


def test_unaligned_rows_above_128_refused_with_extensions():
    """D = 150 (300-byte rows: not TMA-legal, element-wise copies) with extensions: NotImplementedError naming
    the alignment (those cp.async instantiations spill); the dense call runs."""
    q, k, v = make_inputs(np.float16, 150, 70, 133, batch=(1, 2))
    kw = ext_kw(("window",), (1, 2), 70, 133, np.float16)
    with pytest.raises(NotImplementedError, match="16-byte aligned"):
        run("emulator", q, k, v, False, kw, **WGMMA)
    run("emulator", q, k, v, False, {}, **WGMMA)  # dense: the cp.async kernel takes it


def test_cp_async_tile_with_extensions_at_128():
    """The cp.async kernel takes Bc 64 with extensions at padded d 128 (Bc 128 spills), and runs them on
    element-wise copies too (D = 100: 200-byte rows)."""
    q, k, v = make_inputs(np.float16, 100, 70, 133, batch=(2, 3))
    kw = ext_kw(("window", "block_mask", "dropout"), (2, 3), 70, 133, np.float16)
    p = _plan(q, k, v, True, kw)
    assert not p.tile.tma and p.tile.block_n == S.CP_ASYNC_EXT_BLOCK_N
    assert p.launches[0].name.startswith("flash::flash_fwd_sm90_kernel<fa_half, 128, 128, 128, 64, true, false, ")
    check_case("emulator", "fp16", 100, 70, 133, True, ("window", "block_mask", "dropout"), **WGMMA)
    assert _plan(q, k, v, True, {}).tile.block_n == 128


def test_routes_with_extensions(monkeypatch, fresh_plans):
    """Window, seqlens, ALiBi, softcap: the dense route at every head dim (overlapped, persistent as dense calls:
    causal to d 128); the block mask and dropout: overlapped and persistent at d 64, above it every wgmma batch
    waited for and not persistent. The old limits (the hopper_variants switches' flipped side): ALiBi / softcap
    overlapped to d 128, persistent to d 64; the block mask and dropout never overlapped."""
    def tile(D, causal, features):
        q, k, v = make_inputs(np.float16, D, 70, 133, batch=(2, 3))
        return _plan(q, k, v, causal, ext_kw(features, (2, 3), 70, 133, np.float16)).tile

    for D in (128, 200):
        for features in (("alibi",), ("softcap", "seqlens"), ("window",), ()):
            t = tile(D, False, features)
            assert t.overlap and t.persistent, (D, features)
        t = tile(D, True, ("softcap",))
        assert t.overlap and t.persistent == (D <= S.PERSISTENT_CAUSAL_MAX_HEAD_DIM)
        t = tile(D, False, ("dropout", "alibi"))
        assert not t.overlap and not t.persistent
    for features in (("block_mask",), ("dropout", "softcap"), ("window", "block_mask", "dropout", "seqlens")):
        t = tile(64, True, features)
        assert t.overlap and t.persistent, features
    monkeypatch.setattr(S, "HEAVY_EXT_OVERLAP_MAX_HEAD_DIM", 0)
    monkeypatch.setattr(S, "SCORE_EXT_OVERLAP_MAX_HEAD_DIM", 128)
    monkeypatch.setattr(S, "PERSISTENT_MAX_HEAD_DIM_SCORE_EXT", 64)
    launch._clear_plans()
    old128, old200 = tile(128, False, ("alibi",)), tile(200, False, ("softcap",))
    assert old128.overlap and not old128.persistent
    assert not old200.overlap and not old200.persistent
    assert tile(200, False, ("window",)).overlap and tile(200, False, ("window",)).persistent
    old64 = tile(64, True, ("block_mask",))
    assert old64.persistent and not old64.overlap


def test_wide_key_tiles_with_extensions(monkeypatch, fresh_plans):
    """WIDE_EXT: lengths, ALiBi and softcap take the wide key tile (192 / 176 / 80) where dense calls do, but not
    ALiBi with softcap at d 128; at d 256 the window too, causal or not; windows at d 64 / 128, the block mask and
    dropout keep the table's Bc; WIDE_EXT empty (the old route): every extension call on the table's Bc."""
    def bc(D, causal, features):
        q, k, v = make_inputs(np.float16, D, 70, 133, batch=(2, 3))
        return _plan(q, k, v, causal, ext_kw(features, (2, 3), 70, 133, np.float16)).tile.block_n

    wide = {64: 192, 128: 176, 200: 80}
    for D in (64, 128, 200):
        for features in (("alibi",), ("softcap", "seqlens"), ("seqlens",)):
            assert bc(D, False, features) == wide[D], (D, features)
        assert bc(D, True, ("softcap",)) == (80 if D == 200 else 128)   # causal: wide at d 256 only
        assert bc(D, False, ("window",)) == (80 if D == 200 else 128)
        assert bc(D, False, ("dropout",)) == bc(D, False, ("block_mask",)) == (64 if D == 200 else 128)
    assert bc(64, False, ("alibi", "softcap")) == 192 and bc(128, False, ("alibi", "softcap")) == 128
    assert bc(200, True, ("window", "alibi", "softcap", "seqlens")) == 80
    monkeypatch.setattr(S, "WIDE_EXT", {})
    launch._clear_plans()
    assert [bc(D, False, ("softcap",)) for D in (64, 128, 200)] == [128, 128, 64]
    assert bc(128, False, ()) == 176   # dense calls unchanged


# ---- static: the instantiations the tile table picks compile for sm_90a without spills -------------------------
STATIC_BITS = (63, 16, 38)  # every feature; dropout alone (the heaviest single one); ALiBi + softcap + seqlens
                            # (overlapped and persistent at every head dim). -m slow: every subset (the block mask alone,
                            # window + seqlens among them)
SLOW_STATIC_BITS = tuple(range(1, 64))


def ext_instantiations(bits_list, dtypes=(np.float16,), head_dims=(64, 128, 192, 256)):
    """Names of what cuda_forward picks with extensions: the ws kernel (TMA store and row stores; overlapped and
    persistent as tma_tile decides) and the cp.async kernel (aligned; element-wise only up to
    ELEMENTWISE_MAX_HEAD_DIM_EXT)."""
    found = set()
    for dtype in dtypes:
        for d in head_dims:
            t = S.forward_tile(dtype, d, d, 90, kernel="wgmma", ext=1)
            for bits in bits_list:
                ws = S.tma_tile(t, (), bits)
                assert ws.overlap == (bits & ~(S.GEOMETRY_EXT | S.SCORE_EXT) == 0 or d <= 64)
                for causal in (False, True):
                    found.add(ws.name_expression(causal, True, ext=bits))
                    found.add(ws.name_expression(causal, True, tma_store=True, ext=bits))
                    for aligned in (True, False)[:2 if d <= S.ELEMENTWISE_MAX_HEAD_DIM_EXT else 1]:
                        found.add(S.cp_async_ext_tile(t, aligned, bits).name_expression(causal, aligned, ext=bits))
    return sorted(found)


def _no_spills(names, chunk=256):
    """Zero spills in every name, compiled ``chunk`` names per NVRTC program: its time grows faster than the names
    (the 1,764 of one dtype in one program ran past 40 minutes; ~220 per program took ~3.5 minutes each)."""
    from flasharray._private import launch, nvrtc
    bad = []
    for i in range(0, len(names), chunk):
        part = names[i:i + chunk]
        res = nvrtc.compile_cubin(launch.kernel_source(S.SOURCE), "sm_90a", part, options=["--use_fast_math"])
        bad += ["%s: %d regs, spills %d/%d, stack %d" % (n, k.registers, k.spill_stores, k.spill_loads, k.stack_frame)
                for n, k in ((n, res.kernel(n)) for n in part) if k.spill_stores or k.spill_loads or k.stack_frame]
    assert not bad, "\n".join(bad)


@requires_nvrtc
def test_ext_instantiations_zero_spills():
    _no_spills(ext_instantiations(STATIC_BITS))


@pytest.mark.slow
@requires_nvrtc
@pytest.mark.parametrize("dtype", [np.float16, bfloat16], ids=["fp16", "bf16"])
def test_every_ext_subset_zero_spills(dtype):
    _no_spills(ext_instantiations(SLOW_STATIC_BITS, (dtype,)))


# ---- on an sm_90 GPU (-m gpu: benchmarks/gpu_session.sh runs these; skipped with the reason elsewhere) ----------
GPU_CASES = [c for c in CASES if c[1] in (128, 200) or len(c[5]) == 6 or c[6].get("gqa")]


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("case", GPU_CASES, ids=[_id(c) for c in GPU_CASES])
def test_wgmma_extensions_gpu(case):
    """The same bodies through CuPy on the GPU (the driver-encoded maps, the sm_90a cubins)."""
    dt, D, Lq, Lk, causal, features, opts = case
    check_case("cuda", dt, D, Lq, Lk, causal, features, kernel="wgmma", **opts)


# ---- -m slow: every pair of features x dtype x causal -----------------------------------------------------------
FEATURES = ("window", "alibi", "softcap", "block_mask", "dropout", "seqlens")
SLOW = [(dt, pair, causal) for dt in ("fp16", "bf16") for pair in itertools.combinations(FEATURES, 2)
        for causal in (False, True)]


@pytest.mark.slow
@pytest.mark.parametrize("dt,pair,causal", SLOW, ids=["%s-%s%s" % (d, "+".join(p), "-causal" if c else "")
                                                      for d, p, c in SLOW])
def test_wgmma_extension_pairs_full(dt, pair, causal):
    check_case("emulator", dt, 64, 150, 290, causal, pair, **WGMMA)
