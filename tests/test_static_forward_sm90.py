"""Static checks of the Hopper wgmma forward (cuda_src/flash_fwd_sm90.cu) with NVRTC (no GPU needed).

Every instantiation the tile table (cuda_forward_sm90.forward_tile) picks — float16 and bfloat16,
padded head dims 64, 128, 256, causal and not, cp.async and element-wise loads — compiles for
sm_90a with zero spills, no local stack, no static shared memory, registers x threads within the
register file and dynamic shared memory within the opt-in maximum. In the SASS the key-tile loop
(the loop holding the most HGMMA) holds every HGMMA of the kernel, exactly one key tile's:
d/16 HGMMA for S (SS: both operands through descriptors) plus Bc/16 for O (RS: P from registers).
ptxas reports no wgmma serialization. The warp-specialized kernel with the intra-warpgroup overlap (the
default) has instead two steady-state loops (masked and unmasked key tiles), each one key tile's HGMMA,
with the softmax between the P V batch's issue and its ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` (overlap_checks);
the one without it (OVERLAP = False) is checked as above. The ws kernel writing O by TMA stores
(Is_tma_store, the default where out is TMA-legal) issues one ``UTMASTG.5D`` per 64 columns of dv after a
``FENCE.VIEW.ASYNC.S`` and waits for them (``DEPBAR.LE SB0``) with no O row stores (one ``STG``: the LSE);
the row-store instantiations have no ``UTMASTG``; every ws instantiation prefetches its maps
(``UTMACCTL.PF``: 3, 4 with the TMA store) (store_checks). Compiling for plain sm_90 is refused at
compile time (``fa::wgmma needs sm_90a``). The registers per thread and the key loop's instructions are
printed (``-s``; docs/hopper.md quotes them). The default run compiles the float16 half; ``-m slow`` the bfloat16 one
too (the same template with the bf16 mma; the CI time budget).
"""
import dataclasses
import re

import numpy as np
import pytest

from flasharray._private import cuda_forward_sm90 as S
from flasharray._private import launch, nvrtc, sass, tiles
from flasharray._private.dtypes import bfloat16
from conftest import flag_set, requires_nvrtc

pytestmark = requires_nvrtc
SASS_OK, SASS_WHY = sass.available()
REGISTER_FILE = 64 * 1024
FLAGS = [(c, a) for c in (False, True) for a in (False, True)]


def instantiations(dtypes, head_dims):
    found = {}
    for dtype in dtypes:
        for d in head_dims:
            t = S.forward_tile(dtype, d, d, 90, kernel="wgmma")
            for causal, aligned in FLAGS:
                found[t.name_expression(causal, aligned)] = t
            # both consumer loops: overlapped (the default) and every batch waited for (OVERLAP = False)
            # one block per work tile (overlapped and not) and, overlapped, the persistent kernel (Is_persistent)
            for overlap, persistent in ((True, False), (False, False), (True, True)):
                for causal in (False, True):
                    # the warp-specialized TMA instantiation (no tensors to refuse it); non-causal: the wide
                    # key tile (WIDE_KEYS) at d 64 / 128
                    ws = S.tma_tile(t, (), causal=causal)
                    assert ws.tma and ws.n_threads == 128 + 2 * ws.block_m and ws.overlap == S.OVERLAP
                    v = dataclasses.replace(ws, overlap=overlap, persistent=persistent,
                                            smem=S.ws_smem_bytes(ws.head_dim, ws.head_dim_v, ws.block_m, ws.block_n,
                                                                 overlap, persistent))
                    found[v.name_expression(causal, True)] = v
                    if overlap == S.OVERLAP:  # + the TMA store of O (Is_tma_store)
                        found[v.name_expression(causal, True, tma_store=True)] = v
                    if S.three_warpgroups(ws, 0) or d != S.THREE_WARPGROUPS_HEAD_DIM:
                        continue
                    # three consumer warpgroups (THREE_WARPGROUPS: Br 192, Bc 128, 512 threads, setmaxnreg 32 / 160)
                    with flag_set(S, "THREE_WARPGROUPS", True):
                        w3 = S.tma_tile(t, (), causal=causal)
                    assert (w3.block_m, w3.block_n, w3.n_threads) == (192, S.THREE_WARPGROUPS_BLOCK_N, 512)
                    v = dataclasses.replace(w3, overlap=overlap, persistent=persistent,
                                            smem=S.ws_smem_bytes(w3.head_dim, w3.head_dim_v, w3.block_m, w3.block_n,
                                                                 overlap, persistent))
                    found[v.name_expression(causal, True)] = v
                    if overlap == S.OVERLAP:
                        found[v.name_expression(causal, True, tma_store=True)] = v
    return found


