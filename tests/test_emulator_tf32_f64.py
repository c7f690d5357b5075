"""fa::cvt_tf32 / split_tf32 / mma_m16n8k8_tf32 / mma_m8n8k4_f64 / mma_m16n8k16_f64 on the emulator, against known
answers and NumPy models written from the PTX ISA tables (docs/emulator.md, "tf32 and fp64 tensor
cores"), not from the emulator's code. Lane l, g = l >> 2, t = l & 3.
"""
import math
from pathlib import Path

import numpy as np
import pytest

from flasharray import emulator

KERNELS = Path(__file__).parent / "kernels"
LOW13 = np.uint32(0x1FFF)
EPS32 = float(np.finfo(np.float32).eps)


@pytest.fixture(scope="module")
def mod():
    names = ["cvt_tf32_test", "mma_tf32_test", "mma_3xtf32_test", "mma_f64_test", "mma_f64_k16_test<0>"]
    return emulator.Module((KERNELS / "tf32_f64.cu").read_text(), name_expressions=names)


def f32(bits):
    return np.asarray(bits, np.uint32).view(np.float32)


def u32(x):
    return np.asarray(x, np.float32).view(np.uint32)


def cvt(mod, x):
    """(bit patterns of cvt_tf32(x), split hi, split lo) from the kernel."""
    x = np.ascontiguousarray(x, np.float32)
    n = len(x)
    out, hi, lo = np.zeros(n, np.uint32), np.zeros(n, np.float32), np.zeros(n, np.float32)
    mod.launch("cvt_tf32_test", (-(-n // 128), 1, 1), 128, (out, hi, lo, x, np.int32(n)))
    return out, hi, lo


# ---------------------------------------------------------------------------------------------
# cvt.rna.tf32.f32
# ---------------------------------------------------------------------------------------------
KNOWN = [  # (input bits, expected result bits): round the magnitude to 10 bits, ties away from 0
    (0x3F800000, 0x3F800000),   # 1.0
    (0x3F800FFF, 0x3F800000),   # just below half an ulp: down
    (0x3F801000, 0x3F802000),   # tie, even neighbour below: away from zero (RNE would go down)
    (0xBF801000, 0xBF802000),   # negative tie: away from zero (more negative)
    (0x3F803000, 0x3F804000),   # tie, odd neighbour below: up (as RNE)
    (0x3F801001, 0x3F802000),   # above half: up
    (0x3FFFF000, 0x40000000),   # tie with all mantissa bits set: carry into the exponent (2.0)
    (0xBFFFF000, 0xC0000000),   # the same, negative
    (0x7F7FFFFF, 0x7F800000),   # max finite fp32 rounds to +inf
    (0xFF7FF000, 0xFF800000),   # tie at the top of the range: -inf
    (0x7F7FEFFF, 0x7F7FE000),   # largest value still finite after rounding
    (0x7F800000, 0x7F800000),   # +inf
    (0xFF800000, 0xFF800000),   # -inf
    (0x00000000, 0x00000000),   # +0
    (0x80000000, 0x80000000),   # -0
    (0x00000FFF, 0x00000000),   # subnormal below half a tf32 subnormal ulp: +0
    (0x80000FFF, 0x80000000),   # ... keeps the sign: -0
    (0x00001000, 0x00002000),   # subnormal tie: away from zero
    (0x00002FFF, 0x00002000),   # subnormal: down
    (0x007FF000, 0x00800000),   # largest subnormals round up into the smallest normal
    (0x00800000, 0x00800000),   # smallest normal
]


def test_cvt_tf32_known_bit_patterns(mod):
    x, want = np.array(KNOWN, np.uint32).T
    out, _, _ = cvt(mod, f32(x))
    bad = [(hex(a), hex(b), hex(c)) for a, b, c in zip(x, want, out) if b != c]
    assert not bad, "(input, expected, got): %s" % bad


def test_cvt_tf32_nan_and_inf_are_only_masked(mod):
    """ptxas's sequence (tests/test_static_tf32_f64.py): no rounding increment for |x| >= inf, then
    the low 13 bits cleared: a NaN keeps sign and upper payload; one with payload only in the low
    13 bits becomes an infinity."""
    x = np.array([0x7FC00000, 0xFFC00000, 0x7FA01FFF, 0xFFFFFFFF, 0x7F800001, 0xFF801FFF], np.uint32)
    out, _, _ = cvt(mod, f32(x))
    np.testing.assert_array_equal(out, x & ~LOW13)
    assert np.all(np.isnan(f32(out[:4]))) and np.all(np.isinf(f32(out[4:])))


def rna_model(x):
    """Round to nearest, ties away, at 10 mantissa bits, on the value (float64, math.ldexp)."""
    x = np.asarray(x, np.float64)
    out = np.empty(x.size, np.float64)
    for i, v in enumerate(x.ravel()):
        m, e = math.frexp(abs(v))                    # |v| = m 2^e, m in [0.5, 1)
        e = max(e, -125)                             # below the normal range: fixed unit 2^-136
        q = math.floor(math.ldexp(abs(v), 11 - e) + 0.5)
        out[i] = math.copysign(math.ldexp(q, e - 11), v)
    return out.reshape(x.shape).astype(np.float32)


def test_cvt_tf32_matches_a_value_model_on_random_bits(mod):
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    bits[:2000] = (bits[:2000] & ~LOW13) | np.uint32(0x1000)     # many exact ties
    bits[2000:3000] &= np.uint32(0x807FFFFF)                     # subnormals
    x = f32(bits)
    x = x[np.isfinite(x) & (np.abs(x) < 3.4e38)]
    out, _, _ = cvt(mod, x)
    np.testing.assert_array_equal(out, u32(rna_model(x)))
    assert np.all(out & LOW13 == 0)


def test_split_tf32_hi_lo(mod):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(4096) * np.exp2(rng.integers(-20, 20, 4096))).astype(np.float32)
    out, hi, lo = cvt(mod, x)
    np.testing.assert_array_equal(u32(hi), out)
    assert np.all(u32(hi) & LOW13 == 0) and np.all(u32(lo) & LOW13 == 0)
    np.testing.assert_array_equal(lo, rna_model(x.astype(np.float64) - hi))   # x - hi exact in fp32
    err = np.abs(x.astype(np.float64) - hi - lo)
    assert np.all(err <= 2.0 ** -22 * np.abs(x))          # hi + lo carries ~22 significant bits


# ---------------------------------------------------------------------------------------------
# mma.m16n8k8.row.col.f32.tf32.tf32.f32
# ---------------------------------------------------------------------------------------------
def tf32_registers(A, B, C):
    """A (16x8), B (8x8) as fp32 bit patterns, C (16x8) over 32 lanes per the PTX tf32 table."""
    a, b, c = np.zeros((32, 4), np.uint32), np.zeros((32, 2), np.uint32), np.zeros((32, 4), np.float32)
    for l in range(32):
        g, t = l >> 2, l & 3
        a[l] = [A[g, t], A[g + 8, t], A[g, t + 4], A[g + 8, t + 4]]
        b[l] = [B[t, g], B[t + 4, g]]
        c[l] = [C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]]
    return a, b, c


def gather_d(d):
    D = np.zeros((16, 8), np.float32)
    for l in range(32):
        g, t = l >> 2, l & 3
        D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1] = d[l]
    return D


