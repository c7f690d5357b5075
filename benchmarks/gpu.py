"""GPU forward throughput: flasharray's CUDA kernels vs materialized CuPy attention (and PyTorch).

FLOPs counted as FlashAttention does: 4·B·H·Lq·Lk·D per forward (two matmuls), ×0.5 when causal.
Shapes follow FlashAttention-2's benchmark: batch·seqlen = 16k tokens, hidden 2048 (H = 2048/D),
N ∈ {512, 1k, 2k, 4k, 8k, 16k}, D ∈ {64, 128}, fp16 and bf16, causal and not.

Every implementation is validated against the float64 reference on a slice before it is timed;
timings use CUDA events after warm-up; peak memory is the growth of CuPy's memory pool during one
call (torch: ``torch.cuda.max_memory_allocated``).

Implementations (registry ``IMPLS``; other scripts/helpers add rows with :func:`register_impl`,
e.g. the backward kernels with ``kind="bwd"`` and ``flops_factor=2.5``):
  flasharray   flasharray._private.cuda_forward.forward (this project's kernels)
  cupy-naive   S = q kᵀ, softmax, P v with CuPy (S and P materialized)
  torch-sdpa   torch.nn.functional.scaled_dot_product_attention, if PyTorch is installed
  flash-attn   flash_attn.flash_attn_func, if installed

Without a GPU the script says so and exits 0. ``--emulator`` runs one tiny shape through the
CUDA emulator instead (exercises this script and the kernels in CI; the time is CPU time).
``--backward`` continues with ``benchmarks/gpu_backward.py`` (backward and forward+backward
TFLOP/s, backward counted as 2.5× the forward FLOPs) with the same options.
Usage: python benchmarks/gpu.py [--quick] [--emulator] [--backward] [--plot gpu.png]
"""
import argparse
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from flasharray._private import cuda_forward  # noqa: E402
from flasharray._private.dtypes import bfloat16  # noqa: E402

SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
DTYPES = {"fp16": np.float16, "bf16": bfloat16}
TOKENS = 16384
HIDDEN = 2048

#: name -> (make(q, k, v, causal, device) -> callable or None, kind, flops_factor)
IMPLS = {}


def register_impl(name, make, kind="fwd", flops_factor=1.0):
    """Add an implementation row. ``make(q, k, v, causal, device)`` returns a zero-argument
    callable to time (or None when unavailable for these inputs); ``flops_factor`` multiplies
    the forward FLOP count (2.5 for a backward, as FlashAttention counts it)."""
    IMPLS[name] = (make, kind, flops_factor)


def flops(B, H, Lq, Lk, D, causal, factor=1.0):
    f = 4.0 * B * H * Lq * Lk * D * factor
    return f * 0.5 if causal else f


# ---- implementations -------------------------------------------------------------------------------

def _make_flasharray(q, k, v, causal, device):
    scale = 1.0 / math.sqrt(q.shape[-1])
    return lambda: cuda_forward.forward(q, k, v, causal=causal, scale=scale, batch_shape=q.shape[:-2],
                                        device=device)


def _make_cupy_naive(q, k, v, causal, device):
    if device != "cuda":
        return None
    import cupy as cp
    scale = 1.0 / math.sqrt(q.shape[-1])
    Lq, Lk = q.shape[-2], k.shape[-2]
    mask = None
    if causal:
        mask = cp.arange(Lk)[None, :] > (cp.arange(Lq)[:, None] + Lk - Lq)

    def run():
        s = cp.matmul(q, cp.swapaxes(k, -1, -2)).astype(cp.float32) * scale
        if mask is not None:
            s = cp.where(mask, -cp.inf, s)
        s -= s.max(axis=-1, keepdims=True)
        p = cp.exp(s)
        p /= p.sum(axis=-1, keepdims=True)
        return cp.matmul(p.astype(q.dtype), v)
    return run


def _torch():
    try:
        import torch
        return torch if torch.cuda.is_available() else None
    except ImportError:
        return None


def _make_torch_sdpa(q, k, v, causal, device):
    torch = _torch()
    if torch is None or device != "cuda":
        return None
    tq, tk, tv = (torch.as_tensor(x, device="cuda") for x in (q, k, v))
    if causal and q.shape[-2] != k.shape[-2]:
        return None  # SDPA's is_causal is top-left aligned
    return lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)


def _make_flash_attn(q, k, v, causal, device):
    torch = _torch()
    if torch is None or device != "cuda":
        return None
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    tq, tk, tv = (torch.as_tensor(x, device="cuda").transpose(1, 2).contiguous() for x in (q, k, v))
    return lambda: flash_attn_func(tq, tk, tv, causal=causal)


register_impl("flasharray", _make_flasharray)
register_impl("cupy-naive", _make_cupy_naive)
register_impl("torch-sdpa", _make_torch_sdpa)
register_impl("flash-attn", _make_flash_attn)


# ---- measurement -----------------------------------------------------------------------------------

def _validate(fn_out, q, k, v, causal):
    """Check the first batch entry / head against the float64 reference (DESIGN.md rule)."""
    from flasharray.testing import check_attention
    out = fn_out[0] if isinstance(fn_out, tuple) else fn_out
    if hasattr(out, "detach"):  # torch
        out = out.detach().float().cpu().numpy()
        if out.shape[-2] != q.shape[-2]:  # flash-attn layout (B, L, H, D)
            out = np.swapaxes(out, 1, 2)
    host = lambda x: x[:1, :1] if isinstance(x, np.ndarray) else x[:1, :1].get()  # noqa: E731
    o = host(out)
    qs, ks, vs = (host(x) for x in (q, k, v))
    return check_attention(np.asarray(o).astype(qs.dtype), qs, ks, vs, causal=causal)


