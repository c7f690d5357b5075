"""Host microseconds per call: what our Python costs around the kernels (issue 10 §1).

Two modes:

* ``--device null`` (default; runs anywhere, CI included): the emulator path on NumPy arrays with
  every kernel launch replaced by a no-op (``launch.null_launches``). Pointers are bound as for
  CuPy, so what is measured is the host work of a CUDA call minus the driver's launch
  (NumPy's address lookup, ~2 µs per array, is slower than CuPy's). Targets: ≤ 15 µs per cached
  forward call, ≤ 25 µs per backward.
* ``--device cuda`` (a GPU): the same calls end to end on CuPy arrays: host time to issue a call
  (no synchronisation inside the loop) and wall time per call including the kernel
  (synchronised at the end); PyTorch SDPA's figures beside ours when torch with CUDA is
  importable. Target: ≤ 30 µs per forward call.

Each figure is the fastest of ``--repeat`` runs of ``--number`` calls (mean per call), timed
by the wall clock (``--timer wall``, default) or by the process's CPU time (``--timer cpu``:
``time.process_time``, the same figure on an idle machine, and far steadier on a machine
other jobs load, since time spent waiting for a core is not counted; no-op launcher only).
The breakdowns of the cached forward, backward and KV-cache calls time their parts alone:
building the signature key, the cache lookup, the allocations, the address lookups, binding
pointers + the launches (KV-cache: the per-call value check and the append too); "rest" is the
difference to the whole call (function calls, argument passing). The NumPy address lookups are
timed as the code does them: ``launch.host_address`` for the alignment in a signature key,
``a.ctypes.data`` for each handle the no-op launcher binds.

    python benchmarks/overhead.py                # no-op launcher
    python benchmarks/overhead.py --timer cpu    # the same, CPU time (a loaded machine)
    python benchmarks/overhead.py --device cuda
"""
import argparse
import sys
import time
import timeit
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flasharray as fa  # noqa: E402
from flasharray._private import api, launch  # noqa: E402

SHAPE = (1, 1, 128, 64)   # (B, H, L, D): the small problem
TARGETS_US = {"forward": 15.0, "backward": 25.0}


TIMERS = {"wall": time.perf_counter, "cpu": time.process_time}
_timer = [time.perf_counter]


def per_call_us(stmt, number, repeat):
    """Fastest of ``repeat`` runs: mean µs of ``number`` calls of ``stmt()`` (the minimum is the
    least disturbed by other work on the machine, as timeit recommends)."""
    stmt()  # first call: planning, compilation
    runs = timeit.Timer(stmt, timer=_timer[0]).repeat(number=number, repeat=repeat)
    return min(runs) / number * 1e6


