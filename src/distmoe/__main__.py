"""Command line: ``python -m distmoe {demo,plan,bench} ...``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distmoe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from .tools import demo

    demo.add_arguments(sub.add_parser("demo", help="run the layer here and check it"))
    try:
        from .tools import plan_cli

        plan_cli.add_arguments(sub.add_parser("plan", help="print an activation-memory plan"))
    except ImportError:
        plan_cli = None
    try:
        from .tools.bench import cli as bench_cli

        bench_cli.add_arguments(sub.add_parser("bench", help="benchmark on the GPU"))
    except ImportError:
        bench_cli = None
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo.run(args)
    if args.command == "plan":
        return plan_cli.run(args)
    return bench_cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
