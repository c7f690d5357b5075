"""flasharray.emulator as a driver: compile + cache, launch geometry, schedules, counters, options."""
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from flasharray import emulator

KERNELS = Path(__file__).parent / "kernels"

INDEX_SRC = r'''
#include "fa_port.cuh"
// Every thread writes its global linear id and its (thread, block) coordinates.
__global__ void coords(int* out) {
    const int tx = threadIdx.x, ty = threadIdx.y, tz = threadIdx.z;
    const int t = tx + blockDim.x * (ty + blockDim.y * tz);
    const int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const int nt = blockDim.x * blockDim.y * blockDim.z;
    int* o = out + 6 * (b * nt + t);
    fa::gstore(o + 0, tx); fa::gstore(o + 1, ty); fa::gstore(o + 2, tz);
    fa::gstore(o + 3, (int)blockIdx.x); fa::gstore(o + 4, (int)blockIdx.y); fa::gstore(o + 5, (int)blockIdx.z);
}
template <int kScale>
__global__ void scale(float* y, const float* x, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) fa::gstore(y + i, SCALE_BIAS + kScale * fa::gload(x + i));
}
'''


@pytest.fixture(scope="module")
def idx_mod():
    return emulator.Module(INDEX_SRC, name_expressions=["coords", "scale<3>", "scale<-1>"], options=["-DSCALE_BIAS=0.5f",
                           "--use_fast_math", "-arch=sm_80"])


