"""The reference's extension keywords (docs/extensions.md) against an independent statement of the
specification: a per-element Python loop (``brute``), and its backward against central finite
differences in float64 for each feature and for combinations."""
import numpy as np
import pytest

from flasharray import reference
from flasharray._private import philox

from conftest import requires_gpu

SEED = 0x0123_4567_89AB_CDEF


def _keep(p, seed, offset, bh, i, j):
    """The dropout decision for one entry, straight from the words of Philox4x32-10."""
    words = philox.philox4x32((j >> 3, i, bh, offset), (seed & 0xFFFFFFFF, seed >> 32))
    value = (int(words[(j & 7) >> 1]) >> (16 * (j & 1))) & 0xFFFF
    return value >= min(int(round(p * 65536)), 65535)


def _visible(i, j, off, b, causal, kw):
    if causal and j > i + off:
        return False
    if kw.get("window") is not None:
        left, right = kw["window"]
        if (left >= 0 and j < i + off - left) or (right >= 0 and j > i + off + right):
            return False
    if kw.get("block_mask") is not None:
        Bq, Bk = kw.get("block_size", (128, 128))
        bm = np.broadcast_to(kw["block_mask"], kw["_batch"] + kw["block_mask"].shape[-2:])
        if not bm[b][i // Bq, j // Bk]:
            return False
    return True


def _score(qi, kj, i, j, off, b, scale, kw):
    s = scale * float(np.dot(qi, kj))
    if kw.get("softcap") is not None:
        s = kw["softcap"] * np.tanh(s / kw["softcap"])
    if kw.get("alibi_slopes") is not None:
        slopes = np.broadcast_to(kw["alibi_slopes"], kw["_batch"])
        s -= float(slopes[b]) * abs(i + off - j)
    return s


def brute(q, k, v, causal=False, scale=None, **kw):
    """out, lse of docs/extensions.md, one entry, row and key at a time (float64)."""
    batch = tuple(np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    kw["_batch"] = batch
    Lq, Lk, Dv = q.shape[-2], k.shape[-2], v.shape[-1]
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    qb, kb, vb = (np.broadcast_to(x, batch + x.shape[-2:]).astype(np.float64) for x in (q, k, v))
    out, lse = np.zeros(batch + (Lq, Dv)), np.full(batch + (Lq,), -np.inf)
    p = kw.get("dropout_p", 0.0)
    for bh, b in enumerate(np.ndindex(*batch)):
        Lq_b = Lq if kw.get("seqlens_q") is None else int(kw["seqlens_q"][b[0]])
        Lk_b = Lk if kw.get("seqlens_k") is None else int(kw["seqlens_k"][b[0]])
        off = Lk_b - Lq_b
        for i in range(Lq_b):
            s = {j: _score(qb[b][i], kb[b][j], i, j, off, b, scale, kw)
                 for j in range(Lk_b) if _visible(i, j, off, b, causal, kw)}
            if not s:
                continue
            lse[b][i] = np.log(sum(np.exp(x) for x in s.values()))
            for j, x in s.items():
                P = np.exp(x - lse[b][i])
                if p > 0:
                    P = P / (1 - p) if _keep(p, kw["seed"], kw.get("offset", 0), bh, i, j) else 0.0
                out[b][i] += P * vb[b][j]
    return out, lse


def _qkv(shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s) for s in shapes]


B, H = 2, 3
SHAPES = ((B, H, 7, 5), (B, H, 9, 5), (B, H, 9, 4))
BM = np.random.default_rng(5).random((B, H, 2, 3)) < 0.6           # tiles of 4 x 3 on 7 x 9
CASES = {
    "dropout": dict(dropout_p=0.3, seed=SEED, offset=11),
    "block_mask": dict(block_mask=BM, block_size=(4, 3)),
    "block_mask_broadcast": dict(block_mask=BM[:1, :1], block_size=(4, 3)),
    "window": dict(window=(2, 1)),
    "window_left": dict(window=(0, -1)),
    "window_right": dict(window=(-1, 0)),
    "alibi_h": dict(alibi_slopes=np.array([0.5, 0.25, 0.125])),
    "alibi_bh": dict(alibi_slopes=np.arange(B * H, dtype=np.float32).reshape(B, H) / 8),
    "softcap": dict(softcap=1.5),
    "seqlens_q": dict(seqlens_q=np.array([7, 3], np.int32)),
    "seqlens_k": dict(seqlens_k=np.array([0, 5], np.int32)),
    "seqlens": dict(seqlens_q=np.array([2, 7], np.int32), seqlens_k=np.array([9, 4], np.int32)),
    "window+alibi+softcap": dict(window=(3, 0), alibi_slopes=np.array([0.3, 0.2, 0.1]), softcap=2.0),
    "dropout+seqlens+block_mask": dict(dropout_p=0.5, seed=7, seqlens_q=np.array([5, 6], np.int32),
                                       seqlens_k=np.array([9, 2], np.int32), block_mask=BM, block_size=(4, 3)),
    "everything": dict(dropout_p=0.2, seed=3, offset=1, window=(4, 2), alibi_slopes=np.array([0.1, 0.2, 0.3]),
                       softcap=3.0, seqlens_q=np.array([6, 7], np.int32), seqlens_k=np.array([8, 9], np.int32),
                       block_mask=BM[:, :1], block_size=(4, 3)),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", list(CASES))
def test_forward_matches_brute_force(name, causal):
    q, k, v = _qkv(SHAPES, seed=1)
    kw = CASES[name]
    out, lse = reference.attention(q, k, v, causal=causal, scale=0.6, return_lse=True, **kw)
    out_b, lse_b = brute(q, k, v, causal=causal, scale=0.6, **dict(kw))
    np.testing.assert_allclose(out, out_b, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_b))
    np.testing.assert_allclose(lse[np.isfinite(lse_b)], lse_b[np.isfinite(lse_b)], rtol=1e-12, atol=1e-12)


def test_forward_matches_brute_force_gqa_broadcast():
    """GQA by broadcasting: q (B, Hk, G, L, D) against k, v (B, Hk, 1, L, D); bh over (B, Hk, G)."""
    q, k, v = _qkv(((2, 2, 2, 6, 4), (2, 2, 1, 8, 4), (2, 2, 1, 8, 3)), seed=2)
    kw = dict(dropout_p=0.4, seed=99, window=(3, 3), alibi_slopes=np.array([[0.1], [0.2]]),
              seqlens_k=np.array([8, 5], np.int32), causal=True)
    out, lse = reference.attention(q, k, v, return_lse=True, **kw)
    causal = kw.pop("causal")
    out_b, lse_b = brute(q, k, v, causal=causal, **dict(kw))
    np.testing.assert_allclose(out, out_b, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_b, rtol=1e-12, atol=1e-12)


def _numeric_grads(f, arrays, eps=1e-6):
    grads = []
    for a in arrays:
        g = np.zeros_like(a)
        for idx in np.ndindex(*a.shape):
            old = a[idx]
            a[idx] = old + eps
            fp = f()
            a[idx] = old - eps
            fm = f()
            a[idx] = old
            g[idx] = (fp - fm) / (2 * eps)
        grads.append(g)
    return grads


SMALL = ((2, 2, 5, 3), (2, 2, 6, 3), (2, 2, 6, 2))
BM_SMALL = np.array([[True, False], [True, True]])                  # tiles of 3 x 3 on 5 x 6
GRAD_CASES = {
    "dropout": dict(dropout_p=0.4, seed=5, offset=2),
    "block_mask": dict(block_mask=BM_SMALL, block_size=(3, 3)),
    "window": dict(window=(1, 1)),
    "alibi": dict(alibi_slopes=np.array([0.7, 0.3])),
    "softcap": dict(softcap=0.8),
    "seqlens": dict(seqlens_q=np.array([3, 5], np.int32), seqlens_k=np.array([6, 2], np.int32)),
    "dropout+softcap": dict(dropout_p=0.3, seed=1, softcap=1.2),
    "window+alibi+seqlens": dict(window=(2, 0), alibi_slopes=np.array([0.2, 0.4]),
                                 seqlens_q=np.array([4, 5], np.int32), seqlens_k=np.array([5, 3], np.int32)),
    "everything": dict(dropout_p=0.25, seed=8, block_mask=BM_SMALL, block_size=(3, 3), window=(3, 1),
                       alibi_slopes=np.array([0.5, 0.1]), softcap=2.0, seqlens_k=np.array([6, 4], np.int32)),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_backward_matches_finite_differences(name, causal):
    q, k, v = _qkv(SMALL, seed=3)
    kw = GRAD_CASES[name]
    dout = np.random.default_rng(4).standard_normal(SMALL[0][:-1] + (2,))

    def loss():
        return float((reference.attention(q, k, v, causal=causal, scale=0.9, **kw) * dout).sum())

    expected = _numeric_grads(loss, [q, k, v])
    actual = reference.attention_backward(dout, q, k, v, causal=causal, scale=0.9, **kw)
    for a, e, x in zip(actual, expected, (q, k, v)):
        assert a.shape == x.shape and a.dtype == np.float64
        np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-8)


def test_backward_gqa_broadcast_finite_differences():
    q, k, v = _qkv(((1, 2, 2, 4, 3), (1, 2, 1, 5, 3), (1, 2, 1, 5, 2)), seed=6)
    kw = dict(dropout_p=0.3, seed=12, softcap=1.0, alibi_slopes=np.array([[0.3], [0.6]]), causal=True)
    dout = np.random.default_rng(7).standard_normal((1, 2, 2, 4, 2))
    expected = _numeric_grads(lambda: float((reference.attention(q, k, v, **kw) * dout).sum()), [q, k, v])
    for a, e in zip(reference.attention_backward(dout, q, k, v, **kw), expected):
        np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-8)


