#!/usr/bin/env python3
"""Per-kernel GPU times of one distmoe layer, forward or forward+backward, at EP=1 or EP>1.

Usage (repository root):
    PYTHONPATH=src python3 tools/profile_layer.py [--shape issue-a] [--mode fwdbwd]
        [--steps 5] [--rows 25] [--tokens T] [--graph] [--trace FILE.json] [--set SPEC]
    PYTHONPATH=src python3 -m torch.distributed.run --standalone --nproc-per-node=2 \
        tools/profile_layer.py --shape fine --mode fwd --graph      (EP=2, one GPU per rank)

Under ``torch.distributed.run`` every rank runs the shape's T tokens (the bench's EP runs:
the same per-rank work as EP=1) over an NCCL group, and each rank prints its own table, rank
0 first (``--trace`` gets the rank appended).

``--set SPEC`` (repeatable) changes the layer first, as a variant of
``tools/ab_interleaved.py`` does (e.g. ``layer:w13_waves=2`` or ``w13:group_m=16``).

``--ep1-share`` (under ``torch.distributed.run``): every rank profiles its share of the EP
work at EP=1 instead (E / EP experts on a one-rank group, the same per-rank work), the
EP=1 side of issue 7's fifth target.

``tools/trace_timeline.py`` prints the last step of a ``--trace`` file as a timeline (start,
duration and stream of every kernel and copy).

Runs a few untimed steps (compilation), then ``--steps`` steps under ``torch.profiler`` and
prints the CUDA kernels sorted by total time (per step), then the step's wall time. Routing is
sampled (each token draws K distinct experts at random) or, with ``--routing exact``, every
expert gets T*K/E rows (the bench suite's default). Training steps take gradients with respect to
x, scores, w13 and w2 through ``torch.autograd.grad`` like the bench (returned, not
accumulated into ``.grad``).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def main() -> int:
    import torch.distributed as dist

    from distmoe.tools import require_cuda
    from distmoe.tools.bench.layer_step import add_routing_argument, join_group, layer_step
    from distmoe.tools.bench.workloads import SHAPES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="issue-a", choices=sorted(SHAPES),
                    help="the bench shape of the layer (default: issue-a)")
    ap.add_argument("--mode", default="fwdbwd", choices=["fwd", "fwdbwd"],
                    help="forward, or forward+backward (default: fwdbwd)")
    ap.add_argument("--steps", type=int, default=5,
                    help="profiled steps after the warm-up (default: 5)")
    ap.add_argument("--rows", type=int, default=25, help="kernels to list")
    ap.add_argument("--trace", default=None, help="also write a Chrome trace here")
    ap.add_argument("--tokens", type=int, default=None,
                    help="tokens instead of the shape's own T (e.g. 16 for decode)")
    ap.add_argument("--graph", action="store_true",
                    help="capture one step in a CUDA graph and profile its replays")
    ap.add_argument("--ep1-share", action="store_true",
                    help="under torch.distributed.run: every rank profiles its share of the "
                         "EP work at EP=1 (E / EP experts, one rank), as ab_interleaved.py's "
                         "--ep1-share row")
    ap.add_argument("--set", action="append", default=[], metavar="SPEC",
                    help="a layer change as in tools/ab_interleaved.py's --variant specs "
                         "(e.g. layer:w13_waves=2); repeatable")
    add_routing_argument(ap)
    args = ap.parse_args()
    require_cuda("profile_layer.py")
    shape = SHAPES[args.shape]
    D, F, E, K = shape.hidden, shape.ffn, shape.num_experts, shape.top_k
    joined = join_group()
    rank, world, dev = joined.rank, joined.world, joined.device
    share_of = 1
    if args.ep1_share:
        if world == 1:
            raise SystemExit("--ep1-share needs EP > 1 (torch.distributed.run)")
        from distmoe.tools.bench.layer_step import ep1_share

        share_of, joined = world, ep1_share(joined)
    try:
        ctx, step, T = layer_step(args.shape, args.mode, joined, tokens=args.tokens,
                                  share_of=share_of, routing=args.routing)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    if args.set:
        sys.path.insert(0, __file__.rsplit("/", 1)[0])
        from ab_interleaved import INPUT_BUFFER, variant_configs

        try:
            changes = variant_configs(ctx, args.set, training=args.mode == "fwdbwd")
        except ValueError as exc:
            raise SystemExit(str(exc)) from exc
        x_in_buffer = changes.pop(INPUT_BUFFER)
        for attr, value in changes.items():
            setattr(ctx, attr, value)
        if rank == 0:
            print("set: " + ", ".join(args.set), flush=True)
    else:
        x_in_buffer = False
    with ctx:
        for _ in range(3):
            step(x_in_buffer)
        torch.cuda.synchronize()

        def run():
            step(x_in_buffer)
        if args.graph:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step(x_in_buffer)
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
    E //= share_of
    ep = f"1 (a share of EP={world})" if share_of > 1 else str(world)
    lines = [f"{args.shape} {args.mode}: T={T} D={D} F={F} E={E} K={K}, EP={ep}"
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
