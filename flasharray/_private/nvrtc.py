"""Compile CUDA C++ to a cubin with NVRTC (no GPU needed) and read ptxas's resource report.

Used by the static checks: every kernel instantiation must compile for each target
architecture with zero spills and registers / shared memory within the limits.

>>> from flasharray._private import nvrtc
>>> ok, why = nvrtc.available()
>>> r = nvrtc.compile_cubin(src, "sm_80", name_expressions=["my_kernel<fa_half, 64>"])  # doctest: +SKIP
>>> info = r.kernel("my_kernel<fa_half, 64>")                                      # doctest: +SKIP
>>> info.registers, info.spill_stores, info.spill_loads, info.static_smem          # doctest: +SKIP
(96, 0, 0, 0)

``compile_cubin`` always adds ``--gpu-architecture=<arch>``, ``-Xptxas=-v``, ``--std=c++17``,
the flasharray ``cuda_src/`` directory and the CUDA headers (``cuda_fp16.h`` etc., from the
``nvidia-cuda-runtime-cu12`` wheel or ``$CUDA_PATH/include``) to the include path.
libnvrtc is looked up in ``$FLASHARRAY_NVRTC`` (a file path), the ``nvidia-cuda-nvrtc-cu12``
wheel, the CUDA 13 ``nvidia-cuda-nvrtc`` wheel (``nvidia/cu13/lib``; its builtins library is
preloaded from beside it, which that wheel's libnvrtc does not find by itself), ``$CUDA_PATH/lib64``,
then the system loader.
"""
import ctypes
import ctypes.util
import dataclasses
import os
import re
import sys
from pathlib import Path

from flasharray._private.sources import cuda_src_dir

__all__ = ["NvrtcError", "KernelInfo", "CompileResult", "available", "compile_cubin", "find_libnvrtc",
           "cuda_include_dirs", "version"]


class NvrtcError(RuntimeError):
    """NVRTC rejected the program (``log`` holds the compiler log) or is not installed."""

    def __init__(self, message, log=""):
        super().__init__(message)
        self.log = log


@dataclasses.dataclass
class KernelInfo:
    """ptxas's report for one ``__global__`` function (``-Xptxas=-v``)."""
    lowered_name: str           # mangled name in the cubin
    registers: int = 0          # registers per thread
    spill_stores: int = 0       # bytes
    spill_loads: int = 0        # bytes
    stack_frame: int = 0        # bytes of local memory stack per thread
    static_smem: int = 0        # bytes of static __shared__
    cmem: int = 0               # bytes of constant bank 0 (kernel parameters)


@dataclasses.dataclass
class CompileResult:
    """The cubin, its PTX, the full log, and per-kernel resource usage.

    ``lowered_names`` maps each name expression to its mangled name; ``kernels`` maps mangled
    names to :class:`KernelInfo`. ``kernel(name_expression)`` looks one up by name expression.
    """
    arch: str
    cubin: bytes
    ptx: str
    log: str
    lowered_names: dict
    kernels: dict

    def kernel(self, name):
        lowered = self.lowered_names.get(name, name)
        try:
            return self.kernels[lowered]
        except KeyError:
            raise KeyError("no kernel %r in this program (kernels: %s)" % (name, sorted(self.kernels))) from None


# ---------------------------------------------------------------------------------------------
def _site_dirs():
    seen = []
    for p in sys.path:
        if p and os.path.isdir(p) and p not in seen:
            seen.append(p)
    return seen


def find_libnvrtc():
    """Path (or soname) of libnvrtc, or ``None`` when it cannot be found."""
    env = os.environ.get("FLASHARRAY_NVRTC")
    if env:
        return env if os.path.exists(env) else None
    for d in _site_dirs():
        for lib in (Path(d) / "nvidia" / "cuda_nvrtc" / "lib", Path(d) / "nvidia" / "cu13" / "lib"):
            for name in ("libnvrtc.so.12", "libnvrtc.so.13", "libnvrtc.so"):
                if (lib / name).exists():
                    return str(lib / name)
    for var in ("CUDA_PATH", "CUDA_HOME"):
        root = os.environ.get(var)
        if root:
            for name in ("lib64/libnvrtc.so", "lib/libnvrtc.so"):
                if os.path.exists(os.path.join(root, name)):
                    return os.path.join(root, name)
    if os.path.exists("/usr/local/cuda/lib64/libnvrtc.so"):
        return "/usr/local/cuda/lib64/libnvrtc.so"
    return ctypes.util.find_library("nvrtc")


