"""benchmarks/overhead.py runs without a GPU (no-op launcher) and prints every row; it measures
nothing here (speed targets are read from its output on a quiet machine, never asserted)."""
import importlib.util
import sys
from pathlib import Path

import pytest

from flasharray import emulator
from flasharray._private import api, cuda_forward, kvcache, launch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def overhead():
    spec = importlib.util.spec_from_file_location("overhead_bench", ROOT / "benchmarks" / "overhead.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    yield mod
    launch.reload_sources()


def test_null_mode_prints_every_row_without_running_a_kernel(overhead, monkeypatch, capsys):
    def no_kernels(*a, **k):
        raise AssertionError("the no-op launcher compiled or ran a kernel")
    monkeypatch.setattr(emulator.Module, "__init__", no_kernels)
    monkeypatch.setattr(emulator.Module, "launch", no_kernels)
    overhead.main(["--number", "20", "--repeat", "1"])
    out = capsys.readouterr().out
    for row in ("cached call", "uncached call", "forward", "backward", "breakdown", "signature key",
                "cache lookup", "allocate out, lse", "bind pointers + launch", "NumPy address lookups",
                "rest (call layers)", "target <= 15", "target <= 25", "backward, cached: breakdown",
                "handles of the 6 inputs", "allocate 5 buffers (2 allocations)", "bind pointers + launch (3)",
                "kvcache (Lq=1, 1 new), cached: breakdown",
                "cache_seqlens to the host, check values", "append kernel (new keys, key counts)",
                "forward_kvcache (plan kept)", "kvcache, check_values=False",
                "NumPy address lookups (15)", "wall time"):
        assert row in out, row
    # Plans made under the no-op launcher do not survive it.
    assert not cuda_forward._PLANS and not api._CACHE and not kvcache._CALLS


def test_cpu_timer(overhead, capsys):
    overhead.main(["--number", "5", "--repeat", "1", "--timer", "cpu"])
    assert "cpu time" in capsys.readouterr().out
    assert overhead._timer[0] is overhead.time.perf_counter  # restored


def test_arguments_are_checked(overhead):
    with pytest.raises(SystemExit):
        overhead.main(["--number", "0"])
    with pytest.raises(SystemExit):
        overhead.main(["--device", "tpu"])
    with pytest.raises(SystemExit):
        overhead.main(["--device", "cuda", "--timer", "cpu"])


def test_cuda_mode_needs_cupy(overhead):
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed")
    except ImportError:
        pass
    with pytest.raises(ImportError):
        overhead.main(["--device", "cuda", "--number", "1", "--repeat", "1"])
    assert "cupy" not in sys.modules
