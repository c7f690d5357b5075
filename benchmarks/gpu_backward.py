"""GPU backward throughput: flasharray's CUDA backward vs materialized CuPy attention (and PyTorch).

FLOPs counted as FlashAttention does: forward 4·B·H·Lq·Lk·D (×0.5 causal); the backward is 2.5×
that (five matrix products instead of two), forward + backward 3.5×. Shapes as benchmarks/gpu.py:
batch·seqlen = 16k tokens, hidden 2048 (H = 2048/D), N ∈ {512, …, 16k}, D ∈ {64, 128}, fp16/bf16.

Rows (time of the backward given the forward's saved state, and of forward + backward):
  flasharray-det     cuda_backward.backward(deterministic=True): separate dQ kernel, no atomics
  flasharray-atomic  cuda_backward.backward(deterministic=False): fp32 atomics for dQ
  flasharray-fwdbwd  cuda_forward.forward + the deterministic backward
  cupy-naive         materialized attention keeping P from the forward, hand-derived backward:
                     dV = PᵀdO, dP = dO Vᵀ, dS = P∘(dP − rowsum(dO∘O)), dQ = dS K·s, dK = dSᵀQ·s
  cupy-naive-fwdbwd  its forward (S, P materialized) + that backward
  torch-sdpa         torch scaled_dot_product_attention backward (autograd), if PyTorch is installed
  flash-attn         flash_attn_func backward, if installed

flasharray's gradients are validated on the first batch entry / head against the float64 reference
(DESIGN.md rule, 3× for gradients) before timing; timings use CUDA events after warm-up.
Without a GPU the script says so and exits 0; ``--emulator`` runs one tiny shape through the CUDA
emulator (validates the kernels and this script; CPU time, not GPU performance).
Usage: python benchmarks/gpu_backward.py [--quick] [--emulator] [--plot gpu_backward.png]
"""
import argparse
import math
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import gpu as fwd_bench  # noqa: E402  (benchmarks/gpu.py: timing helpers, shapes, FLOP count)
from flasharray._private import cuda_backward, cuda_forward  # noqa: E402
from flasharray.testing import check_attention  # noqa: E402

BWD_FACTOR = 2.5
FWDBWD_FACTOR = 3.5


# ---- implementations: make(q, k, v, dout, causal, device) -> (callable, flops factor) or None ------

def _scale(q):
    return 1.0 / math.sqrt(q.shape[-1])


def _flash_state(q, k, v, causal, device):
    return cuda_forward.forward(q, k, v, causal=causal, scale=_scale(q), batch_shape=q.shape[:-2],
                                device=device)


def _make_flash_bwd(deterministic):
    def make(q, k, v, dout, causal, device):
        out, lse = _flash_state(q, k, v, causal, device)
        return (lambda: cuda_backward.backward(dout, q, k, v, out, lse, causal=causal, scale=_scale(q),
                                               batch_shape=q.shape[:-2], device=device,
                                               deterministic=deterministic)), BWD_FACTOR
    return make


def _make_flash_fwdbwd(q, k, v, dout, causal, device):
    def run():
        out, lse = _flash_state(q, k, v, causal, device)
        return cuda_backward.backward(dout, q, k, v, out, lse, causal=causal, scale=_scale(q),
                                      batch_shape=q.shape[:-2], device=device)
    return run, FWDBWD_FACTOR


def _naive_forward(q, k, v, causal):
    import cupy as cp
    scale = _scale(q)
    Lq, Lk = q.shape[-2], k.shape[-2]
    s = cp.matmul(q, cp.swapaxes(k, -1, -2)).astype(cp.float32) * scale
    if causal:
        s = cp.where(cp.arange(Lk)[None, :] > (cp.arange(Lq)[:, None] + Lk - Lq), -cp.inf, s)
    s -= s.max(axis=-1, keepdims=True)
    p = cp.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    p = p.astype(q.dtype)
    return cp.matmul(p, v), p


def _naive_backward(q, k, v, dout, out, p):
    import cupy as cp
    scale = _scale(q)
    dv = cp.matmul(cp.swapaxes(p, -1, -2), dout)
    dp = cp.matmul(dout, cp.swapaxes(v, -1, -2)).astype(cp.float32)
    delta = (dout.astype(cp.float32) * out.astype(cp.float32)).sum(axis=-1, keepdims=True)
    ds = (p.astype(cp.float32) * (dp - delta)).astype(q.dtype)
    dq = (cp.matmul(ds, k) * scale).astype(q.dtype)
    dk = (cp.matmul(cp.swapaxes(ds, -1, -2), q) * scale).astype(q.dtype)
    return dq, dk, dv


def _make_naive_bwd(q, k, v, dout, causal, device):
    if device != "cuda":
        return None
    out, p = _naive_forward(q, k, v, causal)
    return (lambda: _naive_backward(q, k, v, dout, out, p)), BWD_FACTOR


def _make_naive_fwdbwd(q, k, v, dout, causal, device):
    if device != "cuda":
        return None

    def run():
        out, p = _naive_forward(q, k, v, causal)
        return _naive_backward(q, k, v, dout, out, p)
    return run, FWDBWD_FACTOR


def _make_torch(flash_attn):
    def make(q, k, v, dout, causal, device):
        torch = fwd_bench._torch()
        if torch is None or device != "cuda":
            return None
        if causal and q.shape[-2] != k.shape[-2]:
            return None  # torch's causal masks are top-left aligned
        tq, tk, tv, tdo = (torch.as_tensor(x, device="cuda") for x in (q, k, v, dout))
        if flash_attn:
            try:
                from flash_attn import flash_attn_func
            except ImportError:
                return None
            tq, tk, tv, tdo = (x.transpose(1, 2).contiguous() for x in (tq, tk, tv, tdo))
            fwd = lambda a, b, c: flash_attn_func(a, b, c, causal=causal)  # noqa: E731
        else:
            fwd = lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=causal)  # noqa: E731
        tq, tk, tv = (x.detach().requires_grad_() for x in (tq, tk, tv))
        out = fwd(tq, tk, tv)
        return (lambda: torch.autograd.grad(out, (tq, tk, tv), tdo, retain_graph=True)), BWD_FACTOR
    return make


