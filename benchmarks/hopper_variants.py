"""Hopper (sm_90a) design switches timed on vs off: which module-level flag defaults to keep (docs/hopper.md).

Each switch is a module-level flag of the opt-in Hopper kernels (``kernel="wgmma"``) whose default was chosen
without a GPU; this script times the kernels with the flag at its default and flipped, on the same inputs:

  fwd.OVERLAP                  cuda_forward_sm90.OVERLAP: each consumer warpgroup's softmax overlapped with its
                               own P V wgmmas (off: the ping-pong between the two warpgroups alone)
  fwd.USE_TMA_STORE            cuda_forward_sm90.USE_TMA_STORE: O by TMA stores (off: 16-byte row stores)
  fwd.PERSISTENT               cuda_forward_sm90.PERSISTENT: persistent grid + static tile scheduler (off: one
                               block per work tile); padded d <= PERSISTENT_MAX_HEAD_DIM only
  fwd.PERSISTENT_MAX_HEAD_DIM  256 (default: d = 256 persistent, zero spills since the twenty-third session) vs 128
                               (d = 256 one block per work tile)
  fwd.PERSISTENT_CAUSAL_MAX_HEAD_DIM
                               128 (default: causal d = 256 one block per work tile; its persistent loop is 14 %
                               longer in the SASS, cause not found) vs 256 (causal d = 256 persistent)
  fwd.CAUSAL_PAIRS             cuda_forward_sm90.CAUSAL_PAIRS: the persistent kernel's causal tiles paired (m and
                               n_m - 1 - m on one block) in L2 groups of entries (off: longest first, every entry
                               of a query tile together); causal rows only
  fwd.WIDE_KEYS                cuda_forward_sm90.WIDE_KEYS: the ws kernel's key tiles of 192 / 176 at padded d = dv
                               64 / 128, dense non-causal calls (off: 128); non-causal rows only
  fwd.THREE_WARPGROUPS         cuda_forward_sm90.THREE_WARPGROUPS (default off): the ws kernel's dense calls at padded
                               d = dv = 64 on three consumer warpgroups, 192 x 128 (off: two, 128 x 192 / 128 x 128)
  fwd.USE_TMA                  cuda_forward_sm90.USE_TMA: the warp-specialized TMA kernel (off: cp.async kernel)
  fwd.kernel                   the wgmma forward (all defaults) vs the mma.sync forward (kernel="tensor_core"):
                               ratio > 1 means wgmma is faster, i.e. keep sm_90's automatic dispatch
  bwd.DQ_BULK                  cuda_backward_sm90.DQ_BULK: dQ by shared memory + one bulk reduce-add from a dQ
                               warp (off: the consumers' fp32 atomics); padded d, dv <= 128, and d = dv = 256
                               (staged over the stage's panels, added by the dQ warp)
  bwd.USE_TMA_STORE            cuda_backward_sm90.USE_TMA_STORE: dK, dV by TMA stores (off: 16-byte stores)
  bwd.USE_TMA                  cuda_backward_sm90.USE_TMA: the warp-specialized TMA dK/dV kernel (off: cp.async)
  bwd.KV_REGS                  cuda_backward_sm90.KV_REGS: the ws kernel at d = dv = 64 holds K_j, V_j in registers,
                               the A of S^T and dP^T (RS wgmma; off: SS, both operands from shared memory)
  bwd.QUERY_SPLIT              cuda_backward_sm90.QUERY_SPLIT: the ws kernel's head-dim split (d 256) computes S^T,
                               dP^T for half of the queries in each warpgroup (off: all of them in both, 40 % more
                               tensor work)
  bwd.ENTRIES_FIRST            cuda_backward_sm90.ENTRIES_FIRST: the ws kernel's ordered dQ mode takes its blocks
                               entries first (off: the grid's key blocks first, the running blocks' dQ turns
                               chained); det only
  bwd.DQ_SPLIT                 cuda_backward_sm90.DQ_SPLIT: the ws kernel at d = 64 splits dQ^T over both consumer
                               warpgroups by queries (off: warpgroup 0 computes all of it, 8 wgmmas more per visit)
  bwd.KT_REGS                  cuda_backward_sm90.KT_REGS: the ws kernel's dQ split (d = 64) holds K_j^T in registers,
                               the A of the dQ^T wgmmas (RS; off: K_j's panel from shared memory per wgmma, SS)
  bwd.DQ_BUFFERS               cuda_backward_sm90.DQ_BUFFERS (2 by default; flipped to 4): the ws kernel's bulk dQ at
                               d = 64 with four dQ buffers, the consumers up to three visits ahead of the dQ warp
  bwd.SCORES_AHEAD             cuda_backward_sm90.SCORES_AHEAD (off by default; flipped on): the ws kernel's dQ split
                               (d = 64) issues each visit's S^T behind the previous visit's dQ^T (and dV's batch with
                               dK's), against the default (S^T after dQ^T is stored; dV's batch behind dP^T's)
  bwd.SPLIT_OVERLAP            cuda_backward_sm90.SPLIT_OVERLAP (off by default; flipped on): the ws kernel's query
                               split (d = 256) issues dP^T right behind S^T and its dQ^T batches before the wait for
                               the dV_j, dK_j batch, against the default (dP^T after P^T is staged, dQ^T after the wait)
  bwd.kernel                   the wgmma backward vs the mma.sync backward (kernel="tc")
  mma.WIDE_ROWS                tiles.WIDE_ROWS, the mma.sync forward's own switch (both sides
                               kernel="tensor_core", sm_90's kernel=None being the wgmma forward): the
                               128 x 32 tiles at d > 64 non-causal (off: the table's 64 x 64 / 64 x 32)
  mma.WIDE_BC64                tiles.WIDE_BC64, the mma.sync forward's (both sides kernel="tensor_core"): at
                               64 < d <= 128 non-causal FlashAttention-2's 128 x 64 single-buffered tile (off: 128 x 32
                               double-buffered)
  mma.WIDE_BC64_LARGE          tiles.WIDE_BC64_LARGE (both sides kernel="tensor_core"): at d > 128 FlashAttention-2's
                               128 x 64 8-warp single-buffered tile (off: 128 x 32 double-buffered; the same shared
                               memory); non-causal rows (causal ones take it on sm_80 only)
  mma.WIDE_BC64_CAUSAL         tiles.WIDE_BC64_CAUSAL (both sides kernel="tensor_core"): causal calls at 64 < d = dv
                               <= 128 on FlashAttention-2's 128 x 64 single-buffered tile (off: 128 x 32
                               double-buffered)
  mma.WIDE_CAUSAL              tiles.WIDE_CAUSAL_ARCHS without sm_90: causal calls on sm_90 keep the square tile
                               (the default: the wide-row tiles at d <= 128, as non-causal calls; causal rows only)
  mma.WIDE_KEYS                tiles_bwd.WIDE_KEYS, the mma.sync backward's (both sides kernel="tc"): the row-tile
                               dK/dV kernel's 128-key x 32-query tile at d 80-128 and 64 x 32 at d 256 (off: 64 x 64
                               at d 128, 32 x 64 at d 256); both sides with the grid layout off (its ``under``), as
                               the grid kernel serves d 64 / 128 / 256 on sm_80 / sm_90
  mma.GRID_LAYOUT              tiles_bwd.GRID_LAYOUT, the mma.sync backward's (both sides kernel="tc"): the
                               grid-layout dK/dV kernel (FlashAttention-2's warp grid, 0.5 ldmatrix per MMA) at
                               d 64 / 128 and 0.55 at d 256 in both dQ modes (off: the row-tile kernel, 0.60-0.78)
  mma.GRID_SWIZZLE             tiles_bwd.GRID_SWIZZLE (both sides kernel="tc"): the grid kernel's Q_i, dO_i unpadded
                               and XOR-swizzled (off: padded rows, whose copies an H100 read at 1.5x the sectors)
  mma.ENTRIES_FIRST            tiles_bwd.ENTRIES_FIRST (both sides kernel="tc"): the grid dK/dV kernel's ordered dQ mode
                               takes its blocks entries first (off: the grid's key blocks first); det only
  mma.CAUSAL_GROUPS            tiles.CAUSAL_GROUPS (both sides kernel="tensor_core"): causal dense grids in the grouped
                               longest-first order (off: entry by entry); causal rows only

Extension switches (``--only ext``; not in the default run): the same wgmma-vs-mma.sync comparison with an
extension on both sides (both ``kernel=`` named), to decide sm_90's dispatch of extension calls
(``cuda_forward_sm90.AUTO_EXT``, ``cuda_backward_sm90.AUTO_EXT``):

  fwd.kernel.dropout / bwd.kernel.dropout   dropout_p 0.1
  fwd.kernel.window / bwd.kernel.window     window (255, 0) (both dQ modes: the wgmma ordered mode takes a window
                                            since the fifteenth session)
  fwd.kernel.window1k                       window (1023, 0): where a longer window leaves the mma.sync forward
                                            that sm_90 keeps for windows of <= 384 keys at d <= 64
  bwd.ORDERED_BLOCK_MASK                    cuda_backward.ORDERED_BLOCK_MASK, deterministic, a block mask of half the
                                            128 x 128 blocks: the wgmma backward's ordered dQ (kernel=None's since the
                                            forty-third session) vs the mma.sync recomputing dQ kernel (before)
  mma.GRID_LAYOUT.block_mask                tiles_bwd.GRID_LAYOUT (both sides kernel="tc"), a block mask of half the
                                            128 x 128 blocks: the grid-layout dK/dV kernel (forty-fourth session; d 64
                                            and 256) vs the row-tile kernel, both dQ modes
  mma.GRID_LAYOUT.block_mask_window         the same with a window (255, 0) too (forty-sixth session: at d 128,
                                            where the block mask alone keeps the row tile; and at d 64; d 256 since
                                            the fiftieth session)
  mma.GRID_LAYOUT.dropout                   the same with dropout_p 0.1 (forty-fifth session; at d 256, where sm_90's
                                            dropout calls run the mma.sync backward: the wgmma one refuses them)
  bwd.DQ_BULK_EXT.window / .dropout         cuda_backward_sm90.DQ_BULK_EXT (both sides the wgmma backward): the ws
                                            kernel's bulk dQ for extension calls (the dQ warp walking the consumers'
                                            visits) vs the consumers' atomics, window (255, 0) / dropout_p 0.1
  fwd.SCORE_EXT_OVERLAP_MAX_HEAD_DIM.softcap  softcap 30 on the wgmma forward: the overlap at d 256 (since the
                                            thirty-seventh session) vs every batch waited for (the old limit, 128)
  fwd.PERSISTENT_MAX_HEAD_DIM_SCORE_EXT.softcap  softcap 30: persistent at d 128 / 256 (since the thirty-seventh
                                            session) vs one block per work tile (the old limit, 64)
  fwd.HEAVY_EXT_OVERLAP_MAX_HEAD_DIM.dropout  dropout_p 0.1: the overlap at d 64 (since the thirty-seventh session)
                                            vs every batch waited for (the old route, 0)
  fwd.WIDE_EXT.softcap                      softcap 30: the wide key tiles (192 / 176 / 80 keys, since the
                                            thirty-eighth session) vs the table's (the old route: WIDE_EXT empty)

A shape one side refuses (the wgmma backward's spilling sets at d 128, docs/hopper.md) is left out with a line.

Backward switches are timed in both dQ modes: ``det`` (deterministic=True: key-block-ordered atomics) and
``atomic`` (deterministic=False). The backward's (out, lse) come from the wgmma forward with its defaults.

Per switch a table: shape, mode, ms at the default, ms flipped, ratio = flipped / default (> 1: the default
is faster), TFLOP/s of both (FLOPs as benchmarks/gpu.py: 4·B·H·N²·D, ×0.5 causal, backward ×2.5); then a
summary line: the median ratio (and per head dim) and "keep default" (median > 1.02), "flip" (< 0.98) or
"keep default (within 2 %)"; for the two ``kernel`` rows "wgmma faster: dispatch it", "mma.sync faster" or
"even (within 2 %)". A switch that selects the same kernels as the default for a shape (the plans'
launches compare equal: e.g. PERSISTENT at d = 256) is not timed for it.

Shapes as benchmarks/gpu.py: batch·seqlen = 16k tokens, hidden 2048 (H = 2048 / D); default (the quick set):
fp16, D in {64, 128, 256}, causal and not, N in {1k, 4k, 16k}; ``--full``: fp16 and bf16, N in {1k, 2k, 4k,
8k, 16k}, longer timings. Shapes are taken N-major (every D and mask at 1k first), so that a run cut short
by ``--max-seconds`` still covers every switch.

Every variant's result is validated against the float64 reference (flasharray.testing.check_attention via
benchmarks/gpu.py's / gpu_backward.py's ``check``: first batch entry and head) before it is timed, once per
(dtype, D, causal, mode, variant) at the smallest N: N is no template parameter, so that covers the
instantiation. Timing: benchmarks/gpu_timing.py (untimed first call, warm-up, CUDA events, median). Flags are
set and restored around each variant (try/finally) with the plan caches cleared on both sides (plans are
keyed by call signature, not by the flags).

Without a GPU (or on a GPU other than sm_90) the script says so and exits 0. ``--emulator``: one tiny shape per
switch through the CUDA emulator with arch sm_90 (CPU time, not GPU performance: exercises this script and the
variants in CI). ``--json PATH`` writes the rows and the summary. Exit status 1 when a validation failed or a
variant raised.
Usage: python benchmarks/hopper_variants.py [--full] [--emulator] [--only fwd.OVERLAP,bwd.DQ_BULK | --only ext]
                                           [--seqlens 1024,4096] [--head-dims 256] [--max-seconds S]
                                           [--json PATH]
"""
import argparse
import collections
import contextlib
import json
import math
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import gpu  # noqa: E402  (benchmarks/gpu.py: shapes, inputs, forward check, no-GPU message)
import gpu_backward  # noqa: E402  (its inputs with dout, backward check, FLOP factor)
import gpu_timing  # noqa: E402
from flasharray._private import cuda_backward, cuda_forward, launch, tiles, tiles_bwd  # noqa: E402
from flasharray._private import cuda_backward_sm90 as B  # noqa: E402
from flasharray._private import cuda_forward_sm90 as F  # noqa: E402
from flasharray.testing import check_attention  # noqa: E402

