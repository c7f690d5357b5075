"""Static checks of the float64 DMMA forward (cuda_src/flash_fwd_f64.cu) with NVRTC (no GPU needed).

Every instantiation the library uses compiles for sm_80, sm_86, sm_89 and sm_90 with zero spills,
no local stack, no static shared memory, registers x threads within the register file and dynamic
shared memory within the arch's opt-in maximum; the key-tile loop (the loop holding the most DMMA)
holds exactly the DMMA of one key tile and warp — DMMA.884 on sm_80-89, DMMA.16x8x16 on sm_90 (the tile's
m16n8k16; DMMA.8x8x4 with ``DMMA_K16`` off) — and
the instructions per DMMA are printed (docs/precision.md records them), and with the cp.async copies
(aligned) the key loop holds no inner loop; sm_75 is refused at compile
time (fa::mma_m8n8k4_f64 needs sm_80+) and by the tile table (the SIMT kernel runs there).

Default: d = dv in {16, 64, 128} and 40 (padded 48), causal x aligned; ``-m slow``: every padded
head dim 16..128, and sm_90's m8n8k4 kernels (DMMA_K16 off: sm_80's code, checked on sm_80 by default).
"""
import numpy as np
import pytest

from flasharray._private import cuda_forward_f64 as F
from flasharray._private import launch, nvrtc, sass, tiles
from conftest import requires_nvrtc, static_archs

pytestmark = requires_nvrtc
SASS_OK, SASS_WHY = sass.available()
ARCHS = (80, 86, 89, 90)
REGISTER_FILE = 64 * 1024
DMMA = {80: "DMMA.884", 86: "DMMA.884", 89: "DMMA.884", 90: "DMMA.8x8x4"}   # m8n8k4


def expected_op(arch, t, aligned):
    return "DMMA.16x8x16" if t.kernel_dmma_k(aligned) == 16 else DMMA[arch]


def instantiations(arch, head_dims):
    found = {}
    for d in head_dims:
        t = F.forward_tile(None, np.float64, d, d, arch)
        for causal in (False, True):
            for aligned in (False, True):
                found[t.name_expression(causal, aligned)] = (t, aligned)
    return found


def expected_dmma(t, aligned):
    """DMMA per key tile and warp: S (2 m8 tiles x Bc/8 n8 tiles x d/4 k-steps) + O (2 x dv/8 x Bc/4) in
    m8n8k4; an m16n8k16 does eight of them."""
    k16 = t.kernel_dmma_k(aligned) == 16
    return 2 * (t.block_n // 8 * t.head_dim // 4 + t.head_dim_v // 8 * t.block_n // 4) // (8 if k16 else 1)


def opcode(i):
    """The full opcode: sass.parse stops at lower-case letters (sm_90's DMMA.8x8x4 parses as DMMA.8
    with x8x4 in the operands)."""
    rest = i.operands.split()[0] if i.operands[:1] == "x" else ""
    return i.opcode + rest


def dmma_key_loop(body):
    """(loop, its DMMA instructions): the loop with the most DMMA, then the fewest instructions."""
    def dmma(lp):
        return [i for i in body if i.base == "DMMA" and lp.start <= i.address <= lp.end]
    loop = min(sass.loops(body), key=lambda lp: (-len(dmma(lp)), lp.stats.instructions))
    return loop, dmma(loop)


def _check(arch, head_dims):
    found = instantiations(arch, head_dims)
    res = nvrtc.compile_cubin(launch.kernel_source(F.SOURCE), "sm_%d" % arch, list(found),
                              options=["--use_fast_math"])
    fns = sass.parse(sass.disassemble(res.cubin)) if SASS_OK else None
    problems, rows = [], []
    for name, (t, aligned) in found.items():
        k = res.kernel(name)
        line = "sm_%d %-58s regs %3d spill %d/%d smem %6d" % (arch, name, k.registers, k.spill_stores,
                                                               k.spill_loads, t.smem)
        if k.spill_stores or k.spill_loads or k.stack_frame or k.static_smem:
            problems.append("%s: spills %d/%d stack %d static smem %d" % (name, k.spill_stores, k.spill_loads,
                                                                         k.stack_frame, k.static_smem))
        if k.registers * t.n_threads > REGISTER_FILE or t.smem > tiles.smem_limit(arch):
            problems.append("%s: %d regs, %d bytes smem" % (name, k.registers, t.smem))
        if fns is not None:
            body = fns[k.lowered_name]
            loop, dmma = dmma_key_loop(body)
            line += "  key loop %d instr, %d DMMA (%.2f/DMMA), %d LDS (%d LDS.128), %d BAR" % (
                loop.stats.instructions, len(dmma), loop.stats.instructions / len(dmma), loop.stats.lds,
                loop.stats.lds128, loop.stats.bar)
            ops = {opcode(i) for i in dmma}
            total = sum(1 for i in body if i.base == "DMMA")
            # the element-wise copies (aligned = false) are loops inside the key loop; cp.async ones are not
            nested = loop.nested if aligned else 0
            want = expected_op(arch, t, aligned)
            if ops != {want} or len(dmma) != expected_dmma(t, aligned) or total != len(dmma) or nested:
                problems.append("%s: key loop DMMA %s x %d (expected %s x %d), %d in the kernel, %d nested loops"
                                % (name, sorted(ops), len(dmma), want, expected_dmma(t, aligned), total, loop.nested))
        rows.append(line)
    print("\n".join(rows))
    assert not problems, "\n".join(problems)


#: The default run's archs: sm_89 compiles as sm_86 and sm_86's fp64 (a GPU with 1/64-rate fp64) is left to
#: ``-m slow`` by the CI time budget; sm_80 and sm_90 are where float64 runs on DMMA in practice.
DEFAULT_ARCHS = static_archs(ARCHS)


@pytest.mark.parametrize("arch", DEFAULT_ARCHS)
def test_f64_forward_compiles(arch):
    _check(arch, (16, 40, 64, 128))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_f64_forward_compiles_all_head_dims(arch):
    _check(arch, (16, 32, 48, 64, 80, 96, 112, 128))


@pytest.mark.slow   # sm_80's m8n8k4 code (its own check runs by default); the CI time budget
def test_f64_forward_sm90_m8n8k4_still_compiles():
    """DMMA_K16 = False (the switch benchmarks/gpu_session.sh times) gives the m8n8k4 kernel on sm_90."""
    from conftest import flag_set
    with flag_set(F, "DMMA_K16", False):
        assert F.forward_tile(None, np.float64, 64, 64, 90).dmma_k == 4
        _check(90, (16, 64, 128))


def test_sm75_refused():
    t = F.forward_tile(None, np.float64, 64, 64, 80)
    with pytest.raises(Exception, match="needs sm_80"):
        nvrtc.compile_cubin(launch.kernel_source(F.SOURCE), "sm_75", [t.name_expression(False, True)])
    assert F.forward_tile(None, np.float64, 64, 64, 75) is None
