"""Persistent grouped WGRAD for Hopper, written in Gluon (``triton.experimental.gluon``).

Same contract as the overwrite mode of :func:`distmoe.kernels.wgrad.triton.launch_grouped_wgrad`::

    out[e] = A[rows_e]^T @ B[rows_e]        rows_e = [row_offsets[e], row_offsets[e+1])

``A`` bf16 ``[R_act, P]``, ``B`` bf16 ``[R_act, Q]`` (or a 1-D bf16 base with row ``r`` at
``b_offset[0] + r*Q``, ``b_offset`` an int64 device scalar), ``out`` bf16 ``[E, P, Q]``, fp32
accumulation and one rounding; an expert without rows gets zeros.

Why a second kernel. The Triton kernel runs one program per (expert, output tile). At
T=4096, E=128, K=8 an expert has about 256 rows, four 64-row steps, so each program spends a
large part of its life filling its pipeline and storing its tile, and under real (unbalanced)
routing its last, partial step waits for its own loads after the pipelined loop (evidence:
docs/performance.md). Triton 3.6 pipelines only loads whose address is a closed form of the
loop counter, so it cannot run one pipeline through several tiles. Here the pipeline is
written out by hand:

* one program per SM walks the output tiles ``pid, pid + G, ...`` (``G`` programs);
* one flat stream of TMA loads runs ``STAGES - 1`` row steps ahead of the MMAs, across tile
  boundaries, so the next tile's first loads are in flight while this tile's last MMAs and
  its epilogue run;
* the epilogue rounds the fp32 tile to bf16 into shared memory and leaves with an
  asynchronous TMA store, waited for only before the next tile's epilogue reuses the buffer;
* a partial last step zeroes its rows past the expert's end in shared memory (both
  operands: the rows there belong to the next expert, are stale, or are TMA zeros, and NaN
  must not reach the sum), then runs the same shared-memory MMA as every other step;
* every tile's row bounds are loaded one tile ahead, so tile switches do not wait on memory.

The warp-specialised form (:func:`_gluon_wgrad_ws_kernel`, ``launch_gluon_wgrad(...,
specialized=True)``; picked by :mod:`distmoe.plan` for 128-column tiles) computes the same
MMAs in the same order, so the same bits, with the work split over three partitions:

* one warp issues the TMA loads, each once the MMA warps have released the stage;
* two warps zero each tile's partial last step: its loads complete a second barrier of the
  stage, which they wait for, then they zero the rows past the expert's end (16 rows at a
  time) and complete the stage's barrier themselves;
* the MMA warps run one MMA per step with no branch in their loop, and the epilogue.

Its ping-pong form (``pingpong=True``) runs two MMA warpgroups of 4 warps, each on whole
128-row tiles, taking the program's tiles in turn: a ``turn`` mbarrier pair orders their
MMAs, and each skips the other's row steps in the ring's count, so one's epilogue (bf16
rounding, shared-memory store, TMA store) runs under the other's MMAs; the same bits. With a
few hundred rows per expert a tile is only 2-4 row steps and the epilogue is a large share
of it.

Under a real router most experts end in a partial step. Zeroing it on the MMA warps' path
is costly, and any code added to the one-partition loop slows every step (the loop's
descriptors leave the uniform datapath); hence the zeroing partition (evidence:
docs/performance.md).

Reading B's rows in place (``b_rows``, the W13 WGRAD of a layer that kept its input x at
EP = 1, :func:`distmoe.kernels.wgrad.triton.w13_wgrad`'s ``x_rows``): the warp-specialised
kernel's producer, then two warps, loads A by TMA and copies each B row by 16-byte
``cp.async`` from an address table (Hopper has no TMA gather), rows past the expert's end and
null rows zero-filled, each step's addresses loaded a step ahead; every producer thread's
``cp.async.mbarrier.arrive.noinc`` counts in the stage's barrier. Same MMAs, same bits. The
copies are bound by the producer's latency, so it runs best with 256 x 128 output tiles,
which load each B row once per 256 output rows (:mod:`distmoe.plan` picks the tile).

P need not be a multiple of the tile's rows (GPT-OSS's W2: P = D = 2880): the output is then
stored through an ``[E, P, Q]`` descriptor, whose clipping keeps each expert's partial last
row block out of the next expert's rows, and A's columns past P are TMA zeros.

Only for CUDA devices of compute capability 9.x and outside the interpreter; the launcher
(:func:`gluon_wgrad_supported`) says when, and the Triton kernel serves everything else.
"""

from __future__ import annotations

import torch
import triton

from distmoe.kernels.base.device import (
    device_context,
    ensure_tma_allocator,
    lockstep_counter,
    num_sms,
)
from distmoe.kernels.base.gluon import HAVE_GLUON, gluon_device_reason, shared_layout

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

    from distmoe.kernels.base.gluon import lockstep_before_tile, lockstep_tile_done

__all__ = ["GLUON_WGRAD_CONFIGS", "gluon_gather_reason", "gluon_wgrad_supported",
           "launch_gluon_wgrad"]

# (block_p, block_q, stages, num_warps, block_k) candidates: the tuner times them all
# (distmoe.plan picks the config a layer runs). Shared memory:
# stages * block_k * (block_p + block_q) * 2 + block_p * block_q * 2 bytes (at most 227 KiB).


#: warps of the warp-specialised kernel's zeroing partition
WS_ZERO_WARPS = 2
#: warps of its producer partition when it gathers B's rows by address (``b_rows``)
WS_GATHER_WARPS = 2


