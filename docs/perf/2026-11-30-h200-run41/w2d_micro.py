#!/usr/bin/env python3
"""The Gluon W2 DGRAD alone (scored form, h2 stored, exact row counts): production (and its
plain form) against w2d_diag.py's epilogue variants (VARS env, default 0,1,2,3), interleaved from CUDA graphs
(20 launches each), for fine and issue-a (argv). Prints medians, prod/variant and, for
variants meant to be exact (0, 4-6), whether grad_h1, h2 and the score parts equal
production's bits.

    PYTHONPATH=src python3 w2d_micro.py [SHAPE ...]
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import w2d_diag  # noqa: E402

from distmoe.kernels.w2_dgrad_gluon import launch_gluon_w2_dgrad  # noqa: E402
from distmoe.tools.bench.workloads import SHAPES  # noqa: E402

dev = torch.device("cuda")
VARS = [int(v) for v in os.environ.get("VARS", "0,1,2,3").split(",")]
# "plain": production without the score (scored_rows=False)
ROUNDS = 15
g = torch.Generator(device=dev).manual_seed(1)
for name in sys.argv[1:] or ["fine", "issue-a"]:
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
    combine = torch.randn(R, D, generator=g, device=dev).bfloat16()
    combine.view(torch.float32)[:, 0] = torch.rand(R, generator=g, device=dev)
    perm = torch.randperm(R, generator=g, device=dev)
    ptrs = torch.zeros(Rp, dtype=torch.int64, device=dev)
    ptrs[:R] = combine.data_ptr() + perm.long() * D * 2  # exact counts: padded == rows here
    w2 = (torch.randn(E, D, F, generator=g, device=dev) / D ** 0.5).bfloat16()
    h1 = torch.randn(R, 2 * F, generator=g, device=dev).bfloat16()
    rows = torch.randn(R, D, generator=g, device=dev).bfloat16()
    kinds = ["prod", "plain"] + [f"v{v}" for v in VARS]
    scores = combine.view(torch.float32)[:, 0][perm].contiguous()
    outs, graphs = {}, {}
    for k in kinds:
        comb = combine.clone()
        kptrs = ptrs - combine.data_ptr() + comb.data_ptr()
        kptrs[R:] = 0
        gh1 = torch.full_like(h1, float("nan"))
        h2 = torch.full((R, F), float("nan"), device=dev, dtype=torch.bfloat16)
        outs[k] = (comb, gh1, h2)

        def run(k=k, kptrs=kptrs, gh1=gh1, h2=h2):
            if k in ("prod", "plain"):
                launch_gluon_w2_dgrad(kptrs, po, ro, w2, rows, h1, gh1, h1_offset=None,
                                      h2_out=h2, scored_rows=k == "prod")
            else:
                w2d_diag.launch(kptrs, po, ro, w2, rows, h1, gh1, h2_out=h2, var=int(k[1:]),
                                scores=scores)

        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(20):
                run()
        graphs[k] = graph
    times = {k: [] for k in kinds}
    for r in range(ROUNDS):
        for k in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
            a, b = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            a.record()
            graphs[k].replay()
            b.record()
            b.synchronize()
            times[k].append(a.elapsed_time(b) / 20 * 1e3)
    med = {k: sorted(t)[len(t) // 2] for k, t in times.items()}
    flops = 2 * R * D * F
    line = f"{name:8s} prod {med['prod']:7.1f} us ({flops / med['prod'] / 1e6:.0f} TFLOP/s)"
    for k in kinds[1:]:
        eq = ""
        if k != "plain" and int(k[1:]) in (0, 4, 5, 6, 10):
            eq = " eq " + str(all(torch.equal(x.view(torch.int16), y.view(torch.int16))
                                  for x, y in zip(outs["prod"], outs[k])))
        line += f" | {k} {med[k]:7.1f} ({med['prod'] / med[k]:.3f}{eq})"
    print(line, flush=True)
    del graphs, outs
    torch.cuda.empty_cache()
