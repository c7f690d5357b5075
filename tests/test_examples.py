"""Every example runs as a user would run it, on a machine without a GPU, and says what it used."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, str(path)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip(), "example printed nothing"


def test_quickstart_reports_backend_and_validation():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert "backend" in res.stdout and "within bound : True" in res.stdout


@pytest.mark.parametrize("flags", [[], ["--paged"]], ids=["contiguous", "paged"])
def test_decode_matches_full_recompute_every_step(flags):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "decode.py")] + flags, cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "backend" in res.stdout and "matches full recompute : True" in res.stdout
