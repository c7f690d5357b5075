"""The host C++ compiler behind :mod:`flasharray.emulator`: which one, its flags, its errors.

The compiler is ``$CXX``, split into words like a shell does (so ``CXX="clang++ -stdlib=libc++"``
and ``CXX="ccache g++"`` work), else ``c++``, else ``g++``. Supported: g++ 12, 13, 14 and
clang++ ≥ 14, with libstdc++ or (clang) libc++. What the compiler is — family, version, standard
library — is read once per command from its predefined macros, not from ``--version`` text.
"""
import dataclasses
import functools
import os
import re
import shlex
import shutil
import subprocess
import tempfile

SUPPORTED = "g++ 12-14 and clang++ >= 14 (libstdc++ or libc++)"

# Flags every emulator build uses.
COMMON_FLAGS = ("-O2", "-fPIC", "-fno-strict-aliasing")
# ... and the kernels' modules after them (the last -O wins): -Og. The runtime library, built once per compiler, does
# the emulator's per-instruction work (warp schedules, memory checks, counters) at -O2; a module holds the kernel's
# own arithmetic. The test suite builds ~1,300 modules: -Og builds them in ~25-30 % less compiler time than -O1
# (itself 18-28 % less than -O2) and runs them ~10 % slower; -O0 runs them 3x slower (docs/emulator.md, *Settings*).
# Clang reads -Og as -O1. What the emulator's checks read must not depend on the level: the kernels' __forceinline__
# helpers are inlined at any level (fa_emu.h: call sites are the runtime's identities of barriers and warp
# instructions), and an rs wgmma's A fragment lives (is in scope) until the wait that covers it, as its registers
# would on the GPU (a dead array's stack slot may be reused at -Og). No level changes a result: no -ffast-math, and
# x86-64's baseline has no FMA to contract into.
MODULE_FLAGS = ("-Og",)
# GCC: jump threading, and basic-block reordering's copying of small blocks (a `call
# fa_emu_syncthreads; cmp` block copied into both arms of a preceding `if (threadIdx.x == k)`), can
# duplicate a __syncthreads() call into two branches taken by different threads, which the
# divergent-barrier check (barriers are identified by call site) would then report for correct
# code. Clang needs no flag: fa_emu_api.h declares the barriers `convergent`, which forbids exactly
# that transformation.
FAMILY_FLAGS = {"gcc": ("-fno-thread-jumps", "--param=max-grow-copy-bb-insns=0"), "clang": ()}

# A module's shared library links with GNU gold where the compiler can use it: GNU ld (bfd) took 0.14-0.17 s of each
# module's 0.6-1.6 s build, gold 0.04-0.06 s (g++ 12, binutils 2.40; the same library). Probed once per compiler;
# $FLASHARRAY_EMULATOR_GOLD=0 keeps the compiler's default linker.
GOLD_FLAGS = ("-fuse-ld=gold",)

_PROBE = "#include <cstddef>\n"   # pulls in the standard library's configuration macros


