"""The softcap's tanh is the same precise one in every forward kernel and the backward kernels that
recompute its P.

``--use_fast_math`` turns ``tanhf`` into MUFU.TANH (~2⁻¹¹ relative error). That was once thought fine
for the fp16/bf16 tensor-core kernels (their scores are rounded to 16 bits for P·V anyway), but their
fp32 lse is held to fp32's rule: on an H200 it was 6.2e-6 off with a bound of 3.4e-6. So every kernel
takes ``Mask::cap``'s precise tanh (``expm1f``). The backward recomputes ``P = exp(score − lse)``
from the forward's lse: on a GPU it must use the very same tanh, or P differs from the forward's by
the tanh error. The emulator computes both tanh forms nearly exactly, so only the SASS shows a
mismatch: this test pins it (NVRTC, no GPU).
"""
import pytest

from flasharray._private import cuda_backward, cuda_forward, launch, nvrtc, sass
from conftest import requires_nvrtc

SASS_OK, SASS_WHY = sass.available()
SOFTCAP = cuda_forward.EXT_BITS["softcap"]
pytestmark = [requires_nvrtc, pytest.mark.skipif(not SASS_OK, reason=str(SASS_WHY))]


def uses_mufu_tanh(source, name, arch="sm_80"):
    r = nvrtc.compile_cubin(launch.kernel_source(source), arch, [name], options=["--use_fast_math"])
    lowered, inside, found = r.kernel(name).lowered_name, False, False
    for line in sass.disassemble(r.cubin).splitlines():
        if "Function :" in line:
            inside = line.split("Function :")[1].strip() == lowered
        elif inside and "MUFU.TANH" in line:
            found = True
    return found


@pytest.mark.parametrize("dtype, expect_fast", [("float32", False), ("float16", False)])
def test_backward_recomputes_p_with_the_forwards_tanh(dtype, expect_fast):
    tile = cuda_forward.kernel_for(dtype, 64, 64, 80, ext=True)
    fwd_name = cuda_forward.forward_name_expression(tile, False, True, ext=SOFTCAP)
    assert uses_mufu_tanh(tile.source, fwd_name) == expect_fast
    plan = cuda_backward.kernel_plan(dtype, 64, 64, causal=False, deterministic=True, arch=80, ext=SOFTCAP)
    for role in ("dkv", "dq"):
        source, name, _ = plan[role]
        assert uses_mufu_tanh(source, name) == expect_fast, (role, name)
