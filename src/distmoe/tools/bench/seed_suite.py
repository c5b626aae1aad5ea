"""``python -m distmoe bench --suite seed``: the evaluation cases of seed 002 (section 07 and
the packing workload of its MoK comparison) at sizes one GPU holds.

Cases (:func:`seed_cases`; ``--seed-cases`` picks kinds, default all):

``imbalance``  one routed layer, the seed's layer as one rank's share at EP = 8
               (:data:`SEED_SHARE`: T2048 D7168 F3072 E48 K6), exact routing at imbalance
               1 / 4 / 8 (``--imbalance-groups`` 8: group 0 stands for rank 0's experts):
               bf16, mxfp8 and fp8_block forward and forward+backward (low precisions:
               inference forwards take weights from :func:`distmoe.prepare_weights`,
               training contexts quantise the bf16 weights once per version; both outside
               the timing; fp8_block not at the CPU's tiny widths).
``width``      the same layer at F = 512 1024 1536 2048 3072 4096 (T, D, E, K fixed), bf16,
               forward and forward+backward.
``packing``    ten layers (``--pack-layers``) of :data:`PACK_SHAPE` (D2048 F768 E128 K8),
               each with its own inputs and weights: ten training forwards, then their
               backwards in reverse order, as one timed step, under two memory plans of the
               same bytes: ``distmoe`` one shared slot (``max_layers_per_slot`` = layers) at
               activation factor 2.5, ``distmoe_per_layer`` one slot per layer (``num_slots``
               = layers, ``max_layers_per_slot`` 1, :meth:`~distmoe.MoEContext.select_slot`
               before each forward), each a tenth of that capacity. What a layer cannot keep
               in its budget it replays in backward (``kept``: R saved, I input only).
``packing-shared``  the same with one bf16 shared expert of width F per layer, the branch
               ``MoEExperts(shared_ffn=F)`` runs (:func:`distmoe.nn.shared_expert.with_shared_expert`
               on a side stream; called directly so that twenty modules need not draw their
               weights on the host).

Imbalance of the packing workload, on one GPU. At EP = 1 a layer executes all T*K routes,
whatever the expert histogram, so the planner sees no skew. The workload instead varies the
rows each layer executes, as an EP rank's load varies from layer to layer: layer l runs
``load_l * T`` tokens (all routes live) with ``load_l = f`` for every fifth layer (0, 5)
and 1 otherwise (:func:`layer_loads`), T = :data:`PACK_SHAPE`'s 2048 tokens. The contexts
take ``max_tokens = max(f) * T``. The factor 2.5 is the seed's (``activation_factor``: the
slot holds the replay inputs plus 2.5 times the rest of every layer's balanced full state),
taken at the balanced T and raised by the larger replay inputs of ``max_tokens``
(:func:`pack_budget`). The slots keep no route outputs (``save_route_outputs=False``, same
gradients): the planner sizes those by ``max_tokens``, not by a layer's tokens. At f = 8 the shared slot keeps every layer while each per-layer budget
replays the loaded layers.

Reported per case (rows of cases.csv / results.json, beside the bench's own fields): the
seed's iteration time (CUDA events, windows of ``--iters`` iterations, maximum over ranks,
median over ``--windows`` windows), useful TFLOP/s (6*T*K*D*F per layer forward, 3x with
backward, summed over the layers; shared experts and replays not counted), the HBM model
(:mod:`~distmoe.tools.bench.models`, summed the same way), and per phase the peak of
``torch.cuda.max_memory_allocated`` (reset before the phase, plus the symmetric heap's
untracked bytes) in an untimed eager step: ``peak_fwd_gib`` (the forwards),
``peak_bwd_gib`` (the backwards), with ``scratch_gib`` and ``slot_gib`` the planned scratch
and saved-state bytes of the context (:func:`distmoe.plan_memory`). On the CPU memory is not
measured (empty cells, the note says so). The two packing plans run the same inputs and
their outputs and gradients are compared bit by bit (``plans_agree``).

On the CPU (``--device cpu``) every case runs at tiny widths (:data:`TINY`) in Triton's
interpreter, to check the harness only.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from distmoe.tools.bench import models, report
from distmoe.tools.bench.workloads import MoEShape, make_routing, make_weights

#: ``--seed-cases`` choices, in run order
SEED_KINDS: tuple[str, ...] = ("imbalance", "width", "packing", "packing-shared")
IMBALANCES: tuple[float, ...] = (1.0, 4.0, 8.0)
#: expert widths of the ``width`` sweep (at least six at fixed T, D, E, K)
WIDTHS: tuple[int, ...] = (512, 1024, 1536, 2048, 3072, 4096)
#: the seed's activation factor of the packing workload
PACK_FACTOR = 2.5
PACK_LAYERS = 10
#: every ``PACK_PERIOD``-th layer carries the imbalance factor (:func:`layer_loads`)
PACK_PERIOD = 5

#: seed 002's layer (T2048 D7168 F3072 E384 K6) as one rank's share at EP = 8
SEED_SHARE = MoEShape(name="seed-ep8", hidden=7168, ffn=3072, num_experts=48, top_k=6,
                      tokens=2048, description="seed 002's layer, one rank's share at EP=8")
#: layer of the packing workload (Qwen3-30B-A3B-like; ten of them with gradients fit 80 GB)
PACK_SHAPE = MoEShape(name="seed-pack", hidden=2048, ffn=768, num_experts=128, top_k=8,
                      tokens=2048, description="ten-layer packing workload, per layer")


@dataclass(frozen=True, kw_only=True)
class Tiny:
    """The suite's widths on the CPU (Triton's interpreter)."""

    share: MoEShape = MoEShape(name="seed-ep8", hidden=64, ffn=64, num_experts=16, top_k=2,
                               tokens=32, description="tiny seed layer (CPU)")
    widths: tuple[int, ...] = (32, 64)
    pack: MoEShape = MoEShape(name="seed-pack", hidden=64, ffn=32, num_experts=16, top_k=8,
                              tokens=8, description="tiny packing layer (CPU)")


TINY = Tiny()


@dataclass(frozen=True, kw_only=True)
class SeedCase:
    """One case of the suite: ``kind`` (:data:`SEED_KINDS`), the layer ``shape``, ``mode``
    (``fwd`` / ``fwdbwd``), ``precision``, ``imbalance``; packing cases also ``layers`` and
    ``shared_ffn`` (width of the shared expert, 0 for none)."""

    kind: str
    shape: MoEShape
    mode: str
    precision: str = "bf16"
    imbalance: float = 1.0
    layers: int = 1
    shared_ffn: int = 0


def with_ffn(shape: MoEShape, ffn: int) -> MoEShape:
    """``shape`` at expert width ``ffn``, named ``<name>-f<ffn>``."""
    return dataclasses.replace(shape, name=f"{shape.name}-f{ffn}", ffn=ffn,
                               description=f"{shape.description}, F={ffn}")


def seed_cases(kinds: tuple[str, ...] = SEED_KINDS, *, tiny: bool = False,
               layers: int = PACK_LAYERS,
               imbalances: tuple[float, ...] = IMBALANCES) -> list[SeedCase]:
    """The suite's cases of ``kinds`` in run order (ValueError for an unknown kind or
    ``layers`` < 1); ``imbalances`` for the imbalance and packing kinds (``--imbalance``)."""
    bad = [k for k in kinds if k not in SEED_KINDS]
    if bad:
        raise ValueError(f"--seed-cases ({' '.join(bad)}) must be among {' '.join(SEED_KINDS)}")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"--pack-layers ({layers!r}) must be an int >= 1")
    share = TINY.share if tiny else SEED_SHARE
    widths = TINY.widths if tiny else WIDTHS
    pack = TINY.pack if tiny else PACK_SHAPE
    out: list[SeedCase] = []
    for kind in SEED_KINDS:
        if kind not in kinds:
            continue
        if kind == "imbalance":
            for mode in ("fwd", "fwdbwd"):
                out += [SeedCase(kind=kind, shape=share, mode=mode, imbalance=f)
                        for f in imbalances]
            # block FP8 needs D and F multiples of 128: not at the CPU's tiny widths
            lowp = ("mxfp8",) if tiny else ("mxfp8", "fp8_block")
            out += [SeedCase(kind=kind, shape=share, mode=mode, precision=p, imbalance=f)
                    for mode in ("fwd", "fwdbwd") for p in lowp for f in imbalances]
        elif kind == "width":
            out += [SeedCase(kind=kind, shape=with_ffn(share, f), mode=mode)
                    for mode in ("fwd", "fwdbwd") for f in widths]
        else:
            shared = pack.ffn if kind == "packing-shared" else 0
            name = pack.name + ("+shared" if shared else "")
            out += [SeedCase(kind=kind, shape=dataclasses.replace(pack, name=name),
                             mode="fwdbwd", imbalance=f, layers=layers, shared_ffn=shared)
                    for f in imbalances]
    return out


def count_rows(cases: list[SeedCase], providers: tuple[str, ...]) -> int:
    """Progress units: a layer case per provider (mxfp8: distmoe only), a packing case per
    plan."""
    n = 0
    for c in cases:
        if c.kind.startswith("packing"):
            n += 2
        elif c.precision != "bf16":
            n += "distmoe" in providers
        else:
            n += len(providers)
    return n


# ----------------------------------------------------------------------------- packing plan


def layer_loads(imbalance: float, layers: int) -> list[float]:
    """Load of each layer, in balanced token counts: ``imbalance`` for every
    :data:`PACK_PERIOD`-th layer (0, 5, ...), 1 for the others."""
    return [imbalance if i % PACK_PERIOD == 0 else 1.0 for i in range(layers)]


def pack_budget(shape: MoEShape, *, layers: int, max_tokens: int, ep_size: int = 1,
                factor: float = PACK_FACTOR) -> dict:
    """The two plans' configs of the packing workload, the same saved-state bytes in all.

    ``capacity``: the shared slot, ``plan_memory``'s slot at ``activation_factor = factor``
    for ``layers`` layers at the balanced ``shape.tokens``, plus the larger replay inputs of
    ``max_tokens`` (a layer of ``max_tokens`` tokens that replays keeps its input).
    ``share``: a tenth of it (for ten layers), 128-byte aligned. Both keep no route outputs
    in the slot (``save_route_outputs=False``, the same gradients): the slot sizes those by
    ``max_tokens``, which would charge a balanced layer for the loaded layers' tokens. Returns ``{"shared": cfg,
    "per_layer": cfg, "capacity": int, "share": int}``."""
    import distmoe as dm

    dims = dict(hidden=shape.hidden, ffn=shape.ffn, num_experts=shape.num_experts,
                top_k=shape.top_k, precision="bf16", training=True, row_block=128,
                save_route_outputs=False)
    bal = dm.plan_memory(dm.MoEConfig(**dims, max_tokens=shape.tokens,
                                      max_layers_per_slot=layers, activation_factor=factor),
                         ep_size)
    big = dm.plan_memory(dm.MoEConfig(**dims, max_tokens=max_tokens), ep_size)
    capacity = bal.slot_capacity_bytes + layers * (big.input_bytes - bal.input_bytes)
    share = capacity // layers // 128 * 128
    return {
        "shared": dm.MoEConfig(**dims, max_tokens=max_tokens, max_layers_per_slot=layers,
                               activation_bytes=capacity),
        "per_layer": dm.MoEConfig(**dims, max_tokens=max_tokens, num_slots=layers,
                                  max_layers_per_slot=1, activation_bytes=share),
        "capacity": capacity,
        "share": share,
    }


@dataclass
class PackInputs:
    """One packing case's tensors, drawn once and run by both plans: per layer ``x`` [T_l, D],
    ``ids`` / ``scores`` [T_l, K], ``w13`` / ``w2`` (local experts), ``gy`` [T_l, D] and, with
    a shared expert, ``sw13`` [2, F_s, D] / ``sw2`` [D, F_s]."""

    x: list[torch.Tensor]
    ids: list[torch.Tensor]
    scores: list[torch.Tensor]
    w13: list[torch.Tensor]
    w2: list[torch.Tensor]
    gy: list[torch.Tensor]
    sw13: list[torch.Tensor | None]
    sw2: list[torch.Tensor | None]


def pack_weights(case: SeedCase, *, ep_size: int, rank: int, device, seed: int) -> list:
    """Per layer ``(w13, w2, sw13, sw2)`` requiring grad (independent draws per layer; the
    shared expert's two ``None`` without one)."""
    s, out = case.shape, []
    for layer in range(case.layers):
        w13, w2 = make_weights(s, num_local_experts=s.num_experts // ep_size, device=device,
                               seed=seed + 101 * layer + 1000 * rank + 17)
        sw13 = sw2 = None
        if case.shared_ffn:
            g = torch.Generator(device=device).manual_seed(seed + 101 * layer + 5)
            fs, d = case.shared_ffn, s.hidden
            sw13 = (torch.randn(2, fs, d, generator=g, device=device) * d**-0.5).bfloat16()
            sw2 = (torch.randn(d, fs, generator=g, device=device) * fs**-0.5).bfloat16()
            sw13.requires_grad_(True)
            sw2.requires_grad_(True)
        out.append((w13.requires_grad_(True), w2.requires_grad_(True), sw13, sw2))
    return out


def pack_inputs(case: SeedCase, weights: list, *, rank: int, device, seed: int) -> PackInputs:
    """The tensors of ``case`` on ``device``; layer l runs ``layer_loads[l] * T`` tokens."""
    s = case.shape
    cols: dict[str, list] = {k: [] for k in ("x", "ids", "scores", "gy")}
    for layer, load in enumerate(layer_loads(case.imbalance, case.layers)):
        t = max(1, round(load * s.tokens))
        lseed = seed + 101 * layer + 1000 * rank
        r = make_routing(tokens=t, top_k=s.top_k, num_experts=s.num_experts, seed=lseed)
        g = torch.Generator(device=device).manual_seed(lseed + 7)
        cols["x"].append(torch.randn(t, s.hidden, generator=g, device=device).bfloat16())
        cols["gy"].append(torch.randn(t, s.hidden, generator=g, device=device).bfloat16())
        cols["ids"].append(r.expert_ids_TK.to(device))
        cols["scores"].append(r.scores_TK.to(device).requires_grad_(True))
    w13, w2, sw13, sw2 = (list(c) for c in zip(*weights, strict=True))
    return PackInputs(**cols, w13=w13, w2=w2, sw13=sw13, sw2=sw2)


def pack_step(ctx, inp: PackInputs, *, per_layer: bool, stream=None,
              observe: Callable[[str, int, object], None] | None = None) -> Callable[[], None]:
    """One step of the packing workload on ``ctx``: every layer's training forward in order
    (``per_layer``: slot l selected before layer l), then every layer's backward in reverse
    (``torch.autograd.grad`` for x, the scores, the weights and the shared expert's weights:
    returned, not accumulated, so steps replay). ``observe(phase, layer, value)`` (untimed
    runs) sees ``("routed", l, y_routed)`` and ``("y", l, y)`` after each forward,
    ``("fwd_done", -1, None)`` between the phases, ``("grads", l, grads)`` after each
    backward."""
    from distmoe.nn.shared_expert import with_shared_expert

    num = len(inp.x)

    def step() -> None:
        ys, wrt = [], []
        for i in range(num):
            if per_layer:
                ctx.select_slot(i)
            x = inp.x[i].detach().requires_grad_(True)
            args = (x, inp.ids[i], inp.scores[i], inp.w13[i], inp.w2[i])
            box = []

            def routed(args=args, box=box):
                box.append(ctx(*args))
                return box[0]

            if inp.sw13[i] is None:
                y = routed()
                leaves = (x, inp.scores[i], inp.w13[i], inp.w2[i])
            else:
                y = with_shared_expert(routed, x, inp.sw13[i], inp.sw2[i], stream=stream)
                leaves = (x, inp.scores[i], inp.w13[i], inp.w2[i], inp.sw13[i], inp.sw2[i])
            if observe is not None:
                observe("routed", i, box[0])
                observe("y", i, y)
            ys.append(y)
            wrt.append(leaves)
        if observe is not None:
            observe("fwd_done", -1, None)
        for i in reversed(range(num)):
            grads = torch.autograd.grad(ys[i], wrt[i], inp.gy[i])
            if observe is not None:
                observe("grads", i, grads)
            ys[i] = None

    return step


def fingerprint(t: torch.Tensor) -> tuple[int, int]:
    """Two integer sums of ``t``'s bits (plain and position-weighted): equal for equal
    tensors, different for almost any change, without keeping the tensor."""
    bits = t.detach().contiguous().view(-1)
    bits = bits.view(torch.int16 if bits.element_size() == 2 else torch.int32).long()
    pos = torch.arange(1, bits.numel() + 1, device=bits.device) % 65521
    return int(bits.sum()), int((bits * pos).sum())


# ----------------------------------------------------------------------------- running


def run(ctx, results: list, intensity: dict, progress=None, on_case=None, *, cli) -> None:
    """Every case of ``ctx.plan`` (its ``seed_cases``), appended to ``results`` as it
    finishes. ``ctx``: the bench's run context; ``cli``: the module
    :mod:`~distmoe.tools.bench.cli`, whose case runner the one-layer cases reuse (passed in,
    not imported: it imports this module)."""
    plan = ctx.plan
    tiny = ctx.device.type == "cpu"
    cases = seed_cases(plan.seed_kinds, tiny=tiny, layers=plan.pack_layers,
                       imbalances=plan.imbalances)
    layer_cases = [c for c in cases if not c.kind.startswith("packing")]
    pack_cases = [c for c in cases if c.kind.startswith("packing")]

    def done(rows, label):
        results.extend(rows)
        if on_case is not None:
            on_case()
        if progress:
            progress.update(1)
            progress.set_postfix_str(label, refresh=False)

    _run_layer_cases(ctx, layer_cases, intensity, done, cli)
    for kind in dict.fromkeys(c.kind for c in pack_cases):
        _run_packing(ctx, [c for c in pack_cases if c.kind == kind], done, cli)


def _mem_note(ctx) -> str:
    return "" if ctx.device.type == "cuda" else "memory by phase: not measured on the CPU"


def _run_layer_cases(ctx, cases: list[SeedCase], intensity: dict, done, cli) -> None:
    """The one-layer cases through the bench's own case runner, grouped by (shape, mode,
    precision) so that a provider serves every imbalance."""
    from distmoe.tools.bench.providers import build_provider, make_step
    from distmoe.tools.bench.workloads import make_layer_inputs

    plan, bg = ctx.plan, ctx.bench_group
    groups = bg.world_size if bg.world_size > 1 else plan.imbalance_groups
    keyed: dict[tuple, list[SeedCase]] = {}
    for c in cases:
        keyed.setdefault((c.shape, c.mode, c.precision), []).append(c)
    weights_for: dict[str, tuple] = {}
    for (shape, mode, precision), group in keyed.items():
        training = mode == "fwdbwd"
        if shape.name not in weights_for:
            weights_for.clear()
            cli._free(ctx.device)
            weights_for[shape.name] = make_weights(
                shape, num_local_experts=shape.num_experts // bg.world_size,
                device=ctx.device, seed=plan.seed + 11 + 1000 * bg.rank)
        weights = weights_for[shape.name]
        providers = plan.providers if precision == "bf16" else ("distmoe",)
        providers = tuple(p for p in providers if p in plan.providers)
        built: dict[str, object] = {}
        for c in group:
            try:
                inputs = make_layer_inputs(
                    shape, tokens=shape.tokens, ep_size=bg.world_size, rank=bg.rank,
                    imbalance=c.imbalance, num_groups=groups, training=training,
                    device=ctx.device, seed=plan.seed, weights=weights)
            except ValueError as exc:  # an imbalance the shape cannot route
                for p in providers:
                    row = cli._base_result(ctx, p, shape, shape.tokens, mode, c.imbalance)
                    row.precision, row.suite_case = precision, c.kind
                    row.status, row.note = "infeasible", str(exc)
                    done([row], f"{c.kind} {shape.name} x{c.imbalance:g} {p}")
                continue
            y_ref = cli._reference_output(inputs, ctx)
            for p in providers:
                if p not in built:
                    if precision == "bf16":
                        built[p] = build_provider(
                            p, shape=shape, tokens=shape.tokens, training=training,
                            bench_group=bg, device=ctx.device,
                            max_imbalance=max(plan.imbalances))
                    else:
                        built[p] = _lowp_provider(shape, precision, weights, bg,
                                                  max(plan.imbalances), training=training)
                row = cli._base_result(ctx, p, shape, shape.tokens, mode, c.imbalance)
                row.precision, row.suite_case, row.layers = precision, c.kind, 1
                out = cli.run_case(ctx, built[p], inputs, row, y_ref)
                if out[0][0].status == "ok" and built[p].layer is not None:
                    _layer_phase_memory(ctx, make_step(built[p].layer, inputs, mode),
                                        built[p], inputs, mode, [r for r, _ in out])
                for r, value in out:
                    if value is not None:
                        intensity[id(r)] = value
                    r.note = "; ".join(n for n in (r.note, _mem_note(ctx)) if n)
                done([r for r, _ in out], f"{c.kind} {shape.name} {mode} {precision} "
                                          f"x{c.imbalance:g} {p}")
            del inputs, y_ref
        for prov in built.values():
            try:
                prov.close()
            except Exception:
                pass
        del built
        cli._free(ctx.device)


def _lowp_provider(shape: MoEShape, precision: str, weights, bench_group,
                   max_imbalance: float, training: bool = False):
    """distmoe at ``precision``. Inference: its weights prepared once, outside the timed
    calls; the layer takes the bench's bf16 arguments and passes the prepared weights.
    Training (mxfp8, fp8_block): a training context that takes the bench's bf16 weights
    (quantised once per weight version, so not in the timed calls) and runs eagerly."""
    from distmoe.tools.bench.providers import Provider

    try:
        import distmoe as dm

        cfg = dm.MoEConfig(hidden=shape.hidden, ffn=shape.ffn, num_experts=shape.num_experts,
                           top_k=shape.top_k, max_tokens=shape.tokens, precision=precision,
                           training=training, row_block=128,
                           **({"device_scratch_factor": max(2.0, max_imbalance)}
                              if bench_group.world_size > 1 else {}))
        if not training:
            w13p, w2p = dm.prepare_weights(weights[0].detach(), weights[1].detach(),
                                           precision)
        lctx = dm.MoEContext(cfg, group=bench_group.group)
    except Exception as exc:
        return Provider(name="distmoe", status="failed",
                        note=f"{precision} MoEContext: " + report.error_text(exc))

    if training:
        def layer(x, ids, scores, w13, w2):
            return lctx(x, ids, scores, w13, w2)
        note = f"{precision} training, weights quantised once per version, eager"
    else:
        def layer(x, ids, scores, w13, w2):
            return lctx(x, ids, scores, w13p, w2p)
        note = f"{precision} weights prepared once"

    layer.heap = getattr(lctx, "heap", None)
    return Provider(name="distmoe", status="ok", note=note, layer=layer,
                    graph_safe=not training, close=lctx.close)


def _gib(nbytes: float) -> float:
    return nbytes / 2**30


def _untracked(layer) -> int:
    heap = getattr(layer, "heap", None)
    return heap.untracked_bytes if heap is not None else 0


def _layer_phase_memory(ctx, step, provider, inputs, mode: str, rows: list) -> None:
    """Peak allocated bytes of one untimed call, by phase, into ``rows`` (CUDA only)."""
    if ctx.device.type != "cuda":
        return
    args = (inputs.x_TD, inputs.expert_ids_TK, inputs.scores_TK, inputs.w13_e2FD,
            inputs.w2_eDF)
    extra = _untracked(provider.layer)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(ctx.device)
    fwd = bwd = None
    if mode == "fwd":
        with torch.no_grad():
            provider.layer(*args)
        torch.cuda.synchronize()
        fwd = torch.cuda.max_memory_allocated(ctx.device) + extra
    else:
        y = provider.layer(*args)
        torch.cuda.synchronize()
        fwd = torch.cuda.max_memory_allocated(ctx.device) + extra
        torch.cuda.reset_peak_memory_stats(ctx.device)
        torch.autograd.grad(y, (inputs.x_TD, inputs.scores_TK, inputs.w13_e2FD,
                                inputs.w2_eDF), inputs.grad_y_TD)
        del y
        torch.cuda.synchronize()
        bwd = torch.cuda.max_memory_allocated(ctx.device) + extra
    scratch = None
    layer = provider.layer
    if hasattr(layer, "cfg") and provider.name == "distmoe":
        import distmoe as dm

        scratch = _gib(dm.plan_memory(layer.cfg, ctx.bench_group.world_size).scratch_bytes)
    for r in rows:
        r.peak_fwd_gib = _gib(fwd)
        r.peak_bwd_gib = None if bwd is None else _gib(bwd)
        r.scratch_gib = scratch


def _pack_work(case: SeedCase, inp: PackInputs, ep_size: int) -> tuple[float, float]:
    """Useful FLOPs and modeled HBM bytes of one packing step, summed over its layers."""
    s = case.shape
    flops = hbm = 0.0
    for x in inp.x:
        kw = dict(tokens=x.shape[0], hidden=s.hidden, ffn=s.ffn, top_k=s.top_k, mode="fwdbwd")
        flops += models.useful_flops(**kw)
        hbm += models.modeled_hbm_bytes(num_local_experts=s.num_experts // ep_size, **kw)
    return flops, hbm


def _run_packing(ctx, cases: list[SeedCase], done, cli) -> None:
    """One packing kind: both plans' contexts built once (``max_tokens`` for the largest
    imbalance), then per imbalance the same inputs through each plan: an untimed eager step
    (phase memory, what each layer kept, fingerprints of every output and gradient), then
    the bench's timing of the step."""
    import distmoe as dm
    from distmoe.tools.bench.timing import benchmark_modes

    plan, bg, dev = ctx.plan, ctx.bench_group, ctx.device
    case0 = cases[0]
    shape, layers = case0.shape, case0.layers
    max_tokens = round(max(c.imbalance for c in cases) * shape.tokens)
    budget = pack_budget(shape, layers=layers, max_tokens=max_tokens, ep_size=bg.world_size)
    group = bg.group if bg.world_size > 1 else None
    weights = pack_weights(case0, ep_size=bg.world_size, rank=bg.rank, device=dev,
                           seed=plan.seed)
    contexts: dict[str, object] = {}
    errors: dict[str, str] = {}
    for name in ("shared", "per_layer"):
        try:
            contexts[name] = dm.MoEContext(budget[name], group=bg.group)
        except Exception as exc:
            errors[name] = "MoEContext: " + report.error_text(exc)
    stream = torch.cuda.Stream(dev) if dev.type == "cuda" and case0.shared_ffn else None
    try:
        for case in cases:
            inp = pack_inputs(case, weights, rank=bg.rank, device=dev, seed=plan.seed)
            prints: dict[str, list] = {}
            for name, provider in (("shared", "distmoe"), ("per_layer", "distmoe_per_layer")):
                start = time.perf_counter()
                row = cli._base_result(ctx, provider, shape, shape.tokens, "fwdbwd",
                                       case.imbalance)
                row.suite_case, row.layers = case.kind, layers
                row.shared_ffn = case.shared_ffn or None
                slot = budget["capacity"] if name == "shared" else budget["share"]
                row.slot_gib = _gib(slot * (1 if name == "shared" else layers))
                loads = " ".join(f"{f:g}" for f in layer_loads(case.imbalance, layers))
                notes = [f"{layers} layers, loads {loads} x T; "
                         + ("one slot of " if name == "shared" else f"{layers} slots of ")
                         + f"{slot} B"]
                if name in errors:
                    row.status, row.note = "failed", errors[name]
                    done([row], f"{case.kind} x{case.imbalance:g} {provider}")
                    continue
                lctx = contexts[name]
                try:
                    prints[name] = _pack_check(ctx, lctx, inp, name == "per_layer", stream,
                                               row)
                    row.scratch_gib = _gib(dm.plan_memory(budget[name],
                                                          bg.world_size).scratch_bytes)
                    step = pack_step(lctx, inp, per_layer=name == "per_layer", stream=stream)
                    res = benchmark_modes(step, timing=plan.timing_mode, config=plan.timing,
                                          group=group, device=dev)
                    rows = cli.case_rows(row, res)
                    flops, hbm = _pack_work(case, inp, bg.world_size)
                    for r in rows:
                        r.tflops = models.per_second(flops, r.iter_ms) / 1e12
                        r.hbm_gbps = models.per_second(hbm, r.iter_ms) / 1e9
                        if ctx.dense_tflops:
                            r.pct_dense = 100.0 * r.tflops / ctx.dense_tflops
                except Exception as exc:
                    row.status, row.note = "failed", report.error_text(exc)
                    rows = [row]
                    prints.pop(name, None)
                if name == "per_layer" and "shared" in prints and name in prints:
                    agree = "yes" if prints["shared"] == prints[name] else "no"
                    for r in rows:
                        r.plans_agree = agree
                for r in rows:
                    if r.status == "ok":
                        r.note = "; ".join(n for n in (*notes, r.note, _mem_note(ctx)) if n)
                    r.case_seconds = time.perf_counter() - start
                done(rows, f"{case.kind} x{case.imbalance:g} {provider}")
            del inp
            cli._free(dev)
    finally:
        for lctx in contexts.values():
            try:
                lctx.close()
            except Exception:
                pass
        del weights
        cli._free(dev)


def _pack_check(ctx, lctx, inp: PackInputs, per_layer: bool, stream, row) -> list:
    """The untimed eager step: phase memory (CUDA), what each layer kept, fingerprints of
    every layer's output and gradients (compared between the plans)."""
    cuda = ctx.device.type == "cuda"
    prints: list = []
    flags: list = []
    peaks: dict[str, int] = {}
    extra = _untracked(lctx)

    def observe(phase, layer, value):
        if phase == "routed":
            flags.append(value.grad_fn.record.flags)
        elif phase == "y":
            prints.append(("y", layer, fingerprint(value)))
        elif phase == "fwd_done" and cuda:
            torch.cuda.synchronize()
            peaks["fwd"] = torch.cuda.max_memory_allocated(ctx.device) + extra
            torch.cuda.reset_peak_memory_stats(ctx.device)
        elif phase == "grads":
            prints.append(("grads", layer, tuple(fingerprint(g) for g in value)))

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(ctx.device)
    pack_step(lctx, inp, per_layer=per_layer, stream=stream, observe=observe)()
    if cuda:
        torch.cuda.synchronize()
        peaks["bwd"] = torch.cuda.max_memory_allocated(ctx.device) + extra
        row.peak_fwd_gib, row.peak_bwd_gib = _gib(peaks["fwd"]), _gib(peaks["bwd"])
        row.peak_mem_gib = max(row.peak_fwd_gib, row.peak_bwd_gib)
    row.kept = "".join("I" if f[0] else "X" if f[1] else "R"
                       for f in (t.tolist() for t in flags))
    return prints
