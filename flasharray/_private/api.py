"""The public functions: validate once, normalise shapes, dispatch to a backend."""
import functools
import inspect

import numpy as np

from . import extensions
from . import validation as val
from .precision import check_precision
from .dtypes import accumulation_dtype
from .launch import host_address

# Keywords of the extensions (docs/extensions.md): validated by extensions.from_options and handed
# to the backends as one ``ext`` object (None for a dense call, which reaches them exactly as before).
_EXTENSIONS = frozenset(extensions.KEYWORDS)
# Options of the emulator backend (schedule of fibers between rendezvous, and its random seed).
_EMULATOR_OPTIONS = ("schedule", "schedule_seed")


def _split_options(options):
    """``(extension keywords, other options)`` of one call."""
    if not options or _EXTENSIONS.isdisjoint(options):
        return {}, options
    return ({n: x for n, x in options.items() if n in _EXTENSIONS},
            {n: x for n, x in options.items() if n not in _EXTENSIONS})


def _check_options(options, backend, forward=True, dtype=None):
    """The kernel options of the non-extension ``options`` (extension keywords are split off first).

    ``precision`` is validated for ``dtype`` (:func:`precision.check_precision`) and handed to the
    CUDA forward and backward when set; the cpu backend takes it and computes in IEEE arithmetic
    (docs/precision.md)."""
    kernel_opts = {}
    for name, value in options.items():
        if name == "precision":
            value = check_precision(value, dtype)
            if value is not None and backend != "cpu":
                kernel_opts[name] = value
            continue
        if name == "num_splits":  # split-KV of the CUDA forward (validated by cuda_forward.plan)
            if not forward:
                raise TypeError("flasharray: num_splits applies to the forward only (the backward has "
                                "no split-KV)")
            if value is not None:
                if backend == "cpu":
                    raise TypeError("flasharray: option 'num_splits' only applies to backend='cuda' or "
                                    "'emulator' (got backend='cpu'; use num_splits=None)")
                kernel_opts[name] = value
            continue
        if name in _EMULATOR_OPTIONS:
            if backend != "emulator":
                raise TypeError("flasharray: option %r only applies to backend='emulator' (got "
                                "backend=%r)" % (name, backend))
            kernel_opts["seed" if name == "schedule_seed" else name] = value
        else:
            raise TypeError("flasharray: unexpected keyword argument %r" % name)
    return kernel_opts


# Backend functions known to take ``ext=`` (by function object; the signature is read once).
_TAKES_EXT = {}


def _with_ext(fn, ext, backend):
    """``fn`` itself when ``ext`` is None (a dense call reaches the backend exactly as before the
    extensions existed); else ``fn`` with ``ext=ext`` bound, or NotImplementedError naming the
    features when that backend function does not take ``ext`` (yet)."""
    if ext is None:
        return fn
    f = getattr(fn, "__func__", fn)
    takes = _TAKES_EXT.get(f)
    if takes is None:
        takes = _TAKES_EXT[f] = "ext" in inspect.signature(f).parameters
    if not takes:
        raise NotImplementedError("flasharray: %s not implemented yet on backend=%r"
                                  % (", ".join(ext.features()), backend))
    return functools.partial(fn, ext=ext)


def _per_call(run, spec):
    """``run(*arrays, ext=)`` as ``run(*arrays, ext_options)``: a cached entry validates the extension
    keywords at every call (seed, offset and array contents change without re-planning)."""
    def run_with_options(*args):
        return run(*args[:-1], ext=extensions.from_options(args[-1], **spec))
    return run_with_options


def _xp(kind):
    if kind == "cupy":
        import cupy
        return cupy
    return np


def _with_batch_dims(x, n):
    """View of ``x`` with exactly ``n`` batch dims (size-1 dims prepended: broadcast, no copy)."""
    return x[(None,) * (n - (x.ndim - 2))]


def _cuda_module(name):
    try:
        if name == "forward":
            from . import cuda_forward as mod
        else:
            from . import cuda_backward as mod
    except ImportError as e:
        raise NotImplementedError(
            "flasharray: the CUDA %s kernels are not available in this build (%s)" % (name, e)) from None
    return mod