def test_launch_geometry_3d(idx_mod):
    grid, block = (3, 2, 2), (4, 3, 2)
    nb, nt = 12, 24
    out = np.full((nb, nt, 6), -1, np.int32)
    c = idx_mod.launch("coords", grid, block, (out,), workers=2)
    assert c.blocks == nb
    for b in range(nb):
        bx, by, bz = b % 3, (b // 3) % 2, b // 6
        for t in range(nt):
            tx, ty, tz = t % 4, (t // 4) % 3, t // 12
            assert tuple(out[b, t]) == (tx, ty, tz, bx, by, bz)


def test_options_define_and_ignore_gpu_flags(idx_mod):
    x = np.arange(100, dtype=np.float32)
    y = np.zeros_like(x)
    idx_mod.launch("scale<3>", 4, 32, (y, x, np.int32(100)))
    np.testing.assert_array_equal(y, 0.5 + 3 * x)
    idx_mod.get_function("scale<-1>")((4,), (32,), (y, x, np.int32(100)))
    np.testing.assert_array_equal(y, 0.5 - x)
    assert idx_mod.get_function("scale<3>").signature == ["float*", "const float*", "int"]


def test_unknown_kernel_name(idx_mod):
    with pytest.raises(ValueError, match="not one of this module's name_expressions"):
        idx_mod.launch("scale<4>", 1, 1, ())


def test_bad_launch_shapes(idx_mod):
    out = np.zeros(6 * 2048, np.int32)
    with pytest.raises(emulator.EmulatorError, match="1..1024"):
        idx_mod.launch("coords", 1, (32, 33), (out,))
    with pytest.raises(ValueError, match="shared_mem"):
        idx_mod.launch("coords", 1, 32, (out,), shared_mem=300 * 1024)
    with pytest.raises(ValueError, match="schedule"):
        idx_mod.launch("coords", 1, 32, (out,), schedule="sideways")


def test_results_identical_across_schedules_and_workers(idx_mod):
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    ys = []
    for schedule, seed, workers in [("forward", 0, 1), ("reverse", 0, 2), ("random", 5, 2), ("random", 6, 1)]:
        y = np.zeros_like(x)
        idx_mod.launch("scale<3>", 8, 128, (y, x, np.int32(1000)), schedule=schedule, seed=seed, workers=workers)
        ys.append(y)
    for y in ys[1:]:
        np.testing.assert_array_equal(y, ys[0])


def test_compile_error_carries_compiler_message():
    src = '#include "fa_port.cuh"\n__global__ void broken(float* p) { fa::gstore(p, undeclared_name); }\n'
    with pytest.raises(emulator.CompileError, match="undeclared_name") as e:
        emulator.Module(src, name_expressions=["broken"])
    assert "error" in e.value.log


def test_bad_name_expression_is_compile_error():
    src = '#include "fa_port.cuh"\n__global__ void k(float* p) { fa::gstore(p, 1.0f); }\n'
    with pytest.raises(emulator.CompileError, match="no_such_kernel"):
        emulator.Module(src, name_expressions=["no_such_kernel<int>"])


def test_cache_reuses_and_invalidates_on_header_change(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHARRAY_EMULATOR_CACHE", str(tmp_path / "cache"))
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "value.cuh").write_text("constexpr float kValue = 1.0f;\n")
    src = ('#include "fa_port.cuh"\n#include "value.cuh"\n// %s\n'
           '__global__ void k(float* p) { fa::gstore(p, kValue); }\n' % tmp_path)
    out = np.zeros(1, np.float32)
    emulator.Module(src, ["k"], include_dirs=[inc]).launch("k", 1, 1, (out,))
    assert out[0] == 1.0
    # A new process would find it on disk: forget the in-process copies and forbid compiling.
    emulator._loaded.clear()
    real = emulator._run_compiler
    monkeypatch.setattr(emulator, "_run_compiler", lambda *a: pytest.fail("recompiled a cached module"))
    emulator.Module(src, ["k"], include_dirs=[inc]).launch("k", 1, 1, (out,))
    # Editing an included header invalidates the entry.
    monkeypatch.setattr(emulator, "_run_compiler", real)
    emulator._loaded.clear()
    (inc / "value.cuh").write_text("constexpr float kValue = 2.0f;\n")
    emulator.Module(src, ["k"], include_dirs=[inc]).launch("k", 1, 1, (out,))
    assert out[0] == 2.0
    assert len(list((tmp_path / "cache").glob("mod-*/module-*.so"))) == 2
    # ... also within one process, without clearing anything (editing a header in a notebook).
    (inc / "value.cuh").write_text("constexpr float kValue = 3.0f;\n")
    emulator.Module(src, ["k"], include_dirs=[inc]).launch("k", 1, 1, (out,))
    assert out[0] == 3.0


def test_gcc_modules_read_the_precompiled_port_header(tmp_path, monkeypatch):
    """With GCC every module reads fa_port.cuh (and the emulator's headers) from one precompiled header per flags
    (the module's dependency list then lacks them: GCC did not open them); FLASHARRAY_EMULATOR_PCH=0 parses them
    per module. The results are the same."""
    if emulator._compiler().family != "gcc":
        pytest.skip("precompiled headers are made for GCC only (%s)" % emulator._compiler().describe())
    src = '#include "fa_port.cuh"\n// %s\n__global__ void k(float* p) { fa::gstore(p, 2.5f * fa::gload(p)); }\n' % tmp_path
    deps, outs = {}, {}
    for pch in ("1", "0"):
        monkeypatch.setenv("FLASHARRAY_EMULATOR_PCH", pch)
        monkeypatch.setenv("FLASHARRAY_EMULATOR_CACHE", str(tmp_path / ("cache" + pch)))
        out = np.ones(1, np.float32)
        emulator.Module(src, ["k"]).launch("k", 1, 1, (out,))
        outs[pch] = out[0]
        (meta,) = (tmp_path / ("cache" + pch)).glob("mod-*/deps.json")
        deps[pch] = {Path(p).name for p in json.loads(meta.read_text())["deps"]}
    assert outs == {"1": 2.5, "0": 2.5}
    assert len(list((tmp_path / "cache1").glob("pch-*/fa_port.cuh.gch"))) == 1
    assert not list((tmp_path / "cache0").glob("pch-*"))
    assert "fa_port.cuh" in deps["0"] and "fa_emu.h" in deps["0"]
    assert "fa_port.cuh" not in deps["1"] and "fa_emu.h" not in deps["1"]


def test_default_cache_dir(monkeypatch):
    monkeypatch.delenv("FLASHARRAY_EMULATOR_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/some/where")
    assert emulator.cache_dir() == Path("/some/where/flasharray/emulator")
    monkeypatch.setenv("FLASHARRAY_EMULATOR_CACHE", "/else/where")
    assert emulator.cache_dir() == Path("/else/where")


def test_every_port_wrapper_runs_on_the_emulator():
    """The kernel the NVRTC test compiles for the GPU also compiles and runs on the host branch."""
    mod = emulator.Module((KERNELS / "port_wrappers.cu").read_text(),
                          name_expressions=["port_wrappers<fa_half>", "port_wrappers<fa_bf16>"])
    for dtype, name in [(np.float16, "fa_half"), (ml_dtypes.bfloat16, "fa_bf16")]:
        x = (np.arange(256) % 7).astype(dtype)
        out = np.zeros(33, np.float32)
        out64 = np.zeros(2, np.float64)
        c = mod.launch("port_wrappers<%s>" % name, 2, 32, (out, out64, x, np.int32(200)), shared_mem=512)
        assert np.all(np.isfinite(out)) and c.mma == 2 and c.ldmatrix == 8 and c.shuffles == 2 * 7
        assert c.cp_async == 2 * 32 * 4 and c.atomics == 2 * 32 * 3 and c.syncwarps == 2 and c.barriers == 6
        assert out64[1] == 32 * (0 + 32 + 2) + 32 * (1 + 32 + 2)   # blockIdx.x + blockDim.x + gridDim.x


def test_half_and_bfloat16_scalars_by_value():
    src = '''#include "fa_port.cuh"
    __global__ void k(float* out, fa_half h, fa_bf16 b) { fa::gstore(out, fa::to_float(h)); fa::gstore(out + 1, fa::to_float(b)); }
    '''
    mod = emulator.Module(src, ["k"])
    out = np.zeros(2, np.float32)
    mod.launch("k", 1, 1, (out, np.float16(1.5), ml_dtypes.bfloat16(-2.25)))
    np.testing.assert_array_equal(out, [1.5, -2.25])


def test_conversions_round_to_nearest_even():
    """fa::from_float / pack2 agree bit for bit with NumPy's float32 -> float16 / ml_dtypes bf16."""
    src = '''#include "fa_port.cuh"
    __global__ void conv(fa_half* h, fa_bf16* b, uint32_t* p, float* back, const float* x, int n) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const float v = fa::gload(x + i);
            fa::gstore(h + i, fa::from_float<fa_half>(v));
            fa::gstore(b + i, fa::from_float<fa_bf16>(v));
            fa::gstore(p + i, fa::pack2<fa_half>(v, -v));
            fa::gstore(back + i, fa::to_float(fa::from_float<fa_half>(v)));
        }
    }'''
    mod = emulator.Module(src, ["conv"])
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    special = np.array([0, 0x80000000, 0x7f800000, 0xff800000, 0x477ff000, 0x477fefff, 0x33000000, 0x33000001,
                        0x387fc000, 0x38800000, 0x477fe000, 0x7fc00000], np.uint32)
    x = np.concatenate([bits.view(np.float32), special.view(np.float32),
                        rng.standard_normal(5000).astype(np.float32) * 1e-5])
    n = len(x)
    h = np.zeros(n, np.float16)
    b = np.zeros(n, ml_dtypes.bfloat16)
    p = np.zeros(n, np.uint32)
    back = np.zeros(n, np.float32)
    mod.launch("conv", 1, 64, (h, b, p, back, x, np.int32(n)))
    with np.errstate(over="ignore", invalid="ignore"):
        eh, eb = x.astype(np.float16), x.astype(ml_dtypes.bfloat16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(h.view(np.uint16)[~nan], eh.view(np.uint16)[~nan])
    np.testing.assert_array_equal(b.view(np.uint16)[~nan], eb.view(np.uint16)[~nan])
    assert np.all(np.isnan(h[nan])) and np.all(np.isnan(b.astype(np.float32)[nan]))
    with np.errstate(over="ignore", invalid="ignore"):
        lo, hi = x.astype(np.float16).view(np.uint16), (-x).astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(p[~nan], (lo.astype(np.uint32) | (hi.astype(np.uint32) << 16))[~nan])
    np.testing.assert_array_equal(back[~nan], eh.astype(np.float32)[~nan])


def test_switch_cost_is_measured():
    ns = emulator.switch_cost_ns(100000)
    assert 0 < ns < 10000
