"""Run CUDA kernels on the CPU with exact warp-level semantics.

The emulator compiles a CUDA source written against ``fa_port.cuh`` (flasharray's portability
header) with the host C++ compiler and runs it on the CPU: every CUDA thread is a fiber,
``__syncthreads()`` is a block rendezvous, and every warp collective (shuffles, ``__syncwarp``,
``fa::ldmatrix``, ``fa::mma_m16n8k16``) is a warp rendezvous evaluated once with the PTX ISA
semantics. ``fa::cp_async`` copies are performed by the ``fa::cp_async_wait`` that covers them,
so a missing wait reads stale data. Global memory accesses are bounds-checked against the
launch's arrays and counted.

Example
-------
>>> import numpy as np
>>> from flasharray import emulator
>>> src = r'''
... #include "fa_port.cuh"
... template <class T>
... __global__ void axpy(T* y, const T* x, T a, int n) {
...     int i = blockIdx.x * blockDim.x + threadIdx.x;
...     if (i < n) fa::gstore(y + i, a * fa::gload(x + i) + fa::gload(y + i));
... }
... '''
>>> mod = emulator.Module(src, name_expressions=["axpy<float>"])
>>> x = np.ones(100, np.float32); y = np.zeros(100, np.float32)
>>> counters = mod.launch("axpy<float>", (4,), (32,), (y, x, np.float32(2), np.int32(100)))
>>> float(y[0]), counters.global_read_bytes
(2.0, 800)

Arguments are passed like CuPy's ``RawKernel``: NumPy arrays become device pointers (the
emulator reads and writes the array's memory in place), NumPy scalars are passed by value.
Each argument is checked against the kernel's parameter type; a mismatch is a ``TypeError``.
"""
import ctypes
import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from flasharray._private import host_compiler as _hc
from flasharray._private.sources import cuda_src_dir
from flasharray._private.tensor_map import TensorMap, aligned_words as _aligned_words, encode_tiled as encode_tensor_map

__all__ = ["Module", "Kernel", "Counters", "BufferTraffic", "EmulatorError", "CompileError",
           "cache_dir", "host_compiler", "switch_cost_ns", "TensorMap", "encode_tensor_map"]

_ABI_VERSION = 8
_MAX_SHARED_MEM = 227 * 1024      # largest per-block shared memory of any GPU (sm_90)
_SCHEDULES = {"forward": 0, "reverse": 1, "random": 2}
_RUNTIME_SOURCES = ("emu/fa_emu_runtime.cpp", "emu/fa_emu_api.h", "emu/fa_emu_memstats.h")


class EmulatorError(RuntimeError):
    """A kernel did something that is undefined or wrong on a GPU.

    The message names the kernel, the block and thread (with warp and lane), and what happened:
    an out-of-bounds or misaligned access (with the buffer and byte offset), a barrier some
    threads never reach, an incomplete warp collective, a read of a pending ``cp.async``
    destination, a fault inside a fiber.
    """


class CompileError(RuntimeError):
    """The host compiler rejected the source (or is missing); ``log`` holds its full output.

    The message names the compiler and its version, the first error, the command, and says that
    ``CXX=`` chooses another compiler.
    """

    def __init__(self, message, log=""):
        super().__init__(message)
        self.log = log


@dataclasses.dataclass
class BufferTraffic:
    """Global-memory traffic of one array argument: bytes, and the 32-byte sectors its warp-wide
    loads and stores touched against the minimum for the bytes they moved (see :class:`Counters`)."""
    read_bytes: int
    write_bytes: int
    read_sectors: int = 0
    read_sectors_ideal: int = 0
    write_sectors: int = 0
    write_sectors_ideal: int = 0

    @property
    def read_sector_efficiency(self):
        """Ideal over touched sectors of the loads (1.0: perfectly coalesced)."""
        return _ratio(self.read_sectors_ideal, self.read_sectors)

    @property
    def write_sector_efficiency(self):
        """Ideal over touched sectors of the stores and atomics (1.0: perfectly coalesced)."""
        return _ratio(self.write_sectors_ideal, self.write_sectors)


def _ratio(num, den):
    return num / den if den else 1.0


