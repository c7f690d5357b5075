"""flash_attention_with_kvcache: attention over a KV cache, appending new keys in place.

One call of incremental decoding (issue 10 §3). For every entry ``b`` of the first batch dim:

1. the new keys/values ``k_new[b], v_new[b]`` (``L_new`` rows) are written into the cache at the
   logical rows ``cache_seqlens[b] … cache_seqlens[b] + L_new - 1``;
2. the ``Lq`` queries ``q[b]`` attend to the ``n_b = cache_seqlens[b] + L_new`` visible keys,
   causal bottom-right within them (the queries are the last ``Lq`` positions).

Order of work: validate every argument (types and shapes, then the values of ``cache_seqlens`` and
``block_table``, brought to the host in one small copy for CuPy), then write, then attend — so a
refused call writes nothing.

Attention per backend:

* ``cuda``/``emulator``, every dtype, contiguous or paged: one forward launch over every entry
  (:func:`cuda_forward.forward_kvcache`: the tensor-core forward for float16/bfloat16, the SIMT one
  for float32/float64), the kernel reading each entry's ``n_b`` (and its block-table row) on the
  device; pages are read in place. The forward is planned during validation, so a call the kernel
  refuses (e.g. ``num_splits`` on the SIMT kernel) writes nothing;
* contiguous cache, ``cpu``: the public forward on views ``k_cache[b0:b1, :, :n]`` (no copy), one
  call per run of consecutive entries with equal ``n_b``;
* paged cache, ``cpu``: chunk by chunk of whole pages (``STAGE_ROWS`` keys; a page of that size
  or larger is a view ``k_cache[block_table[b, p]]``, smaller pages are staged into one bounded
  buffer), each chunk's attention (causal mask aligned to the entry's full key range) merged into
  the running result by the log-sum-exp rule (:func:`merge_attention`); the cache is never
  gathered whole;
* GQA packing, every path: for decoding (Lq = 1) or without a mask, the query heads sharing a KV
  head are stacked as rows of one problem (:func:`_packable`), so K/V are read once per KV head.
"""
import numpy as np

from . import api
from . import validation as val
from .api import flash_attention_forward
from .dtypes import accumulation_dtype
from .merge import merge_attention
from .precision import check_precision

# A page holds a whole number of the kernels' 16-row key sub-tiles (mma k-dimension).
PAGE_MULTIPLE = 16
# cpu, paged: keys per attention call. Smaller pages are staged, this many rows at a time, into one
# buffer (the cpu forward copies every key tile into an augmented buffer anyway); larger pages are
# used as views. Never the whole cache: memory stays O(STAGE_ROWS·D) per entry.
STAGE_ROWS = 512


def _shape(x):
    return tuple(int(n) for n in x.shape)


