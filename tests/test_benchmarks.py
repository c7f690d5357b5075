"""The benchmark scripts run (tiny sizes, emulator where they need a GPU) and print their tables.

They measure nothing here; this keeps them working so that a GPU machine can run them as-is.
The GPU timing helper runs against stand-ins (a fake clock for CUDA events, fake kernels whose
first call "compiles"), proving that compilation stays out of the timed region and that the median
of the repetitions is what is reported.
"""
import importlib
import itertools
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
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
    assert "flasharray-det-recompute" in out
    assert "flasharray-dropout-det " in out and "flasharray-dropout-det-recompute" in out and "FAILED" not in out


def test_gpu_backward_dropout_rows_are_validated_with_their_mask(bench):
    """The dropout rows' gradients are checked against the reference with the same Philox mask:
    the dense backward's gradients fail that check, the dropout row's pass."""
    import gpu_backward as gb
    tensors = gb._make_tensors(np, 1, 2, 48, 32, np.float16)
    dropped = gb.IMPLS["flasharray-dropout-det"].make(tensors, True, "emulator")()
    dense = gb.IMPLS["flasharray-det"].make(tensors, True, "emulator")()
    assert gb.check("flasharray-dropout-det", dropped, tensors, True, "emulator").passed
    assert not gb.check("flasharray-dropout-det", dense, tensors, True, "emulator").passed


def test_gpu_backward_wgmma_rows(bench):
    """The Hopper backward's rows exist, are validated like flasharray's, and stand down (None)
    off an sm_90 GPU (here: the emulator device), so no other run changes."""
    import gpu_backward as gb
    for name in gb.WGMMA:
        assert name in gb.IMPLS
    tensors = gb._make_tensors(np, 1, 1, 32, 64, np.float16)
    for name in gb.WGMMA:
        assert gb.IMPLS[name].make(tensors, False, "emulator") is None


def test_io_benchmarks(tmp_path):
    out = run("io.py", "--max-n", "512", tmp_path=tmp_path)
    assert "512" in out and "x" in out
    out = run("io_backward.py", "--max-n", "256", tmp_path=tmp_path)
    assert "256" in out


def test_io_block_sparse_traffic_falls_with_density(tmp_path):
    out = run("io.py", "--max-n", "256", "--block-sparse", tmp_path=tmp_path)
    assert "measured == expected for every block-sparse row: yes" in out
    rows = [line.split("|") for line in out.splitlines() if line[:5] in ("1.000", "0.500", "0.250", "0.125")]
    mb = [float(r[2]) for r in rows]
    assert len(mb) == 4 and mb[0] > mb[1] > mb[2] > mb[3]


def test_emulator_benchmark(tmp_path):
    out = run("emulator.py", "--repeats", "1", tmp_path=tmp_path)
    assert "switch" in out.lower() and "gemm" in out.lower()


# ---- the GPU timing helper against stand-ins ---------------------------------------------------

COMPILE_MS = 1000.0


