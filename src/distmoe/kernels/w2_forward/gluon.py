"""W2 forward with a row-scatter epilogue for Hopper as a warp-specialised Gluon kernel.

Same contract as :func:`distmoe.kernels.w2_forward.triton.w2_scatter` (its module docstring defines
the row numberings, ``scatter_ptrs`` and ``enable``): for every live padded row ``r`` of
expert ``e`` with activation row ``a``, ``h3 = h2[a] @ w2[e]^T`` (fp32 accumulation, rounded
to bf16) is stored at the byte address ``scatter_ptrs[r]`` (0: not stored). That function
launches this kernel when its config asks for it (``W2Config.gluon``) and
:func:`gluon_w2_reason` returns ``None``.

Why: the Triton kernel (128 x 256 tiles, two warpgroups) runs each tile's epilogue, 64 KiB of
row stores that may cross NVLink, between its last MMA and the next tile's first in the same
warps, so the tensor cores wait for the stores (evidence: docs/performance.md). Here each
program (one per SM) has three partitions, as in :mod:`distmoe.kernels.w2_dgrad.gluon`:

* a producer warp issues the TMA loads of the program's tiles, ``pid, pid + G, ...``, K step
  by K step over F, into a ring of ``STAGES`` shared-memory stages: the tile's h2 rows
  (contiguous activation rows from the tile's first one; rows past the expert's live rows
  are read and discarded, rows past ``R_act`` are TMA's zero fill) and the ``BLOCK_N x 64``
  weight tile of ``w2[e]`` (K-major, as stored);
* two consumer warpgroups compute the tiles, in one of two ways (the config's ``num_warps``:
  the MMA warps of one tile):

  - ping-pong (4, ``block_n`` 128): they take the program's tiles in turn; each computes a
    128 x 128 tile (two m64n128 MMAs per k16) and stores it while the other runs its MMAs.
    A ``turn`` mbarrier pair orders their K loops;
  - cooperative (8, ``block_n`` 256): both take every 128 x 256 tile, 64 rows each (one
    m64n256 MMA per k16 on their half of the A stage); a stage goes back to the producer
    when both have released it. Half the h2 loads per FLOP of ping-pong, the stores not
    under MMAs.

The epilogue rounds the accumulator to bf16 and stores it in 64-column parts as 16-byte
vectors through each row's address (plain ``st.global``, as the Triton kernel: a peer reads
the rows after the caller's release/acquire signal). Unlike the Triton kernel, a tile of
padding rows only, and a tile whose live rows all have address 0, still runs its MMAs (the
producer and the consumers would have to agree on skipping it per tile); only its stores are
skipped.

The same kernel runs the W13 DGRAD: this module holds the kernel body shared by both, and
:mod:`distmoe.kernels.w13_dgrad.gluon` imports it publicly (:func:`launch_kernel`,
:func:`shape_reason`) for its launcher
(:func:`~distmoe.kernels.w13_dgrad.gluon.launch_gluon_w13_dgrad`, for
:func:`distmoe.kernels.w13_dgrad.triton.w13_dgrad_scatter`'s ``W13DgradConfig.gluon``): A is
grad_h1 ``[R_act, 2F]`` in the same activation rows, the reduction runs over 2F, and the
weight tiles come from ``w13[e]`` viewed ``[2F, D]`` as ``[64, block_n]`` blocks, N-major as
stored (``B_K_MAJOR`` False: the MMAs read them untransposed); the epilogue stores each
route's input gradient row at ``scatter_ptrs[r]``. Same bits as the Triton W13 DGRAD; which
of the two runs is picked by :mod:`distmoe.plan`.

D need not be a multiple of ``block_n`` (GPT-OSS: D = 2880): a row's last tile is partial.
Its weight rows past D are the next expert's (TMA zeros after the last expert; for the W13
DGRAD, columns past D are TMA zeros), and its 64-column parts at or past D are not stored.

Only for CUDA devices of compute capability 9.x, outside the interpreter, with D and F
multiples of 64 (2F for the W13 DGRAD); :func:`gluon_w2_reason` and
:func:`~distmoe.kernels.w13_dgrad.gluon.gluon_w13_dgrad_reason` say when.
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
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    from distmoe.kernels.base.gluon import (
        consumer_walk,
        enabled_tiles,
        lockstep_before_tile,
        lockstep_tile_done,
        mma_steps,
        program_tiles,
        ring_barriers,
        tile_info,
        tma_load_steps,
        wait_turn,
    )
    from distmoe.kernels.base.tiles import column_halves

__all__ = ["GLUON_W2_BLOCK_K", "GLUON_W2_BLOCK_M", "GLUON_W2_TILES", "GLUON_W2_STAGES",
           "gluon_w2_reason", "launch_gluon_w2", "launch_kernel", "shape_reason", "stage_bytes"]

#: (block_m, block_n, block_k, warps) of a config this kernel runs: ``block_n`` the h3
#: columns of a tile, ``warps`` the MMA warps of one tile (the config's ``num_warps``): 4
#: ping-pong 128 x 128 tiles, 8 cooperative 128 x 256 ones.
GLUON_W2_TILES = ((128, 128, 64, 4), (128, 256, 64, 8))
#: ring depths the kernel takes where the ring fits ``_RING_BYTES`` (the epilogue's layout
#: conversions need the rest): up to 6 stages of 32 KiB (ping-pong), 4 of 48 KiB
#: (cooperative)
GLUON_W2_STAGES = (3, 4, 5, 6)
_RING_BYTES = 200 * 1024
#: a tile's rows (the padding multiple) and K step, every tile
GLUON_W2_BLOCK_M, GLUON_W2_BLOCK_K = 128, 64
#: the kernel's register limit, as :mod:`distmoe.kernels.w2_dgrad.gluon`: the partitions set
#: 232 (both consumers) and 40 (the producer warp) per thread
_MAXNREG = 168


def stage_bytes(block_n: int, block_k: int = 64) -> int:
    """Shared memory of one ring stage: 128 h2 rows and ``block_n`` weight rows of
    ``block_k`` bf16 each."""
    return (128 + block_n) * block_k * 2


if HAVE_GLUON:

    @gluon.jit
    def _producer(a_desc, w_desc, a_bufs, b_bufs, ready, empty, turn, scatter_ptrs_ptr,
                  padded_offsets_ptr, row_offsets_ptr, enable_ptr, sync_ptr,
                  HIDDEN: gl.constexpr,
                  FFN: gl.constexpr, NUM_EXPERTS: gl.constexpr, EXPERTS_POW2: gl.constexpr,
                  GROUP_M: gl.constexpr, STAGES: gl.constexpr, HAS_ENABLE: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  BLOCK_K: gl.constexpr,
                  COOP: gl.constexpr, B_K_MAJOR: gl.constexpr, PARITY: gl.constexpr,
                  LOCKSTEP: gl.constexpr, EXPERT_GROUPS: gl.constexpr):
        """One warp: the TMA loads of every tile of the program, K step by K step."""
        NUM_K: gl.constexpr = FFN // BLOCK_K
        NUM_PID_N: gl.constexpr = (HIDDEN + BLOCK_N - 1) // BLOCK_N  # the last may be partial
        num_pid_m, num_tiles, ends, starts, rbeg, rend, eidx = program_tiles(
            padded_offsets_ptr, row_offsets_ptr, NUM_EXPERTS, EXPERTS_POW2, NUM_PID_N,
            BLOCK_M, 1)
        num_tiles = enabled_tiles(enable_ptr, num_tiles, HAS_ENABLE)
        count = 0
        in_step = gl.to_tensor(True)  # until a wait misses its bound (a program not resident)
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            in_step = lockstep_before_tile(sync_ptr, in_step, tile, num_tiles, LOCKSTEP)
            pid_n, expert, _row, act_start, _live = tile_info(
                tile, num_pid_m, ends, starts, rbeg, rend, eidx, NUM_PID_N, GROUP_M,
                NUM_EXPERTS, BLOCK_M, EXPERT_GROUPS)
            if B_K_MAJOR:  # w2: expert e's [D, F] rows of the [E D, F] view
                w_row = expert * HIDDEN + pid_n * BLOCK_N
                w_col = 0
            else:  # w13: expert e's [2F, D] rows of the [E 2F, D] view
                w_row = expert * FFN
                w_col = pid_n * BLOCK_N
            count = tma_load_steps(a_desc, w_desc, a_bufs, b_bufs, ready, empty, count,
                                    act_start, w_row, w_col, NUM_K, STAGES, BLOCK_K, B_K_MAJOR)
            if LOCKSTEP:
                lockstep_tile_done(sync_ptr)

    @gluon.jit
    def _consumer(a_desc, w_desc, a_bufs, b_bufs, ready, empty, turn, scatter_ptrs_ptr,
                  padded_offsets_ptr, row_offsets_ptr, enable_ptr, sync_ptr,
                  HIDDEN: gl.constexpr,
                  FFN: gl.constexpr, NUM_EXPERTS: gl.constexpr, EXPERTS_POW2: gl.constexpr,
                  GROUP_M: gl.constexpr, STAGES: gl.constexpr, HAS_ENABLE: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  BLOCK_K: gl.constexpr,
                  COOP: gl.constexpr, B_K_MAJOR: gl.constexpr, PARITY: gl.constexpr,
                  LOCKSTEP: gl.constexpr, EXPERT_GROUPS: gl.constexpr):
        """One warpgroup: the MMAs and the stores of the program's tiles ``PARITY``,
        ``PARITY + 2``, ... (in the program's own numbering); with ``COOP``, of rows
        ``64 PARITY`` to ``64 PARITY + 63`` of every tile of the program."""
        NUM_K: gl.constexpr = FFN // BLOCK_K
        NUM_PID_N: gl.constexpr = (HIDDEN + BLOCK_N - 1) // BLOCK_N  # the last may be partial
        ROWS: gl.constexpr = BLOCK_M // 2 if COOP else BLOCK_M
        ROW0: gl.constexpr = PARITY * ROWS if COOP else 0  # its first row in the tile
        ACC: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        num_pid_m, num_tiles, ends, starts, rbeg, rend, eidx = program_tiles(
            padded_offsets_ptr, row_offsets_ptr, NUM_EXPERTS, EXPERTS_POW2, NUM_PID_N,
            BLOCK_M, 4)
        num_tiles = enabled_tiles(enable_ptr, num_tiles, HAS_ENABLE)
        first, step, count = consumer_walk(NUM_K, COOP, PARITY)
        turns = 0
        for tile in range(first, num_tiles, step):
            pid_n, expert, row_start, _act, num_live = tile_info(
                tile, num_pid_m, ends, starts, rbeg, rend, eidx, NUM_PID_N, GROUP_M,
                NUM_EXPERTS, BLOCK_M, EXPERT_GROUPS)
            if not COOP:
                turns = wait_turn(turn, turns, PARITY)
            acc, count = mma_steps(a_bufs, b_bufs, ready, empty,
                                    gl.zeros([ROWS, BLOCK_N], gl.float32, ACC), count, NUM_K,
                                    STAGES, ROW0, ROWS, B_K_MAJOR)
            if not COOP:
                mbarrier.arrive(turn.index(1 - PARITY))
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES))
            if not COOP:
                count += NUM_K  # the other consumer's tile

            scatter_tile(acc, scatter_ptrs_ptr, row_start + ROW0, num_live - ROW0,
                          pid_n * BLOCK_N, ROWS, BLOCK_N, HIDDEN)

    @gluon.jit
    def scatter_tile(acc, scatter_ptrs_ptr, row_start, num_live, col0, ROWS: gl.constexpr,
                      WIDTH: gl.constexpr, HIDDEN: gl.constexpr):
        """The epilogue of a ``[ROWS, WIDTH]`` fp32 tile (``WIDTH`` 128 or 256): bf16, then
        64-column parts (h3 columns ``col0 + ...``), each converted to 16-byte vectors and
        stored at the addresses of padded rows ``row_start + i``, ``i < num_live``; parts at
        or past column ``HIDDEN`` (a multiple of 64: the row's width) are not stored."""
        lo, hi = column_halves(acc.to(gl.bfloat16), ROWS, WIDTH)
        if WIDTH == 256:
            q0, q1 = column_halves(lo, ROWS, 128)
            _scatter_part(q0, scatter_ptrs_ptr, row_start, num_live, col0, ROWS, WIDTH, HIDDEN)
            _scatter_part(q1, scatter_ptrs_ptr, row_start, num_live, col0 + 64, ROWS, WIDTH,
                          HIDDEN)
            q2, q3 = column_halves(hi, ROWS, 128)
            _scatter_part(q2, scatter_ptrs_ptr, row_start, num_live, col0 + 128, ROWS, WIDTH,
                          HIDDEN)
            _scatter_part(q3, scatter_ptrs_ptr, row_start, num_live, col0 + 192, ROWS, WIDTH,
                          HIDDEN)
        else:
            _scatter_part(lo, scatter_ptrs_ptr, row_start, num_live, col0, ROWS, WIDTH, HIDDEN)
            _scatter_part(hi, scatter_ptrs_ptr, row_start, num_live, col0 + 64, ROWS, WIDTH,
                          HIDDEN)

    @gluon.jit
    def _scatter_part(part, scatter_ptrs_ptr, row_start, num_live, col0,
                      ROWS: gl.constexpr, WIDTH: gl.constexpr, HIDDEN: gl.constexpr):
        """Store a ``[ROWS, 64]`` bf16 part (h3 columns ``col0 + j``) of padded rows
        ``row_start + i``, ``i < num_live``, at their addresses (skipping address 0); none
        where ``col0 >= HIDDEN`` (only where ``WIDTH`` does not divide ``HIDDEN``: the row's
        last tile is partial)."""
        L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        v = gl.convert_layout(part, L)
        i = gl.arange(0, ROWS, layout=gl.SliceLayout(1, L))
        j = gl.arange(0, 64, layout=gl.SliceLayout(0, L))
        live = i < num_live
        if HIDDEN % WIDTH != 0:
            live = live & (col0 < HIDDEN)
        dst = gl.load(scatter_ptrs_ptr + row_start + i, mask=live, other=0)
        rows = gl.multiple_of(dst.to(gl.pointer_type(gl.bfloat16)), 16)
        ptrs = gl.expand_dims(rows, 1) + gl.expand_dims(col0 + j, 0)
        gl.store(ptrs, v, mask=gl.expand_dims(live & (dst != 0), 1))

    @gluon.jit
    def _gluon_w2_kernel(
        a_desc,  # host descriptor of A [R_act, K] (h2, or grad_h1), block [128, 64]
        w_desc,  # host descriptor of the weights: w2 viewed [E D, F], block [BLOCK_N, 64]
        #          (B_K_MAJOR), or w13 viewed [E 2F, D], block [64, BLOCK_N]
        scatter_ptrs_ptr,  # int64 [R_cap]: output row addresses by padded row (0 = not stored)
        padded_offsets_ptr,  # int32 [E + 1]
        row_offsets_ptr,  # int32 [E + 1]
        enable_ptr,  # int32 [1] (HAS_ENABLE), else a placeholder
        sync_ptr,  # int32 [1], zeroed (LOCKSTEP), else a placeholder
        HIDDEN: gl.constexpr,  # N: the output row's width (D)
        FFN: gl.constexpr,  # K: the reduction (F for the W2 forward, 2F for the W13 DGRAD)
        NUM_EXPERTS: gl.constexpr,
        EXPERTS_POW2: gl.constexpr,
        GROUP_M: gl.constexpr,
        STAGES: gl.constexpr,
        HAS_ENABLE: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
        COOP: gl.constexpr,
        B_K_MAJOR: gl.constexpr,
        LOCKSTEP: gl.constexpr,
        EXPERT_GROUPS: gl.constexpr,  # tile order: a group per expert (_expert_group_tile_info)
        num_warps: gl.constexpr,
    ):
        a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BLOCK_K],
                                           a_desc.layout)
        if B_K_MAJOR:
            b_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, BLOCK_K],
                                               w_desc.layout)
        else:
            b_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, BLOCK_N],
                                               w_desc.layout)
        # ready: the producer's expect-tx arrive; empty: released by one consumer, or by both
        # with COOP
        ready, empty, turn = ring_barriers(STAGES, 1, 2 if COOP else 1)
        # (the argument lists are written out: a tuple built here loses the constexprs)
        gl.warp_specialize([
            (_consumer, (a_desc, w_desc, a_bufs, b_bufs, ready, empty, turn, scatter_ptrs_ptr,
                         padded_offsets_ptr, row_offsets_ptr, enable_ptr, sync_ptr, HIDDEN,
                         FFN, NUM_EXPERTS, EXPERTS_POW2, GROUP_M, STAGES, HAS_ENABLE, BLOCK_M,
                         BLOCK_N, BLOCK_K, COOP, B_K_MAJOR, 0, LOCKSTEP,
                         EXPERT_GROUPS)),
            (_consumer, (a_desc, w_desc, a_bufs, b_bufs, ready, empty, turn, scatter_ptrs_ptr,
                         padded_offsets_ptr, row_offsets_ptr, enable_ptr, sync_ptr, HIDDEN,
                         FFN, NUM_EXPERTS, EXPERTS_POW2, GROUP_M, STAGES, HAS_ENABLE, BLOCK_M,
                         BLOCK_N, BLOCK_K, COOP, B_K_MAJOR, 1, LOCKSTEP,
                         EXPERT_GROUPS)),
            (_producer, (a_desc, w_desc, a_bufs, b_bufs, ready, empty, turn, scatter_ptrs_ptr,
                         padded_offsets_ptr, row_offsets_ptr, enable_ptr, sync_ptr, HIDDEN,
                         FFN, NUM_EXPERTS, EXPERTS_POW2, GROUP_M, STAGES, HAS_ENABLE, BLOCK_M,
                         BLOCK_N, BLOCK_K, COOP, B_K_MAJOR, 0, LOCKSTEP,
                         EXPERT_GROUPS)),
        ], [4, 1], [232, 40])


