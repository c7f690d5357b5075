"""Tiles of the float64 backward on the double-precision tensor cores (``cuda_src/flash_bwd_f64.cu``,
DMMA ``mma.sync.m8n8k4.f64``, sm_80+; issue 12): the dK/dV kernel with atomic dQ (plain, or in
key-block order: the deterministic mode), and the conversion of its double accumulator
(``flash_bwd_convert_dq_tc_kernel<double, ..., double>``).

IEEE fp64 throughout, so it serves float64 with precision None and "ieee" alike.
:func:`backward_tile` returns the tile a call uses, or None where the kernel does not apply (the
caller then runs the SIMT backward, also IEEE fp64): another dtype or precision, sm_75 and below,
padded head dims d, dv above 128, extensions.

Work split: warp w owns keys w·8·kMT .. of K_j (kMT m8 tiles) and every column of their dK_j,
dV_j rows, so Bc = 8·kMT·warps. Per thread (doubles): dK_j kMT·d/4, dV_j kMT·dv/4, the score
strip's P^T and dS^T kMT·Br/4 each. Where kMT·(d + dv) > 128, dV_j lives in shared memory
(each lane updating its own elements per 16-column pair; in registers ptxas spills at d = dv = 96).
Shared memory (fp64): Q_i Br × (d + 2), dO_i Br × (dv + 2), K_j Bc × (d + 2), V_j Bc × (dv + 2),
dS Br × (Bc + 8), L_i and D_i Br each, dV_j Bc × (dv + 2) (``smem_bytes`` mirrors
BwdF64Traits::kBytes). The choice (registers <= 255 with zero spills, checked by
tests/test_static_backward_f64.py for every tile this table can return):

* d, dv <= 32: kMT = 2, 4 warps (Bc = 64), Br = 32;
* d, dv <= 64: kMT = 1, 4 warps (Bc = 32), Br = 32 at d + dv <= 96, else 16 (d = dv = 64 at Br = 32
  spilled 40 bytes on sm_90 once dK_j, dV_j are summed per visit from zero: blocked summation);
* larger: kMT = 1, Br = 16, dV_j in shared memory, 4 warps (Bc = 32) where the shared memory
  fits, else 2 (Bc = 16: d = dv = 128 on sm_86/89, 99 KB per block).

On sm_90 the kMT = 1, 4-warp tiles at padded d, dv multiples of 32 run ``mma.sync.m16n8k16.f64`` (DMMA.16x8x16; the
kernel's kDmmaK, :class:`F64BwdTiles`' ``dmma_k``, :func:`dmma_k`, switch :data:`DMMA_K16`): warp pairs share 16
keys, P is stored next to dS (Br × (Bc + 8)), and dV_j moves to shared memory from d + dv > 96 (pitch dv + 8), which
leaves d = dv = 64 one buffer of Q_i, dO_i (two would cost the second block).
"""
from dataclasses import dataclass

from . import tiles, tiles_bwd
from .cuda_backward_tf32 import _MAX_WARPS_PER_SM, _RESERVED, _SM_SMEM_KB
from .cuda_forward_f64 import DMMA_K16_ARCH, EXP2_TABLE_BYTES

SOURCE = "flash_bwd_f64.cu"
MAX_HEAD_DIM = 128
MIN_ARCH = 80
#: sm_90: every product by m16n8k16 (DMMA.16x8x16) instead of m8n8k4 where the tile allows it (:func:`dmma_k`);
#: False gives the m8n8k4 kernel (benchmarks/gpu_session.sh times both). Same bits on the emulator.
DMMA_K16 = True


@dataclass(frozen=True)
class F64BwdTiles(tiles_bwd.BwdTiles):
    """A :class:`tiles_bwd.BwdTiles` of ``flash_bwd_dkv_f64_kernel``; ``dmma_k`` 4 (m8n8k4) or 16 (m16n8k16: the
    kernel's kDmmaK, :func:`dmma_k`)."""
    dmma_k: int = 4


def dmma_k(d, dv, block_n, warps, arch):
    """The kernel's kDmmaK where the tile allows it: 16 on sm_90 (:data:`DMMA_K16`) for one m8 key tile per warp, 4
    warps and padded d, dv multiples of 32 (warp pairs share 16 keys, each takes half of dK_j's and dV_j's columns:
    whole 16-column pairs), else 4. :func:`backward_tile` takes 16 where it also costs no resident warps."""
    ok = DMMA_K16 and arch >= DMMA_K16_ARCH and block_n == 8 * warps and warps == 4 and d % 32 == 0 and dv % 32 == 0
    return 16 if ok else 4