@pytest.fixture
def bench(monkeypatch):
    """benchmarks/gpu.py and benchmarks/gpu_timing.py as modules."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("gpu"), importlib.import_module("gpu_timing")


class FakeClock:
    """Stands in for CUDA events: "device" time advances only while a fake kernel runs, a mark is
    that time, and (as with events) elapsed times may be read only after synchronize."""

    def __init__(self):
        self.now, self.marks, self.synced = 0.0, 0, True

    def mark(self):
        self.marks += 1
        self.synced = False
        return self.now

    def elapsed_ms(self, start, stop):
        assert self.synced, "elapsed time read before synchronize"
        return stop - start

    def synchronize(self):
        self.synced = True


class FakeKernel:
    """First call "compiles" (COMPILE_MS of clock time); every call then takes the next duration.
    ``log`` gets ("compile", tag, marks so far) and ("run", tag, ms)."""

    def __init__(self, clock, durations, log, tag):
        self.clock, self.durations, self.log, self.tag = clock, durations, log, tag
        self.compiled = False

    def __call__(self):
        if not self.compiled:
            self.compiled = True
            self.clock.now += COMPILE_MS
            self.log.append(("compile", self.tag, self.clock.marks))
        ms = next(self.durations)
        self.clock.now += ms
        self.log.append(("run", self.tag, ms))


def test_timed_region_excludes_compilation_and_reports_the_median(bench):
    _, gpu_timing = bench
    clock, log = FakeClock(), []
    durations = itertools.cycle([1.0, 1.0, 1.0, 7.0])  # an outlier every 4th call: mean 2.5, median 1
    fns = [FakeKernel(clock, durations, log, tag) for tag in range(3)]  # 3 copies of the inputs
    t = gpu_timing.time_ms(fns, clock, warmup_ms=10.0, rep_ms=30.0, min_repeats=8)
    assert [entry[2] for entry in log if entry[0] == "compile"] == [0, 0, 0]  # before the first mark
    assert max(t.samples) < COMPILE_MS and len(t.samples) >= 8
    runs = [entry for entry in log if entry[0] == "run"]
    timed = runs[-len(t.samples):]
    assert t.samples == [ms for _, _, ms in timed]  # one sample per repetition, nothing else inside
    assert [tag for _, tag, _ in timed] == [i % 3 for i in range(len(t.samples))]  # copies in turn
    assert len(runs) - len(timed) > 2 * len(fns)  # first calls, sizing pass and a warm-up before
    assert t.ms == statistics.median(t.samples) == 1.0 < statistics.mean(t.samples)


def test_host_clock_excludes_a_slow_first_call(bench):
    _, gpu_timing = bench
    calls = []

    def fn():
        time.sleep(0.3 if not calls else 0.001)
        calls.append(None)
    t = gpu_timing.time_ms([fn], gpu_timing.PerfClock(), warmup_ms=5.0, rep_ms=20.0, min_repeats=5)
    assert t.ms < 100.0 and len(t.samples) >= 5


def test_measure_converts_validates_and_compiles_outside_the_timed_region(bench, monkeypatch):
    gpu, _ = bench
    clock, log, made = FakeClock(), [], []
    durations = itertools.cycle([2.0, 2.0, 5.0])

    def make(tensors, causal, device):
        made.append(clock.marks)  # conversion (DLPack, layout) happens here
        return FakeKernel(clock, durations, log, tensors)

    monkeypatch.setattr(gpu, "peak_bytes", lambda fn: 3e6)
    check = lambda name, out, tensors, causal, device: None  # noqa: E731
    ms, nbytes = gpu.measure("fake", gpu.Impl(make), ["copy0", "copy1"], False, check, clock)
    assert made == [0, 0] and ms == 2.0 and nbytes == 3e6


def test_ratios_to_flashattention2_and_the_fastest_torch_backend(bench):
    gpu, _ = bench

    def row(impl, kind, role, ms):
        return gpu.Row("fp16", 8, 16, 2048, 128, False, impl, kind, role, ms, 1e12, 0.0)
    rows = [row("flasharray", "fwd", "", 2.0), row("torch-flash", "fwd", "torch-fa2", 1.0),
            row("torch-cudnn", "fwd", "torch", 0.5), row("torch-math", "fwd", "torch", 8.0),
            row("flasharray-det", "bwd", "", 6.0), row("torch-flash", "bwd", "torch-fa2", 3.0)]
    got = {(r.impl, r.kind): (r.vs_fa2, r.vs_torch) for r in gpu.with_ratios(rows)}
    assert got[("flasharray", "fwd")] == (0.5, 0.25)
    assert got[("torch-math", "fwd")] == (0.125, 0.0625)
    assert got[("flasharray-det", "bwd")] == (0.5, 0.5)
    with_fa = gpu.with_ratios(rows + [row("flash-attn", "fwd", "fa2", 0.8)])
    assert [r.vs_fa2 for r in with_fa if r.impl == "flasharray"] == [0.4]
    assert gpu.with_ratios([row("flasharray", "fwd", "", 2.0)])[0][-2:] == (None, None)


def test_table_selection_narrows_the_shapes(bench):
    """--dtypes / --head-dims / --seqlens / --causal narrow the table; --quick keeps the first 3 N."""
    gpu, _ = bench
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    gpu.add_selection_args(ap)
    parse = lambda *a: gpu.selection_from(ap, ap.parse_args(list(a)), gpu.IMPLS)  # noqa: E731
    full = list(gpu.shapes(parse()))
    assert len(full) == len(gpu.DTYPES) * len(gpu.HEAD_DIMS) * 2 * len(gpu.SEQLENS)
    assert {n for *_, n in gpu.shapes(parse("--quick"))} == set(gpu.SEQLENS[:3])
    sel = parse("--dtypes", "fp16", "--head-dims", "128,256", "--seqlens", "4096,16384", "--causal", "yes",
                "--impls", "flasharray,torch-flash", "--validate-max-n", "4096")
    assert list(gpu.shapes(sel)) == [("fp16", d, True, n) for d in (128, 256) for n in (4096, 16384)]
    assert (sel.impls, sel.validate_max_n) == (("flasharray", "torch-flash"), 4096)
    for bad in (["--dtypes", "fp8"], ["--seqlens", "1k"], ["--impls", "flasharray-det"], ["--head-dims", "x"]):
        with pytest.raises(SystemExit) as e:
            parse(*bad)
        assert e.value.code == 2, bad


def test_backward_option_checks_row_names_of_both_tables(bench):
    gpu, _ = bench
    with pytest.raises(SystemExit) as e:
        gpu.main(["--backward", "--impls", "flasharray,no-such-row"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        gpu.main(["--decode", "--seqlens", "1024"])
    with pytest.raises(SystemExit) as e:
        gpu.main(["--precision", "--dtypes", "fp16"])  # the precision table's dtypes are fp32, fp64
    assert e.value.code == 2
    assert gpu._without_option(["--quick", "--plot", "a.png", "--plot=b.png", "--seqlens", "1"], "--plot") == [
        "--quick", "--seqlens", "1"]


def test_input_copies_cover_twice_the_l2(bench):
    _, gpu_timing = bench
    assert gpu_timing.copies_for_l2(201e6, 50e6) == 1  # FlashAttention-2's shapes: q, k, v > 2 × L2
    assert gpu_timing.copies_for_l2(30e6, 50e6) == 4
    assert gpu_timing.copies_for_l2(1e3, 50e6) == 8


# ---- gpu.py --decode: the inference shapes against FlashAttention-2 ------------------------------

def test_gpu_decode_on_the_emulator(tmp_path):
    out = run("gpu.py", "--decode", "--emulator", tmp_path=tmp_path)
    lines = [line for line in out.splitlines() if "| flasharray" in line]
    assert len(lines) == 5 and all("splits" in line and "SMs" in line for line in lines)
    assert "FAILED" not in out
    assert all(", G 2," in line for line in lines[2:4])   # the GQA rows pack (2 query heads per KV head)


def test_gpu_decode_without_gpu_says_so(tmp_path):
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed: the no-GPU message is not what runs")
    except ImportError:
        pass
    assert "no GPU" in run("gpu.py", "--decode", tmp_path=tmp_path)


def test_decode_refuses_other_table_options(bench):
    gpu, _ = bench
    for extra in (["--backward"], ["--quick"], ["--plot", "x.png"]):
        with pytest.raises(SystemExit) as e:
            gpu.main(["--decode"] + extra)
        assert e.value.code == 2


def test_decode_rows_time_every_shape_and_report_the_ratio(bench, capsys):
    """run_decode against stand-ins: the five shapes of gpu/README.md, both implementations,
    validated before timing, compiled outside the timed region, ratio = flasharray / FA2."""
    gpu, gpu_timing = bench
    clock, log, checked = FakeClock(), [], []
    speed = {"flasharray": 3.0, "torch-flash": 2.0}

    def impl(name):
        def make(tensors, causal, device):
            assert device == "cuda"
            return FakeKernel(clock, itertools.repeat(speed[name] * tensors[0]), log, (name, tensors))
        return make

    def make_tensors(xp, B, Hq, Hkv, Lq, Lk, D, dtype, copy=0):
        assert (D, dtype) == (128, np.float16) and xp == "xp"
        return (Lq, copy)  # per shape: its Lq scales the fake time; the copy index tags the set

    def check(name, result, tensors, causal, device):
        checked.append((name, tensors, clock.marks))
        return None

    impls = {"flasharray": impl("flasharray"), "torch-flash": impl("torch-flash")}
    rows = gpu.run_decode(impls, make_tensors, check, clock, "xp", launch=lambda t, c, d: "splits ?",
                          copies_for=lambda tensors: 2)
    assert len(rows) == 2 * len(gpu.DECODE_SHAPES) == 10
    assert [(r.B, r.Hq, r.Hkv, r.Lq, r.Lk, r.causal) for r in rows[::2]] == list(gpu.DECODE_SHAPES)
    for fa_row, fa2_row in zip(rows[::2], rows[1::2]):
        assert (fa_row.impl, fa2_row.impl) == ("flasharray", "torch-flash")
        assert fa_row.ms == 3.0 * fa_row.Lq and fa2_row.ms == 2.0 * fa2_row.Lq
        assert fa_row.ratio == 1.5 and fa2_row.ratio is None
        assert fa_row.launch == "splits ?" and fa2_row.launch == ""
    # every implementation validated once per shape on the first copy, before its first timing mark
    assert len(checked) == 10 and all(tensors[1] == 0 for _, tensors, _ in checked)
    compiles = [e for e in log if e[0] == "compile"]
    assert len(compiles) == 20                     # 2 copies x 2 implementations x 5 shapes
    printed = capsys.readouterr().out
    assert "1.50x" in printed and "target <= 1.1" in printed


def test_decode_tensors_share_pytorch_and_flasharray_gqa(bench):
    """Query head h uses KV head h // G in both layouts: the (B, H_kv, G, Lq, D) view of q."""
    gpu, _ = bench
    q, k, v = gpu.decode_tensors(np, 2, 8, 2, 3, 5, 16, np.float32)
    qv, kv, vv = gpu.gqa_views(q, k, v)
    assert qv.shape == (2, 2, 4, 3, 16) and kv.shape == vv.shape == (2, 2, 1, 5, 16)
    assert np.shares_memory(qv, q)
    np.testing.assert_array_equal(qv[1, 1, 2], q[1, 1 * 4 + 2])


