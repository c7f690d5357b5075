"""cpu backend extensions (docs/extensions.md): dropout, block_mask, window, ALiBi, softcap and
per-entry lengths, alone and composed, forward and backward, under the DESIGN.md rule (2x the
naive error for out/lse, 3x for gradients).

The ground truth is ``flasharray.reference`` (float64; naive in q's dtype for the rule's naive
error). ``brute`` below is a second, independent statement of the specification written for these
tests: it must agree with the reference, its backward with finite differences, and the cpu
backend's dropout tiles with ``philox.keep_mask`` bit for bit.
"""
import functools

import numpy as np
import pytest

from flasharray._private import cpu, philox
from flasharray._private.dtypes import ATOL, accumulation_dtype, canonical_dtype
from flasharray._private.extensions import Extensions
import flasharray as fa
from flasharray import reference
from flasharray.reference import reduce_to_shape
from flasharray.testing import _compare

from conftest import DTYPES, DTYPE_IDS, make_qkv


# -- the specification, materialised -------------------------------------------------------------

def _rounder(dtype):
    """Round-after-every-step in ``dtype`` (float64 when None), values kept in its accumulation dtype."""
    p = canonical_dtype(np.float64 if dtype is None else dtype)
    acc = accumulation_dtype(p)
    return (lambda x: np.asarray(x).astype(p).astype(acc)), acc