def cuda_include_dirs():
    """Directories holding the CUDA headers NVRTC needs (``cuda_fp16.h``, ``cuda_bf16.h``)."""
    out = []
    for d in _site_dirs():
        incs = [Path(d) / "nvidia" / "cuda_runtime" / "include", Path(d) / "nvidia" / "cu13" / "include"]
        inc = next((i for i in incs if (i / "cuda_fp16.h").exists()), None)
        if inc is not None:
            out.append(str(inc))
            break
    for var in ("CUDA_PATH", "CUDA_HOME"):
        root = os.environ.get(var)
        if root and os.path.exists(os.path.join(root, "include", "cuda_fp16.h")):
            out.append(os.path.join(root, "include"))
    if not out and os.path.exists("/usr/local/cuda/include/cuda_fp16.h"):
        out.append("/usr/local/cuda/include")
    return out


_lib = None


def _preload_builtins(path):
    """Load ``libnvrtc-builtins.so.*`` from beside ``path`` (RTLD_GLOBAL), where there is one: NVRTC
    opens it by name at its first compile, and a wheel's lib folder is not on the loader's path
    (CUDA 13's wheel: "failed to open libnvrtc-builtins.so.13.0")."""
    if not os.path.isabs(path):  # a soname: the system loader finds what goes with it
        return
    folder = Path(path).parent
    for cand in sorted(folder.glob("libnvrtc-builtins.so.*")):
        if ".alt." not in cand.name:
            ctypes.CDLL(str(cand), mode=ctypes.RTLD_GLOBAL)
            return


def _load():
    global _lib
    if _lib is not None:
        return _lib
    path = find_libnvrtc()
    if path is None:
        raise NvrtcError("libnvrtc not found: pip install nvidia-cuda-nvrtc-cu12, or set $FLASHARRAY_NVRTC "
                         "to the library's path")
    try:
        _preload_builtins(path)
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise NvrtcError("cannot load libnvrtc from %s: %s" % (path, e)) from None
    P = ctypes.c_void_p
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]
    lib.nvrtcVersion.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
    lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(P), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
                                       ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_char_p)]
    lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(P)]
    lib.nvrtcAddNameExpression.argtypes = [P, ctypes.c_char_p]
    lib.nvrtcCompileProgram.argtypes = [P, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.nvrtcGetProgramLogSize.argtypes = [P, ctypes.POINTER(ctypes.c_size_t)]
    lib.nvrtcGetProgramLog.argtypes = [P, ctypes.c_char_p]
    lib.nvrtcGetCUBINSize.argtypes = [P, ctypes.POINTER(ctypes.c_size_t)]
    lib.nvrtcGetCUBIN.argtypes = [P, ctypes.c_char_p]
    lib.nvrtcGetPTXSize.argtypes = [P, ctypes.POINTER(ctypes.c_size_t)]
    lib.nvrtcGetPTX.argtypes = [P, ctypes.c_char_p]
    lib.nvrtcGetLoweredName.argtypes = [P, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)]
    _lib = lib
    return lib


def available():
    """``(True, "")`` when NVRTC and the CUDA headers can be used, else ``(False, reason)``."""
    try:
        _load()
    except NvrtcError as e:
        return False, str(e)
    if not cuda_include_dirs():
        return False, "CUDA headers (cuda_fp16.h) not found: pip install nvidia-cuda-runtime-cu12 or set $CUDA_PATH"
    return True, ""


def version():
    """NVRTC version as ``(major, minor)``."""
    lib = _load()
    a, b = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(a), ctypes.byref(b))
    return a.value, b.value


def _check(lib, rc, what):
    if rc != 0:
        raise NvrtcError("%s: %s" % (what, lib.nvrtcGetErrorString(rc).decode()))


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(.*)")


