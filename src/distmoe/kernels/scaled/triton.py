"""Grouped GEMM over experts on block-scaled FP8 operands (SM90; Triton), optionally with
SwiGLU: exact MXFP8 (below), and with one scale per 128 values of K (:class:`ScaleLayout`):
MXFP8 rebased onto 128-wide groups (E8M0 scales, 32-row weight blocks) and DeepSeek-V3's
block FP8 (float32 scales, 128 x 128 weight blocks). The arithmetic is the same with
``32`` read as the layout's ``k_group``: one FP8 dot per K step into a fresh partial,
promoted with both scales (for float32 scales their product is rounded once); error bounds
in docs/numerics.md (section 6, 128-wide K groups).

Operands come from :mod:`distmoe.quant`: the activation rows from
:func:`~distmoe.quant.mxfp8_quantize` (``dim=-1``: one E8M0 scale per 32 values along K), the
expert weights from :func:`~distmoe.quant.mxfp8_quantize_weight` (32 x 32 blocks; the kernel
reads the forward orientation, :attr:`MXFP8Weight.scales` ``[E, N/32, K/32]``). Rows are in
compact expert-major *activation* order, scheduled in *padded* row tiles as in the bf16
families (:mod:`distmoe.kernels.base.rows`): expert ``e`` owns activation rows
``[row_offsets[e], row_offsets[e+1])`` and padded rows ``[padded_offsets[e],
padded_offsets[e+1])`` (a multiple of ``block_m``); padded row ``padded_offsets[e] + j`` is
activation row ``row_offsets[e] + j`` when ``j < n_e``. For every live row ``a`` of expert
``e`` and output column ``n``::

    acc[a, n] = sum over K steps s of  P_s * 2^(sa[a, s] - 127) * 2^(sb[e, n // 32, s] - 127)
    P_s       = sum_{k in [32 s, 32 s + 32)} a_q[a, k] * b_q[e, n, k]     (one FP8 dot)
    out[a, n] = bf16(acc[a, n])                                          (swiglu=False)
    out[a, f] = bf16(silu(acc_g) * acc_u), acc_g = acc[a, f], acc_u = acc[a, F + f]
                                           (swiglu=True, fp32 epilogue, one rounding)

Arithmetic: every 32-wide K step is one FP8 tensor-core dot (E4M3 x E4M3, fp32 out) into a
fresh accumulator, so the E8M0 scales, which change every 32 values of K, never meet the
tensor core; its partial ``P_s`` is promoted into the fp32 accumulator as ``acc += P_s * c``
with ``c = 2^(sa - 127) * 2^(sb - 127)``, a power of two. An E4M3 x E4M3 product has at most
8 significant bits, so every product is exact in fp32, and multiplying by ``c`` is exact
while the result stays a normal fp32 (``c`` itself is exact for ``sa + sb - 254`` in
[-149, 127]). This is exact MXFP8 arithmetic (eq. 87 of the block-scaled GEMM: each product
``(S_a A)(S_b B)``, summed in fp32) up to the fp32 summation order: within a step the
tensor core's (or the interpreter's) order, across steps the K order. Error against the
exact sum, for ``K`` values and ``S = sum_k |a_k b_k|`` (dequantised operands)::

    CPU interpreter:  |acc - exact| <= (31 + K/32 + 1) * 2^-24 * S      (first order)
    SM90 tensor core: add, per step, the FP8 MMA's own accumulation error: Hopper's FP8 WGMMA
                      adds the 32 exact products with a significand narrower than fp32's
                      (reported for H100 as 13 fraction bits, truncated, aligned to the
                      largest addend); on that model at most
                      32 * 2^-13 * max_k |a_k b_k| + 2^-13 * |P_s| per step, times c
                      (a model to confirm on the GPU: tests/kernels/scaled, gpu marker)

then one bf16 rounding (relative 2^-8) of the result, or of the fp32 SwiGLU
``g * sigmoid(g) * u`` (a few fp32 roundings; it flushes silu(g) to 0 once sigmoid(g) leaves
fp32's normal range, g < -87: an absolute error below 2^-118 |u|). Edge cases:
a NaN qdata byte (0x7F / 0xFF, from a non-finite input) or a NaN scale byte (0xFF) makes its
output row / column NaN; ``c`` below 2^-149 flushes the step's term to zero (its value is
then below 2^-126 in magnitude, since ``|P_s| < 2^23``); ``c`` above 2^127 overflows.

Hopper note: one FP8 WGMMA is 32 deep in K, so each step is one MMA, whose result must land
in registers before the promotion (the multiply-add on CUDA cores serialises with the MMAs:
correct first, the fast variants of issue 58 come later). Compiled for sm_90a without a GPU
(Triton 3.6, ptxas): e4m3 ``wgmma`` and a ``cp.async`` pipeline; at the ``for_widths``
configs 254 registers (128 x 128) and 172 (SwiGLU, 128 x 64 per half), no spill.

CPU: under Triton's interpreter (``TRITON_INTERPRET=1``), ``tl.dot`` does accept E4M3
operands (Triton 3.6 widens them to fp16, exactly for every finite code, and multiplies in
fp32), but decodes the NaN codes 0x7F / 0xFF as +-480. Only under the interpreter the kernel
therefore widens both tiles to fp32 itself (exact: E4M3 values are fp32 values), restores
NaN for the NaN codes and takes an fp32 ``tl.dot`` (``input_precision="ieee"``): the same
products, bit for bit, and NaN where the GPU gives NaN.

Algorithm: one program per ``block_m x block_n`` tile of the output, on a 1-D grid sized
from ``R`` (the row capacity, ``a_q.shape[0]``) and N, never from routed counts: ``num_pid_m
= cdiv(R, block_m) + E - 1`` row tiles (the most that ``R`` rows padded per expert to
``block_m`` can fill) by ``cdiv(N_out, block_n)`` column tiles, in group-M order. A program
walks its row tiles ``pid_m, pid_m + num_pid_m, ...`` below ``padded_offsets[E]`` (one at
most under the routing layer's minimal padding; more padding is still covered); a tile's
expert, activation rows and live row count come from the two tables on the device, tiles of
padding rows only do no work. Per K step it loads the ``block_m x 32`` FP8 rows and their
scales, the ``block_n x 32`` FP8 weight rows (and the up half's with SwiGLU) and their
scales (pointer loads, pipelined by Triton), one dot per half, promotes, and at the end
stores the live rows' bf16 values at their activation rows.

Memory: nothing is allocated. Sync points: none on the host (the tables are read on the
device); the operands must be complete before the launch.

Requirements: K, N (and F = N / 2 with SwiGLU) positive multiples of 32; the padded segments
multiples of ``config.block_m``; ``row_offsets[0] = 0``, ``0 <= n_e <=`` the expert's padded
segment length and ``row_offsets[E] <= R`` (device values: not checked by the kernel; the
reference checks them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from distmoe.kernels.base.checks import (
    check_devices,
    check_offsets,
    check_padded_offsets_host,
    check_row_offsets_host,
    check_tensor,
)
from distmoe.kernels.base.device import device_context, warn_gluon_fallback
from distmoe.kernels.base.interpreter import interpreter_active
from distmoe.kernels.base.rows import activation_segments
from distmoe.kernels.base.tiles import swizzle_tile, tile_activation_rows, tile_expert
from distmoe.kernels.scaled import gluon as scaled_gluon
from distmoe.kernels.scaled.config import SCALE_BLOCK, ScaledGemmConfig
from distmoe.quant.formats import e8m0_to_fp32
from distmoe.quant.mxfp8 import e8m0_to_float

# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _load_step(rows_ptr, srows_ptr, s, kk, ok, MASKED: tl.constexpr, SCALE_FP32: tl.constexpr):
    """K step ``s`` of a tile: the E4M3 values ``[rows, kk]`` and the rows' fp32 scales
    (E8M0 bytes decoded, or fp32 scales as stored). ``MASKED``: rows outside ``ok`` read
    zeros and scale 1.0."""
    if SCALE_FP32:
        one = 1.0
    else:
        one = 127
    if MASKED:
        q = tl.load(rows_ptr[:, None] + kk[None, :], mask=ok[:, None], other=0.0)
        sc = tl.load(srows_ptr + s, mask=ok, other=one)
    else:
        q = tl.load(rows_ptr[:, None] + kk[None, :])
        sc = tl.load(srows_ptr + s)
    if SCALE_FP32:
        return q, sc
    else:
        return q, e8m0_to_fp32(sc.to(tl.int32))


@triton.jit
def dot_step(a, b, INTERPRET: tl.constexpr):
    """``a [M, G] @ b [N, G]^T`` of E4M3 tiles, fp32 out: FP8 tensor-core dots, or under
    the interpreter an fp32 dot of the exactly widened values with NaN codes kept NaN (the
    interpreter's own E4M3 decoding turns them into +-480)."""
    if INTERPRET:
        a_nan = (a.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F
        b_nan = (b.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F
        a32 = tl.where(a_nan, float("nan"), a.to(tl.float32))
        b32 = tl.where(b_nan, float("nan"), b.to(tl.float32))
        return tl.dot(a32, tl.trans(b32), input_precision="ieee")
    else:
        return tl.dot(a, tl.trans(b))


@triton.jit
def _mxfp8_tile(
    a_ptr,
    sa_ptr,
    b_ptr,
    sb_ptr,
    padded_offsets_ptr,
    row_offsets_ptr,
    out_ptr,
    scatter_ptr,
    row_start,
    pid_n,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,
    OUT_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    SWIGLU: tl.constexpr,
    INTERPRET: tl.constexpr,
    K_GROUP: tl.constexpr,
    SB_ROWS: tl.constexpr,
    SCALE_FP32: tl.constexpr,
    SCATTER: tl.constexpr,
):
    """One ``BLOCK_M x BLOCK_N`` output tile of the padded row tile at ``row_start``."""
    KS: tl.constexpr = K // K_GROUP  # scale columns of a row (K steps)
    NUM_KB: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    STEPS: tl.constexpr = BLOCK_K // K_GROUP
    expert = tile_expert(padded_offsets_ptr, row_start, NUM_EXPERTS, EXPERTS_POW2)
    act_start, num_live = tile_activation_rows(
        padded_offsets_ptr, row_offsets_ptr, expert, row_start
    )
    # Live rows come first in a segment: a tile starting at a padding row has none.
    if num_live > 0:
        idx = tl.arange(0, BLOCK_M)
        is_live = idx < num_live
        rows = act_start + idx  # int64 activation rows
        a_rows = a_ptr + rows * K
        sa_rows = sa_ptr + rows * KS
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        is_col = cols < OUT_N
        e64 = expert.to(tl.int64)
        # gate (or the only) weight rows, and the up rows F = OUT_N further with SwiGLU
        g_rows = b_ptr + e64 * (N * K) + cols * K
        g_srows = sb_ptr + e64 * ((N // SB_ROWS) * KS) + (cols // SB_ROWS) * KS
        u_rows = g_rows + OUT_N * K
        u_srows = g_srows + (OUT_N // SB_ROWS) * KS
        offs = tl.arange(0, K_GROUP)

        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, NUM_KB):
            for j in tl.static_range(STEPS):
                s = kb * STEPS + j  # K step: values [G s, G s + G), scale column s
                kk = s * K_GROUP + offs
                # Masked rows, columns and steps read zeros and scale 1.0: their
                # terms are 0 and never reach a stored element or change a live one.
                if EVEN_K:
                    row_ok = is_live
                    col_ok = is_col
                else:
                    row_ok = is_live & (s < KS)
                    col_ok = is_col & (s < KS)
                a, sa = _load_step(a_rows, sa_rows, s, kk, row_ok, True, SCALE_FP32)
                b, sb = _load_step(g_rows, g_srows, s, kk, col_ok, not (EVEN_K and EVEN_N),
                                   SCALE_FP32)
                acc_g += dot_step(a, b, INTERPRET) * (sa[:, None] * sb[None, :])
                if SWIGLU:
                    bu, su = _load_step(u_rows, u_srows, s, kk, col_ok,
                                        not (EVEN_K and EVEN_N), SCALE_FP32)
                    acc_u += dot_step(a, bu, INTERPRET) * (sa[:, None] * su[None, :])

        if SWIGLU:
            val = acc_g * tl.sigmoid(acc_g) * acc_u
        else:
            val = acc_g
        if SCATTER:  # each live row at its padded row's address (0: not stored)
            dst = tl.load(scatter_ptr + row_start + idx, mask=is_live, other=0)
            out_rows = tl.multiple_of(dst.to(tl.pointer_type(tl.bfloat16)), 16)
            is_live = is_live & (dst != 0)
        else:
            out_rows = out_ptr + rows * OUT_N
        tl.store(out_rows[:, None] + cols[None, :], val.to(tl.bfloat16),
                 mask=is_live[:, None] & is_col[None, :])


@triton.jit
def _mxfp8_grouped_mm_kernel(
    a_ptr,
    sa_ptr,
    b_ptr,
    sb_ptr,
    padded_offsets_ptr,
    row_offsets_ptr,
    out_ptr,
    scatter_ptr,
    num_pid_m,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,
    OUT_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    SWIGLU: tl.constexpr,
    INTERPRET: tl.constexpr,
    K_GROUP: tl.constexpr,
    SB_ROWS: tl.constexpr,
    SCALE_FP32: tl.constexpr,
    SCATTER: tl.constexpr,
):
    NUM_PID_N: tl.constexpr = (OUT_N + BLOCK_N - 1) // BLOCK_N
    pid_m, pid_n = swizzle_tile(tl.program_id(0), num_pid_m, NUM_PID_N, GROUP_M)
    total_rows = tl.load(padded_offsets_ptr + NUM_EXPERTS)
    # One row tile under minimal padding (the grid's bound); later ones only if the segments
    # were padded further. A while loop (not range) keeps the interpreter working too.
    row_start = pid_m * BLOCK_M
    while row_start < total_rows:
        _mxfp8_tile(a_ptr, sa_ptr, b_ptr, sb_ptr, padded_offsets_ptr, row_offsets_ptr, out_ptr,
                    scatter_ptr, row_start, pid_n, NUM_EXPERTS, EXPERTS_POW2, K, N, OUT_N,
                    BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, SWIGLU, INTERPRET, K_GROUP,
                    SB_ROWS, SCALE_FP32, SCATTER)
        row_start += num_pid_m * BLOCK_M


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScaleLayout:
    """Where an operand pair's scales sit: one activation scale per ``k_group`` values of a
    row along K; one weight scale per ``b_rows`` weight rows by ``k_group`` values; scales
    stored as E8M0 bytes (uint8) or float32."""

    name: str
    k_group: int
    b_rows: int
    fp32: bool

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.fp32 else torch.uint8

    @property
    def kind(self) -> str:
        return "float32" if self.fp32 else "E8M0"


#: exact MXFP8: one E8M0 scale per 32 values, 32 x 32 weight blocks
MXFP8 = ScaleLayout("mxfp8", SCALE_BLOCK, SCALE_BLOCK, False)
#: MXFP8 rebased onto 128-wide K groups (:func:`distmoe.quant.mxfp8_rebase`)
MXFP8_REBASED = ScaleLayout("mxfp8 rebased to 128", 128, SCALE_BLOCK, False)
#: DeepSeek-V3's FP8 recipe: float32 scales, 1 x 128 activations, 128 x 128 weights
FP8_BLOCK = ScaleLayout("fp8_block", 128, 128, True)


def _multiple_of(name: str, value: int, m: int, text: str) -> None:
    if value <= 0 or value % m:
        raise ValueError(f"{name} ({value}) must be a positive multiple of {m} ({text})")


def check_scaled_grouped_mm_args(
    a_q: object,
    a_scales: object,
    b_q: object,
    b_scales: object,
    padded_offsets: object,
    row_offsets: object,
    out: object,
    *,
    swiglu: object,
    layout: ScaleLayout = MXFP8,
    for_kernel: bool = True,
    scatter_ptrs: object = None,
) -> tuple[torch.Tensor, torch.Tensor, int, int, int, int]:
    """Validate a block-scaled grouped GEMM's arguments for ``layout`` (no synchronisation);
    return the weights seen as ``[E, N, K]`` / ``[E, N/b_rows, K/k_group]`` and
    ``(R, K, E, N)``. With ``scatter_ptrs`` (int64 ``[R_cap]``), ``out`` must be None."""
    if not isinstance(swiglu, bool):
        raise TypeError(f"swiglu must be a bool, got {type(swiglu).__name__}")
    g, br, sd, kind = layout.k_group, layout.b_rows, layout.dtype, layout.kind
    check_tensor("a_q", a_q, dtypes=(torch.float8_e4m3fn,), ndim=2, shape_text="[R, K]")
    rows, k = a_q.shape
    _multiple_of("K", k, g, f"a_q.shape[1]: {g} values per {layout.name} scale")
    check_tensor("a_scales", a_scales, dtypes=(sd,), shape=[rows, k // g],
                 shape_text=f"[R, K/{g}] ({kind}, {layout.name})")
    if not isinstance(b_q, torch.Tensor):
        raise TypeError(f"b_q must be a torch.Tensor, got {type(b_q).__name__}")
    if swiglu and b_q.dim() == 4:
        # w13's own layout [E, 2, F, K]: gate rows then up rows, seen as [E, 2F, K]
        check_tensor("b_q", b_q, dtypes=(torch.float8_e4m3fn,), ndim=4,
                     shape_text="[E, 2, F, K] (w13: gate, up)")
        if b_q.shape[1] != 2:
            raise ValueError(f"b_q must have shape [E, 2, F, K] (w13: gate, up) when 4-D, got "
                             f"{list(b_q.shape)}")
        num_experts, _, ffn, bk = b_q.shape
        check_tensor("b_scales", b_scales, dtypes=(sd,),
                     shape=[num_experts, 2, ffn // br, bk // g],
                     shape_text=f"[E, 2, F/{br}, K/{g}] ({kind}, {layout.name} scales of w13)")
        b_q = b_q.view(num_experts, 2 * ffn, bk)
        b_scales = b_scales.view(num_experts, 2 * ffn // br, bk // g)
    else:
        check_tensor("b_q", b_q, dtypes=(torch.float8_e4m3fn,), ndim=3,
                     shape_text="[E, N, K]" + (" or [E, 2, F, K]" if swiglu else ""))
    num_experts, n, bk = b_q.shape
    if bk != k:
        raise ValueError(f"b_q must have K = {k} (a_q.shape[1]) as its last dimension, got "
                         f"shape {list(b_q.shape)}")
    if num_experts < 1:
        raise ValueError(f"b_q must hold at least one expert (E >= 1), got shape "
                         f"{list(b_q.shape)}")
    _multiple_of("N", n, br, f"b_q.shape[1]: {br} x {g} weight scale blocks")
    if swiglu and n % (2 * br):
        raise ValueError(f"N ({n}, b_q.shape[1]) must be 2F with F a multiple of {br} when "
                         f"swiglu is set (gate and up halves of whole {br}-row scale blocks)")
    check_tensor("b_scales", b_scales, dtypes=(sd,), shape=[num_experts, n // br, k // g],
                 shape_text=f"[E, N/{br}, K/{g}] ({kind}, {layout.name}: the forward "
                            "orientation)")
    check_offsets(padded_offsets, row_offsets, num_experts)
    out_n = n // 2 if swiglu else n
    if scatter_ptrs is None:
        check_tensor("out", out, dtypes=(torch.bfloat16,), shape=[rows, out_n],
                     shape_text="[R, F = N/2] (swiglu)" if swiglu else "[R, N]")
        dest = {"out": out}
    else:
        if out is not None:
            raise ValueError("out must be None when scatter_ptrs is given (the rows go to "
                             "their addresses), got a tensor")
        check_tensor("scatter_ptrs", scatter_ptrs, dtypes=(torch.int64,), ndim=1,
                     shape_text="[R_cap] (a byte address per padded row, 0: not stored)")
        dest = {"scatter_ptrs": scatter_ptrs}
    check_devices({"a_q": a_q, "a_scales": a_scales, "b_q": b_q, "b_scales": b_scales,
                   "padded_offsets": padded_offsets, "row_offsets": row_offsets, **dest},
                  for_kernel=for_kernel)
    return b_q, b_scales, rows, k, num_experts, n


def check_mxfp8_grouped_mm_args(a_q, a_scales, b_q, b_scales, padded_offsets, row_offsets, out,
                                *, swiglu, for_kernel=True):
    """:func:`check_scaled_grouped_mm_args` for exact MXFP8 operands."""
    return check_scaled_grouped_mm_args(a_q, a_scales, b_q, b_scales, padded_offsets,
                                        row_offsets, out, swiglu=swiglu, layout=MXFP8,
                                        for_kernel=for_kernel)


def _layout_of_k_group(k_group: object) -> ScaleLayout:
    if isinstance(k_group, bool) or k_group not in (32, 128):
        raise ValueError(f"k_group ({k_group!r}) must be 32 (MXFP8 as quantised) or 128 "
                         "(rebased onto 128-wide K groups by distmoe.quant.mxfp8_rebase)")
    return MXFP8 if k_group == 32 else MXFP8_REBASED


def scaled_grouped_mm(a_q, a_scales, b_q, b_scales, padded_offsets, row_offsets, out, *,
                      layout: ScaleLayout, swiglu: bool = False,
                      config: ScaledGemmConfig | None = None,
                      scatter_ptrs: torch.Tensor | None = None) -> torch.Tensor | None:
    """The block-scaled grouped GEMM for operands of ``layout`` (:data:`MXFP8`,
    :data:`MXFP8_REBASED`, :data:`FP8_BLOCK`): see :func:`mxfp8_grouped_mm` and
    :func:`fp8_block_grouped_mm` for the contract.

    ``scatter_ptrs`` (int64 ``[R_cap]``, with ``out=None``): instead of activation row ``a``
    of ``out``, each live row goes to the byte address ``scatter_ptrs[r]`` of its padded row
    ``r`` (a bf16 row of the output width; 0: not stored), as
    :func:`~distmoe.kernels.movement.scatter_rows.scatter_rows` would move it: the W2
    epilogue writes straight into the owners' combine rows. ``R_cap`` covers the padded rows
    (``padded_offsets[E] <= R_cap``, a device value: not checked)."""
    b_q, b_scales, rows, k, num_experts, n = check_scaled_grouped_mm_args(
        a_q, a_scales, b_q, b_scales, padded_offsets, row_offsets, out, swiglu=swiglu,
        layout=layout, scatter_ptrs=scatter_ptrs)
    if config is None:
        config = ScaledGemmConfig.for_widths(k=k, n=n, swiglu=swiglu, k_group=layout.k_group)
    elif not isinstance(config, ScaledGemmConfig):
        raise TypeError(f"config must be a ScaledGemmConfig, got {type(config).__name__}")
    if config.block_k < layout.k_group:
        raise ValueError(f"config.block_k ({config.block_k}) must be at least the K group of "
                         f"the scales ({layout.k_group}, {layout.name})")
    if config.swap_ab or not config.interleave_k:
        raise ValueError("config.swap_ab and config.interleave_k=False are for the FP4-weight "
                         "GEMMs (distmoe.kernels.scaled.nvfp4); the FP8 GEMMs take the "
                         "defaults")
    if rows == 0:
        return out
    if config.gluon:
        reason = scaled_gluon.gluon_scaled_reason(
            a_q.device, k=k, n=n, swiglu=swiglu, k_group=layout.k_group, block_m=config.block_m,
            block_n=config.block_n, block_k=config.block_k, stages=config.num_stages,
            warps=config.num_warps)
        if reason is None:
            scaled_gluon.launch_gluon_scaled(
                a_q, a_scales, b_q, b_scales, padded_offsets, row_offsets, out, swiglu=swiglu,
                b_rows=layout.b_rows, scale_fp32=layout.fp32, stages=config.num_stages,
                group_m=config.group_m, scatter_ptrs=scatter_ptrs)
            return out
        warn_gluon_fallback("scaled_grouped_mm", reason)
    grid, num_pid_m, kwargs = config.launch(rows=rows, k=k, n=n, num_experts=num_experts,
                                            swiglu=swiglu)
    with device_context(a_q.device):
        _mxfp8_grouped_mm_kernel[grid](
            a_q, a_scales, b_q, b_scales, padded_offsets, row_offsets,
            scatter_ptrs if out is None else out,
            padded_offsets if scatter_ptrs is None else scatter_ptrs, num_pid_m,
            SCATTER=scatter_ptrs is not None,
            EVEN_N=kwargs["OUT_N"] % config.block_n == 0,
            INTERPRET=interpreter_active(),
            K_GROUP=layout.k_group,
            SB_ROWS=layout.b_rows,
            SCALE_FP32=layout.fp32,
            **kwargs,
        )
    return out


def mxfp8_grouped_mm(
    a_q: torch.Tensor,
    a_scales: torch.Tensor,
    b_q: torch.Tensor,
    b_scales: torch.Tensor,
    padded_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    out: torch.Tensor,
    *,
    swiglu: bool = False,
    config: ScaledGemmConfig | None = None,
    k_group: int = 32,
    scatter_ptrs: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Per expert ``e``: ``out[rows of e] = dequant(a_q) @ dequant(b_q[e])^T`` on MXFP8 operands
    (or its SwiGLU), FP8 tensor-core dots per ``k_group``-wide K step promoted with both
    scales into fp32: exact arithmetic on the operands as given, up to the fp32 summation
    order (module docstring).

    Args:
        a_q: float8_e4m3fn ``[R, K]``, activation rows in expert-major order (expert ``e``
            owns rows ``[row_offsets[e], row_offsets[e+1])``); K a multiple of ``k_group``.
            ``R`` is the row capacity: it sizes the grid.
        a_scales: uint8 E8M0 ``[R, K/k_group]`` (``mxfp8_quantize(x, dim=-1)``'s scales, or
            :func:`~distmoe.quant.mxfp8_rebase`'s with ``k_group=128``).
        b_q: float8_e4m3fn ``[E, N, K]`` (``mxfp8_quantize_weight(w).qdata``, N a multiple of
            32); with ``swiglu``, N = 2F in w13's order (gate rows, then up rows), also
            accepted as w13's ``[E, 2, F, K]``.
        b_scales: uint8 E8M0 ``[E, N/32, K/k_group]`` (or ``[E, 2, F/32, K/k_group]``): the
            32-row block scales in the forward orientation (``MXFP8Weight.scales``, or
            rebased).
        padded_offsets: int32 ``[E + 1]`` on the device: the padded row tiles of each expert
            (segments multiples of ``config.block_m``).
        row_offsets: int32 ``[E + 1]`` on the device: exclusive prefix sum of live rows per
            expert, ``row_offsets[E] <= R``.
        out: bf16 ``[R, N]``, or ``[R, F]`` with ``swiglu``; receives the live rows
            ``[0, row_offsets[E])``; every other row is left untouched.
        swiglu: ``out = silu(gate) * up`` from the two fp32 accumulators, rounded once.
        config: launch configuration; default :meth:`ScaledGemmConfig.for_widths`.
        k_group: values per scale along K: 32 (MXFP8 as quantised: one promotion per 32) or
            128 (operands rebased onto 128-wide groups: one promotion per 128, so four FP8
            MMAs run back to back between promotions).
        scatter_ptrs: int64 ``[R_cap]`` with ``out=None``: each live row stored at its padded
            row's byte address instead (0: not stored; :func:`scaled_grouped_mm`).

    Returns ``out``. No host synchronisation; nothing allocated.
    """
    return scaled_grouped_mm(a_q, a_scales, b_q, b_scales, padded_offsets, row_offsets, out,
                             layout=_layout_of_k_group(k_group), swiglu=swiglu, config=config,
                             scatter_ptrs=scatter_ptrs)


def fp8_block_grouped_mm(
    a_q: torch.Tensor,
    a_scales: torch.Tensor,
    b_q: torch.Tensor,
    b_scales: torch.Tensor,
    padded_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    out: torch.Tensor,
    *,
    swiglu: bool = False,
    config: ScaledGemmConfig | None = None,
    scatter_ptrs: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """:func:`mxfp8_grouped_mm` on DeepSeek-V3-style block-FP8 operands
    (:func:`~distmoe.quant.fp8_block_quantize`): ``a_scales`` float32 ``[R, K/128]`` (one per
    1 x 128 activation block), ``b_scales`` float32 ``[E, N/128, K/128]`` (one per 128 x 128
    weight block; ``[E, 2, F/128, K/128]`` with w13's 4-D layout), values multiplied by their
    scale on dequantisation (a checkpoint's ``weight_scale_inv``). K and N multiples of 128
    (F with SwiGLU). One promotion per 128-wide K step: ``acc += P_s * sa * sb`` in fp32
    (``sa * sb`` rounded once, unlike the power-of-two MXFP8 scales)."""
    return scaled_grouped_mm(a_q, a_scales, b_q, b_scales, padded_offsets, row_offsets, out,
                             layout=FP8_BLOCK, swiglu=swiglu, config=config,
                             scatter_ptrs=scatter_ptrs)


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------


def _dequantize(q: torch.Tensor, scales: torch.Tensor, layout: ScaleLayout,
                rows_per_scale: int) -> torch.Tensor:
    """float64 values of E4M3 ``q [..., rows, K]`` with ``scales [..., rows / rows_per_scale,
    K / k_group]`` of ``layout`` (exact: E4M3 values and scales are float64 values; NaN codes
    and the E8M0 NaN byte give NaN)."""
    s = scales.float() if layout.fp32 else e8m0_to_float(scales)
    s = s.repeat_interleave(rows_per_scale, dim=-2).repeat_interleave(layout.k_group, dim=-1)
    return q.double() * s.double()


def scaled_grouped_mm_ref(
    a_q: torch.Tensor,
    a_scales: torch.Tensor,
    b_q: torch.Tensor,
    b_scales: torch.Tensor,
    padded_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    out: torch.Tensor,
    *,
    layout: ScaleLayout = MXFP8,
    swiglu: bool = False,
    block_m: int = 128,
) -> torch.Tensor:
    """Plain-PyTorch :func:`scaled_grouped_mm` (any device; synchronises; for tests).

    Same arguments and contract (``block_m``: the padding multiple, checked on the host with
    both tables). Both operands dequantised exactly (float64), one float64 matmul per expert,
    rounded to fp32 (the kernel's accumulator type); SwiGLU in fp32; one rounding to bf16.
    Only the live rows are written.
    """
    b_q, b_scales, rows, k, num_experts, n = check_scaled_grouped_mm_args(
        a_q, a_scales, b_q, b_scales, padded_offsets, row_offsets, out, swiglu=swiglu,
        layout=layout, for_kernel=False)
    check_padded_offsets_host(padded_offsets, block_m=block_m,
                              r_cap=int(padded_offsets[-1].item()))
    check_row_offsets_host(padded_offsets, row_offsets, r_act=rows)
    a = _dequantize(a_q, a_scales, layout, 1)
    b = _dequantize(b_q, b_scales, layout, layout.b_rows)
    out_n = n // 2 if swiglu else n
    for e, (_, act_start, count) in enumerate(activation_segments(padded_offsets, row_offsets)):
        if count == 0:
            continue
        acc = (a[act_start:act_start + count] @ b[e].T).float()
        if swiglu:
            acc = torch.nn.functional.silu(acc[:, :out_n]) * acc[:, out_n:]
        out[act_start:act_start + count] = acc.to(torch.bfloat16)
    return out


def mxfp8_grouped_mm_ref(a_q, a_scales, b_q, b_scales, padded_offsets, row_offsets, out, *,
                         swiglu: bool = False, block_m: int = 128,
                         k_group: int = 32) -> torch.Tensor:
    """Plain-PyTorch :func:`mxfp8_grouped_mm` (:func:`scaled_grouped_mm_ref`)."""
    return scaled_grouped_mm_ref(a_q, a_scales, b_q, b_scales, padded_offsets, row_offsets,
                                 out, layout=_layout_of_k_group(k_group), swiglu=swiglu,
                                 block_m=block_m)


def fp8_block_grouped_mm_ref(a_q, a_scales, b_q, b_scales, padded_offsets, row_offsets, out,
                             *, swiglu: bool = False, block_m: int = 128) -> torch.Tensor:
    """Plain-PyTorch :func:`fp8_block_grouped_mm` (:func:`scaled_grouped_mm_ref`)."""
    return scaled_grouped_mm_ref(a_q, a_scales, b_q, b_scales, padded_offsets, row_offsets,
                                 out, layout=FP8_BLOCK, swiglu=swiglu, block_m=block_m)
