"""flash_attention_varlen: packed variable-length batches (FlashAttention-2's ``cu_seqlens`` form).

Sequence ``b`` occupies the rows ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]`` of ``q (total_q, H, D)``
and ``cu_seqlens_k[b] : cu_seqlens_k[b + 1]`` of ``k, v (total_k, Hk, D[v])``; query head ``h``
reads key/value head ``h // G`` (``G = H / Hk``, GQA/MQA).

How it is computed (honestly): the packed rows are **scattered into padded arrays**
``(B, Hk, G, max_q, D)`` / ``(B, Hk, 1, max_k, D)`` (the GQA view: k and v broadcast over the ``G``
query heads of their group), the padded call runs with ``seqlens_q``/``seqlens_k`` (so padding is
never read and every feature of docs/extensions.md applies per sequence), and the results are
gathered back to the packed rows. That costs the padded copies (``B · max_len`` rows instead of
``total`` rows, and O(B·max_len) extra memory); a kernel that reads the packed rows in place can
replace it later without changing this interface. Batch entry ``(b, h)`` has the flat index
``bh = b·H + h`` (dropout's counter), as in the padded call on ``(B, H, L, D)`` arrays.
"""
import numpy as np

from . import validation as val
from .api import flash_attention_backward, flash_attention_forward


class _Packing:
    """The validated layout of one packed call: lengths, padded sizes and row indices."""

    def __init__(self, q, k, v, cu_seqlens_q, cu_seqlens_k):
        self.kind, self.dtype = val.check_arrays([("q", q), ("k", k), ("v", v)])
        self.xp = np if self.kind == "numpy" else __import__("cupy")
        _check_packed_shapes(q, k, v)
        self.total_q, self.H, self.D = (int(n) for n in q.shape)
        self.total_k, self.Hk, self.Dv = int(k.shape[0]), int(k.shape[1]), int(v.shape[2])
        self.G = self.H // self.Hk
        cq = _host_cu("cu_seqlens_q", cu_seqlens_q, self.kind, self.total_q, "q")
        ck = _host_cu("cu_seqlens_k", cu_seqlens_k, self.kind, self.total_k, "k")
        if cq.shape != ck.shape:
            raise ValueError("flasharray: cu_seqlens_q and cu_seqlens_k must both have B + 1 entries, got shapes "
                             "%s and %s" % (cq.shape, ck.shape))
        self.B = cq.shape[0] - 1
        lens_q, lens_k = np.diff(cq), np.diff(ck)
        self.max_q = int(lens_q.max()) if self.B else 0
        self.max_k = int(lens_k.max()) if self.B else 0
        self.seqlens_q = self.xp.asarray(lens_q.astype(np.int32))
        self.seqlens_k = self.xp.asarray(lens_k.astype(np.int32))
        self.rows_q = self._rows(cq, lens_q)
        self.rows_k = self._rows(ck, lens_k)

    def _rows(self, cu, lens):
        """``(b, i)`` of every packed row: its sequence and its position in it."""
        b = np.repeat(np.arange(self.B), lens)
        i = np.arange(cu[-1]) - np.repeat(cu[:-1], lens)
        return self.xp.asarray(b), self.xp.asarray(i)

    def pad(self, x, rows, L, fill=0):
        """``x (total, heads, ·)`` -> padded ``(B, heads, L, ·)`` (a fresh array)."""
        b, i = rows
        out = self.xp.full((self.B, L) + tuple(x.shape[1:]), fill, dtype=x.dtype)
        out[b, i] = x
        return self.xp.moveaxis(out, 1, 2)

    def unpad(self, x, rows):
        """Padded ``(B, heads, L, ·)`` -> packed ``(total, heads, ·)``."""
        b, i = rows
        return self.xp.ascontiguousarray(x[b, :, i])

    def queries(self, x, fill=0):
        """``(total_q, H, ·)`` -> the GQA view ``(B, Hk, G, max_q, ·)``."""
        p = self.pad(x, self.rows_q, self.max_q, fill)
        return p.reshape((self.B, self.Hk, self.G) + p.shape[2:])

    def keys(self, x):
        """``(total_k, Hk, ·)`` -> ``(B, Hk, 1, max_k, ·)``."""
        return self.pad(x, self.rows_k, self.max_k)[:, :, None]

    def packed_queries(self, x):
        return self.unpad(x.reshape((self.B, self.H) + x.shape[3:]), self.rows_q)

    def heads_to_groups(self, options):
        """``alibi_slopes`` and ``block_mask`` batch dims given over ``(B, H)`` -> ``(B, Hk, G)``."""
        out = dict(options)
        for name, tail in (("alibi_slopes", 0), ("block_mask", 2)):
            x = options.get(name)
            if x is None or val.array_kind(x) is None or x.ndim < tail:
                continue  # absent, or not an array: the padded call reports it
            shape = tuple(x.shape)
            try:
                full = self.xp.broadcast_to(x, (self.B, self.H) + shape[x.ndim - tail:])
            except ValueError:
                raise ValueError("flasharray: the batch dims of argument %r (shape %s) must broadcast to "
                                 "(B, H) = %s" % (name, shape, (self.B, self.H))) from None
            out[name] = full.reshape((self.B, self.Hk, self.G) + shape[x.ndim - tail:])
        return out