WGMMA = "wgmma"
MMA_FWD, MMA_BWD = "tensor_core", "tc"  # the mma.sync forward and backward, named (kernel=None is wgmma on sm_90)
#: name, pass ("fwd" / "bwd"), module (None: the ``kernel=`` argument), flag, flipped value, what it answers,
#: and the ``kernel=`` argument of the calls both sides of a module flag are timed with (the Hopper kernels,
#: or MMA_FWD: the mma.sync forward's own switch). The ``kernel`` switches' flipped side names the mma.sync
#: kernels (kernel=None on sm_90 is the wgmma one: cuda_forward_sm90.AUTO_DISPATCH).
#: ``under``: (module, flag, value) set on both sides (the row-tile kernel's own switches: the grid layout off)
Switch = collections.namedtuple("Switch", "name kind module flag flipped question base ext modes under",
                                defaults=(WGMMA, "", None, None))
SWITCHES = (
    Switch("fwd.OVERLAP", "fwd", F, "OVERLAP", False, "intra-warpgroup softmax / P V overlap"),
    Switch("fwd.USE_TMA_STORE", "fwd", F, "USE_TMA_STORE", False, "O by TMA store vs row stores"),
    Switch("fwd.PERSISTENT", "fwd", F, "PERSISTENT", False, "persistent kernel + static scheduler"),
    Switch("fwd.PERSISTENT_MAX_HEAD_DIM", "fwd", F, "PERSISTENT_MAX_HEAD_DIM", 128,
           "d = 256 persistent vs one block per work tile"),
    Switch("fwd.PERSISTENT_CAUSAL_MAX_HEAD_DIM", "fwd", F, "PERSISTENT_CAUSAL_MAX_HEAD_DIM", 256,
           "causal d = 256: one block per work tile vs persistent"),
    Switch("fwd.CAUSAL_PAIRS", "fwd", F, "CAUSAL_PAIRS", False,
           "persistent causal order: paired tiles in L2 groups vs longest first"),
    Switch("fwd.WIDE_KEYS", "fwd", F, "WIDE_KEYS", False, "non-causal d 64 / 128: key tiles of 192 / 176 vs 128"),
    Switch("fwd.THREE_WARPGROUPS", "fwd", F, "THREE_WARPGROUPS", True,
           "d 64: three consumer warpgroups (192 x 128) vs two (128 x 192, causal 128 x 128)"),
    Switch("fwd.USE_TMA", "fwd", F, "USE_TMA", False, "warp-specialized TMA kernel vs cp.async kernel"),
    Switch("fwd.kernel", "fwd", None, "kernel", MMA_FWD, "wgmma vs mma.sync forward (sm_90 dispatch)"),
    Switch("bwd.DQ_BULK", "bwd", B, "DQ_BULK", False, "dQ bulk reduce-add vs consumer atomics"),
    Switch("bwd.USE_TMA_STORE", "bwd", B, "USE_TMA_STORE", False, "dK/dV by TMA store vs 16-byte stores"),
    Switch("bwd.USE_TMA", "bwd", B, "USE_TMA", False, "warp-specialized TMA kernel vs cp.async kernel"),
    Switch("bwd.KV_REGS", "bwd", B, "KV_REGS", False, "d = 64: K_j, V_j in registers (RS) vs shared memory (SS)"),
    Switch("bwd.QUERY_SPLIT", "bwd", B, "QUERY_SPLIT", False,
           "d 256: S^T, dP^T split by queries vs computed in both warpgroups"),
    Switch("bwd.ENTRIES_FIRST", "bwd", B, "ENTRIES_FIRST", False,
           "ordered dQ: blocks entries first vs the grid's key blocks first", modes=("det",)),
    Switch("bwd.DQ_SPLIT", "bwd", B, "DQ_SPLIT", False,
           "d 64: dQ^T split by queries over both warpgroups vs computed by one"),
    Switch("bwd.KT_REGS", "bwd", B, "KT_REGS", False,
           "d 64: K_j^T of the dQ wgmmas in registers (RS) vs shared memory (SS)"),
    Switch("bwd.DQ_BUFFERS", "bwd", B, "DQ_BUFFERS", 4,
           "d 64: four dQ buffers for the dQ warp (the consumers up to 3 visits ahead) vs two"),
    Switch("bwd.SCORES_AHEAD", "bwd", B, "SCORES_AHEAD", True,
           "d 64: S^T issued behind the previous visit's dQ^T vs after it"),
    Switch("bwd.SPLIT_OVERLAP", "bwd", B, "SPLIT_OVERLAP", True,
           "d 256: dP^T behind S^T, dQ^T before the dV/dK wait vs after"),
    Switch("bwd.kernel", "bwd", None, "kernel", MMA_BWD, "wgmma vs mma.sync backward (sm_90 dispatch)"),
    Switch("mma.WIDE_ROWS", "fwd", tiles, "WIDE_ROWS", False, "mma.sync d > 64: wide-row 128 x 32 tiles vs the table's",
           MMA_FWD),
    Switch("mma.WIDE_BC64", "fwd", tiles, "WIDE_BC64", False,
           "mma.sync d 80-128 non-causal: 128 x 64 single-buffered vs 128 x 32 double-buffered", MMA_FWD),
    Switch("mma.WIDE_BC64_LARGE", "fwd", tiles, "WIDE_BC64_LARGE", False,
           "mma.sync d > 128: 128 x 64 8-warp single-buffered vs 128 x 32 double-buffered", MMA_FWD),
    Switch("mma.WIDE_BC64_CAUSAL", "fwd", tiles, "WIDE_BC64_CAUSAL", False,
           "mma.sync d 80-128 causal (d = dv): 128 x 64 single-buffered vs 128 x 32 double-buffered", MMA_FWD),
    Switch("mma.WIDE_CAUSAL", "fwd", tiles, "WIDE_CAUSAL_ARCHS", {80: tiles.MAX_HEAD_DIM},
           "mma.sync causal 64 < d <= 128 on sm_90: the wide-row tiles vs the square one", MMA_FWD),
    Switch("mma.WIDE_KEYS", "bwd", tiles_bwd, "WIDE_KEYS", False,
           "mma.sync row-tile backward d 80-128 / 256: 128 x 32 / 64 x 32 dK/dV tiles vs the table's", MMA_BWD,
           under=((tiles_bwd, "GRID_LAYOUT", False),)),
    Switch("mma.GRID_LAYOUT", "bwd", tiles_bwd, "GRID_LAYOUT", False,
           "mma.sync backward d 64 / 128 / 256: the grid-layout dK/dV kernel vs the row-tile kernel", MMA_BWD),
    Switch("mma.GRID_SWIZZLE", "bwd", tiles_bwd, "GRID_SWIZZLE", False,
           "mma.sync grid-layout backward: Q_i, dO_i XOR-swizzled vs padded rows", MMA_BWD),
    Switch("mma.ENTRIES_FIRST", "bwd", tiles_bwd, "ENTRIES_FIRST", False,
           "mma.sync ordered dQ: blocks entries first vs the grid's key blocks first", MMA_BWD, modes=("det",)),
    Switch("mma.CAUSAL_GROUPS", "fwd", tiles, "CAUSAL_GROUPS", False,
           "mma.sync causal forward: grouped longest-first grid order vs entry by entry", MMA_FWD),
)
#: The extension calls' switches (``--only ext``; not in the default run): the wgmma kernels against the mma.sync
#: ones with an extension (``ext``: a key of :data:`EXT_SETS`), both sides called with it; ``modes`` limits the
#: backward's dQ modes. A shape whose call one side refuses
#: (NotImplementedError while planning: e.g. the wgmma backward's refused sets at d 128, docs/hopper.md) is
#: left out with a line saying why. Answers whether sm_90's dispatch should take the wgmma kernels for these
#: calls too (``cuda_forward_sm90.AUTO_EXT``, ``cuda_backward_sm90.AUTO_EXT``).
EXT_SWITCHES = (
    Switch("fwd.kernel.dropout", "fwd", None, "kernel", MMA_FWD, "wgmma vs mma.sync forward, dropout p 0.1",
           ext="dropout"),
    Switch("fwd.kernel.window", "fwd", None, "kernel", MMA_FWD, "wgmma vs mma.sync forward, window (255, 0)",
           ext="window"),
    Switch("fwd.kernel.window1k", "fwd", None, "kernel", MMA_FWD, "wgmma vs mma.sync forward, window (1023, 0)",
           ext="window1k"),
    Switch("bwd.kernel.dropout", "bwd", None, "kernel", MMA_BWD, "wgmma vs mma.sync backward, dropout p 0.1",
           ext="dropout"),
    Switch("bwd.kernel.window", "bwd", None, "kernel", MMA_BWD, "wgmma vs mma.sync backward, window (255, 0)",
           ext="window"),
    Switch("bwd.ORDERED_BLOCK_MASK", "bwd", cuda_backward, "ORDERED_BLOCK_MASK", False,
           "block mask (half of the 128 x 128 blocks): wgmma ordered dQ vs mma.sync recomputing dQ kernel",
           base=MMA_BWD, ext="block_mask", modes=("det",)),
    Switch("mma.GRID_LAYOUT.block_mask", "bwd", tiles_bwd, "GRID_LAYOUT", False,
           "block mask (half of the 128 x 128 blocks), mma.sync backward: grid-layout vs row-tile dK/dV kernel "
           "(d 64 / 256; d 128 keeps the row tile)", MMA_BWD, ext="block_mask"),
    Switch("mma.GRID_LAYOUT.block_mask_window", "bwd", tiles_bwd, "GRID_LAYOUT", False,
           "block mask (half of the 128 x 128 blocks) and window (255, 0), mma.sync backward: grid-layout vs "
           "row-tile dK/dV kernel (d 64 / 128 / 256)", MMA_BWD, ext="block_mask_window"),
    Switch("mma.GRID_LAYOUT.dropout", "bwd", tiles_bwd, "GRID_LAYOUT", False,
           "dropout p 0.1, mma.sync backward: grid-layout vs row-tile dK/dV kernel (d 256; d 64 / 128 keep the row "
           "tile)", MMA_BWD, ext="dropout"),
    Switch("bwd.DQ_BULK_EXT.window", "bwd", B, "DQ_BULK_EXT", False,
           "window (255, 0): dQ bulk reduce-add vs consumer atomics", ext="window"),
    Switch("bwd.DQ_BULK_EXT.dropout", "bwd", B, "DQ_BULK_EXT", False,
           "dropout p 0.1: dQ bulk reduce-add vs consumer atomics", ext="dropout"),
    Switch("fwd.SCORE_EXT_OVERLAP_MAX_HEAD_DIM.softcap", "fwd", F, "SCORE_EXT_OVERLAP_MAX_HEAD_DIM", 128,
           "softcap 30, d 256: softmax overlapped with P V vs every batch waited for", ext="softcap"),
    Switch("fwd.PERSISTENT_MAX_HEAD_DIM_SCORE_EXT.softcap", "fwd", F, "PERSISTENT_MAX_HEAD_DIM_SCORE_EXT", 64,
           "softcap 30, d 128 / 256: persistent vs one block per work tile", ext="softcap"),
    Switch("fwd.HEAVY_EXT_OVERLAP_MAX_HEAD_DIM.dropout", "fwd", F, "HEAVY_EXT_OVERLAP_MAX_HEAD_DIM", 0,
           "dropout p 0.1, d 64: softmax overlapped with P V vs every batch waited for", ext="dropout"),
    Switch("fwd.WIDE_EXT.softcap", "fwd", F, "WIDE_EXT", {},
           "softcap 30, non-causal (d 256: causal too): key tiles of 192 / 176 / 80 vs 128 / 128 / 64", ext="softcap"),
)
#: extension keywords (docs/extensions.md) of the EXT_SWITCHES, by name
EXT_SETS = {"": {}, "dropout": dict(dropout_p=0.1, seed=1234, offset=0), "window": dict(window=(255, 0)),
            "window1k": dict(window=(1023, 0)), "softcap": dict(softcap=30.0),
            "block_mask": dict(block_mask=0.5, block_size=(128, 128)),  # (the density: Problem makes the mask)
            "block_mask_window": dict(block_mask=0.5, block_size=(128, 128), window=(255, 0))}
