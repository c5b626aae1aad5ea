"""Argument checks of the rowwise calls: host metadata only (types, dtypes, shapes, devices,
layout), before any buffer is touched; and the value checks of ``Buffers(check=True)``,
which read the route maps on the host and share the outcome over the group.
"""

from __future__ import annotations

import torch

from distmoe.kernels.base.checks import check_tensor
from distmoe.kernels.movement.rowwise_put import PROB_DTYPES, ROUTE_DTYPES
from distmoe.rowwise.buffers import Buffers
from distmoe.runtime.heap import gather_objects


def check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def check_on_device(name: str, tensor: torch.Tensor, bufs: Buffers) -> None:
    if tensor.device != bufs.device:
        raise ValueError(f"{name} must be on the Buffers' device ({bufs.device}), got "
                         f"{tensor.device}")


def check_rows_arg(name: str, value: object, bufs: Buffers) -> int:
    """A bf16 ``[N, hidden]`` contiguous tensor on the Buffers' device; returns N."""
    check_tensor(name, value, dtypes=(torch.bfloat16,), ndim=2, shape_text="[N, hidden]")
    if value.shape[1] != bufs.hidden:
        raise ValueError(f"{name} must have shape [N, hidden] with hidden = {bufs.hidden} (the "
                         f"Buffers' row width), got {list(value.shape)}")
    check_on_device(name, value, bufs)
    return value.shape[0]


def check_route_maps(ranks_name: str, ranks: object, rows_name: str, rows: object,
                     bufs: Buffers, *, ndim: int, num_tokens: int | None = None) -> None:
    """Two route maps: signed integer, ``[N, K]`` (``ndim=2``, K >= 1) or ``[N]``
    (``ndim=1``), the same shape, contiguous, on the Buffers' device."""
    text = "[N, K]" if ndim == 2 else "[N]"
    check_tensor(ranks_name, ranks, dtypes=ROUTE_DTYPES, ndim=ndim, shape_text=text)
    if num_tokens is not None and ranks.shape[0] != num_tokens:
        raise ValueError(f"{ranks_name} must have shape {text} with N = {num_tokens} (the rows "
                         f"of the input), got {list(ranks.shape)}")
    if ndim == 2 and ranks.shape[1] < 1:
        raise ValueError(f"{ranks_name} must have K >= 1 columns, got shape "
                         f"{list(ranks.shape)}")
    check_tensor(rows_name, rows, dtypes=ROUTE_DTYPES, shape=list(ranks.shape),
                 shape_text=f"(the shape of {ranks_name})")
    check_on_device(ranks_name, ranks, bufs)
    check_on_device(rows_name, rows, bufs)


def check_probs(probs: object, ranks: torch.Tensor, ranks_name: str, bufs: Buffers) -> None:
    if probs is None:
        return
    check_tensor("probs", probs, dtypes=PROB_DTYPES, shape=list(ranks.shape),
                 shape_text=f"(the shape of {ranks_name})")
    check_on_device("probs", probs, bufs)


def check_values(bufs: Buffers, op: str, ranks_name: str, ranks: torch.Tensor,
                 rows: torch.Tensor, differentiable: bool) -> None:
    """``check=True``: bad routes and differentiability, shared over the group (collective:
    every rank makes the same calls in the same order); every rank raises ``ValueError``
    together when any rank fails."""
    ranks64, rows64 = ranks.to("cpu", torch.int64), rows.to("cpu", torch.int64)
    is_bad = (ranks64 >= 0) & (rows64 >= 0) & ((ranks64 >= bufs.world_size)
                                                | (rows64 >= bufs.rows))
    problem = None
    if bool(is_bad.any()):
        first = tuple(int(i) for i in is_bad.nonzero()[0].tolist())
        problem = (f"{op}: {int(is_bad.sum())} bad routes in {ranks_name} on rank {bufs.rank} "
                   f"(a rank must be < world size {bufs.world_size} and a row < rows "
                   f"{bufs.rows}, or either negative for no route); the first at index "
                   f"{list(first)}: rank {int(ranks64[first])}, row {int(rows64[first])}")
    outcomes = gather_objects((problem, differentiable), bufs.group, bufs.world_size)
    if problem is not None:
        raise ValueError(problem)
    bad = [(r, p) for r, (p, _) in enumerate(outcomes) if p is not None]
    if bad:
        raise ValueError(f"{op}: rank {bad[0][0]} failed the route check ({bad[0][1]}); every "
                         "rank stops (check=True)")
    flags = [d for _, d in outcomes]
    if any(flags) and not all(flags):
        raise ValueError(f"{op}: the call is differentiable (grad mode on and an input that "
                         f"requires grad) on ranks {[r for r, d in enumerate(flags) if d]} "
                         f"only; its backward is collective, so every rank must take part "
                         "(check=True)")


