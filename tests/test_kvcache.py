"""flash_attention_with_kvcache: in-place append, attention over the visible keys, validation.

Every output is checked by the DESIGN.md rule (flasharray.testing) against the float64 reference
over the entry's keys gathered from the pre-call cache plus k_new, and against plain
flash_attention on those contiguous keys; every cache is compared byte for byte with the cache
the element-by-element write predicts. Rows the call must not read hold NaN, so reading one
shows up in the result.
"""
import numpy as np
import pytest

import flasharray as fa
from flasharray import reference
from flasharray.testing import assert_attention_close
from flasharray._private import cuda_forward, kvcache, tiles, validation
from flasharray._private.dtypes import bfloat16
from conftest import DTYPES, DTYPE_IDS, requires_gpu

# (Lq, L_new, cache_seqlens): decode without / with a new token, a chunk of new tokens, Lq < L_new,
# Lq > L_new (causal rows that see no key), and Lq spanning several 16-row pages. Capacity is 48.
SCENARIOS = [(1, 0, (5, 0, 33)), (1, 1, (5, 0, 33)), (4, 4, (0, 17, 28)), (3, 6, (2, 0, 30)),
             (6, 2, (9, 1, 0)), (20, 20, (0, 8, 28))]
SCENARIO_IDS = ["decode0", "decode1", "chunk4", "lq<lnew", "lq>lnew", "lq20"]
# q layouts: (B, H_kv, Lq, D); GQA (B, H_kv, G, Lq, D); MQA (B, H, Lq, D) against H_kv = 1.
HEADS = {"mha": (2, None, 2), "gqa": (2, 3, 2), "mqa": (1, None, 4)}
# Closeness to plain flash_attention on the gathered keys: the same arithmetic on a contiguous
# cache; a paged cache is merged page by page in the accumulation dtype, rounded once.
CLOSE = {np.dtype(np.float16): 2e-3, bfloat16: 1.6e-2, np.dtype(np.float32): 2e-6,
         np.dtype(np.float64): 1e-13}


