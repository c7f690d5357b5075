"""End to end: a tiled tensor-core fp16 GEMM (ldmatrix + mma + double-buffered cp.async, 4 warps)
runs on the emulator and matches NumPy; the same kernel with a synchronisation step removed is
caught under permuted schedules (an EmulatorError, or a result that differs)."""
from pathlib import Path

import numpy as np
import pytest

from flasharray import emulator

KERNELS = Path(__file__).parent / "kernels"
BM, BN, BK, PAD, STAGES = 64, 64, 32, 8, 2                       # must match gemm_fp16.cu
SMEM = STAGES * (BM * (BK + PAD) + BK * (BN + PAD)) * 2
SCHEDULES = [("forward", 0), ("reverse", 0), ("random", 1), ("random", 2)]
BUG_NONE, BUG_NO_RAW_BARRIER, BUG_NO_WAR_BARRIER, BUG_NO_WAIT = range(4)


@pytest.fixture(scope="module")
def mod():
    return emulator.Module((KERNELS / "gemm_fp16.cu").read_text(),
                           name_expressions=["gemm_fp16<%d>" % b for b in range(4)])


def run(mod, bug, A, B, schedule="forward", seed=0):
    M, K = A.shape
    N = B.shape[1]
    C = np.zeros((M, N), np.float32)
    counters = mod.launch("gemm_fp16<%d>" % bug, (-(-N // BN), -(-M // BM)), 128,
                          (C, A, B, np.int32(M), np.int32(N), np.int32(K)),
                          shared_mem=SMEM, schedule=schedule, seed=seed)
    return C, counters


def operands(M, N, K, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((M, K)).astype(np.float16), rng.standard_normal((K, N)).astype(np.float16))


def check_close(C, A, B):
    """fp32 accumulation of exact fp16 products: error within a few fp32 ulps of sum |a b|."""
    A64, B64 = A.astype(np.float64), B.astype(np.float64)
    ref = A64 @ B64
    bound = 4 * A.shape[1] * np.finfo(np.float32).eps * (np.abs(A64) @ np.abs(B64))
    assert np.all(np.abs(C - ref) <= bound), np.max(np.abs(C - ref) / bound)


@pytest.mark.parametrize("shape", [(128, 128, 128), (72, 40, 48), (17, 8, 8), (64, 136, 200)])
def test_gemm_matches_numpy(mod, shape):
    M, N, K = shape
    A, B = operands(M, N, K)
    C, counters = run(mod, BUG_NONE, A, B)
    check_close(C, A, B)
    gm, gn, kt = -(-M // BM), -(-N // BN), -(-K // BK)
    blocks = gm * gn
    assert counters.blocks == blocks
    assert counters.mma == blocks * kt * 4 * (BK // 16) * 2 * 4             # warps x k16 x 2 x 4 tiles
    assert counters.ldmatrix == blocks * kt * 4 * (BK // 16) * (2 + 4)
    assert counters.cp_async == blocks * kt * (BM * BK + BK * BN) // 8
    assert counters.barriers == blocks * kt * 2
    assert counters.buffers[0].write_bytes == M * N * 4
    assert counters.buffers[0].read_bytes == 0


def test_gemm_same_result_under_every_schedule(mod):
    A, B = operands(128, 128, 128, seed=1)
    results = [run(mod, BUG_NONE, A, B, s, seed)[0] for s, seed in SCHEDULES]
    for C in results[1:]:
        np.testing.assert_array_equal(C, results[0])
    check_close(results[0], A, B)


def test_gemm_traffic_is_counted_per_buffer(mod):
    """Each block reads its A row panel and B column panel once: the kernel's HBM traffic."""
    M = N = K = 128
    A, B = operands(M, N, K)
    _, c = run(mod, BUG_NONE, A, B)
    assert c.buffers[1].read_bytes == (N // BN) * M * K * 2
    assert c.buffers[2].read_bytes == (M // BM) * K * N * 2
    assert c.global_read_bytes == c.buffers[1].read_bytes + c.buffers[2].read_bytes
    assert c.global_write_bytes == M * N * 4


def caught(mod, bug, A, B, schedule, seed):
    """True when the buggy kernel raises an EmulatorError or gives a wrong result."""
    try:
        C, _ = run(mod, bug, A, B, schedule, seed)
    except emulator.EmulatorError as e:
        assert "gemm_fp16<%d>" % bug in str(e) and "block (" in str(e) and "thread (" in str(e)
        return True
    ref = A.astype(np.float64) @ B.astype(np.float64)
    return not np.allclose(C, ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("bug", [BUG_NO_RAW_BARRIER, BUG_NO_WAR_BARRIER, BUG_NO_WAIT],
                         ids=["no-barrier-after-wait", "no-barrier-before-refill", "no-cp-async-wait"])
def test_missing_synchronisation_is_caught(mod, bug):
    A, B = operands(128, 128, 128, seed=2)
    outcome = {(s, seed): caught(mod, bug, A, B, s, seed) for s, seed in SCHEDULES[:2]}
    # forward lets warp 0 run ahead of the others, reverse warp 3: each order exposes the race.
    assert all(outcome.values()), outcome


def test_missing_barrier_error_message(mod):
    A, B = operands(128, 128, 128, seed=3)
    with pytest.raises(emulator.EmulatorError, match=r"cp\.async .*not|no fa::cp_async_wait") as e:
        run(mod, BUG_NO_RAW_BARRIER, A, B, "forward")
    msg = str(e.value)
    assert "kernel 'gemm_fp16<1>' block (" in msg and "[warp " in msg and "shared offset" in msg


def test_missing_wait_reads_stale_data_without_the_check(mod):
    """Even if no ldmatrix tripped the pending-copy check, the deferred copies would leave the
    poisoned (NaN) shared memory in place: show the stale data directly with a raw read."""
    src = r'''
    #include "fa_port.cuh"
    __global__ void k(fa_half* out, const fa_half* in) {
        FA_DYNAMIC_SMEM(smem);
        fa_half* s = reinterpret_cast<fa_half*>(smem);
        fa::cp_async<16>(s + 8 * threadIdx.x, in + 8 * threadIdx.x, 16);
        fa::cp_async_commit();
        __syncthreads();   // (the missing fa::cp_async_wait<0>() belongs before this barrier)
        for (int i = 0; i < 8; ++i) fa::gstore(out + 8 * threadIdx.x + i, s[8 * ((threadIdx.x + 1) % 32) + i]);
    }
    '''
    m = emulator.Module(src, name_expressions=["k"])
    x = np.arange(256, dtype=np.float16)
    out = np.zeros_like(x)
    m.launch("k", 1, 32, (out, x), shared_mem=512)
    assert np.all(np.isnan(out))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(8))
def test_gemm_random_schedules_exhaustive(mod, seed):
    A, B = operands(128, 192, 256, seed=seed)
    C, _ = run(mod, BUG_NONE, A, B, "random", seed)
    check_close(C, A, B)
    for bug in (BUG_NO_RAW_BARRIER, BUG_NO_WAIT):
        assert caught(mod, bug, A, B, "random", seed)
