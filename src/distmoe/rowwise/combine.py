"""Rowwise combine and gather: every route GETs a row of a peer's heap buffer; the combine
reduces each token's routes in fp32. Their backward is a (weighted) dispatch PUT.

Legend: N token rows on this rank, K routes per token (route id ``t*K + k``), D = hidden,
EP ranks, R = ``Buffers.rows``; ``src@rank`` is rank ``rank``'s buffer.

Forward, with ``rank = src_ranks[t, k]``, ``row = src_rows[t, k]``:

* :func:`combine_get`: gathers ``[N, K, D]`` (GET), then
  ``y[t] = bf16(sum over read k of w[t, k] * src@rank[row])`` in fp32 in k order, ``w =
  probs`` (fp32) or 1; :func:`combine_get_fused`: the same bits from one kernel that pulls
  and reduces, without the ``[N, K, D]`` intermediate;
* :func:`gather_get`: one route per row, ``y[i] = src@src_ranks[i][src_rows[i]]``, exactly.

A negative rank or row is an invalid route: it reads zeros (gather) or adds nothing
(combine; its probability is not read, so it may hold anything). A bad route (rank >= EP,
row >= R) does the same and is counted (``Buffers.stats()["bad_get_routes"]``), or refused
with ``Buffers(check=True)``.

Backward (collective, every rank; :class:`GetRowsFunction`), with ``g = grad of y``:

    grad_src@rank[row] = bf16(fp32(g[t]) * fp32(w[t, k]))  for every read route (w = 1: g[t])
    grad_src (other rows) = 0
    grad_probs[t, k]    = dot(fp32 g[t], fp32 src@rank[row])   fp32, then probs' dtype

Steps: zero this rank's gradient twin of the source buffer; barrier (no peer writes into it
before it is zeroed); PUT; barrier (every route's gradient landed); the twin, copied, is the
source's gradient. The probability gradients read the gathered rows that the unfused
forward kept; the fused forward keeps nothing and pulls the rows again in backward (the
source buffers must still hold the forward's rows: nothing writes them between a forward
and its backward unless the caller does). Two routes naming one source row both read it,
but their gradients race in the PUT: give each route its own row for training.

Sync points: the barriers the caller asks for (``pre_barrier``: before the GET, so that the
peers' rows have landed; ``post_barrier``: after it, so that no peer overwrites a row still
being read), none on the host (``check=True`` excepted); the backward runs two barriers.
"""

from __future__ import annotations

from typing import Literal

import torch

from distmoe.kernels.movement.rowwise_get import rowwise_combine_get_ref
from distmoe.rowwise.buffers import Buffers, buffer_of
from distmoe.rowwise.checks import check_flag, check_probs, check_route_maps, check_values
from distmoe.rowwise.transport import gather, get_reduce, put, route_dots

Mode = Literal["gather", "combine", "fused"]


class GetRowsFunction(torch.autograd.Function):
    """Autograd node of :func:`combine_get`, :func:`combine_get_fused` and
    :func:`gather_get` (bf16): forward GET, backward (weighted) PUT (see the module
    docstring)."""

    @staticmethod
    def forward(ctx, src, probs, bufs: Buffers, name: str, src_ranks, src_rows, mode: Mode,
                pre_barrier: bool, post_barrier: bool):
        need_probs = probs is not None and ctx.needs_input_grad[1]
        y, gathered, is_read = _get(bufs, name, src_ranks, src_rows, probs, mode, pre_barrier,
                                    post_barrier, keep=need_probs)
        ctx.bufs, ctx.name, ctx.mode = bufs, name, mode
        ctx.has_probs = probs is not None
        ctx.save_for_backward(probs, src_ranks, src_rows, gathered, is_read)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        bufs, name = ctx.bufs, ctx.name
        probs, src_ranks, src_rows, gathered, is_read = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        twin = push_grad_rows(bufs, name, grad_y, src_ranks, src_rows, probs)
        grad_src = twin.clone() if ctx.needs_input_grad[0] else None
        grad_probs = None
        if ctx.has_probs and ctx.needs_input_grad[1]:
            if gathered is None:  # fused forward: pull the rows again
                gathered, is_read = gather(bufs, name, src_ranks, src_rows, count=False)
            grad_probs = route_dots(gathered, is_read, grad_y, probs.dtype)
        return grad_src, grad_probs, None, None, None, None, None, None, None


