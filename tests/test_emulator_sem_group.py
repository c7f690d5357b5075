"""fa::sem_wait_group / fa::sem_post_group: inter-block ordering for a named-barrier group of threads.

The block-wide fa::sem_wait / fa::sem_post (tests/test_emulator_semaphore.py) over the nthreads
consecutive threads of named barrier `id` only: the group's leader (linear thread index a multiple of
nthreads) polls the counter with an acquire load, then bar.sync id, nthreads; post: bar.sync, then the
leader's release add. Threads outside the group (a warp-specialized kernel's producer) never take part
and keep running while the group waits: on the emulator the leader's short wait suspends its fiber only,
so a block whose other threads post the counter completes. Misuse is a checked error: a wait that can never
complete (deadlock naming the counter and the leader), a counter past its turn, a group with no or two
leaders, a group split between the semaphore and a plain named barrier, a counter outside the arguments."""
import re
import time

import numpy as np
import pytest

from flasharray import emulator
from conftest import requires_nvrtc
from test_emulator_semaphore import SCHEDULES, sequential_sum, spread

SRC = r'''
#include "fa_port.cuh"

// 96 threads: warp 0 the "producer" (never touches the counter: it fills its own row of `side` while the
// group waits), warps 1-2 the group of 64 on named barrier 1 (leader: thread 64). Block b takes turn b:
// appends its id to `order` (read-modify-write of pos by one group thread), adds its row of x to acc
// (one element per group thread), posts.
__global__ void chain(int* sem, int* pos, int* order, float* acc, const float* x, float* side) {
    const int b = blockIdx.x, t = threadIdx.x;
    if (t < 32) {
        for (int k = 0; k < 4; ++k) {
            fa::gstore(side + b * 128 + 32 * k + t, static_cast<float>(b + k));
            __syncwarp();
        }
        return;
    }
    const int u = t - 32;
    fa::sem_wait_group(sem, b, 1, 64);
    if (u == 0) {
        const int k = fa::gload(pos);
        fa::gstore(order + k, b);
        fa::gstore(pos, k + 1);
    }
    fa::gstore(acc + u, fa::gload(acc + u) + fa::gload(x + b * 64 + u));
    fa::sem_post_group(sem, 1, 64);
}

// Two groups of one block: warps 0-1 (barrier 1, leader 0) wait for the counter the warps 2-3 (barrier 2,
// leader 64) post after writing `data`; the waiters copy it. A block-wide wait could not complete this.
__global__ void in_block(int* sem, float* data, float* out) {
    const int t = threadIdx.x, b = blockIdx.x;
    if (t < 64) {
        fa::sem_wait_group(sem + b, 1, 1, 64);
        fa::gstore(out + b * 64 + t, fa::gload(data + b * 64 + t));
    } else {
        fa::gstore(data + b * 64 + t - 64, static_cast<float>(1000 * b + t));
        fa::sem_post_group(sem + b, 2, 64);
    }
}

// Group of warps 1-2 waits for a turn: block b waits for b, or b + 1 from `stall` on (never comes).
__global__ void stalls(int* sem, int stall) {
    const int b = blockIdx.x;
    if (threadIdx.x < 32) return;
    fa::sem_wait_group(sem + 1, b < stall ? b : b + 1, 1, 64);
    fa::sem_post_group(sem + 1, 1, 64);
}

// The group is the warps set in `warps` (a bit per warp of 4), nthreads 64, barrier 3.
__global__ void group_of(int* sem, int warps, int post) {
    if (!((warps >> (threadIdx.x / 32)) & 1)) return;
    if (post) fa::sem_post_group(sem, 3, 64);
    else fa::sem_wait_group(sem, 0, 3, 64);
}

// Warp 1 at the group semaphore, warp 2 at a plain named barrier of the same id.
__global__ void mixed(int* sem) {
    if (threadIdx.x < 32) return;
    if (threadIdx.x < 64) fa::sem_wait_group(sem, 0, 1, 64);
    else fa::named_barrier_sync(1, 64);
}

// Every block's group waits for a turn that never comes (its warp 0 exits); the last block traps.
__global__ void trap_while_waiting(int* sem) {
    if (blockIdx.x + 1 == gridDim.x) __trap();
    if (threadIdx.x < 32) return;
    fa::sem_wait_group(sem, 1, 1, 64);
}

// Warp 1 waits, warp 2 (the leader's) posts, on one barrier phase.
__global__ void wait_and_post(int* sem) {
    if (threadIdx.x < 32) return;
    if (threadIdx.x < 64) fa::sem_wait_group(sem, 0, 1, 64);
    else fa::sem_post_group(sem, 1, 64);
}

__global__ void wait_at(const int* sem, long long byte_offset, int expected) {
    if (threadIdx.x < 32) return;
    fa::sem_wait_group(reinterpret_cast<const int*>(reinterpret_cast<const char*>(sem) + byte_offset), expected, 1,
                       64);
}
'''
NAMES = ["chain", "in_block", "stalls", "group_of", "mixed", "wait_and_post", "trap_while_waiting", "wait_at"]