def _parse_ptxas(log):
    """Per-kernel resource usage from an ``-Xptxas=-v`` log."""
    kernels, cur, props = {}, None, None
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            cur = kernels.setdefault(m.group(1), KernelInfo(m.group(1)))
            continue
        m = _PROPS.search(line)
        if m:
            props = m.group(1)
            continue
        m = _FRAME.search(line)
        if m and props is not None:
            info = kernels.setdefault(props, KernelInfo(props))
            info.stack_frame, info.spill_stores, info.spill_loads = (int(x) for x in m.groups())
            continue
        m = _USED.search(line)
        if m and cur is not None:
            cur.registers = int(m.group(1))
            rest = m.group(2)
            s = re.search(r"(\d+) bytes smem", rest)
            c = re.search(r"(\d+) bytes cmem\[0\]", rest)
            cur.static_smem = int(s.group(1)) if s else 0
            cur.cmem = int(c.group(1)) if c else 0
    # "Function properties" also lists non-entry functions; keep kernels only.
    return {k: v for k, v in kernels.items() if _entry_seen(log, k)}


def _entry_seen(log, name):
    return ("Compiling entry function '%s'" % name) in log


def compile_cubin(source, arch, name_expressions=(), options=(), include_dirs=()):
    """Compile ``source`` for ``arch`` (e.g. ``"sm_80"``) and return a :class:`CompileResult`.

    Parameters
    ----------
    source : str
        CUDA C++ (typically including ``fa_port.cuh``).
    arch : str
        ``"sm_75"``, ``"sm_80"``, ``"sm_86"``, ``"sm_89"``, ``"sm_90"``, ...
    name_expressions : sequence of str
        Template instantiations to compile and whose mangled names to report
        (``nvrtcAddNameExpression``), e.g. ``"flash_fwd<fa_half, 64>"``.
    options : sequence of str
        Extra NVRTC options (``-DNAME=1``, ``--use_fast_math``, ...).
    include_dirs : sequence of path
        Extra include directories.

    Raises
    ------
    NvrtcError
        If libnvrtc is missing or the program does not compile (``.log`` has the compiler log).
    """
    lib = _load()
    arch = arch if arch.startswith(("sm_", "compute_")) else "sm_" + str(arch)
    opts = ["--gpu-architecture=" + arch, "-Xptxas=-v", "--std=c++17",
            "-I" + str(cuda_src_dir())]
    opts += ["-I" + str(d) for d in include_dirs]
    opts += ["-I" + d for d in cuda_include_dirs()]
    opts += list(options)
    if len(name_expressions) > 1 and _split_compile_ok:
        # Several kernels: NVVM and ptxas optimize them on every CPU (identical code: the cubins of the
        # static checks' programs hash the same with and without it; about 1.35x faster on 2 cores).
        try:
            return _compile(lib, source, arch, name_expressions, opts + ["-split-compile=0"])
        except NvrtcError as e:
            if "INVALID_OPTION" not in str(e) and "split-compile" not in e.log:
                raise
            _disable_split_compile()  # an NVRTC without the option: compile on one thread
    return _compile(lib, source, arch, name_expressions, opts)


#: False once an NVRTC rejected ``-split-compile`` (older than 12.x releases that have it).
_split_compile_ok = True


def _disable_split_compile():
    global _split_compile_ok
    _split_compile_ok = False


def _compile(lib, source, arch, name_expressions, opts):
    """One NVRTC program: ``source`` with ``name_expressions`` under the full option list ``opts``."""
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"flasharray.cu", 0, None, None),
           "nvrtcCreateProgram")
    try:
        for n in name_expressions:
            _check(lib, lib.nvrtcAddNameExpression(prog, n.encode()), "nvrtcAddNameExpression(%s)" % n)
        c_opts = (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts))
        rc = lib.nvrtcCompileProgram(prog, len(opts), c_opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value + 1)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        if rc != 0:
            raise NvrtcError("NVRTC failed to compile for %s (%s):\n%s"
                             % (arch, lib.nvrtcGetErrorString(rc).decode(), log), log)
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
        lowered = {}
        for n in name_expressions:
            p = ctypes.c_char_p()
            _check(lib, lib.nvrtcGetLoweredName(prog, n.encode(), ctypes.byref(p)), "nvrtcGetLoweredName(%s)" % n)
            lowered[n] = p.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return CompileResult(arch=arch, cubin=cubin.raw, ptx=ptx.value.decode(errors="replace"), log=log, lowered_names=lowered, kernels=_parse_ptxas(log))
