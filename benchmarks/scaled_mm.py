"""MXFP8 grouped GEMM (``distmoe.kernels.scaled``) against the dense FP8 rate and bf16 grouped.

    python benchmarks/scaled_mm.py                       # W13 of dense-e32: T8192 K8 D4096 F2048 E32
    python benchmarks/scaled_mm.py --k 2048 --n 4096 --no-swiglu   # its W2
    python benchmarks/scaled_mm.py --json out/scaled_mm.json

One GPU, one run, every provider timed by the shared harness
(:func:`distmoe.tools.bench.timing.benchmark`: warm-ups, CUDA-graph windows, median window and
its range):

* ``dense_fp8``: ``torch._scaled_mm`` on e4m3 at 8192^3, per-tensor scales, bf16 out: the dense
  FP8 rate of this GPU in this run (issue 58's ceiling);
* ``mxfp8_grouped_mm``: ours on ``--rows`` rows routed at random over ``--experts`` experts
  (segments padded to 128), K = ``--k``, N = ``--n`` (2F with SwiGLU, on by default);
* ``bf16_grouped``: ``torch._grouped_mm`` on the same rows and weights in bf16 (the GEMM only,
  no SwiGLU epilogue).

Prints useful TFLOP/s (2 R N K over the live rows) and the ratios ours / dense_fp8 and
ours / bf16_grouped; ``--json`` also writes them with the environment (GPU, versions, git SHA,
date). Operand quantisation is not timed (weights are quantised once per weight version;
activations would be quantised by the producer kernel).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from distmoe.kernels.scaled import ScaledGemmConfig, mxfp8_grouped_mm
from distmoe.quant import mxfp8_quantize, mxfp8_quantize_weight
from distmoe.tools.bench.report import environment
from distmoe.tools.bench.timing import TimingConfig, benchmark

DENSE = 8192


def _rate(flops: float, res) -> dict:
    return {"ms": res.iter_ms, "min_ms": res.stats.min_ms, "max_ms": res.stats.max_ms,
            "tflops": flops / (res.iter_ms * 1e-3) / 1e12, "method": res.method}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=8192 * 8, help="routed rows R (T x top-k)")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--k", type=int, default=4096, help="reduction width (D for W13)")
    p.add_argument("--n", type=int, default=4096, help="weight rows per expert (2F with SwiGLU)")
    p.add_argument("--swiglu", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--block-n", type=int, default=None, help="override the config's block_n")
    p.add_argument("--block-k", type=int, default=None, help="override the config's block_k")
    p.add_argument("--warps", type=int, default=None)
    p.add_argument("--stages", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    timing = TimingConfig()
    gen = torch.Generator().manual_seed(0)
    out: dict = {"env": environment(), "shape": vars(args) | {"json": str(args.json)}}

    # dense FP8 rate: torch._scaled_mm at 8192^3 (B column-major, per-tensor scales)
    a8 = torch.randn(DENSE, DENSE, device=dev).to(torch.float8_e4m3fn)
    b8 = torch.randn(DENSE, DENSE, device=dev).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=dev)
    res = benchmark(lambda a8=a8, b8=b8: torch._scaled_mm(a8, b8, one, one,
                                                          out_dtype=torch.bfloat16),
                    config=timing, device=dev)
    out["dense_fp8"] = _rate(2 * DENSE**3, res)
    del a8, b8

    # routed rows: random counts, segments padded to 128
    e, r, k, n = args.experts, args.rows, args.k, args.n
    counts = torch.bincount(torch.randint(0, e, (r,), generator=gen), minlength=e)
    row_offsets = torch.zeros(e + 1, dtype=torch.int32)
    row_offsets[1:] = counts.cumsum(0)
    padded_offsets = torch.zeros(e + 1, dtype=torch.int32)
    padded_offsets[1:] = ((counts + 127) // 128 * 128).cumsum(0)
    row_offsets, padded_offsets = row_offsets.to(dev), padded_offsets.to(dev)
    x = torch.randn(r, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device=dev, dtype=torch.bfloat16) * k**-0.5
    a_q, a_scales = mxfp8_quantize(x)
    w8 = mxfp8_quantize_weight(w)
    out_n = n // 2 if args.swiglu else n
    y = torch.empty(r, out_n, device=dev, dtype=torch.bfloat16)
    config = ScaledGemmConfig.for_widths(k=k, n=n, swiglu=args.swiglu)
    overrides = {name: v for name, v in (("block_n", args.block_n), ("block_k", args.block_k),
                                         ("num_warps", args.warps), ("num_stages", args.stages))
                 if v is not None}
    if overrides:
        config = dataclasses.replace(config, **overrides)
    out["config"] = dataclasses.asdict(config)
    flops = 2 * r * n * k
    res = benchmark(lambda: mxfp8_grouped_mm(a_q, a_scales, w8.qdata, w8.scales, padded_offsets,
                                             row_offsets, y, swiglu=args.swiglu, config=config),
                    config=timing, device=dev)
    out["mxfp8_grouped_mm"] = _rate(flops, res)

    wt = w.transpose(1, 2)  # [E, K, N]
    offs = row_offsets[1:].contiguous()
    res = benchmark(lambda: torch._grouped_mm(x, wt, offs=offs), config=timing, device=dev)
    out["bf16_grouped"] = _rate(flops, res)

    ours = out["mxfp8_grouped_mm"]["tflops"]
    out["ratio_vs_dense_fp8"] = ours / out["dense_fp8"]["tflops"]
    out["ratio_vs_bf16_grouped"] = ours / out["bf16_grouped"]["tflops"]
    print(f"{out['env']['gpu']}  R={r} E={e} K={k} N={n} swiglu={args.swiglu}  {config}")
    for name in ("dense_fp8", "mxfp8_grouped_mm", "bf16_grouped"):
        v = out[name]
        print(f"  {name:18s} {v['tflops']:8.1f} TFLOP/s  {v['ms']:.3f} ms "
              f"[{v['min_ms']:.3f}, {v['max_ms']:.3f}] ({v['method']})")
    print(f"  ours / dense_fp8 = {out['ratio_vs_dense_fp8']:.3f}   "
          f"ours / bf16_grouped = {out['ratio_vs_bf16_grouped']:.3f}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
