#!/usr/bin/env python3
"""Time the routing-table construction per implementation (torch ops, one Triton program,
blocked Triton) on one device.

Usage (repository root):
    PYTHONPATH=src python3 tools/time_routing.py [--shapes fine issue-a] [--tokens 16 4096]
        [--ep 1] [--csv FILE]

For each named bench shape and token count, builds the tables of rank 0 from balanced random
ids of ``--ep`` ranks (``EP*T*K`` routes, the receive bound of the default
``device_scratch_factor`` 2) with each implementation, checks that all give the same tables,
and times each with ``triton.testing.do_bench_cudagraph`` (CUDA graph replay, as the layer
runs under graphs). Prints one row per case and implementation, fastest first within a case.
On a machine without a GPU it runs under Triton's interpreter with one timed call (a smoke
run of the tool, not a measurement).
"""

from __future__ import annotations

import argparse
import math
import time

import torch


def main(argv: list[str] | None = None) -> int:
    from distmoe.kernels.interpreter import use_interpreter_if_no_gpu

    use_interpreter_if_no_gpu()
    from distmoe.reference import random_routing
    from distmoe.routing import build_routing_tables, row_capacity
    from distmoe.routing.fused import MAX_FUSED_ROUTES, fused_eligible
    from distmoe.tools.bench.report import write_csv
    from distmoe.tools.bench.workloads import SHAPES

    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--shapes", nargs="+", default=["fine", "issue-a"], choices=sorted(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[16, 128, 512, 4096])
    ap.add_argument("--ep", type=int, default=1, help="ranks whose ids rank 0 reads")
    ap.add_argument("--csv", default=None)
    args = ap.parse_args(argv)
    if args.ep < 1:
        ap.error(f"--ep ({args.ep}) must be >= 1")
    if any(t < 1 for t in args.tokens):
        ap.error(f"--tokens values ({' '.join(map(str, args.tokens))}) must be >= 1")
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    rows = []
    skipped = [n for n in args.shapes if SHAPES[n].num_experts % args.ep]
    if len(skipped) == len(args.shapes):
        ap.error(f"--ep {args.ep} divides the expert count of none of the shapes "
                 f"({', '.join(f'{n}: E={SHAPES[n].num_experts}' for n in skipped)})")
    for name in args.shapes:
        s = SHAPES[name]
        E, K = s.num_experts, s.top_k
        if name in skipped:
            print(f"{name}: E={E} not divisible by --ep {args.ep}; skipped")
            continue
        for T in args.tokens:
            g = torch.Generator().manual_seed(T)
            ids = torch.stack([random_routing(T, E, K, generator=g)[0]
                               for _ in range(args.ep)]).to(torch.int16).to(dev)
            bound = min(math.ceil(2.0 * T * K), args.ep * T * min(K, E // args.ep))
            bases = torch.arange(args.ep, dtype=torch.int64, device=dev) * 2**30 + 2**20
            kw = dict(rank=0, num_local_experts=E // args.ep, row_block=128,
                      receive_bound=bound, dispatch_bases_EP=bases,
                      combine_bases_EP=bases + 2**29, row_bytes=s.hidden * 2, training=True)
            impls = ["torch", "blocked"]
            if fused_eligible(args.ep * T * K, E, dev):
                impls.insert(1, "fused")
            want = build_routing_tables(ids, impl="torch", **kw)
            for impl in impls[1:]:
                got = build_routing_tables(ids, impl=impl, **kw)
                for field in want.__dataclass_fields__:
                    a, b = getattr(want, field), getattr(got, field)
                    if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
                        raise SystemExit(f"{name} T={T}: impl {impl!r} differs in {field}")
            case = []
            for impl in impls:
                def fn(impl=impl, ids=ids, kw=kw):
                    build_routing_tables(ids, impl=impl, **kw)
                if cuda:
                    import triton.testing

                    ms = triton.testing.do_bench_cudagraph(fn, rep=50)
                else:
                    start = time.perf_counter()
                    fn()
                    ms = (time.perf_counter() - start) * 1e3
                case.append(dict(shape=name, tokens=T, ep=args.ep, routes=args.ep * T * K,
                                 experts=E, impl=impl, ms=ms,
                                 r_cap=row_capacity(bound, E // args.ep, 128)))
            case.sort(key=lambda r: r["ms"])
            rows += case
    device_name = torch.cuda.get_device_name(dev) if cuda else "cpu (Triton interpreter)"
    print(f"routing tables of rank 0, {device_name}"
          f"{'' if cuda else ': smoke run, times are not measurements'}; "
          f"one-program path up to {MAX_FUSED_ROUTES} routes")
    print(f"{'shape':<12} {'T':>6} {'EP':>3} {'routes':>7} {'impl':<8} {'ms':>9}")
    for r in rows:
        print(f"{r['shape']:<12} {r['tokens']:>6} {r['ep']:>3} {r['routes']:>7} "
              f"{r['impl']:<8} {r['ms']:>9.4f}")
    if args.csv and rows:
        write_csv(args.csv, rows, list(rows[0]))
    return 0


if __name__ == "__main__":
    from distmoe.tools import quiet_on_closed_pipe

    raise SystemExit(quiet_on_closed_pipe(main))
