"""Check any attention implementation against the float64 reference with the DESIGN.md rule.

An output computed in precision ``p`` passes when, elementwise max over the array::

    max|actual − ref64| <= factor · max|naive_p − ref64| + atol_p

where ``ref64`` is :func:`flasharray.reference.attention` in float64 and ``naive_p`` the same
formulas computed naively in ``p`` (FlashAttention's own rule: ``factor = 2`` for the output,
3 for gradients). ``atol_p`` is a few units in the last place of ``p`` times
``max(1, max|ref64|)``, so that it means the same for gradients of magnitude 1000 as for
outputs of magnitude 1 (for float64, ``naive_p`` *is* the reference and only atol remains). Non-finite reference entries (``-inf`` lse of fully masked rows, NaN from NaN
inputs) must be reproduced exactly.

Use it for your own kernels too::

    report = flasharray.testing.check_attention(out, q, k, v, causal=True)
    print(report)            # one line per quantity: max error, naive error, bound
    flasharray.testing.assert_attention_close(out, q, k, v, causal=True, lse=lse,
                                              dout=dout, grads=(dq, dk, dv))
"""
from dataclasses import dataclass, field
from typing import List

import numpy as np

from . import reference
from ._private.dtypes import ATOL, accumulation_dtype, canonical_dtype

__all__ = ["Check", "AttentionReport", "check_attention", "assert_attention_close"]


@dataclass
class Check:
    """One compared quantity (``out``, ``lse``, ``dq``, ...)."""
    name: str
    max_abs_err: float
    naive_err: float
    bound: float
    passed: bool
    note: str = ""

    def __str__(self):
        status = "ok  " if self.passed else "FAIL"
        s = "%s %-4s max|err| = %.3e   naive|err| = %.3e   bound = %.3e" % (
            status, self.name, self.max_abs_err, self.naive_err, self.bound)
        return s + ("   (%s)" % self.note if self.note else "")


@dataclass
class AttentionReport:
    """Result of :func:`check_attention`; truthy when every check passed."""
    dtype: str
    checks: List[Check] = field(default_factory=list)

    @property
    def passed(self):
        return all(c.passed for c in self.checks)

    def __bool__(self):
        return self.passed

    def __getitem__(self, name):
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(name)

    def __str__(self):
        head = "attention check vs float64 reference (%s): %s" % (
            self.dtype, "passed" if self.passed else "FAILED")
        return "\n".join([head] + ["  " + str(c) for c in self.checks])


def _host(x):
    """NumPy copy-free view of a NumPy array, or a host copy of a CuPy array."""
    if x is None:
        return None
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)


def _compare(name, actual, ref, naive, factor, atol):
    actual = np.asarray(actual, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    naive = np.asarray(naive, dtype=np.float64)
    if actual.shape != ref.shape:
        return Check(name, np.inf, np.nan, np.nan, False,
                     "shape %s, expected %s" % (actual.shape, ref.shape))
    finite = np.isfinite(ref)
    # Non-finite reference values (-inf lse, NaN from NaN inputs) must be matched exactly.
    same_special = np.array_equal(actual[~finite], ref[~finite], equal_nan=True)
    with np.errstate(invalid="ignore"):
        err = np.abs(actual[finite] - ref[finite])
        naive_err = np.abs(naive[finite] - ref[finite])
    max_err = float(err.max()) if err.size else 0.0
    if err.size and not np.all(np.isfinite(err)):
        max_err = np.inf
    nerr = float(np.nanmax(naive_err)) if naive_err.size else 0.0
    magnitude = max(1.0, float(np.abs(ref[finite]).max())) if finite.any() else 1.0
    bound = factor * nerr + atol * magnitude
    note = "" if same_special else "non-finite entries differ from the reference"
    return Check(name, max_err, nerr, bound, bool(same_special and max_err <= bound), note)


def check_attention(out, q, k, v, *, causal=False, scale=None, lse=None, dout=None, grads=None,
                    factor=2.0, grad_factor=3.0, atol=None, **extensions):
    """Compare an attention output (and optionally lse and gradients) with the reference.

    Parameters
    ----------
    out : array, shape (*batch, Lq, Dv)
        The output under test (NumPy or CuPy).
    q, k, v : arrays
        The inputs that produced it; their dtype is the precision ``p`` of the rule.
    causal, scale : as for :func:`flasharray.flash_attention`.
    lse : array, optional
        Row log-sum-exp under test; compared with the reference lse, naive error taken from the
        lse computed in the accumulation precision.
    dout, grads : array and (dq, dk, dv), optional
        Cotangent and the gradients under test (compared with ``grad_factor``).
    factor, grad_factor : float
        Multipliers of the naive error (DESIGN.md: 2 and 3).
    atol : float, optional
        Slack per unit of magnitude (multiplied by ``max(1, max|ref|)``); default per dtype
        (float16 1e-4, bfloat16 1e-3, float32 1e-6, float64 1e-12).
    **extensions
        The extension keywords of the call under test (``dropout_p``, ``seed``, ``offset``,
        ``window``, ``alibi_slopes``, ``softcap``, ``block_mask``, ``block_size``, ``seqlens_q``,
        ``seqlens_k``; docs/extensions.md), passed to the reference: with dropout the reference
        applies the same mask, so the rule is unchanged.

    Returns
    -------
    AttentionReport
    """
    q, k, v, out, lse, dout = (_host(x) for x in (q, k, v, out, lse, dout))
    ext = {name: (_host(x) if hasattr(x, "shape") else x) for name, x in extensions.items()}
    kw = dict(causal=causal, scale=scale, **ext)
    p = canonical_dtype(q.dtype)
    atol = ATOL[p] if atol is None else float(atol)
    report = AttentionReport(dtype=str(p))
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
    naive_out, naive_lse = reference.attention(q, k, v, return_lse=True, dtype=p, **kw)
    report.checks.append(_compare("out", out, ref_out, naive_out, factor, atol))
    if lse is not None:
        acc = accumulation_dtype(p)
        _, lse_acc = reference.attention(q.astype(acc), k.astype(acc), v.astype(acc), return_lse=True,
                                         dtype=acc, **kw)
        report.checks.append(_compare("lse", lse, ref_lse, lse_acc, factor, ATOL[acc]))
    if grads is not None:
        if dout is None:
            raise ValueError("flasharray.testing: grads given without dout")
        ref_g = reference.attention_backward(dout, q, k, v, **kw)
        naive_g = reference.attention_backward(dout, q, k, v, dtype=p, **kw)
        for name, g, r, n in zip(("dq", "dk", "dv"), grads, ref_g, naive_g):
            report.checks.append(_compare(name, _host(g), r, n, grad_factor, atol))
    return report


def assert_attention_close(out, q, k, v, **kwargs):
    """:func:`check_attention`, raising ``AssertionError`` with the report when it fails."""
    report = check_attention(out, q, k, v, **kwargs)
    if not report.passed:
        raise AssertionError(str(report))
    return report
