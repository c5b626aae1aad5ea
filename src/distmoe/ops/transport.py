"""The ``"nccl"`` transport of :class:`~distmoe.ops.context.MoEContext`: the layer over
torch.distributed collectives, for ranks that cannot map each other's memory (more than one
node).

Per call on rank r of EP (T tokens per rank, K routes per token, E_local = E / EP experts per
rank), every step a collective of fixed size, so no host synchronisation is needed (the
splits are the same on every rank by construction; NCCL's own API forces none here):

    1. all-gather the tokens, their expert ids (as int32) and scores: x_all [EP*T, D],
       ids_all [EP*T, K], scores_all [EP*T, K] on every rank
    2. keep the routes to this rank's experts: ids_local = id - r*E_local where the id is one
       of them, else -1 (inactive); their scores, 0 elsewhere
    3. run them through a one-rank :class:`MoEContext` of this process (``inner``: E_local
       experts, max_tokens = EP*T_max, the same receive bound in rows): the same expert
       kernels, kernel plan, activation buffer, save/replay and CUDA graphs as the peer
       transport; its y_part [EP*T, D] holds, for every token, the sum over the routes this
       rank executed
    4. reduce-scatter the fp32 partial sums over the ranks: y [T, D] = bf16(sum_r y_part_r)

Training: steps 1 and 4 are ``torch.distributed.nn.functional`` collectives, whose backward
is the other one (all-gather's a reduce-scatter of the gradients, and the reverse), and step
3 is the inner context's own autograd; the backward is collective like the peer transport's.

Cost against the peer transport: the all-gather moves every token to every rank ((EP-1)*T*D
bf16 per rank, where the peer path moves only routed rows) and the reduce-scatter (EP-1)*T*D
fp32 back; the inner context's token-side buffers (dispatch and combine rows, a saved layer's
route results and inputs) are sized for EP*T_max tokens. Results differ from the peer
transport by the rounding of y: each rank's partial sum is rounded once to bf16 inside the
inner layer, then the partials are added in fp32 and rounded again (the peer path rounds the
whole sum once).
"""

from __future__ import annotations

import socket
from dataclasses import replace

import torch
import torch.distributed as dist

from ..config import MoEConfig
from ..runtime.heap import gather_objects, solo

TRANSPORTS = ("auto", "peer", "nccl")


def resolve_transport(transport: str, group) -> str:
    """*Collective* for ``"auto"``: ``"peer"`` where every rank of ``group`` runs on this
    host (a one-rank group included), else ``"nccl"``. ``"peer"`` / ``"nccl"`` as given."""
    if not isinstance(transport, str) or transport not in TRANSPORTS + ("hierarchical",):
        raise ValueError(f"transport ({transport!r}) must be one of {TRANSPORTS}")
    if transport == "hierarchical":
        raise ValueError("transport ('hierarchical'): peer memory inside a node with NCCL "
                         "between nodes is not implemented yet; use 'nccl'")
    if transport != "auto":
        return transport
    if solo(group) or dist.get_world_size(group) == 1:
        return "peer"
    hosts = gather_objects(socket.gethostname(), group, dist.get_world_size(group))
    return "peer" if len(set(hosts)) == 1 else "nccl"


def inner_config(cfg: MoEConfig, ep_size: int) -> MoEConfig:
    """The one-rank layer a rank runs its experts as: E_local experts, EP*T_max tokens, and a
    receive bound of the same rows as ``cfg`` at ``ep_size``."""
    bound = cfg.receive_bound(ep_size)
    tokens = ep_size * cfg.max_tokens
    factor = (bound - 0.5) / (tokens * cfg.top_k)  # ceil(factor * tokens * K) == bound
    inner = replace(cfg, num_experts=cfg.experts_per_rank(ep_size), max_tokens=tokens,
                    device_scratch_factor=factor, total_scratch_factor=None)
    assert inner.receive_bound(1) == bound, (inner.receive_bound(1), bound)
    return inner


def nccl_call(ctx, x, expert_ids, scores, w13, w2, *, autograd: bool) -> torch.Tensor:
    """Steps 1-4 of the module docstring for ``ctx`` (a context with ``transport="nccl"``;
    inputs checked). Returns y [T, D] bf16; with ``autograd`` y has a grad_fn."""
    group, EP, rank = ctx.group, ctx.ep_size, ctx.rank
    E, E_l = ctx.cfg.num_experts, ctx.num_local_experts
    T, D = x.shape[0], ctx.cfg.hidden
    ids_all = torch.empty(EP * T, expert_ids.shape[1], dtype=torch.int32, device=ctx.device)
    dist.all_gather_into_tensor(ids_all, expert_ids.to(torch.int32).contiguous(), group=group)
    if autograd:
        from torch.distributed.nn.functional import all_gather, reduce_scatter

        x_all = torch.cat(all_gather(x, group=group))
        scores_all = torch.cat(all_gather(scores, group=group))
    else:
        x_all = torch.empty(EP * T, D, dtype=x.dtype, device=ctx.device)
        dist.all_gather_into_tensor(x_all, x, group=group)
        scores_all = torch.empty(EP * T, scores.shape[1], dtype=scores.dtype,
                                 device=ctx.device)
        dist.all_gather_into_tensor(scores_all, scores, group=group)
    # every rank counts every rank's invalid ids, as the peer transport does
    ctx._invalid_ids += ((ids_all < -1) | (ids_all >= E)).sum()
    local = ids_all - rank * E_l
    mine = (ids_all >= 0) & (ids_all < E) & (local >= 0) & (local < E_l)
    ids_local = torch.where(mine, local, -1)
    scores_local = torch.where(mine, scores_all, torch.zeros((), dtype=scores_all.dtype,
                                                             device=ctx.device))
    y_part = ctx.inner(x_all, ids_local, scores_local, w13, w2).float()
    if autograd:
        y = reduce_scatter(torch.empty(T, D, dtype=torch.float32, device=ctx.device),
                           list(y_part.chunk(EP)), group=group)
    else:
        y = torch.empty(T, D, dtype=torch.float32, device=ctx.device)
        dist.reduce_scatter_tensor(y, y_part, group=group)
    return y.to(torch.bfloat16)
