"""The ``cpu`` backend: FlashAttention's tiled forward and backward on NumPy arrays.

Forward (the paper's Algorithm 1, in the FlashAttention-2 loop order): for each query block
``Q_i`` (Br rows) keep a running row max ``m_i``, running row sum ``l_i`` and an unnormalised
output ``O_i``; for each key block ``K_j, V_j`` (Bc rows)::

    S_ij  = (scale·Q_i) K_jᵀ                       # Br×Bc, BLAS
    m_new = max(m_i, rowmax(S_ij))
    P_ij  = exp(S_ij − m_new)
    l_i   = exp(m_i − m_new)·l_i + rowsum(P_ij)
    O_i   = exp(m_i − m_new)·O_i + P_ij V_j         # BLAS

and at the end ``O_i /= l_i``, ``lse_i = m_i + log l_i``. Backward recomputes ``P_ij`` from the
saved lse instead of storing it::

    P_ij = exp(S_ij − lse_i),   dV_j += P_ijᵀ dO_i,   dP_ij = dO_i V_jᵀ,
    dS_ij = P_ij ∘ (dP_ij − D_i) with D_i = rowsum(dO_i ∘ O_i),
    dQ_i += scale·dS_ij K_j,    dK_j += scale·dS_ijᵀ Q_i

Two CPU-specific tricks keep the tile loop at two elementwise passes plus two BLAS products:

* **Augmented operands.** A column of ones appended to ``V_j`` makes ``P_ij [V_j | 1]`` return
  ``rowsum(P_ij)`` for free; a column ``-m_i`` appended to ``Q_i`` (against ones appended to
  ``K_j``) makes BLAS return ``S_ij − m_i`` directly. In the backward the same trick yields
  ``S_ij − lse_i`` and ``dP_ij − D_i`` straight from the products.
* **Lazy rescaling.** ``m_i`` is a reference point, not necessarily the exact running max: it
  moves only when a row's new maximum exceeds it by more than ``RESCALE_THRESHOLD`` (natural
  log units), so most tiles need no rescale of ``O_i``. Exact either way — the final division
  by ``l_i`` cancels the reference — and exponents stay ≤ the threshold, so nothing overflows.

Nothing of size Lq×Lk is ever allocated: the largest temporaries are Br×Bc tiles and per-batch
Lq×D / Lk×D buffers. float16/bfloat16 inputs compute in float32, float32 in float32, float64 in
float64. Work items (batch entry × block range) run on a thread pool; BLAS and large NumPy
ufuncs release the GIL, so both cores work.

Calls with extensions (docs/extensions.md: dropout, block_mask, window, ALiBi, softcap, per-entry
lengths) take a separate tiled path at the end of this module (``ext=``); see its header comment.
"""
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import philox
from .blas import single_threaded_blas
from .dtypes import accumulation_dtype
from ..reference import reduce_to_shape

# Tile sizes. Larger tiles amortise the Python overhead per tile and feed BLAS bigger products;
# a Br×Bc float32 tile of 256×512 is 512 KB, which stays in L2 together with K_j and V_j.
BLOCK_Q = 256
BLOCK_K = 512
# Backward tiles: each (key block, query block) step does five products on Br×Bc tiles.
BWD_BLOCK_Q = 256
BWD_BLOCK_K = 256

# Exponents exp(S - m_i) may reach e^8 ≈ 3e3 before m_i is moved: far from overflow in float32
# (l_i ≤ Lk·3e3), and relative precision is unchanged by the scaling.
RESCALE_THRESHOLD = 8.0

_pool = None
_pool_lock = threading.Lock()


def _workers():
    return max(1, int(os.environ.get("FLASHARRAY_CPU_THREADS", os.cpu_count() or 1)))


def _map(fn, items):
    """Run ``fn`` over ``items`` on the shared thread pool (inline when there is one worker)."""
    global _pool
    items = list(items)
    # BLAS stays single-threaded even inline: the pool is how we use the cores, and OpenBLAS's
    # own threads on these small tile products are slower, catastrophically so (measured 15x)
    # when another process keeps a core busy.
    with single_threaded_blas():
        if _workers() == 1 or len(items) <= 1:
            return [fn(it) for it in items]
        with _pool_lock:
            if _pool is None or _pool._max_workers != _workers():
                _pool = ThreadPoolExecutor(max_workers=_workers(), thread_name_prefix="flasharray-cpu")
            pool = _pool
        return list(pool.map(fn, items))


def _augment(x, col, acc):
    """``[x | col]`` as a fresh C-contiguous array in the accumulation dtype."""
    a = np.empty((x.shape[0], x.shape[1] + 1), dtype=acc)
    a[:, :-1] = x
    a[:, -1] = col
    return a


