"""Token-by-token decoding with a KV cache: a tiny random-weight transformer.

Three layers, 4 query heads sharing 2 KV heads (GQA), greedy decoding of two sequences. The prompt
goes through in one call (prefill: Lq = L_new = prompt length), then every step feeds one token:
``flash_attention_with_kvcache`` appends its key and value to each layer's cache in place and
attends over everything cached so far. Each step's logits are checked against running the whole
model again over all tokens with plain causal ``flash_attention`` (no cache).

    python examples/decode.py                  # NumPy arrays, cpu backend
    python examples/decode.py --paged          # a paged cache (pages of 16 rows, shuffled)
    python examples/decode.py --device cuda    # CuPy arrays, cuda backend (contiguous cache)
"""
import argparse

import numpy as np

import flasharray as fa

VOCAB, LAYERS, H_KV, G, HEAD_DIM = 96, 3, 2, 2, 16
D_MODEL = H_KV * G * HEAD_DIM            # 64: the 4 query heads side by side
B, PROMPT, STEPS, PAGE = 2, 7, 12, 16
MAX_LEN = 32                            # cache capacity per sequence (PROMPT + STEPS <= MAX_LEN)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--paged", action="store_true", help="paged KV cache (cpu backend)")
    return p.parse_args()


def array_module(device):
    """NumPy, or CuPy when asked for and a GPU is visible (else NumPy, saying so)."""
    if device == "cuda":
        try:
            import cupy
            if cupy.cuda.runtime.getDeviceCount() > 0:
                return cupy
        except Exception as e:  # no CuPy, no driver
            print("no usable GPU (%s): falling back to NumPy and the cpu backend" % type(e).__name__)
        else:
            print("no GPU visible to CuPy: falling back to NumPy and the cpu backend")
    return np


# -- the model: pre-norm blocks of GQA attention and an MLP, learned positions ---------------------

def init_weights(xp, rng):
    def w(*shape):
        return xp.asarray((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32))
    layers = [dict(wq=w(D_MODEL, D_MODEL), wk=w(D_MODEL, H_KV * HEAD_DIM), wv=w(D_MODEL, H_KV * HEAD_DIM),
                   wo=w(D_MODEL, D_MODEL), w1=w(D_MODEL, 4 * D_MODEL), w2=w(4 * D_MODEL, D_MODEL))
              for _ in range(LAYERS)]
    return dict(embed=w(VOCAB, D_MODEL) * 8, pos=w(MAX_LEN, D_MODEL) * 8, layers=layers)


def rms_norm(x):
    return x / (x * x).mean(axis=-1, keepdims=True) ** 0.5


def model(xp, weights, tokens, start, attend):
    """Logits (B, T, VOCAB) of tokens (B, T) at positions start … start+T-1.

    ``attend(layer, q, k, v)`` gets q (B, H_KV, G, T, HEAD_DIM) and the chunk's own k, v
    (B, H_KV, T, HEAD_DIM) and returns the attention output shaped like q.
    """
    T = tokens.shape[1]
    x = weights["embed"][tokens] + weights["pos"][start:start + T]
    for i, lw in enumerate(weights["layers"]):
        h = rms_norm(x)
        q = (h @ lw["wq"]).reshape(B, T, H_KV, G, HEAD_DIM).transpose(0, 2, 3, 1, 4)
        k = (h @ lw["wk"]).reshape(B, T, H_KV, HEAD_DIM).transpose(0, 2, 1, 3)
        v = (h @ lw["wv"]).reshape(B, T, H_KV, HEAD_DIM).transpose(0, 2, 1, 3)
        a = attend(i, xp.ascontiguousarray(q), xp.ascontiguousarray(k), xp.ascontiguousarray(v))
        x = x + a.transpose(0, 3, 1, 2, 4).reshape(B, T, D_MODEL) @ lw["wo"]
        x = x + xp.maximum(rms_norm(x) @ lw["w1"], 0) @ lw["w2"]
    return rms_norm(x) @ weights["embed"].T


# -- the KV cache: per layer (B, H_KV, MAX_LEN, HEAD_DIM), or a pool of pages and a block table -----

class KVCache:
    def __init__(self, xp, paged, rng):
        self.seqlens = xp.zeros(B, dtype=np.int32)       # advanced by us after each step
        self.block_table = None
        if paged:
            per_seq = MAX_LEN // PAGE
            pages = rng.permutation(B * per_seq).reshape(B, per_seq)   # any page, any order
            self.block_table = xp.asarray(pages.astype(np.int32))
            shape = (B * per_seq, H_KV, PAGE, HEAD_DIM)
        else:
            shape = (B, H_KV, MAX_LEN, HEAD_DIM)
        self.k = [xp.zeros(shape, np.float32) for _ in range(LAYERS)]
        self.v = [xp.zeros(shape, np.float32) for _ in range(LAYERS)]

    def attend(self, layer, q, k_new, v_new):
        """Append k_new, v_new to this layer's cache and attend over all cached tokens."""
        return fa.flash_attention_with_kvcache(q, self.k[layer], self.v[layer], self.seqlens,
                                               k_new=k_new, v_new=v_new, block_table=self.block_table,
                                               causal=True)


def full_attention(layer, q, k, v):
    """No cache: causal attention of every token over all of them (GQA by broadcasting)."""
    return fa.flash_attention(q, k[:, :, None], v[:, :, None], causal=True)


def main():
    args = parse_args()
    xp = array_module(args.device)
    if args.paged and xp is not np:
        raise SystemExit("a paged cache needs the cpu backend today (the CUDA kernels do not read pages yet)")
    rng = np.random.default_rng(0)
    weights = init_weights(xp, rng)
    tokens = xp.asarray(rng.integers(0, VOCAB, size=(B, PROMPT)))
    cache = KVCache(xp, args.paged, rng)

    def check(logits):
        """max |logits - the same model run over all tokens without a cache| (last position)."""
        recomputed = model(xp, weights, tokens, 0, full_attention)[:, -1]
        return float(abs(logits - recomputed).max())

    # -- prefill: the whole prompt in one call per layer (Lq = L_new = PROMPT) ----------------------
    logits = model(xp, weights, tokens, 0, cache.attend)[:, -1]
    cache.seqlens += PROMPT                 # flash_attention_with_kvcache never advances it
    worst = check(logits)
    for _ in range(STEPS):
        # -- decode: greedy next token, then that one token through the model with the cache -------
        nxt = logits.argmax(axis=-1)[:, None]
        tokens = xp.concatenate([tokens, nxt], axis=1)
        logits = model(xp, weights, nxt, tokens.shape[1] - 1, cache.attend)[:, -1]
        cache.seqlens += 1
        worst = max(worst, check(logits))

    backend = "cuda" if xp is not np else "cpu"
    print("backend                : %s (float32), %s cache" % (backend, "paged" if args.paged else "contiguous"))
    print("model                  : %d layers, %d query heads on %d KV heads, head dim %d"
          % (LAYERS, H_KV * G, H_KV, HEAD_DIM))
    print("decoded                : %d sequences, %d prompt + %d new tokens; cache_seqlens now %s"
          % (B, PROMPT, STEPS, list(map(int, cache.seqlens))))
    print("first sequence         : %s" % list(map(int, tokens[0])))
    print("max |logits - full|    : %.2e over the prefill and %d decode steps" % (worst, STEPS))
    ok = worst < 1e-3
    print("matches full recompute : %s" % ok)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
