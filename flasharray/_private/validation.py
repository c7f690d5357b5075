"""Argument checking at the public boundary: done once, with messages naming the argument."""
import math
import numbers

import numpy as np

from .dtypes import SUPPORTED_NAMES, canonical_dtype, is_supported, accumulation_dtype

BACKENDS = ("cpu", "cuda", "emulator")


def array_kind(x):
    """"numpy", "cupy", or None for anything that is not an array flasharray accepts."""
    if isinstance(x, np.ndarray):
        return "numpy"
    mod = type(x).__module__ or ""
    if mod.startswith("cupy") and type(x).__name__ == "ndarray":
        return "cupy"
    return None


def _describe(x):
    kind = array_kind(x)
    if kind is None:
        return type(x).__name__
    return "%s.ndarray of shape %s and dtype %s" % (kind, tuple(x.shape), _dtype_name(x.dtype))


def _dtype_name(dt):
    dt = canonical_dtype(dt)
    return "bfloat16" if dt.name in ("bfloat16",) else dt.name


def check_arrays(named):
    """Type checks for ``named``: a list of (argument name, value) that must be float arrays of
    one dtype and one array library. Returns (kind, dtype)."""
    kinds = {}
    for name, x in named:
        kind = array_kind(x)
        if kind is None:
            raise TypeError("flasharray: argument %r must be a numpy.ndarray or cupy.ndarray, got %s"
                            % (name, _describe(x)))
        if not is_supported(x.dtype):
            raise TypeError("flasharray: argument %r has dtype %s; supported dtypes are %s"
                            % (name, _dtype_name(x.dtype), SUPPORTED_NAMES))
        kinds[name] = kind
    if len(set(kinds.values())) > 1:
        desc = ", ".join("%s is %s" % (n, k) for n, k in kinds.items())
        raise TypeError("flasharray: cannot mix NumPy and CuPy arrays (%s); move them to one "
                        "library first" % desc)
    dtypes = {name: canonical_dtype(x.dtype) for name, x in named}
    first_name, first = named[0][0], dtypes[named[0][0]]
    for name, dt in dtypes.items():
        if dt != first:
            raise TypeError("flasharray: %s and %s must share one dtype, got %s and %s (cast them "
                            "explicitly)" % (first_name, name, _dtype_name(first), _dtype_name(dt)))
    return next(iter(kinds.values())), first


def check_qkv(q, k, v):
    """Shape checks for q, k, v. Returns the broadcast batch shape."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim < 2:
            raise ValueError("flasharray: argument %r must have at least 2 dims (..., L, D), got "
                             "shape %s" % (name, tuple(x.shape)))
    if q.shape[-1] != k.shape[-1]:
        raise ValueError("flasharray: q and k must have the same head dim D (last axis), got "
                         "q.shape=%s and k.shape=%s" % (tuple(q.shape), tuple(k.shape)))
    if k.shape[-2] != v.shape[-2]:
        raise ValueError("flasharray: k and v must have the same number of keys Lk (axis -2), got "
                         "k.shape=%s and v.shape=%s" % (tuple(k.shape), tuple(v.shape)))
    try:
        return tuple(np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    except ValueError:
        raise ValueError("flasharray: the batch dims of q, k and v do not broadcast together: "
                         "q.shape=%s, k.shape=%s, v.shape=%s (leading dims follow NumPy "
                         "broadcasting; for GQA use q (B, Hk, G, L, D) with k (B, Hk, 1, L, D))"
                         % (tuple(q.shape), tuple(k.shape), tuple(v.shape))) from None


def check_expected_shape(name, x, shape):
    if tuple(x.shape) != tuple(shape):
        raise ValueError("flasharray: argument %r must have shape %s (from q, k, v), got %s"
                         % (name, tuple(shape), tuple(x.shape)))


def check_lse(lse, kind, dtype, shape):
    if array_kind(lse) is None:
        raise TypeError("flasharray: argument 'lse' must be a numpy.ndarray or cupy.ndarray, got %s"
                        % _describe(lse))
    if array_kind(lse) != kind:
        raise TypeError("flasharray: cannot mix NumPy and CuPy arrays (q is %s, lse is %s)"
                        % (kind, array_kind(lse)))
    if canonical_dtype(lse.dtype) not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError("flasharray: argument 'lse' must be float32 or float64 (%s for %s inputs), "
                        "got %s" % (accumulation_dtype(dtype).name, _dtype_name(dtype),
                                    _dtype_name(lse.dtype)))
    check_expected_shape("lse", lse, shape)


def check_scale(scale, D):
    """Default ``1/sqrt(D)``; otherwise a finite positive real number."""
    if scale is None:
        return 1.0 / math.sqrt(D) if D > 0 else 1.0
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError("flasharray: argument 'scale' must be a real number or None, got %s"
                        % type(scale).__name__)
    s = float(scale)
    if not math.isfinite(s) or s <= 0:
        raise ValueError("flasharray: argument 'scale' must be finite and positive, got %r" % scale)
    return s


def check_flag(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError("flasharray: argument %r must be a bool, got %s" % (name, type(value).__name__))
    return bool(value)


def check_backend(backend, kind):
    """Resolve ``backend`` (None picks by array type) and check it suits the arrays."""
    if backend is None:
        return "cuda" if kind == "cupy" else "cpu"
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError("flasharray: unknown backend %r; choose one of %s or None (pick by array "
                         "type)" % (backend, ", ".join(map(repr, BACKENDS))))
    needs = "cupy" if backend == "cuda" else "numpy"
    if kind != needs:
        raise TypeError("flasharray: backend=%r needs %s arrays, got %s arrays"
                        % (backend, "CuPy" if needs == "cupy" else "NumPy",
                           "CuPy" if kind == "cupy" else "NumPy"))
    return backend


def check_int32_array(name, x, kind, ndim):
    """An int32 index array (``cache_seqlens``, ``block_table``) of ``ndim`` dims from the array
    library ``kind`` of q. Shapes beyond the rank are checked by the caller."""
    if array_kind(x) is None:
        raise TypeError("flasharray: argument %r must be a numpy.ndarray or cupy.ndarray of int32, "
                        "got %s" % (name, _describe(x)))
    if array_kind(x) != kind:
        raise TypeError("flasharray: cannot mix NumPy and CuPy arrays (q is %s, %s is %s)"
                        % (kind, name, array_kind(x)))
    if np.dtype(x.dtype) != np.int32:
        raise TypeError("flasharray: argument %r must have dtype int32, got %s (cast it with "
                        ".astype(numpy.int32))" % (name, np.dtype(x.dtype).name))
    if x.ndim != ndim:
        raise ValueError("flasharray: argument %r must have %d dim(s), got shape %s"
                         % (name, ndim, tuple(x.shape)))


def check_writeable(name, x):
    """A NumPy array the call writes into must not be read-only (CuPy arrays always are writable)."""
    flags = getattr(x, "flags", None)
    if isinstance(x, np.ndarray) and not flags.writeable:
        raise ValueError("flasharray: argument %r is read-only but k_new/v_new must be written into "
                         "it (pass a writable array, or no k_new/v_new)" % name)
