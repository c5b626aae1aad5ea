"""Gather a layer's rows and quantise them in one pass: the FP8 layers' step 4a + 4b.

For every expert ``e`` and live row ``j < row_offsets[e+1] - row_offsets[e]``, with
``a = row_offsets[e] + j`` and ``r = padded_offsets[e] + j``::

    (q[a], s[a]) = quantise(the D bf16 values at gather_ptrs[r])   (zeros where the address
                                                                    is 0, a null row)

in one of the FP8 operand formats of :data:`distmoe.ops.lowp.FP8_FORMATS` (``"mxfp8"``: E8M0
per 32 values; ``"mxfp8_rebased"``: the same rebased onto 128-wide groups; ``"fp8_block"``:
float32 per 128), by the quantisers' own arithmetic (:func:`~distmoe.quant.mxfp8.mxfp8_encode`,
:func:`~distmoe.quant.mxfp8.mxfp8_rebase_codes`, :func:`~distmoe.quant.fp8_block.fp8_block_encode`):
bit for bit what :func:`~distmoe.kernels.movement.regather_rows.regather_rows` followed by
the format's ``quantize_2d`` writes at the live rows. Why: the gathered bf16 rows are read
only by the quantiser, so they need not round-trip through memory (``4 D`` bytes per row
saved, and the ``[R_b, D]`` bf16 scratch).

Padding rows are not read and no other row of ``q`` / ``s`` is written. Grid: ``R_cap /
BLOCK_M`` row tiles (``BLOCK_M`` divides the padding multiple: a tile never spans two
experts) times the column blocks, from the static bounds. No host synchronisation.
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
from distmoe.quant.formats import float32_bits
from distmoe.quant.fp8_block import fp8_block_encode
from distmoe.quant.mxfp8 import mxfp8_encode, mxfp8_rebase_codes

__all__ = ["GATHER_QUANT_FORMATS", "gather_quantize"]

#: format -> (values per scale, scale dtype)
GATHER_QUANT_FORMATS = {"mxfp8": (32, torch.uint8), "mxfp8_rebased": (128, torch.uint8),
                        "fp8_block": (128, torch.float32)}
_BLOCK_ROWS = 32
_BLOCK_COLS = 256


@triton.jit
def _gather_quant_kernel(gather_ptrs_ptr, padded_offsets_ptr, row_offsets_ptr, q_ptr, s_ptr,
                         HIDDEN: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                         EXPERTS_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
                         UNIT: tl.constexpr, BLOCKS: tl.constexpr, REBASE: tl.constexpr,
                         BLOCK_FP8: tl.constexpr):
    """One tile of ``BLOCK_M`` padded rows by ``BLOCKS`` quantisation blocks of ``UNIT``
    values (32 for MXFP8, 128 for block FP8)."""
    act_start, num_live, idx, is_live, src = tile_row_addresses(
        gather_ptrs_ptr, padded_offsets_ptr, row_offsets_ptr, NUM_EXPERTS, EXPERTS_POW2, BLOCK_M)
    if num_live > 0:  # live rows come first in a segment
        NB: tl.constexpr = HIDDEN // UNIT  # blocks of a row
        rows = tl.multiple_of(src.to(tl.pointer_type(tl.bfloat16)), 16)
        g = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
        cols = g[None, :, None] * UNIT + tl.arange(0, UNIT)[None, None, :]
        in_row = (g < NB)[None, :]
        vals = tl.load(rows[:, None, None] + cols, mask=((src != 0)[:, None] & in_row)[:, :, None],
                       other=0.0)
        bits = float32_bits(vals)
        act = (act_start + idx).to(tl.int64)
        ok = is_live[:, None] & in_row
        if BLOCK_FP8:
            q, s = fp8_block_encode(bits)
            tl.store(s_ptr + act[:, None] * NB + g[None, :], s, mask=ok)
        else:
            q, e = mxfp8_encode(bits)
            if REBASE:
                q, e = mxfp8_rebase_codes(bits, q, e, BLOCK_M, BLOCKS)
                g4 = tl.program_id(1) * (BLOCKS // 4) + tl.arange(0, BLOCKS // 4)
                e4 = tl.max(tl.reshape(e, (BLOCK_M, BLOCKS // 4, 4)), axis=2)
                ok4 = is_live[:, None] & (g4 < NB // 4)[None, :]
                tl.store(s_ptr + act[:, None] * (NB // 4) + g4[None, :],
                         (e4 + 127).to(tl.uint8), mask=ok4)
            else:
                tl.store(s_ptr + act[:, None] * NB + g[None, :], (e + 127).to(tl.uint8),
                         mask=ok)
        tl.store(q_ptr + act[:, None, None] * HIDDEN + cols, q, mask=ok[:, :, None])


def gather_quantize(gather_ptrs: torch.Tensor, padded_offsets: torch.Tensor,
                    row_offsets: torch.Tensor, qdata: torch.Tensor, scales: torch.Tensor, *,
                    format: str, block_m: int) -> None:
    """Gather and quantise the live rows (module docstring).

    Args:
        gather_ptrs: int64 ``[R_cap]`` indexed by padded row: absolute byte address of each
            row's D bf16 values (16-byte aligned), 0 = null row (quantised zeros).
        padded_offsets / row_offsets: int32 ``[E_local + 1]`` (device): the padded segments
            (multiples of ``block_m``) and the live rows' exclusive prefix sum.
        qdata: float8_e4m3fn (or its uint8 view) ``[R_act, D]`` contiguous,
            ``R_act >= row_offsets[E_local]`` (a device value: the caller's contract).
        scales: ``[R_act, D / B]`` contiguous: uint8 E8M0 (``B`` = 32 for ``"mxfp8"``, 128 for
            ``"mxfp8_rebased"``) or float32 (``"fp8_block"``, ``B`` = 128).
        format: ``"mxfp8"``, ``"mxfp8_rebased"`` or ``"fp8_block"``.
        block_m: the padding multiple, a power of two >= 16 dividing ``R_cap``.
    """
    if format not in GATHER_QUANT_FORMATS:
        raise ValueError(f"format ({format!r}) must be one of {list(GATHER_QUANT_FORMATS)}")
    group, scale_dtype = GATHER_QUANT_FORMATS[format]
    check_tensor("gather_ptrs", gather_ptrs, dtypes=(torch.int64,), ndim=1,
                 shape_text="[R_cap] (row addresses by padded row)")
    check_tensor("qdata", qdata, dtypes=(torch.float8_e4m3fn, torch.uint8), ndim=2,
                 shape_text="[R_act, D]")
    rows, hidden = qdata.shape
    if hidden <= 0 or hidden % group:
        raise ValueError(f"D ({hidden}, qdata.shape[1]) must be a positive multiple of {group} "
                         f"(values per {format} scale)")
    check_tensor("scales", scales, dtypes=(scale_dtype,), shape=[rows, hidden // group],
                 shape_text=f"[R_act, D/{group}] ({format} scales)")
    num_experts = check_expert_tables(padded_offsets, row_offsets)
    check_block_m(block_m)
    r_cap = gather_ptrs.shape[0]
    check_gather_r_cap(r_cap, block_m)
    device = check_devices(dict(gather_ptrs=gather_ptrs, padded_offsets=padded_offsets,
                                row_offsets=row_offsets, qdata=qdata, scales=scales))
    if r_cap == 0 or rows == 0:
        return
    unit = 128 if format == "fp8_block" else 32
    blocks = min(_BLOCK_COLS, next_power_of_2(hidden)) // unit
    if format == "mxfp8_rebased":
        blocks = max(4, blocks)
    block_rows = min(_BLOCK_ROWS, block_m)
    grid = (r_cap // block_rows, triton.cdiv(hidden // unit, blocks))
    with device_context(device):
        _gather_quant_kernel[grid](
            gather_ptrs, padded_offsets, row_offsets, qdata.view(torch.uint8), scales,
            HIDDEN=hidden,
            NUM_EXPERTS=num_experts, EXPERTS_POW2=max(2, next_power_of_2(num_experts)),
            BLOCK_M=block_rows, UNIT=unit, BLOCKS=blocks, REBASE=format == "mxfp8_rebased",
            BLOCK_FP8=format == "fp8_block", num_warps=8,
        )  # fmt: skip
