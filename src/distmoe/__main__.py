"""Command line: ``python -m distmoe {demo,plan,bench} ...``."""

from __future__ import annotations

import argparse
import sys


def _unavailable(sub, name: str, help_text: str, exc: ImportError):
    """Register ``name`` even when its module failed to import, so that calling it says why
    (an optional dependency missing, or a broken install) instead of vanishing from the
    choices."""
    sub.add_parser(name, help=f"{help_text} (unavailable here: {exc})", add_help=False)

    def run(_args) -> int:
        print(f"distmoe {name}: error: this command could not be imported ({type(exc).__name__}: "
              f"{exc}); the optional tools are installed with `pip install 'distmoe[tools]'`",
              file=sys.stderr)
        return 2

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distmoe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from .tools import demo, quiet_on_closed_pipe

    demo.add_arguments(sub.add_parser("demo", help="run the layer here and check it"))
    runners = {"demo": demo.run}
    unavailable = set()  # commands whose module failed to import: their arguments are not read
    try:
        from .tools import plan_cli

        plan_cli.add_arguments(sub.add_parser("plan", help="print an activation-memory plan"))
        runners["plan"] = plan_cli.run
    except ImportError as exc:
        runners["plan"] = _unavailable(sub, "plan", "print an activation-memory plan", exc)
        unavailable.add("plan")
    try:
        from .tools.bench import cli as bench_cli

        bench_cli.add_arguments(sub.add_parser("bench", help="benchmark on the GPU"))
        runners["bench"] = bench_cli.run
    except ImportError as exc:
        runners["bench"] = _unavailable(sub, "bench", "benchmark on the GPU", exc)
        unavailable.add("bench")
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in unavailable:  # what parse_args would have refused
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    # a closed stdout (`distmoe plan | head -1`): status 141, no traceback
    return quiet_on_closed_pipe(lambda: runners[args.command](args))


if __name__ == "__main__":
    sys.exit(main())
