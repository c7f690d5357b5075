"""Shared fixtures: fixed seeds, dtype parameters and input builders used by every test file."""
import contextlib

import numpy as np
import pytest

from flasharray._private.dtypes import bfloat16

DTYPES = [np.float16, bfloat16, np.float32, np.float64]
DTYPE_IDS = ["fp16", "bf16", "fp32", "fp64"]


def make_qkv(shape_q, shape_k, shape_v, dtype, seed=0, layout="bhsd"):
    """Random q, k, v. ``layout="bshd"`` returns BHSD-shaped *views* of BSHD-contiguous arrays
    (the transposed, non-contiguous case); shapes are always given as (..., L, D)."""
    rng = np.random.default_rng(seed)
    arrays = []
    for shape in (shape_q, shape_k, shape_v):
        if layout == "bshd" and len(shape) >= 3:
            # allocate (..., L, H, D) and view it as (..., H, L, D)
            perm = list(shape[:-3]) + [shape[-2], shape[-3], shape[-1]]
            x = rng.standard_normal(perm).astype(dtype)
            arrays.append(np.swapaxes(x, -2, -3))
        else:
            arrays.append(rng.standard_normal(shape).astype(dtype))
    return tuple(arrays)


@contextlib.contextmanager
def flag_set(module, name, value):
    """``module.name = value`` for the body, restored after it; the plan caches cleared on both sides
    (plans are keyed by call signature, not by module flags)."""
    from flasharray._private import launch
    old = getattr(module, name)
    setattr(module, name, value)
    launch._clear_plans()
    try:
        yield
    finally:
        setattr(module, name, old)
        launch._clear_plans()


def gpu_available():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


requires_gpu = pytest.mark.skipif(not gpu_available(), reason="no CUDA device visible to CuPy")


class older_arch_ptx:
    """Context manager for GPU tests running an older architecture's PTX (``arch=75`` on a newer GPU): a driver
    older than NVRTC's PTX version cannot load it, which skips the test with the driver's message."""

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        if err is not None and "UNSUPPORTED_PTX_VERSION" in str(err):
            pytest.skip("the driver cannot load NVRTC's PTX: %s" % err)
        return False


def _nvrtc_status():
    from flasharray._private import nvrtc
    ok, why = nvrtc.available()
    return bool(ok), why


NVRTC_OK, NVRTC_WHY = _nvrtc_status()
requires_nvrtc = pytest.mark.skipif(not NVRTC_OK, reason="NVRTC unavailable: %s" % NVRTC_WHY)


#: The archs every static check compiles for in the default run: sm_80 (the mma.sync ISA of Ampere and Ada, and of
#: the calls Hopper leaves to the mma.sync kernels) and sm_90 (Hopper). Others join where a test checks their own
#: code or tiles (``own``); every arch runs under ``-m slow`` (README: the CI time budget).
DEFAULT_STATIC_ARCHS = (80, 90)


def static_archs(archs, own=(), default=DEFAULT_STATIC_ARCHS):
    """``archs`` as parameters: those in ``default`` or ``own`` plain, the rest marked slow."""
    return [a if a in default or a in own else pytest.param(a, marks=pytest.mark.slow) for a in archs]


_ParameterSet = type(pytest.param(None))


def thin(cases, every=2, unpack=False):
    """The default run's share of a case matrix: every ``every``-th case from the first; the others run under
    ``-m slow`` (README: the CI time budget). ``cases`` are one parameter's values, or with ``unpack``
    tuples of several parameters' values; ``pytest.param`` entries keep their id and marks."""
    out = []
    for i, c in enumerate(cases):
        if i % every == 0:
            out.append(c)
        elif isinstance(c, _ParameterSet):
            out.append(pytest.param(*c.values, marks=(*c.marks, pytest.mark.slow), id=c.id))
        else:
            out.append(pytest.param(*(c if unpack else (c,)), marks=pytest.mark.slow))
    return out
