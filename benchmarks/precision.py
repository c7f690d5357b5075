"""Accuracy of float32 attention per precision ("ieee", "tf32", "3xtf32") and the TF32 kernel's SASS.

Accuracy (default): every precision runs the CUDA forward on the emulator (exact mma semantics:
tf32 operands truncated to their 10 mantissa bits, products exact, fp32 accumulation) on the test
shapes of tests/test_cuda_forward_tf32.py, and the table gives the max abs error of out and lse
against the float64 reference, the max relative error of out (|err| / max(1, |ref|) elementwise),
the bound the tests hold it to (3xtf32 / ieee: the DESIGN.md fp32 rule, 2·naive fp32 error +
atol; tf32: the derived precision.tf32_error_bound plus that fp32 term), and naive float32
attention's own error for scale.

--sass: the TF32 kernel's key-tile loop on sm_80, sm_86 and sm_90 (NVRTC + cuobjdump): instructions per
HMMA, HMMA / LDSM / LDS / MUFU counts, registers, shared memory and occupancy per SM; ``--dims``
picks the head dims (d = dv, default 64,128; e.g. 160,192,256 for the wide tiles — calls that run
the SIMT kernel, such as 3xtf32 at d 256 on sm_86, have no row).

--f64: float64 inputs, the DMMA kernel (cuda_src/flash_fwd_f64.cu) against the SIMT fp64 kernel
(kernel="simt") on F64_SHAPES: max abs / rel error of out and max abs error of lse vs the reference.
--f64-sass: the DMMA kernel's key-tile loop (the loop with the most DMMA) on sm_80/86/89/90.

--f64-bwd-sass: the DMMA dK/dV kernel (cuda_src/flash_bwd_f64.cu) per visit of a query block on sm_80/86/90
(non-causal, cp.async, ordered dQ; d = dv 16 .. 128): the busiest warp's instructions and DMMA, its dQ unit loop
counted as often as it runs (cuda_backward_f64.dq_unit_n8: rounds of units per warp), their ratio, the other fp64
instructions per DMMA, registers, buffers and occupancy.

--bwd: float32 gradients per precision (ieee: the SIMT backward; 3xtf32 / tf32: the TF32 dK/dV
kernel, cuda_src/flash_bwd_tf32.cu) on the emulator vs the float64 reference on BWD_SHAPES: max
abs error of dq, dk, dv, the largest relative to max(1, |ref|), and naive float32's error.
--bwd-sass: the TF32 dK/dV kernel's query-block loop on sm_80/86/89/90 (both precisions, d = dv in
16, 32, 64, 128; non-causal, cp.async, ordered dQ): instructions per HMMA, HMMA / LDSM / LDS / RED,
registers, spills, shared memory and occupancy.

--default: float32's default precision, ieee (SIMT) against 3xtf32, in an issue model built from
the SASS (sm_80, sm_90; d 64, 128): useful FLOP per issued warp instruction of the forward and the
default (deterministic) backward, the warps resident per SM, and the rates they allow at 4 issues
per SM per clock under the pipe's cap, scaled to an H100's size — a model, not a timing.

Usage: python benchmarks/precision.py [--sass [--dims D,...] | --f64 | --f64-sass | --f64-bwd-sass | --bwd | --bwd-sass |
       --default] [--quick]
(docs/precision.md)
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from flasharray import reference  # noqa: E402
from flasharray._private import cuda_forward  # noqa: E402
from flasharray._private.dtypes import ATOL  # noqa: E402
from flasharray._private.precision import tf32_error_bound  # noqa: E402

#: (D, Lq, Lk, causal, layout, gqa): the default test shapes of tests/test_cuda_forward_tf32.py.
SHAPES = [
    (64, 77, 130, False, "bhsd", False),
    (32, 1, 130, True, "bhsd", True),
    (128, 65, 63, True, "bhsd", False),
    (59, 17, 45, False, "bshd", False),
    (40, 64, 64, True, "bshd", True),
    (16, 17, 64, False, "bhsd", False),
    (128, 256, 256, False, "bhsd", False),
]
PRECISIONS = ("ieee", "3xtf32", "tf32")


def inputs(D, Lq, Lk, layout, gqa, seed=0, B=1, H=2, dtype=np.float32):
    rng = np.random.default_rng(seed)
    Hk = 1 if gqa else H

    def one(h, L):
        if layout == "bshd":
            return np.swapaxes(rng.standard_normal((B, L, h, D)).astype(dtype), 1, 2)
        return rng.standard_normal((B, h, L, D)).astype(dtype)
    return one(H, Lq), one(Hk, Lk), one(Hk, Lk)


def _max(x):
    return float(x.max()) if x.size else 0.0


def accuracy_row(shape, precision):
    """Errors of one (shape, precision) against the float64 reference, and the test's bound."""
    D, Lq, Lk, causal, layout, gqa = shape
    q, k, v = inputs(D, Lq, Lk, layout, gqa)
    batch = tuple(np.broadcast_shapes(q.shape[:-2], k.shape[:-2]))
    p = cuda_forward.plan(q, k, v, causal=causal, scale=D ** -0.5, batch_shape=batch, device="emulator",
                          precision=precision)
    out, lse = p.run(q, k, v)
    ref, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    naive, naive_lse = reference.attention(q, k, v, causal=causal, return_lse=True, dtype=np.float32)
    fin = np.isfinite(ref_lse)
    err = np.abs(out - ref)
    lse_err = np.abs(lse[fin] - ref_lse[fin])
    naive_err = _max(np.abs(naive - ref))
    bound = 2 * naive_err + ATOL[np.dtype(np.float32)] * max(1.0, _max(np.abs(ref)))
    if precision == "tf32":
        bound = bound + _max(tf32_error_bound(q, k, v, causal=causal)[0])
    return dict(kernel=p.tile.kernel, out=_max(err), rel=_max(err / np.maximum(1.0, np.abs(ref))),
                lse=_max(lse_err), naive=naive_err, bound=bound)


