"""The float32 forward on Hopper wgmma (cuda_src/flash_fwd_sm90_tf32.cu, issue 12) on the emulator's sm_90.

precision="3xtf32" is held to the DESIGN.md rule for float32 (assert_attention_close), "tf32" to the tf32 bound
(test_cuda_forward_tf32.assert_tf32_close), as the mma.sync TF32 forward. Which calls take the kernel
(cuda_forward_tf32.wgmma_tile: sm_90, dense, 16-byte aligned rows, d = dv padded to 64 or 128), the
fallback for rows that are not 16-byte aligned, schedules (a missing barrier between the conversion of a tile and
another thread's or the wgmma's reads of it would change the bits), NaN inputs, and (``FLASHARRAY_EMULATOR_MMA_SUM=
truncate``, a subprocess) the float32 rule under the model of the tensor cores' truncated sums at N 1024.
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import thin

from flasharray import reference
from flasharray._private import cuda_forward_tf32 as T
from flasharray.testing import assert_attention_close

from test_cuda_forward import make_inputs, run_forward
from test_cuda_forward_tf32 import assert_tf32_close, tf32_plan
from test_gpu_sm90 import requires_sm90

ARCH = "sm_90"

# (precision, D, Lq, Lk, causal, layout, gqa): Lq, Lk off the tiles, Lq = 1 (GQA re-viewed as rows), causal with
# fully masked rows (Lq > Lk), D below the padded 64 / 128, BSHD views (row stride H·D), GQA broadcast.
CASES = [(p, *c) for p in ("3xtf32", "tf32") for c in [
    (64, 77, 130, False, "bhsd", False),
    (64, 150, 150, True, "bhsd", False),
    (32, 1, 130, True, "bhsd", True),
    (40, 64, 64, True, "bshd", True),
    (16, 200, 64, True, "bhsd", False),
    (64, 129, 257, False, "bshd", False),
]] + [(p, *c) for p in ("3xtf32", "tf32") for c in [
    (128, 65, 63, True, "bhsd", False),
    (100, 130, 257, False, "bshd", True),
]] + [("3xtf32", 128, 150, 200, True, "bhsd", False)]   # 3xtf32 d 128: Bc 32, Q's hi plane over the stages


def _id(c):
    p, D, Lq, Lk, causal, layout, gqa = c
    return "%s-d%d-%dx%d%s-%s%s" % (p, D, Lq, Lk, "-causal" if causal else "", layout, "-gqa" if gqa else "")


def check(precision, q, k, v, causal, **opts):
    q0, k0, v0 = q.copy(), k.copy(), v.copy()
    out, lse = run_forward("emulator", q, k, v, causal=causal, precision=precision, arch=ARCH, **opts)
    assert out.dtype == np.float32 and out.shape == q.shape[:-1] + (v.shape[-1],) and lse.shape == q.shape[:-1]
    if precision == "3xtf32":
        assert_attention_close(out, q, k, v, causal=causal, lse=lse)
    else:
        assert_tf32_close(out, lse, q, k, v, causal)
    for a, b in ((q, q0), (k, k0), (v, v0)):
        np.testing.assert_array_equal(a, b)
    return out, lse


@pytest.mark.parametrize("case", thin(CASES), ids=[_id(c) for c in CASES])
def test_wgmma_forward(case):
    precision, D, Lq, Lk, causal, layout, gqa = case
    q, k, v = make_inputs(np.float32, D, Lq, Lk, layout=layout, gqa=gqa)
    t = tf32_plan(q, k, v, causal, precision, arch=ARCH).tile
    assert isinstance(t, T.Tf32WgmmaTile) and t.block_m == 128 and t.n_threads == 256
    assert t.head_dim == t.head_dim_v == (64 if D <= 64 else 128)
    check(precision, q, k, v, causal)


def test_dv_differs():
    """D 40, Dv 24: one padded d = dv = 64 (K's and V's columns zero-filled apart)."""
    q, k, v = make_inputs(np.float32, 40, 33, 70, Dv=24)
    assert isinstance(tf32_plan(q, k, v, True, "3xtf32", arch=ARCH).tile, T.Tf32WgmmaTile)
    check("3xtf32", q, k, v, True)


def test_rows_not_16_byte_aligned_take_the_mma_sync_kernel():
    """D 59 (rows of 59 floats): the plan swaps in the tile's fallback, the mma.sync TF32 kernel."""
    q, k, v = make_inputs(np.float32, 59, 17, 45)
    p = tf32_plan(q, k, v, False, "3xtf32", arch=ARCH)
    assert type(p.tile) is T.Tf32Tile and p.tile.block_m == T.BLOCK_M
    assert all(launch.source == T.SOURCE for launch in p.launches)
    check("3xtf32", q, k, v, False)


