"""The extensions of docs/extensions.md on the Hopper wgmma backward (cuda_src/flash_bwd_sm90.cu, ``kExt``).

Every case runs the forward on the emulator (the mma.sync kernels), then
``cuda_backward.backward(..., kernel="wgmma", arch="sm_90", ext=...)`` and checks dq, dk, dv with the DESIGN.md
rule against ``flasharray.reference.attention_backward`` given the same keywords (``testing.check_attention``, as
tests/test_cuda_backward_extensions.py, whose ``features`` give the keyword values: with dropout the reference
applies the same Philox mask). Each asserts which dK/dV kernel ran — the warp-specialized TMA one, or the cp.async
one (``USE_TMA`` off) — and that its name ends in the call's kExt bits.

Default: each feature alone and combinations (all six at once), causal and not, Lq != Lk off the tiles, GQA, head
dims 64 and 128, both dQ modes, both kernels; the ordered mode bitwise under the ``reverse`` and ``random``
schedules; the gradients close to the mma.sync backward's on sm_80 (the same dropout bits); with lengths, NaN in
the padding never read (both kernels: the ws kernel zeroes what its boxes bring past Lq_b / Lk_b); the refusals;
static: the dense names unchanged, and the refusal table (``EXT_SPILLS``) against ptxas (a sample; ``-m slow``:
every subset). ``-m slow``: a larger matrix.
"""
import itertools
import re

import numpy as np
import pytest

import flasharray as fa
from flasharray import testing as fa_testing
from flasharray._private import cuda_backward as cb
from flasharray._private import cuda_backward_sm90 as S
from flasharray._private import cuda_forward, extensions, launch, nvrtc, sass
from flasharray._private.dtypes import bfloat16
from conftest import flag_set, requires_nvrtc, thin
from test_gpu_sm90 import requires_sm90
from test_cuda_backward_sm90 import _mutant, assert_dq_reordered_close
from test_cuda_backward_extensions import features

BITS = cuda_forward.EXT_BITS
ALL = ("window", "alibi", "softcap", "seqlens", "block_mask", "dropout")
NAME_BIT = {"window": BITS["window"], "alibi": BITS["alibi"], "softcap": BITS["softcap"],
            "seqlens": BITS["seqlens"], "block_mask": BITS["block_mask"], "dropout": BITS["dropout"]}


def bits_of(names):
    return sum(NAME_BIT[n] for n in names)


def kw_of(names, B, H, Lq, Lk, seed=1):
    """The extension keywords of ``names`` (block size (16, 32), a random block mask, seqlens shortening one
    entry's queries and the other's keys)."""
    all_kw = features(B, H, Lq, Lk, np.random.default_rng(seed))
    out = {}
    for n in names:
        out.update(all_kw[n])
    return out


def problem(dtype, D, Lq, Lk, B=2, H=2, Hk=2, seed=0, Dv=None):
    rng = np.random.default_rng(seed)
    Dv = D if Dv is None else Dv
    return tuple(rng.standard_normal(s).astype(dtype)
                 for s in ((B, H, Lq, D), (B, Hk, Lk, D), (B, Hk, Lk, Dv), (B, H, Lq, Dv)))


def backward(q, k, v, dout, out, lse, kw, *, causal, deterministic, device="emulator", **opts):
    """cuda_backward.backward with the keywords ``kw`` validated as the API does: (dq, dk, dv, counters) on the
    host. ``device`` "cuda": every array (and the keywords' arrays) copied to the GPU first; the counters are then
    (name, None) per launch of the plan."""
    B, H, Lq, D = q.shape
    xp = np
    if device == "cuda":
        import cupy as xp
    dev = lambda a: xp.asarray(a) if isinstance(a, np.ndarray) else a  # noqa: E731
    ext = extensions.from_options({n: dev(a) for n, a in kw.items()}, kind="numpy" if xp is np else "cupy",
                                  batch_shape=(B, H), Lq=Lq, Lk=k.shape[-2], acc=np.float32)
    args = [dev(a) for a in (dout, q, k, v, out, lse)]
    common = dict(causal=causal, scale=1.0 / np.sqrt(D), batch_shape=(B, H), device=device,
                  deterministic=deterministic, ext=ext, **opts)
    if device == "emulator":
        return cb.backward(*args, return_counters=True, **common)
    launches = [(r.name, None) for r in cb.plan(*args, **common).launches]
    return tuple(g.get() for g in cb.backward(*args, **common)[:3]) + (launches,)


def dkv_launch(counters):
    found = [(n, c) for n, c in counters if n.startswith((S.KERNEL, S.WS_KERNEL))]
    assert len(found) == 1, [n for n, _ in counters]
    return found[0]


def run_case(dtype, names, *, causal, deterministic, D=64, Lq=100, Lk=150, H=2, Hk=2, tma=True, check=True,
             inputs=None, device="emulator", kw=None, Dv=None, **opts):
    """Forward (emulator, sm_80) + the wgmma backward on ``device`` (the emulator, or an sm_90 GPU through
    CuPy); checked against the reference. ``kw``: the keywords (default :func:`kw_of` ``names``); ``Dv``: V's head
    dim (default D). Returns the grads."""
    Dv = D if Dv is None else Dv
    q, k, v, dout = problem(dtype, D, Lq, Lk, H=H, Hk=Hk, Dv=Dv) if inputs is None else inputs
    kw = kw_of(names, 2, H, Lq, Lk) if kw is None else kw
    out, lse = fa.flash_attention_forward(q, k, v, causal=causal, backend="emulator", **kw)
    res = backward(q, k, v, dout, out, lse, kw, causal=causal, deterministic=deterministic, kernel="wgmma",
                   arch="sm_90", device=device, **opts)
    grads, (name, c) = res[:3], dkv_launch(res[3])
    assert name.endswith(", %d>" % bits_of(names)), name
    assert name.startswith(S.WS_KERNEL if tma else S.KERNEL + "<"), name
    # dQ: the ws kernel's bulk reduce-adds (DQ_BULK_EXT: no atomic anywhere), else the consumers' atomics
    bulk = tma and S.ws_dq_bulk(D, Dv, bits_of(names))
    assert c is None or c.blocks == 0 or (c.atomics == 0 if bulk else c.atomics > 0), name
    if check:
        report = fa_testing.check_attention(out, q, k, v, causal=causal, dout=dout, grads=grads, **kw)
        assert report.passed, str(report)
    return grads


