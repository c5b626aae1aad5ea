"""Scatter rows in activation order to the addresses of a padded-row table (the inverse of
:mod:`distmoe.kernels.movement.regather_rows`).

The forward of a layer whose W2 GEMM has no scatter epilogue (the MXFP8 inference forward,
:mod:`distmoe.ops.lowp`) writes its results into compact activation rows; this kernel then
returns every live row to its route's slot, normally in the owner rank's combine buffer::

    store rows[row_offsets[e] + j] (D bf16 values) at byte address scatter_ptrs[padded_offsets[e] + j]
                                   (skipped where the address is 0, a null row)

for every expert ``e`` and live row ``j < row_offsets[e+1] - row_offsets[e]``. Padding rows'
table entries are not read and nothing else is written. The stores are plain global stores
through each row's own address (a peer's buffer mapped into this address space at EP > 1);
the caller orders them against the readers with a barrier.

Grid: ``R_cap / BLOCK_M`` row tiles (``BLOCK_M`` divides the padding multiple, so a tile never
spans two experts) times the column blocks, from the static bounds, never from routed counts.
Memory-bound: reads and writes ``live rows * D`` bf16. Nothing is allocated; no host
synchronisation (it runs inside a CUDA-graph capture).

Requirements (device values, not checked): every non-null address 16-byte aligned with D
writable bf16 values there; ``row_offsets[E_local] <= rows.shape[0]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from distmoe.kernels.base.checks import (
    check_block_m,
    check_devices,
    check_expert_tables,
    check_scatter_r_cap,
    check_tensor,
)
from distmoe.kernels.base.config import next_power_of_2
from distmoe.kernels.base.device import device_context
from distmoe.kernels.base.rows import activation_segments, write_rows_at
from distmoe.kernels.base.tiles import tile_row_addresses

__all__ = ["scatter_rows", "scatter_rows_ref"]

_BLOCK_D = 512


@triton.jit
def _scatter_rows_kernel(rows_ptr, scatter_ptrs_ptr, padded_offsets_ptr, row_offsets_ptr,
                         HIDDEN: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                         EXPERTS_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    act_start, num_live, idx, is_live, dst = tile_row_addresses(
        scatter_ptrs_ptr, padded_offsets_ptr, row_offsets_ptr, NUM_EXPERTS, EXPERTS_POW2, BLOCK_M)
    if num_live > 0:  # live rows come first in a segment
        is_stored = is_live & (dst != 0)
        dst_rows = tl.multiple_of(dst.to(tl.pointer_type(tl.bfloat16)), 16)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = is_stored[:, None] & (cols < HIDDEN)[None, :]
        src = rows_ptr + (act_start + idx) * HIDDEN
        vals = tl.load(src[:, None] + cols[None, :], mask=mask, other=0.0)
        tl.store(dst_rows[:, None] + cols[None, :], vals, mask=mask)


def _check(rows, padded_offsets, row_offsets, scatter_ptrs, block_m, *, for_kernel=True):
    check_tensor("rows", rows, dtypes=(torch.bfloat16,), ndim=2, shape_text="[R_act, D]")
    check_tensor("scatter_ptrs", scatter_ptrs, dtypes=(torch.int64,), ndim=1,
                 shape_text="[R_cap] (row addresses by padded row)")
    num_experts = check_expert_tables(padded_offsets, row_offsets)
    check_block_m(block_m)
    check_scatter_r_cap(scatter_ptrs.shape[0], block_m)
    hidden = rows.shape[1]
    if hidden % 8 or rows.data_ptr() % 16:
        raise ValueError(f"rows must have D % 8 == 0 and a 16-byte aligned start (16-byte "
                         f"rows), got D={hidden} at {rows.data_ptr():#x}")
    device = check_devices(dict(rows=rows, scatter_ptrs=scatter_ptrs,
                                padded_offsets=padded_offsets, row_offsets=row_offsets),
                           for_kernel=for_kernel)
    return num_experts, hidden, device


def scatter_rows(
    rows: torch.Tensor,
    padded_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    scatter_ptrs: torch.Tensor,
    *,
    block_m: int,
) -> None:
    """Store each live activation row at its padded row's address (module docstring).

    Args:
        rows: bf16 ``[R_act, D]`` contiguous, 16-byte aligned, ``R_act >= row_offsets[E]``:
            the results in activation order.
        padded_offsets / row_offsets: int32 ``[E_local + 1]`` (device): the padded segments
            (multiples of ``block_m``) and the live rows' exclusive prefix sum
            (:class:`~distmoe.routing.RoutingTables`).
        scatter_ptrs: int64 ``[R_cap]`` indexed by padded row: the byte address where the
            row goes (16-byte aligned), 0 = null (skipped).
        block_m: the padding multiple, a power of two >= 16 dividing ``R_cap``.
    """
    num_experts, hidden, device = _check(rows, padded_offsets, row_offsets, scatter_ptrs,
                                         block_m)
    r_cap = scatter_ptrs.shape[0]
    if r_cap == 0 or rows.shape[0] == 0:
        return
    block_rows = min(32, block_m)
    block_d = min(_BLOCK_D, next_power_of_2(hidden))
    grid = (r_cap // block_rows, triton.cdiv(hidden, block_d))
    with device_context(device):
        _scatter_rows_kernel[grid](
            rows, scatter_ptrs, padded_offsets, row_offsets, HIDDEN=hidden,
            NUM_EXPERTS=num_experts, EXPERTS_POW2=max(2, next_power_of_2(num_experts)),
            BLOCK_M=block_rows, BLOCK_D=block_d, num_warps=4,
        )  # fmt: skip


def scatter_rows_ref(
    rows: torch.Tensor,
    padded_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    scatter_ptrs: torch.Tensor,
    destinations: list[torch.Tensor],
    *,
    block_m: int,
) -> None:
    """Plain-PyTorch :func:`scatter_rows` (any device; synchronises; for tests): every
    non-null address must start a row of one of ``destinations`` (contiguous tensors with rows
    of D values), which are written."""
    _check(rows, padded_offsets, row_offsets, scatter_ptrs, block_m, for_kernel=False)
    for padded, act, count in activation_segments(padded_offsets, row_offsets):
        if count:
            write_rows_at(scatter_ptrs[padded:padded + count], rows[act:act + count],
                          destinations, name="scatter_ptrs")
