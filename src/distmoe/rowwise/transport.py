"""The movement steps the rowwise forwards and backwards share (no barriers, no autograd):
PUT into a named heap buffer, GET (fused or gathered then reduced), and the per-route dot
products of the probability gradients.

The unfused reduction is :func:`distmoe.kernels.movement.combine.combine` (the MoEContext
owner combine) over the gathered ``[N*K, D]`` rows, with the gather's ``is_read`` flags as
its expert ids; :func:`get_reduce` with ``fused=True`` runs
:func:`distmoe.kernels.movement.rowwise_get.rowwise_combine_get` instead, with the same
arithmetic.
"""

from __future__ import annotations

import torch

from distmoe.kernels.movement.combine import combine
from distmoe.kernels.movement.rowwise_get import rowwise_combine_get, rowwise_gather
from distmoe.kernels.movement.rowwise_put import rowwise_put
from distmoe.rowwise.buffers import Buffers


def put(bufs: Buffers, name: str, x: torch.Tensor, ranks: torch.Tensor, rows: torch.Tensor,
        probs: torch.Tensor | None, *, count: bool) -> None:
    """Route ``(t, k)`` writes ``x[t]`` (times ``probs[t, k]``) into row ``rows[t, k]`` of
    buffer ``name`` on rank ``ranks[t, k]``."""
    rowwise_put(x, ranks, rows, bufs.bases(name), bufs.rows, probs=probs,
                bad_count=bufs.counter("put") if count else None)


def gather(bufs: Buffers, name: str, ranks: torch.Tensor, rows: torch.Tensor, *,
           count: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [*ranks.shape, D] bf16, is_read int8 [*ranks.shape])``: every route's row of
    buffer ``name`` (zeros where not read)."""
    out = torch.empty(*ranks.shape, bufs.hidden, dtype=bufs.dtype, device=bufs.device)
    is_read = torch.empty(ranks.shape, dtype=torch.int8, device=bufs.device)
    rowwise_gather(bufs.bases(name), bufs.rows, ranks, rows, out, is_read=is_read,
                   bad_count=bufs.counter("get") if count else None)
    return out, is_read


def reduce(gathered: torch.Tensor, is_read: torch.Tensor,
           probs: torch.Tensor | None) -> torch.Tensor:
    """``y[t] = bf16(sum over read k of w[t, k] * gathered[t, k])`` in fp32, ``w = probs``
    or 1 (gathered ``[N, K, D]``)."""
    num_tokens, top_k, hidden = gathered.shape
    y = torch.empty(num_tokens, hidden, dtype=gathered.dtype, device=gathered.device)
    if probs is None:
        probs = torch.ones(num_tokens, top_k, dtype=torch.float32, device=gathered.device)
    return combine(gathered, is_read, probs, y)


def get_reduce(bufs: Buffers, name: str, ranks: torch.Tensor, rows: torch.Tensor,
               probs: torch.Tensor | None, *, fused: bool, keep: bool, count: bool,
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(y [N, D], gathered, is_read)``: the (weighted) combine of every token's K routes
    read from buffer ``name``. Fused: one kernel, nothing gathered (``gathered`` and
    ``is_read`` are None); else gathered ``[N, K, D]`` then reduced (returned when
    ``keep``)."""
    if fused:
        y = torch.empty(ranks.shape[0], bufs.hidden, dtype=bufs.dtype, device=bufs.device)
        rowwise_combine_get(bufs.bases(name), bufs.rows, ranks, rows, y, probs=probs,
                            bad_count=bufs.counter("get") if count else None)
        return y, None, None
    gathered, is_read = gather(bufs, name, ranks, rows, count=count)
    y = reduce(gathered, is_read, probs)
    return (y, gathered, is_read) if keep else (y, None, None)


def route_dots(gathered: torch.Tensor, is_read: torch.Tensor, rows_ND: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """``out[t, k] = dot(fp32 gathered[t, k], fp32 rows_ND[t])`` where route ``(t, k)`` was
    read, else 0 (a probability's gradient), in ``dtype``."""
    dots = torch.bmm(gathered.float(), rows_ND.float().unsqueeze(-1)).squeeze(-1)
    return torch.where(is_read > 0, dots, 0.0).to(dtype)
