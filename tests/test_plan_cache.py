"""The per-signature call cache (issue 10 §1): a repeated call does no validation, tile choice,
dim merging or source lookup — and never returns a result planned for another signature."""
import gc
import weakref

import numpy as np
import pytest

import flasharray as fa
from flasharray._private import api, cuda_forward, launch, tiles, validation
from flasharray.testing import assert_attention_close
from conftest import make_qkv


@pytest.fixture(autouse=True)
def fresh_caches():
    launch.reload_sources()
    yield
    launch.reload_sources()


def _forbid(monkeypatch, module, name):
    def boom(*a, **k):
        raise AssertionError("%s.%s called on a cached call" % (module.__name__, name))
    monkeypatch.setattr(module, name, boom)


@pytest.mark.parametrize("backend", ["emulator", "cpu"])
def test_repeated_call_skips_validation_and_planning(monkeypatch, backend):
    q, k, v = make_qkv((2, 3, 40, 32), (2, 1, 56, 32), (2, 1, 56, 32), np.float16, seed=1)
    first = fa.flash_attention(q, k, v, causal=True, backend=backend)
    for module, name in ((validation, "check_qkv"), (validation, "check_arrays"), (tiles, "forward_tile"),
                         (launch, "batch_layout"), (launch, "source_digest"), (launch, "make_launcher")):
        _forbid(monkeypatch, module, name)
    q2, k2, v2 = (x.copy() for x in (q, k, v))    # new arrays, same signature
    q2[0, 0, 0] *= -1
    again = fa.flash_attention(q2, k2, v2, causal=True, backend=backend)
    assert_attention_close(again, q2, k2, v2, causal=True)
    assert not np.array_equal(again[0, 0, 0], first[0, 0, 0])  # computed from the new q, not replayed


def _variants(q, k, v):
    """(description, call) pairs that share shapes but differ in something a plan depends on."""
    buf = np.empty(q.size + 8, q.dtype)
    q_misaligned = buf[1:q.size + 1].reshape(q.shape)        # 2 bytes off a 16-byte boundary
    q_misaligned[...] = q
    q_strided = np.swapaxes(np.ascontiguousarray(np.swapaxes(q, -2, -3)), -2, -3)  # other strides
    k_last = np.asfortranarray(k)                            # head dim not contiguous (copied)
    return [("base", dict(q=q, k=k, v=v)),
            ("causal", dict(q=q, k=k, v=v, causal=True)),
            ("scale", dict(q=q, k=k, v=v, scale=0.3)),
            ("misaligned q", dict(q=q_misaligned, k=k, v=v)),
            ("strides", dict(q=q_strided, k=k, v=v)),
            ("fortran k", dict(q=q, k=k_last, v=v)),
            ("float32", dict(q=q.astype(np.float32), k=k.astype(np.float32), v=v.astype(np.float32)))]


def test_every_signature_change_gets_its_own_plan():
    q, k, v = make_qkv((2, 2, 33, 16), (2, 2, 47, 16), (2, 2, 47, 16), np.float16, seed=2)
    variants = _variants(q, k, v)
    for _ in range(2):  # the second round replays every cached entry, in another order
        for name, kw in variants[::-1] if _ else variants:
            out = fa.flash_attention(backend="emulator", **kw)
            causal, scale = kw.get("causal", False), kw.get("scale")
            assert_attention_close(out, kw["q"], kw["k"], kw["v"], causal=causal, scale=scale)
    assert len(api._CACHE) == len(variants)
    assert len(cuda_forward._PLANS) == len(variants)


def test_alignment_picks_the_kernel_variant():
    q, k, v = make_qkv((1, 1, 32, 16), (1, 1, 32, 16), (1, 1, 32, 16), np.float16, seed=4)
    buf = np.empty(q.size + 8, q.dtype)
    qm = buf[1:q.size + 1].reshape(q.shape)
    qm[...] = q
    plans = [cuda_forward.plan(x, k, v, causal=False, scale=0.25, batch_shape=(1, 1), device="emulator")
             for x in (q, qm)]
    assert plans[0] is not plans[1]
    assert plans[0].launches[0].name != plans[1].launches[0].name
    tile = plans[0].tile
    assert plans[0].launches[0].name == tile.name_expression(causal=False, aligned=True)
    assert plans[1].launches[0].name == tile.name_expression(causal=False, aligned=False)


def test_cached_flags_are_still_type_checked():
    q, k, v = make_qkv((1, 2, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16), np.float32, seed=5)
    fa.flash_attention(q, k, v, causal=True)
    with pytest.raises(TypeError, match="causal"):
        fa.flash_attention(q, k, v, causal=1)          # == True, but not a bool
    fa.flash_attention(q, k, v, scale=1.0)
    with pytest.raises(TypeError, match="scale"):
        fa.flash_attention(q, k, v, scale=True)        # == 1.0, but a bool
    with pytest.raises(ValueError, match="scale"):
        fa.flash_attention(q, k, v, scale=float("nan"))


