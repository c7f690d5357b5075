"""Hopper wgmma (fa::wgmma_m64nNk16_*, sm_90a) on the emulator, and its GPU code.

The shared-memory images are built here from the PTX ISA's canonical layouts, written per mode as the
ISA draws them (core matrices of 8 rows x 16 bytes; a swizzled atom of 8 rows x W bytes whose 16-byte
chunk c of row r is stored at chunk c ^ f(r), f = r for 128B, (r >> 1) & 3 for 64B, (r >> 2) & 1 for
32B), not from the emulator's code; the fragments from the ISA's figures (lane l, g = l >> 2,
t = l & 3). Integer-valued data makes every product and sum exact, so the answers are known exactly.
docs/emulator.md, "Hopper: wgmma", states the rules."""
import re

import ml_dtypes
import numpy as np
import pytest

from flasharray import emulator
from conftest import requires_gpu, requires_nvrtc

SRC = r'''
#include "fa_port.cuh"

template <class T> struct Mma;
template <> struct Mma<fa_half> {
    template <int N, bool TA, bool TB, bool RS>
    static __device__ void run(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t da, uint64_t db, int sd) {
        if (RS) fa::wgmma_m64nNk16_f32_f16_rs<N, TB>(d, a, db, sd);
        else fa::wgmma_m64nNk16_f32_f16_ss<N, TA, TB>(d, da, db, sd);
    }
};
template <> struct Mma<fa_bf16> {
    template <int N, bool TA, bool TB, bool RS>
    static __device__ void run(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t da, uint64_t db, int sd) {
        if (RS) fa::wgmma_m64nNk16_f32_bf16_rs<N, TB>(d, a, db, sd);
        else fa::wgmma_m64nNk16_f32_bf16_ss<N, TA, TB>(d, da, db, sd);
    }
};

// Copies the shared-memory image the test built, then `ksteps` chained wgmmas D (+)= A_ks B_ks, one
// commit group each (wait1: wait_group<1> after every commit, so two groups are in flight), and
// wait_group<0>. The accumulator starts from c_in (scale_d applies to the first step). Every
// warpgroup of the block computes the same product; thread i writes out[i * N/2 ...].
template <class T, int N, bool TA, bool TB, bool RS>
__global__ void wg_gemm(const unsigned char* img, int img_vecs, const uint32_t* afrag, const float* c_in, float* out,
                        int a_off, int b_off, int lbo_a, int sbo_a, int lbo_b, int sbo_b, int swz_a, int swz_b,
                        int ksteps, const int* adv, int scale_d, int wait1) {
    FA_DYNAMIC_SMEM(smem);
    for (int i = threadIdx.x; i < img_vecs; i += blockDim.x) reinterpret_cast<uint4*>(smem)[i] = fa::gload(reinterpret_cast<const uint4*>(img) + i);
    __syncthreads();
    const int t = threadIdx.x % 128;
    float d[N / 2];
    for (int v = 0; v < N / 2; ++v) d[v] = fa::gload(c_in + t * (N / 2) + v);
    uint32_t a[4][4];
    for (int ks = 0; ks < 4; ++ks)
        for (int r = 0; r < 4; ++r) a[ks][r] = RS && ks < ksteps ? fa::gload(afrag + (ks * 128 + t) * 4 + r) : 0u;
    fa::wgmma_fence_operand(d);
    fa::wgmma_fence();
    for (int ks = 0; ks < ksteps; ++ks) {
        const uint64_t da = fa::wgmma_desc(smem + a_off + fa::gload(adv + 2 * ks), lbo_a, sbo_a, swz_a);
        const uint64_t db = fa::wgmma_desc(smem + b_off + fa::gload(adv + 2 * ks + 1), lbo_b, sbo_b, swz_b);
        Mma<T>::template run<N, TA, TB, RS>(d, a[ks], da, db, ks == 0 ? scale_d : 1);
        fa::wgmma_commit_group();
        if (wait1) fa::wgmma_wait_group<1>();
    }
    fa::wgmma_wait_group<0>();
    fa::wgmma_fence_operand(d);
    for (int v = 0; v < N / 2; ++v) fa::gstore(out + threadIdx.x * (N / 2) + v, d[v]);
}

// Misuse on request (bug): 1 a thread exits before the wgmma, 2 no wgmma_fence, 3 the accumulator is
// written between issue and wait, 4 read after issue then wait (only NaN, no error), 5 the operand is
// the destination of a cp.async in flight, 6 no wait_group before exit, 7 a write after the wait and
// a second wgmma without a fence, 8 shared memory operand overwritten in flight, 9 divergent
// descriptors, 10 rs A registers written after the fence, 11 half the warpgroup waits at a barrier, 12 rs A
// registers written while the wgmma is in flight.
__global__ void misuse(const unsigned char* img, float* out, int bug) {
    FA_DYNAMIC_SMEM(smem);
    for (int i = threadIdx.x; i < 1024; i += blockDim.x) reinterpret_cast<uint4*>(smem)[i] = fa::gload(reinterpret_cast<const uint4*>(img) + i);
    __syncthreads();
    if (bug == 5 && threadIdx.x == 0) {
        fa::cp_async<16>(smem + 16, img, 16);
        fa::cp_async_commit();
    }
    if (bug == 1 && threadIdx.x >= 100) return;
    if (bug == 11 && threadIdx.x >= 64) __syncthreads();
    float d[32];
    for (int v = 0; v < 32; ++v) d[v] = 0.0f;
    uint32_t a[4] = {0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u};
    if (bug != 2) fa::wgmma_fence();
    if (bug == 10) a[1] = 0;
    const uint64_t da = fa::wgmma_desc(smem, 128, 256, fa::kWgmmaSwizzleNone);
    const uint64_t db = fa::wgmma_desc(smem + 8192 + (bug == 9 && threadIdx.x == 77 ? 16 : 0), 128, 256,
                                       fa::kWgmmaSwizzleNone);
    if (bug == 10 || bug == 12) fa::wgmma_m64nNk16_f32_f16_rs<64>(d, a, db, 1);
    else fa::wgmma_m64nNk16_f32_f16_ss<64>(d, da, db, 1);
    fa::wgmma_commit_group();
    if (bug == 3) d[5] = 1.0f;
    if (bug == 12) a[2] = 0;
    float early = bug == 4 ? d[3] : 0.0f;
    if (bug == 8 && threadIdx.x == 3) smem[8192 + 64] = 0x55;
    if (bug == 6) return;
    fa::wgmma_wait_group<0>();
    if (bug == 7) {
        d[0] += 1.0f;
        fa::wgmma_m64nNk16_f32_f16_ss<64>(d, da, db, 1);
        fa::wgmma_commit_group();
        fa::wgmma_wait_group<0>();
    }
    for (int v = 0; v < 32; ++v) fa::gstore(out + threadIdx.x * 32 + v, d[v] + early);
}

__global__ void desc_bits(unsigned long long* out, int addr, int lbo, int sbo, int swizzle) {
    fa::gstore(out, (unsigned long long)fa::wgmma_desc_encode(addr, lbo, sbo, swizzle));
}

__global__ void desc_advance(unsigned long long* out, int addr, int lbo, int sbo, int swizzle, int bytes) {
    fa::gstore(out, (unsigned long long)fa::wgmma_desc_advance(fa::wgmma_desc_encode(addr, lbo, sbo, swizzle), bytes));
}
'''

