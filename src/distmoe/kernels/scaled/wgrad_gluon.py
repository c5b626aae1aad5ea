"""FP8 weight gradients for Hopper as a warp-specialised Gluon kernel.

Same contract as :func:`distmoe.kernels.scaled.wgrad.scaled_wgrad` (its module docstring
defines the operands and the arithmetic); that function launches this kernel when its config
asks for it (``ScaledWgradConfig.gluon``) and :func:`gluon_wgrad_reason` returns ``None``.

Why: as for the forward's block-scaled GEMM (:mod:`distmoe.kernels.scaled.gluon`), the
promotion after each 128-token block would otherwise stall the tensor cores. Each program (one
per SM) walks the tiles ``pid, pid + G, ...`` of the (expert, 128-row tile of M, 128-column
tile of N) schedule, expert by expert, with three partitions:

* a producer warp TMA-loads, per token block of the tile's expert, the ``[128, 128]`` blocks of
  ``at`` and ``bt`` (token-contiguous) into a ring of ``STAGES`` stages of 32 KiB;
* two consumer warpgroups take every tile, 64 rows of M each: an m64n128k32 WGMMA chain per
  token block into a fresh partial, the wait, the stage released, and the promotion in four
  32-column chunks, ``acc = fma(P, sa * sb, acc)`` with the row scales and the column scales
  broadcast in registers (one multiply and one FMA per value); an expert with no tokens
  stores zeros. The epilogue rounds to ``out``'s dtype (with ``accumulate``, adds the fp32
  values already there) and stores 16-byte vectors.

Only for CUDA devices of compute capability 9.x, outside the interpreter, with M and N
multiples of 128; :func:`gluon_wgrad_reason` says when.
"""

from __future__ import annotations

import torch

from distmoe.kernels.base.device import device_context, num_sms
from distmoe.kernels.base.gluon import HAVE_GLUON, gluon_device_reason, shared_layout

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    from distmoe.kernels.base.gluon import ring_barriers
    from distmoe.kernels.scaled.gluon import decode_scale, partial_step, promote, quarters

__all__ = ["GLUON_WGRAD_STAGES", "gluon_wgrad_reason", "launch_gluon_scaled_wgrad"]

#: ring depths the kernel takes (stages of 32 KiB within 200 KiB)
GLUON_WGRAD_STAGES = (3, 4, 5, 6)
_MAXNREG = 168


