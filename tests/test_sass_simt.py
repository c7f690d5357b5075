"""Issue 12: the SIMT backward's steady-state loops, held to per-kernel limits (no GPU needed).

``benchmarks/sass.py --simt`` (``flasharray/_private/sass.py``: ``simt_kernel_specs``,
``estimated_per_fma``) compiles the SIMT kernels with NVRTC, finds the loop with the most
FFMA/DFMA and estimates the dynamic instructions per useful FMA of one (query block, key block)
visit. ``test_quick_simt_within_limits`` checks fp32, D 64 and 128 on sm_90 (~10 s on 2 cores);
``-m slow`` the full matrix (fp32 and fp64, D 64 and 128, sm_80 and sm_90). A kernel fails when
its estimated instructions per FMA, its shared-memory loads per FMA or its registers exceed
:data:`BASELINE` (today's value, x 1.02), when it spills, or when a backward kernel needs more
instructions per FMA than its own forward (issue 12's goal is a backward at >= 0.8x the
forward's FLOP rate; docs/performance.md, "SIMT backward (issue 12)").
Before issue 12 the fp32 backward needed an estimated 3.8-5.5 instructions and 1.3-2.0 LDS per
FMA against the forward's 2.0-2.3 and 0.3-0.45; now 1.33-1.48 and 0.12-0.15.
"""
import pytest

from flasharray._private import sass

SASS_OK, SASS_WHY = sass.available()
requires_sass = pytest.mark.skipif(not SASS_OK, reason="SASS report unavailable: %s" % SASS_WHY)

#: Measured with NVRTC 12.9 / cuobjdump 13.5 (non-causal): (role, dtype, D, arch) ->
#: (estimated instructions per useful FMA, LDS per FMA in the loop, registers per thread).
BASELINE = {
    ("bwd_dkv_simt", "fp32", 64, 80): (1.44, 0.14, 200),
    ("bwd_dq_simt", "fp32", 64, 80): (1.44, 0.14, 168),
    ("bwd_dkv_atomic_simt", "fp32", 64, 80): (1.46, 0.14, 234),
    ("bwd_dkv_simt", "fp32", 128, 80): (1.44, 0.15, 172),
    ("bwd_dq_simt", "fp32", 128, 80): (1.33, 0.13, 198),
    ("bwd_dkv_atomic_simt", "fp32", 128, 80): (1.44, 0.15, 192),
    ("bwd_dkv_simt", "fp64", 64, 80): (2.08, 0.19, 182),
    ("bwd_dq_simt", "fp64", 64, 80): (2.32, 0.19, 130),
    ("bwd_dkv_atomic_simt", "fp64", 64, 80): (2.00, 0.21, 208),
    ("bwd_dkv_simt", "fp64", 128, 80): (2.24, 0.28, 198),
    ("bwd_dq_simt", "fp64", 128, 80): (2.33, 0.26, 147),
    ("bwd_dkv_atomic_simt", "fp64", 128, 80): (2.15, 0.28, 211),
    # two blocks per SM (tiles_bwd.SIMT_TWO_BLOCKS; one block: 1.45 / 0.14 / 198 and 1.48 / 0.14 / 204)
    ("bwd_dkv_simt", "fp32", 64, 90): (1.53, 0.16, 128),
    ("bwd_dq_simt", "fp32", 64, 90): (1.46, 0.14, 164),
    ("bwd_dkv_atomic_simt", "fp32", 64, 90): (1.56, 0.16, 128),
    ("bwd_dkv_simt", "fp32", 128, 90): (1.33, 0.13, 208),
    ("bwd_dq_simt", "fp32", 128, 90): (1.33, 0.13, 196),
    ("bwd_dkv_atomic_simt", "fp32", 128, 90): (1.36, 0.12, 246),
    ("bwd_dkv_simt", "fp64", 64, 90): (1.98, 0.15, 242),
    ("bwd_dq_simt", "fp64", 64, 90): (2.05, 0.14, 216),
    ("bwd_dkv_atomic_simt", "fp64", 64, 90): (1.93, 0.15, 240),
    ("bwd_dkv_simt", "fp64", 128, 90): (2.27, 0.28, 202),
    ("bwd_dq_simt", "fp64", 128, 90): (2.09, 0.19, 138),
    ("bwd_dkv_atomic_simt", "fp64", 128, 90): (2.19, 0.28, 216),
}
MARGIN = 1.02


