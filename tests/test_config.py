"""``flasharray.show_config()`` and ``python -m flasharray info`` report versions and kernel choices."""
import io
import os
import subprocess
import sys
from pathlib import Path

import flasharray as fa

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def test_show_config_names_versions_sources_and_kernels():
    buf = io.StringIO()
    fa.show_config(file=buf)
    text = buf.getvalue()
    for word in ("flasharray", "numpy", "cupy", "NVRTC", "cuda sources", "emulator", "sm_80", "sm_75"):
        assert word in text, word
    assert "tensor_core" in text and "simt" in text


def test_cli_info_for_one_configuration():
    res = subprocess.run([sys.executable, "-m", "flasharray", "info", "--dtype", "bfloat16",
                          "--head-dim", "128", "--arch", "75"], env=ENV, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    # bf16 has no tensor cores on sm_75: the SIMT kernel is chosen
    line = [ln for ln in res.stdout.splitlines() if "bfloat16" in ln and "d=128" in ln]
    assert line and "simt" in line[0], res.stdout


def test_cli_without_command_prints_help_and_survives_a_closed_pipe():
    res = subprocess.run([sys.executable, "-m", "flasharray"], env=ENV, capture_output=True, text=True)
    assert res.returncode == 0 and "info" in res.stdout
    res = subprocess.run("%s -m flasharray info | head -1" % sys.executable, shell=True, env=ENV,
                         capture_output=True, text=True)
    assert res.stdout.startswith("flasharray") and "Traceback" not in res.stderr


def test_kernel_choice_names_the_wide_row_tile():
    from flasharray._private import config
    two = config.kernel_choice("float16", 128, 80).splitlines()         # d = dv: 128 x 64 causal or not
    assert len(two) == 2 and "Br=64 Bc=64" in two[0]
    assert "(causal or not," in two[1] and "Br=128 Bc=64" in two[1] and "1-stage" in two[1]
    three = config.kernel_choice("float16", 128, 80, head_dim_v=64).splitlines()  # d > dv: causal calls 128 x 32
    assert len(three) == 3 and "Br=64 Bc=64" in three[0]
    assert "(non-causal," in three[1] and "Br=128 Bc=64" in three[1] and "1-stage" in three[1]
    assert "(causal," in three[2] and "Br=128 Bc=32" in three[2]
    two = config.kernel_choice("float16", 256, 80).splitlines()     # d 256: one wide tile, causal or not
    assert len(two) == 2 and "Br=128 Bc=64" in two[1] and "1-stage" in two[1] and "causal or not" in two[1]
    assert "causal or not" in config.kernel_choice("float16", 128, 90).splitlines()[-1]  # sm_90: the mma.sync one's
    assert len(config.kernel_choice("float16", 128, 75).splitlines()) == 1   # sm_75: the table's tile only
    assert len(config.kernel_choice("float16", 64, 80).splitlines()) == 1


def test_kernel_choice_names_the_wgmma_kernel_on_sm90():
    """sm_90 fp16 / bf16: the wgmma kernel first (forward and backward), then the mma.sync tiles the calls it does
    not serve keep; AUTO_DISPATCH off, float32 or another arch: no wgmma line."""
    from conftest import flag_set
    from flasharray._private import config, cuda_backward_sm90, cuda_forward_sm90
    lines = config.kernel_choice("bfloat16", 64, 90).splitlines()
    assert lines[0].startswith("wgmma kernel") and "backward: wgmma" in lines[0]
    assert "extensions on rows not 16-byte aligned at d 256, split-KV" in lines[1] and "tensor_core" in lines[1]
    assert "(dq='recompute', extensions its kernels or the dQ mode do not take: tc)" in lines[0]
    with flag_set(cuda_backward_sm90, "AUTO_EXT", False):
        assert "(dq='recompute', extensions: tc)" in config.kernel_choice("bfloat16", 64, 90).splitlines()[0]
    with flag_set(cuda_forward_sm90, "AUTO_EXT", False):
        assert "(extensions, split-KV" in config.kernel_choice("bfloat16", 64, 90).splitlines()[1]
    assert "wgmma" not in config.kernel_choice("float16", 64, 80)
    assert "wgmma" not in config.kernel_choice("float32", 64, 90)
    with flag_set(cuda_forward_sm90, "AUTO_DISPATCH", False):
        assert "wgmma" not in config.kernel_choice("float16", 64, 90)
