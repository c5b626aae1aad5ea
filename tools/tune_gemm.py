#!/usr/bin/env python3
"""Time the forward grouped GEMMs over launch configurations, beside torch._grouped_mm.

Usage (repository root, one GPU):
    PYTHONPATH=src python3 tools/tune_gemm.py [--shapes issue-a fine] [--csv FILE]

For each named bench shape (EP=1, balanced random routing: T*K rows over E experts, padded
tile schedule, compact activation rows), times with ``triton.testing.do_bench``:

* ``gather_w13_swiglu`` (rows gathered by pointer from a [T, D] source, SwiGLU epilogue) for
  candidate ``W13Config``s, against ``torch._grouped_mm`` of the pre-gathered rows with W13
  alone (no gather, no SwiGLU): issue 7's first target is ratio >= 1;
* ``w13_train``: the same kernel storing h1 and the gathered rows too (a training forward),
  persistent grids with and without the TMA epilogue (``W13Config.tma_epilogue``); both W13
  lists also time the warp-specialised Gluon kernel (``W13Config.gluon``), ping-pong and
  cooperative tiles (marked ``coop``); ``w13_h1`` stores h1 but not the rows (what saving the
  rows costs);
* ``w2_scatter`` (scatter epilogue into a [T*K, D] buffer) for candidate ``W2Config``s, the
  Gluon kernel's (``W2Config.gluon``, ping-pong and cooperative) among them, against
  ``torch._grouped_mm`` of h2 with W2 alone;
* with ``--backward``, also the DGRAD kernels: ``w2_dgrad_swiglu_bwd`` (grad_h3 rows gathered
  by pointer, SwiGLU backward epilogue, h2 and grad_h3 stored for WGRAD) against
  ``torch._grouped_mm`` of grad_h3 with W2 (``w2_dgrad_scored``: the same with
  ``scored_rows``, what the layer runs), and ``w13_dgrad_scatter`` (route input gradients
  scattered by pointer) against ``torch._grouped_mm`` of grad_h1 with W13; every Triton
  DGRAD candidate on both grids (one program per tile, and persistent), and the Gluon
  kernels (``W2DgradConfig.gluon``; ``W13DgradConfig.gluon``: the Gluon W2 forward kernel
  with N-major weight tiles) on their own grid.

Prints one table per kernel, fastest first, TFLOP/s and the ratio to the grouped_mm time.
``triton.testing.do_bench`` times one candidate after the other, so the GPU's clock drift
(it runs at its power limit) moves those ratios by a few per cent; ``--final N`` (default 3)
then re-times the reference, the N fastest candidates and the heuristic's config
interleaved round by round from CUDA graphs (:func:`distmoe.tools.bench.timing.interleaved`)
and prints the median and range of each: quote those for a comparison. ``--csv`` writes
every row (``timing`` = ``interleaved`` for the second kind).
"""

from __future__ import annotations

import argparse
import itertools

import torch


