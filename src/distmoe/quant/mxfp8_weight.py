"""MXFP8 quantisation of a static weight in 32 x 32 blocks, one qdata for both GEMMs.

A weight ``w [..., N, K]`` is used twice: the forward GEMM reads its rows (contracting over
K, 1 x 32 groups along K) and the input-gradient GEMM reads its columns (contracting over N,
32 x 1 groups along N). A 1 x 32 quantisation along K would give the column reader values
whose scales vary inside its 32-value groups, so it would need a second qdata. Here each
32 x 32 tile gets one E8M0 scale from the tile's amax (the rule of :mod:`distmoe.quant.mxfp8`:
the smallest ``e`` with ``amax <= 448 * 2^e``, values rounded to nearest even, NaN / Inf
stored as NaN and left out of the amax, an all-zero tile gets e = -127), so every 1 x 32 row
group and every 32 x 1 column group lies in one tile and one qdata serves both readers; only
the scale layout differs (:class:`MXFP8Weight`). A tile's amax is at least any of its rows'
amaxes, so a row group may get a larger scale than a 1 x 32 quantisation would give it.

Kernel: one program per 32 rows by ``block_groups`` tiles of the 2-D ``[B * N, K]`` view
(leading dims flattened: N being a multiple of 32, no tile straddles two matrices); it loads
``[32, groups, 32]``, reduces the amax over axes 0 and 2, rounds in integer arithmetic. No
host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from distmoe.kernels.base.checks import check_devices, check_tensor
from distmoe.kernels.base.device import device_context
from distmoe.quant.formats import (
    E8M0_BIAS,
    MXFP8_BLOCK,
    QuantLaunchConfig,
    check_launch_config,
    check_quant_input,
    e8m0_exponent,
    e8m0_exponent_ref,
    finite_abs_bits,
    float32_bits,
    pow2_ref,
    round_e4m3,
    sign_bits,
    tile_grid,
    tile_ids,
)
from distmoe.quant.mxfp8 import encode_e4m3_ref


@dataclass(frozen=True)
class MXFP8Weight:
    """A weight ``w [..., N, K]`` quantised in 32 x 32 blocks (:func:`mxfp8_quantize_weight`).

    Attributes:
        qdata: float8_e4m3fn ``[..., N, K]``, contiguous: ``w[..., n, k] ~ qdata[..., n, k] *
            2^(scales[..., n // 32, k // 32] - 127)``. The input-gradient GEMM reads the same
            qdata transposed (``qdata.mT``, a view).
        scales: uint8 E8M0 ``[..., N / 32, K / 32]``, contiguous: one per 32 x 32 block.

    The 1 x 32 forms (:attr:`row_scales`, :attr:`col_scales`) repeat each block scale 32 times
    along one axis; they are computed on access (new tensors, 1/32 of qdata's size each).
    """

    qdata: torch.Tensor
    scales: torch.Tensor

    @property
    def row_scales(self) -> torch.Tensor:
        """uint8 ``[..., N, K / 32]``: the scale of ``qdata[..., n, k]`` is
        ``row_scales[..., n, k // 32]`` (1 x 32 groups along K, for a GEMM contracting over K;
        the layout of ``mxfp8_quantize(w, dim=-1)``'s scales)."""
        return self.scales.repeat_interleave(MXFP8_BLOCK, dim=-2)

    @property
    def col_scales(self) -> torch.Tensor:
        """uint8 ``[..., N / 32, K]``: the scale of ``qdata[..., n, k]`` is
        ``col_scales[..., n // 32, k]`` (32 x 1 groups along N, for a GEMM contracting over
        N; the layout of ``mxfp8_quantize(w, dim=-2)``'s scales). For the transposed operand
        ``qdata.mT [..., K, N]`` read in 1 x 32 groups along its rows, the scales are
        ``col_scales.mT [..., K, N / 32]``."""
        return self.scales.repeat_interleave(MXFP8_BLOCK, dim=-1)


@triton.jit
def _mxfp8_weight_kernel(w_ptr, q_ptr, s_ptr, num_groups, GROUPS: tl.constexpr):
    pid_r, pid_g = tile_ids(tl.cdiv(num_groups, GROUPS))  # pid_r: a 32-row block of [B * N, K]
    r = pid_r.to(tl.int64) * 32 + tl.arange(0, 32)
    g = pid_g * GROUPS + tl.arange(0, GROUPS)
    j = tl.arange(0, 32)
    cols = num_groups * 32  # r is int64: offsets are int64
    ok = g < num_groups
    offs = r[:, None, None] * cols + (g[None, :, None] * 32 + j[None, None, :])
    ok3 = ok[None, :, None] & (r[:, None, None] >= 0)
    bits = float32_bits(tl.load(w_ptr + offs, mask=ok3, other=0.0))
    abs_bits = bits & 0x7FFFFFFF
    amax_bits = tl.max(tl.max(finite_abs_bits(bits), axis=2), axis=0)
    e = e8m0_exponent(amax_bits)
    code = round_e4m3(abs_bits, e[None, :, None])
    code = tl.where(abs_bits < 0x7F800000, code, 0x7F)  # NaN, Inf -> NaN
    sign = (bits >> 24) & 0x80
    tl.store(q_ptr + offs, (code | sign).to(tl.uint8), mask=ok3)
    tl.store(s_ptr + pid_r.to(tl.int64) * num_groups + g, (e + 127).to(tl.uint8), mask=ok)


def mxfp8_quantize_weight_2d(w: torch.Tensor, qdata: torch.Tensor, scales: torch.Tensor, *,
                             config: QuantLaunchConfig | None = None) -> None:
    """Launcher: quantise contiguous ``w [rows, cols]`` (both multiples of 32) in 32 x 32 blocks
    into the caller's ``qdata`` (float8_e4m3fn or uint8 ``[rows, cols]``) and ``scales``
    (uint8 ``[rows / 32, cols / 32]``), contiguous on one device. ``config.block_rows`` is
    not used (the tile is 32 rows)."""
    config = check_launch_config(config)
    check_quant_input("w", w, -1, MXFP8_BLOCK)
    check_tensor("w", w, dtypes=(w.dtype,), ndim=2, shape_text="[rows, cols]")
    check_quant_input("w", w, 0, MXFP8_BLOCK)
    rows, cols = w.shape
    check_tensor("qdata", qdata, dtypes=(torch.float8_e4m3fn, torch.uint8), shape=[rows, cols],
                 shape_text="(w's shape)")
    check_tensor("scales", scales, dtypes=(torch.uint8,),
                 shape=[rows // MXFP8_BLOCK, cols // MXFP8_BLOCK],
                 shape_text="[rows / 32, cols / 32]")
    check_devices({"w": w, "qdata": qdata, "scales": scales})
    if w.numel() == 0:
        return
    num_groups = cols // MXFP8_BLOCK
    grid = tile_grid(rows // MXFP8_BLOCK, triton.cdiv(num_groups, config.block_groups))
    with device_context(w.device):
        _mxfp8_weight_kernel[grid](w, qdata.view(torch.uint8), scales, num_groups,
                                   GROUPS=config.block_groups, num_warps=config.num_warps)


def _check_weight(w: object) -> None:
    check_quant_input("w", w, -1, MXFP8_BLOCK)
    if w.dim() < 2:
        raise ValueError(f"w must have at least 2 dimensions ([..., N, K]), got shape "
                         f"{list(w.shape)}")
    check_quant_input("w", w, -2, MXFP8_BLOCK)


def mxfp8_quantize_weight(w: torch.Tensor, *,
                          config: QuantLaunchConfig | None = None) -> MXFP8Weight:
    """MXFP8-quantise a static weight ``w [..., N, K]`` in 32 x 32 blocks over its last two
    dims (Triton kernel; the rule in the module docstring).

    Args:
        w: bf16, fp16 or fp32, at least 2-D, N and K multiples of 32, on a CUDA device (or the
            CPU under the interpreter). A non-contiguous ``w`` is copied first.
        config: kernel tile (``block_groups`` and ``num_warps`` are used).

    Returns:
        :class:`MXFP8Weight` with ``qdata [..., N, K]`` and ``scales [..., N / 32, K / 32]``
        (plus the 1 x 32 forms ``row_scales`` and ``col_scales``).
    """
    _check_weight(w)
    n, k = w.shape[-2:]
    flat = w.contiguous().view(-1, k)
    qdata = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scales = torch.empty((*w.shape[:-2], n // MXFP8_BLOCK, k // MXFP8_BLOCK), dtype=torch.uint8,
                         device=w.device)
    mxfp8_quantize_weight_2d(flat, qdata.view(-1, k),
                             scales.view(-1, k // MXFP8_BLOCK), config=config)
    return MXFP8Weight(qdata=qdata, scales=scales)


def mxfp8_quantize_weight_ref(w: torch.Tensor) -> MXFP8Weight:
    """Plain-PyTorch reference of :func:`mxfp8_quantize_weight` (any device, float64), bit
    for bit the same."""
    _check_weight(w)
    n, k = w.shape[-2:]
    tiles = w.unflatten(-2, (n // MXFP8_BLOCK, MXFP8_BLOCK))
    tiles = tiles.unflatten(-1, (k // MXFP8_BLOCK, MXFP8_BLOCK))  # [..., N/32, 32, K/32, 32]
    sign = sign_bits(tiles)
    wide = tiles.to(torch.float64)
    finite = torch.isfinite(wide)
    amax = torch.where(finite, wide.abs(), 0.0).amax(dim=(-3, -1))  # [..., N/32, K/32]
    e = e8m0_exponent_ref(amax)
    scale = pow2_ref(-e)[..., :, None, :, None]
    qdata = encode_e4m3_ref(wide * scale, finite, sign)
    return MXFP8Weight(qdata=qdata.flatten(-2).flatten(-3, -2).contiguous(),
                       scales=(e + E8M0_BIAS).to(torch.uint8))
