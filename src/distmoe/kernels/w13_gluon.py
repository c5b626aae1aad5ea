"""Persistent gather + W13 + SwiGLU for Hopper, written in Gluon (``triton.experimental.gluon``).

Same contract as :func:`distmoe.kernels.w13_gather_swiglu.gather_w13_swiglu` (its module
docstring defines the row numberings, ``out_offsets`` and ``enable``); that function launches
this kernel when its config asks for it (``W13Config.gluon``) and :func:`gluon_w13_reason`
returns ``None``. The Triton kernel serves the interpreter, other GPUs and other tile shapes.

Why a second kernel (performance.md runs 15 and 19): the Triton kernel pipelines the K loop of
one tile; every tile starts with an empty pipeline, and a training forward saves the gathered
rows in a second pass that reads them again from L2 after the MMAs. Here the pipeline is
written out by hand, as in :mod:`distmoe.kernels.wgrad_gluon`:

* one program per SM walks the live output tiles ``pid, pid + G, ...`` in group-M order;
* one flat stream of loads runs ``STAGES - 1`` K steps ahead of the MMAs, across tile
  boundaries: the gathered A rows as 16-byte ``cp.async`` (Hopper has no TMA gather; null
  and non-live rows are zero-filled), the gate and up weight tiles through one TMA
  descriptor over ``w13`` seen as ``[2 E_local F, D]``;
* the next tile's row addresses and expert are fetched one tile ahead, so a tile switch does
  not wait on memory;
* a training forward saves the gathered rows straight from the A stage that the MMA just
  read: a TMA store for a full tile, masked vector stores for an expert's last, partial tile
  (a TMA box would reach into the next expert's rows). Column tile ``n`` saves the K steps
  ``k`` with ``k % NUM_PID_N == n``, so the copy is spread over a row tile's column tiles;
* h2 of a full tile leaves through shared memory as an asynchronous TMA store, waited for
  only before the buffer is reused; partial tiles and h1 use masked 16-byte stores.

Requirements beyond the shared contract (checked by :func:`gluon_w13_reason`): F a multiple
of ``BLOCK_N`` (128) and D of ``BLOCK_K`` (64), at least ``STAGES`` K steps, 2-4 stages (4
leave no shared memory for h2's staging tile, so h2 then takes pointer stores too); the
layer's gather addresses 16-byte aligned.

Status (performance.md run 21): correct on an H200 in every GPU test, but **slower than the
Triton kernel**, so no heuristic selects it (``W13Config.gluon`` is off by default).
``tools/tune_gemm.py``, this version against the Triton heuristic: 3.45 against 3.20 ms at
T=8192 D=4096 F=2048 E=32 K=8 (inference), 3.96 against 3.57 with the training outputs,
0.43 against 0.39 ms at T=4096 D=2048 F=768 E=128 K=8. Earlier versions were 12-20%
behind. What closed part of the gap: no proxy fence on every K step, and a tile lookup
without block barriers. Still unmeasured: the consumer repeats the producer's tile lookup
after every epilogue, and the row addresses are read from shared memory at every step. Warp
specialisation (a producer warp group for the loads, two consumer warp groups taking turns
at the epilogue) is the design this kernel is meant to grow into.
"""

from __future__ import annotations

import torch

from ._common import swizzle_tile
from .wgrad_gluon import HAVE_GLUON, gluon_device_reason

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

__all__ = ["GLUON_W13_TILE", "gluon_w13_reason", "launch_gluon_w13"]

#: (block_m, block_n, block_k, num_warps): the one tile shape the Gluon kernel is written for.
GLUON_W13_TILE = (128, 128, 64, 8)


