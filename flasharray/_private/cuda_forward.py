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
        ptr = a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr
        if ptr % 16:
            return False
        st = L.element_strides(a)
        if any(s % vec for n, s in zip(a.shape[:-1], st[:-1]) if n > 1):
            return False
    return True


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
    """
    if opts:
        raise TypeError("flasharray: unexpected option(s) for the CUDA forward: %s" % ", ".join(sorted(opts)))
    launcher = L.make_launcher(device, schedule=schedule, seed=seed, arch=arch if device == "emulator" else None)
    xp = launcher.xp()
    batch_shape = tuple(int(n) for n in batch_shape)
    dtype = q.dtype
    acc = _acc_dtype(dtype)
    Lq, D = q.shape[-2], q.shape[-1]
    Lk, Dv = k.shape[-2], v.shape[-1]
    tile = kernel_for(dtype, D, Dv, launcher.arch, kernel=kernel, block_m=block_m)

    q, k, v = (L.kernel_ready(a) for a in (q, k, v))
    out = xp.empty(batch_shape + (Lq, Dv), dtype=dtype)
    lse = xp.empty(batch_shape + (Lq,), dtype=acc)
    if out.size == 0:
        return out, lse
    name_expr = tile.name_expression(causal=bool(causal), aligned=_is_aligned((q, k, v)))
    row = [L.element_strides(a)[-2] for a in (q, k, v, out)]
    scale_log2 = L.c_scalar(float(scale) * math.log2(math.e), acc)
    n_blocks = -(-Lq // tile.block_m)

    for part in L.batch_plan(batch_shape, [q, k, v, out, lse]):
        (qf, qs), (kf, ks), (vf, vs), (of, os_), (lf, ls) = part.tensors
        gy, gz = part.grid_yz
        args = (qf, kf, vf, of, lf,
                L.c_int(Lq), L.c_int(Lk), L.c_int(D), L.c_int(Dv), L.c_int(part.dims[2]),
                *(L.c_longlong(s) for s in qs), L.c_longlong(row[0]),
                *(L.c_longlong(s) for s in ks), L.c_longlong(row[1]),
                *(L.c_longlong(s) for s in vs), L.c_longlong(row[2]),
                *(L.c_longlong(s) for s in os_), L.c_longlong(row[3]),
                *(L.c_longlong(s) for s in ls),
                scale_log2)
        c = launcher.launch(tile.source, name_expr, (n_blocks, gy, gz), (tile.n_threads, 1, 1), args,
                            shared_mem=tile.smem)
        if counters is not None and c is not None:
            counters.append(c)
    return out, lse


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
