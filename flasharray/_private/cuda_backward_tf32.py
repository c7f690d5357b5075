"""Tiles of the float32 backward on TF32 tensor cores (``cuda_src/flash_bwd_tf32.cu``, issue 12).

The dK/dV kernel ``flash_bwd_dkv_tf32_kernel`` (always atomic dQ into the fragment-ordered
accumulator, ordered or not) for ``precision="tf32"`` (one mma per product) and ``"3xtf32"``
(hi/lo split, three). :func:`backward_tile` returns the tile a call uses, or None where the kernel
does not apply (another precision or dtype, padded head dims above 256, extensions at wide head
dims).

Extensions (docs/extensions.md) run on the same tiles with the kernel's ``kExt`` bits
(:func:`dkv_name`'s ``ext``): all of them, in both dQ modes (:data:`ORDERED_EXT`) — the ordered counters
follow the key blocks visiting query block i, one contiguous run whose first one the kernel knows (0, or a
window's left edge: ``DQOrder::turn(i, Br, Bc, mask)``), a block mask's holes skipped (``dq_turn``,
cuda_src/flash_bwd_ext.cuh).

Work split: kNWarps = Bc / 16 warps, warp w owning keys 16 w.. of dK_j, dV_j in registers (every
column) and the 16 x Br strips of S^T, dP^T (P^T, dS^T as float C fragments). Registers bound Br:
a thread holds (d + dv) / 2 accumulator floats plus the two strips (Br floats) and their operand
fragments, so Br shrinks as the head dims grow (measured with NVRTC on sm_80/86/89/90 for every
padded d = dv and mixed shapes, every flag: zero spills at <= 255 registers,
tests/test_static_backward_tf32.py):

    tf32:      max(d, dv) <= 64: Br 64;  <= 96: Br 32;  else Br 16
    3xtf32:    max(d, dv) <= 64: Br 32;  else Br 16 (and Bc <= 32 above 112: 4 warps spill on sm_90)

Shared memory (fp32, rows padded by 4 floats; ``smem_bytes`` mirrors ``Tf32BwdSmem``): Q_i, dO_i,
K_j, V_j and dS^T (Bc x Br) — one tf32 plane each, or hi and lo planes for 3xtf32 (``lo_planes``).
3xtf32 without lo planes (raw fp32 tiles, every fragment split in registers: half the shared
memory, but 2.8x the instructions per HMMA at d 128 — 9.35 vs 3.3 on sm_86) is implemented and
tested but chosen only where no lo-plane tile fits (none of today's arches for d, dv <= 128); it is
the candidate to time against the lo planes where those leave one warp per SM (3xtf32, d or dv >
112 on sm_86/89). Bc among 64, 32, 16: the most resident warps per
SM by shared memory (at most 8: the kernels need 150-255 registers), ties to the larger Bc (fewer
reloads of Q_i, dO_i); then two buffers of Q_i, dO_i (``stages`` = 2: the next visit's cp.async
copies overlap this visit's products) where the second buffer costs no resident warps. E.g. sm_80: tf32 d 64 Br 64 Bc 64, d 128 Br 16 Bc 32; 3xtf32 d 64 Br 32
Bc 64, d 128 Br 16 Bc 32; sm_86/89: 3xtf32 d 64 Bc 32, d 128 Bc 16.

3xtf32 keeps dK_j, dV_j in shared memory at every head dim (``acc_in_smem``, the kernel's
``SmemAcc`` below), each visit's k-steps summed in a zeroed fragment and added in fp32: the tensor
cores truncate their sums, and a running sum kept inside the mma over every query tile failed the
float32 rule on an H200 (docs/precision.md, *Default*). The Bc x (d + dv) floats cost resident warps
at some shapes (sm_90 d 128: 4 -> 2; sm_80 d 96: 4 -> 2, d 32: 8 -> 6).

Wide head dims (padded max(d, dv) in 144..256, :data:`REG_ACC_HEAD_DIM`): (d + dv) / 2 accumulator
floats per thread do not fit next to the strips, so dK_j, dV_j accumulate in shared memory (the
kernel's ``SmemAcc``: Bc x (d + dv) floats more, each lane touching only its own fragments, as the
f64 DMMA backward keeps dV_j), Br 16, the same Bc / lo-plane / stages rule. d = dv: sm_80 tf32
Bc 32 (16 at 256), 3xtf32 Bc 32 at 144, then 16, lo planes up to 240, raw tiles at 256; sm_86/89
tf32 Bc 32 at 144, then 16, 3xtf32 Bc 16, raw tiles from 160 (the lo planes pass 99 KB); sm_90 tf32
Bc 64 up to 192, then 32, 3xtf32 Bc 32 up to 208, then 16, lo planes throughout. Dense calls only: with any extension (kExt != 0) the call runs the SIMT backward
(not compiled or checked for spills at wide head dims).
"""
from dataclasses import dataclass