def dv_in_smem(d, dv, block_n, warps, k=4):
    """BwdF64Traits::kDVSmem: dV_j in shared memory where kMT·(d + dv) > 128 (registers); with m16n8k16 (``k`` 16,
    A fragments of the whole visit in registers) > 64: at d = dv = 64 dV_j in registers spilled 4-96 bytes."""
    return block_n // (8 * warps) * (d + dv) > (96 if k == 16 else 128)


def smem_bytes(d, dv, block_m, block_n, warps, stages=1, k=4):
    """Mirror of BwdF64Traits::kBytes: ``stages`` x (Q_i, dO_i) (rows padded by 2 doubles), K_j, V_j
    (padded by 2), dS (padded by 8), ``stages`` x (L_i, D_i), dV_j where :func:`dv_in_smem` (padded by 8 where
    ``k`` is 16), P where ``k`` is 16 (as dS); each region 16-byte aligned; then exp2_nonpositive's table
    (flash_f64_exp.cuh)."""
    a16 = tiles._align16
    return (a16(stages * block_m * (d + 2) * 8) + a16(stages * block_m * (dv + 2) * 8) + a16(block_n * (d + 2) * 8)
            + a16(block_n * (dv + 2) * 8) + a16(block_m * (block_n + 8) * 8) + 2 * a16(stages * block_m * 8)
            + (a16(block_n * (dv + (8 if k == 16 else 2)) * 8) if dv_in_smem(d, dv, block_n, warps, k) else 0)
            + (a16(block_m * (block_n + 8) * 8) if k == 16 else 0) + EXP2_TABLE_BYTES)


def register_warps(block_m, block_n, warps, d, dv, k=4):
    """Warps per SM the register file holds, the cap of :func:`resident_warps`: the TF32 backward's
    8 (169-255 registers per thread), 12 for the Br = 32, kMT = 1 tiles at d + dv <= 96, where
    ptxas fits some instantiations in 156-168 registers (d = dv = 48 with cp.async copies on sm_90:
    12 warps; sm_90's Br = 32 tiles at d + dv <= 128 take 212-255). tests/test_static_backward_f64.py
    checks the resulting choice against the occupancy at the measured registers. The m16n8k16 tiles (``k`` 16) take
    226-252 at d + dv = 96: 8."""
    return 12 if k == 4 and block_m == 32 and block_n == 8 * warps and d + dv <= 96 else _MAX_WARPS_PER_SM