@pytest.mark.parametrize("backend", ["emulator", "cpu"])
def test_cache_does_not_keep_arrays_alive(backend):
    q, k, v = make_qkv((1, 2, 24, 16), (1, 2, 24, 16), (1, 2, 24, 16), np.float16, seed=6)
    out, lse = fa.flash_attention_forward(q, k, v, backend=backend)
    grads = fa.flash_attention_backward(out, q, k, v, out, lse, backend=backend)
    refs = [weakref.ref(x) for x in (q, k, v, out, lse, *grads)]
    del q, k, v, out, lse, grads
    gc.collect()
    assert all(r() is None for r in refs)


def test_reload_kernels_drops_plans_and_digest(monkeypatch):
    q, k, v = make_qkv((1, 1, 16, 16), (1, 1, 16, 16), (1, 1, 16, 16), np.float16, seed=7)
    fa.flash_attention(q, k, v, backend="emulator")
    digest = launch.source_digest()
    assert api._CACHE and cuda_forward._PLANS
    fa.reload_kernels()
    assert not api._CACHE and not cuda_forward._PLANS and launch._digest is None
    assert launch.source_digest() == digest
    out = fa.flash_attention(q, k, v, backend="emulator")
    assert_attention_close(out, q, k, v)


def test_null_launches_run_nothing_and_do_not_leak_plans():
    q, k, v = make_qkv((1, 1, 16, 16), (1, 1, 16, 16), (1, 1, 16, 16), np.float16, seed=8)
    with launch.null_launches():
        out = fa.flash_attention(q, k, v, backend="emulator")
        assert isinstance(cuda_forward._PLANS and next(iter(cuda_forward._PLANS.values())).launcher,
                          launch.NullLauncher)
    assert not api._CACHE and not cuda_forward._PLANS
    real = fa.flash_attention(q, k, v, backend="emulator")
    assert_attention_close(real, q, k, v)
    assert out.shape == real.shape


def test_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(api, "_MAX_ENTRIES", 3)
    q, k, v = make_qkv((1, 1, 8, 16), (1, 1, 8, 16), (1, 1, 8, 16), np.float32, seed=9)
    for s in (0.1, 0.2, 0.3, 0.4, 0.5):
        fa.flash_attention(q, k, v, scale=s)
    assert len(api._CACHE) == 3


def test_cached_backward_skips_validation(monkeypatch):
    q, k, v = make_qkv((1, 2, 24, 16), (1, 1, 24, 16), (1, 1, 24, 16), np.float32, seed=10)
    out, lse = fa.flash_attention_forward(q, k, v, causal=True)
    do = np.ones_like(out)
    first = fa.flash_attention_backward(do, q, k, v, out, lse, causal=True)
    _forbid(monkeypatch, validation, "check_lse")
    again = fa.flash_attention_backward(do, q, k, v, out, lse, causal=True)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    monkeypatch.undo()
    with pytest.raises(TypeError, match="deterministic"):
        fa.flash_attention_backward(do, q, k, v, out, lse, causal=True, deterministic=1)


def test_cached_backward_returns_fresh_gradients_each_call():
    """The returned gradients are views of one allocation per call: never memory of an earlier
    call's results, never overlapping each other, writable, C-contiguous, the inputs' shapes."""
    q, k, v = make_qkv((2, 2, 24, 16), (2, 1, 24, 16), (2, 1, 24, 16), np.float16, seed=11)
    out, lse = fa.flash_attention_forward(q, k, v, backend="emulator")
    do = np.ones_like(out)
    first = fa.flash_attention_backward(do, q, k, v, out, lse, backend="emulator")
    second = fa.flash_attention_backward(do, q, k, v, out, lse, backend="emulator")
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    for i, a in enumerate(first):
        assert a.flags.writeable and a.flags.c_contiguous
        assert not any(np.shares_memory(a, b) for b in second)
        assert not any(np.shares_memory(a, b) for b in first[i + 1:])
    assert [g.shape for g in first] == [q.shape, k.shape, v.shape]


