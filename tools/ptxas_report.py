#!/usr/bin/env python3
"""Registers and spills of the grouped-GEMM kernels built for sm_90a, without a GPU.

Usage (repository root, any machine with triton):
    PYTHONPATH=src python3 tools/ptxas_report.py [--shapes issue-a fine] [--no-variants] [--check]

Builds every case of :func:`distmoe.tools.sm90_build.grouped_gemm_cases` (the production
configs the layer launches at each shape, then the other flag combinations at ``fine``) and
of :func:`~distmoe.tools.sm90_build.other_kernel_cases` (every other kernel) with
``triton.compile`` for sm_90 and Triton's bundled ``ptxas -v``, and prints registers per
thread, spill-store bytes and shared memory per case, and the persistent Gluon kernels' cases
(:func:`~distmoe.tools.sm90_build.gluon_wgrad_cases`, :func:`~.gluon_w13_cases`, the fused
W13 + W2 :func:`~.gluon_fused_cases`, ...), ``--jobs`` builds at once. ``--check``
exits 1 if a case fails to build or needs more than 227 KiB of shared memory, or a production
case spills or has its wgmma pipeline serialized by ptxas (any of its "wgmma.mma_async
instructions are serialized" notes: C7514, a non-wgmma instruction touching an in-flight
accumulator; C7515, one defining an accumulator register inside a pipeline stage; ...); the
CPU test suite runs it so. A spill in a K loop costs
far more than one in an epilogue; the report says whether a kernel spills, not where.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"  # build for the GPU target even on a CPU machine


#: the cases of this run, for the forked build processes (set by main)
_CASES: list = []


def _build_fields(index: int) -> dict:
    """Build ``_CASES[index]``; the report's fields (the case itself stays in the parent)."""
    from distmoe.tools.sm90_build import build

    r = build(_CASES[index])
    return dict(regs=r.regs, spill_bytes=r.spill_bytes, smem_bytes=r.smem_bytes,
                error=r.error, wgmma_serialized=r.wgmma_serialized)


def main() -> int:
    from distmoe.tools.bench.workloads import SHAPES
    from distmoe.tools.sm90_build import (
        BuildReport,
        gluon_fused_cases,
        gluon_w2_cases,
        gluon_w2_dgrad_cases,
        gluon_w13_cases,
        gluon_wgrad_cases,
        grouped_gemm_cases,
        other_kernel_cases,
    )

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["issue-a", "fine"], choices=sorted(SHAPES))
    ap.add_argument("--no-variants", action="store_true",
                    help="production cases only (skip the other flag combinations and the "
                         "other kernels)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="builds run at once, one process each (default: the CPUs)")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 on a build failure, more than 227 KiB of shared memory, or a "
                         "spill or a wgmma pipeline serialized by ptxas in a production case")
    args = ap.parse_args()
    failed = 0
    cases = grouped_gemm_cases(tuple(args.shapes), variants=not args.no_variants)
    cases += [c for c in gluon_wgrad_cases(tuple(args.shapes)) + gluon_w13_cases(tuple(args.shapes))
              + gluon_w2_dgrad_cases(tuple(args.shapes)) + gluon_w2_cases(tuple(args.shapes))
              + gluon_fused_cases(tuple(args.shapes))
              if c.production or not args.no_variants]
    if not args.no_variants:
        cases += other_kernel_cases()
    global _CASES
    _CASES = cases
    jobs = max(1, min(args.jobs, len(cases)))
    print(f"{len(cases)} builds, {jobs} at a time (each line as its build finishes, in order)",
          flush=True)
    pool = None
    if jobs > 1:  # each build is one CPU-bound process; the cases stay here (forked)
        pool = multiprocessing.get_context("fork").Pool(jobs)
        results = pool.imap(_build_fields, range(len(cases)), chunksize=1)
    else:
        results = (_build_fields(i) for i in range(len(cases)))
    for case, fields in zip(cases, results, strict=True):
        r = BuildReport(case, **fields)
        if r.error:
            line = f"FAILED  {r.error}"
        else:
            line = (f"regs {r.regs:>4}  spill stores {r.spill_bytes:>5} B  "
                    f"smem {r.smem_bytes // 1024:>3} KiB")
            if r.wgmma_serialized:
                line += "  WGMMA SERIALIZED (ptxas)"
            if not r.ok:
                line += "  (production config: fails --check)"
        failed += not r.ok
        print(f"{case.label:70s} {line}", flush=True)
    if pool is not None:
        pool.close()
        pool.join()
    if failed:
        print(f"{failed} case(s) failed", file=sys.stderr)
    return 1 if (args.check and failed) else 0


if __name__ == "__main__":
    raise SystemExit(main())
