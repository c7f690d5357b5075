"""FlashAttention backward on the CUDA kernels of ``cuda_src/`` (GPU through CuPy, or the emulator).

Passes (see docs/cuda_backward.md):

1. ``flash_bwd_preprocess_kernel``: ``D_i = rowsum(dO_i ∘ O_i)`` (AccT); in the atomic mode it
   also clears the AccT dQ accumulator.
2. ``flash_bwd_dkv[_simt]_kernel``: one block per (key block j, K/V batch entry); walks the query
   blocks (and the query heads sharing K_j, V_j) recomputing P from the saved LSE; dK_j, dV_j in
   registers. ``deterministic=False``: also ``dQ += dS K_j · scale`` with float atomics.
3. ``deterministic=True``: ``flash_bwd_dq[_simt]_kernel``, one block per query block, recomputing
   P and dS over the key blocks, dQ_i in registers (no atomics, bitwise reproducible).
   ``deterministic=False``: ``flash_bwd_convert_dq_kernel`` converts the accumulator to the dtype.

Batch handling: the leading dims are split into *grid* dims (merged; at most 3 per launch, the
blockIdx.y/z convention, more are looped over on the host) and, for the dK/dV kernel, one
*group* dim walked inside the block:
the dims along which both K and V are broadcast (MQA/GQA), so dK/dV are summed over the group
in registers without copies of K or V. Anything left (a dim along which only one of K, V is
broadcast, or q itself broadcast) goes through an AccT buffer reduced over those dims on the
device, in a fixed order.
"""
import itertools

import numpy as np

from . import launch
from . import tiles_bwd as tiles
from .dtypes import accumulation_dtype, bfloat16, canonical_dtype

