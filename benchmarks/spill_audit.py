"""Spill audit: registers and spill bytes of every extension subset of the tensor-core kernels (no GPU).

The backward's fp16 / bf16 tensor-core kernels are instantiated once per extension subset (the
``kExt`` bits of ``cuda_forward.EXT_BITS``: window 1, ALiBi 2, softcap 4, block mask 8, dropout 16,
lengths 32; any of the 63 non-empty subsets can reach them through ``flasharray.Extensions``).
For each head dim, causal flag and arch this compiles, with NVRTC and ``-Xptxas=-v`` as the
static tests do (``--use_fast_math``), every instantiation a backward call can launch:

  dq        the recomputing dQ kernel (deterministic, ``dq="recompute"``: the mode taken with a
            window or a block mask),
  dkv       its dK/dV kernel,
  atomic    the dK/dV kernel with atomic dQ (``deterministic=False``),
  ordered   the dK/dV kernel with dQ added in key-block order (the deterministic default where
            ``cuda_backward._family_orders`` allows the bits),

and prints registers and spill bytes (stores + loads) per instantiation, then the ones that
spill. ``--forward``: the forward's extension variants instead (``tiles.forward_tile(ext=True)``,
plus the split-KV one). ``--loop``: also the key-tile loop's instructions per HMMA (cuobjdump,
``flasharray/_private/sass.py``'s rule), for the instantiations that spill or with ``--bits``.
``--dense-hash``: instead, a hash of the SASS (opcodes and operands) of every dense (kExt = 0)
backward instantiation that tests/test_static_backward.py or benchmarks/sass.py checks, per arch:
extension work must leave these unchanged.

Results are cached per instantiation in ``benchmarks/results/spill_audit.json`` under the hash of
``cuda_src`` (``launch.source_digest``): re-running after no kernel change compiles nothing.
The full fp16 backward audit is ~1,200 instantiations per arch (~10 min of one core each).

Usage: python benchmarks/spill_audit.py [--arch 80,90] [--dtype float16] [--d 64,128,256]
       [--roles dq,dkv,atomic,ordered] [--bits 4,20] [--causal both|yes|no] [--forward] [--loop]
       [--jobs 1] [--all-rows]
       python benchmarks/spill_audit.py --dense-hash [--arch 80,90]
"""
import argparse
import hashlib
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from flasharray._private import cuda_backward, cuda_forward, launch, nvrtc, sass, tiles  # noqa: E402

EXT_NAMES = {b: n for n, b in cuda_forward.EXT_BITS.items()}
ALL_BITS = sum(cuda_forward.EXT_BITS.values())
ROLES = ("dq", "dkv", "atomic", "ordered")
CACHE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "spill_audit.json")
CHUNK = 12  # instantiations per NVRTC program (one program: one front-end parse, ptxas per kernel)


def bit_names(bits):
    """``"softcap|dropout"`` for kExt 20."""
    return "|".join(EXT_NAMES[b] for b in sorted(EXT_NAMES) if bits & b) or "dense"


def backward_specs(arch, dtype, head_dims, causals, subsets, roles):
    """[(key, source, name, threads)] of the tensor-core backward's extension instantiations;
    key = (arch, dtype, role, d, causal, bits)."""
    if cuda_backward.default_kernel(dtype, arch) != "tc":
        return []
    out = []
    for d in head_dims:
        for causal in causals:
            for bits in subsets:
                plans = []
                if {"dq", "dkv"} & set(roles):
                    plans.append((cuda_backward.kernel_plan(dtype, d, d, causal=causal, deterministic=True, arch=arch,
                                                            ext=bits), {"dq": "dq", "dkv": "dkv"}))
                if "atomic" in roles:
                    plans.append((cuda_backward.kernel_plan(dtype, d, d, causal=causal, deterministic=False,
                                                            arch=arch, ext=bits), {"dkv": "atomic"}))
                if "ordered" in roles and cuda_backward._family_orders("tc", bits, tiles.pad_head_dim(d)):
                    plans.append((cuda_backward.kernel_plan(dtype, d, d, causal=causal, deterministic=True, arch=arch,
                                                            ext=bits, ordered=True), {"dkv": "ordered"}))
                for plan, which in plans:
                    for key, role in which.items():
                        if role in roles and key in plan:
                            source, name, t = plan[key]
                            out.append(((arch, dtype, role, d, causal, bits), source, name, t.n_threads))
    return out


