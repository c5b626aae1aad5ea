#!/usr/bin/env python3
"""Burst against sustained rates on one GPU: does a long timing window run slower?

Usage (repository root, one GPU):
    PYTHONPATH=src python3 tools/sustained_check.py [--shape issue-a] [--csv FILE]

The benchmark's windows are 30 iterations: 5 ms for the 4096^3 dense matmul ceiling, about
160 ms for a layer forward at issue-a. If the GPU lowers its clocks under sustained load
(power or temperature), the layer is timed at the lower clock and the ceiling at the higher
one. This tool times, with the bench's own window method (``timing.benchmark``, CUDA-graph
windows, median of 5):

* the dense bf16 matmul (4096^3) in windows of 30 iterations and in windows as long as a
  layer window (``--sustained-ms``, default 160 ms);
* the distmoe layer forward at ``--shape`` in windows of 30 iterations and of 3;

and prints the SM clock (``torch.cuda.clock_rate``, when pynvml is there) after each.
"""

from __future__ import annotations

import argparse

import torch


def main() -> int:
    import distmoe as dm
    from distmoe.tools import require_cuda
    from distmoe.tools.bench.report import write_csv
    from distmoe.tools.bench.timing import TimingConfig, benchmark
    from distmoe.tools.bench.workloads import SHAPES, make_layer_inputs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="issue-a", choices=sorted(SHAPES),
                    help="the layer's bench shape (default: issue-a)")
    ap.add_argument("--sustained-ms", type=float, default=160.0,
                    help="length of the long matmul windows, ms (default: 160, about one "
                         "issue-a layer window)")
    ap.add_argument("--csv", default=None, help="also write the rows to this CSV file")
    args = ap.parse_args()
    require_cuda("sustained_check.py")
    dev = torch.device("cuda", 0)

    def clock() -> str:
        try:
            return f"{torch.cuda.clock_rate(dev)} MHz"
        except Exception as exc:  # pynvml missing: say so rather than guess
            return f"clock n/a ({type(exc).__name__})"

    rows = []

    def run(label, fn, flops, iters):
        cfg = TimingConfig(num_warmup=3, num_windows=5, iters_per_window=iters,
                           capture_iters=iters)
        res = benchmark(fn, config=cfg, device=dev)
        ms = res.stats.iter_ms
        rate = flops / (ms * 1e-3) / 1e12
        after = clock()
        print(f"{label:44s} {iters:5d} it/window {ms:9.4f} ms {rate:7.1f} TFLOP/s "
              f"window {ms * iters:7.1f} ms  {after}", flush=True)
        rows.append(dict(case=label, iters_per_window=iters, iter_ms=ms, tflops=rate,
                         window_ms=ms * iters, clock=after))
        return ms

    n = 4096
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16).t()
    out = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    mm_flops = 2 * n**3
    burst_ms = run("dense bf16 4096^3", lambda a=a, b=b, out=out: torch.mm(a, b, out=out), mm_flops, 30)
    long_iters = max(30, int(args.sustained_ms / burst_ms) // 30 * 30)
    run("dense bf16 4096^3", lambda a=a, b=b, out=out: torch.mm(a, b, out=out), mm_flops, long_iters)
    del a, b, out

    s = SHAPES[args.shape]
    torch.cuda.set_device(dev)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29556", rank=0, world_size=1)
    inputs = make_layer_inputs(s, tokens=s.tokens, device=dev)  # the bench's exact routing
    cfg = dm.MoEConfig(hidden=s.hidden, ffn=s.ffn, num_experts=s.num_experts, top_k=s.top_k,
                       max_tokens=s.tokens, precision="bf16", training=False, row_block=128)
    layer = dm.MoEContext(cfg, device=dev)
    fwd_flops = 6 * s.tokens * s.top_k * s.hidden * s.ffn
    args_ = (inputs.x_TD, inputs.expert_ids_TK, inputs.scores_TK, inputs.w13_e2FD,
             inputs.w2_eDF)

    def fwd():
        with torch.no_grad():
            layer(*args_)

    run(f"distmoe fwd {args.shape}", fwd, fwd_flops, 30)
    run(f"distmoe fwd {args.shape}", fwd, fwd_flops, 3)
    run(f"distmoe fwd {args.shape}", fwd, fwd_flops, 30)
    layer.close()
    dist.destroy_process_group()
    if args.csv:
        write_csv(args.csv, rows, list(rows[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
