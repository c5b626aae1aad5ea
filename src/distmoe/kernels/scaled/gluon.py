"""The block-scaled grouped GEMM with 128-wide K groups for Hopper, as a warp-specialised Gluon
kernel.

Same contract as :func:`distmoe.kernels.scaled.triton.scaled_grouped_mm` for the layouts
whose scales change every 128 values of K (:data:`~distmoe.kernels.scaled.triton.MXFP8_REBASED`
and :data:`~distmoe.kernels.scaled.triton.FP8_BLOCK`; its module docstring defines the row
numberings, the arithmetic and the error bounds): per 128-wide K step one FP8 MMA chain (four
k32 WGMMAs) into a fresh fp32 partial, promoted into the fp32 accumulator with both scales,
``acc = fma(P_s, sa * sb, acc)``. That function launches this kernel when its config asks for
it (``ScaledGemmConfig.gluon``) and :func:`gluon_scaled_reason` returns ``None``.

Why: in the Triton kernel the promotion runs in the warps that issue the MMAs, after each
step's MMAs have drained, and the operands come by pointer loads, so the tensor cores wait
for the promotion and the load issue (evidence: docs/performance.md, section "FP8"). Here
each program (one per SM) has three partitions, as in :mod:`distmoe.kernels.w2_forward.gluon`:

* a producer warp issues the TMA loads of the program's tiles ``pid, pid + G, ...`` K step
  by K step into a ring of ``STAGES`` stages of 32 KiB: the tile's 128 activation rows
  (contiguous from the tile's first; rows past the expert's live rows are read and
  discarded, rows past R are TMA's zero fill) and 128 weight rows by 128 values (with SwiGLU
  64 gate rows and the 64 up rows ``F`` further, side by side);
* two consumer warpgroups take every tile, 64 rows each: per K step one m64n128k32 WGMMA
  chain on their half of the A stage into the partial, a wait for it, the stage released,
  the promotion. The two warpgroups wait for the same stages but not for each other, so one
  promotes while the other's MMAs run. The partial is promoted in four 32-column chunks,
  each with one weight scale (a 32-column chunk lies in one 32-row MXFP8 block and one
  128-row block-FP8 block), so a promotion costs one FMA per value; the scales of a step are
  loaded (L2) before its ready wait.

Registers per consumer thread: 64 accumulators and 64 partial values (m64n128); the
partitions set 232 (consumers) and 40 (the producer warp).

Tiles: 128 rows (the padding multiple, ``block_m``) by 128 GEMM columns (``block_n`` 128:
128 output columns; with SwiGLU 64 h columns from 64 gate and 64 up rows, ``block_n`` 64),
``block_k`` 128. The epilogue rounds to bf16 (or SwiGLU in fp32, then bf16) and stores the
live rows in 32-column chunks of 16-byte vectors.

Only for CUDA devices of compute capability 9.x, outside the interpreter, with K a multiple
of 128 and N of 128 (F of 64 with SwiGLU); :func:`gluon_scaled_reason` says when.
"""

from __future__ import annotations

import torch

from distmoe.kernels.base.config import next_power_of_2
from distmoe.kernels.base.device import device_context, num_sms
from distmoe.kernels.base.gluon import (
    HAVE_GLUON,
    gluon_device_reason,
    gluon_ring_reason,
    shared_layout,
)

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    from distmoe.kernels.base.gluon import program_tiles, ring_barriers, tile_info
    from distmoe.kernels.base.tiles import column_halves
    from distmoe.quant.formats import e8m0_to_fp32

__all__ = ["GLUON_SCALED_STAGES", "GLUON_SCALED_TILES", "gluon_scaled_reason",
           "launch_gluon_scaled", "shape_reason", "stage_bytes"]

#: (block_m, block_n, block_k, num_warps) of the configs this kernel runs: ``block_n`` the
#: output columns of a tile (128, or 64 h columns with SwiGLU: 128 GEMM columns either way),
#: ``num_warps`` 8 (two consumer warpgroups, 64 rows each)
GLUON_SCALED_TILES = ((128, 128, 128, 8), (128, 64, 128, 8))
#: ring depths the kernel takes where the ring fits ``_RING_BYTES`` (the epilogue's layout
#: conversions need the rest of the 227 KiB)
GLUON_SCALED_STAGES = (3, 4, 5, 6)
_RING_BYTES = 200 * 1024
_BLOCK_M, _BLOCK_K, _GEMM_N = 128, 128, 128
#: the kernel's register limit: 9 warps of 168 fit the register file; the partitions then set
#: 232 (both consumers) and 40 (the producer warp) per thread
_MAXNREG = 168


