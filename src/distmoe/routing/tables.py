"""Device-side routing tables: from every rank's expert ids to expert-major pointer tables.

Shape legend: EP ranks, T tokens per rank (same physical T everywhere), K routes per token,
E_local experts on this rank, R_cap = static row capacity of the padded expert-major layout.

Algorithm (all torch ops on the rank's device, fixed shapes, no host synchronisation, so the
whole thing can be captured in a CUDA graph):

1. flatten the gathered ids ``expert_ids_EPTK`` to routes i = (src, t, k);
2. a route is *mine* when its global id lies in [rank*E_local, (rank+1)*E_local); its key is
   the local expert, or E_local for everything else (inactive, other ranks);
3. counts per local expert by ``scatter_add``; each count padded up to the row block;
   ``padded_offsets`` = exclusive prefix sum of the padded counts;
4. a stable sort by key gives expert-major order that keeps (src, t, k) order inside an expert;
   a route's row is padded_offsets[e] + its position inside the expert;
5. rows below R_cap get the route's source address (dispatch base of src + t*row_bytes) and
   return address (combine base of src + (t*K + k)*row_bytes); rows at or beyond R_cap are
   not executed and counted as dropped. Unused rows stay 0 (null): a null gather reads zeros,
   a null scatter is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RoutingTables:
    """Expert-major tables of one rank for one call (all on the rank's device).

    Attributes:
        padded_offsets: int32 [E_local + 1]; local expert e owns rows
            [padded_offsets[e], padded_offsets[e+1]), a multiple of the row block each; the
            last entry is the number of used rows. Offsets are clamped to R_cap: on overflow
            the experts past the capacity get empty segments.
        rows_per_expert: int32 [E_local] routes received per local expert (unpadded).
        gather_ptrs: int64 [R_cap] source row address (owner's dispatch buffer, row t) or 0.
        scatter_ptrs: int64 [R_cap] return address (owner's combine buffer, row t*K+k) or 0.
        bwd_scatter_ptrs: int64 [R_cap] backward return address (owner's dispatch buffer, row
            t*K+k) or 0; None in inference.
        route_of_row: int64 [R_cap] flat route index src*T*K + t*K + k of each row, -1 = null.
        num_recv_rows: int64 [] routes received by this rank in this call.
        num_dropped_rows: int64 [] received routes that did not fit in R_cap.
        is_route_executed_TK: bool [T, K] for this rank's own routes: True when the
            destination rank executes the route (active and within its R_cap); the owner
            combines only those (a dropped route's return slot is never written).
        num_invalid_ids: int64 [] ids of any rank outside [-1, E) (treated as inactive).
    """

    padded_offsets: torch.Tensor
    rows_per_expert: torch.Tensor
    gather_ptrs: torch.Tensor
    scatter_ptrs: torch.Tensor
    bwd_scatter_ptrs: torch.Tensor | None
    route_of_row: torch.Tensor
    num_recv_rows: torch.Tensor
    num_dropped_rows: torch.Tensor
    is_route_executed_TK: torch.Tensor
    num_invalid_ids: torch.Tensor


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
    row_capacity: int,
    dispatch_bases_EP: torch.Tensor,
    combine_bases_EP: torch.Tensor,
    row_bytes: int,
    training: bool,
) -> RoutingTables:
    """Build this rank's tables from all ranks' ids (see the module docstring).

    Args:
        expert_ids_EPTK: [EP, T, K] global expert ids of every rank (-1 = inactive), any int.
        rank: this rank; owns global experts rank*E_local .. (rank+1)*E_local - 1.
        num_local_experts: E_local.
        row_block: padding multiple of every expert's rows.
        row_capacity: R_cap, a multiple of row_block.
        dispatch_bases_EP / combine_bases_EP: int64 [EP] base addresses of every rank's
            dispatch and combine buffers (heap base tables).
        row_bytes: bytes of one row (D * 2 for bf16).
        training: also build the backward return table.
    """
    EP, T, K = expert_ids_EPTK.shape
    device = expert_ids_EPTK.device
    E_local = num_local_experts
    E = EP * E_local
    # Every rank sorts all EP*T*K routes by global expert, so each rank also knows where its
    # own routes land on their destination ranks (and whether they fit there).
    ids_i = expert_ids_EPTK.reshape(-1).to(torch.int64)
    is_active = (ids_i >= 0) & (ids_i < E)
    key_i = torch.where(is_active, ids_i, torch.full_like(ids_i, E))

    counts = torch.zeros(E + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key_i, torch.ones_like(key_i))
    padded = (counts[:E] + row_block - 1) // row_block * row_block
    # Exclusive prefix sum of padded counts inside each destination rank.
    padded_ends = padded.view(EP, E_local).cumsum(1)
    padded_starts = torch.cat([padded_ends.new_zeros(EP, 1), padded_ends], 1)  # [EP, E_local+1]
    unpadded_offsets = torch.zeros(E + 2, dtype=torch.int64, device=device)
    torch.cumsum(counts, 0, out=unpadded_offsets[1:])

    key_sorted, order = torch.sort(key_i, stable=True)
    position = torch.arange(key_sorted.numel(), device=device) - unpadded_offsets[key_sorted]
    start_of_expert = torch.cat([padded_starts[:, :E_local].reshape(-1),
                                 padded.new_zeros(1)])  # [E + 1], inactive -> 0
    row = start_of_expert[key_sorted] + position
    fits_sorted = (key_sorted < E) & (row < row_capacity)
    is_route_executed = torch.zeros_like(fits_sorted)
    is_route_executed[order] = fits_sorted

    dest_rank = key_sorted // E_local
    mine = (key_sorted < E) & (dest_rank == rank)
    fits = mine & fits_sorted
    # Rows that are not executed here go to a dump slot past the end, sliced away below.
    row = torch.where(fits, row, torch.full_like(row, row_capacity))
    # Clamped to R_cap so that no kernel walking an expert's segment (WGRAD row loops) can
    # step past the capacity on overflow; clamped ends stay multiples of the row block.
    padded_offsets = padded_starts[rank].clamp(max=row_capacity)
    rows_per_expert = counts[rank * E_local:(rank + 1) * E_local]

    src = order // (T * K)
    t = (order // K) % T
    tk = order % (T * K)
    gather_ptrs = torch.zeros(row_capacity + 1, dtype=torch.int64, device=device)
    gather_ptrs[row] = torch.where(fits, dispatch_bases_EP[src] + t * row_bytes, 0)
    scatter_ptrs = torch.zeros(row_capacity + 1, dtype=torch.int64, device=device)
    scatter_ptrs[row] = torch.where(fits, combine_bases_EP[src] + tk * row_bytes, 0)
    route_of_row = torch.full((row_capacity + 1,), -1, dtype=torch.int64, device=device)
    route_of_row[row] = torch.where(fits, order, -1)
    bwd = None
    if training:
        bwd = torch.zeros(row_capacity + 1, dtype=torch.int64, device=device)
        bwd[row] = torch.where(fits, dispatch_bases_EP[src] + tk * row_bytes, 0)
        bwd = bwd[:row_capacity]
    num_recv = mine.sum()
    own = is_route_executed.view(EP, T, K)[rank]
    return RoutingTables(
        padded_offsets=padded_offsets.to(torch.int32),
        rows_per_expert=rows_per_expert.to(torch.int32),
        gather_ptrs=gather_ptrs[:row_capacity],
        scatter_ptrs=scatter_ptrs[:row_capacity],
        bwd_scatter_ptrs=bwd,
        route_of_row=route_of_row[:row_capacity],
        num_recv_rows=num_recv,
        num_dropped_rows=num_recv - fits.sum(),
        is_route_executed_TK=own,
        num_invalid_ids=((ids_i < -1) | (ids_i >= E)).sum(),
    )
