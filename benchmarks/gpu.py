"""GPU forward throughput: flasharray's CUDA kernels vs materialized attention, PyTorch and FlashAttention-2.

FLOPs counted as FlashAttention does: 4·B·H·Lq·Lk·D per forward (two matmuls), ×0.5 when causal.
Shapes follow FlashAttention-2's benchmark: batch·seqlen = 16k tokens, hidden 2048 (H = 2048/D),
N ∈ {512, 1k, 2k, 4k, 8k, 16k}, D ∈ {64, 128}, fp16 and bf16, causal and not.

Every row is validated against the float64 reference on a slice before it is timed. Timing
(benchmarks/gpu_timing.py): one untimed call first (JIT compilation, first allocations), a warm-up,
then CUDA events around each repetition and the median; inputs are cycled through several copies
when L2 could hold them. Peak memory is the growth of CuPy's pool plus PyTorch's peak allocation
during one call. Per row: the ratio to FlashAttention-2 (the ``flash_attn`` package when installed,
else PyTorch's flash backend) and to the fastest PyTorch backend, time_ref / time (>1: faster).

Implementations (``IMPLS``: name -> Impl(make, kind, flops factor, role)):
  flasharray     flasharray._private.cuda_forward.forward (this project's kernels)
  flasharray-mma  the same with kernel="tensor_core": the mma.sync forward (flash_fwd.cu; the default on
                 every GPU but sm_90, where the default is the wgmma one)
  flasharray-wgmma  the same with kernel="wgmma": the Hopper forward (flash_fwd_sm90.cu), sm_90 only
  cupy-naive     S = q kᵀ, softmax, P v with CuPy (S and P materialized); CuPy 14 computes batched
                 fp16 matmuls in fp32 and rejects batched bf16 ones, so torch-math is the fairer
                 materialized baseline
  torch-flash    PyTorch SDPA, flash backend (FlashAttention-2 kernels)   } if PyTorch with CUDA
  torch-cudnn    PyTorch SDPA, cuDNN backend                              } is installed; inputs
  torch-mem-eff  PyTorch SDPA, memory-efficient backend                   } reach PyTorch through
  torch-math     PyTorch SDPA, math backend (S and P materialized)        } DLPack, no copy
  flash-attn     flash_attn.flash_attn_func, if installed

Without a GPU the script says so and exits 0. ``--emulator`` runs one tiny shape through the
CUDA emulator instead (exercises this script and the kernels in CI; the time is CPU time).
``--backward`` continues with ``benchmarks/gpu_backward.py`` (backward and forward+backward
TFLOP/s, backward counted as 2.5× the forward FLOPs) with the same options.

``--decode`` times the inference shapes of ``../shared/gpu/README.md`` instead (fp16, D = 128:
decoding one token against long caches, GQA with 4 query heads per KV head, causal prefill)
against PyTorch's flash backend (FlashAttention-2; GQA through SDPA's ``enable_gqa``): per shape
the milliseconds of each, ``ratio`` = flasharray / FlashAttention-2 (issue 10's target: <= 1.1),
and flasharray's launch (key splits, GQA packing, blocks vs the SM count). Each row is validated
on the first batch entry, KV head and last 256 query rows. With ``--emulator``, scaled-down
shapes run through the emulator (CPU time; no PyTorch).
``--precision`` runs ``benchmarks/gpu_precision.py`` instead (issue 12: float32 per precision and
float64, forward, backward and both, against PyTorch's memory-efficient and math backends, then
the issue's goals from the measured rows).
Usage: python benchmarks/gpu.py [--quick] [--emulator] [--backward] [--decode] [--precision] [--plot gpu.png]
Narrowing the forward / backward tables (a short GPU session): ``--dtypes fp16``, ``--head-dims 64,128``,
``--seqlens 1024,4096,16384``, ``--causal both|no|yes``, ``--impls flasharray,torch-flash,...`` (row names;
with ``--backward`` those of either table) and ``--validate-max-n 4096`` (larger N are timed, not validated:
the float64 reference of one head at N 16k takes seconds on the CPU, and the kernels are the same).
"""
import argparse
import collections
import math
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import gpu_timing  # noqa: E402
from flasharray._private import cuda_forward  # noqa: E402
from flasharray._private.dtypes import bfloat16  # noqa: E402
from flasharray.testing import check_attention  # noqa: E402

SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
DTYPES = {"fp16": np.float16, "bf16": bfloat16}
TOKENS = 16384
HIDDEN = 2048
KINDS = ("fwd", "bwd", "fwdbwd")

