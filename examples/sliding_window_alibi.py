"""Local attention: a sliding window with ALiBi position biases (Mistral/Longformer-style window,
BLOOM/MPT-style ALiBi), as used by long-context models.

``window=(left, right)`` lets query ``i`` see keys ``i - left .. i + right`` (bottom-right aligned
like ``causal``; −1 = unbounded); key tiles wholly outside the band are never read. ``alibi_slopes``
(one per head, broadcast over the batch like q/k/v) adds ``−slope · |i − j|`` to the scores, with
the geometric slopes of the ALiBi paper. Both run inside the kernel; nothing L×L is formed.

    python examples/sliding_window_alibi.py
"""
import numpy as np

import flasharray as fa
from flasharray import reference

rng = np.random.default_rng(0)
B, H, L, D, WINDOW = 2, 4, 1024, 64, 128


def alibi_slopes(n_heads):
    """ALiBi's slopes 2^(−8·h/H), h = 1..H (Press et al., 2022), for H a power of two."""
    return np.array([2.0 ** (-8.0 * h / n_heads) for h in range(1, n_heads + 1)], dtype=np.float32)


q, k, v = (rng.standard_normal((B, H, L, D)).astype(np.float32) for _ in range(3))
slopes = alibi_slopes(H)                       # (H,): broadcasts over the batch dims (B, H)
kw = dict(causal=True, window=(WINDOW - 1, 0), alibi_slopes=slopes)

out, lse = fa.flash_attention(q, k, v, return_lse=True, **kw)
print("q %s, causal window of %d keys, ALiBi slopes %s" % (q.shape, WINDOW, np.round(slopes, 4)))

# Keys outside every window do not matter: change the first half of the keys and values; only the
# rows whose window reaches into it may change.
k2, v2 = k.copy(), v.copy()
k2[..., : L // 2, :] = rng.standard_normal(k2[..., : L // 2, :].shape)
v2[..., : L // 2, :] = rng.standard_normal(v2[..., : L // 2, :].shape)
out2 = fa.flash_attention(q, k2, v2, **kw)
changed = np.flatnonzero(np.any(out2 != out, axis=(0, 1, 3)))
print("rows changed by editing keys [0, %d): %d .. %d (the window reaches back %d keys): %s"
      % (L // 2, changed.min(), changed.max(), WINDOW - 1,
         changed.max() == L // 2 + WINDOW - 2))
assert changed.max() == L // 2 + WINDOW - 2

# Gradients, and validation against the float64 reference with the same keywords.
dout = rng.standard_normal(out.shape).astype(np.float32)
dq, dk, dv = fa.flash_attention_backward(dout, q, k, v, out, lse, **kw)
ref = reference.attention(q, k, v, **kw)
print("max |out - reference| = %.1e" % np.abs(out - ref).max())
fa.testing.assert_attention_close(out, q, k, v, lse=lse, dout=dout, grads=(dq, dk, dv), **kw)
print("out, lse and gradients within the DESIGN.md bound: True")