# ---- gpu.py --precision: issue 12's float32 / float64 rows ------------------------------------------

def test_gpu_precision_on_the_emulator(tmp_path):
    out = run("gpu.py", "--precision", "--emulator", tmp_path=tmp_path)
    assert "FAILED" not in out
    for name in ("flasharray-ieee", "flasharray-3xtf32-bwd", "flasharray-tf32-fwdbwd", "flasharray-ieee-recompute-bwd"):
        assert "fp32              | %s " % name in out
    assert "fp64              | flasharray-ieee-fwdbwd" in out
    assert "fp64              | flasharray-tf32" not in out  # tf32 does not apply to float64


def test_gpu_precision_checks_tf32_gradients(bench):
    """The tf32 rows' gradients are held to precision.tf32_gradient_bound (plus the float32 rule's
    term), elementwise: the emulator's tf32 backward passes; a dq off by 1 % of its scale fails."""
    import gpu_precision as gp
    import flasharray as fa
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, 1, n, 32)).astype(np.float32) for n in (40, 56, 56, 40))
    kw = dict(causal=True, backend="emulator", precision="tf32")
    out, lse = fa.flash_attention_forward(q, k, v, **kw)
    grads = fa.flash_attention_backward(dout, q, k, v, out, lse, **kw)
    checks = gp.tf32_grad_checks(grads, q, k, v, dout, out, lse, True)
    assert [c.name for c in checks] == ["dq", "dk", "dv"] and all(c.passed for c in checks), checks
    bad = (grads[0] + 0.01 * np.abs(grads[0]).max(),) + tuple(grads[1:])
    assert [c.passed for c in gp.tf32_grad_checks(bad, q, k, v, dout, out, lse, True)] == [False, True, True]


