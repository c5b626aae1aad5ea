"""The layer as ``torch.library`` custom ops, for ``torch.compile`` and ``make_fx``.

A traced or compiled model reaches :class:`~distmoe.ops.context.MoEContext` through three ops
in the ``distmoe`` namespace (each with a fake implementation that returns empty tensors of
the right shapes and dtypes and touches no buffer):

    moe_forward(ctx, x, expert_ids, scores, w13, w2) -> y
        no autograd: an inference context, or a training context with grad mode off or
        nothing requiring grad (the real implementation is the eager call, CUDA graphs and
        ``check=True`` included)
    moe_train_forward(ctx, x, expert_ids, scores, w13, w2) -> (y, call)
        a training forward under autograd (:meth:`MoEContext.training_forward`); its autograd
        formula (``torch.library.register_autograd``) calls
    moe_train_backward(ctx, call, grad_y, scores, w13, w2, needs) -> (grad_x, grad_scores,
                                                                     grad_w13, grad_w2)
        :meth:`MoEContext.training_backward`, collective like the eager backward
        (:mod:`distmoe.ops.autograd`): every rank runs the backwards of the same calls in
        the same order, those of a slot in reverse order of their forwards

What crosses the op boundary (ops take tensors and plain scalars only):

* the context, as an ``int``: its ``op_number``, given at construction by :func:`context_id`
  (a process-wide table of live contexts, weak references). Dynamo reads it as an int
  attribute of the context, a constant of the graph guarded on its value (a new context
  recompiles, or passes its number as a graph input). Not through
  ``torch.compiler.assume_constant_result`` on the context itself: torch 2.11's Dynamo cannot
  turn a user-defined object into a constant argument there (its CUDA inductor test failed
  so; torch 2.13 can);
* the forward's per-call state (routing tables, slot record, executed ids, fp32 scores: the
  ``saved`` dict of :meth:`MoEContext.training_forward`, host objects), as ``call``: an int64
  ``[1]`` CPU tensor holding a call number, the key of a process-wide table of pending calls.
  The backward op takes the entry out of the table (its slot record is then checked and
  released as in eager, :meth:`ActivationBuffer.end_layer`); an entry whose ``call`` tensor
  is freed without a backward (an output dropped, a graph freed) leaves the table with it,
  while its layer stays in its slot until ``ctx.reset_slots()``, as in eager.

The backward op reads ``scores`` (for its dtype), ``w13`` and ``w2`` as arguments, saved
through autograd, so autograd's check of saved tensors' versions replaces the eager
function's check by hand. Gradients not needed (``needs``, from ``ctx.needs_input_grad``)
come back as empty ``[0]`` tensors and become ``None``.

Annotations: the ops write no argument (``mutates_args=()``) and return new tensors; what they
write is the context's own buffers and host state, which are no arguments. They are tagged
``needs_contiguous_strides`` (the kernels read contiguous rows) and ``cudagraph_unsafe`` (host
state per call, and the context replays its own CUDA graphs inside them). They are not
registered as effectful (``torch.library._register_effectful_op``): effect tokens break
activation checkpointing in this torch (an internal AssertionError) where the error below is
clear. The compiler therefore sees functional ops and may drop a call whose output is unused
or merge two calls with identical arguments; every rank compiles the same program, so every
rank runs the same calls in the same order either way.

When a call takes this path: :func:`tracing` is true under ``torch.compiler.is_compiling()``
(Dynamo, ``torch.export``), while a ``make_fx``/``torch.export`` proxy mode or a fake tensor
mode is active, or when x is a fake tensor. Eager calls never come here
(:meth:`MoEContext.__call__` checks :func:`tracing` first and keeps its own path otherwise).

Activation checkpointing: ``torch.utils.checkpoint`` around the layer inside a compiled model
makes the partitioner recompute every op of the region that the backward needs, this layer's
forward included (its ``call``). A recomputed forward would be a second collective forward of
the same layer; it raises a RuntimeError instead, before touching anything (the original
layer stays in its slot: ``ctx.reset_slots()`` on every rank). Pass
``context_fn=checkpoint_context_fn`` (:func:`checkpoint_context_fn`: a selective checkpoint
policy that saves the distmoe ops' outputs and recomputes everything else) to checkpoint a
region that contains the layer.

Not supported on this path (ValueError at the first call): ``check=True`` contexts in training
(the eager call checks the whole group; the inference op runs the eager call and keeps it),
and ``main_grad=True`` contexts (the weight gradients would go to tensors that are no
arguments of the op).
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.library import custom_op
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .autograd import new_weight_grads
from .validation import check_call

_TAGS = (torch.Tag.needs_contiguous_strides, torch.Tag.cudagraph_unsafe)

#: live contexts by number (weak: a graph does not keep its context alive)
_CONTEXTS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_NUMBERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_next_context = itertools.count(1)
#: pending training calls: call number -> _Call
_CALLS: dict = {}
_next_call = itertools.count(1)


@dataclass
class _Call:
    """One training forward waiting for its backward."""

    context: int
    saved: dict
    x_shape: tuple


# ---------------------------------------------------------------------------- dispatch
def tracing(x) -> bool:
    """Whether a layer call is being traced rather than run: ``torch.compiler.is_compiling()``
    (Dynamo, ``torch.export``), a ``make_fx`` proxy mode or a fake tensor mode active, or x a
    fake tensor. A few host checks, no device work."""
    return (torch.compiler.is_compiling() or get_proxy_mode() is not None
            or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None
            or isinstance(x, torch._subclasses.FakeTensor))


def context_id(moe) -> int:
    """The number of ``moe`` in the table of live contexts (registered on first use;
    :class:`~distmoe.ops.context.MoEContext` keeps it as ``op_number``)."""
    number = _NUMBERS.get(moe)
    if number is None:
        number = next(_next_context)
        _NUMBERS[moe] = number
        _CONTEXTS[number] = moe
    return number


def _context(number: int):
    moe = _CONTEXTS.get(number)
    if moe is None:
        raise RuntimeError(f"distmoe context {number} of this traced graph no longer exists "
                           "(garbage-collected); trace or compile the model again")
    moe.check_open()
    return moe


def traced_call(moe, x, expert_ids, scores, w13, w2) -> torch.Tensor:
    """``moe(x, expert_ids, scores, w13, w2)`` through the custom ops (what
    :meth:`MoEContext.__call__` runs when :func:`tracing`): the autograd op where the eager
    call would take the autograd path, else the inference op."""
    number = moe.op_number
    if (moe.cfg.training and torch.is_grad_enabled()
            and (x.requires_grad or scores.requires_grad or w13.requires_grad
                 or w2.requires_grad)):
        y, _ = moe_train_forward(number, x, expert_ids, scores, w13, w2)
        return y
    return moe_forward(number, x, expert_ids, scores, w13, w2)


# ---------------------------------------------------------------------------- inference
@custom_op("distmoe::moe_forward", mutates_args=(), tags=_TAGS)
def moe_forward(ctx: int, x: torch.Tensor, expert_ids: torch.Tensor, scores: torch.Tensor,
                w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """y [T, D] bf16 of a call without autograd: the context's eager call."""
    moe = _context(ctx)
    with torch.no_grad():
        return moe(x, expert_ids, scores, w13, w2)


