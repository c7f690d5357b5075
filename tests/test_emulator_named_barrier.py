"""Named barriers (fa::named_barrier_sync / _arrive: bar.sync / bar.arrive id, nthreads) on the emulator.

PTX ISA, "bar, barrier": 16 barriers per CTA (ids 0..15, 0 is __syncthreads()'s); a barrier completes
when `nthreads` threads (a multiple of the warp size, the same in every participant) have arrived;
bar.sync waits for the completion, bar.arrive does not; both are .aligned, so whole warps arrive. The
runtime counts arrivals per barrier and checks each rule; a barrier that can never complete is a
deadlock error naming it. docs/emulator.md, "Named barriers", states the rules."""
import re

import numpy as np
import pytest

from flasharray import emulator
from conftest import requires_nvrtc

SRC = r'''
#include "fa_port.cuh"

// Warp 0 produces `rounds` values into a ring of 2 shared slots; warps 1..3 consume each one. Per slot s:
// FULL = 1 + s (producer arrives, the 3 consumer warps sync: 128 threads), EMPTY = 3 + s (consumers
// arrive, the producer syncs). out[r * 96 + consumer thread] = value of round r. With `skip` the
// consumers do not wait for FULL (a race the schedules expose).
__global__ void ring(float* out, int rounds, int skip) {
    FA_DYNAMIC_SMEM(smem);
    float* slot = reinterpret_cast<float*>(smem);
    const int warp = threadIdx.x / 32;
    for (int r = 0; r < rounds; ++r) {
        const int s = r % 2;
        if (warp == 0) {
            if (r >= 2) fa::named_barrier_sync(3 + s, 128);   // the consumers have read round r - 2
            if (threadIdx.x == 0) slot[s] = 10.0f * r + 1.0f;
            fa::named_barrier_arrive(1 + s, 128);
        } else {
            if (!skip) fa::named_barrier_sync(1 + s, 128);
            fa::gstore(out + r * 96 + threadIdx.x - 32, slot[s]);
            fa::named_barrier_arrive(3 + s, 128);
        }
    }
}

// Two independent pairs of warps, each synchronizing on its own barrier (count 64) `rounds` times;
// out[t] counts the rounds thread t passed.
__global__ void pairs(int* out, int rounds) {
    const int pair = threadIdx.x / 64;
    int n = 0;
    for (int r = 0; r < rounds; ++r) {
        fa::named_barrier_sync(5 + pair, 64);
        ++n;
    }
    fa::gstore(out + threadIdx.x, n);
}

// One misuse per `bug` (block of 128 threads).
__global__ void misuse(int bug, int a, int b) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    switch (bug) {
        case 1: fa::named_barrier_sync(a, b); break;                    // bad id or count
        case 2: if (warp < 2) fa::named_barrier_sync(1, warp == 0 ? 64 : 96); break;
        case 3: if (lane < 16) fa::named_barrier_sync(2, 128); else __syncwarp(); break;   // divergent
        case 7: if (lane < 16) fa::named_barrier_sync(3, 64); else fa::named_barrier_arrive(3, 64); break;
        case 8: if (lane < 16) return; fa::named_barrier_sync(4, 128); break;   // exited lanes do not count
        case 4: if (warp == 0) fa::named_barrier_sync(2, 64); break;   // nobody else arrives
        case 5: if (warp == 0) fa::named_barrier_sync(0, 64); else __syncthreads(); break;
        case 6: if (warp < 3) fa::named_barrier_sync(7, 128); else fa::named_barrier_arrive(7, 128); break;
    }
}
'''
NAMES = ["ring", "pairs", "misuse"]
SCHEDULES = [("forward", 0), ("reverse", 0), ("random", 1), ("random", 2), ("random", 3)]


@pytest.fixture(scope="module")
def mod():
    return emulator.Module(SRC, name_expressions=NAMES)


def run_ring(mod, rounds, skip=0, schedule="forward", seed=0):
    out = np.zeros((rounds, 96), np.float32)
    c = mod.launch("ring", 1, 128, (out, np.int32(rounds), np.int32(skip)), shared_mem=64, schedule=schedule,
                   seed=seed)
    return out, c


@pytest.mark.parametrize("schedule,seed", SCHEDULES)
@pytest.mark.parametrize("rounds", [1, 2, 7])
def test_producer_consumer_ring(mod, rounds, schedule, seed):
    out, c = run_ring(mod, rounds, schedule=schedule, seed=seed)
    assert out.tolist() == [[10.0 * r + 1.0] * 96 for r in range(rounds)]
    # FULL completes every round; EMPTY from round 2 on (the producer's sync pairs with the consumers'
    # arrivals of round r - 2; those of the last two rounds stay pending, which is legal)
    assert c.named_barriers == rounds + max(0, rounds - 2)


def test_the_barrier_is_what_orders_the_ring(mod):
    """Without the consumers' FULL wait a consumer reads a slot before the producer rewrites it: forward
    runs warp 0 until its EMPTY wait of round 2, then warp 1 reads round 0's value again in round 2."""
    out, _ = run_ring(mod, 5, skip=1)
    assert out[2, :32].tolist() == [1.0] * 32   # warp 1 read round 0's value in round 2
    assert out.tolist() != [[10.0 * r + 1.0] * 96 for r in range(5)]


