"""flasharray: FlashAttention for NumPy and CuPy arrays.

``flash_attention(q, k, v)`` computes exact attention without materialising the Lq×Lk score
matrix: on CuPy arrays with hand-written CUDA kernels, on NumPy arrays with a tiled,
multithreaded CPU implementation, and on the CPU emulator of those CUDA kernels
(``backend="emulator"``). Gradients come from an explicit API (``flash_attention_backward``,
``flash_attention_vjp``). Extension keywords (dropout, block-sparse, sliding window, ALiBi,
softcap, per-entry lengths; docs/extensions.md) apply to every function;
``flash_attention_varlen`` takes packed variable-length batches. ``flash_attention_with_kvcache``
attends over a (paged) KV cache for incremental decoding, appending the new keys in place.
``flasharray.reference`` is the plain NumPy ground truth and ``flasharray.testing`` checks any
attention output against it.
"""
__version__ = "0.1.0"

from ._private.api import (  # noqa: E402
    flash_attention,
    flash_attention_backward,
    flash_attention_forward,
    flash_attention_vjp,
)
from ._private.merge import merge_attention  # noqa: E402
from ._private.varlen import flash_attention_varlen, flash_attention_varlen_backward  # noqa: E402
from ._private.kvcache import flash_attention_with_kvcache  # noqa: E402
from . import reference, testing  # noqa: E402


def reload_kernels():
    """Re-read the CUDA sources: drop compiled kernel modules and every cached call plan.

    Calls are planned once per signature and kernels compiled once per source content; the
    sources are hashed once per process. Call this after editing ``cuda_src`` in a running
    process (kernel development); users never need it.
    """
    from ._private.launch import reload_sources
    reload_sources()


def show_config(file=None):
    """Print versions, devices, cache directories and kernel choices (see ``python -m flasharray info``)."""
    try:
        from ._private.config import show_config as _show
    except ImportError as e:  # the CUDA layer is optional at import time
        print("flasharray %s (CUDA configuration unavailable: %s)" % (__version__, e), file=file)
        return
    return _show(file=file)


__all__ = [
    "flash_attention",
    "flash_attention_forward",
    "flash_attention_backward",
    "flash_attention_vjp",
    "flash_attention_varlen",
    "flash_attention_varlen_backward",
    "merge_attention",
    "flash_attention_with_kvcache",
    "reference",
    "testing",
    "show_config",
    "reload_kernels",
    "__version__",
]