def shape_reason(*, hidden: int, ffn: int, block_m: int, block_n: int, block_k: int,
                 stages: int, warps: int = 4, w13_dgrad: bool = False) -> str | None:
    """``None`` when the kernel can tile this case (whatever the device), else why not.
    ``warps``: the MMA warps of one tile (4 ping-pong, 8 cooperative; ``GLUON_W2_TILES``).
    ``w13_dgrad``: the W13 DGRAD's case (the reduction is 2F), else the W2 forward's (F)."""
    reason = gluon_ring_reason(
        "W13 DGRAD" if w13_dgrad else "W2", GLUON_W2_TILES, (block_m, block_n, block_k, warps),
        "num_warps 4: ping-pong 128 x 128 tiles; 8: cooperative 128 x 256 tiles",
        per_stage=stage_bytes(block_n, block_k), stages=stages, depths=GLUON_W2_STAGES,
        ring_bytes=_RING_BYTES)
    depth, depth_name = (2 * ffn, "2F") if w13_dgrad else (ffn, "F")
    if reason is None and (hidden % 64 or depth % block_k):
        reason = (f"D ({hidden}) must be a multiple of 64 and {depth_name} ({depth}) "
                  f"of {block_k}")
    return reason


def gluon_w2_reason(device: torch.device, *, hidden: int, ffn: int, block_m: int,
                    block_n: int, block_k: int, stages: int, warps: int = 4) -> str | None:
    """``None`` when :func:`launch_gluon_w2` can run this case on ``device``, else why not
    (a sentence)."""
    return gluon_device_reason(device) or shape_reason(
        hidden=hidden, ffn=ffn, block_m=block_m, block_n=block_n, block_k=block_k,
        stages=stages, warps=warps)


