"""``python -m flasharray info [--dtype float16] [--head-dim 128] [--arch 80]``: the configuration."""
import argparse
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m flasharray", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    info = sub.add_parser("info", help="versions, devices, cache dirs and kernel/tile choices")
    info.add_argument("--dtype", help="float16, bfloat16, float32 or float64")
    info.add_argument("--head-dim", type=int, help="head dim D")
    info.add_argument("--arch", help="compute capability, e.g. 80 or sm_80")
    args = parser.parse_args(argv)
    if args.command != "info":
        parser.print_help()
        return 0 if args.command is None else 2
    from ._private.config import show_config
    try:
        show_config(dtype=args.dtype, head_dim=args.head_dim, arch=args.arch)
    except BrokenPipeError:  # `python -m flasharray info | head`: the reader left, not an error
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
