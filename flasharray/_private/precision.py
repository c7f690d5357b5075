"""The ``precision=`` option of issue 12: which arithmetic float32 and float64 attention uses.

=========  ===========  ==============================================================
precision  dtypes       arithmetic (CUDA backend)
=========  ===========  ==============================================================
None       all          the library's default for the dtype (float32: chosen by
                        measurement against the DESIGN.md test rule; fp16/bf16: their
                        tensor-core kernels, fp32 accumulation)
"ieee"     fp32, fp64   exact IEEE fp32 / fp64 FMA arithmetic: SIMT kernels for fp32;
                        for fp64 the DMMA tensor cores (IEEE fp64) from sm_80, SIMT below
"tf32"     fp32         TF32 tensor cores (``mma.sync.m16n8k8`` tf32, fp32 accumulate):
                        operands keep 10 mantissa bits; opt-in, lower precision
"3xtf32"   fp32         each operand split into tf32 hi + tf32 residual lo, products
                        hi*hi + hi*lo + lo*hi in fp32: close to fp32 at tensor-core speed
=========  ===========  ==============================================================

Wired into the public functions (``api.py``: forward, backward, vjp, varlen; the reference takes it
too). The CUDA forward runs "tf32" / "3xtf32" on ``cuda_src/flash_fwd_tf32.cu``
(:mod:`cuda_forward_tf32`), the CUDA backward on ``cuda_src/flash_bwd_tf32.cu``
(:mod:`cuda_backward_tf32`), where their tiles apply (else the SIMT kernels); the cpu backend and
the reference compute in IEEE arithmetic whatever the value. float32's default (None) is "ieee"
everywhere (:data:`FLOAT32_TC_DEFAULT`, :func:`effective_precision`; ``docs/precision.md``, *Default*:
3xtf32 missed the rule on an H200). :func:`tf32_error_bound` is the derived error of the
tf32 rounding.
"""
import numpy as np

from .dtypes import canonical_dtype

PRECISIONS = ("ieee", "tf32", "3xtf32")
TENSOR_CORE_TF32 = ("tf32", "3xtf32")   # need sm_80+ (mma.sync m16n8k8 .tf32)
_APPLIES = {
    np.dtype(np.float32): PRECISIONS,
    np.dtype(np.float64): ("ieee",),
}


def check_precision(precision, dtype):
    """Validate ``precision`` for inputs of ``dtype``; return it (None, "ieee", "tf32" or "3xtf32").

    Raises ``ValueError`` naming the argument for an unknown value and for a precision that does
    not apply to the dtype (fp16/bf16 take only None; float64 takes None or "ieee").
    """
    if precision is None:
        return None
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError("flasharray: unknown precision %r; argument 'precision' must be one of %s or "
                         "None (the dtype's default)" % (precision, ", ".join(map(repr, PRECISIONS))))
    dtype = canonical_dtype(dtype)
    allowed = _APPLIES.get(dtype, ())
    if precision not in allowed:
        choices = " or ".join(map(repr, allowed + (None,)))
        raise ValueError("flasharray: argument 'precision'=%r does not apply to %s inputs; for %s use %s"
                         % (precision, dtype.name, dtype.name, choices))
    return precision


def check_precision_arch(precision, compute_capability):
    """``NotImplementedError`` naming the architecture when ``precision`` needs TF32 tensor cores
    (sm_80+) and the GPU (``compute_capability``, e.g. 75 or (7, 5)) has none."""
    if precision not in TENSOR_CORE_TF32:
        return
    cc = compute_capability
    cc = cc[0] * 10 + cc[1] if isinstance(cc, tuple) else int(cc)
    if cc < 80:
        raise NotImplementedError("flasharray: precision=%r needs TF32 tensor cores (sm_80 or newer); "
                                  "this GPU is sm_%d. Use precision='ieee' (or None)." % (precision, cc))


#: float32's default precision on GPUs with TF32 tensor cores (sm_80+), None meaning IEEE (the SIMT
#: kernels). Issue 12 makes the default "the fastest path that meets the DESIGN.md test rule against
#: naive float32 attention". 3xtf32 met it on every emulator test shape, but not on an H200
#: (``benchmarks/gpu.py --precision``, 2026-11-27, (4, 32, 4096, 64)): out 5.1e-6 against a bound of
#: 1.25e-6, dK and dV 5x theirs, dQ within — the tensor cores' sums are not rounded to nearest, and
#: O, dK and dV accumulate inside the mma over every key / query (docs/precision.md, *Default*). So
#: float32 stays exact by default; "3xtf32" and "tf32" are opt-in.
FLOAT32_TC_DEFAULT = None


