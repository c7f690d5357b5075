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

__all__ = ["attention", "attention_backward", "attention_with_kvcache", "gather_kvcache", "causal_mask",
           "reduce_to_shape"]


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


def gather_kvcache(k_cache, v_cache, cache_seqlens, *, k_new=None, v_new=None, block_table=None):
    """The keys and values entry ``b`` of a KV cache exposes, as fresh contiguous arrays.

    Returns a list with one ``(k_b, v_b)`` per entry: ``k_b (H_kv, n_b, D)``, ``v_b (H_kv, n_b,
    Dv)`` with ``n_b = cache_seqlens[b] + L_new`` — the cache's first ``cache_seqlens[b]`` logical
    rows (contiguous ``(B, H_kv, L_cache, D)``, or paged ``(num_blocks, H_kv, page_size, D)``
    through ``block_table``: row ``r`` at page ``block_table[b, r // page_size]``, row
    ``r % page_size``) followed by ``k_new[b]``, ``v_new[b]``. Nothing is written; no checking.
    """
    xp = _xp(k_cache)
    seqlens = [int(s) for s in (cache_seqlens.tolist() if hasattr(cache_seqlens, "tolist") else cache_seqlens)]
    result = []
    for b, s in enumerate(seqlens):
        if block_table is None:
            k_b, v_b = k_cache[b, :, :s], v_cache[b, :, :s]
        else:
            page = k_cache.shape[2]
            rows = xp.arange(s)
            pages = xp.asarray(block_table[b])[rows // page]
            k_b, v_b = k_cache[pages, :, rows % page], v_cache[pages, :, rows % page]   # (s, H_kv, ·)
            k_b, v_b = xp.swapaxes(k_b, 0, 1), xp.swapaxes(v_b, 0, 1)
        if k_new is not None:
            k_b, v_b = xp.concatenate([k_b, k_new[b]], axis=1), xp.concatenate([v_b, v_new[b]], axis=1)
        result.append((xp.ascontiguousarray(k_b), xp.ascontiguousarray(v_b)))
    return result


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, *, k_new=None, v_new=None, block_table=None,
                           causal=True, scale=None, return_lse=False, dtype=None):
    """The plain formula for :func:`flasharray.flash_attention_with_kvcache`, **without writing the cache**.

    For each entry ``b``: :func:`attention` of ``q[b]`` over the keys/values of
    :func:`gather_kvcache` (the cache's first ``cache_seqlens[b]`` rows followed by ``k_new[b]``),
    causal bottom-right within them. The cache, ``k_new`` and every other input are left as they
    are — the result equals what ``flash_attention_with_kvcache`` returns for the same arguments,
    whose cache then holds the new rows.

    Parameters are those of ``flash_attention_with_kvcache`` (q ``(B, H, Lq, D)`` or GQA
    ``(B, H_kv, G, Lq, D)``), plus ``dtype`` as for :func:`attention` (default: float64).

    Returns
    -------
    out : array (B, *heads, Lq, Dv);  lse : array (B, *heads, Lq), only if ``return_lse``.
    """
    xp = _xp(q)
    gqa = q.ndim == 5
    parts = []
    for b, (k_b, v_b) in enumerate(gather_kvcache(k_cache, v_cache, cache_seqlens, k_new=k_new, v_new=v_new,
                                                  block_table=block_table)):
        if gqa:
            k_b, v_b = k_b[:, None], v_b[:, None]
        parts.append(attention(q[b], k_b, v_b, causal=causal, scale=scale, return_lse=True, dtype=dtype))
    if not parts:
        heads = np.broadcast_shapes(q.shape[1:-2], (k_cache.shape[1],) + ((1,) if gqa else ()))
        p = _Precision(np.float64 if dtype is None else dtype, xp)
        out = xp.zeros((0,) + heads + (q.shape[-2], v_cache.shape[-1]), dtype=p.p)
        lse = xp.zeros((0,) + heads + (q.shape[-2],), dtype=p.acc)
    else:
        out, lse = xp.stack([o for o, _ in parts]), xp.stack([s for _, s in parts])
    return (out, lse) if return_lse else out
