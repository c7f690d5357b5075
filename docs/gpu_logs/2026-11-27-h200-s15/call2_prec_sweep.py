"""3xtf32 vs ieee error against the DESIGN.md bound as N grows (fp32, one batch entry, 2 heads), on the GPU."""
import numpy as np, cupy as cp
from flasharray._private import cuda_forward, cuda_backward
from flasharray.testing import check_attention
rng = np.random.default_rng(0)
for D in (64, 128, 256):
    for N in (512, 2048, 4096):
        q, k, v, do = (rng.standard_normal((1, 2, N, D)).astype(np.float32) for _ in range(4))
        g = [cp.asarray(x) for x in (q, k, v, do)]
        for causal in (False, True):
            for prec in ("3xtf32", "ieee"):
                kw = dict(causal=causal, scale=D ** -0.5, batch_shape=(1, 2), device="cuda", precision=prec)
                try:
                    out, lse = cuda_forward.forward(*g[:3], **kw)
                    grads = cuda_backward.backward(g[3], *g[:3], out, lse, deterministic=True, **kw)
                    r = check_attention(out, q, k, v, causal=causal, scale=D ** -0.5, dout=do, grads=grads)
                    print("D %3d N %5d %-6s %-6s %s %s" % (D, N, "causal" if causal else "-", prec,
                          "ok  " if r.passed else "FAIL", "  ".join("%s %.2e/%.2e%s" % (c.name, c.max_abs_err, c.bound,
                          "" if c.passed else "!") for c in r.checks)), flush=True)
                except Exception as e:
                    print("D %3d N %5d %s %s: %s %s" % (D, N, causal, prec, type(e).__name__, str(e)[:120]), flush=True)