@pytest.fixture(scope="module")
def mod():
    return emulator.Module(SRC, name_expressions=NAMES)


def run_chain(mod, x, schedule, seed, workers):
    nb = x.shape[0]
    sem, pos = np.zeros(1, np.int32), np.zeros(1, np.int32)
    order, acc, side = np.full(nb, -1, np.int32), np.zeros(64, np.float32), np.zeros((nb, 128), np.float32)
    c = mod.launch("chain", nb, 96, (sem, pos, order, acc, x, side), schedule=schedule, seed=seed, workers=workers)
    return sem, pos, order, acc, side, c


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("schedule,seed", SCHEDULES)
def test_group_takes_turns_producer_runs_free(mod, schedule, seed, workers):
    """Known answer: turns 0..9 in order, the fp32 sum in that order, the producer warps' rows written."""
    x = spread(np.random.default_rng(0), (10, 64))
    assert np.any(sequential_sum(x) != sequential_sum(x[::-1]))  # the data tells orders apart
    sem, pos, order, acc, side, c = run_chain(mod, x, schedule, seed, workers)
    assert sem[0] == 10 and pos[0] == 10
    np.testing.assert_array_equal(order, np.arange(10))
    assert acc.tobytes() == sequential_sum(x).tobytes()
    np.testing.assert_array_equal(side, np.arange(10)[:, None] + np.repeat(np.arange(4), 32)[None, :])
    assert c.sem_waits == 10 and c.blocks == 10 and c.named_barriers == 20  # one wait and one post per block
    if schedule == "reverse" and workers == 1:
        assert c.sem_blocked == 9  # blocks 9..1 found their turn not yet come


@pytest.mark.parametrize("schedule,seed", SCHEDULES)
def test_wait_suspends_the_leader_not_the_block(mod, schedule, seed):
    """The counter is posted by another group of the same block: the leader's wait lets it run."""
    sem, data, out = np.zeros(3, np.int32), np.zeros(3 * 64, np.float32), np.zeros(3 * 64, np.float32)
    c = mod.launch("in_block", 3, 128, (sem, data, out), schedule=schedule, seed=seed, workers=1)
    expect = (1000 * np.arange(3)[:, None] + 64 + np.arange(64)[None, :]).astype(np.float32).ravel()
    np.testing.assert_array_equal(out, expect)
    np.testing.assert_array_equal(sem, [1, 1, 1])
    assert c.sem_waits == 3


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("schedule,seed", SCHEDULES[:3])
def test_deadlock_names_the_counter_and_the_leader(mod, schedule, seed, workers):
    sem = np.zeros(2, np.int32)
    with pytest.raises(emulator.EmulatorError, match="deadlock in fa::sem_wait_group") as e:
        mod.launch("stalls", 6, 96, (sem, np.int32(4)), schedule=schedule, seed=seed, workers=workers)
    msg = str(e.value)
    # block 4 waits for turn 5 while the counter stopped at 4; its leader is thread 64
    assert "kernel 'stalls' block (4,0,0) thread (64,0,0)" in msg, msg
    assert "argument 0 element 1 (byte offset 4) to equal 5, which is 4" in msg, msg
    assert sem[1] == 4


