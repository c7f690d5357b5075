"""SASS report: what the tensor-core kernels' steady-state loops execute, without a GPU.

Each tensor-core kernel instantiation is compiled with NVRTC (:mod:`flasharray._private.nvrtc`),
its cubin disassembled with ``cuobjdump -sass`` (``nvdisasm`` as a fallback; the pip wheels
``nvidia-cuda-cuobjdump`` and ``nvidia-cuda-nvdisasm`` provide both), and the steady-state
key-tile loop found and counted. The figure that tracks speed is *instructions per HMMA* in that
loop: on an H100 the static ratio of our forward d128 (8.9–9.7) matched the dynamic one Nsight
Compute measured (8.9), and FlashAttention-2's is 4.5–5.0 (``docs/performance.md``).

Loop rule. A loop is the address range ``[target, branch]`` of a backward branch (``BRA`` to a
lower address). The *key-tile loop* is the loop holding the most HMMA instructions; among loops
tied on that count, the one with the fewest instructions (the innermost loop that still holds
them all, or of two disjoint copies — masked and unmasked iterations — the leaner one). Counts
are static: an instruction inside a nested loop counts once, so a rolled inner loop (HMMA in a
nested loop) makes the static ratio a lower bound of what one iteration executes; the report
shows the nested loops and the HMMA inside them.

>>> from flasharray._private import sass
>>> fn = sass.parse(text)["_Z10my_kernelv"]          # doctest: +SKIP
>>> sass.key_loop(fn).per_hmma                       # doctest: +SKIP
9.7
"""
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import cuda_backward, launch, nvrtc, tiles, tiles_bwd

__all__ = ["Instruction", "Loop", "LoopStats", "Occupancy", "KernelSpec", "KernelReport", "ARCH_LIMITS",
           "TOOLS", "QUICK", "FULL", "find_tool", "available", "disassemble", "parse", "loops", "key_loop",
           "occupancy", "target", "kernel_specs", "report", "markdown", "summary", "SIMT_ROLES", "SIMT_QUICK",
           "SIMT_FULL", "simt_kernel_specs", "estimated_per_fma", "simt_summary"]

#: Disassemblers, in order of preference.
TOOLS = ("cuobjdump", "nvdisasm")
#: Opcode (text before the first dot) → report column; opcodes not listed count only as instructions.
CATEGORIES = {"HMMA": "hmma", "LDSM": "ldsm", "LDS": "lds", "STS": "sts", "LDGSTS": "ldgsts",
              "LDG": "ldg", "STG": "stg", "RED": "atomic", "REDG": "atomic", "ATOM": "atomic",
              "ATOMG": "atomic", "MUFU": "mufu", "BAR": "bar", "FFMA": "ffma", "DFMA": "dfma"}


# ---- disassembler ---------------------------------------------------------------------------------
def find_tool(name):
    """Path of ``cuobjdump`` or ``nvdisasm``, or ``None``.

    Looked up as libnvrtc is (``nvrtc.find_libnvrtc``): the pip wheels' ``nvidia/*/bin``
    directories on ``sys.path`` (``nvidia/cu13/bin`` for the CUDA 13 wheels,
    ``nvidia/cuda_<tool>/bin`` for the CUDA 12 ones), ``$CUDA_PATH/bin``, then ``$PATH``.
    """
    for d in sys.path:
        root = Path(d or ".") / "nvidia"
        if root.is_dir():
            for exe in sorted(root.glob("*/bin/" + name)):
                if os.access(exe, os.X_OK):
                    return str(exe)
    for var in ("CUDA_PATH", "CUDA_HOME"):
        root = os.environ.get(var)
        if root and os.access(os.path.join(root, "bin", name), os.X_OK):
            return os.path.join(root, "bin", name)
    return shutil.which(name)


def available():
    """``(True, "")`` when NVRTC and a disassembler can be used, else ``(False, reason)``."""
    ok, why = nvrtc.available()
    if not ok:
        return False, why
    if not any(find_tool(t) for t in TOOLS):
        return False, ("neither cuobjdump nor nvdisasm found: pip install nvidia-cuda-cuobjdump "
                       "nvidia-cuda-nvdisasm (or put the CUDA toolkit's bin/ on $PATH)")
    return True, ""


