"""Rowwise PUT/GET of MXFP8 rows: E4M3 values and their E8M0 scales (one per 32 values) move
in two heap buffers, about half the bytes of bf16 rows (``1 + 1/32`` bytes a value).

Legend as in :mod:`distmoe.rowwise.dispatch` (N token rows, K routes per token, D = hidden,
R = ``Buffers.rows``); the buffers are those of ``Buffers(scaled=True)``.

* :func:`dispatch_put_scaled`: route ``(t, k)`` copies ``qdata[t]`` and ``scales[t]`` into
  row ``dst_rows[t, k]`` of ``out_q`` / ``out_s`` on rank ``dst_ranks[t, k]``, bit for bit
  (the source rank quantises once, e.g. with :func:`distmoe.quant.mxfp8_quantize`; the
  route weights apply at the combine). Not differentiable: the bytes carry no gradient (a
  training step moves its bf16 gradients with the bf16 calls).
* :func:`combine_get_scaled`: every route pulls its row of ``expert_out_q`` /
  ``expert_out_s``, dequantised on arrival (exact in fp32), and each token's K routes are
  summed in fp32 in k order, weighted by ``probs`` (one bf16 rounding): with the same
  values in bf16 buffers, :func:`~distmoe.rowwise.combine_get`'s bits. Differentiable with
  respect to ``probs``: its gradient ``dot(grad_y[t], row(t, k))`` reads the dequantised
  routes kept by the forward (``[N, K, D]`` bf16, exact); ``keep_routes=True`` returns them.

Invalid routes (a negative rank or row) are skipped; bad ones (rank >= EP, row >= R) are
dropped and counted like the bf16 calls' (``Buffers.stats()``), or refused with
``Buffers(check=True)``. Sync points: the barriers asked for (defaults as the bf16 calls'),
none on the host.
"""

from __future__ import annotations

import torch

from distmoe.kernels.movement.rowwise_get import rowwise_combine_get_scaled
from distmoe.kernels.movement.rowwise_put import rowwise_put
from distmoe.quant.mxfp8 import mxfp8_dequantize
from distmoe.rowwise.buffers import Buffers, scaled_buffer_of
from distmoe.rowwise.checks import (
    check_flag,
    check_on_device,
    check_probs,
    check_route_maps,
    check_values,
)
from distmoe.rowwise.transport import route_dots


