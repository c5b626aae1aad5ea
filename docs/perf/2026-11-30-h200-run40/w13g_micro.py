#!/usr/bin/env python3
"""The Gluon W13 forward alone (``gather_w13_swiglu`` with the Hopper heuristic's config) at
deepseek-v3 (T=4096, D=7168, F=2048, E=256, K=8), sampled row counts (seed 0), training
(h1 and the rows saved) and inference. 10 launches per CUDA graph, median of 15 replays,
and a checksum of h2 (sum of its int16 bits) to compare code versions bit for bit:

    PYTHONPATH=<src> python3 w13g_micro.py LABEL
"""
import sys

import torch

from distmoe.kernels.w13_gather_swiglu import W13Config, gather_w13_swiglu
from distmoe.reference import random_routing

label = sys.argv[1]
T, D, F, E, K, BM = 4096, 7168, 2048, 256, 8, 128
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(1)
ids = random_routing(T, E, K, generator=torch.Generator().manual_seed(0))[0].reshape(-1)
counts = torch.bincount(ids, minlength=E)
padded = (counts + BM - 1) // BM * BM
po = torch.zeros(E + 1, dtype=torch.int32)
po[1:] = torch.cumsum(padded, 0)
ro = torch.zeros(E + 1, dtype=torch.int32)
ro[1:] = torch.cumsum(counts, 0)
x = torch.randn(T, D, generator=g, device=dev).bfloat16()
w13 = (torch.randn(E, 2, F, D, generator=g, device=dev) / D ** 0.5).bfloat16()
order = torch.argsort(ids, stable=True)  # route index t*K + k, grouped by expert
gather = torch.zeros(int(po[-1]) + 2 * BM, dtype=torch.int64)
for e in range(E):
    routes = order[int(ro[e]):int(ro[e + 1])]
    gather[int(po[e]):int(po[e]) + routes.numel()] = x.data_ptr() + (routes // K) * D * 2
po, ro, gather = po.to(dev), ro.to(dev), gather.to(dev)
R = int(ro[-1])
for training in (True, False):
    cfg = W13Config.hopper_gluon(hidden=D, ffn=F, rows_per_expert=T * K // E, training=training)
    h2 = torch.empty(R, F, device=dev, dtype=torch.bfloat16)
    h1 = torch.empty(R, 2 * F, device=dev, dtype=torch.bfloat16) if training else None
    xo = torch.empty(R, D, device=dev, dtype=torch.bfloat16) if training else None

    def run():
        gather_w13_swiglu(gather, po, ro, w13, h2, h1_out=h1, x_out=xo, config=cfg)

    h2.fill_(float("nan"))
    run()
    torch.cuda.synchronize()
    assert not h2.isnan().any()
    check = int(h2.view(torch.int16).to(torch.int64).sum())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            run()
    times = []
    for _ in range(15):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 10)
    times.sort()
    print(f"{label:5s} training={training!s:5s} gluon={cfg.gluon} {cfg.block_n}x{cfg.num_warps}w "
          f"{times[7] * 1e3:8.1f} us (min {times[0] * 1e3:.1f}) check {check}", flush=True)