def push_grad_rows(bufs: Buffers, name: str, grad_y: torch.Tensor, src_ranks: torch.Tensor,
                   src_rows: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
    """*Collective.* The adjoint of a GET from buffer ``name``: zero this rank's gradient
    twin; barrier; every route PUTs ``bf16(fp32(grad_y[t]) * fp32(probs[t, k]))`` (or
    ``grad_y[t]``) into its source row's twin; barrier. Returns this rank's twin (bf16 ``[R,
    D]``, heap memory: rows no route read are 0), valid until the next backward step writes
    it."""
    twin = bufs.grad_buffer(name)
    twin.zero_()
    bufs.barrier()  # every twin zeroed before any peer writes into it
    put(bufs, f"grad_{name}", grad_y, src_ranks, src_rows, probs, count=False)
    bufs.barrier()  # every route's gradient landed
    return twin


def _get(bufs: Buffers, name: str, src_ranks: torch.Tensor, src_rows: torch.Tensor,
         probs: torch.Tensor | None, mode: Mode, pre_barrier: bool, post_barrier: bool, *,
         keep: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    if pre_barrier:
        bufs.barrier()
    if mode == "gather":
        y, _ = gather(bufs, name, src_ranks, src_rows, count=True)
        gathered = is_read = None
    else:
        y, gathered, is_read = get_reduce(bufs, name, src_ranks, src_rows, probs,
                                          fused=mode == "fused", keep=keep, count=True)
    if post_barrier:
        bufs.barrier()
    return y, gathered, is_read


def _get_rows(op: str, src: torch.Tensor, src_ranks: torch.Tensor, src_rows: torch.Tensor,
              probs: torch.Tensor | None, mode: Mode, pre_barrier: bool,
              post_barrier: bool) -> torch.Tensor:
    bufs, name = buffer_of("expert_out", src)
    ndim = 1 if mode == "gather" else 2
    check_route_maps("src_ranks", src_ranks, "src_rows", src_rows, bufs, ndim=ndim)
    check_probs(probs, src_ranks, "src_ranks", bufs)
    check_flag("pre_barrier", pre_barrier)
    check_flag("post_barrier", post_barrier)
    differentiable = torch.is_grad_enabled() and (
        src.requires_grad or (probs is not None and probs.requires_grad))
    if differentiable and not bufs.grad:
        raise ValueError("expert_out or probs requires grad, but expert_out's Buffers were "
                         "built with grad=False (no gradient buffers for the backward)")
    if bufs.check:
        check_values(bufs, op, "src_ranks/src_rows", src_ranks, src_rows, differentiable)
    if not differentiable:
        return _get(bufs, name, src_ranks, src_rows, probs, mode, pre_barrier, post_barrier,
                    keep=False)[0]
    return GetRowsFunction.apply(src, probs, bufs, name, src_ranks, src_rows, mode,
                                 pre_barrier, post_barrier)


_ARGS_DOC = """
    Args:
        expert_out: the ``.expert_out`` (or ``.out``) tensor of a
            :class:`~distmoe.rowwise.Buffers`, bf16 ``[R, D]``, whole: the source rows.
        src_ranks: int8/16/32/64 ``{shape}`` contiguous: each route's source rank;
            negative = invalid route.
        src_rows: the same dtype family and shape: each route's row in the source's buffer;
            negative = invalid route.{probs}
        pre_barrier: barrier before the GET (default True: the peers' rows have landed).
        post_barrier: barrier after the GET (default False).
"""


def combine_get(expert_out: torch.Tensor, src_ranks: torch.Tensor, src_rows: torch.Tensor,
                probs: torch.Tensor | None = None, *, pre_barrier: bool = True,
                post_barrier: bool = False) -> torch.Tensor:
    """*Collective* (when a barrier is asked for, or in backward). Pull every route's row and
    reduce each token's K routes in fp32: the gathered rows ``[N, K, D]`` are materialised
    (and kept for backward when ``probs`` requires grad).
    {args}
    Returns:
        bf16 ``[N, D]``: ``y[t] = bf16(sum over read k of probs[t, k] * row)`` (fp32 sum in k
        order, one rounding; unweighted without ``probs``); a token with no read route gets
        zeros. Differentiable with respect to ``expert_out`` and ``probs`` (backward: a
        weighted PUT of the output gradient, collective).

    Raises ``TypeError``/``ValueError`` naming the argument for a wrong type, dtype, shape,
    device or layout, before any buffer is touched; with ``Buffers(check=True)``,
    ``ValueError`` for bad routes on any rank.
    """
    return _get_rows("combine_get", expert_out, src_ranks, src_rows, probs, "combine",
                     pre_barrier, post_barrier)


def combine_get_fused(expert_out: torch.Tensor, src_ranks: torch.Tensor,
                      src_rows: torch.Tensor, probs: torch.Tensor | None = None, *,
                      pre_barrier: bool = True, post_barrier: bool = False) -> torch.Tensor:
    """:func:`combine_get` in one kernel (pull and reduce; no ``[N, K, D]`` intermediate),
    with the same bits. A backward that needs the gradient of ``probs`` pulls the rows again
    (``expert_out`` on every rank must be unchanged until then).
    {args}
    Returns bf16 ``[N, D]``, as :func:`combine_get`.
    """
    return _get_rows("combine_get_fused", expert_out, src_ranks, src_rows, probs, "fused",
                     pre_barrier, post_barrier)


def gather_get(expert_out: torch.Tensor, src_ranks: torch.Tensor, src_rows: torch.Tensor, *,
               pre_barrier: bool = True, post_barrier: bool = False) -> torch.Tensor:
    """*Collective* (when a barrier is asked for, or in backward). One-to-one pull: row i of
    the result is row ``src_rows[i]`` of rank ``src_ranks[i]``'s buffer, bit for bit; zeros
    for an invalid or bad route.
    {args}
    Returns bf16 ``[N, D]``, differentiable with respect to ``expert_out`` (backward: a PUT
    of the output gradient rows, collective).
    """
    return _get_rows("gather_get", expert_out, src_ranks, src_rows, None, "gather",
                     pre_barrier, post_barrier)


_PROBS_DOC = """
        probs: optional float32 / bf16 / fp16 ``[N, K]`` contiguous: route weights,
            multiplied in fp32; the weight of a route that is not read is not read."""
combine_get.__doc__ = combine_get.__doc__.format(
    args=_ARGS_DOC.format(shape="[N, K]", probs=_PROBS_DOC))
combine_get_fused.__doc__ = combine_get_fused.__doc__.format(
    args=_ARGS_DOC.format(shape="[N, K]", probs=_PROBS_DOC))
gather_get.__doc__ = gather_get.__doc__.format(args=_ARGS_DOC.format(shape="[N]", probs=""))


def combine_get_ref(sources: list[torch.Tensor], src_ranks: torch.Tensor,
                    src_rows: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-PyTorch :func:`combine_get` / :func:`combine_get_fused` of one rank reading
    ``sources`` (every rank's buffer, ``[R, D]`` bf16): fp32 sum in k order, so its bits
    are the kernels' on the CPU."""
    return rowwise_combine_get_ref(sources, src_ranks, src_rows, probs)


def combine_get_diff_ref(sources: list[torch.Tensor], src_ranks: torch.Tensor,
                         src_rows: torch.Tensor,
                         probs: torch.Tensor | None = None) -> torch.Tensor:
    """Differentiable plain-PyTorch :func:`combine_get` (any float dtype, sum in fp32 at
    least, result in the sources' dtype): routes not read add nothing."""
    dtype = sources[0].dtype
    wide = torch.promote_types(dtype, torch.float32)
    hidden = sources[0].shape[1]
    ranks, rows = src_ranks.tolist(), src_rows.tolist()
    out = []
    for t, (rank_t, row_t) in enumerate(zip(ranks, rows, strict=True)):
        acc = torch.zeros(hidden, dtype=wide, device=sources[0].device)
        for k, (rank, row) in enumerate(zip(rank_t, row_t, strict=True)):
            if rank < 0 or row < 0 or rank >= len(sources) or row >= sources[rank].shape[0]:
                continue
            term = sources[rank][row].to(wide)
            acc = acc + (term if probs is None else term * probs[t, k].to(wide))
        out.append(acc)
    if not out:
        return torch.zeros(0, hidden, dtype=dtype, device=sources[0].device)
    return torch.stack(out).to(dtype)
