"""The Hopper kernels (cuda_src/flash_fwd_sm90.cu, flash_bwd_sm90.cu; docs/hopper.md) on an sm_90 GPU.

Every test body takes ``device``: ``"cuda"`` (CuPy arrays on an H100 / H200, marked ``gpu`` and skipped with
the reason by :data:`requires_sm90`) or ``"emulator"`` (arch sm_90): a small subset runs on the emulator in
the default suite so that the bodies are known to work; the matrices are GPU-only (``-m gpu``; the largest
also ``slow``). Each case selects a variant by the modules' flags (:data:`FWD_VARIANTS`, :data:`BWD_VARIANTS`),
asserts from the plan that this variant's kernel instantiation is the one launched, checks the results
against the float64 reference with DESIGN.md's rule (``flasharray.testing``) and, on the GPU, against the
emulator running the same variant on the same inputs:

- **GPU vs emulator: a tight tolerance, not bits.** The emulator rounds each wgmma k16 step once to fp32 from
  exact float64 products, but within a step the hardware's order and internal precision are unspecified
  (docs/emulator.md, "Arithmetic"), and the GPU's ``exp2f`` / ``log2f`` are the approximate MUFU
  instructions where the emulator calls the host's: a few fp32 ulps per row, which can move an fp16 / bf16
  result by one ulp of the output type. Outputs: ``|gpu − emu| ≤ 2·eps·max(|emu|, 2^-6)`` elementwise
  (eps the dtype's, 2^-10 / 2^-7: two ulps at the element's magnitude); lse (fp32): rtol = atol = 1e-5, as
  tests/test_cuda_forward.py's ``test_forward_gpu_matches_emulator``; gradients: ``4·eps·max|emu|`` per
  tensor, as tests/test_cuda_backward.py's ``test_backward_gpu_matches_emulator``. The same holds for the
  ordered (deterministic) dQ: its addition order is fixed (key-block order, documented), but the addends
  themselves differ by the above, so GPU and emulator agree to the tolerance, not to the bit; what is
  bit-exact is the GPU against itself (three runs, :func:`test_ordered_backward_bits_repeat`). On the
  emulator device the comparison run uses a permuted schedule and demands bits (a documented emulator
  property) where the order is fixed: forward out / lse, backward dk / dv, and dq in the ordered mode.
- The tensor maps (:func:`test_forward_tensor_maps`, :func:`test_backward_tensor_maps`): rank-5 maps of
  strided (BSHD, sliced head dim) views, of GQA-packed q and of the outputs (TMA stores), encoded by the
  driver (``cuTensorMapEncodeTiled``) on the GPU, then launched.

Runs: ``pytest -m "gpu and not slow" tests/test_gpu_sm90.py`` (about 200 cases, each compared with the
emulator: minutes on an H100 machine), ``-m gpu`` adds the slow matrices (Lq, Lk up to 2048, reference only).
Inputs reach the GPU with their layout (:func:`to_device` keeps strides and offsets: ``cupy.asarray`` would
make BSHD views contiguous). NVRTC compiles each instantiation for sm_90a once (about 1 s; cached).
"""
import numpy as np
import pytest

from flasharray._private import cuda_backward as cb
from flasharray._private import cuda_backward_sm90 as B
from flasharray._private import cuda_forward
from flasharray._private import cuda_forward_sm90 as F
from flasharray._private import launch
from flasharray import reference
from flasharray.testing import assert_attention_close

from test_cuda_backward import Problem, check
from test_cuda_backward_sm90 import template_flags
from test_cuda_forward import make_inputs, run_forward
from test_cuda_forward_sm90 import DTYPES, _batch, work_tiles

EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}
#: Lq x Lk above which a GPU case is held to the reference only (the slow matrices: the emulator would take
#: minutes per case).
EMULATOR_MAX_LQ_LK = 2 ** 18


# ---- devices ------------------------------------------------------------------------------------------------

