"""The textbook attention formulas on materialized matrices: the ground truth.

Everything here builds the full ``S = scale·QKᵀ`` and ``P = softmax(S)`` (``Lq×Lk`` per batch
entry) and is written to be obviously right, not fast. By default it computes in float64.

``dtype=p`` computes "naively in precision p", the way a framework would: every stored
intermediate (S, P, O, dP, dS, gradients) is rounded to ``p`` while the sums inside each matrix
product and softmax run in float32 (float64 for float64). The DESIGN.md test rule compares a
backend's error against this naive error.

Shapes follow NumPy broadcasting: ``q (..., Lq, D)``, ``k (..., Lk, D)``, ``v (..., Lk, Dv)``;
``out (*batch, Lq, Dv)``; ``lse (*batch, Lq)``; gradients have their input's shape. Causal masking
is bottom-right aligned: query ``i`` sees key ``j`` iff ``j <= i + Lk - Lq``. A row that sees no
key has ``out = 0``, ``lse = -inf`` and contributes no gradient.

Works on NumPy arrays and, unchanged, on CuPy arrays.
"""
import numpy as np

from ._private.dtypes import accumulation_dtype, canonical_dtype

__all__ = ["attention", "attention_backward", "causal_mask", "reduce_to_shape"]


def _xp(a):
    mod = type(a).__module__
    if mod.startswith("cupy"):
        import cupy
        return cupy
    return np


def causal_mask(Lq, Lk, xp=np):
    """Boolean ``(Lq, Lk)`` matrix, True where query ``i`` may see key ``j`` (``j <= i + Lk - Lq``)."""
    i = xp.arange(Lq)[:, None]
    j = xp.arange(Lk)[None, :]
    return j <= i + (Lk - Lq)


def reduce_to_shape(g, shape):
    """Sum ``g`` over the axes that broadcasting expanded, so that it has ``shape``."""
    extra = g.ndim - len(shape)
    if extra:
        g = g.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, (n, m) in enumerate(zip(shape, g.shape)) if n == 1 and m != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    return g


class _Precision:
    """Round-after-every-step arithmetic in a storage dtype ``p``, accumulating in ``acc``."""

    def __init__(self, dtype, xp):
        self.xp = xp
        self.p = canonical_dtype(dtype)
        self.acc = accumulation_dtype(self.p)

    def __call__(self, x):
        if self.p == self.acc:
            return x.astype(self.acc, copy=False)
        return x.astype(self.p).astype(self.acc)


def _forward(q, k, v, causal, scale, rnd):
    """S, P, out and lse in precision ``rnd`` (inputs already in the accumulation dtype)."""
    xp = rnd.xp
    Lq, Lk = q.shape[-2], k.shape[-2]
    S = rnd(rnd(q @ xp.swapaxes(k, -1, -2)) * scale)
    if causal:
        S = xp.where(causal_mask(Lq, Lk, xp), S, -xp.inf)
    m = S.max(axis=-1, keepdims=True) if Lk else xp.full(S.shape[:-1] + (1,), -xp.inf, S.dtype)
    # A fully masked row has m = -inf; subtracting 0 instead keeps exp(-inf) = 0 (no NaN).
    m_safe = xp.where(xp.isneginf(m), xp.zeros_like(m), m)
    E = xp.exp(S - m_safe)
    l = E.sum(axis=-1, keepdims=True)
    l_safe = xp.where(l == 0, xp.ones_like(l), l)
    P = rnd(E / l_safe)
    out = rnd(P @ v)
    with np.errstate(divide="ignore"):
        lse = (m_safe + xp.log(l))[..., 0]
    return S, P, out, lse


def _prepare(arrays, dtype, scale):
    xp = _xp(arrays[0])
    rnd = _Precision(np.float64 if dtype is None else dtype, xp)
    cast = [rnd(xp.asarray(a)) for a in arrays]
    D = arrays[1].shape[-1]
    if scale is None:
        scale = 1.0 / np.sqrt(D) if D else 1.0
    return xp, rnd, cast, float(scale)


def attention(q, k, v, *, causal=False, scale=None, return_lse=False, dtype=None):
    """Materialized attention ``softmax(scale·QKᵀ [+ causal mask]) V``.

    Parameters
    ----------
    q : array, shape (..., Lq, D)
    k : array, shape (..., Lk, D)
    v : array, shape (..., Lk, Dv)
        Leading dims broadcast together (NumPy rules).
    causal : bool
        Bottom-right aligned causal mask.
    scale : float, optional
        Softmax scale, default ``1/sqrt(D)``.
    return_lse : bool
        Also return the row log-sum-exp ``log Σ_j exp(scale·q_i·k_j)`` (natural log).
    dtype : dtype, optional
        ``None`` (default): compute and return float64. Otherwise compute naively in that
        precision (see module docstring) and return ``out`` in it; lse is then in the
        accumulation dtype (float32, or float64 for float64).

    Returns
    -------
    out : array, shape (*batch, Lq, Dv)
    lse : array, shape (*batch, Lq), only if ``return_lse``.
    """
    xp, rnd, (q, k, v), scale = _prepare((q, k, v), dtype, scale)
    _, _, out, lse = _forward(q, k, v, causal, scale, rnd)
    out = out.astype(rnd.p)
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, *, causal=False, scale=None, dtype=None):
    """Gradients of ``Σ dout ∘ attention(q, k, v)`` with respect to q, k and v.

    The textbook backward on materialized matrices::

        dV = Pᵀ dO,   dP = dO Vᵀ,   D = rowsum(dO ∘ O),   dS = P ∘ (dP − D),
        dQ = scale · dS K,   dK = scale · dSᵀ Q

    Parameters are as for :func:`attention`; ``dout`` has shape ``(*batch, Lq, Dv)``.

    Returns
    -------
    dq, dk, dv : arrays with exactly the shapes of q, k, v (summed over broadcast dims),
        float64 by default, else ``dtype``.
    """
    shapes = (q.shape, k.shape, v.shape)
    xp, rnd, (dout, q, k, v), scale = _prepare((dout, q, k, v), dtype, scale)
    _, P, out, _ = _forward(q, k, v, causal, scale, rnd)
    dv = rnd(xp.swapaxes(P, -1, -2) @ dout)
    dP = rnd(dout @ xp.swapaxes(v, -1, -2))
    Dsum = (dout * out).sum(axis=-1, keepdims=True)
    dS = rnd(P * (dP - Dsum))
    dq = rnd(rnd(dS @ k) * scale)
    dk = rnd(rnd(xp.swapaxes(dS, -1, -2) @ q) * scale)
    grads = [reduce_to_shape(g, s) for g, s in zip((dq, dk, dv), shapes)]
    return tuple(xp.ascontiguousarray(g).astype(rnd.p) for g in grads)
