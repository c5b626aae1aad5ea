"""W2 backward: DGRAD with the SwiGLU backward fused into its epilogue.

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
    :func:`distmoe.kernels.movement.route_grad.reduce_routes` sums them). The epilogue then runs in
    twice as many column parts (registers).
    Grid: one program per (row tile, ``block_n`` columns of F) of the ``R_cap`` bound, or with
    ``persistent`` one program per SM (at most one per tile of the bound), each walking the
    live tiles ``padded_offsets[E] / block_m * ceil(F / block_n)`` (a device value) with a
    stride of the grid; its descriptors are built, and ``h1_offset`` read, once per program.
    Every tile is computed the same way on both grids (bit-identical outputs). The row gather
    of the gather-once path keeps its own grid (``R_cap / 16`` row blocks).

Requirements (device-side, not checked): the layout rules above; non-null row addresses
16-byte aligned; ``h1_offset[0]`` a multiple of 8 elements (16 bytes: activation rows are
16-byte aligned, like the slot cursor's 128-byte steps) and the base holding
``h1_offset[0] + row_offsets[E_local]*2F`` elements.

Sync points: none inside; kernel boundaries order the launches. Grids are sized from
``R_cap``, ``E_local``, the weight shapes and (persistent DGRAD) the SM count only (CUDA-graph
safe, no host synchronisation).
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
    check_row_table,
    check_rows_cap,
    check_tensor,
    check_tma_aligned,
    check_width,
)
from distmoe.kernels.base.config import next_power_of_2, pow2_clamped
from distmoe.kernels.base.device import (
    device_context,
    ensure_tma_allocator,
    gemm_grid,
    warn_gluon_fallback,
)
from distmoe.kernels.base.rows import compact_segments, rows_at
from distmoe.kernels.base.tiles import column_halves, swizzle_tile, tile_expert, tile_live_rows
from distmoe.kernels.w2_dgrad import gluon as w2_dgrad_gluon
from distmoe.kernels.w2_dgrad.config import W2DgradConfig

# Rows of the standalone row-gather program (a divisor of every legal block_m, so a block
# never straddles two expert segments).
_GATHER_BLOCK_ROWS = 16


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


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
        # need about 180 on SM90 (ptxas). A 128 x 256 tile in halves spills 560-600 bytes
        # per thread; in quarters none. SCORED needs twice the parts (128 x 256 in quarters:
        # 292 bytes of spills, in eighths none; 128 x 128 in halves: 4 bytes).
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
        lo, hi = column_halves(x, ROWS, COLS)
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
        lo, hi = column_halves(x, ROWS, COLS)
        part = _swiglu_bwd_epilogue(lo, h1_ptr, grad_h1_ptr, h2_ptr, act_rows, is_live, is_row,
                                    col0, score, FFN, HALF, STORE_H2, SCORED)
        part += _swiglu_bwd_epilogue(hi, h1_ptr, grad_h1_ptr, h2_ptr, act_rows, is_live,
                                     is_row, col0 + HALF, score, FFN, HALF, STORE_H2, SCORED)
    else:
        QUARTER: tl.constexpr = COLS // 4
        lo, hi = column_halves(x, ROWS, COLS)
        q0, q1 = column_halves(lo, ROWS, COLS // 2)
        part = _swiglu_bwd_epilogue(q0, h1_ptr, grad_h1_ptr, h2_ptr, act_rows, is_live, is_row,
                                    col0, score, FFN, QUARTER, STORE_H2, SCORED)
        part += _swiglu_bwd_epilogue(q1, h1_ptr, grad_h1_ptr, h2_ptr, act_rows, is_live,
                                     is_row, col0 + QUARTER, score, FFN, QUARTER, STORE_H2,
                                     SCORED)
        q2, q3 = column_halves(hi, ROWS, COLS // 2)
        part += _swiglu_bwd_epilogue(q2, h1_ptr, grad_h1_ptr, h2_ptr, act_rows, is_live,
                                     is_row, col0 + 2 * QUARTER, score, FFN, QUARTER, STORE_H2,
                                     SCORED)
        part += _swiglu_bwd_epilogue(q3, h1_ptr, grad_h1_ptr, h2_ptr, act_rows, is_live,
                                     is_row, col0 + 3 * QUARTER, score, FFN, QUARTER, STORE_H2,
                                     SCORED)
    return part


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


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


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
            rows (the layer's owners push them there, :func:`distmoe.kernels.movement.route_grad.
            push_route_grads`): nothing is gathered, ``grad_h3_ptrs`` only marks null rows (whose
            rows must hold zeros, or at least finite values). Not with ``grad_h3_out``.
        scored_rows: the expert computes the score gradients (with ``grad_h3_rows``, which
            then hold the *unscaled* output gradients ``g``;
            :func:`distmoe.kernels.movement.route_grad.push_route_grads`). The address of every
            live non-null row in ``grad_h3_ptrs`` holds the route's fp32 score ``s`` in its first 4
            bytes (the owner's route row). The SwiGLU backward then runs on ``s * (g @ W2)``,
            ``h2_out`` receives ``bf16(s * h2)`` (so that ``w2_wgrad(grad_h3_rows, h2_out)`` is
            ``grad_W2``), and column tile ``j`` of F (``config.block_n`` wide) writes the fp32
            ``dot(g @ W2, h2)`` over its columns at fp32 value ``1 + j`` of that address:
            the rows must hold ``1 + ceil(F / block_n)`` fp32 values (not checked: addresses
            live on the device). Null rows get no parts.
        config: :class:`W2DgradConfig`; ``None`` = ``for_widths`` with ``block_m`` 128.

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
    num_act = check_activation_width("grad_h1_out", grad_h1_out, 2 * ffn, "2F")
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
        config = W2DgradConfig.for_widths(hidden=hidden, ffn=ffn)
    elif not isinstance(config, W2DgradConfig):
        raise TypeError(f"config must be a W2DgradConfig or None, got {type(config).__name__}")
    check_rows_cap(num_rows, config.block_m)
    if num_rows == 0 or num_act == 0:
        return  # no padded rows, or (R_act >= row_offsets[E]) no live rows

    if config.gluon:
        reason = ("it reads rows already gathered (grad_h3_rows)" if grad_h3_rows is None
                  else w2_dgrad_gluon.gluon_w2_dgrad_reason(
                      device, hidden=hidden, ffn=ffn, block_m=config.block_m,
                      block_n=config.block_n, block_k=config.block_k))
        if reason is None:
            w2_dgrad_gluon.launch_gluon_w2_dgrad(
                grad_h3_ptrs, padded_offsets, row_offsets, w2, grad_h3_rows, h1, grad_h1_out,
                h1_offset=h1_offset, h2_out=h2_out, scored_rows=scored_rows, group_m=config.group_m,
                stages=config.num_stages, epilogue_warps=config.epilogue_warps,
                epilogue_buffers=config.epilogue_buffers, lockstep=config.lockstep,
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
            block_cols = pow2_clamped(hidden, 16, 512)
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


# --------------------------------------------------------------------------------------------
# Reference (plain PyTorch; it reads the offsets on the host)
# --------------------------------------------------------------------------------------------


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
