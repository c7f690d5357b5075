"""``show_config()`` / ``python -m flasharray info``: versions, devices, caches, kernel choices."""
import ctypes
import os
import platform
import sys
from pathlib import Path

import numpy as np

from . import tiles
from .sources import cuda_src_dir


def _version(modname):
    try:
        mod = __import__(modname)
        return getattr(mod, "__version__", "installed")
    except Exception:
        return None


def _nvrtc_version():
    """NVRTC version as 'major.minor' (CuPy's binding, else libnvrtc via ctypes), or None."""
    try:
        from cupy.cuda import nvrtc
        major, minor = nvrtc.getVersion()
        return "%d.%d (via CuPy)" % (major, minor)
    except Exception:
        pass
    candidates = []
    try:
        import nvidia.cuda_nvrtc as pkg  # nvidia-cuda-nvrtc-cu12 wheel
        for base in pkg.__path__:
            candidates += sorted(Path(base, "lib").glob("libnvrtc.so*"))
    except Exception:
        pass
    candidates += ["libnvrtc.so", "libnvrtc.so.12", "libnvrtc.so.13"]
    for c in candidates:
        try:
            lib = ctypes.CDLL(str(c))
        except OSError:
            continue
        major, minor = ctypes.c_int(), ctypes.c_int()
        if lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) == 0:
            return "%d.%d (%s)" % (major.value, minor.value, c)
    return None


def _cuda_info():
    """(cupy version or None, runtime version, driver version, [(id, name, arch)], error)."""
    try:
        import cupy
    except Exception as e:
        return None, None, None, [], "CuPy not importable (%s)" % type(e).__name__
    try:
        rt = cupy.cuda.runtime.runtimeGetVersion()
        drv = cupy.cuda.runtime.driverGetVersion()
        devices = []
        for i in range(cupy.cuda.runtime.getDeviceCount()):
            props = cupy.cuda.runtime.getDeviceProperties(i)
            name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            devices.append((i, name, props["major"] * 10 + props["minor"]))
        fmt = lambda v: "%d.%d" % (v // 1000, v % 1000 // 10)  # noqa: E731
        return cupy.__version__, fmt(rt), fmt(drv) if drv else None, devices, None
    except Exception as e:
        return cupy.__version__, None, None, [], "no usable CUDA device (%s)" % e


def _cupy_cache_dir():
    return os.environ.get("CUPY_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cupy", "kernel_cache"))


def kernel_choice(dtype, head_dim, arch, head_dim_v=None, device=None):
    """Which forward kernel and tile (dtype, head dim, arch) gets, and why; a line for long non-causal
    calls taking the wide-row tile (``tiles.WIDE_ROWS``). On sm_90 the wgmma kernel first where
    ``kernel=None`` takes it (``cuda_forward_sm90.auto_tile``; ``device`` "cuda": only where NVRTC compiles
    sm_90a), then the mma.sync tiles the calls it does not serve keep."""
    from . import cuda_backward_sm90, cuda_forward_sm90
    try:
        t = tiles.forward_tile(dtype, head_dim, head_dim_v, arch)
        wide = tiles.forward_tile(dtype, head_dim, head_dim_v, arch, wide=True)
        wide_causal = (tiles.forward_tile(dtype, head_dim, head_dim_v, arch, wide=True, causal=True)
                       if tiles.causal_takes_wide(dtype, head_dim, head_dim_v, arch) else t)
    except NotImplementedError as e:
        return str(e)
    lines = [t.describe()]
    # the wide-row tiles of long calls: one line when causal calls take the same one, else one each
    shown = [("causal or not", wide)] if wide_causal == wide else [("non-causal", wide), ("causal", wide_causal)]
    for which, tile in shown:
        if tile != t:
            lines.append("(%s, aligned rows, > 64 rows, no extensions: %s)" % (which, tile.describe()))
    auto = cuda_forward_sm90.auto_tile(dtype, head_dim, head_dim_v, arch, device)
    if auto is not None:
        ext = ("extensions on rows not 16-byte aligned at d 256" if cuda_forward_sm90.AUTO_EXT else "extensions")
        lines[0] = "(%s, split-KV decoding, KV cache, block_m: %s)" % (ext, lines[0])
        lines.insert(0, "%s; backward: wgmma too (dq='recompute', extensions%s: tc)" % (
            auto.describe(), " its kernels or the dQ mode do not take" if cuda_backward_sm90.AUTO_EXT else ""))
    return "\n      ".join(lines)


def _emulator_compiler():
    from .. import emulator
    try:
        return emulator.host_compiler()
    except emulator.CompileError as e:
        return "unusable: %s" % e


def show_config(file=None, dtype=None, head_dim=None, arch=None):
    """Print versions, devices and compute capabilities, cache dirs and the kernel choices.

    Parameters
    ----------
    file : file-like, optional
        Where to print (default ``sys.stdout``).
    dtype, head_dim, arch : optional
        Print only the kernel/tile choice for this (dtype, head dim, compute capability);
        by default the choices for every visible device (or the static-check archs without a
        device) × {float16, bfloat16, float32, float64} × head dims {64, 128, 256}.
    """
    out = file or sys.stdout
    p = lambda *a: print(*a, file=out)  # noqa: E731
    from .. import __version__
    p("flasharray %s" % __version__)
    p("  python        %s (%s)" % (platform.python_version(), sys.executable))
    p("  numpy         %s" % np.__version__)
    p("  ml_dtypes     %s" % (_version("ml_dtypes") or "not installed"))
    cupy_v, rt, drv, devices, err = _cuda_info()
    p("  cupy          %s" % (cupy_v or "not installed"))
    p("  CUDA runtime  %s" % (rt or "unavailable"))
    p("  CUDA driver   %s" % (drv or "unavailable"))
    p("  NVRTC         %s" % (_nvrtc_version() or "not found"))
    if devices:
        for i, name, cc in devices:
            p("  device %d      %s, compute capability %d.%d" % (i, name, cc // 10, cc % 10))
    else:
        p("  devices       none visible%s" % (" (%s)" % err if err else ""))
    p("cuda sources    %s" % cuda_src_dir())
    p("caches")
    p("  CuPy kernels  %s" % _cupy_cache_dir())
    try:
        from ..emulator import cache_dir
        p("  emulator      %s" % cache_dir())
    except Exception as e:  # pragma: no cover - emulator is part of the package
        p("  emulator      unavailable (%s)" % e)
    p("emulator CXX    %s" % _emulator_compiler())
    p("forward kernel choices")
    device = "cuda" if devices else None  # sm_90's wgmma kernels need NVRTC's sm_90a on a CUDA device
    if dtype is not None or head_dim is not None or arch is not None:
        dt = dtype if dtype is not None else "float16"
        hd = head_dim if head_dim is not None else 64
        a = arch if arch is not None else (devices[0][2] if devices else tiles.EMULATOR_ARCH)
        p("  sm_%d %s d=%d: %s" % (tiles.arch_number(a), tiles.dtype_name(dt), hd, kernel_choice(dt, hd, a, None, device)))
        return
    archs = sorted({cc for _, _, cc in devices}) or list(tiles.ARCHS)
    for a in archs:
        for dt in ("float16", "bfloat16", "float32", "float64"):
            for hd in (64, 128, 256):
                p("  sm_%d %-8s d=%-3d %s" % (a, dt, hd, kernel_choice(dt, hd, a, None, device)))
