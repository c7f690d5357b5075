"""The public API on the kernel backends: one body, run on the emulator (always) and on CUDA
(when CuPy sees a device). Kernel-level matrices live in test_cuda_forward/backward.py."""
import numpy as np
import pytest

import flasharray as fa
from flasharray._private.dtypes import bfloat16
from flasharray.testing import assert_attention_close

from conftest import make_qkv, requires_gpu

BACKENDS = [
    pytest.param("emulator", id="emulator"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, requires_gpu]),
]


def to_backend(x, backend):
    if backend == "cuda":
        import cupy
        return cupy.asarray(x)
    return x


def to_host(x):
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else x


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,causal", [(np.float16, True), (bfloat16, False), (np.float32, True),
                                          (np.float64, False)], ids=["fp16-causal", "bf16", "fp32-causal", "fp64"])
def test_forward_backward_gqa_transposed(backend, dtype, causal):
    """GQA by broadcasting, BSHD-transposed views, Lq != Lk, D not a multiple of 16, Dv != D."""
    q, k, v = make_qkv((1, 2, 2, 33, 40), (1, 2, 1, 50, 40), (1, 2, 1, 50, 24), dtype, seed=1, layout="bshd")
    before = [x.copy() for x in (q, k, v)]
    dq_, dk_, dv_ = (to_backend(x, backend) for x in (q, k, v))
    out, lse = fa.flash_attention_forward(dq_, dk_, dv_, causal=causal, backend=backend)
    dout = np.random.default_rng(2).standard_normal(out.shape).astype(dtype)
    grads = fa.flash_attention_backward(to_backend(dout, backend), dq_, dk_, dv_, out, lse,
                                        causal=causal, backend=backend)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert all(g.dtype == q.dtype for g in grads) and out.dtype == q.dtype
    assert_attention_close(to_host(out), q, k, v, causal=causal, lse=to_host(lse), dout=dout,
                           grads=[to_host(g) for g in grads])
    for x, x0 in zip((q, k, v), before):
        np.testing.assert_array_equal(x, x0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_vjp_round_trip(backend):
    q, k, v = make_qkv((2, 20, 32), (2, 45, 32), (2, 45, 32), np.float32, seed=3)
    args = [to_backend(x, backend) for x in (q, k, v)]
    out, vjp = fa.flash_attention_vjp(*args, causal=True, scale=0.2, backend=backend)
    dout = np.random.default_rng(4).standard_normal(out.shape).astype(np.float32)
    grads = [to_host(g) for g in vjp(to_backend(dout, backend))]
    out2, lse2 = fa.flash_attention_forward(*args, causal=True, scale=0.2, backend=backend)
    np.testing.assert_array_equal(to_host(out), to_host(out2))
    direct = fa.flash_attention_backward(to_backend(dout, backend), *args, out2, lse2, causal=True,
                                         scale=0.2, backend=backend)
    for g, e in zip(grads, direct):
        np.testing.assert_array_equal(g, to_host(e))  # deterministic by default
    assert_attention_close(to_host(out), q, k, v, causal=True, scale=0.2, dout=dout, grads=grads)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows_and_empty_sequences(backend):
    q, k, v = make_qkv((2, 30, 16), (2, 9, 16), (2, 9, 16), np.float16, seed=5)
    args = [to_backend(x, backend) for x in (q, k, v)]
    out, lse = fa.flash_attention_forward(*args, causal=True, backend=backend)
    out, lse = to_host(out), to_host(lse)
    assert np.all(out[:, :21] == 0) and np.all(np.isneginf(lse[:, :21]))
    dout = np.ones(out.shape, np.float16)
    dq, dk, dv = (to_host(g) for g in fa.flash_attention_backward(
        to_backend(dout, backend), *args, to_backend(out, backend), to_backend(lse, backend),
        causal=True, backend=backend))
    assert np.all(dq[:, :21] == 0)
    assert_attention_close(out, q, k, v, causal=True, lse=lse, dout=dout, grads=(dq, dk, dv))
    empty = fa.flash_attention(args[0], args[1][:, :0], args[2][:, :0], backend=backend)
    assert empty.shape == (2, 30, 16) and not to_host(empty).any()


def test_emulator_schedules_give_identical_results():
    q, k, v = make_qkv((1, 40, 32), (1, 70, 32), (1, 70, 32), np.float16, seed=6)
    results = []
    for schedule, seed in (("forward", 0), ("reverse", 0), ("random", 1), ("random", 7)):
        out, lse = fa.flash_attention_forward(q, k, v, causal=True, backend="emulator",
                                              schedule=schedule, schedule_seed=seed)
        grads = fa.flash_attention_backward(np.ones_like(out), q, k, v, out, lse, causal=True,
                                            backend="emulator", schedule=schedule, schedule_seed=seed)
        results.append((out, lse) + tuple(grads))
    for r in results[1:]:
        for a, b in zip(results[0], r):
            np.testing.assert_array_equal(a, b)


def test_emulator_rejects_cupy_style_misuse():
    q, k, v = make_qkv((5, 8), (5, 8), (5, 8), np.float32)
    with pytest.raises(TypeError, match="schedule"):
        fa.flash_attention(q, k, v, backend="cpu", schedule="random")
    with pytest.raises(TypeError, match="unexpected keyword"):
        fa.flash_attention(q, k, v, backend="emulator", workers=3)


def test_bfloat16_on_turing_falls_back_to_simt_forward_and_backward():
    """sm_75 has no bf16 tensor cores: both passes must choose the SIMT kernels by themselves."""
    from flasharray._private import cuda_backward, cuda_forward
    q, k, v = make_qkv((1, 21, 32), (1, 37, 32), (1, 37, 32), bfloat16, seed=8)
    out, lse = cuda_forward.forward(q, k, v, causal=True, scale=32 ** -0.5, batch_shape=(1,),
                                    device="emulator", arch="sm_75")
    dout = np.random.default_rng(9).standard_normal(out.shape).astype(bfloat16)
    grads = cuda_backward.backward(dout, q, k, v, out, lse, causal=True, scale=32 ** -0.5,
                                   batch_shape=(1,), device="emulator", arch="sm_75")
    assert cuda_backward.default_kernel(bfloat16, 75) == "simt"
    assert cuda_backward.default_kernel(bfloat16, 80) == "tc"
    assert cuda_backward.default_kernel(np.float16, 75) == "tc"
    assert_attention_close(out, q, k, v, causal=True, lse=lse, dout=dout, grads=grads)
