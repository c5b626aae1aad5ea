"""The low-precision inference forwards of :class:`~distmoe.MoEContext` (``MoEConfig(
precision="mxfp8" | "fp8_block" | "nvfp4", training=False)``), on the grouped GEMMs of
:mod:`distmoe.kernels.scaled`.

Weights come prepared (:func:`distmoe.quant.prepare_weights`, quantised once: mxfp8 in 32 x 32
blocks, fp8_block in 128 x 128 blocks with float32 scales, nvfp4 as E2M1 with E4M3 scales per
16 along K and a global scale per expert matrix).
bf16 rows cross to the experts exactly as in the bf16 forward, so publishing, routing, the
receive bound, the combine and their protocol are the bf16 forward's own
(:mod:`distmoe.ops.context`, steps 1-7), called through the context. One call, ``R_b`` = the
receive bound (legend of :mod:`distmoe.routing.tables`); steps 1-4a and 5c-7 are shared
(:func:`route_and_gather`, :func:`scatter_and_combine`):

    1-3. publish x and the ids, barrier, routing tables: ``ctx._publish_and_route`` (with
         the plan's choice to pull every peer token at EP > 1)
    4a. gather: the executed rows in compact activation order, read through
        ``ctx.gather_table`` (x in place at EP = 1, peer tokens pulled once into local memory
        at EP > 1): nvfp4 copies them into ``x_rows [R_b, D]`` bf16 (``regather_rows``), or
        at EP > 1, where the owners packed their rows as NVFP4 in step 1
        (:func:`route_and_gather_nvfp4`), decodes them to ``v * s_b`` with each row's global
        scale beside; the FP8 formats quantise them as they read them (4a and 4b in one
        kernel, :func:`~distmoe.kernels.scaled.gather_quant.gather_quantize`)

    mxfp8 and fp8_block (:func:`fp8_forward`; ``B`` = 32 with E8M0 scales for exact mxfp8,
    128 with E8M0 scales for mxfp8 rebased onto 128-wide groups (where D and F are
    multiples of 128, :func:`fp8_format`; the prepared 32 x 32 weight blocks rebased once per
    weight, :func:`rebased_weight`), 128 with float32 scales for fp8_block):
    4b. quantise along D: ``(x_q [R_b, D] e4m3, x_s [R_b, D/B])``, the bits of
        :func:`~distmoe.quant.mxfp8.mxfp8_quantize_2d` /
        :func:`~distmoe.quant.fp8_block.fp8_block_quantize_2d` on the gathered rows
        (docs/numerics.md)
    4c. W13 + SwiGLU: ``mxfp8_grouped_mm`` / ``fp8_block_grouped_mm(x_q, x_s, w13,
        swiglu=True) -> h2 [R_b, F]`` bf16
    5a. quantise h2 along F: ``(h2_q [R_b, F], h2_s [R_b, F/B])``
    5b. W2: the same GEMM ``(h2_q, h2_s, w2) -> h3`` bf16, each live row stored straight
        into its owner's combine slot (the GEMM's ``scatter_ptrs`` epilogue: 5b and 5c in
        one kernel)

    nvfp4 and mxfp4 (:func:`nvfp4_forward`; the GEMMs read bf16 activations; mxfp4: E8M0
    scales per 32 and no global scale, :func:`mxfp4_weight_grouped_mm`):
    4c. W13 + SwiGLU: ``nvfp4_weight_grouped_mm(x_rows, w13, swiglu=True) -> h2 [R_b, F]``
        bf16 (E2M1 decoded to bf16 in the prologue, global scale in the epilogue, times the
        rows' own global scales where they were packed)
    5b. W2: ``nvfp4_weight_grouped_mm(h2, w2) -> h3 [R_b, D]`` bf16, in x_rows' memory
        (x_rows is dead once W13 has read it)
    (configs from :func:`distmoe.plan.rules.fp4_weight_gemm`: transposed 16-row tiles
    below its row threshold, off until measured.) Where the plan takes FP8 operands
    (:meth:`~distmoe.plan.KernelPlan.fp4_fp8_operands`; D and F multiples of 128), 4a
    gathers and quantises x to 1 x 128 E4M3 blocks in one kernel (packed rows: decoded,
    then quantised), h2 is quantised before W2, and both GEMMs are
    :func:`~distmoe.kernels.scaled.nvfp4.nvfp4_weight_fp8_mm` (the weights expanded to E4M3
    in the prologue, FP8 tensor cores).

    5c. nvfp4, mxfp4: scatter each live row of h3 to its route's slot in the owner's combine
        buffer (:func:`~distmoe.kernels.movement.scatter_rows.scatter_rows` through
        ``tables.scatter_ptrs``; null rows skipped)
    6. barrier
    7. the owner's combine, ``y[t] = sum_k score[t, k] * h3[t*K + k]`` in fp32 (executed
       routes only)

Arithmetic (docs/numerics.md section 6): each GEMM is exact MXFP8 arithmetic up to the fp32
summation order, then one bf16 rounding (W13: of the fp32 SwiGLU); against the bf16 layer the
error is the quantisation of both operands of both GEMMs, at most 2^-4 relative per element
(tests/ops/test_mxfp8_forward.py carries both bounds through the layer).

nvfp4 arithmetic (docs/numerics.md, the NVFP4 section): each GEMM is exact in the decoded
weights (``v * s_b`` is exact in bf16) and the bf16 activations up to the fp32 summation
order, then the global scale (one fp32 rounding) and one bf16 rounding; against the bf16
layer the error is the weights' NVFP4 quantisation, plus at EP > 1 the packed activations'
(tests/ops/test_nvfp4_forward.py).

Memory, allocated once per context (:func:`allocate_lowp`): mxfp8: ``x_q`` ``R_b D``,
``x_s`` ``R_b D / 32``, ``h2_q`` ``R_b F``, ``h2_s`` ``R_b F / 32`` bytes
(fp8_block: the scales ``4 R_b D / 128`` and ``4 R_b F / 128``);
nvfp4: ``x_rows`` ``2 R_b D`` bytes (FP8 operands: ``R_b (D + F) (1 + 4/128)`` more);
beside the context's own ``h2 [R_b, F]`` bf16 scratch;
nothing per call but the output y (and the small routing tables, as in bf16). The quantisers
and GEMMs cover the ``R_b`` rows from the static bound (rows past the executed ones are
quantised too and never read).

Sync points: none on the host; the two barriers are the bf16 forward's. Eager calls replay
from the context's own CUDA graphs as at bf16 (:mod:`distmoe.ops.graphs`: the second call of
a key is captured; the prepared weights' qdata addresses are part of the key).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..config import MoEConfig
from ..kernels.movement.combine import combine
from ..kernels.movement.regather_rows import regather_rows
from ..kernels.movement.scatter_rows import scatter_rows
from ..kernels.scaled import (
    ScaledGemmConfig,
    fp8_block_grouped_mm,
    mxfp4_weight_grouped_mm,
    mxfp8_grouped_mm,
    nvfp4_weight_grouped_mm,
)
from ..kernels.scaled.gather_quant import gather_quantize
from ..kernels.scaled.nvfp4 import FP8_GROUP, fp4_weight_fp8_config, nvfp4_weight_fp8_mm
from ..kernels.scaled.nvfp4_rows import gather_nvfp4_rows, nvfp4_row_layout, pack_nvfp4_rows
from ..plan import device_class, rules
from ..plan.rules import mxfp8_k_group
from ..quant.fp8_block import fp8_block_quantize_2d, mxfp8_rebase
from ..quant.mxfp8 import mxfp8_quantize_2d, mxfp8_quantize_rebased_2d
from ..quant.prepare import PreparedWeight, cached_per_object

__all__ = ["FP8Scratch", "NVFP4Scratch", "allocate_fp8", "allocate_lowp", "allocate_nvfp4",
           "check_prepared", "fp8_forward", "lowp_forward", "nvfp4_forward"]

#: the precisions of this module's inference forwards
LOWP_PRECISIONS = ("mxfp8", "fp8_block", "nvfp4", "mxfp4")
#: per FP8 operand format: values per activation scale, the scale dtype, the quantiser, the
#: GEMM; "mxfp8_rebased": MXFP8 with four 32-blocks rebased onto one scale per 128
#: (distmoe.quant.mxfp8_rebase), which the mxfp8 layer runs where D and F allow
#: (distmoe.plan.rules.mxfp8_k_group)
FP8_FORMATS = {
    "mxfp8": (32, torch.uint8, mxfp8_quantize_2d, mxfp8_grouped_mm),
    "mxfp8_rebased": (128, torch.uint8, mxfp8_quantize_rebased_2d,
                      functools.partial(mxfp8_grouped_mm, k_group=128)),
    "fp8_block": (128, torch.float32, fp8_block_quantize_2d, fp8_block_grouped_mm)}


def fp8_format(cfg: MoEConfig) -> str:
    """The operand format of an FP8 context: ``cfg.precision``, or ``"mxfp8_rebased"`` for
    mxfp8 where :func:`distmoe.plan.rules.mxfp8_k_group` picks 128-wide groups."""
    if cfg.precision == "mxfp8" and mxfp8_k_group(hidden=cfg.hidden, ffn=cfg.ffn) == 128:
        return "mxfp8_rebased"
    return cfg.precision


def rebased_weight(owner, w: PreparedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qdata, scales [..., N/32, K/128])`` of an mxfp8 :class:`PreparedWeight` rebased
    onto 128-wide K groups (:func:`distmoe.quant.mxfp8_rebase`), kept on ``owner`` per
    prepared object (weak references: a new object at a freed one's address never matches)
    for its last 8 weights. Why: once per weight, not per call."""
    return cached_per_object(owner, "_distmoe_rebased", (w,),
                             lambda: mxfp8_rebase(w.qdata, w.scales)[:2], size=8)


