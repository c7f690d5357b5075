"""The Hopper backward on wgmma (cuda_src/flash_bwd_sm90.cu, issue 13) on the emulator (arch sm_90).

``cuda_backward.backward(..., kernel="wgmma", arch="sm_90")`` runs the preprocess, the wgmma dK/dV
kernel (atomic dQ into DQAccumLayout: in key-block order when deterministic, the "ordered" mode) and
the conversion pass; dq, dk, dv are checked against the float64 reference backward with DESIGN.md's
rule (``testing.assert_attention_close``, as tests/test_cuda_backward.py). Each case asserts that the
wgmma kernel ran: its launch names ``flash_bwd_sm90_dkv_kernel`` and the emulator's ``wgmma`` counter
equals the count the tiling implies. The ordered mode gives identical bits under permuted schedules.
``-m slow``: more shapes.
"""
import numpy as np
import pytest

from flasharray._private import cuda_backward as cb
from flasharray._private import cuda_backward_sm90 as S
from flasharray._private.dtypes import bfloat16
from test_cuda_backward import Problem, check, run_backward


def expected_wgmma(p, tile, n_entries_kv, n_group):
    """wgmma instructions of one dK/dV launch: per key block, its visited query blocks (causal: from the
    first that sees it) times the query heads of its group; per visit and warpgroup d/16 (S^T) + dv/16
    (dP^T) + 2·Br/16 (dV, dK), plus Bc/16 for each of the d/64 warpgroups computing dQ^T."""
    Lq, D = p.q.shape[-2:]
    Lk, Dv = p.v.shape[-2:]
    d, dv = S.pad_head_dim(D), S.pad_head_dim(Dv)
    Br, Bc = tile.block_m, tile.block_n
    per_visit = (Bc // 64) * (d // 16 + dv // 16 + 2 * Br // 16) + (d // 64) * (Bc // 16)
    Tr = -(-Lq // Br)
    visits = 0
    for c0 in range(0, Lk, Bc):
        first = max(0, c0 - (Lk - Lq)) if p.causal else 0
        visits += Tr - first // Br
    return visits * per_visit * n_group * n_entries_kv


def run_wgmma(p, *, deterministic=True, **opts):
    res = run_backward("emulator", p, deterministic=deterministic, kernel="wgmma", arch="sm_90",
                       return_counters=True, **opts)
    grads, counters = res[:3], res[3]
    names = [n for n, _ in counters]
    dkv = [c for n, c in counters if n.startswith("flash_bwd_sm90_dkv_kernel")]
    assert len(dkv) == 1, names
    assert ("true>" if deterministic else "false>") in [n for n in names if "sm90" in n][0]  # ordered or not
    return grads, dkv[0]


CASES = [  # dtype, D, Dv, (Lq, Lk), causal, bcast, layout, deterministic
    (np.float16, 64, 64, (65, 127), True, "none", "bhsd", True),
    (bfloat16, 128, 128, (17, 63), False, "none", "bhsd", False),
    (np.float16, 40, 72, (130, 70), True, "gqa", "bshd", True),
    (bfloat16, 59, 59, (64, 150), False, "none", "bhsd", True),   # element-wise loads (rows not 16-byte aligned)
    (np.float16, 128, 64, (129, 65), True, "none", "bhsd", False),  # Lq > Lk: rows that see no key
]
SLOW = [
    (dt, D, D, lengths, causal, bcast, "bhsd", det)
    for dt in (np.float16, bfloat16) for D in (16, 64, 96, 128)
    for lengths in ((1, 1), (64, 64), (113, 203), (257, 128)) for causal in (False, True)
    for bcast, det in (("none", True), ("mqa", False))
]


def _check_case(dtype, D, Dv, lengths, causal, bcast, layout, deterministic):
    p = Problem(dtype, D, *lengths, causal=causal, bcast=bcast, layout=layout, Dv=Dv,
                batch_q=None if bcast != "none" else (1, 2), batch_k=None if bcast != "none" else (1, 2))
    grads, c = run_wgmma(p, deterministic=deterministic)
    check(p, grads)
    plan = cb.plan(*p.args("emulator"), causal=p.causal, scale=p.scale, batch_shape=p.batch_shape,
                   device="emulator", deterministic=deterministic, kernel="wgmma", arch="sm_90")
    assert plan.kernel == "wgmma" and plan.dq_mode == ("ordered" if deterministic else "atomic")
    tile = S.backward_tile(None, p.dtype, D, Dv, 90)
    n_group = plan.group[1]
    n_entries_kv = int(np.prod([p.batch_shape[i] for i in plan.grid_b])) if plan.grid_b else 1
    assert c.wgmma == expected_wgmma(p, tile, n_entries_kv, n_group) > 0


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_wgmma_backward_matches_reference(case):
    _check_case(*case)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW, ids=lambda c: "-".join(str(x) for x in c))
def test_wgmma_backward_matrix(case):
    _check_case(*case)


@pytest.mark.parametrize("schedule,seed", [("reverse", 0), ("random", 3)])
def test_wgmma_backward_ordered_bits_identical_under_schedules(schedule, seed):
    """Ordered dQ (deterministic): the same bits whatever the block / warp interleaving."""
    p = Problem(np.float16, 64, 70, 300, causal=False, batch_q=(1, 1), batch_k=(1, 1))
    base, _ = run_wgmma(p)
    got, _ = run_wgmma(p, schedule=schedule, seed=seed)
    for a, b in zip(base, got):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


def test_wgmma_backward_tile():
    t = S.backward_tile(None, np.float16, 128, 128, "sm_90")
    assert (t.block_m, t.block_n, t.n_threads, t.stages) == (64, 128, 256, 2)
    assert t.smem == S.smem_bytes(128, 128) == 2 * (128 * 256 + 2 * 64 * 256 + 128 * 64) + 2 * 2 * 64 * 4 + 1024
    name = cb.kernel_plan(np.float16, 40, 72, causal=True, deterministic=False, arch=90, kernel="wgmma",
                          ordered=True)["dkv"][1]
    assert name == "flash_bwd_sm90_dkv_kernel<fa_half, fa_half, 64, 128, 48, 64, 128, true, true, true>"


def test_default_unchanged_on_sm90():
    """Without kernel="wgmma" sm_90 keeps the mma.sync backward."""
    p = Problem(np.float16, 64, 16, 16, causal=False, batch_q=(1, 1), batch_k=(1, 1))
    plan = cb.plan(*p.args("emulator"), causal=False, scale=p.scale, batch_shape=p.batch_shape, device="emulator",
                   arch="sm_90")
    assert plan.kernel == "tc"


@pytest.mark.parametrize("dtype,D,arch,kw,match", [
    (np.float16, 64, "sm_80", {}, "needs sm_90"),
    (np.float32, 64, "sm_90", {}, "float16 or bfloat16"),
    (np.float16, 256, "sm_90", {}, "head dims 1..128"),
    (np.float16, 64, "sm_90", {"dq": "recompute"}, "recompute"),
])
def test_wgmma_backward_refused(dtype, D, arch, kw, match):
    p = Problem(dtype, D, 8, 8, causal=False, batch_q=(1, 1), batch_k=(1, 1))
    with pytest.raises(NotImplementedError, match="kernel='wgmma'.*" + match):
        run_backward("emulator", p, kernel="wgmma", arch=arch, **kw)