def test_padding_is_never_read_and_gets_zero_gradients():
    q, k, v = _qkv(SMALL, seed=8)
    kw = dict(seqlens_q=np.array([3, 5], np.int32), seqlens_k=np.array([6, 2], np.int32))
    q[0, :, 3:], k[1, :, 2:], v[1, :, 2:] = np.nan, np.inf, np.nan     # garbage in the padding
    out, lse = reference.attention(q, k, v, return_lse=True, **kw)
    assert np.isfinite(out).all()
    assert np.all(out[0, :, 3:] == 0) and np.all(np.isneginf(lse[0, :, 3:])) and np.isfinite(lse[1]).all()
    dout = np.ones(out.shape)
    dq, dk, dv = reference.attention_backward(dout, q, k, v, **kw)
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    assert np.all(dq[0, :, 3:] == 0) and np.all(dk[1, :, 2:] == 0) and np.all(dv[1, :, 2:] == 0)
    clean = [x.copy() for x in (q, k, v)]
    for x in clean:
        x[~np.isfinite(x)] = 0
    np.testing.assert_array_equal(out, reference.attention(*clean, **kw))


@pytest.mark.parametrize("case", ["block_mask", "window", "seqlens_k=0"])
def test_rows_that_see_no_key(case):
    q, k, v = _qkv(((2, 24, 4), (2, 20, 4), (2, 20, 3)), seed=9)
    blind = np.zeros((2, 24), bool)                                   # the rows that must see nothing
    if case == "block_mask":
        kw = dict(block_mask=np.array([[False, False], [True, True]]), block_size=(16, 16))
        blind[:, :16] = True
    elif case == "window":
        kw = dict(window=(0, 0), causal=True)                         # row i sees only key i - 4
        blind[:, :4] = True
    else:
        kw = dict(seqlens_k=np.array([0, 20], np.int32))
        blind[0] = True
    out, lse = reference.attention(q, k, v, return_lse=True, **kw)
    assert np.all(out[blind] == 0) and np.all(np.isneginf(lse[blind]))
    assert np.isfinite(lse[~blind]).all() and np.abs(out[~blind]).sum(-1).min() > 0
    dq, dk, dv = reference.attention_backward(np.ones(out.shape), q, k, v, **kw)
    assert np.all(dq[blind] == 0) and np.isfinite(dq).all()
    if case == "seqlens_k=0":
        assert np.all(dk[0] == 0) and np.all(dv[0] == 0)