#: the backward's dQ modes: label -> deterministic
MODES = {"det": True, "atomic": False}
DTYPES = gpu.DTYPES
HEAD_DIMS = (128, 64, 256)  # the most used first (a run cut short by --max-seconds)
QUICK_SEQLENS = (1024, 4096, 16384)
FULL_SEQLENS = (1024, 2048, 4096, 8192, 16384)
#: (dtype, B, H, N, D, causal) of the emulator run: every switch applies to one of them
EMULATOR_SHAPES = (("fp16", 1, 2, 128, 64, True), ("fp16", 1, 1, 64, 256, False), ("fp16", 1, 1, 128, 128, False))
#: emulator shapes run for these switches only (the others would compile their variants once more there)
EMULATOR_SHAPES_FOR = {("fp16", 1, 1, 80, 80, True): ("mma.WIDE_BC64_CAUSAL", "mma.WIDE_CAUSAL"),
                       ("fp16", 1, 2, 256, 64, True): ("fwd.CAUSAL_PAIRS", "mma.CAUSAL_GROUPS"),
                       ("fp16", 1, 1, 176, 128, False): ("fwd.WIDE_KEYS", "fwd.WIDE_EXT.softcap"),
                       ("fp16", 1, 1, 64, 256, True): ("fwd.PERSISTENT_CAUSAL_MAX_HEAD_DIM",),   # one key tile of 176 (N 128 keeps 128)
                       ("fp16", 1, 1, 80, 256, False): ("mma.WIDE_BC64_LARGE",)}   # > 64 rows: the wide tiles