#: values per scale of the fused expert path's GEMM operands, by precision
EXPERT_BLOCKS = {"mxfp8": 32, "fp8_block": 128}


def check_expert_buffers(bufs: object) -> Buffers:
    """``bufs`` of :func:`~distmoe.rowwise.scaled_expert_mlp`: open ``Buffers(scaled=True)``."""
    if not isinstance(bufs, Buffers):
        raise TypeError(f"bufs must be a distmoe.rowwise.Buffers (built with scaled=True), got "
                        f"{type(bufs).__name__}")
    bufs.check_open()
    if not bufs.scaled:
        raise ValueError("bufs must be built with scaled=True (the fused expert path moves "
                         "MXFP8 rows through .out_q and .expert_out_q), got Buffers with "
                         "scaled=False")
    return bufs


def check_expert_weights(w13: object, w2: object, offs: object, precision: object,
                         bufs: Buffers) -> tuple[int, int]:
    """The expert weights and layout of :func:`~distmoe.rowwise.scaled_expert_mlp`: w13 bf16
    ``[E, 2, F, D]`` and w2 bf16 ``[E, D, F]`` contiguous, offs int32 ``[E]``, D (the
    Buffers' hidden) and F positive multiples of the precision's block, on the Buffers'
    device. Returns ``(E, F)``."""
    if precision not in EXPERT_BLOCKS:
        raise ValueError(f"precision ({precision!r}) must be one of {list(EXPERT_BLOCKS)}")
    check_tensor("w13", w13, dtypes=(torch.bfloat16,), ndim=4,
                 shape_text="[E, 2, F, D] (gate rows w13[e, 0], up rows w13[e, 1])")
    num_experts, two, ffn, hidden = w13.shape
    if two != 2 or hidden != bufs.hidden or num_experts < 1:
        raise ValueError(f"w13 must have shape [E, 2, F, D] with E >= 1 and D = {bufs.hidden} "
                         f"(the Buffers' hidden), got {list(w13.shape)}")
    check_tensor("w2", w2, dtypes=(torch.bfloat16,), shape=[num_experts, hidden, ffn],
                 shape_text="[E, D, F] (w13's E and F, the Buffers' D)")
    check_tensor("offs", offs, dtypes=(torch.int32,), shape=[num_experts],
                 shape_text="[E] (cumulative row ends of the local experts, int32, on the "
                            "device)")
    block = EXPERT_BLOCKS[precision]
    for name, width in (("D (the Buffers' hidden)", hidden), ("F (w13.shape[2])", ffn)):
        if width < 1 or width % block:
            raise ValueError(f"{name} ({width}) must be a positive multiple of {block} for "
                             f"precision {precision!r} (one scale per {block} values)")
    for name, tensor in (("w13", w13), ("w2", w2), ("offs", offs)):
        check_on_device(name, tensor, bufs)
    return num_experts, ffn


def check_grad_buffers(bufs: Buffers, differentiable: bool, inputs: str, owner: str) -> None:
    """A differentiable call needs the gradient twins of ``Buffers(grad=True)``."""
    if differentiable and not bufs.grad:
        raise ValueError(f"{inputs} requires grad, but {owner} were built with grad=False (no "
                         "gradient buffers for the backward)")