@pytest.fixture
def cp_async():
    """The cp.async kernel on inputs the ws kernel would take (USE_TMA off)."""
    with flag_set(S, "USE_TMA", False):
        yield


SINGLE = [((f,), np.float16, causal, det) for f, causal, det in
          [("window", True, False), ("alibi", False, True), ("softcap", True, True), ("seqlens", False, True),
           ("block_mask", True, False), ("dropout", False, True)]]
COMBOS = [
    (("window", "block_mask", "alibi"), bfloat16, False, False),
    (("softcap", "dropout", "seqlens"), np.float16, True, True),
    (ALL, np.float16, True, False),
]
# The cp.async kernel at head dim 64 runs everything but softcap + dropout together (EXT_SPILLS).
ALL_BUT_SOFTCAP = (("window", "alibi", "seqlens", "block_mask", "dropout"), np.float16, True, False)


def _id(case):
    names, dt, causal, det = case[:4]
    return "%s-%s%s-%s%s" % ("+".join(names), np.dtype(dt).name, "-causal" if causal else "",
                             "ordered" if det else "atomic", "".join("-%s" % x for x in case[4:]))


@pytest.mark.parametrize("case", thin(SINGLE + COMBOS), ids=_id)
def test_extension_ws_kernel(case):
    names, dt, causal, det = case
    run_case(dt, names, causal=causal, deterministic=det)


@pytest.mark.parametrize("case", [SINGLE[0], SINGLE[3], SINGLE[5], COMBOS[0], ALL_BUT_SOFTCAP], ids=_id)
def test_extension_cp_async_kernel(case, cp_async):
    names, dt, causal, det = case
    run_case(dt, names, causal=causal, deterministic=det, tma=False)


D128 = [  # the head dim 128 cases (sets EXT_SPILLS leaves to each kernel)
    (("alibi", "seqlens"), np.float16, True, True, "ws"),
    (("window", "block_mask", "alibi"), bfloat16, False, False, "ws"),
    (("window", "seqlens"), np.float16, True, False, "ws"),
    (("window",), bfloat16, True, False, "cp.async"),
]


# The ws kernel's bulk dQ (DQ_BULK_EXT) runs these at head dim 128, which it refuses with the consumers' atomics.
D128_BULK = [
    (("softcap",), np.float16, True, True, "ws"),
    (("alibi", "seqlens", "block_mask"), bfloat16, False, False, "ws"),
    (("softcap", "window", "alibi", "seqlens"), np.float16, False, True, "ws"),
    (("dropout",), np.float16, False, True, "ws"),
    (("softcap", "dropout", "block_mask"), bfloat16, True, False, "ws"),
    # since the thirty-eighth session: dropout with lengths (queries past Lq_b zeroed per visit) and with a window
    # (the keep bits packed into one word)
    (("dropout", "seqlens"), np.float16, True, True, "ws"),
    (("dropout", "seqlens", "softcap"), bfloat16, False, False, "ws"),
    (("dropout", "window"), bfloat16, True, True, "ws"),
    (("dropout", "window", "seqlens", "block_mask"), np.float16, False, False, "ws"),
    # since the thirty-ninth: dropout with ALiBi but causal with plain atomics (EXT_SPILLS_BULK_ONE)
    (("dropout", "alibi"), np.float16, True, True, "ws"),
    (("dropout", "alibi"), bfloat16, False, False, "ws"),
]


@pytest.mark.parametrize("case", thin(D128 + D128_BULK), ids=_id)
def test_extension_head_dim_128(case, monkeypatch):
    names, dt, causal, det, kind = case
    monkeypatch.setattr(S, "USE_TMA", kind == "ws")
    launch._clear_plans()
    run_case(dt, names, causal=causal, deterministic=det, D=128, Lq=70, Lk=140, tma=kind == "ws")


# Head dim 256 (the ws kernel's head-dim split: S^T, dP^T in both consumer warpgroups, dQ by their atomics; since
# the forty-second session): every set without dropout (EXT_SPILLS). D 200: padded to 256, the accumulator's 208.
D256 = [
    (("softcap", "window"), bfloat16, True, True, 256),   # Gemma 2's
    (("window",), np.float16, True, False, 256),
    (("alibi", "seqlens"), np.float16, False, True, 256),
    (("block_mask",), bfloat16, False, False, 256),
    (("window", "alibi", "softcap", "seqlens", "block_mask"), np.float16, True, False, 256),
    (("softcap", "window"), np.float16, False, True, 200),
]


@pytest.mark.parametrize("case", thin(D256), ids=_id)
def test_extension_head_dim_256(case):
    names, dt, causal, det, D = case
    run_case(dt, names, causal=causal, deterministic=det, D=D, Lq=70, Lk=140)


