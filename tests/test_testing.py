"""flasharray.testing must catch wrong results, not only pass right ones."""
import numpy as np
import pytest

import flasharray as fa
from flasharray import reference, testing

from conftest import make_qkv


def test_report_passes_correct_output_and_names_quantities():
    q, k, v = make_qkv((2, 30, 16), (2, 40, 16), (2, 40, 8), np.float16)
    out, lse = fa.flash_attention_forward(q, k, v, causal=True)
    report = testing.check_attention(out, q, k, v, causal=True, lse=lse)
    assert report.passed and bool(report)
    text = str(report)
    assert "out" in text and "lse" in text and "naive" in text and "bound" in text
    assert report["out"].naive_err > 0


def test_detects_a_perturbed_output():
    q, k, v = make_qkv((2, 30, 16), (2, 40, 16), (2, 40, 8), np.float32)
    out = fa.flash_attention(q, k, v)
    bad = out.copy()
    bad[1, 7, 3] += 1e-3
    report = testing.check_attention(bad, q, k, v)
    assert not report.passed
    with pytest.raises(AssertionError, match="FAIL out"):
        testing.assert_attention_close(bad, q, k, v)


def test_detects_wrong_causal_and_wrong_scale():
    q, k, v = make_qkv((20, 16), (20, 16), (20, 8), np.float64)
    assert not testing.check_attention(reference.attention(q, k, v), q, k, v, causal=True).passed
    assert not testing.check_attention(reference.attention(q, k, v, scale=0.2), q, k, v).passed


def test_detects_wrong_gradient_and_missing_neg_inf():
    q, k, v = make_qkv((9, 8), (4, 8), (4, 8), np.float32)
    out, lse = fa.flash_attention_forward(q, k, v, causal=True)
    dout = np.ones_like(out)
    dq, dk, dv = fa.flash_attention_backward(dout, q, k, v, out, lse, causal=True)
    assert testing.check_attention(out, q, k, v, causal=True, lse=lse, dout=dout, grads=(dq, dk, dv))
    bad_lse = np.where(np.isneginf(lse), 0, lse).astype(lse.dtype)
    assert not testing.check_attention(out, q, k, v, causal=True, lse=bad_lse).passed
    bad_dk = dk * 1.01
    r = testing.check_attention(out, q, k, v, causal=True, dout=dout, grads=(dq, bad_dk, dv))
    assert not r.passed and not r["dk"].passed and r["dq"].passed


def test_shape_mismatch_fails():
    q, k, v = make_qkv((5, 8), (6, 8), (6, 8), np.float32)
    out = fa.flash_attention(q, k, v)
    assert not testing.check_attention(out[:4], q, k, v).passed
