"""One-program routing tables for small calls (decode and short prefill).

:func:`distmoe.routing.build_routing_tables` builds the tables from about 60 small torch ops
(fills, a radix sort, prefix sums, index scatters). At decode sizes each of those kernels is
a few microseconds of launch and tail, and together they cost as much as streaming a third of
the expert weights (0.14 ms of 0.36 ms at T=16, D=2048, F=768, E=128, K=8 on one H200,
2026-11-29, ``tools/profile_layer.py --tokens 16 --graph``). Here one Triton program does the
whole construction for up to :data:`MAX_FUSED_ROUTES` routes and :data:`MAX_FUSED_EXPERTS`
experts, after two fills of the padded-row tables. It gives the same tables bit for bit
(tested against the torch construction and an independent loop).

Steps inside the program (N = EP*T*K routes in lanes, padded to a power of two NP; expert
lanes padded to EB >= E + 2):

1. key = global expert of an active route, E for an inactive or invalid id, E + 1 for the
   padding lanes; a route's compound key ``key * NP + i`` sorted in registers (``tl.sort``)
   gives the stable expert-major order the torch path gets from a stable sort;
2. counts per key (``tl.histogram``) and prefix sums over expert lanes give each expert's
   compact start on its destination rank, executed rows (under the receive bound), padded
   start and activation-row start;
3. per-expert values that a lane needs at another index (a rank's first expert, a route's
   expert) go through a small global scratch and a CTA barrier (values written by one thread
   and read by another);
4. every route (sorted lane) writes its executed flag (own routes) and, when this rank runs
   it, its row's source, return and backward addresses and flat route index.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels._common import device_context, next_power_of_2
from ..kernels.interpreter import interpreter_active

#: Largest ``EP * T * K`` the one-program path takes (routes held in registers and sorted).
MAX_FUSED_ROUTES = 4096
#: Largest ``E + 2`` (expert lanes with the inactive and padding keys).
MAX_FUSED_EXPERTS = 1024


def fused_eligible(num_routes: int, num_experts: int, device: torch.device) -> bool:
    """True when :func:`build_routing_tables_fused` takes this call: at most
    :data:`MAX_FUSED_ROUTES` routes and ``E + 2 <= MAX_FUSED_EXPERTS``, on a CUDA device or
    under Triton's interpreter."""
    if num_routes > MAX_FUSED_ROUTES or num_experts + 2 > MAX_FUSED_EXPERTS:
        return False
    return device.type == "cuda" or interpreter_active()


