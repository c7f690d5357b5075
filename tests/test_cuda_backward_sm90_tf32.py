"""The float32 backward on Hopper wgmma (cuda_src/flash_bwd_sm90_tf32.cu, issue 12) on the emulator's sm_90, and its
static checks (NVRTC, no GPU).

Gradients are held as tests/test_cuda_backward_tf32.py holds the mma.sync TF32 kernel's (3xtf32: the float32 rule
against float64, 3 x naive fp32's error; tf32: the float64 backward of the tf32-rounded operands within the
rounding flips). Which calls take the kernel (cuda_backward_tf32.wgmma_tile: sm_90, dense, 16-byte aligned rows,
padded head dims up to 64), the ordered dQ mode bitwise under permuted schedules, and (a subprocess,
``FLASHARRAY_EMULATOR_MMA_SUM=truncate``) the float32 rule under the model of the tensor cores' truncated sums.
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flasharray._private import cuda_backward, launch, nvrtc, sass, tiles
from flasharray._private import cuda_backward_tf32 as T
from conftest import requires_nvrtc, thin
from test_cuda_backward_tf32 import assert_gradients, make_inputs, run_api
from test_gpu_sm90 import requires_sm90

ARCH = "sm_90"

# (precision, D, Lq, Lk, causal, G, deterministic): Lq, Lk off the tiles, causal with Lq > Lk (rows that see no
# key) and Lq < Lk, GQA groups (G query heads per k, v), D below the padded 64, Lq = 1, the atomic mode.
CASES = [(p, *c) for p in ("3xtf32", "tf32") for c in [
    (64, 77, 130, False, 1, True),
    (64, 130, 100, True, 2, True),
    (60, 150, 200, True, 1, True),
    (64, 1, 64, True, 3, True),
    (56, 65, 63, False, 2, False),
    (64, 200, 70, True, 1, False),
    (32, 90, 130, True, 2, True),   # padded D 32: computed at 64, dQ's accumulator at 32
    (40, 70, 50, False, 1, True),   # padded D 48 (DQAccumLayout's 16-column tiles)
]]


def _id(c):
    p, D, Lq, Lk, causal, G, det = c
    return "%s-d%d-%dx%d%s-g%d%s" % (p, D, Lq, Lk, "-causal" if causal else "", G, "" if det else "-atomic")


def check(precision, D, Lq, Lk, causal, G, deterministic, **opts):
    q, k, v, do = make_inputs(D, Lq, Lk, G=G)
    scale = D ** -0.5
    got, (lse, delta), counters = run_api(precision, q, k, v, do, causal, scale=scale, arch=ARCH,
                                          deterministic=deterministic, **opts)
    names = [n for n, _ in counters]
    assert any(n.startswith(T.WGMMA_KERNEL) for n in names), names
    assert_gradients(precision, got, q, k, v, do, causal, scale, lse, delta)
    return got


@pytest.mark.parametrize("case", thin(CASES), ids=[_id(c) for c in CASES])
def test_wgmma_backward(case):
    check(*case)


def test_dv_differs():
    """D 40, Dv 24: K_j, Q_i and V_j, dO_i zero-filled past their own head dims; dQ's accumulator at padded D 48."""
    q, k, v, do = make_inputs(40, 70, 90, Dv=24, G=2)
    got, (lse, delta), counters = run_api("3xtf32", q, k, v, do, True, scale=40 ** -0.5, arch=ARCH)
    assert any(n.startswith(T.WGMMA_KERNEL) for n, _ in counters)
    assert_gradients("3xtf32", got, q, k, v, do, True, 40 ** -0.5, lse, delta)