# D != Dv in the head-dim split (padded 256 / 128 or 128 / 256; since the forty-second session): every set without
# dropout (EXT_SPILLS). Rows of 16-byte multiples (the ws kernel's tensor maps).
MIXED = [
    (("seqlens",), np.float16, True, True, 192, 128),    # DeepSeek's MLA (d_qk 192, d_v 128), packed sequences
    (("window",), np.float16, True, False, 128, 256),
    (("window", "alibi", "softcap", "seqlens", "block_mask"), bfloat16, False, False, 192, 128),
    (("alibi", "softcap"), np.float16, False, True, 96, 200),
    (("dropout", "seqlens"), np.float16, True, True, 192, 128),
    (("dropout", "alibi"), bfloat16, True, False, 128, 256),   # (not causal, this mode refuses it: EXT_SPILLS_ONE)
]


@pytest.mark.parametrize("case", thin(MIXED), ids=_id)
def test_extension_mixed_head_dims(case):
    names, dt, causal, det, D, Dv = case
    run_case(dt, names, causal=causal, deterministic=det, D=D, Dv=Dv, Lq=70, Lk=140)


def test_head_dim_256_ordered_bits_identical_under_schedules():
    """The head-dim split's ordered dQ with a window and softcap: the reference's gradients, and the same bits under
    the reverse and random schedules (Lk 300: five key blocks of 64 add to most dQ elements, query blocks whose
    first visitor is past key block 0)."""
    names = ("window", "softcap")
    inputs = problem(np.float16, 256, 70, 300)
    base = run_case(np.float16, names, causal=False, deterministic=True, D=256, Lq=70, Lk=300, inputs=inputs)
    for schedule, seed in (("reverse", 0), ("random", 5)):
        again = run_case(np.float16, names, causal=False, deterministic=True, D=256, Lq=70, Lk=300, inputs=inputs,
                         check=False, schedule=schedule, seed=seed)
        for a, b in zip(base, again):
            assert np.array_equal(a.view(np.uint16), b.view(np.uint16)), (schedule, seed)


@pytest.mark.parametrize("det", [True, False], ids=["ordered", "atomic"])
def test_gqa_lq_above_lk(det):
    """K/V broadcast over 4 query heads (partial sums reduced), Lq > Lk off the tiles (rows without keys)."""
    names = ("alibi", "dropout") if det else ("window", "alibi", "dropout")
    run_case(np.float16, names, causal=True, deterministic=det, H=4, Hk=1, Lq=150, Lk=77)


@pytest.mark.parametrize("kind", ["ws", "cp.async"])
def test_ordered_bits_identical_under_schedules(kind, monkeypatch):
    """Ordered dQ with the features it takes (the cp.async kernel: not softcap with dropout, EXT_SPILLS): the same
    bits under the reverse and random (seeds 3, 11) schedules, 3 key blocks adding to each dQ element."""
    monkeypatch.setattr(S, "USE_TMA", kind == "ws")
    launch._clear_plans()
    names = ("alibi", "softcap", "dropout", "seqlens") if kind == "ws" else ("alibi", "dropout", "seqlens")
    inputs = problem(np.float16, 64, 70, 300)
    base = run_case(np.float16, names, causal=False, deterministic=True, Lq=70, Lk=300, tma=kind == "ws",
                    inputs=inputs)
    for schedule, seed in (("reverse", 0), ("random", 3), ("random", 11)):
        again = run_case(np.float16, names, causal=False, deterministic=True, Lq=70, Lk=300, tma=kind == "ws",
                         inputs=inputs, check=False, schedule=schedule, seed=seed)
        for a, b in zip(base, again):
            assert np.array_equal(a.view(np.uint16), b.view(np.uint16)), (schedule, seed)


@pytest.mark.parametrize("kind", ["ws", "cp.async"])
@pytest.mark.parametrize("names,causal,D", thin([
    (("window",), False, 64), (("window",), True, 64), (("window", "seqlens"), True, 64),
    (("window", "alibi", "dropout"), False, 64), (("window",), False, 128)], unpack=True),
    ids=["window", "window-causal", "window+seqlens-causal", "window+alibi+dropout", "window-d128"])
def test_ordered_window(kind, names, causal, D, monkeypatch):
    """The ordered dQ with a window (DQOrder::turn with the mask: query block i's first visitor is the window's
    left edge's key block, ascending; causal without lengths descending, unchanged; the ws kernel's dQ warp reads
    the left edge from shared memory): the reference's gradients, and the same bits under the reverse and random
    schedules (a wrong turn is a deadlock the emulator reports). Lk 300 over Lq 70: most query blocks' first
    visitor is past key block 0."""
    monkeypatch.setattr(S, "USE_TMA", kind == "ws")
    launch._clear_plans()
    inputs = problem(np.float16, D, 70, 300)
    base = run_case(np.float16, names, causal=causal, deterministic=True, D=D, Lq=70, Lk=300, tma=kind == "ws",
                    inputs=inputs)
    for schedule, seed in (("reverse", 0), ("random", 5)):
        again = run_case(np.float16, names, causal=causal, deterministic=True, D=D, Lq=70, Lk=300, tma=kind == "ws",
                         inputs=inputs, check=False, schedule=schedule, seed=seed)
        for a, b in zip(base, again):
            assert np.array_equal(a.view(np.uint16), b.view(np.uint16)), (schedule, seed)


@pytest.mark.parametrize("kind,D,names,causal", thin([
    ("ws", 64, (), False), ("ws", 64, (), True), ("cp.async", 64, ("seqlens",), True), ("ws", 128, ("window",), False),
    ("ws", 256, ("alibi",), True), ("ws", 64, ("dropout", "softcap"), False)], unpack=True),
    ids=["ws-d64", "ws-d64-causal", "cp.async-d64-lengths-causal", "ws-d128-window", "ws-d256-alibi-causal",
         "ws-d64-dropout-softcap"])
