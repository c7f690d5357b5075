"""Tiles of the Hopper forward on wgmma (``cuda_src/flash_fwd_sm90.cu``, issue 13; docs/hopper.md).

The default on sm_90 (:data:`AUTO_DISPATCH`, docs/hopper.md "Automatic sm_90 dispatch": 1.2-2.5x the mma.sync
forward on an H200): :func:`forward_tile` returns the tile for ``kernel=None`` where the kernel serves the call
(float16 / bfloat16, head dims 1..256, no IO tile, no split-KV, no KV cache; on CUDA only where NVRTC compiles
sm_90a, :func:`auto_dispatch`), None elsewhere (the mma.sync chain; ``kernel="tensor_core"`` forces it). It takes
the extensions of docs/extensions.md (the kernels' ``kExt`` bits, as the mma.sync forward's; :data:`AUTO_EXT`);
asking for ``kernel="wgmma"`` where the kernel cannot run is a NotImplementedError naming the reason.

Two instantiations: where q, k and v are TMA-legal (:func:`tma_legal`: 16-byte aligned, strides
multiples of 16 bytes below 2^40; the plan's ``aligned`` case) the warp-specialized kernel
``flash_fwd_sm90_ws_kernel`` (a producer warpgroup issuing TMA into a ring on mbarriers, ``setmaxnreg``
24 / 240, 384 threads, each consumer warpgroup's softmax overlapped with its own P V wgmmas unless
:data:`OVERLAP` is off; :func:`tma_tile`), its three tensor maps by-value ``CUtensorMap`` arguments
(:class:`launch.Map`) whose geometry is checked once per plan and whose address is encoded per call
(:class:`tensor_map.TiledTemplate`); otherwise the cp.async kernel ``flash_fwd_sm90_kernel``. The ws kernel
writes O by TMA stores through a fourth map (``Is_tma_store``) where :data:`USE_TMA_STORE` and
:func:`out_tma_legal` allow it (:func:`add_tma_launch` picks the instantiation), else by row stores.

Head dims are padded to 64, 128, 192 or 256 (whole 128-byte swizzle panels; dv is the N of the O wgmma) and
zero-filled past D / Dv. Tiles: two consumer warpgroups (Br = 128, 256 threads); Bc = 128 for head dims up to 128
(S and O accumulators 64 + 64 registers), Bc = 64 above 128 (O takes 96 / 128 registers at 192 / 256); the ws
kernel's dense non-causal calls take wider key tiles, 192 / 176 / 80 at padded d = dv 64 / 128 / 256
(:data:`WIDE_KEYS`). Shared memory: Q, two K stages and two V stages, each
128B-swizzled, plus 1 KB for aligning the dynamic base to the swizzle repeat on the GPU.
"""
import dataclasses
from dataclasses import dataclass

import numpy as np

from . import launch as L
from . import tiles
from .tensor_map import TiledTemplate

SOURCE = "flash_fwd_sm90.cu"
KERNEL = "wgmma"
ARCH = 90
WARPGROUP_ROWS = 64
BLOCK_M = 2 * WARPGROUP_ROWS
STAGES = 2
MAX_HEAD_DIM = 256
_ALIGN = 1024  # the GPU's dynamic shared memory base rounded up to the 128B swizzle repeat


def pad_head_dim(n):
    """64, 128, 192 or 256: the smallest that holds ``n`` (1..256)."""
    return next(p for p in (64, 128, 192, 256) if n <= p)


def smem_bytes(d, dv, block_m, block_n):
    """Mirror of Sm90FwdTraits::kSmemBytes: max(Q + 2 K stages + 2 V stages, staged O + LSE) + 1 KB."""
    loop = 2 * (block_m * d + STAGES * block_n * (d + dv))
    epilogue = 2 * block_m * (dv + 8) + 4 * block_m
    return max(loop, epilogue) + _ALIGN


def ws_smem_bytes(d, dv, block_m, block_n, overlap=True, persistent=False):
    """Mirror of Sm90WsTraits::kSmemBytes: the layout above, then 1 + 4 x STAGES mbarriers (8 bytes; 1 + 3 x
    STAGES without the intra-warpgroup overlap, whose K and V stages share one empty barrier). Persistent:
    one more mbarrier (empty_q) and O's staging region (Br x (dv + 8) elements) past the K / V ring where it
    fits, else over Q grown by whole KB (:func:`persistent_layout`)."""
    bars = 1 + (4 if overlap else 3) * STAGES
    if not persistent:
        body = smem_bytes(d, dv, block_m, block_n) - _ALIGN
        return (body + 7) // 8 * 8 + 8 * bars + _ALIGN
    separate, pad = persistent_layout(d, dv, block_m, block_n, overlap)
    loop = 2 * (block_m * d + STAGES * block_n * (d + dv))
    over_v = not separate and _o_over_v_ring(dv, block_m, block_n)   # + empty_o
    return pad + loop + (_o_bytes(dv, block_m) if separate else 0) + 8 * (bars + 1 + over_v) + _ALIGN


def _o_bytes(dv, block_m):
    return 2 * block_m * (dv + 8)


def _o_over_v_ring(dv, block_m, block_n):
    """Whether the V ring holds sO (Sm90WsTraits::kOOverV, where sO has no region of its own)."""
    return _o_bytes(dv, block_m) <= STAGES * 2 * block_n * dv


