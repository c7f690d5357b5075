"""Hopper mbarriers and bulk copies (fa::mbarrier_*, fa::cp_async_bulk_g2s) on the emulator.

The runtime keeps each mbarrier's PTX state (expected and pending arrivals, tx-count, phase) beside
shared memory; a parity wait for an incomplete phase suspends the thread until the phase completes;
bulk copies land, performing complete_tx on their mbarrier, when the schedule chooses (forward: as
late as possible, reverse: at once, random: at random switches). Every misuse is a checked error,
and a wait that can never complete is a deadlock error, not a hang. docs/emulator.md, "Hopper:
mbarrier and bulk copies", states the rules; the GPU code is checked in the sm_90 SASS below."""
import re
import time

import numpy as np
import pytest

from flasharray import emulator
from conftest import requires_nvrtc

SRC = r'''
#include "fa_port.cuh"

// The FlashAttention-3 producer/consumer pattern on a ring of `stages` shared-memory buffers:
// warp 0 (the producer; lane 0 issues) waits until a stage is free (empty[s]), arms full[s] with
// arrive_expect_tx(tile bytes) and fills the stage with `copies` bulk copies; the consumer warps
// (1..) wait on full[s], read the tile and release the stage (one arrival per consumer warp on
// empty[s]). out[t][j] = 2 * x[t][j] + t, each element written by one consumer thread.
// Two bugs on request: flip = 0 makes the producer wait on empty[s] with the consumers' parity
// convention (its first wait can never complete); early = 1 releases a stage before reading it.
__global__ void pipeline(const float* x, float* out, int tiles, int tile_elems, int stages, int copies, int flip,
                         int early) {
    FA_DYNAMIC_SMEM(smem);
    uint64_t* full = reinterpret_cast<uint64_t*>(smem);
    uint64_t* empty = full + stages;
    float* ring = reinterpret_cast<float*>(smem + 128 * ((16 * stages + 127) / 128));
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, consumers = blockDim.x / 32 - 1;
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s) {
            fa::mbarrier_init(full + s, 1);
            fa::mbarrier_init(empty + s, consumers);
        }
        fa::fence_mbarrier_init();
    }
    __syncthreads();
    const int tile_bytes = tile_elems * 4, chunk = tile_bytes / copies;
    if (warp == 0) {
        if (lane == 0) {
            for (int t = 0; t < tiles; ++t) {
                const int s = t % stages, round = t / stages;
                fa::mbarrier_wait_parity(empty + s, (round & 1) ^ flip);   // round 0 passes at once
                fa::mbarrier_arrive_expect_tx(full + s, tile_bytes);
                const char* src = reinterpret_cast<const char*>(x + t * tile_elems);
                char* dst = reinterpret_cast<char*>(ring + s * tile_elems);
                for (int c = 0; c < copies; ++c)
                    fa::cp_async_bulk_g2s(dst + c * chunk, src + c * chunk, chunk, full + s);
            }
        }
        return;
    }
    const int ct = threadIdx.x - 32, nct = 32 * consumers;
    for (int t = 0; t < tiles; ++t) {
        const int s = t % stages;
        fa::mbarrier_wait_parity(full + s, (t / stages) & 1);
        const float* tile = ring + s * tile_elems;
        if (early) {
            __syncwarp();
            if (lane == 0) fa::mbarrier_arrive(empty + s);
        }
        for (int j = ct; j < tile_elems; j += nct) fa::gstore(out + t * tile_elems + j, 2.0f * tile[j] + t);
        __syncwarp();
        if (lane == 0 && !early) fa::mbarrier_arrive(empty + s);
    }
}

// Known answers of the phase and parity rules, recorded by thread 0 in `log`; thread 32 provides
// the second arrival of phases 0 and 1.
__global__ void parity_rules(const float* x, long long* log) {
    FA_DYNAMIC_SMEM(smem);
    uint64_t* bar = reinterpret_cast<uint64_t*>(smem);
    float* buf = reinterpret_cast<float*>(smem + 64);
    int k = 0;
    if (threadIdx.x == 32) {   // (not thread 0: g++ would merge the two branches around the barrier)
        fa::mbarrier_init(bar, 2);
        fa::fence_mbarrier_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        fa::gstore(log + k++, (long long)fa::mbarrier_try_wait_parity(bar, 1));  // phase 0 runs: parity 1 "done"
        fa::gstore(log + k++, (long long)fa::mbarrier_arrive(bar));              // token: phase 0
        fa::mbarrier_wait_parity(bar, 0);          // blocks until thread 32 arrives
        fa::gstore(log + k++, (long long)fa::mbarrier_try_wait_parity(bar, 0));  // phase 0 completed
        fa::gstore(log + k++, (long long)fa::mbarrier_arrive_expect_tx(bar, 48)); // phase 1, tx 48
        fa::cp_async_bulk_g2s(buf, x, 32, bar);
        fa::mbarrier_expect_tx(bar, 16);           // tx 64 expected in all
        fa::cp_async_bulk_g2s(buf + 8, x + 8, 32, bar);
        fa::mbarrier_wait_parity(bar, 1);          // thread 32's arrival and 64 bytes complete phase 1
        fa::gstore(log + k++, (long long)fa::mbarrier_try_wait_parity(bar, 1));
        for (int i = 0; i < 16; ++i) fa::gstore(reinterpret_cast<float*>(log + 8) + i, buf[i]);
        fa::gstore(log + k++, (long long)fa::mbarrier_arrive(bar));              // token: phase 2
        fa::mbarrier_inval(bar);
        fa::mbarrier_init(bar, 1);                 // a fresh barrier: phase 0 again
        fa::gstore(log + k++, (long long)fa::mbarrier_arrive(bar));
    } else if (threadIdx.x == 32) {
        fa::mbarrier_arrive(bar);                  // phase 0
        fa::mbarrier_wait_parity(bar, 0);
        fa::mbarrier_arrive(bar);                  // phase 1 (its tx bytes may still be pending)
    }
}

// A bulk copy issued before the arrive.expect_tx that accounts for it: the tx-count may go
// negative meanwhile (when the copy lands first, as the reverse schedule makes it). The roles'
// thread ids are arguments: with constants g++ threads the branches through the barriers.
__global__ void copy_before_expect(const float* x, float* out, int initer, int issuer, int arriver) {
    FA_DYNAMIC_SMEM(smem);
    uint64_t* bar = reinterpret_cast<uint64_t*>(smem);
    float* buf = reinterpret_cast<float*>(smem + 128);
    if (threadIdx.x == initer) {
        fa::mbarrier_init(bar, 1);
        fa::fence_mbarrier_init();
    }
    __syncthreads();
    if (threadIdx.x == issuer) fa::cp_async_bulk_g2s(buf, x, 128, bar);
    __syncthreads();
    if (threadIdx.x == arriver) fa::mbarrier_arrive_expect_tx(bar, 128);
    fa::mbarrier_wait_parity(bar, 0);
    fa::gstore(out + threadIdx.x, buf[threadIdx.x]);
}

// Racy on purpose: thread 0 reads the destination without waiting on the mbarrier, after a warp
// switch. When the copy lands is the schedule's choice (forward: not before every fiber waits).
__global__ void stale_read(const float* x, float* out) {
    FA_DYNAMIC_SMEM(smem);
    uint64_t* bar = reinterpret_cast<uint64_t*>(smem);
    float* buf = reinterpret_cast<float*>(smem + 128);
    if (threadIdx.x == 0) {
        fa::mbarrier_init(bar, 1);
        fa::fence_mbarrier_init();
        fa::mbarrier_arrive_expect_tx(bar, 16);
        fa::cp_async_bulk_g2s(buf, x, 16, bar);
    }
    __syncwarp();
    if (threadIdx.x == 0) {
        fa::gstore(out, buf[0]);
        fa::mbarrier_wait_parity(bar, 0);
        fa::gstore(out + 1, buf[0]);
    }
}

// One misuse per `which`; thread 0 does it, the others wait at the block's end (or at the barrier).
__global__ void misuse(int which, const float* x, int n) {
    FA_DYNAMIC_SMEM(smem);
    uint64_t* bar = reinterpret_cast<uint64_t*>(smem);
    unsigned char* data = smem + 256;
    if (which >= 100) {   // every thread waits at the barrier
        if (threadIdx.x == 0) {
            fa::mbarrier_init(bar, 1);
            fa::fence_mbarrier_init();
            if (which == 101) {
                fa::mbarrier_arrive_expect_tx(bar, 64);
                fa::cp_async_bulk_g2s(data, x, 32, bar);
            }
        }
        __syncthreads();
        fa::mbarrier_wait_parity(bar, 0);
        return;
    }
    if (threadIdx.x != 0) return;
    if (which != 0 && which != 1 && which != 2) {
        fa::mbarrier_init(bar, 1);
        if (which != 10) fa::fence_mbarrier_init();
    }
    switch (which) {
        case 0: fa::mbarrier_arrive(bar); break;
        case 1: fa::mbarrier_init(reinterpret_cast<uint64_t*>(smem + 4), 1); break;
        case 2: fa::mbarrier_init(reinterpret_cast<uint64_t*>(smem + 1024), 1); break;
        case 3: fa::mbarrier_arrive_expect_tx(bar, 16); fa::mbarrier_arrive(bar); break;
        case 4: fa::mbarrier_arrive_expect_tx(bar, 16); fa::cp_async_bulk_g2s(data, x, 32, bar);
                fa::mbarrier_wait_parity(bar, 0); break;
        case 5: fa::mbarrier_expect_tx(bar, (1 << 20) - 1); fa::mbarrier_expect_tx(bar, 1); break;
        case 6: fa::cp_async_bulk_g2s(data + 8, x, 32, bar); break;
        case 7: fa::cp_async_bulk_g2s(data, x, 24, bar); break;
        case 8: fa::cp_async_bulk_g2s(data, x + n - 4, 32, bar); break;
        case 9: fa::cp_async_bulk_g2s(smem + 1024 - 16, x, 32, bar); break;
        case 10: fa::cp_async_bulk_g2s(data, x, 32, bar); break;
        case 11: fa::mbarrier_init(bar, 2); break;
        case 12: fa::mbarrier_try_wait_parity(bar, 2); break;
        case 13: fa::cp_async_bulk_g2s(smem, x, 32, bar); break;
        case 14: fa::mbarrier_init(bar + 1, 0); break;
        case 15: fa::cp_async_bulk_g2s(data, x + 1, 32, bar); break;
        case 16: fa::mbarrier_expect_tx(bar, -4); break;
        case 17: fa::cp_async_bulk_g2s(data, x, 32, bar); fa::cp_async_bulk_g2s(data + 16, x, 32, bar); break;
        case 18: fa::cp_async_bulk_g2s(data, x, 32, bar); fa::mbarrier_inval(bar); break;
    }
}

// fa::ldmatrix over bytes a bulk copy in flight will write (no wait on the mbarrier).
__global__ void ldmatrix_too_early(const float* x) {
    FA_DYNAMIC_SMEM(smem);
    uint64_t* bar = reinterpret_cast<uint64_t*>(smem);
    if (threadIdx.x == 0) {
        fa::mbarrier_init(bar, 1);
        fa::fence_mbarrier_init();
        fa::mbarrier_arrive_expect_tx(bar, 256);
        fa::cp_async_bulk_g2s(smem + 256, x, 256, bar);
    }
    __syncwarp();
    uint32_t r[1];
    fa::ldmatrix<1, false>(r, smem + 256 + 16 * (threadIdx.x % 8));
    fa::mbarrier_wait_parity(bar, 0);
}
'''
NAMES = ["pipeline", "parity_rules", "copy_before_expect", "stale_read", "misuse", "ldmatrix_too_early"]
SCHEDULES = [("forward", 0), ("reverse", 0), ("random", 1), ("random", 2), ("random", 3)]