def test_ordered_block_mask(kind, D, names, causal, monkeypatch):
    """The ordered dQ with a block mask (dq_turn: a key block waits at query block i for its previous visitor past
    the mask's holes; a key block of holes only never posts; at d 64 the ws kernel's dQ warp takes the turns, at
    d 128 / 256 its consumers): the reference's gradients and the same bits under the reverse and random schedules
    (a wrong turn is a deadlock the emulator reports). The mask: holed_block_mask's whole-tile holes."""
    from test_cuda_backward_extensions import holed_block_mask
    monkeypatch.setattr(S, "USE_TMA", kind == "ws")
    launch._clear_plans()
    Lq, Lk = 200, 520
    inputs = problem(np.float16, D, Lq, Lk)
    kw = dict(kw_of(names, 2, 2, Lq, Lk), **holed_block_mask(2, 2, Lq, Lk))
    run = lambda **o: run_case(np.float16, ("block_mask",) + names, causal=causal, deterministic=True, D=D,  # noqa: E731
                               Lq=Lq, Lk=Lk, tma=kind == "ws", inputs=inputs, kw=kw, **o)
    base = run()
    for schedule, seed in (("reverse", 0), ("random", 3), ("random", 11)):
        again = run(check=False, schedule=schedule, seed=seed)
        for a, b in zip(base, again):
            assert np.array_equal(a.view(np.uint16), b.view(np.uint16)), (schedule, seed)


BULK_EXT = [  # names, dtype, causal, D, (Lq, Lk), schedule, seed: the ordered mode where the set allows it
    (("window",), np.float16, False, 64, (70, 300), "random", 3),          # the turn with the window's left edge
    (("seqlens", "alibi"), bfloat16, True, 64, (100, 150), "reverse", 0),  # lengths: ascending turns, NaN-free tails
    (("softcap", "dropout"), np.float16, False, 64, (70, 200), "random", 7),
    (("window", "seqlens"), np.float16, True, 128, (70, 140), "random", 5),
    (("block_mask", "alibi"), np.float16, False, 64, (256, 300), "random", 2),  # tiles skipped (both modes)
]


def skipping_block_mask(Lq, Lk, B=2, H=2, block_size=(16, 32)):
    """The block_mask keywords of kw_of with whole visit tiles (64 queries x 128 keys, the ws kernel's at d 64) all
    False in the middle of a key block's walk: query block 2 of key block 0, query block 1 of key block 1, so that
    QueryTileWalk::next skips them (kw_of's random mask leaves no tile empty)."""
    bm = kw_of(("block_mask",), B, H, Lq, Lk)["block_mask"].copy()
    bm[..., 8:12, 0:4] = False
    bm[..., 4:8, 4:8] = False
    return dict(block_mask=bm, block_size=block_size)


@pytest.mark.parametrize("case", thin(BULK_EXT), ids=lambda c: "+".join(c[0]) + "-%s%s-d%d" % (
    np.dtype(c[1]).name, "-causal" if c[2] else "", c[3]))
def test_bulk_dq_with_extensions_matches_atomics(case):
    """The ws kernel's bulk dQ with extensions (DQ_BULK_EXT: the dQ warp walks the consumers' visits and takes the
    turn with the mask) against the consumers' atomics on the same inputs. Ordered: the same adds in the same key-block
    order, so the same dq, dk, dv bits under a permuted schedule. Atomic (every set, the block mask's skipped tiles
    too): dk, dv bit for bit, dq within the test rule and 2 ulps of the atomic run's."""
    names, dt, causal, D, (Lq, Lk), schedule, seed = case
    inputs = problem(dt, D, Lq, Lk)
    kw = kw_of(names, 2, 2, Lq, Lk)
    if "block_mask" in names:
        kw.update(skipping_block_mask(Lq, Lk))
    for det in (True, False):
        run = lambda **o: run_case(dt, names, causal=causal, deterministic=det, D=D, Lq=Lq, Lk=Lk,  # noqa: E731
                                   inputs=inputs, kw=kw, **o)
        new = run(schedule=schedule, seed=seed)
        with flag_set(S, "DQ_BULK_EXT", False):
            old = run(check=False)
        for a, b in zip(new if det else new[1:], old if det else old[1:]):
            assert np.array_equal(a.view(np.uint16), b.view(np.uint16)), (names, det)
        if not det:
            assert_dq_reordered_close(new[0], old[0], dt)


@pytest.mark.parametrize("old,new,names,det", [
    ("      turn = ext_turn(i);\n",
     "      turn = DQTurn{dq_warp_turn<Order, kBlockM, kBlockN>(turn0, i), 1};\n",
     ("window",), True),
    ("      i = walk.next(i, n_qblocks);\n    } else {\n      const bool wrap = i + 1 == n_qblocks;\n"
     "      i = wrap ? i_begin : i + 1, grp_off",
     "      ++i;\n    } else {\n      const bool wrap = i + 1 == n_qblocks;\n      i = wrap ? i_begin : i + 1, grp_off",
     ("block_mask",), False),
], ids=["dense-turn", "dense-walk"])
def test_bulk_dq_with_extensions_mutations_caught(monkeypatch, old, new, names, det):
    """The dQ warp with the dense visit's turn (no window edge: query blocks whose first visitor is past key block 0
    wait for a turn that never comes, a deadlock the emulator reports) or the dense walk (block-mask tiles not
    skipped: the buffers added to the wrong query blocks, gradients off the reference)."""
    from flasharray import emulator
    _mutant(monkeypatch, old, new)
    try:
        launch._clear_plans()
        Lq = 70 if det else 256
        kw = dict(kw_of(names, 2, 2, Lq, 300), **(skipping_block_mask(Lq, 300) if "block_mask" in names else {}))
        with pytest.raises((emulator.EmulatorError, AssertionError), match="deadlock|FAIL|dq"):
            run_case(np.float16, names, causal=False, deterministic=det, Lq=Lq, Lk=300, kw=kw)
    finally:
        monkeypatch.undo()
        launch._clear_plans()


