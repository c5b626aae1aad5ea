"""``python -m distmoe profile``: where one layer step spends its time.

Four views, one per run:

* (default) one layer step under ``torch.profiler``: a few untimed steps (compilation), then
  ``--steps`` steps profiled; prints the kernels sorted by total time per step and the step's
  wall time. Forward (``--mode fwd``) or forward+backward (``fwdbwd``: gradients for x, the
  scores and both weights through ``torch.autograd.grad``, as the bench takes them), sampled
  routing by default (``--routing exact``: every expert gets T*K/E rows). ``--graph`` profiles
  replays of one step captured in a CUDA graph; ``--trace FILE`` also writes a Chrome trace;
  ``--quantities`` adds the kernel-profile quantities of the seed's Appendix A.16 (launches
  per step, time per phase: PUT, GET, combine reduce, grouped GEMMs with their achieved
  rate, weight gradients bf16 / FP8, FP8 quantisation, scale layout; the padding the GEMMs
  run on; peak allocated memory of the forward and the backward;
  :mod:`distmoe.tools.profile_quantities`), ``--json FILE`` writes them;
  ``--set SPEC`` changes the layer's kernel plan as an ``ab`` variant's SPEC does (e.g.
  ``layer:w13_phase_waves=2`` or ``w13:group_m=16``). Under ``torch.distributed.run`` every
  rank runs the shape's T tokens over an NCCL group and prints its own table, rank 0 first
  (``--trace`` gets the rank appended); ``--ep1-share`` profiles each rank's share of the EP
  work at EP=1 instead. On a machine without a GPU it runs on the CPU through Triton's
  interpreter (small shapes, e.g. ``--shape smoke``) and lists CPU operators: a smoke run.
* ``--timeline TRACE...``: the last of ``--steps`` steps of a Chrome trace of the first view
  (with ``--graph``: every step the same) as a timeline, every GPU kernel, copy and memset
  with its start (us, from the step's first event), duration, stream and name; ranks' traces
  in turn. Any machine.
* ``--ncu TABLE``: where each warp role of a kernel waits, from an Nsight Compute SASS table
  (:mod:`distmoe.tools.ncu_stalls`). Any machine.
* ``--ptxas``: registers, spills and shared memory of every kernel built for sm_90
  (:mod:`distmoe.tools.ptxas`; ``--check`` exits 1 on a spill in a production config). Any
  machine with Triton; no GPU needed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time

#: Chrome-trace categories of GPU work
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


# ------------------------------------------------------------------------------- timelines
def last_step(events: list[dict], steps: int) -> list[dict]:
    """The GPU events of the last of ``steps`` equal steps, in start order (ValueError when
    they do not split into ``steps`` equal parts)."""
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES),
                 key=lambda e: e["ts"])
    if steps < 1:
        raise ValueError(f"steps ({steps}) must be >= 1")
    if not gpu or len(gpu) % steps:
        raise ValueError(f"{len(gpu)} GPU events do not split into {steps} equal steps "
                         "(pass the --steps the trace was profiled with)")
    return gpu[-(len(gpu) // steps):]


def format_step(events: list[dict], width: int = 90) -> list[str]:
    """Lines ``start duration stream name`` of one step's events (microseconds)."""
    t0 = events[0]["ts"]
    return [f"{e['ts'] - t0:9.1f} {e['dur']:8.1f}  s{e.get('tid', '?')}  {e['name'][:width]}"
            for e in events]


def timelines(paths: list[str], steps: int) -> int:
    """Print the last step of each trace file; returns the exit status (2 for a file that is
    no readable trace, 1 for one whose events do not split into ``steps``)."""
    print("# start (us, from the step's first event), duration (us), stream, name")
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        try:
            with opener(path, "rt") as f:
                events = json.load(f)["traceEvents"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"distmoe profile: error: --timeline {path}: not a readable Chrome trace "
                  f"({type(exc).__name__}: {exc})", file=sys.stderr)
            return 2
        try:
            step = last_step(events, steps)
        except ValueError as exc:
            print(f"distmoe profile: --timeline {path}: {exc}", file=sys.stderr)
            return 1
        print(f"\n## {path}")
        print("\n".join(format_step(step)))
    return 0