def test_tile_rule(monkeypatch):
    """sm_90, dense, padded d = dv within WGMMA_HEAD_DIMS; else the mma.sync tile (or None where that has none)."""
    f32 = np.float32
    t = T.forward_tile("3xtf32", f32, 64, 48, 90)
    assert isinstance(t, T.Tf32WgmmaTile) and t.head_dim == 64 and isinstance(t.fallback, T.Tf32Tile)
    assert t.smem == T.wgmma_smem_bytes(64, 64, "3xtf32") == 181248 and "lo plane in shared memory" in t.reason
    assert T.forward_tile("tf32", f32, 128, 128, 90).smem == 230400
    t128 = T.forward_tile("3xtf32", f32, 80, 96, 90)   # d 128: Bc 32, Q's hi plane over the two stages
    assert (t128.head_dim, t128.block_n, t128.smem) == (128, 32, 181248) and "Bc=32" in t128.reason
    assert t128.name_expression(False, True) == "flash::flash_fwd_sm90_tf32_kernel<128, 32, 3, false>"
    assert T.wgmma_q_over_stages(128, 32, "3xtf32") and not T.wgmma_q_over_stages(64, 64, "3xtf32")
    assert t.name_expression(True, True) == "flash::flash_fwd_sm90_tf32_kernel<64, 64, 3, true>"
    with pytest.raises(ValueError, match="dense calls with 16-byte aligned rows"):
        t.name_expression(False, False)
    for args, kw in [(("3xtf32", f32, 64, 64, 80), {}), (("3xtf32", f32, 144, 80, 90), {}),
                     (("tf32", f32, 144, 128, 90), {}), (("3xtf32", f32, 64, 64, 90), {"ext": 4})]:
        assert type(T.forward_tile(*args, **kw)) is T.Tf32Tile, (args, kw)
    from flasharray._private import cuda_forward_sm90
    monkeypatch.setattr(cuda_forward_sm90, "nvrtc_sm90a", lambda: False)  # CUDA without NVRTC's sm_90a: mma.sync
    assert type(T.forward_tile("3xtf32", f32, 64, 64, 90, device="cuda")) is T.Tf32Tile
    assert isinstance(T.forward_tile("3xtf32", f32, 64, 64, 90, device="emulator"), T.Tf32WgmmaTile)
    monkeypatch.setattr(T, "WGMMA", False)
    assert type(T.forward_tile("tf32", f32, 64, 64, 90)) is T.Tf32Tile


@pytest.mark.parametrize("schedule", ["reverse", "random"])
@pytest.mark.parametrize("D", [64, 128])
def test_schedules_identical(schedule, D):
    """d 128 (3xtf32): the first key tile lands where Q's hi plane was, after every warp read its fragments."""
    q, k, v = make_inputs(np.float32, D, 150, 200)
    ref = run_forward("emulator", q, k, v, causal=True, precision="3xtf32", arch=ARCH)
    got = run_forward("emulator", q, k, v, causal=True, precision="3xtf32", arch=ARCH, schedule=schedule, seed=3)
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("precision", ["3xtf32", "tf32"])
def test_nan_inputs(precision):
    """A NaN in a key row makes every query row that sees it NaN (out and lse), as the reference: P's conversion
    (tf32_operand_finite) may turn a NaN P into a number, but the row's sum l is NaN too."""
    q, k, v = make_inputs(np.float32, 64, 70, 130, batch=(1, 1))
    k[0, 0, 100, 5] = np.nan
    v[0, 0, 3, 7] = np.nan
    out, lse = run_forward("emulator", q, k, v, causal=True, precision=precision, arch=ARCH)
    ref_out, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True, scale=64 ** -0.5)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref_out))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
    assert np.isnan(out).any() and not np.isnan(out).all()


_TRUNCATE_SCRIPT = r'''
import sys
import numpy as np
from flasharray._private import cuda_forward
from flasharray.testing import check_attention
D = int(sys.argv[1])
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 1, 1024, D)).astype(np.float32) for _ in range(3))
p = cuda_forward.plan(q, k, v, causal=False, scale=D ** -0.5, batch_shape=(1, 1), device="emulator",
                      precision="3xtf32", arch="sm_90")
assert type(p.tile).__name__ == "Tf32WgmmaTile" and p.tile.head_dim == D
out, lse = cuda_forward.forward(q, k, v, causal=False, scale=D ** -0.5, batch_shape=(1, 1), device="emulator",
                                precision="3xtf32", arch="sm_90")
r = check_attention(out, q, k, v, causal=False, scale=D ** -0.5)
sys.stdout.buffer.write(out.tobytes() + (b"PASSED" if r.passed else b"FAILED"))
'''


@pytest.mark.parametrize("D", [64, 128])
def test_3xtf32_under_truncated_mma_sums(D):
    """Under the emulator's model of the tensor cores' truncated sums (read once per process: subprocesses) the
    bits change and the rule holds at N 1024: P V_j of each key tile is summed in a zeroed accumulator and added to
    O in fp32, as the mma.sync kernel does (docs/precision.md, *Default*); at d 128 in two column blocks."""
    root = str(Path(__file__).resolve().parents[1])

    def run(mode):
        res = subprocess.run([sys.executable, "-c", _TRUNCATE_SCRIPT, str(D)], capture_output=True, timeout=600,
                             env=dict(os.environ, PYTHONPATH=root, FLASHARRAY_EMULATOR_MMA_SUM=mode))
        assert res.returncode == 0, res.stderr.decode()
        return res.stdout[:-6], res.stdout[-6:]
    nearest, ok_nearest = run("nearest")
    truncated, ok_truncated = run("truncate")
    assert nearest != truncated
    assert ok_nearest == ok_truncated == b"PASSED"