@dataclasses.dataclass
class Counters:
    """What one launch did, summed over all blocks.

    ``global_read_bytes`` / ``global_write_bytes`` count every byte moved by ``fa::gload``,
    ``fa::gstore``, ``fa::atomic_add`` (read and write) and ``fa::cp_async`` (the ``src_bytes``
    actually read): the kernel's HBM traffic. ``buffers`` maps each array argument's index to its
    share. ``mma``, ``ldmatrix``, ``shuffles``, ``votes`` (``__ballot_sync``/``__any_sync``/
    ``__all_sync``) and ``syncwarps`` count warp-level instructions (one per warp), ``cp_async``
    counts per-thread copies, ``barriers`` counts completed ``__syncthreads()`` (one per block and
    barrier), ``atomics`` per-thread atomic adds, ``fiber_switches`` context switches.

    ``ldmatrix_wavefronts`` counts the shared-memory wavefronts the ``fa::ldmatrix`` calls need on
    the hardware (32 banks of 4 bytes; each 8×8 matrix's 8 row addresses form one phase, which
    takes as many wavefronts as its most-used bank has distinct words), and
    ``ldmatrix_wavefronts_ideal`` the conflict-free count (one per matrix); their ratio is the
    average bank-conflict degree (:attr:`ldmatrix_conflict_factor`). ``stmatrix_wavefronts`` /
    ``stmatrix_wavefronts_ideal`` count the ``fa::stmatrix`` calls' the same way (one phase per 8 x 8 matrix,
    :attr:`stmatrix_conflict_factor`).

    The per-thread ``fa::`` memory calls are regrouped into warp instructions (a thread's k-th call
    from one call site since the block's last barrier) to measure what the hardware would do:
    ``gld_sectors`` / ``gst_sectors`` count the 32-byte global sectors each warp-wide load
    (including ``cp.async`` sources) / store (including atomics) touches, ``*_ideal`` the minimum
    for the bytes moved (``ceil(unique bytes / 32)``); :attr:`load_sector_efficiency` and
    :attr:`store_sector_efficiency` are their ratios, and ``buffers`` has them per array.
    ``cp_async_smem_wavefronts`` counts the shared-memory wavefronts of the ``cp.async``
    destinations (phases of 8 lanes for 16-byte copies) against one per 128 bytes.
    ``cp_async_lines`` and ``cp_async_sectors`` model what an H100 measured for the copies (LDGSTS:
    docs/gpu_h200.md, *Fourth GPU session*; docs/emulator.md). ``cp_async_lines`` counts the distinct 128-byte
    shared-memory lines each phase's destinations touch (ideal: one per 128 bytes). ``cp_async_sectors`` counts the
    distinct (32-byte global sector, 32-byte shared slot) pairs the copied bytes form (ideal: one per 32 source
    bytes). Rows padded to 272 bytes cost 1.5x the sectors (24 against 16 per two-row instruction) and ~1.9x the
    lines. Unpadded or XOR-swizzled rows cost the ideal (:attr:`cp_async_line_factor`,
    :attr:`cp_async_sector_factor`).

    ``sem_waits`` counts ``fa::sem_wait`` calls (one per block and call), ``sem_blocked`` those
    that found the counter short of the expected value and suspended their block.

    ``bulk_copies`` / ``bulk_copy_bytes`` count ``fa::cp_async_bulk_g2s`` calls and bytes (their
    sources are in ``global_read_bytes`` and the sector counts too), ``mbar_waits`` the mbarrier
    parity waits and ``mbar_blocked`` those that found the phase incomplete and suspended the thread.
    ``wgmma`` counts the ``wgmma.mma_async`` instructions (one per warpgroup issue, whatever N).
    ``tma_loads`` / ``tma_stores`` count ``fa::tma_load_*`` / ``fa::tma_store_*`` calls and
    ``tma_load_bytes`` / ``tma_store_bytes`` their box bytes (out-of-bounds elements included); the
    in-bounds elements count in the global bytes and sectors. ``named_barriers`` counts completed
    named barriers (``fa::named_barrier_sync``/``_arrive``; one per block and completion).
    ``stmatrix`` and ``elects`` count warp ``stmatrix`` / ``elect.sync`` instructions, ``setmaxnreg``
    the warpgroup ``setmaxnreg`` instructions (one when all 128 threads have executed it).
    """
    global_read_bytes: int = 0
    global_write_bytes: int = 0
    buffers: dict = dataclasses.field(default_factory=dict)
    mma: int = 0
    ldmatrix: int = 0
    cp_async: int = 0
    cp_async_bytes: int = 0
    barriers: int = 0
    shuffles: int = 0
    syncwarps: int = 0
    atomics: int = 0
    blocks: int = 0
    fiber_switches: int = 0
    votes: int = 0
    ldmatrix_wavefronts: int = 0
    ldmatrix_wavefronts_ideal: int = 0
    seconds: float = 0.0

    gld_sectors: int = 0
    gld_sectors_ideal: int = 0
    gst_sectors: int = 0
    gst_sectors_ideal: int = 0
    cp_async_smem_wavefronts: int = 0
    cp_async_smem_wavefronts_ideal: int = 0
    sem_waits: int = 0
    sem_blocked: int = 0
    bulk_copies: int = 0
    bulk_copy_bytes: int = 0
    mbar_waits: int = 0
    mbar_blocked: int = 0
    wgmma: int = 0
    tma_loads: int = 0
    tma_load_bytes: int = 0
    tma_stores: int = 0
    tma_store_bytes: int = 0
    named_barriers: int = 0
    stmatrix: int = 0
    elects: int = 0
    setmaxnreg: int = 0
    cp_async_lines: int = 0
    cp_async_lines_ideal: int = 0
    cp_async_sectors: int = 0
    cp_async_sectors_ideal: int = 0
    stmatrix_wavefronts: int = 0
    stmatrix_wavefronts_ideal: int = 0

    @property
    def load_sector_efficiency(self):
        """Ideal over touched 32-byte sectors of the global loads (1.0: perfectly coalesced)."""
        return _ratio(self.gld_sectors_ideal, self.gld_sectors)

    @property
    def store_sector_efficiency(self):
        """Ideal over touched 32-byte sectors of the global stores and atomics."""
        return _ratio(self.gst_sectors_ideal, self.gst_sectors)

    @property
    def cp_async_conflict_factor(self):
        """Shared wavefronts of the cp.async destinations over the conflict-free count."""
        return _ratio(self.cp_async_smem_wavefronts, self.cp_async_smem_wavefronts_ideal)

    @property
    def cp_async_line_factor(self):
        """128-byte shared lines of the cp.async phases over the ideal count (1.0: rows 128-byte aligned)."""
        return _ratio(self.cp_async_lines, self.cp_async_lines_ideal)

    @property
    def cp_async_sector_factor(self):
        """(global sector, shared slot) pairs of the cp.async copies over the source's sectors (1.0: each sector
        lands in one 32-byte slot)."""
        return _ratio(self.cp_async_sectors, self.cp_async_sectors_ideal)

    @property
    def ldmatrix_conflict_factor(self):
        """Shared-memory wavefronts of the ldmatrix calls over the conflict-free count (1.0 = none)."""
        return self.ldmatrix_wavefronts / self.ldmatrix_wavefronts_ideal if self.ldmatrix_wavefronts_ideal else 1.0

    @property
    def stmatrix_conflict_factor(self):
        """Shared-memory wavefronts of the stmatrix calls over the conflict-free count (1.0 = none)."""
        return _ratio(self.stmatrix_wavefronts, self.stmatrix_wavefronts_ideal)

    @property
    def global_bytes(self):
        """Total global traffic, read + written (bytes)."""
        return self.global_read_bytes + self.global_write_bytes

    def __getitem__(self, key):
        return getattr(self, key)


