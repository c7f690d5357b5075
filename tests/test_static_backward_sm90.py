"""Static checks of the Hopper wgmma backward (cuda_src/flash_bwd_sm90.cu) with NVRTC (no GPU needed).

Every dK/dV instantiation ``cuda_backward.kernel_plan(..., kernel="wgmma")`` names — padded head dims
64, 128 and 256 (the head-dim split: Bc = 64, each warpgroup half of d, dv), causal and not, ordered
(deterministic) and plain atomic dQ; float16 by default, bfloat16, the element-wise loads (``vec`` false)
and mixed split dims (D != Dv) under ``-m slow`` — compiles for sm_90a with zero spills,
no local stack, no static shared memory, registers x threads within the register file and dynamic
shared memory within the opt-in maximum. In the SASS the query-block loop (the loop holding the
most HGMMA) holds every HGMMA of the kernel, exactly one visit's: per warpgroup d/16 (S^T) + dv/16
(dP^T) SS, Br/16 + Br/16 RS (dV, dK), and Bc/16 SS for dQ^T (head-dim split: d/128 such blocks).
``-s`` prints registers and the loop's instructions (docs/hopper.md, "Backward", quotes them).

The warp-specialized TMA kernel (``flash_bwd_sm90_ws_kernel``, plain atomic and ordered dQ;
``ws_instantiations``) also: setmaxnreg took effect (``USETMAXREG.DEALLOC`` and ``.TRY_ALLOC``, no C7508
note), registers used within the consumers' 240, the query-block loop free of copies (no LDGSTS) with one
named barrier (ordered: two, the group semaphore's wait and post, with the leader's acquire spin
``LDG.E.STRONG.GPU`` and release add ``RED.E.ADD.S32.STRONG.GPU`` in it), and the producer loop (the
smallest loop holding ``UTMALDG``) issuing one visit's Q_i and dO_i boxes with registers below the
producer's 24 and no semaphore instruction. Below the head-dim split, no exp2 of P^T behind a branch.
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


def _dims(d):
    """(D, Dv) of a ``dims`` entry: an int (D = Dv) or a pair."""
    return d if isinstance(d, tuple) else (d, d)


def instantiations(dtype, dims, vecs=(True,)):
    found = {}
    for d in dims:
        for causal in (False, True):
            for ordered in (False, True):
                for vec in vecs:
                    ks = cb.kernel_plan(dtype, *_dims(d), causal=causal, deterministic=False, arch=90,
                                        kernel="wgmma", ordered=ordered, vec=vec)
                    found[ks["dkv"][1]] = (ks["dkv"][2], d)
    return found


def ws_instantiations(dtype, dims):
    found = {}
    for d in dims:
        for causal in (False, True):
            for ordered in (False, True):
                ks = cb.kernel_plan(dtype, *_dims(d), causal=causal, deterministic=False, arch=90, kernel="wgmma",
                                    tma=True, ordered=ordered)
                found[ks["dkv"][1]] = (ks["dkv"][2], d)
    return found


def sass_registers(operands):
    return re.findall(r"\bR\d+\b", operands)


def branched_exp2(body, loop):
    """The MUFU.EX2 of the loop that lie inside a BSSY ... BSYNC region (a branch around them): P^T computed with a
    select of exp2's argument (p_from_score_sel) has none; ptxas put each FFMA / MUFU pair of the select of its
    result behind a branch (docs/hopper.md, "Descriptors by 64-bit adds, P^T without branches")."""
    in_loop = [i for i in body if loop.start <= i.address <= loop.end]
    regions = [(i.address, int(i.operands.split(",")[1], 16)) for i in in_loop if i.base == "BSSY"]
    return sum(1 for i in in_loop if i.opcode.startswith("MUFU.EX2") and any(a < i.address < e for a, e in regions))


def ws_checks(name, t, d, body, loop):
    """Problems of the warp-specialized kernel's SASS and its figures (producer loop, registers)."""
    problems = []
    ops = {i.opcode for i in body}
    for op in ("USETMAXREG.DEALLOC.CTAPOOL", "USETMAXREG.TRY_ALLOC.CTAPOOL", "ELECT", "UTMALDG.5D"):
        if op not in ops:
            problems.append("%s: no %s" % (name, op))
    ordered, tma_store, bulk = [f == "true" for f in S._ws_args(name)[8:11]]
    # Is_dq_bulk: the consumers never take the turn (the dQ warp does, also in the head-dim split's staged bulk dQ):
    # one barrier, no semaphore instruction
    consumer_turn = ordered and not bulk
    p_limit, c_limit = S.ws_regs(*S.pad_head_dims(*_dims(d)))
    if loop.stats.ldgsts or loop.stats.bar != (2 if consumer_turn else 1):
        problems.append("%s: %d LDGSTS, %d BAR in the query-block loop" % (name, loop.stats.ldgsts, loop.stats.bar))
    in_loop = [i.opcode for i in body if loop.start <= i.address <= loop.end]
    sem_ops = ("LDG.E.STRONG.GPU" in in_loop, any(re.fullmatch(r"REDG?\.E\.ADD\.S32\.STRONG\.GPU", o) for o in in_loop))
    if sem_ops != (consumer_turn, consumer_turn):
        problems.append("%s: acquire load / release add in the query-block loop: %s" % (name, sem_ops))
    if not S.is_split(*_dims(d)) and branched_exp2(body, loop):
        problems.append("%s: %d MUFU.EX2 of P^T behind a branch (BSSY ... BSYNC) in the query-block loop"
                        % (name, branched_exp2(body, loop)))
    if bulk:
        staged = S.is_split(*_dims(d))   # (kDQStaged: one add per warpgroup and 16-row tile, Br / 8)
        problems += dq_warp_checks(name, body, loop, ordered, t.block_m // 8 if staged else 1, p_limit)
    # the dK / dV epilogue: Is_tma_store (the name's second-last flag) one TMA store per 64 columns per tensor and
    # no global store instruction; else the 16-byte stores and no TMA store
    pd, pdv = S.pad_head_dims(*_dims(d))
    stores = sum(1 for i in body if i.base == "UTMASTG")
    stg = sum(1 for i in body if i.base == "STG")
    if tma_store != (stores == (pd + pdv) // 64 and stg == 0) or (stores == 0) != (stg > 0):
        problems.append("%s: %d UTMASTG, %d STG" % (name, stores, stg))
    tma = [i for i in body if i.base == "UTMALDG"]
    lps = [lp for lp in sass.loops(body) if any(lp.start <= i.address <= lp.end for i in tma)]
    if not lps:
        return problems + ["%s: no producer loop" % name], ""
    producer = min(lps, key=lambda lp: lp.stats.instructions)
    boxes = sum(1 for i in tma if producer.start <= i.address <= producer.end)
    want = sum(S.pad_head_dims(*_dims(d))) // 64  # Q_i's and dO_i's 64-column boxes
    if boxes != want:
        problems.append("%s: %d UTMALDG in the producer loop, expected %d" % (name, boxes, want))
    in_producer = [i for i in body if producer.start <= i.address <= producer.end]
    if any(i.opcode == "LDG.E.STRONG.GPU" or "STRONG.GPU" in i.opcode for i in in_producer):
        problems.append("%s: a semaphore instruction in the producer loop" % name)
    p_regs = max((int(r[1:]) for i in in_producer for r in sass_registers(i.operands)), default=0) + 1
    regs = max((int(r[1:]) for i in body for r in sass_registers(i.operands)), default=0) + 1
    if regs > c_limit or p_regs > p_limit:
        problems.append("%s: registers up to R%d (consumers: %d), producer loop up to R%d (%d)" % (
            name, regs - 1, c_limit, p_regs - 1, p_limit))
    return problems, "  producer loop %d instr (%d UTMALDG, registers < %d), registers used %d, %d UTMASTG, " \
                     "%d after the loop" % (producer.stats.instructions, boxes, p_regs, regs, stores,
                                            sum(1 for i in body if i.address > loop.end))


DQ_WARP_FIGURES = {}   # name -> the dQ warp loop's figures (printed by _check)


def dq_warp_checks(name, body, loop, ordered, n_adds, p_limit):
    """Is_dq_bulk: no float atomic (RED / ATOM .F32) anywhere; the visit's ``n_adds`` UBLKRED.G.S.ADD.F32.RN (one:
    the whole tile from the dQ buffer; the head-dim split's staged tile: one per warpgroup and 16-row tile) in the
    dQ warp's loop (the loop holding them and an mbarrier wait), not the consumers'; within the producer
    warpgroup's ``p_limit`` registers, ordered with the semaphore's acquire spin and release add in it (plain:
    none)."""
    problems = []
    f32_atomics = [i.opcode for i in body if i.base in ("RED", "REDG", "ATOM", "ATOMG") and ".F32" in i.opcode]
    if f32_atomics:
        problems.append("%s: float atomics with the bulk dQ: %s" % (name, f32_atomics[:4]))
    blk = [i for i in body if i.base == "UBLKRED"]
    lps = [lp for lp in sass.loops(body) if any(lp.start <= i.address <= lp.end for i in blk)]
    if len(blk) != n_adds or any(i.opcode != "UBLKRED.G.S.ADD.F32.RN" for i in blk) or not lps:
        return problems + ["%s: %d UBLKRED (%s), %d loops hold them, expected %d adds" % (
            name, len(blk), blk[:1], len(lps), n_adds)]
    # the visit loop: the smallest holding every UBLKRED and the dq_full wait (ptxas wraps each UBLKRED alone in an
    # elect loop; the try-wait retries branch back from after the kernel's code, spanning other roles)
    waits = [i.address for i in body if i.opcode.startswith("SYNCS.PHASECHK")]
    lps = [lp for lp in lps if any(lp.start <= a <= lp.end for a in waits)
           and all(lp.start <= i.address <= lp.end for i in blk)]
    if not lps:
        return problems + ["%s: no loop holds the UBLKRED and an mbarrier wait" % name]
    dq = min(lps, key=lambda lp: lp.stats.instructions)
    if loop.start <= blk[0].address <= loop.end:
        problems.append("%s: the UBLKRED is in the consumers' loop" % name)
    in_dq = [i for i in body if dq.start <= i.address <= dq.end]
    ops = [i.opcode for i in in_dq]
    sem = ("LDG.E.STRONG.GPU" in ops, any(re.fullmatch(r"REDG?\.E\.ADD\.S32\.STRONG\.GPU", o) for o in ops))
    if sem != (ordered, ordered):
        problems.append("%s: acquire load / release add in the dQ warp's loop: %s" % (name, sem))
    regs = max((int(r[1:]) for i in in_dq for r in sass_registers(i.operands)), default=0) + 1
    if regs > p_limit:
        problems.append("%s: the dQ warp's loop uses registers up to R%d (%d)" % (name, regs - 1, p_limit))
    DQ_WARP_FIGURES[name] = "  dQ warp loop %d instr (%d UBLKRED, %d DEPBAR, registers < %d)" % (
        dq.stats.instructions, n_adds, sum(1 for o in ops if o.startswith("DEPBAR")), regs)
    return problems


def hgmma_in(body, loop):
    return [i for i in body if i.base == "HGMMA" and (loop is None or loop.start <= i.address <= loop.end)]


def _check(found):
    res = nvrtc.compile_cubin(launch.kernel_source(S.SOURCE), "sm_90a", list(found), options=["--use_fast_math"])
    fns = sass.parse(sass.disassemble(res.cubin)) if SASS_OK else None
    problems = [line for line in res.log.splitlines() if "serializ" in line.lower() or "C7508" in line]
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
            pd, pdv = S.pad_head_dims(*_dims(d))
            dq_blocks = pd // 128 if S.is_split(*_dims(d)) else 1  # m64 blocks of dQ^T per warpgroup
            per_wg = pd // 16 + pdv // 16 + 2 * (t.block_m // 16) + dq_blocks * t.block_n // 16  # one thread's code
            in_loop = hgmma_in(body, loop)
            if loop is None or len(in_loop) != per_wg or len(hgmma_in(body, None)) != per_wg:
                problems.append("%s: %d HGMMA in the loop, %d in all, expected %d" % (
                    name, len(in_loop), len(hgmma_in(body, None)), per_wg))
            else:
                rs = [i for i in in_loop if i.operands.split(",")[1].strip().startswith("R")]
                # dV, dK from register A (P^T, dS^T); the ws kernel at d = dv = 64 also S^T, dP^T (K_j, V_j in
                # registers: kKVRegs, unless the name turns it off), and in the dQ split dQ^T (K_j^T in registers:
                # kKtRegs); in the query split only the own queries' k16 steps of dV, dK (the other warpgroup's from
                # shared memory: SS)
                kv = name.startswith(S.WS_KERNEL) and S.ws_kv_regs(name)
                kt = name.startswith(S.WS_KERNEL) and S.ws_kt_regs(name)
                qs = name.startswith(S.WS_KERNEL) and S.ws_query_split(name)
                want = ((1 if qs else 2) * (t.block_m // 16) + (pd // 16 + pdv // 16 if kv else 0)
                        + (t.block_n // 16 if kt else 0))
                if len(rs) != want:
                    problems.append("%s: %d RS HGMMA, expected %d" % (name, len(rs), want))
                # m16n8k16-equivalents per warp and visit: an HGMMA 64xNx16 is N/8 of them per warp
                eq = sum(int(re.search(r"64x(\d+)x16", i.opcode + i.operands).group(1)) // 8 for i in in_loop)
                line += "  loop %d instr, %d HGMMA (%d SS + %d RS), %d m16n8k16-eq (%.2f instr each), %d BAR, " \
                        "%d LDGSTS, %d MUFU, %d RED" % (
                            loop.stats.instructions, len(in_loop), len(in_loop) - len(rs), len(rs), eq,
                            loop.stats.instructions / eq, loop.stats.bar, loop.stats.ldgsts, loop.stats.mufu,
                            sum(1 for i in body if i.base.startswith("RED") and loop.start <= i.address <= loop.end))
                if name.startswith(S.WS_KERNEL):
                    more, text = ws_checks(name, t, d, body, loop)
                    problems += more
                    line += text + DQ_WARP_FIGURES.get(name, "")
        rows.append(line)
    print("\n".join(rows))
    assert not problems, "\n".join(problems)


def test_wgmma_backward_compiles_fp16():
    _check(instantiations(np.float16, (64, 128, 256)))


def test_ws_backward_compiles_fp16():
    """The ws kernel's default instantiations, D = 200 among them (padded 256, the accumulator's head dim 208: the
    head-dim split with the consumers' atomics, whose causal producer spilled 4 bytes at 24 registers)."""
    _check(ws_instantiations(np.float16, (64, 128, 256, 200)))


def test_ws_backward_atomic_dq_compiles_fp16():
    """The ws kernel with the consumers' dQ atomics (DQ_BULK off: Is_dq_bulk false), the before of the bulk dQ
    figures (d = 64, 128, and 256, whose staged bulk dQ it replaces)."""
    try:
        S.DQ_BULK = False
        found = ws_instantiations(np.float16, (64, 128, 256))
    finally:
        S.DQ_BULK = True
    assert all(name.endswith("false>") for name in found)
    _check(found)


@pytest.mark.slow
def test_ws_backward_16_byte_epilogue_compiles_fp16():
    """The ws kernel with the 16-byte-store epilogue (USE_TMA_STORE off: Is_tma_store false), the before of the
    TMA-store figures."""
    try:
        S.USE_TMA_STORE = False
        found = ws_instantiations(np.float16, (64, 128, 256))
    finally:
        S.USE_TMA_STORE = True
    _check(found)


@pytest.mark.slow
def test_wgmma_backward_compiles_bf16_and_elementwise():
    found = instantiations(bfloat16, (64, 128, 256), (True, False))
    found.update(instantiations(np.float16, (64, 128, 256), (False,)))
    found.update(ws_instantiations(bfloat16, (64, 128, 256)))
    _check(found)


@pytest.mark.slow
def test_head_dim_split_mixed_dims_compile():
    """The head-dim split with D != Dv (the smaller padded to 128): (256, 128) and (128, 256), both kernels."""
    found = instantiations(np.float16, ((200, 72), (72, 256)))
    found.update(ws_instantiations(np.float16, ((200, 72), (72, 256))))
    _check(found)


def test_ws_dq_buffers_compiles_fp16(monkeypatch):
    """DQ_BUFFERS = 4 (a switch to time, 2 by default): the ws kernel at padded d = 64 (dv 64, 128) with four dQ
    buffers compiles with zero spills and the default's loop checks, its shared memory (166 / 199 KB) within the
    opt-in maximum; d = 128 keeps two (no room) and its default name."""
    monkeypatch.setattr(S, "DQ_BUFFERS", 4)
    found = ws_instantiations(np.float16, (64, (64, 128), 128))
    assert [n.endswith(", 4>") for n in found] == [S.pad_head_dims(*_dims(d))[0] == 64 for _, d in found.values()]
    assert sorted({t.smem for t, _ in found.values()}) == [166024, 198792, 231528]
    _check(found)


def _visit_loop(body, n_hgmma):
    """The shortest loop holding at least ``n_hgmma`` HGMMA (a whole visit's), its instructions and the indices of
    its ``WARPGROUP.DEPBAR`` waits among them; (None, [], []) if there is none."""
    hg = lambda lp: sum(1 for i in body if lp.start <= i.address <= lp.end and i.base == "HGMMA")  # noqa: E731
    loops = [lp for lp in sass.loops(body) if hg(lp) >= n_hgmma]
    if not loops:
        return None, [], []
    loop = min(loops, key=lambda lp: lp.stats.instructions)
    ins = [i for i in body if loop.start <= i.address <= loop.end]
    return loop, ins, [k for k, i in enumerate(ins) if i.opcode.startswith("WARPGROUP.DEPBAR")]


def _check_order(found, order):
    """Compile the ws instantiations ``found`` (sm_90a): zero spills, no wgmma serialization, and no problem
    ``order(body)`` (a visit order check returning (loop instructions, problems)) reports in their SASS."""
    res = nvrtc.compile_cubin(launch.kernel_source(S.SOURCE), "sm_90a", list(found), options=["--use_fast_math"])
    problems = [line for line in res.log.splitlines() if "serializ" in line.lower() or "C7508" in line]
    fns = sass.parse(sass.disassemble(res.cubin)) if SASS_OK else None
    for name in found:
        k = res.kernel(name)
        if k.spill_stores or k.spill_loads or k.stack_frame:
            problems.append("%s: spills %d/%d stack %d" % (name, k.spill_stores, k.spill_loads, k.stack_frame))
        if fns is not None:
            n, more = order(fns[k.lowered_name])
            problems += ["%s: %s" % (name, p) for p in more]
            print("%-100s regs %d, steady loop %d instr" % (name, k.registers, n))
    assert not problems, "\n".join(problems)


def split_overlap_order(body):
    """The steady-state loop of a SPLIT_OVERLAP instantiation (the loop holding a visit's HGMMA) as (loop
    instructions, problems): S^T's and dP^T's 16 + 16 HGMMA issued before the loop's first wait, a ``0x1`` (S^T
    alone), and the two dQ^T blocks' 2 x 4 HGMMA issued after the previous wait and before a ``0x2`` one (the wait for
    the dV_j, dK_j batch behind them)."""
    loop, ins, waits = _visit_loop(body, 48)
    if loop is None:
        return 0, ["no loop holding a visit's HGMMA"]
    problems = []
    first = waits[0] if waits else len(ins)
    if sum(1 for i in ins[:first] if i.base == "HGMMA") != 32 or not waits or not ins[first].operands.endswith("0x1"):
        problems.append("S^T's and dP^T's 32 HGMMA not all issued before a first 0x1 wait")
    dq = [k for a, k in zip(waits, waits[1:]) if ins[k].operands.endswith("0x2")
          and sum(1 for i in ins[a:k] if i.base == "HGMMA" and "64x64x16" in i.opcode + i.operands) == 8]
    if len(dq) != 1:
        problems.append("the dQ^T blocks' 8 HGMMA not issued right before a 0x2 wait")
    return loop.stats.instructions, problems


def test_ws_split_overlap_compiles_fp16(monkeypatch):
    """SPLIT_OVERLAP (off by default: a switch to time): the ws kernel's query split at padded d = 256 (the staged bulk
    dQ and, DQ_BULK off or D = 200, the consumers' atomics) with dP^T issued behind S^T and the dQ^T batches before the
    wait for the dV_j, dK_j batch compiles with zero spills and no wgmma serialization (issued before the wait for the
    own RS batches it serialized: C7512), and its loop has that order (split_overlap_order)."""
    monkeypatch.setattr(S, "SPLIT_OVERLAP", True)
    found = ws_instantiations(np.float16, (256, 200))
    monkeypatch.setattr(S, "DQ_BULK", False)
    found.update(ws_instantiations(np.float16, (256,)))
    assert len(found) == 12 and all(S.ws_split_overlap(n) for n in found), list(found)
    _check_order(found, split_overlap_order)


def scores_ahead_order(body):
    """The steady-state loop of a SCORES_AHEAD instantiation (the shortest loop holding a whole visit's HGMMA) as
    (loop instructions, problems): the previous visit's dQ^T batch and this visit's S^T batch issued back to back,
    then a ``WARPGROUP.DEPBAR.LE gsb0, 0x1`` (dQ^T alone), the dQ tile's STS for the dQ warp, then the ``0x0`` wait
    for S^T: the stores run while S^T computes."""
    loop, ins, waits = _visit_loop(body, 24)
    if loop is None:
        return 0, ["no loop holding a visit's HGMMA"]
    first = waits[0] if waits else len(ins)
    issued = sum(1 for i in ins[:first] if i.base == "HGMMA")
    problems = []
    if issued != 8 + 4 or not waits or not ins[first].operands.endswith("0x1"):
        problems.append("%d HGMMA before the loop's first wait (%s), expected dQ^T's 8 and S^T's 4 before a 0x1"
                        % (issued, ins[first].operands if waits else "none"))
    elif len(waits) < 2 or not ins[waits[1]].operands.endswith("0x0") or \
            sum(1 for i in ins[first:waits[1]] if i.base == "STS") < 16:
        problems.append("the dQ tile's STS not between the 0x1 wait and S^T's 0x0 wait")
    return loop.stats.instructions, problems


def test_ws_scores_ahead_compiles_fp16(monkeypatch):
    """SCORES_AHEAD (off by default: a switch to time): the ws kernel's dQ split at padded d = 64 (dv 64 and 128)
    with S^T issued behind the previous visit's dQ^T, K_j^T in registers, compiles with zero spills and no wgmma
    serialization (it did not before the visit took FlashAttention-3's order: 48-60 bytes, C7512), and its loop issues
    the two batches before waiting for dQ^T alone (scores_ahead_order)."""
    monkeypatch.setattr(S, "SCORES_AHEAD", True)
    found = ws_instantiations(np.float16, (64, (64, 128)))
    assert all(S.ws_scores_ahead(n) and S.ws_kt_regs(n) for n in found), list(found)
    _check_order(found, scores_ahead_order)