def run_tf32(mod, A_bits, B_bits, C, kernel="mma_tf32_test"):
    a, b, c = tf32_registers(A_bits, B_bits, C)
    if kernel == "mma_3xtf32_test":
        a, b = a.view(np.float32), b.view(np.float32)
    d = np.zeros((32, 4), np.float32)
    mod.launch(kernel, (1, 1, 1), 32, (d, a, b, c))
    return gather_d(d)


def exact_model(A, B, C):
    """Exact products summed exactly (math.fsum), rounded once to fp32."""
    A, B, C = (np.asarray(x, np.float64) for x in (A, B, C))
    D = [[math.fsum([C[i, j], *(A[i, :] * B[:, j])]) for j in range(8)] for i in range(16)]
    return np.array(D).astype(np.float32)


def operands(seed, garbage=True):
    """Distinct random values per element; with `garbage`, random low 13 bits."""
    rng = np.random.default_rng(seed)
    A = u32(rng.uniform(0.5, 2.0, (16, 8)) * rng.choice([-1, 1], (16, 8)))
    B = u32(rng.uniform(0.5, 2.0, (8, 8)) * rng.choice([-1, 1], (8, 8)))
    C = rng.uniform(-4, 4, (16, 8)).astype(np.float32)
    if garbage:
        A = (A & ~LOW13) | rng.integers(0, 0x2000, A.shape, dtype=np.uint32)
        B = (B & ~LOW13) | rng.integers(0, 0x2000, B.shape, dtype=np.uint32)
    return A, B, C


def truncate(bits):
    return f32(bits & ~LOW13)


def test_mma_tf32_tile_matches_numpy_on_truncated_inputs(mod):
    A, B, C = operands(2)
    assert len(np.unique(A)) == A.size and len(np.unique(B)) == B.size
    D = run_tf32(mod, A, B, C)
    np.testing.assert_array_equal(D, exact_model(truncate(A), truncate(B), C))


