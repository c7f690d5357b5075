"""The extensions of docs/extensions.md in the CUDA forward kernels (flash_fwd.cu, flash_fwd_simt.cu).

Every case runs the real kernels on the CPU emulator (and, marked ``gpu``, the same bodies on a GPU
through CuPy) and checks out and lse with the DESIGN.md rule against a brute-force NumPy version of
the specification written here (``brute``: materialized S and P, every intermediate rounded to the
precision p for the naive error), independent of ``flasharray.reference``; where the reference
takes the extension keywords it is checked to agree with ``brute`` in float64.

Default run: every feature alone and in pairs on the tensor-core kernel (fp16/bf16) and the SIMT
kernel (fp32/fp64, and the fp16 fallback), awkward sizes (Lq != Lk both ways, not multiples of the
tiles, D = 40 / 59), fully masked rows, GQA broadcasting, strided views, split-KV, > 3 batch dims;
the dropout mask equal to ``philox.keep_mask`` bit for bit; K/V bytes falling with block-mask
density and window width (emulator counters); schedules; one plan for many seeds / offsets /
arrays. ``-m slow``: every pair of features × dtype × causal.
"""
import itertools

import numpy as np
import pytest

from flasharray import reference
from flasharray import testing as fa_testing
from flasharray._private import cuda_forward, philox
from flasharray._private.dtypes import ATOL, accumulation_dtype, bfloat16, canonical_dtype
from flasharray._private.extensions import Extensions

from conftest import gpu_available, thin

DTYPES = {"fp16": np.float16, "bf16": bfloat16, "fp32": np.float32, "fp64": np.float64}
requires_gpu = pytest.mark.skipif(not gpu_available(), reason="no CUDA device visible to CuPy")


# ---- the specification, brute force ------------------------------------------------------------------

def _round(x, p):
    acc = accumulation_dtype(p)
    return x.astype(acc) if p == acc else x.astype(p).astype(acc)


