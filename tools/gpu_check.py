#!/usr/bin/env python3
"""Build, check and time distmoe on a GPU machine in one call; prints a short table last.

Usage (repository root, no install needed):
    python3 tools/gpu_check.py [--tests EXPR] [--bench ARGS] [--bench-nproc N] [--out DIR]

Issue 8 (four or eight GPUs), in one call:
    python3 tools/gpu_check.py --paths tests --bench-nproc 8 \
        --bench "--mode both --imbalance 1 8" --out $OUT

Steps:
  1. environment: GPU name and count, torch / triton versions;
  2. the GPU test suite: ``pytest -m "gpu or multigpu"`` (with ``-k EXPR`` when --tests is given);
  3. optional benchmarks: ``python -m distmoe bench <ARGS>`` (the bench CLI writes CSV/JSON/PNG
     into --out);
  4. a table: step, result, seconds. Exit status 0 only if every step ran and passed (the
     test step with at least one test run, not all skipped); 2 without a CUDA GPU.
Logs and the JUnit XML go to --out (default: $OUT when set, else ./gpu_check_out).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cmd: list[str], log_path: str, timeout: float) -> tuple[int, float]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    start = time.monotonic()
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.monotonic() - start


def _tail(path: str, lines: int = 40) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tests", default=None, help="pytest -k expression for the GPU tests")
    ap.add_argument("--paths", nargs="+", default=["tests"], help="test paths")
    ap.add_argument("--no-tests", action="store_true", help="skip the GPU test suite")
    ap.add_argument("--bench", default=None, help="arguments for `python -m distmoe bench`")
    ap.add_argument("--bench-nproc", type=int, default=1,
                    help="ranks for the bench (> 1: torchrun, one GPU per rank, EP = ranks)")
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "gpu_check_out")),
                    help="logs, JUnit XML and bench outputs (default: $OUT, else "
                         "./gpu_check_out)")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds per step")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows: list[tuple[str, str, bool, float]] = []  # step, result, ok, seconds

    import torch
    import triton

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    name = torch.cuda.get_device_name(0) if n else "no GPU"
    print(f"device: {n} x {name}; torch {torch.__version__}; triton {triton.__version__}",
          flush=True)
    if not n:
        print("gpu_check: error: no CUDA GPU in this process (the GPU tests would all skip "
              "and the bench would not measure a GPU)", file=sys.stderr)
        return 2

    if not args.no_tests:
        xml = os.path.join(args.out, "gpu_tests.xml")
        log = os.path.join(args.out, "gpu_tests.log")
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu or multigpu", "-p", "no:cacheprovider",
               f"--junitxml={xml}", *args.paths]
        if args.tests:
            cmd += ["-k", args.tests]
        rc, secs = _run(cmd, log, args.timeout)
        print(_tail(log), flush=True)
        summary, ok = f"rc={rc}", False
        if os.path.exists(xml):
            suite = ET.parse(xml).getroot()
            suite = suite if suite.tag == "testsuite" else suite[0]
            total, fail, err, skip = (int(suite.get(k, 0)) for k in
                                      ("tests", "failures", "errors", "skipped"))
            passed = total - fail - err - skip
            summary = f"{passed} passed, {fail + err} failed, {skip} skipped (rc={rc})"
            ok = rc == 0 and passed > 0  # a run where everything skipped checked nothing
        rows.append(("gpu tests", summary, ok, secs))

    if args.bench is not None:
        log = os.path.join(args.out, "bench.log")
        cmd = [sys.executable, "-m", "distmoe", "bench", "--out", args.out,
               *shlex.split(args.bench)]
        if args.bench_nproc > 1:
            cmd[1:3] = ["-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={args.bench_nproc}", "-m", "distmoe"]
        rc, secs = _run(cmd, log, args.timeout)
        print(_tail(log, 80), flush=True)
        rows.append(("bench", f"rc={rc}", rc == 0, secs))

    print("\n| step | result | seconds |\n|---|---|---|")
    for step, result, ok, secs in rows:
        print(f"| {step} | {result}{'' if ok else ' FAILED'} | {secs:.0f} |")
    return 0 if all(ok for _, _, ok, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
