"""Training at bf16, mxfp8 and fp8_block: eager forward and forward+backward of one layer
(issue 58's training targets: forward+backward at least 1.4x bf16 at dense-e32 and 1.2x at
qwen3-30b-a3b).

    PYTHONPATH=src python benchmarks/fp8_training.py [--shapes dense-e32 qwen3-30b-a3b]
        [--precisions bf16 mxfp8 fp8_block] [--json out/fp8_training.json]

One process, one GPU, EP = 1, sampled routing (each token draws K distinct experts), the
public API as a training loop calls it (``MoEContext(cfg)`` with its defaults: the bf16
context replays its own CUDA graphs, the FP8 contexts run every kernel eagerly). Timed by the
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


def _triton_scaled(ctx) -> None:
    """Put the Triton kernels' configs (:meth:`ScaledGemmConfig.for_widths`, and the FP8
    weight gradients' without Gluon) in place of the plan's in an FP8 context: the A/B of
    the Gluon choices of :func:`distmoe.plan.rules.scaled_gemm` and
    :func:`~distmoe.plan.rules.fp8_wgrad` in one run."""
    from distmoe.kernels.scaled import ScaledGemmConfig

    def plain(c: ScaledGemmConfig, k: int, n: int, swiglu: bool = False) -> ScaledGemmConfig:
        k_group = 128 if c.block_k == 128 and c.gluon else None
        if k_group is None:
            return c
        return ScaledGemmConfig.for_widths(k=k, n=n, swiglu=swiglu, block_m=c.block_m,
                                           k_group=k_group)

    def triton_wgrad(c):
        return c and dataclasses.replace(c, gluon=False, num_stages=3)

    D, F = ctx.cfg.hidden, ctx.cfg.ffn
    lp, lt = ctx._lowp, ctx._lowp_train
    ctx._lowp = dataclasses.replace(lp, w13_config=plain(lp.w13_config, D, 2 * F, True),
                                    w2_config=plain(lp.w2_config, F, D))
    ctx._lowp_train = dataclasses.replace(lt, w13_h1=plain(lt.w13_h1, D, 2 * F),
                                          w2_dgrad=plain(lt.w2_dgrad, D, F),
                                          w13_dgrad=plain(lt.w13_dgrad, 2 * F, D),
                                          w13_wgrad=triton_wgrad(lt.w13_wgrad),
                                          w2_wgrad=triton_wgrad(lt.w2_wgrad))


def run_case(shape: str, precision: str, timing: TimingConfig) -> dict:
    precision, _, kernel = precision.partition("/")
    T, D, F, E, K = SHAPES[shape]
    dev = torch.device("cuda", torch.cuda.current_device())
    x, ids, scores, w13, w2 = _inputs(T, D, F, E, K, dev)
    cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T,
                       precision=precision, training=True)
    out = {"shape": shape, "precision": precision + (f"/{kernel}" if kernel else "")}
    with dm.MoEContext(cfg, device=dev) as ctx:
        if kernel == "triton":
            _triton_scaled(ctx)
        elif kernel == "bf16wgrad":  # the plan's GEMMs, the weight gradients in bf16
            ctx._lowp_train = dataclasses.replace(ctx._lowp_train, w13_wgrad=None,
                                                  w2_wgrad=None)
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
                    choices=["bf16", "mxfp8", "fp8_block", "mxfp8/triton", "fp8_block/triton",
                             "mxfp8/bf16wgrad", "fp8_block/bf16wgrad"],
                    help="A/B in one run: '/triton' runs the block-scaled GEMMs and the FP8 "
                         "weight gradients on their Triton kernels instead of the plan's "
                         "Gluon ones; '/bf16wgrad' the weight gradients in bf16")
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
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