def disassemble(cubin):
    """SASS text of a cubin (``bytes``), by ``cuobjdump -sass`` or else ``nvdisasm``."""
    for tool in TOOLS:
        exe = find_tool(tool)
        if exe is None:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "kernel.cubin")
            with open(path, "wb") as f:
                f.write(cubin)
            cmd = [exe, "-sass", path] if tool == "cuobjdump" else [exe, "-c", path]
            return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    raise RuntimeError(available()[1])


# ---- parsing --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Instruction:
    """One SASS instruction: byte address, opcode (``HMMA.16816.F32``), operands, branch target."""
    address: int
    opcode: str
    operands: str = ""
    target: int = None  # BRA: the address it jumps to

    @property
    def base(self):
        """The opcode without modifiers (``HMMA``)."""
        return self.opcode.split(".")[0]


_FUNCTION = re.compile(r"^\s*(?:Function : (\S+)|\.text\.([^:\s]+):)")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_TARGET = re.compile(r"0x([0-9a-f]+)|`\((\.L_x_\d+)\)")


def _branch_target(opcode, operands, labels):
    """Target address of a ``BRA`` (``0x1f30`` from cuobjdump, ``(.L_x_3)`` from nvdisasm)."""
    if opcode.split(".")[0] != "BRA":
        return None
    m = _TARGET.search(operands)
    if m is None:
        return None
    return int(m.group(1), 16) if m.group(1) else labels.get(m.group(2))


def parse(text):
    """``{mangled function name: [Instruction]}`` from ``cuobjdump -sass`` or ``nvdisasm`` output."""
    raw, labels, name, pending = {}, {}, None, []
    for line in text.splitlines():
        m = _FUNCTION.match(line)
        if m:
            name = m.group(1) or m.group(2)
            raw.setdefault(name, [])
            continue
        m = _LABEL.match(line)
        if m:
            pending.append(m.group(1))  # nvdisasm: the label names the next instruction's address
            continue
        m = _INSTR.search(line)
        if m and name is not None:
            address = int(m.group(1), 16)
            for label in pending:
                labels[(name, label)] = address
            pending = []
            raw[name].append((address, m.group(2), m.group(3).strip()))
    out = {}
    for name, rows in raw.items():
        fn_labels = {lab: a for (n, lab), a in labels.items() if n == name}
        out[name] = [Instruction(a, op, ops, _branch_target(op, ops, fn_labels)) for a, op, ops in rows]
    return out


# ---- loops ----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LoopStats:
    """Static counts over a loop body (each instruction once, nested loops included once)."""
    instructions: int
    hmma: int = 0
    ldsm: int = 0
    lds: int = 0
    sts: int = 0
    ldgsts: int = 0
    ldg: int = 0
    stg: int = 0
    atomic: int = 0   # global reductions and atomics (RED, REDG, ATOM, ATOMG)
    mufu: int = 0
    bar: int = 0
    ffma: int = 0     # SIMT kernels: fp32 FMAs
    dfma: int = 0     # SIMT kernels: fp64 FMAs
    lds64: int = 0    # of the LDS / STS: 8- and 16-byte wide ones (LDS.64, LDS.128, ...)
    lds128: int = 0
    sts64: int = 0
    sts128: int = 0
    ldg128_run: int = 0   # the most 16-byte global loads in a row with no shared store between them:
                          # sm_75's copies (no cp.async) have that many loads in flight at once

    @property
    def per_hmma(self):
        """Instructions per HMMA (``inf`` when the body has none)."""
        return self.instructions / self.hmma if self.hmma else float("inf")

    @property
    def fma(self):
        """Scalar FMAs (FFMA + DFMA): the SIMT kernels' useful work."""
        return self.ffma + self.dfma

    @property
    def per_fma(self):
        """Instructions per FFMA/DFMA (``inf`` when the body has none)."""
        return self.instructions / self.fma if self.fma else float("inf")

    @classmethod
    def count(cls, instructions):
        counts = dict.fromkeys((f.name for f in dataclasses.fields(cls)), 0)
        run = 0
        for ins in instructions:
            counts["instructions"] += 1
            column = CATEGORIES.get(ins.base)
            if column:
                counts[column] += 1
            width = ins.opcode.split(".")[1:]
            if column in ("lds", "sts"):
                for bits in ("64", "128"):
                    if bits in width:
                        counts[column + bits] += 1
            if column == "sts":
                run = 0
            elif column == "ldg" and "128" in width:
                run += 1
                counts["ldg128_run"] = max(counts["ldg128_run"], run)
        return cls(**counts)


