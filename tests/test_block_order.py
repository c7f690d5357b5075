"""Causal forwards take their query tiles longest first (flash::query_tile), and the schedule model
of benchmarks/schedule.py that predicts what this is worth."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flasharray import emulator
from flasharray._private import launch, sass

ROOT = Path(__file__).resolve().parents[1]

ORDER_SRC = r'''
#include "flash_block_info.cuh"
// Block x writes the query tile it computes among gridDim.x.
template <bool Is_causal>
__global__ void block_order(int* out) {
    if (threadIdx.x == 0) fa::gstore(out + blockIdx.x, flash::query_tile<Is_causal>((int)blockIdx.x, (int)gridDim.x));
}
'''

#: Every forward kernel source that picks its query tile with query_tile<Is_causal> (block x).
FORWARD_SOURCES = ("flash_fwd.cu", "flash_fwd_sm90.cu", "flash_fwd_simt.cu", "flash_fwd_tf32.cu", "flash_fwd_f64.cu")


def _schedule():
    spec = importlib.util.spec_from_file_location("schedule", ROOT / "benchmarks" / "schedule.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("n", [1, 2, 7])
def test_query_tile_reverses_causal_blocks_only(n):
    names = ["block_order<true>", "block_order<false>"]
    mod = emulator.Module(ORDER_SRC, name_expressions=names, include_dirs=[str(launch.cuda_src_dir())])
    for name, want in zip(names, (np.arange(n)[::-1], np.arange(n))):
        out = np.full(n, -1, np.int32)
        mod.launch(name, n, 32, (out,))
        np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("source", FORWARD_SOURCES)
def test_every_forward_takes_its_query_tile_from_query_tile(source):
    """No forward kernel reads its query tile from blockIdx.x directly any more (the causal
    correctness of each is the kernels' own tests: every query tile computed exactly once)."""
    text = (launch.cuda_src_dir() / source).read_text()
    assert "query_tile<Is_causal>" in text
    assert "static_cast<int>(blockIdx.x) * kBlockM" not in text


def test_makespan_known_answers():
    s = _schedule()
    assert s.makespan([3, 1, 1, 1], 2) == 3       # the 3 on one slot, the three 1s on the other
    assert s.makespan([1, 1, 1, 3], 2) == 4       # the 3 starts last, at time 1
    assert s.makespan([2, 2, 2, 2], 4) == 2
    assert s.tile_costs(256, 64, 64, 1.0) == [2, 3, 4, 5]
    assert s.tile_costs(100, 64, 32, 0.0) == [2, 4]   # the last tile: keys < 100 (4 tiles of 32)


@pytest.mark.parametrize("n, block_m, block_n", [(512, 64, 64), (4096, 128, 64), (16384, 64, 32)])
def test_longest_first_never_worse_on_the_benchmark_shapes(n, block_m, block_n):
    s = _schedule()
    heads = (s.TOKENS // n) * 16
    in_order, longest_first = s.efficiencies(n, heads, block_m, block_n, 264, 1.0)
    assert 0 < in_order <= longest_first <= 1.0


@pytest.mark.skipif(not sass.available()[0], reason="SASS report unavailable: %s" % (sass.available()[1],))
def test_schedule_script_prints_the_table(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "schedule.py"), "--head-dims", "128"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [line.split("|") for line in res.stdout.splitlines() if line.startswith("| 128 |")]
    assert len(rows) == 6                                    # N 512 .. 16k
    assert rows[-1][2].strip() == "128 x 64"                 # the sm_90 D 128 causal tile (tiles.WIDE_BC64_CAUSAL)
    assert all(float(r[7]) <= float(r[8]) for r in rows)     # longest first never worse
