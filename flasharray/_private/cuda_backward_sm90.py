"""Tiles of the Hopper backward on wgmma (``cuda_src/flash_bwd_sm90.cu``, issue 13; docs/hopper.md, "Backward").

The dK/dV kernel ``flash_bwd_sm90_dkv_kernel`` (always atomic dQ into the fragment-ordered
``DQAccumLayout`` accumulator, in key-block order when deterministic) as a family of
``cuda_backward.FAMILIES``: the preprocess and conversion passes are the tensor-core backward's.

``kernel=None`` on sm_90 takes it where it serves the call (``cuda_backward.auto_wgmma``, :func:`auto_ext`);
``kernel="wgmma"`` asks for it (the emulator: ``arch="sm_90"``). Where it cannot run,
:func:`backward_tile` raises NotImplementedError naming the reason: another arch, another dtype,
head dims above 256, ``dq="recompute"``; and the plan where the extensions cannot run: the sets whose
instantiations spill (:data:`EXT_SPILLS`, :func:`ext_refusal`), head dims padded differently (D and Dv) or (the
cp.async kernel) above 128.
Extensions (docs/hopper.md, "Backward with extensions"): both kernels, their ``kExt`` appended last to the names.

Both atomic dQ modes (plain, ``deterministic=False``, and ordered, the deterministic default) take the
warp-specialized kernel ``flash_bwd_sm90_ws_kernel``
where q, dout, k, v fit tensor maps (:func:`tma_args`: 16-byte aligned rows, strides multiples of 16 bytes,
at most three batch dims of extent above 1 per map, the group walked in the block counted): a producer
warpgroup (``setmaxnreg`` 24) issuing TMA boxes of Q_i, dO_i into a two-stage ring on mbarriers (K_j, V_j
once) and loading L_i, D_i, two consumer warpgroups (``setmaxnreg`` 240), 384 threads; its four maps are
``launch.Map`` arguments encoded per call; in the ordered mode its consumers take their turns with the group
semaphore ``fa::sem_wait_group`` / ``fa::sem_post_group`` (the producer never waits). Otherwise (other
layouts, :data:`USE_TMA` off) the cp.async kernel.

Tile: Br = 64 queries per visit (the N of S^T, dP^T and dQ^T), Bc = 128 keys (two warpgroups of 64
keys, 256 threads); head dims padded to 64 or 128 (whole 128-byte swizzle panels; the N of the dK /
dV wgmma). Registers per thread: dK_j, dV_j (d/2 + dv/2), S^T, dP^T (Br/2 each), their rounded A
fragments, dQ^T (Br/2). Shared memory: K_j, V_j, two stages of Q_i and dO_i, dS^T (Bc x Br), L_i and
D_i per stage, plus 1 KB to align the dynamic base on the swizzle repeat (GPU).

D or Dv above 128 (:func:`is_split`, the head-dim split): Bc = 64 keys, both warpgroups computing S^T and
dP^T for all of them (the same values: that work is done twice), warpgroup w owning head dims
[w·d/2, (w + 1)·d/2) of dK_j and dQ^T and [w·dv/2, ..) of dV_j; d, dv padded to 256, the other one to at
least 128 (:func:`pad_head_dims`: each half whole 64-column panels). Registers: d/4 + dv/4 accumulators,
those of d = dv = 128 above. Both kernels, both dQ modes, every layout the d <= 128 kernels take.
"""
from . import launch
from . import tiles
from .cuda_forward_sm90 import check_arch_and_dtype
from .tiles_bwd import BwdTiles

SOURCE = "flash_bwd_sm90.cu"
KERNEL = "flash_bwd_sm90_dkv_kernel"
FAMILY = "wgmma"
ARCH = 90
BLOCK_M = 64
BLOCK_N = 128
#: Bc of the head-dim split (D or Dv above 128): both warpgroups see the 64 keys, each owns half the head dims.
BLOCK_N_SPLIT = 64
STAGES = 2
MAX_HEAD_DIM = 256
#: Above this padded head dim (D or Dv) the kernels take the head-dim split (``Sm90BwdTraits::kSplitD``).
SPLIT_ABOVE = 128
#: Whether ``kernel=None`` on sm_90 (``cuda_backward.auto_wgmma``) takes this backward for calls with extensions too,
#: where its warp-specialized kernel runs the call's bits (:func:`auto_ext`; a plan whose layout then takes the cp.async
#: kernel, which refuses them, is made with the mma.sync backward instead). On since 2026-11-27 (fifteenth session): on an
#: H200 ``tests/test_cuda_backward_sm90_extensions.py::test_extension_gpu`` passed (18 cases) and the wgmma backward
#: ran 1.5-2.0x the mma.sync one with dropout, 1.3-1.4x with a window (``hopper_variants.py --only ext``,
#: docs/gpu_h200.md); the other extension calls keep the mma.sync backward (kernel "tc").
AUTO_EXT = True
#: kExt bits (``cuda_forward.EXT_BITS``: window 1, ALiBi 2, softcap 4, block mask 8, dropout 16, lengths 32) the
#: ordered dQ mode takes: every one (the "tc" kernel's set). Query block i's visitors are one run of key blocks
#: n_lo(i) .. n_max(i), whose turns the ordered counters count (a window's n_lo(i) is its left edge's key block:
#: ``DQOrder::turn`` with the mask); a block mask's holes take no turn (``dq_turn``: the counters then hold ranks,
#: each block waiting for its previous visitor; the forty-third session).
ORDERED_EXT = 1 | 2 | 4 | 8 | 16 | 32
_ALIGN = 1024