def dispatch_put_scaled(qdata: torch.Tensor, scales: torch.Tensor, dst_ranks: torch.Tensor,
                        dst_rows: torch.Tensor, out_q: torch.Tensor, *,
                        pre_barrier: bool = False,
                        post_barrier: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """*Collective* (when a barrier is asked for). Push MXFP8 token rows into the peers'
    ``out_q`` / ``out_s`` buffers, one row per route, bit for bit.

    Args:
        qdata: float8_e4m3fn ``[N, D]`` contiguous (``mxfp8_quantize(x, dim=-1)[0]``).
        scales: uint8 E8M0 ``[N, D/32]`` contiguous (its scales).
        dst_ranks / dst_rows: signed integer ``[N, K]`` contiguous, as
            :func:`~distmoe.rowwise.dispatch_put`'s; negative = invalid route.
        out_q: the ``.out_q`` (or ``.expert_out_q``) of ``Buffers(scaled=True)``, whole;
            its scale buffer (``.out_s`` / ``.expert_out_s``) receives the scales.
        pre_barrier / post_barrier: as :func:`~distmoe.rowwise.dispatch_put` (default
            False / True).

    Returns ``(out_q, out_s)``: this rank's received qdata ``[R, D]`` and scales
    ``[R, D/32]``. Not differentiable.
    """
    bufs, q_name, s_name = scaled_buffer_of("out_q", out_q)
    check_scaled_rows(qdata, scales, bufs)
    check_route_maps("dst_ranks", dst_ranks, "dst_rows", dst_rows, bufs, ndim=2,
                     num_tokens=qdata.shape[0])
    check_flag("pre_barrier", pre_barrier)
    check_flag("post_barrier", post_barrier)
    if bufs.check:
        check_values(bufs, "dispatch_put_scaled", "dst_ranks/dst_rows", dst_ranks, dst_rows,
                     False)
    put_scaled_rows(bufs, q_name, s_name, qdata, scales, dst_ranks, dst_rows, pre_barrier,
                    post_barrier)
    return getattr(bufs, q_name), getattr(bufs, s_name)


def put_scaled_rows(bufs: Buffers, q_name: str, s_name: str, qdata: torch.Tensor,
                    scales: torch.Tensor, dst_ranks: torch.Tensor, dst_rows: torch.Tensor,
                    pre_barrier: bool, post_barrier: bool) -> None:
    """The scaled PUT (checked arguments): the barriers asked for around two row PUTs, the
    qdata bytes (bad routes counted) and the scale bytes."""
    if pre_barrier:
        bufs.barrier()
    rowwise_put(qdata.view(torch.uint8), dst_ranks, dst_rows, bufs.bases(q_name), bufs.rows,
                bad_count=bufs.counter("put"))
    rowwise_put(scales, dst_ranks, dst_rows, bufs.bases(s_name), bufs.rows)
    if post_barrier:
        bufs.barrier()


def check_scaled_rows(qdata: object, scales: object, bufs: Buffers) -> None:
    """MXFP8 rows for ``bufs``: qdata float8_e4m3fn ``[N, hidden]`` and scales uint8
    ``[N, hidden/32]``, contiguous, on the Buffers' device."""
    if not isinstance(qdata, torch.Tensor):
        raise TypeError(f"qdata must be a torch.Tensor, got {type(qdata).__name__}")
    if qdata.dtype != torch.float8_e4m3fn:
        raise TypeError(f"qdata must have dtype float8_e4m3fn (MXFP8 values), got {qdata.dtype}")
    if qdata.dim() != 2 or qdata.shape[1] != bufs.hidden or not qdata.is_contiguous():
        raise ValueError(f"qdata must be contiguous [N, hidden = {bufs.hidden}], got shape "
                         f"{list(qdata.shape)}")
    if not isinstance(scales, torch.Tensor):
        raise TypeError(f"scales must be a torch.Tensor, got {type(scales).__name__}")
    if scales.dtype != torch.uint8:
        raise TypeError(f"scales must have dtype uint8 (E8M0 exponents), got {scales.dtype}")
    want = [qdata.shape[0], bufs.hidden // 32]
    if list(scales.shape) != want or not scales.is_contiguous():
        raise ValueError(f"scales must be contiguous {want} (one per 32 values of qdata), got "
                         f"shape {list(scales.shape)}")
    check_on_device("qdata", qdata, bufs)
    check_on_device("scales", scales, bufs)


class CombineGetScaledFunction(torch.autograd.Function):
    """Autograd node of :func:`combine_get_scaled` (differentiable in ``probs`` only)."""

    @staticmethod
    def forward(ctx, probs, bufs: Buffers, q_name: str, s_name: str, src_ranks, src_rows,
                pre_barrier: bool, post_barrier: bool):
        y, kept = combine_scaled_rows(bufs, q_name, s_name, src_ranks, src_rows, probs, True,
                                      pre_barrier, post_barrier)
        ctx.probs_dtype = probs.dtype
        ctx.save_for_backward(kept)
        ctx.mark_non_differentiable(kept)
        return y, kept

    @staticmethod
    def backward(ctx, grad_y, _grad_kept):
        (kept,) = ctx.saved_tensors
        if grad_y is None:
            return None, None, None, None, None, None, None, None
        grad_probs = scaled_probs_grad(kept, grad_y, ctx.probs_dtype)
        return grad_probs, None, None, None, None, None, None, None


def scaled_probs_grad(kept: torch.Tensor, grad_y: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """``grad_probs[t, k] = dot(fp32 kept[t, k], fp32 grad_y[t])`` in ``dtype``, from the
    routes a scaled combine kept (``[N, K, D]`` bf16)."""
    # routes not read were kept as zero rows: their dot is 0
    read = torch.ones(kept.shape[:2], dtype=torch.int8, device=kept.device)
    return route_dots(kept, read, grad_y, dtype)


def combine_scaled_rows(bufs: Buffers, q_name: str, s_name: str, src_ranks: torch.Tensor,
                        src_rows: torch.Tensor, probs: torch.Tensor | None, keep: bool,
                        pre_barrier: bool, post_barrier: bool
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The scaled combine (checked arguments): ``(y [N, D] bf16, kept routes [N, K, D] bf16
    or None)``, the barriers asked for around one fused GET-dequantise-reduce kernel."""
    if pre_barrier:
        bufs.barrier()
    num_tokens, top_k = src_ranks.shape
    y = torch.empty(num_tokens, bufs.hidden, dtype=torch.bfloat16, device=bufs.device)
    kept = (torch.empty(num_tokens, top_k, bufs.hidden, dtype=torch.bfloat16,
                        device=bufs.device) if keep else None)
    rowwise_combine_get_scaled(bufs.bases(q_name), bufs.bases(s_name), bufs.rows, src_ranks,
                               src_rows, y, probs=probs, kept=kept,
                               bad_count=bufs.counter("get"))
    if post_barrier:
        bufs.barrier()
    return y, kept


def combine_get_scaled(expert_out_q: torch.Tensor, src_ranks: torch.Tensor,
                       src_rows: torch.Tensor, probs: torch.Tensor | None = None, *,
                       pre_barrier: bool = True, post_barrier: bool = False,
                       keep_routes: bool = False
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """*Collective* (when a barrier is asked for). Pull every route's MXFP8 row, dequantise
    it on arrival and reduce each token's K routes in fp32 (module docstring).

    Args:
        expert_out_q: the ``.expert_out_q`` (or ``.out_q``) of ``Buffers(scaled=True)``,
            whole: the source qdata; its scale buffer is read with it.
        src_ranks / src_rows: signed integer ``[N, K]`` contiguous; negative = invalid.
        probs: optional float32 / bf16 / fp16 ``[N, K]`` contiguous: route weights
            (multiplied in fp32); differentiable.
        pre_barrier / post_barrier: default True / False (the peers' rows have landed).
        keep_routes: also return the dequantised routes.

    Returns ``y`` bf16 ``[N, D]`` (``y[t] = bf16(sum over read k of probs[t, k] *
    dequant(row))``; zeros for a token with no read route), or ``(y, routes)`` with
    ``keep_routes``: routes bf16 ``[N, K, D]``, zeros where not read.
    """
    bufs, q_name, s_name = scaled_buffer_of("expert_out_q", expert_out_q)
    check_route_maps("src_ranks", src_ranks, "src_rows", src_rows, bufs, ndim=2)
    check_probs(probs, src_ranks, "src_ranks", bufs)
    for name, value in (("pre_barrier", pre_barrier), ("post_barrier", post_barrier),
                        ("keep_routes", keep_routes)):
        check_flag(name, value)
    differentiable = torch.is_grad_enabled() and probs is not None and probs.requires_grad
    if bufs.check:
        check_values(bufs, "combine_get_scaled", "src_ranks/src_rows", src_ranks, src_rows,
                     differentiable)
    if differentiable:
        y, kept = CombineGetScaledFunction.apply(probs, bufs, q_name, s_name, src_ranks,
                                                 src_rows, pre_barrier, post_barrier)
    else:
        y, kept = combine_scaled_rows(bufs, q_name, s_name, src_ranks, src_rows, probs,
                                      keep_routes, pre_barrier, post_barrier)
    return (y, kept) if keep_routes else y


def combine_get_scaled_ref(sources_q: list[torch.Tensor], sources_s: list[torch.Tensor],
                           src_ranks: torch.Tensor, src_rows: torch.Tensor,
                           probs: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch :func:`combine_get_scaled` of one rank reading every rank's buffers
    (``sources_q[r]`` float8_e4m3fn ``[R, D]``, ``sources_s[r]`` uint8 ``[R, D/32]``):
    ``(y [N, D] bf16, routes [N, K, D] bf16)``, fp32 sum in k order (the kernel's order,
    the same bits on the CPU)."""
    num_tokens, top_k = src_ranks.shape
    hidden = sources_q[0].shape[1]
    routes = torch.zeros(num_tokens, top_k, hidden, dtype=torch.float32)
    acc = torch.zeros(num_tokens, hidden, dtype=torch.float32)
    for t in range(num_tokens):
        for k in range(top_k):
            rank, row = int(src_ranks[t, k]), int(src_rows[t, k])
            if rank < 0 or row < 0 or rank >= len(sources_q) or row >= sources_q[0].shape[0]:
                continue
            val = mxfp8_dequantize(sources_q[rank][row:row + 1].cpu(),
                                   sources_s[rank][row:row + 1].cpu())[0]
            routes[t, k] = val
            acc[t] += val if probs is None else probs[t, k].float().cpu() * val
    return acc.bfloat16(), routes.bfloat16()
