"""Quantise activation rows along the token axis, transposed: the operands of the FP8 weight
gradients.

A weight gradient sums over tokens (``grad_w[e] = A_e^T B_e`` over expert ``e``'s rows), so
its FP8 operands carry one scale per 128 consecutive tokens of one column, and the GEMM reads
them K-major: token-contiguous, ``[C, R_cap]`` with the column index of the padded row
(:mod:`distmoe.kernels.base.rows`). For every expert ``e``, padded row block ``b`` of 128
rows inside its segment and column ``c``::

    v[j]          = rows[act(padded_offsets[e] + 128 b + j), c]  for live rows j, else 0
    (qt[c, 128 b' + j], st[b', c]) = quantise(v[0:128])           b' = padded_offsets[e] / 128 + b

in one of two formats of the 128-wide groups (:data:`TOKEN_FORMATS`):

* ``"fp8_block"``: float32 ``s = amax / 448`` (1.0 for an all-zero block), ``q = RNE(v / s)``
  (:func:`~distmoe.quant.fp8_block.fp8_block_encode`, the 1 x 128 rule turned along tokens);
* ``"mxfp8_rebased"``: an E8M0 scale per 128 values by the MXFP8 rule
  (:func:`~distmoe.quant.mxfp8.mxfp8_encode` on 128-value blocks: the smallest power of two
  with ``amax <= 448 * 2^e``), ``q = RNE(v / 2^e)``: the scale rebasing would give, rounded
  once.

Non-finite values become NaN codes. ``rows`` are activation rows (bf16 ``[R_act, C]``) or,
with ``gather_ptrs``, the rows at the addresses of each padded row (0: a null row, zeros): the
forward's x, read where the layer's W13 read it. Padding rows quantise as zeros, so the GEMM
may sum over an expert's whole padded segment. Blocks past ``padded_offsets[E]`` are not
written. Grid: ``R_cap / 128`` row blocks by ``cdiv(C, 64)`` column blocks, from the static
bounds. No host synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from distmoe.kernels.base.checks import (
    check_devices,
    check_expert_tables,
    check_tensor,
)
from distmoe.kernels.base.config import next_power_of_2
from distmoe.kernels.base.device import device_context
from distmoe.kernels.base.tiles import tile_activation_rows, tile_expert
from distmoe.quant.formats import float32_bits
from distmoe.quant.fp8_block import fp8_block_encode
from distmoe.quant.mxfp8 import mxfp8_encode

__all__ = ["TOKEN_BLOCK", "TOKEN_FORMATS", "quantize_tokens", "quantize_tokens_ref"]

#: tokens per scale, and the padding multiple the layout needs
TOKEN_BLOCK = 128
#: format -> scale dtype
TOKEN_FORMATS = {"fp8_block": torch.float32, "mxfp8_rebased": torch.uint8}
_BLOCK_C = 64


@triton.jit
def _token_quant_kernel(rows_ptr, gather_ptrs_ptr, padded_offsets_ptr, row_offsets_ptr,
                        qt_ptr, st_ptr, R_CAP, C: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                        EXPERTS_POW2: tl.constexpr, BLOCK_C: tl.constexpr,
                        GATHER: tl.constexpr, BLOCK_FP8: tl.constexpr):
    row_start = tl.program_id(0) * 128
    if row_start < tl.load(padded_offsets_ptr + NUM_EXPERTS):
        expert = tile_expert(padded_offsets_ptr, row_start, NUM_EXPERTS, EXPERTS_POW2)
        act_start, num_live = tile_activation_rows(padded_offsets_ptr, row_offsets_ptr,
                                                   expert, row_start)
        j = tl.arange(0, 128)
        live = j < num_live
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        in_c = c < C
        if GATHER:
            src = tl.load(gather_ptrs_ptr + row_start + j, mask=live, other=0)
            base = tl.multiple_of(src.to(tl.pointer_type(tl.bfloat16)), 16)
            ok = (live & (src != 0))[:, None] & in_c[None, :]
        else:
            base = rows_ptr + (act_start + j).to(tl.int64) * C
            ok = live[:, None] & in_c[None, :]
        v = tl.load(base[:, None] + c[None, :], mask=ok, other=0.0)  # [128, BLOCK_C]
        bits = tl.reshape(tl.trans(float32_bits(v)), (BLOCK_C, 1, 128))
        if BLOCK_FP8:
            q, s = fp8_block_encode(bits)
            sv = tl.reshape(s, (BLOCK_C,))
        else:
            q, e = mxfp8_encode(bits)
            sv = (tl.reshape(e, (BLOCK_C,)) + 127).to(tl.uint8)
        q = tl.reshape(q, (BLOCK_C, 128))
        cols = c.to(tl.int64)
        tl.store(qt_ptr + cols[:, None] * R_CAP + (row_start + j)[None, :], q,
                 mask=in_c[:, None])
        tl.store(st_ptr + (row_start // 128) * C + cols, sv, mask=in_c)


def quantize_tokens(rows: torch.Tensor | None, padded_offsets: torch.Tensor,
                    row_offsets: torch.Tensor, qt: torch.Tensor, st: torch.Tensor, *,
                    format: str, gather_ptrs: torch.Tensor | None = None) -> None:
    """Quantise along tokens, transposed (module docstring).

    Args:
        rows: bf16 ``[R_act, C]`` contiguous activation rows (``R_act >= row_offsets[E]``, a
            device value), or None with ``gather_ptrs``.
        padded_offsets / row_offsets: int32 ``[E + 1]`` (device): the padded segments
            (multiples of 128) and the live rows' exclusive prefix sum.
        qt: float8_e4m3fn (or its uint8 view) ``[C, R_cap]`` contiguous, ``R_cap`` a multiple
            of 128 covering the padded rows.
        st: ``[R_cap / 128, C]`` contiguous (block-major: a GEMM step reads one row of it):
            float32 (``"fp8_block"``) or uint8 E8M0 (``"mxfp8_rebased"``).
        format: ``"fp8_block"`` or ``"mxfp8_rebased"``.
        gather_ptrs: int64 ``[R_cap]``: the row addresses by padded row (bf16 rows of C; 0:
            a null row) instead of ``rows``.
    """
    if format not in TOKEN_FORMATS:
        raise ValueError(f"format ({format!r}) must be one of {list(TOKEN_FORMATS)}")
    check_tensor("qt", qt, dtypes=(torch.float8_e4m3fn, torch.uint8), ndim=2,
                 shape_text="[C, R_cap]")
    cols, r_cap = qt.shape
    if r_cap % TOKEN_BLOCK:
        raise ValueError(f"R_cap ({r_cap}, qt.shape[1]) must be a multiple of {TOKEN_BLOCK} "
                         "(tokens per scale)")
    check_tensor("st", st, dtypes=(TOKEN_FORMATS[format],), shape=[r_cap // TOKEN_BLOCK, cols],
                 shape_text=f"[R_cap/{TOKEN_BLOCK}, C] ({format} scales)")
    named = dict(padded_offsets=padded_offsets, row_offsets=row_offsets, qt=qt, st=st)
    if (rows is None) == (gather_ptrs is None):
        raise ValueError("pass exactly one of rows and gather_ptrs, got "
                         f"{'both' if rows is not None else 'neither'}")
    if rows is not None:
        check_tensor("rows", rows, dtypes=(torch.bfloat16,), ndim=2, shape_text="[R_act, C]")
        if rows.shape[1] != cols:
            raise ValueError(f"rows must have C = {cols} (qt.shape[0]) columns, got shape "
                             f"{list(rows.shape)}")
        named["rows"] = rows
    else:
        check_tensor("gather_ptrs", gather_ptrs, dtypes=(torch.int64,), shape=[r_cap],
                     shape_text="[R_cap] (row addresses by padded row)")
        named["gather_ptrs"] = gather_ptrs
    num_experts = check_expert_tables(padded_offsets, row_offsets)
    device = check_devices(named)
    if r_cap == 0 or cols == 0:
        return
    grid = (r_cap // TOKEN_BLOCK, triton.cdiv(cols, _BLOCK_C))
    with device_context(device):
        _token_quant_kernel[grid](
            padded_offsets if rows is None else rows,
            padded_offsets if gather_ptrs is None else gather_ptrs, padded_offsets,
            row_offsets, qt.view(torch.uint8), st, r_cap, C=cols, NUM_EXPERTS=num_experts,
            EXPERTS_POW2=max(2, next_power_of_2(num_experts)), BLOCK_C=_BLOCK_C,
            GATHER=gather_ptrs is not None, BLOCK_FP8=format == "fp8_block", num_warps=8,
        )  # fmt: skip


def quantize_tokens_ref(values: torch.Tensor, format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch rule of one block: ``values [..., 128]`` (float) quantised along the last
    axis, ``(q float8_e4m3fn [..., 128], s [...])`` (float32, or uint8 E8M0). For tests."""
    from distmoe.quant.formats import e8m0_exponent_ref
    from distmoe.quant.fp8_block import fp8_block_quantize_ref

    if format == "fp8_block":
        q, s = fp8_block_quantize_ref(values)
        return q, s[..., 0]
    v = values.double()
    finite = torch.isfinite(v)
    amax = torch.where(finite, v.abs(), 0.0).amax(-1)
    e = e8m0_exponent_ref(amax)
    scaled = torch.where(finite, v / torch.exp2(e.double())[..., None], 0.0)
    code = scaled.float().clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    nan = torch.full_like(code, 0x7F) | torch.where(torch.signbit(v), 0x80, 0).to(torch.uint8)
    code = torch.where(finite, code, nan)
    return code.view(torch.float8_e4m3fn), (e + 127).to(torch.uint8)