# wgmma needs the arch-specific target: the CuPy path compiles this source for sm_90a (as the forward).
launch.ARCH_SPECIFIC.setdefault(SOURCE, {ARCH: "sm_90a"})


def pad_head_dim(n):
    """64, 128 or 256: the smallest that holds ``n`` (1..256)."""
    return 64 if n <= 64 else 128 if n <= 128 else 256


def pad_head_dims(D, Dv):
    """The kernels' (d, dv): each padded by :func:`pad_head_dim`; with either above 128 (the head-dim split)
    both at least 128, so that each warpgroup's half of d and of dv is whole 64-column panels."""
    d, dv = pad_head_dim(D), pad_head_dim(Dv)
    if max(d, dv) > SPLIT_ABOVE:
        d, dv = max(d, SPLIT_ABOVE), max(dv, SPLIT_ABOVE)
    return d, dv


def is_split(D, Dv):
    """Whether (D, Dv) takes the head-dim split (Bc = 64, each warpgroup half the head dims)."""
    return max(pad_head_dims(D, Dv)) > SPLIT_ABOVE


def _tiles_bytes(d, dv, block_m, block_n):
    """K_j, V_j, the stages of Q_i, dO_i, dS^T, the stages' L_i and D_i, and the alignment slack."""
    return 2 * (block_n * (d + dv) + STAGES * block_m * (d + dv) + block_n * block_m) + STAGES * 2 * block_m * 4 + _ALIGN


def smem_bytes(d, dv, block_m=BLOCK_M, block_n=BLOCK_N):
    """Mirror of ``Sm90BwdTraits::kSmemBytes``: the tiles and, in the head-dim split, dk's and dv's batch
    offsets for the epilogue (2 x 8 bytes)."""
    return _tiles_bytes(d, dv, block_m, block_n) + (2 * 8 if max(d, dv) > SPLIT_ABOVE else 0)


def _unsupported(why):
    return NotImplementedError("flasharray: kernel='wgmma' (the Hopper backward, cuda_src/%s) %s" % (SOURCE, why))


def backward_tile(precision, dtype, D, Dv, arch, *, ext=False):
    """The :class:`BwdTiles` of the wgmma dK/dV kernel; NotImplementedError where it cannot run
    (only asked for with ``kernel="wgmma"``: ``cuda_backward.family_tile`` never offers it)."""
    a = check_arch_and_dtype(arch, dtype, _unsupported)
    if precision not in (None, "ieee"):
        raise _unsupported("takes no precision option, got %r" % (precision,))
    Dv = D if Dv is None else Dv
    if not (1 <= D <= MAX_HEAD_DIM and 1 <= Dv <= MAX_HEAD_DIM):
        raise _unsupported("supports head dims 1..%d, got D=%d, Dv=%d" % (MAX_HEAD_DIM, D, Dv))
    d, dv = pad_head_dims(D, Dv)
    split = is_split(D, Dv)
    block_n = BLOCK_N_SPLIT if split else BLOCK_N
    smem = smem_bytes(d, dv, BLOCK_M, block_n)
    assert smem <= tiles.smem_limit(a) and ws_smem_bytes(d, dv, BLOCK_M, block_n) <= tiles.smem_limit(a), (d, dv, smem)
    reason = ("Br=%d (N of S^T, dP^T, dQ^T), Bc=%d (%s), d=%d dv=%d, 2-stage Q_i/dO_i (cp.async), 128B-swizzled"
              % (BLOCK_M, block_n, "head-dim split: 2 warpgroups x half of d, dv" if split
                 else "2 warpgroups x 64 keys", d, dv))
    return BwdTiles(BLOCK_M, block_n, 256, smem, reason, STAGES)


def dkv_name(tile, precision, pD, pDv, causal, vec, ordered, ext=0, dtype=None, out=None):
    """Name expression of the wgmma dK/dV kernel: ``dtype`` / ``out`` the element and output C types
    (``out`` AccT for partial sums), ``pD`` the head dim padded to 16 (the accumulator's, kDQDim), ``ext`` the
    kExt bits (a trailing template argument only when not 0: the dense names are unchanged)."""
    b = lambda x: "true" if x else "false"  # noqa: E731
    return "%s<%s, %s, %d, %d, %d, %d, %d, %s, %s, %s%s>" % (
        KERNEL, dtype, out or dtype, *pad_head_dims(pD, pDv), pD, tile.block_m, tile.block_n,
        b(causal), b(vec), b(ordered), ", %d" % ext if ext else "")


#: Extension subsets whose instantiations spill on sm_90a (registers at the ceiling: the consumers' 240 in the ws
#: kernel, 255 in the cp.async one; audited for every subset, fp16 and bf16, causal and not, both dQ modes —
#: tests/test_cuda_backward_sm90_extensions.py's static checks): per (kernel, padded head dim) the minimal kExt
#: subsets refused; a call whose bits contain one raises NotImplementedError naming it (docs/hopper.md, "Backward
#: with extensions").
#: Head dim 64: the ws kernel runs all 63 sets, the cp.async kernel all without softcap + dropout together. Head
#: dim 128 (the dense loops already at 235 of 240 / 251 of 255 registers): the ws kernel takes subsets of window,
#: ALiBi, block mask, lengths but ALiBi + block mask + lengths, the cp.async kernel the window alone. Head dim 256
#: (the ws kernel only: the head-dim split, S^T and dP^T in both consumer warpgroups, dQ by the consumers' atomics):
#: every set without dropout; of the 192 instantiations with dropout 116 spill (4-88 bytes, no pattern in the other
#: bits: 16 alone spills, 16 + window does not), so dropout is refused (forty-second session's audit, fp16 and bf16).
#: Mixed head dims (padded 256 / 128 and 128 / 256; keyed (kind, d, dv)), the head-dim split too: every set, but one
#: instantiation each (:data:`EXT_SPILLS_ONE`). Below the split, mixed 64 / 128 tiles are not audited (refused).
EXT_SPILLS = {("ws", 64): (), ("ws", 128): (4, 16, 2 | 8 | 32), ("ws", 256): (16,),
              ("ws", 256, 128): (), ("ws", 128, 256): (),
              ("cp.async", 64): (4 | 16,), ("cp.async", 128): (2, 4, 8, 16, 32)}
