"""Every emulated warp operation against an independent NumPy model of ptx_semantics.md.

The models below are written from the tables in /work/shared/ptx_semantics.md (lane l,
g = l >> 2, t = l & 3; the lower-numbered element of a packed register in bits 0-15), not
from the emulator's code. Random data, every lane, every variant.
"""
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from flasharray import emulator

KERNELS = Path(__file__).parent / "kernels"
SHFL_TYPES = {"int": np.int32, "unsigned": np.uint32, "float": np.float32, "double": np.float64}
SHFL_KINDS = ["idx", "xor", "down", "up"]
LDM_VARIANTS = [(n, trans) for n in (1, 2, 4) for trans in (False, True)]


def _ldm_name(n, trans):
    return "ldmatrix_test<%d, %s>" % (n, "true" if trans else "false")


@pytest.fixture(scope="module")
def mod():
    names = ["shfl_test<%d, %s>" % (k, t) for k in range(4) for t in SHFL_TYPES]
    names += [_ldm_name(n, tr) for n, tr in LDM_VARIANTS]
    names += ["mma_test<fa_half>", "mma_test<fa_bf16>", "cp_async_test<4>", "cp_async_test<8>",
              "cp_async_test<16>", "wait_group_test", "chunk_stage_test", "vote_test"]
    return emulator.Module((KERNELS / "warp_ops.cu").read_text(), name_expressions=names)


def aligned_empty(n, dtype, align=64):
    """A 1-D array whose data pointer is `align`-byte aligned."""
    dtype = np.dtype(dtype)
    raw = np.zeros(n * dtype.itemsize + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + n * dtype.itemsize].view(dtype)


# ---------------------------------------------------------------------------------------------
# shuffles
# ---------------------------------------------------------------------------------------------
def shfl_model(kind, v, a, width):
    """ptx_semantics.md, Shuffles: seg = l & ~(width-1); source lane per kind, else own value."""
    out = np.empty_like(v)
    for tid in range(len(v)):
        base, l = tid - tid % 32, tid % 32
        seg = l & ~(width - 1)
        if kind == "idx":
            src = seg + (int(a[tid]) & (width - 1))
        elif kind == "xor":
            j = l ^ int(a[tid])
            src = j if j <= seg + width - 1 else l
        elif kind == "down":
            j = l + int(a[tid])
            src = j if j <= seg + width - 1 else l
        else:
            j = l - int(a[tid])
            src = j if j >= seg else l
        out[tid] = v[base + src]
    return out


@pytest.mark.parametrize("ctype", list(SHFL_TYPES))
@pytest.mark.parametrize("kind", SHFL_KINDS)
def test_shuffle_matches_model(mod, kind, ctype):
    rng = np.random.default_rng(10 * SHFL_KINDS.index(kind) + list(SHFL_TYPES).index(ctype))
    dtype = SHFL_TYPES[ctype]
    nthreads = 64   # two warps: lanes index within their own warp
    for width in (1, 2, 4, 8, 16, 32):
        if np.issubdtype(dtype, np.integer):
            v = rng.integers(np.iinfo(dtype).min, np.iinfo(dtype).max, nthreads, dtype=dtype, endpoint=True)
        else:
            v = rng.standard_normal(nthreads).astype(dtype)
        hi = {"idx": 64, "xor": 32, "down": 34, "up": 34}[kind]
        a = rng.integers(0, hi, nthreads).astype(np.int32)
        out = np.zeros_like(v)
        c = mod.launch("shfl_test<%d, %s>" % (SHFL_KINDS.index(kind), ctype), 1, nthreads,
                       (out, v, a, np.int32(width)))
        np.testing.assert_array_equal(out, shfl_model(kind, v, a, width), err_msg="width=%d" % width)
        assert c.shuffles == 2


def test_shuffle_uniform_source_broadcasts(mod):
    v = np.arange(32, dtype=np.float32) * 1.5
    out = np.zeros_like(v)
    mod.launch("shfl_test<0, float>", 1, 32, (out, v, np.full(32, 5, np.int32), np.int32(32)))
    np.testing.assert_array_equal(out, np.full(32, 7.5, np.float32))


