"""The emulator's host compilers: every supported one builds kernels that include standard headers
after fa_port.cuh, CXX= selects the compiler, and a failed compile says which compiler, what
failed and how to pick another."""
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from flasharray import emulator
from flasharray._private import host_compiler
from flasharray._private.sources import cuda_src_dir

# A kernel that includes a broad set of standard headers *after* fa_port.cuh, and spells GNU
# attributes the way libstdc++ 13 and libc++ do in their own headers.
STD_HEADERS_SRC = r'''
#include "fa_port.cuh"
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <complex>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <variant>
#include <vector>

namespace frag {
__attribute__((__noinline__)) int twice(int x) { return 2 * x; }                 // shared_ptr_base.h
__attribute__((__always_inline__)) inline int plus_one(int x) { return x + 1; }
__attribute__((__const__)) int square(int x) { return x * x; }
__attribute__((__noinline__, __cold__)) void cold_path(int* p) { *p = -1; }       // basic_string.tcc 13
[[__gnu__::__noinline__]] int thrice(int x) { return 3 * x; }                    // <stacktrace>
}  // namespace frag

__device__ FA_NOINLINE int shifted(int x) { return x + 1000; }

__global__ void uses_std(int* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    std::array<int, 4> a{frag::twice(i), frag::plus_one(i), frag::square(i), frag::thrice(i)};
    auto owned = std::make_shared<int>(std::accumulate(a.begin(), a.end(), 0));
    const std::string digits = std::to_string(*std::max_element(a.begin(), a.end()));
    int v = *owned + static_cast<int>(digits.size()) + shifted(0);
    if (i < 0) frag::cold_path(&v);
    fa::gstore(out + i, v);
}
'''


def _expected(n):
    i = np.arange(n)
    vals = np.stack([2 * i, i + 1, i * i, 3 * i])
    return vals.sum(0) + np.array([len(str(m)) for m in vals.max(0)]) + 1000


def _candidates():
    """Compiler commands on this machine, one per distinct executable (+ arguments)."""
    names = ["g++", "clang++", "clang++ -stdlib=libc++"]
    names += ["g++-%d" % v for v in (12, 13, 14)] + ["clang++-%d" % v for v in range(14, 21)]
    seen, out = set(), []
    for name in names:
        words = name.split()
        exe = shutil.which(words[0])
        key = (os.path.realpath(exe) if exe else name, tuple(words[1:]))
        if key not in seen:
            seen.add(key)
            out.append(name)
    return out


def _use(monkeypatch, cxx):
    """Select ``cxx`` through $CXX, as a user would; skip (with the reason) when it is unusable."""
    if not shutil.which(cxx.split()[0]):
        pytest.skip("%s is not installed" % cxx.split()[0])
    try:
        cc = host_compiler.identify(tuple(cxx.split()))
    except host_compiler.CompilerNotFound as e:
        pytest.skip(str(e))
    monkeypatch.setenv("CXX", cxx)
    return cc


@pytest.mark.parametrize("cxx", _candidates())
def test_standard_headers_after_fa_port_with_every_installed_compiler(cxx, monkeypatch):
    cc = _use(monkeypatch, cxx)
    mod = emulator.Module(STD_HEADERS_SRC, name_expressions=["uses_std"])
    out = np.zeros(70, np.int32)
    mod.launch("uses_std", 3, 32, (out, np.int32(70)))
    np.testing.assert_array_equal(out, _expected(70), err_msg=cc.describe())


def _keyword_macros():
    """The double-underscore names fa_emu.h defines as macros."""
    text = (cuda_src_dir() / "emu" / "fa_emu.h").read_text()
    return sorted(set(re.findall(r"^#define (__\w+?__)\b", text, re.M)))


def _stdlib_include_dirs(cc):
    """The current compiler's C++ standard library include directories (from `-v`)."""
    proc = subprocess.run([*cc.argv, "-x", "c++", "-E", "-v", "-"], input="", capture_output=True,
                          text=True, env=dict(os.environ, LC_ALL="C"))
    dirs = re.findall(r"^ (\S+)$", proc.stderr.split("search starts here:", 1)[-1], re.M)
    dirs = [Path(d).resolve() for d in dirs if "c++" in Path(d).parts]
    return [d for d in dirs if not any(o != d and o in d.parents for o in dirs)]


def test_keyword_macros_are_not_spelled_by_the_standard_library():
    """No CUDA keyword the emulator defines as a macro appears in the installed C++ standard
    library: a header included after fa_port.cuh would otherwise be rewritten (the g++ 13 bug:
    `__noinline__`, which libstdc++ writes in __attribute__((__noinline__)))."""
    macros = _keyword_macros()
    assert "__global__" in macros and "__noinline__" not in macros
    cc = host_compiler.current()
    dirs = _stdlib_include_dirs(cc)
    assert dirs, "no C++ standard library include directory found for %s" % cc.describe()
    pattern = re.compile(r"\b(%s)\b" % "|".join(macros))
    hits = []
    for d in dirs:
        for path in d.rglob("*"):
            if path.is_file():
                m = pattern.search(path.read_text(errors="replace"))
                if m:
                    hits.append("%s: %s" % (path, m.group(0)))
    assert not hits, "standard library headers use emulator keyword macros:\n" + "\n".join(hits[:20])