def test_gpu_precision_goals_from_rows(bench, monkeypatch):
    gpu, _ = bench
    import gpu_precision as gp

    def row(dt, impl, kind, ms):
        return gpu.Row(dt, 4, 16, 4096, 128, False, impl, kind, "", ms, 4.0 * 4 * 16 * 4096 * 4096 * 128 * gp.FACTORS[kind], 0.0)
    rows = [row("fp32", "flasharray-3xtf32-fwdbwd", "fwdbwd", 10.0), row("fp32", "torch-mem-eff-fwdbwd", "fwdbwd", 25.0),
            row("fp32", "flasharray-ieee", "fwd", 2.0), row("fp32", "flasharray-ieee-bwd", "bwd", 8.0),
            row("fp32", "flasharray-tf32-fwdbwd", "fwdbwd", 1.0), row("fp64", "flasharray-ieee-fwdbwd", "fwdbwd", 20.0),
            row("fp32", "flasharray-ieee-fwdbwd", "fwdbwd", 30.0), row("fp32", "flasharray-ieee-recompute-bwd", "bwd", 10.0)]
    assert gp.DEFAULT_FP32 == "ieee" and gp.DEFAULT_FP32_FWD == "3xtf32"
    rows.append(row("fp32", "flasharray-3xtf32", "fwd", 1.5))
    lines = gp.goals(rows, "NVIDIA H100 80GB HBM3")   # the default: the 3xtf32 forward + the ieee backward
    assert "default (3xtf32 forward + ieee backward) fwd+bwd %.2fx torch-mem-eff" % (25.0 / 9.5) in lines[0]
    assert "default (3xtf32 forward + ieee backward) fwd+bwd %.2fx ieee" % (30.0 / 9.5) in lines[0]
    monkeypatch.setattr(gp, "DEFAULT_FP32_FWD", "ieee")  # an ieee default: its fwdbwd row
    assert "default (ieee) fwd+bwd %.2fx torch-mem-eff" % (25.0 / 30.0) in gp.goals(rows)[0]
    monkeypatch.setattr(gp, "DEFAULT_FP32", "3xtf32")  # a tensor-core default in both directions
    monkeypatch.setattr(gp, "DEFAULT_FP32_FWD", "3xtf32")
    lines = gp.goals(rows, "NVIDIA H100 80GB HBM3")
    assert "default (3xtf32) fwd+bwd 2.50x torch-mem-eff" in lines[0]
    assert "default (3xtf32) fwd+bwd 3.00x ieee" in lines[0]
    tf32 = rows[4].flop / 1e-3 / 1e12
    assert "tf32 fwd+bwd %.1f TFLOP/s" % tf32 in lines[0]
    assert "ieee bwd/fwd TFLOP/s %.2f" % ((2.5 / 8.0) / (1 / 2.0)) in lines[0]
    assert "ieee bwd ordered dQ 1.25x the recomputing dQ kernel" in lines[0]
    fp64 = rows[5].flop / 20e-3 / 1e12
    assert "fwd+bwd %.1f TFLOP/s = %.0f%% of 66.9" % (fp64, 100 * fp64 / 66.9) in lines[1]
    assert gp.fp64_peak("NVIDIA H100 PCIe") == 51.2 and gp.fp64_peak("Tesla T4") is None


# ---- the Hopper switches (benchmarks/hopper_variants.py) and the GPU session script -------------------