def brute(q, k, v, causal, scale, p, kw):
    """out, lse of docs/extensions.md on materialized matrices, every step rounded to ``p``
    (float64: the ground truth). ``kw``: the extension keywords in their normal forms."""
    acc = accumulation_dtype(p)
    q, k, v = (_round(np.asarray(a), p) for a in (q, k, v))
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    Lq, Lk = q.shape[-2], k.shape[-2]
    i, j = np.arange(Lq)[:, None], np.arange(Lk)[None, :]
    ones = (1,) * len(batch)
    lq = np.full(batch[:1], Lq) if kw.get("seqlens_q") is None else np.asarray(kw["seqlens_q"])
    lk = np.full(batch[:1], Lk) if kw.get("seqlens_k") is None else np.asarray(kw["seqlens_k"])
    lq, lk = lq.reshape(lq.shape + ones[1:] + (1, 1)), lk.reshape(lk.shape + ones[1:] + (1, 1))
    diag = i + (lk - lq)
    visible = (i < lq) & (j < lk)
    if causal:
        visible = visible & (j <= diag)
    if kw.get("window") is not None:
        left, right = kw["window"]
        visible = visible & ((left < 0) | (j >= diag - left)) & ((right < 0) | (j <= diag + right))
    if kw.get("block_mask") is not None:
        Bq, Bk = kw["block_size"]
        visible = visible & kw["block_mask"][..., i // Bq, j // Bk]
    S = _round(_round(q @ np.swapaxes(k, -1, -2), p) * scale, p)
    if kw.get("softcap") is not None:
        S = _round(_round(np.tanh(S / kw["softcap"]), p) * kw["softcap"], p)
    if kw.get("alibi_slopes") is not None:
        S = _round(S - np.asarray(kw["alibi_slopes"], acc)[..., None, None] * np.abs(diag - j), p)
    S = np.where(np.broadcast_to(visible, S.shape), S, -np.inf)
    m = S.max(axis=-1, keepdims=True)
    m = np.where(np.isneginf(m), 0.0, m)
    E = np.exp(S - m)
    l = E.sum(axis=-1, keepdims=True)
    P = _round(E / np.where(l == 0, 1.0, l), p)
    if kw.get("dropout_p", 0.0) > 0:
        keep = philox.keep_mask(kw["dropout_p"], kw["seed"], kw.get("offset", 0), tuple(batch), Lq, Lk)
        P = _round(np.where(keep, P / (1.0 - kw["dropout_p"]), 0.0), p)
    out = _round(P @ v, p)
    with np.errstate(divide="ignore"):
        lse = (m + np.log(l))[..., 0]
    rows = np.broadcast_to(i < lq, lse.shape + (1,))[..., 0]
    return np.where(rows[..., None], out, 0.0), np.where(rows, lse, -np.inf)


def check_close(out, lse, q, k, v, causal, scale, kw):
    """The DESIGN.md rule for out and lse against ``brute`` (and brute against the reference)."""
    p = canonical_dtype(q.dtype)
    acc = accumulation_dtype(p)
    ref_out, ref_lse = brute(q, k, v, causal, scale, np.dtype(np.float64), kw)
    naive_out, _ = brute(q, k, v, causal, scale, p, kw)
    _, acc_lse = brute(q, k, v, causal, scale, np.dtype(acc), kw)
    checks = [fa_testing._compare("out", out, ref_out, naive_out, 2.0, ATOL[p]),
              fa_testing._compare("lse", lse, ref_lse, acc_lse, 2.0, ATOL[acc])]
    assert all(c.passed for c in checks), "\n".join(str(c) for c in checks)
    _agrees_with_reference(ref_out, ref_lse, q, k, v, causal, scale, kw)


def _agrees_with_reference(ref_out, ref_lse, q, k, v, causal, scale, kw):
    try:
        r_out, r_lse = reference.attention(q, k, v, causal=causal, scale=scale, return_lse=True, **kw)
    except TypeError:  # a reference without the extension keywords
        return
    np.testing.assert_allclose(r_out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(r_lse, ref_lse, rtol=1e-12, atol=1e-12)


# ---- inputs --------------------------------------------------------------------------------------------

def make_inputs(dtype, D, Lq, Lk, batch=(2, 3), gqa=False, layout="bhsd", seed=0):
    rng = np.random.default_rng(seed)
    kb = batch[:-1] + (1,) if gqa else batch

    def one(b, L, d):
        if layout == "bshd":
            return np.swapaxes(rng.standard_normal(b[:-1] + (L, b[-1], d)).astype(dtype), -2, -3)
        return rng.standard_normal(b + (L, d)).astype(dtype)

    return one(batch, Lq, D), one(kb, Lk, D), one(kb, Lk, D)


def ext_kw(features, batch, Lq, Lk, dtype, seed=1):
    """Extension keywords in their normal forms (extensions.py) for ``features``."""
    rng = np.random.default_rng(seed)
    acc = accumulation_dtype(canonical_dtype(dtype))
    n = len(batch)
    kw = {}
    for f in features:
        if f == "window":
            kw["window"] = (int(rng.integers(0, 40)), int(rng.integers(-1, 20)))
        elif f == "softcap":
            kw["softcap"] = 1.5
        elif f == "alibi":
            kw["alibi_slopes"] = (rng.random(batch[-1:]) * 0.5).astype(acc)[(None,) * (n - 1)]
        elif f == "seqlens":
            kw["seqlens_q"] = rng.integers(0, Lq + 1, batch[0]).astype(np.int32)
            kw["seqlens_k"] = rng.integers(0, Lk + 1, batch[0]).astype(np.int32)
            kw["seqlens_q"][0], kw["seqlens_k"][-1] = Lq, Lk  # one entry with the full lengths
        elif f == "block_mask":
            bs = (16, 32)
            grid = (-(-Lq // bs[0]), -(-Lk // bs[1]))
            bm = rng.random(batch + grid) < 0.6
            bm[..., 1, :] = False  # a block row that sees nothing: fully masked rows
            kw["block_mask"], kw["block_size"] = bm, bs
        elif f == "dropout":
            kw.update(dropout_p=0.25, seed=int(rng.integers(0, 2 ** 63)) * 2 + 1, offset=int(rng.integers(0, 2 ** 32)))
        else:
            raise ValueError(f)
    return kw


def _ieee(dtype):
    """float32 runs precision="ieee" here (the SIMT kernel this file tests, with the fp16/bf16
    tensor-core kernel); its sm_80+ default, 3xtf32, is tests/test_cuda_forward_tf32.py's."""
    return {"precision": "ieee"} if np.dtype(dtype) == np.float32 else {}


def run(device, q, k, v, causal, kw, scale=None, **opts):
    opts = {**_ieee(q.dtype), **opts}
    batch = tuple(np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    ext = Extensions(**kw)
    if device == "cuda":
        import cupy
        q, k, v = (cupy.asarray(x) for x in (q, k, v))
        ext = Extensions(**{n: (cupy.asarray(a) if isinstance(a, np.ndarray) else a) for n, a in kw.items()})
    out, lse = cuda_forward.forward(q, k, v, causal=causal, scale=scale, batch_shape=batch, device=device,
                                    ext=ext, **opts)
    if device == "cuda":
        out, lse = out.get(), lse.get()
    return out, lse, scale


def check_case(device, dt, D, Lq, Lk, causal, features, *, gqa=False, layout="bhsd", batch=(2, 3), **opts):
    dtype = DTYPES[dt]
    q, k, v = make_inputs(dtype, D, Lq, Lk, batch=batch, gqa=gqa, layout=layout)
    kw = ext_kw(features, batch, Lq, Lk, dtype)
    copies = [a.copy() for a in (q, k, v)]
    out, lse, scale = run(device, q, k, v, causal, kw, **opts)
    assert out.shape == batch + (Lq, D) and out.dtype == q.dtype
    assert lse.dtype == accumulation_dtype(canonical_dtype(dtype))
    check_close(out, lse, q, k, v, causal, scale, kw)
    for a, b in zip((q, k, v), copies):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


# ---- the default cases: (dtype, D, Lq, Lk, causal, features, options) --------------------------------
CASES = [
    # tensor cores, one feature each
    ("fp16", 64, 70, 133, False, ("window",), {}),
    ("fp16", 64, 133, 70, True, ("window",), {}),
    ("fp16", 64, 70, 133, False, ("seqlens",), {}),
    ("fp16", 59, 70, 133, False, ("softcap",), {}),
    ("fp16", 64, 70, 133, True, ("alibi",), {"layout": "bshd"}),
    ("fp16", 64, 70, 133, False, ("block_mask",), {}),
    ("fp16", 64, 70, 133, True, ("dropout",), {}),
    # tensor cores, pairs and more
    ("bf16", 64, 70, 133, False, ("dropout", "block_mask"), {}),
    ("bf16", 40, 133, 70, False, ("window", "alibi"), {}),
    ("fp16", 64, 133, 70, True, ("softcap", "seqlens"), {}),
    ("fp16", 64, 70, 133, True, ("block_mask",), {"batch": (2, 2)}),
    ("fp16", 64, 70, 133, True, ("window", "seqlens", "dropout"), {}),
    ("fp16", 64, 70, 133, True, ("window", "alibi", "softcap", "block_mask", "dropout", "seqlens"), {}),
    ("fp16", 64, 17, 257, False, ("window", "seqlens", "dropout", "block_mask"), {"num_splits": 3}),
    ("fp16", 64, 33, 70, False, ("alibi", "dropout"), {"gqa": True}),
    ("fp16", 32, 33, 47, True, ("dropout", "alibi"), {"batch": (2, 1, 2, 2)}),
    # SIMT: fp32, fp64, the fp16 fallback
    ("fp32", 64, 70, 133, False, ("window", "alibi"), {}),
    ("fp32", 59, 133, 70, True, ("softcap", "seqlens"), {"layout": "bshd"}),
    ("fp32", 64, 70, 133, True, ("block_mask", "dropout"), {}),
    ("fp32", 64, 70, 133, True, ("window", "alibi", "softcap", "block_mask", "dropout", "seqlens"), {}),
    ("fp64", 40, 70, 133, False, ("window", "alibi", "softcap", "block_mask", "dropout", "seqlens"), {}),
    ("fp64", 64, 133, 70, True, ("dropout", "window"), {"gqa": True}),
    ("fp16", 64, 70, 133, True, ("window", "alibi", "softcap", "block_mask", "dropout", "seqlens"),
     {"kernel": "simt"}),
]


def _id(case):
    dt, D, Lq, Lk, causal, features, opts = case
    extra = "".join("-%s%s" % (k, "" if v is True else v) for k, v in sorted(opts.items()))
    return "%s-d%d-%dx%d%s-%s%s" % (dt, D, Lq, Lk, "-causal" if causal else "", "+".join(features), extra)


@pytest.mark.parametrize("case", thin(CASES), ids=[_id(c) for c in CASES])
def test_extensions_emulator(case):
    dt, D, Lq, Lk, causal, features, opts = case
    check_case("emulator", dt, D, Lq, Lk, causal, features, **opts)


@pytest.mark.parametrize("arch,D,features", [(86, 96, ("window", "softcap", "dropout")),
                                              (80, 128, ("alibi", "seqlens", "block_mask"))])
def test_extensions_on_two_blocks_per_sm(arch, D, features):
    """Extension calls above d 64 take the single-buffered square tile where only it lets two blocks share an SM
    (tiles.TWO_BLOCKS_MAX_HEAD_DIM; sm_86/89 at d 80-112, sm_80 at d 128): the rule, and the same bits under a
    reverse schedule. At d <= 64 and on sm_75 the extensions' tiles stay as they were."""
    from flasharray._private import tiles
    assert tiles.forward_tile("float16", D, D, arch, ext=True).stages == 1
    assert tiles.forward_tile("float16", D, D, arch).stages == 1 or arch == 80   # sm_80 d 128 dense: 128 x 64
    assert tiles.forward_tile("float16", 64, 64, 86, ext=True).stages == 2       # the one-slab tile: two fit
    assert tiles.forward_tile("float16", 80, 80, 75, ext=True).stages == 2
    assert tiles.forward_tile("float16", D, D, 90, ext=True).stages == 2         # two double-buffered fit
    check_case("emulator", "fp16", D, 70, 133, True, features, arch=arch)
    q, k, v = make_inputs(np.float16, D, 70, 133, batch=(2, 3))
    kw = ext_kw(features, (2, 3), 70, 133, np.float16)
    a = run("emulator", q, k, v, True, kw, arch=arch)
    b = run("emulator", q, k, v, True, kw, arch=arch, schedule="reverse")
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


@pytest.mark.parametrize("dt,kernel", [("fp16", None), ("bf16", None), ("fp32", None), ("fp64", None)])
def test_fully_masked_rows(dt, kernel):
    """Rows that see no key (window (0, 0) above the diagonal with Lq > Lk; seqlens_q = 0; an all-False
    block row) are out 0, lse -inf; no NaN anywhere."""
    dtype = DTYPES[dt]
    batch, Lq, Lk = (2, 2), 50, 20
    q, k, v = make_inputs(dtype, 32, Lq, Lk, batch=batch)
    bm = np.ones(batch + (4, 2), bool)
    bm[..., 2, :] = False
    kw = dict(window=(0, 0), seqlens_q=np.array([0, 41], np.int32), seqlens_k=np.array([20, 11], np.int32),
              block_mask=bm, block_size=(16, 16))
    out, lse, scale = run("emulator", q, k, v, True, kw, kernel=kernel)
    assert not np.isnan(out.astype(np.float64)).any() and not np.isnan(lse).any()
    assert np.all(out[0] == 0) and np.all(np.isneginf(lse[0]))
    assert np.all(out[1, :, 32:48] == 0) and np.all(np.isneginf(lse[1, :, 32:48]))
    check_close(out, lse, q, k, v, True, scale, kw)


# ---- dropout: the exact Philox bits ----------------------------------------------------------------------

@pytest.mark.parametrize("dt,kernel", [("fp16", None), ("bf16", None), ("fp32", None), ("fp64", None),
                                       ("fp16", "simt")])
def test_dropout_mask_is_philox(dt, kernel):
    check_dropout_is_philox(dt, kernel=kernel)


def check_dropout_is_philox(dt, Lq=70, **opts):
    """q = 0 (uniform P over the keys) and v = identity: out[i, j] = keep_ij / ((1 − p)·Lk), so the
    kept entries are exactly out != 0 — compared with philox.keep_mask bit for bit (``opts``: the
    forward's kernel options)."""
    dtype = DTYPES[dt]
    batch, Lk = (2, 3), 45
    q = np.zeros(batch + (Lq, 48), dtype)
    k = np.zeros(batch + (Lk, 48), dtype)
    v = np.broadcast_to(np.eye(Lk, 48, dtype=dtype), batch + (Lk, 48))
    p, seed, offset = 0.375, 0x123456789ABCDEF0, 41
    out, lse, _ = run("emulator", q, k, v, False, dict(dropout_p=p, seed=seed, offset=offset), **opts)
    keep = philox.keep_mask(p, seed, offset, batch, Lq, Lk)
    np.testing.assert_array_equal(out[..., :Lk] != 0, keep)
    assert np.all(out[..., Lk:] == 0)
    kept = out[..., :Lk][keep].astype(np.float64)
    np.testing.assert_allclose(kept, 1.0 / ((1 - p) * Lk), rtol=1e-2 if np.dtype(dtype).itemsize == 2 else 1e-6)
    np.testing.assert_allclose(lse, np.log(Lk), rtol=1e-6)


def test_one_plan_many_calls():
    """A cached plan takes seed, offset and the arrays per call: new values give new results, equal
    values give bit-identical results."""
    q, k, v = make_inputs(np.float16, 64, 40, 90, batch=(2, 2))
    kw = ext_kw(("dropout", "block_mask", "alibi", "seqlens"), (2, 2), 40, 90, np.float16)
    out1, lse1, scale = run("emulator", q, k, v, True, kw)
    kw2 = dict(kw, seed=kw["seed"] + 2, offset=kw["offset"] ^ 5, block_mask=~kw["block_mask"],
               alibi_slopes=kw["alibi_slopes"] * 2, seqlens_q=kw["seqlens_q"][::-1].copy())
    out2, lse2, _ = run("emulator", q, k, v, True, kw2)
    n_plans = len(cuda_forward._PLANS)
    check_close(out2, lse2, q, k, v, True, scale, kw2)
    out3, lse3, _ = run("emulator", q, k, v, True, kw)
    assert len(cuda_forward._PLANS) == n_plans
    np.testing.assert_array_equal(out1, out3)
    np.testing.assert_array_equal(lse1, lse3)


@pytest.mark.parametrize("schedule", ["reverse", "random"])
def test_schedules_bit_identical(schedule):
    q, k, v = make_inputs(np.float16, 64, 70, 133, batch=(1, 2))
    kw = ext_kw(("dropout", "block_mask", "window", "softcap"), (1, 2), 70, 133, np.float16)
    base, _, _ = run("emulator", q, k, v, True, kw)
    other, _, _ = run("emulator", q, k, v, True, kw, schedule=schedule, seed=3)
    np.testing.assert_array_equal(base, other)


# ---- tile skipping: K/V bytes (emulator counters) --------------------------------------------------------

def _kv_bytes(q, k, v, kw, causal=False):
    counters = []
    batch = q.shape[:-2]
    cuda_forward.forward(q, k, v, causal=causal, scale=0.1, batch_shape=batch, device="emulator",
                         ext=Extensions(**kw), counters=counters, num_splits=1,  # one launch: no combine
                         **_ieee(q.dtype))
    return sum(c.buffers[i].read_bytes for c in counters for i in (1, 2) if i in c.buffers)


def _tile(dtype=np.float16, D=64):
    return cuda_forward.kernel_for(dtype, D, ext=True)


@pytest.mark.parametrize("dt", ["fp16", "fp32"])
def test_block_mask_skips_tiles(dt):
    """K/V bytes read = (query tiles × key tiles whose blocks are not all False) × tile bytes, exactly:
    they fall with the density of the block mask."""
    dtype = DTYPES[dt]
    tile = _tile(dtype)
    Lq, Lk = 2 * tile.block_m, 4 * tile.block_n
    q, k, v = make_inputs(dtype, 64, Lq, Lk, batch=(1, 1))
    bs = (tile.block_m, tile.block_n)
    rng = np.random.default_rng(5)
    seen = []
    for density in (1.0, 0.5, 0.25, 0.0):
        bm = rng.random((1, 1, 2, 4)) < density
        got = _kv_bytes(q, k, v, dict(block_mask=bm, block_size=bs))
        assert got == int(bm.sum()) * tile.block_n * 64 * 2 * np.dtype(dtype).itemsize
        seen.append(got)
    assert seen[0] > seen[-1] == 0


@pytest.mark.parametrize("dt", ["fp16", "fp32"])
def test_window_skips_tiles(dt):
    """A narrow window reads only the key tiles of its band: bytes = Σ over query tiles of the tiles
    overlapping [m0 + off − left, last row + off + right], fewer as the window narrows."""
    dtype = DTYPES[dt]
    tile = _tile(dtype)
    Lq = Lk = 4 * tile.block_m
    q, k, v = make_inputs(dtype, 64, Lq, Lk, batch=(1, 1))
    seen = []
    for left, right in ((-1, -1), (3 * tile.block_n, 0), (tile.block_n, 8), (0, 0)):
        tiles_read = 0
        for m0 in range(0, Lq, tile.block_m):
            last = m0 + tile.block_m - 1
            lo = 0 if left < 0 else max(0, m0 - left) // tile.block_n
            hi = -(-Lk // tile.block_n) if right < 0 else -(-min(Lk, last + right + 1) // tile.block_n)
            tiles_read += hi - lo
        got = _kv_bytes(q, k, v, dict(window=(left, right)))
        assert got == tiles_read * tile.block_n * 64 * 2 * np.dtype(dtype).itemsize
        seen.append(got)
    assert seen == sorted(seen, reverse=True) and seen[-1] < seen[0] / 3


def test_seqlens_k_reads_only_valid_keys():
    """Keys at or past seqlens_k are never read: K/V bytes follow the entries' lengths."""
    tile = _tile()
    q, k, v = make_inputs(np.float16, 64, 20, 4 * tile.block_n, batch=(3, 1))
    lens = np.array([0, tile.block_n + 1, 4 * tile.block_n], np.int32)
    got = _kv_bytes(q, k, v, dict(seqlens_k=lens))
    assert got == int(lens.sum()) * 64 * 2 * 2


# ---- the full matrix (-m slow) ---------------------------------------------------------------------------
FEATURES = ("window", "alibi", "softcap", "block_mask", "dropout", "seqlens")
SLOW = [(dt, pair, causal) for dt in DTYPES for pair in itertools.combinations(FEATURES, 2) for causal in (False, True)]


@pytest.mark.slow
@pytest.mark.parametrize("dt,pair,causal", SLOW, ids=["%s-%s%s" % (d, "+".join(p), "-causal" if c else "")
                                                        for d, p, c in SLOW])
def test_extension_pairs_full(dt, pair, causal):
    check_case("emulator", dt, 59 if dt in ("fp16", "fp32") else 64, 97, 161, causal, pair)


# ---- GPU: the same bodies ---------------------------------------------------------------------------------

@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_extensions_gpu(case):
    dt, D, Lq, Lk, causal, features, opts = case
    check_case("cuda", dt, D, Lq, Lk, causal, features, **opts)


# ---- the device="cuda" host path, against a CuPy stand-in ---------------------------------------------

@pytest.mark.parametrize("dt", ["fp16", "fp32"])
def test_cupy_launch_path_with_fake_cupy(monkeypatch, dt):
    """The CUDA code path with extensions (device addresses for the extension arrays and the dense
    dummies, per-call seed/offset scalars, the kExt name expression) end to end against the CuPy
    stand-in of tests/test_cuda_forward.py, backed by the emulator."""
    import sys
    from flasharray._private import launch
    from test_cuda_forward import _fake_cupy
    log, arrays = [], []
    cupy = _fake_cupy(log, arrays)

    def full(shape, fill, dtype):
        arrays.append(np.full(shape, fill, dtype))
        return arrays[-1]

    cupy.full = full
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(launch.CupyLauncher, "_modules", {})
    monkeypatch.setattr(launch, "_launchers", {})
    dtype = DTYPES[dt]
    batch, Lq, Lk = (2, 3), 70, 133
    q, k, v = make_inputs(dtype, 64, Lq, Lk, batch=batch)
    kw = ext_kw(("window", "alibi", "softcap", "block_mask", "dropout", "seqlens"), batch, Lq, Lk, dtype)
    kw["seqlens_k"] = None  # the plan's own array of Lk stands in
    arrays += [q, k, v] + [a for a in kw.values() if isinstance(a, np.ndarray)]
    scale = 0.125
    for seed, offset in ((1, 0), (7, 3)):  # one plan: the per-call seed and offset slots rewritten
        kw.update(seed=seed, offset=offset)
        call = dict(causal=True, scale=scale, batch_shape=batch, ext=Extensions(**kw), **_ieee(dtype))
        out, lse = cuda_forward.forward(q, k, v, device="cuda", **call)
        check_close(out, lse, q, k, v, True, scale, kw)
        ref_out, ref_lse = cuda_forward.forward(q, k, v, device="emulator", **call)  # argument tuples
        assert out.tobytes() == ref_out.tobytes() and lse.tobytes() == ref_lse.tobytes()
    assert log and all(name.endswith(", 63>") for name, _, _ in log)
    assert cupy.driver_launches == [name for name, _, _ in log]


@pytest.mark.parametrize("dt", ["fp16", "fp32"])
def test_host_loops_over_batch_dims(dt):
    """Slopes varying along batch dims 1 and 3 keep the 4 batch dims from merging into 3: the outer
    dim becomes a host loop, so each launch's entry (seqlens), slope and dropout bh start at its
    own base (bh_base)."""
    dtype = DTYPES[dt]
    batch, Lq, Lk = (2, 2, 2, 2), 33, 47
    q, k, v = make_inputs(dtype, 32, Lq, Lk, batch=batch)
    kw = ext_kw(("dropout", "seqlens"), batch, Lq, Lk, dtype)
    kw["alibi_slopes"] = (np.arange(4).reshape(1, 2, 1, 2) * 0.1 + 0.05).astype(accumulation_dtype(canonical_dtype(dtype)))
    from flasharray._private import launch
    stand = [launch.stand_in(batch, np.int8)] + [launch.stand_in(kw["alibi_slopes"].shape, np.float32,
                                                                  kw["alibi_slopes"].strides)]
    stand.append(launch.stand_in((2, 1, 1, 1), np.int32, (4, 0, 0, 0)))
    assert len(launch.batch_layout(batch, stand)) > 1  # the case really loops on the host
    out, lse, scale = run("emulator", q, k, v, True, kw)
    check_close(out, lse, q, k, v, True, scale, kw)
