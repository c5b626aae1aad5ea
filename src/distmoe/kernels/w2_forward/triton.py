"""Grouped W2 GEMM with a row-scatter epilogue (forward, bf16).

Two row numberings (see :mod:`distmoe.kernels.base.rows`): the *padded* expert-major rows are
the tile schedule and index ``scatter_ptrs``; h2 is in compact *activation* rows. Local
expert ``e`` owns padded rows ``[padded_offsets[e], padded_offsets[e+1])`` and has
``n_e = row_offsets[e+1] - row_offsets[e]`` live rows; padded row ``r = padded_offsets[e] + j``
is live iff ``j < n_e``, and then its activation row is ``a = row_offsets[e] + j``. For every
live row::

    h3 = h2[a] @ w2[e]^T        (fp32 accumulation, rounded to bf16, width D)
    store h3 at byte address scatter_ptrs[r]   (skipped when the address is 0)

Padding rows are never stored (nor their ``scatter_ptrs`` entries read). The destination is
normally the route's slot ``t*K + k`` in the owner rank's combine buffer, possibly in a peer
GPU's memory mapped into this address space. ``enable`` (int32 ``[1]`` on the device) set to
0 makes every program return at once (nothing is written).

Algorithm: one program computes a ``block_m x block_n`` tile of h3. Both operands come through
TMA descriptors (encoded on the host at launch by default, or built on the device:
``W2Config.host_descriptors``): h2 over ``[R_act, F]`` (local, contiguous rows), loaded at
the tile's first activation row ``row_offsets[e] + (tile_row - padded_offsets[e])``, and the
weights over ``w2`` ``[E_local, D, F]`` (out-of-range F/D tiles read zeros). A tile's rows
past the expert's live rows read the next expert's activation rows or, past ``R_act``, TMA's
zero fill; their results are discarded. The epilogue stores each row with plain ``tl.store``
through its own address: a peer reads these rows after a release/acquire signal, and in
Triton 3.6 a later release does not order a TMA store. A tile's expert, its first activation
row and its live row count are found on the device from ``padded_offsets`` and
``row_offsets``; tiles at or beyond ``padded_offsets[E_local]``, tiles of padding rows only
and tiles whose live rows are all skipped do no GEMM work. The grid is sized from ``R_cap``
(or is persistent), never from routed counts.

Memory: nothing is allocated (device-built descriptors: Triton's scratch, 256 bytes per
program).

Sync points: none on the host. The caller signals the destination ranks after the kernel
(or after a kernel boundary); the stores are plain global stores, 16-byte vectors per row.

Requirements (the device-side ones are not checked): D and F multiples of 8; every non-null
scatter address 16-byte aligned; ``R_cap`` a multiple of ``block_m`` and every expert's padded
segment a multiple of ``block_m``; ``row_offsets[0] = 0`` and ``0 <= n_e <=`` the expert's
padded segment length; h2 has ``R_act >= row_offsets[E_local]`` rows (at least 1 is checked)
and starts 16-byte aligned (checked).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from distmoe.kernels.base.checks import (
    check_activation_rows,
    check_devices,
    check_offsets,
    check_padded_offsets_host,
    check_row_offsets_host,
    check_scatter_r_cap,
    check_tensor,
    check_tma_aligned,
    check_width,
)
from distmoe.kernels.base.config import next_power_of_2, validate_block_m
from distmoe.kernels.base.device import (
    config_gluon_reason,
    device_context,
    ensure_tma_allocator,
    gemm_grid,
    warn_gluon_fallback,
)
from distmoe.kernels.base.rows import activation_segments, write_rows_at
from distmoe.kernels.base.tiles import swizzle_tile, tile_activation_rows, tile_expert
from distmoe.kernels.w2_forward import gluon as w2_gluon
from distmoe.kernels.w2_forward.config import W2Config

# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _w2_tile(
    h2_desc,
    w_desc,
    padded_offsets_ptr,
    row_offsets_ptr,
    scatter_ptrs_ptr,
    pid_m,
    pid_n,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    HIDDEN: tl.constexpr,
    FFN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    """One ``BLOCK_M x BLOCK_N`` tile of h3, scattered row by row."""
    NUM_K: tl.constexpr = (FFN + BLOCK_K - 1) // BLOCK_K
    row_start = pid_m * BLOCK_M
    expert = tile_expert(padded_offsets_ptr, row_start, NUM_EXPERTS, EXPERTS_POW2)
    act_start, num_live = tile_activation_rows(
        padded_offsets_ptr, row_offsets_ptr, expert, row_start
    )
    idx = tl.arange(0, BLOCK_M)
    is_live = idx < num_live
    # Destination addresses of the live rows, read first: a tile whose live rows are all
    # skipped (or that has none) does no GEMM. Every address is a multiple of 16 bytes (module
    # requirement); the hint sits on the pointer tensor (on the loaded int64 it is lost at
    # int_to_ptr): 16-byte vector stores.
    dst = tl.load(scatter_ptrs_ptr + row_start + idx, mask=is_live, other=0)
    is_store_row = dst != 0
    if tl.max(is_store_row.to(tl.int32), axis=0) > 0:
        n0 = pid_n * BLOCK_N
        # TMA row coordinate: the tile's first activation row (any row, not a multiple of
        # BLOCK_M). Rows past the live ones are read but never stored.
        a_row = act_start.to(tl.int32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, NUM_K):
            a = h2_desc.load([a_row, k * BLOCK_K])
            b = w_desc.load([expert, n0, k * BLOCK_K]).reshape(BLOCK_N, BLOCK_K)
            acc = tl.dot(a, b.T, acc)

        cols = n0 + tl.arange(0, BLOCK_N)
        mask = is_store_row[:, None]
        if not EVEN_N:
            mask = mask & (cols < HIDDEN)[None, :]
        out_rows = tl.multiple_of(dst.to(tl.pointer_type(tl.bfloat16)), 16)
        tl.store(out_rows[:, None] + cols[None, :], acc.to(tl.bfloat16), mask=mask)


@triton.jit
def _w2_descs(
    h2,
    w2,
    r_act,
    NUM_EXPERTS: tl.constexpr,
    HIDDEN: tl.constexpr,
    FFN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HOST_DESC: tl.constexpr,
):
    """TMA descriptors over h2 ``[R_act, F]`` and w2 ``[E_local, D, F]``: the host-built ones
    passed in, or built on the device (128 bytes of scratch each, a tensormap fence)."""
    if HOST_DESC:
        return h2, w2
    else:
        h2_desc = tl.make_tensor_descriptor(
            h2, shape=[r_act, FFN], strides=[FFN, 1], block_shape=[BLOCK_M, BLOCK_K]
        )
        w_desc = tl.make_tensor_descriptor(
            w2,
            shape=[NUM_EXPERTS, HIDDEN, FFN],
            strides=[HIDDEN * FFN, FFN, 1],
            block_shape=[1, BLOCK_N, BLOCK_K],
        )
        return h2_desc, w_desc


@triton.jit
def _w2_scatter_kernel(
    h2,
    padded_offsets_ptr,
    row_offsets_ptr,
    w2,
    scatter_ptrs_ptr,
    enable_ptr,
    r_act,
    num_pid_m,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    HIDDEN: tl.constexpr,
    FFN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    PERSISTENT: tl.constexpr,
    HOST_DESC: tl.constexpr,
    HAS_ENABLE: tl.constexpr,
):
    """``h2`` and ``w2`` are host TMA descriptors (``HOST_DESC``) or the tensors themselves.

    ``enable_ptr`` (``HAS_ENABLE``) is read once per program; without it, a placeholder that
    is never read.
    """
    NUM_PID_N: tl.constexpr = (HIDDEN + BLOCK_N - 1) // BLOCK_N
    total_rows = tl.load(padded_offsets_ptr + NUM_EXPERTS)
    if HAS_ENABLE:
        # The device decides whether this launch runs: disabled, every tile is idle.
        total_rows = tl.where(tl.load(enable_ptr) != 0, total_rows, 0)
    if PERSISTENT:
        # Descriptors once per program, reused by every tile it walks. Programs without a
        # tile (a disabled launch, fewer tiles than programs) exit at once.
        num_live_m = total_rows // BLOCK_M
        num_tiles = num_live_m * NUM_PID_N
        tile_id = tl.program_id(0)
        if tile_id < num_tiles:
            h2_desc, w_desc = _w2_descs(
                h2, w2, r_act, NUM_EXPERTS, HIDDEN, FFN, BLOCK_M, BLOCK_N, BLOCK_K, HOST_DESC
            )
            while tile_id < num_tiles:
                pid_m, pid_n = swizzle_tile(tile_id, num_live_m, NUM_PID_N, GROUP_M)
                _w2_tile(
                    h2_desc, w_desc, padded_offsets_ptr, row_offsets_ptr, scatter_ptrs_ptr,
                    pid_m, pid_n, NUM_EXPERTS, EXPERTS_POW2, HIDDEN, FFN, BLOCK_M, BLOCK_N,
                    BLOCK_K, EVEN_N,
                )  # fmt: skip
                tile_id += tl.num_programs(0)
    else:
        pid_m, pid_n = swizzle_tile(tl.program_id(0), num_pid_m, NUM_PID_N, GROUP_M)
        # Idle tiles (beyond the used rows) exit before building descriptors or loading.
        if pid_m * BLOCK_M < total_rows:
            h2_desc, w_desc = _w2_descs(
                h2, w2, r_act, NUM_EXPERTS, HIDDEN, FFN, BLOCK_M, BLOCK_N, BLOCK_K, HOST_DESC
            )
            _w2_tile(
                h2_desc, w_desc, padded_offsets_ptr, row_offsets_ptr, scatter_ptrs_ptr, pid_m,
                pid_n, NUM_EXPERTS, EXPERTS_POW2, HIDDEN, FFN, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_N,
            )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


def check_w2_args(
    h2, padded_offsets, row_offsets, w2, scatter_ptrs, enable, *, for_kernel: bool
) -> tuple[int, int, int, int, int]:
    check_tensor("w2", w2, dtypes=(torch.bfloat16,), ndim=3, shape_text="[E_local, D, F]")
    num_experts, hidden, ffn = w2.shape
    if num_experts < 1:
        raise ValueError(f"w2 must have shape [E_local >= 1, D, F], got {list(w2.shape)}")
    check_width("w2's D (hidden)", hidden)
    check_width("w2's F (ffn)", ffn)
    check_tensor("scatter_ptrs", scatter_ptrs, dtypes=(torch.int64,), ndim=1, shape_text="[R_cap]")
    r_cap = scatter_ptrs.shape[0]
    check_tensor("h2", h2, dtypes=(torch.bfloat16,), ndim=2, shape_text="[R_act, F]")
    if h2.shape[1] != ffn:
        raise ValueError(f"h2 must have shape [R_act, F={ffn}] (F from w2), got {list(h2.shape)}")
    r_act = check_activation_rows("h2", h2, r_cap=r_cap)
    check_offsets(padded_offsets, row_offsets, num_experts)
    named = {
        "h2": h2,
        "padded_offsets": padded_offsets,
        "row_offsets": row_offsets,
        "w2": w2,
        "scatter_ptrs": scatter_ptrs,
    }
    if enable is not None:
        check_tensor("enable", enable, dtypes=(torch.int32,), shape=[1], shape_text="(0 = skip)")
        named["enable"] = enable
    check_devices(named, for_kernel=for_kernel)
    if for_kernel:
        check_tma_aligned("h2", h2)
        check_tma_aligned("w2", w2)
    return r_cap, r_act, num_experts, hidden, ffn


def gluon_reason(config: W2Config, device: torch.device, hidden: int, ffn: int) -> str | None:
    """``None`` when ``config`` runs the Gluon kernel on ``device`` at D = ``hidden``, F =
    ``ffn``, else why not (``config.gluon`` False included)."""
    return config_gluon_reason(config, w2_gluon.gluon_w2_reason, device, hidden, ffn)


def w2_scatter(
    h2: torch.Tensor,
    padded_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    w2: torch.Tensor,
    scatter_ptrs: torch.Tensor,
    *,
    enable: torch.Tensor | None = None,
    config: W2Config | None = None,
    block_m: int | None = None,
) -> None:
    """h2 @ W2 per expert, each live row's result stored at its own absolute address.

    Args:
        h2: bf16 ``[R_act, F]`` contiguous, 16-byte aligned: the SwiGLU output in compact
            activation rows (``R_act >= row_offsets[E_local]``, >= 1).
        padded_offsets: int32 ``[E_local + 1]`` (device): expert ``e`` owns padded rows
            ``[padded_offsets[e], padded_offsets[e+1])``, each a multiple of ``block_m``
            (the tile schedule).
        row_offsets: int32 ``[E_local + 1]`` (device): exclusive prefix sum of live rows per
            expert; padded row ``padded_offsets[e] + j`` is live iff
            ``j < row_offsets[e+1] - row_offsets[e]``, and reads h2 row ``row_offsets[e] + j``.
        w2: bf16 ``[E_local, D, F]`` contiguous.
        scatter_ptrs: int64 ``[R_cap]`` indexed by padded row: absolute byte address receiving
            the D bf16 values of each row (16-byte aligned; may be a peer's mapped memory),
            0 = skip the row. Entries of padding rows are never read.
        enable: optional int32 ``[1]`` on the device: 0 = every program returns at once
            (nothing is written), anything else = run.
        config: launch configuration; default :meth:`W2Config.for_widths`.
        block_m: the padding multiple (default 128); must match ``config.block_m`` if both
            are given.

    Only live rows with a non-zero address are stored.
    """
    r_cap, r_act, num_experts, hidden, ffn = check_w2_args(
        h2, padded_offsets, row_offsets, w2, scatter_ptrs, enable, for_kernel=True
    )
    if config is None:
        config = W2Config.for_widths(
            hidden=hidden, ffn=ffn, block_m=128 if block_m is None else block_m
        )
    elif not isinstance(config, W2Config):
        raise TypeError(f"config must be a W2Config, got {type(config).__name__}")
    validate_block_m(config, block_m)
    check_scatter_r_cap(r_cap, config.block_m)
    device = h2.device
    reason = gluon_reason(config, device, hidden, ffn)
    if r_cap == 0:
        return

    if reason is None:
        w2_gluon.launch_gluon_w2(
            h2, padded_offsets, row_offsets, w2, scatter_ptrs, enable=enable,
            block_n=config.block_n, stages=config.num_stages, group_m=config.group_m,
            warps=config.num_warps, lockstep=config.lockstep,
            expert_groups=config.expert_groups)
        return
    if config.gluon:
        warn_gluon_fallback("w2_scatter", reason)
    num_pid_m = r_cap // config.block_m
    num_pid_n = triton.cdiv(hidden, config.block_n)
    grid = gemm_grid(config, num_pid_m * num_pid_n, device)
    if config.host_descriptors:
        h2_arg = TensorDescriptor(
            h2, shape=[r_act, ffn], strides=[ffn, 1], block_shape=[config.block_m, config.block_k]
        )
        w2_arg = TensorDescriptor(
            w2,
            shape=[num_experts, hidden, ffn],
            strides=[hidden * ffn, ffn, 1],
            block_shape=[1, config.block_n, config.block_k],
        )
    else:
        h2_arg, w2_arg = h2, w2
        ensure_tma_allocator()
    with device_context(device):
        _w2_scatter_kernel[(grid,)](
            h2_arg,
            padded_offsets,
            row_offsets,
            w2_arg,
            scatter_ptrs,
            padded_offsets if enable is None else enable,  # placeholder: never read
            r_act,
            num_pid_m,
            NUM_EXPERTS=num_experts,
            EXPERTS_POW2=next_power_of_2(num_experts),
            HIDDEN=hidden,
            FFN=ffn,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            GROUP_M=config.group_m,
            EVEN_N=hidden % config.block_n == 0,
            PERSISTENT=config.persistent,
            HOST_DESC=config.host_descriptors,
            HAS_ENABLE=enable is not None,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------


def w2_scatter_ref(
    h2: torch.Tensor,
    padded_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    w2: torch.Tensor,
    scatter_ptrs: torch.Tensor,
    *,
    enable: torch.Tensor | None = None,
    targets: Sequence[torch.Tensor],
    block_m: int = 128,
) -> None:
    """Plain-PyTorch :func:`w2_scatter` (any device; synchronises; for tests).

    Same arguments and contract; ``enable`` and the layout are read and checked on the host.
    ``targets`` lists the tensors the addresses point into (contiguous bf16, seen as rows of
    D values); each address is resolved to its (tensor, row) on the host. fp32 matmuls,
    results rounded to bf16 like the kernel's.
    """
    r_cap, r_act, _, _, _ = check_w2_args(
        h2, padded_offsets, row_offsets, w2, scatter_ptrs, enable, for_kernel=False
    )
    check_scatter_r_cap(r_cap, block_m)
    check_padded_offsets_host(padded_offsets, block_m=block_m, r_cap=r_cap)
    check_row_offsets_host(padded_offsets, row_offsets, r_act=r_act)
    if enable is not None and int(enable.item()) == 0:
        return
    for e, (pad_start, act_start, count) in enumerate(
        activation_segments(padded_offsets, row_offsets)
    ):
        if count == 0:
            continue
        h3 = (h2[act_start : act_start + count].float() @ w2[e].float().T).to(torch.bfloat16)
        write_rows_at(scatter_ptrs[pad_start : pad_start + count], h3, targets, name="scatter_ptrs")
