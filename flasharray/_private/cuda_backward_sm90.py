"""Tiles of the Hopper backward on wgmma (``cuda_src/flash_bwd_sm90.cu``, issue 13; docs/hopper.md, "Backward").

The dK/dV kernel ``flash_bwd_sm90_dkv_kernel`` (always atomic dQ into the fragment-ordered
``DQAccumLayout`` accumulator, in key-block order when deterministic) as a family of
``cuda_backward.FAMILIES``: the preprocess and conversion passes are the tensor-core backward's.

Opt-in, like the forward's: ``cuda_backward.backward(..., kernel="wgmma")`` on sm_90 (the emulator:
``arch="sm_90"``); nothing picks it automatically (no H100 has run it). Where it cannot run,
:func:`backward_tile` raises NotImplementedError naming the reason: another arch, another dtype,
head dims above 128, extensions, ``dq="recompute"``.

Tile: Br = 64 queries per visit (the N of S^T, dP^T and dQ^T), Bc = 128 keys (two warpgroups of 64
keys, 256 threads); head dims padded to 64 or 128 (whole 128-byte swizzle panels; the N of the dK /
dV wgmma). Registers per thread: dK_j, dV_j (d/2 + dv/2), S^T, dP^T (Br/2 each), their rounded A
fragments, dQ^T (Br/2). Shared memory: K_j, V_j, two stages of Q_i and dO_i, dS^T (Bc x Br), L_i and
D_i per stage, plus 1 KB to align the dynamic base on the swizzle repeat (GPU).
"""
from . import launch
from . import tiles
from .tiles_bwd import BwdTiles

SOURCE = "flash_bwd_sm90.cu"
KERNEL = "flash_bwd_sm90_dkv_kernel"
FAMILY = "wgmma"
ARCH = 90
BLOCK_M = 64
BLOCK_N = 128
STAGES = 2
MAX_HEAD_DIM = 128
#: kExt bits the ordered dQ mode takes: none (the kernel runs dense calls only).
ORDERED_EXT = 0
_ALIGN = 1024

# wgmma needs the arch-specific target: the CuPy path compiles this source for sm_90a (as the forward).
launch.ARCH_SPECIFIC.setdefault(SOURCE, {ARCH: "sm_90a"})


def pad_head_dim(n):
    """64 or 128: the smallest that holds ``n`` (1..128)."""
    return 64 if n <= 64 else 128


def smem_bytes(d, dv, block_m=BLOCK_M, block_n=BLOCK_N):
    """Mirror of ``Sm90BwdTraits::kSmemBytes``."""
    return 2 * (block_n * (d + dv) + STAGES * block_m * (d + dv) + block_n * block_m) + STAGES * 2 * block_m * 4 + _ALIGN


def _unsupported(why):
    return NotImplementedError("flasharray: kernel='wgmma' (the Hopper backward, cuda_src/%s) %s" % (SOURCE, why))


def backward_tile(precision, dtype, D, Dv, arch, *, ext=False):
    """The :class:`BwdTiles` of the wgmma dK/dV kernel; NotImplementedError where it cannot run
    (only asked for with ``kernel="wgmma"``: ``cuda_backward.family_tile`` never offers it)."""
    a = tiles.arch_number(arch)
    if a != ARCH:
        raise _unsupported("needs sm_90 (wgmma, compiled for sm_90a); this device is sm_%d" % a)
    name = tiles.dtype_name(dtype)
    if name not in ("float16", "bfloat16"):
        raise _unsupported("takes float16 or bfloat16, got %s" % name)
    if precision not in (None, "ieee"):
        raise _unsupported("takes no precision option, got %r" % (precision,))
    Dv = D if Dv is None else Dv
    if not (1 <= D <= MAX_HEAD_DIM and 1 <= Dv <= MAX_HEAD_DIM):
        raise _unsupported("supports head dims 1..%d, got D=%d, Dv=%d" % (MAX_HEAD_DIM, D, Dv))
    if ext:
        raise _unsupported("runs dense calls only: no extensions")
    d, dv = pad_head_dim(D), pad_head_dim(Dv)
    smem = smem_bytes(d, dv)
    assert smem <= tiles.smem_limit(a), (d, dv, smem)
    reason = ("Br=%d (N of S^T, dP^T, dQ^T), Bc=%d (2 warpgroups x 64 keys), d=%d dv=%d, 2-stage Q_i/dO_i "
              "(cp.async), 128B-swizzled" % (BLOCK_M, BLOCK_N, d, dv))
    return BwdTiles(BLOCK_M, BLOCK_N, BLOCK_N // 64 * 128, smem, reason, STAGES)


def dkv_name(tile, precision, pD, pDv, causal, vec, ordered, ext=0, dtype=None, out=None):
    """Name expression of the wgmma dK/dV kernel: ``dtype`` / ``out`` the element and output C types
    (``out`` AccT for partial sums), ``pD`` the head dim padded to 16 (the accumulator's, kDQDim)."""
    if ext:
        raise ValueError("flasharray: the wgmma backward takes no extensions (kExt=%d)" % ext)
    b = lambda x: "true" if x else "false"  # noqa: E731
    return "%s<%s, %s, %d, %d, %d, %d, %d, %s, %s, %s>" % (
        KERNEL, dtype, out or dtype, pad_head_dim(pD), pad_head_dim(pDv), pD, tile.block_m, tile.block_n,
        b(causal), b(vec), b(ordered))
