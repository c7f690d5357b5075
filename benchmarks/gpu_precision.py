"""GPU float32 / float64 attention (issue 12): flasharray per precision vs PyTorch's memory-efficient backend.

Rows (kind fwd: the forward; bwd: the backward given the forward's saved state; fwdbwd: both.
FLOPs as benchmarks/gpu.py and gpu_backward.py: 4·B·H·N²·D per forward, ×2.5 backward, ×3.5 both,
×0.5 causal):
  flasharray-<p>, -<p>-bwd, -<p>-fwdbwd   p = ieee (float32: the SIMT kernels; float64: DMMA on
                                          sm_80+), 3xtf32, tf32 (float32 only); deterministic backward
  flasharray-ieee-recompute-bwd, -fwdbwd  ieee with dq="recompute" (the dQ kernel recomputing S and dP,
                                          7 products) beside the default ordered dQ (5)
  torch-mem-eff, -bwd, -fwdbwd            PyTorch SDPA, memory-efficient backend (it refuses float64)
  torch-math, -bwd, -fwdbwd               PyTorch SDPA, math backend (S and P materialized)
Shapes: batch·seqlen = 16k tokens, hidden 2048, D ∈ {64, 128}, causal and not, N 1k–16k, float32
and float64. Timing, input cycling and the ratio columns are benchmarks/gpu.py's (``xtorch``: the
fastest PyTorch backend of the same kind).

Every flasharray row is validated on the first batch entry / head before it is timed: the DESIGN.md
rule against float64 (ieee, 3xtf32, float64); ``tf32`` outputs against the derived tf32 bound
(``precision.tf32_error_bound`` plus the float32 rule's own term); ``tf32`` gradients against the
float64 backward of the tf32-rounded operands within ``precision.tf32_gradient_bound`` plus that term.

After the table, issue 12's goals from the measured rows, per shape:
  float32 default precision, fwd+bwd / torch-mem-eff fwd+bwd    goal >= 2
  float32 default (3xtf32) fwd+bwd / ieee fwd+bwd               the default's premise: > 1
  tf32 fwd+bwd TFLOP/s                                          goal >= 150 (H100, D 128, N >= 4k)
  float64 fwd+bwd, % of the GPU's FP64 tensor-core peak         goal >= 40 (N >= 4k)
  ieee float32 backward TFLOP/s / its forward's                 goal >= 0.8
  ieee backward, ordered dQ vs the recomputing dQ kernel        speedup (expected ~1.3)
Without a GPU the script says so and exits 0; ``--emulator`` runs one tiny shape per dtype through
the CUDA emulator (validates the kernels and this script; CPU time, not GPU performance).
Usage: python benchmarks/gpu_precision.py [--quick] [--emulator]     (also: gpu.py --precision)
       and benchmarks/gpu.py's narrowing options (--dtypes fp32,fp64 --head-dims 64 --seqlens 4096 ...)
"""
import argparse
import math
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import gpu as fwd_bench  # noqa: E402
import gpu_backward  # noqa: E402
from gpu import Impl  # noqa: E402
from flasharray import reference  # noqa: E402
from flasharray._private import cuda_backward, cuda_forward  # noqa: E402
from flasharray._private.dtypes import ATOL  # noqa: E402
from flasharray._private.precision import (FLOAT32_FWD_DEFAULT, FLOAT32_FWD_DEFAULT_MAX_HEAD_DIM,  # noqa: E402
                                           FLOAT32_TC_DEFAULT, tf32_backward_reference, tf32_error_bound,
                                           tf32_gradient_bound)
from flasharray.testing import Check, AttentionReport, check_attention  # noqa: E402

