"""The extension keywords at the public API (docs/extensions.md): validation with clear errors,
inputs untouched, the ``ext`` handed to the backends (none for a dense call), the call cache
(seed, offset and array contents taken at every call), vjp, empty problems, and results against
the reference on every backend that implements a feature (the others must say they do not)."""
import numpy as np
import pytest

import flasharray as fa
from flasharray import reference
from flasharray._private import api, cpu, validation
from flasharray._private.dtypes import ATOL
from flasharray._private.extensions import Extensions, from_options, options_key
from flasharray.testing import _compare

rng = np.random.default_rng(0)
Q = rng.standard_normal((2, 3, 5, 8)).astype(np.float32)
K = rng.standard_normal((2, 3, 7, 8)).astype(np.float32)
V = rng.standard_normal((2, 3, 7, 4)).astype(np.float32)
OUT, LSE = fa.flash_attention_forward(Q, K, V)
DOUT = np.ones_like(OUT)
I32 = np.int32


class _FakeCupy:
    """Looks like a cupy.ndarray to the type checks (no GPU here): tests the library-mixing check."""
    def __init__(self, a):
        self.a, self.dtype, self.shape, self.ndim, self.strides = a, a.dtype, a.shape, a.ndim, a.strides


_FakeCupy.__module__, _FakeCupy.__name__ = "cupy._core.core", "ndarray"

F = fa.flash_attention
B = fa.flash_attention_backward
# (function, keywords, exception, words the message must contain)
BAD = [
    (F, {"dropout_p": 1.0, "seed": 1}, ValueError, ["dropout_p", "1.0", "[0, 1)"]),
    (F, {"dropout_p": -0.1, "seed": 1}, ValueError, ["dropout_p", "-0.1"]),
    (F, {"dropout_p": float("nan"), "seed": 1}, ValueError, ["dropout_p", "nan"]),
    (F, {"dropout_p": "0.1", "seed": 1}, TypeError, ["dropout_p", "'0.1'"]),
    (F, {"dropout_p": True, "seed": 1}, TypeError, ["dropout_p", "True"]),
    (F, {"dropout_p": 0.1}, ValueError, ["dropout_p=0.1", "seed"]),
    (F, {"dropout_p": 0.1, "seed": -1}, ValueError, ["seed", "-1"]),
    (F, {"dropout_p": 0.1, "seed": 2 ** 64}, ValueError, ["seed", str(2 ** 64)]),
    (F, {"dropout_p": 0.1, "seed": 1.5}, TypeError, ["seed", "1.5"]),
    (F, {"dropout_p": 0.1, "seed": 1, "offset": -1}, ValueError, ["offset", "-1"]),
    (F, {"dropout_p": 0.1, "seed": 1, "offset": 2 ** 32}, ValueError, ["offset", str(2 ** 32)]),
    (F, {"dropout_p": 0.1, "seed": 1, "offset": "3"}, TypeError, ["offset", "'3'"]),
    (F, {"seed": "x"}, TypeError, ["seed", "'x'"]),
    (F, {"window": (-2, 0)}, ValueError, ["window", "(-2, 0)"]),
    (F, {"window": (1.5, 0)}, TypeError, ["window", "(1.5, 0)"]),
    (F, {"window": 5}, TypeError, ["window", "5"]),
    (F, {"window": (1, 2, 3)}, TypeError, ["window", "(1, 2, 3)"]),
    (F, {"window": (True, 1)}, TypeError, ["window", "True"]),
    (F, {"softcap": 0.0}, ValueError, ["softcap", "0.0"]),
    (F, {"softcap": -1}, ValueError, ["softcap", "-1"]),
    (F, {"softcap": float("inf")}, ValueError, ["softcap", "inf"]),
    (F, {"softcap": "1"}, TypeError, ["softcap", "'1'"]),
    (F, {"block_size": (8, 16)}, ValueError, ["block_size", "(8, 16)", "multiples of 16"]),
    (F, {"block_size": (0, 16)}, ValueError, ["block_size", "(0, 16)"]),
    (F, {"block_size": 16}, TypeError, ["block_size", "16"]),
    (F, {"block_mask": np.ones((1, 2), bool)}, ValueError, ["block_mask", "(1, 2)", "(..., 1, 1)"]),
    (F, {"block_mask": np.ones((2, 1), bool), "block_size": (16, 16)}, ValueError, ["block_mask", "(2, 1)", "(..., 1, 1)"]),
    (F, {"block_mask": np.ones((1, 1), np.int8)}, TypeError, ["block_mask", "int8"]),
    (F, {"block_mask": [[True]]}, TypeError, ["block_mask", "list"]),
    (F, {"block_mask": np.ones((2, 1, 1), bool)}, ValueError, ["block_mask", "(2, 1, 1)", "(2, 3)"]),
    (F, {"block_mask": np.ones((1, 2, 3, 1, 1), bool)}, ValueError, ["block_mask", "(1, 2, 3, 1, 1)"]),
    (F, {"block_mask": np.ones(1, bool)}, ValueError, ["block_mask", "(1,)"]),
    (F, {"alibi_slopes": np.ones(4, np.float32)}, ValueError, ["alibi_slopes", "(4,)", "(2, 3)"]),
    (F, {"alibi_slopes": np.ones(3, np.int32)}, TypeError, ["alibi_slopes", "int32"]),
    (F, {"alibi_slopes": [0.1, 0.2, 0.3]}, TypeError, ["alibi_slopes", "list"]),
    (F, {"alibi_slopes": _FakeCupy(np.ones(3, np.float32))}, TypeError, ["alibi_slopes", "NumPy and CuPy"]),
    (F, {"seqlens_q": np.array([5, 5], np.int64)}, TypeError, ["seqlens_q", "int64"]),
    (F, {"seqlens_q": np.array([5, 5, 5], I32)}, ValueError, ["seqlens_q", "(2,)", "(3,)"]),
    (F, {"seqlens_q": np.array([[5], [5]], I32)}, ValueError, ["seqlens_q", "(2, 1)"]),
    (F, {"seqlens_q": np.array([5, 6], I32)}, ValueError, ["seqlens_q", "[0, 5]", "6"]),
    (F, {"seqlens_q": np.array([-1, 5], I32)}, ValueError, ["seqlens_q", "-1"]),
    (F, {"seqlens_k": np.array([8, 1], I32)}, ValueError, ["seqlens_k", "[0, 7]", "8"]),
    (F, {"seqlens_k": [7, 7]}, TypeError, ["seqlens_k", "list"]),
    (F, {"seqlens_k": _FakeCupy(np.array([7, 7], I32))}, TypeError, ["seqlens_k", "NumPy and CuPy"]),
    (F, {"dropout": 0.1}, TypeError, ["dropout"]),
    (B, {"dropout_p": 0.1}, ValueError, ["dropout_p=0.1", "seed"]),
    (B, {"window": (0, -3)}, ValueError, ["window", "(0, -3)"]),
    (B, {"seqlens_k": np.array([8, 1], I32)}, ValueError, ["seqlens_k", "8"]),
    (B, {"block_mask": np.ones((1, 1), np.float32)}, TypeError, ["block_mask", "float32"]),
]


