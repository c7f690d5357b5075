"""Twentieth session, call 3: does the padded shared-memory row pitch (272 B at d 128) cost the cp.async copies
shared wavefronts and global sectors? Variants by FLASHARRAY_CUDA_SRC: A (HEAD), B (whole-chunk cp.async without a
src-size, .L2::128B), C (A with unpadded K / V rows in the forward, Q / K / V / dO in the backward)."""
import os, sys, time
import numpy as np
import cupy as cp
sys.path.insert(0, os.getcwd())
from flasharray._private import cuda_backward, cuda_forward
tag = sys.argv[1]
B, H, N, D = 4, 16, 4096, 128
rng = np.random.default_rng(0)
q, k, v, do = (cp.asarray(rng.standard_normal((B, H, N, D)).astype(np.float16)) for _ in range(4))
kw = dict(scale=D ** -0.5, batch_shape=(B, H), device="cuda")
fwd = lambda: cuda_forward.forward(q, k, v, causal=False, kernel="tensor_core", **kw)
out, lse = fwd()
bwd = lambda: cuda_backward.backward(do, q, k, v, out, lse, causal=False, deterministic=False, kernel="tc", **kw)
grads = bwd()
cp.cuda.Device().synchronize()
if os.environ.get("NCU"):
    cp.cuda.profiler.start(); fwd(); bwd(); cp.cuda.Device().synchronize(); cp.cuda.profiler.stop()
    sys.exit(0)
np.save("/tmp/exp_%s.npy" % tag, np.stack([a.get().astype(np.float32)[0, 0, :256] for a in (out,) + tuple(grads[:3])]))
def timed(f, reps=20):
    ts = []
    for _ in range(reps):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(); f(); e1.record(); e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1))
    return float(np.median(ts))
for _ in range(3): fwd(); bwd()
tf, tb = timed(fwd), timed(bwd)
fl = 4 * B * H * N * N * D
ref = np.load("/tmp/exp_A.npy") if os.path.exists("/tmp/exp_A.npy") else None
diff = None if ref is None else float(np.abs(np.load("/tmp/exp_%s.npy" % tag) - ref).max())
print("variant %s: fwd %.3f ms (%.0f TFLOP/s), bwd atomic %.3f ms (%.0f TFLOP/s), max |diff vs A| %s" % (
    tag, tf, fl / tf / 1e9, tb, 2.5 * fl / tb / 1e9, diff))
