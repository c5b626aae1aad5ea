"""Checks of a layer call's inputs, before any buffer or peer memory is touched.

:func:`check_call` (every call: types, devices, dtypes, shapes, layout; host metadata only,
no device reads), :func:`check_values` (``check=True`` only: the ids and scores themselves,
which reads device memory) and :func:`check_together` (``check=True``: both, then the
outcome shared over the group so that every rank raises together). Errors name the argument,
the config field a shape comes from, the rule and the value.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..config import MoEConfig
from ..kernels.base.rows import byte_range
from ..runtime.heap import gather_objects

#: the integer dtypes accepted for expert ids
INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
#: the floating dtypes accepted for scores
SCORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


class RankCall(NamedTuple):
    """One rank's view of a checked call, all-gathered in ``check`` mode."""

    tokens: int | None  # T, or None when x is not a tensor with a first dimension
    error: str | None  # "TypeName: message" when the rank refused its input
    autograd: bool  # the call takes the autograd path
    serial: int  # the context's construction number on its rank


def check_call(cfg: MoEConfig, num_local_experts: int, device: torch.device,
               input_buffer: torch.Tensor, x, expert_ids, scores, w13, w2, *,
               wants_autograd: Callable[[], bool]) -> None:
    """The per-call checks of ``ctx(x, expert_ids, scores, w13, w2)``: ``TypeError`` /
    ``ValueError`` naming the argument. ``input_buffer`` is the context's dispatch rows (x
    may be a view starting at its first row, never another part of it); ``wants_autograd()``
    says whether the call takes the autograd path (asked only for T = 0). ``w13`` and ``w2``
    ``None``: the caller checks the weights itself (prepared low-precision weights)."""
    weights = w13 is not None
    named = {"x": x, "expert_ids": expert_ids, "scores": scores}
    if weights:
        named.update(w13=w13, w2=w2)
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name in ("x", "w13", "w2") if weights else ("x",):
        if named[name].dtype != torch.bfloat16:
            raise TypeError(f"{name} must be torch.bfloat16, got {named[name].dtype}")
    if expert_ids.dtype not in INT_DTYPES:
        raise TypeError(f"expert_ids must have an integer dtype ({_names(INT_DTYPES)}), got "
                        f"{expert_ids.dtype}")
    if scores.dtype not in SCORE_DTYPES:
        raise TypeError(f"scores must have a floating dtype ({_names(SCORE_DTYPES)}), got "
                        f"{scores.dtype}")
    D, K, F, E_l = cfg.hidden, cfg.top_k, cfg.ffn, num_local_experts
    if x.dim() != 2 or x.shape[1] != D:
        raise ValueError(f"x must be [T, hidden={D}], got {tuple(x.shape)}")
    T = x.shape[0]
    if T > cfg.max_tokens:
        raise ValueError(f"x has T = {T} tokens, above max_tokens ({cfg.max_tokens})")
    if T == 0 and wants_autograd():
        raise ValueError("x has T = 0 tokens: a training forward under autograd needs "
                         "T >= 1 (without autograd, T = 0 returns an empty y)")
    for name in ("expert_ids", "scores"):
        if tuple(named[name].shape) != (T, K):
            raise ValueError(f"{name} must be [T, top_k] = [{T}, {K}] (T from x), got "
                             f"{tuple(named[name].shape)}")
    if weights and tuple(w13.shape) != (E_l, 2, F, D):
        raise ValueError(f"w13 must be [E_local={E_l}, 2, ffn={F}, hidden={D}] (gate = "
                         f"w13[e, 0], up = w13[e, 1]), got {tuple(w13.shape)}")
    if weights and tuple(w2.shape) != (E_l, D, F):
        raise ValueError(f"w2 must be [E_local={E_l}, hidden={D}, ffn={F}], got "
                         f"{tuple(w2.shape)}")
    for name, t in named.items():
        if t.device != device:
            raise ValueError(f"{name} must be on {device} (the context's device), got "
                             f"{t.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got shape {tuple(t.shape)} with "
                             f"strides {t.stride()} (call .contiguous())")
    if x.numel() > 0 and x.data_ptr() != input_buffer.data_ptr():
        lo, hi = byte_range(input_buffer)
        start, end = byte_range(x)
        if start < hi and lo < end:
            raise ValueError(
                "x overlaps this context's input buffer but does not start at its first row "
                f"(x at {x.data_ptr():#x}, the buffer at {input_buffer.data_ptr():#x}): pass "
                "ctx.input_buffer(T) itself, or a tensor outside the buffer")


