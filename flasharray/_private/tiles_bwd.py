"""Tile table of the CUDA backward kernels: every tile choice, its reason, and its shared memory.

The kernels take these numbers as template parameters and ``static_assert`` every invariant;
the shared-memory sizes computed here mirror the layouts in ``cuda_src/flash_bwd_simt.cu``
(``SimtSmem``) and ``cuda_src/flash_bwd.cu`` (``TcSmem``) byte for byte.

Architecture limits (``/work/shared/ptx_semantics.md``): dynamic shared memory per block is
48 KB without opt-in and at most 64 KB (sm_75), 163 KB (sm_80), 99 KB (sm_86, sm_89) and
227 KB (sm_90) with ``max_dynamic_shared_size_bytes``; at most 255 registers per thread.

Symbols: Br = kBlockM (query rows per tile), Bc = kBlockN (key rows per tile), D / Dv padded
head dims of q·k and of v.
"""
from dataclasses import dataclass

import numpy as np

# Architecture limits, head-dim padding and the emulator's pretend arch are the forward's.
from .tiles import (ARCHS, DEFAULT_SMEM, EMULATOR_ARCH, MAX_SMEM, _align16, _two_blocks_fit,  # noqa: F401
                    arch_number, pad_head_dim, smem_limit)


@dataclass(frozen=True)
class BwdTiles:
    """One kernel's tile shape, its dynamic shared memory in bytes, and why it was chosen."""
    block_m: int      # Br: query rows per tile
    block_n: int      # Bc: key rows per tile
    n_threads: int
    smem: int
    reason: str
    stages: int = 1   # buffers of the streamed tiles (tensor-core kernels: 2 = cp.async prefetch)
    #: the tensor-core dK/dV kernel's warp layout (a class attribute, no field: subclasses keep their positional
    #: fields): "rows" (flash_bwd_dkv_kernel); :class:`GridBwdTiles`: "grid" (flash_bwd_dkv_grid_kernel)
    layout = "rows"
    #: the kernel's __launch_bounds__ minimum blocks per SM (a class attribute; :class:`SimtBwdTiles` has the field)
    blocks_per_sm = 1

    @property
    def needs_opt_in(self):
        return self.smem > DEFAULT_SMEM


@dataclass(frozen=True)
class SimtBwdTiles(BwdTiles):
    """A tile of the SIMT kernels (:func:`simt_tiles`); ``blocks_per_sm`` 2: the dK/dV kernel's registers capped at
    128 (:data:`SIMT_TWO_BLOCKS`)."""
    blocks_per_sm: int = 1


@dataclass(frozen=True)
class GridBwdTiles(BwdTiles):
    """A dK/dV tile of the grid-layout kernel (:func:`grid_tile`); ``swizzle``: Q_i, dO_i XOR-swizzled
    (:data:`GRID_SWIZZLE`)."""
    swizzle: bool = False
    layout = "grid"


# ---------------------------------------------------------------------------------------------
# SIMT kernels (fp32, fp64): scalar FMAs on shared-memory tiles, 256 threads.
SIMT_THREADS = 256
# A thread keeps ceil(Bc * (D + Dv) / 256) accumulators of dK_j, dV_j (dQ kernel: Br * D / 256)
# in registers; this many 32-bit registers of them leave room for addressing and the loops
# under the 255-register cap without spills (checked by tests/test_static_backward.py).
SIMT_ACC_REGS = 64
# Preferred first: large tiles reuse each loaded K_j/V_j (or Q_i/dO_i) over more rows.
SIMT_CANDIDATES = ((64, 64), (32, 64), (32, 32), (16, 32), (16, 16), (8, 16), (8, 8), (4, 8))
#: The SIMT dK/dV kernel (fp32, the default float32 backward) as two blocks per SM where their shared memory fits
#: and the padded head dims are at most SIMT_TWO_BLOCKS_MAX_HEAD_DIM: its registers capped at 128 (its
#: S / dP partial sums in the rolled loop: unrolled, their hoisted loads spilled at 128), 16 warps per SM instead
#: of 8 (fp32 d 64 on sm_90: 204 registers, one 8-warp block). On the H200 the one-block kernel ran at 52 % of
#: its instruction-issue bound where the 12-warp SIMT forward ran at 71 % (docs/performance.md, *Twenty-sixth
#: session*).
#: Per arch, the padded head dims (d = dv) that take it: every float32 instantiation there (causal or not, each
#: dQ mode) compiles without spills at 128 registers (sm_90 d 48: 336-1,192 bytes; sm_80 d 32: 8 bytes in three
#: of six; float64 d 16 on sm_90: 296-352). Dense calls only (extensions keep one block).
SIMT_TWO_BLOCKS = True
SIMT_TWO_BLOCKS_HEAD_DIMS = {90: (16, 32, 64), 80: (16,)}
#: The float64 dK/dV kernel with extensions takes at most this many query rows per visit: at d 64 its 64 x 64 tile
#: (64 accumulator registers of dK_j, dV_j, at 255) spilled 4-32 bytes in 44 of the 504 extension instantiations on
#: sm_90 (38 before the block mask's FastDiv; window, ALiBi, softcap, lengths as well as the block mask, every dQ
#: mode); 32 x 64 leaves the S / dP partial sums half the registers (forty-ninth session's audit).
SIMT_F64_EXT_MAX_BR = 32