def test_dropout_applies_exactly_the_dropout_mask():
    q, k, v = _qkv(((2, 3, 20, 8), (2, 3, 33, 8), (2, 3, 33, 5)), seed=11)
    p, seed, offset = 0.35, 2 ** 40 + 17, 123
    out, lse = reference.attention(q, k, v, causal=True, return_lse=True, dropout_p=p, seed=seed, offset=offset)
    ref, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_array_equal(lse, ref_lse)                      # lse of the undropped scores
    S = q @ np.swapaxes(k, -1, -2) / np.sqrt(8)
    S = np.where(reference.causal_mask(20, 33), S, -np.inf)
    P = np.exp(S - ref_lse[..., None])
    keep = reference.dropout_mask((2, 3), 20, 33, p, seed, offset)
    np.testing.assert_allclose(out, (P * keep / (1 - p)) @ v, rtol=1e-12, atol=1e-12)
    other = reference.attention(q, k, v, causal=True, dropout_p=p, seed=seed, offset=offset + 1)
    assert not np.allclose(out, other)


def test_block_size_default_is_128():
    q, k, v = _qkv(((130, 4), (300, 4), (300, 2)), seed=12)
    bm = np.array([[True, False, True], [False, True, True]])
    out = reference.attention(q[None], k[None], v[None], block_mask=bm)
    np.testing.assert_allclose(out, brute(q[None], k[None], v[None], block_mask=bm)[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_naive_precision_mode_with_extensions(dtype):
    q, k, v = (x.astype(dtype) for x in _qkv(((2, 2, 40, 16), (2, 2, 50, 16), (2, 2, 50, 16)), seed=13))
    kw = dict(dropout_p=0.2, seed=4, window=(9, 3), alibi_slopes=np.array([0.1, 0.05], np.float32), softcap=2.5,
              seqlens_q=np.array([40, 30], np.int32), seqlens_k=np.array([50, 45], np.int32), causal=True)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
    naive, naive_lse = reference.attention(q, k, v, return_lse=True, dtype=dtype, **kw)
    assert naive.dtype == dtype and naive_lse.dtype == np.float32
    err = np.abs(naive.astype(np.float64) - ref).max()
    assert 0 < err < (1e-2 if dtype == np.float16 else 1e-5)
    np.testing.assert_array_equal(np.isneginf(naive_lse), np.isneginf(ref_lse))
    dout = np.ones(ref.shape, dtype)
    g64 = reference.attention_backward(dout, q, k, v, **kw)
    gp = reference.attention_backward(dout, q, k, v, dtype=dtype, **kw)
    for a, b in zip(gp, g64):
        assert a.dtype == dtype
        rel = np.abs(a.astype(np.float64) - b).max() / np.abs(b).max()
        assert 0 < rel < (2e-2 if dtype == np.float16 else 1e-5)


def test_reference_rejects_misuse():
    q, k, v = _qkv(((2, 4, 3), (2, 5, 3), (2, 5, 3)))
    with pytest.raises(TypeError, match="dropout"):
        reference.attention(q, k, v, dropout=0.1)
    with pytest.raises(ValueError, match="seed"):
        reference.attention(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="block_mask"):
        reference.attention(q, k, v, block_mask=np.ones((2, 2), bool), block_size=(16, 16))
    with pytest.raises(ValueError, match="batch dim"):
        reference.attention(q[0], k[0], v[0], seqlens_q=np.array([4], np.int32))


def test_dense_path_unchanged():
    """No keyword: bit-identical to the textbook formula (the extension code adds nothing)."""
    q, k, v = _qkv(((3, 6, 4), (3, 9, 4), (3, 9, 2)), seed=14)
    S = np.where(reference.causal_mask(6, 9), q @ np.swapaxes(k, -1, -2) * 0.5, -np.inf)
    P = np.exp(S - S.max(-1, keepdims=True))
    np.testing.assert_allclose(reference.attention(q, k, v, causal=True, scale=0.5),
                               (P / P.sum(-1, keepdims=True)) @ v, rtol=1e-13)


@requires_gpu
def test_cupy_arrays():
    import cupy
    q, k, v = _qkv(SHAPES, seed=15)
    kw = CASES["everything"]
    out, lse = reference.attention(q, k, v, causal=True, return_lse=True, **kw)
    ckw = {n: cupy.asarray(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}
    cq, ck, cv = (cupy.asarray(x) for x in (q, k, v))
    cout, clse = reference.attention(cq, ck, cv, causal=True, return_lse=True, **ckw)
    np.testing.assert_allclose(cout.get(), out, rtol=1e-12, atol=1e-12)
    grads = reference.attention_backward(cupy.asarray(np.ones(out.shape)), cq, ck, cv, causal=True, **ckw)
    for g, e in zip(grads, reference.attention_backward(np.ones(out.shape), q, k, v, causal=True, **kw)):
        np.testing.assert_allclose(g.get(), e, rtol=1e-12, atol=1e-12)
