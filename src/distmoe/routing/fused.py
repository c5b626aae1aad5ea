"""One-program routing tables for small calls (decode and short prefill).

:func:`distmoe.routing.build_routing_tables` builds the tables from about 60 small torch ops
(fills, a radix sort, prefix sums, index scatters). At decode sizes each of those kernels is
a few microseconds of launch and tail, and together they cost about as much as streaming a
third of the expert weights (evidence: docs/performance.md). Here one Triton program does the
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
4. every route (sorted lane) writes its destination row (own routes; -1 when not executed)
   and, when this rank runs it, its row's source, return and backward addresses and flat
   route index.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels.base.config import next_power_of_2
from ..kernels.base.device import device_context
from ..kernels.base.interpreter import interpreter_active

#: Largest ``EP * T * K`` the one-program path takes (routes held in registers and sorted).
MAX_FUSED_ROUTES = 4096
#: Largest ``E + 2`` (expert lanes with the inactive and padding keys).
MAX_FUSED_EXPERTS = 1024
#: ``impl="auto"`` takes the one-program path up to this many routes and the blocked path
#: above: the single program's sort grows with N, while the blocked path's blocks run in
#: parallel (evidence: docs/performance.md).
AUTO_FUSED_ROUTES = 1024


def fused_eligible(num_routes: int, num_experts: int, device: torch.device) -> bool:
    """True when the one-program path takes this call: at most
    :data:`MAX_FUSED_ROUTES` routes and ``E + 2 <= MAX_FUSED_EXPERTS``, on a CUDA device or
    under Triton's interpreter."""
    if num_routes > MAX_FUSED_ROUTES or num_experts + 2 > MAX_FUSED_EXPERTS:
        return False
    return device.type == "cuda" or interpreter_active()


def auto_impl(num_routes: int, num_experts: int, device: torch.device) -> str:
    """The implementation ``build_routing_tables(impl="auto")`` runs: ``"fused"`` for at most
    :data:`AUTO_FUSED_ROUTES` routes, ``"blocked"`` above, both only with
    ``E + 2 <= MAX_FUSED_EXPERTS`` on a CUDA device or under Triton's interpreter;
    ``"torch"`` otherwise. Depends on shapes alone (never on routed counts), so a captured
    graph and an eager call take the same path."""
    if not fused_eligible(0, num_experts, device):
        return "torch"
    return "fused" if num_routes <= AUTO_FUSED_ROUTES else "blocked"


@triton.jit
def _keys(ids_ptr, i, valid, E: tl.constexpr):
    """Route keys: the global expert of an active route, E for an inactive or invalid id,
    E + 1 for lanes past the last route; and the invalid-id flags. Ids are widened to int64
    before any comparison, so a wide invalid id never wraps into range and E fits beside a
    narrow id dtype."""
    raw = tl.load(ids_ptr + i, mask=valid, other=-1).to(tl.int64)
    active = (raw >= 0) & (raw < E)
    invalid = valid & ((raw < -1) | (raw >= E))
    key = tl.where(active, raw, E).to(tl.int32)
    return tl.where(valid, key, E + 1), invalid