# ---------------------------------------------------------------------------------------------
# ldmatrix
# ---------------------------------------------------------------------------------------------
def ldmatrix_model(n, trans, rows, row_of_lane):
    """Lanes 8j..8j+7 give rows 0..7 of matrix j; M_j[r][c] = 16-bit value c of that row."""
    out = np.zeros((32, n), np.uint32)
    for l in range(32):
        for j in range(n):
            M = rows[row_of_lane[8 * j: 8 * j + 8]]      # (8, 8) uint16
            if not trans:
                lo, hi = M[l // 4, 2 * (l % 4)], M[l // 4, 2 * (l % 4) + 1]
            else:
                lo, hi = M[2 * (l % 4), l // 4], M[2 * (l % 4) + 1, l // 4]
            out[l, j] = int(lo) | (int(hi) << 16)
    return out


@pytest.mark.parametrize("n,trans", LDM_VARIANTS)
def test_ldmatrix_matches_model(mod, n, trans):
    rng = np.random.default_rng(10 * n + trans)
    nrows = 48
    for trial in range(3):
        rows = rng.integers(0, 2**16, (nrows, 8), dtype=np.uint16)
        row_of_lane = rng.permutation(nrows)[:32].astype(np.int32)
        out = np.zeros(32 * n, np.uint32)
        c = mod.launch(_ldm_name(n, trans), 1, 32, (out, rows.reshape(-1), row_of_lane, np.int32(nrows)),
                       shared_mem=nrows * 16)
        np.testing.assert_array_equal(out.reshape(32, n), ldmatrix_model(n, trans, rows, row_of_lane))
        assert c.ldmatrix == 1


@pytest.mark.parametrize("row_of_lane,degree", [
    (lambda l: l, 1),                    # 8 consecutive 16-byte rows per matrix: 128 bytes, all banks
    (lambda l: 8 * l, 8),                # 128-byte pitch: every row starts in bank 0 -> 8-way
    (lambda l: 4 * l, 4),                # 64-byte pitch -> 4-way
    (lambda l: 2 * l, 2),                # 32-byte pitch -> 2-way
    (lambda l: 8 * l + l % 8, 1),        # 128-byte pitch, XOR-swizzled 16-byte chunks: conflict-free
    (lambda l: 0 * l, 1),                # every lane the same row: a broadcast
])
def test_ldmatrix_bank_conflict_wavefronts(mod, row_of_lane, degree):
    """Shared-memory wavefronts of one ldmatrix.x4 on hand-made row patterns of known conflict degree."""
    nrows = 8 * 32
    rows = np.arange(nrows * 8, dtype=np.uint16).reshape(nrows, 8)
    lanes = np.array([row_of_lane(l) for l in range(32)], np.int32)
    out = np.zeros(32 * 4, np.uint32)
    c = mod.launch(_ldm_name(4, False), 1, 32, (out, rows.reshape(-1), lanes, np.int32(nrows)),
                   shared_mem=nrows * 16)
    np.testing.assert_array_equal(out.reshape(32, 4), ldmatrix_model(4, False, rows, lanes))
    assert c.ldmatrix_wavefronts_ideal == 4
    assert c.ldmatrix_wavefronts == 4 * degree
    assert c.ldmatrix_conflict_factor == degree


def test_ldmatrix_ignores_addresses_of_unused_lanes(mod):
    """x1 reads lanes 0-7 only and x2 lanes 0-15: the other lanes may pass anything in smem."""
    rng = np.random.default_rng(3)
    rows = rng.integers(0, 2**16, (32, 8), dtype=np.uint16)
    for n in (1, 2):
        a = rng.permutation(32).astype(np.int32)
        b = a.copy()
        b[8 * n:] = rng.integers(0, 32, 32 - 8 * n)
        outs = []
        for lanes in (a, b):
            out = np.zeros(32 * n, np.uint32)
            mod.launch(_ldm_name(n, False), 1, 32, (out, rows.reshape(-1), lanes, np.int32(32)), shared_mem=32 * 16)
            outs.append(out)
        np.testing.assert_array_equal(outs[0], outs[1])


# ---------------------------------------------------------------------------------------------
# mma.m16n8k16
# ---------------------------------------------------------------------------------------------
def pack(lo, hi, dtype):
    lo = np.asarray(lo, dtype).view(np.uint16).astype(np.uint32)
    hi = np.asarray(hi, dtype).view(np.uint16).astype(np.uint32)
    return lo | (hi << 16)


def mma_registers(A, B, C, dtype):
    """Distribute A (16x16), B (16x8), C (16x8) over 32 lanes per the mma.m16n8k16 tables."""
    a = np.zeros((32, 4), np.uint32)
    b = np.zeros((32, 2), np.uint32)
    c = np.zeros((32, 4), np.float32)
    for l in range(32):
        g, t = l >> 2, l & 3
        a[l, 0] = pack(A[g, 2 * t], A[g, 2 * t + 1], dtype)
        a[l, 1] = pack(A[g + 8, 2 * t], A[g + 8, 2 * t + 1], dtype)
        a[l, 2] = pack(A[g, 2 * t + 8], A[g, 2 * t + 9], dtype)
        a[l, 3] = pack(A[g + 8, 2 * t + 8], A[g + 8, 2 * t + 9], dtype)
        b[l, 0] = pack(B[2 * t, g], B[2 * t + 1, g], dtype)
        b[l, 1] = pack(B[2 * t + 8, g], B[2 * t + 9, g], dtype)
        c[l] = [C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]]
    return a, b, c


def mma_gather_d(d):
    """Inverse of the C/D table: (32, 4) per-lane floats -> D (16 x 8)."""
    D = np.zeros((16, 8), np.float32)
    for l in range(32):
        g, t = l >> 2, l & 3
        D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1] = d[l]
    return D