HOPPER_SWITCHES = ("fwd.OVERLAP", "fwd.USE_TMA_STORE", "fwd.PERSISTENT", "fwd.PERSISTENT_MAX_HEAD_DIM",
                   "fwd.PERSISTENT_CAUSAL_MAX_HEAD_DIM", "fwd.CAUSAL_PAIRS", "fwd.WIDE_KEYS", "fwd.THREE_WARPGROUPS",
                   "fwd.USE_TMA", "fwd.kernel", "bwd.DQ_BULK",
                   "bwd.USE_TMA_STORE", "bwd.USE_TMA", "bwd.KV_REGS", "bwd.QUERY_SPLIT", "bwd.ENTRIES_FIRST", "bwd.DQ_SPLIT", "bwd.KT_REGS", "bwd.DQ_BUFFERS", "bwd.SCORES_AHEAD", "bwd.SPLIT_OVERLAP", "bwd.kernel", "mma.WIDE_ROWS", "mma.WIDE_BC64", "mma.WIDE_BC64_LARGE",
                   "mma.WIDE_BC64_CAUSAL",
                   "mma.WIDE_CAUSAL", "mma.WIDE_KEYS", "mma.GRID_LAYOUT", "mma.GRID_SWIZZLE", "mma.ENTRIES_FIRST",
                   "mma.CAUSAL_GROUPS")


def test_hopper_variants_on_the_emulator(tmp_path):
    """Every switch gets a table with at least one validated row (both dQ modes for the backward ones) and a
    summary line; the flags are back at their defaults afterwards (the JSON's summary reads them)."""
    import json
    out = run("hopper_variants.py", "--emulator", "--json", str(tmp_path / "hv.json"), tmp_path=tmp_path)
    assert "FAILED" not in out and "Error" not in out
    tables = out.split("\n== ")[1:]
    assert [t.split(":")[0] for t in tables] == list(HOPPER_SWITCHES)
    for name, table in zip(HOPPER_SWITCHES, tables):
        rows = [line for line in table.splitlines() if line.startswith("(")]
        modes = {line.split("|")[1].strip() for line in rows}
        assert modes == ({"det"} if name in ("bwd.ENTRIES_FIRST", "mma.ENTRIES_FIRST")   # (the ordered mode's)
                         else {"det", "atomic"} if name.startswith("bwd") or name in ("mma.WIDE_KEYS", "mma.GRID_LAYOUT",
                                                                                      "mma.GRID_SWIZZLE")
                         else {"fwd"}), \
            (name, table)
        assert all(float(line.split("|")[4]) > 0 for line in rows), table   # flipped / default
    summary = out.split("summary (ratio")[1]
    assert all(name in summary for name in HOPPER_SWITCHES)
    data = json.loads((tmp_path / "hv.json").read_text())
    assert {r["switch"] for r in data["rows"]} == set(HOPPER_SWITCHES) and all(r["ratio"] for r in data["rows"])
    by_name = {s["switch"]: s for s in data["summary"]}
    assert by_name["fwd.OVERLAP"]["default"] is True and by_name["fwd.PERSISTENT_MAX_HEAD_DIM"]["default"] == 256
    assert by_name["bwd.DQ_BULK"]["flag"] == "cuda_backward_sm90.DQ_BULK"
    assert by_name["mma.WIDE_ROWS"]["flag"] == "tiles.WIDE_ROWS" and by_name["mma.WIDE_ROWS"]["default"] is True
    assert by_name["mma.WIDE_BC64"]["flag"] == "tiles.WIDE_BC64" and by_name["mma.WIDE_BC64"]["default"] is True
    assert by_name["mma.WIDE_BC64_CAUSAL"]["default"] is True
    assert by_name["mma.WIDE_BC64_LARGE"]["flag"] == "tiles.WIDE_BC64_LARGE"
    assert by_name["mma.WIDE_CAUSAL"]["flag"] == "tiles.WIDE_CAUSAL_ARCHS"
    assert by_name["mma.WIDE_KEYS"]["flag"] == "tiles_bwd.WIDE_KEYS" and by_name["mma.WIDE_KEYS"]["default"] is True
    assert by_name["mma.GRID_LAYOUT"]["flag"] == "tiles_bwd.GRID_LAYOUT" and by_name["mma.GRID_LAYOUT"]["default"] is True
    assert by_name["mma.GRID_SWIZZLE"]["flag"] == "tiles_bwd.GRID_SWIZZLE"
    assert by_name["mma.GRID_SWIZZLE"]["default"] is True