def persistent_layout(d, dv, block_m, block_n, overlap=True):
    """Mirror of Sm90WsTraits<..., Is_persistent = true>: (kSeparateO, kOPad). sO gets its own region when
    the ring, it and the mbarriers fit in 227 KB (d <= 128 on key tiles of 128, d 64 on the wide one); else it
    lies over the V ring where that holds it (kOOverV: the wide key tiles at d 128 / 256; kOPad 0), else over sQ,
    which moves up by kOPad bytes (a multiple of 1 KB) so that sO covers nothing of the ring (d 256, Bc 64)."""
    bars = 2 + (4 if overlap else 3) * STAGES
    loop = 2 * (block_m * d + STAGES * block_n * (d + dv))
    o_bytes, q_bytes = _o_bytes(dv, block_m), 2 * block_m * d
    if loop + o_bytes + 8 * bars + _ALIGN <= 227 * 1024:
        return True, 0
    if _o_over_v_ring(dv, block_m, block_n):
        return False, 0
    return False, -(-max(0, o_bytes - q_bytes) // 1024) * 1024


@dataclass(frozen=True)
class Sm90Tile(tiles.FwdTile):
    """A :class:`tiles.FwdTile` of the wgmma kernel (kernel ``"wgmma"``; threads_m = warps). ``tma``:
    the warp-specialized instantiation (``flash_fwd_sm90_ws_kernel``: a producer warpgroup issuing TMA,
    tensor maps per call), else the cp.async one (``flash_fwd_sm90_kernel``). ``overlap`` (TMA only): the
    consumers overlap their softmax with their own P V wgmmas (the kernel's ``Is_overlap``). ``persistent``
    (TMA only): the kernel's ``Is_persistent`` (:data:`PERSISTENT`: a grid of at most one block per SM, each
    walking work tiles)."""

    tma: bool = False
    overlap: bool = False
    persistent: bool = False

    @property
    def source(self):
        return SOURCE

    def name_expression(self, causal, aligned, tma_store=False, ext=0):
        """``tma_store`` (TMA tiles): the instantiation writing O by TMA stores (``Is_tma_store``; the
        launch picks it where the output is TMA-legal, :func:`add_tma_launch`). ``ext``: the kExt bits, the
        last template argument (only when nonzero: the dense names stay as they are)."""
        if self.tma:
            name = "flash::flash_fwd_sm90_ws_kernel<%s, %d, %d, %d, %d, %s, %s>" % (
                tiles._CTYPE[self.dtype], self.head_dim, self.head_dim_v, self.block_m, self.block_n,
                "true" if causal else "false", "true" if self.overlap else "false")
            if self.persistent or ext:
                name = name[:-1] + ", false, %s>" % ("true" if self.persistent else "false")
            if ext:
                name = name[:-1] + ", %d>" % ext
            return with_tma_store(name) if tma_store else name
        name = "flash::flash_fwd_sm90_kernel<%s, %d, %d, %d, %d, %s, %s>" % (
            tiles._CTYPE[self.dtype], self.head_dim, self.head_dim_v, self.block_m, self.block_n,
            "true" if causal else "false", "true" if aligned else "false")
        return name[:-1] + ", %d>" % ext if ext else name

    def describe(self):
        return ("wgmma kernel (sm_90a%s), Br=%d Bc=%d, %d threads (%d warpgroups), %d-stage K/V, d=%d dv=%d, "
                "%.1f KB smem (opt-in): %s" % (
                    ", TMA + warp-specialized" if self.tma else "",
                    self.block_m, self.block_n, self.n_threads, self.n_threads // 128, self.stages,
                    self.head_dim, self.head_dim_v, self.smem / tiles.KB, self.reason))


def _unsupported(why):
    return NotImplementedError("flasharray: kernel='wgmma' (the Hopper forward, cuda_src/%s) %s" % (SOURCE, why))


def check_arch_and_dtype(arch, dtype, unsupported):
    """The arch number where the wgmma kernels run (sm_90, float16 / bfloat16); else raises
    ``unsupported(why)`` (the forward's or the backward's NotImplementedError)."""
    a = tiles.arch_number(arch)
    if a != ARCH:
        raise unsupported("needs sm_90 (wgmma, compiled for sm_90a); this device is sm_%d" % a)
    name = tiles.dtype_name(dtype)
    if name not in ("float16", "bfloat16"):
        raise unsupported("takes float16 or bfloat16, got %s" % name)
    return a


#: Whether ``kernel=None`` on sm_90 takes the wgmma kernels where they serve the call (this forward: dense
#: float16 / bfloat16 calls, :func:`forward_tile`; the backward: ``cuda_backward._kernel_choice``). False: the
#: mma.sync kernels, as before the H200 measurements (docs/hopper.md, "Automatic sm_90 dispatch"). Plans are
#: cached by signature: clear them (``launch._clear_plans()``) after changing it.
AUTO_DISPATCH = True
#: Whether that dispatch includes calls with extensions (the ``kExt`` bits: window, ALiBi, softcap, block mask,
#: dropout, lengths). The wgmma forward's extension instantiations passed on an H200
#: (``tests/test_cuda_forward_sm90_extensions.py::test_wgmma_extensions_gpu``, every feature among its cases,
#: docs/gpu_h200.md call 2); where a layout refuses them (rows not 16-byte aligned at padded d 256) the plan
#: falls back to the mma.sync forward. False: extension calls keep the mma.sync forward (the GPU session's
#: ``hopper_variants.py`` row ``fwd.kernel.dropout`` / ``.window`` times both).
AUTO_EXT = True
#: That dispatch leaves to the mma.sync forward the calls with a window of at most this many keys per query row
#: (left + right + 1, both bounded) at padded head dims (d and dv) up to :data:`SHORT_WINDOW_MAX_HEAD_DIM`. On an
#: H200 a (255, 0) window at d 64 ran 1.3-1.4x faster on mma.sync (N 1k and 4k, causal or not; at d 128 wgmma
#: was 1.1-1.2x faster; docs/gpu_h200.md, third session): each 128-row query tile visits 3-4 key tiles, too few
#: to amortize the warp-specialized kernel's prologue and epilogue at d 64. 384 keys (at most 4 key tiles of 128
#: per query tile) covers the measured 256; between that and an unbounded window (wgmma 1.4x at d 64) it is not
#: measured.
SHORT_WINDOW_KEYS = 384
SHORT_WINDOW_MAX_HEAD_DIM = 64


def auto_serves_window(window, tile):
    """Whether ``kernel=None``'s wgmma ``tile`` serves a call with ``window`` (``(left, right)``, −1 unbounded, or
    None): False for a short window (:data:`SHORT_WINDOW_KEYS`) at small head dims, where mma.sync is faster."""
    if window is None or min(window) < 0 or max(tile.head_dim, tile.head_dim_v) > SHORT_WINDOW_MAX_HEAD_DIM:
        return True
    return window[0] + window[1] + 1 > SHORT_WINDOW_KEYS


def nvrtc_sm90a():
    """Whether NVRTC (12.0 or newer: the ``sm_90a`` target) can compile the arch-specific sources here."""
    from . import nvrtc
    try:
        return nvrtc.available()[0] and nvrtc.version() >= (12, 0)
    except Exception:  # noqa: BLE001 -- a broken NVRTC: the mma.sync kernels
        return False


def auto_dispatch(arch, device=None):
    """Whether ``kernel=None`` calls on ``arch`` may take the wgmma kernels: :data:`AUTO_DISPATCH` on sm_90 and,
    on CUDA (``device == "cuda"``), NVRTC able to compile sm_90a (:func:`nvrtc_sm90a`; the emulator needs no
    NVRTC, its arch is the ``arch=`` argument)."""
    if not AUTO_DISPATCH or tiles.arch_number(arch) != ARCH:
        return False
    return device != "cuda" or nvrtc_sm90a()


def forward_tile(dtype, head_dim, head_dim_v, arch, *, kernel=None, block_m=None, ext=False, num_splits=None,
                 kv=None, device=None):
    """The :class:`Sm90Tile` for a call with ``kernel="wgmma"`` (NotImplementedError where the wgmma kernel
    cannot run); for ``kernel=None`` the tile where it serves the call (:func:`auto_tile`), else None; None for
    any other ``kernel``. ``device``: the launcher's ("cuda", "emulator")."""
    if kernel is None:
        return auto_tile(dtype, head_dim, head_dim_v, arch, device, block_m=block_m, ext=ext,
                         num_splits=num_splits, kv=kv)
    if kernel != KERNEL:
        return None
    a = check_arch_and_dtype(arch, dtype, _unsupported)
    name = tiles.dtype_name(dtype)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    if not (1 <= head_dim <= MAX_HEAD_DIM and 1 <= head_dim_v <= MAX_HEAD_DIM):
        raise _unsupported("supports head dims 1..%d, got D=%d, Dv=%d" % (MAX_HEAD_DIM, head_dim, head_dim_v))
    others = [what for what, on in (("block_m=%r" % (block_m,), block_m is not None),
                                    ("num_splits=%r" % (num_splits,), num_splits not in (None, 1)),
                                    ("a KV cache", kv is not None)) if on]
    if others:
        raise _unsupported("runs without IO tiles, split-KV and the KV cache: no %s" % ", ".join(others))
    d, dv = pad_head_dim(head_dim), pad_head_dim(head_dim_v)
    bc = 128 if max(d, dv) <= 128 else 64
    smem = smem_bytes(d, dv, BLOCK_M, bc)
    assert smem <= tiles.smem_limit(a), (d, dv, smem)
    reason = ("2 consumer warpgroups x 64 rows, Bc=%d (%s), K/V in a 2-stage cp.async ring, 128B-swizzled"
              % (bc, "S and O accumulators 64 + %d registers" % (dv // 2) if bc == 128
                 else "the O accumulator takes %d registers" % (dv // 2)))
    return Sm90Tile(KERNEL, name, d, dv, BLOCK_M, bc, BLOCK_M // 16, 32, smem, reason, STAGES)


def auto_tile(dtype, head_dim, head_dim_v, arch, device=None, **call):
    """``kernel=None``: the wgmma tile where :func:`auto_dispatch` allows it and the kernel serves a dense call
    (float16 / bfloat16, head dims 1..256, no ``block_m``, split-KV or KV cache); else None (the mma.sync chain).
    Calls with extensions too where :data:`AUTO_EXT`. ``cuda_forward`` keeps the mma.sync plan where it would
    split the keys (decoding) or where the wgmma layout refuses the call (extensions on unaligned rows at d 256)."""
    if (not auto_dispatch(arch, device) or (call.get("ext") and not AUTO_EXT)
            or tiles.dtype_name(dtype) not in ("float16", "bfloat16")):
        return None
    try:
        return forward_tile(dtype, head_dim, head_dim_v, arch, kernel=KERNEL, **call)
    except NotImplementedError:
        return None


# ---- the TMA / warp-specialized instantiation (flash_fwd_sm90_ws_kernel) ---------------------------------

#: Whether ``kernel="wgmma"`` takes the TMA kernel where the layout allows it (tests turn it off to run
#: the cp.async kernel on the same inputs).
USE_TMA = True
#: Whether the TMA kernel writes O by TMA stores where the output is TMA-legal (:func:`out_tma_legal`; else
#: 16-byte row stores from the staged tile). Tests turn it off to compare the bits.
USE_TMA_STORE = True
#: Whether the TMA kernel overlaps each consumer warpgroup's softmax with its own P V wgmmas
#: (FlashAttention-3's intra-warpgroup overlap, docs/hopper.md; tests turn it off to compare the bits).
OVERLAP = True
#: Whether the TMA kernel is persistent (``Is_persistent``): a grid of min(work tiles, SMs) blocks, each walking
#: (query tile, batch entry) work tiles of a static scheduler (causal: longest first, or paired in L2 groups:
#: :func:`causal_group`). Tests turn it off to compare the bits, and set :data:`SM_COUNT`.
PERSISTENT = True
#: The SM count the persistent grid is sized for; None: the device's (CuPy: ``MultiProcessorCount``; the
#: emulator: ``tiles.emulator_sm_count``). Tests force small counts (several tiles per block).
SM_COUNT = None
#: The largest padded head dim (d and dv) the persistent kernel is taken for: every one since the twenty-third
#: session. At 256 its consumers spilled 28-116 stores under setmaxnreg 240 (measured 1.07x slower than one block
#: per work tile); that was the epilogue's per-thread addresses, hoisted out of the tile loop and held through the
#: key loop, which the epilogue now recomputes per tile (``opaque_int``): zero spills, sO over the V ring on the
#: wide key tile (over sQ on Bc 64). 128: d = 256 one block per work tile (``hopper_variants.py``'s
#: ``fwd.PERSISTENT_MAX_HEAD_DIM``).
PERSISTENT_MAX_HEAD_DIM = 256
#: The same for causal calls: 128. At d 256 the causal persistent kernel's unmasked key loop came out 14 % longer
#: than one block per work tile's (640 / 681 against 561 / 600 instructions on key tiles of 64 / 80, consumers at
#: 230-238 registers), where non-causal it is shorter (584 against 620); so causal d 256 keeps one block per tile.
PERSISTENT_CAUSAL_MAX_HEAD_DIM = 128
#: kExt bits that change only which scores are visible (window, seqlens: a few integers per tile, no per-score
#: state): with only these the ws kernel keeps the intra-warpgroup overlap and PERSISTENT_MAX_HEAD_DIM, as dense
#: calls do (zero spills in every such instantiation).
GEOMETRY_EXT = 1 | 32
#: kExt bits that transform each score (ALiBi, softcap: a slope or a cap per tile, an FMA or a tanh per score): with
#: only these and geometry bits the ws kernel keeps the overlap up to padded d :data:`SCORE_EXT_OVERLAP_MAX_HEAD_DIM`
#: and is persistent up to :data:`PERSISTENT_MAX_HEAD_DIM_SCORE_EXT` (causal: PERSISTENT_CAUSAL_MAX_HEAD_DIM), i.e.
#: at every head dim the dense route: zero spills at every padded head dim, d = dv or not, fp16 and bf16, causal or
#: not, TMA or row stores (thirty-seventh session). Until then 128 and 64: the overlapped loop spilled 4 bytes at
#: d 256, the persistent one 8-12 at d 128, since gone from the consumers' loop. ``hopper_variants.py --only ext``
#: times the old limits (``fwd.SCORE_EXT_OVERLAP_MAX_HEAD_DIM.softcap``,
#: ``fwd.PERSISTENT_MAX_HEAD_DIM_SCORE_EXT.softcap``).
SCORE_EXT = 2 | 4
SCORE_EXT_OVERLAP_MAX_HEAD_DIM = 256
PERSISTENT_MAX_HEAD_DIM_SCORE_EXT = 256
#: With the block mask or dropout (their per-tile state: block-mask pointer and strides, the Philox key): the
#: largest padded head dim taking the persistent kernel. Their state on top of the persistent loop's spills the
#: d = 128 consumers (up to 56 bytes with every feature).
PERSISTENT_MAX_HEAD_DIM_EXT = 64
#: ... and the largest taking the intra-warpgroup overlap: 64 (thirty-seventh session; before, none). At d 64 every
#: subset with the block mask or dropout compiles clean overlapped and persistent (fp16 and bf16, causal or not, TMA
#: or row stores); at d 128 overlapped, 4-112 bytes of spills (window + dropout, block mask + dropout, ...). 0: the
#: old route (``hopper_variants.py``'s ``fwd.HEAVY_EXT_OVERLAP_MAX_HEAD_DIM.dropout``).
HEAVY_EXT_OVERLAP_MAX_HEAD_DIM = 64
#: The largest padded head dim at which the cp.async kernel takes extensions on rows that are not 16-byte
#: aligned (the element-wise copy): at 256 the copy's registers and the extensions' spill (8-32 bytes).
ELEMENTWISE_MAX_HEAD_DIM_EXT = 128
#: Bc of the cp.async kernel with extensions at padded d 128 (Bc 128 spilled 4 bytes with window + ALiBi +
#: block mask + dropout, causal; and the element-wise copy more): 64, zero spills at 164-215 registers.
CP_ASYNC_EXT_BLOCK_N = 64
#: The ws kernel's key tile for dense, non-causal calls at padded d = dv (FlashAttention-3's sm_90 tiles: 128 x 176
#: at d 128, 128 x 80 at d 256; at d 64, where FA3 runs 192 x 192 on three consumer warpgroups, 128 x 192 on our
#: two): Bc = 176 / 192 / 80 instead of 128 / 128 / 64 spreads each key tile's fixed work (the O rescale, the row
#: max and sum shuffles, the mbarrier waits and ping-pong turns) over 1.25-1.5x the scores: 11-14 % fewer
#: instructions per key in the SASS (docs/hopper.md, "Wide key tiles"). Causal calls keep the table's Bc but at
#: :data:`WIDE_CAUSAL` (as FA3's), calls with extensions outside :data:`WIDE_EXT` too, and so does the cp.async
#: kernel. False: the table's Bc everywhere (``hopper_variants.py``'s ``fwd.WIDE_KEYS``).
#: Plans are cached: flip it before planning, or clear them (launch._clear_plans).
WIDE_KEYS = True
WIDE_BLOCK_N = {64: 192, 128: 176, 256: 80}
#: The wide tile's instructions per key over the table tile's (the unmasked loops' SASS, docs/hopper.md): a call
#: takes the wide tile where its keys rounded up to whole wide tiles, at this cost, come cheaper than rounded up to
#: whole table tiles (N 1k at d 64: 6 x 192 = 1152 keys for 1024, so it keeps 128; at d 128: 6 x 176 = 1056).
WIDE_KEY_COST = {64: 454 / 508, 128: 513 / 577, 256: 496 / 574}
#: Extension calls on the wide key tile, per padded head dim: the kExt sets that take it (a call takes it where its
#: bits are a subset of one of them), from the thirty-eighth session's spill audit (zero spills, no stack, fp16 and
#: bf16, TMA and row stores, the overlap and persistence :func:`tma_tile` gives them; docs/hopper.md, "Wide key tiles
#: with extensions"): lengths, ALiBi and softcap, but at d 128 not ALiBi with softcap (the TMA-store instantiation
#: spilled 204 bytes); at d 256, where causal calls take the wide tile too, the window as well (FlashAttention-3 runs
#: 128 x 80 there, local or not). Windows at d 64 / 128 keep the table's Bc as causal calls do (a band of tiles masked
#: at both edges: FlashAttention-3's local tiles are its causal ones), and so do the block mask and dropout. Empty:
#: every extension call on the table's Bc (the old route, ``hopper_variants.py``'s ``fwd.WIDE_EXT.softcap``).
WIDE_EXT = {64: (2 | 4 | 32,), 128: (2 | 32, 4 | 32), 256: (1 | 2 | 4 | 32,)}
#: Padded head dims whose causal calls take the wide tile too (FlashAttention-3: 128 x 80 at d 256 causal or not; 128
#: keys at d 64 / 128 causal).
WIDE_CAUSAL = (256,)
#: Whether the ws kernel's dense calls at padded d = dv = 64 (causal or not) run **three consumer warpgroups**:
#: Br = 192, Bc = 128, 512 threads, setmaxnreg 32 / 160 (FlashAttention-3's d 64 tile; docs/hopper.md, "Three
#: consumer warpgroups at d = 64"). At d 64 each score's softmax (one MUFU.EX2, ~7 other instructions) costs as
#: much MUFU time as its 4·d FLOPs of tensor time; with two warpgroups one warp per scheduler runs its softmax
#: under the other's GEMMs, with three two do. False (the default until a GPU times it): two warpgroups, the wide
#: key tile 128 x 192 (``hopper_variants.py``'s ``fwd.THREE_WARPGROUPS``). Plans are cached: flip it before
#: planning, or clear them (launch._clear_plans).
THREE_WARPGROUPS = False
THREE_WARPGROUPS_HEAD_DIM = 64
THREE_WARPGROUPS_BLOCK_N = 128
PRODUCER_WARPGROUPS = 1
PRODUCER_REGS, CONSUMER_REGS = 24, 240   # Sm90WsTraits::kProducerRegs / kConsumerRegs (setmaxnreg), two consumers
PRODUCER_REGS_3, CONSUMER_REGS_3 = 32, 160   # ... three consumer warpgroups (Br = 192)


def ws_registers(block_m):
    """(producer, consumer) registers per thread after setmaxnreg for the ws kernel with Br = ``block_m``."""
    return (PRODUCER_REGS, CONSUMER_REGS) if block_m == 2 * WARPGROUP_ROWS else (PRODUCER_REGS_3, CONSUMER_REGS_3)


def three_warpgroups(tile, ext=0):
    """Whether the ws instantiation of ``tile`` runs three consumer warpgroups (:data:`THREE_WARPGROUPS`: dense
    calls at padded d = dv = :data:`THREE_WARPGROUPS_HEAD_DIM`)."""
    return (THREE_WARPGROUPS and not ext and tile.head_dim == tile.head_dim_v == THREE_WARPGROUPS_HEAD_DIM)
_MAX_STRIDE = 2 ** 40   # bytes: cuTensorMapEncodeTiled's bound on a global stride
_PANEL = 64             # elements of one 128-byte swizzle panel: the inner box


def _tma_reason(name, a):
    """Why the array ``a`` (leading batch dims, then rows, head dim) cannot be described by a tensor map."""
    if L.device_address(a) % 16:
        return "%s is not 16-byte aligned" % name
    if a.shape[-1] > 1 and a.strides[-1] != a.itemsize:
        return "%s's head dim is not contiguous" % name
    for n, s in zip(a.shape[:-1], a.strides[:-1]):
        if n > 1 and (s < 0 or s % 16 or s >= _MAX_STRIDE):
            return "%s has a stride of %d bytes (TMA: multiples of 16 below 2^40)" % (name, s)
    return None


def tma_legal(arrays):
    """Why the tensors (the kernel's q, k, v: leading batch dims, then rows, head dim) cannot be read by
    TMA, or None: 16-byte aligned addresses (the plan's ``aligned``), unit stride along the head dim,
    every other stride of an extent above 1 a multiple of 16 bytes below 2^40 (rank 5 by construction:
    head dim, rows and the three merged batch dims)."""
    for name, a in zip("qkv", arrays):
        why = _tma_reason(name, a)
        if why is not None:
            return why
    return None


def out_tma_legal(out):
    """Why the output (the kernel's o: batch dims, rows, Dv) cannot be written by TMA stores, or None:
    :func:`tma_legal`'s rules (so Dv·2 bytes a multiple of 16, e.g. not Dv = 59), and no broadcast
    (stride 0) dim, which a written tensor never has."""
    why = _tma_reason("out", out)
    if why is None and any(n > 1 and s == 0 for n, s in zip(out.shape, out.strides)):
        return "out is broadcast along a dim"
    return why


def _ws_args(name_expr):
    head = "flash::flash_fwd_sm90_ws_kernel<"
    assert name_expr.startswith(head) and name_expr.endswith(">") and name_expr.count(",") in (6, 7, 8, 9), name_expr
    return name_expr[len(head):-1].split(", ")


def with_tma_store(name_expr):
    """The ws kernel's instantiation ``name_expr`` with ``Is_tma_store`` set (its eighth template argument)."""
    args = _ws_args(name_expr)
    args[7:8] = ["true"]
    return "flash::flash_fwd_sm90_ws_kernel<%s>" % ", ".join(args)


def ws_flags(name_expr):
    """(Is_tma_store, Is_persistent) of a ws kernel instantiation's name."""
    args = _ws_args(name_expr) + ["false", "false"]
    return args[7] == "true", args[8] == "true"


def wide_block_n(tile, ext=0, causal=False, overlap=True, persistent=False, Lk=None):
    """Bc of the ws instantiation of ``tile``: :data:`WIDE_BLOCK_N` for calls at padded d = dv, dense or with
    the extensions of :data:`WIDE_EXT` (``ext``: kExt bits), non-causal (causal at :data:`WIDE_CAUSAL`), where
    :data:`WIDE_KEYS`, the layout fits the shared memory and, for ``Lk`` keys, the wide tiles' padded keys cost
    less (:data:`WIDE_KEY_COST`); else ``tile.block_n``."""
    if (not WIDE_KEYS or (causal and tile.head_dim not in WIDE_CAUSAL) or tile.head_dim != tile.head_dim_v
            or tile.head_dim not in WIDE_BLOCK_N
            or (ext and not any(ext & ~bits == 0 for bits in WIDE_EXT.get(tile.head_dim, ())))):
        return tile.block_n
    bc, nb = WIDE_BLOCK_N[tile.head_dim], tile.block_n
    smem = ws_smem_bytes(tile.head_dim, tile.head_dim_v, tile.block_m, bc, overlap, persistent)
    fits = smem <= tiles.smem_limit(ARCH)
    cheaper = Lk is None or -(-Lk // bc) * bc * WIDE_KEY_COST[tile.head_dim] < -(-Lk // nb) * nb
    return bc if fits and cheaper else nb


def tma_tile(tile, arrays, ext=0, causal=False, Lk=None):
    """``tile`` turned into the warp-specialized TMA instantiation when the tensors allow it (and
    :data:`USE_TMA`); else ``tile`` itself (the cp.async kernel: the fallback for other layouts). ``ext``: the
    call's kExt bits; with the block mask or dropout above :data:`HEAVY_EXT_OVERLAP_MAX_HEAD_DIM` the consumers wait
    for every wgmma batch (no intra-warpgroup overlap: P_{j−1}'s A fragments in flight and those extensions'
    per-tile state do not fit 240 registers together, the overlapped instantiations spill up to 204 bytes) and the
    kernel is persistent up to :data:`PERSISTENT_MAX_HEAD_DIM_EXT` only; with window, seqlens, ALiBi and softcap
    alone it is the dense route (:data:`SCORE_EXT_OVERLAP_MAX_HEAD_DIM`, :data:`PERSISTENT_MAX_HEAD_DIM_SCORE_EXT`;
    docs/hopper.md, "Extensions"). ``causal`` and ``Lk`` (the keys; None: any) choose the key tile
    (:func:`wide_block_n`)."""
    if not USE_TMA or not isinstance(tile, Sm90Tile) or tile.tma or tma_legal(arrays) is not None:
        return tile
    three = three_warpgroups(tile, ext)
    block_m = 3 * WARPGROUP_ROWS if three else tile.block_m
    warps = (block_m // WARPGROUP_ROWS + PRODUCER_WARPGROUPS) * 4
    d = max(tile.head_dim, tile.head_dim_v)
    heavy, score = bool(ext & ~(GEOMETRY_EXT | SCORE_EXT)), bool(ext & SCORE_EXT)
    overlap = (OVERLAP and (not heavy or d <= HEAVY_EXT_OVERLAP_MAX_HEAD_DIM)
               and (not score or d <= SCORE_EXT_OVERLAP_MAX_HEAD_DIM))
    limit = (PERSISTENT_MAX_HEAD_DIM_EXT if heavy or (score and not overlap) else
             min(PERSISTENT_MAX_HEAD_DIM_SCORE_EXT, PERSISTENT_MAX_HEAD_DIM) if score else PERSISTENT_MAX_HEAD_DIM)
    persistent = PERSISTENT and d <= (min(limit, PERSISTENT_CAUSAL_MAX_HEAD_DIM) if causal else limit)
    bc = THREE_WARPGROUPS_BLOCK_N if three else wide_block_n(tile, ext, causal, overlap, persistent, Lk)
    reason = ("producer warpgroup (TMA, setmaxnreg %d) + %d consumer warpgroups (setmaxnreg %d) x 64 rows, Bc=%d%s, "
              "K/V in a %d-stage ring on mbarriers, 128B-swizzled%s" % (
                  ws_registers(block_m)[0], block_m // WARPGROUP_ROWS, ws_registers(block_m)[1], bc,
                  " (WIDE_KEYS)" if bc != tile.block_n and not three else "", STAGES,
                  ", softmax overlapped with P V" if overlap else ""))
    if three:
        reason += ", THREE_WARPGROUPS"
    if persistent:
        reason += ", persistent (static tile scheduler)"
    smem = ws_smem_bytes(tile.head_dim, tile.head_dim_v, block_m, bc, overlap, persistent)
    return dataclasses.replace(tile, block_m=block_m, block_n=bc, tma=True, overlap=overlap, persistent=persistent,
                               threads_m=warps, smem=smem, reason=reason)


def cp_async_ext_tile(tile, aligned, ext):
    """The cp.async kernel's tile for a call with extensions (``ext``: kExt bits): Bc
    :data:`CP_ASYNC_EXT_BLOCK_N` at padded d 128; NotImplementedError on rows that are not 16-byte aligned above
    :data:`ELEMENTWISE_MAX_HEAD_DIM_EXT` (those instantiations spill). ``tile`` itself otherwise (dense calls,
    the ws kernel, d 64)."""
    d = max(tile.head_dim, tile.head_dim_v)
    if not ext or tile.tma:
        return tile
    if not aligned and d > ELEMENTWISE_MAX_HEAD_DIM_EXT:
        raise _unsupported("takes extensions at head dims above %d only on rows that are 16-byte aligned "
                           "(multiples of 8 elements, aligned bases); these are not (padded head dims %d, %d)"
                           % (ELEMENTWISE_MAX_HEAD_DIM_EXT, tile.head_dim, tile.head_dim_v))
    if d != 128 or tile.block_n == CP_ASYNC_EXT_BLOCK_N:
        return tile
    bc = CP_ASYNC_EXT_BLOCK_N
    return dataclasses.replace(tile, block_n=bc, smem=smem_bytes(tile.head_dim, tile.head_dim_v, tile.block_m, bc),
                               reason=tile.reason.replace("Bc=%d" % tile.block_n, "Bc=%d (extensions)" % bc))


#: Whether the persistent kernel's causal calls take the paired order in L2 groups (:func:`causal_group`; off: the
#: longest-first order of every block's tiles, the scheduler before the twenty-second session). A
#: ``hopper_variants.py`` switch (``fwd.CAUSAL_PAIRS``): not yet timed on a GPU.
CAUSAL_PAIRS = True


def paired_causal(name_expr):
    """Whether a ws kernel instantiation walks the paired causal order when its launch passes ``group`` > 0:
    causal, persistent and dense (kExt = 0: with the extensions' key walk the producer spilled)."""
    args = _ws_args(name_expr)
    return args[5] == "true" and ws_flags(name_expr)[1] and len(args) < 10


def causal_group(work_tiles, grid, n_bh, Lk, d, dv, itemsize):
    """The ``group`` argument of a causal persistent launch (Sm90WsScheduler): 0 (longest-first order) unless
    :data:`CAUSAL_PAIRS` and every block gets two work tiles or more (``work_tiles >= 2 * grid``: with fewer,
    a block's pair costs n_m + 1 key tiles where one tile per block costs at most n_m); else the batch
    entries per L2 group, as many as ``tiles.CAUSAL_GROUP_BYTES`` of K and V hold (at least 1, at most n_bh: the
    blocks running at once read about two groups, within an H100's / H200's 50 MB L2)."""
    if not CAUSAL_PAIRS or work_tiles < 2 * grid:
        return 0
    return min(n_bh, tiles.l2_group_entries(Lk, d, dv, itemsize))


def causal_pair_tiles(block, grid, n_m, n_bh, group):
    """Host mirror of Sm90WsScheduler (first, next, valid, decode) for a causal persistent launch with ``group``
    > 0: the (query tile, batch entry) work tiles of ``block`` of ``grid``, in its order."""
    out, w, k, pairs = [], 2 * block, 0, n_m >> 1
    while w < n_m * n_bh:
        u = w >> 1
        if u < pairs * n_bh:   # pair p of entry e: tiles n_m - 1 - p, then p
            g = u // (pairs * group)
            e0 = g * group
            in_g = min(group, n_bh - e0)
            r = u - g * pairs * group
            p = r // in_g
            out.append((p if w & 1 else n_m - 1 - p, e0 + r - p * in_g))
        else:                  # the middle tiles of an odd n_m
            out.append((pairs, w - 2 * pairs * n_bh))
        w, k = (w + 2 * grid - 1 if k & 1 else w + 1), k + 1
    return out


def persistent_grid(launcher, work_tiles):
    """Blocks of a persistent launch: min(work tiles, SMs), the SMs :data:`SM_COUNT` or the device's."""
    sms = SM_COUNT or getattr(launcher, "sm_count", None) or tiles.emulator_sm_count(launcher.arch)
    return max(1, min(work_tiles, int(sms)))


def _map_geometry(n_cols, rows, batch_strides, row_stride, itemsize, dims):
    """A rank-5 tensor map template over (head dim, rows, b2, b1, b0) and the broadcast bits of the
    batch dims (stride 0 with an extent above 1: the map gets extent 1, the kernel coordinate 0)."""
    nb0, nb1, nb2 = dims
    s_b0, s_b1, s_b2 = batch_strides
    extents, strides, bcast = [int(n_cols), int(rows)], [int(row_stride) * itemsize], 0
    for i, (n, s) in enumerate(((nb2, s_b2), (nb1, s_b1), (nb0, s_b0))):
        if s == 0:
            bcast |= (n > 1) << i
            n = 1
        extents.append(int(n))
        strides.append(int(s) * itemsize)
    # an extent-1 dimension is never stepped: any legal stride describes it
    strides = [s if n > 1 else 16 for n, s in zip(extents[1:], strides)]
    return extents, strides, bcast


def add_tma_launch(plan_launches, launcher, tile, name_expr, part, tensors, keys, Lq, Lk, D, Dv, scale_log2, grid_x,
                   ext_tail):
    """Record one launch of ``flash_fwd_sm90_ws_kernel`` for a :func:`launch.batch_layout` part: out and
    lse as :class:`launch.Ptr` slots, q, k, v as :class:`launch.Map` slots (the geometry and its checks
    made here, once; the address encoded per call), and the fourth map: out's (boxes of 64 columns x one
    consumer warpgroup's 64 rows) where :data:`USE_TMA_STORE` and :func:`out_tma_legal` allow the
    ``Is_tma_store`` instantiation, else q's again (unused: the kernel stores rows). ``ext_tail``: the
    FLASH_EXT_PARAMS arguments after the maps (a dense launch's zeros, or the extensions', whose per-call
    dropout seeds are :class:`launch.Val` slots)."""
    (qo, qs), (ko, ks), (vo, vs), (oo, os_), (lo, ls) = part.tensors[:5]
    row = [L.element_strides(a)[-2] for a in tensors[:4]]
    itemsize = np.dtype(tensors[0].dtype).itemsize
    store = USE_TMA_STORE and out_tma_legal(tensors[3]) is None
    maps, bcast = [], 0
    for t, (key, off, st, n_cols, rows, box_rows, r) in enumerate((
            (keys[0], qo, qs, D, Lq, tile.block_m, row[0]),
            (keys[1], ko, ks, D, Lk, tile.block_n, row[1]),
            (keys[2], vo, vs, Dv, Lk, tile.block_n, row[2]),
            (keys[3], oo, os_, Dv, Lq, WARPGROUP_ROWS, row[3]))[:4 if store else 3]):
        extents, strides, bits = _map_geometry(n_cols, rows, st, r, itemsize, part.dims)
        template = TiledTemplate(tensors[0].dtype, extents, strides, (_PANEL, box_rows, 1, 1, 1), swizzle=128)
        maps.append(L.Map(key, off, template))
        bcast |= bits << (3 * t)
    assert bcast >> 9 == 0, "out is never broadcast"
    if store:
        name_expr = with_tma_store(name_expr)
    else:
        maps.append(maps[0])
    gy, gz = part.grid_yz
    grid = (persistent_grid(launcher, grid_x * gy * gz), 1, 1) if tile.persistent else (grid_x, gy, gz)
    group = causal_group(grid_x * gy * gz, grid[0], gy * gz, Lk, tile.head_dim, tile.head_dim_v,
                         itemsize) if paired_causal(name_expr) else 0
    args = (L.Ptr(keys[3], oo), L.Ptr(keys[4], lo), L.c_int(Lq), L.c_int(Lk), L.c_int(Dv), L.c_int(part.dims[2]),
            *(L.c_longlong(s) for s in os_), L.c_longlong(row[3]), *(L.c_longlong(s) for s in ls),
            scale_log2, L.c_int(bcast), L.c_int(gy), L.c_int(gy * gz), L.c_int(group), *maps, *ext_tail)
    plan_launches.append(L.Recorded(launcher, tile.source, name_expr, grid, (tile.n_threads, 1, 1), args,
                                    shared_mem=tile.smem))
