"""GPU backward throughput: flasharray's CUDA backward vs materialized attention, PyTorch and FlashAttention-2.

FLOPs counted as FlashAttention does: forward 4·B·H·Lq·Lk·D (×0.5 causal); the backward is 2.5×
that (five matrix products instead of two), forward + backward 3.5×. Shapes, validation, timing,
ratios and the table as benchmarks/gpu.py; ratios compare rows of the same kind (backward with
backward, forward + backward with forward + backward).

Rows (backward: time of the backward given the forward's saved state; fwdbwd: forward + backward):
  flasharray-det        cuda_backward.backward(deterministic=True): fp16/bf16 dQ by fp32 atomics
                        in key-block order (ordered), fp32/fp64 the separate dQ kernel
  flasharray-det-recompute  deterministic with the separate dQ kernel (dq="recompute": S, dP again)
  flasharray-atomic     cuda_backward.backward(deterministic=False): fp32 atomics for dQ, any order
  flasharray-mma-det, -mma-atomic   the same two with the mma.sync kernels forced (kernel "tensor_core"
                        forward, "tc" backward): on sm_90 the default rows run the wgmma kernels
  flasharray-fwdbwd     cuda_forward.forward + the deterministic backward
  flasharray-dropout-det, -dropout-det-recompute, -dropout-atomic   the three backward modes with
                        dropout (p 0.1; the forward's saved state with the same mask): fp16/bf16
                        ordered dQ with an extension against the recomputing dQ kernel it replaced
  flasharray-wgmma-det, -wgmma-atomic, -wgmma-fwdbwd   the same with kernel="wgmma": the Hopper
                        backward (flash_bwd_sm90.cu; fwdbwd also the Hopper forward), sm_90 only,
                        where it applies (fp16/bf16, D <= 256)
  cupy-naive            materialized attention keeping P from the forward, hand-derived backward:
                        dV = PᵀdO, dP = dO Vᵀ, dS = P∘(dP − rowsum(dO∘O)), dQ = dS K·s, dK = dSᵀQ·s
  cupy-naive-fwdbwd     its forward (S, P materialized) + that backward
  torch-*, flash-attn   autograd backward of gpu.py's PyTorch rows (SDPA flash, cuDNN, memory-
                        efficient and math backends; flash_attn_func), and the same with -fwdbwd

flasharray's gradients are validated on the first batch entry / head against the float64 reference
(DESIGN.md rule, 3× for gradients) before timing.
Without a GPU the script says so and exits 0; ``--emulator`` runs one tiny shape through the CUDA
emulator (validates the kernels and this script; CPU time, not GPU performance).
Usage: python benchmarks/gpu_backward.py [--quick] [--emulator] [--plot gpu_backward.png]
       [--dtypes fp16] [--head-dims 64,128] [--seqlens 1024,16384] [--causal both|no|yes]
       [--impls flasharray-det,torch-flash] [--validate-max-n 4096]   (as benchmarks/gpu.py)
"""
import argparse
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import gpu as fwd_bench  # noqa: E402  (benchmarks/gpu.py: shapes, driver, table, PyTorch rows)
from gpu import Impl  # noqa: E402
import numpy as np  # noqa: E402

from flasharray._private import cuda_backward, cuda_forward, extensions  # noqa: E402
from flasharray.testing import check_attention  # noqa: E402

BWD_FACTOR = 2.5
FWDBWD_FACTOR = 3.5
FLASHARRAY = ("flasharray-det", "flasharray-det-recompute", "flasharray-atomic", "flasharray-fwdbwd",
              "flasharray-dropout-det", "flasharray-dropout-det-recompute", "flasharray-dropout-atomic")
WGMMA = ("flasharray-wgmma-det", "flasharray-wgmma-atomic", "flasharray-wgmma-fwdbwd")  # sm_90 GPUs only
#: the mma.sync kernels forced (kernel "tensor_core" forward, "tc" backward): on sm_90 the default is wgmma
MMA = ("flasharray-mma-det", "flasharray-mma-atomic")


# ---- implementations: make((q, k, v, dout), causal, device) -> callable or None ------------------

def _scale(q):
    return 1.0 / math.sqrt(q.shape[-1])


#: The dropout rows' keywords (docs/extensions.md): training's most common extension.
DROPOUT = dict(dropout_p=0.1, seed=1234, offset=0)


