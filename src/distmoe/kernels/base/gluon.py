"""What the Gluon kernels of every family share: whether Gluon runs here, the tile and ring
rules, and the ``gluon.jit`` pieces of the warp-specialised grouped GEMMs
(:mod:`distmoe.kernels.w13_forward.gluon`, :mod:`distmoe.kernels.w2_forward.gluon` (which the
W13 DGRAD shares), :mod:`distmoe.kernels.w2_dgrad.gluon`, :mod:`distmoe.kernels.mega.gluon` and
:mod:`distmoe.kernels.wgrad.gluon`).

* :data:`HAVE_GLUON`: the installed triton ships Gluon (with every piece the kernels use);
  :func:`gluon_device_reason`: whether Gluon kernels run on a device;
  :func:`gluon_ring_reason`: the tile and ring-depth rules of a warp-specialised GEMM.
* Each of the grouped GEMMs runs one program per SM over the tiles ``pid, pid + G, ...`` of
  the padded expert-major schedule (group-M order), with a producer partition filling a ring
  of shared-memory stages and two consumer warpgroups computing, ping-pong (alternate tiles)
  or cooperatively (both on every tile). The ``gluon.jit`` helpers below are inlined into
  them: the per-expert bounds and the tile lookup, the ring's mbarriers, the consumers' walk
  and K loop, the producers' lockstep.
"""

from __future__ import annotations

import functools

import torch

from distmoe.kernels.base.interpreter import interpreter_active
from distmoe.kernels.base.tiles import swizzle_tile

try:  # Gluon ships with triton >= 3.4; keep the package importable without it
    # (every Gluon piece the kernels import, so that HAVE_GLUON means they all exist)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: F401
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,  # noqa: F401
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor  # noqa: F401

    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed triton
    HAVE_GLUON = False


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    # the driver's answer does not change in a process; asked on every launch otherwise
    return torch.cuda.get_device_capability(index)


@functools.cache
def shared_layout(block_shape: tuple[int, ...], fp8: bool = False):
    """The default NVMMA shared-memory layout of a bf16 (or, with ``fp8``, E4M3) TMA block
    (one object per shape, made once: building it costs host time on every launch
    otherwise)."""
    return gl.NVMMASharedLayout.get_default_for(list(block_shape),
                                                gl.float8e4nv if fp8 else gl.bfloat16)


def gluon_device_reason(device: torch.device) -> str | None:
    """``None`` when Gluon kernels can run on ``device`` (Gluon present, not the interpreter, a
    CUDA device of compute capability 9.x), else why not (a sentence)."""
    if not HAVE_GLUON:
        return "this triton has no Gluon"
    if interpreter_active():
        return "the Triton interpreter runs no Gluon kernels"
    if device.type != "cuda" or _capability(
            torch.cuda.current_device() if device.index is None else device.index)[0] != 9:
        return f"the Gluon kernels are written for CUDA devices of compute capability 9.x " \
               f"(Hopper), got {device}"
    return None


def gluon_ring_reason(kernel: str, tiles: tuple, tile: tuple, tile_help: str, *,
                      per_stage: int, stages: int, depths: tuple, ring_bytes: int) -> str | None:
    """The tile and ring-depth rules of a warp-specialised Gluon GEMM: ``None`` when ``tile``
    ``(block_m, block_n, block_k, num_warps)`` is one of ``tiles`` and ``stages`` stages of
    ``per_stage`` bytes are one of ``depths`` and fit ``ring_bytes``, else why not (naming
    ``kernel``, with ``tile_help`` saying what the tiles are)."""
    if tile not in tiles:
        return (f"the Gluon {kernel} kernel runs (block_m, block_n, block_k, num_warps) in "
                f"{tiles}, got {tile} ({tile_help})")
    if stages not in depths or stages * per_stage > ring_bytes:
        fit = [s for s in depths if s * per_stage <= ring_bytes]
        return (f"stages must be one of {fit} with block_n = {tile[1]} and num_warps = "
                f"{tile[3]}, got {stages}")
    return None