# ---------------------------------------------------------------------------------------------
# ctypes mirror of fa_emu_api.h
# ---------------------------------------------------------------------------------------------
class _Buffer(ctypes.Structure):
    _fields_ = [("lo", ctypes.c_uint64), ("hi", ctypes.c_uint64),
                ("arg_index", ctypes.c_int32), ("writable", ctypes.c_int32)]


_COUNTER_FIELDS = ("global_read_bytes", "global_write_bytes", "mma", "ldmatrix", "cp_async",
                   "cp_async_bytes", "barriers", "shuffles", "syncwarps", "atomics", "blocks",
                   "fiber_switches", "votes", "ldmatrix_wavefronts", "ldmatrix_wavefronts_ideal",
                   "gld_sectors", "gld_sectors_ideal", "gst_sectors", "gst_sectors_ideal",
                   "cp_async_smem_wavefronts", "cp_async_smem_wavefronts_ideal", "sem_waits", "sem_blocked",
                   "bulk_copies", "bulk_copy_bytes", "mbar_waits", "mbar_blocked", "wgmma",
                   "tma_loads", "tma_load_bytes", "tma_stores", "tma_store_bytes", "named_barriers",
                   "stmatrix", "elects", "setmaxnreg", "cp_async_lines", "cp_async_lines_ideal", "cp_async_sectors",
                   "cp_async_sectors_ideal", "stmatrix_wavefronts", "stmatrix_wavefronts_ideal")


class _Counters(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in _COUNTER_FIELDS]


class _LaunchParams(ctypes.Structure):
    _fields_ = [("kernel_name", ctypes.c_char_p), ("entry", ctypes.c_void_p),
                ("args", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_uint64), ("schedule", ctypes.c_int), ("seed", ctypes.c_uint64),
                ("num_workers", ctypes.c_int), ("stack_bytes", ctypes.c_uint64),
                ("buffers", ctypes.c_void_p), ("num_buffers", ctypes.c_int),
                ("buffer_read_bytes", ctypes.c_void_p), ("buffer_write_bytes", ctypes.c_void_p),
                ("counters", ctypes.c_void_p), ("error", ctypes.c_void_p), ("error_size", ctypes.c_size_t),
                ("buffer_sectors", ctypes.c_void_p)]


# ---------------------------------------------------------------------------------------------
# Compilation and caching
# ---------------------------------------------------------------------------------------------
_lock = threading.RLock()
_runtime_lib = None
_loaded = {}          # module key -> (CDLL, {included header: sha256})