def _batch_index(b, shape):
    """Index into an input whose batch dims are ``shape`` (size 1 where broadcast) for entry b."""
    return tuple(i if n != 1 else 0 for i, n in zip(b, shape))


# Work items aimed for per call. Fixed (not derived from the thread count) so that the split,
# and with it the order of every floating-point sum, is the same on any machine: results are
# bitwise independent of FLASHARRAY_CPU_THREADS.
_TARGET_ITEMS = 16


# The backward keeps one dQ partial (Lq×D) per key chunk of a batch entry, so it splits less.
_TARGET_ITEMS_BWD = 4


def _chunks(n_blocks, n_batch, target=_TARGET_ITEMS):
    """Split ``n_blocks`` blocks per batch entry into contiguous ranges so that there are about
    ``target`` work items (fewer, larger items when the batch alone provides them)."""
    per = max(1, min(n_blocks, -(-target // max(n_batch, 1))))
    step = -(-n_blocks // per)
    return [(s, min(s + step, n_blocks)) for s in range(0, n_blocks, step)]


@functools.lru_cache(maxsize=16)
def _causal_hidden(Br, Bc):
    """Read-only boolean matrix from which every diagonal tile's causal mask is a slice.

    Key ``j0+c`` is hidden from query ``i0+r`` iff ``c - r > d`` with ``d = i0 + offset - j0``.
    ``H[r, x] = (x > r + Bc)``, so ``H[r, c + Bc - d]`` is the tile's mask; every tile that needs
    a mask has ``-(Br-1) <= d <= Bc-2``, hence the width ``2·Bc + Br``. Slicing it avoids
    building a mask per tile; ``copyto(where=)`` writes -inf in one pass (and, unlike adding a
    -inf bias, leaves no NaN from a NaN/inf score the query cannot see).
    """
    H = np.arange(2 * Bc + Br)[None, :] > np.arange(Br)[:, None] + Bc
    H.flags.writeable = False
    return H


def _apply_causal(S_ij, i0, j0, offset, Br, Bc):
    """Set the entries of tile S_ij (rows from i0, cols from j0) hidden by causality to -inf."""
    d = i0 + offset - j0
    rows, cols = S_ij.shape
    np.copyto(S_ij, -np.inf, where=_causal_hidden(Br, Bc)[:rows, Bc - d:Bc - d + cols])


def _key_end(i1, Lk, causal, offset):
    """Exclusive end of the keys any query in [.., i1) sees: the causal loop bound."""
    return min(Lk, i1 + offset) if causal else Lk


def forward(q, k, v, *, causal, scale, batch_shape, ext=None):
    """Tiled forward. q, k, v carry ``len(batch_shape)`` batch dims (size n or 1 each).

    ``ext``: None for a plain call, or an :class:`~.extensions.Extensions` (docs/extensions.md),
    which takes the extension path below. Returns ``out (*batch_shape, Lq, Dv)`` in q's dtype and
    ``lse (*batch_shape, Lq)`` in the accumulation dtype.
    """
    if ext is not None and ext.features():
        return _forward_ext(q, k, v, causal, scale, tuple(batch_shape), ext)
    acc = accumulation_dtype(q.dtype)
    Lq, Lk, Dv = q.shape[-2], k.shape[-2], v.shape[-1]
    offset = Lk - Lq  # bottom-right causal alignment: query i sees key j iff j <= i + offset
    out = np.empty(tuple(batch_shape) + (Lq, Dv), dtype=q.dtype)
    lse = np.empty(tuple(batch_shape) + (Lq,), dtype=acc)
    batches = list(np.ndindex(*batch_shape))
    n_qblocks = -(-Lq // BLOCK_Q)

    def work(item):
        b, (blk0, blk1) = item
        q_b = q[_batch_index(b, q.shape[:-2])]
        K_aug = _augment(k[_batch_index(b, k.shape[:-2])], 1, acc)   # Lk×(D+1):  [K | 1]
        V_aug = _augment(v[_batch_index(b, v.shape[:-2])], 1, acc)   # Lk×(Dv+1): [V | 1]
        for i0 in range(blk0 * BLOCK_Q, min(blk1 * BLOCK_Q, Lq), BLOCK_Q):
            i1 = min(i0 + BLOCK_Q, Lq)
            O_i, lse_i = _forward_block(q_b[i0:i1], K_aug, V_aug, i0, i1, causal, scale, offset, acc)
            out[b + (slice(i0, i1),)] = O_i
            lse[b + (slice(i0, i1),)] = lse_i

    _map(work, [(b, c) for b in batches for c in _chunks(n_qblocks, len(batches))])
    return out, lse


def _forward_block(q_rows, K_aug, V_aug, i0, i1, causal, scale, offset, acc):
    """One query block Q_i against all the key blocks it sees; returns (O_i, lse_i)."""
    Br, Lk, Dv = i1 - i0, K_aug.shape[0], V_aug.shape[1] - 1
    # [scale·Q_i | -m_i]: the product with [K_j | 1]ᵀ is S_ij − m_i (scale folded in once).
    Q_aug = _augment(np.asarray(q_rows, dtype=acc) * acc.type(scale), 0, acc)
    m_i = np.full(Br, -np.inf, dtype=acc)          # reference point; -inf: no key seen yet
    O_i = np.zeros((Br, Dv + 1), dtype=acc)        # [unnormalised O_i | l_i]
    threshold = acc.type(RESCALE_THRESHOLD)
    all_seen = False                               # every row has a finite reference m_i
    for j0 in range(0, _key_end(i1, Lk, causal, offset), BLOCK_K):
        j1 = min(j0 + BLOCK_K, Lk)
        S_ij = Q_aug @ K_aug[j0:j1].T                                  # Br×Bc: S_ij − m_i
        if causal and j1 - 1 > i0 + offset:  # only tiles crossing the diagonal need the mask
            _apply_causal(S_ij, i0, j0, offset, BLOCK_Q, BLOCK_K)
        # -- move m_i for rows whose new max exceeds it by more than the threshold (or that saw
        #    their first key). m_safe is what Q_aug currently subtracts (0 while m_i = -inf,
        #    which keeps -inf - -inf out of the arithmetic).
        #    Fast path: once every row has a reference, one whole-tile max (5x cheaper than
        #    per-row maxima) shows whether any row needs to move; NaN fails it and goes the slow way.
        if not (all_seen and S_ij.max() <= threshold):
            m_safe = -Q_aug[:, -1]
            row_max = S_ij.max(axis=1) + m_safe
            grow = row_max > m_i + threshold       # NaN rows compare False and stay NaN below
            if grow.any():
                # Usually all rows move at once (the first tile): slices keep that in place.
                rows = slice(None) if grow.all() else np.flatnonzero(grow)
                S_ij[rows] -= (row_max[rows] - m_safe[rows])[:, None]
                O_i[rows] *= np.exp(m_i[rows] - row_max[rows])[:, None]   # 0 when m_i was -inf
                m_i[rows] = row_max[rows]
                Q_aug[rows, -1] = -row_max[rows]
                all_seen = not np.isneginf(m_i).any()
        P_ij = np.exp(S_ij, out=S_ij)
        O_i += P_ij @ V_aug[j0:j1]                                     # also adds rowsum(P_ij)
    l_i = O_i[:, -1]
    seen = l_i > 0
    O = np.divide(O_i[:, :-1], l_i[:, None], out=np.zeros((Br, Dv), dtype=acc), where=seen[:, None])
    with np.errstate(divide="ignore", invalid="ignore"):
        lse_i = np.where(seen, m_i + np.log(np.where(seen, l_i, 1)), -np.inf).astype(acc)
    # A NaN anywhere in the row's scores makes l_i NaN (not > 0); keep it NaN as the reference does.
    nan_rows = np.isnan(l_i)
    if nan_rows.any():
        O[nan_rows] = np.nan
        lse_i[nan_rows] = np.nan
    return O, lse_i


def backward(dout, q, k, v, out, lse, *, causal, scale, batch_shape, ext=None):
    """Tiled backward recomputing P from lse. Returns (dq, dk, dv) with the shapes of q, k, v.

    ``ext`` as for :func:`forward` (the same values as the forward that produced out and lse).
    """
    if ext is not None and ext.features():
        return _backward_ext(dout, q, k, v, out, lse, causal, scale, tuple(batch_shape), ext)
    acc = accumulation_dtype(q.dtype)
    Lq, Lk = q.shape[-2], k.shape[-2]
    offset = Lk - Lq
    batch_shape = tuple(batch_shape)
    batches = list(np.ndindex(*batch_shape))
    n_kblocks = -(-Lk // BWD_BLOCK_K)
    chunks = _chunks(n_kblocks, len(batches), _TARGET_ITEMS_BWD)
    # dK, dV per batch entry (summed over broadcast dims at the end); dQ per (entry, key chunk)
    # so that parallel key chunks never write the same memory; summed in a fixed order.
    dk = np.zeros(batch_shape + k.shape[-2:], dtype=acc)
    dv = np.zeros(batch_shape + v.shape[-2:], dtype=acc)
    dq_parts = np.zeros((len(chunks),) + batch_shape + q.shape[-2:], dtype=acc)
    prepared = {}

    def prep(b):
        """Per batch entry: [scale·Q | -lse] and [dO | -D] with D_i = rowsum(dO_i ∘ O_i)."""
        do_b = np.asarray(dout[b], dtype=acc)
        delta = np.einsum("ld,ld->l", do_b, np.asarray(out[b], dtype=acc))
        # Rows with lse = -inf saw no key: +inf makes exp(S - lse) = 0 instead of NaN.
        lse_b = np.where(np.isneginf(lse[b]), np.inf, lse[b]).astype(acc)
        q_b = np.asarray(q[_batch_index(b, q.shape[:-2])], dtype=acc)
        prepared[b] = (_augment(q_b * acc.type(scale), -lse_b, acc), q_b, do_b,
                       _augment(do_b, -delta, acc))

    _map(prep, batches)

    def work(item):
        b, c = item
        K_aug = _augment(k[_batch_index(b, k.shape[:-2])], 1, acc)   # [K | 1]
        V_aug = _augment(v[_batch_index(b, v.shape[:-2])], 1, acc)   # [V | 1]
        _backward_chunk(*prepared[b], K_aug, V_aug, dq_parts[(c,) + b], dk[b], dv[b],
                        chunks[c], causal, offset)

    _map(work, [(b, c) for b in batches for c in range(len(chunks))])
    dq = dq_parts[0] if len(chunks) == 1 else dq_parts.sum(axis=0)
    # The tile loop accumulates dS K and dSᵀ Q; the softmax scale is applied once here.
    dq *= acc.type(scale)
    dk *= acc.type(scale)
    grads = (reduce_to_shape(dq, q.shape), reduce_to_shape(dk, k.shape), reduce_to_shape(dv, v.shape))
    return tuple(np.ascontiguousarray(g).astype(q.dtype, copy=False) for g in grads)


def _backward_chunk(Q_aug, Q, dO, dO_aug, K_aug, V_aug, dq_b, dk_b, dv_b, blocks, causal, offset):
    """Key blocks [blk0, blk1) of one batch entry: accumulates dK_j, dV_j and this chunk's dQ."""
    Lq, Lk = Q.shape[0], K_aug.shape[0]
    blk0, blk1 = blocks
    for j0 in range(blk0 * BWD_BLOCK_K, min(blk1 * BWD_BLOCK_K, Lk), BWD_BLOCK_K):
        j1 = min(j0 + BWD_BLOCK_K, Lk)
        K_j, V_j = K_aug[j0:j1], V_aug[j0:j1]
        K_j_plain = K_j[:, :-1]
        dK_j, dV_j = dk_b[j0:j1], dv_b[j0:j1]
        # Causal: the first query that sees key j0 is i = j0 - offset; earlier blocks are skipped.
        i_start = max(0, j0 - offset) if causal else 0
        for i0 in range(i_start - i_start % BWD_BLOCK_Q, Lq, BWD_BLOCK_Q):
            i1 = min(i0 + BWD_BLOCK_Q, Lq)
            S_ij = Q_aug[i0:i1] @ K_j.T                      # Br×Bc: scale·S_ij − lse_i
            if causal and j1 - 1 > i0 + offset:
                _apply_causal(S_ij, i0, j0, offset, BWD_BLOCK_Q, BWD_BLOCK_K)
            P_ij = np.exp(S_ij, out=S_ij)                    # recomputed, never stored
            dV_j += P_ij.T @ dO[i0:i1]
            dP_ij = dO_aug[i0:i1] @ V_j.T                    # dP_ij − D_i
            dS_ij = np.multiply(P_ij, dP_ij, out=dP_ij)
            dK_j += dS_ij.T @ Q[i0:i1]
            dq_b[i0:i1] += dS_ij @ K_j_plain


# -- Extensions (docs/extensions.md): dropout, block_mask, window, ALiBi, softcap, seqlens -------
#
# A separate tiled path, used only when a call has extensions (a dense call never comes here).
# The augmented operands above fold -m_i (forward) and -lse_i, -D_i (backward) into the products,
# which no longer holds once softcap (nonlinear in S) or ALiBi (a bias per entry) change the
# scores, so here each tile's scores are formed first and the rest follows the textbook steps:
#
#     S_ij = scale·Q_i K_jᵀ                              # BLAS
#     S_ij = softcap·tanh(S_ij/softcap) − slope·|i + off − j|,  -inf where key j is hidden
#     online softmax (lazy reference m_i as above, sum l_i);  P̃_ij = P_ij ∘ keep_ij  (dropout)
#     O_i  = exp(m_old − m_new)·O_i + P̃_ij V_j           # BLAS; O_i /= (1 − p)·l_i at the end
#
# Tiles nobody sees are never formed and their K_j, V_j never read: key ranges outside the
# causal/window band or beyond Lk_b, and key blocks whose block-mask entries are all False for
# the query tile (spans follow the runs of visible blocks). Rows ≥ Lq_b are never computed
# (out 0, lse −inf, zero gradients).

# Tile sizes of the extension path: the dense path's, except that with a block mask the tile
# that walks the mask's rows (forward: query tile; backward: key tile) is a multiple of the
# block, about EXT_MASKED_TILE long, so that skipping follows the blocks closely.
EXT_BLOCK_Q, EXT_BLOCK_K = BLOCK_Q, BLOCK_K
EXT_BWD_BLOCK_Q, EXT_BWD_BLOCK_K = BWD_BLOCK_Q, BWD_BLOCK_K
EXT_MASKED_TILE = 128


def _aligned(width, block):
    """The multiple of ``block`` nearest below ``width`` (at least ``block``)."""
    return block * max(1, width // block)


def _spans(lo, hi, visible, B, width):
    """``[lo, hi)`` cut into pieces of at most ``width``, leaving out the blocks of size ``B``
    whose entry of ``visible`` (one bool per block; None: all visible) is False."""
    runs = [(lo, hi)]
    if visible is not None:
        flags = np.concatenate(([0], visible.astype(np.int8), [0]))
        edges = np.flatnonzero(np.diff(flags))            # starts and ends of runs of True
        runs = [(max(lo, int(a) * B), min(hi, int(z) * B)) for a, z in zip(edges[::2], edges[1::2])]
    return [(s, min(s + width, end)) for start, end in runs for s in range(start, end, width)]


def _dropout_keep(seed, offset, bh, i0, i1, j0, j1, thresh):
    """Boolean tile ``(i1-i0, j1-j0)``: True where dropout keeps P (bit-identical to
    :func:`philox.keep_mask`). One Philox call per 8 columns, not per column as uniform16."""
    g0, g1 = j0 >> 3, (j1 + 7) >> 3
    groups = np.arange(g0, g1, dtype=np.uint64)[None, :]
    rows = np.arange(i0, i1, dtype=np.uint64)[:, None]
    words = philox.philox4x32((groups, rows, bh, offset), (seed & 0xFFFFFFFF, seed >> 32))
    w = np.stack(np.broadcast_arrays(*words), axis=-1)            # (rows, groups, 4) uint32
    # Column 8g + c takes bits 16·(c & 1) of word c >> 1: the little-endian uint16 halves in order.
    u16 = w.astype("<u4", copy=False).view("<u2").reshape(i1 - i0, 8 * (g1 - g0))
    return u16[:, j0 - 8 * g0:j1 - 8 * g0] >= thresh


class _Entry:
    """One batch entry ``b`` of an extension call: its lengths and alignment, band, ALiBi slope,
    block-mask slice and dropout stream (docs/extensions.md, "The score of one entry")."""

    def __init__(self, b, ext, batch_shape, Lq, Lk, causal, acc):
        e = b[0] if b else 0                     # seqlens index the first batch dim
        self.Lq = Lq if ext.seqlens_q is None else int(ext.seqlens_q[e])
        self.Lk = Lk if ext.seqlens_k is None else int(ext.seqlens_k[e])
        self.off = self.Lk - self.Lq             # bottom-right alignment of this entry
        self.causal = causal
        self.left, self.right = ext.window if ext.window is not None else (-1, -1)
        self.softcap = ext.softcap
        self.slope = (None if ext.alibi_slopes is None
                      else acc.type(ext.alibi_slopes[_batch_index(b, ext.alibi_slopes.shape)]))
        self.blocks = (None if ext.block_mask is None
                       else ext.block_mask[_batch_index(b, ext.block_mask.shape[:-2])])
        self.Bq, self.Bk = ext.block_size
        self.dropout = ext.dropout
        if self.dropout:
            self.bh = int(np.ravel_multi_index(b, batch_shape)) if b else 0
            self.seed, self.offset = ext.seed, ext.offset
            self.thresh = philox.threshold(ext.dropout_p)
            self.inv_keep = acc.type(1.0 / (1.0 - ext.dropout_p))

    def key_band(self, i0, i1):
        """Keys ``[lo, hi)`` that some row of ``[i0, i1)`` may see (causal, window, Lk_b)."""
        lo, hi = 0, self.Lk
        if self.causal:
            hi = min(hi, i1 + self.off)                  # j <= i + off
        if self.right >= 0:
            hi = min(hi, i1 + self.off + self.right)     # j <= i + off + r
        if self.left >= 0:
            lo = max(lo, i0 + self.off - self.left)      # j >= i + off - l
        return lo, max(lo, hi)

    def query_band(self, j0, j1):
        """Rows ``[lo, hi)`` that may see some key of ``[j0, j1)`` (the same three conditions)."""
        lo, hi = 0, self.Lq
        if self.causal:
            lo = max(lo, j0 - self.off)
        if self.right >= 0:
            lo = max(lo, j0 - self.off - self.right)
        if self.left >= 0:
            hi = min(hi, j1 + self.left - self.off)
        return lo, max(lo, hi)

    def key_spans(self, i0, i1, width):
        """Key tiles for query rows ``[i0, i1)``: the band less the all-False mask blocks."""
        lo, hi = self.key_band(i0, i1)
        visible = None
        if self.blocks is not None:
            visible = self.blocks[i0 // self.Bq:-(-i1 // self.Bq)].any(axis=0)
        return _spans(lo, hi, visible, self.Bk, width)

    def query_spans(self, j0, j1, width):
        """Query tiles for keys ``[j0, j1)`` (the backward's inner loop)."""
        lo, hi = self.query_band(j0, j1)
        visible = None
        if self.blocks is not None:
            visible = self.blocks[:, j0 // self.Bk:-(-j1 // self.Bk)].any(axis=1)
        return _spans(lo, hi, visible, self.Bq, width)

    def hidden(self, i0, i1, j0, j1):
        """Boolean tile, True where row i cannot see key j; None when the whole tile is visible."""
        hide = None
        if ((self.causal and j1 - 1 > i0 + self.off)
                or (self.right >= 0 and j1 - 1 > i0 + self.off + self.right)
                or (self.left >= 0 and j0 < i1 - 1 + self.off - self.left)):
            d = np.arange(j0, j1)[None, :] - np.arange(i0 + self.off, i1 + self.off)[:, None]
            hide = np.zeros(d.shape, dtype=bool)     # d = j − (i + off)
            if self.causal:
                hide |= d > 0
            if self.right >= 0:
                hide |= d > self.right
            if self.left >= 0:
                hide |= d < -self.left
        if self.blocks is not None:
            b0, c0 = i0 // self.Bq, j0 // self.Bk
            sub = self.blocks[b0:-(-i1 // self.Bq), c0:-(-j1 // self.Bk)]
            if not sub.all():
                rows = np.arange(i0, i1) // self.Bq - b0
                cols = np.arange(j0, j1) // self.Bk - c0
                blocked = ~sub[np.ix_(rows, cols)]
                hide = blocked if hide is None else hide | blocked
        return hide

    def scores(self, S, i0, j0, want_tanh=False):
        """Softcap, ALiBi and the mask applied to the tile ``S = scale·Q_i K_jᵀ`` (in place).

        Returns ``(S, T)`` with ``T = tanh(S_raw / softcap)`` (the backward's 1 − T² factor) when
        ``want_tanh`` and softcap is set, else ``T = None``."""
        i1, j1 = i0 + S.shape[0], j0 + S.shape[1]
        T = None
        if self.softcap is not None:
            cap = S.dtype.type(self.softcap)
            S *= 1 / cap
            np.tanh(S, out=S)
            if want_tanh:
                T = S.copy()
            S *= cap
        if self.slope is not None:
            # FlashAttention-2's ALiBi: −slope·|i + off − j|. Positions are exact in the float
            # dtype (< 2**24), so the distance tile is built in it directly (no integer tile).
            rows = np.arange(i0 + self.off, i1 + self.off, dtype=S.dtype)
            dist = np.subtract.outer(rows, np.arange(j0, j1, dtype=S.dtype))
            np.abs(dist, out=dist)
            dist *= self.slope
            S -= dist
        hide = self.hidden(i0, i1, j0, j1)
        if hide is not None:
            np.copyto(S, -np.inf, where=hide)
        return S, T

    def keep(self, i0, i1, j0, j1):
        """Dropout's keep tile for rows ``[i0, i1)``, keys ``[j0, j1)``."""
        return _dropout_keep(self.seed, self.offset, self.bh, i0, i1, j0, j1, self.thresh)


def _entry_arrays(b, *arrays):
    """The 2-D slices of entry ``b`` of arrays with batch dims (size 1 where broadcast)."""
    return tuple(x[_batch_index(b, x.shape[:-2])] for x in arrays)


def _forward_ext(q, k, v, causal, scale, batch_shape, ext):
    """Forward of an extension call (same results layout as :func:`forward`)."""
    acc = accumulation_dtype(q.dtype)
    Lq, Lk, Dv = q.shape[-2], k.shape[-2], v.shape[-1]
    # Rows that are never computed (≥ Lq_b, or seeing no key) keep out = 0 and lse = -inf.
    out = np.zeros(batch_shape + (Lq, Dv), dtype=q.dtype)
    lse = np.full(batch_shape + (Lq,), -np.inf, dtype=acc)
    batches = list(np.ndindex(*batch_shape))
    Br = EXT_BLOCK_Q if ext.block_mask is None else _aligned(EXT_MASKED_TILE, ext.block_size[0])
    n_qblocks = -(-Lq // Br)

    def work(item):
        b, (blk0, blk1) = item
        ent = _Entry(b, ext, batch_shape, Lq, Lk, causal, acc)
        q_b, k_b, v_b = _entry_arrays(b, q, k, v)
        for i0 in range(blk0 * Br, min(blk1 * Br, ent.Lq), Br):
            i1 = min(i0 + Br, ent.Lq)
            O_i, lse_i = _forward_block_ext(ent, q_b[i0:i1], k_b, v_b, i0, scale, acc)
            out[b + (slice(i0, i1),)] = O_i
            lse[b + (slice(i0, i1),)] = lse_i

    _map(work, [(b, c) for b in batches for c in _chunks(n_qblocks, len(batches))])
    return out, lse


def _forward_block_ext(ent, q_rows, k_b, v_b, i0, scale, acc):
    """Query rows ``[i0, i0 + Br)`` against the key tiles they see; returns (O_i, lse_i)."""
    Br, Dv = q_rows.shape[0], v_b.shape[-1]
    Q_i = np.asarray(q_rows, dtype=acc) * acc.type(scale)          # Br×D: scale·Q_i
    m_i = np.full(Br, -np.inf, dtype=acc)     # reference point (lazy, as in the dense path)
    m_safe = np.zeros(Br, dtype=acc)          # what is subtracted: m_i, or 0 while m_i = -inf
    O_i = np.zeros((Br, Dv + 1), dtype=acc)   # [unnormalised O_i | l_i (undropped row sums)]
    all_seen = False                          # every row has a finite reference m_i
    bound = -np.inf                           # min(m_i) + RESCALE_THRESHOLD once all_seen
    for j0, j1 in ent.key_spans(i0, i0 + Br, EXT_BLOCK_K):
        S_ij, _ = ent.scores(Q_i @ np.asarray(k_b[j0:j1], dtype=acc).T, i0, j0)   # Br×Bc
        # One whole-tile max against the smallest reference usually shows that no row must move
        # (NaN fails the test and goes the slow way, which checks row by row).
        if not (all_seen and S_ij.max() <= bound):
            all_seen = _move_reference(S_ij, m_i, m_safe, O_i)
            bound = m_i.min() + acc.type(RESCALE_THRESHOLD)
        # Subtracted from the scores once (not reference after reference): exact to an ulp of S.
        S_ij -= m_safe[:, None]
        P_ij = np.exp(S_ij, out=S_ij)
        if ent.dropout:
            O_i[:, -1] += P_ij.sum(axis=1)                         # lse is of the undropped P
            np.multiply(P_ij, ent.keep(i0, i0 + Br, j0, j1), out=P_ij)
            O_i[:, :-1] += P_ij @ np.asarray(v_b[j0:j1], dtype=acc)
        else:
            O_i += P_ij @ _augment(v_b[j0:j1], 1, acc)              # [V_j | 1]: adds rowsum(P_ij)
    l_i = O_i[:, -1]
    seen = l_i > 0
    O = np.divide(O_i[:, :-1], l_i[:, None], out=np.zeros((Br, Dv), dtype=acc), where=seen[:, None])
    if ent.dropout:
        O *= ent.inv_keep                                          # kept P scaled by 1/(1 − p)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse_i = np.where(seen, m_i + np.log(np.where(seen, l_i, 1)), -np.inf).astype(acc)
    nan_rows = np.isnan(l_i)        # a NaN score makes the row NaN, as in the reference
    O[nan_rows], lse_i[nan_rows] = np.nan, np.nan
    return O, lse_i


def _move_reference(S_ij, m_i, m_safe, O_i):
    """Rows of the scores ``S_ij`` whose max exceeds ``m_i`` by more than RESCALE_THRESHOLD, or
    that see their first key, move their reference (m_i, m_safe) to that max; O_i (and l_i, its
    last column) is rescaled in place. Returns whether every row has a finite reference now."""
    row_max = S_ij.max(axis=1)
    grow = row_max > m_i + S_ij.dtype.type(RESCALE_THRESHOLD)   # NaN rows compare False
    if grow.any():
        rows = slice(None) if grow.all() else np.flatnonzero(grow)
        O_i[rows] *= np.exp(m_i[rows] - row_max[rows])[:, None]   # 0 when m_i was -inf
        m_i[rows] = row_max[rows]
        m_safe[rows] = row_max[rows]
    return not np.isneginf(m_i).any()


def _backward_ext(dout, q, k, v, out, lse, causal, scale, batch_shape, ext):
    """Backward of an extension call (same layout of work and results as :func:`backward`)."""
    acc = accumulation_dtype(q.dtype)
    Lq, Lk = q.shape[-2], k.shape[-2]
    batches = list(np.ndindex(*batch_shape))
    Bc = EXT_BWD_BLOCK_K if ext.block_mask is None else _aligned(EXT_MASKED_TILE, ext.block_size[1])
    chunks = _chunks(-(-Lk // Bc), len(batches), _TARGET_ITEMS_BWD)
    dk = np.zeros(batch_shape + k.shape[-2:], dtype=acc)
    dv = np.zeros(batch_shape + v.shape[-2:], dtype=acc)
    dq_parts = np.zeros((len(chunks),) + batch_shape + q.shape[-2:], dtype=acc)
    entries, prepared = {}, {}

    def prep(b):
        """Per entry, rows < Lq_b only: scale·Q, Q, dO, D_i = rowsum(dO_i ∘ O_i) and lse."""
        ent = entries[b] = _Entry(b, ext, batch_shape, Lq, Lk, causal, acc)
        rows = slice(0, ent.Lq)
        Q = np.asarray(q[_batch_index(b, q.shape[:-2])][rows], dtype=acc)
        dO = np.asarray(dout[b][rows], dtype=acc)
        delta = np.einsum("ld,ld->l", dO, np.asarray(out[b][rows], dtype=acc))
        # Rows with lse = -inf saw no key: +inf makes exp(S - lse) = 0 instead of NaN.
        lse_b = np.where(np.isneginf(lse[b][rows]), np.inf, lse[b][rows]).astype(acc)
        prepared[b] = (Q * acc.type(scale), Q, dO, delta, lse_b)

    _map(prep, batches)

    def work(item):
        b, c = item
        k_b, v_b = _entry_arrays(b, k, v)
        _backward_chunk_ext(entries[b], *prepared[b], k_b, v_b, dq_parts[(c,) + b], dk[b], dv[b],
                            chunks[c], Bc, acc)

    _map(work, [(b, c) for b in batches for c in range(len(chunks))])
    dq = dq_parts[0] if len(chunks) == 1 else dq_parts.sum(axis=0)
    dq *= acc.type(scale)                # dS is the gradient of scale·QKᵀ: scale applied once
    dk *= acc.type(scale)
    grads = (reduce_to_shape(dq, q.shape), reduce_to_shape(dk, k.shape), reduce_to_shape(dv, v.shape))
    return tuple(np.ascontiguousarray(g).astype(q.dtype, copy=False) for g in grads)


def _backward_chunk_ext(ent, Qs, Q, dO, delta, lse, k_b, v_b, dq_b, dk_b, dv_b, blocks, Bc, acc):
    """Key tiles of blocks [blk0, blk1) of one entry against the query tiles that see them:
    accumulates dK_j, dV_j and this chunk's (unscaled) dQ."""
    blk0, blk1 = blocks
    for j0 in range(blk0 * Bc, min(blk1 * Bc, ent.Lk), Bc):
        j1 = min(j0 + Bc, ent.Lk)
        spans = ent.query_spans(j0, j1, EXT_BWD_BLOCK_Q)
        if not spans:
            continue                     # no row sees these keys: K_j, V_j are never read
        K_j = np.asarray(k_b[j0:j1], dtype=acc)                       # Bc×D
        V_j = np.asarray(v_b[j0:j1], dtype=acc)                       # Bc×Dv
        dK_j, dV_j = dk_b[j0:j1], dv_b[j0:j1]
        for i0, i1 in spans:
            S_ij, T_ij = ent.scores(Qs[i0:i1] @ K_j.T, i0, j0, want_tanh=True)
            S_ij -= lse[i0:i1, None]
            P_ij = np.exp(S_ij, out=S_ij)                             # recomputed, never stored
            dP_ij = dO[i0:i1] @ V_j.T                                 # dP̃_ij
            if ent.dropout:
                keep = ent.keep(i0, i1, j0, j1)
                dV_j += (P_ij * keep).T @ dO[i0:i1] * ent.inv_keep    # P̃ᵀ dO
                np.multiply(dP_ij, keep, out=dP_ij)
                dP_ij *= ent.inv_keep                                 # dP = dP̃ ∘ keep / (1 − p)
            else:
                dV_j += P_ij.T @ dO[i0:i1]
            dP_ij -= delta[i0:i1, None]
            dS_ij = np.multiply(P_ij, dP_ij, out=dP_ij)               # P ∘ (dP − D)
            if T_ij is not None:
                dS_ij *= 1 - T_ij * T_ij                              # softcap' = 1 − tanh²
            dK_j += dS_ij.T @ Q[i0:i1]
            dq_b[i0:i1] += dS_ij @ K_j
