"""W2 backward: DGRAD with the SwiGLU backward fused into its epilogue, and the grouped WGRAD.

Row layout (every backward GEMM; the forward kernels use the same one). Two row numberings:

* *Padded* expert-major rows, the tile schedule: ``padded_offsets`` int32 ``[E_local + 1]``
  (device); local expert ``e`` owns padded rows ``[padded_offsets[e], padded_offsets[e+1])``,
  a multiple of ``block_m``; rows at/after ``padded_offsets[E_local]`` are idle. The pointer
  tables (``grad_h3_ptrs`` here, ``scatter_ptrs`` in W13 DGRAD: int64 ``[R_cap]``) are indexed
  by padded row; ``R_cap`` is a multiple of ``block_m`` and sizes the DGRAD grids (bounds
  them, with ``persistent``).
* Compact *activation* rows, the storage of h1, grad_h1, h2, grad_h3 and x_gathered:
  ``row_offsets`` int32 ``[E_local + 1]`` (device, exclusive prefix sum of live rows per
  expert, ``row_offsets[0] = 0``). Expert ``e`` has ``n_e = row_offsets[e+1] - row_offsets[e]``
  live rows (``n_e <=`` its padded segment length); padded row ``padded_offsets[e] + j`` is
  *live* iff ``j < n_e``, and then its activation row is ``row_offsets[e] + j``; the other
  rows of the segment are *padding* and have no activation row. Activation tensors are
  ``[R_act, width]`` with ``R_act >= row_offsets[E_local]``, independent of ``R_cap`` (the
  host cannot check this bound: the counts live on the device). Rows at/after
  ``row_offsets[E_local]`` are never written and their contents never reach an output.

No kernel stores an activation row for a padding row, and padding rows never affect a live
output. Neither offset table is read on the host.

Per live row (``h1 = [g | u]`` saved by the forward, ``W2 = w2[e]`` of shape ``[D, F]``)::

    grad_h2 = grad_h3 @ W2                         [R, D] @ [D, F], fp32 accumulation
    s       = sigmoid(g)
    grad_g  = grad_h2 * u * s * (1 + g * (1 - s))  (= grad_h2 * u * dsilu(g))
    grad_u  = grad_h2 * silu(g)
    grad_h1 = [grad_g | grad_u]                    bf16 [R, 2F]
    h2      = silu(g) * u                          bf16 [R, F], rebuilt (never saved)
    grad_W2[e] += grad_h3_e^T @ h2_e               fp32 [D, F]

:func:`w2_dgrad_swiglu_bwd`
    ``grad_h3`` rows live wherever the owner's combine buffer is (this or a peer process):
    the kernel reads them through ``grad_h3_ptrs``, absolute row addresses indexed by padded
    row (0 = null row, read as zeros; entries of padding and idle rows are never read). With
    ``grad_h3_out`` it runs two launches: a row gather that copies every live row once into
    ``grad_h3_out`` at its activation row (local, contiguous: WGRAD needs it anyway), then the
    GEMM reading those rows through TMA (a tile's padding rows read past their expert's rows,
    the next expert's rows or TMA zeros, and their results are discarded). Without it the
    GEMM gathers through the pointers in its K loop, so each row is read once per column
    tile (``F / block_n`` times): meant for local rows. Weights come through a 3-D TMA
    descriptor ``[E, D, F]`` (encoded on the host at launch by default, or built in every
    program: ``host_descriptors``); the epilogue reads the ``[g | u]`` tile pair of the live
    rows, writes ``[grad_g | grad_u]`` and optionally h2. ``h1`` is a 2-D tensor in
    activation rows or, with ``h1_offset`` (int64 ``[1]`` on the device, a bf16 element
    offset such as a slot cursor), a 1-D base with activation row ``a`` at
    ``h1 + h1_offset[0] + a*2F``.
    In place: ``grad_h1_out`` may be exactly the memory that h1 reads (same rows: saves the
    ``R*2F*2`` bytes of a separate gradient buffer). Each program reads and writes the same
    elements only (its live rows, its ``g`` and ``u`` columns), and every stored
    ``grad_g``/``grad_u`` element is computed from the ``g`` and ``u`` values loaded at the
    same positions, so each program has loaded its h1 elements before it stores those
    elements of grad_h1 (a data dependency on the GPU, whichever thread stores them); no
    other program touches them.
    Null live rows produce zeros in every output; tiles of padding rows only and idle tiles
    (rows at/after ``padded_offsets[E]``) exit before loading anything.
    ``scored_rows`` (what training runs, :mod:`distmoe.ops.autograd`): the rows hold the
    unscaled ``g = grad_y[t]`` and each row's address points at the owner's route row, whose
    first fp32 is the route's score ``s``; then ``grad_h2 = s * (g @ W2)``, h2 is stored as
    ``s * h2`` (so that WGRAD of ``g`` and it is grad_W2), and each column tile writes the
    fp32 ``dot(g @ W2, h2)`` over its columns after the score (the score gradient, in parts:
    :func:`distmoe.kernels.route_grad.reduce_routes` sums them). The epilogue then runs in
    twice as many column parts (registers).
    Grid: one program per (row tile, ``block_n`` columns of F) of the ``R_cap`` bound, or with
    ``persistent`` one program per SM (at most one per tile of the bound), each walking the
    live tiles ``padded_offsets[E] / block_m * ceil(F / block_n)`` (a device value) with a
    stride of the grid; its descriptors are built, and ``h1_offset`` read, once per program.
    Every tile is computed the same way on both grids (bit-identical outputs). The row gather
    of the gather-once path keeps its own grid (``R_cap / 16`` row blocks).

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
    The same kernel serves W13 WGRAD (:mod:`distmoe.kernels.w13_backward`), whose second
    operand may sit at a device-side offset (device-built TMA descriptor).

Requirements (device-side, not checked): the layout rules above; non-null row addresses
16-byte aligned; ``h1_offset[0]`` a multiple of 8 elements (16 bytes: activation rows are
16-byte aligned, like the slot cursor's 128-byte steps) and the base holding
``h1_offset[0] + row_offsets[E_local]*2F`` elements.

Sync points: none inside; kernel boundaries order the launches. Grids are sized from
``R_cap``, ``E_local``, the weight shapes and (persistent DGRAD) the SM count only (CUDA-graph
safe, no host synchronisation).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from distmoe.kernels._common import (
    GemmConfig,
    byte_range,
    check_devices,
    check_offsets,
    check_tensor,
    check_tma_aligned,
    check_width,
    device_context,
    device_memory_bytes,
    ensure_tma_allocator,
    gemm_grid,
    gluon_device,
    next_power_of_2,
    rows_at,
    swizzle_tile,
    tile_activation_rows,
    tile_expert,
    warn_gluon_fallback,
    wgrad_lockstep,
    wgrad_wide_tiles,
)
from distmoe.kernels.interpreter import interpreter_active

# Rows of the standalone row-gather program (a divisor of every legal block_m, so a block
# never straddles two expert segments).
_GATHER_BLOCK_ROWS = 16


def _pow2_clamped(n: int, low: int, high: int) -> int:
    return min(high, max(low, next_power_of_2(n)))


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def tile_live_rows(padded_offsets_ptr, row_offsets_ptr, expert, row_start):
    """:func:`tile_activation_rows` with an int32 ``act_start``: the backward kernels use it
    as a TMA row coordinate (int32) and in int32 row arithmetic."""
    act_start, num_live = tile_activation_rows(padded_offsets_ptr, row_offsets_ptr, expert,
                                               row_start)
    return act_start.to(tl.int32), num_live


@triton.jit
def _gather_rows_kernel(
    row_ptrs_ptr,  # int64 [R_cap]: absolute addresses of bf16 rows of WIDTH (0 = null)
    padded_offsets_ptr,  # int32 [E + 1]
    row_offsets_ptr,  # int32 [E + 1]
    out_ptr,  # bf16 [R_act, WIDTH], activation rows
    WIDTH: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    row0 = tl.program_id(0) * BLOCK_ROWS
    if row0 >= tl.load(padded_offsets_ptr + NUM_EXPERTS):
        return  # idle rows
    expert = tile_expert(padded_offsets_ptr, row0, NUM_EXPERTS, EXPERTS_POW2)
    act0, num_live = tile_live_rows(padded_offsets_ptr, row_offsets_ptr, expert, row0)
    if num_live <= 0:
        return  # padding rows only
    idx = tl.arange(0, BLOCK_ROWS)
    is_live = idx < num_live
    addr = tl.load(row_ptrs_ptr + row0 + idx, mask=is_live, other=0)
    is_row = addr != 0
    # Row addresses are 16-byte aligned (contract). The hint goes on the pointer (its
    # divisibility counts bytes); on the int64 before the cast it is lost: 2-byte loads.
    src = tl.multiple_of(addr.to(tl.pointer_type(tl.bfloat16)), 16)
    col = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_ok = col < WIDTH
    vals = tl.load(src[:, None] + col[None, :], mask=is_row[:, None] & col_ok[None, :], other=0.0)
    dst = tl.multiple_of(out_ptr + (act0 + idx).to(tl.int64) * WIDTH, 16)
    tl.store(dst[:, None] + col[None, :], vals, mask=is_live[:, None] & col_ok[None, :])


@triton.jit
def _swiglu_bwd_epilogue(
    grad_h2,
    h1_ptr,
    grad_h1_ptr,
    h2_ptr,
    act_rows,
    is_live,
    is_row,
    n0,
    score,
    FFN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STORE_H2: tl.constexpr,
    SCORED: tl.constexpr,
):
    """SwiGLU backward of columns ``[n0, n0 + BLOCK_N)`` of F for the tile's rows: reads the
    ``g``/``u`` tile pair of the non-null live rows, writes ``grad_g``/``grad_u`` (and ``h2``)
    of the live rows at their activation rows ``act_rows`` (int64). Null rows load zeros and
    (their ``grad_h2`` being zero) store zeros; padding rows load and store nothing.
    ``SCORED``: ``grad_h2`` is the unscaled product and ``score`` ([BLOCK_M] fp32) the rows'
    route scores; the SwiGLU backward runs on ``score * grad_h2``, h2 is stored as
    ``bf16(score * h2)``, and the function returns the rows' fp32 ``dot(grad_h2, h2)`` over
    these columns (zeros when not ``SCORED``).

    In place (``grad_h1_ptr`` over the h1 rows): every stored element is a function of the
    ``g`` and ``u`` loaded at the same row and column, so its load precedes its store."""
    col = n0 + tl.arange(0, BLOCK_N)
    col_ok = col < FFN
    # Activation rows are 16-byte aligned (F multiple of 8, offset multiple of 8 elements):
    # the hint keeps 16-byte vector accesses although the row offsets are device values.
    h1_rows = tl.multiple_of(h1_ptr + act_rows * (2 * FFN), 16)
    g_ptrs = h1_rows[:, None] + col[None, :]
    load_mask = is_row[:, None] & col_ok[None, :]
    g = tl.load(g_ptrs, mask=load_mask, other=0.0).to(tl.float32)
    u = tl.load(g_ptrs + FFN, mask=load_mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    silu = g * s
    part = tl.zeros_like(score)
    grad_u = grad_h2 * silu
    if SCORED:
        # dot(grad_h2, h2) = sum(grad_u * u) before the scaling; scaling u scales grad_g and
        # h2 at no extra cost
        part = tl.sum(grad_u * u, axis=1)
        grad_u = grad_u * score[:, None]
        u = u * score[:, None]
    store_mask = is_live[:, None] & col_ok[None, :]
    grad_rows = tl.multiple_of(grad_h1_ptr + act_rows * (2 * FFN), 16)
    grad_ptrs = grad_rows[:, None] + col[None, :]
    tl.store(grad_ptrs, (grad_h2 * u * (s * (1.0 + g * (1.0 - s)))).to(tl.bfloat16),
             mask=store_mask)
    tl.store(grad_ptrs + FFN, grad_u.to(tl.bfloat16), mask=store_mask)
    if STORE_H2:
        h2_rows = tl.multiple_of(h2_ptr + act_rows * FFN, 16)
        tl.store(h2_rows[:, None] + col[None, :], (silu * u).to(tl.bfloat16), mask=store_mask)
    return part


@triton.jit
def _w2_dgrad_descs(
    grad_h3_rows,
    w2,
    num_act_rows,
    HIDDEN: tl.constexpr,
    FFN: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    GATHER_IN_LOOP: tl.constexpr,
    READY: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``(rows, w2)`` TMA descriptors over the gathered grad_h3 rows ``[R_act, D]`` and w2
    ``[E, D, F]``: ``READY``, the arguments themselves (host-encoded, or built earlier);
    otherwise built here on the device (128 bytes of scratch and a tensormap fence each).
    With ``GATHER_IN_LOOP`` the first is ``grad_h3_rows`` itself (unused: the K loop gathers
    through the row pointers)."""
    # (an explicit else: Triton builds code after a constexpr-if return for both values)
    if READY:
        a_desc = grad_h3_rows
        w_desc = w2
    else:
        w_desc = tl.make_tensor_descriptor(
            w2,
            shape=[NUM_EXPERTS, HIDDEN, FFN],
            strides=[HIDDEN * FFN, FFN, 1],
            block_shape=[1, BLOCK_K, BLOCK_N],
        )
        if GATHER_IN_LOOP:
            a_desc = grad_h3_rows
        else:
            a_desc = tl.make_tensor_descriptor(
                grad_h3_rows,
                shape=[num_act_rows, HIDDEN],
                strides=[HIDDEN, 1],
                block_shape=[BLOCK_M, BLOCK_K],
            )
    return a_desc, w_desc