@dataclasses.dataclass(frozen=True)
class Loop:
    """A backward branch's range ``[start, end]`` (byte addresses), its counts, and nested loops."""
    start: int
    end: int
    stats: LoopStats
    nested: int = 0        # loops strictly inside this one
    nested_hmma: int = 0   # HMMA inside those nested loops (a rolled inner loop)
    nested_stats: LoopStats = None   # counts over the instructions inside nested loops holding an FMA
    nested_ldsm: int = 0   # ldmatrix inside the nested loops

    @property
    def per_hmma(self):
        return self.stats.per_hmma

    @property
    def per_fma(self):
        return self.stats.per_fma


def loops(instructions):
    """Every loop of a function (one per backward branch), outermost first."""
    spans = sorted({(i.target, i.address) for i in instructions
                    if i.target is not None and i.target <= i.address}, key=lambda s: (s[0], -s[1]))
    out = []
    for start, end in spans:
        body = [i for i in instructions if start <= i.address <= end]
        inner = [(s, e) for s, e in spans if start <= s and e <= end and (s, e) != (start, end)]
        in_inner = [i for i in body if any(s <= i.address <= e for s, e in inner)]
        # nested_stats: the nested loops that hold an FFMA/DFMA (SIMT: rolled micro-GEMM steps)
        fma_inner = [(s, e) for s, e in inner
                     if any(s <= i.address <= e and i.base in ("FFMA", "DFMA") for i in body)]
        in_fma = [i for i in body if any(s <= i.address <= e for s, e in fma_inner)]
        nested = LoopStats.count(in_inner)
        out.append(Loop(start, end, LoopStats.count(body), len(inner), nested.hmma, LoopStats.count(in_fma),
                        nested.ldsm))
    return out


def key_loop(instructions, column="hmma"):
    """The steady-state key-tile loop: most HMMA, then fewest instructions (module docstring).

    ``column="fma"``: the same rule on FFMA + DFMA (the SIMT kernels). Returns ``None`` when no
    loop holds one.
    """
    candidates = [lp for lp in loops(instructions) if getattr(lp.stats, column)]
    if not candidates:
        return None
    return min(candidates, key=lambda lp: (-getattr(lp.stats, column), lp.stats.instructions, lp.start))


# ---- occupancy ------------------------------------------------------------------------------------
KB = 1024
#: Per-SM limits: (shared memory per SM, max warps, max blocks, shared memory reserved per block).
ARCH_LIMITS = {75: (64 * KB, 32, 16, 0), 80: (164 * KB, 64, 32, KB), 86: (100 * KB, 48, 16, KB),
               89: (100 * KB, 48, 24, KB), 90: (228 * KB, 64, 32, KB)}
REGISTERS_PER_SM = 64 * KB
REGISTER_UNIT = 256       # registers are allocated per warp in units of 256
SUB_PARTITIONS = 4        # a warp's registers come from one of the SM's 4 register-file quarters
SMEM_UNIT = 128           # shared memory is allocated per block in units of 128 bytes


@dataclasses.dataclass(frozen=True)
class Occupancy:
    """Theoretical resident blocks and warps per SM, and the resource that limits them."""
    blocks: int
    warps: int
    limiter: str   # "registers", "shared memory", "warps" or "blocks"