def test_hopper_variants_extension_switches_on_the_emulator(tmp_path):
    """``--only ext``: the fifteen extension switches (not in the default run), each with validated rows where both
    sides plan the call (both dQ modes) and a line naming the refusal where the wgmma backward does not take it
    (dropout at d 128, the head-dim split)."""
    import json
    out = run("hopper_variants.py", "--emulator", "--only", "ext", "--json", str(tmp_path / "hx.json"),
              tmp_path=tmp_path)
    assert "FAILED" not in out
    tables = out.split("\n== ")[1:]
    names = ["fwd.kernel.dropout", "fwd.kernel.window", "fwd.kernel.window1k", "bwd.kernel.dropout",
             "bwd.kernel.window", "bwd.ORDERED_BLOCK_MASK", "mma.GRID_LAYOUT.block_mask",
             "mma.GRID_LAYOUT.block_mask_window", "mma.GRID_LAYOUT.dropout",
             "bwd.DQ_BULK_EXT.window", "bwd.DQ_BULK_EXT.dropout",
             "fwd.SCORE_EXT_OVERLAP_MAX_HEAD_DIM.softcap", "fwd.PERSISTENT_MAX_HEAD_DIM_SCORE_EXT.softcap",
             "fwd.HEAVY_EXT_OVERLAP_MAX_HEAD_DIM.dropout", "fwd.WIDE_EXT.softcap"]
    assert [t.split(":")[0] for t in tables] == names
    rows = json.loads((tmp_path / "hx.json").read_text())["rows"]
    assert {r["switch"] for r in rows} == set(names) and all(r["ratio"] and r["validated"] for r in rows)
    assert {r["mode"] for r in rows if r["switch"] == "bwd.kernel.window"} == {"det", "atomic"}
    assert {r["mode"] for r in rows if r["switch"] == "bwd.kernel.dropout"} == {"det", "atomic"}
    assert "bwd.kernel.dropout           | det    | not run: NotImplementedError" in out
    # the deterministic block-sparse backward: the wgmma ordered dQ against the mma.sync recomputing dQ kernel
    assert {r["mode"] for r in rows if r["switch"] == "bwd.ORDERED_BLOCK_MASK"} == {"det"}
    # the mma.sync backward with a block mask: the grid-layout dK/dV kernel against the row-tile one, both modes
    assert {r["mode"] for r in rows if r["switch"] == "mma.GRID_LAYOUT.block_mask"} == {"det", "atomic"}
    # ... with a window too (d 128: the emulator's 128 x 128 shape, where the block mask alone keeps the row tile)
    assert {r["mode"] for r in rows if r["switch"] == "mma.GRID_LAYOUT.block_mask_window"} == {"det", "atomic"}
    # ... and with dropout (d 256: the emulator's 64 x 256 shape)
    assert {r["mode"] for r in rows if r["switch"] == "mma.GRID_LAYOUT.dropout"} == {"det", "atomic"}
    for ext in ("window", "dropout"):   # the wgmma backward on both sides, bulk dQ vs atomics
        assert {r["mode"] for r in rows if r["switch"] == "bwd.DQ_BULK_EXT." + ext} == {"det", "atomic"}