#: float32's default precision for the CUDA **forward** of dense calls (no extensions, no KV cache) at head dims
#: D, Dv <= :data:`FLOAT32_FWD_DEFAULT_MAX_HEAD_DIM` on sm_80+: "3xtf32". Measured on an H200 (docs/gpu_h200.md,
#: third session): it met the DESIGN.md rule at D 64 and 128 (N 512-4096, causal or not; out at most 0.77 of its
#: bound) after the per-key-tile sums of the truncating mma (docs/precision.md), and ran 1.9x the ieee forward
#: (D 64: 9.6 vs 18.0 ms; D 128: 10.3 vs 19.1). Its backward is no faster than ieee's (D 64) or 2.7x slower (D
#: 128), so the backward's default stays :data:`FLOAT32_TC_DEFAULT`; at D 256 it broke the rule (dv > 128 keeps
#: the sum inside the mma); with extensions it has not run on a GPU.
FLOAT32_FWD_DEFAULT = "3xtf32"
FLOAT32_FWD_DEFAULT_MAX_HEAD_DIM = 128


def effective_forward_precision(precision, dtype, compute_capability, head_dim, head_dim_v, dense):
    """:func:`effective_precision` for a CUDA-backend forward: float32's None on sm_80+ becomes
    :data:`FLOAT32_FWD_DEFAULT` where the call is ``dense`` (no extensions, no KV cache) and ``head_dim``,
    ``head_dim_v`` are at most :data:`FLOAT32_FWD_DEFAULT_MAX_HEAD_DIM`; otherwise as :func:`effective_precision`."""
    p = effective_precision(precision, dtype, compute_capability)  # an explicit value: returned as it is
    if (p is not None or not dense or canonical_dtype(dtype) != np.dtype(np.float32)
            or max(int(head_dim), int(head_dim_v)) > FLOAT32_FWD_DEFAULT_MAX_HEAD_DIM or _cc(compute_capability) < 80):
        return p
    return FLOAT32_FWD_DEFAULT


def _cc(compute_capability):
    cc = compute_capability
    return cc[0] * 10 + cc[1] if isinstance(cc, tuple) else int(cc)


def effective_precision(precision, dtype, compute_capability):
    """The precision a CUDA-backend call with ``precision`` (already validated) runs: None becomes
    :data:`FLOAT32_TC_DEFAULT` (None: IEEE) for float32 on sm_80+ (``compute_capability`` e.g. 80 or (8, 0));
    everything else is returned unchanged (float32 below sm_80 and float64 keep None, i.e. IEEE)."""
    if precision is not None or canonical_dtype(dtype) != np.dtype(np.float32):
        return precision
    return FLOAT32_TC_DEFAULT if _cc(compute_capability) >= 80 else None


#: Unit roundoff of tf32 (10 explicit mantissa bits, cvt.rna round-to-nearest): |cvt(x) − x| <= u|x|.
TF32_UNIT_ROUNDOFF = 2.0 ** -11


def tf32_error_bound(q, k, v, *, causal=False, scale=None):
    """Elementwise bounds ``(out_bound, lse_bound)`` on what rounding the operands to tf32 adds to
    the error of float32 attention (``precision="tf32"``); NumPy arrays in, float64 out.

    Derivation (first principles, u = 2^-11, no second-order term dropped). Each product
    q_d·k_d of rounded operands is off by at most (2u + u²)|q_d k_d|, so a score moves by at most
    ΔS_ij = (2u + u²)·scale·Σ_d |q_id||k_jd|; its weight exp(S_ij − m) then changes by a factor
    1 + δ_j with |δ_j| <= δ_i = expm1(max_j ΔS_ij) (row i's visible keys). The normalised weights
    w_j = P_j(1 + δ_j) / Σ P(1 + δ) satisfy |w_j / P_j − 1| <= 2δ_i / (1 − δ_i), and P and V are
    rounded before P·V (relative 2u + u² per product), so

        |Δout_ic| <= [2δ_i + (2u + u²)(1 + δ_i)] / (1 − δ_i) · Σ_j P_ij |V_jc|,
        |Δlse_i|  <= −log(1 − δ_i)       (l_i sums the unrounded fp32 weights).

    The fp32 arithmetic that remains (accumulation, exp2, the division) is what the DESIGN.md rule
    bounds for float32; the tests add that term (2·naive fp32 error + atol) to these bounds.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    D, Lq, Lk = q.shape[-1], q.shape[-2], k.shape[-2]
    scale = 1.0 / np.sqrt(D) if scale is None else float(scale)
    u = TF32_UNIT_ROUNDOFF
    rel = 2 * u + u * u
    S = scale * (q @ np.swapaxes(k, -1, -2))
    A = scale * (np.abs(q) @ np.swapaxes(np.abs(k), -1, -2))
    visible = np.ones((Lq, Lk), dtype=bool)
    if causal:
        visible = np.arange(Lk)[None, :] <= np.arange(Lq)[:, None] + (Lk - Lq)
    S = np.where(visible, S, -np.inf)
    seen = visible.any(axis=-1)[:, None]
    m = np.where(seen, S.max(axis=-1, keepdims=True, initial=-np.inf), 0.0)
    P = np.exp(S - m)
    P = P / np.where(seen, P.sum(axis=-1, keepdims=True), 1.0)
    delta = np.expm1(rel * np.where(visible, A, 0.0).max(axis=-1, keepdims=True, initial=0.0))
    out_bound = (2 * delta + rel * (1 + delta)) / (1 - delta) * (P @ np.abs(v))
    lse_bound = -np.log1p(-delta[..., 0])
    return out_bound, lse_bound


def tf32_round(x):
    """``cvt.rna.tf32.f32`` of finite float32 values: the magnitude rounded to 10 mantissa bits,
    ties away from zero (float32 in, float32 out)."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x1000) & 0xFFFFE000).astype(np.uint32).view(np.float32)