if HAVE_GLUON:

    @gluon.jit
    def _tile(tile, padded_offsets_ptr, TM: gl.constexpr, TN: gl.constexpr):
        """Expert, first row of M, first column of N and the token-block range of ``tile``."""
        expert = tile // (TM * TN)
        t = tile % (TM * TN)
        k_lo = gl.load(padded_offsets_ptr + expert) // 128
        k_hi = gl.load(padded_offsets_ptr + expert + 1) // 128
        return expert, (t // TN) * 128, (t % TN) * 128, k_lo, k_hi

    @gluon.jit
    def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, sa_ptr, sb_ptr,
                  padded_offsets_ptr, out_ptr, R_CAP, M: gl.constexpr, N: gl.constexpr,
                  NUM_EXPERTS: gl.constexpr, STAGES: gl.constexpr, SCALE_FP32: gl.constexpr,
                  ACCUMULATE: gl.constexpr, PARITY: gl.constexpr):
        """One warp: the TMA loads of every tile of the program, token block by block."""
        TM: gl.constexpr = M // 128
        TN: gl.constexpr = N // 128
        nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
        count = 0
        for tile in range(gl.program_id(0), NUM_EXPERTS * TM * TN, gl.num_programs(0)):
            _e, m0, n0, k_lo, k_hi = _tile(tile, padded_offsets_ptr, TM, TN)
            for kb in range(k_lo, k_hi):
                stage = count % STAGES
                mbarrier.wait(empty.index(stage), ((count // STAGES) & 1) ^ 1)
                bar = ready.index(stage)
                mbarrier.expect(bar, nbytes)
                tma.async_copy_global_to_shared(a_desc, [m0, kb * 128], bar, a_bufs.index(stage))
                tma.async_copy_global_to_shared(b_desc, [n0, kb * 128], bar, b_bufs.index(stage))
                count += 1

    @gluon.jit
    def _store_part(out_ptr, expert, m0, n0, value, M: gl.constexpr, N: gl.constexpr,
                    ACCUMULATE: gl.constexpr):
        """A ``[64, 32]`` fp32 chunk at rows ``m0 + i``, columns ``n0 + j`` of ``out[expert]``
        (added to the fp32 values there with ``ACCUMULATE``), 16-byte vectors."""
        L: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
        v = gl.convert_layout(value, L)
        i = gl.arange(0, 64, layout=gl.SliceLayout(1, L))
        j = gl.arange(0, 32, layout=gl.SliceLayout(0, L))
        rows = out_ptr + expert.to(gl.int64) * (M * N) + (m0 + i).to(gl.int64) * N
        ptrs = gl.expand_dims(rows, 1) + gl.expand_dims(n0 + j, 0)
        if ACCUMULATE:
            v = v + gl.load(ptrs)
        gl.store(ptrs, v.to(out_ptr.dtype.element_ty))

    @gluon.jit
    def _consumer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, sa_ptr, sb_ptr,
                  padded_offsets_ptr, out_ptr, R_CAP, M: gl.constexpr, N: gl.constexpr,
                  NUM_EXPERTS: gl.constexpr, STAGES: gl.constexpr, SCALE_FP32: gl.constexpr,
                  ACCUMULATE: gl.constexpr, PARITY: gl.constexpr):
        """One warpgroup: rows ``64 PARITY`` to ``64 PARITY + 63`` of every tile of the
        program."""
        TM: gl.constexpr = M // 128
        TN: gl.constexpr = N // 128
        ROW0: gl.constexpr = PARITY * 64
        ACC: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
        zero = gl.zeros([64, 128], gl.float32, ACC)
        i = gl.arange(0, 64, layout=gl.SliceLayout(1, ACC))
        j = gl.arange(0, 128, layout=gl.SliceLayout(0, ACC))
        count = 0
        p = zero
        for tile in range(gl.program_id(0), NUM_EXPERTS * TM * TN, gl.num_programs(0)):
            expert, m0, n0, k_lo, k_hi = _tile(tile, padded_offsets_ptr, TM, TN)
            m0 += ROW0
            acc0, acc1, acc2, acc3 = quarters(zero)
            for kb in range(k_lo, k_hi):
                # this block's scales: one row each of the block-major scale tables
                sa = decode_scale(gl.load(sa_ptr + kb * M + m0 + i), SCALE_FP32)
                sb = decode_scale(gl.load(sb_ptr + kb * N + n0 + j), SCALE_FP32)
                p, count = partial_step(a_bufs, b_bufs, ready, empty, p, count, STAGES, ROW0)
                # both scale vectors broadcast over the tile (registers only), in chunks
                sa_full, _ = gl.broadcast(gl.expand_dims(sa, 1), zero)
                sb_full, _ = gl.broadcast(gl.expand_dims(sb, 0), zero)
                a0, a1, a2, a3 = quarters(sa_full)
                b0, b1, b2, b3 = quarters(sb_full)
                acc0, acc1, acc2, acc3 = promote(acc0, acc1, acc2, acc3, p, a0 * b0, a1 * b1,
                                                 a2 * b2, a3 * b3)
            _store_part(out_ptr, expert, m0, n0, acc0, M, N, ACCUMULATE)
            _store_part(out_ptr, expert, m0, n0 + 32, acc1, M, N, ACCUMULATE)
            _store_part(out_ptr, expert, m0, n0 + 64, acc2, M, N, ACCUMULATE)
            _store_part(out_ptr, expert, m0, n0 + 96, acc3, M, N, ACCUMULATE)

    @gluon.jit
    def _gluon_scaled_wgrad_kernel(
        a_desc,  # host descriptor of at [M, R_cap] (E4M3), block [128, 128]
        b_desc,  # host descriptor of bt [N, R_cap] (E4M3), block [128, 128]
        sa_ptr,  # [R_cap/128, M] scales (float32 or E8M0 bytes)
        sb_ptr,  # [R_cap/128, N]
        padded_offsets_ptr,  # int32 [E + 1]
        out_ptr,  # [E, M, N] bf16 or fp32
        R_CAP,
        M: gl.constexpr,
        N: gl.constexpr,
        NUM_EXPERTS: gl.constexpr,
        STAGES: gl.constexpr,
        SCALE_FP32: gl.constexpr,
        ACCUMULATE: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 128, 128], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 128, 128], b_desc.layout)
        ready, empty, _turn = ring_barriers(STAGES, 1, 2)
        gl.warp_specialize([
            (_consumer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, sa_ptr, sb_ptr,
                         padded_offsets_ptr, out_ptr, R_CAP, M, N, NUM_EXPERTS, STAGES,
                         SCALE_FP32, ACCUMULATE, 0)),
            (_consumer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, sa_ptr, sb_ptr,
                         padded_offsets_ptr, out_ptr, R_CAP, M, N, NUM_EXPERTS, STAGES,
                         SCALE_FP32, ACCUMULATE, 1)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, sa_ptr, sb_ptr,
                         padded_offsets_ptr, out_ptr, R_CAP, M, N, NUM_EXPERTS, STAGES,
                         SCALE_FP32, ACCUMULATE, 0)),
        ], [4, 1], [232, 40])


