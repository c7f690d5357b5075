"""Tiles of the float32 forward on TF32 tensor cores (``cuda_src/flash_fwd_tf32.cu``, issue 12).

``precision="tf32"`` (one mma per product, operands rounded to tf32) and ``"3xtf32"`` (operands
split hi + lo, three mma per product). :func:`forward_tile` returns the tile a call uses, or None
where the kernel does not apply — the caller then runs the SIMT kernel (exact fp32):

* padded head dims d, dv (multiples of 16) at most 256, i.e. any D, Dv in 1..256 (D a multiple
  of 4 with 16-byte aligned rows takes the cp.async path, anything else the element-wise loads);
  above 128 the wide tiles (below), except 3xtf32 where Br 64 does not fit (sm_86/89: d = dv
  from padded 208) and 3xtf32 with extensions;
* no IO tile (``block_m``), no split-KV, no KV cache, no forced kernel family.

Wide tiles (padded d or dv > 128, docs/precision.md "Head dims above 128"): O's accumulator is dv/2
registers per thread, so Bc is capped (:data:`WIDE_BLOCK_NS`, :data:`WIDE_BC32_MAX_DV`), 3xtf32
splits Q only up to :data:`WIDE_QSPLIT_MAX_DV`, and extensions take Bc 16 (tf32) or SIMT (3xtf32).

Extensions (docs/extensions.md: dropout, block mask, window, ALiBi, softcap, seqlens) run on the
same tiles with the kernel's ``kExt`` bits (:meth:`Tf32Tile.name_expression`'s ``ext``), except a
window together with a block mask (:data:`NARROW_EXT`), which takes Bc = 16: at Bc 64 / 32 those
instantiations spilled 8-196 bytes on sm_80 at d 64 / 128, at Bc 16 none on sm_80-90.

Every tile is 4 warps × one 16-row slab (Br = 64). Shared memory (fp32, rows padded by 4 floats):
Q_i (Br × d: tf32 in place; 3xtf32 raw, or split into hi/lo planes when ``q_split``), K_j and V_j
as tf32 planes — one for tf32, hi and lo for 3xtf32. The choice, in order of the key loop's
instructions per HMMA (SASS, docs/precision.md: larger Bc first; at equal Bc the Q split saves
10-30%): the first of (Bc 64, 32, 16) × (3xtf32: Q split, Q raw) whose shared memory lets two
blocks share an SM (8 warps: the kernels need 121-223 registers, so registers cap residency at 2-3
blocks anyway, and one block of 4 warps per SM leaves each scheduler a single warp to hide mma and
shared-memory latency), else the first that fits at all (d = 128 on sm_86/89, whose 100 KB per SM
hold one such block). E.g. sm_80: tf32 d <= 64 Bc 64, d 128 Bc 32; 3xtf32 d 64 Bc 32 + Q split,
d 128 Bc 16; sm_90: tf32 Bc 64, 3xtf32 d 64 Bc 64 + Q split, d 128 Bc 32. A GPU measurement may
revise this.
"""
from dataclasses import dataclass

from . import launch, tiles
from .precision import check_precision_arch

