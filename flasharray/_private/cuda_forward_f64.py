"""Tiles of the float64 forward on the double-precision tensor cores (``cuda_src/flash_fwd_f64.cu``,
DMMA ``mma.sync.m8n8k4.f64``, sm_80+; issue 12).

IEEE fp64 throughout (DMMA is fp64 fused multiply-add), so it serves float64 with precision None
and "ieee" alike. :func:`forward_tile` returns the tile a call uses, or None where the kernel does
not apply — the caller then runs the SIMT kernel (also IEEE fp64):

* sm_80 and newer (sm_75 and below have no DMMA);
* padded head dims d, dv (multiples of 16) at most 128, i.e. any D, Dv in 1..128 (D even with
  16-byte aligned rows takes the cp.async path, anything else the element-wise loads);
* no extensions, no IO tile (``block_m``), no split-KV, no KV cache, no forced kernel family.

Every tile is 4 warps × one 16-row slab (two m8 tiles) each: Br = 64. Shared memory (fp64):
Q_i Br × (d + 8), K_j Bc × (d + 8), V_j Bc × (dv + 2) doubles. The choice: the first Bc of
(64, 32, 16) whose shared memory lets two blocks share an SM, else the first that fits at all, else
Bc = 8 (d = 128 on sm_86/89, whose 99 KB per block hold no Bc = 16 tile). Bc is at most 16 for
dv > 64: O_i (dv/2 doubles per thread) and S_ij (Bc/2) share the register file (Bc = 32 at d = 128
spills). E.g. sm_80: d <= 32 Bc 64, d 64 Bc 32, d 128 Bc 16 (one block per SM: 101 KB); sm_90:
d <= 64 Bc 64, d 128 Bc 16 (two per SM); sm_86/89: d 64 Bc 32, d 128 Bc 8. A GPU measurement may
revise this. The softmax weights use the kernel's short exp2 (``flash_f64_exp.cuh``, a 256-byte table in
shared memory).

On sm_90 the products run ``mma.sync.m16n8k16.f64`` (``DMMA.16x8x16``, Hopper's own fp64 shape: one instruction for
eight m8n8k4, the same steps in the same order; the kernel's ``kDmmaK``, the tile's ``dmma_k``) where
:data:`DMMA_K16` is on (Bc is a multiple of 16 on every sm_90 tile) and the rows take the cp.async copies
(``F64Tile.kernel_dmma_k``: the element-wise copies keep m8n8k4).
"""
from dataclasses import dataclass

from . import tiles

SOURCE = "flash_fwd_f64.cu"
MAX_HEAD_DIM = 128
MIN_ARCH = 80
WARPS = 4
BLOCK_M = 16 * WARPS
#: Shared memory per SM in KB (sass.ARCH_LIMITS; unknown arch: its block limit) and reserved per block.
_SM_SMEM_KB = {80: 164, 86: 100, 87: 164, 89: 100, 90: 228}
_RESERVED = 1024
#: sm_90: every product by m16n8k16 (DMMA.16x8x16) instead of m8n8k4 (DMMA.8x8x4); False gives the m8n8k4 kernel
#: (benchmarks/gpu_session.sh times both). Same bits on the emulator (flash_f64_mma.cuh); 8x fewer DMMA instructions.
DMMA_K16 = True
#: The first arch with the m16n8k16 f64 shape.
DMMA_K16_ARCH = 90
#: flash_f64_exp.cuh's kExp2TableBytes: 2^(j/16) as hi + lo doubles, j = 0..15.
EXP2_TABLE_BYTES = 256


def smem_bytes(d, dv, block_m, block_n):
    """Mirror of FwdF64Traits::kSmemBytes: sQ + sK + sV (rows padded by 8, 8 and 2 doubles), each
    16-byte aligned, then exp2_nonpositive's table (flash_f64_exp.cuh: 32 doubles)."""
    a16 = tiles._align16
    return a16(block_m * (d + 8) * 8) + a16(block_n * (d + 8) * 8) + a16(block_n * (dv + 2) * 8) + EXP2_TABLE_BYTES