def sm90_status():
    """(True, "") where CuPy sees a compute capability 9.0 device and NVRTC can compile for sm_90a; else
    (False, what is missing)."""
    try:
        import cupy
    except Exception as e:  # ImportError, or a CuPy without its CUDA libraries
        return False, "CuPy is not importable (%s: %s)" % (type(e).__name__, e)
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return False, "no CUDA device visible to CuPy (%s)" % e
    if n == 0:
        return False, "no CUDA device visible to CuPy"
    cc = cupy.cuda.Device().compute_capability
    if cc != "90":
        return False, "the CUDA device has compute capability %s; the wgmma / TMA kernels need 90 (H100, H200)" % cc
    from flasharray._private import nvrtc
    ok, why = nvrtc.available()
    return (True, "") if ok else (False, "NVRTC unavailable (the sm_90a cubins): %s" % why)


SM90_OK, SM90_WHY = sm90_status()
requires_sm90 = pytest.mark.skipif(not SM90_OK, reason=SM90_WHY)
GPU = [pytest.mark.gpu, requires_sm90]


def on_devices(emulator, gpu, slow=(), ids=str):
    """``(device, *case)`` params: ``emulator`` cases on the emulator (default suite) and, with ``gpu``, on an
    sm_90 GPU; ``slow`` on the GPU only, also marked slow."""
    return ([pytest.param("emulator", *c, id="emulator-" + ids(c)) for c in emulator]
            + [pytest.param("cuda", *c, marks=GPU, id="cuda-" + ids(c)) for c in list(emulator) + list(gpu)]
            + [pytest.param("cuda", *c, marks=GPU + [pytest.mark.slow], id="cuda-" + ids(c)) for c in slow])


def _case_id(c):
    return "-".join(str(x).replace(" ", "").replace("'", "") for x in c)


def to_device(device, *arrays):
    """The arrays on ``device``: NumPy ones for the emulator; on "cuda" CuPy views with the same shapes, byte
    strides and offset from their owning allocation (copied whole), so that strided views stay strided."""
    if device != "cuda":
        return arrays
    import cupy
    out = []
    for x in arrays:
        base = x
        while isinstance(base.base, np.ndarray):
            base = base.base
        assert base.flags.c_contiguous, "to_device: owner not contiguous"
        raw = cupy.asarray(base.reshape(-1).view(np.uint8))
        off = x.ctypes.data - base.ctypes.data
        out.append(cupy.ndarray(x.shape, x.dtype, raw.data + off, x.strides))
    return tuple(out)


def host(x):
    return x if isinstance(x, np.ndarray) else x.get()


def _bytes(a):
    return np.ascontiguousarray(a).view(np.uint8)


@pytest.fixture
def flags(monkeypatch):
    """set(module, **values): the module's flags set for this test (plans cleared: they hold their kernels)."""
    def set_(module, **values):
        for name, value in values.items():
            assert hasattr(module, name), name
            monkeypatch.setattr(module, name, value)
        launch._clear_plans()
    yield set_
    launch._clear_plans()


def assert_output_matches(got, emu, dtype, exact, qkv=None, causal=False):
    """Forward out against the emulator's (the module docstring's tolerance; ``exact``: bits).

    Not bits: each element within 2 eps of max(|emu|, w, 2^-6), w = (P|V|)/l of the row (attention
    of ``qkv`` with |V|, float64; 0 without ``qkv``). P is rounded to fp16 / bf16 for P·V, and a P_ij
    that the GPU's and the emulator's exp2 put on two sides of a rounding boundary moves out_i by
    up to eps·P_ij|V_j|/l_i: summed over the row, eps·w. Where the terms cancel, w is far above
    |out| (seen on an H200: causal rows with a few keys, 1 element in 10^4-10^5 one fp16 ulp of w
    off)."""
    if exact:
        np.testing.assert_array_equal(_bytes(got), _bytes(emu))
        return
    a, b = got.astype(np.float64), emu.astype(np.float64)
    w = 0.0
    if qkv is not None:
        q, k, v = (np.asarray(x, np.float64) for x in qkv)
        w = reference.attention(q, k, np.abs(v), causal=causal, scale=1.0 / np.sqrt(q.shape[-1]))
    bound = 2 * EPS[dtype] * np.maximum(np.maximum(np.abs(b), w), 2.0 ** -6)
    bad = ~(np.abs(a - b) <= bound)
    assert not bad.any(), "%d of %d differ beyond 2 ulps, max |diff| %.3e" % (bad.sum(), a.size, np.abs(a - b).max())


