"""stmatrix, elect.sync and setmaxnreg (sm_90 / sm_90a) on the emulator, and their GPU code.

stmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16 (PTX ISA, "stmatrix"): lanes 8j..8j+7 pass the
addresses of rows 0..7 of matrix j; lane l holds in r[j] the elements (l / 4, 2 (l % 4)) and
(l / 4, 2 (l % 4) + 1) of matrix j (the lower in bits 0-15), with .trans (2 (l % 4), l / 4) and
(2 (l % 4) + 1, l / 4) — ldmatrix's fragment, stored instead of loaded. elect.sync: one leader per
mask, deterministic (the emulator elects the lowest lane, as the hardware does). setmaxnreg: N a
multiple of 8 in 24..256, the same instruction in every warp of the warpgroup. docs/emulator.md states
the rules."""
import re

import numpy as np
import pytest

from flasharray import emulator
from conftest import requires_nvrtc

SRC = r'''
#include "fa_port.cuh"

// Lane l's fragment r[j] = frag[l * N + j]; row r of matrix j lives at shared row row_of_lane[8j + r]
// (16 bytes each). The shared rows start as 0xffff; stmatrix stores, then (reload) ldmatrix<N, LoadTrans>
// reads the same addresses back into back[l * N + j]; rows_out receives the shared rows.
template <int N, bool Trans, bool LoadTrans>
__global__ void st_ld(const uint32_t* frag, const int* row_of_lane, int nrows, uint16_t* rows_out, uint32_t* back) {
    FA_DYNAMIC_SMEM(smem);
    uint16_t* rows = reinterpret_cast<uint16_t*>(smem);
    for (int i = threadIdx.x; i < nrows * 8; i += 32) rows[i] = 0xffff;
    __syncwarp();
    const int l = threadIdx.x;
    uint32_t r[N];
    for (int j = 0; j < N; ++j) r[j] = fa::gload(frag + l * N + j);
    fa::stmatrix<N, Trans>(rows + 8 * fa::gload(row_of_lane + l), r);
    uint32_t b[N];
    fa::ldmatrix<N, LoadTrans>(b, rows + 8 * fa::gload(row_of_lane + l));
    for (int j = 0; j < N; ++j) fa::gstore(back + l * N + j, b[j]);
    __syncwarp();
    for (int i = threadIdx.x; i < nrows * 8; i += 32) fa::gstore(rows_out + i, rows[i]);
}

// Every thread whose lane is in masks[warp] calls elect_one(masks[warp]); out[t] = 1 if elected, 0 if
// not, -1 if it did not take part.
__global__ void elect(const unsigned* masks, int* out) {
    const unsigned mask = fa::gload(masks + threadIdx.x / 32);
    int v = -1;
    if ((mask >> (threadIdx.x % 32)) & 1u) v = fa::elect_one(mask) ? 1 : 0;
    fa::gstore(out + threadIdx.x, v);
}

// The FA3 register split: warpgroup 0 (the producer) releases down to 40 registers, the others (consumers)
// raise theirs to 232. bug: 1 warp 1 of warpgroup 0 asks for 48, 2 only warps 0-1 of warpgroup 0 execute it,
// 3 two setmaxnreg in a row without the warpgroup in between, 4 .inc below the current count after a .dec.
// (ptxas honours setmaxnreg only when the register count at entry is known: __launch_bounds__ gives it.)
__global__ void __launch_bounds__(384, 1) regs(int bug) {
    const int wg = threadIdx.x / 128, warp = threadIdx.x / 32;
    if (wg == 0) {
        if (bug == 2 && warp >= 2) return;
        if (bug == 1 && warp == 1) fa::setmaxnreg_dec<48>();
        else fa::setmaxnreg_dec<40>();
        if (bug == 3 && warp == 0) fa::setmaxnreg_dec<32>();
        if (bug == 4) {
            fa::named_barrier_sync(1, 128);
            fa::setmaxnreg_inc<32>();
        }
    } else {
        fa::setmaxnreg_inc<232>();
    }
}
'''

VARIANTS = [(n, t, lt) for n in (1, 2, 4) for t in (False, True) for lt in (False, True)]


def _st_name(n, t, lt):
    b = lambda x: "true" if x else "false"   # noqa: E731
    return "st_ld<%d, %s, %s>" % (n, b(t), b(lt))


@pytest.fixture(scope="module")
def mod():
    return emulator.Module(SRC, name_expressions=[_st_name(*v) for v in VARIANTS] + ["elect", "regs"])