def cache_dir():
    """Directory of compiled emulator modules.

    ``$FLASHARRAY_EMULATOR_CACHE`` if set, else ``$XDG_CACHE_HOME/flasharray/emulator``
    (``~/.cache/flasharray/emulator``). Safe to delete at any time.
    """
    env = os.environ.get("FLASHARRAY_EMULATOR_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flasharray" / "emulator"


def _compiler():
    """The host compiler ($CXX, else c++, else g++), identified once per command."""
    try:
        return _hc.current()
    except _hc.CompilerNotFound as e:
        raise CompileError(str(e)) from None


def host_compiler():
    """The host compiler kernels are built with, e.g. ``'clang++ (clang 14.0.6, libstdc++)'``.

    ``$CXX`` (split into words, so it may carry arguments), else ``c++``, else ``g++``; read at each
    call. Supported: g++ 12-14 and clang++ >= 14. Raises :class:`CompileError` when it is unusable.
    """
    return _compiler().describe()


def _compiler_key(cc):
    return (cc.argv, cc.family, cc.version, cc.stdlib)


def _sha(*parts):
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode())
        h.update(b"\0")
    return h.hexdigest()


def _run_compiler(cc, args, what):
    cmd = [*cc.argv, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace",
                          env=dict(os.environ, LC_ALL="C"))
    if proc.returncode != 0:
        log = (proc.stdout + proc.stderr).strip()
        raise CompileError(_hc.failure_message(what, cc, cmd, log), log)
    return proc