def assert_grads_match(got, emu, dtype, exact):
    """dq, dk, dv against the emulator's: ``exact`` (a tuple of 3 bools) bits, else 4 eps x max|emu|."""
    for name, a, b, bits in zip(("dq", "dk", "dv"), got, emu, exact):
        if bits:
            np.testing.assert_array_equal(_bytes(a), _bytes(b), err_msg=name)
        else:
            b = b.astype(np.float32)
            np.testing.assert_allclose(a.astype(np.float32), b, rtol=0, atol=4 * EPS[dtype] * float(np.abs(b).max()),
                                       err_msg=name)


# ---- forward ------------------------------------------------------------------------------------------------

#: cuda_forward_sm90 flags of each forward variant (the rest at their defaults: the ws kernel, overlap, TMA store
#: where out is TMA-legal, persistent for padded d <= 128 with the device's SM count).
FWD_VARIANTS = {
    "cp_async": dict(USE_TMA=False),
    "ws": {},
    "ws_no_overlap": dict(OVERLAP=False),
    "row_store": dict(USE_TMA_STORE=False),
    "non_persistent": dict(PERSISTENT=False),
    "persistent_sm1": dict(SM_COUNT=1),
    "persistent_sm3": dict(SM_COUNT=3),
    "narrow_keys": dict(WIDE_KEYS=False),   # key tiles of 128 / 64, not 192 / 176 / 80 (d 256 persistent: sO over sQ)
    "d256_not_persistent": dict(PERSISTENT_MAX_HEAD_DIM=128),   # d = 256 one block per work tile
    "d256_causal_persistent": dict(PERSISTENT_CAUSAL_MAX_HEAD_DIM=256),   # causal d = 256 persistent (not the default)
}


def forward_plan(device, q, k, v, causal):
    return cuda_forward.plan(q, k, v, causal=causal, scale=1.0 / np.sqrt(q.shape[-1]), batch_shape=_batch(q, k, v),
                             device=device, arch="sm_90", kernel="wgmma")


def expect_forward_kernel(plan, q, k, v, causal):
    """The plan launches the instantiation the flags select for these arrays (its name, its grid)."""
    (rec,) = plan.launches
    tma = F.USE_TMA and F.tma_legal((q, k, v)) is None
    assert plan.tile.kernel == "wgmma" and plan.tile.tma == tma, plan.tile.describe()
    if not tma:
        assert rec.name.startswith("flash::flash_fwd_sm90_kernel<"), rec.name
        return
    limit = min(F.PERSISTENT_MAX_HEAD_DIM, F.PERSISTENT_CAUSAL_MAX_HEAD_DIM) if causal else F.PERSISTENT_MAX_HEAD_DIM
    persistent = F.PERSISTENT and max(plan.tile.head_dim, plan.tile.head_dim_v) <= limit
    store = F.USE_TMA_STORE and v.shape[-1] % 8 == 0  # the library's contiguous out: 16-byte rows
    assert plan.tile.overlap == F.OVERLAP and F.ws_flags(rec.name) == (store, persistent), rec.name
    if persistent:
        entries = int(np.prod(_batch(q, k, v))) // plan.gqa_group
        n_work = work_tiles(plan.tile, q.shape[-2] * plan.gqa_group, entries)
        assert rec.grid == (min(n_work, F.SM_COUNT or plan.sm_count), 1, 1)


def run_fwd(device, q, k, v, causal, **opts):
    return tuple(host(x) for x in run_forward(device, q, k, v, causal=causal, kernel="wgmma", arch="sm_90", **opts))


