"""Expert-major destination rows for the rowwise calls, from an all-gathered histogram.

:func:`expert_major_rows` gives every route of this rank its destination: the rank that owns
its expert, and a row there such that each expert rank receives its rows grouped by local
expert (the layout :func:`~distmoe.rowwise.grouped_mm` reads), then by source rank, then in
route order. Legend: N tokens, K routes each, E experts, EP ranks, ``E_local = E / EP``::

    counts[s, e]  routes of rank s to expert e (every rank's, by one all_gather)
    row(t, k)     = sum of counts[:, e'] over the experts e' of the owner before e
                    + sum of counts[s', e] over the source ranks s' before this one
                    + the route's place among this rank's routes to e (route-id order)
    received[j]   = sum over s of counts[s, first + j]   (rows of local expert j here)

Device ops and one collective (no host synchronisation; the all_gather is the process
group's: gloo on CPU tensors, NCCL on CUDA tensors).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distmoe.runtime.heap import solo


def expert_major_rows(expert_ids: torch.Tensor, num_experts: int,
                      group: dist.ProcessGroup | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """*Collective* (when the group has more than one rank). Destinations of this rank's routes.

    Args:
        expert_ids: integer ``[N, K]``: global expert ids, negative = inactive route.
        num_experts: E, divisible by the group's size.
        group: the expert-parallel group (``None``: the world group, or this process alone
            without torch.distributed).

    Returns ``(dst_ranks, dst_rows, received)``: int64 ``[N, K]`` each (-1 for an inactive
    route), for :func:`~distmoe.rowwise.dispatch_put` / ``combine_get``; and int64
    ``[E_local]``, the rows this rank receives per local expert (their cumulative sum, as
    int32, is :func:`~distmoe.rowwise.grouped_mm`'s ``offs``). Rows run from 0 to the rank's
    total received rows: a :class:`~distmoe.rowwise.Buffers` needs at least that many.
    """
    if not isinstance(expert_ids, torch.Tensor) or expert_ids.dim() != 2 or (
            expert_ids.dtype.is_floating_point or expert_ids.dtype == torch.bool):
        raise TypeError("expert_ids must be an integer [N, K] tensor, got "
                        f"{getattr(expert_ids, 'dtype', type(expert_ids).__name__)} of shape "
                        f"{list(getattr(expert_ids, 'shape', []))}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts ({num_experts!r}) must be an int >= 1")
    alone = solo(group)
    world = 1 if alone else dist.get_world_size(group)
    rank = 0 if alone else dist.get_rank(group)
    if num_experts % world:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by the group's size "
                         f"({world})")
    e_local = num_experts // world
    flat = expert_ids.reshape(-1).long()
    active = (flat >= 0) & (flat < num_experts)
    key = torch.where(active, flat, num_experts)  # inactive routes sort last
    # scatter_add, not bincount: bincount sizes its output from the data (a host read)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts = counts.scatter_add_(0, key, torch.ones_like(key))[:num_experts]
    if world > 1:
        every = [torch.empty_like(counts) for _ in range(world)]
        dist.all_gather(every, counts, group=group)
        every = torch.stack(every)  # [source rank, expert]
    else:
        every = counts[None]
    total = every.sum(0)
    before = total.cumsum(0) - total  # rows of all experts before e, over the whole group
    experts = torch.arange(num_experts, device=flat.device)
    first = experts // e_local * e_local  # the owner's first expert
    base = before - before[first] + every[:rank].sum(0)
    # place among this rank's routes to the same expert, in route-id order (a stable sort)
    order = torch.argsort(key, stable=True)
    starts = torch.cat([counts.new_zeros(1), counts.cumsum(0)])  # [E + 1], inactive last
    place_sorted = torch.arange(flat.numel(), device=flat.device) - starts[key[order]]
    place = torch.empty_like(place_sorted)
    place[order] = place_sorted
    safe = torch.where(active, flat, 0)
    dst_rows = torch.where(active, base[safe] + place, -1).view(expert_ids.shape)
    dst_ranks = torch.where(active, flat // e_local, -1).view(expert_ids.shape)
    received = every[:, rank * e_local:(rank + 1) * e_local].sum(0)
    return dst_ranks, dst_rows, received
