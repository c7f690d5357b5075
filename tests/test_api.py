"""The public API contract: bad input, edge cases, broadcasting, NaN, vjp, dtypes."""
import numpy as np
import pytest

import flasharray as fa
from flasharray import reference
from flasharray._private.dtypes import bfloat16
from flasharray.testing import assert_attention_close

from conftest import make_qkv

rng = np.random.default_rng(0)
Q = rng.standard_normal((2, 3, 5, 8)).astype(np.float32)
K = rng.standard_normal((2, 3, 7, 8)).astype(np.float32)
V = rng.standard_normal((2, 3, 7, 4)).astype(np.float32)
OUT, LSE = fa.flash_attention_forward(Q, K, V)
DOUT = np.ones_like(OUT)

F = fa.flash_attention
B = fa.flash_attention_backward
# (function, args, kwargs, exception, words the message must contain)
BAD = [
    (F, ([[1.0]], K, V), {}, TypeError, ["'q'", "list"]),
    (F, (Q, None, V), {}, TypeError, ["'k'", "NoneType"]),
    (F, (Q, K, 3.0), {}, TypeError, ["'v'", "float"]),
    (F, (Q.astype(np.int32), K, V), {}, TypeError, ["'q'", "int32"]),
    (F, (Q, K.astype(np.complex64), V), {}, TypeError, ["'k'", "complex64"]),
    (F, (Q, K, V.astype(bool)), {}, TypeError, ["'v'", "bool"]),
    (F, (Q, K.astype(np.float64), V), {}, TypeError, ["float32", "float64", "k"]),
    (F, (Q.astype(np.float16), K.astype(np.float16), V.astype(bfloat16)), {}, TypeError, ["bfloat16", "float16"]),
    (F, (Q[0, 0, 0], K, V), {}, ValueError, ["'q'", "(8,)", "at least 2"]),
    (F, (Q, K[..., :6], V), {}, ValueError, ["head dim", "(2, 3, 5, 8)", "(2, 3, 7, 6)"]),
    (F, (Q, K, V[..., :6, :]), {}, ValueError, ["Lk", "(2, 3, 7, 8)", "(2, 3, 6, 4)"]),
    (F, (Q, K[:1, :2], V[:1, :2]), {}, ValueError, ["broadcast", "(2, 3, 5, 8)", "(1, 2, 7, 8)"]),
    (F, (Q, K, V), {"scale": 0.0}, ValueError, ["scale", "0.0"]),
    (F, (Q, K, V), {"scale": -1.0}, ValueError, ["scale", "-1.0"]),
    (F, (Q, K, V), {"scale": float("nan")}, ValueError, ["scale", "nan"]),
    (F, (Q, K, V), {"scale": float("inf")}, ValueError, ["scale", "inf"]),
    (F, (Q, K, V), {"scale": "0.5"}, TypeError, ["scale", "str"]),
    (F, (Q, K, V), {"causal": "yes"}, TypeError, ["causal", "str"]),
    (F, (Q, K, V), {"backend": "tpu"}, ValueError, ["backend", "'tpu'", "'cpu'"]),
    (F, (Q, K, V), {"backend": "cuda"}, TypeError, ["backend='cuda'", "CuPy", "NumPy"]),
    (F, (Q, K, V), {"dropout_p": 0.1}, ValueError, ["dropout_p=0.1", "needs a seed"]),
    (F, (Q, K, V), {"bogus": 1}, TypeError, ["bogus"]),
    (F, (Q, K, V), {"schedule": "reverse"}, TypeError, ["schedule", "emulator"]),
    (B, (DOUT[..., :3], Q, K, V, OUT, LSE), {}, ValueError, ["'dout'", "(2, 3, 5, 4)", "(2, 3, 5, 3)"]),
    (B, (DOUT, Q, K, V, OUT[:, :1], LSE), {}, ValueError, ["'out'", "(2, 3, 5, 4)", "(2, 1, 5, 4)"]),
    (B, (DOUT, Q, K, V, OUT, LSE[..., :4]), {}, ValueError, ["'lse'", "(2, 3, 5)", "(2, 3, 4)"]),
    (B, (DOUT, Q, K, V, OUT, LSE.astype(np.int64)), {}, TypeError, ["'lse'", "int64"]),
    (B, (DOUT, Q, K, V, OUT, LSE.tolist()), {}, TypeError, ["'lse'", "list"]),
    (B, (DOUT.astype(np.float64), Q, K, V, OUT, LSE), {}, TypeError, ["dout", "float64"]),
    (B, (DOUT, Q, K, V, OUT, LSE), {"deterministic": None}, TypeError, ["deterministic"]),
]