@dataclass(frozen=True)
class F64Tile(tiles.FwdTile):
    """A :class:`tiles.FwdTile` of the DMMA kernel (kernel ``"f64"``; threads_m = warps); ``dmma_k`` 4
    (m8n8k4) or 16 (m16n8k16, sm_90: calls with the cp.async copies, :meth:`kernel_dmma_k`)."""
    dmma_k: int = 4

    @property
    def source(self):
        return SOURCE

    def kernel_dmma_k(self, aligned):
        """The kernel's kDmmaK: the element-wise copies (``aligned`` False) keep m8n8k4 — with m16n8k16 their
        registers spilled 12-88 bytes at 12 of the 128 (d, dv) x causal instantiations on sm_90."""
        return self.dmma_k if aligned else 4

    def name_expression(self, causal, aligned):
        return "flash::flash_fwd_f64_kernel<%d, %d, %d, %d, %d, %s, %s%s>" % (
            self.head_dim, self.head_dim_v, self.block_m, self.block_n, self.threads_m,
            "true" if causal else "false", "true" if aligned else "false",
            ", 16" if self.kernel_dmma_k(aligned) == 16 else "")

    def describe(self):
        return ("f64 kernel (DMMA m%s), Br=%d Bc=%d, %d threads, d=%d dv=%d, %.1f KB smem%s: %s" % (
            "16n8k16" if self.dmma_k == 16 else "8n8k4", self.block_m, self.block_n, self.n_threads,
            self.head_dim, self.head_dim_v, self.smem / tiles.KB, " (opt-in)" if self.needs_opt_in else "",
            self.reason))


def _candidates(dv):
    """Bc in order of preference (at most 16 for dv > 64: registers)."""
    return [bc for bc in (64, 32, 16) if dv <= 64 or bc <= 16]


def forward_tile(precision, dtype, head_dim, head_dim_v, arch, *, kernel=None, block_m=None, ext=False,
                 num_splits=None, kv=None):
    """The :class:`F64Tile` for a float64 call (precision None or "ieee") on sm_80+, or None (the
    SIMT kernel runs: another dtype, sm_75 and below, d or dv > 128, extensions, forced kernel, IO
    tile, split-KV or KV cache)."""
    if precision not in (None, "ieee") or tiles.dtype_name(dtype) != "float64":
        return None
    a = tiles.arch_number(arch)
    if a < MIN_ARCH or kernel is not None or block_m is not None or ext or num_splits not in (None, 1) \
            or kv is not None:
        return None
    d, dv = tiles.pad_head_dim(head_dim), tiles.pad_head_dim(head_dim_v)
    if max(d, dv) > MAX_HEAD_DIM:
        return None
    limit = tiles.smem_limit(a)
    per_sm = _SM_SMEM_KB.get(a, limit // tiles.KB + 1) * tiles.KB
    fits = [(bc, smem_bytes(d, dv, BLOCK_M, bc)) for bc in _candidates(dv)]
    fits = [f for f in fits if f[1] <= limit]
    shared = [f for f in fits if 2 * (f[1] + _RESERVED) <= per_sm]
    bc, smem = (shared or fits or [(8, smem_bytes(d, dv, BLOCK_M, 8))])[0]
    k = 16 if DMMA_K16 and a >= DMMA_K16_ARCH and bc % 16 == 0 else 4
    reason = "fp64 DMMA (m%s): Br=64 (4 warps x 16 rows), Bc=%d: %s" % (
        "16n8k16" if k == 16 else "8n8k4", bc, "the first Bc letting 2 blocks share an SM" if shared else
        "the first Bc that fits (one block per SM)" if fits else "Bc = 16 does not fit (one block per SM)")
    return F64Tile("f64", "float64", d, dv, BLOCK_M, bc, WARPS, 32, smem, reason, 1, k)
