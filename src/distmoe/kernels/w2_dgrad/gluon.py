"""W2 DGRAD + SwiGLU backward for Hopper as warp-specialised Gluon kernels ("ping-pong" and
"split").

Same contract as :func:`distmoe.kernels.w2_dgrad.triton.w2_dgrad_swiglu_bwd` with rows already
gathered (``grad_h3_rows``): for every live row tile of the padded schedule and column tile of
F::

    grad_h2 = grad_h3[rows] @ w2[e]                 fp32, K = D
    g, u    = h1[rows, cols], h1[rows, F + cols]
    grad_g  = grad_h2 * u * sigmoid(g) * (1 + g * (1 - sigmoid(g)))
    grad_u  = grad_h2 * silu(g)
    h2      = silu(g) * u                           (optional)

and with ``scored_rows`` the score form (each row's score ``s`` at its address: the SwiGLU
backward of ``s * grad_h2``, ``s * h2`` stored, ``dot(grad_h2, h2)`` per column tile written
after the score; the score multiplies ``u`` once, so ``grad_g`` and ``h2`` cost nothing more).
The dot products lengthen the epilogue of an epilogue-bound kernel (evidence:
docs/performance.md), in exchange for the owner's backward reading no h3.

Why a second kernel. The Triton kernel's epilogue (two loads and three stores per element) runs
after the tile's last MMA and before the next tile's first one, in the same warps, so the
tensor cores wait for it (evidence: docs/performance.md). Triton 3.6 does not warp specialise
on Hopper. Here each program (one per SM) has three partitions:

* a producer warp issues the TMA loads of the program's tiles, ``pid, pid + G, ...``, K step
  by K step, into a ring of ``STAGES`` shared-memory stages (``ready`` / ``empty``
  mbarriers);
* two consumer warpgroups take the program's tiles in turn (even and odd). While one runs a
  tile's MMAs, the other runs the previous tile's epilogue, so the epilogue's memory traffic
  is hidden behind the tensor cores. The ring serialises their MMAs: the odd consumer's first
  stage is loaded only after the even one has released the stages before it.

Each consumer computes a ``BLOCK_M x BLOCK_N`` tile in one warpgroup (``BLOCK_N`` 128: 128
fp32 accumulator registers per thread) and runs the epilogue in column quarters, each
converted to a layout of 16-byte vectors.

At 256-512 rows per expert (D = 2048) that epilogue takes longer than the other consumer's
MMAs, so it is not hidden, and one epilogue warp per scheduler cannot issue it fast enough
(evidence: docs/performance.md). The **split kernel** (``epilogue_warps``; picked by
:mod:`distmoe.plan` on Hopper) moves the epilogue into a partition of its own:

* one MMA warpgroup computes every tile of the program; it writes each finished fp32 tile
  into shared memory as four ``[128, 32]`` column quarters (``acc_ready`` / ``acc_free``
  mbarriers per buffer; one 64 KiB buffer, or two) and starts the next tile's MMAs;
* an epilogue partition of 4 or 8 warps reads the quarters in its own layout and runs the
  SwiGLU backward; with 8 warps, two warps per scheduler hide each other's latencies;
* the TMA warp as above.

The bits are the ping-pong kernel's (the same fp32 values, the same epilogue code).

F need not be a multiple of ``block_n`` (GPT-OSS: F = 2880): a row's last tile is then
partial. Its weight columns past F are TMA zeros (grad_h2 = 0 there, so the score parts are
unchanged), and its column quarters past F load no h1 and store nothing.

Only for CUDA devices of compute capability 9.x, outside the interpreter, with ``D`` a multiple
of ``block_k`` and ``F`` of 64; :func:`gluon_w2_dgrad_reason` says when. Opt-in
(:class:`~distmoe.kernels.w2_dgrad.config.W2DgradConfig` ``gluon``).
"""

from __future__ import annotations

import torch

from distmoe.kernels.base.config import next_power_of_2
from distmoe.kernels.base.device import device_context, lockstep_counter, num_sms
from distmoe.kernels.base.gluon import HAVE_GLUON, gluon_device_reason, shared_layout

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    from distmoe.kernels.base.gluon import (
        consumer_walk,
        handoff_barriers,
        lockstep_before_tile,
        lockstep_tile_done,
        mma_steps,
        program_tiles,
        ring_barriers,
        tile_count,
        tile_info,
        tile_info_reloaded,
        tma_load_steps,
        wait_turn,
    )
    from distmoe.kernels.base.tiles import column_halves

__all__ = ["GLUON_W2_DGRAD_CONFIGS", "gluon_w2_dgrad_reason", "launch_gluon_w2_dgrad"]

#: (block_m, block_n, block_k, stages): the tile each consumer warpgroup computes and the
#: depth of the load ring. Shared memory: stages * (block_m + block_n) * block_k * 2 bytes.
GLUON_W2_DGRAD_CONFIGS = ((128, 128, 64, 5), (128, 128, 64, 4), (128, 128, 64, 6))
#: the kernel's register limit: 12 warps (two consumer warpgroups, the producer's rounded up
#: to a warpgroup) of 168 registers fill the register file; the partitions then set 232
#: (both consumers) and 40 (the producer) per thread.
_MAXNREG = 168
#: the split kernel's (``epilogue_warps``) register limit and its epilogue partition's registers
#: per thread, by epilogue warps: with 4, as the ping-pong kernel (12 warps of 168; 232 each
#: for the MMA warpgroup and the epilogue); with 8, 16 warps of 128, then 128 for the
#: epilogue, 40 for the TMA warp's warpgroup and the rest, 216, for the MMA warpgroup.
SPLIT_REGISTERS = {4: (168, 232), 8: (128, 128)}