#: Kernel template argument kPrec per precision (mma per product).
PREC = {"tf32": 1, "3xtf32": 3}
SOURCE = "flash_fwd_tf32.cu"
MAX_HEAD_DIM = 256
#: Padded head dims above this are "wide" (the O accumulator alone is dv/2 registers per thread, up to
#: 128): Bc is capped by :data:`WIDE_BLOCK_NS` and the kernel keeps its conversion loops rolled.
NARROW_HEAD_DIM = 128
#: Wide tiles' Bc candidates per precision, largest first (NVRTC: 3xtf32 at Bc 32 spilled 52-56 bytes
#: at d = dv = 256 on sm_80, Bc 16 none; tf32 Bc 32 only up to padded dv WIDE_BC32_MAX_DV: at dv 256
#: it needed 238-255 registers and spilled 28 bytes at d 128 on sm_86; dv <= 224 at most 230).
WIDE_BLOCK_NS = {"tf32": (32, 16), "3xtf32": (16,)}
WIDE_BC32_MAX_DV = 224
#: 3xtf32's Q split on wide tiles only up to this padded dv below sm_90: at dv 256 it needed 250-255
#: registers and spilled 8 bytes at d 128 (sm_80, causal, cp.async). On sm_90 at every dv
#: (WIDE_QSPLIT_MAX_DV_SM90): there Q raw spilled 20 bytes at d = dv 256 (causal, cp.async) and the
#: split tiles d 224-256 x dv 256 need 250-252 registers, no spills; below sm_90 d 256 does not fit
#: with the split (263 KB).
WIDE_QSPLIT_MAX_DV = 224
WIDE_QSPLIT_MAX_DV_SM90 = 256
#: Wide tiles with extensions (any kExt bit): tf32 takes Bc 16 (at Bc 32 the window / block mask spilled
#: 8-32 bytes at d 64 dv 256 on sm_80); 3xtf32 runs SIMT (at Bc 16, the smallest tile, 8-80 bytes
#: spilled on sm_80: kExt 1, 8, 16, 55, 62, 63 at dv 256, 9 at d 144 — the 3xtf32 A/B lo fragments
#: and the 128-float O accumulator leave no room for the extensions' state).
WIDE_EXT_BLOCK_N = 16
WARPS = 4
BLOCK_M = 16 * WARPS
_PAD = 4  # floats per shared-memory row
#: Shared memory per SM in KB and reserved per block (sass.ARCH_LIMITS; unknown arch: its block limit).
_SM_SMEM_KB = {80: 164, 86: 100, 87: 164, 89: 100, 90: 228}
_RESERVED = 1024
#: kExt bits whose combination takes Bc = 16 (window | block mask: spills at Bc 64 / 32).
NARROW_EXT = 1 | 8
_NARROW_BLOCK_N = 16


#: The wgmma forward (``cuda_src/flash_fwd_sm90_tf32.cu``) on sm_90 for dense calls with 16-byte aligned rows:
#: head dims padded to a wgmma d = dv per precision (64 or 128), Br 128 (two warpgroups), Bc :func:`wgmma_block_n`. Off: the mma.sync kernel
#: everywhere (``benchmarks/gpu_session.sh`` compares the two).
WGMMA = True
#: The wgmma kernel for float32's default forward (precision None, which runs "3xtf32" there) too. Off until a GPU
#: session has run it against the reference (``pytest -m gpu``: tests/test_cuda_forward_sm90_tf32.py's GPU cases,
#: ``benchmarks/gpu.py --precision``): the default keeps the mma.sync kernel, measured on an H200; explicit
#: precision="tf32" / "3xtf32" calls take the wgmma one.
WGMMA_DEFAULT = False
WGMMA_SOURCE = "flash_fwd_sm90_tf32.cu"
WGMMA_HEAD_DIMS = {"tf32": (64, 128), "3xtf32": (64, 128)}
WGMMA_BLOCK_M = 128
WGMMA_BLOCK_N = 64
#: 3xtf32 at d 128: Bc 32 (K_j, V_j with their lo and Vt planes in two stages, Q's lo plane: 177 KB; Bc 64 would
#: need 289 even so), Q's raw / hi plane over the stages (Sm90Tf32FwdTraits::kQOverStages).
WGMMA_BLOCK_N_3XTF32_128 = 32
# wgmma needs the arch-specific target: the CuPy path compiles this source for sm_90a (launch.ARCH_SPECIFIC).
launch.ARCH_SPECIFIC.setdefault(WGMMA_SOURCE, {90: "sm_90a"})


def wgmma_block_n(precision, d):
    """Bc of the wgmma forward at padded d = dv: :data:`WGMMA_BLOCK_N_3XTF32_128` for 3xtf32 at d 128, else
    :data:`WGMMA_BLOCK_N`."""
    return WGMMA_BLOCK_N_3XTF32_128 if (precision, d) == ("3xtf32", 128) else WGMMA_BLOCK_N