#: make(tensors, causal, device) -> zero-argument callable to time, or None when unavailable;
#: kind: what it computes (rows are compared within a kind); factor: × the forward FLOPs;
#: role: "torch" (a PyTorch backend), "torch-fa2" (PyTorch's FlashAttention-2), "fa2" (flash_attn)
Impl = collections.namedtuple("Impl", "make kind factor role", defaults=("fwd", 1.0, ""))
#: one table row; vs_fa2 / vs_torch: reference time / this row's time
Row = collections.namedtuple("Row", "dtype B H N D causal impl kind role ms flop mb vs_fa2 vs_torch",
                             defaults=(None, None))
#: PyTorch rows: name -> (torch.nn.attention.SDPBackend member, or None for flash_attn; role)
TORCH_ROWS = {
    "torch-flash": ("FLASH_ATTENTION", "torch-fa2"),
    "torch-cudnn": ("CUDNN_ATTENTION", "torch"),
    "torch-mem-eff": ("EFFICIENT_ATTENTION", "torch"),
    "torch-math": ("MATH", "torch"),
    "flash-attn": (None, "fa2"),
}


class NotMeasured(Exception):
    """A row that is not timed, with the reason printed in its place."""


def flops(B, H, Lq, Lk, D, causal, factor=1.0):
    f = 4.0 * B * H * Lq * Lk * D * factor
    return f * 0.5 if causal else f


# ---- CuPy <-> PyTorch through DLPack ------------------------------------------------------------

def _torch():
    """The torch module when PyTorch with CUDA is installed, else None."""
    try:
        import torch
        return torch if torch.cuda.is_available() else None
    except ImportError:
        return None


def to_torch(x):
    """PyTorch view of the CuPy array ``x`` (no copy). bfloat16 travels as its int16 bits: PyTorch
    cannot read ml_dtypes' bfloat16 from ``__cuda_array_interface__`` (a TypeError)."""
    import cupy as cp
    torch = _torch()
    if x.dtype == bfloat16:
        return torch.from_dlpack(x.view(cp.int16)).view(torch.bfloat16)
    return torch.from_dlpack(x)


def from_torch(t):
    """CuPy view of the PyTorch tensor ``t`` (detached, made contiguous); bfloat16 as in to_torch."""
    import cupy as cp
    torch = _torch()
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return cp.from_dlpack(t.view(torch.int16)).view(bfloat16)
    return cp.from_dlpack(t)


# ---- implementations -----------------------------------------------------------------------------

def _make_flasharray(tensors, causal, device, kernel=None):
    q, k, v = tensors
    scale = 1.0 / math.sqrt(q.shape[-1])
    return lambda: cuda_forward.forward(q, k, v, causal=causal, scale=scale, batch_shape=q.shape[:-2],
                                        device=device, kernel=kernel)


def _make_flasharray_mma(tensors, causal, device):
    """The mma.sync forward forced (kernel="tensor_core"): the default on sm_90 is the wgmma one."""
    return _make_flasharray(tensors, causal, device, kernel="tensor_core")


def _make_flasharray_wgmma(tensors, causal, device):
    """The Hopper forward (cuda_src/flash_fwd_sm90.cu, opt-in kernel="wgmma") on an sm_90 GPU; None
    elsewhere (other GPUs, the emulator run)."""
    if device != "cuda":
        return None
    import cupy as cp
    if int(cp.cuda.Device().compute_capability) != 90:
        return None
    q, k, v = tensors
    scale = 1.0 / math.sqrt(q.shape[-1])
    return lambda: cuda_forward.forward(q, k, v, causal=causal, scale=scale, batch_shape=q.shape[:-2],
                                        device=device, kernel="wgmma")


def require_batched_matmul(dtype):
    """Raise NotMeasured when CuPy cannot multiply batched matrices of ``dtype`` (CuPy 14 and
    bfloat16: TypeError, cupy/cupy#10317)."""
    import cupy as cp
    try:
        cp.matmul(cp.zeros((2, 2, 2), dtype), cp.zeros((2, 2, 2), dtype))
    except TypeError as e:
        raise NotMeasured("CuPy's batched %s matmul fails (%s); torch-math is the materialized "
                          "baseline" % (np.dtype(dtype).name, e)) from e


def naive_forward(q, k, v, causal):
    """Materialized attention with CuPy: (out, P), S and P of shape (..., Lq, Lk)."""
    import cupy as cp
    scale = 1.0 / math.sqrt(q.shape[-1])
    Lq, Lk = q.shape[-2], k.shape[-2]
    s = cp.matmul(q, cp.swapaxes(k, -1, -2)).astype(cp.float32) * scale
    if causal:  # bottom-right aligned, as flasharray's causal mask
        s = cp.where(cp.arange(Lk)[None, :] > (cp.arange(Lq)[:, None] + Lk - Lq), -cp.inf, s)
    s -= s.max(axis=-1, keepdims=True)
    p = cp.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    p = p.astype(q.dtype)
    return cp.matmul(p, v), p


