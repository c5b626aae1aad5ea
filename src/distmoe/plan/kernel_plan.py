"""The kernel plan: every kernel and launch config one layer's calls use, as plain data.

:func:`plan_kernels` is the one place that plans a layer: given its config (widths, expert
count, top-k, token bound, mode), the expert-parallel size and the device class, it returns a
:class:`KernelPlan`. The plan depends on configured bounds only (rows per local expert
``T_max * K / E_local``), never on routed counts, so it is computed once per context and the
same kernels run whatever the routing, in CUDA graphs too. Two choices depend on the call
(the token count): whether an EP > 1 forward copies every peer token
(:func:`distmoe.plan.rules.pull_all`) and, with that copy, whether W13 runs in two launches
around its join; :meth:`KernelPlan.describe` shows them for a given token count.

Overrides (``MoEContext(cfg, group, overrides={...})``, ``python -m distmoe ab``) replace
entries of the plan: a kernel key maps to a dict of that kernel's config fields (or a whole
config), ``"layer"`` to the layer switches. An override that cannot apply is refused with a
``ValueError`` before any buffer exists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..config import MoEConfig
from ..kernels.base.device import device_memory_bytes
from ..kernels.base.gluon import gluon_device_reason
from ..kernels.mega.gluon import FusedConfig
from ..kernels.movement.combine import CombineConfig
from ..kernels.w2_dgrad.config import W2DgradConfig
from ..kernels.w2_forward.config import W2Config
from ..kernels.w13_dgrad.config import W13DgradConfig
from ..kernels.w13_forward.config import W13Config
from ..kernels.wgrad.config import WgradConfig
from ..memory import rows_in_place
from . import rules
from .thresholds import DEVICE_CLASSES, HBM3E_MEMORY_BYTES, DeviceClass

#: kernel keys of a plan and of an override, with their config class and whether only a
#: training context runs them
KERNELS: dict[str, tuple[type, bool]] = {
    "w13": (W13Config, False),
    "w2": (W2Config, False),
    "combine": (CombineConfig, False),
    "w2_dgrad": (W2DgradConfig, True),
    "w13_dgrad": (W13DgradConfig, True),
    "w2_wgrad": (WgradConfig, True),
    "w13_wgrad": (WgradConfig, True),
}

#: the layer switches an override's ``"layer"`` dict may set: name -> (types, what it is)
LAYER_SWITCHES: dict[str, tuple[tuple[type, ...], str]] = {
    "pull_all": ((bool, type(None)), "EP > 1: copy every peer token (True), the named ones "
                 "(False), or the per-call rule (None)"),
    "w13_phases": ((bool, type(None)), "EP > 1 with every peer token copied: W13 in two "
                   "launches around the copy's join (True / False), or the rule (None)"),
    "w13_phase_waves": ((int, type(None)), "waves of the first of those launches (None: "
                        "estimated from the copy and tile costs)"),
    "mega": ((bool,), "W13 and W2 as one persistent kernel (EP > 1 inference, a GPU per "
             "rank, Hopper)"),
    "mega_lag": ((int,), "row-block groups between a group's W13 and W2 tiles in Mega"),
    "mega_pingpong": ((bool,), "Mega's tiles: ping-pong (True) or cooperative (False)"),
    "mega_dynamic": ((bool,), "Mega's tiles handed out at run time (True) or static"),
    "fp8_operands": ((bool, type(None)), "NVFP4 / MXFP4 inference: FP8 activations and the "
                     "weights expanded to E4M3 (True), bf16 activations (False), or the rule "
                     "(None)"),
}


def device_class(device: torch.device | str | None) -> DeviceClass:
    """The plan's device class of ``device`` (see :mod:`distmoe.plan.thresholds`): ``"h100"``
    or ``"h200"`` for a compute-capability-9 CUDA device where the Gluon kernels run (by
    memory size), else ``"generic"``. Reads the driver's cached properties; no
    synchronisation."""
    if device is None:
        return "generic"
    device = torch.device(device)
    if device.type != "cuda" or gluon_device_reason(device) is not None:
        return "generic"
    return "h200" if device_memory_bytes(device) >= HBM3E_MEMORY_BYTES else "h100"


@dataclass(frozen=True, kw_only=True)
class LayerSwitches:
    """The layer-level choices of a plan (see :data:`LAYER_SWITCHES`)."""

    pull_all: bool | None = None
    w13_phases: bool | None = None
    w13_phase_waves: int | None = None
    mega: bool = False
    mega_lag: int = 3
    mega_pingpong: bool = True
    mega_dynamic: bool = False
    fp8_operands: bool | None = None


@dataclass(frozen=True, kw_only=True)
class KernelPlan:
    """Every kernel and launch config of one layer (frozen, plain data).

    Attributes:
        device_class: ``"h100"``, ``"h200"`` or ``"generic"``.
        rows_per_expert: the shape key ``max(1, T_max * K // E_local)``.
        ep_size: the expert-parallel size planned for.
        training: whether the backward entries are planned.
        w13, w2, combine: the forward's configs.
        w2_dgrad, w13_dgrad, w2_wgrad, w13_wgrad: the backward's (``None`` in inference).
        layer: the layer switches.
        mega_config: Mega's config where ``layer.mega`` is on, else ``None``.
        overridden: the override keys applied (``"w13"``, ``"layer.pull_all"``, ...).
    """

    device_class: DeviceClass
    rows_per_expert: int
    ep_size: int
    training: bool
    w13: W13Config
    w2: W2Config
    combine: CombineConfig
    w2_dgrad: W2DgradConfig | None = None
    w13_dgrad: W13DgradConfig | None = None
    w2_wgrad: WgradConfig | None = None
    w13_wgrad: WgradConfig | None = None
    layer: LayerSwitches = LayerSwitches()
    mega_config: FusedConfig | None = None
    overridden: tuple[str, ...] = ()

    def kernels(self) -> dict[str, Any]:
        """The planned configs by kernel key (training-only keys absent in inference)."""
        out = {}
        for key in KERNELS:
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out

    def describe(self, cfg: MoEConfig | None = None, tokens: int | None = None) -> str:
        """A readable table of the plan; with ``cfg`` and ``tokens`` (the call's token count,
        default ``cfg.max_tokens``) also the per-call choices."""
        lines = [f"kernel plan: device class {self.device_class}, EP={self.ep_size}, "
                 f"{'training' if self.training else 'inference'}, "
                 f"{self.rows_per_expert} rows per local expert (T_max*K/E_local)"]
        for key, config in self.kernels().items():
            mark = " (override)" if key in self.overridden else ""
            lines.append(f"  {key:<10} {_kernel_name(key, config)}{mark}")
            lines.append(f"             {_fields_text(config)}")
        switches = _fields_text(self.layer)
        lines.append(f"  layer      {switches}")
        if self.mega_config is not None:
            lines.append(f"  mega       {_fields_text(self.mega_config)}")
        if cfg is not None and self.ep_size > 1:
            t = cfg.max_tokens if tokens is None else tokens
            pull = self.pulls_all(cfg, t)
            lines.append(f"  call with T={t}: "
                         f"{'every peer token copied' if pull else 'named peer tokens pulled'}"
                         f"{', W13 in two launches' if pull and self.phased_w13(cfg) else ''}")
        return "\n".join(lines)

    def pulls_all(self, cfg: MoEConfig, tokens: int) -> bool:
        """Whether a call of ``tokens`` tokens copies every peer token (the override, else
        :func:`distmoe.plan.rules.pull_all`)."""
        if self.layer.pull_all is not None:
            return self.layer.pull_all
        return rules.pull_all(ep_size=self.ep_size, top_k=cfg.top_k, tokens=tokens,
                              max_tokens=cfg.max_tokens, device_class=self.device_class)

    def fp4_fp8_operands(self, cfg: MoEConfig) -> bool:
        """Whether an NVFP4 / MXFP4 inference layer runs its GEMMs on FP8 operands (the
        override, else :func:`distmoe.plan.rules.fp4_fp8_operands`); False at every other
        precision. ValueError for the override where D or F is not a multiple of 128."""
        if cfg.precision not in ("nvfp4", "mxfp4") or cfg.training:
            return False
        if self.layer.fp8_operands:
            if cfg.hidden % 128 or cfg.ffn % 128:
                raise ValueError(
                    f"overrides['layer']['fp8_operands']: FP8 operands need hidden "
                    f"({cfg.hidden}) and ffn ({cfg.ffn}) multiples of 128 (one activation "
                    "scale per 128 values)")
            return True
        if self.layer.fp8_operands is not None:
            return False
        return rules.fp4_fp8_operands(hidden=cfg.hidden, ffn=cfg.ffn,
                                      rows_per_expert=self.rows_per_expert,
                                      device_class=self.device_class)

    def phased_w13(self, cfg: MoEConfig) -> bool:
        """Whether, with every peer token copied, W13 runs in two launches by the plan (the
        override, else :func:`distmoe.plan.rules.w13_phases`; the caller checks that the
        tiles allow it)."""
        if self.ep_size == 1:
            return False
        if self.layer.w13_phases is not None:
            return self.layer.w13_phases
        return rules.w13_phases(max_tokens=cfg.max_tokens, top_k=cfg.top_k,
                                num_experts=cfg.num_experts, device_class=self.device_class)


def _kernel_name(key: str, config) -> str:
    if key == "combine":
        return "Triton owner combine"
    if key.endswith("wgrad"):
        if not config.gluon:
            return "Triton grouped WGRAD"
        kind = ("ping-pong" if config.pingpong else "cooperative") if config.specialized \
            else "plain"
        return f"Gluon warp-specialised WGRAD, {kind} {config.block_out_m}x{config.block_out_n}"
    form = "Gluon warp-specialised" if getattr(config, "gluon", False) else "Triton"
    return f"{form} {key.replace('_', ' ').upper()}"


def _fields_text(obj) -> str:
    return ", ".join(f"{f.name}={getattr(obj, f.name)}" for f in dataclasses.fields(obj))


def plan_kernels(cfg: MoEConfig, *, ep_size: int = 1,
                 device: torch.device | str | None = None,
                 device_class: DeviceClass | None = None,
                 overrides: Mapping[str, Any] | None = None) -> KernelPlan:
    """Plan every kernel of a layer.

    Args:
        cfg: the layer.
        ep_size: the expert-parallel size (``cfg.num_experts`` divisible by it).
        device: the rank's device, which gives the device class (ignored when
            ``device_class`` is given).
        device_class: ``"h100"``, ``"h200"`` or ``"generic"`` (plan for a device that is not
            here, e.g. on a CPU for a GPU).
        overrides: entries replaced (module docstring; see :func:`apply_overrides`).

    Returns:
        The :class:`KernelPlan`. Raises ``ValueError`` for an override that cannot apply.
    """
    if not isinstance(cfg, MoEConfig):
        raise TypeError(f"cfg must be a distmoe.MoEConfig, got {type(cfg).__name__}")
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"ep_size ({ep_size!r}) must be an int >= 1")
    if device_class is None:
        device_class = _device_class_checked(device)
    elif device_class not in DEVICE_CLASSES:
        raise ValueError(f"device_class ({device_class!r}) must be one of {DEVICE_CLASSES}")
    num_experts = cfg.experts_per_rank(ep_size)
    D, F = cfg.hidden, cfg.ffn
    rows = max(1, cfg.max_tokens * cfg.top_k // num_experts)
    keys = dict(block_m=cfg.row_block, rows_per_expert=rows, device_class=device_class)
    plan = dict(
        device_class=device_class, rows_per_expert=rows, ep_size=ep_size,
        training=cfg.training,
        w13=rules.w13_forward_config(hidden=D, ffn=F, training=cfg.training,
                                     num_experts=num_experts, **keys),
        w2=rules.w2_forward_config(hidden=D, ffn=F, ep_size=ep_size, num_experts=num_experts,
                                   **keys),
        combine=rules.combine_config(hidden=D),
    )
    if cfg.training:
        plan.update(
            w2_dgrad=rules.w2_dgrad_config(hidden=D, ffn=F, num_experts=num_experts, **keys),
            w13_dgrad=rules.w13_dgrad_config(hidden=D, ffn=F, num_experts=num_experts,
                                             **keys),
            w2_wgrad=rules.wgrad_config(out_rows=D, out_cols=F, **keys),
            w13_wgrad=rules.wgrad_config(out_rows=2 * F, out_cols=D,
                                         gathered_b=rows_in_place(cfg, ep_size), **keys),
        )
    if rules.pipeline_for(cfg.pipeline, training=cfg.training, ep_size=ep_size) == "mega":
        if ep_size == 1:
            raise ValueError("pipeline 'mega' needs EP > 1 (at EP = 1 nothing crosses NVLink "
                             "for W2 to overlap): use 'staged' or 'auto'")
        plan["layer"] = LayerSwitches(mega=True)
        plan["mega_config"] = rules.mega_config()
    return apply_overrides(KernelPlan(**plan), overrides)


def _device_class_checked(device) -> DeviceClass:
    if device is not None:
        try:
            torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device ({device!r}) is not a torch device: {exc}") from None
    return device_class(device)


def apply_overrides(plan: KernelPlan, overrides: Mapping[str, Any] | None) -> KernelPlan:
    """``plan`` with ``overrides`` applied.

    ``overrides`` maps a kernel key of :data:`KERNELS` to a dict of that config's fields (or
    a whole config of its class), and ``"layer"`` to a dict of :data:`LAYER_SWITCHES`. A
    ``ValueError`` (or ``TypeError``) names the key, the field and the rule for: an unknown
    key or field, a backward kernel in an inference plan, a field value the config refuses,
    ``gluon=True`` on a device class where no Gluon kernel runs, ``block_m`` other than the
    layer's padding multiple, and Mega in a training plan or at EP=1."""
    if overrides is None:
        return plan
    if not isinstance(overrides, Mapping):
        raise TypeError(f"overrides must be a dict, got {type(overrides).__name__}")
    changes: dict[str, Any] = {}
    applied: list[str] = list(plan.overridden)
    for key, value in overrides.items():
        if key == "layer":
            changes["layer"] = _layer_override(plan, value)
            applied.extend(f"layer.{name}" for name in value)
            continue
        if key not in KERNELS:
            raise ValueError(f"overrides key ({key!r}) must be one of "
                             f"{sorted([*KERNELS, 'layer'])}")
        cls, training_only = KERNELS[key]
        if training_only and not plan.training:
            raise ValueError(f"overrides[{key!r}]: the {key} kernel runs in training only, "
                             "and this plan is for inference (cfg.training False)")
        changes[key] = _kernel_override(key, cls, getattr(plan, key), value, plan)
        applied.append(key)
    plan = dataclasses.replace(plan, **changes, overridden=tuple(applied))
    if plan.layer.mega:
        if plan.training or plan.ep_size == 1:
            raise ValueError("overrides['layer']['mega']: Mega runs in EP > 1 inference only "
                             f"so far, this plan is for EP={plan.ep_size}, "
                             f"{'training' if plan.training else 'inference'}")
        plan = dataclasses.replace(plan, mega_config=rules.mega_config(
            pingpong=plan.layer.mega_pingpong, lag=plan.layer.mega_lag,
            dynamic=plan.layer.mega_dynamic))
    return plan