def test_dropout_bits_as_the_mma_sync_backward():
    """The same dropout (Philox counters of docs/extensions.md) as the mma.sync backward: gradients close to
    kernel "tc" on sm_80 for the same seed / offset, and far from another seed's."""
    names, Lq, Lk = ("dropout", "softcap"), 100, 150
    q, k, v, dout = problem(np.float16, 64, Lq, Lk)
    kw = kw_of(names, 2, 2, Lq, Lk)
    out, lse = fa.flash_attention_forward(q, k, v, backend="emulator", **kw)
    ours = backward(q, k, v, dout, out, lse, kw, causal=False, deterministic=False, kernel="wgmma", arch="sm_90")
    tc = backward(q, k, v, dout, out, lse, kw, causal=False, deterministic=False, arch="sm_80")
    other = backward(q, k, v, dout, out, lse, dict(kw, seed=kw["seed"] + 1), causal=False, deterministic=False,
                     kernel="wgmma", arch="sm_90")
    for a, b, c in zip(ours[:3], tc[:3], other[:3]):
        a, b, c = (x.astype(np.float32) for x in (a, b, c))
        tol = 2e-2 * np.abs(b).max()
        np.testing.assert_allclose(a, b, atol=tol, rtol=0)
        assert np.abs(c - b).max() > 10 * tol


@pytest.mark.parametrize("kind", ["ws", "cp.async"])
def test_lengths_never_read_past_the_entry(kind, monkeypatch):
    """NaN in q, k, v, dout past each entry's seqlens: the gradients are those of zeros there (bit for bit), and
    exactly zero in the padding (the ws kernel's boxes bring the rows in; its consumers zero them)."""
    monkeypatch.setattr(S, "USE_TMA", kind == "ws")
    launch._clear_plans()
    Lq, Lk = 100, 150
    kw = kw_of(("seqlens", "alibi"), 2, 2, Lq, Lk)
    sq, sk = kw["seqlens_q"], kw["seqlens_k"]
    clean = problem(np.float16, 64, Lq, Lk)
    for a in clean:
        for e in range(2):
            a[e, :, (sq if a.shape[-2] == Lq else sk)[e]:] = 0
    out, lse = fa.flash_attention_forward(*clean[:3], backend="emulator", **kw)
    ref = backward(*clean, out, lse, kw, causal=True, deterministic=True, kernel="wgmma", arch="sm_90")
    dirty = [a.copy() for a in clean]
    for a in dirty:
        for e in range(2):
            a[e, :, (sq if a.shape[-2] == Lq else sk)[e]:] = np.nan
    got = backward(*dirty, out, lse, kw, causal=True, deterministic=True, kernel="wgmma", arch="sm_90")
    assert dkv_launch(got[3])[0].startswith(S.WS_KERNEL if kind == "ws" else S.KERNEL + "<")
    for a, b in zip(got[:3], ref[:3]):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
    for e in range(2):
        assert not got[0][e, :, sq[e]:].any() and not got[1][e, :, sk[e]:].any()


@pytest.mark.parametrize("names,D,Dv,det,match", [
    (("alibi",), 64, 128, True, "padded alike, or in the head-dim split, only"),
    (("alibi",), 128, 64, False, "padded alike, or in the head-dim split, only"),
    (("dropout", "alibi"), 192, 128, False, "does not run alibi\\+dropout alone with deterministic=False at head dim "
     "256 / 128 on its warp-specialized TMA kernel.*spills"),
    (("dropout",), 256, 256, False, "dropout together at head dim 256 on its warp-specialized TMA kernel.*spills"),
    (("window", "dropout"), 200, 200, True, "dropout together at head dim 256 .*spills"),
    # the cp.async kernel (the ws kernel is off) takes no extension in the head-dim split
    (("alibi",), 256, 256, False, "above 128 on its warp-specialized TMA kernel only.*cp.async"),
    # the cp.async kernel refuses ALiBi at 128 (EXT_SPILLS; the ws kernel is off: rows not 16-byte aligned)
    (("dropout", "alibi"), 128, 128, False, "alibi together at head dim 128 on its cp.async kernel.*spills"),
])
def test_refused(names, D, Dv, det, match, monkeypatch):
    monkeypatch.setattr(S, "USE_TMA", "cp.async" not in match)
    _check_refused(names, D, Dv, det, match)


