"""The Hopper backward on wgmma (cuda_src/flash_bwd_sm90.cu, issue 13) on the emulator (arch sm_90).

``cuda_backward.backward(..., kernel="wgmma", arch="sm_90")`` runs the preprocess, the wgmma dK/dV
kernel (atomic dQ into DQAccumLayout: in key-block order when deterministic, the "ordered" mode) and
the conversion pass; dq, dk, dv are checked against the float64 reference backward with DESIGN.md's
rule (``testing.assert_attention_close``, as tests/test_cuda_backward.py). Each case asserts that the
wgmma kernel ran: its launch names ``flash_bwd_sm90_dkv_kernel`` and the emulator's ``wgmma`` counter
equals the count the tiling implies. The ordered mode gives identical bits under permuted schedules.
Both atomic modes (plain, ``deterministic=False``, and ordered) take the warp-specialized TMA kernel
``flash_bwd_sm90_ws_kernel`` where q, dout, k, v fit tensor maps (else the cp.async kernel): its
counters show TMA boxes and no cp.async, three setmaxnreg and one elect.sync per block (ordered: one
group-semaphore wait per visit), and its gradients carry the bits of the cp.async kernel — in the
ordered mode with several key blocks per dQ element, under permuted schedules. Head dims above 128 take the
head-dim split (Bc = 64, each warpgroup half of d, dv): D = 256, 200 / 72, 72 / 256, 250 (element-wise) by
default, D = 160 and 256 in the ``-m slow`` matrix. ``-m slow``: more shapes.
"""
import numpy as np
import pytest

from flasharray._private import cuda_backward as cb
from flasharray._private import cuda_backward_sm90 as S
from flasharray._private import cuda_forward, launch
from flasharray._private.dtypes import bfloat16
from flasharray.testing import check_attention
from conftest import thin
from test_cuda_backward import FULL, DTYPE_NAMES, Problem, check, check_case, run_backward
from test_emulator_memstats import aligned_array


