"""The GPU branch of fa_port.cuh compiles with NVRTC (no GPU needed) for every target architecture,
and the reusable NVRTC driver reports ptxas resource usage per kernel."""
import re
from pathlib import Path

import pytest

from flasharray._private import nvrtc
from conftest import requires_nvrtc

KERNELS = Path(__file__).parent / "kernels"
pytestmark = requires_nvrtc


@pytest.mark.parametrize("arch", ["sm_75", "sm_80", "sm_90"])
def test_every_wrapper_compiles(arch):
    names = ["port_wrappers<fa_half>"]
    if arch != "sm_75":   # bf16 tensor cores start at sm_80
        names.append("port_wrappers<fa_bf16>")
    r = nvrtc.compile_cubin((KERNELS / "port_wrappers.cu").read_text(), arch, name_expressions=names)
    assert r.cubin[:4] == b"\x7fELF" and r.arch == arch
    for n in names:
        info = r.kernel(n)
        assert info.lowered_name.startswith("_Z13port_wrappers")
        assert 0 < info.registers <= 255
        assert info.spill_stores == 0 and info.spill_loads == 0


def test_bf16_mma_on_sm75_is_a_compile_error():
    with pytest.raises(nvrtc.NvrtcError, match=r"fa_bf16 \(sm_80\+\)"):
        nvrtc.compile_cubin((KERNELS / "port_wrappers.cu").read_text(), "sm_75",
                            name_expressions=["port_wrappers<fa_bf16>"])


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_gemm_test_kernel_compiles_without_spills(arch):
    names = ["gemm_fp16<0>"]
    r = nvrtc.compile_cubin((KERNELS / "gemm_fp16.cu").read_text(), arch, name_expressions=names)
    info = r.kernel(names[0])
    assert info.spill_stores == 0 and info.spill_loads == 0 and info.static_smem == 0
    assert "Compiling entry function '%s' for '%s'" % (info.lowered_name, arch) in r.log


@pytest.mark.parametrize("arch,k8,k16,cp_async", [("sm_75", 2, 0, 0), ("sm_80", 0, 1, 4), ("sm_90", 0, 1, 4)])
def test_instruction_selection_per_arch(arch, k8, k16, cp_async):
    """fp16 mma is one m16n8k16 from sm_80 and two m16n8k8 on sm_75; cp.async exists from sm_80
    (four per thread in port_wrappers: 16, 8 and 4 bytes, and the staged chunk), a plain copy before."""
    r = nvrtc.compile_cubin((KERNELS / "port_wrappers.cu").read_text(), arch, name_expressions=["port_wrappers<fa_half>"])
    assert r.ptx.count("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32") == k8
    assert r.ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32") == k16
    assert r.ptx.count("cp.async.cg.shared.global") + r.ptx.count("cp.async.ca.shared.global") == cp_async
    for x in ("x4.shared.b16", "x2.shared.b16", "x1.trans.shared.b16", "x2.trans.shared.b16"):
        assert "ldmatrix.sync.aligned.m8n8." + x in r.ptx
    # FA_NOINLINE keeps its function out of line: a .func called from the kernel.
    assert re.search(r"\.func .*noinline_half", r.ptx) and re.search(r"call\.uni.*\n?.*noinline_half", r.ptx)


def test_static_shared_memory_and_registers_are_parsed():
    src = ('#include "fa_port.cuh"\n'
           'template <int N> __global__ void k(float* out) { __shared__ float s[N];\n'
           '  s[threadIdx.x] = threadIdx.x; __syncthreads(); fa::gstore(out + threadIdx.x, s[(threadIdx.x + 1) % N]); }\n')
    r = nvrtc.compile_cubin(src, "sm_80", name_expressions=["k<256>", "k<1024>"])
    assert r.kernel("k<256>").static_smem == 1024
    assert r.kernel("k<1024>").static_smem == 4096
    assert set(r.kernels) == {r.lowered_names["k<256>"], r.lowered_names["k<1024>"]}


def test_compile_error_has_log():
    with pytest.raises(nvrtc.NvrtcError, match="undefined_thing") as e:
        nvrtc.compile_cubin('#include "fa_port.cuh"\n__global__ void k() { undefined_thing(); }\n', "sm_80")
    assert "undefined_thing" in e.value.log


def test_options_and_include_dirs(tmp_path):
    (tmp_path / "extra.cuh").write_text("#define EXTRA_VALUE 3.0f\n")
    src = '#include "fa_port.cuh"\n#include "extra.cuh"\n__global__ void k(float* o) { fa::gstore(o, EXTRA_VALUE * SCALE); }\n'
    r = nvrtc.compile_cubin(src, "sm_86", name_expressions=["k"], options=["-DSCALE=2.0f"], include_dirs=[tmp_path])
    assert r.kernel("k").registers > 0


def test_parse_ptxas_log():
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z1kPf' for 'sm_80'
ptxas info    : Function properties for _Z1kPf
    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 40 registers, 2048 bytes smem, 360 bytes cmem[0]
