"""``python -m distmoe plan``: print an activation-memory plan (optionally draw it), or the
kernel plan.

The memory plan covers one context's activation buffer on one rank: its slots (the state
kept for backward) and its scratch. It leaves out the weights and their gradients, the
caller's tensors, the buffers on the symmetric heap that the peers read (routing, dispatch,
combine), the EP > 1 pull buffer and the W13 pointer table (docs/memory.md, section 1); the
output says so.

``--kernels`` prints the kernel plan instead (:func:`distmoe.plan.plan_kernels`): every
kernel and launch config the layer's calls use, for ``--device-class`` (default: this
machine's GPU's, ``generic`` without one), inference unless ``--training``; ``--shape NAME``
takes the layer from a bench shape. ``--rules`` prints the threshold table of the device
class (name, value, reason, evidence).

The memory subcommand builds a :class:`~distmoe.config.MoEConfig` from its flags, runs
:func:`~distmoe.memory.plan_memory` and prints the table. For training it also shows the
save/replay decisions of one slot, either for received rows read from ``--rows-json`` (a
JSON list ``[layer][rank]`` of row counts, or an object with a ``"received_rows"`` key) or
for a demo routing in which one rank per layer (rotating) receives ``--imbalance`` times the
balanced rows and the others share the rest. ``--png`` draws the regions and the per-rank
slot packing (matplotlib, Agg backend); ``--json`` writes every number.

Bad input exits with status 2 and one line ``distmoe plan: error: ...`` that names the option:
the library's messages are rewritten from its field names (``max_tokens``) to the options
(``--tokens``); the output paths (and matplotlib for ``--png``) are checked before anything
is computed; options that would have no effect are refused (the training-only budget and
decision options with ``--inference``, ``--imbalance`` with ``--rows-json``). A demo
``--imbalance`` above the receive bound is capped at it, with a note on stderr. A closed
stdout (``distmoe plan | head -1``) ends the command quietly with status 141.

With no flags it plans a Qwen3-30B-A3B-like layer (D 2048, F 768, E 128, K 8) at T 4096
tokens per rank on EP 8, four layers per slot, bf16 training. The save/replay table then
assumes the demo routing, not the balanced one, and says so: in layer l, rank ``l % EP``
receives ``f * T*K`` rows (capped at the receive bound), f cycling through ``--imbalance``
(default 1.0,1.5,1.25,1.75), and the other ranks share the rest as evenly as possible.

Wiring (done in ``distmoe/__main__.py``)::

    sub = subparsers.add_parser("plan")
    plan_cli.add_arguments(sub)
    ...
    return plan_cli.run(args)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import textwrap
from collections.abc import Sequence

from distmoe.config import PRECISIONS, MoEConfig
from distmoe.memory import (
    MemoryPlan,
    format_breakdown,
    format_bytes,
    plan_memory,
)
from distmoe.plan import DEVICE_CLASSES
from distmoe.tools import quiet_on_closed_pipe, with_options
from distmoe.tools.bench.workloads import SHAPES

DEFAULT_IMBALANCE = "1.0,1.5,1.25,1.75"
#: the layer planned when no shape option is given (Qwen3-30B-A3B-like at T 4096)
DEFAULT_LAYER = dict(hidden=2048, ffn=768, experts=128, top_k=8, tokens=4096)

#: what the memory plan counts and what it leaves out (printed under the plan's header)
COVERAGE_NOTE = (
    "Covers one context's activation buffer on one rank: its slots (state kept for backward)\n"
    "and its scratch. Not counted: the weights and their gradients, the caller's tensors, the\n"
    "symmetric-heap buffers the peers read (routing, dispatch, combine), the EP > 1 pull\n"
    "buffer, the W13 pointer table (docs/memory.md, section 1).\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``plan`` flags to ``parser``."""
    parser.description = "Print the activation-memory plan of one MoE layer configuration."
    parser.description = (
        "Print the activation-memory plan of one MoE layer configuration (one context's "
        "activation buffer on one rank: slots and scratch; not the weights, not the buffers "
        "the peers read), or with --kernels its kernel plan.")
    shape = parser.add_argument_group("layer shape")
    shape.add_argument("--shape", default=None, metavar="NAME", choices=sorted(SHAPES),
                       help="take D, F, E, K and T from a bench shape (the options below "
                            f"override it); one of {', '.join(sorted(SHAPES))}")
    shape.add_argument("--hidden", type=int, default=None, help="D, token width (2048)")
    shape.add_argument("--ffn", type=int, default=None, help="F, expert width (768)")
    shape.add_argument("--experts", type=int, default=None, help="E, global experts (128)")
    shape.add_argument("--top-k", type=int, default=None, help="K, experts per token (8)")
    shape.add_argument("--tokens", type=int, default=None, help="T_max tokens per rank (4096)")
    shape.add_argument("--ep", type=int, default=8, help="EP ranks (8)")
    shape.add_argument("--precision", choices=PRECISIONS, default="bf16")
    mode = shape.add_mutually_exclusive_group()
    mode.add_argument("--inference", action="store_true",
                      help="no backward, no saved state (the memory plan's default is "
                           "training)")
    mode.add_argument("--training", action="store_true",
                      help="forward and backward (the kernel plan's default is inference)")
    shape.add_argument("--row-block", type=int, default=128, help="GEMM row block (128)")

    kernels = parser.add_argument_group("kernel plan")
    kernels.add_argument("--kernels", action="store_true",
                         help="print the kernel plan (every kernel and launch config) "
                              "instead of the memory plan")
    kernels.add_argument("--rules", action="store_true",
                         help="print the kernel plan's thresholds of --device-class (name, "
                              "value, reason, evidence)")
    kernels.add_argument("--device-class", choices=DEVICE_CLASSES, default=None,
                         help="plan for this device class (default: this machine's GPU's; "
                              "generic without one: Triton kernels only)")
    kernels.add_argument("--call-tokens", type=int, default=None, metavar="T",
                         help="with --kernels at EP > 1: the per-call choices for a call of T "
                              "tokens (default: T_max)")

    budget = parser.add_argument_group("memory budget")
    cap = budget.add_mutually_exclusive_group()
    cap.add_argument(
        "--activation-factor",
        type=float,
        default=None,
        help="slot capacity: 0 = inputs only, 1 = balanced full save (default 1)",
    )
    cap.add_argument("--activation-bytes", type=int, default=None, help="exact slot capacity")
    budget.add_argument(
        "--device-scratch-factor",
        type=float,
        default=2.0,
        help="device receive bound in units of T*K rows (2)",
    )
    budget.add_argument(
        "--total-scratch-factor",
        type=float,
        default=None,
        help="larger receive bound; scratch beyond the device tier is host-backed (VMM)",
    )
    budget.add_argument(
        "--drop-route-outputs",
        action="store_true",
        help="saved layers keep no returned route results h3 (MoEConfig.save_route_outputs "
        "False; the backward does not read them)",
    )
    rows_mode = budget.add_mutually_exclusive_group()
    rows_mode.add_argument(
        "--regather-rows",
        action="store_true",
        help="saved layers keep their input x [T, D] instead of their gathered rows "
        "(MoEConfig.save_gathered_rows False; the backward gathers them again, or at EP=1 "
        "from 512 rows per expert reads them in place: no scratch copy)",
    )
    rows_mode.add_argument(
        "--auto-rows",
        action="store_true",
        help="each layer keeps its gathered rows where the slot has room for them, else its "
        "input x where that fits (regathered in backward), else replays "
        "(MoEConfig.save_gathered_rows='auto')",
    )
    budget.add_argument("--slots", type=int, default=None, help="activation slots (1)")
    budget.add_argument(
        "--layers-per-slot",
        type=int,
        default=None,
        help="MoE layers per slot (4, or the layer count of --rows-json)",
    )

    decide = parser.add_argument_group("save/replay decisions (training)")
    decide.add_argument(
        "--rows-json",
        default=None,
        metavar="FILE",
        help="received rows [layer][rank] (JSON) to decide save/replay for",
    )
    decide.add_argument(
        "--imbalance",
        default=None,
        help="demo routing without --rows-json: per-layer load of the hot rank in units of "
        f"T*K, comma-separated, cycled over the layers ({DEFAULT_IMBALANCE}); 'none' = off",
    )

    out = parser.add_argument_group("output")
    out.add_argument("--tensors", action="store_true", help="print tensor-by-tensor costs")
    out.add_argument("--png", default=None, metavar="FILE", help="draw the plan")
    out.add_argument("--json", default=None, metavar="FILE", help="write the numbers")


