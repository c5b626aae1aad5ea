"""``python -m distmoe demo``: run the distributed layer on the machine at hand and check it.

Default: CPU ranks (Triton interpreter, small shapes) when there is no GPU; every visible GPU
as one rank each when there are GPUs. Prints the max error against the plain-PyTorch
reference (and the bf16 reference's own error against fp64, for scale) and the time per call.
"""

from __future__ import annotations

import argparse
import time

import torch


def add_arguments(p: argparse.ArgumentParser) -> None:
    gpu = torch.cuda.is_available()
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if gpu else "cpu")
    p.add_argument("--ep", type=int, default=None,
                   help="ranks (default: 2 on CPU, the number of GPUs on CUDA)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--ffn", type=int, default=None)
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--iters", type=int, default=None, help="timed calls")
    p.add_argument("--seed", type=int, default=0)


def _defaults(args) -> None:
    cpu = args.device == "cpu"
    fill = dict(ep=2 if cpu else max(1, torch.cuda.device_count()),
                tokens=24 if cpu else 4096, hidden=64 if cpu else 2048,
                ffn=32 if cpu else 768, experts=8 if cpu else 64, top_k=2 if cpu else 8,
                iters=3 if cpu else 20)
    for k, v in fill.items():
        if getattr(args, k) is None:
            setattr(args, k, v)


def _problem(args):
    from ..reference import random_routing

    g = torch.Generator().manual_seed(args.seed)
    N, D, F, E, K = args.ep * args.tokens, args.hidden, args.ffn, args.experts, args.top_k
    x = torch.randn(N, D, generator=g).bfloat16()
    w13 = (torch.randn(E, 2, F, D, generator=g) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, F, generator=g) / F**0.5).bfloat16()
    ids, scores = random_routing(N, E, K, generator=g, inactive_fraction=0.05)
    return x, ids, scores, w13, w2


def _rank(rank, world, args):
    import distmoe as dm

    from ..reference import split_global_problem

    dev = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" \
        else torch.device("cpu")
    mine = split_global_problem(*_problem(args), world)[rank]
    cfg = dm.MoEConfig(hidden=args.hidden, ffn=args.ffn, num_experts=args.experts,
                       top_k=args.top_k, max_tokens=args.tokens, training=False,
                       row_block=16 if args.device == "cpu" else 128,
                       device_scratch_factor=2.0)
    tensors = [t.to(dev) for t in (mine.x, mine.expert_ids, mine.scores, mine.w13, mine.w2)]
    bar = None
    if rank == 0:
        try:
            from tqdm import tqdm

            bar = tqdm(total=args.iters + 1, desc=f"demo ({world} {args.device} ranks)",
                       unit="call")
        except ImportError:
            pass
    with dm.MoEContext(cfg, device=dev) as ctx:
        y = ctx(*tensors)  # first call: compiles kernels
        if bar:
            bar.update(1)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.iters):
            ctx(*tensors)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if bar:
                bar.update(1)
        per_call = (time.perf_counter() - start) / max(1, args.iters)
        stats = ctx.stats()
    if bar:
        bar.close()
    return y.cpu(), per_call, stats


def run(args) -> int:
    import distmoe as dm

    from ..reference import moe_reference

    _defaults(args)
    cfg_check = dm.MoEConfig(hidden=args.hidden, ffn=args.ffn, num_experts=args.experts,
                             top_k=args.top_k, max_tokens=args.tokens, training=False)
    cfg_check.check_ep_size(args.ep)
    print(f"distmoe demo: EP={args.ep} on {args.device}, T={args.tokens} tokens/rank, "
          f"D={args.hidden}, F={args.ffn}, E={args.experts}, K={args.top_k}", flush=True)
    outs = dm.launch(_rank, args.ep, device=args.device, args=(args,), timeout=1800)
    x, ids, scores, w13, w2 = _problem(args)
    y = torch.cat([o[0] for o in outs])
    y64 = moe_reference(x.double(), ids, scores.double(), w13.double(), w2.double())
    y16 = moe_reference(x, ids, scores, w13, w2)
    err = (y.double() - y64).abs().max().item()
    ref_err = (y16.double() - y64).abs().max().item()
    per_call = max(o[1] for o in outs)
    recv = [o[2]["last_recv_rows"] for o in outs]
    print(f"forward max |error| vs fp64 reference: {err:.3e} "
          f"(bf16 PyTorch reference: {ref_err:.3e})")
    print(f"received rows per rank: {recv} (bound {outs[0][2]['receive_bound']})")
    print(f"time per call: {per_call * 1e3:.2f} ms (max over ranks, {args.iters} calls"
          f"{', Triton interpreter' if args.device == 'cpu' else ''})")
    ok = err <= 2 * ref_err + 1e-2
    print("PASS" if ok else "FAIL: error above 2x the bf16 reference's")
    return 0 if ok else 1