class _KVCall:
    """Validated arguments of one ``flash_attention_with_kvcache`` call (types and shapes)."""

    def __init__(self, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal, scale,
                 backend):
        if (k_new is None) != (v_new is None):
            raise ValueError("flasharray: k_new and v_new go together, got k_new %s and v_new %s"
                             % ("None" if k_new is None else _shape(k_new),
                                "None" if v_new is None else _shape(v_new)))
        named = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)]
        if k_new is not None:
            named += [("k_new", k_new), ("v_new", v_new)]
        self.kind, self.dtype = val.check_arrays(named)
        self.q, self.k_cache, self.v_cache, self.k_new, self.v_new = q, k_cache, v_cache, k_new, v_new
        self.seqlens, self.block_table = cache_seqlens, block_table
        self.causal = val.check_flag("causal", causal)
        self.backend = val.check_backend(backend, self.kind)
        self.paged = block_table is not None
        self._check_cache_shapes()
        self.scale = val.check_scale(scale, self.D)
        self._check_q()
        self._check_index_arrays()
        self._check_new()

    def _check_cache_shapes(self):
        k, v = self.k_cache, self.v_cache
        layout = "(num_blocks, H_kv, page_size, D)" if self.paged else "(B, H_kv, L_cache, D)"
        for name, x in (("k_cache", k), ("v_cache", v)):
            if x.ndim != 4:
                raise ValueError("flasharray: argument %r must have 4 dims %s, got shape %s"
                                 % (name, layout, _shape(x)))
        if k.shape[:3] != v.shape[:3]:
            raise ValueError("flasharray: k_cache and v_cache must agree on their first three dims %s,"
                             " got k_cache.shape=%s and v_cache.shape=%s" % (layout[:-4] + ")", _shape(k),
                                                                             _shape(v)))
        self.H_kv, self.L_cache, self.D = int(k.shape[1]), int(k.shape[2]), int(k.shape[3])
        self.Dv = int(v.shape[3])
        if self.paged and (self.L_cache == 0 or self.L_cache % PAGE_MULTIPLE):
            raise ValueError("flasharray: the page size (axis 2 of the paged k_cache) must be a positive "
                             "multiple of %d, got k_cache.shape=%s" % (PAGE_MULTIPLE, _shape(k)))

    def _check_q(self):
        q = self.q
        if q.ndim not in (4, 5):
            raise ValueError("flasharray: argument 'q' must be (B, H, Lq, D) or, for GQA, "
                             "(B, H_kv, G, Lq, D), got shape %s" % (_shape(q),))
        if q.shape[-1] != self.D:
            raise ValueError("flasharray: q and k_cache must have the same head dim D (last axis), got "
                             "q.shape=%s and k_cache.shape=%s" % (_shape(q), _shape(self.k_cache)))
        self.B, self.Lq = int(q.shape[0]), int(q.shape[-2])
        if not self.paged and self.k_cache.shape[0] != self.B:
            raise ValueError("flasharray: k_cache must hold one entry per batch entry of q (axis 0), got "
                             "q.shape=%s and k_cache.shape=%s" % (_shape(q), _shape(self.k_cache)))
        # Per entry the cache is (H_kv, L, D), seen as (H_kv, 1, L, D) against a GQA q.
        self.gqa = q.ndim == 5
        heads = (self.H_kv, 1) if self.gqa else (self.H_kv,)
        try:
            self.batch_shape = (self.B,) + tuple(np.broadcast_shapes(tuple(q.shape[1:-2]), heads))
        except ValueError:
            raise ValueError("flasharray: the head dims of q %s do not broadcast with the cache's %s "
                             "(q.shape=%s, k_cache.shape=%s; for GQA use q (B, H_kv, G, Lq, D))"
                             % (_shape(q)[1:-2], heads, _shape(q), _shape(self.k_cache))) from None

    def _check_index_arrays(self):
        val.check_int32_array("cache_seqlens", self.seqlens, self.kind, 1)
        if _shape(self.seqlens) != (self.B,):
            raise ValueError("flasharray: argument 'cache_seqlens' must have shape (B,) = (%d,) (one "
                             "length per entry of q's first dim), got %s" % (self.B, _shape(self.seqlens)))
        self.capacity = self.L_cache
        if self.paged:
            val.check_int32_array("block_table", self.block_table, self.kind, 2)
            if self.block_table.shape[0] != self.B:
                raise ValueError("flasharray: argument 'block_table' must have shape (B, max_blocks) "
                                 "with B = %d, got %s" % (self.B, _shape(self.block_table)))
            self.capacity = int(self.block_table.shape[1]) * self.L_cache

    def _check_new(self):
        self.L_new = 0
        if self.k_new is None:
            return
        L_new = int(self.k_new.shape[-2]) if self.k_new.ndim >= 2 else 0
        for name, x, d in (("k_new", self.k_new, self.D), ("v_new", self.v_new, self.Dv)):
            want = (self.B, self.H_kv, L_new, d)
            if x.ndim != 4 or _shape(x) != want:
                raise ValueError("flasharray: argument %r must have shape (B, H_kv, L_new, %s) = %s (B from "
                                 "q, H_kv and the head dims from the cache, L_new from k_new), got %s"
                                 % (name, "D" if name == "k_new" else "Dv", want, _shape(x)))
        self.L_new = L_new
        val.check_writeable("k_cache", self.k_cache)
        val.check_writeable("v_cache", self.v_cache)

    @property
    def page_size(self):
        return self.L_cache

    def forget_arrays(self):
        """Drop the arrays (a cached call must not keep the caller's memory alive)."""
        self.q = self.k_cache = self.v_cache = self.k_new = self.v_new = self.seqlens = self.block_table = None

    def rebind(self, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table):
        """This validated call for other arrays of the same signature."""
        c = object.__new__(type(self))
        c.__dict__.update(self.__dict__)
        c.q, c.k_cache, c.v_cache, c.k_new, c.v_new = q, k_cache, v_cache, k_new, v_new
        c.seqlens, c.block_table = cache_seqlens, block_table
        return c