IMPLS = {
    "flasharray-det": _make_flash_bwd(True),
    "flasharray-atomic": _make_flash_bwd(False),
    "flasharray-fwdbwd": _make_flash_fwdbwd,
    "cupy-naive": _make_naive_bwd,
    "cupy-naive-fwdbwd": _make_naive_fwdbwd,
    "torch-sdpa": _make_torch(False),
    "flash-attn": _make_torch(True),
}


def validate(q, k, v, dout, causal, device):
    """flasharray's gradients of the first batch entry / head vs the float64 reference."""
    host = (lambda x: x) if device == "emulator" else (lambda x: x.get())
    out, lse = _flash_state(q, k, v, causal, device)
    grads = cuda_backward.backward(dout, q, k, v, out, lse, causal=causal, scale=_scale(q),
                                   batch_shape=q.shape[:-2], device=device)
    first = lambda x: host(x)[:1, :1]  # noqa: E731
    return check_attention(first(out), first(q), first(k), first(v), causal=causal, scale=_scale(q),
                           dout=first(dout), grads=tuple(first(g) for g in grads))


def _inputs(xp, B, H, N, D, dtype):
    q, k, v = fwd_bench._inputs(xp, B, H, N, D, dtype)
    (dout,) = fwd_bench._inputs(xp, B, H, N, D, dtype, seed=1)[:1]
    return q, k, v, dout


def run_gpu(args):
    import cupy as cp
    rows = []
    seqlens = fwd_bench.SEQLENS[:3] if args.quick else fwd_bench.SEQLENS
    print("device: %s (sm_%s)" % (cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                                 cp.cuda.Device().compute_capability))
    print("%-32s | %-18s | %9s | %9s | %9s" % ("shape (B,H,N,D) dtype causal", "impl", "ms", "TFLOP/s", "peak MB"))
    print("-" * 92)
    for dt_name, dtype in fwd_bench.DTYPES.items():
        for D in fwd_bench.HEAD_DIMS:
            for causal in (False, True):
                for N in seqlens:
                    B, H = max(1, fwd_bench.TOKENS // N), fwd_bench.HIDDEN // D
                    q, k, v, dout = _inputs(cp, B, H, N, D, dtype)
                    shape = "(%d,%d,%d,%d) %s %s" % (B, H, N, D, dt_name, "causal" if causal else "")
                    report = validate(q, k, v, dout, causal, "cuda")
                    if not report.passed:
                        print("%-32s | flasharray validation FAILED\n%s" % (shape, report))
                        continue
                    for name, make in IMPLS.items():
                        try:
                            made = make(q, k, v, dout, causal, "cuda")
                            if made is None:
                                continue
                            fn, factor = made
                            ms = fwd_bench.time_gpu(fn)
                            mb = fwd_bench.peak_bytes(fn) / 1e6
                        except Exception as e:  # out of memory for materialized attention at large N, ...
                            print("%-32s | %-18s | %s" % (shape, name, type(e).__name__))
                            continue
                        tf = fwd_bench.flops(B, H, N, N, D, causal, factor) / (ms * 1e-3) / 1e12
                        rows.append((dt_name, D, causal, N, name, ms, tf, mb))
                        print("%-32s | %-18s | %9.3f | %9.1f | %9.1f" % (shape, name, ms, tf, mb))
                    del q, k, v, dout
                    cp.get_default_memory_pool().free_all_blocks()
    return rows


def run_emulator():
    """One tiny shape through the emulator: validates the kernels and this script's code path."""
    B, H, N, D = 1, 2, 128, 64
    print("emulator run (CPU time, not GPU performance): B=%d H=%d N=%d D=%d" % (B, H, N, D))
    print("%-32s | %-18s | %9s | %9s" % ("shape (B,H,N,D) dtype causal", "impl", "ms", "GFLOP/s"))
    ok = True
    for dt_name, dtype in fwd_bench.DTYPES.items():
        for causal in (False, True):
            q, k, v, dout = _inputs(np, B, H, N, D, dtype)
            report = validate(q, k, v, dout, causal, "emulator")
            ok &= report.passed
            shape = "(%d,%d,%d,%d) %s %s" % (B, H, N, D, dt_name, "causal" if causal else "")
            for name in ("flasharray-det", "flasharray-atomic", "flasharray-fwdbwd"):
                fn, factor = IMPLS[name](q, k, v, dout, causal, "emulator")
                fn()  # compile
                t0 = time.perf_counter()
                fn()
                ms = (time.perf_counter() - t0) * 1e3
                gf = fwd_bench.flops(B, H, N, N, D, causal, factor) / (ms * 1e-3) / 1e9
                print("%-32s | %-18s | %9.1f | %9.3f%s" % (shape, name, ms, gf, "" if report.passed else "  FAILED"))
    return ok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N up to 2048 only")
    ap.add_argument("--emulator", action="store_true", help="run a tiny shape on the CPU emulator")
    ap.add_argument("--plot", default=None, help="save a TFLOP/s plot to this file")
    args = ap.parse_args(argv)
    if args.emulator:
        return 0 if run_emulator() else 1
    if not fwd_bench.have_gpu():
        return 0
    rows = run_gpu(args)
    if args.plot and rows:
        fwd_bench.plot_tflops(rows, IMPLS, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
