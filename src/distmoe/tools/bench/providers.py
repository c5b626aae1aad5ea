"""Benchmark providers: the implementations a case is timed on, behind one calling convention.

Every provider is a layer ``layer(x, expert_ids, scores, w13, w2) -> y`` (the distmoe public
API's signature, shared/DESIGN.md) plus facts the timer needs:

- ``"distmoe"``: ``distmoe.MoEContext(MoEConfig(...), group=pg)``, when the package has it
  (otherwise the provider is recorded as ``"unavailable"`` and skipped).
- ``"torch"``: :func:`distmoe.tools.bench.baseline.torch_moe`.
- ``"torch_compile"``: ``torch.compile`` of the same function; a compilation failure shows up
  at the first call (the harness's priming call) and is recorded as ``"failed"``.
- ``"rowwise"``: the layer written with :mod:`distmoe.rowwise` (``expert_major_rows``,
  ``dispatch_put``, ``grouped_mm`` for W13, SwiGLU in fp32, ``grouped_mm`` for W2,
  ``Buffers.write``, ``combine_get``), the lower-level API's cost against MoEContext's.
- ``"torch_fp8"``: the torch baseline's inference forward with both GEMMs on rowwise FP8
  (:func:`distmoe.tools.bench.baseline.torch_fp8_moe`, ``torch._scaled_grouped_mm``; weights
  quantised once per weight version), the baseline of issue 58's FP8 layers; EP = 1 and
  inference only (``"unavailable"`` otherwise).
- ``"transformers"``: a third-party peer, Hugging Face transformers' experts implementation
  ``"grouped_mm"`` (its Qwen3-MoE experts module, the code every transformers MoE model runs
  through ``experts_implementation``), called on the case's own weights
  (``torch.func.functional_call``: the module's parameters are meta tensors, no copy) and
  routing. One rank only (transformers' expert parallelism shards DTensors; at EP > 1 the
  provider is ``"unavailable"``), and ``"unavailable"`` where transformers does not import.

:func:`make_step` turns a layer into one timed iteration: forward under ``torch.no_grad()``
(inference) or forward plus ``torch.autograd.grad`` with respect to x, scores, w13 and w2
(training; gradients are returned, not accumulated into ``.grad``, so iterations are
independent and replayable).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from distmoe.quant.prepare import cached_per_object
from distmoe.tools.bench.baseline import (
    grouped_mm_path,
    rowwise_fp8,
    scaled_grouped_mm_path,
    torch_fp8_moe,
    torch_moe,
)
from distmoe.tools.bench.groups import BenchGroup
from distmoe.tools.bench.report import error_text
from distmoe.tools.bench.workloads import LayerInputs, MoEShape

PROVIDERS: tuple[str, ...] = ("distmoe", "torch", "torch_compile", "transformers", "rowwise",
                              "torch_fp8")
#: the bench's default providers: all but the FP8 baseline, whose peer is an FP8 distmoe
#: layer (``--providers torch_fp8`` with a low-precision case)
DEFAULT_PROVIDERS: tuple[str, ...] = PROVIDERS[:-1]

Layer = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


@dataclass
class Provider:
    """A built provider.

    Attributes:
        name: one of :data:`PROVIDERS`.
        status: ``"ok"``, ``"unavailable"`` or ``"failed"``.
        note: why it is not ok, or details (e.g. the baseline's grouped-GEMM path).
        layer: the callable (``None`` unless ok).
        graph_safe: False when the layer synchronises with the host (no CUDA-graph capture).
        baseline_path: grouped-GEMM path of the torch baseline (``""`` for distmoe).
        transport: distmoe's resolved ``MoEContext.transport`` (``""`` for the others).
    """

    name: str
    status: str
    note: str = ""
    layer: Layer | None = None
    graph_safe: bool = True
    baseline_path: str = ""
    close: Callable[[], None] = field(default=lambda: None, repr=False)
    transport: str = ""


def build_provider(
    name: str,
    *,
    shape: MoEShape,
    tokens: int,
    training: bool,
    bench_group: BenchGroup,
    device: torch.device,
    max_imbalance: float = 1.0,
    activation_factor: float | None = None,
    save_route_outputs: bool = True,
    save_gathered_rows: bool = True,
    gathered_rows_in_place: bool | None = None,
    precision: str = "bf16",
    transport: str = "auto",
) -> Provider:
    """Build provider ``name`` for one (shape, tokens, mode); never raises for provider failures.

    ``transport``: the distmoe provider's ``MoEContext(transport=)`` (``Provider.transport``
    names the one it resolved to); the other providers ignore it.

    ``precision``: the distmoe provider's :attr:`~distmoe.MoEConfig.precision` (its
    low-precision inference layer takes the case's bf16 weights prepared once per weight
    version); the other providers ignore it.

    ``max_imbalance``: the largest imbalance factor the provider will see. At EP > 1 the
    tracked rank receives that many times its balanced rows, so distmoe's receive bound
    (``device_scratch_factor``, default 2) is raised to it; otherwise routes beyond the bound
    would be dropped and the case would time less work.

    ``activation_factor``: distmoe's ``MoEConfig.activation_factor`` in training cases (None:
    the config's default); the row note names it when given. ``save_route_outputs``:
    distmoe's ``MoEConfig.save_route_outputs`` in training cases (the note says when False).
    ``save_gathered_rows`` / ``gathered_rows_in_place``: the same for those two fields (the
    note says when the input is kept, and whether the rows are then read in place).
    """
    if name not in PROVIDERS:
        raise ValueError(f"provider ({name!r}) must be one of {PROVIDERS}")
    ep_size = bench_group.world_size
    if name == "distmoe":
        return _build_distmoe(
            shape=shape,
            tokens=tokens,
            training=training,
            bench_group=bench_group,
            receive_factor=max_imbalance if ep_size > 1 else 1.0,
            activation_factor=activation_factor,
            save_route_outputs=save_route_outputs,
            save_gathered_rows=save_gathered_rows,
            gathered_rows_in_place=gathered_rows_in_place,
            precision=precision,
            transport=transport,
        )
    if name == "transformers":
        return _build_transformers(shape=shape, bench_group=bench_group, device=device)
    if name == "rowwise":
        return _build_rowwise(shape=shape, tokens=tokens, bench_group=bench_group,
                              device=device)
    if name == "torch_fp8":
        return _build_torch_fp8(training=training, bench_group=bench_group, device=device)
    path, reason = grouped_mm_path(device, torch.bfloat16)
    note = f"grouped GEMM: {path}" + (f" ({reason})" if reason else "")
    group = bench_group.group if ep_size > 1 else None
    layer: Layer = functools.partial(torch_moe, group=group, path=path)
    if name == "torch_compile":
        try:
            layer = torch.compile(layer, dynamic=False)
        except Exception as exc:
            return Provider(name=name, status="failed", note="torch.compile: " + error_text(exc))
    # EP > 1 copies split sizes to the host (.tolist()): not capturable.
    return Provider(
        name=name, status="ok", note=note, layer=layer, graph_safe=ep_size == 1, baseline_path=path
    )


def _build_torch_fp8(*, training: bool, bench_group: BenchGroup,
                     device: torch.device) -> Provider:
    if training or bench_group.world_size > 1:
        return Provider(name="torch_fp8", status="unavailable",
                        note="rowwise-FP8 torch baseline: EP = 1 inference only")
    path, reason = scaled_grouped_mm_path(device)

    def quantised(w: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        # once per weight version (as the FP8 layers' prepared weights), not per call
        return cached_per_object(layer, "_rowwise_fp8", (w,), lambda: rowwise_fp8(
            w.detach().reshape(w.shape[0], rows, -1)), size=2)

    def layer(x, ids, scores, w13, w2):
        return torch_fp8_moe(x, ids, scores, quantised(w13, 2 * w13.shape[2]),
                             quantised(w2, w2.shape[1]), path=path)

    note = f"scaled grouped GEMM: {path}" + (f" ({reason})" if reason else "")
    return Provider(name="torch_fp8", status="ok", note=note, layer=layer, baseline_path=path)


def _build_rowwise(*, shape: MoEShape, tokens: int, bench_group: BenchGroup,
                   device: torch.device) -> Provider:
    try:
        import distmoe.rowwise as rw

        ep = bench_group.world_size
        group = bench_group.group if ep > 1 else None
        # room for every route of the group on one rank (any imbalance)
        bufs = rw.Buffers(group, ep * tokens * shape.top_k, shape.hidden, device=device)
    except Exception as exc:
        return Provider(name="rowwise", status="failed", note="Buffers: " + error_text(exc))
    E, F, D = shape.num_experts, shape.ffn, shape.hidden
    e_local = E // ep

    def layer(x, expert_ids, scores, w13, w2):
        dst_ranks, dst_rows, received = rw.expert_major_rows(expert_ids, E, group)
        rows = rw.dispatch_put(x, dst_ranks, dst_rows, bufs.out)
        offs = received.cumsum(0).to(torch.int32)
        h1 = rw.grouped_mm(rows, w13.view(e_local, 2 * F, D).transpose(1, 2), offs).float()
        h2 = (torch.nn.functional.silu(h1[:, :F]) * h1[:, F:]).to(torch.bfloat16)
        h3 = rw.grouped_mm(h2, w2.transpose(1, 2), offs)
        return rw.combine_get(bufs.write("expert_out", h3), dst_ranks, dst_rows, scores)

    # EP > 1: the histogram's all_gather is a collective outside the heap (not captured)
    return Provider(name="rowwise", status="ok", layer=layer, graph_safe=ep == 1,
                    note=f"distmoe.rowwise layer, {bufs.rows} rows per rank",
                    close=bufs.close)


def _build_transformers(*, shape: MoEShape, bench_group: BenchGroup,
                        device: torch.device) -> Provider:
    if bench_group.world_size > 1:
        return Provider(name="transformers", status="unavailable",
                        note="one rank only (transformers' expert parallelism shards DTensors "
                             "and dispatches by all-to-all, outside this harness)")
    try:
        import transformers
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    except Exception as exc:
        return Provider(name="transformers", status="unavailable",
                        note="import transformers: " + error_text(exc))
    try:
        cfg = transformers.Qwen3MoeConfig(hidden_size=shape.hidden,
                                          moe_intermediate_size=shape.ffn,
                                          num_experts=shape.num_experts,
                                          num_experts_per_tok=shape.top_k)
        cfg._experts_implementation = "grouped_mm"
        with torch.device("meta"):  # shapes only: the case's weights are passed per call
            module = Qwen3MoeExperts(cfg).to(torch.bfloat16)
    except Exception as exc:
        return Provider(name="transformers", status="failed",
                        note="transformers' Qwen3MoeExperts: " + error_text(exc))
    E, F, D = shape.num_experts, shape.ffn, shape.hidden

    def layer(x, expert_ids, scores, w13, w2):
        # gate_up_proj [E, 2F, D] (gate rows first) is w13 [E, 2, F, D] viewed; down_proj
        # [E, D, F] is w2
        params = {"gate_up_proj": w13.view(E, 2 * F, D), "down_proj": w2}
        y = torch.func.functional_call(module, params, (x, expert_ids.long(), scores))
        return y.to(x.dtype)

    return Provider(name="transformers", status="ok", layer=layer,
                    note=f"transformers {transformers.__version__} experts_implementation="
                         "'grouped_mm' (Qwen3MoeExperts)")


def _build_distmoe(
    *, shape: MoEShape, tokens: int, training: bool, bench_group: BenchGroup, receive_factor: float,
    activation_factor: float | None = None, save_route_outputs: bool = True,
    save_gathered_rows: bool = True, gathered_rows_in_place: bool | None = None,
    precision: str = "bf16", transport: str = "auto",
) -> Provider:
    try:
        import distmoe as dm
    except Exception as exc:
        return Provider(
            name="distmoe", status="unavailable", note="import distmoe: " + error_text(exc)
        )
    if not hasattr(dm, "MoEContext") or not hasattr(dm, "MoEConfig"):
        return Provider(
            name="distmoe",
            status="unavailable",
            note="distmoe.MoEContext is not available in this build",
        )
    kwargs = {}
    fields = getattr(dm.MoEConfig, "__dataclass_fields__", {})
    if receive_factor > 2.0 and "device_scratch_factor" in fields:
        kwargs["device_scratch_factor"] = float(receive_factor)
    notes = []
    if training and activation_factor is not None and "activation_factor" in fields:
        kwargs["activation_factor"] = float(activation_factor)
        notes.append(f"activation_factor={activation_factor:g}")
    if training and not save_route_outputs and "save_route_outputs" in fields:
        kwargs["save_route_outputs"] = False
        notes.append("no route outputs in the slot")
    kept_x = training and not save_gathered_rows and "save_gathered_rows" in fields
    if kept_x:
        kwargs["save_gathered_rows"] = False
        if "gathered_rows_in_place" in fields:
            kwargs["gathered_rows_in_place"] = gathered_rows_in_place
    try:
        cfg = dm.MoEConfig(
            hidden=shape.hidden,
            ffn=shape.ffn,
            num_experts=shape.num_experts,
            top_k=shape.top_k,
            max_tokens=tokens,
            precision=precision,
            training=training,
            row_block=128,
            **kwargs,
        )
        if kept_x:
            from distmoe.memory import rows_in_place

            in_place = rows_in_place(cfg, bench_group.world_size)
            notes.append(f"input kept, rows {'read in place' if in_place else 'copied'}")
        note = "; ".join(notes)
        ctx = dm.MoEContext(cfg, group=bench_group.group, transport=transport)
    except Exception as exc:
        return Provider(name="distmoe", status="failed", note="MoEContext: " + error_text(exc),
                        transport=transport)
    layer: Layer = ctx
    if precision != "bf16" and not training:
        from distmoe.quant.prepare import prepare_cached

        def layer(x, ids, scores, w13, w2, ctx=ctx):
            # prepared once per weight version, as a user prepares a checkpoint
            return ctx(x, ids, scores, *prepare_cached(layer, w13, w2, precision))

        note = "; ".join(filter(None, [note, f"precision {precision}"]))
    elif precision != "bf16":
        note = "; ".join(filter(None, [note, f"precision {precision}"]))
    return Provider(
        name="distmoe",
        status="ok",
        note=note,
        layer=layer,  # every precision captures (its own graphs step aside in a capture)
        close=getattr(ctx, "close", lambda: None),
        transport=ctx.transport,
    )


def make_step(layer: Layer, inputs: LayerInputs, mode: str) -> Callable[[], None]:
    """One iteration of ``mode`` (``"fwd"`` or ``"fwdbwd"``) on fixed inputs; returns nothing."""
    args = (inputs.x_TD, inputs.expert_ids_TK, inputs.scores_TK, inputs.w13_e2FD, inputs.w2_eDF)
    if mode == "fwd":

        def step() -> None:
            with torch.no_grad():
                layer(*args)

        return step
    if mode != "fwdbwd":
        raise ValueError(f"mode ({mode!r}) must be 'fwd' or 'fwdbwd'")
    wrt = (inputs.x_TD, inputs.scores_TK, inputs.w13_e2FD, inputs.w2_eDF)

    def step() -> None:
        y = layer(*args)
        torch.autograd.grad(y, wrt, inputs.grad_y_TD)

    return step