DTYPES = {"fp32": np.float32, "fp64": np.float64}
SEQLENS = (1024, 2048, 4096, 8192, 16384)
PRECISIONS = ("ieee", "3xtf32", "tf32")
TF32 = ("3xtf32", "tf32")
#: float32's default precision (precision=None) on the sm_80+ GPUs these rows need (docs/precision.md): the
#: backward's (FLOAT32_TC_DEFAULT None: IEEE), and the forward's of these dense calls up to D 128
DEFAULT_FP32 = FLOAT32_TC_DEFAULT or "ieee"
DEFAULT_FP32_FWD = FLOAT32_FWD_DEFAULT
KIND_SUFFIX = {"fwd": "", "bwd": "-bwd", "fwdbwd": "-fwdbwd"}
#: Backward variants with rows of their own: name -> (precision, cuda_backward options). ieee-recompute:
#: the SIMT backward's recomputing dQ kernel (7 products), beside the default ordered dQ (5).
VARIANTS = {"ieee-recompute": ("ieee", {"dq": "recompute"})}


def _variant(precision):
    """(precision, backward options) of a row's precision part (a :data:`VARIANTS` name or a precision)."""
    return VARIANTS.get(precision, (precision, {}))
FACTORS = {"fwd": 1.0, "bwd": gpu_backward.BWD_FACTOR, "fwdbwd": gpu_backward.FWDBWD_FACTOR}
#: FP64 tensor-core peak TFLOP/s (dense DMMA) by device-name substring, first match wins.
FP64_TC_PEAK = (("H100 PCIe", 51.2), ("H100 NVL", 60.0), ("GH200", 66.9), ("H100", 66.9), ("H200", 66.9),
                ("A100", 19.5), ("A30", 10.3))


def row_name(impl, precision, kind):
    return "%s%s%s" % (impl, "-" + precision if precision else "", KIND_SUFFIX[kind])


def _make_flasharray(precision, kind):
    """flasharray's forward, backward or both for (q, k, v, dout) at ``precision``; None where the
    precision does not apply to the dtype (tf32 with float64)."""
    base, bwd_opts = _variant(precision)

    def make(tensors, causal, device):
        q, k, v, dout = tensors
        if base in TF32 and q.dtype != np.float32:
            return None
        kw = dict(causal=causal, scale=1.0 / math.sqrt(q.shape[-1]), batch_shape=q.shape[:-2], device=device,
                  precision=base)

        def fwd():
            return cuda_forward.forward(q, k, v, **kw)

        def bwd(out, lse):
            return cuda_backward.backward(dout, q, k, v, out, lse, **kw, **bwd_opts)
        if kind == "fwd":
            return fwd
        if kind == "bwd":
            state = fwd()
            return lambda: bwd(*state)
        return lambda: bwd(*fwd())
    return make


def _make_torch(name, kind):
    if kind != "fwd":
        return gpu_backward._make_torch(name, kind == "fwdbwd")
    forward = fwd_bench._make_torch(name)
    return lambda tensors, causal, device: forward(tensors[:3], causal, device)


def impls():
    out = {}
    for kind in ("fwd", "bwd", "fwdbwd"):
        for p in PRECISIONS + (tuple(VARIANTS) if kind != "fwd" else ()):
            out[row_name("flasharray", p, kind)] = Impl(_make_flasharray(p, kind), kind, FACTORS[kind])
        for name in ("torch-mem-eff", "torch-math"):
            out[row_name(name, None, kind)] = Impl(_make_torch(name, kind), kind, FACTORS[kind], "torch")
    return out


IMPLS = impls()
FLASHARRAY = tuple(n for n in IMPLS if n.startswith("flasharray"))


def parse(name):
    """(precision, kind) of a flasharray row name."""
    kind = "bwd" if name.endswith("-bwd") else "fwdbwd" if name.endswith("-fwdbwd") else "fwd"
    return name[len("flasharray-"):len(name) - len(KIND_SUFFIX[kind])], kind


# ---- validation ------------------------------------------------------------------------------------