_PROBE = r"""
#include "flash_fwd_sm90_tf32.cu"
template <int D, int BN, int P>
__global__ void probe(int* out) {
  if (threadIdx.x == 0) fa::gstore(out, flash::Sm90Tf32FwdTraits<D, BN, P>::kSmemBytes);
}
"""


def test_python_smem_matches_traits():
    """cuda_forward_tf32.wgmma_smem_bytes (the launch's dynamic shared memory) equals the kernel's kSmemBytes."""
    from flasharray import emulator
    from flasharray._private import launch
    entries = {"probe<%d, %d, %d>" % (d, T.wgmma_block_n(p, d), T.PREC[p]):
               T.wgmma_smem_bytes(d, T.wgmma_block_n(p, d), p) for p, dims in T.WGMMA_HEAD_DIMS.items() for d in dims}
    mod = emulator.Module(_PROBE, name_expressions=list(entries), include_dirs=[str(launch.cuda_src_dir())],
                          options=["-std=c++17"])
    out = np.zeros(1, np.int32)
    for name, smem in entries.items():
        mod.launch(name, 1, 1, (out,))
        assert int(out[0]) == smem, name


@pytest.mark.parametrize("precision,D", [("3xtf32", 64), ("tf32", 64), ("3xtf32", 128)])
def test_counters(precision, D):
    """Per key tile and warpgroup kPrec x (d/8 + Bc/8) wgmmas (3xtf32 at d 128: P V_j in two column blocks, twice
    Bc/8); every byte of q, k, v read once per tile load and out, lse written once (the analytic count); every store
    fills its 32-byte sectors (the output by 8-byte pairs) and the copies' shared-memory writes are conflict-free."""
    from flasharray._private import cuda_forward
    Lq, Lk = 200, 300
    q, k, v = make_inputs(np.float32, D, Lq, Lk, batch=(1, 1))
    p = tf32_plan(q, k, v, True, precision, arch=ARCH)
    counters = []
    p.run(q, k, v, counters)
    (c,) = counters
    bc = p.tile.block_n
    assert bc == T.wgmma_block_n(precision, D)
    tiles_visited = sum(-(-min(Lk, m0 + min(128, Lq - m0) + Lk - Lq) // bc) for m0 in range(0, Lq, 128))
    pv_blocks = 2 if (precision, D) == ("3xtf32", 128) else 1
    assert c.wgmma == 2 * tiles_visited * T.PREC[precision] * (D // 8 + pv_blocks * bc // 8)
    assert (c.global_read_bytes, c.global_write_bytes) == cuda_forward.analytic_global_bytes(
        1, Lq, Lk, D, D, np.float32, p.tile, causal=True)
    assert c.store_sector_efficiency == 1.0
    assert c.cp_async_smem_wavefronts == c.cp_async_smem_wavefronts_ideal


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("precision,D", [("3xtf32", 64), ("tf32", 64), ("tf32", 128), ("3xtf32", 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_forward(precision, D, causal):
    """The wgmma forward on an H100 / H200 (``-m gpu``; skipped elsewhere): the rule, as on the emulator."""
    q, k, v = make_inputs(np.float32, D, 300, 700, batch=(2, 3))
    out, lse = (x.get() for x in run_forward("cuda", q, k, v, causal=causal, precision=precision))
    if precision == "3xtf32":
        assert_attention_close(out, q, k, v, causal=causal, lse=lse)
    else:
        assert_tf32_close(out, lse, q, k, v, causal)


def test_default_precision_keeps_the_mma_sync_kernel_until_validated(monkeypatch):
    """float32's default forward (precision None: "3xtf32" there) keeps the mma.sync kernel measured on an H200
    while WGMMA_DEFAULT is off; explicit precisions take the wgmma one; WGMMA_DEFAULT on: the default too."""
    q, k, v = make_inputs(np.float32, 64, 70, 90)
    assert type(tf32_plan(q, k, v, False, None, arch=ARCH).tile) is T.Tf32Tile
    assert isinstance(tf32_plan(q, k, v, False, "3xtf32", arch=ARCH).tile, T.Tf32WgmmaTile)
    monkeypatch.setattr(T, "WGMMA_DEFAULT", True)
    p = tf32_plan(q, k, v, False, None, arch=ARCH)
    assert isinstance(p.tile, T.Tf32WgmmaTile) and p.tile.precision == "3xtf32"
    out, lse = run_forward("emulator", q, k, v, causal=False, precision=None, arch=ARCH)
    assert_attention_close(out, q, k, v, causal=False, lse=lse)
