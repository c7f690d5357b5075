"""The extensions of docs/extensions.md on the Hopper wgmma backward (cuda_src/flash_bwd_sm90.cu, ``kExt``).

Every case runs the forward on the emulator (the mma.sync kernels), then
``cuda_backward.backward(..., kernel="wgmma", arch="sm_90", ext=...)`` and checks dq, dk, dv with the DESIGN.md
rule against ``flasharray.reference.attention_backward`` given the same keywords (``testing.check_attention``,
as tests/test_cuda_backward_extensions.py: with dropout the reference applies the same Philox mask). Each asserts
which dK/dV kernel ran (the warp-specialized TMA one, or the cp.async one with ``USE_TMA`` off and always with
lengths) and that its name ends in the kExt bits. Default: each feature alone and combinations (all six at
once), causal and not, Lq != Lk off the tiles, GQA, D 64 and 128, both dQ modes; the ordered mode bitwise under
permuted schedules; the gradients close to the mma.sync backward's on sm_80 (the same dropout bits); the refusals.
``-m slow``: a larger matrix.
"""
import numpy as np
import pytest

import flasharray as fa
from flasharray import testing as fa_testing
from flasharray._private import cuda_backward as cb
from flasharray._private import cuda_backward_sm90 as S
from flasharray._private import cuda_forward, extensions, launch
from flasharray._private.dtypes import bfloat16
from test_cuda_backward_extensions import features

BITS = cuda_forward.EXT_BITS
ALL = ("window", "alibi", "softcap", "seqlens", "block_mask", "dropout")


def kw_of(names, B, H, Lq, Lk, seed=1):
    """The extension keywords of ``names`` (test_cuda_backward_extensions.features: block size (16, 32))."""
    all_kw = features(B, H, Lq, Lk, np.random.default_rng(seed))
    out = {}
    for n in names:
        out.update(all_kw[n])
    return out


def problem(dtype, D, Lq, Lk, B=2, H=2, Hk=2, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, Lq, D)).astype(dtype)
    k = rng.standard_normal((B, Hk, Lk, D)).astype(dtype)
    v = rng.standard_normal((B, Hk, Lk, D)).astype(dtype)
    dout = rng.standard_normal((B, H, Lq, D)).astype(dtype)
    return q, k, v, dout


def backward(q, k, v, dout, out, lse, kw, *, causal, deterministic, **opts):
    """cuda_backward.backward with the keywords ``kw`` validated as the API does; (dq, dk, dv, counters)."""
    B, H, Lq, D = q.shape
    ext = extensions.from_options(kw, kind="numpy", batch_shape=(B, H), Lq=Lq, Lk=k.shape[-2], acc=np.float32)
    return cb.backward(dout, q, k, v, out, lse, causal=causal, scale=1.0 / np.sqrt(D), batch_shape=(B, H),
                       device="emulator", deterministic=deterministic, ext=ext, return_counters=True, **opts)


def run_case(dtype, names, *, causal, deterministic, D=64, Lq=37, Lk=150, H=2, Hk=2, tma=True, **opts):
    """Forward (emulator) + the wgmma backward; checked against the reference. Returns the grads and the
    dK/dV launch's name."""
    q, k, v, dout = problem(dtype, D, Lq, Lk, H=H, Hk=Hk)
    kw = kw_of(names, 2, H, Lq, Lk)
    out, lse = fa.flash_attention_forward(q, k, v, causal=causal, backend="emulator", **kw)
    res = backward(q, k, v, dout, out, lse, kw, causal=causal, deterministic=deterministic, kernel="wgmma",
                   arch="sm_90", **opts)
    grads, counters = res[:3], res[3]
    name = [n for n, _ in counters if n.startswith((S.KERNEL, S.WS_KERNEL))]
    assert len(name) == 1, [n for n, _ in counters]
    bits = sum(BITS[n if n != "seqlens" else "seqlens"] for n in names)
    assert name[0].endswith(", %d>" % bits), name[0]
    ws = tma and S.ws_takes(bits)
    assert name[0].startswith(S.WS_KERNEL if ws else S.KERNEL + "<"), name[0]
    report = fa_testing.check_attention(out, q, k, v, causal=causal, dout=dout, grads=grads, **kw)
    assert report.passed, str(report)
    return grads, name[0]


def with_cp_async(monkeypatch):
    monkeypatch.setattr(S, "USE_TMA", False)
    launch._clear_plans()


SINGLE = [((f,), np.float16, c, det) for f, c, det in
          [("window", True, False), ("alibi", False, True), ("softcap", True, True), ("seqlens", False, True),
           ("block_mask", True, False), ("dropout", False, True)]]
COMBOS = [
    (("window", "block_mask", "alibi"), bfloat16, False, False),
    (("softcap", "dropout", "seqlens"), np.float16, True, True),
    (ALL, np.float16, True, False),
]


def _id(case):
    names, dt, causal, det = case
    return "%s-%s%s-%s" % ("+".join(names), np.dtype(dt).name, "-causal" if causal else "",
                           "ordered" if det else "atomic")


@pytest.mark.parametrize("case", SINGLE + COMBOS, ids=_id)
def test_extension_ws_kernel(case):
    names, dt, causal, det = case
    run_case(dt, names, causal=causal, deterministic=det)


@pytest.mark.parametrize("case", [SINGLE[0], SINGLE[5], COMBOS[0], COMBOS[2]], ids=_id)
def test_extension_cp_async_kernel(case, monkeypatch):
    names, dt, causal, det = case
    with_cp_async(monkeypatch)
    run_case(dt, names, causal=causal, deterministic=det, tma=False)
