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

:func:`from_options` validates the keywords of one call (once, at the public boundary) and returns
an :class:`Extensions`, or None when every keyword has its default (the dense call).
:func:`options_key` is the hashable signature of the raw keywords the api's cache keys on: it
holds what :meth:`Extensions.static_key` depends on and leaves out ``seed``, ``offset`` and array
contents (validated and taken at every call).
"""
import math
import numbers

import numpy as np

from . import philox
from . import validation as val
from .dtypes import is_supported

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
        def show(x):
            return val._describe(x) if val.array_kind(x) is not None else repr(x)
        default = Extensions()
        fields = [f for f in self.__slots__ if getattr(self, f) is not getattr(default, f)
                  and show(getattr(self, f)) != show(getattr(default, f))]
        return "Extensions(%s)" % ", ".join("%s=%s" % (f, show(getattr(self, f))) for f in fields)


# ---- validation ----------------------------------------------------------------------------------

def _error(cls, name, what, value):
    return cls("flasharray: argument %r must be %s, got %s" % (name, what, _show(value)))


def _show(x):
    if val.array_kind(x) is not None:
        return val._describe(x)
    return repr(x) if isinstance(x, (int, float, str, tuple)) else "%r (%s)" % (x, type(x).__name__)


def _real(name, x, ok, what):
    """A Python float from a real number ``x`` for which ``ok(float(x))`` holds."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        raise _error(TypeError, name, "a real number", x)
    f = float(x)
    if not math.isfinite(f) or not ok(f):
        raise _error(ValueError, name, what, x)
    return f


def _int_pair(name, x, ok, what):
    """``(a, b)`` Python ints from a 2-sequence of ints each satisfying ``ok``."""
    if not isinstance(x, (tuple, list)) or len(x) != 2:
        raise _error(TypeError, name, "a pair of ints (%s)" % what, x)
    for e in x:
        if isinstance(e, (bool, np.bool_)) or not isinstance(e, (int, np.integer)):
            raise _error(TypeError, name, "a pair of ints (%s)" % what, x)
    if not all(ok(int(e)) for e in x):
        raise _error(ValueError, name, "a pair of ints (%s)" % what, x)
    return (int(x[0]), int(x[1]))


def _array(name, x, kind, what):
    """``x`` must be an array of the array library ``kind`` of q."""
    if val.array_kind(x) is None:
        raise _error(TypeError, name, "a numpy.ndarray or cupy.ndarray (%s)" % what, x)
    if val.array_kind(x) != kind:
        raise TypeError("flasharray: cannot mix NumPy and CuPy arrays (q is %s, %s is %s)"
                        % (kind, name, val.array_kind(x)))


def _batch_dims(name, x, batch_shape, tail):
    """``x.shape[:ndim - tail]`` must broadcast to ``batch_shape`` (without growing it)."""
    head = tuple(x.shape[:x.ndim - tail])
    try:
        ok = len(head) <= len(batch_shape) and np.broadcast_shapes(head, batch_shape) == tuple(batch_shape)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError("flasharray: the batch dims %s of argument %r (shape %s) do not broadcast to the "
                         "batch shape %s of the call" % (head, name, tuple(x.shape), tuple(batch_shape)))


def _check_dropout(o):
    p = _real("dropout_p", o.get("dropout_p", 0.0), lambda f: 0.0 <= f < 1.0, "a float in [0, 1)")
    seed, offset = o.get("seed"), o.get("offset", 0)
    offset = 0 if offset is None else offset
    if seed is None:
        if p > 0:
            raise ValueError("flasharray: dropout_p=%r needs a seed (an int in [0, 2**64)): the dropout "
                             "mask is a function of (seed, offset), pass the same to the backward" % p)
        philox.check_seed(0, offset)
        return p, None, int(offset)
    seed, offset = philox.check_seed(seed, offset)
    return p, seed, offset