@triton.jit
def _expert_layout(
    counts, scratch_ptr, padded_offsets_ptr, row_offsets_ptr, rows_per_expert_ptr,
    executed_ep_ptr, RANK, RECEIVE_BOUND, E: tl.constexpr, E_LOCAL: tl.constexpr,
    EP: tl.constexpr, ROW_BLOCK: tl.constexpr, EB: tl.constexpr, EPB: tl.constexpr,
):  # fmt: skip
    """From the routes per key (``counts`` over EB expert lanes): every expert's compact
    start on its destination rank, executed rows, padded start and activation-row start.
    Writes this rank's offsets, every rank's executed rows, and into ``scratch`` (int32
    ``[5 * EB]``) the exclusive prefix of the counts at ``[0, EB)``, the compact starts at
    ``[3 EB, 4 EB)`` and the padded starts at ``[4 EB, 5 EB)``. Ends with a CTA barrier, so
    any thread of the program may read them."""
    e = tl.arange(0, EB)
    excl = tl.cumsum(counts, 0) - counts
    tl.store(scratch_ptr + e, excl)
    tl.debug_barrier()
    first = (e // E_LOCAL) * E_LOCAL  # first expert of e's destination rank
    starts = excl - tl.load(scratch_ptr + first)  # compact start inside the rank
    ends = starts + counts
    executed = tl.minimum(ends, RECEIVE_BOUND) - tl.minimum(starts, RECEIVE_BOUND)
    executed = tl.where(e < E, executed, 0)
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
    # this rank's per-expert outputs
    mine_e = (e >= RANK * E_LOCAL) & (e < (RANK + 1) * E_LOCAL)
    j = e - RANK * E_LOCAL
    tl.store(padded_offsets_ptr + j, padded_start, mask=mine_e)
    tl.store(row_offsets_ptr + j, row_start, mask=mine_e)
    tl.store(rows_per_expert_ptr + j, counts, mask=mine_e)
    tl.store(padded_offsets_ptr + E_LOCAL, tl.sum(tl.where(mine_e, padded, 0), 0))
    tl.store(row_offsets_ptr + E_LOCAL, tl.sum(tl.where(mine_e, executed, 0), 0))
    # executed rows of every rank: exec_excl[(r+1)*E_LOCAL] - exec_excl[r*E_LOCAL]
    r = tl.arange(0, EPB)
    r_ok = r < EP
    hi = tl.load(scratch_ptr + 2 * EB + (r + 1) * E_LOCAL, mask=r_ok, other=0)
    lo = tl.load(scratch_ptr + 2 * EB + r * E_LOCAL, mask=r_ok, other=0)
    tl.store(executed_ep_ptr + r, (hi - lo).to(tl.int64), mask=r_ok)
    tl.debug_barrier()


@triton.jit
def _route_stores(
    key, pos, route, scratch_ptr, dispatch_bases_ptr, combine_bases_ptr, tables_ptr,
    route_of_row_ptr, dest_rows_tk_ptr, T, RANK, RECEIVE_BOUND, CAP, ROW_BYTES,
    K: tl.constexpr, E: tl.constexpr, E_LOCAL: tl.constexpr, EB: tl.constexpr,
    TRAINING: tl.constexpr,
):  # fmt: skip
    """Each route's fate and, when this rank runs it, its row's addresses. ``key`` as from
    :func:`_keys`, ``pos`` the route's position inside its expert (in route order), ``route``
    its flat index ``src*T*K + t*K + k``; the compact and padded starts come from the scratch
    that :func:`_expert_layout` wrote. Returns ``(mine, fits)``: received here, and executed
    here."""
    routed = key < E
    compact = tl.load(scratch_ptr + 3 * EB + key) + pos
    fits_anywhere = routed & (compact < RECEIVE_BOUND)
    mine = routed & (key // E_LOCAL == RANK)
    fits = mine & fits_anywhere
    row = tl.where(fits, tl.load(scratch_ptr + 4 * EB + key) + pos, 0)
    src = route // (T * K)
    t = (route // K) % T
    tk = (route % (T * K)).to(tl.int64)
    own = (key <= E) & (src == RANK)  # this rank's own routes (not lanes past the last)
    # own routes: the activation row the destination rank executes it at (its compact index:
    # every earlier expert of that rank is executed whole), -1 when it is not executed
    tl.store(dest_rows_tk_ptr + tk, tl.where(fits_anywhere, compact, -1), mask=own)
    dispatch = tl.load(dispatch_bases_ptr + src, mask=fits, other=0)
    combine = tl.load(combine_bases_ptr + src, mask=fits, other=0)
    tl.store(tables_ptr + row, dispatch + t.to(tl.int64) * ROW_BYTES, mask=fits)
    tl.store(tables_ptr + CAP + row, combine + tk * ROW_BYTES, mask=fits)
    if TRAINING:
        tl.store(tables_ptr + 2 * CAP + row, dispatch + tk * ROW_BYTES, mask=fits)
    tl.store(route_of_row_ptr + row, route.to(tl.int64), mask=fits)
    return mine, fits


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
    tables_ptr,  # int64 [2 or 3, CAP]: gather, scatter (, bwd), prefilled with 0
    route_of_row_ptr,  # int64 [CAP], prefilled with -1
    counters_ptr,  # int64 [3]: received, dropped, invalid ids
    dest_rows_tk_ptr,  # int32 [T * K]: this rank's own routes
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
    """One program: every route of the call in registers (NP lanes)."""
    lane = tl.arange(0, NP)
    key, invalid = _keys(ids_ptr, lane, lane < N, E)
    # stable expert-major order: sort (key, route index) packed in one int32
    packed = tl.sort(key * NP + lane)
    key_s = packed // NP
    _expert_layout(
        tl.histogram(key, EB), scratch_ptr, padded_offsets_ptr, row_offsets_ptr,
        rows_per_expert_ptr, executed_ep_ptr, RANK, RECEIVE_BOUND, E, E_LOCAL, EP, ROW_BLOCK,
        EB, EPB,
    )  # fmt: skip
    # routes in sorted order: a lane's sorted position minus its key's first position
    pos = lane - tl.load(scratch_ptr + key_s)
    mine, fits = _route_stores(
        key_s, pos, packed % NP, scratch_ptr, dispatch_bases_ptr, combine_bases_ptr,
        tables_ptr, route_of_row_ptr, dest_rows_tk_ptr, T, RANK, RECEIVE_BOUND, CAP, ROW_BYTES,
        K, E, E_LOCAL, EB, TRAINING,
    )  # fmt: skip
    num_recv = tl.sum(mine.to(tl.int64), 0)
    tl.store(counters_ptr, num_recv)
    tl.store(counters_ptr + 1, num_recv - tl.sum(fits.to(tl.int64), 0))
    tl.store(counters_ptr + 2, tl.sum(invalid.to(tl.int64), 0))


@triton.jit
def _block_ranks_kernel(
    ids_ptr,  # [N] integer ids
    hist_ptr,  # int32 [NB, EB]: routes per key in each block of BLOCK routes
    scratch_ptr,  # int32 [NB, EB]: per block, exclusive prefix of its counts
    rank_ptr,  # int32 [N]: a route's position among its block's routes of the same key
    N,
    E: tl.constexpr,
    BLOCK: tl.constexpr,
    EB: tl.constexpr,
):
    """Blocked path, step 1 (one program per block of routes)."""
    b = tl.program_id(0)
    lane = tl.arange(0, BLOCK)
    i = b * BLOCK + lane
    key, _ = _keys(ids_ptr, i, i < N, E)
    counts = tl.histogram(key, EB)
    e = tl.arange(0, EB)
    tl.store(hist_ptr + b * EB + e, counts)
    tl.store(scratch_ptr + b * EB + e, tl.cumsum(counts, 0) - counts)
    tl.debug_barrier()
    packed = tl.sort(key * BLOCK + lane)
    key_s = packed // BLOCK
    route = b * BLOCK + packed % BLOCK
    pos = lane - tl.load(scratch_ptr + b * EB + key_s)
    tl.store(rank_ptr + route, pos, mask=route < N)


@triton.jit
def _block_prefix_kernel(
    hist_ptr,  # int32 [NB, EB]
    incl_ptr,  # int32 [NB, EB]: inclusive prefix of hist over blocks
    NB,
    EB: tl.constexpr,
    COLS: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Blocked path, step 2a (one program per ``COLS`` keys): the prefix sum over blocks,
    ``ROWS`` blocks at a time with a running carry, in place of a ``torch.cumsum`` over dim
    0, which is several times slower at these small shapes (evidence: docs/performance.md)."""
    cols = tl.program_id(0) * COLS + tl.arange(0, COLS)
    carry = tl.zeros([COLS], dtype=tl.int32)
    r0 = 0
    while r0 < NB:  # (a while loop: Triton 3.6's interpreter cannot range over an argument)
        rows = r0 + tl.arange(0, ROWS)
        cells = rows[:, None] * EB + cols[None, :]
        live = (rows < NB)[:, None] & (cols < EB)[None, :]
        h = tl.load(hist_ptr + cells, mask=live, other=0)
        tl.store(incl_ptr + cells, tl.cumsum(h, 0) + carry[None, :], mask=live)
        carry += tl.sum(h, 0)
        r0 += ROWS


@triton.jit
def _blocked_layout_kernel(
    counts_ptr,  # int32 [EB]: routes per key over all blocks
    scratch_ptr,  # int32 [5 * EB]
    padded_offsets_ptr,
    row_offsets_ptr,
    rows_per_expert_ptr,
    executed_ep_ptr,
    RANK,
    RECEIVE_BOUND,
    E: tl.constexpr,
    E_LOCAL: tl.constexpr,
    EP: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    EB: tl.constexpr,
    EPB: tl.constexpr,
):
    """Blocked path, step 2 (one program)."""
    counts = tl.load(counts_ptr + tl.arange(0, EB))
    _expert_layout(
        counts, scratch_ptr, padded_offsets_ptr, row_offsets_ptr, rows_per_expert_ptr,
        executed_ep_ptr, RANK, RECEIVE_BOUND, E, E_LOCAL, EP, ROW_BLOCK, EB, EPB,
    )  # fmt: skip


@triton.jit
def _blocked_routes_kernel(
    ids_ptr,
    hist_ptr,  # int32 [NB, EB]
    incl_ptr,  # int32 [NB, EB]: inclusive prefix of hist over blocks
    rank_ptr,  # int32 [N]
    scratch_ptr,  # int32 [5 * EB] from step 2
    dispatch_bases_ptr,
    combine_bases_ptr,
    tables_ptr,
    route_of_row_ptr,
    counters_ptr,  # int64 [3], zeroed; summed with integer atomics (order-independent)
    dest_rows_tk_ptr,
    N,
    T,
    RANK,
    RECEIVE_BOUND,
    CAP,
    ROW_BYTES,
    K: tl.constexpr,
    E: tl.constexpr,
    E_LOCAL: tl.constexpr,
    BLOCK: tl.constexpr,
    EB: tl.constexpr,
    TRAINING: tl.constexpr,
):
    """Blocked path, step 3 (one program per block of routes, in route order)."""
    b = tl.program_id(0)
    i = b * BLOCK + tl.arange(0, BLOCK)
    valid = i < N
    key, invalid = _keys(ids_ptr, i, valid, E)
    # routes of the same key in earlier blocks, then earlier in this block
    cell = b * EB + key
    pos = tl.load(incl_ptr + cell) - tl.load(hist_ptr + cell)
    pos += tl.load(rank_ptr + i, mask=valid, other=0)
    mine, fits = _route_stores(
        key, pos, i, scratch_ptr, dispatch_bases_ptr, combine_bases_ptr, tables_ptr,
        route_of_row_ptr, dest_rows_tk_ptr, T, RANK, RECEIVE_BOUND, CAP, ROW_BYTES, K, E,
        E_LOCAL, EB, TRAINING,
    )  # fmt: skip
    tl.atomic_add(counters_ptr, tl.sum(mine.to(tl.int64), 0))
    tl.atomic_add(counters_ptr + 1, tl.sum((mine & ~fits).to(tl.int64), 0))
    tl.atomic_add(counters_ptr + 2, tl.sum(invalid.to(tl.int64), 0))

class _Outputs:
    """The output tensors of one call (shapes in :class:`~distmoe.routing.RoutingTables`)."""

    def __init__(self, EP, T, K, E_local, cap, training, device, *, zero_counters=False):
        i32 = dict(dtype=torch.int32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        self.padded_offsets = torch.empty(E_local + 1, **i32)
        self.row_offsets = torch.empty(E_local + 1, **i32)
        self.rows_per_expert = torch.empty(E_local, **i32)
        self.executed_EP = torch.empty(EP, **i64)
        self.tables = torch.zeros(3 if training else 2, cap, **i64)
        self.route_of_row = torch.full((cap,), -1, **i64)
        self.counters = (torch.zeros if zero_counters else torch.empty)(3, **i64)
        self.dest_rows_TK = torch.empty(T, K, **i32)
        self.training = training

    def empty_call(self):
        """No routes (T = 0): an empty layout."""
        for t in (self.padded_offsets, self.row_offsets, self.rows_per_expert,
                  self.executed_EP, self.counters):
            t.zero_()

    def fields(self) -> dict:
        return dict(
            padded_offsets=self.padded_offsets,
            row_offsets=self.row_offsets,
            rows_per_expert=self.rows_per_expert,
            executed_rows_EP=self.executed_EP,
            gather_ptrs=self.tables[0],
            scatter_ptrs=self.tables[1],
            bwd_scatter_ptrs=self.tables[2] if self.training else None,
            route_of_row=self.route_of_row,
            num_recv_rows=self.counters[0],
            num_dropped_rows=self.counters[1],
            dest_rows_TK=self.dest_rows_TK,
            num_invalid_ids=self.counters[2],
        )


def _flat_ids(expert_ids_EPTK: torch.Tensor) -> torch.Tensor:
    ids = expert_ids_EPTK.reshape(-1)
    return ids if ids.is_contiguous() else ids.contiguous()


def _bases(dispatch_bases_EP: torch.Tensor, combine_bases_EP: torch.Tensor):
    """The kernels index the base tables as flat arrays: contiguous int64 views (no copy for
    the heap's own tables)."""
    return (dispatch_bases_EP.to(torch.int64).contiguous(),
            combine_bases_EP.to(torch.int64).contiguous())


#: Routes per program of the blocked path (sorted in registers).
BLOCKED_ROUTES_PER_PROGRAM = 1024
#: the blocked path's prefix over blocks: keys per program, blocks per step
_PREFIX_COLS = 64
_PREFIX_ROWS = 32


def build_routing_tables_triton(
    expert_ids_EPTK: torch.Tensor,
    *,
    blocked: bool,
    rank: int,
    num_local_experts: int,
    row_block: int,
    receive_bound: int,
    cap: int,
    dispatch_bases_EP: torch.Tensor,
    combine_bases_EP: torch.Tensor,
    row_bytes: int,
    training: bool,
) -> dict:
    """:func:`distmoe.routing.build_routing_tables` in Triton (arguments as there, plus
    ``cap`` = R_cap); returns the :class:`~distmoe.routing.RoutingTables` fields as a dict.
    Both paths need ``E + 2 <= MAX_FUSED_EXPERTS``.

    ``blocked=False``: one program holds every route (the caller checks
    :func:`fused_eligible`). ``blocked=True``: calls of any size in four Triton launches:

    1. per block of :data:`BLOCKED_ROUTES_PER_PROGRAM` routes, its routes per key and each
       route's position among its block's routes of the same key (an in-register sort);
    2. the prefix sum of the block counts over blocks (one program per 64 keys); one program
       lays out the experts from the totals;
    3. per block, each route's position in its expert (earlier blocks' count plus its
       in-block position) and its stores; the counters are integer atomics, so the result
       does not depend on the order in which blocks run.

    ``impl="auto"`` takes the blocked path above :data:`AUTO_FUSED_ROUTES` routes
    (:func:`auto_impl`).
    """
    EP, T, K = expert_ids_EPTK.shape
    device = expert_ids_EPTK.device
    E = EP * num_local_experts
    N = EP * T * K
    EB = max(16, next_power_of_2(E + 2))
    EPB = max(2, next_power_of_2(EP))
    # the blocked path sums its counters with atomics: they start at zero
    out = _Outputs(EP, T, K, num_local_experts, cap, training, device, zero_counters=blocked)
    if N == 0:
        out.empty_call()
        return out.fields()
    ids = _flat_ids(expert_ids_EPTK)
    scratch = torch.empty(5 * EB, dtype=torch.int32, device=device)
    dispatch_bases_EP, combine_bases_EP = _bases(dispatch_bases_EP, combine_bases_EP)
    if not blocked:
        NP = max(16, next_power_of_2(N))
        with device_context(device):
            _routing_tables_kernel[(1,)](
                ids, dispatch_bases_EP, combine_bases_EP, scratch, out.padded_offsets,
                out.row_offsets, out.rows_per_expert, out.executed_EP, out.tables,
                out.route_of_row, out.counters, out.dest_rows_TK, N, T, rank, receive_bound, cap,
                row_bytes,
                K=K, E=E, E_LOCAL=num_local_experts, EP=EP, ROW_BLOCK=row_block, NP=NP, EB=EB,
                EPB=EPB, TRAINING=training, num_warps=4 if NP <= 1024 else 8,
            )  # fmt: skip
        return out.fields()
    BLOCK = BLOCKED_ROUTES_PER_PROGRAM
    NB = triton.cdiv(N, BLOCK)
    hist = torch.empty(NB, EB, dtype=torch.int32, device=device)
    block_scratch = torch.empty(NB, EB, dtype=torch.int32, device=device)
    ranks = torch.empty(N, dtype=torch.int32, device=device)
    with device_context(device):
        _block_ranks_kernel[(NB,)](ids, hist, block_scratch, ranks, N, E=E, BLOCK=BLOCK, EB=EB,
                                   num_warps=4)
        incl = torch.empty_like(hist)
        _block_prefix_kernel[(triton.cdiv(EB, _PREFIX_COLS),)](
            hist, incl, NB, EB=EB, COLS=_PREFIX_COLS, ROWS=_PREFIX_ROWS, num_warps=4)
        _blocked_layout_kernel[(1,)](
            incl[-1], scratch, out.padded_offsets, out.row_offsets, out.rows_per_expert,
            out.executed_EP, rank, receive_bound,
            E=E, E_LOCAL=num_local_experts, EP=EP, ROW_BLOCK=row_block, EB=EB, EPB=EPB,
            num_warps=4,
        )  # fmt: skip
        _blocked_routes_kernel[(NB,)](
            ids, hist, incl, ranks, scratch, dispatch_bases_EP, combine_bases_EP, out.tables,
            out.route_of_row, out.counters, out.dest_rows_TK, N, T, rank, receive_bound, cap,
            row_bytes,
            K=K, E=E, E_LOCAL=num_local_experts, BLOCK=BLOCK, EB=EB, TRAINING=training,
            num_warps=4,
        )  # fmt: skip
    return out.fields()