def mma_model(A, B, C):
    """Exact products summed exactly (math.fsum), rounded once to fp32."""
    A64, B64, C64 = (np.asarray(x, np.float64) for x in (A, B, C))
    D = np.empty((16, 8), np.float64)
    for i in range(16):
        for j in range(8):
            D[i, j] = math.fsum([C64[i, j], *(A64[i, :] * B64[:, j])])
    return D.astype(np.float32)


def run_mma(mod, dtype, As, Bs, Cs):
    """One warp per (A, B, C) triple."""
    regs = [mma_registers(A, B, C, dtype) for A, B, C in zip(As, Bs, Cs)]
    a = np.concatenate([r[0] for r in regs]).reshape(-1)
    b = np.concatenate([r[1] for r in regs]).reshape(-1)
    c = np.concatenate([r[2] for r in regs]).reshape(-1)
    d = np.zeros(len(As) * 128, np.float32)
    name = "mma_test<%s>" % ("fa_half" if dtype == np.float16 else "fa_bf16")
    counters = mod.launch(name, 1, 32 * len(As), (d, a, b, c))
    assert counters.mma == len(As)
    return [mma_gather_d(x) for x in d.reshape(len(As), 32, 4)]


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["f16", "bf16"])
def test_mma_exact_on_integers(mod, dtype):
    """Small integers: every partial sum is exact, so any layout slip changes the result."""
    rng = np.random.default_rng(7)
    As = [rng.integers(-8, 9, (16, 16)).astype(dtype) for _ in range(4)]
    Bs = [rng.integers(-8, 9, (16, 8)).astype(dtype) for _ in range(4)]
    Cs = [rng.integers(-100, 101, (16, 8)).astype(np.float32) for _ in range(4)]
    for D, A, B, C in zip(run_mma(mod, dtype, As, Bs, Cs), As, Bs, Cs):
        expect = A.astype(np.float64) @ B.astype(np.float64) + C
        np.testing.assert_array_equal(D, expect.astype(np.float32))


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["f16", "bf16"])
def test_mma_random_matches_exact_sum(mod, dtype):
    """Random normals: the emulator sums exact products in float64 and rounds once to fp32,
    which is within 1 fp32 ulp of the correctly rounded sum (and usually equal)."""
    rng = np.random.default_rng(8)
    As = [(rng.standard_normal((16, 16)) * 4.0 ** rng.integers(-3, 4, (16, 16))).astype(dtype) for _ in range(4)]
    Bs = [rng.standard_normal((16, 8)).astype(dtype) for _ in range(4)]
    Cs = [rng.standard_normal((16, 8)).astype(np.float32) for _ in range(4)]
    equal = 0
    for D, A, B, C in zip(run_mma(mod, dtype, As, Bs, Cs), As, Bs, Cs):
        expect = mma_model(A, B, C)
        ulp = np.spacing(np.abs(expect))
        assert np.all(np.abs(D - expect) <= ulp), np.abs(D - expect).max()
        equal += int(np.sum(D == expect))
    assert equal >= 0.95 * 4 * 128


# ---------------------------------------------------------------------------------------------
# cp.async
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nbytes", [4, 8, 16])
def test_cp_async_copies_and_zero_fills(mod, nbytes):
    rng = np.random.default_rng(nbytes)
    n = 64
    src = aligned_empty(n * nbytes, np.uint8)
    src[:] = rng.integers(0, 256, n * nbytes)
    src_bytes = rng.integers(0, nbytes + 1, n).astype(np.int32)
    src_bytes[:3] = [0, nbytes, 1]
    out = np.zeros(n * nbytes, np.uint8)
    c = mod.launch("cp_async_test<%d>" % nbytes, 1, n, (out, src, src_bytes), shared_mem=n * nbytes)
    expect = src.reshape(n, nbytes).copy()
    for t in range(n):
        expect[t, src_bytes[t]:] = 0
    np.testing.assert_array_equal(out.reshape(n, nbytes), expect)
    assert c.cp_async == n and c.cp_async_bytes == n * nbytes
    assert c.global_read_bytes == int(src_bytes.sum()) + 4 * n   # + the src_bytes array itself
    assert c.buffers[1].read_bytes == int(src_bytes.sum())


