"""CUDA forward: pick a kernel and tile, lay out the arguments, launch (CuPy or the emulator).

Kernels: ``cuda_src/flash_fwd.cu`` (tensor cores, fp16 from sm_75 and bf16 from sm_80) and
``cuda_src/flash_fwd_simt.cu`` (FMA; fp32, fp64, and the fallback for fp16/bf16 elsewhere).
Tiles: :mod:`flasharray._private.tiles`. Launch layer: :mod:`flasharray._private.launch`.
"""
import math

import numpy as np

from . import launch as L
from . import tiles


def _acc_dtype(dtype):
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def kernel_for(dtype, head_dim, head_dim_v=None, arch=tiles.EMULATOR_ARCH, kernel=None, block_m=None):
    """The :class:`~flasharray._private.tiles.FwdTile` a forward call would use.

    Parameters
    ----------
    dtype : dtype of q, k, v (float16, bfloat16, float32, float64)
    head_dim, head_dim_v : int
        D of q/k and Dv of v (unpadded).
    arch : int, str or tuple
        Compute capability (``80``, ``"sm_80"``, ``(8, 0)``).
    kernel : {None, "tensor_core", "simt"}
        Force a kernel family (tests); None picks tensor cores when the arch has them.
    block_m : {None, 384, 512}
        An IO-oriented tensor-core tile (``tiles.IO_TILES``) instead of the table's choice.
    """
    return tiles.forward_tile(dtype, head_dim, head_dim_v, arch, kernel=kernel, block_m=block_m)


def _is_aligned(arrays):
    """cp.async path: every row of q, k, v starts on a 16-byte boundary."""
    for a in arrays:
        vec = 16 // a.itemsize
        if _data_ptr(a) % 16:
            return False
        st = L.element_strides(a)
        if any(s % vec for n, s in zip(a.shape[:-1], st[:-1]) if n > 1):
            return False
    return True


def _data_ptr(a):
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr


def _needs_copy(a):
    st = L.element_strides(a)
    return (a.shape[-1] > 1 and st[-1] != 1) or any(s < 0 for s in st)


class ForwardPlan:
    """Everything a forward call on one signature needs, prepared once.

    A signature is what the launches depend on: shapes, strides, dtype, 16-byte alignment of
    q/k/v, causal, scale, device and kernel options. :meth:`run` then only copies inputs whose
    last axis is not contiguous (as at planning), allocates ``out``/``lse`` and binds the array
    pointers into prepared argument tuples — no tile choice, dim merging or source lookup.
    """

    def __init__(self, q, k, v, *, causal, scale, batch_shape, launcher, kernel=None, block_m=None):
        self.launcher = launcher
        self.xp = launcher.xp()
        self.batch_shape = tuple(int(n) for n in batch_shape)
        self.dtype = q.dtype
        acc = _acc_dtype(self.dtype)
        Lq, D = q.shape[-2], q.shape[-1]
        Lk, Dv = k.shape[-2], v.shape[-1]
        self.tile = kernel_for(self.dtype, D, Dv, launcher.arch, kernel=kernel, block_m=block_m)
        self.copy = tuple(_needs_copy(a) for a in (q, k, v))
        q, k, v = (L.kernel_ready(a) for a in (q, k, v))
        self.out_shape = self.batch_shape + (Lq, Dv)
        self.lse_shape = self.batch_shape + (Lq,)
        self.acc = acc
        self.launches = []
        if Lq * Dv == 0 or 0 in self.batch_shape:
            return
        out = np.lib.stride_tricks.as_strided(np.empty(0, self.dtype), self.out_shape,
                                              _contiguous_strides(self.out_shape, self.dtype))
        lse = np.lib.stride_tricks.as_strided(np.empty(0, acc), self.lse_shape,
                                              _contiguous_strides(self.lse_shape, acc))
        tile = self.tile
        name_expr = tile.name_expression(causal=bool(causal), aligned=_is_aligned((q, k, v)))
        row = [L.element_strides(a)[-2] for a in (q, k, v, out)]
        scale_log2 = L.c_scalar(float(scale) * math.log2(math.e), acc)
        n_blocks = -(-Lq // tile.block_m)
        for part in L.batch_layout(self.batch_shape, [q, k, v, out, lse]):
            (qo, qs), (ko, ks), (vo, vs), (oo, os_), (lo, ls) = part.tensors
            gy, gz = part.grid_yz
            args = (L.Ptr(0, qo), L.Ptr(1, ko), L.Ptr(2, vo), L.Ptr(3, oo), L.Ptr(4, lo),
                    L.c_int(Lq), L.c_int(Lk), L.c_int(D), L.c_int(Dv), L.c_int(part.dims[2]),
                    *(L.c_longlong(s) for s in qs), L.c_longlong(row[0]),
                    *(L.c_longlong(s) for s in ks), L.c_longlong(row[1]),
                    *(L.c_longlong(s) for s in vs), L.c_longlong(row[2]),
                    *(L.c_longlong(s) for s in os_), L.c_longlong(row[3]),
                    *(L.c_longlong(s) for s in ls),
                    scale_log2)
            self.launches.append(L.Recorded(launcher, tile.source, name_expr, (n_blocks, gy, gz),
                                            (tile.n_threads, 1, 1), args, shared_mem=tile.smem))

    def run(self, q, k, v, counters=None):
        """``(out, lse)`` for arrays of the planned signature."""
        xp = self.xp
        if True in self.copy:
            q, k, v = (xp.ascontiguousarray(a) if c else a for a, c in zip((q, k, v), self.copy))
        out = xp.empty(self.out_shape, dtype=self.dtype)
        lse = xp.empty(self.lse_shape, dtype=self.acc)
        arrays = (q, k, v, out, lse)
        pointer = self.launcher.pointer
        for launch in self.launches:
            c = launch(pointer, arrays)
            if counters is not None and c is not None:
                counters.append(c)
        return out, lse


def _contiguous_strides(shape, dtype):
    st, acc = [], np.dtype(dtype).itemsize
    for n in reversed(shape):
        st.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(st))