def make_inputs(xp, dtype=np.float16, shape=SHAPE, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, do = (xp.asarray(rng.standard_normal(shape).astype(dtype)) for _ in range(4))
    return q, k, v, do


def calls(backend, q, k, v, do):
    """name -> zero-argument callable, for the forward, backward and (if present) KV-cache call."""
    out, lse = fa.flash_attention_forward(q, k, v, backend=backend)
    fns = {"forward": lambda: fa.flash_attention(q, k, v, backend=backend),
           "backward": lambda: fa.flash_attention_backward(do, q, k, v, out, lse, backend=backend)}
    kv = getattr(fa, "flash_attention_with_kvcache", None)
    if kv is not None:
        xp = np if isinstance(q, np.ndarray) else __import__("cupy")
        B, H, L, D = q.shape
        k_cache = xp.zeros((B, H, 2 * L, D), dtype=q.dtype)
        v_cache = xp.zeros((B, H, 2 * L, D), dtype=q.dtype)
        k_cache[:, :, :L], v_cache[:, :, :L] = k, v
        seqlens = xp.full((B,), L - 1, dtype=np.int32)
        q1, k1, v1 = q[..., :1, :], k[..., :1, :], v[..., :1, :]
        def kvcache_call():
            return kv(q1, k_cache, v_cache, seqlens, k_new=k1, v_new=v1, backend=backend)
        kvcache_call.arrays = (q1, k_cache, v_cache, seqlens, k1, v1, None)  # kvcache_breakdown
        fns["kvcache (Lq=1, 1 new)"] = kvcache_call
        # the same without the values' check (no device->host copy: no synchronisation on a GPU)
        fns["kvcache, check_values=False"] = lambda: kv(q1, k_cache, v_cache, seqlens, k_new=k1, v_new=v1,
                                                        backend=backend, check_values=False)
    return fns


def forward_breakdown(q, k, v, backend, number, repeat):
    """µs of each part of a cached forward call (see the module docstring)."""
    fa.flash_attention(q, k, v, backend=backend)
    key = api._call_key("fwd", (q, k, v), (False, None), backend, {})
    run = api._CACHE[key]
    plan = run.__self__ if hasattr(run, "__self__") else None
    parts = {"signature key": lambda: api._call_key("fwd", (q, k, v), (False, None), backend, {}),
             "cache lookup": lambda: api._CACHE.get(key)}
    if plan is not None:
        xp, pointer = plan.xp, plan.launcher.pointer
        arrays = (q, k, v) + (xp.empty(plan.out_shape, plan.dtype), xp.empty(plan.lse_shape, plan.acc))
        parts["allocate out, lse"] = lambda: (xp.empty(plan.out_shape, dtype=plan.dtype),
                                              xp.empty(plan.lse_shape, dtype=plan.acc))
        handle = plan.launcher.handle
        parts["bind pointers + launch (%d)" % len(plan.launches)] = lambda: [
            rec(pointer, handles) for handles in [tuple(map(handle, arrays))] for rec in plan.launches]
        if backend == "cuda":  # the launch as CuPy's RawKernel makes it: every argument converted per call
            handles = tuple(map(handle, arrays))
            calls = [(rec.call, rec.grid, rec.block, rec.arguments(pointer, handles)) for rec in plan.launches]
            parts["  compare: the same by RawKernel (%d arguments)" % len(calls[0][3])] = lambda: [
                call(grid, block, args) for call, grid, block, args in calls]
    times = {name: per_call_us(fn, number, repeat) for name, fn in parts.items()}
    if isinstance(q, np.ndarray) and plan is not None:
        # NumPy-only cost inside the parts above (CuPy: a field read each): the key's alignment
        # checks of q, k, v (launch.host_address) and one handle per array (a.ctypes.data).
        times["  of which NumPy address lookups (%d)" % (3 + len(arrays))] = _numpy_lookups_us(
            q, 3, len(arrays), number, repeat)
    return times


def _numpy_lookups_us(a, in_key, handles, number, repeat):
    """µs of ``in_key`` alignment lookups (``launch.host_address``) and ``handles`` handle lookups
    (``a.ctypes.data``, as the no-op launcher's ``handle``) on NumPy array ``a``."""
    return (in_key * per_call_us(lambda: launch.host_address(a), number, repeat)
            + handles * per_call_us(lambda: a.ctypes.data, number, repeat))


def uncached_us(fn, number, repeat):
    """µs per call when every call plans afresh (the cache cleared before each)."""
    def cold():
        launch._clear_plans()
        fn()
    return per_call_us(cold, max(number // 10, 1), repeat)


def backward_breakdown(q, k, v, do, backend, number, repeat):
    """µs of each part of a cached backward call (``cuda_backward.BackwardPlan.run``)."""
    out, lse = fa.flash_attention_forward(q, k, v, backend=backend)
    arrays = (do, q, k, v, out, lse)
    fa.flash_attention_backward(*arrays, backend=backend)
    flags = (False, None, True)  # causal, scale, deterministic
    key = api._call_key("bwd", arrays, flags, backend, {})
    run = api._CACHE[key]
    plan = run.__self__ if hasattr(run, "__self__") else None
    parts = {"signature key": lambda: api._call_key("bwd", arrays, flags, backend, {}),
             "cache lookup": lambda: api._CACHE.get(key)}
    if plan is None or not hasattr(plan, "replay"):
        return {name: per_call_us(fn, number, repeat) for name, fn in parts.items()}
    launcher = plan.launcher
    handle, carve, allocations = launcher.handle, launcher.carve, plan.allocations
    handles = [handle(a) for a in arrays] + carve(allocations)[1]
    n_parts = sum(len(alloc[2]) for alloc in allocations)
    parts["handles of the %d inputs" % len(arrays)] = lambda: [handle(a) for a in arrays]
    parts["allocate %d buffers (%d allocation%s)" % (n_parts, len(allocations), "s" * (len(allocations) > 1))] = \
        lambda: carve(allocations)
    parts["bind pointers + launch (%d)" % len(plan.launches)] = lambda: plan.replay(handles)
    times = {name: per_call_us(fn, number, repeat) for name, fn in parts.items()}
    if isinstance(q, np.ndarray):
        n = 2 * len(arrays)  # the key's alignment checks and the handles, one each per input
        times["NumPy address lookups (%d), within the above" % n] = _numpy_lookups_us(q, len(arrays), len(arrays),
                                                                                     number, repeat)
    return times


def kvcache_breakdown(q, k, v, backend, number, repeat):
    """µs of each part of a cached ``flash_attention_with_kvcache`` call (Lq = 1, one new token;
    ``kvcache.flash_attention_with_kvcache``), or {} when that call takes no kernel path."""
    from flasharray._private import cuda_forward, kvcache
    fn = calls(backend, q, k, v, None)["kvcache (Lq=1, 1 new)"]
    fn()
    arrays, flags = fn.arrays, (True, None, False, None, None, True)  # causal, scale, return_lse, num_splits, precision, check_values
    key = kvcache._call_key(arrays, flags, backend)
    entry = kvcache._CALLS[key]
    c = entry.rebind(*arrays)
    if not c.kernel:
        return {}
    seqlens = kvcache._host_values(c)[0]
    lengths = c.seqlens + np.int32(c.L_new)
    parts = {"signature key": lambda: kvcache._call_key(arrays, flags, backend),
             "cache lookup": lambda: kvcache._CALLS.get(key),
             "bind the arrays to the validated call": lambda: entry.rebind(*arrays),
             "cache_seqlens to the host, check values": lambda: kvcache._check_values(c, *kvcache._host_values(c))}
    if c.append is not None:  # one launch: k_new, v_new into the cache and the key counts
        parts["append kernel (new keys, key counts)"] = lambda: kvcache._append(c)
    else:
        parts["append k_new, v_new"] = lambda: kvcache._write_new(c, seqlens)
        parts["key counts for the kernel"] = lambda: c.seqlens + np.int32(c.L_new)
    parts.update({"forward_kvcache (plan kept)": lambda: cuda_forward.forward_kvcache(
                 c.q, c.k_cache, c.v_cache, lengths, c.block_table, causal=c.causal, scale=c.scale,
                 device=c.backend, num_splits=c.num_splits, memo=c.memo)})
    times = {name: per_call_us(fn, number, repeat) for name, fn in parts.items()}
    if isinstance(q, np.ndarray):
        # the key's alignment checks of q and the caches; handles of q, k_cache, v_cache, out, lse
        # and the key counts (+ the append's 6)
        n = 6 + (6 if c.append is not None else 0)
        times["  of which NumPy address lookups (%d)" % (3 + n)] = _numpy_lookups_us(q, 3, n, number, repeat)
    return times


def report(title, rows, targets=None):
    print("\n" + title)
    for name, us in rows.items():
        target = (targets or {}).get(name)
        note = "" if target is None else ("  target <= %.0f: %s" % (target, "met" if us <= target else "NOT met"))
        print("  %-42s %9.2f us%s" % (name, us, note))


def run_null(number, repeat):
    q, k, v, do = make_inputs(np)
    with launch.null_launches():
        fns = calls("emulator", q, k, v, do)
        cached = {name: per_call_us(fn, number, repeat) for name, fn in fns.items()}
        cold = {name: uncached_us(fn, number, repeat) for name, fn in fns.items()}
        parts = forward_breakdown(q, k, v, "emulator", number, repeat)
        bparts = backward_breakdown(q, k, v, do, "emulator", number, repeat)
        kparts = kvcache_breakdown(q, k, v, "emulator", number, repeat)
    timer = [name for name, t in TIMERS.items() if t is _timer[0]][0]
    print("flasharray %s, host overhead with a no-op launcher, fp16 %s (B, H, L, D); %s time, fastest of %d x %d calls"
          % (fa.__version__, SHAPE, timer, repeat, number))
    report("cached call (same signature as the previous call)", cached, TARGETS_US)
    report("uncached call (validation + planning every time)", cold)
    report_breakdowns(cached, parts, bparts, kparts)
    return cached


def report_breakdowns(cached, parts, bparts, kparts):
    """The forward, backward and KV-cache breakdowns, each with the rest of its whole call's time
    (``cached``: µs per call by name; parts whose name starts with a space or "N" are within others)."""
    for name, p in (("forward", parts), ("backward", bparts), ("kvcache (Lq=1, 1 new)", kparts)):
        if not p:
            continue
        p["rest (call layers)"] = cached[name] - sum(us for part, us in p.items() if part[0] not in " N")
        report("%s, cached: breakdown" % name, p)


def run_cuda(number, repeat):
    import cupy
    q, k, v, do = make_inputs(cupy)
    fns = calls("cuda", q, k, v, do)
    sync = cupy.cuda.Device().synchronize
    rows = {}
    for name, fn in fns.items():
        rows[name + ": host"] = per_call_us(fn, number, repeat)
        rows[name + ": end to end"] = per_call_us(lambda: (fn(), sync()), number, repeat)
    torch_rows = _torch_rows(q, k, v, number, repeat)
    print("flasharray %s on %s, fp16 %s (B, H, L, D)" % (fa.__version__, cupy.cuda.runtime.getDeviceProperties(
        cupy.cuda.Device().id)["name"].decode(), SHAPE))
    report("per call", rows, {"forward: end to end": 30.0})
    if torch_rows:
        report("PyTorch SDPA, same inputs", torch_rows)
    # where the host time goes (each part timed alone, no synchronisation: launches queue up)
    report_breakdowns({name: rows[name + ": host"] for name in fns},
                      forward_breakdown(q, k, v, "cuda", number, repeat),
                      backward_breakdown(q, k, v, do, "cuda", number, repeat),
                      kvcache_breakdown(q, k, v, "cuda", number, repeat))
    return rows


def _torch_rows(q, k, v, number, repeat):
    try:
        import torch
        if not torch.cuda.is_available():
            return {}
    except ImportError:
        return {}
    qt, kt, vt = (torch.as_tensor(x, device="cuda") for x in (q, k, v))
    f = torch.nn.functional.scaled_dot_product_attention
    return {"forward: host": per_call_us(lambda: f(qt, kt, vt), number, repeat),
            "forward: end to end": per_call_us(lambda: (f(qt, kt, vt), torch.cuda.synchronize()), number, repeat)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("null", "cuda"), default="null")
    ap.add_argument("--number", type=int, default=2000, help="calls per timing run")
    ap.add_argument("--repeat", type=int, default=5, help="timing runs (the fastest is reported)")
    ap.add_argument("--timer", choices=tuple(TIMERS), default="wall",
                    help="wall clock, or the process's CPU time (steadier on a loaded machine; no-op launcher only)")
    args = ap.parse_args(argv)
    if args.number < 1 or args.repeat < 1:
        ap.error("--number and --repeat must be >= 1")
    if args.device == "cuda":
        if args.timer != "wall":
            ap.error("--timer cpu: the GPU's work is not the process's CPU time; use the wall clock")
        return run_cuda(args.number, args.repeat)
    _timer[0] = TIMERS[args.timer]
    try:
        return run_null(args.number, args.repeat)
    finally:
        _timer[0] = time.perf_counter


if __name__ == "__main__":
    main()