def test_tile_rule(monkeypatch):
    f32 = np.float32
    t = T.backward_tile("3xtf32", f32, 64, 64, 90)
    assert isinstance(t, T.Tf32WgmmaBwdTiles) and (t.block_m, t.block_n, t.n_threads) == (64, 64, 256)
    assert t.source == T.WGMMA_SOURCE and t.smem == T.wgmma_smem_bytes(64, 64, 64, "3xtf32") == 230912
    assert T.backward_tile("tf32", f32, 50, 64, 90).smem == T.wgmma_smem_bytes(64, 64, 64, "tf32")
    assert T.dkv_name(t, "3xtf32", 64, 64, True, True, True) == T.WGMMA_KERNEL + "<64, 64, 64, 3, true, true>"
    with pytest.raises(ValueError, match="dense calls with 16-byte aligned rows"):
        T.dkv_name(t, "3xtf32", 64, 64, True, False, True)
    t48 = T.backward_tile("tf32", f32, 40, 24, 90)
    assert isinstance(t48, T.Tf32WgmmaBwdTiles) and t48.head_dim == 64
    assert T.dkv_name(t48, "tf32", 48, 32, False, True, False) == T.WGMMA_KERNEL + "<64, 64, 64, 1, false, false, 48>"
    for args, kw in [((64, 64, 80), {}), ((64, 80, 90), {}), ((72, 64, 90), {}), ((64, 64, 90), {"ext": 16}),
                     ((64, 64, 90), {"vec": False}), ((64, 64, 90), {"wgmma": False})]:
        assert not isinstance(T.backward_tile("3xtf32", f32, *args, **kw), T.Tf32WgmmaBwdTiles), (args, kw)
    plan = cuda_backward.kernel_plan(f32, 64, 64, causal=True, deterministic=True, arch=90, kernel="tf32",
                                     ordered=True, precision="3xtf32")
    assert plan["dkv"][0] == T.WGMMA_SOURCE and plan["dkv"][1].startswith(T.WGMMA_KERNEL)
    from flasharray._private import cuda_forward_sm90
    monkeypatch.setattr(cuda_forward_sm90, "nvrtc_sm90a", lambda: False)  # CUDA without NVRTC's sm_90a: mma.sync
    assert not isinstance(T.backward_tile("3xtf32", f32, 64, 64, 90, device="cuda"), T.Tf32WgmmaBwdTiles)
    assert isinstance(T.backward_tile("3xtf32", f32, 64, 64, 90, device="emulator"), T.Tf32WgmmaBwdTiles)
    assert cuda_backward.family_tile(f32, "3xtf32", 64, 64, 90, device="cuda")[1].source == T.SOURCE
    monkeypatch.setattr(T, "WGMMA", False)
    assert not isinstance(T.backward_tile("3xtf32", f32, 64, 64, 90), T.Tf32WgmmaBwdTiles)


@pytest.mark.parametrize("schedule", ["reverse", "random"])
def test_ordered_dq_bitwise_under_schedules(schedule):
    """The ordered mode's gradients do not depend on the order the blocks and threads run in (a missing barrier
    between the planes' writers and readers would show here too)."""
    ref = check("3xtf32", 64, 130, 190, True, 2, True)
    got = check("3xtf32", 64, 130, 190, True, 2, True, schedule=schedule, seed=5)
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(a, b)


_PROBE = r"""
#include "flash_bwd_sm90_tf32.cu"
template <int P>
__global__ void probe(int* out) {
  if (threadIdx.x == 0) fa::gstore(out, fa_bwd::Sm90Tf32BwdTraits<64, 64, 64, P>::kSmemBytes);
}
"""


def test_python_smem_matches_traits():
    from flasharray import emulator
    mod = emulator.Module(_PROBE, name_expressions=["probe<1>", "probe<3>"],
                          include_dirs=[str(launch.cuda_src_dir())], options=["-std=c++17"])
    out = np.zeros(1, np.int32)
    for p, prec in ((1, "tf32"), (3, "3xtf32")):
        mod.launch("probe<%d>" % p, 1, 1, (out,))
        assert int(out[0]) == T.wgmma_smem_bytes(64, 64, 64, prec), prec


_TRUNCATE_SCRIPT = r'''
import numpy as np
from flasharray._private import cuda_backward, cuda_forward
from flasharray.testing import check_attention
rng = np.random.default_rng(0)
q, k, v, do = (rng.standard_normal((1, 1, 512, 64)).astype(np.float32) for _ in range(4))
kw = dict(causal=False, scale=0.125, batch_shape=(1, 1), device="emulator", precision="3xtf32", arch="sm_90")
out, lse = cuda_forward.forward(q, k, v, **kw)
*grads, counters = cuda_backward.backward(do, q, k, v, out, lse, deterministic=True, return_counters=True, **kw)
assert any(n.startswith("flash_bwd_dkv_sm90_tf32_kernel") for n, _ in counters)
r = check_attention(out, q, k, v, causal=False, scale=0.125, dout=do, grads=grads)
print(" ".join("%s:%d" % (c.name, c.passed) for c in r.checks), r.passed)
'''