class CompilerNotFound(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class Compiler:
    """One host compiler command and what it is."""
    argv: tuple        # the command and its own arguments, e.g. ("clang++", "-stdlib=libc++")
    family: str        # "gcc" or "clang"
    version: str       # e.g. "13.3.0"
    stdlib: str        # "libstdc++", "libc++" or "unknown"

    @property
    def flags(self):
        return COMMON_FLAGS + FAMILY_FLAGS[self.family]

    @property
    def module_flags(self):
        """The flags of a kernel's module (:data:`MODULE_FLAGS` after :attr:`flags`)."""
        return self.flags + MODULE_FLAGS

    def describe(self):
        """``'clang++ (clang 14.0.6, libstdc++)'``: the command, the compiler and its library."""
        return "%s (%s %s, %s)" % (" ".join(self.argv), self.family, self.version, self.stdlib)


def command():
    """The compiler command as a word list: ``$CXX``, else ``c++``, else ``g++``."""
    env = os.environ.get("CXX", "").strip()
    if env:
        return tuple(shlex.split(env))
    return ("c++",) if shutil.which("c++") else ("g++",)


@functools.lru_cache(maxsize=None)
def identify(argv):
    """The :class:`Compiler` behind ``argv`` (a tuple); raises :class:`CompilerNotFound`."""
    try:
        proc = subprocess.run([*argv, "-x", "c++", "-std=c++17", "-E", "-dM", "-"], input=_PROBE,
                              capture_output=True, text=True, errors="replace", env=dict(os.environ, LC_ALL="C"))
    except OSError as e:
        raise CompilerNotFound(_not_usable(argv, e.strerror or str(e))) from None
    if proc.returncode != 0:
        raise CompilerNotFound(_not_usable(argv, first_error(proc.stderr) or "exit status %d" % proc.returncode))
    macros = dict(re.findall(r"^#define (\w+) ?(.*)$", proc.stdout, re.M))
    if "__clang__" in macros:
        family, parts = "clang", ("__clang_major__", "__clang_minor__", "__clang_patchlevel__")
    elif "__GNUC__" in macros:
        family, parts = "gcc", ("__GNUC__", "__GNUC_MINOR__", "__GNUC_PATCHLEVEL__")
    else:
        raise CompilerNotFound(_not_usable(argv, "neither GCC nor Clang (no __GNUC__ / __clang__ macro)"))
    version = ".".join(macros.get(p, "?") for p in parts)
    stdlib = "libc++" if "_LIBCPP_VERSION" in macros else "libstdc++" if "__GLIBCXX__" in macros else "unknown"
    return Compiler(tuple(argv), family, version, stdlib)


def current():
    """The :class:`Compiler` the emulator uses now (``$CXX`` is read on every call)."""
    return identify(command())


def module_link_flags(compiler):
    """The linker flags of a kernel's module: :data:`GOLD_FLAGS` where gold links a shared library with
    ``compiler`` (and ``$FLASHARRAY_EMULATOR_GOLD`` is not ``0``), else none. A linker chosen in ``$CXX``
    (``-fuse-ld=...``) is kept."""
    if (os.environ.get("FLASHARRAY_EMULATOR_GOLD", "1") == "0"
            or any(w.startswith("-fuse-ld") for w in compiler.argv)):
        return ()
    return GOLD_FLAGS if _links_shared(compiler.argv, GOLD_FLAGS) else ()


@functools.lru_cache(maxsize=None)
def _links_shared(argv, flags):
    """Whether ``argv`` with ``flags`` compiles and links a one-function shared library (a missing ld.gold fails
    here, not in a kernel's build)."""
    with tempfile.TemporaryDirectory(prefix="fa-ld-probe-") as d:
        src, out = os.path.join(d, "probe.cpp"), os.path.join(d, "probe.so")
        with open(src, "w") as f:
            f.write('extern "C" int fa_ld_probe(void) { return 1; }\n')
        try:
            proc = subprocess.run([*argv, *flags, "-shared", "-fPIC", src, "-o", out, "-Wl,--no-undefined"],
                                  capture_output=True, env=dict(os.environ, LC_ALL="C"))
        except OSError:
            return False
        return proc.returncode == 0 and os.path.exists(out)


def _not_usable(argv, why):
    return ("flasharray.emulator needs a C++17 compiler; %r is not usable: %s. Install g++ or clang++, "
            "or choose another compiler with CXX= (supported: %s)." % (" ".join(argv), why, SUPPORTED))


_DIAGNOSTIC = re.compile(r"(: (fatal )?error: |^error: |undefined reference to )")
_CONTEXT = re.compile(r"^(In file included from |\s+from |.*: (In |required from |In instantiation))")


def first_error(log, max_lines=12):
    """The first error of a compiler log with its context: the include chain before it and the
    notes after it (up to the next error), at most ``max_lines`` lines. '' when there is none."""
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if _DIAGNOSTIC.search(line):
            start = i
            while start > 0 and _CONTEXT.match(lines[start - 1]):
                start -= 1
            end = i + 1
            while end < len(lines) and not _DIAGNOSTIC.search(lines[end]) and end - start < max_lines:
                end += 1
            return "\n".join(lines[start:end])
    return ""


# Hints for errors whose cause is the emulator's CUDA dialect rather than the user's code.
_HINTS = (
    (re.compile(r"__noinline__"),
     "the emulator does not define the CUDA keyword __noinline__: libstdc++ and libc++ spell their own "
     "attribute __attribute__((__noinline__)), which such a macro would break. Write FA_NOINLINE "
     "(fa_port.cuh) instead; it is __noinline__ on the GPU."),
)


def failure_message(what, compiler, cmd, log):
    """The message of a failed compile: compiler and version, the first error, the command, and how
    to choose another compiler."""
    err = first_error(log) or log.strip()[-2000:]
    msg = ["%s failed to compile with %s:" % (what, compiler.describe()), err]
    msg += ["hint: " + hint for rx, hint in _HINTS if rx.search(err)]
    msg.append("command: %s" % " ".join(shlex.quote(c) for c in cmd))
    msg.append("The full compiler output is in CompileError.log. CXX= chooses another compiler "
               "(supported: %s)." % SUPPORTED)
    return "\n".join(msg)
