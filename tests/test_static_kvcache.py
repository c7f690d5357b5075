"""Static checks of the KV-cache variants of the tensor-core forward with NVRTC (no GPU needed).

``flash_fwd_kernel<..., Has_seqlens_k = true>`` (per-entry key counts) and ``<..., true, true>``
(paged K/V through a block table), whole and split-KV, causal or not, causal GQA-packed, compile for
sm_75, sm_80, sm_86, sm_89 and sm_90 with zero spills, no local stack, no static shared memory and
registers × threads within the register file — fp16 and bf16 where the arch has their tensor-core
instruction, for the head dims the dense static test covers (64, 256, and D = 40 / Dv = 24; the last
also with unaligned rows, the element-wise copy). That the dense instantiations' SASS is untouched
is what ``tests/test_sass.py`` and ``benchmarks/sass.py`` show (docs/performance.md).
"""
import pytest

from flasharray._private import cuda_forward, launch, nvrtc, sass, tiles
from conftest import requires_nvrtc, static_archs
from test_static_splitkv import _check

pytestmark = requires_nvrtc


def kvcache_names(arch):
    threads = {}
    for dt in ("float16", "bfloat16"):
        if not tiles.tensor_cores_available(dt, arch):
            continue
        for d, dv in ((64, 64), (256, 256), (40, 24)):
            for aligned in ((True, False) if d == 40 else (True,)):
                for paged in (False, True):
                    t = tiles.forward_tile(dt, d, dv, arch, two_blocks=not paged)  # as the plan picks it
                    for split in (False, True):
                        for causal, packed in ((False, False), (True, False), (True, True)):
                            name = cuda_forward.forward_name_expression(t, causal, aligned, split, packed,
                                                                        seqlens_k=True, paged=paged)
                            threads[name] = t.n_threads
    return threads


# sm_80 (Ampere's tile table) runs by default; the other archs with -m slow (each arch compiles ~70 instantiations:
# about a minute on 2 cores; sm_75, the smallest register/shared budget, left the default run for the CI time budget).
ARCH_PARAMS = static_archs(tiles.ARCHS, default=(80,))


@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_kvcache_kernels_compile_without_spills(arch):
    threads = kvcache_names(arch)
    _check(arch, "flash_fwd.cu", sorted(threads), threads)


@pytest.mark.skipif(not sass.available()[0], reason="no disassembler (sass.available)")
def test_paged_key_loop_keeps_the_planned_copy():
    """The paged tensor-core forward's key-tile loop (fp16, sm_80, whole, not causal, d 64/128/256):
    no nested copy loop (the per-chunk load_tile_paged copy had two), the dense plan's cp.async
    count, one block-table load per key tile (K_j and V_j share the page lookup: paged caches keep the
    double-buffered ring, tiles.forward_tile(two_blocks=False)) and instructions per HMMA within issue 9's
    dense targets (docs/performance.md: 6.02 / 5.02 / 4.63, was 14.2 / 12.9 / 12.6)."""
    found = {}
    for d in (64, 128, 256):
        t = tiles.forward_tile("float16", d, d, 80, two_blocks=False)   # the plan's tile for a paged cache
        assert t.stages == 2
        found[cuda_forward.forward_name_expression(t, False, True, seqlens_k=True, paged=True)] = t
    res = nvrtc.compile_cubin(launch.kernel_source("flash_fwd.cu"), "sm_80", list(found), options=["--use_fast_math"])
    functions = sass.parse(sass.disassemble(res.cubin))
    for name, t in found.items():
        loop = sass.key_loop(functions[res.kernel(name).lowered_name])
        chunks = 2 * t.block_n * t.head_dim * 2 // 16           # 16-byte chunks of K_j and V_j
        assert (loop.nested, loop.stats.ldg) == (0, 1), name
        assert loop.stats.ldgsts == chunks // t.n_threads, name
        assert loop.per_hmma <= sass.target("fwd", t.head_dim), (name, loop.per_hmma)


def simt_kvcache_names(arch):
    """The SIMT forward's KV-cache instantiations: float32 / float64 (and bfloat16 where it has no
    tensor cores), contiguous and paged, causal or not, aligned rows and element copies."""
    threads = {}
    dtypes = ("float32", "float64") + (() if tiles.tensor_cores_available("bfloat16", arch) else ("bfloat16",))
    for dt in dtypes:
        for d, dv in ((64, 64), (128, 128), (40, 24)):
            t = tiles.forward_tile(dt, d, dv, arch)
            assert t.kernel == "simt"
            for aligned in ((True, False) if d == 40 else (True,)):
                for paged in (False, True):
                    for causal in (False, True):
                        name = cuda_forward.forward_name_expression(t, causal, aligned, seqlens_k=True, paged=paged)
                        threads[name] = t.n_threads
    return threads


@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_simt_kvcache_kernels_compile_without_spills(arch):
    threads = simt_kvcache_names(arch)
    assert any(", 0, true, true>" in n for n in threads)
    _check(arch, "flash_fwd_simt.cu", sorted(threads), threads)


@pytest.mark.skipif(not sass.available()[0], reason="no disassembler (sass.available)")
def test_simt_paged_key_loop_keeps_the_planned_copy():
    """The paged SIMT forward's key-tile loop (sm_80, not causal, aligned rows; fp32 / fp64, d 64 /
    128) copies K_j / V_j with PagedTileCopy: no copy loop left (the two nested loops are the rolled
    S_ij and P_ij V_j loops; load_tile_paged added two more), one block-table load per key tile (K_j's
    lookup kept for V_j; load_tile_paged had 14 static LDG), and the planned cp.async count, K_j's and
    V_j's 16-byte chunks over the threads (docs/performance.md, "Paged K/V copy")."""
    found = {}
    for dt in ("float32", "float64"):
        for d in (64, 128):
            t = tiles.forward_tile(dt, d, d, 80)
            found[cuda_forward.forward_name_expression(t, False, True, seqlens_k=True, paged=True)] = t
    res = nvrtc.compile_cubin(launch.kernel_source("flash_fwd_simt.cu"), "sm_80", list(found),
                              options=["--use_fast_math"])
    functions = sass.parse(sass.disassemble(res.cubin))
    for name, t in found.items():
        assert res.kernel(name).spill_stores + res.kernel(name).spill_loads == 0, name
        loop = sass.key_loop(functions[res.kernel(name).lowered_name], "fma")
        chunks = 2 * t.block_n * t.head_dim * tiles.itemsize(t.dtype) // 16   # 16-byte chunks of K_j and V_j
        assert (loop.nested, loop.stats.ldg) == (2, 1), name
        assert loop.stats.ldgsts == chunks // t.n_threads, name


@pytest.mark.parametrize("arch", [75, 80, 90])
def test_append_kernel_compiles_without_spills(arch):
    """flash_kv_append_kernel (kvcache.py's one-launch append of k_new, v_new and the key counts), every
    element type: zero spills, no local stack, no static shared memory."""
    from flasharray._private import kvcache
    names = ["flash_kv_append_kernel<%s>" % t for t in kvcache._APPEND_CTYPES.values()]
    res = nvrtc.compile_cubin(launch.kernel_source(kvcache.APPEND_SOURCE), "sm_%d" % arch, names,
                              options=["--use_fast_math"])
    for name in names:
        k = res.kernel(name)
        assert (k.spill_stores, k.spill_loads, k.stack_frame, k.static_smem) == (0, 0, 0, 0), name
        assert k.registers * kvcache.APPEND_THREADS <= 64 * 1024
