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

Validation only: not yet wired into the public functions (``api.py``).
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
