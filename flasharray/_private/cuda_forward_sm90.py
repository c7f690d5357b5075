"""Tiles of the Hopper forward on wgmma (``cuda_src/flash_fwd_sm90.cu``, issue 13; docs/hopper.md).

Opt-in: :func:`forward_tile` returns a tile only for ``kernel="wgmma"`` (nothing has run on an H100
yet, so sm_90 calls keep the mma.sync forward by default), and only for what the kernel serves:
sm_90, float16 / bfloat16, head dims 1..256, no extensions, no IO tile (``block_m``), no split-KV,
no KV cache. Asking for ``kernel="wgmma"`` anywhere else is a NotImplementedError naming the reason.

Head dims are padded to 64, 128 or 256 (whole 128-byte swizzle panels; dv is the N of the O wgmma,
which the GPU takes as 64, 128 or 256) and zero-filled past D / Dv. Tiles: two consumer warpgroups
(Br = 128, 256 threads); Bc = 128 for head dims up to 128 (S and O accumulators 64 + 64 registers),
Bc = 64 at 256 (O takes 128 registers). Shared memory: Q, two K stages and two V stages, each
128B-swizzled, plus 1 KB for aligning the dynamic base to the swizzle repeat on the GPU.
"""
from dataclasses import dataclass

from . import tiles

SOURCE = "flash_fwd_sm90.cu"
KERNEL = "wgmma"
ARCH = 90
WARPGROUP_ROWS = 64
BLOCK_M = 2 * WARPGROUP_ROWS
STAGES = 2
MAX_HEAD_DIM = 256
_ALIGN = 1024  # the GPU's dynamic shared memory base rounded up to the 128B swizzle repeat


def pad_head_dim(n):
    """64, 128 or 256: the smallest that holds ``n`` (1..256)."""
    return next(p for p in (64, 128, 256) if n <= p)


def smem_bytes(d, dv, block_m, block_n):
    """Mirror of Sm90FwdTraits::kSmemBytes: max(Q + 2 K stages + 2 V stages, staged O + LSE) + 1 KB."""
    loop = 2 * (block_m * d + STAGES * block_n * (d + dv))
    epilogue = 2 * block_m * (dv + 8) + 4 * block_m
    return max(loop, epilogue) + _ALIGN


@dataclass(frozen=True)
class Sm90Tile(tiles.FwdTile):
    """A :class:`tiles.FwdTile` of the wgmma kernel (kernel ``"wgmma"``; threads_m = warps)."""

    @property
    def source(self):
        return SOURCE

    def name_expression(self, causal, aligned):
        return "flash::flash_fwd_sm90_kernel<%s, %d, %d, %d, %d, %s, %s>" % (
            tiles._CTYPE[self.dtype], self.head_dim, self.head_dim_v, self.block_m, self.block_n,
            "true" if causal else "false", "true" if aligned else "false")

    def describe(self):
        return ("wgmma kernel (sm_90a), Br=%d Bc=%d, %d threads (%d warpgroups), %d-stage K/V, d=%d dv=%d, "
                "%.1f KB smem (opt-in): %s" % (
                    self.block_m, self.block_n, self.n_threads, self.n_threads // 128, self.stages,
                    self.head_dim, self.head_dim_v, self.smem / tiles.KB, self.reason))


def _unsupported(why):
    return NotImplementedError("flasharray: kernel='wgmma' (the Hopper forward, cuda_src/%s) %s" % (SOURCE, why))


def forward_tile(dtype, head_dim, head_dim_v, arch, *, kernel=None, block_m=None, ext=False, num_splits=None,
                 kv=None):
    """The :class:`Sm90Tile` for a call with ``kernel="wgmma"``; None for any other ``kernel`` (the
    default chain picks the kernel). NotImplementedError where the wgmma kernel cannot run."""
    if kernel != KERNEL:
        return None
    a = tiles.arch_number(arch)
    if a != ARCH:
        raise _unsupported("needs sm_90 (wgmma, compiled for sm_90a); this device is sm_%d" % a)
    name = tiles.dtype_name(dtype)
    if name not in ("float16", "bfloat16"):
        raise _unsupported("takes float16 or bfloat16, got %s" % name)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    if not (1 <= head_dim <= MAX_HEAD_DIM and 1 <= head_dim_v <= MAX_HEAD_DIM):
        raise _unsupported("supports head dims 1..%d, got D=%d, Dv=%d" % (MAX_HEAD_DIM, head_dim, head_dim_v))
    others = [what for what, on in (("extensions", ext), ("block_m=%r" % (block_m,), block_m is not None),
                                    ("num_splits=%r" % (num_splits,), num_splits not in (None, 1)),
                                    ("a KV cache", kv is not None)) if on]
    if others:
        raise _unsupported("runs dense calls only: no %s" % ", ".join(others))
    d, dv = pad_head_dim(head_dim), pad_head_dim(head_dim_v)
    bc = 128 if max(d, dv) <= 128 else 64
    smem = smem_bytes(d, dv, BLOCK_M, bc)
    assert smem <= tiles.smem_limit(a), (d, dv, smem)
    reason = ("2 consumer warpgroups x 64 rows, Bc=%d (%s), K/V in a 2-stage cp.async ring, 128B-swizzled"
              % (bc, "S and O accumulators 64 + %d registers" % (dv // 2) if bc == 128
                 else "the O accumulator takes %d registers" % (dv // 2)))
    return Sm90Tile(KERNEL, name, d, dv, BLOCK_M, bc, BLOCK_M // 16, 32, smem, reason, STAGES)
