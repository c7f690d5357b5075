"""CUDA backward kernels (cuda_src/flash_bwd*.cu) on the emulator, and on a GPU when CuPy sees one.

Every case feeds the float64 reference's ``out`` (rounded to the dtype) and ``lse`` to
``flasharray._private.cuda_backward.backward`` and checks dq, dk, dv against the float64
reference backward with the DESIGN.md rule (3x the naive-precision error for gradients,
``flasharray.testing``). The inputs are read-only, so a kernel writing into one fails.
The same bodies run with ``device="cuda"`` under the ``gpu`` marker.
"""
import functools
import itertools

import numpy as np
import pytest

from flasharray import reference, testing
from flasharray._private import cuda_backward as cb
from flasharray._private import cuda_forward
from flasharray._private import tiles_bwd
from flasharray._private.dtypes import accumulation_dtype, bfloat16, canonical_dtype

from conftest import flag_set, make_qkv, older_arch_ptx, requires_gpu, thin

DIMS = (16, 32, 59, 64, 96, 128, 256)
LENGTHS = ((1, 1), (17, 63), (64, 64), (65, 127), (128, 257), (257, 128), (113, 203))
# Batch dims of q and of k, v: plain, GQA (3 query heads per K/V head), MQA (one K/V head).
BCASTS = {"none": ((2, 2), (2, 2)), "gqa": ((2, 2, 3), (2, 2, 1)), "mqa": ((2, 4), (2, 1))}
DTYPE_NAMES = {"fp16": np.float16, "bf16": bfloat16, "fp32": np.float32, "fp64": np.float64}


class Problem:
    """Inputs of one backward call, with the reference forward's out and lse."""

    def __init__(self, dtype, D, Lq, Lk, *, causal, bcast="none", layout="bhsd", Dv=None, seed=0,
                 batch_q=None, batch_k=None, batch_v=None):
        self.dtype = canonical_dtype(dtype)
        Dv = D if Dv is None else Dv
        bq, bk = BCASTS[bcast]
        bq = batch_q or bq
        bk = batch_k or bk
        bv = batch_v or bk
        self.q, self.k, self.v = make_qkv(bq + (Lq, D), bk + (Lk, D), bv + (Lk, Dv), self.dtype,
                                          seed=seed, layout=layout)
        self.batch_shape = tuple(np.broadcast_shapes(bq, bk, bv))
        rng = np.random.default_rng(seed + 1)
        if layout == "bshd":  # the same transposed view as q
            self.dout = np.swapaxes(rng.standard_normal(self.batch_shape[:-1] + (Lq, self.batch_shape[-1], Dv))
                                    .astype(self.dtype), -2, -3)
        else:
            self.dout = rng.standard_normal(self.batch_shape + (Lq, Dv)).astype(self.dtype)
        self.causal = causal
        self.scale = 1.0 / np.sqrt(D)
        out64, lse64 = reference.attention(self.q, self.k, self.v, causal=causal, scale=self.scale,
                                           return_lse=True)
        self.out = out64.astype(self.dtype)
        self.lse = lse64.astype(accumulation_dtype(self.dtype))
        for a in (self.q, self.k, self.v, self.dout, self.out, self.lse):
            a.flags.writeable = False  # the emulator rejects any store into an input

    def args(self, device):
        arrays = (self.dout, self.q, self.k, self.v, self.out, self.lse)
        if device == "cuda":
            import cupy
            arrays = tuple(cupy.asarray(a) for a in arrays)
        return arrays


def run_backward(device, p, *, deterministic=True, **opts):
    """cuda_backward.backward on the problem; float32 runs precision="ieee" (the SIMT kernels this
    file tests; also the default) unless a test passes another: the TF32 kernels are
    tests/test_cuda_backward_tf32.py's."""
    if np.dtype(p.dtype) == np.float32:
        opts.setdefault("precision", "ieee")
    res = cb.backward(*p.args(device), causal=p.causal, scale=p.scale, batch_shape=p.batch_shape,
                      device=device, deterministic=deterministic, **opts)
    if device == "cuda":
        res = tuple(x.get() for x in res[:3]) + tuple(res[3:])
    return res


def check(p, grads):
    for g, x in zip(grads, (p.q, p.k, p.v)):
        assert g.shape == x.shape and g.dtype == x.dtype, (g.shape, g.dtype, x.shape, x.dtype)
    testing.assert_attention_close(p.out, p.q, p.k, p.v, causal=p.causal, scale=p.scale,
                                   dout=p.dout, grads=grads[:3])


def check_case(device, dtype, D, lengths, causal, bcast="none", layout="bhsd", deterministic=True,
               **kw):
    opts = {k_: kw.pop(k_) for k_ in ("kernel", "arch", "schedule", "seed", "stages", "dq") if k_ in kw}
    p = Problem(dtype, D, *lengths, causal=causal, bcast=bcast, layout=layout, **kw)
    check(p, run_backward(device, p, deterministic=deterministic, **opts))


# A representative subset: every dtype, head dim, length pair, both causal settings, every
# broadcast pattern, both layouts and both dQ modes appear at least once.
CASES = [
    ("fp16", 64, (65, 127), True, "none", "bhsd", True),
    ("fp16", 59, (113, 203), False, "gqa", "bshd", True),
    ("fp16", 128, (128, 257), True, "mqa", "bhsd", False),
    ("fp16", 256, (17, 63), True, "none", "bshd", True),
    ("fp16", 16, (1, 1), False, "none", "bhsd", True),
    ("fp16", 96, (257, 128), True, "gqa", "bhsd", False),
    ("bf16", 32, (257, 128), True, "gqa", "bhsd", True),
    ("bf16", 96, (64, 64), False, "none", "bshd", False),
    ("bf16", 256, (65, 127), True, "mqa", "bhsd", True),
    ("fp32", 16, (17, 63), True, "none", "bhsd", True),
    ("fp32", 59, (257, 128), True, "gqa", "bshd", False),
    ("fp32", 64, (1, 1), True, "none", "bhsd", True),
    ("fp32", 128, (113, 203), False, "mqa", "bhsd", True),
    ("fp32", 256, (64, 64), True, "none", "bhsd", False),
    ("fp64", 32, (65, 127), True, "mqa", "bshd", True),
    ("fp64", 96, (128, 257), False, "none", "bhsd", False),
    ("fp64", 256, (17, 63), True, "gqa", "bhsd", True),
    ("fp64", 64, (257, 128), True, "none", "bhsd", True),
]