def time_gpu(fn, repeats=10):
    import cupy as cp
    fn()  # warm-up (and JIT compile)
    cp.cuda.Device().synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(repeats):
        fn()
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / repeats


def peak_bytes(fn):
    import cupy as cp
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    before = pool.total_bytes()
    out = fn()
    cp.cuda.Device().synchronize()
    used = pool.total_bytes() - before
    del out
    return used


def _inputs(xp, B, H, N, D, dtype, seed=0):
    rng = np.random.default_rng(seed)
    arrs = [rng.standard_normal((B, H, N, D)).astype(dtype) for _ in range(3)]
    return [xp.asarray(a) for a in arrs] if xp is not np else arrs


def run_gpu(args):
    import cupy as cp
    rows = []
    seqlens = SEQLENS[:3] if args.quick else SEQLENS
    print("device: %s (sm_%s)" % (cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                                 cp.cuda.Device().compute_capability))
    print("%-32s | %-11s | %9s | %9s | %9s" % ("shape (B,H,N,D) dtype causal", "impl", "ms", "TFLOP/s", "peak MB"))
    print("-" * 84)
    for dt_name, dtype in DTYPES.items():
        for D in HEAD_DIMS:
            for causal in (False, True):
                for N in seqlens:
                    B, H = max(1, TOKENS // N), HIDDEN // D
                    q, k, v = _inputs(cp, B, H, N, D, dtype)
                    shape = "(%d,%d,%d,%d) %s %s" % (B, H, N, D, dt_name, "causal" if causal else "")
                    for name, (make, kind, factor) in IMPLS.items():
                        try:
                            fn = make(q, k, v, causal, "cuda")
                            if fn is None:
                                continue
                            report = _validate(fn(), q, k, v, causal) if kind == "fwd" else None
                            if report is not None and not report.passed:
                                print("%-32s | %-11s | validation FAILED\n%s" % (shape, name, report))
                                continue
                            ms = time_gpu(fn)
                            mb = peak_bytes(fn) / 1e6
                        except Exception as e:  # out of memory for naive attention at large N, ...
                            print("%-32s | %-11s | %s" % (shape, name, type(e).__name__))
                            continue
                        tf = flops(B, H, N, N, D, causal, factor) / (ms * 1e-3) / 1e12
                        rows.append((dt_name, D, causal, N, name, ms, tf, mb))
                        print("%-32s | %-11s | %9.3f | %9.1f | %9.1f" % (shape, name, ms, tf, mb))
                    del q, k, v
                    cp.get_default_memory_pool().free_all_blocks()
    return rows


def run_emulator():
    """One tiny shape through the emulator: validates the kernel and this script's code path."""
    B, H, N, D = 1, 2, 128, 64
    print("emulator run (CPU time, not GPU performance): B=%d H=%d N=%d D=%d" % (B, H, N, D))
    print("%-32s | %-11s | %9s | %9s" % ("shape (B,H,N,D) dtype causal", "impl", "ms", "GFLOP/s"))
    ok = True
    for dt_name, dtype in DTYPES.items():
        for causal in (False, True):
            q, k, v = _inputs(np, B, H, N, D, dtype)
            fn = IMPLS["flasharray"][0](q, k, v, causal, "emulator")
            report = _validate(fn(), q, k, v, causal)
            ok &= report.passed
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
            gf = flops(B, H, N, N, D, causal) / (ms * 1e-3) / 1e9
            print("%-32s | %-11s | %9.1f | %9.3f%s" % ("(%d,%d,%d,%d) %s %s" % (B, H, N, D, dt_name, "causal" if causal else ""),
                                                   "flasharray", ms, gf, "" if report.passed else "  FAILED"))
    return ok


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
    """TFLOP/s against N, one panel per (dtype, D, causal); rows as printed by the tables
    ``(dtype, D, causal, N, impl, ms, tflops, ...)``."""
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
            pts = [(r[3], r[6]) for r in rows if r[:3] == (dt, D, causal) and r[4] == name]
            if pts:
                ax.semilogx(*zip(*pts), "-o", label=name)
        ax.set_title("%s d=%d%s" % (dt, D, " causal" if causal else ""))
        ax.set_xlabel("N")
        ax.set_ylabel("TFLOP/s")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    print("plot saved to %s" % path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N up to 2048 only")
    ap.add_argument("--emulator", action="store_true", help="run a tiny shape on the CPU emulator")
    ap.add_argument("--plot", default=None, help="save a TFLOP/s plot to this file")
    ap.add_argument("--backward", action="store_true",
                    help="also run benchmarks/gpu_backward.py (backward, forward+backward)")
    args = ap.parse_args(argv)
    if args.backward:
        status = main([a for a in (argv if argv is not None else sys.argv[1:]) if a != "--backward"])
        import gpu_backward  # benchmarks/ is on sys.path when this file runs as a script
        bwd_argv = ["--quick"] * args.quick + ["--emulator"] * args.emulator
        if args.plot:
            root, ext = os.path.splitext(args.plot)
            bwd_argv += ["--plot", root + "_backward" + (ext or ".png")]
        return status or gpu_backward.main(bwd_argv)
    if args.emulator:
        return 0 if run_emulator() else 1
    if not have_gpu():
        return 0
    rows = run_gpu(args)
    if args.plot and rows:
        plot_tflops(rows, IMPLS, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