# --------------------------------------------------------------------------- helpers
def demo_rows(cfg: MoEConfig, ep_size: int, imbalance: Sequence[float]) -> list[list[int]]:
    """Demo ``[layer][rank]`` rows: in layer l, rank ``l % ep_size`` receives
    ``imbalance[l % len(imbalance)] * T * K`` rows (clipped to the receive bound) and the
    other ranks share the remaining ``ep_size * T * K`` routes as evenly as possible."""
    total = ep_size * cfg.balanced_rows
    bound = cfg.receive_bound(ep_size, total=True)
    rows = []
    for layer in range(cfg.max_layers_per_slot):
        factor = imbalance[layer % len(imbalance)]
        if ep_size == 1:
            rows.append([min(total, bound)])
            continue
        hot = min(round(factor * cfg.balanced_rows), bound, total)
        rest, extra = divmod(total - hot, ep_size - 1)
        cold = [rest + (i < extra) for i in range(ep_size - 1)]
        hot_rank = layer % ep_size
        rows.append(cold[:hot_rank] + [hot] + cold[hot_rank:])
    return rows


def _read_rows(path: str) -> list[list[int]]:
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        raise ValueError(f"--rows-json {path}: cannot read it: {exc.strerror or exc}") from None
    except ValueError as exc:  # json.JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"--rows-json {path}: not valid JSON: {exc}") from None
    if isinstance(data, dict):
        if "received_rows" not in data:
            raise ValueError(f"--rows-json {path}: an object must have a 'received_rows' key")
        data = data["received_rows"]
    if not isinstance(data, list) or not all(isinstance(r, list) for r in data):
        raise ValueError(f"--rows-json {path}: expected a list of layers, each a list of ints")
    return data