def test_mma_tf32_truncates_rather_than_rounds(mod):
    A, B, C = operands(3, garbage=False)
    A |= np.uint32(0x1FFF)        # rna would round every operand up, truncation drops the bits
    B |= np.uint32(0x1FFF)
    D = run_tf32(mod, A, B, C)
    np.testing.assert_array_equal(D, exact_model(truncate(A), truncate(B), C))
    assert np.any(D != exact_model(rna_model(f32(A)), rna_model(f32(B)), C))


def test_mma_tf32_ignores_the_low_13_bits(mod):
    A, B, C = operands(4)
    rng = np.random.default_rng(5)
    A2 = (A & ~LOW13) | rng.integers(0, 0x2000, A.shape, dtype=np.uint32)
    B2 = (B & ~LOW13) | rng.integers(0, 0x2000, B.shape, dtype=np.uint32)
    assert np.any(A2 != A) and np.any(B2 != B)
    np.testing.assert_array_equal(run_tf32(mod, A, B, C), run_tf32(mod, A2, B2, C))


@pytest.mark.parametrize("elem", [(0, 0), (9, 3), (15, 7), (6, 5)])
def test_mma_tf32_layout_one_hot(mod, elem):
    """A single nonzero A[i][k] and B row k of distinct values: D row i = A[i][k] B[k, :] only."""
    i, k = elem
    A = np.zeros((16, 8), np.float32)
    A[i, k] = 2.0
    B = np.arange(1, 65, dtype=np.float32).reshape(8, 8)
    D = run_tf32(mod, u32(A), u32(B), np.zeros((16, 8), np.float32))
    want = np.zeros((16, 8), np.float32)
    want[i] = 2.0 * B[k]
    np.testing.assert_array_equal(D, want)


def test_3xtf32_reaches_fp32_accuracy(mod):
    rng = np.random.default_rng(6)
    errs1, errs3 = [], []
    for _ in range(4):
        A = rng.standard_normal((16, 8)).astype(np.float32)
        B = rng.standard_normal((8, 8)).astype(np.float32)
        C = np.zeros((16, 8), np.float32)
        ref = A.astype(np.float64) @ B.astype(np.float64)
        scale = np.abs(A.astype(np.float64)) @ np.abs(B.astype(np.float64))
        D1 = run_tf32(mod, u32(A), u32(B), C)
        D3 = run_tf32(mod, u32(A), u32(B), C, kernel="mma_3xtf32_test")
        errs1.append(np.abs(D1 - ref) / scale)
        errs3.append(np.abs(D3 - ref) / scale)
    e1, e3 = np.concatenate(errs1).ravel(), np.concatenate(errs3).ravel()
    assert e3.max() <= 8 * EPS32, e3.max() / EPS32           # a few fp32 ulps of sum |a b|
    assert np.median(e1) > 100 * np.median(e3)               # plain tf32: ~2^-11 relative
    assert e1.max() > 2.0 ** -14


# ---------------------------------------------------------------------------------------------
# mma.m8n8k4.row.col.f64.f64.f64.f64
# ---------------------------------------------------------------------------------------------
def run_f64(mod, A, B, C):
    """a0 = A[g][t], b0 = B[t][g], c0/c1 = C[g][2t], C[g][2t+1]."""
    a = np.array([A[l >> 2, l & 3] for l in range(32)], np.float64)
    b = np.array([B[l & 3, l >> 2] for l in range(32)], np.float64)
    c = np.array([[C[l >> 2, 2 * (l & 3)], C[l >> 2, 2 * (l & 3) + 1]] for l in range(32)], np.float64)
    d = np.zeros((32, 2), np.float64)
    mod.launch("mma_f64_test", (1, 1, 1), 32, (d, a, b, c))
    D = np.zeros((8, 8), np.float64)
    for l in range(32):
        D[l >> 2, 2 * (l & 3):2 * (l & 3) + 2] = d[l]
    return D


def test_mma_f64_fused_multiply_add(mod):
    """The emulator's model: a chain of fp64 FMAs, s = fma(a_k, b_k, s), one rounding per step."""
    A = np.zeros((8, 4))
    B = np.zeros((4, 8))
    C = np.zeros((8, 8))
    A[3, 2], B[2, 5], C[3, 5] = 1 + 2.0 ** -30, 1 - 2.0 ** -30, -1.0
    D = run_f64(mod, A, B, C)
    assert D[3, 5] == -(2.0 ** -60)                           # unfused: (1 - 2^-60 -> 1) - 1 = 0
    assert np.count_nonzero(D) == 1


