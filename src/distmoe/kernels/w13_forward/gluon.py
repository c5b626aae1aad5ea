"""Gather + W13 + SwiGLU for Hopper as a warp-specialised Gluon kernel (ping-pong or cooperative).

Same contract as :func:`distmoe.kernels.w13_forward.triton.gather_w13_swiglu` (its module
docstring defines the row numberings, ``out_offsets`` and ``enable``); that function launches
this kernel when its config asks for it (``W13Config.gluon``) and :func:`gluon_w13_reason`
returns ``None``.

Why: the Triton kernel runs each tile's epilogue between its last MMA and the next tile's
first, in the same warps. In a training forward that epilogue stores h1 ``[g | u]``, h2 and a
share of the gathered rows, about 160 KiB per 128 x 256 tile, and the tensor cores wait for it
(evidence: docs/performance.md). The same gathers, MMAs and stores are split over three
partitions here, one program per SM:

* a producer warpgroup fills a ring of ``STAGES`` shared-memory stages, K step by K step over
  the program's tiles ``pid, pid + G, ...``: the gate and up weight tiles by TMA into the two
  halves of one ``[2 BLOCK_N, BLOCK_K]`` stage, the gathered rows as 16-byte ``cp.async``
  (Hopper has no TMA gather; null and non-live rows are zero-filled). Each producer thread's
  ``cp.async.mbarrier.arrive.noinc`` and the TMA transaction count complete a stage's
  ``ready`` barrier, so the producer never waits for its own copies;
* two consumer warpgroups compute the tiles, in one of two ways (the config's
  ``num_warps``: the MMA warps of one tile):

  - ping-pong (4): they take the program's tiles in turn (even and odd). Each computes a
    ``BLOCK_M x BLOCK_N`` h2 tile with one m64n(2 BLOCK_N) MMA chain per K step (gate and up
    side by side: 128 fp32 accumulator registers per thread) and runs its epilogue (SwiGLU,
    16-byte stores of h2 and h1) while the other runs its MMAs. A ``turn`` mbarrier pair
    orders the two K loops, as in :mod:`distmoe.kernels.w2_dgrad.gluon`;
  - cooperative (8): both take every tile of the program, 128 x 128 h2 columns, 64 rows each
    with one m64n256 MMA per k16 on their half of the A stage and the whole weight stage; a
    stage goes back to the producer when both have released it. The epilogues run together,
    not under MMAs (the producer refills the ring meanwhile), but each stage feeds twice the
    FLOPs of a ping-pong stage for 1.5 times its bytes, and each gathered row is loaded half
    as often as with 128 x 64 tiles;
* a training forward saves the gathered rows from the A stage the MMA just read, before the
  stage goes back to the producer: column tile ``n`` saves the K steps ``k`` with
  ``k % NUM_PID_N == n``, so every row and column is stored once (with cooperative tiles,
  each consumer its own 64 rows).

Tiles (``GLUON_W13_TILES``): ping-pong 128 x 64 h2 columns (``block_n`` 64: a 128 x 128
GEMM tile, two m64n128 MMAs per k16) or 64 x 128 (``block_n`` 128: one m64n256 MMA, half the
row gathers per FLOP and twice the weight loads); cooperative 128 x 128. Every way, 128 fp32
accumulator registers per consumer thread. The padding multiple (``block_m``) is 128.
:mod:`distmoe.plan` picks the tile.

F need not be a multiple of ``block_n`` (GPT-OSS: F = 2880 with 128-column tiles): a row's
last tile is then partial. Its gate weight rows past F are the expert's first up rows and
its up rows past F the next expert's gate rows (TMA zeros after the last expert), and its
column half past F is not stored.

Only for CUDA devices of compute capability 9.x, outside the interpreter, with F and D
multiples of 64; :func:`gluon_w13_reason` says when.
"""

from __future__ import annotations

import torch

