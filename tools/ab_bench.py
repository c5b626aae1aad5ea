#!/usr/bin/env python3
"""Layer-level A/B of launch configs: ``python -m distmoe bench`` with heuristics overridden.

Usage (repository root, one GPU; everything after ``--`` goes to the bench):
    PYTHONPATH=src python3 tools/ab_bench.py \\
        --set w13:training:num_stages=4 --set w13:inference:tma_epilogue=False \\
        -- --mode both --shapes issue-a --providers distmoe --no-ceilings --no-plots

Kernel-level tuners (``tools/tune_gemm.py``, ``tools/tune_wgrad.py``) time one kernel alone
and have disagreed with the layer (performance.md run 19: 4 W13 stages were 7% faster in the
tuner and 0.5% slower in the layer). This script keeps the layer as the judge: each
``--set KERNEL[:WHEN]:FIELD=VALUE[,FIELD=VALUE...]`` replaces fields of the config that
``KERNEL``'s ``from_heuristic`` returns, for every call in this process:

* ``KERNEL``: ``w13`` (W13Config), ``w2`` (W2Config), ``w2_dgrad`` (W2DgradConfig),
  ``w13_dgrad`` (W13DgradConfig), ``wgrad`` (WgradConfig);
* ``WHEN`` (``w13`` only, whose heuristic takes ``training``): ``training``, ``inference``
  or ``any`` (default);
* ``VALUE``: an int, ``True`` / ``False``, or a tuple of ints written ``1x2x3``.

The overrides are printed first, so the log names the variant. Run the unmodified bench in
the same call for the baseline; compare within one call only (clocks drift between calls).

On two GPUs, one rank per GPU (EP=2; arguments this script does not know go to the bench,
since ``torch.distributed.run`` drops a ``--`` right after the script)::

    PYTHONPATH=src python3 -m torch.distributed.run --standalone --nproc-per-node=2 \
        tools/ab_bench.py --set w2:gluon=False -- --mode fwd --shapes fine --no-plots
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

_CLASSES = {
    "w13": ("distmoe.kernels.w13_gather_swiglu", "W13Config"),
    "w2": ("distmoe.kernels.w2_scatter", "W2Config"),
    "w2_dgrad": ("distmoe.kernels.w2_backward", "W2DgradConfig"),
    "w13_dgrad": ("distmoe.kernels.w13_backward", "W13DgradConfig"),
    "wgrad": ("distmoe.kernels.w2_backward", "WgradConfig"),
    "combine": ("distmoe.kernels.combine", "CombineConfig"),
}


def _value(text: str):
    if text in ("True", "False"):
        return text == "True"
    if "x" in text:
        return tuple(int(v) for v in text.split("x"))
    return int(text)


def parse_override(spec: str) -> tuple[str, str, dict]:
    """``KERNEL[:WHEN]:FIELD=VALUE[,...]`` -> (kernel, when, fields); ValueError if malformed."""
    parts = spec.split(":")
    if len(parts) == 2:
        kernel, when, assignments = parts[0], "any", parts[1]
    elif len(parts) == 3:
        kernel, when, assignments = parts
    else:
        raise ValueError(f"--set {spec!r}: expected KERNEL[:WHEN]:FIELD=VALUE[,...]")
    if kernel not in _CLASSES:
        raise ValueError(f"--set {spec!r}: kernel must be one of {sorted(_CLASSES)}")
    if when not in ("any", "training", "inference") or (when != "any" and kernel != "w13"):
        raise ValueError(f"--set {spec!r}: WHEN must be any, or training / inference for w13")
    fields = {}
    for item in assignments.split(","):
        name, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"--set {spec!r}: {item!r} is not FIELD=VALUE")
        try:
            fields[name] = _value(text)
        except ValueError:
            raise ValueError(f"--set {spec!r}: {name}={text!r}: VALUE must be an int, True / "
                             "False, or a tuple of ints written 1x2x3") from None
    return kernel, when, fields


def install(overrides: list[tuple[str, str, dict]]) -> None:
    """Wrap each named class's ``from_heuristic`` so that it applies the overrides."""
    import importlib

    for kernel in {k for k, _, _ in overrides}:
        module, name = _CLASSES[kernel]
        cls = getattr(importlib.import_module(module), name)
        names = {f.name for f in dataclasses.fields(cls)}
        mine = [(when, fields) for k, when, fields in overrides if k == kernel]
        for _, fields in mine:
            unknown = set(fields) - names
            if unknown:
                raise ValueError(f"{name} has no field(s) {sorted(unknown)}")
        original = cls.from_heuristic.__func__

        def patched(c, *args, _original=original, _mine=tuple(mine), **kwargs):
            cfg = _original(c, *args, **kwargs)
            training = kwargs.get("training", False)
            for when, fields in _mine:
                if when == "any" or (when == "training") == training:
                    cfg = dataclasses.replace(cfg, **fields)
            return cfg

        cls.from_heuristic = classmethod(patched)


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(--set specs, bench arguments)`` of this script's command line. Everything after
    ``--`` goes to the bench, and so does everything this script does not know:
    ``torch.distributed.run`` drops a ``--`` that directly follows the script's name, so
    ``torchrun ... tools/ab_bench.py -- --mode fwd`` arrives as ``--mode fwd``."""
    bench_args = []
    if "--" in argv:
        cut = argv.index("--")
        argv, bench_args = argv[:cut], argv[cut + 1:]
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], allow_abbrev=False,
        epilog="Every other argument (and all after --) goes to `python -m distmoe bench`; "
               "see `python -m distmoe bench --help`.")
    ap.add_argument("--set", action="append", default=[], metavar="SPEC",
                    help="KERNEL[:WHEN]:FIELD=VALUE[,FIELD=VALUE...] (repeatable); KERNEL one "
                         "of w13, w2, w2_dgrad, w13_dgrad, wgrad; WHEN (w13 only) training, "
                         "inference or any")
    args, rest = ap.parse_known_args(argv)
    return args.set, rest + bench_args


def main() -> int:
    specs, bench_args = split_args(sys.argv[1:])
    try:
        overrides = [parse_override(spec) for spec in specs]
    except ValueError as exc:
        print(f"ab_bench.py: error: {exc}", file=sys.stderr)
        return 2
    print("ab_bench overrides:", overrides or "none (the heuristics as they are)", flush=True)
    try:
        install(overrides)
    except ValueError as exc:  # a field the config class does not have
        print(f"ab_bench.py: error: --set: {exc}", file=sys.stderr)
        return 2
    from distmoe.__main__ import main as distmoe_main

    return distmoe_main(["bench", *bench_args])


if __name__ == "__main__":
    raise SystemExit(main())
