#!/usr/bin/env python3
"""The warp-specialised Gluon WGRAD alone: the heuristic's config (128 x 128 tiles, 64-row
steps, 5 stages, two warpgroups on each tile) against VARIANTS, in one process,
interleaved: env VARIANTS="k32" (32-row steps, deeper rings; call 1) or "pp" (two
warpgroups taking the tiles in turn, 4 or 5 stages; call 6). For
fine, olmoe, issue-b and deepseek-v3, both WGRADs (W13: x at a device offset as in the
layer; W2), exact and sampled row counts (T tokens drawing K of E experts at random,
seed 0).

20 launches per CUDA graph; rounds of replays in rotating order; prints each variant's
median per-launch time, base/variant (>1: the variant is faster) and whether its output is
bitwise equal to the base's (same k16 MMAs in the same order, so it should be).

    PYTHONPATH=src python3 wgrad_bk_micro.py [SHAPE ...]
"""
import sys

import torch

from distmoe.kernels.w2_backward import WgradConfig
from distmoe.kernels.wgrad_gluon import launch_gluon_wgrad
from distmoe.reference import random_routing
from distmoe.tools.bench.workloads import SHAPES

dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(1)
import os  # noqa: E402

# name: (block_k, stages, num_warps, pingpong)
# (call 8: "pp8" also times the warp-specialised form with 8 cooperating warps, and the
# base is whatever the heuristic picks: the plain kernel's 128 x 256 tiles at issue-a)
VARIANTS = {"base": None} | ({"pps4": (64, 4, 4, True), "pps5": (64, 5, 4, True)}
                            if os.environ.get("VARIANTS", "k32") == "pp" else
                            {"pps5": (64, 5, 4, True), "ws8": (64, 5, 8, False)}
                            if os.environ.get("VARIANTS") == "pp8" else
                            {"k32s8": (32, 8, 8, False), "k32s10": (32, 10, 8, False),
                             "k32s12": (32, 12, 8, False)})
ROUNDS = 15
for name in sys.argv[1:] or ["fine", "olmoe", "issue-b", "deepseek-v3"]:
    s = SHAPES[name]
    T, D, F, E, K = s.tokens, s.hidden, s.ffn, s.num_experts, s.top_k
    R = T * K
    counts = {"exact": torch.full((E,), R // E, dtype=torch.int64),
              "sampled": torch.bincount(random_routing(T, E, K, generator=torch.Generator()
                                                       .manual_seed(0))[0].reshape(-1),
                                        minlength=E)}
    for routing, c in counts.items():
        offsets = torch.zeros(E + 1, dtype=torch.int32)
        offsets[1:] = torch.cumsum(c, 0)
        offsets = offsets.to(dev)
        for kind, P, Q in (("W13", 2 * F, D), ("W2", D, F)):
            a = torch.randn(R, P, generator=g, device=dev).bfloat16()
            b = torch.randn(R, Q, generator=g, device=dev).bfloat16()
            cfg = WgradConfig.hopper_gluon(out_rows=P, out_cols=Q, rows_per_expert=R // E)
            outs, graphs = {}, {}
            for vname, v in VARIANTS.items():
                bk, st, nw, pp = ((cfg.block_k, cfg.num_stages, cfg.num_warps, cfg.pingpong)
                                  if v is None else v)
                ws = cfg.specialized if v is None else True
                bq = cfg.block_out_n if v is None else min(128, cfg.block_out_n)
                out = torch.full((E, P, Q), float("nan"), device=dev, dtype=torch.bfloat16)
                outs[vname] = out

                def run(out=out, bk=bk, st=st, nw=nw, pp=pp, ws=ws, bq=bq):
                    launch_gluon_wgrad(a, b, offsets, out, block_p=cfg.block_out_m,
                                       block_q=bq, stages=st, num_warps=nw,
                                       block_k=bk, specialized=ws, pingpong=pp)

                run()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(20):
                        run()
                graphs[vname] = graph
            names = list(VARIANTS)
            times = {v: [] for v in names}
            for r in range(ROUNDS):
                order = names[r % len(names):] + names[:r % len(names)]
                for v in order:
                    st_, en = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                    st_.record()
                    graphs[v].replay()
                    en.record()
                    en.synchronize()
                    times[v].append(st_.elapsed_time(en) / 20 * 1e3)
            med = {v: sorted(t)[len(t) // 2] for v, t in times.items()}
            line = f"{name:11s} {routing:7s} {kind:3s} base {med['base']:8.1f} us"
            for v in names[1:]:
                same = torch.equal(outs["base"].view(torch.int16), outs[v].view(torch.int16))
                line += f" | {v} {med[v]:8.1f} ({med['base'] / med[v]:.3f}, eq {same})"
            print(line, flush=True)
            del graphs, outs
            torch.cuda.empty_cache()