from distmoe.kernels.base.config import next_power_of_2
from distmoe.kernels.base.device import device_context, lockstep_counter, num_sms
from distmoe.kernels.base.gluon import (
    HAVE_GLUON,
    gluon_device_reason,
    gluon_ring_reason,
    shared_layout,
)

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    from distmoe.kernels.base.gluon import (
        bounds_layout,
        consumer_walk,
        enabled_tiles,
        expert_bounds,
        lockstep_before_tile,
        lockstep_tile_done,
        ordered_tile_info,
        ordered_tiles,
        program_tiles,
        ring_barriers,
        wait_turn,
    )
    from distmoe.kernels.base.tiles import column_halves

    #: the most experts (``EXPERTS_POW2``) whose bounds the producer holds in registers
    #: across its tile loop (``5 * EXPERTS_POW2 / 32`` of its 56 per thread); above, it
    #: loads them per tile: at 256 experts the held bounds spilled 4 bytes (sm_90, ptxas -v)
    _HELD_BOUNDS = gl.constexpr(128)

__all__ = ["DONE_BLOCK", "GLUON_W13_TILES", "done_count", "tile_rows", "gluon_w13_reason",
           "launch_gluon_w13", "shape_reason"]

#: (block_m, block_n, block_k, warps) of a config this kernel runs: ``block_m`` is the padding
#: multiple, ``block_n`` the h2 columns of a tile, ``warps`` the MMA warps of one tile (the
#: config's ``num_warps``). With 4 ("ping-pong") each consumer warpgroup takes whole tiles in
#: turn and holds 128 x 128 fp32 accumulators, so a tile has ``128 * 64 // block_n`` rows;
#: with 8 ("cooperative") both consumers take every tile, 64 rows each (:func:`tile_rows`).
GLUON_W13_TILES = ((128, 64, 64, 4), (128, 128, 64, 4), (128, 128, 64, 8))
#: ring depths the kernel takes, where the ring fits ``_RING_BYTES`` (the epilogue's layout
#: conversions need the rest of the 227 KiB): up to 6 stages of 32 KiB with 128 x 64 tiles,
#: 5 of 40 KiB with 64 x 128, 4 of 48 KiB with the cooperative 128 x 128
GLUON_W13_STAGES = (3, 4, 5, 6)
_RING_BYTES = 200 * 1024


def tile_rows(block_n: int, warps: int = 4) -> int:
    """Rows of a tile (of an A stage) for ``block_n`` h2 columns and ``warps`` MMA warps per
    tile. Ping-pong (4): 128 x 64 h2 (a 128 x 128 GEMM tile: two m64n128 MMAs per k16) or
    64 x 128 (a 64 x 256 GEMM tile: one m64n256 MMA, half the row gathers per FLOP, twice the
    weight loads). Cooperative (8): 128 x 128 h2, a 128 x 256 GEMM tile of which each
    consumer computes 64 rows with one m64n256 MMA per k16 (half the row gathers per FLOP of
    128 x 64, the same weight loads)."""
    return 128 if warps == 8 else 128 * 64 // block_n


def stage_bytes(block_n: int, block_k: int = 64, warps: int = 4) -> int:
    """Shared memory of one ring stage: a tile's gathered rows and its gate and up weight
    tiles, bf16."""
    return (tile_rows(block_n, warps) + 2 * block_n) * block_k * 2


#: the kernel's register limit: 12 warps (two consumer warpgroups and the producer's) of 168
#: registers fill the register file; the partitions then set 224 (both consumers) and 56
#: (the producer) per thread.
_MAXNREG = 168
_PRODUCER_THREADS = 128
#: padded rows per entry of the fused W13 + W2 kernel's ``done`` counters (a W2 tile's rows)
DONE_BLOCK = 128