def _visible(batch, Lq, Lk, causal, kw):
    """Boolean (*batch, Lq, Lk) visibility and the per-entry offset (*batch, 1, 1)."""
    n = len(batch)
    B = batch[0] if n else 1
    lq = np.full(B, Lq) if kw.get("seqlens_q") is None else np.asarray(kw["seqlens_q"], np.int64)
    lk = np.full(B, Lk) if kw.get("seqlens_k") is None else np.asarray(kw["seqlens_k"], np.int64)
    per = (-1,) + (1,) * (n + 1) if n else (1, 1)
    lq, lk = lq.reshape(per), lk.reshape(per)
    off = lk - lq
    i, j = np.arange(Lq)[:, None], np.arange(Lk)[None, :]
    vis = (i < lq) & (j < lk)
    if causal:
        vis = vis & (j <= i + off)
    left, right = kw.get("window") or (-1, -1)
    if left >= 0:
        vis = vis & (j >= i + off - left)
    if right >= 0:
        vis = vis & (j <= i + off + right)
    if kw.get("block_mask") is not None:
        Bq, Bk = kw.get("block_size", (128, 128))
        bm = np.asarray(kw["block_mask"])
        vis = vis & bm[..., np.arange(Lq)[:, None] // Bq, np.arange(Lk)[None, :] // Bk]
    return np.broadcast_to(vis, batch + (Lq, Lk)), np.broadcast_to(off, batch[:1] + (1,) * (n + 1))


@functools.lru_cache(maxsize=4)
def _keep_mask(p, seed, offset, batch, Lq, Lk):
    """philox.keep_mask, remembered: ``check`` asks for the same mask three times."""
    mask = philox.keep_mask(p, seed, offset, batch, Lq, Lk)
    mask.flags.writeable = False
    return mask


def brute(q, k, v, *, causal=False, scale=None, dtype=None, dout=None, **kw):
    """out, lse (and dq, dk, dv when ``dout`` is given) of the specification, on full matrices."""
    rnd, acc = _rounder(dtype)
    shapes = (q.shape, k.shape, v.shape)
    q, k, v = (rnd(x) for x in (q, k, v))
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    Lq, Lk = q.shape[-2], k.shape[-2]
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    S = rnd(rnd(q @ np.swapaxes(k, -1, -2)) * scale)
    T = None
    if kw.get("softcap") is not None:
        T = rnd(np.tanh(S / kw["softcap"]))
        S = rnd(T * kw["softcap"])
    vis, off = _visible(batch, Lq, Lk, causal, kw)
    if kw.get("alibi_slopes") is not None:
        slopes = np.asarray(kw["alibi_slopes"], np.float64)
        slopes = slopes.reshape(slopes.shape + (1, 1))
        dist = np.abs(np.arange(Lq)[:, None] + off - np.arange(Lk)[None, :])
        S = rnd(S - slopes * dist)
    S = np.where(vis, S, -np.inf)
    m = S.max(axis=-1, keepdims=True) if Lk else np.full(S.shape[:-1] + (1,), -np.inf)
    m = np.where(np.isneginf(m), 0, m)
    E = np.exp(S - m)
    l = E.sum(axis=-1, keepdims=True)
    P = rnd(E / np.where(l == 0, 1, l))
    with np.errstate(divide="ignore"):
        lse = (m + np.log(l))[..., 0].astype(acc)
    keep, p = 1.0, kw.get("dropout_p", 0.0)
    if p > 0:
        keep = _keep_mask(p, kw["seed"], kw.get("offset", 0), batch, Lq, Lk) / (1 - p)
    Pd = rnd(P * keep)
    out = rnd(Pd @ v)
    if dout is None:
        return out, lse
    dout = rnd(dout)
    dv = rnd(np.swapaxes(Pd, -1, -2) @ dout)
    dP = rnd(dout @ np.swapaxes(v, -1, -2)) * keep
    dS = rnd(P * (dP - (dout * out).sum(axis=-1, keepdims=True)))
    if T is not None:
        dS = rnd(dS * (1 - T * T))
    dq = rnd(rnd(dS @ k) * scale)
    dk = rnd(rnd(np.swapaxes(dS, -1, -2) @ q) * scale)
    return out, lse, tuple(reduce_to_shape(g, s) for g, s in zip((dq, dk, dv), shapes))


# -- calling the backend directly with an Extensions in normal form -------------------------------

def make_ext(batch, dtype, **kw):
    """``Extensions`` in the normal form of extensions.py for a call with batch shape ``batch``."""
    n, acc = len(batch), accumulation_dtype(dtype)
    kw = dict(kw)
    if kw.get("block_mask") is not None:
        bm = np.asarray(kw["block_mask"], dtype=bool)
        kw["block_mask"] = bm.reshape((1,) * (n + 2 - bm.ndim) + bm.shape)
    if kw.get("alibi_slopes") is not None:
        a = np.asarray(kw["alibi_slopes"]).astype(acc)
        kw["alibi_slopes"] = a.reshape((1,) * (n - a.ndim) + a.shape)
    for name in ("seqlens_q", "seqlens_k"):
        if kw.get(name) is not None:
            kw[name] = np.asarray(kw[name], dtype=np.int32)
    if kw.get("softcap") is not None:
        kw["softcap"] = float(kw["softcap"])
    return Extensions(**kw)


def _batch_dims(q, k, v):
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    n = len(batch)
    return batch, tuple(x.reshape((1,) * (n + 2 - x.ndim) + x.shape) for x in (q, k, v))


def cpu_forward(q, k, v, causal=False, scale=None, **kw):
    batch, (q, k, v) = _batch_dims(q, k, v)
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    return cpu.forward(q, k, v, causal=causal, scale=scale, batch_shape=batch,
                       ext=make_ext(batch, q.dtype, **kw))


def cpu_backward(dout, q, k, v, out, lse, causal=False, scale=None, **kw):
    shapes = (q.shape, k.shape, v.shape)
    batch, (q, k, v) = _batch_dims(q, k, v)
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    grads = cpu.backward(dout, q, k, v, out, lse, causal=causal, scale=scale, batch_shape=batch,
                         ext=make_ext(batch, q.dtype, **kw))
    return tuple(g.reshape(s) for g, s in zip(grads, shapes))


def check(q, k, v, *, causal=False, scale=None, grads=True, data_seed=0, **kw):
    """cpu forward (and backward) against the reference under the DESIGN.md rule: float64
    reference as ground truth, the reference computed naively in q's dtype for the naive error."""
    inputs = [x.copy() for x in (q, k, v)]
    p = canonical_dtype(q.dtype)
    acc = accumulation_dtype(p)
    out, lse = cpu_forward(q, k, v, causal, scale, **kw)
    assert out.dtype == p and lse.dtype == acc
    opts = dict(causal=causal, scale=scale, **kw)
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, **opts)
    naive_out = reference.attention(q, k, v, dtype=p, **opts)
    lse_acc = reference.attention(*(x.astype(acc) for x in (q, k, v)), return_lse=True, dtype=acc, **opts)[1]
    checks = [_compare("out", out, ref_out, naive_out, 2.0, ATOL[p]),
              _compare("lse", lse, ref_lse, lse_acc, 2.0, ATOL[acc])]
    if grads:
        dout = np.random.default_rng(data_seed + 1).standard_normal(out.shape).astype(p)
        g = cpu_backward(dout, q, k, v, out, lse, causal, scale, **kw)
        assert [x.shape for x in g] == [q.shape, k.shape, v.shape] and all(x.dtype == p for x in g)
        ref_g = reference.attention_backward(dout, q, k, v, **opts)
        naive_g = reference.attention_backward(dout, q, k, v, dtype=p, **opts)
        checks += [_compare(n, a, r, nv, 3.0, ATOL[p])
                   for n, a, r, nv in zip(("dq", "dk", "dv"), g, ref_g, naive_g)]
    failed = [str(c) for c in checks if not c.passed]
    assert not failed, "\n".join(failed)
    for x, x0 in zip((q, k, v), inputs):
        np.testing.assert_array_equal(x, x0)
    return out, lse


