"""The Hopper forward on wgmma (cuda_src/flash_fwd_sm90.cu, issue 13) on the emulator (arch sm_90).

Every case is held to the DESIGN.md rule against the float64 reference (``assert_attention_close``,
out and lse) and checks that the wgmma kernel ran: the plan's tile is the ``"wgmma"`` one, its
launch names ``flash_fwd_sm90_kernel``, and the emulator's wgmma counter equals the count the
tiling implies (2 warpgroups x (d/16 + Bc/16) per visible key tile of every block; causal tiles
above the diagonal are never visited). Default run: fp16 and bf16; head dims 64, 128 and padded
ones (40, 59, 72, 200); causal and not, Lq < Lk and Lq > Lk (fully masked rows), lengths off the
tiles; GQA broadcast; BSHD strided views; the element-wise copy path (D = 59); permuted emulator
schedules giving identical bits; the ws kernel's intra-warpgroup overlap (the default) giving the bits of
the ws kernel without it under each schedule; its TMA store of O (USE_TMA_STORE, the default where the
output is TMA-legal) giving the bits of its row stores under each schedule, the row stores kept for an
output TMA cannot write, and the emulator reporting the store without its proxy fence or its wait; the
opt-in and its errors. ``-m slow``: larger matrices.
"""
import contextlib
import dataclasses

import numpy as np
import pytest

from flasharray._private import cuda_forward, cuda_forward_sm90 as S, tiles
from flasharray._private.dtypes import bfloat16
from flasharray.testing import assert_attention_close

from conftest import flag_set, thin
from test_cuda_forward import make_inputs, run_forward

DTYPES = {"float16": np.float16, "bfloat16": bfloat16}


def _batch(q, k, v):
    return tuple(np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))


def sm90_plan(q, k, v, causal, **kw):
    return cuda_forward.plan(q, k, v, causal=causal, scale=1.0 / np.sqrt(q.shape[-1]), batch_shape=_batch(q, k, v),
                             device="emulator", arch="sm_90", kernel="wgmma", **kw)