def stmatrix_model(frag, row_of_lane, n, trans, nrows):
    """The shared rows after one stmatrix, from the ISA's fragment figure (rows start as 0xffff)."""
    rows = np.full((nrows, 8), 0xFFFF, np.uint16)
    for j in range(n):
        for lane in range(32):
            for half in (0, 1):
                r, c = ((2 * (lane % 4) + half, lane // 4) if trans else (lane // 4, 2 * (lane % 4) + half))
                rows[row_of_lane[8 * j + r], c] = (int(frag[lane, j]) >> (16 * half)) & 0xFFFF
    return rows


def run_st_ld(mod, n, trans, load_trans, seed, schedule="forward"):
    rng = np.random.default_rng(seed)
    nrows = 40
    frag = rng.integers(0, 2 ** 32, (32, n), dtype=np.uint64).astype(np.uint32)
    row_of_lane = rng.permutation(nrows)[:32].astype(np.int32)   # distinct rows, any order
    rows_out = np.zeros(nrows * 8, np.uint16)
    back = np.zeros(32 * n, np.uint32)
    c = mod.launch(_st_name(n, trans, load_trans), 1, 32, (frag.reshape(-1), row_of_lane, np.int32(nrows), rows_out,
                                                           back), shared_mem=nrows * 16, schedule=schedule)
    return frag, row_of_lane, rows_out.reshape(nrows, 8), back.reshape(32, n), c


@pytest.mark.parametrize("n,trans,load_trans", VARIANTS)
@pytest.mark.parametrize("seed", [0, 1])
def test_stmatrix_layout_and_round_trip(mod, n, trans, load_trans, seed):
    frag, row_of_lane, rows, back, c = run_st_ld(mod, n, trans, load_trans, seed, ["forward", "reverse"][seed])
    expect = stmatrix_model(frag, row_of_lane, n, trans, 40)
    assert rows.tobytes() == expect.tobytes()
    used = sorted(set(row_of_lane[:8 * n].tolist()))
    assert np.all(np.delete(rows, used, axis=0) == 0xFFFF)   # only the addressed rows are written
    if trans == load_trans:   # ldmatrix undoes stmatrix
        assert back.tobytes() == frag.tobytes()
    else:                     # a transposed store read back plainly gives the transposed fragment
        assert back.tobytes() != frag.tobytes()
        model_t = stmatrix_model(frag, row_of_lane, n, trans, 40)
        for j in range(n):
            mat = np.array([model_t[row_of_lane[8 * j + r]] for r in range(8)], np.uint32)
            for lane in range(32):
                lo, hi = (mat[2 * (lane % 4), lane // 4], mat[2 * (lane % 4) + 1, lane // 4]) if load_trans else \
                    (mat[lane // 4, 2 * (lane % 4)], mat[lane // 4, 2 * (lane % 4) + 1])
                assert back[lane, j] == lo | hi << 16
    assert c.stmatrix == 1 and c.ldmatrix == 1
    # bank conflicts: each matrix's 8 rows (16-byte pitch here: 4 banks each) one phase, as ldmatrix's
    assert c.stmatrix_wavefronts_ideal == n and c.stmatrix_wavefronts == sum(
        matrix_wavefronts(16 * row_of_lane[8 * j:8 * j + 8]) for j in range(n))


def matrix_wavefronts(row_bytes):
    """Wavefronts of one 8 x 8 matrix's phase: the most distinct 4-byte words any of the 32 banks holds among
    the 8 rows' 16 bytes (row_bytes: byte offsets)."""
    banks = {}
    for b in row_bytes:
        for k in range(4):
            w = int(b) // 4 + k
            banks.setdefault(w % 32, set()).add(w)
    return max(len(v) for v in banks.values())


def test_stmatrix_bank_conflicts_counted(mod):
    """Rows 0, 8, 16, 24, 32 of the 16-byte-pitch tile share banks 0-3: matrix 0's phase takes 5 wavefronts
    (x1: ideal 1); rows 0..7 take one."""
    rows = [0, 8, 16, 24, 32, 1, 9, 17]
    row_of_lane = np.array(rows + [r for r in range(40) if r not in rows][:24], np.int32)
    assert matrix_wavefronts(16 * np.array(rows)) == 5
    for order, want in ((row_of_lane, 5), (np.arange(32, dtype=np.int32), 1)):
        frag = np.zeros(32, np.uint32)
        c = mod.launch(_st_name(1, False, False), 1, 32, (frag, order, np.int32(40), np.zeros(40 * 8, np.uint16),
                                                          np.zeros(32, np.uint32)), shared_mem=40 * 16)
        assert (c.stmatrix_wavefronts, c.stmatrix_wavefronts_ideal, c.stmatrix_conflict_factor) == (want, 1, want)


def test_stmatrix_hand_computed_x1():
    """x1, rows 0..7 at shared rows 0..7: lane 5 holds (row 1, cols 2, 3); .trans puts them at (2, 1), (3, 1)."""
    frag = np.zeros((32, 1), np.uint32)
    frag[5, 0] = 0xBBBB_AAAA
    plain = stmatrix_model(frag, np.arange(32), 1, False, 8)
    trans = stmatrix_model(frag, np.arange(32), 1, True, 8)
    assert plain[1, 2] == 0xAAAA and plain[1, 3] == 0xBBBB and trans[2, 1] == 0xAAAA and trans[3, 1] == 0xBBBB


def test_stmatrix_hand_computed_on_the_emulator(mod):
    frag = np.zeros(32, np.uint32)
    frag[5] = 0xBBBB_AAAA
    for trans, cells in ((False, [(1, 2), (1, 3)]), (True, [(2, 1), (3, 1)])):
        rows = np.zeros(64, np.uint16)
        mod.launch(_st_name(1, trans, trans), 1, 32, (frag, np.arange(32, dtype=np.int32), np.int32(8), rows,
                                                      np.zeros(32, np.uint32)), shared_mem=512)
        rows = rows.reshape(8, 8)
        assert rows[cells[0]] == 0xAAAA and rows[cells[1]] == 0xBBBB
        assert np.count_nonzero(rows) == 2


def test_stmatrix_misaligned_row_is_an_error():
    src = SRC.replace("fa::stmatrix<N, Trans>(rows + 8 * fa::gload(row_of_lane + l), r);",
                      "fa::stmatrix<N, Trans>(rows + 8 * fa::gload(row_of_lane + l) + 1, r);")
    m = emulator.Module(src, name_expressions=[_st_name(1, False, False)])
    with pytest.raises(emulator.EmulatorError, match=r"fa::stmatrix: row address is not 16-byte aligned"):
        m.launch(_st_name(1, False, False), 1, 32, (np.zeros(32, np.uint32), np.arange(32, dtype=np.int32),
                                                    np.int32(33), np.zeros(33 * 8, np.uint16),
                                                    np.zeros(32, np.uint32)), shared_mem=33 * 16)


# ---- elect.sync ----------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule,seed", [("forward", 0), ("reverse", 0), ("random", 1), ("random", 2)])
def test_elect_one_lowest_lane_of_the_mask(mod, schedule, seed):
    masks = np.array([0xFFFFFFFF, 0xF0F0F0F0, 0x80000000, 0x00010006], np.uint32)
    out = np.zeros(128, np.int32)
    c = mod.launch("elect", 1, 128, (masks, out), schedule=schedule, seed=seed)
    for wp, m in enumerate(masks.tolist()):
        lanes = out[32 * wp:32 * wp + 32]
        expect = [(-1 if not (m >> l) & 1 else int(l == (m & -m).bit_length() - 1)) for l in range(32)]
        assert lanes.tolist() == expect
    assert c.elects == 4


def test_elect_with_a_lane_outside_the_mask(mod):
    masks = np.array([0x0000FFFF], np.uint32)
    src = SRC.replace("if ((mask >> (threadIdx.x % 32)) & 1u) v = fa::elect_one(mask) ? 1 : 0;",
                      "v = fa::elect_one(mask) ? 1 : 0;")
    m = emulator.Module(src, name_expressions=["elect"])
    with pytest.raises(emulator.EmulatorError, match=r"fa::elect_one: the calling lane (1[6-9]|2\d|3[01]) is not in the "
                                                     r"mask 0x0000ffff"):
        m.launch("elect", 1, 32, (masks, np.zeros(32, np.int32)))


# ---- setmaxnreg ----------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["forward", "reverse", "random"])
def test_setmaxnreg_register_split(mod, schedule):
    c = mod.launch("regs", 1, 384, (np.int32(0),), schedule=schedule)
    assert c.setmaxnreg == 3


REG_ERRORS = {
    1: r"fa::setmaxnreg_dec<(48|40)>: thread \d+ of warpgroup 0 executed fa::setmaxnreg_dec<(40|48)>: the warps of a "
       r"warpgroup execute the same setmaxnreg",
    2: r"(thread exits without executing the fa::setmaxnreg_dec<40> that \d+ thread\(s\) of its warpgroup 0 executed"
       r"|fa::setmaxnreg_dec<40>: thread \d+ of warpgroup 0 has exited without executing it)",
    3: r"fa::setmaxnreg_dec<32>: this thread executes a second setmaxnreg while \d+ of the 128 threads of warpgroup 0 "
       r"have not executed the first",
    4: r"fa::setmaxnreg_inc<32>: the warpgroup's register count is 40: .inc must not lower it",
}


@pytest.mark.parametrize("schedule", ["forward", "reverse", "random"])
@pytest.mark.parametrize("bug", sorted(REG_ERRORS))
def test_setmaxnreg_misuse_is_a_checked_error(mod, bug, schedule):
    with pytest.raises(emulator.EmulatorError, match=REG_ERRORS[bug]):
        mod.launch("regs", 1, 256, (np.int32(bug),), schedule=schedule)


def test_setmaxnreg_needs_a_whole_warpgroup(mod):
    with pytest.raises(emulator.EmulatorError, match=r"fa::setmaxnreg_dec<40>: warpgroup 0 \(warps 0-3\) is "
                                                     r"incomplete: the block has 96 threads"):
        mod.launch("regs", 1, 96, (np.int32(0),))


@pytest.mark.parametrize("n", [20, 260, 100])
def test_setmaxnreg_count_is_checked_at_compile_time(n):
    src = '#include "fa_port.cuh"\n__global__ void k() { fa::setmaxnreg_inc<%d>(); }\n' % n
    with pytest.raises(emulator.CompileError, match=r"fa::setmaxnreg: N must be a multiple of 8 in \[24, 256\]"):
        emulator.Module(src, name_expressions=["k"])


# ---- GPU code -------------------------------------------------------------------------------------
@requires_nvrtc
def test_sm90a_ptx_and_sass():
    from flasharray._private import nvrtc, sass
    names = [_st_name(*v) for v in VARIANTS] + ["elect", "regs"]
    r = nvrtc.compile_cubin(SRC, "sm_90a", name_expressions=names)
    for instr in ("stmatrix.sync.aligned.m8n8.x1.shared.b16", "stmatrix.sync.aligned.m8n8.x2.trans.shared.b16",
                  "stmatrix.sync.aligned.m8n8.x4.shared.b16", "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
                  "elect.sync _|p", "setmaxnreg.dec.sync.aligned.u32 40", "setmaxnreg.inc.sync.aligned.u32 232"):
        assert instr in r.ptx, instr
    ok, why = sass.available()
    if not ok:
        pytest.skip(why)
    fns = sass.parse(sass.disassemble(r.cubin))
    ops = lambda name: {i.opcode for i in fns[r.kernel(name).lowered_name]}   # noqa: E731
    # stmatrix -> STSM.16.M88.{1,2,4}[.MT88 for .trans]; elect.sync -> ELECT; setmaxnreg -> USETMAXREG
    assert any(o.startswith("STSM.16.M88.4") for o in ops(_st_name(4, False, False))), ops(_st_name(4, False, False))
    assert any(o.startswith("STSM.16.MT88.2") for o in ops(_st_name(2, True, True))), ops(_st_name(2, True, True))
    assert "ELECT" in ops("elect"), sorted(ops("elect"))
    assert any(o.startswith("USETMAXREG") for o in ops("regs")), sorted(ops("regs"))


@requires_nvrtc
def test_below_sm90_is_a_compile_error_at_the_use():
    from flasharray._private import nvrtc
    with pytest.raises(nvrtc.NvrtcError, match=r"fa::stmatrix needs sm_90\+"):
        nvrtc.compile_cubin(SRC, "sm_80", name_expressions=[_st_name(1, False, False)])
    with pytest.raises(nvrtc.NvrtcError, match=r"fa::elect_one needs sm_90\+"):
        nvrtc.compile_cubin(SRC, "sm_80", name_expressions=["elect"])
    with pytest.raises(nvrtc.NvrtcError, match=r"fa::setmaxnreg needs sm_90a"):
        nvrtc.compile_cubin(SRC, "sm_90", name_expressions=["regs"])
