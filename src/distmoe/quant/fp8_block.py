"""Block FP8 (DeepSeek-V3's released FP8 recipe) and MXFP8 rebased onto 128-wide K groups.

**Block FP8** (``precision="fp8_block"``): E4M3 values with float32 scales, one per 1 x 128
activation block (along K) and one per 128 x 128 weight block. Dequantised value =
``q * s`` (a checkpoint's ``weight_scale_inv`` is such an ``s``). For each block::

    amax = max |x| over the block's finite values          (0 if none)
    s    = amax / 448 in float32 (correctly rounded), or 1.0 when that is 0 (amax 0, or
           below 448 * 2^-150, where the quotient underflows; the block's values then
           quantise to zero, an error below 2^-140)
    q    = x / s (float32 division) rounded to nearest, ties to even, onto E4M3,
           clamped at +-448 (x / s can exceed 448 by an ulp after the two roundings)

NaN and +-Inf inputs are ignored by the amax and stored as E4M3 NaN (``0x7F`` with the
input's sign). A finite ``x`` comes back within half an E4M3 step at ``x / s``'s binade (or
2^-10 s below E4M3's normal range), plus the scale's own rounding (relative 2^-24).

**Rebasing MXFP8 onto 128-wide K groups** (:func:`mxfp8_rebase`): Hopper's FP8 MMA applies
no scale, so with a scale every 32 values of K the kernel must promote its partial sum after
every 32-deep MMA. Rebasing makes one scale cover 128 values: each group of four 32-blocks
takes the largest of their four E8M0 exponents ``e_max``, and each value of a block with
exponent ``e`` is shifted down by ``d = e_max - e`` binades inside E4M3::

    q' = q * 2^-d   rounded to nearest even onto E4M3;   scale' = e_max

Exact unless ``q * 2^-d`` leaves E4M3's normal range and has bits below the subnormal step
2^-9: then it is rounded, an error of at most ``2^-10 * 2^(e_max - 127)`` in the
dequantised value (half a subnormal step at the group's scale), relative to the group's
largest magnitude (at least ``224 * 2^(e_max - 127)`` under the ceil rule of
:mod:`distmoe.quant.mxfp8`) below ``2^-17.8``. :func:`mxfp8_rebase` counts the values it
changed. A NaN scale byte (255) stays NaN for its whole group.

Activations are quantised by a Triton kernel (:func:`fp8_block_quantize`,
:func:`fp8_block_quantize_2d` into the caller's buffers; one program per rows x groups tile,
correctly rounded divisions, the E4M3 rounding in integer arithmetic as the MXFP8 quantiser's)
with a plain-PyTorch reference (:func:`fp8_block_quantize_ref`) of the same bits. Weights are
quantised and MXFP8 operands rebased in plain PyTorch (any device; no host synchronisation):
once per weight version, outside any timed call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from distmoe.kernels.base.checks import check_devices, check_tensor
from distmoe.kernels.base.device import device_context
from distmoe.quant.formats import (
    E4M3_MAX,
    QuantLaunchConfig,
    check_launch_config,
    finite_abs_bits,
    float32_bits,
    round_e4m3_unscaled,
    tile_grid,
    tile_ids,
)

#: values per block-FP8 scale along K, and weight rows per scale
FP8_BLOCK = 128


def _blocks(name: str, size: int, what: str) -> int:
    if size % FP8_BLOCK or size == 0:
        raise ValueError(f"{name} ({size}) must be a positive multiple of {FP8_BLOCK} ({what})")
    return size // FP8_BLOCK


def _check_float(name: str, x: object, ndim_min: int) -> None:
    check_tensor(name, x, dtypes=(torch.bfloat16, torch.float16, torch.float32))
    if x.dim() < ndim_min:
        raise ValueError(f"{name} must have at least {ndim_min} dimensions, got shape "
                         f"{list(x.shape)}")


def _quantize_blocks(xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``xb [..., n_blocks, block]`` float -> (E4M3 ``[..., n_blocks, block]``, float32 scales
    ``[..., n_blocks]``) by the module's rule."""
    x = xb.float()
    finite = torch.isfinite(x)
    amax = torch.where(finite, x.abs(), 0.0).amax(-1)
    # correctly rounded on every device: CUDA's tensor / scalar multiplies by the reciprocal
    # (one ulp off at times); a float64 quotient rounded to float32 is the float32 quotient
    s = (amax.double() / E4M3_MAX).float()
    s = torch.where(s > 0, s, 1.0)  # amax 0, or below 448 * 2^-150 (the quotient underflows)
    y = (x / s[..., None]).clamp(-E4M3_MAX, E4M3_MAX)
    y = torch.where(finite, y, torch.copysign(torch.full_like(y, float("nan")), x))
    return y.to(torch.float8_e4m3fn), s