def tf32_out_check(out, q, k, v, causal):
    """``precision="tf32"``'s output vs float64: elementwise within tf32_error_bound plus the float32
    rule's own term (2·max|naive fp32 − ref| + atol), as tests/test_cuda_forward_tf32.py holds it."""
    ref = reference.attention(q, k, v, causal=causal)
    naive = reference.attention(q, k, v, causal=causal, dtype=np.float32)
    bound, _ = tf32_error_bound(q, k, v, causal=causal)
    fp32_term = 2 * np.abs(naive - ref).max() + ATOL[np.dtype(np.float32)] * max(1.0, np.abs(ref).max())
    err = np.abs(np.asarray(out, np.float64) - ref)
    limit = bound + fp32_term
    return Check("out", float(err.max()), float(np.abs(naive - ref).max()), float(limit.max()),
                 bool(np.all(err <= limit)), "tf32 bound (elementwise)")


def _host(x):
    return x.get() if hasattr(x, "get") else np.asarray(x)


def tf32_grad_checks(grads, q, k, v, dout, out, lse, causal):
    """``precision="tf32"``'s gradients: elementwise against the float64 backward of the tf32-rounded
    operands (``precision.tf32_backward_reference``, given the forward's L and D_i = rowsum(dO ∘ O)),
    within ``precision.tf32_gradient_bound`` plus the float32 rule's term per gradient, as
    tests/test_cuda_backward_tf32.py holds them."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    g = lambda x: np.asarray(x)[..., None, :, :]  # noqa: E731  (..., G = 1, L, D): the bound's layout
    lse, delta = np.asarray(lse, np.float32), (np.asarray(dout, np.float64) * out).sum(-1).astype(np.float32)
    *ref_t, p, ds = tf32_backward_reference(g(q), k, v, g(dout), g(lse), g(delta), causal=causal, scale=scale)
    flips = tf32_gradient_bound(g(q), k, v, g(dout), g(lse), g(delta), p, ds, scale=scale)
    ref = reference.attention_backward(dout, q, k, v, causal=causal, scale=scale)
    naive = reference.attention_backward(dout, q, k, v, causal=causal, scale=scale, dtype=np.float32)
    checks = []
    for name, got, rt, f, r64, n in zip(("dq", "dk", "dv"), grads, ref_t, flips, ref, naive):
        r64, n = np.asarray(r64, np.float64), np.asarray(n, np.float64)
        term = 2 * np.abs(n - r64).max() + ATOL[np.dtype(np.float32)] * max(1.0, np.abs(r64).max())
        err = np.abs(np.asarray(got, np.float64) - rt.reshape(np.shape(got)))
        limit = f.reshape(err.shape) + term
        checks.append(Check(name, float(err.max()), float(np.abs(n - r64).max()), float(limit.max()),
                            bool(np.all(err <= limit)), "tf32 gradient bound (elementwise)"))
    return checks


def check(name, result, tensors, causal, device):
    """flasharray rows (first batch entry / head) vs float64; None for PyTorch's rows (trusted)."""
    if not name.startswith("flasharray"):
        return None
    precision, kind = parse(name)
    precision = _variant(precision)[0]
    q, k, v, dout = (_host(x[:1, :1]) for x in tensors)
    if kind == "fwd":
        out, lse = (_host(x[:1, :1]) for x in result)
        grads = None
    else:
        grads = tuple(_host(g[:1, :1]) for g in result)
        out, lse = (_host(x[:1, :1]) for x in _make_flasharray(precision, "fwd")(tensors, causal, device)())
    if precision != "tf32":
        return check_attention(out, q, k, v, causal=causal, dout=None if grads is None else dout, grads=grads)
    report = AttentionReport(dtype="float32 (tf32)")
    report.checks.append(tf32_out_check(out, q, k, v, causal))
    if grads is not None:
        report.checks.extend(tf32_grad_checks(grads, q, k, v, dout, out, lse, causal))
    return report


# ---- issue 12's goals from the rows ----------------------------------------------------------------

def tflops(r):
    return r.flop / (r.ms * 1e-3) / 1e12


def fp64_peak(device_name):
    for key, peak in FP64_TC_PEAK:
        if key in device_name:
            return peak
    return None


