"""``python -m distmoe ab --budget``: a stack of MoE layers in one activation slot under a
memory budget, timed interleaved.

Usage (one GPU)::

    python -m distmoe ab --budget --shape qwen3-30b-a3b --layers 8 \\
        --factors 0.6,0.75,0.9 --modes rows,x,auto [--rounds 7 --iters 3 --routing exact]

What it answers: with one slot holding the state of ``--layers`` layers (the layers of one
pipeline stage and micro-batch) and a budget too small for all of them, which
``MoEConfig.save_gathered_rows`` mode trains fastest: ``rows`` (True: a layer keeps its
gathered rows or replays), ``x`` (False: a saved layer keeps its input and regathers its
rows in backward) or ``auto`` (each layer chooses on the device,
:mod:`distmoe.kernels.movement.slot_cursor`); ``autoip`` is ``auto`` with
``gathered_rows_in_place`` True (every layer's W13 WGRAD reads the rows in place). Each
candidate is a :class:`~distmoe.MoEContext` with ``max_layers_per_slot = --layers`` and, for
a factor of ``--factors``, the slot of ``activation_factor = factor`` in the ``rows`` mode for
every mode alike: the layers' inputs plus that share of what saving every layer's rows needs
at balanced routing. Beside them ``saved``: a slot with room for every layer's rows whatever
the routing (and ``saved-auto`` / ``saved-autoip``, the same slot in those modes). All
candidates run the same layers (weights and routing drawn once, one set per layer) and the
same step: forward through the stack, then the gradients of x, every layer's scores and
weights (``torch.autograd.grad``), captured ``--iters`` times into a CUDA graph per candidate
and replayed round by round (:func:`distmoe.tools.bench.timing.interleaved`).

Printed per candidate: the slot's bytes, what each layer kept in the last step (``R`` its
rows, ``X`` its input x, the rows regathered in backward; ``I`` its input only, replayed),
the median step time over rounds and the median per-round ratio to ``saved``.
"""

from __future__ import annotations

import csv
import statistics
import sys

import torch

from . import INTERPRETER_NOTE

#: --modes names -> (MoEConfig.save_gathered_rows, gathered_rows_in_place)
MODES = {"rows": (True, None), "x": (False, None), "auto": ("auto", None),
         "autoip": ("auto", True)}


def parse_factors(text: str) -> list[float]:
    """``"0.6,0.75"`` -> [0.6, 0.75]; each in [0, 1] (ValueError otherwise)."""
    out = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"--factors {text!r}: {part!r} is not a number") from None
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"--factors {text!r}: {value} is not in [0, 1]")
        out.append(value)
    return out


def parse_modes(text: str) -> list[str]:
    """``"rows,auto"`` -> ["rows", "auto"] (ValueError for a name not in :data:`MODES`)."""
    modes = text.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"--modes {text!r}: expected a comma-separated subset of "
                         f"{sorted(MODES)}, got {bad}")
    return modes


def kept_letters(flags: list[list[int]]) -> str:
    """Per layer ``[replayed, x kept, either]`` (a record's flags) -> ``"RRXI..."``."""
    return "".join("I" if f[0] else "X" if f[1] else "R" for f in flags)


def build(shape_name: str, layers: int, routing: str, device: torch.device, seed: int = 0):
    """The layers' inputs, drawn once: ``(dims, x, [(ids, scores, w13, w2)] * layers, gy)``,
    ``dims`` = (T, D, F, E, K)."""
    from distmoe.reference import random_routing

    from .bench.workloads import get_shape, make_routing

    shape = get_shape(shape_name)
    T, D, F, E, K = shape.tokens, shape.hidden, shape.ffn, shape.num_experts, shape.top_k
    gd = torch.Generator(device=device).manual_seed(seed)

    def draw(*dims, scale=1.0):
        return (torch.randn(*dims, generator=gd, device=device) * scale).bfloat16()

    stack = []
    for layer in range(layers):
        g = torch.Generator().manual_seed(seed * 1000 + layer)
        ids, scores = random_routing(T, E, K, generator=g)
        if routing == "exact":
            ids = make_routing(tokens=T, top_k=K, num_experts=E,
                               seed=seed * 1000 + layer).expert_ids_TK
        stack.append((ids.to(device), scores.float().to(device).requires_grad_(True),
                      draw(E, 2, F, D, scale=D**-0.5).requires_grad_(True),
                      draw(E, D, F, scale=F**-0.5).requires_grad_(True)))
    return (T, D, F, E, K), draw(T, D), stack, draw(T, D)


