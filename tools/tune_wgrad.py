#!/usr/bin/env python3
"""Time the grouped WGRAD kernels over launch configurations on one GPU.

Usage (repository root, one GPU):
    PYTHONPATH=src python3 tools/tune_wgrad.py [--shapes fine issue-a] [--csv FILE]

For each named bench shape (EP=1) and routing (``random``: T*K rows spread at random over E
experts, so most experts end in a partial row step; ``balanced``: T*K/E rows each, as the
layer benchmark routes), times ``w13_wgrad`` and ``w2_wgrad`` (overwrite mode, bf16 output,
W13's x rows in a 1-D base at a device-side offset: as autograd runs them) for a set of
candidate configs, the persistent Gluon kernel's configs (each also in its warp-specialised
form where that takes the tile) and the current heuristic (``w13_wgrad_2d``: the heuristic with x as a 2-D
tensor, both descriptors from the host, to show what the device-built one costs), with
``triton.testing.do_bench`` (median of repeated runs, L2 not flushed). Before timing, each
config writes a NaN-poisoned output once and ``err`` is its largest difference from the
heuristic's output, relative to that output's largest magnitude (same row steps in the same
order: expect 0 or rounding-level differences; NaN means an element was not written).
``w13_wgrad_x_rows`` reads x's rows in place through a gather table instead (``x_rows``:
token-major x, each token on K rows in random order; what a layer that kept x runs at EP=1),
for the heuristic and the warp-specialised Gluon configs.
Prints one table per kernel, fastest first, with TFLOP/s (2 * rows * P * Q per call), and
writes every row to ``--csv`` when given.
"""

from __future__ import annotations

import argparse
import itertools

import torch


def _rel_err(got, ref):
    """Largest |got - ref| over the largest |ref|, in fp32 one expert at a time (a whole
    fp32 copy of deepseek-v3's W13 gradients is 28 GiB); NaN where got holds a NaN."""
    diff = torch.stack([(g.float() - r.float()).abs().max()
                        for g, r in zip(got, ref, strict=True)])
    mag = torch.stack([r.float().abs().max() for r in ref])
    return (diff.max() / mag.max()).item()


def _candidates(WgradConfig, out_rows, out_cols, hint, quick=False):
    from distmoe.kernels.wgrad_gluon import GLUON_WGRAD_CONFIGS

    # first: what the layer runs (the heuristic with its shape hint)
    out = [WgradConfig.from_heuristic(out_rows=out_rows, out_cols=out_cols,
                                      rows_per_expert=hint, device=torch.device("cuda", 0))]
    # the Triton kernel's heuristic (what runs where Gluon cannot)
    out.append(WgradConfig.from_heuristic(out_rows=out_rows, out_cols=out_cols,
                                          rows_per_expert=hint))
    for (bm, bn), bk, stages, warps in itertools.product(
        [] if quick else [(128, 128), (128, 256), (256, 128), (64, 128), (128, 64)],
        [64, 128], [3, 4], [8]
    ):
        cfg = WgradConfig(block_m=128, block_k=bk, block_out_m=min(bm, out_rows),
                          block_out_n=min(bn, out_cols), num_warps=warps, num_stages=stages)
        if cfg.fits_hopper() and cfg not in out:
            out.append(cfg)
    # the persistent Gluon kernel (distmoe.kernels.wgrad_gluon), timed with --quick too, its
    # warp-specialised form where it takes the tile (at most 128 columns), and that form's
    # ping-pong warpgroups (4 warps, 128 rows)
    for (bp, bq, stages, warps, bk), (ws, pp) in itertools.product(
            GLUON_WGRAD_CONFIGS, ((False, False), (True, False), (True, True))):
        if ws and min(bq, out_cols) > 128 or pp and (warps != 4 or bp != 128):
            continue
        cfg = WgradConfig(block_m=128, block_k=bk, block_out_m=bp, block_out_n=min(bq, out_cols),
                          num_warps=warps, num_stages=stages, gluon=True, specialized=ws,
                          pingpong=pp)
        if out_rows % bp == 0 and cfg not in out:
            out.append(cfg)
    return out


