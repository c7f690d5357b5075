"""The extensions of docs/extensions.md in the CUDA backward kernels (flash_bwd.cu).

Every case runs the forward and the backward kernels on the CPU emulator through the public API
(``flash_attention_vjp(..., backend="emulator", <keywords>)``; marked ``gpu``, the same bodies on a
GPU through CuPy) and checks out, dq, dk, dv with the DESIGN.md rule against
``flasharray.reference.attention_backward`` given the same keywords (``testing.check_attention``:
with dropout the reference applies the same Philox mask).

Default run: every feature alone and in pairs on the tensor-core kernels (fp16 / bf16),
deterministic (ordered dQ with lengths / ALiBi / softcap / dropout, bitwise under permuted
schedules; the dQ kernel with a window or block mask) and atomic dQ, awkward sizes (Lq != Lk both ways, not multiples of the tiles), fully
masked rows and empty entries (seqlens 0), GQA broadcasting, one plan for many seeds / offsets /
arrays, block-mask tiles never loaded (emulator byte counters); the SIMT kernels (fp32 / fp64, bf16
on sm_75) with pairs of features. ``-m slow``: every pair of features x causal x mode.
"""
import itertools

import numpy as np
import pytest

import flasharray as fa
from flasharray import testing as fa_testing
from flasharray._private import cuda_backward, extensions
from flasharray._private.dtypes import bfloat16
from flasharray._private.extensions import Extensions

from conftest import gpu_available, thin

requires_gpu = pytest.mark.skipif(not gpu_available(), reason="no CUDA device visible to CuPy")
DTYPES = {"fp16": np.float16, "bf16": bfloat16, "fp32": np.float32, "fp64": np.float64}


