#!/usr/bin/env python3
"""The W13 DGRAD alone: the layer's Triton config (``W13DgradConfig.from_heuristic``) against
the Gluon W2 forward kernel run as the W13 DGRAD (``gluon=True``), interleaved from CUDA
graphs of 20 launches each; prints each variant's median, base / variant (> 1: faster), and
whether its routes' rows are the base's bits.

    PYTHONPATH=src python3 w13d_micro.py [--routing exact|sampled] SHAPE[:NAME=WARPS/STAGES,...]
    e.g. fine:pp5=4/5,co4=8/4 issue-a       (WARPS 4: ping-pong 128 x 128, 8: coop 128 x 256)

Rows scatter into a [T*K, D] buffer in a random order (as the layer's route rows).
"""
import argparse
import time
from dataclasses import replace

import torch

from distmoe.kernels.w13_backward import W13DgradConfig, w13_dgrad_scatter
from distmoe.tools.bench.workloads import SHAPES

ap = argparse.ArgumentParser()
ap.add_argument("specs", nargs="+")
ap.add_argument("--rounds", type=int, default=15)
ap.add_argument("--routing", choices=["exact", "sampled"], default="exact")
args = ap.parse_args()
dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(1)
keep = []
for spec in args.specs:
    name, _, vs = spec.partition(":")
    s = SHAPES[name]
    T, D, F, E, K = s.tokens, s.hidden, s.ffn, s.num_experts, s.top_k
    R = T * K
    base = W13DgradConfig.from_heuristic(hidden=D, ffn=F, rows_per_expert=R // E)
    variants = {"triton": base}
    for v in (vs or "pp5=4/5,pp6=4/6,co4=8/4,co3=8/3").split(","):
        k, _, sp = v.partition("=")
        warps, stages = (int(x) for x in sp.split("/"))
        variants[k] = replace(base, block_n=256 if warps == 8 else 128, num_warps=warps,
                              num_stages=stages, gluon=True)
    if args.routing == "exact":
        counts = torch.full((E,), R // E)
    else:
        counts = torch.bincount(torch.randint(0, E, (R,)), minlength=E)
    ro = torch.zeros(E + 1, dtype=torch.int32)
    ro[1:] = counts.cumsum(0)
    po = torch.zeros(E + 1, dtype=torch.int32)
    po[1:] = ((counts + 127) // 128 * 128).cumsum(0)
    Rp = int(po[-1])
    route = torch.randperm(R, device=dev)
    ptrs = torch.zeros(Rp, dtype=torch.int64, device=dev)
    padded_row = torch.cat([torch.arange(int(po[e]), int(po[e]) + int(counts[e]))
                            for e in range(E)]).to(dev)
    ro, po = ro.to(dev), po.to(dev)
    w13 = (torch.randn(E, 2, F, D, generator=gen, device=dev) / (2 * F) ** 0.5).bfloat16()
    gh1 = torch.randn(R, 2 * F, generator=gen, device=dev).bfloat16()
    outs, graphs = {}, {}
    for k, cfg in variants.items():
        dispatch = torch.full((R, D), float("nan"), device=dev, dtype=torch.bfloat16)
        p = ptrs.clone()
        p[padded_row] = dispatch.data_ptr() + route.long() * D * 2

        def run(p=p, cfg=cfg):
            w13_dgrad_scatter(gh1, po, ro, w13, p, config=cfg)

        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        outs[k] = dispatch.clone()
        keep.append((dispatch, p))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(20):
                run()
        graphs[k] = graph
        print(f"{name} {k}: {cfg}: built and run once in {time.perf_counter() - t0:.1f} s",
              flush=True)
    ref = torch.matmul(gh1[:64].float(), w13[0].reshape(2 * F, D).float())
    assert torch.allclose(outs["triton"][route[:64].long()].float(), ref, atol=0.05, rtol=0.02)
    same = {k: torch.equal(outs["triton"].view(torch.int16), o.view(torch.int16))
            for k, o in outs.items()}
    nan = {k: bool(o.isnan().any()) for k, o in outs.items()}
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
    flops = 2 * R * 2 * F * D
    line = (f"{name:11s} {args.routing} triton {med['triton']:7.1f} us "
            f"({flops / med['triton'] / 1e6:.0f} TFLOP/s)")
    for k in kinds[1:]:
        line += (f" | {k} {med[k]:7.1f} us ({med['triton'] / med[k]:.3f}x, "
                 f"{'same bits' if same[k] else 'bits differ'}{', NaN!' if nan[k] else ''})")
    print(line, flush=True)