def test_3xtf32_under_truncated_mma_sums():
    """Under the truncated-sum model (a subprocess: the mode is read once per process) the wgmma forward and backward
    meet the float32 rule at N 512: each visit's dK_j, dV_j summed in a zeroed accumulator and added in fp32."""
    root = str(Path(__file__).resolve().parents[1])
    res = subprocess.run([sys.executable, "-c", _TRUNCATE_SCRIPT], capture_output=True, timeout=900,
                         env=dict(os.environ, PYTHONPATH=root, FLASHARRAY_EMULATOR_MMA_SUM="truncate"))
    assert res.returncode == 0, res.stderr.decode()
    assert res.stdout.decode().split() == ["out:1", "dq:1", "dk:1", "dv:1", "True"], res.stdout.decode()


# ---- static checks ---------------------------------------------------------------------------------------------
#: Key-loop (one visit) instructions per HGMMA: precision -> bound (measured + ~5 %; docs/precision.md).
MAX_PER_HGMMA = {"3xtf32": 19.5, "tf32": 38.0}


@requires_nvrtc
def test_wgmma_tf32_backward_compiles():
    """Every instantiation (3xtf32 / tf32, causal or not, ordered or not; kDQDim 16 / 32 / 48 too): zero spills and
    stack, 256 threads within
    the register file, its shared memory within the opt-in maximum; the visit loop holds every HGMMA of the kernel
    (kPrec x (d/8 + d/8 + Br/8 + Br/8 + Bc/8): S^T, dP^T, dV^T, dK^T, dQ's two halves), all .TF32, within
    MAX_PER_HGMMA."""
    found = {}
    for prec in ("3xtf32", "tf32"):
        t = T.backward_tile(prec, np.float32, 64, 64, 90)
        for causal in (False, True):
            for ordered in (False, True):
                found[T.dkv_name(t, prec, 64, 64, causal, True, ordered)] = (prec, t)
        for pD in (16, 32, 48):  # the dQ accumulator at a smaller padded D (kDQDim)
            found[T.dkv_name(t, prec, pD, pD, pD == 32, True, pD != 16)] = (prec, t)
    res = nvrtc.compile_cubin(launch.kernel_source(T.WGMMA_SOURCE), "sm_90a", list(found),
                              options=list(launch.CUDA_OPTIONS))
    ok, why = sass.available()
    fns = sass.parse(sass.disassemble(res.cubin)) if ok else None
    problems, rows = [], []
    for name, (prec, t) in found.items():
        k = res.kernel(name)
        line = "%-62s regs %3d spill %d/%d smem %6d" % (name, k.registers, k.spill_stores, k.spill_loads, t.smem)
        if k.spill_stores or k.spill_loads or k.stack_frame or k.static_smem:
            problems.append("%s: spills %d/%d stack %d" % (name, k.spill_stores, k.spill_loads, k.stack_frame))
        if k.registers * 256 > 64 * 1024 or t.smem > tiles.smem_limit(90):
            problems.append("%s: %d registers, %d bytes" % (name, k.registers, t.smem))
        if fns is not None:
            body = fns[k.lowered_name]
            hg = [i for i in body if i.base == "HGMMA"]
            lps = [lp for lp in sass.loops(body) if any(lp.start <= i.address <= lp.end for i in hg)]
            loop = min(lps, key=lambda lp: (-sum(lp.start <= i.address <= lp.end for i in hg), lp.stats.instructions))
            in_loop = [i for i in hg if loop.start <= i.address <= loop.end]
            want = T.PREC[prec] * 5 * 8
            if len(in_loop) != want or len(hg) != want or any(
                    not i.operands.split()[0].endswith("x8.F32.TF32") for i in hg):
                problems.append("%s: %d HGMMA in the loop, %d in all, expected %d tf32" % (name, len(in_loop), len(hg),
                                                                                       want))
            per = loop.stats.instructions / max(1, len(in_loop))
            if per > MAX_PER_HGMMA[prec]:
                problems.append("%s: %.2f instructions per HGMMA, bound %g" % (name, per, MAX_PER_HGMMA[prec]))
            line += "  visit loop %d instr, %d HGMMA, %.2f / HGMMA, %d LDS, %d STS" % (
                loop.stats.instructions, len(in_loop), per, loop.stats.lds, loop.stats.sts)
        rows.append(line)
    print("\n".join(rows))
    assert not problems, "\n".join(problems)
    if fns is None:
        pytest.skip(why)


