"""Static checks of the Hopper wgmma backward (cuda_src/flash_bwd_sm90.cu) with NVRTC (no GPU needed).

Every dK/dV instantiation ``cuda_backward.kernel_plan(..., kernel="wgmma")`` names — padded head dims
64 and 128, causal and not, ordered (deterministic) and plain atomic dQ; float16 by default, bfloat16
and the element-wise loads (``vec`` false) under ``-m slow`` — compiles for sm_90a with zero spills,
no local stack, no static shared memory, registers x threads within the register file and dynamic
shared memory within the opt-in maximum. In the SASS the query-block loop (the loop holding the
most HGMMA) holds every HGMMA of the kernel, exactly one visit's: per warpgroup d/16 (S^T) + dv/16
(dP^T) SS, Br/16 + Br/16 RS (dV, dK), and Bc/16 SS for dQ^T. ``-s`` prints registers and the loop's
instructions (docs/hopper.md, "Backward", quotes them).
"""
import re

import numpy as np
import pytest

from flasharray._private import cuda_backward as cb
from flasharray._private import cuda_backward_sm90 as S
from flasharray._private import launch, nvrtc, sass, tiles
from flasharray._private.dtypes import bfloat16
from conftest import requires_nvrtc

pytestmark = requires_nvrtc
SASS_OK, SASS_WHY = sass.available()
REGISTER_FILE = 64 * 1024


def instantiations(dtype, dims, vecs=(True,)):
    found = {}
    for d in dims:
        for causal in (False, True):
            for ordered in (False, True):
                for vec in vecs:
                    ks = cb.kernel_plan(dtype, d, d, causal=causal, deterministic=False, arch=90, kernel="wgmma",
                                        ordered=ordered, vec=vec)
                    found[ks["dkv"][1]] = (ks["dkv"][2], d)
    return found


def hgmma_in(body, loop):
    return [i for i in body if i.base == "HGMMA" and (loop is None or loop.start <= i.address <= loop.end)]


def _check(found):
    res = nvrtc.compile_cubin(launch.kernel_source(S.SOURCE), "sm_90a", list(found), options=["--use_fast_math"])
    fns = sass.parse(sass.disassemble(res.cubin)) if SASS_OK else None
    problems = [line for line in res.log.splitlines() if "serializ" in line.lower()]
    rows = []
    for name, (t, d) in found.items():
        k = res.kernel(name)
        line = "%-90s regs %3d spill %d/%d smem %6d" % (name, k.registers, k.spill_stores, k.spill_loads, t.smem)
        if k.spill_stores or k.spill_loads or k.stack_frame or k.static_smem:
            problems.append("%s: spills %d/%d stack %d static smem %d" % (name, k.spill_stores, k.spill_loads,
                                                                         k.stack_frame, k.static_smem))
        if k.registers * t.n_threads > REGISTER_FILE or t.smem > tiles.smem_limit(90):
            problems.append("%s: %d regs x %d threads, %d bytes smem" % (name, k.registers, t.n_threads, t.smem))
        if fns is not None:
            body = fns[k.lowered_name]
            lps = [lp for lp in sass.loops(body) if hgmma_in(body, lp)]
            loop = min(lps, key=lambda lp: (-len(hgmma_in(body, lp)), lp.stats.instructions)) if lps else None
            pd = S.pad_head_dim(d)
            per_wg = pd // 16 + pd // 16 + 2 * (t.block_m // 16) + t.block_n // 16  # the code of one thread
            in_loop = hgmma_in(body, loop)
            if loop is None or len(in_loop) != per_wg or len(hgmma_in(body, None)) != per_wg:
                problems.append("%s: %d HGMMA in the loop, %d in all, expected %d" % (
                    name, len(in_loop), len(hgmma_in(body, None)), per_wg))
            else:
                rs = [i for i in in_loop if i.operands.split(",")[1].strip().startswith("R")]
                if len(rs) != 2 * (t.block_m // 16):
                    problems.append("%s: %d RS HGMMA, expected %d" % (name, len(rs), 2 * (t.block_m // 16)))
                # m16n8k16-equivalents per warp and visit: an HGMMA 64xNx16 is N/8 of them per warp
                eq = sum(int(re.search(r"64x(\d+)x16", i.opcode + i.operands).group(1)) // 8 for i in in_loop)
                line += "  loop %d instr, %d HGMMA (%d SS + %d RS), %d m16n8k16-eq (%.2f instr each), %d BAR, " \
                        "%d LDGSTS, %d MUFU, %d RED" % (
                            loop.stats.instructions, len(in_loop), len(in_loop) - len(rs), len(rs), eq,
                            loop.stats.instructions / eq, loop.stats.bar, loop.stats.ldgsts, loop.stats.mufu,
                            sum(1 for i in body if i.base.startswith("RED") and loop.start <= i.address <= loop.end))
        rows.append(line)
    print("\n".join(rows))
    assert not problems, "\n".join(problems)


def test_wgmma_backward_compiles_fp16():
    _check(instantiations(np.float16, (64, 128)))


@pytest.mark.slow
def test_wgmma_backward_compiles_bf16_and_elementwise():
    found = instantiations(bfloat16, (64, 128), (True, False))
    found.update(instantiations(np.float16, (64, 128), (False,)))
    _check(found)
