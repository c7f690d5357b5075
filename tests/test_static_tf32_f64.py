"""The tf32 / fp64 tensor-core wrappers of fa_port.cuh compile with NVRTC (no GPU needed) to the
intended SASS: HMMA.1688.F32.TF32 for mma_m16n8k8_tf32, DMMA (DMMA.884 on sm_80, DMMA.8x8x4 on
sm_90) for mma_m8n8k4_f64, DMMA.16x8x16 for mma_m16n8k16_f64 (sm_90), and for cvt_tf32 the integer sequence the emulator reproduces bit for
bit; no spills. On sm_75 each wrapper is a compile error naming itself (mma_m16n8k16_f64: below sm_90)."""
from pathlib import Path

import pytest

from flasharray._private import nvrtc, sass
from conftest import requires_nvrtc

KERNELS = Path(__file__).parent / "kernels"
NAMES = ["cvt_tf32_test", "mma_tf32_test", "mma_3xtf32_test", "mma_f64_test"]
SASS_OK, SASS_WHY = sass.available()
DMMA = {"sm_80": "DMMA.884", "sm_90": "DMMA.8x8x4"}
pytestmark = requires_nvrtc


@pytest.fixture(scope="module", params=["sm_80", "sm_90"])
def compiled(request):
    arch = request.param
    r = nvrtc.compile_cubin((KERNELS / "tf32_f64.cu").read_text(), arch, name_expressions=NAMES)
    text = sass.disassemble(r.cubin) if SASS_OK else None
    return arch, r, text


def kernel_sass(r, text, name):
    """The SASS lines of one kernel (cuobjdump -sass output, from its 'Function :' header)."""
    lowered, lines, inside = r.kernel(name).lowered_name, [], False
    for line in text.splitlines():
        if "Function :" in line:
            inside = line.split("Function :")[1].strip() == lowered
        elif inside and "/*0" in line:
            lines.append(line.split(";")[0].split("*/", 1)[1].strip())
    assert lines, name
    return lines


def count(lines, opcode):
    """How many lines have exactly this opcode (a predicate guard such as `@!P0` skipped)."""
    return sum(1 for x in lines if [w for w in x.split() if not w.startswith("@")][0] == opcode)


def test_no_spills_and_ptx(compiled):
    arch, r, _ = compiled
    for n in NAMES:
        info = r.kernel(n)
        assert info.spill_stores == 0 and info.spill_loads == 0 and info.stack_frame == 0, n
    assert r.ptx.count("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32") == 4
    assert r.ptx.count("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64") == 1
    assert r.ptx.count("cvt.rna.tf32.f32") == 1 + 2 + 2 * 6   # cvt_tf32_test, 3xtf32 (6 regs split)


@pytest.mark.skipif(not SASS_OK, reason=SASS_WHY)
def test_sass_tensor_core_instructions(compiled):
    arch, r, text = compiled
    assert count(kernel_sass(r, text, "mma_tf32_test"), "HMMA.1688.F32.TF32") == 1
    assert count(kernel_sass(r, text, "mma_3xtf32_test"), "HMMA.1688.F32.TF32") == 3
    f64 = kernel_sass(r, text, "mma_f64_test")
    assert count(f64, DMMA[arch]) == 1
    assert not any("HMMA" in x for x in f64)


@pytest.mark.skipif(not SASS_OK, reason=SASS_WHY)
def test_sass_cvt_tf32_is_the_emulated_sequence(compiled):
    """FSETP.GEU |x|, +INF; @!P x += 0x1000; x &= 0xffffe000 (fa_emu.h tf32_round_bits)."""
    arch, r, text = compiled
    lines = kernel_sass(r, text, "cvt_tf32_test")
    assert any(x.startswith("FSETP.GEU.AND") and "+INF" in x and "|" in x for x in lines)
    assert sum("0xffffe000" in x and x.startswith("LOP3.LUT") for x in lines) == 2   # hi, lo
    assert not any(x.split()[0].startswith(("F2F", "FRND", "HMMA", "DMMA")) for x in lines)


SM75_USES = {
    "cvt_tf32": "fa::gstore(o, fa::cvt_tf32(fa::gload(x)));",
    "mma_m16n8k8_tf32": "uint32_t a[4] = {}, b[2] = {}; float c[4] = {}, d[4]; "
                        "fa::mma_m16n8k8_tf32(d, a, b, c); fa::gstore(o, d[0]);",
    "mma_m8n8k4_f64": "double a[1] = {}, b[1] = {}, c[2] = {}, d[2]; "
                      "fa::mma_m8n8k4_f64(d, a, b, c); fa::gstore(o, (float)d[0]);",
}


@pytest.mark.parametrize("what", sorted(SM75_USES))
def test_sm75_use_is_a_compile_error_naming_the_wrapper(what):
    src = '#include "fa_port.cuh"\n__global__ void k(float* o, const float* x) { %s }\n' % SM75_USES[what]
    nvrtc.compile_cubin(src, "sm_80", name_expressions=["k"])          # fine where it exists
    with pytest.raises(nvrtc.NvrtcError, match=r"fa::%s needs sm_80\+" % what) as e:
        nvrtc.compile_cubin(src, "sm_75", name_expressions=["k"])
    assert e.value.log.count("error: static assertion failed") == 1   # only this wrapper


@pytest.mark.skipif(not SASS_OK, reason=SASS_WHY)
def test_sass_f64_m16n8k16_is_one_dmma_16x8x16():
    r = nvrtc.compile_cubin((KERNELS / "tf32_f64.cu").read_text(), "sm_90", name_expressions=["mma_f64_k16_test<0>"])
    info = r.kernel("mma_f64_k16_test<0>")
    assert info.spill_stores == 0 and info.spill_loads == 0
    assert r.ptx.count("mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64") == 1
    lines = kernel_sass(r, sass.disassemble(r.cubin), "mma_f64_k16_test<0>")
    assert count(lines, "DMMA.16x8x16") == 1
    assert not any(x.split()[0].startswith(("DMMA.8x8x4", "HMMA")) for x in lines)


def test_f64_m16n8k16_below_sm90_is_a_compile_error_naming_the_wrapper():
    src = ('#include "fa_port.cuh"\n__global__ void k(float* o) { double a[8] = {}, b[4] = {}, c[4] = {}, d[4]; '
           'fa::mma_m16n8k16_f64(d, a, b, c); fa::gstore(o, (float)d[0]); }\n')
    nvrtc.compile_cubin(src, "sm_90", name_expressions=["k"])
    with pytest.raises(nvrtc.NvrtcError, match=r"fa::mma_m16n8k16_f64 needs sm_90\+") as e:
        nvrtc.compile_cubin(src, "sm_80", name_expressions=["k"])
    assert e.value.log.count("error: static assertion failed") == 1
