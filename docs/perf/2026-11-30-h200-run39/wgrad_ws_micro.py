#!/usr/bin/env python3
"""The Gluon WGRAD alone, main kernel against the warp-specialised one (partial steps zeroed
by their own warps), in one process, alternating: fine's two WGRADs and deepseek-v3's, exact
and sampled row counts (T tokens each drawing K of E experts at random, seed 0).

20 launches per CUDA graph; rounds of (main, ws) replays in alternating order; prints the
median per-launch time of each and their ratio, and whether the outputs are bitwise equal.

    PYTHONPATH=src python3 wgrad_ws_micro.py
"""
import torch

from distmoe.kernels.w2_backward import WgradConfig
from distmoe.kernels.wgrad_gluon import launch_gluon_wgrad
from distmoe.reference import random_routing

dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(1)
for shape, (T, D, F, E, K) in {"fine": (4096, 2048, 768, 128, 8),
                               "deepseek-v3": (4096, 7168, 2048, 256, 8)}.items():
    R = T * K
    counts = {"exact": torch.full((E,), R // E, dtype=torch.int64),
              "sampled": torch.bincount(random_routing(T, E, K, generator=torch.Generator()
                                                       .manual_seed(0))[0].reshape(-1),
                                        minlength=E)}
    for routing, c in counts.items():
        offsets = torch.zeros(E + 1, dtype=torch.int32)
        offsets[1:] = torch.cumsum(c, 0)
        offsets = offsets.to(dev)
        for kind, P, Q in (("W2", D, F), ("W13", 2 * F, D)):
            a = torch.randn(R, P, generator=g, device=dev).bfloat16()
            b = torch.randn(R, Q, generator=g, device=dev).bfloat16()
            cfg = WgradConfig.hopper_gluon(out_rows=P, out_cols=Q, rows_per_expert=R // E)
            outs, graphs = {}, {}
            for ws in (False, True):
                out = torch.full((E, P, Q), float("nan"), device=dev, dtype=torch.bfloat16)
                outs[ws] = out

                def run(out=out, ws=ws):
                    launch_gluon_wgrad(a, b, offsets, out, block_p=cfg.block_out_m,
                                       block_q=cfg.block_out_n, stages=cfg.num_stages,
                                       num_warps=cfg.num_warps, block_k=cfg.block_k,
                                       specialized=ws)

                run()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(20):
                        run()
                graphs[ws] = graph
            same = torch.equal(outs[False].view(torch.int16), outs[True].view(torch.int16))
            times = {False: [], True: []}
            for r in range(15):
                for ws in ((False, True) if r % 2 == 0 else (True, False)):
                    s, e = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                    s.record()
                    graphs[ws].replay()
                    e.record()
                    e.synchronize()
                    times[ws].append(s.elapsed_time(e) / 20 * 1e3)
            med = {ws: sorted(t)[len(t) // 2] for ws, t in times.items()}
            print(f"{shape:11s} {routing:7s} {kind:3s} P={P} Q={Q} cfg {cfg.block_out_m}x"
                  f"{cfg.block_out_n} s{cfg.num_stages}: main {med[False]:8.1f} us, ws "
                  f"{med[True]:8.1f} us, main/ws {med[False] / med[True]:.3f}, bits equal "
                  f"{same}", flush=True)