def _parse_imbalance(text: str) -> list[float] | None:
    if text.strip().lower() in ("", "none", "off"):
        return None
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"--imbalance ({text!r}) must be comma-separated numbers") from None
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise ValueError(f"--imbalance ({text!r}) values must be finite and >= 0")
    return values


def _default_imbalance(args: argparse.Namespace) -> str:
    return DEFAULT_IMBALANCE if args.imbalance is None else args.imbalance


def fill_shape(args: argparse.Namespace) -> None:
    """Fill the layer options not given: from ``--shape`` where given, else
    :data:`DEFAULT_LAYER` (idempotent)."""
    shape = SHAPES[args.shape] if getattr(args, "shape", None) else None
    from_shape = {} if shape is None else dict(
        hidden=shape.hidden, ffn=shape.ffn, experts=shape.num_experts, top_k=shape.top_k,
        tokens=shape.tokens)
    for name, value in DEFAULT_LAYER.items():
        if getattr(args, name) is None:
            setattr(args, name, from_shape.get(name, value))


def build_plan(args: argparse.Namespace) -> MemoryPlan:
    """Config, received rows and plan from parsed arguments (raises ValueError/TypeError,
    with messages that name the options)."""
    fill_shape(args)
    if args.precision == "nvfp4" and not args.inference:
        raise ValueError("--precision nvfp4 is inference only: add --inference")
    rows = _read_rows(args.rows_json) if args.rows_json else None
    layers = args.layers_per_slot
    if layers is None:
        layers = len(rows) if rows else 4
    extra = {}
    if args.activation_factor is not None:
        extra["activation_factor"] = args.activation_factor
    try:
        cfg = MoEConfig(
            hidden=args.hidden,
            ffn=args.ffn,
            num_experts=args.experts,
            top_k=args.top_k,
            max_tokens=args.tokens,
            precision=args.precision,
            training=not args.inference,
            row_block=args.row_block,
            activation_bytes=args.activation_bytes,
            device_scratch_factor=args.device_scratch_factor,
            total_scratch_factor=args.total_scratch_factor,
            num_slots=1 if args.slots is None else args.slots,
            max_layers_per_slot=layers,
            save_route_outputs=not args.drop_route_outputs,
            save_gathered_rows="auto" if args.auto_rows else not args.regather_rows,
            **extra,
        )
        cfg.check_ep_size(args.ep)
    except (ValueError, TypeError) as exc:
        raise type(exc)(with_options(str(exc))) from None
    source = ""
    if rows is not None:
        source = f"--rows-json {args.rows_json}: "
        for layer, ranks in enumerate(rows):
            if len(ranks) != args.ep:
                raise ValueError(
                    f"{source}received_rows[{layer}] ({len(ranks)} ranks) must have one row "
                    f"count per rank: --ep ({args.ep})"
                )
    elif cfg.training:
        text = _default_imbalance(args)
        imbalance = _parse_imbalance(text)
        if imbalance is not None:
            rows = demo_rows(cfg, args.ep, imbalance)
            source = f"--imbalance ({text!r}), demo routing: "
    if not cfg.training:
        rows = None
    try:
        return plan_memory(cfg, args.ep, received_rows=rows)
    except (ValueError, TypeError) as exc:
        message = with_options(str(exc))
        if "received_rows" in message:
            message = source + message
        raise type(exc)(message) from None


