"""Tile table of the CUDA forward kernels: every choice, its reason, and its shared memory.

The kernels (``cuda_src/flash_fwd.cu``, ``cuda_src/flash_fwd_simt.cu``) take these numbers as
template parameters and ``static_assert`` every invariant (``cuda_src/flash_kernel_traits.cuh``);
the shared-memory sizes computed here mirror ``FwdTensorCoreTraits::kSmemBytes`` and
``FwdSimtTraits::kSmemBytes`` byte for byte (a test compares them on the emulator).

Architecture limits (``/work/shared/ptx_semantics.md``): dynamic shared memory per block is
48 KB without opt-in and at most 64 KB (sm_75), 163 KB (sm_80), 99 KB (sm_86, sm_89) and
227 KB (sm_90) with ``max_dynamic_shared_size_bytes``; at most 255 registers per thread.

Symbols: Br = ``block_m`` (query rows per thread block), Bc = ``block_n`` (key rows per
iteration), d / dv = head dims of q·k and of v rounded up to a multiple of 16.
"""
from dataclasses import dataclass

import numpy as np

KB = 1024
DEFAULT_SMEM = 48 * KB
#: Largest dynamic shared memory per block, with opt-in, per compute capability.
MAX_SMEM = {75: 64 * KB, 80: 163 * KB, 86: 99 * KB, 87: 163 * KB, 89: 99 * KB, 90: 227 * KB}
#: Architectures the static checks cover.
ARCHS = (75, 80, 86, 89, 90)
#: Architecture the emulator pretends to be when the caller does not name one (tile choice only).
EMULATOR_ARCH = 80
#: Head dims the kernels are specialised for (multiples of 16; D is rounded up and zero-filled).
MAX_HEAD_DIM = 256

_CTYPE = {"float16": "fa_half", "bfloat16": "fa_bf16", "float32": "float", "float64": "double"}