def forward_body(device, q, k, v, causal, vs_emulator=True):
    """Plan (the variant's kernel), run, the reference rule; against the emulator (GPU: tolerance; emulator
    device: a reversed schedule, bits). Returns (out, lse) on the host."""
    dev = to_device(device, q, k, v)
    expect_forward_kernel(forward_plan(device, *dev, causal), *dev, causal)
    out, lse = run_fwd(device, *dev, causal)
    assert out.shape == q.shape[:-1] + (v.shape[-1],) and out.dtype == q.dtype and lse.shape == q.shape[:-1]
    assert_attention_close(out, q, k, v, causal=causal, lse=lse)
    if vs_emulator:
        exact = device == "emulator"
        emu = run_fwd("emulator", q, k, v, causal, **({"schedule": "reverse"} if exact else {}))
        assert_output_matches(out, emu[0], q.dtype.name, exact, (host(q), host(k), host(v)), causal)
        if exact:
            np.testing.assert_array_equal(_bytes(lse), _bytes(emu[1]))
        else:
            np.testing.assert_allclose(lse, emu[1], rtol=1e-5, atol=1e-5)
    return out, lse


def forward_case(device, variant, dtype, D, Lq, Lk, causal, layout, gqa, batch, flags):
    flags(F, **FWD_VARIANTS[variant])
    q, k, v = make_inputs(DTYPES[dtype], D, Lq, Lk, layout=layout, gqa=gqa, batch=batch, seed=D + Lq + Lk)
    forward_body(device, q, k, v, causal, Lq * Lk <= EMULATOR_MAX_LQ_LK)


# (dtype, D, Lq, Lk, causal, layout, gqa, batch): lengths off the tiles, Lq > Lk causal (rows that see no key),
# d 64 / 128 / 256 and padded 40 / 72, D = 59 (118-byte rows: every variant falls back to the cp.async kernel),
# BSHD views, GQA broadcast, Lq = 1 decode (GQA-packed rows), several batch entries (persistent: work tiles).
FWD_SHAPES = [
    ("float16", 64, 77, 130, False, "bhsd", False, (2, 3)),
    ("bfloat16", 64, 130, 77, True, "bhsd", False, (1, 2)),
    ("float16", 128, 200, 330, True, "bshd", False, (2, 2)),
    ("bfloat16", 128, 65, 200, False, "bshd", True, (2, 4)),
    ("float16", 256, 150, 100, True, "bhsd", False, (1, 2)),
    ("bfloat16", 256, 33, 300, False, "bshd", True, (1, 3)),
    ("float16", 40, 1, 257, True, "bhsd", True, (2, 4)),
    ("bfloat16", 72, 1, 130, False, "bshd", True, (1, 4)),
    ("float16", 59, 20, 70, True, "bhsd", False, (1, 2)),
    ("float16", 64, 150, 370, False, "bhsd", False, (2, 2)),   # WIDE_KEYS: key tiles of 192, the last of 178
    ("bfloat16", 160, 130, 200, False, "bshd", False, (1, 2)),  # head dims padded to 192
]
FWD_EMULATOR = [  # (variant, *shape): each variant family once, small
    ("cp_async", "bfloat16", 64, 130, 77, True, "bhsd", False, (1, 2)),
    ("ws_no_overlap", "float16", 128, 65, 200, True, "bshd", False, (1, 2)),
    ("row_store", "bfloat16", 64, 50, 90, False, "bhsd", True, (1, 2)),
    ("persistent_sm3", "float16", 64, 200, 130, True, "bshd", False, (1, 2)),  # 4 work tiles on 3 blocks
    ("ws", "bfloat16", 256, 65, 100, False, "bhsd", False, (1, 2)),            # d = 256: not persistent
    ("persistent_sm1", "float16", 40, 1, 130, True, "bhsd", True, (1, 4)),     # decode, GQA-packed
]
FWD_GPU = ([(v,) + s for v in ("cp_async", "ws", "ws_no_overlap", "row_store", "non_persistent") for s in FWD_SHAPES]
           + [(v,) + s for v in ("persistent_sm1", "persistent_sm3") for s in FWD_SHAPES if s[1] <= 128 and s[1] % 8 == 0]
           + [("d256_not_persistent",) + s for s in FWD_SHAPES if s[1] == 256]
           + [("d256_causal_persistent",) + s for s in FWD_SHAPES if s[1] == 256 and s[4]]
           + [("narrow_keys",) + s for s in FWD_SHAPES if (not s[4] or s[1] == 256) and s[1] % 8 == 0])