def rows_note(plan: MemoryPlan, args: argparse.Namespace) -> str:
    """What the save/replay table's received rows are (printed above it; '' without the
    table): the file's counts, or the demo routing of :func:`demo_rows`, which is assumed,
    not measured."""
    if plan.saves is None:
        return ""
    if args.rows_json:
        return f"Received rows from --rows-json {args.rows_json}.\n"
    text = _default_imbalance(args)
    if plan.ep_size == 1:
        return "Received rows: at EP 1 the one rank receives every route, T*K rows per layer.\n"
    default = " (the default)" if args.imbalance is None else ""
    return textwrap.fill(
        "Received rows: an assumed imbalanced demo routing, not measured and not balanced "
        "(--rows-json FILE gives real counts): in layer l, rank l % EP receives f x T*K rows, "
        f"capped at the receive bound, f cycling through --imbalance {text}{default}; the "
        "other ranks share the remaining routes as evenly as possible.", width=92,
        break_on_hyphens=False) + "\n"


def format_memory_plan(plan: MemoryPlan, args: argparse.Namespace) -> str:
    """The printed memory plan: the plan's table with :data:`COVERAGE_NOTE` under its header
    and :func:`rows_note` above the save/replay table."""
    text = str(plan)
    head, sep, rest = text.partition("\n\n")
    text = head + "\n" + COVERAGE_NOTE.rstrip("\n") + sep + rest if sep else text
    note = rows_note(plan, args)
    marker = "\nSave/replay decisions"
    if note and marker in text:
        cut = text.index(marker) + 1
        text = text[:cut] + note + text[cut:]
    return text


def imbalance_notes(plan: MemoryPlan, args: argparse.Namespace) -> list[str]:
    """One-line notes on the demo routing: ``--imbalance`` values capped at the receive
    bound, values never used (more values than layers), no effect at EP 1."""
    if plan.saves is None or args.rows_json or args.inference:
        return []
    text = _default_imbalance(args)
    imbalance = _parse_imbalance(text)
    if imbalance is None:
        return []
    cfg = plan.cfg
    layers = cfg.max_layers_per_slot
    notes = []
    if plan.ep_size == 1:
        if args.imbalance is not None:
            notes.append(
                f"--imbalance ({text!r}) has no effect at --ep 1: the one rank receives every "
                "route"
            )
        return notes
    bound = plan.receive_bound
    capped = [
        layer
        for layer in range(layers)
        if round(imbalance[layer % len(imbalance)] * cfg.balanced_rows) > bound
    ]
    if capped:
        values = sorted({imbalance[layer % len(imbalance)] for layer in capped})
        option = "--imbalance" if args.imbalance is not None else "--imbalance (default)"
        notes.append(
            f"{option} {', '.join(f'{v:g}' for v in values)} x T*K: above the receive bound "
            f"({bound:,} rows = {bound / cfg.balanced_rows:g} x T*K), so the hot rank of "
            f"{', '.join(f'L{layer}' for layer in capped)} receives {bound:,} rows (capped)"
        )
    if len(imbalance) > layers:
        notes.append(
            f"--imbalance ({text!r}) has {len(imbalance)} values but the slot has {layers} "
            f"layers: only the first {layers} are used"
        )
    return notes