def pad_head_dim(d):
    """Head dims are padded to a multiple of 16 (the mma k-step) inside the kernels."""
    return max(16, (int(d) + 15) // 16 * 16)


def _align16(n):
    return (n + 15) // 16 * 16


def arch_number(arch):
    """75 from ``75``, ``"sm_75"``, ``"75"`` or ``(7, 5)``."""
    if isinstance(arch, tuple):
        return arch[0] * 10 + arch[1]
    if isinstance(arch, str):
        return int(arch.replace("sm_", "").replace("compute_", ""))
    return int(arch)


def smem_limit(arch):
    """Largest dynamic shared memory one block may use on ``arch`` (with the opt-in)."""
    a = arch_number(arch)
    if a in MAX_SMEM:
        return MAX_SMEM[a]
    if a > 90:
        return MAX_SMEM[90]
    if a >= 80:
        return MAX_SMEM[86]  # unknown Ampere/Ada part: the smaller of the two known limits
    return MAX_SMEM[75]


def dtype_name(dtype):
    """'float16', 'bfloat16', 'float32' or 'float64' for a NumPy/ml_dtypes dtype or its name."""
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if name not in _CTYPE:
        raise NotImplementedError("flasharray: the CUDA forward supports float16, bfloat16, float32 "
                                  "and float64, got %s" % name)
    return name


def itemsize(dtype):
    return {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}[dtype_name(dtype)]


def tensor_cores_available(dtype, arch):
    """mma.sync m16n8k16 (or 2× m16n8k8) exists for fp16 from sm_75 and for bf16 from sm_80."""
    name, a = dtype_name(dtype), arch_number(arch)
    return (name == "float16" and a >= 75) or (name == "bfloat16" and a >= 80)


@dataclass(frozen=True)
class FwdTile:
    """One forward kernel instantiation's tile shape, shared memory, and the reason for it."""
    kernel: str        # "tensor_core" (flash_fwd.cu) or "simt" (flash_fwd_simt.cu)
    dtype: str         # element dtype name
    head_dim: int      # d: padded head dim of q and k
    head_dim_v: int    # dv: padded head dim of v and out
    block_m: int       # Br
    block_n: int       # Bc
    threads_m: int     # SIMT: row groups; tensor core: warps (each Br/(16·warps) 16-row slabs)
    threads_n: int     # SIMT: lanes per row group; tensor core: 32
    smem: int          # dynamic shared memory in bytes
    reason: str
    stages: int = 1    # tensor core: shared-memory buffers per K_j / V_j tile (2 = double-buffered)

    @property
    def n_threads(self):
        return self.threads_m * self.threads_n

    @property
    def source(self):
        return "flash_fwd.cu" if self.kernel == "tensor_core" else "flash_fwd_simt.cu"

    @property
    def needs_opt_in(self):
        """More than 48 KB of dynamic shared memory: needs ``max_dynamic_shared_size_bytes``."""
        return self.smem > DEFAULT_SMEM

    def name_expression(self, causal, aligned):
        """The C++ template instantiation, as passed to NVRTC / the emulator."""
        flags = "%s, %s" % ("true" if causal else "false", "true" if aligned else "false")
        if self.kernel == "tensor_core":
            return "flash::flash_fwd_kernel<%s, %d, %d, %d, %d, %d, %d, %s>" % (
                _CTYPE[self.dtype], self.head_dim, self.head_dim_v, self.block_m, self.block_n,
                self.threads_m, self.stages, flags)
        return "flash::flash_fwd_simt_kernel<%s, %d, %d, %d, %d, %d, %d, %s>" % (
            _CTYPE[self.dtype], self.head_dim, self.head_dim_v, self.block_m, self.block_n,
            self.threads_m, self.threads_n, flags)

    def describe(self):
        stages = ", %d-stage K/V" % self.stages if self.kernel == "tensor_core" else ""
        return ("%s kernel, Br=%d Bc=%d, %d threads%s, d=%d dv=%d, %.1f KB smem%s: %s" % (
            self.kernel, self.block_m, self.block_n, self.n_threads, stages, self.head_dim, self.head_dim_v,
            self.smem / KB, " (opt-in)" if self.needs_opt_in else "", self.reason))


# ---- shared-memory formulas (mirror flash_kernel_traits.cuh) -----------------------------------

def swizzled_q(d, block_m, block_n, stages):
    """Whether the tensor-core forward stores sQ unpadded and XOR-swizzled (``FwdTensorCoreTraits::kSwizzleQ``):
    the single-buffered 128 x 32 tile at d a multiple of 64 (sm_86/89's wide tile: two blocks per 100 KB SM at d 128)."""
    return stages == 1 and block_m == 128 and block_n == 32 and d % 64 == 0


def tc_smem(d, dv, block_m, block_n, stages=1, elem=2):
    """sQ (Br × d), ``stages`` × sK (Bc × d) and sV (Bc × dv), rows padded by one 16-byte chunk (sQ's not where
    :func:`swizzled_q`)."""
    pad = 16 // elem
    q_pad = 0 if swizzled_q(d, block_m, block_n, stages) else pad
    return (_align16(block_m * (d + q_pad) * elem) + stages * _align16(block_n * (d + pad) * elem)
            + stages * _align16(block_n * (dv + pad) * elem))


def simt_smem(d, dv, block_m, block_n, elem, acc):
    """sQ, sK, sV as above (element type) plus sP (Br × Bc, accumulation type)."""
    pad = 16 // elem
    return (_align16(block_m * (d + pad) * elem) + _align16(block_n * (d + pad) * elem)
            + _align16(block_n * (dv + pad) * elem) + _align16(block_m * block_n * acc))


# ---- the table -----------------------------------------------------------------------------------
# Tensor core: kNWarps warps, each owning Br/(16·kNWarps) 16-row mma slabs (FlashAttention-2's
# split: a row's softmax statistics stay inside one quad of lanes, no cross-warp reduction; the
# K_j / V_j fragments a warp loads feed all its slabs). Candidates in order of preference, the
# first that fits the arch's shared memory is taken. Register counts are from -Xptxas=-v (sm_80).
_TC_CANDIDATES = [
    # (max padded head dim, Br, Bc, warps, stages, reason)
    (64, 128, 64, 4, 2, "d <= 64: Br=128, Bc=64, 4 warps x 2 slabs as FlashAttention-2 (K/V re-read "
                        "half as often as with Br=64, each K/V fragment feeds 2 mma; ~223 regs); "
                        "K/V double-buffered"),
    (64, 128, 64, 4, 1, "d <= 64, single-buffered K/V: where only that lets two blocks share an SM "
                        "(sm_86/89: 36 KB instead of 54; TWO_BLOCKS_MAX_HEAD_DIM), or where two stages do not fit"),
    (128, 64, 64, 4, 2, "64 < d <= 128: Br=64, Bc=64, 4 warps x 1 slab; O (64 fp32/lane) + S (32/lane) "
                        "~182 regs; K/V double-buffered (causal, unaligned, short or extension calls; "
                        "long non-causal ones take the wide-row tile)"),
    (128, 64, 64, 4, 1, "64 < d <= 128, single-buffered K/V: on sm_75 (64 KB smem), and where only that lets two "
                        "blocks share an SM (sm_86/89 at d <= 112, sm_80 at d 128; TWO_BLOCKS_MAX_HEAD_DIM)"),
    (256, 64, 32, 4, 2, "128 < d <= 256: O alone is 128 fp32/lane, so Bc=32 keeps S at 16/lane and "
                        "~240 regs without spills; K/V double-buffered (99 KB: fits sm_86/89 exactly)"),
    (256, 64, 16, 4, 1, "128 < d <= 256 on sm_75 (64 KB smem): Bc=16, single-buffered K/V"),
]

#: Tensor-core tiles for d <= 64 with extensions (kExt != 0): the 2-slab tile above runs at ~223
#: registers densely, and the extensions' state (masks, ALiBi, Philox) made it spill (60-116 spill
#: stores on sm_80); one slab per warp leaves room. Larger head dims keep the table's tiles.
_TC_EXT_CANDIDATES = [
    (64, 64, 64, 4, 2, "d <= 64 with extensions: Br=64, Bc=64, 4 warps x 1 slab (the 2-slab tile spills "
                       "with the extensions' registers); K/V double-buffered"),
    (64, 64, 64, 4, 1, "d <= 64 with extensions, small-smem fallback: single-buffered K/V"),
]

#: Wide-row tensor-core tiles for d > 64 (``forward_tile(..., wide=True)``). 64 < d <= 128: Br = 128 as
#: FlashAttention-2's forward, 4 warps x 2 slabs, so each K/V fragment a warp loads feeds 2 mma
#: (ldmatrix per HMMA 0.56 -> 0.375) and each K/V tile loaded serves twice the query rows (half the
#: L2 -> SM traffic); Bc = 32 keeps O (64 fp32/lane) + S (16/lane) at 240-255 registers without
#: spills (Bc = 64 spilled 136 bytes). Shared memory 68 KB: 2 blocks (8 warps) per A100 SM where
#: the 64 x 64 tile's 85 KB fits one. Taken by the forward plan where it compiles without spills
#: (tests/test_static_forward.py, ``-m slow``: sm_80-90, every d, dv pair): non-causal (causal keeps
#: the square 64 x 64 tile, as FlashAttention-2 on sm_86/89, but on WIDE_CAUSAL_ARCHS), 16-byte aligned rows (the element-wise
#: copies spilled 64 bytes), no extensions, no paged KV cache (12-60 bytes on sm_90), more than 64
#: query rows (fewer: the 64-row tile computes fewer idle rows), sm_80+ (sm_75: one K/V stage only
#: at d 128, and its split variants spilled). 128 < d <= 256: Br = 128, Bc = 32 with 8 warps x 1 slab
#: (FlashAttention-2's d 256 forward also runs 8 warps x 128 rows): the same registers per thread as the
#: 4-warp 64 x 32 tile, the copies split over 256 threads (4.54 -> 4.23 instructions per HMMA), K/V
#: loads halved, 132 KB at d = dv = 256: one 8-warp block per A100 SM where 64 x 32 (99 KB) fit one
#: 4-warp block; on an H100 one 8-warp block instead of two 4-warp ones; sm_86/89 only where it fits
#: (smaller d, dv). Same conditions; zero spills in all 3,390 instantiations audited (paged included).
#: Where two double-buffered 128 x 32 blocks do not fit an SM but two single-buffered ones do (sm_86/89 at padded
#: d 96-128), :data:`TWO_BLOCKS_MAX_HEAD_DIM`'s rule takes the single-buffered 128 x 32: 8 warps per SM instead of 4.
#: At d a multiple of 64 its sQ is unpadded and XOR-swizzled (:func:`swizzled_q`): 50 KB at d = dv = 128 where the
#: padded rows took 51 KB, and two blocks need 2 x (50 + 1 reserved) = 100 KB, the SM's whole shared memory. Zero
#: spills, at most 252 registers: 240 sm_86 / 89 instantiations (fp16, bf16; every d, dv pair; dense / split / key
#: lengths).
#: WIDE_ROWS = False turns them off.
_TC_WIDE_CANDIDATES = [
    (128, 128, 64, 4, 1, "64 < d <= 128, d >= dv (causal: d = dv, no split / packing / key lengths), > 64 rows, "
                         "where two blocks fit an SM (sm_80, sm_90): "
                         "Br=128, Bc=64, 4 warps x 2 slabs, single-buffered K/V: FlashAttention-2's d 128 "
                         "forward tile on A100 / H100 (each K/V fragment feeds 2 mma, half the per-tile "
                         "softmax and barrier work of Bc=32); 255 regs"),
    (128, 128, 32, 4, 2, "64 < d <= 128, non-causal (causal on WIDE_CAUSAL_ARCHS), > 64 rows, where 128 x 64 does "
                         "not apply: Br=128, Bc=32, 4 warps x 2 slabs as "
                         "FlashAttention-2 (each K/V fragment feeds 2 mma, K/V re-read half as often); "
                         "~240-255 regs; K/V double-buffered"),
    (128, 128, 32, 4, 1, "64 < d <= 128 where two blocks of the double-buffered 128 x 32 tile do not fit an SM but "
                         "two single-buffered ones do (sm_86/89 at padded d 96-128: 40-50 KB, sQ unpadded and "
                         "XOR-swizzled at d 128): Br=128, Bc=32, 4 warps x 2 slabs, single-buffered K/V as "
                         "FlashAttention-2 on sm_86/89 (2 blocks per SM); ~205-250 regs"),
    (256, 128, 64, 8, 1, "128 < d <= 256, non-causal (causal on WIDE_CAUSAL_ARCHS), > 64 rows: Br=128, Bc=64, 8 warps "
                         "x 1 slab, single-buffered K/V: FlashAttention-2's d 192-256 forward tile on A100 / H100 "
                         "(the shared memory of 128 x 32 double-buffered, 132 KB at d = dv = 256; each Q fragment "
                         "feeds 8 mma, half the per-tile softmax and barrier work); 213-250 regs"),
    (256, 128, 32, 8, 2, "128 < d <= 256, non-causal, > 64 rows, WIDE_BC64_LARGE off: Br=128, Bc=32, 8 warps "
                         "x 1 slab as FlashAttention-2's 8-warp d 256 tile (K/V re-read half as often, the copies "
                         "split over 256 threads); ~236-250 regs; 132 KB at d = dv = 256 (sm_80, sm_90)"),
]
#: The forward plan takes :data:`_TC_WIDE_CANDIDATES` where they apply (a switch for the GPU's verdict).
WIDE_ROWS = True
#: Above padded head dim 128 the wide candidate with Bc = 64 (8 warps, single-buffered) comes before the double-buffered
#: 128 x 32: both take the same shared memory (Q_i, then 64 rows of K_j and of V_j either way) and one 8-warp block per
#: SM, and the Bc = 64 loop issues 3.45 instructions per HMMA where 128 x 32's issues 4.27 (sm_90, fp16, d 256;
#: 0.56 ldmatrix per HMMA instead of 0.625). FlashAttention-2 runs it at d 192-256 on A100 and H100. Zero spills in every
#: variant the wide tiles serve (sm_80 / 86 / 89 / 90, every d, dv pair above 128; docs/performance.md, "Twenty-fifth
#: session"). Not timed on a GPU: False keeps 128 x 32 (``benchmarks/hopper_variants.py``'s ``mma.WIDE_BC64_LARGE``).
WIDE_BC64_LARGE = True
#: The wide candidate with Bc = 64 (the single-buffered 128 x 64 tile, 69.6 KB at d 128, 255 registers) is taken only
#: by non-causal calls with padded d >= dv where two of its blocks fit an SM's shared memory
#: (:func:`_wide_bc64_applies`): two 4-warp blocks on sm_80 / sm_90; sm_86 / 89 (100 KB) at d 96-128 take 128 x 32
#: (single-buffered: two blocks; at d 128 with sQ swizzled); causal variants (split, GQA-packed, key lengths) and pairs
#: with d < dv spilled 8-164 bytes in the NVRTC audit (docs/performance.md, "Seventeenth session"). False: 128 x 32
#: everywhere (a switch for the GPU's verdict, ``benchmarks/hopper_variants.py``'s ``mma.WIDE_BC64``).
WIDE_BC64 = True
#: Causal calls on :data:`WIDE_CAUSAL_ARCHS` take the 128 x 64 tile too where padded d = dv and the call runs the plain
#: causal instantiation (no split-KV, GQA packing or key lengths: ``forward_tile(plain=False)`` for those): FlashAttention-2
#: runs it causal or not. The plain causal instantiations compile without spills on sm_80 / sm_90 (fp16, bf16, every
#: padded d = dv 72-128: 254-255 registers); the causal variants spilled 16-80 bytes, and on sm_80 the pairs (120-128,
#: 104-112) 16 (docs/performance.md, "Twentieth session"). False: causal calls keep 128 x 32 (``mma.WIDE_BC64_CAUSAL``).
WIDE_BC64_CAUSAL = True

#: Archs where causal calls take the wide-row tiles too, each up to a padded head dim (max(d, dv)). sm_80 (A100, A30:
#: 164 KB of shared memory per SM), every d: the square 64 x 64 tile (85 KB) and the 64 x 32 one at d 256 (99 KB) fit
#: one 4-warp block, the wide ones two 4-warp blocks (68 KB) / one 8-warp block (132 KB). sm_90, d <= 128: measured on
#: an H100 (twentieth session, mma.sync forward, fp16, causal, N 1k-16k): at d 128 the wide tiles ran 1.22-1.27x the
#: square one (128 x 64: 0.88 ms against 1.11 at N 4k, FlashAttention-2 ~0.92 on the same GPUs), at d 256 0.91-0.98x
#: (the 8-warp 128 x 32 tile against two 4-warp square blocks): the square tile stays there.
#: Elsewhere causal keeps the square tile where the warps per SM are the same: a 128-row tile computes
#: twice the masked diagonal (64 instead of 32 wasted keys per row: +6% of the work at N = 1k, +0.4% at 16k);
#: :func:`causal_takes_wide` adds the head dims where the wide tile doubles them (sm_86/89 at d 128).
WIDE_CAUSAL_ARCHS = {80: MAX_HEAD_DIM, 90: 128}


def causal_takes_wide(dtype, head_dim, head_dim_v, arch):
    """Whether a causal call (unpadded ``head_dim``, ``head_dim_v``) takes the wide-row tiles where a long non-causal
    one would: on :data:`WIDE_CAUSAL_ARCHS` (up to its head dim), and wherever the square tile runs one block per SM and the wide one two
    (sm_86/89 at d = dv = 128: 64 x 64 double-buffered, 85 KB, one 4-warp block; 128 x 32 single-buffered with sQ
    swizzled, 50 KB, two; FlashAttention-2 runs two 64 x 64 blocks there in 48 KB, unpadded)."""
    a = arch_number(arch)
    if not WIDE_ROWS or a < 80:
        return False
    hd = max(pad_head_dim(head_dim), pad_head_dim(head_dim if head_dim_v is None else head_dim_v))
    if hd <= WIDE_CAUSAL_ARCHS.get(a, 0):
        return True
    square = forward_tile(dtype, head_dim, head_dim_v, a, causal=True)
    wide = forward_tile(dtype, head_dim, head_dim_v, a, wide=True, causal=True)
    return (square.kernel == "tensor_core" and wide.block_m == 128 and not _two_blocks_fit(square.smem, a)
            and _two_blocks_fit(wide.smem, a))

#: IO-oriented tensor-core tiles (benchmarks/io.py): large Br cuts K/V re-reads (HBM traffic
#: ~ N²·d/Br, the paper's Θ(N²d²/M)) at the price of fewer thread blocks. Not chosen by default.
IO_TILES = {
    384: (384, 32, 8, 1, "IO tile: Br=384 = 8 warps x 3 slabs, Bc=32; ~232 regs x 256 threads"),
    512: (512, 16, 8, 1, "IO tile: Br=512 = 8 warps x 4 slabs, Bc=16; sm_80+ (78 KB smem)"),
}

# SIMT: 8 row groups × 16 lanes = 128 threads unless noted; TM = Br/8 rows and TN = Bc/16
# columns of S per thread. Candidates by (accumulator bytes, max padded head dim); a candidate in
# :data:`_SIMT_MIN_BLOCKS` is taken only where that many of its blocks fit an SM's shared memory.
_SIMT_CANDIDATES = {
    4: [  # fp32 (and fp16/bf16 fallback), fp32 accumulation
        (32, 32, 64, 8, 16, "d <= 32: Br=32, Bc=64 (4×4 S per thread)"),
        (64, 32, 64, 8, 16, "d <= 64 where four blocks' shared memory fits an SM (sm_90: 228 KB): Br=32, "
                            "Bc=64 (4×4 S, 4×4 O per thread; 51 KB)"),
        (64, 32, 32, 8, 16, "d <= 64: Br=32, Bc=32 (4×2 S, 4×4 O per thread; 30 KB)"),
        (128, 32, 32, 8, 16, "d <= 128: Br=32 halves K/V re-reads vs Br=16; 55 KB fp32 smem "
                             "with the opt-in; O is 4×8 per thread"),
        (128, 16, 32, 8, 16, "d <= 128, small-smem fallback: Br=16"),
        (256, 16, 16, 8, 16, "d <= 256: Br=16, Bc=16 keeps O at 2×16 per thread; 51 KB fp32 "
                             "smem with the opt-in"),
        (256, 8, 16, 8, 16, "d <= 256, small-smem fallback: Br=8"),
    ],
    8: [  # fp64, fp64 accumulation
        (32, 32, 32, 8, 16, "d <= 32: Br=32, Bc=32"),
        (64, 32, 32, 8, 16, "d <= 64: Br=32, Bc=32"),
        (64, 16, 32, 8, 16, "d <= 64, small-smem fallback: Br=16"),
        (128, 16, 16, 8, 16, "d <= 128: Br=16, Bc=16"),
        (128, 8, 16, 8, 16, "d <= 128, small-smem fallback: Br=8"),
        (256, 8, 16, 8, 16, "d <= 256: Br=8, Bc=16 (O is 1×16 fp64 per thread), 83 KB fp64 "
                            "smem with the opt-in"),
        (256, 8, 8, 8, 8, "d <= 256 on sm_75 (64 KB smem): 64 threads, Br=8, Bc=8"),
    ],
}
#: SIMT candidates (max padded head dim, Br, Bc) taken only where this many blocks fit an SM by
#: shared memory. fp32 d <= 64 at Bc 64: 16% fewer instructions per FMA than Bc 32 (the 4×4 S
#: micro-tile: 8 vector loads per 64 FMA instead of 6 per 32; est. 1.86 -> 1.56 on sm_90, 1.82 ->
#: 1.52 on sm_80, benchmarks/sass.py --simt) at 51 KB: on sm_90 (228 KB) the 3 blocks per SM its
#: registers allow either way; on sm_80 (164 KB) 3 where Bc 32 runs 4 (16 warps: kept), on
#: sm_86/89 (100 KB) and sm_75 (64 KB) one where Bc 32 runs three and two.
_SIMT_MIN_BLOCKS = {(64, 32, 64): 4}


#: Shared memory per SM and reserved per block, bytes (the occupancy rules of sass.ARCH_LIMITS).
SMEM_PER_SM = {75: 64 * KB, 80: 164 * KB, 86: 100 * KB, 87: 164 * KB, 89: 100 * KB, 90: 228 * KB}
#: Up to this padded head dim the tensor-core table prefers a candidate that lets two blocks share an
#: SM (FlashAttention-2's single-buffered K/V on sm_86/89: "we get 2 CTAs per SM"): on sm_86/89
#: (100 KB per SM) d <= 64's double-buffered 128 x 64 tile (54 KB) runs one 4-warp block per SM, the
#: single-buffered one (36 KB) two, at 6.25 instead of 5.80 instructions per HMMA (a second barrier per
#: tile); so do the square 64 x 64 tile at 64 < d <= 112 there (40-46 KB single-buffered) and at d 128
#: on sm_80 (85 KB: one block; 51 KB: three). sm_90 keeps the double-buffered tiles (two fit), sm_75 too
#: (neither lets two), as does sm_86/89's square tile at d 128 (51 KB + 1 KB reserved: 104 KB for two). Only the
#: stage count changes (the same Br, Bc, warps), also for the wide-row 128 x 32 tile (sm_86/89 at d 96-128: 53-68 KB
#: double-buffered, 40-50 KB single-buffered, sQ swizzled at d 128).
#: With extensions the same above d 64 on sm_80+ (sm_86/89 at d 80-112, sm_80 at d 128: the square tile
#: single-buffered; zero spills in every extension subset audited), while at d <= 64 their one-slab tile lets two
#: blocks fit but on sm_75 and the order of the table stands there (sm_75's single-buffered loop stages its copies
#: only without extensions); and for paged KV caches (single-buffered, K_j and V_j look their pages up separately:
#: sm_80 d 128's paged loop went 5.02 -> 5.57 instructions per HMMA, over issue 9's 5.5).
TWO_BLOCKS_MAX_HEAD_DIM = 128


def _two_blocks_fit(smem, arch):
    a = arch_number(arch)
    per_sm = SMEM_PER_SM.get(a, smem_limit(a))
    return 2 * (smem + (KB if a >= 80 else 0)) <= per_sm


def _wide_bc64_applies(d, dv, causal, smem, arch, plain=True):
    """Whether the single-buffered 128 x 64 wide tile (``smem`` bytes at padded d, dv) serves a call: :data:`WIDE_BC64`
    (causal: :data:`WIDE_BC64_CAUSAL`, d = dv and the ``plain`` instantiation only)."""
    if not (WIDE_BC64 and d >= dv and _two_blocks_fit(smem, arch)):
        return False
    return not causal or (WIDE_BC64_CAUSAL and plain and d == dv)


def _wide_candidate_applies(candidate, d, dv, causal, arch, plain):
    """Whether a :data:`_TC_WIDE_CANDIDATES` entry may serve padded head dims d, dv: the Bc = 64 ones by their rules
    (4 warps: :func:`_wide_bc64_applies`; 8 warps: :data:`WIDE_BC64_LARGE` above d 128), the others always (the
    caller checks head dim and shared memory)."""
    _, br, bc, warps, stages, _ = candidate
    if bc != 64:
        return True
    if warps == 8:
        return WIDE_BC64_LARGE and max(d, dv) > 128
    return _wide_bc64_applies(d, dv, causal, tc_smem(d, dv, br, bc, stages), arch, plain)


def forward_tile(dtype, head_dim, head_dim_v=None, arch=EMULATOR_ARCH, kernel=None, block_m=None, ext=False,
                 wide=False, two_blocks=True, causal=False, plain=True):
    """The tile the CUDA forward uses for ``dtype``, head dims (unpadded) and ``arch``.

    ``kernel`` forces "tensor_core" or "simt"; by default tensor cores are used for fp16/bf16
    where the arch has them (fp16: sm_75+, bf16: sm_80+), SIMT otherwise. ``block_m`` (384 or
    512, tensor cores only) picks one of the :data:`IO_TILES` instead of the table. ``ext``: the
    kernel has extensions (kExt != 0): d <= 64 takes a one-slab tile (:data:`_TC_EXT_CANDIDATES`).
    ``wide``: the call qualifies for the wide-row tiles (:data:`_TC_WIDE_CANDIDATES`: non-causal,
    aligned, > 64 rows, no extensions; the caller decides), taken where :data:`WIDE_ROWS` and they fit; ``causal``:
    the call is causal (the single-buffered 128 x 64 wide tile serves causal calls where :data:`WIDE_BC64_CAUSAL`
    allows); ``plain``: the call runs the plain instantiation (no split-KV, GQA packing or key lengths; False: a causal
    call keeps the 128 x 32 wide tile, whose variants compile without spills). ``two_blocks``: single-buffer where that lets two blocks share an SM (:data:`TWO_BLOCKS_MAX_HEAD_DIM`;
    False for paged KV caches, whose double-buffered ring shares one page lookup between K_j and V_j).
    Raises NotImplementedError for head dims above 256.
    """
    name = dtype_name(dtype)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    if not (1 <= head_dim <= MAX_HEAD_DIM and 1 <= head_dim_v <= MAX_HEAD_DIM):
        raise NotImplementedError(
            "flasharray: the CUDA kernels support head dims 1..%d, got D=%d, Dv=%d"
            % (MAX_HEAD_DIM, head_dim, head_dim_v))
    d, dv = pad_head_dim(head_dim), pad_head_dim(head_dim_v)
    hd = max(d, dv)
    limit = smem_limit(arch)
    if kernel is None:
        kernel = "tensor_core" if tensor_cores_available(name, arch) else "simt"
    if kernel == "tensor_core":
        if name not in ("float16", "bfloat16"):
            raise NotImplementedError("flasharray: the tensor-core forward takes float16/bfloat16")
        if block_m is not None:
            br, bc, warps, stages, reason = IO_TILES[block_m]
            return FwdTile("tensor_core", name, d, dv, br, bc, warps, 32, tc_smem(d, dv, br, bc, stages),
                           reason, stages)
        wide = wide and WIDE_ROWS and not ext and hd > 64 and arch_number(arch) >= 80
        wide_candidates = [c for c in (_TC_WIDE_CANDIDATES if wide else [])
                           if _wide_candidate_applies(c, d, dv, causal, arch, plain)]
        fits = [(br, bc, warps, stages, reason, tc_smem(d, dv, br, bc, stages))
                for max_hd, br, bc, warps, stages, reason in ((_TC_EXT_CANDIDATES if ext else []) +
                                                              wide_candidates + _TC_CANDIDATES)
                if hd <= max_hd and tc_smem(d, dv, br, bc, stages) <= limit]
        if two_blocks and hd <= TWO_BLOCKS_MAX_HEAD_DIM and (not ext or (hd > 64 and arch_number(arch) >= 80)):
            # single-buffered if two then fit (extension calls: the table's tiles above d 64, on cp.async archs)
            fits = [f for f in fits if f[:3] == fits[0][:3] and _two_blocks_fit(f[5], arch)] or fits
        if fits:
            br, bc, warps, stages, reason, smem = fits[0]
            return FwdTile("tensor_core", name, d, dv, br, bc, warps, 32, smem, reason, stages)
    else:
        elem, acc = itemsize(name), (8 if name == "float64" else 4)
        for max_hd, br, bc, tm, tn, reason in _SIMT_CANDIDATES[acc]:
            smem = simt_smem(d, dv, br, bc, elem, acc)
            if hd <= max_hd and smem <= limit and _simt_fits((max_hd, br, bc), smem, arch):
                return FwdTile("simt", name, d, dv, br, bc, tm, tn, smem, reason)
    raise NotImplementedError(  # pragma: no cover - every (dtype, d <= 256, arch) has a tile
        "flasharray: no forward tile fits %s d=%d dv=%d in %d bytes of shared memory on sm_%d"
        % (name, d, dv, limit, arch_number(arch)))


def _simt_fits(candidate, smem, arch):
    """Whether a SIMT candidate (max_hd, Br, Bc, ...) with ``smem`` bytes meets its
    :data:`_SIMT_MIN_BLOCKS` (blocks per SM by shared memory, 1 KB reserved each on sm_80+)."""
    need = _SIMT_MIN_BLOCKS.get(candidate[:3], 1)
    a = arch_number(arch)
    return need == 1 or need * (smem + (KB if a >= 80 else 0)) <= SMEM_PER_SM.get(a, smem_limit(a))


def table(archs=ARCHS, head_dims=(16, 32, 64, 96, 128, 256),
          dtypes=("float16", "bfloat16", "float32", "float64")):
    """Rows (arch, dtype, head_dim, FwdTile) of the whole table, for show_config and docs."""
    return [(a, dt, hd, forward_tile(dt, hd, hd, a)) for a in archs for dt in dtypes for hd in head_dims]


# ---- split-KV ("flash-decoding") -----------------------------------------------------------------
# When the batch entries × query tiles of a forward leave most SMs idle (decoding: Lq = 1, one
# query tile per head), the tensor-core kernel splits the key tiles of each query tile into
# runs processed by separate blocks (flash_fwd_kernel<..., Is_split = true>) and a second kernel
# (flash_fwd_combine.cu) merges the partial results by log-sum-exp.

#: SMs of the GPU the emulator pretends to be, per compute capability (the split heuristic's input;
#: on a real GPU CuPy reports the count): T4 40, A100 108, A10 72 (sm_86), Orin 16 (sm_87),
#: L4 58 (sm_89), H100 SXM 132.
EMULATOR_SM_COUNT = {75: 40, 80: 108, 86: 72, 87: 16, 89: 58, 90: 132}
#: Most splits the heuristic picks, and the most a caller may force (``num_splits``): the combine
#: kernel keeps splits × 4 weights in shared memory (4 KB at 256).
MAX_SPLITS = 128
MAX_FORCED_SPLITS = 256
#: Below this fraction of the SMs busy, splitting is considered.
SPLIT_OCCUPANCY = 0.8
#: Fewest keys per split the automatic count allows: a shorter run saves less time than its fp32
#: partial results and the combine launch cost (FlashAttention-2 counts 128-256-key blocks).
MIN_KEYS_PER_SPLIT = 256
#: The smallest split count whose wave efficiency is within this fraction of the best one wins.
#: FlashAttention-2 takes 85 %; measured on an H200 (docs/gpu_h200.md, third session) a decode's time
#: follows the wave efficiency of its blocks on the slots closely (B 1, H 32, 32k keys: 7 splits, 85 %,
#: 1.16x FlashAttention-2's time; 8 splits, 97 %, 1.08x; 10 splits, 61 %, 1.50x), so 95 %.
SPLIT_EFFICIENCY = 0.95


def emulator_sm_count(arch):
    """The SM count the emulator pretends ``arch`` has (unknown archs: the nearest known one below)."""
    a = arch_number(arch)
    known = [x for x in sorted(EMULATOR_SM_COUNT) if x <= a]
    return EMULATOR_SM_COUNT[known[-1] if known else min(EMULATOR_SM_COUNT)]


def wave_efficiency(blocks, sm_count):
    """Busy fraction of the SM-slots over the waves ``blocks`` blocks take (one block per SM and
    wave): ``w / ceil(w)`` with ``w = blocks / sm_count``."""
    waves = blocks / sm_count
    return waves / -(-blocks // sm_count)


def num_splits_heuristic(blocks, sm_count, n_key_tiles, max_splits=MAX_SPLITS):
    """How many key splits a forward with ``blocks`` (batch entries × query tiles) blocks and
    ``n_key_tiles`` key tiles per query tile should use on ``sm_count`` SMs.

    1 when the blocks already fill ``SPLIT_OCCUPANCY`` (80%) of the SMs. Otherwise every count s
    from 1 to min(max_splits, sm_count, n_key_tiles) is rated by the wave efficiency of the
    ``blocks · s`` blocks it launches; a count that gives every split as many tiles as s − 1 does
    (ceil(n / s) = ceil(n / (s−1)): only an empty split more) is skipped; the smallest count within
    ``SPLIT_EFFICIENCY`` (95%) of the best efficiency wins — more splits mean more partial results
    to write and merge for no better SM use. (FlashAttention-2's rule, ``num_splits_heuristic``, which
    takes 85%.) E.g. 32 heads decoding on 132 slots: 4 splits (128 blocks, 97%); on 264 slots: 8 (256
    blocks, 97%), not 7 (85%); 48 on 108: 9 (432 blocks, 4 full waves), not 2 (89%) or 3 (67%).
    """
    blocks, sm_count, n_key_tiles = int(blocks), int(sm_count), int(n_key_tiles)
    if blocks <= 0 or n_key_tiles <= 1 or blocks >= SPLIT_OCCUPANCY * sm_count:
        return 1
    most = max(1, min(int(max_splits), sm_count, n_key_tiles))
    rated = []
    for s in range(1, most + 1):
        if s > 1 and -(-n_key_tiles // s) == -(-n_key_tiles // (s - 1)):
            continue
        rated.append((s, wave_efficiency(blocks * s, sm_count)))
    best = max(e for _, e in rated)
    return next(s for s, e in rated if e >= SPLIT_EFFICIENCY * best)


#: Whether causal dense calls on the tensor-core forward walk the grouped longest-first order (the kernel's
#: ``causal_groups`` argument, :func:`causal_groups`; off: entry by entry, each entry's longest tile first).
#: Twenty-second session; a ``hopper_variants.py`` switch (``mma.CAUSAL_GROUPS``), not yet timed on a GPU.
CAUSAL_GROUPS = True
#: Bytes of K and V (all key rows of a batch entry, d + dv columns) one group of a causal order may hold: the
#: tensor-core forward's groups here, the persistent wgmma forward's pairs (cuda_forward_sm90.causal_group).
CAUSAL_GROUP_BYTES = 20 << 20


def l2_group_entries(Lk, d, dv, itemsize):
    """Batch entries whose K and V (Lk rows, d + dv columns) fit :data:`CAUSAL_GROUP_BYTES`, at least 1."""
    return max(1, CAUSAL_GROUP_BYTES // max(1, Lk * (d + dv) * itemsize))


def causal_groups(n_m, entries, Lk, d, dv, itemsize, slots):
    """The tensor-core forward's ``causal_groups`` argument (flash_block_info.cuh, ``grid_tile``) for a causal
    dense grid of ``n_m`` query tiles x ``entries`` batch entries on ``slots`` concurrent blocks
    (:func:`split_slots`): 0 (entry by entry) unless :data:`CAUSAL_GROUPS` and n_m > 1; else entries //
    (entries per group), a group being at least the entries whose K and V fit :data:`CAUSAL_GROUP_BYTES` and at
    least 2·slots / n_m entries (groups then differ by at most one entry). The hardware starts blocks in grid
    order, the next where one ends, so each group's longest tiles start while the previous group drains; a
    group of about two waves of work keeps its longest tile from outlasting the rest (a list-scheduling model at
    B·N = 16k, d 64-128, N 1k-16k: the busiest SM 1.003-1.015 x the mean, where entry by entry gave 1.005-1.075;
    docs/performance.md, twenty-second session)."""
    if not CAUSAL_GROUPS or n_m < 2 or entries < 1:
        return 0
    per_group = max(l2_group_entries(Lk, d, dv, itemsize), -(-2 * slots // n_m))
    return max(1, entries // per_group)


def grid_tile_order(n_m, entries, n_groups):
    """Host mirror of flash_block_info.cuh's grid_tile: the (query tile, entry) of each linear block index L =
    x + n_m·e of a causal grid, in dispatch order (n_groups = 0: entry by entry, longest first)."""
    if n_groups <= 0:
        return [(n_m - 1 - x, e) for e in range(entries) for x in range(n_m)]
    groups = min(n_groups, entries)
    base, big = divmod(entries, groups)
    big_tiles = big * (base + 1) * n_m
    out = []
    for L in range(n_m * entries):
        size = base + 1 if L < big_tiles else base
        e0 = L // (size * n_m) * size if L < big_tiles else big * (base + 1) + (L - big_tiles) // (size * n_m) * size
        within = L - e0 * n_m
        level = within // size
        out.append((n_m - 1 - level, e0 + within - level * size))
    return out


def split_slots(tile, arch, sm_count):
    """The block slots one wave of a split-KV forward has: ``sm_count`` x 2 where two blocks of ``tile``
    share an SM (at most 128 threads: their 200-255 registers per thread fill half the register file;
    and two blocks' shared memory fits), else x 1. FlashAttention-2 sizes its splits for 2 x the SM count
    (its 128-thread split kernel); a memory-bound decode wants the second block's loads in flight: with
    one slot per SM, B 1 x H 32 over 32k keys took 4 splits (128 blocks, one per SM) and ran at 1.16x
    FlashAttention-2's time on an H200 (docs/gpu_h200.md), which takes 8."""
    two = tile.n_threads <= 128 and _two_blocks_fit(tile.smem, arch)
    return int(sm_count) * (2 if two else 1)


def auto_num_splits(blocks, sm_count, Lk, block_n):
    """The automatic split count of a forward: :func:`num_splits_heuristic` over the ceil(Lk / Bc)
    key tiles, at most ceil(Lk / ``MIN_KEYS_PER_SPLIT``) splits (so no split runs fewer than
    256 keys; Lk <= 256 never splits) and at most ``MAX_SPLITS``."""
    cap = min(MAX_SPLITS, -(-int(Lk) // MIN_KEYS_PER_SPLIT))
    return num_splits_heuristic(blocks, sm_count, -(-int(Lk) // int(block_n)), max_splits=cap)
