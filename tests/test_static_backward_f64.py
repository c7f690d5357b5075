"""Static checks of the float64 DMMA backward (cuda_src/flash_bwd_f64.cu) with NVRTC (no GPU needed).

Every instantiation the tile table can choose (causal x kVecLoad x kOrderedDQ) compiles for sm_80,
sm_86, sm_89 and sm_90 with zero spills, no local stack, no static shared memory, registers x
threads within the register file and dynamic shared memory within the arch's opt-in maximum;
two buffers of Q_i, dO_i (kStages = 2) only where they cost no resident warps at the measured
registers (``sass.occupancy`` against the one-buffer shared memory); the
query-block loop (the loop holding the most DMMA) holds the DMMA of one visit and warp — DMMA.884
on sm_80-89, DMMA.8x8x4 on sm_90 (DMMA.16x8x16 for the m16n8k16 tiles: an eighth as many, the ratio per
m8n8k4-equivalent), none outside it — and its instructions per DMMA stay within the
measured limits below (printed; the report's SASS table). The conversion of the double
accumulator compiles (vector and element stores). sm_75 is refused at compile time and by the
tile table.

Default: d = dv in {16, 40 (padded 48), 64, 128} and (128, 16); ``-m slow``: every padded head dim
pair class (d = dv 16..128, and mixed pairs), and sm_90's m8n8k4 kernels (DMMA_K16 off: sm_80's code, checked on
sm_80 by default).
"""
import numpy as np
import pytest

from flasharray._private import cuda_backward_f64 as F
from flasharray._private import launch, nvrtc, sass, tiles
from conftest import requires_nvrtc, static_archs

pytestmark = requires_nvrtc
SASS_OK, SASS_WHY = sass.available()
ARCHS = (80, 86, 89, 90)
#: The default run's archs: sm_89 compiles as sm_86 (same ISA, shared memory and tiles), and sm_86's fp64 (a GPU with
#: 1/64-rate fp64; 32 of its 40 instantiations are its own tiles) is left to ``-m slow`` by the CI time budget.
DEFAULT_ARCHS = static_archs(ARCHS)
REGISTER_FILE = 64 * 1024
DMMA = {80: "DMMA.884", 86: "DMMA.884", 89: "DMMA.884", 90: "DMMA.8x8x4"}

# Instructions per DMMA of the query-block loop, the largest over sm_80-90, causal and kOrderedDQ,
# as measured (NVRTC 12, --use_fast_math), +5%: (d, dv) -> (cp.async copies, element copies).
# The element copies' loops sit inside the visit loop (counted once). With the double-buffered
# Q_i / dO_i / L_i / D_i (kStages = 2: the next visit's addresses, the buffer index, L_i·log2e
# converted in shared memory) 2-5% above the one-buffer kernel's (16, 16: 9.15 -> 9.34). Twenty-first session:
# the table exp (flash_f64_exp.cuh) -1 to -4 % everywhere, and (64, 64) 5.54 / 7.07 -> 5.10 / 5.85 by Br = 32;
# then dQ in units of fewer n8 tiles where whole tiles left warps idle (dq_unit_n8: d 16, 32, 48, 80, 96). That
# takes DMMA off the busiest warp (d 16: 192 -> 160 per visit) and the loop body holds fewer of them, so the
# ratio rose there (16, 16: 9.19 -> 10.57), while the busiest warp's DMMA per visit fell 6-17 % and its
# instructions moved -7 to +7 % (sm_80 d 16: 1533 -> 1477 for 192 -> 160 DMMA; sm_90 d 96: 1172 -> 1256 for
# 256 -> 240; docs/performance.md).
MEASURED = {
    (16, 16): (10.57, 12.64), (32, 32): (6.45, 7.34), (48, 48): (6.36, 7.73), (64, 64): (5.10, 5.85),
    (80, 80): (6.02, 7.75), (96, 96): (5.39, 6.71), (112, 112): (4.99, 6.15), (128, 128): (4.58, 5.33),
    (128, 16): (5.25, 6.68), (16, 128): (6.34, 8.29), (64, 128): (5.12, 6.40), (128, 64): (4.77, 5.82),
    (32, 64): (5.92, 7.25), (64, 32): (5.48, 6.55), (48, 80): (6.07, 7.82), (80, 48): (6.76, 8.63),
}
LIMIT = {k: tuple(round(x * 1.05, 2) for x in v) for k, v in MEASURED.items()}


