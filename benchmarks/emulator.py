"""How fast is the CUDA emulator?

Measures (1) the cost of one fiber context switch (the emulator's inner loop: every CUDA thread is a
fiber that switches to the block scheduler at each barrier and warp collective) and (2) the wall
time of the tiled tensor-core fp16 GEMM from tests/kernels/gemm_fp16.cu (ldmatrix + mma.m16n8k16 +
double-buffered cp.async, 4 warps per block) on the emulator, validated against NumPy first.

Run:  python benchmarks/emulator.py [--repeats N] [--workers N]
Prints a table; saves benchmarks/results/emulator.png when matplotlib is installed.
"""
import argparse
import os
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
try:
    from flasharray import emulator
except ImportError:   # running from a source checkout without installing
    import sys
    sys.path.insert(0, str(ROOT))
    from flasharray import emulator
BM, BN, BK, PAD, STAGES = 64, 64, 32, 8, 2          # tile constants of gemm_fp16.cu
SMEM = STAGES * (BM * (BK + PAD) + BK * (BN + PAD)) * 2


def gemm(mod, A, B, **kw):
    M, K = A.shape
    N = B.shape[1]
    C = np.zeros((M, N), np.float32)
    c = mod.launch("gemm_fp16<0>", (-(-N // BN), -(-M // BM)), 128, (C, A, B, np.int32(M), np.int32(N), np.int32(K)),
                   shared_mem=SMEM, **kw)
    return C, c


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workers", type=int, default=0, help="OS threads for blocks (0: all usable cores)")
    args = ap.parse_args()
    workers = args.workers or len(os.sched_getaffinity(0))

    switch_ns = min(emulator.switch_cost_ns(2_000_000) for _ in range(3))
    print("fiber context switch: %.1f ns/switch (x86-64 hand-written switch, best of 3 x 2M)" % switch_ns)

    t0 = time.perf_counter()
    mod = emulator.Module((ROOT / "tests" / "kernels" / "gemm_fp16.cu").read_text(), name_expressions=["gemm_fp16<0>"])
    print("module load (compile or cache hit): %.2f s   cache: %s" % (time.perf_counter() - t0, emulator.cache_dir()))
    print()
    header = "%-15s | %-8s | %7s | %9s | %9s | %8s | %8s | %10s" % (
        "shape MxNxK", "schedule", "workers", "ms", "MFLOP/s", "MB read", "MB write", "switches")
    print(header)
    print("-" * len(header))
    rows = []
    rng = np.random.default_rng(0)
    for size in (64, 128, 256):
        A = rng.standard_normal((size, size)).astype(np.float16)
        B = rng.standard_normal((size, size)).astype(np.float16)
        ref = A.astype(np.float64) @ B.astype(np.float64)
        for schedule, w in sorted({("forward", 1), ("forward", workers), ("random", workers)}):
            C, c = gemm(mod, A, B, schedule=schedule, workers=w)          # validate (and warm up)
            assert np.allclose(C, ref, rtol=1e-4, atol=1e-3), "emulated GEMM disagrees with NumPy"
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                gemm(mod, A, B, schedule=schedule, workers=w)
                times.append(time.perf_counter() - t)
            ms = 1e3 * min(times)
            flops = 2.0 * size ** 3
            print("%-15s | %-8s | %7d | %9.2f | %9.1f | %8.3f | %8.3f | %10d" % (
                "%dx%dx%d" % (size, size, size), schedule, w, ms, flops / ms / 1e3,
                c.global_read_bytes / 1e6, c.global_write_bytes / 1e6, c.fiber_switches))
            rows.append((size, schedule, w, ms))
    t128 = min(ms for s, sch, w, ms in rows if s == 128 and sch == "forward") / 1e3
    print()
    print("128x128x128 fp16 GEMM on the emulator: %.3f s (target <= 0.5 s): %s" % (t128, "OK" if t128 <= 0.5 else "SLOW"))

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for schedule, w in sorted({(sch, w) for _, sch, w, _ in rows}):
        pts = [(s, ms) for s, sch, ww, ms in rows if sch == schedule and ww == w]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label="%s, %d worker(s)" % (schedule, w))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("M = N = K")
    ax.set_ylabel("ms per launch")
    ax.set_title("fp16 tensor-core GEMM on the CPU emulator")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "emulator.png", dpi=120)
    print("plot: %s" % (out / "emulator.png"))


if __name__ == "__main__":
    main()