def _id(c):
    dt, D, (lq, lk), causal, bcast, layout, det = c
    return "%s-d%d-%dx%d-%s-%s-%s-%s" % (dt, D, lq, lk, "causal" if causal else "full", bcast, layout,
                                          "det" if det else "atomic")


def _run_case(device, c):
    dt, D, lengths, causal, bcast, layout, det = c
    check_case(device, DTYPE_NAMES[dt], D, lengths, causal, bcast, layout, det)


@pytest.mark.parametrize("case", thin(CASES), ids=_id)
def test_backward_emulator(case):
    _run_case("emulator", case)


@pytest.mark.parametrize("dt,D,lengths,causal,bcast", [("fp16", 59, (113, 203), False, "gqa"),
                                                        ("bf16", 256, (65, 127), True, "mqa")])
def test_backward_recomputed_dq(dt, D, lengths, causal, bcast):
    """The tensor-core deterministic mode without ordered atomics (dq="recompute": the separate dQ
    kernel; CASES' deterministic fp16/bf16 cases run the default, ordered)."""
    check_case("emulator", DTYPE_NAMES[dt], D, lengths, causal, bcast, dq="recompute")


@pytest.mark.parametrize("dt", ["fp16", "fp32"])
@pytest.mark.parametrize("D,Dv", [(64, 32), (32, 96), (16, 192)])
def test_backward_dv_differs(dt, D, Dv):
    check_case("emulator", DTYPE_NAMES[dt], D, (65, 127), True, "gqa", Dv=Dv)


def test_backward_k_and_v_broadcast_differently():
    """K shared across heads but V not (and vice versa): AccT partial sums, reduced afterwards."""
    for bk, bv in (((2, 1), (2, 3)), ((2, 3), (1, 1))):
        for det in (True, False):
            p = Problem(np.float32, 32, 33, 47, causal=True, batch_q=(2, 3), batch_k=bk, batch_v=bv)
            check(p, run_backward("emulator", p, deterministic=det))


def test_backward_query_broadcast():
    """q broadcast over a batch dim that k, v have: dq is summed over it (fp32 deterministic: the SIMT
    ordered mode, its accumulator converted to an AccT buffer before the sum)."""
    for dt, det in ((np.float16, True), (np.float16, False), (np.float64, False), (np.float32, True)):
        p = Problem(dt, 64, 40, 70, causal=False, batch_q=(1, 3), batch_k=(2, 3))
        check(p, run_backward("emulator", p, deterministic=det))


@pytest.mark.parametrize("D,lengths", [(59, (70, 45)), (80, (129, 33)), (40, (17, 200))])
def test_atomic_dq_padded_accumulator(D, lengths):
    """Tensor-core atomic mode: the dQ accumulator is padded (rows to the dK/dV kernel's query
    block, columns to the padded head dim) and fragment-ordered; Lq not a multiple of Br, D not a
    multiple of 8 (element stores in the conversion) or of 32 (16-column accumulator tiles)."""
    p = Problem(np.float16, D, *lengths, causal=True, bcast="gqa")
    check(p, run_backward("emulator", p, deterministic=False))


def test_backward_many_batch_dims_gqa():
    """Four batch dims, GQA in the last: merged to the grid + an in-kernel group loop."""
    p = Problem(np.float16, 32, 30, 50, causal=True, batch_q=(2, 1, 2, 3), batch_k=(2, 1, 2, 1))
    check(p, run_backward("emulator", p))


def test_backward_unmergeable_batch_dims():
    """Five batch dims whose strides do not merge: the outer ones are looped over on the host
    (each launch gets offset views), the GQA dim is still walked inside the dK/dV kernel."""
    for dt, det in ((np.float16, True), (np.float16, False), (np.float32, False)):
        p = Problem(dt, 32, 21, 37, causal=True, batch_q=(2, 2, 3, 2, 3), batch_k=(2, 2, 3, 2, 1))
        rng = np.random.default_rng(5)
        # q and dout as permuted views: batch dims 1 and 2 swapped in memory
        base = rng.standard_normal((2, 3, 2, 2, 3, 21, 32)).astype(dt)
        p.q = np.swapaxes(base, 1, 2)
        out64, lse64 = reference.attention(p.q, p.k, p.v, causal=True, scale=p.scale, return_lse=True)
        p.out, p.lse = out64.astype(dt), lse64.astype(np.float32)
        dq, dk, dv, counters = run_backward("emulator", p, deterministic=det, return_counters=True)
        check(p, (dq, dk, dv))
        assert len(counters) > 3  # more than one launch per kernel


@pytest.mark.parametrize("limit", [2, 5])
def test_backward_grid_limit(monkeypatch, limit):
    """grid.y / grid.z above CUDA's 65535 (shrunk here): host loops over the outer dims and
    chunks of a lone dim that alone is too large (limit 2: batch (6,) -> chunks; (2, 3, 4)
    -> outer loops)."""
    from flasharray._private import launch
    monkeypatch.setattr(launch, "MAX_GRID_YZ", limit)
    grids = []
    real_launch = cb._Runner.launch

    def recording_launch(self, source, name, grid, block, args, smem=0):
        grids.append(tuple(grid))
        return real_launch(self, source, name, grid, block, args, smem)

    monkeypatch.setattr(cb._Runner, "launch", recording_launch)
    for bq, bk in (((6,), (6,)), ((2, 3, 4), (2, 3, 1))):
        for det in (True, False):
            grids.clear()
            p = Problem(np.float16, 32, 20, 33, causal=True, batch_q=bq, batch_k=bk)
            check(p, run_backward("emulator", p, deterministic=det))
            assert len(grids) > 3  # several launches per kernel
            assert all(g[1] <= limit and g[2] <= limit for g in grids), grids


