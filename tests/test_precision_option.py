"""Validation of the ``precision=`` option (flasharray/_private/precision.py, issue 12)."""
import ml_dtypes
import numpy as np
import pytest

from flasharray._private.precision import check_precision, check_precision_arch

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
