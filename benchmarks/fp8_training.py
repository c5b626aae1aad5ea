"""Training at bf16, mxfp8 and fp8_block: eager forward and forward+backward of one layer
(issue 58's training targets: forward+backward at least 1.4x bf16 at dense-e32 and 1.2x at
qwen3-30b-a3b).

    PYTHONPATH=src python benchmarks/fp8_training.py [--shapes dense-e32 qwen3-30b-a3b]
        [--precisions bf16 mxfp8 fp8_block] [--json out/fp8_training.json]

One process, one GPU, EP = 1, sampled routing (each token draws K distinct experts), the
public API as a training loop calls it (``MoEContext(cfg)`` with its defaults: every context
replays its own CUDA graphs, :mod:`distmoe.ops.graphs`). Timed by the
shared harness (:func:`distmoe.tools.bench.timing.benchmark`, eager CUDA-event windows, median
window): ``fwd``, the training forward (autograd on, the graph dropped), and ``fwdbwd``,
forward + ``torch.autograd.grad`` of every input. The FP8 weights are quantised once per
weight version, so not inside the timed calls (the weights do not change). Prints ms and the
ratio bf16 / precision (above 1: faster than bf16); ``--json`` writes them with the
environment (GPU, versions, git SHA, date, command).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

import distmoe as dm
from distmoe.tools.bench.report import environment
from distmoe.tools.bench.timing import TimingConfig, benchmark

SHAPES = {  # name: (T, D, F, E, K)
    "dense-e32": (8192, 4096, 2048, 32, 8),
    "qwen3-30b-a3b": (4096, 2048, 768, 128, 8),
}


def _inputs(T, D, F, E, K, dev):
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, D, device=dev, generator=g).bfloat16().requires_grad_(True)
    ids = torch.rand(T, E, device=dev, generator=g).topk(K, dim=1).indices.to(torch.int32)
    scores = torch.softmax(torch.rand(T, K, device=dev, generator=g), 1).requires_grad_(True)
    w13 = (torch.randn(E, 2, F, D, device=dev, generator=g) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, F, device=dev, generator=g) / F**0.5).bfloat16()
    return x, ids, scores, w13.requires_grad_(True), w2.requires_grad_(True)


def _gluon_scaled(ctx) -> None:
    """Put the Gluon forms' configs (:func:`distmoe.plan.rules.scaled_gemm` and
    :func:`~distmoe.plan.rules.fp8_wgrad` with ``gluon=True``) in place of the plan's in an
    FP8 context: the A/B of :data:`~distmoe.plan.rules.PICK_GLUON_SCALED` in one run."""
    from distmoe.ops.lowp import FP8_FORMATS
    from distmoe.plan import rules

    cfg = ctx.cfg
    D, F, bm = cfg.hidden, cfg.ffn, cfg.row_block
    fmt = ctx._lowp.format
    g = FP8_FORMATS[fmt][0]

    def gemm(k, n, swiglu=False):
        return rules.scaled_gemm(k=k, n=n, swiglu=swiglu, k_group=g, block_m=bm, gluon=True)

    ctx._lowp = dataclasses.replace(ctx._lowp, w13_config=gemm(D, 2 * F, True),
                                    w2_config=gemm(F, D))
    ctx._lowp_train = dataclasses.replace(
        ctx._lowp_train, w13_h1=gemm(D, 2 * F), w2_dgrad=gemm(D, F), w13_dgrad=gemm(2 * F, D),
        w13_wgrad=ctx._lowp_train.w13_wgrad and rules.fp8_wgrad(
            fmt=fmt, row_block=bm, out_rows=2 * F, out_cols=D, gluon=True, pick=True),
        w2_wgrad=ctx._lowp_train.w2_wgrad and rules.fp8_wgrad(
            fmt=fmt, row_block=bm, out_rows=D, out_cols=F, gluon=True, pick=True))


def run_case(shape: str, precision: str, timing: TimingConfig) -> dict:
    precision, _, kernel = precision.partition("/")
    T, D, F, E, K = SHAPES[shape]
    dev = torch.device("cuda", torch.cuda.current_device())
    x, ids, scores, w13, w2 = _inputs(T, D, F, E, K, dev)
    cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T,
                       precision=precision, training=True)
    out = {"shape": shape, "precision": precision + (f"/{kernel}" if kernel else "")}
    with dm.MoEContext(cfg, device=dev) as ctx:
        options = set(kernel.split("+")) - {""}
        if "fp8wgrad" in options:  # the FP8 weight gradients where they apply
            from distmoe.ops.lowp_train import fp8_train_configs

            ctx._lowp_train = fp8_train_configs(cfg, dev, fp8_wgrad=True)
        if "gluon" in options:
            _gluon_scaled(ctx)
        leaves = (x, scores, w13, w2)

        def fwd():
            ctx(x, ids, scores, w13, w2)
            ctx.reset_slots()  # the dropped graph's layer leaves its slot

        def fwdbwd():
            y = ctx(x, ids, scores, w13, w2)
            torch.autograd.grad(y, leaves, y)

        for mode, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
            res = benchmark(fn, config=timing, device=dev, graph_safe=False)
            out[mode] = {"ms": res.iter_ms, "min_ms": res.stats.min_ms,
                         "max_ms": res.stats.max_ms, "method": res.method}
    out["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    torch.cuda.reset_peak_memory_stats(dev)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--precisions", nargs="+", default=["bf16", "mxfp8", "fp8_block"],
                    help="bf16, mxfp8, fp8_block, each FP8 one with an A/B suffix of options "
                         "joined by '+': '/fp8wgrad' takes FP8 weight gradients (token-axis "
                         "operands) instead of bf16's, '/gluon' runs the block-scaled GEMMs "
                         "(and FP8 weight gradients) on their Gluon forms whatever the plan "
                         "says (e.g. fp8_block/fp8wgrad)")
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    for p in args.precisions:
        base, _, opts = p.partition("/")
        bad = set(opts.split("+")) - {"", "gluon", "fp8wgrad"}
        if base not in ("bf16", "mxfp8", "fp8_block") or bad or (opts and base == "bf16"):
            ap.error(f"--precisions: {p!r} is not bf16, mxfp8 or fp8_block with options "
                     "from gluon, fp8wgrad")
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    timing = TimingConfig(num_warmup=3, num_windows=args.windows, iters_per_window=args.iters,
                          capture_iters=args.iters, use_cuda_graph=False, telemetry=False)
    rows = []
    for shape in args.shapes:
        base = {}
        for precision in args.precisions:
            r = run_case(shape, precision, timing)
            for mode in ("fwd", "fwdbwd"):
                if precision == "bf16":
                    base[mode] = r[mode]["ms"]
                if mode in base:
                    r[mode]["x_bf16"] = base[mode] / r[mode]["ms"]
            rows.append(r)
            print(f"{shape:15s} {precision:16s} fwd {r['fwd']['ms']:8.3f} ms "
                  f"(x{r['fwd'].get('x_bf16', float('nan')):.2f})  fwd+bwd "
                  f"{r['fwdbwd']['ms']:8.3f} ms (x{r['fwdbwd'].get('x_bf16', float('nan')):.2f})"
                  f"  peak {r['peak_gib']:.1f} GiB", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"environment": environment(sys.argv), "mode": "eager",
                                         "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