#: The ws kernel's refused subsets with the bulk dQ (:func:`ws_dq_bulk`: the consumers store dQ^T to shared memory
#: instead of holding the atomics' addresses): none. Softcap, dropout and ALiBi + block mask + lengths, refused with
#: the atomics, compile clean (thirty-sixth session's audit); dropout with a window or with lengths since the
#: thirty-eighth (the consumers' zeroing of queries past the entry's length derives its addresses per visit, and with
#: a window the keep bits of a visit are packed into one word: ``KeepBits``).
EXT_SPILLS_BULK = {("ws", 64): (), ("ws", 128): ()}
#: Single instantiations of the ws kernel with the bulk dQ that spill, refused by exact kExt bits, causal flag and dQ
#: mode (``ordered``): at head dim 128 dropout + ALiBi alone, causal, plain atomics (48 bytes: ptxas computes the
#: Philox bits while S^T is in flight). Its ordered (deterministic) and non-causal instantiations and every superset
#: (the other 15 sets with dropout and ALiBi, either mode) compile clean (thirty-ninth session's audit, fp16 and bf16).
#: Since the block mask's lookups divide by FastDiv (flash_mask.cuh, forty-eighth session: two registers more in the
#: Mask) four sets of a block mask with dropout spill 8-52 bytes with the atomics, and with the ordered dQ (the dQ
#: warp's turns past the mask's holes, producer warpgroup at 32 registers and consumers at 232: ``kMaskTurns``,
#: :func:`ws_regs`) nine sets of a block mask with dropout or ALiBi spill 8-20 bytes (forty-ninth session's audit of
#: every block-mask instantiation, fp16 and bf16; the other 110 of 128 ordered ones at d 128 and all 128 at d 64 clean).
EXT_SPILLS_BULK_ONE = {("ws", 128): ((16 | 2, True, False),
                                     (2 | 8 | 16, False, False), (2 | 8 | 16 | 32, False, False),
                                     (8 | 16 | 32, True, False), (1 | 2 | 8 | 16 | 32, True, False),
                                     (2 | 8, False, True), (8 | 16, False, True), (2 | 8 | 16, False, True),
                                     (8 | 16 | 32, False, True), (2 | 8 | 16 | 32, False, True),
                                     (8 | 16, True, True), (2 | 8 | 16, True, True),
                                     (8 | 16 | 32, True, True), (2 | 8 | 16 | 32, True, True))}
#: ... and of the ws kernel with the consumers' atomics (the head-dim split's extension calls): at padded head dims
#: 256 / 128 and 128 / 256, dropout + ALiBi alone, not causal, plain atomics (4 bytes; fp16 and bf16, D 256 / 128
#: and 128 / 256; the other 374 instantiations of each pair compile clean, and D 192 / 128's 188 fp16 ones all do:
#: forty-second session's audit). Since FastDiv (forty-ninth session's audit of every block-mask instantiation, fp16
#: and bf16): at head dim 256 ALiBi + block mask, causal, plain atomics, and block mask + lengths with or without
#: ALiBi in the ordered mode (4-8 bytes); at 128 / 256 ALiBi + block mask + dropout, not causal, ordered.
EXT_SPILLS_ONE = {("ws", 256, 128): ((16 | 2, False, False),),
                  ("ws", 128, 256): ((16 | 2, False, False), (2 | 8 | 16, False, True)),
                  ("ws", 256): ((2 | 8, True, False), (8 | 32, False, True), (2 | 8 | 32, False, True),
                                (8 | 32, True, True), (2 | 8 | 32, True, True))}


def _bit_names(bits):
    from .cuda_forward import EXT_BITS
    return "+".join(n for n, b in EXT_BITS.items() if bits & b)


def auto_ext(ext, D, Dv, deterministic):
    """Whether ``kernel=None`` may take this backward for a call with the kExt bits ``ext``: :data:`AUTO_EXT`, the
    dQ mode takes them (:data:`ORDERED_EXT` when deterministic) and the warp-specialized kernel does not refuse them
    (:func:`ext_refusal`; which kernel runs depends on the layout, known only while planning: where the cp.async kernel
    runs instead and refuses them, ``cuda_backward.plan`` falls back to the mma.sync backward)."""
    return AUTO_EXT and not (deterministic and ext & ~ORDERED_EXT) and ext_refusal(ext, D, Dv, USE_TMA) is None