@pytest.fixture(scope="module")
def mod():
    # Built with the default flags: g++'s block copying that made one __syncthreads() two call
    # sites in these kernels is off for every build (host_compiler.FAMILY_FLAGS).
    return emulator.Module(SRC, name_expressions=NAMES)


# ---- the FlashAttention-3 producer/consumer ring ---------------------------------------------------
def run_pipeline(mod, tiles, elems, stages, copies, consumers, schedule="forward", seed=0, flip=1, early=0):
    x = np.random.default_rng(tiles * 100 + stages).standard_normal((tiles, elems)).astype(np.float32)
    out = np.full((tiles, elems), np.nan, np.float32)
    smem = 128 * ((16 * stages + 127) // 128) + stages * elems * 4
    args = (x, out, np.int32(tiles), np.int32(elems), np.int32(stages), np.int32(copies), np.int32(flip),
            np.int32(early))
    c = mod.launch("pipeline", 1, 32 * (1 + consumers), args, shared_mem=smem, schedule=schedule, seed=seed)
    return x, out, c


@pytest.mark.parametrize("schedule,seed", SCHEDULES)
@pytest.mark.parametrize("tiles,elems,stages,copies,consumers", [
    (7, 256, 3, 2, 2),    # stages wrap around twice, phase parities 0, 1, 0
    (9, 512, 2, 4, 1),
    (5, 128, 1, 1, 3),    # a single stage: every tile waits for the previous one's release
    (12, 64, 4, 1, 2),
])
def test_pipeline_is_exact_under_every_schedule(mod, schedule, seed, tiles, elems, stages, copies, consumers):
    x, out, c = run_pipeline(mod, tiles, elems, stages, copies, consumers, schedule, seed)
    expect = x * np.float32(2) + np.arange(tiles, dtype=np.float32)[:, None]
    assert out.tobytes() == expect.tobytes()
    assert c.bulk_copies == tiles * copies and c.bulk_copy_bytes == x.nbytes
    chunk = elems * 4 // copies   # each copy's source: one contiguous range of 32-byte sectors
    starts = x.ctypes.data + chunk * np.arange(tiles * copies)
    assert c.global_read_bytes == x.nbytes and c.gld_sectors_ideal == x.nbytes // 32
    assert c.gld_sectors == int(np.sum((starts + chunk + 31) // 32 - starts // 32))
    # the producer's empty waits, every consumer thread's full waits
    assert c.mbar_waits == tiles + tiles * 32 * consumers
    assert c.mbar_blocked > 0 and c.mma == 0 and c.cp_async == 0


def test_forward_lands_copies_late_reverse_early(mod):
    """Forward lands a copy only when no thread can run, so every consumer wait blocks; reverse lands
    it at the producer's next switch, so many consumer waits find the phase complete."""
    *_, fwd = run_pipeline(mod, 7, 256, 3, 2, 2, "forward")
    *_, rev = run_pipeline(mod, 7, 256, 3, 2, 2, "reverse")
    assert fwd.mbar_blocked >= 7 * 64 and rev.mbar_blocked < fwd.mbar_blocked


@pytest.mark.parametrize("schedule,seed", SCHEDULES[:3])
def test_wrong_producer_parity_is_a_deadlock(mod, schedule, seed):
    # the producer's empty wait with the consumers' parity: phase 0 of empty[0] needs a release of
    # a stage never filled
    with pytest.raises(emulator.EmulatorError, match=r"deadlock: thread \(0,0,0\) .* parity 0 of the mbarrier "
                       r"at shared offset 24 \(phase 0, parity 0; 2 of 2 arrivals pending; tx-count 0 bytes\)"):
        run_pipeline(mod, 7, 256, 3, 2, 2, schedule, seed, flip=0)


def test_early_release_is_caught_by_random_schedules(mod):
    """A stage released before it is read: the producer refills it under the consumers' feet. The
    forward schedule lands copies late and hides the race; random ones land them in between."""
    def correct(schedule, seed):
        x, out, _ = run_pipeline(mod, 7, 256, 1, 2, 2, schedule, seed, early=1)
        return out.tobytes() == (x * np.float32(2) + np.arange(7, dtype=np.float32)[:, None]).tobytes()
    assert correct("forward", 0)
    assert not any(correct("random", s) for s in range(8))


# ---- phase and parity rules -----------------------------------------------------------------------
@pytest.mark.parametrize("schedule,seed", SCHEDULES)
def test_parity_known_answers(mod, schedule, seed):
    x = np.arange(64, dtype=np.float32)
    log = np.full(16, -1, np.int64)
    c = mod.launch("parity_rules", 1, 64, (x, log), shared_mem=256, schedule=schedule, seed=seed)
    # try_wait(1) in phase 0: true (parity 1 names the phase before, complete); arrive -> token 0;
    # try_wait(0) after phase 0: true; arrive.expect_tx -> 1; try_wait(1) after phase 1: true;
    # arrive -> 2; after inval + init a fresh barrier: arrive -> 0
    assert log[:7].tolist() == [1, 0, 1, 1, 1, 2, 0]
    assert log[8:].view(np.float32).tolist() == x[:16].tolist()   # both copies landed by phase 1
    assert c.bulk_copies == 2 and c.bulk_copy_bytes == 64 and c.mbar_waits == 6
    if schedule == "forward":   # thread 0 blocks on phases 0 and 1; thread 32 finds phase 0 done
        assert c.mbar_blocked == 2


@pytest.mark.parametrize("schedule,seed", SCHEDULES)
def test_copy_may_land_before_its_expect_tx(mod, schedule, seed):
    """The tx-count may go negative while arrivals are pending (reverse lands the copy first)."""
    x = np.arange(64, dtype=np.float32) + 1
    out = np.zeros(64, np.float32)
    mod.launch("copy_before_expect", 1, 64, (x, out, np.int32(0), np.int32(32), np.int32(33)), shared_mem=512,
               schedule=schedule, seed=seed)
    assert out[:32].tolist() == x[:32].tolist()


def test_when_a_copy_lands_is_the_schedules_choice(mod):
    x = np.arange(1, 5, dtype=np.float32)
    for schedule, first in [("forward", None), ("reverse", 1.0)]:
        out = np.zeros(2, np.float32)
        mod.launch("stale_read", 1, 32, (x, out), shared_mem=512, schedule=schedule)
        assert (np.isnan(out[0]) if first is None else out[0] == first) and out[1] == 1.0


# ---- errors ---------------------------------------------------------------------------------------
WHERE = r"kernel 'misuse' block \(0,0,0\) thread \(0,0,0\) \[warp 0 lane 0\]: "
BAR0 = r"the mbarrier at shared offset 0 \(phase 0, parity 0; %d of 1 arrivals pending; tx-count %d bytes\)"
ERRORS = [
    (0, r"fa::mbarrier_arrive: no mbarrier is initialized at shared offset 0 \(used before fa::mbarrier_init"),
    (1, r"fa::mbarrier_init: mbarrier address is not 8-byte aligned: shared offset 4 "),
    (2, r"fa::mbarrier_init: mbarrier address 0x[0-9a-f]+ is outside dynamic shared memory: shared offset 1024 "
        r"\(dynamic shared memory is 1024 bytes\)"),
    (3, r"fa::mbarrier_arrive: arrival beyond the expected count: " + BAR0 % (0, 16)),
    (4, r"fa::cp_async_bulk_g2s \(32 bytes to shared offset 256 .*\) lands: complete-tx of 32 bytes underflows the "
        r"tx-count of " + BAR0 % (0, 16) + r" to -16: more bytes completed than expected"),
    (5, r"fa::mbarrier_expect_tx: expect-tx of 1 bytes overflows the tx-count of " + BAR0 % (1, 1048575)),
    (6, r"fa::cp_async_bulk_g2s: destination is not 16-byte aligned: shared offset 264 "),
    (7, r"fa::cp_async_bulk_g2s: size 24 bytes is not a positive multiple of 16"),
    (8, r"out-of-bounds fa::cp_async_bulk_g2s global read of 32 bytes: .*nearest is argument 1 \(256 bytes\): "
        r"byte offset 240"),
    (9, r"fa::cp_async_bulk_g2s: destination 0x[0-9a-f]+ \(32 bytes\) is outside dynamic shared memory: "
        r"shared offset 1008"),
    (10, r"fa::cp_async_bulk_g2s completes on " + BAR0 % (1, 0) + r", which its initializing thread 0 has not "
         r"made visible to the async proxy: fa::fence_mbarrier_init\(\)"),
    (11, r"fa::mbarrier_init: shared offset 0 holds a live mbarrier \(initialized by thread 0\): "
         r"fa::mbarrier_inval it first"),
    (12, r"fa::mbarrier_try_wait_parity: phase parity 2 is not 0 or 1"),
    (13, r"fa::cp_async_bulk_g2s: destination shared offset 0 .* overwrites the live " + BAR0[4:] % (1, 0)),
    (14, r"fa::mbarrier_init: arrival count 0 is outside \[1, 2\^20-1\]"),
    (15, r"fa::cp_async_bulk_g2s: global source 0x[0-9a-f]+ is not 16-byte aligned"),
    (16, r"fa::mbarrier_expect_tx: tx byte count -4 is outside \[0, 2\^20-1\]"),
    (17, r"fa::cp_async_bulk_g2s: destination overlaps shared offset 272 .*the destination of a bulk copy "
         r"\(fa::cp_async_bulk_g2s, 32 bytes\) issued by thread 0 .*\(two copies in flight write the same bytes\)"),
    (18, r"fa::mbarrier_inval: a bulk copy issued by thread 0 is in flight and completes on " + BAR0 % (1, 0)),
]


@pytest.mark.parametrize("which,pattern", ERRORS, ids=[str(w) for w, _ in ERRORS])
def test_misuse_is_a_checked_error(mod, which, pattern):
    x = np.arange(64, dtype=np.float32)
    with pytest.raises(emulator.EmulatorError) as e:
        mod.launch("misuse", 1, 64, (np.int32(which), x, np.int32(64)), shared_mem=1024)
    assert re.search(WHERE + pattern, str(e.value)), str(e.value)


def test_ldmatrix_of_a_copy_in_flight(mod):
    with pytest.raises(emulator.EmulatorError, match=r"thread \(0,0,0\) \[warp 0 lane 0\]: fa::ldmatrix reads "
                       r"shared offset 256 .*the destination of a bulk copy \(fa::cp_async_bulk_g2s, 256 bytes\) "
                       r"issued by thread 0 that has not completed on its mbarrier at shared offset 0 yet"):
        mod.launch("ldmatrix_too_early", 1, 32, (np.zeros(64, np.float32),), shared_mem=1024, schedule="forward")


@pytest.mark.parametrize("schedule,seed", SCHEDULES[:3])
@pytest.mark.parametrize("which,pending,tx", [(100, 1, 0), (101, 0, 32)])
def test_deadlock_is_reported_promptly(mod, schedule, seed, which, pending, tx):
    """100: nobody arrives; 101: the only arrival expected 64 bytes, the one copy brings 32."""
    x = np.arange(64, dtype=np.float32)
    t0 = time.monotonic()
    with pytest.raises(emulator.EmulatorError) as e:
        mod.launch("misuse", 1, 64, (np.int32(which), x, np.int32(64)), shared_mem=1024, schedule=schedule, seed=seed)
    assert time.monotonic() - t0 < 10
    assert re.search(r"kernel 'misuse' block \(0,0,0\): deadlock: thread \(\d+,0,0\) \[warp \d lane \d+\] waits for "
                     r"the phase of parity 0 of " + BAR0 % (pending, tx) + r" to complete, and no bulk copy in "
                     r"flight can complete it \(64 thread\(s\) wait at mbarriers, 0 at __syncthreads\(\), 0 at "
                     r"warp collectives, 0 exited\)", str(e.value)), str(e.value)
    x, out, _ = run_pipeline(mod, 7, 256, 3, 2, 2, schedule, seed)   # the runtime is left clean
    assert out.tobytes() == (x * np.float32(2) + np.arange(7, dtype=np.float32)[:, None]).tobytes()


# ---- GPU code -------------------------------------------------------------------------------------
@requires_nvrtc
def test_sm90_ptx_and_sass():
    from flasharray._private import nvrtc, sass
    r = nvrtc.compile_cubin(SRC, "sm_90", name_expressions=["pipeline", "parity_rules"])
    for instr in ("mbarrier.init.shared::cta.b64", "fence.mbarrier_init.release.cluster",
                  "mbarrier.try_wait.parity.shared::cta.b64", "mbarrier.arrive.expect_tx.shared::cta.b64",
                  "mbarrier.arrive.shared::cta.b64", "mbarrier.expect_tx.relaxed.cta.shared::cta.b64",
                  "mbarrier.inval.shared::cta.b64",
                  "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"):
        assert instr in r.ptx, instr
    for name in ("pipeline", "parity_rules"):
        info = r.kernel(name)
        assert info.spill_stores == 0 and info.spill_loads == 0
    ok, why = sass.available()
    if not ok:
        pytest.skip(why)
    fns = sass.parse(sass.disassemble(r.cubin))
    ops = {name: {i.opcode for i in fns[r.kernel(name).lowered_name]} for name in ("pipeline", "parity_rules")}
    # mbarrier.init -> SYNCS.EXCH.64, arrive(.expect_tx) -> SYNCS.ARRIVE.TRANS64*, try_wait.parity ->
    # SYNCS.PHASECHK.TRANS64.TRYWAIT, cp.async.bulk -> UBLKCP.S.G, fence.mbarrier_init -> FENCE.VIEW.ASYNC.S
    for o in ("SYNCS.EXCH.64", "SYNCS.ARRIVE.TRANS64.A1T0", "SYNCS.PHASECHK.TRANS64.TRYWAIT", "UBLKCP.S.G",
              "FENCE.VIEW.ASYNC.S"):
        assert o in ops["pipeline"], (o, sorted(ops["pipeline"]))
    # expect_tx without arrival -> SYNCS.ARRIVE.TRANS64.RED.A0TR (zero arrivals, tx); inval -> SYNCS.CCTL.IV
    assert {"SYNCS.ARRIVE.TRANS64.RED.A0TR", "SYNCS.CCTL.IV"} <= ops["parity_rules"], sorted(ops["parity_rules"])


@requires_nvrtc
def test_below_sm90_is_a_compile_error_at_the_use():
    from flasharray._private import nvrtc
    with pytest.raises(nvrtc.NvrtcError, match=r"mbarrier and bulk copies need sm_90\+"):
        nvrtc.compile_cubin(SRC, "sm_80", name_expressions=["pipeline"])
