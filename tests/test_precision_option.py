"""Validation of the ``precision=`` option (flasharray/_private/precision.py, issue 12)."""
import ml_dtypes
import numpy as np
import pytest

from flasharray._private.precision import (FLOAT32_TC_DEFAULT, check_precision, check_precision_arch,
                                          effective_precision)

F16, BF16, F32, F64 = np.float16, ml_dtypes.bfloat16, np.float32, np.float64


@pytest.mark.parametrize("dtype,precision", [
    (F32, None), (F32, "ieee"), (F32, "tf32"), (F32, "3xtf32"),
    (F64, None), (F64, "ieee"), (F16, None), (BF16, None),
])
def test_accepted(dtype, precision):
    assert check_precision(precision, dtype) == precision
    assert check_precision(precision, np.dtype(dtype)) == precision


@pytest.mark.parametrize("bad", ["TF32", "fp32", "highest", "", "3xTF32", 32, True, ("tf32",)])
def test_unknown_value_names_the_argument(bad):
    with pytest.raises(ValueError, match=r"unknown precision .*argument 'precision' must be one of "
                                         r"'ieee', 'tf32', '3xtf32' or None"):
        check_precision(bad, F32)


@pytest.mark.parametrize("dtype,precision,choices", [
    (F16, "tf32", "None"), (BF16, "3xtf32", "None"), (F16, "ieee", "None"),
    (F64, "tf32", "'ieee' or None"), (F64, "3xtf32", "'ieee' or None"),
])
def test_precision_not_applying_to_the_dtype(dtype, precision, choices):
    name = np.dtype(dtype).name
    with pytest.raises(ValueError, match=r"argument 'precision'=%r does not apply to %s inputs; for %s use %s$"
                                         % (precision, name, name, choices)):
        check_precision(precision, dtype)


@pytest.mark.parametrize("cc", [75, (7, 5), 70])
@pytest.mark.parametrize("precision", ["tf32", "3xtf32"])
def test_tf32_without_tf32_tensor_cores(precision, cc):
    with pytest.raises(NotImplementedError, match=r"precision='%s' needs TF32 tensor cores \(sm_80 or newer\); "
                                                  r"this GPU is sm_7[05]" % precision):
        check_precision_arch(precision, cc)


@pytest.mark.parametrize("cc", [80, (8, 6), 90])
@pytest.mark.parametrize("precision", [None, "ieee", "tf32", "3xtf32"])
def test_arch_supported(precision, cc):
    check_precision_arch(precision, cc)


@pytest.mark.parametrize("precision", [None, "ieee"])
def test_ieee_and_default_run_everywhere(precision):
    check_precision_arch(precision, 75)


@pytest.mark.parametrize("cc,expected", [(80, None), ((8, 6), None), (89, None), (90, None), (75, None), ((7, 0), None)])
def test_float32_default_is_ieee(cc, expected):
    """float32's None runs IEEE (None) on every arch (3xtf32 missed the DESIGN.md rule on an H200:
    docs/precision.md, *Default*); explicit values and other dtypes pass through unchanged."""
    assert FLOAT32_TC_DEFAULT is None
    assert effective_precision(None, F32, cc) == expected
    assert effective_precision(None, np.dtype(F32), cc) == expected
    for precision in ("ieee", "tf32", "3xtf32"):
        assert effective_precision(precision, F32, cc) == precision
    for dtype in (F16, BF16, F64):
        assert effective_precision(None, dtype, cc) is None
    assert effective_precision("ieee", F64, cc) == "ieee"


