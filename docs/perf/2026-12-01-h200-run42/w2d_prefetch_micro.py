#!/usr/bin/env python3
"""The Gluon W2 DGRAD alone (scored form, h2 stored, exact row counts, rows permuted) with h1
loaded from global memory (production) against h1 brought into shared memory by cp.async
(``h1_prefetch``), interleaved from CUDA graphs of 20 launches each; prints each variant's
median, production / variant (> 1: faster), and whether grad_h1, h2 and the score parts are
production's bits.

    PYTHONPATH=src python3 w2d_prefetch_micro.py SHAPE[:NAME=STAGES/PREFETCH[/WARPS/BUFFERS[/EARLY]]]
    e.g. fine:prod=4/0,p2=4/2,p3=3/3 olmoe:prod=4/0,p2=4/2

Run 43 added the optional ``/WARPS/BUFFERS/EARLY``: the split kernel's ``epilogue_warps``,
``epilogue_buffers`` and ``epilogue_early_h1`` (default 0, 1, 0: the ping-pong kernel), e.g.
``fine:prod=4/0,e8=4/0/8/1,e8e=4/0/8/1/1``.

``--wait-pid PID``: build and check every variant first, then wait until process PID has
ended before timing (a test run sharing the GPU during the builds).
"""
import argparse
import os
import time

import torch

from distmoe.kernels.w2_dgrad_gluon import launch_gluon_w2_dgrad
from distmoe.tools.bench.workloads import SHAPES

ap = argparse.ArgumentParser()
ap.add_argument("specs", nargs="+")
ap.add_argument("--wait-pid", type=int, default=0)
ap.add_argument("--rounds", type=int, default=15)
args = ap.parse_args()
dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(1)
built = []
keep = []  # every tensor a graph's launches address stays alive until the end
for spec in args.specs:
    name, _, vs = spec.partition(":")
    variants = {}
    for v in (vs or "prod=4/0,p2=4/2").split(","):
        k, _, sp = v.partition("=")
        given = [int(x) for x in sp.split("/")]
        variants[k] = tuple(given + [0, 0, 1, 0][len(given) - 1:])
    s = SHAPES[name]
    T, D, F, E, K = s.tokens, s.hidden, s.ffn, s.num_experts, s.top_k
    R = T * K
    counts = torch.full((E,), R // E)
    ro = torch.zeros(E + 1, dtype=torch.int32)
    ro[1:] = counts.cumsum(0)
    po = torch.zeros(E + 1, dtype=torch.int32)
    po[1:] = ((counts + 127) // 128 * 128).cumsum(0)
    ro, po = ro.to(dev), po.to(dev)
    Rp = int(po[-1])
    combine = torch.randn(R, D, generator=gen, device=dev).bfloat16()
    combine.view(torch.float32)[:, 0] = torch.rand(R, generator=gen, device=dev) + 0.25
    perm = torch.randperm(R, generator=gen, device=dev)
    w2 = (torch.randn(E, D, F, generator=gen, device=dev) / D ** 0.5).bfloat16()
    h1 = torch.randn(R, 2 * F, generator=gen, device=dev).bfloat16()
    rows = torch.randn(R, D, generator=gen, device=dev).bfloat16()
    outs, graphs = {}, {}
    for k, (stages, prefetch, warps, bufs, early) in variants.items():
        comb = combine.clone()
        ptrs = torch.zeros(Rp, dtype=torch.int64, device=dev)
        ptrs[:R] = comb.data_ptr() + perm.long() * D * 2  # exact counts: padded == rows
        gh1 = torch.full_like(h1, float("nan"))
        h2 = torch.full((R, F), float("nan"), device=dev, dtype=torch.bfloat16)

        def run(ptrs=ptrs, gh1=gh1, h2=h2, stages=stages, prefetch=prefetch, po=po, ro=ro,
                w2=w2, rows=rows, h1=h1, warps=warps, bufs=bufs, early=early):
            launch_gluon_w2_dgrad(ptrs, po, ro, w2, rows, h1, gh1, h1_offset=None, h2_out=h2,
                                  scored_rows=True, stages=stages, h1_prefetch=prefetch,
                                  epilogue_warps=warps, epilogue_buffers=bufs,
                                  epilogue_early_h1=bool(early))

        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        outs[k] = (comb.clone(), gh1.clone(), h2.clone())
        keep.append((comb, ptrs, gh1, h2, w2, rows, h1, po, ro))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(20):
                run()
        graphs[k] = graph
        print(f"{name} {k}: built and run once in {time.perf_counter() - t0:.1f} s", flush=True)
    ref = next(iter(outs))
    same = {k: all(torch.equal(x.view(torch.int16), y.view(torch.int16))
                   for x, y in zip(outs[ref], outs[k], strict=True)) for k in outs}
    built.append((name, R * D * F * 2, graphs, same))
if args.wait_pid:
    while os.path.exists(f"/proc/{args.wait_pid}"):
        time.sleep(0.5)
for name, flops, graphs, same in built:
    kinds = list(graphs)
    times = {k: [] for k in kinds}
    for r in range(args.rounds):
        for k in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
            a, b = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            a.record()
            graphs[k].replay()
            b.record()
            b.synchronize()
            times[k].append(a.elapsed_time(b) / 20 * 1e3)
    med = {k: sorted(t)[len(t) // 2] for k, t in times.items()}
    ref = kinds[0]
    line = f"{name:11s} {ref} {med[ref]:7.1f} us ({flops / med[ref] / 1e6:.0f} TFLOP/s)"
    for k in kinds[1:]:
        line += (f" | {k} {med[k]:7.1f} us ({med[ref] / med[k]:.3f}x, "
                 f"{'same bits' if same[k] else 'BITS DIFFER'})")
    print(line, flush=True)