def _check_block_mask(o, kind, batch_shape, Lq, Lk):
    block_size = _int_pair("block_size", o.get("block_size", DEFAULT_BLOCK_SIZE),
                           lambda b: b > 0 and b % 16 == 0, "positive multiples of 16")
    bm = o.get("block_mask")
    if bm is None:
        return None, block_size
    _array("block_mask", bm, kind, "of bool")
    if np.dtype(bm.dtype) != np.bool_:
        raise _error(TypeError, "block_mask", "a bool array", bm)
    grid = (-(-Lq // block_size[0]), -(-Lk // block_size[1]))
    if bm.ndim < 2 or tuple(bm.shape[-2:]) != grid:
        raise ValueError("flasharray: argument 'block_mask' must have shape (..., %d, %d) (ceil(Lq/Bq), "
                         "ceil(Lk/Bk)) for Lq=%d, Lk=%d, block_size=%s; got shape %s"
                         % (grid + (Lq, Lk, block_size, tuple(bm.shape))))
    _batch_dims("block_mask", bm, batch_shape, 2)
    return bm[(None,) * (len(batch_shape) + 2 - bm.ndim)], block_size


def _check_alibi(o, kind, batch_shape, acc):
    slopes = o.get("alibi_slopes")
    if slopes is None:
        return None
    _array("alibi_slopes", slopes, kind, "of float")
    if not is_supported(slopes.dtype):
        raise _error(TypeError, "alibi_slopes", "a float array", slopes)
    _batch_dims("alibi_slopes", slopes, batch_shape, 0)
    slopes = slopes.astype(acc, copy=False)
    return slopes[(None,) * (len(batch_shape) - slopes.ndim)]


def _check_seqlens(name, x, kind, batch_shape, L):
    if x is None:
        return None
    if not batch_shape:
        raise ValueError("flasharray: argument %r needs a batch dim (its length B is the first batch dim), "
                         "but q, k, v have none (shapes (L, D))" % name)
    val.check_int32_array(name, x, kind, 1)
    if tuple(x.shape) != (batch_shape[0],):
        raise ValueError("flasharray: argument %r must have shape (%d,) (the first batch dim of %s), got %s"
                         % (name, batch_shape[0], tuple(batch_shape), tuple(x.shape)))
    host = np.asarray(x.get() if kind == "cupy" else x)  # values are checked on the host
    bad = (host < 0) | (host > L)
    if bad.any():
        e = int(np.argmax(bad))
        raise ValueError("flasharray: argument %r must hold lengths in [0, %d], got %s[%d] = %d"
                         % (name, L, name, e, int(host[e])))
    return x


def from_options(options, *, kind, batch_shape, Lq, Lk, acc):
    """Validate the extension keywords of one call; an :class:`Extensions`, or None for the dense call.

    Parameters
    ----------
    options : dict
        Keyword -> value, keys among :data:`KEYWORDS` (missing keys take their defaults).
    kind : {"numpy", "cupy"}
        The array library of q (array arguments must share it).
    batch_shape : tuple
        The broadcast batch shape of the call; ``Lq``, ``Lk``: query and key lengths.
    acc : numpy.dtype
        The accumulation dtype (``alibi_slopes`` is converted to it).

    Raises ``TypeError`` / ``ValueError`` naming the argument and the value it got. Inputs are
    never modified (``block_mask`` and ``alibi_slopes`` come back as views where possible).
    """
    unknown = set(options) - set(KEYWORDS)
    if unknown:
        raise TypeError("flasharray: unexpected keyword argument %r" % sorted(unknown)[0])
    p, seed, offset = _check_dropout(options)
    block_mask, block_size = _check_block_mask(options, kind, batch_shape, Lq, Lk)
    window = options.get("window")
    if window is not None:
        window = _int_pair("window", window, lambda w: w >= -1, "left, right >= -1; -1 = unbounded")
        window = None if window == (-1, -1) else window
    softcap = options.get("softcap")
    if softcap is not None:
        softcap = _real("softcap", softcap, lambda f: f > 0, "a finite float > 0")
    ext = Extensions(dropout_p=p, seed=seed, offset=offset, block_mask=block_mask, block_size=block_size,
                     window=window, alibi_slopes=_check_alibi(options, kind, batch_shape, acc), softcap=softcap,
                     seqlens_q=_check_seqlens("seqlens_q", options.get("seqlens_q"), kind, batch_shape, Lq),
                     seqlens_k=_check_seqlens("seqlens_k", options.get("seqlens_k"), kind, batch_shape, Lk))
    return ext if ext.features() else None


def _value_key(name, x):
    if val.array_kind(x) is not None:
        return (type(x), x.dtype, x.shape, x.strides)
    return (type(x), tuple(x) if isinstance(x, list) else x)


def options_key(options):
    """Hashable signature of the raw extension keywords ``options`` for the api's call cache.

    Everything :meth:`Extensions.static_key` depends on (scalar values with their types, the
    type/dtype/shape/strides of arrays), nothing that changes per call without re-planning
    (``seed``, ``offset``, array contents). Raises ``TypeError`` when a value is unhashable.
    """
    key = tuple(sorted((n, _value_key(n, x)) for n, x in options.items() if n not in ("seed", "offset")))
    hash(key)
    return key