def _call(fn, kwargs):
    if fn is F:
        return F(Q, K, V, **kwargs)
    return B(DOUT, Q, K, V, OUT, LSE, **kwargs)


@pytest.mark.parametrize("backend", ["cpu", "emulator"])
@pytest.mark.parametrize("fn,kwargs,exc,words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_keyword_raises_clear_error_and_leaves_inputs_alone(fn, kwargs, exc, words, backend):
    arrays = [Q, K, V, OUT, LSE, DOUT] + [x for x in kwargs.values() if isinstance(x, np.ndarray)]
    before = [a.copy() for a in arrays]
    with pytest.raises(exc) as info:
        _call(fn, dict(kwargs, backend=backend))
    msg = str(info.value)
    for w in words:
        assert w in msg, "%r not in message %r" % (w, msg)
    for a, b in zip(arrays, before):
        np.testing.assert_array_equal(a, b)


def test_seqlens_need_a_batch_dim():
    with pytest.raises(ValueError, match="seqlens_q.*batch dim"):
        F(Q[0, 0], K[0, 0], V[0, 0], seqlens_q=np.array([5], I32))


def test_validation_runs_again_on_a_cached_signature():
    """seed, offset and seqlens values are not in the cache key: a cached call still checks them."""
    F(Q, K, V, dropout_p=0.1, seed=1, seqlens_q=np.array([5, 2], I32), backend="cpu")
    for kwargs, word in (({"seed": -1}, "seed"), ({"seed": 1, "offset": -5}, "offset"),
                         ({"seed": 1, "seqlens_q": np.array([5, 9], I32)}, "seqlens_q")):
        kw = dict(dropout_p=0.1, seqlens_q=np.array([5, 2], I32), backend="cpu")
        kw.update(kwargs)
        with pytest.raises(ValueError, match=word):
            F(Q, K, V, **kw)


# -- what the backends receive ----------------------------------------------------------------------

def test_normal_forms():
    ext = from_options({"dropout_p": 0.25, "seed": np.uint64(5), "window": [3, -1], "softcap": 2,
                        "alibi_slopes": np.ones(3, np.float64), "block_mask": np.ones((1, 1), bool),
                        "block_size": [16, 32], "seqlens_k": np.array([7, 0], I32)},
                       kind="numpy", batch_shape=(2, 3), Lq=5, Lk=7, acc=np.dtype(np.float32))
    assert isinstance(ext, Extensions)
    assert ext.dropout_p == 0.25 and type(ext.seed) is int and ext.offset == 0
    assert ext.window == (3, -1) and type(ext.window[0]) is int
    assert ext.softcap == 2.0 and type(ext.softcap) is float and ext.block_size == (16, 32)
    assert ext.alibi_slopes.dtype == np.float32 and ext.alibi_slopes.shape == (1, 3)
    assert ext.block_mask.shape == (1, 1, 1, 1)
    assert ext.features() == ("dropout", "block_mask", "window", "alibi", "softcap", "seqlens")
    assert "dropout_p=0.25" in repr(ext) and "seqlens_k=numpy.ndarray of shape (2,)" in repr(ext)


def test_block_mask_is_a_view_and_float64_slopes_stay():
    bm = np.ones((3, 1, 1), bool)
    ext = from_options({"block_mask": bm, "alibi_slopes": np.ones((2, 1))}, kind="numpy", batch_shape=(2, 3),
                       Lq=5, Lk=7, acc=np.dtype(np.float64))
    assert ext.block_mask.shape == (1, 3, 1, 1) and np.shares_memory(ext.block_mask, bm)
    assert ext.alibi_slopes.dtype == np.float64 and ext.alibi_slopes.shape == (2, 1)


@pytest.mark.parametrize("kwargs", [{}, {"dropout_p": 0.0}, {"dropout_p": 0.0, "seed": 3, "offset": 4},
                                    {"window": (-1, -1)}, {"block_size": (64, 64)}])
def test_defaults_mean_no_extensions(kwargs):
    assert from_options(kwargs, kind="numpy", batch_shape=(2,), Lq=3, Lk=3, acc=np.dtype(np.float32)) is None


def _recorder(monkeypatch, name, takes_ext):
    """Replace cpu.<name> by a recorder (with or without an ``ext`` parameter) around the original."""
    original = getattr(cpu, name)
    calls = []
    if takes_ext:
        def fake(*args, ext=None, **kwargs):
            calls.append(ext)
            return original(*args, ext=ext, **kwargs)
    else:
        def fake(*args, **kwargs):
            calls.append("no ext keyword")
            return original(*args, **kwargs)
    monkeypatch.setattr(cpu, name, fake)
    api._clear_cache()
    return calls


@pytest.mark.parametrize("kwargs", [{}, {"dropout_p": 0.0, "seed": 1}, {"window": (-1, -1)}])
def test_dense_calls_reach_the_backend_without_ext(monkeypatch, kwargs):
    """A backend that knows nothing of ``ext`` keeps working for every call with default keywords."""
    fwd, bwd = _recorder(monkeypatch, "forward", False), _recorder(monkeypatch, "backward", False)
    out, lse = fa.flash_attention_forward(Q, K, V, backend="cpu", **kwargs)
    fa.flash_attention_backward(DOUT, Q, K, V, out, lse, backend="cpu", **kwargs)
    assert fwd == ["no ext keyword"] and bwd == ["no ext keyword"]
    np.testing.assert_array_equal(out, OUT)


def test_backend_without_ext_raises_not_implemented(monkeypatch):
    _recorder(monkeypatch, "forward", False)
    with pytest.raises(NotImplementedError, match=r"window, softcap not implemented yet on backend='cpu'"):
        fa.flash_attention(Q, K, V, window=(1, 1), softcap=3.0, backend="cpu")
    out, lse = fa.flash_attention_forward(Q, K, V, backend="cpu")   # the dense call still works
    np.testing.assert_array_equal(out, OUT)


def test_backend_gets_the_validated_extensions(monkeypatch):
    calls = _recorder(monkeypatch, "forward", True)
    bm = np.ones((1, 1), bool)
    fa.flash_attention(Q, K, V, window=[2, 0], block_mask=bm, dropout_p=0.5, seed=9, offset=3, backend="cpu")
    ext = calls[-1]
    assert isinstance(ext, Extensions) and ext.window == (2, 0) and ext.seed == 9 and ext.offset == 3
    assert ext.block_mask.shape == (1, 1, 1, 1) and np.shares_memory(ext.block_mask, bm)


# -- the call cache --------------------------------------------------------------------------------

def test_cache_keys_on_the_static_part_only(monkeypatch):
    api._clear_cache()
    calls = _recorder(monkeypatch, "forward", True)
    kw = dict(dropout_p=0.3, backend="cpu", seqlens_k=np.array([7, 4], I32))
    outs = [fa.flash_attention(Q, K, V, seed=s, offset=o, **kw) for s, o in ((1, 0), (2, 0), (2, 1))]
    assert len(api._CACHE) == 1                       # one entry: seed/offset/contents not in the key
    assert [(e.seed, e.offset) for e in calls] == [(1, 0), (2, 0), (2, 1)]
    assert not np.array_equal(outs[0], outs[1]) and not np.array_equal(outs[1], outs[2])
    monkeypatch.setattr(validation, "check_qkv", lambda *a: pytest.fail("cached call re-validated q, k, v"))
    again = fa.flash_attention(Q, K, V, seed=2, offset=1, **kw)
    np.testing.assert_array_equal(again, outs[2])
    other = fa.flash_attention(Q, K, V, seed=2, offset=1, **dict(kw, seqlens_k=np.array([7, 2], I32)))
    assert calls[-1].seqlens_k.tolist() == [7, 2] and not np.array_equal(other, again)


def test_static_changes_get_their_own_entry():
    api._clear_cache()
    base = dict(backend="cpu", seed=1)
    for kw in ({"dropout_p": 0.1}, {"dropout_p": 0.2}, {"window": (1, 1)}, {"window": (2, 1)},
               {"softcap": 1.0}, {"alibi_slopes": np.ones(3, np.float32)}, {"alibi_slopes": np.ones((2, 3), np.float32)}):
        fa.flash_attention(Q, K, V, **base, **kw)
    assert len(api._CACHE) == 7


def test_options_key_leaves_out_per_call_values():
    a = options_key({"dropout_p": 0.1, "seed": 1, "offset": 2, "seqlens_q": np.array([1, 2], I32)})
    b = options_key({"dropout_p": 0.1, "seed": 5, "offset": 0, "seqlens_q": np.array([3, 4], I32)})
    c = options_key({"dropout_p": 0.1, "seed": 5, "seqlens_q": np.array([3, 4, 5], I32)[:2]})
    assert a == b and hash(a) == hash(b) and a != options_key({"dropout_p": 0.2, "seed": 1})
    assert c == a    # same dtype, shape and strides
    assert options_key({"window": (1, 2)}) != options_key({"window": [1, 2]})   # types enter the key


# -- results ---------------------------------------------------------------------------------------

def _check(out, lse, q, k, v, kw, dout=None, grads=None):
    """The DESIGN.md rule against the reference with the same keywords."""
    p = q.dtype
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
    naive, naive_lse = reference.attention(q, k, v, return_lse=True, dtype=p, **kw)
    checks = [_compare("out", out, ref, naive, 2.0, ATOL[p]), _compare("lse", lse, ref_lse, naive_lse, 2.0, ATOL[p])]
    if grads is not None:
        ref_g = reference.attention_backward(dout, q, k, v, **kw)
        naive_g = reference.attention_backward(dout, q, k, v, dtype=p, **kw)
        checks += [_compare(n, g, r, m, 3.0, ATOL[p]) for n, g, r, m in zip(("dq", "dk", "dv"), grads, ref_g, naive_g)]
    bad = [str(c) for c in checks if not c.passed]
    assert not bad, "\n".join(bad)


FEATURES = {
    "dropout": dict(dropout_p=0.2, seed=2 ** 33 + 5, offset=7),
    "block_mask": dict(block_mask=np.array([[True, False, True], [False, True, True], [True, True, False]]),
                       block_size=(16, 32)),
    "window": dict(window=(20, 5)),
    "alibi": dict(alibi_slopes=np.array([0.05, 0.1], np.float32)),
    "softcap": dict(softcap=4.0),
    "seqlens": dict(seqlens_q=np.array([40, 17], I32), seqlens_k=np.array([70, 0], I32)),
    "all": dict(dropout_p=0.1, seed=1, window=(30, 3), alibi_slopes=np.array([0.05, 0.1], np.float32),
                softcap=5.0, seqlens_q=np.array([33, 40], I32), seqlens_k=np.array([65, 50], I32),
                block_mask=np.array([[True, True, False], [True, True, True], [False, True, True]]),
                block_size=(16, 32)),
}


@pytest.mark.parametrize("backend", ["cpu", "emulator"])
@pytest.mark.parametrize("name", list(FEATURES))
def test_backend_matches_reference_or_says_not_implemented(name, backend):
    """Whichever backends implement a feature must match the reference; the others must refuse
    with NotImplementedError naming the backend (never a silently dense result)."""
    q, k, v = (np.random.default_rng(s).standard_normal(sh).astype(np.float32)
               for s, sh in ((1, (2, 2, 40, 32)), (2, (2, 2, 70, 32)), (3, (2, 2, 70, 16))))
    kw = dict(FEATURES[name], causal=True)
    dout = np.random.default_rng(4).standard_normal((2, 2, 40, 16)).astype(np.float32)
    try:
        out, lse = fa.flash_attention_forward(q, k, v, backend=backend, **kw)
    except NotImplementedError as e:
        assert "not implemented yet on backend=%r" % backend in str(e) or backend in str(e), str(e)
        return
    try:
        grads = fa.flash_attention_backward(dout, q, k, v, out, lse, backend=backend, **kw)
    except NotImplementedError as e:
        assert backend in str(e), str(e)
        grads = None
    _check(out, lse, q, k, v, kw, dout, grads)


@pytest.mark.parametrize("backend", ["cpu", "emulator"])
def test_vjp_passes_the_keywords(backend):
    q, k, v = (np.random.default_rng(s).standard_normal((2, 3, 24, 16)).astype(np.float32) for s in (5, 6, 7))
    kw = dict(dropout_p=0.3, seed=11, offset=2, window=(8, 0), softcap=3.0, alibi_slopes=np.full(3, 0.1, np.float32))
    try:
        out, vjp = fa.flash_attention_vjp(q, k, v, backend=backend, **kw)
        dout = np.random.default_rng(8).standard_normal(out.shape).astype(np.float32)
        grads = vjp(dout)
    except NotImplementedError as e:
        assert backend in str(e)
        return
    out2, lse2 = fa.flash_attention_forward(q, k, v, backend=backend, **kw)
    np.testing.assert_array_equal(out, out2)
    for g, e in zip(grads, fa.flash_attention_backward(dout, q, k, v, out2, lse2, backend=backend, **kw)):
        np.testing.assert_array_equal(g, e)
    _check(out, lse2, q, k, v, kw, dout, grads)
    dense = fa.flash_attention_backward(dout, q, k, v, out2, lse2, backend=backend)
    assert not np.allclose(grads[0], dense[0])    # the keywords did reach the backward


@pytest.mark.parametrize("backend", ["cpu", "emulator"])
@pytest.mark.parametrize("shapes", [((2, 0, 8), (2, 7, 8), (2, 7, 4)), ((2, 5, 8), (2, 0, 8), (2, 0, 4))],
                         ids=["Lq=0", "Lk=0"])
def test_empty_problems_with_extensions(shapes, backend):
    q, k, v = (np.ones(s, np.float32) for s in shapes)
    Lq, Lk = shapes[0][1], shapes[1][1]
    kw = dict(dropout_p=0.5, seed=1, window=(1, 1), softcap=2.0, alibi_slopes=np.ones(2, np.float32),
              seqlens_q=np.full(2, Lq, I32), seqlens_k=np.full(2, Lk, I32),
              block_mask=np.ones((-(-Lq // 16), -(-Lk // 16)), bool), block_size=(16, 16))
    out, lse = fa.flash_attention_forward(q, k, v, backend=backend, **kw)
    assert out.shape == (2, Lq, 4) and np.all(out == 0) and np.all(np.isneginf(lse))
    grads = fa.flash_attention_backward(np.ones_like(out), q, k, v, out, lse, backend=backend, **kw)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape] and all(np.all(g == 0) for g in grads)


def test_keywords_documented():
    for fn in (fa.flash_attention_forward, fa.flash_attention_backward):
        for word in ("dropout_p", "seed", "offset", "block_mask", "block_size", "window", "alibi_slopes",
                     "softcap", "seqlens_q", "seqlens_k", "docs/extensions.md"):
            assert word in fn.__doc__, (fn.__name__, word)
    assert "must match the forward call" in fa.flash_attention_backward.__doc__