def test_chunk_stage_copies_whole_chunks_and_zero_fills(mod):
    """fa::ChunkStage (sm_75's staged copies, cp.async on the emulator): staged chunks arrive at their
    destinations once landed and waited for; a chunk staged with src_bytes 0 is zeros and reads nothing."""
    n, shift = 32, 3
    src = aligned_empty((4 * n + shift) * 16, np.uint8)
    src[:] = np.random.default_rng(1).integers(0, 256, src.size)
    out = np.zeros(n * 64, np.uint8)
    c = mod.launch("chunk_stage_test", 1, n, (out, src, np.int32(shift)), shared_mem=n * 64)
    expect = src[shift * 16:].reshape(n, 4, 16).copy()
    expect[1::2, 2] = 0
    np.testing.assert_array_equal(out.reshape(n, 4, 16), expect)
    assert c.cp_async == 4 * n and c.buffers[1].read_bytes == (4 * n - n // 2) * 16


def test_cp_async_wait_group_completes_oldest_groups_only(mod):
    """wait_group N completes every group but the newest N; before that the old data is seen."""
    n = 32
    src = aligned_empty(3 * n, np.float32)
    src[:] = np.arange(3 * n) + 1.0
    out = np.zeros(12 * n, np.float32)
    mod.launch("wait_group_test", 1, n, (out, src), shared_mem=3 * n * 4)
    out = out.reshape(n, 4, 3)
    v = src.reshape(n, 3)
    stale = -np.ones(3, np.float32)
    for t in range(n):
        np.testing.assert_array_equal(out[t, 0], stale)                       # before any wait
        np.testing.assert_array_equal(out[t, 1], [v[t, 0], -1, -1])           # wait<2>
        np.testing.assert_array_equal(out[t, 2], [v[t, 0], v[t, 1], -1])      # wait<1>
        np.testing.assert_array_equal(out[t, 3], v[t])                        # wait<0>


# ---------------------------------------------------------------------------------------------
# votes and barrier reductions
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("density", [0.0, 0.3, 1.0])
def test_votes_and_barrier_reductions(mod, density):
    rng = np.random.default_rng(int(density * 10))
    n = 96
    pred = (rng.random(n) < density).astype(np.int32) * rng.integers(1, 100, n).astype(np.int32)
    masks = np.array([0xFFFFFFFF, 0x0000FFFF, 0xF0F0F0F0], np.uint32)
    out = np.zeros(4 * n, np.uint32)
    c = mod.launch("vote_test", 1, n, (out, pred, masks))
    out = out.reshape(n, 4)
    for tid in range(n):
        w, l = divmod(tid, 32)
        m = int(masks[w])
        if not (m >> l) & 1:
            assert tuple(out[tid, :3]) == (0, 0, 0)
            continue
        ballot = sum(1 << k for k in range(32) if (m >> k) & 1 and pred[32 * w + k] != 0)
        assert out[tid, 0] == ballot
        assert out[tid, 1] == int(ballot != 0)
        assert out[tid, 2] == int(ballot == m)
    count = int(np.count_nonzero(pred))
    assert np.all(out[:, 3] == (count | (int(count == n) << 16) | (int(count > 0) << 17)))
    assert c.votes == 3 * 3 and c.barriers == 3


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(20))
def test_ldmatrix_and_mma_exhaustive_seeds(mod, seed):
    rng = np.random.default_rng(1000 + seed)
    for n, trans in LDM_VARIANTS:
        rows = rng.integers(0, 2**16, (64, 8), dtype=np.uint16)
        row_of_lane = rng.integers(0, 64, 32).astype(np.int32)
        out = np.zeros(32 * n, np.uint32)
        mod.launch(_ldm_name(n, trans), 1, 32, (out, rows.reshape(-1), row_of_lane, np.int32(64)), shared_mem=64 * 16)
        np.testing.assert_array_equal(out.reshape(32, n), ldmatrix_model(n, trans, rows, row_of_lane))
    for dtype in (np.float16, ml_dtypes.bfloat16):
        A = rng.standard_normal((16, 16)).astype(dtype)
        B = rng.standard_normal((16, 8)).astype(dtype)
        C = rng.standard_normal((16, 8)).astype(np.float32)
        (D,) = run_mma(mod, dtype, [A], [B], [C])
        expect = mma_model(A, B, C)
        assert np.all(np.abs(D - expect) <= np.spacing(np.abs(expect)))