#: SMs of the emulator's persistent grids (cuda_forward_sm90.SM_COUNT): 4 work tiles then give each block two,
#: the causal pairs' condition
EMULATOR_SM_COUNT = 2
KEEP_ABOVE, FLIP_BELOW = 1.02, 0.98

#: one measured (or failed) pair; ratio = ms_flipped / ms_default; note: why it is not timed, if so
Row = collections.namedtuple("Row", "switch mode dtype B H N D causal ms_default ms_flipped ratio "
                                    "tflops_default tflops_flipped validated note")


# ---- variants ----------------------------------------------------------------------------------------------

@contextlib.contextmanager
def variant(switch, base=WGMMA, under=None):
    """The switch flipped (None: the defaults, calls with ``kernel=base``) for the body, with its ``under`` flags
    (``under``, the switch's, for the defaults' side); restored after it, plan caches cleared both sides. Yields the
    ``kernel=`` argument of the calls."""
    sets = list((switch.under if switch is not None else under) or ())
    if switch is not None and switch.module is not None:
        sets.append((switch.module, switch.flag, switch.flipped))
    olds = [(module, flag, getattr(module, flag)) for module, flag, _ in sets]
    for module, flag, value in sets:
        setattr(module, flag, value)
    launch._clear_plans()
    try:
        yield base if switch is None else switch.flipped if switch.module is None else switch.base
    finally:
        for module, flag, value in reversed(olds):
            setattr(module, flag, value)
        launch._clear_plans()


