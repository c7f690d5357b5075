"""flash_attention_varlen (packed sequences, cu_seqlens) against the reference run per sequence,
and against the padded reference call with seqlens (the specification's statement of it)."""
import numpy as np
import pytest

import flasharray as fa
from flasharray import reference
from flasharray._private.dtypes import ATOL
from flasharray.testing import _compare


def _packed(lens_q, lens_k, H, Hk, D, Dv, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = rng.standard_normal((cq[-1], H, D)).astype(dtype)
    k = rng.standard_normal((ck[-1], Hk, D)).astype(dtype)
    v = rng.standard_normal((ck[-1], Hk, Dv)).astype(dtype)
    return q, k, v, cq, ck


def _per_sequence(q, k, v, cq, ck, dout=None, dtype=None, **kw):
    """The reference on each sequence alone ((H, L, D) arrays, K/V repeated over the group)."""
    H, Hk = q.shape[1], k.shape[1]
    G = H // Hk
    outs, lses, dqs, dks, dvs = [], [], [], [], []
    for b in range(len(cq) - 1):
        qb = q[cq[b]:cq[b + 1]].transpose(1, 0, 2)
        kb, vb = (np.repeat(x[ck[b]:ck[b + 1]].transpose(1, 0, 2), G, axis=0) for x in (k, v))
        o, l = reference.attention(qb, kb, vb, return_lse=True, dtype=dtype, **kw)
        outs.append(o.transpose(1, 0, 2))
        lses.append(l)
        if dout is not None:
            dq, dk, dv = reference.attention_backward(dout[cq[b]:cq[b + 1]].transpose(1, 0, 2), qb, kb, vb,
                                                      dtype=dtype, **kw)
            dqs.append(dq.transpose(1, 0, 2))
            dks.append(dk.reshape(Hk, G, -1, dk.shape[-1]).sum(1).transpose(1, 0, 2))
            dvs.append(dv.reshape(Hk, G, -1, dv.shape[-1]).sum(1).transpose(1, 0, 2))
    result = [np.concatenate(outs), np.concatenate(lses, axis=1)]
    if dout is not None:
        result += [np.concatenate(dqs), np.concatenate(dks), np.concatenate(dvs)]
    return result


LENS = {
    "mixed": ([3, 17, 1, 30], [5, 17, 40, 2]),
    "empty_sequences": ([4, 0, 9, 6], [7, 3, 0, 6]),
    "one": ([33], [20]),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (3, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("lens", list(LENS))
def test_forward_backward_match_per_sequence_reference(lens, heads, causal):
    H, Hk = heads
    q, k, v, cq, ck = _packed(*LENS[lens], H, Hk, 16, 8)
    before = [x.copy() for x in (q, k, v, cq, ck)]
    out, lse = fa.flash_attention_varlen(q, k, v, cq, ck, causal=causal, scale=0.3, return_lse=True, backend="cpu")
    dout = np.random.default_rng(1).standard_normal(out.shape)
    ref_out, ref_lse, *ref_g = _per_sequence(q, k, v, cq, ck, dout, causal=causal, scale=0.3)
    assert out.shape == (cq[-1], H, 8) and lse.shape == (H, cq[-1])
    np.testing.assert_allclose(out, ref_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    np.testing.assert_allclose(lse[np.isfinite(ref_lse)], ref_lse[np.isfinite(ref_lse)], rtol=1e-12)
    grads = fa.flash_attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, causal=causal, scale=0.3,
                                               backend="cpu")
    for g, r, x in zip(grads, ref_g, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
        np.testing.assert_allclose(g, r, rtol=1e-9, atol=1e-11)
    for x, x0 in zip((q, k, v, cq, ck), before):
        np.testing.assert_array_equal(x, x0)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_low_precision_under_the_design_rule(dtype):
    q, k, v, cq, ck = _packed([50, 7, 64], [64, 30, 1], 4, 2, 32, 32, dtype=dtype, seed=2)
    out = fa.flash_attention_varlen(q, k, v, cq, ck, causal=True, backend="cpu")
    ref = _per_sequence(q, k, v, cq, ck, causal=True)[0]
    naive = _per_sequence(q, k, v, cq, ck, causal=True, dtype=dtype)[0]
    check = _compare("out", out, ref, naive, 2.0, ATOL[np.dtype(dtype)])
    assert check.passed, str(check)


def test_extensions_are_the_padded_call_with_seqlens():
    """Every keyword applies per sequence as in the padded (B, H, max_len) call (bh = b·H + h)."""
    lens_q, lens_k = [5, 0, 12, 9], [8, 4, 16, 3]
    H, Hk, D = 4, 2, 8
    q, k, v, cq, ck = _packed(lens_q, lens_k, H, Hk, D, 4, seed=3)
    Lq, Lk = max(lens_q), max(lens_k)
    kw = dict(dropout_p=0.25, seed=77, offset=5, window=(6, 2), softcap=3.0,
              alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4]), causal=True,
              block_mask=np.random.default_rng(4).random((4, H, 1, 1)) < 0.8, block_size=(16, 16))
    out, lse = fa.flash_attention_varlen(q, k, v, cq, ck, return_lse=True, backend="cpu", **kw)
    # the padded statement: (B, H, L, D) with K/V repeated over the group
    qp, kp, vp = np.zeros((4, H, Lq, D)), np.zeros((4, H, Lk, D)), np.zeros((4, H, Lk, 4))
    for b in range(4):
        qp[b, :, :lens_q[b]] = q[cq[b]:cq[b + 1]].transpose(1, 0, 2)
        kp[b, :, :lens_k[b]] = np.repeat(k[ck[b]:ck[b + 1]].transpose(1, 0, 2), 2, axis=0)
        vp[b, :, :lens_k[b]] = np.repeat(v[ck[b]:ck[b + 1]].transpose(1, 0, 2), 2, axis=0)
    sq, sk = np.array(lens_q, np.int32), np.array(lens_k, np.int32)
    ref, ref_lse = reference.attention(qp, kp, vp, return_lse=True, seqlens_q=sq, seqlens_k=sk, **kw)
    for b in range(4):
        np.testing.assert_allclose(out[cq[b]:cq[b + 1]], ref[b, :, :lens_q[b]].transpose(1, 0, 2), rtol=1e-10,
                                   atol=1e-12)
        np.testing.assert_allclose(lse[:, cq[b]:cq[b + 1]], ref_lse[b, :, :lens_q[b]], rtol=1e-12)
    dout = np.random.default_rng(5).standard_normal(out.shape)
    dq, dk, dv = fa.flash_attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, backend="cpu", **kw)
    doutp = np.zeros((4, H, Lq, 4))
    for b in range(4):
        doutp[b, :, :lens_q[b]] = dout[cq[b]:cq[b + 1]].transpose(1, 0, 2)
    rq, rk, rv = reference.attention_backward(doutp, qp, kp, vp, seqlens_q=sq, seqlens_k=sk, **kw)
    for b in range(4):
        np.testing.assert_allclose(dq[cq[b]:cq[b + 1]], rq[b, :, :lens_q[b]].transpose(1, 0, 2), rtol=1e-9,
                                   atol=1e-11)
        np.testing.assert_allclose(dk[ck[b]:ck[b + 1]], rk[b, :, :lens_k[b]].reshape(Hk, 2, lens_k[b], D).sum(1)
                                   .transpose(1, 0, 2), rtol=1e-9, atol=1e-11)
    assert not np.allclose(out, fa.flash_attention_varlen(q, k, v, cq, ck, backend="cpu", causal=True))


def test_no_sequences_and_all_empty():
    q, k, v, cq, ck = _packed([], [], 2, 1, 8, 4)
    out, lse = fa.flash_attention_varlen(q, k, v, cq, ck, return_lse=True)
    assert out.shape == (0, 2, 4) and lse.shape == (2, 0)
    q, k, v, cq, ck = _packed([0, 3], [2, 0], 2, 1, 8, 4)
    out, lse = fa.flash_attention_varlen(q, k, v, cq, ck, return_lse=True)
    assert np.all(out == 0) and np.all(np.isneginf(lse))        # sequence 1 has no keys
    dq, dk, dv = fa.flash_attention_varlen_backward(np.ones_like(out), q, k, v, out, lse, cq, ck)
    assert np.all(dq == 0) and np.all(dk == 0) and np.all(dv == 0) and dk.shape == k.shape


def test_emulator_matches_or_says_not_implemented():
    q, k, v, cq, ck = _packed([5, 20], [9, 20], 2, 1, 16, 16, dtype=np.float32, seed=6)
    try:
        out = fa.flash_attention_varlen(q, k, v, cq, ck, causal=True, backend="emulator")
    except NotImplementedError as e:
        assert "emulator" in str(e)
        return
    ref = _per_sequence(q, k, v, cq, ck, causal=True)[0]
    naive = _per_sequence(q, k, v, cq, ck, causal=True, dtype=np.float32)[0]
    check = _compare("out", out, ref, naive, 2.0, ATOL[np.dtype(np.float32)])
    assert check.passed, str(check)


Q, K, V, CQ, CK = _packed([3, 4], [5, 2], 4, 2, 8, 4, dtype=np.float32)
BAD = [
    (dict(cu_seqlens_q=CQ.astype(np.int64)), TypeError, ["cu_seqlens_q", "int32"]),
    (dict(cu_seqlens_k=CK.tolist()), TypeError, ["cu_seqlens_k", "list"]),
    (dict(cu_seqlens_q=np.array([1, 3, 7], np.int32)), ValueError, ["cu_seqlens_q", "[1, 3, 7]", "from 0"]),
    (dict(cu_seqlens_q=np.array([0, 5, 3, 7], np.int32)), ValueError, ["cu_seqlens_q", "[0, 5, 3, 7]"]),
    (dict(cu_seqlens_k=np.array([0, 5, 6], np.int32)), ValueError, ["cu_seqlens_k", "7", "[0, 5, 6]"]),
    (dict(cu_seqlens_k=np.array([0, 7], np.int32)), ValueError, ["cu_seqlens_q", "cu_seqlens_k", "(3,)", "(2,)"]),
    (dict(cu_seqlens_q=CQ[None]), ValueError, ["cu_seqlens_q", "1 dim"]),
    (dict(q=Q[:, :3]), ValueError, ["multiple", "(7, 3, 8)", "(7, 2, 8)"]),
    (dict(q=Q[None]), ValueError, ["'q'", "3 dims", "(1, 7, 4, 8)"]),
    (dict(v=V[:, :1]), ValueError, ["(7, 2, 8)", "(7, 1, 4)"]),
    (dict(k=K.astype(np.float64)), TypeError, ["float32", "float64"]),
    (dict(seqlens_q=np.array([3, 4], np.int32)), TypeError, ["seqlens_q", "cu_seqlens"]),
    (dict(alibi_slopes=np.ones(3, np.float32)), ValueError, ["alibi_slopes", "(3,)", "(2, 4)"]),
    (dict(window=(-3, 0)), ValueError, ["window", "(-3, 0)"]),
    (dict(dropout_p=0.5), ValueError, ["dropout_p=0.5", "seed"]),
]


@pytest.mark.parametrize("kwargs,exc,words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input(kwargs, exc, words):
    args = dict(q=Q, k=K, v=V, cu_seqlens_q=CQ, cu_seqlens_k=CK)
    args.update(kwargs)
    with pytest.raises(exc) as info:
        fa.flash_attention_varlen(**args)
    for w in words:
        assert w in str(info.value), "%r not in %r" % (w, str(info.value))


def test_backward_checks_its_extra_arguments():
    out, lse = fa.flash_attention_varlen(Q, K, V, CQ, CK, return_lse=True)
    with pytest.raises(ValueError, match=r"'lse'.*\(4, 7\).*\(7, 4\)"):
        fa.flash_attention_varlen_backward(out, Q, K, V, out, lse.T, CQ, CK)
    with pytest.raises(ValueError, match=r"'dout'.*\(7, 4, 4\).*\(7, 4, 3\)"):
        fa.flash_attention_varlen_backward(out[..., :3], Q, K, V, out, lse, CQ, CK)
    with pytest.raises(TypeError, match="seqlens_k"):
        fa.flash_attention_varlen_backward(out, Q, K, V, out, lse, CQ, CK, seqlens_k=CK[1:])


def test_public():
    assert "flash_attention_varlen" in fa.__all__ and "flash_attention_varlen_backward" in fa.__all__