def test_backward_fully_masked_rows_are_zero():
    """Causal with Lq > Lk: the first Lq - Lk rows see no key (lse = -inf): exactly zero dq,
    and keys nobody sees get zero dk, dv."""
    for dt in (np.float16, np.float32):
        p = Problem(dt, 64, 100, 30, causal=True)
        dq, dk, dv = run_backward("emulator", p)
        assert np.all(np.isneginf(p.lse[..., :70]))
        assert np.all(dq[..., :70, :] == 0)
        check(p, (dq, dk, dv))
        p = Problem(dt, 64, 30, 100, causal=True)  # Lk > Lq: every key is seen by the last row
        check(p, run_backward("emulator", p))


@pytest.mark.parametrize("stages", [1, 2])
def test_backward_tensor_core_stages(stages):
    """Single- and double-buffered (cp.async prefetch of the next block) tensor-core kernels,
    under a random schedule (a missing wait or barrier around the prefetch shows up here)."""
    for det in (True, False):
        check_case("emulator", np.float16, 64, (200, 300), True, "gqa", deterministic=det,
                   stages=stages, schedule="random", seed=3)


def test_backward_simt_fallback_16bit():
    """The SIMT kernels also run fp16/bf16 (GPUs without the needed tensor-core instructions)."""
    for dt in (np.float16, bfloat16):
        check_case("emulator", dt, 64, (65, 127), True, "gqa", kernel="simt")


def test_backward_sm75_tiles():
    """sm_75 tiles (64 KB of shared memory) run; bf16 tensor cores need sm_80 (asking for them
    explicitly is an error; by default bf16 falls back to the SIMT kernel, as the forward does)."""
    check_case("emulator", np.float16, 128, (65, 127), True, arch="sm_75")
    check_case("emulator", np.float64, 128, (33, 40), False, arch="sm_75")
    p = Problem(bfloat16, 64, 16, 16, causal=False)
    with pytest.raises(NotImplementedError, match="sm_80"):
        run_backward("emulator", p, arch="sm_75", kernel="tc")


@pytest.mark.parametrize("D,lengths,causal,bcast", [(64, (150, 200), False, "gqa"), (128, (100, 190), True, "none")])
def test_backward_sm75_prefetched_tiles(D, lengths, causal, bcast):
    """sm_75's dense backward fetches the next visit's tiles during this visit's math (fa::ChunkPrefetch: the
    dK/dV kernel's Q_i, dO_i, L_i, D_i; the dQ kernel's K_j, V_j, or, double-buffered at d 64, staged into its
    second buffer): the rule holds in the ordered (default), atomic and recompute dQ modes, and reverse /
    random schedules give the same bits (the emulator checks each prefetched chunk is put, from the source
    it was fetched from, and each staged chunk lands before its wait)."""
    plan = cb.kernel_plan(np.float16, D, D, causal=causal, deterministic=True, arch=75)
    assert (plan["dkv"][2].stages, plan["dq"][2].stages) == (1, 2 if D == 64 else 1)
    p = Problem(np.float16, D, *lengths, causal=causal, bcast=bcast)
    for opts in ({}, {"deterministic": False}, {"dq": "recompute"}):
        ref = run_backward("emulator", p, arch="sm_75", **opts)
        check(p, ref)
        if opts.get("deterministic", True):
            for schedule, seed in (("reverse", 0), ("random", 5)):
                got = run_backward("emulator", p, arch="sm_75", schedule=schedule, seed=seed, **opts)
                for a, b in zip(got[:3], ref[:3]):
                    np.testing.assert_array_equal(a, b)


def test_simt_two_blocks_rule():
    """tiles_bwd.SIMT_TWO_BLOCKS: the float32 SIMT dK/dV kernel of dense calls takes two blocks per SM (its
    launch bounds, the name's last argument) at padded d = dv 16 / 32 / 64 on sm_90 and 16 on sm_80; extension
    calls, float64, other head dims, the dQ kernel and sm_86 keep one."""
    def blocks(dtype=np.float32, D=64, Dv=None, arch=90, ext=0, deterministic=True, ordered=True):
        plan = cb.kernel_plan(dtype, D, Dv or D, causal=False, arch=arch, kernel="simt", ext=ext,
                              deterministic=deterministic, ordered=ordered)
        t = plan["dkv"][2]
        assert plan["dkv"][1].endswith(", 2>") == (t.blocks_per_sm == 2), plan["dkv"][1]
        return t.blocks_per_sm
    assert [blocks(D=d) for d in (16, 32, 40, 48, 64, 80, 128)] == [2, 2, 1, 1, 2, 1, 1]  # 40, 48 pad to 48
    assert [blocks(D=d, arch=80) for d in (16, 32, 64)] == [2, 1, 1]
    assert blocks(D=64, Dv=32) == 1 and blocks(arch=86) == 1 and blocks(dtype=np.float64, D=16) == 1
    assert blocks(ext=1) == 1 and blocks(ext=32) == 1
    assert blocks(deterministic=False, ordered=False) == 2 and blocks(ordered=False) == 2  # atomic, recompute
    recompute = cb.kernel_plan(np.float32, 64, 64, causal=False, deterministic=True, arch=90, kernel="simt")
    assert recompute["dq"][2].blocks_per_sm == 1
    assert "two blocks per SM" in tiles_bwd.simt_tiles("dkv", np.float32, 64, 64, 90).reason


def test_simt_float64_extensions_take_32_query_rows():
    """tiles_bwd.SIMT_F64_EXT_MAX_BR: the float64 dK/dV kernel with extensions visits at most 32 query rows (its
    64 x 64 tile spilled at d 64 on sm_90 in 44 of 504 extension instantiations); dense float64, float32 with
    extensions and the dQ kernel keep their tiles."""
    def tile(dtype, ext, kernel="dkv", D=64, arch=90):
        t = tiles_bwd.simt_tiles(kernel, dtype, D, D, arch, ext=ext)
        return t.block_m, t.block_n
    assert tile(np.float64, 63) == (32, 64) and tile(np.float64, 1, arch=80) == (32, 64)
    assert tile(np.float64, 0) == (64, 64) and tile(np.float32, 63) == (64, 64)
    assert tile(np.float64, 63, "dq") == tile(np.float64, 0, "dq")
    plan = cb.kernel_plan(np.float64, 64, 64, causal=True, arch=90, kernel="simt", ext=63, deterministic=True,
                          ordered=True)
    assert plan["dkv"][2].block_m == 32, plan["dkv"][1]


