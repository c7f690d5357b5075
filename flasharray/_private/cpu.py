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

Nothing of size Lq×Lk is ever allocated: the largest temporaries are Br×Bc tiles and per-batch
Lq×D / Lk×D buffers. float16/bfloat16 inputs compute in float32, float32 in float32, float64 in
float64. Work items (batch entry × block range) run on a thread pool; BLAS and large NumPy
ufuncs release the GIL, so both cores work.
"""
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .dtypes import accumulation_dtype
from ..reference import reduce_to_shape

# Tile sizes. Larger tiles amortise the Python overhead per tile and feed BLAS bigger products;
# a Br×Bc float32 tile of 128×512 is 256 KB, which stays in L2 together with K_j and V_j.
BLOCK_Q = 128
BLOCK_K = 512
# Backward tiles: each (key block, query block) step does five products on Br×Bc tiles.
BWD_BLOCK_Q = 256
BWD_BLOCK_K = 256

_pool = None
_pool_lock = threading.Lock()


def _workers():
    return max(1, int(os.environ.get("FLASHARRAY_CPU_THREADS", os.cpu_count() or 1)))


def _map(fn, items):
    """Run ``fn`` over ``items`` on the shared thread pool (inline when there is one worker)."""
    global _pool
    items = list(items)
    if _workers() == 1 or len(items) <= 1:
        return [fn(it) for it in items]
    with _pool_lock:
        if _pool is None or _pool._max_workers != _workers():
            _pool = ThreadPoolExecutor(max_workers=_workers(), thread_name_prefix="flasharray-cpu")
        pool = _pool
    return list(pool.map(fn, items))


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


def _causal_tile_mask(i0, i1, j0, j1, offset):
    """Br×Bc boolean tile, True where key j is *hidden* from query i (j > i + offset)."""
    return np.arange(j0, j1)[None, :] > (np.arange(i0, i1)[:, None] + offset)


def _key_end(i1, Lk, causal, offset):
    """Exclusive end of the keys any query in [.., i1) sees: the causal loop bound."""
    return min(Lk, i1 + offset) if causal else Lk


def forward(q, k, v, *, causal, scale, batch_shape):
    """Tiled forward. q, k, v carry ``len(batch_shape)`` batch dims (size n or 1 each).

    Returns ``out (*batch_shape, Lq, Dv)`` in q's dtype and ``lse (*batch_shape, Lq)`` in the
    accumulation dtype.
    """
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
        k_b = np.asarray(k[_batch_index(b, k.shape[:-2])], dtype=acc)
        v_b = np.asarray(v[_batch_index(b, v.shape[:-2])], dtype=acc)
        for i0 in range(blk0 * BLOCK_Q, min(blk1 * BLOCK_Q, Lq), BLOCK_Q):
            i1 = min(i0 + BLOCK_Q, Lq)
            O_i, lse_i = _forward_block(q_b[i0:i1], k_b, v_b, i0, i1, causal, scale, offset, acc)
            out[b + (slice(i0, i1),)] = O_i
            lse[b + (slice(i0, i1),)] = lse_i

    _map(work, [(b, c) for b in batches for c in _chunks(n_qblocks, len(batches))])
    return out, lse


def _forward_block(q_rows, k_b, v_b, i0, i1, causal, scale, offset, acc):
    """One query block Q_i against all the key blocks it sees; returns (O_i, lse_i)."""
    Br = i1 - i0
    Q_i = np.asarray(q_rows, dtype=acc) * acc.type(scale)  # fold the scale into Q once
    m_i = np.full(Br, -np.inf, dtype=acc)
    l_i = np.zeros(Br, dtype=acc)
    O_i = np.zeros((Br, v_b.shape[-1]), dtype=acc)
    for j0 in range(0, _key_end(i1, k_b.shape[0], causal, offset), BLOCK_K):
        j1 = min(j0 + BLOCK_K, k_b.shape[0])
        S_ij = Q_i @ k_b[j0:j1].T                                    # Br×Bc
        if causal and j1 - 1 > i0 + offset:  # only tiles crossing the diagonal need the mask
            S_ij[_causal_tile_mask(i0, i1, j0, j1, offset)] = -np.inf
        # -- update m_i; a row with no visible key so far keeps m = -inf, and subtracting 0
        #    instead of -inf keeps exp() at 0 rather than NaN (-inf - -inf).
        m_new = np.maximum(m_i, S_ij.max(axis=1))
        m_safe = np.where(np.isneginf(m_new), acc.type(0), m_new)
        alpha = np.exp(m_i - m_safe)                                 # rescale of the old state
        np.subtract(S_ij, m_safe[:, None], out=S_ij)
        P_ij = np.exp(S_ij, out=S_ij)
        # -- update l_i and O_i
        l_i *= alpha
        l_i += P_ij.sum(axis=1)
        O_i *= alpha[:, None]
        O_i += P_ij @ v_b[j0:j1]
        m_i = m_new
    seen = l_i > 0
    O_i = np.divide(O_i, l_i[:, None], out=np.zeros_like(O_i), where=seen[:, None])
    with np.errstate(divide="ignore"):
        lse_i = np.where(seen, m_i + np.log(np.where(seen, l_i, 1)), -np.inf).astype(acc)
    # A NaN anywhere in the row's scores makes l_i NaN (not > 0); keep it NaN as the reference does.
    nan_rows = np.isnan(l_i)
    if nan_rows.any():
        O_i[nan_rows] = np.nan
        lse_i[nan_rows] = np.nan
    return O_i, lse_i


def backward(dout, q, k, v, out, lse, *, causal, scale, batch_shape):
    """Tiled backward recomputing P from lse. Returns (dq, dk, dv) with the shapes of q, k, v."""
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
    delta = {}  # D_i = rowsum(dO_i ∘ O_i), one Lq vector per batch entry

    def prep(b):
        delta[b] = np.einsum("ld,ld->l", np.asarray(dout[b], dtype=acc), np.asarray(out[b], dtype=acc))

    _map(prep, batches)

    def work(item):
        b, c = item
        blk0, blk1 = chunks[c]
        q_b = np.asarray(q[_batch_index(b, q.shape[:-2])], dtype=acc)
        k_b = np.asarray(k[_batch_index(b, k.shape[:-2])], dtype=acc)
        v_b = np.asarray(v[_batch_index(b, v.shape[:-2])], dtype=acc)
        do_b = np.asarray(dout[b], dtype=acc)
        # Rows with lse = -inf saw no key: +inf makes exp(S - lse) = 0 instead of NaN.
        lse_b = np.where(np.isneginf(lse[b]), np.inf, lse[b]).astype(acc)
        _backward_chunk(q_b, k_b, v_b, do_b, lse_b, delta[b], dq_parts[(c,) + b], dk[b], dv[b],
                        blk0, blk1, causal, acc.type(scale), offset)

    _map(work, [(b, c) for b in batches for c in range(len(chunks))])
    dq = dq_parts[0] if len(chunks) == 1 else dq_parts.sum(axis=0)
    grads = (reduce_to_shape(dq, q.shape), reduce_to_shape(dk, k.shape), reduce_to_shape(dv, v.shape))
    return tuple(np.ascontiguousarray(g).astype(q.dtype, copy=False) for g in grads)


def _backward_chunk(q_b, k_b, v_b, do_b, lse_b, delta_b, dq_b, dk_b, dv_b, blk0, blk1, causal,
                    scale, offset):
    """Key blocks [blk0, blk1) of one batch entry: accumulates dK_j, dV_j and this chunk's dQ."""
    Lq, Lk = q_b.shape[0], k_b.shape[0]
    for j0 in range(blk0 * BWD_BLOCK_K, min(blk1 * BWD_BLOCK_K, Lk), BWD_BLOCK_K):
        j1 = min(j0 + BWD_BLOCK_K, Lk)
        K_j, V_j = k_b[j0:j1], v_b[j0:j1]
        dK_j = dk_b[j0:j1]
        dV_j = dv_b[j0:j1]
        # Causal: the first query that sees key j0 is i = j0 - offset; earlier blocks are skipped.
        i_start = max(0, j0 - offset) if causal else 0
        for i0 in range(i_start - i_start % BWD_BLOCK_Q, Lq, BWD_BLOCK_Q):
            i1 = min(i0 + BWD_BLOCK_Q, Lq)
            Q_i = q_b[i0:i1]
            dO_i = do_b[i0:i1]
            S_ij = (Q_i @ K_j.T) * scale                                 # Br×Bc
            if causal and j1 - 1 > i0 + offset:
                S_ij[_causal_tile_mask(i0, i1, j0, j1, offset)] = -np.inf
            np.subtract(S_ij, lse_b[i0:i1, None], out=S_ij)
            P_ij = np.exp(S_ij, out=S_ij)                               # recomputed, never stored
            dV_j += P_ij.T @ dO_i
            dP_ij = dO_i @ V_j.T
            dP_ij -= delta_b[i0:i1, None]
            dS_ij = np.multiply(P_ij, dP_ij, out=dP_ij)
            dK_j += (dS_ij.T @ Q_i) * scale
            dq_b[i0:i1] += (dS_ij @ K_j) * scale
