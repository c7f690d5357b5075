"""SASS report: instructions per HMMA in the tensor-core kernels' key-tile loops (no GPU needed).

Compiles every tensor-core kernel the library launches (forward; backward dK/dV, dQ and the
atomic-mode dK/dV) with NVRTC, disassembles it with cuobjdump (pip install nvidia-cuda-cuobjdump
nvidia-cuda-nvdisasm), finds the steady-state key-tile loop (the loop with the most HMMA; ties:
the fewest instructions) and prints its instruction mix, instructions per HMMA next to issue 9's
target, registers, spills, shared memory and the theoretical occupancy per SM.
The analysis lives in flasharray/_private/sass.py; docs/performance.md explains every column.

--simt: the SIMT (scalar FMA) kernels instead (fp32 and fp64, D 64 and 128; --quick: fp32 on
sm_90): the loop with the most FFMA/DFMA, instructions per FMA, the useful FMAs per (query block,
key block) visit and the estimated dynamic instructions per useful FMA (issue 12).

Usage: python benchmarks/sass.py [--simt] [--quick] [--arch 80,90] [--causal] [--json report.json]
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from flasharray._private import sass  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fp16, D 64 and 128, sm_90 only (~10 s)")
    ap.add_argument("--arch", default=None, help="comma-separated compute capabilities (default 80,90; "
                                                  "--quick: 90); 75, 80, 86, 89, 90 are known")
    ap.add_argument("--simt", action="store_true", help="the SIMT kernels (fp32, fp64) instead")
    ap.add_argument("--causal", action="store_true", help="the causal instantiations instead")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON ('-': stdout)")
    args = ap.parse_args(argv)
    ok, why = sass.available()
    if not ok:
        print("SASS report unavailable: %s" % why)
        return 2
    if args.simt:
        config = dict(sass.SIMT_QUICK if args.quick else sass.SIMT_FULL)
    else:
        config = dict(sass.QUICK if args.quick else sass.FULL)
    if args.arch:
        config["archs"] = tuple(int(a.replace("sm_", "")) for a in args.arch.split(","))
    t0 = time.perf_counter()
    specs = sass.simt_kernel_specs if args.simt else sass.kernel_specs
    reports = sass.report(specs(causal=args.causal, **config))
    if args.json:
        text = json.dumps([r.as_dict() for r in reports], indent=1)
        if args.json == "-":
            print(text)
            return 0
        with open(args.json, "w") as f:
            f.write(text + "\n")
    what = "instructions per FFMA/DFMA (SIMT)" if args.simt else "instructions per HMMA vs issue 9's targets"
    print("SASS key-tile loops (%s, %s): %s; %.0f s" % ("causal" if args.causal else "non-causal",
                                                        "quick" if args.quick else "full", what, time.perf_counter() - t0))
    print(sass.markdown(reports))
    print(sass.simt_summary(reports) if args.simt else sass.summary(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