@pytest.mark.parametrize("D,arch,causal,bcast", thin([(64, "sm_90", True, "gqa"), (64, "sm_90", False, "none"),
                                                 (32, "sm_90", True, "none"), (16, "sm_80", False, "mqa")],
                                                unpack=True))
def test_simt_two_blocks_same_bits(monkeypatch, D, arch, causal, bcast):
    """The two-block SIMT dK/dV kernel (S / dP partial sums in the rolled loop, P in shared memory before dP) adds
    the same terms in the same order as the one-block kernel: dq, dk, dv bitwise equal in the ordered (default)
    and recompute dQ modes (ordered also under a random schedule), dk, dv in the atomic one (whose dq adds in
    the order the blocks run), and the rule holds."""
    p = Problem(np.float32, D, 97, 150, causal=causal, bcast=bcast)
    for opts in ({}, {"deterministic": False}, {"dq": "recompute"}):
        monkeypatch.setattr(tiles_bwd, "SIMT_TWO_BLOCKS", False)
        ref = run_backward("emulator", p, arch=arch, **opts)
        monkeypatch.setattr(tiles_bwd, "SIMT_TWO_BLOCKS", True)
        got = run_backward("emulator", p, arch=arch, **opts)
        check(p, got)
        first = 0 if opts.get("deterministic", True) else 1  # the atomic mode: dk, dv
        for a, b in zip(got[first:3], ref[first:3]):
            np.testing.assert_array_equal(a, b)
    ordered = run_backward("emulator", p, arch=arch)
    got = run_backward("emulator", p, arch=arch, schedule="random", seed=3)
    for a, b in zip(got[:3], ordered[:3]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("D,lengths,causal,bcast", [(64, (150, 200), False, "gqa"), (128, (100, 190), True, "none"),
                                                   (80, (70, 130), True, "none")])
def test_backward_gpu_sm75_code(D, lengths, causal, bcast):
    """sm_75's backward on a newer GPU (arch=75: sm_75's tiles and PTX, compiled by the driver for the GPU; the
    prefetched and staged copies as loads and stores): the rule in the ordered, atomic and recompute modes."""
    p = Problem(np.float16, D, *lengths, causal=causal, bcast=bcast)
    for opts in ({}, {"deterministic": False}, {"dq": "recompute"}):
        with older_arch_ptx():
            grads = run_backward("cuda", p, arch="sm_75", **opts)
        check(p, grads)


def test_backward_bad_options():
    p = Problem(np.float32, 16, 4, 4, causal=False)
    with pytest.raises(TypeError, match="unexpected"):
        run_backward("emulator", p, bogus=1)
    with pytest.raises(ValueError, match="device"):
        cb.backward(*p.args("emulator"), causal=False, scale=0.25, batch_shape=p.batch_shape, device="tpu")
    with pytest.raises(NotImplementedError, match="tensor-core"):
        run_backward("emulator", p, kernel="tc")
    with pytest.raises(ValueError, match=r"option 'dq' must be one of 'ordered', 'recompute', got 'fast'"):
        run_backward("emulator", p, dq="fast")
    assert cb.plan(*p.args("emulator"), causal=False, scale=0.25, batch_shape=p.batch_shape, device="emulator",
                   dq="ordered").dq_mode == "ordered"                 # float32: SIMT orders too
    import types
    from flasharray._private.cuda_forward import EXT_BITS as extensions_bits
    window = types.SimpleNamespace(bits=extensions_bits["window"])  # a plan's extensions (_ExtPlan): their kExt bits
    block_mask = types.SimpleNamespace(bits=extensions_bits["block_mask"])
    alibi = types.SimpleNamespace(bits=extensions_bits["alibi"])
    with pytest.raises(ValueError, match=r"option dq='ordered' takes no ALiBi above head dim 128 on the fp16/bf16 "
                                         r"mma.sync kernel \(this call: kernel 'tc', head dim 256, extensions alibi\)"):
        cb.dq_mode(True, "tc", alibi, "ordered", head_dim=256)
    assert cb.dq_mode(True, "tc", alibi, head_dim=256) == "recompute"
    for ext in (window, block_mask):
        assert cb.dq_mode(True, "tc", ext) == cb.dq_mode(True, "simt", ext) == "ordered"
    # ORDERED_BLOCK_MASK off (hopper_variants' bwd.ORDERED_BLOCK_MASK): the recomputing dQ kernel, not the wgmma one
    assert cb.auto_wgmma(np.float16, 90, D=64, Dv=64, ext=block_mask.bits, deterministic=True)
    with flag_set(cb, "ORDERED_BLOCK_MASK", False):
        assert cb.dq_mode(True, "tc", block_mask) == cb.dq_mode(True, "simt", block_mask) == "recompute"
        assert cb.dq_mode(True, "tc", window) == "ordered"
        assert not cb.auto_wgmma(np.float16, 90, D=64, Dv=64, ext=block_mask.bits, deterministic=True)
    with pytest.raises(ValueError, match=r"option 'dq'='recompute' needs deterministic=True"):
        run_backward("emulator", Problem(np.float16, 16, 4, 4, causal=False), deterministic=False, dq="recompute")


# ---- determinism ------------------------------------------------------------------------------
SCHEDULES = [("forward", 0), ("reverse", 0), ("random", 1), ("random", 2)]


@pytest.mark.parametrize("dt,dq", [("fp16", None), ("fp16", "recompute"), ("fp32", None)])
def test_deterministic_bitwise_under_schedules(dt, dq):
    """deterministic=True: bitwise identical dq, dk, dv under every fiber schedule and run (fp16:
    the default ordered atomics, whose key blocks also run in every block order, and the
    recomputing dQ kernel)."""
    p = Problem(DTYPE_NAMES[dt], 64, 97, 130, causal=True, bcast="gqa")
    ref = run_backward("emulator", p, dq=dq)
    check(p, ref)
    for schedule, seed in SCHEDULES + [("forward", 0)]:
        got = run_backward("emulator", p, schedule=schedule, seed=seed, dq=dq)
        for a, b in zip(ref, got):
            assert a.tobytes() == b.tobytes(), (schedule, seed)


def _dkv_counters(counters):
    (c,) = [c for name, c in counters
            if name.startswith(("flash_bwd_dkv_kernel", "flash_bwd_dkv_grid_kernel", "flash_bwd_dkv_simt_kernel"))]
    return c


@pytest.mark.parametrize("dt", ["fp16", "fp32"])
@pytest.mark.parametrize("causal,lengths", thin([(False, (300, 200)), (True, (300, 200)), (True, (100, 260))],
                                                unpack=True))
def test_ordered_dq_waits_only_for_earlier_blocks(monkeypatch, causal, lengths, dt):
    """The ordered mode (the default of the tensor-core kernels and of the SIMT kernel: fp32): one
    wait and one post per visited (key block, query block) pair. On one worker in block order no
    wait ever blocks, so each block waits only for blocks with a smaller index (fa::sem_wait's rule:
    no deadlock on a GPU, however few blocks are resident); in reverse order most waits block (the
    emulator starts the earlier blocks) and dQ is bitwise the same: every sum runs in key-block
    order. Several query heads share each K/V head (GQA: each keeps its own counters)."""
    dtype = DTYPE_NAMES[dt]
    p = Problem(dtype, 64, *lengths, causal=causal, bcast="gqa")
    monkeypatch.setenv("FLASHARRAY_EMULATOR_THREADS", "1")
    *ref, counters = run_backward("emulator", p, return_counters=True)
    check(p, ref)
    c = _dkv_counters(counters)
    t_kv = cb.kernel_plan(dtype, 64, 64, causal=causal, deterministic=True, arch=80, ordered=True)["dkv"][2]
    B = int(np.prod(p.batch_shape))
    assert c.sem_waits == B * cb.visited_query_blocks(*lengths, causal, t_kv) > 0
    assert c.sem_blocked == 0
    for workers in ("1", "2"):
        monkeypatch.setenv("FLASHARRAY_EMULATOR_THREADS", workers)
        *got, counters = run_backward("emulator", p, schedule="reverse", return_counters=True)
        assert _dkv_counters(counters).sem_blocked > 0
        for a, b in zip(ref, got):
            assert a.tobytes() == b.tobytes(), workers


@pytest.mark.parametrize("D,per_visit", [(128, 3), (256, 4)])
def test_row_tile_ordered_dq(monkeypatch, D, per_visit):
    """The row-tile dK/dV kernel's ordered dQ (sm_75 / 86 / 89, head dims other than the grid layout's, dropout):
    fa::sem_wait's halves around the dV_j, dK_j products (thread 0 polls, the turn's barrier extends it) and
    fa::sem_post's release by thread 0 after the next visit's first barrier, so a visit holds 3 barriers (D 128:
    P^T, dS^T in registers; was 4) or 4 (D 256: through shared memory; was 5), plus 3 per block (the last post's,
    the epilogue's 2; every block visits some query block here).
    One wait per visit, none blocked in block order on one worker; bitwise the same under reverse and random
    schedules, where the waits block."""
    p = Problem(np.float16, D, 150, 200, causal=True, bcast="gqa")
    with flag_set(tiles_bwd, "GRID_LAYOUT", False):
        monkeypatch.setenv("FLASHARRAY_EMULATOR_THREADS", "1")
        *ref, counters = run_backward("emulator", p, return_counters=True)
        check(p, ref)
        assert any(name.startswith("flash_bwd_dkv_kernel<") for name, _ in counters)
        c = _dkv_counters(counters)
        t_kv = cb.kernel_plan(np.float16, D, D, causal=True, deterministic=True, arch=80, ordered=True)["dkv"][2]
        visits = int(np.prod(p.batch_shape)) * cb.visited_query_blocks(150, 200, True, t_kv)
        assert c.sem_waits == visits > 0 and c.sem_blocked == 0
        assert c.barriers == per_visit * visits + 3 * c.blocks
        monkeypatch.setenv("FLASHARRAY_EMULATOR_THREADS", "2")
        for schedule, seed in (("reverse", 0), ("random", 3)):
            *got, counters = run_backward("emulator", p, schedule=schedule, seed=seed, return_counters=True)
            assert _dkv_counters(counters).sem_blocked > 0
            assert all(a.tobytes() == b.tobytes() for a, b in zip(ref, got)), schedule


@pytest.mark.parametrize("D,causal,deterministic", thin([(128, True, True), (128, False, False), (256, False, True),
                                                    (256, True, False)], unpack=True))
def test_grid_layout_kernel(D, causal, deterministic):
    """The grid-layout dK/dV kernel (tiles_bwd.grid_tile: FlashAttention-2's warp grid, d 64 / 128 / 256, atomic and
    ordered dQ) serves dense tensor-core calls on sm_80 / sm_90. Its dK, dV are bitwise those of the row-tile
    kernel (the same P^T, dS^T and the same k16 steps in query order, only more per visit); its dQ meets the rule,
    and in the ordered mode runs bitwise the same under every block schedule (one buffer of Q_i, dO_i refilled
    while dQ is added: the refill waits for every warp's last read). d 256: the 64 x 64 tile, whose warps add
    their 64 dQ columns in two passes (and compute dP^T on both key m tiles at once)."""
    p = Problem(np.float16, D, 200, 300, causal=causal, bcast="gqa")
    tile = {128: "64, 128", 256: "64, 64"}[D]
    for arch, mode in ((80, deterministic), (90, deterministic), (80, not deterministic)):
        plan = cb.kernel_plan(np.float16, D, D, causal=causal, deterministic=mode, arch=arch, ordered=mode)
        assert plan["dkv"][1].startswith("flash_bwd_dkv_grid_kernel<fa_half, fa_half, %d, %d, %s, " % (D, D, tile))
    assert tiles_bwd.tc_tiles("dkv", 128, 128, 86, mode="ordered").layout == "rows"      # 99 KB: no room
    assert tiles_bwd.tc_tiles("dkv", 128, 128, 80, mode="recompute").layout == "rows"
    assert tiles_bwd.tc_tiles("dkv", 128, 128, 80, ext=16, mode="ordered").layout == "rows"    # dropout: spilled
    assert tiles_bwd.tc_tiles("dkv", 128, 128, 80, ext=20, mode="ordered").layout == "grid"    # softcap, dropout
    assert tiles_bwd.tc_tiles("dkv", 128, 128, 80, ext=1, mode="ordered").layout == "rows"     # spilled set
    assert tiles_bwd.tc_tiles("dkv", 128, 128, 80, ext=4, mode="ordered").layout == "grid"     # softcap
    assert tiles_bwd.tc_tiles("dkv", 256, 256, 86, mode="atomic").layout == "rows"       # 150.5 KB > 99 KB
    assert tiles_bwd.tc_tiles("dkv", 256, 256, 90, ext=33, mode="atomic").layout == "rows"     # spilled at d 256
    assert tiles_bwd.tc_tiles("dkv", 256, 256, 90, ext=35, mode="atomic").layout == "grid"
    *grid, counters = run_backward("emulator", p, deterministic=deterministic, return_counters=True)
    assert any(name.startswith("flash_bwd_dkv_grid_kernel") for name, _ in counters)
    check(p, grid)
    with flag_set(tiles_bwd, "GRID_LAYOUT", False):
        *rows, counters = run_backward("emulator", p, deterministic=deterministic, return_counters=True)
    assert any(name.startswith("flash_bwd_dkv_kernel") for name, _ in counters)
    assert grid[1].tobytes() == rows[1].tobytes() and grid[2].tobytes() == rows[2].tobytes()
    if deterministic:
        for schedule, seed in (("reverse", 0), ("random", 3)):
            got = run_backward("emulator", p, schedule=schedule, seed=seed)
            assert all(a.tobytes() == b.tobytes() for a, b in zip(grid, got)), schedule


def _aligned_copy(a):
    """A read-only copy of ``a`` (same shape and strides when contiguous) whose data starts on a 256-byte boundary."""
    raw = np.empty(a.nbytes + 256, np.uint8)
    off = (-raw.ctypes.data) % 256
    b = raw[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
    b[...] = a
    b.flags.writeable = False
    return b


@pytest.mark.parametrize("D,causal,deterministic,bcast", [(128, False, True, "gqa"), (64, True, False, "none")])
def test_grid_layout_swizzled_query_tiles(D, causal, deterministic, bcast):
    """tiles_bwd.GRID_SWIZZLE: the grid kernel's Q_i, dO_i unpadded and XOR-swizzled. The gradients are bitwise
    those of the padded rows (the same products on the same values; the ordered mode also under reverse and random
    schedules). The copies reach the emulator's model of an H100's cost: cp_async_sectors at 1.5x the ideal with padded
    rows, near 1 with the swizzle (K_j, V_j, copied once per block, stay padded). ldmatrix stays conflict-free. Rows not
    16-byte aligned (element-wise copies) and softcap (whose swizzled instantiations spilled) keep the padded rows."""
    p = Problem(np.float16, D, 520, 200, causal=causal, bcast=bcast)   # many visits per key block
    for name in ("q", "k", "v", "dout", "out", "lse"):  # 256-byte aligned, as CuPy's arrays (sector counts assume it)
        setattr(p, name, _aligned_copy(getattr(p, name)))
    plan = cb.kernel_plan(np.float16, D, D, causal=causal, deterministic=deterministic, arch=90,
                          ordered=deterministic)
    # (kExt, kSwizzle; ordered: kEntriesFirst, tiles_bwd.ENTRIES_FIRST)
    assert plan["dkv"][1].endswith(", 0, true, true>" if deterministic else ", 0, true>") and plan["dkv"][2].swizzle
    plan_of = functools.partial(cb.kernel_plan, np.float16, D, D, causal=causal, deterministic=True, arch=90,
                                ordered=True)
    assert plan_of(ext=32)["dkv"][1].endswith(", 32, true>")   # lengths: swizzled too
    assert plan_of(ext=4)["dkv"][1].endswith(", 4>")           # softcap: padded (swizzled, it spilled)
    unaligned = plan_of(vec=False)["dkv"]
    assert unaligned[1].startswith("flash_bwd_dkv_grid_kernel") and not unaligned[2].swizzle
    *swz, counters = run_backward("emulator", p, deterministic=deterministic, return_counters=True)
    with flag_set(tiles_bwd, "GRID_SWIZZLE", False):
        assert not plan_of()["dkv"][2].swizzle
        *padded, counters_p = run_backward("emulator", p, deterministic=deterministic, return_counters=True)
    check(p, swz)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(swz, padded))
    (c,) = [c for name, c in counters if name.startswith("flash_bwd_dkv_grid_kernel")]
    (cp,) = [c for name, c in counters_p if name.startswith("flash_bwd_dkv_grid_kernel")]
    # what stays above 1 with the swizzle is K_j, V_j's share (padded, copied once per block; causal: fewer visits)
    assert cp.cp_async_sector_factor > 1.45 and cp.cp_async_line_factor > 1.8
    assert c.cp_async_sector_factor < cp.cp_async_sector_factor - 0.3
    assert c.cp_async_line_factor < cp.cp_async_line_factor - 0.5
    if not causal:
        assert c.cp_async_sector_factor < 1.05 and c.cp_async_line_factor < 1.1
    assert c.ldmatrix_conflict_factor == cp.ldmatrix_conflict_factor == 1.0
    assert c.cp_async_conflict_factor == 1.0
    if deterministic:
        for schedule, seed in (("reverse", 0), ("random", 5)):
            got = run_backward("emulator", p, schedule=schedule, seed=seed)
            assert all(a.tobytes() == b.tobytes() for a, b in zip(swz, got)), schedule


@pytest.mark.parametrize("dt,D,kernels", [
    ("fp16", 128, ["flash_bwd_preprocess_kernel", "flash_bwd_dkv_grid_kernel", "flash_bwd_convert_dq_tc_kernel"]),
    ("fp32", 64, ["flash_bwd_preprocess_kernel", "flash_bwd_dkv_simt_kernel", "flash_bwd_convert_dq_kernel"])])
def test_ordered_and_recomputed_dq_agree(dt, D, kernels):
    """The two deterministic modes compute the same gradients (dK, dV: the same kernel code; dQ: a
    different summation order, both within the test rule); the ordered mode launches the atomic
    mode's kernels (preprocess clearing the accumulator and counters, dK/dV, convert). SIMT: the
    atomic dK/dV kernel's 5 products instead of 7 (no dQ kernel recomputing S and dP)."""
    p = Problem(DTYPE_NAMES[dt], D, 150, 190, causal=True)
    *ordered, counters = run_backward("emulator", p, return_counters=True)
    recomputed = run_backward("emulator", p, dq="recompute")
    check(p, ordered)
    check(p, recomputed)
    assert ordered[1].tobytes() == recomputed[1].tobytes() and ordered[2].tobytes() == recomputed[2].tobytes()
    names = [name.split("<")[0] for name, _ in counters]
    assert names == kernels
    # kOrderedDQ, kExt, then the grid kernel's kSwizzle, kEntriesFirst (SIMT: kExt, kOrderedDQ)
    assert counters[1][0].endswith(", true, 0, true, true>" if dt == "fp16" else ", 0, true>")


@pytest.mark.parametrize("dt", ["fp16", "fp64"])
def test_atomic_mode_correct_under_schedules(dt):
    """deterministic=False: float atomics in any order stay within the test rule."""
    p = Problem(DTYPE_NAMES[dt], 32, 97, 130, causal=True, bcast="mqa")
    for schedule, seed in SCHEDULES:
        check(p, run_backward("emulator", p, deterministic=False, schedule=schedule, seed=seed))


# ---- global memory traffic --------------------------------------------------------------------
def measured_traffic(dtype, D, Lq, Lk, causal, deterministic, dq=None):
    """(emulator counters, cuda_backward.analytic_global_bytes) as (read, written) bytes."""
    p = Problem(dtype, D, Lq, Lk, causal=causal)
    *grads, counters = run_backward("emulator", p, deterministic=deterministic, return_counters=True, dq=dq)
    check(p, grads)
    B = int(np.prod(p.batch_shape))
    want = cb.analytic_global_bytes(B, Lq, Lk, D, D, dtype, causal=causal, deterministic=deterministic, dq=dq,
                                    precision="ieee" if np.dtype(dtype) == np.float32 else None)
    got = (sum(c.global_read_bytes for _, c in counters), sum(c.global_write_bytes for _, c in counters))
    return got, want


def test_analytic_traffic_by_hand():
    """The model on a case small enough to count by hand: fp32, B=1, Lq=Lk=D=Dv=16, one block
    each way (SIMT tiles are 64 x 64 on sm_80), deterministic: the recomputing dQ kernel, and the
    ordered atomics (the default: one accumulator row more for the counter, one wait and post)."""
    s, a, L, D = 4, 4, 16, 16
    read = 2 * L * D * s                       # preprocess: dO, O
    read += 2 * L * D * s + (2 * L * D * s + 2 * L * a)   # dK/dV: K, V; Q, dO, L, D (one visit)
    write = L * a + 2 * L * D * s              # D; dK, dV
    r_read = read + (2 * L * D * s + 2 * L * a) + 2 * L * D * s   # dQ: Q, dO, L, D; K, V (one visit)
    r_write = write + L * D * s                                  # dQ
    for kw in ({"precision": "ieee"}, {"arch": 75}):  # (sm_75: no TF32, IEEE)
        assert cb.analytic_global_bytes(1, L, L, D, D, np.float32, dq="recompute", **kw) == (r_read, r_write)
    o_read = read + L * D * a + 8 + L * D * a                     # atomics (read-modify-write), wait + post, convert
    o_write = write + (L + 1) * D * a + L * D * a + 4 + L * D * s  # clear (+ the counter's row), atomics, post, dQ
    assert cb.analytic_global_bytes(1, L, L, D, D, np.float32, precision="ieee") == (o_read, o_write)


@pytest.mark.parametrize("dt,D,deterministic,dq", [("fp16", 64, True, None), ("fp16", 64, True, "recompute"),
                                                   ("fp16", 64, False, None), ("fp32", 32, True, None),
                                                   ("fp64", 16, False, None)])
def test_counters_match_analytic(dt, D, deterministic, dq):
    """Non-causal: every (query block, key block) pair is visited."""
    got, want = measured_traffic(DTYPE_NAMES[dt], D, 100, 150, False, deterministic, dq)
    assert got == want


@pytest.mark.parametrize("dt,deterministic,dq", [("fp16", True, None), ("fp16", True, "recompute"),
                                                 ("fp32", False, None)])
def test_counters_causal_skips_blocks(dt, deterministic, dq):
    """Causal: the dK/dV kernel skips query blocks above the diagonal, the dQ kernel key blocks
    right of it; the counted traffic is exactly that of the visited pairs."""
    got, want = measured_traffic(DTYPE_NAMES[dt], 64, 300, 200, True, deterministic, dq)
    assert got == want
    full, _ = measured_traffic(DTYPE_NAMES[dt], 64, 300, 200, False, deterministic, dq)
    assert sum(got) < sum(full)


def test_tensor_cores_and_cp_async_used():
    p = Problem(np.float16, 64, 64, 64, causal=False)
    *_, counters = run_backward("emulator", p, return_counters=True, dq="recompute")
    by_kernel = {name.split("<")[0]: c for name, c in counters}
    for name in ("flash_bwd_dkv_kernel", "flash_bwd_dq_kernel"):
        assert by_kernel[name].mma > 0 and by_kernel[name].ldmatrix > 0 and by_kernel[name].cp_async > 0
    # D = 59: rows are not 16-byte aligned, element loads instead of 16-byte cp.async (the grid-layout dK/dV kernel
    # still copies L_i, D_i, our float rows, by 4-byte cp.async)
    p = Problem(np.float16, 59, 64, 64, causal=False)
    *_, counters = run_backward("emulator", p, return_counters=True)
    assert all(c.cp_async_bytes == 4 * c.cp_async for _, c in counters)
    assert any(name.startswith("flash_bwd_dkv_grid_kernel") and c.cp_async > 0 for name, c in counters)


# ---- the full matrix ----------------------------------------------------------------------------
FULL = list(itertools.product(DTYPE_NAMES, DIMS, LENGTHS, (False, True), BCASTS, ("bhsd", "bshd"),
                              (True, False)))


@pytest.mark.slow
@pytest.mark.parametrize("case", FULL, ids=_id)
def test_backward_emulator_full(case):
    _run_case("emulator", case)


# ---- GPU: the same bodies on a CUDA device ------------------------------------------------------
@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_backward_gpu(case):
    _run_case("cuda", case)


@pytest.mark.gpu
@pytest.mark.slow
@requires_gpu
@pytest.mark.parametrize("case", FULL, ids=_id)
def test_backward_gpu_full(case):
    _run_case("cuda", case)


@pytest.mark.gpu
@requires_gpu
def test_backward_gpu_deterministic_bitwise():
    p = Problem(np.float16, 64, 300, 500, causal=True, bcast="gqa")
    ref = run_backward("cuda", p)
    check(p, ref)
    for _ in range(3):
        got = run_backward("cuda", p)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(ref, got))