def _ext(q, k, ext_kw):
    """The kernels' Extensions for keywords ``ext_kw`` (None: the dense kernels)."""
    if not ext_kw:
        return None
    return extensions.from_options(ext_kw, kind="cupy" if type(q).__module__.startswith("cupy") else "numpy",
                                   batch_shape=q.shape[:-2], Lq=q.shape[-2], Lk=k.shape[-2], acc=np.dtype(np.float32))


def _flash_state(q, k, v, causal, device, ext_kw=None, kernel=None):
    return cuda_forward.forward(q, k, v, causal=causal, scale=_scale(q), batch_shape=q.shape[:-2],
                                device=device, ext=_ext(q, k, ext_kw), kernel=kernel)


def _flash_backward(q, k, v, dout, out, lse, causal, device, deterministic=True, dq=None, ext_kw=None, kernel=None):
    return cuda_backward.backward(dout, q, k, v, out, lse, causal=causal, scale=_scale(q),
                                  batch_shape=q.shape[:-2], device=device, deterministic=deterministic, dq=dq,
                                  ext=_ext(q, k, ext_kw), kernel=kernel)


def _make_flash_bwd(deterministic, dq=None, ext_kw=None, mma=False):
    """``mma``: the mma.sync kernels forced (forward "tensor_core", backward "tc")."""
    fwd_kernel, bwd_kernel = ("tensor_core", "tc") if mma else (None, None)

    def make(tensors, causal, device):
        q, k, v, dout = tensors
        out, lse = _flash_state(q, k, v, causal, device, ext_kw, fwd_kernel)
        return lambda: _flash_backward(q, k, v, dout, out, lse, causal, device, deterministic, dq, ext_kw, bwd_kernel)
    return make


def _make_flash_fwdbwd(tensors, causal, device):
    q, k, v, dout = tensors

    def run():
        out, lse = _flash_state(q, k, v, causal, device)
        return _flash_backward(q, k, v, dout, out, lse, causal, device)
    return run


def _wgmma_runs(tensors, causal, device):
    """The Hopper kernels (opt-in kernel="wgmma") on an sm_90 GPU: (out, lse) of the wgmma forward
    when its backward applies to these tensors, else None (another GPU, the emulator run, a dtype
    or head dim the wgmma backward refuses)."""
    if device != "cuda":
        return None
    import cupy as cp
    if int(cp.cuda.Device().compute_capability) != 90:
        return None
    q, k, v, dout = tensors
    try:
        out, lse = cuda_forward.forward(q, k, v, causal=causal, scale=_scale(q), batch_shape=q.shape[:-2],
                                        device=device, kernel="wgmma")
        _wgmma_backward(q, k, v, dout, out, lse, causal, device)   # plans it (refusals come here)
    except NotImplementedError:
        return None
    return out, lse


def _wgmma_backward(q, k, v, dout, out, lse, causal, device, deterministic=True):
    return cuda_backward.backward(dout, q, k, v, out, lse, causal=causal, scale=_scale(q), batch_shape=q.shape[:-2],
                                  device=device, deterministic=deterministic, kernel="wgmma")


def _make_wgmma_bwd(deterministic):
    def make(tensors, causal, device):
        state = _wgmma_runs(tensors, causal, device)
        if state is None:
            return None
        q, k, v, dout = tensors
        return lambda: _wgmma_backward(q, k, v, dout, *state, causal, device, deterministic)
    return make


def _make_wgmma_fwdbwd(tensors, causal, device):
    if _wgmma_runs(tensors, causal, device) is None:
        return None
    q, k, v, dout = tensors

    def run():
        out, lse = cuda_forward.forward(q, k, v, causal=causal, scale=_scale(q), batch_shape=q.shape[:-2],
                                        device=device, kernel="wgmma")
        return _wgmma_backward(q, k, v, dout, out, lse, causal, device)
    return run


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


def _make_naive(fwdbwd):
    def make(tensors, causal, device):
        if device != "cuda":
            return None
        q, k, v, dout = tensors
        fwd_bench.require_batched_matmul(q.dtype)
        if fwdbwd:
            return lambda: _naive_backward(q, k, v, dout, *fwd_bench.naive_forward(q, k, v, causal))
        out, p = fwd_bench.naive_forward(q, k, v, causal)
        return lambda: _naive_backward(q, k, v, dout, out, p)
    return make


def _make_torch(name, fwdbwd):
    def make(tensors, causal, device):
        made = fwd_bench.torch_attention(name, tensors, causal, device)
        if made is None:
            return None
        attend, (q, k, v, dout) = made
        grad = fwd_bench._torch().autograd.grad
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        if fwdbwd:
            return lambda: grad(attend(q, k, v), (q, k, v), dout)
        out = attend(q, k, v)
        return lambda: grad(out, (q, k, v), dout, retain_graph=True)
    return make