if HAVE_GLUON:

    @gluon.jit
    def _tile_info(tile, num_pid_m, ends, starts, rbeg, rend, eidx,
                   NUM_PID_N: gl.constexpr, GROUP_M: gl.constexpr, NUM_EXPERTS: gl.constexpr,
                   BLOCK_M: gl.constexpr):
        """Column tile, expert, first padded row, first activation row and live row count of
        ``tile`` (group-M order: the Triton kernels' :func:`swizzle_tile`). The per-expert
        bounds are register vectors loaded once per program (``ends`` = padded_offsets[1:],
        ``starts`` = padded_offsets[:-1], ``rbeg`` / ``rend`` = row_offsets[:-1] / [1:],
        ``eidx`` their expert index)."""
        pid_m, pid_n = swizzle_tile(tile, num_pid_m, NUM_PID_N, GROUP_M)
        row_start = pid_m * BLOCK_M
        expert = gl.minimum(gl.sum((ends <= row_start).to(gl.int32), axis=0), NUM_EXPERTS - 1)
        sel = eidx == expert
        local = row_start - gl.sum(gl.where(sel, starts, 0), axis=0)
        act_begin = gl.sum(gl.where(sel, rbeg, 0), axis=0)
        act_end = gl.sum(gl.where(sel, rend, 0), axis=0)
        return pid_n, expert, row_start, act_begin + local, act_end - act_begin - local

    @gluon.jit
    def _expert_bounds(padded_offsets_ptr, row_offsets_ptr, NUM_EXPERTS: gl.constexpr,
                       EXPERTS_POW2: gl.constexpr, LAYOUT: gl.constexpr):
        """The per-expert bounds that :func:`_tile_info` takes, as ``[EXPERTS_POW2]`` register
        vectors in ``LAYOUT``: ``(ends, starts, rbeg, rend, eidx)``."""
        eidx = gl.arange(0, EXPERTS_POW2, layout=LAYOUT)
        emask = eidx < NUM_EXPERTS
        ends = gl.load(padded_offsets_ptr + 1 + eidx, mask=emask, other=2147483647)
        starts = gl.load(padded_offsets_ptr + eidx, mask=emask, other=0)
        rbeg = gl.load(row_offsets_ptr + eidx, mask=emask, other=0)
        rend = gl.load(row_offsets_ptr + 1 + eidx, mask=emask, other=0)
        return ends, starts, rbeg, rend, eidx

    @gluon.jit
    def _next_live(tile, num_tiles, num_progs, num_pid_m, ends, starts, rbeg, rend, eidx,
                   NUM_PID_N: gl.constexpr, GROUP_M: gl.constexpr, NUM_EXPERTS: gl.constexpr,
                   BLOCK_M: gl.constexpr):
        """The first tile ``tile, tile + G, ...`` with live rows (``>= num_tiles``: none) and
        its :func:`_tile_info`."""
        pid_n = 0
        expert = 0
        row_start = 0
        act_start = 0
        num_live = 0
        searching = tile < num_tiles
        while searching:
            pid_n, expert, row_start, act_start, num_live = _tile_info(
                tile, num_pid_m, ends, starts, rbeg, rend, eidx, NUM_PID_N, GROUP_M,
                NUM_EXPERTS, BLOCK_M)
            if num_live > 0:
                searching = False
            else:
                tile += num_progs
                searching = tile < num_tiles
        if tile >= num_tiles:
            num_live = 0
        return tile, pid_n, expert, row_start, act_start, num_live

    @gluon.jit
    def _fetch_sources(gather_ptrs_ptr, slot, row_start, num_live, BLOCK_M: gl.constexpr,
                       num_warps: gl.constexpr):
        """``cp.async`` a row tile's source addresses into the shared-memory ``slot`` (0 for
        non-live rows: zero-filled; null rows are 0 already). Part of the current group."""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        i = gl.arange(0, BLOCK_M, layout=layout)
        async_copy.async_copy_global_to_shared(slot, gather_ptrs_ptr + row_start + i,
                                               i < num_live)

    @gluon.jit
    def _produce(w_desc, a_bufs, bg_bufs, bu_bufs, bars, src_smem, gather_ptrs_ptr,
                 p_tile, p_k, p_n, p_expert, p_slot, p_count,
                 f_tile, f_n, f_expert,
                 num_tiles, num_progs, num_pid_m, ends, starts, rbeg, rend, eidx,
                 FFN: gl.constexpr, NUM_K: gl.constexpr, NUM_PID_N: gl.constexpr,
                 GROUP_M: gl.constexpr, NUM_EXPERTS: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                 CP_LAYOUT: gl.constexpr, num_warps: gl.constexpr):
        """Issue the loads of the next K step of the program's flat step stream into stage
        ``p_count % STAGES`` (one ``cp.async`` group per step, empty once the stream has
        ended, so that group counting stays exact) and advance the cursor.

        ``f_*``: the next live tile after ``p_tile``; its row addresses are copied into
        shared-memory slot ``1 - p_slot`` when the cursor enters ``p_tile``, at least
        ``NUM_K >= STAGES`` groups before they are read. (The addresses are read from shared
        memory at every step, not carried in registers through the loops: the register form
        hit an assertion in Triton 3.6's sm_90 lowering, seen together with the unrolled
        prologue that was later replaced by a loop; the register form was not retried.)"""
        if p_k == NUM_K:
            p_tile = f_tile
            p_n = f_n
            p_expert = f_expert
            p_slot = 1 - p_slot
            p_k = 0
            f_tile, f_n, f_expert, f_row, _f_act, f_live = _next_live(
                p_tile + num_progs, num_tiles, num_progs, num_pid_m, ends, starts, rbeg, rend,
                eidx, NUM_PID_N, GROUP_M, NUM_EXPERTS, BLOCK_M)
            _fetch_sources(gather_ptrs_ptr, src_smem.index(1 - p_slot), f_row, f_live, BLOCK_M,
                           num_warps)
        live = p_tile < num_tiles
        stage = p_count % STAGES
        if live:
            src = src_smem.index(p_slot).load(gl.SliceLayout(1, CP_LAYOUT))
            kk = p_k * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, CP_LAYOUT))
            rows = gl.multiple_of(src.to(gl.pointer_type(gl.bfloat16)), 16)
            ptrs = gl.expand_dims(rows, 1) + gl.expand_dims(kk, 0)
            read = gl.expand_dims(src != 0, 1) & gl.expand_dims(kk >= 0, 0)
            async_copy.async_copy_global_to_shared(a_bufs.index(stage), ptrs, read)
        async_copy.commit_group()
        bar = bars.index(stage)
        mbarrier.expect(bar, 2 * w_desc.block_type.nbytes, pred=live)
        w_row = 2 * p_expert * FFN + p_n * BLOCK_N
        tma.async_copy_global_to_shared(w_desc, [w_row, p_k * BLOCK_K], bar,
                                        bg_bufs.index(stage), live)
        tma.async_copy_global_to_shared(w_desc, [w_row + FFN, p_k * BLOCK_K], bar,
                                        bu_bufs.index(stage), live)
        return p_tile, p_k + 1, p_n, p_expert, p_slot, p_count + 1, f_tile, f_n, f_expert

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
        A_LAYOUT: gl.constexpr,
        H2_LAYOUT: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        NUM_K: gl.constexpr = HIDDEN // BLOCK_K
        NUM_PID_N: gl.constexpr = FFN // BLOCK_N
        # cp.async: 8 bf16 (16 bytes) per thread and row, a warp covers 4 rows x 64 columns
        CP_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        OUT_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
        # Every warp holds all the per-expert bounds (EXPERTS_POW2 / 32 per thread), so the
        # tile lookup's reductions are warp shuffles: no shared memory, no block barrier.
        VEC_LAYOUT: gl.constexpr = gl.BlockedLayout([EXPERTS_POW2 // 32], [32], [num_warps], [0])
        ACC_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])

        pid = gl.program_id(0)
        num_progs = gl.num_programs(0)
        live_rows = gl.load(row_offsets_ptr + NUM_EXPERTS)
        num_pid_m = gl.load(padded_offsets_ptr + NUM_EXPERTS) // BLOCK_M
        if HAS_ENABLE:
            num_pid_m = gl.where(gl.load(enable_ptr) != 0, num_pid_m, 0)
        num_tiles = num_pid_m * NUM_PID_N
        h1_off = 0
        x_off = 0
        x_save = x_ptr  # where saved row 0 goes (a negative offset: not saved)
        if DYN_OFFSETS:
            h1_off = gl.load(out_offsets_ptr)
            x_off = gl.load(out_offsets_ptr + 1)
            x_save = x_ptr + gl.maximum(x_off, 0)

        # Per-expert bounds, once per program, in registers.
        ends, starts, rbeg, rend, eidx = _expert_bounds(padded_offsets_ptr, row_offsets_ptr,
                                                        NUM_EXPERTS, EXPERTS_POW2, VEC_LAYOUT)

        a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BLOCK_K], A_LAYOUT)
        bg_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, BLOCK_K],
                                            w_desc.layout)
        bu_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, BLOCK_K],
                                            w_desc.layout)
        # 4 stages leave no room for the h2 staging tile: h2 then takes pointer stores too
        H2_TMA: gl.constexpr = STAGES <= 3
        if H2_TMA:
            c_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_N], H2_LAYOUT)
        src_smem = gl.allocate_shared_memory(
            gl.int64, [2, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)

        if num_tiles > pid:
            # Bounded by the live activation rows: a box never reaches past them. A skipped
            # output (negative offset) gets a descriptor at offset 0 that is never used.
            # (a full tile has BLOCK_M live rows, so with any TMA store live_rows >= 1)
            h2_desc = tma.make_tensor_descriptor(h2_ptr, shape=[gl.maximum(live_rows, 1), FFN],
                                                 strides=[FFN, 1],
                                                 block_shape=[BLOCK_M, BLOCK_N],
                                                 layout=H2_LAYOUT)
            x_desc = h2_desc
            if WRITE_X:
                x_desc = tma.make_tensor_descriptor(x_save,
                                                    shape=[gl.maximum(live_rows, 1), HIDDEN],
                                                    strides=[HIDDEN, 1],
                                                    block_shape=[BLOCK_M, BLOCK_K],
                                                    layout=A_LAYOUT)

            # Producer cursor (p_k = NUM_K: the first call moves to the fetched tile, whose
            # row addresses land in slot 0 before the stream starts; an extra, completed
            # group that does not disturb the group counting).
            f_tile, f_n, f_expert, f_row, _f_act, f_live = _next_live(
                pid, num_tiles, num_progs, num_pid_m, ends, starts, rbeg, rend, eidx,
                NUM_PID_N, GROUP_M, NUM_EXPERTS, BLOCK_M)
            _fetch_sources(gather_ptrs_ptr, src_smem.index(0), f_row, f_live, BLOCK_M,
                           num_warps)
            async_copy.commit_group()
            async_copy.wait_group(0)
            gl.thread_barrier()
            p_tile = f_tile
            p_k = gl.to_tensor(NUM_K)
            p_n = f_n
            p_expert = f_expert
            p_slot = gl.to_tensor(1)
            p_count = gl.to_tensor(0)
            # A loop, not unrolled: Triton 3.6's sm_90 lowering hit an assertion on the
            # unrolled form (two or more constant-folded calls).
            for _pre in range(STAGES - 1):
                (p_tile, p_k, p_n, p_expert, p_slot, p_count, f_tile, f_n, f_expert) = _produce(
                    w_desc, a_bufs, bg_bufs, bu_bufs, bars, src_smem, gather_ptrs_ptr,
                    p_tile, p_k, p_n, p_expert, p_slot, p_count, f_tile, f_n, f_expert,
                    num_tiles, num_progs, num_pid_m, ends, starts, rbeg, rend, eidx,
                    FFN, NUM_K, NUM_PID_N, GROUP_M, NUM_EXPERTS, BLOCK_M, BLOCK_N, BLOCK_K,
                    STAGES, CP_LAYOUT, num_warps)

            c_count = 0
            tile, n_idx, expert, _row, act_start, num_live = _next_live(
                pid, num_tiles, num_progs, num_pid_m, ends, starts, rbeg, rend, eidx,
                NUM_PID_N, GROUP_M, NUM_EXPERTS, BLOCK_M)
            while tile < num_tiles:
                full = num_live >= BLOCK_M
                acc_g = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, ACC_LAYOUT)
                acc_u = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, ACC_LAYOUT)
                for k in range(NUM_K):
                    stage = c_count % STAGES
                    # This thread's copies of step c_count have landed (groups are per step),
                    # then the weights.
                    # No proxy fence here (the Triton kernel's pipeline has none either): a
                    # fence.proxy.async after wait_group may also wait for this thread's
                    # copies of the later steps still in flight, which would cut the load
                    # stream to one step (run 21: 2 stages took twice as long as 3).
                    # (The block barrier that publishes every thread's rows is the one the
                    # compiler places after the cp.async wait.)
                    async_copy.wait_group(STAGES - 2)
                    mbarrier.wait(bars.index(stage), (c_count // STAGES) & 1)
                    a_tile = a_bufs.index(stage)
                    acc_g = warpgroup_mma(a_tile, bg_bufs.index(stage).permute((1, 0)), acc_g,
                                          is_async=True)
                    acc_u = warpgroup_mma(a_tile, bu_bufs.index(stage).permute((1, 0)), acc_u,
                                          is_async=True)
                    # The previous step's MMAs are done in this warpgroup, and its saved-rows
                    # store has read its stage; after the barrier, in every thread, so that
                    # stage takes the load STAGES - 1 steps ahead.
                    acc_g, acc_u = warpgroup_mma_wait(2, deps=(acc_g, acc_u))
                    if WRITE_X:
                        tma.store_wait(0)
                    gl.thread_barrier()
                    (p_tile, p_k, p_n, p_expert, p_slot, p_count,
                     f_tile, f_n, f_expert) = _produce(
                        w_desc, a_bufs, bg_bufs, bu_bufs, bars, src_smem, gather_ptrs_ptr,
                        p_tile, p_k, p_n, p_expert, p_slot, p_count, f_tile, f_n, f_expert,
                        num_tiles, num_progs, num_pid_m, ends, starts, rbeg, rend, eidx,
                        FFN, NUM_K, NUM_PID_N, GROUP_M, NUM_EXPERTS, BLOCK_M, BLOCK_N,
                        BLOCK_K, STAGES, CP_LAYOUT, num_warps)
                    if WRITE_X:
                        if x_off >= 0:
                            if k % NUM_PID_N == n_idx:
                                if full:
                                    # the TMA unit reads rows that cp.async wrote
                                    fence_async_shared()
                                    gl.thread_barrier()
                                    tma.async_copy_shared_to_global(
                                        x_desc, [act_start, k * BLOCK_K], a_tile)
                                else:
                                    _store_rows(x_save, act_start, num_live, k * BLOCK_K,
                                                a_tile.load(CP_LAYOUT), HIDDEN, BLOCK_M,
                                                BLOCK_K, CP_LAYOUT)
                    c_count += 1

                acc_g, acc_u = warpgroup_mma_wait(0, deps=(acc_g, acc_u))
                n0 = n_idx * BLOCK_N
                h2 = (acc_g / (1.0 + gl.exp(-acc_g)) * acc_u).to(gl.bfloat16)
                if H2_TMA:
                    if full:
                        # The previous tile's h2 store has read c_smem (the wait is per
                        # issuing thread: the barrier publishes it to every thread).
                        tma.store_wait(0)
                        gl.thread_barrier()
                        c_smem.store(h2)
                        fence_async_shared()
                        gl.thread_barrier()
                        tma.async_copy_shared_to_global(h2_desc, [act_start, n0], c_smem)
                    else:
                        _store_rows(h2_ptr, act_start, num_live, n0, h2, FFN, BLOCK_M, BLOCK_N,
                                    OUT_LAYOUT)
                else:
                    _store_rows(h2_ptr, act_start, num_live, n0, h2, FFN, BLOCK_M, BLOCK_N,
                                OUT_LAYOUT)
                if WRITE_H1:
                    if h1_off >= 0:
                        h1_base = h1_ptr + h1_off
                        _store_rows(h1_base, act_start, num_live, n0, acc_g.to(gl.bfloat16),
                                    2 * FFN, BLOCK_M, BLOCK_N, OUT_LAYOUT)
                        _store_rows(h1_base, act_start, num_live, FFN + n0,
                                    acc_u.to(gl.bfloat16), 2 * FFN, BLOCK_M, BLOCK_N,
                                    OUT_LAYOUT)
                tile, n_idx, expert, _row, act_start, num_live = _next_live(
                    tile + num_progs, num_tiles, num_progs, num_pid_m, ends, starts, rbeg,
                    rend, eidx, NUM_PID_N, GROUP_M, NUM_EXPERTS, BLOCK_M)
            tma.store_wait(0)
        async_copy.wait_group(0)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))