def wgmma_q_over_stages(d, block_n, precision):
    """Mirror of Sm90Tf32FwdTraits::kQOverStages: Q_i's raw / hi plane (read once into registers by 3xtf32)
    over the two stages (4 tiles of Bc x d floats), where it fits there, at d 128."""
    return precision == "3xtf32" and d == 128 and WGMMA_BLOCK_M <= 4 * block_n


def wgmma_smem_bytes(d, block_n, precision):
    """Mirror of Sm90Tf32FwdTraits::kSmemBytes: two stages of K_j (raw, then hi) and V_j raw, K_j's lo plane
    (3xtf32), the Vt planes, Q_i's planes (hi, lo for 3xtf32; the hi plane over the stages where
    :func:`wgmma_q_over_stages`); + 1024 bytes of alignment slack."""
    tile = block_n * d * 4
    planes = 2 if precision == "3xtf32" else 1
    q_planes = planes - (1 if wgmma_q_over_stages(d, block_n, precision) else 0)
    return 4 * tile + (planes - 1) * tile + planes * tile + q_planes * WGMMA_BLOCK_M * d * 4 + 1024


def smem_bytes(d, dv, block_m, block_n, precision, q_split=False, o_smem=False):
    """Mirror of FwdTf32Traits::kSmemBytes: Q planes × sQ + planes × (sK + sV), each 16-byte aligned, then
    (``o_smem``, kOSmem) O_i, Br × dv floats."""
    planes = 2 if precision == "3xtf32" else 1
    a16 = tiles._align16
    return (a16((2 if q_split else 1) * block_m * (d + _PAD) * 4) + a16(planes * block_n * (d + _PAD) * 4)
            + a16(planes * block_n * (dv + _PAD) * 4) + (block_m * dv * 4 if o_smem else 0))


@dataclass(frozen=True)
class Tf32Tile(tiles.FwdTile):
    """A :class:`tiles.FwdTile` of the TF32 kernel (kernel ``"tf32"``; threads_m = warps)."""
    precision: str = "tf32"
    q_split: bool = False   # 3xtf32: Q_i split once into hi/lo planes (kQSplit)
    o_smem: bool = False    # 3xtf32 at dv > 128: O_i in shared memory, each key tile summed apart (kOSmem)

    @property
    def source(self):
        return SOURCE

    def name_expression(self, causal, aligned, ext=0):
        """The kernel's instantiation; ``ext``: the kExt bits (0: the dense name, kQSplit only when
        set; else kQSplit spelled out and kExt appended)."""
        tail = (", %s, %d, true" % ("true" if self.q_split else "false", ext) if self.o_smem
                else ", %s, %d" % ("true" if self.q_split else "false", ext) if ext
                else ", true" if self.q_split else "")
        return "flash::flash_fwd_tf32_kernel<%d, %d, %d, %d, %d, %d, %s, %s%s>" % (
            self.head_dim, self.head_dim_v, self.block_m, self.block_n, self.threads_m, PREC[self.precision],
            "true" if causal else "false", "true" if aligned else "false", tail)

    def describe(self):
        return ("tf32 kernel (%s%s), Br=%d Bc=%d, %d threads, d=%d dv=%d, %.1f KB smem%s: %s" % (
            self.precision, (", Q split" if self.q_split else "") + (", O in shared memory" if self.o_smem else ""),
            self.block_m, self.block_n, self.n_threads, self.head_dim, self.head_dim_v,
            self.smem / tiles.KB, " (opt-in)" if self.needs_opt_in else "", self.reason))


