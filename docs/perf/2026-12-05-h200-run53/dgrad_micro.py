#!/usr/bin/env python3
"""The two DGRAD kernels alone, with and without their producers in lockstep
(``W2DgradConfig.lockstep``, ``W13DgradConfig.lockstep``), interleaved from CUDA graphs of 20
launches each; prints each variant's median, base / variant (> 1: faster) and whether its
outputs are the base's bits.

    PYTHONPATH=src python3 dgrad_micro.py [--routing sampled|exact] [--rounds N] SHAPE ...

Variants: W2 DGRAD ``w2`` (the heuristic's: the split Gluon kernel) and ``w2ls`` (lockstep);
W13 DGRAD ``w13`` (the heuristic's), ``w13g`` (the Gluon kernel, ping-pong 128 x 128, 5
stages, where the heuristic keeps Triton) and ``w13gls`` (Gluon with lockstep). Ratios are
against ``w2`` and ``w13`` in the same rounds. Sampled routing: each of the T*K routes draws
its expert at random (balanced in expectation), as the layer benches' default.
"""
import argparse
import time
from dataclasses import replace

import torch

from distmoe.kernels.w2_backward import W2DgradConfig, w2_dgrad_swiglu_bwd
from distmoe.kernels.w13_backward import W13DgradConfig, w13_dgrad_scatter
from distmoe.tools.bench.workloads import SHAPES

ap = argparse.ArgumentParser()
ap.add_argument("shapes", nargs="+")
ap.add_argument("--rounds", type=int, default=11)
ap.add_argument("--routing", choices=["exact", "sampled"], default="sampled")
args = ap.parse_args()
dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(1)


def layout(E, R):
    counts = (torch.full((E,), R // E) if args.routing == "exact"
              else torch.bincount(torch.randint(0, E, (R,)), minlength=E))
    ro = torch.zeros(E + 1, dtype=torch.int32)
    ro[1:] = counts.cumsum(0)
    po = torch.zeros(E + 1, dtype=torch.int32)
    po[1:] = ((counts + 127) // 128 * 128).cumsum(0)
    padded_row = torch.cat([torch.arange(int(po[e]), int(po[e]) + int(counts[e]))
                            for e in range(E)]).to(dev)
    return ro.to(dev), po.to(dev), int(po[-1]), padded_row


def timed(graphs):
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
    return {k: sorted(t)[len(t) // 2] for k, t in times.items()}


def capture(run):
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            run()
    return graph


def w2_case(name, T, D, F, E, K):
    """The W2 DGRAD: rows gathered in activation order, the row table pointing at them."""
    R = T * K
    ro, po, Rp, padded_row = layout(E, R)
    rows = torch.randn(R, D, generator=gen, device=dev).bfloat16()
    ptrs = torch.zeros(Rp, dtype=torch.int64, device=dev)
    ptrs[padded_row] = rows.data_ptr() + torch.arange(R, device=dev) * D * 2
    w2 = (torch.randn(E, D, F, generator=gen, device=dev) / D ** 0.5).bfloat16()
    h1 = torch.randn(R, 2 * F, generator=gen, device=dev).bfloat16()
    base = W2DgradConfig.from_heuristic(hidden=D, ffn=F, rows_per_expert=R // E, device=dev)
    configs = {"w2": base, "w2ls": replace(base, lockstep=True)}
    outs, graphs = {}, {}
    for k, cfg in configs.items():
        g1 = torch.full((R, 2 * F), float("nan"), device=dev, dtype=torch.bfloat16)
        h2 = torch.full((R, F), float("nan"), device=dev, dtype=torch.bfloat16)
        graphs[k] = capture(lambda cfg=cfg, g1=g1, h2=h2: w2_dgrad_swiglu_bwd(
            ptrs, po, ro, w2, h1, g1, h2_out=h2, grad_h3_rows=rows, config=cfg))
        outs[k] = (g1, h2)
    med = timed(graphs)
    same = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
               for a, b in zip(outs["w2"], outs["w2ls"], strict=True))
    nan = any(bool(o.isnan().any()) for o in outs["w2ls"])
    print(f"{name:17s} {args.routing} W2 DGRAD  {'split' if base.epilogue_warps else 'pp'} "
          f"{med['w2']:8.1f} us ({2 * R * D * F / med['w2'] / 1e6:.0f} TFLOP/s) | lockstep "
          f"{med['w2ls']:8.1f} us ({med['w2'] / med['w2ls']:.3f}x, "
          f"{'same bits' if same else 'bits differ'}{', NaN!' if nan else ''})", flush=True)


def w13_case(name, T, D, F, E, K):
    """The W13 DGRAD: rows scattered into a [T*K, D] buffer in a random order (route rows)."""
    R = T * K
    ro, po, Rp, padded_row = layout(E, R)
    w13 = (torch.randn(E, 2, F, D, generator=gen, device=dev) / (2 * F) ** 0.5).bfloat16()
    gh1 = torch.randn(R, 2 * F, generator=gen, device=dev).bfloat16()
    base = W13DgradConfig.from_heuristic(hidden=D, ffn=F, rows_per_expert=R // E, device=dev,
                                         num_experts=E)
    gluon = base if base.gluon else W13DgradConfig(
        block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=5, group_m=8,
        persistent=True, gluon=True)
    configs = {"w13": base, "w13gls": replace(gluon, lockstep=True)}
    if not base.gluon:
        configs["w13g"] = gluon
    route = torch.randperm(R, device=dev)
    outs, graphs, tables = {}, {}, []
    for k, cfg in configs.items():
        dispatch = torch.full((R, D), float("nan"), device=dev, dtype=torch.bfloat16)
        p = torch.zeros(Rp, dtype=torch.int64, device=dev)
        p[padded_row] = dispatch.data_ptr() + route.long() * D * 2
        graphs[k] = capture(lambda cfg=cfg, p=p: w13_dgrad_scatter(gh1, po, ro, w13, p,
                                                                   config=cfg))
        outs[k] = dispatch
        tables.append(p)  # the graph reads it at every replay
    ref = torch.matmul(gh1[:64].float(), w13[0].reshape(2 * F, D).float())
    ok = torch.allclose(outs["w13"][route[:64].long()].float(), ref, atol=0.05, rtol=0.02)
    med = timed(graphs)
    line = (f"{name:17s} {args.routing} W13 DGRAD {'gluon' if base.gluon else 'triton'} "
            f"{med['w13']:8.1f} us ({2 * R * 2 * F * D / med['w13'] / 1e6:.0f} TFLOP/s"
            f"{'' if ok else ', REFERENCE MISMATCH'})")
    for k in [k for k in graphs if k != "w13"]:
        same = torch.equal(outs["w13"].view(torch.int16), outs[k].view(torch.int16))
        line += (f" | {k} {med[k]:8.1f} us ({med['w13'] / med[k]:.3f}x, "
                 f"{'same bits' if same else 'bits differ'}"
                 f"{', NaN!' if outs[k].isnan().any() else ''})")
    print(line, flush=True)


for name in args.shapes:
    s = SHAPES[name]
    t0 = time.perf_counter()
    shape = (s.tokens, s.hidden, s.ffn, s.num_experts, s.top_k)
    w2_case(name, *shape)
    torch.cuda.empty_cache()
    w13_case(name, *shape)
    torch.cuda.empty_cache()
    print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
