#!/usr/bin/env python3
"""Run 55: the grouped WGRAD kernels at exactly ``--rows`` rows per expert (DeepSeek-V3's
D=7168 F=2048 by default), one config at a time, for timing and for Nsight Compute.

    PYTHONPATH=src python3 probe.py --experts 256 --time            # every config, do_bench
    ncu ... python3 probe.py --experts 64 --config wide --kernel w13  # one launch after one

Configs: ``plain`` (persistent Gluon, 128 x 128, 4 warps, 4 stages), ``wide`` (warp-
specialised 256 x 128, 8 MMA warps, 3 stages: the heuristic's pick from 12 MiB per expert),
``pp`` (warp-specialised ping-pong 128 x 128, 4 warps, 5 stages), ``coop`` (warp-specialised
128 x 128, 8 warps, 5 stages). Timing reports ms, TFLOP/s and the output's write rate
(E * P * Q bf16 per call), and each config's largest difference from ``plain``'s output
(poisoned with NaN before each config's first call). ``widels`` / ``ppls``: wide and
ping-pong with their producers in lockstep (``WgradConfig.lockstep``, run 55 call 7).
"""
from __future__ import annotations

import argparse

import torch

CONFIGS = {
    "plain": dict(block_out_m=128, num_warps=4, num_stages=4),
    "wide": dict(block_out_m=256, num_warps=8, num_stages=3, specialized=True),
    "pp": dict(block_out_m=128, num_warps=4, num_stages=5, specialized=True, pingpong=True),
    "coop": dict(block_out_m=128, num_warps=8, num_stages=5, specialized=True),
    "widels": dict(block_out_m=256, num_warps=8, num_stages=3, specialized=True, lockstep=True),
    "ppls": dict(block_out_m=128, num_warps=4, num_stages=5, specialized=True, pingpong=True,
                 lockstep=True),
}


def main() -> int:
    import triton.testing

    from distmoe.kernels.w2_backward import WgradConfig, w2_wgrad
    from distmoe.kernels.w13_backward import w13_wgrad

    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--rows", type=int, default=128, help="rows per expert (all equal)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--config", nargs="+", default=["plain", "wide", "pp", "coop"],
                    choices=list(CONFIGS))
    ap.add_argument("--kernel", nargs="+", default=["w13", "w2"], choices=["w13", "w2"])
    ap.add_argument("--time", action="store_true", help="do_bench each (else: 2 launches)")
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    E, D, F, n = args.experts, args.hidden, args.ffn, args.rows
    R = E * n
    ro = (torch.arange(E + 1, dtype=torch.int32) * n).to(dev)
    po = (torch.arange(E + 1, dtype=torch.int32) * ((n + 127) // 128 * 128)).to(dev)
    torch.manual_seed(0)
    x = torch.randn(R, D, device=dev).bfloat16()
    gh1 = torch.randn(R, 2 * F, device=dev).bfloat16()
    gh3 = torch.randn(R, D, device=dev).bfloat16()
    h2 = torch.randn(R, F, device=dev).bfloat16()
    outs = {"w13": torch.empty(E, 2, F, D, device=dev, dtype=torch.bfloat16),
            "w2": torch.empty(E, D, F, device=dev, dtype=torch.bfloat16)}
    shapes = {"w13": (2 * F, D), "w2": (D, F)}

    def launch(kernel, cfg):
        if kernel == "w13":
            w13_wgrad(gh1, x, po, ro, outs["w13"], accumulate=False, config=cfg)
        else:
            w2_wgrad(gh3, h2, po, ro, outs["w2"], accumulate=False, config=cfg)

    rows = []
    for kernel in args.kernel:
        P, Q = shapes[kernel]
        ref = None
        for name in args.config:
            cfg = WgradConfig(block_m=128, block_k=64, block_out_n=128, gluon=True,
                              **CONFIGS[name])
            outs[kernel].fill_(float("nan"))
            launch(kernel, cfg)
            if not args.time:
                launch(kernel, cfg)
                torch.cuda.synchronize()
                continue
            if ref is None:
                ref = outs[kernel].clone()
            err = max(((o.float() - r.float()).abs().max() / r.float().abs().max()).item()
                      for o, r in zip(outs[kernel], ref, strict=True))
            ms = triton.testing.do_bench(lambda k=kernel, c=cfg: launch(k, c), warmup=5,
                                         rep=40)
            tiles = E * (-(-P // cfg.block_out_m)) * (-(-Q // 128))
            rows.append((kernel, name, ms, 2 * R * P * Q / ms / 1e9,
                         E * P * Q * 2 / ms / 1e6, ms * 1e3 * 132 / tiles, err))
        ref = None
    torch.cuda.synchronize()
    if rows:
        print(f"E={E} rows/expert={n} D={D} F={F} ({torch.cuda.get_device_name()})")
        print(f"{'kernel':6} {'config':6} {'ms':>8} {'TFLOP/s':>8} {'GB/s out':>9} "
              f"{'us/tile/SM':>10} {'err':>8}")
        for k, name, ms, tf, gbs, us, err in rows:
            print(f"{k:6} {name:6} {ms:8.3f} {tf:8.1f} {gbs:9.0f} {us:10.2f} {err:8.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