@pytest.mark.parametrize("workers", [1, 2])
def test_error_elsewhere_releases_waiting_groups(mod, workers):
    t0 = time.monotonic()
    with pytest.raises(emulator.EmulatorError, match=r"block \(5,0,0\).*__trap\(\) called"):
        mod.launch("trap_while_waiting", 6, 96, (np.zeros(1, np.int32),), schedule="forward", workers=workers)
    assert time.monotonic() - t0 < 10


def test_overshoot_is_an_error(mod):
    sem = np.array([0, 5], np.int32)
    with pytest.raises(emulator.EmulatorError, match=r"thread \(64,0,0\).*fa::sem_wait_group: argument 0 element 1 "
                       r"\(byte offset 4\) is 5, past the expected 3"):
        mod.launch("wait_at", 1, 96, (sem, 4, np.int32(3)))


def test_counter_outside_every_argument(mod):
    sem = np.zeros(4, np.int32)
    with pytest.raises(emulator.EmulatorError, match=r"out-of-bounds fa::sem_wait_group of 4 bytes"):
        mod.launch("wait_at", 1, 96, (sem, 64, np.int32(0)))


@pytest.mark.parametrize("warps,post,leaders", [(0b1010, 0, 0), (0b0101, 0, 2), (0b1010, 1, 0), (0b0101, 1, 2)])
def test_group_needs_exactly_one_leader(mod, warps, post, leaders):
    """Warps 1 and 3 (no thread index a multiple of 64) or 0 and 2 (two): not nthreads consecutive threads."""
    sem = np.zeros(1, np.int32)
    what = "fa::sem_post_group" if post else "fa::sem_wait_group"
    with pytest.raises(emulator.EmulatorError, match=re.escape(what) + r"\(id 3, 64 threads\): %d of the group's "
                       r"threads have a linear thread index that is a multiple of 64" % leaders):
        mod.launch("group_of", 1, 128, (sem, np.int32(warps), np.int32(post)))
    assert sem[0] == 0  # nothing posted


def test_group_split_with_a_plain_named_barrier(mod):
    with pytest.raises(emulator.EmulatorError, match=r"named barrier 1 completed with 32 thread\(s\) at "
                       r"fa::sem_wait_group and 32 at a plain"):
        mod.launch("mixed", 1, 96, (np.zeros(1, np.int32),))


@pytest.mark.parametrize("schedule,seed", SCHEDULES[:3])
def test_group_split_between_wait_and_post(mod, schedule, seed):
    sem = np.zeros(1, np.int32)
    with pytest.raises(emulator.EmulatorError, match=r"fa::sem_(wait|post)_group\(id 1, 64 threads\): \d+ thread\(s\) "
                       r"of this barrier phase are at fa::sem_(post|wait)_group: a group passes one semaphore "
                       r"operation together"):
        mod.launch("wait_and_post", 1, 96, (sem,), schedule=schedule, seed=seed)
    assert sem[0] == 0


@requires_nvrtc
def test_gpu_code_is_a_leader_spin_and_named_barriers():
    """sm_90a SASS: the acquire load and the release add under the leader test, each next to a BAR.SYNC of
    barrier 1 with a thread count (not the block's barrier 0)."""
    from flasharray._private import nvrtc, sass
    r = nvrtc.compile_cubin(SRC, "sm_90a", name_expressions=["chain"])
    assert "ld.acquire.gpu.global.b32" in r.ptx and "red.release.gpu.global.add.s32" in r.ptx
    ok, why = sass.available()
    if not ok:
        pytest.skip(why)
    body = sass.parse(sass.disassemble(r.cubin))[r.kernel("chain").lowered_name]
    ops = [i.opcode for i in body]
    ldg = ops.index("LDG.E.STRONG.GPU")
    red = next(k for k, o in enumerate(ops) if re.fullmatch(r"REDG?\.E\.ADD\.S32\.STRONG\.GPU", o))
    bars = [k for k, i in enumerate(body) if i.opcode.startswith("BAR.SYNC")]
    assert len(bars) == 2 and ldg < bars[0] < bars[1] < red
    assert all(body[k].operands.replace(" ", "").startswith("0x1,") for k in bars), [body[k].operands for k in bars]
    assert "MEMBAR.ALL.GPU" in ops[bars[1]:red]
