"""Hopper wgmma on tf32 operands (fa::wgmma_m64nNk8_f32_tf32_{ss,rs}, sm_90a) on the emulator, and its GPU code.

As tests/test_emulator_wgmma.py for 16-bit types: the shared-memory images follow the PTX ISA's canonical
K-major layouts (tf32 has no MN-major form) with 4-byte elements — core matrices of 8 rows x 16 bytes (4 k),
a swizzled row of W bytes holding W/4 k — and the register A fragment is the mma.m16n8k8 tf32 one (a0 =
A[g][t], a1 = A[g+8][t], a2 = A[g][t+4], a3 = A[g+8][t+4], rows 16q.. per warp q). The operands are integers
with random low 13 mantissa bits, which the instruction ignores (ptx_semantics.md): the answers are the
truncated values' exact sums."""
import re

import numpy as np
import pytest

from flasharray import emulator
from conftest import requires_gpu, requires_nvrtc
from test_emulator_wgmma import SWIZZLE, _swizzled, fragment_to_matrix, matrix_to_fragment

SRC = r'''
#include "fa_port.cuh"

// The shared-memory image, then `ksteps` chained wgmmas D (+)= A_ks B_ks in one commit group, wait_group<0>.
// The accumulator starts from c_in (scale_d applies to the first step); thread i writes out[i * N/2 ...].
template <int N, bool RS>
__global__ void wg_tf32(const unsigned char* img, int img_vecs, const uint32_t* afrag, const float* c_in, float* out,
                        int b_off, int lbo_a, int sbo_a, int lbo_b, int sbo_b, int swz_a, int swz_b, int ksteps,
                        const int* adv, int scale_d) {
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
        const uint64_t da = fa::wgmma_desc(smem + fa::gload(adv + 2 * ks), lbo_a, sbo_a, swz_a);
        const uint64_t db = fa::wgmma_desc(smem + b_off + fa::gload(adv + 2 * ks + 1), lbo_b, sbo_b, swz_b);
        if (RS) fa::wgmma_m64nNk8_f32_tf32_rs<N>(d, a[ks], db, ks == 0 ? scale_d : 1);
        else fa::wgmma_m64nNk8_f32_tf32_ss<N>(d, da, db, ks == 0 ? scale_d : 1);
    }
    fa::wgmma_commit_group();
    fa::wgmma_wait_group<0>();
    fa::wgmma_fence_operand(d);
    for (int v = 0; v < N / 2; ++v) fa::gstore(out + threadIdx.x * (N / 2) + v, d[v]);
}
'''


def _name(n, rs):
    return "wg_tf32<%d, %s>" % (n, "true" if rs else "false")


CASES = [(n, rs) for n in (32, 64, 128) for rs in (False, True)]


@pytest.fixture(scope="module")
def mod():
    return emulator.Module(SRC, name_expressions=[_name(*c) for c in CASES])