from . import launch, tiles
from .precision import check_precision_arch
from .tiles_bwd import BwdTiles

#: Kernel template argument kPrec per precision (mma per product).
PREC = {"tf32": 1, "3xtf32": 3}
SOURCE = "flash_bwd_tf32.cu"
KERNEL = "flash_bwd_dkv_tf32_kernel"
MAX_HEAD_DIM = 256
#: Above this padded head dim (d or dv) dK_j, dV_j accumulate in shared memory (the kernel's
#: SmemAcc): (d + dv) / 2 floats per thread do not fit in registers next to the strips.
REG_ACC_HEAD_DIM = 128
_PAD = 4  # floats per shared-memory row
#: Shared memory per SM in KB and reserved per block (as cuda_forward_tf32).
_SM_SMEM_KB = {80: 164, 86: 100, 87: 164, 89: 100, 90: 228}
_RESERVED = 1024
#: Warps per SM the register file holds at the kernels' 200-255 registers per thread.
_MAX_WARPS_PER_SM = 8
#: kExt bits (cuda_forward.EXT_BITS) the 3xtf32 kernel takes at padded head dims above 64: window,
#: dropout, lengths. ALiBi, softcap and the block mask spilled there (4-156 bytes on sm_80/86/89/90,
#: d 80-128, even at the smallest tile), so those calls run the SIMT backward
#: (tests/test_static_backward_tf32.py).
WIDE_3XTF32_EXT = 1 | 16 | 32

#: 3xtf32 dense calls keep the lo planes of Q_i, dO_i only (K_j, V_j and dS^T raw, each fragment split after its load:
#: the kernel's kLoPlanes = 2) where that lets more warps share an SM than the tile with every plane: at d 64 on sm_90
#: two 4-warp blocks (109 KB each) instead of one (155 KB); d 128 on sm_90 two 2-warp blocks. The operands are the same
#: bits (the same split), so are the gradients; ~50 % more instructions per HMMA (docs/precision.md, *Fewer lo planes*).
#: Padded head dims up to 128 only: at the wide ones (dK_j, dV_j in shared memory) some instantiations spilled 4 bytes
#: once Sᵀ and dPᵀ took partial sums.
KV_RAW = True

#: The wgmma dK/dV kernel (``cuda_src/flash_bwd_sm90_tf32.cu``) on sm_90 for dense calls with 16-byte aligned rows at
#: padded head dims up to 64 (computed at d = dv = 64, the dQ accumulator at the padded D): Br = Bc = 64, two
#: warpgroups (:func:`wgmma_tile`). Off: the mma.sync kernel.
WGMMA = True
WGMMA_SOURCE = "flash_bwd_sm90_tf32.cu"
WGMMA_KERNEL = "flash_bwd_dkv_sm90_tf32_kernel"
WGMMA_HEAD_DIM = 64
# wgmma needs the arch-specific target: the CuPy path compiles this source for sm_90a (launch.ARCH_SPECIFIC).
launch.ARCH_SPECIFIC.setdefault(WGMMA_SOURCE, {90: "sm_90a"})

#: kExt bits (cuda_forward.EXT_BITS) the ordered dQ mode takes: every one (every query block's visitors stay one
#: run of key blocks n_lo(i) .. n(i) − 1; a block mask's holes take no turn: ``dq_turn``, the forty-third session).
ORDERED_EXT = 1 | 2 | 4 | 8 | 16 | 32


def block_m(precision, d, dv):
    """Br for padded head dims d, dv (the register rule of the module docstring)."""
    m = max(d, dv)
    if precision == "tf32":
        return 64 if m <= 64 else 32 if m <= 96 else 16
    return 32 if m <= 64 else 16


