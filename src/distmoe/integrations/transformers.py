"""``"distmoe"``: a Hugging Face transformers (5.x) experts implementation running on distmoe.

transformers dispatches the forward of every experts module decorated with
``@use_experts_implementation`` (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3, ...)
through its ``ExpertsInterface`` registry, by the name in ``config._experts_implementation``.
**Importing this module registers** :func:`distmoe_experts_forward` there under ``"distmoe"``
(:func:`register` does it again, idempotently), after which

    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="distmoe")
    model.set_experts_implementation("distmoe")        # or switch an existing model

runs every experts module through a :class:`distmoe.MoEContext`. docs/integrations.md is the
user page.

Shapes (legend): T tokens of this rank in one call, D hidden, F the expert FFN width, K top-k,
E global experts, E_local = E / EP experts on this rank.

What the experts module receives and holds, and what the context is called with:

    hidden_states [T, D]  model dtype    -> x_TD      bf16 (a cast where the model is not bf16)
    top_k_index   [T, K]  int64, global  -> ids_TK    as is (global expert ids)
    top_k_weights [T, K]  float          -> scores_TK as is (the context takes any float)
    gate_up_proj  [E_local, 2F, D]       -> w13 [E_local, 2, F, D] bf16: rows 0..F-1 are the
                                            gate, F..2F-1 the up projection, so a reshape is
                                            w13 (a view, no copy, for a contiguous bf16
                                            parameter)
    down_proj     [E_local, D, F]        -> w2  [E_local, D, F] bf16: the same tensor

A copy happens (every forward, inside autograd, so gradients reach the parameter in its own
dtype) only where the layout or dtype differ: a model in fp32 / fp16 casts its expert weights
and activations to bf16 (distmoe computes in bf16 with fp32 accumulation; the output is cast
back to the model's dtype), and a transposed layout (``is_transposed``: ``gate_up_proj``
[E, D, 2F], ``down_proj`` [E, F, D]) is permuted into w13 / w2. :func:`expert_weights` returns
exactly what the context gets.

Contexts: one :class:`distmoe.MoEContext` per (layer shape, process group, device, token
bound, training), built lazily on the first call that needs it and cached in this process:
the layers of a model that share a shape share it (each passes its own weights). Building one
is collective over its group. A call takes a training context (its autograd path, collective
backward) when grad mode is on and any input requires grad, else an inference context (run
inference under ``torch.no_grad()`` / ``torch.inference_mode()``; ``generate`` does). A
training context holds the state of ``max_layers_per_slot`` layers between a forward and its
backward (default: ``config.num_hidden_layers``); a forward in grad mode whose output gets no
backward keeps its layers there until :func:`reset_contexts`. :func:`close_contexts` frees them
all (collective).

Expert parallelism: by default an experts module holds all E experts and runs on a one-rank
group (the process alone where torch.distributed is not initialised). :func:`shard_experts` gives each rank of an
EP group its E / EP consecutive global experts (rank r: ``r * E_local .. (r + 1) * E_local - 1``,
the slice of ``gate_up_proj`` / ``down_proj`` along dim 0); the router still picks among all E
experts, and distmoe's own dispatch (peer memory, no all-to-all) carries each route to its
owner. transformers' own expert parallelism (``distributed_config`` / a tp_plan with EP)
is refused: use one or the other.

Experts distmoe cannot run raise ``ValueError`` naming every such feature
(:func:`unsupported_features`): expert biases (GPT-OSS), clamped or custom gating
(``limit``, an overridden ``_apply_gate``), activations other than SiLU, non-gated experts,
a post-expert norm, interleaved gate/up rows, quantised or DTensor weights, transformers'
expert parallelism.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from transformers.activations import SiLUActivation
from transformers.integrations.moe import ExpertsInterface

from ..config import MoEConfig
from ..ops import MoEContext
from ..quant.prepare import prepare_cached

#: the name under which the implementation is registered
NAME = "distmoe"

#: dtypes of expert weights and activations that are cast to bf16 (anything else is refused)
_CASTABLE = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

#: the contexts built so far, in construction order, by key (see :func:`_context`)
_CONTEXTS: dict[tuple, MoEContext] = {}


@dataclass(frozen=True, kw_only=True)
class ExpertsOptions:
    """How the contexts of a model's experts are built (:func:`shard_experts`).

    Attributes:
        max_tokens: the token bound T_max of every context (a call with more tokens per rank
            raises). ``None`` (default): the next power of two at or above each call's T, so
            calls of different lengths build (and keep) a context per power of two.
        row_block: ``MoEConfig.row_block``; ``None``: 128 on CUDA, 16 on the CPU (the Triton
            interpreter runs small tiles faster).
        device_scratch_factor: ``MoEConfig.device_scratch_factor``; ``None``: large enough
            that no route is ever dropped (``EP * min(K, E_local) / K``: the receive bound is
            every rank's every token), since a model's router may send any share of the
            tokens to one rank. A smaller factor saves memory; dropped routes then contribute
            nothing (``check=True`` raises instead).
        activation_factor: ``MoEConfig.activation_factor`` of training contexts.
        max_layers_per_slot: layers a training context keeps between forward and backward;
            ``None``: the model's ``config.num_hidden_layers``.
        check: ``MoEContext(check=...)``: every call validated and compared across ranks
            (synchronises; for debugging).
        inference_precision: ``"bf16"`` (default), or ``"mxfp8"``, ``"fp8_block"`` or
            ``"nvfp4"``: inference calls (no grad) run at that precision, on each module's
            weights prepared once per weight version (:func:`distmoe.prepare_weights`, kept
            until a parameter changes in place or is replaced).
        training_precision: ``"bf16"`` (default), ``"mxfp8"`` or ``"fp8_block"``: training
            calls run their expert GEMMs at that precision (:mod:`distmoe.ops.lowp_train`:
            bf16 parameters, quantised by the context once per weight version; bf16
            gradients).
    """

    max_tokens: int | None = None
    row_block: int | None = None
    device_scratch_factor: float | None = None
    activation_factor: float = 1.0
    max_layers_per_slot: int | None = None
    check: bool = False
    inference_precision: str = "bf16"
    training_precision: str = "bf16"

    def __post_init__(self) -> None:
        if self.training_precision not in ("bf16", "mxfp8", "fp8_block"):
            raise ValueError(f"training_precision ({self.training_precision!r}) must be "
                             "'bf16', 'mxfp8' or 'fp8_block' (nvfp4 is inference only)")
        if self.inference_precision not in ("bf16", "mxfp8", "fp8_block", "nvfp4"):
            raise ValueError(f"inference_precision ({self.inference_precision!r}) must be "
                             "'bf16', 'mxfp8', 'fp8_block' or 'nvfp4'")
        for name in ("max_tokens", "row_block", "max_layers_per_slot"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} ({value!r}) must be None or an int >= 1")
        if not isinstance(self.check, bool):
            raise TypeError(f"check must be a bool, got {type(self.check).__name__}")


@dataclass(frozen=True)
class ExpertShard:
    """The EP placement of one experts module, set by :func:`shard_experts` as its
    ``distmoe_shard`` attribute.

    Attributes:
        group: the EP process group.
        rank: this process's rank in ``group``; ep_size: the group's size.
        num_experts: E, the global experts the router chooses among.
        first_expert: global index of this rank's expert 0 (``rank * E / ep_size``).
        options: how its contexts are built.
    """

    group: dist.ProcessGroup | None  # None: no torch.distributed, this process alone
    rank: int
    ep_size: int
    num_experts: int
    first_expert: int
    options: ExpertsOptions


# ---------------------------------------------------------------------------- registration
def register() -> str:
    """Register :func:`distmoe_experts_forward` in transformers' ``ExpertsInterface`` under
    ``"distmoe"`` (idempotent; importing this module already did). Returns the name."""
    ExpertsInterface.register(NAME, distmoe_experts_forward)
    return NAME


# ---------------------------------------------------------------------------- support
def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` is an experts module of transformers' ``@use_experts_implementation``
    (the decorator sets ``has_gate`` / ``is_transposed`` and the class holds ``down_proj``)."""
    return (hasattr(module, "has_gate") and hasattr(module, "is_transposed")
            and isinstance(getattr(module, "down_proj", None), torch.Tensor))


def _is_default_gate(module: nn.Module) -> bool:
    """Whether the class keeps transformers' default gate (``act_fn(gate) * up`` on the two
    halves), which the decorator installs where a class defines none."""
    fn = getattr(type(module), "_apply_gate", None)
    return fn is None or (fn.__module__ == "transformers.integrations.moe"
                          and fn.__name__ == "_default_apply_gate")


def unsupported_features(module: nn.Module) -> list[str]:
    """The features of an experts module that distmoe cannot run, as phrases (empty: it
    runs). distmoe computes ``sum_k score_k * W2_e (silu(W_gate,e x) * (W_up,e x))``, no more."""
    out = []
    if getattr(module, "has_bias", False):
        out.append("expert biases (has_bias=True, as in GPT-OSS)")
    if not getattr(module, "has_gate", True):
        out.append("non-gated experts (has_gate=False: an activation without the SwiGLU gate)")
    if getattr(module, "limit", None) is not None:
        out.append(f"clamped activations (limit={module.limit})")
    if not _is_default_gate(module):
        out.append(f"a custom gate ({type(module).__name__}._apply_gate; distmoe computes "
                   "silu(gate) * up)")
    elif getattr(module, "has_gate", True):
        act = getattr(module, "act_fn", None)
        if not isinstance(act, (nn.SiLU, SiLUActivation)):
            name = getattr(getattr(module, "config", None), "hidden_act", None)
            out.append(f"the activation {name or type(act).__name__!r} (distmoe computes "
                       "silu(gate) * up)")
    if getattr(module, "has_post_expert_norm", False):
        out.append("a post-expert norm (has_post_expert_norm=True)")
    if not getattr(module, "is_concatenated", True):
        out.append("interleaved gate/up rows (is_concatenated=False)")
    if getattr(module, "_is_expert_parallel", False):
        out.append("transformers' own expert parallelism (its experts are DTensor shards and "
                   "its dispatch an all-to-all; use distmoe.integrations.transformers."
                   "shard_experts instead)")
    for pname in ("gate_up_proj", "down_proj"):
        p = getattr(module, pname, None)
        if p is None:
            out.append(f"no {pname} parameter")
            continue
        if type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ == "DTensor":
            out.append(f"DTensor (tensor- or expert-parallel) weights ({pname})")
        elif p.dtype not in _CASTABLE:
            out.append(f"expert weights of dtype {p.dtype} ({pname}; quantised weights)")
    return list(dict.fromkeys(out))


def check_experts(module: nn.Module) -> None:
    """``ValueError`` naming every feature of ``module`` that distmoe cannot run."""
    features = unsupported_features(module)
    if features:
        raise ValueError(f"the {NAME!r} experts implementation cannot run "
                         f"{type(module).__name__}: it has " + "; ".join(features))


# ---------------------------------------------------------------------------- weights
def expert_weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w13 [E_local, 2, F, D], w2 [E_local, D, F])``, bf16 and contiguous, as the context
    receives them from ``module`` (this rank's experts).

    A contiguous bf16 ``gate_up_proj`` [E_local, 2F, D] is viewed as w13 and ``down_proj``
    [E_local, D, F] is w2 itself: no copy, the context's kernels read the parameters. Another
    dtype is cast to bf16 and a transposed layout (``is_transposed``) permuted: copies, made
    inside autograd so that the parameters receive gradients in their own dtype."""
    gate_up, down = module.gate_up_proj, module.down_proj
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0]:
        raise ValueError(f"{type(module).__name__}: gate_up_proj {tuple(gate_up.shape)} and "
                         f"down_proj {tuple(down.shape)} must both be [E, ., .]")
    E = gate_up.shape[0]
    bf16 = torch.bfloat16
    if module.is_transposed:  # gate_up [E, D, 2F], down [E, F, D]
        D, F2 = gate_up.shape[1:]
        expected_down = (E, F2 // 2, D)
    else:  # gate_up [E, 2F, D], down [E, D, F]
        F2, D = gate_up.shape[1:]
        expected_down = (E, D, F2 // 2)
    if F2 % 2 or tuple(down.shape) != expected_down:
        raise ValueError(f"{type(module).__name__}: gate_up_proj {tuple(gate_up.shape)} and "
                         f"down_proj {tuple(down.shape)} are not a gated expert pair (expected "
                         f"down_proj {expected_down})")
    F = F2 // 2
    if module.is_transposed:
        w13 = gate_up.to(bf16).reshape(E, D, 2, F).permute(0, 2, 3, 1).contiguous()
        w2 = down.to(bf16).transpose(1, 2).contiguous()
    else:
        w13 = gate_up.to(bf16).contiguous().view(E, 2, F, D)
        w2 = down.to(bf16).contiguous()
    return w13, w2


def _weights_are_views(module: nn.Module) -> bool:
    """Whether :func:`expert_weights` returns views of the parameters (no copy)."""
    return (not module.is_transposed
            and all(p.dtype == torch.bfloat16 and p.is_contiguous()
                    for p in (module.gate_up_proj, module.down_proj)))


# ---------------------------------------------------------------------------- sharding
def _resolve_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group``, the world group by default, or ``None`` in a process without
    torch.distributed (one rank of its own: :class:`distmoe.MoEContext` runs alone)."""
    if not dist.is_initialized():
        if group is not None:
            raise RuntimeError(f"group ({group!r}) given, but torch.distributed is not "
                               "initialised in this process")
        return None
    return group if group is not None else dist.group.WORLD


def _group_size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def shard_experts(model: nn.Module, group: dist.ProcessGroup | None = None, *,
                  options: ExpertsOptions | None = None) -> list[str]:
    """*Collective in effect* (every rank of ``group`` calls it on the same model).

    Give every experts module of ``model`` (all E experts on each rank, e.g. as built or
    loaded) this rank's share of the EP group ``group`` (default: the world group): the E /
    EP consecutive global experts ``rank * E_local ..``, copied out of ``gate_up_proj`` /
    ``down_proj`` into new parameters (the full tensors are then freed unless referenced
    elsewhere; build optimizers after this), ``num_experts`` set to E_local (as
    transformers' own EP does), and ``distmoe_shard`` (:class:`ExpertShard`) recording the
    group, the global E and ``options``. A one-rank group keeps the parameters as they are
    and only records the group and options. The model's experts implementation is set to
    ``"distmoe"`` (a sharded module runs on nothing else).

    Returns the names of the modules sharded. Raises ``ValueError`` where a module has a
    feature distmoe cannot run, where E is not divisible by the group size, or where a
    module was sharded already.
    """
    options = ExpertsOptions() if options is None else options
    if not isinstance(options, ExpertsOptions):
        raise TypeError(f"options must be an ExpertsOptions or None, got "
                        f"{type(options).__name__}")
    found = [(name, m) for name, m in model.named_modules() if is_experts_module(m)]
    if not found:
        raise ValueError(f"{type(model).__name__} has no transformers experts module "
                         "(@use_experts_implementation) to shard")
    for name, m in found:  # every refusal before any module changes
        check_experts(m)
        if getattr(m, "distmoe_shard", None) is not None:
            raise ValueError(f"{name} is sharded already (distmoe_shard is set)")
    group = _resolve_group(group)
    ep_size, rank = _group_size_rank(group)
    for name, m in found:
        if m.gate_up_proj.shape[0] % ep_size:
            raise ValueError(f"num_experts ({m.gate_up_proj.shape[0]}) of {name} must be "
                             f"divisible by the EP group size ({ep_size})")
    for _, m in found:
        E = m.gate_up_proj.shape[0]
        E_local = E // ep_size
        first = rank * E_local
        if ep_size > 1:
            with torch.no_grad():
                for pname in ("gate_up_proj", "down_proj"):
                    p = getattr(m, pname)
                    mine = p.detach()[first:first + E_local].clone()
                    setattr(m, pname, nn.Parameter(mine, requires_grad=p.requires_grad))
            m.num_experts = E_local
        m.distmoe_shard = ExpertShard(group=group, rank=rank, ep_size=ep_size, num_experts=E,
                                      first_expert=first, options=options)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(NAME)
    return [name for name, _ in found]


def set_options(model: nn.Module, options: ExpertsOptions) -> int:
    """Replace the :class:`ExpertsOptions` of every experts module of ``model`` that
    :func:`shard_experts` placed (for example to train at another ``training_precision``);
    the cached contexts stay (a call whose options need another context builds it). Returns
    the number of modules changed; ``ValueError`` where none was sharded."""
    if not isinstance(options, ExpertsOptions):
        raise TypeError(f"options must be an ExpertsOptions, got {type(options).__name__}")
    changed = 0
    for m in model.modules():
        shard = getattr(m, "distmoe_shard", None)
        if shard is not None:
            m.distmoe_shard = dataclasses.replace(shard, options=options)
            changed += 1
    if not changed:
        raise ValueError(f"{type(model).__name__} has no experts module placed by "
                         "shard_experts: call shard_experts(model, group, options=...) first")
    return changed


def _shard_of(module: nn.Module) -> ExpertShard:
    """The module's :class:`ExpertShard`; an unsharded module runs on the world group, which
    must then have one rank (its experts are all here)."""
    shard = getattr(module, "distmoe_shard", None)
    if shard is not None:
        return shard
    group = _resolve_group(None)
    if _group_size_rank(group)[0] != 1:
        raise ValueError(
            f"{type(module).__name__} holds all {module.gate_up_proj.shape[0]} experts but "
            f"torch.distributed has {dist.get_world_size(group)} ranks: call distmoe."
            "integrations.transformers.shard_experts(model, group) with the expert-parallel "
            "group first (a one-rank group where every rank keeps all experts)")
    return ExpertShard(group=group, rank=0, ep_size=1, num_experts=module.gate_up_proj.shape[0],
                       first_expert=0, options=ExpertsOptions())


# ---------------------------------------------------------------------------- contexts
def _context(module: nn.Module, shard: ExpertShard, *, tokens: int, top_k: int, hidden: int,
             ffn: int, training: bool, device: torch.device, graphs: bool,
             precision: str = "bf16") -> MoEContext:
    """The cached context of this call's shape, built on first use (collective)."""
    opt = shard.options
    if opt.max_tokens is not None:
        if tokens > opt.max_tokens:
            raise ValueError(f"the call has {tokens} tokens on this rank, above max_tokens "
                             f"({opt.max_tokens}) of its ExpertsOptions")
        max_tokens = opt.max_tokens
    else:
        max_tokens = 1 << max(tokens - 1, 0).bit_length()
    E_local = shard.num_experts // shard.ep_size
    scratch = opt.device_scratch_factor
    if scratch is None:
        scratch = shard.ep_size * min(top_k, E_local) / top_k
    row_block = opt.row_block or (128 if device.type == "cuda" else 16)
    layers = opt.max_layers_per_slot
    if layers is None:
        layers = getattr(getattr(module, "config", None), "num_hidden_layers", None) or 1
    cfg = MoEConfig(hidden=hidden, ffn=ffn, num_experts=shard.num_experts, top_k=top_k,
                    max_tokens=max_tokens, training=training, row_block=row_block,
                    device_scratch_factor=float(scratch),
                    activation_factor=opt.activation_factor,
                    max_layers_per_slot=layers if training else 1, precision=precision)
    key = (cfg, shard.group, device, graphs, opt.check)
    ctx = _CONTEXTS.get(key)
    if ctx is None:
        # normal tensors even when the first call runs under inference_mode (later calls
        # outside it update the context's buffers in place)
        with torch.inference_mode(False):
            ctx = MoEContext(cfg, shard.group, device=device, graphs=graphs, check=opt.check)
        _CONTEXTS[key] = ctx
    return ctx


def cached_contexts() -> list[MoEContext]:
    """The contexts built in this process so far, in construction order."""
    return list(_CONTEXTS.values())


def reset_contexts() -> None:
    """*Collective.* Empty the activation slots of every training context (after forwards in
    grad mode whose outputs got no backward)."""
    for ctx in _CONTEXTS.values():
        if ctx.cfg.training:
            ctx.reset_slots()


def close_contexts() -> None:
    """*Collective* (every rank of every context's group, in the same order). Close every
    cached context and forget it; later calls build new ones."""
    try:
        for ctx in _CONTEXTS.values():
            ctx.close()
    finally:
        _CONTEXTS.clear()


# ---------------------------------------------------------------------------- the forward
def distmoe_experts_forward(module: nn.Module, hidden_states: torch.Tensor,
                            top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"distmoe"`` experts forward: ``hidden_states`` [T, D], ``top_k_index`` [T, K]
    (global expert ids), ``top_k_weights`` [T, K] -> [T, D] in ``hidden_states``' dtype,
    through this rank's experts' :class:`distmoe.MoEContext` (collective over its group: at
    EP > 1 every rank calls every layer, with the same T).

    Activations in another dtype than bf16 are cast to bf16 and the output cast back;
    weights per :func:`expert_weights`. Raises ``ValueError`` for what distmoe cannot run
    (:func:`unsupported_features`)."""
    check_experts(module)
    shard = _shard_of(module)
    w13, w2 = expert_weights(module)
    E_local = shard.num_experts // shard.ep_size
    if w13.shape[0] != E_local:
        raise ValueError(f"{type(module).__name__} holds {w13.shape[0]} experts, expected "
                         f"E / EP = {shard.num_experts} / {shard.ep_size} = {E_local}")
    if hidden_states.dtype not in _CASTABLE:
        raise ValueError(f"hidden_states of dtype {hidden_states.dtype}: the {NAME!r} experts "
                         "implementation takes bf16, fp16, fp32 or fp64 activations")
    if hidden_states.dim() != 2 or top_k_index.dim() != 2 or \
            top_k_index.shape != top_k_weights.shape or \
            top_k_index.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"hidden_states {tuple(hidden_states.shape)}, top_k_index "
                         f"{tuple(top_k_index.shape)} and top_k_weights "
                         f"{tuple(top_k_weights.shape)} must be [T, D], [T, K] and [T, K]")
    x_TD = hidden_states.to(torch.bfloat16).contiguous()
    ids_TK = top_k_index.contiguous()
    scores_TK = top_k_weights.contiguous()
    T, K = ids_TK.shape
    training = torch.is_grad_enabled() and any(
        t.requires_grad for t in (x_TD, scores_TK, w13, w2))
    opt = shard.options
    precision = opt.training_precision if training else opt.inference_precision
    ctx = _context(module, shard, tokens=T, top_k=K, hidden=w13.shape[3], ffn=w13.shape[2],
                   training=training, device=x_TD.device, precision=precision,
                   # captured graphs (CUDA inference) key on weight addresses: per-call
                   # copies would capture again and again
                   graphs=x_TD.device.type == "cuda" and _weights_are_views(module))
    if precision != "bf16" and not training:  # a training context quantises them itself
        w13, w2 = prepare_cached(module, w13, w2, precision,
                                 sources=(module.gate_up_proj, module.down_proj))
    y_TD = ctx(x_TD, ids_TK, scores_TK, w13, w2)
    return y_TD.to(hidden_states.dtype)


register()
