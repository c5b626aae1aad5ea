"""MoEExperts: one rank's routed experts as an ``nn.Module``, checkpointed in global numbering.

The module owns this rank's slice of the layer's expert weights and calls
:class:`distmoe.MoEContext` with them; everything else (dispatch, GEMMs, combine, autograd)
is the context's. Rank r of an EP group of size EP owns the global experts
``r * E_local .. (r + 1) * E_local - 1`` with ``E_local = num_experts / EP``.

Parameters (this rank's experts, local index i = global index - r * E_local):

    w13  [E_local, 2, F, D] bf16   gate = w13[i, 0], up = w13[i, 1]
    w2   [E_local, D, F] bf16      down projection

Initialisation: every element is drawn from N(0, init_std^2) (``init_std`` defaults to 0.02,
the ``initializer_range`` of the common Hugging Face MoE models, which initialise their
expert Linear weights that way), in fp32 on the CPU, then rounded to bf16. Each global expert
e has its own generator, seeded from ``(seed, e)``: expert e holds the same bits whatever the
EP size, and building the module draws nothing but the base seed from torch's default
generator (so ``torch.manual_seed`` governs it, and successive layers differ).

State dict (sharded, in global numbering; no collective): under the module's prefix, one
entry per expert this rank owns,

    {e}.w13  [2, F, D] bf16        {e}.w2  [D, F] bf16          e = global expert index

so a module registered as ``mlp.experts`` saves ``mlp.experts.5.w13``, beside where a
Hugging Face checkpoint keeps ``mlp.experts.5.gate_proj.weight``. Why per expert rather than
the full ``[E, ...]`` tensors: saving then needs no all-gather (``state_dict()`` stays local
and cannot deadlock when one rank saves alone), no rank ever holds more than its own
experts, and the union of the ranks' dicts *is* the full checkpoint: its keys do not depend
on the EP size. The tensors are views of the parameters (as ``nn.Module.state_dict`` returns
its parameters, no copy); serialisers that refuse tensors sharing storage (safetensors) want
``{k: v.clone() for k, v in sd.items()}``.

Loading (``load_state_dict``, strict or not, through ``nn.Module``'s machinery) takes this
rank's experts from either form and ignores the others':

* the per-expert keys above, from any EP size (each rank finds its own experts' keys in a
  merged dict, or in the dict of any rank that held them);
* the fused full tensors ``w13`` [E, 2, F, D] and ``w2`` [E, D, F] (each rank copies its
  slice), as a single-process model keeps them; where an expert's per-expert key is also
  present, the per-expert key wins.

With ``strict=True`` a missing expert is reported by its per-expert key name, a key under
the prefix that is neither form (or names an expert outside [0, E)) as unexpected, and a
tensor of the wrong shape as an error naming the key and the expected shape. Values are
copied into the existing parameters (converted to bf16; ``assign=True`` is not honoured:
the parameters keep their storage, which the context's calls read).

:meth:`MoEExperts.load_hf_experts` maps the per-expert Linear layout of Hugging Face MoE
checkpoints (``{e}.gate_proj.weight`` [F, D], ``{e}.up_proj.weight`` [F, D],
``{e}.down_proj.weight`` [D, F]; Mixtral's ``w1``/``w3``/``w2`` through ``names=``) into
w13/w2.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..config import MoEConfig
from ..ops import MoEContext

#: per-expert state-dict suffixes and their shapes as functions of (F, D)
_EXPERT_SHAPES = {
    "w13": lambda F, D: (2, F, D),
    "w2": lambda F, D: (D, F),
}
_SHAPE_NAMES = {"w13": "[2, F, D]", "w2": "[D, F]", "w13_full": "[E, 2, F, D]",
                "w2_full": "[E, D, F]"}


def expert_seed(seed: int, expert: int) -> int:
    """The generator seed of global expert ``expert`` under base seed ``seed`` (a 63-bit
    mix, the same on every rank and at every EP size)."""
    mixed = (seed * 0x9E3779B97F4A7C15 + expert * 0xBF58476D1CE4E5B9 + 1) % (1 << 64)
    mixed ^= mixed >> 31
    return mixed % (1 << 63)


class MoEExperts(nn.Module):
    """This rank's routed experts of one MoE layer (see the module docstring).

    Args:
        cfg: the layer (:class:`distmoe.MoEConfig`).
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

    Attributes:
        w13: ``nn.Parameter`` bf16 [E_local, 2, F, D]; gate ``w13[i, 0]``, up ``w13[i, 1]``.
        w2: ``nn.Parameter`` bf16 [E_local, D, F].
        context: the :class:`distmoe.MoEContext` the forward calls.
        first_expert: global index of local expert 0 (``rank * E_local``).
        num_local_experts: E_local.
    """

    def __init__(self, cfg: MoEConfig, group: dist.ProcessGroup | None = None, *,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.bfloat16, context: MoEContext | None = None,
                 init_std: float | None = None, seed: int | None = None) -> None:
        super().__init__()
        if not isinstance(cfg, MoEConfig):
            raise TypeError(f"cfg must be a distmoe.MoEConfig, got {type(cfg).__name__}")
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

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor,
                scores: torch.Tensor) -> torch.Tensor:
        """``y = context(x, expert_ids, scores, w13, w2)``: x [T, D] bf16, expert_ids [T, K]
        integer (global ids, -1 inactive), scores [T, K] float; returns y [T, D] bf16.
        Collective (every rank calls it); with ``cfg.training`` and grad mode on, y has a
        grad_fn and its backward (collective too) fills ``w13.grad`` / ``w2.grad``."""
        return self.context(x, expert_ids, scores, self.w13, self.w2)

    def extra_repr(self) -> str:
        c = self.cfg
        return (f"experts {self.first_expert}..{self.first_expert + self.num_local_experts - 1}"
                f" of {c.num_experts}, hidden={c.hidden}, ffn={c.ffn}, top_k={c.top_k}")

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
        if strict:
            for key in state_dict:
                if key.startswith(prefix) and not self._known_key(key[len(prefix):]):
                    unexpected_keys.append(key)

    def _known_key(self, name: str) -> bool:
        """Whether ``name`` (a key less the prefix) is a key of either state-dict form."""
        if name in _EXPERT_SHAPES:
            return True
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