@pytest.mark.parametrize("cc", [80, (8, 6), 89, 90])
def test_float32_forward_default_is_3xtf32_for_dense_calls_up_to_d128(cc):
    """The CUDA forward's float32 None on sm_80+: 3xtf32 for dense calls (no extensions, no KV cache) at D, Dv <=
    128 (it met the rule and ran 1.9x ieee on an H200); ieee above, with extensions or a KV cache, below sm_80,
    and for the backward (effective_precision); explicit values and other dtypes unchanged."""
    from flasharray._private.precision import FLOAT32_FWD_DEFAULT, effective_forward_precision
    assert FLOAT32_FWD_DEFAULT == "3xtf32"
    assert effective_forward_precision(None, F32, cc, 128, 128, dense=True) == "3xtf32"
    assert effective_forward_precision(None, F32, cc, 1, 64, dense=True) == "3xtf32"
    assert effective_forward_precision(None, F32, cc, 129, 64, dense=True) is None
    assert effective_forward_precision(None, F32, cc, 64, 256, dense=True) is None
    assert effective_forward_precision(None, F32, cc, 64, 64, dense=False) is None
    assert effective_forward_precision(None, F32, 75, 64, 64, dense=True) is None
    assert effective_precision(None, F32, cc) is None
    for precision in ("ieee", "tf32", "3xtf32"):
        assert effective_forward_precision(precision, F32, cc, 64, 64, dense=True) == precision
    for dtype in (F16, BF16, F64):
        assert effective_forward_precision(None, dtype, cc, 64, 64, dense=True) is None


# ---- the option on the public functions (api.py) ------------------------------------------------------

def _qkv(dtype, L=9, D=16):
    rng = np.random.default_rng(0)
    return [rng.standard_normal((2, L, D)).astype(dtype) for _ in range(3)]


def _public_calls(q, k, v, backend, precision):
    import flasharray as fa
    out, lse = fa.flash_attention_forward(q, k, v, backend=backend, precision=precision)
    yield out
    yield fa.flash_attention(q, k, v, backend=backend, precision=precision)
    yield fa.flash_attention_backward(out, q, k, v, out, lse, backend=backend, precision=precision)[0]
    out2, vjp = fa.flash_attention_vjp(q, k, v, backend=backend, precision=precision)
    yield vjp(out2)[0]


@pytest.mark.parametrize("backend", ["cpu", "emulator"])
@pytest.mark.parametrize("dtype,precision", [(F16, "tf32"), (BF16, "ieee"), (F64, "3xtf32"), (F32, "fast")])
def test_every_public_function_validates(backend, dtype, precision):
    q, k, v = _qkv(dtype)
    import flasharray as fa
    out, lse = fa.flash_attention_forward(q, k, v, backend=backend)
    calls = [lambda: fa.flash_attention_forward(q, k, v, backend=backend, precision=precision),
             lambda: fa.flash_attention(q, k, v, backend=backend, precision=precision),
             lambda: fa.flash_attention_backward(out, q, k, v, out, lse, backend=backend, precision=precision),
             lambda: fa.flash_attention_vjp(q, k, v, backend=backend, precision=precision)]
    for call in calls:
        with pytest.raises(ValueError, match="precision"):
            call()


@pytest.mark.parametrize("backend", ["cpu", "emulator"])
@pytest.mark.parametrize("precision", [None, "ieee", "tf32", "3xtf32"])
def test_every_public_function_accepts_float32(backend, precision):
    q, k, v = _qkv(F32)
    for x in _public_calls(q, k, v, backend, precision):
        assert x.dtype == F32 and np.all(np.isfinite(x))


@pytest.mark.parametrize("precision", [None, "ieee"])
def test_float64_accepts_ieee(precision):
    q, k, v = _qkv(F64)
    for backend in ("cpu", "emulator"):
        for x in _public_calls(q, k, v, backend, precision):
            assert x.dtype == F64


def test_backward_precision_changes_the_kernel():
    """float32 on sm_80+ (the emulator's sm_80): the default is "ieee" (bitwise the same gradients);
    "3xtf32" and "tf32" run the TF32 backward (different bits, within their accuracy); the cached call
    keys on it."""
    import flasharray as fa
    q, k, v = _qkv(F32)
    out, lse = fa.flash_attention_forward(q, k, v, backend="emulator", precision="ieee")
    ref = fa.flash_attention_backward(out, q, k, v, out, lse, backend="emulator")
    ieee = fa.flash_attention_backward(out, q, k, v, out, lse, backend="emulator", precision="ieee")
    for a, b in zip(ieee, ref):
        np.testing.assert_array_equal(a, b)
    for precision in ("tf32", "3xtf32"):
        got = fa.flash_attention_backward(out, q, k, v, out, lse, backend="emulator", precision=precision)
        assert max(np.abs(a - b).max() for a, b in zip(got, ref)) > 0
        for a, b in zip(got, ref):
            np.testing.assert_allclose(a, b, rtol=0, atol=5e-2 * np.abs(b).max())


