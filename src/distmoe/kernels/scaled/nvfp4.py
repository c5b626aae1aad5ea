"""Grouped GEMM over experts with NVFP4 weights and bf16 activations (weight-only; Triton),
optionally with SwiGLU; and the same weights on FP8 operands (:func:`nvfp4_weight_fp8_mm`).

Weights come from :func:`~distmoe.quant.prepare_weights` (``precision="nvfp4"``): per expert
``e``, E2M1 codes packed two per byte along K (``b_packed [E, N, K/2]``, the element of even
index in the low nibble, as :func:`~distmoe.quant.nvfp4_quantize`), one E4M3 block scale per
16 values along K (``b_block_scales [E, N, K/16]``) and one float32 global scale per expert
matrix (``b_global [E]``). Activation rows stay bf16. Rows are in compact expert-major
*activation* order, scheduled in *padded* row tiles exactly as in
:func:`~distmoe.kernels.scaled.triton.mxfp8_grouped_mm` (same tables, same grid). For every live
row ``a`` of expert ``e`` and output column ``n``::

    w[n, k]   = v[e, n, k] * s_b[e, n, k // 16]          (E2M1 value times E4M3 scale, in bf16)
    acc[a, n] = sum_k a[a, k] * w[n, k]                  (bf16 tensor-core dots, fp32 accumulator)
    out[a, n] = bf16(acc[a, n] * s_g[e])                                        (swiglu=False)
    out[a, f] = bf16(silu(g) * u), g = acc[a, f] * s_g[e], u = acc[a, F + f] * s_g[e]
                                                          (swiglu=True: fp32 epilogue, one rounding)

Arithmetic: the prologue's ``v * s_b`` is exact in bf16. An E2M1 value (0.5 to 6) has at
most 2 significant bits and an E4M3 scale at most 4 (normal: 1 implicit + 3 fraction bits;
subnormal ``m * 2^-9``, m < 8: at most 3), so the product has at most 6 <= 8 (bf16's
significand); its magnitude lies in [2^-10, 6 * 448 = 2688] (smallest nonzero 0.5 * 2^-9),
inside bf16's normal range [2^-126, 2^127]: no rounding, no overflow, no subnormal. A bf16 x
bf16 product (8 + 6 significant bits) is exact in fp32, so the dots are exact up to the fp32
summation order, and multiplying by the global scale is one fp32 rounding. Against the exact
sum over the dequantised operands, ``S = sum_k |a_k w_k|``, ``u = 2^-24``::

    |acc * s_g - exact * s_g| <= ((K - 1) u S + u |acc|) * s_g       (first order)

then one bf16 rounding (2^-8 relative) of the result or of the fp32 SwiGLU (a few fp32
roundings; silu(g) flushes to 0 for g < -87, an absolute error below 2^-118 |u|). On SM90 the
bf16 WGMMA accumulates in fp32 (no narrower internal accumulation is documented for 16-bit
operands; the gpu tests allow a margin). Edge cases: a NaN block scale (``0x7F``, from a
non-finite weight) makes the 16 values it scales NaN, hence every output row of that
column; a NaN or Inf activation makes its row NaN; ``acc * s_g`` below fp32's normal range
is a subnormal (no flush on the GPU's ``mul.f32``) or 0.

Hopper has no FP4 tensor cores: the gain of this kernel is the bytes it streams (0.5 + 1/16
bytes per weight value instead of 2), which bounds decode; the tensor-core work is bf16's.
Correct first (issue 59): the E2M1 decode runs on CUDA cores per K tile and per output tile
(each block scale decoded once, each code through fp16 bits: a few integer operations), with
no attempt yet to hide it behind the MMAs. Two more tile forms share the kernel entry and
its epilogue: transposed tiles (``config.swap_ab``: the decoded weights as the MMA's
register operand, a few token rows as its N side, for decode) and FP8 operands
(:func:`nvfp4_weight_fp8_mm`: the weights expanded to E4M3 beside 1 x 128 FP8 rows).

CPU: under Triton's interpreter the kernel decodes E4M3 scale bytes itself, by bits (the
interpreter decodes the E4M3 NaN codes as +-480); it always does, so GPU and CPU run the same
decode. A weight tile is loaded K-major and its low and high nibbles (the values at even and
odd K) decoded into two tiles, interleaved in registers back into K order
(``config.interleave_k``, the default: ``join`` then ``reshape``; it lowers for Hopper MMA
with Triton 3.6) for one dot over the activation tile as it lies in memory; with
``interleave_k=False`` each parity tile is a dot operand with the activation's even or odd
columns (two dots per K tile, the activation loaded with stride 2). Either way a sum over K
in some order.

Algorithm: one program per ``block_m x block_n`` output tile on a 1-D grid sized from ``R``
(``a.shape[0]``) and N, never from routed counts (``cdiv(R, block_m) + E - 1`` row tiles by
``cdiv(N_out, block_n)`` column tiles, group-M order); a program walks its row tiles below
``padded_offsets[E]``; a tile's expert, activation rows and live row count come from the two
tables on the device. Per K tile (``block_k`` values, a multiple of 16 wide) it loads the
``block_m x block_k`` bf16 rows, the ``block_n x block_k / 2`` packed bytes and the matching
block scales (as 4-byte words where whole words tile the K step; gate and up with SwiGLU),
decodes, and takes one bf16 dot (two with ``interleave_k=False``). With ``interleave_k``
every load of the loop is contiguous and staged asynchronously by the pipeliner (sm_90a
TTGIR); the strided activation loads and byte-wide scale loads were not, so each K step
waited on them.

Memory: nothing is allocated. Sync points: none on the host.

Requirements: K a positive multiple of 16 (whole scale blocks), N >= 1 (N = 2F, F >= 1 with
SwiGLU); the padded segments multiples of ``config.block_m``; ``row_offsets[0] = 0``,
``0 <= n_e <=`` the expert's padded segment length and ``row_offsets[E] <= R`` (device
values: not checked by the kernel; the reference checks them).
"""

from __future__ import annotations

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
from distmoe.kernels.base.device import device_context
from distmoe.kernels.base.interpreter import interpreter_active
from distmoe.kernels.base.rows import activation_segments
from distmoe.kernels.base.tiles import swizzle_tile, tile_activation_rows, tile_expert
from distmoe.kernels.scaled.config import ScaledGemmConfig
from distmoe.quant.formats import (
    e4m3_byte_to_fp32,
    e8m0_to_fp32,
    finite_abs_bits,
    float32_bits,
    round_e4m3,
)
from distmoe.quant.mxfp4 import MXFP4_BLOCK, mxfp4_dequantize
from distmoe.quant.nvfp4 import nvfp4_dequantize

#: values per NVFP4 block scale along K
NVFP4_BLOCK = 16
#: values of K per activation scale and per weight shift of the FP8-operand kernel
#: (:func:`nvfp4_weight_fp8_mm`): one promotion per 128-wide K group, block FP8's activations
FP8_GROUP = 128

# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _e2m1_to_fp32(nib):
    """fp32 value of E2M1 nibbles (int32, ``sign << 3 | code``), exact: code ``2 e + m`` is
    ``m / 2`` for e = 0, else ``2^(e - 1) (1 + m / 2)``."""
    e = (nib >> 1) & 3
    m = nib & 1
    bits = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
    bits = bits | ((nib & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e2m1_pairs_to_bf16(byte, scale):
    """``(even, odd)``: the bf16 values ``v * scale`` of the low and high E2M1 nibbles of
    packed bytes (int32), exact for an E4M3 or E8M0 ``scale`` (fp32, broadcast to ``byte``)."""
    even = (_e2m1_to_fp32(byte & 15) * scale).to(tl.bfloat16)
    odd = (_e2m1_to_fp32(byte >> 4) * scale).to(tl.bfloat16)
    return even, odd


@triton.jit
def _e2m1_times_2_14(nib):
    """fp32 ``v * 2^-14`` of E2M1 nibbles (int32, ``sign << 3 | code``), exact, in five
    integer operations and one conversion: the code's three bits placed as an fp16's exponent
    and fraction (``2^(e - 15) (1 + m / 2)``, or the subnormal ``m * 2^-15`` for e = 0) are
    the value times 2^-14."""
    bits = ((nib & 7) << 9) | ((nib & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _fp4_pairs(byte, scale, E8M0: tl.constexpr):
    """``(even, odd)`` bf16 ``v * s_b`` of packed bytes (int32) with their block scale
    ``scale`` (fp32, broadcast to ``byte``; NVFP4: ``s_b * 2^14`` as
    :func:`_block_scale_tile` gives it, MXFP4: ``s_b``), exact."""
    if E8M0:
        return e2m1_pairs_to_bf16(byte, scale)
    even = (_e2m1_times_2_14(byte & 15) * scale).to(tl.bfloat16)
    odd = (_e2m1_times_2_14(byte >> 4) * scale).to(tl.bfloat16)
    return even, odd


@triton.jit
def _block_scale_tile(scale_rows, kb, col_ok, K: tl.constexpr, BLOCK_K: tl.constexpr,
                      EVEN_K: tl.constexpr, SCALE_GROUP: tl.constexpr, E8M0: tl.constexpr,
                      ROW_MAJOR: tl.constexpr):
    """The block scales of K tile ``kb`` decoded once per block and repeated over the
    block's packed bytes: ``[block_n, BLOCK_K / 2]`` (``ROW_MAJOR``) or ``[BLOCK_K / 2,
    block_n]`` fp32, byte ``j`` of the tile taking block ``j // (SCALE_GROUP / 2)``'s scale
    (NVFP4: ``s_b * 2^14``, exact, for :func:`_fp4_pairs`). Masked columns and blocks past K
    read 0."""
    HALF: tl.constexpr = BLOCK_K // 2
    PER: tl.constexpr = SCALE_GROUP // 2  # packed bytes per block scale
    NB: tl.constexpr = HALF // PER
    # whole 4-byte words of scales per row and tile (every row 4-byte aligned): one int32
    # load per four scales, which the pipeliner stages asynchronously (byte loads it did not)
    WORDS: tl.constexpr = EVEN_K and NB % 4 == 0 and (K // SCALE_GROUP) % 4 == 0
    if WORDS:
        NW: tl.constexpr = NB // 4
        w = kb * NW + tl.arange(0, NW)
        shift = 8 * tl.arange(0, 4)
        words = scale_rows.to(tl.pointer_type(tl.int32))
        if ROW_MAJOR:
            sw = tl.load(words[:, None] + w[None, :], mask=col_ok[:, None], other=0)
            sb = tl.reshape((sw[:, :, None] >> shift[None, None, :]) & 0xFF,
                            (sw.shape[0], NB))
        else:
            sw = tl.load(words[None, :] + w[:, None], mask=col_ok[None, :], other=0)
            sb = tl.reshape((sw[:, None, :] >> shift[None, :, None]) & 0xFF,
                            (NB, sw.shape[1]))
    else:
        b = kb * NB + tl.arange(0, NB)
        if ROW_MAJOR:
            ok = col_ok[:, None]
            if not EVEN_K:
                ok = ok & (b < K // SCALE_GROUP)[None, :]
            sb = tl.load(scale_rows[:, None] + b[None, :], mask=ok, other=0).to(tl.int32)
        else:
            ok = col_ok[None, :]
            if not EVEN_K:
                ok = ok & (b < K // SCALE_GROUP)[:, None]
            sb = tl.load(scale_rows[None, :] + b[:, None], mask=ok, other=0).to(tl.int32)
    if E8M0:
        sc = e8m0_to_fp32(sb)
    else:
        sc = e4m3_byte_to_fp32(sb) * 16384.0
    if ROW_MAJOR:
        n: tl.constexpr = sc.shape[0]
        return tl.reshape(tl.broadcast_to(sc[:, :, None], (n, NB, PER)), (n, HALF))
    else:
        n: tl.constexpr = sc.shape[1]
        return tl.reshape(tl.broadcast_to(sc[:, None, :], (NB, PER, n)), (HALF, n))


@triton.jit
def _load_weight_tile(packed_rows, scale_rows, kb, col_ok, K: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                      SCALE_GROUP: tl.constexpr, E8M0: tl.constexpr):
    """The bf16 values ``v * s_b`` of weight rows ``[block_n]`` at K tile ``kb``, transposed
    and split by parity: ``(even, odd)``, each ``[BLOCK_K / 2, block_n]``, row j holding the
    values at K = 2 j and 2 j + 1 of the tile (the low and high nibbles of byte j; exact).
    Masked rows and K past the end read 0. (Loaded K-major: each is a dot operand as it
    stands, or the two interleave into one, :func:`_k_major_interleaved`.)"""
    HALF: tl.constexpr = BLOCK_K // 2
    j = kb * HALF + tl.arange(0, HALF)  # byte index along K: values 2 j, 2 j + 1
    if EVEN_K:
        ok = col_ok[None, :]
    else:
        ok = col_ok[None, :] & (j < K // 2)[:, None]
    byte = tl.load(packed_rows[None, :] + j[:, None], mask=ok, other=0).to(tl.int32)
    scale = _block_scale_tile(scale_rows, kb, col_ok, K, BLOCK_K, EVEN_K, SCALE_GROUP, E8M0,
                              False)
    return _fp4_pairs(byte, scale, E8M0)


@triton.jit
def _fp4_store(acc_g, acc_u, gs_ptr, rs_ptr, expert, rows, is_live, cols, is_col, out_ptr,
               OUT_N: tl.constexpr, SWIGLU: tl.constexpr, HAS_GLOBAL: tl.constexpr,
               HAS_ROW_SCALE: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The FP4-weight GEMMs' epilogue: the expert's global scale (times each row's own
    scale, one fp32 product) on the fp32 accumulators ``[rows, cols]`` (``TRANSPOSED``:
    ``[cols, rows]``), SwiGLU in fp32, one bf16 rounding, the live rows stored at their
    activation rows."""
    if HAS_GLOBAL:
        s_g = tl.load(gs_ptr + expert)
    else:
        s_g = 1.0
    if HAS_ROW_SCALE:  # the activations' global scale per row, times the weights'
        s_row = s_g * tl.load(rs_ptr + rows, mask=is_live, other=0.0)
        if TRANSPOSED:
            s_g = s_row[None, :]
        else:
            s_g = s_row[:, None]
    if SWIGLU:
        g = acc_g * s_g
        val = g * tl.sigmoid(g) * (acc_u * s_g)
    else:
        val = acc_g * s_g
    out_rows = out_ptr + rows * OUT_N
    if TRANSPOSED:
        tl.store(out_rows[None, :] + cols[:, None], val.to(tl.bfloat16),
                 mask=is_live[None, :] & is_col[:, None])
    else:
        tl.store(out_rows[:, None] + cols[None, :], val.to(tl.bfloat16),
                 mask=is_live[:, None] & is_col[None, :])


@triton.jit
def _fp4_tile_operands(a_ptr, b_ptr, sb_ptr, expert, act_start, num_live, pid_n,
                       K: tl.constexpr, N: tl.constexpr, OUT_N: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       SCALE_GROUP: tl.constexpr):
    """The row and column operands every FP4-weight tile starts from: ``(rows, is_live,
    a_rows, cols, is_col, g_rows, g_srows, u_rows, u_srows)`` -- the tile's int64 activation
    rows and their live mask, the activation row pointers (``a_ptr``'s element type, K per
    row), the output columns and their mask, and the packed-byte and block-scale row
    pointers of the gate (or only) weight rows and of the up rows ``OUT_N`` further (used
    with SwiGLU only)."""
    KB: tl.constexpr = K // 2  # bytes of a packed weight row
    KS: tl.constexpr = K // SCALE_GROUP  # block scales of a weight row
    idx = tl.arange(0, BLOCK_M)
    is_live = idx < num_live
    rows = act_start + idx  # int64 activation rows
    a_rows = a_ptr + rows * K
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    is_col = cols < OUT_N
    e64 = expert.to(tl.int64)
    g_rows = b_ptr + e64 * (N * KB) + cols * KB
    g_srows = sb_ptr + e64 * (N * KS) + cols * KS
    return (rows, is_live, a_rows, cols, is_col, g_rows, g_srows, g_rows + OUT_N * KB,
            g_srows + OUT_N * KS)


@triton.jit
def _step_columns(STEP_K: tl.constexpr, INTERLEAVE_K: tl.constexpr):
    """The activation columns a K step of ``STEP_K`` values loads, from the step's start:
    all of them in K order (``INTERLEAVE_K``: the decoded weights interleaved to match), or
    the even ones (the odd ones are these plus 1), matching the weights' parity tiles."""
    if INTERLEAVE_K:
        return tl.arange(0, STEP_K)
    else:
        return 2 * tl.arange(0, STEP_K // 2)


@triton.jit
def _k_major_interleaved(even, odd):
    """``[2 H, n]`` from the ``[H, n]`` tiles of the values at even and odd K (row ``2 j + p``
    holding row ``j`` of the parity ``p`` tile): the decoded weights in K order, one dot
    operand instead of two."""
    H: tl.constexpr = even.shape[0]
    n: tl.constexpr = even.shape[1]
    return tl.reshape(tl.permute(tl.join(even, odd), (0, 2, 1)), (2 * H, n))


@triton.jit
def _row_major_interleaved(even, odd):
    """``[n, 2 H]`` from ``[n, H]`` tiles of the values at even and odd K: in K order."""
    H: tl.constexpr = even.shape[1]
    n: tl.constexpr = even.shape[0]
    return tl.reshape(tl.join(even, odd), (n, 2 * H))


@triton.jit
def _nvfp4_tile(
    a_ptr,
    b_ptr,
    sb_ptr,
    gs_ptr,
    rs_ptr,
    padded_offsets_ptr,
    row_offsets_ptr,
    out_ptr,
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
    SWIGLU: tl.constexpr,
    SCALE_GROUP: tl.constexpr,
    E8M0: tl.constexpr,
    HAS_GLOBAL: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
    INTERLEAVE_K: tl.constexpr,
):
    """One ``BLOCK_M x BLOCK_N`` output tile of the padded row tile at ``row_start``."""
    NUM_KB: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    expert = tile_expert(padded_offsets_ptr, row_start, NUM_EXPERTS, EXPERTS_POW2)
    act_start, num_live = tile_activation_rows(
        padded_offsets_ptr, row_offsets_ptr, expert, row_start
    )
    # Live rows come first in a segment: a tile starting at a padding row has none.
    if num_live > 0:
        rows, is_live, a_rows, cols, is_col, g_rows, g_srows, u_rows, u_srows = \
            _fp4_tile_operands(a_ptr, b_ptr, sb_ptr, expert, act_start, num_live, pid_n, K, N,
                               OUT_N, BLOCK_M, BLOCK_N, SCALE_GROUP)
        offs_k = _step_columns(BLOCK_K, INTERLEAVE_K)

        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, NUM_KB):
            kk = kb * BLOCK_K + offs_k
            if EVEN_K:
                a_ok = is_live[:, None]
            else:
                a_ok = is_live[:, None] & (kk < K)[None, :]  # K even: 2 j + 1 < K iff 2 j < K
            # masked rows and K read zeros: their terms are 0 and reach no stored element
            w_even, w_odd = _load_weight_tile(g_rows, g_srows, kb, is_col, K, BLOCK_N, BLOCK_K,
                                              EVEN_K, SCALE_GROUP, E8M0)
            if SWIGLU:
                u_even, u_odd = _load_weight_tile(u_rows, u_srows, kb, is_col, K, BLOCK_N,
                                                  BLOCK_K, EVEN_K, SCALE_GROUP, E8M0)
            if INTERLEAVE_K:
                a = tl.load(a_rows[:, None] + kk[None, :], mask=a_ok, other=0.0)
                acc_g = tl.dot(a, _k_major_interleaved(w_even, w_odd), acc_g)
                if SWIGLU:
                    acc_u = tl.dot(a, _k_major_interleaved(u_even, u_odd), acc_u)
            else:
                a_even = tl.load(a_rows[:, None] + kk[None, :], mask=a_ok, other=0.0)
                a_odd = tl.load(a_rows[:, None] + (kk + 1)[None, :], mask=a_ok, other=0.0)
                acc_g = tl.dot(a_even, w_even, acc_g)
                acc_g = tl.dot(a_odd, w_odd, acc_g)
                if SWIGLU:
                    acc_u = tl.dot(a_even, u_even, acc_u)
                    acc_u = tl.dot(a_odd, u_odd, acc_u)

        _fp4_store(acc_g, acc_u, gs_ptr, rs_ptr, expert, rows, is_live, cols, is_col, out_ptr,
                   OUT_N, SWIGLU, HAS_GLOBAL, HAS_ROW_SCALE, False)


@triton.jit
def _load_weight_rows(packed_rows, scale_rows, kb, col_ok, K: tl.constexpr,
                      BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SCALE_GROUP: tl.constexpr,
                      E8M0: tl.constexpr):
    """:func:`_load_weight_tile` row-major: ``(even, odd)``, each ``[block_n, BLOCK_K / 2]``
    bf16 (the swapped tile's A operands, contiguous bytes along K per weight row)."""
    HALF: tl.constexpr = BLOCK_K // 2
    j = kb * HALF + tl.arange(0, HALF)
    if EVEN_K:
        ok = col_ok[:, None]
    else:
        ok = col_ok[:, None] & (j < K // 2)[None, :]
    byte = tl.load(packed_rows[:, None] + j[None, :], mask=ok, other=0).to(tl.int32)
    scale = _block_scale_tile(scale_rows, kb, col_ok, K, BLOCK_K, EVEN_K, SCALE_GROUP, E8M0,
                              True)
    return _fp4_pairs(byte, scale, E8M0)


@triton.jit
def _nvfp4_tile_swapped(
    a_ptr,
    b_ptr,
    sb_ptr,
    gs_ptr,
    rs_ptr,
    padded_offsets_ptr,
    row_offsets_ptr,
    out_ptr,
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
    SWIGLU: tl.constexpr,
    SCALE_GROUP: tl.constexpr,
    E8M0: tl.constexpr,
    HAS_GLOBAL: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
    INTERLEAVE_K: tl.constexpr,
):
    """:func:`_nvfp4_tile` transposed (``config.swap_ab``): ``acc [BLOCK_N, BLOCK_M] =
    W_tile x_tile^T``, the decoded weights as the dot's first operand; same sums, same
    epilogue, stored transposed."""
    NUM_KB: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    expert = tile_expert(padded_offsets_ptr, row_start, NUM_EXPERTS, EXPERTS_POW2)
    act_start, num_live = tile_activation_rows(
        padded_offsets_ptr, row_offsets_ptr, expert, row_start
    )
    if num_live > 0:
        rows, is_live, a_rows, cols, is_col, g_rows, g_srows, u_rows, u_srows = \
            _fp4_tile_operands(a_ptr, b_ptr, sb_ptr, expert, act_start, num_live, pid_n, K, N,
                               OUT_N, BLOCK_M, BLOCK_N, SCALE_GROUP)
        offs_k = _step_columns(BLOCK_K, INTERLEAVE_K)

        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for kb in range(0, NUM_KB):
            kk = kb * BLOCK_K + offs_k
            if EVEN_K:
                a_ok = is_live[None, :]
            else:
                a_ok = is_live[None, :] & (kk < K)[:, None]
            w_even, w_odd = _load_weight_rows(g_rows, g_srows, kb, is_col, K, BLOCK_K, EVEN_K,
                                              SCALE_GROUP, E8M0)
            if SWIGLU:
                u_even, u_odd = _load_weight_rows(u_rows, u_srows, kb, is_col, K, BLOCK_K,
                                                  EVEN_K, SCALE_GROUP, E8M0)
            # the activations K-major: [BLOCK_K, BLOCK_M] in K order, or per parity
            if INTERLEAVE_K:
                a = tl.load(a_rows[None, :] + kk[:, None], mask=a_ok, other=0.0)
                acc_g = tl.dot(_row_major_interleaved(w_even, w_odd), a, acc_g)
                if SWIGLU:
                    acc_u = tl.dot(_row_major_interleaved(u_even, u_odd), a, acc_u)
            else:
                a_even = tl.load(a_rows[None, :] + kk[:, None], mask=a_ok, other=0.0)
                a_odd = tl.load(a_rows[None, :] + (kk + 1)[:, None], mask=a_ok, other=0.0)
                acc_g = tl.dot(w_even, a_even, acc_g)
                acc_g = tl.dot(w_odd, a_odd, acc_g)
                if SWIGLU:
                    acc_u = tl.dot(u_even, a_even, acc_u)
                    acc_u = tl.dot(u_odd, a_odd, acc_u)

        _fp4_store(acc_g, acc_u, gs_ptr, rs_ptr, expert, rows, is_live, cols, is_col, out_ptr,
                   OUT_N, SWIGLU, HAS_GLOBAL, HAS_ROW_SCALE, True)


@triton.jit
def _nvfp4_weight_grouped_mm_kernel(
    a_ptr,
    sa_ptr,
    b_ptr,
    sb_ptr,
    gs_ptr,
    rs_ptr,
    padded_offsets_ptr,
    row_offsets_ptr,
    out_ptr,
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
    SWIGLU: tl.constexpr,
    SCALE_GROUP: tl.constexpr = 16,
    E8M0: tl.constexpr = False,
    HAS_GLOBAL: tl.constexpr = True,
    HAS_ROW_SCALE: tl.constexpr = False,
    SWAP_AB: tl.constexpr = False,
    FP8_A: tl.constexpr = False,
    INTERLEAVE_K: tl.constexpr = True,
    INTERPRET: tl.constexpr = False,
):
    """Every FP4-weight grouped GEMM: bf16 activations with the weights expanded to bf16
    (:func:`_nvfp4_tile`, or transposed with ``SWAP_AB``, :func:`_nvfp4_tile_swapped`), or
    FP8 activations (``sa_ptr`` their scales) with the weights expanded to E4M3
    (``FP8_A``, :func:`_fp4_fp8_tile`)."""
    NUM_PID_N: tl.constexpr = (OUT_N + BLOCK_N - 1) // BLOCK_N
    pid_m, pid_n = swizzle_tile(tl.program_id(0), num_pid_m, NUM_PID_N, GROUP_M)
    total_rows = tl.load(padded_offsets_ptr + NUM_EXPERTS)
    # One row tile under minimal padding (the grid's bound); later ones only if the segments
    # were padded further. A while loop (not range) keeps the interpreter working too.
    row_start = pid_m * BLOCK_M
    while row_start < total_rows:
        if FP8_A:
            _fp4_fp8_tile(a_ptr, sa_ptr, b_ptr, sb_ptr, gs_ptr, rs_ptr, padded_offsets_ptr,
                          row_offsets_ptr, out_ptr, row_start, pid_n, NUM_EXPERTS,
                          EXPERTS_POW2, K, N, OUT_N, BLOCK_M, BLOCK_N, BLOCK_K, SWIGLU,
                          SCALE_GROUP, E8M0, HAS_GLOBAL, HAS_ROW_SCALE, INTERLEAVE_K,
                          INTERPRET)
        elif SWAP_AB:
            _nvfp4_tile_swapped(a_ptr, b_ptr, sb_ptr, gs_ptr, rs_ptr, padded_offsets_ptr,
                                row_offsets_ptr, out_ptr, row_start, pid_n, NUM_EXPERTS,
                                EXPERTS_POW2, K, N, OUT_N, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                                SWIGLU, SCALE_GROUP, E8M0, HAS_GLOBAL, HAS_ROW_SCALE,
                                INTERLEAVE_K)
        else:
            _nvfp4_tile(a_ptr, b_ptr, sb_ptr, gs_ptr, rs_ptr, padded_offsets_ptr,
                        row_offsets_ptr, out_ptr, row_start, pid_n, NUM_EXPERTS, EXPERTS_POW2,
                        K, N, OUT_N, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, SWIGLU, SCALE_GROUP,
                        E8M0, HAS_GLOBAL, HAS_ROW_SCALE, INTERLEAVE_K)
        row_start += num_pid_m * BLOCK_M


@triton.jit
def _weight_tile_fp8(packed_rows, scale_rows, kb, col_ok, BLOCK_N: tl.constexpr,
                     FP8_K: tl.constexpr, SCALE_GROUP: tl.constexpr, E8M0: tl.constexpr):
    """The weight rows ``[block_n]`` at K group ``kb`` (``FP8_K`` values) as E4M3 dot operands:
    ``(even, odd, sw)``, ``even`` / ``odd`` ``[FP8_K / 2, block_n]`` float8e4nv holding
    ``RNE_e4m3(v * s_b / sw)`` at K = 2 j and 2 j + 1, ``sw [block_n]`` fp32 the column's
    power of two ``2^(e - 5)``, ``e`` the exponent of the largest block scale of the column in
    the group (module docstring of :func:`nvfp4_weight_fp8_mm`). NaN scales give NaN codes;
    masked columns read 0 and ``sw`` 1."""
    HALF: tl.constexpr = FP8_K // 2
    j = kb * HALF + tl.arange(0, HALF)
    ok = col_ok[None, :]
    byte = tl.load(packed_rows[None, :] + j[:, None], mask=ok, other=0).to(tl.int32)
    sb = tl.load(scale_rows[None, :] + (j // (SCALE_GROUP // 2))[:, None], mask=ok,
                 other=0).to(tl.int32)
    if E8M0:
        scale = e8m0_to_fp32(sb)
        # the largest scale is 2^e (clamped so that 2^(e - 5) stays a normal fp32: scales
        # below 2^-121 only lose more values to E4M3's subnormals)
        e = tl.maximum(tl.max(sb, axis=0) - 127, -121)
        is_nan = sb == 255
    else:
        scale = e4m3_byte_to_fp32(sb)
        top = tl.max(sb & 0x7F, axis=0)  # positive E4M3 bytes order like their values
        e = tl.where(top >= 8, (top >> 3) - 7, -6)  # largest scale in [2^e, 2^(e+1))
        is_nan = (sb & 0x7F) == 0x7F
    # every |v * s_b| < 6 * 2^(e+1), so |v * s_b| * 2^(5 - e) < 384 <= 448: no saturation
    shift = (e - 5)[None, :]
    even = _fp8_code(_e2m1_to_fp32(byte & 15) * scale, shift, is_nan)
    odd = _fp8_code(_e2m1_to_fp32(byte >> 4) * scale, shift, is_nan)
    sw = ((e - 5 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e - 5), e - 5 >= -126
    return even, odd, tl.where(col_ok, sw, 1.0)


@triton.jit
def _fp8_code(val, shift, is_nan):
    """float8e4nv of ``val * 2^-shift`` (fp32 ``val``, exact products of E2M1 values and
    scales), rounded to nearest even by bits (the same code on the GPU and the interpreter);
    NaN where ``is_nan``."""
    bits = float32_bits(val)
    code = round_e4m3(finite_abs_bits(bits), shift)
    code = tl.where(is_nan, 0x7F, code) | ((bits >> 24) & 0x80)
    return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _fp8_dot_kn(a, b, acc, INTERPRET: tl.constexpr):
    """``acc + a [M, G] @ b [G, N]`` of E4M3 tiles in fp32: FP8 tensor-core dots, or under
    the interpreter fp32 dots of the exactly widened values, NaN codes kept NaN."""
    if INTERPRET:
        a_nan = (a.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F
        b_nan = (b.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F
        a32 = tl.where(a_nan, float("nan"), a.to(tl.float32))
        b32 = tl.where(b_nan, float("nan"), b.to(tl.float32))
        return tl.dot(a32, b32, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _fp4_fp8_tile(
    a_ptr,
    sa_ptr,
    b_ptr,
    sb_ptr,
    gs_ptr,
    rs_ptr,
    padded_offsets_ptr,
    row_offsets_ptr,
    out_ptr,
    row_start,
    pid_n,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,
    OUT_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8_K: tl.constexpr,
    SWIGLU: tl.constexpr,
    SCALE_GROUP: tl.constexpr,
    E8M0: tl.constexpr,
    HAS_GLOBAL: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
    INTERLEAVE_K: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One ``BLOCK_M x BLOCK_N`` output tile of :func:`nvfp4_weight_fp8_mm` at ``row_start``."""
    NUM_KG: tl.constexpr = K // FP8_K
    expert = tile_expert(padded_offsets_ptr, row_start, NUM_EXPERTS, EXPERTS_POW2)
    act_start, num_live = tile_activation_rows(
        padded_offsets_ptr, row_offsets_ptr, expert, row_start
    )
    if num_live > 0:
        rows, is_live, a_rows, cols, is_col, g_rows, g_srows, u_rows, u_srows = \
            _fp4_tile_operands(a_ptr, b_ptr, sb_ptr, expert, act_start, num_live, pid_n, K, N,
                               OUT_N, BLOCK_M, BLOCK_N, SCALE_GROUP)
        sa_rows = sa_ptr + rows * NUM_KG
        offs_k = _step_columns(FP8_K, INTERLEAVE_K)

        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kg in range(0, NUM_KG):
            kk = kg * FP8_K + offs_k
            # masked rows read zeros and scale 1: their terms are 0 and are never stored
            sa = tl.load(sa_rows + kg, mask=is_live, other=1.0)
            w_even, w_odd, sw = _weight_tile_fp8(g_rows, g_srows, kg, is_col, BLOCK_N, FP8_K,
                                                 SCALE_GROUP, E8M0)
            if SWIGLU:
                u_even, u_odd, su = _weight_tile_fp8(u_rows, u_srows, kg, is_col, BLOCK_N,
                                                     FP8_K, SCALE_GROUP, E8M0)
            if INTERLEAVE_K:
                a = tl.load(a_rows[:, None] + kk[None, :], mask=is_live[:, None], other=0.0)
                part = _fp8_dot_kn(a, _k_major_interleaved(w_even, w_odd),
                                   tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), INTERPRET)
                acc_g += part * (sa[:, None] * sw[None, :])
                if SWIGLU:
                    part = _fp8_dot_kn(a, _k_major_interleaved(u_even, u_odd),
                                       tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32),
                                       INTERPRET)
                    acc_u += part * (sa[:, None] * su[None, :])
            else:
                a_even = tl.load(a_rows[:, None] + kk[None, :], mask=is_live[:, None],
                                 other=0.0)
                a_odd = tl.load(a_rows[:, None] + (kk + 1)[None, :], mask=is_live[:, None],
                                other=0.0)
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                part = _fp8_dot_kn(a_even, w_even, part, INTERPRET)
                part = _fp8_dot_kn(a_odd, w_odd, part, INTERPRET)
                acc_g += part * (sa[:, None] * sw[None, :])
                if SWIGLU:
                    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    part = _fp8_dot_kn(a_even, u_even, part, INTERPRET)
                    part = _fp8_dot_kn(a_odd, u_odd, part, INTERPRET)
                    acc_u += part * (sa[:, None] * su[None, :])

        _fp4_store(acc_g, acc_u, gs_ptr, rs_ptr, expert, rows, is_live, cols, is_col, out_ptr,
                   OUT_N, SWIGLU, HAS_GLOBAL, HAS_ROW_SCALE, False)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


def check_nvfp4_weight_grouped_mm_args(
    a: object,
    b_packed: object,
    b_block_scales: object,
    b_global: object,
    padded_offsets: object,
    row_offsets: object,
    out: object,
    *,
    swiglu: object,
    for_kernel: bool = True,
    mx: bool = False,
    a_scales: object = False,
) -> tuple[torch.Tensor, torch.Tensor, int, int, int, int]:
    """Validate :func:`nvfp4_weight_grouped_mm`'s arguments (no synchronisation); return the
    weights seen as ``[E, N, K/2]`` uint8 / ``[E, N, K/G]`` uint8 and ``(R, K, E, N)``.
    ``mx``: MXFP4 weights (:func:`mxfp4_weight_grouped_mm`: E8M0 scales per 32, no global
    scale) instead of NVFP4's (E4M3 per 16 and a global scale). ``a_scales`` (anything but
    False): FP8 activations (:func:`nvfp4_weight_fp8_mm`): ``a`` float8_e4m3fn with these
    float32 scales, one per 128 values along K (K a multiple of 128)."""
    if not isinstance(swiglu, bool):
        raise TypeError(f"swiglu must be a bool, got {type(swiglu).__name__}")
    group = MXFP4_BLOCK if mx else NVFP4_BLOCK
    kind = "E8M0, one per 32 values along K" if mx else "E4M3, one per 16 values along K"
    scale_dtypes = (torch.uint8,) if mx else (torch.float8_e4m3fn, torch.uint8)
    fp8_a = a_scales is not False
    check_tensor("a", a, dtypes=(torch.float8_e4m3fn,) if fp8_a else (torch.bfloat16,), ndim=2,
                 shape_text="[R, K]")
    rows, k = a.shape
    if k <= 0 or k % group:
        raise ValueError(f"K ({k}, a.shape[1]) must be a positive multiple of {group} (one "
                         f"{'E8M0' if mx else 'E4M3'} block scale per {group} values)")
    if fp8_a:
        if k % FP8_GROUP:
            raise ValueError(f"K ({k}, a.shape[1]) must be a multiple of {FP8_GROUP} with FP8 "
                             f"activations (one activation scale per {FP8_GROUP} values)")
        check_tensor("a_scales", a_scales, dtypes=(torch.float32,),
                     shape=[rows, k // FP8_GROUP],
                     shape_text=f"[R, K/{FP8_GROUP}] (float32, one per {FP8_GROUP} values)")
    if not isinstance(b_packed, torch.Tensor):
        raise TypeError(f"b_packed must be a torch.Tensor, got {type(b_packed).__name__}")
    if swiglu and b_packed.dim() == 4:
        # w13's own layout [E, 2, F, K/2]: gate rows then up rows, seen as [E, 2F, K/2]
        check_tensor("b_packed", b_packed, dtypes=(torch.uint8,), ndim=4,
                     shape_text="[E, 2, F, K/2] (w13: gate, up)")
        if b_packed.shape[1] != 2:
            raise ValueError(f"b_packed must have shape [E, 2, F, K/2] (w13: gate, up) when "
                             f"4-D, got {list(b_packed.shape)}")
        num_experts, _, ffn, half = b_packed.shape
        check_tensor("b_block_scales", b_block_scales, dtypes=scale_dtypes,
                     shape=[num_experts, 2, ffn, 2 * half // group],
                     shape_text=f"[E, 2, F, K/{group}] ({kind})")
        b_packed = b_packed.view(num_experts, 2 * ffn, half)
        b_block_scales = b_block_scales.view(num_experts, 2 * ffn, 2 * half // group)
    else:
        check_tensor("b_packed", b_packed, dtypes=(torch.uint8,), ndim=3,
                     shape_text="[E, N, K/2]" + (" or [E, 2, F, K/2]" if swiglu else ""))
    num_experts, n, half = b_packed.shape
    if half * 2 != k:
        raise ValueError(f"b_packed must have K/2 = {k // 2} bytes (a.shape[1] = {k} values, "
                         f"two per byte) as its last dimension, got shape "
                         f"{list(b_packed.shape)}")
    if num_experts < 1 or n < 1:
        raise ValueError(f"b_packed must hold at least one expert and one row (E, N >= 1), got "
                         f"shape {list(b_packed.shape)}")
    if swiglu and n % 2:
        raise ValueError(f"N ({n}, b_packed.shape[1]) must be 2F (gate and up rows) when swiglu "
                         "is set")
    check_tensor("b_block_scales", b_block_scales, dtypes=scale_dtypes,
                 shape=[num_experts, n, k // group], shape_text=f"[E, N, K/{group}] ({kind})")
    named = {"a": a, "b_packed": b_packed, "b_block_scales": b_block_scales,
             "padded_offsets": padded_offsets, "row_offsets": row_offsets, "out": out}
    if fp8_a:
        named["a_scales"] = a_scales
    if mx:
        if b_global is not None:
            raise ValueError("b_global must be None for MXFP4 weights (no global scale), got "
                             f"{type(b_global).__name__}")
    else:
        check_tensor("b_global", b_global, dtypes=(torch.float32,), shape=[num_experts],
                     shape_text="[E] (one float32 global scale per expert matrix)")
        named["b_global"] = b_global
    check_offsets(padded_offsets, row_offsets, num_experts)
    out_n = n // 2 if swiglu else n
    check_tensor("out", out, dtypes=(torch.bfloat16,), shape=[rows, out_n],
                 shape_text="[R, F = N/2] (swiglu)" if swiglu else "[R, N]")
    check_devices(named, for_kernel=for_kernel)
    scales = b_block_scales.view(torch.uint8)
    if for_kernel and scales.data_ptr() % 4:
        # the kernels read whole rows of scales as 4-byte words (_block_scale_tile): a view
        # that starts off a word boundary is copied to one that does (the same bytes)
        scales = scales.clone()
    return b_packed, scales, rows, k, num_experts, n


def nvfp4_weight_config(*, k: int, n: int, swiglu: bool = False,
                        block_m: int = 128) -> ScaledGemmConfig:
    """The default launch config: :meth:`ScaledGemmConfig.for_widths` (its FP8 tile shapes;
    untuned for bf16 x decoded-E2M1 tiles, a starting point)."""
    return ScaledGemmConfig.for_widths(k=k, n=n, swiglu=swiglu, block_m=block_m)


def nvfp4_weight_grouped_mm(
    a: torch.Tensor,
    b_packed: torch.Tensor,
    b_block_scales: torch.Tensor,
    b_global: torch.Tensor,
    padded_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    out: torch.Tensor,
    *,
    swiglu: bool = False,
    config: ScaledGemmConfig | None = None,
    a_row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per expert ``e``: ``out[rows of e] = a @ dequant(b[e])^T`` (or its SwiGLU) with NVFP4
    weights decoded to bf16 in the prologue, bf16 tensor-core dots into fp32, the global scale
    in the epilogue, one bf16 rounding (module docstring).

    Args:
        a: bf16 ``[R, K]``, activation rows in expert-major order (expert ``e`` owns rows
            ``[row_offsets[e], row_offsets[e+1])``); K a multiple of 16. ``R`` sizes the grid.
        b_packed: uint8 ``[E, N, K/2]``, two E2M1 codes per byte along K (even element in the
            low nibble); with ``swiglu``, N = 2F in w13's order (gate rows, then up rows), also
            accepted as w13's ``[E, 2, F, K/2]``.
        b_block_scales: float8_e4m3fn (or its uint8 view) ``[E, N, K/16]`` (or
            ``[E, 2, F, K/16]``).
        b_global: float32 ``[E]``: each expert matrix's global (decode) scale.
        padded_offsets: int32 ``[E + 1]`` on the device: the padded row tiles of each expert
            (segments multiples of ``config.block_m``).
        row_offsets: int32 ``[E + 1]`` on the device: exclusive prefix sum of live rows per
            expert, ``row_offsets[E] <= R``.
        out: bf16 ``[R, N]``, or ``[R, F]`` with ``swiglu``; receives the live rows
            ``[0, row_offsets[E])``; every other row is left untouched.
        swiglu: ``out = silu(gate) * up`` from the two scaled fp32 accumulators, rounded once.
        config: launch configuration; default :func:`nvfp4_weight_config`.
        a_row_scale: optional float32 ``[R]``: a factor per activation row (NVFP4 activation
            rows' global scales, :mod:`~distmoe.kernels.scaled.nvfp4_rows`), multiplied into
            the weight's global scale in fp32 before the accumulator is scaled.

    Returns ``out``. No host synchronisation; nothing allocated.
    """
    return _fp4_weight_grouped_mm(a, b_packed, b_block_scales, b_global, padded_offsets,
                                  row_offsets, out, swiglu=swiglu, config=config, mx=False,
                                  a_row_scale=a_row_scale)


def mxfp4_weight_grouped_mm(
    a: torch.Tensor,
    b_packed: torch.Tensor,
    b_scales: torch.Tensor,
    padded_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    out: torch.Tensor,
    *,
    swiglu: bool = False,
    config: ScaledGemmConfig | None = None,
) -> torch.Tensor:
    """:func:`nvfp4_weight_grouped_mm` on MXFP4 weights (:mod:`distmoe.quant.mxfp4`, GPT-OSS's
    format): ``b_packed`` uint8 ``[E, N, K/2]`` (or ``[E, 2, F, K/2]``), ``b_scales`` uint8
    E8M0 ``[E, N, K/32]`` (or ``[E, 2, F, K/32]``), no global scale; K a multiple of 32. The
    prologue's ``v * 2^(s - 127)`` is exact in bf16 (a 2-bit significand times a power of
    two) for scale bytes up to 251; larger ones overflow to Inf. Same grid, tables and
    arithmetic otherwise."""
    return _fp4_weight_grouped_mm(a, b_packed, b_scales, None, padded_offsets, row_offsets,
                                  out, swiglu=swiglu, config=config, mx=True)


def _check_row_scale(a_row_scale: object, a: torch.Tensor) -> None:
    if a_row_scale is not None:
        check_tensor("a_row_scale", a_row_scale, dtypes=(torch.float32,), shape=[a.shape[0]],
                     shape_text="[R] (one factor per activation row)")
        check_devices({"a": a, "a_row_scale": a_row_scale})


def _fp4_weight_grouped_mm(a, b_packed, b_block_scales, b_global, padded_offsets, row_offsets,
                           out, *, swiglu, config, mx, a_row_scale=None):
    b_packed, b_scales, rows, k, num_experts, n = check_nvfp4_weight_grouped_mm_args(
        a, b_packed, b_block_scales, b_global, padded_offsets, row_offsets, out, swiglu=swiglu,
        mx=mx)
    _check_row_scale(a_row_scale, a)
    if config is None:
        config = nvfp4_weight_config(k=k, n=n, swiglu=swiglu)
    elif not isinstance(config, ScaledGemmConfig):
        raise TypeError(f"config must be a ScaledGemmConfig, got {type(config).__name__}")
    if rows == 0:
        return out
    grid, num_pid_m, kwargs = config.launch(rows=rows, k=k, n=n, num_experts=num_experts,
                                            swiglu=swiglu)
    with device_context(a.device):
        _nvfp4_weight_grouped_mm_kernel[grid](
            a, a, b_packed, b_scales, b_scales if b_global is None else b_global,
            b_scales if a_row_scale is None else a_row_scale, padded_offsets, row_offsets, out,
            num_pid_m, SCALE_GROUP=MXFP4_BLOCK if mx else NVFP4_BLOCK, E8M0=mx,
            HAS_GLOBAL=not mx, HAS_ROW_SCALE=a_row_scale is not None,
            SWAP_AB=config.swap_ab, INTERLEAVE_K=config.interleave_k, **kwargs,
        )
    return out


def fp4_weight_fp8_config(*, k: int, n: int, swiglu: bool = False,
                          block_m: int = 128) -> ScaledGemmConfig:
    """The default launch config of :func:`nvfp4_weight_fp8_mm`: :meth:`ScaledGemmConfig.
    for_widths` at 128-wide K groups (``block_k`` 128, one promotion per group; a starting
    point, untuned)."""
    return ScaledGemmConfig.for_widths(k=k, n=n, swiglu=swiglu, block_m=block_m,
                                       k_group=FP8_GROUP)


def nvfp4_weight_fp8_mm(
    a_q: torch.Tensor,
    a_scales: torch.Tensor,
    b_packed: torch.Tensor,
    b_block_scales: torch.Tensor,
    b_global: torch.Tensor | None,
    padded_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    out: torch.Tensor,
    *,
    swiglu: bool = False,
    config: ScaledGemmConfig | None = None,
    a_row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`nvfp4_weight_grouped_mm` on FP8 tensor cores: FP8 activations, the FP4 weights
    expanded to E4M3 in the prologue. (MXFP4 weights: ``b_global=None`` and
    ``b_block_scales`` their E8M0 scales per 32.)

    Per expert ``e``, K group ``g`` of 128 values and output column ``n``::

        x       = max over the group's block scales of column n; e = its exponent
                  (x in [2^e, 2^(e+1)); E4M3 subnormal scales: e = -6)
        w8[n,k] = RNE_e4m3(v[n, k] * s_b[n, k // 16] * 2^(5 - e))   (|.| < 6*2^(e+1)*2^(5-e)
                                                                      = 384 <= 448: no clip)
        P_g     = sum_{k in g} a_q[a, k] * w8[n, k]                 (FP8 dots, fp32)
        acc    += P_g * (sa[a, g] * 2^(e - 5))                      (promotion, fp32)
        out     = bf16(acc * s_g[e] (* a_row_scale[a]))  or its SwiGLU, as the bf16 kernel

    Arithmetic: the activations are whatever quantiser made ``a_q``; the weights lose only
    the rounding of ``v * s_b`` (at most 2 + 4 = 6 significant bits) to E4M3's 4: relative
    error at most 2^-4 per weight while ``v * s_b * 2^(5 - e) >= 2^-6`` (E4M3's smallest
    normal), else an absolute error of at most 2^-10 * 2^(e - 5) (half the subnormal
    quantum). MXFP4 weights (``v * 2^s``, 2 significant bits) are exact unless their block's
    scale is 2^13 or more below the group's largest. Each product of E4M3 values is exact in
    fp32; the sum is the tensor core's (docs/numerics.md section 6 states the SM90 FP8
    accumulation model). Against the reference :func:`nvfp4_weight_fp8_mm_ref`, which
    computes ``w8`` the same way, only the summation order differs.

    Args:
        a_q: float8_e4m3fn ``[R, K]``, K a multiple of 128; activation rows in expert-major
            order (``row_offsets``), e.g. from :func:`~distmoe.quant.fp8_block_quantize_2d`
            or :func:`~distmoe.kernels.scaled.gather_quant.gather_quantize`
            (``format="fp8_block"``).
        a_scales: float32 ``[R, K/128]``: each row's scale per 128 values.
        b_packed, b_block_scales, b_global, padded_offsets, row_offsets, out, swiglu,
        a_row_scale: as :func:`nvfp4_weight_grouped_mm`.
        config: launch config with ``block_k`` 128; default :func:`fp4_weight_fp8_config`.

    Returns ``out``. No host synchronisation; nothing allocated. Why: Hopper's FP8 tensor
    cores run twice bf16's rate; whether that beats the extra activation pass is measured
    (:func:`distmoe.plan.rules.fp4_fp8_operands`).
    """
    mx = b_global is None
    b_packed, b_scales, rows, k, num_experts, n = check_nvfp4_weight_grouped_mm_args(
        a_q, b_packed, b_block_scales, b_global, padded_offsets, row_offsets, out,
        swiglu=swiglu, mx=mx, a_scales=a_scales)
    _check_row_scale(a_row_scale, a_q)
    if config is None:
        config = fp4_weight_fp8_config(k=k, n=n, swiglu=swiglu)
    elif not isinstance(config, ScaledGemmConfig):
        raise TypeError(f"config must be a ScaledGemmConfig, got {type(config).__name__}")
    if config.swap_ab:
        raise ValueError("config.swap_ab is not implemented for the FP8-operand kernel; "
                         "take swap_ab=False")
    if config.block_k != FP8_GROUP:
        raise ValueError(f"config.block_k ({config.block_k}) must be {FP8_GROUP} (one "
                         "promotion per activation scale group)")
    if rows == 0:
        return out
    grid, num_pid_m, kwargs = config.launch(rows=rows, k=k, n=n, num_experts=num_experts,
                                            swiglu=swiglu)
    with device_context(a_q.device):
        _nvfp4_weight_grouped_mm_kernel[grid](
            a_q, a_scales, b_packed, b_scales, b_scales if mx else b_global,
            b_scales if a_row_scale is None else a_row_scale, padded_offsets, row_offsets,
            out, num_pid_m, SCALE_GROUP=MXFP4_BLOCK if mx else NVFP4_BLOCK, E8M0=mx,
            HAS_GLOBAL=not mx, HAS_ROW_SCALE=a_row_scale is not None, FP8_A=True,
            INTERLEAVE_K=config.interleave_k, INTERPRET=interpreter_active(), **kwargs,
        )
    return out


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------


def fp4_weight_fp8_values(b_packed: torch.Tensor, b_scales: torch.Tensor, *,
                          mx: bool) -> torch.Tensor:
    """float64 effective weights of :func:`nvfp4_weight_fp8_mm`: ``w8 * 2^(e - 5)`` per value
    (its docstring), ``b_packed``'s shape with the last dim doubled; ``b_scales`` uint8 (or
    float8_e4m3fn) NVFP4 E4M3 scales per 16, or with ``mx`` E8M0 bytes per 32. Plain
    PyTorch."""
    b_scales = b_scales.view(torch.uint8)
    group = MXFP4_BLOCK if mx else NVFP4_BLOCK
    if mx:
        vals = mxfp4_dequantize(b_packed, b_scales, dtype=torch.float32)
        e = b_scales.to(torch.int32) - 127
    else:
        vals = nvfp4_weight_values(b_packed, b_scales)
        code = b_scales.to(torch.int32) & 0x7F
        e = torch.where(code >= 8, (code >> 3) - 7, -6)
    k = vals.shape[-1]
    per = FP8_GROUP // group  # block scales per K group
    e = e.unflatten(-1, (k // FP8_GROUP, per)).amax(-1)  # [..., K/128]
    if mx:
        e = e.clamp(min=-121)
    nan = (b_scales == 255) if mx else ((b_scales & 0x7F) == 0x7F)
    shift = torch.ldexp(torch.ones_like(e, dtype=torch.float64), (e - 5).to(torch.float64))
    shift = shift.repeat_interleave(FP8_GROUP, dim=-1)
    w8 = (vals.double() / shift).to(torch.float8_e4m3fn).double()  # exact / 2^k, then RNE
    w8 = torch.where(nan.repeat_interleave(group, dim=-1), torch.nan, w8)
    return w8 * shift


def nvfp4_weight_fp8_mm_ref(a_q, a_scales, b_packed, b_block_scales, b_global, padded_offsets,
                            row_offsets, out, *, swiglu=False, block_m=128, a_row_scale=None):
    """Plain-PyTorch :func:`nvfp4_weight_fp8_mm` (synchronises; for tests): the dequantised
    activations times :func:`fp4_weight_fp8_values`, one float64 matmul per expert rounded to
    fp32, then the epilogue of :func:`nvfp4_weight_grouped_mm_ref`."""
    mx = b_global is None
    b_packed, b_scales, rows, k, num_experts, n = check_nvfp4_weight_grouped_mm_args(
        a_q, b_packed, b_block_scales, b_global, padded_offsets, row_offsets, out,
        swiglu=swiglu, for_kernel=False, mx=mx, a_scales=a_scales)
    a64 = a_q.double() * a_scales.double().repeat_interleave(FP8_GROUP, dim=1)
    w = fp4_weight_fp8_values(b_packed, b_scales, mx=mx)
    return _fp4_ref_epilogue(a64, w, b_global, padded_offsets, row_offsets, out, n=n,
                             swiglu=swiglu, block_m=block_m, rows=rows,
                             a_row_scale=a_row_scale)




def nvfp4_weight_values(b_packed: torch.Tensor, b_block_scales: torch.Tensor) -> torch.Tensor:
    """float32 ``v * s_b`` of every weight value (the kernel's bf16 prologue values, exact in
    either type): ``b_packed``'s shape with the last dim doubled. Plain PyTorch."""
    one = torch.ones((), dtype=torch.float32, device=b_packed.device)
    return nvfp4_dequantize(b_packed, b_block_scales, one, dim=-1)


def nvfp4_weight_grouped_mm_ref(
    a: torch.Tensor,
    b_packed: torch.Tensor,
    b_block_scales: torch.Tensor,
    b_global: torch.Tensor,
    padded_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    out: torch.Tensor,
    *,
    swiglu: bool = False,
    block_m: int = 128,
    a_row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-PyTorch :func:`nvfp4_weight_grouped_mm` (any device; synchronises; for tests);
    with ``b_global=None``, of :func:`mxfp4_weight_grouped_mm` (MXFP4 weights, ``b_block_scales``
    its E8M0 scales).

    Same arguments and contract (``block_m``: the padding multiple, checked on the host with
    both tables). The weights decoded exactly (``v * s_b``, :func:`nvfp4_weight_values`), one
    float64 matmul per expert rounded to fp32 (the kernel's accumulator type), times the
    global scale in fp32, SwiGLU in fp32, one rounding to bf16. Only the live rows are
    written.
    """
    mx = b_global is None
    b_packed, b_scales, rows, k, num_experts, n = check_nvfp4_weight_grouped_mm_args(
        a, b_packed, b_block_scales, b_global, padded_offsets, row_offsets, out, swiglu=swiglu,
        for_kernel=False, mx=mx)
    a64 = a.double()
    w = (mxfp4_dequantize(b_packed, b_scales, dtype=torch.float64) if mx else
         nvfp4_weight_values(b_packed, b_scales).double())
    return _fp4_ref_epilogue(a64, w, b_global, padded_offsets, row_offsets, out, n=n,
                             swiglu=swiglu, block_m=block_m, rows=rows,
                             a_row_scale=a_row_scale)


def _fp4_ref_epilogue(a64, w, b_global, padded_offsets, row_offsets, out, *, n, swiglu,
                      block_m, rows, a_row_scale):
    """The references' common part: the tables checked on the host, one float64 matmul of
    ``a64 [R, K]`` and ``w [E, N, K]`` per expert rounded to fp32, times the global scale
    (``b_global`` None: 1) and the row scale in fp32, SwiGLU in fp32, one bf16 rounding into
    the live rows of ``out``."""
    check_padded_offsets_host(padded_offsets, block_m=block_m,
                              r_cap=int(padded_offsets[-1].item()))
    check_row_offsets_host(padded_offsets, row_offsets, r_act=rows)
    out_n = n // 2 if swiglu else n
    for e, (_, act_start, count) in enumerate(activation_segments(padded_offsets, row_offsets)):
        if count == 0:
            continue
        acc = (a64[act_start:act_start + count] @ w[e].T).float()
        scale = torch.ones((), device=a64.device) if b_global is None else b_global[e]
        if a_row_scale is not None:  # the kernel's fp32 product of the two, first
            scale = (scale * a_row_scale[act_start:act_start + count])[:, None]
        acc = acc * scale
        if swiglu:
            acc = torch.nn.functional.silu(acc[:, :out_n]) * acc[:, out_n:]
        out[act_start:act_start + count] = acc.to(torch.bfloat16)
    return out