def occupancy(arch, registers, threads, smem):
    """Blocks and warps one SM of ``arch`` holds (the CUDA occupancy calculator's rules).

    Parameters
    ----------
    arch : int
        Compute capability (75, 80, 86, 89, 90).
    registers : int
        Registers per thread (ptxas).
    threads : int
        Threads per block.
    smem : int
        Shared memory per block in bytes (dynamic + static), without the reserved 1 KB.
    """
    smem_per_sm, max_warps, max_blocks, reserved = ARCH_LIMITS[tiles.arch_number(arch)]
    warps = -(-threads // 32)
    per_warp = -(-max(registers, 1) * 32 // REGISTER_UNIT) * REGISTER_UNIT
    warps_by_regs = (REGISTERS_PER_SM // SUB_PARTITIONS // per_warp) * SUB_PARTITIONS
    per_block = -(-(smem + reserved) // SMEM_UNIT) * SMEM_UNIT
    limits = {"registers": warps_by_regs // warps, "shared memory": smem_per_sm // per_block,
              "warps": max_warps // warps, "blocks": max_blocks}
    limiter = min(limits, key=limits.get)
    return Occupancy(limits[limiter], limits[limiter] * warps, limiter)


# ---- the kernels the library uses -----------------------------------------------------------------
#: Roles: the forward, and the backward's dK/dV and dQ kernels of the recomputing deterministic
#: mode, the atomic dK/dV(+dQ) kernel, and the ordered one (the deterministic default on tensor
#: cores: atomic dQ added in key-block order, ``cuda_backward.dq_mode``).
ROLES = ("fwd", "bwd_dkv", "bwd_dq", "bwd_dkv_atomic", "bwd_dkv_ordered")
#: The same roles of the SIMT (scalar FMA) kernels: fp32, fp64 (``--simt``; issue 12).
SIMT_ROLES = ("fwd_simt", "bwd_dkv_simt", "bwd_dq_simt", "bwd_dkv_atomic_simt")
DTYPE_LABELS = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}
#: Issue 9's targets for the key-tile loop, instructions per HMMA (the backward: every role).
FORWARD_TARGETS = {64: 6.5, 128: 5.5}
BACKWARD_TARGET = 5.0
#: ``kernel_specs`` arguments of ``benchmarks/sass.py --quick`` (the pre-stop hook, the default test).
QUICK = dict(archs=(90,), dtypes=("float16",), head_dims=(64, 128))
#: ``kernel_specs`` arguments of the full report.
FULL = dict(archs=(80, 90), dtypes=("float16", "bfloat16"), head_dims=(64, 128, 256))
#: ``simt_kernel_specs`` arguments of ``benchmarks/sass.py --simt --quick`` and ``--simt``.
SIMT_QUICK = dict(archs=(90,), dtypes=("float32",), head_dims=(64, 128))
SIMT_FULL = dict(archs=(80, 90), dtypes=("float32", "float64"), head_dims=(64, 128))


def target(role, head_dim):
    """Issue 9's instructions-per-HMMA target; forward D > 128 is held to the D = 128 one."""
    if role != "fwd":
        return BACKWARD_TARGET
    return FORWARD_TARGETS[64] if head_dim <= 64 else FORWARD_TARGETS[128]


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One tensor-core instantiation: what it is for, its source and name expression, its launch."""
    role: str
    dtype: str
    head_dim: int
    arch: int
    source: str
    name: str
    threads: int
    smem: int      # dynamic shared memory, bytes
    block_m: int = 0   # SIMT specs: Br, Bc (the useful FMAs per block visit)
    block_n: int = 0

    @property
    def label(self):
        return "%s %s d%d" % (self.role, DTYPE_LABELS[self.dtype], self.head_dim)

    @property
    def simt(self):
        return self.role in SIMT_ROLES

    @property
    def fma_per_visit(self):
        """SIMT: useful FMAs per thread per (query block, key block) visit: Br x Bc x (the inner
        dims of the role's products) / threads. Forward S, PV: d + dv; dK/dV: S, dP, dV, dK:
        2d + 2dv (atomic mode + dQ: 3d + 2dv); dQ: S, dP, dQ: 2d + dv. 0 for tensor-core specs."""
        d = self.head_dim
        inner = {"fwd_simt": 2 * d, "bwd_dkv_simt": 4 * d, "bwd_dkv_atomic_simt": 5 * d,
                 "bwd_dq_simt": 3 * d}.get(self.role, 0)
        return self.block_m * self.block_n * inner / self.threads


def _forward_spec(dtype, d, arch, causal):
    # the wide-row tile where a long call takes it (non-causal; causal where tiles.causal_takes_wide)
    t = tiles.forward_tile(dtype, d, d, arch, wide=not causal or tiles.causal_takes_wide(dtype, d, d, arch),
                           causal=causal)
    if t.kernel != "tensor_core":
        return []
    return [KernelSpec("fwd", dtype, d, arch, t.source, t.name_expression(causal, True), t.n_threads, t.smem)]


def _backward_specs(dtype, d, arch, causal):
    if cuda_backward.default_kernel(dtype, arch) != "tc":
        return []
    out = []
    for deterministic, ordered, roles in ((True, False, {"dkv": "bwd_dkv", "dq": "bwd_dq"}),
                                          (False, False, {"dkv": "bwd_dkv_atomic"}),
                                          (True, True, {"dkv": "bwd_dkv_ordered"})):
        plan = cuda_backward.kernel_plan(dtype, d, d, causal=causal, deterministic=deterministic, arch=arch,
                                         ordered=ordered)
        for key, role in roles.items():
            source, name, t = plan[key]
            out.append(KernelSpec(role, dtype, d, arch, source, name, t.n_threads, t.smem))
    return out


def _simt_specs(dtype, d, arch, causal):
    t = tiles.forward_tile(dtype, d, d, arch, kernel="simt")
    out = [KernelSpec("fwd_simt", dtype, d, arch, t.source, t.name_expression(causal, True), t.n_threads, t.smem,
                      t.block_m, t.block_n)]
    for deterministic, roles in ((True, {"dkv": "bwd_dkv_simt", "dq": "bwd_dq_simt"}),
                                 (False, {"dkv": "bwd_dkv_atomic_simt"})):
        plan = cuda_backward.kernel_plan(dtype, d, d, causal=causal, deterministic=deterministic, arch=arch,
                                         kernel="simt")
        for key, role in roles.items():
            source, name, bt = plan[key]
            out.append(KernelSpec(role, dtype, d, arch, source, name, bt.n_threads, bt.smem, bt.block_m, bt.block_n))
    return out


def simt_kernel_specs(archs=(80, 90), dtypes=("float32", "float64"), head_dims=(64, 128), roles=SIMT_ROLES,
                      causal=False):
    """The SIMT instantiations (forward, dK/dV, dQ, atomic dK/dV) the library launches for these
    archs, dtypes and head dims, tiles as a call picks them (:func:`kernel_specs`' rules)."""
    return [s for arch in archs for dtype in dtypes for d in head_dims
            for s in _simt_specs(dtype, d, arch, causal) if s.role in roles]


def kernel_specs(archs=(80, 90), dtypes=("float16", "bfloat16"), head_dims=(64, 128, 256),
                 roles=ROLES, causal=False):
    """The tensor-core instantiations the library launches for these archs, dtypes and head dims.

    Tiles come from :mod:`~flasharray._private.tiles` (forward) and
    :func:`~flasharray._private.cuda_backward.kernel_plan` (backward), as a call would pick them;
    rows are 16-byte aligned (cp.async paths), ``causal`` as given.
    """
    specs = []
    for arch in archs:
        for dtype in dtypes:
            for d in head_dims:
                found = _forward_spec(dtype, d, arch, causal) + _backward_specs(dtype, d, arch, causal)
                specs += [s for s in found if s.role in roles]
    return specs


# ---- the report -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class KernelReport:
    """A kernel's key-tile loop (``None``: no loop holds an HMMA), ptxas resources, occupancy."""
    spec: KernelSpec
    loop: Loop
    registers: int
    spill_bytes: int      # spill stores + spill loads
    static_smem: int
    occupancy: Occupancy

    @property
    def target(self):
        return target(self.spec.role, self.spec.head_dim)

    def as_dict(self):
        """Plain data for ``--json``."""
        d = {"kernel": self.spec.label, **dataclasses.asdict(self.spec), "registers": self.registers,
             "spill_bytes": self.spill_bytes, "static_smem": self.static_smem,
             "occupancy": dataclasses.asdict(self.occupancy), "target_per_hmma": self.target, "loop": None}
        if self.spec.simt:
            d["target_per_hmma"] = None
            d["est_per_fma"] = round(estimated_per_fma(self), 3) if self.loop is not None else None
        if self.loop is not None:
            d["loop"] = {"start": self.loop.start, "end": self.loop.end, "nested": self.loop.nested,
                         "nested_hmma": self.loop.nested_hmma, "per_hmma": round(self.loop.per_hmma, 3),
                         **dataclasses.asdict(self.loop.stats)}
        return d


def _compile_group(arch, source, specs):
    """Compile one source's instantiations for one arch; a report per spec."""
    res = nvrtc.compile_cubin(launch.kernel_source(source), "sm_%d" % arch, [s.name for s in specs],
                              options=["--use_fast_math"])
    functions = parse(disassemble(res.cubin))
    out = []
    for s in specs:
        info = res.kernel(s.name)
        body = functions.get(info.lowered_name, [])
        occ = occupancy(arch, info.registers, s.threads, s.smem + info.static_smem)
        out.append(KernelReport(s, key_loop(body, "fma" if s.simt else "hmma"), info.registers, info.spill_stores + info.spill_loads,
                                info.static_smem, occ))
    return out


def report(specs, workers=None):
    """Compile, disassemble and analyse ``specs`` (one NVRTC program per arch and source, run
    ``workers`` at a time, default one per CPU); reports in the order of ``specs``.

    Raises
    ------
    RuntimeError
        When NVRTC or both disassemblers are missing (the message says what to install).
    """
    ok, why = available()
    if not ok:
        raise RuntimeError("SASS report unavailable: " + why)
    groups = {}
    for s in specs:
        groups.setdefault((s.arch, s.source), []).append(s)
    with ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
        done = pool.map(lambda item: _compile_group(item[0][0], item[0][1], item[1]), groups.items())
        by_name = {(r.spec.arch, r.spec.name): r for group in done for r in group}
    return [by_name[(s.arch, s.name)] for s in specs]


# ---- the table ------------------------------------------------------------------------------------
COLUMNS = ("kernel", "sm", "instr", "HMMA", "instr/HMMA", "target", "nested (HMMA)", "LDSM", "LDS/STS",
           "LDGSTS", "LDG/STG/atom", "MUFU", "BAR", "regs", "spill B", "smem KB", "blocks/warps per SM")


def _row(r):
    """One report as the table's cells (a kernel without an HMMA loop shows dashes)."""
    s, occ = r.spec, r.occupancy
    resources = [str(r.registers), str(r.spill_bytes), "%.1f" % ((s.smem + r.static_smem) / KB),
                 "%d / %d (%s)" % (occ.blocks, occ.warps, occ.limiter)]
    lp = r.loop
    if lp is None:
        return [s.label, str(s.arch)] + ["-"] * 11 + resources
    st = lp.stats
    return [s.label, str(s.arch), str(st.instructions), str(st.hmma), "%.2f" % lp.per_hmma, "<= %g" % r.target,
            "%d (%d)" % (lp.nested, lp.nested_hmma), str(st.ldsm), "%d/%d" % (st.lds, st.sts), str(st.ldgsts),
            "%d/%d/%d" % (st.ldg, st.stg, st.atomic), str(st.mufu), str(st.bar)] + resources


def markdown(reports):
    """The report as a markdown table, one row per kernel and arch (SIMT reports: SIMT_COLUMNS)."""
    simt = bool(reports) and all(r.spec.simt for r in reports)
    columns, row = (SIMT_COLUMNS, _simt_row) if simt else (COLUMNS, _row)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row(r)) + " |" for r in reports]
    return "\n".join(lines)


# ---- SIMT kernels (issue 12) ----------------------------------------------------------------------
SIMT_COLUMNS = ("kernel", "sm", "Br x Bc", "instr", "FMA", "instr/FMA", "nested (FMA)", "FMA/visit",
                "est. instr/FMA", "LDS/FMA", "LDS (.64/.128)", "STS (.64/.128)", "LDG/STG/atom", "BAR", "regs", "spill B",
                "smem KB", "blocks/warps per SM")


def estimated_per_fma(r):
    """Dynamic instructions per useful FMA of one (query block, key block) visit, estimated.

    The key loop runs once per visit; a thread's useful FMAs per visit are
    ``spec.fma_per_visit``. Instructions outside nested FMA loops run once (a nested loop without
    FMAs, e.g. a rolled copy loop, is counted once: a lower bound); the nested FMA loops are
    assumed to run until they supply the remaining FMAs at their static instructions-per-FMA
    ratio. Without nested loops (fully unrolled) this is static instructions / useful FMAs,
    exact up to predicated-off work.
    """
    lp, useful = r.loop, r.spec.fma_per_visit
    if lp is None or not useful:
        return float("inf")
    inner = lp.nested_stats or LoopStats(0)
    top_instr, top_fma = lp.stats.instructions - inner.instructions, lp.stats.fma - inner.fma
    nested = inner.instructions * max(useful - top_fma, 0) / inner.fma if inner.fma else inner.instructions
    return (top_instr + nested) / useful


def _simt_row(r):
    s, occ = r.spec, r.occupancy
    resources = [str(r.registers), str(r.spill_bytes), "%.1f" % ((s.smem + r.static_smem) / KB),
                 "%d / %d (%s)" % (occ.blocks, occ.warps, occ.limiter)]
    head = [s.label, str(s.arch), "%d x %d" % (s.block_m, s.block_n)]
    lp = r.loop
    if lp is None:
        return head + ["-"] * 11 + resources
    st, inner = lp.stats, lp.nested_stats or LoopStats(0)
    return head + [str(st.instructions), str(st.fma), "%.2f" % lp.per_fma, "%d (%d)" % (lp.nested, inner.fma),
                   "%g" % s.fma_per_visit, "%.2f" % estimated_per_fma(r), "%.2f" % (st.lds / st.fma),
                   "%d (%d/%d)" % (st.lds, st.lds64, st.lds128), "%d (%d/%d)" % (st.sts, st.sts64, st.sts128),
                   "%d/%d/%d" % (st.ldg, st.stg, st.atomic), str(st.bar)] + resources


def simt_summary(reports):
    """One line per (dtype, d, arch): each backward kernel's estimated instructions per FMA over
    the forward's (issue 12's goal, backward at >= 0.8x the forward's FLOP rate: <= 1.25)."""
    fwd = {(r.spec.dtype, r.spec.head_dim, r.spec.arch): estimated_per_fma(r)
           for r in reports if r.spec.role == "fwd_simt"}
    lines = []
    for key, f in fwd.items():
        parts = ["%s %.2fx" % (r.spec.role, estimated_per_fma(r) / f) for r in reports
                 if r.spec.role != "fwd_simt" and (r.spec.dtype, r.spec.head_dim, r.spec.arch) == key]
        lines.append("%s d%d sm_%d: est. instr/FMA over the forward's: %s" % (DTYPE_LABELS[key[0]], key[1], key[2],
                                                                             ", ".join(parts)))
    spills = sum(1 for r in reports if r.spill_bytes)
    return "\n".join(lines + ["kernels with spills: %d" % spills])


def summary(reports):
    """One line: kernels over the issue's target, the worst ratio, spills."""
    over = [r for r in reports if r.loop is None or r.loop.per_hmma > r.target]
    spills = sum(1 for r in reports if r.spill_bytes)
    worst = max(reports, key=lambda r: r.loop.per_hmma if r.loop else float("inf"), default=None)
    text = "over the instr/HMMA target: %d of %d kernels" % (len(over), len(reports))
    if worst is not None and worst.loop is not None:
        text += "; worst %s sm_%d: %.2f (target %g)" % (worst.spec.label, worst.spec.arch, worst.loop.per_hmma,
                                                         worst.target)
    return text + "; kernels with spills: %d" % spills