def _layout(T, K, E, dev):
    R = T * K
    counts = torch.bincount(torch.randint(0, E, (R,)), minlength=E)
    ro = torch.zeros(E + 1, dtype=torch.int32)
    ro[1:] = counts.cumsum(0)
    po = torch.zeros(E + 1, dtype=torch.int32)
    po[1:] = ((counts + 127) // 128 * 128).cumsum(0)
    r_cap = int(po[-1]) + 128 * 4  # some idle tiles, as the receive bound leaves
    token = torch.randint(0, T, (R,))
    return counts, ro.to(dev), po.to(dev), r_cap, token


def _describe(cfg) -> str:
    """A config in a few words (tile, ring, grid, kernel)."""
    gluon = getattr(cfg, "gluon", False)
    return (f"n{cfg.block_n} k{cfg.block_k} s{cfg.num_stages} g{cfg.group_m} "
            f"{'persistent' if cfg.persistent else 'tiles'}"
            f"{' tma-epilogue' if getattr(cfg, 'tma_epilogue', False) else ''}"
            f"{' GLUON' if gluon else ''}{' coop' if gluon and cfg.num_warps == 8 else ''}")


def _both_grids(configs):
    """Each config followed by its twin on the other grid (order kept)."""
    return [c for cfg in configs for c in (cfg, cfg.with_grid(not cfg.persistent))]


def main() -> int:
    import triton.testing

    from distmoe.kernels.w2_backward import W2DgradConfig, w2_dgrad_swiglu_bwd
    from distmoe.kernels.w2_scatter import W2Config, w2_scatter
    from distmoe.kernels.w13_backward import W13DgradConfig, w13_dgrad_scatter
    from distmoe.kernels.w13_gather_swiglu import W13Config, gather_w13_swiglu
    from distmoe.tools import require_cuda
    from distmoe.tools.bench.report import write_csv
    from distmoe.tools.bench.timing import interleaved
    from distmoe.tools.bench.workloads import SHAPES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["issue-a", "fine"], choices=sorted(SHAPES))
    ap.add_argument("--csv", default=None)
    ap.add_argument("--backward", action="store_true", help="also the DGRAD kernels")
    ap.add_argument("--final", type=int, default=3, metavar="N",
                    help="re-time the reference, the N fastest and the heuristic config of "
                         "each kernel interleaved round by round (0: skip)")
    ap.add_argument("--rounds", type=int, default=9, help="rounds of the --final timing")
    ap.add_argument("--kernels", nargs="+", default=None,
                    choices=["w13", "w13_train", "w13_h1", "w2", "w2_dgrad", "w2_dgrad_scored",
                             "w13_dgrad"],
                    help="time only these kernels (default: all that the options select)")
    args = ap.parse_args()
    require_cuda("tune_gemm.py")
    dev = torch.device("cuda", 0)
    out_rows = []
    for name in args.shapes:
        s = SHAPES[name]
        T, D, F, E, K = s.tokens, s.hidden, s.ffn, s.num_experts, s.top_k
        R = T * K
        hint = max(1, R // E)  # the layer's shape key (balanced rows per local expert, EP=1)
        counts, ro, po, r_cap, token = _layout(T, K, E, dev)
        x = torch.randn(T, D, device=dev).bfloat16()
        w13 = (torch.randn(E, 2, F, D, device=dev) / D**0.5).bfloat16()
        w2 = (torch.randn(E, D, F, device=dev) / F**0.5).bfloat16()
        # padded-row pointer tables: live rows first in each segment
        gather = torch.zeros(r_cap, dtype=torch.int64)
        scatter = torch.zeros(r_cap, dtype=torch.int64)
        combine = torch.empty(R, D, device=dev, dtype=torch.bfloat16)
        pos = 0
        starts = po.tolist()
        for e in range(E):
            n = int(counts[e])
            rows = torch.arange(starts[e], starts[e] + n)
            gather[rows] = x.data_ptr() + token[pos:pos + n] * D * 2
            scatter[rows] = combine.data_ptr() + torch.arange(pos, pos + n) * D * 2
            pos += n
        gather, scatter = gather.to(dev), scatter.to(dev)
        h2 = torch.empty(R, F, device=dev, dtype=torch.bfloat16)
        # torch._grouped_mm references on pre-gathered rows
        x_g = x[token.to(dev)].contiguous()
        offs = ro[1:].contiguous()
        w13_t = w13.view(E, 2 * F, D).transpose(-2, -1)
        w2_t = w2.transpose(-2, -1)
        h2_g = torch.randn(R, F, device=dev).bfloat16()
        def grouped(a, b, offs=offs):
            return lambda: torch._grouped_mm(a, b, offs=offs)

        ref_fns = {"w13": grouped(x_g, w13_t), "w2": grouped(h2_g, w2_t)}
        ref = {k: triton.testing.do_bench(f, warmup=5, rep=40) for k, f in ref_fns.items()}
        flops = {"w13": 2 * R * 2 * F * D, "w2": 2 * R * D * F}
        # the warp-specialised Gluon kernel (W13Config.gluon; Hopper only, else the Triton
        # kernel): ping-pong 128 x 64 and 64 x 128 h2 tiles per consumer warpgroup (num_warps
        # 4), cooperative 128 x 128 tiles (num_warps 8)
        gluon = [W13Config(block_m=128, block_n=bn, block_k=64, num_warps=nw, num_stages=st,
                           group_m=gm, persistent=True, gluon=True)
                 for bn, st, gm, nw in ((64, 4, 8, 4), (64, 5, 8, 4), (64, 6, 8, 4),
                                        (128, 3, 8, 4), (128, 4, 8, 4), (128, 5, 8, 4),
                                        (128, 4, 16, 4), (128, 3, 8, 8), (128, 4, 8, 8),
                                        (128, 4, 16, 8))]
        cands = {
            "w13": [W13Config.from_heuristic(hidden=D, ffn=F, rows_per_expert=hint,
                                             device=dev, num_experts=E)] + [
                W13Config(block_m=128, block_n=bn, block_k=64, num_warps=8, num_stages=st,
                          group_m=gm, persistent=pe)
                for bn, st, gm, pe in itertools.product([128, 64], [3, 4], [8, 16],
                                                        [False, True])] + [
                W13Config(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=st,
                          group_m=gm, persistent=True, tma_epilogue=True)
                for st, gm in itertools.product([3, 4], [8, 16])] + gluon,
            # Training: h1 and the gathered rows are stored too (the epilogue the layer runs
            # in a training forward), persistent grids with and without the TMA epilogue.
            "w13_train": [W13Config.from_heuristic(hidden=D, ffn=F, rows_per_expert=hint,
                                                   training=True, device=dev,
                                                   num_experts=E)] + [
                W13Config(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=st,
                          group_m=gm, persistent=True, tma_epilogue=tma)
                for st, gm, tma in itertools.product([3, 4], [8, 16], [False, True])] + gluon,
            "w2": [W2Config.from_heuristic(hidden=D, ffn=F, rows_per_expert=hint,
                                           device=dev, num_experts=E)] + [
                W2Config(block_m=128, block_n=bn, block_k=64, num_warps=8, num_stages=st,
                         group_m=gm, persistent=pe)
                for bn, st, gm, pe in itertools.product([128, 256], [3, 4], [8], [False, True])] + [
                # the warp-specialised Gluon kernel (W2Config.gluon): ping-pong 128 x 128
                # tiles (num_warps 4), cooperative 128 x 256 (num_warps 8)
                W2Config(block_m=128, block_n=bn, block_k=64, num_warps=nw, num_stages=st,
                         group_m=gm, persistent=True, gluon=True)
                for bn, nw, st, gm in ((128, 4, 4, 8), (128, 4, 5, 8), (128, 4, 6, 8),
                                       (128, 4, 5, 16), (256, 8, 3, 8), (256, 8, 4, 8),
                                       (256, 8, 4, 16))],
        }

        def run13(c, gather=gather, po=po, ro=ro, w13=w13, h2=h2):
            gather_w13_swiglu(gather, po, ro, w13, h2, config=c)

        def run2(c, h2=h2, po=po, ro=ro, w2=w2, scatter=scatter):
            w2_scatter(h2, po, ro, w2, scatter, config=c)

        h1_train = torch.empty(R, 2 * F, device=dev, dtype=torch.bfloat16)
        x_train = torch.empty(R, D, device=dev, dtype=torch.bfloat16)

        def run13t(c, gather=gather, po=po, ro=ro, w13=w13, h2=h2, h1=h1_train, xo=x_train):
            gather_w13_swiglu(gather, po, ro, w13, h2, h1_out=h1, x_out=xo, config=c)

        def run13h(c, gather=gather, po=po, ro=ro, w13=w13, h2=h2, h1=h1_train):
            gather_w13_swiglu(gather, po, ro, w13, h2, h1_out=h1, config=c)

        for k in ("w13_train", "w13_h1"):
            ref[k], ref_fns[k], flops[k] = ref["w13"], ref_fns["w13"], flops["w13"]
        cands["w13_h1"] = cands["w13_train"]
        kernels = [("w13", run13), ("w13_train", run13t), ("w13_h1", run13h), ("w2", run2)]
        if args.backward:
            h1 = torch.randn(R, 2 * F, device=dev).bfloat16()
            grad_h1 = torch.empty(R, 2 * F, device=dev, dtype=torch.bfloat16)
            gh3_rows = torch.empty(R, D, device=dev, dtype=torch.bfloat16)
            dispatch = torch.empty(R, D, device=dev, dtype=torch.bfloat16)
            bwd_scatter = scatter - combine.data_ptr() + dispatch.data_ptr()
            bwd_scatter = torch.where(scatter == 0, 0, bwd_scatter)
            combine.normal_()
            ref_fns["w2_dgrad"] = grouped(gh3_rows.normal_(), w2)
            ref_fns["w13_dgrad"] = grouped(torch.randn(R, 2 * F, device=dev).bfloat16(),
                                           w13.view(E, 2 * F, D))
            for k in ("w2_dgrad", "w13_dgrad"):
                ref[k] = triton.testing.do_bench(ref_fns[k], warmup=5, rep=40)
            flops["w2_dgrad"] = flops["w2"]
            flops["w13_dgrad"] = flops["w13"]
            # Each candidate on both grids: one program per tile and persistent (heuristic
            # first: the results mark index 0 as the heuristic).
            cands["w2_dgrad"] = _both_grids([W2DgradConfig.from_heuristic(
                hidden=D, ffn=F, rows_per_expert=hint, device=dev, num_experts=E)] + [
                W2DgradConfig(block_m=128, block_n=bn, block_k=64, num_warps=8, num_stages=st)
                for bn, st in itertools.product([128, 256], [3, 4])]) + [
                # the warp-specialised Gluon kernel (its own grid; ring depth = num_stages)
                W2DgradConfig(block_m=128, block_n=128, block_k=64, num_stages=st, gluon=True)
                for st in (4, 5, 6)] + [
                # its split form (the heuristic's pick since run 43 at 4 or 5 stages)
                W2DgradConfig(block_m=128, block_n=128, block_k=64, num_stages=st, gluon=True,
                              epilogue_warps=8) for st in (3, 4, 5)]
            # the heuristic's pick first, then the Triton pick (the heuristic's where the
            # Gluon kernel is not picked) on both grids, other Triton tiles, and the Gluon W2
            # forward kernel run as the W13 DGRAD (its own grid): ping-pong 128 x 128
            # (num_warps 4), cooperative 128 x 256 (8)
            pick13d = W13DgradConfig.from_heuristic(hidden=D, ffn=F, rows_per_expert=hint,
                                                    device=dev, num_experts=E)
            gluon13d = [W13DgradConfig(block_m=128, block_n=bn, block_k=64, num_warps=nw,
                                       num_stages=st, persistent=True, gluon=True)
                        for bn, nw, st in ((128, 4, 4), (128, 4, 5), (128, 4, 6), (256, 8, 3),
                                           (256, 8, 4))]
            cands["w13_dgrad"] = [pick13d] * pick13d.gluon + _both_grids(
                [W13DgradConfig.from_heuristic(hidden=D, ffn=F, rows_per_expert=hint)] + [
                    W13DgradConfig(block_m=128, block_n=bn, block_k=64, num_warps=8,
                                   num_stages=st)
                    for bn, st in itertools.product([128, 256], [3, 4])]) + [
                c for c in gluon13d if c != pick13d]

            def run2d(c, po=po, ro=ro, w2=w2, h1=h1, grad_h1=grad_h1, h2=h2,
                      gh3_rows=gh3_rows, scatter=scatter):
                # the layer's path: the rows are already in place (pushed by their owners)
                w2_dgrad_swiglu_bwd(scatter, po, ro, w2, h1, grad_h1, h2_out=h2,
                                    grad_h3_rows=gh3_rows, config=c)

            def run2ds(c, po=po, ro=ro, w2=w2, h1=h1, grad_h1=grad_h1, h2=h2,
                       gh3_rows=gh3_rows, scatter=scatter):
                # the layer's training path: unscaled rows, each route's score at the start
                # of its combine row, the score parts written after it
                w2_dgrad_swiglu_bwd(scatter, po, ro, w2, h1, grad_h1, h2_out=h2,
                                    grad_h3_rows=gh3_rows, scored_rows=True, config=c)

            def run13d(c, po=po, ro=ro, w13=w13, grad_h1=grad_h1, bwd=bwd_scatter):
                w13_dgrad_scatter(grad_h1, po, ro, w13, bwd, config=c)

            combine.view(torch.float32)[:, 0] = torch.rand(combine.shape[0], device=dev)
            ref["w2_dgrad_scored"], flops["w2_dgrad_scored"] = ref["w2_dgrad"], flops["w2"]
            ref_fns["w2_dgrad_scored"] = ref_fns["w2_dgrad"]
            cands["w2_dgrad_scored"] = cands["w2_dgrad"]
            kernels += [("w2_dgrad", run2d), ("w2_dgrad_scored", run2ds),
                        ("w13_dgrad", run13d)]
        for kernel, fn in kernels:
            if args.kernels and kernel not in args.kernels:
                continue
            results = []
            seen = []
            for i, cfg in enumerate(cands[kernel]):
                if cfg in seen or not cfg.fits_hopper():
                    continue
                seen.append(cfg)
                try:
                    ms = triton.testing.do_bench(lambda cfg=cfg, fn=fn: fn(cfg), warmup=5,
                                                 rep=40)
                except Exception as exc:  # a config that does not build is a result
                    print(f"{name} {kernel} {cfg}: {type(exc).__name__}: {str(exc)[:100]}")
                    continue
                results.append((ms, i == 0, cfg))
                out_rows.append(dict(shape=name, kernel=kernel, ms=ms,
                                     tflops=flops[kernel] / ms / 1e9,
                                     vs_grouped_mm=ref[kernel] / ms, heuristic=i == 0,
                                     **vars(cfg)))
            results.sort(key=lambda r: r[0])
            print(f"\n{name} {kernel}: T={T} D={D} F={F} E={E} K={K}; torch._grouped_mm on "
                  f"pre-gathered rows {ref[kernel]:.3f} ms "
                  f"({flops[kernel] / ref[kernel] / 1e9:.0f} TFLOP/s)")
            for ms, heur, cfg in results[:5] + [r for r in results if r[1]]:
                print(f"  {ms:8.3f} ms {flops[kernel] / ms / 1e9:6.0f} TFLOP/s "
                      f"{ref[kernel] / ms:5.2f}x grouped_mm {'HEURISTIC ' if heur else ''}"
                      f"{_describe(cfg)}")
            if args.final:
                # the reference, the fastest few and the heuristic again, interleaved
                final = results[:args.final] + [r for r in results[args.final:] if r[1]]
                fns = {"torch._grouped_mm": ref_fns[kernel]}
                fns.update({f"{'HEURISTIC ' if heur else ''}{_describe(cfg)}":
                            (lambda cfg=cfg, fn=fn: fn(cfg)) for _, heur, cfg in final})
                stats = interleaved(fns, rounds=args.rounds, iters=10, device=dev)
                base = stats["torch._grouped_mm"].iter_ms
                print(f"  interleaved, {args.rounds} rounds of 10 calls from a CUDA graph "
                      "(median, fastest-slowest round):")
                for label, st in sorted(stats.items(), key=lambda kv: kv[1].iter_ms):
                    print(f"    {st.iter_ms:8.3f} ms ({st.min_ms:.3f}-{st.max_ms:.3f}) "
                          f"{flops[kernel] / st.iter_ms / 1e9:6.0f} TFLOP/s "
                          f"{base / st.iter_ms:5.3f}x grouped_mm  {label}")
                    out_rows.append(dict(shape=name, kernel=kernel, ms=st.iter_ms,
                                         tflops=flops[kernel] / st.iter_ms / 1e9,
                                         vs_grouped_mm=base / st.iter_ms,
                                         heuristic=label.startswith("HEURISTIC"),
                                         timing="interleaved", label=label))
    if args.csv and out_rows:
        write_csv(args.csv, out_rows, list(dict.fromkeys(k for r in out_rows for k in r)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
