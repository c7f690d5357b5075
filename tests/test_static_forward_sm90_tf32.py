"""Static checks of the float32 wgmma forward (cuda_src/flash_fwd_sm90_tf32.cu) with NVRTC (no GPU needed).

Every instantiation the host picks (cuda_forward_tf32.wgmma_tile: tf32 and 3xtf32 at d 64 / 128; causal and
not) compiles for sm_90a with the library's options with zero spills, no local stack, no static shared memory,
registers x 256 threads within the register file and its dynamic shared memory (the host's mirror,
``wgmma_smem_bytes``) within the opt-in maximum. In the SASS the key-tile loop (the loop holding the most HGMMA)
holds every HGMMA of the kernel, exactly one key tile's: kPrec x (d/8 for S + Bc/8 for P V, twice at 3xtf32 d 128:
two column blocks of 64), every one
``HGMMA.64xNx8.F32.TF32``; d/8 read A through a descriptor (SS: 3xtf32's Q lo products, tf32's Q), the rest
from registers. tf32 at d 64 runs two blocks per SM (its launch bounds: 128 registers). The loop's instructions per HGMMA stay within :data:`MAX_PER_HGMMA` (a regression
bound, docs/precision.md, "The wgmma forward"; printed with ``-s``).
"""
import pytest

from flasharray._private import cuda_forward_tf32 as T
from flasharray._private import launch, nvrtc, sass, tiles
from conftest import requires_nvrtc

pytestmark = requires_nvrtc
SASS_OK, SASS_WHY = sass.available()
REGISTER_FILE = 64 * 1024
#: Key-loop instructions per HGMMA: (precision, d) -> bound (measured + ~5 %; docs/precision.md).
MAX_PER_HGMMA = {("3xtf32", 64): 20.3, ("3xtf32", 128): 12.5, ("tf32", 64): 41.1, ("tf32", 128): 37.9}


def pv_n(t):
    """The N of the P V wgmmas: 3xtf32 at d 128 sums P V_j in two column blocks of 64 (Tr::kPvN)."""
    return 64 if (t.precision, t.head_dim_v) == ("3xtf32", 128) else t.head_dim_v


def instantiations():
    found = {}
    for precision, dims in T.WGMMA_HEAD_DIMS.items():
        for d in dims:
            t = T.wgmma_tile(precision, d, d, 90, 0, None)
            assert t is not None and t.head_dim == d and t.smem == T.wgmma_smem_bytes(d, t.block_n, precision)
            for causal in (False, True):
                found[t.name_expression(causal, True)] = t
    return found


def hgmma_in(body, loop):
    return [i for i in body if i.base == "HGMMA" and (loop is None or loop.start <= i.address <= loop.end)]


def is_rs(ins):
    return ins.operands.split(",")[1].strip().startswith("R")


def loop_checks(name, t, body):
    """(problems, text): the key loop holds one key tile's HGMMA, all of them, tf32, SS / RS as designed."""
    lps = [lp for lp in sass.loops(body) if hgmma_in(body, lp)]
    loop = min(lps, key=lambda lp: (-len(hgmma_in(body, lp)), lp.stats.instructions)) if lps else None
    prec = T.PREC[t.precision]
    expected = prec * (t.head_dim // 8 + t.head_dim_v // pv_n(t) * t.block_n // 8)
    in_loop = hgmma_in(body, loop)
    if loop is None or len(in_loop) != expected or len(hgmma_in(body, None)) != expected:
        return ["%s: %d HGMMA in the key loop, %d in all, expected %d" % (name, len(in_loop),
                                                                         len(hgmma_in(body, None)), expected)], ""
    problems = []
    # sass.parse's opcode stops at the shape's lower-case x: "HGMMA.64", operands "x64x8.F32.TF32 R48, ..."
    shapes = {i.opcode + i.operands.split()[0] for i in in_loop}
    if shapes != {"HGMMA.64x%dx8.F32.TF32" % n for n in {t.block_n, pv_n(t)}}:
        problems.append("%s: HGMMA shapes %s" % (name, sorted(shapes)))
    ss = [i for i in in_loop if not is_rs(i)]
    want_ss = t.head_dim // 8   # 3xtf32: Q lo; tf32: Q
    if len(ss) != want_ss:
        problems.append("%s: %d SS HGMMA, expected %d" % (name, len(ss), want_ss))
    per = loop.stats.instructions / len(in_loop)
    bound = MAX_PER_HGMMA[(t.precision, t.head_dim)]
    if per > bound:
        problems.append("%s: %.2f instructions per HGMMA in the key loop, bound %g" % (name, per, bound))
    text = "  key loop %d instr, %d HGMMA (%d SS), %.2f / HGMMA, %d LDS, %d STS, %d BAR" % (
        loop.stats.instructions, len(in_loop), len(ss), per, loop.stats.lds, loop.stats.sts, loop.stats.bar)
    return problems, text


def test_wgmma_tf32_forward_compiles():
    found = instantiations()
    res = nvrtc.compile_cubin(launch.kernel_source(T.WGMMA_SOURCE), "sm_90a", list(found),
                              options=list(launch.CUDA_OPTIONS))
    fns = sass.parse(sass.disassemble(res.cubin)) if SASS_OK else None
    problems = [line for line in res.log.splitlines() if "serializ" in line.lower()]
    rows = []
    for name, t in found.items():
        k = res.kernel(name)
        occ = sass.occupancy(90, k.registers, t.n_threads, t.smem)
        line = "%-56s regs %3d spill %d/%d smem %6d  %d block(s)/SM (%s)" % (
            name, k.registers, k.spill_stores, k.spill_loads, t.smem, occ.blocks, occ.limiter)
        if k.spill_stores or k.spill_loads or k.stack_frame or k.static_smem:
            problems.append("%s: spills %d/%d stack %d static smem %d" % (name, k.spill_stores, k.spill_loads,
                                                                         k.stack_frame, k.static_smem))
        want_blocks = 2 if (t.precision, t.head_dim) == ("tf32", 64) else 1
        if k.registers * t.n_threads > REGISTER_FILE or t.smem > tiles.smem_limit(90) or occ.blocks != want_blocks:
            problems.append("%s: %d regs x %d threads, %d bytes smem" % (name, k.registers, t.n_threads, t.smem))
        if fns is not None:
            more, text = loop_checks(name, t, fns[k.lowered_name])
            problems += more
            line += text
        rows.append(line)
    print("\n".join(rows))
    assert not problems, "\n".join(problems)
    if fns is None:
        pytest.skip(SASS_WHY)


def test_sm90_without_a_refused():
    t = T.wgmma_tile("3xtf32", 64, 64, 90, 0, None)
    with pytest.raises(nvrtc.NvrtcError, match="fa::wgmma needs sm_90a"):
        nvrtc.compile_cubin(launch.kernel_source(T.WGMMA_SOURCE), "sm_90", [t.name_expression(False, True)])