@triton.jit
def fp8_block_encode(bits):
    """E4M3 bytes and float32 scales of float32 ``bits [..., G, 128]`` (int32, one 128-value
    block per last axis): the rule of the module docstring, NaN and Inf stored as NaN with
    their sign. The quantiser's own arithmetic, for kernels that quantise what they
    compute."""
    abs_bits = bits & 0x7FFFFFFF
    amax_bits = tl.max(finite_abs_bits(bits), axis=2)
    amax = amax_bits.to(tl.float32, bitcast=True)
    s = tl.math.div_rn(amax, 448.0)
    s = tl.where(s > 0, s, 1.0)  # amax 0, or so small that the quotient underflows
    y = tl.math.div_rn(bits.to(tl.float32, bitcast=True), s[:, :, None])
    code = round_e4m3_unscaled(y.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    code = tl.where(abs_bits < 0x7F800000, code, 0x7F)  # NaN, Inf -> NaN
    return (code | ((bits >> 24) & 0x80)).to(tl.uint8), s


@triton.jit
def _fp8_block_quantize_kernel(x_ptr, q_ptr, s_ptr, rows, num_groups,
                               BLOCK_R: tl.constexpr, GROUPS: tl.constexpr):
    pid_r, pid_g = tile_ids(tl.cdiv(num_groups, GROUPS))
    r = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = pid_g * GROUPS + tl.arange(0, GROUPS)
    j = tl.arange(0, 128)
    cols = num_groups * 128  # r is int64: offsets are int64
    ok2 = (r[:, None] < rows) & (g[None, :] < num_groups)
    offs = r[:, None, None] * cols + (g[None, :, None] * 128 + j[None, None, :])
    ok3 = ok2[:, :, None]
    q, s = fp8_block_encode(float32_bits(tl.load(x_ptr + offs, mask=ok3, other=0.0)))
    tl.store(q_ptr + offs, q, mask=ok3)
    tl.store(s_ptr + r[:, None] * num_groups + g[None, :], s, mask=ok2)


def fp8_block_quantize_2d(x: torch.Tensor, qdata: torch.Tensor, scales: torch.Tensor, *,
                          config: QuantLaunchConfig | None = None) -> None:
    """Launcher: quantise contiguous ``x [rows, cols]`` (bf16 / fp16 / fp32, cols a multiple
    of 128) along its last axis into the caller's ``qdata`` (float8_e4m3fn ``[rows, cols]``,
    or its uint8 view) and ``scales`` (float32 ``[rows, cols / 128]``), all contiguous on one
    device (CUDA, or the CPU under the interpreter); ``config.block_rows`` rows per program,
    one 128-value block each (``config.block_groups`` is not used). No host
    synchronisation."""
    config = check_launch_config(config)
    _check_float("x", x, 2)
    check_tensor("x", x, dtypes=(x.dtype,), ndim=2, shape_text="[rows, cols]")
    rows, cols = x.shape
    groups = _blocks("cols", cols, "x.shape[1]: one float32 scale per 128 values")
    check_tensor("qdata", qdata, dtypes=(torch.float8_e4m3fn, torch.uint8), shape=[rows, cols],
                 shape_text="(x's shape)")
    check_tensor("scales", scales, dtypes=(torch.float32,), shape=[rows, groups],
                 shape_text="[rows, cols / 128]")
    check_devices({"x": x, "qdata": qdata, "scales": scales})
    if x.numel() == 0:
        return
    # one 128-value group per program (sm_90 build: two groups of 32 rows spill registers)
    block_groups = 1
    grid = tile_grid(triton.cdiv(rows, config.block_rows), triton.cdiv(groups, block_groups))
    with device_context(x.device):
        _fp8_block_quantize_kernel[grid](x, qdata.view(torch.uint8), scales, rows, groups,
                                         BLOCK_R=config.block_rows, GROUPS=block_groups,
                                         num_warps=config.num_warps)


def fp8_block_quantize(x: torch.Tensor, *, config: QuantLaunchConfig | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations ``x [..., K]`` (bf16 / fp16 / fp32 on a CUDA device, or the CPU under the
    interpreter; K a multiple of 128) -> ``(qdata float8_e4m3fn [..., K], scales float32
    [..., K/128])``: one scale per 1 x 128 block along the last axis (module docstring;
    Triton kernel, the bits of :func:`fp8_block_quantize_ref`)."""
    _check_float("x", x, 1)
    k = x.shape[-1]
    nb = _blocks("K", k, "x.shape[-1]: one float32 scale per 128 values")
    flat = x.contiguous().view(-1, k)
    qdata = torch.empty(flat.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(flat.shape[0], nb, dtype=torch.float32, device=x.device)
    fp8_block_quantize_2d(flat, qdata, scales, config=config)
    return qdata.view(x.shape), scales.view(*x.shape[:-1], nb)


def fp8_block_quantize_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch :func:`fp8_block_quantize` (any device): the same bits."""
    _check_float("x", x, 1)
    nb = _blocks("K", x.shape[-1], "x.shape[-1]: one float32 scale per 128 values")
    q, s = _quantize_blocks(x.unflatten(-1, (nb, FP8_BLOCK)))
    return q.flatten(-2), s


def fp8_block_quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights ``w [..., N, K]`` (N and K multiples of 128) -> ``(qdata float8_e4m3fn
    [..., N, K], scales float32 [..., N/128, K/128])``: one scale per 128 x 128 block (the
    layout of DeepSeek-V3's FP8 checkpoints' ``weight_scale_inv``)."""
    _check_float("w", w, 2)
    nb = _blocks("N", w.shape[-2], "w.shape[-2]: 128 x 128 weight blocks")
    kb = _blocks("K", w.shape[-1], "w.shape[-1]: 128 x 128 weight blocks")
    if w.dim() > 2 and w.shape[0] > 1:
        # one leading slice (an expert's matrix) at a time: the float32 temporaries of
        # _quantize_blocks are several times the FP8 result's size, and a training context
        # quantises after every optimizer step
        parts = [fp8_block_quantize_weight(w[i]) for i in range(w.shape[0])]
        return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    blocks = w.unflatten(-1, (kb, FP8_BLOCK)).unflatten(-3, (nb, FP8_BLOCK))
    blocks = blocks.movedim(-3, -2).flatten(-2)  # [..., nb, kb, 128 * 128]
    q, s = _quantize_blocks(blocks)
    q = q.unflatten(-1, (FP8_BLOCK, FP8_BLOCK)).movedim(-2, -3).flatten(-4, -3).flatten(-2)
    return q, s


def fp8_block_dequantize(qdata: torch.Tensor, scales: torch.Tensor, *,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``qdata * scale`` in ``dtype`` (float32 or float64: exact in float64) for activations
    (``scales [..., K/128]``) or weights (``scales [..., N/128, K/128]``)."""
    check_tensor("qdata", qdata, dtypes=(torch.float8_e4m3fn,))
    check_tensor("scales", scales, dtypes=(torch.float32,))
    if qdata.dim() == 0:
        raise ValueError("qdata must have at least one dimension")
    kb = _blocks("K", qdata.shape[-1], "qdata.shape[-1]")
    rows = qdata.shape[-2] if qdata.dim() >= 2 else None
    if list(scales.shape) == list(qdata.shape[:-1]) + [kb]:
        s = scales.repeat_interleave(FP8_BLOCK, dim=-1)
    elif rows is not None and rows % FP8_BLOCK == 0 and list(scales.shape) == (
            list(qdata.shape[:-2]) + [rows // FP8_BLOCK, kb]):
        s = scales.repeat_interleave(FP8_BLOCK, dim=-1).repeat_interleave(FP8_BLOCK, dim=-2)
    else:
        raise ValueError(f"scales must have shape {list(qdata.shape[:-1]) + [kb]} (1 x 128 "
                         f"blocks) or [..., N/128, K/128] (128 x 128 blocks) for qdata of "
                         f"shape {list(qdata.shape)}, got {list(scales.shape)}")
    return (qdata.to(dtype) * s.to(dtype))


def mxfp8_rebase(qdata: torch.Tensor, scales: torch.Tensor, *, group: int = 128
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MXFP8 operands with one E8M0 scale per ``group`` values along K (module docstring).

    Args:
        qdata: float8_e4m3fn ``[..., rows, K]``, K a multiple of ``group``.
        scales: uint8 E8M0 ``[..., rows / b, K/32]`` with ``b`` = 1 (activations,
            ``mxfp8_quantize(x, dim=-1)``) or 32 (a weight's 32 x 32 block scales,
            ``MXFP8Weight.scales``).
        group: values per new scale along K: 64 or 128.

    Returns ``(qdata' [..., rows, K], scales' uint8 [..., rows / b, K/group], changed)``:
    ``changed`` an int64 0-d device tensor, the number of values whose dequantised value the
    rebasing changed (rounded below E4M3's subnormal step at the group's scale)."""
    if isinstance(group, bool) or group not in (64, 128):
        raise ValueError(f"group ({group!r}) must be 64 or 128 (values per new scale)")
    check_tensor("qdata", qdata, dtypes=(torch.float8_e4m3fn,))
    check_tensor("scales", scales, dtypes=(torch.uint8,))
    if qdata.dim() < 2 or scales.dim() != qdata.dim():
        raise ValueError(f"qdata must be [..., rows, K] and scales [..., rows/b, K/32] of the "
                         f"same rank, got {list(qdata.shape)} and {list(scales.shape)}")
    rows, k = qdata.shape[-2:]
    if k % group or k == 0:
        raise ValueError(f"K ({k}, qdata.shape[-1]) must be a positive multiple of group "
                         f"({group})")
    srows = scales.shape[-2]
    b = rows // srows if srows else 0
    if (b not in (1, 32) or b * srows != rows
            or list(scales.shape) != list(qdata.shape[:-2]) + [srows, k // 32]):
        raise ValueError(f"scales must have shape [..., rows, K/32] or [..., rows/32, K/32] "
                         f"for qdata of shape {list(qdata.shape)}, got {list(scales.shape)}")
    if qdata.dim() > 2 and qdata.shape[0] > 1:
        # one leading slice at a time (an expert's matrix): the float temporaries below are
        # 4-8 bytes a value, so a whole layer's weights at once would need several times
        # their FP8 size
        parts = [mxfp8_rebase(qdata[i], scales[i], group=group) for i in range(qdata.shape[0])]
        return (torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]),
                sum(p[2] for p in parts))
    per = group // 32
    s = scales.to(torch.int32).unflatten(-1, (k // group, per))  # [..., srows, G, per]
    smax = s.amax(-1)
    shift = (smax[..., None] - s).flatten(-2)  # [..., srows, K/32]
    shift = shift.repeat_interleave(32, dim=-1).repeat_interleave(b, dim=-2)
    v = qdata.float()
    # 2^-shift as float32 bits (exact; 0 below 2^-149, where the E4M3 result is 0 anyway)
    factor = torch.where(shift <= 126, (127 - shift).clamp(min=1) << 23, 0).view(torch.float32)
    shifted = v * factor
    q2 = shifted.to(torch.float8_e4m3fn)  # round to nearest even (NaN stays NaN)
    back = q2.double() * torch.exp2(shift.double())  # the rebased value at the old scale
    changed = (torch.isfinite(v) & (back != v.double())).sum()
    return q2, smax.to(torch.uint8), changed
