"""3xtf32 vs ieee error against the DESIGN.md bound as N grows (fp32, D 64, one head), on the GPU."""
import numpy as np, cupy as cp
from flasharray._private import cuda_forward, cuda_backward
from flasharray.testing import check_attention
rng = np.random.default_rng(0)
for N in (512, 1024, 2048, 4096):
    q, k, v, do = (rng.standard_normal((1, 2, N, 64)).astype(np.float32) for _ in range(4))
    g = [cp.asarray(x) for x in (q, k, v, do)]
    for prec in ("3xtf32", "ieee"):
        kw = dict(causal=False, scale=0.125, batch_shape=(1, 2), device="cuda", precision=prec)
        out, lse = cuda_forward.forward(*g[:3], **kw)
        grads = cuda_backward.backward(g[3], *g[:3], out, lse, deterministic=True, **kw)
        r = check_attention(out, q, k, v, causal=False, scale=0.125, dout=do, grads=grads)
        print("N %5d %-6s %s" % (N, prec, "  ".join("%s %.2e/%.2e%s" % (c.name, c.max_abs_err, c.bound, "" if c.passed else "!")
                                                 for c in r.checks)), flush=True)