def test_forward_precision_changes_the_kernel():
    """tf32 and 3xtf32 differ from ieee (the TF32 kernel ran); the forward's default is 3xtf32 on sm_80 (the
    emulator's: FLOAT32_FWD_DEFAULT, a dense call at D 32) and ieee on sm_75; the cached call signature keys on
    precision."""
    import flasharray as fa
    from flasharray._private import cuda_forward
    q, k, v = _qkv(F32, L=33, D=32)
    ieee = fa.flash_attention(q, k, v, backend="emulator", precision="ieee")
    tf32 = fa.flash_attention(q, k, v, backend="emulator", precision="tf32")
    x3 = fa.flash_attention(q, k, v, backend="emulator", precision="3xtf32")
    assert np.abs(ieee - tf32).max() > 1e-5 and np.abs(ieee - x3).max() > 0
    np.testing.assert_array_equal(fa.flash_attention(q, k, v, backend="emulator"), x3)  # default: 3xtf32
    kw = dict(causal=False, scale=32 ** -0.5, batch_shape=q.shape[:-2], device="emulator", arch="sm_75")
    on75 = cuda_forward.forward(q, k, v, **kw)[0]
    np.testing.assert_array_equal(on75, cuda_forward.forward(q, k, v, precision="ieee", **kw)[0])


def test_varlen_accepts_precision():
    """The varlen forward passes precision on: lengths run on the TF32 kernel with "3xtf32" (other
    bits than the default, ieee: bitwise equal to an explicit "ieee")."""
    import flasharray as fa
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((10, 2, 16)).astype(F32) for _ in range(3))
    cu = np.array([0, 4, 10], np.int32)
    a = fa.flash_attention_varlen(q, k, v, cu, cu, backend="emulator", precision="3xtf32")
    b = fa.flash_attention_varlen(q, k, v, cu, cu, backend="emulator")
    c = fa.flash_attention_varlen(q, k, v, cu, cu, backend="emulator", precision="ieee")
    np.testing.assert_array_equal(b, c)
    assert np.abs(a - b).max() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("D,causal,gqa", [(64, True, False), (128, False, True), (96, True, True)])
def test_float32_default_forward_on_the_gpu(D, causal, gqa):
    """On an sm_80+ GPU float32's default forward (dense, D <= 128) runs the 3xtf32 kernel and meets the
    DESIGN.md rule, its gradients (the default ieee backward from its out and lse) too."""
    from conftest import gpu_available
    if not gpu_available():
        pytest.skip("no CUDA device visible to CuPy")
    import cupy as cp
    import flasharray as fa
    from flasharray._private import cuda_forward
    from flasharray.testing import check_attention
    if int(cp.cuda.Device().compute_capability) < 80:
        pytest.skip("3xtf32 needs sm_80+")
    rng = np.random.default_rng(D)
    hk = 1 if gqa else 4
    q, dout = (rng.standard_normal((2, 4, 1000, D)).astype(F32) for _ in range(2))
    k, v = (rng.standard_normal((2, hk, 1000, D)).astype(F32) for _ in range(2))
    g = [cp.asarray(x) for x in (q, k, v, dout)]
    kb, vb = (cp.broadcast_to(x, (2, 4, 1000, D)) for x in g[1:3])
    plan = cuda_forward.plan(g[0], kb, vb, causal=causal, scale=D ** -0.5, batch_shape=(2, 4), device="cuda")
    assert plan.tile.kernel == "tf32" and plan.tile.precision == "3xtf32", plan.tile.describe()
    out, lse = fa.flash_attention_forward(*g[:3], causal=causal)
    grads = fa.flash_attention_backward(g[3], *g[:3], out, lse, causal=causal)
    report = check_attention(out, q, k, v, causal=causal, lse=lse, dout=dout, grads=grads)
    assert report.passed, report
