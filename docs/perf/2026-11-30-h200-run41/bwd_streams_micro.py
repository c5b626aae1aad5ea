#!/usr/bin/env python3
"""The backward's three independent GEMMs after the W2 DGRAD (W2 WGRAD, W13 WGRAD, W13
DGRAD), in sequence on one stream (what the layer runs) against the two WGRADs on one stream
and the W13 DGRAD on a second, each launch's persistent grid cut to a share of the SMs
(``S_WGRAD + S_DGRAD``). At fine-grained shapes every one of these kernels runs at 50-60%
of the DRAM peak with the SMs 64-73% busy (run 41, Nsight Compute): the WGRADs mostly
write (weight gradients), the DGRAD mostly reads (weights), so sharing the GPU might fill
both. The layer's configs (from_heuristic), exact or sampled counts; 10 repetitions per
CUDA graph, rounds in rotating order; median per repetition and seq/variant (>1: faster).
Outputs compared bitwise with the sequential run's (the split changes no arithmetic).

    PYTHONPATH=src python3 bwd_streams_micro.py [SHAPE ...]
"""
import contextlib
import sys

import torch

import distmoe.kernels._common as common
from distmoe.kernels.w2_backward import WgradConfig, w2_wgrad
from distmoe.kernels.w13_backward import W13DgradConfig, w13_dgrad_scatter, w13_wgrad
from distmoe.reference import random_routing
from distmoe.tools.bench.workloads import SHAPES

dev = torch.device("cuda")
SPLITS = [(66, 66), (88, 44), (44, 88), (100, 32), (32, 100)]
ROUNDS, REPS = 11, 10
real_num_sms = common.num_sms


@contextlib.contextmanager
def sms(n):
    common.num_sms = (lambda d: n) if n else real_num_sms
    try:
        yield
    finally:
        common.num_sms = real_num_sms


g = torch.Generator(device=dev).manual_seed(1)
for name in sys.argv[1:] or ["fine", "olmoe", "issue-b"]:
    s = SHAPES[name]
    T, D, F, E, K = s.tokens, s.hidden, s.ffn, s.num_experts, s.top_k
    R = T * K
    for routing in ("exact", "sampled"):
        c = (torch.full((E,), R // E, dtype=torch.int64) if routing == "exact" else
             torch.bincount(random_routing(T, E, K, generator=torch.Generator().manual_seed(0))
                            [0].reshape(-1), minlength=E))
        padded = (c + 127) // 128 * 128
        po = torch.zeros(E + 1, dtype=torch.int32)
        po[1:] = torch.cumsum(padded, 0)
        ro = torch.zeros(E + 1, dtype=torch.int32)
        ro[1:] = torch.cumsum(c, 0)
        gh3 = torch.randn(R, D, generator=g, device=dev).bfloat16()
        h2 = torch.randn(R, F, generator=g, device=dev).bfloat16()
        gh1 = torch.randn(R, 2 * F, generator=g, device=dev).bfloat16()
        xr = torch.randn(R, D, generator=g, device=dev).bfloat16()
        w13 = (torch.randn(E, 2, F, D, generator=g, device=dev) / D ** 0.5).bfloat16()
        ptrs = torch.zeros(int(po[-1]) + 256, dtype=torch.int64)
        hint = dict(block_m=128, rows_per_expert=R // E)
        cfg_w2 = WgradConfig.from_heuristic(out_rows=D, out_cols=F, device=dev, **hint)
        cfg_w13 = WgradConfig.from_heuristic(out_rows=2 * F, out_cols=D, device=dev, **hint)
        cfg_d = W13DgradConfig.from_heuristic(hidden=D, ffn=F, **hint)
        po_d, ro_d = po.to(dev), ro.to(dev)
        kinds = ["seq"] + [f"{a}+{b}" for a, b in SPLITS]
        outs, graphs = {}, {}
        for kind in kinds:
            gw2 = torch.empty(E, D, F, device=dev, dtype=torch.bfloat16)
            gw13 = torch.empty(E, 2, F, D, device=dev, dtype=torch.bfloat16)
            dx = torch.full((R, D), float("nan"), device=dev, dtype=torch.bfloat16)
            p = ptrs.clone()
            for e in range(E):
                rows = torch.arange(int(ro[e]), int(ro[e + 1]))
                p[int(po[e]):int(po[e]) + rows.numel()] = dx.data_ptr() + rows * D * 2
            p = p.to(dev)
            outs[kind] = (gw2, gw13, dx)
            if kind == "seq":
                split = None
            else:
                split = tuple(int(v) for v in kind.split("+"))
            side = torch.cuda.Stream()

            def run(gw2=gw2, gw13=gw13, p=p, split=split, side=side):
                if split is None:
                    w2_wgrad(gh3, h2, po_d, ro_d, gw2, accumulate=False,
                             config=cfg_w2)
                    w13_wgrad(gh1, xr, po_d, ro_d, gw13, accumulate=False,
                              config=cfg_w13)
                    w13_dgrad_scatter(gh1, po_d, ro_d, w13, p, config=cfg_d)
                    return
                main = torch.cuda.current_stream()
                side.wait_stream(main)
                with torch.cuda.stream(side), sms(split[1]):
                    w13_dgrad_scatter(gh1, po_d, ro_d, w13, p, config=cfg_d)
                with sms(split[0]):
                    w2_wgrad(gh3, h2, po_d, ro_d, gw2, accumulate=False, config=cfg_w2)
                    w13_wgrad(gh1, xr, po_d, ro_d, gw13, accumulate=False, config=cfg_w13)
                main.wait_stream(side)

            run()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(REPS):
                    run()
            graphs[kind] = graph
        times = {k: [] for k in kinds}
        for r in range(ROUNDS):
            for k in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
                a, b = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                a.record()
                graphs[k].replay()
                b.record()
                b.synchronize()
                times[k].append(a.elapsed_time(b) / REPS * 1e3)
        med = {k: sorted(t)[len(t) // 2] for k, t in times.items()}
        line = f"{name:8s} {routing:7s} seq {med['seq']:7.1f} us"
        for k in kinds[1:]:
            eq = all(torch.equal(x.view(torch.int16), y.view(torch.int16))
                     for x, y in zip(outs["seq"], outs[k]))
            line += f" | {k} {med[k]:7.1f} ({med['seq'] / med[k]:.3f}{'' if eq else ' DIFF'})"
        print(line, flush=True)
        del graphs, outs
        torch.cuda.empty_cache()
