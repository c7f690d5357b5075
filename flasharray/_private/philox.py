"""Philox4x32-10 (Salmon et al., SC'11, "Parallel random numbers: as easy as 1, 2, 3") and the
dropout mask built from it — the NumPy twin of ``cuda_src/flash_philox.cuh``.

Dropout's keep/drop bits are a pure function of (seed, offset, batch entry, row, column), the same
on every backend, so ``flasharray.reference`` reproduces a kernel's mask exactly:

* key     ``(seed mod 2**32, seed >> 32)``                          (``seed`` in [0, 2**64))
* counter ``(j >> 3, i, bh, offset)``                               (all uint32)
  ``bh``: the flat (C-order) index of the batch entry in the broadcast batch shape of ``out``;
  ``i``, ``j``: the query row and key column (positions in the padded arrays);
* the 4 output words give 8 uint16 values for the columns ``8·(j >> 3) .. + 7``: column ``j`` takes
  bits ``16·(j & 1) ..`` of word ``(j & 7) >> 1``;
* kept iff that value ``>= threshold(p) = min(round(p·65536), 65535)``; kept entries of P are
  scaled by ``1 / (1 − p)``.

The drop probability is therefore ``threshold / 65536`` (``p`` to within 2**-17).
"""
import numpy as np

M0, M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
W0, W1 = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10
_MASK32 = np.uint64(0xFFFFFFFF)
_U32 = np.uint64(32)


def philox4x32(counter, key, rounds=ROUNDS):
    """Philox4x32-``rounds`` of ``counter`` (4 uint32 arrays, broadcast together) under ``key``
    (two Python ints < 2**32). Returns the 4 output words as uint32 arrays."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in counter)
    k0, k1 = int(key[0]) & 0xFFFFFFFF, int(key[1]) & 0xFFFFFFFF
    for r in range(rounds):
        p0, p1 = M0 * c0, M1 * c2  # exact: both factors < 2**32
        hi0, lo0 = p0 >> _U32, p0 & _MASK32
        hi1, lo1 = p1 >> _U32, p1 & _MASK32
        c0, c1, c2, c3 = hi1 ^ c1 ^ np.uint64(k0), lo1, hi0 ^ c3 ^ np.uint64(k1), lo0
        if r + 1 < rounds:
            k0, k1 = (k0 + W0) & 0xFFFFFFFF, (k1 + W1) & 0xFFFFFFFF
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


def threshold(p):
    """The uint16 drop threshold of dropout probability ``p`` in [0, 1)."""
    return min(int(round(float(p) * 65536.0)), 65535)


def check_seed(seed, offset):
    """``(seed, offset)`` as Python ints, or TypeError/ValueError naming the argument."""
    out = []
    for name, x, bits in (("seed", seed, 64), ("offset", offset, 32)):
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
            raise TypeError("flasharray: %s must be an int, got %r" % (name, x))
        if not 0 <= int(x) < 2 ** bits:
            raise ValueError("flasharray: %s must be in [0, 2**%d), got %r" % (name, bits, x))
        out.append(int(x))
    return tuple(out)


def uniform16(seed, offset, bh, rows, cols):
    """The uint16 random values of entries (bh, rows, cols) (integer arrays, broadcast together)."""
    seed, offset = check_seed(seed, offset)
    bh, rows, cols = np.broadcast_arrays(*(np.asarray(x, dtype=np.uint64) for x in (bh, rows, cols)))
    words = philox4x32((cols >> np.uint64(3), rows, bh, np.full(cols.shape, offset, np.uint64)),
                       (seed & 0xFFFFFFFF, seed >> 32))
    w = np.stack(words)  # (4, ...)
    sel = ((cols & np.uint64(7)) >> np.uint64(1)).astype(np.intp)
    word = np.take_along_axis(w, sel[None], axis=0)[0]
    return ((word >> ((cols & np.uint64(1)) * np.uint64(16)).astype(np.uint32)) & np.uint32(0xFFFF)).astype(np.uint16)


def keep_mask(p, seed, offset, batch_shape, Lq, Lk):
    """Boolean ``(*batch_shape, Lq, Lk)``: True where dropout keeps the entry of P."""
    nb = int(np.prod(batch_shape, dtype=np.int64))
    bh = np.arange(nb, dtype=np.uint64).reshape(batch_shape + (1, 1))
    rows = np.arange(Lq, dtype=np.uint64)[:, None]
    cols = np.arange(Lk, dtype=np.uint64)[None, :]
    return uniform16(seed, offset, bh, rows, cols) >= threshold(p)