def _atomic_write(path, data):
    tmp = "%s.tmp.%d.%d" % (path, os.getpid(), threading.get_ident())
    with open(tmp, "w" if isinstance(data, str) else "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _runtime():
    """The runtime shared library (built once per compiler and runtime source)."""
    global _runtime_lib
    with _lock:
        if _runtime_lib is not None:
            return _runtime_lib
        src = cuda_src_dir()
        cc = _compiler()
        texts = [(src / name).read_bytes() for name in _RUNTIME_SOURCES]
        key = _sha("runtime", _ABI_VERSION, _compiler_key(cc), cc.flags, *texts)[:24]
        root = cache_dir()
        root.mkdir(parents=True, exist_ok=True)
        path = root / ("libfa_emu_rt-%s.so" % key)
        if not path.exists():
            tmpdir = tempfile.mkdtemp(dir=root, prefix="build-rt-")
            try:
                out = os.path.join(tmpdir, "libfa_emu_rt.so")
                _run_compiler(cc, ["-std=c++17", *cc.flags, "-shared", "-pthread",
                                   str(src / "emu" / "fa_emu_runtime.cpp"), "-o", out],
                              "the emulator runtime (cuda_src/emu/fa_emu_runtime.cpp)")
                os.replace(out, path)
            finally:
                shutil.rmtree(tmpdir, ignore_errors=True)
        lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        lib.fa_emu_launch.argtypes = [ctypes.POINTER(_LaunchParams)]
        lib.fa_emu_launch.restype = ctypes.c_int
        lib.fa_emu_measure_switch_ns.argtypes = [ctypes.c_int]
        lib.fa_emu_measure_switch_ns.restype = ctypes.c_double
        lib.fa_emu_abi_version.restype = ctypes.c_int
        if lib.fa_emu_abi_version() != _ABI_VERSION:
            raise CompileError("emulator runtime ABI %d does not match the driver's %d"
                               % (lib.fa_emu_abi_version(), _ABI_VERSION))
        _runtime_lib = (lib, path)
        return _runtime_lib


#: The headers every module parses first (``fa_port.cuh`` and the emulator's own), precompiled once per compiler,
#: flags and header texts (GCC): about a sixth of a module's compile time.
_PCH_HEADERS = ("fa_port.cuh", "emu/fa_emu.h", "emu/fa_emu_api.h")
_pch_dirs = {}


def _precompiled_port(cc, cmd_flags):
    """A directory holding ``fa_port.cuh.gch`` (and a copy of the header, which a kernel's own ``#include
    "fa_port.cuh"`` then finds there and skips by its ``#pragma once``) for ``cmd_flags``, or None: not GCC, or the
    header did not precompile (then every module parses it, as without this). GCC checks that a module's flags
    and macros match the ones it was made with and otherwise parses the header: a stale or foreign file costs
    time, never correctness."""
    if cc.family != "gcc" or os.environ.get("FLASHARRAY_EMULATOR_PCH", "1") == "0":
        return None
    src = cuda_src_dir()
    texts = [(src / name).read_bytes() for name in _PCH_HEADERS]
    key = _sha("pch", _ABI_VERSION, _compiler_key(cc), cmd_flags, *texts)[:24]
    d = cache_dir() / ("pch-" + key)
    with _lock:
        if d in _pch_dirs and (_pch_dirs[d] is None or (d / "fa_port.cuh.gch").exists()):
            return _pch_dirs[d]
        if not (d / "fa_port.cuh.gch").exists():
            d.mkdir(parents=True, exist_ok=True)
            tmp = "%s.tmp.%d.%d" % (d / "fa_port.cuh.gch", os.getpid(), threading.get_ident())
            try:
                _run_compiler(cc, [*cmd_flags, "-pthread", "-x", "c++-header", str(src / "fa_port.cuh"), "-o", tmp],
                              "the precompiled cuda_src/fa_port.cuh")
                _atomic_write(d / "fa_port.cuh", texts[0])
                os.replace(tmp, d / "fa_port.cuh.gch")
            except CompileError:
                _pch_dirs[d] = None
                return None
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
        _pch_dirs[d] = d
        return d


def switch_cost_ns(iterations=1_000_000):
    """Measured cost of one fiber context switch, in nanoseconds."""
    lib, _ = _runtime()
    return lib.fa_emu_measure_switch_ns(int(iterations))


def _parse_depfile(text):
    text = text.replace("\\\n", " ")
    _, _, deps = text.partition(":")
    out = []
    for tok in re.split(r"(?<!\\) ", deps.strip()):
        tok = tok.strip()
        if tok:
            out.append(tok.replace("\\ ", " "))
    return out


def _file_sha(path):
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def _translate_options(options):
    """NVRTC/CuPy options -> host compiler flags (defines, include dirs, language standard)."""
    flags, std = [], "-std=c++17"
    it = iter(options)
    for opt in it:
        if opt in ("-D", "-U", "-I", "--define-macro", "--undefine-macro", "--include-path"):
            val = next(it, "")
            flag = {"--define-macro": "-D", "--undefine-macro": "-U", "--include-path": "-I"}.get(opt, opt)
            flags.append(flag + val)
        elif opt.startswith(("-D", "-U", "-I")):
            flags.append(opt)
        elif opt.startswith(("--define-macro=", "--undefine-macro=", "--include-path=")):
            name, _, val = opt.partition("=")
            flags.append({"--define-macro": "-D", "--undefine-macro": "-U", "--include-path": "-I"}[name] + val)
        elif re.fullmatch(r"--?std=c\+\+\d\d", opt):
            std = "-std=" + opt.split("=", 1)[1]
        # Everything else (-arch, --use_fast_math, -lineinfo, --ftz, ...) is GPU-only.
    return std, flags


class Kernel:
    """One registered kernel; ``kernel(grid, block, args, shared_mem=0, **opts)`` launches it."""

    def __init__(self, module, name_expression):
        self.module = module
        self.name_expression = name_expression
        self.max_dynamic_shared_size_bytes = 48 * 1024   # accepted for CuPy parity; not enforced

    def __call__(self, grid, block, args, shared_mem=0, **opts):
        return self.module.launch(self.name_expression, grid, block, args, shared_mem=shared_mem, **opts)

    @property
    def signature(self):
        """Parameter types as C++ spelling, e.g. ``['const fa_half*', 'int']``."""
        return [_ctype_name(c) for c in self.module._sigs[self.name_expression]]


class Module:
    """A CUDA source compiled for the emulator.

    Parameters
    ----------
    source : str
        CUDA C++ source using ``fa_port.cuh`` (which it includes itself: ``#include "fa_port.cuh"``).
    name_expressions : sequence of str
        Kernels to make launchable, spelled as in CuPy's ``RawModule``, e.g.
        ``"flash_fwd<fa_half, 64, true>"``; each must name one ``__global__`` function.
    include_dirs : sequence of path
        Extra include directories (``cuda_src/`` is always on the path).
    options : sequence of str
        NVRTC-style options; ``-D``/``-U``/``-I`` and ``-std=`` are honoured, GPU-only options
        (``-arch``, ``--use_fast_math``, ...) are ignored.
    host_options : sequence of str
        Extra flags for the host compiler (e.g. ``["-g"]``).

    The shared library is cached under :func:`cache_dir` by a hash of the source, the name
    expressions, the options and the contents of every header it includes; a later Module with
    the same inputs loads it without compiling.

    Raises
    ------
    CompileError
        With the compiler's message when the source does not compile.
    """

    def __init__(self, source, name_expressions=(), include_dirs=(), options=(), host_options=()):
        if isinstance(name_expressions, str):
            name_expressions = [name_expressions]
        self.name_expressions = list(name_expressions)
        self.source = source
        rt_lib, rt_path = _runtime()
        src_dir = cuda_src_dir()
        std, flags = _translate_options(list(options))
        inc = [str(src_dir)] + [str(Path(d).resolve()) for d in include_dirs]
        cc = _compiler()
        gen = ["// generated by flasharray.emulator",
               '#include "fa_port.cuh"',
               '#include "kernel.cu"',
               '#include "emu/fa_emu_register.h"']
        for i, expr in enumerate(self.name_expressions):
            gen.append('extern "C" void fa_emu_entry_%d(void** args) { auto fn = &%s; ::fa_emu::invoke(fn, args); }'
                       % (i, expr))
            gen.append('extern "C" const char* fa_emu_sig_%d(void) { auto fn = &%s; return ::fa_emu::signature(fn); }'
                       % (i, expr))
        main = "\n".join(gen) + "\n"
        cmd_flags = [std, *cc.module_flags, *flags, *host_options, *("-I" + d for d in inc)]
        pch = _precompiled_port(cc, cmd_flags)
        if pch is not None:   # searched first: its fa_port.cuh.gch stands for the header (keyed by the header texts)
            cmd_flags = ["-I" + str(pch)] + cmd_flags
        key = _sha("module", _ABI_VERSION, _compiler_key(cc), cmd_flags, rt_path.name, source, main)[:32]
        with _lock:
            hit = _loaded.get(key)
            # Reuse the loaded library unless a header it includes changed since (e.g. while
            # editing a kernel in a notebook): then build (and load) a new one.
            if hit is not None and all(_file_sha(p) == h for p, h in hit[1].items()):
                self._lib = hit[0]
            else:
                self._lib, deps = self._build(key, cc, cmd_flags, source, main, rt_path)
                _loaded[key] = (self._lib, deps)
        self._entries, self._sigs = {}, {}
        for i, expr in enumerate(self.name_expressions):
            entry = getattr(self._lib, "fa_emu_entry_%d" % i)
            sig_fn = getattr(self._lib, "fa_emu_sig_%d" % i)
            sig_fn.restype = ctypes.c_char_p
            sig = sig_fn().decode()
            self._entries[expr] = ctypes.cast(entry, ctypes.c_void_p).value
            self._sigs[expr] = sig.split(",") if sig else []

    @staticmethod
    def _build(key, cc, cmd_flags, source, main, rt_path):
        root = cache_dir()
        mod_dir = root / ("mod-" + key)
        meta = mod_dir / "deps.json"
        if meta.exists():
            try:
                info = json.loads(meta.read_text())
                if all(_file_sha(p) == h for p, h in info["deps"].items()):
                    lib_path = mod_dir / info["lib"]
                    if lib_path.exists():
                        return ctypes.CDLL(str(lib_path)), info["deps"]
            except (ValueError, KeyError, OSError):
                pass
        mod_dir.mkdir(parents=True, exist_ok=True)
        tmpdir = tempfile.mkdtemp(dir=root, prefix="build-")
        try:
            Path(tmpdir, "kernel.cu").write_text(source)
            Path(tmpdir, "main.cpp").write_text(main)
            out = os.path.join(tmpdir, "module.so")
            args = [*cmd_flags, *_hc.module_link_flags(cc), "-I" + tmpdir, "-shared", "-pthread", "-MMD", "-MF",
                    os.path.join(tmpdir, "deps.d"), "-x", "c++", os.path.join(tmpdir, "main.cpp"), "-x", "none",
                    "-o", out, str(rt_path), "-Wl,-rpath," + str(rt_path.parent), "-Wl,--no-undefined"]
            _run_compiler(cc, args, "the kernel source")
            deps = {}
            for d in _parse_depfile(Path(tmpdir, "deps.d").read_text()):
                p = os.path.abspath(d)
                if not p.startswith(os.path.abspath(tmpdir) + os.sep):
                    deps[p] = _file_sha(p)
            lib_name = "module-%s.so" % _sha(*sorted(deps.items()))[:16]
            os.replace(out, mod_dir / lib_name)
            _atomic_write(meta, json.dumps({"lib": lib_name, "deps": deps}, indent=1))
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)
        return ctypes.CDLL(str(mod_dir / lib_name)), deps

    def get_function(self, name_expression):
        """The kernel registered as ``name_expression`` (CuPy ``RawModule.get_function`` parity)."""
        self._check_name(name_expression)
        return Kernel(self, name_expression)

    def _check_name(self, name_expression):
        if name_expression not in self._entries:
            raise ValueError("kernel %r is not one of this module's name_expressions %r"
                             % (name_expression, self.name_expressions))

    def launch(self, name_expression, grid, block, args, shared_mem=0, schedule="forward", seed=0,
               workers=None, stack_kb=None):
        """Run one kernel on the CPU and return its :class:`Counters`.

        Parameters
        ----------
        name_expression : str
            One of the module's name expressions.
        grid, block : int or tuple of up to 3 ints
            Launch shape (``block`` has at most 1024 threads).
        args : tuple
            NumPy arrays (passed as pointers to their memory, modified in place) and NumPy
            scalars (passed by value), one per kernel parameter. Python ``int``/``float`` are
            accepted only for ``long long``/``double`` parameters (what CuPy passes them as).
        shared_mem : int
            Bytes of dynamic shared memory per block (``FA_DYNAMIC_SMEM``).
        schedule : {"forward", "reverse", "random"}
            Which runnable thread runs next: the lowest id, the highest id, or a random one
            (seeded by ``seed``). Blocks are taken in the same order. A correct kernel gives the
            same result under every schedule.
        workers : int, optional
            OS threads running blocks in parallel (default ``$FLASHARRAY_EMULATOR_THREADS`` or the
            number of usable cores).
        stack_kb : int, optional
            Stack per CUDA thread (default ``$FLASHARRAY_EMULATOR_STACK_KB`` or 256).

        Raises
        ------
        EmulatorError
            On any checked error (the kernel's work up to the error may be partially done).
        TypeError
            When an argument does not match the kernel's parameter type.
        """
        self._check_name(name_expression)
        if schedule not in _SCHEDULES:
            raise ValueError("schedule must be one of %s, got %r" % (sorted(_SCHEDULES), schedule))
        grid3, block3 = _dim3(grid, "grid"), _dim3(block, "block")
        shared_mem = int(shared_mem)
        if shared_mem < 0 or shared_mem > _MAX_SHARED_MEM:
            raise ValueError("shared_mem=%d bytes: must be in [0, %d] (the largest per-block shared memory of "
                             "any supported GPU)" % (shared_mem, _MAX_SHARED_MEM))
        sig = self._sigs[name_expression]
        args = tuple(args)
        if len(args) != len(sig):
            raise TypeError("%s takes %d arguments (%s), got %d"
                            % (name_expression, len(sig), ", ".join(_ctype_name(c) for c in sig), len(args)))
        keep = []
        argv = (ctypes.c_void_p * max(1, len(args)))()
        buffers, buffer_desc = [], []
        for i, (a, code) in enumerate(zip(args, sig)):
            obj = _marshal(i, a, code, name_expression)
            if isinstance(obj, tuple):   # (ctypes view, the memory it views)
                keep.append(obj[1])
                obj = obj[0]
            keep.append(obj)
            argv[i] = ctypes.addressof(obj)
            if isinstance(a, TensorMap):   # the global memory a tensor map describes
                a = a.array
            if isinstance(a, np.ndarray):
                lo, hi = _byte_bounds(a)
                buffers.append(_Buffer(lo, hi, i, 1 if a.flags.writeable else 0))
                buffer_desc.append("argument %d: %s array of shape %s (%d bytes at 0x%x)"
                                   % (i, a.dtype, a.shape, hi - lo, lo))
        nb = len(buffers)
        buf_arr = (_Buffer * max(1, nb))(*buffers)
        reads = (ctypes.c_uint64 * max(1, nb))()
        writes = (ctypes.c_uint64 * max(1, nb))()
        sectors = (ctypes.c_uint64 * max(1, 4 * nb))()
        counters = _Counters()
        err = ctypes.create_string_buffer(4096)
        if workers is None:
            workers = int(os.environ.get("FLASHARRAY_EMULATOR_THREADS", "0")) or _usable_cores()
        if stack_kb is None:
            stack_kb = int(os.environ.get("FLASHARRAY_EMULATOR_STACK_KB", "256"))
        _check_mma_sum_env()
        name_b = name_expression.encode()
        p = _LaunchParams()
        p.kernel_name = name_b
        p.entry = self._entries[name_expression]
        p.args = ctypes.addressof(argv)
        p.grid[:] = grid3
        p.block[:] = block3
        p.shared_mem = shared_mem
        p.schedule = _SCHEDULES[schedule]
        p.seed = int(seed) & 0xFFFFFFFFFFFFFFFF
        p.num_workers = max(1, int(workers))
        p.stack_bytes = max(16, int(stack_kb)) * 1024
        p.buffers = ctypes.addressof(buf_arr)
        p.num_buffers = nb
        p.buffer_read_bytes = ctypes.addressof(reads)
        p.buffer_write_bytes = ctypes.addressof(writes)
        p.counters = ctypes.addressof(counters)
        p.error = ctypes.addressof(err)
        p.error_size = len(err)
        p.buffer_sectors = ctypes.addressof(sectors)
        lib, _ = _runtime()
        t0 = time.perf_counter()
        rc = lib.fa_emu_launch(ctypes.byref(p))
        seconds = time.perf_counter() - t0
        if rc != 0:
            msg = err.value.decode(errors="replace")
            if buffer_desc:
                msg += "\nlaunch buffers:\n  " + "\n  ".join(buffer_desc)
            raise EmulatorError(msg)
        out = Counters(**{f: getattr(counters, f) for f in _COUNTER_FIELDS}, seconds=seconds)
        out.buffers = {b.arg_index: BufferTraffic(int(reads[k]), int(writes[k]), *(int(x) for x in sectors[4 * k:4 * k + 4]))
                       for k, b in enumerate(buffers)}
        return out