# --------------------------------------------------------------------------- drawing
def draw_plan(plan: MemoryPlan, path: str) -> None:
    """Save a PNG: the region strip on top, the per-rank slot packing (or, without
    decisions, the per-layer costs) below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    saves = plan.saves
    num_ranks = saves.num_ranks if saves is not None else 0
    bottom_height = min(10.0, max(2.6, 0.42 * num_ranks + 1.9)) if saves is not None else 2.8
    fig, (ax_strip, ax_low) = plt.subplots(
        2,
        1,
        figsize=(12, 1.9 + bottom_height),
        gridspec_kw={"height_ratios": [1.35, bottom_height]},
    )
    cfg = plan.cfg
    mode = "training" if cfg.training else "inference"
    fig.suptitle(
        f"distmoe memory plan: {cfg.precision} {mode}, EP {plan.ep_size}, T {cfg.max_tokens}, "
        f"D {cfg.hidden}, F {cfg.ffn}, E {cfg.num_experts}, K {cfg.top_k}",
        fontsize=12,
        fontweight="bold",
        x=0.01,
        ha="left",
    )
    _draw_strip(ax_strip, plan)
    if saves is not None:
        _draw_packing(ax_low, plan, Patch)
    else:
        _draw_costs(ax_low, plan)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=130)
    plt.close(fig)


_SLOT_COLORS = ("#4C72B0", "#6A8FC8", "#88A9DA", "#A5C2EA")
_HOST_COLOR = "#C9A227"
_SCRATCH_COLOR = "#DD8452"


def _draw_strip(ax, plan: MemoryPlan) -> None:
    total = plan.virtual_range_bytes
    for i, region in enumerate(plan.regions):
        if region.name.startswith("slot"):
            color = _SLOT_COLORS[i % len(_SLOT_COLORS)]
        else:
            color = _HOST_COLOR if region.tier == "host" else _SCRATCH_COLOR
        hatch = "//" if region.tier == "host" else None
        ax.barh(
            0,
            region.num_bytes,
            left=region.offset_bytes,
            height=0.6,
            color=color,
            edgecolor="white",
            linewidth=1.5,
            hatch=hatch,
        )
        if region.num_bytes == 0:
            continue
        label = f"{region.name}\n{format_bytes(region.num_bytes)}"
        if region.tier == "host":
            label = f"host scratch (VMM)\n{format_bytes(region.num_bytes)}"
        if region.num_bytes / total > 0.09:
            ax.text(
                region.offset_bytes + region.num_bytes / 2,
                0,
                label,
                ha="center",
                va="center",
                fontsize=9,
                fontweight="bold",
                color="black" if region.tier == "host" else "white",
                bbox={"facecolor": color, "edgecolor": "none", "pad": 1.5}
                if region.tier == "host"
                else None,
            )
    allocation = (
        f"device allocation {format_bytes(plan.activation_buffer_bytes)} "
        f"({plan.activation_buffer_bytes:,} B) = "
    )
    if plan.slot_capacity_bytes:
        allocation += (
            f"{plan.num_slots} slot{'s' * (plan.num_slots > 1)} x "
            f"{format_bytes(plan.slot_capacity_bytes)} + "
        )
    parts = [allocation + f"device scratch {format_bytes(plan.scratch_bytes)}"]
    if plan.host_scratch_bytes:
        parts.append(f"host-backed scratch {format_bytes(plan.host_scratch_bytes)}")
    ax.set_title(
        "Activation range (offset from its base)   " + "; ".join(parts), fontsize=9.5, loc="left"
    )
    ax.set_xlim(0, total)
    ax.set_ylim(-0.5, 0.5)
    ax.set_yticks([])
    _bytes_axis(ax, total)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)


def _bytes_axis(ax, limit: int) -> None:
    """Ticks at round values of a binary unit that suits ``limit``."""
    from matplotlib.ticker import FuncFormatter, MultipleLocator

    unit, scale = "B", 1
    for name, power in (("KiB", 1), ("MiB", 2), ("GiB", 3)):
        if limit >= 2 * 1024**power:
            unit, scale = name, 1024**power
    raw = max(limit / scale / 7, 1e-9)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    ax.xaxis.set_major_locator(MultipleLocator(step * scale))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / scale:g}"))
    ax.set_xlabel(unit, fontsize=9, loc="right")
    ax.tick_params(labelsize=8)


def _draw_packing(ax, plan: MemoryPlan, patch_cls) -> None:
    import matplotlib.pyplot as plt

    saves = plan.saves
    assert saves is not None, "packing needs decisions"
    cmap = plt.get_cmap("tab10")
    capacity = saves.capacity_bytes
    most = max(capacity, *(max(s) for s in saves.saved_bytes))
    handles = []
    for layer in range(saves.num_layers):
        color = cmap(layer % 10)
        saved = saves.decisions[layer]
        for rank in range(saves.num_ranks):
            before = saves.saved_bytes[layer - 1][rank] if layer else 0
            width = saves.saved_bytes[layer][rank] - before
            ax.barh(
                rank,
                width,
                left=before,
                height=0.7,
                color=color if saved else "white",
                edgecolor=color,
                hatch=None if saved else "////",
                linewidth=1.0,
            )
        what = "full state" if saved else "replay: input kept"
        handles.append(
            patch_cls(
                facecolor=color if saved else "white",
                edgecolor=color,
                hatch=None if saved else "////",
                label=f"L{layer} {what}",
            )
        )
    # The rejected alternative of each replayed layer, drawn on the rank that decided it:
    # its full state (dashed) plus the inputs reserved for the later layers (dotted).
    # Several replayed layers decided on one rank share its band, one thin lane each.
    ghosts: dict[int, list[int]] = {}
    for layer in range(saves.num_layers):
        if not saves.decisions[layer]:
            before = saves.saved_bytes[layer - 1] if layer else (0,) * saves.num_ranks
            full = saves.full_bytes[layer]
            rank = max(range(saves.num_ranks), key=lambda r: before[r] + full[r])
            ghosts.setdefault(rank, []).append(layer)
    for rank, layers in ghosts.items():
        lane = 0.8 / len(layers)
        for k, layer in enumerate(layers):
            color = cmap(layer % 10)
            before = saves.saved_bytes[layer - 1][rank] if layer else 0
            full = saves.full_bytes[layer][rank]
            need = saves.required_bytes[layer]
            y = rank - 0.4 + (k + 0.5) * lane
            ax.barh(
                y,
                full,
                left=before,
                height=lane * 0.85,
                fill=False,
                edgecolor=color,
                linestyle="--",
                linewidth=1.2,
            )
            if need > before + full:
                ax.barh(
                    y,
                    need - before - full,
                    left=before + full,
                    height=lane * 0.85,
                    fill=False,
                    edgecolor="grey",
                    linestyle=":",
                    linewidth=1.2,
                )
            ax.text(
                need,
                y,
                f"  L{layer} full state would need {format_bytes(need)}",
                va="center",
                fontsize=8 if len(layers) < 3 else 6.5,
                color=color,
            )
            most = max(most, need * 1.25)
    if not all(saves.decisions):
        handles.append(
            patch_cls(
                fill=False,
                edgecolor="black",
                linestyle="--",
                label="rejected full state (deciding rank)",
            )
        )
    if any(not d and layer < saves.num_layers - 1 for layer, d in enumerate(saves.decisions)):
        handles.append(
            patch_cls(
                fill=False,
                edgecolor="grey",
                linestyle=":",
                label="inputs reserved for later layers",
            )
        )
    ax.axvline(capacity, color="#C44E52", linestyle="--", linewidth=1.5)
    ax.text(
        capacity,
        -0.65,
        f" slot capacity {format_bytes(capacity)}",
        color="#C44E52",
        fontsize=9,
        va="center",
        ha="left",
    )
    ax.set_ylim(saves.num_ranks - 0.4, -1.0)
    every = 1 if saves.num_ranks <= 32 else 4  # keep labels legible on large groups
    shown = [r for r in range(saves.num_ranks) if r % every == 0]
    ax.set_yticks(shown, [f"rank {r}" for r in shown], fontsize=8)
    ax.set_xlim(0, most * 1.12)
    _bytes_axis(ax, int(most * 1.12))
    choice = ", ".join(f"L{i} {'save' if d else 'replay'}" for i, d in enumerate(saves.decisions))
    ax.set_title(
        f"Slot packing per rank, layers in forward order ({choice}). Layer l saves iff "
        "max over ranks (kept + full state) + later layers' inputs <= capacity",
        fontsize=9.5,
        loc="left",
    )
    ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(0.0, -0.09 - 1.6 / max(6, 2.4 * saves.num_ranks)),
        fontsize=8,
        ncol=min(5, len(handles)),
        frameon=False,
    )
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _draw_costs(ax, plan: MemoryPlan) -> None:
    columns = [("balanced", plan.balanced_costs), ("receive bound", plan.bound_costs)]
    labels, values = [], []
    for name, c in columns:
        if plan.cfg.training:
            labels += [f"input ({name})", f"full state ({name})"]
            values += [c.input_bytes, c.full_state_bytes]
        labels.append(f"forward scratch ({name})")
        values.append(c.forward_scratch.peak_bytes)
        if c.backward_scratch is not None:
            labels.append(f"backward replay scratch ({name})")
            values.append(c.backward_scratch.peak_bytes)
    colors = ["#4C72B0" if "balanced" in lab else "#DD8452" for lab in labels]
    ax.barh(range(len(values)), values, color=colors)
    for i, v in enumerate(values):
        ax.text(v, i, f" {format_bytes(v)}", va="center", fontsize=8)
    ax.set_yticks(range(len(values)), labels, fontsize=8)
    ax.invert_yaxis()
    _bytes_axis(ax, int(max(values) * 1.15))
    ax.set_xlim(0, max(values) * 1.15)
    ax.set_title(
        f"Per-layer costs at balanced R={plan.balanced_rows:,} and at the receive bound "
        f"R={plan.receive_bound:,} rows" + ("" if plan.cfg.training else " (inference)"),
        fontsize=9.5,
        loc="left",
    )
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


# --------------------------------------------------------------------------- entry point
def check_options(args: argparse.Namespace) -> None:
    """Raise ``ValueError`` for options that would be ignored: training-only options with
    ``--inference``, ``--imbalance`` with ``--rows-json``, memory-plan options with
    ``--kernels`` / ``--rules``, kernel-plan options without them."""
    if args.kernels or args.rules:
        given = [name for name, value in (
            ("--rows-json", args.rows_json), ("--imbalance", args.imbalance),
            ("--activation-factor", args.activation_factor),
            ("--activation-bytes", args.activation_bytes), ("--slots", args.slots),
            ("--layers-per-slot", args.layers_per_slot),
            ("--total-scratch-factor", args.total_scratch_factor),
            ("--drop-route-outputs", args.drop_route_outputs),
            ("--regather-rows", args.regather_rows), ("--auto-rows", args.auto_rows),
            ("--tensors", args.tensors), ("--png", args.png), ("--json", args.json))
            if value not in (None, False)]
        if given:
            raise ValueError(f"{', '.join(given)}: memory-plan options, no effect with "
                             f"{'--kernels' if args.kernels else '--rules'}")
        if args.rules and args.kernels:
            raise ValueError("--kernels and --rules: one of them")
        return
    if args.device_class is not None or args.call_tokens is not None:
        option = "--device-class" if args.device_class is not None else "--call-tokens"
        raise ValueError(f"{option}: a kernel-plan option, no effect without --kernels "
                         "(or --rules)")
    if args.training:
        raise ValueError("--training: the memory plan is for training unless --inference "
                         "(--training is for --kernels)")
    if args.inference:
        given = []
        if args.rows_json is not None:
            given.append(f"--rows-json {args.rows_json}")
        if args.activation_factor is not None:
            given.append(f"--activation-factor {args.activation_factor:g}")
        if args.activation_bytes is not None:
            given.append(f"--activation-bytes {args.activation_bytes}")
        if args.slots is not None:
            given.append(f"--slots {args.slots}")
        if args.layers_per_slot is not None:
            given.append(f"--layers-per-slot {args.layers_per_slot}")
        if args.drop_route_outputs:
            given.append("--drop-route-outputs")
        if args.imbalance is not None:
            given.append(f"--imbalance {args.imbalance}")
        if given:
            raise ValueError(
                f"{', '.join(given)}: training only, no effect with --inference (inference "
                "keeps no state for backward); drop them or --inference"
            )
    if args.rows_json is not None and args.imbalance is not None:
        raise ValueError(
            f"--imbalance ({args.imbalance!r}) has no effect with --rows-json: the file gives "
            "the rows; drop one of them"
        )


def check_output(option: str, path: str | None) -> None:
    """Raise ``ValueError`` unless ``path`` (of ``option``) can be written as a file."""
    if path is None:
        return
    if not path:
        raise ValueError(f"{option} ({path!r}) must name a file")
    if os.path.isdir(path):
        raise ValueError(f"{option} {path}: is a directory, must be a file path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(parent):
        raise ValueError(f"{option} {path}: directory {parent} does not exist")
    if not os.path.isdir(parent):
        raise ValueError(f"{option} {path}: {parent} is not a directory")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"{option} {path}: the file is not writable")
    if not os.path.exists(path) and not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {path}: directory {parent} is not writable")


def _check_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(
            "--png needs matplotlib, which is not installed: pip install 'distmoe[tools]' "
            "(or pip install matplotlib)"
        ) from None


def local_device_class() -> str:
    """The device class of this machine's first CUDA device (``generic`` without one)."""
    import torch

    from distmoe.plan import device_class

    return device_class(torch.device("cuda", 0)) if torch.cuda.is_available() else "generic"


