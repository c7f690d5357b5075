"""Hopper TMA (fa::tma_load_*/tma_store_*, cp.async.bulk.tensor) and tensor maps on the emulator.

The expected shared-memory images are written here from the PTX ISA and the CUDA driver's
documentation, not from the emulator's code: the box lies dense in shared memory, innermost
dimension fastest; out-of-bounds elements (any coordinate, negative included) are zeros; with a
swizzle of W bytes (the inner box is one W-byte row) the 16-byte chunk c of the row at shared
address a is stored at chunk c ^ f(r), r = (a / W) % 8, f = r (128B), (r >> 1) & 3 (64B),
(r >> 2) & 1 (32B) — the patterns of tests/test_emulator_wgmma.py. A TMA store writes the box's
in-bounds elements only. The inner coordinate times the element size is a multiple of 16 bytes (not in
the ISA's text: the GPU's rule, docs/emulator.md). docs/emulator.md, "Hopper: TMA", states the rules."""
import re

import ml_dtypes
import numpy as np
import pytest

from flasharray import emulator
from flasharray.emulator import encode_tensor_map
from conftest import requires_gpu, requires_nvrtc

SRC = r'''
#include "fa_port.cuh"

__device__ void load_box(void* dst, const CUtensorMap* m, int rank, const int* c, uint64_t* bar) {
    switch (rank) {
        case 1: fa::tma_load_1d(dst, m, c[0], bar); break;
        case 2: fa::tma_load_2d(dst, m, c[0], c[1], bar); break;
        case 3: fa::tma_load_3d(dst, m, c[0], c[1], c[2], bar); break;
        case 4: fa::tma_load_4d(dst, m, c[0], c[1], c[2], c[3], bar); break;
        default: fa::tma_load_5d(dst, m, c[0], c[1], c[2], c[3], c[4], bar); break;
    }
}

__device__ void store_box(const CUtensorMap* m, int rank, const int* c, const void* src) {
    switch (rank) {
        case 1: fa::tma_store_1d(m, c[0], src); break;
        case 2: fa::tma_store_2d(m, c[0], c[1], src); break;
        case 3: fa::tma_store_3d(m, c[0], c[1], c[2], src); break;
        case 4: fa::tma_store_4d(m, c[0], c[1], c[2], c[3], src); break;
        default: fa::tma_store_5d(m, c[0], c[1], c[2], c[3], c[4], src); break;
    }
}

// Thread `issuer` loads the box of `src` at coordinates c (innermost first) into shared memory at
// `box_off` with one TMA load completing on an mbarrier (expecting `expect` bytes); every thread waits,
// then the raw shared bytes (swizzled as they lie) go to `img`. With store != 0 the issuer then
// stores the same box to `dst` at coordinates d, commits and waits for the read.
__global__ void load_store(const __grid_constant__ CUtensorMap src, const __grid_constant__ CUtensorMap dst,
                           const int* c, const int* d, int rank, int box_bytes, int box_off, int expect, int issuer,
                           unsigned char* img, int store) {
    FA_DYNAMIC_SMEM(smem);
    uint64_t* bar = reinterpret_cast<uint64_t*>(smem);
    unsigned char* box = smem + box_off;
    int cc[5], dd[5];
    for (int i = 0; i < rank; ++i) {
        cc[i] = fa::gload(c + i);
        dd[i] = fa::gload(d + i);
    }
    if (threadIdx.x == issuer) {
        fa::tma_prefetch(&src);
        fa::mbarrier_init(bar, 1);
        fa::fence_mbarrier_init();
    }
    __syncthreads();
    if (threadIdx.x == issuer) {
        fa::mbarrier_arrive_expect_tx(bar, expect);
        load_box(box, &src, rank, cc, bar);
    }
    fa::mbarrier_wait_parity(bar, 0);
    for (int i = threadIdx.x; i < box_bytes / 16; i += blockDim.x)
        fa::gstore(reinterpret_cast<uint4*>(img) + i, reinterpret_cast<const uint4*>(box)[i]);
    if (store && threadIdx.x == issuer) {
        store_box(&dst, rank, dd, box);
        fa::tma_store_commit();
        fa::tma_store_wait<0>();
    }
}

// Every thread writes 4 bytes of the shared box (value v + its index) with ordinary stores; `fence`
// selects fa::fence_proxy_async() in every thread before the barrier; thread 0 stores the box with
// TMA at (d0, d1). bug: 1 overwrites the source between the store and its wait, 2 exits without the
// wait, 3 stores two boxes in two groups and waits with N = 1 first (correct), 4 stores from a
// box that is 64 bytes off the 128-byte alignment, 5 stores at inner coordinate d0 + 1 (4 bytes off 16).
__global__ void store_2d(const __grid_constant__ CUtensorMap dst, int d0, int d1, int box_bytes, float v, int fence,
                         int bug) {
    FA_DYNAMIC_SMEM(smem);
    float* box = reinterpret_cast<float*>(smem + 1024);
    for (int i = threadIdx.x; i < box_bytes / 4; i += blockDim.x) box[i] = v + i;
    if (fence) fa::fence_proxy_async();
    __syncthreads();
    if (threadIdx.x != 0) return;
    fa::tma_store_2d(&dst, d0 + (bug == 5), d1, bug == 4 ? smem + 1024 + 64 : smem + 1024);
    fa::tma_store_commit();
    if (bug == 3) {
        fa::tma_store_2d(&dst, d0 + 8, d1, box);
        fa::tma_store_commit();
        fa::tma_store_wait<1>();
        fa::tma_store_wait<0>();
        return;
    }
    if (bug == 1) box[5] = -1.0f;
    if (bug == 2) return;
    fa::tma_store_wait<0>();
}

// Misuse of a load on request: 1 a rank-2 load through a rank-3 map, 2 a box not 128-byte aligned,
// 3 a box past the end of shared memory, 4 an mbarrier without fence_mbarrier_init, 5 ldmatrix of the
// box while the load is in flight, 6 inner coordinate 4 (8 bytes: not a multiple of 16), 7 stmatrix into
// the box by lanes that have not waited for it (only lane 0 has). 8 (correct): the same after a __syncwarp(),
// which orders the other lanes after lane 0's wait.
__global__ void load_misuse(const __grid_constant__ CUtensorMap src, int bug) {
    FA_DYNAMIC_SMEM(smem);
    uint64_t* bar = reinterpret_cast<uint64_t*>(smem);
    if (threadIdx.x == 0) {
        fa::mbarrier_init(bar, 1);
        if (bug != 4) fa::fence_mbarrier_init();
        fa::mbarrier_arrive_expect_tx(bar, 2048);
        unsigned char* box = smem + (bug == 2 ? 1024 + 16 : bug == 3 ? 4096 - 128 : 1024);
        if (bug == 1) fa::tma_load_2d(box, &src, 0, 0, bar);
        else fa::tma_load_3d(box, &src, bug == 6 ? 4 : 0, 0, 0, bar);
    }
    __syncwarp();
    if (bug == 5) {
        uint32_t r[1];
        fa::ldmatrix<1, false>(r, smem + 1024 + 16 * (threadIdx.x % 8));
    }
    if (bug == 7 || bug == 8) {
        if (threadIdx.x == 0) fa::mbarrier_wait_parity(bar, 0);
        if (bug == 8) __syncwarp();
        uint32_t r[1] = {0u};
        fa::stmatrix<1, false>(smem + 1024 + 16 * (threadIdx.x % 8), r);
    }
    fa::mbarrier_wait_parity(bar, 0);
}
'''
NAMES = ["load_store", "store_2d", "load_misuse"]
SCHEDULES = [("forward", 0), ("reverse", 0), ("random", 1), ("random", 2)]


