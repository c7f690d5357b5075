"""Split-KV ("flash-decoding") and GQA packing of the tensor-core forward (issue 10 §2).

Split-KV: ``flash_fwd_kernel<..., Is_split = true>`` writes per-split fp32 partial O and LSE to a
workspace and ``flash_fwd_combine.cu`` merges them by log-sum-exp. Every forced split count
(1, 2, 3, more than the key tiles) meets the DESIGN.md rule, causal or not, Lq = 1 and Lq > 1,
fp16 and bf16, on the emulator; rows that see no key in a split (or at all) stay NaN-free.
The automatic count follows ``tiles.num_splits_heuristic`` with the SM count of the device (the
emulator pretends ``tiles.EMULATOR_SM_COUNT``). The SIMT kernels (fp32, fp64) do not split:
``num_splits > 1`` there is a NotImplementedError, ``None`` runs one split.

GQA packing: the G query heads sharing a K/V head (broadcast batch dim) become the rows of one
block, so K and V are read once per KV head: the emulator's per-array byte counters show exactly
one pass over K and V per KV head for Lq = 1, against G passes unpacked. Causal packing with
Lq > 1 (``Is_packed``: each row masked at its query position) is exact across query tiles that
span two heads.
"""
import dataclasses

import numpy as np
import pytest

import flasharray as fa
from flasharray._private import cuda_forward, tiles
from flasharray._private.dtypes import bfloat16
from flasharray.testing import assert_attention_close

DTYPES = {"fp16": np.float16, "bf16": bfloat16, "fp32": np.float32, "fp64": np.float64}


def qkv(dtype, shape_q, shape_k, Dv=None, seed=0):
    rng = np.random.default_rng(seed)
    Dv = shape_k[-1] if Dv is None else Dv
    q = rng.standard_normal(shape_q).astype(dtype)
    k = rng.standard_normal(shape_k).astype(dtype)
    v = rng.standard_normal(shape_k[:-1] + (Dv,)).astype(dtype)
    return q, k, v