class _Problem:
    """Validated inputs of one attention call."""

    def __init__(self, q, k, v, causal, scale, backend, extra=()):
        kind, self.dtype = val.check_arrays([("q", q), ("k", k), ("v", v)] + list(extra))
        self.batch_shape = val.check_qkv(q, k, v)
        self.causal = val.check_flag("causal", causal)
        self.scale = val.check_scale(scale, q.shape[-1])
        self.backend = val.check_backend(backend, kind)
        self.kind, self.xp = kind, _xp(kind)
        n = len(self.batch_shape)
        self.q, self.k, self.v = (_with_batch_dims(x, n) for x in (q, k, v))
        self.Lq, self.Lk, self.Dv = q.shape[-2], k.shape[-2], v.shape[-1]
        self.acc = accumulation_dtype(self.dtype)

    def forget_arrays(self):
        """Drop the arrays (a cached problem must not keep the caller's memory alive)."""
        self.q = self.k = self.v = None

    def rebind(self, q, k, v):
        """This validated problem for other arrays of the same signature."""
        p = object.__new__(_Problem)
        p.__dict__.update(self.__dict__)
        n = len(self.batch_shape)
        p.q, p.k, p.v = (_with_batch_dims(x, n) for x in (q, k, v))
        return p

    def ext_spec(self):
        """The problem facts :func:`extensions.from_options` validates against."""
        return dict(kind=self.kind, batch_shape=self.batch_shape, Lq=self.Lq, Lk=self.Lk, acc=self.acc)

    @property
    def out_shape(self):
        return self.batch_shape + (self.Lq, self.Dv)

    @property
    def lse_shape(self):
        return self.batch_shape + (self.Lq,)


# ---- call-signature cache ------------------------------------------------------------------------
# A repeated call (same array types, dtypes, shapes, strides, alignment, device, flags, options)
# skips validation and planning: the entry made by the first call runs directly.

_CACHE = {}
_MAX_ENTRIES = 1024


def _array_key(a, backend):
    t = type(a)
    if t is np.ndarray:
        # 16-byte alignment picks the emulator's cp.async path; the cpu backend ignores it.
        return (a.dtype, a.shape, a.strides, host_address(a) % 16 if backend == "emulator" else None)
    if val.array_kind(a) == "cupy":
        data = a.data
        return (t, a.dtype, a.shape, a.strides, data.ptr % 16, data.device_id)
    raise TypeError  # not an array: the uncached path reports it


def _options_key(options):
    if not options:
        return ()
    ext, rest = _split_options(options)
    rest = tuple(sorted(rest.items()))
    return (rest, extensions.options_key(ext)) if ext else rest


def _call_key(kind, arrays, flags, backend, options):
    """Hashable signature of one call, or None when it cannot be cached (then validate fully).

    Flags enter with their types (``causal=1`` must still fail validation after a cached
    ``causal=True``); CuPy calls add the current device. Extension keywords enter by
    :func:`extensions.options_key` (what ``Extensions.static_key()`` depends on): seed, offset and
    array contents are not part of the key and reach the backend at every call.
    """
    try:
        key = (kind, backend, _options_key(options),
               tuple(map(type, flags)), flags, *[_array_key(a, backend) for a in arrays])
        if type(arrays[0]) is not np.ndarray:
            import cupy
            key += (cupy.cuda.runtime.getDevice(),)
        hash(key)
        return key
    except TypeError:
        return None


def _store(key, entry):
    """Keep ``entry`` for ``key`` (not when ``key`` is None); at most ``_MAX_ENTRIES`` kept."""
    if key is not None:
        if len(_CACHE) >= _MAX_ENTRIES:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = entry
    return entry


def _clear_cache():
    _CACHE.clear()


def _register_clear():
    from . import launch
    launch._on_reload.append(_clear_cache)


_register_clear()


def _forward_entry(q, k, v, causal, scale, backend, options):
    """Validate one forward call and return ``run(q, k, v) -> (out, lse)`` for its signature
    (``run(q, k, v, ext_options)`` when extension keywords were given)."""
    p = _Problem(q, k, v, causal, scale, backend)
    ext_opts, options = _split_options(options)
    opts = _check_options(options, p.backend, dtype=p.dtype)
    spec = p.ext_spec()
    ext = extensions.from_options(ext_opts, **spec) if ext_opts else None
    direct = not ext_opts and q.ndim == k.ndim == v.ndim == len(p.batch_shape) + 2
    run = _forward_runner(p, opts, ext, direct)
    return _per_call(run, spec) if ext_opts else run