def _kernel_override(key: str, cls: type, current, value, plan: KernelPlan):
    if isinstance(value, cls):
        config = value
    elif isinstance(value, Mapping):
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"overrides[{key!r}]: unknown field(s) {unknown} of "
                             f"{cls.__name__}; fields: {sorted(names)}")
        try:
            config = dataclasses.replace(current, **value)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"overrides[{key!r}] ({dict(value)}): {exc}") from None
    else:
        raise TypeError(f"overrides[{key!r}] must be a dict of {cls.__name__} fields or a "
                        f"{cls.__name__}, got {type(value).__name__}")
    if getattr(config, "gluon", False) and plan.device_class == "generic":
        raise ValueError(f"overrides[{key!r}]: gluon=True needs a Hopper device class "
                         "('h100' or 'h200'), this plan's is 'generic' (the Gluon kernels do "
                         "not run on this device)")
    block_m = getattr(config, "block_m", None)
    if key != "combine" and block_m is not None and block_m != current.block_m:
        raise ValueError(f"overrides[{key!r}]: block_m ({block_m}) must stay the layer's "
                         f"padding multiple ({current.block_m}, MoEConfig.row_block)")
    return config


def layer_switch_type_error(name: str, value) -> str | None:
    """``None`` when ``value`` has a type layer switch ``name`` (one of
    :data:`LAYER_SWITCHES`) takes, else the types it takes ("bool or None"); a bool is not
    an int here."""
    types, _ = LAYER_SWITCHES[name]
    if isinstance(value, types) and (bool in types or not isinstance(value, bool)):
        return None
    return " or ".join("None" if t is type(None) else t.__name__ for t in types)


def _layer_override(plan: KernelPlan, value) -> LayerSwitches:
    if not isinstance(value, Mapping):
        raise TypeError(f"overrides['layer'] must be a dict, got {type(value).__name__}")
    for name, v in value.items():
        if name not in LAYER_SWITCHES:
            raise ValueError(f"overrides['layer']: unknown switch {name!r}; switches: "
                             f"{sorted(LAYER_SWITCHES)}")
        names = layer_switch_type_error(name, v)
        if names is not None:
            raise TypeError(f"overrides['layer'][{name!r}] must be {names}, got {v!r}")
        if isinstance(v, int) and not isinstance(v, bool) and v < 1:
            raise ValueError(f"overrides['layer'][{name!r}] ({v}) must be >= 1")
    return dataclasses.replace(plan.layer, **value)
