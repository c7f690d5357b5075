"""Merging attention over disjoint key sets by their log-sum-exp (the split-KV combine step)."""
import numpy as np

from . import validation as val
from .dtypes import accumulation_dtype


def _check_parts(outs, lses):
    """Validate the parts; returns (kind, dtype of outs, lse dtype, shapes)."""
    if not isinstance(outs, (list, tuple)) or not isinstance(lses, (list, tuple)):
        raise TypeError("flasharray: merge_attention takes two sequences, outs and lses, got %s and %s"
                        % (type(outs).__name__, type(lses).__name__))
    if len(outs) != len(lses) or not outs:
        raise ValueError("flasharray: merge_attention needs one lse per out and at least one part, got "
                         "%d outs and %d lses" % (len(outs), len(lses)))
    kind, dtype = val.check_arrays([("outs[%d]" % i, o) for i, o in enumerate(outs)])
    lse_kind, lse_dtype = val.check_arrays([("lses[%d]" % i, x) for i, x in enumerate(lses)])
    if lse_kind != kind:
        raise TypeError("flasharray: cannot mix NumPy and CuPy arrays (outs are %s, lses are %s)"
                        % (kind, lse_kind))
    if lse_dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError("flasharray: lses must be float32 or float64, got %s" % val._dtype_name(lse_dtype))
    out_shape = tuple(outs[0].shape)
    if len(out_shape) < 2:
        raise ValueError("flasharray: outs[0] must have at least 2 dims (..., Lq, Dv), got shape %s"
                         % (out_shape,))
    for i, (o, x) in enumerate(zip(outs, lses)):
        val.check_expected_shape("outs[%d]" % i, o, out_shape)
        val.check_expected_shape("lses[%d]" % i, x, out_shape[:-1])
    return kind, dtype, lse_dtype


def merge_attention(outs, lses):
    """Attention over the union of disjoint key sets, from the attention over each set.

    If ``out_i, lse_i = flash_attention_forward(q, k_i, v_i)`` for key/value sets ``i`` that
    partition the keys, then the attention of ``q`` over all of them is::

        lse = log Σ_i exp(lse_i)
        out = Σ_i exp(lse_i − lse) · out_i

    This is the combine step of split-KV decoding, of attention over a KV cache plus new tokens
    computed separately, and of context parallelism (each GPU attends to its shard of the keys;
    the partial results are merged).

    Parameters
    ----------
    outs : sequence of arrays, each (..., Lq, Dv)
        Partial outputs, one dtype (float16, bfloat16, float32 or float64), NumPy or CuPy.
    lses : sequence of arrays, each (..., Lq)
        Their row log-sum-exps (natural log), float32 or float64; ``-inf`` for a row that saw no
        key in that part.

    Returns
    -------
    out : array (..., Lq, Dv)
        In the dtype of ``outs``; computed in float32 (float64 when ``outs`` or ``lses`` are float64).
    lse : array (..., Lq)
        float32 (float64 when ``outs`` or ``lses`` are float64). A row that saw no key in any part
        gets ``out = 0`` and ``lse = -inf`` — never NaN: a part whose lse is ``-inf`` contributes
        nothing, whatever its ``out`` holds. NaN in an lse propagates to that row.

    Examples
    --------
    >>> import numpy as np, flasharray as fa
    >>> q, k, v = (np.random.randn(2, 5, 16).astype(np.float32) for _ in range(3))
    >>> parts = [fa.flash_attention_forward(q, k[:, s], v[:, s]) for s in (slice(0, 2), slice(2, 5))]
    >>> out, lse = fa.merge_attention([p[0] for p in parts], [p[1] for p in parts])
    >>> bool(np.allclose(out, fa.flash_attention(q, k, v), atol=1e-6))
    True
    """
    kind, dtype, lse_dtype = _check_parts(outs, lses)
    xp = np if kind == "numpy" else __import__("cupy")
    f64 = np.dtype(np.float64)
    acc = f64 if f64 in (accumulation_dtype(dtype), lse_dtype) else np.dtype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):   # 0·inf of unseen parts is discarded below
        return _merge(xp, outs, lses, dtype, acc)


def _merge(xp, outs, lses, dtype, acc):
    L = xp.stack([x.astype(acc, copy=False) for x in lses])          # parts × (..., Lq)
    m = L.max(axis=0)                                                # NaN if any part is NaN
    seen = m > -xp.inf                                               # False for -inf and NaN rows
    m_safe = xp.where(seen, m, 0).astype(acc)                        # keeps -inf − (−inf) out
    w = xp.exp(L - m_safe)                                           # exp(-inf) = 0: unseen parts
    out = xp.zeros(outs[0].shape, dtype=acc)
    for w_i, o in zip(w, outs):
        # A part with weight 0 adds nothing, even where its out holds NaN or inf.
        out += xp.where((w_i > 0)[..., None], w_i[..., None] * o.astype(acc, copy=False), 0)
    total = xp.where(seen, w.sum(axis=0), 1)
    out = xp.where(seen[..., None], out / total[..., None], 0)
    lse = xp.where(seen, m_safe + xp.log(total), -xp.inf)
    nan_rows = xp.isnan(m)[..., None]
    out = xp.where(nan_rows, xp.nan, out)
    lse = xp.where(nan_rows[..., 0], xp.nan, lse)
    return out.astype(dtype), lse.astype(acc)