# ---------------------------------------------------------------------------------------------
# Argument marshalling
# ---------------------------------------------------------------------------------------------
_DTYPE_CODES = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64", "bool": "b1",
                "int8": "i8", "uint8": "u8", "int16": "i16", "uint16": "u16", "int32": "i32",
                "uint32": "u32", "int64": "i64", "uint64": "u64"}
_CODE_NAMES = {"f16": "fa_half", "bf16": "fa_bf16", "f32": "float", "f64": "double", "b1": "bool",
               "i8": "char", "u8": "unsigned char", "i16": "short", "u16": "unsigned short", "i32": "int",
               "u32": "unsigned int", "i64": "long long", "u64": "unsigned long long", "v": "void",
               "tmap": "CUtensorMap"}
_CODE_CTYPES = {"f32": ctypes.c_float, "f64": ctypes.c_double, "b1": ctypes.c_bool, "i8": ctypes.c_int8,
                "u8": ctypes.c_uint8, "i16": ctypes.c_int16, "u16": ctypes.c_uint16, "i32": ctypes.c_int32,
                "u32": ctypes.c_uint32, "i64": ctypes.c_int64, "u64": ctypes.c_uint64,
                "f16": ctypes.c_uint16, "bf16": ctypes.c_uint16}


def _ctype_name(code):
    if code.startswith("*"):
        rest = code[1:]
        const = rest.startswith("c")
        if const:
            rest = rest[1:]
        return ("const " if const else "") + _ctype_name(rest) + "*"
    if code.startswith("?"):
        return "<unsupported %s-byte type>" % code[1:]
    return _CODE_NAMES.get(code, code)


