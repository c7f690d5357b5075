"""The float64 backward on the DMMA tensor cores (cuda_src/flash_bwd_f64.cu, issue 12) on the emulator.

The dK/dV kernel ``flash_bwd_dkv_f64_kernel`` (atomic dQ, plain or in key-block order) and the
double accumulator's conversion (``flash_bwd_convert_dq_tc_kernel<double, ..., double>``) are
launched here directly (``launch_f64``: the host's argument list, L_i from the float64 reference
forward, D_i = rowsum(dO ∘ O)), so the kernel is held to the DESIGN.md rule for float64
(``assert_attention_close``: bound = the reference's atol 1e-12 per unit of magnitude) on its own;
``test_api_*`` go through ``cuda_backward.backward`` (device="emulator"), where float64 on sm_80+
runs this kernel. Its max error against a long-double reference is compared with the SIMT fp64
backward's on the same inputs (both ~1e-16 relative).

Default run: a representative subset (head dims 16/32/36/40/59/64/72/128, Dv != D, Lq != Lk, lengths
not multiples of the tiles, causal with fully masked rows, MQA/GQA groups, BSHD strided views, the
element-wise copy paths, both dQ modes); ``-m slow``: head dims x lengths x causal x groups.
"""
import dataclasses
import itertools

import numpy as np
import pytest

from flasharray import emulator, reference, testing
from flasharray._private import cuda_backward_f64 as F
from flasharray._private import launch, tiles
from conftest import flag_set, thin

ARCHS = (80, 86, 89, 90)


# ---- inputs and the direct launch ---------------------------------------------------------------
class Inputs:
    """q, dout (B, H, Lq, ·), k, v (B, Hk, Lk, ·) with H = Hk·G (query head h uses K/V head h // G),
    the float64 reference forward's out and lse; layout "bshd": (B, L, H, ·) storage, viewed."""

    def __init__(self, D, Lq, Lk, *, Dv=None, B=2, Hk=2, G=1, causal=False, layout="bhsd", seed=0):
        Dv = D if Dv is None else Dv
        rng = np.random.default_rng(seed)
        H = Hk * G

        def make(h, L, d):
            if layout == "bshd":
                return np.swapaxes(rng.standard_normal((B, L, h, d)), 1, 2)
            return rng.standard_normal((B, h, L, d))
        self.q, self.k, self.v, self.dout = make(H, Lq, D), make(Hk, Lk, D), make(Hk, Lk, Dv), make(H, Lq, Dv)
        self.B, self.Hk, self.G, self.causal, self.scale = B, Hk, G, causal, 1.0 / np.sqrt(D)
        self.out, self.lse = reference.attention(*self.grouped(), causal=causal, scale=self.scale, return_lse=True)
        self.out = self.out.reshape(B, H, Lq, Dv)
        self.lse = self.lse.reshape(B, H, Lq)

    def grouped(self):
        """q (B, Hk, G, Lq, D), k, v (B, Hk, 1, Lk, ·): the reference's broadcasting of the group."""
        B, Hk, G = self.B, self.Hk, self.G
        return (self.q.reshape(B, Hk, G, *self.q.shape[2:]), self.k[:, :, None], self.v[:, :, None])

    def check(self, grads):
        dq, dk, dv = grads
        q5, k5, v5 = self.grouped()
        testing.assert_attention_close(self.out.reshape(q5.shape[:3] + self.out.shape[2:]), q5, k5, v5,
                                       causal=self.causal, scale=self.scale, dout=self.dout.reshape(
                                           q5.shape[:3] + self.dout.shape[2:]),
                                       grads=(dq.reshape(q5.shape), dk[:, :, None], dv[:, :, None]))


_DENSE_TAIL = None


def _dense_tail():
    """FLASH_EXT_PARAMS(double) of a dense launch: zeros and never-read one-element arrays."""
    global _DENSE_TAIL
    if _DENSE_TAIL is None:
        i64, i32 = np.int64, np.int32
        ints, dbls, bools = np.zeros(1, np.int32), np.zeros(1), np.zeros(1, np.bool_)
        _DENSE_TAIL = ([ints, ints, i64(0), i64(0), i64(0), i32(0), i32(0), 0.0, dbls, i64(0), i64(0), i64(0), 0.0,
                        bools] + [i64(0)] * 5 + [i32(0), i32(0)] + [np.uint32(0)] * 4 + [0.0] + [i64(0)] * 4)
    return _DENSE_TAIL


_MODULES = {}


def _module(source, names):
    key = (source, tuple(names))
    if key not in _MODULES:
        _MODULES[key] = emulator.Module(launch.kernel_source(source), name_expressions=list(names),
                                        include_dirs=[str(launch.cuda_src_dir())], options=["-std=c++17"])
    return _MODULES[key]


def is_vec(p):
    """The host's kVecLoad: every row of q, k, v, dout 16-byte aligned, D and Dv even."""
    D, Dv = p.q.shape[-1], p.v.shape[-1]
    return D % 2 == 0 and Dv % 2 == 0 and all(
        a.ctypes.data % 16 == 0 and a.strides[2] % 16 == 0 for a in (p.q, p.k, p.v, p.dout))