def _forward_runner(p, opts, ext, direct):
    """``run(q, k, v, ext=None)`` for problem ``p``, planned with ``ext`` (or plan.run itself when
    ``direct``: a dense call whose arrays already have every batch dim)."""
    if p.Lq == 0 or p.Lk == 0 or p.backend == "cpu":
        p.forget_arrays()
        return lambda q, k, v, ext=None: _forward(p.rebind(q, k, v), opts, ext)
    plan = _with_ext(_cuda_module("forward").plan, ext, p.backend)(
        p.q, p.k, p.v, causal=p.causal, scale=p.scale, batch_shape=p.batch_shape, device=p.backend, **opts)
    if direct:
        return plan.run
    n = len(p.batch_shape)
    return lambda q, k, v, ext=None: _with_ext(plan.run, ext, p.backend)(*(_with_batch_dims(x, n)
                                                                           for x in (q, k, v)))


def _forward(p, opts, ext=None):
    if p.Lq == 0 or p.Lk == 0:
        # No queries: empty outputs. No keys: every row sees nothing (out = 0, lse = -inf).
        return (p.xp.zeros(p.out_shape, dtype=p.dtype),
                p.xp.full(p.lse_shape, -np.inf, dtype=p.acc))
    if p.backend == "cpu":
        from . import cpu
        return _with_ext(cpu.forward, ext, "cpu")(p.q, p.k, p.v, causal=p.causal, scale=p.scale,
                                                  batch_shape=p.batch_shape)
    return _with_ext(_cuda_module("forward").forward, ext, p.backend)(
        p.q, p.k, p.v, causal=p.causal, scale=p.scale, batch_shape=p.batch_shape, device=p.backend, **opts)


def flash_attention_forward(q, k, v, *, causal=False, scale=None, backend=None, **options):
    """Exact attention and its row log-sum-exp, without materialising the Lq×Lk matrices.

    Parameters
    ----------
    q : numpy.ndarray or cupy.ndarray, shape (..., Lq, D)
    k : array, shape (..., Lk, D)
    v : array, shape (..., Lk, Dv)
        One dtype for all three: float16, bfloat16 (``ml_dtypes.bfloat16``), float32 or
        float64. Leading (batch) dims broadcast by NumPy rules: MQA/GQA is
        ``q (B, Hk, G, L, D)`` against ``k, v (B, Hk, 1, L, D)``. Any strides.
    causal : bool, default False
        Bottom-right aligned causal mask: query ``i`` sees key ``j`` iff ``j <= i + Lk - Lq``.
    scale : float, optional
        Softmax scale (finite, > 0); default ``1/sqrt(D)``.
    backend : {None, "cpu", "cuda", "emulator"}
        ``None`` picks by array type (NumPy → "cpu", CuPy → "cuda"). "emulator" runs the CUDA
        kernels on the CPU emulator (NumPy arrays).
    dropout_p, seed, offset : float, int, int
        Dropout on P with probability ``dropout_p`` in [0, 1); the keep mask is Philox4x32-10 of
        ``(seed, offset, batch entry, row, column)`` (``reference.dropout_mask`` reproduces it);
        ``seed`` in [0, 2**64) is required when ``dropout_p > 0``, ``offset`` in [0, 2**32).
    block_mask, block_size : bool array ``(..., ceil(Lq/Bq), ceil(Lk/Bk))``, ``(Bq, Bk)``
        Block-sparse attention: tile ``(i // Bq, j // Bk)`` is seen only where True; batch dims
        broadcast to the batch shape; ``block_size`` positive multiples of 16, default (128, 128).
    window : (left, right) ints >= -1, optional
        Sliding window: key ``j`` visible to row ``i`` iff ``i+off-left <= j <= i+off+right``
        (``off = Lk - Lq``; -1 = unbounded on that side).
    alibi_slopes : float array broadcastable to the batch shape, optional
        ALiBi: ``s -= slope · |i + off - j|``.
    softcap : float > 0, optional
        ``s = softcap · tanh(s / softcap)`` (before ALiBi and masks).
    seqlens_q, seqlens_k : int32 arrays ``(B,)``, optional
        Valid lengths per entry of the first batch dim (padded batches); rows beyond get
        ``out = 0``, ``lse = -inf``; keys beyond are never read.
        All extension keywords follow ``docs/extensions.md`` exactly; a backend that does not
        implement one raises ``NotImplementedError``.
    **options
        ``schedule`` ("forward", "reverse", "random") and ``schedule_seed`` for the emulator.
        ``num_splits`` (cuda and emulator backends; forward only): split-KV, the key range of every
        query tile cut into this many runs processed by separate thread blocks and merged by
        log-sum-exp (decoding, where batch × heads leave most SMs idle). ``None`` (default):
        chosen from the GPU's SM count and the problem size; ``1``: no split; at most 256.
        Splitting runs on the float16/bfloat16 tensor-core kernel; on float32/float64 a count
        above 1 is a ``NotImplementedError``. The cpu backend accepts only ``None``.
        ``precision`` (float32 and float64; ``docs/precision.md``): ``None`` (the dtype's default),
        ``"ieee"`` (exact fp32 / fp64 arithmetic, the SIMT kernels), and for float32 ``"tf32"``
        (TF32 tensor cores, operands rounded to 10 mantissa bits: lower precision, opt-in) or
        ``"3xtf32"`` (each operand split into two tf32 parts, three tensor-core products: close
        to fp32). tf32/3xtf32 need sm_80 or newer (``NotImplementedError`` naming the arch;
        the emulator's arch is its compile target, sm_80); calls the TF32 kernel does not serve
        (head dims above 128, extensions, split-KV) run the SIMT kernel. The float32 default
        (``None``) on the CUDA backend: ``"3xtf32"`` for dense calls (no extensions, no KV cache)
        with D, Dv <= 128 on sm_80+ (it met the test rule and ran 1.9x ``"ieee"`` on an H200),
        ``"ieee"`` otherwise and for every backward. The cpu backend accepts every value and
        computes in IEEE fp32 / fp64. A value not applying to the dtype is a ``ValueError``.

    Returns
    -------
    out : array, shape (*batch, Lq, Dv), the input dtype
    lse : array, shape (*batch, Lq), float32 (float64 for float64 inputs); natural-log
        ``log Σ_j exp(scale·q_i·k_j)`` over visible keys, ``-inf`` for rows that see none.

    Notes
    -----
    Accumulation is float32 for float16/bfloat16/float32 inputs and float64 for float64.
    A row that sees no key has ``out = 0``. Inputs are never modified.
    """
    return _forward_call(q, k, v, causal, scale, backend, options)