def accuracy_table(shapes=SHAPES):
    lines = ["| shape (D, Lq x Lk) | precision | kernel | max abs err out | max rel err out | max abs err lse | "
             "test bound (out) | naive fp32 err |",
             "|---|---|---|---|---|---|---|---|"]
    worst = {}
    for shape in shapes:
        D, Lq, Lk, causal, layout, gqa = shape
        name = "D %d, %d x %d%s%s%s" % (D, Lq, Lk, " causal" if causal else "", " bshd" if layout == "bshd" else "",
                                        " GQA" if gqa else "")
        for precision in PRECISIONS:
            r = accuracy_row(shape, precision)
            worst[precision] = max(worst.get(precision, 0.0), r["out"])
            lines.append("| %s | %s | %s | %.2e | %.2e | %.2e | %.2e | %.2e |" % (
                name, precision, r["kernel"], r["out"], r["rel"], r["lse"], r["bound"], r["naive"]))
    lines.append("")
    lines.append("max |err out| over the shapes: " + ", ".join("%s %.2e" % kv for kv in worst.items()))
    return "\n".join(lines)


#: (D, Lq, Lk, causal, layout, gqa): float64 shapes (tests/test_cuda_forward_f64.py and two larger).
F64_SHAPES = [
    (64, 77, 130, False, "bhsd", False),
    (32, 1, 130, True, "bhsd", True),
    (128, 65, 63, True, "bhsd", False),
    (59, 17, 45, False, "bshd", False),
    (16, 64, 64, True, "bshd", True),
    (128, 17, 130, False, "bshd", True),
    (128, 256, 256, False, "bhsd", False),
    (64, 256, 256, True, "bhsd", False),
]


def _shape_name(shape):
    D, Lq, Lk, causal, layout, gqa = shape
    return "D %d, %d x %d%s%s%s" % (D, Lq, Lk, " causal" if causal else "", " bshd" if layout == "bshd" else "",
                                    " GQA" if gqa else "")