@triton.jit
def _routing_tables_kernel(
    ids_ptr,  # [N] integer ids, flattened [EP, T, K]
    dispatch_bases_ptr,  # int64 [EP]
    combine_bases_ptr,  # int64 [EP]
    scratch_ptr,  # int32 [5 * EB]
    padded_offsets_ptr,  # int32 [E_LOCAL + 1]
    row_offsets_ptr,  # int32 [E_LOCAL + 1]
    rows_per_expert_ptr,  # int32 [E_LOCAL]
    executed_ep_ptr,  # int64 [EP]
    tables_ptr,  # int64 [3, CAP]: gather, scatter, bwd (prefilled with 0)
    route_of_row_ptr,  # int64 [CAP] (prefilled with -1)
    counters_ptr,  # int64 [3]: received, dropped, invalid ids
    executed_tk_ptr,  # bool [T * K]: this rank's own routes
    N,
    T,
    RANK,
    RECEIVE_BOUND,
    CAP,
    ROW_BYTES,
    K: tl.constexpr,
    E: tl.constexpr,
    E_LOCAL: tl.constexpr,
    EP: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    NP: tl.constexpr,
    EB: tl.constexpr,
    EPB: tl.constexpr,
    TRAINING: tl.constexpr,
):
    # ---- keys (comparisons in the ids' own dtype: a wide invalid id never wraps into range)
    lane = tl.arange(0, NP)
    valid = lane < N
    raw = tl.load(ids_ptr + lane, mask=valid, other=-1)
    active = (raw >= 0) & (raw < E)
    invalid = valid & ((raw < -1) | (raw >= E))
    key = tl.where(active, raw, E).to(tl.int32)
    key = tl.where(valid, key, E + 1)
    # ---- stable expert-major order: sort (key, route index) packed in one int32
    packed = tl.sort(key * NP + lane)
    key_s = packed // NP
    order = packed % NP
    # ---- per-expert counts and prefix sums (expert lanes)
    e = tl.arange(0, EB)
    counts = tl.histogram(key, EB)
    excl = tl.cumsum(counts, 0) - counts
    tl.store(scratch_ptr + e, excl)
    tl.debug_barrier()
    first = (e // E_LOCAL) * E_LOCAL  # first expert of e's destination rank
    is_expert = e < E
    starts = excl - tl.load(scratch_ptr + first)  # compact start inside the rank
    ends = starts + counts
    executed = tl.minimum(ends, RECEIVE_BOUND) - tl.minimum(starts, RECEIVE_BOUND)
    executed = tl.where(is_expert, executed, 0)
    padded = (executed + ROW_BLOCK - 1) // ROW_BLOCK * ROW_BLOCK
    padded_excl = tl.cumsum(padded, 0) - padded
    exec_excl = tl.cumsum(executed, 0) - executed
    tl.store(scratch_ptr + EB + e, padded_excl)
    tl.store(scratch_ptr + 2 * EB + e, exec_excl)
    tl.store(scratch_ptr + 3 * EB + e, starts)
    tl.debug_barrier()
    padded_start = padded_excl - tl.load(scratch_ptr + EB + first)
    row_start = exec_excl - tl.load(scratch_ptr + 2 * EB + first)
    tl.store(scratch_ptr + 4 * EB + e, padded_start)
    # ---- this rank's per-expert outputs
    mine_e = (e >= RANK * E_LOCAL) & (e < (RANK + 1) * E_LOCAL)
    j = e - RANK * E_LOCAL
    tl.store(padded_offsets_ptr + j, padded_start, mask=mine_e)
    tl.store(row_offsets_ptr + j, row_start, mask=mine_e)
    tl.store(rows_per_expert_ptr + j, counts, mask=mine_e)
    tl.store(padded_offsets_ptr + E_LOCAL, tl.sum(tl.where(mine_e, padded, 0), 0))
    tl.store(row_offsets_ptr + E_LOCAL, tl.sum(tl.where(mine_e, executed, 0), 0))
    tl.debug_barrier()
    # ---- executed rows of every rank: exec_excl[(r+1)*E_LOCAL] - exec_excl[r*E_LOCAL]
    r = tl.arange(0, EPB)
    r_ok = r < EP
    hi = tl.load(scratch_ptr + 2 * EB + (r + 1) * E_LOCAL, mask=r_ok, other=0)
    lo = tl.load(scratch_ptr + 2 * EB + r * E_LOCAL, mask=r_ok, other=0)
    tl.store(executed_ep_ptr + r, (hi - lo).to(tl.int64), mask=r_ok)
    # ---- routes, in sorted order (lane = sorted position)
    routed = key_s < E
    pos = lane - tl.load(scratch_ptr + key_s)
    compact = tl.load(scratch_ptr + 3 * EB + key_s) + pos
    fits_sorted = routed & (compact < RECEIVE_BOUND)
    mine = routed & (key_s // E_LOCAL == RANK)
    fits = mine & fits_sorted
    row = tl.load(scratch_ptr + 4 * EB + key_s) + pos
    row = tl.where(fits, row, 0)
    src = order // (T * K)
    t = (order // K) % T
    tk = (order % (T * K)).to(tl.int64)
    is_route = key_s <= E  # not a padding lane
    own = is_route & (src == RANK)
    tl.store(executed_tk_ptr + tk, fits_sorted, mask=own)
    dispatch = tl.load(dispatch_bases_ptr + src, mask=fits, other=0)
    combine = tl.load(combine_bases_ptr + src, mask=fits, other=0)
    tl.store(tables_ptr + row, dispatch + t.to(tl.int64) * ROW_BYTES, mask=fits)
    tl.store(tables_ptr + CAP + row, combine + tk * ROW_BYTES, mask=fits)
    if TRAINING:
        tl.store(tables_ptr + 2 * CAP + row, dispatch + tk * ROW_BYTES, mask=fits)
    tl.store(route_of_row_ptr + row, order.to(tl.int64), mask=fits)
    num_recv = tl.sum(mine.to(tl.int64), 0)
    tl.store(counters_ptr, num_recv)
    tl.store(counters_ptr + 1, num_recv - tl.sum(fits.to(tl.int64), 0))
    tl.store(counters_ptr + 2, tl.sum(invalid.to(tl.int64), 0))


def build_routing_tables_fused(
    expert_ids_EPTK: torch.Tensor,
    *,
    rank: int,
    num_local_experts: int,
    row_block: int,
    receive_bound: int,
    cap: int,
    dispatch_bases_EP: torch.Tensor,
    combine_bases_EP: torch.Tensor,
    row_bytes: int,
    training: bool,
):
    """:func:`distmoe.routing.build_routing_tables` in one Triton program (arguments as
    there, plus ``cap`` = R_cap); the caller checks :func:`fused_eligible`. Returns the
    :class:`~distmoe.routing.RoutingTables` fields as a dict."""
    EP, T, K = expert_ids_EPTK.shape
    device = expert_ids_EPTK.device
    E_local = num_local_experts
    E = EP * E_local
    N = EP * T * K
    NP = max(16, next_power_of_2(N))
    EB = max(16, next_power_of_2(E + 2))
    ids = expert_ids_EPTK.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    i32 = dict(dtype=torch.int32, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    scratch = torch.empty(5 * EB, **i32)
    padded_offsets = torch.empty(E_local + 1, **i32)
    row_offsets = torch.empty(E_local + 1, **i32)
    rows_per_expert = torch.empty(E_local, **i32)
    executed_EP = torch.empty(EP, **i64)
    tables = torch.zeros(3 if training else 2, cap, **i64)
    route_of_row = torch.full((cap,), -1, **i64)
    counters = torch.empty(3, **i64)
    executed_TK = torch.empty(T, K, dtype=torch.bool, device=device)
    if N > 0:
        with device_context(device):
            _routing_tables_kernel[(1,)](
                ids, dispatch_bases_EP, combine_bases_EP, scratch, padded_offsets,
                row_offsets, rows_per_expert, executed_EP, tables, route_of_row, counters,
                executed_TK, N, T, rank, receive_bound, cap, row_bytes,
                K=K, E=E, E_LOCAL=E_local, EP=EP, ROW_BLOCK=row_block, NP=NP, EB=EB,
                EPB=max(2, next_power_of_2(EP)), TRAINING=training,
                num_warps=4 if NP <= 1024 else 8,
            )  # fmt: skip
    else:  # no tokens: empty layout
        padded_offsets.zero_()
        row_offsets.zero_()
        rows_per_expert.zero_()
        executed_EP.zero_()
        counters.zero_()
    return dict(
        padded_offsets=padded_offsets,
        row_offsets=row_offsets,
        rows_per_expert=rows_per_expert,
        executed_rows_EP=executed_EP,
        gather_ptrs=tables[0],
        scatter_ptrs=tables[1],
        bwd_scatter_ptrs=tables[2] if training else None,
        route_of_row=route_of_row,
        num_recv_rows=counters[0],
        num_dropped_rows=counters[1],
        is_route_executed_TK=executed_TK,
        num_invalid_ids=counters[2],
    )
