#!/usr/bin/env python3
"""Time the owner combine (:func:`distmoe.kernels.combine.combine`) over its launch configs.

Usage (repository root, one GPU):
    PYTHONPATH=src python3 tools/tune_combine.py [--shapes fine issue-a] [--reps 50]
        [--rounds 7] [--csv FILE]

For each named bench shape (T, D, K; every route active, fp32 scores, the layer's [T*K, D]
rows) every config of :meth:`CombineConfig.all_configs` and the heuristic's is first checked
against :func:`~distmoe.kernels.combine.combine_ref` on fresh random rows (output poisoned
with NaN before the run; bf16 outputs of one fp32 sum must agree to one bf16 rounding), then
all of them and a copy are timed against each other (``distmoe.tools.bench.timing.
interleaved``: ``--reps`` launches captured in one CUDA graph per candidate, one replay of
each per round in rotating order, ``--rounds`` rounds, the median per call), so that the
GPU's clock drift does not decide between configs timed minutes apart. Bytes moved are the
``T*K*D`` rows read plus the ``T*D`` output written; the line "copy" is
``torch.Tensor.copy_`` of the rows' size in the same rounds (a device bandwidth ceiling: it
reads and writes as many bytes). The table lists the heuristic, the five fastest configs and
the ceiling, fastest first.
"""

from __future__ import annotations

import argparse
import csv
import functools
import sys

import torch


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text}")
    return value


def main() -> int:
    from distmoe.kernels.combine import CombineConfig, combine, combine_ref
    from distmoe.tools import require_cuda
    from distmoe.tools.bench.timing import interleaved
    from distmoe.tools.bench.workloads import SHAPES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["fine", "issue-a"], choices=sorted(SHAPES))
    ap.add_argument("--reps", type=_positive, default=50, help="launches per CUDA graph")
    ap.add_argument("--rounds", type=_positive, default=7, help="interleaved rounds")
    ap.add_argument("--csv", default=None, help="also write every timing here")
    args = ap.parse_args()
    require_cuda("tune_combine.py")
    dev = torch.device("cuda")
    records = []
    for name in args.shapes:
        s = SHAPES[name]
        T, D, K = s.tokens, s.hidden, s.top_k
        g = torch.Generator(device=dev).manual_seed(0)
        rows = torch.randn(T * K, D, device=dev, generator=g).to(torch.bfloat16)
        ids = torch.randint(0, s.num_experts, (T, K), device=dev, generator=g, dtype=torch.int32)
        scores = torch.rand(T, K, device=dev, generator=g)
        want = combine_ref(rows, ids, scores, torch.empty(T, D, device=dev, dtype=torch.bfloat16))
        nbytes = (T * K * D + T * D) * 2
        heuristic = CombineConfig.from_heuristic(hidden=D)
        configs = [heuristic] + [c for c in CombineConfig.all_configs() if c != heuristic]
        y = torch.empty(T, D, device=dev, dtype=torch.bfloat16)
        fns = {}
        for i, cfg in enumerate(configs):
            y.fill_(float("nan"))
            combine(rows, ids, scores, y, config=cfg)
            diff = (y.float() - want.float()).abs()
            tol = want.float().abs() * 2**-7 + 1e-6
            if not bool((diff <= tol).all()):
                raise SystemExit(f"{name}: {cfg} disagrees with combine_ref "
                                 f"(max diff {diff.max().item():.3g})")
            fns[f"cfg{i}"] = functools.partial(combine, rows, ids, scores, y, config=cfg)
        dst = torch.empty_like(rows)
        fns["copy"] = functools.partial(dst.copy_, rows)
        stats = interleaved(fns, rounds=args.rounds, iters=args.reps, device=dev)
        results = [(stats[f"cfg{i}"].iter_ms * 1e3, cfg) for i, cfg in enumerate(configs)]
        copy_us = stats["copy"].iter_ms * 1e3
        copy_gbs = 2 * rows.numel() * 2 / copy_us / 1e3
        base_us = results[0][0]
        print(f"\n{name}: T={T} D={D} K={K}, {torch.cuda.get_device_name(dev)}; "
              f"{nbytes / 1e6:.1f} MB per combine; {args.rounds} rounds interleaved")
        print(f"{'us':>8} {'GB/s':>7} {'vs heur':>8}  config")
        shown = [results[0]] + sorted(results[1:], key=lambda r: r[0])[:5]
        for us, cfg in sorted(shown, key=lambda r: r[0]):
            tag = " (heuristic)" if cfg == heuristic else ""
            print(f"{us:8.1f} {nbytes / us / 1e3:7.0f} {base_us / us:8.3f}  "
                  f"block_t={cfg.block_t} block_d={cfg.block_d} "
                  f"num_warps={cfg.num_warps}{tag}")
        print(f"{copy_us:8.1f} {copy_gbs:7.0f}           copy (ceiling: reads and writes "
              f"{2 * rows.numel() * 2 / 1e6:.0f} MB)")
        records += [dict(shape=name, us=f"{us:.2f}", gbs=f"{nbytes / us / 1e3:.0f}",
                         block_t=c.block_t, block_d=c.block_d, num_warps=c.num_warps,
                         heuristic=c == heuristic) for us, c in results]
        records.append(dict(shape=name, us=f"{copy_us:.2f}", gbs=f"{copy_gbs:.0f}",
                            block_t="copy", block_d="", num_warps="", heuristic=False))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(records[0]))
            w.writeheader()
            w.writerows(records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