_CTYPE = {np.dtype(np.float16): "fa_half", bfloat16: "fa_bf16",
          np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
_MAX_GRID_DIMS = 3


# ---------------------------------------------------------------------------------------------
# Batch planning
def _batch_strides(a, nb):
    """Element strides of the first ``nb`` (batch) dims of ``a``; 0 along size-1 dims (broadcast)."""
    return [0 if a.shape[i] == 1 else a.strides[i] // a.itemsize for i in range(nb)]


def _merge(sizes, tensor_strides):
    """Merge adjacent dims (``launch.merge_batch_dims``) for every tensor of ``{name: strides}``."""
    names = list(tensor_strides)
    shape, strides = launch.merge_batch_dims(sizes, [tensor_strides[n] for n in names])
    return list(shape), {n: list(s) for n, s in zip(names, strides)}


def _grid_fits(sizes):
    """Whether ≤ 3 merged dims fit grid.z = nb0 and grid.y = nb1·nb2 (CUDA's 65535 limit)."""
    dims = [1] * (_MAX_GRID_DIMS - len(sizes)) + list(sizes)
    return dims[0] <= launch.MAX_GRID_YZ and dims[1] * dims[2] <= launch.MAX_GRID_YZ


def _launch_plans(sizes, strides):
    """Split merged batch dims into launches of exactly (nb0, nb1, nb2) grid dims.

    As ``launch.batch_plan``: dims that do not fit (more than three, or grid.y / grid.z above
    ``launch.MAX_GRID_YZ``) are looped over on the host, outermost first; a lone dim above the
    limit is launched in chunks. Returns a list of ``(dims, strides3, offsets)``: the padded grid
    dims, each tensor's three batch strides, and each tensor's element offset for that launch.
    """
    sizes = list(sizes)
    n_outer = 0
    while len(sizes) - n_outer > _MAX_GRID_DIMS or (len(sizes) - n_outer > 1 and not _grid_fits(sizes[n_outer:])):
        n_outer += 1
    inner = sizes[n_outer:]
    chunks = [(0, None)]
    if inner and not _grid_fits(inner):  # one dim alone above the limit
        chunks = [(c, min(launch.MAX_GRID_YZ, inner[0] - c)) for c in range(0, inner[0], launch.MAX_GRID_YZ)]
    plans = []
    for idx in itertools.product(*[range(n) for n in sizes[:n_outer]]):
        for start, count in chunks:
            cur = list(inner)
            if count is not None:
                cur[0] = count
            pad = _MAX_GRID_DIMS - len(cur)
            strides3 = {n: [0] * pad + list(st[n_outer:]) for n, st in strides.items()}
            offsets = {n: sum(i * si for i, si in zip(idx, st[:n_outer])) + start * (st[n_outer] if inner else 0)
                       for n, st in strides.items()}
            plans.append(([1] * pad + cur, strides3, offsets))
    return plans


# ---------------------------------------------------------------------------------------------
# Launching
class _Runner:
    """``launch.Launcher`` plus the list of ``(kernel, counters)`` of this backward's launches."""

    def __init__(self, launcher):
        self.launcher = launcher
        self.counters = []

    def launch(self, source, name, grid, block, args, smem=0):
        if 0 in grid:
            return
        # Arrays travel as flat views (launch.flat_view) of the span they reach from this launch's
        # first element: the kernels index with strides.
        c = self.launcher.launch(source, name, tuple(int(x) for x in grid), (int(block), 1, 1),
                                 tuple(args), shared_mem=int(smem))
        self.counters.append((name, c))


# ---------------------------------------------------------------------------------------------
# Arrays
def _aligned16(a):
    ptr = a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr
    return ptr % 16 == 0


# ---------------------------------------------------------------------------------------------
def _b(flag):
    return "true" if flag else "false"


def default_kernel(dtype, arch):
    """"tc" where tensor cores serve the dtype (fp16 on sm_75+, bf16 on sm_80+), else "simt" —
    the same fallback as the forward, so bf16 on Turing trains end to end."""
    dtype = canonical_dtype(dtype)
    if dtype.itemsize == 2 and (arch >= 80 or (dtype != bfloat16 and arch >= 75)):
        return "tc"
    return "simt"


def kernel_plan(dtype, D, Dv, *, causal, deterministic, arch, kernel=None, acc_dkv=False,
                acc_dq=False, vec=True, stages=None):
    """The kernels one backward launches: ``{role: (source file, name expression, BwdTiles)}``.

    Roles: ``preprocess``, ``dkv``, and ``dq`` (deterministic) or ``convert`` (atomic mode).
    ``kernel``: "tc" or "simt" (default: :func:`default_kernel`); ``acc_dkv`` / ``acc_dq``: dK/dV or dQ
    written as AccT partial sums (broadcast dims reduced afterwards); ``vec``: cp.async tile
    loads (16-byte aligned rows); ``stages``: force 1 or 2 buffers of the tensor-core kernels'
    streamed tiles (default: the tile table's choice). Also used by the static checks.
    """
    dtype = canonical_dtype(dtype)
    acc = accumulation_dtype(dtype)
    T, A = _CTYPE[dtype], _CTYPE[acc]
    kernel = kernel or default_kernel(dtype, arch)
    pD, pDv = tiles.pad_head_dim(D), tiles.pad_head_dim(Dv)
    out_kv = A if acc_dkv else T
    out_q = A if acc_dq else T
    plan = {"preprocess": ("flash_bwd_preprocess.cu", "flash_bwd_preprocess_kernel<%s, %s, %d, %s>" % (
        T, A, tiles.ROW_THREADS, _b(not deterministic)), None)}
    if kernel == "tc":
        t_kv = tiles.tc_tiles("dkv", D, Dv, arch, stages)
        plan["dkv"] = ("flash_bwd.cu", "flash_bwd_dkv_kernel<%s, %s, %d, %d, %d, %d, %d, %s, %s, %s, %d>" % (
            T, out_kv, pD, pDv, t_kv.block_m, t_kv.block_n, t_kv.n_threads // 32, _b(causal),
            _b(not deterministic), _b(vec), t_kv.stages), t_kv)
        if deterministic:
            t_q = tiles.tc_tiles("dq", D, Dv, arch, stages)
            plan["dq"] = ("flash_bwd.cu", "flash_bwd_dq_kernel<%s, %s, %d, %d, %d, %d, %d, %s, %s, %d>" % (
                T, out_q, pD, pDv, t_q.block_m, t_q.block_n, t_q.n_threads // 32, _b(causal), _b(vec),
                t_q.stages), t_q)
    else:
        t_kv = tiles.simt_tiles("dkv", dtype, D, Dv, arch)
        plan["dkv"] = ("flash_bwd_simt.cu", "flash_bwd_dkv_simt_kernel<%s, %s, %s, %d, %d, %d, %d, %d, %s, %s>" % (
            T, A, out_kv, pD, pDv, t_kv.block_m, t_kv.block_n, t_kv.n_threads, _b(causal),
            _b(not deterministic)), t_kv)
        if deterministic:
            t_q = tiles.simt_tiles("dq", dtype, D, Dv, arch)
            plan["dq"] = ("flash_bwd_simt.cu", "flash_bwd_dq_simt_kernel<%s, %s, %s, %d, %d, %d, %d, %d, %s>" % (
                T, A, out_q, pD, pDv, t_q.block_m, t_q.block_n, t_q.n_threads, _b(causal)), t_q)
    if not deterministic and kernel == "tc":
        # The padded, fragment-ordered accumulator (DQAccumLayout) -> dQ (or AccT partial sums when
        # q is broadcast); 16-byte stores when D % 8 == 0 (dq is ours: contiguous, aligned).
        plan["convert"] = ("flash_bwd_convert.cu", "flash_bwd_convert_dq_tc_kernel<%s, %d, %d, %d, %s>" % (
            out_q, tiles.ROW_THREADS, t_kv.block_m, pD, _b(D % 8 == 0)), None)
    elif not deterministic and not acc_dq:
        plan["convert"] = ("flash_bwd_convert.cu", "flash_bwd_convert_dq_kernel<%s, %s, %d, %d>" % (
            T, A, tiles.ROW_THREADS, tiles.ROWS_PER_BLOCK), None)
    return plan


def _empty(xp, shape, dtype):
    """``xp.empty``, 256-byte aligned on the host too (as CuPy's allocations are): the kernels'
    16-byte stores need 16-byte aligned rows, and the emulator's sector counts assume CuPy's
    alignment."""
    if xp is not np:
        return xp.empty(shape, dtype=dtype)
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(n + 256, dtype=np.uint8)
    off = (-raw.ctypes.data) % 256
    return raw[off:off + n].view(dtype).reshape(shape)


def dq_accum_rows(Lq, kernel, t_kv):
    """Rows of the atomic mode's dQ accumulator per batch entry: Lq (SIMT, row-major) or Lq rounded
    up to the dK/dV kernel's query block (tensor cores: DQAccumLayout, no bounds tests)."""
    return Lq if kernel != "tc" else -(-Lq // t_kv.block_m) * t_kv.block_m


def backward(dout, q, k, v, out, lse, *, causal, scale, batch_shape, device, deterministic=True,
             **opts):
    """Gradients of FlashAttention by the CUDA backward kernels.

    Parameters
    ----------
    dout : array, shape (*batch_shape, Lq, Dv), dtype of q
    q : array, shape (*bq, Lq, D); k : (*bk, Lk, D); v : (*bv, Lk, Dv)
        Each batch dim of q, k, v is ``batch_shape[i]`` or 1 (broadcast). float16, bfloat16,
        float32 or float64 (one dtype). Any strides; a non-contiguous last axis is copied.
    out : array, shape (*batch_shape, Lq, Dv), dtype of q; lse : (*batch_shape, Lq), AccT
        The forward's outputs (lse natural log, -inf for a row that sees no key).
    causal : bool
        Bottom-right aligned causal mask.
    scale : float
    batch_shape : tuple
    device : {"cuda", "emulator"}
        CuPy arrays on the current device, or NumPy arrays run by ``flasharray.emulator``.
    deterministic : bool
        True: separate dQ kernel, no atomics, bitwise reproducible. False: float atomics into an
        AccT dQ accumulator plus a conversion pass.
    **opts
        ``schedule``, ``seed`` (emulator fiber schedule), ``arch`` (tile table's target,
        default the device's, ``sm_80`` for the emulator), ``kernel`` ("tc" or "simt"; default
        tensor cores for fp16/bf16), ``stages`` (1 or 2: force single- or double-buffered
        streamed tiles in the tensor-core kernels), ``return_counters`` (emulator: also return the list of
        ``(kernel name, counters)`` of every launch).

    Returns
    -------
    dq, dk, dv : arrays with exactly the shapes and dtype of q, k, v (summed over broadcast
        batch dims); ``(dq, dk, dv, counters)`` with ``return_counters=True``.
    """
    unknown = set(opts) - {"schedule", "seed", "arch", "kernel", "stages", "return_counters"}
    if unknown:
        raise TypeError("flasharray.cuda_backward: unexpected option(s) %s" % sorted(unknown))
    if device not in ("cuda", "emulator"):
        raise ValueError("flasharray.cuda_backward: device must be 'cuda' or 'emulator', got %r" % (device,))
    runner = _Runner(launch.make_launcher(device, schedule=opts.get("schedule", "forward"),
                                          seed=opts.get("seed", 0), arch=opts.get("arch")))
    xp = runner.launcher.xp()
    dtype = canonical_dtype(q.dtype)
    acc = accumulation_dtype(dtype)
    arch = tiles.arch_number(opts["arch"]) if "arch" in opts else runner.launcher.arch
    kernel = opts.get("kernel") or default_kernel(dtype, arch)
    if kernel == "tc" and dtype.itemsize != 2:
        raise NotImplementedError("flasharray: the tensor-core backward supports float16 and bfloat16, "
                                  "got %s (the SIMT kernel covers float32/float64)" % dtype)
    if kernel == "tc" and dtype == bfloat16 and arch < 80:
        raise NotImplementedError("flasharray: bfloat16 needs tensor cores of sm_80 or newer, got sm_%d" % arch)
    if kernel == "tc" and arch < 75:
        raise NotImplementedError("flasharray: float16 tensor-core kernels need sm_75 or newer, got sm_%d" % arch)

    batch_shape = tuple(int(b) for b in batch_shape)
    nb = len(batch_shape)
    Lq, D = q.shape[-2], q.shape[-1]
    Lk, Dv = v.shape[-2], v.shape[-1]
    q, k, v, dout, out = (launch.kernel_ready(a) for a in (q, k, v, dout, out))
    lse = launch.kernel_ready(lse.astype(acc, copy=False))
    scale_arg = launch.c_scalar(scale, acc)

    full = tuple(batch_shape)
    delta = xp.empty(full + (Lq,), dtype=acc)
    if deterministic:
        dqacc = xp.empty((1,), dtype=acc)
    elif kernel == "tc":  # padded rows and head dim (DQAccumLayout)
        dqacc = _empty(xp, full + (dq_accum_rows(Lq, kernel, tiles.tc_tiles("dkv", D, Dv, arch, opts.get("stages"))),
                                   tiles.pad_head_dim(D)), acc)
    else:
        dqacc = _empty(xp, full + (Lq, D), acc)

    # ---- plan A: full batch in the grid (preprocess, dQ, convert)
    dims = [i for i in range(nb) if batch_shape[i] > 1]
    q_bcast = any(q.shape[i] == 1 for i in dims)
    # q broadcast along a batch dim: dQ goes to an AccT buffer of the full batch, summed afterwards.
    dq_buf = _empty(xp, full + (Lq, D), acc) if q_bcast else _empty(xp, q.shape, dtype)
    tensors_a = {"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse, "delta": delta,
                 "dq": dq_buf}
    if not deterministic:
        tensors_a["dqacc"] = dqacc
    sizes_a, strides_a = _merge([batch_shape[i] for i in dims],
                                {n: [_batch_strides(a, nb)[i] for i in dims] for n, a in tensors_a.items()})
    plans_a = _launch_plans(sizes_a, strides_a)

    # ---- plan B: dK/dV kernel, group dim = dims where K and V are both broadcast
    shared = [i for i in dims if k.shape[i] == 1 and v.shape[i] == 1]
    qside = {"q": q, "dout": dout, "lse": lse, "delta": delta, "dqacc": dqacc}
    qside_strides = {n: _batch_strides(a, nb) if a.ndim > 1 else [0] * nb for n, a in qside.items()}
    # The group is the longest run of trailing shared dims that merges into one dim for every
    # query-side tensor; shared dims before it are walked by the grid instead (their dK/dV
    # partial sums are reduced afterwards).
    for start in range(len(shared) + 1):
        run = shared[start:]
        g_sizes, g_strides = _merge([batch_shape[i] for i in run],
                                    {n: [s[i] for i in run] for n, s in qside_strides.items()})
        if len(g_sizes) <= 1:
            shared = run
            break
    grid_b = [i for i in dims if i not in shared]
    partial = any(k.shape[i] == 1 or v.shape[i] == 1 for i in grid_b)
    if partial:
        kshape = tuple(batch_shape[i] if i in grid_b else 1 for i in range(nb))
        dk_buf = _empty(xp, kshape + (Lk, D), acc)
        dv_buf = _empty(xp, kshape + (Lk, Dv), acc)
    else:
        dk_buf = _empty(xp, k.shape, dtype)
        dv_buf = _empty(xp, v.shape, dtype)
    tensors_b = dict(qside, k=k, v=v, dk=dk_buf, dv=dv_buf)
    sizes_b, strides_b = _merge([batch_shape[i] for i in grid_b],
                                {n: [_batch_strides(a, nb)[i] if a.ndim > 1 else 0 for i in grid_b]
                                 for n, a in tensors_b.items()})
    plans_b = _launch_plans(sizes_b, strides_b)
    n_group = g_sizes[0] if g_sizes else 1
    gs = {n: (s[0] if s else 0) for n, s in g_strides.items()}

    def rs(a):  # row stride in elements
        return a.strides[-2] // a.itemsize if a.shape[-2] > 1 else a.shape[-1]

    def st(plan_strides, name, a, group=None, row=True):
        s = [np.int64(x) for x in plan_strides[name]]
        if group is not None:
            s.append(np.int64(group))
        if row:
            s.append(np.int64(rs(a)))
        return s

    i32, i64 = np.int32, np.int64

    # ---- kernels
    vec = kernel == "tc" and (
        D % 8 == 0 and Dv % 8 == 0
        and all(rs(a) % 8 == 0 and _aligned16(a) for a in (q, k, v, dout))
        and all(x % 8 == 0 for a in (q, k, v, dout) for x in _batch_strides(a, nb)))
    ks = kernel_plan(dtype, D, Dv, causal=causal, deterministic=deterministic, arch=arch, kernel=kernel,
                     acc_dkv=partial, acc_dq=q_bcast, vec=vec, stages=opts.get("stages"))
    (src_pre, name_pre, _), (src_main, name_kv, t_kv) = ks["preprocess"], ks["dkv"]
    # ---- 1. D_i = rowsum(dO_i ∘ O_i)  (and clear the dQ accumulator in the atomic mode)
    rows_grid = -(-Lq // tiles.ROWS_PER_BLOCK)
    for (nb0, nb1, nb2), sa, off in plans_a:
        at = lambda name, a: launch.flat_view(a, off.get(name, 0))  # noqa: E731
        # the accumulator is cleared as n_accum contiguous elements per batch entry
        dqa_args = (st(sa, "dqacc", dqacc, row=False) + [i64(dqacc.shape[-2] * dqacc.shape[-1])]
                    if not deterministic else [i64(0)] * 4)
        runner.launch(src_pre, name_pre, (rows_grid, nb1 * nb2, nb0), tiles.ROW_THREADS,
                      [at("dout", dout), *st(sa, "dout", dout), at("out", out), *st(sa, "out", out),
                       at("delta", delta), *st(sa, "delta", delta, row=False),
                       at("dqacc", dqacc), *dqa_args, i32(Lq), i32(Dv), i32(nb2)])

    # ---- 2. dK, dV (+ atomic dQ)
    Tc = -(-Lk // t_kv.block_n)
    for (mb0, mb1, mb2), sb, off in plans_b:
        at = lambda name, a: launch.flat_view(a, off.get(name, 0))  # noqa: E731
        dqa_b = st(sb, "dqacc", dqacc, group=gs["dqacc"]) if not deterministic else [i64(0)] * 5
        runner.launch(src_main, name_kv, (Tc, mb1 * mb2, mb0), t_kv.n_threads,
                      [at("q", q), *st(sb, "q", q, group=gs["q"]),
                       at("k", k), *st(sb, "k", k), at("v", v), *st(sb, "v", v),
                       at("dout", dout), *st(sb, "dout", dout, group=gs["dout"]),
                       at("lse", lse), *st(sb, "lse", lse, group=gs["lse"], row=False),
                       at("delta", delta), *st(sb, "delta", delta, group=gs["delta"], row=False),
                       at("dqacc", dqacc), *dqa_b,
                       at("dk", dk_buf), *st(sb, "dk", dk_buf), at("dv", dv_buf), *st(sb, "dv", dv_buf),
                       i32(Lq), i32(Lk), i32(D), i32(Dv), i32(mb2), i32(n_group), scale_arg],
                      t_kv.smem)

    # ---- 3. dQ: deterministic kernel, or conversion of the atomic accumulator
    for (nb0, nb1, nb2), sa, off in plans_a:
        at = lambda name, a: launch.flat_view(a, off.get(name, 0))  # noqa: E731
        if deterministic:
            _, name_q, t_q = ks["dq"]
            Tr = -(-Lq // t_q.block_m)
            runner.launch(src_main, name_q, (Tr, nb1 * nb2, nb0), t_q.n_threads,
                          [at("q", q), *st(sa, "q", q), at("k", k), *st(sa, "k", k),
                           at("v", v), *st(sa, "v", v), at("dout", dout), *st(sa, "dout", dout),
                           at("lse", lse), *st(sa, "lse", lse, row=False),
                           at("delta", delta), *st(sa, "delta", delta, row=False),
                           at("dq", dq_buf), *st(sa, "dq", dq_buf),
                           i32(Lq), i32(Lk), i32(D), i32(Dv), i32(nb2), scale_arg],
                          t_q.smem)
        elif kernel == "tc":  # DQAccumLayout -> dQ (AccT when q is broadcast), times scale
            src_cvt, name_cvt, _ = ks["convert"]
            runner.launch(src_cvt, name_cvt, (-(-Lq // t_kv.block_m), nb1 * nb2, nb0), tiles.ROW_THREADS,
                          [at("dqacc", dqacc), *st(sa, "dqacc", dqacc, row=False),
                           at("dq", dq_buf), *st(sa, "dq", dq_buf), i32(Lq), i32(D), i32(nb2), scale_arg])
        elif not q_bcast:
            src_cvt, name_cvt, _ = ks["convert"]
            runner.launch(src_cvt, name_cvt, (rows_grid, nb1 * nb2, nb0), tiles.ROW_THREADS,
                          [at("dqacc", dqacc), *st(sa, "dqacc", dqacc), at("dq", dq_buf), *st(sa, "dq", dq_buf),
                           i32(Lq), i32(D), i32(nb2)])
    if not deterministic and q_bcast and kernel != "tc":
        dq_buf = dqacc  # summed over q's broadcast dims below

    # ---- broadcast dims not summed inside the kernels: fixed-order reductions on the device
    dq = _reduce_to(xp, dq_buf, q.shape, dtype)
    dk = _reduce_to(xp, dk_buf, k.shape, dtype)
    dv = _reduce_to(xp, dv_buf, v.shape, dtype)
    if opts.get("return_counters"):
        return dq, dk, dv, runner.counters
    return dq, dk, dv


def _reduce_to(xp, buf, shape, dtype):
    if buf.shape == tuple(shape) and buf.dtype == dtype:
        return buf
    axes = tuple(i for i in range(len(shape) - 2) if shape[i] == 1 and buf.shape[i] != 1)
    if axes:
        buf = buf.sum(axis=axes, keepdims=True)
    return buf.astype(dtype).reshape(shape)


# ---------------------------------------------------------------------------------------------
# Global-memory traffic model
def visited_rows(Lq, Lk, causal, kv_tiles, q_tiles=None):
    """Rows that the causal block skipping leaves to load, per batch entry.

    Returns ``(q_rows, k_rows)``: query rows the dK/dV kernel loads summed over its key blocks
    (a key block starting at c0 skips the query blocks wholly above the diagonal), and key rows
    the deterministic dQ kernel loads summed over its query blocks (0 without ``q_tiles``).
    """
    Br, Bc = kv_tiles.block_m, kv_tiles.block_n
    q_rows = 0
    for c0 in range(0, Lk, Bc):
        first = c0 - (Lk - Lq) if causal else 0        # first query row that sees key c0
        i_begin = max(0, first) // Br
        q_rows += max(0, Lq - i_begin * Br)
    k_rows = 0
    if q_tiles is not None:
        Br, Bc = q_tiles.block_m, q_tiles.block_n
        for r0 in range(0, Lq, Br):
            last_row = min(r0 + Br, Lq) - 1
            n = min(last_row + Lk - Lq + 1, Lk) if causal else Lk   # keys the last row sees
            k_rows += min(-(-n // Bc) * Bc, Lk) if n > 0 else 0
    return q_rows, k_rows


def analytic_global_bytes(B, Lq, Lk, D, Dv, dtype, *, causal=False, deterministic=True, arch=None,
                          kernel=None):
    """(bytes read, bytes written) in global memory by one backward without broadcasting.

    What the kernels move: the preprocess reads dO and O once and writes D; the dK/dV kernel
    reads K_j, V_j once and, per visited (key block, query block) pair, Q_i, dO_i, L_i, D_i, and
    writes dK, dV once; the deterministic dQ kernel reads Q_i, dO_i, L_i, D_i once and K_j, V_j
    per visited pair, and writes dQ; the atomic mode instead clears the AccT dQ accumulator,
    read-modify-writes it once per visited pair (atomics) and converts it once. The emulator's
    counters equal this exactly (tests/test_cuda_backward.py).
    """
    dtype = canonical_dtype(dtype)
    s, a = dtype.itemsize, accumulation_dtype(dtype).itemsize
    arch = tiles.EMULATOR_ARCH if arch is None else tiles.arch_number(arch)
    plan = kernel_plan(dtype, D, Dv, causal=causal, deterministic=deterministic, arch=arch, kernel=kernel)
    q_rows, k_rows = visited_rows(Lq, Lk, causal, plan["dkv"][2], plan["dq"][2] if deterministic else None)
    row_q = (D + Dv) * s  # one row of Q and of dO
    row_k = (D + Dv) * s  # one row of K and of V
    read = 2 * Lq * Dv * s                                       # preprocess: dO, O
    write = Lq * a                                               # D
    read += Lk * row_k + q_rows * (row_q + 2 * a)                # dK/dV kernel
    write += Lk * row_k
    if deterministic:
        read += Lq * (row_q + 2 * a) + k_rows * row_k            # dQ kernel
        write += Lq * D * s
    elif plan["convert"][1].startswith("flash_bwd_convert_dq_tc_kernel"):
        # DQAccumLayout: rows padded to Br, columns to the padded D; every atomic of a visited
        # (key block, query block) pair runs (no bounds tests); the conversion reads whole 8-column
        # chunks of the rows < Lq.
        t_kv = plan["dkv"][2]
        Br, pD = t_kv.block_m, tiles.pad_head_dim(D)
        q_blocks = visited_query_blocks(Lq, Lk, causal, t_kv)
        write += dq_accum_rows(Lq, "tc", t_kv) * pD * a           # clear the accumulator
        read += q_blocks * Br * pD * a                             # atomics (read-modify-write)
        write += q_blocks * Br * pD * a
        read += Lq * -(-D // 8) * 8 * a                            # convert
        write += Lq * D * s
    else:
        write += Lq * D * a                                      # clear the accumulator
        read += q_rows * D * a                                   # atomics (read-modify-write)
        write += q_rows * D * a
        read += Lq * D * a                                       # convert
        write += Lq * D * s
    return B * read, B * write


def visited_query_blocks(Lq, Lk, causal, kv_tiles):
    """(key block, query block) pairs the dK/dV kernel visits per batch entry."""
    Br, Bc = kv_tiles.block_m, kv_tiles.block_n
    Tr = -(-Lq // Br)
    n = 0
    for c0 in range(0, Lk, Bc):
        first = c0 - (Lk - Lq) if causal else 0        # first query row that sees key c0
        n += max(0, Tr - max(0, first) // Br)
    return n
