"""TMA tensor maps (``CUtensorMap``, 128 bytes): the host side of ``cp.async.bulk.tensor``.

:func:`encode_tiled` checks the arguments with the rules of the CUDA driver's
``cuTensorMapEncodeTiled`` and returns a :class:`TensorMap`: for a NumPy array the emulator's
encoding (words documented in ``cuda_src/emu/fa_emu_runtime.cpp``, "TMA"; docs/emulator.md,
"Hopper: TMA"), for a CuPy array the driver's opaque one, made by ``cuTensorMapEncodeTiled`` from
the ``libcuda.so.1`` CuPy has loaded (through ctypes: nothing here needs a GPU to import).

Dimensions, strides and box sizes are given innermost first, as the driver takes them; by default
the whole array (C order) is described: ``global_dim = shape[::-1]``, ``global_strides`` the byte
strides of dimensions 1 … rank-1.
"""
import ctypes
import dataclasses

import numpy as np

__all__ = ["TensorMap", "TiledTemplate", "encode_tiled", "aligned_words", "DATA_TYPES"]

# CUtensorMapDataType by NumPy dtype name (the copies are bitwise: int8/int16 travel as UINT8/UINT16).
DATA_TYPES = {"uint8": 0, "int8": 0, "uint16": 1, "int16": 1, "uint32": 2, "int32": 3, "uint64": 4, "int64": 5,
              "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}
_SWIZZLE_ENUM = {0: 0, 32: 1, 64: 2, 128: 3}   # bytes -> CUtensorMapSwizzle
_MAGIC = 0x50414D54554D4546                     # "FEMUTMAP": cuda_src/emu/fa_emu_runtime.cpp's kTmaMagic


@dataclasses.dataclass
class TensorMap:
    """A tensor map: ``words`` (16 uint64, the 128 bytes of the ``CUtensorMap``) and the arguments.

    ``array`` is the global memory it describes (kept alive with the map). ``emulated`` tells which
    encoding ``words`` holds: the emulator's (NumPy array) or the driver's (CuPy array).
    """
    words: np.ndarray
    array: object
    global_dim: tuple
    global_strides: tuple
    box_dim: tuple
    swizzle: int
    emulated: bool

    @property
    def box_bytes(self):
        """Bytes one ``cp.async.bulk.tensor`` moves (the mbarrier's ``complete_tx``)."""
        return int(np.prod(self.box_dim)) * np.dtype(self.array.dtype).itemsize

    def kernel_arg(self):
        """The by-value kernel argument for CuPy (a 128-byte ``numpy.void``)."""
        return self.words.view(np.dtype((np.void, 128)))[0]


def _check(rank, itemsize, address, global_dim, global_strides, box_dim, element_strides, interleave, swizzle,
           l2_promotion, oob_fill):
    """cuTensorMapEncodeTiled's rules (CUDA driver API), as ValueErrors naming the argument."""
    if not 1 <= rank <= 5:
        raise ValueError("tensor rank %d: must be 1 to 5 (interleave none)" % rank)
    if address % 16:
        raise ValueError("global address 0x%x is not 16-byte aligned" % address)
    for name, seq, n in (("global_dim", global_dim, rank), ("global_strides", global_strides, rank - 1),
                         ("box_dim", box_dim, rank), ("element_strides", element_strides, rank)):
        if len(seq) != n:
            raise ValueError("%s has %d entries, the rank %d needs %d" % (name, len(seq), rank, n))
    for i, d in enumerate(global_dim):
        if not 1 <= d <= 2 ** 32:
            raise ValueError("global_dim[%d] = %d: must be in [1, 2^32]" % (i, d))
    for i, s in enumerate(global_strides):
        if s % 16 or not 0 < s < 2 ** 40:
            raise ValueError("global_strides[%d] = %d bytes (dimension %d): must be a positive multiple of 16, "
                             "below 2^40" % (i, s, i + 1))
    for i, b in enumerate(box_dim):
        if not 1 <= b <= 256:
            raise ValueError("box_dim[%d] = %d: must be in [1, 256]" % (i, b))
    if box_dim[0] * itemsize % 16:
        raise ValueError("box_dim[0] = %d elements of %d bytes = %d bytes: the inner box must be a multiple of "
                         "16 bytes" % (box_dim[0], itemsize, box_dim[0] * itemsize))
    for i, e in enumerate(element_strides):
        if not 1 <= e <= 8:
            raise ValueError("element_strides[%d] = %d: must be in [1, 8]" % (i, e))
    if interleave != 0:
        raise ValueError("interleave %d: only CU_TENSOR_MAP_INTERLEAVE_NONE (0) is supported" % interleave)
    if swizzle not in _SWIZZLE_ENUM:
        raise ValueError("swizzle %r: must be 0, 32, 64 or 128 (bytes)" % (swizzle,))
    if swizzle and box_dim[0] * itemsize > swizzle:
        raise ValueError("box_dim[0] = %d elements = %d bytes exceeds the %d-byte swizzle span"
                         % (box_dim[0], box_dim[0] * itemsize, swizzle))
    if l2_promotion not in (0, 1, 2, 3):
        raise ValueError("l2_promotion %r: must be 0 (none), 1 (64B), 2 (128B) or 3 (256B)" % (l2_promotion,))
    if oob_fill not in (0, 1):
        raise ValueError("oob_fill %r: must be 0 (zeros) or 1 (NaN request, zero FMA)" % (oob_fill,))


def aligned_words():
    """16 zeroed uint64 at a 128-byte aligned address (a CUtensorMap's alignment: 128 bytes in CUDA 13's
    headers, 64 in 12.x's; the driver's encoder writes there)."""
    raw = np.zeros(32, np.uint64)
    skip = (-raw.ctypes.data % 128) // 8
    return raw[skip:skip + 16]


def _emulator_words(rank, itemsize, dtype_code, address, global_dim, global_strides, box_dim, element_strides,
                    swizzle, l2_promotion, oob_fill):
    words = aligned_words()
    words[0] = _MAGIC
    words[1] = address
    words[2:2 + rank] = global_dim
    words[7:7 + rank - 1] = global_strides
    box = list(box_dim) + [0] * (5 - rank)
    words[11] = box[0] | box[1] << 16 | box[2] << 32 | box[3] << 48
    words[12] = box[4] | sum(e << (16 + 4 * i) for i, e in enumerate(element_strides))
    words[13] = rank | itemsize << 8 | swizzle << 16 | dtype_code << 32 | l2_promotion << 48 | oob_fill << 56
    return words


def encode_tiled(array, box_dim, *, global_dim=None, global_strides=None, element_strides=None, swizzle=0,
                 interleave=0, l2_promotion=0, oob_fill=0):
    """Encodes a tiled tensor map over ``array`` (``cuTensorMapEncodeTiled``).

    Parameters
    ----------
    array : numpy.ndarray or cupy.ndarray
        The global memory (its first element is the map's global address, 16-byte aligned). NumPy:
        the emulator's encoding; CuPy: the driver's (needs a GPU).
    box_dim : sequence of int
        Box size per dimension, innermost first (each 1 … 256; the inner box a multiple of 16 bytes).
    global_dim, global_strides : sequence of int, optional
        Dimensions (innermost first) and byte strides of dimensions 1 … rank-1 (multiples of 16);
        default: the array's shape and strides (its innermost dimension must be contiguous).
    element_strides : sequence of int, optional
        Traversal strides (default all 1; the emulator supports only 1).
    swizzle : {0, 32, 64, 128}
        Shared-memory swizzle span in bytes; the inner box must not exceed it (the emulator needs it
        equal).
    interleave, l2_promotion, oob_fill : int
        ``CUtensorMapInterleave`` (only NONE, 0), ``CUtensorMapL2promotion`` (0 … 3, a cache hint),
        ``CUtensorMapFloatOOBfill`` (0 zeros; 1 the NaN request, not emulated).

    Returns
    -------
    TensorMap
    """
    dtype = np.dtype(array.dtype)
    if dtype.name not in DATA_TYPES:
        raise ValueError("array dtype %s has no tensor-map data type (supported: %s)"
                         % (dtype, ", ".join(sorted(DATA_TYPES))))
    if global_dim is None:
        if array.strides[-1] != dtype.itemsize:
            raise ValueError("the array's innermost dimension is not contiguous (stride %d bytes): pass "
                             "global_dim and global_strides" % array.strides[-1])
        global_dim, global_strides = array.shape[::-1], array.strides[::-1][1:]
    global_dim, box_dim = tuple(int(d) for d in global_dim), tuple(int(b) for b in box_dim)
    global_strides = tuple(int(s) for s in (global_strides or ()))
    rank = len(global_dim)
    element_strides = tuple(int(e) for e in (element_strides or (1,) * rank))
    address = _address(array)
    _check(rank, dtype.itemsize, address, global_dim, global_strides, box_dim, element_strides, interleave, swizzle,
           l2_promotion, oob_fill)
    if isinstance(array, np.ndarray):
        _check_emulated(array, dtype.itemsize, global_dim, global_strides, box_dim, element_strides, swizzle, oob_fill)
        words = _emulator_words(rank, dtype.itemsize, DATA_TYPES[dtype.name], address, global_dim, global_strides,
                                box_dim, element_strides, swizzle, l2_promotion, oob_fill)
    else:
        words = _driver_encode(DATA_TYPES[dtype.name], rank, address, global_dim, global_strides, box_dim,
                               element_strides, interleave, _SWIZZLE_ENUM[swizzle], l2_promotion, oob_fill)
    return TensorMap(words, array, global_dim, global_strides, box_dim, swizzle, isinstance(array, np.ndarray))


def _address(array):
    if isinstance(array, np.ndarray):
        return array.ctypes.data
    return int(array.__cuda_array_interface__["data"][0])


def _check_emulated(array, itemsize, global_dim, global_strides, box_dim, element_strides, swizzle, oob_fill):
    """What the emulator does not implement, and the extent inside the array (the runtime checks each access)."""
    if any(e != 1 for e in element_strides):
        raise ValueError("element_strides %r: the emulator supports only 1" % (element_strides,))
    if swizzle and box_dim[0] * itemsize != swizzle:
        raise ValueError("box_dim[0] = %d bytes with a %d-byte swizzle: the emulator needs the inner box to equal "
                         "the swizzle span" % (box_dim[0] * itemsize, swizzle))
    if oob_fill:
        raise ValueError("oob_fill 1 (NaN request): the emulator fills out-of-bounds elements with zeros only")
    last = (global_dim[0] - 1) * itemsize + sum((d - 1) * s for d, s in zip(global_dim[1:], global_strides))
    if last + itemsize > array.nbytes:
        raise ValueError("the tensor described (last element at byte %d) extends past the array (%d bytes)"
                         % (last, array.nbytes))


_libcuda = None


def _driver_encode(dtype_code, rank, address, global_dim, global_strides, box_dim, element_strides, interleave,
                   swizzle_enum, l2_promotion, oob_fill):
    """cuTensorMapEncodeTiled through ctypes, from the libcuda.so.1 CuPy has loaded (a GPU is needed)."""
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
        _libcuda.cuTensorMapEncodeTiled.restype = ctypes.c_int
    words = aligned_words()
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    rc = _libcuda.cuTensorMapEncodeTiled(
        ctypes.c_void_p(words.ctypes.data), ctypes.c_int(dtype_code), u32(rank), ctypes.c_void_p(address),
        (u64 * rank)(*global_dim), (u64 * max(1, rank - 1))(*global_strides), (u32 * rank)(*box_dim),
        (u32 * rank)(*element_strides), ctypes.c_int(interleave), ctypes.c_int(swizzle_enum),
        ctypes.c_int(l2_promotion), ctypes.c_int(oob_fill))
    if rc != 0:
        raise RuntimeError("cuTensorMapEncodeTiled failed with CUresult %d" % rc)
    return words


class TiledTemplate:
    """A tiled tensor map whose geometry is fixed and whose global address changes per call (plans).

    The arguments are checked once here (with the rules of :func:`encode_tiled`, at a 16-byte aligned
    stand-in address), and the driver's argument arrays built once; :meth:`driver_arg` then encodes the
    map for one address (one ``cuTensorMapEncodeTiled`` call), :meth:`emulator_arg` fills the emulator's
    words (no driver: host-overhead measurements), :meth:`emulator_map` encodes over a NumPy view (the
    emulator checks every access against it). Arguments as :func:`encode_tiled`'s, for ``dtype``.
    """

    __slots__ = ("dtype", "global_dim", "global_strides", "box_dim", "swizzle", "_words", "_driver_args")

    def __init__(self, dtype, global_dim, global_strides, box_dim, swizzle=0):
        dtype = np.dtype(dtype)
        if dtype.name not in DATA_TYPES:
            raise ValueError("dtype %s has no tensor-map data type" % dtype)
        self.dtype = dtype
        self.global_dim = tuple(int(d) for d in global_dim)
        self.global_strides = tuple(int(s) for s in global_strides)
        self.box_dim = tuple(int(b) for b in box_dim)
        self.swizzle = int(swizzle)
        rank = len(self.global_dim)
        ones = (1,) * rank
        _check(rank, dtype.itemsize, 0, self.global_dim, self.global_strides, self.box_dim, ones, 0, self.swizzle, 0, 0)
        self._words = _emulator_words(rank, dtype.itemsize, DATA_TYPES[dtype.name], 0, self.global_dim,
                                      self.global_strides, self.box_dim, ones, self.swizzle, 0, 0)
        self._driver_args = None

    def emulator_map(self, view):
        """The emulator's :class:`TensorMap` over the NumPy array ``view`` (its element 0 the address)."""
        return encode_tiled(view, self.box_dim, global_dim=self.global_dim, global_strides=self.global_strides,
                            swizzle=self.swizzle)

    def emulator_arg(self, address):
        """The emulator's 128 bytes for ``address``, as a by-value argument (``numpy.void``)."""
        words = self._words.copy()
        words[1] = address
        return words.view(np.dtype((np.void, 128)))[0]

    def driver_arg(self, address):
        """The driver's encoding for ``address`` (16-byte aligned), as a by-value argument (``numpy.void``)."""
        words = aligned_words()
        self.driver_encode(words.ctypes.data, address)
        return words.view(np.dtype((np.void, 128)))[0]

    def driver_encode(self, dest, address):
        """Encode the map for global ``address`` (16-byte aligned) with the driver's
        ``cuTensorMapEncodeTiled`` into the 128 bytes at host address ``dest`` (64-byte aligned: a
        kernel-parameter block's slot, :class:`launch.ArgBlock`)."""
        if address % 16:
            raise ValueError("global address 0x%x is not 16-byte aligned" % address)
        if self._driver_args is None:
            rank = len(self.global_dim)
            u64, u32 = ctypes.c_uint64, ctypes.c_uint32
            self._driver_args = (
                ctypes.c_int(DATA_TYPES[self.dtype.name]), u32(rank), (u64 * rank)(*self.global_dim),
                (u64 * max(1, rank - 1))(*self.global_strides), (u32 * rank)(*self.box_dim), (u32 * rank)(*(1,) * rank),
                _SWIZZLE_ENUM[self.swizzle])
        dtype_code, rank, dims, strides, box, elems, swizzle_enum = self._driver_args
        global _libcuda
        if _libcuda is None:
            _libcuda = ctypes.CDLL("libcuda.so.1")
            _libcuda.cuTensorMapEncodeTiled.restype = ctypes.c_int
        rc = _libcuda.cuTensorMapEncodeTiled(ctypes.c_void_p(dest), dtype_code, rank,
                                             ctypes.c_void_p(address), dims, strides, box, elems, ctypes.c_int(0),
                                             ctypes.c_int(swizzle_enum), ctypes.c_int(0), ctypes.c_int(0))
        if rc != 0:
            raise RuntimeError("cuTensorMapEncodeTiled failed with CUresult %d" % rc)

    def emulator_encode(self, dest_words, address):
        """The emulator's 16 words for ``address`` written into ``dest_words`` (a uint64 array's slice:
        the host work of :meth:`driver_encode` without a driver, for host-overhead measurements)."""
        dest_words[:] = self._words
        dest_words[1] = address
