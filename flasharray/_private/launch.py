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

``make_launcher(device, **opts) -> Launcher`` (one per device / emulator settings, per process)
    ``launcher.launch(source_name, name_expr, grid, block, args, shared_mem=0)`` → counters
    (a dict, emulator) or None (CUDA). ``launcher.arch`` is the compute capability as an int.
``Recorded(launcher, source, name_expr, grid, block, args, shared_mem)``, ``Ptr(key, offset)``,
``Map(key, offset, template)``, ``Val(name, dtype)``
    a launch prepared once (plans): array arguments are ``Ptr`` slots bound per call; ``Map`` slots
    are by-value ``CUtensorMap`` arguments (TMA) encoded per call from the array's address; ``Val``
    slots the call's scalars (dropout's seed and offset).
``Replay(launcher, recorded, keys)``
    several recorded launches sharing their arrays: each distinct ``Ptr`` slot is bound once per
    call (``launcher.pointers``), each distinct ``Map`` slot encoded once per call
    (``launcher.tensor_map``), and every argument tuple gathered in one step.
``ArgBlock(template)``, ``Packed(launcher, recorded)``
    CUDA (and the no-op launcher that measures its host work): no argument tuples. A launch's
    arguments live in one ``kernelParams`` block, constants written at planning; per call only the
    slots are written (an address per ``Ptr``, the encoding of a ``Map`` in place, a ``Val``) and
    the driver's ``cuLaunchKernel`` is called (``cupy.cuda.driver.launchKernel``, on the current
    stream) — CuPy's ``RawKernel`` converts every argument to a C value per call (~0.5 µs each).