# -- configurations -------------------------------------------------------------------------------

@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles far smaller than the defaults, so that small problems span many tiles (and tile edges
    fall inside blocks, bands and lengths)."""
    monkeypatch.setattr(cpu, "EXT_BLOCK_Q", 24)
    monkeypatch.setattr(cpu, "EXT_BLOCK_K", 40)
    monkeypatch.setattr(cpu, "EXT_BWD_BLOCK_Q", 40)
    monkeypatch.setattr(cpu, "EXT_BWD_BLOCK_K", 24)
    monkeypatch.setattr(cpu, "EXT_MASKED_TILE", 32)


def feature(name, batch, Lq, Lk, rng):
    """Keywords of one feature for a call with batch shape ``batch`` (first dim = B)."""
    B = batch[0]
    if name == "dropout":
        return dict(dropout_p=0.3, seed=0x1234_5678_9ABC_DEF0 + B, offset=7)
    if name in ("block_mask", "block_mask_48x64"):
        Bq, Bk = (16, 32) if name == "block_mask" else (48, 64)
        grid = (-(-Lq // Bq), -(-Lk // Bk))
        return dict(block_size=(Bq, Bk), block_mask=rng.random(batch[-1:] + grid) < 0.6)
    if name == "window":
        return dict(window=(13, 5))
    if name == "window_left":
        return dict(window=(20, -1))
    if name == "window_right":
        return dict(window=(-1, 3))
    if name == "alibi":
        return dict(alibi_slopes=rng.uniform(0.05, 0.5, batch[1:]))
    if name == "softcap":
        return dict(softcap=1.5)
    if name == "seqlens":  # one full entry, one shorter in both
        lq, lk = [Lq, Lq // 2 + 1][:B], [Lk - Lk // 5, Lk // 3 + 1][:B]
        return dict(seqlens_q=lq + [Lq] * (B - 2), seqlens_k=lk + [Lk] * (B - 2))
    if name == "seqlens_k":
        return dict(seqlens_k=[Lk // 2 + 1] * B)
    raise KeyError(name)


def shapes(layout, Lq, Lk, D=32, Dv=24):
    """GQA broadcasting, or plain (B, H, L, D) (``bshd``: views of (B, L, H, D) arrays)."""
    if layout == "gqa":  # 2 entries, 2 kv heads, 3 query heads per kv head
        return (2, 2, 3, Lq, D), (2, 2, 1, Lk, D), (2, 2, 1, Lk, Dv)
    if layout == "b1":  # one entry of the first dim (large problems)
        return (1, 3, Lq, D), (1, 3, Lk, D), (1, 3, Lk, Dv)
    return (2, 3, Lq, D), (2, 3, Lk, D), (2, 3, Lk, Dv)


def run(names, dtype, Lq, Lk, causal=False, layout="bhsd", seed=0, grads=True, scale=None):
    storage = "bshd" if layout == "bshd" else "bhsd"
    q, k, v = make_qkv(*shapes(layout, Lq, Lk), dtype, seed=seed, layout=storage)
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    rng = np.random.default_rng(seed + 100)
    kw = {}
    for name in names:
        kw.update(feature(name, batch, Lq, Lk, rng))
    return check(q, k, v, causal=causal, scale=scale, grads=grads, data_seed=seed, **kw)


SIZES = [(65, 127), (127, 65), (1, 33), (100, 100), (17, 200), (200, 17)]
SINGLE = ["dropout", "block_mask", "block_mask_48x64", "window", "window_left", "window_right", "alibi",
          "softcap", "seqlens", "seqlens_k"]


# -- each feature alone -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", SINGLE)
def test_forward_single_feature(small_tiles, name, dtype):
    for i, (Lq, Lk) in enumerate(SIZES[:3]):
        run([name], dtype, Lq, Lk, causal=bool(i % 2), seed=i, grads=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", SINGLE)
def test_single_feature(small_tiles, name, dtype):
    """Forward and backward, one feature, sizes rotating (Lq ≠ Lk both ways, non-multiples of
    every tile), causal on and off."""
    i = SINGLE.index(name) + DTYPES.index(dtype)
    for causal in (False, True):
        Lq, Lk = SIZES[i % len(SIZES)]
        run([name], dtype, Lq, Lk, causal=causal, seed=i)


# -- features composed ----------------------------------------------------------------------------

PAIRS = [
    (("dropout",), True, "bhsd"),
    (("window", "alibi"), False, "bhsd"),
    (("softcap", "seqlens"), False, "bhsd"),
    (("block_mask",), True, "gqa"),
    (("dropout", "block_mask"), False, "bhsd"),
    (("window", "softcap"), False, "gqa"),
    (("alibi",), True, "gqa"),
    (("seqlens",), True, "bhsd"),
    (("dropout", "seqlens"), True, "gqa"),
    (("block_mask", "window"), False, "bhsd"),
    (("alibi", "softcap"), True, "bhsd"),
    (("dropout", "softcap"), False, "gqa"),
    (("window_left", "seqlens"), True, "gqa"),
    (("block_mask", "seqlens", "alibi"), False, "gqa"),
    (("dropout", "window_right", "alibi"), True, "bhsd"),
    (("dropout", "block_mask", "window", "alibi", "softcap", "seqlens"), True, "gqa"),
    (("dropout", "block_mask", "window", "alibi", "softcap", "seqlens"), False, "bhsd"),
    (("dropout", "window", "alibi", "softcap"), True, "bshd"),       # non-contiguous q, k, v
    (("block_mask_48x64", "seqlens_k"), False, "bshd"),
]


@pytest.mark.parametrize("names,causal,layout", PAIRS,
                         ids=["+".join(n) + ("+causal" if c else "") + "-" + lay for n, c, lay in PAIRS])
def test_composed(small_tiles, names, causal, layout):
    i = PAIRS.index((names, causal, layout))
    Lq, Lk = SIZES[i % len(SIZES)]
    run(names, DTYPES[i % 4], Lq, Lk, causal=causal, layout=layout, seed=i)


@pytest.mark.parametrize("dtype", [np.float16, pytest.param(DTYPES[1], marks=pytest.mark.slow),
                                   pytest.param(np.float32, marks=pytest.mark.slow), np.float64],
                         ids=DTYPE_IDS)
def test_everything_default_tiles(dtype):
    """The shipped tile sizes, several tiles each way (Lk > 2·EXT_BLOCK_K, Lq > 2·EXT_BLOCK_Q)."""
    run(("dropout", "block_mask", "window_left", "alibi", "softcap", "seqlens"), dtype, 600, 1100,
        causal=True, layout="b1", seed=3)


@pytest.mark.slow
@pytest.mark.parametrize("names", [("dropout",), ("block_mask",), ("window",), ("alibi", "softcap"),
                                   ("seqlens", "window_right")])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("Lq,Lk", [(1300, 700), (700, 1300)])
def test_large(names, dtype, Lq, Lk):
    run(names, dtype, Lq, Lk, causal=bool(Lq < Lk), layout="gqa", seed=Lq)


# -- dropout: the exact Philox mask ----------------------------------------------------------------

def test_dropout_tile_bits_equal_keep_mask():
    """Every tile of _dropout_keep (any alignment to the 8-column Philox groups) is the slice of
    philox.keep_mask (the same function the reference uses)."""
    p, seed, offset, batch = 0.37, 2**64 - 12345, 2**32 - 3, (2, 3)
    full = philox.keep_mask(p, seed, offset, batch, 50, 77)
    assert 0.55 < full.mean() < 0.71
    rng = np.random.default_rng(0)
    for _ in range(40):
        bh = int(rng.integers(6))
        i0, j0 = int(rng.integers(50)), int(rng.integers(77))
        i1, j1 = int(rng.integers(i0 + 1, 51)), int(rng.integers(j0 + 1, 78))
        tile = cpu._dropout_keep(seed, offset, bh, i0, i1, j0, j1, philox.threshold(p))
        np.testing.assert_array_equal(tile, full[np.unravel_index(bh, batch)][i0:i1, j0:j1])


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_output_is_exact_mask(small_tiles, causal):
    """With V = I the output is P̃ itself: its zeros are exactly the dropped entries of
    philox.keep_mask, and kept entries are P/(1 − p)."""
    p, Lq, Lk, batch = 0.25, 37, 70, (2, 3)
    rng = np.random.default_rng(4)
    q = rng.standard_normal(batch + (Lq, 16))
    k = rng.standard_normal(batch + (Lk, 16))
    v = np.broadcast_to(np.eye(Lk), batch + (Lk, Lk))
    kw = dict(dropout_p=p, seed=99, offset=5)
    out, lse = cpu_forward(q, k, v, causal=causal, **kw)
    keep = philox.keep_mask(p, 99, 5, batch, Lq, Lk)
    P = brute(q, k, v, causal=causal)[0]                      # undropped P (V = I)
    np.testing.assert_array_equal(out == 0, ~keep | (P == 0))
    np.testing.assert_allclose(out, P * keep / (1 - p), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(lse, brute(q, k, v, causal=causal)[1], rtol=1e-13)   # undropped lse
    out2, _ = cpu_forward(q, k, v, causal=causal, **dict(kw, offset=6))
    assert np.mean((out2 == 0) != (out == 0)) > 0.1             # another offset, another mask


# -- rows that see nothing, empty entries, what is never read --------------------------------------

def test_fully_masked_rows_and_empty_entries(small_tiles):
    """Entry 0 has no queries, entry 1 no keys, entry 2 a block-mask row of False blocks and a
    window that leaves the first rows (Lq > Lk, causal) without keys: out 0, lse -inf, zero grads."""
    Lq, Lk, batch = 70, 45, (3, 2)
    q, k, v = make_qkv(batch + (Lq, 16), batch + (Lk, 16), batch + (Lk, 8), np.float32, seed=8)
    mask = np.ones(batch + (-(-Lq // 16), -(-Lk // 16)), dtype=bool)
    mask[2, :, 1] = False                                          # rows 16..31 of entry 2
    kw = dict(seqlens_q=[0, Lq, Lq], seqlens_k=[Lk, 0, Lk], block_mask=mask, block_size=(16, 16),
              window=(4, 2))
    out, lse = check(q, k, v, causal=True, **kw)
    assert np.all(out[:2] == 0) and np.all(np.isneginf(lse[:2]))
    assert np.all(out[2, :, 16:32] == 0) and np.all(np.isneginf(lse[2, :, 16:32]))
    assert np.all(np.isneginf(lse[2, :, :Lq - Lk - 4])) and np.all(np.isfinite(lse[2, :, 32:]))
    dq, dk, dv = cpu_backward(np.ones_like(out), q, k, v, out, lse, causal=True, **kw)
    assert not dq[:2].any() and not dk[:2].any() and not dv[:2].any()
    assert not dq[2, :, 16:32].any() and dq[2, :, 32:].all(axis=-1).any()


def _poison(x, region):
    y = x.copy()
    y[region] = np.nan
    return y


@pytest.mark.parametrize("causal", [False, True])
def test_invisible_tiles_are_never_read(small_tiles, causal):
    """NaN wherever nothing may be read — rows ≥ Lq_b (q, dout, out, lse), keys ≥ Lk_b, a key-block
    column the block mask hides from every row, key tiles wholly outside the window band — and
    every result is bitwise the same as with clean inputs (a read would spread the NaN)."""
    Lq, Lk, batch = 50, 130, (2, 3)
    q, k, v = make_qkv(batch + (Lq, 16), batch + (Lk, 16), batch + (Lk, 8), np.float64, seed=9)
    mask = np.ones(batch[1:] + (-(-Lq // 16), -(-Lk // 32)), dtype=bool)
    mask[:, :, 2] = False                                          # keys 64..95, every row
    mask[1, 0, 3] = False
    # entry 0: off = 120 - 50, window rows see keys >= i + off - 10 >= 60: keys < 32 (whole tiles)
    kw = dict(seqlens_q=[50, 30], seqlens_k=[120, 100], block_mask=mask, block_size=(16, 32),
              window=(10, 20))
    unread_k = [(0, slice(None), slice(120, None)), (1, slice(None), slice(100, None)),
                (slice(None), slice(None), slice(64, 96)), (0, slice(None), slice(0, 32))]
    unread_q = [(1, slice(None), slice(30, None))]
    kp, vp, qp = k, v, q
    for r in unread_k:
        kp, vp = _poison(kp, r), _poison(vp, r)
    for r in unread_q:
        qp = _poison(qp, r)
    out, lse = cpu_forward(q, k, v, causal, **kw)
    out_p, lse_p = cpu_forward(qp, kp, vp, causal, **kw)
    np.testing.assert_array_equal(out_p, out)
    np.testing.assert_array_equal(lse_p, lse)
    dout = np.random.default_rng(1).standard_normal(out.shape)
    grads = cpu_backward(dout, q, k, v, out, lse, causal, **kw)
    dout_p, outp, lsep = dout, out, lse
    for r in unread_q:
        dout_p, outp, lsep = _poison(dout_p, r), _poison(outp, r), _poison(lsep, r)
    grads_p = cpu_backward(dout_p, qp, kp, vp, outp, lsep, causal, **kw)
    for g, gp in zip(grads, grads_p):
        np.testing.assert_array_equal(gp, g)
    for r in unread_k:
        assert not grads[1][r].any() and not grads[2][r].any()
    check(q, k, v, causal=causal, **kw)                            # and the clean call is right


def test_thread_count_does_not_change_results(monkeypatch):
    q, k, v = make_qkv((3, 2, 300, 32), (3, 1, 700, 32), (3, 1, 700, 16), np.float32, seed=5)
    kw = dict(dropout_p=0.1, seed=3, window=(200, 50), alibi_slopes=np.array([0.1, 0.2]),
              softcap=3.0, seqlens_q=[300, 250, 10], seqlens_k=[700, 400, 699])
    results = []
    for n in ("1", "2", "3"):
        monkeypatch.setenv("FLASHARRAY_CPU_THREADS", n)
        out, lse = cpu_forward(q, k, v, True, **kw)
        results.append((out, lse) + cpu_backward(np.ones_like(out), q, k, v, out, lse, True, **kw))
    for r in results[1:]:
        for a, b in zip(results[0], r):
            np.testing.assert_array_equal(a, b)


def test_brute_backward_matches_finite_differences():
    """The test's own statement of the backward (every feature at once) is the derivative of its
    forward: central differences in float64."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal(s) for s in ((2, 2, 6, 3), (2, 1, 9, 3), (2, 1, 9, 2)))
    mask = np.array([[True, True, False], [False, True, True]])
    kw = dict(dropout_p=0.3, seed=11, window=(3, 1), alibi_slopes=np.array([0.3, 0.7]), softcap=0.8,
              seqlens_q=[6, 4], seqlens_k=[8, 9], block_mask=mask, block_size=(4, 3))
    dout = rng.standard_normal((2, 2, 6, 2))
    _, _, grads = brute(q, k, v, causal=True, dout=dout, **kw)
    assert all(np.abs(g).max() > 0.05 for g in grads)
    for x, g in zip((q, k, v), grads):
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            old = x[idx]
            x[idx] = old + 1e-6
            fp = np.sum(dout * brute(q, k, v, causal=True, **kw)[0])
            x[idx] = old - 1e-6
            fm = np.sum(dout * brute(q, k, v, causal=True, **kw)[0])
            x[idx] = old
            num[idx] = (fp - fm) / 2e-6
        np.testing.assert_allclose(g, num, rtol=1e-6, atol=1e-8)