def acc_in_smem(precision, d, dv):
    """Mirror of ``Tf32BwdSmem::kAccSmem``: dK_j, dV_j in shared memory (wide head dims; 3xtf32 always,
    each visit summed in a zeroed fragment and added in fp32: the tensor cores truncate their sums)."""
    return max(d, dv) > REG_ACC_HEAD_DIM or precision == "3xtf32"


def smem_bytes(d, dv, block_m, block_n, precision, lo_planes=True, stages=1, kv_planes=True):
    """Mirror of ``Tf32BwdSmem::kBytes``: planes x (stages x Q_i, stages x dO_i), planes x (K_j, V_j, dS^T),
    then L_i, D_i. 3xtf32: ``lo_planes`` every tile with a lo plane (False: none), ``kv_planes`` False:
    K_j, V_j, dS^T without (the kernel's kLoPlanes = 2)."""
    q_planes = 2 if precision == "3xtf32" and lo_planes else 1
    kv = 2 if q_planes == 2 and kv_planes else 1
    a16 = tiles._align16
    tiles_f = ((q_planes, stages * block_m * (d + _PAD)), (q_planes, stages * block_m * (dv + _PAD)),
               (kv, block_n * (d + _PAD)), (kv, block_n * (dv + _PAD)), (kv, block_n * (block_m + _PAD)))
    acc = 4 * block_n * (d + dv) if acc_in_smem(precision, d, dv) else 0  # SmemAcc dK_j, dV_j
    return sum(a16(planes * n * 4) for planes, n in tiles_f) + 2 * a16(block_m * 4) + acc


@dataclass(frozen=True)
class Tf32BwdTiles(BwdTiles):
    """A :class:`BwdTiles` of the TF32 dK/dV kernel (stages = 1): also the precision, padded head
    dims and whether 3xtf32 keeps lo planes in shared memory (``lo_planes``: Q_i, dO_i, and with
    ``kv_planes`` K_j, V_j, dS^T too)."""
    precision: str = "tf32"
    head_dim: int = 0
    head_dim_v: int = 0
    lo_planes: bool = True
    kv_planes: bool = True

    @property
    def source(self):
        return SOURCE

    @property
    def planes_mode(self):
        """The kernel's kLoPlanes: 1 every tile with a lo plane, 2 Q_i and dO_i only, 0 none."""
        return 0 if not self.lo_planes else 1 if self.kv_planes else 2


def wgmma_smem_bytes(d, block_m, block_n, precision):
    """Mirror of Sm90Tf32BwdTraits::kSmemBytes: planes x (Q_i, dO_i), their raw staging planes, planes x K_j^T,
    (3xtf32) K_j's and V_j's lo planes, two planes of P^T (hi, lo; tf32: tf32, raw), planes x dS^T, L_i and D_i;
    + 1024 bytes of alignment slack."""
    planes = 2 if precision == "3xtf32" else 1
    q, s, kv = block_m * d * 4, block_n * block_m * 4, block_n * d * 4
    return (2 * planes * q + 2 * q + planes * kv + (2 * kv if planes == 2 else 0) + (2 + planes) * s
            + 2 * block_m * 4 + 1024)


@dataclass(frozen=True)
class Tf32WgmmaBwdTiles(Tf32BwdTiles):
    """The wgmma dK/dV kernel's tile (sm_90; 256 threads, two warpgroups)."""

    @property
    def source(self):
        return WGMMA_SOURCE


def wgmma_tile(precision, d, dv, a, ext, vec, device=None):
    """The :class:`Tf32WgmmaBwdTiles` for padded head dims ``d``, ``dv`` on arch number ``a``, or None (not sm_90,
    :data:`WGMMA` off, extensions, rows not 16-byte aligned, padded head dims above :data:`WGMMA_HEAD_DIM`, or on
    ``device`` "cuda" without NVRTC compiling sm_90a: ``cuda_forward_sm90.nvrtc_sm90a``)."""
    if not WGMMA or a != 90 or ext or not vec or max(d, dv) > WGMMA_HEAD_DIM:
        return None
    if device == "cuda":
        from . import cuda_forward_sm90
        if not cuda_forward_sm90.nvrtc_sm90a():
            return None
    smem = wgmma_smem_bytes(WGMMA_HEAD_DIM, 64, 64, precision)
    reason = ("%s on sm_90: wgmma m64nNk8, two warpgroups (S^T, P^T, dV^T | dP^T, dS^T, dK^T; dQ split by columns), "
              "Br=Bc=64, K_j / V_j A fragments in registers, Q_i, dO_i, K_j^T, P^T, dS^T as %s"
              % (precision, "tf32 hi+lo planes" if precision == "3xtf32" else "tf32 planes"))
    return Tf32WgmmaBwdTiles(64, 64, 256, smem, reason, 1, precision=precision, head_dim=WGMMA_HEAD_DIM,
                             head_dim_v=WGMMA_HEAD_DIM)