def _forward_call(q, k, v, causal, scale, backend, options):
    key = _call_key("fwd", (q, k, v), (causal, scale), backend, options)
    run = _CACHE.get(key)
    if run is None:
        run = _store(key, _forward_entry(q, k, v, causal, scale, backend, options))
    ext_opts = _split_options(options)[0]
    return run(q, k, v, ext_opts) if ext_opts else run(q, k, v)


def flash_attention(q, k, v, *, causal=False, scale=None, return_lse=False, backend=None, **options):
    """Exact attention ``softmax(scale·QKᵀ) V`` (FlashAttention).

    Same parameters as :func:`flash_attention_forward`; returns ``out`` of shape
    ``(*batch, Lq, Dv)``, or ``(out, lse)`` when ``return_lse=True``.
    """
    if return_lse is not False and return_lse is not True:
        val.check_flag("return_lse", return_lse)
    out, lse = _forward_call(q, k, v, causal, scale, backend, options)
    return (out, lse) if return_lse else out


def flash_attention_backward(dout, q, k, v, out, lse, *, causal=False, scale=None, backend=None,
                             deterministic=True, **options):
    """Gradients of ``Σ dout ∘ attention(q, k, v)`` by FlashAttention's backward.

    P is recomputed tile by tile from the saved ``lse``; nothing of size Lq×Lk is stored.

    Parameters
    ----------
    dout : array, shape (*batch, Lq, Dv)
        Gradient of the loss with respect to ``out``; dtype of q.
    q, k, v : arrays as for :func:`flash_attention_forward`.
    out, lse : the outputs of :func:`flash_attention_forward` for the same q, k, v and options.
    causal, scale, backend : as for :func:`flash_attention_forward`; must match the forward call.
    dropout_p, seed, offset, block_mask, block_size, window, alibi_slopes, softcap, seqlens_q, seqlens_k
        The extension keywords of :func:`flash_attention_forward` (``docs/extensions.md``); they
        **must match the forward call** (the same seed and offset reproduce the dropout mask).
        Padded rows/keys and rows that see no key get zero gradients.
    deterministic : bool, default True
        CUDA backend: ``True`` gives bitwise-identical gradients run to run (dQ by atomics added in
        a fixed key-block order, with every extension; a separate dQ kernel for ALiBi above head dim
        128 on the fp16/bf16 mma.sync kernel); ``False`` accumulates dQ with atomics in any order
        (not bitwise reproducible). The cpu backend is always deterministic.
    precision : {None, "ieee", "tf32", "3xtf32"}
        Validated as for :func:`flash_attention_forward`. CUDA backend: float32 with "tf32" /
        "3xtf32" runs the TF32 tensor-core backward (sm_80+, head dims <= 128, no extensions;
        else the SIMT kernels); float64 (None / "ieee") the DMMA backward on sm_80+ under the same
        conditions; the cpu backend computes in IEEE arithmetic (docs/precision.md).

    Returns
    -------
    dq, dk, dv : arrays with exactly the shapes and dtype of q, k, v; for broadcast inputs
        (MQA/GQA) the gradient is summed over the broadcast dims. Rows that see no key
        contribute nothing.
    """
    arrays = (dout, q, k, v, out, lse)
    key = _call_key("bwd", arrays, (causal, scale, deterministic), backend, options)
    run = _CACHE.get(key)
    if run is None:
        run = _store(key, _backward_entry(arrays, causal, scale, backend, deterministic, options))
    ext_opts = _split_options(options)[0]
    return run(*arrays, ext_opts) if ext_opts else run(*arrays)


