"""The launch layer shared by the CUDA forward and backward: sources, modules, launchers, batches.

One kernel source (``cuda_src/*.cu``) runs in two places:

* ``device="cuda"``: compiled at run time by NVRTC through ``cupy.RawModule`` (``-I<cuda_src>``,
  ``-std=c++17``, plus a content hash of every file in ``cuda_src`` as a ``-D`` option, so CuPy's
  on-disk cache key changes whenever an included header changes), launched on CuPy's current
  stream, with ``max_dynamic_shared_size_bytes`` raised when a kernel needs more than 48 KB;
* ``device="emulator"``: compiled with the host C++ compiler by ``flasharray.emulator.Module``
  and run on the CPU; the launch returns the emulator's counters (global bytes read/written,
  mma, ldmatrix, cp.async, barriers, ...). ``schedule`` and ``seed`` pass through.

Batch convention (``flash_block_info.cuh``): the batch dims of all tensors of one launch are
merged into at most three, ``(nb0, nb1, nb2)``; the grid is ``(blocks, nb1*nb2, nb0)``; every
tensor gets element strides for the three dims and its rows. When more than three dims remain
after merging, the outer ones are looped over on the host (one launch each).

Public helpers (stable API, used by ``cuda_forward`` and ``cuda_backward``):

``make_launcher(device, **opts) -> Launcher``
    ``launcher.launch(source_name, name_expr, grid, block, args, shared_mem=0)`` → counters
    (a dict, emulator) or None (CUDA). ``launcher.arch`` is the compute capability as an int.
``batch_plan(batch_shape, arrays) -> list[BatchLaunch]``
    merged (nb0, nb1, nb2), and per array a flat view + its three batch strides.
``kernel_ready(a)``, ``element_strides(a)``
    copy only when the last axis is not contiguous; strides in elements.
``c_int(x)``, ``c_longlong(x)``, ``c_float(x)``, ``c_double(x)``, ``c_scalar(x, acc_dtype)``
    exact-C-type NumPy scalars (kernel arguments by value, as CuPy's RawKernel takes them).
"""
import functools
import hashlib
import itertools
import threading
from pathlib import Path

import numpy as np

from .sources import cuda_src_dir

CUDA_OPTIONS = ("-std=c++17", "--use_fast_math")

_lock = threading.Lock()


# ---- sources ---------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _source_tree_digest(src_dir):
    """sha256 over every file of cuda_src (names and contents): covers all included headers."""
    h = hashlib.sha256()
    root = src_dir
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".cu", ".cuh", ".h", ".cpp")):
        h.update(str(path.relative_to(root)).encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:16]


def source_digest():
    """Content hash of ``cuda_src`` (all .cu/.cuh/.h/.cpp files), 16 hex digits."""
    return _source_tree_digest(cuda_src_dir())


def kernel_source(source_name):
    """Text of ``cuda_src/<source_name>``."""
    return (cuda_src_dir() / source_name).read_text()


def _cuda_include_dirs():
    """CUDA headers (cuda_fp16.h, cuda_bf16.h) from the nvidia-cuda-runtime wheel, if installed."""
    dirs = []
    try:
        import nvidia.cuda_runtime as rt  # type: ignore
        for base in getattr(rt, "__path__", []):
            inc = Path(base) / "include"
            if (inc / "cuda_fp16.h").exists():
                dirs.append(str(inc))
    except ImportError:
        pass
    return dirs


def cuda_compile_options():
    """NVRTC options used for the CuPy path (also what the static checks compile with)."""
    opts = list(CUDA_OPTIONS) + ["-I" + str(cuda_src_dir())]
    opts += ["-I" + d for d in _cuda_include_dirs()]
    opts.append("-DFLASHARRAY_SOURCE_DIGEST=0x" + source_digest())
    return tuple(opts)


# ---- scalars ---------------------------------------------------------------------------------------

def c_int(x):
    return np.int32(x)


def c_longlong(x):
    return np.int64(x)


def c_float(x):
    return np.float32(x)


def c_double(x):
    return np.float64(x)


def c_scalar(x, acc_dtype):
    """``x`` as the kernel's accumulation type (float or double)."""
    return np.float64(x) if np.dtype(acc_dtype) == np.float64 else np.float32(x)


# ---- launchers -------------------------------------------------------------------------------------

class Launcher:
    """Compile-once, launch-many access to the kernels of ``cuda_src`` on one device."""

    device = None
    arch = None

    def launch(self, source_name, name_expr, grid, block, args, shared_mem=0):
        raise NotImplementedError

    def xp(self):
        raise NotImplementedError


