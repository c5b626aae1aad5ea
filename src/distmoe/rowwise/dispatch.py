"""Rowwise dispatch: every route PUTs its token row into a peer's heap buffer; its backward
is a combine GET of the output gradient.

Legend: N token rows on this rank, K routes per token (route id ``t*K + k``), D = hidden,
EP ranks, R = ``Buffers.rows``.

Forward, route ``(t, k)`` with ``rank = dst_ranks[t, k]``, ``row = dst_rows[t, k]``::

    out@rank[row] = x[t]                                        (probs None)
    out@rank[row] = bf16(fp32(x[t]) * fp32(probs[t, k]))          (weighted: one rounding)

A negative rank or row is an invalid route: skipped. A bad route (rank >= EP, row >= R) is
skipped and counted (``Buffers.stats()["bad_put_routes"]``), or refused with
``Buffers(check=True)``. Each route should name its own destination row: two routes into one
row race (which one lands is undefined, and so is the gradient of the one that lost).

Backward (collective, every rank; :class:`DispatchPutFunction`): with ``g = grad of out``
on each rank,

    grad_x[t]        = bf16(sum over moved k of w[t, k] * g@rank[row])   fp32, k order
    grad_probs[t, k] = dot(fp32 g@rank[row], fp32 x[t])                  fp32, then probs' dtype

Steps: copy g into this rank's ``grad_out`` twin; barrier; GET (fused, or gathered when the
probabilities need their gradient: the dots read the gathered rows); barrier (no peer reads
a twin that a later backward step writes, whatever the order of the calls). Rows of ``out``
that no route of the call wrote carry no gradient back.

Sync points: the barriers the caller asks for (``pre_barrier``: before the PUT, so that no
peer still reads ``out``; ``post_barrier``: after it, so that every route has landed when the
call returns), none on the host (``check=True`` excepted); the backward runs two barriers.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import increment_version

from distmoe.rowwise.buffers import Buffers, buffer_of
from distmoe.rowwise.checks import (
    check_flag,
    check_probs,
    check_route_maps,
    check_rows_arg,
    check_values,
)
from distmoe.rowwise.transport import get_reduce, put, route_dots


class DispatchPutFunction(torch.autograd.Function):
    """Autograd node of :func:`dispatch_put` (bf16): forward PUT, backward combine GET (see
    the module docstring). ``out`` is returned itself, marked dirty."""

    @staticmethod
    def forward(ctx, x, probs, out, bufs: Buffers, name: str, dst_ranks, dst_rows,
                pre_barrier: bool, post_barrier: bool):
        _dispatch(bufs, name, x, dst_ranks, dst_rows, probs, pre_barrier, post_barrier)
        ctx.mark_dirty(out)
        ctx.bufs, ctx.name = bufs, name
        ctx.has_probs = probs is not None
        keep_x = probs is not None and ctx.needs_input_grad[1]
        ctx.save_for_backward(x if keep_x else None, probs, dst_ranks, dst_rows)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        bufs, name = ctx.bufs, ctx.name
        x, probs, dst_ranks, dst_rows = ctx.saved_tensors
        twin = bufs.grad_buffer(name)
        # peers pull this rank's gradient rows: stage them in the heap twin
        if grad_out is None:
            twin.zero_()
        elif grad_out.data_ptr() != twin.data_ptr() or grad_out.stride() != twin.stride():
            twin.copy_(grad_out)
        need_x, need_probs = ctx.needs_input_grad[0], ctx.has_probs and ctx.needs_input_grad[1]
        grad_probs = None
        y, gathered, is_read = pull_grad_rows(bufs, name, dst_ranks, dst_rows, probs,
                                              run=need_x or need_probs, keep=need_probs)
        grad_x = y if need_x else None
        if need_probs:
            grad_probs = route_dots(gathered, is_read, x, probs.dtype)
        return grad_x, grad_probs, None, None, None, None, None, None, None


def pull_grad_rows(bufs: Buffers, name: str, dst_ranks: torch.Tensor, dst_rows: torch.Tensor,
                   probs: torch.Tensor | None, *, run: bool, keep: bool
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """*Collective.* The adjoint of a PUT into buffer ``name``, once every rank has staged
    its gradient rows in its twin: barrier; GET every route's row of the peers' twins and sum
    each token's routes in fp32 (weighted by ``probs``; fused unless ``keep``, which also
    returns the gathered rows and their ``is_read`` flags); barrier. ``run=False`` skips the
    GET (the barriers still run: they are collective). Returns ``(y [N, D] bf16, gathered,
    is_read)`` (Nones where not computed)."""
    bufs.barrier()
    out = (None, None, None)
    if run:
        out = get_reduce(bufs, f"grad_{name}", dst_ranks, dst_rows, probs, fused=not keep,
                         keep=keep, count=False)
    # no peer still reads this rank's twin when the next backward step writes a twin
    bufs.barrier()
    return out


def _dispatch(bufs: Buffers, name: str, x: torch.Tensor, dst_ranks: torch.Tensor,
              dst_rows: torch.Tensor, probs: torch.Tensor | None, pre_barrier: bool,
              post_barrier: bool) -> None:
    if pre_barrier:
        bufs.barrier()
    put(bufs, name, x, dst_ranks, dst_rows, probs, count=True)
    if post_barrier:
        bufs.barrier()


def dispatch_put(input: torch.Tensor, dst_ranks: torch.Tensor, dst_rows: torch.Tensor,
                 out: torch.Tensor, probs: torch.Tensor | None = None, *,
                 pre_barrier: bool = False, post_barrier: bool = True) -> torch.Tensor:
    """*Collective* (when a barrier is asked for, or in backward). Push token rows into the
    peers' ``out`` buffers, one row per route.

    Args:
        input: bf16 ``[N, D]`` contiguous, this rank's token rows (N may differ by rank).
        dst_ranks: int8/16/32/64 ``[N, K]`` contiguous: each route's destination rank;
            negative = invalid route (skipped).
        dst_rows: the same dtype family and shape: each route's row in the destination's
            ``out``; negative = invalid route.
        out: the ``.out`` (or ``.expert_out``) tensor of a :class:`~distmoe.rowwise.Buffers`,
            bf16 ``[R, D]``, whole.
        probs: optional float32 / bf16 / fp16 ``[N, K]`` contiguous: route ``(t, k)`` sends
            ``bf16(fp32(input[t]) * fp32(probs[t, k]))`` (one rounding) instead of
            ``input[t]``.
        pre_barrier: barrier before the PUT (default False).
        post_barrier: barrier after the PUT (default True): ``out`` holds every peer's rows
            when the call returns. Without it, call ``bufs.barrier()`` before reading them.

    Returns:
        ``out`` itself (bf16 ``[R, D]``, this rank's received rows), differentiable with
        respect to ``input`` and ``probs``: its backward (collective) pulls each route's
        gradient row back and sums them in fp32.

    Raises ``TypeError``/``ValueError`` naming the argument for a wrong type, dtype, shape,
    device or layout, before any buffer is touched; with ``Buffers(check=True)``,
    ``ValueError`` for bad routes (rank >= world size or row >= rows) on any rank.
    """
    bufs, name = buffer_of("out", out)
    num_tokens = check_rows_arg("input", input, bufs)
    check_route_maps("dst_ranks", dst_ranks, "dst_rows", dst_rows, bufs, ndim=2,
                     num_tokens=num_tokens)
    check_probs(probs, dst_ranks, "dst_ranks", bufs)
    check_flag("pre_barrier", pre_barrier)
    check_flag("post_barrier", post_barrier)
    differentiable = torch.is_grad_enabled() and (
        input.requires_grad or (probs is not None and probs.requires_grad))
    if differentiable and not bufs.grad:
        raise ValueError("input or probs requires grad, but out's Buffers were built with "
                         "grad=False (no gradient buffers for the backward)")
    if bufs.check:
        check_values(bufs, "dispatch_put", "dst_ranks/dst_rows", dst_ranks, dst_rows,
                     differentiable)
    if not differentiable:
        _dispatch(bufs, name, input, dst_ranks, dst_rows, probs, pre_barrier, post_barrier)
        increment_version(out)  # a graph that saved out sees it was overwritten
        return out
    if out.requires_grad:
        # out's rows are this call's: drop the history of an earlier call (its graph keeps
        # what it saved; a saved out is caught by the version bump of mark_dirty)
        out.detach_()
    return DispatchPutFunction.apply(input, probs, out, bufs, name, dst_ranks, dst_rows,
                                     pre_barrier, post_barrier)


def dispatch_put_ref(inputs: list[torch.Tensor], dst_ranks: list[torch.Tensor],
                     dst_rows: list[torch.Tensor], outs: list[torch.Tensor],
                     probs: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Plain-PyTorch :func:`dispatch_put` of a whole group, differentiable, on any device:
    ``inputs[s]`` / ``dst_ranks[s]`` / ``dst_rows[s]`` / ``probs[s]`` are rank s's arguments,
    ``outs[r]`` rank r's ``out`` before the call (``[R, D]``, any float dtype). Returns new
    tensors (the ``outs`` after the call); the weighted product is taken in fp32 at least
    and rounded to ``outs``' dtype. Routes are applied in rank, then route order (a later
    duplicate wins). Bad and invalid routes are skipped."""
    new = list(outs)
    for s, x in enumerate(inputs):
        ranks, rows = dst_ranks[s].tolist(), dst_rows[s].tolist()  # [N, K] each
        for t, (rank_t, row_t) in enumerate(zip(ranks, rows, strict=True)):
            for k, (rank, row) in enumerate(zip(rank_t, row_t, strict=True)):
                if rank < 0 or row < 0 or rank >= len(outs) or row >= outs[rank].shape[0]:
                    continue
                val = x[t]
                if probs is not None:
                    wide = torch.promote_types(x.dtype, torch.float32)
                    val = val.to(wide) * probs[s][t, k].to(wide)
                val = val.to(new[rank].dtype).to(new[rank].device)
                new[rank] = torch.cat([new[rank][:row], val[None], new[rank][row + 1:]])
    return new