def _check(reports):
    problems = []
    forward = {(r.spec.dtype, r.spec.head_dim, r.spec.arch): sass.estimated_per_fma(r)
               for r in reports if r.spec.role == "fwd_simt"}
    for r in reports:
        s = r.spec
        if r.spill_bytes:
            problems.append("%s sm_%d spills %d bytes" % (s.label, s.arch, r.spill_bytes))
        if s.role == "fwd_simt":
            continue
        if r.loop is None:
            problems.append("%s sm_%d: no FMA loop" % (s.label, s.arch))
            continue
        est, lds = sass.estimated_per_fma(r), r.loop.stats.lds / r.loop.stats.fma
        key = (s.role, sass.DTYPE_LABELS[s.dtype], s.head_dim, s.arch)
        limit_est, limit_lds, limit_regs = BASELINE[key]
        if est > limit_est * MARGIN or lds > limit_lds * MARGIN or r.registers > limit_regs * MARGIN:
            problems.append("%s sm_%d: est. instr/FMA %.2f (<= %.2f), LDS/FMA %.3f (<= %.2f), regs %d (<= %d)"
                            % (s.label, s.arch, est, limit_est, lds, limit_lds, r.registers, limit_regs))
        if est > forward[(s.dtype, s.head_dim, s.arch)]:
            problems.append("%s sm_%d: est. instr/FMA %.2f above the forward's %.2f"
                            % (s.label, s.arch, est, forward[(s.dtype, s.head_dim, s.arch)]))
    assert not problems, "\n".join(problems)


def test_simt_specs_follow_the_tile_tables():
    specs = sass.simt_kernel_specs(**sass.SIMT_QUICK)
    assert [(s.role, s.head_dim) for s in specs] == [(r, d) for d in (64, 128) for r in sass.SIMT_ROLES]
    assert all(s.simt and s.source == "flash_bwd_simt.cu" for s in specs if s.role != "fwd_simt")
    dkv = specs[1]
    assert (dkv.block_m, dkv.block_n, dkv.threads) == (64, 64, 256)
    assert dkv.fma_per_visit == 64 * 64 * 4 * 64 / 256   # S, dP, dV, dK


def test_estimate_counts_nested_fma_loops_by_their_share():
    # a visit loop [0x0, 0x60] with one FFMA of its own and a rolled FMA loop [0x10, 0x30]
    text = """Function : f
        /*0000*/                   IADD3 R0, R0, 0x1, RZ ;
        /*0010*/                   FFMA R1, R2, R3, R1 ;
        /*0020*/                   LDS.128 R4, [R2] ;
        /*0030*/               @P0 BRA 0x10 ;
        /*0040*/                   FFMA R8, R2, R3, R8 ;
        /*0050*/                   STS.64 [R2], R6 ;
        /*0060*/               @P1 BRA 0x0 ;
"""
    lp = sass.key_loop(sass.parse(text)["f"], "fma")
    assert (lp.start, lp.end, lp.stats.fma, lp.stats.lds128, lp.stats.sts64, lp.nested_stats.instructions) == (
        0, 0x60, 2, 1, 1, 3)
    spec = sass.KernelSpec("bwd_dq_simt", "float32", 16, 90, "flash_bwd_simt.cu", "f", 256, 0, 16, 16)
    r = sass.KernelReport(spec, lp, 32, 0, 0, sass.occupancy(90, 32, 256, 0))
    useful = 16 * 16 * 48 / 256   # 48 FMAs: 1 at the top, the inner loop runs 47 times at 3 instructions
    assert sass.estimated_per_fma(r) == pytest.approx((4 + 3 * (useful - 1)) / useful)
    assert "| bwd_dq_simt fp32 d16 | 90 | 16 x 16 | 7 | 2 | 3.50 | 1 (1) | 48 |" in sass.markdown([r])


@requires_sass
def test_quick_simt_within_limits():
    _check(sass.report(sass.simt_kernel_specs(**sass.SIMT_QUICK)))


@requires_sass
@pytest.mark.slow
def test_full_simt_within_limits():
    _check(sass.report(sass.simt_kernel_specs(**sass.SIMT_FULL)))
