"""Training at ``MoEConfig(precision="mxfp8" | "fp8_block", training=True)``: the four
expert GEMMs of the forward and of the input-gradient backward on FP8 tensor cores, the
weight gradients in bf16 (fp32 accumulation).

Parameters stay bf16 (or whatever dtype the caller keeps); their quantised forms (32 x 32
blocks for mxfp8, 128 x 128 for fp8_block: one qdata serves both orientations) are made once
per weight version (:func:`train_weights`) together with the transposed copies
the input-gradient GEMMs read. ``B`` = values per activation scale of the context's operand
format (:func:`~distmoe.ops.lowp.fp8_format`): 32 (exact MXFP8), 128 (MXFP8 rebased onto
128-wide groups where D and F are multiples of 128, E8M0 scales; block FP8, float32 scales);
``R_b`` = the receive bound; rows in the expert-major activation order of the routing
tables.

Forward (collective; publishing, routing, gather, scatter and combine are the inference
forward's, :mod:`distmoe.ops.lowp`)::

    1-4b  route, gather the executed rows and quantise them along D in one kernel
          (:func:`~distmoe.kernels.scaled.gather_quant.gather_quantize`):
                                     x_q [R_b, D] e4m3, x_s [R_b, D/B]        (saved)
    4c    W13:  h1 = bf16(x_q W13_q^T)            [R_b, 2F]                    (saved)
    5a    SwiGLU in fp32 from h1, quantised along F in the same kernel
          (:func:`~distmoe.kernels.scaled.swiglu_quant.swiglu_quantize`):
          h2 = bf16(silu(h1_gate) * h1_up) [R_b, F], h2_q, h2_s
          W2:   h3 = bf16(h2_q W2_q^T)  [R_b, D], each live row stored straight into
          its owner's combine slot (the GEMM's ``scatter_ptrs`` epilogue)
    5c-7  barrier, combine: y[t] = sum_k score[t, k] h3[t, k] (fp32); the
          owner keeps its routes' h3 rows ``[T*K, D]`` bf16 (saved) for the score gradient

Backward (collective: every rank runs the backward of the same calls in the same order)::

    1  owner:  route_grads, push mode: grad_scores[t, k] = <grad_y[t], h3[t, k]> (fp32) and
               bf16(score[t, k] * grad_y[t]) pushed into the expert's scratch gh3, at the
               activation row the expert executed the route at
    2  barrier
    3  expert: quantise gh3 along D; gh2 = bf16(gh3_q W2_q)             [R_b, F]
               SwiGLU backward in fp32 from h1, quantised along 2F in the same kernel
               (``swiglu_backward_quantize``): gh1 [R_b, 2F] bf16, gh1_q, gh1_s, and h2
               again (the forward's bits); gx = bf16(gh1_q W13_q)     [R_b, D]
               (the gx GEMM stores each live row straight into its owner's dispatch row
               t*K+k: its ``scatter_ptrs`` epilogue)
               WGRAD, FP8 where :func:`distmoe.plan.rules.fp8_wgrad` gives configs
               (when chosen; 128-wide groups, row blocks of 128): operands quantised along tokens
               per 128 padded rows (:func:`~distmoe.kernels.scaled.token_quant.quantize_tokens`,
               transposed; x's in the forward, from the rows W13 read) and one grouped GEMM
               per weight reducing along each expert's tokens
               (:func:`~distmoe.kernels.scaled.wgrad.scaled_wgrad`):
               grad_w2[e] = Q_T(gh3)_e^T Q_T(h2)_e, grad_w13[e] = Q_T(gh1)_e^T Q_T(x)_e;
               else bf16 (fp32 accumulation, the bf16 layer's kernels,
               :mod:`distmoe.kernels.wgrad`): grad_w2[e] = gh3_e^T h2_e,
               grad_w13[e] = gh1_e^T dequant(x_q)_e
    4  barrier
    5  owner:  grad_x[t] = bf16(sum over executed k of the route rows) (reduce_routes)

The gradient of the quantised forward (straight-through: the rounding's derivative taken as
one): the weight gradients use the operands the forward multiplied (``dequant(x_q)``, and
``h2``, the operand W2 quantised, as bf16), the input gradients the same quantised weights
as the forward. Routes beyond the receive bound are not executed and get zero gradients.

Not yet (issue 58): the saved state in the planner's activation buffer (here per-call
tensors: x for the weight gradient, ``x_q`` + ``x_s`` ``R_b (D + D/B)`` bytes (scales of
4 bytes for fp8_block), or with FP8 weight gradients x along tokens ``R_cap D (1 + 1/128)``
bytes (``1 + 4/128`` for fp8_block), ``h1`` ``4 R_b F`` and
the owner's h3 rows ``2 T K D`` bytes per layer until its backward; the context's activation
slots are not used); replay under a budget. Eager calls replay from the context's CUDA graphs
(:class:`~distmoe.ops.graphs.FP8TrainGraphs`) on CUDA devices.

Sync points: none on the host. Memory per backward: the quantised gh1 (``R_b 2F (1 + 1/B)``
bytes), gh1, and x dequantised (bf16) or the token-axis operands (about one byte per value
of gh3, h2 and gh1), beside the context's scratch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from ..kernels.movement.route_grad import reduce_routes, route_grads
from ..kernels.scaled import ScaledGemmConfig
from ..kernels.scaled.swiglu_quant import swiglu_backward_quantize, swiglu_quantize
from ..kernels.scaled.token_quant import TOKEN_BLOCK, quantize_tokens
from ..kernels.scaled.wgrad import ScaledWgradConfig, scaled_wgrad
from ..kernels.wgrad import w2_wgrad, w13_wgrad
from ..plan import rules
from ..quant.fp8_block import mxfp8_rebase
from ..quant.prepare import cached_per_object, dequantize_rows, prepare_weights
from .autograd import backward_outputs, check_versions, record_versions, weight_grad_outputs
from .lowp import FP8_FORMATS, fp8_format, route_and_quantize, scatter_and_combine

__all__ = ["FP8TrainConfigs", "FP8TrainFunction", "fp8_train_configs", "train_weights"]


@dataclass(frozen=True)
class FP8TrainConfigs:
    """Launch configs of a low-precision training context's GEMMs beside the inference
    forward's two (``block_m`` = the routing's ``row_block``): W13 without SwiGLU (h1 is
    saved), the two input-gradient GEMMs, and the two FP8 weight-gradient GEMMs
    (``w13_wgrad`` / ``w2_wgrad``; None: the bf16 WGRADs on the plan's configs;
    :func:`distmoe.plan.rules.fp8_wgrad`)."""

    w13_h1: ScaledGemmConfig
    w2_dgrad: ScaledGemmConfig
    w13_dgrad: ScaledGemmConfig
    w13_wgrad: ScaledWgradConfig | None = None
    w2_wgrad: ScaledWgradConfig | None = None


def fp8_train_configs(cfg, device: torch.device, *,
                      fp8_wgrad: bool | None = None) -> FP8TrainConfigs:
    """The configs of :class:`FP8TrainConfigs` for ``cfg`` on ``device``
    (:func:`distmoe.plan.rules.scaled_gemm`, :func:`~distmoe.plan.rules.fp8_wgrad`;
    ``fp8_wgrad``: take FP8 weight gradients where they apply, default the plan's
    :data:`~distmoe.plan.rules.PICK_FP8_WGRAD`)."""
    D, F, bm = cfg.hidden, cfg.ffn, cfg.row_block
    fmt = fp8_format(cfg)
    g = FP8_FORMATS[fmt][0]
    gluon = rules.scaled_gluon(device)
    return FP8TrainConfigs(
        w13_h1=rules.scaled_gemm(k=D, n=2 * F, block_m=bm, k_group=g, gluon=gluon),
        w2_dgrad=rules.scaled_gemm(k=D, n=F, block_m=bm, k_group=g, gluon=gluon),
        w13_dgrad=rules.scaled_gemm(k=2 * F, n=D, block_m=bm, k_group=g, gluon=gluon),
        w13_wgrad=rules.fp8_wgrad(fmt=fmt, row_block=bm, out_rows=2 * F, out_cols=D,
                                  gluon=gluon, pick=fp8_wgrad),
        w2_wgrad=rules.fp8_wgrad(fmt=fmt, row_block=bm, out_rows=D, out_cols=F, gluon=gluon,
                                 pick=fp8_wgrad),
    )


@dataclass(frozen=True)
class TrainWeights:
    """One weight version's quantised forms, the GEMM operands only (the weights' B x B
    prepared blocks, ``B`` = 32 or 128, are the forward operands where no rebase applies;
    where the operands are rebased copies the blocks are dropped, a third of the forms'
    bytes): the forward GEMMs' operands (``w13_q [E, 2, F, D]``,
    ``w2_q [E, D, F]`` and their scales), which a call without autograd reads too, and the
    input-gradient GEMMs' ``[E, N, K]`` operands, the same qdata and scales transposed
    (contiguous copies): ``w2t_q [E, F, D]``, ``w13t_q [E, D, 2F]``. In the
    ``"mxfp8_rebased"`` format every operand is rebased onto 128-wide K groups (scales
    ``[..., N/32, K/128]``)."""

    w13_q: torch.Tensor
    w13_s: torch.Tensor
    w2_q: torch.Tensor
    w2_s: torch.Tensor
    w2t_q: torch.Tensor
    w2t_s: torch.Tensor
    w13t_q: torch.Tensor
    w13t_s: torch.Tensor


def train_weights(moe, w13: torch.Tensor, w2: torch.Tensor) -> TrainWeights:
    """The quantised forms of ``(w13, w2)`` at ``moe.cfg.precision``, made once per weight
    version and kept on ``moe``: for each of the last ``cfg.max_layers_per_slot`` weight pairs
    (the layers that share a context), keyed by the tensor objects themselves (weak
    references, so a new tensor at a freed one's address never matches). A new version of
    the same tensors (an in-place change, as an optimizer step) is quantised again into the
    same :class:`TrainWeights` tensors, so the forms keep their addresses (the context's CUDA
    graphs read them there). Why: static weights are quantised once per version, not once
    per call."""
    return cached_per_object(moe, "_distmoe_train_weights", (w13, w2),
                             lambda: _quantise_weights(moe, w13, w2),
                             size=moe.cfg.max_layers_per_slot,
                             refresh=lambda tw: _refresh(tw, _quantise_weights(moe, w13, w2)))


def _refresh(tw: TrainWeights, new: TrainWeights) -> None:
    """Copy every form of ``new`` into ``tw``'s tensors (the same shapes and dtypes)."""
    for n in ("w13_q", "w13_s", "w2_q", "w2_s", "w2t_q", "w2t_s", "w13t_q", "w13t_s"):
        getattr(tw, n).copy_(getattr(new, n))


def _quantise_weights(moe, w13: torch.Tensor, w2: torch.Tensor) -> TrainWeights:
    """:class:`TrainWeights` of ``(w13, w2)`` in ``moe``'s operand format."""
    p13, p2 = prepare_weights(w13.detach(), w2.detach(), moe.cfg.precision)
    E, _, F, D = p13.shape
    forms = [(p13.qdata, p13.scales), (p2.qdata, p2.scales),
             (p2.qdata.transpose(1, 2).contiguous(), p2.scales.transpose(1, 2).contiguous()),
             (p13.qdata.view(E, 2 * F, D).transpose(1, 2).contiguous(),
              p13.scales.flatten(1, 2).transpose(1, 2).contiguous())]
    if moe._lowp.format == "mxfp8_rebased":  # every operand onto 128-wide K groups
        forms = [mxfp8_rebase(q, sc)[:2] for q, sc in forms]
    (q13, s13), (q2, s2), (q2t, s2t), (q13t, s13t) = forms
    return TrainWeights(w13_q=q13, w13_s=s13, w2_q=q2, w2_s=s2, w2t_q=q2t,
                        w2t_s=s2t, w13t_q=q13t, w13t_s=s13t)


def fp8_train_forward(moe, x, expert_ids, scores, tw: TrainWeights):
    """Forward steps 1-7 (module docstring) on checked inputs: ``(y [T, D] bf16, saved)``."""
    s = moe._lowp
    conf = moe._lowp_train
    block, scale_dtype, _, grouped_mm = FP8_FORMATS[s.format]
    R, D = s.x_q.shape
    F = moe.cfg.ffn
    E = moe.num_local_experts
    x_q = torch.empty(R, D, dtype=torch.float8_e4m3fn, device=moe.device)
    x_s = torch.empty(R, D // block, dtype=scale_dtype, device=moe.device)
    tables, gather_ptrs = route_and_quantize(moe, x, expert_ids, x_q, x_s, s.format)
    po, ro = tables.padded_offsets, tables.row_offsets
    if conf.w13_wgrad is not None:
        # W13's weight gradient reads x quantised along tokens, from the bf16 rows where
        # W13 read them (saved instead of x_q, the same bytes)
        r_cap = gather_ptrs.shape[0]
        wx = (torch.empty(D, r_cap, dtype=torch.float8_e4m3fn, device=moe.device),
              torch.empty(r_cap // TOKEN_BLOCK, D, dtype=scale_dtype, device=moe.device))
        quantize_tokens(None, po, ro, *wx, format=s.format, gather_ptrs=gather_ptrs)
    else:
        wx = (x_q, x_s)
    h1 = torch.empty(R, 2 * F, dtype=torch.bfloat16, device=moe.device)
    grouped_mm(x_q, x_s, tw.w13_q.view(E, 2 * F, D), tw.w13_s.flatten(1, 2), po, ro, h1,
               config=conf.w13_h1)
    swiglu_quantize(h1, moe._h2[:R], s.h2_q, s.h2_s, precision=s.format)
    # h3 rows straight into their owners' combine slots
    grouped_mm(s.h2_q, s.h2_s, tw.w2_q, tw.w2_s, po, ro, None, config=s.w2_config,
               scatter_ptrs=tables.scatter_ptrs)
    y = scatter_and_combine(moe, tables, None, x, expert_ids, scores, None)
    T, K = expert_ids.shape
    saved = dict(tables=tables, wgrad_x=wx, h1=h1,
                 h3_routes=moe._combine[:T * K].clone(),  # the next forward overwrites them
                 ids_executed=torch.where(tables.is_route_executed_TK,
                                          expert_ids.to(torch.int32), -1),
                 scores_f32=scores.float().contiguous(), weights=tw)
    return y, saved


def _token_quantized(rows: torch.Tensor, po: torch.Tensor, ro: torch.Tensor, like: tuple,
                     fmt: str):
    """``rows [R, C]`` (activation rows) quantised along tokens: ``(qt [C, R_cap], st
    [R_cap/128, C])`` with ``R_cap`` and the scale dtype of ``like`` (the saved x's)."""
    r_cap, C = like[0].shape[1], rows.shape[1]
    qt = torch.empty(C, r_cap, dtype=torch.float8_e4m3fn, device=rows.device)
    st = torch.empty(r_cap // TOKEN_BLOCK, C, dtype=like[1].dtype, device=rows.device)
    quantize_tokens(rows, po, ro, qt, st, format=fmt)
    return qt, st


def fp8_train_backward(moe, saved: dict, grad_y: torch.Tensor, weight_out):
    """Backward steps 1-5 (module docstring): ``(grad_x bf16 [T, D], grad_scores fp32
    [T, K])``; weight gradients into ``weight_out = (grad_w13, grad_w2)`` (each None where
    not needed; written whole, or added into fp32 ``main_grad`` buffers with
    ``moe.main_grad``). Three phases (:func:`fp8_backward_inputs`,
    :func:`fp8_backward_weights`, :func:`fp8_backward_finish`), which the context's CUDA
    graphs capture apart (:class:`~distmoe.ops.graphs.FP8TrainGraphs`)."""
    T, K = saved["ids_executed"].shape
    grad_scores = torch.empty(T, K, dtype=torch.float32, device=moe.device)
    grad_x = torch.empty(T, moe.cfg.hidden, dtype=torch.bfloat16, device=moe.device)
    parts = fp8_backward_inputs(moe, saved, grad_y, grad_scores)
    fp8_backward_weights(moe, saved, parts, weight_out)
    fp8_backward_finish(moe, saved, grad_x)
    return grad_x, grad_scores


def fp8_backward_inputs(moe, saved: dict, grad_y: torch.Tensor,
                        grad_scores: torch.Tensor) -> dict:
    """Steps 1-3 but the weight gradients: the score gradients into ``grad_scores`` (fp32
    ``[T, K]``), the route gradients pushed, and on the expert side gh2, the SwiGLU backward
    and the input-gradient GEMM (rows stored into their owners' dispatch rows). Returns what
    the weight gradients read: ``gh3``, ``h2``, ``gh1`` (activation rows)."""
    s, conf = moe._lowp, moe._lowp_train
    fmt = s.format
    block, _, quantize_2d, grouped_mm = FP8_FORMATS[fmt]
    tables, tw = saved["tables"], saved["weights"]
    ids_executed, scores_f32 = saved["ids_executed"], saved["scores_f32"]
    R = s.x_q.shape[0]
    F = moe.cfg.ffn
    po, ro = tables.padded_offsets, tables.row_offsets
    bufs = moe.backward_buffers
    grad_y = grad_y.to(torch.bfloat16).contiguous()
    # 1. owner: score gradients from the kept h3 rows; scored route gradients pushed
    route_grads(grad_y, saved["h3_routes"], ids_executed, scores_f32, None, grad_scores,
                dest_rows=tables.dest_rows_TK, dest_bases=bufs.gh3_bases,
                experts_per_rank=moe.num_local_experts)
    # 2. the route gradients visible to the experts
    moe.heap.barrier()
    # 3. expert side
    gh3 = moe.activations.scratch["gh3"][:R]
    g_q, g_s = s.x_q, s.x_s  # free in backward: the forward keeps its own x_q
    quantize_2d(gh3, g_q, g_s)
    gh2 = moe._h2[:R]
    grouped_mm(g_q, g_s, tw.w2t_q, tw.w2t_s, po, ro, gh2, config=conf.w2_dgrad)
    h1 = saved["h1"]
    gh1 = torch.empty_like(h1)
    gh1_q = torch.empty(R, 2 * F, dtype=torch.float8_e4m3fn, device=moe.device)
    gh1_s = torch.empty(R, 2 * F // block, dtype=s.x_s.dtype, device=moe.device)
    h2 = torch.empty(R, F, dtype=torch.bfloat16, device=moe.device)  # W2 WGRAD's operand
    swiglu_backward_quantize(h1, gh2, gh1, gh1_q, gh1_s, precision=fmt, h2=h2)
    # each route's input gradient row straight into its owner's dispatch row
    grouped_mm(gh1_q, gh1_s, tw.w13t_q, tw.w13t_s, po, ro, None, config=conf.w13_dgrad,
               scatter_ptrs=tables.bwd_scatter_ptrs)
    return dict(gh3=gh3, h2=h2, gh1=gh1)


def fp8_backward_weights(moe, saved: dict, parts: dict, weight_out) -> None:
    """Step 3's weight gradients from :func:`fp8_backward_inputs`' ``parts`` into
    ``weight_out = (grad_w13, grad_w2)`` (each None where not needed)."""
    s, conf = moe._lowp, moe._lowp_train
    fmt = s.format
    tables = saved["tables"]
    po, ro = tables.padded_offsets, tables.row_offsets
    gh3, h2, gh1 = parts["gh3"], parts["h2"], parts["gh1"]
    D, F = moe.cfg.hidden, moe.cfg.ffn
    grad_w13, grad_w2 = weight_out
    accumulate = moe.main_grad
    if conf.w13_wgrad is not None:  # FP8, operands quantised along tokens
        E = moe.num_local_experts
        x_t = saved["wgrad_x"]
        if grad_w2 is not None:
            scaled_wgrad(*_token_quantized(gh3, po, ro, x_t, fmt),
                         *_token_quantized(h2, po, ro, x_t, fmt), po, grad_w2, format=fmt,
                         accumulate=accumulate, config=conf.w2_wgrad)
        if grad_w13 is not None:
            scaled_wgrad(*_token_quantized(gh1, po, ro, x_t, fmt), *x_t, po,
                         grad_w13.view(E, 2 * F, D), format=fmt, accumulate=accumulate,
                         config=conf.w13_wgrad)
    else:  # the bf16 layer's WGRAD kernels and the plan's configs for them
        if grad_w2 is not None:
            w2_wgrad(gh3, h2, po, ro, grad_w2, accumulate=accumulate,
                     config=moe.plan.w2_wgrad)
        if grad_w13 is not None:
            w13_wgrad(gh1, dequantize_rows(*saved["wgrad_x"], fmt), po, ro, grad_w13,
                      accumulate=accumulate, config=moe.plan.w13_wgrad)


def fp8_backward_finish(moe, saved: dict, grad_x: torch.Tensor) -> None:
    """Steps 4-5: once every route's input gradient has landed, ``grad_x`` (bf16 ``[T, D]``)
    as the sum of its executed routes' rows."""
    T, K = saved["ids_executed"].shape
    moe.heap.barrier()
    reduce_routes(moe.backward_buffers.dispatch[:T * K], saved["ids_executed"], grad_x)


class FP8TrainFunction(torch.autograd.Function):
    """``y = FP8TrainFunction.apply(moe_ctx, x, expert_ids, scores, w13, w2)`` (collective;
    module docstring)."""

    @staticmethod
    def forward(ctx, moe, x, expert_ids, scores, w13, w2):
        tw = train_weights(moe, w13, w2)
        if moe.graphs is not None:  # an FP8 training context's are FP8TrainGraphs
            y, saved = moe.graphs.forward(x, expert_ids, scores, tw)
        else:
            y, saved = fp8_train_forward(moe, x, expert_ids, scores, tw)
        ctx.moe, ctx.saved = moe, saved
        ctx.scores_dtype = scores.dtype
        ctx.weights = (w13, w2)
        record_versions(ctx, scores, w13, w2)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        moe = ctx.moe
        moe.check_open()
        check_versions(ctx)
        weight_out = weight_grad_outputs(ctx, moe)
        out = None
        if moe.graphs is not None:
            out = moe.graphs.backward(ctx.saved, grad_y, weight_out)
        grad_x, grad_scores = out or fp8_train_backward(moe, ctx.saved, grad_y, weight_out)
        ctx.saved = None  # the layer's tensors go now, not with the graph
        return backward_outputs(ctx, moe, grad_x, grad_scores, weight_out)
