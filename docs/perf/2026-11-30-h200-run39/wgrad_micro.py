#!/usr/bin/env python3
"""The Gluon WGRAD alone at the fine shape's two WGRADs, exact (256 rows per expert) and
sampled row counts (each of T=4096 tokens draws K=8 of E=128 experts at random, seed 0).

Times ``launch_gluon_wgrad`` with the heuristic's config, 20 launches per CUDA graph, median
of 15 replays, and prints a checksum of each output (sum of its int16 bits), so runs of
different kernel code (PYTHONPATH) can be compared bit for bit:

    PYTHONPATH=<src> python3 wgrad_micro.py LABEL
"""
import sys

import torch

from distmoe.kernels.w2_backward import WgradConfig
from distmoe.kernels.wgrad_gluon import launch_gluon_wgrad
from distmoe.reference import random_routing

T, D, F, E, K = 4096, 2048, 768, 128, 8
label = sys.argv[1]
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(1)
R = T * K
counts = {"exact": torch.full((E,), R // E, dtype=torch.int64),
          "sampled": torch.bincount(random_routing(T, E, K, generator=torch.Generator()
                                                   .manual_seed(0))[0].reshape(-1),
                                    minlength=E)}
for routing, c in counts.items():
    offsets = torch.zeros(E + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(c, 0)
    offsets = offsets.to(dev)
    partial = int((c % 64 != 0).sum())
    for kind, P, Q in (("W2", D, F), ("W13", 2 * F, D)):
        a = torch.randn(R, P, generator=g, device=dev).bfloat16()
        b = torch.randn(R, Q, generator=g, device=dev).bfloat16()
        out = torch.full((E, P, Q), float("nan"), device=dev, dtype=torch.bfloat16)
        cfg = WgradConfig.hopper_gluon(out_rows=P, out_cols=Q, rows_per_expert=R // E)

        def run():
            launch_gluon_wgrad(a, b, offsets, out, block_p=cfg.block_out_m,
                               block_q=cfg.block_out_n, stages=cfg.num_stages,
                               num_warps=cfg.num_warps, block_k=cfg.block_k)

        run()
        torch.cuda.synchronize()
        check = int(out.view(torch.int16).to(torch.int64).sum())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(20):
                run()
        times = []
        for _ in range(15):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            graph.replay()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 20)
        times.sort()
        print(f"{label:6s} {routing:7s} {kind:3s} P={P} Q={Q} partial_experts={partial:3d} "
              f"{times[len(times) // 2] * 1e3:8.1f} us (min {times[0] * 1e3:.1f}) "
              f"check {check}", flush=True)
