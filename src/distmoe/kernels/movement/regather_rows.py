"""Gather a layer's rows again in backward, for a saved layer that kept its input instead.

With ``MoEConfig.save_gathered_rows`` False a saved layer keeps ``x [T, D]`` rather than the
``x_rows [R, D]`` its W13 forward read (:mod:`distmoe.ops.activations`). Before the weight
gradients its backward copies x back into the dispatch rows (as a replay does) and this kernel
rebuilds the rows in activation order, bit for bit what the forward's W13 stored::

    out[row_offsets[e] + j] = the D bf16 values at gather_ptrs[padded_offsets[e] + j]
                              (zeros where the address is 0, a null row)

for every expert ``e`` and live row ``j < row_offsets[e+1] - row_offsets[e]``. Padding rows
are not read and no other row of ``out`` is written. Grid: ``R_cap / BLOCK_M`` row tiles
(``BLOCK_M`` divides the padding multiple, so a tile never spans two experts) times the
column blocks, from the static bounds; ``enable`` turns it off on the device (a replayed
layer rebuilds its rows in its W13 instead). No host synchronisation: it runs inside
CUDA-graph capture.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from distmoe.kernels.base.checks import (
    check_block_m,
    check_devices,
    check_expert_tables,
    check_gather_r_cap,
    check_tensor,
)
from distmoe.kernels.base.config import next_power_of_2
from distmoe.kernels.base.device import device_context
from distmoe.kernels.base.tiles import tile_row_addresses

__all__ = ["regather_rows"]

_BLOCK_D = 512


@triton.jit
def _regather_kernel(gather_ptrs_ptr, padded_offsets_ptr, row_offsets_ptr, out_ptr,
                     enable_ptr, HIDDEN: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                     EXPERTS_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                     HAS_ENABLE: tl.constexpr):
    run = True
    if HAS_ENABLE:
        run = tl.load(enable_ptr) != 0
    if run:
        act_start, num_live, idx, is_live, src = tile_row_addresses(
            gather_ptrs_ptr, padded_offsets_ptr, row_offsets_ptr, NUM_EXPERTS, EXPERTS_POW2,
            BLOCK_M)
        if num_live > 0:  # live rows come first in a segment
            rows = tl.multiple_of(src.to(tl.pointer_type(tl.bfloat16)), 16)
            cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
            in_row = (cols < HIDDEN)[None, :]
            vals = tl.load(rows[:, None] + cols[None, :], mask=(src != 0)[:, None] & in_row,
                           other=0.0)
            dst = out_ptr + (act_start + idx) * HIDDEN
            tl.store(dst[:, None] + cols[None, :], vals, mask=is_live[:, None] & in_row)


def regather_rows(
    gather_ptrs: torch.Tensor,
    padded_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    out: torch.Tensor,
    *,
    block_m: int,
    enable: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rebuild gathered rows in activation order (module docstring).

    Args:
        gather_ptrs: int64 ``[R_cap]`` indexed by padded row: absolute byte address of each
            row's D bf16 values (16-byte aligned), 0 = null row (stores zeros); the table the
            forward's W13 read.
        padded_offsets / row_offsets: int32 ``[E_local + 1]`` (device): the padded segments
            (multiples of ``block_m``) and the live rows' exclusive prefix sum, as for
            :func:`~distmoe.kernels.w13_forward.triton.gather_w13_swiglu`.
        out: bf16 ``[R_act, D]`` contiguous, ``R_act >= row_offsets[E_local]`` (the caller's
            contract: a device value).
        block_m: the padding multiple, a power of two >= 16 dividing ``R_cap``.
        enable: optional int32 ``[1]`` (device): 0 = nothing is read or written.

    Returns ``out``.
    """
    check_tensor("gather_ptrs", gather_ptrs, dtypes=(torch.int64,), ndim=1,
                 shape_text="[R_cap] (row addresses by padded row)")
    check_tensor("out", out, dtypes=(torch.bfloat16,), ndim=2, shape_text="[R_act, D]")
    num_experts = check_expert_tables(padded_offsets, row_offsets)
    check_block_m(block_m)
    r_cap = gather_ptrs.shape[0]
    check_gather_r_cap(r_cap, block_m)
    named = dict(gather_ptrs=gather_ptrs, padded_offsets=padded_offsets,
                 row_offsets=row_offsets, out=out)
    if enable is not None:
        check_tensor("enable", enable, dtypes=(torch.int32,), shape=[1],
                     shape_text="(0 = skip)")
        named["enable"] = enable
    device = check_devices(named)
    hidden = out.shape[1]
    if hidden % 8 or out.data_ptr() % 16:
        raise ValueError(f"out must have D % 8 == 0 and a 16-byte aligned start (16-byte "
                         f"rows), got D={hidden} at {out.data_ptr():#x}")
    if r_cap == 0 or out.shape[0] == 0:
        return out
    block_rows = min(32, block_m)
    block_d = min(_BLOCK_D, next_power_of_2(hidden))
    grid = (r_cap // block_rows, triton.cdiv(hidden, block_d))
    with device_context(device):
        _regather_kernel[grid](
            gather_ptrs, padded_offsets, row_offsets, out,
            gather_ptrs if enable is None else enable, HIDDEN=hidden, NUM_EXPERTS=num_experts,
            EXPERTS_POW2=max(2, next_power_of_2(num_experts)), BLOCK_M=block_rows,
            BLOCK_D=block_d, HAS_ENABLE=enable is not None, num_warps=4,
        )  # fmt: skip
    return out
