"""Dequantise FP8 activation rows in one pass: :func:`dequantize_rows_2d` (Triton).

For ``qdata [R, K]`` (E4M3) with scales along K in one of the FP8 operand formats
(``"mxfp8"``: uint8 E8M0 ``[R, K/32]``; ``"mxfp8_rebased"``: E8M0 ``[R, K/128]``;
``"fp8_block"``: float32 ``[R, K/128]``)::

    out[r, k] = round(fl32(v(q[r, k]) * s(r, k // G)))      to out's dtype (bf16 or float32)

``v`` is the E4M3 value (exact in float32; NaN for the NaN codes), ``s`` the scale (``2^(e -
127)`` exactly for E8M0, NaN for byte 255; the float32 as stored for fp8_block), the product
rounded once to float32 (exact for E8M0 scales unless it leaves float32's range), then once
to ``out``'s dtype: the bits of the plain-PyTorch :func:`distmoe.quant.prepare.dequantize_rows`
(its ``q.float() * scale``, then ``.to(dtype)``). Why: that form writes and rereads float32
copies of the whole tensor (about 20 bytes of traffic per value against 3 here), and the FP8
training backward dequantises x for its bf16 weight gradient every step.

Grid: ``cdiv(R, 32)`` row blocks by ``cdiv(K, 256)`` column blocks. No host synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from distmoe.kernels.base.checks import check_devices, check_tensor
from distmoe.kernels.base.device import device_context
from distmoe.quant.formats import e4m3_byte_to_fp32, e8m0_to_fp32, tile_grid, tile_ids

__all__ = ["DEQUANT_FORMATS", "dequantize_rows_2d"]

#: format -> (values per scale, scale dtype)
DEQUANT_FORMATS = {"mxfp8": (32, torch.uint8), "mxfp8_rebased": (128, torch.uint8),
                   "fp8_block": (128, torch.float32)}
_BLOCK_R, _BLOCK_C = 32, 256


@triton.jit
def _dequant_rows_kernel(q_ptr, s_ptr, out_ptr, rows, COLS: tl.constexpr, GROUP: tl.constexpr,
                         E8M0: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pid_r, pid_c = tile_ids(tl.cdiv(COLS, BLOCK_C))
    r = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (r < rows)[:, None] & (c < COLS)[None, :]
    offs = r[:, None] * COLS + c[None, :]
    v = e4m3_byte_to_fp32(tl.load(q_ptr + offs, mask=ok, other=0).to(tl.int32))
    s = tl.load(s_ptr + r[:, None] * (COLS // GROUP) + (c // GROUP)[None, :], mask=ok, other=0)
    if E8M0:
        s = e8m0_to_fp32(s.to(tl.int32))
    tl.store(out_ptr + offs, (v * s).to(out_ptr.dtype.element_ty), mask=ok)


def dequantize_rows_2d(qdata: torch.Tensor, scales: torch.Tensor, fmt: str,
                       out: torch.Tensor) -> torch.Tensor:
    """Dequantise ``qdata [R, K]`` (float8_e4m3fn, or its uint8 view) with ``scales`` of
    format ``fmt`` (:data:`DEQUANT_FORMATS`) into ``out`` (bf16 or float32 ``[R, K]``); all
    contiguous on one device (CUDA, or the CPU under Triton's interpreter). Returns ``out``."""
    if fmt not in DEQUANT_FORMATS:
        raise ValueError(f"fmt ({fmt!r}) must be one of {list(DEQUANT_FORMATS)}")
    group, sdtype = DEQUANT_FORMATS[fmt]
    check_tensor("qdata", qdata, dtypes=(torch.float8_e4m3fn, torch.uint8), ndim=2,
                 shape_text="[R, K]")
    rows, cols = qdata.shape
    if cols % group:
        raise ValueError(f"K ({cols}, qdata.shape[1]) must be a multiple of {group} "
                         f"(values per {fmt} scale)")
    check_tensor("scales", scales, dtypes=(sdtype,), shape=[rows, cols // group],
                 shape_text=f"[R, K/{group}] ({fmt} scales)")
    check_tensor("out", out, dtypes=(torch.bfloat16, torch.float32), shape=[rows, cols],
                 shape_text="[R, K]")
    device = check_devices(dict(qdata=qdata, scales=scales, out=out))
    if rows == 0 or cols == 0:
        return out
    grid = tile_grid(triton.cdiv(rows, _BLOCK_R), triton.cdiv(cols, _BLOCK_C))
    with device_context(device):
        _dequant_rows_kernel[grid](qdata.view(torch.uint8), scales, out, rows, COLS=cols,
                                   GROUP=group, E8M0=fmt != "fp8_block", BLOCK_R=_BLOCK_R,
                                   BLOCK_C=_BLOCK_C, num_warps=4)
    return out