@pytest.mark.gpu
@requires_gpu
def test_backward_gpu_matches_emulator():
    """GPU vs emulator: same kernels; differences only from mma accumulation order and exp2
    (ex2.approx), so at most a couple of fp16 ulps at the gradient's magnitude."""
    p = Problem(np.float16, 64, 65, 127, causal=True, bcast="gqa")
    gpu = run_backward("cuda", p)
    emu = run_backward("emulator", p)
    check(p, gpu)
    for a, b in zip(gpu, emu):
        b = b.astype(np.float32)
        ulp = 2.0 ** -10 * float(np.abs(b).max())  # one fp16 ulp at the largest gradient
        np.testing.assert_allclose(a.astype(np.float32), b, rtol=0, atol=4 * ulp)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("D", [64, 128, 256])
def test_backward_gpu_grid_layout(D):
    """The grid-layout dK/dV kernel on the device (kernel="tc": sm_90's default is the wgmma backward): the rule
    in both dQ modes, the ordered mode bitwise the same over runs, and dK, dV bitwise the row-tile kernel's."""
    import cupy
    arch = int(cupy.cuda.Device().compute_capability)
    if tiles_bwd.grid_tile(D, D, arch, mode="ordered") is None:
        pytest.skip("the grid layout does not apply on sm_%d (shared memory)" % arch)
    p = Problem(np.float16, D, 300, 500, causal=True, bcast="gqa")
    ref = run_backward("cuda", p, kernel="tc")
    check(p, ref)
    for _ in range(2):
        assert all(a.tobytes() == b.tobytes() for a, b in zip(ref, run_backward("cuda", p, kernel="tc")))
    check(p, run_backward("cuda", p, kernel="tc", deterministic=False))
    with flag_set(tiles_bwd, "GRID_LAYOUT", False):
        rows = run_backward("cuda", p, kernel="tc")
    assert ref[1].tobytes() == rows[1].tobytes() and ref[2].tobytes() == rows[2].tobytes()