if HAVE_GLUON:
    #: the most counter reads a producer spends waiting for the wave (``lockstep`` of the
    #: W13 and W2 configs: :func:`_lockstep_wait`)
    _LOCKSTEP_SPINS = gl.constexpr(512)

    @gluon.jit
    def tile_info(tile, num_pid_m, ends, starts, rbeg, rend, eidx,
                   NUM_PID_N: gl.constexpr, GROUP_M: gl.constexpr, NUM_EXPERTS: gl.constexpr,
                   BLOCK_M: gl.constexpr, EXPERT_GROUPS: gl.constexpr):
        """Column tile, expert, first padded row, first activation row and live row count of
        ``tile`` (group-M order: the Triton kernels' :func:`swizzle_tile`; with
        ``EXPERT_GROUPS`` a group per expert, :func:`_expert_group_tile_info`). The
        per-expert bounds are register vectors loaded once per program (``ends`` =
        padded_offsets[1:], ``starts`` = padded_offsets[:-1], ``rbeg`` / ``rend`` =
        row_offsets[:-1] / [1:], ``eidx`` their expert index)."""
        if EXPERT_GROUPS:
            return _expert_group_tile_info(tile, ends, starts, rbeg, rend, eidx, NUM_PID_N,
                                           NUM_EXPERTS, BLOCK_M)
        pid_m, pid_n = swizzle_tile(tile, num_pid_m, NUM_PID_N, GROUP_M)
        return block_info(pid_m, pid_n, ends, starts, rbeg, rend, eidx, NUM_EXPERTS, BLOCK_M)

    @gluon.jit
    def ordered_tile_info(tile, num_pid_m, order_ptr, pos_lo, ends, starts, rbeg, rend, eidx,
                           NUM_PID_N: gl.constexpr, GROUP_M: gl.constexpr,
                           NUM_EXPERTS: gl.constexpr, BLOCK_M: gl.constexpr,
                           HAS_ORDER: gl.constexpr, EXPERT_GROUPS: gl.constexpr):
        """:func:`tile_info` of a launch over the row blocks ``order[pos_lo:pos_lo +
        num_pid_m]`` (``HAS_ORDER``; group-M order over the positions), else of all of them
        (:mod:`distmoe.kernels.w13_forward.phases`). ``EXPERT_GROUPS`` (without ``HAS_ORDER``): a
        group per expert instead of per ``GROUP_M`` row blocks
        (:func:`_expert_group_tile_info`)."""
        if not HAS_ORDER:
            return tile_info(tile, num_pid_m, ends, starts, rbeg, rend, eidx, NUM_PID_N,
                              GROUP_M, NUM_EXPERTS, BLOCK_M, EXPERT_GROUPS)
        pid_m, pid_n = swizzle_tile(tile, num_pid_m, NUM_PID_N, GROUP_M)
        pid_m = gl.load(order_ptr + pos_lo + pid_m)
        return block_info(pid_m, pid_n, ends, starts, rbeg, rend, eidx, NUM_EXPERTS, BLOCK_M)

    @gluon.jit
    def _expert_group_tile_info(tile, ends, starts, rbeg, rend, eidx,
                                NUM_PID_N: gl.constexpr, NUM_EXPERTS: gl.constexpr,
                                BLOCK_M: gl.constexpr):
        """:func:`block_info` of ``tile`` in the expert-group order: an expert's tiles are
        the same range of tile numbers as in row-block order (``NUM_PID_N`` per row block),
        walked column tile by column tile, each over all the expert's row blocks. So every
        column tile of a row block runs within ``blocks * NUM_PID_N`` tiles of the others (in
        one wave or two), and the row blocks that read a weight tile run side by side. (The
        expert is found once: the row-block order's lookup again spilled the producer's
        registers at 256 experts.)"""
        expert, sel = _expert_at((tile // NUM_PID_N) * BLOCK_M, ends, eidx, NUM_EXPERTS)
        first = gl.sum(gl.where(sel, starts, 0), axis=0) // BLOCK_M
        blocks = gl.sum(gl.where(sel, ends, 0), axis=0) // BLOCK_M - first
        local = tile - first * NUM_PID_N
        block = local % blocks  # the row block within the expert
        act_begin = gl.sum(gl.where(sel, rbeg, 0), axis=0) + block * BLOCK_M
        act_end = gl.sum(gl.where(sel, rend, 0), axis=0)
        return local // blocks, expert, (first + block) * BLOCK_M, act_begin, act_end - act_begin

    @gluon.jit
    def block_info(pid_m, pid_n, ends, starts, rbeg, rend, eidx, NUM_EXPERTS: gl.constexpr,
                    BLOCK_M: gl.constexpr):
        """:func:`tile_info` from the tile's row block and column tile."""
        row_start = pid_m * BLOCK_M
        expert, sel = _expert_at(row_start, ends, eidx, NUM_EXPERTS)
        local = row_start - gl.sum(gl.where(sel, starts, 0), axis=0)
        act_begin = gl.sum(gl.where(sel, rbeg, 0), axis=0)
        act_end = gl.sum(gl.where(sel, rend, 0), axis=0)
        return pid_n, expert, row_start, act_begin + local, act_end - act_begin - local

    @gluon.jit
    def _expert_at(row, ends, eidx, NUM_EXPERTS: gl.constexpr):
        """The expert whose padded rows hold ``row`` (the experts ending at or before it
        counted), and the mask of its entry in the per-expert bound vectors."""
        expert = gl.minimum(gl.sum((ends <= row).to(gl.int32), axis=0), NUM_EXPERTS - 1)
        return expert, eidx == expert

    @gluon.jit
    def expert_bounds(padded_offsets_ptr, row_offsets_ptr, NUM_EXPERTS: gl.constexpr,
                       EXPERTS_POW2: gl.constexpr, LAYOUT: gl.constexpr):
        """The per-expert bounds that :func:`tile_info` takes, as ``[EXPERTS_POW2]`` register
        vectors in ``LAYOUT``: ``(ends, starts, rbeg, rend, eidx)``."""
        eidx = gl.arange(0, EXPERTS_POW2, layout=LAYOUT)
        emask = eidx < NUM_EXPERTS
        ends = gl.load(padded_offsets_ptr + 1 + eidx, mask=emask, other=2147483647)
        starts = gl.load(padded_offsets_ptr + eidx, mask=emask, other=0)
        rbeg = gl.load(row_offsets_ptr + eidx, mask=emask, other=0)
        rend = gl.load(row_offsets_ptr + 1 + eidx, mask=emask, other=0)
        return ends, starts, rbeg, rend, eidx

    @gluon.jit
    def program_tiles(padded_offsets_ptr, row_offsets_ptr, NUM_EXPERTS: gl.constexpr,
                       EXPERTS_POW2: gl.constexpr, NUM_PID_N: gl.constexpr,
                       BLOCK_M: gl.constexpr, NW: gl.constexpr):
        """The row blocks and tiles (:func:`tile_count`) and the per-expert bounds as
        register vectors of a partition of ``NW`` warps (every warp holds them all: the
        lookup reduces with shuffles)."""
        num_pid_m, num_tiles = tile_count(padded_offsets_ptr, NUM_EXPERTS, NUM_PID_N, BLOCK_M)
        ends, starts, rbeg, rend, eidx = expert_bounds(padded_offsets_ptr, row_offsets_ptr,
                                                        NUM_EXPERTS, EXPERTS_POW2,
                                                        bounds_layout(EXPERTS_POW2, NW))
        return num_pid_m, num_tiles, ends, starts, rbeg, rend, eidx

    @gluon.jit
    def tile_count(padded_offsets_ptr, NUM_EXPERTS: gl.constexpr, NUM_PID_N: gl.constexpr,
                    BLOCK_M: gl.constexpr):
        """``(row blocks, tiles)`` of the call: ``padded_offsets[E] / BLOCK_M`` blocks of
        ``NUM_PID_N`` column tiles each."""
        num_pid_m = gl.load(padded_offsets_ptr + NUM_EXPERTS) // BLOCK_M
        return num_pid_m, num_pid_m * NUM_PID_N

    @gluon.constexpr_function
    def bounds_layout(EXPERTS_POW2, NW):
        """The per-expert bound vectors' layout in a partition of ``NW`` warps."""
        return gl.BlockedLayout([EXPERTS_POW2 // 32], [32], [NW], [0])

    @gluon.jit
    def tile_info_reloaded(tile, num_pid_m, padded_offsets_ptr, row_offsets_ptr,
                            NUM_PID_N: gl.constexpr, GROUP_M: gl.constexpr,
                            NUM_EXPERTS: gl.constexpr, EXPERTS_POW2: gl.constexpr,
                            BLOCK_M: gl.constexpr, NW: gl.constexpr,
                            EXPERT_GROUPS: gl.constexpr):
        """:func:`tile_info` with the per-expert bounds loaded for this tile (L1 hits after
        the first) instead of held in registers across the loop: for a partition whose
        epilogue needs the registers (``5 * EXPERTS_POW2 / 32`` per thread otherwise)."""
        ends, starts, rbeg, rend, eidx = expert_bounds(padded_offsets_ptr, row_offsets_ptr,
                                                        NUM_EXPERTS, EXPERTS_POW2,
                                                        bounds_layout(EXPERTS_POW2, NW))
        return tile_info(tile, num_pid_m, ends, starts, rbeg, rend, eidx, NUM_PID_N, GROUP_M,
                          NUM_EXPERTS, BLOCK_M, EXPERT_GROUPS)

    @gluon.jit
    def wait_turn(turn, turns, PARITY: gl.constexpr):
        """Ping-pong consumers take turns: consumer ``PARITY`` waits until the other has
        issued every earlier K step (its ``turns``-th wait; the first of consumer 0 passes at
        once). A stage's ready barrier may be waited on only one phase ahead, so the K loops
        must not overlap. Returns ``turns + 1``."""
        mbarrier.wait(turn.index(PARITY), (turns & 1) ^ (1 - PARITY))
        return turns + 1

    @gluon.jit
    def consumer_walk(NUM_K: gl.constexpr, COOP: gl.constexpr, PARITY: gl.constexpr):
        """Where consumer ``PARITY`` walks the program's tiles: ``(first, step, count)``, its
        first tile, the stride and its first step in the program's stream of ring steps
        (``NUM_K`` a tile). Cooperative consumers take every tile; ping-pong ones every
        other, starting with tile ``PARITY``."""
        num_progs = gl.num_programs(0)
        if COOP:
            first = gl.program_id(0)
            step = num_progs
            count = 0
        else:
            first = gl.program_id(0) + PARITY * num_progs
            step = 2 * num_progs
            count = PARITY * NUM_K
        return first, step, count

    @gluon.jit
    def ring_barriers(STAGES: gl.constexpr, READY_ARRIVALS: gl.constexpr,
                       EMPTY_ARRIVALS: gl.constexpr):
        """The mbarriers of a load ring and its two consumers, initialised: ``ready`` and
        ``empty`` per stage (completed by these arrival counts), and the ping-pong ``turn``
        pair (``turn[c]``: consumer ``c`` may start its next tile's MMAs, the other one has
        issued all of its tile's). Returns ``(ready, empty, turn)``."""
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=READY_ARRIVALS)
            mbarrier.init(empty.index(s), count=EMPTY_ARRIVALS)
        mbarrier.init(turn.index(0), count=1)
        mbarrier.init(turn.index(1), count=1)
        return ready, empty, turn

    @gluon.jit
    def handoff_barriers(N: gl.constexpr, READY_ARRIVALS: gl.constexpr,
                          FREE_ARRIVALS: gl.constexpr):
        """The mbarriers of ``N`` buffers that one partition fills and others read (not a
        TMA ring: :func:`ring_barriers`), initialised: ``ready[i]`` completed by
        ``READY_ARRIVALS`` arrivals (the writer's), ``free[i]`` by ``FREE_ARRIVALS`` (the
        readers'). Returns ``(ready, free)``."""
        ready = gl.allocate_shared_memory(gl.int64, [N, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [N, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(N):
            mbarrier.init(ready.index(i), count=READY_ARRIVALS)
            mbarrier.init(free.index(i), count=FREE_ARRIVALS)
        return ready, free

    @gluon.jit
    def mma_steps(a_bufs, b_bufs, ready, empty, acc, count, NUM_K: gl.constexpr,
                   STAGES: gl.constexpr, ROW0: gl.constexpr, ROWS: gl.constexpr,
                   B_K_MAJOR: gl.constexpr):
        """A consumer's MMAs of one tile: ``NUM_K`` ring stages from the ``count``-th of the
        program's step stream, ``acc += A[ROW0:ROW0 + ROWS] @ B`` each (B stored
        ``[N, K]`` and transposed with ``B_K_MAJOR``, else ``[K, N]``), each stage going back
        to the producer once the next one's MMA is issued and its own is done. Returns
        ``(acc, count + NUM_K)`` with the last MMA still in flight and its stage held: the
        caller waits for it and releases stage ``(count + NUM_K - 1) % STAGES``."""
        for k in range(NUM_K):
            stage = count % STAGES
            mbarrier.wait(ready.index(stage), (count // STAGES) & 1)
            b = b_bufs.index(stage)
            if B_K_MAJOR:
                b = b.permute((1, 0))
            acc = warpgroup_mma(a_bufs.index(stage).slice(ROW0, ROWS), b, acc, is_async=True)
            # the previous step's MMA is done: its stage goes back to the producer
            acc = warpgroup_mma_wait(1, deps=(acc,))
            mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), pred=k > 0)
            count += 1
        return acc, count

    @gluon.jit
    def tma_load_steps(a_desc, w_desc, a_bufs, b_bufs, ready, empty, count, a_row, w_row,
                        w_col, NUM_K: gl.constexpr, STAGES: gl.constexpr,
                        BLOCK_K: gl.constexpr, B_K_MAJOR: gl.constexpr):
        """A TMA producer's loads of one tile, the counterpart of :func:`mma_steps`: into
        ``NUM_K`` ring stages from the ``count``-th of the program's step stream, each once
        its consumers have released it, the A tile at ``[a_row, k BLOCK_K]`` and the B tile
        at ``[w_row, k BLOCK_K]`` (``B_K_MAJOR``: B stored ``[N, K]``) or at
        ``[w_row + k BLOCK_K, w_col]`` (stored ``[K, N]``); both complete the stage's
        ``ready`` barrier. Returns ``count + NUM_K``."""
        nbytes: gl.constexpr = a_desc.block_type.nbytes + w_desc.block_type.nbytes
        for k in range(NUM_K):
            stage = count % STAGES
            mbarrier.wait(empty.index(stage), ((count // STAGES) & 1) ^ 1)
            bar = ready.index(stage)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(a_desc, [a_row, k * BLOCK_K], bar,
                                            a_bufs.index(stage))
            if B_K_MAJOR:
                tma.async_copy_global_to_shared(w_desc, [w_row, k * BLOCK_K], bar,
                                                b_bufs.index(stage))
            else:
                tma.async_copy_global_to_shared(w_desc, [w_row + k * BLOCK_K, w_col], bar,
                                                b_bufs.index(stage))
            count += 1
        return count

    @gluon.jit
    def ordered_tiles(positions_ptr, num_pid_m, num_tiles, NUM_PID_N: gl.constexpr,
                       HAS_ORDER: gl.constexpr):
        """``(pos_lo, num_pid_m, num_tiles)`` of a launch over the positions
        ``[positions[0], positions[1])`` of a block order (``HAS_ORDER``), else ``(0, ...)``
        as given."""
        pos_lo = 0
        if HAS_ORDER:
            pos_lo = gl.load(positions_ptr)
            num_pid_m = gl.load(positions_ptr + 1) - pos_lo
            num_tiles = num_pid_m * NUM_PID_N
        return pos_lo, num_pid_m, num_tiles

    @gluon.jit
    def arrive_block(done_ptr, row_start, BLOCK: gl.constexpr, NW: gl.constexpr):
        """Every thread of a partition of ``NW`` warps adds 1 to ``done[row_start // BLOCK]``
        with release semantics at GPU scope, after its own stores of the tile (so the
        counter reaches its total only once every thread's stores are visible; no barrier
        needed). :func:`wait_block` is the reader."""
        L: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        one = gl.full([32 * NW], 1, gl.int32, L)
        ptrs = done_ptr + row_start // BLOCK + gl.zeros([32 * NW], gl.int32, L)
        gl.atomic_add(ptrs, one, sem="release", scope="gpu")

    @gluon.jit
    def wait_block(wait_ptr, row_start, need, BLOCK: gl.constexpr, NW: gl.constexpr):
        """The ``NW`` warps of a partition spin until ``wait[row_start // BLOCK] >= need``
        (acquire loads at GPU scope; every warp holds the whole vector, so the minimum needs
        no shared memory), then fence the async proxy, so the TMA loads they issue next read
        what the threads counted by :func:`arrive_block` stored."""
        L: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        zero = gl.zeros([32], gl.int32, L)
        ptrs = wait_ptr + row_start // BLOCK + zero
        seen = gl.atomic_add(ptrs, zero, sem="acquire", scope="gpu")
        while gl.min(seen, axis=0) < need:
            seen = gl.atomic_add(ptrs, zero, sem="acquire", scope="gpu")
        gl.inline_asm_elementwise("fence.proxy.async.global; mov.b32 $0, $1;", "=r,r",
                                  [seen], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _lockstep_wait(sync_ptr, need):
        """Spin until ``sync[0] >= need`` (the tiles whose loads every program has issued),
        at most ``_LOCKSTEP_SPINS`` reads; returns whether the wave arrived in time. The
        programs start each wave's tiles together, so the row blocks and weight tiles they
        share are read from L2 rather than DRAM. The bound keeps a program that is not
        resident (another kernel holds its SM) from deadlocking the others, and the caller
        stops waiting after the first miss, so such a launch pays one bound per program, not
        one per tile."""
        seen = gl.load(sync_ptr, volatile=True)
        spins = 0
        while (seen < need) & (spins < _LOCKSTEP_SPINS):
            seen = gl.load(sync_ptr, volatile=True)
            spins += 1
        return seen >= need

    @gluon.jit
    def lockstep_before_tile(sync_ptr, in_step, tile, num_tiles, LOCKSTEP: gl.constexpr):
        """A producer's wait before loading ``tile`` of its persistent loop (``LOCKSTEP``):
        every program has issued the loads of the tiles before it in the previous waves.
        ``in_step`` is whether this program's waits so far arrived in time (start with a
        true tensor); returns it updated, so that after a first miss it waits no more."""
        if LOCKSTEP:
            if in_step:
                in_step = _lockstep_wait(sync_ptr,
                                         gl.minimum(num_tiles, tile - gl.program_id(0)))
        return in_step

    @gluon.jit
    def lockstep_tile_done(sync_ptr):
        """Count one tile whose loads this program has issued (:func:`_lockstep_wait`)."""
        gl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")

    @gluon.jit
    def enabled_tiles(enable_ptr, num_tiles, HAS_ENABLE: gl.constexpr):
        """The tile count with ``enable`` applied (0 when it is 0)."""
        if HAS_ENABLE:
            num_tiles = gl.where(gl.load(enable_ptr) != 0, num_tiles, 0)
        return num_tiles