def _visible(Lq, Lk, causal):
    if not causal:
        return np.ones((Lq, Lk), dtype=bool)
    return np.arange(Lk)[None, :] <= np.arange(Lq)[:, None] + (Lk - Lq)


def tf32_backward_reference(q, k, v, do, lse, delta, *, causal=False, scale, rounded=True):
    """float64 ``(dq, dk, dv, P, dS)`` of the backward the tf32 kernels compute, from the L
    (``lse``, natural log) and D_i (``delta``) they were given: P = exp(S·scale − L) where visible,
    dS = P ∘ (dP − D_i), dV = Pᵀ dO, dK = scale·dSᵀ Q, dQ = scale·dS K. With ``rounded`` every
    product operand is rounded as the kernels round it (Q, K, V, dO; P and dS from their float64
    values). Layout: q, do ``(..., G, Lq, D)``, k, v ``(..., Lk, D)`` shared by the G query heads
    (dk, dv summed over G), lse, delta ``(..., G, Lq)``."""
    r = (lambda x: tf32_round(x).astype(np.float64)) if rounded else (lambda x: np.asarray(x, np.float64))
    q64, do64 = r(q), r(do)
    k64, v64 = (r(x)[..., None, :, :] for x in (k, v))
    s = q64 @ np.swapaxes(k64, -1, -2) * scale
    lse64 = np.asarray(lse, np.float64)[..., None]
    seen = np.isfinite(lse64)
    vis = _visible(q.shape[-2], k.shape[-2], causal)
    p = np.where(vis & seen, np.exp(s - np.where(seen, lse64, 0.0)), 0.0)
    ds = p * (do64 @ np.swapaxes(v64, -1, -2) - np.asarray(delta, np.float64)[..., None])
    pr, dsr = (r(p), r(ds)) if rounded else (p, ds)
    dq = dsr @ k64 * scale
    dk = (np.swapaxes(dsr, -1, -2) @ q64 * scale).sum(-3)
    dv = (np.swapaxes(pr, -1, -2) @ do64).sum(-3)
    return dq, dk, dv, p, ds


def _ambiguous(x, dx):
    """Where the tf32 rounding of a value known to within ±dx of x is ambiguous (a rounding boundary
    inside the interval): there the kernel's rounding may differ from the reference's by one tf32
    ulp (<= 2^-10 |x|)."""
    return tf32_round(np.asarray(x - dx, np.float32)) != tf32_round(np.asarray(x + dx, np.float32))


def tf32_gradient_bound(q, k, v, do, lse, delta, p, ds, *, scale):
    """Elementwise bounds ``(dq, dk, dv)`` on the tf32 kernels' gradients against
    :func:`tf32_backward_reference` (``p``, ``ds`` its P and dS; same layout): one-ulp flips of the
    tf32 rounding of P and dS where their float32 value can straddle a rounding boundary (error
    from the fp32 products γ_n Σ|a||b|, and 2^-20 relative for exp2, the scale and L multiplies
    and D_i), propagated with |operand| weights. The remaining fp32 arithmetic is the float32
    rule's term (2·max|naive fp32 − float64| + atol per gradient), which callers add."""
    D, Dv = q.shape[-1], v.shape[-1]
    gam = lambda n: n * 2.0 ** -24 / (1 - n * 2.0 ** -24)  # noqa: E731
    qa, doa = (np.abs(tf32_round(x)).astype(np.float64) for x in (q, do))
    ka, va = (np.abs(tf32_round(x)).astype(np.float64)[..., None, :, :] for x in (k, v))
    s_abs = qa @ np.swapaxes(ka, -1, -2)
    dp_abs = doa @ np.swapaxes(va, -1, -2)
    dlt = np.abs(np.asarray(delta, np.float64))[..., None]
    lse_abs = np.abs(np.where(np.isfinite(lse), lse, 0))[..., None]
    d_p = p * (scale * gam(D) * s_abs + 2.0 ** -20 * (1 + scale * s_abs + lse_abs))
    dp_val = ds / np.where(p > 0, p, 1)  # dP − D_i where P > 0
    d_ds = d_p * np.abs(dp_val) + p * (gam(Dv) * dp_abs + 2.0 ** -20 * (dp_abs + dlt))
    fp = np.where(_ambiguous(p, d_p), 2.0 ** -10 * p, 0.0)
    fds = np.where(_ambiguous(ds, d_ds), 2.0 ** -10 * np.abs(ds), 0.0)
    return (fds @ ka * scale, (np.swapaxes(fds, -1, -2) @ qa * scale).sum(-3),
            (np.swapaxes(fp, -1, -2) @ doa).sum(-3))