def test_cxx_selects_the_compiler_and_its_arguments(monkeypatch):
    monkeypatch.setenv("CXX", "%s -DFROM_CXX=7" % host_compiler.current().argv[0])
    src = '#include "fa_port.cuh"\n__global__ void k(int* p) { fa::gstore(p, FROM_CXX); }\n'
    out = np.zeros(1, np.int32)
    emulator.Module(src, name_expressions=["k"]).launch("k", 1, 1, (out,))
    assert out[0] == 7


def test_missing_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    with pytest.raises(emulator.CompileError, match=r"'no-such-compiler-xyz' is not usable.*CXX="):
        emulator.Module('#include "fa_port.cuh"\n', name_expressions=[])


def test_compile_failure_names_compiler_first_error_command_and_cxx():
    src = ('#include "fa_port.cuh"\n'
           '__global__ void broken(float* p) { fa::gstore(p, first_undeclared); }\n'
           '__global__ void broken2(float* p) { fa::gstore(p, second_undeclared); }\n')
    with pytest.raises(emulator.CompileError) as e:
        emulator.Module(src, name_expressions=["broken"])
    msg, cc = str(e.value), host_compiler.current()
    assert ("with %s:" % cc.describe()) in msg
    assert cc.version in msg and re.search(r"\d+\.\d+", cc.version)
    assert "first_undeclared" in msg and "second_undeclared" not in msg   # the first error only
    assert "second_undeclared" in e.value.log                             # the full log is kept
    assert "command: " in msg and "main.cpp" in msg
    assert "CXX=" in msg


def test_bare_noinline_keyword_gets_a_hint():
    src = '#include "fa_port.cuh"\n__device__ __noinline__ int f(int x) { return x; }\n'
    with pytest.raises(emulator.CompileError, match="FA_NOINLINE"):
        emulator.Module(src, name_expressions=[])


GCC_LOG = """\
In file included from /usr/include/c++/13/string:54,
                 from kernel.cu:3:
/usr/include/c++/13/bits/basic_string.tcc: In member function 'void f()':
/usr/include/c++/13/bits/basic_string.tcc:473:20: error: 'noinline' was not declared in this scope
  473 |     __attribute__((__noinline__, __noclone__, __cold__)) void
      |                    ^~~~~~~~~~~~
fa_emu.h:27:37: note: in definition of macro '__noinline__'
kernel.cu:9:1: error: expected ';' before '}' token
"""

CLANG_LOG = """\
clang: warning: argument unused during compilation: '-pthread'
kernel.cu:2:50: error: use of undeclared identifier 'nope'
__global__ void broken(float* p) { fa::gstore(p, nope); }
                                                 ^
1 error generated.
"""


def test_first_error_keeps_include_chain_and_notes_but_not_later_errors():
    first = host_compiler.first_error(GCC_LOG)
    assert first.startswith("In file included from /usr/include/c++/13/string:54")
    assert "'noinline' was not declared" in first and "note: in definition of macro" in first
    assert "expected ';'" not in first
    clang = host_compiler.first_error(CLANG_LOG)
    assert clang.startswith("kernel.cu:2:50: error: use of undeclared identifier 'nope'")
    assert "warning" not in clang and "1 error generated" in clang
    assert host_compiler.first_error("all good\n") == ""


def test_modules_link_with_gold_where_it_links(monkeypatch, tmp_path):
    """Kernel modules link with GNU gold where the compiler can use it (the library carries gold's version note);
    ``$FLASHARRAY_EMULATOR_GOLD=0`` keeps the default linker; an unusable linker is probed as such, not used."""
    monkeypatch.setenv("FLASHARRAY_EMULATOR_GOLD", "1")     # whatever the caller's environment says
    cc = host_compiler.current()
    gold = host_compiler._links_shared(cc.argv, host_compiler.GOLD_FLAGS)
    assert host_compiler.module_link_flags(cc) == (host_compiler.GOLD_FLAGS if gold else ())
    assert not host_compiler._links_shared(cc.argv, ("-fuse-ld=no-such-linker-xyz",))
    for setting, value in (("0", 11), ("1", 12)):
        monkeypatch.setenv("FLASHARRAY_EMULATOR_GOLD", setting)
        monkeypatch.setenv("FLASHARRAY_EMULATOR_CACHE", str(tmp_path / setting))
        src = '#include "fa_port.cuh"\n__global__ void k(int* p) { fa::gstore(p, %d); }\n' % value
        out = np.zeros(1, np.int32)
        emulator.Module(src, name_expressions=["k"]).launch("k", 1, 1, (out,))
        assert out[0] == value
        libs = list((tmp_path / setting).glob("mod-*/module-*.so"))
        assert len(libs) == 1
        assert (b"gold " in libs[0].read_bytes()) == (setting == "1" and gold), setting
    monkeypatch.setenv("FLASHARRAY_EMULATOR_GOLD", "0")
    assert host_compiler.module_link_flags(cc) == ()
    monkeypatch.setenv("FLASHARRAY_EMULATOR_GOLD", "1")
    chosen = host_compiler.Compiler(cc.argv + ("-fuse-ld=bfd",), cc.family, cc.version, cc.stdlib)
    assert host_compiler.module_link_flags(chosen) == ()     # $CXX's own linker choice stands
