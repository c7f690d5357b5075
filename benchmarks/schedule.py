"""Tail effect of the causal forward's block order: a model, no GPU needed.

A causal forward's query tiles differ in work: with the diagonal (bottom-right aligned), query
tile m of Br rows sees ceil((m + 1) Br / Bc) key tiles. A GPU dispatches thread blocks in
increasing linear index (x fastest) onto whichever SM slot frees first. With the tiles in order,
every head's longest tiles are dispatched last, and the grid's last wave runs a few long blocks on
an otherwise idle GPU. ``query_tile`` (``cuda_src/flash_block_info.cuh``) gives causal blocks their
tiles longest first, as FlashAttention-3 (and our persistent Hopper scheduler) do.

This script predicts what that is worth on FlashAttention-2's benchmark shapes (batch x seqlen =
16k tokens, hidden 2048: H = 2048 / D), by list scheduling: ``SMs x blocks per SM`` slots, block
cost = ``--overhead`` (prologue and epilogue, in key-tile units) + its key tiles, blocks taken in
dispatch order by the earliest free slot. Tiles and blocks per SM are the library's: the tile table
and the occupancy of the compiled causal forward (NVRTC + cuobjdump, as ``benchmarks/sass.py``).
Efficiency = the work's average per slot / the makespan (1.0: no tail). It is a model: blocks
sharing an SM share its throughput, and the dispatch is only roughly in order; the GPU's figure is
``benchmarks/gpu.py --backward`` (causal rows).

    python benchmarks/schedule.py                 # sm_90 (132 SMs), fp16, D 64 / 128 / 256
    python benchmarks/schedule.py --arch 80 --overhead 2
"""
import argparse
import heapq
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from flasharray._private import sass, tiles  # noqa: E402

SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
TOKENS = 16384
HIDDEN = 2048


def makespan(costs, slots):
    """Finish time of ``costs`` taken in order, each by the earliest free of ``slots``."""
    free = [0.0] * slots
    end = 0.0
    for c in costs:
        t = heapq.heappop(free) + c
        end = max(end, t)
        heapq.heappush(free, t)
    return end


def tile_costs(n, block_m, block_n, overhead):
    """Cost of each causal query tile m = 0, 1, ... of an n x n problem (key tiles + overhead)."""
    n_m = -(-n // block_m)
    return [overhead + -(-min((m + 1) * block_m, n) // block_n) for m in range(n_m)]


def efficiencies(n, heads, block_m, block_n, slots, overhead):
    """(in-order, longest-first) efficiency of a grid of ``heads`` x query tiles."""
    costs = tile_costs(n, block_m, block_n, overhead)
    in_order = costs * heads                   # x fastest: each head's tiles, shortest first
    longest_first = costs[::-1] * heads        # query_tile<true>: n_m - 1 - x
    ideal = sum(in_order) / slots
    return ideal / makespan(in_order, slots), ideal / makespan(longest_first, slots)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability (SM count: tiles.EMULATOR_SM_COUNT)")
    ap.add_argument("--overhead", type=float, default=1.0, help="per-block cost beyond its key tiles, in key tiles")
    ap.add_argument("--head-dims", default="64,128,256")
    args = ap.parse_args(argv)
    dims = tuple(int(d) for d in args.head_dims.split(","))
    sms = tiles.EMULATOR_SM_COUNT[args.arch]
    specs = sass.kernel_specs(archs=(args.arch,), dtypes=("float16",), head_dims=dims, roles=("fwd",), causal=True)
    print("causal forward, fp16, sm_%d (%d SMs), block overhead %.1f key tiles; efficiency = ideal / makespan"
          % (args.arch, sms, args.overhead))
    print("| D | Br x Bc | blocks/SM | N | B x H | blocks | in order | longest first | predicted speed-up |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in sass.report(specs):
        d, slots = r.spec.head_dim, sms * r.occupancy.blocks
        t = tiles.forward_tile("float16", d, d, args.arch, wide=tiles.causal_takes_wide("float16", d, d, args.arch),
                               causal=True)
        for n in SEQLENS:
            heads = (TOKENS // n) * (HIDDEN // d)
            a, b = efficiencies(n, heads, t.block_m, t.block_n, slots, args.overhead)
            print("| %d | %d x %d | %d | %d | %d | %d | %.3f | %.3f | %.3f |"
                  % (d, t.block_m, t.block_n, r.occupancy.blocks, n, heads, heads * -(-n // t.block_m), a, b, b / a))


if __name__ == "__main__":
    main()
