"""``grouped_mm``: torch._grouped_mm's 2-D x 3-D grouped GEMM (bf16) with autograd, its
forward and input gradient written into caller buffers.

Legend: M rows of ``a``, K its width, N the output width, E groups (experts).

    a [M, K] bf16, rows grouped by expert     b [E, K, N] bf16     offs int32 [E]
    group e owns rows offs[e-1] .. offs[e]-1  (offs[-1] taken as 0), offs[E-1] <= M

    out[r]      = bf16(a[r] @ b[e])            r in group e (fp32 accumulation, one rounding)
    out[r]      = 0                            r >= offs[E-1] (rows of no group)
    grad_a[r]   = bf16(grad_out[r] @ b[e]^T)   0 for rows of no group
    grad_b[e]   = bf16(a_e^T @ grad_out_e)     0 for an empty group

torch._grouped_mm (torch 2.13, on the CPU as on CUDA) leaves the rows of no group of its
result, and of ``a``'s gradient, uninitialised (``torch.empty``: whatever the allocator
held); here they are zeros, in ``out`` and ``input_grad_out`` too. Elsewhere the results are
torch's up to fp32 summation order (on the CPU torch also accumulates in fp32 and rounds
once).

``offs`` stays on the device and is never read on the host: it must be non-decreasing with
``offs[E-1] <= M`` (not checked). Values outside that contract never touch memory out of
bounds: the offsets are clamped to ``[0, M]`` and made non-decreasing (a running maximum) on
the device, so a decreasing entry makes its group empty.

Kernels: forward and DGRAD are :func:`distmoe.kernels.grouped.grouped_gemm` (grid from the
shapes: ``cdiv(M, block_m) + E - 1`` row tiles), the weight gradient is the layer's grouped
WGRAD (:func:`distmoe.kernels.wgrad.launch_grouped_wgrad`, overwrite mode: zeros for an empty
group). ``b`` may be contiguous or the transpose of a contiguous ``[E, N, K]`` (weights
stored ``[E, N, K]`` and passed as ``w.transpose(-2, -1)``, as torch._grouped_mm accepts);
its gradient then has the same layout.

Memory: the forward saves ``a``, ``b`` (references, no copies) and the ``[E + 1]`` offsets;
the backward allocates ``grad_b`` and, without ``input_grad_out``, ``grad_a``.

Sync points: none (the offsets are normalised by device ops; grids come from shapes).
"""

from __future__ import annotations

import torch

from distmoe.kernels.base.checks import (
    check_devices,
    check_disjoint,
    check_tensor,
    check_tma_aligned,
    check_width,
)
from distmoe.kernels.grouped import GroupedConfig, grouped_gemm
from distmoe.kernels.scaled import ScaledGemmConfig
from distmoe.kernels.scaled.triton import FP8_BLOCK, MXFP8, MXFP8_REBASED
from distmoe.kernels.scaled.triton import scaled_grouped_mm as block_scaled_grouped_mm
from distmoe.kernels.wgrad import WgradConfig, launch_grouped_wgrad


def _is_transposed(b: torch.Tensor) -> bool:
    """``b`` [E, K, N] is the transpose of a contiguous [E, N, K] (and not contiguous)."""
    return not b.is_contiguous() and b.transpose(1, 2).is_contiguous()