@pytest.mark.parametrize("deterministic,dq", [(True, None), (True, "recompute"), (False, None)])
def test_backward_plan_binds_each_array_once(deterministic, dq):
    """One pointer per distinct (array, offset) however many launches use it; the recomputing
    mode's unused dQ accumulator is bound once at planning (no per-call allocation); the atomic
    modes (fp16 deterministic: ordered) allocate the accumulator with the scratch."""
    from flasharray._private import cuda_backward
    q, k, v = make_qkv((1, 2, 40, 16), (1, 2, 40, 16), (1, 2, 40, 16), np.float16, seed=12)
    out, lse = fa.flash_attention_forward(q, k, v, backend="emulator")
    p = cuda_backward.plan(out, q, k, v, out, lse, causal=False, scale=0.25, batch_shape=(1, 2),
                           device="emulator", deterministic=deterministic, dq=dq)
    assert len(p.launches) == 3
    keys = [key for key, _ in p.replay.slots]
    assert len(keys) == len(set(p.replay.slots)) == len(set(keys))  # one batch split: offsets 0
    recompute = dq == "recompute"
    names = ["dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv", "delta"] + ([] if recompute else ["dqacc"])
    assert len(keys) == len(names)
    assert len(p.allocations) == 2  # the returned gradients; the AccT scratch
    scratch = p.allocations[1][2]
    assert len(scratch) == (1 if recompute else 2) and all(offset % 256 == 0 for offset, _, _ in scratch)


def test_null_launcher_backward_shapes_for_every_layout():
    """Under the no-op launcher (CUDA's binding, nothing run) every backward layout returns its
    gradients' shapes and dtypes: GQA partial sums, atomic accumulator, copied inputs, empty batch."""
    q, k, v = make_qkv((2, 3, 20, 16), (2, 1, 20, 16), (2, 1, 20, 16), np.float16, seed=13)
    out, lse = fa.flash_attention_forward(q, k, v, backend="emulator")
    cases = [(q, k, v), (q, np.asfortranarray(k), v), (q[:1, :1], k[:1], v[:1]),
             (q[:0], k[:0], v[:0]), (q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))]
    with launch.null_launches():
        for qq, kk, vv in cases:
            o, l_ = out[:qq.shape[0], :qq.shape[1]].astype(qq.dtype), lse[:qq.shape[0], :qq.shape[1]]
            for det in (True, False):
                grads = fa.flash_attention_backward(o, qq, kk, vv, o, l_, backend="emulator", deterministic=det)
                assert [(g.shape, g.dtype) for g in grads] == [(x.shape, x.dtype) for x in (qq, kk, vv)]


@pytest.mark.parametrize("B", [1, 2, 3])
def test_kvcache_write_by_slices_equals_write_by_indexing(monkeypatch, B):
    """A few entries of a contiguous cache are written by slices (cheaper per call than index
    arrays): the same caches and outputs as the indexing path."""
    from flasharray._private import kvcache
    rng = np.random.default_rng(B)
    q = rng.standard_normal((B, 2, 1, 16)).astype(np.float16)
    k_new, v_new = (rng.standard_normal((B, 2, 3, 16)).astype(np.float16) for _ in range(2))
    seqlens = np.array([5, 0, 29][:B], dtype=np.int32)
    results = []
    for entries in (kvcache.SLICE_WRITE_ENTRIES, 0):
        monkeypatch.setattr(kvcache, "SLICE_WRITE_ENTRIES", entries)
        k_cache, v_cache = (rng.standard_normal((B, 2, 32, 16)).astype(np.float16) for _ in range(2))
        if results:
            k_cache[...], v_cache[...] = results[0][1], results[0][2]  # the same starting caches
        start = (k_cache.copy(), v_cache.copy())
        out = fa.flash_attention_with_kvcache(q, k_cache, v_cache, seqlens, k_new=k_new, v_new=v_new,
                                              backend="emulator")
        results.append((out, start[0], start[1], k_cache, v_cache))
    (o1, *_, k1, v1), (o2, *_, k2, v2) = results
    np.testing.assert_array_equal(k1, k2)
    np.testing.assert_array_equal(v1, v2)
    np.testing.assert_array_equal(o1, o2)
    for b, s in enumerate(seqlens):
        np.testing.assert_array_equal(k1[b, :, s:s + 3], k_new[b])


def _decoding_step(rng, paged=False, B=2, dtype=np.float16):
    """Arguments of one KV-cache call: q (B, 2, 1, 16), one new token, caches of 64 rows (paged:
    4 pages of 16 per entry)."""
    q = rng.standard_normal((B, 2, 1, 16)).astype(dtype)
    k_new, v_new = (rng.standard_normal((B, 2, 1, 16)).astype(dtype) for _ in range(2))
    seqlens = np.array([5, 40, 17][:B], dtype=np.int32)
    if paged:
        k_cache, v_cache = (rng.standard_normal((4 * B, 2, 16, 16)).astype(dtype) for _ in range(2))
        table = np.arange(4 * B, dtype=np.int32)[::-1].reshape(B, 4).copy()
    else:
        k_cache, v_cache = (rng.standard_normal((B, 2, 64, 16)).astype(dtype) for _ in range(2))
        table = None
    return q, k_cache, v_cache, seqlens, dict(k_new=k_new, v_new=v_new, block_table=table)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("backend", ["emulator", "cpu"])