def layout(rows, ktot, w):
    """K-major canonical layout of a rows x ktot tf32 operand: (addr(i, k), lbo, sbo, byte advance per k8 step)."""
    if w == 0:   # core matrices 8 rows x 4 k: row blocks at SBO = 128, k blocks at LBO
        lbo = rows // 8 * 128
        return (lambda i, k: i // 8 * 128 + k // 4 * lbo + i % 8 * 16 + k % 4 * 4), lbo, 128, (lambda ks: 2 * lbo * ks)
    epr = w // 4   # k per swizzled row; atoms of 8 rows at SBO = 8W; the next W bytes of k after all rows
    def addr(i, k):
        return _swizzled(k // epr * rows * w + i // 8 * 8 * w, i % 8, k % epr * 4, w)
    return addr, 16, 8 * w, (lambda ks: 8 * ks // epr * rows * w + 8 * ks % epr * 4)


def tf32_bits(rng, shape):
    """Integers in [-8, 8] as fp32 bit patterns with random low 13 mantissa bits (the instruction ignores them),
    and the values it uses."""
    exact = rng.integers(-8, 9, shape).astype(np.float32)
    bits = exact.view(np.uint32) | (rng.integers(0, 1 << 13, shape).astype(np.uint32) * (exact != 0))
    return bits, (bits & np.uint32(0xffffe000)).view(np.float32)


def a_fragments(A_bits, ksteps):
    """The rs A fragment per k8 step and thread: the mma.m16n8k8 tf32 A layout on rows 16q..16q+15."""
    fr = np.zeros((ksteps, 128, 4), np.uint32)
    for ks in range(ksteps):
        for th in range(128):
            r, t = 16 * (th // 32) + ((th % 32) >> 2), th & 3
            for v, (rr, cc) in enumerate([(r, t), (r + 8, t), (r, t + 4), (r + 8, t + 4)]):
                fr[ks, th, v] = A_bits[rr, 8 * ks + cc]
    return fr


def run_gemm(mod, n, rs, swz_a, swz_b, ksteps=1, scale_d=1, seed=0, launch=None):
    rng = np.random.default_rng(seed)
    K = 8 * ksteps
    A_bits, A = tf32_bits(rng, (64, K))
    B_bits, B = tf32_bits(rng, (K, n))           # B[k][j]; its operand rows are j (the N index)
    C = rng.integers(-8, 9, (64, n)).astype(np.float32)
    la, lb = layout(64, K, SWIZZLE[swz_a][1]), layout(n, K, SWIZZLE[swz_b][1])
    extent = lambda lay, rows: max(lay[0](i, k) for i in range(rows) for k in range(K)) + 4   # noqa: E731
    b_off = (extent(la, 64) + 1023) // 1024 * 1024
    size = b_off + (extent(lb, n) + 1023) // 1024 * 1024
    img = np.zeros(size // 4, np.uint32)
    for base, mat, lay in ((0, A_bits, la), (b_off, B_bits.T, lb)):
        for i in range(mat.shape[0]):
            for k in range(K):
                img[(base + lay[0](i, k)) // 4] = mat[i, k]
    advs = np.array([[la[3](ks), lb[3](ks)] for ks in range(ksteps)], np.int32).reshape(-1)
    afrag = a_fragments(A_bits, ksteps) if rs else np.zeros(4, np.uint32)
    out = np.zeros((128, n // 2), np.float32)
    args = (img.view(np.uint8), np.int32(size // 16), afrag.reshape(-1), matrix_to_fragment(C).reshape(-1),
            out.reshape(-1), np.int32(b_off), np.int32(la[1]), np.int32(la[2]), np.int32(lb[1]), np.int32(lb[2]),
            np.int32(SWIZZLE[swz_a][0]), np.int32(SWIZZLE[swz_b][0]), np.int32(ksteps), advs, np.int32(scale_d))
    launch = launch or (lambda name, threads, args, smem: mod.launch(name, 1, threads, args, shared_mem=smem))  # noqa: E731
    c = launch(_name(n, rs), 128, args, size)
    D = C.astype(np.float64) * scale_d
    for ks in range(ksteps):   # one fp32 rounding per wgmma (exact here: integers)
        D = D + A[:, 8 * ks:8 * ks + 8].astype(np.float64) @ B[8 * ks:8 * ks + 8].astype(np.float64)
    return fragment_to_matrix(out, n), D.astype(np.float32), c


@pytest.mark.parametrize("n,rs", CASES)
@pytest.mark.parametrize("swz", list(SWIZZLE))
def test_known_answers(mod, n, rs, swz):
    """One k8 step, every shape, swizzle, ss and rs: exact, the low 13 bits of every operand ignored."""
    D, ref, c = run_gemm(mod, n, rs, swz, swz)
    assert D.tobytes() == ref.tobytes()
    assert c.wgmma == 1 and c.mma == 0


@pytest.mark.parametrize("n,rs", CASES)
@pytest.mark.parametrize("swz_a,swz_b", [("128B", "128B"), ("none", "64B"), ("32B", "128B")])
def test_chained_k_steps_and_scale_d(mod, n, rs, swz_a, swz_b):
    """Four k8 steps into one accumulator; scale_d 0 on the first ignores C."""
    for scale_d in (0, 1):
        D, ref, c = run_gemm(mod, n, rs, swz_a, swz_b, ksteps=4, scale_d=scale_d, seed=7)
        assert D.tobytes() == ref.tobytes()
        assert c.wgmma == 4


def test_the_ignored_bits_matter():
    """The operands' low bits are not zero (else the known answers could not tell truncation from rounding)."""
    bits, vals = tf32_bits(np.random.default_rng(0), (64, 8))
    assert np.count_nonzero(bits != vals.view(np.uint32)) > 40


# ---- GPU code -------------------------------------------------------------------------------------
@requires_nvrtc
def test_sm90a_ptx_and_sass():
    from flasharray._private import nvrtc, sass
    names = [_name(*c) for c in CASES]
    r = nvrtc.compile_cubin(SRC, "sm_90a", name_expressions=names)
    for instr in ("wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32",
                  "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32"):
        assert instr in r.ptx, instr
    for name in names:
        info = r.kernel(name)
        assert info.spill_stores == 0 and info.spill_loads == 0, (name, info)
    ok, why = sass.available()
    if not ok:
        pytest.skip(why)
    hg = set(re.findall(r"HGMMA\.64x(\d+)x8\.F32\.TF32", sass.disassemble(r.cubin)))
    assert hg == {"32", "64", "128"}, hg


@requires_gpu
@requires_nvrtc
@pytest.mark.gpu
def test_gpu_matches_the_known_answers():
    """The same images and fragments on an H100/H200 (skipped without an sm_90 GPU)."""
    import cupy
    from flasharray._private import nvrtc
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("wgmma needs an sm_90 GPU")
    names = [_name(*c) for c in CASES]
    r = nvrtc.compile_cubin(SRC, "sm_90a", name_expressions=names)
    module = cupy.cuda.function.Module()
    module.load(r.cubin)

    def launch(name, threads, args, smem):
        dev = [cupy.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
        module.get_function(r.lowered_names[name])((1, 1, 1), (threads, 1, 1), tuple(dev), shared_mem=smem)
        args[4][...] = cupy.asnumpy(dev[4])
    for n, rs in CASES:
        for swz in SWIZZLE:
            D, ref, _ = run_gemm(None, n, rs, swz, swz, ksteps=2, launch=launch)
            assert D.tobytes() == ref.tobytes(), (n, rs, swz)
