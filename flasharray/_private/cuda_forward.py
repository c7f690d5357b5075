"""CUDA forward: pick a kernel and tile, lay out the arguments, launch (CuPy or the emulator).

Kernels: ``cuda_src/flash_fwd.cu`` (tensor cores, fp16 from sm_75 and bf16 from sm_80),
``cuda_src/flash_fwd_simt.cu`` (FMA; fp32, fp64, and the fallback for fp16/bf16 elsewhere),
``cuda_src/flash_fwd_tf32.cu`` (fp32 on TF32 tensor cores, ``precision="tf32"`` / ``"3xtf32"``:
:mod:`flasharray._private.cuda_forward_tf32`, SIMT where it does not apply) and
``cuda_src/flash_fwd_f64.cu`` (fp64 on DMMA from sm_80, precision None / ``"ieee"``:
:mod:`flasharray._private.cuda_forward_f64`, SIMT where it does not apply).
Tiles: :mod:`flasharray._private.tiles`. Launch layer: :mod:`flasharray._private.launch`.
"""
import math

import numpy as np

from . import cuda_forward_f64 as f64
from . import cuda_forward_sm90 as sm90
from . import cuda_forward_tf32 as tf32
from . import launch as L
from . import philox
from . import tiles
from .precision import effective_forward_precision

#: The kExt bits of cuda_src/flash_ext.cuh, by Extensions.features() name.
EXT_BITS = {"window": 1, "alibi": 2, "softcap": 4, "block_mask": 8, "dropout": 16, "seqlens": 32}
#: Array slots of :meth:`ForwardPlan.run` after q, k, v, out, lse, the split workspace (5, 6) and
#: the KV cache's (7, 8): the extensions' arrays.
EXT_SLOTS = {"seqlens_q": 9, "seqlens_k": 10, "alibi_slopes": 11, "block_mask": 12}


def ext_bits(ext):
    """The kernels' ``kExt`` template argument for an :class:`Extensions` (0 for None)."""
    return 0 if ext is None else sum(EXT_BITS[f] for f in ext.features())