def ext_refusal(ext, D, Dv, ws, causal=None, ordered=None):
    """None where the wgmma kernel (``ws``: the warp-specialized one, else the cp.async one) runs the kExt bits
    ``ext`` for head dims D, Dv without spilling; else why not (the text of the NotImplementedError). ``causal`` and
    ``ordered`` (the dQ mode) name the instantiation where known (:data:`EXT_SPILLS_BULK_ONE`, :data:`EXT_SPILLS_ONE`);
    None (kernel=None's choice, before the plan knows them) refuses only what every instantiation of the set
    refuses."""
    if not ext:
        return None
    d, dv = pad_head_dims(D, Dv)
    split = max(d, dv) > SPLIT_ABOVE
    if split and not ws:
        return ("runs extensions at head dims above %d on its warp-specialized TMA kernel only (got D=%d, Dv=%d; the "
                "cp.async kernel's head-dim split is not audited for them)" % (SPLIT_ABOVE, D, Dv))
    if d != dv and not split:
        return ("runs extensions with D and Dv padded alike, or in the head-dim split, only (got D=%d, Dv=%d: mixed "
                "64 / 128 tiles are not audited for them)" % (D, Dv))
    kind = "ws" if ws else "cp.async"
    key, dims = ((kind, d), "%d" % d) if d == dv else ((kind, d, dv), "%d / %d" % (d, dv))
    bulk = ws and ws_dq_bulk(D, Dv, ext)
    for m in (EXT_SPILLS_BULK if bulk else EXT_SPILLS)[key]:
        if ext & m == m:
            return ("does not run %s together at head dim %s on its %s kernel (the instantiation spills registers; "
                    "this call: %s)" % (_bit_names(m), dims, "warp-specialized TMA" if ws else "cp.async",
                                         _bit_names(ext)))
    if (ext, causal, ordered) in (EXT_SPILLS_BULK_ONE if bulk else EXT_SPILLS_ONE).get(key, ()):
        return ("does not run %s alone%s with deterministic=%s at head dim %s on its warp-specialized TMA kernel "
                "(the instantiation spills registers)" % (_bit_names(ext), ", causal," if causal else "", ordered, dims))
    return None


# ---- the TMA / warp-specialized instantiation (flash_bwd_sm90_ws_kernel) ---------------------------------

#: Whether ``kernel="wgmma"`` takes the warp-specialized TMA kernel where it applies (tests turn it off to
#: run the cp.async kernel on the same inputs).
USE_TMA = True
#: Whether the warp-specialized kernel writes its 16-bit dK, dV by TMA stores (``Is_tma_store``; tests turn it
#: off to run the 16-byte-store epilogue on the same inputs).
USE_TMA_STORE = True
#: Whether the warp-specialized kernel adds dQ FlashAttention-3's way (``Is_dq_bulk``, d and dv <= 128): the
#: consumers store each visit's dQ tile to shared memory and a dQ warp of the producer warpgroup adds it to the
#: accumulator with one bulk reduce-add (``cp.reduce.async.bulk ... add.f32``), taking the ordered mode's turn
#: itself; off: the consumers' per-thread atomics (tests turn it off to compare, a GPU run to time both).
DQ_BULK = True
#: Whether calls with extensions (window, ALiBi, softcap, block mask, dropout, lengths; d and dv <= 128) take the bulk
#: dQ too (:data:`DQ_BULK` on): the dQ warp then walks the consumers' visited query blocks (block-mask tiles skipped)
#: and takes the ordered mode's turn with the mask (a window's first visitor); off: the consumers' atomics, as before
#: the thirty-sixth session. A ``hopper_variants.py`` switch (``bwd.DQ_BULK_EXT``), not yet timed on a GPU.
DQ_BULK_EXT = True
#: Whether the warp-specialized kernel at padded d = dv = 64 (dense calls) keeps its warpgroup's rows of K_j and V_j
#: in registers as the A operand of S^T = K_j Q_i^T and dP^T = V_j dO_i^T (RS wgmma, ``kKVRegsOn``; off: both
#: read from shared memory per wgmma, SS). Twenty-second session; a ``hopper_variants.py`` switch
#: (``bwd.KV_REGS``), not yet timed on a GPU.
KV_REGS = True
#: Whether the warp-specialized kernel's dQ query split (padded d = 64, Bc = 128, dense calls; :func:`dq_split`) keeps
#: K_j^T, all 128 keys x 64 head dims, in registers as the A operand of dQ^T = K_j^T dS^T (RS wgmma, ``kKtRegsOn``;
#: 32 registers loaded once per block; off: K_j's panel read from shared memory per wgmma in both warpgroups, SS).
#: Thirty-third session; a ``hopper_variants.py`` switch (``bwd.KT_REGS``), not yet timed on a GPU.
KT_REGS = True
#: Whether the warp-specialized kernel's dQ query split (padded d = 64, dense calls, bulk dQ; :func:`scores_ahead`)
#: issues each visit's S^T behind the previous visit's dQ^T batch (``kScoresAheadOn``): the tensor cores compute S^T
#: while the consumers store dQ^T for the dQ warp, where the default waits for dQ^T, stores it, and only then issues
#: the next S^T. Its visit takes FlashAttention-3's order (P^T rounded after the dS^T math, dV's batch issued with dK's,
#: not behind dP^T's), which frees the registers the in-flight S^T and dQ^T need. Thirty-fourth session, off by
#: default: a ``hopper_variants.py`` switch (``bwd.SCORES_AHEAD``).
SCORES_AHEAD = False
#: The most dQ buffers of the warp-specialized kernel's bulk dQ (below the head-dim split; ``kDQBufsMax``, as many as
#: fit in the opt-in maximum: :func:`dq_buffers`). The consumers run up to that many visits minus one ahead of the dQ
#: warp, which in the ordered mode waits for each query block's turn: 4 (d = 64 only: 32 KB more shared memory, 165 /
#: 197 KB at dv 64 / 128; d = 128 has room for two) lets them absorb turns late by up to three visits instead of one.
#: Thirty-fourth session; 2 by default, a ``hopper_variants.py`` switch (``bwd.DQ_BUFFERS``, flipped to 4).
DQ_BUFFERS = 2
#: Whether the warp-specialized kernel's query split at padded d = 256 (dense calls; :func:`split_overlap`) overlaps
#: more of its visit (``kSplitOverlapOn``): dP^T issued right behind S^T, computing under the softmax of P^T, and the
#: two dQ^T batches issued behind the dV_j, dK_j batch before the wait for it; off: dP^T issued after P^T is staged,
#: and the dQ^T batches after that wait. Same bits. Thirty-fifth session, off by default: a ``hopper_variants.py``
#: switch (``bwd.SPLIT_OVERLAP``).
SPLIT_OVERLAP = False
#: Whether the warp-specialized kernel's head-dim split (D or Dv above 128, dense calls) splits S^T, dP^T over the
#: two consumer warpgroups by queries (``kQSplitOn``: each computes them for 32 of the visit's 64 queries and stages
#: P^T and dS^T for the other's k16 steps of dV_j, dK_j) instead of computing all of them in both (40 % more tensor
#: work than the visit needs). Twenty-fourth session; a ``hopper_variants.py`` switch (``bwd.QUERY_SPLIT``).
QUERY_SPLIT = True
#: Whether the warp-specialized kernel's ordered dQ mode takes its blocks entries first (``kEntriesFirstOn``: the
#: blocks running at once are the first key blocks of many batch entries, so the chains of dQ turns between them
#: stay within an entry; off: the grid's x first, one entry's key blocks, up to a wave of 132 chained). Twenty-fourth
#: session; a ``hopper_variants.py`` switch (``bwd.ENTRIES_FIRST``).
ENTRIES_FIRST = True
#: Whether the warp-specialized kernel at padded d = 64 (and dv 64 or 128; Bc = 128: two warpgroups of keys) splits
#: dQ^T = K_j^T dS^T between its consumer warpgroups by queries (``kDQSplitOn``: each N = 32 of the visit's 64, dS^T
#: staged as two 64B-swizzled half tiles); off: warpgroup 0 computes all of it (one m64 block of head-dim rows), 8
#: wgmmas per visit more than warpgroup 1. Thirtieth session; a ``hopper_variants.py`` switch (``bwd.DQ_SPLIT``).
DQ_SPLIT = True
WS_KERNEL = "flash_bwd_sm90_ws_kernel"
PRODUCER_REGS, CONSUMER_REGS = 24, 240   # flash::kWsProducerRegs / kWsConsumerRegs (flash_sm90_common.cuh)
PRODUCER_REGS_SPLIT, CONSUMER_REGS_SPLIT = 32, 232   # ... in the head-dim split (Sm90BwdWsTraits)