@triton.jit
def _w2_dgrad_tile(
    grad_h3_ptrs_ptr,
    grad_h3_rows,
    padded_offsets_ptr,
    row_offsets_ptr,
    w2,
    h1_ptr,
    h1_offset_ptr,
    grad_h1_ptr,
    h2_ptr,
    num_act_rows,
    pid_m,
    pid_n,
    HIDDEN: tl.constexpr,
    FFN: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    GATHER_IN_LOOP: tl.constexpr,
    STORE_H2: tl.constexpr,
    SCORED: tl.constexpr,
    DESC_READY: tl.constexpr,
    H1_OFFSET: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One ``BLOCK_M x BLOCK_N`` tile of grad_h2 and its SwiGLU backward, for a row tile below
    ``padded_offsets[E]``. A tile of padding rows only loads and stores nothing.
    ``SCORED``: each non-null row's score is the fp32 at its address, and the tile's score
    part goes to fp32 value ``1 + pid_n`` there.

    ``grad_h3_rows`` / ``w2``: TMA descriptors (``DESC_READY``: host-encoded, or built once per
    persistent program), else the tensors, whose descriptors are built here once the tile is
    known to hold live rows. ``H1_OFFSET``: ``h1_ptr`` still needs ``h1_offset[0]`` added
    (else it already points at activation row 0).
    """
    row0 = pid_m * BLOCK_M
    expert = tile_expert(padded_offsets_ptr, row0, NUM_EXPERTS, EXPERTS_POW2)
    act0, num_live = tile_live_rows(padded_offsets_ptr, row_offsets_ptr, expert, row0)
    # Live rows come first in a segment: a tile starting at a padding row has none.
    if num_live > 0:
        idx = tl.arange(0, BLOCK_M)
        is_live = idx < num_live
        # Pointer entries of padding rows are not read (masked): they may hold anything.
        addr = tl.load(grad_h3_ptrs_ptr + row0 + idx, mask=is_live, other=0)
        is_row = addr != 0
        act_rows = (act0 + idx).to(tl.int64)
        n0 = pid_n * BLOCK_N

        a_desc, w_desc = _w2_dgrad_descs(
            grad_h3_rows, w2, num_act_rows, HIDDEN, FFN, NUM_EXPERTS, GATHER_IN_LOOP,
            DESC_READY, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if GATHER_IN_LOOP:
            src = tl.multiple_of(addr.to(tl.pointer_type(tl.bfloat16)), 16)  # 16-byte aligned
            for k0 in range(0, HIDDEN, BLOCK_K):
                col = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(
                    src[:, None] + col[None, :],
                    mask=is_row[:, None] & (col < HIDDEN)[None, :],
                    other=0.0,
                )
                b = w_desc.load([expert, k0, n0]).reshape(BLOCK_K, BLOCK_N)
                acc = tl.dot(a, b, acc)
        else:
            # Activation rows [act0, act0 + BLOCK_M): the padding rows of the tile read the
            # next expert's rows, rows past the live end or TMA zeros; their results are never
            # stored.
            for k0 in range(0, HIDDEN, BLOCK_K):
                a = a_desc.load([act0, k0])
                b = w_desc.load([expert, k0, n0]).reshape(BLOCK_K, BLOCK_N)
                acc = tl.dot(a, b, acc)

        if H1_OFFSET:
            h1_ptr = h1_ptr + tl.load(h1_offset_ptr)
        score_ptr = addr.to(tl.pointer_type(tl.float32))
        score = tl.zeros([BLOCK_M], dtype=tl.float32)
        if SCORED:
            score = tl.load(score_ptr, mask=is_row, other=0.0)

        # SwiGLU backward in column parts: the whole 128 x 128 tile with its g/u pair and
        # their 64-bit addresses needs more than 255 registers per thread (spills); halves
        # need about 180 on SM90 (ptxas). A 128 x 256 tile in halves spilled 560-600 bytes
        # per thread; in quarters none (tools/ptxas_report.py; run 12: 2.23 -> 2.15 ms at
        # issue-a). SCORED needs twice the parts (128 x 256 in quarters: 292 bytes of spills,
        # in eighths none; 128 x 128 in halves: 4 bytes).
        args = (h1_ptr, grad_h1_ptr, h2_ptr, act_rows, is_live, is_row, score)
        PARTS: tl.constexpr = (4 if BLOCK_N >= 256 else (2 if BLOCK_N >= 32 else 1)) * (
            2 if SCORED and BLOCK_N >= 64 else 1)
        part = _epilogue_in_parts(acc, args, n0, FFN, BLOCK_M, BLOCK_N, PARTS, STORE_H2, SCORED)
        if SCORED:
            tl.store(score_ptr + 1 + pid_n, part, mask=is_row)


@triton.jit
def _epilogue_in_parts(x, args, col0, FFN: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                       PARTS: tl.constexpr, STORE_H2: tl.constexpr, SCORED: tl.constexpr):
    """:func:`_swiglu_bwd_epilogue` of the ``[ROWS, COLS]`` tile ``x`` (columns ``col0 + j``)
    in ``PARTS`` (1, 2, 4 or 8) column parts of ``COLS / PARTS``, left to right; returns the
    sum of their score parts. ``args``: ``(h1_ptr, grad_h1_ptr, h2_ptr, act_rows, is_live,
    is_row, score)``."""
    h1_ptr, grad_h1_ptr, h2_ptr, act_rows, is_live, is_row, score = args
    if PARTS == 1:
        part = _swiglu_bwd_epilogue(x, h1_ptr, grad_h1_ptr, h2_ptr, act_rows, is_live, is_row,
                                    col0, score, FFN, COLS, STORE_H2, SCORED)
    else:
        HALF: tl.constexpr = COLS // 2
        lo, hi = _column_halves(x, ROWS, COLS)
        part = _epilogue_half(lo, args, col0, FFN, ROWS, HALF, PARTS // 2, STORE_H2, SCORED)
        part += _epilogue_half(hi, args, col0 + HALF, FFN, ROWS, HALF, PARTS // 2, STORE_H2,
                               SCORED)
    return part


@triton.jit
def _epilogue_half(x, args, col0, FFN: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                   PARTS: tl.constexpr, STORE_H2: tl.constexpr, SCORED: tl.constexpr):
    """One half of :func:`_epilogue_in_parts` (up to 4 parts: Triton does not recurse)."""
    h1_ptr, grad_h1_ptr, h2_ptr, act_rows, is_live, is_row, score = args
    if PARTS == 1:
        part = _swiglu_bwd_epilogue(x, h1_ptr, grad_h1_ptr, h2_ptr, act_rows, is_live, is_row,
                                    col0, score, FFN, COLS, STORE_H2, SCORED)
    elif PARTS == 2:
        HALF: tl.constexpr = COLS // 2
        lo, hi = _column_halves(x, ROWS, COLS)
        part = _swiglu_bwd_epilogue(lo, h1_ptr, grad_h1_ptr, h2_ptr, act_rows, is_live, is_row,
                                    col0, score, FFN, HALF, STORE_H2, SCORED)
        part += _swiglu_bwd_epilogue(hi, h1_ptr, grad_h1_ptr, h2_ptr, act_rows, is_live,
                                     is_row, col0 + HALF, score, FFN, HALF, STORE_H2, SCORED)
    else:
        QUARTER: tl.constexpr = COLS // 4
        lo, hi = _column_halves(x, ROWS, COLS)
        q0, q1 = _column_halves(lo, ROWS, COLS // 2)
        part = _swiglu_bwd_epilogue(q0, h1_ptr, grad_h1_ptr, h2_ptr, act_rows, is_live, is_row,
                                    col0, score, FFN, QUARTER, STORE_H2, SCORED)
        part += _swiglu_bwd_epilogue(q1, h1_ptr, grad_h1_ptr, h2_ptr, act_rows, is_live,
                                     is_row, col0 + QUARTER, score, FFN, QUARTER, STORE_H2,
                                     SCORED)
        q2, q3 = _column_halves(hi, ROWS, COLS // 2)
        part += _swiglu_bwd_epilogue(q2, h1_ptr, grad_h1_ptr, h2_ptr, act_rows, is_live,
                                     is_row, col0 + 2 * QUARTER, score, FFN, QUARTER, STORE_H2,
                                     SCORED)
        part += _swiglu_bwd_epilogue(q3, h1_ptr, grad_h1_ptr, h2_ptr, act_rows, is_live,
                                     is_row, col0 + 3 * QUARTER, score, FFN, QUARTER, STORE_H2,
                                     SCORED)
    return part


@triton.jit
def _column_halves(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``x[:, :COLS/2]`` and ``x[:, COLS/2:]`` of a ``[ROWS, COLS]`` tile."""
    return tl.split(tl.permute(tl.reshape(x, [ROWS, 2, COLS // 2]), (0, 2, 1)))


@triton.jit
def _w2_dgrad_swiglu_kernel(
    grad_h3_ptrs_ptr,  # int64 [R_cap]: addresses of the bf16 grad_h3 rows (0 = null)
    grad_h3_rows,  # bf16 [R_act, D] gathered rows, or its TMA descriptor (not GATHER_IN_LOOP)
    padded_offsets_ptr,  # int32 [E + 1]
    row_offsets_ptr,  # int32 [E + 1]
    w2,  # bf16 [E, D, F], or its TMA descriptor (HOST_DESC)
    h1_ptr,  # bf16 [R_act, 2F], or a 1-D bf16 base (H1_OFFSET)
    h1_offset_ptr,  # int64 [1]: element offset of activation row 0 in h1 (H1_OFFSET)
    grad_h1_ptr,  # bf16 [R_act, 2F] (may be the h1 rows)
    h2_ptr,  # bf16 [R_act, F] (written when STORE_H2)
    num_rows,  # R_cap
    num_act_rows,  # R_act
    HIDDEN: tl.constexpr,
    FFN: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    GATHER_IN_LOOP: tl.constexpr,
    STORE_H2: tl.constexpr,
    SCORED: tl.constexpr,
    HOST_DESC: tl.constexpr,
    H1_OFFSET: tl.constexpr,
    PERSISTENT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    NUM_PID_N: tl.constexpr = (FFN + BLOCK_N - 1) // BLOCK_N
    total_rows = tl.load(padded_offsets_ptr + NUM_EXPERTS)
    if PERSISTENT:
        # Each program walks the live tiles (count read on the device) with a stride of the
        # grid; a while loop (not range) keeps the interpreter working too. Descriptors and
        # the h1 offset are set up once per program, and only by a program that has a tile:
        # the others (fewer live tiles than programs) exit at once.
        num_live_m = total_rows // BLOCK_M
        num_tiles = num_live_m * NUM_PID_N
        tile_id = tl.program_id(0)
        if tile_id < num_tiles:
            a_desc, w_desc = _w2_dgrad_descs(
                grad_h3_rows, w2, num_act_rows, HIDDEN, FFN, NUM_EXPERTS, GATHER_IN_LOOP,
                HOST_DESC, BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
            h1_rows_ptr = h1_ptr
            if H1_OFFSET:
                h1_rows_ptr = h1_ptr + tl.load(h1_offset_ptr)
            while tile_id < num_tiles:
                pid_m, pid_n = swizzle_tile(tile_id, num_live_m, NUM_PID_N, GROUP_M)
                _w2_dgrad_tile(
                    grad_h3_ptrs_ptr, a_desc, padded_offsets_ptr, row_offsets_ptr, w_desc,
                    h1_rows_ptr, h1_offset_ptr, grad_h1_ptr, h2_ptr, num_act_rows, pid_m, pid_n,
                    HIDDEN, FFN, NUM_EXPERTS, EXPERTS_POW2, GATHER_IN_LOOP, STORE_H2, SCORED,
                    True, False, BLOCK_M, BLOCK_N, BLOCK_K,
                )  # fmt: skip
                tile_id += tl.num_programs(0)
    else:
        pid_m, pid_n = swizzle_tile(tl.program_id(0), num_rows // BLOCK_M, NUM_PID_N, GROUP_M)
        # Idle tiles (rows at/after padded_offsets[E]): no loads, no stores.
        if pid_m * BLOCK_M < total_rows:
            _w2_dgrad_tile(
                grad_h3_ptrs_ptr, grad_h3_rows, padded_offsets_ptr, row_offsets_ptr, w2, h1_ptr,
                h1_offset_ptr, grad_h1_ptr, h2_ptr, num_act_rows, pid_m, pid_n, HIDDEN, FFN,
                NUM_EXPERTS, EXPERTS_POW2, GATHER_IN_LOOP, STORE_H2, SCORED, HOST_DESC,
                H1_OFFSET, BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip


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
# Launch configurations
# --------------------------------------------------------------------------------------------


def check_backward_gemm_config(config: GemmConfig) -> None:
    """Rules that the backward DGRAD configs add to :class:`GemmConfig`.

    None today: both DGRAD kernels take every :class:`GemmConfig`, ``persistent`` and
    ``host_descriptors`` in any combination. Kept as the one place for DGRAD-only rules.
    """
    del config


@dataclass(frozen=True, kw_only=True)
class W2DgradConfig(GemmConfig):
    """Launch configuration of :func:`w2_dgrad_swiglu_bwd` (see :class:`GemmConfig`).

    ``block_m`` rows (the padding multiple), ``block_n`` columns of F (each tile writes
    ``block_n`` columns of grad_g and of grad_u), ``block_k`` step over D. ``persistent``: one
    program per SM walking the live tiles (else one program per tile of the ``R_cap`` bound;
    the default until measured on an H200); the gather-once row copy keeps its own grid.
    ``host_descriptors`` covers the w2 and gathered grad_h3 TMA descriptors.
    """

    #: Run the warp-specialised Gluon kernel (:mod:`distmoe.kernels.w2_dgrad_gluon`: a TMA
    #: producer warp and two consumer warpgroups taking tiles in turn, so that one's epilogue
    #: runs under the other's MMAs; or, with ``epilogue_warps``, one MMA warpgroup and an
    #: epilogue partition) where it can run: Hopper, not the interpreter, rows already
    #: gathered (``grad_h3_rows``), 128 x 128 x 64 tiles, D and F multiples of 64.
    #: Elsewhere the Triton kernel runs this config. Uses ``num_stages`` (the load ring, 4-6)
    #: and ``group_m``; ``num_warps``, ``persistent`` and ``host_descriptors`` do not apply.
    gluon: bool = False
    #: With ``gluon``: shared-memory slots per consumer warpgroup (0-4) for the tile's h1
    #: column quarters (g and u, 16 KiB a slot), filled by cp.async: the first ``h1_prefetch``
    #: quarters before the tile's MMAs, each later one as soon as a slot is read, so that the
    #: epilogue does not wait on h1's global loads (docs/performance.md, run 42). The same
    #: bits as 0. Shares the shared memory with the ring: ``num_stages + h1_prefetch`` at most
    #: 6 (32 KiB each).
    h1_prefetch: int = 0
    #: With ``gluon``: 4 or 8 runs the split kernel instead of the ping-pong one: one MMA
    #: warpgroup computes every tile and hands it, as fp32 in shared memory, to an epilogue
    #: partition of this many warps, so the SwiGLU backward runs on more warps beside the
    #: MMAs (docs/performance.md, run 43). 0: the two ping-pong consumers, each running its
    #: own tiles' epilogue. The same bits.
    epilogue_warps: int = 0
    #: With ``epilogue_warps``: fp32 tiles in shared memory (1 or 2, 64 KiB each; with 2 the
    #: MMA warpgroup never waits for the epilogue's reads of the tile before).
    #: ``num_stages + 2 * epilogue_buffers`` at most 7 (the ring's stages are 32 KiB).
    epilogue_buffers: int = 1
    #: With ``epilogue_warps``: the epilogue issues each column quarter's h1 loads one
    #: quarter ahead, the first before it waits for the tile (run 43's profile: the
    #: epilogue warps spent 44% of their cycles waiting on global loads). The same bits;
    #: measured even (kernel 1.005x at T=4096 D=2048 F=768 E=128, 1.001x at T=8192 D=4096,
    #: one H200, 2026-12-01), so off.
    epilogue_early_h1: bool = False
    #: With ``gluon``: the TMA producers start each wave of tiles together (as
    #: :attr:`~distmoe.kernels.w2_scatter.W2Config.lockstep`): each waits, a bounded spin on
    #: a device counter, until every program has issued the loads of its previous tile, so
    #: that the weight tiles an expert's row blocks share are read from L2 rather than DRAM
    #: again. Same bits; the Triton kernel ignores it. :meth:`from_heuristic` sets it at 96
    #: to 191 rows per expert where the rank's W2 weights total at least 3 GiB.
    lockstep: bool = False
    #: With ``gluon``: the tile order is a group per expert rather than per ``group_m`` row
    #: blocks (as :attr:`~distmoe.kernels.w2_scatter.W2Config.expert_groups`): an expert's
    #: tiles are walked column tile by column tile over all its row blocks, so a row block's
    #: grad_h3 rows are read by its column tiles close together in time. Same bits; the
    #: Triton kernel ignores it. :meth:`from_heuristic` sets it at 16 to 768 rows per
    #: expert.
    expert_groups: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_backward_gemm_config(self)
        p = self.h1_prefetch
        if isinstance(p, bool) or not isinstance(p, int):
            raise TypeError(f"h1_prefetch must be an int, got {type(p).__name__} ({p!r})")
        if not 0 <= p <= 4:
            raise ValueError(f"h1_prefetch ({p}) must be in [0, 4] (column quarters of a tile)")
        if p and not self.gluon:
            raise ValueError(f"h1_prefetch ({p}) needs gluon=True (only the Gluon W2 DGRAD "
                             "prefetches h1)")
        if p and self.num_stages + p > 6:
            raise ValueError(f"num_stages + h1_prefetch ({self.num_stages} + {p}) must be at "
                             "most 6: ring stages and h1 slots share the SM's shared memory "
                             "(32 KiB each)")
        w, b = self.epilogue_warps, self.epilogue_buffers
        for name, v, allowed in (("epilogue_warps", w, (0, 4, 8)),
                                 ("epilogue_buffers", b, (1, 2))):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__} ({v!r})")
            if v not in allowed:
                raise ValueError(f"{name} ({v}) must be one of {allowed}")
        if w and not self.gluon:
            raise ValueError(f"epilogue_warps ({w}) needs gluon=True (only the Gluon W2 DGRAD "
                             "has an epilogue partition)")
        if self.epilogue_early_h1 and not w:
            raise ValueError("epilogue_early_h1 needs epilogue_warps (4 or 8): only the split "
                             "kernel's epilogue loads h1 ahead")
        if w and p:
            raise ValueError(f"epilogue_warps ({w}) and h1_prefetch ({p}) do not combine: the "
                             "split kernel's epilogue reads h1 from global memory")
        if w and self.num_stages + 2 * b > 7:
            raise ValueError(f"num_stages + 2 * epilogue_buffers ({self.num_stages} + 2 * {b}) "
                             "must be at most 7: ring stages (32 KiB) and fp32 tiles (64 KiB) "
                             "share the SM's shared memory")
        if self.gluon and self.num_stages < 2:
            raise ValueError(f"num_stages ({self.num_stages}) must be at least 2 with gluon=True: "
                             "the Gluon kernels' consumers hold a ring stage until the next "
                             "one's MMA is issued")

    @classmethod
    def from_heuristic(cls, *, hidden: int, ffn: int, block_m: int = 128,
                       rows_per_expert: int | None = None,
                       device: torch.device | None = None,
                       num_experts: int | None = None) -> W2DgradConfig:
        """128 x 128 x 64 tiles, 8 warps, 4 stages (128 KiB of SMEM) at training shapes;
        narrower tiles for narrow F/D. The SwiGLU epilogue needs about 180 registers per
        thread at 8 warps (sm_90 build), so one CTA per SM: the SMEM is there for a deeper
        pipeline.

        With a ``rows_per_expert`` hint (balanced rows per local expert ``T*K*EP/E``, a shape
        key, never a routed count), ``block_m`` 128 and F >= 256: 128 x 256 tiles, 4 stages.
        Measured on one H200 (2026-11-29, ``tools/tune_gemm.py --backward``): at T=8192
        D=4096 F=2048 E=32 K=8 2.23 ms against 2.44 for 128 x 128; at T=4096 D=2048 F=768
        E=128 K=8 0.405 against 0.410 ms. With the epilogue in four column parts (run 12, same
        tool, gather launch included): 2.15 and 0.368 ms.

        With the hint and a ``device`` where the warp-specialised Gluon kernel runs (Hopper,
        not the interpreter, D and F multiples of 64): that kernel (``gluon``), 128 x 128
        tiles, a ring of 5 stages at >= 1024 rows per expert, else 4. Measured on one H200
        (2026-11-29, run 23, ``tools/tune_gemm.py --backward --kernels w2_dgrad``): 1.720 ms
        against 1.801 for the Triton heuristic at T=8192 D=4096 F=2048 E=32 K=8, 0.282 against
        0.295 at T=4096 D=2048 F=768 E=128 K=8. In its split form (``epilogue_warps=8``, one
        fp32 tile buffer): the kernel alone 1.13x (T=8192 D=4096 F=2048 E=32), 1.36x
        (T=4096 D=2048 F=768 E=128), 1.39x (OLMoE) and 1.24x (T=2048) the ping-pong form,
        same bits; the layer's fwd+bwd 4.5% faster at the second (one H200, 2026-12-01,
        docs/performance.md run 43).

        With the local expert count ``num_experts`` too, the Gluon pick's producer runs in
        ``lockstep`` at 96 to 191 rows per expert where the rank's W2 weights
        (``num_experts * D * F`` bf16) total at least 3 GiB
        (:data:`~distmoe.kernels._common.LOCKSTEP_W2_DGRAD_WEIGHT_BYTES`). The kernel alone,
        one H100, 2026-12-05 (docs/performance.md run 53, sampled routing): 1.05x at
        DeepSeek-V3 (7.5 GB, 128 rows per expert), 1.10x at DeepSeek-V4-Flash (4.3 GB, 96
        rows); 0.995x at GPT-OSS-120B (2.1 GB, 128 rows), 0.95x at T=2048 D=2048 F=768 E=128
        (0.4 GB, 128 rows) and at T=4096 (256 rows).

        The Gluon pick walks its tiles in ``expert_groups`` order at 16 to 768 rows per
        expert (:data:`~distmoe.kernels._common.EXPERT_GROUPS_W2_DGRAD_ROWS`), at every EP
        size (the kernel reads the rank's own scratch rows). One H100, 2026-12-06, run 60,
        Nsight Compute on the kernel in the layer's fwd+bwd step, sampled routing: 3.34 ->
        3.07 ms at DeepSeek-V3 (128 rows per expert, lockstep too; DRAM reads 9.10 -> 8.38
        GB), 1.80 -> 1.72 ms at DeepSeek-V4-Flash (96 rows, lockstep too), 230 -> 223 us at
        T=2048 D=2048 F=768 E=128 K=8, 325 -> 310 us at T=4096 there, 349 -> 330 us at
        OLMoE, 317 -> 304 us at Qwen3-30B-A3B, 631 -> 570 us at D=F=2880 E=32 K=4 (512
        rows); at 1024 rows 839 -> 855 us (OLMoE, 8192 tokens) and 860 -> 857 us (T=4096
        D=4096 F=2048 E=32, exact routing); 1.76 -> 1.98 ms at 2048 (T=8192 there). The
        layer's fwd+bwd (``tools/ab_interleaved.py``, 5-9 rounds): 1.004-1.014x at 128-512
        rows, 0.969x at 2048. Run 61 (the kernel in the step as above): 3.11 -> 2.83 ms at
        DeepSeek-V3 with T=2048 (64 rows per expert), 2.83 -> 2.74 ms at T=1024 (32), 868 ->
        853 us at GPT-OSS-120B with T=2048 (64), 121 -> 119 us at OLMoE with T=512 (64); the
        step 1.0045x and 1.0023x at the first and third. Run 62 (the same way): 2.71 -> 2.64
        ms at DeepSeek-V3 with T=512 (16 rows), 2.80 -> 2.74 ms at T=768 (24), 487 -> 470 us
        at OLMoE with T=6144 (768), 727 -> 710 us at Qwen3-30B-A3B with T=12288 (768); at
        1024 829 -> 843 us (OLMoE) and 1.49 -> 1.80 ms (Qwen3-30B-A3B); the step even at 16
        and 768 rows (1.0003x, 1.0008x). Not measured at EP > 1, below 16 rows per expert
        or at 769-1023.
        """
        if rows_per_expert is not None and block_m == 128 and device is not None:
            from .w2_dgrad_gluon import gluon_w2_dgrad_reason

            if gluon_w2_dgrad_reason(device, hidden=hidden, ffn=ffn, block_m=128, block_n=128,
                                     block_k=64) is None:
                from ._common import EXPERT_GROUPS_W2_DGRAD_ROWS, w2_dgrad_lockstep

                lo, hi = EXPERT_GROUPS_W2_DGRAD_ROWS
                return cls(block_m=128, block_n=128, block_k=64,
                           num_stages=5 if rows_per_expert >= 1024 else 4, gluon=True,
                           epilogue_warps=8,
                           lockstep=w2_dgrad_lockstep(rows_per_expert=rows_per_expert,
                                                      num_experts=num_experts, hidden=hidden,
                                                      ffn=ffn),
                           expert_groups=lo <= rows_per_expert <= hi)
        if rows_per_expert is not None and block_m == 128 and ffn >= 256 and hidden >= 64:
            return cls(block_m=block_m, block_n=256, block_k=64, num_warps=8, num_stages=4)
        block_n = _pow2_clamped(ffn, 16, 128)
        block_k = _pow2_clamped(hidden, 16, 64)
        num_warps = 8 if block_m * block_n >= 128 * 128 else 4
        return cls(
            block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=4
        )

    @classmethod
    def all_configs(cls, *, hidden: int, ffn: int, block_m: int = 128) -> list[W2DgradConfig]:
        """Tuning candidates that fit an SM90 (shared memory and accumulator registers)."""
        return cls.sweep(block_m=block_m, block_ns=(64, 128, 256), block_ks=(32, 64, 128),
                         num_stages=(2, 3, 4), persistent=(False, True),
                         max_n=_pow2_clamped(ffn, 16, 256), max_k=_pow2_clamped(hidden, 16, 256))


@dataclass(frozen=True, kw_only=True)
class WgradConfig:
    """Launch configuration of the grouped WGRAD (:func:`w2_wgrad`, ``w13_wgrad``).

    The GEMM is ``grad_w[e] (+)= A_e^T @ B_e`` over expert ``e``'s activation rows, with ``A``
    ``[R_act, P]`` and ``B`` ``[R_act, Q]`` (W2: P = D, Q = F; W13: P = 2F, Q = D).

    Attributes:
        block_m: padding multiple of the expert segments (same as the DGRAD ``block_m``). The
            compact row walk does not depend on it; it only bounds ``block_k``.
        block_k: activation rows per step of the row loop; power of two in [16, 256] dividing
            ``block_m``. A step may run past its expert's last row (compact rows are not
            padded): the last, partial step of each program is masked.
        block_out_m: rows (P) of the output tile; power of two in [16, 256].
        block_out_n: columns (Q) of the output tile; power of two in [16, 256].
        split_rows: programs sharing one output tile, each taking every ``split_rows``-th
            row step and adding with fp32 atomics; 1 = deterministic read-add-write.
        num_warps: 4 or 8.
        num_stages: software-pipeline depth of the row loop (>= 1).
        host_descriptors: TMA descriptors of both operands encoded on the host at launch
            (True) or built on the device in every program (False).
        gluon: run the persistent, hand-pipelined Gluon kernel
            (:mod:`distmoe.kernels.wgrad_gluon`: one program per SM, one load stream across
            tiles, partial steps zeroed in shared memory) wherever it can run: a Hopper GPU,
            not the interpreter, overwrite mode into a contiguous bf16 output, ``P`` a multiple
            of ``block_out_m``. Elsewhere the Triton kernel runs this config. Needs
            ``split_rows == 1`` and ``block_out_m >= 16 * num_warps``.
        specialized: with ``gluon``, its warp-specialised form (a one-warp TMA producer,
            two warps zeroing each tile's partial last step off the MMA warps' path, no
            branch in their step loop; the same bits). Needs ``gluon`` and
            ``block_out_n <= 128``. 12-15% faster than the plain Gluon kernel at exact
            routing and 17-31% under sampled routing at the T=4096, E=128 and DeepSeek-V3
            shapes (one H200, 2026-11-30, performance.md run 39).
        pingpong: with ``specialized``, ``num_warps`` 4 and ``block_out_m`` 128: two MMA
            warpgroups of 4 warps take the program's tiles in turn (each a whole
            128-row tile), so that one's epilogue (the tile's TMA store) runs under the
            other's MMAs; the same bits. Below 1024 rows per expert a tile is only a few
            row steps, so the epilogue is a large share of it.
        lockstep: with ``specialized``, where B is loaded by TMA (not read through a row
            table, ``w13_wgrad``'s ``x_rows``, which ignores it): the producers start each
            wave of tiles together, counting issued tiles in a zeroed int32 counter
            allocated per launch, so that the waves' A and B rows are read from L2 (the
            forwards' ``lockstep``); the same bits.
    """

    block_m: int = 128
    block_k: int = 64
    block_out_m: int = 128
    block_out_n: int = 128
    split_rows: int = 1
    num_warps: int = 8
    num_stages: int = 4
    host_descriptors: bool = True
    gluon: bool = False
    specialized: bool = False
    pingpong: bool = False
    lockstep: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_k", "block_out_m", "block_out_n"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
            if not (16 <= value <= 256 and value & (value - 1) == 0):
                raise ValueError(f"{name} ({value}) must be a power of two in [16, 256]")
        if self.block_m % self.block_k:
            raise ValueError(
                f"block_k ({self.block_k}) must divide block_m ({self.block_m}): a row step is "
                "at most one padding multiple"
            )
        for name in ("split_rows", "num_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} ({value!r}) must be an int >= 1")
        if self.num_warps not in (4, 8):
            raise ValueError(f"num_warps ({self.num_warps}) must be 4 or 8")
        for name in ("host_descriptors", "gluon", "specialized", "pingpong", "lockstep"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"{name} must be a bool, got {type(getattr(self, name)).__name__}"
                )
        if self.gluon and (self.split_rows != 1 or self.block_out_m < 16 * self.num_warps):
            raise ValueError(
                f"gluon=True needs split_rows == 1 (got {self.split_rows}) and block_out_m >= "
                f"16 * num_warps (got {self.block_out_m} and {self.num_warps} warps)"
            )
        if self.specialized and (not self.gluon or self.block_out_n > 128):
            raise ValueError(
                f"specialized=True needs gluon=True (got {self.gluon}) and block_out_n <= 128 "
                f"(got {self.block_out_n})"
            )
        if self.pingpong and (not self.specialized or self.num_warps != 4
                              or self.block_out_m != 128):
            raise ValueError(
                f"pingpong=True needs specialized=True (got {self.specialized}), num_warps == 4 "
                f"(got {self.num_warps}) and block_out_m == 128 (got {self.block_out_m})"
            )
        if self.lockstep and not self.specialized:
            raise ValueError(f"lockstep=True needs specialized=True (got {self.specialized})")

    def smem_bytes(self) -> int:
        """Shared memory of the row-loop pipeline (bf16 A and B tiles of every stage)."""
        return self.num_stages * self.block_k * (self.block_out_m + self.block_out_n) * 2

    def fits_hopper(self) -> bool:
        """Pipeline SMEM <= 200 KiB and at most 128 fp32 accumulator registers per thread."""
        regs = self.block_out_m * self.block_out_n // (32 * self.num_warps)
        return self.smem_bytes() <= 200 * 1024 and regs <= 128

    @classmethod
    def from_heuristic(cls, *, out_rows: int, out_cols: int, block_m: int = 128,
                       rows_per_expert: int | None = None,
                       device: torch.device | None = None,
                       gathered_b: bool = False) -> WgradConfig:
        """64 rows per step, 8 warps. ``rows_per_expert`` is a *shape* hint (the balanced
        rows per local expert, ``T*K*EP/E``), never a routed count. ``gathered_b``: B's rows
        are read through a row address table (``b_rows``; see :meth:`hopper_gluon`).

        On a Hopper ``device`` (and ``out_rows`` >= 128, a multiple of 8) the persistent Gluon
        kernel (``gluon=True``), warp-specialised: 256 x 128 tiles where an expert's
        gradient holds 12 MiB or more (on an H200, from 1024 rows per expert), else 128 x
        128 tiles, 5 stages: for long row loops (hint >= 1024) with wide weights its 8-warp
        form (two warpgroups on one tile), else its ping-pong form (:meth:`hopper_gluon`).
        First measured with 128 x 256 tiles and 3 stages for the long row loops, plain 128 x
        128 otherwise; on one
        H200 (2026-11-29, ``tools/tune_wgrad.py --quick``, docs/performance.md run 15), against
        the Triton configs below: at T=4096 D=2048 F=768 E=128 K=8, balanced routing, W13
        (x at a device offset) 0.418 against 0.555 ms and W2 0.210 against 0.268; at T=8192
        D=4096 F=2048 E=32 K=8, W13 3.14 against 3.34 ms and W2 1.66 against 1.69.

        Elsewhere (no ``device``, the interpreter, other GPUs) the Triton kernel:

        * long row loops (hint >= 1024) with wide weights: 128 x 256 output tiles, 3 stages
          (144 KiB of SMEM, and the TMA-store staging of the epilogue);
        * otherwise 128 x 128 tiles (narrower for narrow weights), 3 stages, so two CTAs fit
          an SM and one's epilogue overlaps the other's loads.

        Measured on one H200 (2026-11-29, ``tools/tune_wgrad.py``, overwrite mode): at T=8192
        D=4096 F=2048 E=32 K=8, 128x256/4 stages 3.18 ms (W13) and 1.58 ms (W2) against 3.74 and
        1.84 for 128x128/4; at T=4096 D=2048 F=768 E=128 K=8, 128x128/3 stages 0.65 and 0.35 ms
        against 0.99 and 0.54 for 4 stages. With the TMA-store epilogue (a later run, same
        tool): 128x256/3 stages 3.24 and 1.59 ms against 3.36 and 1.62 for 4 stages at the
        first shape; 128x128/3 stages 0.634 and 0.337 ms at the second.
        """
        if gluon_device(device):
            gluon = cls.hopper_gluon(out_rows=out_rows, out_cols=out_cols, block_m=block_m,
                                     rows_per_expert=rows_per_expert, gathered_b=gathered_b,
                                     device_memory=device_memory_bytes(device))
            if gluon is not None:
                return gluon
        if rows_per_expert is not None and rows_per_expert >= 1024 and out_rows >= 128 \
                and out_cols >= 256:
            return cls(block_m=block_m, block_k=min(64, block_m), block_out_m=128,
                       block_out_n=256, num_warps=8, num_stages=3)
        block_out_m = _pow2_clamped(out_rows, 16, 128)
        block_out_n = _pow2_clamped(out_cols, 16, 128)
        num_warps = 8 if block_out_m * block_out_n >= 128 * 128 else 4
        return cls(
            block_m=block_m,
            block_k=min(64, block_m),
            block_out_m=block_out_m,
            block_out_n=block_out_n,
            num_warps=num_warps,
            num_stages=3,
        )

    @classmethod
    def hopper_gluon(cls, *, out_rows: int, out_cols: int, block_m: int = 128,
                     rows_per_expert: int | None = None, gathered_b: bool = False,
                     device_memory: int | None = None) -> WgradConfig | None:
        """The Gluon config :meth:`from_heuristic` picks on a Hopper device (None where the
        Gluon kernel does not apply: ``out_rows`` under 128 or not a multiple of 8,
        ``block_m`` < 64). ``out_rows`` need not be a multiple of the tile: an expert's last
        row block is stored clipped (:func:`~distmoe.kernels.wgrad_gluon.launch_gluon_wgrad`;
        D = 2880 at GPT-OSS).

        With ``gathered_b`` (B's rows copied by address, ``cp.async``, rather than by TMA) and
        ``out_rows`` a multiple of 256: the warp-specialised kernel with 256 x 128 tiles, 8
        MMA warps and 3 stages, which loads each B row once per 256 output rows instead of
        128. Kernel alone, one H200 (2026-12-04, ``tools/tune_wgrad.py --quick --routing
        random``, performance.md run 47): 0.453 against 0.499 ms for the ping-pong 128 x 128
        tiles at T=4096 D=2048 F=768 E=128 K=8 (TMA-fed: 0.401), 3.129 against 3.817 ms for
        the two cooperating warpgroups at T=8192 D=4096 F=2048 E=32 K=8 (TMA-fed: 3.344).

        B loaded by TMA, the same 256 x 128 tiles where one expert's gradient holds at least
        :data:`~distmoe.kernels._common.WGRAD_WIDE_TILE_EXPERT_BYTES` (12 MiB;
        :func:`~distmoe.kernels._common.wgrad_wide_tiles`), whatever the rows per expert:
        layer fwd+bwd with both WGRADs so, one H100 (2026-12-05, ``tools/ab_interleaved.py
        --variant wide=wgrad:block_out_m=256,num_warps=8,num_stages=3,pingpong=False``, 9
        rounds, performance.md run 54), sampled / exact routing: DeepSeek-V3 1.049x / 1.081x,
        DeepSeek-V4-Flash 1.132x / 1.097x, GPT-OSS-120B 1.021x (sampled), T=8192 D=4096
        F=2048 E=32 K=8 1.090x / 1.099x; below it OLMoE 0.969x, T=2048 D=2048 F=768 E=128
        1.001x, the same at T=16384 0.991x / 0.994x. On one H200 the last of the first four
        read 16.29 against 16.42 ms (run 47, 7 rounds); the others are unmeasured there.
        From :data:`~distmoe.kernels._common.WGRAD_LOCKSTEP_EXPERT_BYTES` (48 MiB an expert,
        :func:`~distmoe.kernels._common.wgrad_lockstep`) their producers run in lockstep:
        DeepSeek-V3's W13 WGRAD (56 MiB) read its inputs from DRAM 4.5 times without it
        (Nsight Compute, E=64) and once with it, alone 8.09 against 5.74 ms at 128 rows per
        expert; the layer 1.050x faster under sampled routing with the W13 WGRAD's on, 1.11x
        under exact routing with both (one H100, 2026-12-06, ``--variant
        ls13=w13_wgrad:lockstep=True``, performance.md run 55); at 28-32 MiB even to 1%
        slower under sampled routing.
        ``device_memory`` (bytes; ``None``: not known): on an HBM3e-class device (an H200,
        :data:`~distmoe.kernels._common.HBM3E_MEMORY_BYTES`) the 256 x 128 tiles need a
        ``rows_per_expert`` hint of at least 1024 as well
        (:data:`~distmoe.kernels._common.WGRAD_WIDE_TILE_ROWS_HBM3E`): on one H200 the
        ping-pong tiles below were 2.5-4.8% faster at 96-128 rows per expert (DeepSeek-V3,
        V4-Flash, GPT-OSS-120B), the 256 x 128 tiles 2.8% faster at 2048 (one H200,
        2026-12-06, performance.md run 57).
        Elsewhere, two cooperating warpgroups from 1024 rows per expert with outputs at least
        256 wide, else the ping-pong form."""
        if block_m < 64 or out_rows % 8 or out_rows < 128:
            return None
        wide = cls(block_m=block_m, block_k=64, block_out_m=256, block_out_n=128,
                   num_warps=8, num_stages=3, gluon=True, specialized=True)
        if gathered_b and out_rows % 256 == 0 and out_cols >= 128:
            return wide
        keys = dict(out_rows=out_rows, out_cols=out_cols, rows_per_expert=rows_per_expert,
                    device_memory=device_memory)
        if not gathered_b and wgrad_wide_tiles(**keys):
            return replace(wide, lockstep=wgrad_lockstep(**keys))
        if rows_per_expert is not None and rows_per_expert >= 1024 and out_cols >= 256:
            # the warp-specialised kernel, two warpgroups cooperating on a 128 x 128 tile: the
            # layer fwd+bwd 1.3-1.5% faster than with the plain 128 x 256 one (one H200,
            # 2026-12-01, run 42: T=8192 D=4096 F=2048 E=32 K=8 both routings, 13 rounds;
            # T=16384 D=2048 F=768 E=128 K=8 sampled, 9 rounds; tools/ab_interleaved.py)
            return cls(block_m=block_m, block_k=64, block_out_m=128, block_out_n=128,
                       num_warps=8, num_stages=5, gluon=True, specialized=True)
        return cls(block_m=block_m, block_k=64, block_out_m=128,
                   block_out_n=_pow2_clamped(out_cols, 16, 128), num_warps=4, num_stages=5,
                   gluon=True, specialized=True, pingpong=True)

    @classmethod
    def all_configs(cls, *, out_rows: int, out_cols: int, block_m: int = 128) -> list[WgradConfig]:
        """Tuning candidates that fit an SM90."""
        out = []
        for block_out_m in (64, 128, 256):
            for block_out_n in (64, 128, 256):
                for block_k in (32, 64, 128):
                    for num_stages in (3, 4, 5):
                        for split_rows in (1, 2, 4):
                            for num_warps in (4, 8):
                                if block_m % block_k:
                                    continue
                                cfg = cls(
                                    block_m=block_m,
                                    block_k=block_k,
                                    block_out_m=min(block_out_m, _pow2_clamped(out_rows, 16, 256)),
                                    block_out_n=min(block_out_n, _pow2_clamped(out_cols, 16, 256)),
                                    split_rows=split_rows,
                                    num_warps=num_warps,
                                    num_stages=num_stages,
                                )
                                if cfg.fits_hopper() and cfg not in out:
                                    out.append(cfg)
        return out


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def check_disjoint(
    named: dict[str, torch.Tensor], *, same_ok: tuple[str, str] | None = None
) -> None:
    """Raise ``ValueError`` if two of the tensors share bytes (``same_ok`` names one pair that
    may be the identical tensor storage, e.g. an in-place output)."""
    items = [(n, t) for n, t in named.items() if t is not None and t.numel() > 0]
    for i, (name_a, a) in enumerate(items):
        lo_a, hi_a = byte_range(a)
        for name_b, b in items[i + 1 :]:
            lo_b, hi_b = byte_range(b)
            if lo_a < hi_b and lo_b < hi_a:
                identical = (lo_a, hi_a) == (lo_b, hi_b) and a.shape == b.shape
                if identical and same_ok is not None and {name_a, name_b} == set(same_ok):
                    continue
                raise ValueError(
                    f"{name_a} and {name_b} must not overlap in memory, got "
                    f"[{lo_a:#x}, {hi_a:#x}) and [{lo_b:#x}, {hi_b:#x})"
                )


def check_device_scalar(name: str, value: object, rule: str) -> None:
    """A device-side int64 ``[1]`` argument (offset or address); ``rule`` says what it holds."""
    check_tensor(name, value, dtypes=(torch.int64,), shape=[1], shape_text=rule)


def check_base_tensor(name: str, value: object, offset_name: str, row_text: str) -> None:
    """The 1-D contiguous bf16 base that ``offset_name`` indexes (16-byte aligned start)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != 1:
        raise ValueError(
            f"{name} must be a 1-D bf16 base tensor when {offset_name} is given "
            f"({row_text}), got shape {list(value.shape)}"
        )
    check_tensor(name, value, dtypes=(torch.bfloat16,), ndim=1, shape_text=f"({row_text})")
    if value.data_ptr() % 16:
        raise ValueError(
            f"{name} must start at a 16-byte aligned address ({offset_name} counts from it and "
            f"activation rows are 16-byte aligned), got {value.data_ptr():#x}"
        )


def check_activation_rows(name: str, value: object, width: int, width_text: str) -> int:
    """A 2-D bf16 ``[R_act, width]`` tensor in activation rows; returns ``R_act``."""
    check_tensor(name, value, dtypes=(torch.bfloat16,), ndim=2, shape_text=f"[R_act, {width_text}]")
    if value.shape[1] != width:
        raise ValueError(
            f"{name} must have shape [R_act, {width}] ([R_act, {width_text}], activation rows), "
            f"got {list(value.shape)}"
        )
    return value.shape[0]


def check_row_table(name: str, table: object) -> int:
    """An int64 ``[R_cap]`` table of absolute row addresses; returns ``R_cap``."""
    check_tensor(name, table, dtypes=(torch.int64,), ndim=1, shape_text="[R_cap]")
    return table.shape[0]


def check_rows_cap(num_rows: int, block_m: int) -> None:
    """``R_cap`` must be a multiple of the padding multiple ``block_m``."""
    if num_rows % block_m:
        raise ValueError(
            f"R_cap ({num_rows}) must be a multiple of config.block_m ({block_m}), the padding "
            "multiple of the expert segments"
        )


def check_wgrad_config(config: object, *, out_rows: int, out_cols: int,
                       accumulate: bool = True) -> WgradConfig:
    if not isinstance(accumulate, bool):
        raise TypeError(f"accumulate must be a bool, got {type(accumulate).__name__}")
    if config is None:
        config = WgradConfig.from_heuristic(out_rows=out_rows, out_cols=out_cols)
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
        from .wgrad_gluon import gluon_gather_reason, gluon_wgrad_supported, launch_gluon_wgrad

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


def w2_dgrad_swiglu_bwd(
    grad_h3_ptrs: torch.Tensor,
    padded_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    w2: torch.Tensor,
    h1: torch.Tensor,
    grad_h1_out: torch.Tensor,
    *,
    h1_offset: torch.Tensor | None = None,
    h2_out: torch.Tensor | None = None,
    grad_h3_out: torch.Tensor | None = None,
    grad_h3_rows: torch.Tensor | None = None,
    scored_rows: bool = False,
    config: W2DgradConfig | None = None,
) -> None:
    """W2 DGRAD + SwiGLU backward: padded tile schedule, compact activation rows (module
    docstring).

    Args:
        grad_h3_ptrs: int64 ``[R_cap]``, indexed by padded row: absolute byte addresses of the
            bf16 ``grad_h3`` rows (``D`` values each, 16-byte aligned; 0 = null row, read as
            zeros). Entries of padding and idle rows are never read.
        padded_offsets: int32 ``[E_local + 1]``, the expert segments of padded rows (multiples
            of ``config.block_m``); rows at/after ``padded_offsets[E_local]`` are idle.
        row_offsets: int32 ``[E_local + 1]``, exclusive prefix sum of the live rows per expert
            (``n_e <=`` the expert's padded segment length): padded row
            ``padded_offsets[e] + j`` is live iff ``j < n_e``, at activation row
            ``row_offsets[e] + j``.
        w2: bf16 ``[E_local, D, F]``.
        h1: the forward's ``[g | u]`` in activation rows: bf16 ``[R_act, 2F]`` like
            ``grad_h1_out``; or, with ``h1_offset``, a 1-D contiguous bf16 base tensor
            (16-byte aligned start) with activation row ``a`` at ``h1 + h1_offset[0] + a*2F``.
            Rows of null and padding rows are not read.
        grad_h1_out: bf16 ``[R_act, 2F]`` (``R_act >= row_offsets[E_local]``), receives
            ``[grad_g | grad_u]`` on the live rows. May be exactly the memory that h1 reads
            (in place, the same rows): each program loads its h1 elements before it stores
            the same elements of grad_h1 (module docstring). Without ``h1_offset`` that means
            ``grad_h1_out`` is ``h1`` (the identical tensor; any other overlap is an error);
            with it the overlap is not checked (the offset lives on the device).
        h1_offset: optional int64 ``[1]`` device tensor, the bf16 element offset of activation
            row 0 in ``h1`` (a multiple of 8 elements: 16-byte aligned rows; not checked).
        h2_out: optional bf16 ``[R_act, F]``, receives ``silu(g) * u`` on the live rows.
        grad_h3_out: optional bf16 ``[R_act, D]``, receives the gathered ``grad_h3`` rows on the
            live rows (zeros for null rows); also switches on the gather-once path.
        grad_h3_rows: optional bf16 ``[R_act, D]``, the ``grad_h3`` rows already in activation
            rows (the layer's owners push them there, :func:`distmoe.kernels.route_grad.
            push_route_grads`): nothing is gathered, ``grad_h3_ptrs`` only marks null rows (whose
            rows must hold zeros, or at least finite values). Not with ``grad_h3_out``.
        scored_rows: the expert computes the score gradients (with ``grad_h3_rows``, which
            then hold the *unscaled* output gradients ``g``; :func:`distmoe.kernels.route_grad.
            push_route_grads`). The address of every live non-null row in ``grad_h3_ptrs``
            holds the route's fp32 score ``s`` in its first 4 bytes (the owner's route row).
            The SwiGLU backward then runs on ``s * (g @ W2)``, ``h2_out`` receives
            ``bf16(s * h2)`` (so that ``w2_wgrad(grad_h3_rows, h2_out)`` is ``grad_W2``), and
            column tile ``j`` of F (``config.block_n`` wide) writes the fp32
            ``dot(g @ W2, h2)`` over its columns at fp32 value ``1 + j`` of that address:
            the rows must hold ``1 + ceil(F / block_n)`` fp32 values (not checked: addresses
            live on the device). Null rows get no parts.
        config: :class:`W2DgradConfig`; ``None`` = ``from_heuristic`` with ``block_m`` 128.

    D and F must be multiples of 8. Live rows of every output are written (null rows as
    zeros); activation rows at/after ``row_offsets[E_local]`` are left untouched. Nothing is
    read on the host from the device tensors (no synchronisation).
    """
    check_tensor("w2", w2, dtypes=(torch.bfloat16,), ndim=3, shape_text="[E_local, D, F]")
    num_experts, hidden, ffn = w2.shape
    check_width("D (w2.shape[1])", hidden)
    check_width("F (w2.shape[2])", ffn)
    if num_experts < 1:
        raise ValueError(f"w2 must hold at least one expert, got shape {list(w2.shape)}")
    num_rows = check_row_table("grad_h3_ptrs", grad_h3_ptrs)
    check_offsets(padded_offsets, row_offsets, num_experts)
    num_act = check_activation_rows("grad_h1_out", grad_h1_out, 2 * ffn, "2F")
    if h1_offset is None:
        check_tensor(
            "h1",
            h1,
            dtypes=(torch.bfloat16,),
            shape=[num_act, 2 * ffn],
            shape_text="[R_act, 2F] like grad_h1_out (or a 1-D base with h1_offset)",
        )
    else:
        check_device_scalar("h1_offset", h1_offset, "[1] (bf16 element offset of h1's row 0)")
        check_base_tensor("h1", h1, "h1_offset", "row a at h1 + h1_offset[0] + a*2F")
    if h2_out is not None:
        check_tensor(
            "h2_out",
            h2_out,
            dtypes=(torch.bfloat16,),
            shape=[num_act, ffn],
            shape_text="[R_act, F] like grad_h1_out",
        )
    if grad_h3_out is not None and grad_h3_rows is not None:
        raise ValueError("grad_h3_out and grad_h3_rows exclude each other (gather the rows, or "
                         "pass rows already gathered), got both")
    if not isinstance(scored_rows, bool):
        raise TypeError(f"scored_rows must be a bool, got {type(scored_rows).__name__}")
    if scored_rows and grad_h3_rows is None:
        raise ValueError("scored_rows needs grad_h3_rows (the row addresses then point at the "
                         "scores, not at grad_h3 rows to gather), got grad_h3_rows=None")
    h3_name = "grad_h3_out" if grad_h3_rows is None else "grad_h3_rows"
    gathered = grad_h3_out if grad_h3_rows is None else grad_h3_rows
    if gathered is not None:
        check_tensor(
            h3_name,
            gathered,
            dtypes=(torch.bfloat16,),
            shape=[num_act, hidden],
            shape_text="[R_act, D] like grad_h1_out",
        )
        check_tma_aligned(h3_name, gathered)
    check_tma_aligned("w2", w2)
    named = {
        "grad_h3_ptrs": grad_h3_ptrs,
        "padded_offsets": padded_offsets,
        "row_offsets": row_offsets,
        "w2": w2,
        "h1": h1,
        "grad_h1_out": grad_h1_out,
    }
    if h1_offset is not None:
        named["h1_offset"] = h1_offset
    if h2_out is not None:
        named["h2_out"] = h2_out
    if gathered is not None:
        named[h3_name] = gathered
    device = check_devices(named)
    if h1_offset is not None:
        # The rows h1 reads start at a device-side offset: the host cannot tell them apart
        # from the rest of the base (often the whole activation buffer), so the base is left
        # out of the overlap check.
        del named["h1"]
    check_disjoint(named, same_ok=("h1", "grad_h1_out"))
    if config is None:
        config = W2DgradConfig.from_heuristic(hidden=hidden, ffn=ffn)
    elif not isinstance(config, W2DgradConfig):
        raise TypeError(f"config must be a W2DgradConfig or None, got {type(config).__name__}")
    check_rows_cap(num_rows, config.block_m)
    if num_rows == 0 or num_act == 0:
        return  # no padded rows, or (R_act >= row_offsets[E]) no live rows

    if config.gluon:
        from .w2_dgrad_gluon import gluon_w2_dgrad_reason, launch_gluon_w2_dgrad

        reason = ("it reads rows already gathered (grad_h3_rows)" if grad_h3_rows is None
                  else gluon_w2_dgrad_reason(device, hidden=hidden, ffn=ffn,
                                             block_m=config.block_m, block_n=config.block_n,
                                             block_k=config.block_k))
        if reason is None:
            launch_gluon_w2_dgrad(grad_h3_ptrs, padded_offsets, row_offsets, w2, grad_h3_rows,
                                  h1, grad_h1_out, h1_offset=h1_offset, h2_out=h2_out,
                                  scored_rows=scored_rows, group_m=config.group_m,
                                  stages=config.num_stages, h1_prefetch=config.h1_prefetch,
                                  epilogue_warps=config.epilogue_warps,
                                  epilogue_buffers=config.epilogue_buffers,
                                  epilogue_early_h1=config.epilogue_early_h1,
                                  lockstep=config.lockstep,
                                  expert_groups=config.expert_groups)
            return
        warn_gluon_fallback("w2_dgrad_swiglu_bwd", reason)
    gather_in_loop = gathered is None
    w2_arg, rows_arg = w2, grad_h3_ptrs if gather_in_loop else gathered
    if config.host_descriptors:
        w2_arg = TensorDescriptor(
            w2,
            shape=[num_experts, hidden, ffn],
            strides=[hidden * ffn, ffn, 1],
            block_shape=[1, config.block_k, config.block_n],
        )
        if not gather_in_loop:
            rows_arg = TensorDescriptor(
                gathered,
                shape=[num_act, hidden],
                strides=[hidden, 1],
                block_shape=[config.block_m, config.block_k],
            )
    else:
        ensure_tma_allocator()
    experts_pow2 = next_power_of_2(num_experts)
    with device_context(device):
        if grad_h3_out is not None:
            block_cols = _pow2_clamped(hidden, 16, 512)
            _gather_rows_kernel[(num_rows // _GATHER_BLOCK_ROWS, triton.cdiv(hidden, block_cols))](
                grad_h3_ptrs,
                padded_offsets,
                row_offsets,
                grad_h3_out,
                WIDTH=hidden,
                NUM_EXPERTS=num_experts,
                EXPERTS_POW2=experts_pow2,
                BLOCK_ROWS=_GATHER_BLOCK_ROWS,
                BLOCK_COLS=block_cols,
                num_warps=4,
            )
        num_tiles_cap = (num_rows // config.block_m) * triton.cdiv(ffn, config.block_n)
        _w2_dgrad_swiglu_kernel[(gemm_grid(config, num_tiles_cap, device),)](
            grad_h3_ptrs,
            rows_arg,
            padded_offsets,
            row_offsets,
            w2_arg,
            h1,
            h1_offset if h1_offset is not None else row_offsets,  # placeholder: never read
            grad_h1_out,
            h2_out if h2_out is not None else grad_h1_out,  # placeholder: never touched
            num_rows,
            num_act,
            HIDDEN=hidden,
            FFN=ffn,
            NUM_EXPERTS=num_experts,
            EXPERTS_POW2=experts_pow2,
            GATHER_IN_LOOP=gather_in_loop,
            STORE_H2=h2_out is not None,
            SCORED=scored_rows,
            HOST_DESC=config.host_descriptors,
            H1_OFFSET=h1_offset is not None,
            PERSISTENT=config.persistent,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            GROUP_M=config.group_m,
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
            (``grad_h3_out`` of :func:`w2_dgrad_swiglu_bwd`; null rows zeros or finite).
        h2: bf16 ``[R_act, F]`` (``h2_out`` of :func:`w2_dgrad_swiglu_bwd`).
        padded_offsets: int32 ``[E_local + 1]``, validated with the rest of the layout; the row
            walk itself needs only ``row_offsets`` (padding rows have no activation rows).
        row_offsets: int32 ``[E_local + 1]``, exclusive prefix sum of the live rows per expert
            (``R_act >= row_offsets[E_local]``). Rows past an expert's end that its last row
            step loads are zeroed, so they may hold anything, NaN included.
        grad_w2: fp32 ``[E_local, D, F]``, accumulated into (experts without rows untouched);
            fp32 or bf16 with ``accumulate=False``.
        config: :class:`WgradConfig`; ``None`` = ``from_heuristic`` with ``block_m`` 128.
    """
    out_dtypes = (torch.float32,) if accumulate else (torch.float32, torch.bfloat16)
    check_tensor("grad_w2", grad_w2, dtypes=out_dtypes, ndim=3, shape_text="[E_local, D, F]")
    num_experts, hidden, ffn = grad_w2.shape
    check_width("D (grad_w2.shape[1])", hidden)
    check_width("F (grad_w2.shape[2])", ffn)
    num_act = check_activation_rows("grad_h3", grad_h3, hidden, "D")
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


# --------------------------------------------------------------------------------------------
# References (plain PyTorch; they read the offsets on the host)
# --------------------------------------------------------------------------------------------


def compact_segments(
    padded_offsets: torch.Tensor, row_offsets: torch.Tensor
) -> list[tuple[int, int, int]]:
    """``[(padded_start, act_start, n_e)]`` per local expert (host copy: references and tests
    only). Raises ``ValueError`` where the layout breaks its rules (``row_offsets[0] = 0``,
    ``0 <= n_e <=`` the padded segment length)."""
    padded = padded_offsets.detach().to("cpu", torch.int64).tolist()
    rows = row_offsets.detach().to("cpu", torch.int64).tolist()
    if len(padded) != len(rows):
        raise ValueError(
            f"row_offsets must have {len(padded)} entries like padded_offsets, got {len(rows)}"
        )
    if rows[0] != 0:
        raise ValueError(f"row_offsets[0] ({rows[0]}) must be 0")
    out = []
    for e in range(len(padded) - 1):
        count, seg = rows[e + 1] - rows[e], padded[e + 1] - padded[e]
        if not 0 <= count <= seg:
            raise ValueError(
                f"expert {e} has {count} live rows (row_offsets), which must be in [0, {seg}] "
                "(its padded segment length)"
            )
        out.append((padded[e], rows[e], count))
    return out


def w2_dgrad_swiglu_bwd_ref(
    grad_h3_ptrs: torch.Tensor,
    padded_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    w2: torch.Tensor,
    h1: torch.Tensor,
    *,
    row_sources: list[torch.Tensor],
    row_scores: torch.Tensor | None = None,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | tuple[torch.Tensor, ...]:
    """Reference of :func:`w2_dgrad_swiglu_bwd` in fp32.

    ``h1`` is bf16 ``[R_act, 2F]`` in activation rows; ``row_sources`` are the tensors that
    ``grad_h3_ptrs`` points into. Returns ``(grad_h1 [R_act, 2F], h2 [R_act, F],
    grad_h3 [R_act, D])`` in fp32 activation rows, without rounding to bf16; null rows and rows
    at/after ``row_offsets[E_local]`` are zeros (the kernel leaves the latter untouched).

    ``row_scores`` (fp32 ``[R_act]``, with ``block_n``): the ``scored_rows`` contract with the
    grad_h3 rows given by ``row_sources`` (unscaled) and the scores per activation row;
    ``grad_h1`` and ``h2`` are then the scaled results, and a fourth value is returned: the
    score parts ``[R_act, ceil(F / block_n)]`` (fp32 h2 in the dot, like the kernel).
    """
    hidden, ffn = w2.shape[1], w2.shape[2]
    num_act = h1.shape[0]
    device = h1.device
    grad_h1 = torch.zeros(num_act, 2 * ffn, dtype=torch.float32, device=device)
    h2 = torch.zeros(num_act, ffn, dtype=torch.float32, device=device)
    gathered = torch.zeros(num_act, hidden, dtype=torch.float32, device=device)
    num_parts = 0 if row_scores is None else -(-ffn // block_n)
    parts = torch.zeros(num_act, num_parts, dtype=torch.float32, device=device)
    zero = torch.zeros((), device=device)
    for e, (pad, act, count) in enumerate(compact_segments(padded_offsets, row_offsets)):
        if count == 0:
            continue
        ptrs = grad_h3_ptrs[pad : pad + count]
        live = (ptrs != 0).to(device)[:, None]
        gh3 = rows_at(ptrs, row_sources, row_elems=hidden, name="grad_h3_ptrs").to(device)
        gh3 = torch.where(live, gh3, zero)
        rows = slice(act, act + count)
        grad_h2 = gh3 @ w2[e].float()
        g = torch.where(live, h1[rows, :ffn].float(), zero)
        u = torch.where(live, h1[rows, ffn:].float(), zero)
        s = torch.sigmoid(g)
        h2_rows = g * s * u
        if row_scores is not None:
            score = torch.where(live, row_scores[rows, None].float(), zero)
            prod = grad_h2 * h2_rows
            for j in range(num_parts):
                parts[rows, j] = prod[:, j * block_n:(j + 1) * block_n].sum(dim=1)
            grad_h2 = grad_h2 * score
            h2_rows = h2_rows * score
        grad_h1[rows, :ffn] = grad_h2 * u * s * (1 + g * (1 - s))
        grad_h1[rows, ffn:] = grad_h2 * g * s
        h2[rows] = h2_rows
        gathered[rows] = gh3
    if row_scores is not None:
        return grad_h1, h2, gathered, parts
    return grad_h1, h2, gathered


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
