"""Rowwise PUT: every route pushes its token row into a row of a peer's heap buffer.

Legend: N token rows on this rank, K routes per token (route id ``t*K + k``), D = hidden,
EP ranks, R rows per rank's destination buffer.

For every route ``(t, k)`` with ``rank = dst_ranks[t, k]`` and ``row = dst_rows[t, k]``::

    invalid  rank < 0 or row < 0                  skipped (nothing written, not counted)
    bad      valid, and rank >= EP or row >= R    skipped and counted in ``bad_count``
    moved    otherwise:  out@rank[row] = x[t]                     (unweighted)
                         out@rank[row] = bf16(fp32(x[t]) * fp32(probs[t, k]))  (weighted)

``out@rank`` is rank ``rank``'s buffer, addressed through ``bases_EP`` (its base address as
mapped in this process, :meth:`distmoe.runtime.SymmetricHeap.base_table`). Two routes that
name the same destination row race: which one lands is undefined (callers give each route
its own row).

Algorithm: one program owns ``block_r`` routes x ``block_d`` columns; it reads the routes'
ranks and rows once, loads the token rows (served by L1/L2 when a token's K routes share a
program) and stores them with plain stores into the peers' memory (peer-to-peer over NVLink
on the CUDA heaps, a shared mapping on the CPU heap). The programs of column block 0 add
their bad routes to ``bad_count`` (one atomic per program that has any). Memory-bound:
reads ``N*D`` (once per route, cached) and writes ``moved routes * D`` bf16.

Sync points: none on the host; the grid comes from ``N*K`` and ``D``. The caller orders the
writes against the peers' readers with barriers (:mod:`distmoe.rowwise`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from distmoe.kernels.base.checks import check_devices, check_tensor
from distmoe.kernels.base.config import is_power_of_2, next_power_of_2
from distmoe.kernels.base.device import device_context

#: integer dtypes of the route maps (signed: a negative value marks an invalid route)
ROUTE_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)
#: dtypes of the route weights (multiplied in fp32)
PROB_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def route_targets(ranks_ptr, rows_ptr, bases_ptr, routes, is_route, world, num_rows,
                  HIDDEN: tl.constexpr, BYTES: tl.constexpr = False):
    """``(is_moved, is_bad, row pointers)`` of ``routes``: a route is moved when its rank
    and row lie in ``[0, world)`` x ``[0, num_rows)``, bad when both are non-negative and
    one is out of range. Pointers of routes not moved are null (never dereferenced). Rows
    are ``HIDDEN`` bf16 values, or with ``BYTES`` ``HIDDEN`` bytes (uint8 pointers)."""
    rank = tl.load(ranks_ptr + routes, mask=is_route, other=-1).to(tl.int64)
    row = tl.load(rows_ptr + routes, mask=is_route, other=-1).to(tl.int64)
    is_valid = is_route & (rank >= 0) & (row >= 0)
    is_moved = is_valid & (rank < world) & (row < num_rows)
    is_bad = is_valid & ((rank >= world) | (row >= num_rows))
    base = tl.load(bases_ptr + tl.where(is_moved, rank, 0), mask=is_moved, other=0)
    if BYTES:
        addr = base + tl.where(is_moved, row, 0) * HIDDEN
        row_ptrs = addr.to(tl.pointer_type(tl.uint8))
        if HIDDEN % 16 == 0:
            row_ptrs = tl.multiple_of(row_ptrs, 16)
    else:
        addr = base + tl.where(is_moved, row, 0) * (HIDDEN * 2)
        row_ptrs = addr.to(tl.pointer_type(tl.bfloat16))
        if HIDDEN % 8 == 0:
            row_ptrs = tl.multiple_of(row_ptrs, 16)  # heap bases are 256-byte aligned
    return is_moved, is_bad, row_ptrs


@triton.jit
def count_bad(bad_ptr, is_bad):
    """Add the bad routes of ``is_bad`` to the int64 counter at ``bad_ptr`` (one atomic when
    there is any)."""
    num_bad = tl.sum(is_bad.to(tl.int64), axis=0)
    if num_bad > 0:
        tl.atomic_add(bad_ptr, num_bad)


@triton.jit
def _rowwise_put_kernel(
    x_ptr,  # bf16 [N, D] (uint8 with BYTES)
    ranks_ptr,  # int [N*K]
    rows_ptr,  # int [N*K]
    probs_ptr,  # float [N*K] (WEIGHTED)
    bases_ptr,  # int64 [EP]: row 0 of every rank's destination buffer
    bad_ptr,  # int64 [1] (COUNT)
    num_routes,  # N*K
    world,  # EP
    num_rows,  # R
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WEIGHTED: tl.constexpr,
    COUNT: tl.constexpr,
    BYTES: tl.constexpr,
):
    routes = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    is_route = routes < num_routes
    is_moved, is_bad, dst_rows = route_targets(ranks_ptr, rows_ptr, bases_ptr, routes,
                                               is_route, world, num_rows, HIDDEN, BYTES)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = is_moved[:, None] & (cols < HIDDEN)[None, :]
    tokens = routes // TOP_K
    vals = tl.load(x_ptr + tokens[:, None] * HIDDEN + cols[None, :], mask=mask, other=0)
    if WEIGHTED:
        p = tl.load(probs_ptr + routes, mask=is_moved, other=0.0).to(tl.float32)
        vals = (vals.to(tl.float32) * p[:, None]).to(tl.bfloat16)
    tl.store(dst_rows[:, None] + cols[None, :], vals, mask=mask)
    if COUNT:
        if tl.program_id(1) == 0:
            count_bad(bad_ptr, is_bad)


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RowwiseConfig:
    """Launch configuration of the rowwise PUT and gather kernels.

    Attributes:
        block_r: routes per program (power of two).
        block_d: columns per program (power of two).
        num_warps: warps per program.
    """

    block_r: int = 4
    block_d: int = 1024
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_r", "block_d"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not is_power_of_2(value):
                raise ValueError(f"{name} ({value!r}) must be a power-of-two int")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps ({self.num_warps!r}) must be 1, 2, 4, 8 or 16")

    @classmethod
    def for_widths(cls, *, hidden: int) -> RowwiseConfig:
        """Up to 1024 columns per program, more routes per program below (1024 elements in
        all), 4 warps."""
        block_d = min(1024, next_power_of_2(max(1, hidden)))
        return cls(block_r=max(1, 1024 // block_d), block_d=block_d, num_warps=4)

    @classmethod
    def all_configs(cls) -> list[RowwiseConfig]:
        """Candidates for a benchmark sweep."""
        return [cls(block_r=r, block_d=d, num_warps=w)
                for d in (256, 512, 1024, 2048) for r in (1, 2, 4, 8, 16) for w in (4, 8)
                if 1024 <= r * d <= 16384]


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


def check_routes(ranks_name: str, ranks: object, rows_name: str, rows: object,
                 num_tokens: int, top_k: int | None = None) -> int:
    """Two route maps of the same shape, ``[N, K]`` (or ``[N]`` with ``top_k=None`` given
    as 1-D), signed integers, contiguous; returns K (1 for 1-D maps)."""
    check_tensor(ranks_name, ranks, dtypes=ROUTE_DTYPES)
    if ranks.dim() not in (1, 2) or ranks.shape[0] != num_tokens:
        raise ValueError(f"{ranks_name} must be [N, K] (or [N] for one route per row) with "
                         f"N = {num_tokens}, got shape {list(ranks.shape)}")
    check_tensor(rows_name, rows, dtypes=ROUTE_DTYPES, shape=list(ranks.shape),
                 shape_text=f"(the shape of {ranks_name})")
    k = 1 if ranks.dim() == 1 else ranks.shape[1]
    if top_k is not None and k != top_k:
        raise ValueError(f"{ranks_name} must have K = {top_k} columns, got shape "
                         f"{list(ranks.shape)}")
    return k


def check_bad_count(bad_count: object) -> None:
    if bad_count is not None:
        check_tensor("bad_count", bad_count, dtypes=(torch.int64,), shape=[1],
                     shape_text="(a device counter)")


def rowwise_put(
    x: torch.Tensor,
    dst_ranks: torch.Tensor,
    dst_rows: torch.Tensor,
    bases: torch.Tensor,
    num_rows: int,
    *,
    probs: torch.Tensor | None = None,
    bad_count: torch.Tensor | None = None,
    config: RowwiseConfig | None = None,
) -> None:
    """Push each route's token row into its destination row (see the module docstring).

    Args:
        x: bf16 ``[N, D]`` contiguous, the token rows; or uint8 ``[N, D]`` (rows of D bytes,
            e.g. MXFP8 qdata or scales viewed as uint8: moved bit for bit, unweighted).
        dst_ranks / dst_rows: signed integer ``[N, K]`` (or ``[N]``: K = 1) contiguous;
            negative = invalid route.
        bases: int64 ``[EP]``: address of row 0 of every rank's destination buffer, as mapped
            in this process; each buffer holds ``num_rows`` rows of D values of x's dtype
            (16-byte aligned when a row is a multiple of 16 bytes).
        num_rows: R, the rows of every destination buffer.
        probs: optional float32 / bf16 / fp16 ``[N, K]`` contiguous: weighted PUT.
        bad_count: optional int64 ``[1]`` device counter: bad routes are added to it.
        config: launch configuration; default :meth:`RowwiseConfig.for_widths`.
    """
    check_tensor("x", x, dtypes=(torch.bfloat16, torch.uint8), ndim=2, shape_text="[N, D]")
    num_tokens, hidden = x.shape
    if x.dtype == torch.uint8 and probs is not None:
        raise ValueError("probs must be None when x is uint8 (bytes move unweighted)")
    top_k = check_routes("dst_ranks", dst_ranks, "dst_rows", dst_rows, num_tokens)
    check_tensor("bases", bases, dtypes=(torch.int64,), ndim=1, shape_text="[EP]")
    if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 0:
        raise ValueError(f"num_rows ({num_rows!r}) must be a non-negative int")
    if probs is not None:
        check_tensor("probs", probs, dtypes=PROB_DTYPES, shape=list(dst_ranks.shape),
                     shape_text="(the shape of dst_ranks)")
    check_bad_count(bad_count)
    named = dict(x=x, dst_ranks=dst_ranks, dst_rows=dst_rows, bases=bases)
    if probs is not None:
        named["probs"] = probs
    if bad_count is not None:
        named["bad_count"] = bad_count
    check_devices(named)
    if config is None:
        config = RowwiseConfig.for_widths(hidden=hidden)
    elif not isinstance(config, RowwiseConfig):
        raise TypeError(f"config must be a RowwiseConfig, got {type(config).__name__}")
    num_routes = num_tokens * top_k
    if num_routes == 0 or hidden == 0:
        return
    grid = (triton.cdiv(num_routes, config.block_r), triton.cdiv(hidden, config.block_d))
    with device_context(x.device):
        _rowwise_put_kernel[grid](
            x, dst_ranks, dst_rows, x if probs is None else probs, bases,
            bases if bad_count is None else bad_count,  # placeholders: never read
            num_routes, bases.shape[0], num_rows,
            TOP_K=top_k, HIDDEN=hidden, BLOCK_R=config.block_r, BLOCK_D=config.block_d,
            WEIGHTED=probs is not None, COUNT=bad_count is not None,
            BYTES=x.dtype == torch.uint8, num_warps=config.num_warps,
        )


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------


def rowwise_put_ref(x: torch.Tensor, dst_ranks: torch.Tensor, dst_rows: torch.Tensor,
                    outs: list[torch.Tensor], probs: torch.Tensor | None = None) -> int:
    """Plain-PyTorch :func:`rowwise_put` of one source rank into ``outs`` (every rank's
    destination buffer, ``[R, D]`` of x's dtype each, on any device); returns the bad
    routes.
    Routes are written in route order (a later duplicate wins)."""
    two_d = (lambda m: m if m.dim() == 2 else m[:, None])
    ranks, rows = two_d(dst_ranks).tolist(), two_d(dst_rows).tolist()
    weights = None if probs is None else two_d(probs).float()
    num_tokens = x.shape[0]
    bad = 0
    for t in range(num_tokens):
        for k, (rank, row) in enumerate(zip(ranks[t], rows[t], strict=True)):
            if rank < 0 or row < 0:
                continue
            if rank >= len(outs) or row >= outs[rank].shape[0]:
                bad += 1
                continue
            val = x[t] if weights is None else (x[t].float() * weights[t, k]).bfloat16()
            outs[rank][row] = val.to(outs[rank].device)
    return bad