# ---- on an sm_90 GPU (-m gpu) ---------------------------------------------------------------------------------
@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("precision", ["3xtf32", "tf32"])
@pytest.mark.parametrize("causal,deterministic", [(False, True), (True, True), (True, False)])
def test_gpu_backward(precision, causal, deterministic):
    """The wgmma backward on an H100 / H200 (``-m gpu``; skipped elsewhere): the gradients within the rule (as on the
    emulator); the ordered mode's bits repeat."""
    import cupy
    from flasharray._private import cuda_forward
    q, k, v, do = make_inputs(64, 300, 500, G=2, B=2)
    scale = 0.125
    kb, vb = k[:, :, None], v[:, :, None]
    kw = dict(causal=causal, scale=scale, batch_shape=q.shape[:-2], device="cuda", precision=precision)
    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, kb, vb, do))
    out, lse = cuda_forward.forward(qd, kd, vd, **kw)
    runs = [cuda_backward.backward(dod, qd, kd, vd, out, lse, deterministic=deterministic, **kw) for _ in range(3)]
    got = [g.get() for g in runs[0]]
    got = (got[0], got[1].reshape(k.shape), got[2].reshape(v.shape))
    delta = (do.astype(np.float64) * out.get()).sum(-1).astype(np.float32)
    assert_gradients(precision, got, q, k, v, do, causal, scale, lse.get(), delta)
    if deterministic:
        for other in runs[1:]:
            for a, b in zip(runs[0], other):
                assert (a == b).all()


def test_unaligned_rows_take_the_mma_sync_kernel_and_its_accumulator():
    """Rows not 16-byte aligned (q at a 4-byte offset) run the mma.sync dK/dV kernel (Br 32 for 3xtf32 at d 64),
    and the dQ accumulator is sized for that kernel's query blocks, not the wgmma tile's Br 64: at Lq 2112 (33
    blocks of 64, 66 of 32) the ordered mode's counters, after the accumulator's rows, would have run past a buffer
    sized for 64 (the emulator bounds-checks every access)."""
    rng = np.random.default_rng(3)
    Lq, Lk, D = 2112, 64, 64
    q = np.empty(Lq * D + 1, np.float32)[1:].reshape(1, 1, Lq, D)
    q[...] = rng.standard_normal(q.shape)
    k, v, do = (rng.standard_normal(s).astype(np.float32) for s in ((1, 1, Lk, D), (1, 1, Lk, D), (1, 1, Lq, D)))
    kw = dict(causal=False, scale=0.125, batch_shape=(1, 1), device="emulator", precision="3xtf32", arch=ARCH)
    from flasharray._private import cuda_forward
    from flasharray.testing import check_attention
    out, lse = cuda_forward.forward(q, k, v, **kw)
    *grads, counters = cuda_backward.backward(do, q, k, v, out, lse, deterministic=True, return_counters=True, **kw)
    names = [n for n, _ in counters]
    assert any(n.startswith(T.KERNEL + "<64, 64, 32,") for n in names), names
    assert check_attention(out, q, k, v, causal=False, scale=0.125, dout=do, grads=grads).passed


@pytest.mark.parametrize("precision", ["3xtf32", "tf32"])
def test_counters(precision):
    """Per block and visit kPrec x 48 wgmma (each warpgroup 8 k8 steps of S^T or dP^T, of dV^T or dK^T and of its half
    of dQ): the visits are the causal mask's (key block j visits query blocks from its diagonal on) times the group."""
    Lq, Lk, G = 150, 200, 2
    q, k, v, do = make_inputs(64, Lq, Lk, G=G, Hk=1)
    got, _, counters = run_api(precision, q, k, v, do, True, scale=0.125, arch=ARCH)
    (c,) = [c for n, c in counters if n.startswith(T.WGMMA_KERNEL)]
    Tr = -(-Lq // 64)
    # bottom-right causal: query row r sees keys up to r + Lk - Lq; key block j's first query block
    visits = sum(Tr - max(0, (64 * j - (Lk - Lq)) // 64) for j in range(-(-Lk // 64))) * G
    assert c.wgmma == visits * 48 * T.PREC[precision]
