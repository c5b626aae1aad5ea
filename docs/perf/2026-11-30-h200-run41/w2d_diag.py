"""Variants of the Gluon W2 DGRAD's consumer epilogue (distmoe.kernels.w2_dgrad_gluon at
d320d34), for timing only (run 41): the production producer, a consumer whose epilogue is
chosen by ``VAR``:

0 production's order (addr and score loaded per part, g / u loaded where used);
1 no epilogue (diagnostic: the MMAs and a never-taken store of the accumulator's sum);
2 no h1 loads (diagnostic: g and u taken from the accumulator);
3 no grad_h1 / h2 stores (diagnostic: the results summed into the score part);
4 the rows' addresses and scores loaded once per tile;
5 as 4, and each part's g / u loaded while the part before it is computed;
6 as 5, and the first part's addresses, scores, g and u loaded before the tile's MMAs;
8 as 0 without the score loads (diagnostic: score 1);
9 as 8 without the address loads (diagnostic: every row treated as live and not null; the
  score parts not stored);
10 as 0 with the scores read from a contiguous fp32 array by activation row (passed as
  ``h1_offset_ptr``), not through the row addresses: no load waits for another.

Variants 4-6 compute the same values in the same order as 0 (same bits expected).
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

from distmoe.kernels._gluon_ring import (_consumer_walk, _mma_steps, _ring_barriers,
                                         _tile_count, _tile_info_reloaded, _wait_turn)
from distmoe.kernels.w2_backward import _column_halves
from distmoe.kernels.w2_dgrad_gluon import _MAXNREG, _part_layout, _producer


@gluon.jit
def _rows(ptrs_ptr, row_start, num_live, SCORED: gl.constexpr, BLOCK_M: gl.constexpr,
          L: gl.constexpr, VAR: gl.constexpr = 0, scores_ptr=None, act_start=0):
    i = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, L))
    live = i < num_live
    if VAR == 9:
        addr = gl.full([BLOCK_M], 1, gl.int64, gl.SliceLayout(1, L))
    else:
        addr = gl.load(ptrs_ptr + row_start + i, mask=live, other=0)
    score = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, L))
    if SCORED:
        if VAR == 10:
            score = gl.load(scores_ptr + act_start + i, mask=live, other=0.0)
        elif VAR >= 8:
            score += 1.0
        else:
            score = gl.load(addr.to(gl.pointer_type(gl.float32)), mask=live & (addr != 0),
                            other=0.0)
    return i, live, addr, score


@gluon.jit
def _load_gu(h1_base, act_start, i, live, addr, col0, FFN: gl.constexpr, W: gl.constexpr,
             L: gl.constexpr):
    j = gl.arange(0, W, layout=gl.SliceLayout(0, L))
    rows = gl.expand_dims((act_start + i).to(gl.int64), 1)
    col = gl.expand_dims(col0 + j, 0)
    load_mask = gl.expand_dims(live & (addr != 0), 1)
    g_ptrs = gl.multiple_of(h1_base + rows * (2 * FFN), [16, 16]) + col
    g = gl.load(g_ptrs, mask=load_mask, other=0.0)
    u = gl.load(g_ptrs + FFN, mask=load_mask, other=0.0)
    return g, u


@gluon.jit
def _bwd(part, g, u, i, live, score, act_start, grad_h1_ptr, h2_ptr, col0,
         FFN: gl.constexpr, STORE_H2: gl.constexpr, SCORED: gl.constexpr, W: gl.constexpr,
         L: gl.constexpr, VAR: gl.constexpr):
    grad_h2 = gl.convert_layout(part, L)
    if VAR == 2:
        g = grad_h2
        u = grad_h2 * 0.5
    else:
        g = g.to(gl.float32)
        u = u.to(gl.float32)
    j = gl.arange(0, W, layout=gl.SliceLayout(0, L))
    rows = gl.expand_dims((act_start + i).to(gl.int64), 1)
    col = gl.expand_dims(col0 + j, 0)
    store_mask = gl.expand_dims(live, 1)
    s = 1.0 / (1.0 + gl.exp(-g))
    silu = g * s
    dot = gl.zeros_like(score)
    grad_u = grad_h2 * silu
    if SCORED:
        dot = gl.sum(grad_u * u, axis=1)
        sc = gl.expand_dims(score, 1)
        grad_u = grad_u * sc
        u = u * sc
    grad_g = grad_h2 * u * (s * (1.0 + g * (1.0 - s)))
    if VAR == 3:
        dot += gl.sum(grad_g + grad_u + silu * u, axis=1)
    else:
        out_ptrs = gl.multiple_of(grad_h1_ptr + rows * (2 * FFN), [16, 16]) + col
        gl.store(out_ptrs, grad_g.to(gl.bfloat16), mask=store_mask)
        gl.store(out_ptrs + FFN, grad_u.to(gl.bfloat16), mask=store_mask)
        if STORE_H2:
            h2_rows = gl.multiple_of(h2_ptr + rows * FFN, [16, 16])
            gl.store(h2_rows + col, (silu * u).to(gl.bfloat16), mask=store_mask)
    return dot


@gluon.jit
def _part_v0(part, scores_ptr, ptrs_ptr, row_start, act_start, num_live, h1_base, grad_h1_ptr, h2_ptr,
             col0, FFN: gl.constexpr, STORE_H2: gl.constexpr, SCORED: gl.constexpr,
             BLOCK_M: gl.constexpr, W: gl.constexpr, VAR: gl.constexpr):
    L: gl.constexpr = _part_layout(W)
    i, live, addr, score = _rows(ptrs_ptr, row_start, num_live, SCORED, BLOCK_M, L, VAR,
                                 scores_ptr, act_start)
    g = gl.zeros([BLOCK_M, W], gl.bfloat16, L)
    u = g
    if VAR != 2:
        g, u = _load_gu(h1_base, act_start, i, live, addr, col0, FFN, W, L)
    return _bwd(part, g, u, i, live, score, act_start, grad_h1_ptr, h2_ptr, col0, FFN,
                STORE_H2, SCORED, W, L, VAR)


@gluon.jit
def _consumer_v(a_desc, w_desc, a_bufs, b_bufs, ready, empty, turn, ptrs_ptr,
                padded_offsets_ptr, row_offsets_ptr, h1_ptr, h1_offset_ptr, grad_h1_ptr, h2_ptr,
                FFN: gl.constexpr, HIDDEN: gl.constexpr, NUM_EXPERTS: gl.constexpr,
                EXPERTS_POW2: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                H1_OFFSET: gl.constexpr, STORE_H2: gl.constexpr, SCORED: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                RELOAD_BOUNDS: gl.constexpr, PARITY: gl.constexpr, VAR: gl.constexpr):
    NUM_K: gl.constexpr = HIDDEN // BLOCK_K
    NUM_PID_N: gl.constexpr = FFN // BLOCK_N
    Q: gl.constexpr = BLOCK_N // 4
    L: gl.constexpr = _part_layout(Q)
    ACC: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    num_pid_m, num_tiles = _tile_count(padded_offsets_ptr, NUM_EXPERTS, NUM_PID_N, BLOCK_M)
    h1_base = h1_ptr
    if H1_OFFSET:
        h1_base = h1_ptr + gl.load(h1_offset_ptr)
    first, step, count = _consumer_walk(NUM_K, False, PARITY)
    turns = 0
    for tile in range(first, num_tiles, step):
        pid_n, expert, row_start, act_start, num_live = _tile_info_reloaded(
            tile, num_pid_m, padded_offsets_ptr, row_offsets_ptr, NUM_PID_N, GROUP_M,
            NUM_EXPERTS, EXPERTS_POW2, BLOCK_M, 4)
        n0 = pid_n * BLOCK_N
        if VAR == 6:
            i, live, addr, score = _rows(ptrs_ptr, row_start, num_live, SCORED, BLOCK_M, L)
            g0, u0 = _load_gu(h1_base, act_start, i, live, addr, n0, FFN, Q, L)
        turns = _wait_turn(turn, turns, PARITY)
        acc, count = _mma_steps(a_bufs, b_bufs, ready, empty,
                                gl.zeros([BLOCK_M, BLOCK_N], gl.float32, ACC), count, NUM_K,
                                STAGES, 0, BLOCK_M, False)
        mbarrier.arrive(turn.index(1 - PARITY))
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES))
        count += NUM_K
        if VAR == 1:
            tot = gl.sum(gl.sum(acc, axis=1), axis=0)
            gl.store(h2_ptr, tot.to(gl.bfloat16), mask=tot == 12345.5)
        else:
            lo, hi = _column_halves(acc, BLOCK_M, BLOCK_N)
            q0, q1 = _column_halves(lo, BLOCK_M, BLOCK_N // 2)
            q2, q3 = _column_halves(hi, BLOCK_M, BLOCK_N // 2)
            if VAR <= 3 or VAR >= 8:
                p3 = _part_v0(q0, h1_offset_ptr, ptrs_ptr, row_start, act_start, num_live, h1_base,
                              grad_h1_ptr, h2_ptr, n0, FFN, STORE_H2, SCORED, BLOCK_M, Q, VAR)
                p3 += _part_v0(q1, h1_offset_ptr, ptrs_ptr, row_start, act_start, num_live, h1_base,
                               grad_h1_ptr, h2_ptr, n0 + Q, FFN, STORE_H2, SCORED, BLOCK_M, Q,
                               VAR)
                p3 += _part_v0(q2, h1_offset_ptr, ptrs_ptr, row_start, act_start, num_live, h1_base,
                               grad_h1_ptr, h2_ptr, n0 + 2 * Q, FFN, STORE_H2, SCORED,
                               BLOCK_M, Q, VAR)
                p3 += _part_v0(q3, h1_offset_ptr, ptrs_ptr, row_start, act_start, num_live, h1_base,
                               grad_h1_ptr, h2_ptr, n0 + 3 * Q, FFN, STORE_H2, SCORED,
                               BLOCK_M, Q, VAR)
                i, live, addr, _s = _rows(ptrs_ptr, row_start, num_live, False, BLOCK_M, L, VAR)
            else:
                if VAR != 6:
                    i, live, addr, score = _rows(ptrs_ptr, row_start, num_live, SCORED,
                                                 BLOCK_M, L)
                    g0, u0 = _load_gu(h1_base, act_start, i, live, addr, n0, FFN, Q, L)
                if VAR == 4:
                    p3 = _bwd(q0, g0, u0, i, live, score, act_start, grad_h1_ptr, h2_ptr, n0,
                              FFN, STORE_H2, SCORED, Q, L, VAR)
                    g1, u1 = _load_gu(h1_base, act_start, i, live, addr, n0 + Q, FFN, Q, L)
                    p3 += _bwd(q1, g1, u1, i, live, score, act_start, grad_h1_ptr, h2_ptr,
                               n0 + Q, FFN, STORE_H2, SCORED, Q, L, VAR)
                    g2, u2 = _load_gu(h1_base, act_start, i, live, addr, n0 + 2 * Q, FFN, Q,
                                      L)
                    p3 += _bwd(q2, g2, u2, i, live, score, act_start, grad_h1_ptr, h2_ptr,
                               n0 + 2 * Q, FFN, STORE_H2, SCORED, Q, L, VAR)
                    g3, u3 = _load_gu(h1_base, act_start, i, live, addr, n0 + 3 * Q, FFN, Q,
                                      L)
                    p3 += _bwd(q3, g3, u3, i, live, score, act_start, grad_h1_ptr, h2_ptr,
                               n0 + 3 * Q, FFN, STORE_H2, SCORED, Q, L, VAR)
                else:
                    g1, u1 = _load_gu(h1_base, act_start, i, live, addr, n0 + Q, FFN, Q, L)
                    p3 = _bwd(q0, g0, u0, i, live, score, act_start, grad_h1_ptr, h2_ptr, n0,
                              FFN, STORE_H2, SCORED, Q, L, VAR)
                    g2, u2 = _load_gu(h1_base, act_start, i, live, addr, n0 + 2 * Q, FFN, Q,
                                      L)
                    p3 += _bwd(q1, g1, u1, i, live, score, act_start, grad_h1_ptr, h2_ptr,
                               n0 + Q, FFN, STORE_H2, SCORED, Q, L, VAR)
                    g3, u3 = _load_gu(h1_base, act_start, i, live, addr, n0 + 3 * Q, FFN, Q,
                                      L)
                    p3 += _bwd(q2, g2, u2, i, live, score, act_start, grad_h1_ptr, h2_ptr,
                               n0 + 2 * Q, FFN, STORE_H2, SCORED, Q, L, VAR)
                    p3 += _bwd(q3, g3, u3, i, live, score, act_start, grad_h1_ptr, h2_ptr,
                               n0 + 3 * Q, FFN, STORE_H2, SCORED, Q, L, VAR)
            if VAR == 9:
                gl.store(h2_ptr + i, p3.to(gl.bfloat16), mask=p3 == 12345.5)
            elif SCORED:
                gl.store(addr.to(gl.pointer_type(gl.float32)) + 1 + pid_n, p3,
                         mask=live & (addr != 0))


@gluon.jit
def _kernel_v(a_desc, w_desc, ptrs_ptr, padded_offsets_ptr, row_offsets_ptr, h1_ptr,
              h1_offset_ptr, grad_h1_ptr, h2_ptr, FFN: gl.constexpr, HIDDEN: gl.constexpr,
              NUM_EXPERTS: gl.constexpr, EXPERTS_POW2: gl.constexpr, GROUP_M: gl.constexpr,
              STAGES: gl.constexpr, H1_OFFSET: gl.constexpr, STORE_H2: gl.constexpr,
              SCORED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              BLOCK_K: gl.constexpr, RELOAD_BOUNDS: gl.constexpr, VAR: gl.constexpr,
              num_warps: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, BLOCK_N], w_desc.layout)
    ready, empty, turn = _ring_barriers(STAGES, 1, 1)
    gl.warp_specialize([
        (_consumer_v, (a_desc, w_desc, a_bufs, b_bufs, ready, empty, turn, ptrs_ptr,
                       padded_offsets_ptr, row_offsets_ptr, h1_ptr, h1_offset_ptr,
                       grad_h1_ptr, h2_ptr, FFN, HIDDEN, NUM_EXPERTS, EXPERTS_POW2, GROUP_M,
                       STAGES, H1_OFFSET, STORE_H2, SCORED, BLOCK_M, BLOCK_N, BLOCK_K,
                       RELOAD_BOUNDS, 0, VAR)),
        (_consumer_v, (a_desc, w_desc, a_bufs, b_bufs, ready, empty, turn, ptrs_ptr,
                       padded_offsets_ptr, row_offsets_ptr, h1_ptr, h1_offset_ptr,
                       grad_h1_ptr, h2_ptr, FFN, HIDDEN, NUM_EXPERTS, EXPERTS_POW2, GROUP_M,
                       STAGES, H1_OFFSET, STORE_H2, SCORED, BLOCK_M, BLOCK_N, BLOCK_K,
                       RELOAD_BOUNDS, 1, VAR)),
        (_producer, (a_desc, w_desc, a_bufs, b_bufs, ready, empty, turn, ptrs_ptr,
                     padded_offsets_ptr, row_offsets_ptr, h1_ptr, h1_offset_ptr,
                     grad_h1_ptr, h2_ptr, FFN, HIDDEN, NUM_EXPERTS, EXPERTS_POW2, GROUP_M,
                     STAGES, H1_OFFSET, STORE_H2, SCORED, BLOCK_M, BLOCK_N, BLOCK_K,
                     RELOAD_BOUNDS, 1)),
    ], [4, 1], [232, 40])


def launch(grad_h3_ptrs, padded_offsets, row_offsets, w2, grad_h3_rows, h1, grad_h1_out, *,
           h2_out, var, stages=5, group_m=8, scores=None):
    from distmoe.kernels._common import device_context, next_power_of_2, num_sms

    num_experts, hidden, ffn = w2.shape
    bm, bn, bk = 128, 128, 64
    a_layout = gl.NVMMASharedLayout.get_default_for([bm, bk], gl.bfloat16)
    w_layout = gl.NVMMASharedLayout.get_default_for([bk, bn], gl.bfloat16)
    a_desc = GluonDescriptor(grad_h3_rows, list(grad_h3_rows.shape), [hidden, 1], [bm, bk],
                             a_layout)
    w_desc = GluonDescriptor(w2.view(num_experts * hidden, ffn), [num_experts * hidden, ffn],
                             [ffn, 1], [bk, bn], w_layout)
    tiles_cap = (grad_h3_ptrs.shape[0] // bm) * (ffn // bn)
    with device_context(w2.device):
        _kernel_v[(max(1, min(num_sms(w2.device), tiles_cap)),)](
            a_desc, w_desc, grad_h3_ptrs, padded_offsets, row_offsets, h1,
            row_offsets if scores is None else scores,
            grad_h1_out, h2_out, FFN=ffn, HIDDEN=hidden, NUM_EXPERTS=num_experts,
            EXPERTS_POW2=max(32, next_power_of_2(num_experts)), GROUP_M=group_m,
            STAGES=stages, H1_OFFSET=False, STORE_H2=True, SCORED=True, BLOCK_M=bm,
            BLOCK_N=bn, BLOCK_K=bk, RELOAD_BOUNDS=True, VAR=var, num_warps=4,
            maxnreg=_MAXNREG)