# ------------------------------------------------------------------------------ command line
def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``profile`` options."""
    from .bench.layer_step import add_routing_argument
    from .bench.workloads import SHAPES

    p.description = ("Profile one layer step (torch.profiler), or read a trace (--timeline), "
                     "an Nsight Compute table (--ncu), or build every kernel for sm_90 and "
                     "report registers and spills (--ptxas).")
    p.epilog = ("Examples: profile --shape qwen3-30b-a3b --mode fwd --graph --steps 3 --trace "
                "t.json; profile --timeline t.json --steps 3; profile --ncu sass.csv --kernel "
                "w13; profile --ptxas --check.")
    view = p.add_mutually_exclusive_group()
    view.add_argument("--timeline", nargs="+", metavar="TRACE",
                      help="print the last step of these Chrome traces (.json or .json.gz) as "
                           "a timeline")
    view.add_argument("--ncu", metavar="TABLE",
                      help="stall samples per warp-specialised partition from `ncu --page "
                           "source --csv --print-source sass` output (.gz read as gzip)")
    view.add_argument("--ptxas", action="store_true",
                      help="build every kernel for sm_90 and print registers, spills and "
                           "shared memory (no GPU needed)")
    layer = p.add_argument_group("the layer step (default view)")
    layer.add_argument("--shape", default="dense-e32", choices=sorted(SHAPES), metavar="NAME",
                       help=f"the bench shape (default: dense-e32); one of "
                            f"{', '.join(sorted(SHAPES))}")
    layer.add_argument("--mode", default="fwdbwd", choices=["fwd", "fwdbwd"],
                       help="forward, or forward+backward (default: fwdbwd)")
    layer.add_argument("--tokens", type=int, default=None,
                       help="tokens per rank instead of the shape's own T (e.g. 16 for decode)")
    add_routing_argument(layer)
    layer.add_argument("--precision", default="bf16",
                       choices=["bf16", "mxfp8", "fp8_block", "nvfp4"],
                       help="the layer's MoEConfig.precision (default bf16; nvfp4: --mode fwd)")
    layer.add_argument("--steps", type=int, default=5,
                       help="profiled steps after the warm-up; with --timeline: the steps in "
                            "the trace (default: 5)")
    layer.add_argument("--rows", type=int, default=25, help="kernels to list (default: 25)")
    layer.add_argument("--graph", action="store_true",
                       help="capture one step in a CUDA graph and profile its replays (GPU)")
    layer.add_argument("--trace", default=None, metavar="FILE",
                       help="also write a Chrome trace here")
    layer.add_argument("--set", action="append", default=[], metavar="SPEC",
                       help="a kernel-plan change as in `distmoe ab --variant` (e.g. "
                            "layer:w13_phase_waves=2 or w13:group_m=16); repeatable")
    layer.add_argument("--quantities", action="store_true",
                       help="also the kernel-profile quantities per step (phases, launches, "
                            "GEMM rate, padding, peak memory by phase)")
    layer.add_argument("--json", default=None, metavar="FILE",
                       help="with --quantities: write them and the kernel rows here")
    layer.add_argument("--ep1-share", action="store_true",
                       help="under torch.distributed.run: every rank profiles its share of "
                            "the EP work at EP=1 (E / EP experts, one rank)")
    ncu = p.add_argument_group("--ncu")
    ncu.add_argument("--kernel", default=None, metavar="REGEX",
                     help="only kernels whose name matches this regex")
    ncu.add_argument("--top", type=int, default=6,
                     help="instructions shown per partition (default: 6)")
    ptxas = p.add_argument_group("--ptxas")
    from .ptxas import add_arguments as ptxas_arguments

    ptxas_arguments(ptxas)
    return p


def _ptxas_argv(args) -> list[str]:
    argv = ["--shapes", *args.shapes, "--jobs", str(args.jobs)]
    return argv + ["--no-variants"] * args.no_variants + ["--check"] * args.check


def run(args) -> int:
    """Run the command; returns the exit status (2 for a usage error)."""
    if args.timeline:
        if args.steps < 1:
            print(f"distmoe profile: error: --steps ({args.steps}) must be >= 1",
                  file=sys.stderr)
            return 2
        return timelines(args.timeline, args.steps)
    if args.ncu:
        if args.top < 1:
            print(f"distmoe profile: error: --top ({args.top}) must be >= 1", file=sys.stderr)
            return 2
        from .ncu_stalls import summarize

        return summarize(args.ncu, args.top, args.kernel)
    if args.ptxas:
        from . import ptxas

        return ptxas.main(_ptxas_argv(args))
    try:
        overrides, x_in_buffer = _check_layer_arguments(args)
    except ValueError as exc:
        print(f"distmoe profile: error: {exc}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    from .bench.layer_step import join_group

    joined = join_group()
    try:
        return _profile_layer(args, joined, overrides, x_in_buffer)
    except ValueError as exc:  # an override the plan refuses, a shape EP does not divide
        print(f"distmoe profile: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _check_layer_arguments(args) -> tuple[dict | None, bool]:
    import torch

    from .ab import overrides_from_specs

    for name in ("steps", "rows"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} ({getattr(args, name)}) must be >= 1")
    if args.tokens is not None and args.tokens < 1:
        raise ValueError(f"--tokens ({args.tokens}) must be >= 1")
    if args.graph and not torch.cuda.is_available():
        raise ValueError("--graph needs a CUDA GPU (a CUDA graph of the step)")
    overrides, x_in_buffer = overrides_from_specs(args.set)
    if x_in_buffer and args.mode == "fwdbwd":
        raise ValueError("--set input:buffer=True is for inference (--mode fwd)")
    if args.json and not args.quantities:
        raise ValueError("--json writes the --quantities: pass both")
    return overrides or None, x_in_buffer


def _profile_layer(args, joined, overrides, x_in_buffer) -> int:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from . import INTERPRETER_NOTE
    from .bench.layer_step import build_layer, draw_inputs, ep1_share

    rank, world, dev = joined.rank, joined.world, joined.device
    share_of = 1
    if args.ep1_share:
        if world == 1:
            raise ValueError("--ep1-share needs EP > 1 (torch.distributed.run)")
        share_of, joined = world, ep1_share(joined)
    cuda = dev.type == "cuda"
    inputs = draw_inputs(args.shape, args.mode, joined, tokens=args.tokens, share_of=share_of,
                         routing=args.routing)
    ctx, step = build_layer(inputs, joined, overrides=overrides, precision=args.precision)
    T = inputs.tokens

    def sync():
        if cuda:
            torch.cuda.synchronize()

    with ctx:
        if rank == 0:
            if args.set:
                print("set: " + ", ".join(args.set))
            print(ctx.explain(T), flush=True)
        for _ in range(3 if cuda else 1):
            step(x_in_buffer)
        sync()
        peaks = _phase_peaks(ctx, inputs, step, x_in_buffer) if args.quantities else {}

        def run_step():
            step(x_in_buffer)
        if args.graph:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step(x_in_buffer)
            run_step = graph.replay
            run_step()
            sync()
        start = time.perf_counter()
        for _ in range(args.steps):
            run_step()
        sync()
        wall_ms = (time.perf_counter() - start) * 1e3 / args.steps
        activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
        with profile(activities=[activity]) as prof:
            for _ in range(args.steps):
                run_step()
            sync()
    rows = []
    for ev in prof.key_averages():
        if cuda:
            us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        else:
            us = ev.self_cpu_time_total
        if us > 0:
            rows.append((us / args.steps / 1e3, ev.count // args.steps, ev.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    s = ctx.cfg
    ep = f"1 (a share of EP={world})" if share_of > 1 else str(world)
    where = torch.cuda.get_device_name(dev) if cuda else "CPU (Triton interpreter)"
    what = "kernel" if cuda else "CPU operator (self time)"
    lines = [f"{args.shape} {args.mode}: T={T} D={s.hidden} F={s.ffn} E={s.num_experts} "
             f"K={s.top_k}, EP={ep}{f' rank {rank}' if world > 1 else ''}, {where}",
             f"{'ms/step':>9} {'calls':>6}  {what}"]
    lines += [f"{ms:9.3f} {calls:6d}  {name[:100]}" for ms, calls, name in rows[:args.rows]]
    lines.append(f"{total:9.3f}         sum of {what} time per step; wall {wall_ms:.3f} "
                 f"ms/step ({'CUDA graph replay' if args.graph else 'eager'})")
    if not cuda:
        lines.append(f"note: {INTERPRETER_NOTE}")
    for r in range(world):  # one rank's table at a time
        if r == rank:
            print("\n".join(lines), flush=True)
        if world > 1:
            dist.barrier()
    if args.quantities:
        _print_quantities(args, rows, inputs, ctx, joined, peaks)
    if args.trace:
        prof.export_chrome_trace(args.trace if world == 1 else f"{args.trace}.rank{rank}")
    return 0


def _phase_peaks(ctx, inputs, step, x_in_buffer) -> dict:
    """Peak allocated GiB (torch's allocator plus the heap's own buffers) of the forward and
    of the backward of one step, each from a reset peak (synchronises: a tool, not the hot
    path); None on the CPU."""
    import torch

    dev = inputs.x.device
    if dev.type != "cuda":
        return {"forward": None, "backward": None} if inputs.training else {"forward": None}
    extra = ctx.heap.untracked_bytes

    def peak(fn):
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        out = fn()
        torch.cuda.synchronize(dev)
        return out, (torch.cuda.max_memory_allocated(dev) + extra) / 2**30

    if not inputs.training:
        return {"forward": peak(lambda: step(x_in_buffer))[1]}
    xs = inputs.x.detach().requires_grad_(True)
    y, fwd = peak(lambda: ctx(xs, inputs.ids, inputs.scores, inputs.w13, inputs.w2))
    _, bwd = peak(lambda: torch.autograd.grad(y, (xs, inputs.scores, inputs.w13, inputs.w2),
                                              inputs.gy))
    return {"forward": fwd, "backward": bwd}


def _local_counts(inputs, ctx, joined) -> list[int]:
    """Rows each of this rank's experts receives in the step (every rank's ids gathered)."""
    import torch
    import torch.distributed as dist

    ids = inputs.ids.to(torch.int64)
    if joined.world > 1:
        every = torch.empty(joined.world * ids.numel(), dtype=torch.int64, device=ids.device)
        dist.all_gather_into_tensor(every, ids.flatten().contiguous(), group=joined.group)
        ids = every
    e_local = ctx.num_local_experts
    local = ids.flatten() - joined.rank * e_local
    local = local[(local >= 0) & (local < e_local)]
    return torch.bincount(local, minlength=e_local).tolist()


def _print_quantities(args, rows, inputs, ctx, joined, peaks) -> None:
    import torch.distributed as dist

    from .profile_quantities import as_json, format_quantities, quantities

    s = ctx.cfg
    useful = 6 * inputs.tokens * s.top_k * s.hidden * s.ffn * (3 if inputs.training else 1)
    q = quantities(rows, useful_tflop=useful / 1e12, counts=_local_counts(inputs, ctx, joined),
                   row_block=s.row_block, peak_gib=peaks)
    lines = [f"quantities per step (rank {joined.rank}):", *format_quantities(q)]
    for r in range(joined.world):
        if r == joined.rank:
            print("\n".join(lines), flush=True)
        if joined.world > 1:
            dist.barrier()
    if args.json:
        import json

        from .bench.report import environment

        path = args.json if joined.world == 1 else f"{args.json}.rank{joined.rank}"
        with open(path, "w") as f:
            json.dump(dict(environment=environment(), shape=args.shape, mode=args.mode,
                           precision=args.precision, tokens=inputs.tokens,
                           graph=bool(args.graph), quantities=as_json(q),
                           kernels=[dict(ms=ms, launches=n, name=name)
                                    for ms, n, name in rows]), f, indent=1)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m distmoe.tools.profile``)."""
    from . import quiet_on_closed_pipe

    parser = add_arguments(argparse.ArgumentParser(prog="distmoe profile"))
    args = parser.parse_args(argv)
    return quiet_on_closed_pipe(lambda: run(args))


if __name__ == "__main__":
    raise SystemExit(main())
