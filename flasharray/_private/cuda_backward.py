"""FlashAttention backward on the CUDA kernels of ``cuda_src/`` (GPU through CuPy, or the emulator).

Passes (see docs/cuda_backward.md):

1. ``flash_bwd_preprocess_kernel``: ``D_i = rowsum(dO_i ∘ O_i)`` (AccT); in the atomic modes it
   also clears the AccT dQ accumulator (and the ordered mode's counters).
2. ``flash_bwd_dkv[_simt]_kernel``: one block per (key block j, K/V batch entry); walks the query
   blocks (and the query heads sharing K_j, V_j) recomputing P from the saved LSE; dK_j, dV_j in
   registers. Atomic modes: also ``dQ += dS K_j`` with float atomics — in any order
   (``deterministic=False``), or in key-block order ("ordered", :func:`dq_mode`: the
   deterministic default on tensor cores without extensions; bitwise reproducible).
3. Atomic modes: ``flash_bwd_convert_dq[_tc]_kernel`` converts the accumulator to the dtype.
   "recompute" (deterministic otherwise): ``flash_bwd_dq[_simt]_kernel``, one block per query
   block, recomputing P and dS over the key blocks, dQ_i in registers (no atomics).

Batch handling: the leading dims are split into *grid* dims (merged; at most 3 per launch, the
blockIdx.y/z convention, more are looped over on the host) and, for the dK/dV kernel, one
*group* dim walked inside the block:
the dims along which both K and V are broadcast (MQA/GQA), so dK/dV are summed over the group
in registers without copies of K or V. Anything left (a dim along which only one of K, V is
broadcast, or q itself broadcast) goes through an AccT buffer reduced over those dims on the
device, in a fixed order.
"""
import itertools
import math
import operator

import numpy as np

from . import launch
from . import tiles_bwd as tiles
from .dtypes import accumulation_dtype, bfloat16, canonical_dtype
from .precision import effective_precision


def _fwd():
    """cuda_forward (imported late: it imports this module's neighbours)."""
    from . import cuda_forward
    return cuda_forward


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
    """Records the launches of one :class:`BackwardPlan` (``launch.Recorded``, array arguments
    as ``launch.Ptr(buffer name, offset)``); launches with an empty grid are dropped."""

    def __init__(self, launcher):
        self.launcher = launcher
        self.launches = []

    def launch(self, source, name, grid, block, args, smem=0):
        if 0 in grid:
            return
        self.launches.append(launch.Recorded(self.launcher, source, name, grid, (int(block), 1, 1), args,
                                             shared_mem=int(smem)))


# ---------------------------------------------------------------------------------------------
# Arrays
def _vec_rows(t, nb, dtype):
    """Whether the tensor-core kernels copy q, k, v, dout by 16-byte cp.async chunks (every row, row stride and
    batch stride a multiple of 16 bytes, the arrays 16-byte aligned), else element by element."""
    c = 16 // dtype.itemsize  # elements per 16-byte cp.async chunk
    q, k, v, dout = t["q"], t["k"], t["v"], t["dout"]
    return (q.shape[-1] % c == 0 and v.shape[-1] % c == 0
            and all(_rs(a) % c == 0 and _aligned16(a) for a in (q, k, v, dout))
            and all(x % c == 0 for a in (q, k, v, dout) for x in _batch_strides(a, nb)))


def _aligned16(a):
    return launch.device_address(a) % 16 == 0


# ---------------------------------------------------------------------------------------------
def _b(flag):
    return "true" if flag else "false"


#: The float32 / float64 tensor-core backward families (issue 12): the atomic-dQ structure of "tc"
#: (one dK/dV kernel per key block, dQ by atomics into the DQAccumLayout accumulator, in key-block
#: order when deterministic) on TF32 mma (float32, precision "tf32" / "3xtf32") or DMMA (float64).
#: Each module has ``SOURCE``, ``backward_tile(precision, dtype, D, Dv, arch, *, ext)`` (None where
#: the family does not apply: the SIMT kernels run) and ``dkv_name(tile, precision, pD, pDv,
#: causal, vec, ordered)``.
FAMILIES = {"tf32": "cuda_backward_tf32", "f64": "cuda_backward_f64",
            # Hopper fp16 / bf16 on wgmma (issue 13): kernel="wgmma" on sm_90, and kernel=None there where
            # auto_wgmma says so (never chosen by family_tile); its module's backward_tile raises
            # NotImplementedError where it cannot run.
            "wgmma": "cuda_backward_sm90"}
#: Kernel families sharing the atomic-dQ passes (DQAccumLayout accumulator, ordered mode, convert).
TC_FAMILIES = ("tc",) + tuple(FAMILIES)
_FAMILY_OF = {np.dtype(np.float32): "tf32", np.dtype(np.float64): "f64"}


def _family_module(name):
    import importlib
    return importlib.import_module("." + FAMILIES[name], __package__)


def family_tile(dtype, precision, D, Dv, arch, ext=False, device=None):
    """``(family, dK/dV tile)`` when a float32 / float64 backward runs on tensor cores (the family
    module says where it applies: dtype, precision, arch, head dims, no extensions), else None.
    ``device``: the launcher's (the tf32 family's wgmma tile needs NVRTC's sm_90a on "cuda")."""
    name = _FAMILY_OF.get(canonical_dtype(dtype))
    if name is None:
        return None
    try:
        module = _family_module(name)
    except ImportError:  # the family's module is not built yet (issue 12, in progress)
        return None
    t = module.backward_tile(precision, canonical_dtype(dtype), D, Dv, arch, ext=ext,
                             **({"device": device} if name == "tf32" else {}))
    return None if t is None else (name, t)


def default_kernel(dtype, arch):
    """"tc" where tensor cores serve the dtype (fp16 on sm_75+, bf16 on sm_80+), else "simt" —
    the same fallback as the forward, so bf16 on Turing trains end to end."""
    dtype = canonical_dtype(dtype)
    if dtype.itemsize == 2 and (arch >= 80 or (dtype != bfloat16 and arch >= 75)):
        return "tc"
    return "simt"