def _check_packed_shapes(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            raise ValueError("flasharray: argument %r must have 3 dims (total, heads, D) in the packed form, "
                             "got shape %s" % (name, tuple(x.shape)))
    if q.shape[2] != k.shape[2] or k.shape[:2] != v.shape[:2]:
        raise ValueError("flasharray: packed shapes must be q (total_q, H, D), k (total_k, Hk, D), v (total_k, "
                         "Hk, Dv); got q %s, k %s, v %s" % (tuple(q.shape), tuple(k.shape), tuple(v.shape)))
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError("flasharray: the query heads H must be a multiple of the key/value heads Hk (GQA), "
                         "got q %s and k %s" % (tuple(q.shape), tuple(k.shape)))


def _host_cu(name, cu, kind, total, of):
    """Validated ``cu_seqlens`` on the host: int32 ``(B + 1,)``, 0, non-decreasing, ``total``."""
    val.check_int32_array(name, cu, kind, 1)
    host = np.asarray(cu.get() if kind == "cupy" else cu).astype(np.int64)
    if host.shape[0] < 1 or host[0] != 0 or host[-1] != total or np.any(np.diff(host) < 0):
        raise ValueError("flasharray: argument %r must be non-decreasing from 0 to the %d rows of %s (%s.shape[0]), "
                         "got %s" % (name, total, of, of, host.tolist() if host.size <= 16 else
                                     "%s ... %s" % (host[:4].tolist(), host[-4:].tolist())))
    return host


def _no_seqlens(options):
    for name in ("seqlens_q", "seqlens_k"):
        if name in options:
            raise TypeError("flasharray: %s does not apply to the packed form (the lengths come from "
                            "cu_seqlens_q/cu_seqlens_k)" % name)


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, scale=None,
                           return_lse=False, backend=None, **options):
    """Attention over packed variable-length sequences (FlashAttention-2's ``varlen`` form).

    Parameters
    ----------
    q : array, shape (total_q, H, D)
    k : array, shape (total_k, Hk, D)
    v : array, shape (total_k, Hk, Dv)
        Sequences packed along the first axis; ``H % Hk == 0`` (GQA/MQA: query head ``h`` reads
        key/value head ``h // (H / Hk)``). One dtype, as for :func:`flash_attention`.
    cu_seqlens_q, cu_seqlens_k : int32 arrays, shape (B + 1,)
        Cumulative lengths: sequence ``b`` is rows ``cu[b] : cu[b + 1]``; non-decreasing from 0
        to ``total_q`` / ``total_k`` (empty sequences allowed). Same array library as q.
    causal, scale, return_lse, backend : as for :func:`flash_attention`; causal is bottom-right
        aligned within each sequence.
    **options
        The extension keywords of docs/extensions.md except ``seqlens_q``/``seqlens_k``; batch
        entries are ``(b, h)`` (``alibi_slopes`` broadcast to ``(B, H)``; ``block_mask``
        ``(..., ceil(max_q/Bq), ceil(max_k/Bk))`` with batch dims broadcast to ``(B, H)``, ``max_q``
        and ``max_k`` the longest sequences; dropout's ``bh = b·H + h``), and the backend options.

    Returns
    -------
    out : array, shape (total_q, H, Dv), the input dtype
    lse : array, shape (H, total_q), float32 (float64 for float64 inputs), only if ``return_lse``
        (FlashAttention-2's packed lse layout).

    Notes
    -----
    Computed by scattering into padded ``(B, ·, max_len, ·)`` arrays, the padded call with
    ``seqlens_q``/``seqlens_k``, and a gather back (see the module docstring): exact, but it costs
    the padded copies.
    """
    if return_lse is not False and return_lse is not True:
        val.check_flag("return_lse", return_lse)
    _no_seqlens(options)
    pk = _Packing(q, k, v, cu_seqlens_q, cu_seqlens_k)
    out, lse = flash_attention_forward(pk.queries(q), pk.keys(k), pk.keys(v), causal=causal, scale=scale,
                                       backend=backend, seqlens_q=pk.seqlens_q, seqlens_k=pk.seqlens_k,
                                       **pk.heads_to_groups(options))
    out = pk.packed_queries(out)
    if not return_lse:
        return out
    return out, pk.xp.ascontiguousarray(pk.packed_queries(lse[..., None])[..., 0].T)


def flash_attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, causal=False,
                                    scale=None, backend=None, deterministic=True, **options):
    """Gradients of ``Σ dout ∘ flash_attention_varlen(q, k, v, ...)``.

    Parameters
    ----------
    dout, out : arrays, shape (total_q, H, Dv), the dtype of q
    q, k, v, cu_seqlens_q, cu_seqlens_k : as for :func:`flash_attention_varlen`.
    lse : array, shape (H, total_q): the lse returned by the forward (``return_lse=True``).
    causal, scale, backend, deterministic, **options : as for :func:`flash_attention_backward`;
        they must match the forward call.

    Returns
    -------
    dq, dk, dv : arrays with the packed shapes of q, k, v; dk and dv summed over the query heads
        of their group.
    """
    _no_seqlens(options)
    pk = _Packing(q, k, v, cu_seqlens_q, cu_seqlens_k)
    val.check_arrays([("q", q), ("dout", dout), ("out", out)])
    val.check_expected_shape("dout", dout, (pk.total_q, pk.H, pk.Dv))
    val.check_expected_shape("out", out, (pk.total_q, pk.H, pk.Dv))
    val.check_lse(lse, pk.kind, pk.dtype, (pk.H, pk.total_q))
    lse_pad = pk.queries(lse.T[..., None], fill=-np.inf)[..., 0]  # padded rows: never read
    dq, dk, dv = flash_attention_backward(pk.queries(dout), pk.queries(q), pk.keys(k), pk.keys(v), pk.queries(out),
                                          lse_pad, causal=causal, scale=scale, backend=backend,
                                          deterministic=deterministic, seqlens_q=pk.seqlens_q,
                                          seqlens_k=pk.seqlens_k, **pk.heads_to_groups(options))
    return pk.packed_queries(dq), pk.unpad(dk[:, :, 0], pk.rows_k), pk.unpad(dv[:, :, 0], pk.rows_k)
