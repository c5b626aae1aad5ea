"""Standalone grouped GEMM over contiguous row groups (the forward and DGRAD of
:func:`distmoe.rowwise.grouped_mm`, torch._grouped_mm's 2-D x 3-D case).

Legend: M rows of ``a``, RED the reduction width, OUT the output width, E groups.

Row layout: ``row_offsets`` int32 ``[E + 1]`` on the device, non-decreasing, ``row_offsets[0]
= 0``, ``row_offsets[E] <= M`` (the caller normalises torch's ``offs``); group ``e`` owns the
rows ``[row_offsets[e], row_offsets[e+1])``, unpadded, and rows at or past ``row_offsets[E]``
belong to no group. Per row::

    out[r] = bf16(a[r] @ W_e)        r in group e; fp32 accumulation, one rounding
    out[r] = 0                       r >= row_offsets[E]

``W_e`` is ``w[e]`` (``[RED, OUT]``) or, with ``trans_w``, ``w[e]^T`` (``w[e]`` then
``[OUT, RED]``), both read from a contiguous ``w`` by TMA: the forward passes ``b`` (or a
transposed ``b``'s storage), the DGRAD ``grad_a = grad_out @ b_e^T`` the same storage with
the other flag.

:func:`grouped_gemm`
    Row tiles of ``block_m`` rows never straddle two groups: group ``e`` has
    ``cdiv(n_e, block_m)`` tiles, its last one partial (the last group's segment runs to M, so
    that its tiles also zero the rows past ``row_offsets[E]``). Those counts sum to at most
    ``cdiv(M, block_m) + E - 1`` (each group adds at most one partial tile), which with
    ``cdiv(OUT, block_n)`` column tiles sizes the grid: no host synchronisation, CUDA-graph
    safe. Each program finds its group from the device-side offsets (a prefix sum of the
    per-group tile counts), exits if it is past the live tiles, and otherwise runs a K loop
    over RED of TMA loads of ``a`` rows (rows of the next group or past M come along and are
    never stored: a row's result depends on its own row only, so no masking is needed there)
    and of ``W_e``. Tiles wholly past ``row_offsets[E]`` skip the loop and store zeros. The
    epilogue rounds the fp32 tile once to bf16 and stores the group's rows with a masked
    pointer store (a TMA store of a partial tile would overwrite the next group's rows).
    Row tiles follow the group-M swizzle (consecutive tiles of one group share ``W_e`` in
    L2).

Requirements: RED and OUT multiples of 8 and 16-byte aligned bases (TMA; checked by the
caller); offsets as above (device values, not checked: the caller clamps them).

Sync points: none.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from distmoe.kernels.base.config import next_power_of_2
from distmoe.kernels.base.device import device_context, ensure_tma_allocator
from distmoe.kernels.base.tiles import swizzle_tile
from distmoe.kernels.grouped.config import GroupedConfig

# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _group_of_tile(row_offsets_ptr, tile, num_rows, NUM_GROUPS: tl.constexpr,
                   GROUPS_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
    """``(group, first row of the tile, end of the group's segment, end of its live rows)``
    of row tile ``tile``; ``group == NUM_GROUPS`` past the last live tile. The last group's
    segment ends at ``num_rows`` (its tiles also cover the rows of no group)."""
    idx = tl.arange(0, GROUPS_POW2)
    starts = tl.load(row_offsets_ptr + idx, mask=idx < NUM_GROUPS, other=0)
    live_ends = tl.load(row_offsets_ptr + 1 + idx, mask=idx < NUM_GROUPS, other=0)
    seg_ends = tl.where(idx == NUM_GROUPS - 1, num_rows, live_ends)
    seg_ends = tl.where(idx < NUM_GROUPS, seg_ends, starts)
    counts = (seg_ends - starts + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(counts, 0)  # tile index just past each group's tiles
    group = tl.sum((ends <= tile).to(tl.int32), axis=0)
    mine = idx == group
    first_tile = tl.sum(tl.where(mine, ends - counts, 0), axis=0)
    row0 = tl.sum(tl.where(mine, starts, 0), axis=0) + (tile - first_tile) * BLOCK_M
    seg_end = tl.sum(tl.where(mine, seg_ends, 0), axis=0)
    live_end = tl.sum(tl.where(mine, live_ends, 0), axis=0)
    return group, row0, seg_end, live_end


@triton.jit
def _grouped_gemm_kernel(
    a,  # bf16 [M, RED], or its TMA descriptor (HOST_DESC)
    w,  # bf16 [E, RED, OUT] (or [E, OUT, RED] with TRANS_W), or its TMA descriptor
    row_offsets_ptr,  # int32 [E + 1]
    out_ptr,  # bf16 [M, OUT]
    num_rows,  # M
    num_row_tiles,  # cdiv(M, BLOCK_M) + E - 1: the row tiles of the grid
    RED: tl.constexpr,
    OUT: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUPS_POW2: tl.constexpr,
    TRANS_W: tl.constexpr,
    HOST_DESC: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    num_n = tl.cdiv(OUT, BLOCK_N)
    tile, pid_n = swizzle_tile(tl.program_id(0), num_row_tiles, num_n, GROUP_M)
    group, row0, seg_end, live_end = _group_of_tile(row_offsets_ptr, tile, num_rows,
                                                    NUM_GROUPS, GROUPS_POW2, BLOCK_M)
    if group >= NUM_GROUPS:
        return  # past the live tiles (the grid is a bound)
    n0 = pid_n * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if row0 < live_end:  # else every row of the tile belongs to no group: zeros
        if HOST_DESC:
            a_desc = a
            w_desc = w
        else:
            a_desc = tl.make_tensor_descriptor(a, shape=[num_rows, RED], strides=[RED, 1],
                                               block_shape=[BLOCK_M, BLOCK_K])
            if TRANS_W:
                w_desc = tl.make_tensor_descriptor(
                    w, shape=[NUM_GROUPS, OUT, RED], strides=[OUT * RED, RED, 1],
                    block_shape=[1, BLOCK_N, BLOCK_K])
            else:
                w_desc = tl.make_tensor_descriptor(
                    w, shape=[NUM_GROUPS, RED, OUT], strides=[RED * OUT, OUT, 1],
                    block_shape=[1, BLOCK_K, BLOCK_N])
        for k0 in range(0, RED, BLOCK_K):
            x = a_desc.load([row0, k0])
            if TRANS_W:
                wt = tl.trans(tl.reshape(w_desc.load([group, n0, k0]), [BLOCK_N, BLOCK_K]))
            else:
                wt = tl.reshape(w_desc.load([group, k0, n0]), [BLOCK_K, BLOCK_N])
            acc = tl.dot(x, wt, acc)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    acc = tl.where((rows < live_end)[:, None], acc, 0.0)  # rows of no group: zeros
    ptrs = out_ptr + rows.to(tl.int64)[:, None] * OUT + cols[None, :]
    tl.store(ptrs, acc.to(tl.bfloat16), mask=(rows < seg_end)[:, None] & (cols < OUT)[None, :])


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


def num_row_tiles(num_rows: int, num_groups: int, block_m: int) -> int:
    """Row tiles of the grid: ``cdiv(M, block_m) + E - 1`` (each group adds at most one
    partial tile), 0 without rows or groups."""
    if num_rows == 0 or num_groups == 0:
        return 0
    return triton.cdiv(num_rows, block_m) + num_groups - 1


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, row_offsets: torch.Tensor,
                 out: torch.Tensor, config: GroupedConfig, *, trans_w: bool) -> None:
    """``out[rows_e] = bf16(a[rows_e] @ W_e)`` for every group, zeros in the rows of no group
    (the module docstring). Inputs validated by the caller: ``a`` bf16 ``[M, RED]``, ``w``
    bf16 contiguous ``[E, RED, OUT]`` (``[E, OUT, RED]`` with ``trans_w``), ``row_offsets``
    int32 ``[E + 1]`` normalised, ``out`` bf16 ``[M, OUT]``, all contiguous on one device,
    ``a`` and ``w`` 16-byte aligned, RED and OUT multiples of 8."""
    num_rows, red = a.shape
    num_groups = w.shape[0]
    width = out.shape[1]
    if num_rows == 0 or width == 0:
        return
    if num_groups == 0:
        out.zero_()  # no group owns a row
        return
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    tiles = num_row_tiles(num_rows, num_groups, bm)
    grid = (tiles * triton.cdiv(width, bn),)
    if config.host_descriptors:
        a_arg = TensorDescriptor(a, shape=[num_rows, red], strides=[red, 1],
                                 block_shape=[bm, bk])
        if trans_w:
            w_arg = TensorDescriptor(w, shape=[num_groups, width, red],
                                     strides=[width * red, red, 1], block_shape=[1, bn, bk])
        else:
            w_arg = TensorDescriptor(w, shape=[num_groups, red, width],
                                     strides=[red * width, width, 1], block_shape=[1, bk, bn])
    else:
        ensure_tma_allocator()
        a_arg, w_arg = a, w
    with device_context(a.device):
        _grouped_gemm_kernel[grid](
            a_arg,
            w_arg,
            row_offsets,
            out,
            num_rows,
            tiles,
            RED=red,
            OUT=width,
            NUM_GROUPS=num_groups,
            GROUPS_POW2=max(2, next_power_of_2(num_groups)),
            TRANS_W=trans_w,
            HOST_DESC=config.host_descriptors,
            GROUP_M=config.group_m,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )


# --------------------------------------------------------------------------------------------
# Reference (plain PyTorch; reads the offsets on the host)
# --------------------------------------------------------------------------------------------


def grouped_gemm_ref(a: torch.Tensor, w: torch.Tensor, row_offsets: torch.Tensor, *,
                     trans_w: bool) -> torch.Tensor:
    """Reference of :func:`grouped_gemm`: a new bf16 ``[M, OUT]`` tensor (fp32 matmul per
    group, one rounding; zeros in the rows of no group)."""
    offsets = row_offsets.detach().to("cpu", torch.int64).tolist()
    width = w.shape[1] if trans_w else w.shape[2]
    out = torch.zeros(a.shape[0], width, dtype=torch.float32, device=a.device)
    for e, (start, end) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
        if end > start:
            we = w[e].float().t() if trans_w else w[e].float()
            out[start:end] = a[start:end].float() @ we
    return out.bfloat16()
