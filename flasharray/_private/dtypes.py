"""The dtypes flasharray supports and the precision each one computes in."""
import numpy as np
import ml_dtypes

bfloat16 = np.dtype(ml_dtypes.bfloat16)
SUPPORTED = (np.dtype(np.float16), bfloat16, np.dtype(np.float32), np.dtype(np.float64))
SUPPORTED_NAMES = "float16, bfloat16, float32, float64"


def canonical_dtype(dtype):
    """``numpy.dtype`` of ``dtype`` (accepts names such as ``"bfloat16"``)."""
    if isinstance(dtype, str) and dtype == "bfloat16":
        return bfloat16
    return np.dtype(dtype)


def is_supported(dtype):
    return canonical_dtype(dtype) in SUPPORTED


def accumulation_dtype(dtype):
    """float64 for float64 inputs, float32 for everything narrower (fp16, bf16, fp32)."""
    return np.dtype(np.float64) if canonical_dtype(dtype) == np.float64 else np.dtype(np.float32)


# Per-dtype absolute slack of the DESIGN.md test rule (|err| <= factor*naive_err + atol): about
# one unit in the last place at magnitude 1/8, so exact cases (naive error 0) are not flaky.
ATOL = {
    np.dtype(np.float16): 1e-4,
    bfloat16: 1e-3,
    np.dtype(np.float32): 1e-6,
    np.dtype(np.float64): 1e-12,
}
