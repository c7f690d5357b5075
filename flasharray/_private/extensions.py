"""The extension keywords of one call (docs/extensions.md), validated and normalised.

:class:`Extensions` is the one object every backend receives (``ext=``; ``None`` for a plain
dense call, which keeps the dense fast paths untouched). It has two parts:

* the **static** part — what a compiled plan depends on: ``dropout_p``, ``window``, ``softcap``,
  ``block_size``, which arrays are present, and the shapes/strides/dtypes of those arrays
  (``static_key()``; the api's call-signature cache keys on it);
* the **per-call values** — ``seed``, ``offset`` and the arrays ``block_mask``, ``alibi_slopes``,
  ``seqlens_q``, ``seqlens_k`` — which a cached plan takes at run time (a training loop changes
  ``offset`` every step without re-planning).

Normal forms (what backends may rely on):

* ``window``: ``(left, right)`` Python ints, −1 meaning unbounded, or None;
* ``softcap``: a positive Python float, or None; ``dropout_p``: Python float in [0, 1);
* ``seed``/``offset``: Python ints (seed None only when dropout_p == 0);
* ``block_mask``: bool array with exactly ``n`` batch dims (size-1 dims prepended: broadcast over
  the batch shape, no copy) then ``(ceil(Lq/Bq), ceil(Lk/Bk))``; ``block_size``: ``(Bq, Bk)``;
* ``alibi_slopes``: array of the accumulation dtype (float32; float64 for float64 inputs) with
  exactly ``n`` dims, broadcastable to the batch shape;
* ``seqlens_q``/``seqlens_k``: int32 arrays of shape ``(B,)`` (``B`` = first batch dim), on the
  device of q (NumPy for cpu/emulator, CuPy for cuda).

``n`` is the number of batch dims of the call (``len(batch_shape)``).
"""

KEYWORDS = ("dropout_p", "seed", "offset", "block_mask", "block_size", "window", "alibi_slopes",
            "softcap", "seqlens_q", "seqlens_k")
DEFAULT_BLOCK_SIZE = (128, 128)


class Extensions:
    """Validated extension keywords of one call; see the module docstring."""

    __slots__ = ("dropout_p", "seed", "offset", "block_mask", "block_size", "window", "alibi_slopes",
                 "softcap", "seqlens_q", "seqlens_k")

    def __init__(self, dropout_p=0.0, seed=None, offset=0, block_mask=None, block_size=DEFAULT_BLOCK_SIZE,
                 window=None, alibi_slopes=None, softcap=None, seqlens_q=None, seqlens_k=None):
        self.dropout_p, self.seed, self.offset = dropout_p, seed, offset
        self.block_mask, self.block_size = block_mask, tuple(block_size)
        self.window, self.alibi_slopes, self.softcap = window, alibi_slopes, softcap
        self.seqlens_q, self.seqlens_k = seqlens_q, seqlens_k

    @property
    def dropout(self):
        return self.dropout_p > 0.0

    def features(self):
        """The names of the features in use (for messages and kernel flags)."""
        names = []
        if self.dropout:
            names.append("dropout")
        if self.block_mask is not None:
            names.append("block_mask")
        if self.window is not None:
            names.append("window")
        if self.alibi_slopes is not None:
            names.append("alibi")
        if self.softcap is not None:
            names.append("softcap")
        if self.seqlens_q is not None or self.seqlens_k is not None:
            names.append("seqlens")
        return tuple(names)

    def static_key(self):
        """Hashable: everything but the per-call values (seed, offset, array contents/addresses)."""
        def sig(a):
            return None if a is None else (type(a), a.dtype, a.shape, a.strides)
        return (self.dropout_p, self.window, self.softcap, self.block_size,
                sig(self.block_mask), sig(self.alibi_slopes), sig(self.seqlens_q), sig(self.seqlens_k))

    def __repr__(self):
        return "Extensions(%s)" % ", ".join("%s=%r" % (f, getattr(self, f)) for f in self.features())
