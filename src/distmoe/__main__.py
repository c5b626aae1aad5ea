"""Command line: ``python -m distmoe {demo,plan,bench,ab,profile,tune,scaling} ...``.

* ``demo``: run the layer here (CPU ranks or every GPU) and check it against the reference;
* ``plan``: the activation-memory plan of a layer, or its kernel plan (``--kernels``);
* ``bench``: the benchmark suite against plain PyTorch and the GPU's ceilings;
* ``ab``: time kernel-plan variants of one layer against its plan, interleaved;
* ``profile``: one layer step under torch.profiler, trace timelines, Nsight Compute stall
  tables, sm_90 register and spill reports;
* ``tune``: time one kernel over its launch configs;
* ``scaling``: the expected time of a layer at EP = 8 to 256 from measured EP=1 times and the
  links' bandwidths (docs/scaling.md).

``python -m distmoe CMD --help`` lists a command's options (no GPU needed).
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: command -> (module under distmoe.tools, one-line help)
COMMANDS = {
    "demo": ("demo", "run the layer here and check it"),
    "plan": ("plan_cli", "print a layer's activation-memory plan or its kernel plan"),
    "bench": ("bench.cli", "benchmark the layer against plain PyTorch and GPU ceilings"),
    "ab": ("ab", "time kernel-plan variants of one layer against its plan, interleaved"),
    "profile": ("profile", "profile one layer step; read traces, ncu tables, ptxas reports"),
    "tune": ("tune", "time one kernel over its launch configs"),
    "scaling": ("scaling", "model a layer's time past one node from measured EP=1 times"),
}


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
    parser = argparse.ArgumentParser(
        prog="distmoe", description=__doc__.split("\n\n")[0],
        epilog="`python -m distmoe CMD --help` lists a command's options.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="CMD")
    from .tools import quiet_on_closed_pipe

    runners = {}
    unavailable = set()  # commands whose module failed to import: their arguments are not read
    for name, (module, help_text) in COMMANDS.items():
        try:
            mod = importlib.import_module(f".tools.{module}", __package__)
        except ImportError as exc:
            if name == "demo":  # the library's own command: a failure here is a bug
                raise
            runners[name] = _unavailable(sub, name, help_text, exc)
            unavailable.add(name)
            continue
        mod.add_arguments(sub.add_parser(name, help=help_text))
        runners[name] = mod.run
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in unavailable:  # what parse_args would have refused
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    # a closed stdout (`distmoe plan | head -1`): status 141, no traceback
    return quiet_on_closed_pipe(lambda: runners[args.command](args))


if __name__ == "__main__":
    sys.exit(main())