@dataclass(frozen=True)
class Tf32WgmmaTile(Tf32Tile):
    """The wgmma forward's tile (sm_90, dense, 16-byte aligned rows; threads_m = 8 warps). ``fallback``: the
    mma.sync :class:`Tf32Tile` a call whose rows are not 16-byte aligned runs instead (the plan swaps it in)."""
    fallback: Tf32Tile = None

    @property
    def source(self):
        return WGMMA_SOURCE

    def name_expression(self, causal, aligned, ext=0):
        if ext or not aligned:
            raise ValueError("the wgmma tf32 forward takes dense calls with 16-byte aligned rows (ext=%r, aligned=%r)"
                             % (ext, aligned))
        return "flash::flash_fwd_sm90_tf32_kernel<%d, %d, %d, %s>" % (
            self.head_dim, self.block_n, PREC[self.precision], "true" if causal else "false")

    def describe(self):
        return ("tf32 wgmma kernel (%s), Br=%d Bc=%d, %d threads, d=dv=%d, %.1f KB smem: %s" % (
            self.precision, self.block_m, self.block_n, self.n_threads, self.head_dim, self.smem / tiles.KB,
            self.reason))


def wgmma_tile(precision, d, dv, a, ext, fallback, device=None):
    """The :class:`Tf32WgmmaTile` for padded head dims ``d``, ``dv`` on arch number ``a``, or None (not sm_90,
    :data:`WGMMA` off, extensions, head dims past :data:`WGMMA_HEAD_DIMS`, or on ``device`` "cuda" without NVRTC
    compiling sm_90a: ``cuda_forward_sm90.nvrtc_sm90a``)."""
    if not WGMMA or a != 90 or ext:
        return None
    if device == "cuda":
        from . import cuda_forward_sm90
        if not cuda_forward_sm90.nvrtc_sm90a():
            return None
    wd = next((w for w in WGMMA_HEAD_DIMS[precision] if max(d, dv) <= w), None)
    if wd is None:
        return None
    block_n = wgmma_block_n(precision, wd)
    smem = wgmma_smem_bytes(wd, block_n, precision)
    reason = ("%s on sm_90: wgmma m64nNk8 (two warpgroups, Br=%d, Bc=%d; Q %s, K_j and V_j transposed as tf32 %s "
              "in shared memory), d = dv padded to %d%s"
              % (precision, WGMMA_BLOCK_M, block_n,
                 "hi fragments in registers, lo plane in shared memory" if precision == "3xtf32" else
                 "in shared memory", "hi+lo planes" if precision == "3xtf32" else "planes", wd,
                 "; two blocks per SM" if (precision, wd) == ("tf32", 64) else ""))
    return Tf32WgmmaTile("tf32", "float32", wd, wd, WGMMA_BLOCK_M, block_n, WGMMA_BLOCK_M // 16, 32, smem,
                         reason, 1, precision, fallback=fallback)


def forward_tile(precision, dtype, head_dim, head_dim_v, arch, *, kernel=None, block_m=None, ext=False,
                 num_splits=None, kv=None, wgmma=True, device=None):
    """The :class:`Tf32Tile` for a float32 call with ``precision`` "tf32" / "3xtf32", or None (the
    SIMT kernel runs: precision None / "ieee", another dtype, d or dv > 256, forced kernel, IO tile,
    split-KV or KV cache; 3xtf32 with extensions on a wide tile, or where no tile fits). ``ext``: the
    call's kExt bits (the same tile, but Bc = 16 for a window with a block mask, :data:`NARROW_EXT`,
    and for any extension on a wide tile). On sm_90 the wgmma kernel's :class:`Tf32WgmmaTile` where it
    applies (:func:`wgmma_tile`, ``device`` the launcher's; ``wgmma=False``: the mma.sync tile, its ``fallback``).
    NotImplementedError naming the arch below sm_80."""
    if precision not in PREC or tiles.dtype_name(dtype) != "float32":
        return None
    check_precision_arch(precision, tiles.arch_number(arch))
    if kernel is not None or block_m is not None or num_splits not in (None, 1) or kv is not None:
        return None
    d, dv = tiles.pad_head_dim(head_dim), tiles.pad_head_dim(head_dim_v)
    if max(d, dv) > MAX_HEAD_DIM:
        return None
    wide = max(d, dv) > NARROW_HEAD_DIM
    if wide and ext and precision == "3xtf32":
        return None  # spilled even at Bc 16 (WIDE_EXT_BLOCK_N's comment): the SIMT kernel
    narrow = int(ext) & NARROW_EXT == NARROW_EXT or (wide and bool(ext))
    tile = _pick_tile(precision, d, dv, tiles.arch_number(arch), narrow)
    return (wgmma and wgmma_tile(precision, d, dv, tiles.arch_number(arch), ext, tile, device)) or tile