if HAVE_GLUON:

    @gluon.jit
    def _producer(a_desc, w_desc, a_bufs, b_bufs, ready, empty, turn, ptrs_ptr,
                  padded_offsets_ptr, row_offsets_ptr, h1_ptr, h1_offset_ptr, grad_h1_ptr,
                  h2_ptr, sync_ptr,
                  FFN: gl.constexpr, HIDDEN: gl.constexpr, NUM_EXPERTS: gl.constexpr,
                  EXPERTS_POW2: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                  H1_OFFSET: gl.constexpr, STORE_H2: gl.constexpr, SCORED: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                  RELOAD_BOUNDS: gl.constexpr, PARITY: gl.constexpr,
                  LOCKSTEP: gl.constexpr, EXPERT_GROUPS: gl.constexpr):
        """One warp: the TMA loads of every tile of the program, K step by K step."""
        _produce_tiles(a_desc, w_desc, a_bufs, b_bufs, ready, empty, padded_offsets_ptr,
                       row_offsets_ptr, sync_ptr, FFN, HIDDEN, NUM_EXPERTS, EXPERTS_POW2,
                       GROUP_M, STAGES, BLOCK_M, BLOCK_N, BLOCK_K, LOCKSTEP,
                       EXPERT_GROUPS)

    @gluon.jit
    def _produce_tiles(a_desc, w_desc, a_bufs, b_bufs, ready, empty, padded_offsets_ptr,
                       row_offsets_ptr, sync_ptr, FFN: gl.constexpr, HIDDEN: gl.constexpr,
                       NUM_EXPERTS: gl.constexpr, EXPERTS_POW2: gl.constexpr,
                       GROUP_M: gl.constexpr, STAGES: gl.constexpr, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, LOCKSTEP: gl.constexpr,
                       EXPERT_GROUPS: gl.constexpr):
        """The producer warp's loop: the tiles ``pid, pid + G, ...``, each ``D / BLOCK_K``
        ring steps of the grad_h3 rows and the expert's w2 columns; with ``LOCKSTEP`` each
        wave's tiles start together (:func:`lockstep_before_tile`)."""
        NUM_K: gl.constexpr = HIDDEN // BLOCK_K
        NUM_PID_N: gl.constexpr = (FFN + BLOCK_N - 1) // BLOCK_N  # the last may be partial
        num_pid_m, num_tiles, ends, starts, rbeg, rend, eidx = program_tiles(
            padded_offsets_ptr, row_offsets_ptr, NUM_EXPERTS, EXPERTS_POW2, NUM_PID_N,
            BLOCK_M, 1)
        count = 0
        in_step = gl.to_tensor(True)  # until a wait misses its bound (a program not resident)
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            in_step = lockstep_before_tile(sync_ptr, in_step, tile, num_tiles, LOCKSTEP)
            pid_n, expert, _row, act_start, _live = tile_info(
                tile, num_pid_m, ends, starts, rbeg, rend, eidx, NUM_PID_N, GROUP_M,
                NUM_EXPERTS, BLOCK_M, EXPERT_GROUPS)
            count = tma_load_steps(a_desc, w_desc, a_bufs, b_bufs, ready, empty, count,
                                    act_start, expert * HIDDEN, pid_n * BLOCK_N, NUM_K,
                                    STAGES, BLOCK_K, False)
            if LOCKSTEP:
                lockstep_tile_done(sync_ptr)

    @gluon.jit
    def _consumer(a_desc, w_desc, a_bufs, b_bufs, ready, empty, turn, ptrs_ptr,
                  padded_offsets_ptr, row_offsets_ptr, h1_ptr, h1_offset_ptr, grad_h1_ptr,
                  h2_ptr, sync_ptr,
                  FFN: gl.constexpr, HIDDEN: gl.constexpr, NUM_EXPERTS: gl.constexpr,
                  EXPERTS_POW2: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                  H1_OFFSET: gl.constexpr, STORE_H2: gl.constexpr, SCORED: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                  RELOAD_BOUNDS: gl.constexpr, PARITY: gl.constexpr,
                  LOCKSTEP: gl.constexpr, EXPERT_GROUPS: gl.constexpr):
        """One warpgroup: the MMAs and the epilogue of the program's tiles ``PARITY``,
        ``PARITY + 2``, ... (in the program's own numbering)."""
        NUM_K: gl.constexpr = HIDDEN // BLOCK_K
        NUM_PID_N: gl.constexpr = (FFN + BLOCK_N - 1) // BLOCK_N  # the last may be partial
        ACC: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        if RELOAD_BOUNDS:  # the bounds are loaded per tile below
            num_pid_m, num_tiles = tile_count(padded_offsets_ptr, NUM_EXPERTS, NUM_PID_N,
                                               BLOCK_M)
        else:
            num_pid_m, num_tiles, ends, starts, rbeg, rend, eidx = program_tiles(
                padded_offsets_ptr, row_offsets_ptr, NUM_EXPERTS, EXPERTS_POW2, NUM_PID_N,
                BLOCK_M, 4)
        h1_base = h1_ptr
        if H1_OFFSET:
            h1_base = h1_ptr + gl.load(h1_offset_ptr)
        first, step, count = consumer_walk(NUM_K, False, PARITY)
        turns = 0
        for tile in range(first, num_tiles, step):
            if RELOAD_BOUNDS:
                # the bounds reloaded per tile: held across the loop (5 * E / 32 registers
                # per thread) they make the epilogue spill above 32 experts
                pid_n, expert, row_start, act_start, num_live = tile_info_reloaded(
                    tile, num_pid_m, padded_offsets_ptr, row_offsets_ptr, NUM_PID_N, GROUP_M,
                    NUM_EXPERTS, EXPERTS_POW2, BLOCK_M, 4, EXPERT_GROUPS)
            else:
                pid_n, expert, row_start, act_start, num_live = tile_info(
                    tile, num_pid_m, ends, starts, rbeg, rend, eidx, NUM_PID_N, GROUP_M,
                    NUM_EXPERTS, BLOCK_M, EXPERT_GROUPS)
            turns = wait_turn(turn, turns, PARITY)
            acc, count = mma_steps(a_bufs, b_bufs, ready, empty,
                                    gl.zeros([BLOCK_M, BLOCK_N], gl.float32, ACC), count, NUM_K,
                                    STAGES, 0, BLOCK_M, False)
            mbarrier.arrive(turn.index(1 - PARITY))
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES))
            count += NUM_K  # the other consumer's tile

            # Epilogue in column quarters (the whole tile with its g/u pair needs more
            # registers than a consumer has), each in an accumulator layout of its own.
            lo, hi = column_halves(acc, BLOCK_M, BLOCK_N)
            q0, q1 = column_halves(lo, BLOCK_M, BLOCK_N // 2)
            n0 = pid_n * BLOCK_N
            Q: gl.constexpr = BLOCK_N // 4
            p0 = _swiglu_bwd_part(q0, ptrs_ptr, row_start, act_start, num_live, h1_base,
                                  grad_h1_ptr, h2_ptr, n0, FFN, STORE_H2, SCORED, BLOCK_M, Q, 4)
            p1 = p0 + _swiglu_bwd_part(q1, ptrs_ptr, row_start, act_start, num_live, h1_base,
                                  grad_h1_ptr, h2_ptr, n0 + Q, FFN, STORE_H2, SCORED, BLOCK_M,
                                  Q, 4)
            q2, q3 = column_halves(hi, BLOCK_M, BLOCK_N // 2)
            p2 = p1 + _swiglu_bwd_part(q2, ptrs_ptr, row_start, act_start, num_live, h1_base,
                                  grad_h1_ptr, h2_ptr, n0 + 2 * Q, FFN, STORE_H2, SCORED,
                                  BLOCK_M, Q, 4)
            p3 = p2 + _swiglu_bwd_part(q3, ptrs_ptr, row_start, act_start, num_live, h1_base,
                                  grad_h1_ptr, h2_ptr, n0 + 3 * Q, FFN, STORE_H2, SCORED,
                                  BLOCK_M, Q, 4)
            if SCORED:
                _store_score_part(p3, ptrs_ptr, row_start, num_live, pid_n, BLOCK_M, Q, 4)

    @gluon.jit
    def _store_score_part(part_sum, ptrs_ptr, row_start, num_live, pid_n,
                          BLOCK_M: gl.constexpr, W: gl.constexpr, NW: gl.constexpr):
        """The tile's score part of each live non-null row (``part_sum``, the rows' sums
        of :func:`_swiglu_bwd_part` over the tile's columns), at fp32 value ``1 + pid_n`` of
        the row's address."""
        PL: gl.constexpr = gl.SliceLayout(1, _part_layout(W, NW))
        i = gl.arange(0, BLOCK_M, layout=PL)
        live = i < num_live
        addr = gl.load(ptrs_ptr + row_start + i, mask=live, other=0)
        gl.store(addr.to(gl.pointer_type(gl.float32)) + 1 + pid_n, part_sum,
                 mask=live & (addr != 0))

    @gluon.constexpr_function
    def _part_layout(W, NW):
        """The epilogue's layout of a ``[128, W]`` part over ``NW`` warps: 16-byte vectors
        of 8 columns per thread."""
        return gl.BlockedLayout([1, 8], [32 * 8 // W, W // 8], [NW, 1], [1, 0])

    @gluon.jit
    def _part_rows(ptrs_ptr, row_start, act_start, num_live, h1_base, col0,
                   FFN: gl.constexpr, BLOCK_M: gl.constexpr, W: gl.constexpr,
                   NW: gl.constexpr):
        """A ``[BLOCK_M, W]`` part's rows in :func:`_part_layout` over ``NW`` warps:
        ``(live, addr, rows, col, g_ptrs, load_mask)``: the live rows, their addresses in
        ``ptrs_ptr`` (0: a null row), the act rows and columns (``[BLOCK_M, 1]``,
        ``[1, W]``), the part's g pointers in h1 (u is ``FFN`` further) and the mask of live
        non-null rows (constant per 16-byte vector)."""
        L: gl.constexpr = _part_layout(W, NW)
        i = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, L))
        j = gl.arange(0, W, layout=gl.SliceLayout(0, L))
        live = i < num_live
        addr = gl.load(ptrs_ptr + row_start + i, mask=live, other=0)
        rows = gl.expand_dims((act_start + i).to(gl.int64), 1)
        col = gl.expand_dims(col0 + j, 0)
        load_mask = gl.expand_dims(live & (addr != 0), 1)
        g_ptrs = gl.multiple_of(h1_base + rows * (2 * FFN), [16, 16]) + col
        return live, addr, rows, col, g_ptrs, load_mask

    @gluon.jit
    def _swiglu_bwd_part(part, ptrs_ptr, row_start, act_start, num_live, h1_base, grad_h1_ptr,
                         h2_ptr, col0, FFN: gl.constexpr, STORE_H2: gl.constexpr,
                         SCORED: gl.constexpr, BLOCK_M: gl.constexpr, W: gl.constexpr,
                         NW: gl.constexpr):
        """SwiGLU backward of a ``[BLOCK_M, W]`` part of the tile (columns ``col0 + j``):
        rows ``act_start + i`` for ``i < num_live``; null rows (address 0 in ``ptrs_ptr``)
        load zeros and store zeros. Returns the rows' fp32 ``dot(part, h2)`` over these
        columns when ``SCORED`` (``part`` unscaled, each row's fp32 score at its address; the
        backward then runs on ``score * part`` and h2 is stored scaled), else zeros. Runs in
        a partition of ``NW`` warps (``part`` converted to its :func:`_part_layout`)."""
        # 16-byte vectors of 8 columns per thread: few 64-bit addresses (in the accumulator's
        # layout every 2 columns need their own, and the epilogue spills)
        L: gl.constexpr = _part_layout(W, NW)
        grad_h2 = gl.convert_layout(part, L)
        live, addr, rows, col, g_ptrs, load_mask = _part_rows(
            ptrs_ptr, row_start, act_start, num_live, h1_base, col0, FFN, BLOCK_M, W, NW)
        if FFN % (4 * W) != 0:  # a row's last tile is partial: no loads or stores past F
            inside = col0 < FFN  # (its weight columns there are TMA zeros: grad_h2 = 0)
            live = live & inside
            load_mask = load_mask & inside
        store_mask = gl.expand_dims(live, 1)  # broadcast along the columns
        score = 1.0
        if SCORED:
            score = gl.expand_dims(gl.load(addr.to(gl.pointer_type(gl.float32)),
                                           mask=live & (addr != 0), other=0.0), 1)
        g = gl.load(g_ptrs, mask=load_mask, other=0.0).to(gl.float32)
        u = gl.load(g_ptrs + FFN, mask=load_mask, other=0.0).to(gl.float32)
        return _swiglu_bwd_math(grad_h2, g, u, score, rows, col, store_mask, grad_h1_ptr,
                                h2_ptr, FFN, STORE_H2, SCORED, BLOCK_M, L)

    @gluon.jit
    def _swiglu_bwd_math(grad_h2, g, u, score, rows, col, store_mask, grad_h1_ptr, h2_ptr,
                         FFN: gl.constexpr, STORE_H2: gl.constexpr, SCORED: gl.constexpr,
                         BLOCK_M: gl.constexpr, L: gl.constexpr):
        """The SwiGLU backward of a part (``grad_h2``, fp32 ``g`` and ``u``, the rows'
        ``[BLOCK_M, 1]`` fp32 ``score`` when ``SCORED``, all in layout ``L``) and its stores
        (grad_h1's g and u halves, h2 with ``STORE_H2``) at act ``rows`` and columns ``col``;
        returns the rows' ``dot(part, h2)`` (``SCORED``), else zeros."""
        s = 1.0 / (1.0 + gl.exp(-g))
        silu = g * s
        dot = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, L))
        grad_u = grad_h2 * silu
        if SCORED:
            # dot(grad_h2, h2) = sum(grad_u * u) before the scaling; scaling u scales grad_g
            # and h2 at no extra cost
            dot = gl.sum(grad_u * u, axis=1)
            grad_u = grad_u * score
            u = u * score
        out_ptrs = gl.multiple_of(grad_h1_ptr + rows * (2 * FFN), [16, 16]) + col
        gl.store(out_ptrs, (grad_h2 * u * (s * (1.0 + g * (1.0 - s)))).to(gl.bfloat16),
                 mask=store_mask)
        gl.store(out_ptrs + FFN, grad_u.to(gl.bfloat16), mask=store_mask)
        if STORE_H2:
            h2_rows = gl.multiple_of(h2_ptr + rows * FFN, [16, 16])
            gl.store(h2_rows + col, (silu * u).to(gl.bfloat16), mask=store_mask)
        return dot

    @gluon.constexpr_function
    def _acc_smem_layout():
        """The shared layout of the split kernel's fp32 tile quarters (``[128, 32]``): a
        row's 16-byte chunks swizzled by the row mod 8, so that the epilogue's 16-byte reads
        of 8 rows at the same columns, and the accumulator's 8-byte writes, fall in
        different banks."""
        return gl.SwizzledSharedLayout(4, 1, 8, order=[1, 0])

    @gluon.jit
    def _split_mma(a_desc, w_desc, a_bufs, b_bufs, ready, empty, acc_smem, acc_ready, acc_free,
                   ptrs_ptr, padded_offsets_ptr, row_offsets_ptr, h1_ptr, h1_offset_ptr,
                   grad_h1_ptr, h2_ptr, sync_ptr,
                   FFN: gl.constexpr, HIDDEN: gl.constexpr, NUM_EXPERTS: gl.constexpr,
                   EXPERTS_POW2: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                   H1_OFFSET: gl.constexpr, STORE_H2: gl.constexpr, SCORED: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                   RELOAD_BOUNDS: gl.constexpr, ACC_BUFS: gl.constexpr,
                   EPI_WARPS: gl.constexpr, LOCKSTEP: gl.constexpr,
                   EXPERT_GROUPS: gl.constexpr):
        """The split kernel's MMA warpgroup: every tile of the program in turn; each finished
        fp32 tile goes to shared memory as four column quarters (buffer ``t % ACC_BUFS`` of
        the program's ``t``-th tile, once the epilogue has read that buffer's previous tile)
        and the epilogue partition is told."""
        NUM_K: gl.constexpr = HIDDEN // BLOCK_K
        NUM_PID_N: gl.constexpr = (FFN + BLOCK_N - 1) // BLOCK_N  # the last may be partial
        ACC: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        _num_pid_m, num_tiles = tile_count(padded_offsets_ptr, NUM_EXPERTS, NUM_PID_N, BLOCK_M)
        count = 0
        t = 0
        for _tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            acc, count = mma_steps(a_bufs, b_bufs, ready, empty,
                                    gl.zeros([BLOCK_M, BLOCK_N], gl.float32, ACC), count, NUM_K,
                                    STAGES, 0, BLOCK_M, False)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES))
            buf = t % ACC_BUFS
            mbarrier.wait(acc_free.index(buf), ((t // ACC_BUFS) & 1) ^ 1)
            lo, hi = column_halves(acc, BLOCK_M, BLOCK_N)
            q0, q1 = column_halves(lo, BLOCK_M, BLOCK_N // 2)
            q2, q3 = column_halves(hi, BLOCK_M, BLOCK_N // 2)
            acc_smem.index(4 * buf).store(q0)
            acc_smem.index(4 * buf + 1).store(q1)
            acc_smem.index(4 * buf + 2).store(q2)
            acc_smem.index(4 * buf + 3).store(q3)
            gl.thread_barrier()  # every thread's quarters written, before the (one) arrive
            mbarrier.arrive(acc_ready.index(buf))
            t += 1

    @gluon.jit
    def _split_epilogue(a_desc, w_desc, a_bufs, b_bufs, ready, empty, acc_smem, acc_ready,
                        acc_free, ptrs_ptr, padded_offsets_ptr, row_offsets_ptr, h1_ptr,
                        h1_offset_ptr, grad_h1_ptr, h2_ptr, sync_ptr,
                        FFN: gl.constexpr, HIDDEN: gl.constexpr, NUM_EXPERTS: gl.constexpr,
                        EXPERTS_POW2: gl.constexpr, GROUP_M: gl.constexpr,
                        STAGES: gl.constexpr, H1_OFFSET: gl.constexpr,
                        STORE_H2: gl.constexpr, SCORED: gl.constexpr, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                        RELOAD_BOUNDS: gl.constexpr, ACC_BUFS: gl.constexpr,
                        EPI_WARPS: gl.constexpr, LOCKSTEP: gl.constexpr,
                        EXPERT_GROUPS: gl.constexpr):
        """The split kernel's epilogue partition (``EPI_WARPS`` warps): the SwiGLU backward
        of every tile of the program, its quarters read from shared memory as the MMA
        warpgroup left them; the buffer goes back once the last quarter is read."""
        NUM_PID_N: gl.constexpr = (FFN + BLOCK_N - 1) // BLOCK_N  # the last may be partial
        Q: gl.constexpr = BLOCK_N // 4
        L: gl.constexpr = _part_layout(Q, EPI_WARPS)
        if RELOAD_BOUNDS:
            num_pid_m, num_tiles = tile_count(padded_offsets_ptr, NUM_EXPERTS, NUM_PID_N,
                                               BLOCK_M)
        else:
            num_pid_m, num_tiles, ends, starts, rbeg, rend, eidx = program_tiles(
                padded_offsets_ptr, row_offsets_ptr, NUM_EXPERTS, EXPERTS_POW2, NUM_PID_N,
                BLOCK_M, EPI_WARPS)
        h1_base = h1_ptr
        if H1_OFFSET:
            h1_base = h1_ptr + gl.load(h1_offset_ptr)
        t = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            if RELOAD_BOUNDS:
                pid_n, expert, row_start, act_start, num_live = tile_info_reloaded(
                    tile, num_pid_m, padded_offsets_ptr, row_offsets_ptr, NUM_PID_N, GROUP_M,
                    NUM_EXPERTS, EXPERTS_POW2, BLOCK_M, EPI_WARPS,
                    EXPERT_GROUPS)
            else:
                pid_n, expert, row_start, act_start, num_live = tile_info(
                    tile, num_pid_m, ends, starts, rbeg, rend, eidx, NUM_PID_N, GROUP_M,
                    NUM_EXPERTS, BLOCK_M, EXPERT_GROUPS)
            n0 = pid_n * BLOCK_N
            buf = t % ACC_BUFS
            mbarrier.wait(acc_ready.index(buf), (t // ACC_BUFS) & 1)
            part = acc_smem.index(4 * buf).load(L)
            p = _swiglu_bwd_part(part, ptrs_ptr, row_start, act_start, num_live, h1_base,
                                 grad_h1_ptr, h2_ptr, n0, FFN, STORE_H2, SCORED, BLOCK_M, Q,
                                 EPI_WARPS)
            part = acc_smem.index(4 * buf + 1).load(L)
            p += _swiglu_bwd_part(part, ptrs_ptr, row_start, act_start, num_live, h1_base,
                                  grad_h1_ptr, h2_ptr, n0 + Q, FFN, STORE_H2, SCORED, BLOCK_M,
                                  Q, EPI_WARPS)
            part = acc_smem.index(4 * buf + 2).load(L)
            p += _swiglu_bwd_part(part, ptrs_ptr, row_start, act_start, num_live, h1_base,
                                  grad_h1_ptr, h2_ptr, n0 + 2 * Q, FFN, STORE_H2, SCORED,
                                  BLOCK_M, Q, EPI_WARPS)
            part = acc_smem.index(4 * buf + 3).load(L)
            gl.thread_barrier()  # every thread's reads of the buffer, before the (one) arrive
            mbarrier.arrive(acc_free.index(buf))
            p += _swiglu_bwd_part(part, ptrs_ptr, row_start, act_start, num_live, h1_base,
                                  grad_h1_ptr, h2_ptr, n0 + 3 * Q, FFN, STORE_H2, SCORED,
                                  BLOCK_M, Q, EPI_WARPS)
            if SCORED:
                _store_score_part(p, ptrs_ptr, row_start, num_live, pid_n, BLOCK_M, Q,
                                  EPI_WARPS)
            t += 1

    @gluon.jit
    def _split_producer(a_desc, w_desc, a_bufs, b_bufs, ready, empty, acc_smem, acc_ready,
                        acc_free, ptrs_ptr, padded_offsets_ptr, row_offsets_ptr, h1_ptr,
                        h1_offset_ptr, grad_h1_ptr, h2_ptr, sync_ptr,
                        FFN: gl.constexpr, HIDDEN: gl.constexpr, NUM_EXPERTS: gl.constexpr,
                        EXPERTS_POW2: gl.constexpr, GROUP_M: gl.constexpr,
                        STAGES: gl.constexpr, H1_OFFSET: gl.constexpr,
                        STORE_H2: gl.constexpr, SCORED: gl.constexpr, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                        RELOAD_BOUNDS: gl.constexpr, ACC_BUFS: gl.constexpr,
                        EPI_WARPS: gl.constexpr, LOCKSTEP: gl.constexpr,
                        EXPERT_GROUPS: gl.constexpr):
        """The split kernel's TMA warp (:func:`_produce_tiles`)."""
        _produce_tiles(a_desc, w_desc, a_bufs, b_bufs, ready, empty, padded_offsets_ptr,
                       row_offsets_ptr, sync_ptr, FFN, HIDDEN, NUM_EXPERTS, EXPERTS_POW2,
                       GROUP_M, STAGES, BLOCK_M, BLOCK_N, BLOCK_K, LOCKSTEP,
                       EXPERT_GROUPS)

    @gluon.jit
    def _gluon_w2_dgrad_kernel(
        a_desc,  # host descriptor of the gathered grad_h3 rows [R_act, D], block [BM, BK]
        w_desc,  # host descriptor of w2 viewed [E*D, F], block [BK, BN]
        ptrs_ptr,  # int64 [R_cap]: grad_h3 row addresses by padded row (0 = null row)
        padded_offsets_ptr,  # int32 [E + 1]
        row_offsets_ptr,  # int32 [E + 1]
        h1_ptr,  # bf16 h1 rows [R_act, 2F], or a 1-D base (H1_OFFSET)
        h1_offset_ptr,  # int64 [1] (H1_OFFSET), else a placeholder
        grad_h1_ptr,  # bf16 [R_act, 2F] (may be the h1 rows)
        h2_ptr,  # bf16 [R_act, F] (STORE_H2), else a placeholder
        sync_ptr,  # int32 [1], zero at the launch (LOCKSTEP), else a placeholder
        FFN: gl.constexpr,
        HIDDEN: gl.constexpr,
        NUM_EXPERTS: gl.constexpr,
        EXPERTS_POW2: gl.constexpr,
        GROUP_M: gl.constexpr,
        STAGES: gl.constexpr,
        H1_OFFSET: gl.constexpr,
        STORE_H2: gl.constexpr,
        SCORED: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
        RELOAD_BOUNDS: gl.constexpr,
        LOCKSTEP: gl.constexpr,  # the producer starts each wave's tiles with the others'
        EXPERT_GROUPS: gl.constexpr,  # tile order: a group per expert (tile_info)
        num_warps: gl.constexpr,
    ):
        a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BLOCK_K],
                                           a_desc.layout)
        b_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, BLOCK_N],
                                           w_desc.layout)
        ready, empty, turn = ring_barriers(STAGES, 1, 1)
        gl.warp_specialize([
            (_consumer, (a_desc, w_desc, a_bufs, b_bufs, ready, empty, turn, ptrs_ptr,
                         padded_offsets_ptr, row_offsets_ptr, h1_ptr, h1_offset_ptr,
                         grad_h1_ptr, h2_ptr, sync_ptr, FFN, HIDDEN, NUM_EXPERTS, EXPERTS_POW2,
                         GROUP_M, STAGES, H1_OFFSET, STORE_H2, SCORED, BLOCK_M, BLOCK_N, BLOCK_K,
                         RELOAD_BOUNDS, 0, LOCKSTEP, EXPERT_GROUPS)),
            (_consumer, (a_desc, w_desc, a_bufs, b_bufs, ready, empty, turn, ptrs_ptr,
                         padded_offsets_ptr, row_offsets_ptr, h1_ptr, h1_offset_ptr,
                         grad_h1_ptr, h2_ptr, sync_ptr, FFN, HIDDEN, NUM_EXPERTS, EXPERTS_POW2,
                         GROUP_M, STAGES, H1_OFFSET, STORE_H2, SCORED, BLOCK_M, BLOCK_N, BLOCK_K,
                         RELOAD_BOUNDS, 1, LOCKSTEP, EXPERT_GROUPS)),
            (_producer, (a_desc, w_desc, a_bufs, b_bufs, ready, empty, turn, ptrs_ptr,
                         padded_offsets_ptr, row_offsets_ptr, h1_ptr, h1_offset_ptr,
                         grad_h1_ptr, h2_ptr, sync_ptr, FFN, HIDDEN, NUM_EXPERTS, EXPERTS_POW2,
                         GROUP_M, STAGES, H1_OFFSET, STORE_H2, SCORED, BLOCK_M, BLOCK_N, BLOCK_K,
                         RELOAD_BOUNDS, 1, LOCKSTEP, EXPERT_GROUPS)),
        ], [4, 1], [232, 40])


    @gluon.jit
    def _gluon_w2_dgrad_split_kernel(
        a_desc, w_desc, ptrs_ptr, padded_offsets_ptr, row_offsets_ptr, h1_ptr, h1_offset_ptr,
        grad_h1_ptr, h2_ptr, sync_ptr,  # as _gluon_w2_dgrad_kernel's
        FFN: gl.constexpr,
        HIDDEN: gl.constexpr,
        NUM_EXPERTS: gl.constexpr,
        EXPERTS_POW2: gl.constexpr,
        GROUP_M: gl.constexpr,
        STAGES: gl.constexpr,
        H1_OFFSET: gl.constexpr,
        STORE_H2: gl.constexpr,
        SCORED: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
        RELOAD_BOUNDS: gl.constexpr,
        ACC_BUFS: gl.constexpr,  # fp32 tiles in shared memory (64 KiB each)
        EPI_WARPS: gl.constexpr,  # the epilogue partition's warps (4 or 8)
        EPI_REGS: gl.constexpr,  # its registers per thread
        LOCKSTEP: gl.constexpr,  # as _gluon_w2_dgrad_kernel's
        EXPERT_GROUPS: gl.constexpr,  # as _gluon_w2_dgrad_kernel's
        num_warps: gl.constexpr,
    ):
        """The W2 DGRAD with its epilogue in a partition of its own (``epilogue_warps``):
        one MMA warpgroup, ``EPI_WARPS`` epilogue warps, one TMA warp."""
        a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BLOCK_K],
                                           a_desc.layout)
        b_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, BLOCK_N],
                                           w_desc.layout)
        acc_smem = gl.allocate_shared_memory(gl.float32, [4 * ACC_BUFS, BLOCK_M, BLOCK_N // 4],
                                             _acc_smem_layout())
        ready, empty, _turn = ring_barriers(STAGES, 1, 1)
        acc_ready, acc_free = handoff_barriers(ACC_BUFS, 1, 1)
        # the arguments written out per partition: a tuple assigned to a name first would
        # turn its constexprs into tensors
        gl.warp_specialize([
            (_split_mma, (a_desc, w_desc, a_bufs, b_bufs, ready, empty, acc_smem, acc_ready,
                 acc_free, ptrs_ptr, padded_offsets_ptr, row_offsets_ptr, h1_ptr, h1_offset_ptr,
                 grad_h1_ptr, h2_ptr, sync_ptr, FFN, HIDDEN, NUM_EXPERTS, EXPERTS_POW2, GROUP_M,
                 STAGES, H1_OFFSET, STORE_H2, SCORED, BLOCK_M, BLOCK_N, BLOCK_K,
                 RELOAD_BOUNDS, ACC_BUFS, EPI_WARPS, LOCKSTEP, EXPERT_GROUPS)),
            (_split_epilogue, (a_desc, w_desc, a_bufs, b_bufs, ready, empty, acc_smem, acc_ready,
                 acc_free, ptrs_ptr, padded_offsets_ptr, row_offsets_ptr, h1_ptr, h1_offset_ptr,
                 grad_h1_ptr, h2_ptr, sync_ptr, FFN, HIDDEN, NUM_EXPERTS, EXPERTS_POW2, GROUP_M,
                 STAGES, H1_OFFSET, STORE_H2, SCORED, BLOCK_M, BLOCK_N, BLOCK_K,
                 RELOAD_BOUNDS, ACC_BUFS, EPI_WARPS, LOCKSTEP, EXPERT_GROUPS)),
            (_split_producer, (a_desc, w_desc, a_bufs, b_bufs, ready, empty, acc_smem, acc_ready,
                 acc_free, ptrs_ptr, padded_offsets_ptr, row_offsets_ptr, h1_ptr, h1_offset_ptr,
                 grad_h1_ptr, h2_ptr, sync_ptr, FFN, HIDDEN, NUM_EXPERTS, EXPERTS_POW2, GROUP_M,
                 STAGES, H1_OFFSET, STORE_H2, SCORED, BLOCK_M, BLOCK_N, BLOCK_K,
                 RELOAD_BOUNDS, ACC_BUFS, EPI_WARPS, LOCKSTEP, EXPERT_GROUPS)),
        ], [EPI_WARPS, 1], [EPI_REGS, 40])


def gluon_w2_dgrad_reason(device: torch.device, *, hidden: int, ffn: int, block_m: int,
                          block_n: int, block_k: int) -> str | None:
    """``None`` when :func:`launch_gluon_w2_dgrad` can run this case, else why not."""
    reason = gluon_device_reason(device)
    if reason is not None:
        return reason
    return shape_reason(hidden=hidden, ffn=ffn, block_m=block_m, block_n=block_n,
                        block_k=block_k)


def shape_reason(*, hidden: int, ffn: int, block_m: int = 128, block_n: int = 128,
                 block_k: int = 64) -> str | None:
    """``None`` when the Gluon W2 DGRAD tiles this shape (device aside), else why not."""
    if block_m != 128 or block_n != 128 or block_k != 64:
        return f"the Gluon W2 DGRAD computes 128 x 128 x 64 tiles, got {block_m} x {block_n} " \
               f"x {block_k}"
    if hidden % block_k or ffn % 64:
        return f"D ({hidden}) must be a multiple of {block_k} and F ({ffn}) of 64"
    return None


def launch_gluon_w2_dgrad(grad_h3_ptrs: torch.Tensor, padded_offsets: torch.Tensor,
                          row_offsets: torch.Tensor, w2: torch.Tensor,
                          grad_h3_rows: torch.Tensor, h1: torch.Tensor,
                          grad_h1_out: torch.Tensor, *, h1_offset: torch.Tensor | None,
                          h2_out: torch.Tensor | None, scored_rows: bool = False,
                          group_m: int = 8, stages: int = 5,
                          programs: int | None = None,
                          reload_bounds: bool | None = None, epilogue_warps: int = 0,
                          epilogue_buffers: int = 1, lockstep: bool = False,
                          expert_groups: bool = False) -> None:
    """Launch the kernel (arguments validated by the caller,
    :func:`~distmoe.kernels.w2_dgrad.triton.w2_dgrad_swiglu_bwd`, and
    :func:`gluon_w2_dgrad_reason` returned ``None``). ``programs``: the grid (default one per
    SM); tests pass fewer so that every program walks many tiles. ``reload_bounds``: the
    consumers load the per-expert bounds per tile instead of holding them in registers
    (default: above 32 experts, where holding them made the epilogue spill: 132 bytes per
    thread at 128 experts in the scored form, 220 at 256, none after; at 32 experts holding
    them spills nothing and reloading would spill 16 bytes in the plain form).
    ``epilogue_warps`` (4 or 8; 0: the ping-pong kernel): the split kernel, one MMA
    warpgroup handing each fp32 tile to an epilogue partition of that many warps through
    ``epilogue_buffers`` (1 or 2) shared-memory tiles; ``stages + 2 * epilogue_buffers`` at
    most 7 (shared memory). Same bits as the ping-pong kernel.
    ``lockstep``: :attr:`~distmoe.kernels.w2_dgrad.config.W2DgradConfig.lockstep` (a zeroed int32
    counter is allocated per launch). ``expert_groups``:
    :attr:`~distmoe.kernels.w2_dgrad.config.W2DgradConfig.expert_groups`."""
    num_experts, hidden, ffn = w2.shape
    block_m, block_n, block_k = 128, 128, 64
    a_layout = shared_layout((block_m, block_k))
    w_layout = shared_layout((block_k, block_n))
    a_desc = GluonDescriptor(grad_h3_rows, list(grad_h3_rows.shape), [hidden, 1],
                             [block_m, block_k], a_layout)
    w_desc = GluonDescriptor(w2.view(num_experts * hidden, ffn), [num_experts * hidden, ffn],
                             [ffn, 1], [block_k, block_n], w_layout)
    tiles_cap = (grad_h3_ptrs.shape[0] // block_m) * -(-ffn // block_n)
    if programs is None:
        programs = num_sms(w2.device)
    grid = (max(1, min(programs, tiles_cap)),)
    reload = num_experts > 32 if reload_bounds is None else bool(reload_bounds)
    args = (a_desc, w_desc, grad_h3_ptrs, padded_offsets, row_offsets, h1,
            h1_offset if h1_offset is not None else row_offsets, grad_h1_out,
            h2_out if h2_out is not None else grad_h1_out,
            lockstep_counter(lockstep, row_offsets))
    common = dict(FFN=ffn, HIDDEN=hidden, NUM_EXPERTS=num_experts,
                  EXPERTS_POW2=max(32, next_power_of_2(num_experts)), GROUP_M=group_m,
                  STAGES=stages, H1_OFFSET=h1_offset is not None, STORE_H2=h2_out is not None,
                  SCORED=scored_rows, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                  RELOAD_BOUNDS=reload, LOCKSTEP=bool(lockstep),
                  EXPERT_GROUPS=bool(expert_groups), num_warps=4)
    if epilogue_warps:  # the split kernel
        maxnreg, epi_regs = SPLIT_REGISTERS[epilogue_warps]
        kernel = _gluon_w2_dgrad_split_kernel
        own = dict(ACC_BUFS=epilogue_buffers, EPI_WARPS=epilogue_warps, EPI_REGS=epi_regs,
                   maxnreg=maxnreg)
    else:  # the ping-pong kernel
        kernel = _gluon_w2_dgrad_kernel
        own = dict(maxnreg=_MAXNREG)
    with device_context(w2.device):
        kernel[grid](*args, **common, **own)
