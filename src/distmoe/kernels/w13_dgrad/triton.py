"""W13 backward: DGRAD with a scatter epilogue that returns route input gradients.

Row layout: the padded tile schedule and compact activation rows of
:mod:`distmoe.kernels.w2_dgrad.triton` (``padded_offsets`` schedules the tiles and indexes
``scatter_ptrs``; ``row_offsets`` maps live padded row ``padded_offsets[e] + j``, ``j < n_e``,
to activation row ``row_offsets[e] + j``; padding rows have no activation row; ``grad_h1`` and
``x_gathered`` are in activation rows, ``[R_act, width]`` with ``R_act >= row_offsets[E_local]``).
Per live row, with ``grad_h1 = [grad_g | grad_u]`` from
:func:`distmoe.kernels.w2_dgrad.triton.w2_dgrad_swiglu_bwd` and ``W13 = w13[e]`` viewed
``[2F, D]``::

    grad_x_route = grad_h1 @ W13              [R, 2F] @ [2F, D], fp32 accumulation -> bf16
    grad_W13[e] += grad_h1_e^T @ x_e          fp32 [2F, D] (= [2, F, D])

:func:`w13_dgrad_scatter`
    One program per (padded row tile, ``block_n`` columns of D) of the ``R_cap`` bound; idle
    tiles and tiles of padding rows only exit at once. With ``persistent``: one program per SM
    (at most one per tile of the bound), each walking the live tiles (their count read on the
    device from ``padded_offsets[E]``) with a stride of the grid, or (``dynamic``) taking
    each next tile from a device counter, its descriptors built once; every tile is computed
    the same way on both grids. ``pair_tails``: an expert's short last tile is computed with
    the tile before it, the weight tiles loaded once for both (:class:`W13DgradConfig`).
    ``grad_h1`` (local, contiguous) and the weights come through TMA descriptors
    (``[R_act, 2F]`` and ``[E, 2F, D]``; encoded on the host at launch by default, or built
    in every program). A tile reads the ``block_m`` activation rows that follow its first
    row's; its padding rows thereby read the next expert's rows, rows past the live end or
    TMA zeros, and their results are discarded. The epilogue stores each live bf16 row with
    a plain ``tl.store`` to ``scatter_ptrs[row]`` (indexed by padded row), an absolute
    address (usually route slot ``t*K + k`` of the token owner's dispatch buffer, possibly
    in a peer's memory); 0 = skip. Entries of padding and idle rows are never read (masked
    loads). Never a TMA store: the owner reads these rows after a release/acquire signal,
    and in triton 3.6 a later release does not order a TMA store. Every destination row is
    written by exactly one program per column tile, so no atomics. With
    ``W13DgradConfig.gluon`` (where :mod:`distmoe.plan` picks it), the warp-specialised Gluon
    kernel of the W2 forward runs it instead (:func:`~distmoe.kernels.w13_dgrad.gluon.\
launch_gluon_w13_dgrad`: same tiles read, same stores, one program per SM).

Requirements (device-side, not checked): the layout rules; non-null scatter addresses 16-byte
aligned; ``x_offset[0]`` a multiple of 8 elements (16-byte aligned TMA base) and the base
holding ``x_offset[0] + row_offsets[E_local]*D`` elements.

Sync points: none inside. The caller signals the owners after ``w13_dgrad_scatter``
(barrier) before they run ``reduce_routes``. Grids come from ``R_cap``, ``E_local``, the
weight shapes and (persistent DGRAD) the SM count (no host synchronisation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from distmoe.kernels.base.checks import (
    check_activation_width,
    check_devices,
    check_offsets,
    check_row_table,
    check_rows_cap,
    check_tensor,
    check_tma_aligned,
    check_width,
)
from distmoe.kernels.base.config import next_power_of_2
from distmoe.kernels.base.device import (
    config_gluon_reason,
    device_context,
    ensure_tma_allocator,
    gemm_grid,
    warn_gluon_fallback,
)
from distmoe.kernels.base.rows import compact_segments
from distmoe.kernels.base.tiles import swizzle_tile, tile_expert, tile_live_rows
from distmoe.kernels.w13_dgrad import gluon as w13_dgrad_gluon
from distmoe.kernels.w13_dgrad.config import W13DgradConfig

# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _w13_dgrad_descs(
    grad_h1,
    w13,
    num_act_rows,
    HIDDEN: tl.constexpr,
    FFN: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """TMA descriptors built on the device (128 bytes of scratch and a tensormap fence each)
    over grad_h1 ``[R_act, 2F]`` and w13 ``[E, 2F, D]``."""
    a_desc = tl.make_tensor_descriptor(
        grad_h1,
        shape=[num_act_rows, 2 * FFN],
        strides=[2 * FFN, 1],
        block_shape=[BLOCK_M, BLOCK_K],
    )
    w_desc = tl.make_tensor_descriptor(
        w13,
        shape=[NUM_EXPERTS, 2 * FFN, HIDDEN],
        strides=[2 * FFN * HIDDEN, HIDDEN, 1],
        block_shape=[1, BLOCK_K, BLOCK_N],
    )
    return a_desc, w_desc


@triton.jit
def _w13_dgrad_all_descs(grad_h1, grad_h1_half, w13, w13_half, num_act_rows,
                         HIDDEN: tl.constexpr, FFN: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                         READY: tl.constexpr, PAIR_TAILS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``(a, w, a_half, w_half)``: the descriptors as passed (``READY``), else built here (the
    half ones, ``BLOCK_M / 2`` rows and ``BLOCK_N / 2`` columns, only with ``PAIR_TAILS``;
    without it they are the whole ones, unused)."""
    if READY:
        a_desc = grad_h1
        w_desc = w13
        ah_desc = grad_h1_half
        wh_desc = w13_half
    else:
        a_desc, w_desc = _w13_dgrad_descs(grad_h1, w13, num_act_rows, HIDDEN, FFN, NUM_EXPERTS,
                                          BLOCK_M, BLOCK_N, BLOCK_K)
        ah_desc = a_desc
        wh_desc = w_desc
        if PAIR_TAILS:
            ah_desc, wh_desc = _w13_dgrad_descs(grad_h1, w13, num_act_rows, HIDDEN, FFN,
                                                NUM_EXPERTS, BLOCK_M // 2, BLOCK_N // 2,
                                                BLOCK_K)
    return a_desc, w_desc, ah_desc, wh_desc


