"""fa::sem_wait / fa::sem_post: inter-block ordering through counters in global memory.

On the emulator a block whose wait is not yet satisfied is suspended (its worker's OS thread
blocks) and another worker starts the blocks not yet dispatched, so any block order works; a
wait that can never be satisfied is a deadlock error, never a hang. On the GPU the wrappers are
an acquire-load spin and a release reduction (checked in the SASS below)."""
import os
import re
import threading
import time

import numpy as np
import pytest

from flasharray import emulator
from conftest import requires_nvrtc

SRC = r'''
#include "fa_port.cuh"

// Block b waits for its turn b, appends its id to `order` (a plain read-modify-write of `pos`,
// protected by the turn), adds its row of x to acc (one element per thread), posts.
__global__ void chain(int* sem, int* pos, int* order, float* acc, const float* x) {
    const int b = blockIdx.x, t = threadIdx.x;
    fa::sem_wait(sem, b);
    if (t == 0) {
        const int k = fa::gload(pos);
        fa::gstore(order + k, b);
        fa::gstore(pos, k + 1);
    }
    fa::gstore(acc + t, fa::gload(acc + t) + fa::gload(x + b * blockDim.x + t));
    fa::sem_post(sem);
}

// The deterministic dQ pattern: block (n, h) walks tiles m; tile (h, m) takes key blocks n in
// order 0, 1, ..., N-1. x is [H][N][M][D], acc [H][M][D], sem [H][M].
__global__ void tiles(int* sem, float* acc, const float* x, int M) {
    const int n = blockIdx.x, h = blockIdx.y, N = gridDim.x, D = blockDim.x, t = threadIdx.x;
    for (int m = 0; m < M; ++m) {
        int* s = sem + h * M + m;
        fa::sem_wait(s, n);
        fa::atomic_add(acc + (h * M + m) * D + t, fa::gload(x + ((h * N + n) * M + m) * D + t));
        fa::sem_post(s);
    }
}

// Blocks before `stall` take their turns; from `stall` on every block expects one turn too many.
__global__ void stalls(int* sem, int stall) {
    const int b = blockIdx.x;
    fa::sem_wait(sem + 2, b < stall ? b : b + 1);
    fa::sem_post(sem + 2);
}

// Every block but the last waits for a turn that never comes; the last one traps.
__global__ void trap_while_waiting(int* sem) {
    if (blockIdx.x + 1 == gridDim.x) __trap();
    fa::sem_wait(sem, 1);
}

__global__ void wait_at(const int* sem, long long byte_offset, int expected) {
    fa::sem_wait(reinterpret_cast<const int*>(reinterpret_cast<const char*>(sem) + byte_offset), expected);
}

// fa::sem_wait / fa::sem_post in their halves (the grid-layout dK/dV kernel's ordered dQ): thread 0 polls
// while the block works, a barrier extends the turn, the atomics, and the post after the next tile's barrier.
__global__ void tiles_split(int* sem, float* acc, const float* x, float* work, int M) {
    const int n = blockIdx.x, h = blockIdx.y, N = gridDim.x, D = blockDim.x, t = threadIdx.x;
    int* posted = nullptr;
    for (int m = 0; m < M; ++m) {
        __syncthreads();
        if (m > 0 && t == 0) fa::sem_release(posted);
        int* s = sem + h * M + m;
        if (t == 0) fa::sem_acquire(s, n);
        fa::gstore(work + (h * N + n) * D + t, fa::gload(work + (h * N + n) * D + t) + 1.0f);  // work meanwhile
        __syncthreads();
        fa::atomic_add(acc + (h * M + m) * D + t, fa::gload(x + ((h * N + n) * M + m) * D + t));
        posted = s;
    }
    fa::sem_post(posted);
}

__global__ void post_at(int* sem, long long byte_offset) {
    fa::sem_post(reinterpret_cast<int*>(reinterpret_cast<char*>(sem) + byte_offset));
}
'''
NAMES = ["chain", "tiles", "tiles_split", "stalls", "trap_while_waiting", "wait_at", "post_at"]
SCHEDULES = [("forward", 0), ("reverse", 0), ("random", 1), ("random", 2), ("random", 3)]


@pytest.fixture(scope="module")
def mod():
    return emulator.Module(SRC, name_expressions=NAMES)


def spread(rng, shape):
    """float32 values of magnitudes 1e-6..1e6: their fp32 sum depends on the order."""
    return (rng.standard_normal(shape) * 10.0 ** rng.uniform(-6, 6, shape)).astype(np.float32)