def _block_ns(precision, d, dv, narrow):
    """Bc candidates, largest first: Bc 16 for narrow calls (NARROW_EXT, extensions on a wide tile),
    the wide tiles' (WIDE_BLOCK_NS, Bc 32 up to dv WIDE_BC32_MAX_DV), else 64, 32, 16."""
    wide = max(d, dv) > NARROW_HEAD_DIM
    if narrow:
        return (WIDE_EXT_BLOCK_N if wide else _NARROW_BLOCK_N,)
    if wide:
        return tuple(bc for bc in WIDE_BLOCK_NS[precision] if bc <= 16 or dv <= WIDE_BC32_MAX_DV)
    return (64, 32, 16)


def _candidates(precision, d, dv, narrow, a):
    """(Bc, Q split) in order of the key loop's instructions per HMMA (``a``: the arch number)."""
    wide = max(d, dv) > NARROW_HEAD_DIM
    max_dv = WIDE_QSPLIT_MAX_DV_SM90 if a >= 90 else WIDE_QSPLIT_MAX_DV
    splits = (True, False) if precision == "3xtf32" and not (wide and dv > max_dv) else (False,)
    return [(bc, qs) for bc in _block_ns(precision, d, dv, narrow) for qs in splits]


def _pick_tile(precision, d, dv, a, narrow):
    """The first candidate letting two blocks share an SM, else the first that fits; None (SIMT)
    when none fits the arch's shared memory (3xtf32 on sm_86/89 where 384 (d + 4) + 128 (dv + 4)
    bytes exceed 99 KB, e.g. d = dv >= 208, d 256 with any dv)."""
    limit = tiles.smem_limit(a)
    per_sm = _SM_SMEM_KB.get(a, limit // tiles.KB + 1) * tiles.KB
    o_smem = precision == "3xtf32" and dv > NARROW_HEAD_DIM  # its per-tile sums need O off the registers
    fits = [(bc, qs, smem_bytes(d, dv, BLOCK_M, bc, precision, qs, o_smem))
            for bc, qs in _candidates(precision, d, dv, narrow, a)]
    fits = [f for f in fits if f[2] <= limit]
    if not fits:
        return None
    two = [f for f in fits if 2 * (f[2] + _RESERVED) <= per_sm]
    bc, q_split, smem = (two or fits)[0]
    wide = max(d, dv) > NARROW_HEAD_DIM
    reason = ("%s: Br=64 (4 warps x 1 slab), Bc=%d%s: %s%s (K/V as %s)"
              % (precision, bc, ", Q split into hi/lo planes" if q_split else "",
                 "the first (Bc, Q split) letting 2 blocks share an SM" if two else
                 "the first (Bc, Q split) that fits (one block per SM)",
                 " of Bc 16 (extensions on a wide tile spill at Bc 32)" if narrow and wide else
                 " of Bc 16 (a window with a block mask spills at Bc 64 / 32)" if narrow else
                 " of the wide tiles' Bc %s (d or dv > 128: larger Bc spill)" % (
                     "/".join(map(str, _block_ns(precision, d, dv, False))),) if wide else "",
                 "tf32 hi+lo planes" if precision == "3xtf32" else "tf32 planes"))
    if o_smem:
        reason += "; O_i in shared memory (each key tile summed in a zeroed fragment: the float32 rule at dv > 128)"
    return Tf32Tile("tf32", "float32", d, dv, BLOCK_M, bc, WARPS, 32, smem, reason, 1, precision, q_split, o_smem)
