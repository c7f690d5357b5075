"""The emulator's warp-instruction memory statistics on hand-made access patterns of known cost:
global 32-byte sectors against the minimum (coalescing) and shared-memory wavefronts of cp.async
destinations (bank conflicts)."""
import numpy as np
import pytest

from flasharray import emulator

SRC = r'''
#include "fa_port.cuh"
__global__ void strided(float* y, const float* x, int stride) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    fa::gstore(y + i * stride, fa::gload(x + i * stride));
}
__global__ void two_phases(float* y, const float* x) {
    // the same call site before and after a barrier: two warp instructions, not one
    for (int pass = 0; pass < 2; ++pass) {
        fa::gstore(y + 32 * pass + threadIdx.x, fa::gload(x + 32 * pass + threadIdx.x));
        __syncthreads();
    }
}
__global__ void accumulate(float* y, int stride) { fa::atomic_add(y + threadIdx.x * stride, 1.0f); }
__global__ void cp_rows(float* y, const float* x, int pitch_bytes, int swizzle) {
    // a warp copies two 256-byte rows, 16 lanes per row (the kernels' tile copies), into rows pitch_bytes apart;
    // swizzle: 16-byte chunk c of row r at chunk c ^ (r mod 8) (FlashAttention-2's layout)
    FA_DYNAMIC_SMEM(smem);
    const int t = threadIdx.x, r = t / 16, c = t % 16;
    const int cs = swizzle ? (c ^ (r % 8)) : c;
    fa::cp_async<16>(smem + r * pitch_bytes + 16 * cs, x + 64 * r + 4 * c, 16);
    fa::cp_async_commit();
    fa::cp_async_wait<0>();
    __syncthreads();
    fa::gstore(y + t, *reinterpret_cast<const float*>(smem + r * pitch_bytes + 16 * cs));
}
__global__ void cp16(float* y, const float* x, int pitch_words) {
    FA_DYNAMIC_SMEM(smem);
    float* s = reinterpret_cast<float*>(smem);
    const int t = threadIdx.x;
    fa::cp_async<16>(s + t * pitch_words, x + 4 * t, 16);
    fa::cp_async_commit();
    fa::cp_async_wait<0>();
    __syncthreads();   // every lane's copy has landed before lane t reads its own row back
    fa::gstore(y + t, s[t * pitch_words]);
}
'''


@pytest.fixture(scope="module")
def mod():
    return emulator.Module(SRC, ["strided", "two_phases", "accumulate", "cp16", "cp_rows"])