``launcher.carve(allocations)``
    new allocations cut into several arrays, with their handles (on CUDA addresses computed from
    the allocation's; on the emulator exact views, as it checks every access).
``empty(xp, shape, dtype)``, ``view_at(raw, offset, shape)``
    ``xp.empty``, 256-byte aligned on the host too (as CuPy's allocations are); a C-contiguous
    array at a byte offset of a 1-D allocation.
``batch_layout(batch_shape, arrays)`` / ``batch_plan`` -> list[BatchLaunch]
    merged (nb0, nb1, nb2), and per array its element offset (``batch_plan``: a flat view) +
    its three batch strides.
``source_digest()``, ``reload_sources()``
    the ``cuda_src`` hash, computed once per process; ``reload_sources`` drops it, the compiled
    modules and every cached plan.
``null_launches()``
    context manager: emulator launches do nothing (``benchmarks/overhead.py``).
``kernel_ready(a)``, ``element_strides(a)``
    copy only when the last axis is not contiguous; strides in elements.
``c_int(x)``, ``c_longlong(x)``, ``c_float(x)``, ``c_double(x)``, ``c_scalar(x, acc_dtype)``
    exact-C-type NumPy scalars (kernel arguments by value, as CuPy's RawKernel takes them).
"""
import ctypes
import functools
import hashlib
import itertools
import math
import operator
import os
import struct
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


_digest = None


def source_digest():
    """Content hash of ``cuda_src`` (all .cu/.cuh/.h/.cpp files), 16 hex digits.

    Computed once per process: launches never touch the file system. :func:`reload_sources`
    recomputes it (after editing a kernel in a running process).
    """
    global _digest
    if _digest is None:
        _digest = _source_tree_digest(cuda_src_dir())
    return _digest


#: Called by :func:`reload_sources` (plan caches register their ``clear`` here).
_on_reload = []


def reload_sources():
    """Re-read ``cuda_src``: new digest, compiled modules and prepared launch plans dropped.

    Kernels are compiled once per (source digest, instantiation) and plans are cached per call
    signature; a process that edits ``cuda_src`` calls this to see the edit.
    """
    global _digest
    with _lock:
        _source_tree_digest.cache_clear()
        _digest = None
        CupyLauncher._modules.clear()
        EmulatorLauncher._modules.clear()
        _launchers.clear()
    for clear in _on_reload:
        clear()


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
    """Compile-once, launch-many access to the kernels of ``cuda_src`` on one device.

    ``function(source, name_expr, shared_mem)`` resolves a kernel once (compiling it on first
    use) and returns ``call(grid, block, args)``; ``pointer(a, offset)`` is the kernel argument
    for array ``a`` starting ``offset`` elements in. Plans (:class:`Recorded`) keep the first and
    call the second per launch; :meth:`launch` does both (one-off launches, tests).
    """

    device = None
    arch = None
    #: Whether plans launch through kernel-parameter blocks (:class:`Packed`: :meth:`kernel_launch`,
    #: :meth:`encode_map`) rather than argument tuples (:meth:`function`).
    packs = False

    def function(self, source_name, name_expr, shared_mem=0):
        raise NotImplementedError

    def kernel_launch(self, rec, params):
        """``launch()``: launch :class:`Recorded` ``rec``'s kernel (grid, block, shared memory) with the
        kernel-parameter array at host address ``params`` (:class:`ArgBlock`), on the current stream."""
        raise NotImplementedError

    def encode_map(self, template, dest, dest_address, address):
        """Encode ``template`` (:class:`tensor_map.TiledTemplate`) for global ``address`` into the 16
        words ``dest`` (at host address ``dest_address``) of a kernel-parameter block."""
        raise NotImplementedError

    def map_address_word(self, template):
        """Index (0-15) of the one word of ``template``'s encoded map that holds the global address, or
        None. Found by encoding the map (:meth:`encode_map`) at three addresses: the encodings must
        differ in that word alone, which must hold each address itself — then a call can write the
        address there (:class:`Packed`) instead of encoding the map again (``cuTensorMapEncodeTiled``
        through ctypes: ~2-3 µs a map). An encoder that lays the address out otherwise gets None, and
        every call encodes. The CUtensorMap layout is the driver's (undocumented): hence the check, per
        template, on the encoder at hand."""
        words = np.zeros(16 * 4 + 8, np.uint64)
        start = -words.ctypes.data % _MAP_ALIGN // 8
        slots = [words[start + 16 * j:start + 16 * (j + 1)] for j in range(3)]
        try:
            for dest, address in zip(slots, _PROBE_ADDRESSES):
                self.encode_map(template, dest, dest.ctypes.data, address)
        except (RuntimeError, ValueError):  # an encoder that refuses an address it cannot check
            return None
        differ = np.flatnonzero((slots[0] != slots[1]) | (slots[0] != slots[2]))
        if len(differ) != 1:
            return None
        w = int(differ[0])
        if [int(dest[w]) for dest in slots] != list(_PROBE_ADDRESSES):
            return None
        return w

    def pointer(self, a, offset=0):
        raise NotImplementedError

    def handle(self, a):
        """What :meth:`pointer` needs of array ``a``, looked up once per call (plans)."""
        return a

    def empty(self, shape, dtype):
        """A new output array on this launcher's device (``xp.empty``: CuPy's are 256-byte aligned)."""
        return self.xp().empty(shape, dtype=dtype)

    def tensor_map(self, h, offset, template):
        """The by-value ``CUtensorMap`` argument of a :class:`Map` slot: ``template``
        (:class:`tensor_map.TiledTemplate`) at element ``offset`` of the array whose handle is ``h``."""
        raise NotImplementedError

    def pointers(self, handles, slots):
        """``[pointer(handles[i], offset) for i, offset in slots]``: every array argument of a
        :class:`Replay`, bound at once."""
        pointer = self.pointer
        return [pointer(handles[i], offset) for i, offset in slots]

    def carve(self, allocations):
        """New memory cut into arrays: ``allocations`` ``((dtype, nbytes, parts), ...)``, each one
        allocation of ``nbytes`` of ``dtype`` (256-byte aligned, :func:`empty`) holding ``parts``
        ``((byte offset, shape, array), ...)``. Returns ``(arrays, handles)``, one of each per part,
        in order. A part's array is None unless asked for (``array`` true) or the launcher needs
        it: the emulator takes an exact view of every part (it checks each access against the span
        of its argument); on CUDA a handle is an address, computed from the allocation's."""
        xp, arrays = self.xp(), []
        for dtype, nbytes, parts in allocations:
            raw = empty(xp, (nbytes // dtype.itemsize,), dtype)
            arrays += [view_at(raw, offset, shape) for offset, shape, _ in parts]
        return arrays, [self.handle(a) for a in arrays]

    def launch(self, source_name, name_expr, grid, block, args, shared_mem=0):
        return self.function(source_name, name_expr, shared_mem)(tuple(grid), tuple(block), tuple(args))

    def xp(self):
        raise NotImplementedError


#: Whether CUDA plans launch through kernel-parameter blocks (:class:`Packed`: one ``cuLaunchKernel`` with
#: the prepared argument bytes) rather than CuPy's ``RawKernel`` with an argument tuple (each argument
#: converted per call, ~0.5 µs). A switch for a GPU's verdict: plans made after it changes follow it
#: (``_clear_plans()`` drops the cached ones).
PACKED_LAUNCHES = True

#: Sources whose kernels use arch-specific features (wgmma, setmaxnreg: ``sm_90a``), by device arch:
#: the NVRTC target to compile them for. CuPy's RawModule compiles for the plain arch it adds
#: itself (``-arch=sm_90``), which those wrappers refuse, so the CuPy path compiles them with
#: :mod:`nvrtc` and loads the cubin (:meth:`CupyLauncher._arch_specific`).
ARCH_SPECIFIC = {"flash_fwd_sm90.cu": {90: "sm_90a"}}


def cubin_cache_dir():
    """Where the CuPy path keeps the cubins of :data:`ARCH_SPECIFIC` sources (next to the
    emulator's cache: ``$FLASHARRAY_EMULATOR_CACHE/../cubin`` or ``~/.cache/flasharray/cubin``)."""
    from ..emulator import cache_dir
    return Path(cache_dir()).parent / "cubin"


class CupyLauncher(Launcher):
    """CuPy + NVRTC; launches on CuPy's current stream (read at each launch, never cached).

    ``arch`` older than the GPU's (e.g. 75 on an H100): plans take that architecture's tiles and every
    kernel is compiled to its PTX (``__CUDA_ARCH__`` = 750: no cp.async, m16n8k8 MMAs, fa::kSyncCopy),
    which the driver compiles for the GPU — the older architecture's code paths on real hardware, for
    their correctness (not their speed). A newer ``arch`` than the GPU's is a ``ValueError``.
    """

    device = "cuda"
    _modules = {}

    @property
    def packs(self):
        return PACKED_LAUNCHES

    def __init__(self, device_id=None, arch=None):
        import cupy  # lazy: importing flasharray never needs a GPU
        self._cupy = cupy
        dev = cupy.cuda.Device(device_id)
        self._tls = threading.local()
        self.device_id = dev.id
        self.arch = int(dev.compute_capability)
        self.ptx_arch = None  # the older architecture whose PTX runs here
        if arch is not None and int(arch) != self.arch:
            if int(arch) > self.arch:
                raise ValueError("flasharray: arch=sm_%d needs a GPU of that architecture or newer; this one is "
                                 "sm_%d" % (int(arch), self.arch))
            self.arch = self.ptx_arch = int(arch)
        self.sm_count = int(dev.attributes["MultiProcessorCount"])

    def xp(self):
        return self._cupy

    def _function(self, source_name, name_expr):
        key = (self.device_id, self.ptx_arch, source_name, source_digest(), name_expr)
        with _lock:
            fn = self._modules.get(key)
            if fn is None:
                target = ARCH_SPECIFIC.get(source_name, {}).get(self.arch)
                if self.ptx_arch is not None:
                    fn = self._arch_specific(source_name, name_expr, "sm_%d" % self.ptx_arch, ptx=True)
                elif target is not None:
                    fn = self._arch_specific(source_name, name_expr, target)
                else:
                    mod = self._cupy.RawModule(code=kernel_source(source_name), options=cuda_compile_options(),
                                               name_expressions=[name_expr])
                    fn = mod.get_function(name_expr)
                self._modules[key] = fn
        return fn

    def _arch_specific(self, source_name, name_expr, target, ptx=False):
        """The kernel ``name_expr`` compiled by :mod:`nvrtc` for ``target`` (e.g. ``sm_90a``) with the
        CuPy path's options, its cubin (``ptx``: its PTX, which the driver compiles for the GPU) cached by
        source digest and name, loaded by CuPy."""
        from . import nvrtc
        tag = hashlib.sha256(("%s|%s|%s" % (source_name, name_expr, target)).encode()).hexdigest()[:16]
        path = cubin_cache_dir() / ("%s-%s-%s.%s" % (source_digest(), target, tag, "ptx" if ptx else "cubin"))
        lowered = path.with_suffix(".name")
        if not (path.exists() and lowered.exists()):
            res = nvrtc.compile_cubin(kernel_source(source_name), target, [name_expr], options=cuda_compile_options())
            path.parent.mkdir(parents=True, exist_ok=True)
            binary = res.ptx.encode() if ptx else res.cubin
            for dst, data in ((lowered, res.lowered_names[name_expr].encode()), (path, binary)):
                tmp = dst.with_suffix(".tmp%d" % os.getpid())
                tmp.write_bytes(data)
                os.replace(tmp, dst)
        return self._cupy.RawModule(path=str(path)).get_function(lowered.read_text())

    def function(self, source_name, name_expr, shared_mem=0):
        fn = self._function(source_name, name_expr)
        if shared_mem > 48 * 1024 and fn.max_dynamic_shared_size_bytes < shared_mem:
            fn.max_dynamic_shared_size_bytes = shared_mem  # opt-in beyond 48 KB

        def call(grid, block, args):
            fn(grid, block, args, shared_mem=shared_mem)

        return call

    def kernel_launch(self, rec, params):
        # The driver's launch, as CuPy's RawKernel makes it (cupy/cuda/function.pyx: cuLaunchKernel
        # on the current stream, the calling thread's context made current first), without its
        # conversion of every argument to a C value per call: ~0.5 us each, 60 arguments here.
        fn = self._function(rec.source, rec.name)  # resolved (and opted in) by rec.call already
        cuda = self._cupy.cuda
        launch = functools.partial(cuda.driver.launchKernel, fn.kernel.ptr, *(max(1, g) for g in rec.grid),
                                   *(max(1, b) for b in rec.block), rec.shared_mem)
        stream, ready, tls = cuda.get_current_stream, self._context_ready, self._tls

        def go():
            if not getattr(tls, "ready", False):
                ready()
            launch(stream().ptr, params, 0)

        return go

    def _context_ready(self):
        """Once per thread: a runtime call binds the device's primary context to the thread (CuPy's
        ``runtime._ensure_context``), which the driver's launch needs."""
        self._cupy.cuda.runtime.memGetInfo()
        self._tls.ready = True

    def encode_map(self, template, dest, dest_address, address):
        template.driver_encode(dest_address, address)

    def handle(self, a):
        return device_address(a), a.itemsize

    def tensor_map(self, h, offset, template):
        # the driver's encoding (cuTensorMapEncodeTiled), 128 bytes passed by value
        return template.driver_arg(h[0] + offset * h[1])

    def pointer(self, h, offset=0):
        # A device pointer passed by value: 8 bytes, what a ``T*`` kernel parameter holds.
        # ``h``: the handle of an array (address of element 0, itemsize).
        return np.uint64(h[0] + offset * h[1])

    def pointers(self, handles, slots):
        # one array conversion: cheaper than a numpy.uint64 per slot; its items are numpy.uint64
        return list(np.array([handles[i][0] + offset * handles[i][1] if offset else handles[i][0]
                              for i, offset in slots], dtype=np.uint64))

    def carve(self, allocations):
        arrays, handles = [], []
        for dtype, nbytes, parts in allocations:
            raw = self._cupy.empty(nbytes // dtype.itemsize, dtype=dtype)
            base, size = device_address(raw), dtype.itemsize
            for offset, shape, array in parts:
                arrays.append(view_at(raw, offset, shape) if array else None)
                handles.append((base + offset, size))
        return arrays, handles


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

    def function(self, source_name, name_expr, shared_mem=0):
        mod = self._module(source_name, name_expr)
        schedule, seed = self.schedule, self.seed

        def call(grid, block, args):
            return mod.launch(name_expr, grid, block, args, shared_mem=shared_mem,
                              schedule=schedule, seed=seed)

        return call

    def pointer(self, a, offset=0):
        # The emulator checks every access: it gets the exact span the kernel may reach.
        return flat_view(a, offset)

    def tensor_map(self, a, offset, template):
        # the emulator's encoding over the exact span (it checks every TMA access against it)
        return template.emulator_map(flat_view(a, offset))

    def empty(self, shape, dtype):
        """256-byte aligned as CuPy's (:func:`empty`): the emulator's sector counts are the GPU's."""
        return empty(np, shape, dtype)


class NullLauncher(EmulatorLauncher):
    """The emulator's planning with launches that do nothing (``benchmarks/overhead.py``).

    Kernels are neither compiled nor run. Pointers are bound as :class:`CupyLauncher` binds them
    (an address per array argument; NumPy's address lookup costs more than CuPy's), so the host
    work measured is the CUDA path's, minus the driver's launch.
    """

    device = "emulator"

    def function(self, source_name, name_expr, shared_mem=0):
        def call(grid, block, args):
            return None

        return call

    def handle(self, a):
        return a.ctypes.data, a.itemsize  # as CupyLauncher.handle, for NumPy

    def empty(self, shape, dtype):
        return np.empty(shape, dtype=dtype)  # CupyLauncher's cost (cupy.empty); alignment unused

    def carve(self, allocations):
        # as CupyLauncher.carve; the address comes with the (host-aligned) allocation
        arrays, handles = [], []
        for dtype, nbytes, parts in allocations:
            raw = np.empty(nbytes + 256, dtype=np.uint8)  # _host_bytes, inlined: this is the hot path
            address = ctypes.addressof(ctypes.c_char.from_buffer(raw))
            start = -address % 256
            base, size = address + start, dtype.itemsize
            for offset, shape, array in parts:
                arrays.append(np.ndarray(shape, dtype, raw, start + offset) if array else None)
                handles.append((base + offset, size))
        return arrays, handles

    pointer = CupyLauncher.pointer
    pointers = CupyLauncher.pointers
    packs = True

    def kernel_launch(self, rec, params):
        return _no_launch

    def encode_map(self, template, dest, dest_address, address):
        # the emulator's words at the CUDA path's address: the per-call encoding work without a driver
        template.emulator_encode(dest, address)

    def tensor_map(self, h, offset, template):
        # the emulator's words at the CUDA path's address: the per-call encoding work without a driver
        return template.emulator_arg(h[0] + offset * h[1])


def _no_launch():
    return None


_launchers = {}
_null = [False]
_serial = itertools.count()


def make_launcher(device, schedule="forward", seed=0, arch=None, **_ignored):
    """The launcher for ``device`` ("cuda": CuPy's current device; "emulator"), shared per process.

    ``schedule``/``seed`` are the emulator's fiber schedule; ``arch`` picks its tile table (on CUDA an
    older architecture than the GPU's runs that architecture's code: :class:`CupyLauncher`).
    """
    if device == "cuda":
        import cupy
        from .tiles import arch_number
        key = ("cuda", cupy.cuda.runtime.getDevice(), None if arch is None else arch_number(arch))
        make = lambda: CupyLauncher(key[1], arch=key[2])  # noqa: E731
    elif device == "emulator":
        schedule = schedule or "forward"
        seed = 0 if seed is None else seed
        key = ("emulator", schedule, seed, arch, _null[0])
        cls = NullLauncher if _null[0] else EmulatorLauncher
        make = lambda: cls(schedule=schedule, seed=seed, arch=arch)  # noqa: E731
    else:
        raise ValueError("flasharray: device must be 'cuda' or 'emulator', got %r" % (device,))
    launcher = _launchers.get(key)
    if launcher is None:
        launcher = make()
        launcher.plan_key = (key, next(_serial))  # unique for the process: plans key on it
        _launchers[key] = launcher
    return launcher


class null_launches:
    """Context manager: emulator launches become no-ops (host overhead measurements).

    Entering and leaving drops the cached plans, so no plan made inside outlives it.
    """

    def __enter__(self):
        _null[0] = True
        _clear_plans()
        return self

    def __exit__(self, *exc):
        _null[0] = False
        _clear_plans()
        return False


def _clear_plans():
    for clear in _on_reload:
        clear()


# ---- prepared launches -------------------------------------------------------------------------------

class Ptr:
    """Placeholder for an array argument of a :class:`Recorded` launch: ``arrays[key]``, ``offset``
    elements past its element 0."""

    __slots__ = ("key", "offset")

    def __init__(self, key, offset=0):
        self.key = key
        self.offset = int(offset)

    def __repr__(self):
        return "Ptr(%r, %d)" % (self.key, self.offset)


class Map:
    """Placeholder for a by-value ``const __grid_constant__ CUtensorMap`` argument of a
    :class:`Recorded` launch: ``template`` (:class:`tensor_map.TiledTemplate`, the geometry fixed at
    planning) encoded per call at ``arrays[key]``, ``offset`` elements past its element 0
    (``launcher.tensor_map``: the driver's encoding on CUDA, the emulator's over the exact span)."""

    __slots__ = ("key", "offset", "template")

    def __init__(self, key, offset, template):
        self.key = key
        self.offset = int(offset)
        self.template = template

    def __repr__(self):
        return "Map(%r, %d, box=%r)" % (self.key, self.offset, self.template.box_dim)


class Val:
    """Placeholder for a per-call scalar argument (dropout's seed and offset) of a :class:`Recorded`
    launch: ``values[name]`` of the call, a ``dtype`` scalar (the last entry of the handles of a
    :class:`Recorded` call; the ``values`` of a :class:`Replay` call)."""

    __slots__ = ("name", "dtype")

    def __init__(self, name, dtype=np.uint32):
        self.name = name
        self.dtype = np.dtype(dtype)


class Recorded:
    """One kernel launch prepared once: the function resolved, grid/block fixed, every scalar
    argument built; only the :class:`Ptr` slots are bound per call (``pointer(handles[key],
    offset)``, the handles from ``launcher.handle`` once per array and call), the :class:`Map`
    slots, if any (``launcher.tensor_map(handles[key], offset, template)``), and the :class:`Val`
    slots (the call's scalars: the last entry of ``handles`` is then a dict of them).

    On CUDA the launch goes through :attr:`packed` (:class:`Packed`: the arguments' bytes kept in
    one kernel-parameter block, only the slots rewritten per call); elsewhere an argument tuple is
    built per call for ``call`` (the emulator checks every argument against the kernel's types)."""

    __slots__ = ("name", "source", "call", "grid", "block", "shared_mem", "template", "slots", "maps", "values",
                 "tensor_map", "packed")

    def __init__(self, launcher, source_name, name_expr, grid, block, args, shared_mem=0):
        self.name = name_expr
        self.source = source_name
        self.call = launcher.function(source_name, name_expr, shared_mem)
        self.grid = tuple(int(x) for x in grid)
        self.block = tuple(int(x) for x in block) if isinstance(block, tuple) else (int(block), 1, 1)
        self.shared_mem = int(shared_mem)
        self.template = list(args)
        self.slots = tuple((i, a.key, a.offset) for i, a in enumerate(args) if isinstance(a, Ptr))
        self.maps = tuple((i, a.key, a.offset, a.template) for i, a in enumerate(args) if isinstance(a, Map))
        self.values = tuple((i, a.name) for i, a in enumerate(args) if isinstance(a, Val))
        self.tensor_map = launcher.tensor_map if self.maps else None
        self.packed = launcher if launcher.packs else None  # made at the first call (a Replay makes its own)

    def __call__(self, pointer, arrays):
        packed = self.packed
        if packed is not None:
            if not isinstance(packed, Packed):
                packed = self.packed = Packed(packed, self)
            return packed(arrays, arrays[-1] if self.values else None)
        return self.call(self.grid, self.block, self.arguments(pointer, arrays))

    def arguments(self, pointer, arrays):
        """The argument tuple of a call with the handles ``arrays`` (:meth:`call`'s third argument)."""
        args = self.template.copy()
        for i, key, offset in self.slots:
            args[i] = pointer(arrays[key], offset)
        for i, key, offset, template in self.maps:
            args[i] = self.tensor_map(arrays[key], offset, template)
        if self.values:
            values = arrays[-1]
            for i, name in self.values:
                args[i] = values[name]
        return tuple(args)


class Replay:
    """Recorded launches that share their arrays, replayed together.

    ``keys`` orders the arrays: a call passes their handles in that order. Each distinct
    ``Ptr(key, offset)`` of all the launches is bound once per call (``launcher.pointers``: on
    CUDA one ``numpy.uint64`` per slot, however many launches use it) and each launch's argument
    tuple is gathered from the bound pointers and the constants by one ``operator.itemgetter``.
    On CUDA each launch goes through its own :class:`Packed` block instead (no argument tuples).
    """

    def __init__(self, launcher, recorded, keys):
        index = {key: i for i, key in enumerate(keys)}
        slots, maps, consts, gathers = {}, {}, [], []
        for rec in recorded:
            where = []
            for a in rec.template:
                if isinstance(a, Ptr):
                    where.append((0, slots.setdefault((index[a.key], a.offset), len(slots))))
                elif isinstance(a, Map):  # one encoding per distinct (array, offset, template) and call
                    where.append((1, maps.setdefault((index[a.key], a.offset, a.template), len(maps))))
                else:
                    where.append((2, len(consts)))  # constants follow the pointers and maps
                    consts.append(a)
            gathers.append(where)
        base = (0, len(slots), len(slots) + len(maps))
        self.launcher = launcher
        self._pointers = launcher.pointers
        self._tensor_map = launcher.tensor_map
        self.slots = tuple(slots)
        self.maps = tuple(maps)
        self.consts = consts
        self.values = tuple((i, c.name) for i, c in enumerate(consts) if isinstance(c, Val))
        self.names = [rec.name for rec in recorded]
        self.launches = [(rec.call, rec.grid, rec.block, _gather([base[kind] + i for kind, i in where]))
                         for rec, where in zip(recorded, gathers)]
        self.packed = ([Packed(launcher, rec, index.__getitem__) for rec in recorded]
                       if launcher.packs else None)

    def __call__(self, handles, counters=None, values=None):
        """Launch every recorded launch with the arrays of ``handles`` (``launcher.handle`` of each
        array, in the order of ``keys``) and the per-call scalars ``values`` (a dict, for the
        :class:`Val` slots); ``counters``: ``(name, counters)`` appended per launch.
        :class:`Map` slots are encoded once per call (``launcher.tensor_map``)."""
        if self.packed is not None:
            for packed in self.packed:
                packed(handles, values)
            return
        args = self._pointers(handles, self.slots)
        if self.maps:
            args = list(args) + [self._tensor_map(handles[i], offset, template) for i, offset, template in self.maps]
        consts = self.consts
        if self.values:
            consts = consts.copy()
            for i, name in self.values:
                consts[i] = values[name]
        args = args + consts
        if counters is None:
            for call, grid, block, gather in self.launches:
                call(grid, block, gather(args))
            return
        for name, (call, grid, block, gather) in zip(self.names, self.launches):
            counters.append((name, call(grid, block, gather(args))))


# ---- kernel-parameter blocks (CUDA) ---------------------------------------------------------------------

def _slot_bytes(kind, a):
    """Bytes of a :class:`Ptr` (8), :class:`Map` (128) or :class:`Val` (its dtype's) slot."""
    return 8 if kind is Ptr else 128 if kind is Map else a.dtype.itemsize


#: struct codes of the by-value argument types (Python int / float / bool as CuPy passes them: 64-bit);
#: other NumPy scalar types (bfloat16) are packed as their bytes.
_STRUCT_CODES = {np.int8: "b", np.uint8: "B", np.int16: "h", np.uint16: "H", np.int32: "i", np.uint32: "I",
                 np.int64: "q", np.uint64: "Q", np.float16: "e", np.float32: "f", np.float64: "d", np.bool_: "?",
                 int: "q", float: "d", bool: "?"}
_LAYOUTS = {}


_MAP_ALIGN = 128   # host alignment of a CUtensorMap's bytes (CUDA 13's CUtensorMap; 12.x needs 64)


def _layout_of(template):
    """``(offsets, end, struct format, indices of the constants, those passed as bytes)`` of a template,
    cached per argument kinds (plans of one kernel share it): every argument at an 8-byte aligned offset,
    128 for one over 8 bytes (a CUtensorMap: its encoder writes it there, CUDA 13 documents 128-byte
    alignment, 12.x 64); the slots (Ptr, Map, Val) zeros."""
    kinds = tuple([(Val, a.dtype.itemsize) if type(a) is Val else type(a) for a in template])
    layout = _LAYOUTS.get(kinds)
    if layout is None:
        offsets, fmt, where, as_bytes, end = [], ["<"], [], [], 0
        for i, k in enumerate(kinds):
            code = None if k in (Ptr, Map) or type(k) is tuple else _STRUCT_CODES.get(k)
            if code is None and not (k in (Ptr, Map) or type(k) is tuple):
                if not (isinstance(k, type) and issubclass(k, np.generic)):
                    raise TypeError("flasharray: kernel argument of type %s has no by-value bytes" % k.__name__)
                code = "%ds" % np.dtype(k).itemsize
                as_bytes.append(len(where))
            size = struct.calcsize("<" + code) if code else k[1] if type(k) is tuple else _slot_bytes(k, None)
            align = _MAP_ALIGN if size > 8 else 8
            at = -(-end // align) * align
            offsets.append(at)
            if code:
                where.append(i)
            fmt.append("%dx%s" % (at - end, code or "%dx" % size))
            end = at + -(-size // 8) * 8
            fmt.append("%dx" % (end - at - size))
        layout = _LAYOUTS[kinds] = (tuple(offsets), end, "".join(fmt), tuple(where), tuple(as_bytes))
    return layout


#: The global addresses :meth:`Launcher.map_address_word` encodes a map at (16-byte aligned, every
#: byte of the three different).
_PROBE_ADDRESSES = (0x7F1234567890, 0x5A0B0C0D0E10, 0x3C4D5E6F7A80)


class ArgBlock:
    """The ``kernelParams`` of one prepared launch (``cuLaunchKernel``): every argument's bytes in one
    host buffer, at 8-byte aligned offsets (128 for arguments over 8 bytes: a ``CUtensorMap``'s
    alignment, which its encoder needs), and :attr:`params`, the address of the array of their
    addresses. The constants are written once; a call rewrites only its slots (:class:`Packed`).
    The driver copies the arguments at the launch, so the block may be rewritten after it returns.
    """

    __slots__ = ("offsets", "raw", "base", "words", "argv", "params")

    def __init__(self, template):
        offsets, end, fmt, where, as_bytes = _layout_of(template)
        values = [template[i] for i in where]
        for j in as_bytes:
            values[j] = values[j].tobytes()
        data = struct.pack(fmt, *values)  # the constants, in one call
        self.offsets = offsets
        self.raw = np.zeros(end + _MAP_ALIGN, np.uint8)
        start = -self.raw.ctypes.data % _MAP_ALIGN
        self.base = self.raw.ctypes.data + start
        self.raw[start:start + end] = np.frombuffer(data, np.uint8)
        self.words = self.raw[start:start + end].view(np.uint64)  # the pointer slots: one word each
        self.argv = np.array([self.base + off for off in offsets] or [0], dtype=np.uint64)
        self.params = self.argv.ctypes.data

    def word(self, i):
        """Index in :attr:`words` of argument ``i`` (8-byte aligned)."""
        return self.offsets[i] // 8

    def scalar(self, i, dtype):
        """A one-element ``dtype`` view of argument ``i``'s bytes (``view[0] = value`` sets it)."""
        return self.words[self.word(i):].view(np.uint8)[:np.dtype(dtype).itemsize].view(dtype)

    def argument(self, i, nbytes):
        """The ``nbytes`` bytes of argument ``i``, as they are now (tests, diagnostics)."""
        off = self.offsets[i]
        return self.words.view(np.uint8)[off:off + nbytes].tobytes()


class Packed:
    """One :class:`Recorded` launch through an :class:`ArgBlock`: per call the array addresses of its
    :class:`Ptr` slots (one word each), its :class:`Map` slots (the address word where
    :meth:`Launcher.map_address_word` found one: the map is encoded once, here; else encoded in
    place per call) and its :class:`Val` slots are written, and the kernel launched (``launcher.kernel_launch``: one
    ``cuLaunchKernel`` on CUDA) — no argument objects, no per-argument conversion. ``index``
    maps a slot's key to its position in the call's handles (:class:`Replay`; default: the key
    itself). A lock makes concurrent calls of one plan take turns over the block."""

    __slots__ = ("name", "block", "ptrs", "maps", "map_ptrs", "vals", "launch", "encode", "lock")

    def __init__(self, launcher, rec, index=None):
        index = index or (lambda key: key)
        block = self.block = ArgBlock(rec.template)
        self.name = rec.name
        self.ptrs = tuple((block.word(i), index(key), offset) for i, key, offset in rec.slots)
        maps, map_ptrs = [], []
        for i, key, offset, template in rec.maps:
            dest, dest_address = block.words[block.word(i):block.word(i) + 16], block.base + block.offsets[i]
            w = launcher.map_address_word(template)
            if w is None:  # encoded per call
                maps.append((dest, dest_address, index(key), offset, template))
            else:  # encoded once here; a call writes the address word
                launcher.encode_map(template, dest, dest_address, _PROBE_ADDRESSES[0])
                map_ptrs.append((block.word(i) + w, index(key), offset))
        self.maps, self.map_ptrs = tuple(maps), tuple(map_ptrs)
        self.vals = tuple((block.scalar(i, rec.template[i].dtype), name) for i, name in rec.values)
        self.launch = launcher.kernel_launch(rec, block.params)
        self.encode = launcher.encode_map
        self.lock = threading.Lock()

    def __call__(self, handles, values=None):
        words = self.block.words
        with self.lock:
            for w, i, offset in self.ptrs:
                h = handles[i]
                words[w] = h[0] + offset * h[1]
            for w, i, offset in self.map_ptrs:
                h = handles[i]
                address = h[0] + offset * h[1]
                if address % 16:
                    raise ValueError("global address 0x%x of a tensor map is not 16-byte aligned" % address)
                words[w] = address
            for dest, dest_address, i, offset, template in self.maps:
                h = handles[i]
                self.encode(template, dest, dest_address, h[0] + offset * h[1])
            for view, name in self.vals:
                view[0] = values[name]
            self.launch()


def _gather(indices):
    """``f(values) -> tuple(values[i] for i in indices)`` (an itemgetter, whose result is a tuple
    only for two indices or more)."""
    if len(indices) >= 2:
        return operator.itemgetter(*indices)
    return lambda values: tuple(values[i] for i in indices)


# ---- arrays as kernel arguments ----------------------------------------------------------------------

def xp_of(a):
    """numpy or cupy, by the array's type."""
    if isinstance(a, np.ndarray):
        return np
    import cupy
    return cupy


def device_address(a):
    """Address of element 0: ``a.data.ptr`` for a CuPy array, ``a.ctypes.data`` for a NumPy one
    (the emulator's alignment checks; the CuPy stand-in of the tests)."""
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr


def host_address(a):
    """Address of element 0 of the NumPy array ``a``, as ``a.ctypes.data`` but, for a writable
    C-contiguous array (the common case), through a ctypes view of its buffer: ~0.5 µs instead of
    ~1.5 (``a.ctypes`` builds an object per call). Other arrays (read-only, strided, empty) take
    ``a.ctypes.data``."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError, BufferError):
        return a.ctypes.data


def _host_bytes(nbytes):
    """``(raw, start, address)``: new host memory, ``nbytes`` of it from byte ``start`` of the uint8
    array ``raw`` on, at ``address``, a multiple of 256."""
    raw = np.empty(nbytes + 256, dtype=np.uint8)
    address = ctypes.addressof(ctypes.c_char.from_buffer(raw))  # raw is ours: writable, contiguous
    start = -address % 256
    return raw, start, address + start


def empty(xp, shape, dtype):
    """``xp.empty(shape, dtype)``, 256-byte aligned on the host too, as CuPy's allocations are:
    the kernels' 16-byte stores need 16-byte aligned rows, and the emulator's sector counts
    assume CuPy's alignment."""
    if xp is not np:
        return xp.empty(shape, dtype=dtype)
    dtype = np.dtype(dtype)
    raw, start, _ = _host_bytes(math.prod(shape) * dtype.itemsize)
    return np.ndarray(shape, dtype, raw, start)


def view_at(raw, offset, shape):
    """The C-contiguous array of ``shape`` at byte ``offset`` of the 1-D array ``raw`` (its dtype)."""
    if isinstance(raw, np.ndarray):
        return np.ndarray(shape, raw.dtype, raw, offset)
    return type(raw)(shape, raw.dtype, memptr=raw.data + offset)  # cupy.ndarray


def stand_in(shape, dtype, strides=None):
    """An array of ``shape`` with byte ``strides`` (default C-contiguous) and no memory: what
    planning needs of a tensor that is allocated, copied or re-viewed per call."""
    dtype = np.dtype(dtype)
    if strides is None:
        st, acc = [], dtype.itemsize
        for n in reversed(shape):
            st.append(acc)
            acc *= max(int(n), 1)
        strides = reversed(st)
    return np.lib.stride_tricks.as_strided(np.empty(0, dtype), tuple(shape), tuple(strides))


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
        self.tensors = tensors    # list of (offset or flat view, (s_b0, s_b1, s_b2))

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
    """:func:`batch_layout` with each tensor's element offset turned into a flat view."""
    return [BatchLaunch(part.dims, [(flat_view(a, off), st) for a, (off, st) in zip(arrays, part.tensors)])
            for part in batch_layout(batch_shape, arrays, max_dims)]


def batch_layout(batch_shape, arrays, max_dims=3):
    """Split a batched launch into launches with at most ``max_dims`` merged batch dims.

    ``arrays``: tensors whose leading ``len(batch_shape)`` dims are the batch dims (size
    ``batch_shape[i]`` or 1 = broadcast). Returns a list of :class:`BatchLaunch`; each holds the
    padded (nb0, nb1, nb2) and, per tensor, the element offset of that launch's first element
    and the three batch strides (elements). Dims that do not fit (more than ``max_dims`` after
    merging, or grid.y / grid.z above ``MAX_GRID_YZ``) become host loops, the outermost first;
    a single dim that alone exceeds the limit is launched in chunks. Depends only on shapes and
    strides, so plans compute it once.
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
                tensors.append((base[t] + chunk_off[t], tuple(st[t] for _, st in padded)))
            launches.append(BatchLaunch(tuple(n for n, _ in padded), tensors))
    return launches