def run(q, k, v, causal, counters=None, **opts):
    batch_shape = tuple(np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    return cuda_forward.forward(q, k, v, causal=causal, scale=q.shape[-1] ** -0.5, batch_shape=batch_shape,
                                device="emulator", counters=counters, **opts)


def the_plan(q, k, v, causal, **opts):
    batch_shape = tuple(np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    return cuda_forward.plan(q, k, v, causal=causal, scale=q.shape[-1] ** -0.5, batch_shape=batch_shape,
                             device="emulator", **opts)


def check(q, k, v, causal, **opts):
    q0, k0, v0 = q.copy(), k.copy(), v.copy()
    out, lse = run(q, k, v, causal, **opts)
    assert not np.isnan(out.astype(np.float32)).any() and not np.isnan(lse).any()
    assert_attention_close(out, q, k, v, causal=causal, lse=lse)
    for a, b in ((q, q0), (k, k0), (v, v0)):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    return out, lse


# ---- forced split counts ---------------------------------------------------------------------------
# d = 64: Bc = 64, so Lk = 300 has 5 key tiles and Lk = 200 has 4; 7 and 9 splits leave empty splits.
CASES = [(1, 300, 7), (70, 200, 9)]


@pytest.mark.parametrize("dt", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("Lq,Lk,many", CASES, ids=["decode", "prefill"])
def test_forced_split_counts(dt, causal, Lq, Lk, many):
    q, k, v = qkv(DTYPES[dt], (1, 2, Lq, 64), (1, 2, Lk, 64))
    outs = {}
    for n in (1, 2, 3, many):
        p = the_plan(q, k, v, causal, num_splits=n)
        assert p.num_splits == n
        outs[n] = check(q, k, v, causal, num_splits=n)
    # one split is the dense kernel itself; more splits agree with it to fp16/bf16 rounding
    ref = outs[1][0].astype(np.float32)
    for n in (2, 3, many):
        np.testing.assert_allclose(outs[n][0].astype(np.float32), ref, atol=2e-2, rtol=0)
        np.testing.assert_allclose(outs[n][1], outs[1][1], atol=1e-4, rtol=1e-5)


def test_split_awkward_sizes_dv_and_layout():
    """D = 59 packed (unaligned rows: element loads), Dv != D, BSHD views, odd lengths."""
    rng = np.random.default_rng(4)
    q = np.swapaxes(rng.standard_normal((2, 3, 3, 59)).astype(np.float16), 1, 2)   # (2, 3, 3, 59) view
    k = np.swapaxes(rng.standard_normal((2, 257, 3, 59)).astype(np.float16), 1, 2)
    v = np.swapaxes(rng.standard_normal((2, 257, 3, 40)).astype(np.float16), 1, 2)
    for n in (2, 5):
        check(q, k, v, True, num_splits=n)
        check(q, k, v, False, num_splits=n)


@pytest.mark.parametrize("limit", [None, 3])
def test_split_many_batch_dims_and_host_loops(monkeypatch, limit):
    """Five batch dims that do not all merge (host loops over the outer ones), broadcasting, and
    with the grid cap shrunk (chunked launches): every launch finds its slab of the workspace."""
    from flasharray._private import launch
    if limit is not None:
        monkeypatch.setattr(launch, "MAX_GRID_YZ", limit)
    rng = np.random.default_rng(12)
    q = rng.standard_normal((2, 3, 2, 2, 2, 1, 32)).astype(np.float16)
    k = rng.standard_normal((2, 1, 2, 1, 2, 300, 32)).astype(np.float16)
    v = rng.standard_normal((1, 3, 2, 1, 2, 300, 32)).astype(np.float16)
    c = []
    check(q, k, v, False, counters=c, num_splits=3)
    assert len(c) > 2


def test_io_tiles_split_only_when_forced():
    q, k, v = qkv(np.float16, (1, 1, 1, 64), (1, 1, 2000, 64))
    assert the_plan(q, k, v, False, block_m=384).num_splits == 1
    assert the_plan(q, k, v, False).num_splits > 1
    check(q, k, v, True, block_m=384, num_splits=2)


def test_rows_without_keys_stay_nan_free():
    """Causal Lq > Lk: the first Lq − Lk rows see no key in any split (out 0, lse −inf); the other
    rows see no key in the later splits (weight 0 in the combine)."""
    q, k, v = qkv(np.float16, (1, 2, 100, 32), (1, 2, 70, 32))
    for n in (2, 3, 6):
        out, lse = check(q, k, v, True, num_splits=n)
        assert np.all(out[..., :30, :] == 0) and np.all(np.isneginf(lse[..., :30]))
        assert np.all(np.isfinite(lse[..., 30:]))


def test_split_schedules_identical():
    """Reverse and random fiber schedules give bit-identical split results (barriers complete)."""
    q, k, v = qkv(np.float16, (1, 2, 33, 64), (1, 2, 230, 64))
    ref = run(q, k, v, True, num_splits=3)
    for schedule, seed in (("reverse", 0), ("random", 3)):
        got = run(q, k, v, True, num_splits=3, schedule=schedule, seed=seed)
        np.testing.assert_array_equal(got[0], ref[0])
        np.testing.assert_array_equal(got[1], ref[1])


def test_split_single_buffered_sm75_tile():
    """The sm_75 table (single-buffered K/V, Bc = 16 at d = 256) splits too."""
    q, k, v = qkv(np.float16, (1, 1, 1, 256), (1, 1, 100, 256))
    assert cuda_forward.kernel_for(np.float16, 256, arch=75).stages == 1
    check(q, k, v, False, num_splits=3, arch=75)


# ---- the automatic count ------------------------------------------------------------------------------

def test_heuristic_values():
    h = tiles.num_splits_heuristic
    assert h(32, 132, 512) == 4          # B 1, H 32 decoding on an H100: 128 blocks, 97% of one wave
    assert h(48, 108, 100) == 9          # 4 full waves; 2 splits (96 of 108 SMs, 89%) is below 95% of it
    assert h(32, 264, 512) == 8          # 256 of 264 slots (97%); 7 (85%) was FlashAttention-2's 85% rule's
    assert h(512, 132, 64) == 1          # already > 80% busy
    assert h(106, 132, 64) == 1 and h(105, 132, 64) > 1
    assert h(4, 132, 1) == 1             # one key tile: nothing to split
    assert h(1, 132, 3) == 3             # never more splits than key tiles
    assert h(1, 132, 10 ** 6) <= tiles.MAX_SPLITS
    for blocks, sms, n in [(7, 108, 40), (20, 132, 33), (2, 40, 300)]:
        s = h(blocks, sms, n)
        assert 1 <= s <= min(n, tiles.MAX_SPLITS)
        counts = [c for c in range(1, min(n, sms, tiles.MAX_SPLITS) + 1)   # those with fewer tiles per split
                  if c == 1 or -(-n // c) < -(-n // (c - 1))]
        best = max(tiles.wave_efficiency(blocks * c, sms) for c in counts)
        assert tiles.wave_efficiency(blocks * s, sms) >= tiles.SPLIT_EFFICIENCY * best


def test_auto_count_keeps_256_keys_per_split():
    a = tiles.auto_num_splits
    assert a(32, 132, 32768, 64) == 4                  # B 1, H 32, 32k cache (gpu/README.md's first row)
    assert a(1, 132, 256, 64) == 1 and a(1, 132, 257, 64) == 2
    assert a(1, 132, 1000, 16) == 4                    # ceil(1000 / 256)
    assert 0.8 * 132 <= a(1, 132, 10 ** 6, 64) <= tiles.MAX_SPLITS   # one block: (almost) every SM


def test_split_slots_count_two_blocks_per_sm_where_they_fit():
    """Decoding sizes its splits for the blocks that share an SM (FlashAttention-2: 2 x the SMs): the
    128-thread tensor-core tiles whose shared memory fits twice; one per SM otherwise."""
    def decode_plan(arch, D, Lk=32768, H=32):
        q, k = np.zeros((1, H, 1, D), np.float16), np.zeros((1, H, Lk, D), np.float16)
        return the_plan(q, k, k, False, arch=arch)
    p = decode_plan(90, 128)
    assert p.tile.n_threads == 128 and 2 * (p.tile.smem + 1024) <= 228 * 1024
    assert tiles.split_slots(p.tile, 90, 132) == 264
    assert p.num_splits == tiles.auto_num_splits(32, 264, 32768, p.tile.block_n) == 8  # 256 blocks, was 4 (128)
    p86 = decode_plan(86, 128)
    assert 2 * (p86.tile.smem + 1024) > 100 * 1024 and tiles.split_slots(p86.tile, 86, 72) == 72
    eight_warps = dataclasses.replace(p.tile, threads_m=8)  # 256 threads: their registers fill the register file
    assert tiles.split_slots(eight_warps, 90, 132) == 132


def test_emulator_sm_counts():
    assert tiles.emulator_sm_count(80) == 108 and tiles.emulator_sm_count("sm_90") == 132
    assert tiles.emulator_sm_count(75) == 40 and tiles.emulator_sm_count(100) == 132


@pytest.mark.parametrize("arch", [80, 90])
def test_auto_split_follows_the_heuristic(arch):
    """Decoding 2 heads over 2000 keys: far fewer blocks than SMs, so the key range is split."""
    q, k, v = qkv(np.float16, (1, 2, 1, 64), (1, 2, 2000, 64))
    p = the_plan(q, k, v, False, arch=arch)
    expect = tiles.auto_num_splits(2, tiles.split_slots(p.tile, arch, tiles.emulator_sm_count(arch)), 2000,
                                   p.tile.block_n)
    assert p.num_splits == expect > 1 and expect <= -(-2000 // tiles.MIN_KEYS_PER_SPLIT)
    assert p.sm_count == tiles.emulator_sm_count(arch)
    check(q, k, v, False, arch=arch)
    assert p.blocks == 2 * expect
    # a full GPU's worth of blocks, or too few keys: no split
    q2, k2, v2 = qkv(np.float16, (1, 2, 7000, 16), (1, 2, 40, 16))
    assert the_plan(q2, k2, v2, True, arch=arch).num_splits == 1
    q3, k3, v3 = qkv(np.float16, (1, 1, 1, 64), (1, 1, tiles.MIN_KEYS_PER_SPLIT, 64))
    assert the_plan(q3, k3, v3, False, arch=arch).num_splits == 1


@pytest.mark.parametrize("dt", ["fp32", "fp64"])
def test_simt_kernels_do_not_split(dt):
    q, k, v = qkv(DTYPES[dt], (1, 2, 1, 32), (1, 2, 500, 32))
    assert the_plan(q, k, v, False).num_splits == 1          # auto: the SIMT kernel runs whole
    check(q, k, v, False, num_splits=1)
    with pytest.raises(NotImplementedError, match="num_splits"):
        run(q, k, v, False, num_splits=2)
    with pytest.raises(NotImplementedError, match="float16"):
        run(q, k, v, False, num_splits=2)


@pytest.mark.parametrize("bad,err", [(0, ValueError), (-1, ValueError), (tiles.MAX_FORCED_SPLITS + 1, ValueError),
                                     (1.5, TypeError), (True, TypeError), ("2", TypeError)])
def test_num_splits_validation(bad, err):
    q, k, v = qkv(np.float16, (1, 1, 1, 16), (1, 1, 20, 16))
    with pytest.raises(err, match="num_splits"):
        run(q, k, v, False, num_splits=bad)


# ---- GQA packing ---------------------------------------------------------------------------------

def kv_read_bytes(counters):
    """Bytes read from k (argument 1) and v (argument 2) by the forward kernel launches (the ones
    with mma instructions; the combine kernel's arguments 1 and 2 are other arrays)."""
    total = 0
    for c in counters:
        if not c.mma:
            continue
        for i in (1, 2):
            if i in c.buffers:
                total += c.buffers[i].read_bytes
    return total


@pytest.mark.parametrize("num_splits", [1, 3])
def test_gqa_packing_reads_kv_once_per_kv_head(num_splits):
    """Lq = 1, q (B, Hkv, G, 1, D) against k, v (B, Hkv, 1, Lk, D): packed, each KV head's K and V
    are read exactly once (B·Hkv·Lk·(D + Dv) elements); unpacked, once per query head (G times)."""
    B, Hkv, G, Lk, D, Dv = 2, 2, 4, 300, 64, 48
    q, k, v = qkv(np.float16, (B, Hkv, G, 1, D), (B, Hkv, 1, Lk, D), Dv=Dv)
    one_pass = B * Hkv * Lk * (D + Dv) * 2
    packed, unpacked = [], []
    out_p, lse_p = check(q, k, v, False, counters=packed, num_splits=num_splits)
    out_u, lse_u = check(q, k, v, False, counters=unpacked, num_splits=num_splits, pack_gqa=False)
    assert the_plan(q, k, v, False, num_splits=num_splits).gqa_group == G
    assert the_plan(q, k, v, False, num_splits=num_splits, pack_gqa=False).gqa_group == 1
    assert kv_read_bytes(packed) == one_pass
    assert kv_read_bytes(unpacked) == G * one_pass
    np.testing.assert_array_equal(out_p, out_u)   # same rows, same key order: the same arithmetic
    np.testing.assert_array_equal(lse_p, lse_u)


def test_gqa_packing_decode_causal_and_layouts():
    """Lq = 1 causal is the same mask as non-causal (the one query sees every key): packed. BSHD
    views of q (row stride H·D) and MQA (one KV head) pack too."""
    rng = np.random.default_rng(9)
    B, Hkv, G, Lk, D = 2, 2, 3, 150, 32
    # q as a view of (B, 1, Hkv, G, D) memory: the G stride is D, not Lq·D
    q = rng.standard_normal((B, 1, Hkv, G, D)).astype(np.float16).transpose(0, 2, 3, 1, 4)
    k, v = (rng.standard_normal((B, Hkv, 1, Lk, D)).astype(np.float16) for _ in range(2))
    assert the_plan(q, k, v, True).gqa_group == G
    c = []
    check(q, k, v, True, counters=c)
    assert kv_read_bytes(c) == B * Hkv * Lk * 2 * D * 2
    qm, km, vm = qkv(bfloat16, (2, 8, 1, 64), (2, 1, 90, 64))    # MQA: 8 heads, one KV head
    assert the_plan(qm, km, vm, False).gqa_group == 8
    check(qm, km, vm, False)


def test_gqa_packing_prefill_rules():
    """1 < Lq < Br: packed where the G and Lq dims of q merge into one row stride; causal on the
    tensor-core kernel (Is_packed: row g·Lq + i masked at position i), not on the SIMT ones."""
    q, k, v = qkv(np.float16, (1, 2, 4, 5, 64), (1, 2, 1, 80, 64))
    assert the_plan(q, k, v, False).gqa_group == 4
    assert the_plan(q, k, v, True).gqa_group == 4
    check(q, k, v, False)
    check(q, k, v, True)
    qt = np.ascontiguousarray(np.swapaxes(q, 2, 3)).swapaxes(2, 3)   # (G, Lq) strides do not merge
    assert the_plan(qt, k, v, False).gqa_group == 1
    check(qt, k, v, False)
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    assert the_plan(q32, k32, v32, True).gqa_group == 1 and the_plan(q32, k32, v32, False).gqa_group == 4
    check(q32, k32, v32, True)


@pytest.mark.parametrize("dt", ["fp16", "bf16"])
@pytest.mark.parametrize("G,Lq,Lk", [(4, 7, 300), (3, 50, 40), (8, 20, 20), (5, 63, 130)])
def test_gqa_packing_causal_rows_span_heads(dt, G, Lq, Lk):
    """Causal packing with query tiles that hold the end of one head and the start of the next
    (Br = 128 at d = 64: 7·4, 50·3, 20·8, 63·5 rows), Lq > Lk (rows with no key), Lk < Bc; split
    or not; K and V read once per KV head and query tile."""
    q, k, v = qkv(DTYPES[dt], (2, 2, G, Lq, 64), (2, 2, 1, Lk, 64))
    assert the_plan(q, k, v, True).gqa_group == G
    out_u, lse_u = check(q, k, v, True, pack_gqa=False, num_splits=1)
    for n in (1, 3):
        c = []
        out_p, lse_p = check(q, k, v, True, num_splits=n, counters=c)
        # every packed query tile holds some head's last position, which sees all Lk keys
        assert kv_read_bytes(c) == -(-G * Lq // 128) * 2 * 2 * Lk * 64 * 2 * 2
        if n == 1:   # same rows, same key order per row: the same arithmetic as unpacked
            np.testing.assert_array_equal(out_p, out_u)
            np.testing.assert_array_equal(lse_p, lse_u)


# ---- public API ----------------------------------------------------------------------------------

def test_public_option():
    q, k, v = qkv(np.float16, (1, 2, 4, 1, 64), (1, 2, 1, 400, 64))
    out, lse = fa.flash_attention(q, k, v, backend="emulator", num_splits=3, return_lse=True)
    assert_attention_close(out, q, k, v, causal=False, lse=lse)
    out2 = fa.flash_attention_forward(q, k, v, backend="emulator", num_splits=None)[0]
    assert_attention_close(out2, q, k, v, causal=False)
    out3, vjp = fa.flash_attention_vjp(q, k, v, backend="emulator", num_splits=2)   # forward-only option
    dq, dk, dv = vjp(np.ones_like(out3))
    assert dq.shape == q.shape and dk.shape == k.shape
    with pytest.raises(TypeError, match="num_splits"):
        fa.flash_attention_backward(out3, q, k, v, out3, lse, backend="emulator", num_splits=2)


def test_public_option_cpu_backend():
    """The cpu backend has no split: num_splits=None is accepted everywhere, a count is refused."""
    q, k, v = qkv(np.float32, (1, 1, 3, 16), (1, 1, 9, 16))
    fa.flash_attention(q, k, v, num_splits=None)
    with pytest.raises(TypeError, match="num_splits"):
        fa.flash_attention(q, k, v, num_splits=2)
    with pytest.raises(NotImplementedError, match="num_splits"):
        fa.flash_attention(q, k, v, backend="emulator", num_splits=2)   # fp32: SIMT kernel


def test_cupy_path_reads_the_sm_count(monkeypatch):
    """device="cuda" (a CuPy stand-in backed by the emulator): the split count comes from
    cupy.cuda.Device().attributes['MultiProcessorCount']."""
    import sys
    from flasharray._private import launch
    from test_cuda_forward import _fake_cupy
    log, arrays = [], []
    cupy = _fake_cupy(log, arrays)
    monkeypatch.setattr(cupy.cuda.Device, "attributes", {"MultiProcessorCount": 16})
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(launch.CupyLauncher, "_modules", {})
    monkeypatch.setattr(launch, "_launchers", {})
    q, k, v = qkv(np.float16, (1, 1, 2, 1, 64), (1, 1, 1, 1000, 64))
    arrays += [q, k, v]
    bs = q.shape[:-2]
    p = cuda_forward.plan(q, k, v, causal=False, scale=0.125, batch_shape=bs, device="cuda")
    assert p.sm_count == 16 and p.gqa_group == 2
    assert p.num_splits == tiles.auto_num_splits(1, tiles.split_slots(p.tile, 80, 16), 1000, p.tile.block_n) > 1
    out, lse = cuda_forward.forward(q, k, v, causal=False, scale=0.125, batch_shape=bs, device="cuda")
    assert_attention_close(out, q, k, v, causal=False, lse=lse, scale=0.125)
    assert any("flash_fwd_combine_kernel" in name for name, _, _ in log)
