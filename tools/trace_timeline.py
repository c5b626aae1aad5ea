#!/usr/bin/env python3
"""One step of a layer as a GPU timeline, from a Chrome trace of ``tools/profile_layer.py``.

Usage (repository root, on any machine; the trace comes from a GPU run):
    python3 tools/profile_layer.py --shape fine --mode fwd --graph --steps 3 --trace t.json
    python3 tools/trace_timeline.py t.json --steps 3          (EP=1)
    python3 tools/trace_timeline.py t.json.rank0 t.json.rank1 --steps 3   (EP>1, ranks in turn)

Prints the last of ``--steps`` steps: every GPU kernel, copy and memset with its start (us,
from the step's first event), duration (us), stream and name, in start order. The profiled
steps replay one CUDA graph, so each holds the same events; the trace's GPU events are split
into ``--steps`` equal parts and the last is shown. A copy-engine copy shows as ``Memcpy``
(``PtoP`` between GPUs) on its own stream. ``.gz`` traces are read as they are.

docs/performance.md runs 30-32 read their timelines this way (``perf/*/*timeline*.txt``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys

#: Chrome-trace categories of GPU work
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def last_step(events: list[dict], steps: int) -> list[dict]:
    """The GPU events of the last of ``steps`` equal steps, in start order."""
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES),
                 key=lambda e: e["ts"])
    if steps < 1:
        raise ValueError(f"steps ({steps}) must be >= 1")
    if not gpu or len(gpu) % steps:
        raise ValueError(f"{len(gpu)} GPU events do not split into {steps} equal steps "
                         "(pass the --steps the trace was profiled with)")
    return gpu[-(len(gpu) // steps):]


def format_step(events: list[dict], width: int = 90) -> list[str]:
    """Lines ``start duration stream name`` of one step's events (microseconds)."""
    t0 = events[0]["ts"]
    return [f"{e['ts'] - t0:9.1f} {e['dur']:8.1f}  s{e.get('tid', '?')}  {e['name'][:width]}"
            for e in events]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+", help="Chrome trace files (.json or .json.gz)")
    ap.add_argument("--steps", type=int, default=5,
                    help="steps in the trace (profile_layer.py's --steps)")
    args = ap.parse_args(argv)
    print("# start (us, from the step's first event), duration (us), stream, name")
    for path in args.traces:
        opener = gzip.open if path.endswith(".gz") else open
        try:
            with opener(path, "rt") as f:
                events = json.load(f)["traceEvents"]
        except (OSError, ValueError, KeyError) as exc:  # missing, not JSON, not a trace
            ap.error(f"{path}: not a readable Chrome trace ({type(exc).__name__}: {exc})")
        try:
            step = last_step(events, args.steps)
        except ValueError as exc:
            print(f"{path}: {exc}", file=sys.stderr)
            return 1
        print(f"\n## {path}")
        print("\n".join(format_step(step)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
