"""MoEExperts: one rank's routed experts as an ``nn.Module``, checkpointed in global numbering.

The module owns this rank's slice of the layer's expert weights and calls
:class:`distmoe.MoEContext` with them; everything else (dispatch, GEMMs, combine, autograd)
is the context's. Rank r of an EP group of size EP owns the global experts
``r * E_local .. (r + 1) * E_local - 1`` with ``E_local = num_experts / EP``.

Parameters (this rank's experts, local index i = global index - r * E_local):

    w13  [E_local, 2, F, D] bf16   gate = w13[i, 0], up = w13[i, 1]
    w2   [E_local, D, F] bf16      down projection

and, with ``shared_ffn=F_s`` (a shared expert, replicated: the same on every rank),

    shared_w13    [2, F_s, D] bf16   gate = shared_w13[0], up = shared_w13[1]
    shared_w2     [D, F_s] bf16      down projection
    shared_gate_w [1, D] bf16        with ``shared_gate=True``: y_shared *= sigmoid(x @ g^T)

Initialisation: every element is drawn from N(0, init_std^2) (``init_std`` defaults to 0.02,
the ``initializer_range`` of the common Hugging Face MoE models, which initialise their
expert Linear weights that way), in fp32 on the CPU, then rounded to bf16. Each global expert
e has its own generator, seeded from ``(seed, e)``: expert e holds the same bits whatever the
EP size, and building the module draws nothing but the base seed from torch's default
generator (so ``torch.manual_seed`` governs it, and successive layers differ). The shared
expert draws ``shared_w13``, ``shared_w2`` then ``shared_gate_w`` the same way from the
generator of index E (``expert_seed(seed, num_experts)``, as if it were one more expert):
the same bits on every rank and at every EP size.

State dict (sharded, in global numbering; no collective): under the module's prefix, one
entry per expert this rank owns,

    {e}.w13  [2, F, D] bf16        {e}.w2  [D, F] bf16          e = global expert index

plus, with a shared expert, on every rank (it is replicated)

    shared.w13  [2, F_s, D] bf16   shared.w2  [D, F_s] bf16   shared.gate  [1, D] bf16 (gated)

so a module registered as ``mlp.experts`` saves ``mlp.experts.5.w13``, beside where a
Hugging Face checkpoint keeps ``mlp.experts.5.gate_proj.weight``. Why per expert rather than
the full ``[E, ...]`` tensors: saving then needs no all-gather (``state_dict()`` stays local
and cannot deadlock when one rank saves alone), no rank ever holds more than its own
experts, and the union of the ranks' dicts *is* the full checkpoint: its keys do not depend
on the EP size (the ``shared.*`` keys come from every rank with the same values, as long as
the caller keeps the replicas in step; any one rank's will do). The tensors are views of the
parameters (as ``nn.Module.state_dict`` returns its parameters, no copy); serialisers that
refuse tensors sharing storage (safetensors) want ``{k: v.clone() for k, v in sd.items()}``.

Loading (``load_state_dict``, strict or not, through ``nn.Module``'s machinery) takes this
rank's experts from either form and ignores the others':

* the per-expert keys above, from any EP size (each rank finds its own experts' keys in a
  merged dict, or in the dict of any rank that held them);
* the fused full tensors ``w13`` [E, 2, F, D] and ``w2`` [E, D, F] (each rank copies its
  slice), as a single-process model keeps them; where an expert's per-expert key is also
  present, the per-expert key wins;
* the ``shared.*`` keys (every rank loads them), which a module without a shared expert, or
  without its gate, reports as unexpected.

With ``strict=True`` a missing expert is reported by its per-expert key name, a key under
the prefix that is neither form (or names an expert outside [0, E)) as unexpected, and a
tensor of the wrong shape as an error naming the key and the expected shape. Values are
copied into the existing parameters (converted to bf16; ``assign=True`` is not honoured:
the parameters keep their storage, which the context's calls read).

:meth:`MoEExperts.load_hf_experts` maps the per-expert Linear layout of Hugging Face MoE
checkpoints (``{e}.gate_proj.weight`` [F, D], ``{e}.up_proj.weight`` [F, D],
``{e}.down_proj.weight`` [D, F]; Mixtral's ``w1``/``w3``/``w2`` through ``names=``) into
w13/w2, and :meth:`MoEExperts.load_hf_shared_expert` the shared expert's
(``shared_expert.gate_proj/up_proj/down_proj`` and ``shared_expert_gate`` of Qwen2-MoE,
``shared_experts.*`` of DeepSeek-V3).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..config import MoEConfig
from ..ops import MoEContext
from ..ops.custom_ops import tracing
from ..quant.prepare import prepare_cached
from .shared_expert import with_shared_expert

#: per-expert state-dict suffixes and their shapes as functions of (F, D)
_EXPERT_SHAPES = {
    "w13": lambda F, D: (2, F, D),
    "w2": lambda F, D: (D, F),
}
_SHAPE_NAMES = {"w13": "[2, F, D]", "w2": "[D, F]", "w13_full": "[E, 2, F, D]",
                "w2_full": "[E, D, F]"}
#: the shared expert's state-dict keys: (parameter, shape name)
_SHARED_KEYS = {"shared.w13": ("shared_w13", "[2, F_s, D]"),
                "shared.w2": ("shared_w2", "[D, F_s]"),
                "shared.gate": ("shared_gate_w", "[1, D]")}


def expert_seed(seed: int, expert: int) -> int:
    """The generator seed of global expert ``expert`` under base seed ``seed`` (a 63-bit
    mix, the same on every rank and at every EP size)."""
    mixed = (seed * 0x9E3779B97F4A7C15 + expert * 0xBF58476D1CE4E5B9 + 1) % (1 << 64)
    mixed ^= mixed >> 31
    return mixed % (1 << 63)


class MoEExperts(nn.Module):
    """This rank's routed experts of one MoE layer (see the module docstring).

    Args:
        cfg: the layer (:class:`distmoe.MoEConfig`). At a low precision the parameters stay
            bf16; an inference forward runs on their prepared form, quantised once per weight
            version (:meth:`expert_weights`), a training context quantises them itself.
        group: the expert-parallel process group (default: the world group; a one-rank
            "group" when torch.distributed is not initialised).
        device: where the parameters and the context live (default: the context's device:
            the current CUDA device, else the CPU).
        dtype: the parameters' dtype; only ``torch.bfloat16`` (the layer computes in bf16).
        context: a :class:`distmoe.MoEContext` to share (one context serves a stack of
            layers of the same shape: each layer passes its own weights). Its ``cfg`` must
            equal ``cfg``; ``group`` and ``device``, if given, must be the context's. The
            module then does not close it. Default: the module builds one (collective: every
            rank of the group builds its module in the same order) and closes it in
            :meth:`close`.
        init_std: standard deviation of the normal initialisation (default 0.02).
        seed: base seed of the initialisation (default: drawn from torch's default CPU
            generator, so every rank must have seeded it alike, e.g. ``torch.manual_seed``,
            for a consistent global init; only a concern if weights are not loaded).
        shared_ffn: the width F_s of an optional shared expert (default ``None``: none);
            an int >= 1.
        shared_gate: with a shared expert, scale its output by a per-token sigmoid gate
            (Qwen2-MoE's ``shared_expert_gate``; default ``False``: DeepSeek-V3's ungated
            shared experts, whose ``n_shared_experts`` concatenate into one of width
            ``n_shared_experts * moe_intermediate_size``).

    Shared expert (``shared_ffn``): a dense SwiGLU branch every token goes through, added to
    the routed output, ``y = routed + s * (silu(x g^T) * (x u^T)) @ d^T`` with ``s = 1`` or
    ``sigmoid(x @ shared_gate_w^T)`` (:mod:`distmoe.nn.shared_expert`: torch matmuls, the
    SwiGLU in fp32 rounded once like the routed layer's h2, and the add in fp32 with one bf16
    rounding of y; the routed output is itself the layer's bf16 rounding of its combine). On
    CUDA it runs beside the routed call, on a side stream forked from the current stream
    before it and joined after it (no host sync; autograd runs its backward on that stream
    too); on the CPU and under tracing (torch.compile, make_fx) inline. Its parameters are
    replicated, not sharded: each rank computes it for its own tokens, so its gradients
    (``.grad``, bf16, also when the context has ``main_grad``) are this rank's part only,
    and the caller sums them over the EP group, like any replicated parameter (a data-parallel
    wrapper over the ranks that hold different tokens does; :meth:`shared_parameters` lists
    them). This is what DeepSeek-style training does (Megatron-LM treats the shared expert as
    a dense layer, reduced over the data-parallel group that spans the EP ranks, while routed
    experts reduce over the expert-data-parallel group only; its option
    ``moe_shared_expert_overlap`` overlaps the shared expert with the token dispatch as here).

    Attributes:
        w13: ``nn.Parameter`` bf16 [E_local, 2, F, D]; gate ``w13[i, 0]``, up ``w13[i, 1]``.
        w2: ``nn.Parameter`` bf16 [E_local, D, F].
        shared_w13, shared_w2, shared_gate_w: the shared expert's ``nn.Parameter``s
            ([2, F_s, D], [D, F_s], [1, D]), or ``None`` where absent.
        shared_ffn, shared_gate: as given.
        context: the :class:`distmoe.MoEContext` the forward calls.
        first_expert: global index of local expert 0 (``rank * E_local``).
        num_local_experts: E_local.
    """

    def __init__(self, cfg: MoEConfig, group: dist.ProcessGroup | None = None, *,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.bfloat16, context: MoEContext | None = None,
                 init_std: float | None = None, seed: int | None = None,
                 shared_ffn: int | None = None, shared_gate: bool = False) -> None:
        super().__init__()
        if not isinstance(cfg, MoEConfig):
            raise TypeError(f"cfg must be a distmoe.MoEConfig, got {type(cfg).__name__}")
        if shared_ffn is not None:
            if isinstance(shared_ffn, bool) or not isinstance(shared_ffn, int):
                raise TypeError(f"shared_ffn must be an int or None, got "
                                f"{type(shared_ffn).__name__} ({shared_ffn!r})")
            if shared_ffn < 1:
                raise ValueError(f"shared_ffn ({shared_ffn}) must be >= 1 (the shared "
                                 "expert's width F_s), or None for no shared expert")
        if not isinstance(shared_gate, bool):
            raise TypeError(f"shared_gate must be a bool, got {type(shared_gate).__name__} "
                            f"({shared_gate!r})")
        if shared_gate and shared_ffn is None:
            raise ValueError("shared_gate=True needs a shared expert: give shared_ffn (its "
                             "width F_s)")
        if dtype != torch.bfloat16:
            raise ValueError(f"dtype ({dtype}) must be torch.bfloat16: the layer computes in "
                             "bf16 only")
        if init_std is None:
            init_std = 0.02
        if isinstance(init_std, bool) or not isinstance(init_std, (int, float)) \
                or not init_std >= 0:
            raise ValueError(f"init_std ({init_std!r}) must be a number >= 0")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__} "
                            f"({seed!r})")
        if context is not None:
            if not isinstance(context, MoEContext):
                raise TypeError("context must be a distmoe.MoEContext or None, got "
                                f"{type(context).__name__}")
            context.check_open()
            if context.cfg != cfg:
                raise ValueError(f"context.cfg ({context.cfg}) must equal cfg ({cfg}): a "
                                 "shared context serves layers of the same shape")
            if group is not None and group is not context.group:
                raise ValueError("group must be None or the context's group when context is "
                                 "given")
            if device is not None and torch.device(device) != context.device:
                raise ValueError(f"device ({device!r}) must be None or the context's device "
                                 f"({context.device}) when context is given")
            self._owns_context = False
        else:
            context = MoEContext(cfg, group, device=device)
            self._owns_context = True
        self.cfg = cfg
        self.context = context
        self.init_std = float(init_std)
        self.seed = int(torch.randint(0, 1 << 62, (), dtype=torch.int64)) if seed is None \
            else seed
        self.num_local_experts = context.num_local_experts
        self.first_expert = context.rank * self.num_local_experts
        E_local, F, D = self.num_local_experts, cfg.ffn, cfg.hidden
        dev = context.device
        self.w13 = nn.Parameter(torch.empty(E_local, 2, F, D, dtype=dtype, device=dev))
        self.w2 = nn.Parameter(torch.empty(E_local, D, F, dtype=dtype, device=dev))
        self.shared_ffn = shared_ffn
        self.shared_gate = shared_gate
        shapes = {"shared_w13": (2, shared_ffn, D), "shared_w2": (D, shared_ffn),
                  "shared_gate_w": (1, D) if shared_gate else None}
        for name, shape in shapes.items():
            self.register_parameter(name, None if shared_ffn is None or shape is None else
                                    nn.Parameter(torch.empty(shape, dtype=dtype, device=dev)))
        # the shared expert's side stream (CUDA only; a handle, no device work)
        self._shared_stream = (torch.cuda.Stream(dev) if shared_ffn is not None
                               and dev.type == "cuda" else None)
        self.reset_parameters()

    # ------------------------------------------------------------------ parameters
    @property
    def global_experts(self) -> range:
        """The global indices of this rank's experts."""
        return range(self.first_expert, self.first_expert + self.num_local_experts)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw every local expert's weights again (see the module docstring): each global
        expert from its own generator, the same bits at every EP size."""
        F, D = self.cfg.ffn, self.cfg.hidden
        for i, e in enumerate(self.global_experts):
            g = torch.Generator().manual_seed(expert_seed(self.seed, e))
            self.w13[i].copy_(torch.randn(2, F, D, generator=g).mul_(self.init_std))
            self.w2[i].copy_(torch.randn(D, F, generator=g).mul_(self.init_std))
        if self.shared_ffn is not None:
            g = torch.Generator().manual_seed(expert_seed(self.seed, self.cfg.num_experts))
            for p in self.shared_parameters():
                p.copy_(torch.randn(p.shape, generator=g).mul_(self.init_std))

    def shared_parameters(self) -> list[nn.Parameter]:
        """The shared expert's parameters (replicated: their gradients are this rank's part,
        for the caller to sum over the EP group); empty without a shared expert."""
        return [p for p in (self.shared_w13, self.shared_w2, self.shared_gate_w)
                if p is not None]

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor,
                scores: torch.Tensor) -> torch.Tensor:
        """``y = context(x, expert_ids, scores, w13, w2)``, plus the shared expert's output
        if there is one (see the class docstring): x [T, D] bf16, expert_ids [T, K]
        integer (global ids, -1 inactive), scores [T, K] float; returns y [T, D] bf16.
        Collective (every rank calls it); with ``cfg.training`` and grad mode on, y has a
        grad_fn and its backward (collective too) fills ``w13.grad`` / ``w2.grad`` (and the
        shared expert's ``.grad``, which the routed layer's ``cfg.training`` does not gate:
        it follows grad mode like any torch op)."""
        w13, w2 = self.expert_weights()
        if self.shared_ffn is None:
            return self.context(x, expert_ids, scores, w13, w2)
        stream = None
        if (self._shared_stream is not None and isinstance(x, torch.Tensor)
                and x.device == self._shared_stream.device and not tracing(x)):
            stream = self._shared_stream
        return with_shared_expert(
            lambda: self.context(x, expert_ids, scores, w13, w2), x,
            self.shared_w13, self.shared_w2, self.shared_gate_w, stream=stream)

    def expert_weights(self):
        """``(w13, w2)`` as the context takes them: the bf16 parameters (also in training at
        a low precision), or at a low precision (``"mxfp8"``, ``"fp8_block"`` or ``"nvfp4"``)
        in inference their :func:`~distmoe.prepare_weights` form, quantised once per weight version: kept
        until a parameter is changed in place (its version counter moves, e.g. an optimizer
        step or ``load_state_dict``) or replaced, then quantised again at the next call."""
        if self.cfg.precision == "bf16" or self.cfg.training:  # a training context
            return self.w13, self.w2  # quantises the parameters itself
        return prepare_cached(self, self.w13, self.w2, self.cfg.precision)

    def extra_repr(self) -> str:
        c = self.cfg
        return (f"experts {self.first_expert}..{self.first_expert + self.num_local_experts - 1}"
                f" of {c.num_experts}, hidden={c.hidden}, ffn={c.ffn}, top_k={c.top_k}"
                + ("" if self.shared_ffn is None else
                   f", shared_ffn={self.shared_ffn}, shared_gate={self.shared_gate}"))

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """*Collective* when the module built its context: free it (idempotent). A shared
        context (``context=``) is left to its owner."""
        if self._owns_context:
            self.context.close()

    def __enter__(self) -> MoEExperts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ state dict
    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        for i, e in enumerate(self.global_experts):
            for name in _EXPERT_SHAPES:
                t = getattr(self, name)[i]
                destination[f"{prefix}{e}.{name}"] = t if keep_vars else t.detach()
        for key, (attr, _) in _SHARED_KEYS.items():
            t = getattr(self, attr)
            if t is not None:
                destination[prefix + key] = t if keep_vars else t.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
                              missing_keys, unexpected_keys, error_msgs) -> None:
        E, F, D = self.cfg.num_experts, self.cfg.ffn, self.cfg.hidden
        full = {}
        for name in _EXPERT_SHAPES:
            key = prefix + name
            if key in state_dict:
                expected = (E, *_EXPERT_SHAPES[name](F, D))
                t = state_dict[key]
                if tuple(t.shape) != expected:
                    error_msgs.append(
                        f"size mismatch for {key}: expected shape {_SHAPE_NAMES[name + '_full']}"
                        f" = {expected}, got {tuple(t.shape)}")
                else:
                    full[name] = t
        with torch.no_grad():
            for i, e in enumerate(self.global_experts):
                for name, shape_of in _EXPERT_SHAPES.items():
                    key = f"{prefix}{e}.{name}"
                    expected = shape_of(F, D)
                    if key in state_dict:
                        t = state_dict[key]
                        if tuple(t.shape) != expected:
                            error_msgs.append(
                                f"size mismatch for {key}: expected shape "
                                f"{_SHAPE_NAMES[name]} = {expected}, got {tuple(t.shape)}")
                            continue
                    elif name in full:
                        t = full[name][e]
                    else:
                        if strict:
                            missing_keys.append(key)
                        continue
                    getattr(self, name)[i].copy_(t)
            for key, (attr, shape_name) in _SHARED_KEYS.items():
                param = getattr(self, attr)
                if param is None:
                    continue
                if prefix + key not in state_dict:
                    if strict:
                        missing_keys.append(prefix + key)
                    continue
                t = state_dict[prefix + key]
                if t.shape != param.shape:
                    error_msgs.append(
                        f"size mismatch for {prefix + key}: expected shape {shape_name} = "
                        f"{tuple(param.shape)}, got {tuple(t.shape)}")
                    continue
                param.copy_(t)
        if strict:
            for key in state_dict:
                if key.startswith(prefix) and not self._known_key(key[len(prefix):]):
                    unexpected_keys.append(key)

    def _known_key(self, name: str) -> bool:
        """Whether ``name`` (a key less the prefix) is a key of either state-dict form."""
        if name in _EXPERT_SHAPES:
            return True
        if name in _SHARED_KEYS:
            return getattr(self, _SHARED_KEYS[name][0]) is not None
        expert, _, suffix = name.partition(".")
        return (suffix in _EXPERT_SHAPES and expert.isdigit()
                and int(expert) < self.cfg.num_experts and str(int(expert)) == expert)

    @torch.no_grad()
    def load_hf_experts(self, state_dict: Mapping[str, torch.Tensor], prefix: str = "", *,
                        names: Sequence[str] = ("gate_proj", "up_proj", "down_proj")) -> None:
        """Copy this rank's experts from a Hugging Face layout of per-expert Linear weights:
        ``{prefix}{e}.{gate}.weight`` [F, D], ``{prefix}{e}.{up}.weight`` [F, D] and
        ``{prefix}{e}.{down}.weight`` [D, F] for every global e this rank owns (other
        experts' keys are ignored), into ``w13[i, 0]``, ``w13[i, 1]`` and ``w2[i]``
        (converted to bf16). ``names`` = (gate, up, down): ``("gate_proj", "up_proj",
        "down_proj")`` for Qwen / DeepSeek / OLMoE, ``("w1", "w3", "w2")`` for Mixtral.
        Example prefix: ``"model.layers.3.mlp.experts."``. Local (no collective).

        Raises ``KeyError`` naming the first missing key and ``ValueError`` naming a key
        whose tensor has the wrong shape, before any parameter is written.
        """
        if len(names) != 3 or not all(isinstance(n, str) for n in names):
            raise ValueError(f"names ({names!r}) must be three strings: gate, up, down")
        F, D = self.cfg.ffn, self.cfg.hidden
        gate, up, down = names
        plan = []
        for i, e in enumerate(self.global_experts):
            for name, shape, dst in ((gate, (F, D), self.w13[i, 0]),
                                     (up, (F, D), self.w13[i, 1]),
                                     (down, (D, F), self.w2[i])):
                key = f"{prefix}{e}.{name}.weight"
                if key not in state_dict:
                    raise KeyError(f"{key} (expert {e} of this rank) is not in the state dict")
                t = state_dict[key]
                if tuple(t.shape) != shape:
                    dims = "[D, F]" if name == down else "[F, D]"
                    raise ValueError(f"{key} has shape {tuple(t.shape)}, expected {dims} = "
                                     f"{shape}")
                plan.append((dst, t))
        for dst, t in plan:
            dst.copy_(t)

    @torch.no_grad()
    def load_hf_shared_expert(self, state_dict: Mapping[str, torch.Tensor], prefix: str = "",
                              *, module: str = "shared_expert",
                              names: Sequence[str] = ("gate_proj", "up_proj", "down_proj"),
                              gate: str = "shared_expert_gate") -> None:
        """Copy the shared expert from a Hugging Face MoE block's keys:
        ``{prefix}{module}.{gate_proj}.weight`` [F_s, D], ``{prefix}{module}.{up_proj}.weight``
        [F_s, D] and ``{prefix}{module}.{down_proj}.weight`` [D, F_s] into ``shared_w13[0]``,
        ``shared_w13[1]`` and ``shared_w2``, and with ``shared_gate`` ``{prefix}{gate}.weight``
        [1, D] into ``shared_gate_w`` (converted to bf16). Qwen2-MoE: the defaults;
        DeepSeek-V3: ``module="shared_experts"`` (no gate). Example prefix:
        ``"model.layers.3.mlp."``. Local (no collective; every rank loads the same).

        Raises ``ValueError`` when the module has no shared expert, or when the dict has the
        gate's key and the module has no gate (its output would be wrong, not just
        incomplete); ``KeyError`` naming the first missing key; ``ValueError`` naming a key
        whose tensor has the wrong shape; all before any parameter is written.
        """
        if self.shared_ffn is None:
            raise ValueError("this MoEExperts has no shared expert (shared_ffn=None): build "
                             "it with shared_ffn=F_s to load one")
        if len(names) != 3 or not all(isinstance(n, str) for n in names):
            raise ValueError(f"names ({names!r}) must be three strings: gate, up, down")
        F_s, D = self.shared_ffn, self.cfg.hidden
        entries = [(f"{prefix}{module}.{names[0]}.weight", (F_s, D), "[F_s, D]",
                    self.shared_w13[0]),
                   (f"{prefix}{module}.{names[1]}.weight", (F_s, D), "[F_s, D]",
                    self.shared_w13[1]),
                   (f"{prefix}{module}.{names[2]}.weight", (D, F_s), "[D, F_s]", self.shared_w2)]
        gate_key = f"{prefix}{gate}.weight"
        if self.shared_gate:
            entries.append((gate_key, (1, D), "[1, D]", self.shared_gate_w))
        elif gate_key in state_dict:
            raise ValueError(f"{gate_key} (a sigmoid gate on the shared expert) is in the "
                             "state dict, but this module was built with shared_gate=False")
        plan = []
        for key, shape, dims, dst in entries:
            if key not in state_dict:
                raise KeyError(f"{key} (the shared expert) is not in the state dict")
            t = state_dict[key]
            if tuple(t.shape) != shape:
                raise ValueError(f"{key} has shape {tuple(t.shape)}, expected {dims} = {shape}")
            plan.append((dst, t))
        for dst, t in plan:
            dst.copy_(t)