def launch_f64(p, *, ordered=True, arch=80, vec=None, stages=None, schedule="forward", seed=0, counters=None):
    """dq, dk, dv of ``p`` by the DMMA dK/dV kernel and the double conversion (the host's arguments);
    ``stages`` forces 1 or 2 buffers of Q_i, dO_i, L_i, D_i (default: the tile table's)."""
    B, Hk, G = p.B, p.Hk, p.G
    H, Lq, D = p.q.shape[1:]
    Lk, Dv = p.v.shape[2:]
    t = F.backward_tile(None, np.float64, D, Dv, arch)
    pD, pDv = tiles.pad_head_dim(D), tiles.pad_head_dim(Dv)
    if stages is not None:
        t = dataclasses.replace(t, stages=stages, smem=F.smem_bytes(pD, pDv, t.block_m, t.block_n, t.n_threads // 32,
                                                                    stages))
    vec = is_vec(p) if vec is None else vec
    Tr = -(-Lq // t.block_m)
    rows = Tr * t.block_m + (-(-Tr // pD) if ordered else 0)  # DQAccumLayout blocks (+ DQOrderCounters)
    def full(shape, x):  # 256-byte aligned, as CuPy allocates (the emulator's sector counts)
        a = launch.empty(np, shape, np.float64)
        a[...] = x
        return a
    dqa = full((B, H, rows, pD), 0.0)
    dq = full((B, H, Lq, D), np.nan)
    dk, dv = full((B, Hk, Lk, D), np.nan), full((B, Hk, Lk, Dv), np.nan)
    delta = (p.dout * p.out).sum(-1)
    lse = np.ascontiguousarray(p.lse)
    i64, i32 = np.int64, np.int32

    def st(a, group=True, row=True):  # element strides (b0, b1 = K/V head, b2, [group], [row])
        s = [i64(a.strides[0] // 8), i64(a.strides[1] // 8 * (G if group else 1)), i64(0)]
        return s + ([i64(a.strides[1] // 8)] if group else []) + ([i64(a.strides[2] // 8)] if row else [])
    name = F.dkv_name(t, None, pD, pDv, p.causal, vec, ordered)
    args = ([p.q, *st(p.q)] + [p.k, *st(p.k, False)] + [p.v, *st(p.v, False)] + [p.dout, *st(p.dout)]
            + [lse, *st(lse, row=False)] + [delta, *st(delta, row=False)] + [dqa, *st(dqa, row=False), i64(pD)]
            + [dk, *st(dk, False)] + [dv, *st(dv, False)]
            + [i32(Lq), i32(Lk), i32(D), i32(Dv), i32(1), i32(G), float(p.scale)] + _dense_tail())
    c = _module(F.SOURCE, [name]).launch(name, (-(-Lk // t.block_n), Hk, B), (t.n_threads,), args,
                                         shared_mem=t.smem, schedule=schedule, seed=seed)
    conv = F.convert_name(t, pD, D)
    c2 = _module("flash_bwd_convert.cu", [conv]).launch(
        conv, (Tr, H, B), (128,), [dqa, i64(dqa.strides[0] // 8), i64(dqa.strides[1] // 8), i64(0),
                                   dq, i64(dq.strides[0] // 8), i64(dq.strides[1] // 8), i64(0), i64(D),
                                   i32(Lq), i32(D), i32(1), float(p.scale)])
    if counters is not None:
        counters += [(name, c), (conv, c2)]
    return dq, dk, dv


# ---- correctness --------------------------------------------------------------------------------
# (D, Dv, Lq, Lk, causal, Hk, G, layout, ordered): every head dim class of the tile table (kMT = 2,
# kMT = 1 with dV in registers / in shared memory), odd and non-multiple-of-16 dims (element copies,
# element stores of the conversion), Lq > Lk causal (rows that see no key), one-row calls, MQA and GQA.
SUBSET = [
    (16, 16, 70, 33, True, 2, 1, "bhsd", True),
    (32, 32, 65, 127, True, 1, 4, "bshd", True),
    (40, 24, 33, 70, True, 2, 3, "bhsd", False),
    (59, 59, 17, 63, False, 2, 1, "bhsd", True),
    (64, 64, 77, 130, False, 1, 2, "bhsd", True),
    (72, 72, 45, 45, True, 2, 1, "bshd", False),
    (128, 128, 65, 63, True, 1, 3, "bhsd", True),
    (36, 128, 1, 17, False, 2, 2, "bhsd", True),
    (128, 48, 50, 1, True, 1, 1, "bhsd", False),
]


def _id(c):
    D, Dv, Lq, Lk, causal, Hk, G, layout, ordered = c
    return "d%d-dv%d-%dx%d%s-hk%d-g%d-%s-%s" % (D, Dv, Lq, Lk, "-causal" if causal else "", Hk, G, layout,
                                                "ordered" if ordered else "atomic")


@pytest.mark.parametrize("case", thin(SUBSET), ids=_id)
def test_backward_f64(case):
    D, Dv, Lq, Lk, causal, Hk, G, layout, ordered = case
    p = Inputs(D, Lq, Lk, Dv=Dv, Hk=Hk, G=G, causal=causal, layout=layout)
    p.check(launch_f64(p, ordered=ordered))


def test_element_copies_match_cp_async():
    """kVecLoad = false (element loads) on aligned inputs gives bitwise the cp.async path's result."""
    p = Inputs(64, 50, 70, Dv=32, G=2, causal=True)
    assert is_vec(p)
    a, b = launch_f64(p), launch_f64(p, vec=False)
    for x, y in zip(a, b):
        assert x.tobytes() == y.tobytes()


@pytest.mark.parametrize("D,Dv,causal,G", [(64, 64, True, 3), (128, 128, False, 1), (16, 40, True, 2)])
def test_prefetch_matches_single_buffer(D, Dv, causal, G):
    """kStages = 2 (the next visit's Q_i, dO_i, L_i, D_i copied during this visit's products) gives
    bitwise the one-buffer kernel's dq, dk, dv, in the ordered mode under a random schedule too (the
    prefetch changes when data lands, never what is summed or in which order); Lq not a multiple of
    Br (rows past Lq zero-filled, L_i·log2e = +inf), causal rows without keys, group wrap-around."""
    p = Inputs(D, 70, 45, Dv=Dv, Hk=1, G=G, causal=causal)
    one = launch_f64(p, stages=1)
    p.check(one)
    for schedule, seed in (("forward", 0), ("random", 3)):
        two = launch_f64(p, stages=2, schedule=schedule, seed=seed)
        for a, b in zip(one, two):
            assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("arch", [86, 90])
def test_other_arch_tiles(arch):
    """sm_86's 2-warp tile (d > 80: Bc = 16) and sm_90's on the emulator."""
    p = Inputs(112, 40, 37, Dv=96, G=2, causal=True)
    assert F.backward_tile(None, np.float64, 112, 96, arch).n_threads == (64 if arch == 86 else 128)
    p.check(launch_f64(p, arch=arch))


@pytest.mark.parametrize("D, Dv, arch", thin([(64, 64, 90), (40, 64, 90), (64, 48, 80), (64, 64, 86)], unpack=True))
@pytest.mark.parametrize("causal", [False, True])
def test_wide_query_tile(D, Dv, arch, causal):
    """96 < d + dv <= 128 (cuda_backward_f64.WIDE_QUERY): Br = 32, so that the dQ product's four 16 x 32 tiles
    keep the 4 warps busy (Br = 16 idled two); sm_90 keeps both buffers, sm_80 / 86 one (their resident warps).
    Gradients within the rule in both dQ modes (Lq not a multiple of 32, a partial key block), the ordered
    mode bitwise under a reverse schedule."""
    t = F.backward_tile(None, np.float64, D, Dv, arch)
    # sm_90's m16n8k16 tile (d = dv = 64) adds P and dV_j in shared memory: two buffers would cost the second block.
    assert (t.block_m, t.block_n, t.n_threads, t.stages) == (32, 32, 128, 2 if arch == 90 and t.dmma_k == 4 else 1)
    assert t.dmma_k == (16 if arch == 90 and D == 64 else 4)
    p = Inputs(D, 77, 70, Dv=Dv, G=2, causal=causal)
    ref = launch_f64(p, arch=arch)
    p.check(ref)
    for a, b in zip(ref, launch_f64(p, arch=arch, schedule="reverse")):
        assert a.tobytes() == b.tobytes()
    p.check(launch_f64(p, arch=arch, ordered=False))


def test_wide_query_switch(monkeypatch):
    """WIDE_QUERY off: the Br = 16 tile (both buffers on sm_80 / 90) at d = dv = 64; d + dv <= 96 keeps Br = 32."""
    monkeypatch.setattr(F, "WIDE_QUERY", False)
    for arch in (80, 90):
        t = F.backward_tile(None, np.float64, 64, 64, arch)
        assert (t.block_m, t.block_n, t.stages) == (16, 32, 2)
    assert F.backward_tile(None, np.float64, 48, 48, 80).block_m == 32


@pytest.mark.parametrize("D,Dv,Lq,Lk,causal,G,layout", thin([
    (64, 64, 77, 70, True, 2, "bhsd"),      # Br 32, dV_j in shared memory, partial key and query blocks
    (128, 128, 70, 150, False, 1, "bhsd"),  # Br 16, two buffers, dV_j in shared memory
    (64, 32, 40, 33, True, 3, "bshd"),      # d != dv, dV_j in registers, GQA, BSHD strides
    (96, 64, 47, 100, False, 1, "bhsd"),    # d 96: three 16-column pairs in the warp pair's halves
    (32, 64, 1, 45, True, 2, "bhsd"),       # Lq 1, causal: query rows without keys
], unpack=True))
def test_sm90_m16n8k16_gives_the_m8n8k4_bits(D, Dv, Lq, Lk, causal, G, layout):
    """sm_90's m16n8k16 kernel (kDmmaK = 16: warp pairs share 16 keys, P and dS through shared memory) issues
    the m8n8k4 kernel's k4 steps in the same order for every product, so on the emulator (one fp64 FMA chain per
    element for both shapes) the ordered mode's dq, dk, dv are the same bits, under a random schedule too, with
    one mma per eight, no shuffles (no epilogue exchange: natural columns) and the same HBM bytes."""
    p = Inputs(D, Lq, Lk, Dv=Dv, G=G, causal=causal, layout=layout)
    runs = {}
    for k16 in (True, False):
        with flag_set(F, "DMMA_K16", k16):
            assert F.backward_tile(None, np.float64, D, Dv, 90).dmma_k == (16 if k16 else 4)
            counters = []
            grads = launch_f64(p, arch=90, schedule="random" if k16 else "forward", seed=4, counters=counters)
        runs[k16] = grads, counters[0][1]
    for a, b in zip(runs[True][0], runs[False][0]):
        assert a.tobytes() == b.tobytes()
    c16, c4 = runs[True][1], runs[False][1]
    assert c16.mma * 8 == c4.mma > 0 and c16.shuffles == 0
    assert (c16.global_read_bytes, c16.global_write_bytes) == (c4.global_read_bytes, c4.global_write_bytes)
    p.check(runs[True][0])


def test_sm90_m16n8k16_atomic_mode():
    """deterministic=False's plain atomics on the m16n8k16 kernel: within the rule (the order of dQ's adds is the
    schedule's; dK, dV are not atomics: the same bits as the ordered mode)."""
    p = Inputs(128, 65, 90, G=2, causal=True)
    ordered = launch_f64(p, arch=90)
    atomic = launch_f64(p, arch=90, ordered=False, schedule="random", seed=2)
    p.check(atomic)
    assert atomic[1].tobytes() == ordered[1].tobytes() and atomic[2].tobytes() == ordered[2].tobytes()


SCHEDULES = [("reverse", 0), ("random", 1), ("random", 2)]


def test_ordered_bitwise_under_schedules(monkeypatch):
    """kOrderedDQ: dq, dk, dv bitwise identical under every fiber schedule and worker count (every
    dQ sum runs in key-block order; the reverse schedule makes the waits block)."""
    p = Inputs(64, 97, 130, G=3, Hk=1, causal=True)
    counters = []
    monkeypatch.setenv("FLASHARRAY_EMULATOR_THREADS", "1")
    ref = launch_f64(p, counters=counters)
    p.check(ref)
    # one worker in block order: no wait blocks (a block waits only for blocks with smaller indices)
    assert counters[0][1].sem_waits > 0 and counters[0][1].sem_blocked == 0
    for workers in ("1", "2"):
        monkeypatch.setenv("FLASHARRAY_EMULATOR_THREADS", workers)
        for schedule, seed in SCHEDULES:
            counters = []
            got = launch_f64(p, schedule=schedule, seed=seed, counters=counters)
            for a, b in zip(ref, got):
                assert a.tobytes() == b.tobytes(), (workers, schedule, seed)
        assert counters[0][1].sem_blocked > 0


def test_atomic_mode_under_schedules():
    """Plain atomics (deterministic=False) in any order stay within the rule."""
    p = Inputs(32, 97, 130, Hk=1, G=4, causal=True)
    for schedule, seed in SCHEDULES:
        p.check(launch_f64(p, ordered=False, schedule=schedule, seed=seed))


def visits(Lq, Lk, causal, t, G):
    """(key block, query block) pairs visited per K/V batch entry (times the group)."""
    Tr, Tc = -(-Lq // t.block_m), -(-Lk // t.block_n)
    n = 0
    for j in range(Tc):
        first = max(0, j * t.block_n - (Lk - Lq)) // t.block_m if causal else 0
        n += max(0, Tr - first)
    return n * G


@pytest.mark.parametrize("D,Dv,causal", [(64, 64, False), (128, 40, True), (16, 16, True)])
def test_dmma_counts(D, Dv, causal):
    """The DMMA kernel runs: per visited block pair Br·Bc·(3 d + 2 dv)/256 m8n8k4 (S^T, dP^T, dV, dK,
    dQ); in ordered mode one wait and post per visit; the conversion does no mma."""
    p = Inputs(D, 100, 75, Dv=Dv, Hk=2, G=2, causal=causal)
    counters = []
    launch_f64(p, counters=counters)
    (name, c), (_, conv) = counters
    t = F.backward_tile(None, np.float64, D, Dv, 80)
    n = p.B * p.Hk * visits(100, 75, causal, t, p.G)
    pD, pDv = tiles.pad_head_dim(D), tiles.pad_head_dim(Dv)
    assert c.mma == n * t.block_m * t.block_n * (3 * pD + 2 * pDv) // 256
    assert c.sem_waits == n and c.ldmatrix == 0 and conv.mma == 0
    assert c.cp_async > 0


def test_rows_without_keys_are_zero():
    """Causal with Lq > Lk: rows i < Lq − Lk see no key (L_i = −inf) and get dQ = 0 exactly; every
    gradient element is written (the outputs start as NaN)."""
    p = Inputs(32, 90, 20, causal=True)
    dq, dk, dv = launch_f64(p)
    p.check((dq, dk, dv))
    assert not (np.isnan(dq).any() or np.isnan(dk).any() or np.isnan(dv).any())
    assert (dq[:, :, :70] == 0).all() and (dq[:, :, 70:] != 0).all()


def aligned(a):
    """A C-contiguous, 256-byte aligned copy (CuPy's allocations; NumPy's are 16-byte aligned)."""
    out = launch.empty(np, a.shape, a.dtype)
    out[...] = a
    return out


@pytest.mark.parametrize("D", [16, 40, 128])
def test_memory_efficiency(D):
    """cp.async destinations conflict-free, loads >= 0.99 of the ideal sectors; the dQ atomics (each
    warp-wide: 256 contiguous bytes of DQAccumLayout) and the dK, dV stores (quad exchange: 64-byte
    row segments per instruction) whole sectors; the conversion reads and writes whole sectors."""
    p = Inputs(D, 128, 100, B=1, Hk=1)
    p.q, p.k, p.v, p.dout = (aligned(a) for a in (p.q, p.k, p.v, p.dout))
    counters = []
    p.check(launch_f64(p, counters=counters))
    (_, c), (_, conv) = counters
    assert c.cp_async_conflict_factor == 1 and c.load_sector_efficiency >= 0.99
    assert c.store_sector_efficiency == 1.0
    assert conv.load_sector_efficiency == 1.0 and conv.store_sector_efficiency == 1.0


# ---- accuracy vs the SIMT fp64 backward ---------------------------------------------------------
def exact_grads(p):
    """dq, dk, dv in long double (dq, dk, dv of the float64 inputs, to ~1e-19)."""
    ld = np.longdouble
    q5, k5, v5 = (a.astype(ld) for a in p.grouped())
    do = p.dout.reshape(q5.shape[:3] + p.dout.shape[2:]).astype(ld)
    s = q5 @ np.swapaxes(k5, -1, -2) * ld(p.scale)
    Lq, Lk = s.shape[-2:]
    if p.causal:
        s = np.where(reference.causal_mask(Lq, Lk), s, -np.inf)
    m = np.max(s, -1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(s - m)
    lsum = e.sum(-1, keepdims=True)
    P = e / np.where(lsum > 0, lsum, 1)
    dv = (np.swapaxes(P, -1, -2) @ do).sum(2)
    dP = do @ np.swapaxes(v5, -1, -2)
    dS = P * (dP - (do * (P @ v5)).sum(-1, keepdims=True))
    dq = (dS @ k5) * ld(p.scale)
    dk = (np.swapaxes(dS, -1, -2) @ q5).sum(2) * ld(p.scale)
    return dq.reshape(p.q.shape), dk, dv


def simt_grads(p):
    from flasharray._private import cuda_backward as cb
    q5, k5, v5 = p.grouped()
    do = p.dout.reshape(q5.shape[:3] + p.dout.shape[2:])
    out, lse = p.out.reshape(do.shape), p.lse.reshape(do.shape[:-1])
    dq, dk, dv = cb.backward(do, q5, k5, v5, out, lse, causal=p.causal, scale=p.scale, batch_shape=q5.shape[:3],
                             device="emulator", kernel="simt")[:3]
    return dq.reshape(p.q.shape), dk[:, :, 0], dv[:, :, 0]


@pytest.mark.parametrize("D,Lq,Lk,causal", [(64, 77, 130, False), (128, 65, 63, True), (40, 90, 50, True),
                                             (16, 200, 200, False)])
def test_error_at_simt_fp64_level(D, Lq, Lk, causal):
    """Max |grad − exact| (long double) of the DMMA kernel, both dQ modes, within 2x of the larger of
    the SIMT fp64 backward's and the naive float64 reference's own (floor: 4 fp64 ulps of the
    gradient's magnitude); all below 1e-14. Measured 0.5-1.8x the SIMT kernel's, 0.5-2.4x the
    float64 reference's (dK_j, dV_j summed per visit from zero, then added: blocked summation)."""
    p = Inputs(D, Lq, Lk, G=2, causal=causal, seed=3)
    exact = exact_grads(p)
    simt = simt_grads(p)
    q5, k5, v5 = p.grouped()
    ref = reference.attention_backward(p.dout.reshape(q5.shape[:3] + p.dout.shape[2:]), q5, k5, v5,
                                       causal=causal, scale=p.scale)
    ref = (ref[0].reshape(p.q.shape), ref[1][:, :, 0], ref[2][:, :, 0])
    for ordered in (True, False):
        dmma = launch_f64(p, ordered=ordered)
        for name, g, s, r, x in zip(("dq", "dk", "dv"), dmma, simt, ref, exact):
            mag = float(np.abs(x).max())
            err = [float(np.abs(a - x).max()) for a in (g, s, r)]
            assert err[0] <= 2 * max(err[1], err[2], 4 * np.finfo(np.float64).eps * max(1.0, mag)), (name, err)
            assert err[0] < 1e-14, (name, err)


# ---- through the library (cuda_backward.backward / flash_attention_backward, device "emulator") ---
def api_grads(p, **opts):
    """cuda_backward.backward on the grouped inputs; (dq, dk, dv, counters) in Inputs' shapes."""
    from flasharray._private import cuda_backward as cb
    q5, k5, v5 = p.grouped()
    do = p.dout.reshape(q5.shape[:3] + p.dout.shape[2:])
    out, lse = p.out.reshape(do.shape), p.lse.reshape(do.shape[:-1])
    dq, dk, dv, counters = cb.backward(do, q5, k5, v5, out, lse, causal=p.causal, scale=p.scale,
                                       batch_shape=q5.shape[:3], device="emulator", return_counters=True, **opts)
    return dq.reshape(p.q.shape), dk[:, :, 0], dv[:, :, 0], counters


@pytest.mark.parametrize("deterministic", [True, False])
def test_api_runs_dmma_kernel(deterministic):
    """float64 on the emulator's sm_80 runs this kernel (ordered by default, plain atomics with
    deterministic=False) and the double conversion, with this file's DMMA count; deterministic:
    bitwise the same under another fiber schedule."""
    p = Inputs(40, 70, 45, Dv=24, G=2, causal=True)
    *grads, counters = api_grads(p, deterministic=deterministic)
    p.check(grads)
    names = [name for name, _ in counters]
    (dkv,) = [c for name, c in counters if name.startswith("flash_bwd_dkv_f64_kernel")]
    (name,) = [n for n in names if n.startswith("flash_bwd_dkv_f64_kernel")]
    assert name.split(", ")[-2] == ("true" if deterministic else "false")  # kOrderedDQ, then kStages
    assert any(n.startswith("flash_bwd_convert_dq_tc_kernel<double") and n.endswith(", double>") for n in names)
    t = F.backward_tile(None, np.float64, 40, 24, tiles.EMULATOR_ARCH)
    assert dkv.mma == p.B * p.Hk * visits(70, 45, True, t, p.G) * t.block_m * t.block_n * (3 * 48 + 2 * 32) // 256
    if deterministic:  # bitwise reproducible under another schedule
        for a, b in zip(grads, api_grads(p, schedule="random", seed=5)[:3]):
            assert a.tobytes() == b.tobytes()


def test_api_runs_m16n8k16_on_sm90():
    """float64 gradients with arch=90 run the m16n8k16 kernel (its name's kDmmaK 16, an eighth of the mma), the
    DMMA_K16 switch the m8n8k4 one: the same bits."""
    p = Inputs(64, 70, 45, G=2, causal=True)
    runs = {}
    for k16 in (True, False):
        with flag_set(F, "DMMA_K16", k16):
            *grads, counters = api_grads(p, arch=90)
        (name, dkv), = [(n, c) for n, c in counters if n.startswith("flash_bwd_dkv_f64_kernel")]
        assert name.endswith(", 16>") == k16
        runs[k16] = grads, dkv.mma
    p.check(runs[True][0])
    for a, b in zip(runs[True][0], runs[False][0]):
        assert a.tobytes() == b.tobytes()
    assert runs[True][1] * 8 == runs[False][1]


def test_api_flash_attention_backward():
    """flasharray.flash_attention_backward(backend="emulator") on float64: forward and backward on
    DMMA, BSHD views, MQA broadcast, precision "ieee" the same kernel."""
    import flasharray as fa
    p = Inputs(64, 33, 80, Hk=1, G=4, causal=False, layout="bshd")
    q5, k5, v5 = p.grouped()
    do = p.dout.reshape(q5.shape[:3] + p.dout.shape[2:])
    out, lse = fa.flash_attention_forward(q5, k5, v5, backend="emulator")
    g1 = fa.flash_attention_backward(do, q5, k5, v5, out, lse, backend="emulator")
    g2 = fa.flash_attention_backward(do, q5, k5, v5, out, lse, backend="emulator", precision="ieee")
    testing.assert_attention_close(out, q5, k5, v5, dout=do, grads=g1)
    for a, b in zip(g1, g2):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("case", ["d160", "sm75", "window", "kernel_simt"])
def test_api_fallbacks_to_simt(case):
    """Head dims above 128, sm_75, extensions and kernel="simt" run the SIMT fp64 backward."""
    from flasharray._private import cuda_backward as cb
    D = 160 if case == "d160" else 32
    p = Inputs(D, 20, 30, B=1, Hk=1, G=2, causal=True)
    opts = {"sm75": dict(arch=75), "kernel_simt": dict(kernel="simt")}.get(case, {})
    if case == "window":
        q5, k5, v5 = p.grouped()
        do = p.dout.reshape(q5.shape[:3] + p.dout.shape[2:])
        out, lse = reference.attention(q5, k5, v5, causal=True, window=(3, 0), return_lse=True)
        *grads, counters = cb.backward(do, q5, k5, v5, out, lse, causal=True, scale=p.scale, batch_shape=q5.shape[:3],
                                       device="emulator", return_counters=True, ext=_window_ext(q5, k5, v5))
        testing.assert_attention_close(out, q5, k5, v5, causal=True, window=(3, 0), dout=do, grads=grads)
    else:
        *grads, counters = api_grads(p, **opts)
        p.check(grads)
    names = [name for name, _ in counters]
    assert not any("f64" in n for n in names) and any(n.startswith("flash_bwd_dkv_simt_kernel") for n in names)


def _window_ext(q, k, v):
    from flasharray._private import extensions
    return extensions.from_options({"window": (3, 0)}, kind="numpy", batch_shape=q.shape[:-2], Lq=q.shape[-2],
                                   Lk=k.shape[-2], acc=np.dtype(np.float64))


# ---- tile table ---------------------------------------------------------------------------------
def test_tile_table():
    """Every d, dv <= 128 has a tile on every sm_80+ arch within its shared memory; above 128, below
    sm_80, other dtypes, precisions and extensions none."""
    for arch in ARCHS:
        for d in range(1, 129, 9):
            for dv in (1, 64, 128 - d // 2, 128):
                t = F.backward_tile(None, np.float64, d, dv, arch)
                pd, pdv = tiles.pad_head_dim(d), tiles.pad_head_dim(dv)
                warps = t.n_threads // 32
                assert t.smem <= tiles.smem_limit(arch) and t.block_m in (16, 32) and t.stages in (1, 2)
                assert t.block_n % (8 * warps) == 0 and t.block_n // (8 * warps) in (1, 2)
                assert t.smem == F.smem_bytes(pd, pdv, t.block_m, t.block_n, warps, t.stages, t.dmma_k)
                assert t.dmma_k in {4, F.dmma_k(pd, pdv, t.block_n, warps, arch)}
                # two buffers exactly where they fit without costing resident warps
                one, two = (F.smem_bytes(pd, pdv, t.block_m, t.block_n, warps, s, t.dmma_k) for s in (1, 2))
                cap = F.register_warps(t.block_m, t.block_n, warps, pd, pdv, t.dmma_k)
                assert (t.stages == 2) == (two <= tiles.smem_limit(arch) and F.resident_warps(arch, two, warps, cap)
                                           >= F.resident_warps(arch, one, warps, cap))
        assert F.backward_tile("ieee", np.float64, 64, 64, arch) == F.backward_tile(None, np.float64, 64, 64, arch)
        for bad in [dict(D=129, Dv=64), dict(D=64, Dv=130)]:
            assert F.backward_tile(None, np.float64, bad["D"], bad["Dv"], arch) is None
        assert F.backward_tile(None, np.float32, 64, 64, arch) is None
        assert F.backward_tile("tf32", np.float64, 64, 64, arch) is None
        assert F.backward_tile(None, np.float64, 64, 64, arch, ext=True) is None
    assert F.backward_tile(None, np.float64, 64, 64, 75) is None
    assert F.backward_tile(None, np.float64, 128, 128, 86).n_threads == 64  # 99 KB per block
    assert F.dkv_name(F.backward_tile(None, np.float64, 40, 24, 80), None, 48, 32, True, False, True) == \
        "flash_bwd_dkv_f64_kernel<48, 32, 32, 32, 4, true, false, true, 1>"
    # sm_80: d = dv = 128 keeps one buffer (two would exceed 163 KB), d = dv = 32 and 64 too (two would
    # cost the second block: 8 -> 4 warps); sm_90 double-buffers them but d = 64's m16n8k16 tile (P and dV_j in
    # shared memory: 105 KB with one buffer).
    assert [F.backward_tile(None, np.float64, d, d, 80).stages for d in (16, 32, 64, 128)] == [2, 1, 1, 1]
    assert [F.backward_tile(None, np.float64, d, d, 90).stages for d in (16, 32, 64, 128)] == [2, 2, 1, 2]
    # m16n8k16 on sm_90 where one m8 key tile per warp and 4 warps meet padded d, dv multiples of 32
    assert [F.backward_tile(None, np.float64, d, dv, 90).dmma_k for d, dv in
            ((16, 16), (32, 32), (48, 48), (64, 64), (64, 32), (96, 96), (128, 128), (128, 80))] == \
        [4, 4, 4, 16, 16, 16, 16, 4]
    assert {F.backward_tile(None, np.float64, d, d, a).dmma_k for a in (80, 86, 89) for d in (64, 128)} == {4}
    # but not where m16n8k16's P and padded dV_j cost resident warps: d 64, dv 128 (8 -> 4 warps per SM)
    t = F.backward_tile(None, np.float64, 64, 128, 90)
    assert t.dmma_k == 4 and "would cost resident warps" in t.reason


def _wavefronts(lane_addrs, nbytes):
    """Shared-memory wavefronts of one warp instruction (the emulator's rule for cp.async: phases of
    128 / nbytes lanes, each taking as many wavefronts as its most-used 4-byte bank has distinct
    words); lane_addrs: byte addresses of lanes 0..31."""
    per_phase = 128 // nbytes
    total = 0
    for ph in range(0, 32, per_phase):
        banks = {}
        for a in lane_addrs[ph:ph + per_phase]:
            for w in range(a // 4, (a + nbytes) // 4):
                banks.setdefault(w % 32, set()).add(w)
        total += max(len(v) for v in banks.values())
    return total


def ds_column(r, c, swizzled=True):
    """store_ds / atomic_dq_f64: key column c of dS row r sits at column c ^ 4·((r / 2) mod 4)."""
    return c ^ (4 * ((r >> 1) & 3)) if swizzled else c


@pytest.mark.parametrize("swizzled", [True, False])
def test_ds_layout_bank_conflicts(swizzled):
    """The dS tile's shared-memory accesses, modelled from the kernel's index formulas for every tile
    the table chooses: the stores from the dS^T fragments (8 bytes, lane (g, t): row 8nt + 2t + e,
    key kw + 8mt + g) take the minimum 2 wavefronts per warp instruction with the swizzle (8 without:
    4 per 16-lane phase, the pitch Bc + 8 ≡ 8 mod 16 doubles putting rows 2t on the same banks);
    dQ's A-fragment loads (16 bytes, row 16tm + g (+ 8), keys 8kc + 2t, +1) stay conflict-free, 4
    wavefronts (one per 8-lane phase). Plain shared-memory accesses are not counted by the emulator, hence the model;
    every emulator test checks the layout's correctness."""
    shapes = {(t.block_m, t.block_n, t.n_threads // 32) for arch in ARCHS for d in range(16, 129, 16)
              for dv in (16, d, 128) for t in [F.backward_tile(None, np.float64, d, dv, arch)]}
    for br, bc, warps in sorted(shapes):
        pitch, kmt = bc + 8, bc // (8 * warps)
        lanes = [(lane // 4, lane % 4) for lane in range(32)]
        for w in range(warps):
            kw = 8 * kmt * w
            for mt, nt, e in itertools.product(range(kmt), range(br // 8), range(2)):
                addrs = [8 * ((8 * nt + 2 * t + e) * pitch + ds_column(8 * nt + 2 * t + e, kw + 8 * mt + g, swizzled))
                         for g, t in lanes]
                assert _wavefronts(addrs, 8) == (2 if swizzled else 8)
        for tm, mt, kc in itertools.product(range(br // 16), range(2), range(bc // 8)):
            rows = [16 * tm + g + 8 * mt for g, _ in lanes]
            cols = [ds_column(r, 8 * kc + 2 * t, swizzled) for r, (_, t) in zip(rows, lanes)]
            assert all(c % 2 == 0 and ds_column(r, c, swizzled) + 1 == ds_column(r, c + 1, swizzled)
                       for r, c in zip(rows, cols))  # keys 8kc + 2t, +1: one 16-byte word
            assert _wavefronts([8 * (r * pitch + c) for r, c in zip(rows, cols)], 16) == 4


_PROBE = r"""
#include "flash_bwd_f64.cu"
template <int D, int DV, int BM, int BN, int NW, int ST, int K>
__global__ void probe_bwd_f64(int* out) {
  if (threadIdx.x == 0) fa::gstore(out, fa_bwd::BwdF64Traits<D, DV, BM, BN, NW, ST, K>::kBytes);
}
"""


def test_python_smem_matches_traits():
    """smem_bytes mirrors BwdF64Traits::kBytes, the m16n8k16 tiles' P and padded dV_j included (sm_90 rows)."""
    entries = {}
    for d, dv, arch in ((16, 16, 80), (32, 64, 80), (64, 64, 80), (128, 128, 80), (112, 96, 86), (128, 16, 89),
                        (48, 80, 90), (64, 64, 90), (64, 32, 90), (128, 128, 90), (96, 64, 90)):
        t = F.backward_tile(None, np.float64, d, dv, arch)
        for st in (1, 2):
            entries["probe_bwd_f64<%d, %d, %d, %d, %d, %d, %d>" % (
                d, dv, t.block_m, t.block_n, t.n_threads // 32, st, t.dmma_k)] = \
                F.smem_bytes(d, dv, t.block_m, t.block_n, t.n_threads // 32, st, t.dmma_k)
    mod = emulator.Module(_PROBE, name_expressions=list(entries), include_dirs=[str(launch.cuda_src_dir())],
                          options=["-std=c++17"])
    for expr, smem in entries.items():
        out = np.zeros(1, np.int32)
        mod.launch(expr, (1,), (32,), (out,))
        assert int(out[0]) == smem, expr


# ---- the full matrix ----------------------------------------------------------------------------
FULL = list(itertools.product((16, 32, 40, 64, 72, 96, 128), ((1, 1), (17, 63), (65, 127), (128, 257), (257, 128)),
                              (False, True), (1, 3)))


@pytest.mark.slow
@pytest.mark.parametrize("D,lengths,causal,G", FULL)
def test_backward_f64_full(D, lengths, causal, G):
    p = Inputs(D, *lengths, Hk=1, G=G, causal=causal, layout="bshd" if D % 3 == 0 else "bhsd")
    p.check(launch_f64(p, ordered=G == 1))


K16_FULL = list(itertools.product(((64, 64), (96, 96), (128, 128), (96, 128), (128, 64), (32, 64), (64, 32), (96, 32)),
                                  ((1, 1), (17, 63), (65, 127), (257, 128)), (False, True)))


@pytest.mark.slow
@pytest.mark.parametrize("dims,lengths,causal", K16_FULL)
def test_sm90_m16n8k16_bits_full(dims, lengths, causal):
    """Every m16n8k16 head-dim class on sm_90: the ordered mode's bits equal the m8n8k4 kernel's (random schedule)."""
    p = Inputs(dims[0], *lengths, Dv=dims[1], Hk=1, G=2, causal=causal)
    k16 = launch_f64(p, arch=90, schedule="random", seed=1)
    assert F.backward_tile(None, np.float64, *dims, 90).dmma_k == 16
    with flag_set(F, "DMMA_K16", False):
        k4 = launch_f64(p, arch=90)
    for a, b in zip(k16, k4):
        assert a.tobytes() == b.tobytes()
    p.check(k16)