def test_no_feature_takes_the_dense_path():
    """An Extensions with every keyword at its default is a dense call: bitwise the dense result."""
    q, k, v = make_qkv((2, 70, 16), (2, 90, 16), (2, 90, 8), np.float32, seed=6)
    dense = cpu.forward(q, k, v, causal=True, scale=0.25, batch_shape=(2,))
    ext = cpu.forward(q, k, v, causal=True, scale=0.25, batch_shape=(2,), ext=Extensions())
    for a, b in zip(dense, ext):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("causal", [False, True])
def test_brute_agrees_with_reference(causal):
    """Two independent statements of docs/extensions.md (every feature at once) give one function."""
    q, k, v = make_qkv(*shapes("gqa", 45, 70), np.float64, seed=12)
    rng = np.random.default_rng(13)
    kw = {}
    for name in ("dropout", "block_mask", "window", "alibi", "softcap", "seqlens"):
        kw.update(feature(name, (2, 2, 3), 45, 70, rng))
    dout = rng.standard_normal((2, 2, 3, 45, 24))
    out, lse, grads = brute(q, k, v, causal=causal, dout=dout, **kw)
    ref_out, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True, **kw)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)
    for g, r in zip(grads, reference.attention_backward(dout, q, k, v, causal=causal, **kw)):
        np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-13)