@pytest.mark.parametrize("schedule,seed", SCHEDULES)
def test_independent_barriers_with_partial_counts(mod, schedule, seed):
    out = np.zeros(256, np.int32)
    c = mod.launch("pairs", 1, 256, (out, np.int32(3)), schedule=schedule, seed=seed)
    assert out.tolist() == [3] * 256
    assert c.named_barriers == 4 * 3 and c.barriers == 0


WHERE = r"kernel 'misuse' block \(0,0,0\) thread \(\d+,0,0\) \[warp \d lane \d+\]: "
ERRORS = [
    ((1, 16, 128), r"fa::named_barrier_sync: barrier id 16 is outside 0..15"),
    ((1, -1, 128), r"fa::named_barrier_sync: barrier id -1 is outside 0..15"),
    ((1, 1, 48), r"fa::named_barrier_sync\(1, 48\): the thread count must be a positive multiple of 32"),
    ((1, 1, 0), r"fa::named_barrier_sync\(1, 0\): the thread count must be a positive multiple of 32"),
    ((1, 1, 160), r"fa::named_barrier_sync\(1, 160\): more threads than the block's 4 warps have \(128\)"),
    ((2, 0, 0), r"fa::named_barrier_sync\(1, (64|96)\): thread \d+ arrived at named barrier 1 with a count of "
                r"(96|64): every participant must pass the same thread count"),
    ((7, 0, 0), r"fa::named_barrier_(sync|arrive)\(3, 64\): lanes [\d,-]+ of warp \d are at "
                r"fa::named_barrier_(arrive|sync) of the same barrier: a warp executes one barrier instruction together"),
    ((5, 0, 0), r"(fa::named_barrier_sync\(0, 64\): \d+ thread\(s\) wait at __syncthreads\(\), which is barrier 0 "
                r"too|__syncthreads\(\) .* while \d+ thread\(s\) have arrived at named barrier 0 \(its count 64\))"),
]


@pytest.mark.parametrize("schedule,seed", SCHEDULES[:3])
@pytest.mark.parametrize("args,pattern", ERRORS, ids=[str(a) for a, _ in ERRORS])
def test_misuse_is_a_checked_error(mod, args, pattern, schedule, seed):
    with pytest.raises(emulator.EmulatorError) as e:
        mod.launch("misuse", 1, 128, tuple(np.int32(x) for x in args), schedule=schedule, seed=seed)
    assert re.search(WHERE + pattern, str(e.value)), str(e.value)


@pytest.mark.parametrize("schedule,seed", SCHEDULES[:3])
def test_a_barrier_that_never_completes_is_a_deadlock(mod, schedule, seed):
    with pytest.raises(emulator.EmulatorError, match=r"kernel 'misuse' block \(0,0,0\): deadlock: named barrier 2 "
                                                     r"\(32 of its 64 threads arrived; lanes waiting for the rest of "
                                                     r"their warp: none\) never completes: 32 thread\(s\) wait at "
                                                     r"fa::named_barrier_sync, the others never arrive \(0 thread\(s\) "
                                                     r"wait at __syncthreads\(\), 96 exited\)"):
        mod.launch("misuse", 1, 128, (np.int32(4), np.int32(0), np.int32(0)), schedule=schedule, seed=seed)


@pytest.mark.parametrize("schedule,seed", SCHEDULES[:3])
def test_a_warp_arrives_as_a_unit(mod, schedule, seed):
    """Half of each warp at the barrier, the other half at __syncwarp: no warp's arrival ever forms."""
    with pytest.raises(emulator.EmulatorError, match=r"deadlock: named barrier 2 \(0 of its 128 threads arrived; lanes "
                                                     r"waiting for the rest of their warp: warp 0 lanes 0-15, warp 1 "
                                                     r"lanes 0-15, warp 2 lanes 0-15, warp 3 lanes 0-15\) never "
                                                     r"completes: 64 thread\(s\) wait at fa::named_barrier_sync"):
        mod.launch("misuse", 1, 128, (np.int32(3), np.int32(0), np.int32(0)), schedule=schedule, seed=seed)


@pytest.mark.parametrize("schedule,seed", SCHEDULES)
@pytest.mark.parametrize("bug", [6, 8])
def test_arrive_and_exited_lanes(mod, bug, schedule, seed):
    """6: three warps sync, one arrives: one completion. 8: lanes 0-15 exit; the rest of each warp forms
    its arrival (32 threads counted per warp, as the hardware counts a warp)."""
    c = mod.launch("misuse", 1, 128, (np.int32(bug), np.int32(0), np.int32(0)), schedule=schedule, seed=seed)
    assert c.named_barriers == 1


# ---- GPU code -------------------------------------------------------------------------------------
@requires_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_ptx_and_sass(arch):
    from flasharray._private import nvrtc, sass
    r = nvrtc.compile_cubin(SRC, arch, name_expressions=NAMES)
    assert re.search(r"bar\.sync \d+, \d+;|bar\.sync %r\d+, %r\d+;", r.ptx) and "bar.arrive" in r.ptx
    ok, why = sass.available()
    if not ok:
        pytest.skip(why)
    fns = sass.parse(sass.disassemble(r.cubin))
    ops = {i.opcode for i in fns[r.kernel("ring").lowered_name]}
    # bar.sync id, n -> BAR.SYNC(.DEFER_BLOCKING) with the id and count operands; bar.arrive -> BAR.ARV
    assert "BAR.ARV" in ops and any(o.startswith("BAR.SYNC") for o in ops), sorted(ops)