IMPLS = {
    "flasharray-det": Impl(_make_flash_bwd(True), "bwd", BWD_FACTOR),
    "flasharray-det-recompute": Impl(_make_flash_bwd(True, "recompute"), "bwd", BWD_FACTOR),
    "flasharray-atomic": Impl(_make_flash_bwd(False), "bwd", BWD_FACTOR),
    "flasharray-mma-det": Impl(_make_flash_bwd(True, mma=True), "bwd", BWD_FACTOR),
    "flasharray-mma-atomic": Impl(_make_flash_bwd(False, mma=True), "bwd", BWD_FACTOR),
    "flasharray-fwdbwd": Impl(_make_flash_fwdbwd, "fwdbwd", FWDBWD_FACTOR),
    "flasharray-dropout-det": Impl(_make_flash_bwd(True, ext_kw=DROPOUT), "bwd", BWD_FACTOR),
    "flasharray-dropout-det-recompute": Impl(_make_flash_bwd(True, "recompute", DROPOUT), "bwd", BWD_FACTOR),
    "flasharray-dropout-atomic": Impl(_make_flash_bwd(False, ext_kw=DROPOUT), "bwd", BWD_FACTOR),
    "flasharray-wgmma-det": Impl(_make_wgmma_bwd(True), "bwd", BWD_FACTOR),
    "flasharray-wgmma-atomic": Impl(_make_wgmma_bwd(False), "bwd", BWD_FACTOR),
    "flasharray-wgmma-fwdbwd": Impl(_make_wgmma_fwdbwd, "fwdbwd", FWDBWD_FACTOR),
    "cupy-naive": Impl(_make_naive(False), "bwd", BWD_FACTOR),
    "cupy-naive-fwdbwd": Impl(_make_naive(True), "fwdbwd", FWDBWD_FACTOR),
}
for _name, (_, _role) in fwd_bench.TORCH_ROWS.items():
    IMPLS[_name] = Impl(_make_torch(_name, False), "bwd", BWD_FACTOR, _role)
    IMPLS[_name + "-fwdbwd"] = Impl(_make_torch(_name, True), "fwdbwd", FWDBWD_FACTOR, _role)


def check(name, grads, tensors, causal, device):
    """flasharray's gradients (first batch entry / head) vs the float64 reference; None for the
    other rows (PyTorch and the naive baseline are trusted)."""
    if name not in FLASHARRAY + WGMMA + MMA:
        return None
    q, k, v, dout = tensors
    ext_kw = DROPOUT if "-dropout-" in name else {}
    out, _ = _flash_state(q, k, v, causal, device, ext_kw, "tensor_core" if name in MMA else None)
    first = lambda x: x[:1, :1]  # noqa: E731  (the dropout mask of entry (0, 0) is the same for the slice)
    return check_attention(first(out), first(q), first(k), first(v), causal=causal, scale=_scale(q),
                           dout=first(dout), grads=tuple(first(g) for g in grads), **ext_kw)


def _make_tensors(xp, B, H, N, D, dtype, copy=0):
    """q, k, v and the cotangent dout; ``copy`` picks the seeds."""
    q, k, v = fwd_bench.inputs(xp, B, H, N, D, dtype, seed=2 * copy)
    (dout,) = fwd_bench.inputs(xp, B, H, N, D, dtype, seed=2 * copy + 1, count=1)
    return q, k, v, dout


def main(argv=None, known_impls=None):
    """``known_impls``: the row names ``--impls`` may give (default: this table's; gpu.py --backward
    passes both tables' names)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N up to 2048 only")
    ap.add_argument("--emulator", action="store_true", help="run a tiny shape on the CPU emulator")
    ap.add_argument("--plot", default=None, help="save a TFLOP/s plot to this file")
    fwd_bench.add_selection_args(ap)
    args = ap.parse_args(argv)
    select = fwd_bench.selection_from(ap, args, known_impls or IMPLS)
    if args.emulator:
        return 0 if fwd_bench.run_emulator(IMPLS, FLASHARRAY, _make_tensors, check) else 1
    if not fwd_bench.have_gpu():
        return 0
    rows = fwd_bench.run_gpu(IMPLS, _make_tensors, check, select)
    if args.plot and rows:
        fwd_bench.plot_tflops(rows, IMPLS, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