def f64_errors(shape, kernel=None):
    """(kernel name, max abs err out, max rel err out, max abs err lse) of a float64 forward."""
    D, Lq, Lk, causal, layout, gqa = shape
    q, k, v = inputs(D, Lq, Lk, layout, gqa, dtype=np.float64)
    batch = tuple(np.broadcast_shapes(q.shape[:-2], k.shape[:-2]))
    p = cuda_forward.plan(q, k, v, causal=causal, scale=D ** -0.5, batch_shape=batch, device="emulator", kernel=kernel)
    out, lse = p.run(q, k, v)
    ref, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    fin = np.isfinite(ref_lse)
    err = np.abs(out - ref)
    return (p.tile.kernel, _max(err), _max(err / np.maximum(1.0, np.abs(ref))), _max(np.abs(lse[fin] - ref_lse[fin])))


def f64_accuracy_table(shapes=F64_SHAPES):
    lines = ["| shape (D, Lq x Lk) | DMMA out | DMMA rel | DMMA lse | SIMT out | SIMT rel | SIMT lse |",
             "|---|---|---|---|---|---|---|"]
    for shape in shapes:
        dmma, simt = f64_errors(shape), f64_errors(shape, "simt")
        assert dmma[0] == "f64" and simt[0] == "simt"
        lines.append("| %s | %.2e | %.2e | %.2e | %.2e | %.2e | %.2e |" % ((_shape_name(shape),) + dmma[1:] + simt[1:]))
    return "\n".join(lines)


def _dmma_key_loop(sass, body):
    """(loop, its DMMA): the loop holding the most DMMA, then the fewest instructions."""
    def dmma(lp):
        return [i for i in body if i.base == "DMMA" and lp.start <= i.address <= lp.end]
    loop = min(sass.loops(body), key=lambda lp: (-len(dmma(lp)), lp.stats.instructions))
    return loop, dmma(loop)


def _fp64_pipe(i):
    """An fp64 instruction other than DMMA: on sm_80+ these share the DMMA's dispatch port, so each
    one takes a tensor-core issue slot (the softmax's cost in the DMMA kernels)."""
    return i.base in ("DFMA", "DADD", "DMUL", "DSETP", "DMNMX") or (
        i.base in ("FRND", "F2I", "I2F", "F2F") and "F64" in i.opcode)