# -- through the public api ------------------------------------------------------------------------

@pytest.mark.parametrize("names,causal", [(("window", "alibi", "dropout"), True),
                                          (("softcap", "seqlens", "block_mask"), False)])
@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["fp16", "fp32"])
def test_public_api(names, causal, dtype):
    """flash_attention_forward / _backward / _vjp with backend="cpu" and the keywords as a user
    writes them (alibi (H,), lists for window, block mask without batch dims)."""
    q, k, v = make_qkv(*shapes("gqa", 90, 150), dtype, seed=21)
    rng = np.random.default_rng(22)
    kw = {}
    for name in names:
        kw.update(feature(name, (2, 2, 3), 90, 150, rng))
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = kw["alibi_slopes"][0].astype(np.float32)      # (3,): per query head
    if "seqlens_q" in kw:
        kw.update({n: np.array(kw[n], np.int32) for n in ("seqlens_q", "seqlens_k")})
    if "block_mask" in kw:
        kw["block_mask"] = kw["block_mask"][0]
    out, lse = fa.flash_attention_forward(q, k, v, causal=causal, backend="cpu", **kw)
    dout = rng.standard_normal(out.shape).astype(dtype)
    grads = fa.flash_attention_backward(dout, q, k, v, out, lse, causal=causal, backend="cpu", **kw)
    out2, vjp = fa.flash_attention_vjp(q, k, v, causal=causal, backend="cpu", **kw)
    np.testing.assert_array_equal(out2, out)
    for a, b in zip(vjp(dout), grads):
        np.testing.assert_array_equal(a, b)
    direct = cpu_forward(q, k, v, causal, **kw)
    np.testing.assert_array_equal(direct[0], out)
    np.testing.assert_array_equal(direct[1], lse)
    for a, b in zip(cpu_backward(dout, q, k, v, out, lse, causal, **kw), grads):
        np.testing.assert_array_equal(a, b)
    check(q, k, v, causal=causal, data_seed=0, **kw)


