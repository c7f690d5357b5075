"""merge_attention: attention over key shards merged by their lse equals attention over all keys."""
import numpy as np
import pytest

import flasharray as fa
from flasharray.testing import assert_attention_close
from conftest import DTYPES, DTYPE_IDS, make_qkv, requires_gpu


def _parts(q, k, v, bounds):
    """flash_attention_forward over each key shard [a, b)."""
    outs, lses = zip(*(fa.flash_attention_forward(q, k[..., a:b, :], v[..., a:b, :]) for a, b in bounds))
    return list(outs), list(lses)


def _causal_part(q, k, v, a, b):
    """The causal problem restricted to keys [a, b), computed in float64 by the textbook formula
    (rows that see none of those keys get out 0, lse -inf, as from a kernel)."""
    Lq, Lk = q.shape[-2], k.shape[-2]
    s = np.einsum("...id,...jd->...ij", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(q.shape[-1])
    i, j = np.arange(Lq)[:, None], np.arange(Lk)[None, :]
    visible = (j <= i + Lk - Lq) & (j >= a) & (j < b)
    s = np.where(visible, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m_safe)
    l = p.sum(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(l[..., None] > 0, (p @ v.astype(np.float64)) / l[..., None], 0)
        lse = np.where(l > 0, m_safe[..., 0] + np.log(l), -np.inf)
    return out.astype(q.dtype), lse.astype(fa._private.dtypes.accumulation_dtype(q.dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("bounds", [[(0, 40), (40, 97)], [(0, 1), (1, 50), (50, 97)], [(0, 97)]])
def test_merged_shards_equal_attention_over_all_keys(dtype, bounds):
    q, k, v = make_qkv((2, 3, 17, 32), (2, 3, 97, 32), (2, 3, 97, 24), dtype, seed=3)
    outs, lses = _parts(q, k, v, bounds)
    out, lse = fa.merge_attention(outs, lses)
    assert out.dtype == dtype and out.shape == (2, 3, 17, 24) and lse.shape == (2, 3, 17)
    assert lse.dtype == fa._private.dtypes.accumulation_dtype(dtype)
    assert_attention_close(out, q, k, v, lse=lse)


def test_rows_that_see_no_key_in_a_shard_are_nan_free():
    """Causal with Lq = Lk: early queries see none of the later shard's keys (lse -inf there)."""
    q, k, v = make_qkv((2, 64, 16), (2, 64, 16), (2, 64, 16), np.float64, seed=4)
    outs, lses = map(list, zip(*(_causal_part(q, k, v, a, b) for a, b in [(0, 20), (20, 64)])))
    assert np.isneginf(lses[1][:, :20]).all()
    outs[1][:, :20] = np.nan            # whatever a part holds where it saw nothing is ignored
    with np.errstate(all="raise"):
        out, lse = fa.merge_attention(outs, lses)
    assert_attention_close(out, q, k, v, causal=True, lse=lse)


def test_row_with_no_key_in_any_part_is_zero_and_minus_inf():
    out_a = np.full((3, 4), np.nan, np.float32)
    lse_a = np.array([-np.inf, 0.0, -np.inf], np.float32)
    out_b = np.ones((3, 4), np.float32)
    lse_b = np.array([-np.inf, -np.inf, 1.0], np.float32)
    out_a[1] = 2.0
    out, lse = fa.merge_attention([out_a, out_b], [lse_a, lse_b])
    np.testing.assert_array_equal(out, [[0] * 4, [2] * 4, [1] * 4])
    np.testing.assert_array_equal(lse, [-np.inf, 0.0, 1.0])


def test_nan_lse_propagates_and_inputs_are_untouched():
    outs = [np.ones((2, 3), np.float32), np.zeros((2, 3), np.float32)]
    lses = [np.array([np.nan, 0.0], np.float32), np.array([0.0, 0.0], np.float32)]
    copies = [x.copy() for x in outs + lses]
    out, lse = fa.merge_attention(outs, lses)
    assert np.isnan(out[0]).all() and np.isnan(lse[0])
    np.testing.assert_allclose(out[1], 0.5)
    np.testing.assert_allclose(lse[1], np.log(2.0), rtol=1e-7)
    for a, b in zip(outs + lses, copies):
        np.testing.assert_array_equal(a, b)


def test_extreme_lse_does_not_overflow():
    outs = [np.ones((1, 2), np.float64), 3 * np.ones((1, 2), np.float64)]
    lses = [np.array([1000.0]), np.array([1000.0 + np.log(3.0)])]
    with np.errstate(all="raise"):
        out, lse = fa.merge_attention(outs, lses)
    np.testing.assert_allclose(out, 2.5)
    np.testing.assert_allclose(lse, 1000.0 + np.log(4.0))


@pytest.mark.parametrize("outs,lses,exc,match", [
    ("x", [], TypeError, "two sequences"),
    ([], [], ValueError, "at least one part"),
    ([np.zeros((2, 3))], [np.zeros(2), np.zeros(2)], ValueError, "one lse per out"),
    ([np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float64)], [np.zeros(2)] * 2, TypeError, "share one dtype"),
    ([np.zeros((2, 3))], [np.zeros(3)], ValueError, r"'lses\[0\]' must have shape \(2,\)"),
    ([np.zeros((2, 3)), np.zeros((2, 4))], [np.zeros(2)] * 2, ValueError, r"'outs\[1\]' must have shape \(2, 3\)"),
    ([np.zeros((2, 3))], [np.zeros(2, np.float16)], TypeError, "lses must be float32 or float64"),
    ([np.zeros((2, 3), np.int32)], [np.zeros(2)], TypeError, "has dtype int32"),
    ([[1.0, 2.0]], [np.zeros(1)], TypeError, "must be a numpy.ndarray or cupy.ndarray"),
    ([np.zeros(3)], [np.zeros(())], ValueError, "at least 2 dims"),
])
def test_bad_input_is_a_clear_error(outs, lses, exc, match):
    with pytest.raises(exc, match=match):
        fa.merge_attention(outs, lses)


@pytest.mark.gpu
@requires_gpu
def test_cupy_arrays_merge_like_numpy():
    import cupy
    q, k, v = make_qkv((2, 17, 32), (2, 97, 32), (2, 97, 24), np.float32, seed=5)
    outs, lses = _parts(q, k, v, [(0, 40), (40, 97)])
    out, lse = fa.merge_attention([cupy.asarray(o) for o in outs], [cupy.asarray(x) for x in lses])
    ref_out, ref_lse = fa.merge_attention(outs, lses)
    np.testing.assert_allclose(cupy.asnumpy(out), ref_out, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(cupy.asnumpy(lse), ref_lse, rtol=1e-6, atol=1e-6)