def _dtype_code(dtype):
    return _DTYPE_CODES.get(np.dtype(dtype).name)


def _marshal(i, a, code, kname):
    where = "%s argument %d" % (kname, i)
    if code == "tmap" or isinstance(a, TensorMap):
        if code != "tmap" or not isinstance(a, TensorMap) or not a.emulated:
            raise TypeError("%s: a CUtensorMap parameter takes a TensorMap encoded for a NumPy array "
                            "(flasharray.emulator.encode_tensor_map), and a TensorMap only such a parameter; "
                            "got %s for %s" % (where, type(a).__name__, _ctype_name(code)))
        words = _aligned_words()   # passed by value: a 128-byte aligned copy
        words[:] = a.words
        return (ctypes.c_uint64 * 16).from_address(words.ctypes.data), words
    if code.startswith("?"):
        raise TypeError("%s: the kernel parameter has a type the emulator cannot pass (%s)" % (where, _ctype_name(code)))
    if code.startswith("*"):
        if not isinstance(a, np.ndarray):
            raise TypeError("%s: the kernel takes a pointer (%s), got %s; pass a NumPy array"
                            % (where, _ctype_name(code), type(a).__name__))
        pointee = code[2:] if code.startswith("*c") else code[1:]
        got = _dtype_code(a.dtype)
        if pointee not in ("v", "i8", "u8") and got != pointee:
            raise TypeError("%s: the kernel takes %s, got an array of dtype %s"
                            % (where, _ctype_name(code), a.dtype))
        return ctypes.c_void_p(a.ctypes.data)
    if isinstance(a, np.ndarray):
        raise TypeError("%s: the kernel takes %s by value, got a NumPy array" % (where, _ctype_name(code)))
    if isinstance(a, np.generic):
        got = _dtype_code(a.dtype)
        if got != code:
            raise TypeError("%s: the kernel takes %s, got numpy.%s" % (where, _ctype_name(code), a.dtype))
        if code in ("f16", "bf16"):
            return ctypes.c_uint16(int(np.asarray(a).view(np.uint16)))
        return _CODE_CTYPES[code](a.item())
    if isinstance(a, bool):
        if code != "b1":
            raise TypeError("%s: the kernel takes %s, got a Python bool" % (where, _ctype_name(code)))
        return ctypes.c_bool(a)
    if isinstance(a, int):
        if code != "i64":
            raise TypeError("%s: the kernel takes %s, got a Python int, which CuPy passes as a 64-bit integer; "
                            "wrap it, e.g. numpy.%s(...)" % (where, _ctype_name(code), _numpy_name(code)))
        return ctypes.c_int64(a)
    if isinstance(a, float):
        if code != "f64":
            raise TypeError("%s: the kernel takes %s, got a Python float, which CuPy passes as a double; "
                            "wrap it, e.g. numpy.%s(...)" % (where, _ctype_name(code), _numpy_name(code)))
        return ctypes.c_double(a)
    raise TypeError("%s: unsupported argument type %s (NumPy arrays and NumPy scalars are supported)"
                    % (where, type(a).__name__))