def f64_sass_table(archs=(80, 86, 89, 90), head_dims=(16, 32, 64, 128)):
    from flasharray._private import cuda_forward_f64 as F
    from flasharray._private import sass
    ok, why = sass.available()
    if not ok:
        return "SASS unavailable: %s" % why
    lines = ["| arch | d = dv | Br x Bc | regs | smem KB | occupancy (blocks, warps / SM) | key-loop instr | DMMA | "
             "instr / DMMA | LDS | DFMA | other fp64 / DMMA | BAR |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for arch in archs:
        found = {}
        for d in head_dims:
            t = F.forward_tile(None, np.float64, d, d, arch)
            found[t.name_expression(False, True)] = t
        for (k, body), t in zip(_compiled(F.SOURCE, arch, found), found.values()):
            lp, dmma = _dmma_key_loop(sass, body)
            occ = sass.occupancy(arch, k.registers, t.n_threads, t.smem)
            s = lp.stats
            op = dmma[0].opcode + (dmma[0].operands.split()[0] if dmma[0].operands[:1] == "x" else "")
            loop = [i for i in body if lp.start <= i.address <= lp.end]
            dfma = sum(1 for i in loop if i.base == "DFMA")
            fp64 = sum(1 for i in loop if _fp64_pipe(i))
            lines.append("| sm_%d | %d | %d x %d | %d | %.1f | %d, %d (%s) | %d | %d `%s` | %.2f | %d (%d LDS.128) | %d | %.2f | %d |" % (
                arch, t.head_dim, t.block_m, t.block_n, k.registers, t.smem / 1024, occ.blocks, occ.warps, occ.limiter,
                s.instructions, len(dmma), op, s.instructions / len(dmma), s.lds, s.lds128, dfma, fp64 / len(dmma), s.bar))
    return "\n".join(lines)


def _busiest_warp(sass, body, rounds):
    """(instructions, DMMA, other fp64) of one visit of the DMMA backward's busiest warp: the query-block loop
    (the loop with the most DMMA), the dQ unit loop nested in it counted ``rounds`` times."""
    def count(lp, pred=lambda i: True):
        return sum(1 for i in body if lp.start <= i.address <= lp.end and pred(i))
    is_dmma = lambda i: i.base == "DMMA"  # noqa: E731
    loops = sass.loops(body)
    outer = max(loops, key=lambda lp: count(lp, is_dmma))
    inner = [lp for lp in loops if outer.start < lp.start and lp.end < outer.end and count(lp, is_dmma)]
    return tuple(count(outer, pred) + sum((rounds - 1) * count(lp, pred) for lp in inner)
                 for pred in (lambda i: True, is_dmma, _fp64_pipe))


def f64_bwd_sass_table(archs=(80, 86, 90), head_dims=(16, 32, 48, 64, 80, 96, 112, 128)):
    """The DMMA backward's busiest warp per visit (:func:`_busiest_warp`, ``rounds`` = ceil(dQ units / warps))."""
    from flasharray._private import cuda_backward_f64 as B
    from flasharray._private import sass
    ok, why = sass.available()
    if not ok:
        return "SASS unavailable: %s" % why
    lines = ["| arch | d = dv | Br x Bc (warps), buffers | regs | occupancy (warps / SM) | dQ unit (n8), rounds | "
             "busiest warp: instr, DMMA per visit | instr / DMMA | other fp64 / DMMA | DMMA |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for arch in archs:
        found = {}
        for d in head_dims:
            t = B.backward_tile(None, np.float64, d, d, arch)
            found[B.dkv_name(t, None, d, d, False, True, True)] = (t, d)
        for (k, body), (t, d) in zip(_compiled(B.SOURCE, arch, found), found.values()):
            warps = t.n_threads // 32
            unit, rounds = B.dq_unit_n8(t.block_m, d, warps), B.dq_rounds(t.block_m, d, warps)
            instr, dmma, fp64 = _busiest_warp(sass, body, rounds)
            dmma *= 8 if t.dmma_k == 16 else 1  # in m8n8k4-equivalents (an m16n8k16 is eight)
            occ = sass.occupancy(arch, k.registers, t.n_threads, t.smem)
            lines.append("| sm_%d | %d | %d x %d (%d), %d | %d | %d | %d, %d | %d, %d | %.2f | %.2f | %s |" % (
                arch, d, t.block_m, t.block_n, warps, t.stages, k.registers, occ.warps, unit, rounds, instr, dmma,
                instr / dmma, fp64 / dmma, "m16n8k16 (x 8)" if t.dmma_k == 16 else "m8n8k4"))
    return "\n".join(lines)


def _compiled(source, arch, names):
    """NVRTC-compile the instantiations ``names`` (name expressions) of ``source`` for ``arch``; [(kernel info,
    its SASS body)] in their order."""
    from flasharray._private import launch, nvrtc, sass
    res = nvrtc.compile_cubin(launch.kernel_source(source), "sm_%d" % arch, list(names), options=["--use_fast_math"])
    fns = sass.parse(sass.disassemble(res.cubin))
    return [(res.kernel(n), fns[res.kernel(n).lowered_name]) for n in names]


def _compiled_loops(source, arch, found):
    """NVRTC-compile the instantiations ``found`` ({name expression: tile}) of ``source`` for
    ``arch``; [(tile, kernel info, key loop (the loop with the most HMMA), occupancy)]."""
    from flasharray._private import sass
    return [(t, k, sass.key_loop(body), sass.occupancy(arch, k.registers, t.n_threads, t.smem))
            for (k, body), t in zip(_compiled(source, arch, found), found.values())]


def _tf32_fwd_found(precisions, arch, head_dims):
    from flasharray._private import cuda_forward_tf32 as T
    tiles = (T.forward_tile(p, np.float32, d, d, arch, wgmma=False) for p in precisions for d in head_dims)
    return {t.name_expression(False, True): t for t in tiles if t is not None}  # None: the call runs SIMT


def _tf32_bwd_found(precisions, arch, head_dims):
    from flasharray._private import cuda_backward_tf32 as T
    tiles = [(p, T.backward_tile(p, np.float32, d, d, arch, wgmma=False)) for p in precisions for d in head_dims]
    return {T.dkv_name(t, p, t.head_dim, t.head_dim_v, False, True, True): t for p, t in tiles}


def sass_table(archs=(80, 86, 90), head_dims=(64, 128)):
    from flasharray._private import cuda_forward_tf32 as T
    from flasharray._private import sass
    ok, why = sass.available()
    if not ok:
        return "SASS unavailable: %s" % why
    lines = ["| arch | precision | d | Br x Bc (3xtf32: Q split) | regs | smem KB | occupancy (blocks, warps / SM) | key-loop instr | "
             "HMMA | instr / HMMA | LDSM | LDS | MUFU |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for arch in archs:
        for t, k, lp, occ in _compiled_loops(T.SOURCE, arch, _tf32_fwd_found(T.PREC, arch, head_dims)):
            s = lp.stats
            lines.append("| sm_%d | %s | %d | %d x %d%s | %d | %.1f | %d, %d (%s) | %d | %d | %.2f | %d | %d | %d |" % (
                arch, t.precision, t.head_dim, t.block_m, t.block_n, ", Q split" if t.q_split else "", k.registers, t.smem / 1024, occ.blocks,
                occ.warps, occ.limiter, s.instructions, s.hmma, s.per_hmma, s.ldsm, s.lds, s.mufu))
    return "\n".join(lines)


#: (D, Dv, Lq, Lk, causal, group): float32 backward shapes (tests/test_cuda_backward_tf32.py, larger).
BWD_SHAPES = [
    (64, 64, 77, 130, False, 1),
    (40, 24, 33, 70, True, 2),
    (128, 128, 50, 70, True, 1),
    (16, 16, 17, 45, False, 3),
    (64, 64, 256, 256, True, 1),
    (128, 128, 256, 256, False, 1),
]


def bwd_errors(shape, precision, seed=0):
    """{dq, dk, dv: max abs err}, the max error relative to max(1, |ref|), and naive fp32's max error."""
    from flasharray._private import cuda_backward
    import flasharray as fa
    D, Dv, Lq, Lk, causal, G = shape
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 2, G, Lq, D)).astype(np.float32)
    k = rng.standard_normal((1, 2, 1, Lk, D)).astype(np.float32)
    v = rng.standard_normal((1, 2, 1, Lk, Dv)).astype(np.float32)
    do = rng.standard_normal((1, 2, G, Lq, Dv)).astype(np.float32)
    out, lse = fa.flash_attention_forward(q, k, v, causal=causal, backend="emulator", precision=precision)
    *grads, counters = cuda_backward.backward(do, q, k, v, out, lse, causal=causal, scale=D ** -0.5,
                                              batch_shape=q.shape[:-2], device="emulator", precision=precision,
                                              return_counters=True)
    kernel = "tf32" if any(n.startswith("flash_bwd_dkv_tf32") for n, _ in counters) else "simt"
    ref = reference.attention_backward(do, q, k, v, causal=causal)
    naive = reference.attention_backward(do, q, k, v, causal=causal, dtype=np.float32)
    errs = [_max(np.abs(g - r)) for g, r in zip(grads, ref)]
    rel = max(_max(np.abs(g - r) / np.maximum(1.0, np.abs(r))) for g, r in zip(grads, ref))
    return kernel, errs, rel, max(_max(np.abs(n - r)) for n, r in zip(naive, ref))


def bwd_accuracy_table(shapes=BWD_SHAPES):
    lines = ["| shape (D, Dv, Lq x Lk, group) | precision | dK/dV kernel | dq err | dk err | dv err | max rel err | "
             "naive fp32 err |", "|---|---|---|---|---|---|---|---|"]
    for shape in shapes:
        D, Dv, Lq, Lk, causal, G = shape
        name = "D %d, Dv %d, %d x %d%s, G %d" % (D, Dv, Lq, Lk, " causal" if causal else "", G)
        for precision in PRECISIONS:
            kernel, errs, rel, naive = bwd_errors(shape, precision)
            lines.append("| %s | %s | %s | %.2e | %.2e | %.2e | %.2e | %.2e |" % (
                name, precision, kernel, errs[0], errs[1], errs[2], rel, naive))
    return "\n".join(lines)


def bwd_sass_table(archs=(80, 86, 89, 90), head_dims=(16, 32, 64, 128)):
    from flasharray._private import cuda_backward_tf32 as T
    from flasharray._private import sass
    ok, why = sass.available()
    if not ok:
        return "SASS unavailable: %s" % why
    lines = ["| arch | precision | d = dv | Br x Bc (warps), stages | regs | spill | smem KB | occupancy (blocks, warps / SM) | "
             "loop instr | HMMA | instr / HMMA | LDSM | LDS | RED |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for arch in archs:
        for t, k, lp, occ in _compiled_loops(T.SOURCE, arch, _tf32_bwd_found(T.PREC, arch, head_dims)):
            s = lp.stats
            lines.append("| sm_%d | %s | %d | %d x %d (%d), %d | %d | %d | %.1f | %d, %d (%s) | %d | %d | %.2f | %d | %d | %d |" % (
                arch, t.precision, t.head_dim, t.block_m, t.block_n, t.n_threads // 32, t.stages, k.registers,
                k.spill_stores + k.spill_loads, t.smem / 1024, occ.blocks, occ.warps, occ.limiter, s.instructions,
                s.hmma, s.per_hmma, s.ldsm, s.lds, s.atomic))
    return "\n".join(lines)


#: --default's issue model, in useful FLOP per SM per clock. An SM issues 4 warp instructions per
#: clock (one per scheduler: fewer when fewer warps are resident); its FMA pipes retire 128 fp32 FMAs (256 FLOP) per clock; TF32 mma.sync is taken at A100's
#: rate, 1024 FLOP per SM per clock (156 TFLOP/s / 108 SMs / 1.41 GHz), of which 3xtf32 keeps a third.
ISSUE_PER_CLOCK = 4
FFMA_FLOP_PER_CLOCK = 256
TF32_MMA_FLOP_PER_CLOCK = 1024
H100_SMS, H100_GHZ = 132, 1.755   # H100 SXM: SMs, sustained clock (GHz) for the TFLOP/s column


def _simt_model(arch, d):
    """ieee (SIMT): useful FLOP per warp instruction of the forward and of the default deterministic
    backward (dK/dV kernel + dQ kernel, 7 products for 5 useful), and (warps per SM) of each kernel."""
    from flasharray._private import sass
    reps = {r.spec.role: r for r in sass.report(sass.simt_kernel_specs(archs=(arch,), dtypes=("float32",),
                                                                       head_dims=(d,)))}
    est = {role: sass.estimated_per_fma(r) for role, r in reps.items()}
    fwd = 64 / est["fwd_simt"]                    # 32 lanes x 2 FLOP per FFMA
    # FMAs per (query, key) pair: dK/dV 2d + 2dv, dQ 2d + dv (S, dP recomputed); useful 3d + 2dv.
    bwd = 64 * 5 * d / (est["bwd_dkv_simt"] * 4 * d + est["bwd_dq_simt"] * 3 * d)
    warps = (reps["fwd_simt"].occupancy.warps, min(reps[r].occupancy.warps for r in ("bwd_dkv_simt", "bwd_dq_simt")))
    return fwd, bwd, warps, FFMA_FLOP_PER_CLOCK


def _tf32_model(arch, d, precision="3xtf32"):
    """TF32 kernels: useful FLOP per warp instruction of the forward and the (ordered) backward loop
    (an m16n8k8 HMMA is 2048 FLOP; 3xtf32 issues three per product), and (warps per SM)."""
    from flasharray._private import cuda_backward_tf32 as TB, cuda_forward_tf32 as TF
    per = 2048 / (3 if precision == "3xtf32" else 1)
    (tf, _, lf, of), = _compiled_loops(TF.SOURCE, arch, _tf32_fwd_found((precision,), arch, (d,)))
    (tb, _, lb, ob), = _compiled_loops(TB.SOURCE, arch, _tf32_bwd_found((precision,), arch, (d,)))
    return per / lf.stats.per_hmma, per / lb.stats.per_hmma, (of.warps, ob.warps), TF32_MMA_FLOP_PER_CLOCK * per / 2048


def default_model(archs=(80, 90), head_dims=(64, 128)):
    """float32's default (docs/precision.md, *Default*): the ieee (SIMT) kernels against 3xtf32 in
    an issue model built from the SASS: useful FLOP per issued warp instruction, times 4 issues per
    clock, capped by the pipe (FFMA, or TF32 mma at A100's rate) — rates at full issue, not timings;
    the resident warps per SM say how much latency hiding the kernels get."""
    from flasharray._private import sass
    ok, why = sass.available()
    if not ok:
        return "SASS unavailable: %s" % why
    lines = ["| arch | d | precision | useful FLOP / warp instr: fwd, bwd | warps / SM: fwd, bwd | modeled TFLOP/s at "
             "H100 size (fwd, bwd, fwd+bwd) | fwd+bwd vs ieee |", "|---|---|---|---|---|---|---|"]
    scale = H100_SMS * H100_GHZ * 1e-3
    for arch in archs:
        for d in head_dims:
            base = None
            for precision, (f, b, w, pipe) in (("ieee", _simt_model(arch, d)), ("3xtf32", _tf32_model(arch, d))):
                # a scheduler issues at most one instruction per clock, from its own warps
                rf, rb = (min(min(ISSUE_PER_CLOCK, n) * x, pipe) * scale for x, n in zip((f, b), w))
                both = 3.5 / (1 / rf + 2.5 / rb)           # backward FLOPs = 2.5 x forward's (d = dv)
                base = base or both
                lines.append("| sm_%d | %d | %s | %.0f, %.0f | %d, %d | %.0f, %.0f, %.0f | %.2f |" % (
                    arch, d, precision, f, b, w[0], w[1], rf, rb, both, both / base))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sass", action="store_true", help="the TF32 kernel's SASS figures instead")
    ap.add_argument("--f64", action="store_true", help="float64: the DMMA kernel's accuracy vs the SIMT kernel's")
    ap.add_argument("--f64-sass", action="store_true", help="the DMMA kernel's SASS figures")
    ap.add_argument("--f64-bwd-sass", action="store_true", help="the DMMA backward's busiest warp per visit (SASS)")
    ap.add_argument("--bwd", action="store_true", help="float32 gradients per precision vs float64")
    ap.add_argument("--bwd-sass", action="store_true", help="the TF32 dK/dV kernel's SASS figures")
    ap.add_argument("--default", action="store_true",
                    help="float32's default: ieee vs 3xtf32 in the SASS issue model")
    ap.add_argument("--quick", action="store_true", help="accuracy: the first two shapes only")
    ap.add_argument("--dims", default="64,128",
                    help="--sass: head dims d = dv, comma-separated (up to 256; calls routed to SIMT are skipped)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.sass:
        print(sass_table(head_dims=tuple(int(d) for d in args.dims.split(","))))
    elif args.default:
        print(default_model())
    elif args.f64_sass:
        print(f64_sass_table())
    elif args.f64_bwd_sass:
        print(f64_bwd_sass_table())
    elif args.bwd_sass:
        print(bwd_sass_table())
    elif args.bwd:
        print(bwd_accuracy_table(BWD_SHAPES[:2] if args.quick else BWD_SHAPES))
    elif args.f64:
        print(f64_accuracy_table(F64_SHAPES[:2] if args.quick else F64_SHAPES))
    else:
        print(accuracy_table(SHAPES[:2] if args.quick else SHAPES))
    print("(%.0f s)" % (time.perf_counter() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