@dataclass(frozen=True)
class FP8Scratch:
    """What an MXFP8 or block-FP8 context owns besides the bf16 context's buffers
    (allocated once, :func:`allocate_fp8`; ``R_b`` = the receive bound; ``B`` = 32 (mxfp8,
    uint8 E8M0 scales), 128 (mxfp8 rebased: uint8 E8M0 scales; fp8_block: float32 scales)).

    Attributes:
        precision: ``"mxfp8"`` or ``"fp8_block"``.
        format: the operands' format (:data:`FP8_FORMATS`, :func:`fp8_format`).
        x_q / x_s: float8_e4m3fn ``[R_b, D]`` / scales ``[R_b, D/B]``: the gathered rows
            quantised.
        h2_q / h2_s: float8_e4m3fn ``[R_b, F]`` / scales ``[R_b, F/B]``: h2 quantised.
        w13_config / w2_config: the two grouped GEMMs' launch configs (``block_m`` = the
            routing's ``row_block``, the padding multiple).
        w13_shape / w2_shape: the prepared weights' shapes this context takes.
    """

    precision: str
    format: str
    x_q: torch.Tensor
    x_s: torch.Tensor
    h2_q: torch.Tensor
    h2_s: torch.Tensor
    w13_config: ScaledGemmConfig
    w2_config: ScaledGemmConfig
    w13_shape: tuple[int, ...]
    w2_shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.x_q, self.x_s, self.h2_q, self.h2_s))