def _acc_dtype(dtype):
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def kernel_for(dtype, head_dim, head_dim_v=None, arch=tiles.EMULATOR_ARCH, kernel=None, block_m=None, ext=False,
               wide=False, two_blocks=True, causal=False, plain=True):
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
    ext : bool
        The call has extensions (the kernels' kExt != 0; d <= 64 then runs a one-slab tile).
    wide : bool
        The call qualifies for the wide-row tiles (``tiles.WIDE_ROWS``: d > 64, non-causal,
        16-byte aligned rows, more than 64 query rows, no extensions): :func:`wide_rows`.
    two_blocks : bool
        Single-buffer where that lets two blocks share an SM (``tiles.TWO_BLOCKS_MAX_HEAD_DIM``);
        False for a paged KV cache.
    causal : bool
        The call is causal (the single-buffered 128 x 64 wide tile: ``tiles.WIDE_BC64``, ``tiles.WIDE_BC64_CAUSAL``).
    plain : bool
        The call runs the plain instantiation (no split-KV, GQA packing or key lengths); False: a causal call keeps
        the 128 x 32 wide tile.
    """
    return tiles.forward_tile(dtype, head_dim, head_dim_v, arch, kernel=kernel, block_m=block_m, ext=ext, wide=wide,
                              two_blocks=two_blocks, causal=causal, plain=plain)


def wide_rows(tile, causal, aligned, rows, ext, kv=None, arch=tiles.EMULATOR_ARCH):
    """Whether a call on the table's ``tile`` qualifies for the wide-row tiles (``tiles.WIDE_ROWS``):
    the mma.sync kernel of the table (no IO tile), non-causal (causal too where ``tiles.causal_takes_wide``),
    16-byte aligned rows, more than 64 query rows (after GQA packing), no extensions, no paged KV cache:
    the instantiations audited free of spills (the paged ones spilled 12-60 bytes on sm_90;
    docs/performance.md)."""
    return (tile.kernel == "tensor_core" and tile.block_m == 64 and aligned and rows > 64 and ext is None
            and not (kv is not None and kv.paged)
            and (not causal or tiles.causal_takes_wide(tile.dtype, tile.head_dim, tile.head_dim_v, arch)))


def _is_aligned(arrays):
    """cp.async path: every row of q, k, v starts on a 16-byte boundary."""
    for a in arrays:
        vec = 16 // a.itemsize
        if L.device_address(a) % 16:
            return False
        st = L.element_strides(a)
        if any(s % vec for n, s in zip(a.shape[:-1], st[:-1]) if n > 1):
            return False
    return True


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

    def __init__(self, q, k, v, *, causal, scale, batch_shape, launcher, kernel=None, block_m=None,
                 num_splits=None, pack_gqa=None, kv=None, ext=None, precision=None, tf32_wgmma=True):
        self.launcher = launcher
        self.kv = kv  # KVLayout: per-entry key lengths (and pages) of a KV cache, or None
        # Extensions (docs/extensions.md): the kernels' kExt bits; None for a dense plan.
        self.ext = _ExtPlan(ext, q, k, batch_shape, scale, launcher) if ext_bits(ext) else None
        self.xp = launcher.xp()
        self.batch_shape = tuple(int(n) for n in batch_shape)
        self.dtype = q.dtype
        acc = _acc_dtype(self.dtype)
        Lq, D = q.shape[-2], q.shape[-1]
        Lk, Dv = (k.shape[-2] if kv is None else kv.Lk), v.shape[-1]
        if self.ext is not None and block_m is not None:
            raise NotImplementedError("flasharray: the IO tiles (block_m=%d) take no extensions (%s): use block_m=None"
                                      % (block_m, ", ".join(self.ext.features)))
        # precision "tf32" / "3xtf32": the TF32 tensor-core kernel where it applies, else SIMT.
        # float64 (precision None / "ieee"): the DMMA kernel on sm_80+ where it applies, else SIMT.
        tc = dict(kernel=kernel, block_m=block_m, ext=0 if self.ext is None else self.ext.bits, num_splits=num_splits,
                  kv=kv)
        # kernel="wgmma": the Hopper forward (NotImplementedError where it cannot run); kernel=None on sm_90: the
        # same where it serves the call (cuda_forward_sm90.auto_tile), kept below unless the mma.sync plan splits.
        self.tile = sm90.forward_tile(self.dtype, D, Dv, launcher.arch, device=launcher.device, **tc)
        if kernel is None and self.tile is not None and not sm90.auto_serves_window(getattr(ext, "window", None),
                                                                                     self.tile):
            self.tile = None  # a short window at d <= 64: the mma.sync forward
        auto = self.tile if kernel is None else None
        if self.tile is None or auto is not None:
            self.tile = tf32.forward_tile(precision, self.dtype, D, Dv, launcher.arch, device=launcher.device,
                                          wgmma=tf32_wgmma, **tc) or \
                f64.forward_tile(precision, self.dtype, D, Dv, launcher.arch, **tc) or \
                kernel_for(self.dtype, D, Dv, launcher.arch, kernel=kernel, block_m=block_m,
                           ext=self.ext is not None, two_blocks=not (kv is not None and kv.paged))
        self.copy = tuple(_needs_copy(a) for a in (q, k, v))
        q, k, v = (L.kernel_ready(a) for a in (q, k, v))
        self.out_shape = self.batch_shape + (Lq, Dv)
        self.lse_shape = self.batch_shape + (Lq,)
        self.acc = acc
        self.launches = []
        # Decoding figures (docs, tests): query heads per block row group (GQA packing), key
        # splits, forward-kernel blocks launched, and the SM count the split count was chosen for.
        self.gqa_group, self.num_splits, self.blocks = 1, 1, 0
        self.sm_count = getattr(launcher, "sm_count", None) or tiles.emulator_sm_count(launcher.arch)
        self.workspace = None  # split-KV: shapes of the fp32 partial O and LSE
        if Lq * Dv == 0 or 0 in self.batch_shape:
            return
        out = L.stand_in(self.out_shape, self.dtype)
        lse = L.stand_in(self.lse_shape, acc)
        aligned = _is_aligned((q, k, v))
        if not aligned and getattr(self.tile, "fallback", None) is not None:
            self.tile = self.tile.fallback  # the wgmma tf32 forward copies 16-byte aligned rows only
        call = (q, k, v, out, lse, causal, pack_gqa, aligned, dict(kernel=kernel, block_m=block_m,
                                                                    num_splits=num_splits))
        layout = self._layout(*call)
        if auto is not None and layout[-1] == 1:  # kernel=None on sm_90: wgmma where the mma.sync plan does not split
            layout = self._auto_layout(auto, call, layout)
        tile = self.tile
        batch, (q_k, out_k, lse_k), rows, causal, packed_causal, n_blocks, splits = layout
        self.num_splits = splits
        self.blocks = int(np.prod(batch)) * n_blocks * splits
        name_expr = forward_name_expression(tile, bool(causal), aligned, split=splits > 1, packed=packed_causal,
                                            seqlens_k=kv is not None, paged=kv is not None and kv.paged,
                                            ext=0 if self.ext is None else self.ext.bits)
        scale_log2 = L.c_scalar(float(scale) * math.log2(math.e), acc)
        self.rows_per_group = Lq  # the kernel's query positions: row mod Lq (only Is_packed reads it)
        # causal dense calls on the mma.sync kernel: the grouped longest-first order (tiles.causal_groups)
        self._grouped = (tile.kernel == "tensor_core" and bool(causal) and splits == 1 and not packed_causal
                         and kv is None and self.ext is None)
        if splits > 1:
            # Partial results (*batch, splits, rows, Dv) and (*batch, splits, rows), fp32: the
            # kernel's o / lse arguments (arrays 5 and 6 of run), merged into out / lse by
            # flash_fwd_combine.cu.
            self.workspace = (batch + (splits, rows, Dv), batch + (splits, rows))
            o_ws = L.stand_in(self.workspace[0], np.float32)
            l_ws = L.stand_in(self.workspace[1], np.float32)
            self._add_forward(launcher, name_expr, batch, (q_k, k, v, o_ws, l_ws), (0, 1, 2, 5, 6),
                              rows, Lk, D, Dv, scale_log2, n_blocks * splits)
            self._add_combine(launcher, batch, (o_ws, l_ws, out_k, lse_k), rows, Dv, splits)
        else:
            self._add_forward(launcher, name_expr, batch, (q_k, k, v, out_k, lse_k), (0, 1, 2, 3, 4),
                              rows, Lk, D, Dv, scale_log2, n_blocks)

    def _auto_layout(self, auto, call, fallback):
        """``kernel=None`` on sm_90: the wgmma tile ``auto`` and its layout, or the mma.sync plan's (``self.tile``
        and ``fallback``, kept) where the wgmma kernel refuses the layout (extensions on rows not 16-byte aligned
        at padded d 256: ``cuda_forward_sm90.cp_async_ext_tile``)."""
        kept = self.tile, self.gqa_group
        self.tile = auto
        try:
            return self._layout(*call)
        except NotImplementedError:
            self.tile, self.gqa_group = kept
            return fallback

    def _layout(self, q, k, v, out, lse, causal, pack_gqa, aligned, opts):
        """The launch geometry on ``self.tile`` (its wide-row, TMA or cp.async variant set in ``self.tile``):
        ``(batch, (q, out, lse) as the kernel walks them, rows, causal, packed_causal, query tiles, key splits)``.
        ``opts``: the call's ``kernel``, ``block_m``, ``num_splits``."""
        tile, kv, arch, Lq = self.tile, self.kv, self.launcher.arch, q.shape[-2]
        D, Dv, Lk = q.shape[-1], v.shape[-1], (k.shape[-2] if kv is None else kv.Lk)
        bits = 0 if self.ext is None else self.ext.bits
        # GQA packing: the query heads sharing a K/V head become rows of one block (a re-view of
        # q, out and lse: same memory, same pointers; only shapes and strides change).
        batch, q_k, out_k, lse_k, rows = self.batch_shape, q, out, lse, Lq
        packed = None if pack_gqa is False or self.ext is not None else gqa_packing(
            q, k, v, out, lse, self.batch_shape, causal, tile)
        packed_causal, self.gqa_group = False, 1  # Is_packed: the mask at each row's query position
        if packed is not None:
            batch, (q_k, out_k, lse_k), self.gqa_group = packed
            rows = q_k.shape[-2]
            causal = causal and Lq > 1  # Lq = 1: the one query sees every key, causal or not
            packed_causal = bool(causal)
        wide = opts["block_m"] is None and wide_rows(tile, causal, aligned, rows, self.ext, kv, arch)
        if wide:
            plain = not packed_causal and kv is None and opts["num_splits"] in (None, 1)
            tile = self.tile = kernel_for(self.dtype, D, Dv, arch, kernel=opts["kernel"], wide=True, causal=causal,
                                          plain=plain)
        if tile.kernel == "wgmma" and aligned:  # the TMA / warp-specialized instantiation where legal
            tile = self.tile = sm90.tma_tile(tile, (q_k, k, v), bits, causal, Lk)
        if tile.kernel == "wgmma":  # the cp.async kernel's tile with extensions (or NotImplementedError)
            tile = self.tile = sm90.cp_async_ext_tile(tile, aligned, bits)
        n_blocks = -(-rows // tile.block_m)
        splits = self._split_count(opts["num_splits"], int(np.prod(batch)) * n_blocks, Lk, opts["block_m"])
        if wide and causal and splits > 1 and tile.block_n == 64:  # a causal split: 128 x 32 (128 x 64's spilled)
            tile = self.tile = kernel_for(self.dtype, D, Dv, arch, kernel=opts["kernel"], wide=True, causal=True,
                                          plain=False)
            splits = self._split_count(opts["num_splits"], int(np.prod(batch)) * n_blocks, Lk, opts["block_m"])
        return batch, (q_k, out_k, lse_k), rows, causal, packed_causal, n_blocks, splits

    def _split_count(self, num_splits, blocks, Lk, block_m=None):
        """Key splits: ``num_splits`` when given, else :func:`tiles.auto_num_splits` for ``blocks``
        (batch entries × query tiles) on this device's block slots (:func:`tiles.split_slots`: the SMs,
        twice where two blocks of the tile share one; the IO tiles, ``block_m``, are for the dense
        algorithm's traffic: one split unless forced). The SIMT kernels do not split."""
        if self.tile.kernel != "tensor_core":
            if num_splits not in (None, 1):
                raise NotImplementedError(
                    "flasharray: num_splits=%d: split-KV runs on the tensor-core forward (float16 on sm_75+, "
                    "bfloat16 on sm_80+); this call uses the SIMT kernel (%s): use num_splits=None or 1"
                    % (num_splits, np.dtype(self.dtype).name))
            return 1
        if num_splits is not None:
            return num_splits
        if block_m is not None:
            return 1
        return tiles.auto_num_splits(blocks, tiles.split_slots(self.tile, self.launcher.arch, self.sm_count), Lk,
                                     self.tile.block_n)

    def _add_forward(self, launcher, name_expr, batch, tensors, keys, Lq, Lk, D, Dv, scale_log2, grid_x):
        tile = self.tile
        row = [L.element_strides(a)[-2] for a in tensors[:4]]
        # The entry (first batch dim) of each block: a stand-in int tensor (B, 1, …) walked like the
        # others, its offset and strides the kernel's entry index (KV cache only).
        entries = L.stand_in((batch[0],) + (1,) * (len(batch) - 1), np.int32, (4,) + (0,) * (len(batch) - 1))
        ext_tensors = [] if self.ext is None else self.ext.stand_ins
        for part in L.batch_layout(batch, list(tensors) + [entries] + ext_tensors):
            eo, es = part.tensors[5]
            if getattr(tile, "tma", False):  # tensor maps for q, k, v (cuda_forward_sm90.add_tma_launch)
                tail = (_dense_ext_args(self, launcher) if self.ext is None
                        else self.ext.args(eo, es, part.tensors[6:]))
                sm90.add_tma_launch(self.launches, launcher, tile, name_expr, part, tensors, keys, Lq, Lk, D, Dv,
                                    scale_log2, grid_x, tail)
                continue
            (qo, qs), (ko, ks), (vo, vs), (oo, os_), (lo, ls) = part.tensors[:5]
            gy, gz = part.grid_yz
            args = (L.Ptr(keys[0], qo), L.Ptr(keys[1], ko), L.Ptr(keys[2], vo), L.Ptr(keys[3], oo),
                    L.Ptr(keys[4], lo),
                    L.c_int(Lq), L.c_int(Lk), L.c_int(D), L.c_int(Dv), L.c_int(part.dims[2]),
                    *(L.c_longlong(s) for s in qs), L.c_longlong(row[0]),
                    *(L.c_longlong(s) for s in ks), L.c_longlong(row[1]),
                    *(L.c_longlong(s) for s in vs), L.c_longlong(row[2]),
                    *(L.c_longlong(s) for s in os_), L.c_longlong(row[3]),
                    *(L.c_longlong(s) for s in ls),
                    scale_log2)
            if tile.kernel in ("tensor_core", "wgmma"):  # the wgmma kernel takes flash_fwd_kernel's arguments
                groups = tiles.causal_groups(grid_x, gy * gz, Lk, tile.head_dim, tile.head_dim_v,
                                             np.dtype(self.dtype).itemsize,
                                             tiles.split_slots(tile, launcher.arch, self.sm_count)) \
                    if self._grouped else 0
                args += (L.c_int(self.rows_per_group), L.c_int(groups)) + self._kv_args(launcher, eo, es)
            elif tile.kernel == "simt":
                args += self._kv_args(launcher, eo, es)
            args += _dense_ext_args(self, launcher) if self.ext is None else self.ext.args(eo, es, part.tensors[6:])
            self.launches.append(L.Recorded(launcher, tile.source, name_expr, (grid_x, gy, gz),
                                            (tile.n_threads, 1, 1), args, shared_mem=tile.smem))

    def _kv_args(self, launcher, entry0, entry_strides):
        """The tensor-core and SIMT kernels' trailing KV-cache arguments: seqlens_k, block_table (array slots
        7 and 8 of :meth:`run`), the entry strides, table row stride, page size and page strides
        of k and v (zeros for a dense call, whose two pointers are never read: a one-int array the
        plan keeps, since the emulator and checked launch paths take only arrays' addresses)."""
        kv = self.kv
        if kv is None:
            if getattr(self, "_no_ints", None) is None:
                self._no_ints = self.xp.empty(1, dtype=np.int32)
            null = launcher.pointer(launcher.handle(self._no_ints))
            return (null, null) + tuple(L.c_longlong(0) for _ in range(4)) + (L.c_int(0),) + (L.c_longlong(0),) * 2
        table = L.Ptr(8, entry0 * kv.table_row) if kv.paged else L.Ptr(7, entry0)
        return ((L.Ptr(7, entry0), table) + tuple(L.c_longlong(s) for s in entry_strides)
                + (L.c_longlong(kv.table_row), L.c_int(kv.page_size), L.c_longlong(kv.k_page),
                   L.c_longlong(kv.v_page)))

    def _add_combine(self, launcher, batch, tensors, Lq, Dv, splits):
        name_expr = combine_name_expression(self.dtype)
        row = [L.element_strides(a)[-2] for a in tensors[:3]]
        for part in L.batch_layout(batch, list(tensors)):
            (wo, ws), (wlo, wls), (oo, os_), (lo, ls) = part.tensors
            gy, gz = part.grid_yz
            args = (L.Ptr(5, wo), L.Ptr(6, wlo), L.Ptr(3, oo), L.Ptr(4, lo),
                    L.c_int(Lq), L.c_int(Dv), L.c_int(splits), L.c_int(part.dims[2]),
                    *(L.c_longlong(s) for s in ws), L.c_longlong(row[0]),
                    *(L.c_longlong(s) for s in wls),
                    *(L.c_longlong(s) for s in os_), L.c_longlong(row[2]),
                    *(L.c_longlong(s) for s in ls))
            self.launches.append(L.Recorded(launcher, COMBINE_SOURCE, name_expr,
                                            (-(-Lq // COMBINE_ROWS), gy, gz), (COMBINE_ROWS * 32, 1, 1), args,
                                            shared_mem=splits * COMBINE_ROWS * 4))

    def run(self, q, k, v, counters=None, seqlens_k=None, block_table=None, ext=None):
        """``(out, lse)`` for arrays of the planned signature (KV-cache plans: + the entries' key
        counts, int32 (B,), and for paged caches the block table; k, v are then the caches;
        extension plans: + the call's :class:`Extensions`, whose seed, offset and arrays are
        taken here)."""
        if self.ext is not None or ext_bits(ext):
            return self._run_ext(q, k, v, counters, ext)
        xp = self.xp
        if True in self.copy:
            q, k, v = (xp.ascontiguousarray(a) if c else a for a, c in zip((q, k, v), self.copy))
        empty = self.launcher.empty  # 256-byte aligned, on the emulator too
        arrays = (q, k, v, empty(self.out_shape, self.dtype), empty(self.lse_shape, self.acc))
        if self.workspace is not None:
            arrays += (empty(self.workspace[0], np.float32), empty(self.workspace[1], np.float32))
        if self.kv is not None:
            arrays += (None,) * (7 - len(arrays)) + (seqlens_k, block_table)
        return self._launch(arrays, counters)

    def _launch(self, arrays, counters, values=None):
        """Every launch with ``arrays`` bound (and, extension plans, the per-call ``values`` as the
        last slot: the :class:`launch.Val` slots); returns arrays 3 and 4 (out, lse)."""
        handle = self.launcher.handle
        pointer, handles = self.launcher.pointer, tuple(None if a is None else handle(a) for a in arrays)
        if values is not None:
            handles += (values,)
        for launch in self.launches:
            c = launch(pointer, handles)
            if counters is not None and c is not None:
                counters.append(c)
        return arrays[3], arrays[4]

    def _run_ext(self, q, k, v, counters, ext):
        """:meth:`run` of a plan with extensions: per-call scalars (seed, offset) and arrays bound."""
        if self.ext is None or ext is None or ext.static_key() != self.ext.key:
            raise ValueError("flasharray: this forward plan was made for other extensions (%r), got %r"
                             % (self.ext and self.ext.features, ext))
        xp = self.xp
        if True in self.copy:
            q, k, v = (xp.ascontiguousarray(a) if c else a for a, c in zip((q, k, v), self.copy))
        empty = self.launcher.empty
        arrays = (q, k, v, empty(self.out_shape, self.dtype), empty(self.lse_shape, self.acc))
        if self.workspace is not None:
            arrays += (empty(self.workspace[0], np.float32), empty(self.workspace[1], np.float32))
        arrays += (None,) * (9 - len(arrays)) + self.ext.arrays(ext)
        return self._launch(arrays, counters, self.ext.values(ext))


def _dense_ext_args(plan, launcher):
    """The extension argument tail of a dense launch: zeros and never-read one-element arrays of the
    parameter types (kept by the plan: the emulator and CuPy take arrays' addresses)."""
    if getattr(plan, "_no_ext", None) is None:
        xp = plan.xp
        dummies = [xp.empty(1, dtype=dt) for dt in (np.int32, plan.acc, np.bool_)]
        plan._no_ext_arrays = dummies
        ints, accs, bools = (launcher.pointer(launcher.handle(a)) for a in dummies)
        zero_acc, ll0, u0 = L.c_scalar(0.0, plan.acc), L.c_longlong(0), np.uint32(0)
        plan._no_ext = ((ints, ints) + (ll0,) * 3 + (L.c_int(0), L.c_int(0), zero_acc)
                        + (accs,) + (ll0,) * 3 + (zero_acc,)
                        + (bools,) + (ll0,) * 5 + (L.c_int(0), L.c_int(0))
                        + (u0,) * 4 + (zero_acc,) + (ll0,) * 4)
    return plan._no_ext


#: Placeholder for a per-call scalar argument (dropout's seed, offset): :class:`launch.Val`.
Val = L.Val


def _non_negative(a):
    """A stand-in with ``a``'s shape and strides, or C-contiguous ones when a stride is negative
    (then :meth:`_ExtPlan.arrays` copies): planning keeps no user array alive."""
    if any(st < 0 for st in a.strides):
        return L.stand_in(a.shape, a.dtype), True
    return L.stand_in(a.shape, a.dtype, a.strides), False


class _ExtPlan:
    """The extension part of a :class:`ForwardPlan`: kExt bits, the stand-ins walked with the
    batch (ALiBi slopes, block mask, the flat batch index for dropout), the scalar tail, and per
    call the arrays (slots :data:`EXT_SLOTS`) and the values (seed, offset)."""

    def __init__(self, ext, q, k, batch_shape, scale, launcher):
        self.bits, self.key, self.features = ext_bits(ext), ext.static_key(), ext.features()
        batch = tuple(int(n) for n in batch_shape)
        if ext.seqlens_q is not None or ext.seqlens_k is not None:
            if not batch:
                raise ValueError("flasharray: seqlens_q / seqlens_k need a batch dim (B = first batch dim)")
            xp = launcher.xp()
            # A missing length array: every entry has the full length (plan-owned, never changes).
            self.full_q = xp.full(batch[0], q.shape[-2], dtype=np.int32)
            self.full_k = xp.full(batch[0], k.shape[-2], dtype=np.int32)
        self.acc, self.xp = _acc_dtype(q.dtype), launcher.xp()
        self.stand_ins, self.copy = [], {}
        for name in ("alibi_slopes", "block_mask"):
            a = getattr(ext, name)
            if a is not None:
                st, self.copy[name] = _non_negative(a)
                self.stand_ins.append(st)
        self.stand_ins.append(L.stand_in(batch, np.int32))  # element offset = flat C-order index
        self.ext, self.scale, self.launcher = ext, float(scale), launcher

    def args(self, entry0, entry_strides, parts):
        """The extension argument tail of one launch part (``parts``: offsets and strides of the
        stand-ins, in order)."""
        ext, acc, ll = self.ext, self.acc, L.c_longlong
        dense = _dense_ext_args(self, self.launcher)
        parts = list(parts)
        tail = list(dense)
        if "seqlens" in self.features:
            tail[0:5] = [L.Ptr(EXT_SLOTS["seqlens_q"], entry0), L.Ptr(EXT_SLOTS["seqlens_k"], entry0)] + \
                [ll(s) for s in entry_strides]
        if ext.window is not None:
            tail[5:7] = [L.c_int(ext.window[0]), L.c_int(ext.window[1])]
        if ext.softcap is not None:
            tail[7] = L.c_scalar(ext.softcap / self.scale, acc)
        if ext.alibi_slopes is not None:
            off, st = parts.pop(0)
            tail[8:13] = [L.Ptr(EXT_SLOTS["alibi_slopes"], off)] + [ll(s) for s in st] + [L.c_scalar(1.0 / self.scale, acc)]
        if ext.block_mask is not None:
            off, st = parts.pop(0)
            row, col = L.element_strides(self.stand_ins[len(self.stand_ins) - 2])[-2:]
            tail[13:21] = ([L.Ptr(EXT_SLOTS["block_mask"], off)] + [ll(s) for s in st] + [ll(row), ll(col)]
                           + [L.c_int(b) for b in ext.block_size])
        if ext.dropout:
            off, st = parts.pop(0)
            tail[21:30] = ([Val("seed_lo"), Val("seed_hi"), Val("offset"), np.uint32(philox.threshold(ext.dropout_p)),
                            L.c_scalar(1.0 / (1.0 - ext.dropout_p), acc), ll(off)] + [ll(s) for s in st])
        return tuple(tail)

    def arrays(self, ext):
        """The call's arrays for slots 9-12 (seqlens_q, seqlens_k, alibi slopes, block mask)."""
        xp = self.launcher.xp()
        out = [None] * 4
        if "seqlens" in self.features:
            out[0] = self.full_q if ext.seqlens_q is None else xp.ascontiguousarray(ext.seqlens_q)
            out[1] = self.full_k if ext.seqlens_k is None else xp.ascontiguousarray(ext.seqlens_k)
        for i, name in ((2, "alibi_slopes"), (3, "block_mask")):
            a = getattr(ext, name)
            if a is not None:
                out[i] = xp.ascontiguousarray(a) if self.copy[name] else a
        return tuple(out)

    def values(self, ext):
        """The per-call scalars: dropout's seed (two words) and offset."""
        if not ext.dropout:
            return {}
        seed = int(ext.seed)
        return {"seed_lo": np.uint32(seed & 0xFFFFFFFF), "seed_hi": np.uint32(seed >> 32),
                "offset": np.uint32(int(ext.offset))}


#: The split-KV combine kernel: source, and query rows per block (one warp each).
COMBINE_SOURCE = "flash_fwd_combine.cu"
COMBINE_ROWS = 4


def combine_name_expression(dtype):
    """The combine kernel's instantiation for the output dtype (float16 or bfloat16)."""
    return "flash::flash_fwd_combine_kernel<%s, %d>" % (tiles._CTYPE[tiles.dtype_name(dtype)], COMBINE_ROWS)


def forward_name_expression(tile, causal, aligned, split=False, packed=False, seqlens_k=False, paged=False, ext=0):
    """The forward's instantiation with its defaulted flags appended up to the last one set (the
    dense name is the tile table's): tensor cores ``Is_split`` (split-KV), ``Is_packed`` (causal GQA
    packing), ``Has_seqlens_k`` (per-entry key lengths), ``Is_paged`` (K/V read through a block
    table), then ``kExt`` (the extension bits, :data:`EXT_BITS`); SIMT ``kExt``, ``Has_seqlens_k``,
    ``Is_paged``; the TF32 kernel ``kExt``."""
    if tile.kernel in ("tf32", "wgmma"):  # kExt after kQSplit / Is_persistent (the tiles' name_expression)
        return tile.name_expression(causal=causal, aligned=aligned, ext=ext)
    name = tile.name_expression(causal=causal, aligned=aligned)
    if tile.kernel == "simt" and (seqlens_k or paged):
        return name[:-1] + ", %d, true, %s>" % (ext, "true" if paged else "false")
    if tile.kernel != "tensor_core":
        return name if not ext else name[:-1] + ", %d>" % ext
    flags = [split, packed, seqlens_k or paged, paged]
    if ext:
        return name[:-1] + ", " + ", ".join("true" if f else "false" for f in flags) + ", %d>" % ext
    while flags and not flags[-1]:
        flags.pop()
    if not flags:
        return name
    return name[:-1] + ", " + ", ".join("true" if f else "false" for f in flags) + ">"


def _merged_row_stride(dims):
    """The element stride of dims [(size, stride), ...] (outer first) walked as one, or None when
    they do not nest (stride_i = size_{i+1} · stride_{i+1})."""
    for (_, s_outer), (n_inner, s_inner) in zip(dims, dims[1:]):
        if s_outer != n_inner * s_inner:
            return None
    return dims[-1][1]


def gqa_packing(q, k, v, out, lse, batch_shape, causal, tile):
    """GQA packing: ``(batch, (q, out, lse), G)`` with the query heads that share a K/V head
    stacked as rows, or None where packing does not apply.

    The group dims are the batch dims along which k and v broadcast (size 1) and q does not; they
    must be the trailing batch dims (q ``(B, Hkv, G, Lq, D)`` against k, v ``(B, Hkv, 1, Lk, D)``,
    MQA ``(B, H, Lq, D)`` against ``(B, 1, Lk, D)``), so that out and lse (contiguous) walk them
    as rows; q's group dims and its rows must nest into one row stride (any strides otherwise:
    BSHD views pack when Lq = 1). The packed problem has ``G·Lq`` rows, row ``g·Lq + i`` being
    query ``i`` of head ``g``. Applies to Lq = 1 (causal or not: the one query sees every key) and
    to 1 < Lq < Br (with Lq >= Br the query tiles of a head are full and packing saves little);
    causal with Lq > 1 on the tensor-core kernel only, whose ``Is_packed`` variant masks each row
    at its query position ``row mod Lq`` (the SIMT kernels do not).
    """
    n = len(batch_shape)
    Lq = q.shape[-2]
    group = [i for i in range(n) if batch_shape[i] > 1 and k.shape[i] == 1 and v.shape[i] == 1]
    if not group or (Lq > 1 and (Lq >= tile.block_m or (causal and tile.kernel != "tensor_core"))):
        return None
    if any(batch_shape[i] > 1 for i in range(group[0], n) if i not in group):
        return None  # a non-group dim inside the group: out / lse rows would not nest
    packed = []
    for a, nrow in ((q, 2), (out, 2), (lse, 1)):
        st = L.element_strides(a)
        dims = [(a.shape[i], st[i]) for i in group] + ([(Lq, st[-nrow])] if Lq > 1 else [])
        row = _merged_row_stride(dims)
        if row is None or (nrow == 1 and row != 1):  # the kernels read lse rows at stride 1
            return None
        shape = [1 if i in group else a.shape[i] for i in range(n)] + [int(np.prod([d for d, _ in dims]))]
        strides = [0 if i in group else a.strides[i] for i in range(n)] + [row * a.itemsize]
        if nrow == 2:
            shape.append(a.shape[-1])
            strides.append(a.strides[-1])
        packed.append(L.stand_in(shape, a.dtype, strides))
    batch = tuple(1 if i in group else batch_shape[i] for i in range(n))
    return batch, tuple(packed), int(np.prod([batch_shape[i] for i in group]))


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
         schedule="forward", seed=0, num_splits=None, pack_gqa=None, kv=None, ext=None, precision=None):
    """The cached :class:`ForwardPlan` for this signature (made on first use). ``ext``: an
    :class:`~flasharray._private.extensions.Extensions` or None; the plan keys on its
    ``static_key()`` only (seed, offset and the arrays' contents are taken by :meth:`ForwardPlan.run`).
    ``precision``: None, "ieee", "tf32" or "3xtf32" (validated for the dtype by the caller)."""
    if num_splits is not None:
        num_splits = check_num_splits(num_splits)
    if not ext_bits(ext):
        ext = None
    elif kv is not None:
        raise NotImplementedError("flasharray: the KV-cache forward takes no extensions (%s)" % ", ".join(ext.features()))
    launcher = L.make_launcher(device, schedule=schedule, seed=seed, arch=arch)
    # The wgmma TF32 forward for an explicit precision; for the default one only once tf32.WGMMA_DEFAULT says so.
    tf32_wgmma = precision is not None or tf32.WGMMA_DEFAULT
    # float32 None: FLOAT32_FWD_DEFAULT (3xtf32) for dense calls at D, Dv <= 128 on sm_80+, else FLOAT32_TC_DEFAULT
    precision = effective_forward_precision(precision, q.dtype, launcher.arch, q.shape[-1], v.shape[-1],
                                            dense=ext is None and kv is None)
    key = signature((q, k, v), (launcher.plan_key, bool(causal), float(scale), tuple(batch_shape), kernel, block_m,
                                num_splits, pack_gqa, kv, None if ext is None else ext.static_key(), precision,
                                tf32_wgmma))
    return cached(_PLANS, key, lambda: ForwardPlan(q, k, v, causal=causal, scale=scale, batch_shape=batch_shape,
                                                   launcher=launcher, kernel=kernel, block_m=block_m,
                                                   num_splits=num_splits, pack_gqa=pack_gqa, kv=kv, ext=ext,
                                                   precision=precision, tf32_wgmma=tf32_wgmma))


class KVLayout(tuple):
    """How a KV-cache forward reads its keys (part of the plan's key; no array values): ``paged``,
    ``Lk`` (the key rows an entry may have: the cache length, or max_blocks·page_size), and for
    paged caches the block table's row stride, the page size and the page strides of k and v
    (elements)."""

    __slots__ = ()

    def __new__(cls, paged, Lk, table_row=0, page_size=0, k_page=0, v_page=0):
        return tuple.__new__(cls, (bool(paged), int(Lk), int(table_row), int(page_size), int(k_page), int(v_page)))

    paged = property(lambda self: self[0])
    Lk = property(lambda self: self[1])
    table_row = property(lambda self: self[2])
    page_size = property(lambda self: self[3])
    k_page = property(lambda self: self[4])
    v_page = property(lambda self: self[5])


def kvcache_kernel(dtype, head_dim, head_dim_v, device, arch=None):
    """Whether :func:`forward_kvcache` runs for this dtype and head dims on ``device``: the
    tensor-core forward (float16 from sm_75, bfloat16 from sm_80) and the SIMT one (every dtype)
    both read per-entry key counts and block tables, so it always does."""
    launcher = L.make_launcher(device, arch=arch)
    return kernel_for(dtype, head_dim, head_dim_v, launcher.arch).kernel in ("tensor_core", "simt")


#: Rows of the paged K/V copy's group (PageTable, flash_fwd_copy.cuh): a page must hold whole groups.
PAGE_ROWS = 16


def forward_kvcache(q, k_cache, v_cache, seqlens_k, block_table=None, *, causal, scale, device, counters=None,
                    arch=None, schedule="forward", seed=0, num_splits=None, pack_gqa=None, memo=None):
    """One forward (tensor cores, or SIMT for float32/float64 and bf16 before sm_80) over every
    entry of a KV cache, each with its own key count.

    q : (B, H, Lq, D) or, GQA, (B, H_kv, G, Lq, D); k_cache, v_cache: (B, H_kv, L_cache, D|Dv)
    contiguous, or (num_blocks, H_kv, page_size, D|Dv) page pools with ``block_table`` (B,
    max_blocks) int32; seqlens_k: int32 (B,), the keys entry b sees (the kernel reads it: values
    are not part of the plan). Entry b attends to its first seqlens_k[b] keys (causal: bottom-right
    within them; none: out 0, lse -inf); paged, logical key r of entry b is row r % page_size of
    page block_table[b, r // page_size], read in place. Split-KV and GQA packing as
    :func:`forward`. The page size (axis 2 of a paged ``k_cache``) must be a positive multiple of
    16 — the kernels look a page up once per 16-row group of a key tile (``PageTable`` in
    ``flash_fwd_copy.cuh``) — ValueError otherwise, before anything is launched; other values
    (lengths, table entries) are not checked here (flash_attention_with_kvcache does).

    memo : dict, optional
        Kept by the caller for one call signature (types, dtypes, shapes, strides, alignment and
        device of q, the caches and block_table, and the keywords): the plan found by the first
        call is kept in it (``"plan"``) and reused by the next, which skip computing the plan's
        signature (``flash_attention_with_kvcache``'s call-signature cache). It holds no arrays.
    """
    if block_table is not None and (k_cache.shape[2] <= 0 or k_cache.shape[2] % PAGE_ROWS):
        raise ValueError("flasharray: forward_kvcache: the page size (axis 2 of the paged k_cache) must be a "
                         "positive multiple of %d, got page_size=%d (k_cache.shape=%s)"
                         % (PAGE_ROWS, k_cache.shape[2], tuple(k_cache.shape)))
    p = None if memo is None else memo.get("plan")
    if p is None:
        p = _kvcache_plan(q, k_cache, v_cache, block_table, causal=causal, scale=scale, device=device, arch=arch,
                          schedule=schedule, seed=seed, num_splits=num_splits, pack_gqa=pack_gqa)
        if memo is not None:
            memo["plan"] = p
    xp = p.xp
    k, v = k_cache, v_cache
    if block_table is not None:  # bound as the pools: the kernel reaches pages through the table
        block_table = xp.ascontiguousarray(block_table)
    elif q.ndim == 5:  # GQA: (B, H_kv, 1, L, ·) against q (B, H_kv, G, Lq, D)
        k, v = k[:, :, None], v[:, :, None]
    return p.run(q, k, v, counters, xp.ascontiguousarray(seqlens_k), block_table)


def _kvcache_plan(q, k_cache, v_cache, block_table, *, causal, scale, device, arch, schedule, seed, num_splits,
                  pack_gqa):
    """The :class:`ForwardPlan` of :func:`forward_kvcache` for this signature."""
    xp = L.xp_of(q)
    k, v = k_cache, v_cache
    if block_table is not None:  # the pools seen as (B, H_kv, page_size, ·): entry stride 0
        ps = int(k_cache.shape[2])
        k, v = (xp.lib.stride_tricks.as_strided(c, (q.shape[0],) + c.shape[1:], (0,) + c.strides[1:])
                for c in (k_cache, v_cache))
        block_table = xp.ascontiguousarray(block_table)
        kv = KVLayout(True, block_table.shape[1] * ps, block_table.strides[0] // 4, ps,
                      k_cache.strides[0] // k_cache.itemsize, v_cache.strides[0] // v_cache.itemsize)
    else:
        kv = KVLayout(False, k_cache.shape[2])
    if q.ndim == 5:  # GQA: (B, H_kv, 1, L, ·) against q (B, H_kv, G, Lq, D)
        k, v = k[:, :, None], v[:, :, None]
    batch_shape = np.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    p = plan(q, k, v, causal=causal, scale=scale, batch_shape=batch_shape, device=device, arch=arch,
             schedule=schedule, seed=seed, num_splits=num_splits, pack_gqa=pack_gqa, kv=kv)
    assert p.tile.kernel in ("tensor_core", "simt"), p.tile.kernel  # no TF32 / IO tiles with a KV cache
    return p


def check_num_splits(num_splits):
    """``num_splits``: None (automatic) or an int in [1, ``tiles.MAX_FORCED_SPLITS``]."""
    if num_splits is None:
        return None
    if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)):
        raise TypeError("flasharray: num_splits must be None or an int >= 1, got %r (%s)"
                        % (num_splits, type(num_splits).__name__))
    if not 1 <= num_splits <= tiles.MAX_FORCED_SPLITS:
        raise ValueError("flasharray: num_splits must be None or in [1, %d], got %d"
                         % (tiles.MAX_FORCED_SPLITS, num_splits))
    return int(num_splits)


def forward(q, k, v, *, causal, scale, batch_shape, device, counters=None, kernel=None, arch=None,
            block_m=None, schedule="forward", seed=0, num_splits=None, pack_gqa=None, ext=None, precision=None,
            **opts):
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
    kernel : {None, "tensor_core", "simt", "wgmma"}
        Force a kernel family (None: tensor cores for fp16/bf16 where the arch has them: on sm_90 the
        wgmma kernel where it serves the call, ``cuda_forward_sm90.auto_tile``, else the mma.sync one,
        which "tensor_core" forces).
    arch : optional
        Emulator only: the compute capability whose tile table to use (default sm_80).
    block_m : {None, 384, 512}
        Use an IO-oriented tensor-core tile (benchmarks/io.py), fp16/bf16 only.
    schedule, seed
        Emulator only: fiber schedule ("forward", "reverse", "random") and its seed.
    num_splits : None or int >= 1
        Split-KV (tensor-core kernel): the key range of every query tile is cut into this many
        runs, each run by its own block writing fp32 partial results that a second kernel
        merges. None: ``tiles.auto_num_splits`` from the device's SM count (CuPy's
        ``MultiProcessorCount``; the emulator pretends ``tiles.EMULATOR_SM_COUNT``) and the
        problem size; 1: the dense kernel alone. The SIMT kernels (fp32, fp64, bf16 on sm_75)
        do not split: a count > 1 there raises NotImplementedError.
    pack_gqa : None or False
        GQA packing (:func:`gqa_packing`) where it applies (None), or never (False: tests; never
        with extensions either).
    ext : Extensions or None
        The extension keywords of the call (docs/extensions.md), validated and in their normal
        forms (:mod:`flasharray._private.extensions`); None: the dense kernels. Every feature runs
        on both kernels (compile-time ``kExt`` bits), composable with causal, split-KV, any dtype,
        strides and broadcasting.
    precision : {None, "ieee", "tf32", "3xtf32"}
        float32 only (validated by the caller, ``precision.check_precision``): "tf32" / "3xtf32"
        run ``cuda_src/flash_fwd_tf32.cu`` on TF32 tensor cores where it applies
        (:func:`cuda_forward_tf32.forward_tile`: d, dv <= 256 without split-KV or KV cache; 3xtf32
        above 128 only without extensions and where a tile fits the arch's shared memory), the SIMT
        kernel otherwise; NotImplementedError naming the arch below sm_80 (the emulator's arch
        is its compile target, ``arch``). None and "ieee": the SIMT kernel (exact fp32), the
        float32 default until a GPU measurement picks one. float64 (None or "ieee", IEEE fp64
        either way): ``cuda_src/flash_fwd_f64.cu`` on DMMA on sm_80+ where it applies
        (:func:`cuda_forward_f64.forward_tile`), the SIMT kernel otherwise.

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
             arch=arch, block_m=block_m, schedule=schedule, seed=seed, num_splits=num_splits, pack_gqa=pack_gqa,
             ext=ext, precision=precision)
    return p.run(q, k, v, counters, ext=ext)


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