def is_tma_store(name):
    return name.startswith("flash::flash_fwd_sm90_ws_kernel<") and S.ws_flags(name)[0]


def store_checks(name, t, body):
    """How the ws kernel writes O: with Is_tma_store, dv/64 UTMASTG.5D (one per 64-column box of a consumer
    warpgroup's rows), after a FENCE.VIEW.ASYNC.S (the stmatrix writes visible to the async proxy), followed
    by the wait (DEPBAR.LE SB0, 0x0: cp.async.bulk.wait_group.read 0) and no STG but the LSE's; else none."""
    stores = [i for i in body if i.base == "UTMASTG"]
    # prefetch.tensormap of each map the kernel uses (q, k, v; + o with the TMA store), at its start
    prefetches = [i for i in body if i.opcode == "UTMACCTL.PF"]
    if len(prefetches) != 3 + is_tma_store(name) or (stores and prefetches[-1].address > stores[0].address):
        return ["%s: %d UTMACCTL.PF" % (name, len(prefetches))], ""
    if not is_tma_store(name):
        return ["%s: %d UTMASTG in a row-store instantiation" % (name, len(stores))] if stores else [], ""
    fences = [i for i in body if i.opcode == "FENCE.VIEW.ASYNC.S"]
    waits = [i for i in body if i.opcode.startswith("DEPBAR.LE") and "SB0" in i.operands]
    stg = [i for i in body if i.base == "STG"]
    ok = (len(stores) == t.head_dim_v // 64 and all(i.opcode == "UTMASTG.5D" for i in stores) and
          any(f.address < stores[0].address for f in fences) and
          any(w.address > stores[-1].address for w in waits) and len(stg) <= 1)
    problems = [] if ok else ["%s: %d UTMASTG (%s), fences %s, SB0 waits %s, %d STG" % (
        name, len(stores), sorted({i.opcode for i in stores}), [hex(f.address) for f in fences],
        [hex(w.address) for w in waits], len(stg))]
    return problems, ", %d UTMASTG.5D" % len(stores)


def written_registers(ins):
    """The R registers an instruction writes (its first operand, 2 / 4 of them for 64- / 128-bit results);
    none for stores, barriers and branches."""
    if ins.base.startswith(("ST", "RED", "BAR", "BRA", "SYNCS", "WARPGROUP")):
        return set()
    m = re.match(r"\s*R(\d+)\b", ins.operands)
    if not m:
        return set()
    width = 4 if ".128" in ins.opcode else 2 if (".64" in ins.opcode or ".WIDE" in ins.opcode) else 1
    return {int(m.group(1)) + k for k in range(width)}


def is_rs(ins):
    return ins.base == "HGMMA" and ins.operands.split(",")[1].strip().startswith("R")