def stage_bytes() -> int:
    """Shared memory of one ring stage: 128 E4M3 rows and 128 E4M3 weight rows of 128 values."""
    return (_BLOCK_M + _GEMM_N) * _BLOCK_K


if HAVE_GLUON:

    @gluon.jit
    def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, sa_ptr, sb_ptr,
                  padded_offsets_ptr, row_offsets_ptr, out_ptr, scatter_ptr, K: gl.constexpr,
                  N: gl.constexpr, OUT_N: gl.constexpr, NUM_EXPERTS: gl.constexpr,
                  EXPERTS_POW2: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                  SWIGLU: gl.constexpr, SB_ROWS: gl.constexpr, SCALE_FP32: gl.constexpr,
                  SCATTER: gl.constexpr, PARITY: gl.constexpr):
        """One warp: the TMA loads of every tile of the program, K step by K step."""
        NUM_K: gl.constexpr = K // 128
        OUT_TILE: gl.constexpr = 64 if SWIGLU else 128
        NUM_PID_N: gl.constexpr = OUT_N // OUT_TILE
        num_pid_m, num_tiles, ends, starts, rbeg, rend, eidx = program_tiles(
            padded_offsets_ptr, row_offsets_ptr, NUM_EXPERTS, EXPERTS_POW2, NUM_PID_N, 128, 1)
        nbytes: gl.constexpr = a_desc.block_type.nbytes + (2 if SWIGLU else 1) * \
            b_desc.block_type.nbytes
        count = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            pid_n, expert, _row, act_start, _live = tile_info(
                tile, num_pid_m, ends, starts, rbeg, rend, eidx, NUM_PID_N, GROUP_M,
                NUM_EXPERTS, 128, False)
            w_row = expert * N + pid_n * OUT_TILE  # gate (or the only) weight rows
            for k in range(NUM_K):
                stage = count % STAGES
                mbarrier.wait(empty.index(stage), ((count // STAGES) & 1) ^ 1)
                bar = ready.index(stage)
                mbarrier.expect(bar, nbytes)
                tma.async_copy_global_to_shared(a_desc, [act_start, k * 128], bar,
                                                a_bufs.index(stage))
                b = b_bufs.index(stage)
                if SWIGLU:
                    tma.async_copy_global_to_shared(b_desc, [w_row, k * 128], bar,
                                                    b.slice(0, 64))
                    tma.async_copy_global_to_shared(b_desc, [w_row + OUT_N, k * 128], bar,
                                                    b.slice(64, 64))
                else:
                    tma.async_copy_global_to_shared(b_desc, [w_row, k * 128], bar, b)
                count += 1

    @gluon.jit
    def quarters(x):
        """The four 32-column chunks of a ``[64, 128]`` tile."""
        lo, hi = column_halves(x, 64, 128)
        c0, c1 = column_halves(lo, 64, 64)
        c2, c3 = column_halves(hi, 64, 64)
        return c0, c1, c2, c3

    @gluon.jit
    def partial_step(a_bufs, b_bufs, ready, empty, p, count, STAGES: gl.constexpr,
                     ROW0: gl.constexpr):
        """A consumer's FP8 MMA chain of one 128-wide K step into a fresh partial ``p``
        (``[64, 128]``, rows ``ROW0`` to ``ROW0 + 63`` of the A stage), waited for, the stage
        released. Returns ``(p, count + 1)``."""
        stage = count % STAGES
        mbarrier.wait(ready.index(stage), (count // STAGES) & 1)
        p = warpgroup_mma(a_bufs.index(stage).slice(ROW0, 64),
                          b_bufs.index(stage).permute((1, 0)), p, use_acc=False, is_async=True)
        p = warpgroup_mma_wait(0, deps=(p,))
        mbarrier.arrive(empty.index(stage))
        return p, count + 1

    @gluon.jit
    def promote(acc0, acc1, acc2, acc3, p, c0, c1, c2, c3):
        """``acc_i = fma(p_i, c_i, acc_i)`` over the four 32-column chunks of the partial
        (``c_i``: the chunks' scale products, one FMA per value)."""
        p0, p1, p2, p3 = quarters(p)
        return (gl.fma(p0, c0, acc0), gl.fma(p1, c1, acc1), gl.fma(p2, c2, acc2),
                gl.fma(p3, c3, acc3))

    @gluon.jit
    def decode_scale(s, SCALE_FP32: gl.constexpr):
        """fp32 value of scales as stored (E8M0 bytes decoded)."""
        if SCALE_FP32:
            return s
        else:
            return e8m0_to_fp32(s.to(gl.int32))

    @gluon.jit
    def _store_chunk(out_ptr, scatter_ptr, act_start, row_start, num_live, col0, value,
                     OUT_N: gl.constexpr, SCATTER: gl.constexpr):
        """Masked 16-byte stores of a ``[64, 32]`` fp32 chunk, rounded to bf16, into rows
        ``act_start + i`` (``i < num_live``), columns ``col0 + j`` of the output; with
        ``SCATTER`` at the addresses ``scatter[row_start + i]`` instead (0: not stored)."""
        L: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        v = gl.convert_layout(value.to(gl.bfloat16), L)
        i = gl.arange(0, 64, layout=gl.SliceLayout(1, L))
        j = gl.arange(0, 32, layout=gl.SliceLayout(0, L))
        live = i < num_live
        if SCATTER:
            dst = gl.load(scatter_ptr + row_start + i, mask=live, other=0)
            rows = gl.multiple_of(dst.to(gl.pointer_type(gl.bfloat16)), 16)
            live = live & (dst != 0)
        else:
            rows = gl.multiple_of(out_ptr + (act_start + i).to(gl.int64) * OUT_N, 16)
        ptrs = gl.expand_dims(rows, 1) + gl.expand_dims(col0 + j, 0)
        gl.store(ptrs, v, mask=gl.expand_dims(live, 1))

    @gluon.jit
    def _consumer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, sa_ptr, sb_ptr,
                  padded_offsets_ptr, row_offsets_ptr, out_ptr, scatter_ptr, K: gl.constexpr,
                  N: gl.constexpr, OUT_N: gl.constexpr, NUM_EXPERTS: gl.constexpr,
                  EXPERTS_POW2: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                  SWIGLU: gl.constexpr, SB_ROWS: gl.constexpr, SCALE_FP32: gl.constexpr,
                  SCATTER: gl.constexpr, PARITY: gl.constexpr):
        """One warpgroup: rows ``64 PARITY`` to ``64 PARITY + 63`` of every tile of the
        program: MMAs, promotions and the epilogue."""
        NUM_K: gl.constexpr = K // 128
        KS: gl.constexpr = K // 128  # scale columns of a row
        OUT_TILE: gl.constexpr = 64 if SWIGLU else 128
        NUM_PID_N: gl.constexpr = OUT_N // OUT_TILE
        ROW0: gl.constexpr = PARITY * 64
        ACC: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
        num_pid_m, num_tiles, ends, starts, rbeg, rend, eidx = program_tiles(
            padded_offsets_ptr, row_offsets_ptr, NUM_EXPERTS, EXPERTS_POW2, NUM_PID_N, 128, 4)
        zero = gl.zeros([64, 128], gl.float32, ACC)
        i = gl.arange(0, 64, layout=gl.SliceLayout(1, ACC))
        if SCALE_FP32:
            one = 1.0
        else:
            one = 127
        count = 0
        p = zero
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            pid_n, expert, row_start, act_start, num_live = tile_info(
                tile, num_pid_m, ends, starts, rbeg, rend, eidx, NUM_PID_N, GROUP_M,
                NUM_EXPERTS, 128, False)
            row_start += ROW0
            act_start += ROW0
            num_live -= ROW0
            sa_rows = sa_ptr + (act_start + i).to(gl.int64) * KS
            live = i < num_live
            # the weight rows of the four 32-column chunks (gate, gate, up, up with SwiGLU)
            # and their scale rows in the [E N / SB_ROWS, KS] view
            r0 = expert * N + pid_n * OUT_TILE
            if SWIGLU:
                r2 = r0 + OUT_N
            else:
                r2 = r0 + 64
            sb0 = sb_ptr + (r0 // SB_ROWS).to(gl.int64) * KS
            sb1 = sb_ptr + ((r0 + 32) // SB_ROWS).to(gl.int64) * KS
            sb2 = sb_ptr + (r2 // SB_ROWS).to(gl.int64) * KS
            sb3 = sb_ptr + ((r2 + 32) // SB_ROWS).to(gl.int64) * KS
            acc0, acc1, acc2, acc3 = quarters(zero)
            for k in range(NUM_K):
                # this step's scales (L2), loaded before the ring wait
                sa = decode_scale(gl.load(sa_rows + k, mask=live, other=one), SCALE_FP32)
                s0 = decode_scale(gl.load(sb0 + k), SCALE_FP32)
                s1 = decode_scale(gl.load(sb1 + k), SCALE_FP32)
                s2 = decode_scale(gl.load(sb2 + k), SCALE_FP32)
                s3 = decode_scale(gl.load(sb3 + k), SCALE_FP32)
                p, count = partial_step(a_bufs, b_bufs, ready, empty, p, count, STAGES, ROW0)
                # promotion: the row scales broadcast over the tile (registers only), cut
                # into the chunks like the partial, times each chunk's weight scale
                sa_full, _ = gl.broadcast(gl.expand_dims(sa, 1), zero)
                a0, a1, a2, a3 = quarters(sa_full)
                acc0, acc1, acc2, acc3 = promote(acc0, acc1, acc2, acc3, p, a0 * s0, a1 * s1,
                                                 a2 * s2, a3 * s3)

            n0 = pid_n * OUT_TILE
            if SWIGLU:
                h0 = acc0 * (1.0 / (1.0 + gl.exp(-acc0))) * acc2
                h1 = acc1 * (1.0 / (1.0 + gl.exp(-acc1))) * acc3
                _store_chunk(out_ptr, scatter_ptr, act_start, row_start, num_live, n0, h0,
                             OUT_N, SCATTER)
                _store_chunk(out_ptr, scatter_ptr, act_start, row_start, num_live, n0 + 32, h1,
                             OUT_N, SCATTER)
            else:
                _store_chunk(out_ptr, scatter_ptr, act_start, row_start, num_live, n0, acc0,
                             OUT_N, SCATTER)
                _store_chunk(out_ptr, scatter_ptr, act_start, row_start, num_live, n0 + 32,
                             acc1, OUT_N, SCATTER)
                _store_chunk(out_ptr, scatter_ptr, act_start, row_start, num_live, n0 + 64,
                             acc2, OUT_N, SCATTER)
                _store_chunk(out_ptr, scatter_ptr, act_start, row_start, num_live, n0 + 96,
                             acc3, OUT_N, SCATTER)

    @gluon.jit
    def _gluon_scaled_kernel(
        a_desc,  # host descriptor of A [R, K] (E4M3), block [128, 128]
        b_desc,  # host descriptor of the weights [E N, K] (E4M3), block [128 or 64, 128]
        sa_ptr,  # activation scales [R, K/128] (E8M0 bytes or float32)
        sb_ptr,  # weight scales [E N / SB_ROWS, K/128]
        padded_offsets_ptr,  # int32 [E + 1]
        row_offsets_ptr,  # int32 [E + 1]
        out_ptr,  # bf16 [R, OUT_N] (not SCATTER)
        scatter_ptr,  # int64 [R_cap]: output row addresses by padded row (SCATTER)
        K: gl.constexpr,
        N: gl.constexpr,  # weight rows per expert (2F with SwiGLU)
        OUT_N: gl.constexpr,  # output columns (N, or F with SwiGLU)
        NUM_EXPERTS: gl.constexpr,
        EXPERTS_POW2: gl.constexpr,
        GROUP_M: gl.constexpr,
        STAGES: gl.constexpr,
        SWIGLU: gl.constexpr,
        SB_ROWS: gl.constexpr,  # weight rows per scale (32 MXFP8, 128 block FP8)
        SCALE_FP32: gl.constexpr,
        SCATTER: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 128, 128], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 128, 128], b_desc.layout)
        # ready: the producer's expect-tx arrive; empty: released by both consumers
        ready, empty, _turn = ring_barriers(STAGES, 1, 2)
        # (the argument lists are written out: a tuple built here loses the constexprs)
        gl.warp_specialize([
            (_consumer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, sa_ptr, sb_ptr,
                         padded_offsets_ptr, row_offsets_ptr, out_ptr, scatter_ptr, K, N,
                         OUT_N, NUM_EXPERTS, EXPERTS_POW2, GROUP_M, STAGES, SWIGLU, SB_ROWS,
                         SCALE_FP32, SCATTER, 0)),
            (_consumer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, sa_ptr, sb_ptr,
                         padded_offsets_ptr, row_offsets_ptr, out_ptr, scatter_ptr, K, N,
                         OUT_N, NUM_EXPERTS, EXPERTS_POW2, GROUP_M, STAGES, SWIGLU, SB_ROWS,
                         SCALE_FP32, SCATTER, 1)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, sa_ptr, sb_ptr,
                         padded_offsets_ptr, row_offsets_ptr, out_ptr, scatter_ptr, K, N,
                         OUT_N, NUM_EXPERTS, EXPERTS_POW2, GROUP_M, STAGES, SWIGLU, SB_ROWS,
                         SCALE_FP32, SCATTER, 0)),
        ], [4, 1], [232, 40])


def shape_reason(*, k: int, n: int, swiglu: bool, k_group: int, block_m: int, block_n: int,
                 block_k: int, stages: int, warps: int) -> str | None:
    """``None`` when the kernel can tile this case (whatever the device), else why not:
    ``k`` / ``n`` the GEMM's K and weight rows per expert (2F with ``swiglu``), ``k_group``
    the values per scale along K, and the config's tile, ring depth and warps."""
    reason = gluon_ring_reason(
        "block-scaled GEMM", GLUON_SCALED_TILES, (block_m, block_n, block_k, warps),
        "block_n 128, or 64 with SwiGLU; two consumer warpgroups (num_warps 8)",
        per_stage=stage_bytes(), stages=stages, depths=GLUON_SCALED_STAGES,
        ring_bytes=_RING_BYTES)
    if reason is None and (block_n == 64) != swiglu:
        reason = f"block_n must be 64 with SwiGLU and 128 without, got {block_n}"
    if reason is None and k_group != 128:
        reason = f"the Gluon kernel takes scales per 128 values of K, got k_group {k_group}"
    out_n = n // 2 if swiglu else n
    if reason is None and (k % 128 or out_n % block_n):
        reason = (f"K ({k}) must be a multiple of 128 and the output width ({out_n}) of "
                  f"{block_n}")
    return reason


def gluon_scaled_reason(device: torch.device, **shape) -> str | None:
    """``None`` when :func:`launch_gluon_scaled` can run this case on ``device`` (keyword
    arguments: :func:`shape_reason`'s), else why not (a sentence)."""
    return gluon_device_reason(device) or shape_reason(**shape)


def launch_gluon_scaled(a_q: torch.Tensor, a_scales: torch.Tensor, b_q: torch.Tensor,
                        b_scales: torch.Tensor, padded_offsets: torch.Tensor,
                        row_offsets: torch.Tensor, out: torch.Tensor, *, swiglu: bool,
                        b_rows: int, scale_fp32: bool, stages: int = 5, group_m: int = 8,
                        programs: int | None = None,
                        scatter_ptrs: torch.Tensor | None = None) -> None:
    """Launch the kernel (arguments validated by
    :func:`~distmoe.kernels.scaled.triton.check_scaled_grouped_mm_args`, ``b_q`` / ``b_scales``
    as it returns them, ``[E, N, K]`` / ``[E, N / b_rows, K / 128]``, and
    :func:`gluon_scaled_reason` returned ``None``). ``programs``: the grid (default one per
    SM); tests pass fewer so that every program walks many tiles. ``scatter_ptrs`` (with
    ``out`` None): each live row at its padded row's address instead."""
    rows, k = a_q.shape
    num_experts, n, _ = b_q.shape
    out_n = n // 2 if swiglu else n
    b_block = [64 if swiglu else 128, 128]
    a_desc = GluonDescriptor(a_q, [rows, k], [k, 1], [128, 128],
                             shared_layout((128, 128), True))
    b_desc = GluonDescriptor(b_q.view(num_experts * n, k), [num_experts * n, k], [k, 1],
                             b_block, shared_layout(tuple(b_block), True))
    tiles = (-(-rows // 128) + num_experts - 1) * (out_n // (64 if swiglu else 128))
    if programs is None:
        programs = num_sms(a_q.device)
    with device_context(a_q.device):
        _gluon_scaled_kernel[(max(1, min(programs, tiles)),)](
            a_desc, b_desc, a_scales, b_scales, padded_offsets, row_offsets,
            scatter_ptrs if out is None else out,
            padded_offsets if scatter_ptrs is None else scatter_ptrs,
            K=k, N=n, OUT_N=out_n, NUM_EXPERTS=num_experts,
            EXPERTS_POW2=max(32, next_power_of_2(num_experts)), GROUP_M=group_m,
            STAGES=stages, SWIGLU=swiglu, SB_ROWS=b_rows, SCALE_FP32=scale_fp32,
            SCATTER=scatter_ptrs is not None, num_warps=4, maxnreg=_MAXNREG,
        )  # fmt: skip
