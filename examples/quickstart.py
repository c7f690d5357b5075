"""Quickstart: exact attention, its gradients, and a check against the reference.

Runs on a GPU through CuPy when one is visible (the hand-written CUDA kernels) and on the
CPU otherwise (the tiled NumPy backend); it prints which one it used.

    python examples/quickstart.py
"""
import time

import numpy as np

import flasharray as fa

# -- pick the array library: CuPy on a GPU, else NumPy -------------------------------------------
try:
    import cupy as xp
    if xp.cuda.runtime.getDeviceCount() == 0:
        raise RuntimeError("no CUDA device")
    dtype = np.float16
except Exception:  # no CuPy, or no device: the cpu backend
    xp = np
    dtype = np.float32
backend = "cuda" if xp is not np else "cpu"

# -- inputs: batch 2, 4 heads, 1024 queries and keys, head dim 64 --------------------------------
B, H, L, D = 2, 4, 1024, 64
rng = np.random.default_rng(0)
q, k, v = (xp.asarray(rng.standard_normal((B, H, L, D)).astype(dtype)) for _ in range(3))

# -- forward and backward ------------------------------------------------------------------------
t0 = time.perf_counter()
out, vjp = fa.flash_attention_vjp(q, k, v, causal=True)     # out: (B, H, L, D)
dout = xp.asarray(rng.standard_normal(out.shape).astype(dtype))
dq, dk, dv = vjp(dout)                                      # gradients, shapes of q, k, v
if xp is not np:
    xp.cuda.get_current_stream().synchronize()
elapsed = time.perf_counter() - t0

# -- validate against the float64 NumPy reference (DESIGN.md rule) -------------------------------
report = fa.testing.check_attention(out, q, k, v, causal=True, dout=dout, grads=(dq, dk, dv))
print("backend      : %s (%s)" % (backend, np.dtype(dtype).name))
print("shapes       : q, k, v %s -> out %s" % (tuple(q.shape), tuple(out.shape)))
print("max |error|  : out %.2e, dq %.2e, dk %.2e, dv %.2e (vs float64 reference)" % tuple(
    report[name].max_abs_err for name in ("out", "dq", "dk", "dv")))
print("within bound : %s" % report.passed)
print("time         : %.1f ms (forward + backward, first call)" % (elapsed * 1e3))
if not report.passed:
    raise SystemExit(str(report))