@pytest.mark.parametrize("causal", [False, True])
def test_no_batch_dims(causal):
    """q (Lq, D), k, v (Lk, ·): one entry, bh = 0."""
    q, k, v = make_qkv((300, 40), (530, 40), (530, 24), np.float32, seed=30)
    mask = np.random.default_rng(31).random((3, 5)) < 0.7
    check(q, k, v, causal=causal, dropout_p=0.15, seed=77, window=(100, 40), softcap=4.0,
          alibi_slopes=np.float32(0.05), block_mask=mask)


@pytest.mark.parametrize("order", ["growing", "shrinking"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["fp32", "fp64"])
def test_large_scores_exercise_rescaling_without_overflow(order, dtype):
    """Scores that grow (or shrink) by hundreds across key tiles force the lazy reference m_i to
    move (see test_cpu.py's twin for why float32 is checked at scale 1/4)."""
    Lq, Lk, D = 40, 1800, 16
    rng = np.random.default_rng(12)
    q = rng.standard_normal((2, Lq, D)).astype(dtype)
    ramp = np.linspace(0.1, 12.0, Lk)[:, None]
    k = (rng.standard_normal((2, Lk, D)) * (ramp if order == "growing" else ramp[::-1])).astype(dtype)
    v = rng.standard_normal((2, Lk, 8)).astype(dtype)
    kw = dict(window=(1500, -1), alibi_slopes=np.array([0.001, 0.01]), seqlens_k=[1790, 1500],
              dropout_p=0.1, seed=5)
    with np.errstate(over="raise"):
        out, lse = cpu_forward(q, k, v, False, 1.0, **kw)
        grads = cpu_backward(np.ones_like(out), q, k, v, out, lse, False, 1.0, **kw)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse)) and all(np.isfinite(g).all() for g in grads)
    check(q, k, v, scale=0.25 if dtype == np.float32 else 1.0, **kw)