def done_count(ffn: int, block_n: int, warps: int) -> int:
    """What each entry of the fused W13 + W2 kernel's ``done`` counters
    (:mod:`distmoe.kernels.mega.gluon`, whose W13 tiles are this kernel's; one entry per
    ``DONE_BLOCK`` padded rows) reaches once every W13 tile over those rows has stored its
    h2 rows: every thread of each consumer warpgroup that ran a tile adds 1 (``warps`` 8:
    both consumers on every tile)."""
    tiles = -(-ffn // block_n) * (DONE_BLOCK // tile_rows(block_n, warps))
    return tiles * (2 if warps == 8 else 1) * 128


if HAVE_GLUON:

    @gluon.jit
    def _store_rows(base_ptr, act_start, num_live, col0, value, WIDTH: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, OUT_LAYOUT: gl.constexpr):
        """Masked 16-byte stores of a ``[BLOCK_M, BLOCK_N]`` bf16 tile into rows
        ``act_start + i`` (``i < num_live``), columns ``col0 + j`` of a ``WIDTH``-wide output."""
        v = gl.convert_layout(value, OUT_LAYOUT)
        i = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, OUT_LAYOUT))
        j = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, OUT_LAYOUT))
        rows = gl.multiple_of(base_ptr + (act_start + i).to(gl.int64) * WIDTH, 16)
        ptrs = gl.expand_dims(rows, 1) + gl.expand_dims(col0 + j, 0)
        mask = gl.expand_dims(i < num_live, 1) & gl.expand_dims(j >= 0, 0)
        gl.store(ptrs, v, mask=mask)

    @gluon.jit
    def _producer(w_desc, a_bufs, b_bufs, ready, empty, turn, gather_ptrs_ptr,
                  padded_offsets_ptr, row_offsets_ptr, h2_ptr, h1_ptr, x_ptr, out_offsets_ptr,
                  enable_ptr, order_ptr, positions_ptr, sync_ptr, FFN: gl.constexpr,
                  HIDDEN: gl.constexpr,
                  NUM_EXPERTS: gl.constexpr, EXPERTS_POW2: gl.constexpr, GROUP_M: gl.constexpr,
                  STAGES: gl.constexpr, WRITE_H1: gl.constexpr, WRITE_X: gl.constexpr,
                  DYN_OFFSETS: gl.constexpr, HAS_ENABLE: gl.constexpr,
                  HAS_ORDER: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, COOP: gl.constexpr,
                  PARITY: gl.constexpr, LOCKSTEP: gl.constexpr,
                  EXPERT_GROUPS: gl.constexpr):
        """One warpgroup: the loads of every tile of the program, K step by K step."""
        NUM_K: gl.constexpr = HIDDEN // BLOCK_K
        NUM_PID_N: gl.constexpr = (FFN + BLOCK_N - 1) // BLOCK_N  # the last may be partial
        # cp.async: 8 bf16 (16 bytes) per thread and row; a warp covers 4 rows x 64 columns
        CP: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        num_pid_m, num_tiles, ends, starts, rbeg, rend, eidx = program_tiles(
            padded_offsets_ptr, row_offsets_ptr, NUM_EXPERTS, EXPERTS_POW2, NUM_PID_N,
            BLOCK_M, 4)
        pos_lo, num_pid_m, num_tiles = ordered_tiles(positions_ptr, num_pid_m, num_tiles,
                                                      NUM_PID_N, HAS_ORDER)
        num_tiles = enabled_tiles(enable_ptr, num_tiles, HAS_ENABLE)
        i = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, CP))
        kk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, CP))
        nbytes: gl.constexpr = 2 * w_desc.block_type.nbytes
        count = 0
        in_step = gl.to_tensor(True)  # until a wait misses its bound (a program not resident)
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            in_step = lockstep_before_tile(sync_ptr, in_step, tile, num_tiles, LOCKSTEP)
            if EXPERTS_POW2 > _HELD_BOUNDS:
                # loaded per tile (L1 hits after the first) rather than held across the loop
                t_ends, t_starts, t_rbeg, t_rend, t_eidx = expert_bounds(
                    padded_offsets_ptr, row_offsets_ptr, NUM_EXPERTS, EXPERTS_POW2,
                    bounds_layout(EXPERTS_POW2, 4))
            else:
                t_ends, t_starts, t_rbeg, t_rend, t_eidx = ends, starts, rbeg, rend, eidx
            pid_n, expert, row_start, _act, num_live = ordered_tile_info(
                tile, num_pid_m, order_ptr, pos_lo, t_ends, t_starts, t_rbeg, t_rend, t_eidx,
                NUM_PID_N, GROUP_M, NUM_EXPERTS, BLOCK_M, HAS_ORDER, EXPERT_GROUPS)
            # this tile's row addresses (0: null or not live, zero-filled)
            src = gl.load(gather_ptrs_ptr + row_start + i, mask=i < num_live, other=0)
            rows = gl.multiple_of(src.to(gl.pointer_type(gl.bfloat16)), 16)
            ptrs = gl.expand_dims(rows, 1) + gl.expand_dims(kk, 0)
            read = gl.expand_dims(src != 0, 1) & gl.expand_dims(kk >= 0, 0)
            w_row = 2 * expert * FFN + pid_n * BLOCK_N
            for k in range(NUM_K):
                stage = count % STAGES
                mbarrier.wait(empty.index(stage), ((count // STAGES) & 1) ^ 1)
                bar = ready.index(stage)
                b = b_bufs.index(stage)
                mbarrier.expect(bar, nbytes)
                tma.async_copy_global_to_shared(w_desc, [w_row, k * BLOCK_K], bar,
                                                b.slice(0, BLOCK_N))
                tma.async_copy_global_to_shared(w_desc, [w_row + FFN, k * BLOCK_K], bar,
                                                b.slice(BLOCK_N, BLOCK_N))
                async_copy.async_copy_global_to_shared(a_bufs.index(stage),
                                                       ptrs + k * BLOCK_K, read)
                # arrives when this thread's copies have landed (counted in the barrier)
                async_copy.mbarrier_arrive(bar, increment_count=False)
                count += 1
            if LOCKSTEP:
                lockstep_tile_done(sync_ptr)
        async_copy.wait_group(0)

    @gluon.jit
    def _consumer(w_desc, a_bufs, b_bufs, ready, empty, turn, gather_ptrs_ptr,
                  padded_offsets_ptr, row_offsets_ptr, h2_ptr, h1_ptr, x_ptr, out_offsets_ptr,
                  enable_ptr, order_ptr, positions_ptr, sync_ptr, FFN: gl.constexpr,
                  HIDDEN: gl.constexpr,
                  NUM_EXPERTS: gl.constexpr, EXPERTS_POW2: gl.constexpr, GROUP_M: gl.constexpr,
                  STAGES: gl.constexpr, WRITE_H1: gl.constexpr, WRITE_X: gl.constexpr,
                  DYN_OFFSETS: gl.constexpr, HAS_ENABLE: gl.constexpr,
                  HAS_ORDER: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, COOP: gl.constexpr,
                  PARITY: gl.constexpr, LOCKSTEP: gl.constexpr,
                  EXPERT_GROUPS: gl.constexpr):
        """One warpgroup: the MMAs, the rows saved and the epilogue of the program's tiles
        ``PARITY``, ``PARITY + 2``, ... (in the program's own numbering); with ``COOP``, of
        rows ``64 PARITY`` to ``64 PARITY + 63`` of every tile of the program."""
        NUM_K: gl.constexpr = HIDDEN // BLOCK_K
        NUM_PID_N: gl.constexpr = (FFN + BLOCK_N - 1) // BLOCK_N  # the last may be partial
        # this warpgroup's rows of a tile: all of them, or its half with COOP
        ROWS: gl.constexpr = BLOCK_M // 2 if COOP else BLOCK_M
        ROW0: gl.constexpr = PARITY * ROWS if COOP else 0  # its first row in the tile
        ACC: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 2 * BLOCK_N, 16])
        CP: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        num_pid_m, num_tiles, ends, starts, rbeg, rend, eidx = program_tiles(
            padded_offsets_ptr, row_offsets_ptr, NUM_EXPERTS, EXPERTS_POW2, NUM_PID_N,
            BLOCK_M, 4)
        pos_lo, num_pid_m, num_tiles = ordered_tiles(positions_ptr, num_pid_m, num_tiles,
                                                      NUM_PID_N, HAS_ORDER)
        num_tiles = enabled_tiles(enable_ptr, num_tiles, HAS_ENABLE)
        # element offsets of h1 and the saved rows (negative: not stored)
        h1_off = 0
        x_off = 0
        if DYN_OFFSETS:
            h1_off = gl.load(out_offsets_ptr)
            x_off = gl.load(out_offsets_ptr + 1)
        x_base = x_ptr + gl.maximum(x_off, 0)
        first, step, count = consumer_walk(NUM_K, COOP, PARITY)
        turns = 0
        for tile in range(first, num_tiles, step):
            pid_n, expert, row_start, act_start, num_live = ordered_tile_info(
                tile, num_pid_m, order_ptr, pos_lo, ends, starts, rbeg, rend, eidx, NUM_PID_N,
                GROUP_M, NUM_EXPERTS, BLOCK_M, HAS_ORDER, EXPERT_GROUPS)
            act_start += ROW0
            num_live -= ROW0
            if not COOP:
                turns = wait_turn(turn, turns, PARITY)
            acc = gl.zeros([ROWS, 2 * BLOCK_N], gl.float32, ACC)
            for k in range(NUM_K):
                stage = count % STAGES
                mbarrier.wait(ready.index(stage), (count // STAGES) & 1)
                acc = warpgroup_mma(a_bufs.index(stage).slice(ROW0, ROWS),
                                    b_bufs.index(stage).permute((1, 0)), acc, is_async=True)
                # the previous step's MMA is done: save its rows, then its stage goes back
                acc = warpgroup_mma_wait(1, deps=(acc,))
                if k > 0:
                    prev = (count + STAGES - 1) % STAGES
                    if WRITE_X:
                        if x_off >= 0 and (k - 1) % NUM_PID_N == pid_n:
                            _store_rows(x_base, act_start, num_live, (k - 1) * BLOCK_K,
                                        a_bufs.index(prev).slice(ROW0, ROWS).load(CP), HIDDEN,
                                        ROWS, BLOCK_K, CP)
                    mbarrier.arrive(empty.index(prev))
                count += 1
            if not COOP:
                mbarrier.arrive(turn.index(1 - PARITY))
            acc = warpgroup_mma_wait(0, deps=(acc,))
            last = (count + STAGES - 1) % STAGES
            if WRITE_X:
                if x_off >= 0 and (NUM_K - 1) % NUM_PID_N == pid_n:
                    _store_rows(x_base, act_start, num_live, (NUM_K - 1) * BLOCK_K,
                                a_bufs.index(last).slice(ROW0, ROWS).load(CP), HIDDEN, ROWS,
                                BLOCK_K, CP)
            mbarrier.arrive(empty.index(last))
            if not COOP:
                count += NUM_K  # the other consumer's tile

            # Epilogue in two column halves (g and u of BLOCK_N / 2 h2 columns each), each
            # converted to 16-byte vectors for its stores.
            g, u = column_halves(acc, ROWS, 2 * BLOCK_N)
            g0, g1 = column_halves(g, ROWS, BLOCK_N)
            u0, u1 = column_halves(u, ROWS, BLOCK_N)
            n0 = pid_n * BLOCK_N
            H: gl.constexpr = BLOCK_N // 2
            swiglu_part(g0, u0, act_start, num_live, n0, h2_ptr, h1_ptr, h1_off, FFN, WRITE_H1,
                         ROWS, H)
            swiglu_part(g1, u1, act_start, num_live, n0 + H, h2_ptr, h1_ptr, h1_off, FFN,
                         WRITE_H1, ROWS, H)

    @gluon.jit
    def swiglu_part(g, u, act_start, num_live, col0, h2_ptr, h1_ptr, h1_off,
                     FFN: gl.constexpr, WRITE_H1: gl.constexpr, BLOCK_M: gl.constexpr,
                     W: gl.constexpr):
        """h2 = silu(g) * u of a ``[BLOCK_M, W]`` part (h2 columns ``col0 + j``) into rows
        ``act_start + i``, ``i < num_live``; with ``WRITE_H1`` (and ``h1_off >= 0``) also g and
        u into h1 (``[g | u]`` rows of 2F at element ``h1_off``). Nothing where ``col0 >= F``
        (the part of a partial last column tile past F: ``W`` divides F)."""
        L: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // W, W // 8], [4, 1], [1, 0])
        h2 = g * (1.0 / (1.0 + gl.exp(-g))) * u
        i = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, L))
        j = gl.arange(0, W, layout=gl.SliceLayout(0, L))
        rows = gl.expand_dims((act_start + i).to(gl.int64), 1)
        col = gl.expand_dims(col0 + j, 0)
        live = i < num_live
        if FFN % (2 * W) != 0:  # a row's last tile is partial: no part at or past F
            live = live & (col0 < FFN)
        mask = gl.expand_dims(live, 1)
        h2_ptrs = gl.multiple_of(h2_ptr + rows * FFN, [16, 16]) + col
        gl.store(h2_ptrs, gl.convert_layout(h2.to(gl.bfloat16), L), mask=mask)
        if WRITE_H1:
            if h1_off >= 0:
                h1_ptrs = gl.multiple_of(h1_ptr + h1_off + rows * (2 * FFN), [16, 16]) + col
                gl.store(h1_ptrs, gl.convert_layout(g.to(gl.bfloat16), L), mask=mask)
                gl.store(h1_ptrs + FFN, gl.convert_layout(u.to(gl.bfloat16), L), mask=mask)

    @gluon.jit
    def _gluon_w13_kernel(
        w_desc,  # host descriptor of w13 viewed [2 E F, D], block [BLOCK_N, BLOCK_K]
        gather_ptrs_ptr,  # int64 [R_cap]
        padded_offsets_ptr,  # int32 [E + 1]
        row_offsets_ptr,  # int32 [E + 1]
        h2_ptr,  # bf16 [R_act, F]
        h1_ptr,  # bf16 base of h1 (WRITE_H1), else a placeholder
        x_ptr,  # bf16 base of the saved rows (WRITE_X), else a placeholder
        out_offsets_ptr,  # int64 [2] (DYN_OFFSETS), else a placeholder
        enable_ptr,  # int32 [1] (HAS_ENABLE), else a placeholder
        order_ptr,  # int32 [R_cap / BLOCK_M] (HAS_ORDER), else a placeholder
        positions_ptr,  # int32 [2] (HAS_ORDER), else a placeholder
        sync_ptr,  # int32 [1], zero at the launch (LOCKSTEP), else a placeholder
        FFN: gl.constexpr,
        HIDDEN: gl.constexpr,
        NUM_EXPERTS: gl.constexpr,
        EXPERTS_POW2: gl.constexpr,
        GROUP_M: gl.constexpr,
        STAGES: gl.constexpr,
        WRITE_H1: gl.constexpr,
        WRITE_X: gl.constexpr,
        DYN_OFFSETS: gl.constexpr,
        HAS_ENABLE: gl.constexpr,
        HAS_ORDER: gl.constexpr,
        A_LAYOUT: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
        PRODUCER_THREADS: gl.constexpr,
        COOP: gl.constexpr,
        LOCKSTEP: gl.constexpr,  # the producers start each wave's tiles together (sync_ptr)
        EXPERT_GROUPS: gl.constexpr,  # tile order: a group per expert (not with HAS_ORDER)
        num_warps: gl.constexpr,
    ):
        a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BLOCK_K], A_LAYOUT)
        b_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 2 * BLOCK_N, BLOCK_K],
                                           w_desc.layout)
        # ready: the producer's expect-tx arrive, then one cp.async arrive per producer
        # thread; empty: released by one consumer, or by both with COOP
        ready, empty, turn = ring_barriers(STAGES, 1 + PRODUCER_THREADS, 2 if COOP else 1)
        # (the argument lists are written out: a tuple built here loses the constexprs)
        gl.warp_specialize([
            (_consumer, (w_desc, a_bufs, b_bufs, ready, empty, turn, gather_ptrs_ptr,
                         padded_offsets_ptr, row_offsets_ptr, h2_ptr, h1_ptr, x_ptr,
                         out_offsets_ptr, enable_ptr, order_ptr, positions_ptr, sync_ptr,
                         FFN, HIDDEN, NUM_EXPERTS, EXPERTS_POW2, GROUP_M, STAGES,
                         WRITE_H1, WRITE_X, DYN_OFFSETS, HAS_ENABLE, HAS_ORDER, BLOCK_M,
                         BLOCK_N, BLOCK_K, COOP, 0, LOCKSTEP, EXPERT_GROUPS)),
            (_consumer, (w_desc, a_bufs, b_bufs, ready, empty, turn, gather_ptrs_ptr,
                         padded_offsets_ptr, row_offsets_ptr, h2_ptr, h1_ptr, x_ptr,
                         out_offsets_ptr, enable_ptr, order_ptr, positions_ptr, sync_ptr,
                         FFN, HIDDEN, NUM_EXPERTS, EXPERTS_POW2, GROUP_M, STAGES,
                         WRITE_H1, WRITE_X, DYN_OFFSETS, HAS_ENABLE, HAS_ORDER, BLOCK_M,
                         BLOCK_N, BLOCK_K, COOP, 1, LOCKSTEP, EXPERT_GROUPS)),
            (_producer, (w_desc, a_bufs, b_bufs, ready, empty, turn, gather_ptrs_ptr,
                         padded_offsets_ptr, row_offsets_ptr, h2_ptr, h1_ptr, x_ptr,
                         out_offsets_ptr, enable_ptr, order_ptr, positions_ptr, sync_ptr,
                         FFN, HIDDEN, NUM_EXPERTS, EXPERTS_POW2, GROUP_M, STAGES,
                         WRITE_H1, WRITE_X, DYN_OFFSETS, HAS_ENABLE, HAS_ORDER, BLOCK_M,
                         BLOCK_N, BLOCK_K, COOP, 0, LOCKSTEP, EXPERT_GROUPS)),
        ], [4, PRODUCER_THREADS // 32], [224, 56])


def shape_reason(*, hidden: int, ffn: int, block_m: int, block_n: int, block_k: int,
                 stages: int, warps: int = 4) -> str | None:
    """``None`` when the kernel can tile this case (whatever the device), else why not.
    ``warps``: the MMA warps of one tile (4 ping-pong, 8 cooperative; ``GLUON_W13_TILES``)."""
    reason = gluon_ring_reason(
        "W13", GLUON_W13_TILES, (block_m, block_n, block_k, warps),
        "num_warps 4: ping-pong tiles, block_n 64 or 128; 8: cooperative tiles, block_n 128",
        per_stage=stage_bytes(block_n, block_k, warps), stages=stages, depths=GLUON_W13_STAGES,
        ring_bytes=_RING_BYTES)
    if reason is None and (ffn % 64 or hidden % block_k):
        reason = f"F ({ffn}) must be a multiple of 64 and D ({hidden}) of {block_k}"
    return reason


def gluon_w13_reason(device: torch.device, *, hidden: int, ffn: int, block_m: int,
                     block_n: int, block_k: int, stages: int, warps: int = 4) -> str | None:
    """``None`` when :func:`launch_gluon_w13` can run this case on ``device``, else why not
    (a sentence)."""
    return gluon_device_reason(device) or shape_reason(
        hidden=hidden, ffn=ffn, block_m=block_m, block_n=block_n, block_k=block_k,
        stages=stages, warps=warps)


def launch_gluon_w13(gather_ptrs: torch.Tensor, padded_offsets: torch.Tensor,
                     row_offsets: torch.Tensor, w13: torch.Tensor, h2_out: torch.Tensor, *,
                     h1_out: torch.Tensor | None, x_out: torch.Tensor | None,
                     out_offsets: torch.Tensor | None, enable: torch.Tensor | None,
                     block_n: int = 64, stages: int = 5, group_m: int = 8, warps: int = 4,
                     programs: int | None = None, order: torch.Tensor | None = None,
                     positions: torch.Tensor | None = None, lockstep: bool = False,
                     expert_groups: bool = False) -> None:
    """Launch the kernel (arguments validated by
    :func:`~distmoe.kernels.w13_forward.triton.gather_w13_swiglu`, and
    :func:`gluon_w13_reason` returned ``None``). ``warps``: 4 (ping-pong) or 8 (cooperative).
    ``programs``: the grid (default one per SM); tests pass fewer so that every program walks
    many tiles. ``order`` / ``positions``: the row blocks of this launch (see
    :func:`~distmoe.kernels.w13_forward.triton.gather_w13_swiglu`). ``lockstep``:
    :attr:`~distmoe.kernels.w13_forward.config.W13Config.lockstep` (a zeroed int32 counter
    is allocated per launch). ``expert_groups``:
    :attr:`~distmoe.kernels.w13_forward.config.W13Config.expert_groups` (ignored with
    ``order``)."""
    block_m, block_k = tile_rows(block_n, warps), 64
    num_experts, _, ffn, hidden = w13.shape
    w_layout = shared_layout((block_n, block_k))
    a_layout = shared_layout((block_m, block_k))
    w_desc = GluonDescriptor(w13.view(2 * num_experts * ffn, hidden),
                             [2 * num_experts * ffn, hidden], [hidden, 1], [block_n, block_k],
                             w_layout)
    tiles = (gather_ptrs.shape[0] // block_m) * -(-ffn // block_n)
    if programs is None:
        programs = num_sms(h2_out.device)
    with device_context(h2_out.device):
        _gluon_w13_kernel[(max(1, min(programs, tiles)),)](
            w_desc, gather_ptrs, padded_offsets, row_offsets, h2_out,
            h2_out if h1_out is None else h1_out,
            h2_out if x_out is None else x_out,
            padded_offsets if out_offsets is None else out_offsets,
            padded_offsets if enable is None else enable,
            padded_offsets if order is None else order,
            padded_offsets if positions is None else positions,
            lockstep_counter(lockstep, padded_offsets),
            FFN=ffn, HIDDEN=hidden, NUM_EXPERTS=num_experts,
            EXPERTS_POW2=max(32, next_power_of_2(num_experts)),
            GROUP_M=group_m, STAGES=stages,
            WRITE_H1=h1_out is not None, WRITE_X=x_out is not None,
            DYN_OFFSETS=out_offsets is not None, HAS_ENABLE=enable is not None,
            HAS_ORDER=order is not None, A_LAYOUT=a_layout,
            BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=block_k,
            PRODUCER_THREADS=_PRODUCER_THREADS, COOP=warps == 8, LOCKSTEP=lockstep,
            EXPERT_GROUPS=expert_groups, num_warps=4,
            maxnreg=_MAXNREG,
        )  # fmt: skip