def launch_gluon_w2(h2: torch.Tensor, padded_offsets: torch.Tensor, row_offsets: torch.Tensor,
                    w2: torch.Tensor, scatter_ptrs: torch.Tensor, *,
                    enable: torch.Tensor | None, block_n: int = 128, stages: int = 5,
                    group_m: int = 8, warps: int = 4, programs: int | None = None,
                    lockstep: bool = False, expert_groups: bool = False) -> None:
    """Launch the kernel (arguments validated by
    :func:`~distmoe.kernels.w2_forward.triton.w2_scatter`, and :func:`gluon_w2_reason` returned
    ``None``). ``warps``: 4 (ping-pong, ``block_n`` 128) or 8 (cooperative, ``block_n`` 256).
    ``programs``: the grid (default one per SM); tests pass fewer so that every program walks
    many tiles. ``lockstep``: :attr:`~distmoe.kernels.w2_forward.config.W2Config.lockstep` (a
    zeroed int32 counter is allocated per launch). ``expert_groups``:
    :attr:`~distmoe.kernels.w2_forward.config.W2Config.expert_groups`."""
    num_experts, hidden, ffn = w2.shape
    w_layout = shared_layout((block_n, GLUON_W2_BLOCK_K))
    w_desc = GluonDescriptor(w2.view(num_experts * hidden, ffn), [num_experts * hidden, ffn],
                             [ffn, 1], [block_n, GLUON_W2_BLOCK_K], w_layout)
    launch_kernel(h2, w_desc, scatter_ptrs, padded_offsets, row_offsets, enable,
            hidden=hidden, depth=ffn, num_experts=num_experts, block_n=block_n,
            stages=stages, group_m=group_m, warps=warps, programs=programs, b_k_major=True,
            lockstep=lockstep, expert_groups=expert_groups)


