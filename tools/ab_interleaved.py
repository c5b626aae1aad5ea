#!/usr/bin/env python3
"""Layer-level A/B of launch configs in one process, interleaved round by round.

Usage (repository root; one GPU, or one rank per GPU under torch.distributed.run):
    PYTHONPATH=src python3 tools/ab_interleaved.py --shape issue-a --mode fwd \\
        --variant g16=w13:group_m=16 --variant w2tri=w2:gluon=False [--rounds 15]
    PYTHONPATH=src python3 -m torch.distributed.run --standalone --nproc-per-node=2 \\
        tools/ab_interleaved.py --shape fine --mode fwd --variant w13tri=w13:gluon=False
    (--tokens T: T tokens per rank instead of the shape's own, e.g. 64 for decode;
     --routing exact: every expert gets T*K/E rows instead of a sampled histogram)

Why: ``tools/ab_bench.py`` runs one bench per variant, one after the other, and a GPU at its
power limit drifts by a few per cent between them (performance.md runs 28-29), so an A/B of
1-2% needed several alternating runs and still read as noise. Here one layer
(:func:`distmoe.tools.bench.layer_step.layer_step`) is built once; each variant's configs are
set on it and ``--iters`` steps are captured into a CUDA graph per variant; then every round
replays each variant's graph once (:func:`distmoe.tools.bench.timing.interleaved`, rotating
order). Reported per variant: the median over rounds of the per-step time (maximum over
ranks per round), the fastest and slowest round, and the median over rounds of the ratio to
the heuristic ("base") in the same round, which cancels most of the drift.

``--ep1-share`` (EP > 1 only) adds a row "ep1share": on every rank a second layer over a
one-rank group with E / EP experts, the same per-rank work at EP=1, replayed in the same
rounds (the EP=1 share of issue 7's fifth target); its line gives EP / EP=1 as well, and
every variant's line its own time over the share's (median per round).

``--replay`` (``--mode fwdbwd`` only) adds a row "replay": a second layer whose context has
``activation_factor`` 0 (its slot holds the layer's input only), so its backward recomputes
the layer's forward (:mod:`distmoe.ops.activations`): what fitting a memory budget by replay
costs, as a same-round ratio. The same inputs are drawn for both layers; both contexts'
activation buffer sizes are printed.

``--regather`` (``--mode fwdbwd`` only) adds a row "regather": another layer whose context
has ``save_gathered_rows`` False (a saved layer keeps its input instead of its gathered rows,
and its backward gathers them again), timed the same way, with its smaller slot printed.
``--regather-in-place auto|on|off|both`` sets that layer's ``gathered_rows_in_place`` (auto:
None, the library's rule; on / off: True / False, at EP = 1 the W13 WGRAD reads the rows in
place or from a copy; both: two such layers, "regather" copying and "inplace" in place).

``--variant NAME=SPEC[+SPEC...]``, each SPEC ``KERNEL[:WHEN]:FIELD=VALUE[,FIELD=VALUE...]`` as
in ``tools/ab_bench.py``: ``w13`` (``WHEN`` training / inference / any, matched against the
mode), ``w2``, ``w2_dgrad`` (not ``block_n``: the score parts depend on it), ``w13_dgrad``,
``wgrad`` (both WGRADs; ``w2_wgrad`` / ``w13_wgrad``: one), ``combine`` (the owner combine); or ``layer:pull_all=True|False``,
the EP > 1 token pull's way (:meth:`distmoe.MoEContext.pull_all_rule`),
``layer:w13_phases=True|False``, W13 in two launches around that copy's join
(:mod:`distmoe.kernels.w13_phases`), ``layer:w13_waves=N``, the waves of its first
launch, ``layer:w2_beside=True|False``, W2 on a side stream beside W13 (EP > 1 inference),
``layer:w2_beside_sms=N``, W2's programs there, ``layer:fused=True|False``, W13 and W2 in
one kernel (EP > 1 inference; :mod:`distmoe.kernels.w13_w2_gluon`), ``layer:fused_lag=N``,
its lag in row-block groups, ``layer:fused_pp=True|False``, its ping-pong tiles, and ``layer:fused_dynamic=True|False``,
its tiles handed out at run time or statically; or ``input:buffer=True|False``, x passed as
the context's :meth:`distmoe.MoEContext.input_buffer` (inference: no copy of x in the
forward). The configs of every variant are printed first, with a note where a variant
sets a Gluon-only field (``lockstep``, ``expert_groups``) on a config that runs the Triton
kernel, which ignores it (that variant times the base's kernels again).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from ab_bench import parse_override  # noqa: E402

#: layer switches a ``layer:NAME=VALUE`` spec sets: the MoEContext attribute each is, and
#: its type (True / False, or a positive int)
_LAYER = {"pull_all": ("_pull_all", bool), "w13_phases": ("_w13_phases", bool),
          "w13_waves": ("_w13_phase_waves", int), "w2_beside": ("_w2_beside", bool),
          "w2_beside_sms": ("_w2_beside_programs", int), "fused": ("_fused", bool),
          "fused_lag": ("_fused_lag", int), "fused_pp": ("_fused_pingpong", bool),
          "fused_dynamic": ("_fused_dynamic", bool)}
#: the key of ``input:buffer=True|False`` in a variant's configs: the step's x_in_buffer,
#: not a layer attribute
INPUT_BUFFER = "input:buffer"
#: the layer attributes each kernel's config lives in (distmoe.ops.context)
_ATTRS = {"w13": ("_w13_cfg",), "w2": ("_w2_cfg",), "w2_dgrad": ("_w2_dgrad_cfg",),
          "w13_dgrad": ("_w13_dgrad_cfg",), "wgrad": ("_w2_wgrad_cfg", "_w13_wgrad_cfg"),
          "combine": ("_combine_cfg",)}
#: kernels of a ``--variant`` spec that set one WGRAD's config only
_ONE_WGRAD = ("w2_wgrad", "w13_wgrad")


def variant_configs(ctx, specs: list[str], training: bool) -> dict[str, object]:
    """The config attributes of ``ctx`` with the overrides of ``specs`` applied (ValueError
    for an unknown field, a kernel this mode does not run, or ``w2_dgrad`` ``block_n``)."""
    out = {a: getattr(ctx, a) for attrs in _ATTRS.values() for a in attrs if hasattr(ctx, a)}
    out.update({a: getattr(ctx, a) for a, _ in _LAYER.values() if hasattr(ctx, a)})
    out[INPUT_BUFFER] = False
    for spec in specs:
        if spec.startswith("input:"):
            name, _, value = spec.partition("=")
            if name != INPUT_BUFFER or value not in ("True", "False"):
                raise ValueError(f"{spec!r}: expected {INPUT_BUFFER}=True|False")
            if value == "True" and training:
                raise ValueError(f"{spec!r}: the input buffer is for inference (--mode fwd)")
            out[INPUT_BUFFER] = value == "True"
            continue
        if spec.startswith("layer:"):
            name, sep, value = spec[len("layer:"):].partition("=")
            attr, kind = _LAYER.get(name, (None, None))
            if kind is int and sep and value.isdigit() and int(value) > 0:
                out[attr] = int(value)
                continue
            if not sep or kind is not bool or value not in ("True", "False"):
                raise ValueError(f"{spec!r}: expected layer:NAME=True|False with NAME one of "
                                 f"{sorted(n for n, (_, k) in _LAYER.items() if k is bool)}, "
                                 f"or layer:NAME=N (a positive int) with NAME one of "
                                 f"{sorted(n for n, (_, k) in _LAYER.items() if k is int)}")
            out[attr] = value == "True"
            continue
        one = next((k for k in _ONE_WGRAD if spec.startswith(k + ":")), None)
        if one is not None:  # one of the two WGRADs: its fields are a WgradConfig's
            spec = "wgrad" + spec[len(one):]
        kernel, when, fields = parse_override(spec)
        if kernel == "w2_dgrad" and "block_n" in fields:
            raise ValueError(f"{spec!r}: w2_dgrad block_n sets the layer's score parts; "
                             "it cannot change on a built layer")
        if when != "any" and (when == "training") != training:
            continue
        for attr in (f"_{one}_cfg",) if one is not None else _ATTRS[kernel]:
            if attr not in out:
                raise ValueError(f"{spec!r}: this mode does not run {kernel}")
            names = {f.name for f in dataclasses.fields(out[attr])}
            if set(fields) - names:
                raise ValueError(f"{spec!r}: {type(out[attr]).__name__} has no field(s) "
                                 f"{sorted(set(fields) - names)}")
            out[attr] = dataclasses.replace(out[attr], **fields)
    return out


#: config fields that only the Gluon kernels read (the Triton kernels ignore them)
_GLUON_ONLY = ("lockstep", "expert_groups")


def ignored_changes(base: dict[str, object], cfgs: dict[str, object]) -> list[str]:
    """The fields a variant changed (``cfgs`` against ``base``, both from
    :func:`variant_configs`) that its kernel ignores: a Gluon-only field on a config that
    runs the Triton kernel (``gluon=False``), as ``"attr.field"``. Such a variant times the
    base's kernels again."""
    out = []
    for attr, cfg in cfgs.items():
        if not dataclasses.is_dataclass(cfg) or getattr(cfg, "gluon", True):
            continue
        out += [f"{attr}.{f}" for f in _GLUON_ONLY
                if hasattr(cfg, f) and getattr(cfg, f) != getattr(base[attr], f)]
    return out


