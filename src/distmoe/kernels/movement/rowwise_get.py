"""Rowwise GET: every route pulls a row of a peer's heap buffer; the combine reduces them.

Legend as in :mod:`distmoe.kernels.movement.rowwise_put` (N token rows, K routes per token,
route id ``t*K + k``, D = hidden, EP ranks, R rows per source buffer). A route is *read* when
``src_ranks[t, k]`` and ``src_rows[t, k]`` lie in ``[0, EP)`` x ``[0, R)``; *invalid* when
either is negative, *bad* when both are non-negative and one is out of range (counted in
``bad_count``). Routes that are not read contribute zeros.

* :func:`rowwise_gather` (one-to-one): ``out[i] = src@ranks[i][rows[i]]`` for every route
  ``i`` of ``[M]`` (``M = N*K``), zeros where not read, plus ``is_read`` (int8 ``[M]``: 1
  read, -1 not) for the reduction that may follow
  (:func:`distmoe.kernels.movement.combine.combine` with ``is_read`` as its expert ids:
  the unfused combine).
* :func:`rowwise_combine_get_scaled`: the fused combine of MXFP8 rows (qdata and scales in
  two buffers, dequantised on arrival), optionally keeping every route's dequantised row.
* :func:`rowwise_combine_get` (fused): ``y[t] = bf16(sum over read k of w[t, k] *
  src@ranks[t, k][rows[t, k]])`` in fp32, ``w = probs`` or 1, in k order, without the
  ``[N, K, D]`` intermediate. Its arithmetic is that of ``combine`` (same expression, same
  order), so the fused and unfused combines give the same bits.

Algorithm: one program owns a block of routes (gather) or tokens (combine) x a block of
columns; loads of the K routes of a token are unrolled so they are in flight together. The
programs of column block 0 count bad routes (one atomic per program that has any).
Memory-bound: reads ``read routes * D`` bf16 from the peers, writes ``M*D`` (gather) or
``N*D`` (combine).

Sync points: none on the host; grids come from the route maps' and rows' shapes. The caller
orders the reads after the peers' writes with a barrier (:mod:`distmoe.rowwise`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from distmoe.kernels.base.checks import check_devices, check_tensor
from distmoe.kernels.base.device import device_context
from distmoe.kernels.movement.combine import CombineConfig
from distmoe.kernels.movement.rowwise_put import (
    PROB_DTYPES,
    RowwiseConfig,
    check_bad_count,
    check_routes,
    count_bad,
    route_targets,
)
from distmoe.quant.formats import e4m3_byte_to_fp32, e8m0_to_fp32

# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _rowwise_gather_kernel(
    bases_ptr,  # int64 [EP]: row 0 of every rank's source buffer
    ranks_ptr,  # int [M]
    rows_ptr,  # int [M]
    out_ptr,  # bf16 [M, D]
    is_read_ptr,  # int8 [M] (MARK)
    bad_ptr,  # int64 [1] (COUNT)
    num_routes,  # M
    world,  # EP
    num_rows,  # R
    HIDDEN: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MARK: tl.constexpr,
    COUNT: tl.constexpr,
):
    routes = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    is_route = routes < num_routes
    is_read, is_bad, src_rows = route_targets(ranks_ptr, rows_ptr, bases_ptr, routes,
                                              is_route, world, num_rows, HIDDEN)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = (cols < HIDDEN)[None, :]
    vals = tl.load(src_rows[:, None] + cols[None, :], mask=is_read[:, None] & col_mask,
                   other=0.0)
    tl.store(out_ptr + routes[:, None] * HIDDEN + cols[None, :], vals,
             mask=is_route[:, None] & col_mask)
    if tl.program_id(1) == 0:
        if MARK:
            tl.store(is_read_ptr + routes, tl.where(is_read, 1, -1).to(tl.int8), mask=is_route)
        if COUNT:
            count_bad(bad_ptr, is_bad)


@triton.jit
def _rowwise_combine_get_kernel(
    bases_ptr,  # int64 [EP]
    ranks_ptr,  # int [N*K]
    rows_ptr,  # int [N*K]
    probs_ptr,  # float [N*K] (WEIGHTED)
    y_ptr,  # bf16 [N, D]
    bad_ptr,  # int64 [1] (COUNT)
    num_tokens,  # N
    world,  # EP
    num_rows,  # R
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WEIGHTED: tl.constexpr,
    COUNT: tl.constexpr,
):
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    is_token = tokens < num_tokens
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = (cols < HIDDEN)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        route = tokens * TOP_K + k
        is_read, is_bad, src_rows = route_targets(ranks_ptr, rows_ptr, bases_ptr, route,
                                                  is_token, world, num_rows, HIDDEN)
        row = tl.load(src_rows[:, None] + cols[None, :], mask=is_read[:, None] & col_mask,
                      other=0.0)
        if WEIGHTED:
            # the expression of distmoe.kernels.movement.combine: the same bits
            w = tl.load(probs_ptr + route, mask=is_read, other=0.0).to(tl.float32)
            acc += w[:, None] * row.to(tl.float32)
        else:
            acc += row.to(tl.float32)
        if COUNT:
            if tl.program_id(1) == 0:
                count_bad(bad_ptr, is_bad)
    tl.store(y_ptr + tokens[:, None] * HIDDEN + cols[None, :], acc.to(tl.bfloat16),
             mask=is_token[:, None] & col_mask)


@triton.jit
def _rowwise_combine_get_scaled_kernel(
    q_bases_ptr,  # int64 [EP]: row 0 of every rank's qdata buffer (D bytes a row)
    s_bases_ptr,  # int64 [EP]: row 0 of every rank's scale buffer (D/32 bytes a row)
    ranks_ptr,  # int [N*K]
    rows_ptr,  # int [N*K]
    probs_ptr,  # float [N*K] (WEIGHTED)
    y_ptr,  # bf16 [N, D]
    kept_ptr,  # bf16 [N, K, D] (KEEP)
    bad_ptr,  # int64 [1] (COUNT)
    num_tokens,  # N
    world,  # EP
    num_rows,  # R
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WEIGHTED: tl.constexpr,
    KEEP: tl.constexpr,
    COUNT: tl.constexpr,
):
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    is_token = tokens < num_tokens
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < HIDDEN
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        route = tokens * TOP_K + k
        is_read, is_bad, q_rows = route_targets(ranks_ptr, rows_ptr, q_bases_ptr, route,
                                                is_token, world, num_rows, HIDDEN, True)
        _, _, s_rows = route_targets(ranks_ptr, rows_ptr, s_bases_ptr, route, is_token, world,
                                     num_rows, HIDDEN // 32, True)
        ok = is_read[:, None] & col_ok[None, :]
        q = tl.load(q_rows[:, None] + cols[None, :], mask=ok, other=0).to(tl.int32)
        sc = tl.load(s_rows[:, None] + (cols // 32)[None, :], mask=ok, other=127).to(tl.int32)
        # dequantised on arrival: an E4M3 value times a power of two, exact in fp32
        row = e4m3_byte_to_fp32(q) * e8m0_to_fp32(sc)
        if KEEP:
            tl.store(kept_ptr + route[:, None] * HIDDEN + cols[None, :], row.to(tl.bfloat16),
                     mask=is_token[:, None] & col_ok[None, :])
        if WEIGHTED:
            w = tl.load(probs_ptr + route, mask=is_read, other=0.0).to(tl.float32)
            acc += w[:, None] * row
        else:
            acc += row
        if COUNT:
            if tl.program_id(1) == 0:
                count_bad(bad_ptr, is_bad)
    tl.store(y_ptr + tokens[:, None] * HIDDEN + cols[None, :], acc.to(tl.bfloat16),
             mask=is_token[:, None] & col_ok[None, :])


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _check_num_rows(num_rows: object) -> None:
    if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 0:
        raise ValueError(f"num_rows ({num_rows!r}) must be a non-negative int")


def rowwise_gather(
    bases: torch.Tensor,
    num_rows: int,
    src_ranks: torch.Tensor,
    src_rows: torch.Tensor,
    out: torch.Tensor,
    *,
    is_read: torch.Tensor | None = None,
    bad_count: torch.Tensor | None = None,
    config: RowwiseConfig | None = None,
) -> torch.Tensor:
    """Pull every route's row into ``out`` (zeros where not read); see the module docstring.

    Args:
        bases: int64 ``[EP]``: address of row 0 of every rank's source buffer (``num_rows``
            rows of D bf16 each), as mapped in this process.
        num_rows: R.
        src_ranks / src_rows: signed integer, the same shape (``[M]`` or ``[N, K]``, M = N*K
            routes in row-major order), contiguous; negative = invalid route.
        out: bf16 ``[M, D]`` (or ``[N, K, D]``) contiguous; every row is written.
        is_read: optional int8 with the shape of ``src_ranks`` (written): 1 where the route
            was read, -1 where not.
        bad_count: optional int64 ``[1]`` device counter: bad routes are added to it.
        config: launch configuration; default :meth:`RowwiseConfig.for_widths`.

    Returns ``out``.
    """
    check_tensor("bases", bases, dtypes=(torch.int64,), ndim=1, shape_text="[EP]")
    _check_num_rows(num_rows)
    check_tensor("src_ranks", src_ranks, dtypes=(torch.int8, torch.int16, torch.int32,
                                                 torch.int64))
    num_tokens = src_ranks.shape[0] if src_ranks.dim() else 0
    check_routes("src_ranks", src_ranks, "src_rows", src_rows, num_tokens)
    num_routes = src_ranks.numel()
    check_tensor("out", out, dtypes=(torch.bfloat16,))
    if out.dim() != src_ranks.dim() + 1 or list(out.shape[:-1]) != list(src_ranks.shape):
        raise ValueError(f"out must have shape {list(src_ranks.shape)} + [D] (one row per "
                         f"route), got {list(out.shape)}")
    hidden = out.shape[-1]
    named = dict(bases=bases, src_ranks=src_ranks, src_rows=src_rows, out=out)
    if is_read is not None:
        check_tensor("is_read", is_read, dtypes=(torch.int8,), shape=list(src_ranks.shape),
                     shape_text="(the shape of src_ranks)")
        named["is_read"] = is_read
    check_bad_count(bad_count)
    if bad_count is not None:
        named["bad_count"] = bad_count
    check_devices(named)
    if config is None:
        config = RowwiseConfig.for_widths(hidden=hidden)
    elif not isinstance(config, RowwiseConfig):
        raise TypeError(f"config must be a RowwiseConfig, got {type(config).__name__}")
    if num_routes == 0 or hidden == 0:
        return out
    grid = (triton.cdiv(num_routes, config.block_r), triton.cdiv(hidden, config.block_d))
    with device_context(out.device):
        _rowwise_gather_kernel[grid](
            bases, src_ranks, src_rows, out,
            out if is_read is None else is_read,  # placeholders: never touched
            bases if bad_count is None else bad_count,
            num_routes, bases.shape[0], num_rows,
            HIDDEN=hidden, BLOCK_R=config.block_r, BLOCK_D=config.block_d,
            MARK=is_read is not None, COUNT=bad_count is not None,
            num_warps=config.num_warps,
        )
    return out


def rowwise_combine_get(
    bases: torch.Tensor,
    num_rows: int,
    src_ranks: torch.Tensor,
    src_rows: torch.Tensor,
    y: torch.Tensor,
    *,
    probs: torch.Tensor | None = None,
    bad_count: torch.Tensor | None = None,
    config: CombineConfig | None = None,
) -> torch.Tensor:
    """Pull and reduce every token's K routes into ``y`` in one kernel (fused combine).

    Args:
        bases / num_rows: as in :func:`rowwise_gather`.
        src_ranks / src_rows: signed integer ``[N, K]`` contiguous; negative = invalid.
        y: bf16 ``[N, D]`` contiguous; every row is written.
        probs: optional float32 / bf16 / fp16 ``[N, K]`` contiguous: weighted sum.
        bad_count: optional int64 ``[1]`` device counter: bad routes are added to it.
        config: launch configuration (tokens x columns per program); default
            :meth:`CombineConfig.for_widths`, the unfused reduction's.

    Returns ``y``.
    """
    check_tensor("bases", bases, dtypes=(torch.int64,), ndim=1, shape_text="[EP]")
    _check_num_rows(num_rows)
    check_tensor("y", y, dtypes=(torch.bfloat16,), ndim=2, shape_text="[N, D]")
    num_tokens, hidden = y.shape
    check_tensor("src_ranks", src_ranks, dtypes=(torch.int8, torch.int16, torch.int32,
                                                 torch.int64), ndim=2, shape_text="[N, K]")
    top_k = check_routes("src_ranks", src_ranks, "src_rows", src_rows, num_tokens)
    named = dict(bases=bases, src_ranks=src_ranks, src_rows=src_rows, y=y)
    if probs is not None:
        check_tensor("probs", probs, dtypes=PROB_DTYPES, shape=list(src_ranks.shape),
                     shape_text="(the shape of src_ranks)")
        named["probs"] = probs
    check_bad_count(bad_count)
    if bad_count is not None:
        named["bad_count"] = bad_count
    check_devices(named)
    if config is None:
        config = CombineConfig.for_widths(hidden=max(1, hidden))
    elif not isinstance(config, CombineConfig):
        raise TypeError(f"config must be a CombineConfig, got {type(config).__name__}")
    if num_tokens == 0 or hidden == 0:
        return y
    grid = (triton.cdiv(num_tokens, config.block_t), triton.cdiv(hidden, config.block_d))
    with device_context(y.device):
        _rowwise_combine_get_kernel[grid](
            bases, src_ranks, src_rows, y if probs is None else probs, y,
            bases if bad_count is None else bad_count,  # placeholders: never read
            num_tokens, bases.shape[0], num_rows,
            TOP_K=top_k, HIDDEN=hidden, BLOCK_T=config.block_t, BLOCK_D=config.block_d,
            WEIGHTED=probs is not None, COUNT=bad_count is not None,
            num_warps=config.num_warps,
        )
    return y


def rowwise_combine_get_scaled(
    q_bases: torch.Tensor,
    s_bases: torch.Tensor,
    num_rows: int,
    src_ranks: torch.Tensor,
    src_rows: torch.Tensor,
    y: torch.Tensor,
    *,
    probs: torch.Tensor | None = None,
    kept: torch.Tensor | None = None,
    bad_count: torch.Tensor | None = None,
    config: CombineConfig | None = None,
) -> torch.Tensor:
    """:func:`rowwise_combine_get` of MXFP8 rows: each route pulls its row's E4M3 values
    (D bytes) and E8M0 scales (D/32 bytes) from two heap buffers, dequantises them on
    arrival (exact in fp32) and adds them, weighted, in fp32 in k order; one bf16 rounding.

    Args:
        q_bases / s_bases: int64 ``[EP]``: row 0 of every rank's qdata buffer (``num_rows``
            rows of D bytes) and scale buffer (rows of D/32 bytes), as mapped here.
        num_rows: R.
        src_ranks / src_rows: signed integer ``[N, K]`` contiguous; negative = invalid.
        y: bf16 ``[N, D]`` contiguous (D a multiple of 32); every row is written.
        probs: optional float32 / bf16 / fp16 ``[N, K]``: weighted sum.
        kept: optional bf16 ``[N, K, D]``: receives every route's dequantised row (exact in
            bf16 for scales in bf16's normal range; zeros where not read), for the
            probabilities' gradient.
        bad_count: optional int64 ``[1]`` device counter.
        config: tokens x columns per program; default :meth:`CombineConfig.for_widths`.

    Returns ``y``. No host synchronisation.
    """
    check_tensor("q_bases", q_bases, dtypes=(torch.int64,), ndim=1, shape_text="[EP]")
    check_tensor("s_bases", s_bases, dtypes=(torch.int64,), shape=list(q_bases.shape),
                 shape_text="(the shape of q_bases)")
    _check_num_rows(num_rows)
    check_tensor("y", y, dtypes=(torch.bfloat16,), ndim=2, shape_text="[N, D]")
    num_tokens, hidden = y.shape
    if hidden % 32:
        raise ValueError(f"D ({hidden}, y.shape[1]) must be a multiple of 32 (one E8M0 scale "
                         "per 32 values)")
    check_tensor("src_ranks", src_ranks, dtypes=(torch.int8, torch.int16, torch.int32,
                                                 torch.int64), ndim=2, shape_text="[N, K]")
    top_k = check_routes("src_ranks", src_ranks, "src_rows", src_rows, num_tokens)
    named = dict(q_bases=q_bases, s_bases=s_bases, src_ranks=src_ranks, src_rows=src_rows,
                 y=y)
    if probs is not None:
        check_tensor("probs", probs, dtypes=PROB_DTYPES, shape=list(src_ranks.shape),
                     shape_text="(the shape of src_ranks)")
        named["probs"] = probs
    if kept is not None:
        check_tensor("kept", kept, dtypes=(torch.bfloat16,),
                     shape=[num_tokens, top_k, hidden], shape_text="[N, K, D]")
        named["kept"] = kept
    check_bad_count(bad_count)
    if bad_count is not None:
        named["bad_count"] = bad_count
    check_devices(named)
    if config is None:
        config = CombineConfig.for_widths(hidden=max(1, hidden))
    elif not isinstance(config, CombineConfig):
        raise TypeError(f"config must be a CombineConfig, got {type(config).__name__}")
    if num_tokens == 0 or hidden == 0:
        return y
    grid = (triton.cdiv(num_tokens, config.block_t), triton.cdiv(hidden, config.block_d))
    with device_context(y.device):
        _rowwise_combine_get_scaled_kernel[grid](
            q_bases, s_bases, src_ranks, src_rows, y if probs is None else probs, y,
            y if kept is None else kept,  # placeholders: never touched
            q_bases if bad_count is None else bad_count,
            num_tokens, q_bases.shape[0], num_rows,
            TOP_K=top_k, HIDDEN=hidden, BLOCK_T=config.block_t, BLOCK_D=config.block_d,
            WEIGHTED=probs is not None, KEEP=kept is not None, COUNT=bad_count is not None,
            num_warps=config.num_warps,
        )
    return y


# --------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------


def rowwise_gather_ref(sources: list[torch.Tensor], src_ranks: torch.Tensor,
                       src_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Plain-PyTorch :func:`rowwise_gather` from ``sources`` (every rank's source buffer,
    ``[R, D]`` each): ``(rows [*src_ranks.shape, D], is_read int8, bad routes)``."""
    ranks, rows = src_ranks.reshape(-1).tolist(), src_rows.reshape(-1).tolist()
    hidden = sources[0].shape[1]
    out = torch.zeros(len(ranks), hidden, dtype=sources[0].dtype)
    is_read = torch.full((len(ranks),), -1, dtype=torch.int8)
    bad = 0
    for i, (rank, row) in enumerate(zip(ranks, rows, strict=True)):
        if rank < 0 or row < 0:
            continue
        if rank >= len(sources) or row >= sources[rank].shape[0]:
            bad += 1
            continue
        out[i] = sources[rank][row].cpu()
        is_read[i] = 1
    return (out.reshape(*src_ranks.shape, hidden), is_read.reshape(src_ranks.shape), bad)


def rowwise_combine_get_ref(sources: list[torch.Tensor], src_ranks: torch.Tensor,
                            src_rows: torch.Tensor,
                            probs: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-PyTorch :func:`rowwise_combine_get`: fp32 sum in k order (the kernels' order,
    so the bits agree on the CPU), one bf16 rounding; routes not read add nothing."""
    rows, is_read, _ = rowwise_gather_ref(sources, src_ranks, src_rows)
    num_tokens, top_k = src_ranks.shape
    acc = torch.zeros(num_tokens, rows.shape[-1], dtype=torch.float32)
    for k in range(top_k):
        read = (is_read[:, k] > 0)[:, None]
        term = rows[:, k].float()
        if probs is not None:
            term = probs[:, k].float().cpu()[:, None] * term
        acc += torch.where(read, term, 0.0)
    return acc.bfloat16()