def allocate_fp8(cfg: MoEConfig, num_local_experts: int, receive_bound: int,
                 device: torch.device) -> FP8Scratch:
    """The scratch of an MXFP8 or block-FP8 inference context (module docstring, Memory);
    zeroed once so that rows never written hold finite values."""
    if cfg.precision not in FP8_FORMATS:
        raise ValueError(f"allocate_fp8 is for MXFP8 and block-FP8 contexts, got precision "
                         f"{cfg.precision!r}")
    R, D, F, E = receive_bound, cfg.hidden, cfg.ffn, num_local_experts
    w13_shape, w2_shape = (E, 2, F, D), (E, D, F)
    fmt = fp8_format(cfg)
    block, scale_dtype = FP8_FORMATS[fmt][:2]
    gluon = rules.scaled_gluon(device)
    return FP8Scratch(
        precision=cfg.precision,
        format=fmt,
        x_q=torch.zeros(R, D, dtype=torch.float8_e4m3fn, device=device),
        x_s=torch.zeros(R, D // block, dtype=scale_dtype, device=device),
        h2_q=torch.zeros(R, F, dtype=torch.float8_e4m3fn, device=device),
        h2_s=torch.zeros(R, F // block, dtype=scale_dtype, device=device),
        w13_config=rules.scaled_gemm(k=D, n=2 * F, swiglu=True, block_m=cfg.row_block,
                                     k_group=block, gluon=gluon),
        w2_config=rules.scaled_gemm(k=F, n=D, block_m=cfg.row_block, k_group=block,
                                    gluon=gluon),
        w13_shape=w13_shape,
        w2_shape=w2_shape,
    )


@dataclass(frozen=True)
class NVFP4Scratch:
    """What an NVFP4 inference context owns besides the bf16 context's buffers (allocated
    once, :func:`allocate_nvfp4`; ``R_b`` = the receive bound).

    Attributes:
        x_rows: bf16 ``[R_b, D]``: the gathered rows, then W2's output h3 (activation rows).
        row_scale: float32 ``[R_b]``: the gathered rows' global scales where the owners pack
            their rows as NVFP4 (:func:`~distmoe.plan.rules.packs_nvfp4_rows`), else None.
        w13_config / w2_config: the two grouped GEMMs' launch configs (``block_m`` = the
            routing's ``row_block``, the padding multiple).
        w13_shape / w2_shape: the prepared weights' shapes this context takes.
        fp8: where the GEMMs run on FP8 operands (:meth:`KernelPlan.fp4_fp8_operands
            <distmoe.plan.KernelPlan.fp4_fp8_operands>`), the quantised activations ``(x_q
            [R_b, D] e4m3, x_s [R_b, D/128] float32, h2_q [R_b, F], h2_s [R_b, F/128])``;
            else None.
        decode: the two GEMMs' configs for a call of few rows per expert where the planned
            ones (sized by ``max_tokens``) are not those of :func:`~distmoe.plan.rules.
            fp4_weight_gemm` at few rows (a context sized for prefill serving a decode
            step), with ``decode_rows``, the rows per local expert below which a call takes
            them (:meth:`configs`); else None.
    """

    x_rows: torch.Tensor
    row_scale: torch.Tensor | None
    w13_config: ScaledGemmConfig
    w2_config: ScaledGemmConfig
    w13_shape: tuple[int, ...]
    w2_shape: tuple[int, ...]
    fp8: tuple[torch.Tensor, ...] | None = None
    decode: tuple[ScaledGemmConfig, ScaledGemmConfig] | None = None
    decode_rows: int = 0

    def configs(self, tokens: int, top_k: int) -> tuple[ScaledGemmConfig, ScaledGemmConfig]:
        """The (W13, W2) configs of a call of ``tokens`` tokens on this rank: the decode ones
        where ``tokens * top_k`` over the local experts falls below ``decode_rows`` (a
        host integer: the call's shape, no synchronisation), else the planned ones."""
        if self.decode is not None and tokens * top_k < self.decode_rows * self.w13_shape[0]:
            return self.decode
        return self.w13_config, self.w2_config

    @property
    def nbytes(self) -> int:
        extra = (0 if self.row_scale is None else self.row_scale.nbytes) + sum(
            t.nbytes for t in self.fp8 or ())
        return self.x_rows.nbytes + extra


def allocate_nvfp4(cfg: MoEConfig, num_local_experts: int, receive_bound: int,
                   device: torch.device, ep_size: int = 1,
                   fp8_operands: bool = False) -> NVFP4Scratch:
    """The scratch of an NVFP4 inference context (module docstring, Memory); zeroed once.
    ``fp8_operands``: the GEMMs on FP8 operands (D and F multiples of 128)."""
    if cfg.precision not in ("nvfp4", "mxfp4") or cfg.training:
        raise ValueError(f"allocate_nvfp4 is for NVFP4 / MXFP4 inference contexts, got "
                         f"precision {cfg.precision!r} with training={cfg.training}")
    R, D, F, E = receive_bound, cfg.hidden, cfg.ffn, num_local_experts
    keys = dict(block_m=cfg.row_block, rows_per_expert=max(1, cfg.max_tokens * cfg.top_k // E),
                device_class=device_class(device))
    fp8 = None
    if fp8_operands:
        if D % FP8_GROUP or F % FP8_GROUP:
            raise ValueError(f"FP8 operands for {cfg.precision} need hidden ({D}) and ffn "
                             f"({F}) multiples of {FP8_GROUP}")
        fp8 = tuple(torch.zeros(R, c, dtype=dt, device=device)
                    for c, dt in ((D, torch.float8_e4m3fn), (D // FP8_GROUP, torch.float32),
                                  (F, torch.float8_e4m3fn), (F // FP8_GROUP, torch.float32)))
        gemm = functools.partial(fp4_weight_fp8_config, block_m=cfg.row_block)
        w13_config, w2_config = gemm(k=D, n=2 * F, swiglu=True), gemm(k=F, n=D)
    else:
        w13_config = rules.fp4_weight_gemm(k=D, n=2 * F, swiglu=True, **keys)
        w2_config = rules.fp4_weight_gemm(k=F, n=D, **keys)
    decode, decode_rows = None, 0
    few = dict(keys, rows_per_expert=1)
    decode_w13 = rules.fp4_weight_gemm(k=D, n=2 * F, swiglu=True, **few)
    if fp8 is None and decode_w13 != w13_config:
        decode = (decode_w13, rules.fp4_weight_gemm(k=F, n=D, **few))
        decode_rows = rules.fp4_swap_rows(keys["device_class"])
    return NVFP4Scratch(
        x_rows=torch.zeros(R, D, dtype=torch.bfloat16, device=device),
        row_scale=(torch.zeros(R, dtype=torch.float32, device=device)
                   if rules.packs_nvfp4_rows(precision=cfg.precision, ep_size=ep_size)
                   else None),
        w13_config=w13_config,
        w2_config=w2_config,
        w13_shape=(E, 2, F, D),
        w2_shape=(E, D, F),
        fp8=fp8,
        decode=decode,
        decode_rows=decode_rows,
    )


def allocate_lowp(cfg: MoEConfig, num_local_experts: int, receive_bound: int,
                  device: torch.device, ep_size: int = 1,
                  fp8_operands: bool = False) -> FP8Scratch | NVFP4Scratch | None:
    """The low-precision scratch of a context at ``cfg.precision`` (None at bf16);
    ``fp8_operands``: FP4-weight GEMMs on FP8 operands (:func:`allocate_nvfp4`)."""
    if cfg.precision in FP8_FORMATS:
        return allocate_fp8(cfg, num_local_experts, receive_bound, device)
    if cfg.precision in ("nvfp4", "mxfp4"):
        return allocate_nvfp4(cfg, num_local_experts, receive_bound, device, ep_size,
                              fp8_operands)
    return None


def check_prepared(scratch: FP8Scratch | NVFP4Scratch, device: torch.device, w13, w2,
                   precision: str) -> None:
    """The prepared weights of a low-precision call: :class:`PreparedWeight` of the context's
    precision, the config's shapes, on the context's device (``TypeError`` / ``ValueError``
    naming the argument)."""
    for name, w, shape, text in (
            ("w13", w13, scratch.w13_shape, "[E_local, 2, ffn, hidden] (gate, up)"),
            ("w2", w2, scratch.w2_shape, "[E_local, hidden, ffn]")):
        if isinstance(w, torch.Tensor):
            raise TypeError(
                f"{name} must be a PreparedWeight for precision {precision!r}, got a "
                f"{w.dtype} tensor: quantise the weights once with "
                f"distmoe.quant.prepare_weights(w13, w2, {precision!r}) and pass its results")
        if not isinstance(w, PreparedWeight):
            raise TypeError(f"{name} must be a PreparedWeight (distmoe.quant.prepare_weights), "
                            f"got {type(w).__name__}")
        if w.precision != precision:
            raise ValueError(f"{name} was prepared for precision {w.precision!r}, the context "
                             f"runs {precision!r}")
        if w.shape != shape:
            raise ValueError(f"{name} must be prepared from a weight of shape {list(shape)} "
                             f"{text}, got {list(w.shape)}")
        if w.qdata.device != device:
            raise ValueError(f"{name} must be on {device} (the context's device), got "
                             f"{w.qdata.device} (PreparedWeight.to moves it)")


def lowp_forward(ctx, x, expert_ids, scores, w13: PreparedWeight, w2: PreparedWeight, *,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """The forward of ``ctx.cfg.precision`` on checked inputs (y [T, D] bf16)."""
    forward = nvfp4_forward if ctx.cfg.precision in ("nvfp4", "mxfp4") else fp8_forward
    return forward(ctx, x, expert_ids, scores, w13, w2, out=out)


def route_rows(ctx, x, expert_ids):
    """Steps 1-3 and the rows' addresses: publish, route; returns the routing tables
    (:mod:`distmoe.routing.tables`) and the gather table the rows are read through."""
    T = expert_ids.shape[0]
    pull_all = ctx.ep_size > 1 and ctx.plan.pulls_all(ctx.cfg, T)
    tables = ctx._publish_and_route(x, expert_ids, pull_all)  # steps 1-3
    return tables, ctx.gather_table(tables.gather_ptrs, pulled=pull_all, x=x)


def route_and_gather(ctx, x, expert_ids, x_rows: torch.Tensor):
    """Steps 1-4a: publish, route, gather the executed rows into ``x_rows``; returns the
    routing tables (:mod:`distmoe.routing.tables`)."""
    tables, gather_ptrs = route_rows(ctx, x, expert_ids)
    regather_rows(gather_ptrs, tables.padded_offsets, tables.row_offsets, x_rows,
                  block_m=ctx.cfg.row_block)
    return tables


def route_and_quantize(ctx, x, expert_ids, x_q: torch.Tensor, x_s: torch.Tensor, fmt: str):
    """Steps 1-4b of the FP8 formats: publish, route, gather the executed rows quantised in
    format ``fmt`` into ``x_q`` / ``x_s`` (one kernel); returns the routing tables and the
    gather table the rows were read through."""
    tables, gather_ptrs = route_rows(ctx, x, expert_ids)
    gather_quantize(gather_ptrs, tables.padded_offsets, tables.row_offsets, x_q, x_s,
                    format=fmt, block_m=ctx.cfg.row_block)
    return tables, gather_ptrs


def scatter_and_combine(ctx, tables, h3: torch.Tensor | None, x, expert_ids, scores,
                         out: torch.Tensor | None) -> torch.Tensor:
    """Steps 5c-7: scatter h3's live rows to their combine slots (``h3`` None: W2 stored
    them there itself), barrier, combine; returns y [T, D] bf16 (into ``out`` when
    given)."""
    T, K = expert_ids.shape
    if h3 is not None:
        scatter_rows(h3, tables.padded_offsets, tables.row_offsets, tables.scatter_ptrs,
                     block_m=ctx.cfg.row_block)
    ctx.heap.barrier()
    y = torch.empty_like(x) if out is None else out
    # dest_rows_TK is -1 exactly where a route is not executed (the combine's ids)
    combine(ctx._combine[:T * K], tables.dest_rows_TK, scores.float().contiguous(), y,
            config=ctx.plan.combine)
    return y


def _fp8_operand(ctx, w, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qdata, scales)`` of a weight for the GEMMs of format ``fmt``: a pair is already
    in that format (a training context's forms), a :class:`PreparedWeight` is rebased where
    the format asks."""
    if isinstance(w, tuple):
        return w
    return rebased_weight(ctx, w) if fmt == "mxfp8_rebased" else (w.qdata, w.scales)


def fp8_forward(ctx, x, expert_ids, scores, w13, w2, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Steps 1-7 of the module docstring (mxfp8, fp8_block) on checked inputs; returns
    y [T, D] bf16 (into ``out`` when given). ``w13`` / ``w2``: :class:`PreparedWeight`, or
    ``(qdata, scales)`` pairs already in the context's operand format (a training context's
    :class:`~distmoe.ops.lowp_train.TrainWeights` forms)."""
    s: FP8Scratch = ctx._lowp
    _, _, quantize_2d, grouped_mm = FP8_FORMATS[s.format]
    (q13, s13), (q2, s2) = (_fp8_operand(ctx, w, s.format) for w in (w13, w2))
    tables, _ = route_and_quantize(ctx, x, expert_ids, s.x_q, s.x_s, s.format)
    po, ro = tables.padded_offsets, tables.row_offsets
    h2 = ctx._h2
    grouped_mm(s.x_q, s.x_s, q13, s13, po, ro, h2, swiglu=True, config=s.w13_config)
    quantize_2d(h2, s.h2_q, s.h2_s)
    # W2 stores each route's h3 row in its owner's combine slot (5b and 5c in one kernel)
    grouped_mm(s.h2_q, s.h2_s, q2, s2, po, ro, None, config=s.w2_config,
               scatter_ptrs=tables.scatter_ptrs)
    return scatter_and_combine(ctx, tables, None, x, expert_ids, scores, out)


def route_and_gather_nvfp4(ctx, x, expert_ids, x_rows: torch.Tensor,
                           row_scale: torch.Tensor):
    """Steps 1-4a with rows packed by their owners (:mod:`~distmoe.kernels.scaled.nvfp4_rows`,
    EP > 1): each rank packs its x into its dispatch slots, peers copy the packed bytes
    only, and the executed rows are decoded into ``x_rows`` (``v * s_b``) with their global
    scales in ``row_scale``; returns the routing tables."""
    T = expert_ids.shape[0]
    pull_all = ctx.plan.pulls_all(ctx.cfg, T)
    _, _, num_bytes = nvfp4_row_layout(ctx.cfg.hidden)
    copy_elems = -(-num_bytes // 16) * 8  # whole 16-byte vectors
    tables = ctx._publish_and_route(x, expert_ids, pull_all, pack=pack_nvfp4_rows,
                                    copy_elems=copy_elems)
    ptrs = ctx.gather_table(tables.gather_ptrs, pulled=pull_all, copy_elems=copy_elems)
    gather_nvfp4_rows(ptrs, tables.padded_offsets, tables.row_offsets, x_rows, row_scale,
                      block_m=ctx.cfg.row_block)
    return tables


def _fp4_mm(a, w: PreparedWeight, po, ro, out, *, fp8_a=None, **kw):
    """The FP4-weight grouped GEMM of ``w``'s precision: MXFP4 (no global scale) or NVFP4;
    ``fp8_a = (a_q, a_s)``: on FP8 operands (``a`` unused)."""
    if fp8_a is not None:
        return nvfp4_weight_fp8_mm(*fp8_a, w.qdata, w.scales,
                                   None if w.precision == "mxfp4" else w.global_scale, po, ro,
                                   out, **kw)
    if w.precision == "mxfp4":
        return mxfp4_weight_grouped_mm(a, w.qdata, w.scales, po, ro, out, **kw)
    return nvfp4_weight_grouped_mm(a, w.qdata, w.scales, w.global_scale, po, ro, out, **kw)


def nvfp4_forward(ctx, x, expert_ids, scores, w13: PreparedWeight, w2: PreparedWeight, *,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Steps 1-7 of the module docstring (nvfp4: weight-only, bf16 activations) on checked
    inputs; returns y [T, D] bf16 (into ``out`` when given)."""
    s: NVFP4Scratch = ctx._lowp
    x_fp8 = h2_fp8 = None
    if s.fp8 is not None:
        x_fp8, h2_fp8 = s.fp8[:2], s.fp8[2:]
    if s.row_scale is not None:  # rows packed by their owners
        tables = route_and_gather_nvfp4(ctx, x, expert_ids, s.x_rows, s.row_scale)
        if x_fp8 is not None:  # the decoded rows (v * s_b, exact in bf16) quantised
            fp8_block_quantize_2d(s.x_rows, *x_fp8)
    elif x_fp8 is not None:  # gathered and quantised in one kernel
        tables, _ = route_and_quantize(ctx, x, expert_ids, *x_fp8, "fp8_block")
    else:
        tables = route_and_gather(ctx, x, expert_ids, s.x_rows)
    po, ro = tables.padded_offsets, tables.row_offsets
    h2 = ctx._h2
    extra = {} if s.row_scale is None else {"a_row_scale": s.row_scale}
    w13_config, w2_config = s.configs(x.shape[0], ctx.cfg.top_k)
    _fp4_mm(s.x_rows, w13, po, ro, h2, swiglu=True, config=w13_config, fp8_a=x_fp8, **extra)
    if h2_fp8 is not None:
        fp8_block_quantize_2d(h2, *h2_fp8)
    h3 = s.x_rows  # the gathered rows are dead once W13 has read them
    _fp4_mm(h2, w2, po, ro, h3, config=w2_config, fp8_a=h2_fp8)
    return scatter_and_combine(ctx, tables, h3, x, expert_ids, scores, out)