ptxas info    : Function properties for _Z6helperv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
"""
    ks = nvrtc._parse_ptxas(log)
    assert list(ks) == ["_Z1kPf"]
    k = ks["_Z1kPf"]
    assert (k.registers, k.spill_stores, k.spill_loads, k.stack_frame, k.static_smem, k.cmem) == (40, 8, 4, 16, 2048, 360)


def test_cuda13_wheel_layout_is_found(tmp_path, monkeypatch):
    """The CUDA 13 nvidia-cuda-nvrtc wheel keeps libnvrtc in nvidia/cu13/lib (the cu12 one in
    nvidia/cuda_nvrtc/lib), the runtime headers in nvidia/cu13/include."""
    lib = tmp_path / "nvidia" / "cu13" / "lib"
    inc = tmp_path / "nvidia" / "cu13" / "include"
    lib.mkdir(parents=True)
    inc.mkdir(parents=True)
    (lib / "libnvrtc.so.13").write_bytes(b"")
    (inc / "cuda_fp16.h").write_text("")
    monkeypatch.delenv("FLASHARRAY_NVRTC", raising=False)
    monkeypatch.setattr(nvrtc.sys, "path", [str(tmp_path)])
    assert nvrtc.find_libnvrtc() == str(lib / "libnvrtc.so.13")
    assert nvrtc.cuda_include_dirs()[0] == str(inc)


def test_builtins_preload_is_a_no_op_without_them(tmp_path):
    """_preload_builtins loads libnvrtc-builtins from beside libnvrtc only where it exists (here: not)."""
    (tmp_path / "libnvrtc.so.13").write_bytes(b"")
    nvrtc._preload_builtins(str(tmp_path / "libnvrtc.so.13"))   # nothing to load, nothing raised
    nvrtc._preload_builtins("libnvrtc.so")                       # a bare soname: the loader's business


def _sass_lines(cubin):
    from flasharray._private import sass
    return [ln.split("/*")[-2] for ln in sass.disassemble(cubin).splitlines() if ln.count("/*") >= 2]


@pytest.mark.skipif(not __import__("flasharray._private.sass", fromlist=["available"]).available()[0],
                    reason="needs the disassembler wheels")
def test_split_compile_gives_the_same_code():
    """Programs of several kernels compile with ``-split-compile=0`` (every CPU): the same instructions
    and resources as on one thread."""
    src = (KERNELS / "port_wrappers.cu").read_text()
    names = ["port_wrappers<fa_half>", "port_wrappers<fa_bf16>"]
    lib = nvrtc._load()
    base = ["--gpu-architecture=sm_80", "-Xptxas=-v", "--std=c++17", "-I" + str(nvrtc.cuda_src_dir())]
    base += ["-I" + d for d in nvrtc.cuda_include_dirs()]
    one = nvrtc._compile(lib, src, "sm_80", names, base)
    split = nvrtc._compile(lib, src, "sm_80", names, base + ["-split-compile=0"])
    assert _sass_lines(one.cubin) == _sass_lines(split.cubin) and len(_sass_lines(one.cubin)) > 100
    for n in names:
        assert one.kernel(n).registers == split.kernel(n).registers


def test_split_compile_falls_back_where_nvrtc_lacks_it(monkeypatch):
    """An NVRTC that rejects ``-split-compile`` (INVALID_OPTION) compiles the program on one thread, and
    later programs no longer ask for it."""
    calls = []
    real = nvrtc._compile

    def old_nvrtc(lib, source, arch, names, opts):
        calls.append(any(o.startswith("-split-compile") for o in opts))
        if calls[-1]:
            raise nvrtc.NvrtcError("NVRTC failed to compile for %s (NVRTC_ERROR_INVALID_OPTION):\n" % arch,
                                   "nvrtc: error: unrecognized option -split-compile=0 found\n")
        return real(lib, source, arch, names, opts)

    monkeypatch.setattr(nvrtc, "_compile", old_nvrtc)
    monkeypatch.setattr(nvrtc, "_split_compile_ok", True)
    names = ["port_wrappers<fa_half>", "port_wrappers<fa_bf16>"]
    src = (KERNELS / "port_wrappers.cu").read_text()
    r = nvrtc.compile_cubin(src, "sm_80", name_expressions=names)
    assert r.kernel(names[0]).registers > 0 and calls == [True, False]
    nvrtc.compile_cubin(src, "sm_80", name_expressions=names)
    assert calls == [True, False, False] and nvrtc._split_compile_ok is False


def test_split_compile_keeps_real_errors(monkeypatch):
    """A program that does not compile reports its own error, not the fallback's."""
    monkeypatch.setattr(nvrtc, "_split_compile_ok", True)
    with pytest.raises(nvrtc.NvrtcError, match="undefined"):
        nvrtc.compile_cubin("template <int N> __global__ void k() { undefined_thing(); }", "sm_80",
                            name_expressions=["k<1>", "k<2>"])
    assert nvrtc._split_compile_ok is True