def ws_regs(d, dv, mask_turns=False):
    """``kProducerRegs, kConsumerRegs`` (setmaxnreg) of the ws kernel for padded head dims d, dv: 32 / 232 in the
    head-dim split (``Sm90BwdWsTraits``: the staged bulk dQ's producer warpgroup holds the dQ warp beside the loader;
    with the atomics the loader alone spilled 4 bytes at 24 in the causal kernels) and where the dQ warp takes the
    ordered mode's turns past a block mask's holes (``mask_turns``: the kernel's ``kMaskTurns``, bulk dQ, ordered,
    kExt with the block mask; at 24 it spilled 4 bytes, forty-eighth session), else 24 / 240."""
    split = is_split(d, dv) or mask_turns
    return (PRODUCER_REGS_SPLIT, CONSUMER_REGS_SPLIT) if split else (PRODUCER_REGS, CONSUMER_REGS)
_PANEL = 64             # elements of one 128-byte swizzle panel: the inner box
_MAX_STRIDE = 2 ** 40   # bytes: cuTensorMapEncodeTiled's bound on a global stride
_SEL_NONE, _SEL_GROUP, _SEL_B2, _SEL_B1, _SEL_B0 = range(5)  # the kernel's tma_sel codes


#: ``Sm90BwdWsTraits::kTurnBytes``: the ordered dQ mode's counter base and the dQ warp's turn arguments.
TURN_BYTES = 24


def ws_smem_bytes(d, dv, block_m=BLOCK_M, block_n=BLOCK_N, bulk=None):
    """Mirror of ``Sm90BwdWsTraits::kSmemBytes``: the cp.async layout with dS^T per stage, then the
    1 + 2 x STAGES mbarriers (8 bytes each), the ordered mode's counter base and turn (a pointer and three ints: DQOrder's
    key block, Tc, Lk - Lq; 24 bytes) and, in the
    head-dim split (d or dv above 128), P^T per stage (:data:`QUERY_SPLIT`'s; reserved either way) and the batch
    offsets of dq_accum, dk and dv (3 x 8 bytes); with the bulk
    dQ (``bulk``, default :func:`dq_bulk`) :func:`dq_buffers` fp32 tiles of Br x d and two mbarriers each (in the
    split, staged: one mbarrier per stage, no buffer)."""
    split = max(d, dv) > SPLIT_ABOVE
    staged = split and (dq_bulk(d, dv) if bulk is None else bulk)
    base = (_tiles_bytes(d, dv, block_m, block_n) + 2 * block_n * block_m * (STAGES - 1) + 8 * (1 + 2 * STAGES)
            + TURN_BYTES + (3 * 8 + 2 * block_n * block_m * STAGES if split else 0) + (8 * STAGES if staged else 0))
    n = dq_buffers(d, dv, block_m, block_n, bulk)
    return base + n * (block_m * d * 4 + 16) + (8 if n else 0)   # (+ dq_accum's batch offset)