@triton.jit
def _w13_dgrad_store(scatter_ptrs_ptr, row0, num_live, acc, n0, HIDDEN: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Scatter the bf16 rows of ``acc`` (``[BLOCK_M, BLOCK_N]``, columns from ``n0``) of the
    tile at padded row ``row0``, its first ``num_live`` rows live."""
    idx = tl.arange(0, BLOCK_M)
    is_live = idx < num_live
    # Entries of padding rows are not read (the routing layer writes 0 there anyway).
    addr = tl.load(scatter_ptrs_ptr + row0 + idx, mask=is_live, other=0)
    is_row = addr != 0
    # Destination rows are 16-byte aligned (contract): 16-byte vector stores. The hint goes
    # on the pointer (divisibility in bytes); on the int64 before the cast it would be lost.
    dst = tl.multiple_of(addr.to(tl.pointer_type(tl.bfloat16)), 16)
    col = n0 + tl.arange(0, BLOCK_N)
    tl.store(
        dst[:, None] + col[None, :],
        acc.to(tl.bfloat16),
        mask=is_row[:, None] & (col < HIDDEN)[None, :],
    )


@triton.jit
def _w13_dgrad_tile(
    grad_h1,
    grad_h1_half,
    w13_half,
    padded_offsets_ptr,
    row_offsets_ptr,
    w13,
    scatter_ptrs_ptr,
    num_act_rows,
    pid_m,
    pid_n,
    HIDDEN: tl.constexpr,
    FFN: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    DESC_READY: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PAIR_TAILS: tl.constexpr,
):
    """One ``BLOCK_M x BLOCK_N`` tile of grad_x_route, scattered, for a row tile below
    ``padded_offsets[E]``. A tile of padding rows only loads and stores nothing.

    ``PAIR_TAILS``: an expert's last row tile with at most ``BLOCK_M / 2`` live rows (a
    tail; not the expert's only tile) is computed with the tile before it, which then runs
    as two ``(BLOCK_M + BLOCK_M / 2) x BLOCK_N / 2`` halves, each K step's weight tile
    feeding a ``BLOCK_M``-row MMA for the tile and a ``BLOCK_M / 2``-row one for the tail:
    the weights are read once for both, and the tail's dead half takes no MMA (its own
    tile exits).

    ``grad_h1`` / ``grad_h1_half`` / ``w13`` / ``w13_half``: TMA descriptors (``DESC_READY``:
    host-encoded, or built once per persistent program; the ``_half`` ones with ``BLOCK_M /
    2`` rows and ``BLOCK_N / 2`` columns), else the tensors, whose descriptors are built
    here once the tile is known to hold live rows.
    """
    HALF_M: tl.constexpr = BLOCK_M // 2
    HALF_N: tl.constexpr = BLOCK_N // 2
    row0 = pid_m * BLOCK_M
    expert = tile_expert(padded_offsets_ptr, row0, NUM_EXPERTS, EXPERTS_POW2)
    act0, num_live = tile_live_rows(padded_offsets_ptr, row_offsets_ptr, expert, row0)
    single = num_live > 0
    if PAIR_TAILS:
        # live rows count from row0 to the expert's end: (BLOCK_M, BLOCK_M + HALF_M] makes
        # this tile and the expert's tail a pair; (0, HALF_M] past its first tile is that tail
        pair = (num_live > BLOCK_M) & (num_live <= BLOCK_M + HALF_M)
        tail = (num_live <= HALF_M) & (row0 > tl.load(padded_offsets_ptr + expert))
        single = single & (pair == 0) & (tail == 0)
    # Live rows come first in a segment: a tile starting at a padding row has none.
    if single:
        n0 = pid_n * BLOCK_N
        a_desc, w_desc, _ah, _wh = _w13_dgrad_all_descs(
            grad_h1, grad_h1_half, w13, w13_half, num_act_rows, HIDDEN, FFN, NUM_EXPERTS,
            DESC_READY, False, BLOCK_M, BLOCK_N, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        # Activation rows [act0, act0 + BLOCK_M): the tile's padding rows read past its
        # expert's rows (TMA zero-fills rows past R_act); their results are discarded below.
        for k0 in range(0, 2 * FFN, BLOCK_K):
            a = a_desc.load([act0, k0])
            b = w_desc.load([expert, k0, n0]).reshape(BLOCK_K, BLOCK_N)
            acc = tl.dot(a, b, acc)
        _w13_dgrad_store(scatter_ptrs_ptr, row0, num_live, acc, n0, HIDDEN, BLOCK_M, BLOCK_N)
    if PAIR_TAILS:
        if pair:
            a_desc, _w, ah_desc, wh_desc = _w13_dgrad_all_descs(
                grad_h1, grad_h1_half, w13, w13_half, num_act_rows, HIDDEN, FFN, NUM_EXPERTS,
                DESC_READY, True, BLOCK_M, BLOCK_N, BLOCK_K)
            for h in range(2):
                n0 = pid_n * BLOCK_N + h * HALF_N
                acc0 = tl.zeros([BLOCK_M, HALF_N], dtype=tl.float32)
                acc1 = tl.zeros([HALF_M, HALF_N], dtype=tl.float32)
                for k0 in range(0, 2 * FFN, BLOCK_K):
                    a0 = a_desc.load([act0, k0])
                    a1 = ah_desc.load([act0 + BLOCK_M, k0])
                    b = wh_desc.load([expert, k0, n0]).reshape(BLOCK_K, HALF_N)
                    acc0 = tl.dot(a0, b, acc0)
                    acc1 = tl.dot(a1, b, acc1)
                _w13_dgrad_store(scatter_ptrs_ptr, row0, BLOCK_M, acc0, n0, HIDDEN, BLOCK_M,
                                 HALF_N)
                _w13_dgrad_store(scatter_ptrs_ptr, row0 + BLOCK_M, num_live - BLOCK_M, acc1,
                                 n0, HIDDEN, HALF_M, HALF_N)


@triton.jit
def _w13_dgrad_scatter_kernel(
    grad_h1,  # bf16 [R_act, 2F], or its TMA descriptor (HOST_DESC)
    grad_h1_half,  # PAIR_TAILS and HOST_DESC: its descriptor of BLOCK_M / 2 rows, else unused
    w13_half,  # PAIR_TAILS and HOST_DESC: w13's descriptor of BLOCK_N / 2 columns, else unused
    padded_offsets_ptr,  # int32 [E + 1]
    row_offsets_ptr,  # int32 [E + 1]
    w13,  # bf16 [E, 2F, D], or its TMA descriptor (HOST_DESC)
    scatter_ptrs_ptr,  # int64 [R_cap]: destination addresses of bf16 [D] rows (0 = skip)
    next_ptr,  # DYNAMIC: int32 [1], zero: the next tile to hand out; else unused
    num_rows,  # R_cap
    num_act_rows,  # R_act
    HIDDEN: tl.constexpr,
    FFN: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    HOST_DESC: tl.constexpr,
    PERSISTENT: tl.constexpr,
    DYNAMIC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PAIR_TAILS: tl.constexpr,
):
    NUM_PID_N: tl.constexpr = (HIDDEN + BLOCK_N - 1) // BLOCK_N
    total_rows = tl.load(padded_offsets_ptr + NUM_EXPERTS)
    if PERSISTENT:
        # Each program walks the live tiles (count read on the device) with a stride of the
        # grid; a while loop (not range) keeps the interpreter working too. Descriptors are
        # built once per program, and only by a program that has a tile: the others (fewer
        # live tiles than programs) exit at once.
        num_live_m = total_rows // BLOCK_M
        num_tiles = num_live_m * NUM_PID_N
        # DYNAMIC: each program takes its next tile from a counter when it is done with one,
        # so the tiles running at once stay neighbours in the group-M order (L2 reuse)
        # however long each tile takes; else a fixed stride of the grid
        tile_id = tl.program_id(0)
        if DYNAMIC:
            tile_id = tl.atomic_add(next_ptr, 1, sem="relaxed")
        if tile_id < num_tiles:
            a_desc, w_desc, ah_desc, wh_desc = _w13_dgrad_all_descs(
                grad_h1, grad_h1_half, w13, w13_half, num_act_rows, HIDDEN, FFN, NUM_EXPERTS,
                HOST_DESC, PAIR_TAILS, BLOCK_M, BLOCK_N, BLOCK_K)
            while tile_id < num_tiles:
                pid_m, pid_n = swizzle_tile(tile_id, num_live_m, NUM_PID_N, GROUP_M)
                _w13_dgrad_tile(
                    a_desc, ah_desc, wh_desc, padded_offsets_ptr, row_offsets_ptr, w_desc,
                    scatter_ptrs_ptr, num_act_rows, pid_m, pid_n, HIDDEN, FFN, NUM_EXPERTS,
                    EXPERTS_POW2, True, BLOCK_M, BLOCK_N, BLOCK_K, PAIR_TAILS,
                )  # fmt: skip
                if DYNAMIC:
                    tile_id = tl.atomic_add(next_ptr, 1, sem="relaxed")
                else:
                    tile_id += tl.num_programs(0)
    else:
        pid_m, pid_n = swizzle_tile(tl.program_id(0), num_rows // BLOCK_M, NUM_PID_N, GROUP_M)
        # Idle tiles (rows at/after padded_offsets[E]): no loads, no stores.
        if pid_m * BLOCK_M < total_rows:
            _w13_dgrad_tile(
                grad_h1, grad_h1_half, w13_half, padded_offsets_ptr, row_offsets_ptr, w13,
                scatter_ptrs_ptr,
                num_act_rows, pid_m, pid_n, HIDDEN, FFN, NUM_EXPERTS, EXPERTS_POW2, HOST_DESC,
                BLOCK_M, BLOCK_N, BLOCK_K, PAIR_TAILS,
            )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


def w13_dgrad_gluon_reason(config: W13DgradConfig, device: torch.device, hidden: int,
                           ffn: int) -> str | None:
    """``None`` when ``config`` runs the Gluon kernel on ``device`` at D = ``hidden``, F =
    ``ffn``, else why not (``config.gluon`` False included)."""
    return config_gluon_reason(config, w13_dgrad_gluon.gluon_w13_dgrad_reason, device, hidden, ffn)


def w13_dgrad_scatter(
    grad_h1: torch.Tensor,
    padded_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    w13: torch.Tensor,
    scatter_ptrs: torch.Tensor,
    *,
    config: W13DgradConfig | None = None,
) -> None:
    """``grad_x_route = bf16(grad_h1 @ W13)`` stored to ``scatter_ptrs[row]`` (module docstring).

    Args:
        grad_h1: bf16 ``[R_act, 2F]`` (``[grad_g | grad_u]``) in activation rows,
            ``R_act >= row_offsets[E_local]``.
        padded_offsets: int32 ``[E_local + 1]``, the expert segments of padded rows (multiples
            of ``config.block_m``).
        row_offsets: int32 ``[E_local + 1]``, exclusive prefix sum of the live rows per expert:
            padded row ``padded_offsets[e] + j`` is live iff ``j < n_e``, at activation row
            ``row_offsets[e] + j``.
        w13: bf16 ``[E_local, 2, F, D]``.
        scatter_ptrs: int64 ``[R_cap]``, indexed by padded row: absolute byte addresses of bf16
            rows of ``D`` values (16-byte aligned; 0 = skip). Only live, non-null rows are
            written; nothing else is touched, and entries of padding rows are not read.
        config: :class:`W13DgradConfig`; ``None`` = ``for_widths`` with ``block_m`` 128.
    """
    check_tensor("w13", w13, dtypes=(torch.bfloat16,), ndim=4, shape_text="[E_local, 2, F, D]")
    num_experts, two, ffn, hidden = w13.shape
    if two != 2:
        raise ValueError(f"w13 must have shape [E_local, 2, F, D], got {list(w13.shape)}")
    if num_experts < 1:
        raise ValueError(f"w13 must hold at least one expert, got shape {list(w13.shape)}")
    check_width("D (w13.shape[3])", hidden)
    check_width("F (w13.shape[2])", ffn)
    num_rows = check_row_table("scatter_ptrs", scatter_ptrs)
    check_offsets(padded_offsets, row_offsets, num_experts)
    num_act = check_activation_width("grad_h1", grad_h1, 2 * ffn, "2F")
    check_tma_aligned("grad_h1", grad_h1)
    check_tma_aligned("w13", w13)
    device = check_devices(
        {
            "grad_h1": grad_h1,
            "padded_offsets": padded_offsets,
            "row_offsets": row_offsets,
            "w13": w13,
            "scatter_ptrs": scatter_ptrs,
        }
    )
    if config is None:
        config = W13DgradConfig.for_widths(hidden=hidden, ffn=ffn)
    elif not isinstance(config, W13DgradConfig):
        raise TypeError(f"config must be a W13DgradConfig or None, got {type(config).__name__}")
    check_rows_cap(num_rows, config.block_m)
    reason = w13_dgrad_gluon_reason(config, device, hidden, ffn)
    if num_rows == 0 or num_act == 0:
        return  # no padded rows, or (R_act >= row_offsets[E]) no live rows
    if reason is None:
        w13_dgrad_gluon.launch_gluon_w13_dgrad(
            grad_h1, padded_offsets, row_offsets, w13, scatter_ptrs, block_n=config.block_n,
            stages=config.num_stages, group_m=config.group_m, warps=config.num_warps,
            lockstep=config.lockstep, expert_groups=config.expert_groups)
        return
    if config.gluon:
        warn_gluon_fallback("w13_dgrad_scatter", reason)
    grad_h1_arg, w13_arg, grad_h1_half, w13_half = grad_h1, w13, grad_h1, w13
    if config.host_descriptors:
        grad_h1_arg = TensorDescriptor(
            grad_h1,
            shape=[num_act, 2 * ffn],
            strides=[2 * ffn, 1],
            block_shape=[config.block_m, config.block_k],
        )
        w13_arg = TensorDescriptor(
            w13,
            shape=[num_experts, 2 * ffn, hidden],
            strides=[2 * ffn * hidden, hidden, 1],
            block_shape=[1, config.block_k, config.block_n],
        )
        if config.pair_tails:
            grad_h1_half = TensorDescriptor(
                grad_h1,
                shape=[num_act, 2 * ffn],
                strides=[2 * ffn, 1],
                block_shape=[config.block_m // 2, config.block_k],
            )
            w13_half = TensorDescriptor(
                w13,
                shape=[num_experts, 2 * ffn, hidden],
                strides=[2 * ffn * hidden, hidden, 1],
                block_shape=[1, config.block_k, config.block_n // 2],
            )
    else:
        ensure_tma_allocator()
    num_tiles_cap = (num_rows // config.block_m) * triton.cdiv(hidden, config.block_n)
    # the tile counter (a memset node in a captured graph)
    next_tile = (torch.zeros(1, dtype=torch.int32, device=device) if config.dynamic
                 else padded_offsets)
    with device_context(device):
        _w13_dgrad_scatter_kernel[(gemm_grid(config, num_tiles_cap, device),)](
            grad_h1_arg,
            grad_h1_half,
            w13_half,
            padded_offsets,
            row_offsets,
            w13_arg,
            scatter_ptrs,
            next_tile,
            num_rows,
            num_act,
            HIDDEN=hidden,
            FFN=ffn,
            NUM_EXPERTS=num_experts,
            EXPERTS_POW2=next_power_of_2(num_experts),
            HOST_DESC=config.host_descriptors,
            PERSISTENT=config.persistent,
            DYNAMIC=config.dynamic,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            GROUP_M=config.group_m,
            PAIR_TAILS=config.pair_tails,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )


# --------------------------------------------------------------------------------------------
# Reference (plain PyTorch; it reads the offsets on the host)
# --------------------------------------------------------------------------------------------


def w13_dgrad_scatter_ref(
    grad_h1: torch.Tensor,
    padded_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    w13: torch.Tensor,
    *,
    num_rows: int,
) -> torch.Tensor:
    """Reference of :func:`w13_dgrad_scatter`: the fp32 ``[R_cap, D]`` rows (``num_rows`` =
    ``R_cap``, indexed by padded row) that the kernel stores (row ``i`` goes to
    ``scatter_ptrs[i]`` unless that is 0); padding and idle rows are zeros (never stored)."""
    num_experts, _, ffn, hidden = w13.shape
    out = torch.zeros(num_rows, hidden, dtype=torch.float32, device=grad_h1.device)
    for e, (pad, act, count) in enumerate(compact_segments(padded_offsets, row_offsets)):
        if count:
            weight = w13[e].reshape(2 * ffn, hidden).float()
            out[pad : pad + count] = grad_h1[act : act + count].float() @ weight
    return out