def overlap_checks(name, t, body):
    """The overlapped consumer loop (Is_overlap): two steady-state loops (masked tiles, then unmasked ones),
    each one key tile's HGMMA — d/16 SS for S_i, then Bc/16 RS for P_{i−1} V_{i−1} — with no nested loop.
    In each: the WARPGROUP.DEPBAR.LE gsb0, 0x1 after the RS batch (S_i done), every MUFU.EX2 and FMNMX of
    the softmax after it, no 0x0 wait between the RS batch and the back edge (the P V batch stays in
    flight through the softmax; its 0x0 wait is at the top of the next visit, before the S batch), and no
    instruction in flight range (after the RS batch to the end, from the top to the 0x0 wait) writing a
    register the RS HGMMAs read or accumulate (A fragments, O). Returns (problems, steady loops)."""
    problems = []
    per_tile_ss, per_tile_rs = t.head_dim // 16, t.block_n // 16
    ss_all = [i for i in body if i.base == "HGMMA" and not is_rs(i)]
    rs_all = [i for i in body if is_rs(i)]
    if (len(ss_all), len(rs_all)) != (3 * per_tile_ss, 3 * per_tile_rs):  # visit 0, two loops, the last P V
        problems.append("%s: %d SS + %d RS HGMMA, expected %d + %d" % (name, len(ss_all), len(rs_all),
                                                                     3 * per_tile_ss, 3 * per_tile_rs))
    steady = [lp for lp in sass.loops(body) if lp.nested == 0 and
              sum(1 for i in ss_all if lp.start <= i.address <= lp.end) == per_tile_ss and
              sum(1 for i in rs_all if lp.start <= i.address <= lp.end) == per_tile_rs]
    if len(steady) != 2:
        return problems + ["%s: %d steady-state loops, expected 2 (masked, unmasked)" % (name, len(steady))], steady
    for lp in steady:
        ins = [i for i in body if lp.start <= i.address <= lp.end]
        ss = [i for i in ins if i.base == "HGMMA" and not is_rs(i)]
        rs = [i for i in ins if is_rs(i)]
        waits = [i for i in ins if i.opcode.startswith("WARPGROUP.DEPBAR")]
        w1 = [i for i in waits if i.operands.replace(" ", "").endswith("0x1")]
        w0 = [i for i in waits if i.operands.replace(" ", "").endswith("0x0")]
        soft = [i for i in ins if i.opcode.startswith("MUFU.EX2") or i.base == "FMNMX"]
        ok = (len(w1) == 1 and len(w0) == 1 and w0[0].address < ss[0].address and ss[-1].address < rs[0].address
              and rs[-1].address < w1[0].address and soft and w1[0].address < soft[0].address)
        if not ok:
            problems.append("%s: loop %x-%x: waits %s, softmax not between the RS batch's issue and its wait"
                            % (name, lp.start, lp.end, [(hex(i.address), i.operands) for i in waits]))
            continue
        operands = set()
        for i in rs:
            acc, a = (int(r[1:]) for r in sass_registers(i.operands)[:2])  # "64x{dv}x16.F32 R<O>, R<A>, ..."
            operands |= set(range(acc, acc + t.head_dim_v // 2)) | set(range(a, a + 4))
        in_flight = [i for i in ins if i.address > rs[-1].address or i.address < w0[0].address]
        clobbers = [i for i in in_flight if written_registers(i) & operands]
        if clobbers:
            problems.append("%s: loop %x-%x: %s writes an in-flight RS operand" % (name, lp.start, lp.end,
                                                                                 clobbers[0].opcode))
    return problems, steady


def ws_checks(name, t, body, loop):
    """The warp-specialized kernel: setmaxnreg took effect (both USETMAXREG, registers above the launch
    count used after the .inc), the key loop free of copies, its only barriers the ping-pong's named
    ones around the S batch (overlapped: around the S and P V batches), the producer loop (the
    smallest loop holding UTMALDG and both expect-tx arrivals) issuing one tile's boxes per visit and
    waiting on mbarriers."""
    problems = []
    ops = {i.opcode for i in body}
    for op in ("USETMAXREG.DEALLOC.CTAPOOL", "USETMAXREG.TRY_ALLOC.CTAPOOL", "ELECT", "UTMALDG.5D"):
        if op not in ops:
            problems.append("%s: no %s" % (name, op))
    # no copies; the only barriers the ping-pong's named ones: BAR.SYNC (our turn) before the S HGMMAs,
    # BAR.ARV (the other warpgroup's turn) after the last S HGMMA and before the wait for them
    in_loop = [i for i in body if loop.start <= i.address <= loop.end]
    bars = [i for i in in_loop if i.base == "BAR"]
    ss = [i for i in in_loop if i.base == "HGMMA" and not i.operands.split(",")[1].strip().startswith("R")]
    waits = [i for i in in_loop if i.opcode.startswith("WARPGROUP.DEPBAR") and ss and i.address > ss[-1].address]
    if (loop.stats.ldgsts or [b.opcode.split(".")[1] for b in bars] != ["SYNC", "ARV"] or not waits
            or not bars[0].address < ss[0].address or not ss[-1].address < bars[1].address < waits[0].address):
        problems.append("%s: %d LDGSTS, barriers %s in the key loop" % (name, loop.stats.ldgsts,
                                                                        [b.opcode for b in bars]))
    tma = [i for i in body if i.base == "UTMALDG"]
    lps = [lp for lp in sass.loops(body) if any(lp.start <= i.address <= lp.end for i in tma)]
    if not lps:
        return problems + ["%s: no producer loop" % name], ""
    # the smallest holding both expect-tx arrivals (K's and V's full barriers): the overlapped kernel's
    # visit waits on two empty barriers, and a span between those spins holds V's boxes only
    expect_tx = [i for i in body if i.opcode.startswith("SYNCS.ARRIVE.TRANS64") and ".A1T0" not in i.opcode]
    lps = [lp for lp in lps if sum(1 for i in expect_tx if lp.start <= i.address <= lp.end) >= 2] or lps
    producer = min(lps, key=lambda lp: lp.stats.instructions)
    boxes = sum(1 for i in tma if producer.start <= i.address <= producer.end)
    # persistent: Q's boxes (issued after the tile's first K, on a branch) lie inside the visit loop too, or (as
    # ptxas lays out d 256) in a loop beside it with one tile's K and V boxes, whose back edge is the next work tile's
    kv_boxes, q_boxes = (t.head_dim + t.head_dim_v) // 64, (t.head_dim // 64 if t.persistent else 0)
    around = any(sum(1 for i in tma if lp.start <= i.address <= lp.end) == kv_boxes + q_boxes for lp in lps)
    if boxes != kv_boxes + q_boxes and not (t.persistent and boxes == kv_boxes and around):
        problems.append("%s: %d UTMALDG in the producer loop, expected %d" % (name, boxes, kv_boxes + q_boxes))
    regs = max((int(r[1:]) for i in body for r in sass_registers(i.operands)), default=0) + 1
    # Registers used anywhere (the consumers' code after setmaxnreg.inc): within the raised count; at
    # d = 256 (O alone 128 per thread) above the 168 of the launch, i.e. the .inc is what makes it fit; with
    # three consumer warpgroups (512 threads: 128 at launch), overlapped (P_{j-1} held), above 128 too.
    consumer = S.ws_registers(t.block_m)[1]
    launch_regs = REGISTER_FILE // t.n_threads // 8 * 8
    if regs > consumer or ((t.head_dim_v == 256 or (t.block_m == 192 and t.overlap)) and regs <= launch_regs):
        problems.append("%s: registers up to R%d (launch %d, setmaxnreg.inc %d)" % (name, regs - 1, launch_regs,
                                                                                  consumer))
    return problems, "  producer loop %d instr (%d UTMALDG), consumer registers up to %d" % (
        producer.stats.instructions, boxes, regs)


def sass_registers(operands):
    return re.findall(r"\bR\d+\b", operands)


def hgmma_in(body, loop):
    return [i for i in body if i.base == "HGMMA" and (loop is None or loop.start <= i.address <= loop.end)]


def hgmma_key_loop(body):
    """The loop holding the most HGMMA; of those the one with the fewest instructions (sass.key_loop's rule)."""
    lps = [lp for lp in sass.loops(body) if hgmma_in(body, lp)]
    return min(lps, key=lambda lp: (-len(hgmma_in(body, lp)), lp.stats.instructions)) if lps else None


def _check(dtypes, head_dims):
    found = instantiations(dtypes, head_dims)
    res = nvrtc.compile_cubin(launch.kernel_source(S.SOURCE), "sm_90a", list(found), options=["--use_fast_math"])
    fns = sass.parse(sass.disassemble(res.cubin)) if SASS_OK else None
    problems, rows = [], []
    # ptxas's advisory when it has to serialize wgmma (e.g. accumulators touched across the pipeline)
    problems += [line for line in res.log.splitlines() if "serializ" in line.lower()]
    for name, t in found.items():
        k = res.kernel(name)
        occ = sass.occupancy(90, k.registers, t.n_threads, t.smem)
        line = "%-70s regs %3d spill %d/%d smem %6d  %d block(s)/SM (%s)" % (
            name, k.registers, k.spill_stores, k.spill_loads, t.smem, occ.blocks, occ.limiter)
        if k.spill_stores or k.spill_loads or k.stack_frame or k.static_smem:
            problems.append("%s: spills %d/%d stack %d static smem %d" % (name, k.spill_stores, k.spill_loads,
                                                                         k.stack_frame, k.static_smem))
        # the warp-specialized kernel: the launch count fits its threads; after setmaxnreg 24 + 2 x 240
        # (three consumers: 32 + 3 x 160) per slot
        if (k.registers * t.n_threads > REGISTER_FILE or t.smem > tiles.smem_limit(90) or occ.blocks < 1 or
                t.tma and S.ws_registers(t.block_m)[0] + t.block_m // 64 * S.ws_registers(t.block_m)[1]
                > REGISTER_FILE // 128):
            problems.append("%s: %d regs x %d threads, %d bytes smem" % (name, k.registers, t.n_threads, t.smem))
        if fns is not None and t.tma:
            more, text = store_checks(name, t, fns[k.lowered_name])
            problems += more
            line += "  %d instr%s" % (len(fns[k.lowered_name]), text)
        if fns is not None and t.overlap:
            body = fns[k.lowered_name]
            more, steady = overlap_checks(name, t, body)
            problems += more
            if len(steady) == 2:
                masked, loop = sorted(steady, key=lambda lp: -lp.stats.instructions)
                in_loop = hgmma_in(body, loop)
                line += ("  key loops (masked / unmasked) %d / %d instr, %d HGMMA (%d SS + %d RS), %d BAR, %d MUFU, "
                         "softmax overlapped" % (masked.stats.instructions, loop.stats.instructions, len(in_loop),
                                                 t.head_dim // 16, t.block_n // 16, loop.stats.bar, loop.stats.mufu))
                more, text = ws_checks(name, t, body, loop)
                problems += more
                line += text
        elif fns is not None:
            body = fns[k.lowered_name]
            loop = hgmma_key_loop(body)
            expected = t.head_dim // 16 + t.block_n // 16
            in_loop = hgmma_in(body, loop)
            if loop is None or len(in_loop) != expected or len(hgmma_in(body, None)) != expected:
                problems.append("%s: %d HGMMA in the key loop, %d in all, expected %d"
                                % (name, len(in_loop), len(hgmma_in(body, None)), expected))
            else:
                rs = [i for i in in_loop if i.operands.split(",")[1].strip().startswith("R")]
                if len(rs) != t.block_n // 16:
                    problems.append("%s: %d register-A (RS) HGMMA, expected %d" % (name, len(rs), t.block_n // 16))
                line += "  key loop %d instr, %d HGMMA (%d SS + %d RS), %d BAR, %d LDGSTS, %d MUFU" % (
                    loop.stats.instructions, len(in_loop), len(in_loop) - len(rs), len(rs), loop.stats.bar,
                    loop.stats.ldgsts, loop.stats.mufu)
                if t.tma:
                    more, text = ws_checks(name, t, body, loop)
                    problems += more
                    line += text
        rows.append(line)
    print("\n".join(rows))
    assert not problems, "\n".join(problems)


def test_wgmma_forward_compiles_fp16():
    _check((np.float16,), (64, 128, 192, 256))


@pytest.mark.slow   # the fp16 kernels' template with the bf16 mma (fp16: default run); the CI time budget
def test_wgmma_forward_compiles_bf16():
    _check((bfloat16,), (64, 128, 192, 256))


def test_sm90_without_a_refused():
    t = S.forward_tile(np.float16, 64, 64, 90, kernel="wgmma")
    with pytest.raises(nvrtc.NvrtcError, match="fa::wgmma needs sm_90a"):
        nvrtc.compile_cubin(launch.kernel_source(S.SOURCE), "sm_90", [t.name_expression(False, True)])