def sequential_sum(rows):
    acc = np.zeros(rows.shape[1:], np.float32)
    for r in rows:
        acc = acc + r   # float32 + float32: rounded per step, in this order
    return acc


# ---- ordering -------------------------------------------------------------------------------------
def run_chain(mod, x, schedule, seed, workers):
    nb, nt = x.shape
    sem, pos = np.zeros(1, np.int32), np.zeros(1, np.int32)
    order, acc = np.full(nb, -1, np.int32), np.zeros(nt, np.float32)
    c = mod.launch("chain", nb, nt, (sem, pos, order, acc, x), schedule=schedule, seed=seed, workers=workers)
    return sem, pos, order, acc, c


def test_order_data_is_order_sensitive():
    """The test data really distinguishes orders (otherwise the tests below could not fail)."""
    x = spread(np.random.default_rng(0), (12, 64))
    assert np.any(sequential_sum(x) != sequential_sum(x[::-1]))
    assert np.any(sequential_sum(x) != sequential_sum(x[np.random.default_rng(1).permutation(12)]))


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("schedule,seed", SCHEDULES)
def test_chain_runs_blocks_in_turn_order(mod, schedule, seed, workers):
    x = spread(np.random.default_rng(0), (12, 64))
    sem, pos, order, acc, c = run_chain(mod, x, schedule, seed, workers)
    assert sem[0] == 12 and pos[0] == 12
    np.testing.assert_array_equal(order, np.arange(12))
    assert acc.tobytes() == sequential_sum(x).tobytes()
    assert c.sem_waits == 12 and c.blocks == 12


def test_reverse_on_one_worker_suspends_and_starts_workers(mod):
    """Block 11 is dispatched first and waits: it can only finish if the runtime suspends it and
    starts the other blocks on additional threads (each of blocks 11..1 blocks once)."""
    x = spread(np.random.default_rng(0), (12, 64))
    _, _, order, acc, c = run_chain(mod, x, "reverse", 0, 1)
    np.testing.assert_array_equal(order, np.arange(12))
    assert c.sem_blocked == 11 and c.sem_waits == 12
    _, _, _, _, c = run_chain(mod, x, "forward", 0, 1)
    assert c.sem_blocked == 0


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("schedule,seed", SCHEDULES)
def test_per_tile_semaphores_accumulate_in_key_block_order(mod, schedule, seed, workers):
    H, N, M, D = 3, 5, 4, 32
    x = spread(np.random.default_rng(7), (H, N, M, D))
    sem, acc = np.zeros((H, M), np.int32), np.zeros((H, M, D), np.float32)
    c = mod.launch("tiles", (N, H), D, (sem, acc, x, np.int32(M)), schedule=schedule, seed=seed, workers=workers)
    expect = np.stack([sequential_sum(x[h]) for h in range(H)])   # n = 0..N-1 for every (h, m)
    assert acc.tobytes() == expect.tobytes()
    assert np.all(sem == N)
    assert c.sem_waits == H * N * M and c.atomics == H * N * M * D
    if schedule == "reverse":
        assert c.sem_blocked > 0


# ---- errors ---------------------------------------------------------------------------------------
def os_threads():
    """The process's OS threads less those Python started (pytest-xdist's execnet may start one during a test:
    a count of all threads failed once under CI, 6 == 5): the emulator's workers are not Python threads."""
    python = {t.native_id for t in threading.enumerate()}
    return len([tid for tid in os.listdir("/proc/self/task") if int(tid) not in python])


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("schedule,seed", SCHEDULES)
def test_split_halves_accumulate_in_key_block_order(mod, schedule, seed, workers):
    """fa::sem_acquire by thread 0 with work before the barrier, fa::sem_release after the next tile's barrier
    (the grid-layout dK/dV kernel's ordered dQ): every (h, m) sums its key blocks in order 0 .. N-1, bitwise."""
    H, N, M, D = 2, 5, 4, 32
    x = spread(np.random.default_rng(11), (H, N, M, D))
    sem, acc = np.zeros((H, M), np.int32), np.zeros((H, M, D), np.float32)
    work = np.zeros((H, N, D), np.float32)
    c = mod.launch("tiles_split", (N, H), D, (sem, acc, x, work, np.int32(M)), schedule=schedule, seed=seed,
                   workers=workers)
    expect = np.stack([sequential_sum(x[h]) for h in range(H)])
    assert acc.tobytes() == expect.tobytes() and np.all(sem == N) and np.all(work == M)
    assert c.sem_waits == H * N * M
    if schedule == "reverse":
        assert c.sem_blocked > 0


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("schedule,seed", SCHEDULES[:3])
def test_deadlock_is_reported_not_hung(mod, schedule, seed, workers):
    sem = np.zeros(4, np.int32)
    threads = os_threads()
    t0 = time.monotonic()
    with pytest.raises(emulator.EmulatorError, match="deadlock") as e:
        mod.launch("stalls", 8, 64, (sem, np.int32(5)), schedule=schedule, seed=seed, workers=workers)
    assert time.monotonic() - t0 < 10
    assert os_threads() == threads   # every worker started for the waiting blocks was joined
    msg = str(e.value)
    # the lowest waiting block: block 5 waits for turn 6 while the counter stopped at 5
    assert "kernel 'stalls' block (5,0,0)" in msg, msg
    assert "argument 0 element 2 (byte offset 8) to equal 6, which is 5" in msg, msg
    assert sem[2] == 5
    # the runtime is left clean: the next launch works
    _, _, order, _, _ = run_chain(mod, spread(np.random.default_rng(0), (12, 64)), schedule, seed, workers)
    np.testing.assert_array_equal(order, np.arange(12))