def _numpy_name(code):
    for k, v in _DTYPE_CODES.items():
        if v == code:
            return k
    return "generic"


def _byte_bounds(a):
    try:
        from numpy.lib.array_utils import byte_bounds
    except ImportError:   # numpy < 2
        byte_bounds = np.byte_bounds
    lo, hi = byte_bounds(a)
    return int(lo), int(hi)


def _dim3(v, what):
    if isinstance(v, (int, np.integer)):
        v = (int(v),)
    v = tuple(int(x) for x in v)
    if not 1 <= len(v) <= 3 or any(x < 1 for x in v):
        raise ValueError("%s must be 1 to 3 positive ints, got %r" % (what, v))
    return v + (1,) * (3 - len(v))


#: ``$FLASHARRAY_EMULATOR_MMA_SUM``: how an mma's fp32 sum is rounded (docs/emulator.md, *Settings*).
MMA_SUM_MODES = ("nearest", "truncate")


def _check_mma_sum_env():
    """A ValueError naming ``$FLASHARRAY_EMULATOR_MMA_SUM`` and its value when it is set to neither mode
    (the runtime would quietly round to nearest)."""
    value = os.environ.get("FLASHARRAY_EMULATOR_MMA_SUM")
    if value is not None and value not in MMA_SUM_MODES:
        raise ValueError("$FLASHARRAY_EMULATOR_MMA_SUM must be one of %s, got %r" % (", ".join(MMA_SUM_MODES), value))


def _usable_cores():
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)