def expected_wgmma(p, tile, n_entries_kv, n_group, dq_split=False):
    """wgmma instructions of one dK/dV launch: per key block, its visited query blocks (causal: from the
    first that sees it) times the query heads of its group; per visit and warpgroup (two: of 64 keys each,
    or in the head-dim split both of the Bc = 64 keys) d/16 (S^T) + dv/16 (dP^T) + 2·Br/16 (dV, dK), plus
    Bc/16 for each of the d/64 m64 blocks of dQ^T, or (``dq_split``: the ws kernel's dQ query split at d = 64) for
    each warpgroup's half of the queries."""
    Lq, D = p.q.shape[-2:]
    Lk, Dv = p.v.shape[-2:]
    d, dv = S.pad_head_dims(D, Dv)
    Br, Bc = tile.block_m, tile.block_n
    assert Bc == (S.BLOCK_N_SPLIT if S.is_split(D, Dv) else S.BLOCK_N)
    per_visit = 2 * (d // 16 + dv // 16 + 2 * Br // 16) + (2 if dq_split else d // 64) * (Bc // 16)
    Tr = -(-Lq // Br)
    visits = 0
    for c0 in range(0, Lk, Bc):
        first = max(0, c0 - (Lk - Lq)) if p.causal else 0
        visits += Tr - first // Br
    return visits * per_visit * n_group * n_entries_kv


def template_flags(name):
    """The trailing bool template arguments of a kernel name, in order."""
    args = [a.strip() for a in name[name.index("<") + 1:-1].split(",")]
    while args and args[-1] not in ("true", "false"):
        args.pop()
    i = len(args)
    while i and args[i - 1] in ("true", "false"):
        i -= 1
    return [a == "true" for a in args[i:]]


def run_wgmma(p, *, deterministic=True, dkv_names=None, **opts):
    """The wgmma backward on the emulator: (dq, dk, dv), the dK/dV kernel's counters (``dkv_names``: a list the
    kernel's name is appended to)."""
    res = run_backward("emulator", p, deterministic=deterministic, kernel="wgmma", arch="sm_90",
                       return_counters=True, **opts)
    grads, counters = res[:3], res[3]
    names = [n for n, _ in counters]
    dkv = [(n, c) for n, c in counters if n.startswith((S.KERNEL, S.WS_KERNEL))]
    assert len(dkv) == 1, names
    name, c = dkv[0]
    if dkv_names is not None:
        dkv_names.append(name)
    ws = name.startswith(S.WS_KERNEL)
    # (ws: the first eleven template arguments; kExt, kKVRegsOn, kQSplitOn, kEntriesFirstOn, kDQSplitOn follow)
    flags = template_flags(", ".join(name.split(", ")[:11]) + ">" if ws and name.count(", ") >= 11 else name)
    assert flags[-3 if ws else -1] == deterministic, name  # ordered or not
    if ws:  # TMA boxes, no copy instruction, registers moved
        assert c.cp_async == 0 and c.tma_loads > 0 and c.setmaxnreg == 3 * c.blocks and c.elects == c.blocks
    else:
        assert c.tma_loads == 0 and c.setmaxnreg == 0
    # Is_tma_store: one TMA store per 64 columns of D and of Dv per block (dK_j, dV_j); none otherwise
    D, Dv = p.q.shape[-1], p.v.shape[-1]
    assert c.tma_stores == (c.blocks * (-(-D // 64) + -(-Dv // 64)) if ws and flags[-2] else 0), name
    # Is_dq_bulk: dQ by the dQ warp's bulk reduce-adds, no atomic anywhere
    assert (ws and flags[-1]) == (ws and S.dq_bulk(*S.pad_head_dims(D, Dv), -(-D // 16) * 16)), name
    if ws and flags[-1]:
        assert c.atomics == 0, name
    if not deterministic:
        assert c.sem_waits == 0
    return grads, c


CASES = [  # dtype, D, Dv, (Lq, Lk), causal, bcast, layout, deterministic, TMA (warp-specialized) kernel
    (np.float16, 64, 64, (65, 127), True, "none", "bhsd", True, True),
    (bfloat16, 128, 128, (17, 63), False, "none", "bhsd", False, True),
    (np.float16, 40, 72, (130, 70), True, "gqa", "bshd", True, True),
    (bfloat16, 59, 59, (64, 150), False, "none", "bhsd", True, False),  # element-wise loads (rows not 16-byte aligned)
    (bfloat16, 128, 128, (40, 300), False, "none", "bhsd", True, True),  # ordered ws: 3 key blocks per dQ element
    (np.float16, 128, 64, (129, 65), True, "none", "bhsd", False, True),  # Lq > Lk: rows that see no key
    (np.float16, 40, 72, (70, 130), True, "gqa", "bshd", False, True),  # TMA: group dim + BSHD strides in the maps
    (bfloat16, 59, 59, (20, 40), False, "none", "bhsd", False, False),  # not TMA-legal (118-byte rows): cp.async
    # Head dims above 128: the head-dim split (Bc = 64, each warpgroup half of d, dv).
    (np.float16, 256, 256, (65, 127), True, "none", "bhsd", True, True),  # ordered ws, tails
    (bfloat16, 256, 256, (40, 200), False, "none", "bhsd", False, True),  # atomic ws, 4 key blocks
    (np.float16, 200, 72, (130, 70), True, "gqa", "bshd", True, True),  # GQA, dv padded to 128
    (bfloat16, 250, 250, (64, 150), False, "none", "bhsd", True, False),  # element-wise loads (500-byte rows)
    (np.float16, 72, 256, (40, 150), False, "none", "bhsd", False, True),  # d padded to 128, dv 256
]
SLOW = [
    (dt, D, D, lengths, causal, bcast, "bhsd", det, None)
    for dt in (np.float16, bfloat16) for D in (16, 64, 96, 128, 160, 256)
    for lengths in ((1, 1), (64, 64), (113, 203), (257, 128)) for causal in (False, True)
    for bcast, det in (("none", True), ("mqa", False), ("gqa", False))
]


def _case_problem(dtype, D, Dv, lengths, causal, bcast, layout):
    """The Problem of a ws-kernel case row: two entries of one head unless K/V are broadcast (GQA / MQA)."""
    small = None if bcast != "none" else (1, 2)
    return Problem(dtype, D, *lengths, causal=causal, bcast=bcast, layout=layout, Dv=Dv, batch_q=small, batch_k=small)



def _check_case(dtype, D, Dv, lengths, causal, bcast, layout, deterministic, tma=None):
    p = _case_problem(dtype, D, Dv, lengths, causal, bcast, layout)
    grads, c = run_wgmma(p, deterministic=deterministic)
    check(p, grads)
    plan = cb.plan(*p.args("emulator"), causal=p.causal, scale=p.scale, batch_shape=p.batch_shape,
                   device="emulator", deterministic=deterministic, kernel="wgmma", arch="sm_90")
    assert plan.kernel == "wgmma" and plan.dq_mode == ("ordered" if deterministic else "atomic")
    assert tma is None or plan.tma == tma
    tile = S.backward_tile(None, p.dtype, D, Dv, 90)
    n_group = plan.group[1]
    n_entries_kv = int(np.prod([p.batch_shape[i] for i in plan.grid_b])) if plan.grid_b else 1
    dq_split = plan.tma and S.DQ_SPLIT and S.dq_split(D, Dv)
    assert c.wgmma == expected_wgmma(p, tile, n_entries_kv, n_group, dq_split) > 0


@pytest.mark.parametrize("case", thin(CASES), ids=lambda c: "-".join(str(x) for x in c))
def test_wgmma_backward_matches_reference(case):
    _check_case(*case)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW, ids=lambda c: "-".join(str(x) for x in c))
def test_wgmma_backward_matrix(case):
    _check_case(*case)


@pytest.mark.parametrize("D,schedule,seed", [(64, "reverse", 0), (64, "random", 3), (256, "reverse", 0),
                                             (256, "random", 7)])
def test_wgmma_backward_ordered_bits_identical_under_schedules(D, schedule, seed):
    """Ordered dQ (deterministic): the same bits whatever the block / warp interleaving (D = 256: the
    head-dim split, 5 key blocks adding to every dQ element, each warpgroup its half of the head dims)."""
    p = Problem(np.float16, D, 70, 300, causal=False, batch_q=(1, 1), batch_k=(1, 1))
    base, _ = run_wgmma(p)
    got, _ = run_wgmma(p, schedule=schedule, seed=seed)
    for a, b in zip(base, got):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


def _ws_vs_cp_async(p, deterministic=False, cp_opts=None, **opts):
    """The warp-specialized kernel's gradients and the cp.async kernel's on the same inputs (``cp_opts``:
    the cp.async run's emulator options, default ``opts``)."""
    ws, c = run_wgmma(p, deterministic=deterministic, **opts)
    assert c.tma_loads > 0
    try:
        S.USE_TMA = False
        launch._clear_plans()
        cp, c = run_wgmma(p, deterministic=deterministic, **(opts if cp_opts is None else cp_opts))
    finally:
        S.USE_TMA = True
        launch._clear_plans()
    assert c.cp_async > 0
    return ws, cp


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in FULL if c[0] in ("fp16", "bf16") and c[1] == 256],
                         ids=lambda c: "-".join(str(x) for x in c))
def test_wgmma_backward_tc_matrix_d256(case):
    """The mma.sync backward's emulator matrix (tests/test_cuda_backward.py, FULL), its fp16 / bf16 D = 256
    rows on kernel="wgmma" (issue 13's "done when"): every length pair, causal and not, no broadcast / GQA /
    MQA, BHSD and BSHD, ordered and plain atomic dQ."""
    dt, D, lengths, causal, bcast, layout, det = case
    check_case("emulator", DTYPE_NAMES[dt], D, lengths, causal, bcast, layout, det, kernel="wgmma", arch="sm_90")


@pytest.mark.parametrize("schedule,seed", [("forward", 0), ("reverse", 0), ("random", 5)])
def test_ws_kernel_bits_match_cp_async(schedule, seed):
    """One key block per K/V head (each dQ element added once per query block: no order to vary): the
    warp-specialized kernel gives the cp.async kernel's bits for dq, dk and dv, whatever the landing
    points of the TMA boxes and the producer / consumer interleaving (GQA: the group walked in the block,
    its coordinate through tma_sel; BSHD views: strided maps)."""
    p = Problem(np.float16, 64, 150, 100, causal=True, bcast="gqa", layout="bshd", batch_q=(1, 2, 2),
                batch_k=(1, 2, 1))
    ws, cp = _ws_vs_cp_async(p, schedule=schedule, seed=seed)
    for a, b in zip(ws, cp):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


@pytest.mark.parametrize("D,schedule,seed", [(64, "forward", 0), (64, "reverse", 0), (64, "random", 3),
                                             (64, "random", 11), (256, "random", 5)])
def test_ws_ordered_bits_match_cp_async(D, schedule, seed):
    """Ordered dQ on the warp-specialized kernel (the group semaphore: consumers only): three key blocks
    (D = 256: five, of 64 keys) add to every dQ element, in key-block order whatever the block order, the
    producer / consumer interleaving and the landing points of the TMA boxes, so dq, dk and dv carry the
    bits of the cp.async kernel's ordered mode (run under the forward schedule)."""
    p = Problem(np.float16, D, 70, 300, causal=False, batch_q=(1, 1), batch_k=(1, 1))
    ws, cp = _ws_vs_cp_async(p, deterministic=True, cp_opts={}, schedule=schedule, seed=seed)
    for a, b in zip(ws, cp):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


@pytest.mark.parametrize("D,tma", [(128, True), (64, False), (256, True), (256, False)])
def test_dk_dv_epilogue_coalesced(D, tma):
    """The dK_j / dV_j epilogue through shared memory: each warp stmatrix.x4 per 16 of its columns of dK_j and
    dV_j, then 16-byte stores of whole rows: the global sectors of dk and dv are the ideal count (before:
    2-byte stores straight from the fragments, 4x the sectors). Lk = 63 and 100: a tile's rows past Lk are not
    stored. (The cp.async kernel at d = 128 keeps the fragment stores: registers, flash_bwd_sm90.cu.) Every
    stmatrix, the ws kernel's dS^T ones included, is free of bank conflicts."""
    Lk = 100 if D == 256 else 63
    p = Problem(np.float16, D, 70, Lk, causal=False, batch_q=(1, 2), batch_k=(1, 2))
    try:
        S.USE_TMA = tma
        launch._clear_plans()
        grads, c = run_wgmma(p, deterministic=False)
    finally:
        S.USE_TMA = True
        launch._clear_plans()
    check(p, grads)
    kv = [c.buffers[i] for i in sorted(c.buffers)][7:9]  # the arguments dk, dv (after q, k, v, dout, lse, delta, dq)
    for b in kv:
        assert b.write_bytes == 2 * Lk * D * 2 and b.write_sectors == b.write_sectors_ideal == b.write_bytes // 32
    d, dv = S.pad_head_dims(D, D)
    per_warp = (d + dv) // 16 // (2 if S.is_split(D, D) else 1)  # its 16 keys x (its half of) d and dv
    # (the ws kernel also stages dS^T by stmatrix, and in the query split P^T: 4 per warp and visit, 2 visits per
    # block: the query blocks of Lq = 70)
    ds = 2 * 8 * 4 if tma else 0
    assert c.stmatrix == c.blocks * (8 * per_warp + ds)  # 8 math warps per block
    assert c.stmatrix_wavefronts == c.stmatrix_wavefronts_ideal == 4 * c.stmatrix  # x4, no bank conflict



@pytest.mark.parametrize("D", [64, 128, 256])
def test_ws_ds_stmatrix_conflict_free(D):
    """The ws kernel stages dS^T by stmatrix.x4, one per k16 step (d 64: the dQ split's 64B-swizzled half tiles;
    d 128: the 128B-swizzled tile; d 256, the query split: P^T and dS^T of the warpgroup's two own steps), without
    bank conflicts; the gradients as the reference's. Lq = 130: 3 query blocks, causal; 8 consumer warps, 4
    stmatrix each per visit; plus the epilogue's (d 256: each warpgroup half of the head dims)."""
    p = Problem(np.float16, D, 130, 200, causal=True, batch_q=(1, 1), batch_k=(1, 1))
    grads, c = run_wgmma(p, deterministic=True, schedule="random", seed=4)
    check(p, grads)
    bc = 64 if D == 256 else 128
    visits = sum(len([i for i in range(3) if i * 64 + 63 + 200 - 130 >= n * bc]) for n in range(-(-200 // bc)))
    assert c.stmatrix == visits * 8 * 4 + c.blocks * 8 * (2 * D // 16) // (2 if D == 256 else 1)
    assert c.stmatrix_wavefronts == c.stmatrix_wavefronts_ideal == 4 * c.stmatrix

def test_ws_ordered_counts_one_wait_per_visit():
    """Per visit one group-semaphore wait (the leader's) and two consumer barriers (the wait's, the post's):
    3 key blocks x 2 query blocks x 2 heads (causal, bottom-right: every key block sees both query blocks);
    per block two more, the dK / dV epilogue's (operands idle, staged tiles complete)."""
    p = Problem(np.float16, 64, 70, 300, causal=True, batch_q=(1, 2), batch_k=(1, 2))
    _, c = run_wgmma(p, schedule="reverse")
    # Is_dq_bulk (DQ_BULK): the dQ warp takes the turn (its group barrier twice per visit), the consumers keep
    # one barrier per visit (dS^T staged)
    visit_bars = 12 + 2 * 12 if S.DQ_BULK else 2 * 12
    assert c.sem_waits == 12 and c.named_barriers == visit_bars + 2 * 6 and c.blocks == 6


def test_ws_plan_maps():
    """The plan's dK/dV launch: 384 threads, the ws tile's shared memory, four tensor maps (q, dout: box
    64 x Br; k, v: 64 x Bc; 128-byte swizzle) and tma_sel naming the group dim for q, dout."""
    p = Problem(np.float16, 40, 70, 130, causal=False, bcast="gqa", layout="bshd")
    plan = cb.plan(*p.args("emulator"), causal=False, scale=p.scale, batch_shape=p.batch_shape, device="emulator",
                   deterministic=False, kernel="wgmma", arch="sm_90")
    assert plan.tma
    rec = [r for r in plan.launches if r.name.startswith(S.WS_KERNEL)]
    assert len(rec) == 1 and rec[0].block == (384, 1, 1)
    maps = [a for a in rec[0].template if isinstance(a, launch.Map)]
    assert [m.key for m in maps] == ["q", "dout", "k", "v", "dk", "dv"]
    assert [m.template.box_dim for m in maps] == [(64, 64, 1, 1, 1)] * 2 + [(64, 128, 1, 1, 1)] * 4
    assert all(m.template.swizzle == 128 for m in maps)
    # dk, dv (the epilogue's TMA stores): the outputs' D / Dv columns and Lk rows (rows past Lk clipped)
    assert [m.template.global_dim[:2] for m in maps[4:]] == [(40, 130), (40, 130)]
    sel = int(rec[0].template[-7])
    assert sel & 7 == 1 and (sel >> 9) & 7 == 1  # q, dout: first batch dim of the map = the group entry
    assert all((sel >> (9 * m)) & 7 != 1 for m in (2, 3, 4, 5))  # k, v, dk, dv: no group
    t = S.ws_tile(S.backward_tile(None, np.float16, 40, 40, 90), 40, 40)
    # (+ the bulk dQ's buffers of Br x d floats with two mbarriers each and dq_accum's batch offset)
    dq = S.dq_buffers(64, 64) * (64 * 64 * 4 + 16) + (8 if S.DQ_BULK else 0)
    # (+ the ordered mode's turn slot: the counters' base and DQOrder's three ints, S.TURN_BYTES)
    assert t.n_threads == 384 and t.smem == S.ws_smem_bytes(64, 64) == (
        S.smem_bytes(64, 64) + 128 * 64 * 2 + 40 + S.TURN_BYTES + dq)


def test_wgmma_backward_tile():
    t = S.backward_tile(None, np.float16, 128, 128, "sm_90")
    assert (t.block_m, t.block_n, t.n_threads, t.stages) == (64, 128, 256, 2)
    assert t.smem == S.smem_bytes(128, 128) == 2 * (128 * 256 + 2 * 64 * 256 + 128 * 64) + 2 * 2 * 64 * 4 + 1024
    name = cb.kernel_plan(np.float16, 40, 72, causal=True, deterministic=False, arch=90, kernel="wgmma",
                          ordered=True)["dkv"][1]
    assert name == "flash_bwd_sm90_dkv_kernel<fa_half, fa_half, 64, 128, 48, 64, 128, true, true, true>"
    ks = cb.kernel_plan(np.float16, 40, 72, causal=True, deterministic=False, arch=90, kernel="wgmma", tma=True)
    assert ks["dkv"][1] == "flash_bwd_sm90_ws_kernel<fa_half, fa_half, 64, 128, 48, 64, 128, true, false, true, true>"
    assert ks["dkv"][2].n_threads == 384
    ks = cb.kernel_plan(np.float16, 40, 72, causal=True, deterministic=False, arch=90, kernel="wgmma", tma=True,
                        ordered=True)
    assert ks["dkv"][1] == "flash_bwd_sm90_ws_kernel<fa_half, fa_half, 64, 128, 48, 64, 128, true, true, true, true>"
    ks = cb.kernel_plan(np.float16, 40, 72, causal=True, deterministic=False, arch=90, kernel="wgmma", tma=True,
                        acc_dkv=True)  # fp32 partial sums (K/V broadcast over the grid): no TMA store
    assert ks["dkv"][1] == "flash_bwd_sm90_ws_kernel<fa_half, float, 64, 128, 48, 64, 128, true, false, false, true>"


def test_wgmma_backward_tile_head_dim_split():
    """D or Dv above 128: Bc = 64 keys seen by both warpgroups (256 threads; ws: 384), each owning half of
    the head dims; the other head dim padded to at least 128 (whole panels per half)."""
    t = S.backward_tile(None, np.float16, 256, 256, "sm_90")
    assert (t.block_m, t.block_n, t.n_threads, t.stages) == (64, 64, 256, 2)
    # (the cp.async kernel: + dk's and dv's batch offsets for the epilogue, 16 bytes; the ws kernel has its own)
    assert t.smem == S.smem_bytes(256, 256, 64, 64) == 2 * (64 * 512 + 2 * 64 * 512 + 64 * 64) + 2 * 2 * 64 * 4 + 1024 + 16
    w = S.ws_tile(t, 256, 256)
    # (+ the second dS^T buffer, P^T per stage for the query split, the mbarriers (5, and the staged bulk dQ's
    # dq_full per stage: 2), the turn, the batch offsets)
    assert w.n_threads == 384 and w.smem == t.smem - 16 + 64 * 64 * 2 * 3 + 56 + S.TURN_BYTES + 24 <= 227 * 1024
    assert S.pad_head_dims(200, 72) == (256, 128) and S.pad_head_dims(40, 130) == (128, 256)
    assert S.pad_head_dims(40, 72) == (64, 128) and not S.is_split(128, 128) and S.is_split(129, 1)
    ks = cb.kernel_plan(np.float16, 200, 72, causal=True, deterministic=False, arch=90, kernel="wgmma", tma=True,
                        ordered=True)
    assert ks["dkv"][1] == "flash_bwd_sm90_ws_kernel<fa_half, fa_half, 256, 128, 208, 64, 64, true, true, true, false>"
    name = cb.kernel_plan(bfloat16, 40, 130, causal=False, deterministic=False, arch=90, kernel="wgmma")["dkv"][1]
    assert name == "flash_bwd_sm90_dkv_kernel<fa_bf16, fa_bf16, 128, 256, 48, 64, 64, false, true, false>"


def _auto_kernel(dtype=np.float16, D=64, arch="sm_90", ext=None, causal=False, **kw):
    p = Problem(dtype, D, 16, 16, causal=causal, batch_q=(1, 1), batch_k=(1, 1))
    return cb.plan(*p.args("emulator"), causal=causal, scale=p.scale, batch_shape=p.batch_shape, device="emulator",
                   arch=arch, ext=ext, **kw).kernel


@pytest.mark.parametrize("dtype,D", [(np.float16, 64), (bfloat16, 128), (np.float16, 256)])
def test_dispatched_on_sm90_by_default(dtype, D):
    """kernel=None on sm_90 plans the wgmma backward for fp16 / bf16, both dQ modes (deterministic: ordered);
    sm_80 and kernel="tc" keep the mma.sync backward."""
    assert _auto_kernel(dtype, D) == "wgmma"
    assert _auto_kernel(dtype, D, deterministic=False) == "wgmma"
    assert _auto_kernel(dtype, D, arch="sm_80") == "tc"
    assert _auto_kernel(dtype, D, kernel="tc") == "tc"
    p = Problem(dtype, D, 16, 16, causal=False, batch_q=(1, 1), batch_k=(1, 1))
    plan = cb.plan(*p.args("emulator"), causal=False, scale=p.scale, batch_shape=p.batch_shape, device="emulator",
                   arch="sm_90")
    assert plan.dq_mode == "ordered"


def test_not_dispatched_where_it_does_not_serve(monkeypatch):
    """float32, extensions (AUTO_EXT off; a deterministic block mask with ORDERED_BLOCK_MASK off), dq="recompute",
    AUTO_DISPATCH off and CUDA without NVRTC's sm_90a keep the choice."""
    from conftest import flag_set
    from flasharray._private import cuda_forward_sm90 as F
    from flasharray._private.extensions import Extensions
    assert _auto_kernel(np.float32) == "simt"  # float32's default precision: ieee
    assert _auto_kernel(np.float32, precision="3xtf32") == "tf32"
    block_mask = Extensions(block_mask=np.ones((1, 1), bool), block_size=(16, 16))
    assert S.AUTO_EXT and _auto_kernel(ext=block_mask) == "wgmma"  # deterministic: the ordered dQ takes it (dq_turn)
    with flag_set(cb, "ORDERED_BLOCK_MASK", False):  # as before the forty-third session: the recomputing dQ kernel
        assert _auto_kernel(ext=block_mask) == "tc"
    with flag_set(S, "AUTO_EXT", False):
        assert _auto_kernel(ext=Extensions(dropout_p=0.2, seed=5, offset=1)) == "tc"
    assert _auto_kernel(dq="recompute") == "tc"
    with flag_set(F, "AUTO_DISPATCH", False):
        assert _auto_kernel() == "tc"
    assert cb.auto_wgmma(np.float16, 90, None, 64, 64, device="emulator")
    assert not cb.auto_wgmma(np.float16, 90, None, 300, 64)
    monkeypatch.setattr(F, "nvrtc_sm90a", lambda: False)
    assert not cb.auto_wgmma(np.float16, 90, None, 64, 64, device="cuda")
    assert cb._kernel_choice(np.dtype(np.float16), 90, None, None, 64, 64, device="cuda") == "tc"


def test_extensions_dispatched_with_auto_ext():
    """cuda_backward_sm90.AUTO_EXT on: kernel=None on sm_90 takes the wgmma backward for extension bits both of its
    kernels run (auto_ext), in the dQ modes that take them; the others keep "tc". The gradients meet the rule."""
    from conftest import flag_set
    from flasharray._private.extensions import Extensions
    drop = Extensions(dropout_p=0.2, seed=5, offset=1)
    with flag_set(S, "AUTO_EXT", True):
        assert _auto_kernel(np.float16, 64, ext=drop) == "wgmma"
        assert _auto_kernel(np.float16, 64, ext=Extensions(window=(2, 2)), deterministic=False) == "wgmma"
        assert _auto_kernel(np.float16, 64, ext=Extensions(window=(2, 2))) == "wgmma"  # ordered, window's turn
        # softcap + dropout: the ws kernel takes them (the cp.async one spills: rows it takes fall back, below)
        assert _auto_kernel(np.float16, 64, ext=Extensions(softcap=3.0, dropout_p=0.2)) == "wgmma"
        assert _auto_kernel(np.float16, 128, ext=drop) == "wgmma"  # the ws kernel's bulk dQ at d 128
        assert _auto_kernel(np.float16, 128, ext=Extensions(window=(2, 2), dropout_p=0.2)) == "wgmma"  # (38th)
        slopes = np.full((1, 1), 0.5, np.float32)
        alibi_drop = Extensions(alibi_slopes=slopes, dropout_p=0.2)
        assert _auto_kernel(np.float16, 128, ext=alibi_drop) == "wgmma"  # (39th: ordered, causal or not)
        assert _auto_kernel(np.float16, 128, ext=alibi_drop, causal=True) == "wgmma"
        assert _auto_kernel(np.float16, 128, ext=alibi_drop, deterministic=False) == "wgmma"
        # the one instantiation refused (EXT_SPILLS_BULK_ONE): causal, plain atomics
        assert _auto_kernel(np.float16, 128, ext=alibi_drop, causal=True, deterministic=False) == "tc"
        assert _auto_kernel(np.float16, 256, ext=drop) == "tc"  # the head-dim split: dropout spills (EXT_SPILLS)
        assert _auto_kernel(np.float16, 256, ext=Extensions(softcap=3.0, window=(2, 2))) == "wgmma"   # (42nd)
        assert _auto_kernel(np.float16, 200, ext=Extensions(alibi_slopes=slopes), deterministic=False) == "wgmma"
        assert _auto_kernel(np.float16, 128, ext=Extensions(window=(2, 2)), deterministic=False) == "wgmma"
        q, k, v, dout = (np.random.default_rng(i).standard_normal((1, 2, 70, 64)).astype(np.float16)
                         for i in range(4))
        kw = dict(dropout_p=0.2, seed=5, offset=1)
        common = dict(causal=True, scale=0.125, batch_shape=(1, 2), device="emulator", arch="sm_90", ext=drop)
        out, lse = cuda_forward.forward(q, k, v, **common)
        assert cb.plan(dout, q, k, v, out, lse, **common).kernel == "wgmma"
        grads = cb.backward(dout, q, k, v, out, lse, **common)
        report = check_attention(out, q, k, v, causal=True, dout=dout, grads=grads, **kw)
        assert report.passed, str(report)


def test_auto_dispatch_falls_back_where_the_layout_takes_the_cp_async_kernel():
    """kernel=None with softcap + dropout at d 64: the wgmma backward where its ws kernel runs (16-byte rows, TMA
    maps); rows of 136 bytes take its cp.async kernel, which refuses the set (EXT_SPILLS: it spills), so the plan is
    the mma.sync backward's ("tc"), and its gradients meet the rule. Forced (kernel="wgmma"), the refusal is raised."""
    from flasharray._private.extensions import Extensions
    ext = Extensions(softcap=3.0, dropout_p=0.2, seed=5, offset=1)
    kw = dict(softcap=3.0, dropout_p=0.2, seed=5, offset=1)
    rng = np.random.default_rng(0)
    wide = [rng.standard_normal((1, 2, 70, 68)).astype(np.float16) for _ in range(4)]
    dense = [np.ascontiguousarray(a[..., :64]) for a in wide]
    sliced = [a[..., :64] for a in wide]   # rows 136 bytes apart: no 16-byte rows, no tensor maps
    common = dict(causal=False, scale=0.125, batch_shape=(1, 2), device="emulator", arch="sm_90", ext=ext)
    for arrays, kernel in ((dense, "wgmma"), (sliced, "tc")):
        q, k, v, dout = arrays
        out, lse = cuda_forward.forward(q, k, v, **common)
        assert cb.plan(dout, q, k, v, out, lse, **common).kernel == kernel
        grads = cb.backward(dout, q, k, v, out, lse, **common)
        report = check_attention(out, q, k, v, causal=False, dout=dout, grads=grads, **kw)
        assert report.passed, str(report)
    with pytest.raises(NotImplementedError, match="softcap\\+dropout together at head dim 64 on its cp.async"):
        cb.plan(dout, q, k, v, out, lse, kernel="wgmma", **common)


def test_dispatched_backward_runs_on_the_emulator():
    """One small kernel=None backward on the emulator's sm_90 (the wgmma kernels), against the reference."""
    p = Problem(np.float16, 64, 64, 64, causal=False, batch_q=(1, 2), batch_k=(1, 2))
    check(p, run_backward("emulator", p, arch="sm_90"))


@pytest.mark.parametrize("dtype,D,arch,kw,match", [
    (np.float16, 64, "sm_80", {}, "needs sm_90"),
    (np.float32, 64, "sm_90", {}, "float16 or bfloat16"),
    (np.float16, 257, "sm_90", {}, "head dims 1..256"),
    (np.float16, 64, "sm_90", {"dq": "recompute"}, "recompute"),
])
def test_wgmma_backward_refused(dtype, D, arch, kw, match):
    p = Problem(dtype, D, 8, 8, causal=False, batch_q=(1, 1), batch_k=(1, 1))
    with pytest.raises(NotImplementedError, match="kernel='wgmma'.*" + match):
        run_backward("emulator", p, kernel="wgmma", arch=arch, **kw)


# ---- the ws kernel's dK / dV epilogue by TMA stores (Is_tma_store) ----------------------------------------

def _flag_off(flag, p, deterministic, **opts):
    """The ws kernel's gradients with cuda_backward_sm90's ``flag`` on (its default) and off, on the same inputs
    and emulator options (the plan cache cleared around the second run): new, old and both runs' counters."""
    new, c_new = run_wgmma(p, deterministic=deterministic, **opts)
    try:
        setattr(S, flag, False)
        launch._clear_plans()
        old, c_old = run_wgmma(p, deterministic=deterministic, **opts)
    finally:
        setattr(S, flag, True)
        launch._clear_plans()
    return new, old, c_new, c_old



KV_REGS_CASES = [  # dtype, D, Dv, (Lq, Lk), causal, bcast, layout, deterministic, schedule, seed
    (np.float16, 64, 64, (70, 300), False, "none", "bhsd", True, "random", 3),   # 3 key blocks per dQ element
    (bfloat16, 48, 64, (130, 200), True, "gqa", "bshd", False, "reverse", 0),   # padded 64, GQA, BSHD, tails
    (np.float16, 64, 40, (129, 65), True, "none", "bhsd", True, "random", 7),   # Lq > Lk, dv padded to 64
]


@pytest.mark.parametrize("case", KV_REGS_CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_ws_kv_regs_bits_match_smem_operands(case):
    """KV_REGS: the ws kernel at padded d = dv = 64 with K_j, V_j as register A fragments (ldmatrix once per block;
    S^T, dP^T by RS wgmma) gives the bits of the SS kernel (kKVRegsOn = false: both operands from shared memory)
    under a permuted schedule, both dQ modes; the names say which (ws_kv_regs)."""
    dtype, D, Dv, lengths, causal, bcast, layout, det, schedule, seed = case
    p = _case_problem(dtype, D, Dv, lengths, causal, bcast, layout)
    names = []
    new, old, c_new, c_old = _flag_off("KV_REGS", p, det, schedule=schedule, seed=seed, dkv_names=names)
    assert [S.ws_kv_regs(n) for n in names] == [True, False], names
    assert (c_new.wgmma, c_new.tma_loads) == (c_old.wgmma, c_old.tma_loads)
    for a, b in zip(new, old):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
    check(p, new)




def _bulk_case_flag_off(flag, case, monkeypatch):
    """A case row (dtype, D, Dv, lengths, causal, bcast, layout, deterministic, bulk dQ, schedule, seed) run with
    cuda_backward_sm90's ``flag`` on and off (_flag_off), DQ_BULK as the row says: the problem, the mode, the two
    dK/dV names, both runs' gradients and counters."""
    dtype, D, Dv, lengths, causal, bcast, layout, det, bulk, schedule, seed = case
    monkeypatch.setattr(S, "DQ_BULK", bulk)
    p = _case_problem(dtype, D, Dv, lengths, causal, bcast, layout)
    names = []
    new, old, c_new, c_old = _flag_off(flag, p, det, schedule=schedule, seed=seed, dkv_names=names)
    return p, det, names, new, old, c_new, c_old


KT_REGS_CASES = [  # dtype, D, Dv, (Lq, Lk), causal, bcast, layout, deterministic, bulk dQ, schedule, seed
    (np.float16, 64, 64, (70, 300), False, "none", "bhsd", True, True, "random", 3),   # 3 key blocks per element
    (bfloat16, 40, 72, (130, 200), True, "gqa", "bshd", True, False, "reverse", 0),   # dv 128, GQA, atomics
    (np.float16, 64, 40, (129, 65), True, "none", "bhsd", False, True, "random", 7),   # Lq > Lk, tails
]


@pytest.mark.parametrize("case", KT_REGS_CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_ws_kt_regs_bits_match_smem_operand(case, monkeypatch):
    """KT_REGS: the ws kernel's dQ split (padded d = 64) with K_j^T as register A fragments (ldmatrix.trans once per
    block; dQ^T by RS wgmma) gives the bits of the SS kernel (kKtRegsOn = false: K_j's panel from shared memory)
    under a permuted schedule, both dQ modes, bulk dQ or the consumers' atomics; the names say which (ws_kt_regs)."""
    p, det, names, new, old, c_new, c_old = _bulk_case_flag_off("KT_REGS", case, monkeypatch)
    assert [S.ws_kt_regs(n) for n in names] == [True, False], names
    assert (c_new.wgmma, c_new.tma_loads) == (c_old.wgmma, c_old.tma_loads)
    assert c_new.ldmatrix == c_old.ldmatrix + c_new.blocks * 8 * 8   # 8 consumer warps x 8 k16 steps, once per block
    for a, b in zip(new, old):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
    check(p, new)


def _case_flag_set(flag, value, case, monkeypatch):
    """A case row (dtype, D, Dv, lengths, causal, bcast, layout, deterministic, schedule, seed) run with
    cuda_backward_sm90's ``flag`` at its default, then at ``value`` (a switch off by default), on the same inputs
    and emulator options: the problem, the two dK/dV names, the flipped and default runs' gradients and counters."""
    dtype, D, Dv, lengths, causal, bcast, layout, det, schedule, seed = case
    p = _case_problem(dtype, D, Dv, lengths, causal, bcast, layout)
    names = []
    old, c_old = run_wgmma(p, deterministic=det, schedule=schedule, seed=seed, dkv_names=names)
    monkeypatch.setattr(S, flag, value)
    launch._clear_plans()
    try:
        new, c_new = run_wgmma(p, deterministic=det, schedule=schedule, seed=seed, dkv_names=names)
    finally:
        launch._clear_plans()
    return p, names, new, old, c_new, c_old


SCORES_AHEAD_CASES = [  # dtype, D, Dv, (Lq, Lk), causal, bcast, layout, deterministic, schedule, seed
    (np.float16, 64, 64, (70, 300), False, "none", "bhsd", True, "random", 3),   # 3 key blocks per element
    (bfloat16, 40, 72, (130, 200), True, "gqa", "bshd", True, "reverse", 0),   # dv 128, GQA, BSHD
    (np.float16, 64, 40, (129, 65), True, "none", "bhsd", False, "random", 7),   # Lq > Lk, tails, atomic order
    (bfloat16, 64, 64, (64, 128), False, "none", "bhsd", True, "forward", 1),   # one visit per block
]


@pytest.mark.parametrize("case", thin(SCORES_AHEAD_CASES, every=4), ids=lambda c: "-".join(str(x) for x in c))
def test_ws_scores_ahead_bits_match_default(case, monkeypatch):
    """SCORES_AHEAD: the ws kernel's dQ split (padded d = 64, bulk dQ) issuing each visit's S^T behind the previous
    visit's dQ^T (the last visit's dQ^T after the loop; dV's batch issued with dK's) gives the bits of the default kernel
    under a permuted schedule, both dQ modes; the names say which (ws_scores_ahead), and the wgmma count is the
    same (no extra batch)."""
    p, names, new, old, c_new, c_old = _case_flag_set("SCORES_AHEAD", True, case, monkeypatch)
    assert [S.ws_scores_ahead(n) for n in names] == [False, True], names
    assert (c_new.wgmma, c_new.tma_loads) == (c_old.wgmma, c_old.tma_loads)
    for a, b in zip(new, old):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
    check(p, new)


DQ_BUFFERS_CASES = [  # dtype, D, Dv, (Lq, Lk), causal, bcast, layout, deterministic, schedule, seed
    (np.float16, 64, 64, (330, 300), False, "none", "bhsd", True, "random", 3),   # 6 visits: buffers reused
    (bfloat16, 40, 72, (400, 200), True, "gqa", "bshd", True, "reverse", 0),   # dv 128, GQA: 2 x 7 visits
    (np.float16, 64, 64, (300, 129), True, "none", "bhsd", False, "random", 7),   # atomic order, tails
    (np.float16, 128, 128, (200, 150), False, "none", "bhsd", True, "random", 1),   # d 128: two fit, unchanged
]


@pytest.mark.parametrize("case", thin(DQ_BUFFERS_CASES, every=4), ids=lambda c: "-".join(str(x) for x in c))
def test_ws_dq_buffers_bits_match_default(case, monkeypatch):
    """DQ_BUFFERS = 4: the ws kernel's bulk dQ at d = 64 with four dQ buffers (the consumers up to three visits ahead
    of the dQ warp; each buffer reused, with its parity, past the fourth visit) gives the bits of the two-buffer
    default under a permuted schedule, both dQ modes; at d = 128 only two fit and the kernel is the default one."""
    p, names, new, old, c_new, c_old = _case_flag_set("DQ_BUFFERS", 4, case, monkeypatch)
    D, Dv = case[1], case[2]
    four = S.pad_head_dims(D, Dv)[0] == 64
    assert [n.endswith(", 4>") for n in names] == [False, four], names
    assert S.dq_buffers(*S.pad_head_dims(D, Dv)) == (4 if four else 2)
    assert (c_new.wgmma, c_new.tma_loads) == (c_old.wgmma, c_old.tma_loads)
    for a, b in zip(new, old):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
    check(p, new)


LAYOUT_SRC = r'''
#include "flash_bwd_common.cuh"
// offs: DQAccumLayout<kD, kRowsInner>::offset(r, c) of a 64 x kD query block; frag[w][e][lane] and one atomic add
// each: the offsets of the wgmma dQ^T fragment (flash_bwd_sm90.cu: lane 4g + t of warp w holds head dim 16w + g + 8h,
// queries 8j + 2t, +1; element e = 4j + 2h + (query & 1)), 64 queries.
template <int kD, bool kRowsInner>
__global__ void dq_layout(int* offs, int* frag, float* acc) {
  using A = fa_bwd::DQAccumLayout<kD, kRowsInner>;
  for (int i = threadIdx.x; i < 64 * kD; i += blockDim.x) fa::gstore(offs + i, A::offset(i / kD, i % kD));
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  for (int e = 0; e < 32; ++e) {
    const int off = A::offset(8 * (e / 4) + 2 * t + (e & 1), 16 * w + g + 8 * ((e % 4) >> 1));
    fa::gstore(frag + (w * 32 + e) * 32 + lane, off);
    fa::atomic_add(acc + off, 1.0f);
  }
}
'''


@pytest.mark.parametrize("d", [64, 80, 128, 208, 256])
def test_dq_accum_wg_layout(d):
    """DQAccumWg (the wgmma kernels' dQ accumulator, rows inner) is a permutation of each query block with the
    mma.sync layout's 16 x kDQCols tiles, and per element of the wgmma dQ^T fragment a warp's 32 lanes cover 32
    consecutive floats: one shared-memory wavefront (32 distinct banks) and 4 sectors per RED instruction. The mma.sync
    layout gave that fragment 2-way bank conflicts and 8 sectors (the emulator's RED sector efficiency 0.5)."""
    from flasharray import emulator
    names = ["dq_layout<%d, true>" % d, "dq_layout<%d, false>" % d]
    mod = emulator.Module(LAYOUT_SRC, name_expressions=names, include_dirs=[str(launch.cuda_src_dir())])
    res = {}
    for name in names:
        # (acc 256-byte aligned, as CuPy's arrays are: the sector counts depend on it)
        offs, frag, acc = np.full(64 * d, -1, np.int32), np.zeros(4 * 32 * 32, np.int32), aligned_array(np.zeros(64 * d, np.float32))
        c = mod.launch(name, 1, 128, (offs, frag, acc))
        res[name] = (offs, frag.reshape(4, 32, 32), c)
    offs, frag, c = res[names[0]]
    assert sorted(offs) == list(range(64 * d))
    cols = 32 if d % 32 == 0 else 16
    tile_of = lambda o: o // (16 * cols)  # noqa: E731
    r, cc = np.divmod(np.arange(64 * d), d)
    np.testing.assert_array_equal(tile_of(offs), (r // 16) * (d // cols) + cc // cols)  # the same tiles
    np.testing.assert_array_equal(tile_of(offs), tile_of(res[names[1]][0]))
    wavefronts = lambda lanes: max(len(set(lanes[lanes % 32 == b])) for b in range(32))  # noqa: E731
    for name, want_waves, want_eff in ((names[0], 1, 1.0), (names[1], 2, 0.5)):
        _, frag, c = res[name]
        for lanes in frag.reshape(-1, 32):
            assert wavefronts(lanes) == want_waves, (name, lanes)
            if want_waves == 1:
                assert lanes.min() % 32 == 0 and sorted(lanes - lanes.min()) == list(range(32)), (name, lanes)
        assert c.buffers[2].write_sector_efficiency == want_eff, name  # acc: the REDs


@pytest.mark.parametrize("tma,D", [(True, 64), (True, 256), (False, 128)])
def test_wgmma_dq_atomics_and_convert_coalesced(tma, D, monkeypatch):
    """The wgmma backward's dQ REDs (DQ_BULK off; D = 256 is the head-dim split) write whole 32-byte sectors of the
    accumulator (DQAccumWg: 0.5 with the mma.sync layout), and the convert kernel reads it and writes dQ at full
    sector efficiency (loads of 512 contiguous bytes, 32-byte row segments per lane pair)."""
    monkeypatch.setattr(S, "DQ_BULK", False)
    monkeypatch.setattr(S, "USE_TMA", tma)
    launch._clear_plans()
    p = Problem(np.float16, D, 130, 150, causal=True, batch_q=(1, 1), batch_k=(1, 1))
    try:
        res = run_backward("emulator", p, deterministic=False, kernel="wgmma", arch="sm_90", return_counters=True)
    finally:
        launch._clear_plans()
    check(p, res[:3])
    counters = dict(res[3])
    (dkv,) = [c for n, c in counters.items() if n.startswith((S.KERNEL, S.WS_KERNEL))]
    (conv,) = [c for n, c in counters.items() if "convert_dq_tc" in n and n.endswith(", float, true>")]
    assert dkv.atomics > 0
    (acc,) = [b for b in dkv.buffers.values() if b.write_sectors and b.read_bytes]   # (atomics read and write)
    assert acc.write_sector_efficiency == 1.0
    assert conv.load_sector_efficiency == 1.0 and conv.store_sector_efficiency == 1.0


SPLIT_OVERLAP_CASES = [  # dtype, D, Dv, (Lq, Lk), causal, bcast, layout, deterministic, bulk dQ, schedule, seed
    (np.float16, 256, 256, (70, 200), False, "none", "bhsd", True, True, "random", 5),   # staged dQ, 4 key blocks
    (bfloat16, 256, 256, (130, 150), True, "gqa", "bshd", False, True, "reverse", 0),    # staged, causal, GQA, BSHD
    (np.float16, 256, 256, (65, 127), True, "none", "bhsd", True, False, "random", 2),   # the consumers' atomics
    (bfloat16, 200, 72, (40, 130), False, "none", "bhsd", True, True, "forward", 1),     # 256 / 128: atomics
]


@pytest.mark.parametrize("case", thin(SPLIT_OVERLAP_CASES, every=4), ids=lambda c: "-".join(str(x) for x in c))
def test_ws_split_overlap_bits_match_default(case, monkeypatch):
    """SPLIT_OVERLAP: the ws kernel's query split at padded d = 256 with dP^T issued right behind S^T and the dQ^T
    batches issued before the wait for the dV_j, dK_j batch gives the bits of the default order under a permuted
    schedule, in both dQ modes, with the staged bulk dQ and with the consumers' atomics (DQ_BULK off, and d 256 with
    dv 128, which has no staged mode); the names say which (ws_split_overlap), and the wgmma count is the same."""
    *row, bulk, schedule, seed = case
    monkeypatch.setattr(S, "DQ_BULK", bulk)
    p, names, new, old, c_new, c_old = _case_flag_set("SPLIT_OVERLAP", True, (*row, schedule, seed), monkeypatch)
    assert [S.ws_split_overlap(n) for n in names] == [False, True], names
    assert [S._ws_args(n)[10] for n in names] == [str(bulk and case[2] == 256).lower()] * 2, names  # Is_dq_bulk
    assert (c_new.wgmma, c_new.tma_loads) == (c_old.wgmma, c_old.tma_loads)
    for a, b in zip(new, old):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
    check(p, new)


def test_ws_split_overlap_needs_the_warpgroup_barrier(monkeypatch):
    """SPLIT_OVERLAP with the staged dQ: without the warpgroup's named barrier after the wait for the dV_j, dK_j
    batch, one warp's dQ^T stores overwrite its panels of the stage while another warp of the warpgroup has not yet
    waited for the batch that reads them; the emulator reports it."""
    from flasharray import emulator
    monkeypatch.setattr(S, "SPLIT_OVERLAP", True)
    p = Problem(np.float16, 256, 70, 200, causal=False, batch_q=(1, 1), batch_k=(1, 1))
    _mutant(monkeypatch, "      if constexpr (kSplitOverlap && Tr::kDQStaged) fa::named_barrier_sync(Tr::kWgBarrier + cwg, 128);\n", "")
    try:
        launch._clear_plans()
        with pytest.raises(emulator.EmulatorError, match=r"wgmma of warpgroup \d reads .* was written between its issue"):
            run_wgmma(p, deterministic=True, schedule="random", seed=5)
    finally:
        monkeypatch.undo()
        launch._clear_plans()


DQ_SPLIT_CASES = [  # dtype, D, Dv, (Lq, Lk), causal, bcast, layout, deterministic, bulk dQ, schedule, seed
    (np.float16, 64, 64, (70, 300), False, "none", "bhsd", True, True, "random", 3),   # 3 key blocks per element
    (bfloat16, 40, 72, (130, 200), True, "gqa", "bshd", True, False, "reverse", 0),   # dv 128, GQA, atomics
    (np.float16, 64, 40, (129, 65), True, "none", "bhsd", False, True, "random", 7),   # Lq > Lk, tails
    (bfloat16, 48, 64, (90, 257), False, "mqa", "bhsd", False, False, "forward", 0),   # kDQDim 48 < d
]


@pytest.mark.parametrize("case", thin(DQ_SPLIT_CASES), ids=lambda c: "-".join(str(x) for x in c))
def test_ws_dq_split_bits_match_one_warpgroup(case, monkeypatch):
    """DQ_SPLIT: the ws kernel at padded d = 64 with dQ^T split by queries over both consumer warpgroups (N = 32 each,
    dS^T in two 64B-swizzled half tiles) gives the bits of dQ^T computed by warpgroup 0 alone (kDQSplitOn = false):
    dq, dk, dv in the ordered mode; dk, dv and the reference rule in the atomic one (its dq adds in schedule order).
    Twice the dQ wgmma instructions at half the N; dQ by the bulk reduce-add or by the consumers' atomics."""
    p, det, names, new, old, c_new, c_old = _bulk_case_flag_off("DQ_SPLIT", case, monkeypatch)
    D, Dv = case[1], case[2]
    assert [S.ws_dq_split(n) for n in names] == [True, False], names
    visits = c_old.wgmma // (2 * (4 + S.pad_head_dims(D, Dv)[1] // 16 + 8) + 8)   # per visit: both warpgroups + dQ
    assert c_new.wgmma - c_old.wgmma == 8 * visits > 0 and c_new.tma_loads == c_old.tma_loads
    assert c_new.atomics == c_old.atomics   # (0 with the bulk dQ; else every dQ element once per key block)
    for a, b in list(zip(new, old))[0 if det else 1:]:
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
    check(p, new)
    check(p, old)


def test_dq_split_only_at_64():
    """dq_split / ws_dq_split: padded d = 64 (dv 64 or 128) outside the head-dim split; kDQSplitOn = false named only
    where the flag changes the code."""
    assert S.dq_split(64, 64) and S.dq_split(40, 72) and S.dq_split(1, 128)
    assert not S.dq_split(128, 64) and not S.dq_split(64, 256) and not S.dq_split(200, 72)
    t, t128 = S.backward_tile(None, np.float16, 64, 64, 90), S.backward_tile(None, np.float16, 128, 128, 90)
    name, name128 = S.ws_name(t, 64, 64, True, "fa_half"), S.ws_name(t128, 128, 128, True, "fa_half")
    assert S.ws_dq_split(name) and not S.ws_dq_split(name128)
    assert S.ws_dq_split(S.ws_name(t, 64, 64, True, "fa_half", ext=2))   # (extensions take it too)
    try:
        S.DQ_SPLIT = False
        off = S.ws_name(t, 64, 64, True, "fa_half")
        assert off == name[:-1] + ", 0, true, true, true, false>" and not S.ws_dq_split(off)
        assert S.ws_name(t128, 128, 128, True, "fa_half") == name128
    finally:
        S.DQ_SPLIT = True


def test_kv_regs_only_at_64():
    """ws_kv_regs / kv_regs: padded d = dv = 64 without extensions; names with kKVRegsOn = false only where the flag
    changes the code."""
    assert S.kv_regs(64, 64) and S.kv_regs(40, 33) and not S.kv_regs(64, 128) and not S.kv_regs(128, 128)
    assert not S.kv_regs(64, 64, ext=2)
    t, t128 = S.backward_tile(None, np.float16, 64, 64, 90), S.backward_tile(None, np.float16, 128, 128, 90)
    name, name128 = S.ws_name(t, 64, 64, True, "fa_half"), S.ws_name(t128, 128, 128, True, "fa_half")
    assert S.ws_kv_regs(name) and not S.ws_kv_regs(name128)
    assert not S.ws_kv_regs(S.ws_name(t, 64, 64, True, "fa_half", ext=2))
    try:
        S.KV_REGS = False
        off = S.ws_name(t, 64, 64, True, "fa_half")
        assert off == name[:-1] + ", 0, false>" and not S.ws_kv_regs(off)
        assert S.ws_name(t128, 128, 128, True, "fa_half") == name128   # no code change there: the same name
    finally:
        S.KV_REGS = True


def _tma_store_vs_16_byte(p, deterministic, **opts):
    """The ws kernel's gradients with the TMA-store epilogue and with the 16-byte stores (USE_TMA_STORE off),
    on the same inputs and emulator options; both runs' counters."""
    new, old, c_new, c_old = _flag_off("USE_TMA_STORE", p, deterministic, **opts)
    assert c_new.tma_stores > 0 and c_old.tma_stores == 0
    return new, old, c_new, c_old


STORE_CASES = [  # dtype, D, Dv, (Lq, Lk), causal, bcast, layout, deterministic, schedule, seed
    (np.float16, 64, 64, (65, 127), True, "none", "bhsd", False, "reverse", 0),
    (bfloat16, 128, 128, (17, 63), False, "none", "bhsd", True, "random", 3),
    (np.float16, 40, 72, (70, 130), True, "gqa", "bshd", False, "random", 11),  # group in the block, BSHD views
    (bfloat16, 256, 256, (65, 127), True, "none", "bhsd", True, "reverse", 0),  # head-dim split, Lk = 2 x 64 - 1
]
STORE_SLOW = [
    (np.float16, 128, 64, (129, 300), False, "gqa", "bshd", True, "random", 5),
    (bfloat16, 64, 128, (40, 200), True, "mqa", "bhsd", False, "forward", 0),
    (np.float16, 200, 72, (130, 70), True, "gqa", "bshd", True, "random", 7),  # split, D, Dv not multiples of 64
    (bfloat16, 72, 256, (40, 150), False, "none", "bshd", False, "reverse", 0),
]


def _check_store_case(dtype, D, Dv, lengths, causal, bcast, layout, deterministic, schedule, seed):
    p = _case_problem(dtype, D, Dv, lengths, causal, bcast, layout)
    new, old, c_new, c_old = _tma_store_vs_16_byte(p, deterministic, schedule=schedule, seed=seed)
    for a, b in zip(new, old):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
    check(p, new)
    # the same stmatrix count (staged into the swizzled K_j / V_j tiles instead of the padded ones)
    assert c_new.stmatrix == c_old.stmatrix > 0


@pytest.mark.parametrize("case", thin(STORE_CASES), ids=lambda c: "-".join(str(x) for x in c))
def test_ws_tma_store_bits_match_16_byte_stores(case):
    """dK / dV by TMA stores (swizzled staging, one elected thread's d/64 + dv/64 stores, rows past Lk clipped
    by the TMA unit) carry the bits of the 16-byte-store epilogue, for dq too, under permuted schedules (the
    stores' reads of shared memory land at their wait); gradients against the float64 reference."""
    _check_store_case(*case)


@pytest.mark.slow
@pytest.mark.parametrize("case", STORE_SLOW, ids=lambda c: "-".join(str(x) for x in c))
def test_ws_tma_store_bits_match_16_byte_stores_more(case):
    _check_store_case(*case)


def test_ws_partial_sums_keep_fragment_stores():
    """K / V broadcast over a grid dim (q's batch (2, 2, 2), k's and v's (1, 2, 1): the last dim is the group
    walked in the block, the first a grid dim): fp32 partial sums of dK, dV, summed afterwards — the ws kernel
    without Is_tma_store (its map slots hold q's and dout's maps, unused)."""
    p = Problem(np.float16, 64, 70, 130, causal=True, batch_q=(2, 2, 2), batch_k=(1, 2, 1))
    grads, c = run_wgmma(p, deterministic=False)
    check(p, grads)
    assert c.tma_stores == 0 and c.tma_loads > 0
    plan = cb.plan(*p.args("emulator"), causal=True, scale=p.scale, batch_shape=p.batch_shape, device="emulator",
                   deterministic=False, kernel="wgmma", arch="sm_90")
    rec = [r for r in plan.launches if r.name.startswith(S.WS_KERNEL)]
    assert plan.partial and rec and all(template_flags(r.name)[-2] is False and ", float," in r.name for r in rec)
    assert all([m.key for m in r.template if isinstance(m, launch.Map)][4:] == ["q", "dout"] for r in rec)


def test_tma_store_maps_legality():
    """tma_store_maps refuses outputs a map cannot describe (the caller then keeps the old path): rows not a
    multiple of 16 bytes, a launch offset not 16-byte aligned, non-unit column stride, fp32 outputs."""
    tile = S.backward_tile(None, np.float16, 64, 64, 90)
    part = ((1, 1, 2), {"dk": (0, 0, 127 * 64), "dv": (0, 0, 127 * 64)}, {})
    ok = {"dk": launch.stand_in((2, 127, 64), np.float16), "dv": launch.stand_in((2, 127, 64), np.float16)}
    maps = S.tma_store_maps(ok, part, tile, np.float16)
    assert [m.key for m, _ in maps] == ["dk", "dv"] and maps[0][0].template.box_dim == (64, 128, 1, 1, 1)
    assert maps[0][0].template.global_dim == (64, 127, 2, 1, 1) and maps[0][1] == [S._SEL_B2, 0, 0]
    rows_60 = dict(ok, dv=launch.stand_in((2, 127, 60), np.float16))               # 120-byte rows
    assert S.tma_store_maps(rows_60, ((1, 1, 2), {"dk": (0, 0, 127 * 64), "dv": (0, 0, 127 * 60)}, {}),
                            tile, np.float16) is None
    assert S.tma_store_maps(ok, (part[0], part[1], {"dk": 4}), tile, np.float16) is None  # 8-byte offset
    strided = dict(ok, dk=launch.stand_in((2, 127, 64), np.float16, (127 * 256, 256, 4)))
    assert S.tma_store_maps(strided, part, tile, np.float16) is None
    f32 = dict(ok, dk=launch.stand_in((2, 127, 64), np.float32))
    assert S.tma_store_maps(f32, part, tile, np.float16) is None


def _mutant(monkeypatch, old, new):
    """Run the kernels from flash_bwd_sm90.cu with ``old`` replaced by ``new`` (once) in the source."""
    src = launch.kernel_source(S.SOURCE)
    assert src.count(old) == 1, old
    real = launch.kernel_source
    monkeypatch.setattr(launch, "kernel_source", lambda n: src.replace(old, new) if n == S.SOURCE else real(n))
    monkeypatch.setattr(launch, "_digest", "mutant-%x" % (hash((old, new)) & 0xffffffff))  # a new module cache key


@pytest.mark.parametrize("old,new,match", [
    ("  fa::fence_proxy_async();\n  sync();\n  if (etid == 0) {", "  sync();\n  if (etid == 0) {",
     r"fa::tma_store reads .*written by ordinary \(generic-proxy\) stores since the block's last"),
    ("    fa::tma_store_wait<0>();\n  }\n}", "  }\n}", r"thread exits with 2 TMA store\(s\)"),
], ids=["no-fence", "no-wait"])
def test_ws_tma_store_mutations_reported(monkeypatch, old, new, match):
    """The emulator reports the epilogue without its fence.proxy.async (the TMA store would read the stmatrix
    writes through the async proxy unordered) and without the store's wait (the thread, and with the block
    its shared memory, would go away under the stores' reads)."""
    from flasharray import emulator
    p = Problem(np.float16, 64, 70, 63, causal=False, batch_q=(1, 1), batch_k=(1, 1))
    _mutant(monkeypatch, old, new)
    try:
        launch._clear_plans()  # (plans hold their kernels)
        with pytest.raises(emulator.EmulatorError, match=match):
            run_wgmma(p, deterministic=False)
    finally:
        monkeypatch.undo()
        launch._clear_plans()


# ---- the ws kernel's bulk dQ (Is_dq_bulk: FlashAttention-3's dQ warp and cp.reduce.async.bulk) -------------

def _bulk_vs_atomic(p, deterministic, **opts):
    """The ws kernel's gradients with the bulk dQ and with the consumers' atomics (DQ_BULK off), same inputs
    and emulator options; both runs' counters."""
    new, old, c_new, c_old = _flag_off("DQ_BULK", p, deterministic, **opts)
    assert c_new.atomics == 0 and c_old.atomics > 0 and c_new.tma_loads > 0 and c_old.tma_loads > 0
    return new, old, c_new, c_old


BULK_CASES = [  # dtype, D, Dv, (Lq, Lk), causal, bcast, layout, schedule, seed
    (np.float16, 64, 64, (70, 300), False, "none", "bhsd", "random", 3),     # 3 key blocks per dQ element
    (bfloat16, 128, 128, (130, 300), True, "none", "bhsd", "reverse", 0),   # causal, tails
    (np.float16, 40, 72, (130, 200), True, "gqa", "bshd", "random", 11),    # kDQDim 48 < d 64, GQA, BSHD
    (np.float16, 256, 256, (70, 200), False, "none", "bhsd", "random", 5),  # head-dim split: staged, 4 key blocks
]
BULK_SLOW = [
    (bfloat16, 64, 128, (200, 390), False, "mqa", "bhsd", "random", 5),
    (np.float16, 128, 64, (129, 65), True, "none", "bhsd", "forward", 0),   # Lq > Lk: rows that see no key
    (bfloat16, 96, 96, (257, 513), True, "gqa", "bshd", "random", 7),
    (bfloat16, 256, 256, (130, 150), True, "gqa", "bshd", "reverse", 0),    # staged, causal, GQA, BSHD
]


def _check_bulk_case(dtype, D, Dv, lengths, causal, bcast, layout, schedule, seed):
    p = _case_problem(dtype, D, Dv, lengths, causal, bcast, layout)
    # ordered: the same adds in the same (key-block) order, each an fp32 round-to-nearest add: the bits of the
    # atomic ordered mode, whatever the schedule (the atomic run under the forward schedule)
    new, old, c_new, _ = _bulk_vs_atomic(p, True, schedule=schedule, seed=seed)
    for a, b in zip(new, old):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
    check(p, new)
    assert c_new.sem_waits > 0
    # plain (atomic mode): the adds in any order; dk, dv unaffected (bits), dq within the test rule
    new, old, _, _ = _bulk_vs_atomic(p, False, schedule=schedule, seed=seed)
    for a, b in zip(new[1:], old[1:]):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
    check(p, new)
    assert_dq_reordered_close(new[0], old[0], dtype)


def assert_dq_reordered_close(new, old, dtype):
    """dq from the same fp32 addends in another order, then one rounding: within 2 ulps of the dtype at the element's
    magnitude (tests/test_gpu_sm90.py's bound)."""
    a, b = new.astype(np.float64), old.astype(np.float64)
    eps = 2.0 ** -10 if np.dtype(dtype) == np.float16 else 2.0 ** -7
    assert np.all(np.abs(a - b) <= 2 * eps * np.maximum(np.abs(b), 2.0 ** -6 * np.abs(b).max()))


@pytest.mark.parametrize("case", thin(BULK_CASES), ids=lambda c: "-".join(str(x) for x in c))
def test_ws_bulk_dq_matches_atomics(case):
    """Bulk dQ against the consumers' atomics: ordered, bit-identical dq, dk, dv (same addition order) under a
    permuted schedule; plain, the gradients against the float64 reference and dq close to the atomic run's."""
    _check_bulk_case(*case)


@pytest.mark.slow
@pytest.mark.parametrize("case", BULK_SLOW, ids=lambda c: "-".join(str(x) for x in c))
def test_ws_bulk_dq_matches_atomics_more(case):
    _check_bulk_case(*case)


@pytest.mark.parametrize("schedule,seed", [("reverse", 0), ("random", 1), ("random", 2), ("random", 9)])
def test_ws_bulk_dq_ordered_bits_identical_under_schedules(schedule, seed):
    """Ordered bulk dQ: five key blocks add to every dQ element; the same bits under every schedule."""
    p = Problem(np.float16, 128, 70, 600, causal=False, batch_q=(1, 1), batch_k=(1, 1))
    base, c = run_wgmma(p, schedule="forward")
    got, _ = run_wgmma(p, schedule=schedule, seed=seed)
    assert c.atomics == 0
    for a, b in zip(base, got):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))



def test_ws_staged_dq_read_before_the_epilogue(monkeypatch):
    """The staged bulk dQ (d = dv = 256): the 16-byte-store epilogue stages dK_j, dV_j over the operand tiles,
    Q_i's and dO_i's stages included, so the consumers first wait for the dQ warp's release of the last visit's
    stage. Without that wait the emulator reports the dQ warp's adds reading the epilogue's stores."""
    from flasharray import emulator
    p = Problem(bfloat16, 256, 65, 127, causal=True, batch_q=(1, 2), batch_k=(1, 2))
    _mutant(monkeypatch, "    if (n_visits > 0) fa::mbarrier_wait_parity(empty + (n_visits - 1) % kStages, "
                         "((n_visits - 1) / kStages) & 1);\n", "")
    try:
        S.USE_TMA_STORE = False
        launch._clear_plans()
        with pytest.raises(emulator.EmulatorError, match=r"bulk_reduce_add_f32 reads shared offset .*generic-proxy|"
                                                         r"source of a bulk reduce-add .* was overwritten"):
            run_wgmma(p, deterministic=True, schedule="reverse")
    finally:
        S.USE_TMA_STORE = True
        monkeypatch.undo()
        launch._clear_plans()

def test_ws_bulk_dq_in_the_head_dim_split():
    """d or dv above 128: a Br x 256 fp32 buffer does not fit beside the split's tiles. At d = dv = 256 (and the
    accumulator's head dim 256) the consumers stage dQ over their own panels of the stage instead, for the dQ warp
    (no buffer; one mbarrier per stage more); elsewhere in the split (d != dv, D padded to 16 below 256) the atomics
    stay."""
    assert S.dq_bulk(256, 256) and not S.dq_bulk(256, 256, 208) and not S.dq_bulk(128, 256)
    assert not S.dq_bulk(256, 128) and S.dq_bulk(128, 128) and S.dq_bulk(64, 128)
    assert S.dq_buffers(128, 128) == 2 and S.dq_buffers(64, 64) == 2 and S.dq_buffers(256, 256) == 0
    for D in (128, 64, 256):
        t = S.ws_tile(S.backward_tile(None, np.float16, D, D, 90), D, D)
        assert t.smem <= 227 * 1024
    t = S.backward_tile(None, np.float16, 256, 256, 90)
    # (200: atomics, the same layout but the staged mode's dq_full barrier per stage)
    assert S.ws_tile(t, 256, 256).smem == S.ws_tile(t, 200, 256).smem + 8 * S.STAGES
    names = [cb.kernel_plan(np.float16, D, D, causal=False, deterministic=True, arch=90, kernel="wgmma", tma=True,
                            ordered=True)["dkv"][1] for D in (256, 200)]
    assert template_flags(names[0])[-1] and not template_flags(names[1])[-1], names


_STAGED = (256, 130, 200)   # the head-dim split's staged bulk dQ (dq_staged_sm90): D, Lq, Lk
_DQ_WARP = (64, 200, 300)   # the dQ warp's (dq_bulk_writer_sm90): 4 visits per block


@pytest.mark.parametrize("shape,old,new,match,deterministic", [
    (_DQ_WARP,
     "    fa::fence_proxy_async();            // the generic stores visible to the bulk reduce (async proxy) ...\n",
     "", r"fa::bulk_reduce_add_f32 reads shared offset .*written by ordinary \(generic-proxy\) stores", True),
    (_DQ_WARP,
     "      if constexpr (kOrderedDQ) fa::bulk_wait<0>();  // the adds complete before the turn passes on\n", "",
     r"fa::sem_post_group: this thread has a bulk reduce-add \(fa::bulk_reduce_add_f32\) in flight, not complete",
     True),
    (_DQ_WARP, "      fa::bulk_wait_read<0>();\n", "",
     r"fa::bulk_wait: the source of a bulk reduce-add .* was overwritten between its issue", False),
    (_STAGED, "      fa::fence_proxy_async();           // the generic stores visible to the bulk reduce (async proxy) ...\n",
     "", r"fa::bulk_reduce_add_f32 reads shared offset .*written by ordinary \(generic-proxy\) stores", True),
    (_STAGED, "      if constexpr (kOrderedDQ) fa::bulk_wait<0>();  // the adds complete before the turn passes on\n", "",
     r"fa::sem_post_group: this thread has a bulk reduce-add \(fa::bulk_reduce_add_f32\) in flight, not complete",
     True),
    (_STAGED, "      fa::bulk_wait_read<0>();\n", "",
     r"fa::bulk_wait: the source of a bulk reduce-add .* was overwritten between its issue", False),
], ids=["no-fence", "turn-before-completion", "buffer-freed-unread", "staged-no-fence",
        "staged-turn-before-completion", "staged-stage-freed-unread"])
def test_ws_bulk_dq_mutations_reported(monkeypatch, shape, old, new, match, deterministic):
    """The emulator reports the consumers' dQ stores without their fence.proxy.async, the turn passed on after
    the bulk reduce's .read wait only (its adds still in flight: the next key block could add first), and
    (plain mode, 4 visits per block) the buffer freed without waiting for the reduce's read (the consumers'
    tile two visits later overwrites the source before the final wait); all three also in the head-dim split's
    staged bulk dQ, where the dQ warp frees the stage itself (the producer's next boxes overwrite the source)."""
    from flasharray import emulator
    D, Lq, Lk = shape
    p = Problem(np.float16, D, Lq, Lk, causal=False, batch_q=(1, 1), batch_k=(1, 1))
    _mutant(monkeypatch, old, new)
    try:
        launch._clear_plans()
        with pytest.raises(emulator.EmulatorError, match=match):
            run_wgmma(p, deterministic=deterministic)
    finally:
        monkeypatch.undo()
        launch._clear_plans()