def _backward_entry(arrays, causal, scale, backend, deterministic, options):
    """Validate one backward call; return ``run(dout, q, k, v, out, lse) -> (dq, dk, dv)``
    (``run(..., lse, ext_options)`` when extension keywords were given)."""
    dout, q, k, v, out, lse = arrays
    p = _Problem(q, k, v, causal, scale, backend, extra=[("dout", dout), ("out", out)])
    val.check_expected_shape("dout", dout, p.out_shape)
    val.check_expected_shape("out", out, p.out_shape)
    val.check_lse(lse, p.kind, p.dtype, p.lse_shape)
    deterministic = val.check_flag("deterministic", deterministic)
    ext_opts, options = _split_options(options)
    opts = _check_options(options, p.backend, forward=False, dtype=p.dtype)
    spec = p.ext_spec()
    ext = extensions.from_options(ext_opts, **spec) if ext_opts else None
    p.forget_arrays()
    if p.Lq == 0 or p.Lk == 0:
        def run(dout, q, k, v, out, lse, ext=None):
            return tuple(p.xp.zeros(x.shape, dtype=p.dtype) for x in (q, k, v))
    else:
        plan = None
        if p.backend != "cpu":
            b = p.rebind(q, k, v)
            plan = _with_ext(_cuda_module("backward").plan, ext, p.backend)(
                dout, b.q, b.k, b.v, out, lse, causal=p.causal, scale=p.scale, batch_shape=p.batch_shape,
                device=p.backend, deterministic=deterministic, **opts)
            if not ext_opts and q.ndim == k.ndim == v.ndim == len(p.batch_shape) + 2:
                return plan.run  # gradients come back with exactly the shapes of q, k, v
        run = _backward_runner(p, plan)
    return _per_call(run, spec) if ext_opts else run


def _backward_runner(p, plan):
    """``run(dout, q, k, v, out, lse, ext=None)`` on the cpu backend or through ``plan``."""
    def run(dout, q, k, v, out, lse, ext=None):
        b = p.rebind(q, k, v)
        if p.backend == "cpu":
            from . import cpu
            dq, dk, dv = _with_ext(cpu.backward, ext, "cpu")(dout, b.q, b.k, b.v, out, lse, causal=p.causal,
                                                             scale=p.scale, batch_shape=p.batch_shape)
        else:
            dq, dk, dv = _with_ext(plan.run, ext, p.backend)(dout, b.q, b.k, b.v, out, lse)
        # Backends return gradients with the batch-dim-normalised shapes of p.q, p.k, p.v.
        return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)

    return run


def flash_attention_vjp(q, k, v, **options):
    """Forward pass plus a function for its vector-Jacobian product.

    ``out, vjp = flash_attention_vjp(q, k, v, causal=..., scale=..., backend=...)`` then
    ``dq, dk, dv = vjp(dout)``. Takes the keywords of :func:`flash_attention_forward` (extension
    keywords included: the backward gets the same ones) and ``deterministic`` (used by the backward). The closure keeps q, k, v, out and lse alive.
    """
    deterministic = options.pop("deterministic", True)
    fwd_keys = ("causal", "scale", "backend")
    fwd = {k_: options[k_] for k_ in fwd_keys if k_ in options}
    rest = {k_: val_ for k_, val_ in options.items() if k_ not in fwd_keys}
    out, lse = flash_attention_forward(q, k, v, **fwd, **rest)
    val.check_flag("deterministic", deterministic)

    def vjp(dout):
        """dq, dk, dv for the cotangent ``dout`` (shape and dtype of ``out``)."""
        return flash_attention_backward(dout, q, k, v, out, lse, deterministic=deterministic,
                                        **fwd, **{k_: v_ for k_, v_ in rest.items() if k_ != "num_splits"})

    return out, vjp