def default_ms(get, D):
    """``(label, ms)`` of float32's default forward + backward at head dim ``D`` from the rows (``get(impl)``): the
    forward's default precision (3xtf32 up to D 128) plus the backward's (ieee); one fwdbwd row where both are the
    same precision; None when a row is missing."""
    fwd = DEFAULT_FP32_FWD if D <= FLOAT32_FWD_DEFAULT_MAX_HEAD_DIM else DEFAULT_FP32
    if fwd == DEFAULT_FP32:
        row = get(row_name("flasharray", fwd, "fwdbwd"))
        return (fwd, row.ms) if row else None
    f, b = get(row_name("flasharray", fwd, "fwd")), get(row_name("flasharray", DEFAULT_FP32, "bwd"))
    return ("%s forward + %s backward" % (fwd, DEFAULT_FP32), f.ms + b.ms) if f and b else None


def _default_goals(get, D):
    """The float32 default's goal lines: fwd+bwd against PyTorch's memory-efficient backend, and against ieee."""
    mine, theirs, ieee = default_ms(get, D), get("torch-mem-eff-fwdbwd"), get(row_name("flasharray", "ieee", "fwdbwd"))
    parts = []
    if mine and theirs:
        parts.append("default (%s) fwd+bwd %.2fx torch-mem-eff (goal >= 2)" % (mine[0], theirs.ms / mine[1]))
    if mine and ieee and mine[0] != "ieee":
        parts.append("default (%s) fwd+bwd %.2fx ieee (the default's premise: > 1)" % (mine[0], ieee.ms / mine[1]))
    return parts


def goals(rows, device_name=""):
    """Lines of issue 12's goals per shape (dtype, D, causal, N), from whatever rows were measured."""
    by = {(r.dtype, r.D, r.causal, r.N, r.impl): r for r in rows}
    shapes = sorted({(r.dtype, r.D, r.causal, r.N) for r in rows})
    peak = fp64_peak(device_name)
    lines = []
    for dt, D, causal, N in shapes:
        get = lambda impl: by.get((dt, D, causal, N, impl))  # noqa: E731
        parts = []
        if dt == "fp32":
            parts += _default_goals(get, D)
            tf = get(row_name("flasharray", "tf32", "fwdbwd"))
            if tf:
                parts.append("tf32 fwd+bwd %.1f TFLOP/s (goal >= 150 at D 128, N >= 4k)" % tflops(tf))
            f, b = get(row_name("flasharray", "ieee", "fwd")), get(row_name("flasharray", "ieee", "bwd"))
            if f and b:
                parts.append("ieee bwd/fwd TFLOP/s %.2f (goal >= 0.8)" % (tflops(b) / tflops(f)))
            rb = get(row_name("flasharray", "ieee-recompute", "bwd"))
            if b and rb:
                parts.append("ieee bwd ordered dQ %.2fx the recomputing dQ kernel" % (rb.ms / b.ms))
        else:
            fb = get(row_name("flasharray", "ieee", "fwdbwd"))
            if fb:
                pct = " = %.0f%% of %.1f" % (100 * tflops(fb) / peak, peak) if peak else " (FP64 peak unknown)"
                parts.append("fwd+bwd %.1f TFLOP/s%s (goal >= 40%% at N >= 4k)" % (tflops(fb), pct))
        if parts:
            lines.append("  %s D=%d N=%d%s: %s" % (dt, D, N, " causal" if causal else "", "; ".join(parts)))
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N up to 4096 only")
    ap.add_argument("--emulator", action="store_true", help="run a tiny shape on the CPU emulator")
    fwd_bench.add_selection_args(ap, DTYPES, SEQLENS)
    args = ap.parse_args(argv)
    select = fwd_bench.selection_from(ap, args, IMPLS, DTYPES, SEQLENS)
    if args.emulator:
        ok = fwd_bench.run_emulator(IMPLS, FLASHARRAY, gpu_backward._make_tensors, check, dtypes=DTYPES)
        return 0 if ok else 1
    if not fwd_bench.have_gpu():
        return 0
    import cupy as cp
    rows = fwd_bench.run_gpu(IMPLS, gpu_backward._make_tensors, check, select, dtypes=DTYPES)
    name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print("\nissue 12's goals, measured on %s:" % name)
    print("\n".join(goals(rows, name)) or "  (no rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