@pytest.mark.parametrize("fn,args,kwargs,exc,words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_raises_clear_error_and_leaves_inputs_alone(fn, args, kwargs, exc, words):
    before = [a.copy() for a in args if isinstance(a, np.ndarray)]
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    for w in words:
        assert w in msg, "%r not in message %r" % (w, msg)
    for a, b in zip([a for a in args if isinstance(a, np.ndarray)], before):
        np.testing.assert_array_equal(a, b)


def test_bad_input_battery_is_large():
    assert len(BAD) >= 20


@pytest.mark.parametrize("backend", [None, "cpu"])
def test_lk_zero_means_every_row_sees_nothing(backend):
    q = np.ones((2, 4, 8), np.float32)
    k = np.ones((2, 0, 8), np.float32)
    v = np.ones((2, 0, 3), np.float32)
    out, lse = fa.flash_attention_forward(q, k, v, backend=backend)
    assert out.shape == (2, 4, 3) and np.all(out == 0)
    assert lse.shape == (2, 4) and np.all(np.isneginf(lse)) and lse.dtype == np.float32
    dq, dk, dv = fa.flash_attention_backward(np.ones_like(out), q, k, v, out, lse)
    assert dq.shape == q.shape and np.all(dq == 0) and dk.shape == k.shape and dv.shape == v.shape


def test_lq_zero_gives_empty_outputs_and_zero_grads():
    q = np.ones((3, 0, 8), np.float64)
    k = np.ones((3, 5, 8), np.float64)
    v = np.ones((3, 5, 2), np.float64)
    out, lse = fa.flash_attention_forward(q, k, v)
    assert out.shape == (3, 0, 2) and lse.shape == (3, 0) and lse.dtype == np.float64
    dq, dk, dv = fa.flash_attention_backward(out, q, k, v, out, lse)
    assert dq.shape == q.shape and np.all(dk == 0) and np.all(dv == 0)


def test_causal_lq_greater_than_lk_fully_masked_rows():
    q, k, v = make_qkv((9, 16), (4, 16), (4, 16), np.float32)
    out, lse = fa.flash_attention_forward(q, k, v, causal=True)
    assert np.all(out[:5] == 0) and np.all(np.isneginf(lse[:5])) and np.all(np.isfinite(lse[5:]))
    dout = np.ones_like(out)
    dq, dk, dv = fa.flash_attention_backward(dout, q, k, v, out, lse, causal=True)
    assert np.all(dq[:5] == 0)
    assert_attention_close(out, q, k, v, causal=True, lse=lse, dout=dout, grads=(dq, dk, dv))


def test_gqa_by_broadcasting_reduces_gradients():
    B_, Hk, G, L, D = 2, 2, 3, 33, 16
    q, k, v = make_qkv((B_, Hk, G, L, D), (B_, Hk, 1, L, D), (B_, Hk, 1, L, D), np.float64, seed=3)
    out, lse = fa.flash_attention_forward(q, k, v, causal=True)
    dout = np.random.default_rng(9).standard_normal(out.shape)
    dq, dk, dv = fa.flash_attention_backward(dout, q, k, v, out, lse, causal=True)
    assert dk.shape == k.shape and dv.shape == v.shape
    # equal to the explicitly repeated K/V computation, summed over the query heads of a group
    kr, vr = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    _, dk_r, dv_r = reference.attention_backward(dout, q, kr, vr, causal=True)
    np.testing.assert_allclose(dk, dk_r.sum(axis=2, keepdims=True), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dv, dv_r.sum(axis=2, keepdims=True), rtol=1e-10, atol=1e-12)


def test_q_broadcast_against_batched_kv_and_missing_batch_dims():
    q, k, v = make_qkv((6, 8), (3, 2, 10, 8), (10, 5), np.float32, seed=4)
    out, lse = fa.flash_attention_forward(q, k, v)
    assert out.shape == (3, 2, 6, 5) and lse.shape == (3, 2, 6)
    dout = np.ones_like(out)
    grads = fa.flash_attention_backward(dout, q, k, v, out, lse)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert_attention_close(out, q, k, v, lse=lse, dout=dout, grads=grads)


def test_custom_scale_and_return_lse():
    q, k, v = make_qkv((4, 20, 16), (4, 30, 16), (4, 30, 16), np.float32, seed=6)
    out, lse = fa.flash_attention(q, k, v, scale=0.3, return_lse=True)
    assert_attention_close(out, q, k, v, scale=0.3, lse=lse)
    assert isinstance(fa.flash_attention(q, k, v), np.ndarray)


@pytest.mark.parametrize("causal", [False, True])
def test_nan_propagates_like_the_reference(causal):
    q, k, v = make_qkv((2, 9, 8), (2, 9, 8), (2, 9, 8), np.float32, seed=7)
    q = q.copy()
    q[0, 4, 2] = np.nan
    out, lse = fa.flash_attention_forward(q, k, v, causal=causal)
    ref, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
    assert np.isnan(out[0, 4]).all() and not np.isnan(out[1]).any()


def test_nan_in_a_key_hidden_by_causality_does_not_leak():
    q, k, v = make_qkv((600, 8), (600, 8), (600, 8), np.float32, seed=13)
    k = k.copy()
    k[550] = np.nan  # queries 0..549 cannot see key 550
    out, lse = fa.flash_attention_forward(q, k, v, causal=True)
    ref, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
    assert not np.isnan(out[:550]).any() and np.isnan(out[550:]).all()


def test_nan_in_values_propagates():
    q, k, v = make_qkv((12, 8), (12, 8), (12, 8), np.float32, seed=8)
    v = v.copy()
    v[3, 1] = np.nan
    out = fa.flash_attention(q, k, v)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(reference.attention(q, k, v)))