def ws_maxnreg(num_warps: int, pingpong: bool = False, gather: bool = False) -> int:
    """The warp-specialised kernel's register limit: the register file over its warps
    (``num_warps`` MMA warps, twice that with ``pingpong``, the producer's one (with
    ``gather``: :data:`WS_GATHER_WARPS`) and the zeroing partition's :data:`WS_ZERO_WARPS`,
    launched as a multiple of 4), rounded down to a multiple of 8: 168 at 8 MMA warps (or
    two ping-pong warpgroups of 4), 248 at 4."""
    mma_warps = 2 * num_warps if pingpong else num_warps
    producer = WS_GATHER_WARPS if gather else 1
    warps = -(-(mma_warps + producer + WS_ZERO_WARPS) // 4) * 4
    return min(255, 65536 // (32 * warps)) // 8 * 8

GLUON_WGRAD_CONFIGS = ((128, 256, 3, 8, 64), (128, 128, 5, 8, 64), (128, 128, 6, 8, 64),
                       (128, 128, 4, 4, 64), (128, 128, 3, 8, 128), (256, 128, 3, 8, 64))


if HAVE_GLUON:

    @gluon.constexpr_function
    def _tiles_per_expert(P, NUM_Q, BLOCK_P):
        """Output tiles of one expert: ``ceil(P / BLOCK_P)`` row blocks of ``NUM_Q`` tiles (an
        expert's last row block may be partial: :func:`_store_tile` clips it)."""
        return (P + BLOCK_P - 1) // BLOCK_P * NUM_Q

    @gluon.jit
    def _store_tile(o_desc, buf, out_row, p0, q0, P: gl.constexpr, BLOCK_P: gl.constexpr,
                    BLOCK_Q: gl.constexpr):
        """The tile's asynchronous TMA store from ``buf`` (bf16 ``[BLOCK_P, BLOCK_Q]``). With P
        a multiple of ``BLOCK_P`` ``o_desc`` views out as ``[E*P, Q]``; otherwise as ``[E, P,
        Q]`` (blocks ``[1, BLOCK_P, BLOCK_Q]``), so that TMA clips an expert's last row block
        at P instead of writing into the next expert's rows."""
        if P % BLOCK_P != 0:
            tile3 = buf._reinterpret(gl.bfloat16, [1, BLOCK_P, BLOCK_Q], o_desc.layout)
            tma.async_copy_shared_to_global(o_desc, [out_row // P, p0, q0], tile3)
        else:
            tma.async_copy_shared_to_global(o_desc, [out_row, q0], buf)

    @gluon.jit
    def _tile_rows(row_offsets_ptr, tile, num_tiles, TILES_PER_EXPERT: gl.constexpr):
        """Row bounds ``(first, end)`` of ``tile``'s expert; ``(0, 0)`` past the last tile."""
        first = 0
        end = 0
        if tile < num_tiles:
            expert = tile // TILES_PER_EXPERT
            first = gl.load(row_offsets_ptr + expert)
            end = gl.load(row_offsets_ptr + expert + 1)
        return first, end

    @gluon.jit
    def _tile_origin(tile, P: gl.constexpr, NUM_Q: gl.constexpr, TILES_PER_EXPERT: gl.constexpr,
                     BLOCK_P: gl.constexpr, BLOCK_Q: gl.constexpr):
        """Output row (in the ``[E*P, Q]`` view) and column of ``tile``'s first element, and its
        first column of A (``p0``)."""
        expert = tile // TILES_PER_EXPERT
        rest = tile % TILES_PER_EXPERT
        p0 = (rest // NUM_Q) * BLOCK_P
        q0 = (rest % NUM_Q) * BLOCK_Q
        return expert * P + p0, p0, q0

    @gluon.jit
    def _produce(a_desc, b_desc, a_bufs, b_bufs, bars, row_offsets_ptr, num_tiles, num_progs,
                 p_tile, p_row, p_end, pf_first, pf_end, p_count,
                 P: gl.constexpr, NUM_Q: gl.constexpr, TILES_PER_EXPERT: gl.constexpr,
                 BLOCK_K: gl.constexpr, BLOCK_P: gl.constexpr, BLOCK_Q: gl.constexpr,
                 STAGES: gl.constexpr):
        """Issue the TMA loads of the next row step of the program's flat step stream into
        stage ``p_count % STAGES`` (none once the stream has ended) and advance the cursor.
        ``pf_*``: the bounds of tile ``p_tile + G``, loaded one tile ahead."""
        while (p_row >= p_end) & (p_tile < num_tiles):
            p_tile += num_progs
            p_row = pf_first
            p_end = pf_end
            pf_first, pf_end = _tile_rows(row_offsets_ptr, p_tile + num_progs, num_tiles,
                                          TILES_PER_EXPERT)
        live = p_tile < num_tiles
        _row, p0, q0 = _tile_origin(p_tile, P, NUM_Q, TILES_PER_EXPERT, BLOCK_P, BLOCK_Q)
        stage = p_count % STAGES
        bar = bars.index(stage)
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=live)
        tma.async_copy_global_to_shared(a_desc, [p_row, p0], bar, a_bufs.index(stage), live)
        tma.async_copy_global_to_shared(b_desc, [p_row, q0], bar, b_bufs.index(stage), live)
        return p_tile, p_row + BLOCK_K, p_end, pf_first, pf_end, p_count + 1

    @gluon.jit
    def _zero_rows_from(buf, valid, BLOCK_K: gl.constexpr, WIDTH: gl.constexpr,
                        num_warps: gl.constexpr):
        """Rows ``>= valid`` of a ``[BLOCK_K, WIDTH]`` shared-memory tile set to zero."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        tile = buf.load(layout)
        rows = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, layout))
        keep = gl.expand_dims(rows < valid, 1)
        buf.store(gl.where(keep, tile, gl.zeros_like(tile)))

    @gluon.jit
    def _b_source(b_desc, b_base, b_offset_ptr, row_offsets_ptr, Q: gl.constexpr,
                  NUM_EXPERTS: gl.constexpr, B_OFFSET: gl.constexpr, B_LAYOUT: gl.constexpr,
                  BLOCK_K: gl.constexpr, BLOCK_Q: gl.constexpr):
        """B's descriptor: the host's, or (``B_OFFSET``: the offset is a device value, a slot
        cursor) one built on the device over the live rows from the offset (a multiple of 8
        elements: a 16-byte aligned base), once per program."""
        if B_OFFSET:
            b_src = tma.make_tensor_descriptor(
                b_base + gl.load(b_offset_ptr),
                shape=[gl.load(row_offsets_ptr + NUM_EXPERTS), Q],
                strides=[Q, 1],
                block_shape=[BLOCK_K, BLOCK_Q],
                layout=B_LAYOUT,
            )
        else:
            b_src = b_desc
        return b_src

    @gluon.jit
    def _gluon_wgrad_kernel(
        a_desc,  # host descriptor of A [R_act, P], block [BLOCK_K, BLOCK_P]
        b_desc,  # host descriptor of B [R_act, Q], block [BLOCK_K, BLOCK_Q] (not B_OFFSET)
        b_base,  # 1-D bf16 base of B (B_OFFSET), else a placeholder
        b_offset_ptr,  # int64 [1]: element offset of B's row 0 (B_OFFSET), else a placeholder
        o_desc,  # host descriptor of out viewed [E*P, Q], block [BLOCK_P, BLOCK_Q] (P a multiple
        #        of BLOCK_P), else viewed [E, P, Q], block [1, BLOCK_P, BLOCK_Q]
        row_offsets_ptr,  # int32 [E + 1]
        P: gl.constexpr,
        Q: gl.constexpr,
        NUM_EXPERTS: gl.constexpr,
        B_OFFSET: gl.constexpr,
        B_LAYOUT: gl.constexpr,
        C_LAYOUT: gl.constexpr,  # the epilogue buffer's: [BLOCK_P, BLOCK_Q] blocks of o_desc's
        BLOCK_K: gl.constexpr,
        BLOCK_P: gl.constexpr,
        BLOCK_Q: gl.constexpr,
        STAGES: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        NUM_Q: gl.constexpr = (Q + BLOCK_Q - 1) // BLOCK_Q
        TILES_PER_EXPERT: gl.constexpr = _tiles_per_expert(P, NUM_Q, BLOCK_P)
        num_tiles = NUM_EXPERTS * TILES_PER_EXPERT
        pid = gl.program_id(0)
        num_progs = gl.num_programs(0)

        b_src = _b_source(b_desc, b_base, b_offset_ptr, row_offsets_ptr, Q, NUM_EXPERTS,
                          B_OFFSET, B_LAYOUT, BLOCK_K, BLOCK_Q)

        a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, BLOCK_P], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, BLOCK_Q], B_LAYOUT)
        c_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_P, BLOCK_Q], C_LAYOUT)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)

        # 16-row MMA atoms stacked over the warps (BLOCK_P >= 16 * num_warps), full width.
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_Q, 16])

        # Producer cursor: its tile, next row, the tile's end, the bounds of tile + G.
        p_tile = pid
        p_row, p_end = _tile_rows(row_offsets_ptr, pid, num_tiles, TILES_PER_EXPERT)
        pf_first, pf_end = _tile_rows(row_offsets_ptr, pid + num_progs, num_tiles,
                                      TILES_PER_EXPERT)
        p_count = 0
        for _pre in gl.static_range(STAGES - 1):
            p_tile, p_row, p_end, pf_first, pf_end, p_count = _produce(
                a_desc, b_src, a_bufs, b_bufs, bars, row_offsets_ptr, num_tiles, num_progs,
                p_tile, p_row, p_end, pf_first, pf_end, p_count,
                P, NUM_Q, TILES_PER_EXPERT, BLOCK_K, BLOCK_P, BLOCK_Q, STAGES,
            )  # fmt: skip

        # Consumer: the program's tiles in order; each step's stage and phase follow the count.
        c_count = 0
        tile = pid
        first, end = _tile_rows(row_offsets_ptr, tile, num_tiles, TILES_PER_EXPERT)
        while tile < num_tiles:
            next_first, next_end = _tile_rows(row_offsets_ptr, tile + num_progs, num_tiles,
                                              TILES_PER_EXPERT)
            out_row, p0, q0 = _tile_origin(tile, P, NUM_Q, TILES_PER_EXPERT, BLOCK_P, BLOCK_Q)
            acc = gl.zeros([BLOCK_P, BLOCK_Q], gl.float32, acc_layout)
            row = first
            while row < end:
                stage = c_count % STAGES
                mbarrier.wait(bars.index(stage), (c_count // STAGES) & 1)
                a_tile = a_bufs.index(stage)
                b_tile = b_bufs.index(stage)
                if row + BLOCK_K > end:
                    _zero_rows_from(a_tile, end - row, BLOCK_K, BLOCK_P, num_warps)
                    _zero_rows_from(b_tile, end - row, BLOCK_K, BLOCK_Q, num_warps)
                    fence_async_shared()
                    gl.thread_barrier()
                acc = warpgroup_mma(a_tile.permute((1, 0)), b_tile, acc, is_async=True)
                # The previous step's MMA is done in this warpgroup; after the barrier, in all
                # of them, so its stage takes the load STAGES - 1 steps ahead.
                acc = warpgroup_mma_wait(1, deps=(acc,))
                gl.thread_barrier()
                p_tile, p_row, p_end, pf_first, pf_end, p_count = _produce(
                    a_desc, b_src, a_bufs, b_bufs, bars, row_offsets_ptr, num_tiles, num_progs,
                    p_tile, p_row, p_end, pf_first, pf_end, p_count,
                    P, NUM_Q, TILES_PER_EXPERT, BLOCK_K, BLOCK_P, BLOCK_Q, STAGES,
                )  # fmt: skip
                c_count += 1
                row += BLOCK_K
            acc = warpgroup_mma_wait(0, deps=(acc,))
            # The previous tile's store has read c_smem (the wait is per issuing thread: the
            # barrier publishes it to every thread).
            tma.store_wait(0)
            gl.thread_barrier()
            c_smem.store(acc.to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()
            _store_tile(o_desc, c_smem, out_row, p0, q0, P, BLOCK_P, BLOCK_Q)
            tile += num_progs
            first = next_first
            end = next_end
        tma.store_wait(0)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))


    @gluon.constexpr_function
    def _slice_layout(WIDTH, num_warps):
        """16-byte vectors over a ``[16, WIDTH]`` slice, a warp's threads along a row first."""
        cols = min(32, WIDTH // 8)
        return gl.BlockedLayout([1, 8], [32 // cols, cols], [num_warps, 1], [1, 0])

    @gluon.jit
    def _zero_rows_sliced(buf, valid, BLOCK_K: gl.constexpr, WIDTH: gl.constexpr,
                          num_warps: gl.constexpr):
        """:func:`_zero_rows_from` 16 rows at a time (few registers): slices wholly past
        ``valid`` are stored without a load; only the one straddling it is read."""
        layout: gl.constexpr = _slice_layout(WIDTH, num_warps)
        rows = gl.arange(0, 16, layout=gl.SliceLayout(1, layout))
        for s in gl.static_range(BLOCK_K // 16):
            part = buf.slice(s * 16, 16)
            if s * 16 >= valid:
                part.store(gl.zeros([16, WIDTH], gl.bfloat16, layout))
            elif s * 16 + 16 > valid:
                tile = part.load(layout)
                keep = gl.expand_dims(rows < valid - s * 16, 1)
                part.store(gl.where(keep, tile, gl.zeros_like(tile)))

    @gluon.jit
    def _ws_consumer(a_bufs, b_bufs, c_smem, bars, empty, o_desc, row_offsets_ptr,
                     b_desc, b_base, b_offset_ptr, b_rows_ptr, padded_offsets_ptr, b_shift,
                     P: gl.constexpr, Q: gl.constexpr, NUM_EXPERTS: gl.constexpr,
                     B_OFFSET: gl.constexpr, GATHER_B: gl.constexpr, B_LAYOUT: gl.constexpr,
                     BLOCK_K: gl.constexpr,
                     BLOCK_P: gl.constexpr, BLOCK_Q: gl.constexpr, STAGES: gl.constexpr,
                     NUM_WARPS: gl.constexpr, turn, PINGPONG: gl.constexpr,
                     PARITY: gl.constexpr):
        """The MMAs and the epilogue of the program's tiles: every row step the same MMA
        (a partial step arrives with its dead rows already zeroed), no branch in the loop.
        With ``PINGPONG`` this warpgroup takes every other tile of the program (from its
        ``PARITY``-th) into its own ``c_smem`` buffer, its MMAs ordered after the other's by
        the ``turn`` pair, so that one's epilogue runs under the other's MMAs; it skips the
        other's steps in the ring's count."""
        NUM_Q: gl.constexpr = (Q + BLOCK_Q - 1) // BLOCK_Q
        TILES_PER_EXPERT: gl.constexpr = _tiles_per_expert(P, NUM_Q, BLOCK_P)
        num_tiles = NUM_EXPERTS * TILES_PER_EXPERT
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, BLOCK_Q, 16])
        num_progs = gl.num_programs(0)
        start = gl.program_id(0)
        stride = num_progs
        count = 0
        buf = c_smem
        if PINGPONG:
            start += PARITY * num_progs
            stride = 2 * num_progs
            buf = c_smem.index(PARITY)
            if PARITY == 1:  # the other warpgroup's first tile comes first in the ring
                first0, end0 = _tile_rows(row_offsets_ptr, gl.program_id(0), num_tiles,
                                          TILES_PER_EXPERT)
                count = (end0 - first0 + BLOCK_K - 1) // BLOCK_K
        turns = 0
        for tile in range(start, num_tiles, stride):
            first, end = _tile_rows(row_offsets_ptr, tile, num_tiles, TILES_PER_EXPERT)
            out_row, p0, q0 = _tile_origin(tile, P, NUM_Q, TILES_PER_EXPERT, BLOCK_P, BLOCK_Q)
            steps = (end - first + BLOCK_K - 1) // BLOCK_K
            if PINGPONG:  # the other warpgroup has issued every earlier step's MMA
                mbarrier.wait(turn.index(PARITY), (turns & 1) ^ (1 - PARITY))
                turns += 1
            acc = gl.zeros([BLOCK_P, BLOCK_Q], gl.float32, acc_layout)
            for k in range(steps):
                stage = count % STAGES
                mbarrier.wait(bars.index(stage), (count // STAGES) & 1)
                acc = warpgroup_mma(a_bufs.index(stage).permute((1, 0)), b_bufs.index(stage),
                                    acc, is_async=True)
                # the previous step's MMA is done: its stage goes back to the producer
                acc = warpgroup_mma_wait(1, deps=(acc,))
                mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), pred=k > 0)
                count += 1
            if PINGPONG:
                mbarrier.arrive(turn.index(1 - PARITY))
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), pred=steps > 0)
            if PINGPONG:  # the other warpgroup's next tile, whose steps come next
                o_first, o_end = _tile_rows(row_offsets_ptr, tile + num_progs, num_tiles,
                                            TILES_PER_EXPERT)
                count += (o_end - o_first + BLOCK_K - 1) // BLOCK_K
            # The previous tile's store has read the buffer (the wait is per issuing thread:
            # the barrier publishes it to every thread of the partition).
            tma.store_wait(0)
            gl.thread_barrier()
            buf.store(acc.to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()
            _store_tile(o_desc, buf, out_row, p0, q0, P, BLOCK_P, BLOCK_Q)
        tma.store_wait(0)

    @gluon.jit
    def _ws_load_tiles(a_bufs, b_bufs, bars, empty, a_desc, b_src, row_offsets_ptr,
                       b_rows_ptr, padded_offsets_ptr, shift, i, qq, P: gl.constexpr,
                       Q: gl.constexpr, NUM_EXPERTS: gl.constexpr, BLOCK_K: gl.constexpr,
                       BLOCK_P: gl.constexpr, BLOCK_Q: gl.constexpr, STAGES: gl.constexpr,
                       GATHER: gl.constexpr, ORDERED: gl.constexpr, sync_ptr,
                       LOCKSTEP: gl.constexpr):
        """The producer's walk over the program's tiles (:func:`_ws_producer`): A by TMA, and
        B by TMA from ``b_src``, or with ``GATHER`` B's rows by ``cp.async`` (``i`` / ``qq``
        their row and column lanes) from the table's addresses plus ``shift`` (loaded one step
        ahead), or with ``ORDERED`` too from ``shift + row * 2Q`` (rows in activation order,
        no table). Gathered rows at or past the expert's end and null addresses are
        zero-filled. With ``LOCKSTEP`` (``sync_ptr``: a zeroed int32 counter) every program
        starts a wave's loads once all have issued the previous wave's
        (:func:`~distmoe.kernels.base.gluon.lockstep_before_tile`)."""
        NUM_Q: gl.constexpr = (Q + BLOCK_Q - 1) // BLOCK_Q
        TILES_PER_EXPERT: gl.constexpr = _tiles_per_expert(P, NUM_Q, BLOCK_P)
        num_tiles = NUM_EXPERTS * TILES_PER_EXPERT
        if GATHER:
            nbytes: gl.constexpr = a_desc.block_type.nbytes
        else:
            nbytes: gl.constexpr = a_desc.block_type.nbytes + b_src.block_type.nbytes
        count = 0
        in_step = gl.to_tensor(True)  # until a wait misses its bound (a program not resident)
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            in_step = lockstep_before_tile(sync_ptr, in_step, tile, num_tiles, LOCKSTEP)
            first, end = _tile_rows(row_offsets_ptr, tile, num_tiles, TILES_PER_EXPERT)
            _row, p0, q0 = _tile_origin(tile, P, NUM_Q, TILES_PER_EXPERT, BLOCK_P, BLOCK_Q)
            if GATHER and not ORDERED:  # the table's entry of row `first`, the first addresses
                table = b_rows_ptr + gl.load(padded_offsets_ptr + tile // TILES_PER_EXPERT)
                src = gl.load(table + i, mask=first + i < end, other=0)
            for row in range(first, end, BLOCK_K):
                if GATHER:
                    if ORDERED:
                        live = row + i < end
                        cur = gl.where(live, (row + i).to(gl.int64) * (2 * Q), 0)
                    else:  # this step's addresses; the next step's are loaded meanwhile
                        cur = src
                        ahead = row + BLOCK_K
                        src = gl.load(table + (ahead - first) + i, mask=ahead + i < end,
                                      other=0)
                        live = cur != 0
                stage = count % STAGES
                mbarrier.wait(empty.index(stage), ((count // STAGES) & 1) ^ 1)
                bar = bars.index(stage + STAGES * (row + BLOCK_K > end).to(gl.int32))
                mbarrier.expect(bar, nbytes)
                tma.async_copy_global_to_shared(a_desc, [row, p0], bar, a_bufs.index(stage))
                if GATHER:
                    rows = gl.multiple_of((cur + shift).to(gl.pointer_type(gl.bfloat16)), 16)
                    ptrs = gl.expand_dims(rows, 1) + gl.expand_dims(q0 + qq, 0)
                    read = gl.expand_dims(live, 1) & gl.expand_dims(qq >= 0, 0)
                    async_copy.async_copy_global_to_shared(b_bufs.index(stage), ptrs, read)
                    # arrives when this thread's copies have landed (counted in bars[s])
                    async_copy.mbarrier_arrive(bars.index(stage), increment_count=False)
                else:
                    tma.async_copy_global_to_shared(b_src, [row, q0], bar, b_bufs.index(stage))
                count += 1
            if LOCKSTEP:
                lockstep_tile_done(sync_ptr)

    @gluon.jit
    def _ws_producer(a_bufs, b_bufs, c_smem, bars, empty, o_desc, row_offsets_ptr,
                     b_desc, b_base, b_offset_ptr, b_rows_ptr, padded_offsets_ptr, b_shift,
                     P: gl.constexpr, Q: gl.constexpr, NUM_EXPERTS: gl.constexpr,
                     B_OFFSET: gl.constexpr, GATHER_B: gl.constexpr, B_LAYOUT: gl.constexpr,
                     BLOCK_K: gl.constexpr,
                     BLOCK_P: gl.constexpr, BLOCK_Q: gl.constexpr, STAGES: gl.constexpr,
                     NUM_WARPS: gl.constexpr, a_desc, GATHER_WARPS: gl.constexpr, sync_ptr,
                     LOCKSTEP: gl.constexpr):
        """One warp (``GATHER_WARPS``): the loads of every row step of the program's tiles,
        each once the consumer has released its stage (:func:`_ws_load_tiles`). A whole step
        completes the stage's barrier ``bars[s]`` itself; a partial one completes
        ``bars[STAGES + s]``, which the zeroing partition waits for before it completes
        ``bars[s]``.

        With ``GATHER_B`` only A comes by TMA; B's rows are copied by ``cp.async`` from the
        addresses in ``b_rows_ptr`` (by padded row, shifted by ``b_shift + 2 * b_offset[0]``
        bytes; rows at or past the expert's end and null addresses are zero-filled), or, where
        the device switch ``b_offset[1]`` is nonzero, from rows in activation order (the table
        unread), and every thread's ``cp.async.mbarrier.arrive.noinc`` counts in ``bars[s]``.
        The partition then has ``GATHER_WARPS`` warps, each instruction of a warp copying whole
        128-byte lines of 4 rows, and each step's table addresses are loaded one step ahead
        (within the tile), so that the copies do not wait on that load. The two ways are two
        walks behind a branch on the switch (one walk selecting per step spilled)."""
        if GATHER_B:
            # 16 bytes per thread; a warp covers 4 rows x 64 columns (a whole line of each row)
            CP: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [GATHER_WARPS, 1], [1, 0])
            i = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, CP))
            qq = gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(0, CP))
            shift = b_shift + 2 * gl.load(b_offset_ptr)
            in_order = gl.load(b_offset_ptr + 1)  # 0, or the table's origin: rows in order
            if in_order != 0:
                _ws_load_tiles(a_bufs, b_bufs, bars, empty, a_desc, a_desc, row_offsets_ptr,
                               b_rows_ptr, padded_offsets_ptr, shift + in_order, i, qq, P, Q,
                               NUM_EXPERTS, BLOCK_K, BLOCK_P, BLOCK_Q, STAGES, True, True,
                               sync_ptr, False)
            else:
                _ws_load_tiles(a_bufs, b_bufs, bars, empty, a_desc, a_desc, row_offsets_ptr,
                               b_rows_ptr, padded_offsets_ptr, shift, i, qq, P, Q,
                               NUM_EXPERTS, BLOCK_K, BLOCK_P, BLOCK_Q, STAGES, True, False,
                               sync_ptr, False)
            async_copy.wait_group(0)
        else:
            b_src = _b_source(b_desc, b_base, b_offset_ptr, row_offsets_ptr, Q, NUM_EXPERTS,
                              B_OFFSET, B_LAYOUT, BLOCK_K, BLOCK_Q)
            _ws_load_tiles(a_bufs, b_bufs, bars, empty, a_desc, b_src, row_offsets_ptr,
                           b_rows_ptr, padded_offsets_ptr, b_shift, 0, 0, P, Q, NUM_EXPERTS,
                           BLOCK_K, BLOCK_P, BLOCK_Q, STAGES, False, False, sync_ptr,
                           LOCKSTEP)

    @gluon.jit
    def _ws_zeroer(a_bufs, b_bufs, c_smem, bars, empty, o_desc, row_offsets_ptr,
                   b_desc, b_base, b_offset_ptr, b_rows_ptr, padded_offsets_ptr, b_shift,
                   P: gl.constexpr, Q: gl.constexpr, NUM_EXPERTS: gl.constexpr,
                   B_OFFSET: gl.constexpr, GATHER_B: gl.constexpr, B_LAYOUT: gl.constexpr,
                   BLOCK_K: gl.constexpr,
                   BLOCK_P: gl.constexpr, BLOCK_Q: gl.constexpr, STAGES: gl.constexpr,
                   NUM_WARPS: gl.constexpr, ZERO_WARPS: gl.constexpr):
        """``ZERO_WARPS`` warps: each tile's partial last step, once loaded, gets its rows past the
        expert's end zeroed in both operands (they belong to the next expert, are stale, or
        are TMA zeros, and NaN must not reach the sum); then its stage goes to the consumer.
        ``bars[STAGES + s]`` completes only for partial steps, so its phases are tracked per
        stage (bit ``s`` of ``phases``)."""
        NUM_Q: gl.constexpr = (Q + BLOCK_Q - 1) // BLOCK_Q
        TILES_PER_EXPERT: gl.constexpr = _tiles_per_expert(P, NUM_Q, BLOCK_P)
        num_tiles = NUM_EXPERTS * TILES_PER_EXPERT
        count = 0
        phases = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            first, end = _tile_rows(row_offsets_ptr, tile, num_tiles, TILES_PER_EXPERT)
            steps = (end - first + BLOCK_K - 1) // BLOCK_K
            live = (end - first) % BLOCK_K
            count += steps
            if live != 0:
                stage = (count - 1) % STAGES
                mbarrier.wait(bars.index(STAGES + stage), (phases >> stage) & 1)
                phases ^= 1 << stage
                _zero_rows_sliced(a_bufs.index(stage), live, BLOCK_K, BLOCK_P, ZERO_WARPS)
                if not GATHER_B:  # gathered B rows past the end arrive zero-filled
                    _zero_rows_sliced(b_bufs.index(stage), live, BLOCK_K, BLOCK_Q, ZERO_WARPS)
                fence_async_shared()
                gl.thread_barrier()  # every thread's stores, before the (one) arrive
                mbarrier.arrive(bars.index(stage))

    @gluon.jit
    def _gluon_wgrad_ws_kernel(
        a_desc, b_desc, b_base, b_offset_ptr, o_desc, row_offsets_ptr,
        b_rows_ptr,  # int64 [R_cap] B row addresses by padded row (GATHER_B), else a placeholder
        padded_offsets_ptr,  # int32 [E + 1] (GATHER_B), else a placeholder
        b_shift,  # int64: bytes from the table's addresses to B's rows, less 2 * b_offset[0]
        sync_ptr,  # int32 [1], zeroed (LOCKSTEP), else a placeholder
        P: gl.constexpr, Q: gl.constexpr, NUM_EXPERTS: gl.constexpr, B_OFFSET: gl.constexpr,
        GATHER_B: gl.constexpr, B_LAYOUT: gl.constexpr, C_LAYOUT: gl.constexpr,
        BLOCK_K: gl.constexpr, BLOCK_P: gl.constexpr, BLOCK_Q: gl.constexpr, STAGES: gl.constexpr,
        ZERO_WARPS: gl.constexpr, PINGPONG: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
        LOCKSTEP: gl.constexpr, num_warps: gl.constexpr,
    ):
        """:func:`_gluon_wgrad_kernel`'s contract and bits, warp-specialised: a one-warp TMA
        producer, a ``ZERO_WARPS``-warp partition zeroing each tile's partial last step off the
        critical path, and the MMA warps (``num_warps``) with no branch in their step loop;
        with ``PINGPONG``, two such warpgroups of ``num_warps`` (4) taking the tiles in turn.

        With ``GATHER_B`` the producer reads B's rows through a table of row addresses instead
        (``cp.async``, 16 bytes per thread; rows past the expert's end and null rows zero-filled,
        so the zeroing partition zeroes only A), by ``PRODUCER_WARPS`` warps, each of whose
        threads completes the stage's barrier once its copies have landed.

        With ``LOCKSTEP`` (B by TMA only) the producers start each wave of tiles together,
        counting their issued tiles in ``sync_ptr``."""
        a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, BLOCK_P], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, BLOCK_Q], B_LAYOUT)
        if PINGPONG:
            c_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_P, BLOCK_Q], C_LAYOUT)
        else:
            c_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_P, BLOCK_Q], C_LAYOUT)
        # bars[s]: stage s ready for the MMAs (a whole step's TMA bytes, or the zeroing
        # partition's arrive); bars[STAGES + s]: a partial step's TMA bytes landed
        bars = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        # with GATHER_B, bars[s] also counts one cp.async arrive per producer thread
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1 + 32 * PRODUCER_WARPS * GATHER_B)
            mbarrier.init(bars.index(STAGES + i), count=1)
            mbarrier.init(empty.index(i), count=1)
        mbarrier.init(turn.index(0), count=1)
        mbarrier.init(turn.index(1), count=1)
        # (the argument lists are written out: a tuple built here loses the constexprs)
        if PINGPONG:
            gl.warp_specialize([
                (_ws_consumer, (a_bufs, b_bufs, c_smem, bars, empty, o_desc, row_offsets_ptr,
                                b_desc, b_base, b_offset_ptr, b_rows_ptr, padded_offsets_ptr,
                                b_shift, P, Q, NUM_EXPERTS, B_OFFSET, GATHER_B,
                                B_LAYOUT, BLOCK_K, BLOCK_P, BLOCK_Q, STAGES, num_warps, turn,
                                PINGPONG, 0)),
                (_ws_consumer, (a_bufs, b_bufs, c_smem, bars, empty, o_desc, row_offsets_ptr,
                                b_desc, b_base, b_offset_ptr, b_rows_ptr, padded_offsets_ptr,
                                b_shift, P, Q, NUM_EXPERTS, B_OFFSET, GATHER_B,
                                B_LAYOUT, BLOCK_K, BLOCK_P, BLOCK_Q, STAGES, num_warps, turn,
                                PINGPONG, 1)),
                (_ws_producer, (a_bufs, b_bufs, c_smem, bars, empty, o_desc, row_offsets_ptr,
                                b_desc, b_base, b_offset_ptr, b_rows_ptr, padded_offsets_ptr,
                                b_shift, P, Q, NUM_EXPERTS, B_OFFSET, GATHER_B,
                                B_LAYOUT, BLOCK_K, BLOCK_P, BLOCK_Q, STAGES, num_warps,
                                a_desc, PRODUCER_WARPS, sync_ptr, LOCKSTEP)),
                (_ws_zeroer, (a_bufs, b_bufs, c_smem, bars, empty, o_desc, row_offsets_ptr,
                              b_desc, b_base, b_offset_ptr, b_rows_ptr, padded_offsets_ptr,
                              b_shift, P, Q, NUM_EXPERTS, B_OFFSET, GATHER_B,
                              B_LAYOUT, BLOCK_K, BLOCK_P, BLOCK_Q, STAGES, num_warps,
                              ZERO_WARPS)),
            ], [num_warps, PRODUCER_WARPS, ZERO_WARPS], [232, 48 if GATHER_B else 40, 48])
        else:
            gl.warp_specialize([
                (_ws_consumer, (a_bufs, b_bufs, c_smem, bars, empty, o_desc, row_offsets_ptr,
                                b_desc, b_base, b_offset_ptr, b_rows_ptr, padded_offsets_ptr,
                                b_shift, P, Q, NUM_EXPERTS, B_OFFSET, GATHER_B,
                                B_LAYOUT, BLOCK_K, BLOCK_P, BLOCK_Q, STAGES, num_warps, turn,
                                PINGPONG, 0)),
                (_ws_producer, (a_bufs, b_bufs, c_smem, bars, empty, o_desc, row_offsets_ptr,
                                b_desc, b_base, b_offset_ptr, b_rows_ptr, padded_offsets_ptr,
                                b_shift, P, Q, NUM_EXPERTS, B_OFFSET, GATHER_B,
                                B_LAYOUT, BLOCK_K, BLOCK_P, BLOCK_Q, STAGES, num_warps,
                                a_desc, PRODUCER_WARPS, sync_ptr, LOCKSTEP)),
                (_ws_zeroer, (a_bufs, b_bufs, c_smem, bars, empty, o_desc, row_offsets_ptr,
                              b_desc, b_base, b_offset_ptr, b_rows_ptr, padded_offsets_ptr,
                              b_shift, P, Q, NUM_EXPERTS, B_OFFSET, GATHER_B,
                              B_LAYOUT, BLOCK_K, BLOCK_P, BLOCK_Q, STAGES, num_warps,
                              ZERO_WARPS)),
            ], [PRODUCER_WARPS, ZERO_WARPS], [48 if GATHER_B else 40, 48])