def test_error_elsewhere_releases_waiting_blocks(mod):
    sem = np.zeros(1, np.int32)
    t0 = time.monotonic()
    with pytest.raises(emulator.EmulatorError, match=r"block \(5,0,0\).*__trap\(\) called"):
        mod.launch("trap_while_waiting", 6, 32, (sem,), schedule="forward", workers=1)
    assert time.monotonic() - t0 < 10


def test_overshoot_is_an_error(mod):
    sem = np.array([0, 5], np.int32)
    with pytest.raises(emulator.EmulatorError, match=r"kernel 'wait_at' block \(0,0,0\) thread \(0,0,0\).*"
                       r"argument 0 element 1 \(byte offset 4\) is 5, past the expected 3"):
        mod.launch("wait_at", 1, 32, (sem, 4, np.int32(3)))


def test_semaphore_outside_every_argument(mod):
    sem = np.zeros(4, np.int32)
    with pytest.raises(emulator.EmulatorError, match=r"out-of-bounds fa::sem_wait of 4 bytes.*nearest is "
                       r"argument 0 \(16 bytes\): byte offset 64"):
        mod.launch("wait_at", 1, 32, (sem, 64, np.int32(0)))
    with pytest.raises(emulator.EmulatorError, match=r"out-of-bounds fa::sem_post of 4 bytes.*nearest is "
                       r"argument 0 \(16 bytes\): byte offset -8"):
        mod.launch("post_at", 1, 32, (sem, -8))
    assert np.all(sem == 0)


def test_semaphore_misaligned_or_read_only(mod):
    sem = np.zeros(4, np.int32)
    with pytest.raises(emulator.EmulatorError, match=r"misaligned fa::sem_wait of 4 bytes"):
        mod.launch("wait_at", 1, 32, (sem, 2, np.int32(0)))
    sem.flags.writeable = False
    with pytest.raises(emulator.EmulatorError, match=r"fa::sem_post to argument 0, a read-only array"):
        mod.launch("post_at", 1, 32, (sem, 4))


# ---- GPU code -------------------------------------------------------------------------------------
@requires_nvrtc
@pytest.mark.parametrize("arch", ["sm_75", "sm_80", "sm_90"])
def test_gpu_code_is_an_acquire_spin_and_a_release_reduction(arch):
    from flasharray._private import nvrtc, sass
    r = nvrtc.compile_cubin(SRC, arch, name_expressions=["chain"])
    assert "ld.acquire.gpu.global.b32" in r.ptx and "red.release.gpu.global.add.s32" in r.ptx
    ok, why = sass.available()
    if not ok:
        pytest.skip(why)
    ops = [i.opcode for i in sass.parse(sass.disassemble(r.cubin))[r.kernel("chain").lowered_name]]
    # acquire: a strong GPU-scope load, then L1 invalidated, then the block's barrier;
    # release: the barrier, a GPU-scope fence, the add (warp-aggregated: RED after VOTEU/POPC)
    ldg = ops.index("LDG.E.STRONG.GPU")
    assert ops[ldg + 1:].index("CCTL.IVALL") < 4
    red = next(k for k, o in enumerate(ops) if re.fullmatch(r"REDG?\.E\.ADD\.S32\.STRONG\.GPU", o))
    bars = [k for k, o in enumerate(ops) if o.startswith("BAR.SYNC")]
    assert len(bars) == 2 and ldg < bars[0] < bars[1] < red
    assert "MEMBAR.ALL.GPU" in ops[bars[1]:red]
