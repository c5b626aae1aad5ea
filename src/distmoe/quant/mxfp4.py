"""MXFP4: E2M1 values packed two per byte with one E8M0 scale per 32 values (OCP MX), the
format GPT-OSS checkpoints ship their experts in. Weights only (prepared once; the layer
decodes them in its GEMM, :mod:`distmoe.kernels.scaled.nvfp4`).

Rule, per block of 32 values along ``dim`` (docs/numerics.md, section 4's E2M1 grid)::

    amax = max |x| over the block's values        (a non-finite value: the block is NaN)
    e    = the smallest integer with amax <= 6 * 2^e, clamped to [-127, 127] (amax 0: -127)
    v    = RNE(x / 2^e) on the E2M1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} (ties to the even code),
           saturated at +-6 (reached only where the clamp raised e's floor), with x's sign
    code = sign << 3 | index of |v| in the grid;  scale byte = e + 127

A block holding NaN or Inf gets scale byte 255 (E8M0's NaN) and zero codes: it dequantises to
NaN. The ceil rule keeps every finite value within the grid (the OCP floor rule
``floor(log2 amax) - 2`` would clip the top of the block to 6). Packing: the element of even
index in the low nibble, as :func:`~distmoe.quant.nvfp4_quantize` and GPT-OSS's ``*_blocks``
tensors. Error: half a grid step times ``2^e`` (``0.25 * 2^e`` where ``|x| < 2^(e+1)``,
``0.5 * 2^e`` up to ``2^(e+2)``, ``2^e`` above), so at most 1/4 of ``|x|`` where
``|x| >= 2^e`` and ``0.25 * 2^e`` absolute below.

Implemented in plain PyTorch (any device): a weight is quantised once per version, outside
the hot path.
"""

from __future__ import annotations

import torch

from distmoe.kernels.base.checks import check_tensor
from distmoe.quant.formats import E2M1_VALUES
from distmoe.quant.nvfp4 import unpack_e2m1

__all__ = ["MXFP4_BLOCK", "mxfp4_dequantize", "mxfp4_quantize"]

#: values per E8M0 scale
MXFP4_BLOCK = 32


def _axis_last(x: torch.Tensor, dim: int, name: str, width: int) -> tuple[torch.Tensor, int]:
    if not isinstance(dim, int) or isinstance(dim, bool) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim ({dim!r}) must be an axis of {name} (ndim {x.dim()})")
    dim = dim % x.dim()
    if x.shape[dim] % width or x.shape[dim] == 0:
        raise ValueError(f"{name}.shape[{dim}] ({x.shape[dim]}) must be a positive multiple of "
                         f"{width}")
    return x.movedim(dim, -1), dim


def mxfp4_quantize(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed uint8, scales uint8 E8M0)`` of ``x`` (float32 / bf16 / fp16) by the module's
    rule along ``dim`` (a multiple of 32): ``packed`` has ``x``'s shape with ``shape[dim] /
    2``, ``scales`` with ``shape[dim] / 32``; both contiguous on ``x``'s device."""
    check_tensor("x", x, dtypes=(torch.float32, torch.bfloat16, torch.float16),
                 contiguous=False)
    moved, dim = _axis_last(x, dim, "x", MXFP4_BLOCK)
    v = moved.double().unflatten(-1, (-1, MXFP4_BLOCK))  # [..., G, 32], exact
    finite = torch.isfinite(v).all(-1)
    amax = torch.where(torch.isfinite(v), v.abs(), 0.0).amax(-1)
    # the smallest e with amax <= 6 * 2^e, exactly: amax = f 2^k with f in [0.5, 1), so
    # amax / 2^(k-3) lies in [4, 8): e is k - 3, or k - 2 where that quotient passes 6
    _, k = torch.frexp(amax)
    e = k.to(torch.int64) - 3
    e = e + (amax > 6.0 * torch.exp2(e.double())).to(torch.int64)
    e = torch.where(amax == 0, -127, e).clamp(-127, 127)
    y = (v.abs() / torch.exp2(e.double())[..., None]).clamp(max=6.0)
    step = torch.where(y < 2, 0.5, torch.where(y < 4, 1.0, 2.0))
    mag = torch.round(y / step) * step  # ties to even: an even multiple is an even code
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=x.device)
    code = torch.searchsorted(table, mag.contiguous())  # exact grid values
    code = code | torch.where(torch.signbit(v), 8, 0)
    code = torch.where(finite[..., None], code, 0).flatten(-2).to(torch.uint8)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    scales = torch.where(finite, e + 127, 255).to(torch.uint8)
    return packed.movedim(-1, dim).contiguous(), scales.movedim(-1, dim).contiguous()


def mxfp4_dequantize(packed: torch.Tensor, scales: torch.Tensor, dim: int = -1, *,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``v * 2^(s - 127)`` of every packed value as ``dtype`` (computed in float64: exact in
    float32 and float64; NaN for scale byte 255); ``packed`` uint8 (two values per byte along
    ``dim``, the low nibble first), ``scales`` uint8 with ``shape[dim] * 2 / 32``."""
    check_tensor("packed", packed, dtypes=(torch.uint8,), contiguous=False)
    moved, dim = _axis_last(packed, dim, "packed", MXFP4_BLOCK // 2)
    want = list(moved.shape)
    want[-1] = want[-1] * 2 // MXFP4_BLOCK
    check_tensor("scales", scales, dtypes=(torch.uint8,), contiguous=False)
    s = scales.movedim(dim, -1)
    if list(s.shape) != want:
        raise ValueError(f"scales must have packed's shape with shape[dim] * 2 / 32 "
                         f"({want} with dim last), got {list(s.shape)} with dim last")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise TypeError(f"dtype must be float64, float32, bfloat16 or float16, got {dtype}")
    nib = unpack_e2m1(moved, -1).to(torch.int64)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=packed.device)
    v = torch.where((nib & 8) != 0, -table[nib & 7], table[nib & 7])
    scale = torch.exp2(s.double() - 127)
    scale = torch.where(s == 255, float("nan"), scale)
    out = (v.unflatten(-1, (-1, MXFP4_BLOCK)) * scale[..., None]).flatten(-2)
    return out.to(dtype).movedim(-1, dim).contiguous()
