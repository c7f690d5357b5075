"""Tiles of the float32 forward on TF32 tensor cores (``cuda_src/flash_fwd_tf32.cu``, issue 12).

``precision="tf32"`` (one mma per product, operands rounded to tf32) and ``"3xtf32"`` (operands
split hi + lo, three mma per product). :func:`forward_tile` returns the tile a call uses, or None
where the kernel does not apply — the caller then runs the SIMT kernel (exact fp32):

* padded head dims d, dv (multiples of 16) at most 128, i.e. any D, Dv in 1..128 (D a multiple
  of 4 with 16-byte aligned rows takes the cp.async path, anything else the element-wise loads);
* no extensions, no IO tile (``block_m``), no split-KV, no KV cache, no forced kernel family.

Every tile is 4 warps × one 16-row slab (Br = 64). Shared memory (fp32, rows padded by 4 floats):
Q_i raw (Br × d), K_j and V_j as tf32 planes — one for tf32, hi and lo for 3xtf32. Bc is the
largest of 64, 32, 16 that fits the arch: 3xtf32 at d = 128 takes Bc = 32 (Q 33 KB + K 2 × 16.5
KB + V 2 × 16.5 KB = 99 KB, exactly sm_86/89's opt-in maximum).
"""
from dataclasses import dataclass

from . import tiles
from .precision import check_precision_arch

#: Kernel template argument kPrec per precision (mma per product).
PREC = {"tf32": 1, "3xtf32": 3}
SOURCE = "flash_fwd_tf32.cu"
MAX_HEAD_DIM = 128
WARPS = 4
BLOCK_M = 16 * WARPS
_PAD = 4  # floats per shared-memory row


def smem_bytes(d, dv, block_m, block_n, precision):
    """Mirror of FwdTf32Traits::kSmemBytes: sQ + planes × (sK + sV), each 16-byte aligned."""
    planes = 2 if precision == "3xtf32" else 1
    a16 = tiles._align16
    return (a16(block_m * (d + _PAD) * 4) + a16(planes * block_n * (d + _PAD) * 4)
            + a16(planes * block_n * (dv + _PAD) * 4))


@dataclass(frozen=True)
class Tf32Tile(tiles.FwdTile):
    """A :class:`tiles.FwdTile` of the TF32 kernel (kernel ``"tf32"``; threads_m = warps)."""
    precision: str = "tf32"

    @property
    def source(self):
        return SOURCE

    def name_expression(self, causal, aligned):
        return "flash::flash_fwd_tf32_kernel<%d, %d, %d, %d, %d, %d, %s, %s>" % (
            self.head_dim, self.head_dim_v, self.block_m, self.block_n, self.threads_m, PREC[self.precision],
            "true" if causal else "false", "true" if aligned else "false")

    def describe(self):
        return ("tf32 kernel (%s), Br=%d Bc=%d, %d threads, d=%d dv=%d, %.1f KB smem%s: %s" % (
            self.precision, self.block_m, self.block_n, self.n_threads, self.head_dim, self.head_dim_v,
            self.smem / tiles.KB, " (opt-in)" if self.needs_opt_in else "", self.reason))


def forward_tile(precision, dtype, head_dim, head_dim_v, arch, *, kernel=None, block_m=None, ext=False,
                 num_splits=None, kv=None):
    """The :class:`Tf32Tile` for a float32 call with ``precision`` "tf32" / "3xtf32", or None (the
    SIMT kernel runs: precision None / "ieee", another dtype, d or dv > 128, extensions, forced
    kernel, IO tile, split-KV or KV cache). NotImplementedError naming the arch below sm_80."""
    if precision not in PREC or tiles.dtype_name(dtype) != "float32":
        return None
    check_precision_arch(precision, tiles.arch_number(arch))
    if kernel is not None or block_m is not None or ext or num_splits not in (None, 1) or kv is not None:
        return None
    d, dv = tiles.pad_head_dim(head_dim), tiles.pad_head_dim(head_dim_v)
    if max(d, dv) > MAX_HEAD_DIM:
        return None
    for bc in (64, 32, 16):
        smem = smem_bytes(d, dv, BLOCK_M, bc, precision)
        if smem <= tiles.smem_limit(arch):
            reason = ("%s: Br=64 (4 warps x 1 slab), Bc=%d, the largest of 64/32/16 whose K/V %s fit %d KB"
                      % (precision, bc, "hi+lo planes" if precision == "3xtf32" else "tf32 planes",
                         tiles.smem_limit(arch) // tiles.KB))
            return Tf32Tile("tf32", "float32", d, dv, BLOCK_M, bc, WARPS, 32, smem, reason, 1, precision)
    return None  # pragma: no cover - Bc = 16 fits every sm_80+ arch