def launch_kernel(a, w_desc, scatter_ptrs, padded_offsets, row_offsets, enable, *,
            hidden, depth, num_experts, block_n, stages, group_m, warps, programs, b_k_major,
            lockstep, expert_groups):
    """One launch of the kernel: A ``[R_act, depth]`` by a host descriptor of ``[128, 64]``
    blocks, the weights' descriptor ``w_desc`` (``b_k_major``: ``[block_n, 64]`` blocks of
    ``[E N, K]``, else ``[64, block_n]`` blocks of ``[E K, N]``), one program per SM (or
    ``programs``) and at most one per tile of the ``R_cap`` bound."""
    a_layout = shared_layout((GLUON_W2_BLOCK_M, GLUON_W2_BLOCK_K))
    a_desc = GluonDescriptor(a, list(a.shape), [depth, 1], [GLUON_W2_BLOCK_M, GLUON_W2_BLOCK_K],
                             a_layout)
    tiles = (scatter_ptrs.shape[0] // GLUON_W2_BLOCK_M) * -(-hidden // block_n)
    if programs is None:
        programs = num_sms(a.device)
    with device_context(a.device):
        _gluon_w2_kernel[(max(1, min(programs, tiles)),)](
            a_desc, w_desc, scatter_ptrs, padded_offsets, row_offsets,
            padded_offsets if enable is None else enable,
            lockstep_counter(lockstep, padded_offsets),
            HIDDEN=hidden, FFN=depth, NUM_EXPERTS=num_experts,
            EXPERTS_POW2=max(32, next_power_of_2(num_experts)), GROUP_M=group_m,
            STAGES=stages, HAS_ENABLE=enable is not None,
            BLOCK_M=GLUON_W2_BLOCK_M, BLOCK_N=block_n, BLOCK_K=GLUON_W2_BLOCK_K, COOP=warps == 8,
            B_K_MAJOR=b_k_major, LOCKSTEP=lockstep, EXPERT_GROUPS=expert_groups, num_warps=4,
            maxnreg=_MAXNREG,
        )  # fmt: skip