def test_hopper_variants_flags_restored_and_plans_cleared(monkeypatch):
    """variant(): the flag flipped inside, restored after (also on an exception), and a plan made inside is not
    what a call after it finds."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    hv = importlib.import_module("hopper_variants")
    from flasharray._private import cuda_backward_sm90 as B, cuda_forward, tiles
    (sw,) = [s for s in hv.SWITCHES if s.name == "bwd.DQ_BULK"]
    with pytest.raises(RuntimeError):
        with hv.variant(sw) as kernel:
            assert kernel == "wgmma" and B.DQ_BULK is False
            cuda_forward._PLANS["stale"] = object()
            raise RuntimeError
    assert B.DQ_BULK is True and "stale" not in cuda_forward._PLANS
    # the mma.sync kernels, named: kernel=None on sm_90 is the wgmma one
    kernels = {s.name: s.flipped for s in hv.SWITCHES if s.module is None}
    assert kernels == {"fwd.kernel": "tensor_core", "bwd.kernel": "tc"}
    (sw,) = [s for s in hv.SWITCHES if s.name == "fwd.kernel"]
    with hv.variant(sw) as kernel:
        assert kernel == "tensor_core"
    (sw,) = [s for s in hv.SWITCHES if s.name == "mma.WIDE_ROWS"]
    with hv.variant(sw) as kernel:               # the mma.sync forward's own switch: both sides kernel="tensor_core"
        assert kernel == "tensor_core" and tiles.WIDE_ROWS is False
    assert tiles.WIDE_ROWS is True
    with hv.variant(None, sw.base) as kernel:
        assert kernel == "tensor_core"
    from conftest import flag_set
    q = np.zeros((1, 1, 128, 128), np.float16)    # both sides of mma.WIDE_ROWS plan the mma.sync forward on sm_90
    for flag in (True, False):
        with flag_set(tiles, "WIDE_ROWS", flag):
            p = cuda_forward.plan(q, q, q, causal=False, scale=1.0, batch_shape=(1, 1), device="emulator",
                                  arch="sm_90", kernel=sw.base)
            assert p.tile.kernel == "tensor_core" and p.tile.block_m == (128 if flag else 64)
    (sw,) = [s for s in hv.SWITCHES if s.name == "mma.WIDE_BC64"]
    for on in (False, True):                      # FlashAttention-2's 128 x 64 tile against 128 x 32
        with hv.variant(sw if not on else None, sw.base) as kernel:
            p = cuda_forward.plan(q, q, q, causal=False, scale=1.0, batch_shape=(1, 1), device="emulator",
                                  arch="sm_90", kernel=kernel)
            assert (p.tile.block_m, p.tile.block_n, p.tile.stages) == ((128, 64, 1) if on else (128, 32, 2))
    assert tiles.WIDE_BC64 is True
    from flasharray._private import tiles_bwd
    (sw,) = [s for s in hv.SWITCHES if s.name == "mma.WIDE_KEYS"]
    with hv.variant(sw) as kernel:               # the mma.sync backward's own switch: both sides kernel="tc"
        assert kernel == "tc" and tiles_bwd.WIDE_KEYS is False
        assert tiles_bwd.tc_tiles("dkv", 128, 128, "sm_90").block_n == 64
    assert tiles_bwd.WIDE_KEYS is True and tiles_bwd.tc_tiles("dkv", 128, 128, "sm_90").block_n == 128
    (sw,) = [s for s in hv.SWITCHES if s.name == "mma.GRID_LAYOUT"]
    with hv.variant(sw) as kernel:               # the row-tile dK/dV kernel in the atomic modes
        assert kernel == "tc" and tiles_bwd.tc_tiles("dkv", 128, 128, "sm_90", mode="ordered").layout == "rows"
    assert tiles_bwd.tc_tiles("dkv", 128, 128, "sm_90", mode="ordered").layout == "grid"
    assert hv.verdict([1.1, 1.05, 0.9]) == (1.05, "keep default") and hv.verdict([0.9])[1] == "flip"
    assert hv.verdict([1.01, 0.99])[1] == "keep default (within 2 %)" and hv.verdict([])[0] is None
    assert hv.verdict([1.5], dispatch=True)[1] == "wgmma faster: dispatch it"


def test_hopper_variants_without_gpu_says_so(tmp_path):
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed: the no-GPU message is not what runs")
    except ImportError:
        pass
    assert "no GPU" in run("hopper_variants.py", tmp_path=tmp_path)


SESSION = ROOT / "benchmarks" / "gpu_session.sh"
SESSION_STEPS = ("install", "smi", "smoke", "overhead", "pytest", "gpu_backward", "mma_verdicts", "mma_d256", "gpu_decode",
                 "pytest_sm90", "gpu_precision", "gpu_fp64", "gpu_fp64_br16", "gpu_fp64_k4", "gpu_fp32_one_block", "gpu_3xtf32_planes",
                 "gpu_fp32_fwd_mma", "gpu_fp32_bwd_mma",
                 "hopper_ext", "hopper_variants")


def _session(tmp_path, budget, stub_body='printf "%s\\n" "---" "$@" >> "$STUB_LOG"; echo stub', steps=None):
    """gpu_session.sh with stub ``python`` and ``nvidia-smi`` first on PATH; (rc, summary lines, stub calls)."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name in ("python", "nvidia-smi"):
        (stubs / name).write_text("#!/bin/sh\n%s\n" % stub_body)
        (stubs / name).chmod(0o755)
    env = dict(os.environ, PATH="%s:/usr/bin:/bin" % stubs, OUT=str(tmp_path / "out"), STUB_LOG=str(tmp_path / "log"),
               GPU_SESSION_BUDGET_S=str(budget))
    env.pop("PYTHON", None)
    env.pop("GPU_SESSION_STEPS", None)
    if steps is not None:
        env["GPU_SESSION_STEPS"] = steps
    res = subprocess.run(["bash", str(SESSION)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    log = tmp_path / "log"
    calls = [c.strip("\n").split("\n") for c in log.read_text().split("---\n")[1:]] if log.exists() else []
    probes = [c for c in calls if c[0] == "-c"]  # the script's `python -c "import xdist"` and the like
    assert all(c[1].startswith("import ") for c in probes), probes
    return res.returncode, summary, [c for c in calls if c[0] != "-c"]


def test_gpu_session_script_parses():
    assert subprocess.run(["bash", "-n", str(SESSION)], capture_output=True).returncode == 0


def test_gpu_session_runs_every_step_and_names_real_commands(tmp_path, monkeypatch):
    """With stubs every step runs (rc 0) and is logged; every script it names exists and takes the options it
    is given (their --help), and the pytest marker expression uses setup.cfg's markers."""
    rc, summary, calls = _session(tmp_path, 60)
    assert rc == 0, summary
    for i, step in enumerate(SESSION_STEPS, 1):
        assert any(line.startswith("step %d %s: start" % (i, step)) for line in summary), summary
        assert any(line.startswith("step %d %s: end" % (i, step)) and " rc 0 " in line for line in summary), summary
    assert all((tmp_path / "out" / ("%02d_%s.log" % (i, s))).exists() for i, s in enumerate(SESSION_STEPS, 1))
    scripts = [c for c in calls if c[0].startswith("benchmarks/")]
    assert [c[0] for c in scripts] == ["benchmarks/overhead.py", "benchmarks/gpu.py"] + [
        "benchmarks/hopper_variants.py"] * 2 + ["benchmarks/gpu.py"] * 3 + ["benchmarks/hopper_variants.py"] * 2
    assert "fwd.THREE_WARPGROUPS,bwd.DQ_SPLIT,bwd.KT_REGS,bwd.SCORES_AHEAD,bwd.SPLIT_OVERLAP,bwd.DQ_BUFFERS,bwd.DQ_BULK,bwd.QUERY_SPLIT,bwd.ENTRIES_FIRST,fwd.PERSISTENT_CAUSAL_MAX_HEAD_DIM,mma.ENTRIES_FIRST" \
        in scripts[2] \
        and "ext" in scripts[-2] and "--only" not in scripts[-1]
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    assert [s.name for s in importlib.import_module("hopper_variants").select(scripts[2][2])] == [
        "fwd.PERSISTENT_CAUSAL_MAX_HEAD_DIM", "fwd.THREE_WARPGROUPS", "bwd.DQ_BULK", "bwd.QUERY_SPLIT",
        "bwd.ENTRIES_FIRST", "bwd.DQ_SPLIT", "bwd.KT_REGS", "bwd.DQ_BUFFERS", "bwd.SCORES_AHEAD", "bwd.SPLIT_OVERLAP", "mma.ENTRIES_FIRST"]
    assert [s.name for s in importlib.import_module("hopper_variants").select(scripts[3][2])] == [
        "bwd.kernel", "mma.WIDE_BC64_LARGE", "mma.GRID_LAYOUT", "bwd.kernel.window"] and "256" in scripts[3]
    helps = {}
    for script, *args in scripts:
        if script not in helps:
            res = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True,
                                 env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
            assert res.returncode == 0, res.stderr
            helps[script] = res.stdout
        assert all(a in helps[script] for a in args if a.startswith("--")), (script, args)
    pytest_calls = [c for c in calls if c[:2] == ["-m", "pytest"]]
    assert [c[-1] for c in pytest_calls] == ["tests/", "tests/test_gpu_sm90.py"]
    for pytest_call in pytest_calls:
        marker = pytest_call[pytest_call.index("-m", 2) + 1]
        assert marker == "gpu and not slow" and "-n" in pytest_call and "--timeout" in pytest_call
    assert "--ignore=tests/test_gpu_sm90.py" in pytest_calls[0]
    assert len([c for c in calls if c[:1] == ["-"]]) == 2  # smi's and smoke's `python -` (scripts on stdin)
    cfg = (ROOT / "setup.cfg").read_text()
    assert "gpu: " in cfg and "slow: " in cfg
    assert "cuda12 = " in cfg and "test =" in cfg                    # the install step's extras


def test_gpu_session_runs_the_selected_steps_only(tmp_path):
    """GPU_SESSION_STEPS runs the named steps in the script's order; the rest are logged, not run, not failed."""
    rc, summary, calls = _session(tmp_path, 60, steps="gpu_fp64_k4,smi,pytest_sm90")
    assert rc == 0, summary
    ran = [line.split(":")[0] for line in summary if ": start " in line]
    assert ran == ["step %d %s" % (SESSION_STEPS.index(s) + 1, s) for s in ("smi", "pytest_sm90", "gpu_fp64_k4")]
    assert len([line for line in summary if "not selected" in line]) == len(SESSION_STEPS) - 3
    assert [c[-1] for c in calls if c[:2] == ["-m", "pytest"]] == ["tests/test_gpu_sm90.py"]


def test_gpu_session_refuses_an_unknown_step(tmp_path):
    """A name in GPU_SESSION_STEPS that is no step: exit 2 naming it, before anything runs or is written."""
    res = subprocess.run(["bash", str(SESSION)], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                         env=dict(os.environ, GPU_SESSION_STEPS="smi,gpu_fp64_k16", OUT=str(tmp_path / "out")))
    assert res.returncode == 2 and "'gpu_fp64_k16'" in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()


def test_gpu_session_calls_name_every_step_once(tmp_path):
    """`--calls` prints the two calls of a session: real step names, together every step, none twice in a call."""
    res = subprocess.run(["bash", str(SESSION), "--calls"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    calls = dict(line.split("=", 1) for line in res.stdout.split())
    assert sorted(calls) == ["CALL_A", "CALL_B"]
    a, b = (calls[k].split(",") for k in ("CALL_A", "CALL_B"))
    assert len(set(a)) == len(a) and len(set(b)) == len(b)
    assert set(a) | set(b) == set(SESSION_STEPS)
    assert {"install", "smi", "smoke"} <= set(a) & set(b)
    assert not (tmp_path / "gpu_session_out").exists()  # --calls runs nothing


def test_gpu_session_skips_steps_past_its_budget(tmp_path):
    rc, summary, calls = _session(tmp_path, 3)
    assert rc == 1 and calls == []
    assert [line.split(":")[0] for line in summary if "skipped (total budget spent" in line] == [
        "step %d %s" % (i, s) for i, s in enumerate(SESSION_STEPS, 1)]