class Case:
    """Random arguments of one call; rows (and pages) the call must not read hold NaN."""

    def __init__(self, dtype, Lq, L_new, seqlens, *, heads="mha", paged=False, L_cache=48, page=16,
                 D=32, Dv=24, seed=0, layout="bhsd", reserve=0):
        rng = np.random.default_rng(seed)
        H_kv, G, H = HEADS[heads]
        self.B, self.page, self.paged, self.L_new = len(seqlens), page, paged, L_new
        self.cache_seqlens = np.array(seqlens, dtype=np.int32)
        q_shape = (self.B, H_kv, G, Lq, D) if G else (self.B, H, Lq, D)
        self.q = rng.standard_normal(q_shape).astype(dtype)
        self.k_new = rng.standard_normal((self.B, H_kv, L_new, D)).astype(dtype)
        self.v_new = rng.standard_normal((self.B, H_kv, L_new, Dv)).astype(dtype)
        self.block_table = self._table(rng, L_cache, reserve) if paged else None
        n_slots = self.block_table.max() + 3 if paged else self.B
        rows = page if paged else L_cache
        self.k_cache = self._cache(rng, (n_slots, H_kv, rows, D), dtype, layout)
        self.v_cache = self._cache(rng, (n_slots, H_kv, rows, Dv), dtype, layout)
        self._poison_unread()

    def _table(self, rng, L_cache, reserve):
        """Distinct pages in random order for the pages each entry touches (or the first
        ``reserve`` rows need); -1 elsewhere."""
        max_blocks = L_cache // self.page
        table = np.full((self.B, max_blocks), -1, dtype=np.int32)
        used = [-(-max(s + self.L_new, reserve) // self.page) for s in self.cache_seqlens]
        pool = rng.permutation(sum(used) + 2)
        for b, n in enumerate(used):
            table[b, :n], pool = pool[:n], pool[n:]
        return table

    @staticmethod
    def _cache(rng, shape, dtype, layout):
        if layout == "bshd":  # (slots, rows, H, D) memory viewed as (slots, H, rows, D)
            x = rng.standard_normal((shape[0], shape[2], shape[1], shape[3])).astype(dtype)
            return np.swapaxes(x, 1, 2)
        return rng.standard_normal(shape).astype(dtype)

    def _poison_unread(self):
        for cache in (self.k_cache, self.v_cache):
            if self.paged:
                cache[np.setdiff1d(np.arange(cache.shape[0]), self.block_table)] = np.nan
            for b, s in enumerate(self.cache_seqlens):
                for r in range(s, self.capacity):
                    slot, row = self.slot(b, r)
                    if slot >= 0:
                        cache[slot, :, row] = np.nan

    @property
    def capacity(self):
        return self.block_table.shape[1] * self.page if self.paged else self.k_cache.shape[2]

    def slot(self, b, r):
        """(cache slot, row) of logical key row r of entry b."""
        if self.paged:
            return self.block_table[b, r // self.page], r % self.page
        return b, r

    def kwargs(self, with_new=True):
        kw = dict(block_table=self.block_table)
        if with_new:
            kw.update(k_new=self.k_new, v_new=self.v_new)
        return kw

    def args(self):
        return self.q, self.k_cache, self.v_cache, self.cache_seqlens

    def snapshot(self):
        """Copies of every argument, keyed by name."""
        names = ("q", "k_cache", "v_cache", "cache_seqlens", "k_new", "v_new", "block_table")
        return {n: getattr(self, n).copy() for n in names if getattr(self, n) is not None}

    def expected_caches(self, before):
        """The caches after the call, written element by element."""
        k, v = before["k_cache"].copy(), before["v_cache"].copy()
        for b, s in enumerate(self.cache_seqlens):
            for t in range(self.L_new):
                slot, row = self.slot(b, s + t)
                k[slot, :, row] = self.k_new[b, :, t]
                v[slot, :, row] = self.v_new[b, :, t]
        return k, v


def _same_bytes(a, b):
    if not isinstance(a, np.ndarray):
        return a == b
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _assert_untouched(case, before, names=("q", "cache_seqlens", "k_new", "v_new", "block_table")):
    for name in names:
        if name in before:
            assert _same_bytes(getattr(case, name), before[name]), "%s was modified" % name


def _dev(x, backend):
    """The array on the device the backend computes on (CuPy for "cuda")."""
    if backend != "cuda" or x is None:
        return x
    import cupy
    return cupy.asarray(x)


def _host(x):
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else x


def _call(case, causal, backend, **opts):
    """flash_attention_with_kvcache on the backend's arrays; the caches (and results) come back
    into ``case`` on the host."""
    args = [_dev(x, backend) for x in case.args()]
    kwargs = {n: _dev(x, backend) for n, x in case.kwargs().items()}
    out, lse = fa.flash_attention_with_kvcache(*args, **kwargs, causal=causal, return_lse=True,
                                               backend=backend, **opts)
    if backend == "cuda":
        case.k_cache[...], case.v_cache[...] = _host(args[1]), _host(args[2])
    return _host(out), _host(lse)


def run_and_check(case, causal, backend, **opts):
    """Call, then check the cache writes, the untouched inputs and the output of every entry."""
    before = case.snapshot()
    out, lse = _call(case, causal, backend, **opts)
    k_want, v_want = case.expected_caches(before)
    assert _same_bytes(case.k_cache, k_want) and _same_bytes(case.v_cache, v_want)
    _assert_untouched(case, before)
    gathered = reference.gather_kvcache(before["k_cache"], before["v_cache"], case.cache_seqlens,
                                        k_new=case.k_new, v_new=case.v_new, block_table=case.block_table)
    assert out.dtype == case.q.dtype and out.shape[0] == case.B
    tol = CLOSE[np.dtype(case.q.dtype)] * (4 if case.paged else 1)
    for b, (k_b, v_b) in enumerate(gathered):
        if case.q.ndim == 5:
            k_b, v_b = k_b[:, None], v_b[:, None]
        assert_attention_close(out[b], case.q[b], k_b, v_b, causal=causal, lse=lse[b])
        plain = fa.flash_attention_forward(*(_dev(x, backend) for x in (case.q[b], k_b, v_b)),
                                           causal=causal, backend=backend)
        plain_out, plain_lse = map(_host, plain)
        np.testing.assert_allclose(out[b].astype(np.float64), plain_out.astype(np.float64), rtol=tol, atol=tol)
        np.testing.assert_allclose(lse[b], plain_lse, rtol=tol, atol=tol)
    return out, lse


# -- cpu: every dtype, contiguous and paged, MHA/GQA/MQA, causal and not -------------------------

@pytest.mark.parametrize("scenario", SCENARIOS, ids=SCENARIO_IDS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("cache", [None, 16, 32], ids=["contiguous", "paged-1", "paged-2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cpu_matches_reference_and_writes_in_place(dtype, cache, heads, causal, scenario, monkeypatch):
    """``cache``: contiguous, or paged with the cpu path attending one or two 16-row pages per
    call (STAGE_ROWS), so that the causal diagonal crosses calls."""
    if cache:
        monkeypatch.setattr(kvcache, "STAGE_ROWS", cache)
    Lq, L_new, seqlens = scenario
    case = Case(dtype, Lq, L_new, seqlens, heads=heads, paged=bool(cache), seed=len(seqlens) + Lq)
    run_and_check(case, causal, "cpu")


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_strided_cache_is_written_through_the_view(paged):
    case = Case(np.float32, 2, 3, (4, 0, 20), heads="gqa", paged=paged, layout="bshd")
    assert not case.k_cache.flags.c_contiguous
    run_and_check(case, True, "cpu")


def test_reference_does_not_write_and_is_the_plain_formula():
    case = Case(np.float64, 3, 2, (5, 0, 12), heads="gqa")
    before = case.snapshot()
    out, lse = reference.attention_with_kvcache(*case.args(), **case.kwargs(), return_lse=True)
    for name, x in before.items():
        assert _same_bytes(getattr(case, name), x), "%s was modified by the reference" % name
    for b, s in enumerate(case.cache_seqlens):
        k_b = np.concatenate([case.k_cache[b, :, :s], case.k_new[b]], axis=1)[:, None]
        v_b = np.concatenate([case.v_cache[b, :, :s], case.v_new[b]], axis=1)[:, None]
        want_out, want_lse = reference.attention(case.q[b], k_b, v_b, causal=True, return_lse=True)
        np.testing.assert_array_equal(out[b], want_out)
        np.testing.assert_array_equal(lse[b], want_lse)


def test_paged_and_contiguous_caches_with_the_same_keys_agree():
    paged = Case(np.float32, 4, 2, (7, 0, 30), paged=True, seed=5)
    contiguous = Case(np.float32, 4, 2, (7, 0, 30), seed=5)
    for b, (k_b, v_b) in enumerate(reference.gather_kvcache(paged.k_cache, paged.v_cache, paged.cache_seqlens,
                                                            block_table=paged.block_table)):
        contiguous.k_cache[b, :, :k_b.shape[1]], contiguous.v_cache[b, :, :v_b.shape[1]] = k_b, v_b
    contiguous.q, contiguous.k_new, contiguous.v_new = paged.q, paged.k_new, paged.v_new
    out_p = fa.flash_attention_with_kvcache(*paged.args(), **paged.kwargs())
    out_c = fa.flash_attention_with_kvcache(*contiguous.args(), **contiguous.kwargs())
    np.testing.assert_allclose(out_p, out_c, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decoding_step_by_step_equals_one_causal_attention(paged):
    """Prefill 5 tokens, then decode 4 one at a time (the caller advances cache_seqlens): each
    step's output is the matching row of causal attention over all 9 tokens."""
    rng = np.random.default_rng(7)
    B, H_kv, G, T, D = 2, 2, 2, 9, 16
    q, k, v = (rng.standard_normal((B, H_kv, G if i == 0 else 1, T, D)).astype(np.float32) for i in range(3))
    full = fa.flash_attention(q, k, v, causal=True)
    case = Case(np.float32, 1, 0, (0, 0), heads="gqa", paged=paged, D=D, Dv=D, reserve=T)
    seqlens = np.zeros(B, np.int32)
    steps = [(0, 5)] + [(t, t + 1) for t in range(5, T)]
    for t0, t1 in steps:
        out = fa.flash_attention_with_kvcache(q[..., t0:t1, :], case.k_cache, case.v_cache, seqlens,
                                              k_new=k[:, :, 0, t0:t1], v_new=v[:, :, 0, t0:t1],
                                              block_table=case.block_table)
        np.testing.assert_allclose(out, full[..., t0:t1, :], rtol=1e-5, atol=1e-5)
        seqlens += t1 - t0


def test_empty_batch_and_no_queries():
    case = Case(np.float32, 0, 2, (3, 0))
    before = case.snapshot()
    out, lse = fa.flash_attention_with_kvcache(*case.args(), **case.kwargs(), return_lse=True)
    assert out.shape == (2, 2, 0, 24) and lse.shape == (2, 2, 0)
    assert _same_bytes(case.k_cache, case.expected_caches(before)[0])     # the write still happens
    q = np.zeros((0, 2, 1, 32), np.float32)
    k = np.zeros((0, 2, 16, 32), np.float32)
    out = fa.flash_attention_with_kvcache(q, k, k, np.zeros(0, np.int32))
    assert out.shape == (0, 2, 1, 32)


def test_untouched_block_table_entries_are_ignored():
    """Pages past an entry's last visible key may hold anything, even -1 or huge indices."""
    case = Case(np.float32, 1, 1, (3, 17, 0), paged=True)
    case.block_table[case.block_table < 0] = np.iinfo(np.int32).max
    run_and_check(case, True, "cpu")


@pytest.mark.parametrize("heads,Lq,causal,packed", [
    ("gqa", 1, True, True), ("gqa", 3, False, True), ("mqa", 1, True, True), ("gqa", 3, True, False),
    ("mha", 1, True, False)])
def test_query_heads_sharing_a_kv_head_are_packed_as_rows(monkeypatch, heads, Lq, causal, packed):
    """GQA packing: for decoding (Lq = 1) or without a mask, the G query heads of a KV head go to the
    forward as G·Lq rows of one problem against the unexpanded cache (K/V read once per KV head)."""
    shapes = []

    def spy(q, k, v, **kw):
        shapes.append((q.shape, k.shape, kw["causal"]))
        return fa.flash_attention_forward(q, k, v, **kw)

    monkeypatch.setattr(kvcache, "flash_attention_forward", spy)
    case = Case(np.float32, Lq, 1, (4, 4, 4), heads=heads)
    run_and_check(case, causal, "cpu")
    (q_shape, k_shape, masked), = shapes
    H_kv, G, H = HEADS[heads]
    group = G or (H if H_kv == 1 else 1)
    assert q_shape[-2] == (group * Lq if packed else Lq) and k_shape[-2] == 5
    assert masked == (causal and not packed)


# -- refused calls: a clear error and nothing written --------------------------------------------

def _set(name, value):
    return lambda c: setattr(c, name, value(c))


BAD = [
    ("seqlens int64", False, _set("cache_seqlens", lambda c: c.cache_seqlens.astype(np.int64)), TypeError,
     "'cache_seqlens' must have dtype int32, got int64"),
    ("seqlens list", False, _set("cache_seqlens", lambda c: list(c.cache_seqlens)), TypeError,
     "'cache_seqlens' must be a numpy.ndarray"),
    ("seqlens shape", False, _set("cache_seqlens", lambda c: np.zeros(4, np.int32)), ValueError,
     r"'cache_seqlens' must have shape \(B,\) = \(3,\).*got \(4,\)"),
    ("seqlens 2-d", False, _set("cache_seqlens", lambda c: c.cache_seqlens[:, None]), ValueError,
     "'cache_seqlens' must have 1 dim"),
    ("seqlens negative", False, _set("cache_seqlens", lambda c: np.array([1, -2, 0], np.int32)), ValueError,
     r"cache_seqlens must be >= 0, got cache_seqlens\[1\] = -2"),
    ("overflow", False, _set("cache_seqlens", lambda c: np.array([0, 1, 46], np.int32)), ValueError,
     r"cache_seqlens\[2\] \+ L_new = 46 \+ 3 = 49 exceeds the cache capacity L_cache = 48"),
    ("overflow paged", True, _set("cache_seqlens", lambda c: np.array([0, 46, 1], np.int32)), ValueError,
     r"cache_seqlens\[1\] \+ L_new = 46 \+ 3 = 49 exceeds .* max_blocks·page_size = 3·16 = 48"),
    ("table too large", True, lambda c: c.block_table.__setitem__((2, 0), c.k_cache.shape[0]), ValueError,
     r"block_table\[2, 0\] = \d+ is outside \[0, num_blocks = \d+\)"),
    ("table negative", True, lambda c: c.block_table.__setitem__((2, 1), -1), ValueError,
     r"block_table\[2, 1\] = -1 is outside"),
    ("table int64", True, _set("block_table", lambda c: c.block_table.astype(np.int64)), TypeError,
     "'block_table' must have dtype int32"),
    ("table rows", True, _set("block_table", lambda c: c.block_table[:2]), ValueError,
     r"'block_table' must have shape \(B, max_blocks\) with B = 3"),
    ("table 1-d", True, _set("block_table", lambda c: c.block_table[0]), ValueError,
     "'block_table' must have 2 dim"),
    ("page size", True, lambda c: [setattr(c, n, getattr(c, n)[:, :, :8]) for n in ("k_cache", "v_cache")],
     ValueError, r"page size .* multiple of 16, got k_cache.shape=\(\d+, 2, 8, 32\)"),
    ("k_new dtype", False, _set("k_new", lambda c: c.k_new.astype(np.float64)), TypeError,
     "q and k_new must share one dtype, got float32 and float64"),
    ("cache dtype", False, _set("v_cache", lambda c: c.v_cache.astype(np.float16)), TypeError,
     "q and v_cache must share one dtype"),
    ("k_new alone", False, _set("v_new", lambda c: None), ValueError, "k_new and v_new go together"),
    ("k_new shape", False, _set("k_new", lambda c: c.k_new[:, :, :, :16]), ValueError,
     r"'k_new' must have shape \(B, H_kv, L_new, D\) = \(3, 2, 3, 32\)"),
    ("v_new shape", False, _set("v_new", lambda c: c.v_new[:, :, :2]), ValueError,
     r"'v_new' must have shape \(B, H_kv, L_new, Dv\) = \(3, 2, 3, 24\)"),
    ("read-only", False, lambda c: setattr(c.v_cache.flags, "writeable", False), ValueError,
     "'v_cache' is read-only"),
    ("q head dim", False, _set("q", lambda c: c.q[..., :16]), ValueError, "same head dim D"),
    ("q rank", False, _set("q", lambda c: c.q[0]), ValueError, r"'q' must be \(B, H, Lq, D\) or"),
    ("q heads", False, _set("q", lambda c: np.zeros((3, 3, 2, 32), np.float32)), ValueError,
     r"head dims of q \(3,\) do not broadcast with the cache's \(2,\)"),
    ("cache batch", False, lambda c: [setattr(c, n, getattr(c, n)[:2]) for n in ("k_cache", "v_cache")],
     ValueError, "k_cache must hold one entry per batch entry of q"),
    ("v_cache rows", False, _set("v_cache", lambda c: c.v_cache[:, :, :40]), ValueError,
     "k_cache and v_cache must agree on their first three dims"),
    ("backend", False, lambda c: None, TypeError, "backend='cuda' needs CuPy arrays"),
    ("splits on the SIMT kernel", True, lambda c: None, NotImplementedError,
     "num_splits=2: split-KV runs on the tensor-core forward .*this call uses the SIMT kernel \\(float32\\)"),
]


@pytest.mark.parametrize("name,paged,mutate,exc,match", BAD, ids=[b[0] for b in BAD])
def test_refused_call_names_the_argument_and_writes_nothing(name, paged, mutate, exc, match):
    case = Case(np.float32, 2, 3, (4, 0, 20), paged=paged)
    mutate(case)
    before = case.snapshot()
    backend = {"backend": "cuda", "splits on the SIMT kernel": "emulator"}.get(name)
    kwargs = case.kwargs()
    if name == "splits on the SIMT kernel":  # refused while planning, which comes before the writes
        kwargs["num_splits"] = 2
    with pytest.raises(exc, match=match):
        fa.flash_attention_with_kvcache(*case.args(), **kwargs, backend=backend)
    _assert_untouched(case, before, names=("q", "k_cache", "v_cache", "cache_seqlens", "k_new", "v_new",
                                           "block_table"))


def test_flags_are_checked():
    case = Case(np.float32, 1, 1, (2, 0, 5))
    with pytest.raises(TypeError, match="'causal' must be a bool"):
        fa.flash_attention_with_kvcache(*case.args(), causal=1)
    with pytest.raises(TypeError, match="'return_lse' must be a bool"):
        fa.flash_attention_with_kvcache(*case.args(), return_lse="yes")
    with pytest.raises(ValueError, match="'scale' must be finite and positive"):
        fa.flash_attention_with_kvcache(*case.args(), scale=-1.0)
    with pytest.raises(TypeError, match="'check_values' must be a bool, got str"):
        fa.flash_attention_with_kvcache(*case.args(), check_values="no")


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_append_kernel_writes_the_new_keys(monkeypatch, paged, layout):
    """Kernel backends: k_new, v_new go into the cache by one flash_kv_append_kernel launch (every entry,
    head and new row; paged through the block table; strided caches), which also makes the key counts the
    forward reads: the array-indexing write is not used. New rows whose elements are not contiguous keep
    the array-indexing write."""
    monkeypatch.setattr(kvcache, "_write_new", lambda c, s: pytest.fail("array-indexing write used"))
    case = Case(np.float16, 2, 3, (5, 0, 30), heads="gqa", paged=paged, layout=layout, D=40, seed=5)
    run_and_check(case, True, "emulator")
    monkeypatch.undo()
    case = Case(np.float16, 2, 3, (5, 0, 30), paged=paged, D=40, seed=6)
    case.k_new = np.asfortranarray(case.k_new)  # head dim strided: the append kernel does not apply
    monkeypatch.setattr(kvcache, "_append", lambda c: pytest.fail("append kernel used"))
    run_and_check(case, True, "emulator")


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_check_values_false_reads_nothing_back(monkeypatch, paged):
    """check_values=False on a kernel backend: cache_seqlens and block_table are never brought to the
    host (the append indexes on the arrays' device, the kernel reads the lengths there), and a call with
    valid values writes the same caches and returns the same bits as a checked one."""
    runs = []
    for check in (True, False):
        case = Case(np.float16, 1, 1, (5, 0, 33), paged=paged, D=40, seed=3)
        if not check:
            monkeypatch.setattr(kvcache, "_host_values", lambda c: pytest.fail("values read back"))
        out, lse = run_and_check(case, True, "emulator", check_values=check)
        runs.append((out, lse, case.k_cache, case.v_cache))
    assert all(_same_bytes(a, b) for a, b in zip(*runs))


# -- kernel backends: the CUDA forward kernels on views of a contiguous cache ---------------------
# One body for the emulator (always) and CUDA (when CuPy sees a device); small: the emulator is slow.

KERNEL_BACKENDS = [pytest.param("emulator", id="emulator"),
                   pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, requires_gpu])]
EMU_SCENARIOS = [(1, 1, (5, 0, 33)), (3, 2, (0, 17, 2)), (2, 0, (1, 9, 0))]


@pytest.mark.parametrize("scenario", EMU_SCENARIOS, ids=["decode1", "chunk", "no-new"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads", ["mha", "gqa"])
@pytest.mark.parametrize("dtype", DTYPES[:3], ids=DTYPE_IDS[:3])
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_kernel_backends_contiguous_cache(backend, dtype, heads, causal, scenario):
    Lq, L_new, seqlens = scenario
    case = Case(dtype, Lq, L_new, seqlens, heads=heads, D=40, seed=11)   # D, Dv as test_backends_api
    run_and_check(case, causal, backend)


# -- kernel backends: one tensor-core forward over the whole cache (per-entry key counts, pages) ---
# float16 / bfloat16; D = 40, Dv = 24 (as above). Rows and pages a call must not read hold NaN.

PAGED_SCENARIOS = [(1, 1, (5, 0, 33)), (3, 2, (0, 17, 70)), (2, 0, (1, 40, 0))]


@pytest.mark.parametrize("scenario", PAGED_SCENARIOS, ids=["decode1", "chunk", "no-new"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("page", [16, 32, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES[:2], ids=DTYPE_IDS[:2])
def test_emulator_paged_cache(dtype, page, causal, scenario):
    """Pages smaller than, equal to and larger than the key tile; a key tile may span pages."""
    Lq, L_new, seqlens = scenario
    heads = "gqa" if (page // 16 + causal) % 2 else "mha"
    case = Case(dtype, Lq, L_new, seqlens, heads=heads, paged=True, L_cache=128 if page < 128 else 256,
                page=page, D=40, seed=page + Lq)
    run_and_check(case, causal, "emulator")


@pytest.mark.parametrize("num_splits", [1, 2, 3])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", DTYPES[:2], ids=DTYPE_IDS[:2])
def test_emulator_kvcache_forced_splits(dtype, paged, num_splits):
    """Split-KV over per-entry key counts: splits past an entry's keys are empty (lse -inf in the
    workspace) and the combine merges the rest; an entry with no key gets out 0, lse -inf."""
    case = Case(dtype, 3, 2, (0, 17, 95), heads="gqa" if paged else "mqa", paged=paged, L_cache=128,
                page=32, D=40, seed=num_splits)
    out, lse = run_and_check(case, True, "emulator", num_splits=num_splits)
    case0 = Case(dtype, 1, 0, (0, 9), paged=paged, L_cache=128, page=32, D=40, seed=5)
    out, lse = _call(case0, False, "emulator", num_splits=num_splits)
    assert np.all(out[0] == 0) and np.all(np.isneginf(lse[0])) and np.all(np.isfinite(lse[1]))


def _counted_kvcache_launches(monkeypatch):
    """Patches forward_kvcache to collect the emulator's per-launch counters."""
    counters, original = [], cuda_forward.forward_kvcache
    monkeypatch.setattr(cuda_forward, "forward_kvcache",
                        lambda *a, **kw: original(*a, counters=counters, **kw))
    return counters


@pytest.mark.parametrize("num_splits", [1, 2])
def test_one_forward_launch_for_differing_lengths(monkeypatch, num_splits):
    """A contiguous cache whose entries all see different numbers of keys: one forward launch
    (+ the split-KV combine), not one per run of equal lengths."""
    counters = _counted_kvcache_launches(monkeypatch)
    case = Case(np.float16, 1, 1, (5, 0, 33, 12, 40), heads="gqa", D=40, seed=2)
    run_and_check(case, True, "emulator", num_splits=num_splits)
    assert len(counters) == num_splits          # forward (+ combine)


def test_paged_reads_only_the_touched_pages(monkeypatch):
    """The emulator's byte counters: K and V bytes read are exactly the entries' visible rows (each
    read once per KV head: GQA-packed decoding), out of a pool several times larger."""
    counters = _counted_kvcache_launches(monkeypatch)
    seqlens = (5, 0, 33)
    case = Case(np.float16, 1, 1, seqlens, heads="gqa", paged=True, L_cache=128, page=16, D=64, Dv=64,
                seed=4)
    run_and_check(case, True, "emulator", num_splits=1)
    (c,) = counters
    H_kv, rows = case.k_cache.shape[1], sum(s + 1 for s in seqlens)
    assert c.buffers[1].read_bytes == rows * H_kv * 64 * 2      # K: visible rows only
    assert c.buffers[2].read_bytes == rows * H_kv * 64 * 2      # V
    assert case.k_cache.nbytes >= 3 * c.buffers[1].read_bytes   # the pool is far larger


# The block_table parameter of flash_fwd_kernel (cuda_src/flash_fwd.cu): its argument index, which
# keys the emulator's per-buffer counters (q, k, v are 0, 1, 2).
TABLE_ARG = 33


def _table_reads(lengths, H_kv, page, tile):
    """Block-table bytes the tensor-core and SIMT forwards read (PageTable::lookup in
    flash_fwd_copy.cuh): per key tile and warp, one 4-byte read per page that the tile's existing
    16-row groups touch — one per tile when the page holds the tile; K_j and V_j share it in the
    tensor-core two-stage ring and in the SIMT forward (K_j's lookup kept for V_j)."""
    pages = sum(len({g // page for g in range(n0, min(n0 + tile.block_n, n), 16)})
                for n in lengths for n0 in range(0, n, tile.block_n))
    shared = tile.kernel == "simt" or tile.stages == 2
    return H_kv * pages * (tile.n_threads // 32) * 4 * (1 if shared else 2)


@pytest.mark.parametrize("page", [16, 32, 48, 64, 80, 256])
def test_paged_table_reads_one_per_page_and_tile(monkeypatch, page):
    """Decoding over shuffled pools of `page`-row pages, every entry's last page partial (48, 80:
    key tiles and pages straddle each other): the result is right, K and V bytes are exactly the
    visible rows, and the block table is read once per page a key tile touches and warp — not once
    per copied 16-byte chunk as before (docs/performance.md, "paged K/V copy")."""
    counters = _counted_kvcache_launches(monkeypatch)
    seqlens = (100, 0, 257, 30)                                   # + 1 new key each
    case = Case(np.float16, 1, 1, seqlens, heads="gqa", paged=True, L_cache=-(-320 // page) * page,
                page=page, D=64, Dv=64, seed=page)
    run_and_check(case, True, "emulator", num_splits=1)
    (c,) = counters
    H_kv, lengths = case.k_cache.shape[1], [s + 1 for s in seqlens]
    tile = tiles.forward_tile("float16", 64, 64)
    assert c.buffers[1].read_bytes == sum(lengths) * H_kv * 64 * 2      # K: visible rows only
    assert c.buffers[2].read_bytes == sum(lengths) * H_kv * 64 * 2      # V
    table = c.buffers[TABLE_ARG].read_bytes
    assert table == _table_reads(lengths, H_kv, page, tile)
    chunks = sum(lengths) * H_kv * 2 * (64 * 2 // 16)                    # 16-byte chunks of K and V
    assert table * 16 <= chunks * 4                                      # before: 4 bytes per chunk


def test_emulator_paged_unaligned_rows():
    """Rows that are not 16-byte aligned (D = 27 fp16): the element-wise paged copy, a lookup per row."""
    case = Case(np.float16, 2, 1, (5, 0, 40), heads="gqa", paged=True, L_cache=64, page=16, D=27, Dv=27, seed=8)
    run_and_check(case, True, "emulator", num_splits=1)


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["fp16", "fp32-simt"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_emulator_strided_cache(paged, dtype):
    """BSHD memory viewed as BHSD: the kernel gets the row, head and page strides, nothing is copied
    (float32: the SIMT forward, whose aligned paged rows go through PagedTileCopy too)."""
    case = Case(dtype, 2, 3, (4, 0, 20), heads="gqa", paged=paged, layout="bshd", D=40)
    assert not case.k_cache.flags.c_contiguous
    run_and_check(case, True, "emulator")


def test_kvcache_plan_does_not_depend_on_the_lengths():
    """One cached plan serves every call of a signature, whatever the lengths' and table's values."""
    case = Case(np.float16, 1, 0, (5, 0, 33), paged=True, L_cache=64, D=40)
    fa.flash_attention_with_kvcache(*case.args(), **case.kwargs(), backend="emulator")
    plans = len(cuda_forward._PLANS)
    case.cache_seqlens[:] = (20, 7, 1)
    case.block_table[:] = case.block_table[::-1]
    case.block_table[case.block_table < 0] = 0
    fa.flash_attention_with_kvcache(*case.args(), **case.kwargs(), backend="emulator")
    assert len(cuda_forward._PLANS) == plans


@pytest.mark.parametrize("scenario", PAGED_SCENARIOS, ids=["decode1", "chunk", "no-new"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype,page", [(np.float32, 16), (np.float32, 48), (np.float32, 128), (np.float64, 32)],
                         ids=["fp32-p16", "fp32-p48", "fp32-p128", "fp64-p32"])
def test_emulator_paged_cache_simt(dtype, page, causal, scenario):
    """float32 / float64: the SIMT forward reads per-entry key counts and pages in place too (D = 40:
    Bc = 32, a key tile spans two 16-row pages; 48-row pages and tiles straddle each other; pages
    larger than the tile)."""
    Lq, L_new, seqlens = scenario
    case = Case(dtype, Lq, L_new, seqlens, heads="gqa" if causal else "mha", paged=True,
                L_cache=-(-128 // page) * page if page < 128 else 256, page=page, D=40, seed=page + Lq)
    run_and_check(case, causal, "emulator")


def test_simt_paged_reads_only_the_touched_pages(monkeypatch):
    """float32, one SIMT forward launch: K and V bytes read are exactly the entries' visible rows
    (GQA-packed decoding: once per KV head), pages read in place."""
    counters = _counted_kvcache_launches(monkeypatch)
    seqlens = (5, 0, 33)
    case = Case(np.float32, 1, 1, seqlens, heads="gqa", paged=True, L_cache=128, page=16, D=64, Dv=64, seed=4)
    run_and_check(case, True, "emulator")
    (c,) = counters
    H_kv, rows = case.k_cache.shape[1], sum(s + 1 for s in seqlens)
    assert c.buffers[1].read_bytes == rows * H_kv * 64 * 4      # K: visible rows only
    assert c.buffers[2].read_bytes == rows * H_kv * 64 * 4      # V


# The block_table parameter of flash_fwd_simt_kernel (cuda_src/flash_fwd_simt.cu): its argument index.
SIMT_TABLE_ARG = 31


@pytest.mark.parametrize("dtype,page", [(np.float32, p) for p in (16, 32, 48, 64, 80, 256)]
                         + [(np.float64, 16), (np.float64, 48)],
                         ids=["fp32-p%d" % p for p in (16, 32, 48, 64, 80, 256)] + ["fp64-p16", "fp64-p48"])
def test_simt_paged_table_reads_one_per_page_and_tile(monkeypatch, dtype, page):
    """The SIMT forward (float32 / float64) with 16-byte aligned rows copies paged K/V as the
    tensor-core forward does (PagedTileCopy): decoding over shuffled pools, every entry's last page
    partial (48, 80: Bc = 32 key tiles and pages straddle) — the result is right, K and V bytes are
    exactly the visible rows, and the block table is read once per page a key tile touches and warp
    (K_j and V_j share the lookup), not once per copied 16-byte chunk as with load_tile_paged
    (docs/performance.md, "Paged K/V copy")."""
    counters = _counted_kvcache_launches(monkeypatch)
    seqlens = (100, 0, 257, 30)                                   # + 1 new key each
    case = Case(dtype, 1, 1, seqlens, heads="gqa", paged=True, L_cache=-(-320 // page) * page,
                page=page, D=64, Dv=64, seed=page)
    run_and_check(case, True, "emulator")
    (c,) = counters
    size = np.dtype(dtype).itemsize
    H_kv, lengths = case.k_cache.shape[1], [s + 1 for s in seqlens]
    tile = tiles.forward_tile(np.dtype(dtype).name, 64, 64)
    assert tile.kernel == "simt" and tile.block_n == 32
    assert c.buffers[1].read_bytes == sum(lengths) * H_kv * 64 * size      # K: visible rows only
    assert c.buffers[2].read_bytes == sum(lengths) * H_kv * 64 * size      # V
    table = c.buffers[SIMT_TABLE_ARG].read_bytes
    assert table == _table_reads(lengths, H_kv, page, tile)
    chunks = sum(lengths) * H_kv * 2 * (64 * size // 16)                    # 16-byte chunks of K and V
    assert table * 16 <= chunks * 4                                         # before: 4 bytes per chunk


def test_emulator_paged_unaligned_rows_simt():
    """float32 rows that are not 16-byte aligned (D = 27): the SIMT forward's element-wise paged
    copy (load_tile_paged, a lookup per row), 16-row pages straddled by the key tiles."""
    case = Case(np.float32, 2, 1, (5, 0, 40), heads="gqa", paged=True, L_cache=64, page=16, D=27, Dv=27, seed=8)
    run_and_check(case, True, "emulator")


@pytest.mark.parametrize("page", [0, 8, 24, 40])
def test_private_forward_kvcache_checks_the_page_size(page):
    """cuda_forward.forward_kvcache (private; flash_attention_with_kvcache checks first) refuses a
    page size that is not a positive multiple of 16 before planning or launching anything: the
    kernels look pages up per 16-row group."""
    counters = []
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 1, 1, 32)).astype(np.float32)
    pool = rng.standard_normal((4, 1, page, 32)).astype(np.float32)
    table = np.array([[0, 1], [2, 3]], dtype=np.int32)
    seqlens = np.array([page, 1], dtype=np.int32)
    plans = len(cuda_forward._PLANS)
    with pytest.raises(ValueError, match=r"page size \(axis 2 of the paged k_cache\) must be a positive "
                                         r"multiple of 16, got page_size=%d \(k_cache.shape=\(4, 1, %d, 32\)\)"
                                         % (page, page)):
        cuda_forward.forward_kvcache(q, pool, pool, seqlens, table, causal=True, scale=None, device="emulator",
                                     counters=counters)
    assert counters == [] and len(cuda_forward._PLANS) == plans


def test_num_splits_is_refused_on_cpu():
    case = Case(np.float32, 1, 1, (5, 0, 33))
    with pytest.raises(TypeError, match="num_splits"):
        fa.flash_attention_with_kvcache(*case.args(), backend="cpu", num_splits=2)


def _numpy_backed_cupy(monkeypatch, copies):
    """A CuPy stand-in whose arrays are NumPy arrays of a subclass named ``cupy.ndarray`` (which the
    array-kind check is told to take for CuPy), with the few functions the kvcache glue calls;
    ``copies`` records each device→host transfer."""
    import sys
    import types
    nd = type("ndarray", (np.ndarray,), {"__module__": "cupy",
                                         "get": lambda self: copies.append(self.shape) or np.array(self)})
    dev = lambda x: np.asarray(x).view(nd)        # noqa: E731
    fake = types.ModuleType("cupy")
    fake.ndarray, fake.int64 = nd, np.int64
    for name in ("arange", "empty", "concatenate", "take_along_axis", "swapaxes"):
        setattr(fake, name, lambda *a, _f=getattr(np, name), **kw: dev(_f(*a, **kw)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    numpy_or_cupy = validation.array_kind    # a NumPy subclass would count as NumPy: tell it apart
    monkeypatch.setattr(validation, "array_kind", lambda x: "cupy" if type(x) is nd else numpy_or_cupy(x))

    def forward(q, k, v, *, backend, **kw):          # the cpu backend stands in for the kernels
        assert backend == "cuda" and all(type(x) is nd for x in (q, k, v))
        return tuple(map(dev, fa.flash_attention_forward(*map(np.asarray, (q, k, v)), backend="cpu", **kw)))

    monkeypatch.setattr(kvcache, "flash_attention_forward", forward)
    return dev


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_cupy_glue_without_a_gpu(monkeypatch, paged):
    """The CuPy-only steps — one device→host copy of cache_seqlens (and block_table), the write by
    device-side indexing (where the append kernel does not apply), the plan made during validation, one
    kernel call with the device arrays —
    against a NumPy-backed CuPy stand-in (the kernel call itself recorded, not run)."""
    copies = []
    dev = _numpy_backed_cupy(monkeypatch, copies)
    case = Case(np.float32, 2, 3, (4, 0, 20), heads="gqa", paged=paged)
    before = case.snapshot()
    args = [dev(x) for x in case.args()] + [{n: dev(x) for n, x in case.kwargs().items() if x is not None}]
    seen, planned = [], []
    monkeypatch.setattr(kvcache, "_uses_kernel", lambda c: c.backend == "cuda")
    monkeypatch.setattr(kvcache, "_append_plan", lambda c: None)  # the indexed write (the append kernel: emulator tests)
    monkeypatch.setattr(cuda_forward, "_kvcache_plan", lambda *a, **kw: planned.append(kw["device"]) or "plan")
    monkeypatch.setattr(cuda_forward, "forward_kvcache",
                        lambda q, k, v, lengths, table, memo, **kw: seen.append(
                            (np.asarray(lengths).tolist(), None if table is None else np.asarray(table).tolist(),
                             memo["plan"], type(q).__module__)) or (None, None))
    fa.flash_attention_with_kvcache(*args[:4], **args[4])
    assert planned == ["cuda"]
    assert copies == [(3 + (case.block_table.size if paged else 0),)]   # seqlens (and table) in one transfer
    assert seen == [([7, 3, 23], case.block_table.tolist() if paged else None, "plan", "cupy")]
    assert _same_bytes(case.k_cache, case.expected_caches(before)[0])   # written in place on the device
    # check_values=False: no transfer at all; the same write and kernel call
    case.k_cache[...], case.v_cache[...] = before["k_cache"], before["v_cache"]
    copies.clear(), seen.clear()
    fa.flash_attention_with_kvcache(*args[:4], **args[4], check_values=False)
    assert copies == [] and seen == [([7, 3, 23], case.block_table.tolist() if paged else None, "plan", "cupy")]
    assert _same_bytes(case.k_cache, case.expected_caches(before)[0])


# -- bigger problems ------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("page", [16, 64, 256])
@pytest.mark.parametrize("Lq,L_new", [(1, 1), (129, 129), (65, 0)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cpu_large_cache(dtype, Lq, L_new, page):
    seqlens = (700, 0, 1023 - L_new, 257)
    for paged in (False, True):
        case = Case(dtype, Lq, L_new, seqlens, heads="gqa", paged=paged, L_cache=1024, page=page,
                    D=128, Dv=128, seed=page)
        run_and_check(case, True, "cpu")


@pytest.mark.slow
@pytest.mark.parametrize("num_splits", [1, None])
@pytest.mark.parametrize("page", [16, 48, 256])
@pytest.mark.parametrize("dtype", DTYPES[:2], ids=DTYPE_IDS[:2])
def test_emulator_larger_paged_cache(dtype, page, num_splits):
    """Thousands of keys through the paged copy: many key tiles per entry, pages straddling tiles
    (48), a prefill chunk (causal, GQA-packed) and the split-KV default."""
    case = Case(dtype, 65, 64, (1000, 0, 2047, 513), heads="gqa", paged=True, L_cache=-(-2112 // page) * page,
                page=page, D=128, Dv=128, seed=page)
    run_and_check(case, True, "emulator", num_splits=num_splits)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES[:3], ids=DTYPE_IDS[:3])
def test_emulator_larger_cache(dtype):
    case = Case(dtype, 65, 64, (130, 0, 257), heads="gqa", L_cache=512, D=64, Dv=64, seed=3)
    run_and_check(case, True, "emulator")


# -- GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@requires_gpu
def test_cuda_float64_contiguous_cache():
    run_and_check(Case(np.float64, 3, 2, (5, 0, 33), heads="gqa", seed=13), True, "cuda")


@pytest.mark.gpu
@requires_gpu
def test_cuda_paged_float32_cache():
    """float32 pages on the SIMT forward (docs/kvcache.md; this test once expected a refusal, from the days of
    a tensor-core float32 default, and failed on an H200)."""
    run_and_check(Case(np.float32, 1, 1, (5, 0, 33), paged=True), True, "cuda")


def test_precision_is_validated_and_ieee():
    """precision= as on every function: a precision that does not apply to the dtype is refused
    before anything is written; float32 accepts each one and computes in IEEE arithmetic."""
    case = Case(np.float16, 1, 1, (5, 0, 33))
    before = case.snapshot()
    with pytest.raises(ValueError, match="argument 'precision'='tf32' does not apply to float16"):
        fa.flash_attention_with_kvcache(*case.args(), **case.kwargs(), backend="emulator", precision="tf32")
    _assert_untouched(case, before, names=("k_cache", "v_cache"))
    results = []
    for precision in (None, "ieee", "tf32", "3xtf32"):
        case = Case(np.float32, 1, 1, (5, 0, 33), heads="gqa", paged=True, seed=3)
        results.append(fa.flash_attention_with_kvcache(*case.args(), **case.kwargs(), backend="emulator",
                                                       precision=precision))
    assert all(np.array_equal(results[0], r) for r in results[1:])
