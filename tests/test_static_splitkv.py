"""Static checks of the split-KV kernels with NVRTC (no GPU needed).

The split variant of the tensor-core forward (``flash_fwd_kernel<..., Is_split = true>``), the
causal GQA-packed variants (``Is_packed = true``, whole and split) and the combine kernel (``flash_fwd_combine.cu``) compile for sm_75, sm_80, sm_86, sm_89 and sm_90 with
``-Xptxas=-v``: zero spills, no local stack, no static shared memory, registers × threads within
the register file — for the head dims the dense static test covers (64, 256, and D = 40 / Dv = 24),
fp16 and bf16 where the arch has their tensor-core instruction, causal or not, aligned or not.
sm_80 and sm_90 run by default; sm_75, sm_86 and sm_89 under ``-m slow`` (the CI time budget; conftest.static_archs).
(That the dense instantiations' SASS is untouched by the flag is what ``tests/test_sass.py``'s
limits and ``benchmarks/sass.py`` show.)
"""
import pytest

from flasharray._private import cuda_forward, launch, nvrtc, tiles
from conftest import requires_nvrtc, static_archs

pytestmark = requires_nvrtc

REGISTER_FILE = 64 * 1024


def combine_name(dtype):
    return cuda_forward.combine_name_expression(dtype)


def _check(arch, source, names, threads):
    res = nvrtc.compile_cubin(launch.kernel_source(source), "sm_%d" % arch, list(names),
                              options=["--use_fast_math"])
    rows, problems = [], []
    for name in names:
        k = res.kernel(name)
        rows.append("sm_%d %-80s regs %3d  spill %d/%d  stack %d" % (arch, name, k.registers, k.spill_stores,
                                                                     k.spill_loads, k.stack_frame))
        if k.spill_stores or k.spill_loads or k.stack_frame:
            problems.append("%s: spills %d/%d, stack %d" % (name, k.spill_stores, k.spill_loads, k.stack_frame))
        if k.static_smem:
            problems.append("%s: %d bytes of static shared memory" % (name, k.static_smem))
        if k.registers * threads[name] > REGISTER_FILE or k.registers > 255:
            problems.append("%s: %d registers x %d threads" % (name, k.registers, threads[name]))
    print("\n".join(rows))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("arch", static_archs(tiles.ARCHS))
def test_split_kernels_compile_without_spills(arch):
    threads = {}
    for dt in ("float16", "bfloat16"):
        if not tiles.tensor_cores_available(dt, arch):
            continue
        for d, dv in ((64, 64), (256, 256), (40, 24)):
            t = tiles.forward_tile(dt, d, dv, arch)
            for causal in (False, True):
                for aligned in (False, True):
                    threads[cuda_forward.forward_name_expression(t, causal, aligned, split=True)] = t.n_threads
                    if causal:  # GQA packing with the causal mask, whole and split
                        for split in (False, True):
                            name = cuda_forward.forward_name_expression(t, causal, aligned, split, packed=True)
                            threads[name] = t.n_threads
    _check(arch, "flash_fwd.cu", sorted(threads), threads)
    combine = {combine_name(dt): 32 * cuda_forward.COMBINE_ROWS for dt in ("float16", "bfloat16")}
    _check(arch, cuda_forward.COMBINE_SOURCE, sorted(combine), combine)
