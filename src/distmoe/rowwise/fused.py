"""The scaled expert path of an MoE layer as one autograd node: scaled dispatch -> W13 grouped
GEMM -> SwiGLU -> W2 grouped GEMM -> scaled combine, and its adjoint backward.

Legend: N token rows on this rank, K routes per token, D = hidden, F = ffn, E local experts,
R = ``Buffers.rows`` (this rank's received rows, grouped by local expert: group e owns rows
``offs[e-1] .. offs[e]-1``), B = values per activation scale of the GEMM operands (32 for
``"mxfp8"``, E8M0 scales; 128 for ``"fp8_block"``, float32 scales); the weights are quantised
per call in B x B blocks. The calls are those of the separate nodes, in their order; ``Q``
is a quantiser, ``DQ`` its dequantisation::

    forward (collective)
    1 source  x_q, x_s = mxfp8_quantize(x)                            [N, D] e4m3, [N, D/32]
              [pre_barrier] PUT both rows of every route into out_q / out_s; barrier
    2 expert  a = the received rows as they are (mxfp8), or DQ then 1 x 128 block-FP8 Q
              (fp8_block)                                             [R, D] e4m3, [R, D/B]
              h1 = bf16(a W13_q^T)                                    [R, 2F]  (FP8 GEMM)
              h2 = bf16(silu(g) * u) and Q(h2) in one kernel          [R, F]   (swiglu_quantize)
              h3 = bf16(Q(h2) W2_q^T)                                 [R, D]   (FP8 GEMM)
              h3 MXFP8-quantised into expert_out_q / expert_out_s; barrier
    3 source  y[t] = bf16(sum over read k of probs[t, k] * DQ(row))  fp32, k order (the
              scaled combine GET; it keeps the routes [N, K, D] when probs needs a gradient)
              [post_barrier]

    backward (collective; the straight-through gradient of the quantised forward: each
    rounding's derivative taken as one), with g = grad of y
    1 combine's adjoint: zero the grad_expert_out twins; barrier; every route PUTs
              bf16(g[t] * probs[t, k]) into its row's twin; barrier        gh3 [R, D]
              grad_probs[t, k] = dot(g[t], DQ(route(t, k)))  fp32, from the kept routes
    2 expert  gh2 = bf16(Q(gh3) W2_q)                                 [R, F]   (FP8 GEMM)
              [recompute_swiglu: h2 and Q(h2) again from h1, the forward's kernel]
              gh1 = SwiGLU backward in fp32 from h1, and Q(gh1), in one kernel  [R, 2F]
              grad x rows = bf16(Q(gh1) W13_q) into the grad_out twin  [R, D]  (FP8 GEMM)
              grad_w2[e] = bf16(gh3_e^T DQ(Q(h2))_e), grad_w13[e] = bf16(gh1_e^T DQ(a)_e)
              (bf16 operands, fp32 accumulation; the layer's grouped WGRAD)
    3 dispatch's adjoint: barrier; grad_x[t] = bf16(sum over moved k of the twin rows)
              (fused GET, fp32, k order); barrier

Every step is the separate nodes' own code (``dispatch_put_scaled``'s PUT,
``scaled_grouped_mm``'s operand, DGRAD and WGRAD helpers, ``combine_get_scaled``'s GET,
``combine_get``'s and ``dispatch_put``'s backward movement) and the FP8 training layer's
SwiGLU kernels (:mod:`distmoe.kernels.scaled.swiglu_quant`), so the result is the
composition of those nodes (``tests/rowwise/test_rowwise_fused.py``). Where the separate
``scaled_grouped_mm`` would quantise a bf16 tensor, the fused node passes the FP8 rows it
already has (the received rows, the SwiGLU kernel's ``Q(h2)`` and ``Q(gh1)``): the same
values, one pass fewer each.

Saved for backward (``ctx.save_for_backward``; R, E, F, D, B as above, ``b`` = the weights'
block = B):

====================  ================  ==========================  ========================
tensor                shape             dtype                       saved when
====================  ================  ==========================  ========================
a_q (W13's operand)   [R, D]            float8_e4m3fn               always (mxfp8: a copy of
                                                                    the received rows)
a_s                   [R, D/B]          uint8 E8M0 / float32        always
w13t_q, w13t_s        [E, D, 2F],       float8_e4m3fn,              always (W13's blocks,
                      [E, D/b, 2F/b]    uint8 / float32             transposed, contiguous)
w2t_q, w2t_s          [E, F, D],        float8_e4m3fn,              always
                      [E, F/b, D/b]     uint8 / float32
h1 (pre-SwiGLU)       [R, 2F]           bfloat16                    always
h2_q (W2's operand)   [R, F]            float8_e4m3fn               ``recompute_swiglu=False``
h2_s                  [R, F/B]          uint8 E8M0 / float32        ``recompute_swiglu=False``
routes (dequantised)  [N, K, D]         bfloat16                    probs requires grad
probs, dst_ranks,     [N, K], [N, K],   the caller's                always (references to
dst_rows, offs        [N, K], [E]                                   the arguments, no copy)
====================  ================  ==========================  ========================

``recompute_swiglu=True`` keeps h1 only of the SwiGLU's tensors and runs the forward's
SwiGLU kernel again in backward (it reads h1, ``R 2F`` bf16, and writes h2 and ``Q(h2)``):
``R F (1 + 1/B)`` bytes less held from forward to backward (4 more for each scale of
fp8_block), one kernel more in backward. Both modes give the same bits.

Temporaries: the forward allocates ``Q(x)``, h1, h2 (bf16, dropped), ``Q(h2)``, h3 and the
quantised weights; the backward ``Q(gh3)``, gh2, gh1 and ``Q(gh1)``, the dequantised
operands of the two WGRADs and the weight gradients. The heap buffers used: ``out_q`` /
``out_s`` (dispatch destination), ``expert_out_q`` / ``expert_out_s`` (combine source) and the
gradient twins ``grad_expert_out`` / ``grad_out`` (backward).

Sync points: none on the host (``Buffers(check=True)`` excepted); barriers: the forward's two
inner ones plus those asked for, four in backward. The forward reads (or copies) the received
rows before it reaches the combine's barrier, after which a peer's next PUT may land: with
the default barriers, calls repeat safely as the separate calls do (docs/rowwise.md,
Barriers).
"""