def main() -> int:
    import triton.testing

    from distmoe.kernels.w2_backward import WgradConfig, w2_wgrad
    from distmoe.kernels.w13_backward import w13_wgrad
    from distmoe.tools import require_cuda
    from distmoe.tools.bench.report import write_csv
    from distmoe.tools.bench.workloads import SHAPES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["fine", "issue-a"], choices=sorted(SHAPES))
    ap.add_argument("--csv", default=None)
    ap.add_argument("--routing", nargs="+", default=["random", "balanced"],
                    choices=["random", "balanced"],
                    help="random: multinomial counts (partial last steps); balanced: T*K/E "
                         "rows per expert, as the layer benchmark routes")
    ap.add_argument("--quick", action="store_true",
                    help="time the heuristic only (with --routing: tails against none)")
    args = ap.parse_args()
    require_cuda("tune_wgrad.py")
    dev = torch.device("cuda", 0)
    rows_out = []
    for name, routing in itertools.product(args.shapes, args.routing):
        s = SHAPES[name]
        T, D, F, E, K = s.tokens, s.hidden, s.ffn, s.num_experts, s.top_k
        R = T * K
        if routing == "random":
            counts = torch.bincount(torch.randint(0, E, (R,)), minlength=E)
        else:
            counts = torch.full((E,), R // E, dtype=torch.int64)
            counts[: R % E] += 1
        ro = torch.zeros(E + 1, dtype=torch.int32)
        ro[1:] = counts.cumsum(0)
        padded = (counts + 127) // 128 * 128
        po = torch.zeros(E + 1, dtype=torch.int32)
        po[1:] = padded.cumsum(0)
        ro, po = ro.to(dev), po.to(dev)
        x = torch.randn(R, D, device=dev).bfloat16()
        gh1 = torch.randn(R, 2 * F, device=dev).bfloat16()
        gh3 = torch.randn(R, D, device=dev).bfloat16()
        h2 = torch.randn(R, F, device=dev).bfloat16()
        g13 = torch.empty(E, 2, F, D, device=dev, dtype=torch.bfloat16)
        g2 = torch.empty(E, D, F, device=dev, dtype=torch.bfloat16)
        # W13's x rows as the layer passes them: a 1-D base and a device-side offset (the
        # activation slot's cursor), so its descriptor is built on the device
        x_base = torch.cat([torch.zeros(64, device=dev, dtype=x.dtype), x.reshape(-1)])
        x_offset = torch.tensor([64], dtype=torch.int64, device=dev)

        def run13(c, gh1=gh1, x=x_base, xo=x_offset, po=po, ro=ro, g13=g13):
            w13_wgrad(gh1, x, po, ro, g13, x_offset=xo, accumulate=False, config=c)

        def run2(c, gh3=gh3, h2=h2, po=po, ro=ro, g2=g2):
            w2_wgrad(gh3, h2, po, ro, g2, accumulate=False, config=c)

        def run13_2d(c, gh1=gh1, x=x, po=po, ro=ro, g13=g13):
            w13_wgrad(gh1, x, po, ro, g13, accumulate=False, config=c)

        # x's rows read in place (EP = 1, a layer that kept x: MoEConfig.save_gathered_rows
        # False): token-major x [T, D] at a device-side offset and the gather table by padded
        # row, each token's K routes on K rows in random order, as behind a router
        x_tok = torch.randn(T, D, device=dev).bfloat16()
        tok_base = torch.cat([torch.zeros(64, device=dev, dtype=x.dtype), x_tok.reshape(-1)])
        token = torch.randperm(R, device=dev) // K
        act = torch.arange(R, device=dev)
        expert = torch.searchsorted(ro[1:].long(), act, right=True)
        table = torch.zeros(int(po[-1]), dtype=torch.int64, device=dev)
        origin = x_tok.data_ptr()  # the table names x_tok's rows; read at tok_base + 64
        table[po.long()[expert] + act - ro.long()[expert]] = origin + token * (D * 2)

        # [offset, 0]: through the table (a nonzero second entry reads the rows in order)
        xo_rows = torch.tensor([64, 0], dtype=torch.int64, device=dev)

        def run13_rows(c, gh1=gh1, x=tok_base, xo=xo_rows, po=po, ro=ro, g13=g13, t=table,
                       o=origin):
            w13_wgrad(gh1, x, po, ro, g13, x_offset=xo, accumulate=False, config=c, x_rows=t,
                      rows_origin=o)

        for kernel, (P, Q), fn in (("w13_wgrad", (2 * F, D), run13),
                                   ("w13_wgrad_2d", (2 * F, D), run13_2d),
                                   ("w13_wgrad_x_rows", (2 * F, D), run13_rows),
                                   ("w2_wgrad", (D, F), run2)):
            results = []
            first_out = None
            out_t = g2 if kernel == "w2_wgrad" else g13
            cands = _candidates(WgradConfig, P, Q, max(1, R // E), args.quick)
            if kernel == "w13_wgrad_2d":
                cands = cands[:1]
            elif kernel == "w13_wgrad_x_rows":  # the heuristic and the other Gluon forms
                cands = [c for i, c in enumerate(cands) if i == 0 or c.specialized]
            for i, cfg in enumerate(cands):
                try:
                    out_t.fill_(float("nan"))  # poisoned: every element must be written
                    fn(cfg)
                    if first_out is None:
                        first_out = out_t.clone()  # the heuristic's result
                    # same row steps, same order: equal up to the MMA's internal order
                    err = _rel_err(out_t, first_out)
                    ms = triton.testing.do_bench(lambda cfg=cfg, fn=fn: fn(cfg), warmup=5,
                                                 rep=30)
                except Exception as exc:  # a config that does not compile is a result
                    print(f"{name} {kernel} {cfg}: {type(exc).__name__}: {str(exc)[:80]}")
                    continue
                tflops = 2 * R * P * Q / ms / 1e9
                results.append((ms, tflops, i == 0, cfg, err))
                rows_out.append(dict(shape=name, routing=routing, kernel=kernel, ms=ms,
                                     tflops=tflops, heuristic=i == 0, rel_err=err,
                                     **vars(cfg)))
            results.sort(key=lambda r: r[0])
            print(f"\n{name} ({routing}) {kernel}: T={T} D={D} F={F} E={E} K={K} "
                  f"(P={P}, Q={Q})")
            shown = results[:6] + [r for r in results[6:] if r[2] or r[3].gluon]
            for ms, tflops, heur, cfg, err in shown:
                print(f"  {ms:8.3f} ms {tflops:7.1f} TFLOP/s {'HEURISTIC ' if heur else ''}"
                      f"out {cfg.block_out_m}x{cfg.block_out_n} k{cfg.block_k} "
                      f"s{cfg.num_stages} w{cfg.num_warps}{' GLUON' if cfg.gluon else ''}"
                      f"{' WS' if cfg.specialized else ''}{' PP' if cfg.pingpong else ''}"
                      f"{' LS' if cfg.lockstep else ''} "
                      f"err {err:.1e}")
        # this shape's buffers (at deepseek-v3 21 GiB of gradients) go before the next one's
        del x, gh1, gh3, h2, g13, g2, x_base, x_tok, tok_base, table, first_out, out_t
        del run13, run2, run13_2d, run13_rows, fn
        torch.cuda.empty_cache()
    if args.csv and rows_out:
        write_csv(args.csv, rows_out, list(rows_out[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
