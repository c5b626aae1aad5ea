#!/usr/bin/env python3
"""W13 DGRAD alone (``w13_dgrad_scatter``) at the fine and deepseek-v3 shapes, exact and
sampled row counts (each of T=4096 tokens draws K=8 experts at random, seed 0), for the
configs named on the command line: ``base`` (the layer's heuristic) and each
``NAME=FIELD=VALUE[,FIELD=VALUE]`` replacing fields of it.

Per (shape, routing): every config captured as 10 launches in a CUDA graph, then 15 rounds
replaying each graph once in rotating order; median us per launch, and a checksum of the
output rows (sum of their int16 bits) for comparing bits.

    PYTHONPATH=src python3 w13d_micro.py half=half_tails=True
    ROUTINGS=exact,shift1,sampled PYTHONPATH=src python3 w13d_micro.py m64=block_m=64

(``half_tails`` exists on branch ``wip/half-tails`` only.)
"""
import dataclasses
import os
import sys

import torch

from distmoe.kernels.w13_backward import W13DgradConfig, w13_dgrad_scatter
from distmoe.reference import random_routing

dev = torch.device("cuda")
SHAPES = {"fine": (2048, 768, 128), "deepseek-v3": (7168, 2048, 256)}
T, K, BM = 4096, 8, 128
variants = {}
# ROUTINGS=exact,shift1,sampled (environment): the row counts to run; shift1 is exact with
# one row moved from the first expert to the last (every other expert's rows start one
# activation row off the 128-row grid)
ROUTINGS = [r for r in os.environ.get("ROUTINGS", "").split(",") if r]
for arg in sys.argv[1:]:
    name, spec = arg.split("=", 1)
    fields = {}
    for item in spec.split(","):
        k, v = item.split("=")
        fields[k] = {"True": True, "False": False}.get(v, v if not v.isdigit() else int(v))
    variants[name] = fields
for shape, (D, F, E) in SHAPES.items():
    base = W13DgradConfig.from_heuristic(hidden=D, ffn=F, rows_per_expert=T * K // E)
    cfgs = {"base": base} | {n: dataclasses.replace(base, **f) for n, f in variants.items()}
    g = torch.Generator(device=dev).manual_seed(1)
    w13 = (torch.randn(E, 2, F, D, generator=g, device=dev) / F ** 0.5).bfloat16()
    counts = {"exact": torch.full((E,), T * K // E, dtype=torch.int64),
              "sampled": torch.bincount(random_routing(T, E, K, generator=torch.Generator()
                                                       .manual_seed(0))[0].reshape(-1),
                                        minlength=E)}
    if ROUTINGS:
        shifted = counts["exact"].clone()
        shifted[0] -= 1  # every later expert's rows start one activation row earlier
        shifted[-1] += 1
        counts["shift1"] = shifted
        counts = {k: counts[k] for k in ROUTINGS}
    for routing, c in counts.items():
        padded = (c + BM - 1) // BM * BM
        po = torch.zeros(E + 1, dtype=torch.int32)
        po[1:] = torch.cumsum(padded, 0)
        ro = torch.zeros(E + 1, dtype=torch.int32)
        ro[1:] = torch.cumsum(c, 0)
        R = int(ro[-1])
        h1 = torch.randn(R, 2 * F, generator=g, device=dev).bfloat16()
        out = torch.full((R, D), float("nan"), device=dev, dtype=torch.bfloat16)
        ptrs = torch.zeros(int(po[-1]) + 2 * BM, dtype=torch.int64)
        for e in range(E):
            rows = torch.arange(int(ro[e]), int(ro[e + 1]))
            ptrs[int(po[e]):int(po[e]) + rows.numel()] = out.data_ptr() + rows * D * 2
        po, ro, ptrs = po.to(dev), ro.to(dev), ptrs.to(dev)
        tails = int(((c % BM > 0) & (c % BM <= BM // 2)).sum())
        graphs, checks = {}, {}
        for name, cfg in cfgs.items():
            def run(cfg=cfg):
                w13_dgrad_scatter(h1, po, ro, w13, ptrs, config=cfg)
            out.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            checks[name] = int(out.view(torch.int16).to(torch.int64).sum())
            assert not out.isnan().any(), name
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(10):
                    run()
            graphs[name] = graph
        times = {n: [] for n in cfgs}
        names = list(cfgs)
        for r in range(15):
            for name in names[r % len(names):] + names[:r % len(names)]:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                graphs[name].replay()
                e.record()
                e.synchronize()
                times[name].append(s.elapsed_time(e) / 10)
        for name in names:
            t = sorted(times[name])
            print(f"{shape:11s} {routing:7s} tails<=64: {tails:3d}/{E} {name:8s} "
                  f"{t[len(t) // 2] * 1e3:8.1f} us (min {t[0] * 1e3:.1f}) "
                  f"same bits as base: {checks[name] == checks['base']}", flush=True)