def _make_cupy_naive(tensors, causal, device):
    if device != "cuda":
        return None
    require_batched_matmul(tensors[0].dtype)
    return lambda: naive_forward(*tensors, causal)[0]


def torch_attention(name, tensors, causal, device):
    """``(attend(q, k, v), torch tensors)`` for the PyTorch row ``name`` (TORCH_ROWS), the tensors
    in that row's layout (flash_attn: (B, L, H, D)); None when unavailable."""
    torch = _torch()
    if torch is None or device != "cuda":
        return None
    if causal and tensors[0].shape[-2] != tensors[1].shape[-2]:
        return None  # PyTorch's causal masks are top-left aligned, flasharray's bottom-right
    backend, _ = TORCH_ROWS[name]
    if backend is None:
        try:
            from flash_attn import flash_attn_func
        except ImportError:
            return None
        return ((lambda q, k, v: flash_attn_func(q, k, v, causal=causal)),
                [to_torch(x).transpose(1, 2).contiguous() for x in tensors])
    from torch.nn.attention import SDPBackend, sdpa_kernel
    only = getattr(SDPBackend, backend)

    def attend(q, k, v):
        with sdpa_kernel(only):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return attend, [to_torch(x) for x in tensors]


def _make_torch(name):
    def make(tensors, causal, device):
        made = torch_attention(name, tensors, causal, device)
        if made is None:
            return None
        attend, (q, k, v) = made
        return lambda: attend(q, k, v)
    return make


IMPLS = {"flasharray": Impl(_make_flasharray), "flasharray-mma": Impl(_make_flasharray_mma),
         "flasharray-wgmma": Impl(_make_flasharray_wgmma), "cupy-naive": Impl(_make_cupy_naive)}
IMPLS.update((name, Impl(_make_torch(name), role=role)) for name, (_, role) in TORCH_ROWS.items())


def as_cupy(x, name):
    """A result of row ``name`` as a NumPy/CuPy array in (B, H, L, D) layout."""
    if not hasattr(x, "detach"):
        return x
    x = from_torch(x)
    return x.swapaxes(1, 2) if TORCH_ROWS[name][0] is None else x


def check(name, result, tensors, causal, device):
    """The forward output's first batch entry / head vs the float64 reference (DESIGN.md rule)."""
    out = as_cupy(result[0] if isinstance(result, tuple) else result, name)
    q, k, v = (x[:1, :1] for x in tensors)
    return check_attention(out[:1, :1], q, k, v, causal=causal)


def inputs(xp, B, H, N, D, dtype, seed=0, count=3):
    """``count`` arrays of shape (B, H, N, D), standard normal, on ``xp``'s device."""
    rng = np.random.default_rng(seed)
    arrs = [rng.standard_normal((B, H, N, D)).astype(dtype) for _ in range(count)]
    return [xp.asarray(a) for a in arrs] if xp is not np else arrs


def _make_tensors(xp, B, H, N, D, dtype, copy=0):
    return inputs(xp, B, H, N, D, dtype, seed=copy)


# ---- measurement ---------------------------------------------------------------------------------

def peak_bytes(fn):
    """Device memory one call of ``fn`` adds: growth of CuPy's pool plus PyTorch's peak allocation."""
    import cupy as cp
    torch = _torch()
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    before = pool.total_bytes()
    if torch is not None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        torch_before = torch.cuda.memory_allocated()
    out = fn()
    cp.cuda.Device().synchronize()
    used = pool.total_bytes() - before
    if torch is not None:
        used += torch.cuda.max_memory_allocated() - torch_before
    del out
    return used


def with_ratios(rows):
    """Rows of one shape with ``vs_fa2`` (FlashAttention-2: the flash_attn package if measured,
    else PyTorch's flash backend) and ``vs_torch`` (the fastest PyTorch backend): reference time /
    the row's time among rows of the same kind, so 0.5 means half FlashAttention-2's speed."""
    def best(kind, roles):
        times = [r.ms for r in rows if r.kind == kind and r.role in roles]
        return min(times) if times else None

    out = []
    for r in sorted(rows, key=lambda r: KINDS.index(r.kind)):
        fa2 = best(r.kind, ("fa2",)) or best(r.kind, ("torch-fa2",))
        fastest_torch = best(r.kind, ("torch", "torch-fa2"))
        out.append(r._replace(vs_fa2=fa2 and fa2 / r.ms, vs_torch=fastest_torch and fastest_torch / r.ms))
    return out


def shape_label(B, H, N, D, dt_name, causal):
    return "(%d,%d,%d,%d) %s%s" % (B, H, N, D, dt_name, " causal" if causal else "")


def print_header(unit):
    print("%-30s | %-32s | %9s | %9s | %6s | %8s | %9s"
          % ("shape (B,H,N,D) dtype causal", "impl", "ms", unit, "xFA2", "xtorch", "peak MB"))
    print("-" * 124)


