"""The grouped WGRAD of both backward GEMMs: ``grad_W[e] += A_e^T @ B_e`` over every local
expert's activation rows (W2: ``A = grad_h3``, ``B = h2``; W13: ``A = grad_h1``,
``B = x_gathered``).

Row layout: the padded tile schedule and compact activation rows of
:mod:`distmoe.kernels.w2_dgrad.triton` (its module docstring defines them).

:func:`w2_wgrad`
    One program per (expert, output tile ``[block_out_m, block_out_n]`` of ``grad_w2[e]``,
    row split). It walks its expert's activation rows ``[row_offsets[e], row_offsets[e+1])``
    on the device, ``block_k`` rows per step, both operands through TMA, and adds the fp32
    tile into ``grad_w2`` (read-add-write: ``.grad`` accumulation semantics; experts without
    rows leave ``grad_w2[e]`` untouched). Every step but the last is whole and unmasked; the
    last step, when partial, is peeled and zeroes the rows past the expert's end in both
    operands (they are the next expert's rows, rows past ``row_offsets[E]`` holding anything,
    or TMA zeros). The row loop is a ``for`` over a device-side trip count on the GPU
    (software-pipelined by Triton) and a ``while`` loop under the interpreter, which cannot
    take loop bounds from ``tl.load``; the loop body is the same.
    ``split_rows > 1`` (split-K over rows) interleaves ``block_k`` row steps over that many
    programs and adds with fp32 atomics (non-deterministic summation order); it pays off when
    ``E_local * tiles`` is below the SM count or one expert holds most rows. The default is 1:
    deterministic, and at training shapes the tile count already fills the GPU.
    The same kernel serves the W13 WGRAD (:func:`w13_wgrad`), whose second operand may sit at
    a device-side offset (device-built TMA descriptor).

:func:`w13_wgrad`
    The grouped WGRAD kernel with ``A = grad_h1`` (P = 2F) and ``B = x_gathered`` (Q = D),
    walking each expert's activation rows (the last, partial row step masked), accumulated in
    place into fp32 ``grad_w13 [E, 2, F, D]`` viewed ``[E, 2F, D]``. ``x_gathered`` is a 2-D
    tensor or, with ``x_offset`` (int64 ``[1]`` on the device, a bf16 element offset such as a
    slot cursor), a 1-D base with activation row ``a`` at ``x_gathered + x_offset[0] + a*D``.
    A host-encoded TMA descriptor cannot see that offset, so on that path this operand's
    descriptor is built in every program (``tl.make_tensor_descriptor`` over
    ``row_offsets[E_local]`` rows from the offset base), while ``grad_h1`` keeps its host
    descriptor unless ``host_descriptors`` is False.

Requirements (device-side, not checked): the layout rules; ``x_offset[0]`` a multiple of 8
elements (16-byte aligned TMA base) and the base holding ``x_offset[0] + row_offsets[E_local]*D``
elements.

Sync points: none inside; kernel boundaries order the launches. Grids come from ``E_local``,
the weight shapes and the config only (no host synchronisation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from distmoe.kernels.base.checks import (
    check_activation_width,
    check_base_tensor,
    check_device_scalar,
    check_devices,
    check_disjoint,
    check_offsets,
    check_tensor,
    check_tma_aligned,
    check_width,
)
from distmoe.kernels.base.device import device_context, ensure_tma_allocator
from distmoe.kernels.base.interpreter import interpreter_active
from distmoe.kernels.base.rows import compact_segments
from distmoe.kernels.wgrad.config import WgradConfig
from distmoe.kernels.wgrad.gluon import (
    gluon_gather_reason,
    gluon_wgrad_supported,
    launch_gluon_wgrad,
)

# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _wgrad_tile_step(a_desc, b_desc, row, p0, q0, acc):
    a = a_desc.load([row, p0])
    b = b_desc.load([row, q0])
    return tl.dot(tl.trans(a), b, acc)


@triton.jit
def _wgrad_tail_step(a_desc, b_desc, row, end, p0, q0, acc, BLOCK_K: tl.constexpr):
    """The last, partial row step: rows at/after ``end`` (the next expert's rows, stale rows
    past the live end, or TMA zeros) are zeroed in both operands, so neither a large value nor
    a NaN there reaches the sum."""
    keep = ((row + tl.arange(0, BLOCK_K)) < end)[:, None]
    a = a_desc.load([row, p0])
    b = b_desc.load([row, q0])
    a = tl.where(keep, a, tl.zeros_like(a))
    b = tl.where(keep, b, tl.zeros_like(b))
    return tl.dot(tl.trans(a), b, acc)


@triton.jit
def _gathered_b(b_rows_ptr, pad_base, row, end, q0, shift, in_order, Q: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_Q: tl.constexpr):
    """B's ``[BLOCK_K, BLOCK_Q]`` tile of activation rows ``row...`` read through the row
    address table (padded row ``pad_base + row``, shifted by ``shift`` bytes), or with
    ``in_order`` nonzero from ``in_order + row * 2Q`` (rows stored in activation order; the
    table unread); rows at or past ``end`` and null addresses read as zeros."""
    i = tl.arange(0, BLOCK_K)
    live = row + i < end
    listed = tl.load(b_rows_ptr + pad_base + row + i, mask=live & (in_order == 0), other=0)
    ordered = tl.where(live, in_order + (row + i).to(tl.int64) * (2 * Q), 0)
    src = tl.where(live & (in_order != 0), ordered, listed)
    rows = tl.multiple_of((src + shift).to(tl.pointer_type(tl.bfloat16)), 16)
    q = q0 + tl.arange(0, BLOCK_Q)
    return tl.load(rows[:, None] + q[None, :], mask=(src != 0)[:, None] & (q < Q)[None, :],
                   other=0.0)


@triton.jit
def _wgrad_gather_step(a_desc, b_rows_ptr, pad_base, row, end, p0, q0, shift, in_order, acc,
                       Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_Q: tl.constexpr,
                       PARTIAL: tl.constexpr):
    """One row step with B gathered (:func:`_gathered_b`); a ``PARTIAL`` step zeroes A's
    rows at or past ``end`` too (see :func:`_wgrad_tail_step`)."""
    a = a_desc.load([row, p0])
    if PARTIAL:
        keep = ((row + tl.arange(0, BLOCK_K)) < end)[:, None]
        a = tl.where(keep, a, tl.zeros_like(a))
    b = _gathered_b(b_rows_ptr, pad_base, row, end, q0, shift, in_order, Q, BLOCK_K, BLOCK_Q)
    return tl.dot(tl.trans(a), b, acc)


@triton.jit
def _wgrad_full_step(a_desc, b_desc, b_rows_ptr, pad_base, row, end, p0, q0, shift, in_order,
                     acc, Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_Q: tl.constexpr,
                     GATHER_B: tl.constexpr):
    """A whole row step, B by descriptor or (``GATHER_B``) through the address table."""
    if GATHER_B:
        acc = _wgrad_gather_step(a_desc, b_rows_ptr, pad_base, row, end, p0, q0, shift,
                                 in_order, acc, Q, BLOCK_K, BLOCK_Q, False)
    else:
        acc = _wgrad_tile_step(a_desc, b_desc, row, p0, q0, acc)
    return acc


@triton.jit
def _grouped_wgrad_kernel(
    a,  # bf16 [R_act, P], or its TMA descriptor (HOST_DESC)
    b,  # bf16 [R_act, Q], or its TMA descriptor (HOST_DESC), or a 1-D bf16 base (B_OFFSET)
    b_offset_ptr,  # int64 [1]: element offset of activation row 0 in b (B_OFFSET); with
    #                GATHER_B int64 [2]: that offset, and 0 (rows through the table) or the
    #                table's origin (rows in activation order, the table unread)
    b_rows_ptr,  # int64 [R_cap] B row addresses by padded row (GATHER_B), else a placeholder
    padded_offsets_ptr,  # int32 [E + 1] (GATHER_B), else a placeholder
    b_shift,  # int64 (GATHER_B): bytes from the table's addresses to b's rows, less 2*offset
    row_offsets_ptr,  # int32 [E + 1]
    out_ptr,  # fp32 [E, P, Q] accumulated into, or fp32/bf16 overwritten (OVERWRITE)
    out_desc,  # TMA descriptor of out [E, P, Q], block [1, BLOCK_P, BLOCK_Q] (TMA_STORE and
    #            HOST_DESC; otherwise a placeholder)
    num_act_rows,  # R_act
    P: tl.constexpr,
    Q: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    SPLIT_ROWS: tl.constexpr,
    OVERWRITE: tl.constexpr,
    TMA_STORE: tl.constexpr,
    INTERPRETED: tl.constexpr,
    HOST_DESC: tl.constexpr,
    B_OFFSET: tl.constexpr,
    GATHER_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    num_q = tl.cdiv(Q, BLOCK_Q)
    tiles = tl.cdiv(P, BLOCK_P) * num_q
    pid = tl.program_id(0)
    # Expert slowest: the programs of one expert run together and share its rows in L2.
    expert = pid // (SPLIT_ROWS * tiles)
    rest = pid % (SPLIT_ROWS * tiles)
    split = rest // tiles
    tile = rest % tiles
    p0 = (tile // num_q) * BLOCK_P
    q0 = (tile % num_q) * BLOCK_Q
    first = tl.load(row_offsets_ptr + expert) + split * BLOCK_K
    end = tl.load(row_offsets_ptr + expert + 1)
    p = p0 + tl.arange(0, BLOCK_P)
    q = q0 + tl.arange(0, BLOCK_Q)
    mask = (p < P)[:, None] & (q < Q)[None, :]
    out = out_ptr + expert.to(tl.int64) * (P * Q) + p.to(tl.int64)[:, None] * Q + q[None, :]
    if first >= end:
        # no rows for this program: accumulating, grad_w stays as it is; overwriting (one
        # program per tile), the expert's gradient is zero
        if OVERWRITE:
            tl.store(out, tl.zeros([BLOCK_P, BLOCK_Q], dtype=out_ptr.dtype.element_ty),
                     mask=mask)
        return
    if HOST_DESC:
        a_desc = a
    else:
        a_desc = tl.make_tensor_descriptor(
            a, shape=[num_act_rows, P], strides=[P, 1], block_shape=[BLOCK_K, BLOCK_P]
        )
    shift = b_shift  # (GATHER_B only)
    pad_base = 0
    in_order = 0
    if GATHER_B:
        b_desc = a_desc  # not read: B's rows come through the address table
        shift = b_shift + 2 * tl.load(b_offset_ptr)
        in_order = tl.load(b_offset_ptr + 1)
        pad_base = tl.load(padded_offsets_ptr + expert) - tl.load(row_offsets_ptr + expert)
    elif B_OFFSET:
        # A host descriptor cannot see a device-side offset: build this one on the device,
        # bounded by the live rows (nothing past row_offsets[E] is read; offset a multiple of
        # 8 elements, so the base stays 16-byte aligned).
        b_base = tl.multiple_of(b + tl.load(b_offset_ptr), 16)
        b_desc = tl.make_tensor_descriptor(
            b_base,
            shape=[tl.load(row_offsets_ptr + NUM_EXPERTS), Q],
            strides=[Q, 1],
            block_shape=[BLOCK_K, BLOCK_Q],
        )
    elif HOST_DESC:
        b_desc = b
    else:
        b_desc = tl.make_tensor_descriptor(
            b, shape=[num_act_rows, Q], strides=[Q, 1], block_shape=[BLOCK_K, BLOCK_Q]
        )
    acc = tl.zeros([BLOCK_P, BLOCK_Q], dtype=tl.float32)
    step = SPLIT_ROWS * BLOCK_K
    # Whole steps (all BLOCK_K rows before `end`): unmasked. Only the last step of a program
    # can be partial (a partial step ends past `end`, so every later one starts past it).
    # end - first >= 1 and step >= BLOCK_K keep the numerator positive.
    num_full = (end - first - BLOCK_K + step) // step
    if INTERPRETED:
        i = 0
        while i < num_full:
            acc = _wgrad_full_step(a_desc, b_desc, b_rows_ptr, pad_base, first + i * step, end,
                                   p0, q0, shift, in_order, acc, Q, BLOCK_K, BLOCK_Q, GATHER_B)
            i += 1
    else:
        for i in range(0, num_full):
            acc = _wgrad_full_step(a_desc, b_desc, b_rows_ptr, pad_base, first + i * step, end,
                                   p0, q0, shift, in_order, acc, Q, BLOCK_K, BLOCK_Q, GATHER_B)
    tail = first + num_full * step
    if tail < end:
        if GATHER_B:
            acc = _wgrad_gather_step(a_desc, b_rows_ptr, pad_base, tail, end, p0, q0, shift,
                                     in_order, acc, Q, BLOCK_K, BLOCK_Q, True)
        else:
            acc = _wgrad_tail_step(a_desc, b_desc, tail, end, p0, q0, acc, BLOCK_K)

    if OVERWRITE and TMA_STORE:
        # One asynchronous TMA store of the whole tile (bounds per dimension: a tile past P or
        # Q is clipped there, never spills into the next expert).
        if HOST_DESC:
            o_desc = out_desc
        else:
            o_desc = tl.make_tensor_descriptor(
                out_ptr, shape=[NUM_EXPERTS, P, Q], strides=[P * Q, Q, 1],
                block_shape=[1, BLOCK_P, BLOCK_Q],
            )
        o_desc.store([expert, p0, q0],
                     tl.reshape(acc.to(out_ptr.dtype.element_ty), [1, BLOCK_P, BLOCK_Q]))
    elif OVERWRITE:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    elif SPLIT_ROWS == 1:
        tl.store(out, tl.load(out, mask=mask, other=0.0) + acc, mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask, sem="relaxed")


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def check_wgrad_config(config: object, *, out_rows: int, out_cols: int,
                       accumulate: bool = True) -> WgradConfig:
    if not isinstance(accumulate, bool):
        raise TypeError(f"accumulate must be a bool, got {type(accumulate).__name__}")
    if config is None:
        config = WgradConfig.for_widths(out_rows=out_rows, out_cols=out_cols)
    if not isinstance(config, WgradConfig):
        raise TypeError(f"config must be a WgradConfig or None, got {type(config).__name__}")
    if not accumulate and config.split_rows != 1:
        raise ValueError(
            f"accumulate=False needs config.split_rows == 1 (one program per output tile), "
            f"got {config.split_rows}"
        )
    return config


def launch_grouped_wgrad(
    a: torch.Tensor,
    b: torch.Tensor,
    row_offsets: torch.Tensor,
    out: torch.Tensor,
    config: WgradConfig,
    device: torch.device,
    *,
    b_offset: torch.Tensor | None = None,
    accumulate: bool = True,
    b_rows: torch.Tensor | None = None,
    padded_offsets: torch.Tensor | None = None,
    b_rows_origin: int = 0,
) -> None:
    """``out[e] += a[rows_e]^T @ b[rows_e]`` (``out[e] = ...`` without ``accumulate``: every
    element written, zeros for an expert without rows) over every local expert's activation rows
    ``rows_e = [row_offsets[e], row_offsets[e+1])`` (inputs validated by the caller: ``a``
    ``[R_act, P]`` bf16, ``b`` ``[R_act, Q]`` bf16, or with ``b_offset`` (int64 ``[1]``) a
    1-D bf16 base with row ``r`` at ``b + b_offset[0] + r*Q``; ``out`` fp32 ``[E, P, Q]``).

    With ``b_rows`` (int64 ``[R_cap]``, and ``b_offset`` int64 ``[2]`` and
    ``padded_offsets``) B's rows are read through a table of byte addresses by padded row
    instead: activation row ``r`` of expert ``e`` is the row at ``b + 2*b_offset[0] +
    b_rows[padded_offsets[e] + r - row_offsets[e]] - b_rows_origin`` (bytes; 0 in the table =
    a null row, zeros), or where ``b_offset[1]`` (0 or ``b_rows_origin``, on the device) is
    nonzero, at ``b + 2*b_offset[0] + r*2Q`` (rows in order, the table unread)."""
    num_act_rows, width_p = a.shape
    width_q = out.shape[2]
    num_experts = row_offsets.shape[0] - 1
    if num_experts == 0:
        return
    if num_act_rows == 0:
        if not accumulate:
            out.zero_()
        return  # R_act >= row_offsets[E]: no live rows
    if config.gluon and not accumulate:
        if gluon_wgrad_supported(a, out, config.block_out_m, config.block_out_n) is None and (
                b_rows is None or gluon_gather_reason(config.specialized, width_q,
                                                      config.block_out_n) is None):
            launch_gluon_wgrad(a, b, row_offsets, out, b_offset=b_offset,
                               block_p=config.block_out_m, block_q=config.block_out_n,
                               stages=config.num_stages, num_warps=config.num_warps,
                               block_k=config.block_k, specialized=config.specialized,
                               pingpong=config.pingpong, b_rows=b_rows,
                               padded_offsets=padded_offsets, b_rows_origin=b_rows_origin,
                               lockstep=config.lockstep and b_rows is None)
            return
    tiles = triton.cdiv(width_p, config.block_out_m) * triton.cdiv(width_q, config.block_out_n)
    grid = (num_experts * config.split_rows * tiles,)
    # Overwriting: the epilogue is one TMA store when out meets TMA's alignment (16-byte base
    # and row pitch); accumulating reads the old values, so it keeps pointer stores.
    tma_store = (not accumulate and out.is_contiguous() and out.data_ptr() % 16 == 0
                 and (width_q * out.element_size()) % 16 == 0)
    out_desc = row_offsets  # placeholder unless TMA_STORE with host descriptors
    if tma_store and config.host_descriptors:
        out_desc = TensorDescriptor(
            out.view(num_experts, width_p, width_q),
            shape=[num_experts, width_p, width_q],
            strides=[width_p * width_q, width_q, 1],
            block_shape=[1, config.block_out_m, config.block_out_n],
        )
    if config.host_descriptors:
        a = TensorDescriptor(
            a,
            shape=[num_act_rows, width_p],
            strides=[width_p, 1],
            block_shape=[config.block_k, config.block_out_m],
        )
        if b_offset is None:
            b = TensorDescriptor(
                b,
                shape=[num_act_rows, width_q],
                strides=[width_q, 1],
                block_shape=[config.block_k, config.block_out_n],
            )
    if not config.host_descriptors or b_offset is not None:
        ensure_tma_allocator()
    with device_context(device):
        _grouped_wgrad_kernel[grid](
            a,
            b,
            b_offset if b_offset is not None else row_offsets,  # placeholder unless B_OFFSET
            row_offsets if b_rows is None else b_rows,  # placeholders unless GATHER_B
            row_offsets if padded_offsets is None else padded_offsets,
            0 if b_rows is None else b.data_ptr() - b_rows_origin,
            row_offsets,
            out,
            out_desc,
            num_act_rows,
            P=width_p,
            Q=width_q,
            NUM_EXPERTS=num_experts,
            SPLIT_ROWS=config.split_rows,
            OVERWRITE=not accumulate,
            TMA_STORE=tma_store,
            INTERPRETED=interpreter_active(),
            HOST_DESC=config.host_descriptors,
            B_OFFSET=b_offset is not None,
            GATHER_B=b_rows is not None,
            BLOCK_K=config.block_k,
            BLOCK_P=config.block_out_m,
            BLOCK_Q=config.block_out_n,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )


def w2_wgrad(
    grad_h3: torch.Tensor,
    h2: torch.Tensor,
    padded_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    grad_w2: torch.Tensor,
    *,
    accumulate: bool = True,
    config: WgradConfig | None = None,
) -> None:
    """``grad_w2[e] += grad_h3_e^T @ h2_e`` over every local expert's activation rows
    ``[row_offsets[e], row_offsets[e+1])`` (fp32, in place; module docstring). With
    ``accumulate=False``: ``grad_w2[e] = ...`` (fp32 accumulation, one rounding to
    grad_w2's dtype, zeros for experts without rows; needs ``config.split_rows == 1``), so
    grad_w2 needs no zero fill and may be bf16.

    Args:
        grad_h3: bf16 ``[R_act, D]`` gathered route output gradients in activation rows
            (``grad_h3_out`` of :func:`~distmoe.kernels.w2_dgrad.triton.w2_dgrad_swiglu_bwd`; null
            rows zeros or finite).
        h2: bf16 ``[R_act, F]`` (``h2_out`` of
            :func:`~distmoe.kernels.w2_dgrad.triton.w2_dgrad_swiglu_bwd`).
        padded_offsets: int32 ``[E_local + 1]``, validated with the rest of the layout; the row
            walk itself needs only ``row_offsets`` (padding rows have no activation rows).
        row_offsets: int32 ``[E_local + 1]``, exclusive prefix sum of the live rows per expert
            (``R_act >= row_offsets[E_local]``). Rows past an expert's end that its last row
            step loads are zeroed, so they may hold anything, NaN included.
        grad_w2: fp32 ``[E_local, D, F]``, accumulated into (experts without rows untouched);
            fp32 or bf16 with ``accumulate=False``.
        config: :class:`WgradConfig`; ``None`` = ``for_widths`` with ``block_m`` 128.
    """
    out_dtypes = (torch.float32,) if accumulate else (torch.float32, torch.bfloat16)
    check_tensor("grad_w2", grad_w2, dtypes=out_dtypes, ndim=3, shape_text="[E_local, D, F]")
    num_experts, hidden, ffn = grad_w2.shape
    check_width("D (grad_w2.shape[1])", hidden)
    check_width("F (grad_w2.shape[2])", ffn)
    num_act = check_activation_width("grad_h3", grad_h3, hidden, "D")
    check_tensor(
        "h2",
        h2,
        dtypes=(torch.bfloat16,),
        shape=[num_act, ffn],
        shape_text="[R_act, F] like grad_h3",
    )
    check_offsets(padded_offsets, row_offsets, num_experts)
    check_tma_aligned("grad_h3", grad_h3)
    check_tma_aligned("h2", h2)
    named = {
        "grad_h3": grad_h3,
        "h2": h2,
        "padded_offsets": padded_offsets,
        "row_offsets": row_offsets,
        "grad_w2": grad_w2,
    }
    device = check_devices(named)
    check_disjoint(named)
    config = check_wgrad_config(config, out_rows=hidden, out_cols=ffn, accumulate=accumulate)
    launch_grouped_wgrad(grad_h3, h2, row_offsets, grad_w2, config, device,
                         accumulate=accumulate)


def w13_wgrad(
    grad_h1: torch.Tensor,
    x_gathered: torch.Tensor,
    padded_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    grad_w13: torch.Tensor,
    *,
    x_offset: torch.Tensor | None = None,
    accumulate: bool = True,
    config: WgradConfig | None = None,
    x_rows: torch.Tensor | None = None,
    rows_origin: int = 0,
) -> None:
    """``grad_w13[e] += grad_h1_e^T @ x_e`` over every local expert's activation rows
    ``[row_offsets[e], row_offsets[e+1])`` (fp32, in place; module docstring). With
    ``accumulate=False``: ``grad_w13[e] = ...`` (fp32 accumulation, one rounding to
    grad_w13's dtype, zeros for experts without rows; needs ``config.split_rows == 1``), so
    grad_w13 needs no zero fill and may be bf16.

    Args:
        grad_h1: bf16 ``[R_act, 2F]`` in activation rows (``R_act >= row_offsets[E_local]``).
        x_gathered: the forward's gathered input rows (null rows zeros) in activation rows:
            bf16 ``[R_act, D]`` like ``grad_h1``, or, with ``x_offset``, a 1-D contiguous bf16
            base tensor (16-byte aligned start) with activation row ``a`` at
            ``x_gathered + x_offset[0] + a*D``; only rows ``< row_offsets[E_local]`` are read
            there.
        padded_offsets: int32 ``[E_local + 1]``, validated with the rest of the layout; the row
            walk itself needs only ``row_offsets``.
        row_offsets: int32 ``[E_local + 1]``, exclusive prefix sum of the live rows per expert.
            Rows past an expert's end that its last row step loads are zeroed, so they may
            hold anything, NaN included.
        grad_w13: fp32 ``[E_local, 2, F, D]``, accumulated into (experts without rows
            untouched); fp32 or bf16 with ``accumulate=False``.
        x_offset: optional int64 ``[1]`` device tensor, the bf16 element offset of activation
            row 0 in ``x_gathered`` (a multiple of 8 elements; not checked). The base is left
            out of the overlap check (the rows it covers are known on the device only). With
            ``x_rows``: int64 ``[2]``, that offset and a device switch: 0 reads the rows
            through the table; ``rows_origin`` leaves the table unread and reads activation
            row ``a`` at ``x_gathered + x_offset[0] + a*D`` (rows stored in order, as without
            ``x_rows``; same bits), so that one launch serves a layer either way.
        config: :class:`WgradConfig` (output tile over ``[2F, D]``); ``None`` =
            ``for_widths`` with ``block_m`` 128.
        x_rows: optional int64 ``[R_cap]`` (needs ``x_offset`` ``[2]``): the rows are not stored in
            activation order but named by a table of byte addresses by padded row, the table
            the forward's W13 gathered through (0 = a null row, zeros). Activation row ``a``
            of expert ``e`` is then the row whose address is
            ``x_rows[padded_offsets[e] + a - row_offsets[e]]``, moved from ``rows_origin``
            to ``x_gathered + x_offset[0]``: with x's rows kept token-major at that offset
            and the table naming the rows of a buffer at ``rows_origin`` with the same row
            pitch, each row is read in place (no gathered copy; the same bits). Addresses are
            not checked (device values): each must land inside ``x_gathered``.
        rows_origin: an int, the byte address the table's rows are relative to (with
            ``x_rows``).
    """
    out_dtypes = (torch.float32,) if accumulate else (torch.float32, torch.bfloat16)
    check_tensor(
        "grad_w13", grad_w13, dtypes=out_dtypes, ndim=4, shape_text="[E_local, 2, F, D]"
    )
    num_experts, two, ffn, hidden = grad_w13.shape
    if two != 2:
        raise ValueError(f"grad_w13 must have shape [E_local, 2, F, D], got {list(grad_w13.shape)}")
    check_width("D (grad_w13.shape[3])", hidden)
    check_width("F (grad_w13.shape[2])", ffn)
    num_act = check_activation_width("grad_h1", grad_h1, 2 * ffn, "2F")
    if x_rows is not None:
        if x_offset is None:
            raise ValueError("x_rows needs x_offset (x_gathered is then the base that the "
                             "table's rows are read from), got x_offset=None")
        check_tensor("x_rows", x_rows, dtypes=(torch.int64,), ndim=1,
                     shape_text="[R_cap] (row byte addresses by padded row)")
        if isinstance(rows_origin, bool) or not isinstance(rows_origin, int) \
                or rows_origin < 0 or rows_origin % 16:
            raise ValueError(f"rows_origin must be a non-negative int, a multiple of 16 "
                             f"(16-byte aligned rows), got {rows_origin!r}")
        if hidden % 8:
            raise ValueError(f"x_rows needs D % 8 == 0 (16-byte rows), got D={hidden}")
    elif rows_origin != 0:
        raise ValueError(f"rows_origin is read only with x_rows, got {rows_origin!r} without")
    if x_offset is None:
        check_tensor(
            "x_gathered",
            x_gathered,
            dtypes=(torch.bfloat16,),
            shape=[num_act, hidden],
            shape_text="[R_act, D] like grad_h1 (or a 1-D base with x_offset)",
        )
        check_tma_aligned("x_gathered", x_gathered)
    elif x_rows is not None:
        check_tensor("x_offset", x_offset, dtypes=(torch.int64,), shape=[2],
                     shape_text="[2] with x_rows (x_gathered's row-0 element offset, and 0 or "
                                "rows_origin)")
        check_base_tensor(
            "x_gathered", x_gathered, "x_offset", "row a at x_gathered + x_offset[0] + a*D"
        )
    else:
        check_device_scalar("x_offset", x_offset, "[1] (bf16 element offset of x_gathered's row 0)")
        check_base_tensor(
            "x_gathered", x_gathered, "x_offset", "row a at x_gathered + x_offset[0] + a*D"
        )
    check_offsets(padded_offsets, row_offsets, num_experts)
    check_tma_aligned("grad_h1", grad_h1)
    named = {
        "grad_h1": grad_h1,
        "x_gathered": x_gathered,
        "padded_offsets": padded_offsets,
        "row_offsets": row_offsets,
        "grad_w13": grad_w13,
    }
    if x_offset is not None:
        named["x_offset"] = x_offset
    if x_rows is not None:
        named["x_rows"] = x_rows
    device = check_devices(named)
    if x_offset is not None:
        del named["x_gathered"]  # rows at a device-side offset: not checkable on the host
    check_disjoint(named)
    config = check_wgrad_config(config, out_rows=2 * ffn, out_cols=hidden,
                                accumulate=accumulate)
    launch_grouped_wgrad(
        grad_h1,
        x_gathered,
        row_offsets,
        grad_w13.view(num_experts, 2 * ffn, hidden),
        config,
        device,
        b_offset=x_offset,
        accumulate=accumulate,
        b_rows=x_rows,
        padded_offsets=padded_offsets,
        b_rows_origin=rows_origin,
    )


# --------------------------------------------------------------------------------------------
# References (plain PyTorch; they read the offsets on the host)
# --------------------------------------------------------------------------------------------


def w2_wgrad_ref(
    grad_h3: torch.Tensor,
    h2: torch.Tensor,
    padded_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    grad_w2: torch.Tensor,
) -> torch.Tensor:
    """Reference of :func:`w2_wgrad` (activation rows): returns ``grad_w2 + sum`` as a new
    fp32 tensor."""
    out = grad_w2.float().clone()
    for e, (_, act, count) in enumerate(compact_segments(padded_offsets, row_offsets)):
        if count:
            rows = slice(act, act + count)
            out[e] += grad_h3[rows].float().t() @ h2[rows].float()
    return out


def w13_wgrad_ref(
    grad_h1: torch.Tensor,
    x_gathered: torch.Tensor,
    padded_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    grad_w13: torch.Tensor,
) -> torch.Tensor:
    """Reference of :func:`w13_wgrad` (``x_gathered`` 2-D in activation rows): returns
    ``grad_w13 + sum`` as a new fp32 tensor."""
    num_experts, _, ffn, hidden = grad_w13.shape
    out = grad_w13.float().clone()
    for e, (_, act, count) in enumerate(compact_segments(padded_offsets, row_offsets)):
        if count:
            rows = slice(act, act + count)
            grad = grad_h1[rows].float().t() @ x_gathered[rows].float()
            out[e] += grad.reshape(2, ffn, hidden)
    return out
