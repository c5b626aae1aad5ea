"""MXFP8 quantisation along one axis: E4M3 values with one E8M0 scale per 32 values.

For every block of 32 consecutive values along ``dim`` (docs/numerics.md has the derivations):

    amax = max |x| over the block's finite values                 (0 if none)
    e    = smallest integer in [-127, 127] with amax <= 448 * 2^e  (the ceil rule)
    scale byte = e + 127                                           (E8M0, in [0, 247])
    q    = x * 2^-e rounded to nearest, ties to even, onto E4M3    (|x * 2^-e| <= 448)

The ceil rule, ``e = ceil(log2(amax / 448))``, is used rather than OCP MX's
``floor(log2(amax)) - 8``: OCP's puts ``amax * 2^-e`` in [256, 512), so a block's largest
values can exceed 448 and are clipped (up to 12.5 % of amax); the ceil rule never clips a
finite value, so every element's error is its rounding error alone (the bound below), at the
cost of one binade of range for blocks whose amax's significand is above 1.75.

* Saturation: values are clamped at +-448 (unreachable for finite inputs under this rule).
* Subnormals: E4M3 subnormals (multiples of 2^-9 below 2^-6) are produced, rounded to nearest
  even like normals; at or below 2^-10 a value becomes a signed zero. Zeros keep their sign
  (``-0.0`` is ``0x80``).
* All-zero block: e = -127 (byte 0), zeros stored.
* NaN and +-Inf: ignored by the amax (the block's finite values keep their scale) and stored
  as E4M3 NaN with the input's sign (``0x7F`` / ``0xFF``); E4M3 has no infinity.
* Bound: every finite ``x`` comes back (:func:`mxfp8_dequantize`, exact in float32) within
  ``2^(max(floor(log2|x|), e - 6) - 4)``: half an E4M3 step at ``x``'s binade.

Kernel: one program per ``block_rows`` rows by ``block_groups`` blocks of a 2-D
``[rows, cols]`` view (cols along ``dim``); it loads its tile as ``[rows, groups, 32]``,
reduces the amax over the last axis and rounds in integer arithmetic
(:func:`~distmoe.quant.formats.round_minifloat`). Reads each input byte once, writes one
byte per value plus one per 32 values; no host synchronisation. ``dim`` other than the last
costs a ``movedim(...).contiguous()`` copy in and one out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from distmoe.kernels.base.checks import check_devices, check_tensor
from distmoe.kernels.base.device import device_context
from distmoe.quant.formats import (
    E4M3_MAX,
    E4M3_NAN,
    E8M0_BIAS,
    MXFP8_BLOCK,
    QUANT_INPUT_DTYPES,
    QuantLaunchConfig,
    check_block_dim,
    check_launch_config,
    check_quant_input,
    e4m3_code_to_float,
    e8m0_exponent,
    e8m0_exponent_ref,
    finite_abs_bits,
    float32_bits,
    pow2_ref,
    round_e4m3,
    round_minifloat_ref,
    sign_bits,
    tile_grid,
    tile_ids,
)


@triton.jit
def mxfp8_encode(bits):
    """E4M3 bytes and E8M0 exponents (unbiased) of float32 ``bits [..., G, 32]`` (int32, one
    32-value block per last axis): the rule of the module docstring, NaN and Inf stored as
    NaN with their sign. The quantiser's own arithmetic, for kernels that quantise what they
    compute."""
    abs_bits = bits & 0x7FFFFFFF
    e = e8m0_exponent(tl.max(finite_abs_bits(bits), axis=2))
    code = round_e4m3(abs_bits, e[:, :, None])
    code = tl.where(abs_bits < 0x7F800000, code, 0x7F)
    return (code | ((bits >> 24) & 0x80)).to(tl.uint8), e


@triton.jit
def mxfp8_rebase_codes(bits, q, e, ROWS: tl.constexpr, GROUPS: tl.constexpr):
    """:func:`mxfp8_encode`'s ``(q [ROWS, GROUPS, 32], e [ROWS, GROUPS])`` of ``bits`` rebased
    onto the largest exponent of each 4 blocks (128 values): the value code * 2^e rounded
    again at 2^e_max (:func:`distmoe.quant.mxfp8_rebase`'s rule, the same bits as
    ``mxfp8_rebase(mxfp8_quantize(x))``). Returns ``(q', e_max [ROWS, GROUPS])`` (each
    block's exponent now its group's)."""
    e_max = tl.max(tl.reshape(e, (ROWS, GROUPS // 4, 4)), axis=2)
    e_max = tl.reshape(tl.broadcast_to(e_max[:, :, None], (ROWS, GROUPS // 4, 4)),
                       (ROWS, GROUPS))
    v_bits = e4m3_code_to_float(q.to(tl.int32) & 0x7F).to(tl.int32, bitcast=True)
    code = round_e4m3(v_bits, (e_max - e)[:, :, None])
    code = tl.where((bits & 0x7FFFFFFF) < 0x7F800000, code, 0x7F)  # NaN, Inf -> NaN
    return (code | ((bits >> 24) & 0x80)).to(tl.uint8), e_max


@triton.jit
def _mxfp8_quantize_kernel(x_ptr, q_ptr, s_ptr, rows, num_groups,
                           BLOCK_R: tl.constexpr, GROUPS: tl.constexpr,
                           REBASE: tl.constexpr = False):
    pid_r, pid_g = tile_ids(tl.cdiv(num_groups, GROUPS))
    r = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = pid_g * GROUPS + tl.arange(0, GROUPS)
    j = tl.arange(0, 32)
    cols = num_groups * 32  # r is int64: offsets are int64
    ok2 = (r[:, None] < rows) & (g[None, :] < num_groups)
    offs = r[:, None, None] * cols + (g[None, :, None] * 32 + j[None, None, :])
    ok3 = ok2[:, :, None]
    bits = float32_bits(tl.load(x_ptr + offs, mask=ok3, other=0.0))
    q, e = mxfp8_encode(bits)
    if REBASE:
        q, e = mxfp8_rebase_codes(bits, q, e, BLOCK_R, GROUPS)
    tl.store(q_ptr + offs, q, mask=ok3)
    if REBASE:
        g4 = pid_g * (GROUPS // 4) + tl.arange(0, GROUPS // 4)
        e4 = tl.max(tl.reshape(e, (BLOCK_R, GROUPS // 4, 4)), axis=2)
        ok4 = (r[:, None] < rows) & (g4[None, :] < num_groups // 4)
        tl.store(s_ptr + r[:, None] * (num_groups // 4) + g4[None, :], (e4 + 127).to(tl.uint8),
                 mask=ok4)
    else:
        tl.store(s_ptr + r[:, None] * num_groups + g[None, :], (e + 127).to(tl.uint8),
                 mask=ok2)


def mxfp8_quantize_rebased_2d(x: torch.Tensor, qdata: torch.Tensor, scales: torch.Tensor, *,
                              config: QuantLaunchConfig | None = None) -> None:
    """:func:`mxfp8_quantize_2d` then :func:`~distmoe.quant.mxfp8_rebase` (128-wide groups)
    in one kernel, the same bits: ``x [rows, cols]`` (cols a multiple of 128) into ``qdata``
    (float8_e4m3fn or uint8 ``[rows, cols]``) and ``scales`` (uint8 ``[rows, cols / 128]``),
    for :func:`~distmoe.kernels.scaled.mxfp8_grouped_mm` with ``k_group=128``."""
    config = check_launch_config(config)
    check_tensor("x", x, dtypes=QUANT_INPUT_DTYPES, ndim=2, shape_text="[rows, cols]")
    rows, cols = x.shape
    if cols % 128 or cols == 0:
        raise ValueError(f"cols ({cols}, x.shape[1]) must be a positive multiple of 128 (four "
                         "32-value blocks per rebased scale)")
    check_tensor("qdata", qdata, dtypes=(torch.float8_e4m3fn, torch.uint8), shape=[rows, cols],
                 shape_text="(x's shape)")
    check_tensor("scales", scales, dtypes=(torch.uint8,), shape=[rows, cols // 128],
                 shape_text="[rows, cols / 128]")
    check_devices({"x": x, "qdata": qdata, "scales": scales})
    if x.numel() == 0:
        return
    num_groups = cols // MXFP8_BLOCK
    block_groups = max(4, config.block_groups)  # whole 128-value groups per program
    grid = tile_grid(triton.cdiv(rows, config.block_rows), triton.cdiv(num_groups, block_groups))
    with device_context(x.device):
        _mxfp8_quantize_kernel[grid](x, qdata.view(torch.uint8), scales, rows, num_groups,
                                     BLOCK_R=config.block_rows, GROUPS=block_groups,
                                     REBASE=True, num_warps=config.num_warps)


def mxfp8_quantize_2d(x: torch.Tensor, qdata: torch.Tensor, scales: torch.Tensor, *,
                      config: QuantLaunchConfig | None = None) -> None:
    """Launcher: quantise contiguous ``x [rows, cols]`` along its last axis into the caller's
    ``qdata`` (float8_e4m3fn ``[rows, cols]``, or its uint8 view) and ``scales`` (uint8
    ``[rows, cols / 32]``), all contiguous on one device (CUDA, or CPU in the interpreter)."""
    config = check_launch_config(config)
    check_quant_input("x", x, -1, MXFP8_BLOCK)
    check_tensor("x", x, dtypes=(x.dtype,), ndim=2, shape_text="[rows, cols]")
    rows, cols = x.shape
    check_tensor("qdata", qdata, dtypes=(torch.float8_e4m3fn, torch.uint8), shape=[rows, cols],
                 shape_text="(x's shape)")
    check_tensor("scales", scales, dtypes=(torch.uint8,), shape=[rows, cols // MXFP8_BLOCK],
                 shape_text="[rows, cols / 32]")
    check_devices({"x": x, "qdata": qdata, "scales": scales})
    if x.numel() == 0:
        return
    num_groups = cols // MXFP8_BLOCK
    grid = tile_grid(triton.cdiv(rows, config.block_rows),
                     triton.cdiv(num_groups, config.block_groups))
    with device_context(x.device):
        _mxfp8_quantize_kernel[grid](x, qdata.view(torch.uint8), scales, rows, num_groups,
                                     BLOCK_R=config.block_rows, GROUPS=config.block_groups,
                                     num_warps=config.num_warps)


def _scales_shape(shape: torch.Size, dim: int, block: int) -> list[int]:
    out = list(shape)
    out[dim] //= block
    return out


def mxfp8_quantize(x: torch.Tensor, dim: int = -1, *,
                   config: QuantLaunchConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8-quantise ``x`` in blocks of 32 consecutive values along ``dim`` (Triton kernel).

    Args:
        x: bf16, fp16 or fp32 tensor on a CUDA device (or the CPU under the interpreter);
            ``x.shape[dim]`` a multiple of 32.
        dim: the quantised axis.
        config: kernel tile (:class:`~distmoe.quant.formats.QuantLaunchConfig`).

    Returns:
        ``(qdata, scales)``: ``qdata`` float8_e4m3fn of ``x``'s shape; ``scales`` uint8 E8M0
        exponents (bias 127) of ``x``'s shape with ``shape[dim] / 32``, both contiguous.
        The rule is the module docstring's; :func:`mxfp8_quantize_ref` is the reference.
    """
    dim = check_quant_input("x", x, dim, MXFP8_BLOCK)
    moved = x.movedim(dim, -1).contiguous()
    cols = moved.shape[-1]
    qdata = torch.empty(moved.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(_scales_shape(moved.shape, -1, MXFP8_BLOCK), dtype=torch.uint8,
                         device=x.device)
    mxfp8_quantize_2d(moved.view(-1, cols), qdata.view(-1, cols),
                      scales.view(-1, cols // MXFP8_BLOCK), config=config)
    return qdata.movedim(-1, dim).contiguous(), scales.movedim(-1, dim).contiguous()


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """Float32 ``2^(b - 127)`` of E8M0 bytes ``b`` (exact; byte 0 is the subnormal 2^-127,
    ``0xFF`` is NaN)."""
    b = scales.to(torch.int32)
    bits = torch.where(b == 0, 0x00400000, b << 23)  # 2^-127 has no exponent field
    bits = torch.where(b == 255, 0x7FC00000, bits)
    return bits.view(torch.float32)


def mxfp8_dequantize(qdata: torch.Tensor, scales: torch.Tensor, dim: int = -1, *,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``qdata * 2^(scales - 127)``, each scale over its 32 values along ``dim``, as ``dtype``.

    Plain PyTorch on any device (element-wise; no kernel of its own). The float32 product is
    exact (an E4M3 value times a power of two from 2^-127 to 2^127 lands on float32's grid,
    subnormals included, or overflows to infinity); another ``dtype`` rounds that float32 to
    nearest even. A scale byte 0xFF gives NaN.

    Args:
        qdata: float8_e4m3fn (or its uint8 view), ``shape[dim]`` a multiple of 32.
        scales: uint8, ``qdata``'s shape with ``shape[dim] / 32``.
        dim: the axis the scales run along.
        dtype: float32, bfloat16 or float16.
    """
    if not isinstance(qdata, torch.Tensor) or qdata.dtype not in (torch.float8_e4m3fn,
                                                                   torch.uint8):
        got = qdata.dtype if isinstance(qdata, torch.Tensor) else type(qdata).__name__
        raise TypeError(f"qdata must be a float8_e4m3fn (or uint8) tensor, got {got}")
    dim = check_block_dim("qdata", qdata, dim, MXFP8_BLOCK)
    want = _scales_shape(qdata.shape, dim, MXFP8_BLOCK)
    check_tensor("scales", scales, dtypes=(torch.uint8,), shape=want,
                 shape_text="(qdata's shape with shape[dim] / 32)", contiguous=False)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    check_devices({"qdata": qdata, "scales": scales}, for_kernel=False)
    q = qdata.view(torch.float8_e4m3fn).movedim(dim, -1)
    s = e8m0_to_float(scales.movedim(dim, -1))
    out = q.to(torch.float32).unflatten(-1, (-1, MXFP8_BLOCK)) * s.unsqueeze(-1)
    return out.flatten(-2).movedim(-1, dim).to(dtype).contiguous()


def mxfp8_quantize_ref(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch reference of :func:`mxfp8_quantize` (any device): the same outputs, bit
    for bit, computed in float64 (the scale by :func:`~distmoe.quant.formats.e8m0_exponent_ref`,
    the rounding by ``torch.round`` on the E4M3 grid)."""
    dim = check_quant_input("x", x, dim, MXFP8_BLOCK)
    xb = x.movedim(dim, -1).unflatten(-1, (-1, MXFP8_BLOCK))
    sign = sign_bits(xb)
    wide = xb.to(torch.float64)
    finite = torch.isfinite(wide)
    amax = torch.where(finite, wide.abs(), 0.0).amax(dim=-1)
    e = e8m0_exponent_ref(amax)
    qdata = encode_e4m3_ref(wide * pow2_ref(-e.unsqueeze(-1)), finite, sign)
    scales = (e + E8M0_BIAS).to(torch.uint8)
    return (qdata.flatten(-2).movedim(-1, dim).contiguous(),
            scales.movedim(-1, dim).contiguous())


def encode_e4m3_ref(y: torch.Tensor, finite: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    """E4M3 of float64 ``y`` (rounded to nearest even, saturated at 448) where ``finite``, NaN
    with ``sign`` elsewhere, as float8_e4m3fn. The rounded value is on E4M3's grid, so torch's
    cast of it is exact."""
    rounded = round_minifloat_ref(torch.where(finite, y, 0.0), 3, -6, E4M3_MAX)
    codes = rounded.to(torch.float32).to(torch.float8_e4m3fn).view(torch.uint8)
    nan = (E4M3_NAN | (sign << 7)).to(torch.uint8)
    return torch.where(finite, codes, nan).view(torch.float8_e4m3fn)