def print_row(r, flop_unit=1e12, note=""):
    ratio = lambda x: "-" if x is None else "%.2fx" % x  # noqa: E731
    print("%-30s | %-32s | %9.3f | %9.3f | %6s | %8s | %9.1f%s"
          % (shape_label(r.B, r.H, r.N, r.D, r.dtype, r.causal), r.impl, r.ms,
             r.flop / (r.ms * 1e-3) / flop_unit, ratio(r.vs_fa2), ratio(r.vs_torch), r.mb, note))


def _why(e):
    """One line for a row that raised: NotMeasured says why; anything else its type and message."""
    if isinstance(e, NotMeasured):
        return str(e)
    return "%s: %s" % (type(e).__name__, (str(e).splitlines() or [""])[0][:120])


def measure(name, impl, copies, causal, check, clock):
    """Validate then time one implementation on one shape; ``copies``: input sets to cycle through;
    ``check`` None: not validated. Returns ``(ms, peak bytes)``, None when unavailable; raises
    NotMeasured when validation fails."""
    fns = [impl.make(tensors, causal, "cuda") for tensors in copies]
    if fns[0] is None:
        return None
    report = check and check(name, fns[0](), copies[0], causal, "cuda")
    if report is not None and not report.passed:
        raise NotMeasured("validation FAILED\n%s" % report)
    return gpu_timing.time_ms(fns, clock).ms, peak_bytes(fns[0])


#: What a table covers (``--dtypes``, ``--head-dims``, ``--seqlens``, ``--causal``, ``--impls``,
#: ``--validate-max-n``): names of dtypes, head dims, N, causal flags, row names (None: every row of
#: the script), and the largest N whose rows are validated (None: every row).
Selection = collections.namedtuple("Selection", "dtypes head_dims seqlens causal impls validate_max_n",
                                   defaults=(tuple(DTYPES), HEAD_DIMS, SEQLENS, (False, True), None, None))


def add_selection_args(ap, dtypes=DTYPES, seqlens=SEQLENS):
    """The options that narrow a table (gpu.py, gpu_backward.py, gpu_precision.py: ``dtypes`` and
    ``seqlens`` its defaults)."""
    ap.add_argument("--dtypes", default=None, help="comma-separated, of %s (default: all)" % ",".join(dtypes))
    ap.add_argument("--head-dims", default=None, help="comma-separated D (default: %s)"
                    % ",".join(map(str, HEAD_DIMS)))
    ap.add_argument("--seqlens", default=None, help="comma-separated N (default: %s; --quick: the first 3)"
                    % ",".join(map(str, seqlens)))
    ap.add_argument("--causal", choices=("both", "no", "yes"), default="both")
    ap.add_argument("--impls", default=None, help="comma-separated row names (default: every row); with "
                    "--backward, the names of either table")
    ap.add_argument("--validate-max-n", type=int, default=None,
                    help="validate rows only up to this N (the float64 reference of one head takes seconds at "
                    "N 16k on the CPU; larger N runs the instantiations validated at smaller N)")


#: the options of :func:`add_selection_args`
SELECTION_OPTIONS = ("--dtypes", "--head-dims", "--seqlens", "--causal", "--impls", "--validate-max-n")


def _without_option(argv, option):
    """``argv`` without ``option`` and its value (``--opt value`` or ``--opt=value``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == option:
            skip = True
        elif not a.startswith(option + "="):
            out.append(a)
    return out


def _csv(text, convert=str):
    return tuple(convert(x) for x in text.split(",") if x.strip())


def selection_from(ap, args, known_impls, all_dtypes=DTYPES, all_seqlens=SEQLENS):
    """The Selection of parsed ``args`` (defaults: ``all_dtypes``, ``all_seqlens``, the first 3 with
    ``--quick``); ``ap.error`` names an unknown dtype, a bad number or a row name not in ``known_impls``."""
    try:
        dtypes = _csv(args.dtypes) if args.dtypes else tuple(all_dtypes)
        head_dims = _csv(args.head_dims, int) if args.head_dims else HEAD_DIMS
        seqlens = _csv(args.seqlens, int) if args.seqlens else (all_seqlens[:3] if args.quick else all_seqlens)
    except ValueError as e:
        ap.error("--head-dims and --seqlens take comma-separated integers (%s)" % e)
    bad = [d for d in dtypes if d not in all_dtypes]
    if bad:
        ap.error("--dtypes: unknown %s (choose from %s)" % (",".join(bad), ",".join(all_dtypes)))
    impls = _csv(args.impls) if args.impls else None
    bad = [n for n in impls or () if n not in known_impls]
    if bad:
        ap.error("--impls: unknown %s (rows: %s)" % (",".join(bad), ",".join(sorted(known_impls))))
    causal = {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]
    return Selection(dtypes, head_dims, seqlens, causal, impls, args.validate_max_n)


def shapes(select=Selection()):
    """(dtype name, D, causal, N) of FlashAttention-2's benchmark, narrowed by ``select``."""
    for dt_name in select.dtypes:
        for D in select.head_dims:
            for causal in select.causal:
                for N in select.seqlens:
                    yield dt_name, D, causal, N