def simt_two_blocks(dtype, D, Dv, smem, arch, ext=0):
    """Whether the SIMT dK/dV kernel runs as two blocks per SM (:data:`SIMT_TWO_BLOCKS`) at padded ``D``, ``Dv``."""
    return (SIMT_TWO_BLOCKS and not ext and np.dtype(dtype) == np.float32 and D == Dv
            and D in SIMT_TWO_BLOCKS_HEAD_DIMS.get(arch_number(arch), ()) and _two_blocks_fit(smem, arch))


def _simt_pitch(itemsize, cols):
    return cols + 16 // itemsize   # SimtPitch: 16 bytes of padding per row


def simt_smem(itemsize, acc_itemsize, D, Dv, Br, Bc, kernel="dkv"):
    """Bytes of ``SimtSmem``: Q_i, dO_i, K_j, V_j (padded pitch), P_ij (dK/dV kernel only), dS_ij,
    L_i, D_i."""
    pd, pdv = _simt_pitch(itemsize, D), _simt_pitch(itemsize, Dv)
    scores = (2 if kernel == "dkv" else 1) * _align16(Br * Bc * acc_itemsize)
    return (_align16(Br * pd * itemsize) + _align16(Br * pdv * itemsize)
            + _align16(Bc * pd * itemsize) + _align16(Bc * pdv * itemsize)
            + scores + 2 * _align16(Br * acc_itemsize))