def format_rules(device_class: str) -> str:
    """The threshold table of ``device_class``: each threshold's name and value, its reason
    and the measurement it rests on."""
    from distmoe.plan import thresholds

    lines = [f"kernel-plan thresholds of device class {device_class} "
             "(distmoe.plan.thresholds; the rules in distmoe.plan.rules read them)"]
    if device_class == "generic":
        lines.append("  (generic: the Triton kernels only; the rows that pick Gluon options are "
                     "unused)")
    for name, row in thresholds(device_class).rows():
        lines.append(f"  {name} = {row.value}")
        lines.append(textwrap.fill(row.reason, width=96, initial_indent=" " * 6,
                                   subsequent_indent=" " * 6, break_on_hyphens=False))
        lines.append(f"      evidence: {row.evidence}")
    return "\n".join(lines)


def kernel_plan_text(args: argparse.Namespace) -> str:
    """``--kernels``: the layer's kernel plan (raises ValueError/TypeError naming the
    options)."""
    from distmoe.plan import plan_kernels

    fill_shape(args)
    if args.precision == "nvfp4" and args.training:
        raise ValueError("--precision nvfp4 is inference only: drop --training")
    try:
        cfg = MoEConfig(hidden=args.hidden, ffn=args.ffn, num_experts=args.experts,
                        top_k=args.top_k, max_tokens=args.tokens, precision=args.precision,
                        training=args.training, row_block=args.row_block,
                        device_scratch_factor=args.device_scratch_factor)
        cfg.check_ep_size(args.ep)
    except (ValueError, TypeError) as exc:
        raise type(exc)(with_options(str(exc))) from None
    call = args.call_tokens
    if call is not None and not 1 <= call <= cfg.max_tokens:
        raise ValueError(f"--call-tokens ({call}) must be in [1, --tokens ({cfg.max_tokens})]")
    dc = args.device_class or local_device_class()
    plan = plan_kernels(cfg, ep_size=args.ep, device_class=dc)
    layer = (f"{args.shape}: " if args.shape else "") + (
        f"T {cfg.max_tokens}, D {cfg.hidden}, F {cfg.ffn}, E {cfg.num_experts} "
        f"({cfg.experts_per_rank(args.ep)} per rank), K {cfg.top_k}, {cfg.precision}")
    return f"{layer}\n{plan.describe(cfg, tokens=call)}"