def ext_keywords(kw, q, k):
    """``kw`` with a block mask made for the shape where it gives a density (EXT_SETS' "block_mask": that share of
    the blocks True, the diagonal kept, one mask for every batch entry, on q's array module), else ``kw``."""
    density = kw.get("block_mask")
    if not isinstance(density, float):
        return kw
    bq, bk = kw["block_size"]
    shape = (-(-q.shape[-2] // bq), -(-k.shape[-2] // bk))
    mask = np.random.default_rng(0).random(shape) < density
    mask[np.arange(min(shape)), np.arange(min(shape))] = True
    xp = sys.modules[type(q).__module__.split(".")[0]]
    return dict(kw, block_mask=xp.asarray(mask))


class Problem:
    """One shape's inputs (on the device: ``copies`` of q, k, v, dout for L2) and its calls."""

    def __init__(self, copies, causal, device, arch, ext=""):
        self.copies, self.causal, self.device, self.arch = copies, causal, device, arch
        q = copies[0][0]
        self.scale, self.batch = 1.0 / math.sqrt(q.shape[-1]), q.shape[:-2]
        self.ext_kw = ext_keywords(EXT_SETS[ext], q, copies[0][1])  # the calls' extension keywords (EXT_SWITCHES)
        self.ext = gpu_backward._ext(q, copies[0][1], self.ext_kw)
        self.state = None  # [(out, lse) per copy]: the wgmma forward with its defaults

    def fwd_kw(self, kernel):
        return dict(causal=self.causal, scale=self.scale, batch_shape=self.batch, device=self.device,
                    kernel=kernel, arch=self.arch, ext=self.ext)

    def forward(self, tensors, kernel):
        return cuda_forward.forward(*tensors[:3], **self.fwd_kw(kernel))

    def saved(self):
        if self.state is None:
            with variant(None):
                self.state = [self.forward(t, WGMMA) for t in self.copies]
        return self.state

    def backward(self, i, kernel, deterministic):
        q, k, v, dout = self.copies[i]
        out, lse = self.saved()[i]
        return cuda_backward.backward(dout, q, k, v, out, lse, deterministic=deterministic, **self.fwd_kw(kernel))

    def calls(self, kind, kernel, deterministic):
        if kind == "fwd":
            return [lambda t=t: self.forward(t, kernel) for t in self.copies]
        return [lambda i=i: self.backward(i, kernel, deterministic) for i in range(len(self.copies))]

    def launches(self, kind, kernel, deterministic):
        """What the plan launches (names, grids, blocks, scalar arguments): equal for two variants = the same
        work (a switch may change an argument only: fwd.CAUSAL_PAIRS's ``group``)."""
        q, k, v, dout = self.copies[0]
        if kind == "fwd":
            p = cuda_forward.plan(q, k, v, **self.fwd_kw(kernel))
        else:
            out, lse = self.saved()[0]
            p = cuda_backward.plan(dout, q, k, v, out, lse, deterministic=deterministic, **self.fwd_kw(kernel))
        return tuple((r.name, r.grid, r.block, tuple(int(a) for a in r.template if isinstance(a, np.integer)))
                     for r in p.launches)

    def validate(self, kind, result):
        """flasharray.testing's report for the result (first batch entry and head; with the extension keywords:
        dropout's mask of entry (0, 0) is the same in the slice), via gpu.py's checks for dense calls."""
        if not self.ext_kw:
            if kind == "fwd":
                return gpu.check("flasharray-wgmma", result, self.copies[0][:3], self.causal, self.device)
            return gpu_backward.check("flasharray-wgmma-det", result, self.copies[0], self.causal, self.device)
        first = lambda x: x[:1, :1]  # noqa: E731
        q, k, v, dout = (first(x) for x in self.copies[0])
        if kind == "fwd":
            return check_attention(first(result[0]), q, k, v, causal=self.causal, scale=self.scale, **self.ext_kw)
        out = first(self.saved()[0][0])
        return check_attention(out, q, k, v, causal=self.causal, scale=self.scale, dout=dout,
                               grads=tuple(first(g) for g in result[:3]), **self.ext_kw)


def measure(problem, kind, switch, deterministic, clock, timing, validated, base=WGMMA, under=None):
    """(ms, validated now) of one variant: plan, validate (once per key in ``validated``), time. ``switch``
    None: the defaults (with the flags ``under``), called with ``kernel=base``."""
    with variant(switch, base, under) as kernel:
        fns = problem.calls(kind, kernel, deterministic)
        key = (switch.name if switch else (base, repr(under)), deterministic, tuple(sorted(problem.ext_kw)))
        checked = False
        if key not in validated:
            report = problem.validate(kind, fns[0]())
            if report is not None and not report.passed:
                raise gpu.NotMeasured("validation FAILED\n%s" % report)
            validated.add(key)
            checked = True
        return gpu_timing.time_ms(fns, clock, **timing).ms, checked


def run(shapes, switches, device, arch, clock, timing, make_copies, deadline=None, log=print):
    """Time every applicable switch on every shape; returns the rows (failures as rows with a note)."""
    rows, validated = [], collections.defaultdict(set)
    for n_shape, (dt_name, Bn, H, N, D, causal) in enumerate(shapes):
        if deadline is not None and time.monotonic() > deadline:
            log("--max-seconds reached: %d of %d shapes measured" % (n_shape, len(shapes)))
            break
        label = gpu.shape_label(Bn, H, N, D, dt_name, causal)
        copies = make_copies(Bn, H, N, D, DTYPES[dt_name])
        problems = {e: Problem(copies, causal, device, arch, e) for e in sorted({s.ext for s in switches})}
        seen = validated[(dt_name, D, causal)]
        for kind, modes in (("fwd", {"": True}), ("bwd", MODES)):
            mine = [s for s in switches if s.kind == kind]
            if not mine:
                continue
            for mode, det in modes.items():
                bases, default_launches = {}, {}  # by the switch's (base kernel, extension set, under)
                for sw in mine:
                    if sw.modes is not None and mode not in sw.modes:
                        continue
                    problem, key = problems[sw.ext], (sw.base, sw.ext, repr(sw.under))
                    factor = 1.0 if kind == "fwd" else gpu_backward.BWD_FACTOR
                    flop = gpu.flops(Bn, H, N, N, D, causal, factor)

                    def row(ms_d=None, ms_f=None, ok=False, note=""):
                        ratio = ms_f / ms_d if ms_d and ms_f else None
                        tf = lambda ms: ms and flop / (ms * 1e-3) / 1e12  # noqa: E731
                        return Row(sw.name, mode or "fwd", dt_name, Bn, H, N, D, causal, ms_d, ms_f, ratio,
                                   tf(ms_d), tf(ms_f), ok, note)
                    base = bases.get(key)
                    try:
                        try:
                            if key not in default_launches:
                                with variant(None, sw.base, sw.under) as kernel:
                                    default_launches[key] = problem.launches(kind, kernel, det)
                            with variant(sw) as kernel:
                                flipped_launch = problem.launches(kind, kernel, det)
                        except NotImplementedError as e:
                            if not sw.ext:
                                raise
                            log("%-30s | %-28s | %-6s | not run: %s" % (label, sw.name, mode or "fwd", gpu._why(e)))
                            continue  # a kernel refuses this extension call (e.g. spilling sets at d 128)
                        if flipped_launch == default_launches[key]:
                            continue  # the flag changes nothing for this shape
                        if base is None:
                            base = bases[key] = measure(problem, kind, None, det, clock, timing, seen, sw.base,
                                                        sw.under)
                        ms_f, ok = measure(problem, kind, sw, det, clock, timing, seen)
                    except Exception as e:  # a failed validation, a compile error, out of memory, ...
                        log("%-30s | %-28s | %-6s | %s" % (label, sw.name, mode or "fwd", gpu._why(e)))
                        rows.append(row(base and base[0], note=gpu._why(e)))
                        continue
                    rows.append(row(base[0], ms_f, base[1] or ok))
                    r = rows[-1]
                    log("%-30s | %-28s | %-6s | %9.3f | %9.3f | %6.3f" % (label, sw.name, r.mode, r.ms_default,
                                                                          r.ms_flipped, r.ratio))
        del problems, copies
    return rows


# ---- tables ------------------------------------------------------------------------------------------------

def verdict(ratios, dispatch=False):
    """(median, words) of the ratios flipped / default; ``dispatch``: the wgmma vs mma.sync switches."""
    if not ratios:
        return None, "no measurement"
    med = statistics.median(ratios)
    if med > KEEP_ABOVE:
        return med, "wgmma faster: dispatch it" if dispatch else "keep default"
    if med < FLIP_BELOW:
        return med, "mma.sync faster" if dispatch else "flip"
    return med, "even (within 2 %)" if dispatch else "keep default (within 2 %)"


def summarize(rows, switches):
    """One dict per switch: median ratio overall and per head dim, the verdict, counts."""
    out = []
    for sw in switches:
        mine = [r for r in rows if r.switch == sw.name]
        good = [r for r in mine if r.ratio is not None]
        med, words = verdict([r.ratio for r in good], sw.module is None)
        by_d = {D: statistics.median([r.ratio for r in good if r.D == D]) for D in sorted({r.D for r in good})}
        by_mode = {m: statistics.median([r.ratio for r in good if r.mode == m])
                   for m in sorted({r.mode for r in good})}
        out.append(dict(switch=sw.name, flag=None if sw.module is None else "%s.%s" % (
            sw.module.__name__.rsplit(".", 1)[-1], sw.flag),
            default=WGMMA if sw.module is None else getattr(sw.module, sw.flag), flipped=sw.flipped,
            question=sw.question, median_ratio=med, median_by_head_dim=by_d, median_by_mode=by_mode,
            verdict=words, measured=len(good), failed=len(mine) - len(good)))
    return out


def print_tables(rows, switches, unit="TFLOP/s", scale=1.0, note=""):
    fmt = lambda x, f="%9.3f": "-" if x is None else f % x  # noqa: E731
    summary = summarize(rows, switches)
    for sw, s in zip(switches, summary):
        mine = [r for r in rows if r.switch == sw.name]
        print()
        print("== %s: %s (default %r, flipped %r)" % (sw.name, sw.question, s["default"], s["flipped"]))
        if not mine:
            print("   (no shape where it changes the kernels, or not measured)")
        else:
            print("%-30s | %-6s | %9s | %9s | %12s | %9s | %9s" % (
                "shape (B,H,N,D) dtype causal", "mode", "ms dflt", "ms flip", "flip/dflt", unit + " d", unit + " f"))
            print("-" * 106)
            for r in mine:
                tf = lambda x: None if x is None else x * scale  # noqa: E731
                print("%-30s | %-6s | %9s | %9s | %12s | %9s | %9s%s" % (
                    gpu.shape_label(r.B, r.H, r.N, r.D, r.dtype, r.causal), r.mode, fmt(r.ms_default),
                    fmt(r.ms_flipped), fmt(r.ratio, "%.3f"), fmt(tf(r.tflops_default), "%9.2f"),
                    fmt(tf(r.tflops_flipped), "%9.2f"), "  " + r.note.splitlines()[0] if r.note else ""))
    print()
    print("summary (ratio = flipped / default; > 1: the default is faster)%s:" % note)
    for s in summary:
        extra = ", ".join("D=%d %.3f" % kv for kv in s["median_by_head_dim"].items())
        extra += "".join(", %s %.3f" % kv for kv in s["median_by_mode"].items() if len(s["median_by_mode"]) > 1)
        print("  %-28s %-26s median %s of %d rows%s%s" % (
            s["switch"], s["verdict"] + ":", "-" if s["median_ratio"] is None else "%.3f" % s["median_ratio"],
            s["measured"], " (%s)" % extra if extra else "", ", %d FAILED" % s["failed"] if s["failed"] else ""))
    return summary


def write_json(path, device, rows, summary):
    with open(path, "w") as f:
        json.dump(dict(device=device, rows=[r._asdict() for r in rows], summary=summary), f, indent=1,
                  default=str)
    print("rows written to %s" % path)


# ---- drivers -----------------------------------------------------------------------------------------------

def gpu_shapes(dtypes, seqlens, head_dims=HEAD_DIMS):
    """N-major: (dtype, B, H, N, D, causal) with gpu.py's tokens and hidden size."""
    for N in seqlens:
        for dt in dtypes:
            for D in head_dims:
                for causal in (False, True):
                    yield dt, max(1, gpu.TOKENS // N), gpu.HIDDEN // D, N, D, causal


def sm90_device():
    """The device line when an sm_90 GPU is visible; else None (and why is printed)."""
    if not gpu.have_gpu():
        return None
    import cupy as cp
    cc = cp.cuda.Device().compute_capability
    props = cp.cuda.runtime.getDeviceProperties(0)
    line = "%s (sm_%s), %d SMs, L2 %.0f MB" % (props["name"].decode(), cc, props["multiProcessorCount"],
                                              props["l2CacheSize"] / 1e6)
    if cc != "90":
        print("not an sm_90 GPU (%s): the Hopper kernels do not run here; nothing to measure." % line)
        return None
    return line


def select(only):
    """The switches ``--only`` names (names, their prefixes or last parts, fwd / bwd, "ext": every extension
    switch; a whole switch name names that switch only, not the extension switches it prefixes); default: every
    switch but the extension ones."""
    if not only:
        return SWITCHES
    every = SWITCHES + EXT_SWITCHES
    names = [s.strip() for s in only.split(",") if s.strip()]
    exact = {n for n in names if any(s.name == n for s in every)}
    chosen = [s for s in every
              if any(s.name == n or (n not in exact and s.name.startswith(n + ".")) or s.name.endswith("." + n)
                     or (n == s.kind and not s.ext) or (n == "ext" and s.ext) for n in names)]
    if not chosen:
        raise SystemExit("--only %r matches none of: ext, %s" % (only, ", ".join(s.name for s in SWITCHES
                                                                               + EXT_SWITCHES)))
    return chosen


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="fp16 and bf16, N 1k..16k, longer timings")
    ap.add_argument("--emulator", action="store_true", help="one tiny shape per switch on the CPU emulator (sm_90)")
    ap.add_argument("--only", default=None, help="comma-separated switches (names, flags or fwd / bwd)")
    ap.add_argument("--seqlens", default=None, help="comma-separated N (default: 1024,4096,16384; --full: 5 N)")
    ap.add_argument("--head-dims", default=None, help="comma-separated D (default: 128,64,256)")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="start no new shape after this many seconds (the tables print what was measured)")
    ap.add_argument("--json", default=None, help="write the rows and the summary to this file")
    args = ap.parse_args(argv)
    switches = select(args.only)
    deadline = None if args.max_seconds is None else time.monotonic() + args.max_seconds
    if args.emulator:
        print("emulator run (arch sm_90; CPU time, not GPU performance)")
        F.SM_COUNT = F.SM_COUNT or EMULATOR_SM_COUNT
        make = lambda Bn, H, N, D, dtype: [gpu_backward._make_tensors(np, Bn, H, N, D, dtype)]  # noqa: E731
        timing, own = dict(warmup_ms=0, rep_ms=0, min_repeats=1), set().union(*EMULATOR_SHAPES_FOR.values())
        rows = run(EMULATOR_SHAPES, [s for s in switches if s.name not in own], "emulator", "sm_90",
                   gpu_timing.PerfClock(), timing, make, deadline)
        for shape, names in EMULATOR_SHAPES_FOR.items():
            mine = [s for s in switches if s.name in names]
            rows += run((shape,), mine, "emulator", "sm_90", gpu_timing.PerfClock(), timing, make, deadline) if mine \
                else []
        device, unit, scale = "emulator (sm_90)", "GFLOP/s", 1e3
    else:
        device = sm90_device()
        if device is None:
            return 0
        import cupy as cp
        print("device: %s" % device)
        l2 = cp.cuda.runtime.getDeviceProperties(0)["l2CacheSize"]

        def make(Bn, H, N, D, dtype):
            copies = [gpu_backward._make_tensors(cp, Bn, H, N, D, dtype)]
            n = gpu_timing.copies_for_l2(sum(x.nbytes for x in copies[0]), l2)
            return copies + [gpu_backward._make_tensors(cp, Bn, H, N, D, dtype, copy=i) for i in range(1, n)]

        seqlens = tuple(int(n) for n in args.seqlens.split(",")) if args.seqlens else (
            FULL_SEQLENS if args.full else QUICK_SEQLENS)
        dtypes = tuple(DTYPES) if args.full else ("fp16",)
        timing = {} if args.full else dict(warmup_ms=25.0, rep_ms=100.0)
        print("%-30s | %-28s | %-6s | %9s | %9s | %6s" % ("shape (B,H,N,D) dtype causal", "switch", "mode",
                                                          "ms dflt", "ms flip", "ratio"))
        head_dims = tuple(int(d) for d in args.head_dims.split(",")) if args.head_dims else HEAD_DIMS
        rows = run(list(gpu_shapes(dtypes, seqlens, head_dims)), switches, "cuda", None, gpu_timing.CudaClock(),
                   timing, make, deadline)
        unit, scale = "TFLOP/s", 1.0
    summary = print_tables(rows, switches, unit, scale,
                           "; emulator CPU time: the verdicts mean nothing" if args.emulator else "")
    if args.json:
        write_json(args.json, device, rows, summary)
    return 1 if any(s["failed"] for s in summary) else 0


if __name__ == "__main__":
    sys.exit(main())