def signature(arrays, extra=()):
    """Hashable key of everything a plan depends on in ``arrays`` (+ ``extra``): type, device,
    dtype, shape, strides and 16-byte alignment of each."""
    key = list(extra)
    for a in arrays:
        if isinstance(a, np.ndarray):
            key += (a.dtype, a.shape, a.strides, a.ctypes.data % 16)
        else:
            key += (a.dtype, a.shape, a.strides, a.data.ptr % 16, a.data.device_id)
    return tuple(key)


_PLANS = {}
#: Plans kept per process (least recently made dropped first beyond this).
MAX_PLANS = 1024
L._on_reload.append(_PLANS.clear)


def cached(cache, key, make):
    """``cache[key]``, made by ``make()`` on a miss; at most ``MAX_PLANS`` entries."""
    plan = cache.get(key)
    if plan is None:
        plan = make()
        if len(cache) >= MAX_PLANS:
            cache.pop(next(iter(cache)))
        cache[key] = plan
    return plan


def plan(q, k, v, *, causal, scale, batch_shape, device, kernel=None, arch=None, block_m=None,
         schedule="forward", seed=0):
    """The cached :class:`ForwardPlan` for this signature (made on first use)."""
    launcher = L.make_launcher(device, schedule=schedule, seed=seed, arch=arch if device == "emulator" else None)
    key = signature((q, k, v), (launcher.plan_key, bool(causal), float(scale), tuple(batch_shape), kernel, block_m))
    return cached(_PLANS, key, lambda: ForwardPlan(q, k, v, causal=causal, scale=scale, batch_shape=batch_shape,
                                                   launcher=launcher, kernel=kernel, block_m=block_m))


def forward(q, k, v, *, causal, scale, batch_shape, device, counters=None, kernel=None, arch=None,
            block_m=None, schedule="forward", seed=0, **opts):
    """FlashAttention forward on the CUDA kernels.

    Parameters
    ----------
    q : array (*b_q, Lq, D);  k : array (*b_k, Lk, D);  v : array (*b_v, Lk, Dv)
        NumPy arrays for ``device="emulator"``, CuPy arrays for ``device="cuda"``; each batch dim
        has size ``batch_shape[i]`` or 1 (broadcast: stride 0, no copy — MQA/GQA). Any strides;
        a copy is made only when the last axis is not contiguous.
    causal : bool
        Bottom-right aligned causal mask (query i sees key j iff j <= i + Lk - Lq).
    scale : float
        Multiplies q·k before the softmax.
    batch_shape : tuple
    device : {"cuda", "emulator"}
    counters : list, optional
        Emulator only: the counters (dict) of every launch are appended.
    kernel : {None, "tensor_core", "simt"}
        Force a kernel family (None: tensor cores for fp16/bf16 where the arch has them).
    arch : optional
        Emulator only: the compute capability whose tile table to use (default sm_80).
    block_m : {None, 384, 512}
        Use an IO-oriented tensor-core tile (benchmarks/io.py), fp16/bf16 only.
    schedule, seed
        Emulator only: fiber schedule ("forward", "reverse", "random") and its seed.

    Returns
    -------
    out : (*batch_shape, Lq, Dv), dtype of q
    lse : (*batch_shape, Lq), float32 (float64 for float64 inputs), natural log; -inf for rows
        that see no key (their ``out`` row is 0).

    The launches are prepared once per signature (:func:`plan`) and replayed.
    """
    if opts:
        raise TypeError("flasharray: unexpected option(s) for the CUDA forward: %s" % ", ".join(sorted(opts)))
    p = plan(q, k, v, causal=causal, scale=scale, batch_shape=batch_shape, device=device, kernel=kernel,
             arch=arch, block_m=block_m, schedule=schedule, seed=seed)
    return p.run(q, k, v, counters)


def analytic_global_bytes(batch, Lq, Lk, D, Dv, dtype, tile, causal=False):
    """Global-memory bytes one forward moves with ``tile``: (read_bytes, write_bytes).

    Per batch entry and query tile i (Tr = ceil(Lq / Br) tiles): Q_i is read once and K_j, V_j
    once for every key tile j the block visits (all of them without a mask; with the causal mask
    only those not entirely above the diagonal — a query tile that sees no key reads nothing);
    O and LSE are written once. Rows past Lq / Lk and head-dim padding are never read. This is
    what the emulator counts, exactly (tests/test_cuda_forward.py).
    """
    e = np.dtype(dtype).itemsize
    acc = _acc_dtype(dtype).itemsize
    q_rows = key_rows = 0
    for m0 in range(0, Lq, tile.block_m):
        rows = min(tile.block_m, Lq - m0)
        visible = Lk if not causal else min(Lk, m0 + rows - 1 + Lk - Lq + 1)
        if visible <= 0:
            continue
        q_rows += rows
        key_rows += min(Lk, -(-visible // tile.block_n) * tile.block_n)
    reads = batch * (q_rows * D + key_rows * (D + Dv)) * e
    writes = batch * Lq * (Dv * e + acc)
    return reads, writes
