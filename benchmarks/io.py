"""HBM traffic of one attention forward: FlashAttention (measured) vs standard attention.

FlashAttention's claim is IO: standard attention writes S = QKᵀ and P = softmax(S) (N×N each)
to HBM and reads them back, Θ(Nd + N²) accesses; the tiled kernel moves only Q, K, V, O and the
LSE, re-reading K and V once per query tile: Θ(N²d²/M) for on-chip memory M (here: the query
tile height Br that shared memory and registers allow).

This script runs the CUDA forward kernel on the emulator, which counts every byte moved by
global loads/stores and cp.async (the kernel's HBM traffic; no cache is modelled), and compares:

* measured    — emulator counters, batch·heads = 1, fp16, non-causal;
* analytic    — Q once + K,V once per query tile (Tr = ceil(N/Br) times) + O and LSE once,
                in bytes; must equal the measurement exactly (checked; the script exits 1 if not);
* standard    — unfused attention with S and P materialized in fp16:
                read Q,K, write S; read S, write P; read P,V, write O = 4N² + 4Nd elements.

Rows past the largest measured N are extrapolated with the verified analytic formula.

``--block-sparse`` adds the paper's §3.3 result (Fig. 3 right): block-sparse FlashAttention
(``block_mask``, 128×128 blocks, random masks of decreasing density, the diagonal blocks kept so
every row sees a key) skips the masked-out blocks entirely, so its measured HBM traffic falls in
proportion to the density: bytes ≈ Q + O once, plus K and V once per visible (query tile, key
tile) pair, which is also checked against the count of visible tile pairs.

Usage: python benchmarks/io.py [--max-n 2048] [--plot io.png] [--block-sparse]
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from flasharray._private import cuda_forward, extensions, tiles  # noqa: E402

D = 64
DTYPE = np.float16
MEASURED_N = (256, 512, 1024, 2048)
EXTRAPOLATED_N = (4096, 8192, 16384)
TILES = [("default", None), ("io-384", 384), ("io-512", 512)]


def standard_bytes(n, d, elem=2):
    """Unfused attention: S and P (N×N) written and read back once each, in the input dtype."""
    return (4 * n * n + 4 * n * d) * elem


def flash_bytes(n, d, tile):
    r, w = cuda_forward.analytic_global_bytes(1, n, n, d, d, DTYPE, tile)
    return r + w


def measure(n, d, block_m):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, n, d)).astype(DTYPE) for _ in range(3))
    counters = []
    t0 = time.perf_counter()
    cuda_forward.forward(q, k, v, causal=False, scale=d ** -0.5, batch_shape=(1,), device="emulator",
                         counters=counters, block_m=block_m, num_splits=1)  # the dense algorithm's IO
    return counters[0].global_read_bytes + counters[0].global_write_bytes, time.perf_counter() - t0


SPARSE_N = 1024
SPARSE_BLOCK = 128
DENSITIES = (1.0, 0.5, 0.25, 0.125)


def random_block_mask(n_blocks, density, rng):
    """A (T, T) block mask with round(density·T²) True blocks: the diagonal, then random others."""
    mask = np.eye(n_blocks, dtype=bool)
    off = np.flatnonzero(~mask.ravel())
    extra = max(0, int(round(density * n_blocks * n_blocks)) - n_blocks)
    mask.ravel()[rng.choice(off, size=extra, replace=False)] = True
    return mask


def measure_sparse(n, d, mask):
    """Emulator HBM bytes of one forward with ``block_mask=mask`` (blocks of SPARSE_BLOCK)."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, n, d)).astype(DTYPE) for _ in range(3))
    ext = extensions.from_options({"block_mask": mask[None], "block_size": (SPARSE_BLOCK, SPARSE_BLOCK)},
                                  kind="numpy", batch_shape=(1,), Lq=n, Lk=n, acc=np.dtype(np.float32))
    counters = []
    cuda_forward.forward(q, k, v, causal=False, scale=d ** -0.5, batch_shape=(1,), device="emulator",
                         counters=counters, num_splits=1, ext=ext)
    c = counters[0]
    total = c.global_read_bytes + c.global_write_bytes
    qkvo = sum(t.read_bytes + t.write_bytes for i, t in c.buffers.items() if i <= 4)  # q, k, v, out, lse
    return qkvo, total - qkvo