def run_gpu(impls, make_tensors, check, select=Selection(), dtypes=DTYPES):
    """Validate, time and print every shape × implementation of ``select``; returns the rows.
    ``make_tensors(xp, B, H, N, D, dtype, copy)`` makes one set of inputs; ``dtypes``: {label:
    dtype}."""
    import cupy as cp
    if select.impls is not None:
        impls = {name: impl for name, impl in impls.items() if name in select.impls}
    if select.validate_max_n is not None:
        print("rows with N > %d are timed without validation (the same instantiations are validated at "
              "smaller N)" % select.validate_max_n)
    props = cp.cuda.runtime.getDeviceProperties(0)
    print("device: %s (sm_%s), L2 %.0f MB" % (props["name"].decode(), cp.cuda.Device().compute_capability,
                                               props["l2CacheSize"] / 1e6))
    clock = gpu_timing.CudaClock()
    print_header("TFLOP/s")
    rows = []
    for dt_name, D, causal, N in shapes(select):
        B, H, dtype = max(1, TOKENS // N), HIDDEN // D, dtypes[dt_name]
        copies = [make_tensors(cp, B, H, N, D, dtype)]
        n = gpu_timing.copies_for_l2(sum(x.nbytes for x in copies[0]), props["l2CacheSize"])
        copies += [make_tensors(cp, B, H, N, D, dtype, copy=i) for i in range(1, n)]
        shape_rows = []
        for name, impl in impls.items():
            try:
                validate = select.validate_max_n is None or N <= select.validate_max_n
                measured = measure(name, impl, copies, causal, check if validate else None, clock)
            except Exception as e:  # out of memory for materialized attention at large N, no kernel, ...
                print("%-30s | %-32s | %s" % (shape_label(B, H, N, D, dt_name, causal), name, _why(e)))
                continue
            if measured is not None:
                ms, nbytes = measured
                shape_rows.append(Row(dt_name, B, H, N, D, causal, name, impl.kind, impl.role, ms,
                                      flops(B, H, N, N, D, causal, impl.factor), nbytes / 1e6))
        shape_rows = with_ratios(shape_rows)
        for row in shape_rows:
            print_row(row)
        rows += shape_rows
        del copies
        _free_cached_memory()
    return rows


def _free_cached_memory():
    """Give CuPy's and PyTorch's cached blocks back, so that one shape's leftovers (or a failed
    materialized attention) do not starve the next."""
    import cupy as cp
    cp.get_default_memory_pool().free_all_blocks()
    torch = _torch()
    if torch is not None:
        torch.cuda.empty_cache()


def run_emulator(impls, names, make_tensors, check, dtypes=DTYPES):
    """One tiny shape through the CUDA emulator: validates the kernels and this script's code path
    (host time, not GPU performance). Returns True when every validation passed."""
    B, H, N, D = 1, 2, 128, 64
    print("emulator run (CPU time, not GPU performance): B=%d H=%d N=%d D=%d" % (B, H, N, D))
    print_header("GFLOP/s")
    ok = True
    for dt_name, dtype in dtypes.items():
        for causal in (False, True):
            tensors = make_tensors(np, B, H, N, D, dtype)
            for name in names:
                impl = impls[name]
                fn = impl.make(tensors, causal, "emulator")
                if fn is None:  # the row does not apply to this dtype
                    continue
                report = check(name, fn(), tensors, causal, "emulator")
                passed = report is None or report.passed
                ok &= passed
                ms = gpu_timing.time_ms([fn], gpu_timing.PerfClock(), warmup_ms=0, rep_ms=0, min_repeats=1).ms
                print_row(Row(dt_name, B, H, N, D, causal, name, impl.kind, impl.role, ms,
                              flops(B, H, N, N, D, causal, impl.factor), 0.0), 1e9, "" if passed else "  FAILED")
    return ok


# ---- decoding and GQA (--decode) -------------------------------------------------------------------

#: (B, H_q, H_kv, Lq, Lk, causal): the inference table of ../shared/gpu/README.md (fp16, D = 128).
DECODE_SHAPES = (
    (1, 32, 32, 1, 32768, False),
    (16, 32, 32, 1, 4096, False),
    (64, 32, 8, 1, 2048, False),
    (4, 32, 8, 4096, 4096, True),
    (1, 8, 8, 65536, 65536, True),
)
#: The same kinds of shape, small enough for the emulator (--decode --emulator).
DECODE_SHAPES_EMULATOR = (
    (1, 4, 4, 1, 1024, False),
    (2, 4, 4, 1, 256, False),
    (2, 4, 2, 1, 512, False),
    (1, 4, 2, 64, 64, True),
    (1, 2, 2, 128, 128, True),
)
DECODE_D = 128
DECODE_D_EMULATOR = 64
DECODE_DTYPE = "fp16"
#: Query rows validated per shape (the last ones: causal bottom-right alignment keeps them exact).
DECODE_CHECK_ROWS = 256
#: one decode table row; ratio = flasharray's time / FlashAttention-2's (None until both ran)
DecodeRow = collections.namedtuple("DecodeRow", "B Hq Hkv Lq Lk causal impl ms launch ratio", defaults=(None,))


def decode_tensors(xp, B, Hq, Hkv, Lq, Lk, D, dtype, copy=0):
    """q (B, H_q, Lq, D), k and v (B, H_kv, Lk, D): PyTorch's layout; query head h uses KV head
    h // (H_q / H_kv), as SDPA's ``enable_gqa`` and flasharray's (B, H_kv, G, Lq, D) view agree."""
    rng = np.random.default_rng(copy)
    arrs = [rng.standard_normal(shape).astype(dtype) for shape in ((B, Hq, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, D))]
    return [xp.asarray(a) for a in arrs] if xp is not np else arrs


def gqa_views(q, k, v):
    """flasharray's GQA convention: q (B, H_kv, G, Lq, D) against k, v (B, H_kv, 1, Lk, D) (views)."""
    B, Hq, Lq, D = q.shape
    Hkv = k.shape[1]
    return (q.reshape(B, Hkv, Hq // Hkv, Lq, D), k.reshape(B, Hkv, 1, k.shape[2], D),
            v.reshape(B, Hkv, 1, v.shape[2], v.shape[3]))


def decode_launch(tensors, causal, device, arch=None):
    """What flasharray launches for a decode shape: 'splits S, G g, blocks N / M SMs'."""
    q, k, v = gqa_views(*tensors)
    p = cuda_forward.plan(q, k, v, causal=causal, scale=1.0 / math.sqrt(q.shape[-1]), batch_shape=q.shape[:-2],
                          device=device, arch=arch)
    return "splits %d, G %d, %d blocks / %d SMs" % (p.num_splits, p.gqa_group, p.blocks, p.sm_count)


def _make_flasharray_decode(tensors, causal, device):
    q, k, v = gqa_views(*tensors)
    scale = 1.0 / math.sqrt(q.shape[-1])
    return lambda: cuda_forward.forward(q, k, v, causal=causal, scale=scale, batch_shape=q.shape[:-2],
                                        device=device)


def _make_torch_flash_decode(tensors, causal, device):
    """PyTorch SDPA's flash backend with ``enable_gqa`` (no K/V copies), or None without PyTorch.
    A PyTorch whose flash backend refuses ``enable_gqa`` gets K/V repeated per query head once, in
    the untimed first call (then every query head reads its own copy, as unpacked GQA does)."""
    torch = _torch()
    if torch is None or device != "cuda":
        return None
    from torch.nn.attention import SDPBackend, sdpa_kernel
    sdpa = torch.nn.functional.scaled_dot_product_attention
    q, k, v = (to_torch(x) for x in tensors)
    G = q.shape[1] // k.shape[1]
    state = {"gqa": G > 1, "kv": (k, v)}

    def attend():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            if state["gqa"]:
                try:
                    return sdpa(q, k, v, is_causal=causal, enable_gqa=True)
                except (RuntimeError, TypeError):
                    state["gqa"] = False
                    state["kv"] = (k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1))
            return sdpa(q, *state["kv"], is_causal=causal)
    return attend


#: name -> make(tensors in PyTorch's layout, causal, device) -> callable or None
DECODE_IMPLS = {"flasharray": _make_flasharray_decode, "torch-flash": _make_torch_flash_decode}


def check_decode(name, result, tensors, causal, device):
    """First batch entry, first KV head's query heads, last DECODE_CHECK_ROWS query rows, against
    the float64 reference (the DESIGN.md rule); every key is used."""
    out = result[0] if isinstance(result, tuple) else result
    out = from_torch(out) if hasattr(out, "detach") else out
    q, k, v = tensors
    out = out.reshape(q.shape[:3] + (v.shape[-1],))  # flasharray's (B, H_kv, G, Lq, Dv) view
    G = q.shape[1] // k.shape[1]
    rows = min(DECODE_CHECK_ROWS, q.shape[2])
    return check_attention(out[:1, :G, -rows:], q[:1, :G, -rows:], k[:1, :1], v[:1, :1], causal=causal)


def with_decode_ratios(rows):
    """``ratio`` = flasharray's time / FlashAttention-2's for each shape (rows of one shape)."""
    ref = {(r.B, r.Hq, r.Hkv, r.Lq, r.Lk, r.causal): r.ms for r in rows if r.impl == "torch-flash"}
    out = []
    for r in rows:
        fa2 = ref.get((r.B, r.Hq, r.Hkv, r.Lq, r.Lk, r.causal))
        out.append(r._replace(ratio=r.ms / fa2 if fa2 and r.impl == "flasharray" else None))
    return out


def print_decode_header():
    print("%-40s | %-12s | %9s | %7s | %s" % ("B  H_q H_kv   Lq     Lk  causal", "impl", "ms", "ratio", "launch"))
    print("-" * 110)


def print_decode_row(r):
    label = "%-3d %-4d %-4d %-6d %-6d %s" % (r.B, r.Hq, r.Hkv, r.Lq, r.Lk, "causal" if r.causal else "-")
    ratio = "-" if r.ratio is None else "%.2fx" % r.ratio
    print("%-40s | %-12s | %9.3f | %7s | %s" % (label, r.impl, r.ms, ratio, r.launch or ""))


def run_decode(impls, make_tensors, check, clock, xp, shapes=DECODE_SHAPES, D=DECODE_D, device="cuda",
               launch=decode_launch, copies_for=lambda tensors: 1):
    """Validate and time every decode shape × implementation; print and return the rows.
    ``make_tensors(xp, B, H_q, H_kv, Lq, Lk, D, dtype, copy)``; ``copies_for(tensors)``: how many
    input sets to cycle through (L2)."""
    dtype = DTYPES[DECODE_DTYPE]
    print("decode / GQA shapes, %s, D = %d: ratio = flasharray time / FlashAttention-2 time (target <= 1.1)"
          % (DECODE_DTYPE, D))
    print_decode_header()
    rows = []
    for B, Hq, Hkv, Lq, Lk, causal in shapes:
        copies = [make_tensors(xp, B, Hq, Hkv, Lq, Lk, D, dtype)]
        copies += [make_tensors(xp, B, Hq, Hkv, Lq, Lk, D, dtype, copy=i) for i in range(1, copies_for(copies[0]))]
        shape_rows = []
        for name, make in impls.items():
            label = "%d %d %d %d %d%s" % (B, Hq, Hkv, Lq, Lk, " causal" if causal else "")
            try:
                fns = [make(tensors, causal, device) for tensors in copies]
                if fns[0] is None:
                    continue
                report = check(name, fns[0](), copies[0], causal, device)
                if report is not None and not report.passed:
                    raise NotMeasured("validation FAILED\n%s" % report)
                ms = gpu_timing.time_ms(fns, clock).ms
            except Exception as e:  # out of memory, no kernel, no GQA in this PyTorch, ...
                print("%-40s | %-12s | %s" % (label, name, _why(e)))
                continue
            info = launch(copies[0], causal, device) if name == "flasharray" else ""
            shape_rows.append(DecodeRow(B, Hq, Hkv, Lq, Lk, causal, name, ms, info))
        for r in with_decode_ratios(shape_rows):
            print_decode_row(r)
            rows.append(r)
        del copies
    return rows


def stand_ins(B, Hq, Hkv, Lq, Lk, D, dtype):
    """Arrays of the decode shapes without memory (planning needs shapes, strides and alignment)."""
    def one(shape):
        st = np.cumprod((1,) + tuple(reversed(shape[1:])))[::-1] * np.dtype(dtype).itemsize
        return np.lib.stride_tricks.as_strided(np.empty(0, dtype), shape, tuple(int(x) for x in st))
    return one((B, Hq, Lq, D)), one((B, Hkv, Lk, D)), one((B, Hkv, Lk, D))


def print_decode_plans(arch=90):
    """flasharray's launch for the GPU decode shapes on ``arch`` with the emulator's SM count for it
    (planning only: nothing is allocated, compiled or run)."""
    from flasharray._private import launch, tiles
    print("flasharray's launches for the decode shapes on sm_%d (%d SMs), planning only:"
          % (arch, tiles.emulator_sm_count(arch)))
    with launch.null_launches():  # plans without compiling anything
        for B, Hq, Hkv, Lq, Lk, causal in DECODE_SHAPES:
            tensors = stand_ins(B, Hq, Hkv, Lq, Lk, DECODE_D, DTYPES[DECODE_DTYPE])
            print("  B %-3d H_q %-3d H_kv %-3d Lq %-6d Lk %-6d %-7s %s" % (
                B, Hq, Hkv, Lq, Lk, "causal" if causal else "",
                decode_launch(tensors, causal, "emulator", arch=arch)))


def main_decode(emulator):
    """``--decode``: the inference table on the GPU, or its scaled-down shapes on the emulator."""
    if emulator:
        print_decode_plans()
        rows = run_decode({"flasharray": DECODE_IMPLS["flasharray"]}, decode_tensors, check_decode,
                          gpu_timing.PerfClock(), np, shapes=DECODE_SHAPES_EMULATOR, D=DECODE_D_EMULATOR,
                          device="emulator")
        return 0 if len(rows) == len(DECODE_SHAPES_EMULATOR) else 1
    if not have_gpu():
        return 0
    import cupy as cp
    props = cp.cuda.runtime.getDeviceProperties(0)
    print("device: %s (sm_%s), %d SMs, L2 %.0f MB" % (props["name"].decode(), cp.cuda.Device().compute_capability,
                                                     props["multiProcessorCount"], props["l2CacheSize"] / 1e6))
    copies_for = lambda tensors: gpu_timing.copies_for_l2(sum(x.nbytes for x in tensors), props["l2CacheSize"])  # noqa: E731
    run_decode(DECODE_IMPLS, decode_tensors, check_decode, gpu_timing.CudaClock(), cp, copies_for=copies_for)
    return 0


def have_gpu():
    """True when CuPy sees a CUDA device; otherwise say why there is nothing to measure."""
    try:
        import cupy
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        print("no GPU: CuPy unavailable (%s: %s); nothing to measure. Use --emulator to exercise the "
              "kernels on the CPU." % (type(e).__name__, e))
        return False
    if n == 0:
        print("no GPU: CuPy sees no CUDA device; nothing to measure.")
        return False
    return True


def plot_tflops(rows, impl_names, path):
    """TFLOP/s against N, one panel per (dtype, D, causal), one line per implementation."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(2, 4, figsize=(16, 7), sharex=True)
    for ax, (dt, D, causal) in zip(axes.flat, [(a, b, c) for a in DTYPES for b in HEAD_DIMS for c in (False, True)]):
        for name in impl_names:
            pts = [(r.N, r.flop / (r.ms * 1e-3) / 1e12) for r in rows
                   if (r.dtype, r.D, r.causal, r.impl) == (dt, D, causal, name)]
            if pts:
                ax.semilogx(*zip(*pts), "-o", label=name)
        ax.set_title("%s d=%d%s" % (dt, D, " causal" if causal else ""))
        ax.set_xlabel("N")
        ax.set_ylabel("TFLOP/s")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    print("plot saved to %s" % path)


def main(argv=None, known_impls=None):
    """``known_impls``: the row names ``--impls`` may give (default: this table's, or with
    ``--backward`` both tables')."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N up to 2048 only")
    ap.add_argument("--emulator", action="store_true", help="run a tiny shape on the CPU emulator")
    ap.add_argument("--plot", default=None, help="save a TFLOP/s plot to this file")
    ap.add_argument("--backward", action="store_true",
                    help="also run benchmarks/gpu_backward.py (backward, forward+backward)")
    ap.add_argument("--decode", action="store_true",
                    help="the decoding / GQA inference shapes against PyTorch's flash backend instead")
    ap.add_argument("--precision", action="store_true",
                    help="float32 (each precision) and float64 rows instead (benchmarks/gpu_precision.py)")
    add_selection_args(ap)
    args = ap.parse_args(argv)
    narrowed = [opt for opt in SELECTION_OPTIONS if getattr(args, opt[2:].replace("-", "_")) not in (None, "both")]
    if args.decode and narrowed:
        ap.error("%s: only for the forward / backward / precision tables, not with --decode" % narrowed[0])
    if args.precision:
        if args.decode or args.backward or args.plot:
            ap.error("--precision takes only --quick, --emulator and the table's narrowing options (it times "
                     "forward and backward)")
        import gpu_precision
        return gpu_precision.main([a for a in (argv if argv is not None else sys.argv[1:]) if a != "--precision"])
    if args.decode:
        if args.backward or args.quick or args.plot:
            ap.error("--decode takes only --emulator")
        return main_decode(args.emulator)
    if args.backward:
        import gpu_backward
        rest = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--backward"]
        selection_from(ap, args, set(IMPLS) | set(gpu_backward.IMPLS))  # unknown names fail before anything runs
        status = main(rest, known_impls=set(IMPLS) | set(gpu_backward.IMPLS))
        bwd_argv = _without_option(rest, "--plot")
        if args.plot:
            root, ext = os.path.splitext(args.plot)
            bwd_argv += ["--plot", root + "_backward" + (ext or ".png")]
        return status or gpu_backward.main(bwd_argv, known_impls=set(IMPLS) | set(gpu_backward.IMPLS))
    if args.emulator:
        return 0 if run_emulator(IMPLS, ["flasharray"], _make_tensors, check) else 1
    if not have_gpu():
        return 0
    rows = run_gpu(IMPLS, _make_tensors, check, selection_from(ap, args, known_impls or IMPLS))
    if args.plot and rows:
        plot_tflops(rows, IMPLS, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
