"""HBM traffic of one attention backward: FlashAttention's (measured) vs standard attention's.

The FlashAttention backward never reads or writes an N×N matrix: it recomputes P block by block
from Q, K and the saved LSE. Its traffic is Q, dO, LSE and D once per key block (the dK/dV
kernel keeps K_j, V_j on chip while it walks the query blocks) plus, for the deterministic dQ
kernel, K, V once per query block: Θ(N²d/Bc + N²d/Br) with tiles Br, Bc bounded by SRAM —
Θ(N²d²/M). Standard attention's backward reads the P it stored in the forward and writes and
reads dP and dS (N×N each).

This script runs the backward kernels on the emulator, which counts every byte moved by global
loads/stores, atomics and cp.async (the kernels' HBM traffic; no cache is modelled), and
compares:

* measured    — emulator counters, batch·heads = 1, fp16, non-causal, d = 64, both dQ modes;
* analytic    — ``cuda_backward.analytic_global_bytes`` (must equal the measurement exactly;
                the script exits 1 if not);
* standard    — unfused backward on materialized P (fp16 elements, D_i in fp32):
                dV = PᵀdO (read P, dO; write dV), dP = dO Vᵀ (read dO, V; write dP),
                D = rowsum(dO∘O) (read dO, O; write D), dS = P∘(dP − D) (read P, dP, D; write dS),
                dQ = dS K, dK = dSᵀQ (read dS twice, K, Q; write dQ, dK)
                = 7N² + 10Nd elements + 2N floats.

Rows past the largest measured N are extrapolated with the verified analytic formula.
Usage: python benchmarks/io_backward.py [--max-n 1024] [--plot io_backward.png]
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from flasharray import reference  # noqa: E402
from flasharray._private import cuda_backward, tiles_bwd  # noqa: E402

D = 64
DTYPE = np.float16
MEASURED_N = (256, 512, 1024)
EXTRAPOLATED_N = (2048, 4096, 8192, 16384)
MODES = (("det", True), ("atomic", False))


def standard_bytes(n, d, elem=2):
    """Unfused backward on the stored P: 7 N×N and 10 N×d element accesses, D_i in fp32."""
    return (7 * n * n + 10 * n * d) * elem + 2 * n * 4


def flash_bytes(n, d, deterministic):
    r, w = cuda_backward.analytic_global_bytes(1, n, n, d, d, DTYPE, deterministic=deterministic)
    return r + w


def measure(n, d, deterministic):
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, n, d)).astype(DTYPE) for _ in range(4))
    out, lse = reference.attention(q, k, v, return_lse=True)
    t0 = time.perf_counter()
    *_, counters = cuda_backward.backward(dout, q, k, v, out.astype(DTYPE), lse.astype(np.float32),
                                          causal=False, scale=d ** -0.5, batch_shape=(1,),
                                          device="emulator", deterministic=deterministic,
                                          return_counters=True)
    return sum(c.global_bytes for _, c in counters), time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-n", type=int, default=1024, help="largest N run on the emulator")
    ap.add_argument("--plot", default=None, help="save a log-log plot to this file")
    args = ap.parse_args(argv)

    kv = tiles_bwd.tc_tiles("dkv", D, D, tiles_bwd.EMULATOR_ARCH)
    dq = tiles_bwd.tc_tiles("dq", D, D, tiles_bwd.EMULATOR_ARCH)
    print("HBM bytes per backward, fp16, d=%d, batch·heads=1, non-causal (emulator counts)" % D)
    print("tiles (sm_%d): dK/dV kernel Br=%d Bc=%d, dQ kernel Br=%d Bc=%d" % (
        tiles_bwd.EMULATOR_ARCH, kv.block_m, kv.block_n, dq.block_m, dq.block_n))
    print("%-6s | %-6s | %11s | %11s | %8s | %11s | %6s | %s" % (
        "N", "dQ", "flash MB", "analytic MB", "meas/an", "standard MB", "ratio", "source"))
    print("-" * 90)
    rows, ok = [], True
    for n in MEASURED_N + EXTRAPOLATED_N:
        for label, det in MODES:
            an = flash_bytes(n, D, det)
            std = standard_bytes(n, D)
            if n <= args.max_n and n in MEASURED_N:
                meas, secs = measure(n, D, det)
                ok &= meas == an
                src = "emulator (%.1f s)" % secs
                shown, rel = meas, "%.3f" % (meas / an)
            else:
                shown, rel, src = an, "-", "extrapolated (analytic)"
            rows.append((n, label, shown, std))
            print("%-6d | %-6s | %11.3f | %11.3f | %8s | %11.3f | %5.1fx | %s" % (
                n, label, shown / 1e6, an / 1e6, rel, std / 1e6, std / shown, src))
    print()
    print("measured == analytic for every measured row: %s" % ("yes" if ok else "NO"))
    # Large N: flash ≈ N²·((2d·s + 2·4)/Bc + 2d·s/Br) (deterministic), standard ≈ 7N²·s.
    s = np.dtype(DTYPE).itemsize
    per_n2 = (2 * D * s + 8) / kv.block_n + 2 * D * s / dq.block_m
    print("large-N limit (deterministic): flash %.2f B per N², standard %d B per N², ratio %.2fx; "
          "the flash term shrinks as the tiles Br, Bc (SRAM) grow: Θ(N²d²/M)" % (per_n2, 7 * s, 7 * s / per_n2))
    if args.plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib not installed: no plot")
        else:
            fig, ax = plt.subplots(figsize=(6, 4))
            ns = sorted({r[0] for r in rows})
            ax.loglog(ns, [standard_bytes(n, D) / 1e6 for n in ns], "k-o", label="standard (P, dP, dS in HBM)")
            for label, _ in MODES:
                ax.loglog(ns, [r[2] / 1e6 for r in rows if r[1] == label], "-o", label="flash, dQ " + label)
            ax.set_xlabel("N")
            ax.set_ylabel("HBM MB per backward")
            ax.set_title("fp16, d=%d" % D)
            ax.legend()
            fig.tight_layout()
            fig.savefig(args.plot)
            print("plot saved to %s" % args.plot)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