def opcode(i):
    """The full opcode (sass.parse stops at lower-case letters: sm_90's DMMA.8x8x4 parses as DMMA.8)."""
    rest = i.operands.split()[0] if i.operands[:1] == "x" else ""
    return i.opcode + rest


def dmma_key_loop(body):
    """(loop, its DMMA instructions): the loop with the most DMMA, then the fewest instructions."""
    def dmma(lp):
        return [i for i in body if i.base == "DMMA" and lp.start <= i.address <= lp.end]
    loop = min(sass.loops(body), key=lambda lp: (-len(dmma(lp)), lp.stats.instructions))
    return loop, dmma(loop)


def expected_dmma(t, d, dv):
    """DMMA instructions of one visit and warp: S^T, dP^T (kMT m8 x Br/8 n8 tiles x (d + dv)/4 k4
    steps), dV, dK (kMT x (d + dv)/8 x Br/4), and one dQ work unit's code (2 m8 x dq_unit_n8 n8 tiles x
    Bc/4; a warp's several units run it in a loop). m16n8k16 (``t.dmma_k`` 16): an eighth of them (each one
    two m8 tiles and four k4 steps; the warp pair's split of keys and columns gives each warp the same work)."""
    mt = t.block_n * 4 // t.n_threads  # kMT = Bc / (8 warps)
    unit = F.dq_unit_n8(t.block_m, d, t.n_threads // 32)
    n = mt * (t.block_m // 8) * (d + dv) // 4 + mt * (d + dv) // 8 * t.block_m // 4 + 2 * unit * t.block_n // 4
    return n // 8 if t.dmma_k == 16 else n


def dmma_opcode(arch, t):
    return "DMMA.16x8x16" if t.dmma_k == 16 else DMMA[arch]


def instantiations(arch, pairs):
    found = {}
    for d, dv in pairs:
        t = F.backward_tile(None, np.float64, d, dv, arch)
        for causal in (False, True):
            for vec in (True, False):
                for ordered in (False, True):
                    found[F.dkv_name(t, None, d, dv, causal, vec, ordered)] = (t, d, dv, vec)
    return found


def _check(arch, pairs):
    found = instantiations(arch, pairs)
    res = nvrtc.compile_cubin(launch.kernel_source(F.SOURCE), "sm_%d" % arch, list(found),
                              options=["--use_fast_math"])
    fns = sass.parse(sass.disassemble(res.cubin)) if SASS_OK else None
    problems, rows = [], []
    for name, (t, d, dv, vec) in found.items():
        k = res.kernel(name)
        line = "sm_%d %-66s regs %3d spill %d/%d smem %6d" % (arch, name, k.registers, k.spill_stores,
                                                               k.spill_loads, t.smem)
        if k.spill_stores or k.spill_loads or k.stack_frame or k.static_smem:
            problems.append("%s: spills %d/%d stack %d static smem %d" % (name, k.spill_stores, k.spill_loads,
                                                                         k.stack_frame, k.static_smem))
        if k.registers * t.n_threads > REGISTER_FILE or t.smem > tiles.smem_limit(arch):
            problems.append("%s: %d regs, %d bytes smem" % (name, k.registers, t.smem))
        # Two buffers of Q_i, dO_i only where they cost no resident warps (at the measured registers).
        occ = sass.occupancy(arch, k.registers, t.n_threads, t.smem)
        one = sass.occupancy(arch, k.registers, t.n_threads, F.smem_bytes(d, dv, t.block_m, t.block_n,
                                                                          t.n_threads // 32, 1, t.dmma_k))
        line += " occ %d blocks %d warps (%s)" % (occ.blocks, occ.warps, occ.limiter)
        if occ.warps < one.warps:
            problems.append("%s: %d stages cost occupancy: %d < %d warps" % (name, t.stages, occ.warps, one.warps))
        if fns is not None:
            body = fns[k.lowered_name]
            loop, dmma = dmma_key_loop(body)
            per = loop.stats.instructions / (len(dmma) * (8 if t.dmma_k == 16 else 1))  # per m8n8k4-equivalent
            line += "  loop %d instr, %d DMMA (%.2f/DMMA%s), %d LDS (%d LDS.128), %d BAR" % (
                loop.stats.instructions, len(dmma), per, ".8x8x4" if t.dmma_k == 16 else "", loop.stats.lds,
                loop.stats.lds128, loop.stats.bar)
            ops = {opcode(i) for i in dmma}
            total = sum(1 for i in body if i.base == "DMMA")
            if ops != {dmma_opcode(arch, t)} or len(dmma) != expected_dmma(t, d, dv) or total != len(dmma):
                problems.append("%s: loop DMMA %s x %d (expected %s x %d), %d in the kernel"
                                % (name, sorted(ops), len(dmma), dmma_opcode(arch, t), expected_dmma(t, d, dv), total))
            limit = LIMIT[(d, dv)][0 if vec else 1]
            if per > limit:
                problems.append("%s: %.2f instructions per DMMA > %.2f" % (name, per, limit))
        rows.append(line)
    print("\n".join(rows))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("arch", DEFAULT_ARCHS)
def test_f64_backward_compiles(arch):
    _check(arch, ((16, 16), (48, 48), (64, 64), (128, 128), (128, 16)))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_f64_backward_compiles_all_head_dims(arch):
    _check(arch, [k for k in MEASURED if k not in ((16, 16), (48, 48), (64, 64), (128, 128), (128, 16))])


@pytest.mark.slow   # sm_80's m8n8k4 code (its own check runs by default); the CI time budget
def test_f64_backward_sm90_m8n8k4_still_compiles(monkeypatch):
    """DMMA_K16 off (benchmarks/gpu_session.sh step 7h times it): sm_90's m8n8k4 tiles at the m16n8k16 head dims
    compile as before, zero spills, DMMA.8x8x4 only."""
    monkeypatch.setattr(F, "DMMA_K16", False)
    _check(90, ((64, 64), (128, 128)))


@pytest.mark.parametrize("arch", ARCHS)
def test_convert_double_compiles(arch):
    """flash_bwd_convert_dq_tc_kernel<double, ..., double> (the host's name for every tile's Br and
    both store paths) next to the float instantiations it generalizes: no spills, no local memory."""
    names = []
    for d, D in ((16, 16), (48, 40), (64, 59), (128, 128)):
        names.append(F.convert_name(F.backward_tile(None, np.float64, d, d, arch), d, D))
    names += ["flash_bwd_convert_dq_tc_kernel<__half, 128, 64, 64, true>",
              "flash_bwd_convert_dq_tc_kernel<float, 128, 64, 128, false>"]
    res = nvrtc.compile_cubin(launch.kernel_source("flash_bwd_convert.cu"), "sm_%d" % arch, names,
                              options=["--use_fast_math"])
    for n in names:
        k = res.kernel(n)
        assert not (k.spill_stores or k.spill_loads or k.stack_frame), n


def test_sm75_refused():
    t = F.backward_tile(None, np.float64, 64, 64, 80)
    with pytest.raises(Exception, match="needs sm_80"):
        nvrtc.compile_cubin(launch.kernel_source(F.SOURCE), "sm_75", [F.dkv_name(t, None, 64, 64, False, True, True)])
    assert F.backward_tile(None, np.float64, 64, 64, 75) is None


@pytest.mark.skipif(not SASS_OK, reason=str(SASS_WHY))
def test_busiest_warp_per_visit():
    """benchmarks/precision.py --f64-bwd-sass: the dQ work units take the idle warps' share off the busiest one.
    Per visit on sm_90 every warp runs S^T, dP^T, dV, dK: 128 DMMA at d 16 (Br 32, Bc 64, kMT 2), 256 at d 64
    (Br 32, Bc 32, kMT 1); then its dQ units, 2 m8 x unit n8 x Bc/4 DMMA each: d 16 one unit of one n8 tile
    (32; whole 16 x 16 tiles gave two warps 64 and two none: 192 on the busiest), d 64 one whole 16 x 32 tile
    (64)."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "precision.py"
    spec = importlib.util.spec_from_file_location("precision_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = [r.split("|")[1:-1] for r in bench.f64_bwd_sass_table(archs=(90,), head_dims=(16, 64)).splitlines()[2:]]
    got = {int(r[1]): (r[5].strip(), int(r[6].split(",")[1])) for r in rows}
    assert got == {16: ("1, 1", 160), 64: ("4, 1", 320)}, got