#: row names the tool gives its own layers: the heuristics, ``--ep1-share``, ``--replay``,
#: ``--regather`` (and ``--regather-in-place both``)
_RESERVED = ("base", "ep1share", "replay", "regather", "inplace")


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``NAME=SPEC[+SPEC...]`` -> (name, specs)."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest or name in _RESERVED:
        raise ValueError(f"--variant {text!r}: expected NAME=SPEC[+SPEC...] with a NAME "
                         f"other than {', '.join(map(repr, _RESERVED))} (the tool's own rows)")
    return name, rest.split("+")


def round_ratios(base_ms: list[float], ms: list[float]) -> list[float]:
    """Per round: the base's time over this variant's (> 1: the variant is faster)."""
    return [b / m for b, m in zip(base_ms, ms, strict=True)]


def main() -> int:
    import torch.distributed as dist

    from distmoe.tools.bench.layer_step import (
        add_routing_argument,
        ep1_share,
        join_group,
        layer_step,
    )
    from distmoe.tools.bench.timing import interleaved
    from distmoe.tools.bench.workloads import SHAPES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="issue-a", choices=sorted(SHAPES),
                    help="the bench shape of the layer (default: issue-a)")
    ap.add_argument("--mode", default="fwd", choices=["fwd", "fwdbwd"],
                    help="forward, or forward+backward (default: fwd)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=SPEC[+SPEC]",
                    help="a variant against the heuristics' base, SPEC as "
                         "KERNEL[:WHEN]:FIELD=VALUE[,...], layer:NAME=VALUE or "
                         "input:buffer=True|False (see the module docstring); repeatable")
    ap.add_argument("--rounds", type=int, default=15,
                    help="rounds, each replaying every variant's graph once (default: 15)")
    ap.add_argument("--iters", type=int, default=10,
                    help="steps per graph (per round; default: 10)")
    ap.add_argument("--warmup", type=int, default=3,
                    help="eager steps per variant first (default: 3)")
    ap.add_argument("--tokens", type=int, default=None,
                    help="tokens per rank instead of the shape's own T (e.g. 64 for decode)")
    ap.add_argument("--ep1-share", action="store_true",
                    help="also this rank's share of the work at EP=1, in the same rounds")
    ap.add_argument("--replay", action="store_true",
                    help="also the same layer with every layer replayed in backward "
                         "(activation_factor 0), in the same rounds (--mode fwdbwd)")
    ap.add_argument("--regather", action="store_true",
                    help="also the same layer with saved layers keeping their input instead "
                         "of their gathered rows (save_gathered_rows False), in the same "
                         "rounds (--mode fwdbwd)")
    ap.add_argument("--regather-in-place", choices=["auto", "on", "off", "both"],
                    default="auto",
                    help="with --regather: its layer's gathered_rows_in_place (auto: the "
                         "rule; both: a copying layer and an in-place one)")
    add_routing_argument(ap)
    args = ap.parse_args()
    for name in ("rounds", "iters"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} ({getattr(args, name)}) must be >= 1")
    if args.warmup < 0:
        ap.error(f"--warmup ({args.warmup}) must be >= 0")
    try:
        variants = dict(parse_variant(v) for v in args.variant)
    except ValueError as exc:
        ap.error(str(exc))
    for flag in ("replay", "regather"):
        if getattr(args, flag) and args.mode != "fwdbwd":
            ap.error(f"--{flag} needs --mode fwdbwd (a forward saves nothing)")
    joined = join_group()
    if args.ep1_share and joined.world == 1:
        raise SystemExit("--ep1-share needs EP > 1 (torch.distributed.run)")
    training = args.mode == "fwdbwd"
    try:
        ctx, step, T = layer_step(args.shape, args.mode, joined, tokens=args.tokens,
                                  routing=args.routing)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    extra = {}  # name -> (ctx, step) of the layers beside the base one
    if args.replay:
        extra["replay"] = layer_step(args.shape, args.mode, joined, tokens=args.tokens,
                                     routing=args.routing, activation_factor=0.0)[:2]
    if args.regather:
        way = args.regather_in_place
        kept_x = ([("regather", False), ("inplace", True)] if way == "both" else
                  [("regather", {"auto": None, "on": True, "off": False}[way])])
        for name, in_place in kept_x:
            extra[name] = layer_step(args.shape, args.mode, joined, tokens=args.tokens,
                                     routing=args.routing, save_gathered_rows=False,
                                     gathered_rows_in_place=in_place)[:2]
    share = None
    if args.ep1_share:
        share = layer_step(args.shape, args.mode, ep1_share(joined), tokens=args.tokens,
                           share_of=joined.world, routing=args.routing)
    with ctx:
        configs = {"base": variant_configs(ctx, [], training)}
        for name, specs in variants.items():
            try:
                configs[name] = variant_configs(ctx, specs, training)
            except (TypeError, ValueError) as exc:  # an unknown field, a bad value
                ap.error(f"--variant {name}: {exc}")

        def runner(cfgs):
            def run():
                for attr, cfg in cfgs.items():
                    if attr != INPUT_BUFFER:
                        setattr(ctx, attr, cfg)
                step(x_in_buffer=cfgs[INPUT_BUFFER])
            return run

        if joined.rank == 0:
            where = (torch.cuda.get_device_name(joined.device)
                     if joined.device.type == "cuda" else "CPU (Triton interpreter)")
            print(f"{args.shape} {args.mode} T={T} EP={joined.world}, {where}")
            for name, cfgs in configs.items():
                changed = {a: c for a, c in cfgs.items() if c != configs["base"][a]}
                print(f"  {name}: " + ("; ".join(f"{a}={c}" for a, c in changed.items())
                                       if name != "base" else "the heuristics"))
                ignored = ignored_changes(configs["base"], cfgs)
                if ignored:
                    print(f"      note: {', '.join(ignored)} changed on a config that runs "
                          "the Triton kernel (gluon=False), which ignores it: the same "
                          "kernel as the base")
                if name == "base":
                    for a, c in cfgs.items():
                        print(f"      {a} = {c}")
            layers = [("base", ctx)] + [(name, other) for name, (other, _) in extra.items()]
            for name, other in layers if training else ():
                act = other.stats()["activations"]
                print(f"  {name} layer: activation buffer {act['activation_buffer_bytes']} "
                      f"bytes, slot capacity {act['slot_capacity_bytes']} (activation_factor "
                      f"{other.cfg.activation_factor}, save_gathered_rows "
                      f"{other.cfg.save_gathered_rows}, rows in place {act['rows_in_place']})")
        fns = {n: runner(c) for n, c in configs.items()}
        fns.update((name, other_step) for name, (_, other_step) in extra.items())
        if share is not None:
            fns["ep1share"] = share[1]
        stats = interleaved(fns, rounds=args.rounds, iters=args.iters, warmup=args.warmup,
                            device=joined.device, group=joined.group)
        for other, _ in extra.values():
            other.close()
        if share is not None:
            share[0].close()
    names = list(fns)  # each round below is the slowest rank's
    if joined.rank == 0:
        base = list(stats["base"].window_ms)
        graph = "a CUDA graph" if joined.device.type == "cuda" else "eager calls (CPU)"
        print(f"  {args.rounds} rounds of {args.iters} steps from {graph} per variant "
              "(ms per step, median and fastest-slowest round; ratio = base / variant per "
              "round, median; > 1: faster)")
        for name in names:
            st = stats[name]
            ratio = statistics.median(round_ratios(base, list(st.window_ms)))
            note = ""
            if name == "ep1share":
                note = f"  EP={joined.world} / EP=1 share: {ratio:.3f}x (median per round)"
            elif name == "replay":  # its own context, the heuristics' configs
                note = f"  replayed / saved: {1 / ratio:.3f}x (median per round)"
            elif name in ("regather", "inplace"):
                note = f"  regathered / saved: {1 / ratio:.3f}x (median per round)"
            elif "ep1share" in stats:  # this variant's time over the share's, per round
                over = statistics.median(round_ratios(list(st.window_ms),
                                                      list(stats["ep1share"].window_ms)))
                note = f"  / EP=1 share: {over:.3f}x"
            print(f"  {name:>12} {st.iter_ms:8.3f} ({st.min_ms:.3f}-{st.max_ms:.3f})"
                  f"  x{ratio:.4f}{note}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
