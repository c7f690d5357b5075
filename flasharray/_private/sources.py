"""Locate the CUDA sources (``cuda_src/``) in a source checkout or an installed wheel."""
import os
from pathlib import Path

_PKG = Path(__file__).resolve().parents[1]


def cuda_src_dir():
    """Return the directory holding ``fa_port.cuh`` and the kernel sources.

    An installed wheel ships them as ``flasharray/cuda_src``; a source checkout keeps them in
    ``cuda_src/`` beside the package. ``FLASHARRAY_CUDA_SRC`` overrides both.
    """
    env = os.environ.get("FLASHARRAY_CUDA_SRC")
    candidates = [Path(env)] if env else []
    candidates += [_PKG / "cuda_src", _PKG.parent / "cuda_src"]
    for c in candidates:
        if (c / "__init__.py").exists() or any(c.glob("*.cuh")):
            return c
    raise FileNotFoundError(
        "flasharray: cannot find the CUDA sources (looked in %s)" % ", ".join(map(str, candidates)))


def read_source(name):
    """Text of one file of ``cuda_src/`` (e.g. ``"flash_fwd.cu"``)."""
    return (cuda_src_dir() / name).read_text()