# ---- the device="cuda" launch path without a GPU ---------------------------------------------------
@pytest.mark.parametrize("dt,D,deterministic", [("fp16", 128, True), ("fp32", 64, False)])
def test_cupy_launch_path_with_fake_cupy(monkeypatch, dt, D, deterministic):
    """device="cuda" end to end (CupyLauncher: RawModule options, name expressions, the >48 KB
    opt-in, argument types) against the CuPy stand-in of test_cuda_forward, backed by the emulator."""
    import sys
    from flasharray._private import launch
    from test_cuda_forward import _fake_cupy
    log, arrays = [], []
    fake = _fake_cupy(log, arrays)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(launch.CupyLauncher, "_modules", {})
    monkeypatch.setattr(launch, "_launchers", {})
    p = Problem(DTYPE_NAMES[dt], D, 70, 90, causal=True, bcast="gqa")
    arrays += list(p.args("emulator"))  # the stand-in maps device addresses back to these
    grads = cb.backward(*p.args("emulator"), causal=True, scale=p.scale, batch_shape=p.batch_shape,
                        device="cuda", deterministic=deterministic,
                        precision="ieee" if np.dtype(p.dtype) == np.float32 else None)
    check(p, grads)
    plan = cb.kernel_plan(p.dtype, D, D, causal=True, deterministic=deterministic, arch=80,
                          ordered=cb.dq_mode(deterministic, cb.default_kernel(p.dtype, 80), None) == "ordered")
    launched = {name: (smem, optin) for name, smem, optin in log}
    assert set(launched) == {name for _, name, _ in plan.values()}
    assert fake.driver_launches == [name for name, _, _ in log]  # every launch through launchKernel
    for _, name, t in plan.values():
        smem, optin = launched[name]
        assert smem == (t.smem if t else 0) and optin >= smem


@pytest.mark.parametrize("D", [64, 128, 256])
def test_ldmatrix_reads_are_bank_conflict_free(D):
    """Every fa::ldmatrix of the tensor-core forward and backward kernels is served in the ideal
    number of shared-memory wavefronts (emulator counter; the shared tiles are laid out so that
    each 8x8 matrix's rows hit distinct banks). A layout change that causes conflicts fails here."""
    rng = np.random.default_rng(D)
    q, k, v = (rng.standard_normal((1, 1, 128, D)).astype(np.float16) for _ in range(3))
    fwd = []
    out, lse = cuda_forward.forward(q, k, v, causal=True, scale=D ** -0.5, batch_shape=(1, 1),
                                    device="emulator", counters=fwd)
    *_, bwd = cb.backward(np.ones_like(out), q, k, v, out, lse, causal=True, scale=D ** -0.5,
                          batch_shape=(1, 1), device="emulator", return_counters=True)
    launches = [("forward", c) for c in fwd] + list(bwd)
    assert sum(c.ldmatrix_wavefronts_ideal for _, c in launches) > 0
    for name, c in launches:
        assert c.ldmatrix_wavefronts == c.ldmatrix_wavefronts_ideal, (name, c.ldmatrix_conflict_factor)
