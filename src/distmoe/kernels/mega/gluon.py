"""Gather + W13 + SwiGLU and the W2 row scatter in one warp-specialised Gluon kernel (Hopper).

Why: at EP > 1 the W2 stores the rows of peer-owned routes into the peers over NVLink and is
bound by the link, while the link idles during W13; a W2 on a side stream on part of the SMs
costs W13 more than the spread-out stores save (evidence: docs/performance.md). Here one
program per SM takes the tiles of both GEMMs from one schedule
(:func:`~distmoe.kernels.base.tiles.fused_tile`): period ``p`` holds W13's tiles of row-block
group ``p`` (``group_m`` blocks of 128 padded rows), then W2's tiles of group ``p - lag``. A
W2 tile starts once every W13 tile of its 128 rows has stored its h2 rows: the W13 tiles
count ``done`` up (release, GPU scope; :func:`~distmoe.kernels.base.gluon.arrive_block`),
the producer of the W2 tile spins until the count is reached (acquire) and fences the async
proxy before its TMA loads (:func:`~distmoe.kernels.base.gluon.wait_block`). So the W2's
stores run beside the W13 tiles of later groups on every SM, and W13 keeps every SM.

Both GEMMs share one ring: a stage holds 128 A rows and ``2 block_n`` weight rows of 64
columns, for W13 the gathered rows (16-byte ``cp.async``, as
:mod:`~distmoe.kernels.w13_forward.gluon`) and the gate and up tiles, for W2 the h2 rows and a W2
tile of ``2 block_n`` output columns (both by TMA). The accumulator has the same shape in
both (``[rows, 2 block_n]`` fp32), only the K loop's length (D / 64 or F / 64) and the
epilogue differ:

* ``warps`` 8, cooperative (``block_n`` 128): both consumer warpgroups on every tile, 64
  rows each; W13 tiles of 128 x 128 h2 columns, W2 tiles of 128 x 256 output columns;
* ``warps`` 4, ping-pong (``block_n`` 64): the consumers take the program's tiles in turn;
  W13 tiles of 128 x 64 h2 columns, W2 tiles of 128 x 128.

Which program runs a position: by default the static round robin (position ``t`` on
program ``t mod G``); with ``dynamic`` the producer of each program takes its next position
from a counter (a relaxed atomic during its current tile's first K step) and passes it to
both consumers through a 4-slot ring in shared memory with its own mbarriers. Either way a
program runs its positions in increasing order, so the unfinished position that comes first
can always run (its W13 tiles came earlier): the waits cannot deadlock.

Every program must be resident at once (a W2 tile waits for W13 tiles of other programs):
one program per SM at most, and no other kernel that holds SMs for long beside it (ranks
sharing a GPU do not use it: :class:`~distmoe.ops.context.MoEContext` refuses it there).
Inference only: no h1, no saved rows, no ``enable``. The results are bit for bit those of
:func:`~distmoe.kernels.w13_forward.triton.gather_w13_swiglu` then
:func:`~distmoe.kernels.w2_forward.triton.w2_scatter` with the Gluon configs of the same tiles
(same MMAs in the same order per tile).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distmoe.kernels.base.checks import check_block_counters, check_gather_r_cap, check_tensor
from distmoe.kernels.base.config import next_power_of_2
from distmoe.kernels.base.device import device_context, num_sms
from distmoe.kernels.base.gluon import HAVE_GLUON, gluon_device_reason, shared_layout
from distmoe.kernels.w2_forward.triton import check_w2_args
from distmoe.kernels.w13_forward.gluon import done_count
from distmoe.kernels.w13_forward.triton import check_w13_args

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
        arrive_block,
        block_info,
        bounds_layout,
        expert_bounds,
        handoff_barriers,
        program_tiles,
        ring_barriers,
        tile_count,
        wait_block,
        wait_turn,
    )
    from distmoe.kernels.base.tiles import column_halves, fused_tile, swizzle_tile
    from distmoe.kernels.w2_forward.gluon import scatter_tile
    from distmoe.kernels.w13_forward.gluon import swiglu_part

__all__ = ["FusedConfig", "fused_reason", "fused_w13_w2", "stage_bytes"]

#: the kernel's register limit, as :mod:`distmoe.kernels.w13_forward.gluon`: 12 warps; the
#: consumers get 224 registers per thread, the producer warpgroup 56
_MAXNREG = 168
_PRODUCER_THREADS = 128
_RING_BYTES = 200 * 1024
#: slots of the ring through which the producer passes its schedule positions (dynamic)
_IDS = 4
#: padded rows of a row block (a tile's rows in both GEMMs, one ``done`` entry)
BLOCK_M = 128


@dataclass(frozen=True)
class FusedConfig:
    """Tiles and schedule of the fused kernel.

    ``warps`` 4 (ping-pong, ``block_n`` 64) or 8 (cooperative, ``block_n`` 128); ``block_n``
    h2 columns of a W13 tile (a W2 tile has ``2 block_n`` output columns); ``stages`` of the
    shared ring (at most 200 KiB); ``group_m`` row blocks per group; ``lag`` groups between
    a group's W13 tiles and its W2 tiles (>= 1); ``dynamic``: each producer takes its next
    schedule position from a counter at run time, instead of the static round robin
    (position ``t`` on program ``t mod G``).

    The defaults (ping-pong, static, ``lag`` 3) are the fastest of these schedules in an
    EP=2 forward (evidence: docs/performance.md)."""

    block_n: int = 64
    warps: int = 4
    stages: int = 6
    group_m: int = 8
    lag: int = 3
    dynamic: bool = False

    def __post_init__(self) -> None:
        if (self.block_n, self.warps) not in ((128, 8), (64, 4)):
            raise ValueError("FusedConfig (block_n, warps) must be (128, 8) (cooperative) or "
                             f"(64, 4) (ping-pong), got ({self.block_n}, {self.warps})")
        if not isinstance(self.dynamic, bool):
            raise ValueError(f"FusedConfig.dynamic must be a bool, got {self.dynamic!r}")
        for name in ("stages", "group_m", "lag"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"FusedConfig.{name} must be an int >= 1, got {value!r}")
        if self.stages * stage_bytes(self.block_n) > _RING_BYTES:
            raise ValueError(f"FusedConfig.stages ({self.stages}) of {stage_bytes(self.block_n)}"
                             f" bytes exceed the ring's {_RING_BYTES} bytes")

    def done_count(self, ffn: int) -> int:
        """What a ``done`` entry reaches once every W13 tile over its 128 rows has stored
        (:func:`~distmoe.kernels.w13_forward.gluon.done_count`: the fused kernel's W13 tiles
        are that kernel's)."""
        return done_count(ffn, self.block_n, self.warps)


def stage_bytes(block_n: int) -> int:
    """One ring stage: 128 A rows and ``2 block_n`` weight rows of 64 bf16."""
    return (BLOCK_M + 2 * block_n) * 64 * 2


def fused_reason(device: torch.device, *, hidden: int, ffn: int,
                 config: FusedConfig) -> str | None:
    """``None`` when the fused kernel runs this case on ``device``, else why not."""
    reason = gluon_device_reason(device)
    if reason is None and (ffn % config.block_n or ffn % 64 or hidden % (2 * config.block_n)):
        reason = (f"F ({ffn}) must be a multiple of {max(64, config.block_n)} and D ({hidden})"
                  f" of {2 * config.block_n}")
    return reason


if HAVE_GLUON:

    @gluon.jit
    def _fused_info(t, num_pid_m, ends, starts, rbeg, rend, eidx, N13: gl.constexpr,
                    N2: gl.constexpr, GROUP_M: gl.constexpr, LAG: gl.constexpr,
                    NUM_EXPERTS: gl.constexpr):
        """``(is_w2, pid_n, expert, row_start, act_start, num_live)`` of position ``t``."""
        is_w2, idx = fused_tile(t, num_pid_m, N13, N2, GROUP_M, LAG)
        pid_m, pid_n = swizzle_tile(idx, num_pid_m, gl.where(is_w2, N2, N13), GROUP_M)
        pid_n, expert, row_start, act_start, num_live = block_info(
            pid_m, pid_n, ends, starts, rbeg, rend, eidx, NUM_EXPERTS, 128)
        return is_w2, pid_n, expert, row_start, act_start, num_live

    @gluon.jit
    def _first_tile(next_ptr, DYNAMIC: gl.constexpr):
        """The producer's first schedule position: taken from ``next`` (DYNAMIC; relaxed: an
        acquire-release atomic would first wait for the thread's gathers in flight), else the
        program id (the static round robin)."""
        t = gl.program_id(0)
        if DYNAMIC:
            t = gl.atomic_add(next_ptr, 1, sem="relaxed")
        return t

    @gluon.jit
    def _next_tile(ids, t, j, DYNAMIC: gl.constexpr, IDS: gl.constexpr):
        """The producer's ``j``-th position (the one after ``t``): with DYNAMIC read back
        from the id ring, where the producer posted it during ``t``'s first K step (so the
        atomic's latency hides under the stages in flight; holding it in a register across
        the loads made the producer spill), else ``t`` plus the grid."""
        if DYNAMIC:
            L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
            t = gl.max(ids.index(j % IDS).load(L), axis=0)
        else:
            t = t + gl.num_programs(0)
        return t

    @gluon.jit
    def _post_tile(ids, id_ready, id_free, j, t, IDS: gl.constexpr):
        """The producer passes its ``j``-th position ``t`` to both consumers through slot
        ``j % IDS`` of the id ring, once both have read what the slot held before."""
        L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        slot = j % IDS
        mbarrier.wait(id_free.index(slot), ((j // IDS) & 1) ^ 1)
        ids.index(slot).store(gl.full([1], t, gl.int32, L))
        gl.thread_barrier()  # every thread's store, before the (one) arrive releases them
        mbarrier.arrive(id_ready.index(slot))

    @gluon.jit
    def _take_tile(ids, id_ready, id_free, j, next_ptr, t, IDS: gl.constexpr,
                   DYNAMIC: gl.constexpr):
        """A consumer's ``j``-th schedule position: from the id ring (DYNAMIC; the slot goes
        back once read), else the static round robin (``t``: the previous one, or the
        schedule's length before the first, which is then the program id)."""
        if DYNAMIC:
            L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
            slot = j % IDS
            mbarrier.wait(id_ready.index(slot), (j // IDS) & 1)
            t = gl.max(ids.index(slot).load(L), axis=0)
            gl.thread_barrier()  # every thread has read it, before the slot goes back
            mbarrier.arrive(id_free.index(slot))
        else:
            t = gl.where(j == 0, gl.program_id(0), t + gl.num_programs(0))
        return t

    @gluon.jit
    def _producer(w13_desc, w2_desc, h2_desc, a_bufs, b_bufs, ready, empty, turn, ids,
                  id_ready, id_free, gather_ptrs_ptr, padded_offsets_ptr, row_offsets_ptr,
                  h2_ptr, scatter_ptrs_ptr, done_ptr, next_ptr, need, HIDDEN: gl.constexpr,
                  FFN: gl.constexpr,
                  NUM_EXPERTS: gl.constexpr, EXPERTS_POW2: gl.constexpr,
                  GROUP_M: gl.constexpr, LAG: gl.constexpr, STAGES: gl.constexpr,
                  BLOCK_N: gl.constexpr, DYNAMIC: gl.constexpr, IDS: gl.constexpr,
                  COOP: gl.constexpr, PARITY: gl.constexpr):
        """One warpgroup: the loads of every tile of the program, K step by K step."""
        N13: gl.constexpr = FFN // BLOCK_N
        N2: gl.constexpr = HIDDEN // (2 * BLOCK_N)
        CP: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        # the per-expert bounds are loaded per tile (L1 hits), not held across the loop:
        # the producer has 56 registers
        num_pid_m, _n = tile_count(padded_offsets_ptr, NUM_EXPERTS, N13, 128)
        total = num_pid_m * (N13 + N2)
        i = gl.arange(0, 128, layout=gl.SliceLayout(1, CP))
        kk = gl.arange(0, 64, layout=gl.SliceLayout(0, CP))
        w_bytes: gl.constexpr = 2 * w13_desc.block_type.nbytes
        a_bytes: gl.constexpr = h2_desc.block_type.nbytes
        count = 0
        j = 0  # tiles handed to the consumers (the id ring's position)
        t = _first_tile(next_ptr, DYNAMIC)
        if DYNAMIC:
            _post_tile(ids, id_ready, id_free, 0, t, IDS)
        while t < total:
            j += 1  # with DYNAMIC, the next position is posted during this tile's first step
            ends, starts, rbeg, rend, eidx = expert_bounds(
                padded_offsets_ptr, row_offsets_ptr, NUM_EXPERTS, EXPERTS_POW2,
                bounds_layout(EXPERTS_POW2, 4))
            is_w2, pid_n, expert, row_start, act_start, num_live = _fused_info(
                t, num_pid_m, ends, starts, rbeg, rend, eidx, N13, N2, GROUP_M, LAG,
                NUM_EXPERTS)
            if is_w2:
                # every W13 tile of these 128 rows has stored its h2 rows
                wait_block(done_ptr, row_start, need, 128, 4)
                w_row = expert * HIDDEN + pid_n * (2 * BLOCK_N)
                for k in range(FFN // 64):
                    stage = count % STAGES
                    mbarrier.wait(empty.index(stage), ((count // STAGES) & 1) ^ 1)
                    bar = ready.index(stage)
                    b = b_bufs.index(stage)
                    mbarrier.expect(bar, a_bytes + w_bytes)
                    tma.async_copy_global_to_shared(h2_desc, [act_start, k * 64], bar,
                                                    a_bufs.index(stage))
                    tma.async_copy_global_to_shared(w2_desc, [w_row, k * 64], bar,
                                                    b.slice(0, BLOCK_N))
                    tma.async_copy_global_to_shared(w2_desc, [w_row + BLOCK_N, k * 64], bar,
                                                    b.slice(BLOCK_N, BLOCK_N))
                    # the stage's other arrivals (its ready barrier counts every thread)
                    async_copy.mbarrier_arrive(bar, increment_count=False)
                    count += 1
                    if DYNAMIC:
                        if k == 0:  # the next position, while this tile's stages fill
                            _post_tile(ids, id_ready, id_free, j,
                                       gl.atomic_add(next_ptr, 1, sem="relaxed"), IDS)
            else:
                src = gl.load(gather_ptrs_ptr + row_start + i, mask=i < num_live, other=0)
                rows = gl.multiple_of(src.to(gl.pointer_type(gl.bfloat16)), 16)
                ptrs = gl.expand_dims(rows, 1) + gl.expand_dims(kk, 0)
                read = gl.expand_dims(src != 0, 1) & gl.expand_dims(kk >= 0, 0)
                w_row = 2 * expert * FFN + pid_n * BLOCK_N
                for k in range(HIDDEN // 64):
                    stage = count % STAGES
                    mbarrier.wait(empty.index(stage), ((count // STAGES) & 1) ^ 1)
                    bar = ready.index(stage)
                    b = b_bufs.index(stage)
                    mbarrier.expect(bar, w_bytes)
                    tma.async_copy_global_to_shared(w13_desc, [w_row, k * 64], bar,
                                                    b.slice(0, BLOCK_N))
                    tma.async_copy_global_to_shared(w13_desc, [w_row + FFN, k * 64], bar,
                                                    b.slice(BLOCK_N, BLOCK_N))
                    async_copy.async_copy_global_to_shared(a_bufs.index(stage),
                                                           ptrs + k * 64, read)
                    async_copy.mbarrier_arrive(bar, increment_count=False)
                    count += 1
                    if DYNAMIC:
                        if k == 0:
                            _post_tile(ids, id_ready, id_free, j,
                                       gl.atomic_add(next_ptr, 1, sem="relaxed"), IDS)
            t = _next_tile(ids, t, j, DYNAMIC, IDS)
        async_copy.wait_group(0)

    @gluon.jit
    def _consumer(w13_desc, w2_desc, h2_desc, a_bufs, b_bufs, ready, empty, turn, ids,
                  id_ready, id_free, gather_ptrs_ptr, padded_offsets_ptr, row_offsets_ptr,
                  h2_ptr, scatter_ptrs_ptr, done_ptr, next_ptr, need, HIDDEN: gl.constexpr,
                  FFN: gl.constexpr,
                  NUM_EXPERTS: gl.constexpr, EXPERTS_POW2: gl.constexpr,
                  GROUP_M: gl.constexpr, LAG: gl.constexpr, STAGES: gl.constexpr,
                  BLOCK_N: gl.constexpr, DYNAMIC: gl.constexpr, IDS: gl.constexpr,
                  COOP: gl.constexpr, PARITY: gl.constexpr):
        """One warpgroup: the MMAs and epilogues of the program's tiles ``PARITY``,
        ``PARITY + 2``, ... (in the program's own numbering); with ``COOP``, of rows
        ``64 PARITY`` to ``64 PARITY + 63`` of every tile of the program."""
        N13: gl.constexpr = FFN // BLOCK_N
        N2: gl.constexpr = HIDDEN // (2 * BLOCK_N)
        ROWS: gl.constexpr = 64 if COOP else 128
        ROW0: gl.constexpr = PARITY * ROWS if COOP else 0
        ACC: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 2 * BLOCK_N, 16])
        num_pid_m, _n, ends, starts, rbeg, rend, eidx = program_tiles(
            padded_offsets_ptr, row_offsets_ptr, NUM_EXPERTS, EXPERTS_POW2, N13, 128, 4)
        total = num_pid_m * (N13 + N2)
        count = 0
        turns = 0
        local = 0  # the program's own tile numbering (ping-pong: every other one is ours)
        t = _take_tile(ids, id_ready, id_free, local, next_ptr, total, IDS, DYNAMIC)
        while t < total:
            is_w2, pid_n, expert, row_start, act_start, num_live = _fused_info(
                t, num_pid_m, ends, starts, rbeg, rend, eidx, N13, N2, GROUP_M, LAG,
                NUM_EXPERTS)
            nk = gl.where(is_w2, FFN // 64, HIDDEN // 64)
            if ((local % 2) == PARITY) | COOP:
                if not COOP:
                    turns = wait_turn(turn, turns, PARITY)
                acc = gl.zeros([ROWS, 2 * BLOCK_N], gl.float32, ACC)
                c = count
                for k in range(nk):
                    stage = c % STAGES
                    mbarrier.wait(ready.index(stage), (c // STAGES) & 1)
                    acc = warpgroup_mma(a_bufs.index(stage).slice(ROW0, ROWS),
                                        b_bufs.index(stage).permute((1, 0)), acc,
                                        is_async=True)
                    acc = warpgroup_mma_wait(1, deps=(acc,))
                    mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), pred=k > 0)
                    c += 1
                if not COOP:
                    mbarrier.arrive(turn.index(1 - PARITY))
                acc = warpgroup_mma_wait(0, deps=(acc,))
                mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES))
                if is_w2:
                    scatter_tile(acc, scatter_ptrs_ptr, row_start + ROW0, num_live - ROW0,
                                  pid_n * (2 * BLOCK_N), ROWS, 2 * BLOCK_N, HIDDEN)
                else:
                    g, u = column_halves(acc, ROWS, 2 * BLOCK_N)
                    g0, g1 = column_halves(g, ROWS, BLOCK_N)
                    u0, u1 = column_halves(u, ROWS, BLOCK_N)
                    n0 = pid_n * BLOCK_N
                    H: gl.constexpr = BLOCK_N // 2
                    swiglu_part(g0, u0, act_start + ROW0, num_live - ROW0, n0, h2_ptr,
                                 h2_ptr, 0, FFN, False, ROWS, H)
                    swiglu_part(g1, u1, act_start + ROW0, num_live - ROW0, n0 + H, h2_ptr,
                                 h2_ptr, 0, FFN, False, ROWS, H)
                    arrive_block(done_ptr, row_start, 128, 4)
            count += nk
            local += 1
            t = _take_tile(ids, id_ready, id_free, local, next_ptr, t, IDS, DYNAMIC)

    @gluon.jit
    def _fused_kernel(
        w13_desc,  # w13 viewed [2 E F, D], block [BLOCK_N, 64]
        w2_desc,  # w2 viewed [E D, F], block [BLOCK_N, 64]
        h2_desc,  # h2 [R_act, F], block [128, 64]
        gather_ptrs_ptr,  # int64 [R_cap]
        padded_offsets_ptr,  # int32 [E + 1]
        row_offsets_ptr,  # int32 [E + 1]
        h2_ptr,  # bf16 [R_act, F]
        scatter_ptrs_ptr,  # int64 [R_cap]
        done_ptr,  # int32 [R_cap / 128], zero
        next_ptr,  # int32 [1], zero: the next schedule position to hand out (DYNAMIC)
        need,  # what a done entry reaches
        HIDDEN: gl.constexpr,
        FFN: gl.constexpr,
        NUM_EXPERTS: gl.constexpr,
        EXPERTS_POW2: gl.constexpr,
        GROUP_M: gl.constexpr,
        LAG: gl.constexpr,
        STAGES: gl.constexpr,
        BLOCK_N: gl.constexpr,
        DYNAMIC: gl.constexpr,
        IDS: gl.constexpr,
        PRODUCER_THREADS: gl.constexpr,
        COOP: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 128, 64], h2_desc.layout)
        b_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 2 * BLOCK_N, 64],
                                           w13_desc.layout)
        ready, empty, turn = ring_barriers(STAGES, 1 + PRODUCER_THREADS, 2 if COOP else 1)
        # DYNAMIC: the positions the producer takes, passed on to both consumers
        ids = gl.allocate_shared_memory(gl.int32, [IDS, 1],
                                        gl.SwizzledSharedLayout(1, 1, 1, [0]))
        id_ready, id_free = handoff_barriers(IDS, 1, 2)
        gl.warp_specialize([
            (_consumer, (w13_desc, w2_desc, h2_desc, a_bufs, b_bufs, ready, empty, turn, ids,
                         id_ready, id_free, gather_ptrs_ptr, padded_offsets_ptr,
                         row_offsets_ptr, h2_ptr, scatter_ptrs_ptr, done_ptr, next_ptr, need,
                         HIDDEN, FFN, NUM_EXPERTS, EXPERTS_POW2, GROUP_M, LAG, STAGES, BLOCK_N,
                         DYNAMIC, IDS, COOP, 0)),
            (_consumer, (w13_desc, w2_desc, h2_desc, a_bufs, b_bufs, ready, empty, turn, ids,
                         id_ready, id_free, gather_ptrs_ptr, padded_offsets_ptr,
                         row_offsets_ptr, h2_ptr, scatter_ptrs_ptr, done_ptr, next_ptr, need,
                         HIDDEN, FFN, NUM_EXPERTS, EXPERTS_POW2, GROUP_M, LAG, STAGES, BLOCK_N,
                         DYNAMIC, IDS, COOP, 1)),
            (_producer, (w13_desc, w2_desc, h2_desc, a_bufs, b_bufs, ready, empty, turn, ids,
                         id_ready, id_free, gather_ptrs_ptr, padded_offsets_ptr,
                         row_offsets_ptr, h2_ptr, scatter_ptrs_ptr, done_ptr, next_ptr, need,
                         HIDDEN, FFN, NUM_EXPERTS, EXPERTS_POW2, GROUP_M, LAG, STAGES, BLOCK_N,
                         DYNAMIC, IDS, COOP, 0)),
        ], [4, PRODUCER_THREADS // 32], [224, 56])


def fused_w13_w2(gather_ptrs: torch.Tensor, padded_offsets: torch.Tensor,
                 row_offsets: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 h2: torch.Tensor, scatter_ptrs: torch.Tensor, counters: torch.Tensor, *,
                 config: FusedConfig | None = None, programs: int | None = None) -> None:
    """Gather + W13 + SwiGLU into ``h2``, then W2 of those rows to their scatter addresses,
    in one launch (module docstring).

    Args:
        gather_ptrs, padded_offsets, row_offsets, w13: as
            :func:`~distmoe.kernels.w13_forward.triton.gather_w13_swiglu` (padding multiple
            128).
        w2, scatter_ptrs: as :func:`~distmoe.kernels.w2_forward.triton.w2_scatter`
            (``scatter_ptrs`` int64 ``[R_cap]``, the same ``R_cap``).
        h2: bf16 ``[R_act, F]``: the SwiGLU rows, written by the W13 tiles and read by the
            W2 tiles (``R_act >= row_offsets[E]``).
        counters: int32 ``[R_cap / 128 + 1]`` on the device, **zero on entry** (the caller
            zeroes it on the same stream): entry ``b`` counts the stored W13 tiles of row
            block ``b`` (``done``), the last one hands out schedule positions with
            ``config.dynamic``. The call leaves :meth:`FusedConfig.done_count` in each
            entry of its row blocks.
        config: tiles, ring and schedule (default :class:`FusedConfig`).
        programs: the grid (default one program per SM; never more than the SMs, since a
            W2 tile waits for W13 tiles of other programs).

    Raises ValueError / TypeError for bad arguments, and ValueError where the kernel cannot
    run (:func:`fused_reason`), before any launch.
    """
    if config is None:
        config = FusedConfig()
    elif not isinstance(config, FusedConfig):
        raise TypeError(f"config must be a FusedConfig, got {type(config).__name__}")
    r_cap, num_experts, ffn, hidden = check_w13_args(
        gather_ptrs, padded_offsets, row_offsets, w13, h2, None, None, None, None,
        for_kernel=True)
    r_cap2, _r_act, e2, d2, f2 = check_w2_args(h2, padded_offsets, row_offsets, w2,
                                                scatter_ptrs, None, for_kernel=True)
    if (e2, d2, f2) != (num_experts, hidden, ffn) or r_cap2 != r_cap:
        raise ValueError(
            f"w2 must have shape [E_local={num_experts}, D={hidden}, F={ffn}] and scatter_ptrs "
            f"[R_cap={r_cap}] (from w13 and gather_ptrs), got {list(w2.shape)} and "
            f"[{r_cap2}]")
    check_gather_r_cap(r_cap, BLOCK_M)
    check_tensor("counters", counters, dtypes=(torch.int32,), shape=[r_cap // BLOCK_M + 1],
                 shape_text="[R_cap / 128 + 1] (one counter per 128 padded rows, then the "
                 "next schedule position)")
    if counters.device != gather_ptrs.device:
        raise ValueError(f"counters must be on {gather_ptrs.device}, got {counters.device}")
    check_block_counters("done", None, r_cap, gather_ptrs.device, programs)
    device = gather_ptrs.device
    reason = fused_reason(device, hidden=hidden, ffn=ffn, config=config)
    if reason is not None:
        raise ValueError(f"the fused W13 + W2 kernel cannot run here: {reason}")
    sms = num_sms(device)
    if programs is not None and programs > sms:
        raise ValueError(f"programs must be at most the SMs ({sms}): every program must be "
                         f"resident at once, got {programs}")
    bn = config.block_n
    w_layout = shared_layout((bn, 64))
    a_layout = shared_layout((BLOCK_M, 64))
    w13_desc = GluonDescriptor(w13.view(2 * num_experts * ffn, hidden),
                               [2 * num_experts * ffn, hidden], [hidden, 1], [bn, 64], w_layout)
    w2_desc = GluonDescriptor(w2.view(num_experts * hidden, ffn), [num_experts * hidden, ffn],
                              [ffn, 1], [bn, 64], w_layout)
    h2_desc = GluonDescriptor(h2, list(h2.shape), [ffn, 1], [BLOCK_M, 64], a_layout)
    tiles = (r_cap // BLOCK_M) * (ffn // bn + hidden // (2 * bn))
    grid = max(1, min(sms if programs is None else programs, tiles))
    with device_context(device):
        _fused_kernel[(grid,)](
            w13_desc, w2_desc, h2_desc, gather_ptrs, padded_offsets, row_offsets, h2,
            scatter_ptrs, counters[:-1], counters[-1:], config.done_count(ffn),
            HIDDEN=hidden, FFN=ffn, NUM_EXPERTS=num_experts,
            EXPERTS_POW2=max(32, next_power_of_2(num_experts)), GROUP_M=config.group_m,
            LAG=config.lag, STAGES=config.stages, BLOCK_N=bn, DYNAMIC=config.dynamic,
            IDS=_IDS,
            PRODUCER_THREADS=_PRODUCER_THREADS, COOP=config.warps == 8, num_warps=4,
            maxnreg=_MAXNREG,
        )  # fmt: skip