@pytest.fixture(scope="module")
def mod():
    return emulator.Module(SRC, name_expressions=NAMES)


# ---- the known answers, from the ISA ------------------------------------------------------------
def box_values(arr, coords, box, global_dim=None):
    """The box of `arr` (C order, innermost dimension last) at `coords` (innermost first): zeros where
    any coordinate is outside [0, global_dim)."""
    global_dim = global_dim or arr.shape[::-1]
    out = np.zeros(box[::-1], arr.dtype)
    for j in np.ndindex(*box[::-1]):
        x = [coords[i] + j[len(box) - 1 - i] for i in range(len(box))]
        if all(0 <= x[i] < global_dim[i] for i in range(len(box))):
            out[j] = arr[tuple(x[::-1])]
    return out


def swizzled(dense, base, w):
    """The dense box bytes as a W-byte swizzle stores them at shared address `base` (rows of W bytes)."""
    raw = np.frombuffer(dense.tobytes(), np.uint8)
    if w == 0:
        return raw.copy()
    out = np.zeros_like(raw)
    f = {128: lambda r: r, 64: lambda r: (r >> 1) & 3, 32: lambda r: (r >> 2) & 1}[w]
    for row in range(raw.size // w):
        r = ((base + row * w) // w) % 8
        for c in range(w // 16):
            dst = row * w + (c ^ f(r)) * 16
            out[dst:dst + 16] = raw[row * w + c * 16:row * w + c * 16 + 16]
    return out


def run_load(mod, arr, box, coords, swizzle=0, box_off=1024, schedule="forward", seed=0, store_to=None, d=None,
             global_dim=None, global_strides=None, expect=None):
    m = encode_tensor_map(arr, box, swizzle=swizzle, global_dim=global_dim, global_strides=global_strides)
    dst = store_to if store_to is not None else np.zeros(16, np.float32)
    mdst = encode_tensor_map(dst, box) if store_to is not None else encode_tensor_map(dst, (4,))
    rank = len(box)
    nbytes = m.box_bytes
    img = np.zeros(nbytes, np.uint8)
    c = np.array(list(coords), np.int32)
    dd = np.array(list(d) if d is not None else [0] * rank, np.int32)
    args = (m, mdst, c, dd, np.int32(rank), np.int32(nbytes), np.int32(box_off),
            np.int32(nbytes if expect is None else expect), np.int32(0), img, np.int32(store_to is not None))
    counters = mod.launch("load_store", 1, 64, args, shared_mem=box_off + nbytes + 1024, schedule=schedule, seed=seed)
    return img, counters


LOADS = [   # shape (C order), dtype, box (innermost first), coordinates (innermost first)
    ((100,), np.float32, (16,), (92,)),                        # runs past the end
    ((37, 56), np.float16, (24, 8), (-8, 33)),                 # negative inner coordinate, past the rows
    ((9, 48), np.uint8, (32, 4), (32, -2)),
    ((5, 6, 24), np.float32, (8, 4, 3), (12, 3, 3)),
    ((3, 4, 5, 16), ml_dtypes.bfloat16, (8, 2, 3, 2), (8, -1, 3, 1)),
    ((2, 3, 2, 3, 8), np.float64, (2, 2, 2, 2, 2), (6, 1, 1, 2, 0)),
    ((2, 3, 2, 3, 8), np.float64, (4, 3, 2, 3, 2), (0, 0, 0, 0, 0)),   # the whole tensor
    ((40, 64), np.float32, (8, 5), (-100, 1000)),               # entirely out of bounds: all zeros
]


@pytest.mark.parametrize("schedule,seed", SCHEDULES)
@pytest.mark.parametrize("shape,dtype,box,coords", LOADS, ids=[str(i) for i in range(len(LOADS))])
def test_load_known_answers(mod, shape, dtype, box, coords, schedule, seed):
    arr = (np.arange(np.prod(shape)) % 251 + 1).astype(dtype).reshape(shape)
    img, c = run_load(mod, arr, box, coords, schedule=schedule, seed=seed)
    assert img.tobytes() == box_values(arr, coords, box).tobytes()
    inside = int(np.count_nonzero(box_values(np.ones(shape, np.uint8), coords, box)))
    assert c.tma_loads == 1 and c.tma_load_bytes == img.size and c.bulk_copies == 0
    assert c.buffers[0].read_bytes == inside * np.dtype(dtype).itemsize
    ideal = (inside * np.dtype(dtype).itemsize + 31) // 32   # one TMA load: the sectors of its in-bounds bytes
    assert c.buffers[0].read_sectors_ideal == ideal and c.buffers[0].read_sectors >= ideal


@pytest.mark.parametrize("schedule,seed", SCHEDULES[:3])
@pytest.mark.parametrize("w", [32, 64, 128])
@pytest.mark.parametrize("dtype,base", [(np.float16, 1024), (np.float32, 1024), (np.uint8, 1024 + 384)])
def test_swizzled_load_known_answers(mod, w, dtype, base, schedule, seed):
    """The inner box is one swizzle span; 20 rows (past the 8-row repeat), the last ones out of bounds;
    base 1408 starts the pattern mid-repeat (rows r = (address / W) % 8)."""
    item = np.dtype(dtype).itemsize
    arr = (np.arange(30 * 96) % 127 + 1).astype(dtype).reshape(30, 96)
    box, coords = (w // item, 20), (96 - w // item, 14)
    img, _ = run_load(mod, arr, box, coords, swizzle=w, box_off=base, schedule=schedule, seed=seed)
    assert img.tobytes() == swizzled(box_values(arr, coords, box), base, w).tobytes()


def test_padded_global_strides(mod):
    """A 2-D view with a row pitch of 48 floats, described by global_dim/global_strides."""
    big = (np.arange(20 * 48) + 1).astype(np.float32).reshape(20, 48)
    img, _ = run_load(mod, big, (8, 6), (28, 16), global_dim=(35, 20), global_strides=(48 * 4,))
    assert img.tobytes() == box_values(big, (28, 16), (8, 6), global_dim=(35, 20)).tobytes()


@pytest.mark.parametrize("schedule,seed", SCHEDULES)
def test_store_writes_in_bounds_elements_only(mod, schedule, seed):
    """Load a box (partly out of the source), store it partly out of the destination: the destination's
    other elements keep their sentinel."""
    src = (np.arange(12 * 20) + 1).astype(np.float32).reshape(12, 20)
    dst = np.full((10, 16), -7.0, np.float32)
    box, c, d = (8, 4), (16, 10), (12, -1)
    _, counters = run_load(mod, src, box, c, store_to=dst, d=d, schedule=schedule, seed=seed)
    vals = box_values(src, c, box)
    expect = np.full((10, 16), -7.0, np.float32)
    for j1 in range(4):
        for j0 in range(8):
            x0, x1 = d[0] + j0, d[1] + j1
            if 0 <= x0 < 16 and 0 <= x1 < 10:
                expect[x1, x0] = vals[j1, j0]
    assert dst.tobytes() == expect.tobytes()
    assert counters.tma_stores == 1 and counters.tma_store_bytes == 128
    assert counters.buffers[1].write_bytes == 4 * 3 * 4   # 4 columns x 3 rows inside


def run_store(mod, bug=0, fence=1, schedule="forward", dst=None):
    dst = np.zeros((16, 32), np.float32) if dst is None else dst
    m = encode_tensor_map(dst, (8, 4))
    mod.launch("store_2d", 1, 64, (m, np.int32(4), np.int32(2), np.int32(128), np.float32(1.0), np.int32(fence),
                                   np.int32(bug)), shared_mem=4096, schedule=schedule)
    return dst


@pytest.mark.parametrize("schedule", ["forward", "reverse", "random"])
def test_store_after_fence_and_two_groups(mod, schedule):
    dst = run_store(mod, schedule=schedule)
    assert dst[2:6, 4:12].reshape(-1).tolist() == [1.0 + i for i in range(32)]
    assert np.count_nonzero(dst) == 32
    dst = run_store(mod, bug=3, schedule=schedule)
    assert dst[2:6, 4:12].tolist() == dst[2:6, 12:20].tolist() and np.count_nonzero(dst) == 64


STORE_ERRORS = {
    (0, 0): r"fa::tma_store reads shared offset 1024 .*, written by ordinary \(generic-proxy\) stores since the "
            r"block's last fa::fence_proxy_async\(\)",
    (1, 1): r"fa::tma_store_wait: the source of a TMA store \(shared offset 1046 .*\) was overwritten between its "
            r"issue and the fa::tma_store_wait<N>\(\)",
    (2, 1): r"thread exits with 1 TMA store\(s\) whose source reads no fa::tma_store_wait<N>\(\) has covered",
    (4, 1): r"fa::tma_store: the shared-memory box is not 128-byte aligned: shared offset 1088",
    (5, 1): r"fa::tma_store: inner coordinate 5 x 4-byte elements = 20 bytes, not a multiple of 16: the GPU raises "
            r"an illegal instruction",
}


@pytest.mark.parametrize("bug,fence", sorted(STORE_ERRORS))
def test_store_misuse_is_a_checked_error(mod, bug, fence):
    with pytest.raises(emulator.EmulatorError, match=r"kernel 'store_2d' block \(0,0,0\) thread \(0,0,0\) \[warp 0 "
                                                     r"lane 0\]: " + STORE_ERRORS[bug, fence]):
        run_store(mod, bug=bug, fence=fence)


def test_store_to_a_read_only_array(mod):
    dst = np.zeros((16, 32), np.float32)
    dst.flags.writeable = False
    with pytest.raises(emulator.EmulatorError, match=r"fa::tma_store global write to argument 0, a read-only array"):
        run_store(mod, dst=dst)


LOAD_ERRORS = {
    1: r"fa::tma_load: 2 coordinates for a tensor map of rank 3 \(use fa::tma_load_3d / tma_store_3d\)",
    2: r"fa::tma_load: the shared-memory box is not 128-byte aligned: shared offset 1040",
    3: r"fa::tma_load: the box \(2048 bytes\) at 0x[0-9a-f]+ is outside dynamic shared memory: shared offset 3968",
    4: r"fa::tma_load completes on the mbarrier at shared offset 0 .*which its initializing thread 0 has not made "
       r"visible to the async proxy",
    5: r"fa::ldmatrix reads shared offset 1024 .*the destination of a bulk copy \(fa::tma_load, 2048 bytes\) issued "
       r"by thread 0 that has not completed on its mbarrier at shared offset 0",
    6: r"fa::tma_load: inner coordinate 4 x 2-byte elements = 8 bytes, not a multiple of 16: the GPU raises an "
       r"illegal instruction",
    # landed or still in flight when the other lanes write, as the schedule has it: a race either way
    7: r"fa::stmatrix writes shared offset 10[0-9][0-9](, where a bulk copy completing phase 0 of the mbarrier at "
       r"shared offset 0 landed, unordered: this thread has not waited for that phase| .*the destination of a bulk "
       r"copy)",
}


@pytest.mark.parametrize("bug", sorted(LOAD_ERRORS))
def test_load_misuse_is_a_checked_error(mod, bug):
    m = encode_tensor_map(np.zeros((4, 8, 32), np.float16), (32, 8, 4))
    with pytest.raises(emulator.EmulatorError, match=LOAD_ERRORS[bug]):
        mod.launch("load_misuse", 1, 32, (m, np.int32(bug)), shared_mem=4096)


@pytest.mark.parametrize("schedule,seed", SCHEDULES)
def test_overwrite_ordered_by_a_waiting_lane_and_syncwarp(mod, schedule, seed):
    """Bytes a bulk copy landed may be overwritten by a thread that waited for its phase, or that a barrier
    (__syncwarp, __syncthreads, a named barrier) orders after one that did; load_misuse's bug 7 (no such order) is
    reported under every schedule."""
    m = encode_tensor_map(np.zeros((4, 8, 32), np.float16), (32, 8, 4))
    mod.launch("load_misuse", 1, 32, (m, np.int32(8)), shared_mem=4096, schedule=schedule, seed=seed)
    with pytest.raises(emulator.EmulatorError, match=LOAD_ERRORS[7]):
        mod.launch("load_misuse", 1, 32, (m, np.int32(7)), shared_mem=4096, schedule=schedule, seed=seed)


def test_box_bytes_are_the_transaction_count(mod):
    """complete_tx counts the whole box, out-of-bounds zeros included: expecting fewer bytes underflows."""
    arr = np.ones((4, 16), np.float32)
    with pytest.raises(emulator.EmulatorError, match=r"fa::tma_load \(256 bytes to shared offset 1024 .*\) lands: "
                                                     r"complete-tx of 256 bytes underflows the tx-count"):
        run_load(mod, arr, (16, 4), (8, 2), expect=128)


def test_not_an_emulator_tensor_map(mod):
    m = encode_tensor_map(np.zeros((4, 8, 32), np.float16), (32, 8, 4))
    m.words[0] = 0
    with pytest.raises(emulator.EmulatorError, match=r"fa::tma_load: the tensor map at 0x[0-9a-f]+ is not one "
                                                     r"flasharray's encoder made for the emulator"):
        mod.launch("load_misuse", 1, 32, (m, np.int32(0)), shared_mem=4096)


def test_argument_types(mod):
    m = encode_tensor_map(np.zeros((4, 8, 32), np.float16), (32, 8, 4))
    with pytest.raises(TypeError, match=r"a CUtensorMap parameter takes a TensorMap"):
        mod.launch("load_misuse", 1, 32, (np.int32(0), np.int32(0)), shared_mem=4096)
    with pytest.raises(TypeError, match=r"a CUtensorMap parameter takes a TensorMap"):
        mod.launch("load_misuse", 1, 32, (m, m), shared_mem=4096)


# ---- the encoder's argument rules (cuTensorMapEncodeTiled), no GPU needed --------------------------
A = np.zeros((64, 64), np.float16)
ENCODER_ERRORS = [
    (dict(array=np.zeros((2,) * 6, np.float32), box_dim=(4,) * 6), r"tensor rank 6: must be 1 to 5"),
    (dict(array=np.zeros(72, np.uint8)[8:], box_dim=(16,)), r"global address 0x[0-9a-f]+ is not 16-byte aligned"),
    (dict(array=A, box_dim=(8, 8), global_dim=(60, 64), global_strides=(120,)),
     r"global_strides\[0\] = 120 bytes \(dimension 1\): must be a positive multiple of 16"),
    (dict(array=A, box_dim=(8, 8), global_dim=(64, 64)), r"global_strides has 0 entries, the rank 2 needs 1"),
    (dict(array=A, box_dim=(8, 300)), r"box_dim\[1\] = 300: must be in \[1, 256\]"),
    (dict(array=A, box_dim=(0, 8)), r"box_dim\[0\] = 0: must be in \[1, 256\]"),
    (dict(array=A, box_dim=(12, 8)), r"box_dim\[0\] = 12 elements of 2 bytes = 24 bytes: the inner box must be a "
                                     r"multiple of 16 bytes"),
    (dict(array=A, box_dim=(64, 8), swizzle=64), r"box_dim\[0\] = 64 elements = 128 bytes exceeds the 64-byte "
                                                 r"swizzle span"),
    (dict(array=A, box_dim=(8, 8), swizzle=16), r"swizzle 16: must be 0, 32, 64 or 128"),
    (dict(array=A, box_dim=(8, 8), interleave=1), r"interleave 1: only CU_TENSOR_MAP_INTERLEAVE_NONE"),
    (dict(array=A, box_dim=(8, 8), element_strides=(1, 9)), r"element_strides\[1\] = 9: must be in \[1, 8\]"),
    (dict(array=A, box_dim=(8, 8), l2_promotion=4), r"l2_promotion 4"),
    (dict(array=A, box_dim=(8, 8), oob_fill=2), r"oob_fill 2"),
    (dict(array=np.zeros(8, np.complex64), box_dim=(8,)), r"array dtype complex64 has no tensor-map data type"),
    (dict(array=A[:, ::2], box_dim=(8, 8)), r"innermost dimension is not contiguous"),
    (dict(array=A, box_dim=(8,), global_dim=(2 ** 32 + 1,), global_strides=()), r"global_dim\[0\] = 4294967297"),
    # what the emulator does not implement, or cannot reach
    (dict(array=A, box_dim=(8, 8), element_strides=(1, 2)), r"element_strides \(1, 2\): the emulator supports only 1"),
    (dict(array=A, box_dim=(16, 8), swizzle=64), r"box_dim\[0\] = 32 bytes with a 64-byte swizzle: the emulator "
                                                 r"needs the inner box to equal the swizzle span"),
    (dict(array=A, box_dim=(8, 8), oob_fill=1), r"oob_fill 1 \(NaN request\): the emulator fills"),
    (dict(array=A, box_dim=(8, 8), global_dim=(64, 65), global_strides=(128,)), r"extends past the array"),
]


@pytest.mark.parametrize("kw,pattern", ENCODER_ERRORS, ids=[str(i) for i in range(len(ENCODER_ERRORS))])
def test_encoder_argument_rules(kw, pattern):
    kw = dict(kw)
    with pytest.raises(ValueError, match=pattern):
        encode_tensor_map(kw.pop("array"), kw.pop("box_dim"), **kw)


def test_encoder_accepts_the_limits():
    """Legal corner values: rank 5, box 256, strides that are multiples of 16, L2 promotion 256B."""
    m = encode_tensor_map(np.zeros((2, 2, 2, 2, 256), np.uint8), (256, 1, 2, 1, 2), l2_promotion=3)
    assert m.box_bytes == 1024 and m.global_dim == (256, 2, 2, 2, 2) and m.global_strides == (256, 512, 1024, 2048)
    assert m.words.ctypes.data % 128 == 0 and m.kernel_arg().nbytes == 128
    m = encode_tensor_map(np.zeros((8, 64), np.float16), (64, 8), swizzle=128)
    assert m.box_bytes == 1024 and m.swizzle == 128


# ---- GPU code -------------------------------------------------------------------------------------
@requires_nvrtc
def test_sm90_ptx_and_sass():
    from flasharray._private import nvrtc, sass
    r = nvrtc.compile_cubin(SRC, "sm_90a", name_expressions=NAMES)
    for dims in range(1, 6):
        assert ("cp.async.bulk.tensor.%dd.shared::cluster.global.tile.mbarrier::complete_tx::bytes" % dims) in r.ptx
        assert ("cp.async.bulk.tensor.%dd.global.shared::cta.tile.bulk_group" % dims) in r.ptx
    for instr in ("cp.async.bulk.commit_group", "cp.async.bulk.wait_group.read 0", "cp.async.bulk.wait_group.read 1",
                  "prefetch.tensormap", "fence.proxy.async.shared::cta"):
        assert instr in r.ptx, instr
    for name in NAMES:
        info = r.kernel(name)
        assert info.spill_stores == 0 and info.spill_loads == 0
    ok, why = sass.available()
    if not ok:
        pytest.skip(why)
    fns = sass.parse(sass.disassemble(r.cubin))
    ops = {name: {i.opcode for i in fns[r.kernel(name).lowered_name]} for name in NAMES}
    # cp.async.bulk.tensor loads -> UTMALDG.<N>D, stores -> UTMASTG.<N>D, commit_group -> UTMACMDFLUSH,
    # wait_group.read -> DEPBAR.LE, prefetch.tensormap -> UTMACCTL.PF
    for dims in range(1, 6):
        assert "UTMALDG.%dD" % dims in ops["load_store"], sorted(ops["load_store"])
        assert "UTMASTG.%dD" % dims in ops["load_store"], sorted(ops["load_store"])
    assert {"UTMASTG.2D", "UTMACMDFLUSH", "DEPBAR.LE", "FENCE.VIEW.ASYNC.S"} <= ops["store_2d"], sorted(ops["store_2d"])
    assert "UTMACCTL.PF" in ops["load_store"], sorted(ops["load_store"])


@requires_nvrtc
def test_below_sm90_is_a_compile_error_at_the_use():
    from flasharray._private import nvrtc
    with pytest.raises(nvrtc.NvrtcError, match=r"mbarrier and bulk copies need sm_90\+"):
        nvrtc.compile_cubin(SRC, "sm_80", name_expressions=["store_2d"])


@requires_gpu
@requires_nvrtc
@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype,box,coords", LOADS, ids=["case%d" % i for i in range(len(LOADS))])
def test_gpu_matches_the_known_answers(shape, dtype, box, coords):
    """The same loads on an H100/H200 with driver-encoded maps (skipped without an sm_90 GPU), one case per
    test: an illegal instruction poisons the process's context, so the first failing case is the one to read
    (on an H200, 2026-11-27, the cases then at inner byte offsets 360 and -10 raised
    cudaErrorIllegalInstruction: the inner coordinates are now 16-byte multiples, and the emulator reports the
    others, test_load_misuse_is_a_checked_error)."""
    import cupy
    from flasharray._private import nvrtc
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("TMA needs an sm_90 GPU")
    r = nvrtc.compile_cubin(SRC, "sm_90a", name_expressions=["load_store"])
    module = cupy.cuda.function.Module()
    module.load(r.cubin)
    fn = module.get_function(r.lowered_names["load_store"])  # (NVRTC 13's log: no per-kernel ptxas lines parsed)
    arr = (np.arange(np.prod(shape)) % 251 + 1).astype(dtype).reshape(shape)
    m = encode_tensor_map(cupy.asarray(arr), box)
    rank, nbytes = len(box), m.box_bytes
    img = cupy.zeros(nbytes, cupy.uint8)
    c = cupy.asarray(np.array(coords, np.int32))
    fn((1, 1, 1), (64, 1, 1), (m.kernel_arg(), m.kernel_arg(), c, c, np.int32(rank), np.int32(nbytes),
                               np.int32(1024), np.int32(nbytes), np.int32(0), img, np.int32(0)),
       shared_mem=2048 + nbytes)
    assert cupy.asnumpy(img).tobytes() == box_values(arr, coords, box).tobytes(), (shape, box, coords)


# ---- the 1-D bulk reduce-add: cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 -------------------
# Known answers from the PTX ISA: each of the bytes / 4 floats of the source is added (fp32, round to nearest
# even) to the global float at the same offset; the source is read as it was at the issue (the async proxy:
# generic writes need fence.proxy.async first) and must not be written before the covering wait_group.read;
# the adds are complete (visible) only after a wait_group without .read; addresses 16-byte aligned, size a
# positive multiple of 16. The emulator applies the adds at completion (docs/emulator.md).
RED_SRC = r'''
#include "fa_port.cuh"

// Every thread writes source floats i = tid, tid + blockDim.x, ... of `n` from src (ordinary stores), fences
// unless fence == 0; thread 0 adds `bytes` from shared offset soff to dst + doff (floats), then per mode:
// 0 wait_read<0>, wait<0>;  1 overwrite the source before the wait (error);  2 exit without a wait (error);
// 3 wait_read<0>, record dst[doff] in obs[0], overwrite the source (legal), wait<0>, record in obs[1];
// 4 wait_read<0>, post the semaphore without wait<0> (error);  5 wait<0>, post (correct);
// 6 two reduces of the same source in two groups, wait<1> then wait<0>.
__global__ void bulk_red(float* dst, const float* src, int n, int soff, int doff, int bytes, int fence, int mode,
                         float* obs, int* sem) {
    FA_DYNAMIC_SMEM(smem);
    float* s = reinterpret_cast<float*>(smem + 1024);
    for (int i = threadIdx.x; i < n; i += blockDim.x) s[i] = fa::gload(src + i);
    if (fence) fa::fence_proxy_async();
    __syncthreads();
    if (threadIdx.x != 0) {
        if (mode == 4 || mode == 5) fa::sem_post_group(sem, 1, 32);   // the group: warp 0
        return;
    }
    fa::bulk_reduce_add_f32(dst + doff, smem + 1024 + soff, bytes);
    fa::bulk_commit();
    if (mode == 1) s[1] = 5.0f;
    if (mode == 2) return;
    if (mode == 6) {
        fa::bulk_reduce_add_f32(dst + doff, smem + 1024 + soff, bytes);
        fa::bulk_commit();
        fa::bulk_wait<1>();
    }
    if (mode == 5) fa::bulk_wait<0>();
    else fa::bulk_wait_read<0>();
    if (mode == 3) {
        obs[0] = fa::gload(dst + doff);
        s[soff / 4] = -100.0f;
    }
    if (mode == 4 || mode == 5) {
        fa::sem_post_group(sem, 1, 32);
        fa::bulk_wait<0>();
        return;
    }
    fa::bulk_wait<0>();
    if (mode == 3) obs[1] = fa::gload(dst + doff);
}
'''


@pytest.fixture(scope="module")
def red_mod():
    return emulator.Module(RED_SRC, name_expressions=["bulk_red"])


def run_red(red_mod, dst, src, soff=0, doff=0, nbytes=None, fence=1, mode=0, grid=1, schedule="forward", seed=0):
    obs = np.zeros(2, np.float32)
    sem = np.zeros(1, np.int32)
    nbytes = src.nbytes if nbytes is None else nbytes
    block = 64 if mode not in (4, 5) else 32   # the semaphore group: warp 0
    red_mod.launch("bulk_red", grid, block, (dst, src, np.int32(src.size), np.int32(soff), np.int32(doff),
                                             np.int32(nbytes), np.int32(fence), np.int32(mode), obs, sem),
                   shared_mem=1024 + src.nbytes + 1024, schedule=schedule, seed=seed)
    return obs, sem


@pytest.mark.parametrize("schedule,seed", SCHEDULES)
def test_bulk_reduce_add_known_answers(red_mod, schedule, seed):
    """fp32 adds element by element, rounded to nearest even (numpy's float32 addition); the floats before
    and after the range keep their sentinel; a range inside the source (offset 48, 80 bytes) to dst + 4."""
    rng = np.random.default_rng(3)
    src = (rng.standard_normal(96) * 10.0 ** rng.integers(-3, 8, 96)).astype(np.float32)
    dst0 = (rng.standard_normal(40) * 1e7).astype(np.float32)
    dst = dst0.copy()
    run_red(red_mod, dst, src, soff=48, doff=4, nbytes=80, schedule=schedule, seed=seed)
    expect = dst0.copy()
    expect[4:24] = dst0[4:24] + src[12:32]
    assert dst.tobytes() == expect.tobytes()


def test_bulk_reduce_reads_the_source_at_the_issue_and_adds_at_completion(red_mod):
    src = np.arange(1, 33, dtype=np.float32)
    dst = np.full(32, 0.5, np.float32)
    obs, _ = run_red(red_mod, dst, src, mode=3)
    assert obs.tolist() == [0.5, 1.5]   # not yet at .read; the issue-time source at completion
    assert dst.tolist() == (src + 0.5).tolist()
    dst = np.zeros(32, np.float32)
    run_red(red_mod, dst, src, mode=6)  # two groups of the same source
    assert dst.tolist() == (2 * src).tolist()


@pytest.mark.parametrize("schedule,seed", SCHEDULES)
def test_bulk_reduce_blocks_add_concurrently(red_mod, schedule, seed):
    """Eight blocks add into the same floats: real atomics (exact small integers: any order)."""
    src = np.arange(64, dtype=np.float32)
    dst = np.zeros(64, np.float32)
    run_red(red_mod, dst, src, grid=8, schedule=schedule, seed=seed)
    assert dst.tolist() == (8 * src).tolist()


def test_bulk_reduce_post_after_completion(red_mod):
    src = np.ones(32, np.float32)
    dst = np.zeros(32, np.float32)
    _, sem = run_red(red_mod, dst, src, mode=5)
    assert sem[0] == 1 and dst.tolist() == src.tolist()


RED_ERRORS = {   # (mode, fence, soff, doff, bytes): message
    (0, 0, 0, 0, 128): r"fa::bulk_reduce_add_f32 reads shared offset 1024 .*, written by ordinary \(generic-proxy\) "
                       r"stores since the block's last fa::fence_proxy_async\(\): the bulk reduce \(async proxy\)",
    (1, 1, 0, 0, 128): r"fa::bulk_wait: the source of a bulk reduce-add \(fa::bulk_reduce_add_f32\) \(shared offset "
                       r"1030 .*\) was overwritten between its issue and the cp.async.bulk.wait_group.read",
    (2, 1, 0, 0, 128): r"thread exits with 1 bulk reduce-add\(s\) \(fa::bulk_reduce_add_f32\) whose source reads no",
    (4, 1, 0, 0, 128): r"fa::sem_post_group: this thread has a bulk reduce-add \(fa::bulk_reduce_add_f32\) in "
                       r"flight, not complete \(its source was read: .read is not completion\)",
    (0, 1, 8, 0, 64): r"fa::bulk_reduce_add_f32: the shared source is not 16-byte aligned: shared offset 1032",
    (0, 1, 0, 2, 64): r"fa::bulk_reduce_add_f32: the global address 0x[0-9a-f]+ is not 16-byte aligned",
    (0, 1, 0, 0, 72): r"fa::bulk_reduce_add_f32: 72 bytes: the size must be a positive multiple of 16",
    (0, 1, 0, 0, 0): r"fa::bulk_reduce_add_f32: 0 bytes: the size must be a positive multiple of 16",
    (0, 1, 0, 24, 64): r"fa::bulk_reduce_add_f32 global read-modify-write .*(out of bounds|past|outside)",
}


@pytest.mark.parametrize("key", sorted(RED_ERRORS), ids=[str(i) for i in range(len(RED_ERRORS))])
def test_bulk_reduce_misuse_is_a_checked_error(red_mod, key):
    mode, fence, soff, doff, nbytes = key
    with pytest.raises(emulator.EmulatorError, match=RED_ERRORS[key]):
        run_red(red_mod, np.zeros(32, np.float32), np.ones(32, np.float32), soff=soff, doff=doff, nbytes=nbytes,
                fence=fence, mode=mode)


@requires_nvrtc
def test_bulk_reduce_ptx_and_sass():
    from flasharray._private import nvrtc, sass
    r = nvrtc.compile_cubin(RED_SRC, "sm_90a", name_expressions=["bulk_red"])
    for instr in ("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32", "cp.async.bulk.commit_group",
                  "cp.async.bulk.wait_group.read 0", "cp.async.bulk.wait_group 0", "cp.async.bulk.wait_group 1"):
        assert instr in r.ptx, instr
    info = r.kernel("bulk_red")
    assert info.spill_stores == 0 and info.spill_loads == 0
    ok, why = sass.available()
    if not ok:
        pytest.skip(why)
    ops = [i.opcode for i in sass.parse(sass.disassemble(r.cubin))[info.lowered_name]]
    # the 1-D bulk reduce -> UBLKRED.G.S.ADD.F32.RN (one per issue), commit_group -> UTMACMDFLUSH,
    # wait_group(.read) -> DEPBAR.LE
    assert ops.count("UBLKRED.G.S.ADD.F32.RN") == 2, sorted(set(ops))
    assert {"UTMACMDFLUSH", "DEPBAR.LE", "FENCE.VIEW.ASYNC.S"} <= set(ops), sorted(set(ops))
