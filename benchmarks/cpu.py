"""CPU benchmark: flasharray's cpu backend vs naive float32 attention vs PyTorch's CPU SDPA.

For each sequence length N, head dim D and causal flag (8 heads, batch 1, float32) it measures
forward and forward+backward wall time (best of ``--repeats`` after a warm-up) and the peak
resident memory above the process baseline. Every measurement runs in a fresh subprocess so
that peak memory (``ru_maxrss``) belongs to that one implementation and shape.

* ``flasharray``: ``flash_attention_forward`` + ``flash_attention_backward`` (backend "cpu")
* ``naive-fp32``: ``flasharray.reference`` in float32 (materialises S and P: O(N²) memory;
  skipped where it would need more than ``--naive-max-gb``)
* ``torch-sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` + autograd backward,
  only when PyTorch is installed (never a dependency of flasharray)

Results are validated first (flasharray vs the float64 reference on a small shape), then
printed as a table with ratios against torch (or naive) measured in the same run, and plotted
to ``--out`` (default ``benchmarks/results/cpu.png``) when matplotlib is available.

    python benchmarks/cpu.py                    # the full grid (takes several minutes)
    python benchmarks/cpu.py --quick            # N in {512, 1024, 2048}, D = 64
    python benchmarks/cpu.py --sizes 4096 --dims 64 --no-causal
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
HEADS = 8


def _rss_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak():
    """Reset VmHWM (the peak RSS) to the current RSS: Linux >= 4.0, ``clear_refs`` value 5."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _worker(impl, N, D, causal, repeats):
    """Runs in a subprocess: time forward and forward+backward, report the peak RSS above what
    the process held after creating the inputs (so: the implementation's own working memory)."""
    import numpy as np
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, HEADS, N, D), dtype=np.float32) for _ in range(4))
    import flasharray  # noqa: F401  (imports are not the implementation's working memory)
    if impl == "torch-sdpa":
        import torch  # noqa: F401
    exact = _reset_peak()
    base = _rss_kb("VmRSS") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if impl == "flasharray":
        import flasharray as fa

        def fwd():
            return fa.flash_attention_forward(q, k, v, causal=causal, backend="cpu")

        def fwd_bwd():
            out, lse = fwd()
            return fa.flash_attention_backward(dout, q, k, v, out, lse, causal=causal, backend="cpu")
    elif impl == "naive-fp32":
        from flasharray import reference

        def fwd():
            return reference.attention(q, k, v, causal=causal, dtype=np.float32)

        def fwd_bwd():
            fwd()
            return reference.attention_backward(dout, q, k, v, causal=causal, dtype=np.float32)
    elif impl == "torch-sdpa":
        import torch
        tq, tk, tv, tdo = (torch.from_numpy(x) for x in (q, k, v, dout))
        F = torch.nn.functional.scaled_dot_product_attention

        def fwd():
            with torch.no_grad():
                return F(tq, tk, tv, is_causal=causal)

        def fwd_bwd():
            a, b, c = (t.detach().requires_grad_() for t in (tq, tk, tv))
            F(a, b, c, is_causal=causal).backward(tdo)
            return a.grad, b.grad, c.grad
    else:
        raise ValueError(impl)

    def best(fn):
        fn()  # warm-up (thread pools, BLAS buffers)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    t_fwd = best(fwd)
    t_fb = best(fwd_bwd)
    peak = _rss_kb("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"fwd_s": t_fwd, "fwd_bwd_s": t_fb, "peak_mb": max(0, peak - base) / 1024.0}


def _run(impl, N, D, causal, repeats):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", impl, str(N), str(D),
           str(int(causal)), str(repeats)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        return {"error": res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "failed"}
    return json.loads(res.stdout.strip().splitlines()[-1])


def _validate():
    import numpy as np
    import flasharray as fa
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 300, 64), dtype=np.float32) for _ in range(3))
    for causal in (False, True):
        out, lse = fa.flash_attention_forward(q, k, v, causal=causal)
        dout = np.ones_like(out)
        grads = fa.flash_attention_backward(dout, q, k, v, out, lse, causal=causal)
        fa.testing.assert_attention_close(out, q, k, v, causal=causal, lse=lse, dout=dout, grads=grads)
    print("validated: cpu backend matches the float64 reference (fp32, causal and not)")