def kernel_plan(dtype, D, Dv, *, causal, deterministic, arch, kernel=None, acc_dkv=False,
                acc_dq=False, vec=True, stages=None, ext=0, ordered=False, precision=None, tma=False, device=None):
    """The kernels one backward launches: ``{role: (source file, name expression, BwdTiles)}``.

    Roles: ``preprocess``, ``dkv``, and ``dq`` (deterministic, recomputing) or ``convert`` (atomic
    modes). ``ordered``: the deterministic mode by ordered atomics (where it runs the bits: :func:`dq_mode`): the
    atomic mode's kernels with ``kOrderedDQ`` (``deterministic`` is then irrelevant).
    ``kernel``: "tc", "simt", or a float32 / float64 tensor-core family of :data:`FAMILIES` ("tf32"
    with ``precision`` "tf32" / "3xtf32", "f64"), which runs the atomic modes only (default:
    :func:`default_kernel`); ``acc_dkv`` / ``acc_dq``: dK/dV or dQ
    written as AccT partial sums (broadcast dims reduced afterwards); ``vec``: cp.async tile
    loads (16-byte aligned rows); ``stages``: force 1 or 2 buffers of the tensor-core kernels'
    streamed tiles (default: the tile table's choice); ``ext``: the kernels' ``kExt`` bits
    (``cuda_forward.EXT_BITS``; 0: the dense instantiations, whose names carry no kExt); ``tma``:
    kernel "wgmma" in the atomic modes (plain or ordered), the warp-specialized TMA dK/dV kernel
    (``cuda_backward_sm90.ws_name``); ``device``: the launcher's (kernel "tf32": its wgmma tile needs NVRTC's
    sm_90a on "cuda"). Also used by the static checks.
    """
    dtype = canonical_dtype(dtype)
    acc = accumulation_dtype(dtype)
    T, A = _CTYPE[dtype], _CTYPE[acc]
    kernel = kernel or default_kernel(dtype, arch)
    wide = tiles.pad_head_dim(max(D, Dv))
    if ordered and (kernel not in ORDERED_KERNELS or (ext and not _family_orders(kernel, ext, wide))):
        raise ValueError("flasharray: the ordered dQ mode takes no ALiBi above head dim 128 on the fp16/bf16 "
                         "mma.sync kernel (kernel %r, kExt %d)" % (kernel, ext))
    atomic = not deterministic or ordered
    x = ", %d, true>" % ext if ordered else ", %d>" % ext if ext else ">"
    # the fp16 / bf16 grid-layout dK/dV kernel's kEntriesFirst (its last argument): dense calls. (With extensions, and
    # in the row-tile kernel, the remap's registers spilled: d 80 causal with dropout 16 bytes, d 96 causal 8.)
    ef = ordered and tiles.ENTRIES_FIRST and not ext
    pD, pDv = tiles.pad_head_dim(D), tiles.pad_head_dim(Dv)
    out_kv = A if acc_dkv else T
    out_q = A if acc_dq else T
    plan = {"preprocess": ("flash_bwd_preprocess.cu", "flash_bwd_preprocess_kernel<%s, %s, %d, %s>" % (
        T, A, tiles.ROW_THREADS, _b(atomic)), None)}
    if kernel == "tc":
        mode = "ordered" if ordered else "atomic" if atomic else "recompute"
        t_kv = tiles.tc_tiles("dkv", D, Dv, arch, _dkv_stages(stages, atomic, causal, ext, wide), ext=ext, mode=mode,
                              vec=vec, partial=acc_dkv)
        if t_kv.layout == "grid":  # dense or lengths, atomic or ordered (tiles_bwd.grid_tile)
            tail = (", %d, %s, true" % (ext, _b(t_kv.swizzle)) if ef        # kExt, kSwizzle, kEntriesFirst
                    else ", %d, true" % ext if t_kv.swizzle else ", %d" % ext if ext else "")
            plan["dkv"] = ("flash_bwd.cu", "flash_bwd_dkv_grid_kernel<%s, %s, %d, %d, %d, %d, %s, %s, %d, %s%s>" % (
                T, out_kv, pD, pDv, t_kv.block_m, t_kv.block_n, _b(causal), _b(vec), t_kv.stages, _b(ordered), tail),
                t_kv)
        else:
            plan["dkv"] = ("flash_bwd.cu", "flash_bwd_dkv_kernel<%s, %s, %d, %d, %d, %d, %d, %s, %s, %s, %d%s" % (
                T, out_kv, pD, pDv, t_kv.block_m, t_kv.block_n, t_kv.n_threads // 32, _b(causal),
                _b(atomic), _b(vec), t_kv.stages, x), t_kv)
        if not atomic:
            t_q = tiles.tc_tiles("dq", D, Dv, arch, stages)
            plan["dq"] = ("flash_bwd.cu", "flash_bwd_dq_kernel<%s, %s, %d, %d, %d, %d, %d, %s, %s, %d%s" % (
                T, out_q, pD, pDv, t_q.block_m, t_q.block_n, t_q.n_threads // 32, _b(causal), _b(vec),
                t_q.stages, x), t_q)
    elif kernel in FAMILIES:
        module = _family_module(kernel)
        # (the tf32 tile takes the bits, the rows' alignment and the mode: EXT_SPILLED_SMALL_D)
        options = (dict(ext=ext, vec=vec, device=device, causal=causal, ordered=ordered) if kernel == "tf32"
                   else dict(ext=bool(ext)))
        t_kv = module.backward_tile(precision, dtype, D, Dv, arch, **options)
        if t_kv is None or not atomic:
            raise ValueError("flasharray: the %s backward kernel does not apply to %s, D=%d, Dv=%d, precision=%r%s"
                             % (kernel, dtype, D, Dv, precision, "" if atomic else " in the recompute dQ mode"))
        if tma and kernel == "wgmma":  # the warp-specialized TMA kernel (both atomic dQ modes)
            plan["dkv"] = (module.SOURCE, module.ws_name(t_kv, pD, pDv, causal, T, out_kv, ordered, ext),
                           module.ws_tile(t_kv, D, Dv, ext))
        else:
            name = module.dkv_name(t_kv, precision, pD, pDv, causal, vec, ordered, **({"ext": ext} if ext else {}),
                                   **({"dtype": T, "out": out_kv} if kernel == "wgmma" else {}))
            plan["dkv"] = (getattr(t_kv, "source", module.SOURCE), name, t_kv)  # (tf32: the wgmma or mma.sync file)
    else:
        t_kv = tiles.simt_tiles("dkv", dtype, D, Dv, arch, ext)
        x_kv = (", %d, %s, %d>" % (ext, _b(ordered), t_kv.blocks_per_sm) if t_kv.blocks_per_sm > 1  # kBlocksPerSm
                else x)
        plan["dkv"] = ("flash_bwd_simt.cu", "flash_bwd_dkv_simt_kernel<%s, %s, %s, %d, %d, %d, %d, %d, %s, %s%s" % (
            T, A, out_kv, pD, pDv, t_kv.block_m, t_kv.block_n, t_kv.n_threads, _b(causal),
            _b(atomic), x_kv), t_kv)
        if not atomic:
            t_q = tiles.simt_tiles("dq", dtype, D, Dv, arch)
            plan["dq"] = ("flash_bwd_simt.cu", "flash_bwd_dq_simt_kernel<%s, %s, %s, %d, %d, %d, %d, %d, %s%s" % (
                T, A, out_q, pD, pDv, t_q.block_m, t_q.block_n, t_q.n_threads, _b(causal), x), t_q)
    if atomic and kernel in TC_FAMILIES:
        # The padded, fragment-ordered accumulator (DQAccumLayout, AccT) -> dQ (or AccT partial sums
        # when q is broadcast); 16-byte stores when D % 8 == 0 (dq is ours: contiguous, aligned).
        # (the wgmma kernels' accumulator has rows inner, DQAccumWg: kRowsInner)
        acc_arg = ", double" if A == "double" else ", float, true" if kernel == "wgmma" else ""
        plan["convert"] = ("flash_bwd_convert.cu", "flash_bwd_convert_dq_tc_kernel<%s, %d, %d, %d, %s%s>" % (
            out_q, tiles.ROW_THREADS, t_kv.block_m, pD, _b(D % 8 == 0), acc_arg), None)
    elif atomic and (not acc_dq or ordered):
        # (ordered: the accumulator holds the counters after its Lq rows, so a broadcast q's dQ is
        # converted to its own AccT buffer before the sums over broadcast dims)
        plan["convert"] = ("flash_bwd_convert.cu", "flash_bwd_convert_dq_kernel<%s, %s, %d, %d>" % (
            out_q, A, tiles.ROW_THREADS, tiles.ROWS_PER_BLOCK), None)
    return plan


