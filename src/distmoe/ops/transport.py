"""The ``"nccl"`` and ``"hierarchical"`` transports of :class:`~distmoe.ops.context.MoEContext`:
the layer over torch.distributed collectives, for ranks that cannot all map each other's
memory (more than one node).

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

Training: steps 1 and 4 are autograd functions over the tensor collectives, each one's
backward the other (all-gather's a reduce-scatter of the gradients, and the reverse; not
``torch.distributed.nn.functional``'s, whose gloo all-gather backward fails on a subgroup in
torch 2.13), and step 3 is the inner context's own autograd; the backward is collective like
the peer transport's.

``"hierarchical"``: the same four steps between nodes, with peer memory inside a node. The
EP ranks form N nodes of n consecutive ranks (``node_size`` n); rank r = a*n + i is local
rank i of node a. Steps 1 and 4 run over the *cross-node group* of local rank i (one rank
per node, N ranks), step 2 keeps the routes to node a's experts (E/N of them, numbered from
0 inside the node) and step 3 is a peer-memory :class:`MoEContext` over node a's n ranks
(E/N experts, max_tokens = N*T_max, the same receive bound in rows): a token gathered onto
rank i of node a reaches an expert on rank j of the node by peer memory, as in the peer
transport. With one node it is the peer transport with extra copies; with n = 1 it is
``"nccl"``.

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
from ..kernels.movement.local_routes import local_routes
from ..runtime.heap import gather_objects, solo

TRANSPORTS = ("auto", "peer", "nccl", "hierarchical")


def _hosts(group) -> list[str]:
    return gather_objects(socket.gethostname(), group, dist.get_world_size(group))


def _node_size_from_hosts(hosts: list[str]) -> int | None:
    """n where the ranks form nodes of n consecutive ranks on one host each, else None."""
    n = hosts.count(hosts[0])
    if len(hosts) % n:
        return None
    for a in range(0, len(hosts), n):
        if len(set(hosts[a:a + n])) != 1 or hosts.count(hosts[a]) != n:
            return None
    return n


def resolve_transport(transport: str, group, node_size: int | None = None
                      ) -> tuple[str, int | None]:
    """``(transport, node_size)``. *Collective* for ``"auto"`` and, without ``node_size``,
    for ``"hierarchical"`` (the group's host names are gathered). ``"auto"``: ``"peer"``
    where every rank of ``group`` runs on this host (a one-rank group included), else
    ``"hierarchical"`` where the ranks form nodes of equal size on one host each (more than
    one rank per node), else ``"nccl"``. ``node_size`` (hierarchical only): ranks per node;
    default from the host names (tests split one host into "nodes" with it)."""
    if not isinstance(transport, str) or transport not in TRANSPORTS:
        raise ValueError(f"transport ({transport!r}) must be one of {TRANSPORTS}")
    if node_size is not None and (isinstance(node_size, bool) or not isinstance(node_size, int)
                                  or node_size < 1):
        raise ValueError(f"node_size ({node_size!r}) must be None or an int >= 1")
    if node_size is not None and transport != "hierarchical":
        raise ValueError(f"node_size ({node_size}) is for transport='hierarchical', got "
                         f"transport={transport!r}")
    if transport in ("peer", "nccl"):
        return transport, None
    if transport == "auto":
        if solo(group) or dist.get_world_size(group) == 1:
            return "peer", None
        hosts = _hosts(group)
        if len(set(hosts)) == 1:
            return "peer", None
        n = _node_size_from_hosts(hosts)
        return ("hierarchical", n) if n is not None and n > 1 else ("nccl", None)
    if solo(group):
        raise ValueError("transport ('hierarchical') needs a torch.distributed group")
    world = dist.get_world_size(group)
    if node_size is None:
        node_size = _node_size_from_hosts(_hosts(group))
        if node_size is None:
            raise ValueError("transport ('hierarchical'): the ranks do not form nodes of "
                             "equal size on one host each; pass node_size")
    if world % node_size:
        raise ValueError(f"node_size ({node_size}) must divide the group size ({world})")
    return "hierarchical", node_size


def node_groups(group, node_size: int):
    """*Collective* over ``group`` (every rank creates every subgroup, in the same order):
    ``(node group, cross-node group)`` of this rank: the n consecutive ranks of its node, and
    the ranks of its local index on every node."""
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank(group)
    nodes = len(ranks) // node_size
    mine = [None, None]
    for a in range(nodes):  # node groups
        g = dist.new_group(ranks[a * node_size:(a + 1) * node_size])
        if me // node_size == a:
            mine[0] = g
    for i in range(node_size):  # cross-node groups
        g = dist.new_group(ranks[i::node_size])
        if me % node_size == i:
            mine[1] = g
    return mine[0], mine[1]


def inner_config(cfg: MoEConfig, ep_size: int, node_size: int = 1) -> MoEConfig:
    """The layer a node of ``node_size`` ranks runs its experts as (one rank for ``"nccl"``):
    E * node_size / EP experts, max_tokens of every node (EP / node_size * T_max), and a
    receive bound of the same rows per rank as ``cfg`` at ``ep_size``."""
    bound = cfg.receive_bound(ep_size)
    nodes = ep_size // node_size
    tokens = nodes * cfg.max_tokens
    factor = (bound - 0.5) / (tokens * cfg.top_k)  # ceil(factor * tokens * K) == bound
    inner = replace(cfg, num_experts=cfg.num_experts // nodes, max_tokens=tokens,
                    device_scratch_factor=factor, total_scratch_factor=None)
    assert inner.receive_bound(node_size) == bound, (inner.receive_bound(node_size), bound)
    return inner


class _AllGather(torch.autograd.Function):
    """``[EP*T, ...]`` = every rank's ``x [T, ...]`` in rank order; backward: the gradient
    rows of every rank summed over the ranks, each rank's own T rows (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group),
                              *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


class _ReduceScatter(torch.autograd.Function):
    """``[T, ...]`` = the sum over the ranks of their ``x [EP*T, ...]``'s rows of this rank;
    backward: the gradient all-gathered."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]))
        dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((dist.get_world_size(ctx.group) * grad.shape[0],
                              *grad.shape[1:]))
        dist.all_gather_into_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


def nccl_call(ctx, x, expert_ids, scores, w13, w2, *, autograd: bool) -> torch.Tensor:
    """Steps 1-4 of the module docstring for ``ctx`` (a context with ``transport`` "nccl" or
    "hierarchical"; inputs checked). Returns y [T, D] bf16; with ``autograd`` y has a
    grad_fn. The collectives run over ``ctx.cross_group`` (the group for "nccl", the
    cross-node group for "hierarchical"), whose size is ``EP`` here, and this rank keeps the
    routes to experts ``[ctx.expert_base, ctx.expert_base + ctx.inner.cfg.num_experts)``."""
    group = ctx.cross_group
    EP = dist.get_world_size(group)
    E = ctx.cfg.num_experts
    base, E_l = ctx.expert_base, ctx.inner.cfg.num_experts
    T, D = x.shape[0], ctx.cfg.hidden
    ids_all = torch.empty(EP * T, expert_ids.shape[1], dtype=torch.int32, device=ctx.device)
    dist.all_gather_into_tensor(ids_all, expert_ids.to(torch.int32).contiguous(), group=group)
    if autograd:
        x_all = _AllGather.apply(x, group)
        scores_all = _AllGather.apply(scores, group)
    else:
        x_all = torch.empty(EP * T, D, dtype=x.dtype, device=ctx.device)
        dist.all_gather_into_tensor(x_all, x, group=group)
        scores_all = torch.empty(EP * T, scores.shape[1], dtype=scores.dtype,
                                 device=ctx.device)
        dist.all_gather_into_tensor(scores_all, scores, group=group)
    # the invalid ids of every rank gathered from: every rank's with "nccl" (as the peer
    # transport counts them), the cross-node group's with "hierarchical"
    ids_local = torch.empty_like(ids_all)
    local_routes(ids_all, ids_local, ctx._invalid_ids, base=base, num_local=E_l,
                 num_experts=E)
    scores_local = torch.where(ids_local >= 0, scores_all,
                               torch.zeros((), dtype=scores_all.dtype, device=ctx.device))
    y_part = ctx.inner(x_all, ids_local, scores_local, w13, w2).float()
    if autograd:
        y = _ReduceScatter.apply(y_part, group)
    else:
        y = torch.empty(T, D, dtype=torch.float32, device=ctx.device)
        dist.reduce_scatter_tensor(y, y_part, group=group)
    return y.to(torch.bfloat16)
