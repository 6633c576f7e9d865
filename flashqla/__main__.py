"""``python -m flashqla {info,check,bench,precompile}`` (also installed as the ``flashqla`` command)."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from .cli import bench, check, info, precompile
    parser = argparse.ArgumentParser(prog="python -m flashqla",
                                     description="flashqla: GDN chunked linear attention, many backends")
    sub = parser.add_subparsers(dest="command", metavar="{info,check,bench,precompile}")
    info.add_parser(sub)
    check.add_parser(sub)
    bench.add_parser(sub)
    precompile.add_parser(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
