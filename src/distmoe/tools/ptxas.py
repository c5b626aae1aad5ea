"""Registers and spills of the kernels built for sm_90a, without a GPU
(``python -m distmoe profile --ptxas``).

Usage (any machine with triton)::

    python -m distmoe profile --ptxas [--shapes dense-e32 qwen3-30b-a3b] [--no-variants]
        [--check] [--jobs N]

Builds every case of :func:`distmoe.tools.sm90_build.grouped_gemm_cases` (the production
configs the layer launches at each shape, then the other flag combinations at ``fine``) and
of :func:`~distmoe.tools.sm90_build.other_kernel_cases` (every other kernel) and
:func:`~distmoe.tools.sm90_build.lowp_kernel_cases` (the low-precision GEMMs, quantisers and
scaled rowwise moves) with
``triton.compile`` for sm_90 and Triton's bundled ``ptxas -v``, and prints registers per
thread, spill-store bytes and shared memory per case, and the persistent Gluon kernels' cases
(:func:`~distmoe.tools.sm90_build.gluon_wgrad_cases`, :func:`~.gluon_w13_cases`, the fused
W13 + W2 :func:`~.gluon_fused_cases`, ...), ``--jobs`` builds at once. The builds need Triton
imported without its interpreter, which ``import distmoe`` turns on where there is no GPU:
:func:`main` runs them in a child process with ``TRITON_INTERPRET=0`` when it is on. ``--check``
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
import subprocess
import sys

#: the default shapes (the layer's production configs are built at each)
DEFAULT_SHAPES = ("dense-e32", "qwen3-30b-a3b")


#: the cases of this run, for the forked build processes (set by main)
_CASES: list = []


def _build_fields(index: int) -> dict:
    """Build ``_CASES[index]``; the report's fields (the case itself stays in the parent)."""
    from distmoe.tools.sm90_build import build

    r = build(_CASES[index])
    return dict(regs=r.regs, spill_bytes=r.spill_bytes, smem_bytes=r.smem_bytes,
                error=r.error, wgmma_serialized=r.wgmma_serialized)


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The report's options (also those of ``profile --ptxas``)."""
    from distmoe.tools.bench.workloads import SHAPES

    ap.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), metavar="NAME",
                    choices=sorted(SHAPES),
                    help=f"bench shapes of the production cases (default: "
                         f"{' '.join(DEFAULT_SHAPES)})")
    ap.add_argument("--no-variants", action="store_true",
                    help="production cases only (skip the other flag combinations and the "
                         "other kernels)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="builds run at once, one process each (default: the CPUs)")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 on a build failure, more than 227 KiB of shared memory, or a "
                         "spill or a wgmma pipeline serialized by ptxas in a production case")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Build and report (module docstring); returns the exit status."""
    ap = add_arguments(argparse.ArgumentParser(prog="distmoe profile --ptxas",
                                               description=__doc__.splitlines()[0]))
    args = ap.parse_args(argv)
    from distmoe.kernels.base.interpreter import interpreter_active

    if interpreter_active():  # the kernels are interpreted functions here: build in a child
        env = dict(os.environ, TRITON_INTERPRET="0")
        argv = sys.argv[1:] if argv is None else list(argv)
        return subprocess.run([sys.executable, "-m", "distmoe.tools.ptxas", *argv],
                              env=env).returncode
    return report(args)


def report(args: argparse.Namespace) -> int:
    """The builds and the printed report of parsed ``args`` (in a process whose Triton is not
    the interpreter)."""
    from distmoe.tools.sm90_build import (
        BuildReport,
        gluon_fused_cases,
        gluon_w2_cases,
        gluon_w2_dgrad_cases,
        gluon_w13_cases,
        gluon_wgrad_cases,
        grouped_gemm_cases,
        lowp_kernel_cases,
        other_kernel_cases,
    )

    failed = 0
    cases = grouped_gemm_cases(tuple(args.shapes), variants=not args.no_variants)
    cases += [c for c in gluon_wgrad_cases(tuple(args.shapes)) + gluon_w13_cases(tuple(args.shapes))
              + gluon_w2_dgrad_cases(tuple(args.shapes)) + gluon_w2_cases(tuple(args.shapes))
              + gluon_fused_cases(tuple(args.shapes))
              if c.production or not args.no_variants]
    if not args.no_variants:
        cases += other_kernel_cases() + lowp_kernel_cases()
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
