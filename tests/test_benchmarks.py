"""The benchmark scripts run (tiny sizes, emulator where they need a GPU) and print their tables.

They measure nothing here; this keeps them working so that a GPU machine can run them as-is.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(script, *args, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), FLASHARRAY_CPU_THREADS="2")
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def test_cpu_benchmark_prints_table_and_plot(tmp_path):
    out = run("cpu.py", "--sizes", "256", "--dims", "32", "--repeats", "1", "--no-causal",
              "--out", str(tmp_path / "cpu.png"), tmp_path=tmp_path)
    assert "validated" in out and "flasharray" in out and "naive-fp32" in out
    assert "fwd ms" in out and "peak MB" in out


def test_gpu_benchmark_without_gpu_says_so(tmp_path):
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed: the no-GPU message is not what runs")
    except ImportError:
        pass
    assert "no GPU" in run("gpu.py", "--backward", tmp_path=tmp_path)


def test_gpu_benchmarks_on_the_emulator(tmp_path):
    out = run("gpu.py", "--emulator", "--backward", tmp_path=tmp_path)
    assert "flasharray" in out and "flasharray-det" in out and "flasharray-atomic" in out


def test_io_benchmarks(tmp_path):
    out = run("io.py", "--max-n", "512", tmp_path=tmp_path)
    assert "512" in out and "x" in out
    out = run("io_backward.py", "--max-n", "256", tmp_path=tmp_path)
    assert "256" in out


def test_emulator_benchmark(tmp_path):
    out = run("emulator.py", "--repeats", "1", tmp_path=tmp_path)
    assert "switch" in out.lower() and "gemm" in out.lower()
