"""``python -m distmoe ab``: layer-level A/B of kernel-plan variants, interleaved round by round.

Usage (one GPU, or one rank per GPU under torch.distributed.run)::

    python -m distmoe ab --shape dense-e32 --mode fwd \\
        --variant g16=w13:group_m=16 --variant w2tri=w2:gluon=False [--rounds 15]
    python -m torch.distributed.run --standalone --nproc-per-node=2 -m distmoe ab \\
        --shape qwen3-30b-a3b --mode fwd --variant nopull=layer:pull_all=False --ep1-share

Every variant is a context of its own, ``MoEContext(cfg, group, overrides=...)``, built on
the same inputs (drawn once), beside the base context (the plan's rules, no override). Each
context's plan (``ctx.explain(T)``) is printed first. Then ``--iters`` steps of each are
captured into a CUDA graph and every round replays each graph once, in rotating order
(:func:`distmoe.tools.bench.timing.interleaved`): a GPU at its power limit drifts by a few
per cent between runs, which one-after-the-other timing mistakes for a difference. Reported
per variant: the median over rounds of the per-step time (maximum over ranks per round), the
fastest and slowest round, and the median over rounds of the ratio to the base in the same
round (> 1: the variant is faster). ``--out FILE`` writes the same as JSON.

``--variant NAME=SPEC[+SPEC...]``; a SPEC is one of

* ``KERNEL:FIELD=VALUE[,FIELD=VALUE...]``: fields of one kernel's launch config, KERNEL one of
  ``w13``, ``w2``, ``combine``, ``w2_dgrad``, ``w13_dgrad``, ``w2_wgrad``, ``w13_wgrad`` (the
  backward ones with ``--mode fwdbwd``), or ``wgrad`` for both WGRADs;
* ``layer:NAME=VALUE``: a layer switch (``pull_all``, ``w13_phases``, ``w13_phase_waves``,
  ``mega``, ``mega_lag``, ``mega_pingpong``, ``mega_dynamic``, ``fp8_operands``; see
  :data:`distmoe.plan.LAYER_SWITCHES`);
* ``input:buffer=True|False``: x passed as the context's ``input_buffer`` (inference: no copy
  of x in the forward).

VALUE: an int, ``True`` / ``False``, ``None``, or a tuple of ints written ``1x2x3``. A spec
naming an unknown kernel, field or switch is refused before anything runs; so is one the plan
cannot apply (a backward kernel in ``--mode fwd``, ``gluon=True`` where no Gluon kernel runs,
Mega in training). A variant that sets a Gluon-only field (``lockstep``, ``expert_groups``)
on a config that runs the Triton kernel gets a note: it times the base's kernels again.

Rows beside the variants:

* ``--ep1-share`` (EP > 1): on every rank a layer over a one-rank group with E / EP experts,
  the same per-rank work at EP=1, in the same rounds; its line gives EP / EP=1;
* ``--replay`` (``--mode fwdbwd``): a layer whose slot holds its input only
  (``activation_factor`` 0), so its backward recomputes the forward: what fitting a memory
  budget by replay costs;
* ``--regather`` (``--mode fwdbwd``): a layer whose saved state keeps its input instead of
  its gathered rows (``save_gathered_rows`` False); ``--regather-in-place auto|on|off|both``
  sets its ``gathered_rows_in_place`` (both: a copying layer "regather" and an in-place one
  "inplace").

``--budget``: a stack of ``--layers`` layers in one activation slot under budgets too small
for all of them, one candidate per ``save_gathered_rows`` mode and budget, timed the same
way (:mod:`distmoe.tools.budget`).

Two source trees (a commit against the working tree) are compared by
``benchmarks/same_bits_ab.py``, which also checks that they give the same bits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

from . import INTERPRETER_NOTE

#: a kernel key that stands for both WGRADs
BOTH_WGRADS = "wgrad"
#: row names the tool gives its own layers
RESERVED = ("base", "ep1share", "replay", "regather", "inplace")
#: config fields that only the Gluon kernels read (the Triton kernels ignore them)
GLUON_ONLY = ("lockstep", "expert_groups")


def parse_value(text: str):
    """``True`` / ``False`` / ``None``, an int, or a tuple of ints written ``1x2x3``
    (ValueError otherwise)."""
    if text in ("True", "False"):
        return text == "True"
    if text == "None":
        return None
    try:
        if "x" in text:
            return tuple(int(v) for v in text.split("x"))
        return int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a VALUE: an int, True / False, None, or a tuple "
                         "of ints written 1x2x3") from None


def _assignments(spec: str, text: str) -> dict:
    out = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"{spec!r}: {item!r} is not FIELD=VALUE")
        try:
            out[name] = parse_value(value)
        except ValueError as exc:
            raise ValueError(f"{spec!r}: {name}={value!r}: {exc}") from None
    return out


def parse_spec(spec: str) -> tuple[str, dict]:
    """One SPEC (module docstring) -> ``(key, fields)``: a kernel key (``"wgrad"`` for both
    WGRADs), ``"layer"`` or ``"input"``. ValueError naming what is wrong: the form, an unknown
    kernel, field or layer switch, a value of the wrong type."""
    from distmoe.plan.kernel_plan import KERNELS, LAYER_SWITCHES, layer_switch_type_error

    key, sep, rest = spec.partition(":")
    if not sep or not rest or ":" in rest:
        raise ValueError(f"{spec!r}: expected KERNEL:FIELD=VALUE[,FIELD=VALUE...], "
                         "layer:NAME=VALUE or input:buffer=True|False")
    fields = _assignments(spec, rest)
    if key == "input":
        if set(fields) != {"buffer"} or not isinstance(fields["buffer"], bool):
            raise ValueError(f"{spec!r}: expected input:buffer=True|False")
        return key, fields
    if key == "layer":
        for name, value in fields.items():
            if name not in LAYER_SWITCHES:
                raise ValueError(f"{spec!r}: unknown layer switch {name!r}; switches: "
                                 f"{', '.join(sorted(LAYER_SWITCHES))}")
            names = layer_switch_type_error(name, value)
            if names is not None:
                raise ValueError(f"{spec!r}: layer switch {name} must be {names}, "
                                 f"got {value!r}")
        return key, fields
    known = [*KERNELS, BOTH_WGRADS]
    if key not in known:
        raise ValueError(f"{spec!r}: unknown kernel {key!r}; kernels: {', '.join(known)}, "
                         "or layer / input")
    cls = KERNELS["w2_wgrad" if key == BOTH_WGRADS else key][0]
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise ValueError(f"{spec!r}: unknown field(s) {', '.join(unknown)} of {cls.__name__} "
                         f"({key}); its fields: {', '.join(sorted(names))}")
    return key, fields


def overrides_from_specs(specs: list[str]) -> tuple[dict, bool]:
    """``(overrides, x_in_buffer)`` of a variant's specs: the dict for
    ``MoEContext(..., overrides=)`` (later specs win field by field) and whether x is passed
    in the context's input buffer. ValueError as :func:`parse_spec`."""
    overrides: dict[str, dict] = {}
    x_in_buffer = False
    for spec in specs:
        key, fields = parse_spec(spec)
        if key == "input":
            x_in_buffer = fields["buffer"]
            continue
        for k in ("w2_wgrad", "w13_wgrad") if key == BOTH_WGRADS else (key,):
            overrides.setdefault(k, {}).update(fields)
    return overrides, x_in_buffer


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``NAME=SPEC[+SPEC...]`` -> ``(name, specs)`` (ValueError for another form or a NAME
    of the tool's own rows)."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest or name in RESERVED:
        raise ValueError(f"--variant {text!r}: expected NAME=SPEC[+SPEC...] with a NAME "
                         f"other than {', '.join(map(repr, RESERVED))} (the tool's own rows)")
    return name, rest.split("+")


def ignored_changes(base, plan) -> list[str]:
    """The fields a variant's plan changed against the base plan (both
    :class:`~distmoe.plan.KernelPlan`) that its kernel ignores: a Gluon-only field on a
    config that runs the Triton kernel (``gluon=False``), as ``"kernel.field"``."""
    out = []
    before = base.kernels()
    for key, cfg in plan.kernels().items():
        if getattr(cfg, "gluon", True) or key not in before:
            continue
        out += [f"{key}.{f}" for f in GLUON_ONLY
                if hasattr(cfg, f) and getattr(cfg, f) != getattr(before[key], f)]
    return out


def round_ratios(base_ms: list[float], ms: list[float]) -> list[float]:
    """Per round: the base's time over this variant's (> 1: the variant is faster)."""
    return [b / m for b, m in zip(base_ms, ms, strict=True)]


def check_variants(shape_name: str, mode: str, tokens: int | None, ep_size: int, device,
                   variants: dict[str, dict]) -> None:
    """Plan every variant's overrides for the layer it will run (ValueError naming the
    variant for one the plan refuses), before inputs are drawn or buffers allocated."""
    import distmoe as dm
    from distmoe.plan import plan_kernels

    from .bench.workloads import get_shape

    s = get_shape(shape_name)
    cfg = dm.MoEConfig(hidden=s.hidden, ffn=s.ffn, num_experts=s.num_experts, top_k=s.top_k,
                       max_tokens=tokens or s.tokens, training=mode == "fwdbwd")
    for name, overrides in variants.items():
        try:
            plan_kernels(cfg, ep_size=ep_size, device=device, overrides=overrides)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--variant {name}: {exc}") from None


# ------------------------------------------------------------------------------ command line
def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``ab`` options."""
    from .bench.layer_step import add_routing_argument
    from .bench.workloads import SHAPES

    p.description = ("Time kernel-plan variants of one layer against its plan, interleaved "
                     "round by round in one process (one context per variant).")
    p.epilog = ("SPEC: KERNEL:FIELD=VALUE[,FIELD=VALUE...] (KERNEL: w13, w2, combine, "
                "w2_dgrad, w13_dgrad, w2_wgrad, w13_wgrad, or wgrad for both WGRADs), "
                "layer:NAME=VALUE (pull_all, w13_phases, w13_phase_waves, mega, mega_lag, "
                "mega_pingpong, mega_dynamic, fp8_operands) or input:buffer=True|False; VALUE an int, "
                "True/False, None or 1x2x3. Example: --variant g16=w13:group_m=16+w2:"
                "num_stages=5. Under torch.distributed.run every rank is one EP rank.")
    p.add_argument("--shape", default=None, choices=sorted(SHAPES), metavar="NAME",
                   help="the bench shape of the layer (default: dense-e32; with --budget: "
                        f"qwen3-30b-a3b); one of {', '.join(sorted(SHAPES))}")
    p.add_argument("--mode", default="fwd", choices=["fwd", "fwdbwd"],
                   help="forward (inference), or forward+backward (training) (default: fwd)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=SPEC[+SPEC]",
                   help="a variant against the plan's rules (the base); repeatable")
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens per rank instead of the shape's own T (e.g. 64 for decode)")
    p.add_argument("--precision", default="bf16",
                   choices=["bf16", "mxfp8", "fp8_block", "nvfp4", "mxfp4"],
                   help="the layer's precision; the low ones with --mode fwd (inference on "
                        "prepared weights), e.g. nvfp4 with --variant "
                        "fp8=layer:fp8_operands=True (default: bf16)")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds, each replaying every variant's graph once (default: 15; "
                        "--budget: 7)")
    p.add_argument("--iters", type=int, default=None,
                   help="steps per graph and round (default: 10; --budget: 3)")
    p.add_argument("--warmup", type=int, default=None,
                   help="eager steps per variant first (default: 3; --budget: 2)")
    add_routing_argument(p)
    p.add_argument("--ep1-share", action="store_true",
                   help="also this rank's share of the work at EP=1, in the same rounds "
                        "(EP > 1)")
    p.add_argument("--replay", action="store_true",
                   help="also the layer with every layer replayed in backward "
                        "(activation_factor 0) (--mode fwdbwd)")
    p.add_argument("--regather", action="store_true",
                   help="also the layer with saved layers keeping their input instead of "
                        "their gathered rows (save_gathered_rows False) (--mode fwdbwd)")
    p.add_argument("--regather-in-place", choices=["auto", "on", "off", "both"],
                   default="auto",
                   help="with --regather: its gathered_rows_in_place (auto: the rule; both: "
                        "a copying layer and an in-place one)")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="also write the results as JSON to FILE")
    budget = p.add_argument_group(
        "memory budgets (--budget)",
        "a stack of --layers layers in one activation slot; candidates: each "
        "save_gathered_rows mode of --modes at each budget of --factors, and 'saved' (room "
        "for every layer's rows)")
    budget.add_argument("--budget", action="store_true",
                        help="time memory budgets instead of kernel variants (one rank)")
    budget.add_argument("--layers", type=int, default=8,
                        help="layers in the slot (default: 8)")
    budget.add_argument("--factors", default="0.6,0.75,0.9",
                        help="activation_factor of each budget, comma-separated (default: "
                             "0.6,0.75,0.9)")
    budget.add_argument("--modes", default="rows,x,auto",
                        help="save_gathered_rows modes: rows (True), x (False), auto, autoip "
                             "(auto with gathered_rows_in_place True) (default: rows,x,auto)")
    budget.add_argument("--csv", default=None, metavar="FILE",
                        help="also write the budget table to this CSV file")
    return p


def _fill_defaults(args) -> None:
    budget = args.budget
    defaults = dict(shape="qwen3-30b-a3b" if budget else "dense-e32",
                    rounds=7 if budget else 15, iters=3 if budget else 10,
                    warmup=2 if budget else 3)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One ``--variant``: its specs, the overrides they make and whether x is passed in the
    context's input buffer."""

    specs: tuple[str, ...]
    overrides: dict
    x_in_buffer: bool = False


def check_arguments(args) -> dict[str, Variant]:
    """Option rules and the parsed variants by name; ValueError naming the option."""
    _fill_defaults(args)
    for name in ("rounds", "iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} ({getattr(args, name)}) must be >= 1")
    if args.warmup < 0:
        raise ValueError(f"--warmup ({args.warmup}) must be >= 0")
    if args.tokens is not None and args.tokens < 1:
        raise ValueError(f"--tokens ({args.tokens}) must be >= 1")
    if args.budget:
        given = [f"--{n.replace('_', '-')}" for n in ("variant", "ep1_share", "replay",
                                                      "regather", "tokens")
                 if getattr(args, n)]
        if args.mode != "fwd":
            given.append("--mode")
        if given:
            raise ValueError(f"{', '.join(given)}: not with --budget (it times forward+"
                             "backward steps of its stack at the shape's T)")
        return {}
    for flag in ("replay", "regather"):
        if getattr(args, flag) and args.mode != "fwdbwd":
            raise ValueError(f"--{flag} needs --mode fwdbwd (a forward saves nothing)")
    variants: dict[str, Variant] = {}
    for text in args.variant:
        name, specs = parse_variant(text)
        if name in variants:
            raise ValueError(f"--variant {name}: the name is given twice")
        try:
            overrides, x_in_buffer = overrides_from_specs(specs)
        except ValueError as exc:
            raise ValueError(f"--variant {name}: {exc}") from None
        if x_in_buffer and args.mode == "fwdbwd":
            raise ValueError(f"--variant {name}: input:buffer=True is for inference "
                             "(--mode fwd)")
        variants[name] = Variant(tuple(specs), overrides, x_in_buffer)
    return variants


def run(args) -> int:
    """Run the command; returns the exit status (2 for a usage error)."""
    try:
        variants = check_arguments(args)
    except ValueError as exc:
        print(f"distmoe ab: error: {exc}", file=sys.stderr)
        return 2
    if args.budget:
        from . import budget

        return budget.run(args)
    import torch.distributed as dist

    from .bench.layer_step import join_group

    joined = join_group()
    try:
        return _run(args, variants, joined)
    except ValueError as exc:  # a variant the plan refuses, a shape EP does not divide
        print(f"distmoe ab: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(args, variants: dict[str, Variant], joined) -> int:
    import torch

    from .bench.layer_step import build_layer, draw_inputs, ep1_share
    from .bench.timing import interleaved

    if args.ep1_share and joined.world == 1:
        raise ValueError("--ep1-share needs EP > 1 (torch.distributed.run)")
    training = args.mode == "fwdbwd"
    if args.precision != "bf16" and training:
        raise ValueError(f"--precision {args.precision} runs with --mode fwd (inference on "
                         "prepared weights) in ab")
    low = {"precision": args.precision}
    check_variants(args.shape, args.mode, args.tokens, joined.world, joined.device,
                   {n: v.overrides for n, v in variants.items()})
    inputs = draw_inputs(args.shape, args.mode, joined, tokens=args.tokens,
                         routing=args.routing)
    T = inputs.tokens
    layers: dict[str, tuple[object, object, bool]] = {}  # name -> (ctx, step, x_in_buffer)
    try:
        layers["base"] = (*build_layer(inputs, joined, **low), False)
        for name, v in variants.items():
            layers[name] = (*build_layer(inputs, joined, overrides=v.overrides, **low),
                            v.x_in_buffer)
        if args.replay:
            layers["replay"] = (*build_layer(inputs, joined, activation_factor=0.0), False)
        if args.regather:
            way = args.regather_in_place
            kept_x = ([("regather", False), ("inplace", True)] if way == "both" else
                      [("regather", {"auto": None, "on": True, "off": False}[way])])
            for name, in_place in kept_x:
                layers[name] = (*build_layer(inputs, joined, save_gathered_rows=False,
                                             gathered_rows_in_place=in_place), False)
        if args.ep1_share:
            share = ep1_share(joined)
            share_inputs = draw_inputs(args.shape, args.mode, share, tokens=args.tokens,
                                       share_of=joined.world, routing=args.routing)
            layers["ep1share"] = (*build_layer(share_inputs, share), False)
        if joined.rank == 0:
            _print_plans(args, joined, T, variants, layers, training)

        def runner(step, x_in_buffer):
            return lambda: step(x_in_buffer=x_in_buffer)

        fns = {name: runner(step, xb) for name, (_, step, xb) in layers.items()}
        stats = interleaved(fns, rounds=args.rounds, iters=args.iters, warmup=args.warmup,
                            device=joined.device, group=joined.group)
    finally:
        for ctx, _, _ in layers.values():
            ctx.close()
    if joined.rank != 0:
        return 0
    rows = _result_rows(stats, joined.world)
    graph = "a CUDA graph" if joined.device.type == "cuda" else "eager calls (CPU)"
    print(f"  {args.rounds} rounds of {args.iters} steps from {graph} per variant (ms per "
          "step, median and fastest-slowest round; ratio = base / variant per round, "
          "median; > 1: faster)")
    for r in rows:
        print(f"  {r['name']:>12} {r['ms']:8.3f} ({r['min_ms']:.3f}-{r['max_ms']:.3f})"
              f"  x{r['ratio']:.4f}{r['note']}")
    if joined.device.type != "cuda":
        print(f"  note: {INTERPRETER_NOTE}")
    if args.out:
        payload = dict(
            shape=args.shape, mode=args.mode, tokens=T, ep=joined.world,
            routing=args.routing, rounds=args.rounds, iters=args.iters,
            device=(torch.cuda.get_device_name(joined.device)
                    if joined.device.type == "cuda" else "cpu (Triton interpreter)"),
            variants={n: dataclasses.asdict(v) for n, v in variants.items()},
            rows=rows)
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=2)
            f.write("\n")
        print(f"  wrote {args.out}")
    return 0


def _print_plans(args, joined, T, variants, layers, training) -> None:
    import torch

    where = (torch.cuda.get_device_name(joined.device)
             if joined.device.type == "cuda" else "CPU (Triton interpreter)")
    print(f"{args.shape} {args.mode} T={T} EP={joined.world}, {args.routing} routing, {where}")
    base_plan = layers["base"][0].plan
    for name, (ctx, _, x_in_buffer) in layers.items():
        what = ("the plan's rules" if name == "base" else
                "+".join(variants[name].specs) if name in variants else _OWN_ROWS[name])
        print(f"\n== {name}: {what}")
        print(ctx.explain(T))
        if x_in_buffer:
            print("  x passed in the context's input buffer")
        ignored = ignored_changes(base_plan, ctx.plan) if name in variants else []
        if ignored:
            print(f"  note: {', '.join(ignored)} changed on a config that runs the Triton "
                  "kernel (gluon=False), which ignores it: the same kernel as the base")
        if training:
            act = ctx.stats()["activations"]
            print(f"  activation buffer {act['activation_buffer_bytes']} bytes, slot "
                  f"capacity {act['slot_capacity_bytes']} (activation_factor "
                  f"{ctx.cfg.activation_factor}, save_gathered_rows "
                  f"{ctx.cfg.save_gathered_rows}, rows in place {act['rows_in_place']})")
    print()


#: what the tool's own rows are
_OWN_ROWS = {
    "replay": "activation_factor 0: every layer replayed in backward",
    "regather": "save_gathered_rows False: the input kept, the rows gathered again",
    "inplace": "save_gathered_rows False, gathered_rows_in_place True",
    "ep1share": "this rank's share of the work at EP=1 (E / EP experts, one rank)",
}


def _result_rows(stats, world: int) -> list[dict]:
    base = list(stats["base"].window_ms)
    rows = []
    for name, st in stats.items():
        ratio = statistics.median(round_ratios(base, list(st.window_ms)))
        note = ""
        if name == "ep1share":
            note = f"  EP={world} / EP=1 share: {ratio:.3f}x (median per round)"
        elif name == "replay":
            note = f"  replayed / saved: {1 / ratio:.3f}x (median per round)"
        elif name in ("regather", "inplace"):
            note = f"  regathered / saved: {1 / ratio:.3f}x (median per round)"
        elif "ep1share" in stats:  # this variant's time over the share's, per round
            over = statistics.median(round_ratios(list(st.window_ms),
                                                  list(stats["ep1share"].window_ms)))
            note = f"  / EP=1 share: {over:.3f}x"
        rows.append(dict(name=name, ms=st.iter_ms, min_ms=st.min_ms, max_ms=st.max_ms,
                         ratio=ratio, window_ms=list(st.window_ms), note=note))
    return rows


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m distmoe.tools.ab``)."""
    from . import quiet_on_closed_pipe

    parser = add_arguments(argparse.ArgumentParser(prog="distmoe ab"))
    args = parser.parse_args(argv)
    return quiet_on_closed_pipe(lambda: run(args))


if __name__ == "__main__":
    raise SystemExit(main())