def gluon_w13_reason(device: torch.device, *, hidden: int, ffn: int, block_m: int,
                     block_n: int, block_k: int, num_warps: int, stages: int) -> str | None:
    """``None`` when :func:`launch_gluon_w13` can run this case, else why not (a sentence)."""
    reason = gluon_device_reason(device)
    if reason is not None:
        return reason
    if (block_m, block_n, block_k, num_warps) != GLUON_W13_TILE:
        return (f"the Gluon W13 kernel is written for (block_m, block_n, block_k, num_warps) = "
                f"{GLUON_W13_TILE}, got {(block_m, block_n, block_k, num_warps)}")
    if stages not in (2, 3, 4):
        return f"stages must be 2, 3 or 4 (shared memory: 4 stages take 226 KiB), got {stages}"
    if ffn % block_n or hidden % block_k:
        return f"F ({ffn}) must be a multiple of {block_n} and D ({hidden}) of {block_k}"
    if hidden // block_k < stages:
        return (f"D ({hidden}) must give at least {stages} K steps of {block_k} (the next "
                "tile's row addresses are fetched that many steps ahead)")
    return None


def launch_gluon_w13(gather_ptrs: torch.Tensor, padded_offsets: torch.Tensor,
                     row_offsets: torch.Tensor, w13: torch.Tensor, h2_out: torch.Tensor, *,
                     h1_out: torch.Tensor | None, x_out: torch.Tensor | None,
                     out_offsets: torch.Tensor | None, enable: torch.Tensor | None,
                     stages: int = 3, group_m: int = 8, programs: int | None = None) -> None:
    """Launch the persistent Gluon W13 (arguments validated by
    :func:`~distmoe.kernels.w13_gather_swiglu.gather_w13_swiglu`, and
    :func:`gluon_w13_reason` returned ``None``). ``programs``: grid size, default one per SM
    (tests pass fewer, so that every program walks several tiles)."""
    from ._common import device_context, ensure_tma_allocator, next_power_of_2, num_sms

    block_m, block_n, block_k, num_warps = GLUON_W13_TILE
    num_experts, _, ffn, hidden = w13.shape
    w_layout = gl.NVMMASharedLayout.get_default_for([block_n, block_k], gl.bfloat16)
    a_layout = gl.NVMMASharedLayout.get_default_for([block_m, block_k], gl.bfloat16)
    h2_layout = gl.NVMMASharedLayout.get_default_for([block_m, block_n], gl.bfloat16)
    w_desc = GluonDescriptor(w13.view(2 * num_experts * ffn, hidden),
                             [2 * num_experts * ffn, hidden], [hidden, 1], [block_n, block_k],
                             w_layout)
    ensure_tma_allocator()
    tiles = (gather_ptrs.shape[0] // block_m) * (ffn // block_n)
    if programs is None:
        programs = num_sms(h2_out.device)
    with device_context(h2_out.device):
        _gluon_w13_kernel[(max(1, min(programs, tiles)),)](
            w_desc, gather_ptrs, padded_offsets, row_offsets, h2_out,
            h2_out if h1_out is None else h1_out,
            h2_out if x_out is None else x_out,
            padded_offsets if out_offsets is None else out_offsets,
            padded_offsets if enable is None else enable,
            FFN=ffn, HIDDEN=hidden, NUM_EXPERTS=num_experts,
            EXPERTS_POW2=max(32, next_power_of_2(num_experts)),
            GROUP_M=group_m, STAGES=stages,
            WRITE_H1=h1_out is not None, WRITE_X=x_out is not None,
            DYN_OFFSETS=out_offsets is not None, HAS_ENABLE=enable is not None,
            A_LAYOUT=a_layout, H2_LAYOUT=h2_layout,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        )  # fmt: skip
