"""``python -m distmoe demo``: run the distributed layer on the machine at hand and check it.

Default: CPU ranks (Triton interpreter, small shapes) when there is no GPU; every visible GPU
as one rank each when there are GPUs. By default it runs training steps (forward and
backward, upstream gradient = a fixed random tensor) and prints, for y and every gradient
(x, scores, w13, w2), the max error against torch autograd of the plain-PyTorch reference in
fp64, beside the bf16 reference's own error (for scale), then the time per step and the
activation slot's save/replay decision. ``--inference`` runs the forward only.

Bad options exit with status 2 and one line ``distmoe demo: error: ...`` naming the option,
before any rank starts: sizes and ``--iters`` below 1, the layer's configuration rules
(``MoEConfig``: ``--top-k`` at most ``--experts``, ``--experts`` divisible by ``--ep``, widths
a multiple of 8, ...) and ``--device cuda`` without CUDA.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from . import with_options


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
    p.add_argument("--inference", action="store_true",
                   help="forward only (default: training steps, forward + backward)")


def _defaults(args) -> None:
    cpu = args.device == "cpu"
    fill = dict(ep=2 if cpu else max(1, torch.cuda.device_count()),
                tokens=24 if cpu else 4096, hidden=64 if cpu else 2048,
                ffn=32 if cpu else 768, experts=8 if cpu else 64, top_k=2 if cpu else 8,
                iters=3 if cpu else 20)
    for k, v in fill.items():
        if getattr(args, k) is None:
            setattr(args, k, v)


def _config(args):
    """The layer's configuration on every rank (raises the library's ValueError/TypeError)."""
    import distmoe as dm

    return dm.MoEConfig(hidden=args.hidden, ffn=args.ffn, num_experts=args.experts,
                        top_k=args.top_k, max_tokens=args.tokens, training=not args.inference,
                        row_block=16 if args.device == "cpu" else 128,
                        device_scratch_factor=2.0)


def _check(args) -> str | None:
    """The first problem with the (defaulted) options, as a message naming the option, or
    None. Runs before any rank starts."""
    if args.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda: no CUDA device is available (torch.cuda.is_available() is False)"
    for option, name in (("--ep", "ep"), ("--tokens", "tokens"), ("--hidden", "hidden"),
                         ("--ffn", "ffn"), ("--experts", "experts"), ("--top-k", "top_k"),
                         ("--iters", "iters")):
        value = getattr(args, name)
        if value < 1:
            return f"{option} ({value}) must be >= 1"
    try:
        _config(args).check_ep_size(args.ep)
    except (ValueError, TypeError) as exc:
        return with_options(str(exc))
    return None


def _problem(args):
    from ..reference import random_routing

    g = torch.Generator().manual_seed(args.seed)
    N, D, F, E, K = args.ep * args.tokens, args.hidden, args.ffn, args.experts, args.top_k
    x = torch.randn(N, D, generator=g).bfloat16()
    w13 = (torch.randn(E, 2, F, D, generator=g) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, F, generator=g) / F**0.5).bfloat16()
    ids, scores = random_routing(N, E, K, generator=g, inactive_fraction=0.05)
    return x, ids, scores, w13, w2


def _upstream(args) -> torch.Tensor:
    g = torch.Generator().manual_seed(args.seed + 1)
    return torch.randn(args.ep * args.tokens, args.hidden, generator=g).bfloat16()


def _rank(rank, world, args):
    import distmoe as dm

    from ..reference import split_global_problem

    dev = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" \
        else torch.device("cpu")
    mine = split_global_problem(*_problem(args), world)[rank]
    training = not args.inference
    cfg = _config(args)
    tensors = [t.to(dev) for t in (mine.x, mine.expert_ids, mine.scores, mine.w13, mine.w2)]
    gy = _upstream(args)[rank * args.tokens:(rank + 1) * args.tokens].to(dev)
    bar = None
    if rank == 0:
        try:
            from tqdm import tqdm

            bar = tqdm(total=args.iters + 1, desc=f"demo ({world} {args.device} ranks)",
                       unit="step" if training else "call")
        except ImportError:
            pass

    def step(ctx):
        if not training:
            return ctx(*tensors), None, None
        x, ids, scores, w13, w2 = tensors
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, scores, w13, w2)]
        y = ctx(leaves[0], ids, leaves[1], leaves[2], leaves[3])
        replay = bool(y.grad_fn.record.replay)
        y.backward(gy)
        return y.detach(), [t.grad for t in leaves], replay

    with dm.MoEContext(cfg, device=dev) as ctx:
        y, grads, replay = step(ctx)  # first step: compiles kernels
        if bar:
            bar.update(1)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.iters):
            step(ctx)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if bar:
                bar.update(1)
        per_call = (time.perf_counter() - start) / args.iters
        stats = ctx.stats()
    if bar:
        bar.close()
    grads = None if grads is None else [g.cpu() for g in grads]
    return y.cpu(), grads, replay, per_call, stats


def _reference(args, dtype):
    """(y, [grad_x, grad_scores, grad_w13, grad_w2]) of the plain-PyTorch reference."""
    from ..reference import moe_reference

    x, ids, scores, w13, w2 = _problem(args)
    leaves = [t.to(dtype).requires_grad_(True) for t in (x, scores, w13, w2)]
    y = moe_reference(leaves[0], ids, leaves[1], leaves[2], leaves[3])
    if args.inference:
        return y.detach(), None
    y.backward(_upstream(args).to(dtype))
    return y.detach(), [t.grad for t in leaves]


def run(args) -> int:
    import distmoe as dm

    from ..reference import merge_expert_tensors

    _defaults(args)
    problem = _check(args)
    if problem is not None:
        print(f"distmoe demo: error: {problem}", file=sys.stderr)
        return 2
    mode = "forward only" if args.inference else "training step (forward + backward)"
    print(f"distmoe demo, {mode}: EP={args.ep} on {args.device}, T={args.tokens} tokens/rank, "
          f"D={args.hidden}, F={args.ffn}, E={args.experts}, K={args.top_k}", flush=True)
    outs = dm.launch(_rank, args.ep, device=args.device, args=(args,), timeout=1800)
    y64, g64 = _reference(args, torch.float64)
    y16, g16 = _reference(args, torch.bfloat16)
    ours = {"y": torch.cat([o[0] for o in outs])}
    refs = {"y": (y64, y16)}
    if not args.inference:
        names = ["grad_x", "grad_scores", "grad_w13", "grad_w2"]
        for i, name in enumerate(names):
            parts = [o[1][i] for o in outs]
            ours[name] = merge_expert_tensors(parts) if i >= 2 else torch.cat(parts)
            refs[name] = (g64[i], g16[i])
    ok = True
    print(f"{'tensor':<12} {'max |error| vs fp64':>20} {'bf16 reference':>16}")
    for name, value in ours.items():
        r64, r16 = refs[name]
        err = (value.double() - r64).abs().max().item()
        ref_err = (r16.double() - r64).abs().max().item()
        # two bf16 ulps of the largest magnitude covers ties rounding the other way
        floor = r64.abs().max().item() / 128 + 1e-6
        good = err <= 2 * ref_err + floor
        ok &= good
        print(f"{name:<12} {err:>20.3e} {ref_err:>16.3e}{'' if good else '  <-- too large'}")
    per_call = max(o[3] for o in outs)
    recv = [o[4]["last_recv_rows"] for o in outs]
    print(f"received rows per rank: {recv} (bound {outs[0][4]['receive_bound']})")
    if not args.inference:
        acts = outs[0][4]["activations"]
        print(f"activation buffer: {acts['activation_buffer_bytes']} B per rank; the layer "
              f"{'replayed in backward' if outs[0][2] else 'kept its full state'} "
              f"(slot capacity {acts['slot_capacity_bytes']} B)")
    unit = "call" if args.inference else "step"
    print(f"time per {unit}: {per_call * 1e3:.2f} ms (max over ranks, {args.iters} {unit}s"
          f"{', Triton interpreter' if args.device == 'cpu' else ''})")
    print("PASS" if ok else "FAIL: error above 2x the bf16 reference's")
    return 0 if ok else 1
