"""Redraw the plots and reprint the table of a finished run from its ``results.json``.

    PYTHONPATH=src python benchmarks/replot.py out/bench/results.json [--out DIR]

Useful after copying a run back from the GPU machine, or after changing a plot.
"""

import argparse
import json
import sys
from pathlib import Path

from distmoe.tools.bench import report
from distmoe.tools.bench.cli import case_work


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", type=Path, help="results.json of a run")
    parser.add_argument("--out", type=Path, help="where to write the PNGs (default: beside it)")
    args = parser.parse_args(argv)
    try:
        data = json.loads(args.results.read_text())
        data["cases"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        parser.error(f"{args.results}: not a readable results.json of a bench run "
                     f"({type(exc).__name__}: {exc})")
    out = args.out or args.results.parent
    out.mkdir(parents=True, exist_ok=True)

    cases = [report.CaseResult(**c) for c in data["cases"]]
    ceilings = {c["name"]: c for c in data.get("ceilings", [])}
    dense = (ceilings.get("dense_bf16") or {}).get("value")
    model = data.get("roofline_model") or {}
    peak = model.get("peak_tflops") or dense or 989.0
    hbm = model.get("hbm_gbps") or (ceilings.get("device_copy") or {}).get("value") or 4800.0
    source = model.get("source") or ("measured" if dense else "H200 datasheet")
    intensity = {}
    for c in cases:
        flops, nbytes, _ = case_work(c)
        intensity[id(c)] = flops / nbytes

    written = [
        report.plot_tflops(cases, dense, out / "tflops.png"),
        report.plot_roofline(
            cases,
            peak_tflops=peak,
            hbm_gbps=hbm,
            intensity=intensity,
            path=out / "roofline.png",
            source=source,
        ),
    ]
    if model.get("curves"):
        marks = {}
        for c in cases:
            marks.setdefault(c.shape, set()).add(c.tokens)
        written.append(
            report.plot_roofline_model(
                model["curves"], source=source, path=out / "roofline_model.png", marks=marks
            )
        )
    micro_rows = (data.get("micro") or {}).get("rows") or []
    written += report.plot_micro(micro_rows, out)
    print("wrote " + " ".join(str(p) for p in written if p is not None))
    print(report.format_table(cases, data.get("ceilings", [])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