def dq_bulk(d, dv, dq_dim=None):
    """Whether the ws kernel for padded head dims d, dv takes the bulk dQ (``Is_dq_bulk``): :data:`DQ_BULK`, and
    no head-dim split (the dQ warp) or d = dv = 256 with the accumulator's head dim ``dq_dim`` (D padded to 16;
    None: d) 256 (the consumers' staged bulk adds, ``kDQStaged``)."""
    return DQ_BULK and (max(d, dv) <= SPLIT_ABOVE or d == dv == (dq_dim or d) == 256)


def ws_dq_bulk(D, Dv, ext=0):
    """Whether the ws kernel for head dims D, Dv (unpadded; D padded to 16 is the accumulator's) and the kExt bits
    ``ext`` takes the bulk dQ (``Is_dq_bulk``): :func:`dq_bulk`, and with extensions :data:`DQ_BULK_EXT` below the
    head-dim split (in it, extension calls take the consumers' atomics: the staged dQ rides the query split, which
    they do not take)."""
    d, dv = pad_head_dims(D, Dv)
    return dq_bulk(d, dv, -(-D // 16) * 16) and (not ext or (DQ_BULK_EXT and not is_split(D, Dv)))


def dq_buffers(d, dv, block_m=BLOCK_M, block_n=BLOCK_N, bulk=None):
    """``Sm90BwdWsTraits::kDQBufs``: the most of :data:`DQ_BUFFERS` (the kernel's kDQBufsMax), 2, 1 dQ buffers that
    fit in the opt-in maximum (0: atomics, or the head-dim split's staged dQ)."""
    if not (dq_bulk(d, dv) if bulk is None else bulk) or max(d, dv) > SPLIT_ABOVE:   # (split: staged, no buffer)
        return 0
    base = (_tiles_bytes(d, dv, block_m, block_n) + 2 * block_n * block_m * (STAGES - 1) + 8 * (1 + 2 * STAGES)
            + TURN_BYTES + 8)
    fit = (tiles.smem_limit(ARCH) - base) // (block_m * d * 4 + 16)
    return DQ_BUFFERS if fit >= DQ_BUFFERS else 2 if fit >= 2 else 1


def ws_tile(tile, D, Dv, ext=0):
    """The :class:`BwdTiles` of ``flash_bwd_sm90_ws_kernel`` for the cp.async kernel's ``tile`` (head dims
    D, Dv; ``ext`` the kExt bits: :func:`ws_dq_bulk`): one more (producer) warpgroup, dS^T double-buffered, the
    mbarriers, the bulk dQ's buffers."""
    import dataclasses
    d, dv = pad_head_dims(D, Dv)
    bulk = ws_dq_bulk(D, Dv, ext)
    p_regs, c_regs = ws_regs(d, dv)
    reason = ("Br=%d, Bc=%d (producer warpgroup: TMA, setmaxnreg %d; 2 consumer warpgroups x %s, setmaxnreg "
              "%d), d=%d dv=%d, %d-stage Q_i/dO_i ring on mbarriers, 128B-swizzled"
              % (tile.block_m, tile.block_n, p_regs, "half of d, dv" if is_split(D, Dv) else "64 keys",
                 c_regs, d, dv, STAGES))
    return dataclasses.replace(tile, n_threads=tile.n_threads + 128,
                               smem=ws_smem_bytes(d, dv, tile.block_m, tile.block_n, bulk), reason=reason)


def ws_name(tile, pD, pDv, causal, dtype, out=None, ordered=False, ext=0):
    """Name expression of the warp-specialized dK/dV kernel (``ordered``: key-block-ordered dQ atomics; its last
    flags, ``Is_tma_store``: dK, dV written by TMA stores — :data:`USE_TMA_STORE` and 16-bit outputs — and
    ``Is_dq_bulk``: :func:`ws_dq_bulk`; ``ext``: the kExt bits, appended only when not 0)."""
    b = lambda x: "true" if x else "false"  # noqa: E731
    # the trailing template arguments (kExt, kKVRegsOn, kQSplitOn, kEntriesFirstOn, kDQSplitOn, kKtRegsOn,
    # kScoresAheadOn, kDQBufsMax, kSplitOverlapOn), named up to the last one that differs from its default and
    # changes the code
    ahead = not ext and scores_ahead(pD, pDv)
    d, dv = pad_head_dims(pD, pDv)
    bulk = ws_dq_bulk(pD, pDv, ext)
    bufs = dq_buffers(d, dv, tile.block_m, tile.block_n, bulk)
    opt = [str(ext), b(not (not KV_REGS and kv_regs(pD, pDv, ext))),
           b(not (not QUERY_SPLIT and not ext and is_split(pD, pDv))), b(ENTRIES_FIRST or not ordered),
           b(DQ_SPLIT or not dq_split(pD, pDv)),
           b(KT_REGS or not (DQ_SPLIT and not ext and dq_split(pD, pDv))), b(ahead),
           str(max(bufs, 2)), b(not ext and split_overlap(pD, pDv))]
    while opt and opt[-1] == _WS_DEFAULTS[len(opt) - 1]:
        opt.pop()
    tail = "".join(", " + a for a in opt)
    return "%s<%s, %s, %d, %d, %d, %d, %d, %s, %s, %s, %s%s>" % (
        WS_KERNEL, dtype, out or dtype, *pad_head_dims(pD, pDv), pD, tile.block_m, tile.block_n,
        b(causal), b(ordered), b(_stores_by_tma(dtype, out)), b(bulk), tail)


# kExt, kKVRegsOn, kQSplitOn, kEntriesFirstOn, kDQSplitOn, kKtRegsOn, kScoresAheadOn, kDQBufsMax, kSplitOverlapOn
_WS_DEFAULTS = ["0", "true", "true", "true", "true", "true", "false", "2", "false"]


def _ws_args(name_expr):
    """A ws kernel name's template arguments, the unnamed trailing ones (kExt, kKVRegsOn, kQSplitOn,
    kEntriesFirstOn, kDQSplitOn, kKtRegsOn, kScoresAheadOn, kDQBufsMax, kSplitOverlapOn) at their defaults."""
    args = name_expr[name_expr.index("<") + 1:-1].split(", ")
    return args + _WS_DEFAULTS[len(args) - 11:]


def ws_kv_regs(name_expr):
    """Whether a ws kernel instantiation (its name) holds K_j, V_j in registers (``kKVRegs``): padded d = dv = 64,
    kExt = 0 and ``kKVRegsOn`` (the thirteenth template argument)."""
    args = _ws_args(name_expr)
    return kv_regs(int(args[2]), int(args[3]), int(args[11])) and args[12] == "true"


def ws_kt_regs(name_expr):
    """Whether a ws kernel instantiation (its name) holds K_j^T in registers for dQ^T (``kKtRegs``): the dQ query
    split (:func:`ws_dq_split`), kExt = 0 and ``kKtRegsOn`` (the seventeenth template argument)."""
    args = _ws_args(name_expr)
    return ws_dq_split(name_expr) and args[11] == "0" and args[16] == "true"


def ws_scores_ahead(name_expr):
    """Whether a ws kernel instantiation (its name) issues S^T behind the previous visit's dQ^T (``kScoresAhead``):
    the dQ query split (:func:`ws_dq_split`) with the bulk dQ, kExt = 0 and ``kScoresAheadOn`` (the eighteenth template
    argument)."""
    args = _ws_args(name_expr)
    return ws_dq_split(name_expr) and args[10] == "true" and args[11] == "0" and args[17] == "true"


def ws_query_split(name_expr):
    """Whether a ws kernel instantiation (its name) takes the query split (``kQSplit``): the head-dim split, kExt = 0
    and ``kQSplitOn`` (the fourteenth template argument)."""
    args = _ws_args(name_expr)
    return args[11] == "0" and is_split(int(args[2]), int(args[3])) and args[13] == "true"


def ws_split_overlap(name_expr):
    """Whether a ws kernel instantiation (its name) overlaps the query split's visit (``kSplitOverlap``): the query
    split (:func:`ws_query_split`) at padded d = 256 and ``kSplitOverlapOn`` (the twentieth template argument)."""
    args = _ws_args(name_expr)
    return ws_query_split(name_expr) and int(args[2]) == 256 and args[19] == "true"


def ws_entries_first(name_expr):
    """Whether a ws kernel instantiation (its name) takes its blocks entries first (``kEntriesFirst``): the ordered
    dQ mode (the ninth template argument) and ``kEntriesFirstOn`` (the fifteenth)."""
    args = _ws_args(name_expr)
    return args[8] == "true" and args[14] == "true"


def ws_dq_split(name_expr):
    """Whether a ws kernel instantiation (its name) splits dQ^T by queries (``kDQSplitQ``): padded d = 64 without the
    head-dim split (:func:`dq_split`) and ``kDQSplitOn`` (the sixteenth template argument)."""
    args = _ws_args(name_expr)
    return dq_split(int(args[2]), int(args[3])) and args[15] == "true"


def dq_split(D, Dv):
    """Whether the ws kernel for head dims D, Dv splits dQ^T by queries where :data:`DQ_SPLIT` (``kDQSplitQ``:
    padded d = 64, dv 64 or 128 — Bc = 128, two warpgroups of keys)."""
    return not is_split(D, Dv) and pad_head_dims(D, Dv)[0] == 64


def scores_ahead(D, Dv):
    """Whether the ws kernel for head dims D, Dv (a dense call) issues S^T behind the previous visit's dQ^T
    (``kScoresAheadOn``): :data:`SCORES_AHEAD`, the dQ query split (:data:`DQ_SPLIT`, :func:`dq_split`) and the bulk
    dQ (:func:`dq_bulk`)."""
    return SCORES_AHEAD and DQ_SPLIT and dq_split(D, Dv) and dq_bulk(*pad_head_dims(D, Dv))


def split_overlap(D, Dv):
    """Whether the ws kernel for head dims D, Dv (a dense call) overlaps the query split's visit
    (``kSplitOverlapOn``): :data:`SPLIT_OVERLAP`, the query split (:data:`QUERY_SPLIT`, the head-dim split) and padded
    d = 256 (two m64 blocks of dQ^T per warpgroup)."""
    return SPLIT_OVERLAP and QUERY_SPLIT and is_split(D, Dv) and pad_head_dims(D, Dv)[0] == 256


def kv_regs(D, Dv, ext=0):
    """Whether the ws kernel for head dims D, Dv holds K_j, V_j in registers where :data:`KV_REGS` (its
    ``kKVRegs``: padded d = dv = 64, no extensions)."""
    return not ext and pad_head_dims(D, Dv) == (64, 64)


def _stores_by_tma(dtype, out):
    """Whether the ws kernel named for element type ``dtype`` and output type ``out`` (C types or NumPy dtypes;
    None: ``dtype``) writes dK, dV by TMA stores: :data:`USE_TMA_STORE` and 16-bit outputs (the fp32 partial
    sums of K/V broadcast over the grid keep the fragment stores)."""
    return USE_TMA_STORE and (out is None or out == dtype)


def _map_dims(batch, itemsize):
    """The three batch dims of a map: ``batch`` ``[(sel code, extent, element stride), ...]``; those of
    extent above 1 and stride not 0 (a broadcast dim is extent 1: coordinate 0), padded with extent-1
    dims. Returns ``(extents, byte strides, sel codes)`` or None when more than three remain or a stride
    is not TMA-legal."""
    kept = [(code, n, st) for code, n, st in batch if n > 1 and st != 0]
    if len(kept) > 3 or any(st < 0 or st * itemsize % 16 or st * itemsize >= _MAX_STRIDE for _, n, st in kept):
        return None
    kept += [(_SEL_NONE, 1, 0)] * (3 - len(kept))
    return [n for _, n, _ in kept], [st * itemsize if n > 1 else 16 for _, n, st in kept], [c for c, _, _ in kept]


def _tile_map(t, name, box_rows, batch, itemsize, off, dtype):
    """``(launch.Map, sel codes)`` of a rank-5 map over ``t[name]`` (column, row, the three batch dims of
    ``batch``: :func:`_map_dims`) with box (64 columns, ``box_rows``, 1, 1, 1) and the 128-byte swizzle; None
    where it is not TMA-legal: rows not 16-byte multiples, columns not contiguous, the launch's offset not
    16-byte aligned, a stride :func:`_map_dims` or the driver's rules (``tensor_map._check``) refuse."""
    from .tensor_map import TiledTemplate
    a = t[name]
    n_cols, n_rows = a.shape[-1], a.shape[-2]
    row = a.strides[-2] // a.itemsize if n_rows > 1 else n_cols
    dims = _map_dims(batch, itemsize)
    if dims is None or row * itemsize % 16 or (n_cols > 1 and a.strides[-1] != a.itemsize) \
            or off.get(name, 0) * itemsize % 16:
        return None
    extents, strides, codes = dims
    try:
        template = TiledTemplate(dtype, [n_cols, n_rows] + extents, [row * itemsize] + strides,
                                 (_PANEL, box_rows, 1, 1, 1), swizzle=128)
    except ValueError:
        return None
    return launch.Map(name, off.get(name, 0), template), codes


def _grid_batch(part, name):
    (mb0, mb1, mb2), sb, _ = part
    return [(_SEL_B2, mb2, sb[name][2]), (_SEL_B1, mb1, sb[name][1]), (_SEL_B0, mb0, sb[name][0])]


def tma_store_maps(t, part, tile, dtype):
    """The legality function of the TMA-store epilogue: ``[(Map dk, codes), (Map dv, codes)]`` (rows Lk, box
    64 columns x Bc keys, the tile's rows past Lk clipped by the TMA unit) or None where dk or dv is not
    TMA-legal (:func:`_tile_map`). dk, dv are the plan's contiguous 16-bit buffers, which the ws kernel's
    own conditions (16-byte rows of q, k, v, dout: D, Dv multiples of 8) make legal; checked all the same."""
    import numpy as np
    itemsize = np.dtype(dtype).itemsize
    if any(np.dtype(t[n].dtype) != np.dtype(dtype) for n in ("dk", "dv")):
        return None
    maps = [_tile_map(t, n, tile.block_n, _grid_batch(part, n), itemsize, part[2], dtype) for n in ("dk", "dv")]
    return None if None in maps else maps


def tma_args(t, part, group, tile, dtype):
    """The warp-specialized kernel's tail for one dK/dV launch part (``part``: ``(dims, strides3,
    offsets)`` of ``cuda_backward._launch_plans``, ``group``: ``({name: group stride}, n_group)``):
    ``[tma_sel, Map q, Map dout, Map k, Map v, Map dk, Map dv]``; None where a map cannot describe the part
    (more than three batch dims of extent above 1, strides not multiples of 16 bytes; the host then takes the
    cp.async kernel). dk, dv: the epilogue's TMA stores (:func:`tma_store_maps`) where the kernel takes them
    (:func:`_stores_by_tma`: dk, dv 16-bit), else the q and dout maps again, unused (the same encoding: no
    extra work per call). ``t``: the plan's arrays (for shapes and row strides)."""
    import numpy as np
    gs, n_group = group
    itemsize = np.dtype(dtype).itemsize
    found = []
    for name, box_rows in (("q", tile.block_m), ("dout", tile.block_m), ("k", tile.block_n), ("v", tile.block_n)):
        batch = _grid_batch(part, name)
        if name in ("q", "dout"):
            batch.insert(0, (_SEL_GROUP, n_group, gs[name]))
        found.append(_tile_map(t, name, box_rows, batch, itemsize, part[2], dtype))
    if None in found:
        return None
    if _stores_by_tma(np.dtype(dtype), np.dtype(t["dk"].dtype)):
        stores = tma_store_maps(t, part, tile, dtype)
        if stores is None:  # (the kernel was named before the arrays were seen: the cp.async kernel instead)
            return None
        found += stores
    else:
        found += [(found[0][0], [_SEL_NONE] * 3), (found[1][0], [_SEL_NONE] * 3)]
    sel = sum(c << (9 * m + 3 * d) for m, (_, codes) in enumerate(found) for d, c in enumerate(codes))
    return [np.int64(sel)] + [m for m, _ in found]