def test_one_instantiation_refused():
    """EXT_SPILLS_BULK_ONE: dropout + ALiBi at head dim 128, causal with plain atomics, is refused by name (the ws
    kernel's instantiation spills; the cp.async kernel refuses ALiBi), in that mode only: not causal, ordered, or
    with one more feature the ws kernel takes it."""
    _check_refused(("dropout", "alibi"), 128, 128, False, "alibi together at head dim 128 on its cp.async kernel.*; "
                   "its warp-specialized TMA kernel does not run alibi\\+dropout alone, causal,", causal=True)
    m = BITS["dropout"] | BITS["alibi"]
    why = S.ext_refusal(m, 128, 128, True, True, False)
    assert why is not None and "alone, causal, with deterministic=False" in why and "spills" in why
    for bits, causal, ordered in [(m, False, False), (m, True, True), (m, False, True), (m | BITS["window"], True,
                                                                                          False), (m, None, None)]:
        assert S.ext_refusal(bits, 128, 128, True, causal, ordered) is None, (bits, causal, ordered)
    assert S.ext_refusal(m, 64, 64, True, True, False) is None
    for D, Dv in ((256, 128), (192, 128), (128, 256)):   # EXT_SPILLS_ONE: the split's mixed dims, not causal, atomics
        why = S.ext_refusal(m, D, Dv, True, False, False)
        assert why is not None and "alone with deterministic=False at head dim" in why and "spills" in why
        for causal, ordered in ((True, False), (False, True), (True, True), (None, None)):
            assert S.ext_refusal(m, D, Dv, True, causal, ordered) is None, (D, Dv, causal, ordered)
    # since FastDiv (forty-ninth session's audit): a block mask with dropout at 128 by exact set and mode; the block
    # mask alone in the ordered mode runs at every head dim (kMaskTurns), the cp.async kernel's table unchanged
    bm, drop = BITS["block_mask"], BITS["dropout"]
    assert "spills" in S.ext_refusal(bm | drop, 128, 128, True, True, True)
    for bits, causal, ordered in ((bm | drop, False, False), (bm | drop, True, False), (bm | drop, None, None)):
        assert S.ext_refusal(bits, 128, 128, True, causal, ordered) is None, (bits, causal, ordered)
    for D in (64, 128, 256):
        for causal in (False, True):
            assert S.ext_refusal(bm, D, D, True, causal, True) is None, (D, causal)


@pytest.mark.parametrize("names,det,match", [
    (("softcap",), False, "softcap together at head dim 128 on its cp.async kernel.*spills"),
    (("dropout",), True, "dropout together at head dim 128 on its cp.async kernel.*spills"),
    (("alibi", "seqlens", "block_mask"), False, "spills"),
])
def test_refused_with_atomics(names, det, match):
    """With the consumers' atomics (DQ_BULK_EXT off) the ws kernel refuses sets at head dim 128 (EXT_SPILLS):
    softcap, dropout, and ALiBi + block mask + lengths, which its bulk dQ runs (D128_BULK)."""
    with flag_set(S, "DQ_BULK_EXT", False):
        _check_refused(names, 128, 128, det, match)


def _check_refused(names, D, Dv, det, match, causal=False):
    q, k, v, dout = problem(np.float16, D, 40, 60, B=2)
    if Dv != D:
        v = np.random.default_rng(1).standard_normal(k.shape[:-1] + (Dv,)).astype(np.float16)
        dout = np.random.default_rng(2).standard_normal(q.shape[:-1] + (Dv,)).astype(np.float16)
    kw = kw_of(names, 2, 2, 40, 60)
    out, lse = fa.flash_attention_forward(q, k, v, backend="emulator", **kw)
    with pytest.raises(NotImplementedError, match="kernel='wgmma'.*" + match):
        backward(q, k, v, dout, out, lse, kw, causal=causal, deterministic=det, kernel="wgmma", arch="sm_90")


@pytest.mark.parametrize("bulk", [True, False], ids=["bulk", "atomics"])
def test_spilling_sets_refused(bulk):
    """Every (kernel, head dim) subset the refusal table lists is refused by name, and its supersets (EXT_SPILLS;
    the ws kernel with the bulk dQ, EXT_SPILLS_BULK)."""
    with flag_set(S, "DQ_BULK_EXT", bulk):
        for key, subsets in S.EXT_SPILLS.items():   # (the head-dim split takes no bulk dQ with extensions)
            kind, d, dv = key if len(key) == 3 else key + key[1:]
            for m in (S.EXT_SPILLS_BULK if kind == "ws" and bulk and max(d, dv) <= S.SPLIT_ABOVE else S.EXT_SPILLS)[key]:
                why = S.ext_refusal(m, d, dv, kind == "ws")
                assert why is not None and "spills" in why, (key, m)
                assert S.ext_refusal(m | BITS["alibi"], d, dv, kind == "ws") is not None
    assert S.ext_refusal(BITS["softcap"], 128, 128, True) is None   # (the bulk dQ's registers)
    assert S.ext_refusal(BITS["dropout"], 128, 128, True) is None
    for D, Dv in ((256, 256), (192, 128), (128, 256)):
        assert S.ext_refusal(63 & ~BITS["dropout"], D, Dv, True) is None, (D, Dv)
    assert not S.ws_dq_bulk(256, 256, BITS["window"]) and S.ws_dq_bulk(256, 256) and S.ws_dq_bulk(128, 128, 1)


def test_dense_names_unchanged():
    """kExt = 0 adds nothing to the names (the dense instantiations keep their names and, docs/hopper.md, their
    SASS); an extension set appends it last."""
    tile = S.backward_tile(None, np.float16, 64, 64, 90)
    assert S.dkv_name(tile, None, 64, 64, True, True, False, dtype="fa_half") == \
        "flash_bwd_sm90_dkv_kernel<fa_half, fa_half, 64, 64, 64, 64, 128, true, true, false>"
    assert S.dkv_name(tile, None, 64, 64, True, True, False, ext=63, dtype="fa_half").endswith(", false, 63>")
    assert S.ws_name(tile, 64, 64, False, "fa_half").endswith("false, false, true, true>")
    assert S.ws_name(tile, 64, 64, False, "fa_half", ext=2).endswith("false, false, true, true, 2>")  # bulk dQ
    assert S.ws_name(tile, 64, 64, False, "fa_half", ordered=True, ext=1).endswith("false, true, true, true, 1>")
    with flag_set(S, "DQ_BULK_EXT", False):  # the consumers' atomics
        assert S.ws_name(tile, 64, 64, False, "fa_half", ext=2).endswith("false, false, true, false, 2>")
    assert S.ws_name(tile, 64, 64, False, "fa_half", ordered=True, ext=8).endswith("false, true, true, true, 8>")