def _host_values(c):
    """cache_seqlens (and block_table) as host int64 arrays: one device→host copy for CuPy."""
    if c.kind == "numpy":
        table = None if not c.paged else np.asarray(c.block_table, dtype=np.int64)
        return np.asarray(c.seqlens, dtype=np.int64), table
    if not c.paged:  # one copy, no concatenation kernel
        return c.seqlens.get().astype(np.int64), None
    import cupy
    flat = cupy.concatenate([c.seqlens, c.block_table.ravel()]).get().astype(np.int64)
    return flat[:c.B], flat[c.B:].reshape(c.block_table.shape)


#: cache_seqlens of at most this many entries are range-checked as Python ints (for a few entries
#: cheaper than the two NumPy reductions).
FEW_ENTRIES = 8


def _check_values(c, seqlens, table):
    """Lengths within the cache and block-table entries within the pool, for the rows touched."""
    lengths = seqlens + c.L_new
    if not c.paged and seqlens.size:
        # the common case: for a few entries as Python ints (cheaper than two reductions); the
        # loop below names the culprit
        few = seqlens.tolist() if seqlens.size <= FEW_ENTRIES else None
        if (min(few) >= 0 and max(few) + c.L_new <= c.capacity if few is not None
                else seqlens.min() >= 0 and lengths.max() <= c.capacity):
            return lengths
    bad = np.flatnonzero(seqlens < 0)
    if bad.size:
        raise ValueError("flasharray: cache_seqlens must be >= 0, got cache_seqlens[%d] = %d"
                         % (bad[0], seqlens[bad[0]]))
    over = np.flatnonzero(lengths > c.capacity)
    if over.size:
        b = over[0]
        where = ("max_blocks·page_size = %d·%d" % (table.shape[1], c.page_size) if c.paged
                 else "L_cache")
        raise ValueError("flasharray: cache_seqlens[%d] + L_new = %d + %d = %d exceeds the cache capacity "
                         "%s = %d; nothing was written" % (b, seqlens[b], c.L_new, lengths[b], where,
                                                           c.capacity))
    if c.paged:
        num_blocks = int(c.k_cache.shape[0])
        touched = np.arange(table.shape[1]) < -(-lengths[:, None] // c.page_size)   # pages in use
        wrong = np.argwhere(touched & ((table < 0) | (table >= num_blocks)))
        if wrong.size:
            b, p = wrong[0]
            raise ValueError("flasharray: block_table[%d, %d] = %d is outside [0, num_blocks = %d) and "
                             "entry %d uses it (%d visible keys)" % (b, p, table[b, p], num_blocks, b,
                                                                     lengths[b]))
    return lengths


#: Contiguous caches of at most this many entries are written entry by entry (a slice each: for
#: one or two entries cheaper than building the index arrays, on the host and on a GPU alike).
SLICE_WRITE_ENTRIES = 2


def _write_new(c, seqlens):
    """k_new/v_new into the cache at logical rows cache_seqlens[b] + t (``seqlens``: their host
    values, or None: not read back), by slices for a few entries of a contiguous cache whose values
    are on the host, else by array indexing (on the arrays' device)."""
    if c.L_new == 0 or c.B == 0:
        return
    if not c.paged and c.B <= SLICE_WRITE_ENTRIES and seqlens is not None:
        for b, start in enumerate(seqlens.tolist()):
            c.k_cache[b, :, start:start + c.L_new] = c.k_new[b]
            c.v_cache[b, :, start:start + c.L_new] = c.v_new[b]
        return
    xp = np if c.kind == "numpy" else __import__("cupy")
    rows = c.seqlens.astype(xp.int64)[:, None] + xp.arange(c.L_new)       # (B, L_new) logical rows
    if c.paged:
        pages = xp.take_along_axis(c.block_table, rows // c.page_size, axis=1)
        index = (pages, slice(None), rows % c.page_size)
    else:
        index = (xp.arange(c.B)[:, None], slice(None), rows)
    # Advanced indices around a slice put their (B, L_new) dims first: values are (B, L_new, H_kv, D).
    c.k_cache[index] = xp.swapaxes(c.k_new, 1, 2)
    c.v_cache[index] = xp.swapaxes(c.v_new, 1, 2)


def _runs(lengths):
    """(b0, b1, n): maximal runs of consecutive entries with the same number of visible keys."""
    b0 = 0
    for b in range(1, len(lengths) + 1):
        if b == len(lengths) or lengths[b] != lengths[b0]:
            yield b0, b, int(lengths[b0])
            b0 = b


def _outputs(c, xp, dtype):
    out = xp.empty(c.batch_shape + (c.Lq, c.Dv), dtype=dtype)
    lse = xp.empty(c.batch_shape + (c.Lq,), dtype=accumulation_dtype(c.dtype))
    return out, lse


def _as_keys(c, x):
    """A per-entry cache view (…, H_kv, L, D) with the size-1 group axis GQA broadcasting needs."""
    return x[..., None, :, :] if c.gqa else x


def _attend_contiguous(c, lengths):
    """The public forward on views of the cache, one call per run of entries with equal lengths
    (a single call when every entry sees as many keys: prefill, lock-step decoding)."""
    runs = list(_runs(lengths))
    if len(runs) == 1:
        return _forward_on_view(c, slice(None), runs[0][2])
    xp = np if c.kind == "numpy" else __import__("cupy")
    out, lse = _outputs(c, xp, c.dtype)
    for b0, b1, n in runs:
        out[b0:b1], lse[b0:b1] = _forward_on_view(c, slice(b0, b1), n)
    return out, lse


def _check_num_splits(num_splits, backend):
    if num_splits is None:
        return None
    if backend == "cpu":
        raise TypeError("flasharray: option 'num_splits' only applies to backend='cuda' or 'emulator' "
                        "(got backend='cpu'; use num_splits=None)")
    from . import cuda_forward
    return cuda_forward.check_num_splits(num_splits)


def _forward_on_view(c, entries, n):
    """Attention of q[entries] over the first n keys of cache entries ``entries`` (views)."""
    q, k, v = c.q[entries], c.k_cache[entries, :, :n], c.v_cache[entries, :, :n]
    packed = _packable(c)
    opts = {} if getattr(c, "num_splits", None) is None else {"num_splits": c.num_splits}
    out, lse = flash_attention_forward(_pack(q) if packed else q, _as_keys(c, k), _as_keys(c, v),
                                       causal=c.causal and not packed, scale=c.scale, backend=c.backend, **opts)
    batch = (out.shape[0],) + c.batch_shape[1:]
    return out.reshape(batch + (c.Lq, c.Dv)), lse.reshape(batch + (c.Lq,))


def _packable(c):
    """GQA packing applies: the query heads that share a KV head (G of a 5-dim q; H of a 4-dim q
    against H_kv = 1) can be stacked as the rows of one problem, so that K and V are read once per
    KV head instead of once per query head. Every row of a head must see the same keys: no causal
    mask, or Lq = 1 (where it hides nothing); the packed problem is computed without a mask."""
    if c.causal and c.Lq > 1:
        return False
    return c.q.shape[-3] > 1 and (c.gqa or c.H_kv == 1)


def _pack(q):
    """(…, G, Lq, D) → (…, 1, G·Lq, D): the group's queries as rows (a view when q allows it)."""
    return q.reshape(q.shape[:-3] + (1, q.shape[-3] * q.shape[-2], q.shape[-1]))


def _chunk_attention(q, k, v, a, e, n, causal, scale):
    """Attention of all Lq queries to the keys [a, e) of an entry with n visible keys.

    With the causal mask, query i sees key j iff j <= i + n - Lq. On the chunk (local key
    j' = j - a) that is the bottom-right mask of the query prefix [0, i1) with i1 = Lq - (n - e);
    queries from i1 on see the whole chunk.
    """
    Lq = q.shape[-2]
    i1 = min(max(Lq - (n - e), 0), Lq) if causal else 0
    if i1 in (0, Lq):
        return flash_attention_forward(q, k, v, causal=i1 == Lq, scale=scale, backend="cpu")
    top = flash_attention_forward(q[..., :i1, :], k, v, causal=True, scale=scale, backend="cpu")
    rest = flash_attention_forward(q[..., i1:, :], k, v, causal=False, scale=scale, backend="cpu")
    return np.concatenate([top[0], rest[0]], axis=-2), np.concatenate([top[1], rest[1]], axis=-1)


def _attend_paged_cpu(c, lengths, table):
    """Chunk by chunk of at most ``STAGE_ROWS`` keys (whole pages), merged by log-sum-exp; computed
    in the accumulation dtype (as the cpu backend computes float16/bfloat16), rounded once."""
    acc = accumulation_dtype(c.dtype)
    out, lse = _outputs(c, np, acc)
    packed = _packable(c)
    for b, n in enumerate(int(x) for x in lengths):
        q = c.q[b].astype(acc, copy=False)
        o, s = _paged_entry(c, _pack(q) if packed else q, table[b], n, c.causal and not packed, acc)
        out[b], lse[b] = (0, -np.inf) if o is None else (o.reshape(out.shape[1:]), s.reshape(lse.shape[1:]))
    return out.astype(c.dtype), lse


def _paged_entry(c, q, pages_b, n, causal, acc):
    """(out, lse) of one entry's queries over its n keys, read through its row of the block table;
    (None, None) when n = 0 (no visible key: the caller writes out = 0, lse = -inf)."""
    ps = c.page_size
    chunk = ps * max(1, STAGE_ROWS // ps)
    out = lse = None
    for a in range(0, n, chunk):
        e = min(a + chunk, n)
        pages = pages_b[a // ps:-(-e // ps)]
        k = _as_keys(c, _stage(c.k_cache, pages, e - a, acc))
        v = _as_keys(c, _stage(c.v_cache, pages, e - a, acc))
        o, s = _chunk_attention(q, k, v, a, e, n, causal, c.scale)
        out, lse = (o, s) if lse is None else merge_attention([out, o], [lse, s])
    return out, lse


def _stage(cache, pages, rows, acc):
    """The first ``rows`` keys of the given pages as (H_kv, rows, ·) in ``acc``: a view of the page
    when there is one (float32/float64), else one pass over the page views into a staging buffer."""
    views = [cache[p] for p in pages]
    views[-1] = views[-1][:, :rows - (len(views) - 1) * cache.shape[2]]
    if len(views) == 1:
        return views[0].astype(acc, copy=False)
    return np.concatenate(views, axis=1, dtype=acc)


_USES_KERNEL = {}


def _uses_kernel(c):
    """cuda / emulator: one forward launch over every entry (tensor cores for float16/bfloat16,
    SIMT otherwise), reading each entry's key count (and pages) on the device. Remembered per
    (dtype, head dims, backend, CuPy's current device)."""
    if c.backend == "cpu":
        return False
    key = (c.dtype, c.D, c.Dv, c.backend, __import__("cupy").cuda.runtime.getDevice() if c.backend == "cuda" else None)
    uses = _USES_KERNEL.get(key)
    if uses is None:
        from . import cuda_forward
        uses = _USES_KERNEL[key] = cuda_forward.kvcache_kernel(c.dtype, c.D, c.Dv, c.backend)
    return uses


def _register_clear():
    from . import launch
    launch._on_reload.append(_USES_KERNEL.clear)


_register_clear()


def _attend_kernel(c, lengths):
    """:func:`cuda_forward.forward_kvcache` over the whole cache: entry b sees its first
    ``lengths[b] = cache_seqlens[b] + L_new`` keys (int32 (B,) on the arrays' device), contiguous or
    through its row of the block table (pages read in place); one forward launch (+ the split-KV
    combine) whatever the lengths."""
    from . import cuda_forward
    return cuda_forward.forward_kvcache(c.q, c.k_cache, c.v_cache, lengths, c.block_table, causal=c.causal,
                                        scale=c.scale, device=c.backend, num_splits=c.num_splits, memo=c.memo)


# ---- the append kernel (kernel backends) ---------------------------------------------------------
APPEND_SOURCE = "flash_kv_append.cu"
APPEND_THREADS = 64
_APPEND_CTYPES = {"float16": "fa_half", "bfloat16": "fa_bf16", "float32": "float", "float64": "double"}


def _append_plan(c):
    """The append's launch (``flash_kv_append_kernel``: k_new, v_new into the cache and the key counts
    ``cache_seqlens + L_new``, every entry in one launch), prepared at validation as a
    :class:`launch.Recorded` whose array slots are keyed by argument name; None where the writes stay
    with array indexing (no new keys, or a head dim whose elements are not contiguous)."""
    from . import launch as L
    arrays = (c.k_cache, c.v_cache, c.k_new, c.v_new)
    if c.L_new == 0 or c.B == 0 or any(L.element_strides(a)[-1] != 1 for a in arrays):
        return None
    launcher = L.make_launcher(c.backend, schedule="forward", seed=0)
    strides = [tuple(L.c_longlong(x) for x in L.element_strides(a)[:3]) for a in arrays]
    table_row = L.element_strides(c.block_table)[0] if c.paged else 0
    args = (L.Ptr("k_cache"), *strides[0], L.Ptr("v_cache"), *strides[1], L.Ptr("k_new"), *strides[2],
            L.Ptr("v_new"), *strides[3], L.Ptr("seqlens"), L.Ptr("lengths"), L.Ptr("table" if c.paged else "seqlens"),
            L.c_longlong(table_row), L.c_int(c.page_size), L.c_int(c.L_new), L.c_int(c.D), L.c_int(c.Dv),
            L.c_int(1 if c.paged else 0))
    name = "flash_kv_append_kernel<%s>" % _APPEND_CTYPES[np.dtype(c.dtype).name]
    return launcher, L.Recorded(launcher, APPEND_SOURCE, name, (c.L_new, c.H_kv, c.B), (APPEND_THREADS, 1, 1), args)


def _append(c):
    """Run the prepared append for this call's arrays; returns the key counts (int32 (B,), new)."""
    launcher, rec = c.append
    lengths = launcher.empty((c.B,), np.int32)
    h = launcher.handle
    handles = {"k_cache": h(c.k_cache), "v_cache": h(c.v_cache), "k_new": h(c.k_new), "v_new": h(c.v_new),
               "seqlens": h(c.seqlens), "lengths": h(lengths)}
    if c.paged:
        handles["table"] = h(c.block_table)
    rec(launcher.pointer, handles)
    return lengths


def flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, *, k_new=None, v_new=None,
                                 block_table=None, causal=True, scale=None, return_lse=False,
                                 backend=None, num_splits=None, precision=None, check_values=True):
    """Attention over a KV cache for incremental decoding; appends ``k_new``/``v_new`` in place.

    For each entry ``b`` of the first batch dim: writes ``k_new[b]``, ``v_new[b]`` into the cache
    at the logical rows ``cache_seqlens[b] … cache_seqlens[b] + L_new - 1``, then computes the
    attention of ``q[b]`` over the first ``n_b = cache_seqlens[b] + L_new`` keys of the cache.

    Parameters
    ----------
    q : array, shape (B, H, Lq, D), or (B, H_kv, G, Lq, D) for GQA
        Queries. The head dims broadcast against the cache's ``(H_kv,)`` — or ``(H_kv, 1)`` for a
        5-dim q — by NumPy rules (``H == H_kv``, or MQA with ``H_kv == 1``). ``Lq`` may differ
        from ``L_new``: the queries are the last ``Lq`` positions of the entry's keys.
    k_cache : array, shape (B, H_kv, L_cache, D), or (num_blocks, H_kv, page_size, D) when paged
    v_cache : array, shape (B, H_kv, L_cache, Dv), or (num_blocks, H_kv, page_size, Dv) when paged
        The cache; any strides. Rows at and past ``n_b`` are never read. Written in place when
        ``k_new`` is given (it must then be writable).
    cache_seqlens : int32 array, shape (B,)
        Keys already in the cache per entry; NumPy for NumPy q, CuPy for CuPy q. **Not advanced by
        this function**: after the call the caller adds ``L_new``.
    k_new, v_new : arrays (B, H_kv, L_new, D) and (B, H_kv, L_new, Dv), optional (both or neither)
        Keys/values of the new tokens; dtype of q.
    block_table : int32 array, shape (B, max_blocks), optional
        Selects a paged cache: logical key row ``r`` of entry ``b`` lives in page
        ``block_table[b, r // page_size]`` at row ``r % page_size``; ``page_size`` (axis 2 of the
        caches) must be a multiple of 16. Only the pages an entry touches (``ceil(n_b /
        page_size)``) must be valid indices into ``[0, num_blocks)``; the rest are ignored.
        Entries must not share the pages they write.
    causal : bool, default True
        Bottom-right aligned within the visible keys: query ``i`` sees key ``j`` iff
        ``j <= i + n_b - Lq``.
    scale : float, optional
        Softmax scale; default ``1/sqrt(D)``.
    return_lse : bool, default False
        Also return the row log-sum-exp.
    backend : {None, "cpu", "cuda", "emulator"}
        As for :func:`flash_attention`. On ``cuda``/``emulator`` every dtype takes one forward launch
        for every entry (paged: pages read in place): tensor cores for float16/bfloat16, the SIMT
        kernel for float32/float64.
    num_splits : None or int, optional
        ``cuda``/``emulator`` only: force the split-KV count of the forward (as
        :func:`flash_attention_forward`; tensor-core kernel only); None picks it.
    precision : {None, "ieee", "tf32", "3xtf32"}, optional
        Validated as for :func:`flash_attention_forward` (a precision that does not apply to the
        dtype is a ``ValueError``); the KV-cache forward computes float32 in IEEE arithmetic
        whatever its value (the TF32 kernel has no KV-cache variant yet: docs/precision.md).
    check_values : bool, default True
        Check the values of ``cache_seqlens`` (and the pages of ``block_table`` an entry touches)
        before anything is written, raising ``ValueError`` for one out of range. For CuPy arrays
        that is a device→host copy, which synchronises with the GPU every call. ``False`` skips it:
        nothing is read back, so a decoding loop's calls queue up behind the GPU's work; values out
        of range are then undefined behaviour (out-of-bounds reads and writes), as in
        FlashAttention-2. The cpu backend reads the values either way (it computes on the host).

    Returns
    -------
    out : array (B, *heads, Lq, Dv), dtype of q
    lse : array (B, *heads, Lq), float32 (float64 for float64), only with ``return_lse``.
        A row that sees no key (``n_b = 0``, or causal with ``Lq > n_b``) has out 0, lse -inf.

    Notes
    -----
    Everything is validated before anything is written: a refused call leaves the cache as it was.
    For CuPy arrays the values of ``cache_seqlens`` (and ``block_table``) are checked on the host,
    which costs one small device→host copy (a synchronisation) per call (``check_values=False``
    skips it). Inputs other than the cache are never modified. See ``docs/kvcache.md`` for what
    each backend does.
    """
    arrays = (q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table)
    flags = (causal, scale, return_lse, num_splits, precision, check_values)
    key = _call_key(arrays, flags, backend)
    entry = _CALLS.get(key)
    if entry is None:
        entry = _validate(arrays, flags, backend)
        if key is not None:
            if len(_CALLS) >= api._MAX_ENTRIES:
                _CALLS.pop(next(iter(_CALLS)))
            _CALLS[key] = entry
    c = entry.rebind(*arrays)
    if c.kernel:
        return _kernel_call(c)
    # The values of cache_seqlens and block_table change from call to call: checked every time.
    seqlens, table = _host_values(c)
    lengths = _check_values(c, seqlens, table) if c.check_values else seqlens + c.L_new
    _write_new(c, seqlens)
    if not c.paged:
        out, lse = _attend_contiguous(c, lengths)
    else:
        out, lse = _attend_paged_cpu(c, lengths, table)
    return (out, lse) if c.return_lse else out


def _kernel_call(c):
    """A call on the kernel backends: the values checked on the host (unless ``check_values=False``:
    nothing read back), the append kernel (new keys and the key counts, one launch), the forward."""
    seqlens = None
    if c.check_values:  # the values of cache_seqlens and block_table change from call to call
        seqlens, table = _host_values(c)
        _check_values(c, seqlens, table)
    if c.append is not None:
        lengths = _append(c)
    else:
        _write_new(c, seqlens)
        lengths = c.seqlens + np.int32(c.L_new)  # int32 (B,), on the arrays' device
    out, lse = _attend_kernel(c, lengths)
    return (out, lse) if c.return_lse else out


# ---- call-signature cache ------------------------------------------------------------------------
# As the api's (api._call_key): a repeated call with the same array types, dtypes, shapes, strides,
# alignment, device, writability of the caches and flags skips the validation of types and shapes,
# the kernel-path decision and the forward plan's signature. What depends on the values of
# cache_seqlens and block_table (_check_values) is done at every call.

_CALLS = {}


def _index_key(a, backend):
    """Signature of an index array (cache_seqlens, block_table) or of k_new/v_new: their alignment
    plays no part (the kernel reads the index arrays by int32 loads; k_new/v_new are copied)."""
    if type(a) is np.ndarray:
        return a.dtype, a.shape, a.strides
    return None if a is None else api._array_key(a, backend)


def _call_key(arrays, flags, backend):
    """Hashable signature of one call, or None (then it is validated fully and not kept)."""
    q, k_cache, v_cache = arrays[:3]
    try:
        key = (backend, tuple(map(type, flags)), flags, api._array_key(q, backend),
               api._array_key(k_cache, backend), api._array_key(v_cache, backend),
               *[_index_key(a, backend) for a in arrays[3:]])
        if type(q) is np.ndarray:
            if arrays[4] is not None:  # a read-only cache is refused (check_writeable)
                key += (k_cache.flags.writeable, v_cache.flags.writeable)
        else:
            import cupy
            key += (cupy.cuda.runtime.getDevice(),)
        hash(key)
        return key
    except (TypeError, AttributeError):
        return None


def _validate(arrays, flags, backend):
    """The validated call (:class:`_KVCall`, arrays dropped) for this signature; raises for a
    refused one before anything is written."""
    causal, scale, return_lse, num_splits, precision, check_values = flags
    return_lse = val.check_flag("return_lse", return_lse)
    check_values = val.check_flag("check_values", check_values)
    q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table = arrays
    c = _KVCall(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal, scale, backend)
    check_precision(precision, c.dtype)  # accepted; the KV-cache forward is IEEE (no TF32 variant)
    c.num_splits = _check_num_splits(num_splits, c.backend)
    c.return_lse = return_lse
    c.check_values = check_values
    c.kernel = _uses_kernel(c)
    c.memo = {}  # forward_kvcache keeps its plan here
    c.append = _append_plan(c) if c.kernel else None
    if c.kernel:  # planned now: what the kernel refuses is refused before anything is written
        from . import cuda_forward
        c.memo["plan"] = cuda_forward._kvcache_plan(c.q, c.k_cache, c.v_cache, c.block_table, causal=c.causal,
                                                    scale=c.scale, device=c.backend, arch=None, schedule="forward",
                                                    seed=0, num_splits=c.num_splits, pack_gqa=None)
    c.forget_arrays()
    return c


def _register_clear_calls():
    from . import launch
    launch._on_reload.append(_CALLS.clear)


_register_clear_calls()