def expected_wgmma(tile, Lq, Lk, causal, entries):
    """wgmma instructions of one launch: per block (query tile) its visible key tiles, per tile and
    warpgroup d/16 (S) + Bc/16 (O) instructions."""
    per_tile = tile.block_m // 64 * (tile.head_dim // 16 + tile.block_n // 16)  # consumer warpgroups
    tiles_visited = 0
    for m0 in range(0, Lq, tile.block_m):
        last_row = min(m0 + tile.block_m, Lq) - 1
        keys = min(Lk, last_row + 1 + Lk - Lq) if causal else Lk
        tiles_visited += -(-keys // tile.block_n) if keys > 0 else 0
    return entries * tiles_visited * per_tile


def stores_by_tma(plan):
    """Whether the plan's ws launch is the Is_tma_store instantiation (O written by TMA stores)."""
    return plan.tile.tma and S.ws_flags(plan.launches[0].name)[0]


def work_tiles(tile, rows, entries):
    """(query tile, batch entry) work tiles of one launch: what a non-persistent grid has as blocks."""
    return -(-rows // tile.block_m) * entries


def expected_tma_stores(tile, rows, entries):
    """TMA stores of one launch: per block, each consumer warpgroup holding a row below ``rows`` stores its
    64 rows as dv / 64 boxes."""
    per_tile = [sum(1 for w in range(tile.block_m // 64) if m0 + 64 * w < rows) for m0 in range(0, rows, tile.block_m)]
    return entries * sum(per_tile) * (tile.head_dim_v // 64)


def _tiles_without_keys(tile, rows, Lk, causal):
    """Query tiles of one batch entry that see no key (causal, Lq > Lk): no Q load without persistence."""
    return sum(1 for m0 in range(0, rows, tile.block_m) if causal and min(m0 + tile.block_m, rows) - 1 + Lk - rows < 0)


def check(dtype, D, Lq, Lk, causal, *, Dv=None, layout="bhsd", gqa=False, seed=0, tma=None, **opts):
    q, k, v = make_inputs(DTYPES[dtype], D, Lq, Lk, Dv=Dv, layout=layout, gqa=gqa, seed=seed)
    q0, k0, v0 = q.copy(), k.copy(), v.copy()
    counters = []
    out, lse = run_forward("emulator", q, k, v, causal=causal, kernel="wgmma", arch="sm_90", counters=counters, **opts)
    assert out.dtype == q.dtype and out.shape == q.shape[:-1] + (v.shape[-1],)
    assert lse.dtype == np.float32 and lse.shape == q.shape[:-1]
    assert_attention_close(out, q, k, v, causal=causal, lse=lse)
    for a, b in ((q, q0), (k, k0), (v, v0)):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    plan = sm90_plan(q, k, v, causal)
    assert plan.tile.kernel == "wgmma" and isinstance(plan.tile, S.Sm90Tile)
    assert tma is None or plan.tile.tma == tma, plan.tile.describe()
    kernel = "flash_fwd_sm90_ws_kernel" if plan.tile.tma else "flash_fwd_sm90_kernel"
    assert len(plan.launches) == 1 and plan.launches[0].name.startswith("flash::%s<" % kernel)
    assert len(counters) == 1
    c = counters[0]
    entries = int(np.prod(_batch(q, k, v)))
    rows, group = Lq * plan.gqa_group, plan.gqa_group
    n_work = work_tiles(plan.tile, rows, entries // group)
    if plan.tile.tma:  # the producer's TMA boxes only: no copy instruction anywhere, registers moved
        wgs = plan.tile.block_m // 64   # consumer warpgroups: 2, or 3 (THREE_WARPGROUPS)
        assert c.cp_async == 0 and c.tma_loads > 0 and c.setmaxnreg == (1 + wgs) * c.blocks and c.elects == c.blocks
        persistent = S.ws_flags(plan.launches[0].name)[1]
        assert persistent == plan.tile.persistent
        # persistent: min(work tiles, SMs) blocks, each walking several work tiles; else one block per tile
        sms = S.SM_COUNT or tiles.emulator_sm_count(90)
        assert c.blocks == (min(n_work, sms) if persistent else n_work)
        assert not persistent or plan.launches[0].grid == (c.blocks, 1, 1)
        # ping-pong: per work tile, one phase of each warpgroup's turn barrier per key tile, + the epilogue's
        # barriers: 2 (row stores) or 1 + each warpgroup's before its TMA store (Is_tma_store)
        tiles_visited = c.wgmma // (wgs * (plan.tile.head_dim // 16 + plan.tile.block_n // 16))
        assert c.named_barriers == (1 + wgs if stores_by_tma(plan) else 2) * n_work + wgs * tiles_visited
        # TMA loads: per work tile Q (d/64 boxes; persistent: every tile, else those with a visible key),
        # per visited key tile K and V (d/64 + dv/64 boxes)
        q_tiles = n_work if persistent else n_work - _tiles_without_keys(plan.tile, rows, Lk, causal) * (entries // group)
        assert c.tma_loads == (q_tiles * plan.tile.head_dim + tiles_visited * (plan.tile.head_dim + plan.tile.head_dim_v)) // 64
    else:
        assert c.tma_loads == 0 and c.setmaxnreg == 0
    assert c.tma_stores == (expected_tma_stores(plan.tile, rows, entries // group) if stores_by_tma(plan) else 0)
    if plan.gqa_group == 1:
        assert counters[0].wgmma == expected_wgmma(plan.tile, Lq, Lk, causal, entries) > 0
    else:  # GQA-packed (Lq = 1): the group's query heads are the rows of one block
        assert counters[0].wgmma == expected_wgmma(plan.tile, Lq * plan.gqa_group, Lk, causal,
                                                   entries // plan.gqa_group) > 0
    return out, lse


# (dtype, D, Lq, Lk, causal, layout, gqa): Lk off the tile (130, 45, 200), Lq > Lk causal (rows that see
# no key: out 0, lse −inf), two query tiles (Lq 130, 150), padded head dims (40 → 64, 72 → 128, 200 → 256),
# D = 59 (no 16-byte rows: element-wise copies), BSHD views (row stride H·D), GQA broadcast.
SUBSET = [
    ("float16", 64, 77, 130, False, "bhsd", False),
    ("bfloat16", 64, 130, 77, True, "bhsd", False),
    ("float16", 128, 65, 200, True, "bshd", False),
    ("bfloat16", 128, 17, 45, False, "bhsd", True),
    ("float16", 40, 150, 150, True, "bshd", True),
    ("bfloat16", 72, 33, 150, False, "bhsd", False),
    ("float16", 59, 20, 70, True, "bhsd", False),
    ("bfloat16", 200, 65, 100, True, "bhsd", False),
]


@pytest.mark.parametrize("dtype,D,Lq,Lk,causal,layout,gqa", SUBSET)
def test_wgmma_forward_matches_reference(dtype, D, Lq, Lk, causal, layout, gqa):
    """16-byte rows: the warp-specialized TMA kernel; D = 59 (118-byte rows): the cp.async fallback."""
    check(dtype, D, Lq, Lk, causal, layout=layout, gqa=gqa, tma=D % 8 == 0)


@pytest.fixture
def cp_async_kernel():
    """kernel="wgmma" with TMA turned off: the cp.async kernel on the layouts TMA would take."""
    with flag_set(S, "USE_TMA", False):
        yield


@pytest.mark.parametrize("dtype,D,Lq,Lk,causal,layout,gqa", [SUBSET[1], SUBSET[3]])
def test_cp_async_kernel_still_matches(cp_async_kernel, dtype, D, Lq, Lk, causal, layout, gqa):
    check(dtype, D, Lq, Lk, causal, layout=layout, gqa=gqa, tma=False)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_wgmma_forward_dv_differs(dtype):
    check(dtype, 64, 70, 140, True, Dv=128)
    check(dtype, 128, 70, 60, False, Dv=32)


def test_wgmma_forward_decode_packed():
    """Lq = 1 with GQA: the plan packs the group's query heads as rows of one block."""
    check("float16", 64, 1, 130, True, gqa=True)


@pytest.mark.parametrize("schedule,seed", [("reverse", 0), ("random", 1), ("random", 7)])
def test_wgmma_forward_schedules_identical(schedule, seed):
    """Permuted fiber schedules (TMA landing order, producer / consumer interleaving) give identical bits
    (GQA: K and V broadcast along the head dim, the tensor maps' extent-1 batch dim)."""
    q, k, v = make_inputs(np.float16, 64, 90, 200, seed=3, gqa=True)
    assert sm90_plan(q, k, v, True).tile.tma
    base = run_forward("emulator", q, k, v, causal=True, kernel="wgmma", arch="sm_90")
    got = run_forward("emulator", q, k, v, causal=True, kernel="wgmma", arch="sm_90", schedule=schedule, seed=seed)
    for a, b in zip(base, got):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


# (dtype, D, Lq, Lk, causal, gqa): several masked and unmasked key tiles (both of the overlapped loop's
# copies), Lq > Lk causal (rows with no visible key), one key tile only (visit 0 and the last P V alone),
# d = 256 (Bc = 64, five tiles), GQA broadcast (the maps' extent-1 batch dim).
OVERLAP_CASES = [
    ("float16", 64, 90, 520, True, True),
    ("bfloat16", 128, 200, 130, True, False),
    ("float16", 64, 33, 100, False, False),
    ("bfloat16", 256, 65, 300, False, False),
    ("bfloat16", 128, 70, 400, False, False),   # WIDE_KEYS: three key tiles of 176 (the last one 48 keys)
]


@pytest.mark.parametrize("dtype,D,Lq,Lk,causal,gqa", thin(OVERLAP_CASES, unpack=True))
@pytest.mark.parametrize("schedule,seed", [("forward", 0), ("reverse", 0), ("random", 5)])
def test_overlap_matches_unoverlapped_bits(monkeypatch, dtype, D, Lq, Lk, causal, gqa, schedule, seed):
    """The ws kernel's intra-warpgroup overlap (OVERLAP, the default: softmax of S_j while P_{j-1} V_{j-1}
    is in flight) gives the bits of its consumer loop without it (every wgmma batch waited for): the same
    fp32 operations in the same order per row, under each emulator schedule."""
    from flasharray._private import launch
    q, k, v = make_inputs(DTYPES[dtype], D, Lq, Lk, gqa=gqa, seed=D + Lk)
    got = {}
    for overlap in (True, False):
        monkeypatch.setattr(S, "OVERLAP", overlap)
        launch._clear_plans()
        tile = sm90_plan(q, k, v, causal).tile
        assert tile.tma and tile.overlap == overlap and S._ws_args(tile.name_expression(causal, True))[5:7] == [
            str(causal).lower(), str(overlap).lower()]
        got[overlap] = run_forward("emulator", q, k, v, causal=causal, kernel="wgmma", arch="sm_90",
                                   schedule=schedule, seed=seed)
    launch._clear_plans()
    for a, b in zip(got[True], got[False]):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    assert_attention_close(got[True][0], q, k, v, causal=causal, lse=got[True][1])


# (dtype, D, Lq, Lk, layout, gqa): several wide key tiles and a partial last one (380 = 192 + 188, 340 = 176 + 164,
# 300 = 3 x 80 + 60), exactly one tile (192, 176), padded head dims (48 -> 64, 120 -> 128, 200 -> 256), BSHD views,
# GQA broadcast.
WIDE_CASES = [
    ("float16", 64, 150, 380, "bhsd", False),
    ("bfloat16", 48, 70, 192, "bshd", True),
    ("bfloat16", 128, 130, 340, "bhsd", False),
    ("float16", 120, 40, 176, "bshd", False),
    ("bfloat16", 200, 65, 300, "bhsd", False),
]


@pytest.mark.parametrize("dtype,D,Lq,Lk,layout,gqa", thin(WIDE_CASES, unpack=True))
def test_wide_key_tiles(dtype, D, Lq, Lk, layout, gqa):
    """WIDE_KEYS: dense non-causal calls at padded d = dv 64 / 128 / 256 run the ws kernel on key tiles of 192 / 176
    / 80 (``check``: the reference rule, and the wgmma, TMA-box and named-barrier counts of that tile); causal
    calls too at d 256 (Lq < Lk and Lq > Lk), else the table's Bc; the call with Dv != D or with WIDE_KEYS off
    keeps the table's Bc (and meets the rule); permuted emulator schedules give the same bits."""
    out, lse = check(dtype, D, Lq, Lk, False, layout=layout, gqa=gqa, tma=True)
    q, k, v = make_inputs(DTYPES[dtype], D, Lq, Lk, layout=layout, gqa=gqa, seed=0)
    tile = sm90_plan(q, k, v, False).tile
    narrow = S.forward_tile(q.dtype, D, D, 90, kernel="wgmma").block_n
    assert tile.block_n == S.WIDE_BLOCK_N[tile.head_dim] != narrow and "WIDE_KEYS" in tile.describe()
    causal_bc = sm90_plan(q, k, v, True).tile.block_n
    assert causal_bc == (tile.block_n if tile.head_dim in S.WIDE_CAUSAL else narrow)
    if tile.head_dim in S.WIDE_CAUSAL:   # d 256: causal too (masked tiles across the diagonal, Lq < Lk here)
        check(dtype, D, Lq, Lk, True, layout=layout, gqa=gqa, tma=True)
        check(dtype, D, Lk + 50, Lk, True, layout=layout, gqa=gqa, tma=True)   # Lq > Lk: rows that see no key
    dv = 100 if tile.head_dim == 64 else 40   # another padded head dim
    v2 = make_inputs(DTYPES[dtype], D, Lq, Lk, Dv=dv, seed=0)[2]
    assert sm90_plan(q, k, v2, False).tile.block_n == S.forward_tile(q.dtype, D, dv, 90, kernel="wgmma").block_n
    for schedule, seed in (("reverse", 0), ("random", 3)):
        got = run_forward("emulator", q, k, v, causal=False, kernel="wgmma", arch="sm_90", schedule=schedule, seed=seed)
        for a, b in zip(got, (out, lse)):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    with flag_set(S, "WIDE_KEYS", False):
        assert sm90_plan(q, k, v, False).tile.block_n == narrow
        check(dtype, D, Lq, Lk, False, layout=layout, gqa=gqa, tma=True)


# (dtype, D, Lq, Lk, causal, layout, gqa): one partial query tile of 192; three (the last partial) causal with
# Lq > Lk (rows that see no key); padded head dims (40, 48 -> 64) with GQA broadcast; BSHD views; two query tiles.
THREE_WG_CASES = [
    ("float16", 64, 77, 130, False, "bhsd", False),
    ("bfloat16", 64, 400, 333, True, "bshd", False),
    ("float16", 40, 150, 150, True, "bhsd", True),
    ("bfloat16", 48, 200, 380, False, "bshd", True),
]


@pytest.mark.parametrize("dtype,D,Lq,Lk,causal,layout,gqa", thin(THREE_WG_CASES, every=4, unpack=True))
def test_three_warpgroups(dtype, D, Lq, Lk, causal, layout, gqa):
    """THREE_WARPGROUPS: dense calls at padded d = dv 64 run the ws kernel with three consumer warpgroups (Br = 192,
    Bc = 128, 512 threads; ``check``: the reference rule, and the counts of that tile — 4 setmaxnreg per block, three
    turn-barrier phases per key tile, a TMA store per warpgroup). Every row walks the key tiles of the two-warpgroup
    kernel on Bc = 128 (WIDE_KEYS off) in the same order, so the bits are that kernel's, under permuted schedules,
    persistent or not, with row stores or TMA stores, overlapped or not."""
    q, k, v = make_inputs(DTYPES[dtype], D, Lq, Lk, layout=layout, gqa=gqa, seed=D + Lq)

    def run(**kw):
        return run_forward("emulator", q, k, v, causal=causal, kernel="wgmma", arch="sm_90", **kw)

    with flag_set(S, "WIDE_KEYS", False):
        base = run()
        assert sm90_plan(q, k, v, causal).tile.block_m == 128
    with flag_set(S, "THREE_WARPGROUPS", True):
        tile = sm90_plan(q, k, v, causal).tile
        assert (tile.block_m, tile.block_n, tile.n_threads) == (192, 128, 512) and "THREE_WARPGROUPS" in tile.describe()
        check(dtype, D, Lq, Lk, causal, layout=layout, gqa=gqa, seed=D + Lq, tma=True)
        variants = [({}, "reverse", 0), ({"PERSISTENT": False}, "random", 5), ({"USE_TMA_STORE": False}, "forward", 0),
                    ({"OVERLAP": False, "SM_COUNT": 1}, "random", 2)]
        for flags, schedule, seed in variants:
            with contextlib.ExitStack() as stack:
                for name, value in flags.items():
                    stack.enter_context(flag_set(S, name, value))
                assert sm90_plan(q, k, v, causal).tile.block_m == 192
                got = run(schedule=schedule, seed=seed)
            for a, b in zip(got, base):
                np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_three_warpgroups_rule():
    """Three consumer warpgroups only where THREE_WARPGROUPS is set, for padded d = dv = 64 and no extension;
    the kernel's register split (32 + 3 x 160 per thread-slot) fills the register file."""
    def tile(d, dv=None, **kw):
        return S.tma_tile(S.forward_tile(np.float16, d, dv or d, 90, kernel="wgmma"), (), **kw)
    assert tile(64).block_m == 128
    with flag_set(S, "THREE_WARPGROUPS", True):
        assert [(tile(d).block_m, tile(d).block_n) for d in (16, 64, 128, 256)] == [(192, 128), (192, 128),
                                                                                   (128, 176), (128, 80)]
        assert tile(64, causal=True).block_m == 192 and tile(64, Lk=512).block_n == 128
        assert tile(64, 100).block_m == tile(64, ext=1).block_m == tile(64, ext=16).block_m == 128
    assert S.ws_registers(192) == (32, 160) and S.ws_registers(128) == (24, 240)
    assert (32 + 3 * 160) * 128 == 65536


def test_wide_key_tiles_rule():
    """The wide tile where its padded keys, at its cost per key, come cheaper than the table tile's: not at N 512
    or 1k at d 64 (6 x 192 = 1152 keys for 1024), at every N from 512 at d 128 and 256; causal at d 256 only;
    never with extensions or at d != dv."""
    def bc(d, Lk, **kw):
        t = S.forward_tile(np.float16, d, d, 90, kernel="wgmma")
        return S.tma_tile(t, (), Lk=Lk, **kw).block_n
    assert [bc(64, n) for n in (512, 1024, 2048, 4096, 380, 192, 200)] == [128, 128, 192, 192, 192, 192, 128]
    assert [bc(128, n) for n in (512, 1024, 16384, 128, 176, 340, 353)] == [176, 176, 176, 128, 176, 176, 128]
    assert [bc(256, n) for n in (512, 1024, 64, 80, 300)] == [80, 80, 64, 80, 80]
    assert bc(128, 4096, causal=True) == 128 and bc(128, 4096, ext=1) == 128 and bc(64, 4096, causal=True) == 128
    assert bc(256, 4096, causal=True) == 80   # FlashAttention-3's d 256 tile, causal or not
    t = S.forward_tile(np.float16, 128, 64, 90, kernel="wgmma")
    assert S.tma_tile(t, (), Lk=4096).block_n == 128


# (dtype, D, Dv, Lq, Lk, causal, layout): head dims padded to 192 (three 64-column panels; dv the N of the O wgmma:
# 192, or 128 as in DeepSeek's MLA), lengths off the tiles, causal Lq > Lk, BSHD views.
D192_CASES = [
    ("float16", 192, 192, 130, 200, False, "bhsd"),
    ("bfloat16", 160, 160, 77, 150, True, "bshd"),
    ("float16", 192, 128, 100, 300, False, "bhsd"),
    ("bfloat16", 176, 104, 140, 90, True, "bhsd"),
]


@pytest.mark.parametrize("dtype,D,Dv,Lq,Lk,causal,layout", thin(D192_CASES, unpack=True))
def test_head_dims_padded_to_192(dtype, D, Dv, Lq, Lk, causal, layout):
    """Head dims 129..192 pad to 192, not 256 (a quarter less work in Q K^T, and in P V where dv pads to 192): the
    ws kernel (persistent where not causal) and the cp.async kernel (its copies one 64-column panel at a time: 24
    chunks per row do not divide 256 threads) against the reference, with ``check()``'s counts."""
    check(dtype, D, Lq, Lk, causal, Dv=Dv, layout=layout, tma=True)
    q, k, v = make_inputs(DTYPES[dtype], D, Lq, Lk, Dv=Dv, layout=layout, seed=0)
    tile = sm90_plan(q, k, v, causal).tile
    assert (tile.head_dim, tile.head_dim_v) == (192, S.pad_head_dim(Dv)) and tile.persistent == (not causal)
    with flag_set(S, "USE_TMA", False):
        check(dtype, D, Lq, Lk, causal, Dv=Dv, layout=layout, tma=False)


@pytest.fixture
def tma_store(monkeypatch):
    """run(use_tma_store, q, k, v, causal, **opts): the forward with USE_TMA_STORE set, and its plan."""
    from flasharray._private import launch

    def run(use, q, k, v, causal, **opts):
        monkeypatch.setattr(S, "USE_TMA_STORE", use)
        launch._clear_plans()
        plan = sm90_plan(q, k, v, causal)
        return plan, run_forward("emulator", q, k, v, causal=causal, kernel="wgmma", arch="sm_90", **opts)
    yield run
    launch._clear_plans()


# (dtype, D, Dv, Lq, Lk, causal, layout, gqa): Lq off the tile (the boxes' rows past Lq clipped: 77, 200 = 128
# + 72; Lq = 65: warpgroup 1 has one row; Lq = 50: warpgroup 1 none, no store), d 64 / 128 / 256 (1, 2, 4 boxes
# per warpgroup), Dv = 40 and 72 (padded to 64 / 128: the columns past Dv clipped), BSHD views (a map over
# strided rows), GQA broadcast and the plan's packing (Lq = 1: the query heads are the rows of one block).
STORE_CASES = [
    ("float16", 64, 64, 77, 130, False, "bhsd", False),
    ("bfloat16", 128, 128, 200, 130, True, "bshd", False),
    ("float16", 256, 256, 65, 100, False, "bhsd", False),
    ("bfloat16", 64, 40, 50, 90, True, "bhsd", False),
    ("float16", 72, 72, 90, 150, True, "bshd", True),
    ("bfloat16", 64, 64, 1, 130, True, "bhsd", True),
]


@pytest.mark.parametrize("dtype,D,Dv,Lq,Lk,causal,layout,gqa", thin(STORE_CASES, unpack=True))
@pytest.mark.parametrize("schedule,seed", [("forward", 0), ("reverse", 0), ("random", 3)])
def test_tma_store_matches_row_store_bits(tma_store, dtype, D, Dv, Lq, Lk, causal, layout, gqa, schedule, seed):
    """The ws kernel writing O by TMA stores (Is_tma_store: swizzled staging, fence.proxy.async, one thread
    per warpgroup storing dv / 64 boxes, wait_group.read) gives the bits of its row stores (the same
    arithmetic; LSE one row per thread in both), under each emulator schedule; nothing past Lq or Dv written."""
    q, k, v = make_inputs(DTYPES[dtype], D, Lq, Lk, Dv=Dv, layout=layout, gqa=gqa, seed=D + Lq)
    got = {}
    for use in (True, False):
        plan, got[use] = tma_store(use, q, k, v, causal, schedule=schedule, seed=seed)
        assert plan.tile.tma and stores_by_tma(plan) == use, plan.launches[0].name
    for a, b in zip(got[True], got[False]):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    assert_attention_close(got[True][0], q, k, v, causal=causal, lse=got[True][1])


def test_tma_store_counts_and_reference():
    """The TMA-store kernel through check(): the reference rule, the boxes it stores (a warpgroup with no
    row below Lq stores none), its epilogue barriers."""
    check("float16", 128, 200, 130, True, layout="bshd", tma=True)
    check("bfloat16", 64, 50, 90, True, Dv=40, tma=True)


def test_out_not_tma_legal_keeps_row_stores(tma_store):
    """Dv = 59: q, k, v TMA-legal (v a view with 128-byte rows) but out (contiguous, 118-byte rows) not: the ws
    kernel keeps its row stores, q's map in out's slot, and is still right."""
    q, k, _ = make_inputs(np.float16, 64, 70, 100, seed=4)
    v = make_inputs(np.float16, 64, 70, 100, seed=5)[2][..., :59]
    assert S.tma_legal((q, k, v)) is None
    assert S.out_tma_legal(np.zeros(q.shape[:-1] + (59,), np.float16)).startswith("out has a stride of")
    plan, (out, lse) = tma_store(True, q, k, v, True)
    assert plan.tile.tma and not stores_by_tma(plan)
    maps = [a for a in plan.launches[0].template if hasattr(a, "template") and hasattr(a, "key")]
    assert [m.key for m in maps] == [0, 1, 2, 0]
    assert_attention_close(out, q, k, v, causal=True, lse=lse)


def test_out_tma_legal_rules():
    a = np.zeros((2, 3, 40, 64), np.float16)
    assert S.out_tma_legal(a) is None and S.out_tma_legal(a[..., :40]) is None
    assert S.out_tma_legal(np.zeros((2, 3, 40, 59), np.float16)) is not None
    raw = np.zeros(a.size + 8, np.float16)
    assert S.out_tma_legal(raw[1:1 + a.size].reshape(a.shape)) == "out is not 16-byte aligned"
    assert S.out_tma_legal(np.broadcast_to(a[:, :1], a.shape)) == "out is broadcast along a dim"
    assert S.with_tma_store("flash::flash_fwd_sm90_ws_kernel<fa_half, 64, 64, 128, 128, true, true>") == \
        "flash::flash_fwd_sm90_ws_kernel<fa_half, 64, 64, 128, 128, true, true, true>"


@pytest.fixture
def mutated_source(monkeypatch):
    """mutate(old, new, [old2, new2, ...]): the emulator compiles cuda_src/flash_fwd_sm90.cu with ``old`` (present
    once) replaced, and each further pair."""
    from flasharray._private import launch
    text, digest = launch.kernel_source(S.SOURCE), launch.source_digest()

    def mutate(old, new, *more):
        patched = text
        for o, n in zip((old,) + more[::2], (new,) + more[1::2]):
            assert patched.count(o) == 1, o
            patched = patched.replace(o, n)
        monkeypatch.setattr(launch, "kernel_source", lambda name: patched if name == S.SOURCE else text)
        monkeypatch.setattr(launch, "source_digest", lambda: digest + "-mutant-%x" % hash(patched))
        launch._clear_plans()
    yield mutate
    launch._clear_plans()


@pytest.mark.parametrize("old,new,match", [
    ("    fa::fence_proxy_async();\n    fa::named_barrier_sync(Tr::kStoreBarrier", "    fa::named_barrier_sync(Tr::kStoreBarrier",
     "written by ordinary \\(generic-proxy\\) stores since the block's last fa::fence_proxy_async"),
    ("      fa::tma_store_wait<0>();\n", "", "TMA store\\(s\\) whose source reads no fa::tma_store_wait"),
])
def test_tma_store_mutations_reported(mutated_source, old, new, match):
    """The TMA store without its proxy fence (the stmatrix writes may be invisible to the copy engine) or
    without its wait_group.read (the block exits while the store may still read shared memory) is an
    EmulatorError."""
    from flasharray.emulator import EmulatorError
    mutated_source(old, new)
    q, k, v = make_inputs(np.float16, 64, 77, 130)
    assert stores_by_tma(sm90_plan(q, k, v, False))
    with pytest.raises(EmulatorError, match=match):
        run_forward("emulator", q, k, v, causal=False, kernel="wgmma", arch="sm_90")


@pytest.fixture
def persistent(monkeypatch):
    """run(use, sm_count, q, k, v, causal, store=True, **opts): the forward with PERSISTENT = use, the
    persistent grid sized for ``sm_count`` SMs (None: the emulator's natural count) and USE_TMA_STORE =
    store; returns (plan, (out, lse), counters)."""
    from flasharray._private import launch

    def run(use, sm_count, q, k, v, causal, store=True, **opts):
        monkeypatch.setattr(S, "PERSISTENT", use)
        monkeypatch.setattr(S, "PERSISTENT_CAUSAL_MAX_HEAD_DIM", 256)   # causal d = 256 too (the default keeps it out)
        monkeypatch.setattr(S, "SM_COUNT", sm_count)
        monkeypatch.setattr(S, "USE_TMA_STORE", store)
        launch._clear_plans()
        plan = sm90_plan(q, k, v, causal)
        counters = []
        res = run_forward("emulator", q, k, v, causal=causal, kernel="wgmma", arch="sm_90", counters=counters, **opts)
        return plan, res, counters[0]
    yield run
    launch._clear_plans()


# (dtype, D, Lq, Lk, causal, gqa, layout, batch): Lq off the tile (a partial last query tile), several batch
# entries (work tiles = query tiles x entries: 4 to 9), causal with Lq > Lk (query tiles that see no key:
# their Q still loaded, their O zero), GQA broadcast, BSHD views, d 64 / 128 (sO in its own region; non-causal
# d 128 on the wide key tile: over the V stage of the tile's last visit, released after the epilogue) and 256 (sO
# over sQ, released after the epilogue).
PERSIST_CASES = [
    ("float16", 64, 200, 300, True, False, "bhsd", (1, 2)),
    ("bfloat16", 128, 330, 200, True, False, "bhsd", (1, 2)),
    ("float16", 64, 77, 130, False, True, "bshd", (2, 3)),
    ("bfloat16", 128, 150, 150, False, False, "bhsd", (3, 1)),
    ("float16", 256, 150, 100, True, False, "bhsd", (1, 2)),
    ("bfloat16", 256, 300, 100, True, False, "bhsd", (1, 1)),   # sO over the V ring; query tile 0 sees no key
    ("float16", 64, 150, 370, False, False, "bhsd", (2, 1)),   # WIDE_KEYS: key tiles of 192 (the last one 178 keys)
    ("bfloat16", 128, 200, 400, False, False, "bshd", (1, 2)),  # ... of 176: sO over the last visit's V stage,
]                                                               # three visits a tile (the stage alternates)
# forced SM counts (1: one block walks every tile; 2, 3: uneven splits) and the natural count (one tile per
# block), each under another emulator schedule
PERSIST_RUNS = [(1, "random", 11), (2, "reverse", 0), (3, "forward", 0), (None, "random", 4)]


@pytest.mark.parametrize("store", [True, False], ids=["tma_store", "row_store"])
@pytest.mark.parametrize("dtype,D,Lq,Lk,causal,gqa,layout,batch", thin(PERSIST_CASES, unpack=True))
def test_persistent_matches_non_persistent_bits(persistent, dtype, D, Lq, Lk, causal, gqa, layout, batch, store):
    """The persistent ws kernel (Is_persistent: min(work tiles, SMs) blocks walking the static scheduler's
    tiles, the K / V ring's stages and parities running across tiles, sQ handed back per tile) gives the bits
    of one block per tile, for 1, 2, 3 and the natural number of blocks, under permuted schedules; the
    reference rule; TMA store and row stores."""
    q, k, v = make_inputs(DTYPES[dtype], D, Lq, Lk, layout=layout, gqa=gqa, seed=D + Lq, batch=batch)
    plan, base, c0 = persistent(False, None, q, k, v, causal, store)
    n_work = work_tiles(plan.tile, Lq, int(np.prod(batch)))
    assert not plan.tile.persistent and c0.blocks == n_work and stores_by_tma(plan) == store
    assert_attention_close(base[0], q, k, v, causal=causal, lse=base[1])
    for sm_count, schedule, seed in PERSIST_RUNS:
        plan, got, c = persistent(True, sm_count, q, k, v, causal, store, schedule=schedule, seed=seed)
        assert plan.tile.persistent and S.ws_flags(plan.launches[0].name) == (store, True)
        assert c.blocks == min(n_work, sm_count or tiles.emulator_sm_count(90)) == plan.launches[0].grid[0]
        assert (c.wgmma, c.named_barriers, c.tma_stores) == (c0.wgmma, c0.named_barriers, c0.tma_stores)
        for a, b in zip(got, base):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def _group_arg(plan):
    """The ``group`` argument (Sm90WsScheduler: 0 is the longest-first order) of a plan's ws launch."""
    launch = plan.launches[0]
    assert launch.name.startswith("flash::flash_fwd_sm90_ws_kernel<")
    return int(launch.template[17])


# (D, Lq, Lk, batch, group bytes): odd and even query tiles per entry (middle tiles paired across entries), Lq > Lk
# (tiles that see no key), groups of 1 and 2 entries with a smaller last group (3 and 5 entries)
PAIR_CASES = [
    (64, 330, 330, (1, 3), 1),              # n_m = 3, groups of 1
    (128, 260, 200, (5, 1), 2 * 200 * 256 * 2),  # n_m = 3 (Lq > Lk), groups of 2: 2, 2, 1
    (64, 256, 400, (2, 2), 1 << 30),        # n_m = 2, one group
]


@pytest.mark.parametrize("D,Lq,Lk,batch,group_bytes", PAIR_CASES)
def test_persistent_causal_pairs(persistent, monkeypatch, D, Lq, Lk, batch, group_bytes):
    """The causal persistent order of paired tiles in L2 groups (Sm90WsScheduler with group > 0: query tiles m and
    n_m - 1 - m of one entry on one block, pairs round-robin by group, pair index, entry; odd n_m's middle tiles
    paired across entries) gives the bits of one block per tile, under permuted schedules, for SM counts that give
    every block two tiles or more; the launch carries the group its K / V bytes allow, and 0 (longest first) when
    a block would get one tile or with CAUSAL_PAIRS off."""
    monkeypatch.setattr(tiles, "CAUSAL_GROUP_BYTES", group_bytes)
    q, k, v = make_inputs(DTYPES["float16"], D, Lq, Lk, seed=D + Lq, batch=batch)
    _, base, _ = persistent(False, None, q, k, v, True)
    n_bh, n_work = int(np.prod(batch)), -(-Lq // 128) * int(np.prod(batch))
    group = max(1, min(n_bh, group_bytes // (Lk * 2 * D * 2)))
    for sm_count, schedule, seed in ((1, "random", 3), (2, "reverse", 0), (n_work // 2, "random", 5)):
        plan, got, c = persistent(True, sm_count, q, k, v, True, schedule=schedule, seed=seed)
        assert plan.tile.persistent and _group_arg(plan) == group and c.blocks == sm_count
        for a, b in zip(got, base):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    plan, got, _ = persistent(True, n_work // 2 + 1, q, k, v, True)   # a block with one tile: longest first
    assert _group_arg(plan) == 0
    monkeypatch.setattr(S, "CAUSAL_PAIRS", False)
    plan, got, _ = persistent(True, 1, q, k, v, True)
    assert _group_arg(plan) == 0
    for a, b in zip(got, base):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_causal_pair_order():
    """causal_pair_tiles (the host mirror of the paired order): every (query tile, entry) exactly once over the
    blocks; each block's pairs cost alike (n_m + 1 key tiles with bottom-right alignment at Lq = Lk), so the
    busiest block carries at most one pair more than the average; the blocks' k-th tiles cover few groups."""
    for n_m, n_bh, grid, group in ((8, 256, 132, 40), (32, 64, 132, 10), (128, 16, 132, 2), (7, 5, 3, 2),
                                   (9, 3, 4, 1), (1, 9, 4, 3), (2, 2, 2, 1)):
        lists = [S.causal_pair_tiles(b, grid, n_m, n_bh, group) for b in range(grid)]
        seen = sorted(t for tl in lists for t in tl)
        assert seen == [(m, e) for m in range(n_m) for e in range(n_bh)], (n_m, n_bh, grid, group)
        cost = [sum(m + 1 for m, _ in tl) for tl in lists]
        assert max(cost) <= sum(cost) / grid + n_m + 1, (n_m, n_bh, grid, group)
        if n_m % 2 == 0 and n_m * n_bh >= 4 * grid:   # the first pairs of every block: at most two groups
            firsts = {e // group for tl in lists for _, e in tl[:2]}
            assert len(firsts) <= 2 + grid // (n_m // 2 * group), (n_m, n_bh, grid, group)
    # the old order (longest first, every entry of a query tile together) at (4, 16, 4096) on 132 SMs: 64 entries
    # run at once; paired in groups of 10, about 16 (docs/hopper.md)
    lists = [S.causal_pair_tiles(b, 132, 32, 64, 10) for b in range(132)]
    assert len({e for tl in lists for _, e in tl[:1]}) <= 20


def test_causal_group_rule(monkeypatch):
    """causal_group: 0 with fewer than two tiles per block or CAUSAL_PAIRS off; else the entries whose K and V
    fit CAUSAL_GROUP_BYTES, at least 1, at most every entry."""
    mb = 1 << 20
    assert S.causal_group(263, 132, 16, 4096, 128, 128, 2) == 0
    assert S.causal_group(264, 132, 64, 4096, 128, 128, 2) == tiles.CAUSAL_GROUP_BYTES // (2 * mb)
    assert S.causal_group(2048, 132, 16, 65536, 256, 256, 2) == 1
    assert S.causal_group(2048, 132, 256, 64, 64, 64, 2) == 256
    monkeypatch.setattr(S, "CAUSAL_PAIRS", False)
    assert S.causal_group(2048, 132, 64, 4096, 128, 128, 2) == 0


@pytest.mark.parametrize("sm_count", [1, 2, 3])
def test_persistent_counts(monkeypatch, sm_count):
    """check()'s accounting with several tiles per block: blocks, per-tile named-barrier phases, the Q
    boxes of every work tile, the K / V boxes per visited key tile, the TMA stores."""
    from flasharray._private import launch
    monkeypatch.setattr(S, "SM_COUNT", sm_count)
    launch._clear_plans()
    check("bfloat16", 64, 130, 77, True, tma=True)            # Lq > Lk: a query tile with no visible key
    check("float16", 128, 200, 130, False, layout="bshd", tma=True)
    check("float16", 64, 1, 130, True, gqa=True)              # GQA-packed rows
    launch._clear_plans()


def test_persistent_layout_and_names():
    """The persistent layout (sO past the ring where it fits, else over sQ grown by whole KB) and names."""
    assert S.persistent_layout(64, 64, 128, 128) == (True, 0)
    assert S.persistent_layout(128, 128, 128, 128) == (True, 0)
    assert S.persistent_layout(256, 256, 128, 64) == (False, 2048)   # Br x 8 padding elements past sQ
    assert S.persistent_layout(64, 64, 128, 192) == (True, 0)
    assert S.persistent_layout(128, 128, 128, 176) == (False, 0)  # the wide key tiles: sO over the V ring
    assert S.persistent_layout(256, 256, 128, 80) == (False, 0)
    for d, bc in ((64, 128), (128, 128), (256, 64), (64, 192), (128, 176), (256, 80)):
        assert S.ws_smem_bytes(d, d, 128, bc, True, True) <= tiles.smem_limit(90)
    assert S.ws_smem_bytes(128, 128, 128, 128, True, True) == 163840 + 128 * 136 * 2 + 8 * 10 + 1024
    t = S.forward_tile(np.float16, 64, 64, 90, kernel="wgmma")
    ws = S.tma_tile(t, (), causal=True)
    assert ws.persistent == S.PERSISTENT
    assert S.tma_tile(S.forward_tile(np.float16, 256, 256, 90, kernel="wgmma"), ()).persistent  # zero spills now
    name = dataclasses.replace(ws, persistent=True).name_expression(True, True)
    assert name == "flash::flash_fwd_sm90_ws_kernel<fa_half, 64, 64, 128, 128, true, true, false, true>"
    assert S.with_tma_store(name).endswith("true, true, true, true>") and S.ws_flags(name) == (False, True)
    assert S.ws_flags(S.with_tma_store(name)) == (True, True)


_NO_Q_WAIT = ("    if (Is_persistent && k_tile > 0) fa::mbarrier_wait_parity(sm.empty_q, (k_tile - 1) & 1);\n", "")


@pytest.mark.parametrize("old,new,D,match", [
    # the producer not waiting for the consumers to hand sQ back: the next tile's Q lands under their wgmmas
    # (which of the two checks sees it first depends on the interleaving)
    (*_NO_Q_WAIT, 64, "fa::wgmma reads its A operand at .* the destination of a bulk copy|shared memory the wgmma "
                      "of warpgroup . reads .* was written between its issue"),
    (*_NO_Q_WAIT, 256, "fa::wgmma reads its A operand at .* the destination of a bulk copy|shared memory the wgmma "
                       "of warpgroup . reads .* was written between its issue"),
    # the ring's visit count restarted per tile: stages and parities out of step with the mbarriers' phases
    ("    visit += kExt == 0 ? n_block_max : visits;", "    visit = 0;", 64, "deadlock: thread .* waits for the phase"),
    # sQ never handed back (d = 64: separate sO, released after the S batches; d = 256: after the epilogue)
    ("    if (Is_persistent && !Tr::kOOverQ) fa::mbarrier_arrive(sm.empty_q);\n", "", 64, "deadlock"),
    ("    if (Tr::kOOverQ) fa::mbarrier_arrive(sm.empty_q);\n", "", 256, "deadlock"),
])
def test_persistent_mutations_reported(monkeypatch, mutated_source, persistent, old, new, D, match):
    """The emulator reports a persistent kernel (one block, four work tiles) that loads the next Q without
    sQ's hand-back, restarts the K / V ring per tile, or never hands sQ back (d 256: on key tiles of 64, sO over
    sQ)."""
    from flasharray.emulator import EmulatorError
    monkeypatch.setattr(S, "WIDE_KEYS", D != 256)
    q, k, v = make_inputs(np.float16, D, 200, 300, seed=2)
    mutated_source(old, new)
    with pytest.raises(EmulatorError, match=match):
        persistent(True, 1, q, k, v, True, schedule="random", seed=1)


_UNORDERED = ("fa::stmatrix writes shared offset .*(the destination of a bulk copy|where a bulk copy completing phase "
              ".* landed, unordered: this thread has not waited for that phase)")
_EMPTY_O = "    if (Tr::kOOverV) fa::mbarrier_arrive(sm.empty_o);   // the next tile's first V may land on sO\n"
_EMPTY_O_WAIT = ("    if (Tr::kOOverV && k_tile > 0 && n_block == tiles.first())   // the previous tile's sO lies over "
                 "the V ring\n      fa::mbarrier_wait_parity(sm.empty_o, (k_tile - 1) & 1);\n")


@pytest.mark.parametrize("D,old,new,match", [
    # the consumers never hand sO back: the producer waits for empty_o forever
    (128, _EMPTY_O, "", "deadlock"),
    # the producer loads a tile's first V without the wait: it lands under the previous tile's staged O (in flight
    # when the epilogue writes sO, or landed before it and overwritten unordered, as the schedule has it)
    (128, _EMPTY_O_WAIT, "", _UNORDERED),
    (256, _EMPTY_O_WAIT, "", _UNORDERED),
])
@pytest.mark.parametrize("schedule,seed", [("forward", 0), ("random", 1), ("reverse", 0)])
def test_o_over_v_mutations_reported(mutated_source, persistent, D, old, new, match, schedule, seed):
    """sO over the V ring (the wide key tiles at d 128 / 256, persistent, one block walking four work tiles): the
    emulator reports sO never handed back, or a tile's first V loaded without waiting for it, under every schedule."""
    from flasharray.emulator import EmulatorError
    q, k, v = make_inputs(np.float16, D, 200, 400, seed=2, batch=(1, 2))
    mutated_source(old, new)
    with pytest.raises(EmulatorError, match=match):
        persistent(True, 1, q, k, v, False, schedule=schedule, seed=seed)


def test_tma_fallback_rules():
    """What the TMA kernel takes (else the cp.async one): 16-byte aligned, 16-byte strides below 2^40."""
    a = np.zeros((2, 3, 40, 64), np.float16)
    assert S.tma_legal((a, a, a)) is None
    assert S.tma_legal((a, a[..., :59], a)) is None  # D = 59 in rows of 128 bytes: the map's extent is 59
    odd = np.zeros((2, 3, 40, 59), np.float16)
    assert S.tma_legal((a, odd, a)) == "k has a stride of 118 bytes (TMA: multiples of 16 below 2^40)"
    raw = np.zeros(2 * 3 * 40 * 64 + 8, np.float16)
    assert S.tma_legal((a, a, raw[1:1 + a.size].reshape(a.shape))) == "v is not 16-byte aligned"
    bcast = np.broadcast_to(a[:, :1], a.shape)  # stride 0: allowed (extent 1 in the map, coordinate 0)
    assert S.tma_legal((a, bcast, bcast)) is None
    # (head dim, rows, b2, b1, b0): the broadcast dim b2 (extent 3, stride 0) becomes extent 1, bit 0 set;
    # an extent-1 dim gets a stand-in stride of 16 bytes
    extents, strides, bits = S._map_geometry(64, 40, (3 * 40 * 64, 0, 0), 64, 2, (2, 1, 3))
    assert (extents, strides, bits) == ([64, 40, 1, 1, 2], [128, 16, 16, 2 * 3 * 40 * 64], 1)


def test_tensor_map_template_matches_the_encoder():
    """The plan's per-call encoding (geometry checked once, address per call) is encode_tiled's."""
    from flasharray._private import tensor_map
    a = np.zeros((2, 40, 64), np.float16)
    t = tensor_map.TiledTemplate(np.float16, (64, 40, 1, 1, 2), (128, 16, 16, 40 * 128), (64, 128, 1, 1, 1), 128)
    m = t.emulator_map(a.reshape(-1))
    assert m.words.tobytes() == t.emulator_arg(a.ctypes.data).tobytes()
    assert m.box_bytes == 64 * 128 * 2
    with pytest.raises(ValueError, match=r"global_strides\[0\] = 120 bytes"):
        tensor_map.TiledTemplate(np.float16, (60, 40), (120,), (64, 8), 128)


def test_null_launches_bind_tensor_maps():
    """The host path of a TMA plan (launch.null_launches: the CUDA path's kernel-parameter block, no
    driver): four 128-byte by-value maps per launch, 64-byte aligned in the block, encoded at the
    arrays' addresses (q, k, v, and out: the TMA store), and out's and lse's pointer slots."""
    from flasharray._private import launch
    q, k, v = make_inputs(np.float16, 64, 70, 130)
    with launch.null_launches():
        plan = sm90_plan(q, k, v, True)
        assert plan.tile.tma
        rec = plan.launches[0]
        where = [i for i, a in enumerate(rec.template) if isinstance(a, launch.Map)]
        assert [rec.template[i].key for i in where] == [0, 1, 2, 3]  # + out's (TMA store)
        out, lse = plan.run(q, k, v)
    block = rec.packed.block
    assert all((block.base + block.offsets[i]) % 128 == 0 for i in where)
    maps = [np.frombuffer(block.argument(i, 128), np.uint64) for i in where]
    assert [int(m[1]) for m in maps] == [x.ctypes.data for x in (q, k, v, out)]
    assert [int(np.frombuffer(block.argument(i, 8), np.uint64)[0]) for i, _, _ in rec.slots] == [
        out.ctypes.data, lse.ctypes.data]


def test_tile_table():
    for d, (hd, bc) in {40: (64, 128), 64: (64, 128), 100: (128, 128), 128: (128, 128), 129: (192, 64),
                        192: (192, 64), 193: (256, 64), 256: (256, 64)}.items():
        t = S.forward_tile(np.float16, d, d, "sm_90", kernel="wgmma")
        assert (t.head_dim, t.head_dim_v, t.block_m, t.block_n, t.n_threads, t.stages) == (hd, hd, 128, bc, 256, 2)
        assert t.smem == S.smem_bytes(hd, hd, 128, bc) <= tiles.smem_limit(90)
        assert t.source == "flash_fwd_sm90.cu" and "wgmma kernel" in t.describe()
    t = S.forward_tile(np.float16, 64, 128, 90, kernel="wgmma")
    assert (t.head_dim, t.head_dim_v) == (64, 128)
    assert t.name_expression(True, False) == "flash::flash_fwd_sm90_kernel<fa_half, 64, 128, 128, 128, true, false>"
    # Q 16 KB + 2 x (K 16 KB + V 32 KB) + 1 KB alignment
    assert t.smem == 16384 + 2 * (16384 + 32768) + 1024


def _auto_plan(q, k, v, arch="sm_90", **kw):
    return cuda_forward.plan(q, k, v, causal=False, scale=q.shape[-1] ** -0.5, batch_shape=_batch(q, k, v),
                             device="emulator", arch=arch, **kw)


@pytest.mark.parametrize("dtype,D,Dv", [(np.float16, 64, 64), (bfloat16, 128, 128), (np.float16, 200, 96)])
def test_dispatched_on_sm90_by_default(dtype, D, Dv):
    """kernel=None on sm_90 plans the wgmma forward (fp16 / bf16, dense); sm_80 and "tensor_core" keep mma.sync."""
    assert S.forward_tile(dtype, D, Dv, 90).kernel == "wgmma"
    assert S.forward_tile(dtype, D, Dv, 80) is None
    assert S.forward_tile(dtype, D, Dv, 90, kernel="tensor_core") is None
    q, k, v = make_inputs(dtype, D, 8, 8, Dv=Dv)
    assert _auto_plan(q, k, v).tile.kernel == "wgmma"
    assert _auto_plan(q, k, v, kernel="tensor_core").tile.kernel == "tensor_core"
    assert _auto_plan(q, k, v, arch="sm_80").tile.kernel == "tensor_core"


def test_not_dispatched_where_it_does_not_serve():
    """float32, extensions with AUTO_EXT off, block_m, num_splits, a KV cache and AUTO_DISPATCH off keep the
    previous choice."""
    from flasharray._private.extensions import Extensions
    assert S.forward_tile(np.float32, 64, 64, 90) is None
    with flag_set(S, "AUTO_EXT", False):
        assert S.forward_tile(np.float16, 64, 64, 90, ext=1) is None
        q, k, v = make_inputs(np.float16, 64, 8, 8)
        assert _auto_plan(q, k, v, ext=Extensions(window=(2, 2))).tile.kernel == "tensor_core"
    assert S.forward_tile(np.float16, 64, 64, 90, block_m=384) is None
    assert S.forward_tile(np.float16, 64, 64, 90, num_splits=2) is None
    assert S.forward_tile(np.float16, 64, 64, 90, kv=cuda_forward.KVLayout(False, 64)) is None
    assert S.forward_tile(np.float16, 300, 64, 90) is None
    q, k, v = make_inputs(np.float16, 64, 8, 8)
    assert _auto_plan(q, k, v, num_splits=2).tile.kernel == "tensor_core"
    assert _auto_plan(*(x.astype(np.float32) for x in (q, k, v))).tile.kernel != "wgmma"
    with flag_set(S, "AUTO_DISPATCH", False):
        assert S.forward_tile(np.float16, 64, 64, 90) is None
        assert _auto_plan(q, k, v).tile.kernel == "tensor_core"


@pytest.mark.parametrize("D,causal", [(64, True), (128, False), (195, True)])
def test_extensions_dispatched_on_sm90(D, causal):
    """kernel=None on sm_90 with extensions (AUTO_EXT): the wgmma forward (its ws kernel on 16-byte rows), the
    reference's result; rows not 16-byte aligned at padded d 256, which the wgmma kernel refuses with
    extensions, fall back to the mma.sync forward (``kernel="wgmma"`` there is the NotImplementedError)."""
    from flasharray._private import extensions
    q, k, v = make_inputs(np.float16, D, 70, 90, seed=D)
    # d 64: an unbounded left side (a short window there is the mma.sync forward's: test_short_windows_...)
    ext = dict(window=(-1, 5) if D <= 64 else (20, 5), softcap=8.0, dropout_p=0.2, seed=7, offset=3)
    ex = extensions.from_options(ext, kind="numpy", batch_shape=_batch(q, k, v), Lq=70, Lk=90, acc=np.dtype(np.float32))
    plan = cuda_forward.plan(q, k, v, causal=causal, scale=D ** -0.5, batch_shape=_batch(q, k, v),
                             device="emulator", arch="sm_90", ext=ex)
    assert plan.tile.kernel == ("tensor_core" if D % 8 else "wgmma"), plan.tile.describe()
    assert D % 8 or plan.tile.tma
    out, lse = cuda_forward.forward(q, k, v, causal=causal, scale=D ** -0.5, batch_shape=_batch(q, k, v),
                                    device="emulator", arch="sm_90", ext=ex)
    assert_attention_close(out, q, k, v, causal=causal, lse=lse, **ext)
    if D % 8:
        with pytest.raises(NotImplementedError, match="16-byte aligned"):
            cuda_forward.plan(q, k, v, causal=causal, scale=D ** -0.5, batch_shape=_batch(q, k, v),
                              device="emulator", arch="sm_90", ext=ex, kernel="wgmma")


@pytest.mark.parametrize("D,window,kernel", [(64, (255, 0), "tensor_core"), (64, (200, 183), "tensor_core"),
                                              (64, (200, 184), "wgmma"), (64, (-1, 0), "wgmma"),
                                              (40, (20, 5), "tensor_core"), (128, (255, 0), "wgmma")])
def test_short_windows_at_small_head_dims_keep_mma_sync(D, window, kernel):
    """kernel=None on sm_90: a window of at most SHORT_WINDOW_KEYS (384) keys per row at padded d <= 64 takes the
    mma.sync forward (1.3-1.4x faster on an H200 at (255, 0), d 64); longer or unbounded windows and d 128 the
    wgmma one; kernel="wgmma" forces it. The result is the reference's either way."""
    from flasharray._private import extensions
    q, k, v = make_inputs(np.float16, D, 70, 90, seed=D)
    ex = extensions.from_options(dict(window=window), kind="numpy", batch_shape=_batch(q, k, v), Lq=70, Lk=90,
                                 acc=np.dtype(np.float32))
    kw = dict(causal=False, scale=D ** -0.5, batch_shape=_batch(q, k, v), device="emulator", arch="sm_90", ext=ex)
    assert cuda_forward.plan(q, k, v, **kw).tile.kernel == kernel
    assert cuda_forward.plan(q, k, v, kernel="wgmma", **kw).tile.kernel == "wgmma"
    if kernel == "tensor_core":
        out, lse = cuda_forward.forward(q, k, v, **kw)
        assert_attention_close(out, q, k, v, causal=False, lse=lse, window=window)


def test_decoding_keeps_split_kv():
    """Where the mma.sync plan splits the keys (decoding: one query, long caches) kernel=None keeps it; without a
    split (short keys) the wgmma forward takes the call."""
    q, k, v = make_inputs(np.float16, 64, 1, 4096)
    p = _auto_plan(q, k, v)
    assert p.tile.kernel == "tensor_core" and p.num_splits > 1
    q, k, v = make_inputs(np.float16, 64, 1, 64)
    p = _auto_plan(q, k, v)
    assert p.tile.kernel == "wgmma" and p.num_splits == 1


def test_cuda_dispatch_needs_nvrtc_sm90a(monkeypatch):
    """On CUDA the wgmma kernels are taken only where NVRTC compiles sm_90a; the emulator needs no NVRTC."""
    monkeypatch.setattr(S, "nvrtc_sm90a", lambda: False)
    assert S.forward_tile(np.float16, 64, 64, 90, device="cuda") is None
    assert S.forward_tile(np.float16, 64, 64, 90, device="emulator").kernel == "wgmma"
    monkeypatch.setattr(S, "nvrtc_sm90a", lambda: True)
    assert S.forward_tile(np.float16, 64, 64, 90, device="cuda").kernel == "wgmma"


def test_dispatched_forward_runs_on_the_emulator():
    """One small kernel=None forward on the emulator's sm_90: the wgmma kernel, against the reference."""
    q, k, v = make_inputs(np.float16, 64, 64, 64)
    out, lse = run_forward("emulator", q, k, v, causal=False, arch="sm_90")
    assert_attention_close(out, q, k, v, causal=False, lse=lse)


@pytest.mark.parametrize("args,kw,match", [
    ((np.float16, 64, 64, 80), {}, "needs sm_90.*sm_80"),
    ((np.float16, 64, 64, 89), {}, "needs sm_90.*sm_89"),
    ((np.float32, 64, 64, 90), {}, "float16 or bfloat16, got float32"),
    ((np.float64, 64, 64, 90), {}, "got float64"),
    ((np.float16, 257, 64, 90), {}, "head dims 1..256, got D=257"),
    ((np.float16, 64, 300, 90), {}, "Dv=300"),
    ((np.float16, 64, 64, 90), {"num_splits": 2}, "no num_splits=2"),
    ((np.float16, 64, 64, 90), {"block_m": 384}, "no block_m=384"),
    ((np.float16, 64, 64, 90), {"kv": cuda_forward.KVLayout(False, 64)}, "no a KV cache"),
])
def test_wgmma_refused(args, kw, match):
    with pytest.raises(NotImplementedError, match="kernel='wgmma'.*" + match):
        S.forward_tile(*args, kernel="wgmma", **kw)


def test_wgmma_refused_through_forward():
    q, k, v = make_inputs(np.float16, 64, 8, 8)
    with pytest.raises(NotImplementedError, match="needs sm_90.*sm_80"):
        run_forward("emulator", q, k, v, causal=False, kernel="wgmma")
    with pytest.raises(NotImplementedError, match="float16 or bfloat16, got float32"):
        run_forward("emulator", *(x.astype(np.float32) for x in (q, k, v)), causal=False, kernel="wgmma",
                    arch="sm_90")
    with pytest.raises(NotImplementedError, match="no num_splits=2"):
        run_forward("emulator", q, k, v, causal=False, kernel="wgmma", arch="sm_90", num_splits=2)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("D", [16, 64, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Lq,Lk", [(300, 300), (257, 513), (513, 129)])
def test_wgmma_forward_larger(dtype, D, causal, Lq, Lk):
    check(dtype, D, Lq, Lk, causal, layout="bshd" if D == 96 else "bhsd", seed=D + Lq)


def test_cupy_path_compiles_sm90a_and_loads_the_cubin(monkeypatch, tmp_path):
    """device="cuda" on an sm_90 GPU: CuPy's RawModule would compile for plain sm_90 (which the wgmma
    wrappers refuse), so the launcher compiles the source for sm_90a with NVRTC, caches the cubin
    and loads it by path, asking for the mangled name; other sources keep RawModule(code=...)."""
    import sys
    import types
    from flasharray._private import launch, nvrtc
    ok, why = nvrtc.available()
    if not ok:
        pytest.skip(why)
    loaded = []

    class RawModule:
        def __init__(self, code=None, options=(), name_expressions=None, path=None):
            loaded.append(("path", path) if path is not None else ("code", tuple(name_expressions)))

        def get_function(self, name):
            loaded.append(("function", name))
            return types.SimpleNamespace(name=name)

    class Device:
        id, compute_capability, attributes = 0, "90", {"MultiProcessorCount": 132}

        def __init__(self, device_id=None):
            pass

    cupy = types.ModuleType("cupy")
    cupy.RawModule, cupy.cuda = RawModule, types.SimpleNamespace(Device=Device)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(launch.CupyLauncher, "_modules", {})
    monkeypatch.setenv("FLASHARRAY_EMULATOR_CACHE", str(tmp_path / "emulator"))
    t = S.forward_tile(np.float16, 64, 64, 90, kernel="wgmma")
    name = t.name_expression(False, True)
    launcher = launch.CupyLauncher()
    launcher._function(t.source, name)
    (kind, path), (_, lowered) = loaded
    assert kind == "path" and path.startswith(str(tmp_path / "cubin")) and "-sm_90a-" in path
    res = nvrtc.compile_cubin(launch.kernel_source(t.source), "sm_90a", [name], options=launch.cuda_compile_options())
    assert lowered == res.lowered_names[name] and lowered.startswith("_Z")
    assert open(path, "rb").read()[:4] == b"\x7fELF"
    launcher._function("flash_bwd_convert.cu", "flash_bwd_convert_dq_kernel<float, float, 128, 4>")
    assert loaded[2] == ("code", ("flash_bwd_convert_dq_kernel<float, float, 128, 4>",))
    # the warp-specialized TMA instantiation: the same sm_90a path; its tensor maps are the driver's
    # encoding per call (cuTensorMapEncodeTiled at the array's address + offset, stood in for here)
    ws = S.tma_tile(t, (), causal=True)
    ws_name = ws.name_expression(True, True)
    launcher._function(ws.source, ws_name)
    (kind, path), (_, lowered) = loaded[4:6]
    assert kind == "path" and "-sm_90a-" in path and lowered.startswith("_ZN5flash24flash_fwd_sm90_ws_kernel")
    from flasharray._private import tensor_map
    monkeypatch.setattr(tensor_map.TiledTemplate, "driver_arg", lambda self, address: ("driver", address))
    tmpl = tensor_map.TiledTemplate(np.float16, (64, 40), (128,), (64, 128), 128)
    assert launcher.tensor_map((0x10000, 2), 24, tmpl) == ("driver", 0x10000 + 48)
