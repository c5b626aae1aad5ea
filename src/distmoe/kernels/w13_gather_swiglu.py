"""Grouped W13 GEMM with a row-gather prologue and a SwiGLU epilogue (forward, bf16).

Two row numberings (see :mod:`distmoe.kernels._common`): the *padded* expert-major rows are
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
local rows mostly come from L2 after the first read; rows in a peer GPU's memory may cross
NVLink on every read (peer memory is, as far as we know, not cached in the reader's L2; to be
measured), which can make the kernel NVLink-bound; staging remote rows into a local buffer
first would avoid that.
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
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from distmoe.kernels._common import (
    GemmConfig,
    activation_segments,
    check_activation_rows,
    check_bf16_base,
    check_block_counters,
    check_devices,
    check_offsets,
    check_padded_offsets_host,
    check_row_offsets_host,
    check_tensor,
    check_tma_aligned,
    check_width,
    config_gluon_reason,
    device_context,
    ensure_tma_allocator,
    gemm_grid,
    gluon_device,
    gluon_mid_rows,
    lockstep_rows,
    next_power_of_2,
    rows_at,
    swizzle_tile,
    tile_activation_rows,
    tile_expert,
    validate_block_m,
    warn_gluon_fallback,
)

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
# Launch configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class W13Config(GemmConfig):
    """Launch configuration of :func:`gather_w13_swiglu` (see :class:`GemmConfig`).

    ``block_n`` counts h2 columns: each program loads a gate and an up tile of ``block_n``
    rows of ``w13`` and keeps two fp32 accumulators, so a 128 x 128 tile is a 128 x 256 GEMM
    tile with 128 accumulator registers per thread at 8 warps. ``host_descriptors`` covers
    the weight TMA descriptor.
    """

    _B_TILES = 2
    _ACCUMULATORS = 2

    #: Full tiles of a persistent grid store h2, h1 and x through TMA descriptors that each
    #: program builds once (needs F a multiple of ``block_n``, D of ``block_k`` and 16-byte
    #: aligned outputs; otherwise, and on a grid of one program per tile, every tile keeps
    #: pointer stores).
    tma_epilogue: bool = False
    #: Run the warp-specialised Gluon kernel (:mod:`distmoe.kernels.w13_gluon`: a producer
    #: warpgroup gathers while two consumer warpgroups compute) where it can run: Hopper,
    #: not the interpreter, ``block_m`` 128, ``block_k`` 64, F a multiple of ``block_n``, D
    #: of 64, 16-byte aligned outputs, a ring that fits
    #: (:func:`~distmoe.kernels.w13_gluon.gluon_w13_reason`). ``num_warps`` counts the MMA
    #: warps of one tile: 4 ("ping-pong", ``block_n`` 64 for 128 x 64 tiles or 128 for
    #: 64 x 128: the consumers take tiles in turn, each one's epilogue under the other's
    #: MMAs) or 8 ("cooperative", ``block_n`` 128: both consumers on one 128 x 128 tile, 64
    #: rows each, the epilogue not under MMAs). Mind ``GemmConfig``'s default of 8 warps:
    #: ``block_n`` 64 needs ``num_warps=4``. Elsewhere the Triton kernel runs this config
    #: (with a ``RuntimeWarning`` that says why). Uses ``num_stages`` and ``group_m``;
    #: ``persistent`` does not apply (12 warps, one program per SM).
    gluon: bool = False
    #: The Gluon kernel's producers start each wave of tiles together: each waits (a bounded
    #: spin on a device counter) until every program has issued the loads of its previous
    #: tile. Under a real router's routing, tiles differ in live rows and so in time, and
    #: programs that drift apart no longer find the row blocks and weight tiles they share
    #: in L2. Same bits; the Triton kernel ignores it. :meth:`hopper_gluon` sets it at 128
    #: to 191 rows per expert.
    lockstep: bool = False
    #: The Gluon kernel's tile order: a group per expert rather than per ``group_m`` row
    #: blocks. An expert's tiles keep their range of tile numbers but are walked column tile
    #: by column tile over all its row blocks, so a row block's column tiles run close
    #: together, for its gathered rows to stay in L2 between them (in group-M 8 order at
    #: DeepSeek-V3's 128 rows per expert they came from DRAM 2.6 times over: performance.md
    #: run 58), and the row blocks that read a weight tile run side by side. Ignored by the
    #: Triton kernel and with a block order (``order``: EP > 1 with the token copy split
    #: around its join). :meth:`hopper_gluon` sets it where it sets ``lockstep`` (for
    #: training too since run 61).
    expert_groups: bool = False

    def smem_bytes(self) -> int:
        if self.gluon:
            from .w13_gluon import stage_bytes

            return self.num_stages * stage_bytes(self.block_n, self.block_k, self.num_warps)
        return super().smem_bytes()

    def accumulator_regs_per_thread(self) -> int:
        # the Gluon kernel: 128 x 128 fp32 per consumer warpgroup, whatever the tile
        return 128 if self.gluon else super().accumulator_regs_per_thread()

    @classmethod
    def from_heuristic(cls, *, hidden: int, ffn: int, block_m: int = 128,
                       rows_per_expert: int | None = None, training: bool = False,
                       device: torch.device | None = None,
                       num_experts: int | None = None) -> W13Config:
        """Config from the shapes (D = ``hidden``, F = ``ffn``) and the padding multiple.

        Hopper defaults: 128 x 128 x 64 tiles, 8 warps, group-M 8, 3 stages (48 KiB of SMEM
        per stage). Smaller dimensions shrink the tiles. With a ``rows_per_expert`` hint (the
        balanced rows per local expert ``T*K*EP/E``, a shape key, never a routed count): a
        persistent grid with 4 stages, except 3 for training (h1 and x stored too) with long
        expert segments (hint >= 1024); for inference (``training`` False: only h2 is
        stored) with long segments, also the TMA epilogue.
        Measured on one H200 (2026-11-29): at T=8192 D=4096 F=2048 E=32 K=8, persistent/3
        stages 3.23 ms against 3.45 for one program per tile (``tools/tune_gemm.py``); the
        inference layer forward 5.37 ms with 4 stages and the TMA epilogue against 5.55-5.57
        with 3 stages and pointer stores (``python -m distmoe bench``, performance.md run
        19). In training, 4 stages gave nothing at the layer (17.79 against 17.70 ms) and
        the TMA epilogue was slower in the tuner (each store waits for its buffer before the
        next), as it was at T=4096 D=2048 F=768 E=128 K=8 (0.41 against 0.39 ms). At that
        shape persistent/4 stages: 0.393 ms against 0.459 for one program per tile.

        With the hint and a ``device`` where the warp-specialised Gluon kernel runs (Hopper,
        not the interpreter, ``block_m`` 128, F and D multiples of 64): that kernel
        (``gluon``, :meth:`hopper_gluon` says which tile). Measured on one H200 (2026-11-29):

        * performance.md run 24, 128 x 64 ping-pong tiles: layer forward+backward at issue-a
          17.16-17.25 against 17.33-17.44 ms (Triton), inference forward 5.38-5.42 against
          5.50-5.52; at T=4096 D=2048 F=768 E=128 K=8 the training kernel 0.427 against
          0.504 ms in ``tools/tune_gemm.py``, its inference forward even with Triton at the
          layer;
        * run 27, cooperative 128 x 128 tiles (4 stages) against those: the training kernel
          3.03 against 3.42 ms at issue-a and 0.396 against 0.424 at the fine shape, the
          layer 0.7-1.9% faster in all four cases (issue-a and fine, forward and
          forward+backward); at T=4096 D=2048 F=1024 E=64 K=8 the inference forward 10%
          faster than the Triton kernel;
        * run 29, interleaved in one process: the cooperative tile for inference at 128 rows
          per expert too (forward 4-5% faster at two shapes);
        * run 30, interleaved: and for inference below 64 rows per expert (decode, 0.9-3.4%);
        * run 38, interleaved: and for inference at 64-127 rows per expert where the local
          expert count ``num_experts`` is given and their W13 weights total less than 2 GiB
          (:func:`~distmoe.kernels._common.gluon_mid_rows`).
        """
        if rows_per_expert is not None and block_m == 128 and gluon_device(device):
            gluon = cls.hopper_gluon(hidden=hidden, ffn=ffn,
                                     rows_per_expert=rows_per_expert, training=training,
                                     num_experts=num_experts)
            if gluon is not None:
                return gluon
        block_n = min(128, max(16, next_power_of_2(ffn)))
        block_k = min(64, max(16, next_power_of_2(hidden)))
        num_warps = 8 if block_m * block_n >= 128 * 128 else 4
        per_stage = (block_m + 2 * block_n) * block_k * 2
        num_stages = max(2, min(4, (160 * 1024) // per_stage))
        persistent = tma_epilogue = False
        if rows_per_expert is not None:
            persistent = True
            long_segments = rows_per_expert >= 1024
            if not (training and long_segments):
                num_stages = max(2, min(4, (200 * 1024) // per_stage))
            tma_epilogue = not training and long_segments
        return cls(
            block_m=block_m,
            block_n=block_n,
            block_k=block_k,
            num_warps=num_warps,
            num_stages=num_stages,
            group_m=8,
            persistent=persistent,
            tma_epilogue=tma_epilogue,
        )

    @classmethod
    def hopper_gluon(cls, *, hidden: int, ffn: int, rows_per_expert: int,
                     training: bool, num_experts: int | None = None) -> W13Config | None:
        """The Gluon config :meth:`from_heuristic` picks on a Hopper device (padding multiple
        128), or ``None`` where it keeps the Triton kernel: inference at 64-127 rows per
        expert unless :func:`~distmoe.kernels._common.gluon_mid_rows` holds for the local
        expert count ``num_experts`` (their W13 weights under 2 GiB), and widths the Gluon
        kernel cannot tile.

        The first of these that the kernel can tile (:func:`~distmoe.kernels.w13_gluon.\
shape_reason`):

        * cooperative 128 x 128 tiles (``num_warps`` 8), 4 stages, from 128 rows per expert
          (performance.md run 27, at the layer: faster at 256, 512 and 2048 rows per expert
          in training and inference; at 128, training even at T=2048 D=2048 F=768 E=128 K=8
          and 1.4% faster at T=4096 D=7168 F=2048 E=256 K=8. Inference at 128, timed
          interleaved in one process (run 29, ``tools/ab_interleaved.py``): 4.0-4.2% faster
          at the first shape (two calls) and 5.4% at the second, where run 27's one-round
          A/B read +1.7% and -0.6%; at 96 rows per expert, T=4096 D=4096 F=2048 E=256 K=6,
          1.5% slower); also for inference below 64 rows per expert (decode: a few rows of
          each expert, its weights streamed once). Run 30, interleaved, random routing: the
          layer forward 0.9-3.4% faster in five cases of 1 to 32 rows per expert, T=16 and
          128 at D=4096 F=2048 E=32 K=8 and at D=2048 F=768 E=128 K=8, T=128 at D=7168
          F=2048 E=256 K=8; run 38: at 64-127 rows per expert 1.3-4.5% faster at D=2048
          F=768 E=128, D=2048 F=1024 E=64 and D=4096 F=2048 E=32, even to 2% slower at D=4096
          and 7168, F=2048, E=256 (and E=128 at EP=2): hence the bound on the weights;
        * for training, and for inference with >= 1024 rows per expert: ping-pong 128 x 64
          tiles, 5 stages at >= 1024 rows per expert, else 6 (run 24).

        The cooperative tile runs with ``lockstep`` at 128 to 191 rows per expert
        (:data:`~distmoe.kernels._common.LOCKSTEP_ROWS`): there a router's histogram gives
        about half the experts a second, nearly empty row block, and programs that drift
        apart read its weight tiles from DRAM again (performance.md run 51). Run 52,
        interleaved, sampled routing, one H100: inference forward 1.22x at T=4096 D=7168
        F=2048 E=256 K=8 (1.07x under exact routing), 1.085x at D=F=2880 E=128 K=4 and
        1.018x at T=2048 D=2048 F=768 E=128 K=8; forward+backward 1.026-1.032x at the
        second and even at the third; at 256 rows per expert (T=4096 at the third's widths)
        the forward 2.8% slower, at 512 and 2048 and at decode (T=64) even to 1.1% slower:
        hence the bound, halfway to 256.

        It also walks its tiles in ``expert_groups`` order there: run 58, interleaved, one
        H100, inference forward 1.034x (sampled) / 1.016x (exact) at T=4096 D=7168 F=2048
        E=256 K=8, 1.058x at D=F=2880 E=128 K=4 (sampled), 1.008x at T=1024 D=2048 F=1024
        E=64 K=8; at 256 and 2048 rows per expert (not taken there) 1.009x and 0.996x. In
        training since run 61 (one H100, 2026-12-06): Nsight Compute on the kernel in the
        first shape's fwd+bwd step 6.28 -> 5.94 ms (DRAM reads 16.65 -> 15.56 GB); the step
        (interleaved, 9-15 rounds) 1.009x / 1.012x sampled and 1.000x exact there, 1.017x /
        1.016x sampled and 1.007x exact at the second; forced on outside the lockstep rows
        0.980-1.008x (fine, OLMoE, 2048 rows per expert), so not taken there.

        Where 128 does not divide F (F a multiple of 64) the cooperative tile's last column
        tile is partial; it is a candidate only where its columns past F are at most 1/16 of
        F (GPT-OSS's 2880: run 49 measured it there).
        """
        from .w13_gluon import shape_reason

        long_segments = rows_per_expert >= 1024
        decode = not training and rows_per_expert < 64
        mid = not training and gluon_mid_rows(rows_per_expert, num_experts, 2 * ffn * hidden)
        candidates = []
        # a partial last column tile (128 not dividing F) wastes its columns past F: take the
        # cooperative tile only where that is at most 1/16 of F (GPT-OSS: 64 of 2880)
        coop_waste = -(-ffn // 128) * 128 - ffn
        if (rows_per_expert >= 128 or decode or mid) and 16 * coop_waste <= ffn:
            lockstep = lockstep_rows(rows_per_expert)
            candidates.append(cls(block_m=128, block_n=128, block_k=64, num_warps=8,
                                  num_stages=4, group_m=8, persistent=True, gluon=True,
                                  lockstep=lockstep, expert_groups=lockstep))
        if training or long_segments:
            candidates.append(cls(block_m=128, block_n=64, block_k=64, num_warps=4,
                                  num_stages=5 if long_segments else 6, group_m=8,
                                  persistent=True, gluon=True))
        for config in candidates:
            if shape_reason(hidden=hidden, ffn=ffn, block_m=128, block_n=config.block_n,
                            block_k=64, stages=config.num_stages,
                            warps=config.num_warps) is None:
                return config
        return None

    @classmethod
    def all_configs(cls, *, block_m: int = 128) -> list[W13Config]:
        """Candidates for a benchmark sweep at one padding multiple (fitting SM90)."""
        return cls.sweep(block_m=block_m, block_ns=(64, 128), block_ks=(64, 128),
                         persistent=(False, True))


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


def _check_w13_args(
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


def _check_r_cap(r_cap: int, block_m: int) -> None:
    if r_cap % block_m:
        raise ValueError(
            f"R_cap ({r_cap}, rows of gather_ptrs) must be a multiple of block_m ({block_m})"
        )


def _gluon_reason(config: W13Config, device: torch.device, hidden: int, ffn: int,
                  aligned: bool) -> str | None:
    """``None`` when ``config`` runs the Gluon kernel here, else why not (``config.gluon``
    False included); ``aligned``: every output starts 16-byte aligned."""
    if config.gluon and not aligned:
        return "its 16-byte vector stores need 16-byte aligned outputs"
    from .w13_gluon import gluon_w13_reason

    return config_gluon_reason(config, gluon_w13_reason, device, hidden, ffn)


def w13_done_count(config: W13Config, ffn: int) -> int:
    """What each entry of :func:`gather_w13_swiglu`'s ``done`` reaches once the Gluon kernel
    under ``config`` has stored the h2 rows (F = ``ffn`` wide) of its 128 padded rows (the
    ``need`` of :func:`~distmoe.kernels.w2_scatter.w2_scatter`'s ``wait``)."""
    from .w13_gluon import done_count

    return done_count(ffn, config.block_n, config.num_warps)


def w13_tile_rows(config: W13Config, gluon: bool | None = None) -> int:
    """Padded rows of one W13 tile (a row block of ``order``) under ``config``: the Gluon
    kernel's :func:`~distmoe.kernels.w13_gluon.tile_rows` where it runs (``gluon``; default
    ``config.gluon``), else ``block_m``."""
    if config.gluon if gluon is None else gluon:
        from .w13_gluon import tile_rows

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
    done: torch.Tensor | None = None,
    programs: int | None = None,
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
        config: launch configuration; default :meth:`W13Config.from_heuristic`.
        block_m: the padding multiple (default 128); must match ``config.block_m`` if both
            are given.
        order, positions: optional, together: int32 ``[R_cap / M]`` (device), a permutation
            of the row blocks of ``M`` padded rows (``M`` = :func:`w13_tile_rows` of the
            config), and int32 ``[2]`` (device) ``[lo, hi)``: this launch computes only the
            row blocks ``order[lo:hi]``, every column tile of each (the tiles of a launch
            without them), in group-M order over the positions. Launches over disjoint
            position ranges that cover the call's blocks compute what one launch does, bit
            for bit (:mod:`distmoe.kernels.w13_phases`).
        done: optional int32 ``[R_cap / 128]`` (device), for a W2 run beside this launch
            (:func:`~distmoe.kernels.w2_scatter.w2_scatter`'s ``wait``): after storing its h2
            rows each tile adds to the entry of its 128 padded rows (release, GPU scope), so
            an entry zeroed before the call reaches :func:`w13_done_count` once every tile
            over those rows has stored. Gluon kernel only (ValueError elsewhere).
        programs: optional grid of the Gluon kernel (default one program per SM): fewer
            leave SMs to a kernel run beside it.

    Only the live rows' activation rows ``< row_offsets[E_local]`` of every output are
    written (null rows as zeros); padding rows are not stored and every other row or element
    is left untouched. Returns ``h2_out``.
    """
    r_cap, num_experts, ffn, hidden = _check_w13_args(
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
        config = W13Config.from_heuristic(
            hidden=hidden, ffn=ffn, block_m=128 if block_m is None else block_m
        )
    elif not isinstance(config, W13Config):
        raise TypeError(f"config must be a W13Config, got {type(config).__name__}")
    validate_block_m(config, block_m)
    _check_r_cap(r_cap, config.block_m)
    device = gather_ptrs.device
    # the Gluon kernel's vector stores and TMA stores need 16-byte aligned bases (1-D bases
    # with out_offsets are checked above)
    aligned = all(t is None or t.data_ptr() % 16 == 0 for t in (h2_out, h1_out, x_out))
    gluon_reason = _gluon_reason(config, device, hidden, ffn, aligned)
    _check_order(order, positions, r_cap, w13_tile_rows(config, gluon_reason is None), device)
    check_block_counters("done", done, r_cap, device, programs)
    if done is not None and gluon_reason is not None:
        raise ValueError(f"done needs the Gluon W13 kernel, which does not run here: "
                         f"{gluon_reason}")
    if r_cap == 0:
        return h2_out

    if config.gluon:
        if gluon_reason is None:
            from .w13_gluon import launch_gluon_w13

            launch_gluon_w13(gather_ptrs, padded_offsets, row_offsets, w13, h2_out,
                             h1_out=h1_out, x_out=x_out, out_offsets=out_offsets,
                             enable=enable, block_n=config.block_n, stages=config.num_stages,
                             group_m=config.group_m, warps=config.num_warps, order=order,
                             positions=positions, done=done, programs=programs,
                             lockstep=config.lockstep, expert_groups=config.expert_groups)
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
    r_cap, _, _, hidden = _check_w13_args(
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
    _check_r_cap(r_cap, block_m)
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
