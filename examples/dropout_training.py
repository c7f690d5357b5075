"""Training one attention layer with attention dropout, gradients from ``flash_attention_vjp``.

A single-head self-attention layer ``y = attention(x Wq, x Wk, x Wv) Wo`` learns the causal running
mean of its inputs (``y_i = mean_{j<=i} x_j``: uniform attention over the prefix, ``Wv Wo = I``) by
plain gradient descent. Attention dropout
(p = 0.1) is fused into the kernel: the keep/drop bits come from a counter-based generator keyed
by ``seed`` and advanced by ``offset`` (the training step), so

* nothing of size L×L is stored: the backward regenerates the same mask from (seed, offset);
* ``flasharray.reference`` reproduces the exact mask, so a training step can be validated.

The chain rule through the projections is written by hand (NumPy matmuls): flasharray gives the
attention's vector-Jacobian product, the rest is ordinary array code.

    python examples/dropout_training.py
"""
import numpy as np

import flasharray as fa
from flasharray import reference

rng = np.random.default_rng(0)
B, L, D_MODEL, D_HEAD = 8, 64, 32, 32
P_DROP, SEED, STEPS, LR = 0.1, 1234, 200, 2.0


def batch():
    """Random token embeddings and the target: their causal running mean."""
    x = rng.standard_normal((B, L, D_MODEL)).astype(np.float32)
    y = np.cumsum(x, axis=1) / np.arange(1, L + 1, dtype=np.float32)[:, None]
    return x, y


W = {name: (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)
     for name, shape in (("q", (D_MODEL, D_HEAD)), ("k", (D_MODEL, D_HEAD)), ("v", (D_MODEL, D_HEAD)),
                         ("o", (D_HEAD, D_MODEL)))}


def step(x, y, offset):
    """One forward + backward; returns the loss and the weight gradients."""
    q, k, v = x @ W["q"], x @ W["k"], x @ W["v"]
    a, vjp = fa.flash_attention_vjp(q, k, v, causal=True, dropout_p=P_DROP, seed=SEED, offset=offset)
    pred = a @ W["o"]
    err = pred - y
    loss = float((err ** 2).mean())
    d_pred = 2.0 * err / err.size
    da = d_pred @ W["o"].T
    dq, dk, dv = vjp(da)                       # regenerates the dropout mask of this step
    grads = {"o": np.einsum("bld,blm->dm", a, d_pred),
             "q": np.einsum("blm,bld->md", x, dq), "k": np.einsum("blm,bld->md", x, dk),
             "v": np.einsum("blm,bld->md", x, dv)}
    return loss, grads


losses = []
for t in range(STEPS):
    x, y = batch()
    loss, grads = step(x, y, offset=t)         # a new dropout mask every step
    for name in W:
        W[name] -= LR * grads[name]
    losses.append(loss)
    if t % 40 == 0 or t == STEPS - 1:
        print("step %3d  loss %.4f" % (t, loss))
print("loss fell from %.4f to %.4f: %s" % (losses[0], losses[-1], losses[-1] < 0.5 * losses[0]))
assert losses[-1] < 0.5 * losses[0], "training did not converge"

# -- the kernel's dropout is the reference's, bit for bit -----------------------------------------
x, _ = batch()
q, k, v = x @ W["q"], x @ W["k"], x @ W["v"]
out = fa.flash_attention(q, k, v, causal=True, dropout_p=P_DROP, seed=SEED, offset=7)
ref = reference.attention(q, k, v, causal=True, dropout_p=P_DROP, seed=SEED, offset=7)
mask = reference.dropout_mask((B,), L, L, P_DROP, SEED, offset=7)
print("dropout keeps %.3f of the entries (1 - p = %.3f); max |out - reference| = %.1e"
      % (mask.mean(), 1 - P_DROP, np.abs(out - ref).max()))
fa.testing.assert_attention_close(out, q, k, v, causal=True, dropout_p=P_DROP, seed=SEED, offset=7)
print("within the DESIGN.md bound with the same mask: True")