def aligned_array(a):
    """A copy of ``a`` (C-contiguous) whose data starts on a 256-byte boundary."""
    raw = np.empty(a.nbytes + 256, np.uint8)
    off = (-raw.ctypes.data) % 256
    b = raw[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
    b[...] = a
    return b


def aligned(n, dtype=np.float32, value=0):
    """A 1-D array whose data starts on a 256-byte boundary (sector counts assume it)."""
    raw = np.empty(n * np.dtype(dtype).itemsize + 256, np.uint8)
    off = (-raw.ctypes.data) % 256
    a = raw[off:off + n * np.dtype(dtype).itemsize].view(dtype)
    a[...] = value
    return a


@pytest.mark.parametrize("stride,efficiency", [(1, 1.0), (2, 0.5), (4, 0.25), (8, 0.125), (64, 0.125)])
def test_global_sectors_of_strided_accesses(mod, stride, efficiency):
    x, y = aligned(64 * stride, value=1), aligned(64 * stride)
    c = mod.launch("strided", 2, 32, (y, x, np.int32(stride)))
    # two warps, one load and one store each, 128 bytes per warp instruction: 4 sectors ideally
    assert c.gld_sectors_ideal == c.gst_sectors_ideal == 2 * 4
    assert c.gld_sectors == c.gst_sectors == 2 * min(32, 4 * stride)
    assert c.load_sector_efficiency == c.store_sector_efficiency == efficiency
    assert c.buffers[1].read_sectors == c.gld_sectors and c.buffers[1].write_sectors == 0
    assert c.buffers[0].write_sector_efficiency == efficiency and c.buffers[0].read_sectors == 0


def test_broadcast_load_is_one_sector(mod):
    x, y = aligned(64, value=1), aligned(64)
    c = mod.launch("strided", 1, 32, (y, x, np.int32(0)))   # every lane the same address
    assert (c.gld_sectors, c.gld_sectors_ideal) == (1, 1)


def test_misaligned_base_costs_one_more_sector(mod):
    x, y = aligned(64 + 4, value=1), aligned(64)
    c = mod.launch("strided", 1, 32, (y, x[4:], np.int32(1)))   # 16 bytes past a sector boundary
    assert (c.gld_sectors, c.gld_sectors_ideal) == (5, 4)


def test_barrier_separates_warp_instructions(mod):
    x, y = aligned(64, value=1), aligned(64)
    c = mod.launch("two_phases", 1, 32, (y, x))
    assert (c.gld_sectors, c.gld_sectors_ideal) == (8, 8)   # 2 instructions × 4 sectors, both full


@pytest.mark.parametrize("stride,sectors", [(1, 4), (8, 32)])
def test_atomics_count_as_stores(mod, stride, sectors):
    y = aligned(32 * stride)
    c = mod.launch("accumulate", 1, 32, (y, np.int32(stride)))
    assert (c.gst_sectors, c.gst_sectors_ideal, c.gld_sectors) == (sectors, 4, 0)


@pytest.mark.parametrize("pitch_words,degree", [(4, 1), (8, 2), (16, 4), (32, 8), (36, 1)])
def test_cp_async_destination_bank_conflicts(mod, pitch_words, degree):
    """16-byte copies are served 8 lanes per phase: a 32-byte pitch puts two of a phase's rows in
    each bank group (2-way), a 128-byte pitch all eight (8-way); padding by 16 bytes removes it."""
    x, y = aligned(128, value=2), aligned(32)
    c = mod.launch("cp16", 1, 32, (y, x, np.int32(pitch_words)), shared_mem=32 * pitch_words * 4)
    np.testing.assert_array_equal(y, 2)
    assert c.cp_async_smem_wavefronts_ideal == 4                  # 512 bytes: 4 × 128
    assert c.cp_async_smem_wavefronts == 4 * degree
    assert c.cp_async_conflict_factor == degree
    assert (c.gld_sectors, c.gld_sectors_ideal) == (16, 16)      # the sources are contiguous


@pytest.mark.parametrize("pitch,swizzle,lines,sectors", [(256, 0, 4, 16), (272, 0, 6, 24), (256, 1, 4, 16),
                                                         (384, 0, 4, 16), (288, 0, 6, 16)])
def test_cp_async_lines_and_sectors(mod, pitch, swizzle, lines, sectors):
    """The model of an H100's cp.async (LDGSTS) cost: two 256-byte rows per warp instruction. Unpadded (256-byte)
    rows, XOR-swizzled ones and 128-byte-aligned padding cost the ideal, 4 lines and 16 sectors. Rows padded by
    16 bytes (272: the kernels' padded rows at d 128) put row 1 across 128-byte lines (2 per phase: 6 lines) and
    at 16 mod 32, where each global sector's two halves land in two 32-byte slots (24 sectors, as measured). A
    32-byte pad (288) crosses lines but keeps each sector in one slot. The bank-conflict counter sees none of
    this: every case is conflict-free for plain stores."""
    x, y = aligned(128, value=3), aligned(32)
    c = mod.launch("cp_rows", 1, 32, (y, x, np.int32(pitch), np.int32(swizzle)), shared_mem=2 * pitch)
    np.testing.assert_array_equal(y, 3)
    assert (c.cp_async_lines, c.cp_async_lines_ideal) == (lines, 4)
    assert (c.cp_async_sectors, c.cp_async_sectors_ideal) == (sectors, 16)
    assert c.cp_async_sector_factor == sectors / 16 and c.cp_async_line_factor == lines / 4
    assert c.cp_async_smem_wavefronts == c.cp_async_smem_wavefronts_ideal == 4
    assert (c.gld_sectors, c.gld_sectors_ideal) == (16, 16)


def test_flash_kernels_coalescing_does_not_regress():
    """Today's figures of the tensor-core kernels (docs/performance.md) as floors: loads ≥ 0.9 of
    ideal sectors, cp.async destinations conflict-free (and their copies into padded rows at most 1.6x the sectors
    and 1.9x the 128-byte lines of the ideal: docs/emulator.md), O and LSE stores 1.0 (16-byte rows through
    shared memory into outputs the emulator launcher allocates 256-byte aligned, as CuPy's are).
    The backward, every dQ mode: every array
    any of its launches writes — dK, dV, dQ (16-byte rows through shared memory), the atomic
    mode's dQ accumulator (padded, fragment-ordered: each warp-wide RED 128 contiguous bytes) and
    its clear, D — at ≥ 0.95 (measured 1.00)."""
    from flasharray._private import cuda_backward, cuda_forward
    rng = np.random.default_rng(0)
    # inputs 256-byte aligned as CuPy's are: the copies' sector counts depend on the sources' alignment (a NumPy
    # array at 16 mod 32 bytes splits every sector of a swizzled copy across two 32-byte slots)
    q, k, v = (aligned_array(rng.standard_normal((1, 1, 128, 64)).astype(np.float16)) for _ in range(3))
    fwd = []
    out, lse = cuda_forward.forward(q, k, v, causal=False, scale=0.125, batch_shape=(1, 1),
                                    device="emulator", counters=fwd)
    (c,) = fwd
    assert c.load_sector_efficiency >= 0.9 and c.cp_async_conflict_factor == 1
    assert c.cp_async_sector_factor <= 1.6 and c.cp_async_line_factor <= 1.9  # padded rows (an H100: 1.5x sectors)
    assert c.buffers[3].write_sector_efficiency == 1.0          # O
    assert c.buffers[4].write_sector_efficiency == 1.0          # LSE
    assert out.ctypes.data % 256 == 0 and lse.ctypes.data % 256 == 0 and q.ctypes.data % 256 == 0
    for deterministic, dq in ((True, "ordered"), (True, "recompute"), (False, None)):
        *_, bwd = cuda_backward.backward(aligned_array(np.ones_like(out)), q, k, v, out, lse, causal=False, scale=0.125,
                                         batch_shape=(1, 1), device="emulator", return_counters=True,
                                         deterministic=deterministic, dq=dq)
        names = [name.split("<")[0] for name, _ in bwd]
        assert ("flash_bwd_convert_dq_tc_kernel" in names) != (dq == "recompute"), names
        for name, c in bwd:
            assert c.cp_async_conflict_factor == 1, name
            assert c.cp_async_sector_factor <= 1.6 and c.cp_async_line_factor <= 1.9, name
            if "dkv" in name or "dq_kernel" in name:
                assert c.load_sector_efficiency >= 0.9, name
            assert c.store_sector_efficiency >= 0.95, name
            written = [b for b in c.buffers.values() if b.write_sectors]
            assert written, name
            for b in written:
                assert b.write_sector_efficiency >= 0.95, name


@pytest.mark.parametrize("dtype,D,Lq,splits", [("float16", 64, 256, 1), ("float16", 128, 200, 1),
                                               ("bfloat16", 256, 72, 1), ("float16", 64, 200, 3)])
def test_forward_epilogue_stores_whole_sectors(monkeypatch, dtype, D, Lq, splits):
    """The tensor-core forward's epilogue (docs/performance.md, "Forward: coalesced epilogue"): O
    leaves through shared memory in 16-byte row chunks and LSE one float per thread, so with
    CuPy's 256-byte aligned outputs every store fills its 32-byte sectors (was 0.50 for O: the
    fragments' 4-byte stores), Lq not a multiple of Br included. Split-KV: the fp32 workspace O_s
    keeps the fragment stores (a quad's four 8-byte pairs fill a sector) and L_s is staged."""
    from flasharray._private import cuda_forward
    import ml_dtypes
    dt = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, Lq, D)).astype(dt)
    k, v = (rng.standard_normal((1, 2, 128 * splits, D)).astype(dt) for _ in range(2))
    p = cuda_forward.plan(q, k, v, causal=False, scale=D ** -0.5, batch_shape=(1, 2), device="emulator",
                          num_splits=splits)
    assert p.num_splits == splits
    # The emulator launcher allocates outputs 256-byte aligned, as CuPy does (Lq·4 bytes per LSE
    # row of heads: whole sectors).
    counters = []
    out, lse = p.run(q, k, v, counters)
    o, l = counters[0].buffers[3], counters[0].buffers[4]   # O (or O_s), LSE (or L_s)
    assert o.write_sectors_ideal > 0 and l.write_sectors_ideal > 0
    assert o.write_sector_efficiency == 1.0
    assert l.write_sector_efficiency == 1.0


@pytest.mark.parametrize("dtype,D", [("float32", 40), ("float32", 64), ("float32", 128), ("float64", 64)])
def test_simt_forward_stores_whole_sectors(dtype, D):
    """The SIMT forward's O epilogue (flash_fwd_simt.cu, ColRuns): a row group's lanes store consecutive
    16-byte runs of an O row (or consecutive elements where the head dim allows no vector), so every store
    fills whole 32-byte sectors of CuPy's 256-byte aligned output."""
    from flasharray._private import cuda_forward
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 96, D)).astype(dtype)
    k = rng.standard_normal((1, 2, 64, D)).astype(dtype)
    counters = []
    cuda_forward.forward(q, k, k, causal=False, scale=D ** -0.5, batch_shape=(1, 2), device="emulator",
                         counters=counters, precision="ieee")
    o = counters[0].buffers[3]
    assert o.write_sectors_ideal > 0 and o.write_sector_efficiency == 1.0
