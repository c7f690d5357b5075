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
key has ``out = 0``, ``lse = -inf`` and contributes no gradient. The extension keywords
(dropout, block-sparse, window, ALiBi, softcap, per-entry lengths) follow ``docs/extensions.md``
to the letter, as masks and biases on the materialized S and P.

Works on NumPy arrays and, unchanged, on CuPy arrays.
"""
import numpy as np

from ._private import philox
from ._private.dtypes import accumulation_dtype, canonical_dtype

__all__ = ["attention", "attention_backward", "dropout_mask", "attention_with_kvcache", "gather_kvcache", "causal_mask",
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


_DEFAULTS = {"dropout_p": 0.0, "seed": None, "offset": 0, "block_mask": None, "block_size": (128, 128),
             "window": None, "alibi_slopes": None, "softcap": None, "seqlens_q": None, "seqlens_k": None}


def dropout_mask(batch_shape, Lq, Lk, dropout_p, seed, offset=0):
    """The exact dropout keep mask every backend applies (docs/extensions.md, Philox4x32-10).

    Returns a NumPy bool array ``(*batch_shape, Lq, Lk)``: True where entry ``(b, i, j)`` of P is
    kept (and scaled by ``1/(1 − dropout_p)``). ``batch_shape`` is the broadcast batch shape of
    ``out``; the batch entry enters the counter by its flat C-order index.
    """
    return philox.keep_mask(dropout_p, seed, offset, tuple(int(n) for n in batch_shape), int(Lq), int(Lk))


def _lengths(xp, seqlens, L, batch, name):
    """Per-entry valid length as an int array ``(B, 1, …, 1, 1, 1)`` (or the int ``L``)."""
    if seqlens is None:
        return L
    if not batch:
        raise ValueError("flasharray.reference: %s needs a batch dim (B = first batch dim)" % name)
    s = xp.asarray(seqlens).astype(xp.int64)
    return s.reshape((batch[0],) + (1,) * (len(batch) + 1))


class _Masks:
    """The extension keywords of one reference call, materialized (docs/extensions.md).

    ``rows (…, Lq, 1)`` / ``keys (…, 1, Lk)``: valid query rows / keys (``i < Lq_b``, ``j < Lk_b``);
    ``visible (…, Lq, Lk)`` or None (everything visible); ``bias`` the ALiBi term or None;
    ``keep`` the dropout keep mask or None; ``softcap`` a float or None.
    """

    def __init__(self, xp, batch, Lq, Lk, causal, acc, kw):
        unknown = set(kw) - set(_DEFAULTS)
        if unknown:
            raise TypeError("flasharray.reference: unexpected keyword argument %r" % sorted(unknown)[0])
        kw = dict(_DEFAULTS, **kw)
        i, j = xp.arange(Lq)[:, None], xp.arange(Lk)[None, :]
        Lq_b = _lengths(xp, kw["seqlens_q"], Lq, batch, "seqlens_q")
        Lk_b = _lengths(xp, kw["seqlens_k"], Lk, batch, "seqlens_k")
        self.padded = kw["seqlens_q"] is not None or kw["seqlens_k"] is not None
        self.rows, self.keys = i < Lq_b, j < Lk_b
        diag = i + (Lk_b - Lq_b)          # the key column aligned with row i (bottom-right)
        conds = [self.rows & self.keys] if self.padded else []
        if causal:
            conds.append(j <= diag)
        if kw["window"] is not None:
            left, right = (int(w) for w in kw["window"])
            conds += ([j >= diag - left] if left >= 0 else []) + ([j <= diag + right] if right >= 0 else [])
        if kw["block_mask"] is not None:
            conds.append(_expand_blocks(xp, kw["block_mask"], kw["block_size"], Lq, Lk))
        self.visible = None
        for c in conds:
            self.visible = c if self.visible is None else self.visible & c
        self.bias = None
        if kw["alibi_slopes"] is not None:
            slopes = xp.asarray(kw["alibi_slopes"]).astype(acc)
            self.bias = slopes[..., None, None] * xp.abs(diag - j).astype(acc)
        self.softcap = None if kw["softcap"] is None else float(kw["softcap"])
        self.p, self.keep = float(kw["dropout_p"]), None
        if self.p > 0:
            if kw["seed"] is None:
                raise ValueError("flasharray.reference: dropout_p=%r needs a seed" % kw["dropout_p"])
            self.keep = xp.asarray(dropout_mask(batch, Lq, Lk, self.p, kw["seed"], kw["offset"]))

    def valid_rows(self, x):
        """``x (…, Lq, ·)`` with the rows ``i ≥ Lq_b`` zeroed (padding is never read)."""
        return self.rows_or_keys(x, self.rows)

    def valid_keys(self, x):
        """``x (…, Lk, ·)`` with the rows ``j ≥ Lk_b`` zeroed (padding is never read)."""
        return self.rows_or_keys(x, _xp(x).swapaxes(self.keys, -1, -2))

    def rows_or_keys(self, x, mask):
        if not self.padded:
            return x
        return _xp(x).where(mask, x, x.dtype.type(0))


def _expand_blocks(xp, block_mask, block_size, Lq, Lk):
    """``block_mask (…, ceil(Lq/Bq), ceil(Lk/Bk))`` expanded to ``(…, Lq, Lk)`` entries."""
    Bq, Bk = (int(b) for b in block_size)
    bm = xp.asarray(block_mask).astype(bool)
    grid = (-(-Lq // Bq), -(-Lk // Bk))
    if tuple(bm.shape[-2:]) != grid:
        raise ValueError("flasharray.reference: block_mask must end in the tile grid %s of block_size "
                         "%s, got shape %s" % (grid, (Bq, Bk), tuple(bm.shape)))
    return bm[..., xp.arange(Lq) // Bq, :][..., xp.arange(Lk) // Bk]


def _forward(q, k, v, causal, scale, rnd, ext):
    """S, P, P̃ (dropped), tanh of the softcap (or None), out and lse in precision ``rnd``
    (inputs already in the accumulation dtype; ``ext`` a :class:`_Masks`)."""
    xp = rnd.xp
    S = rnd(rnd(q @ xp.swapaxes(k, -1, -2)) * scale)
    T = None
    if ext.softcap is not None:
        T = rnd(xp.tanh(S / ext.softcap))
        S = rnd(T * ext.softcap)
    if ext.bias is not None:
        S = rnd(S - ext.bias)
    if ext.visible is not None:
        S = xp.where(ext.visible, S, -xp.inf)
    m = S.max(axis=-1, keepdims=True) if S.shape[-1] else xp.full(S.shape[:-1] + (1,), -xp.inf, S.dtype)
    # A fully masked row has m = -inf; subtracting 0 instead keeps exp(-inf) = 0 (no NaN).
    m_safe = xp.where(xp.isneginf(m), xp.zeros_like(m), m)
    E = xp.exp(S - m_safe)
    l = E.sum(axis=-1, keepdims=True)
    l_safe = xp.where(l == 0, xp.ones_like(l), l)
    P = rnd(E / l_safe)
    Pd = P if ext.keep is None else rnd(xp.where(ext.keep, P / (1.0 - ext.p), P.dtype.type(0)))
    out = rnd(Pd @ v)
    with np.errstate(divide="ignore"):
        lse = (m_safe + xp.log(l))[..., 0]
    return P, Pd, T, out, lse


def _prepare(arrays, dtype, scale, causal, extensions):
    xp = _xp(arrays[0])
    rnd = _Precision(np.float64 if dtype is None else dtype, xp)
    q, k, v = arrays[-3:]
    batch = tuple(np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    ext = _Masks(xp, batch, q.shape[-2], k.shape[-2], causal, rnd.acc, extensions)
    cast = [rnd(xp.asarray(a)) for a in arrays]
    D = arrays[-2].shape[-1]
    if scale is None:
        scale = 1.0 / np.sqrt(D) if D else 1.0
    return xp, rnd, cast, float(scale), ext


_EXT_DOC = """
    dropout_p, seed, offset, block_mask, block_size, window, alibi_slopes, softcap, seqlens_q,
    seqlens_k : the extension keywords, exactly as specified in ``docs/extensions.md``
        (dropout on P with the Philox mask of :func:`dropout_mask`; block-sparse mask of tiles
        ``block_size``; sliding window ``(left, right)``; ALiBi slopes broadcast to the batch
        shape; ``softcap·tanh(s/softcap)``; per-entry valid lengths ``(B,)`` of the first batch
        dim). Not checked beyond what is needed to compute: pass valid values."""


def _accept_precision(precision, q):
    """``precision=`` as the library functions take it (validated for q's dtype); the reference
    computes in IEEE arithmetic of ``dtype`` whatever its value."""
    if precision is not None:
        from ._private.precision import check_precision
        check_precision(precision, q.dtype)


def attention(q, k, v, *, causal=False, scale=None, return_lse=False, dtype=None, precision=None, **extensions):
    """Materialized attention ``softmax(scale·QKᵀ [+ masks]) V``.

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
        Also return the row log-sum-exp ``log Σ_j exp(s_ij)`` over visible keys (natural log; of the
        undropped scores).
    dtype : dtype, optional
        ``None`` (default): compute and return float64. Otherwise compute naively in that
        precision (see module docstring) and return ``out`` in it; lse is then in the
        accumulation dtype (float32, or float64 for float64).
    precision : {None, "ieee", "tf32", "3xtf32"}
        Accepted as by :func:`flasharray.flash_attention` (validated for q's dtype) and ignored:
        the reference always computes in IEEE arithmetic of ``dtype`` (float64 by default).%s

    Returns
    -------
    out : array, shape (*batch, Lq, Dv); rows that see no key (or ``i ≥ seqlens_q[b]``) are 0.
    lse : array, shape (*batch, Lq), only if ``return_lse``; ``-inf`` for rows that see no key.
    """
    _accept_precision(precision, q)
    xp, rnd, (q, k, v), scale, ext = _prepare((q, k, v), dtype, scale, causal, extensions)
    q, k, v = ext.valid_rows(q), ext.valid_keys(k), ext.valid_keys(v)
    _, _, _, out, lse = _forward(q, k, v, causal, scale, rnd, ext)
    out = out.astype(rnd.p)
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, *, causal=False, scale=None, dtype=None, precision=None, **extensions):
    """Gradients of ``Σ dout ∘ attention(q, k, v)`` with respect to q, k and v.

    The textbook backward on materialized matrices (P̃ the dropped P, ``keep`` its mask, T the
    tanh of the softcap)::

        dV = P̃ᵀ dO,   dP̃ = dO Vᵀ,   D = rowsum(dO ∘ O),   dS = P ∘ (dP̃ ∘ keep/(1−p) − D) [∘ (1 − T²)],
        dQ = scale · dS K,   dK = scale · dSᵀ Q

    Parameters are as for :func:`attention` (the same keywords as the forward, ``precision``
    accepted and ignored);
    ``dout`` has shape ``(*batch, Lq, Dv)``. ALiBi slopes, masks and lengths are constants.

    Returns
    -------
    dq, dk, dv : arrays with exactly the shapes of q, k, v (summed over broadcast dims),
        float64 by default, else ``dtype``. Padded rows/keys and rows that see no key get 0.
    """
    _accept_precision(precision, q)
    shapes = (q.shape, k.shape, v.shape)
    xp, rnd, (dout, q, k, v), scale, ext = _prepare((dout, q, k, v), dtype, scale, causal, extensions)
    dout, q, k, v = ext.valid_rows(dout), ext.valid_rows(q), ext.valid_keys(k), ext.valid_keys(v)
    P, Pd, T, out, _ = _forward(q, k, v, causal, scale, rnd, ext)
    dv = rnd(xp.swapaxes(Pd, -1, -2) @ dout)
    dP = rnd(dout @ xp.swapaxes(v, -1, -2))
    if ext.keep is not None:
        dP = rnd(xp.where(ext.keep, dP / (1.0 - ext.p), dP.dtype.type(0)))
    Dsum = (dout * out).sum(axis=-1, keepdims=True)
    dS = rnd(P * (dP - Dsum))
    if T is not None:
        dS = rnd(dS * (1.0 - T * T))
    dq = rnd(rnd(dS @ k) * scale)
    dk = rnd(rnd(xp.swapaxes(dS, -1, -2) @ q) * scale)
    grads = [reduce_to_shape(g, s) for g, s in zip((dq, dk, dv), shapes)]
    return tuple(xp.ascontiguousarray(g).astype(rnd.p) for g in grads)


attention.__doc__ = attention.__doc__ % _EXT_DOC


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