# ---- static: the refusal table against ptxas -------------------------------------------------------------------

def instantiations(dtypes, dims, subsets, kinds=("ws", "cp.async")):
    """{name: (kind, d, bits)} of every extension instantiation a call can launch for these sets (both dQ modes,
    causal and not; ``dims``: head dims, or (D, Dv) pairs), those the refusal tables refuse left out."""
    found = {}
    for dt, d, bits, causal, ordered, kind in itertools.product(dtypes, dims, subsets, (False, True),
                                                                 (False, True), kinds):
        D, Dv = d if isinstance(d, tuple) else (d, d)
        if S.ext_refusal(bits, D, Dv, kind == "ws", causal, ordered):
            continue
        ks = cb.kernel_plan(dt, D, Dv, causal=causal, deterministic=False, arch=90, kernel="wgmma", ordered=ordered,
                            ext=bits, tma=kind == "ws")
        found[ks["dkv"][1]] = (kind, d, bits)
    return found


def check_no_spills(found):
    src = launch.kernel_source(S.SOURCE)
    names = sorted(found)
    problems = []
    for i in range(0, len(names), 12):
        res = nvrtc.compile_cubin(src, "sm_90a", names[i:i + 12], options=["--use_fast_math"])
        for n in names[i:i + 12]:
            k = res.kernel(n)
            if k.spill_stores or k.spill_loads or k.stack_frame or k.static_smem:
                problems.append("%s: spills %d/%d stack %d" % (n, k.spill_stores, k.spill_loads, k.stack_frame))
        problems += [line for line in res.log.splitlines() if "C7508" in line or "serializ" in line.lower()]
    assert not problems, "\n".join(problems)


@requires_nvrtc
def test_extension_instantiations_do_not_spill():
    """A sample of the sets the refusal tables leave to the kernels (fp16, each feature alone, head dims 64, 128 and
    256 — the ws kernel with its bulk dQ, EXT_SPILLS_BULK, below the split —, both dQ modes, causal and not)
    compiles for sm_90a without spills."""
    singles = [b for b in BITS.values()]
    check_no_spills(instantiations((np.float16,), (64, 128, 256), singles))