def run(args: argparse.Namespace) -> int:
    """Run the subcommand; returns the process exit status (0 ok, 2 bad input)."""
    if args.kernels or args.rules:
        try:
            check_options(args)
            text = (format_rules(args.device_class or local_device_class()) if args.rules
                    else kernel_plan_text(args))
        except (ValueError, TypeError) as exc:
            print(f"distmoe plan: error: {exc}", file=sys.stderr)
            return 2
        print(text)
        return 0
    try:
        check_options(args)
        check_output("--json", args.json)
        check_output("--png", args.png)
        if args.png is not None:
            _check_matplotlib()
        plan = build_plan(args)
    except (ValueError, TypeError) as exc:
        print(f"distmoe plan: error: {exc}", file=sys.stderr)
        return 2
    print(format_memory_plan(plan, args))
    if args.tensors:
        print()
        print(format_breakdown(plan.balanced_costs))
        print()
        print(format_breakdown(plan.bound_costs))
    sys.stdout.flush()
    for note in imbalance_notes(plan, args):
        print(f"distmoe plan: note: {note}", file=sys.stderr)
    option = "--json"
    try:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(plan.to_dict(), f, indent=2)
                f.write("\n")
        option = "--png"
        if args.png:
            draw_plan(plan, args.png)
    except OSError as exc:
        path = args.json if option == "--json" else args.png
        print(f"distmoe plan: error: {option} {path}: cannot write it: {exc.strerror or exc}",
              file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry (``python -m distmoe.tools.plan_cli``)."""
    parser = argparse.ArgumentParser(prog="distmoe plan")
    add_arguments(parser)
    args = parser.parse_args(argv)
    return quiet_on_closed_pipe(lambda: run(args))


if __name__ == "__main__":
    raise SystemExit(main())
