"""The reference itself: backward against central finite differences in float64."""
import numpy as np
import pytest

from flasharray import reference


def _numeric_grads(f, arrays, eps=1e-6):
    grads = []
    for a in arrays:
        g = np.zeros_like(a)
        it = np.nditer(a, flags=["multi_index"])
        for _ in it:
            idx = it.multi_index
            old = a[idx]
            a[idx] = old + eps
            fp = f()
            a[idx] = old - eps
            fm = f()
            a[idx] = old
            g[idx] = (fp - fm) / (2 * eps)
        grads.append(g)
    return grads


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shapes", [
    ((2, 3, 4), (2, 5, 4), (2, 5, 3)),          # Lq < Lk
    ((1, 6, 3), (1, 4, 3), (1, 4, 2)),          # Lq > Lk: causal leaves fully masked rows
    ((2, 2, 3, 4), (2, 1, 5, 4), (2, 1, 5, 3)), # GQA/MQA by broadcasting
    ((3, 4), (1, 2, 4, 4), (4, 2)),             # q broadcast against a batch of k
], ids=["lq<lk", "lq>lk", "gqa", "broadcast-q"])
def test_backward_matches_finite_differences(shapes, causal):
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal(s) for s in shapes)
    out = reference.attention(q, k, v, causal=causal, scale=0.7)
    dout = rng.standard_normal(out.shape)

    def loss():
        return float((reference.attention(q, k, v, causal=causal, scale=0.7) * dout).sum())

    expected = _numeric_grads(loss, [q, k, v])
    actual = reference.attention_backward(dout, q, k, v, causal=causal, scale=0.7)
    for a, e, x in zip(actual, expected, (q, k, v)):
        assert a.shape == x.shape
        np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-8)


def test_fully_masked_rows_are_zero_with_neg_inf_lse():
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((5, 3)), rng.standard_normal((2, 3)), rng.standard_normal((2, 4))
    out, lse = reference.attention(q, k, v, causal=True, return_lse=True)
    # bottom-right alignment: query i sees key j iff j <= i + 2 - 5, so rows 0..2 see nothing
    assert np.all(out[:3] == 0) and np.all(np.isneginf(lse[:3]))
    assert np.all(np.isfinite(lse[3:]))
    dq, dk, dv = reference.attention_backward(np.ones((5, 4)), q, k, v, causal=True)
    assert np.all(dq[:3] == 0)


def test_lse_is_natural_log_sum_exp():
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((4, 8)), rng.standard_normal((6, 8)), rng.standard_normal((6, 2))
    _, lse = reference.attention(q, k, v, scale=0.5, return_lse=True)
    np.testing.assert_allclose(lse, np.log(np.exp(0.5 * q @ k.T).sum(-1)), rtol=1e-13)


def test_naive_precision_rounds_intermediates():
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((32, 16)).astype(np.float16) for _ in range(3))
    ref = reference.attention(q, k, v)
    naive = reference.attention(q, k, v, dtype=np.float16)
    assert naive.dtype == np.float16 and ref.dtype == np.float64
    err = np.abs(naive.astype(np.float64) - ref).max()
    assert 0 < err < 1e-2  # rounded to fp16 (not exact) but close