def forward_specs(arch, dtype, head_dims, causals, subsets):
    """The forward's extension instantiations (tensor cores: also the split-KV one), same shape."""
    out = []
    for d in head_dims:
        t = tiles.forward_tile(dtype, d, d, arch, ext=True)
        for causal in causals:
            for bits in subsets:
                out.append(((arch, dtype, "fwd", d, causal, bits), t.source,
                            cuda_forward.forward_name_expression(t, causal, True, ext=bits), t.n_threads))
                if t.kernel == "tensor_core":
                    out.append(((arch, dtype, "fwd_split", d, causal, bits), t.source,
                                 cuda_forward.forward_name_expression(t, causal, True, split=True, ext=bits),
                                 t.n_threads))
    return out


def _load_cache():
    try:
        with open(CACHE) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _compile(arch, source, names, loop):
    """{name: result dict} for one NVRTC program."""
    res = nvrtc.compile_cubin(launch.kernel_source(source), "sm_%d" % arch, names, options=["--use_fast_math"])
    functions = sass.parse(sass.disassemble(res.cubin)) if loop else {}
    out = {}
    for n in names:
        k = res.kernel(n)
        r = {"regs": k.registers, "spill": k.spill_stores + k.spill_loads, "stack": k.stack_frame}
        if loop:
            lp = sass.key_loop(functions.get(k.lowered_name, []))
            r["loop"] = None if lp is None else {"instr": lp.stats.instructions, "hmma": lp.stats.hmma,
                                                 "per_hmma": round(lp.per_hmma, 3)}
        out[n] = r
    return out


def audit(specs, loop=False, jobs=1, progress=True):
    """{name@arch: result} for ``specs``, compiling what the cache lacks (saved after each program)."""
    digest = launch.source_digest()
    cache = _load_cache()
    mine = cache.setdefault(digest, {})
    todo = {}
    for key, source, name, _ in specs:
        r = mine.get("%s@%d" % (name, key[0]))
        if r is None or (loop and "loop" not in r):
            todo.setdefault((key[0], source), []).append(name)
    groups = [(arch, source, sorted(set(names))[i:i + CHUNK]) for (arch, source), names in todo.items()
              for i in range(0, len(set(names)), CHUNK)]
    total, done, t0 = sum(len(g[2]) for g in groups), 0, time.perf_counter()
    if progress and total:
        print("compiling %d instantiations in %d NVRTC programs (%d cached)" % (total, len(groups), len(specs) - total),
              flush=True)
    with ThreadPoolExecutor(jobs) as pool:
        for (arch, source, names), results in zip(groups, pool.map(lambda g: _compile(g[0], g[1], g[2], loop), groups)):
            for n, r in results.items():
                mine["%s@%d" % (n, arch)] = r
            done += len(names)
            os.makedirs(os.path.dirname(CACHE), exist_ok=True)
            with open(CACHE + ".tmp", "w") as f:
                json.dump({digest: mine}, f)  # entries of older sources are dropped
            os.replace(CACHE + ".tmp", CACHE)
            if progress:
                el = time.perf_counter() - t0
                print("  %d / %d  (%.0f s, ~%.0f s left)" % (done, total, el, el / done * (total - done)), flush=True)
    return {"%s@%d" % (name, key[0]): mine["%s@%d" % (name, key[0])] for key, _, name, _ in specs}