def dq_accum_rows(Lq, kernel, t_kv, D=None, ordered=False):
    """Rows of the atomic modes' dQ accumulator per batch entry: Lq (SIMT, row-major) or Lq rounded
    up to the dK/dV kernel's query block (tensor cores: DQAccumLayout, no bounds tests); ordered
    mode: plus ``ceil(Tr / D)`` rows of ``D`` elements (the padded head dim on tensor cores, the head
    dim on SIMT) holding the Tr int32 counters (``DQOrderCounters``; SIMT: after row Lq)."""
    Tr = -(-Lq // t_kv.block_m)
    counters = -(-Tr // D) if ordered else 0
    return (Tr * t_kv.block_m if kernel in TC_FAMILIES else Lq) + counters


DQ_MODES = ("ordered", "recompute")


def dq_mode(deterministic, kernel, ext, requested=None, head_dim=0):
    """How dQ is made: "atomic" (``deterministic=False``); deterministic: "ordered" (the atomic
    mode's kernels adding in key-block order: 5 products per block pair, the default where it
    applies: the tensor-core families and the SIMT kernel, with no extension or those
    :func:`_family_orders` takes) or "recompute" (the separate dQ kernel: 7 products; fp16/bf16
    tensor cores and SIMT).
    ``requested``: force "ordered" or "recompute" (the ``dq`` option); ``head_dim``: the larger
    padded head dim (:func:`_family_orders`)."""
    if requested is not None and requested not in DQ_MODES:
        raise ValueError("flasharray: option 'dq' must be one of %s, got %r" % (", ".join(map(repr, DQ_MODES)), requested))
    if not deterministic:
        if requested is not None:
            raise ValueError("flasharray: option 'dq'=%r needs deterministic=True" % (requested,))
        return "atomic"
    can_order = kernel in ORDERED_KERNELS and (ext is None or _family_orders(kernel, ext.bits, head_dim))
    if requested == "ordered" and not can_order:
        names = [] if ext is None else [n for n, b in _fwd().EXT_BITS.items() if ext.bits & b]
        raise ValueError("flasharray: option dq='ordered' takes no ALiBi above head dim 128 on the fp16/bf16 "
                         "mma.sync kernel (this call: kernel %r, head dim %d, extensions %s)"
                         % (kernel, head_dim, ", ".join(names) or "none"))
    return requested or ("ordered" if can_order else "recompute")


_OPTIONS = {"schedule", "seed", "arch", "kernel", "stages", "dq", "precision", "return_counters"}
_INPUTS = ("dout", "q", "k", "v", "out", "lse")


#: kExt bits of ALiBi and of the per-entry lengths (``cuda_forward.EXT_BITS``).
ALIBI_BIT, LENGTHS_BIT = 2, 32


def _dkv_stages(stages, atomic, causal, ext, wide):
    """Buffers of the "tc" dK/dV kernel's streamed Q_i / dO_i tiles: ``stages`` if forced, else the
    tile table's choice — except one buffer for the causal kernels with ALiBi above padded head dim
    128 (``wide``) that spilled double-buffered (sm_90, the only arch whose shared memory fits two
    buffers at d 256): the atomic one (80-192 bytes) and, with lengths, the recomputing mode's
    (60-176 bytes). Single-buffered neither spills (docs/performance.md, "Spill audit of the
    extension subsets"); the other subsets keep two buffers."""
    if (stages is None and causal and ext & ALIBI_BIT and wide > 128
            and (atomic or ext & LENGTHS_BIT)):
        return 1
    return stages


#: kExt bits the fp16 / bf16 tensor-core kernel ("tc") takes in the ordered dQ mode: every one. Query block i's
#: visitors are one contiguous run of key blocks whose first one the kernel knows (0, or with a window the window's
#: left edge: ``DQOrder::turn(i, Br, Bc, mask)``, cuda_src/flash_bwd_common.cuh); a block mask's holes (tiles whose
#: blocks are all False, never visited) take no turn: ``dq_turn`` (cuda_src/flash_bwd_ext.cuh) then counts ranks,
#: each block waiting for its previous visitor found past the holes (since the forty-third session; before, a
#: block mask ran the recomputing dQ kernel: 7 products instead of 5). Above padded head dim 128
#: without ALiBi (:data:`TC_ORDERED_EXT_WIDE`): its ordered d 256 instantiations spill 36-88 bytes at the
#: register cap on sm_75 / sm_86 / sm_90 (causal; its atomic and dQ-kernel ones do not).
TC_ORDERED_EXT = 1 | 2 | 4 | 8 | 16 | 32
TC_ORDERED_EXT_WIDE = TC_ORDERED_EXT & ~2
#: kExt bits the SIMT kernel takes in the ordered dQ mode: the same set (its key blocks walk the query blocks by
#: the same ``QueryTileWalk`` and take their turns by the same ``dq_turn``).
SIMT_ORDERED_EXT = TC_ORDERED_EXT
#: Whether the ordered dQ mode takes a block mask (``dq_turn``'s ranks, since the forty-third session). False: as
#: before, deterministic calls with one run the recomputing dQ kernel (7 products; kernel "tc" or "simt", and on sm_90
#: ``kernel=None`` keeps the mma.sync backward) — ``benchmarks/hopper_variants.py``'s ``bwd.ORDERED_BLOCK_MASK``
#: times both on a GPU (not yet run). Plans are cached: flip it before planning, or clear them (launch._clear_plans).
ORDERED_BLOCK_MASK = True
BLOCK_MASK_BIT = 8
#: Kernels with an ordered dQ mode (the atomic mode's dK/dV kernel adding dQ in key-block order).
ORDERED_KERNELS = TC_FAMILIES + ("simt",)


def _family_orders(kernel, bits, head_dim=0):
    """Whether a tensor-core family runs the ordered dQ mode with the kExt ``bits``
    (:data:`TC_ORDERED_EXT` for "tc", :data:`TC_ORDERED_EXT_WIDE` above padded ``head_dim`` 128 —
    the larger of D and Dv —; a float32 / float64 family's module's ``ORDERED_EXT``, none without
    one); none with a block mask where :data:`ORDERED_BLOCK_MASK` is off."""
    if bits & BLOCK_MASK_BIT and not ORDERED_BLOCK_MASK:
        return False
    if kernel == "tc":
        return not bits & ~(TC_ORDERED_EXT if head_dim <= 128 else TC_ORDERED_EXT_WIDE)
    if kernel == "simt":
        return not bits & ~SIMT_ORDERED_EXT
    return kernel in FAMILIES and not bits & ~getattr(_family_module(kernel), "ORDERED_EXT", 0)


def auto_wgmma(dtype, arch, precision=None, D=0, Dv=0, ext=False, dq=None, device=None, deterministic=False):
    """Whether ``kernel=None`` takes the wgmma backward: on sm_90 where ``cuda_forward_sm90.auto_dispatch``
    allows it (its ``AUTO_DISPATCH``; on CUDA, NVRTC compiling sm_90a) and ``cuda_backward_sm90.backward_tile``
    serves the call (float16 / bfloat16, head dims 1..256), with ``dq`` not "recompute" and no extensions but
    where ``cuda_backward_sm90.auto_ext`` allows them (its ``AUTO_EXT``, on; the others keep "tc").
    Deterministic calls run its ordered dQ mode."""
    sm90 = _family_module("wgmma")
    if dq == "recompute" or not _fwd().sm90.auto_dispatch(arch, device):
        return False
    if ext and not sm90.auto_ext(int(ext), D, Dv, deterministic):
        return False
    if ext and deterministic and not _family_orders("wgmma", int(ext)):
        return False
    try:
        sm90.backward_tile(precision, dtype, D, Dv, arch)
    except NotImplementedError:
        return False
    return True


def _kernel_choice(dtype, arch, kernel, precision=None, D=0, Dv=0, ext=False, dq=None, deterministic=False,
                   device=None):
    """The kernel family of a plan: ``kernel`` when forced, else a float32 / float64 tensor-core
    family where it applies (:func:`family_tile`; not with ``dq="recompute"``, which those
    families do not run, nor deterministic with extensions its ordered mode does not take), else
    "wgmma" on sm_90 where :func:`auto_wgmma` says so (``device``: the launcher's), else
    :func:`default_kernel`."""
    if kernel is None and dq != "recompute":
        fam = family_tile(dtype, precision, D, Dv, arch, ext, device)
        if fam is not None and (not (ext and deterministic) or _family_orders(fam[0], ext)):
            return fam[0]
        if auto_wgmma(dtype, arch, precision, D, Dv, ext, dq, device, deterministic):
            return "wgmma"
    if kernel == "wgmma":  # the Hopper backward: NotImplementedError naming why where it cannot run
        if dq == "recompute":
            raise NotImplementedError("flasharray: kernel='wgmma' (the Hopper backward) runs the atomic and "
                                      "ordered dQ modes only, not dq='recompute'")
        _family_module(kernel).backward_tile(precision, dtype, D, Dv, arch, ext=ext)
    kernel = kernel or default_kernel(dtype, arch)
    if kernel == "tc" and dtype.itemsize != 2:
        raise NotImplementedError("flasharray: the tensor-core backward supports float16 and bfloat16, "
                                  "got %s (the SIMT kernel covers float32/float64)" % dtype)
    if kernel == "tc" and dtype == bfloat16 and arch < 80:
        raise NotImplementedError("flasharray: bfloat16 needs tensor cores of sm_80 or newer, got sm_%d" % arch)
    if kernel == "tc" and arch < 75:
        raise NotImplementedError("flasharray: float16 tensor-core kernels need sm_75 or newer, got sm_%d" % arch)
    return kernel


class BackwardPlan:
    """The launches of one backward signature, prepared once (see ``cuda_forward.ForwardPlan``).

    Planning chooses kernels and tiles, the buffers (delta, the dQ accumulator, dQ/dK/dV or their
    AccT partial sums), the batch split into launches and every scalar argument; :meth:`run`
    copies the inputs planned as copied, allocates the buffers, binds pointers, launches, and
    reduces the broadcast dims.
    """

    def __init__(self, dout, q, k, v, out, lse, *, causal, scale, batch_shape, launcher, deterministic,
                 arch=None, kernel=None, stages=None, ext=None, dq=None, precision=None):
        self.launcher, self.xp = launcher, launcher.xp()
        self.dtype = dtype = canonical_dtype(q.dtype)
        self.acc = acc = accumulation_dtype(dtype)
        arch = tiles.arch_number(arch) if arch is not None else launcher.arch
        self.causal = causal
        self.precision = precision
        self.kernel = _kernel_choice(dtype, arch, kernel, precision, q.shape[-1], v.shape[-1],
                                     _fwd().ext_bits(ext), dq, deterministic, launcher.device)
        self.auto = kernel is None   # the family chosen, not forced
        self.batch_shape = tuple(int(b) for b in batch_shape)
        # Extensions (docs/extensions.md): the forward's _ExtPlan (kExt bits, stand-ins walked with
        # the batch, the argument tail, per-call arrays and seed/offset); None for a dense plan.
        self.ext = None
        if _fwd().ext_bits(ext):
            self.ext = _fwd()._ExtPlan(ext, q, k, self.batch_shape, scale, launcher)
        # "ordered" runs the atomic mode's passes with kOrderedDQ kernels.
        self.dq_mode = dq_mode(deterministic, self.kernel, self.ext, dq,
                               tiles.pad_head_dim(max(q.shape[-1], v.shape[-1])))
        self.ordered = self.dq_mode == "ordered"
        deterministic = self.dq_mode == "recompute"
        self.shapes = {n: tuple(a.shape) for n, a in zip(_INPUTS, (dout, q, k, v, out, lse))}
        # inputs: copied per call when the last axis is not contiguous (lse also cast to AccT)
        self.copy = {n: launch.kernel_ready(a) is not a for n, a in zip(_INPUTS[:5], (dout, q, k, v, out))}
        self.copy["lse"] = lse.dtype != acc or launch.kernel_ready(lse) is not lse
        ready = {n: (launch.stand_in(a.shape, acc if n == "lse" else a.dtype) if self.copy[n] else a)
                 for n, a in zip(_INPUTS, (dout, q, k, v, out, lse))}
        self.buffers = self._buffers(ready, deterministic, arch, stages)
        arrays = dict(ready, **{n: launch.stand_in(shape, dt) for n, (shape, dt) in self.buffers.items()})
        # Deterministic mode: the kernels take a dQ accumulator they never touch; one plan-owned
        # element stands for it (bound once, here).
        self._unused = self.xp.empty(1, dtype=acc)
        unused = launcher.pointer(launcher.handle(self._unused))
        runner = _Runner(launcher)
        self._record(runner, arrays, unused, causal=causal, scale=scale, deterministic=deterministic, arch=arch,
                     stages=stages)
        self.launches = runner.launches
        self._prepare_call((dout, q, k, v, out, lse))

    def _prepare_call(self, inputs):
        """What :meth:`run` does per call, decided once: the inputs to copy, the allocations, the
        order of the arrays' handles, and the reductions of broadcast dims.

        Two allocations at most, each of one dtype and cut into 256-byte aligned parts
        (``launcher.carve``): the gradients returned as they are (views of one allocation), and
        the AccT scratch freed when the call returns (delta, the atomic mode's dQ accumulator,
        the partial sums reduced over broadcast dims).
        """
        acc = self.acc
        self.copies = tuple((i, acc if n == "lse" else a.dtype) for i, (n, a) in enumerate(zip(_INPUTS, inputs))
                            if self.copy[n])
        returned = (self.dq_name, "dk", "dv")
        used = {a.key for rec in self.launches for a in rec.template if isinstance(a, launch.Ptr)}
        reductions = {}
        for name, src in zip(returned, ("q", "k", "v")):
            shape, dt = self.buffers[name]
            if shape != self.shapes[src] or dt != self.dtype:
                reductions[name] = (tuple(i for i in range(len(shape) - 2)
                                          if self.shapes[src][i] == 1 and shape[i] != 1), self.shapes[src])
        kept = [n for n in returned if n not in reductions]
        scratch = [n for n in self.buffers if n not in kept and (n in used or n in returned)]
        self.allocations = tuple(_carving(self.buffers, group, returned) for group in (kept, scratch) if group)
        order = kept + scratch
        slots = () if self.ext is None else tuple(sorted(_fwd().EXT_SLOTS.values()))
        self.replay = launch.Replay(self.launcher, self.launches, _INPUTS + tuple(order) + slots)
        self.grads = operator.itemgetter(*[order.index(n) for n in returned])  # -> (dq, dk, dv)
        self.reductions = tuple(reductions.get(n) for n in returned)
        self.reduce = bool(reductions)

    def _buffers(self, t, deterministic, arch, stages):
        """{name: (shape, dtype)} of the buffers each call allocates."""
        full, acc, dtype = self.batch_shape, self.acc, self.dtype
        nb = len(full)
        Lq, D, Lk, Dv = t["q"].shape[-2], t["q"].shape[-1], t["v"].shape[-2], t["v"].shape[-1]
        bufs = {"delta": (full + (Lq,), acc)}
        if deterministic:
            bufs["dqacc"] = ((1,), acc)
        elif self.kernel in TC_FAMILIES:  # padded rows and head dim (DQAccumLayout)
            vec = _vec_rows(t, nb, dtype)
            if self.kernel == "tc":
                # (with extensions dK, dV are float partial sums where K or V is broadcast: self.partial, below)
                partial = self.ext is not None and any(t["k"].shape[i] == 1 or t["v"].shape[i] == 1
                                                       for i in range(nb) if full[i] > 1)
                t_kv = tiles.tc_tiles("dkv", D, Dv, arch, stages, ext=0 if self.ext is None else self.ext.bits,
                                      mode=self.dq_mode, vec=vec, partial=partial)
            elif self.kernel == "wgmma":
                t_kv = _family_module(self.kernel).backward_tile(self.precision, self.dtype, D, Dv, arch)
            elif self.kernel == "tf32":  # kernel_plan's tile: the rows' alignment picks it (wgmma: Br 64, else 32)
                t_kv = _family_module(self.kernel).backward_tile(self.precision, self.dtype, D, Dv, arch,
                                                                 ext=0 if self.ext is None else self.ext.bits, vec=vec,
                                                                 causal=self.causal, ordered=self.ordered,
                                                                 device=self.launcher.device)
            else:
                t_kv = family_tile(self.dtype, self.precision, D, Dv, arch, self.ext is not None)[1]
            pD = tiles.pad_head_dim(D)
            bufs["dqacc"] = (full + (dq_accum_rows(Lq, self.kernel, t_kv, pD, self.ordered), pD), acc)
        else:  # SIMT: row-major (ordered: + the counters' rows)
            t_kv = tiles.simt_tiles("dkv", self.dtype, D, Dv, arch, 0 if self.ext is None else self.ext.bits)
            bufs["dqacc"] = (full + (dq_accum_rows(Lq, self.kernel, t_kv, D, self.ordered), D), acc)
        dims = [i for i in range(nb) if full[i] > 1]
        self.q_bcast = any(t["q"].shape[i] == 1 for i in dims)
        # q broadcast along a batch dim: dQ goes to an AccT buffer of the full batch, summed afterwards.
        bufs["dq"] = (full + (Lq, D), acc) if self.q_bcast else (t["q"].shape, dtype)
        qside = dict(t, **{n: launch.stand_in(*bufs[n]) for n in ("delta", "dqacc")})
        self.group, self.grid_b = _group_dims(qside, full, dims)
        if self.ext is not None:
            # Extensions are per query batch entry (slopes, block mask, dropout's bh): no group walked
            # inside the dK/dV block; broadcast K/V get AccT partial sums reduced afterwards.
            self.group, self.grid_b = ({n: 0 for n in ("q", "dout", "lse", "delta", "dqacc")}, 1), dims
        self.partial = any(t["k"].shape[i] == 1 or t["v"].shape[i] == 1 for i in self.grid_b)
        if self.partial:
            kshape = tuple(full[i] if i in self.grid_b else 1 for i in range(nb))
            bufs["dk"], bufs["dv"] = (kshape + (Lk, D), acc), (kshape + (Lk, Dv), acc)
        else:
            bufs["dk"], bufs["dv"] = (t["k"].shape, dtype), (t["v"].shape, dtype)
        return bufs

    def _record(self, runner, t, unused, *, causal, scale, deterministic, arch, stages):
        """Plan the batch splits and record the three passes' launches."""
        self.dq_name = ("dqacc" if not deterministic and self.q_bcast and self.kernel not in TC_FAMILIES
                        and not self.ordered else "dq")
        self.tma = False  # the warp-specialized TMA dK/dV kernel (kernel "wgmma", set below)
        full, nb = self.batch_shape, len(self.batch_shape)
        if 0 in full:
            return  # no batch entry: nothing to launch (empty gradients)
        q, k, v, dout = t["q"], t["k"], t["v"], t["dout"]
        D, Dv = q.shape[-1], v.shape[-1]
        dims = [i for i in range(nb) if full[i] > 1]
        t, ext_names = self._ext_stand_ins(t)
        names_a = ["q", "k", "v", "dout", "out", "lse", "delta", "dq"] + ([] if deterministic else ["dqacc"]) + ext_names
        sizes_a, strides_a = _merge([full[i] for i in dims],
                                    {n: [_batch_strides(t[n], nb)[i] for i in dims] for n in names_a})
        qside = ("q", "dout", "lse", "delta", "dqacc")
        names_b = qside + ("k", "v", "dk", "dv") + tuple(ext_names)
        sizes_b, strides_b = _merge([full[i] for i in self.grid_b],
                                    {n: [_batch_strides(t[n], nb)[i] if t[n].ndim > 1 else 0 for i in self.grid_b]
                                     for n in names_b})
        vec = self.kernel in TC_FAMILIES and _vec_rows(t, nb, self.dtype)
        plans_b = _launch_plans(sizes_b, strides_b)
        # kernel "wgmma", atomic dQ (plain or ordered): the warp-specialized TMA kernel where every launch's
        # q, dout, k, v fit tensor maps (cuda_backward_sm90.tma_args), else the cp.async kernel.
        tma = False
        if self.kernel == "wgmma" and vec and (self.ordered or not deterministic):
            sm90 = _family_module("wgmma")
            tile = sm90.backward_tile(self.precision, self.dtype, D, Dv, arch)
            bits = 0 if self.ext is None else self.ext.bits
            tma = (sm90.USE_TMA and sm90.ext_refusal(bits, D, Dv, True, causal, self.ordered) is None
                   and all(sm90.tma_args(t, part, self.group, tile, self.dtype) is not None for part in plans_b))
        self.tma = tma
        if self.kernel == "wgmma" and self.ext is not None:  # extension sets a kernel spills with: refused
            sm90 = _family_module("wgmma")
            why = sm90.ext_refusal(self.ext.bits, D, Dv, tma, causal, self.ordered)
            ws_why = None if tma else sm90.ext_refusal(self.ext.bits, D, Dv, True, causal, self.ordered)
            if why and ws_why and ws_why != why and sm90.USE_TMA:
                why += "; its warp-specialized TMA kernel " + ws_why
            if why:  # (chosen by kernel=None: plan() makes the mma.sync backward's plan instead)
                raise (_AutoRefused if self.auto else NotImplementedError)(
                    "flasharray: kernel='wgmma' (the Hopper backward) " + why)
        ks = kernel_plan(self.dtype, D, Dv, causal=causal, deterministic=deterministic, arch=arch,
                         kernel=self.kernel, acc_dkv=self.partial, acc_dq=self.q_bcast, vec=vec, stages=stages,
                         ext=0 if self.ext is None else self.ext.bits, ordered=self.ordered, precision=self.precision,
                         tma=tma, device=self.launcher.device)
        ctx = _Passes(runner, t, ks, launch.c_scalar(scale, self.acc), deterministic, self.kernel, self.q_bcast,
                      unused)
        ctx.tail = self._ext_tail(ext_names)
        plans_a = _launch_plans(sizes_a, strides_a)
        ctx.preprocess(plans_a)
        ctx.dkv(plans_b, self.group)
        ctx.dq(plans_a)

    def _ext_stand_ins(self, t):
        """``t`` with the extensions' stand-ins walked with the batch (the entry index of seqlens,
        then cuda_forward._ExtPlan's: ALiBi slopes, block mask, dropout's flat batch index), and
        their names."""
        if self.ext is None:
            return t, []
        nb = len(self.batch_shape)
        names = ["ext_entry"] + ["ext_%d" % i for i in range(len(self.ext.stand_ins))]
        entry = (launch.stand_in((self.batch_shape[0],) + (1,) * (nb - 1), np.int32, (4,) + (0,) * (nb - 1))
                 if nb else launch.stand_in((), np.int32))
        return dict(t, **dict(zip(names, [entry] + list(self.ext.stand_ins)))), names

    def _ext_tail(self, ext_names):
        """``tail(offsets, strides3)``: the FLASH_EXT_PARAMS(AccT) arguments of one dK/dV or dQ launch
        (tensor cores: float; SIMT: the dtype's AccT): zeros and never-read arrays for a dense plan."""
        if self.ext is None:
            dense = _fwd()._dense_ext_args(self, self.launcher)
            return lambda off, st: dense
        ext = self.ext

        def tail(off, st):
            parts = [(off.get(n, 0), st[n]) for n in ext_names[1:]]
            return ext.args(off.get("ext_entry", 0), st["ext_entry"], parts)
        return tail

    def run(self, dout, q, k, v, out, lse, counters=None, ext=None):
        """``(dq, dk, dv)`` for arrays of the planned signature (``counters``: the emulator's
        ``(kernel name, counters)`` per launch are appended; ``ext``: the call's
        :class:`~flasharray._private.extensions.Extensions`, required by a plan made with them:
        its seed, offset and arrays are taken here)."""
        if ext is not None or self.ext is not None:
            return self._run_ext(dout, q, k, v, out, lse, counters, ext)
        launcher = self.launcher
        if self.copies:
            dout, q, k, v, out, lse = self._copy_inputs([dout, q, k, v, out, lse])
        handle = launcher.handle
        arrays, handles = launcher.carve(self.allocations)
        self.replay([handle(dout), handle(q), handle(k), handle(v), handle(out), handle(lse)] + handles, counters)
        if self.reduce:
            return tuple(g if r is None else _reduce(g, *r, self.dtype)
                         for g, r in zip(self.grads(arrays), self.reductions))
        return self.grads(arrays)

    def _run_ext(self, dout, q, k, v, out, lse, counters, ext):
        """:meth:`run` of a plan with extensions: the call's arrays (slots 9-12 of
        cuda_forward.EXT_SLOTS) and dropout's seed and offset bound."""
        if not _fwd().ext_bits(ext):
            ext = None
        if self.ext is None or ext is None or ext.static_key() != self.ext.key:
            raise ValueError("flasharray: this backward plan was made for other extensions (%r), got %r"
                             % (self.ext and self.ext.features, ext))
        launcher = self.launcher
        if self.copies:
            dout, q, k, v, out, lse = self._copy_inputs([dout, q, k, v, out, lse])
        handle = launcher.handle
        arrays, handles = launcher.carve(self.allocations)
        extra = [handle(a) if a is not None else None for a in self.ext.arrays(ext)]
        self.replay([handle(dout), handle(q), handle(k), handle(v), handle(out), handle(lse)] + handles + extra,
                    counters, self.ext.values(ext))
        if self.reduce:
            return tuple(g if r is None else _reduce(g, *r, self.dtype)
                         for g, r in zip(self.grads(arrays), self.reductions))
        return self.grads(arrays)

    def _copy_inputs(self, arrays):
        """The inputs planned as copied (last axis not contiguous; lse not AccT), copied."""
        for i, dt in self.copies:
            a = arrays[i]
            arrays[i] = c = launch.empty(self.xp, a.shape, dt)
            c[...] = a
        return arrays


def _carving(buffers, names, returned):
    """``(dtype, nbytes, parts)`` for ``launcher.carve``: the buffers ``names`` (of one dtype) one
    after the other, each at a 256-byte boundary (as separate CuPy allocations would be); arrays
    for those in ``returned``."""
    dtypes = {np.dtype(buffers[n][1]) for n in names}
    assert len(dtypes) == 1, "one dtype per allocation"
    dt = dtypes.pop()
    parts, nbytes = [], 0
    for n in names:
        shape = tuple(buffers[n][0])
        parts.append((nbytes, shape, n in returned))
        nbytes += -(-math.prod(shape) * dt.itemsize // 256) * 256
    return dt, nbytes, tuple(parts)


def _rs(a):
    """Row stride in elements."""
    return a.strides[-2] // a.itemsize if a.shape[-2] > 1 else a.shape[-1]


def _group_dims(t, full, dims):
    """The dK/dV kernel's group (dims where K and V are both broadcast, walked inside the block)
    and the grid dims: ``({name: group stride}, n_group), grid dims``.

    The group is the longest run of trailing shared dims that merges into one dim for every
    query-side tensor; shared dims before it are walked by the grid instead (their dK/dV
    partial sums are reduced afterwards).
    """
    nb = len(full)
    shared = [i for i in dims if t["k"].shape[i] == 1 and t["v"].shape[i] == 1]
    qside = ("q", "dout", "lse", "delta", "dqacc")
    qside_strides = {n: _batch_strides(t[n], nb) if t[n].ndim > 1 else [0] * nb for n in qside}
    for start in range(len(shared) + 1):
        run = shared[start:]
        g_sizes, g_strides = _merge([full[i] for i in run], {n: [s[i] for i in run] for n, s in qside_strides.items()})
        if len(g_sizes) <= 1:
            shared = run
            break
    group = ({n: (st[0] if st else 0) for n, st in g_strides.items()}, g_sizes[0] if g_sizes else 1)
    return group, [i for i in dims if i not in shared]


class _Passes:
    """Records the launches of the three backward passes for each batch split of a plan."""

    def __init__(self, runner, t, ks, scale_arg, deterministic, kernel, q_bcast, unused):
        self.runner, self.t, self.ks, self.scale_arg, self.unused = runner, t, ks, scale_arg, unused
        self.deterministic, self.kernel, self.q_bcast = deterministic, kernel, q_bcast
        self.Lq, self.D = t["q"].shape[-2], t["q"].shape[-1]
        self.Lk, self.Dv = t["v"].shape[-2], t["v"].shape[-1]

    def _st(self, plan_strides, name, group=None, row=True):
        s = [np.int64(x) for x in plan_strides[name]]
        if group is not None:
            s.append(np.int64(group))
        if row:
            s.append(np.int64(_rs(self.t[name])))
        return s

    def _arg(self, name, off, plan_strides, **kw):
        """The pointer slot of ``name`` followed by its stride arguments."""
        return [launch.Ptr(name, off.get(name, 0)), *self._st(plan_strides, name, **kw)]

    def preprocess(self, plans_a):
        """1. D_i = rowsum(dO_i ∘ O_i) (and clear the dQ accumulator in the atomic mode)."""
        src, name, _ = self.ks["preprocess"]
        dqacc = self.t["dqacc"]
        for (nb0, nb1, nb2), sa, off in plans_a:
            # the accumulator is cleared as n_accum contiguous elements per batch entry
            dqa = (self._arg("dqacc", off, sa, row=False) + [np.int64(dqacc.shape[-2] * dqacc.shape[-1])]
                   if not self.deterministic else [self.unused, *[np.int64(0)] * 4])
            self.runner.launch(src, name, (-(-self.Lq // tiles.ROWS_PER_BLOCK), nb1 * nb2, nb0), tiles.ROW_THREADS,
                               [*self._arg("dout", off, sa), *self._arg("out", off, sa),
                                *self._arg("delta", off, sa, row=False), *dqa,
                                np.int32(self.Lq), np.int32(self.Dv), np.int32(nb2)])

    def dkv(self, plans_b, group):
        """2. dK, dV (+ atomic dQ): one block per key block and K/V batch entry."""
        gs, n_group = group
        src, name, t_kv = self.ks["dkv"]
        i32 = np.int32
        for (mb0, mb1, mb2), sb, off in plans_b:
            dqa = (self._arg("dqacc", off, sb, group=gs["dqacc"]) if not self.deterministic
                   else [self.unused, *[np.int64(0)] * 5])
            self.runner.launch(
                src, name, (-(-self.Lk // t_kv.block_n), mb1 * mb2, mb0), t_kv.n_threads,
                [*self._arg("q", off, sb, group=gs["q"]), *self._arg("k", off, sb), *self._arg("v", off, sb),
                 *self._arg("dout", off, sb, group=gs["dout"]),
                 *self._arg("lse", off, sb, group=gs["lse"], row=False),
                 *self._arg("delta", off, sb, group=gs["delta"], row=False), *dqa,
                 *self._arg("dk", off, sb), *self._arg("dv", off, sb),
                 i32(self.Lq), i32(self.Lk), i32(self.D), i32(self.Dv), i32(mb2), i32(n_group), self.scale_arg,
                 *self.tail(off, sb), *self._tma_tail(name, ((mb0, mb1, mb2), sb, off), group, t_kv)],
                t_kv.smem)

    def _tma_tail(self, name, part, group, t_kv):
        """The warp-specialized wgmma kernel's tma_sel and tensor maps (``launch.Map``); nothing for the others."""
        if self.kernel != "wgmma" or not name.startswith(_family_module("wgmma").WS_KERNEL):
            return []
        return _family_module("wgmma").tma_args(self.t, part, group, t_kv, self.t["q"].dtype)

    def dq(self, plans_a):
        """3. dQ: the deterministic kernel, or the conversion of the atomic accumulator."""
        i32 = np.int32
        for (nb0, nb1, nb2), sa, off in plans_a:
            if self.deterministic:
                src, name, t_q = self.ks["dq"]
                self.runner.launch(
                    src, name, (-(-self.Lq // t_q.block_m), nb1 * nb2, nb0), t_q.n_threads,
                    [*self._arg("q", off, sa), *self._arg("k", off, sa), *self._arg("v", off, sa),
                     *self._arg("dout", off, sa), *self._arg("lse", off, sa, row=False),
                     *self._arg("delta", off, sa, row=False), *self._arg("dq", off, sa),
                     i32(self.Lq), i32(self.Lk), i32(self.D), i32(self.Dv), i32(nb2), self.scale_arg,
                     *self.tail(off, sa)],
                    t_q.smem)
            elif self.kernel in TC_FAMILIES:  # DQAccumLayout -> dQ (AccT when q is broadcast), times scale
                src, name, _ = self.ks["convert"]
                t_kv = self.ks["dkv"][2]
                self.runner.launch(src, name, (-(-self.Lq // t_kv.block_m), nb1 * nb2, nb0), tiles.ROW_THREADS,
                                   [*self._arg("dqacc", off, sa, row=False), *self._arg("dq", off, sa),
                                    i32(self.Lq), i32(self.D), i32(nb2), self.scale_arg])
            elif "convert" in self.ks:  # SIMT: dQ not summed over broadcast dims from the accumulator itself
                src, name, _ = self.ks["convert"]
                self.runner.launch(src, name, (-(-self.Lq // tiles.ROWS_PER_BLOCK), nb1 * nb2, nb0),
                                   tiles.ROW_THREADS,
                                   [*self._arg("dqacc", off, sa), *self._arg("dq", off, sa),
                                    i32(self.Lq), i32(self.D), i32(nb2)])


_PLANS = {}
launch._on_reload.append(_PLANS.clear)


def plan(dout, q, k, v, out, lse, *, causal, scale, batch_shape, device, deterministic=True, arch=None,
         kernel=None, stages=None, schedule="forward", seed=0, ext=None, dq=None, precision=None):
    """The cached :class:`BackwardPlan` for this signature (made on first use). ``ext``: an
    :class:`~flasharray._private.extensions.Extensions` or None; the plan keys on its
    ``static_key()`` only (seed, offset and the arrays are taken by :meth:`BackwardPlan.run`)."""
    from .cuda_forward import cached, ext_bits, signature
    if not ext_bits(ext):
        ext = None
    launcher = launch.make_launcher(device, schedule=schedule, seed=seed, arch=arch)
    precision = effective_precision(precision, q.dtype,   # float32 None: FLOAT32_TC_DEFAULT
                                    tiles.arch_number(arch) if arch is not None else launcher.arch)
    key = signature((dout, q, k, v, out, lse),
                    (launcher.plan_key, bool(causal), float(scale), tuple(batch_shape), bool(deterministic),
                     arch, kernel, stages, dq, launch.MAX_GRID_YZ, None if ext is None else ext.static_key(),
                     precision))
    def make(kernel):
        return BackwardPlan(dout, q, k, v, out, lse, causal=causal, scale=scale, batch_shape=batch_shape,
                            launcher=launcher, deterministic=deterministic, arch=arch, kernel=kernel, stages=stages,
                            ext=ext, dq=dq, precision=precision)

    def make_or_fall_back():
        try:
            return make(kernel)
        except _AutoRefused:  # kernel=None took the wgmma backward, whose kernel for this layout refuses the extensions
            return make("tc")
    return cached(_PLANS, key, make_or_fall_back)


class _AutoRefused(NotImplementedError):
    """The wgmma backward chosen by ``kernel=None`` (``auto_wgmma``: its warp-specialized kernel takes the extension
    set) refusing a call whose layout takes its cp.async kernel: :func:`plan` plans the mma.sync backward instead."""


def backward(dout, q, k, v, out, lse, *, causal, scale, batch_shape, device, deterministic=True, ext=None,
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
        True: bitwise reproducible — tensor cores without extensions: float atomics added in
        key-block order (ordered); otherwise the separate dQ kernel (recompute). False: float
        atomics in any order into an AccT dQ accumulator plus a conversion pass.
    **opts
        ``schedule``, ``seed`` (emulator fiber schedule), ``arch`` (tile table's target,
        default the device's, ``sm_80`` for the emulator), ``kernel`` ("tc" (the mma.sync kernels), "simt", "wgmma" (sm_90 fp16/bf16),
        "tf32", "f64"; default tensor cores for fp16/bf16 — "wgmma" on sm_90 where :func:`auto_wgmma` says so,
        else "tc" —, and for float32 / float64 where :func:`family_tile` applies), ``precision`` (None, "ieee", "tf32", "3xtf32", validated by
        the caller: float32 "tf32" / "3xtf32" run the TF32 tensor-core backward, float64 the DMMA
        one on sm_80+; otherwise the SIMT kernels), ``stages`` (1 or 2: force single- or double-buffered
        streamed tiles in the tensor-core kernels), ``dq`` ("ordered" or "recompute": force the
        deterministic mode's dQ, :func:`dq_mode`), ``return_counters`` (emulator: also return the list of
        ``(kernel name, counters)`` of every launch).
    ext : Extensions or None
        The extension keywords of the call (docs/extensions.md), the forward's values; None: the
        dense kernels. Every feature on the tensor-core and the SIMT kernels.

    Returns
    -------
    dq, dk, dv : arrays with exactly the shapes and dtype of q, k, v (summed over broadcast
        batch dims); ``(dq, dk, dv, counters)`` with ``return_counters=True``.

    The launches are prepared once per signature (:func:`plan`) and replayed.
    """
    unknown = set(opts) - _OPTIONS
    if unknown:
        raise TypeError("flasharray.cuda_backward: unexpected option(s) %s" % sorted(unknown))
    if device not in ("cuda", "emulator"):
        raise ValueError("flasharray.cuda_backward: device must be 'cuda' or 'emulator', got %r" % (device,))
    return_counters = opts.pop("return_counters", False)
    p = plan(dout, q, k, v, out, lse, causal=causal, scale=scale, batch_shape=batch_shape, device=device,
             deterministic=deterministic, ext=ext, **opts)
    counters = [] if return_counters else None
    grads = p.run(dout, q, k, v, out, lse, counters, ext=ext)
    return grads + (counters,) if return_counters else grads


def _reduce(buf, axes, shape, dtype):
    """A gradient buffer summed over the broadcast dims ``axes`` of its input, as ``shape`` and ``dtype``."""
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
                          kernel=None, dq=None, precision=None):
    """(bytes read, bytes written) in global memory by one backward without broadcasting.

    What the kernels move: the preprocess reads dO and O once and writes D; the dK/dV kernel
    reads K_j, V_j once and, per visited (key block, query block) pair, Q_i, dO_i, L_i, D_i, and
    writes dK, dV once; the deterministic dQ kernel reads Q_i, dO_i, L_i, D_i once and K_j, V_j
    per visited pair, and writes dQ; the atomic modes instead clear the AccT dQ accumulator,
    read-modify-write it once per visited pair (atomics) and convert it once; the ordered mode
    also clears its counters and, per visited pair, reads one counter (the wait's last check) and
    increments it. ``dq``: the mode as :func:`dq_mode` chooses it (``dq`` forces one). The emulator's
    counters equal this exactly (tests/test_cuda_backward.py).
    """
    dtype = canonical_dtype(dtype)
    s, a = dtype.itemsize, accumulation_dtype(dtype).itemsize
    arch = tiles.EMULATOR_ARCH if arch is None else tiles.arch_number(arch)
    precision = effective_precision(precision, dtype, arch)
    kernel = _kernel_choice(dtype, arch, kernel, precision, D, Dv, False, dq)
    mode = dq_mode(deterministic, kernel, None, dq)
    deterministic = mode == "recompute"
    plan = kernel_plan(dtype, D, Dv, causal=causal, deterministic=deterministic, arch=arch, kernel=kernel,
                       ordered=mode == "ordered", precision=precision)
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
        write += dq_accum_rows(Lq, "tc", t_kv, pD, mode == "ordered") * pD * a  # clear (+ counters)
        read += q_blocks * Br * pD * a                             # atomics (read-modify-write)
        write += q_blocks * Br * pD * a
        if mode == "ordered":
            read += q_blocks * 8                                   # per pair: wait, post (int32)
            write += q_blocks * 4
        read += Lq * -(-D // 8) * 8 * a                            # convert
        write += Lq * D * s
    else:
        t_kv = plan["dkv"][2]
        write += dq_accum_rows(Lq, kernel, t_kv, D, mode == "ordered") * D * a  # clear (+ counters)
        read += q_rows * D * a                                   # atomics (read-modify-write)
        write += q_rows * D * a
        if mode == "ordered":
            q_blocks = visited_query_blocks(Lq, Lk, causal, t_kv)
            read += q_blocks * 8                                 # per pair: wait, post (int32)
            write += q_blocks * 4
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