#: Above this padded max(d, dv), calls with extensions whose rows take the element-wise copies (``vec`` False) keep
#: Bc <= 32 on sm_90: the 4-warp tf32 instantiations spilled 4-20 bytes at d 128 there (dropout, causal; window +
#: ALiBi + softcap + dropout + lengths; atomic dQ; tests/test_static_backward_tf32.py, ``-m slow``); 2 warps do not.
ELEMENTWISE_EXT_MAX_HEAD_DIM_SM90 = 112

#: (precision, arch number) -> kExt sets whose causal ordered-dQ instantiations at padded max(d, dv) <= 64 spilled on
#: the extensions' Br (half of :func:`block_m`'s) and take half that again: tf32 on sm_80, ALiBi alone and with
#: lengths (32 and 44 bytes at 255 registers). 16 query rows compile every ALiBi set clean there (164-222 registers);
#: 32 x 32 still spilled. Only that mode: 16 rows cost 17-21 % more instructions per HMMA of the loop (7.3-7.9
#: against 6.1-6.6), so the atomic and non-causal instantiations, clean at 32 rows, keep them. Clean on the
#: extensions' tile (fiftieth session's audit of all 63 sets, causal or not, both dQ modes): the other sets on sm_80,
#: every set on sm_86 / sm_90 at d 64 and on sm_80 at d 16-48, 3xtf32 at d 64 on sm_80.
EXT_SPILLED_SMALL_D = {("tf32", 80): (2, 2 | 32)}