# ---------------------------------------------------------------------------------------------
# mma.m16n8k16.row.col.f64.f64.f64.f64 (sm_90): the PTX ISA's f64 m16n8k16 fragments
# ---------------------------------------------------------------------------------------------
def run_f64_k16(mod, A, B, C):
    """a[v0 + 2 v1] = A[g + 8 v0][t + 4 v1], b[v] = B[t + 4 v][g], c[v0 + 2 v1] = C[g + 8 v1][2t + v0]."""
    lanes = [(l >> 2, l & 3) for l in range(32)]
    a = np.array([[A[g + 8 * (v & 1), t + 4 * (v >> 1)] for v in range(8)] for g, t in lanes], np.float64)
    b = np.array([[B[t + 4 * v, g] for v in range(4)] for g, t in lanes], np.float64)
    c = np.array([[C[g + 8 * (v >> 1), 2 * t + (v & 1)] for v in range(4)] for g, t in lanes], np.float64)
    d = np.zeros((32, 4), np.float64)
    mod.launch("mma_f64_k16_test<0>", (1, 1, 1), 32, (d, a, b, c))
    D = np.zeros((16, 8), np.float64)
    for (g, t), dl in zip(lanes, d):
        for v in range(4):
            D[g + 8 * (v >> 1), 2 * t + (v & 1)] = dl[v]
    return D


# Both f64 shapes: (runner, M, K); N = 8.
F64_SHAPES = {"m8n8k4": (run_f64, 8, 4), "m16n8k16": (run_f64_k16, 16, 16)}


@pytest.mark.parametrize("shape,seed", [("m8n8k4", 7), ("m16n8k16", 8)])
def test_mma_f64_small_integers_exact(mod, shape, seed):
    run, M, K = F64_SHAPES[shape]
    rng = np.random.default_rng(seed)
    for _ in range(3):
        A = rng.integers(-9, 10, (M, K)).astype(np.float64)
        B = rng.integers(-9, 10, (K, 8)).astype(np.float64)
        C = rng.integers(-99, 100, (M, 8)).astype(np.float64)
        np.testing.assert_array_equal(run(mod, A, B, C), A @ B + C)


@pytest.mark.parametrize("shape", list(F64_SHAPES))
def test_mma_f64_c_layout_distinct_values(mod, shape):
    """A = 0: D is C, element by element (distinct values: a misplaced c register shows)."""
    run, M, K = F64_SHAPES[shape]
    C = np.arange(8 * M, dtype=np.float64).reshape(M, 8) * 3 + 1
    np.testing.assert_array_equal(run(mod, np.zeros((M, K)), np.ones((K, 8)), C), C)


@pytest.mark.parametrize("shape,elem", [("m8n8k4", e) for e in [(0, 0), (5, 1), (2, 3), (7, 2)]] +
                         [("m16n8k16", e) for e in [(0, 0), (9, 1), (2, 7), (15, 12), (8, 15)]])
def test_mma_f64_ab_layout_one_hot(mod, shape, elem):
    """A single nonzero A[i][k] and distinct B values: D row i = A[i][k] B[k, :], zero elsewhere."""
    run, M, K = F64_SHAPES[shape]
    i, k = elem
    A = np.zeros((M, K))
    A[i, k] = 3.0
    B = np.arange(1, 8 * K + 1, dtype=np.float64).reshape(K, 8)
    want = np.zeros((M, 8))
    want[i] = 3.0 * B[k]
    np.testing.assert_array_equal(run(mod, A, B, np.zeros((M, 8))), want)


def test_mma_f64_k16_is_eight_m8n8k4_in_k_order(mod):
    """The model: each D element one fp64 FMA chain over k = 0..15, i.e. the bits of m8n8k4 on each m8 row
    tile chained over the four k4 steps in order (what the kernels' sm_90 path relies on)."""
    rng = np.random.default_rng(9)
    A, B, C = rng.standard_normal((16, 16)), rng.standard_normal((16, 8)), rng.standard_normal((16, 8))
    want = C.copy()
    for m in range(2):
        for s in range(4):
            want[8 * m:8 * m + 8] = run_f64(mod, A[8 * m:8 * m + 8, 4 * s:4 * s + 4], B[4 * s:4 * s + 4],
                                            want[8 * m:8 * m + 8])
    np.testing.assert_array_equal(run_f64_k16(mod, A, B, C), want)
    assert not np.array_equal(want, A @ B + C)   # the order is visible in the bits: the test can fail