def dense_hashes(arch):
    """{name: sha256 of the SASS text} of the dense tensor-core backward instantiations (flash_bwd.cu)
    of tests/test_static_backward.py and benchmarks/sass.py on ``arch``."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import test_static_backward  # noqa: E402 (the tests' own list of instantiations)
    items = set(test_static_backward.instantiations(arch).get("flash_bwd.cu", {}))
    # and the SASS report's (benchmarks/sass.py: fp16 / bf16, head dims 64, 128, 256, every role)
    items |= {s.name for causal in (False, True) for s in sass.kernel_specs(archs=(arch,), causal=causal)
              if s.source == "flash_bwd.cu"}
    items = sorted(items)
    out = {}
    for i in range(0, len(items), CHUNK):
        names = items[i:i + CHUNK]
        res = nvrtc.compile_cubin(launch.kernel_source("flash_bwd.cu"), "sm_%d" % arch, names,
                                  options=["--use_fast_math"])
        functions = sass.parse(sass.disassemble(res.cubin))
        for n in names:
            body = functions[res.kernel(n).lowered_name]
            out[n] = hashlib.sha256("\n".join("%s %s" % (x.opcode, x.operands) for x in body).encode()).hexdigest()[:16]
        print("  %d / %d" % (min(i + CHUNK, len(items)), len(items)), flush=True)
    return out


def _row(key, name, r):
    arch, dtype, role, d, causal, bits = key
    lp = r.get("loop")
    return "sm_%d %-4s %-9s d%-3d %-6s kExt %2d %-44s regs %3d  spill B %4d%s" % (
        arch, {"float16": "fp16", "bfloat16": "bf16"}.get(dtype, dtype), role, d, "causal" if causal else "-", bits,
        bit_names(bits), r["regs"], r["spill"], "  instr/HMMA %.2f (%d/%d)" % (lp["per_hmma"], lp["instr"], lp["hmma"])
        if lp else "")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="80,90", help="compute capabilities (default 80,90)")
    ap.add_argument("--dtype", default="float16", help="float16 and/or bfloat16, comma-separated")
    ap.add_argument("--d", default="64,128,256", help="head dims (default 64,128,256)")
    ap.add_argument("--roles", default=",".join(ROLES), help="backward roles: dq, dkv, atomic, ordered")
    ap.add_argument("--bits", default=None, help="kExt values (default: all 63 non-empty subsets)")
    ap.add_argument("--causal", default="both", choices=("both", "yes", "no"))
    ap.add_argument("--forward", action="store_true", help="the forward's extension variants instead")
    ap.add_argument("--loop", action="store_true", help="instructions per HMMA of the key-tile loop too")
    ap.add_argument("--jobs", type=int, default=1, help="NVRTC programs compiled at once (default 1)")
    ap.add_argument("--dense-hash", action="store_true",
                    help="hash the SASS of the dense backward instantiations of tests/test_static_backward.py")
    ap.add_argument("--all-rows", action="store_true", help="print every instantiation, not only the spilling ones")
    args = ap.parse_args(argv)
    ok, why = sass.available() if args.loop or args.dense_hash else nvrtc.available()
    if not ok:
        print("spill audit unavailable: %s" % why)
        return 2
    archs = [int(a.replace("sm_", "")) for a in args.arch.split(",")]
    if args.dense_hash:
        for arch in archs:
            hashes = dense_hashes(arch)
            for n, h in sorted(hashes.items()):
                print("sm_%d %s %s" % (arch, h, n))
            print("sm_%d: %d dense instantiations, combined %s" % (arch, len(hashes), hashlib.sha256(
                "".join(h for _, h in sorted(hashes.items())).encode()).hexdigest()[:16]))
        return 0
    head_dims = [int(x) for x in args.d.split(",")]
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    subsets = [int(b) for b in args.bits.split(",")] if args.bits else list(range(1, ALL_BITS + 1))
    roles = tuple(args.roles.split(","))
    specs = []
    for arch in archs:
        for dtype in args.dtype.split(","):
            if args.forward:
                specs += forward_specs(arch, dtype, head_dims, causals, subsets)
            else:
                specs += backward_specs(arch, dtype, head_dims, causals, subsets, roles)
    t0 = time.perf_counter()
    results = audit(specs, loop=False, jobs=args.jobs)
    spilling = [(key, name) for key, _, name, _ in specs if results["%s@%d" % (name, key[0])]["spill"]
                or results["%s@%d" % (name, key[0])]["stack"]]
    if args.loop:
        wanted = specs if args.bits else [s for s in specs if (s[0], s[2]) in set(spilling)]
        results.update(audit(wanted, loop=True, jobs=args.jobs))
    if args.all_rows:
        for key, _, name, _ in specs:
            print(_row(key, name, results["%s@%d" % (name, key[0])]))
    print("%d instantiations, %d spill (%.0f s):" % (len(specs), len(spilling), time.perf_counter() - t0))
    for key, name in spilling:
        print(_row(key, name, results["%s@%d" % (name, key[0])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
