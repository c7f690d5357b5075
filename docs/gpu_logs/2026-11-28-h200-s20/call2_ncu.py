"""Nsight Compute targets (twentieth session, call 2): the mma.sync kernels against FlashAttention-2's (PyTorch's flash
backend) at fp16 (4, 16, 4096, 128): the causal forward (128 x 64 tile), the backward non-causal in both dQ modes.
Each call warmed up (compiled) first; only the calls between cudaProfilerStart / Stop are profiled
(ncu --profile-from-start off)."""
import os
import sys

import cupy as cp
import numpy as np
import torch

sys.path.insert(0, os.getcwd())
from flasharray._private import cuda_backward, cuda_forward  # noqa: E402

B, H, N, D = 4, 16, 4096, 128
rng = np.random.default_rng(0)
q, k, v, do = (cp.asarray(rng.standard_normal((B, H, N, D)).astype(np.float16)) for _ in range(4))
kw = dict(scale=D ** -0.5, batch_shape=(B, H), device="cuda")


def ours_fwd(causal):
    return cuda_forward.forward(q, k, v, causal=causal, kernel="tensor_core", **kw)


def ours_bwd(deterministic, out, lse):
    return cuda_backward.backward(do, q, k, v, out, lse, causal=False, deterministic=deterministic, kernel="tc", **kw)


tq, tk, tv, tdo = (torch.from_dlpack(x).requires_grad_(True) for x in (q, k, v, do))


def fa2(causal):
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        o.backward(tdo)


out, lse = ours_fwd(False)
ours_fwd(True)
ours_bwd(False, out, lse)
ours_bwd(True, out, lse)
fa2(True)
fa2(False)
cp.cuda.Device().synchronize()
torch.cuda.synchronize()
cp.cuda.profiler.start()
ours_fwd(True)
ours_bwd(False, out, lse)
ours_bwd(True, out, lse)
fa2(True)     # its forward (causal) and backward (causal)
fa2(False)    # non-causal: the backward to compare
cp.cuda.Device().synchronize()
torch.cuda.synchronize()
cp.cuda.profiler.stop()
print("ncu target done")
