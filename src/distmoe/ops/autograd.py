"""Autograd for :class:`distmoe.ops.MoEContext` (training, full-save version).

Forward (same barriers as inference, see :mod:`distmoe.ops.context`): the W13 kernel also
writes ``h1 = [g | u]`` and the gathered input rows ``x`` into per-call tensors ``[R_cap, 2F]``
and ``[R_cap, D]`` that are saved for backward, and the owner keeps a copy of its returned
route results (combine rows ``[T*K, D]``, needed for the score gradients) before combining.
The routing tables, ids (non-executed routes as -1) and scores are saved too. Nothing of a
call lives in the context's buffers after the forward, so several forwards (layers sharing
one context, or not) may run before their backwards.

Backward is **collective**: every rank of the EP group must run the backward of the same
calls in the same order (one call's backward on one rank pairs with the same call's backward
on every other rank). Per call:

    1. owner:  route_grads: combine[t*K+k] <- bf16(score[t,k] * grad_y[t]) for executed routes;
               grad_scores[t,k] = <grad_y[t], h3[t,k]>
    2. barrier                     (route output gradients visible to the experts)
    3. expert: w2_dgrad_swiglu_bwd gathers grad_h3 from the owners' combine slots
               (tables.scatter_ptrs), writes grad_h1, h2 and the gathered grad_h3;
               w2_wgrad and w13_wgrad accumulate fp32 weight gradients;
               w13_dgrad_scatter stores each route's input gradient into the owner's
               dispatch row t*K+k (tables.bwd_scatter_ptrs)
    4. barrier                     (all route input gradients have landed)
    5. owner:  reduce_routes: grad_x[t] = bf16(sum_k dispatch[t*K+k]) over executed routes

Why the peer writes are safe:

* step 1 writes this rank's combine buffer. Its last readers are peers in step 3 of the
  previous backward on this context, and those finished before that backward's barrier 4,
  which this rank has passed. The next forward's W2 scatter writes it only after that
  forward's first barrier, which peers reach after their step 3 of this backward.
* step 3's scatter writes peers' dispatch rows. Peers read their dispatch in forward (the
  W13 gather, finished before the forward's second barrier) and in step 5 of the previous
  backward on this context (finished before they entered barrier 2 of this one, which the
  writer has passed). Nothing else reads dispatch.
* No barrier after step 5: the only reader of this rank's dispatch in step 5 is this rank,
  and the next write into it is either this rank's own next-forward publish (ordered after
  step 5 on the same stream) or a peer's write after a later barrier (the next forward's
  first barrier, or barrier 2 of the next backward), which this rank enters only after its
  step 5.

Returned gradients: x (bf16), scores (scores' dtype), w13 and w2 in the parameters' dtype
(fp32 buffers accumulated by the WGRAD kernels, then cast; autograd adds them into ``.grad``).
Routes beyond the receive bound are not executed: they get zero gradients everywhere.
"""

from __future__ import annotations

import torch

from ..kernels.route_grad import reduce_routes, route_grads
from ..kernels.w2_backward import W2DgradConfig, WgradConfig, w2_dgrad_swiglu_bwd, w2_wgrad
from ..kernels.w13_backward import W13DgradConfig, w13_dgrad_scatter, w13_wgrad


class MoEFunction(torch.autograd.Function):
    """``y = MoEFunction.apply(moe_ctx, x, expert_ids, scores, w13, w2)`` (collective)."""

    @staticmethod
    def forward(ctx, moe, x, expert_ids, scores, w13, w2):
        y, saved = moe._forward(x, expert_ids, scores, w13, w2, save=True)
        ctx.moe = moe
        ctx.tables = saved["tables"]
        ctx.scores_dtype = scores.dtype
        ctx.save_for_backward(saved["h1"], saved["x_rows"], saved["h3_routes"],
                              saved["ids_executed"], saved["scores_f32"], w13, w2)
        ctx.x_shape = tuple(x.shape)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        moe = ctx.moe
        moe._check_open()
        h1, x_rows, h3_routes, ids_executed, scores_f32, w13, w2 = ctx.saved_tensors
        tables = ctx.tables
        heap = moe.heap
        cfg = moe.cfg
        block = cfg.row_block
        T, K = ids_executed.shape
        D, F = cfg.hidden, cfg.ffn
        E_l = moe.num_local_experts
        R = moe.row_capacity
        dev = moe.device
        grad_y = grad_y.to(torch.bfloat16).contiguous()
        combine_rows = moe._combine[:T * K]
        dispatch_rows = moe._dispatch[:T * K]

        # 1. owner: score gradients and route output gradients into its combine slots
        grad_scores = torch.empty(T, K, dtype=torch.float32, device=dev)
        route_grads(grad_y, h3_routes, ids_executed, scores_f32, combine_rows, grad_scores)
        # 2. route output gradients visible to the experts
        heap.barrier()
        # 3. expert side
        offsets = tables.padded_offsets
        grad_h1 = torch.zeros(R, 2 * F, dtype=torch.bfloat16, device=dev)
        h2 = torch.zeros(R, F, dtype=torch.bfloat16, device=dev)
        grad_h3 = torch.zeros(R, D, dtype=torch.bfloat16, device=dev)
        w2_dgrad_swiglu_bwd(tables.scatter_ptrs, offsets, w2, h1, grad_h1, h2_out=h2,
                            grad_h3_out=grad_h3,
                            config=W2DgradConfig.from_heuristic(hidden=D, ffn=F, block_m=block))
        grad_w2 = torch.zeros(E_l, D, F, dtype=torch.float32, device=dev)
        w2_wgrad(grad_h3, h2, offsets, grad_w2,
                 config=WgradConfig.from_heuristic(out_rows=D, out_cols=F, block_m=block))
        grad_w13 = torch.zeros(E_l, 2, F, D, dtype=torch.float32, device=dev)
        w13_wgrad(grad_h1, x_rows, offsets, grad_w13,
                  config=WgradConfig.from_heuristic(out_rows=2 * F, out_cols=D, block_m=block))
        # Route input gradients into the owners' dispatch rows t*K+k (see the module
        # docstring for why no peer reads dispatch now).
        w13_dgrad_scatter(grad_h1, offsets, w13, tables.bwd_scatter_ptrs,
                          config=W13DgradConfig.from_heuristic(hidden=D, ffn=F, block_m=block))
        # 4. all route input gradients have landed
        heap.barrier()
        # 5. owner: sum its routes' input gradients (no barrier after: module docstring)
        grad_x = torch.empty(ctx.x_shape, dtype=torch.bfloat16, device=dev)
        reduce_routes(dispatch_rows, ids_executed, grad_x)

        need = ctx.needs_input_grad
        return (
            None,
            grad_x if need[1] else None,
            None,
            grad_scores.to(ctx.scores_dtype) if need[3] else None,
            grad_w13.to(w13.dtype) if need[4] else None,
            grad_w2.to(w2.dtype) if need[5] else None,
        )
