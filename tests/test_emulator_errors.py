"""Bugs in kernels become Python exceptions naming kernel, block, thread and offset; the process
never crashes. Each kernel in tests/kernels/faulty.cu has exactly one bug."""
from pathlib import Path

import numpy as np
import pytest

from flasharray import emulator

KERNELS = Path(__file__).parent / "kernels"
NAMES = ["global_read_oob", "global_write_oob", "global_misaligned", "write_read_only", "cp_async_src_oob",
         "cp_async_dst_oob", "cp_async_misaligned", "stage_land_after_wait", "stage_never_landed", "stage_partial_chunk", "ldmatrix_bad_row", "raw_shared_oob", "early_exit_barrier",
         "divergent_barrier", "shuffle_missing_lanes", "shuffle_exited_lanes", "shuffle_source_outside_mask",
         "shuffle_half_masks", "mma_partial_warp", "stack_overflow", "int_div_zero", "trap_kernel", "args_kernel"]


@pytest.fixture(scope="module")
def mod():
    return emulator.Module((KERNELS / "faulty.cu").read_text(), name_expressions=NAMES)


def raises(mod, name, grid, block, args, match, shared_mem=0, **kw):
    with pytest.raises(emulator.EmulatorError, match=match) as e:
        mod.launch(name, grid, block, args, shared_mem=shared_mem, **kw)
    msg = str(e.value)
    assert ("kernel '%s' block (" % name) in msg, msg
    return msg


# ---- global memory ------------------------------------------------------------------------------
def test_global_read_out_of_bounds(mod):
    x = np.zeros(64, np.float32)
    out = np.zeros(64, np.float32)
    msg = raises(mod, "global_read_oob", 2, 32, (out, x, np.int32(16)), r"out-of-bounds fa::gload of 4 bytes")
    # forward order: the first thread past the end is block 1, thread 16 -> element 64 = byte 256
    assert "block (1,0,0) thread (16,0,0)" in msg and "argument 1 (256 bytes): byte offset 256" in msg


def test_global_write_out_of_bounds_names_buffer_and_offset(mod):
    out = np.zeros(40, np.float32)
    msg = raises(mod, "global_write_oob", 2, 32, (out, np.int32(40)), r"out-of-bounds fa::gstore")
    assert "thread (8,0,0)" in msg and "argument 0 (160 bytes): byte offset 160" in msg
    assert np.all(out == 1.0)   # the in-bounds stores before the error happened


def test_global_misaligned(mod):
    x = np.zeros(64, np.float32)
    raises(mod, "global_misaligned", 1, 32, (np.zeros(32, np.float32), x), r"misaligned fa::gload of 4 bytes")


def test_store_to_read_only_array(mod):
    out = np.zeros(32, np.float32)
    out.flags.writeable = False
    raises(mod, "write_read_only", 1, 32, (out,), r"read-only array")


def test_cp_async_source_out_of_bounds(mod):
    x = np.zeros(4 * 20, np.float32)   # 20 rows of 16 bytes, 32 threads copy one row each
    msg = raises(mod, "cp_async_src_oob", 1, 32, (np.zeros(1, np.float32), x, np.int32(80)),
                 r"out-of-bounds fa::cp_async global read of 16 bytes", shared_mem=512)
    assert "thread (20,0,0)" in msg and "byte offset 320" in msg


# ---- shared memory ------------------------------------------------------------------------------
def test_cp_async_destination_outside_shared_memory(mod):
    x = np.zeros(4, np.float32)
    raises(mod, "cp_async_dst_oob", 1, 1, (x, np.int32(64)), r"destination .* outside shared memory: shared offset 1024 "
           r"\(dynamic shared memory is 1024 bytes\)", shared_mem=1024)


@pytest.mark.parametrize("name,match", [
    ("stage_land_after_wait", r"fa::ChunkStage::land: after the cp_async_wait that completed the chunk"),
    ("stage_never_landed", r"fa::ChunkStage: a staged chunk never landed"),
    ("stage_partial_chunk", r"fa::ChunkStage::stage: src_bytes must be 16 or 0")])
def test_chunk_stage_misuse(mod, name, match):
    """What sm_75's staged copies need and the emulator's cp.async would not show: each staged chunk lands,
    before the wait that completes it, and is whole."""
    raises(mod, name, 1, 1, (np.zeros(4, np.float32),), match, shared_mem=256)


def test_cp_async_misaligned_destination(mod):
    raises(mod, "cp_async_misaligned", 1, 1, (np.zeros(4, np.float32), np.int32(8)), r"not 16-byte aligned: shared offset 8",
           shared_mem=256)


def test_ldmatrix_misaligned_row(mod):
    msg = raises(mod, "ldmatrix_bad_row", 1, 32, (np.zeros(32, np.uint32), np.int32(24)), r"not 16-byte aligned",
                 shared_mem=512)
    assert "lane 13" in msg and "shared offset 24" in msg


def test_ldmatrix_row_outside_shared_memory(mod):
    raises(mod, "ldmatrix_bad_row", 1, 32, (np.zeros(32, np.uint32), np.int32(512)),
           r"outside shared memory: shared offset 512 \(dynamic shared memory is 512 bytes\)", shared_mem=512)


@pytest.mark.parametrize("index", [64, 1000, -1100])
def test_raw_shared_pointer_out_of_bounds_is_caught(mod, index):
    """Guard pages around the block's shared memory turn a stray raw access into an error."""
    out = np.zeros(1, np.float32)
    msg = raises(mod, "raw_shared_oob", 1, 64, (out, np.int32(index)),
                 r"out-of-bounds shared memory access \(raw pointer\)", shared_mem=256)
    assert "shared offset %d" % (4 * index) in msg and "thread (0,0,0)" in msg