from __future__ import annotations

from typing import Literal

import torch

from distmoe.kernels.scaled.swiglu_quant import swiglu_backward_quantize, swiglu_quantize
from distmoe.quant.mxfp8 import mxfp8_quantize, mxfp8_quantize_2d
from distmoe.quant.prepare import dequantize_rows
from distmoe.rowwise.buffers import Buffers
from distmoe.rowwise.checks import (
    EXPERT_BLOCKS,
    check_expert_buffers,
    check_expert_weights,
    check_flag,
    check_grad_buffers,
    check_probs,
    check_route_maps,
    check_rows_arg,
    check_values,
)
from distmoe.rowwise.combine import push_grad_rows
from distmoe.rowwise.dispatch import pull_grad_rows
from distmoe.rowwise.grouped import (
    quantize_rows,
    scaled_dgrad,
    scaled_grouped_mm_q,
    scaled_weight_blocks,
    scaled_wgrad,
)
from distmoe.rowwise.scaled import combine_scaled_rows, put_scaled_rows, scaled_probs_grad

Precision = Literal["mxfp8", "fp8_block"]


def _scale_dtype(precision: str) -> torch.dtype:
    return torch.uint8 if precision == "mxfp8" else torch.float32


def _swiglu(h1_R2F: torch.Tensor, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``Q(h2)`` of ``h2 = bf16(silu(gate) * up)``, one kernel: ``(h2_q [R, F], h2_s)``."""
    rows, ffn = h1_R2F.shape[0], h1_R2F.shape[1] // 2
    dev = h1_R2F.device
    h2_RF = torch.empty(rows, ffn, dtype=torch.bfloat16, device=dev)
    h2_q = torch.empty(rows, ffn, dtype=torch.float8_e4m3fn, device=dev)
    h2_s = torch.empty(rows, ffn // EXPERT_BLOCKS[precision], dtype=_scale_dtype(precision),
                       device=dev)
    swiglu_quantize(h1_R2F, h2_RF, h2_q, h2_s, precision=precision)
    return h2_q, h2_s


def _forward(bufs: Buffers, x_ND, probs_NK, w13, w2, dst_ranks, dst_rows, offs, precision,
             pre_barrier, post_barrier, *, keep_routes: bool, save: bool):
    """The forward (module docstring): ``y [N, D]`` bf16 and what the backward needs
    (``save``: with copies of the heap rows it reads)."""
    num_experts, _, ffn, hidden = w13.shape
    # 1 source: quantise this rank's rows (MXFP8, the transport format) and PUT them
    xq_ND, xs_ND = mxfp8_quantize(x_ND, dim=-1)
    put_scaled_rows(bufs, "out_q", "out_s", xq_ND, xs_ND, dst_ranks, dst_rows, pre_barrier,
                    True)
    # 2 expert: the W13 operand is the received rows (their block-FP8 form for fp8_block)
    if precision == "mxfp8":
        a_q, a_s = bufs.out_q, bufs.out_s
        if save:  # a peer's next PUT may land once this rank passes the combine's barrier
            a_q, a_s = a_q.clone(), a_s.clone()
    else:
        a_q, a_s = quantize_rows(dequantize_rows(bufs.out_q, bufs.out_s, "mxfp8"), precision)
    w13_q, w13_s, w13t_q, w13t_s = scaled_weight_blocks(
        w13.view(num_experts, 2 * ffn, hidden).transpose(1, 2), precision)
    w2_q, w2_s, w2t_q, w2t_s = scaled_weight_blocks(w2.transpose(1, 2), precision)
    h1_R2F = scaled_grouped_mm_q(a_q, a_s, w13_q.transpose(1, 2), w13_s, offs, format=precision)
    h2_q, h2_s = _swiglu(h1_R2F, precision)
    h3_RD = scaled_grouped_mm_q(h2_q, h2_s, w2_q.transpose(1, 2), w2_s, offs, format=precision)
    mxfp8_quantize_2d(h3_RD, bufs.expert_out_q, bufs.expert_out_s)
    # 3 source: pull, dequantise and reduce every token's routes (after the peers' writes)
    y_ND, routes_NKD = combine_scaled_rows(bufs, "expert_out_q", "expert_out_s", dst_ranks,
                                           dst_rows, probs_NK, keep_routes, True, post_barrier)
    return y_ND, (a_q, a_s, w13t_q, w13t_s, w2t_q, w2t_s, h1_R2F, h2_q, h2_s, routes_NKD)


class ScaledExpertMLPFunction(torch.autograd.Function):
    """Autograd node of :func:`scaled_expert_mlp`: the whole scaled expert path forward, its
    adjoint backward (module docstring)."""

    @staticmethod
    def forward(ctx, x_ND, probs_NK, w13, w2, bufs: Buffers, dst_ranks, dst_rows, offs,
                precision: str, recompute_swiglu: bool, pre_barrier: bool,
                post_barrier: bool):
        keep_routes = probs_NK is not None and ctx.needs_input_grad[1]
        y_ND, saved = _forward(bufs, x_ND, probs_NK, w13, w2, dst_ranks, dst_rows, offs,
                               precision, pre_barrier, post_barrier, keep_routes=keep_routes,
                               save=True)
        a_q, a_s, w13t_q, w13t_s, w2t_q, w2t_s, h1_R2F, h2_q, h2_s, routes_NKD = saved
        if recompute_swiglu:
            h2_q = h2_s = None
        ctx.bufs, ctx.precision, ctx.recompute = bufs, precision, recompute_swiglu
        ctx.w13_shape = tuple(w13.shape)
        ctx.save_for_backward(a_q, a_s, w13t_q, w13t_s, w2t_q, w2t_s, h1_R2F, h2_q, h2_s,
                              routes_NKD, probs_NK, dst_ranks, dst_rows, offs)
        return y_ND

    @staticmethod
    def backward(ctx, grad_y):
        (a_q, a_s, w13t_q, w13t_s, w2t_q, w2t_s, h1_R2F, h2_q, h2_s, routes_NKD, probs_NK,
         dst_ranks, dst_rows, offs) = ctx.saved_tensors
        bufs, precision = ctx.bufs, ctx.precision
        num_experts, _, ffn, hidden = ctx.w13_shape
        grad_y_ND = grad_y.to(torch.bfloat16).contiguous()
        # 1 combine's adjoint: the weighted PUT of grad_y into the experts' twins
        gh3_RD = push_grad_rows(bufs, "expert_out", grad_y_ND, dst_ranks, dst_rows, probs_NK)
        grad_probs = None
        if routes_NKD is not None:
            grad_probs = scaled_probs_grad(routes_NKD, grad_y_ND, probs_NK.dtype)
        # 2 expert: W2 DGRAD, SwiGLU backward, W13 DGRAD into the grad_out twin (peers pull
        # it). Every rank computes its rows whatever its own inputs need: peers' tokens
        # need them.
        g3_q, g3_s = quantize_rows(gh3_RD, precision)
        gh2_RF = scaled_dgrad(g3_q, g3_s, w2t_q, w2t_s, offs, precision)
        rows = h1_R2F.shape[0]
        gh1_R2F = torch.empty_like(h1_R2F)
        g1_q = torch.empty(rows, 2 * ffn, dtype=torch.float8_e4m3fn, device=h1_R2F.device)
        g1_s = torch.empty(rows, 2 * ffn // EXPERT_BLOCKS[precision],
                           dtype=_scale_dtype(precision), device=h1_R2F.device)
        swiglu_backward_quantize(h1_R2F, gh2_RF, gh1_R2F, g1_q, g1_s, precision=precision)
        scaled_dgrad(g1_q, g1_s, w13t_q, w13t_s, offs, precision, out=bufs.grad_buffer("out"))
        grad_w13 = grad_w2 = None
        if ctx.needs_input_grad[3]:
            if ctx.recompute:
                h2_q, h2_s = _swiglu(h1_R2F, precision)
            h2_RF = dequantize_rows(h2_q, h2_s, precision)  # the operand W2 multiplied
            grad_w2 = scaled_wgrad(gh3_RD, h2_RF, offs, (num_experts, ffn, hidden),
                                   True).transpose(1, 2)
        if ctx.needs_input_grad[2]:
            a_RD = dequantize_rows(a_q, a_s, precision)  # the operand W13 multiplied
            grad_w13 = scaled_wgrad(gh1_R2F, a_RD, offs, (num_experts, hidden, 2 * ffn),
                                    True).transpose(1, 2).view(ctx.w13_shape)
        # 3 dispatch's adjoint: each token pulls and sums its routes' gradient rows
        grad_x, _, _ = pull_grad_rows(bufs, "out", dst_ranks, dst_rows, None,
                                      run=ctx.needs_input_grad[0], keep=False)
        return (grad_x, grad_probs, grad_w13, grad_w2, None, None, None, None, None, None,
                None, None)


def scaled_expert_mlp(input: torch.Tensor, dst_ranks: torch.Tensor, dst_rows: torch.Tensor,
                      probs: torch.Tensor | None, w13: torch.Tensor, w2: torch.Tensor,
                      offs: torch.Tensor, bufs: Buffers, *, precision: Precision = "mxfp8",
                      recompute_swiglu: bool = False, pre_barrier: bool = False,
                      post_barrier: bool = False) -> torch.Tensor:
    """*Collective.* The scaled expert path of an MoE layer in one autograd node (module
    docstring): ``y[t] = sum_k probs[t, k] * expert(dst_ranks[t, k])(x[t])`` with SwiGLU
    experts on FP8 tensor cores, rows moved as MXFP8 one-sided PUT and GET.

    It equals ``dispatch_put_scaled`` -> ``scaled_grouped_mm`` (W13) -> SwiGLU ->
    ``scaled_grouped_mm`` (W2) -> ``combine_get_scaled`` of the same rows, with the backward
    of ``combine_get`` / ``scaled_grouped_mm`` / ``dispatch_put`` (the straight-through
    gradient of the quantisations), bit for bit; what the node saves is listed in the module
    docstring.

    Args:
        input: bf16 ``[N, D]`` contiguous, this rank's token rows (N may differ by rank).
        dst_ranks / dst_rows: signed integer ``[N, K]`` contiguous: each route's expert rank
            and its row there (``expert_major_rows`` gives rows grouped by local expert);
            negative = invalid route (skipped; it adds nothing to y). Each route's row its
            own.
        probs: optional float32 / bf16 / fp16 ``[N, K]`` contiguous: the route weights of the
            combine (multiplied in fp32); None: weights 1.
        w13: bf16 ``[E, 2, F, D]`` contiguous (gate ``w13[e, 0]``, up ``w13[e, 1]``;
            ``MoEContext``'s layout), this rank's local experts.
        w2: bf16 ``[E, D, F]`` contiguous.
        offs: int32 ``[E]`` on the device: cumulative row ends of the local experts in the
            received rows (``received.cumsum(0)`` of ``expert_major_rows``; not read on the
            host, clamped to ``[0, R]``).
        bufs: ``Buffers(group, R, D, scaled=True)`` (``grad=True`` for a backward): R rows
            receive this rank's routes.
        precision: the GEMM operands: ``"mxfp8"`` (32-value E8M0 scales; D and F multiples of
            32) or ``"fp8_block"`` (1 x 128 and 128 x 128 blocks with float32 scales; D and F
            multiples of 128). The rows move as MXFP8 either way.
        recompute_swiglu: save h1 only and recompute the SwiGLU output in backward (module
            docstring, saved tensors).
        pre_barrier: barrier before the PUT (default False, as ``dispatch_put_scaled``).
        post_barrier: barrier after the GET (default False, as ``combine_get_scaled``).

    Returns bf16 ``[N, D]``, differentiable with respect to ``input``, ``probs``, ``w13`` and
    ``w2`` (weight gradients bf16 in their layouts); the backward is collective: every rank
    runs it (the call is differentiable on every rank or on none).

    Raises ``TypeError``/``ValueError`` naming the argument for a wrong type, dtype, shape,
    device, layout or precision, before any buffer is touched; with ``Buffers(check=True)``,
    ``ValueError`` for bad routes on any rank.
    """
    bufs = check_expert_buffers(bufs)
    num_tokens = check_rows_arg("input", input, bufs)
    check_route_maps("dst_ranks", dst_ranks, "dst_rows", dst_rows, bufs, ndim=2,
                     num_tokens=num_tokens)
    check_probs(probs, dst_ranks, "dst_ranks", bufs)
    check_expert_weights(w13, w2, offs, precision, bufs)
    for name, value in (("recompute_swiglu", recompute_swiglu), ("pre_barrier", pre_barrier),
                        ("post_barrier", post_barrier)):
        check_flag(name, value)
    differentiable = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (input, probs, w13, w2))
    check_grad_buffers(bufs, differentiable, "input, probs, w13 or w2", "bufs")
    if bufs.check:
        check_values(bufs, "scaled_expert_mlp", "dst_ranks/dst_rows", dst_ranks, dst_rows,
                     differentiable)
    if not differentiable:
        return _forward(bufs, input, probs, w13, w2, dst_ranks, dst_rows, offs, precision,
                        pre_barrier, post_barrier, keep_routes=False, save=False)[0]
    return ScaledExpertMLPFunction.apply(input, probs, w13, w2, bufs, dst_ranks, dst_rows,
                                         offs, precision, recompute_swiglu, pre_barrier,
                                         post_barrier)