def backward_tile(precision, dtype, D, Dv, arch, *, ext=False, vec=True, wgmma=True, device=None, causal=False,
                  ordered=False):
    """The tile of the TF32 dK/dV kernel for a float32 call, or None where it does not apply
    (precision not "tf32"/"3xtf32", dtype not float32, padded head dims above 128, 3xtf32 above d 64
    with extensions outside :data:`WIDE_3XTF32_EXT`). ``ext``: the call's kExt bits, or a bool (max(d,
    dv) <= 64 with extensions: half the Br, else the same tile; tests/test_static_backward_tf32.py).
    ``vec``: the rows take the 16-byte copies (False: element-wise, :data:`ELEMENTWISE_EXT_MAX_HEAD_DIM_SM90`).
    ``causal`` and ``ordered`` (the dQ mode): :data:`EXT_SPILLED_SMALL_D`'s sets take 16 query rows in that mode.
    On sm_90 the wgmma kernel's tile where it applies (:func:`wgmma_tile`, ``device`` the launcher's;
    ``wgmma=False``: the mma.sync one).
    NotImplementedError naming the arch below sm_80."""
    if precision not in PREC or tiles.dtype_name(dtype) != "float32":
        return None
    a = tiles.arch_number(arch)
    check_precision_arch(precision, a)
    d, dv = tiles.pad_head_dim(D), tiles.pad_head_dim(Dv)
    if max(d, dv) > MAX_HEAD_DIM:
        return None
    if max(d, dv) > REG_ACC_HEAD_DIM and not isinstance(ext, bool) and ext:
        return None  # wide head dims: dense calls only (extensions run the SIMT backward)
    if precision == "3xtf32" and max(d, dv) > 64 and not isinstance(ext, bool) and ext & ~WIDE_3XTF32_EXT:
        return None  # (a bool ``ext``: call sites after the family was chosen by the bits)
    wg = wgmma_tile(precision, d, dv, a, ext, vec, device) if wgmma else None
    if wg is not None:
        return wg
    limit = tiles.smem_limit(a)
    per_sm = _SM_SMEM_KB.get(a, limit // tiles.KB + 1) * tiles.KB
    br = block_m(precision, d, dv)
    if ext and max(d, dv) <= 64:
        br //= 2  # extensions (dropout's keep bits, the mask state) spilled 4-84 bytes at Br 64 / 32 on sm_80
        spilled = EXT_SPILLED_SMALL_D.get((precision, a), ())
        if causal and ordered and not isinstance(ext, bool) and int(ext) in spilled:
            br //= 2
    def best_tile(lo, kv):
        best = None
        for bc in (64, 32, 16):
            if precision == "3xtf32" and max(d, dv) > 112 and bc > 32:
                continue  # 4 warps spill 32-96 bytes on sm_90 (causal, plain atomics); 2 do not
            if (ext and not vec and a == 90 and max(d, dv) > ELEMENTWISE_EXT_MAX_HEAD_DIM_SM90 and bc > 32):
                continue  # element-wise copies with extensions: 4 warps spilled 4-20 bytes at d 128
            smem = smem_bytes(d, dv, br, bc, precision, lo, kv_planes=kv)
            if smem > limit:
                continue
            warps = min(_MAX_WARPS_PER_SM, bc // 16 * (per_sm // (smem + _RESERVED)))
            if best is None or warps > best[0]:  # ties: the larger Bc
                best = (warps, bc, lo, kv, smem)
        return best

    # lo planes whenever they fit (3xtf32: without K_j, V_j, dS^T's where that holds more warps, KV_RAW)
    best = best_tile(True, True) if precision == "tf32" else best_tile(True, True) or best_tile(False, True)
    if precision == "3xtf32" and KV_RAW and not ext and max(d, dv) <= REG_ACC_HEAD_DIM and best is not None and best[2]:
        kv_raw = best_tile(True, False)
        if kv_raw is not None and kv_raw[0] > best[0]:
            best = kv_raw
    if best is None:
        return None
    warps, bc, lo, kv, smem = best
    # Double-buffered Q_i, dO_i (the next visit's copies overlap this one's products) where the
    # second buffer costs no resident warps.
    smem2 = smem_bytes(d, dv, br, bc, precision, lo, 2, kv_planes=kv)
    stages = 2 if smem2 <= limit and min(_MAX_WARPS_PER_SM, bc // 16 * (per_sm // (smem2 + _RESERVED))) >= warps else 1
    smem = smem2 if stages == 2 else smem
    reason = ("%s: Br=%d (registers: max(d, dv)=%d), Bc=%d (%d warps), %s, %d buffer(s) of Q_i/dO_i; "
              "%d resident warps per SM"
              % (precision, br, max(d, dv), bc, bc // 16,
                 "operands as tf32 planes" if precision == "tf32" else
                 "hi+lo planes" if lo and kv else
                 "hi+lo planes of Q_i, dO_i; K_j, V_j, dS^T raw, split in registers (KV_RAW)" if lo else
                 "raw fp32 tiles split in registers", stages, warps))
    return Tf32BwdTiles(br, bc, bc // 16 * 32, smem, reason, stages, precision=precision, head_dim=d, head_dim_v=dv,
                        lo_planes=lo, kv_planes=kv)


def dkv_name(tile, precision, pD, pDv, causal, vec, ordered, ext=0):
    """Name expression of the TF32 dK/dV kernel for ``tile`` (from :func:`backward_tile`); ``ext``:
    the kExt bits (0: the dense name)."""
    b = lambda x: "true" if x else "false"  # noqa: E731
    if isinstance(tile, Tf32WgmmaBwdTiles):
        if ext or not vec:
            raise ValueError("flasharray: the wgmma TF32 backward takes dense calls with 16-byte aligned rows "
                             "(ext=%d, vec=%r)" % (ext, vec))
        return "%s<%d, %d, %d, %d, %s, %s%s>" % (WGMMA_KERNEL, tile.head_dim, tile.block_m, tile.block_n,
                                                 PREC[precision], b(causal), b(ordered),
                                                 "" if pD == tile.head_dim else ", %d" % pD)  # kDQDim
    mode = getattr(tile, "planes_mode", 1)
    return "%s<%d, %d, %d, %d, %d, %d, %s, %s, %s, %s, %d%s>" % (
        KERNEL, pD, pDv, tile.block_m, tile.block_n, tile.block_n // 16, PREC[precision], b(causal), b(vec),
        b(ordered), "2" if mode == 2 else b(mode), tile.stages, ", %d" % ext if ext else "")