def run(args) -> int:
    """``ab --budget`` with its parsed arguments (``shape``, ``layers``, ``factors``,
    ``modes``, ``rounds``, ``iters``, ``warmup``, ``routing``, ``csv``, ``out``); returns the
    exit status."""
    try:
        factors, modes = parse_factors(args.factors), parse_modes(args.modes)
        if args.layers < 1:
            raise ValueError(f"--layers ({args.layers}) must be >= 1")
    except ValueError as exc:
        print(f"distmoe ab: error: {exc}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    from .bench.layer_step import join_group

    joined = join_group()
    try:
        if joined.world != 1:
            print("distmoe ab: error: --budget runs one rank (EP = 1); start it without "
                  "torch.distributed.run", file=sys.stderr)
            return 2
        return _run(args, factors, modes, joined)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(args, factors, modes, joined) -> int:
    import json

    import distmoe as dm

    from .bench.timing import interleaved

    dev = joined.device
    (T, D, F, E, K), x, stack, gy = build(args.shape, args.layers, args.routing, dev)
    base = dict(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T,
                max_layers_per_slot=args.layers)
    roomy = dm.plan_memory(dm.MoEConfig(**base), 1).useful_max_slot_bytes
    cfgs = {"saved": dm.MoEConfig(**base, activation_bytes=roomy)}
    for mode in ("auto", "autoip"):  # where every layer's rows fit, what the mode costs
        if mode in modes:
            rows, in_place = MODES[mode]
            cfgs[f"saved-{mode}"] = dm.MoEConfig(**base, activation_bytes=roomy,
                                                 save_gathered_rows=rows,
                                                 gathered_rows_in_place=in_place)
    for factor in factors:  # the same bytes for every mode: the rows' plan at the factor
        cap = dm.plan_memory(dm.MoEConfig(**base, activation_factor=factor),
                             1).slot_capacity_bytes
        for mode in modes:
            rows, in_place = MODES[mode]
            cfgs[f"{mode}@{factor:g}"] = dm.MoEConfig(**base, activation_bytes=cap,
                                                      save_gathered_rows=rows,
                                                      gathered_rows_in_place=in_place)
    ctxs = {name: dm.MoEContext(cfg, joined.group, device=dev) for name, cfg in cfgs.items()}
    leaves_of = [t for layer in stack for t in layer[1:]]
    kept: dict[str, list] = {}

    def runner(name):
        ctx = ctxs[name]

        def step():
            xs = x.detach().requires_grad_(True)
            h, flags = xs, []
            for ids, scores, w13, w2 in stack:
                h = ctx(h, ids, scores, w13, w2)
                flags.append(h.grad_fn.record.flags)
            torch.autograd.grad(h, [xs, *leaves_of], gy)
            kept[name] = flags
        return step

    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (interpreter)"
    print(f"{args.shape}: T={T} D={D} F={F} E={E} K={K}, {args.layers} layers in one slot, "
          f"EP=1, {args.routing} routing, {where}", flush=True)
    try:
        times = interleaved({name: runner(name) for name in ctxs}, rounds=args.rounds,
                            iters=args.iters, warmup=args.warmup, device=dev,
                            share_pool=True)  # each graph's gradients: GBs, never read
        # what every layer kept, from an eager step: on a GPU the timed steps were graph
        # replays, so one more step each; elsewhere they were eager and their flags stand
        for name in ctxs:
            if dev.type == "cuda" or name not in kept:
                runner(name)()
        letters = {name: kept_letters([f.tolist() for f in flags])
                   for name, flags in kept.items()}
        rows = []
        for name, ctx in ctxs.items():
            ratio = statistics.median(
                m / s for m, s in zip(times[name].window_ms, times["saved"].window_ms,
                                      strict=True))
            rows.append(dict(candidate=name, slot_bytes=ctx.stats()["activations"][
                "slot_capacity_bytes"], kept=letters[name], ms=times[name].iter_ms,
                ratio_to_saved=ratio))
    finally:
        for ctx in ctxs.values():
            ctx.close()
    print(f"\n{'candidate':<12}{'slot MB':>10}  {'kept (R rows, X x, I input)':<30}"
          f"{'ms/step':>10}{'/ saved':>10}")
    for r in rows:
        print(f"{r['candidate']:<12}{r['slot_bytes'] / 1e6:>10.1f}  {r['kept']:<30}"
              f"{r['ms']:>10.3f}{r['ratio_to_saved']:>9.3f}x")
    if dev.type != "cuda":
        print(f"note: {INTERPRETER_NOTE}")
    if args.csv:
        with open(args.csv, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(shape=args.shape, layers=args.layers, routing=args.routing,
                           rounds=args.rounds, iters=args.iters, rows=rows), fh, indent=2)
            fh.write("\n")
    return 0
