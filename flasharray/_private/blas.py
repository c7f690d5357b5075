"""Keep BLAS single-threaded while the cpu backend's own thread pool runs.

The cpu backend parallelises over (batch entry × block range) work items; if OpenBLAS also
spawned its threads inside every tile product, 2 pool threads × 2 BLAS threads would fight
over 2 cores (measured: about 2× slower). OpenBLAS exposes ``*_set_num_threads``; we find the
copy NumPy loaded (its file name contains "openblas") and call it, restoring the previous
value afterwards. With another BLAS (MKL, Accelerate) this is a no-op.
"""
import ctypes
import threading
from contextlib import contextmanager

_SET = ("openblas_set_num_threads", "scipy_openblas_set_num_threads64_",
        "scipy_openblas_set_num_threads", "openblas_set_num_threads64_")
_GET = ("openblas_get_num_threads", "scipy_openblas_get_num_threads64_",
        "scipy_openblas_get_num_threads", "openblas_get_num_threads64_")

_lock = threading.Lock()
_state = {"users": 0, "saved": None}
_funcs = None


def _openblas():
    """(set, get) ctypes functions of the OpenBLAS NumPy uses, or None."""
    global _funcs
    if _funcs is not None:
        return _funcs or None
    _funcs = ()
    try:
        import numpy  # noqa: F401  (makes sure NumPy's BLAS is loaded)
        with open("/proc/self/maps") as f:
            paths = sorted({ln.split()[-1] for ln in f if "openblas" in ln.lower() and "/" in ln})
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        set_ = next((getattr(lib, n) for n in _SET if hasattr(lib, n)), None)
        get_ = next((getattr(lib, n) for n in _GET if hasattr(lib, n)), None)
        if set_ is not None and get_ is not None:
            set_.argtypes, set_.restype, get_.restype = [ctypes.c_int], None, ctypes.c_int
            _funcs = (set_, get_)
            return _funcs
    return None


@contextmanager
def single_threaded_blas():
    """Context in which OpenBLAS runs each call on the calling thread only (re-entrant)."""
    funcs = _openblas()
    if funcs is None:
        yield
        return
    set_, get_ = funcs
    with _lock:
        if _state["users"] == 0:
            _state["saved"] = get_()
            set_(1)
        _state["users"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["users"] -= 1
            if _state["users"] == 0:
                set_(_state["saved"])
