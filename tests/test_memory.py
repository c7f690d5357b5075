"""The cpu backend never allocates anything of size Lq×Lk (tracemalloc sees NumPy's buffers)."""
import tracemalloc

import numpy as np

import flasharray as fa


def test_forward_backward_peak_memory_is_far_below_lq_lk():
    L, D = 8192, 64
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, L, D), dtype=np.float32) for _ in range(3))
    dout = rng.standard_normal((1, L, D), dtype=np.float32)
    tracemalloc.start()
    try:
        out, lse = fa.flash_attention_forward(q, k, v, causal=True)
        fa.flash_attention_backward(dout, q, k, v, out, lse, causal=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    lq_lk_bytes = L * L * 4  # one float32 score matrix: 256 MiB
    print("peak traced %.1f MiB vs one Lq×Lk float32 matrix %.0f MiB" % (peak / 2**20, lq_lk_bytes / 2**20))
    assert peak < lq_lk_bytes / 8
