"""NVFP4 quantisation: E2M1 values, one E4M3 block scale per 16 values, a float32 global scale.

Two levels of scale, all arithmetic in float32 with correctly rounded division (the quotient
of each step is rounded to nearest even, docs/numerics.md derives the bounds):

    amax  = max |x| over the finite values of the tensor (``per="tensor"``) or of each row
            (``per="row"``: a row is every index of the other dims, the values along ``dim``)
    s_g   = max(amax / 2688, 2^-126)                 global (decode) scale, 2688 = 448 * 6
    t     = (bamax / 6) / s_g                        bamax: the block's finite amax
    s_b   = t rounded to nearest even onto E4M3, saturated at 448   (block scale)
    D     = s_b * s_g                                the block's decode factor
    v     = x / D rounded to nearest even onto {0, 0.5, 1, 1.5, 2, 3, 4, 6} (with sign),
            saturated at 6;                           x ~ v * D

``s_g`` is floored at float32's smallest normal so that it is never zero (an all-zero
tensor or row gets 2^-126) and ``D`` needs no special case. A caller may pass ``s_g``
(``global_scale``, e.g. a calibrated one): it must then be positive and finite (device
values, not checked); a too-small one saturates block scales at 448.

* Zero blocks: a block whose ``t`` rounds to 0 (all zeros, or a block amax at most
  2^-10 * 6 * s_g) stores block scale 0 and nibbles 0. In other blocks zeros, and values that
  round to zero, keep their sign (nibble 0b1000 for ``-0``).
* Non-finite inputs: E2M1 has no NaN or infinity, so a block holding a NaN or +-Inf stores
  block scale NaN (``0x7F``) and zero codes: the whole block dequantises to NaN. The amaxes
  leave such values out, so the other blocks of the row or tensor keep their scales.
* Packing: two E2M1 codes per byte along ``dim``; the element of even index goes in the low
  nibble (bits 0-3), the odd one in the high nibble; each nibble is ``sign << 3 | code``,
  ``code`` indexing {0, 0.5, 1, 1.5, 2, 3, 4, 6}.

Kernels (2-D ``[rows, cols]`` view, cols along ``dim``; another ``dim`` costs a
``movedim(...).contiguous()`` copy in and out): without a given ``global_scale``, an amax
kernel reduces ``block_rows x 16 * block_groups`` tiles and ``atomic_max``-es the float32 bits
(non-negative floats order like their bits) into a zeroed int32 buffer, per row or one for
the tensor; the quantiser then reads even and odd elements as two ``[rows, groups, 8]``
tiles, computes the scales, rounds in integer arithmetic and stores the packed bytes. Grids
come from the shape; no host synchronisation.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from distmoe.kernels.base.checks import check_devices, check_tensor
from distmoe.kernels.base.device import device_context
from distmoe.quant.formats import (
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MAX,
    E4M3_NAN,
    NVFP4_BLOCK,
    QuantLaunchConfig,
    check_block_dim,
    check_launch_config,
    check_quant_input,
    e4m3_code_to_float,
    finite_abs_bits,
    float32_bits,
    round_e4m3_unscaled,
    round_minifloat,
    round_minifloat_ref,
    sign_bits,
    tile_grid,
    tile_ids,
)

#: 448 * 6: the global scale maps the amax onto the largest block scale times the largest
#: E2M1 value.
NVFP4_AMAX_DIVISOR = E4M3_MAX * E2M1_MAX
#: Floor of the global scale: float32's smallest normal.
NVFP4_MIN_GLOBAL_SCALE = 2.0**-126

Per = Literal["tensor", "row"]


@triton.jit
def _nvfp4_amax_kernel(x_ptr, amax_ptr, rows, cols, PER_ROW: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pid_r, pid_c = tile_ids(tl.cdiv(cols, BLOCK_C))
    r = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = pid_c.to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (r[:, None] < rows) & (c[None, :] < cols)
    x = tl.load(x_ptr + r[:, None] * cols + c[None, :], mask=ok, other=0.0)
    amax_bits = tl.max(finite_abs_bits(float32_bits(x)), axis=1)
    if PER_ROW:
        tl.atomic_max(amax_ptr + r, amax_bits, mask=r < rows)
    else:
        tl.atomic_max(amax_ptr, tl.max(amax_bits, axis=0))


@triton.jit
def _e2m1_nibbles(bits, D, use):
    """Sign-and-code nibbles (int32) of the float32 bit patterns ``bits`` divided by ``D``;
    0 where ``use`` is false."""
    abs_bits = bits & 0x7FFFFFFF
    y = tl.math.div_rn(abs_bits.to(tl.float32, bitcast=True), D)
    code = round_minifloat(y.to(tl.int32, bitcast=True), 0, 1, 0, 7)
    nibble = code | ((bits >> 28) & 0x8)
    return tl.where(use, nibble, 0)


@triton.jit
def _nvfp4_quantize_kernel(x_ptr, packed_ptr, scales_ptr, gs_ptr, amax_ptr, rows, num_groups,
                           HAS_GLOBAL: tl.constexpr, PER_ROW: tl.constexpr,
                           BLOCK_R: tl.constexpr, GROUPS: tl.constexpr):
    pid_r, pid_g = tile_ids(tl.cdiv(num_groups, GROUPS))
    r = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = pid_g * GROUPS + tl.arange(0, GROUPS)
    j = tl.arange(0, 8)
    row_ok = r < rows
    ok2 = row_ok[:, None] & (g[None, :] < num_groups)
    ok3 = ok2[:, :, None]
    cols = num_groups * 16  # r is int64: offsets are int64
    pair = r[:, None, None] * cols + (g[None, :, None] * 16 + 2 * j[None, None, :])

    if PER_ROW:
        if HAS_GLOBAL:
            s_g = tl.load(gs_ptr + r, mask=row_ok, other=1.0)
        else:
            amax = tl.load(amax_ptr + r, mask=row_ok, other=0).to(tl.float32, bitcast=True)
            s_g = tl.maximum(tl.math.div_rn(amax, 2688.0), 1.1754943508222875e-38)
            if pid_g == 0:
                tl.store(gs_ptr + r, s_g, mask=row_ok)
        s_g = s_g[:, None]
    else:
        if HAS_GLOBAL:
            s_g = tl.load(gs_ptr)
        else:
            amax = tl.load(amax_ptr).to(tl.float32, bitcast=True)
            s_g = tl.maximum(tl.math.div_rn(amax, 2688.0), 1.1754943508222875e-38)
            if (pid_r == 0) & (pid_g == 0):
                tl.store(gs_ptr, s_g)

    even = float32_bits(tl.load(x_ptr + pair, mask=ok3, other=0.0))
    odd = float32_bits(tl.load(x_ptr + pair + 1, mask=ok3, other=0.0))
    bamax_bits = tl.maximum(tl.max(finite_abs_bits(even), axis=2),
                            tl.max(finite_abs_bits(odd), axis=2))
    bad = tl.maximum(tl.max(((even & 0x7FFFFFFF) >= 0x7F800000).to(tl.int32), axis=2),
                     tl.max(((odd & 0x7FFFFFFF) >= 0x7F800000).to(tl.int32), axis=2))
    bamax = bamax_bits.to(tl.float32, bitcast=True)
    t = tl.math.div_rn(tl.math.div_rn(bamax, 6.0), s_g)
    sb_code = round_e4m3_unscaled(t.to(tl.int32, bitcast=True))
    use = (sb_code > 0) & (bad == 0)
    D = e4m3_code_to_float(sb_code) * s_g
    D = tl.where(use, D, 1.0)[:, :, None]
    use3 = use[:, :, None]
    lo = _e2m1_nibbles(even, D, use3)
    hi = _e2m1_nibbles(odd, D, use3)
    out = r[:, None, None] * (cols // 2) + (g[None, :, None] * 8 + j[None, None, :])
    tl.store(packed_ptr + out, (lo | (hi << 4)).to(tl.uint8), mask=ok3)
    sb = tl.where(bad == 0, sb_code, 0x7F)
    tl.store(scales_ptr + r[:, None] * num_groups + g[None, :], sb.to(tl.uint8), mask=ok2)


def _check_per(per: object) -> None:
    if per not in ("tensor", "row"):
        raise ValueError(f"per must be 'tensor' or 'row', got {per!r}")


def _global_shape(shape: torch.Size, dim: int, per: Per) -> list[int]:
    """``[]`` for one global scale, else ``shape`` with ``shape[dim] = 1`` (one per row)."""
    if per == "tensor":
        return []
    out = list(shape)
    out[dim] = 1
    return out


def nvfp4_quantize_2d(x: torch.Tensor, packed: torch.Tensor, block_scales: torch.Tensor,
                      global_scale: torch.Tensor, *, per: Per = "tensor",
                      given_global: bool = False,
                      config: QuantLaunchConfig | None = None) -> None:
    """Launcher: quantise contiguous ``x [rows, cols]`` (cols a multiple of 16) along its last
    axis into the caller's ``packed`` (uint8 ``[rows, cols / 2]``), ``block_scales``
    (float8_e4m3fn or uint8 ``[rows, cols / 16]``) and ``global_scale`` (float32, ``[1]`` for
    ``per="tensor"``, ``[rows]`` for ``per="row"``), all contiguous on one device.

    With ``given_global`` the kernel reads ``global_scale``; otherwise it computes it from the
    amax (one extra launch and a zeroed int32 buffer) and writes it there."""
    config = check_launch_config(config)
    _check_per(per)
    check_quant_input("x", x, -1, NVFP4_BLOCK)
    check_tensor("x", x, dtypes=(x.dtype,), ndim=2, shape_text="[rows, cols]")
    rows, cols = x.shape
    check_tensor("packed", packed, dtypes=(torch.uint8,), shape=[rows, cols // 2],
                 shape_text="[rows, cols / 2] (two E2M1 values per byte)")
    check_tensor("block_scales", block_scales, dtypes=(torch.float8_e4m3fn, torch.uint8),
                 shape=[rows, cols // NVFP4_BLOCK], shape_text="[rows, cols / 16]")
    check_tensor("global_scale", global_scale, dtypes=(torch.float32,),
                 shape=[rows] if per == "row" else [1],
                 shape_text="(one per row)" if per == "row" else "(one for the tensor)")
    check_devices({"x": x, "packed": packed, "block_scales": block_scales,
                   "global_scale": global_scale})
    if x.numel() == 0:
        if not given_global:
            global_scale.fill_(NVFP4_MIN_GLOBAL_SCALE)
        return
    num_groups = cols // NVFP4_BLOCK
    per_row = per == "row"
    amax = global_scale  # not read when the global scale is given
    with device_context(x.device):
        if not given_global:
            amax = torch.zeros(rows if per_row else 1, dtype=torch.int32, device=x.device)
            block_c = NVFP4_BLOCK * config.block_groups
            grid = tile_grid(triton.cdiv(rows, config.block_rows), triton.cdiv(cols, block_c))
            _nvfp4_amax_kernel[grid](x, amax, rows, cols, PER_ROW=per_row,
                                     BLOCK_R=config.block_rows, BLOCK_C=block_c,
                                     num_warps=config.num_warps)
        grid = tile_grid(triton.cdiv(rows, config.block_rows),
                         triton.cdiv(num_groups, config.block_groups))
        _nvfp4_quantize_kernel[grid](x, packed, block_scales.view(torch.uint8), global_scale,
                                     amax, rows, num_groups, HAS_GLOBAL=given_global,
                                     PER_ROW=per_row, BLOCK_R=config.block_rows,
                                     GROUPS=config.block_groups, num_warps=config.num_warps)


def _check_global(global_scale: object, want: list[int], x: torch.Tensor, per: Per) -> None:
    check_tensor("global_scale", global_scale, dtypes=(torch.float32,), shape=want,
                 shape_text=f"(per={per!r}: " + ("a 0-d tensor)" if per == "tensor" else
                                                 "x's shape with shape[dim] = 1)"),
                 contiguous=False)
    if global_scale.device != x.device:
        raise ValueError(f"global_scale must be on x's device ({x.device}), got "
                         f"{global_scale.device}")


def nvfp4_quantize(x: torch.Tensor, dim: int = -1, global_scale: torch.Tensor | None = None, *,
                   per: Per = "tensor", config: QuantLaunchConfig | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4-quantise ``x`` in blocks of 16 along ``dim`` (Triton kernels; the rule in the
    module docstring).

    Args:
        x: bf16, fp16 or fp32 on a CUDA device (or the CPU under the interpreter),
            ``x.shape[dim]`` a multiple of 16.
        dim: the quantised axis (the packing and the blocks run along it).
        global_scale: the decode scale ``s_g`` to use (float32, positive and finite, shaped
            as returned for ``per``), or None to compute ``max(amax / 2688, 2^-126)``.
        per: ``"tensor"``, one global scale (weights), or ``"row"``, one per row (activations:
            a row is each index of the dims other than ``dim``).
        config: kernel tile (:class:`~distmoe.quant.formats.QuantLaunchConfig`).

    Returns:
        ``(packed, block_scales, global_scale)``, contiguous: ``packed`` uint8, ``x``'s shape
        with ``shape[dim] / 2``; ``block_scales`` float8_e4m3fn, ``x``'s shape with
        ``shape[dim] / 16``; ``global_scale`` float32, 0-d for ``per="tensor"``, ``x``'s shape
        with ``shape[dim] = 1`` for ``per="row"`` (it broadcasts against ``x``). The given
        ``global_scale`` is returned as passed.
    """
    _check_per(per)
    dim = check_quant_input("x", x, dim, NVFP4_BLOCK)
    want = _global_shape(x.shape, dim, per)
    if global_scale is not None:
        _check_global(global_scale, want, x, per)
    moved = x.movedim(dim, -1).contiguous()
    cols = moved.shape[-1]
    rows = math.prod(moved.shape[:-1])
    packed = torch.empty((*moved.shape[:-1], cols // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((*moved.shape[:-1], cols // NVFP4_BLOCK), dtype=torch.float8_e4m3fn,
                         device=x.device)
    if global_scale is None:
        gs = torch.empty(rows if per == "row" else 1, dtype=torch.float32, device=x.device)
    else:
        gs = global_scale.movedim(dim, -1) if per == "row" else global_scale
        gs = gs.reshape(-1).contiguous()
    nvfp4_quantize_2d(moved.reshape(rows, cols), packed.view(rows, cols // 2),
                      scales.view(rows, cols // NVFP4_BLOCK), gs, per=per,
                      given_global=global_scale is not None, config=config)
    if global_scale is None:
        global_scale = gs.view(want) if per == "tensor" else \
            gs.view(*moved.shape[:-1], 1).movedim(-1, dim).contiguous()
    return (packed.movedim(-1, dim).contiguous(), scales.movedim(-1, dim).contiguous(),
            global_scale)


def unpack_e2m1(packed: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The nibbles (uint8, ``sign << 3 | code``) of ``packed``, two per byte along ``dim``,
    the low nibble first: ``packed``'s shape with ``shape[dim] * 2``."""
    dim = check_block_dim("packed", packed, dim, 1)
    pairs = torch.stack((packed & 0x0F, packed >> 4), dim=-1)  # [..., n, 2]
    return pairs.movedim(dim, -2).flatten(-2).movedim(-1, dim)


def nvfp4_dequantize(packed: torch.Tensor, block_scales: torch.Tensor,
                     global_scale: torch.Tensor, dim: int = -1, *,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``v * (s_b * s_g)`` for every packed value (plain PyTorch, any device), as ``dtype``.

    The decode factor ``D = s_b * s_g`` is the quantiser's (float32 product), so every value
    is ``fl32(v * D)``; another ``dtype`` rounds that float32 to nearest even. A NaN block
    scale gives NaN for its 16 values.

    Args:
        packed: uint8, two E2M1 values per byte along ``dim`` (low nibble first).
        block_scales: float8_e4m3fn (or its uint8 view), ``packed``'s shape with
            ``shape[dim] * 2 / 16``.
        global_scale: float32 broadcasting against the unpacked shape (0-d or one per row).
        dim: the axis of the blocks and the packing.
        dtype: float32, bfloat16 or float16.
    """
    check_tensor("packed", packed, dtypes=(torch.uint8,), contiguous=False)
    dim = check_block_dim("packed", packed, dim, 1)
    if packed.shape[dim] % (NVFP4_BLOCK // 2):
        raise ValueError(f"packed.shape[{dim}] ({packed.shape[dim]}) must be a multiple of 8 "
                         f"(bytes per 16-value block), got shape {list(packed.shape)}")
    want = list(packed.shape)
    want[dim] = want[dim] * 2 // NVFP4_BLOCK
    check_tensor("block_scales", block_scales, dtypes=(torch.float8_e4m3fn, torch.uint8),
                 shape=want, shape_text="(packed's shape with shape[dim] * 2 / 16)",
                 contiguous=False)
    check_tensor("global_scale", global_scale, dtypes=(torch.float32,), contiguous=False)
    if global_scale.dim() and (global_scale.dim() != packed.dim()
                               or global_scale.shape[dim] != 1):
        raise ValueError(f"global_scale must be 0-d or have packed's {packed.dim()} dims with "
                         f"shape[{dim}] = 1 (one per row), got shape {list(global_scale.shape)}")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    check_devices({"packed": packed, "block_scales": block_scales,
                   "global_scale": global_scale}, for_kernel=False)
    nibbles = unpack_e2m1(packed, dim).movedim(dim, -1).to(torch.int64)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    values = table[nibbles & 7]
    values = torch.where((nibbles & 8) != 0, -values, values)
    s_b = block_scales.view(torch.float8_e4m3fn).movedim(dim, -1).to(torch.float32)
    s_g = global_scale.movedim(dim, -1) if global_scale.dim() else global_scale
    decode = (s_b * s_g).unsqueeze(-1)
    out = (values.unflatten(-1, (-1, NVFP4_BLOCK)) * decode).flatten(-2)
    return out.movedim(-1, dim).to(dtype).contiguous()


def nvfp4_quantize_ref(x: torch.Tensor, dim: int = -1, global_scale: torch.Tensor | None = None,
                       *, per: Per = "tensor"
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-PyTorch reference of :func:`nvfp4_quantize` (any device), bit for bit the same:
    the float32 steps of the rule as torch tensor ops (divisors are tensors, so no reciprocal
    shortcut), the roundings onto E4M3 and E2M1 in float64 with ``torch.round``."""
    _check_per(per)
    dim = check_quant_input("x", x, dim, NVFP4_BLOCK)
    want = _global_shape(x.shape, dim, per)
    if global_scale is not None:
        _check_global(global_scale, want, x, per)
    xb = x.movedim(dim, -1).unflatten(-1, (-1, NVFP4_BLOCK))  # [..., blocks, 16]
    sign = sign_bits(xb)
    x32 = xb.to(torch.float32)
    finite = torch.isfinite(x32)
    mag = torch.where(finite, x32.abs(), 0.0)
    if global_scale is None:
        # a zero column added: the amax of no values is 0
        if per == "row":
            amax = F.pad(mag.flatten(-2), (0, 1)).amax(dim=-1, keepdim=True).unsqueeze(-1)
        else:
            amax = F.pad(mag.flatten(), (0, 1)).amax()
        s_g = torch.clamp(amax / torch.full_like(amax, NVFP4_AMAX_DIVISOR),
                          min=NVFP4_MIN_GLOBAL_SCALE)
        out_global = s_g.squeeze(-1).movedim(-1, dim).contiguous() if per == "row" else s_g
    else:
        s_g = global_scale.movedim(dim, -1).unsqueeze(-1) if per == "row" else global_scale
        out_global = global_scale
    bamax = mag.amax(dim=-1, keepdim=True)
    t = bamax / torch.full_like(bamax, E2M1_MAX) / s_g
    s_b = round_minifloat_ref(t.to(torch.float64), 3, -6, E4M3_MAX).to(torch.float32)
    bad = ~finite.all(dim=-1, keepdim=True)
    use = (s_b > 0) & ~bad
    decode = torch.where(use, s_b * s_g, torch.ones_like(s_b))
    y = x32.abs() / decode
    v = round_minifloat_ref(torch.where(use & finite, y, 0.0).to(torch.float64), 1, 0, E2M1_MAX)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=x.device)
    code = torch.searchsorted(table, v.contiguous()).to(torch.int32)
    nibble = torch.where(use, code | (sign << 3), 0).flatten(-2)
    packed = (nibble[..., 0::2] | (nibble[..., 1::2] << 4)).to(torch.uint8)
    sb_bytes = s_b.to(torch.float8_e4m3fn).view(torch.uint8)
    sb_bytes = torch.where(bad, torch.full_like(sb_bytes, E4M3_NAN), sb_bytes).squeeze(-1)
    return (packed.movedim(-1, dim).contiguous(),
            sb_bytes.view(torch.float8_e4m3fn).movedim(-1, dim).contiguous(), out_global)