@pytest.mark.parametrize("dtype", [np.float16, bfloat16, np.float32, np.float64])
def test_vjp_round_trip(dtype):
    q, k, v = make_qkv((2, 19, 24), (2, 23, 24), (2, 23, 12), dtype, seed=10)
    out, vjp = fa.flash_attention_vjp(q, k, v, causal=True, scale=0.25)
    dout = np.random.default_rng(11).standard_normal(out.shape).astype(dtype)
    grads = vjp(dout)
    out2, lse2 = fa.flash_attention_forward(q, k, v, causal=True, scale=0.25)
    np.testing.assert_array_equal(out, out2)
    expected = fa.flash_attention_backward(dout, q, k, v, out2, lse2, causal=True, scale=0.25)
    for g, e in zip(grads, expected):
        np.testing.assert_array_equal(g, e)
    assert_attention_close(out, q, k, v, causal=True, scale=0.25, dout=dout, grads=grads)


def test_lse_dtypes():
    for dt, lse_dt in [(np.float16, np.float32), (bfloat16, np.float32), (np.float32, np.float32),
                       (np.float64, np.float64)]:
        q, k, v = make_qkv((3, 8), (4, 8), (4, 8), dt)
        _, lse = fa.flash_attention_forward(q, k, v)
        assert lse.dtype == lse_dt


def test_public_names():
    for name in ("flash_attention", "flash_attention_forward", "flash_attention_backward",
                 "flash_attention_vjp", "reference", "testing", "show_config", "__version__"):
        assert hasattr(fa, name)