class CupyLauncher(Launcher):
    """CuPy + NVRTC; launches on CuPy's current stream."""

    device = "cuda"
    _modules = {}

    def __init__(self):
        import cupy  # lazy: importing flasharray never needs a GPU
        self._cupy = cupy
        dev = cupy.cuda.Device()
        self.device_id = dev.id
        self.arch = int(dev.compute_capability)

    def xp(self):
        return self._cupy

    def _function(self, source_name, name_expr):
        key = (self.device_id, source_name, source_digest(), name_expr)
        with _lock:
            fn = self._modules.get(key)
            if fn is None:
                mod = self._cupy.RawModule(code=kernel_source(source_name), options=cuda_compile_options(),
                                           name_expressions=[name_expr])
                fn = mod.get_function(name_expr)
                self._modules[key] = fn
        return fn

    def launch(self, source_name, name_expr, grid, block, args, shared_mem=0):
        fn = self._function(source_name, name_expr)
        if shared_mem > 48 * 1024 and fn.max_dynamic_shared_size_bytes < shared_mem:
            fn.max_dynamic_shared_size_bytes = shared_mem  # opt-in beyond 48 KB
        fn(tuple(grid), tuple(block), tuple(args), shared_mem=shared_mem)
        return None


class EmulatorLauncher(Launcher):
    """``flasharray.emulator``: the same kernels on the CPU; returns the launch counters."""

    device = "emulator"
    _modules = {}

    def __init__(self, schedule="forward", seed=0, arch=None):
        from .tiles import EMULATOR_ARCH, arch_number
        self.schedule = schedule
        self.seed = seed
        self.arch = arch_number(arch) if arch is not None else EMULATOR_ARCH

    def xp(self):
        return np

    def _module(self, source_name, name_expr):
        from .. import emulator
        key = (source_name, source_digest(), name_expr)
        with _lock:
            mod = self._modules.get(key)
            if mod is None:
                mod = emulator.Module(kernel_source(source_name), name_expressions=[name_expr],
                                      include_dirs=[str(cuda_src_dir())], options=["-std=c++17"])
                self._modules[key] = mod
        return mod

    def launch(self, source_name, name_expr, grid, block, args, shared_mem=0):
        mod = self._module(source_name, name_expr)
        return mod.launch(name_expr, tuple(grid), tuple(block), tuple(args), shared_mem=shared_mem,
                          schedule=self.schedule, seed=self.seed)


def make_launcher(device, schedule="forward", seed=0, arch=None, **_ignored):
    """A launcher for ``device`` ("cuda" or "emulator"); ``arch`` picks tiles on the emulator."""
    if device == "cuda":
        return CupyLauncher()
    if device == "emulator":
        return EmulatorLauncher(schedule=schedule or "forward", seed=0 if seed is None else seed, arch=arch)
    raise ValueError("flasharray: device must be 'cuda' or 'emulator', got %r" % (device,))


# ---- arrays as kernel arguments ----------------------------------------------------------------------

def xp_of(a):
    """numpy or cupy, by the array's type."""
    if isinstance(a, np.ndarray):
        return np
    import cupy
    return cupy