TYPES = {"fa_half": np.float16, "fa_bf16": ml_dtypes.bfloat16}
SWIZZLE = {"none": (0, 0), "128B": (1, 128), "64B": (2, 64), "32B": (3, 32)}   # mode bits, width W


def _name(t, n, ta, tb, rs):
    b = lambda x: "true" if x else "false"   # noqa: E731
    return "wg_gemm<%s, %d, %s, %s, %s>" % (t, n, b(ta), b(tb), b(rs))


CASES = [(t, n, ta, tb, rs) for t in TYPES for n in (64, 128) for ta, tb, rs in
         [(False, False, False), (True, True, False), (False, True, False), (False, False, True), (False, True, True)]]
# N = 32 with both operands MN-major: the wgmma backward's dQ^T half (flash_bwd_sm90.cu, kDQSplitQ: B one 64B atom wide)
CASES += [(t, 32, True, True, False) for t in TYPES]


@pytest.fixture(scope="module")
def mod():
    return emulator.Module(SRC, name_expressions=sorted({_name(*c) for c in CASES}) + ["misuse", "desc_bits", "desc_advance"])


def _chunk_xor(r, w):
    return {128: r, 64: (r >> 1) & 3, 32: (r >> 2) & 1}[w]


def _swizzled(atom_base, r, byte, w):
    """Byte address of `byte` (0..W-1) of row r (0..7) of a swizzled atom at atom_base (8*W aligned)."""
    return atom_base + r * w + ((byte // 16) ^ _chunk_xor(r, w)) * 16 + byte % 16


def layout(rows, ktot, mn_major, w):
    """Canonical layout of a rows x ktot operand (16-bit): (addr(i, k), lbo, sbo, advance per k16 step)."""
    if not mn_major and w == 0:      # K-major core matrices; row blocks at SBO = 128, k blocks at LBO
        lbo = rows // 8 * 128
        return (lambda i, k: i // 8 * 128 + k // 8 * lbo + i % 8 * 16 + k % 8 * 2), lbo, 128, 2 * lbo
    if not mn_major:                 # rows of W bytes (W/2 k), atoms of 8 rows at SBO = 8W, k atoms after all rows
        epr = w // 2
        def addr(i, k):
            return _swizzled(k // epr * rows * w + i // 8 * 8 * w, i % 8, k % epr * 2, w)
        adv = lambda ks: 16 * ks // epr * rows * w + 16 * ks % epr * 2   # noqa: E731
        return addr, 16, 8 * w, adv
    if w == 0:                       # MN-major core matrices (8 k rows x 8 mn): mn blocks at SBO, k blocks at LBO
        lbo = rows // 8 * 128
        return (lambda i, k: i // 8 * 128 + k // 8 * lbo + k % 8 * 16 + i % 8 * 2), lbo, 128, 2 * lbo
    epr = w // 2                     # rows are k (8 per atom, W bytes of mn); k groups at SBO, mn atoms at LBO
    lbo = ktot // 8 * 8 * w
    def addr(i, k):
        return _swizzled(i // epr * lbo + k // 8 * 8 * w, k % 8, i % epr * 2, w)
    return addr, lbo, 8 * w, 2 * 8 * w


def place(img, base, mat, lay):
    """Writes mat[i, k] (16-bit bit patterns) at base + addr(i, k) of the uint16 image."""
    addr = lay[0]
    for i in range(mat.shape[0]):
        for k in range(mat.shape[1]):
            img[(base + addr(i, k)) // 2] = mat[i, k]


def fragment_to_matrix(out, n):
    """The m64nNk16 accumulator of one warpgroup (thread-major out[128, n/2]) as a 64 x n matrix."""
    D = np.zeros((64, n), out.dtype)
    for th in range(128):
        q, g, t = th // 32, (th % 32) >> 2, th & 3
        for v in range(n // 2):
            j, e = v // 4, v % 4
            D[16 * q + g + 8 * (e >> 1), 8 * j + 2 * t + (e & 1)] = out[th, v]
    return D


def matrix_to_fragment(D):
    n = D.shape[1]
    out = np.zeros((128, n // 2), np.float32)
    for th in range(128):
        q, g, t = th // 32, (th % 32) >> 2, th & 3
        for v in range(n // 2):
            j, e = v // 4, v % 4
            out[th, v] = D[16 * q + g + 8 * (e >> 1), 8 * j + 2 * t + (e & 1)]
    return out


def a_fragments(A_bits, ksteps):
    """The rs A fragment per k step and thread: the mma.m16n8k16 A layout on rows 16q..16q+15."""
    fr = np.zeros((ksteps, 128, 4), np.uint32)
    for ks in range(ksteps):
        blk = A_bits[:, 16 * ks:16 * ks + 16].astype(np.uint32)
        for th in range(128):
            r, c = 16 * (th // 32) + ((th % 32) >> 2), 2 * (th & 3)
            for v, (rr, cc) in enumerate([(r, c), (r + 8, c), (r, c + 8), (r + 8, c + 8)]):
                fr[ks, th, v] = blk[rr, cc] | (blk[rr, cc + 1] << 16)
    return fr


def run_gemm(mod, t, n, ta, tb, rs, swz_a, swz_b, ksteps=1, scale_d=1, wait1=0, groups=1, seed=0, ints=True,
             launch=None):
    rng = np.random.default_rng(seed)
    dt = TYPES[t]
    K = 16 * ksteps
    draw = (lambda s: rng.integers(-8, 9, s)) if ints else (lambda s: rng.standard_normal(s))  # noqa: E731
    A = draw((64, K)).astype(dt)
    B = draw((K, n)).astype(dt)            # B[k][j]; its operand rows are j (the N index)
    C = draw((64, n)).astype(np.float32)
    la = layout(64, K, ta, SWIZZLE[swz_a][1])
    lb = layout(n, K, tb, SWIZZLE[swz_b][1])
    extent = lambda lay, rows: max(lay[0](i, k) for i in range(rows) for k in range(K)) + 2   # noqa: E731
    b_off = (extent(la, 64) + 1023) // 1024 * 1024
    size = b_off + (extent(lb, n) + 1023) // 1024 * 1024
    img = np.zeros(size // 2, np.uint16)
    place(img, 0, A.view(np.uint16), la)
    place(img, b_off, B.T.copy().view(np.uint16), lb)
    adv = lambda lay, ks: lay[3](ks) if callable(lay[3]) else lay[3] * ks    # noqa: E731
    advs = np.array([[adv(la, ks), adv(lb, ks)] for ks in range(ksteps)], np.int32).reshape(-1)
    afrag = a_fragments(A.view(np.uint16), ksteps) if rs else np.zeros(4, np.uint32)
    out = np.zeros((128 * groups, n // 2), np.float32)
    args = (img.view(np.uint8), np.int32(size // 16),
            afrag.reshape(-1), matrix_to_fragment(C).reshape(-1), out.reshape(-1), np.int32(0), np.int32(b_off),
            np.int32(la[1]), np.int32(la[2]), np.int32(lb[1]), np.int32(lb[2]), np.int32(SWIZZLE[swz_a][0]),
            np.int32(SWIZZLE[swz_b][0]), np.int32(ksteps), advs, np.int32(scale_d),
            np.int32(wait1))
    launch = launch or (lambda name, threads, args, smem: mod.launch(name, 1, threads, args, shared_mem=smem))  # noqa: E731
    c = launch(_name(t, n, ta, tb, rs), 128 * groups, args, size)
    Af, Bf = A.astype(np.float64), B.astype(np.float64)
    D = C.astype(np.float64) * scale_d
    for ks in range(ksteps):   # one fp32 rounding per wgmma
        D = (D + Af[:, 16 * ks:16 * ks + 16] @ Bf[16 * ks:16 * ks + 16]).astype(np.float32).astype(np.float64)
    return [fragment_to_matrix(out[128 * g:128 * g + 128], n) for g in range(groups)], D.astype(np.float32), c


@pytest.mark.parametrize("t,n,ta,tb,rs", CASES)
@pytest.mark.parametrize("swz", ["none", "128B", "64B", "32B"])
def test_known_answers(mod, t, n, ta, tb, rs, swz):
    """One k16 step, scale_d 1, every type, shape, swizzle and transpose variant, exact."""
    (D,), ref, c = run_gemm(mod, t, n, ta, tb, rs, swz, swz)
    assert D.tobytes() == ref.tobytes()
    assert c.wgmma == 1 and c.mma == 0


@pytest.mark.parametrize("t", list(TYPES))
@pytest.mark.parametrize("swz_a,swz_b", [("128B", "none"), ("32B", "64B")])
def test_scale_d_zero_ignores_the_accumulator(mod, t, swz_a, swz_b):
    (D,), ref, _ = run_gemm(mod, t, 64, False, False, False, swz_a, swz_b, scale_d=0, seed=3)
    assert D.tobytes() == ref.tobytes()


@pytest.mark.parametrize("t,n,ta,tb,rs", [("fa_half", 128, False, False, False), ("fa_bf16", 64, True, True, False),
                                          ("fa_half", 64, False, True, True), ("fa_bf16", 128, False, False, True)])
@pytest.mark.parametrize("swz", ["128B", "64B", "none"])
@pytest.mark.parametrize("wait1", [0, 1])
def test_chained_k_steps_and_groups(mod, t, n, ta, tb, rs, swz, wait1):
    """Four k16 steps into one accumulator, a commit group each; wait_group<1> keeps two in flight."""
    (D,), ref, c = run_gemm(mod, t, n, ta, tb, rs, swz, swz, ksteps=4, wait1=wait1, seed=5)
    assert D.tobytes() == ref.tobytes()
    assert c.wgmma == 4


def test_real_values_and_two_warpgroups(mod):
    """Random normal data: one fp32 rounding per wgmma (exact float64 sums of 16 products and C);
    both warpgroups of a 256-thread block compute the product."""
    Ds, ref, c = run_gemm(mod, "fa_bf16", 128, False, False, False, "128B", "128B", ksteps=2, groups=2, ints=False)
    for D in Ds:
        np.testing.assert_allclose(D, ref, rtol=2e-6, atol=1e-5)
    assert Ds[0].tobytes() == Ds[1].tobytes() and c.wgmma == 4


def test_descriptor_bit_fields(mod):
    """Bits 0-13 start >> 4, 16-29 LBO >> 4, 32-45 SBO >> 4, 62-63 swizzle (0 none, 1 128B, 2 64B, 3 32B)."""
    out = np.zeros(1, np.uint64)
    for addr, lbo, sbo, swz in [(0x1230, 0x40, 0x400, 1), (0x3fff0, 0x3fff0, 0x3fff0, 3), (16, 0, 256, 2), (0, 0, 0, 0)]:
        mod.launch("desc_bits", 1, 1, (out, np.int32(addr), np.int32(lbo), np.int32(sbo), np.int32(swz)))
        assert int(out[0]) == (addr >> 4) | (lbo >> 4) << 16 | (sbo >> 4) << 32 | swz << 62


def test_descriptor_advance(mod):
    """fa::wgmma_desc_advance(desc, bytes): the descriptor of the address ``bytes`` further, every other field kept
    (up to the start field's last value, 0x3fff0 >> 4); an advance that is no multiple of 16 bytes, or that leaves
    the 14-bit field, is a checked error."""
    out = np.zeros(1, np.uint64)

    def advance(addr, lbo, sbo, swz, nbytes):
        mod.launch("desc_advance", 1, 1, (out, np.int32(addr), np.int32(lbo), np.int32(sbo), np.int32(swz),
                                          np.int32(nbytes)))
        return int(out[0])
    for addr, lbo, sbo, swz, nbytes in [(0x1230, 0x40, 0x400, 1, 0x2000), (0, 0x3fff0, 0x3fff0, 3, 0x3fff0),
                                        (0x8000, 16, 1024, 1, 32), (0x3fff0, 0, 256, 2, 0)]:
        a = addr + nbytes
        assert advance(addr, lbo, sbo, swz, nbytes) == (a >> 4) | (lbo >> 4) << 16 | (sbo >> 4) << 32 | swz << 62
    with pytest.raises(emulator.EmulatorError, match=r"fa::wgmma_desc_advance: the advance is not a multiple of 16"):
        advance(0x1230, 0x40, 0x400, 1, 40)
    with pytest.raises(emulator.EmulatorError, match=r"fa::wgmma_desc_advance: the start address leaves its 14-bit"):
        advance(0x3ff00, 0x40, 0x400, 1, 0x100)


MISUSE = {
    1: r"warpgroup 0 \(warps 0-3\)",
    2: r"no fa::wgmma_fence\(\) before this thread's first wgmma on these accumulator registers",
    3: r"accumulator register 5 of an in-flight wgmma \(warpgroup 0\) was accessed \(written: 0x3f800000\) between "
       r"its issue and its covering wgmma_wait_group",
    5: r"fa::wgmma reads its A operand at shared offset 16 .*the destination of a cp.async issued by thread 0",
    6: r"thread exits with 1 wgmma\(s\) in flight \(no covering fa::wgmma_wait_group\)",
    7: r"accumulator register 0 was written by ordinary code since the thread's last fa::wgmma_fence\(\)",
    8: r"shared memory the wgmma of warpgroup 0 reads \(shared offset 8256 .*\) was written between its issue and "
       r"its completion",
    9: r"thread \(77,0,0\) .*warpgroup 0: thread 77 issued a different wgmma than thread 0",
    10: r"A-fragment register 1 was written by ordinary code since the thread's last fa::wgmma_fence\(\)",
    12: r"the A-fragment registers of an in-flight wgmma \(rs\) were written between its issue and its covering "
        r"wgmma_wait_group \(or the array holding them ended before that wait",
}


def _misuse(mod, bug, threads=128, schedule="forward"):
    img = np.full(8192, 0x3c00, np.uint16)   # fp16 ones
    out = np.zeros(threads * 32, np.float32)
    mod.launch("misuse", 1, threads, (img.view(np.uint8), out, np.int32(bug)), shared_mem=16384, schedule=schedule)
    return out


@pytest.mark.parametrize("bug", sorted(MISUSE))
@pytest.mark.parametrize("schedule", ["forward", "reverse", "random"])
def test_misuse_is_a_checked_error(mod, bug, schedule):
    with pytest.raises(emulator.EmulatorError, match=MISUSE[bug]):
        _misuse(mod, bug, schedule=schedule)


def test_correct_use_and_a_read_in_flight(mod):
    """bug 0 is correct (16 products of ones); a read between issue and wait (bug 4) is not reported,
    but it reads the poison, a NaN, which shows in the output."""
    assert np.all(_misuse(mod, 0) == 16.0)
    out = _misuse(mod, 4)
    assert np.all(np.isnan(out))


@pytest.mark.parametrize("schedule", ["forward", "reverse"])
def test_a_wgmma_half_the_warpgroup_never_reaches_is_a_deadlock(mod, schedule):
    with pytest.raises(emulator.EmulatorError, match=r"warpgroup 0 \(warps 0-3\): the wgmma never completes: 64 of "
                                                     r"its 128 threads wait at it, the others never arrive \(64 wait "
                                                     r"at __syncthreads\(\), 0 exited\)"):
        _misuse(mod, 11, schedule=schedule)


def test_incomplete_warpgroup(mod):
    with pytest.raises(emulator.EmulatorError, match=r"warpgroup 0 \(warps 0-3\) is incomplete: the block has 96 "
                                                     r"threads"):
        _misuse(mod, 0, threads=96)


# ---- GPU code -------------------------------------------------------------------------------------
GPU_NAMES = [_name("fa_half", 64, False, False, False), _name("fa_bf16", 128, True, True, False),
             _name("fa_half", 128, False, True, True), _name("fa_bf16", 64, False, False, True)]


@requires_nvrtc
def test_sm90a_ptx_and_sass():
    from flasharray._private import nvrtc, sass
    r = nvrtc.compile_cubin(SRC, "sm_90a", name_expressions=GPU_NAMES + ["misuse"])
    for instr in ("wgmma.fence.sync.aligned", "wgmma.commit_group.sync.aligned", "wgmma.wait_group.sync.aligned 1",
                  "wgmma.wait_group.sync.aligned 0", "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16",
                  "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16"):
        assert instr in r.ptx, instr
    for name in GPU_NAMES:
        info = r.kernel(name)
        assert info.spill_stores == 0 and info.spill_loads == 0, (name, info)
    ok, why = sass.available()
    if not ok:
        pytest.skip(why)
    text = sass.disassemble(r.cubin)
    # wgmma.mma_async -> HGMMA.64xNx16.F32[.BF16] (fp16 has no type suffix; tnspA/tnspB flags on the
    # descriptors); wgmma.fence -> WARPGROUP.ARRIVE; wait_group -> WARPGROUP.DEPBAR.LE gsb0, N
    hg = set(re.findall(r"HGMMA\.64x(\d+)x16\.F32(\.BF16)?", text))
    assert {("64", ""), ("128", ".BF16")} <= hg, hg
    assert "tnspA" in text and "tnspB" in text
    assert "WARPGROUP.ARRIVE" in text and re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1", text)


@requires_nvrtc
def test_sm90_without_a_is_a_compile_error_at_the_use():
    from flasharray._private import nvrtc
    with pytest.raises(nvrtc.NvrtcError, match=r"fa::wgmma needs sm_90a"):
        nvrtc.compile_cubin(SRC, "sm_90", name_expressions=GPU_NAMES[:1])


def _gpu_launcher():
    """Runs the sm_90a cubin of SRC on the GPU (CuPy), with the emulator's launch signature."""
    import cupy
    from flasharray._private import nvrtc
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("wgmma needs an sm_90 GPU")
    names = sorted({_name(*c) for c in CASES})
    r = nvrtc.compile_cubin(SRC, "sm_90a", name_expressions=names)
    module = cupy.cuda.function.Module()
    module.load(r.cubin)

    def launch(name, threads, args, smem):
        dev = [cupy.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
        module.get_function(r.lowered_names[name])((1, 1, 1), (threads, 1, 1), tuple(dev), shared_mem=smem)
        out = args[4]
        out[...] = cupy.asnumpy(dev[4])   # the output array, in place as on the emulator
    return launch


@requires_gpu
@requires_nvrtc
@pytest.mark.gpu
def test_gpu_matches_the_known_answers():
    """The same images and fragments on an H100/H200: the layouts, swizzles and fragments as the
    hardware has them (skipped without an sm_90 GPU)."""
    launch = _gpu_launcher()
    for t, n, ta, tb, rs in CASES:
        for swz in SWIZZLE:
            if n == 32 and swz == "128B":   # (an MN-major B narrower than its 128-byte atom: no kernel uses it)
                continue
            (D,), ref, _ = run_gemm(None, t, n, ta, tb, rs, swz, swz, ksteps=2, wait1=1, launch=launch)
            assert D.tobytes() == ref.tobytes(), (t, n, ta, tb, rs, swz)