def features(B, H, Lq, Lk, rng, block_size=(16, 32)):
    """One value of each extension keyword for a (B, H) batch (seqlens leave entries short,
    the block mask is random with one all-False query-tile row)."""
    bq, bk = block_size
    bm = rng.random((B, H, -(-Lq // bq), -(-Lk // bk))) < 0.6
    bm[0, 0, 0, :] = False  # rows of the first block see nothing
    return {
        "window": dict(window=(9, 4)),
        "alibi": dict(alibi_slopes=rng.uniform(0.1, 0.9, H).astype(np.float32)),
        "softcap": dict(softcap=2.5),
        "seqlens": dict(seqlens_q=np.array([Lq, max(Lq - 13, 1)][:B], np.int32),
                        seqlens_k=np.array([max(Lk - 20, 1), Lk][:B], np.int32)),
        "block_mask": dict(block_mask=bm, block_size=block_size),
        "dropout": dict(dropout_p=0.25, seed=1234567890123, offset=5),
    }


def run_case(xp, dtype, kw, *, causal=False, deterministic=True, B=2, H=2, Hk=2, Lq=37, Lk=53, D=16, seed=0):
    """Forward + backward through the public API on ``xp`` arrays; checked against the reference."""
    rng = np.random.default_rng(seed)
    backend = "emulator" if xp is np else "cuda"
    q = rng.standard_normal((B, H, Lq, D)).astype(dtype)
    k = rng.standard_normal((B, Hk, Lk, D)).astype(dtype)
    v = rng.standard_normal((B, Hk, Lk, D)).astype(dtype)
    dout = rng.standard_normal((B, H, Lq, D)).astype(dtype)
    dev = {n: (xp.asarray(a) if isinstance(a, np.ndarray) else a) for n, a in kw.items()}
    out, vjp = fa.flash_attention_vjp(*(xp.asarray(a) for a in (q, k, v)), causal=causal, backend=backend,
                                      deterministic=deterministic, **dev)
    grads = vjp(xp.asarray(dout))
    report = fa_testing.check_attention(out, q, k, v, causal=causal, dout=dout, grads=grads, **kw)
    assert report.passed, str(report)
    return grads


def kw_of(names, B=2, H=2, Lq=37, Lk=53, seed=1):
    all_kw = features(B, H, Lq, Lk, np.random.default_rng(seed))
    out = {}
    for n in names:
        out.update(all_kw[n])
    return out


SINGLE = [(f, "fp16", False, True) for f in ("window", "alibi", "softcap", "seqlens", "block_mask", "dropout")]
PAIRS = [
    (("dropout",), "fp16", True, False),                 # dropout + causal, atomic
    (("window", "alibi"), "bf16", False, True),
    (("softcap", "seqlens"), "fp16", False, False),
    (("block_mask",), "bf16", True, False),               # block mask + causal, atomic
    (("dropout", "block_mask"), "fp16", False, True),
    (("window", "seqlens"), "bf16", True, True),
    (("alibi", "softcap", "dropout"), "fp16", True, True),
]


def _id(case):
    names, dt, causal, det = case
    names = (names,) if isinstance(names, str) else names
    return "%s-%s%s-%s" % ("+".join(names), dt, "-causal" if causal else "", "det" if det else "atomic")


@pytest.mark.parametrize("case", thin(SINGLE + PAIRS), ids=_id)
def test_backward_extension(case):
    names, dt, causal, det = case
    names = (names,) if isinstance(names, str) else names
    run_case(np, DTYPES[dt], kw_of(names), causal=causal, deterministic=det)


@pytest.mark.parametrize("D, causal, det", thin([(128, False, True), (128, True, False), (96, True, True),
                                                 (256, False, True)], unpack=True))
def test_seqlens_on_the_wide_key_tiles(D, causal, det):
    """Per-entry lengths alone keep the dK/dV kernel's wide-key tile (tiles_bwd.WIDE_KEYS_EXT: 128 keys x 32
    queries at d 96, sm_80) and at d 128 / 256 the grid layout (tiles_bwd.GRID_EXT: 128 x 64 / 64 x 64, 16-byte
    row copies; element-wise ones keep the wide-key tile, 64 x 32 at d 256): the plan takes it, and out / dq / dk /
    dv meet the rule with entries shorter than the tiles and Lq != Lk; other bits keep the candidates' tiles
    (dropout: 64 keys)."""
    from flasharray._private import tiles_bwd
    bits = cuda_backward._fwd().EXT_BITS
    plan = cuda_backward.kernel_plan(np.float16, D, D, causal=causal, deterministic=False, arch=80,
                                     ext=bits["seqlens"], ordered=det)
    t = plan["dkv"][2]
    assert (t.block_n, t.block_m) == {256: (64, 64), 128: (128, 64)}.get(D, (128, 32))
    assert (t.layout == "grid") == (D in (128, 256)) and ", %d" % bits["seqlens"] in plan["dkv"][1]
    if D in (128, 256):
        t = cuda_backward.kernel_plan(np.float16, D, D, causal=causal, deterministic=False, arch=80,
                                      ext=bits["seqlens"], ordered=det, vec=False)["dkv"][2]
        assert (t.layout, t.block_n, t.block_m) == ("rows", 128 if D == 128 else 64, 32)
    t = cuda_backward.kernel_plan(np.float16, D, D, causal=causal, deterministic=False, arch=80,
                                  ext=bits["dropout"] | bits["seqlens"])
    assert t["dkv"][2].block_n <= 64 and tiles_bwd.WIDE_KEYS_EXT == (0, bits["seqlens"])
    Lq, Lk = 150, 290
    run_case(np, np.float16, kw_of(("seqlens",), Lq=Lq, Lk=Lk), causal=causal, deterministic=det, Lq=Lq, Lk=Lk,
             D=D, H=1, Hk=1)


def test_wide_key_dropout_refused_where_it_spills():
    """tiles_bwd.WIDE_KEYS_EXT_SPILLED: dropout in the ordered mode at d 80 keeps the candidates' tiles on sm_86 /
    sm_89 (the wide-key instantiation spilled there, causal), the wide-key tile on sm_80 / sm_90 and in the atomic
    mode everywhere; the arch is read as a number or a name."""
    from flasharray._private import tiles_bwd
    drop = cuda_backward._fwd().EXT_BITS["dropout"]
    for arch, mode, wide in ((86, "ordered", False), ("sm_89", "ordered", False), (80, "ordered", True),
                             ("sm_90", "ordered", True), (86, "atomic", True), (89, "atomic", True)):
        t = tiles_bwd.tc_tiles("dkv", 80, 80, arch, ext=drop, mode=mode)
        assert (t.block_n == 128) == wide and tiles_bwd.wide_keys_take(drop, 80, 80, mode, arch) == wide, (arch, mode)
    assert tiles_bwd.wide_keys_take(drop, 128, 128, "ordered", 86)


@pytest.mark.parametrize("names, D, causal, mode", thin([
    (("softcap",), 128, True, "recompute"), (("softcap",), 96, False, "ordered"), (("softcap",), 256, True, "recompute"),
    (("dropout",), 128, False, "ordered"), (("dropout",), 128, True, "atomic"), (("dropout",), 256, False, "ordered"),
    (("dropout",), 80, True, "atomic")], unpack=True))
def test_softcap_and_dropout_on_the_wide_key_tiles(names, D, causal, mode):
    """Softcap alone (every dQ mode) and dropout alone (the atomic modes, not d 96) keep the wide-key dK/dV tile
    (tiles_bwd.WIDE_KEYS_EXT_BY_MODE; sm_80: 128 keys x 32 queries at d 80-128, 64 x 32 at d 256) where the grid
    layout does not take them (softcap at d 128 / 256 in the atomic modes: test_extensions_on_the_grid_layout): the
    plan takes it, and the gradients meet the rule (dropout: the forward's Philox mask) with Lq != Lk off the tiles;
    dropout in the recomputing mode, at d 96, or with lengths keeps the candidates' tiles."""
    from flasharray._private import tiles_bwd
    bits = sum(cuda_backward._fwd().EXT_BITS[n] for n in names)
    det = mode != "atomic"
    wide = (64, 32) if D == 256 else (128, 32)
    t = cuda_backward.kernel_plan(np.float16, D, D, causal=causal, deterministic=det, arch=80, ext=bits,
                                  ordered=mode == "ordered")["dkv"][2]
    assert (t.block_n, t.block_m) == wide
    if "dropout" in names:
        assert tiles_bwd.tc_tiles("dkv", D, D, "sm_80", ext=bits, mode="recompute").block_n < wide[0]
        assert tiles_bwd.tc_tiles("dkv", 96, 96, "sm_80", ext=bits, mode=mode).block_n < 128
    Lq, Lk = 150, 290
    rng = np.random.default_rng(D)
    q, dout = (rng.standard_normal((1, 1, Lq, D)).astype(np.float16) for _ in range(2))
    k, v = (rng.standard_normal((1, 1, Lk, D)).astype(np.float16) for _ in range(2))
    kw = kw_of(names, B=1, H=1, Lq=Lq, Lk=Lk)
    out, lse = fa.flash_attention_forward(q, k, v, causal=causal, backend="emulator", **kw)
    common = dict(causal=causal, scale=D ** -0.5, batch_shape=(1, 1), device="emulator", deterministic=det,
                  ext=ext_of(kw, Lq=Lq, Lk=Lk), dq="recompute" if mode == "recompute" else None)
    plan = cuda_backward.plan(dout, q, k, v, out, lse, **common)
    assert plan.dq_mode == mode
    assert any(r.name.startswith("flash_bwd_dkv_kernel<fa_half, fa_half, %d, %d, %d, %d," % (D, D, *wide[::-1]))
               for r in plan.launches), [r.name for r in plan.launches]
    grads = cuda_backward.backward(dout, q, k, v, out, lse, **common)
    report = fa_testing.check_attention(out, q, k, v, causal=causal, dout=dout, grads=grads, **kw)
    assert report.passed, str(report)


def ext_of(kw, B=1, H=1, Lq=40, Lk=40):
    from flasharray._private import extensions
    return extensions.from_options(kw, kind="numpy", batch_shape=(B, H), Lq=Lq, Lk=Lk, acc=np.dtype(np.float32))


@pytest.mark.parametrize("det", [True, False], ids=["det", "atomic"])
def test_gqa_and_lq_above_lk(det):
    """K/V broadcast over the query heads (partial sums reduced), Lq > Lk, window + ALiBi + dropout."""
    kw = kw_of(("window", "alibi", "dropout"), H=4, Lq=70, Lk=29)
    run_case(np, np.float16, kw, causal=True, deterministic=det, H=4, Hk=1, Lq=70, Lk=29)


def test_fully_masked_rows_and_empty_entries():
    """seqlens 0 for one entry's queries and another's keys; a window that leaves rows with no key:
    their gradients are exactly zero."""
    kw = dict(seqlens_q=np.array([0, 21], np.int32), seqlens_k=np.array([40, 0], np.int32), window=(0, 0))
    dq, dk, dv = run_case(np, np.float16, kw, causal=True, Lq=37, Lk=53)
    assert not dq[0].any() and not dk[0, :, 40:].any() and not dv[0, :, 40:].any()
    assert not dq[1].any() and not dk[1].any() and not dv[1].any()


def test_one_plan_many_calls():
    """One plan (keyed on the static part) serves new seeds, offsets and array contents."""
    rng = np.random.default_rng(3)
    B, H, Lq, Lk, D = 1, 2, 24, 40, 16
    q, k, v, dout = (rng.standard_normal(s).astype(np.float16) for s in
                     [(B, H, Lq, D), (B, H, Lk, D), (B, H, Lk, D), (B, H, Lq, D)])
    for seed, offset, slopes in ((1, 0, [0.2, 0.5]), (2**40 + 5, 9, [0.7, 0.1])):
        kw = dict(dropout_p=0.5, seed=seed, offset=offset, alibi_slopes=np.array(slopes, np.float32))
        out, lse = fa.flash_attention_forward(q, k, v, backend="emulator", **kw)
        n = len(cuda_backward._PLANS)
        grads = fa.flash_attention_backward(dout, q, k, v, out, lse, backend="emulator", **kw)
        report = fa_testing.check_attention(out, q, k, v, dout=dout, grads=grads, **kw)
        assert report.passed, str(report)
    assert len(cuda_backward._PLANS) == n  # the second call planned nothing new


def test_block_mask_tiles_never_loaded():
    """The dK/dV kernel reads Q_i, dO_i only for the query tiles whose blocks are not all False, and
    the dQ kernel (dq="recompute") K_j, V_j only for such key tiles (emulator byte counters)."""
    rng = np.random.default_rng(4)
    B, H, L, D = 1, 1, 256, 64
    q, k, v, dout = (rng.standard_normal((B, H, L, D)).astype(np.float16) for _ in range(4))
    out, lse = fa.flash_attention_forward(q, k, v, backend="emulator")
    tiles = {n: t for n, (_, _, t) in cuda_backward.kernel_plan(np.float16, D, D, causal=False, deterministic=True,
                                                                 arch=80, ext=8).items() if t is not None}
    reads = {}
    for name, mask in (("full", np.ones((1, 1, 2, 2), bool)), ("diag", np.eye(2, dtype=bool)[None, None])):
        ext = Extensions(block_mask=mask, block_size=(128, 128))
        *_, counters = cuda_backward.backward(dout, q, k, v, out, lse, causal=False, scale=D ** -0.5,
                                              batch_shape=(B, H), device="emulator", ext=ext, dq="recompute",
                                              return_counters=True)
        c = {n.split("<")[0]: c for n, c in counters}
        # Q (argument 0) in the dK/dV kernel, K (argument 5) in the dQ kernel: the streamed tiles
        reads[name] = (c["flash_bwd_dkv_kernel"].buffers[0].read_bytes, c["flash_bwd_dq_kernel"].buffers[5].read_bytes)
    full_q = (L // tiles["dkv"].block_n) * L * D * 2  # every key tile reads all of Q
    full_k = (L // tiles["dq"].block_m) * L * D * 2   # every query tile reads all of K
    assert reads["full"] == (full_q, full_k)
    assert reads["diag"] == (full_q // 2, full_k // 2)  # half of the tile pairs: never loaded


def _ext_backward(kw, *, H=2, Hk=2, Lq=150, Lk=170, D=32, data_seed=5, dtype=np.float16, causal=True, **opts):
    """The CUDA backward (fp16: tensor cores; fp32: SIMT) on the emulator with extension keywords kw
    (checked against the reference); ``opts``: cuda_backward.backward's (schedule, seed, dq). (grads, plan)."""
    rng = np.random.default_rng(data_seed)
    q, dout = (rng.standard_normal((2, H, Lq, D)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((2, Hk, Lk, D)).astype(dtype) for _ in range(2))
    args = dict(causal=causal, scale=D ** -0.5)
    out, lse = fa.flash_attention_forward(q, k, v, backend="emulator", **args, **kw)
    ext = extensions.from_options(kw, kind="numpy", batch_shape=(2, H), Lq=Lq, Lk=Lk, acc=np.dtype(np.float32))
    call = dict(batch_shape=(2, H), device="emulator", ext=ext, **args)
    result = cuda_backward.backward(dout, q, k, v, out, lse, **call, **opts)
    plan = cuda_backward.plan(dout, q, k, v, out, lse, **call,
                              **{n: o for n, o in opts.items() if n in ("dq", "deterministic")})
    grads = result[:3] if opts.get("return_counters") else result
    report = fa_testing.check_attention(out, q, k, v, dout=dout, grads=grads, **args, **kw)
    assert report.passed, str(report)
    return result, plan


@pytest.mark.parametrize("deterministic", [True, False])
def test_cupy_launch_path_with_fake_cupy(monkeypatch, deterministic):
    """The CUDA backward with dropout (per-call seed and offset in every launch's kernel-parameter
    block, kernel.Replay) against the CuPy stand-in of tests/test_cuda_forward.py: two calls of
    one plan, each bitwise the emulator path's (argument tuples)."""
    import sys
    from flasharray._private import launch
    from test_cuda_forward import _fake_cupy
    log, arrays = [], []
    cupy = _fake_cupy(log, arrays)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(launch.CupyLauncher, "_modules", {})
    monkeypatch.setattr(launch, "_launchers", {})
    rng = np.random.default_rng(3)
    q, k, v, dout = (rng.standard_normal((2, 2, 40, 32)).astype(np.float16) for _ in range(4))
    for seed, offset in ((1, 0), (9, 5)):
        kw = {"dropout_p": 0.2, "seed": seed, "offset": offset}
        out, lse = fa.flash_attention_forward(q, k, v, backend="emulator", causal=True, **kw)
        arrays += [dout, q, k, v, out, lse]
        ext = extensions.from_options(kw, kind="numpy", batch_shape=(2, 2), Lq=40, Lk=40, acc=np.dtype(np.float32))
        call = dict(causal=True, scale=32 ** -0.5, batch_shape=(2, 2), ext=ext, deterministic=deterministic)
        got = cuda_backward.backward(dout, q, k, v, out, lse, device="cuda", **call)
        ref = cuda_backward.backward(dout, q, k, v, out, lse, device="emulator", **call)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(got, ref))
    assert log and cupy.driver_launches == [name for name, _, _ in log]


@pytest.mark.parametrize("names, D, mode", thin([
    (("alibi", "softcap", "dropout", "seqlens"), 32, "ordered"), (("softcap", "dropout", "seqlens"), 256, "ordered"),
    (("alibi",), 256, "recompute"), (("window",), 32, "ordered"), (("block_mask", "dropout"), 32, "ordered")],
    unpack=True),
    ids=["ordered-exts", "ordered-d256", "alibi-d256", "window", "block_mask"])
def test_deterministic_ext_dq_mode(names, D, mode):
    """deterministic=True with extensions on the fp16 tensor cores: the ordered dQ mode (the atomic
    mode's 5 products, adding in key-block order) with every extension — lengths, ALiBi, softcap, dropout,
    a window (its first visitor of each query block known to the kernel), a block mask (its holes take no
    turn: dq_turn) — but ALiBi above head dim 128 (those instantiations spill): the recomputing dQ kernel.
    Checked against the reference."""
    kw = kw_of(names, Lq=40, Lk=60)
    _, plan = _ext_backward(kw, Lq=40, Lk=60, D=D)
    assert plan.dq_mode == mode
    if mode == "recompute":
        with pytest.raises(ValueError, match="dq='ordered' takes no ALiBi above head dim 128 "
                                             ".*this call: kernel 'tc', head dim %d, extensions %s"
                                             % (D, ", ".join(names))):
            _ext_backward(kw, Lq=40, Lk=60, D=D, dq="ordered")


def _dkv_counters(grads_and_counters):
    *grads, counters = grads_and_counters
    (c,) = [c for name, c in counters
            if name.startswith(("flash_bwd_dkv_kernel", "flash_bwd_dkv_grid_kernel", "flash_bwd_dkv_simt_kernel", "flash_bwd_dkv_tf32"))]
    return grads, c


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["fp16", "fp32-simt"])
@pytest.mark.parametrize("H, Hk", [(2, 2), (4, 1)], ids=["mha", "mqa"])
def test_ordered_dq_with_extensions_bitwise_under_schedules(monkeypatch, H, Hk, dtype):
    """The ordered dQ mode (tensor cores; fp32: the SIMT kernel) with lengths, ALiBi and dropout (causal,
    7 key blocks, short entries, and K/V broadcast over the query heads): the reference's rule; one
    worker in block order never blocks in fa::sem_wait (each block waits only for smaller indices), in
    reverse order waits block, and dq, dk, dv are the same bits under reverse and random schedules."""
    kw = kw_of(("alibi", "dropout", "seqlens"), H=H, Lq=100, Lk=420)
    shape = dict(H=H, Hk=Hk, Lq=100, Lk=420, return_counters=True, dtype=dtype)
    monkeypatch.setenv("FLASHARRAY_EMULATOR_THREADS", "1")
    (base, c), plan = (lambda r: (_dkv_counters(r[0]), r[1]))(_ext_backward(kw, **shape))
    assert plan.dq_mode == "ordered" and any(n.startswith("flash_bwd_dkv_") and ", true>" in n
                                             for n in plan.replay.names)
    assert c.sem_waits > 0 and c.sem_blocked == 0
    _same_bits_under_schedules(monkeypatch, kw, shape, base,
                               (("1", "reverse", 0), ("2", "reverse", 0), ("2", "random", 3), ("2", "random", 11)))


def _same_bits_under_schedules(monkeypatch, kw, shape, base, runs):
    """dq, dk, dv of _ext_backward(kw, **shape) under each (workers, schedule, seed) of ``runs``: the bits of
    ``base``; a reversed schedule has blocks that wait."""
    for workers, schedule, seed in runs:
        monkeypatch.setenv("FLASHARRAY_EMULATOR_THREADS", workers)
        got, c = _dkv_counters(_ext_backward(kw, schedule=schedule, seed=seed, **shape)[0])
        if schedule == "reverse":
            assert c.sem_blocked > 0
        for a, b in zip(base, got):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("causal", [True, False])
def test_ordered_dq_with_lengths_on_the_grid_layout(monkeypatch, causal):
    """Per-entry lengths alone at d 128 run the grid-layout dK/dV kernel (tiles_bwd.GRID_EXT) in the ordered mode:
    the rule with entries shorter than the tiles (key blocks past an entry's keys write zeros), waits only on
    earlier blocks, and the same bits under reverse and random schedules."""
    kw = kw_of(("seqlens",), H=2, Lq=150, Lk=330)
    shape = dict(H=2, Hk=2, Lq=150, Lk=330, D=128, causal=causal, return_counters=True)
    monkeypatch.setenv("FLASHARRAY_EMULATOR_THREADS", "1")
    (base, c), plan = (lambda r: (_dkv_counters(r[0]), r[1]))(_ext_backward(kw, **shape))
    assert plan.dq_mode == "ordered"
    assert any(n.startswith("flash_bwd_dkv_grid_kernel") and n.endswith(", true, 32, true>")  # ordered, kExt, kSwizzle
               for n in plan.replay.names)
    assert c.sem_waits > 0 and c.sem_blocked == 0
    for workers, schedule, seed in (("2", "reverse", 0), ("2", "random", 5)):
        monkeypatch.setenv("FLASHARRAY_EMULATOR_THREADS", workers)
        got, c = _dkv_counters(_ext_backward(kw, schedule=schedule, seed=seed, **shape)[0])
        for a, b in zip(base, got):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("names, D, causal, det", thin([
    (("softcap",), 128, True, True), (("alibi", "window"), 256, False, False), (("window", "seqlens"), 64, True, True),
    (("softcap", "alibi", "seqlens"), 64, False, False), (("window",), 64, True, False), (("softcap",), 256, True, True)],
    unpack=True))
def test_extensions_on_the_grid_layout(monkeypatch, names, D, causal, det):
    """Window, ALiBi, softcap and lengths (tiles_bwd.GRID_EXT; not the d 128 / 256 sets that spilled) run the grid-layout
    dK/dV kernel: the rule in both dQ modes; without softcap dK, dV are bitwise the row-tile kernel's (the same P
    and dS = P o (dP - D_i)); with softcap dS = f o (dP - D_i), f = P o (1 - tanh^2) (float association only);
    the ordered mode gives the same bits under a reversed schedule."""
    from conftest import flag_set
    from flasharray._private import tiles_bwd
    kw = kw_of(names, H=2, Lq=150, Lk=330)
    shape = dict(H=2, Hk=2, Lq=150, Lk=330, D=D, causal=causal, return_counters=True, deterministic=det)
    (grid, c), plan = (lambda r: (_dkv_counters(r[0]), r[1]))(_ext_backward(kw, **shape))
    assert any(n.startswith("flash_bwd_dkv_grid_kernel") for n in plan.replay.names), plan.replay.names
    with flag_set(tiles_bwd, "GRID_LAYOUT", False):
        (rows, c), plan = (lambda r: (_dkv_counters(r[0]), r[1]))(_ext_backward(kw, **shape))
    assert not any(n.startswith("flash_bwd_dkv_grid_kernel") for n in plan.replay.names)
    if "softcap" not in names:
        np.testing.assert_array_equal(grid[1], rows[1])
        np.testing.assert_array_equal(grid[2], rows[2])
    if det:
        monkeypatch.setenv("FLASHARRAY_EMULATOR_THREADS", "2")
        got, c = _dkv_counters(_ext_backward(kw, schedule="reverse", **shape)[0])
        for a, b in zip(grid, got):
            np.testing.assert_array_equal(a, b)


def holed_block_mask(B, H, Lq, Lk, block_size=(32, 64), seed=4):
    """block_mask keywords whose holes are whole visit tiles of every kernel (tiles of 16-128 queries x 64 or 128
    keys): a random mask of density 1/2 on (32, 64) blocks, and in entry (1, 1) keys 128..255 all False (a key block
    that visits nothing: it never posts), in entry (0, 1) queries 64..127 (a query block some key blocks skip)."""
    bm = np.random.default_rng(seed).random((B, H, -(-Lq // block_size[0]), -(-Lk // block_size[1]))) < 0.5
    bm[1, 1, :, 128 // block_size[1]:256 // block_size[1]] = False
    bm[0, 1, 64 // block_size[0]:128 // block_size[0], :] = False
    return dict(block_mask=bm, block_size=block_size)


BLOCK_MASKS = [  # (other features, causal, D, dtype[, precision]): the ordered dQ mode with a block mask
    ((), False, 64, np.float16),                           # tensor cores, ascending
    ((), True, 64, np.float16),                            # causal: descending ranks
    (("window", "seqlens", "alibi"), True, 96, np.float16),  # lengths: ascending under causal; the window's run
    ((), True, 64, np.float32),                            # the SIMT kernel (float32 ieee)
    (("dropout", "seqlens"), False, 40, np.float64),       # SIMT fp64
    (("window",), True, 32, np.float32, "3xtf32"),         # the TF32 tensor cores
]


@pytest.mark.parametrize("case", thin(BLOCK_MASKS), ids=lambda c: "-".join(
    ["block_mask", *c[0], "causal" if c[1] else "full", "d%d" % c[2], np.dtype(c[3]).name, *c[4:]]))
def test_ordered_dq_with_a_block_mask(monkeypatch, case):
    """A block mask in the deterministic default: the ordered dQ mode (5 products; it ran the recomputing dQ kernel's
    7 before the forty-third session), key block n waiting at query block i for its previous visitor past the
    mask's holes (dq_turn's ranks; a key block whose tiles are all holes never posts): the reference's rule, no
    block waiting when the blocks run in order, and the same bits under reverse and random schedules on one and
    two workers (a wrong turn deadlocks, which the emulator reports)."""
    others, causal, D, dtype = case[:4]
    H, Lq, Lk = 2, 150, 330
    kw = kw_of(others, H=H, Lq=Lq, Lk=Lk) if others else {}
    kw.update(holed_block_mask(2, H, Lq, Lk))
    shape = dict(H=H, Hk=2, Lq=Lq, Lk=Lk, D=D, causal=causal, dtype=dtype, return_counters=True,
                 **({"precision": case[4]} if len(case) > 4 else {}))
    monkeypatch.setenv("FLASHARRAY_EMULATOR_THREADS", "1")
    result, plan = _ext_backward(kw, **shape)
    base, c = _dkv_counters(result)
    (name,) = [n for n, _ in result[3] if n.startswith("flash_bwd_dkv_")]
    assert ("tf32" in name) == (len(case) > 4), name
    assert c.sem_waits > 0 and c.sem_blocked == 0  # (waits: the ordered mode)
    _same_bits_under_schedules(monkeypatch, kw, shape, base, (("1", "reverse", 0), ("2", "random", 3), ("2", "random", 11)))


def _grid_against_rows(monkeypatch, kw, shape, det, bitwise):
    """The backward with ``kw`` on the grid-layout dK/dV kernel (the rule: _ext_backward) in the dQ mode ``det``
    says; ordered: no block in fa::sem_wait with one worker, the same bits under a reverse schedule (one worker:
    with two, whether a block finds its turn not yet come depends on the threads' timing, and a narrow window leaves
    few shared query tiles — d 128's window case blocked 0-2 times in 11 waits) and a random one (two workers);
    ``bitwise``: dK, dV equal to the row-tile kernel's (tiles_bwd.GRID_LAYOUT off)."""
    from conftest import flag_set
    from flasharray._private import tiles_bwd
    monkeypatch.setenv("FLASHARRAY_EMULATOR_THREADS", "1")
    (grid, c), plan = (lambda r: (_dkv_counters(r[0]), r[1]))(_ext_backward(kw, **shape))
    assert any(n.startswith("flash_bwd_dkv_grid_kernel") for n in plan.replay.names), plan.replay.names
    assert plan.dq_mode == ("ordered" if det else "atomic")
    if det:
        assert c.sem_waits > 0 and c.sem_blocked == 0
        _same_bits_under_schedules(monkeypatch, kw, shape, grid, (("1", "reverse", 0), ("2", "random", 3)))
    if bitwise:
        monkeypatch.setenv("FLASHARRAY_EMULATOR_THREADS", "1")
        with flag_set(tiles_bwd, "GRID_LAYOUT", False):
            (rows, _), plan = (lambda r: (_dkv_counters(r[0]), r[1]))(_ext_backward(kw, **shape))
        assert not any(n.startswith("flash_bwd_dkv_grid_kernel") for n in plan.replay.names)
        np.testing.assert_array_equal(grid[1], rows[1])
        np.testing.assert_array_equal(grid[2], rows[2])


GRID_BLOCK_MASKS = [  # (other features, D, causal, deterministic, block size): a block mask on the grid layout
    (("window",), 64, True, True, (32, 64)),            # causal: descending ranks past the holes
    (("softcap", "window"), 256, False, True, (16, 32)),  # n8 tiles of 16-query blocks; softcap's P and f selected
    (("softcap", "seqlens"), 256, True, False, (32, 64)),  # atomic, short entries (lengths alone spilled at d 256)
    (("alibi",), 64, False, True, (48, 16)),            # ascending; 16-key blocks, 48-query ones across n8 tiles
    (("window", "alibi", "softcap"), 128, True, True, (32, 64)),  # d 128: the per-m-tile pass (forty-sixth session)
    (("softcap", "dropout"), 128, False, False, (16, 32)),  # ... with dropout's keep bits beside the lookups
    (("seqlens",), 128, True, True, (32, 64)),          # lengths (tiles_bwd._GRID_LET_BACK, fiftieth session)
    (("window",), 256, True, True, (16, 32)),           # d 256 with a window (_GRID_LET_BACK)
]


@pytest.mark.parametrize("names, D, causal, det, block", thin(GRID_BLOCK_MASKS, unpack=True))
def test_block_mask_on_the_grid_layout(monkeypatch, names, D, causal, det, block):
    """A block mask (tiles_bwd.GRID_EXT; at d 64 and 256 most sets, at d 128 the ten that compiled clean in the
    per-m-tile pass — not the block mask alone, which keeps the row-tile kernel) runs the grid-layout dK/dV kernel:
    query tiles whose blocks are all False skipped (QueryTileWalk), the mask looked up once per n8 tile
    (grid_scores): the rule in both dQ modes; without softcap dK, dV bitwise the row-tile kernel's; the ordered mode
    (dq_turn's ranks past the holes) the same bits under reverse and random schedules."""
    bits = cuda_backward._fwd().EXT_BITS
    t = cuda_backward.kernel_plan(np.float16, 128, 128, causal=causal, deterministic=det, arch=80,
                                  ext=bits["block_mask"], ordered=det)["dkv"][2]
    assert t.layout == "rows"  # d 128, the block mask alone: tiles_bwd.GRID_EXT_SPILLED
    with_sc = bits["block_mask"] | bits["alibi"] | bits["softcap"]
    t = cuda_backward.kernel_plan(np.float16, 128, 128, causal=causal, deterministic=det, arch=80,
                                  ext=with_sc, ordered=det)["dkv"][2]
    assert t.layout == "grid"  # ... with ALiBi + softcap: the per-m-tile pass
    t = cuda_backward.kernel_plan(np.float16, 128, 128, causal=causal, deterministic=det, arch=80, acc_dkv=True,
                                  ext=with_sc, ordered=det)["dkv"][2]
    assert t.layout == "rows"  # ... but not in float output (K/V broadcast): tiles_bwd.GRID_EXT_SPILLED_PARTIAL
    H, Lq, Lk = 2, 150, 330
    kw = kw_of(names, H=H, Lq=Lq, Lk=Lk) if names else {}
    kw.update(holed_block_mask(2, H, Lq, Lk, block_size=block))
    shape = dict(H=H, Hk=2, Lq=Lq, Lk=Lk, D=D, causal=causal, return_counters=True, deterministic=det)
    _grid_against_rows(monkeypatch, kw, shape, det, bitwise="softcap" not in names)


GRID_DROPOUT = [  # (other features, D, causal, deterministic): dropout on the grid layout (tiles_bwd.GRID_EXT)
    ((), 256, True, True),                          # dropout alone (at d 64 / 128 it spilled: the row-tile kernel)
    (("softcap",), 128, False, False),              # atomic (at d 128 only the sets with softcap compiled clean)
    (("block_mask", "softcap", "alibi"), 256, True, False),  # the tiles a block mask skips
    (("softcap", "seqlens"), 128, False, True),     # softcap's f with Z's sign; short entries
    (("window", "softcap"), 256, True, False),
    (("block_mask",), 128, False, True),            # d 128 dropout + block mask (tiles_bwd._GRID_LET_BACK)
    (("softcap", "seqlens"), 64, True, True),       # d 64 (_GRID_LET_BACK): 13 of the 32 sets with dropout
]


@pytest.mark.parametrize("names, D, causal, det", thin(GRID_DROPOUT, unpack=True))
def test_dropout_on_the_grid_layout(monkeypatch, names, D, causal, det):
    """Dropout (tiles_bwd.GRID_EXT, less GRID_EXT_SPILLED: at d 64 13 of the 32 sets, fiftieth session) runs the
    grid-layout dK/dV kernel with the row-tile kernel's keep bits (dropout_bits_t per 16-key m tile; P o Z to P^T_s,
    Z back from the sign of the kept factor in the dS pass): the rule in both dQ modes; without softcap dK, dV bitwise the row-tile kernel's; the
    ordered mode the same bits under reverse and random schedules."""
    bits = cuda_backward._fwd().EXT_BITS
    # dropout alone: spilled at d 64 / 128, and at d 256 in the float-output (K/V broadcast) instantiations
    for d, acc, layout in ((64, False, "rows"), (128, False, "rows"), (256, False, "grid"), (256, True, "rows")):
        t = cuda_backward.kernel_plan(np.float16, d, d, causal=True, deterministic=True, arch=80, acc_dkv=acc,
                                      ext=bits["dropout"], ordered=True)["dkv"][2]
        assert t.layout == layout, (d, acc)
    # d 64 softcap + dropout + lengths: the grid (_GRID_LET_BACK) but in float output (GRID_EXT_SPILLED_PARTIAL)
    for acc, layout in ((False, "grid"), (True, "rows")):
        t = cuda_backward.kernel_plan(np.float16, 64, 64, causal=True, deterministic=True, arch=90, acc_dkv=acc,
                                      ext=bits["dropout"] | bits["softcap"] | bits["seqlens"], ordered=True)["dkv"][2]
        assert t.layout == layout, acc
    H, Lq, Lk = 2, 150, 330
    kw = kw_of(("dropout",) + names, H=H, Lq=Lq, Lk=Lk)
    if "block_mask" in names:
        kw.update(holed_block_mask(2, H, Lq, Lk))
    shape = dict(H=H, Hk=2, Lq=Lq, Lk=Lk, D=D, causal=causal, return_counters=True, deterministic=det)
    _grid_against_rows(monkeypatch, kw, shape, det, bitwise="softcap" not in names)


WINDOWS = [  # (keywords, causal, H, Hk, Lq, Lk, D): the ordered dQ mode's window cases
    (dict(window=(20, 5)), False, 2, 2, 150, 290, 64),          # ascending, first visitor > 0, both edges
    (dict(window=(70, 0)), True, 2, 2, 290, 290, 64),           # causal: descending, unchanged turns
    (dict(window=(3, 0)), True, 4, 1, 200, 330, 32),            # tiny band, MQA partial sums, Lq < Lk
    (dict(window=(40, 40), alibi=True, dropout=True), False, 2, 2, 150, 77, 128),  # Lq > Lk, rows past keys
    (dict(window=(100, -1), seqlens=True), True, 2, 2, 150, 290, 64),  # lengths: ascending under causal
    (dict(window=(-1, 30), softcap=True), False, 2, 2, 130, 200, 256),  # right edge only; d 256 (wide set)
    (dict(window=(20, 5)), False, 2, 2, 150, 290, 64, np.float32),       # the SIMT kernel (float32 ieee)
    (dict(window=(50, 0), dropout=True), True, 4, 1, 200, 130, 40, np.float64),  # SIMT fp64, causal, MQA
]


def _window_kw(case):
    kw, causal, H, Hk, Lq, Lk, D = case[:7]
    out = {"window": kw["window"]}
    for name in ("alibi", "dropout", "seqlens", "softcap"):
        if kw.get(name):
            out.update(kw_of((name,), H=H, Lq=Lq, Lk=Lk))
    return out


@pytest.mark.parametrize("case", thin(WINDOWS), ids=lambda c: "-".join(
    [("w%s,%s" % c[0]["window"])] + [n for n in c[0] if n != "window"] + ["causal" if c[1] else "full", "d%d" % c[6]]
    + [np.dtype(c[7]).name if len(c) > 7 else "float16"]))
def test_ordered_dq_with_a_window(monkeypatch, case):
    """A window in the deterministic default: the ordered dQ mode (no recomputing dQ kernel), key block n taking
    its turn at query block i after the window's first visitor n_lo(i) (ascending) or after the visitors above it
    (causal, descending); the reference's rule, and the same bits under reverse and random schedules (blocks that
    wait, no deadlock) on one and two workers."""
    _, causal, H, Hk, Lq, Lk, D = case[:7]
    kw = _window_kw(case)
    shape = dict(H=H, Hk=Hk, Lq=Lq, Lk=Lk, D=D, causal=causal, return_counters=True,
                 dtype=case[7] if len(case) > 7 else np.float16)
    monkeypatch.setenv("FLASHARRAY_EMULATOR_THREADS", "1")
    (base, c), plan = (lambda r: (_dkv_counters(r[0]), r[1]))(_ext_backward(kw, **shape))
    assert plan.dq_mode == "ordered" and c.sem_waits > 0 and c.sem_blocked == 0
    for workers, schedule, seed in (("1", "reverse", 0), ("2", "random", 3)):
        monkeypatch.setenv("FLASHARRAY_EMULATOR_THREADS", workers)
        got, c = _dkv_counters(_ext_backward(kw, schedule=schedule, seed=seed, **shape)[0])
        for a, b in zip(base, got):
            np.testing.assert_array_equal(a, b)


SIMT = [(("window", "alibi"), "fp32", True, True), (("softcap", "dropout"), "fp64", False, False),
        (("seqlens", "block_mask"), "fp32", False, False), (("dropout", "seqlens"), "fp64", True, True)]


@pytest.mark.parametrize("case", SIMT, ids=_id)
def test_backward_extension_simt(case):
    """The SIMT kernels (fp32 / fp64): pairs of features, both dQ modes."""
    names, dt, causal, det = case
    run_case(np, DTYPES[dt], kw_of(names, Lq=21, Lk=30), causal=causal, deterministic=det, Lq=21, Lk=30, D=16)


def test_backward_extension_simt_bf16_sm75():
    """bf16 on sm_75 runs the SIMT kernels (no bf16 tensor cores there)."""
    kw = kw_of(("alibi", "dropout", "window"), Lq=21, Lk=30)
    rng = np.random.default_rng(7)
    q, k, v, dout = (rng.standard_normal((2, 2, L, 16)).astype(bfloat16) for L in (21, 30, 30, 21))
    opts = dict(causal=True, scale=0.25)
    out, lse = fa.flash_attention_forward(q, k, v, backend="emulator", **opts, **kw)
    ext = extensions.from_options(kw, kind="numpy", batch_shape=(2, 2), Lq=21, Lk=30, acc=np.dtype(np.float32))
    grads = cuda_backward.backward(dout, q, k, v, out, lse, **opts, batch_shape=(2, 2), device="emulator",
                                   arch="sm_75", ext=ext)
    p = cuda_backward.plan(dout, q, k, v, out, lse, **opts, batch_shape=(2, 2), device="emulator", arch="sm_75",
                           ext=ext)
    computing = [n for n in p.replay.names if n.startswith(("flash_bwd_dkv", "flash_bwd_dq_"))]
    assert computing and all("simt" in n for n in computing) and p.dq_mode == "ordered"  # the window: ordered too
    report = fa_testing.check_attention(out, q, k, v, dout=dout, grads=grads, **opts, **kw)
    assert report.passed, str(report)


def test_dense_plan_has_no_ext():
    rng = np.random.default_rng(6)
    q = rng.standard_normal((1, 1, 16, 16)).astype(np.float16)
    out, lse = fa.flash_attention_forward(q, q, q, backend="emulator")
    p = cuda_backward.plan(out, q, q, q, out, lse, causal=False, scale=0.25, batch_shape=(1, 1), device="emulator",
                           dq="recompute")
    dense = {cuda_backward.kernel_plan(np.float16, 16, 16, causal=False, deterministic=True, arch=80, vec=vec)[r][1]
             for vec in (True, False) for r in ("dkv", "dq")}
    assert p.ext is None and len(dense & set(p.replay.names)) == 2  # the dense names, no kExt
    p2 = cuda_backward.plan(out, q, q, q, out, lse, causal=False, scale=0.25, batch_shape=(1, 1), device="emulator",
                            ext=Extensions(), dq="recompute")
    assert p2 is p  # an Extensions with no feature is the dense plan


ALL_PAIRS = [(pair, dt, causal, det) for pair in itertools.combinations(
    ("window", "alibi", "softcap", "seqlens", "block_mask", "dropout"), 2)
    for dt in ("fp16", "bf16") for causal in (False, True) for det in (True, False)]


@pytest.mark.slow
@pytest.mark.parametrize("case", ALL_PAIRS, ids=_id)
def test_backward_extension_pairs_slow(case):
    names, dt, causal, det = case
    run_case(np, DTYPES[dt], kw_of(names, Lq=70, Lk=45), causal=causal, deterministic=det, Lq=70, Lk=45, D=40)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dt,causal", [("fp16", False), ("fp16", True), ("bf16", True), ("fp32", False)])
def test_ordered_dq_with_a_block_mask_gpu(dt, causal):
    """The deterministic default with a block mask whose holes are whole tiles (the ordered dQ's dq_turn; on sm_90
    the wgmma backward, else mma.sync; fp32 SIMT): the reference's rule, the same bits in a second run."""
    import cupy
    kw = holed_block_mask(2, 2, 150, 330)
    runs = [run_case(cupy, DTYPES[dt], kw, causal=causal, Lq=150, Lk=330, D=64) for _ in range(2)]
    for a, b in zip(*runs):
        assert cupy.array_equal(a.view(cupy.uint8), b.view(cupy.uint8))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("case", SINGLE + PAIRS, ids=_id)
def test_backward_extension_gpu(case):
    import cupy
    names, dt, causal, det = case
    names = (names,) if isinstance(names, str) else names
    run_case(cupy, DTYPES[dt], kw_of(names), causal=causal, deterministic=det)
