"""Device-side routing tables: from every rank's expert ids to expert-major pointer tables.

Shape legend: EP ranks, T tokens per rank (same physical T everywhere), K routes per token,
E_local experts on this rank, R_b = receive bound (rows a rank executes at most), R_cap =
static row capacity of the padded tile layout (R_b plus worst-case per-expert padding).

Two row numberings (see also :mod:`distmoe.kernels.base.rows`):

* **padded rows** (the tile schedule): expert e owns rows [padded_offsets[e],
  padded_offsets[e+1]), its executed rows first, then padding up to a multiple of the row
  block. Pointer tables (gather, scatter, backward scatter) are indexed by padded row; padding
  rows hold 0 (a null gather reads zeros, a null scatter is skipped).
* **activation rows** (compact, what activation memory holds): executed row j of expert e
  is activation row row_offsets[e] + j. The memory planner counts these rows.

Algorithm (all torch ops on the rank's device, fixed shapes, no host synchronisation, so the
whole thing can be captured in a CUDA graph). With E + 2 <= 1024, on a CUDA device or under
Triton's interpreter, Triton kernels in :mod:`distmoe.routing.fused` give the same tables
instead: one program for calls of at most 1024 routes, a blocked construction above):

1. flatten the gathered ids ``expert_ids_EPTK`` to routes i = (src, t, k); its key is its
   global expert, or E for inactive and invalid ids;
2. counts per expert by ``scatter_add``; a stable sort by key gives expert-major order that
   keeps (src, t, k) order inside an expert; a route's *compact index* on its destination
   rank is the number of routes to that rank's earlier experts plus its position inside the
   expert;
3. a route is executed iff its compact index is below R_b (so every rank knows the fate of
   its own routes and every rank's executed row count without communication); executed
   counts, padded to the row block, give ``padded_offsets``; their exclusive prefix sum gives
   ``row_offsets``;
4. executed routes of this rank get their source address (dispatch base of src +
   t*row_bytes) and return address (combine base of src + (t*K + k)*row_bytes) at their
   padded row. The others are counted as dropped and never written anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fused import (
    MAX_FUSED_EXPERTS,
    MAX_FUSED_ROUTES,
    auto_impl,
    build_routing_tables_triton,
    fused_eligible,
)


@dataclass(frozen=True)
class RoutingTables:
    """Expert-major tables of one rank for one call (all on the rank's device).

    Attributes:
        padded_offsets: int32 [E_local + 1]; local expert e owns padded rows
            [padded_offsets[e], padded_offsets[e+1]), its executed rows rounded up to the
            row block; the last entry (<= R_cap) is the number of used padded rows.
        row_offsets: int32 [E_local + 1]; exclusive prefix sum of executed rows per local
            expert: expert e's executed row j is activation row row_offsets[e] + j; the
            last entry (<= R_b) is the number of executed rows.
        rows_per_expert: int32 [E_local] routes received per local expert (executed or not).
        executed_rows_EP: int64 [EP] rows executed by every rank of the group in this call
            (the same vector on every rank; feeds the worst-rank save/replay decision).
        gather_ptrs: int64 [R_cap] source row address (owner's dispatch buffer, row t) or 0.
        scatter_ptrs: int64 [R_cap] return address (owner's combine buffer, row t*K+k) or 0.
        bwd_scatter_ptrs: int64 [R_cap] backward return address (owner's dispatch buffer, row
            t*K+k) or 0; None in inference.
        route_of_row: int64 [R_cap] flat route index src*T*K + t*K + k of each row, -1 = null.
        num_recv_rows: int64 [] routes received by this rank in this call.
        num_dropped_rows: int64 [] received routes beyond the receive bound (not executed).
        dest_rows_TK: int32 [T, K] for this rank's own routes: the activation row at which the
            destination rank executes the route (its compact index there), -1 when it is not
            executed (inactive, or beyond its receive bound: the owner combines only executed
            routes, a dropped route's return slot is never written). The backward writes each
            route's output gradient straight into that row of the destination's gathered
            grad_h3 (:mod:`distmoe.ops.autograd`).
        num_invalid_ids: int64 [] ids of any rank outside [-1, E) (treated as inactive).
    """

    padded_offsets: torch.Tensor
    row_offsets: torch.Tensor
    rows_per_expert: torch.Tensor
    executed_rows_EP: torch.Tensor
    gather_ptrs: torch.Tensor
    scatter_ptrs: torch.Tensor
    bwd_scatter_ptrs: torch.Tensor | None
    route_of_row: torch.Tensor
    num_recv_rows: torch.Tensor
    num_dropped_rows: torch.Tensor
    num_invalid_ids: torch.Tensor
    dest_rows_TK: torch.Tensor

    @property
    def is_route_executed_TK(self) -> torch.Tensor:
        """bool [T, K]: ``dest_rows_TK >= 0`` (one elementwise kernel, computed on use; the
        forward's combine reads ``dest_rows_TK`` itself)."""
        return self.dest_rows_TK >= 0


def row_capacity(receive_bound: int, num_local_experts: int, row_block: int) -> int:
    """R_cap: rows of the padded layout that hold ``receive_bound`` routed rows whatever their
    split over experts (each expert wastes at most row_block - 1 rows), rounded to the block."""
    rows = receive_bound + num_local_experts * (row_block - 1)
    return -(-rows // row_block) * row_block


def build_routing_tables(
    expert_ids_EPTK: torch.Tensor,
    *,
    rank: int,
    num_local_experts: int,
    row_block: int,
    receive_bound: int,
    dispatch_bases_EP: torch.Tensor,
    combine_bases_EP: torch.Tensor,
    row_bytes: int,
    training: bool,
    impl: str = "auto",
) -> RoutingTables:
    """Build this rank's tables from all ranks' ids (see the module docstring).

    Args:
        expert_ids_EPTK: [EP, T, K] global expert ids of every rank (-1 = inactive), any int.
        rank: this rank; owns global experts rank*E_local .. (rank+1)*E_local - 1.
        num_local_experts: E_local.
        row_block: padding multiple of every expert's padded segment.
        receive_bound: R_b, rows a rank executes at most; the pointer tables have
            ``row_capacity(R_b, E_local, row_block)`` rows.
        dispatch_bases_EP / combine_bases_EP: int64 [EP] base addresses of every rank's
            dispatch and combine buffers (heap base tables).
        row_bytes: bytes of one row (D * 2 for bf16).
        training: also build the backward return table.
        impl: ``"auto"`` (:func:`distmoe.routing.fused.auto_impl`: one Triton program for
            small calls, the blocked Triton construction for larger ones, torch ops where
            neither applies), ``"torch"``, ``"fused"`` (a ``ValueError`` when the call is
            too large for it) or ``"blocked"`` (Triton at any size). All give the same
            tables.
    """
    EP, T, K = expert_ids_EPTK.shape
    device = expert_ids_EPTK.device
    E_local = num_local_experts
    E = EP * E_local
    cap = row_capacity(receive_bound, E_local, row_block)
    if impl not in ("auto", "torch", "fused", "blocked"):
        raise ValueError(f"impl ({impl!r}) must be 'auto', 'torch', 'fused' or 'blocked'")
    kw = dict(rank=rank, num_local_experts=E_local, row_block=row_block,
              receive_bound=receive_bound, cap=cap, dispatch_bases_EP=dispatch_bases_EP,
              combine_bases_EP=combine_bases_EP, row_bytes=row_bytes, training=training)
    if impl == "auto":
        impl = auto_impl(EP * T * K, E, device)
    if impl == "blocked":
        if not fused_eligible(0, E, device):
            raise ValueError(
                f"impl='blocked' needs E + 2 <= {MAX_FUSED_EXPERTS} (E = {E}), on a CUDA "
                "device or under Triton's interpreter"
            )
        return RoutingTables(**build_routing_tables_triton(expert_ids_EPTK, blocked=True, **kw))
    if impl == "fused":
        if not fused_eligible(EP * T * K, E, device):
            raise ValueError(
                f"impl='fused' takes at most {MAX_FUSED_ROUTES} routes (EP*T*K = {EP * T * K}) "
                f"and E + 2 <= {MAX_FUSED_EXPERTS} (E = {E}), on a CUDA device or under "
                "Triton's interpreter"
            )
        return RoutingTables(**build_routing_tables_triton(expert_ids_EPTK, blocked=False, **kw))
    # Every rank sorts all EP*T*K routes by global expert, so each rank also knows where its
    # own routes land on their destination ranks (and whether they are executed there).
    ids_i = expert_ids_EPTK.reshape(-1).to(torch.int64)
    is_active = (ids_i >= 0) & (ids_i < E)
    key_i = torch.where(is_active, ids_i, torch.full_like(ids_i, E))

    counts = torch.zeros(E + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key_i, torch.ones_like(key_i))
    # Compact starts of every expert inside its destination rank, and executed counts.
    ends = counts[:E].view(EP, E_local).cumsum(1)
    starts = ends - counts[:E].view(EP, E_local)
    executed = ends.clamp(max=receive_bound) - starts.clamp(max=receive_bound)  # [EP, E_local]
    padded = (executed + row_block - 1) // row_block * row_block
    padded_starts = torch.cat([padded.new_zeros(EP, 1), padded.cumsum(1)], 1)  # [EP, E_l+1]
    unpadded_offsets = torch.zeros(E + 2, dtype=torch.int64, device=device)
    torch.cumsum(counts, 0, out=unpadded_offsets[1:])

    key_sorted, order = torch.sort(key_i, stable=True)
    position = torch.arange(key_sorted.numel(), device=device) - unpadded_offsets[key_sorted]
    compact_start = torch.cat([starts.reshape(-1), starts.new_zeros(1)])  # [E + 1]
    padded_start = torch.cat([padded_starts[:, :E_local].reshape(-1), padded.new_zeros(1)])
    fits_sorted = (key_sorted < E) & (compact_start[key_sorted] + position < receive_bound)
    # Own routes' activation rows on their destination ranks: a route's compact index (every
    # earlier expert of that rank is executed whole when this one is executed at all).
    dest_rows = torch.full_like(key_sorted, -1)
    dest_rows[order] = torch.where(fits_sorted, compact_start[key_sorted] + position, -1)

    dest_rank = key_sorted // E_local
    mine = (key_sorted < E) & (dest_rank == rank)
    fits = mine & fits_sorted
    # Rows that are not executed here go to a dump slot past the end, sliced away below.
    row = torch.where(fits, padded_start[key_sorted] + position, torch.full_like(position, cap))

    src = order // (T * K)
    t = (order // K) % T
    tk = order % (T * K)
    gather_ptrs = torch.zeros(cap + 1, dtype=torch.int64, device=device)
    gather_ptrs[row] = torch.where(fits, dispatch_bases_EP[src] + t * row_bytes, 0)
    scatter_ptrs = torch.zeros(cap + 1, dtype=torch.int64, device=device)
    scatter_ptrs[row] = torch.where(fits, combine_bases_EP[src] + tk * row_bytes, 0)
    route_of_row = torch.full((cap + 1,), -1, dtype=torch.int64, device=device)
    route_of_row[row] = torch.where(fits, order, -1)
    bwd = None
    if training:
        bwd = torch.zeros(cap + 1, dtype=torch.int64, device=device)
        bwd[row] = torch.where(fits, dispatch_bases_EP[src] + tk * row_bytes, 0)
        bwd = bwd[:cap]
    num_recv = mine.sum()
    my_executed = executed[rank]
    row_offsets = torch.cat([my_executed.new_zeros(1), my_executed.cumsum(0)])
    return RoutingTables(
        padded_offsets=padded_starts[rank].to(torch.int32),
        row_offsets=row_offsets.to(torch.int32),
        rows_per_expert=counts[rank * E_local:(rank + 1) * E_local].to(torch.int32),
        executed_rows_EP=executed.sum(1),
        gather_ptrs=gather_ptrs[:cap],
        scatter_ptrs=scatter_ptrs[:cap],
        bwd_scatter_ptrs=bwd,
        route_of_row=route_of_row[:cap],
        num_recv_rows=num_recv,
        num_dropped_rows=num_recv - fits.sum(),
        num_invalid_ids=((ids_i < -1) | (ids_i >= E)).sum(),
        dest_rows_TK=dest_rows.view(EP, T, K)[rank].to(torch.int32),
    )
