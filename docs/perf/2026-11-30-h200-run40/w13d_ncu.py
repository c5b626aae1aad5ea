#!/usr/bin/env python3
"""W13 DGRAD launches for Nsight Compute: for fine and deepseek-v3, exact then sampled row
counts (as ``w13d_micro.py``), each config named on the command line (``base`` first) is
launched twice (a warm-up, then the profiled one); the order is printed to stderr:

    ncu --kernel-name regex:_w13_dgrad --launch-skip-before-match 0 ... \\
        python3 w13d_ncu.py pair=pair_tails=True
"""
import dataclasses
import sys

import torch

from distmoe.kernels.w13_backward import W13DgradConfig, w13_dgrad_scatter
from distmoe.reference import random_routing

dev = torch.device("cuda")
SHAPES = {"fine": (2048, 768, 128), "deepseek-v3": (7168, 2048, 256)}
T, K, BM = 4096, 8, 128
variants = {}
for arg in sys.argv[1:]:
    name, spec = arg.split("=", 1)
    fields = {}
    for item in spec.split(","):
        k, v = item.split("=")
        fields[k] = {"True": True, "False": False}.get(v, v if not v.isdigit() else int(v))
    variants[name] = fields
n = 0
for shape, (D, F, E) in SHAPES.items():
    base = W13DgradConfig.from_heuristic(hidden=D, ffn=F, rows_per_expert=T * K // E)
    cfgs = {"base": base} | {k: dataclasses.replace(base, **f) for k, f in variants.items()}
    g = torch.Generator(device=dev).manual_seed(1)
    w13 = (torch.randn(E, 2, F, D, generator=g, device=dev) / F ** 0.5).bfloat16()
    counts = {"exact": torch.full((E,), T * K // E, dtype=torch.int64),
              "sampled": torch.bincount(random_routing(T, E, K, generator=torch.Generator()
                                                       .manual_seed(0))[0].reshape(-1),
                                        minlength=E)}
    for routing, c in counts.items():
        padded = (c + BM - 1) // BM * BM
        po = torch.zeros(E + 1, dtype=torch.int32)
        po[1:] = torch.cumsum(padded, 0)
        ro = torch.zeros(E + 1, dtype=torch.int32)
        ro[1:] = torch.cumsum(c, 0)
        R = int(ro[-1])
        h1 = torch.randn(R, 2 * F, generator=g, device=dev).bfloat16()
        out = torch.empty((R, D), device=dev, dtype=torch.bfloat16)
        ptrs = torch.zeros(int(po[-1]) + 2 * BM, dtype=torch.int64)
        for e in range(E):
            rows = torch.arange(int(ro[e]), int(ro[e + 1]))
            ptrs[int(po[e]):int(po[e]) + rows.numel()] = out.data_ptr() + rows * D * 2
        po, ro, ptrs = po.to(dev), ro.to(dev), ptrs.to(dev)
        for name, cfg in cfgs.items():
            for rep in range(2):
                w13_dgrad_scatter(h1, po, ro, w13, ptrs, config=cfg)
                torch.cuda.synchronize()
                print(f"launch {n}: {shape} {routing} {name} {'profiled' if rep else 'warm-up'}",
                      file=sys.stderr, flush=True)
                n += 1