def _row_offsets(offs: torch.Tensor, num_rows: int) -> torch.Tensor:
    """int32 ``[E + 1]``: 0, then ``offs`` clamped to ``[0, M]`` and non-decreasing (device
    ops, no host read)."""
    ends = offs.clamp(0, num_rows).cummax(0).values.to(torch.int32)
    return torch.cat([ends.new_zeros(1), ends])


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous with a 16-byte aligned base (an upstream gradient may be neither)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _check_args(a, b, offs, out, input_grad_out, config):
    check_tensor("a", a, dtypes=(torch.bfloat16,), ndim=2, shape_text="[M, K]")
    check_tensor("b", b, dtypes=(torch.bfloat16,), ndim=3, shape_text="[E, K, N]",
                 contiguous=False)
    num_rows, width_k = a.shape
    num_groups, bk, width_n = b.shape
    if bk != width_k:
        raise ValueError(f"b must have shape [E, K, N] with K = a.shape[1] ({width_k}), got "
                         f"{list(b.shape)}")
    if not (b.is_contiguous() or _is_transposed(b)):
        raise ValueError(f"b must be contiguous or the transpose of a contiguous [E, N, K] "
                         f"(b.transpose(1, 2).is_contiguous()), got strides {list(b.stride())}")
    check_width("K (a.shape[1])", width_k)
    check_width("N (b.shape[2])", width_n)
    check_tensor("offs", offs, dtypes=(torch.int32,), shape=[num_groups],
                 shape_text="[E] (cumulative row ends, int32, on the device)")
    named = {"a": a, "b": b, "offs": offs}
    if out is not None:
        check_tensor("out", out, dtypes=(torch.bfloat16,), shape=[num_rows, width_n],
                     shape_text="[M, N]")
        if out.requires_grad:
            raise ValueError("out must not require grad (it is written in place and returned "
                             "as the differentiable result), got out.requires_grad=True")
        named["out"] = out
    if input_grad_out is not None:
        check_tensor("input_grad_out", input_grad_out, dtypes=(torch.bfloat16,),
                     shape=[num_rows, width_k], shape_text="[M, K] (a's gradient)")
        if input_grad_out.requires_grad:
            raise ValueError("input_grad_out must not require grad (the backward writes a's "
                             "gradient into it), got input_grad_out.requires_grad=True")
        named["input_grad_out"] = input_grad_out
    if config is not None and not isinstance(config, GroupedConfig):
        raise TypeError(f"config must be a GroupedConfig or None, got {type(config).__name__}")
    check_devices(named)
    check_tma_aligned("a", a)
    check_tma_aligned("b", b)
    check_disjoint(named)