@moe_forward.register_fake
def _(ctx, x, expert_ids, scores, w13, w2):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# ---------------------------------------------------------------------------- training
@custom_op("distmoe::moe_train_forward", mutates_args=(), tags=_TAGS)
def moe_train_forward(ctx: int, x: torch.Tensor, expert_ids: torch.Tensor,
                      scores: torch.Tensor, w13: torch.Tensor,
                      w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y [T, D] bf16, call int64 [1] CPU)`` of a training forward under autograd."""
    moe = _context(ctx)
    if torch._C._current_graph_task_id() != -1:
        raise RuntimeError(
            "distmoe: the MoE layer's forward ran again during backward, which "
            "torch.utils.checkpoint does to every op of a checkpointed region inside "
            "torch.compile; a second collective forward of the layer cannot run there. Pass "
            "context_fn=distmoe.ops.custom_ops.checkpoint_context_fn to torch.utils.checkpoint "
            "(it saves the layer's outputs and recomputes the rest), or leave the layer "
            "outside the checkpointed region. The layer's forward stays in its slot: call "
            "ctx.reset_slots() on every rank before the next step")
    _check_supported(moe)
    check_call(moe.cfg, moe.num_local_experts, moe.device, moe.backward_buffers.dispatch, x,
               expert_ids, scores, w13, w2, wants_autograd=lambda: True)
    y, saved = moe.training_forward(x, expert_ids, scores, w13, w2)
    number = next(_next_call)
    _CALLS[number] = _Call(context=ctx, saved=saved, x_shape=tuple(x.shape))
    call = torch.tensor([number], dtype=torch.int64)
    weakref.finalize(call, _CALLS.pop, number, None)  # dropped without a backward
    return y, call


@moe_train_forward.register_fake
def _(ctx, x, expert_ids, scores, w13, w2):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty(1, dtype=torch.int64, device="cpu"))


def _check_supported(moe) -> None:
    if moe.check:
        raise ValueError("check=True: a checked training call runs eagerly only (its checks "
                         "are shared over the group around the call); call the layer outside "
                         "torch.compile / make_fx, or use check=False")
    if moe.main_grad:
        raise ValueError("main_grad=True is not supported under torch.compile / make_fx yet: "
                         "the weight gradients would go to tensors that are no arguments of "
                         "the traced op; use main_grad=False (bf16 .grad)")


@custom_op("distmoe::moe_train_backward", mutates_args=(), tags=_TAGS)
def moe_train_backward(ctx: int, call: torch.Tensor, grad_y: torch.Tensor,
                       scores: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       needs: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                   torch.Tensor]:
    """``(grad_x bf16 [T, D], grad_scores [T, K] in scores' dtype, grad_w13, grad_w2)`` of
    one :func:`moe_train_forward`; ``needs``: ``[x, scores, w13, w2]`` need a gradient (an
    empty ``[0]`` tensor where not). Collective."""
    entry = _CALLS.pop(int(call[0]), None)
    if entry is None:
        raise RuntimeError("distmoe: backward of a MoE call whose state is gone: its "
                           "backward already ran (a second backward through the layer), or "
                           "it was never recorded")
    if entry.context != ctx:
        raise AssertionError(f"call of context {entry.context} reached context {ctx}'s "
                             "backward")
    moe = _context(ctx)
    saved = entry.saved
    moe.activations.end_layer(saved["record"], restore=False)  # checks the slot order
    need_x, need_scores, need_w13, need_w2 = needs
    weight_out = new_weight_grads(w13, w2, need_w13=need_w13, need_w2=need_w2)
    grad_x, grad_scores = moe.training_backward(saved, grad_y, w13, w2, entry.x_shape,
                                                weight_out)
    empty = grad_x.new_empty(0)
    grad_w13, grad_w2 = weight_out
    return (grad_x if need_x else empty,
            grad_scores.to(scores.dtype) if need_scores else empty.to(scores.dtype),
            grad_w13 if need_w13 else empty, grad_w2 if need_w2 else empty)


@moe_train_backward.register_fake
def _(ctx, call, grad_y, scores, w13, w2, needs):
    def grad_like(t, need):
        if need:
            return torch.empty_like(t, memory_format=torch.contiguous_format)
        return t.new_empty(0)

    need_x, need_scores, need_w13, need_w2 = needs
    return (grad_like(grad_y.new_empty(grad_y.shape, dtype=torch.bfloat16), need_x),
            grad_like(scores, need_scores), grad_like(w13, need_w13), grad_like(w2, need_w2))


def _setup_context(ctx, inputs, output):
    number, _x, _ids, scores, w13, w2 = inputs
    _, call = output
    ctx.number = number
    ctx.mark_non_differentiable(call)
    ctx.save_for_backward(call, scores, w13, w2)


def _backward(ctx, grad_y, _grad_call):
    call, scores, w13, w2 = ctx.saved_tensors
    need = ctx.needs_input_grad
    needs = [bool(need[1]), bool(need[3]), bool(need[4]), bool(need[5])]
    grads = moe_train_backward(ctx.number, call, grad_y, scores, w13, w2, needs)
    gx, gs, gw13, gw2 = (g if n else None for g, n in zip(grads, needs, strict=True))
    return None, gx, None, gs, gw13, gw2


moe_train_forward.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------- checkpointing
#: the ops whose outputs :func:`checkpoint_context_fn` saves
SAVED_OPS = (torch.ops.distmoe.moe_train_forward.default, torch.ops.distmoe.moe_forward.default)


def checkpoint_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective checkpoint policy: save the distmoe ops' outputs (the layer's y and call:
    its forward must not run twice), recompute everything else."""
    if op in SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_context_fn():
    """``context_fn`` for ``torch.utils.checkpoint(..., use_reentrant=False)`` around a region
    that contains a distmoe layer inside ``torch.compile`` (:func:`checkpoint_policy`)."""
    return create_selective_checkpoint_contexts(checkpoint_policy)


__all__ = ["checkpoint_context_fn", "checkpoint_policy", "context_id", "moe_forward",
           "moe_train_backward", "moe_train_forward", "traced_call", "tracing"]

