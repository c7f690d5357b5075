"""Grouped-query (GQA) and multi-query (MQA) attention by NumPy broadcasting.

No special API: give K and V a size-1 axis where query heads share them. flasharray never
copies K/V per query head, and the gradients come back with K/V's own (smaller) shapes,
summed over the query heads of each group.

    python examples/gqa_broadcasting.py
"""
import numpy as np

import flasharray as fa
from flasharray import reference

rng = np.random.default_rng(0)
B, Hk, G, L, D = 2, 2, 4, 256, 64      # 2 KV heads, 4 query heads per KV head (8 query heads)

# -- GQA: q (B, Hk, G, L, D) against k, v (B, Hk, 1, L, D) ---------------------------------------
q = rng.standard_normal((B, Hk, G, L, D)).astype(np.float32)
k = rng.standard_normal((B, Hk, 1, L, D)).astype(np.float32)
v = rng.standard_normal((B, Hk, 1, L, D)).astype(np.float32)
out, lse = fa.flash_attention_forward(q, k, v, causal=True)
dout = rng.standard_normal(out.shape).astype(np.float32)
dq, dk, dv = fa.flash_attention_backward(dout, q, k, v, out, lse, causal=True)
print("GQA   q %s, k %s -> out %s; dk %s (summed over the %d query heads per group)"
      % (q.shape, k.shape, out.shape, dk.shape, G))

# The same numbers as repeating K and V explicitly for every query head ...
k_rep, v_rep = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
out_rep = fa.flash_attention(q, k_rep, v_rep, causal=True)
_, dk_rep, _ = fa.flash_attention_backward(dout, q, k_rep, v_rep, out_rep, lse, causal=True)
print("      equal to explicit repetition: out %s, dk %s" % (
    np.allclose(out, out_rep, atol=1e-6), np.allclose(dk, dk_rep.sum(axis=2, keepdims=True), atol=1e-4)))

# -- MQA: one K/V head for all query heads: k, v (B, 1, L, D) against q (B, H, L, D) -------------
q = rng.standard_normal((B, 8, L, D)).astype(np.float32)
k = rng.standard_normal((B, 1, L, D)).astype(np.float32)
v = rng.standard_normal((B, 1, L, D)).astype(np.float32)
out, vjp = fa.flash_attention_vjp(q, k, v)
dq, dk, dv = vjp(np.ones_like(out))
print("MQA   q %s, k %s -> out %s; dk %s, dv %s" % (q.shape, k.shape, out.shape, dk.shape, dv.shape))

# -- validate both against the float64 reference -------------------------------------------------
ref_dq, ref_dk, ref_dv = reference.attention_backward(np.ones_like(out), q, k, v)
print("      max |dk - reference| = %.2e, max |dv - reference| = %.2e"
      % (np.abs(dk - ref_dk).max(), np.abs(dv - ref_dv).max()))
fa.testing.assert_attention_close(out, q, k, v, dout=np.ones_like(out), grads=(dq, dk, dv))
print("      within the DESIGN.md bound: True")