class GroupedMMFunction(torch.autograd.Function):
    """Autograd node of :func:`grouped_mm`: forward grouped GEMM into ``out`` (returned itself,
    marked dirty); backward DGRAD into ``input_grad_out`` (or a new tensor) and WGRAD."""

    @staticmethod
    def forward(ctx, out, a, b, offs, input_grad_out, config):
        row_offsets = _row_offsets(offs, a.shape[0])
        transposed = _is_transposed(b)
        w = b.transpose(1, 2) if transposed else b  # contiguous storage
        cfg = config or GroupedConfig.for_shape(rows=a.shape[0], groups=b.shape[0],
                                                out_cols=b.shape[2], reduction=a.shape[1])
        grouped_gemm(a, w, row_offsets, out, cfg, trans_w=transposed)
        ctx.mark_dirty(out)
        ctx.save_for_backward(a, b, row_offsets)
        ctx.transposed, ctx.config, ctx.input_grad_out = transposed, config, input_grad_out
        return out

    @staticmethod
    def backward(ctx, grad_out):
        a, b, row_offsets = ctx.saved_tensors
        grad_out = _aligned(grad_out.to(torch.bfloat16))
        num_rows, width_k = a.shape
        num_groups, _, width_n = b.shape
        transposed = ctx.transposed
        w = b.transpose(1, 2) if transposed else b
        grad_a = grad_b = None
        if ctx.needs_input_grad[1]:
            grad_a = ctx.input_grad_out
            if grad_a is None:
                grad_a = torch.empty_like(a)
            cfg = ctx.config or GroupedConfig.for_shape(rows=num_rows, groups=num_groups,
                                                        out_cols=width_k, reduction=width_n)
            # grad_a = grad_out @ b_e^T: the same storage with the other orientation
            grouped_gemm(grad_out, w, row_offsets, grad_a, cfg, trans_w=not transposed)
        if ctx.needs_input_grad[2]:
            # WGRAD in b's storage layout: [E, K, N] = a^T @ g, or [E, N, K] = g^T @ a
            lhs, rhs = (grad_out, a) if transposed else (a, grad_out)
            grad_w = torch.empty_like(w)
            wcfg = WgradConfig.for_widths(out_rows=grad_w.shape[1], out_cols=grad_w.shape[2])
            launch_grouped_wgrad(lhs, rhs, row_offsets, grad_w, wcfg, a.device,
                                 accumulate=False)
            grad_b = grad_w.transpose(1, 2) if transposed else grad_w
        return None, grad_a, grad_b, None, None, None


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
               out: torch.Tensor | None = None, input_grad_out: torch.Tensor | None = None,
               *, config: GroupedConfig | None = None) -> torch.Tensor:
    """Grouped GEMM with torch._grouped_mm's shapes and offsets (2-D ``a``, 3-D ``b``), bf16,
    differentiable (module docstring for the full contract).

    Args:
        a: bf16 ``[M, K]`` contiguous, rows grouped by expert, 16-byte aligned.
        b: bf16 ``[E, K, N]``, contiguous or the transpose of a contiguous ``[E, N, K]``;
            K and N positive multiples of 8 (torch's 16-byte stride rule).
        offs: int32 ``[E]`` on ``a``'s device: cumulative row ends (group ``e`` owns rows
            ``offs[e-1] .. offs[e]-1``), non-decreasing, ``offs[-1] <= M`` (device values:
            not checked, clamped).
        out: optional bf16 ``[M, N]`` contiguous buffer the result is written into and
            returned as (it must not require grad); rows past ``offs[-1]`` get zeros.
        input_grad_out: optional bf16 ``[M, K]`` contiguous buffer that the backward writes
            ``a``'s gradient into (rows past ``offs[-1]`` zeros), which autograd then
            delivers (``a.grad`` may be this tensor itself, or a copy of it).
        config: the :class:`GroupedConfig` of the forward and DGRAD launches (each picks
            :meth:`GroupedConfig.for_shape` when None).

    Returns:
        bf16 ``[M, N]``: ``out`` itself when given. ``b``'s gradient is bf16 in ``b``'s
        layout, zeros for an empty group.

    Raises ``TypeError``/``ValueError`` naming the argument before any work.
    """
    _check_args(a, b, offs, out, input_grad_out, config)
    if out is None:
        out = torch.empty(a.shape[0], b.shape[2], dtype=torch.bfloat16, device=a.device)
    # out first: when it is a view, autograd's CopySlices passes the gradient of the dirty
    # view as the node's first input
    return GroupedMMFunction.apply(out, a, b, offs, input_grad_out, config)