def simt_tiles(kernel, dtype, D, Dv, arch, ext=0):
    """Tiles of ``flash_bwd_dkv_simt_kernel`` (kernel="dkv") or ``flash_bwd_dq_simt_kernel`` ("dq").

    The first candidate (largest tiles) whose register accumulators fit ``SIMT_ACC_REGS`` and
    whose shared memory fits the architecture's opt-in limit; the dK/dV kernel of a dense call (``ext`` 0) as
    two blocks per SM where :func:`simt_two_blocks` says so.
    """
    dtype = np.dtype(dtype)
    D, Dv = pad_head_dim(D), pad_head_dim(Dv)
    acc = 8 if dtype == np.float64 else 4
    limit = smem_limit(arch)
    for Br, Bc in SIMT_CANDIDATES:
        if kernel == "dkv" and ext and dtype == np.float64 and Br > SIMT_F64_EXT_MAX_BR:
            continue
        kept = Bc * (D + Dv) if kernel == "dkv" else Br * D
        regs = -(-kept // SIMT_THREADS) * acc // 4
        smem = simt_smem(dtype.itemsize, acc, D, Dv, Br, Bc, kernel)
        if regs <= SIMT_ACC_REGS and smem <= limit:
            why = ("largest (Br, Bc) with <= %d accumulator registers per thread and %d B of "
                   "shared memory <= the sm_%d limit %d B" % (SIMT_ACC_REGS, smem, arch_number(arch), limit))
            two = kernel == "dkv" and simt_two_blocks(dtype, D, Dv, smem, arch, ext)
            if two:
                why += "; two blocks per SM (SIMT_TWO_BLOCKS: registers capped at 128)"
            return SimtBwdTiles(Br, Bc, SIMT_THREADS, smem, why, blocks_per_sm=2 if two else 1)
    raise NotImplementedError(
        "flasharray: no SIMT backward tile fits D=%d, Dv=%d, %s on sm_%d" % (D, Dv, dtype, arch_number(arch)))


# ---------------------------------------------------------------------------------------------
# Tensor-core kernels (fp16, bf16): mma.sync m16n8k16, tiles padded by 8 elements per row.
TC_PAD = 8  # 16 bytes: rows stay 16-byte aligned for ldmatrix / cp.async and rotate banks
# dK_j and dV_j (dQ kernel: dQ_i) stay in registers, split over the warps as (Bc / 16) row tiles
# x column slices: D / (2 * slices) + Dv / (2 * slices) floats per lane. This many keep the
# kernel well under 255 registers with the 16x16 score tiles and addressing alive.
TC_ACC_REGS = 64
TC_ACC_REGS_FALLBACK = (96, 128)
# Preferred first (rows kept on chip, rows streamed, warps): FlashAttention-2's 128 x 64 / 64 x 64
# tiles for small head dims; smaller tiles when D grows (registers) or shared memory is scarce
# (sm_75, sm_86/89). dK/dV kernel: (Bc, Br, warps); dQ kernel: (Br, Bc, warps).
TC_CANDIDATES = ((128, 64, 8), (64, 64, 8), (64, 64, 4), (64, 32, 8), (64, 32, 4), (32, 64, 8),
                 (32, 32, 8), (32, 32, 4), (32, 16, 8), (32, 16, 4), (16, 16, 4), (16, 16, 2))


# The dK/dV kernel's wide-key tiles: more keys per block than the candidates below give at head dims
# above 64, with 32 query rows per visit — (Bc, Br, warps, the padded head dims D and Dv both in `dims`,
# one of them above `above`). At d 80-128, 128 x 32 (FlashAttention-2 keeps 128 keys there too; one
# warp per 16 keys holds its 16 x 32 score strip and the D + Dv columns of dK_j, dV_j: <= 128 floats);
# at d 256, 64 x 32 (two warps per 16 keys, half the columns each). Against 64 x 64 (d 128) and
# 32 x 64 (d 256) each Q_i, dO_i tile serves twice the keys and each visit adds half the dQ atomics per
# product. The head dims are those whose instantiations compile without spills on sm_80 / sm_86 /
# sm_90 (d 112 spilled at 128 x 32; d 192, 224 and 256 / 128 at 64 x 32: tests/test_static_backward.py).
TC_WIDE_KEYS = ((128, 32, 8, (64, 80, 96, 128), 64), (64, 32, 8, (256,), 128))
#: False: the candidates below only (the tiles before the wide-key ones; benchmarks/hopper_variants.py times
#: both as ``mma.WIDE_KEYS``). Plans are cached: flip it before planning, or clear them (launch._clear_plans).
WIDE_KEYS = True
#: The extension bits (kExt) the wide-key tiles take in every dQ mode at every head dim they serve: per-entry
#: lengths alone (compiled without spills on sm_80 / sm_86 / sm_90 in every mode; ALiBi and some pairs spilled
#: 16-80 bytes).
WIDE_KEYS_EXT = (0, 32)
#: More sets, each with the dQ modes (``cuda_backward.dq_mode``'s names) and padded head dims (d = dv) where every
#: instantiation compiled without spills (NVRTC audit of 2026-11-27: fp16 and bf16, sm_80 / 86 / 89 / 90, causal
#: and not; docs/performance.md, "Fourteenth session"): softcap alone everywhere; dropout alone in the modes that
#: add dQ in the dK/dV kernel (plain and ordered atomics), not at d 96 (the plain atomic kernel spilled 24 bytes,
#: non-causal, sm_80 / 86 / 89) — the recomputing mode's dK/dV kernel spilled 16-80 bytes on sm_90 at d 128.
#: Dropout with lengths (20 bytes, sm_80 d 128 atomic), softcap with lengths (28, sm_90 d 256 atomic) and a
#: window (12, sm_90 d 128 atomic) spilled and keep the candidates' tiles.
WIDE_KEYS_EXT_BY_MODE = {4: (("atomic", "ordered", "recompute"), (80, 96, 128, 256)),
                         16: (("atomic", "ordered"), (80, 128, 256))}
#: (bits, mode, padded d) of :data:`WIDE_KEYS_EXT_BY_MODE` that spill on some archs since that audit, with those
#: archs: dropout in the ordered mode at d 80 on sm_86 / sm_89 (the causal instantiation, 128 keys x 32 queries,
#: spilled 28 / 56 bytes, fp16 and bf16; sm_80 / sm_90 and the non-causal one clean: forty-ninth session).
WIDE_KEYS_EXT_SPILLED = {(16, "ordered", 80): (86, 89)}


def wide_keys_take(ext, D, Dv, mode=None, arch=None):
    """Whether the dK/dV kernel with the kExt bits ``ext`` may take the wide-key tiles at padded head dims D, Dv
    in the dQ ``mode`` ("atomic", "ordered", "recompute"; None: a mode not known, only :data:`WIDE_KEYS_EXT`) on
    ``arch`` (:data:`WIDE_KEYS_EXT_SPILLED`)."""
    ext = int(ext)
    if ext in WIDE_KEYS_EXT:
        return True
    modes, dims = WIDE_KEYS_EXT_BY_MODE.get(ext, ((), ()))
    return (mode in modes and D == Dv and D in dims
            and (arch is None or arch_number(arch) not in WIDE_KEYS_EXT_SPILLED.get((ext, mode, D), ())))


def _wide_keys(D, Dv, limit, stages):
    """The wide-key dK/dV tile for padded head dims D, Dv, or None where none applies or fits."""
    for Bc, Br, warps, dims, above in TC_WIDE_KEYS:
        if D not in dims or Dv not in dims or max(D, Dv) <= above:
            continue
        for st in ((2, 1) if stages is None else (stages,)):
            smem = tc_smem("dkv", D, Dv, Br, Bc, st, warps=warps)
            if smem <= limit:
                floats = (D + Dv) // 2 // (warps // (Bc // 16))
                why = ("%d keys x %d queries (%d accumulator floats per lane); %d buffer(s) of the streamed "
                       "tiles: %d B of shared memory fit the limit %d B" % (Bc, Br, floats, st, smem, limit))
                return BwdTiles(Br, Bc, 32 * warps, smem, why, st)
    return None


# The grid-layout dK/dV kernel (flash_bwd_dkv_grid_kernel; FlashAttention-2's warp grid): 8 warps on 32-row
# warp tiles of every product — 0.5 ldmatrix.x4 per MMA where the row-tile kernel (one warp per 16 keys) needs
# 0.60-0.65: its products are bound by shared-memory reads (4 cycles per ldmatrix.x4 against about 2 per MMA).
# Padded head dim d = dv -> (Br, Bc): d 128 takes 64 queries x 128 keys (each warp's dQ tile 32 rows x 32 columns),
# d 64 128 x 128, d 256 64 x 64 (FlashAttention-2's d 256 tile: 32-key x 16-query score warp tiles, dQ tiles of
# 32 x 64 in two passes; 150.5 KB). Dense calls (kExt = 0), or window / ALiBi / softcap / lengths (GRID_EXT), in
# the atomic and ordered dQ modes (the recomputing mode's dK/dV kernel adds no dQ); one buffer of Q_i, dO_i (the
# next visit's copies start
# once the last product read them, overlapping dQ and its atomics: two buffers spilled 12-52 bytes at d 128 and
# do not fit sm_80's 163 KB); on the arches whose shared memory fits it (sm_80, sm_90: 138.5-150.5 KB; not sm_75 /
# 86 / 89). docs/cuda_backward.md, "The grid layout".
GRID_TILES = {128: (64, 128), 64: (128, 128), 256: (64, 64)}
#: kExt bits the grid layout takes besides dense calls (with 16-byte row copies: element-wise ones spilled 32 bytes
#: with lengths on sm_90): any set of window, ALiBi, softcap, block mask (forty-fourth session), dropout (forty-fifth)
#: and lengths — but the sets whose instantiations spilled in the NVRTC
#: audits (fp16 / bf16, T / float output, causal or not, both dQ modes, sm_80 / sm_90), in :data:`GRID_EXT_SPILLED`:
#: at d 128 those of 2026-11-27 (8-56 bytes, causal mostly; window with ALiBi 4-12 bytes in the float-output
#: instantiations, found by the slow test of 2026-11-29) and the block-mask sets but :data:`_BM128` (the both-tiles
#: pass spilled 8-152 bytes in 23 of 64 fp16 sm_80 instantiations; the per-m-tile pass, 2026-12-01, leaves ten sets
#: clean — the block mask alone spilled 8-40 bytes there too, softcap + dropout + lengths (with or without a window)
#: 24-40 on sm_90 ordered); at d 256 those of
#: 2026-11-29 (``benchmarks/spill_audit.py --d 256 --roles atomic,ordered``: window or ALiBi, with or without
#: lengths, causal: 16-32 bytes) and with a block mask window or ALiBi, lengths, and all five (16-188 bytes); at d 64
#: a block mask with window and ALiBi, window and softcap, or lengths (20-48 bytes). With dropout
#: (``benchmarks/spill_audit.py --d 64,128,256 --roles atomic,ordered``, 2026-12-01): every set at d 64 (20 of the 32
#: spilled on sm_80 fp16 alone, 8-220 bytes, dropout alone 88-120 causal; the others not audited further); at d 128
#: all but the six with softcap (dropout alone 8-80 bytes, a window without softcap 32-88 on sm_90, every block-mask
#: set as above); at d 256 twelve (with a block mask eleven of the sixteen sets, 8-136 bytes; with lengths alone 8 on
#: sm_90). docs/cuda_backward.md, "The grid layout", *Dropout on the grid layout*.
GRID_EXT = 1 | 2 | 4 | 8 | 16 | 32
_BM, _DROP = 8, 16
_GRID_SETS = tuple(b for b in range(1, GRID_EXT + 1) if not b & ~GRID_EXT)
#: d 128's block-mask sets that compile clean (the per-m-tile pass of grid_scores, forty-sixth session): with a window,
#: softcap or both (ALiBi beside them; lengths only with all three), and softcap + dropout (alone, with a window,
#: with ALiBi, with ALiBi and lengths).
_BM128 = (_BM | 1, _BM | 1 | 2, _BM | 4, _BM | 2 | 4, _BM | 1 | 2 | 4, _BM | 1 | 2 | 4 | 32,
          _BM | _DROP | 4, _BM | _DROP | 1 | 4, _BM | _DROP | 2 | 4, _BM | _DROP | 2 | 4 | 32)
#: The block-mask sets that compiled clean before the block mask's lookups divided by FastDiv (flash_mask.cuh, forty-eighth
#: session) and spilled after it, 8-64 bytes at the 255-register cap (fp16 sm_80, one dQ mode or causal flag each):
#: at d 64 the block mask alone (ordered), with window + ALiBi + lengths, with window + softcap + lengths; at d 128 with a
#: window, with window + ALiBi, with softcap, with ALiBi + softcap + dropout + lengths; at d 256 with softcap +
#: dropout + lengths. They take the row-tile kernel, whose block-mask loops the change made 1.4-2.4x shorter.
_GRID_FASTDIV_SPILLED = {64: (_BM, _BM | 1 | 2 | 32, _BM | 1 | 4 | 32), 128: (_BM | 1, _BM | 1 | 2, _BM | 4,
                                                                     _BM | 2 | 4 | _DROP | 32),
                         256: (_BM | 4 | _DROP | 32,)}
_GRID_REFUSED_BEFORE_AUDIT = {
    64: (_BM | 1 | 2, _BM | 1 | 4, _BM | 32) + tuple(b for b in _GRID_SETS if b & _DROP) + _GRID_FASTDIV_SPILLED[64],
    128: (1, 2, 1 | 2, 1 | 32, 2 | 32, 1 | 2 | 32)
    + tuple(b for b in _GRID_SETS if b & _BM and b not in _BM128) + _GRID_FASTDIV_SPILLED[128]
    + tuple(_DROP | b for b in (0, 1, 2, 1 | 2, 1 | 2 | 4, 32, 1 | 32, 2 | 32, 1 | 2 | 32, 1 | 2 | 4 | 32)),
    256: (1, 2, 1 | 32, 2 | 32, _BM | 1, _BM | 2, _BM | 1 | 2, _BM | 32, _BM | 1 | 32, _BM | 2 | 32,
          _BM | 1 | 2 | 4 | 32)
    + tuple(_DROP | _BM | b for b in (0, 1, 2, 1 | 2, 4, 1 | 4, 32, 1 | 32, 2 | 32, 1 | 2 | 32, 1 | 4 | 32))
    + (_DROP | 32,) + _GRID_FASTDIV_SPILLED[256]}
#: The refused sets that compiled clean in the fiftieth session's audit of every one of them (script in
#: docs/performance.md, "Fiftieth session": fp16 and bf16, T and float outputs, sm_80 and sm_90, causal or not, both
#: dQ modes; 1,376 instantiations): ptxas's allocation at the 255-register cap moved with the kernels since (FastDiv,
#: the per-m-tile pass). At d 64 a block mask with window + ALiBi or lengths, and 13 of the 32 dropout sets; at d 128
#: window + ALiBi, a block mask with dropout, with lengths (alone, with softcap, ALiBi + softcap, softcap + dropout);
#: at d 256 ten block-mask sets (with a window, dropout, or all five). The grid kernel ran the dense backward 1.27x
#: (atomic) and 1.40-1.43x (ordered) the row-tile kernel on an H200. The sets that still spilled stay refused.
_GRID_LET_BACK = {64: (_BM | 1 | 2, _DROP | 1 | 2, _DROP | 4, _DROP | 2 | 4, _BM | _DROP | 1, _BM | _DROP | 1 | 2,
                       _BM | _DROP | 4, _BM | 32, _DROP | 1 | 32, _DROP | 1 | 2 | 32, _DROP | 4 | 32,
                       _DROP | 1 | 4 | 32, _DROP | 2 | 4 | 32, _BM | _DROP | 1 | 32, _BM | _DROP | 1 | 2 | 32),
                  128: (1 | 2, _BM | _DROP, _BM | 32, _BM | 4 | 32, _BM | 2 | 4 | 32, _BM | _DROP | 4 | 32),
                  256: (_BM | 1, _BM | 1 | 2, _BM | _DROP, _BM | _DROP | 2, _BM | _DROP | 1 | 2, _BM | _DROP | 4,
                        _BM | _DROP | 1 | 4, _BM | 1 | 2 | 4 | 32, _BM | _DROP | 32, _BM | _DROP | 1 | 2 | 32)}
GRID_EXT_SPILLED = {d: tuple(b for b in sets if b not in _GRID_LET_BACK[d])
                    for d, sets in _GRID_REFUSED_BEFORE_AUDIT.items()}
#: ... and the sets whose float-output instantiations alone spilled (dK, dV as float partial sums: K/V broadcast over
#: the query heads with extensions; ``grid_tile(partial=True)``): with dropout, d 128 window + softcap (24 bytes, sm_90
#: ordered), d 256 alone and with ALiBi (96, sm_90 causal atomic), ALiBi + softcap + block mask (32, sm_80 atomic);
#: at d 128 every block-mask set of :data:`_BM128` but softcap + dropout alone or with a window (8-116 bytes;
#: forty-sixth session, window + block mask 108 on sm_80 atomic); since FastDiv (forty-eighth session) also softcap +
#: dropout + window + block mask (16 bytes, sm_90 ordered causal); of the sets let back (fiftieth session), at d 64
#: window + ALiBi + block mask, softcap + dropout + block mask, softcap + dropout + lengths (with or without a window),
#: at d 128 window + ALiBi and dropout + block mask; at d 256 dropout + ALiBi + lengths (32 bytes, sm_90 causal atomic:
#: the slow test's first complete run, fifty-first session).
GRID_EXT_SPILLED_PARTIAL = {64: (_BM | 1 | 2, _BM | _DROP | 4, _DROP | 4 | 32, _DROP | 1 | 4 | 32),
                            128: (_DROP | 1 | 4, 1 | 2, _BM | _DROP) + tuple(b for b in _BM128 if b != _BM | _DROP | 4),
                            256: (_DROP, _DROP | 2, _DROP | 2 | 32, _DROP | _BM | 2 | 4)}
#: False: the row-tile kernel everywhere (benchmarks/hopper_variants.py times both as ``mma.GRID_LAYOUT``).
#: Plans are cached: flip it before planning, or clear them (launch._clear_plans).
GRID_LAYOUT = True
#: The grid kernel's Q_i and dO_i — the tiles it copies every visit — unpadded and XOR-swizzled (16-byte chunk c of
#: row r at c ^ (r mod 8): FlashAttention-2's layout; flash_bwd_mma.cuh, swz_chunk_offset), where rows are copied
#: in 16-byte chunks. On an H100 the padded rows' copies read 24 global sectors per warp instruction where 16 hold
#: the data, and took ~2x the shared wavefronts (docs/gpu_h200.md, "Fourth GPU session"; the emulator's
#: cp_async_sectors). K_j, V_j, copied once per block, keep the padded rows: swizzling them too spilled 8 bytes at
#: d 128. Taken by dense calls and the extension sets of :data:`GRID_SWIZZLE_EXT`: zero spills there (sm_80 / sm_90,
#: fp16 / bf16, d 64 / 128, causal or not, both dQ modes), instructions per HMMA within ±2 % (docs/performance.md,
#: "Twentieth session"); every set with softcap spilled 8-112 bytes swizzled and keeps the padded rows. False: the
#: padded rows everywhere (``benchmarks/hopper_variants.py``'s ``mma.GRID_SWIZZLE``).
GRID_SWIZZLE = True
GRID_SWIZZLE_EXT = GRID_EXT & ~4
#: The fp16 / bf16 grid-layout dK/dV kernel's ordered dQ mode (dense calls; the row-tile kernel spilled 8 bytes at d 96
#: causal with it, extension sets 16 at d 80) takes its blocks entries first (``kEntriesFirst``,
#: flash_bwd_common.cuh's grid_pos): the blocks running at once are the first key blocks of many batch entries, so
#: the chains of dQ turns between them stay within an entry (from the grid's x: one entry's key blocks, a wave of
#: them chained). As the wgmma kernel's (cuda_backward_sm90.ENTRIES_FIRST). False: the grid's order
#: (``benchmarks/hopper_variants.py``'s ``mma.ENTRIES_FIRST``). Twenty-fourth session, not timed.
ENTRIES_FIRST = True


def grid_tile(D, Dv, arch, stages=None, ext=False, mode=None, vec=True, partial=False):
    """The grid-layout dK/dV tile for padded head dims D, Dv, or None where it does not apply (head dims
    other than d = dv in :data:`GRID_TILES`, extensions but :data:`GRID_EXT` with 16-byte row copies (``vec``),
    the recomputing or an unknown dQ ``mode``, two buffers forced, shared memory over the arch's limit,
    :data:`GRID_LAYOUT` off). ``partial``: dK, dV written as float partial sums (K/V broadcast with extensions),
    whose instantiations also refuse :data:`GRID_EXT_SPILLED_PARTIAL`."""
    if not GRID_LAYOUT or mode not in ("atomic", "ordered") or stages not in (None, 1):
        return None
    if ext and (isinstance(ext, bool) or int(ext) & ~GRID_EXT or int(ext) in GRID_EXT_SPILLED.get(D, ())
                or (partial and int(ext) in GRID_EXT_SPILLED_PARTIAL.get(D, ())) or not vec):
        return None
    if D != Dv or D not in GRID_TILES:
        return None
    Br, Bc = GRID_TILES[D]
    smem = tc_smem("dkv", D, Dv, Br, Bc, 1)
    limit = smem_limit(arch)
    if smem > limit:
        return None
    why = ("grid layout: %d keys x %d queries, 8 warps on 32-row warp tiles (0.5 ldmatrix per MMA); one buffer "
           "of Q_i, dO_i: %d B of shared memory fit the limit %d B" % (Bc, Br, smem, limit))
    swizzle = GRID_SWIZZLE and vec and not (int(ext) & ~GRID_SWIZZLE_EXT)
    if swizzle:
        why += "; Q_i, dO_i XOR-swizzled (GRID_SWIZZLE)"
    return GridBwdTiles(Br, Bc, 256, smem, why, 1, swizzle=swizzle)


def tc_smem(kernel, D, Dv, Br, Bc, stages=1, itemsize=2, warps=None):
    """Bytes of ``TcSmem``: Q_i, dO_i, K_j, V_j (the streamed pair ``stages`` times: Q_i, dO_i
    for "dkv", K_j, V_j for "dq"), then P^T and dS^T (dkv) or dS (dq), L_i, D_i. The dK/dV kernel
    with one warp per 16-key row tile (``warps`` == Bc / 16: P^T stays in registers) has no P^T."""
    sq, sk = (stages, 1) if kernel == "dkv" else (1, stages)
    q = _align16(sq * Br * (D + TC_PAD) * itemsize) + _align16(sq * Br * (Dv + TC_PAD) * itemsize)
    kv = _align16(sk * Bc * (D + TC_PAD) * itemsize) + _align16(sk * Bc * (Dv + TC_PAD) * itemsize)
    if kernel == "dkv":
        no_pt = warps is not None and warps == Bc // 16
        scores = (1 if no_pt else 2) * _align16(Bc * (Br + TC_PAD) * itemsize)   # P^T, dS^T: Bc x Br
    else:
        scores = _align16(Br * (Bc + TC_PAD) * itemsize)       # dS: Br x Bc
    return q + kv + scores + 2 * _align16(Br * 4)


def tc_split(kernel, D, Dv, Br, Bc, warps):
    """Column slices per row tile of each register accumulator, or None if the shape is illegal.

    ``warps / (row tiles)`` warps share a row tile; a head dim that does not divide into that
    many n16-step slices is split into fewer (the largest divisor that does; the remaining warps
    own none of it), mirroring ``column_slices`` in ``flash_bwd.cu``.
    Returns a tuple of slice counts: (dK, dV) for "dkv", (dQ,) for "dq".
    """
    rows = (Bc if kernel == "dkv" else Br) // 16
    if rows == 0 or warps % rows or warps < rows:
        return None
    split = warps // rows
    splits = []
    for c in ((D, Dv) if kernel == "dkv" else (D,)):
        s = split  # column_slices() of flash_bwd.cu
        while s > 1 and (split % s or c % (16 * s)):
            s -= 1
        splits.append(s)
    return tuple(splits)


def tc_tiles(kernel, D, Dv, arch, stages=None, ext=False, mode=None, vec=True, partial=False):
    """Tiles of ``flash_bwd_dkv_kernel`` (kernel="dkv") or ``flash_bwd_dq_kernel`` ("dq").

    Per candidate, double-buffered streamed tiles (``stages=2``: the next block's cp.async
    copies overlap this block's math) when shared memory allows, else one buffer; ``stages``
    forces one of them. The dK/dV kernel of a dense call in the atomic or ordered dQ ``mode`` takes the
    grid layout where :func:`grid_tile` gives one (``vec``: the rows take 16-byte copies; ``partial``: dK, dV as float
    partial sums). ``ext``: the kernels' extension bits (kExt; True: some); with any the dK/dV
    kernel takes no Bc = 128 candidate (with all six bits, d = 64's 128 x 64 tile, one warp per 16 keys
    holding its whole score strip in registers, spilled 4-16 bytes on sm_80), and the wide-key tiles only
    where :func:`wide_keys_take` allows the bits in the dQ ``mode`` (:data:`WIDE_KEYS_EXT`,
    :data:`WIDE_KEYS_EXT_BY_MODE`).
    """
    D, Dv = pad_head_dim(D), pad_head_dim(Dv)
    limit = smem_limit(arch)
    grid = grid_tile(D, Dv, arch, stages, ext, mode, vec, partial) if kernel == "dkv" else None
    if grid is not None:
        return grid
    take = kernel == "dkv" and WIDE_KEYS and wide_keys_take(ext, D, Dv, mode, arch)
    wide = _wide_keys(D, Dv, limit, stages) if take else None
    if wide is not None:
        return wide
    # Later passes: head dims that split unevenly over the warps (e.g. D = 16 with Dv = 192, or
    # 160) get more accumulator registers (the static checks confirm there are no spills).
    for budget in (TC_ACC_REGS,) + TC_ACC_REGS_FALLBACK:
        for big, small, warps in TC_CANDIDATES:
            # The block's own rows are the tile it keeps on chip (K_j, V_j for dK/dV; Q_i, dO_i
            # for dQ); the larger side goes there: each extra row saves a re-read of the other.
            Bc, Br = (big, small) if kernel == "dkv" else (small, big)
            if ext and kernel == "dkv" and Bc > 64:
                continue
            splits = tc_split(kernel, D, Dv, Br, Bc, warps)
            if splits is None:
                continue
            floats = sum(c // (2 * s) for c, s in zip((D, Dv), splits))
            if floats > budget:
                continue
            for st in ((2, 1) if stages is None else (stages,)):
                smem = tc_smem(kernel, D, Dv, Br, Bc, st, warps=warps)
                if smem <= limit:
                    why = ("largest (Bc, Br) whose %d accumulator floats per lane fit %d; %d buffer(s) of "
                           "the streamed tiles: %d B of shared memory fit the sm_%d limit %d B"
                           % (floats, budget, st, smem, arch_number(arch), limit))
                    return BwdTiles(Br, Bc, 32 * warps, smem, why, st)
    raise NotImplementedError(
        "flasharray: no tensor-core backward tile fits D=%d, Dv=%d on sm_%d" % (D, Dv, arch_number(arch)))


# Row-wise passes (preprocess D_i, dQ conversion): one warp per row, 4 rows per 128-thread block.
ROW_THREADS = 128
ROWS_PER_BLOCK = ROW_THREADS // 32


def describe(dtypes=("float16", "float32", "float64"), dims=(16, 32, 64, 128, 256), archs=ARCHS):
    """Rows ``(arch, dtype, D, kernel, Br, Bc, threads, stages, smem)`` of the table."""
    from .dtypes import canonical_dtype
    rows = []
    for a in archs:
        for dt in dtypes:
            dt = canonical_dtype(dt)
            for d in dims:
                for kern in ("dkv", "dq"):
                    if dt.itemsize == 2:
                        t = tc_tiles(kern, d, d, a)
                    else:
                        t = simt_tiles(kern, dt, d, d, a)
                    rows.append((a, str(dt), d, kern, t.block_m, t.block_n, t.n_threads, t.stages, t.smem))
    return rows