def gluon_wgrad_supported(a: torch.Tensor, out: torch.Tensor, block_p: int,
                          block_q: int) -> str | None:
    """``None`` when :func:`launch_gluon_wgrad` can run this case, else why not (a sentence):
    Gluon present, a CUDA device of compute capability 9.x, not the interpreter, bf16 output
    overwritten (TMA store: contiguous, 16-byte aligned, 16-byte row pitch), ``P`` a multiple
    of 8 (A's TMA row pitch; an expert's last row block may be partial: it is stored through
    an ``[E, P, Q]`` view that TMA clips at ``P``)."""
    reason = gluon_device_reason(out.device)
    if reason is not None:
        return reason
    width_p, width_q = out.shape[1], out.shape[2]
    if out.dtype != torch.bfloat16 or not out.is_contiguous() or out.data_ptr() % 16 \
            or (width_q * 2) % 16:
        return "out must be contiguous bf16 with a 16-byte aligned base and row pitch"
    if width_p % 8:
        return f"P ({width_p}) must be a multiple of 8 (A's rows by TMA)"
    if a.shape[0] >= 2**31:
        return "more than 2**31 activation rows"
    return None


def gluon_gather_reason(specialized: bool, width_q: int, block_q: int) -> str | None:
    """``None`` when the Gluon WGRAD can read B's rows by address (``b_rows``): only its
    warp-specialised form, with ``Q`` a multiple of ``block_q``; else why not."""
    if not specialized or width_q % block_q:
        return (f"b_rows needs specialized=True and Q a multiple of block_q, got "
                f"specialized={specialized}, Q={width_q}, block_q={block_q}")
    return None