def grouped_mm_ref(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch :func:`grouped_mm` in ``a``'s dtype (any float dtype, any device),
    differentiable: one matmul per group, zeros in the rows of no group. Reads ``offs`` on the
    host (it synchronises)."""
    ends = offs.detach().to("cpu", torch.int64).clamp(0, a.shape[0]).cummax(0).values.tolist()
    pieces, start = [], 0
    for e, end in enumerate(ends):
        pieces.append(a[start:end] @ b[e])
        start = end
    pieces.append(a.new_zeros(a.shape[0] - start, b.shape[2]))
    return torch.cat(pieces)


# --------------------------------------------------------------------------------------------
# Prequantised operands
# --------------------------------------------------------------------------------------------

#: operand formats of :func:`scaled_grouped_mm_q`: (values per scale along K, weight rows per
#: scale, scale dtype)
SCALED_FORMATS = {"mxfp8": (32, 32, torch.uint8), "mxfp8_rebased": (128, 32, torch.uint8),
                  "fp8_block": (128, 128, torch.float32)}


def scaled_grouped_mm_q(a_q: torch.Tensor, a_scales: torch.Tensor, b_q: torch.Tensor,
                        b_scales: torch.Tensor, offs: torch.Tensor,
                        out: torch.Tensor | None = None, *, format: str = "mxfp8",
                        swiglu: bool = False, config=None) -> torch.Tensor:
    """:func:`grouped_mm`'s shapes and offsets on prequantised FP8 operands (forward only, no
    autograd): ``out[r] = bf16(dequant(a_q[r]) @ dequant(b_q[e]))`` for row r of group e, fp32
    accumulation per scale step (the :mod:`distmoe.kernels.scaled` GEMM: exact arithmetic on
    the operands up to the fp32 summation order, docs/numerics.md); rows past ``offs[-1]``
    zeros.

    Args:
        a_q: float8_e4m3fn ``[M, K]`` contiguous, rows grouped by expert.
        a_scales: ``[M, K/g]``: uint8 E8M0 (``"mxfp8"``: g = 32, ``mxfp8_quantize``;
            ``"mxfp8_rebased"``: g = 128, ``mxfp8_rebase``) or float32 (``"fp8_block"``:
            g = 128, ``fp8_block_quantize``).
        b_q: float8_e4m3fn ``[E, K, N]``, the transpose of a contiguous ``[E, N, K]`` (the
            weights as quantised, passed as ``w_q.transpose(-2, -1)``, torch's layout for
            ``torch._scaled_grouped_mm``).
        b_scales: the weights' scales in their own ``[E, N/b, K/g]`` orientation (b = 32 for
            the MXFP8 formats, 128 for block FP8).
        offs: int32 ``[E]`` on the device: cumulative row ends (:func:`grouped_mm`'s; not
            read on the host, clamped).
        out: optional bf16 ``[M, N]`` (``[M, N/2]`` with ``swiglu``) contiguous.
        format: ``"mxfp8"``, ``"mxfp8_rebased"`` or ``"fp8_block"``.
        swiglu: ``out = silu(gate) * up`` of the two halves of N (w13's gate rows, then up).
        config: a :class:`~distmoe.kernels.scaled.ScaledGemmConfig` (its ``block_m`` is the
            padding of the row tiles; default for the widths).

    Returns ``out`` (a new tensor when not given). No host synchronisation.
    """
    if format not in SCALED_FORMATS:
        raise ValueError(f"format ({format!r}) must be one of {list(SCALED_FORMATS)}")
    layout = {"mxfp8": MXFP8, "mxfp8_rebased": MXFP8_REBASED, "fp8_block": FP8_BLOCK}[format]
    check_tensor("b_q", b_q, dtypes=(torch.float8_e4m3fn,), ndim=3, shape_text="[E, K, N]",
                 contiguous=False)
    if not _is_transposed(b_q):
        raise ValueError("b_q must be the transpose of a contiguous [E, N, K] "
                         "(w_q.transpose(-2, -1)), got strides " + str(list(b_q.stride())))
    check_tensor("a_q", a_q, dtypes=(torch.float8_e4m3fn,), ndim=2, shape_text="[M, K]")
    num_rows = a_q.shape[0]
    num_groups, _, width_n = b_q.shape
    check_tensor("offs", offs, dtypes=(torch.int32,), shape=[num_groups],
                 shape_text="[E] (cumulative row ends, int32, on the device)")
    out_n = width_n // 2 if swiglu else width_n
    if out is None:
        out = torch.empty(num_rows, out_n, dtype=torch.bfloat16, device=a_q.device)
    if config is None:
        config = ScaledGemmConfig.for_widths(k=a_q.shape[1], n=width_n, swiglu=swiglu,
                                             k_group=layout.k_group)
    row_offsets = _row_offsets(offs, num_rows)
    counts = row_offsets[1:] - row_offsets[:-1]
    block_m = config.block_m
    padded = ((counts + block_m - 1) // block_m * block_m).cumsum(0).to(torch.int32)
    padded_offsets = torch.cat([padded.new_zeros(1), padded])
    block_scaled_grouped_mm(a_q, a_scales, b_q.transpose(1, 2), b_scales, padded_offsets,
                            row_offsets, out, layout=layout, swiglu=swiglu, config=config)
    # rows of no group: zeros (the kernel writes the live rows only)
    rows = torch.arange(num_rows, device=out.device)[:, None]
    return out.masked_fill_(rows >= row_offsets[-1], 0.0)


# --------------------------------------------------------------------------------------------
# FP8 with autograd
# --------------------------------------------------------------------------------------------

#: per precision: values per scale (activation groups along K, weight blocks b x b)
_TRAIN_BLOCK = {"mxfp8": 32, "fp8_block": 128}


def quantize_rows(x: torch.Tensor, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qdata, scales)`` of bf16 rows ``x [M, K]`` along K in ``precision``'s activation
    format: MXFP8 (``"mxfp8"``, uint8 E8M0 ``[M, K/32]``) or block FP8 (``"fp8_block"``,
    float32 ``[M, K/128]``)."""
    from distmoe.quant import fp8_block_quantize, mxfp8_quantize

    return mxfp8_quantize(x, dim=-1) if precision == "mxfp8" else fp8_block_quantize(x)


def _quantize_weight(w: torch.Tensor, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    from distmoe.quant import fp8_block_quantize_weight, mxfp8_quantize_weight

    if precision == "mxfp8":
        q = mxfp8_quantize_weight(w)
        return q.qdata, q.scales
    return fp8_block_quantize_weight(w)


def scaled_weight_blocks(b: torch.Tensor, precision: str
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weight operands of one FP8 training GEMM, from bf16 ``b [E, K, N]`` (values only,
    no autograd): ``(w_q, w_s)``, ``b^T`` quantised in ``B x B`` blocks (``[E, N, K]``, the
    forward's orientation: pass ``w_q.transpose(1, 2)``), and ``(wt_q, wt_s)``, the same
    blocks transposed and contiguous (``[E, K, N]``: the input-gradient GEMM's operand)."""
    w_q, w_s = _quantize_weight(b.transpose(1, 2).detach().contiguous(), precision)
    return w_q, w_s, w_q.transpose(1, 2).contiguous(), w_s.transpose(1, 2).contiguous()


def scaled_dgrad(g_q: torch.Tensor, g_s: torch.Tensor, wt_q: torch.Tensor,
                 wt_s: torch.Tensor, offs: torch.Tensor, precision: str,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Input gradient of an FP8 training GEMM: ``bf16(Q(grad_out)[r] @ Q(b)[e]^T)`` from the
    quantised output gradient ``(g_q, g_s)`` and the transposed blocks of
    :func:`scaled_weight_blocks` (into ``out`` when given; rows of no group zeros)."""
    return scaled_grouped_mm_q(g_q, g_s, wt_q.transpose(1, 2), wt_s, offs, out,
                               format=precision)


def scaled_wgrad(grad_out: torch.Tensor, a_dq: torch.Tensor, offs: torch.Tensor,
                 b_shape: tuple[int, int, int], transposed: bool,
                 sink: torch.Tensor | None = None) -> torch.Tensor | None:
    """Weight gradient of an FP8 training GEMM from bf16 operands with fp32 accumulation:
    ``bf16(a_dq_e^T @ grad_out_e)`` per group, in ``b``'s layout (``b_shape`` = ``[E, K,
    N]``; ``transposed``: ``b`` is the transpose of a contiguous ``[E, N, K]``), zeros for an
    empty group; or added in fp32 into ``sink`` (``b``'s shape and layout), returning None."""
    num_groups, width_k, width_n = b_shape
    row_offsets = _row_offsets(offs, a_dq.shape[0])
    # WGRAD in b's storage layout: [E, N, K] = g^T @ a for a transposed b, else
    # [E, K, N] = a^T @ g
    lhs, rhs = (grad_out, a_dq) if transposed else (a_dq, grad_out)
    if sink is not None:
        out = sink.transpose(1, 2) if transposed else sink
    else:
        shape = (num_groups, width_n, width_k) if transposed else (num_groups, width_k, width_n)
        out = torch.empty(shape, dtype=torch.bfloat16, device=a_dq.device)
    wcfg = WgradConfig.for_widths(out_rows=out.shape[1], out_cols=out.shape[2])
    launch_grouped_wgrad(lhs, rhs, row_offsets, out, wcfg, a_dq.device,
                         accumulate=sink is not None)
    if sink is not None:
        return None
    return out.transpose(1, 2) if transposed else out


class ScaledGroupedMMFunction(torch.autograd.Function):
    """Autograd node of :func:`scaled_grouped_mm`: FP8 forward and DGRAD, bf16 WGRAD."""

    @staticmethod
    def forward(ctx, a, b, offs, precision, wgrad_sink):
        from distmoe.quant.prepare import dequantize_rows

        w_q, w_s, wt_q, wt_s = scaled_weight_blocks(b, precision)
        a_q, a_s = quantize_rows(a.detach(), precision)
        out = scaled_grouped_mm_q(a_q, a_s, w_q.transpose(1, 2), w_s, offs, format=precision)
        ctx.precision, ctx.transposed, ctx.wgrad_sink = precision, _is_transposed(b), wgrad_sink
        # the input-gradient GEMM reads the same blocks transposed ([E, K, N] contiguous);
        # the weight gradient multiplies the rows the forward multiplied
        a_dq = dequantize_rows(a_q, a_s, precision)
        ctx.save_for_backward(wt_q, wt_s, a_dq, offs)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        wt_q, wt_s, a_dq, offs = ctx.saved_tensors
        grad_out = _aligned(grad_out.to(torch.bfloat16))
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            g_q, g_s = quantize_rows(grad_out, ctx.precision)
            grad_a = scaled_dgrad(g_q, g_s, wt_q, wt_s, offs, ctx.precision)
        if ctx.needs_input_grad[1] or ctx.wgrad_sink is not None:
            grad_b = scaled_wgrad(grad_out, a_dq, offs, tuple(wt_q.shape), ctx.transposed,
                                  ctx.wgrad_sink)
        return grad_a, grad_b, None, None, None


def scaled_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, *,
                      precision: str = "mxfp8",
                      wgrad_sink: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`grouped_mm` on FP8 tensor cores, differentiable: ``a`` quantised along K and
    ``b`` in ``B x B`` blocks in each call (``B`` = 32 for ``"mxfp8"``, E8M0 scales; 128 for
    ``"fp8_block"``, float32 scales), ``out[r] = bf16(Q(a)[r] @ Q(b)[e])`` with fp32
    accumulation per scale step (:mod:`distmoe.kernels.scaled`), zeros in rows of no group.

    Backward (the gradient of the quantised product, each rounding's derivative taken as
    one): ``grad_a = bf16(Q(grad_out) @ Q(b)[e]^T)`` on FP8 tensor cores (the same weight
    blocks, transposed), and ``b``'s gradient ``bf16(Q(a)_e^T @ grad_out_e)`` from bf16
    operands with fp32 accumulation; with ``wgrad_sink`` it is added in fp32 into that
    buffer instead and ``b`` gets no ``.grad`` (a model's ``main_grad``).

    Args:
        a: bf16 ``[M, K]`` contiguous, rows grouped by expert.
        b: bf16 ``[E, K, N]``, contiguous or the transpose of a contiguous ``[E, N, K]``; K and
            N multiples of ``B``.
        offs: int32 ``[E]`` on the device: cumulative row ends (not read on the host).
        precision: ``"mxfp8"`` or ``"fp8_block"``.
        wgrad_sink: optional float32 tensor of ``b``'s shape and layout.

    Returns bf16 ``[M, N]``. Memory saved for the backward: the weight blocks transposed
    (``E K N`` bytes plus scales) and ``Q(a)`` as bf16. No host synchronisation.
    """
    if precision not in _TRAIN_BLOCK:
        raise ValueError(f"precision ({precision!r}) must be 'mxfp8' or 'fp8_block'")
    _check_args(a, b, offs, None, None, None)
    block = _TRAIN_BLOCK[precision]
    for name, width in (("K (a.shape[1])", a.shape[1]), ("N (b.shape[2])", b.shape[2])):
        if width % block:
            raise ValueError(f"{name} ({width}) must be a multiple of {block} for precision "
                             f"{precision!r}")
    if wgrad_sink is not None:
        check_tensor("wgrad_sink", wgrad_sink, dtypes=(torch.float32,), shape=list(b.shape),
                     shape_text="b's shape", contiguous=False)
        if wgrad_sink.stride() != b.stride():
            raise ValueError(f"wgrad_sink must have b's layout (strides {list(b.stride())}), "
                             f"got strides {list(wgrad_sink.stride())}")
        check_devices({"a": a, "wgrad_sink": wgrad_sink})
    return ScaledGroupedMMFunction.apply(a, b, offs, precision, wgrad_sink)