@requires_nvrtc
@pytest.mark.skipif(not sass.available()[0], reason="SASS tools unavailable: %s" % (sass.available()[1],))
def test_dq_warp_block_mask_turns_registers():
    """kMaskTurns (flash_bwd_sm90.cu): where the dQ warp takes the ordered mode's turns past a block mask's holes (bulk
    dQ, ordered, a block mask) the producer warpgroup runs at 32 registers and the consumers at 232 (ws_regs with
    mask_turns; at 24 the dQ warp spilled 4 bytes, forty-eighth session), without spills; the atomic twin keeps
    24 / 240. The setmaxnreg counts read from the SASS."""
    for ordered in (True, False):
        ks = cb.kernel_plan(np.float16, 64, 64, causal=False, deterministic=False, arch=90, kernel="wgmma",
                            ordered=ordered, ext=BITS["block_mask"], tma=True)
        name = ks["dkv"][1]
        res = nvrtc.compile_cubin(launch.kernel_source(S.SOURCE), "sm_90a", [name], options=["--use_fast_math"])
        k = res.kernel(name)
        assert not (k.spill_stores or k.spill_loads or k.stack_frame), (name, k.spill_stores, k.spill_loads)
        text = sass.disassemble(res.cubin)
        dec = [int(x, 16) for x in re.findall(r"USETMAXREG\.DEALLOC\.CTAPOOL (0x[0-9a-f]+)", text)]
        inc = [int(x, 16) for x in re.findall(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL UP\d, (0x[0-9a-f]+)", text)]
        want = S.ws_regs(64, 64, mask_turns=ordered)
        assert (dec, inc) == ([want[0]], [want[1]]), (name, dec, inc)
    assert S.ws_regs(64, 64, mask_turns=True) == (32, 232) and S.ws_regs(128, 128) == (24, 240)


@requires_nvrtc
@pytest.mark.slow
def test_every_extension_instantiation_does_not_spill():
    """Every subset of the six, fp16 and bf16, head dims 64, 128 and 256 and the split's mixed 256 / 128, 128 / 256,
    both kernels, both dQ modes, causal and not: those the refusal tables leave compile without spills (the audit
    behind the tables; ~30 min): the ws kernel with its bulk dQ (EXT_SPILLS_BULK) and with the consumers' atomics
    (DQ_BULK_EXT off, EXT_SPILLS)."""
    check_no_spills(instantiations((np.float16, bfloat16), (64, 128, 256, (256, 128), (128, 256)), range(1, 64)))
    with flag_set(S, "DQ_BULK_EXT", False):
        check_no_spills(instantiations((np.float16, bfloat16), (64, 128), range(1, 64), kinds=("ws",)))


# ---- -m slow: more shapes --------------------------------------------------------------------------------------

SLOW = [(names, dt, causal, det, D, kind)
        for names in (("window",), ("alibi", "dropout"), ("block_mask", "seqlens"), ("softcap", "window"), ALL)
        for dt in (np.float16, bfloat16) for causal in (False, True) for det in (False, True)
        for D in (64, 128, 256) for kind in ("ws", "cp.async")]


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW, ids=_id)
def test_extension_matrix(case, monkeypatch):
    names, dt, causal, det, D, kind = case
    if S.ext_refusal(bits_of(names), D, D, kind == "ws", causal, det):
        pytest.skip("refused (EXT_SPILLS)")
    monkeypatch.setattr(S, "USE_TMA", kind == "ws")
    launch._clear_plans()
    run_case(dt, names, causal=causal, deterministic=det, D=D, Lq=129, Lk=200, tma=kind == "ws")


# ---- on an sm_90 GPU (-m gpu: benchmarks/gpu_session.sh runs these; skipped with the reason elsewhere) ----------
# Each feature alone, the combinations, head dim 128's sets, GQA with Lq > Lk, both kernels, both dQ modes: the
# bodies above through CuPy (driver-encoded maps, sm_90a cubins), held to the same rule. What the GPU adds to the
# emulator: the hardware's own wgmma / TMA / mbarrier behaviour with the extensions' instructions in the loop.
GPU_CASES = ([c + (64, "ws") for c in SINGLE + COMBOS] + [c + ("cp.async",) for c in
             [c + (64,) for c in (SINGLE[0], SINGLE[3], SINGLE[5], COMBOS[0], ALL_BUT_SOFTCAP)]]
             + [c[:4] + (128, c[4]) for c in D128 + D128_BULK] + [c + ("ws",) for c in D256])


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("case", GPU_CASES, ids=_id)
def test_extension_gpu(case, monkeypatch):
    names, dt, causal, det, D, kind = case
    monkeypatch.setattr(S, "USE_TMA", kind == "ws")
    launch._clear_plans()
    run_case(dt, names, causal=causal, deterministic=det, D=D, Lq=100 if D == 64 else 70, Lk=150 if D == 64 else 140,
             tma=kind == "ws", device="cuda")


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("case", MIXED, ids=_id)
def test_extension_gpu_mixed_head_dims(case):
    names, dt, causal, det, D, Dv = case
    run_case(dt, names, causal=causal, deterministic=det, D=D, Dv=Dv, Lq=70, Lk=140, device="cuda")


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("det", [True, False], ids=["ordered", "atomic"])
def test_extension_gpu_gqa_lq_above_lk(det):
    names = ("alibi", "dropout") if det else ("window", "alibi", "dropout")
    run_case(np.float16, names, causal=True, deterministic=det, H=4, Hk=1, Lq=150, Lk=77, device="cuda")


@pytest.mark.gpu
@requires_sm90
def test_extension_gpu_ordered_bits_repeat():
    """The ordered dQ with extensions: three GPU runs give the same bits."""
    names = ("alibi", "softcap", "dropout", "seqlens")
    inputs = problem(np.float16, 64, 70, 300)
    runs = [run_case(np.float16, names, causal=False, deterministic=True, Lq=70, Lk=300, inputs=inputs,
                     device="cuda", check=i == 0) for i in range(3)]
    for again in runs[1:]:
        for a, b in zip(runs[0], again):
            assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("kind,D", [("ws", 64), ("cp.async", 64), ("ws", 128)])
def test_extension_gpu_ordered_window(kind, D, monkeypatch):
    """The ordered dQ with a window (its left edge's turn) on the GPU: the reference's gradients, and the same bits
    in a second run."""
    monkeypatch.setattr(S, "USE_TMA", kind == "ws")
    launch._clear_plans()
    inputs = problem(np.float16, D, 70, 300)
    names = ("window", "seqlens") if D == 64 else ("window",)
    runs = [run_case(np.float16, names, causal=False, deterministic=True, D=D, Lq=70, Lk=300, inputs=inputs,
                     tma=kind == "ws", device="cuda", check=i == 0) for i in range(2)]
    for a, b in zip(*runs):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("kind,D,causal", [("ws", 64, False), ("ws", 64, True), ("cp.async", 64, True),
                                           ("ws", 128, False), ("ws", 256, True)])
def test_extension_gpu_ordered_block_mask(kind, D, causal, monkeypatch):
    """The ordered dQ with a block mask (dq_turn: the previous visitor's rank past the holes) on the GPU: the
    reference's gradients, and the same bits in two more runs."""
    from test_cuda_backward_extensions import holed_block_mask
    monkeypatch.setattr(S, "USE_TMA", kind == "ws")
    launch._clear_plans()
    inputs = problem(np.float16, D, 200, 520)
    kw = holed_block_mask(2, 2, 200, 520)
    runs = [run_case(np.float16, ("block_mask",), causal=causal, deterministic=True, D=D, Lq=200, Lk=520,
                     inputs=inputs, kw=kw, tma=kind == "ws", device="cuda", check=i == 0) for i in range(3)]
    for again in runs[1:]:
        for a, b in zip(runs[0], again):
            assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


@pytest.mark.parametrize("names,causal,det", [(ALL, True, False), (("alibi", "dropout", "seqlens"), False, True)],
                         ids=["all-causal-atomic", "alibi+dropout+seqlens-ordered"])
def test_wgmma_forward_then_wgmma_backward(names, causal, det):
    """Both passes on the Hopper kernels (the forward's out and lse from flash_fwd_sm90.cu with the same kExt):
    the gradients within the rule, as after the mma.sync forward."""
    q, k, v, dout = problem(np.float16, 64, 100, 150)
    kw = kw_of(names, 2, 2, 100, 150)
    ext = extensions.from_options(kw, kind="numpy", batch_shape=(2, 2), Lq=100, Lk=150, acc=np.float32)
    out, lse = cuda_forward.forward(q, k, v, causal=causal, scale=1.0 / 8.0, batch_shape=(2, 2), device="emulator",
                                    ext=ext, kernel="wgmma", arch="sm_90")
    grads = backward(q, k, v, dout, out, lse, kw, causal=causal, deterministic=det, kernel="wgmma", arch="sm_90")[:3]
    report = fa_testing.check_attention(out, q, k, v, causal=causal, dout=dout, grads=grads, **kw)
    assert report.passed, str(report)