def test_repeated_kvcache_call_skips_validation_and_planning(monkeypatch, paged, backend):
    """A KV-cache call of a known signature skips the checks of types and shapes and the plan's
    signature; it still appends in place and attends over the new lengths."""
    from flasharray._private import kvcache
    rng = np.random.default_rng(7)
    q, k_cache, v_cache, seqlens, kw = _decoding_step(rng, paged)
    fa.flash_attention_with_kvcache(q, k_cache, v_cache, seqlens, backend=backend, **kw)
    forbidden = [(validation, "check_int32_array"), (validation, "check_writeable"), (kvcache, "_KVCall"),
                 (kvcache, "_uses_kernel")]
    if backend == "emulator":  # (the cpu path calls the public forward per length: its own cache)
        forbidden += [(validation, "check_arrays"), (cuda_forward, "signature"), (launch, "make_launcher")]
    for module, name in forbidden:
        _forbid(monkeypatch, module, name)
    q2, k2, v2, s2, kw2 = _decoding_step(np.random.default_rng(8), paged)
    s2 += 1
    start = (k2.copy(), v2.copy())
    out = fa.flash_attention_with_kvcache(q2, k2, v2, s2, backend=backend, **kw2)
    monkeypatch.undo()
    k3, v3 = start
    want = fa.flash_attention_with_kvcache(q2, k3, v3, s2, backend="cpu", **kw2)
    np.testing.assert_array_equal(k2, k3)   # the same rows appended in place
    np.testing.assert_array_equal(v2, v3)
    np.testing.assert_allclose(out.astype(np.float32), want.astype(np.float32), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_cached_kvcache_call_still_checks_values(paged):
    """The values of cache_seqlens and block_table are not part of the signature: a cached call
    with an out-of-range length or page still raises and writes nothing."""
    rng = np.random.default_rng(9)
    q, k_cache, v_cache, seqlens, kw = _decoding_step(rng, paged)
    fa.flash_attention_with_kvcache(q, k_cache, v_cache, seqlens, backend="emulator", **kw)
    before = (k_cache.copy(), v_cache.copy())
    for bad, match in ((np.array([5, 64], np.int32), "exceeds the cache capacity"),
                       (np.array([-1, 3], np.int32), "must be >= 0")):
        with pytest.raises(ValueError, match=match):
            fa.flash_attention_with_kvcache(q, k_cache, v_cache, bad, backend="emulator", **kw)
    if paged:
        table = kw["block_table"].copy()
        table[1, 2] = 99   # entry 1 (41 keys) uses its pages 0..2
        with pytest.raises(ValueError, match=r"block_table\[1, 2\] = 99"):
            fa.flash_attention_with_kvcache(q, k_cache, v_cache, seqlens, backend="emulator",
                                            **dict(kw, block_table=table))
    np.testing.assert_array_equal(k_cache, before[0])
    np.testing.assert_array_equal(v_cache, before[1])


def test_cached_kvcache_call_refuses_a_read_only_cache():
    """Writability is part of the signature: a read-only cache after a writable one of the same
    shape is still refused, before anything is written."""
    rng = np.random.default_rng(10)
    q, k_cache, v_cache, seqlens, kw = _decoding_step(rng)
    fa.flash_attention_with_kvcache(q, k_cache, v_cache, seqlens, backend="emulator", **kw)
    before = k_cache.copy()
    v_cache.flags.writeable = False
    with pytest.raises(ValueError, match="'v_cache' is read-only"):
        fa.flash_attention_with_kvcache(q, k_cache, v_cache, seqlens, backend="emulator", **kw)
    np.testing.assert_array_equal(k_cache, before)
    with pytest.raises(TypeError, match="causal"):   # flags keep their types in the signature
        fa.flash_attention_with_kvcache(q, k_cache, v_cache, seqlens, causal=1, backend="emulator")


@pytest.mark.parametrize("backend", ["emulator", "cpu"])
def test_kvcache_cache_does_not_keep_arrays_alive(backend):
    rng = np.random.default_rng(11)
    q, k_cache, v_cache, seqlens, kw = _decoding_step(rng, paged=backend == "emulator")
    out = fa.flash_attention_with_kvcache(q, k_cache, v_cache, seqlens, backend=backend, **kw)
    refs = [weakref.ref(x) for x in (q, k_cache, v_cache, seqlens, out, *(x for x in kw.values() if x is not None))]
    del q, k_cache, v_cache, seqlens, out, kw
    gc.collect()
    assert all(r() is None for r in refs)
