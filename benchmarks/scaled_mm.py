"""Block-scaled grouped GEMMs (``distmoe.kernels.scaled``) against the dense FP8 rate and bf16.

    python benchmarks/scaled_mm.py                       # W13 of dense-e32: T8192 K8 D4096 F2048 E32
    python benchmarks/scaled_mm.py --k 2048 --n 4096 --no-swiglu   # its W2
    python benchmarks/scaled_mm.py --json out/scaled_mm.json

One GPU, one run, every provider timed by the shared harness
(:func:`distmoe.tools.bench.timing.benchmark`: warm-ups, CUDA-graph windows, median window and
its range):

* ``dense_fp8``: ``torch._scaled_mm`` on e4m3 at 8192^3, per-tensor scales, bf16 out: the dense
  FP8 rate of this GPU in this run (issue 58's ceiling);
* ours on ``--rows`` rows routed at random over ``--experts`` experts (segments padded to
  128), K = ``--k``, N = ``--n`` (2F with SwiGLU, on by default), one entry per
  ``--variants``: ``mxfp8`` (exact MXFP8, a promotion per 32-wide K step), ``mxfp8_rebased``
  (rebased onto 128-wide groups, :func:`distmoe.quant.mxfp8_rebase`: a promotion per 128),
  ``fp8_block`` (DeepSeek-V3's 1 x 128 / 128 x 128 float32 scales); ``--sweep`` also times
  a few configs of each and reports the best; the two 128-group variants also run the
  warp-specialised Gluon kernel (``<variant>_gluon``; ``--sweep``: ring depths 4-6);
  ``nvfp4_bf16`` / ``nvfp4_fp8``: NVFP4 weights (issue 59 item 4) expanded to bf16 operands
  beside bf16 rows (:func:`~distmoe.kernels.scaled.nvfp4_weight_grouped_mm`) or to E4M3
  beside 1 x 128 FP8 rows (:func:`~distmoe.kernels.scaled.nvfp4.nvfp4_weight_fp8_mm`);
  ``nvfp4_fp8_quant`` also times the rows' quantisation (``fp8_block_quantize_2d``) in each
  call, as a layer would pay it; ``<variant>_split``: the plan's config (and with ``--sweep``
  the first transposed one) with ``interleave_k=False`` (a dot per K parity);
* ``torch_scaled_grouped``: ``torch._scaled_grouped_mm`` with rowwise FP8 scales (one per
  row and per weight column; no SwiGLU epilogue), where this torch has it;
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

from distmoe.kernels.scaled import (
    ScaledGemmConfig,
    fp8_block_grouped_mm,
    mxfp8_grouped_mm,
    nvfp4_weight_config,
    nvfp4_weight_grouped_mm,
)
from distmoe.kernels.scaled.nvfp4 import fp4_weight_fp8_config, nvfp4_weight_fp8_mm
from distmoe.quant import (
    fp8_block_quantize,
    fp8_block_quantize_weight,
    mxfp8_quantize,
    mxfp8_quantize_weight,
    mxfp8_rebase,
    nvfp4_quantize,
)
from distmoe.quant.fp8_block import fp8_block_quantize_2d
from distmoe.tools.bench.report import environment
from distmoe.tools.bench.timing import TimingConfig, benchmark

DENSE = 8192
VARIANTS = ("mxfp8", "mxfp8_rebased", "fp8_block", "nvfp4_bf16", "nvfp4_fp8")
FP4_VARIANTS = ("nvfp4_bf16", "nvfp4_fp8")
SWEEP = ({"block_n": 256, "num_stages": 3}, {"block_n": 128, "num_stages": 4})


def _rate(flops: float, res) -> dict:
    return {"ms": res.iter_ms, "min_ms": res.stats.min_ms, "max_ms": res.stats.max_ms,
            "tflops": flops / (res.iter_ms * 1e-3) / 1e12, "method": res.method}


def _time_config(out, name, fn, cfg, flops, timing, dev) -> None:
    """Time ``fn`` (one config ``cfg`` of entry ``name``) into ``out[name + "_configs"]``,
    keeping the fastest as ``out[name]``; a config that fails to compile is reported and
    skipped."""
    try:
        res = benchmark(fn, config=timing, device=dev)
    except Exception as exc:
        print(f"  {name} {cfg}: {type(exc).__name__}: {str(exc)[:300]}")
        return
    entry = _rate(flops, res) | {"config": dataclasses.asdict(cfg)}
    out.setdefault(name + "_configs", []).append(entry)
    if name not in out or entry["tflops"] > out[name]["tflops"]:
        out[name] = entry


#: (block_m, block_n, block_k, num_warps, num_stages, swap_ab) tried by ``--sweep`` for the
#: FP4-weight variants (block_m divides the 128-row padding; the FP8-operand kernel needs
#: block_k 128 and no swap)
FP4_SWEEP = ((16, 64, 64, 4, 3, False), (16, 64, 128, 4, 3, False),
             (64, 64, 128, 4, 3, False), (128, 64, 128, 8, 2, False),
             (128, 128, 64, 8, 3, False),
             (16, 64, 128, 4, 3, True), (16, 128, 128, 8, 3, True), (32, 64, 128, 4, 3, True),
             (64, 128, 64, 8, 3, True), (128, 128, 64, 8, 2, True))


def _time_fp4(variant, x, w, padded_offsets, row_offsets, y, args, flops, timing, dev, out):
    """Time one FP4-weight variant (module docstring) into ``out[variant]`` (and
    ``out["nvfp4_fp8_quant"]``); with ``--sweep`` every :data:`FP4_SWEEP` config that applies,
    the best kept."""
    e, n, k = w.shape
    packed, scales, gs = nvfp4_quantize(w.reshape(e, -1), dim=-1, per="row")
    packed, scales = packed.view(e, n, k // 2), scales.view(e, n, k // 16)
    gs = gs.reshape(e).contiguous()
    fp8 = variant == "nvfp4_fp8"
    base = (fp4_weight_fp8_config if fp8 else nvfp4_weight_config)(k=k, n=n, swiglu=args.swiglu)
    configs = [base]
    if args.sweep:
        for bm, bn, bk, warps, stages, swap in FP4_SWEEP:
            if fp8 and (bk != 128 or swap):
                continue
            cfg = ScaledGemmConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=warps,
                                   num_stages=stages, swap_ab=swap)
            if cfg not in configs:
                configs.append(cfg)
    # a dot per K parity (config.interleave_k False): the plan's config and the first
    # transposed one, reported as "<variant>_split"
    swapped = [c for c in configs if c.swap_ab][:1]
    configs += [dataclasses.replace(c, interleave_k=False) for c in [base, *swapped]]
    if fp8:
        a_q, a_s = fp8_block_quantize(x)
    for cfg in configs:
        calls = {}
        if not fp8:
            calls[variant] = lambda cfg=cfg: nvfp4_weight_grouped_mm(
                x, packed, scales, gs, padded_offsets, row_offsets, y, swiglu=args.swiglu,
                config=cfg)
        else:
            def gemm(cfg=cfg):
                return nvfp4_weight_fp8_mm(a_q, a_s, packed, scales, gs, padded_offsets,
                                           row_offsets, y, swiglu=args.swiglu, config=cfg)

            def quant_and_gemm(gemm=gemm):
                fp8_block_quantize_2d(x, a_q, a_s)
                return gemm()

            calls[variant], calls[variant + "_quant"] = gemm, quant_and_gemm
        for name, fn in calls.items():
            _time_config(out, name if cfg.interleave_k else name + "_split", fn, cfg, flops,
                         timing, dev)


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
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--sweep", action="store_true", help="time a few configs of each variant")
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
    out_n = n // 2 if args.swiglu else n
    y = torch.empty(r, out_n, device=dev, dtype=torch.bfloat16)
    flops = 2 * r * n * k
    overrides = {name: v for name, v in (("block_n", args.block_n), ("block_k", args.block_k),
                                         ("num_warps", args.warps), ("num_stages", args.stages))
                 if v is not None}
    for variant in [v for v in args.variants if v in FP4_VARIANTS]:
        _time_fp4(variant, x, w, padded_offsets, row_offsets, y, args, flops, timing, dev, out)
    for variant in [v for v in args.variants if v not in FP4_VARIANTS]:
        if variant == "fp8_block":
            a_q, a_s = fp8_block_quantize(x)
            b_q, b_s = fp8_block_quantize_weight(w)
            group = 128
        else:
            a_q, a_s = mxfp8_quantize(x)
            w8 = mxfp8_quantize_weight(w)
            b_q, b_s = w8.qdata, w8.scales
            group = 32
            if variant == "mxfp8_rebased":
                a_q, a_s, changed_a = mxfp8_rebase(a_q, a_s)
                b_q, b_s, changed_b = mxfp8_rebase(b_q, b_s)
                group = 128
                out[variant + "_rebase_changed"] = {
                    "activations": int(changed_a) / a_q.numel(),
                    "weights": int(changed_b) / b_q.numel()}

        def call(cfg, a_q=a_q, a_s=a_s, b_q=b_q, b_s=b_s, variant=variant):
            if variant == "fp8_block":
                return fp8_block_grouped_mm(a_q, a_s, b_q, b_s, padded_offsets, row_offsets, y,
                                            swiglu=args.swiglu, config=cfg)
            return mxfp8_grouped_mm(a_q, a_s, b_q, b_s, padded_offsets, row_offsets, y,
                                    swiglu=args.swiglu, config=cfg,
                                    k_group=32 if variant == "mxfp8" else 128)

        base = ScaledGemmConfig.for_widths(k=k, n=n, swiglu=args.swiglu, k_group=group)
        configs = [dataclasses.replace(base, **overrides)]
        if args.sweep:
            for change in SWEEP:
                try:
                    cfg = dataclasses.replace(base, **change)
                except ValueError:
                    continue
                if cfg.block_k >= group and cfg.fits_hopper(swiglu=args.swiglu) \
                        and cfg not in configs:
                    configs.append(cfg)
        if group == 128:  # the warp-specialised Gluon kernel, reported as its own entry
            configs += [ScaledGemmConfig(block_m=128, block_n=64 if args.swiglu else 128,
                                         block_k=128, num_warps=8, num_stages=stages,
                                         gluon=True)
                        for stages in ((4, 5, 6) if args.sweep else (5,))]
        for cfg in configs:
            name = variant + ("_gluon" if cfg.gluon else "")
            _time_config(out, name, lambda cfg=cfg: call(cfg), cfg, flops, timing, dev)
        del a_q, a_s, b_q, b_s

    # torch's rowwise-FP8 grouped GEMM (where present): one scale per row and weight column
    try:
        xr_s = x.float().abs().amax(-1).clamp(min=1e-12) / 448.0
        xr_q = (x.float() / xr_s[:, None]).to(torch.float8_e4m3fn)
        wr_s = w.float().abs().amax(-1).clamp(min=1e-12) / 448.0  # [E, N]
        wr_q = (w.float() / wr_s[..., None]).to(torch.float8_e4m3fn)  # [E, N, K]
        offs32 = row_offsets[1:].contiguous()
        res = benchmark(lambda: torch._scaled_grouped_mm(
            xr_q, wr_q.transpose(1, 2), xr_s, wr_s, offs=offs32, out_dtype=torch.bfloat16),
            config=timing, device=dev)
        out["torch_scaled_grouped"] = _rate(flops, res)
    except Exception as exc:
        out["torch_scaled_grouped_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(f"  torch_scaled_grouped: {out['torch_scaled_grouped_error']}")

    wt = w.transpose(1, 2)  # [E, K, N]
    offs = row_offsets[1:].contiguous()
    res = benchmark(lambda: torch._grouped_mm(x, wt, offs=offs), config=timing, device=dev)
    out["bf16_grouped"] = _rate(flops, res)

    dense = out["dense_fp8"]["tflops"]
    print(f"{out['env']['gpu']}  R={r} E={e} K={k} N={n} swiglu={args.swiglu}")
    names = [v + g for v in args.variants for g in ("", "_gluon", "_quant", "_split")]
    for name in ("dense_fp8", *names, "torch_scaled_grouped", "bf16_grouped"):
        if name not in out:
            continue
        v = out[name]
        out[name]["ratio_vs_dense_fp8"] = v["tflops"] / dense
        out[name]["ratio_vs_bf16_grouped"] = v["tflops"] / out["bf16_grouped"]["tflops"]
        print(f"  {name:22s} {v['tflops']:8.1f} TFLOP/s  {v['ms']:.3f} ms "
              f"[{v['min_ms']:.3f}, {v['max_ms']:.3f}] ({v['method']})  "
              f"{v['tflops'] / dense:.3f} of dense FP8  "
              + (str(v["config"]) if "config" in v else ""))
    for name in (v + g for v in FP4_VARIANTS for g in ("", "_quant", "_split")):
        swept = out.get(name + "_configs", [])
        for entry in swept if len(swept) > 1 else ():
            c = entry["config"]
            print(f"    {name:18s} {entry['ms']:.3f} ms  bm {c['block_m']} bn {c['block_n']} "
                  f"bk {c['block_k']} w {c['num_warps']} s {c['num_stages']}"
                  + (" swap" if c["swap_ab"] else "") + ("" if c["interleave_k"] else " split"))
    for variant in args.variants:
        if variant + "_rebase_changed" in out:
            print(f"  {variant}: values changed by rebasing {out[variant + '_rebase_changed']}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