def test_peak_memory_is_far_below_lq_lk():
    """The extension path allocates tiles, never anything Lq×Lk (tracemalloc sees NumPy buffers)."""
    import tracemalloc
    L, D = 8192, 32
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, L, D), dtype=np.float32) for _ in range(3))
    kw = dict(dropout_p=0.1, seed=1, window=(700, 300), alibi_slopes=np.array([0.01, 0.02]),
              softcap=5.0, seqlens_k=[L - 5])
    tracemalloc.start()
    try:
        out, lse = cpu_forward(q, k, v, True, **kw)
        cpu_backward(out, q, k, v, out, lse, True, **kw)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < L * L * 4 / 8, "peak %.1f MiB" % (peak / 2**20)   # one float32 Lq×Lk: 256 MiB


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["fp16", "fp32"])
def test_steep_alibi_keeps_lse_accurate(dtype):
    """ALiBi over 1300 keys: a row's first key tile scores around −500 and its last around 0, so
    the reference m_i moves by hundreds; the scores must still be shifted by one subtraction
    (shifting them reference after reference lost ulp(500) ≈ 3e-5 in float32: lse errors of
    5e-6 against a naive error of 3e-7)."""
    q, k, v = make_qkv((1, 3, 64, 32), (1, 3, 1300, 32), (1, 3, 1300, 24), dtype, seed=1)
    check(q, k, v, causal=True, alibi_slopes=np.linspace(0.05, 0.5, 3), softcap=1.5)
