#!/usr/bin/env python3
"""Per-kernel GPU times of one distmoe layer, forward or forward+backward, at EP=1 or EP>1.

Usage (repository root):
    PYTHONPATH=src python3 tools/profile_layer.py [--shape issue-a] [--mode fwdbwd]
        [--steps 5] [--rows 25] [--tokens T] [--graph] [--trace FILE.json]
    PYTHONPATH=src python3 -m torch.distributed.run --standalone --nproc-per-node=2 \
        tools/profile_layer.py --shape fine --mode fwd --graph      (EP=2, one GPU per rank)

Under ``torch.distributed.run`` every rank runs the shape's T tokens (the bench's EP runs:
the same per-rank work as EP=1) over an NCCL group, and each rank prints its own table, rank
0 first (``--trace`` gets the rank appended).

Runs a few untimed steps (compilation), then ``--steps`` steps under ``torch.profiler`` and
prints the CUDA kernels sorted by total time (per step), then the step's wall time. Routing is
balanced random (the bench's default shapes). Training steps take gradients with respect to
x, scores, w13 and w2 through ``torch.autograd.grad`` like the bench (returned, not
accumulated into ``.grad``).
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> int:
    import distmoe as dm
    from distmoe.reference import random_routing
    from distmoe.tools.bench.workloads import SHAPES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="issue-a", choices=sorted(SHAPES))
    ap.add_argument("--mode", default="fwdbwd", choices=["fwd", "fwdbwd"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=25, help="kernels to list")
    ap.add_argument("--trace", default=None, help="also write a Chrome trace here")
    ap.add_argument("--tokens", type=int, default=None,
                    help="tokens instead of the shape's own T (e.g. 16 for decode)")
    ap.add_argument("--graph", action="store_true",
                    help="capture one step in a CUDA graph and profile its replays")
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    T, D, F, E, K = shape.tokens, shape.hidden, shape.ffn, shape.num_experts, shape.top_k
    if args.tokens is not None:
        if args.tokens < 1:
            raise SystemExit(f"--tokens must be >= 1, got {args.tokens}")
        T = args.tokens
    import torch.distributed as dist

    from distmoe.tools.bench.groups import init_torchrun_group, launched_by_torchrun

    group = None
    if launched_by_torchrun():
        bench_group, dev = init_torchrun_group("cuda")
        group, rank, world = bench_group.group, bench_group.rank, bench_group.world_size
    else:
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29555", rank=0,
                                world_size=1)
        rank, world = 0, 1
    training = args.mode == "fwdbwd"
    cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T,
                       training=training)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, D, generator=g).bfloat16().to(dev)
    ids, scores = random_routing(T, E, K, generator=g)
    ids, scores = ids.to(dev), scores.to(dev)
    w13 = (torch.randn(E, 2, F, D, generator=g) / D**0.5).bfloat16().to(dev)
    w2 = (torch.randn(E, D, F, generator=g) / F**0.5).bfloat16().to(dev)
    gy = torch.randn(T, D, generator=g).bfloat16().to(dev)
    params = [t.requires_grad_(training) for t in (w13, w2)]
    scores_g = scores.float().requires_grad_(training)
    with dm.MoEContext(cfg, group, device=dev) as ctx:
        def step():
            if training:
                xs = x.detach().requires_grad_(True)
                y = ctx(xs, ids, scores_g, *params)
                # like the bench: gradients returned, not accumulated into .grad
                torch.autograd.grad(y, (xs, scores_g, *params), gy)
            else:
                with torch.no_grad():
                    ctx(x, ids, scores, w13, w2)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        run = step
        if args.graph:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            run = graph.replay
            run()
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            run()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3 / args.steps
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                run()
            torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        cuda_us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if cuda_us > 0:
            rows.append((cuda_us / args.steps / 1e3, ev.count // args.steps, ev.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    lines = [f"{args.shape} {args.mode}: T={T} D={D} F={F} E={E} K={K}, EP={world}"
             f"{f' rank {rank}' if world > 1 else ''}, {torch.cuda.get_device_name(dev)}",
             f"{'ms/step':>9} {'calls':>6}  kernel"]
    lines += [f"{ms:9.3f} {calls:6d}  {name[:100]}" for ms, calls, name in rows[:args.rows]]
    lines.append(f"{total:9.3f}         sum of kernel time per step; wall {wall_ms:.3f} "
                 f"ms/step ({'CUDA graph replay' if args.graph else 'eager'})")
    for r in range(world):  # one rank's table at a time
        if r == rank:
            print("\n".join(lines), flush=True)
        if world > 1:
            dist.barrier()
    if args.trace:
        prof.export_chrome_trace(args.trace if world == 1 else f"{args.trace}.rank{rank}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