def launch_gluon_wgrad(a: torch.Tensor, b: torch.Tensor, row_offsets: torch.Tensor,
                       out: torch.Tensor, *, b_offset: torch.Tensor | None = None,
                       block_p: int = 128, block_q: int = 256, stages: int = 3,
                       num_warps: int = 8, block_k: int = 64,
                       programs: int | None = None, specialized: bool = False,
                       pingpong: bool = False, b_rows: torch.Tensor | None = None,
                       padded_offsets: torch.Tensor | None = None,
                       b_rows_origin: int = 0, lockstep: bool = False) -> None:
    """Launch the persistent Gluon WGRAD (overwrite mode; arguments validated by the caller,
    :func:`gluon_wgrad_supported` returned ``None``): ``out[e] = a[rows_e]^T @ b[rows_e]``.

    Args:
        a: bf16 ``[R_act, P]``.
        b: bf16 ``[R_act, Q]``, or a 1-D bf16 base with ``b_offset``.
        row_offsets: int32 ``[E + 1]`` on the device.
        out: bf16 ``[E, P, Q]``.
        b_offset: int64 ``[1]`` device element offset of ``b``'s row 0 (a multiple of 8).
        block_p / block_q / stages / num_warps / block_k: one of :data:`GLUON_WGRAD_CONFIGS`.
        programs: grid size; default one per SM (at most one per tile). Tests pass fewer, so
            that every program walks several tiles.
        specialized: the warp-specialised kernel (:func:`_gluon_wgrad_ws_kernel`: the
            partial steps zeroed by their own warps; the same bits).
        pingpong: with ``specialized``, ``num_warps`` 4 and ``block_p`` 128: two MMA
            warpgroups take the program's tiles in turn, one's epilogue under the other's
            MMAs (the same bits).
        b_rows: with ``specialized`` and ``b_offset`` (then int64 ``[2]``): int64
            ``[R_cap]`` byte addresses of B's rows by padded row (0 = a null row, zeros),
            relative to ``b_rows_origin``: activation row ``a`` of expert ``e`` reads the row
            at byte address ``b + 2*b_offset[0] + b_rows[padded_offsets[e] + a -
            row_offsets[e]] - b_rows_origin`` (16-byte aligned), by ``cp.async`` (the same
            bits as B's rows stored in order); where ``b_offset[1]`` (0 or
            ``b_rows_origin``) is nonzero, the row at ``b + 2*b_offset[0] + a*2Q`` instead
            (rows stored in order, the table unread).
        padded_offsets: int32 ``[E + 1]`` on the device, with ``b_rows``.
        b_rows_origin: an int, with ``b_rows``.
        lockstep: with ``specialized`` and B loaded by TMA (no ``b_rows``): the producers
            start each wave of tiles together (:attr:`~distmoe.kernels.w2_dgrad.triton.
WgradConfig.lockstep`; a zeroed int32 counter is allocated per launch; the same bits).
    """
    if pingpong and (not specialized or num_warps != 4 or block_p != 128):
        raise ValueError(f"pingpong needs specialized=True, num_warps == 4 and block_p == 128, "
                         f"got {specialized}, {num_warps} and {block_p}")
    if lockstep and (not specialized or b_rows is not None):
        raise ValueError(f"lockstep needs specialized=True and B loaded by TMA (no b_rows), "
                         f"got specialized={specialized} and "
                         f"{'a' if b_rows is not None else 'no'} b_rows")

    gather = b_rows is not None
    if gather:
        reason = gluon_gather_reason(specialized, out.shape[2], block_q)
        if reason is None and (b_offset is None or padded_offsets is None):
            reason = (f"b_rows needs b_offset and padded_offsets, got "
                      f"{'a' if b_offset is not None else 'no'} b_offset and "
                      f"{'' if padded_offsets is not None else 'no '}padded_offsets")
        if reason is not None:
            raise ValueError(reason)
    num_experts, width_p, width_q = out.shape
    num_act_rows = a.shape[0]
    a_layout = shared_layout((block_k, block_p))
    b_layout = shared_layout((block_k, block_q))
    o_layout = shared_layout((block_p, block_q))
    a_desc = GluonDescriptor(a, [num_act_rows, width_p], [width_p, 1], [block_k, block_p],
                             a_layout)
    if b_offset is None:
        b_desc = GluonDescriptor(b, [num_act_rows, width_q], [width_q, 1], [block_k, block_q],
                                 b_layout)
        b_base, b_off = row_offsets, row_offsets  # placeholders, never read
    else:
        b_desc = a_desc  # placeholder, never read
        b_base, b_off = b, b_offset
        ensure_tma_allocator()
    if width_p % block_p:  # [E, P, Q]: TMA clips each expert's last row block at P
        o_desc = GluonDescriptor(
            out, [num_experts, width_p, width_q], [width_p * width_q, width_q, 1],
            [1, block_p, block_q],
            shared_layout((1, block_p, block_q)))
    else:
        o_desc = GluonDescriptor(out.view(num_experts * width_p, width_q),
                                 [num_experts * width_p, width_q], [width_q, 1],
                                 [block_p, block_q], o_layout)
    tiles = num_experts * triton.cdiv(width_p, block_p) * triton.cdiv(width_q, block_q)
    if programs is None:
        programs = num_sms(out.device)
    kernel, extra = _gluon_wgrad_kernel, {}
    if specialized:
        if block_q > 128:  # its m64n256 MMAs spill at ws_maxnreg(8) (sm_90 build)
            raise ValueError(f"specialized needs block_q <= 128, got {block_q}")
        kernel = _gluon_wgrad_ws_kernel
        extra = {"maxnreg": ws_maxnreg(num_warps, pingpong, gather),
                 "ZERO_WARPS": WS_ZERO_WARPS, "PINGPONG": pingpong, "GATHER_B": gather,
                 "PRODUCER_WARPS": WS_GATHER_WARPS if gather else 1, "LOCKSTEP": lockstep}
    with device_context(out.device):
        table_args = ((b_rows, padded_offsets, b.data_ptr() - b_rows_origin) if gather
                      else (row_offsets, row_offsets, 0))  # placeholders, never read
        kernel[(max(1, min(programs, tiles)),)](
            a_desc, b_desc, b_base, b_off, o_desc, row_offsets,
            *((*table_args, lockstep_counter(lockstep, row_offsets)) if specialized else ()),
            P=width_p, Q=width_q, NUM_EXPERTS=num_experts, B_OFFSET=b_offset is not None,
            B_LAYOUT=b_layout, C_LAYOUT=o_layout, BLOCK_K=block_k, BLOCK_P=block_p,
            BLOCK_Q=block_q, STAGES=stages, num_warps=num_warps, **extra,
        )  # fmt: skip