def sparse_expected_bytes(n, d, mask, tile):
    """Q, O and LSE once; K and V once per (query tile, key tile) pair whose blocks are not all False."""
    elem = np.dtype(DTYPE).itemsize
    br, bc = tile.block_m, tile.block_n
    pairs = 0
    for i0 in range(0, n, br):
        for j0 in range(0, n, bc):
            rows = slice(i0 // SPARSE_BLOCK, (min(i0 + br, n) - 1) // SPARSE_BLOCK + 1)
            cols = slice(j0 // SPARSE_BLOCK, (min(j0 + bc, n) - 1) // SPARSE_BLOCK + 1)
            pairs += bool(mask[rows, cols].any()) * min(bc, n - j0)
    return (2 * n * d + 2 * pairs * d) * elem + n * 4


def block_sparse_table():
    """Rows (density, measured bytes, expected bytes); prints the table. True if all match."""
    tile = cuda_forward.kernel_for(DTYPE, D, D, tiles.EMULATOR_ARCH, ext=True)  # the kExt kernels' tile
    n_blocks = -(-SPARSE_N // SPARSE_BLOCK)
    rng = np.random.default_rng(0)
    print()
    print("Block-sparse forward (block_mask, %dx%d blocks), N=%d, fp16, d=%d, tile %dx%d (emulator counts)"
          % (SPARSE_BLOCK, SPARSE_BLOCK, SPARSE_N, D, tile.block_m, tile.block_n))
    print("%-8s | %-14s | %11s | %11s | %9s | %8s | %s" % (
        "density", "blocks kept", "Q,K,V,O MB", "expected MB", "vs dense", "meas/exp", "mask lookups KB"))
    print("-" * 92)
    ok, dense = True, None
    for density in DENSITIES:
        mask = random_block_mask(n_blocks, density, rng)
        meas, mask_bytes = measure_sparse(SPARSE_N, D, mask)
        exp = sparse_expected_bytes(SPARSE_N, D, mask, tile)
        dense = meas if dense is None else dense
        ok &= meas == exp
        print("%-8.3f | %5d / %-6d | %11.3f | %11.3f | %8.2fx | %8.3f | %.1f" % (
            density, mask.sum(), mask.size, meas / 1e6, exp / 1e6, meas / dense, meas / exp, mask_bytes / 1e3))
    print("IO falls with the density of the mask (the paper's Fig. 3 right): masked-out blocks are never read.")
    print("Mask lookups: the kernel's reads of block_mask entries (a few hundred bytes per visited tile")
    print("pair; on a GPU these hit L1/L2: the whole mask here is %d bytes)" % (n_blocks * n_blocks))
    return ok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-n", type=int, default=2048, help="largest N run on the emulator")
    ap.add_argument("--plot", default=None, help="save a log-log plot to this file")
    ap.add_argument("--block-sparse", action="store_true", help="add the block-sparse table (§3.3)")
    args = ap.parse_args(argv)

    print("HBM bytes per forward, fp16, d=%d, batch·heads=1, non-causal (emulator counts)" % D)
    print("%-6s | %-8s | %5s | %11s | %11s | %8s | %11s | %6s | %s" % (
        "N", "tile", "Br", "flash MB", "analytic MB", "meas/an", "standard MB", "ratio", "source"))
    print("-" * 96)
    rows, ok = [], True
    for n in MEASURED_N + EXTRAPOLATED_N:
        for label, block_m in TILES:
            tile = cuda_forward.kernel_for(DTYPE, D, D, tiles.EMULATOR_ARCH, block_m=block_m)
            an = flash_bytes(n, D, tile)
            std = standard_bytes(n, D)
            if n <= args.max_n and n in MEASURED_N:
                meas, secs = measure(n, D, block_m)
                ok &= meas == an
                src = "emulator (%.1f s)" % secs
                shown, rel = meas, "%.3f" % (meas / an)
            else:
                shown, rel, src = an, "-", "extrapolated (analytic)"
            rows.append((n, label, tile.block_m, shown, std))
            print("%-6d | %-8s | %5d | %11.3f | %11.3f | %8s | %11.3f | %5.1fx | %s" % (
                n, label, tile.block_m, shown / 1e6, an / 1e6, rel, std / 1e6, std / shown, src))
    print()
    print("measured == analytic for every measured row: %s" % ("yes" if ok else "NO"))
    print("standard/flash ratio ~ 2·Br/d for large N: the tile height Br (what SRAM allows) sets the IO")
    if args.block_sparse:
        sparse_ok = block_sparse_table()
        print("measured == expected for every block-sparse row: %s" % ("yes" if sparse_ok else "NO"))
        ok &= sparse_ok
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
            ax.loglog(ns, [standard_bytes(n, D) / 1e6 for n in ns], "k-o", label="standard (S, P in HBM)")
            for label, _ in TILES:
                ax.loglog(ns, [r[3] / 1e6 for r in rows if r[1] == label], "-o", label="flash " + label)
            ax.set_xlabel("N")
            ax.set_ylabel("HBM MB per forward")
            ax.set_title("fp16, d=%d" % D)
            ax.legend()
            fig.tight_layout()
            fig.savefig(args.plot)
            print("plot saved to %s" % args.plot)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