def _have_torch():
    try:
        import torch  # noqa: F401
        return True
    except ImportError:
        return False


def _plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "fwd_s", "forward"), (axes[1], "fwd_bwd_s", "forward+backward")):
        series = {}
        for r in rows:
            if key in r["res"]:
                label = "%s D=%d%s" % (r["impl"], r["D"], " causal" if r["causal"] else "")
                series.setdefault(label, []).append((r["N"], r["res"][key] * 1e3))
        colors = {"flasharray": "tab:blue", "naive-fp32": "tab:gray", "torch-sdpa": "tab:orange"}
        for label, pts in sorted(series.items()):
            pts.sort()
            impl, rest = label.split(" ", 1)
            style = {"D=64": "-", "D=64 causal": "--", "D=128": "-.", "D=128 causal": ":"}.get(rest, "-")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label,
                    color=colors.get(impl), linestyle=style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N (8 heads, fp32)")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=6)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    print("plot saved to %s" % path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--no-causal", action="store_true", help="only non-causal")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="N in {512, 1024, 2048}, D = 64, 1 repeat")
    ap.add_argument("--naive-max-gb", type=float, default=6.0,
                    help="skip the naive reference where its S/P matrices would exceed this")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cpu.png"))
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.dims, args.repeats = [512, 1024, 2048], [64], 1
    _validate()
    impls = ["flasharray", "naive-fp32"] + (["torch-sdpa"] if _have_torch() else [])
    if "torch-sdpa" not in impls:
        print("PyTorch not installed: comparing against the naive reference only")
    print("threads: %d cores" % (os.cpu_count() or 1))
    header = "%-26s | %-11s | %9s | %9s | %9s | %6s | %6s" % (
        "shape (B=1,H=8,N,D)", "impl", "fwd ms", "f+b ms", "peak MB", "fwd x", "f+b x")
    print(header)
    print("-" * len(header))
    rows = []
    for causal in ([False] if args.no_causal else [False, True]):
        for D in args.dims:
            for N in args.sizes:
                res = {}
                for impl in impls:
                    naive_gb = 3 * HEADS * N * N * 4 / 2**30  # S, P and dP alive together
                    if impl == "naive-fp32" and naive_gb > args.naive_max_gb:
                        res[impl] = {"error": "skipped (needs ~%.0f GB)" % naive_gb}
                        continue
                    res[impl] = _run(impl, N, D, causal, args.repeats)
                base = res.get("torch-sdpa") if "fwd_s" in res.get("torch-sdpa", {}) else None
                for impl in impls:
                    r = res[impl]
                    shape = "N=%d D=%d %s" % (N, D, "causal" if causal else "full")
                    rows.append({"impl": impl, "N": N, "D": D, "causal": causal, "res": r})
                    if "error" in r:
                        print("%-26s | %-11s | %s" % (shape, impl, r["error"]))
                        continue
                    rf = "%6.2f" % (r["fwd_s"] / base["fwd_s"]) if base else "   -  "
                    rb = "%6.2f" % (r["fwd_bwd_s"] / base["fwd_bwd_s"]) if base else "   -  "
                    print("%-26s | %-11s | %9.1f | %9.1f | %9.1f | %s | %s" % (
                        shape, impl, r["fwd_s"] * 1e3, r["fwd_bwd_s"] * 1e3, r["peak_mb"], rf, rb),
                        flush=True)
    print("ratios are time / torch-sdpa time in the same run (lower is better)")
    _plot(rows, args.out)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        impl, N, D, causal, repeats = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), bool(int(sys.argv[5])), int(sys.argv[6])
        print(json.dumps(_worker(impl, N, D, causal, repeats)))
    else:
        main()