def resident_warps(arch, smem, warps, cap=_MAX_WARPS_PER_SM):
    """Warps per SM the shared memory leaves (at most ``cap``: the register file), by the TF32
    backward's rule (:mod:`cuda_backward_tf32`: the same per-SM shared memory and reserve)."""
    per_sm = _SM_SMEM_KB.get(arch, tiles.smem_limit(arch) // tiles.KB + 1) * tiles.KB
    return min(cap, warps * (per_sm // (smem + _RESERVED)))


def stages_for(d, dv, block_m, block_n, warps, arch, k=4):
    """2 (Q_i, dO_i, L_i, D_i double-buffered: the next visit's cp.async copies overlap this
    visit's products) where the second buffer fits and costs no resident warps, else 1."""
    one = smem_bytes(d, dv, block_m, block_n, warps, 1, k)
    two = smem_bytes(d, dv, block_m, block_n, warps, 2, k)
    cap = register_warps(block_m, block_n, warps, d, dv, k)
    return 2 if two <= tiles.smem_limit(arch) and resident_warps(arch, two, warps, cap) >= resident_warps(
        arch, one, warps, cap) else 1


#: Tiles at 96 < d + dv <= 128 (max(d, dv) <= 64) take Br = 32 queries per visit (else 16, the choice before the
#: twenty-first session). At d = 64 the dQ product is 16 x 32 tiles dealt to the 4 warps (DQAccumLayout): Br = 16
#: gives two tiles, so two warps wait through every dQ phase, and a visit's critical path is 192 DMMA for 16 query
#: rows; Br = 32 gives four, 320 DMMA for 32 rows (-17 % per row). It also halves the barriers and the ordered-dQ
#: turns per DMMA. sm_90 keeps both buffers of Q_i, dO_i and 8 warps per SM (242-254 registers, no spills;
#: 5.05 -> 4.80 instructions per DMMA); sm_80 and sm_86/89 keep their resident warps and drop the second buffer
#: (two 110 KB blocks do not fit). Not yet timed on a GPU: benchmarks/gpu_session.sh's step gpu_fp64_br16.
WIDE_QUERY = True


def _candidates(d, dv):
    """(Br, kMT, warps) in order of preference."""
    if max(d, dv) <= 32:
        return [(32, 2, 4)]
    if max(d, dv) <= 64:
        return [(32, 1, 4)] if d + dv <= 96 or WIDE_QUERY else [(16, 1, 4)]
    return [(16, 1, 4), (16, 1, 2)]


def _dq_tiles(block_m, d):
    """DQAccumLayout's 16 x kDQCols tiles of a query block, and n8 tiles per tile."""
    cols = 32 if d % 32 == 0 else 16
    return block_m // 16 * (d // cols), cols // 8


def dq_unit_n8(block_m, d, warps):
    """Mirror of flash_bwd_f64.cu's dq_unit_n8: n8 tiles per dQ work unit (units of one 16 x kDQCols tile of
    DQAccumLayout, dealt round-robin to the warps): the divisor of kDQCols / 8 putting the fewest n8 tiles on
    the busiest warp, ties to the larger unit."""
    tiles, n8 = _dq_tiles(block_m, d)
    costs = [(-(-(tiles * (n8 // u)) // warps) * u, -u) for u in range(1, n8 + 1) if n8 % u == 0]
    return -min(costs)[1]


def dq_rounds(block_m, d, warps):
    """Rounds of atomic_dq_f64's unit loop on the busiest warp: ceil(units / warps)."""
    tiles, n8 = _dq_tiles(block_m, d)
    return -(-(tiles * (n8 // dq_unit_n8(block_m, d, warps))) // warps)


def backward_tile(precision, dtype, D, Dv, arch, *, ext=False):
    """The :class:`tiles_bwd.BwdTiles` of ``flash_bwd_dkv_f64_kernel`` for a float64 call on sm_80+,
    or None (the SIMT backward runs)."""
    if precision not in (None, "ieee") or tiles.dtype_name(dtype) != "float64" or ext:
        return None
    a = tiles.arch_number(arch)
    if a < MIN_ARCH:
        return None
    d, dv = tiles.pad_head_dim(D), tiles.pad_head_dim(Dv)
    if max(d, dv) > MAX_HEAD_DIM:
        return None
    limit = tiles.smem_limit(a)
    for br, mt, warps in _candidates(d, dv):
        bc = 8 * mt * warps
        options = []  # (dmma_k, stages, smem, resident warps): m16n8k16 first where it applies
        for k in sorted({dmma_k(d, dv, bc, warps, a), 4}, reverse=True):
            if smem_bytes(d, dv, br, bc, warps, 1, k) <= limit:
                stages = stages_for(d, dv, br, bc, warps, a, k)
                smem = smem_bytes(d, dv, br, bc, warps, stages, k)
                options.append((k, stages, smem, resident_warps(a, smem, warps)))
        if not options:
            continue
        # m16n8k16's P and padded dV_j (shared memory) only where they cost resident warps at the register file's
        # 8 (both kernels take 226-255 registers there; d 64, dv 128: 8 -> 4)
        k, stages, smem, _ = max(options, key=lambda o: o[3])  # the first of the best: m16n8k16 on ties
        resident = resident_warps(a, smem, warps, register_warps(br, bc, warps, d, dv, k))
        reason = ("fp64 DMMA (m%s): %d warps x %d key rows (kMT = %d), Br = %d, Bc = %d%s: "
                  "the first tile of the register table whose shared memory fits the sm_%d limit %d B; "
                  "%d buffer(s) of Q_i/dO_i (%d B, %d resident warps per SM)%s"
                  % ("16n8k16" if k == 16 else "8n8k4", warps, 8 * mt, mt, br, bc,
                     ", dV_j in shared memory" if dv_in_smem(d, dv, bc, warps, k) else "", a, limit, stages, smem,
                     resident, "; m8n8k4: m16n8k16's shared memory would cost resident warps"
                     if len(options) == 2 and k == 4 else ""))
        return F64BwdTiles(br, bc, 32 * warps, smem, reason, stages, k)
    return None


def dkv_name(tile, precision, pD, pDv, causal, vec, ordered):
    """The name expression of ``flash_bwd_dkv_f64_kernel`` for ``tile`` (padded head dims pD, pDv)."""
    del precision  # IEEE fp64 either way
    b = lambda x: "true" if x else "false"  # noqa: E731
    return "flash_bwd_dkv_f64_kernel<%d, %d, %d, %d, %d, %s, %s, %s, %d%s>" % (
        pD, pDv, tile.block_m, tile.block_n, tile.n_threads // 32, b(causal), b(vec), b(ordered), tile.stages,
        ", 16" if getattr(tile, "dmma_k", 4) == 16 else "")


def convert_name(tile, pD, D):
    """The conversion of the double accumulator (``flash_bwd_convert.cu``), as the host launches it."""
    return "flash_bwd_convert_dq_tc_kernel<double, 128, %d, %d, %s, double>" % (
        tile.block_m, pD, "true" if D % 8 == 0 else "false")