def element_strides(a):
    """Strides of ``a`` in elements (exact: NumPy/CuPy strides are multiples of the itemsize)."""
    return tuple(s // a.itemsize for s in a.strides)


def kernel_ready(a):
    """``a`` itself, or a copy when its last axis is not contiguous or a stride is negative.

    The kernels need unit stride along the head dim; negative strides are not expressible as a
    pointer to element 0 plus non-negative offsets, so they are copied too (rare: flipped views).
    """
    st = element_strides(a)
    if (a.shape[-1] > 1 and st[-1] != 1) or any(s < 0 for s in st):
        return xp_of(a).ascontiguousarray(a)
    return a


def flat_view(a, offset=0):
    """1-D contiguous view of the memory span of ``a`` starting ``offset`` elements in.

    The kernel indexes with explicit strides from the pointer to element 0, so what it needs is a
    pointer (CuPy) or a buffer (emulator: the byte range it may touch) — the view covers exactly
    the elements ``a`` can reach. Strides must be non-negative (see :func:`kernel_ready`).
    """
    xp = xp_of(a)
    st = element_strides(a)
    span = 1 + sum((n - 1) * s for n, s in zip(a.shape, st)) if a.size else 0
    if xp is np:
        base = np.lib.stride_tricks.as_strided(a, shape=(span,), strides=(a.itemsize,),
                                               writeable=a.flags.writeable)
    else:
        base = xp.lib.stride_tricks.as_strided(a, shape=(span,), strides=(a.itemsize,))
    return base[offset:]


class BatchLaunch:
    """One launch of a batched kernel: the merged dims and, per tensor, a flat view + strides."""

    def __init__(self, dims, tensors):
        self.dims = dims          # (nb0, nb1, nb2)
        self.tensors = tensors    # list of (flat_view, (s_b0, s_b1, s_b2))

    @property
    def grid_yz(self):
        nb0, nb1, nb2 = self.dims
        return nb1 * nb2, nb0


def merge_batch_dims(batch_shape, strides):
    """Drop size-1 dims and merge neighbours that every tensor steps through uniformly.

    ``strides[t][i]`` is tensor t's element stride for batch dim i (0 where it broadcasts).
    Returns (shape, strides) with dims i, i+1 merged whenever, for every tensor,
    ``stride[i] == stride[i+1] * shape[i+1]``.
    """
    shape = []
    st = [[] for _ in strides]
    for i, n in enumerate(batch_shape):
        if n == 1:
            continue
        if shape and all(s[-1] == strides[t][i] * n for t, s in enumerate(st)):
            shape[-1] *= n
            for t, s in enumerate(st):
                s[-1] = strides[t][i]
            continue
        shape.append(n)
        for t, s in enumerate(st):
            s.append(strides[t][i])
    return tuple(shape), [tuple(s) for s in st]


#: CUDA's limit on gridDim.y and gridDim.z (a module constant so tests can shrink it).
MAX_GRID_YZ = 65535


def _grid_fits(inner):
    """Whether inner dims (≤ 3, leading padded with 1) fit grid.z = nb0 and grid.y = nb1·nb2."""
    dims = (1,) * (3 - len(inner)) + tuple(n for n, _ in inner)
    return dims[0] <= MAX_GRID_YZ and dims[1] * dims[2] <= MAX_GRID_YZ


def batch_plan(batch_shape, arrays, max_dims=3):
    """Split a batched launch into launches with at most ``max_dims`` merged batch dims.

    ``arrays``: tensors whose leading ``len(batch_shape)`` dims are the batch dims (size
    ``batch_shape[i]`` or 1 = broadcast). Returns a list of :class:`BatchLaunch`; each holds the
    padded (nb0, nb1, nb2) and, per tensor, a flat view starting at that launch's first element
    and the three batch strides (elements). Dims that do not fit (more than ``max_dims`` after
    merging, or grid.y / grid.z above ``MAX_GRID_YZ``) become host loops, the outermost first;
    a single dim that alone exceeds the limit is launched in chunks.
    """
    nbatch = len(batch_shape)
    strides = []
    for a in arrays:
        st = element_strides(a)
        strides.append([0 if a.shape[i] == 1 else st[i] for i in range(nbatch)])
    shape, mstrides = merge_batch_dims(batch_shape, strides)
    dims = [(n, tuple(s[i] for s in mstrides)) for i, n in enumerate(shape)]
    outer, inner = [], dims
    while len(inner) > max_dims or (len(inner) > 1 and not _grid_fits(inner)):
        outer.append(inner[0])
        inner = inner[1:]
    # Host loops: every outer index, and chunks of a lone inner dim above the grid limit.
    if inner and not _grid_fits(inner):
        n, st = inner[0]
        chunks = [(tuple(c * x for x in st), min(MAX_GRID_YZ, n - c)) for c in range(0, n, MAX_GRID_YZ)]
    else:
        chunks = [(tuple(0 for _ in arrays), None)]
    launches = []
    outer_ranges = [range(n) for n, _ in outer]
    for idx in itertools.product(*outer_ranges):
        base = [sum(i * st[t] for i, (_, st) in zip(idx, outer)) for t in range(len(arrays))]
        for chunk_off, chunk_n in chunks:
            cur = list(inner)
            if chunk_n is not None:
                cur[0] = (chunk_n, cur[0][1])
            padded = [(1, (0,) * len(arrays))] * (max_dims - len(cur)) + cur
            tensors = []
            for t, a in enumerate(arrays):
                tensors.append((flat_view(a, base[t] + chunk_off[t]), tuple(st[t] for _, st in padded)))
            launches.append(BatchLaunch(tuple(n for n, _ in padded), tensors))
    return launches
