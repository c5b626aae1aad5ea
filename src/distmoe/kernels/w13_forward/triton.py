"""Grouped W13 GEMM with a row-gather prologue and a SwiGLU epilogue (forward, bf16).

Two row numberings (see :mod:`distmoe.kernels.base.rows`): the *padded* expert-major rows are
the tile schedule and index ``gather_ptrs``; the outputs are in compact *activation* rows.
Local expert ``e`` owns padded rows ``[padded_offsets[e], padded_offsets[e+1])`` and has
``n_e = row_offsets[e+1] - row_offsets[e]`` live rows; padded row ``padded_offsets[e] + j`` is
live iff ``j < n_e``, and then its activation row is ``a = row_offsets[e] + j``. For every
live row::

    x   = the D bf16 values at byte address gather_ptrs[r]      (zeros when the address is 0)
    g   = x @ w13[e, 0]^T        u = x @ w13[e, 1]^T            (fp32 accumulation)
    h2[a] = silu(g) * u                                         (bf16, width F)
    h1[a] = [g | u]                                             (bf16, width 2F, optional)
    x_out[a] = x                                                (bf16, width D, optional)

Padding rows (``j >= n_e``) are neither gathered nor stored. h1 and x_out are either 2-D
tensors in activation rows or, with ``out_offsets`` (an int64 ``[2]`` device tensor of bf16
element offsets, e.g. a slot cursor), 1-D bf16 base tensors: row ``a`` of h1 at
``h1_out + out_offsets[0] + a*2F``, of x at ``x_out + out_offsets[1] + a*D``; a negative
offset skips that output (read on the device by every program). ``enable`` (int32 ``[1]``
on the device) set to 0 makes every program return at once (nothing is written).

Algorithm: one program computes a ``block_m x block_n`` tile of h2 with two fp32 accumulators
(gate and up) that share the gathered A tile. A rows are pointer loads from absolute
addresses (they may point into a peer GPU's buffer mapped into this address space; Hopper has
no TMA gather), issued as 16-byte ``cp.async`` and software-pipelined with the weights. The
weights come through one TMA descriptor over ``w13`` seen as ``[2 E_local, F, D]``
(out-of-range F/D tiles read zeros), encoded on the host at launch by default or built on the
device (``W13Config.host_descriptors``). A tile's expert, its activation rows and its live
row count are found on the device from ``padded_offsets`` and ``row_offsets``; tiles at or
beyond ``padded_offsets[E_local]`` and tiles of padding rows only do no work. Outputs are
plain 16-byte vector stores through row pointers (activation row offsets and the dynamic
element offsets are device values). The grid is sized from ``R_cap`` (one program per tile,
idle ones exit at once) or is persistent (one program per SM walking the live tiles), never
from routed counts.

Memory: nothing is allocated (device-built descriptors: Triton's scratch, 128 bytes per
program). Each gathered row is read once per column tile (``ceil(F / block_n)`` times):
local rows mostly come from L2 after the first read; rows in a peer GPU's memory cross NVLink
on every read (a GPU does not keep a peer's memory in its L2), which is why the layer first
copies peer rows into local memory (:mod:`distmoe.kernels.movement.pull_tokens`).
Writes h2 (and h1 / x_out when given), live rows only.

Sync points: none on the host. The gathered rows must be complete before the launch (the
caller orders this with a barrier or signal); all outputs are local and read by later kernels.

Requirements (the device-side ones are not checked): D and F multiples of 8; every non-null
gather address 16-byte aligned (rows of 16-byte aligned buffers); ``R_cap`` a multiple of
``block_m``, and each expert's padded segment a multiple of ``block_m`` (the routing layer's
padding); ``row_offsets[0] = 0`` and ``0 <= n_e <=`` the expert's padded segment length;
every 2-D output has ``R_act >= row_offsets[E_local]`` rows (at least 1 is checked); with
``out_offsets``, each non-negative offset is a multiple of 8 elements (16 bytes) and its base
holds ``offset + row_offsets[E_local] * width`` elements, and the bases start 16-byte aligned
(checked).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from distmoe.kernels.base.checks import (
    check_activation_rows,
    check_bf16_base,
    check_devices,
    check_gather_r_cap,
    check_offsets,
    check_padded_offsets_host,
    check_row_offsets_host,
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
from distmoe.kernels.base.rows import activation_segments, rows_at
from distmoe.kernels.base.tiles import swizzle_tile, tile_activation_rows, tile_expert
from distmoe.kernels.w13_forward import gluon as w13_gluon
from distmoe.kernels.w13_forward.config import W13Config
from distmoe.kernels.w13_forward.gluon import tile_rows

# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _w13_store_rows(
    h2_ptr,
    h1_ptr,
    h1_off,
    acc_g,
    acc_u,
    h2_val,
    act_rows,
    cols,
    out_mask,
    FFN: tl.constexpr,
    WRITE_H1: tl.constexpr,
):
    """Pointer stores of a tile's h2 (and h1) rows under ``out_mask`` (live rows, columns
    < F). Row pointers carry the 16-byte hint (widths are multiples of 8 elements, offsets
    too: module requirement) so the stores stay 16-byte vectors although the row offsets are
    device values."""
    h2_rows = tl.multiple_of(h2_ptr + act_rows * FFN, 16)
    tl.store(h2_rows[:, None] + cols[None, :], h2_val.to(tl.bfloat16), mask=out_mask)
    if WRITE_H1:
        if h1_off >= 0:
            h1_rows = tl.multiple_of(h1_ptr + h1_off + act_rows * (2 * FFN), 16)
            h1_tile = h1_rows[:, None] + cols[None, :]
            tl.store(h1_tile, acc_g.to(tl.bfloat16), mask=out_mask)
            tl.store(h1_tile + FFN, acc_u.to(tl.bfloat16), mask=out_mask)


@triton.jit
def _w13_tile(
    w_desc,
    gather_ptrs_ptr,
    padded_offsets_ptr,
    row_offsets_ptr,
    h2_ptr,
    h1_ptr,
    x_out_ptr,
    h2_desc,
    h1_desc,
    x_desc,
    h1_off,
    x_off,
    pid_m,
    pid_n,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    HIDDEN: tl.constexpr,
    FFN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    WRITE_H1: tl.constexpr,
    WRITE_X: tl.constexpr,
    TMA_STORE: tl.constexpr,
):
    """One ``BLOCK_M x BLOCK_N`` tile of h2 (and of both h1 halves) for a live row tile.

    ``h1_off`` / ``x_off``: element offsets of the h1 / x outputs (0, or device values; a
    negative one skips that output). With ``TMA_STORE`` (F a multiple of ``BLOCK_N``, D of
    ``BLOCK_K``), ``h2_desc`` / ``h1_desc`` / ``x_desc`` are the program's TMA descriptors
    over the live activation rows of each output, and a tile whose rows are all live stores
    through them; a partial tile (its expert's last) keeps the masked pointer stores, since
    a TMA box would run into the next expert's rows.
    """
    NUM_K: tl.constexpr = (HIDDEN + BLOCK_K - 1) // BLOCK_K
    row_start = pid_m * BLOCK_M
    expert = tile_expert(padded_offsets_ptr, row_start, NUM_EXPERTS, EXPERTS_POW2)
    act_start, num_live = tile_activation_rows(
        padded_offsets_ptr, row_offsets_ptr, expert, row_start
    )
    # Live rows come first in a segment: a tile starting at a padding row has none.
    if num_live > 0:
        idx = tl.arange(0, BLOCK_M)
        is_live = idx < num_live
        # Source row addresses of the live rows, once per tile (padding rows are not read).
        # 0 marks a null row: masked, reads zeros. Every address is a multiple of 16 bytes
        # (module requirement). The hint must sit on the pointer tensor (on the loaded int64
        # it is lost at int_to_ptr): with it the row loads become 16-byte vectors, which the
        # pipeliner turns into cp.async; without it they are 2-byte loads that are not
        # pipelined at all (checked in the sm_90 PTX).
        src = tl.load(gather_ptrs_ptr + row_start + idx, mask=is_live, other=0)
        is_read_row = src != 0
        a_rows = tl.multiple_of(src.to(tl.pointer_type(tl.bfloat16)), 16)
        offs_k = tl.arange(0, BLOCK_K)
        n0 = pid_n * BLOCK_N

        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, NUM_K):
            kk = k * BLOCK_K + offs_k
            if EVEN_K:
                a_mask = is_read_row[:, None]
            else:
                a_mask = is_read_row[:, None] & (kk < HIDDEN)[None, :]
            a = tl.load(a_rows[:, None] + kk[None, :], mask=a_mask, other=0.0)
            gate = w_desc.load([2 * expert, n0, k * BLOCK_K]).reshape(BLOCK_N, BLOCK_K)
            up = w_desc.load([2 * expert + 1, n0, k * BLOCK_K]).reshape(BLOCK_N, BLOCK_K)
            acc_g = tl.dot(a, gate.T, acc_g)
            acc_u = tl.dot(a, up.T, acc_u)

        # Epilogue: SwiGLU in fp32, bf16 stores of the live rows only, at their activation
        # rows (null rows hold g = u = 0 and store zeros).
        h2_val = acc_g * tl.sigmoid(acc_g) * acc_u
        act_rows = act_start + idx
        cols = n0 + tl.arange(0, BLOCK_N)
        if EVEN_N:
            out_mask = is_live[:, None]
        else:
            out_mask = is_live[:, None] & (cols < FFN)[None, :]
        if TMA_STORE:
            if num_live == BLOCK_M:
                # Asynchronous bulk writes from shared memory instead of every thread's
                # 16-byte vector stores.
                row = act_start.to(tl.int32)  # descriptor offsets are 32-bit
                h2_desc.store([row, n0], h2_val.to(tl.bfloat16))
                if WRITE_H1:
                    if h1_off >= 0:
                        h1_desc.store([row, n0], acc_g.to(tl.bfloat16))
                        h1_desc.store([row, FFN + n0], acc_u.to(tl.bfloat16))
            else:
                _w13_store_rows(h2_ptr, h1_ptr, h1_off, acc_g, acc_u, h2_val, act_rows, cols,
                                out_mask, FFN, WRITE_H1)
        else:
            _w13_store_rows(h2_ptr, h1_ptr, h1_off, acc_g, acc_u, h2_val, act_rows, cols,
                            out_mask, FFN, WRITE_H1)
        if WRITE_X:
            # The column tiles of a row tile share saving its gathered rows (training keeps
            # them for WGRAD): tile pid_n copies the K steps pid_n, pid_n + NUM_PID_N, ...,
            # so no tile carries the whole copy. A second pass rather than a store inside the
            # K loop keeps the main loop a plain load/dot pipeline; the rows were just read,
            # so this pass mostly hits L2.
            NUM_PID_N: tl.constexpr = (FFN + BLOCK_N - 1) // BLOCK_N
            if pid_n < NUM_K:
                if x_off >= 0:
                    x_rows = tl.multiple_of(x_out_ptr + x_off + act_rows * HIDDEN, 16)
                    for j in range(0, (NUM_K + NUM_PID_N - 1) // NUM_PID_N):
                        k = pid_n + j * NUM_PID_N
                        if k < NUM_K:
                            kk = k * BLOCK_K + offs_k
                            if EVEN_K:
                                a_mask = is_read_row[:, None]
                                x_mask = is_live[:, None]
                            else:
                                a_mask = is_read_row[:, None] & (kk < HIDDEN)[None, :]
                                x_mask = is_live[:, None] & (kk < HIDDEN)[None, :]
                            a = tl.load(a_rows[:, None] + kk[None, :], mask=a_mask, other=0.0)
                            if TMA_STORE:
                                if num_live == BLOCK_M:
                                    x_desc.store([act_start.to(tl.int32), k * BLOCK_K], a)
                                else:
                                    tl.store(x_rows[:, None] + kk[None, :], a, mask=x_mask)
                            else:
                                tl.store(x_rows[:, None] + kk[None, :], a, mask=x_mask)


@triton.jit
def _w13_weight_desc(
    w13,
    NUM_EXPERTS: tl.constexpr,
    HIDDEN: tl.constexpr,
    FFN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HOST_DESC: tl.constexpr,
):
    """TMA descriptor over w13 seen as ``[2 E_local, F, D]``: the host-built one passed in,
    or one built on the device (128 bytes of global scratch, a tensormap fence)."""
    if HOST_DESC:
        return w13
    else:
        return tl.make_tensor_descriptor(
            w13,
            shape=[2 * NUM_EXPERTS, FFN, HIDDEN],
            strides=[FFN * HIDDEN, HIDDEN, 1],
            block_shape=[1, BLOCK_N, BLOCK_K],
        )


@triton.jit
def _gather_w13_swiglu_kernel(
    gather_ptrs_ptr,
    padded_offsets_ptr,
    row_offsets_ptr,
    w13,
    h2_ptr,
    h1_ptr,
    x_out_ptr,
    out_offsets_ptr,
    enable_ptr,
    order_ptr,
    positions_ptr,
    num_pid_m,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    HIDDEN: tl.constexpr,
    FFN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    PERSISTENT: tl.constexpr,
    HOST_DESC: tl.constexpr,
    WRITE_H1: tl.constexpr,
    WRITE_X: tl.constexpr,
    DYN_OFFSETS: tl.constexpr,
    HAS_ENABLE: tl.constexpr,
    TMA_STORE: tl.constexpr,
    HAS_ORDER: tl.constexpr,
):
    """``w13`` is a host TMA descriptor (``HOST_DESC``) or the weight tensor itself.

    ``out_offsets_ptr`` (``DYN_OFFSETS``), ``enable_ptr`` (``HAS_ENABLE``) and
    ``positions_ptr`` (``HAS_ORDER``: the launch covers the row blocks
    ``order[positions[0]:positions[1]]``) are read once per program; without them they are
    placeholders that are never read. ``TMA_STORE``
    (persistent grids only): each program builds TMA descriptors over the live activation
    rows of its outputs once, for the epilogues of its full tiles.
    """
    NUM_PID_N: tl.constexpr = (FFN + BLOCK_N - 1) // BLOCK_N
    total_rows = tl.load(padded_offsets_ptr + NUM_EXPERTS)
    pos_lo = 0
    if HAS_ORDER:
        # this launch's row blocks: positions [pos_lo, pos_hi) of order
        pos_lo = tl.load(positions_ptr)
        total_rows = (tl.load(positions_ptr + 1) - pos_lo) * BLOCK_M
    if HAS_ENABLE:
        # The device decides whether this launch runs: disabled, every tile is idle.
        total_rows = tl.where(tl.load(enable_ptr) != 0, total_rows, 0)
    if DYN_OFFSETS:
        h1_off = tl.load(out_offsets_ptr)
        x_off = tl.load(out_offsets_ptr + 1)
    else:
        h1_off = 0
        x_off = 0
    if PERSISTENT:
        # One descriptor per program, reused by every tile it walks. The live tile count is
        # read on the device; a while loop (not range) keeps the interpreter working too.
        # Programs without a tile (a disabled launch, fewer tiles than programs) exit at once.
        num_live_m = total_rows // BLOCK_M
        num_tiles = num_live_m * NUM_PID_N
        tile_id = tl.program_id(0)
        if tile_id < num_tiles:
            w_desc = _w13_weight_desc(w13, NUM_EXPERTS, HIDDEN, FFN, BLOCK_N, BLOCK_K, HOST_DESC)
            if TMA_STORE:
                # Bounded by the live rows (row_offsets[E]): a box never reaches past them.
                # A skipped output (negative offset) gets a descriptor at offset 0 that is
                # never stored through. (At least 1 row: padding-only layouts store nothing,
                # but a descriptor needs a nonzero extent.)
                live = tl.maximum(tl.load(row_offsets_ptr + NUM_EXPERTS), 1)
                h2_desc = tl.make_tensor_descriptor(
                    h2_ptr, shape=[live, FFN], strides=[FFN, 1], block_shape=[BLOCK_M, BLOCK_N])
                h1_desc = h2_desc
                x_desc = h2_desc
                if WRITE_H1:
                    h1_desc = tl.make_tensor_descriptor(
                        h1_ptr + tl.maximum(h1_off, 0), shape=[live, 2 * FFN],
                        strides=[2 * FFN, 1], block_shape=[BLOCK_M, BLOCK_N])
                if WRITE_X:
                    x_desc = tl.make_tensor_descriptor(
                        x_out_ptr + tl.maximum(x_off, 0), shape=[live, HIDDEN],
                        strides=[HIDDEN, 1], block_shape=[BLOCK_M, BLOCK_K])
            else:
                h2_desc = h2_ptr  # placeholders, never used
                h1_desc = h2_ptr
                x_desc = h2_ptr
            while tile_id < num_tiles:
                pid_m, pid_n = swizzle_tile(tile_id, num_live_m, NUM_PID_N, GROUP_M)
                if HAS_ORDER:
                    pid_m = tl.load(order_ptr + pos_lo + pid_m)
                _w13_tile(
                    w_desc, gather_ptrs_ptr, padded_offsets_ptr, row_offsets_ptr, h2_ptr,
                    h1_ptr, x_out_ptr, h2_desc, h1_desc, x_desc, h1_off, x_off, pid_m, pid_n,
                    NUM_EXPERTS, EXPERTS_POW2, HIDDEN, FFN, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                    EVEN_N, WRITE_H1, WRITE_X, TMA_STORE,
                )  # fmt: skip
                tile_id += tl.num_programs(0)
    else:
        pid_m, pid_n = swizzle_tile(tl.program_id(0), num_pid_m, NUM_PID_N, GROUP_M)
        # Idle tiles (beyond the used rows) exit before building a descriptor or loading.
        if pid_m * BLOCK_M < total_rows:
            if HAS_ORDER:
                pid_m = tl.load(order_ptr + pos_lo + pid_m)
            w_desc = _w13_weight_desc(w13, NUM_EXPERTS, HIDDEN, FFN, BLOCK_N, BLOCK_K, HOST_DESC)
            _w13_tile(
                w_desc, gather_ptrs_ptr, padded_offsets_ptr, row_offsets_ptr, h2_ptr, h1_ptr,
                x_out_ptr, h2_ptr, h2_ptr, h2_ptr, h1_off, x_off, pid_m, pid_n, NUM_EXPERTS,
                EXPERTS_POW2, HIDDEN, FFN, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, WRITE_H1,
                WRITE_X, False,
            )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


def check_w13_args(
    gather_ptrs,
    padded_offsets,
    row_offsets,
    w13,
    h2_out,
    h1_out,
    x_out,
    out_offsets,
    enable,
    *,
    for_kernel: bool,
) -> tuple[int, int, int, int]:
    check_tensor("w13", w13, dtypes=(torch.bfloat16,), ndim=4, shape_text="[E_local, 2, F, D]")
    num_experts, two, ffn, hidden = w13.shape
    if two != 2 or num_experts < 1:
        raise ValueError(
            f"w13 must have shape [E_local >= 1, 2, F, D] (gate, up), got {list(w13.shape)}"
        )
    check_width("w13's D (hidden)", hidden)
    check_width("w13's F (ffn)", ffn)
    check_tensor("gather_ptrs", gather_ptrs, dtypes=(torch.int64,), ndim=1, shape_text="[R_cap]")
    r_cap = gather_ptrs.shape[0]
    check_offsets(padded_offsets, row_offsets, num_experts)
    named = {
        "gather_ptrs": gather_ptrs,
        "padded_offsets": padded_offsets,
        "row_offsets": row_offsets,
        "w13": w13,
    }
    check_tensor("h2_out", h2_out, dtypes=(torch.bfloat16,), ndim=2, shape_text="[R_act, F]")
    if h2_out.shape[1] != ffn:
        raise ValueError(
            f"h2_out must have shape [R_act, F={ffn}] (F from w13), got {list(h2_out.shape)}"
        )
    check_activation_rows("h2_out", h2_out, r_cap=r_cap)
    named["h2_out"] = h2_out
    if out_offsets is None:
        for name, out, width, text in (
            ("h1_out", h1_out, 2 * ffn, "2F"),
            ("x_out", x_out, hidden, "D"),
        ):
            if out is None:
                continue
            check_tensor(
                name,
                out,
                dtypes=(torch.bfloat16,),
                ndim=2,
                shape_text=f"[R_act, {text}] (a 1-D base needs out_offsets)",
            )
            if out.shape[1] != width:
                raise ValueError(
                    f"{name} must have shape [R_act, {text}={width}] (activation rows; a 1-D "
                    f"base needs out_offsets), got {list(out.shape)}"
                )
            check_activation_rows(name, out, r_cap=r_cap)
            named[name] = out
    else:
        check_tensor(
            "out_offsets", out_offsets, dtypes=(torch.int64,), shape=[2], shape_text="(h1, x)"
        )
        named["out_offsets"] = out_offsets
        for name, out in (("h1_out", h1_out), ("x_out", x_out)):
            if out is None:
                raise ValueError(
                    f"{name} must be given with out_offsets (both h1_out and x_out, 1-D bf16 "
                    "base tensors; a negative offset skips an output), got None"
                )
            check_bf16_base(name, out)
            named[name] = out
    if enable is not None:
        check_tensor("enable", enable, dtypes=(torch.int32,), shape=[1], shape_text="(0 = skip)")
        named["enable"] = enable
    check_devices(named, for_kernel=for_kernel)
    if for_kernel:
        check_tma_aligned("w13", w13)
    return r_cap, num_experts, ffn, hidden


def w13_gluon_reason(config: W13Config, device: torch.device, hidden: int, ffn: int,
                  aligned: bool) -> str | None:
    """``None`` when ``config`` runs the Gluon kernel here, else why not (``config.gluon``
    False included); ``aligned``: every output starts 16-byte aligned."""
    if config.gluon and not aligned:
        return "its 16-byte vector stores need 16-byte aligned outputs"
    return config_gluon_reason(config, w13_gluon.gluon_w13_reason, device, hidden, ffn)


def w13_tile_rows(config: W13Config, gluon: bool | None = None) -> int:
    """Padded rows of one W13 tile (a row block of ``order``) under ``config``: the Gluon
    kernel's :func:`~distmoe.kernels.w13_forward.gluon.tile_rows` where it runs (``gluon``; default
    ``config.gluon``), else ``block_m``."""
    if config.gluon if gluon is None else gluon:
        return tile_rows(config.block_n, config.num_warps)
    return config.block_m


def _check_order(order, positions, r_cap: int, rows: int, device: torch.device) -> None:
    if (order is None) != (positions is None):
        raise ValueError("order and positions must be given together, got "
                         f"order {'None' if order is None else 'given'} and positions "
                         f"{'None' if positions is None else 'given'}")
    if order is None:
        return
    check_tensor("order", order, dtypes=(torch.int32,), shape=[r_cap // rows],
                 shape_text=f"[R_cap / {rows}] (row blocks of the kernel's {rows}-row tiles)")
    check_tensor("positions", positions, dtypes=(torch.int32,), shape=[2],
                 shape_text="[lo, hi] (positions of order)")
    for name, t in (("order", order), ("positions", positions)):
        if t.device != device:
            raise ValueError(f"{name} must be on {device}, got {t.device}")


def gather_w13_swiglu(
    gather_ptrs: torch.Tensor,
    padded_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    w13: torch.Tensor,
    h2_out: torch.Tensor,
    *,
    h1_out: torch.Tensor | None = None,
    x_out: torch.Tensor | None = None,
    out_offsets: torch.Tensor | None = None,
    enable: torch.Tensor | None = None,
    config: W13Config | None = None,
    block_m: int | None = None,
    order: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gathered rows @ W13 with SwiGLU, into compact activation rows.

    Args:
        gather_ptrs: int64 ``[R_cap]`` indexed by padded row: absolute byte address of each
            row's D bf16 source values (16-byte aligned; may be a peer's mapped memory),
            0 = null row (reads zeros). Entries of padding rows are never read.
        padded_offsets: int32 ``[E_local + 1]`` (device): expert ``e`` owns padded rows
            ``[padded_offsets[e], padded_offsets[e+1])``, each a multiple of ``block_m``
            (the tile schedule).
        row_offsets: int32 ``[E_local + 1]`` (device): exclusive prefix sum of live rows per
            expert; padded row ``padded_offsets[e] + j`` is live iff
            ``j < row_offsets[e+1] - row_offsets[e]``, and its activation row is
            ``row_offsets[e] + j``.
        w13: bf16 ``[E_local, 2, F, D]`` contiguous (``w13[e, 0]`` gate, ``w13[e, 1]`` up).
        h2_out: bf16 ``[R_act, F]`` (``R_act >= row_offsets[E_local]``, >= 1): receives
            ``silu(g) * u`` at the activation rows.
        h1_out: optional (training), receives ``[g | u]``: bf16 ``[R_act, 2F]`` in activation
            rows, or with ``out_offsets`` a 1-D bf16 base (row ``a`` at element
            ``out_offsets[0] + a*2F``).
        x_out: optional (training), receives the gathered rows: bf16 ``[R_act, D]``, or with
            ``out_offsets`` a 1-D bf16 base (row ``a`` at element ``out_offsets[1] + a*D``;
            may be the same tensor as ``h1_out``).
        out_offsets: optional int64 ``[2]`` on the device: bf16 element offsets of h1 and x
            into their bases (multiples of 8; e.g. a slot cursor); a negative offset means
            that output is not stored. Requires both ``h1_out`` and ``x_out``.
        enable: optional int32 ``[1]`` on the device: 0 = every program returns at once
            (nothing is written), anything else = run.
        config: launch configuration; default :meth:`W13Config.for_widths`.
        block_m: the padding multiple (default 128); must match ``config.block_m`` if both
            are given.
        order, positions: optional, together: int32 ``[R_cap / M]`` (device), a permutation
            of the row blocks of ``M`` padded rows (``M`` = :func:`w13_tile_rows` of the
            config), and int32 ``[2]`` (device) ``[lo, hi)``: this launch computes only the
            row blocks ``order[lo:hi]``, every column tile of each (the tiles of a launch
            without them), in group-M order over the positions. Launches over disjoint
            position ranges that cover the call's blocks compute what one launch does, bit
            for bit (:mod:`distmoe.kernels.w13_forward.phases`).

    Only the live rows' activation rows ``< row_offsets[E_local]`` of every output are
    written (null rows as zeros); padding rows are not stored and every other row or element
    is left untouched. Returns ``h2_out``.
    """
    r_cap, num_experts, ffn, hidden = check_w13_args(
        gather_ptrs,
        padded_offsets,
        row_offsets,
        w13,
        h2_out,
        h1_out,
        x_out,
        out_offsets,
        enable,
        for_kernel=True,
    )
    if config is None:
        config = W13Config.for_widths(
            hidden=hidden, ffn=ffn, block_m=128 if block_m is None else block_m
        )
    elif not isinstance(config, W13Config):
        raise TypeError(f"config must be a W13Config, got {type(config).__name__}")
    validate_block_m(config, block_m)
    check_gather_r_cap(r_cap, config.block_m)
    device = gather_ptrs.device
    # the Gluon kernel's vector stores and TMA stores need 16-byte aligned bases (1-D bases
    # with out_offsets are checked above)
    aligned = all(t is None or t.data_ptr() % 16 == 0 for t in (h2_out, h1_out, x_out))
    gluon_reason = w13_gluon_reason(config, device, hidden, ffn, aligned)
    _check_order(order, positions, r_cap, w13_tile_rows(config, gluon_reason is None), device)
    if r_cap == 0:
        return h2_out

    if config.gluon:
        if gluon_reason is None:
            w13_gluon.launch_gluon_w13(
                gather_ptrs, padded_offsets, row_offsets, w13, h2_out, h1_out=h1_out, x_out=x_out,
                out_offsets=out_offsets, enable=enable, block_n=config.block_n,
                stages=config.num_stages, group_m=config.group_m, warps=config.num_warps,
                order=order, positions=positions, lockstep=config.lockstep,
                expert_groups=config.expert_groups)
            return h2_out
        warn_gluon_fallback("gather_w13_swiglu", gluon_reason)
    num_pid_m = r_cap // config.block_m
    num_pid_n = triton.cdiv(ffn, config.block_n)
    grid = gemm_grid(config, num_pid_m * num_pid_n, device)
    if config.host_descriptors:
        w13_arg = TensorDescriptor(
            w13,
            shape=[2 * num_experts, ffn, hidden],
            strides=[ffn * hidden, hidden, 1],
            block_shape=[1, config.block_n, config.block_k],
        )
    else:
        w13_arg = w13
    tma_store = (config.tma_epilogue and config.persistent and ffn % config.block_n == 0
                 and hidden % config.block_k == 0 and aligned)
    if tma_store or not config.host_descriptors:
        ensure_tma_allocator()
    with device_context(device):
        _gather_w13_swiglu_kernel[(grid,)](
            gather_ptrs,
            padded_offsets,
            row_offsets,
            w13_arg,
            h2_out,
            h2_out if h1_out is None else h1_out,  # placeholder: never touched (WRITE_H1)
            h2_out if x_out is None else x_out,  # placeholder: never touched (WRITE_X)
            padded_offsets if out_offsets is None else out_offsets,  # placeholder: never read
            padded_offsets if enable is None else enable,  # placeholder: never read
            padded_offsets if order is None else order,  # placeholder: never read
            padded_offsets if positions is None else positions,  # placeholder: never read
            num_pid_m,
            NUM_EXPERTS=num_experts,
            EXPERTS_POW2=next_power_of_2(num_experts),
            HIDDEN=hidden,
            FFN=ffn,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            GROUP_M=config.group_m,
            EVEN_K=hidden % config.block_k == 0,
            EVEN_N=ffn % config.block_n == 0,
            PERSISTENT=config.persistent,
            HOST_DESC=config.host_descriptors,
            WRITE_H1=h1_out is not None,
            WRITE_X=x_out is not None,
            DYN_OFFSETS=out_offsets is not None,
            HAS_ENABLE=enable is not None,
            TMA_STORE=tma_store,
            HAS_ORDER=order is not None,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
    return h2_out


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------


def _output_rows(
    name: str, out: torch.Tensor, offset: int | None, start: int, count: int, width: int
) -> torch.Tensor:
    """Rows ``[start, start + count)`` of an output: a 2-D tensor, or a 1-D base at ``offset``."""
    if offset is None:
        rows = out[start : start + count]
    else:
        lo = offset + start * width
        rows = out[lo : lo + count * width]
        rows = rows.view(-1, width) if rows.numel() == count * width else rows
    if rows.shape != (count, width):
        raise ValueError(
            f"{name} is too small: activation rows [{start}, {start + count}) of width "
            f"{width}{'' if offset is None else f' at element offset {offset}'} do not fit in "
            f"shape {list(out.shape)}"
        )
    return rows


def gather_w13_swiglu_ref(
    gather_ptrs: torch.Tensor,
    padded_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    w13: torch.Tensor,
    h2_out: torch.Tensor,
    *,
    h1_out: torch.Tensor | None = None,
    x_out: torch.Tensor | None = None,
    out_offsets: torch.Tensor | None = None,
    enable: torch.Tensor | None = None,
    sources: Sequence[torch.Tensor],
    block_m: int = 128,
    order: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    tile_rows: int | None = None,
) -> torch.Tensor:
    """Plain-PyTorch :func:`gather_w13_swiglu` (any device; synchronises; for tests).

    Same arguments and contract; ``enable``, ``out_offsets``, ``order`` / ``positions`` (row
    blocks of ``tile_rows`` rows, default ``block_m``) and the layout are read and checked
    on the host. ``sources`` lists the tensors the addresses point into (contiguous
    bf16, seen as rows of D values): an address is resolved to its (tensor, row) on the host.
    fp32 matmuls, outputs rounded to bf16 like the kernel's; only live rows are written.
    """
    r_cap, _, _, hidden = check_w13_args(
        gather_ptrs,
        padded_offsets,
        row_offsets,
        w13,
        h2_out,
        h1_out,
        x_out,
        out_offsets,
        enable,
        for_kernel=False,
    )
    check_gather_r_cap(r_cap, block_m)
    check_padded_offsets_host(padded_offsets, block_m=block_m, r_cap=r_cap)
    check_row_offsets_host(padded_offsets, row_offsets, r_act=h2_out.shape[0])
    if enable is not None and int(enable.item()) == 0:
        return h2_out
    rows = block_m if tile_rows is None else tile_rows
    _check_order(order, positions, r_cap, rows, gather_ptrs.device)
    chosen = None  # padded rows this call computes (None: all)
    if order is not None:
        lo, hi = (int(v) for v in positions.tolist())
        blocks = order[lo:hi].long().cpu()
        chosen = torch.zeros(r_cap, dtype=torch.bool)
        for b in blocks.tolist():
            chosen[b * rows:(b + 1) * rows] = True
        chosen = chosen.to(h2_out.device)
    h1_off = x_off = None
    if out_offsets is not None:
        h1_off, x_off = (int(v) for v in out_offsets.tolist())
    for e, (pad_start, act_start, count) in enumerate(
        activation_segments(padded_offsets, row_offsets)
    ):
        if count == 0:
            continue
        xe = rows_at(
            gather_ptrs[pad_start : pad_start + count],
            sources,
            row_elems=hidden,
            name="gather_ptrs",
        ).to(w13.device)
        g = xe @ w13[e, 0].float().T
        u = xe @ w13[e, 1].float().T
        keep = slice(None) if chosen is None else chosen[pad_start:pad_start + count]
        h2 = _output_rows("h2_out", h2_out, None, act_start, count, g.shape[1])
        h2[keep] = (torch.nn.functional.silu(g) * u).to(torch.bfloat16)[keep]
        if h1_out is not None and (h1_off is None or h1_off >= 0):
            h1 = _output_rows("h1_out", h1_out, h1_off, act_start, count, 2 * g.shape[1])
            h1[keep] = torch.cat([g, u], dim=1).to(torch.bfloat16)[keep]
        if x_out is not None and (x_off is None or x_off >= 0):
            _output_rows("x_out", x_out, x_off, act_start, count, hidden)[keep] = xe[keep]
    return h2_out