def test_raw_shared_pointer_in_bounds_works(mod):
    out = np.zeros(1, np.float32)
    mod.launch("raw_shared_oob", 1, 64, (out, np.int32(63)), shared_mem=256)
    assert out[0] == 1.0


# ---- barriers and warp collectives ------------------------------------------------------------
def test_barrier_after_early_exit(mod):
    raises(mod, "early_exit_barrier", 1, 64, (np.zeros(64, np.float32),),
           r"thread exits while 40 thread\(s\) wait at __syncthreads\(\)")


@pytest.mark.parametrize("schedule", ["forward", "reverse", "random"])
def test_barrier_after_early_exit_any_schedule(mod, schedule):
    raises(mod, "early_exit_barrier", 1, 64, (np.zeros(64, np.float32),), r"never reach", schedule=schedule)


def test_divergent_barrier(mod):
    msg = raises(mod, "divergent_barrier", 1, 64, (np.zeros(64, np.float32),), r"divergent __syncthreads\(\)")
    assert "divergent_barrier(float*)+0x" in msg


def test_incomplete_warp_collective_deadlock(mod):
    msg = raises(mod, "shuffle_missing_lanes", 1, 64, (np.zeros(64, np.float32),),
                 r"__shfl_xor_sync \(mask 0xffffffff\) never completes")
    assert "lanes 0-15 wait at it, lanes 16-31 never arrive" in msg and "wait at __syncthreads()" in msg


def test_warp_collective_with_exited_lanes(mod):
    raises(mod, "shuffle_exited_lanes", 1, 32, (np.zeros(32, np.float32),), r"incomplete warp collective")


def test_shuffle_source_lane_outside_mask(mod):
    raises(mod, "shuffle_source_outside_mask", 1, 32, (np.zeros(32, np.float32),),
           r"reads lane 20, which is not in the mask")


def test_disjoint_half_warp_masks_are_legal(mod):
    out = np.zeros(32, np.float32)
    mod.launch("shuffle_half_masks", 1, 32, (out,))
    np.testing.assert_array_equal(out, np.arange(32) ^ 1)


def test_mma_missing_lane(mod):
    msg = raises(mod, "mma_partial_warp", 1, 32, (np.zeros(32, np.float32),), r"fa::mma_m16n8k16")
    assert "lane 7" in msg or "lanes 7" in msg


# ---- faults inside fibers -----------------------------------------------------------------------
def test_stack_overflow_is_an_error(mod):
    raises(mod, "stack_overflow", 1, 2, (np.zeros(2, np.int32), np.int32(1000)), r"fiber stack overflow",
           stack_kb=64)


def test_deep_but_fitting_stack_works(mod):
    out = np.zeros(2, np.int32)
    mod.launch("stack_overflow", 1, 2, (out, np.int32(3)), stack_kb=64)
    np.testing.assert_array_equal(out, [6, 6])


def test_integer_division_by_zero(mod):
    raises(mod, "int_div_zero", 1, 4, (np.zeros(4, np.int32), np.int32(0)), r"SIGFPE")


def test_trap(mod):
    raises(mod, "trap_kernel", 1, 8, (np.zeros(8, np.int32),), r"thread \(5,0,0\).*__trap\(\) called")


def test_process_survives_and_module_still_works_after_errors(mod):
    for _ in range(3):
        with pytest.raises(emulator.EmulatorError):
            mod.launch("raw_shared_oob", 1, 64, (np.zeros(1, np.float32), np.int32(5000)), shared_mem=256)
    out = np.zeros(32, np.float32)
    mod.launch("shuffle_half_masks", 4, 32, (out,))
    np.testing.assert_array_equal(out, np.arange(32) ^ 1)


# ---- argument checking -------------------------------------------------------------------------
def args_ok():
    return [np.zeros(1, np.float32), np.ones(1, np.float16), np.int32(1), np.int64(2), np.float32(3),
            np.float64(4), np.uint32(5)]


def test_arguments_pass_by_value(mod):
    args = args_ok()
    mod.launch("args_kernel", 1, 1, args)
    assert args[0][0] == 16.0
    args[3], args[5] = 2, 4.0   # Python int/float are what CuPy passes as long long/double
    mod.launch("args_kernel", 1, 1, args)
    assert args[0][0] == 16.0


@pytest.mark.parametrize("index,value,match", [
    (0, np.zeros(1, np.float64), r"argument 0: the kernel takes float\*, got an array of dtype float64"),
    (1, np.ones(1, np.float32), r"argument 1: the kernel takes const fa_half\*, got an array of dtype float32"),
    (2, np.int64(1), r"argument 2: the kernel takes int, got numpy.int64"),
    (2, 1, r"argument 2: the kernel takes int, got a Python int"),
    (4, 3.0, r"argument 4: the kernel takes float, got a Python float"),
    (6, np.int32(5), r"argument 6: the kernel takes unsigned int, got numpy.int32"),
    (0, np.float32(1), r"argument 0: the kernel takes a pointer \(float\*\)"),
    (2, np.zeros(1, np.int32), r"argument 2: the kernel takes int by value, got a NumPy array"),
])
def test_argument_type_mismatch_is_type_error(mod, index, value, match):
    args = args_ok()
    args[index] = value
    with pytest.raises(TypeError, match=match):
        mod.launch("args_kernel", 1, 1, args)


def test_wrong_argument_count(mod):
    with pytest.raises(TypeError, match=r"takes 7 arguments"):
        mod.launch("args_kernel", 1, 1, args_ok()[:-1])