def check_values(num_experts: int, expert_ids: torch.Tensor, scores: torch.Tensor) -> None:
    """``check=True``: ids in [-1, E), distinct active ids per token, zero scores on
    inactive routes (reads device memory: synchronises)."""
    E = num_experts
    ids = expert_ids.long()  # compared as int64: -1 is no id of an unsigned dtype
    bad = (ids < -1) | (ids >= E)
    if bool(bad.any()):
        t, k = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"expert_ids must lie in [-1, num_experts={E}); found "
                         f"{int(ids[t, k])} at [{t}, {k}]")
    if ids.shape[1] > 1:  # a token's active routes name distinct experts
        ordered = ids.sort(dim=1).values
        twice = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
        if bool(twice.any()):
            t, k = (int(i) for i in twice.nonzero()[0])
            raise ValueError(
                f"expert_ids must name distinct experts per token (the receive bound "
                f"counts at most min(K, E_local) routes of a token per rank); token {t} "
                f"names expert {int(ordered[t, k])} more than once")
    stray = (ids == -1) & (scores != 0)
    if bool(stray.any()):
        t, k = (int(i) for i in stray.nonzero()[0])
        raise ValueError("scores must be 0 on inactive routes (expert id -1); found "
                         f"{float(scores[t, k])} at [{t}, {k}]")


def check_together(group, ep_size: int, serial: int, x, run_checks, wants_autograd) -> None:
    """``check`` mode: this rank's checks (``run_checks()``, raising ``TypeError`` /
    ``ValueError``), then one host all-gather of (T, outcome, path, context serial) over
    ``group``, so that every rank raises when any rank refused its input, the token counts
    or autograd paths differ, or the ranks called different contexts."""
    err = None
    try:
        run_checks()
    except (TypeError, ValueError) as exc:
        err = exc
    tokens = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() > 0 else None
    autograd = err is None and wants_autograd()
    outcomes: list[RankCall] = gather_objects(
        RankCall(tokens, None if err is None else f"{type(err).__name__}: {err}", autograd,
                 serial), group, ep_size)
    serials = [o.serial for o in outcomes]
    if len(set(serials)) > 1:
        raise ValueError(
            "the ranks called different MoEContexts in this call (context serials "
            f"{serials}, rank r at index r; contexts are numbered in construction order): "
            "every rank must call its contexts in the same order")
    if err is not None:
        raise err
    for r, o in enumerate(outcomes):
        if o.error is not None:
            raise ValueError(f"rank {r} refused its input ({o.error}); every rank stops "
                             "(check=True)")
    counts = [o.tokens for o in outcomes]
    if len(set(counts)) > 1:
        raise ValueError(f"x must have the same number of tokens T on every rank of the "
                         f"group, got T = {counts} (rank r at index r)")
    paths = [o.autograd for o in outcomes]
    if len(set(paths)) > 1:
        raise ValueError(
            "every rank must take the same path, autograd or not (the backward is "
            f"collective), got autograd = {paths} (rank r at index r): autograd runs "
            "when cfg.training, grad mode is on and x, scores, w13 or w2 requires grad "
            "(e.g. experts frozen on one rank only)")


def check_main_grads(w13, w2) -> None:
    """``MoEContext(main_grad=True)``: every weight that requires grad carries ``main_grad``,
    an fp32 contiguous tensor of its shape on its device (``TypeError`` / ``ValueError``
    naming ``w13.main_grad`` or ``w2.main_grad``)."""
    for name, w in (("w13", w13), ("w2", w2)):
        if not w.requires_grad:
            continue
        g = getattr(w, "main_grad", None)
        if not isinstance(g, torch.Tensor):
            raise TypeError(f"{name}.main_grad must be a torch.Tensor (MoEContext(main_grad="
                            f"True) adds the fp32 weight gradient into it), got "
                            f"{type(g).__name__}")
        if g.dtype != torch.float32:
            raise TypeError(f"{name}.main_grad must be torch.float32, got {g.dtype}")
        if tuple(g.shape) != tuple(w.shape):
            raise ValueError(f"{name}.main_grad must have {name}'s shape {list(w.shape)}, got "
                             f"{list(g.shape)}")
        if g.device != w.device:
            raise ValueError(f"{name}.main_grad must be on {name}'s device {w.device}, got "
                             f"{g.device}")
        if not g.is_contiguous():
            raise ValueError(f"{name}.main_grad must be contiguous, got strides "
                             f"{list(g.stride())}")


def warn_inference_grad(x, scores, why: str) -> None:
    """A ``UserWarning`` when grad mode is on and x or scores requires grad in a call that
    gives y no grad_fn (``why``: the rest of the message), naming the caller's line."""
    if torch.is_grad_enabled() and (x.requires_grad or scores.requires_grad):
        warnings.warn(f"MoEContext: x or scores requires grad, but {why}", UserWarning,
                      stacklevel=3)