FWD_SLOW = [(v, dt, D, Lq, Lk, causal, "bshd" if D == 128 else "bhsd", D == 64, (2, 4))
            for v in ("ws", "cp_async", "row_store", "ws_no_overlap") for dt in DTYPES for D in (64, 128, 256)
            for Lq, Lk in ((1000, 1500), (2048, 2048)) for causal in (False, True)]


@pytest.mark.parametrize("device,variant,dtype,D,Lq,Lk,causal,layout,gqa,batch",
                         on_devices(FWD_EMULATOR, FWD_GPU, FWD_SLOW, ids=_case_id))
def test_forward(flags, device, variant, dtype, D, Lq, Lk, causal, layout, gqa, batch):
    forward_case(device, variant, dtype, D, Lq, Lk, causal, layout, gqa, batch, flags)


@pytest.mark.parametrize("device,persistent", on_devices([(True,)], [(False,)], ids=_case_id))
def test_forward_out_not_tma_legal(flags, device, persistent):
    """Dv = 59: q, k, v TMA-legal (v a view with 128-byte rows) but out (118-byte rows) not: the ws kernel keeps
    its row stores (q's map in out's slot) with USE_TMA_STORE on."""
    flags(F, USE_TMA_STORE=True, PERSISTENT=persistent)
    q, k, _ = make_inputs(np.float16, 64, 70, 100, seed=4, batch=(2, 2))
    v = make_inputs(np.float16, 64, 70, 100, seed=5, batch=(2, 2))[2][..., :59]
    dev = to_device(device, q, k, v)
    plan = forward_plan(device, *dev, True)
    maps = [a for a in plan.launches[0].template if isinstance(a, launch.Map)]
    assert plan.tile.tma and F.ws_flags(plan.launches[0].name) == (False, persistent)
    assert [m.key for m in maps] == [0, 1, 2, 0]
    forward_body(device, q, k, v, True)