def gluon_wgrad_reason(device: torch.device, *, m: int, n: int, block_m: int, block_n: int,
                       stages: int) -> str | None:
    """``None`` when :func:`launch_gluon_scaled_wgrad` can run this case on ``device``, else
    why not (a sentence)."""
    reason = gluon_device_reason(device)
    if reason is None and (block_m, block_n) != (128, 128):
        reason = f"the Gluon FP8 WGRAD runs 128 x 128 tiles, got {block_m} x {block_n}"
    if reason is None and stages not in GLUON_WGRAD_STAGES:
        reason = f"stages must be one of {GLUON_WGRAD_STAGES}, got {stages}"
    if reason is None and (m % 128 or n % 128):
        reason = f"M ({m}) and N ({n}) must be multiples of 128"
    return reason


def launch_gluon_scaled_wgrad(at_q, at_s, bt_q, bt_s, padded_offsets, out, *, scale_fp32: bool,
                              accumulate: bool, stages: int = 5,
                              programs: int | None = None) -> None:
    """Launch the kernel (arguments validated by
    :func:`~distmoe.kernels.scaled.wgrad.scaled_wgrad`, and :func:`gluon_wgrad_reason`
    returned ``None``); ``programs``: the grid (default one per SM)."""
    m, r_cap = at_q.shape
    n = bt_q.shape[0]
    num_experts = out.shape[0]
    layout = shared_layout((128, 128), True)
    a_desc = GluonDescriptor(at_q, [m, r_cap], [r_cap, 1], [128, 128], layout)
    b_desc = GluonDescriptor(bt_q, [n, r_cap], [r_cap, 1], [128, 128], layout)
    tiles = num_experts * (m // 128) * (n // 128)
    if programs is None:
        programs = num_sms(at_q.device)
    with device_context(at_q.device):
        _gluon_scaled_wgrad_kernel[(max(1, min(programs, tiles)),)](
            a_desc, b_desc, at_s, bt_s, padded_offsets, out, r_cap, M=m, N=n,
            NUM_EXPERTS=num_experts, STAGES=stages, SCALE_FP32=scale_fp32,
            ACCUMULATE=accumulate, num_warps=4, maxnreg=_MAXNREG,
        )  # fmt: skip