def _strided_qkv(Lq, Lk, D, seed):
    """q (2, 3, 4, Lq, D) a view of (2, Lq, 3, 4, D) (rows G·H·D apart, the batch dims' strides below the row
    stride); k, v (2, 3, 1, Lk, D) views of (2, Lk, 3, 1, 2D) cut to D columns (rows 6·D apart): GQA 4:1."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, Lq, 3, 4, D)).astype(np.float16).transpose(0, 2, 3, 1, 4)
    k, v = (rng.standard_normal((2, Lk, 3, 1, 2 * D)).astype(np.float16).transpose(0, 2, 3, 1, 4)[..., :D]
            for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("device,Lq", on_devices([(90,), (1,)], [], ids=_case_id))
def test_forward_tensor_maps(flags, device, Lq):
    """The rank-5 maps of strided views (BSHD rows, a sliced head dim, three batch dims) and of GQA-packed q
    (Lq = 1: the 4 query heads of a K/V head are the rows of one block, 2·D bytes apart) and of the output
    (TMA store) are built (on the GPU by the driver, per call) and launched."""
    flags(F)
    D = 64
    q, k, v = _strided_qkv(Lq, 150, D, seed=Lq)
    dev = to_device(device, q, k, v)
    plan = forward_plan(device, *dev, True)
    maps = [a for a in plan.launches[0].template if isinstance(a, launch.Map)]
    assert plan.tile.tma and [m.key for m in maps] == [0, 1, 2, 3]
    assert all(len(m.template.global_dim) == 5 and m.template.swizzle == 128 for m in maps)
    q_row = 2 * D if Lq == 1 else 2 * 3 * 4 * D
    assert plan.gqa_group == (4 if Lq == 1 else 1)
    assert [m.template.global_strides[0] for m in maps] == [q_row, 2 * 6 * D, 2 * 6 * D, 2 * D]  # out: contiguous rows
    forward_body(device, q, k, v, True)


# ---- backward -----------------------------------------------------------------------------------------------

#: cuda_backward_sm90 flags of each backward variant (the rest at their defaults: the ws kernel, dQ by the dQ
#: warp's bulk reduce-add where d, dv <= 128 (atomics in the head-dim split), dK / dV by TMA stores).
BWD_VARIANTS = {
    "ws": {},
    "ws_atomic_dq": dict(DQ_BULK=False),
    "ws_16_byte_store": dict(USE_TMA_STORE=False),
    "cp_async": dict(USE_TMA=False),
    "ws_kv_smem": dict(KV_REGS=False),   # d = dv = 64: K_j, V_j read from shared memory (SS), not registers
    "ws_dup_scores": dict(QUERY_SPLIT=False),   # head-dim split: S^T, dP^T in both warpgroups, not split by queries
    "ws_key_blocks_first": dict(ENTRIES_FIRST=False),   # ordered: the grid's key blocks first, not its entries
    "ws_dq_one_warpgroup": dict(DQ_SPLIT=False),   # d = 64: dQ^T by warpgroup 0 alone, not split by queries
    "ws_kt_smem": dict(KT_REGS=False),   # d = 64: the dQ wgmmas read K_j from shared memory (SS), not registers
    "ws_scores_ahead": dict(SCORES_AHEAD=True),   # d = 64: S^T issued behind the previous visit's dQ^T (off by default)
    "ws_dq_buffers": dict(DQ_BUFFERS=4),   # d = 64: four dQ buffers for the dQ warp (two by default)
    "ws_split_overlap": dict(SPLIT_OVERLAP=True),   # d 256: dP^T behind S^T, dQ^T before the dV/dK wait (off)
}


def problem(dtype, D, Dv, lengths, causal, bcast, layout):
    small = None if bcast != "none" else (1, 2)
    return Problem(DTYPES[dtype], D, *lengths, causal=causal, bcast=bcast, layout=layout, Dv=Dv, batch_q=small,
                   batch_k=small, seed=D + lengths[0])


def backward_plan(device, p, args, deterministic):
    return cb.plan(*args, causal=p.causal, scale=p.scale, batch_shape=p.batch_shape, device=device,
                   deterministic=deterministic, kernel="wgmma", arch="sm_90")


def expect_backward_kernel(plan, p, deterministic):
    """The plan's dK/dV launches are the instantiation the flags select (ws / cp.async, ordered or not, TMA
    stores, bulk dQ)."""
    D, Dv = p.q.shape[-1], p.v.shape[-1]
    ws = B.USE_TMA and D % 8 == 0 and Dv % 8 == 0  # 16-byte rows of q, dout, k, v
    assert plan.kernel == "wgmma" and plan.tma == ws and plan.dq_mode == ("ordered" if deterministic else "atomic")
    names = [r.name for r in plan.launches if r.name.startswith((B.KERNEL, B.WS_KERNEL))]
    assert names, [r.name for r in plan.launches]
    for name in names:
        # (the first eleven template arguments: kExt, kKVRegsOn, kQSplitOn, kEntriesFirstOn follow where named)
        flags = template_flags(", ".join(name.split(", ")[:11]) + (">" if name.count(", ") >= 11 else ""))
        if ws:
            assert name.startswith(B.WS_KERNEL) and flags[-3:] == [
                deterministic, B.USE_TMA_STORE and not plan.partial,
                B.dq_bulk(*B.pad_head_dims(D, Dv), -(-D // 16) * 16)], name
            assert B.ws_kv_regs(name) == (B.KV_REGS and B.kv_regs(D, Dv)), name
            assert B.ws_query_split(name) == (B.QUERY_SPLIT and B.is_split(D, Dv)), name
            assert B.ws_entries_first(name) == (B.ENTRIES_FIRST and deterministic), name
            assert B.ws_dq_split(name) == (B.DQ_SPLIT and B.dq_split(D, Dv)), name
            assert B.ws_kt_regs(name) == (B.KT_REGS and B.DQ_SPLIT and B.dq_split(D, Dv)), name
            assert B.ws_scores_ahead(name) == B.scores_ahead(D, Dv), name
            assert B.ws_split_overlap(name) == B.split_overlap(D, Dv), name
            pd, pdv = B.pad_head_dims(D, Dv)
            assert name.endswith(", 4>") == (B.dq_buffers(pd, pdv) == 4), name
        else:
            assert name.startswith(B.KERNEL) and flags[-1] == deterministic, name


def run_bwd(device, p, args, deterministic, **opts):
    res = cb.backward(*args, causal=p.causal, scale=p.scale, batch_shape=p.batch_shape, device=device,
                      deterministic=deterministic, kernel="wgmma", arch="sm_90", **opts)
    return tuple(host(x) for x in res[:3])


def backward_body(device, p, deterministic, vs_emulator=True):
    """Plan (the variant's kernel), run, the reference rule; against the emulator (GPU: tolerance; emulator
    device: a reversed schedule, bits where the order is fixed). Returns the gradients on the host."""
    args = to_device(device, *p.args("emulator"))
    expect_backward_kernel(backward_plan(device, p, args, deterministic), p, deterministic)
    grads = run_bwd(device, p, args, deterministic)
    check(p, grads)
    if vs_emulator:
        exact = device == "emulator"
        emu = run_bwd("emulator", p, p.args("emulator"), deterministic, **({"schedule": "reverse"} if exact else {}))
        assert_grads_match(grads, emu, p.dtype.name, (exact and deterministic, exact, exact))
    return grads


def backward_case(device, variant, dtype, D, Dv, lengths, causal, bcast, layout, deterministic, flags):
    flags(B, **BWD_VARIANTS[variant])
    p = problem(dtype, D, Dv, lengths, causal, bcast, layout)
    backward_body(device, p, deterministic, lengths[0] * lengths[1] <= EMULATOR_MAX_LQ_LK)


# (dtype, D, Dv, (Lq, Lk), causal, bcast, layout): tails, Lq > Lk causal, several key blocks per dQ element,
# D != Dv, head dims above 128 (the head-dim split: Bc = 64, atomics even with DQ_BULK), GQA / MQA (the group
# walked in the block), BSHD views, D = 59 (element-wise loads: every variant takes the cp.async kernel).
BWD_SHAPES = [
    ("float16", 64, 64, (65, 127), True, "none", "bhsd"),
    ("bfloat16", 128, 128, (130, 300), False, "none", "bshd"),
    ("float16", 40, 72, (70, 130), True, "gqa", "bshd"),
    ("bfloat16", 256, 256, (65, 127), True, "none", "bhsd"),
    ("float16", 200, 72, (130, 70), True, "gqa", "bshd"),
    ("bfloat16", 72, 256, (40, 150), False, "mqa", "bhsd"),
    ("float16", 59, 59, (64, 150), False, "none", "bhsd"),
]
BWD_EMULATOR = [  # (variant, *shape, deterministic)
    ("ws", "float16", 64, 64, (65, 127), True, "none", "bhsd", True),            # bulk dQ, ordered
    ("ws_atomic_dq", "bfloat16", 128, 128, (70, 300), False, "none", "bshd", True),
    ("ws_16_byte_store", "float16", 40, 72, (70, 130), True, "none", "bshd", False),
    ("cp_async", "bfloat16", 256, 256, (65, 127), True, "none", "bhsd", True),   # head-dim split
    ("ws", "float16", 200, 72, (130, 70), True, "none", "bshd", False),          # split: atomics, Lq > Lk
    ("ws_dup_scores", "bfloat16", 72, 256, (40, 150), False, "none", "bhsd", True),   # split, not by queries
    ("ws_scores_ahead", "float16", 64, 64, (200, 127), True, "none", "bhsd", True),   # d 64: S^T ahead, 4 visits
    ("ws_dq_buffers", "bfloat16", 40, 72, (330, 130), False, "gqa", "bshd", True),   # d 64: 4 dQ buffers reused
    ("ws_split_overlap", "bfloat16", 256, 256, (65, 127), True, "none", "bhsd", True),   # d 256: staged dQ
]
BWD_GPU = [(v,) + s + (det,) for v in BWD_VARIANTS for s in BWD_SHAPES for det in (True, False)
           if (s[1] % 8 == 0 or v in ("ws", "cp_async"))   # (D = 59 takes the cp.async kernel whatever the flags)
           and (v != "ws_dup_scores" or B.is_split(s[1], s[2])) and (v != "ws_key_blocks_first" or det)
           and (v not in ("ws_dq_one_warpgroup", "ws_scores_ahead", "ws_dq_buffers") or B.dq_split(s[1], s[2]))
           and (v != "ws_split_overlap" or B.pad_head_dims(s[1], s[2])[0] == 256)]
BWD_SLOW = [(v, dt, D, D, lengths, causal, "mqa" if D == 128 else "none", "bshd" if D == 64 else "bhsd", det)
            for v in ("ws", "cp_async") for dt in DTYPES for D in (64, 128, 256)
            for lengths in ((1000, 1500), (2048, 2048)) for causal in (False, True) for det in (True, False)]


@pytest.mark.parametrize("device,variant,dtype,D,Dv,lengths,causal,bcast,layout,deterministic",
                         on_devices(BWD_EMULATOR, BWD_GPU, BWD_SLOW, ids=_case_id))
def test_backward(flags, device, variant, dtype, D, Dv, lengths, causal, bcast, layout, deterministic):
    backward_case(device, variant, dtype, D, Dv, lengths, causal, bcast, layout, deterministic, flags)


ORDERED = [("ws", 64, (70, 300)), ("ws_atomic_dq", 128, (200, 600)), ("cp_async", 64, (70, 300)),
           ("ws", 256, (70, 300))]  # (variant, D, lengths): 3 to 10 key blocks add to every dQ element


@pytest.mark.parametrize("device,variant,D,lengths", on_devices([ORDERED[0]], ORDERED[1:], ids=_case_id))
def test_ordered_backward_bits_repeat(flags, device, variant, D, lengths):
    """The ordered (deterministic) dQ: three runs give the same bits for dq, dk, dv (emulator: under the forward,
    reverse and a random schedule)."""
    flags(B, **BWD_VARIANTS[variant])
    p = problem("float16", D, D, lengths, False, "none", "bhsd")
    args = to_device(device, *p.args("emulator"))
    schedules = ({"schedule": s, "seed": 3} for s in ("forward", "reverse", "random"))
    runs = [run_bwd(device, p, args, True, **(next(schedules) if device == "emulator" else {})) for _ in range(3)]
    check(p, runs[0])
    for got in runs[1:]:
        assert all(a.tobytes() == b.tobytes() for a, b in zip(runs[0], got))


@pytest.mark.parametrize("device,deterministic", on_devices([(False,)], [(True,)], ids=_case_id))
def test_backward_tensor_maps(flags, device, deterministic):
    """The ws kernel's six rank-5 maps over BSHD views with the GQA group walked in the block (q, dout: the
    group entry through tma_sel; k, v; dk, dv: the TMA stores) built (on the GPU by the driver) and launched."""
    flags(B)
    p = Problem(np.float16, 40, 70, 130, causal=False, bcast="gqa", layout="bshd", seed=1)
    args = to_device(device, *p.args("emulator"))
    plan = backward_plan(device, p, args, deterministic)
    (rec,) = [r for r in plan.launches if r.name.startswith(B.WS_KERNEL)]
    maps = [a for a in rec.template if isinstance(a, launch.Map)]
    assert [m.key for m in maps] == ["q", "dout", "k", "v", "dk", "dv"]
    assert all(len(m.template.global_dim) == 5 and m.template.swizzle == 128 for m in maps)
    # BSHD rows, H·D elements apart: q, dout 3 heads (the group), k, v 1
    assert [m.template.global_strides[0] for m in maps[:4]] == [2 * 3 * 40] * 2 + [2 * 40] * 2
    backward_body(device, p, deterministic)
