"""The torch baseline of shared/DESIGN.md: what a careful PyTorch user writes today.

EP = 1 (:func:`torch_moe`):

    1. inactive routes (id -1) are sent to the rank's first local expert with score 0, so
       every grouped-GEMM row is finite and the layout needs no host-side count;
    2. routes sorted by expert (stable ``argsort`` of the flat ids), rows per expert counted
       on the device (``scatter_add_``) and turned into int32 group ends (``cumsum``);
    3. ``x_RD = x.index_select(0, token_R)``: the routed rows, expert-major;
    4. ``h1 = torch._grouped_mm(x_RD, W13^T, offs)`` with ``W13 = w13.view(E, 2F, D)``;
    5. ``h2 = silu(g) * u``;
    6. ``h3 = torch._grouped_mm(h2, W2^T, offs)``;
    7. ``y = zeros(T, D, fp32).index_add(0, token_R, h3 * score_R)``, cast to x's dtype.

Backward is PyTorch autograd through these ops. There is no host synchronisation (so the
forward and backward can be captured in a CUDA graph).

EP > 1 (:func:`torch_moe` with a group of several ranks), torchtitan's all-to-all approach:
route counts per global expert are exchanged with ``all_to_all_single``, the per-rank split
sizes are copied to the host with ``.tolist()`` (a device-host synchronisation that is part of
the baseline's cost and prevents graph capture), rows are exchanged with
``torch.distributed.all_to_all_single`` inside a small autograd Function (its backward is the
reverse all-to-all), regrouped from (source rank, expert) to (expert, source rank) order, run
through the same grouped MLP, put back in arrival order, returned with a second all-to-all and
combined on the owner, as above.

Grouped GEMM: ``torch._grouped_mm`` is used when a small probe (forward and backward, an empty
group included) works on the device and dtype; otherwise a per-expert loop of ``@`` with host
offsets runs instead (meant for CPU tests: CPU builds of torch 2.13 run the forward but not the
backward). :func:`grouped_mm_path` says which one runs.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

GroupedMMPath = Literal["grouped_mm", "loop"]


# ----------------------------------------------------------------------------- grouped GEMM


def _grouped_mm_loop(a_RK: torch.Tensor, b_eKN: torch.Tensor, offs_e: torch.Tensor) -> torch.Tensor:
    """``out[rows of group e] = a[rows of group e] @ b[e]`` with a host loop (syncs)."""
    ends = offs_e.tolist()
    outs, start = [], 0
    for e, end in enumerate(ends):
        outs.append(a_RK[start:end] @ b_eKN[e])
        start = end
    if start != a_RK.shape[0]:
        outs.append(a_RK.new_zeros(a_RK.shape[0] - start, b_eKN.shape[-1]))
    return torch.cat(outs, dim=0)


@functools.cache
def _probe_grouped_mm(
    device_type: str, device_index: int | None, dtype: torch.dtype
) -> tuple[bool, str]:
    if not hasattr(torch, "_grouped_mm"):
        return False, "torch._grouped_mm does not exist in this torch"
    device = torch.device(device_type, device_index) if device_index is not None else device_type
    try:
        with torch.enable_grad():  # callers may sit under no_grad (inference timing)
            return _run_probe(device, dtype)
    except Exception as exc:  # any failure means: use the loop
        lines = str(exc).strip().splitlines()
        first = lines[0] if lines else ""
        return False, f"torch._grouped_mm probe failed: {type(exc).__name__}: {first}"


def _run_probe(device, dtype: torch.dtype) -> tuple[bool, str]:
    """Forward and backward of a tiny grouped GEMM (group 1 empty) against the host loop."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(24, 16, device=device, dtype=dtype, generator=gen).requires_grad_(True)
    w = torch.randn(3, 8, 16, device=device, dtype=dtype, generator=gen).requires_grad_(True)
    offs = torch.tensor([8, 8, 24], device=device, dtype=torch.int32)
    out = torch._grouped_mm(a, w.transpose(1, 2), offs=offs)
    grad_a, grad_w = torch.autograd.grad(out.float().square().sum(), (a, w))
    a_ref = a.detach().float().requires_grad_(True)
    w_ref = w.detach().float().requires_grad_(True)
    ref = _grouped_mm_loop(a_ref, w_ref.transpose(1, 2), offs)
    ref_a, ref_w = torch.autograd.grad(ref.square().sum(), (a_ref, w_ref))
    for got, want in ((out, ref), (grad_a, ref_a), (grad_w, ref_w)):
        scale = want.abs().max().item() + 1e-6
        if not (got.float() - want).abs().max().item() <= 0.05 * scale:
            return False, "torch._grouped_mm probe gave wrong values"
    return True, ""


def grouped_mm_path(
    device: torch.device | str, dtype: torch.dtype = torch.bfloat16
) -> tuple[GroupedMMPath, str]:
    """Which grouped GEMM :func:`torch_moe` runs on ``device``/``dtype``, and why not the fast
    one."""
    device = torch.device(device)
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    ok, reason = _probe_grouped_mm(device.type, index, dtype)
    return ("grouped_mm", "") if ok else ("loop", reason)


def _grouped_mm(
    a_RK: torch.Tensor, b_eKN: torch.Tensor, offs_e: torch.Tensor, path: GroupedMMPath
) -> torch.Tensor:
    if path == "grouped_mm":
        return torch._grouped_mm(a_RK, b_eKN, offs=offs_e)
    return _grouped_mm_loop(a_RK, b_eKN, offs_e)


def grouped_swiglu_mlp(
    x_RD: torch.Tensor,
    w13_e2FD: torch.Tensor,
    w2_eDF: torch.Tensor,
    offs_e: torch.Tensor,
    path: GroupedMMPath,
) -> torch.Tensor:
    """Expert-major rows through their experts: ``h3 = (silu(g) * u) @ W2^T`` with
    ``[g|u] = x @ W13^T``.

    Args:
        x_RD: ``[R, D]`` rows sorted by local expert.
        w13_e2FD: ``[E_local, 2, F, D]``; w2_eDF: ``[E_local, D, F]``.
        offs_e: ``[E_local]`` int32 end row of each expert's group (``offs_e[-1] == R``).
    Returns:
        h3_RD ``[R, D]`` in the weights' dtype.
    """
    num_local, _, ffn, hidden = w13_e2FD.shape
    w13_eD2F = w13_e2FD.reshape(num_local, 2 * ffn, hidden).transpose(1, 2)
    h1_R2F = _grouped_mm(x_RD, w13_eD2F, offs_e, path)
    h2_RF = F.silu(h1_R2F[:, :ffn]) * h1_R2F[:, ffn:]
    return _grouped_mm(h2_RF, w2_eDF.transpose(1, 2), offs_e, path)


# ----------------------------------------------------------------------------- EP = 1 and EP > 1


def _sort_routes(expert_ids_TK: torch.Tensor, scores_TK: torch.Tensor, inactive_expert: int):
    """Expert-major route order. Returns (flat ids, order_R, token_R, score_R (fp32, in order))."""
    top_k = expert_ids_TK.shape[1]
    is_active_TK = expert_ids_TK >= 0
    ids_R = torch.where(is_active_TK, expert_ids_TK, inactive_expert).reshape(-1).long()
    score_R = (scores_TK.float() * is_active_TK).reshape(-1)
    order_R = torch.argsort(ids_R, stable=True)
    return ids_R, order_R, order_R // top_k, score_R.index_select(0, order_R)


def _combine(
    h3_RD: torch.Tensor, token_R: torch.Tensor, score_R: torch.Tensor, like_TD: torch.Tensor
) -> torch.Tensor:
    weighted_RD = h3_RD.float() * score_R[:, None]
    y_TD = torch.zeros(like_TD.shape, dtype=torch.float32, device=like_TD.device)
    return y_TD.index_add(0, token_R, weighted_RD).to(like_TD.dtype)


def _count(ids_R: torch.Tensor, num_bins: int) -> torch.Tensor:
    counts = torch.zeros(num_bins, dtype=torch.int64, device=ids_R.device)
    return counts.scatter_add_(0, ids_R, torch.ones_like(ids_R))


def torch_moe(
    x_TD: torch.Tensor,
    expert_ids_TK: torch.Tensor,
    scores_TK: torch.Tensor,
    w13_e2FD: torch.Tensor,
    w2_eDF: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    path: GroupedMMPath | None = None,
) -> torch.Tensor:
    """The torch baseline layer; autograd-aware.

    Args:
        x_TD: ``[T, D]`` tokens (bf16 on GPU; any float dtype on CPU).
        expert_ids_TK: ``[T, K]`` integer global expert ids, -1 = inactive route.
        scores_TK: ``[T, K]`` float router weights (0 on inactive routes).
        w13_e2FD: ``[E_local, 2, F, D]`` local experts' ``[gate; up]`` weights.
        w2_eDF: ``[E_local, D, F]`` local experts' down weights.
        group: expert-parallel group; ``None`` or one rank runs the EP = 1 path.
        path: ``"grouped_mm"`` or ``"loop"``; default :func:`grouped_mm_path` of the device.
    Returns:
        y_TD ``[T, D]`` in x's dtype, accumulated in fp32.
    """
    if path is None:
        path = grouped_mm_path(x_TD.device, w13_e2FD.dtype)[0]
    ep_size = 1 if group is None else dist.get_world_size(group)
    if ep_size == 1:
        return _torch_moe_local(x_TD, expert_ids_TK, scores_TK, w13_e2FD, w2_eDF, path)
    return _torch_moe_ep(x_TD, expert_ids_TK, scores_TK, w13_e2FD, w2_eDF, group, path)


def _torch_moe_local(x_TD, expert_ids_TK, scores_TK, w13_e2FD, w2_eDF, path):
    num_experts = w13_e2FD.shape[0]
    ids_R, order_R, token_R, score_R = _sort_routes(expert_ids_TK, scores_TK, inactive_expert=0)
    rows_per_expert_e = _count(ids_R, num_experts)
    offs_e = rows_per_expert_e.cumsum(0).to(torch.int32)
    x_RD = x_TD.index_select(0, token_R)
    h3_RD = grouped_swiglu_mlp(x_RD, w13_e2FD, w2_eDF, offs_e, path)
    return _combine(h3_RD, token_R, score_R, x_TD)


class _AllToAll(torch.autograd.Function):
    """``torch.distributed.all_to_all_single`` of rows; backward sends gradients the other way."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        output_splits, input_splits = ctx.splits
        grad_x = grad_out.new_empty((sum(input_splits), *grad_out.shape[1:]))
        dist.all_to_all_single(
            grad_x, grad_out.contiguous(), input_splits, output_splits, group=ctx.group
        )
        return grad_x, None, None, None


def _all_to_all(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group
) -> torch.Tensor:
    return _AllToAll.apply(x, output_splits, input_splits, group)


def _torch_moe_ep(x_TD, expert_ids_TK, scores_TK, w13_e2FD, w2_eDF, group, path):
    ep_size, rank = dist.get_world_size(group), dist.get_rank(group)
    num_local = w13_e2FD.shape[0]
    ids_R, order_R, token_R, score_R = _sort_routes(
        expert_ids_TK, scores_TK, inactive_expert=rank * num_local
    )
    # Routes per global expert; global ids are rank-major, so expert order is rank order.
    send_per_expert_E = _count(ids_R, ep_size * num_local)
    recv_per_expert_SE = torch.empty_like(send_per_expert_E)
    dist.all_to_all_single(recv_per_expert_SE, send_per_expert_E, group=group)
    recv_per_expert_SE = recv_per_expert_SE.view(ep_size, num_local)  # [source rank, local expert]
    # The host synchronisation of this baseline: split sizes must be Python ints.
    input_splits = send_per_expert_E.view(ep_size, num_local).sum(1).tolist()
    output_splits = recv_per_expert_SE.sum(1).tolist()
    num_recv = sum(output_splits)

    send_x_RD = x_TD.index_select(0, token_R)
    recv_x_ND = _all_to_all(send_x_RD, output_splits, input_splits, group)
    # Arrival order is (source rank, local expert); the grouped GEMM wants local-expert order.
    local_expert_N = torch.repeat_interleave(
        torch.arange(num_local, device=x_TD.device).repeat(ep_size),
        recv_per_expert_SE.reshape(-1),
        output_size=num_recv,
    )
    perm_N = torch.argsort(local_expert_N, stable=True)
    offs_e = recv_per_expert_SE.sum(0).cumsum(0).to(torch.int32)
    h3_ND = grouped_swiglu_mlp(recv_x_ND.index_select(0, perm_N), w13_e2FD, w2_eDF, offs_e, path)
    h3_arrival_ND = h3_ND.index_select(0, torch.argsort(perm_N))
    h3_RD = _all_to_all(h3_arrival_ND, input_splits, output_splits, group)
    return _combine(h3_RD, token_R, score_R, x_TD)


# ----------------------------------------------------------------------------- rowwise FP8


def rowwise_fp8(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise FP8 of ``v [..., K]``: ``(q float8_e4m3fn, s float32 [...])`` with
    ``s = max(amax, 1e-12) / 448`` per row and ``q = fp8(v / s)`` (torch's round to nearest).
    The recipe ``torch._scaled_grouped_mm``'s rowwise scaling takes (dequantised: ``q * s``)."""
    s = v.float().abs().amax(-1).clamp(min=1e-12) / 448.0
    return (v.float() / s[..., None]).to(torch.float8_e4m3fn), s


def scaled_grouped_mm_path(device: torch.device | str) -> tuple[GroupedMMPath, str]:
    """``"grouped_mm"`` where ``torch._scaled_grouped_mm`` runs on ``device`` (a tiny probe
    against the dequantised product), else ``"loop"`` (dequantised operands, a host loop) and
    why."""
    device = torch.device(device)
    if device.type != "cuda" or not hasattr(torch, "_scaled_grouped_mm"):
        return "loop", "torch._scaled_grouped_mm needs CUDA (and a torch that has it)"
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        a, sa = rowwise_fp8(torch.randn(32, 32, device=device, generator=gen))
        b, sb = rowwise_fp8(torch.randn(2, 16, 32, device=device, generator=gen))
        offs = torch.tensor([16, 32], device=device, dtype=torch.int32)
        out = torch._scaled_grouped_mm(a, b.transpose(1, 2), sa, sb, offs=offs,
                                       out_dtype=torch.bfloat16)
        ref = _scaled_loop(a, sa, b, sb, offs)
        if (out.float() - ref).abs().max().item() > 0.02 * ref.abs().max().item():
            return "loop", "torch._scaled_grouped_mm probe gave wrong values"
    except Exception as exc:
        return "loop", f"torch._scaled_grouped_mm probe failed: {type(exc).__name__}"
    return "grouped_mm", ""


def _scaled_loop(a_q, s_a, b_q, s_b, offs_e):
    """The rowwise-FP8 grouped product on dequantised operands (fp32; a host loop)."""
    a = a_q.float() * s_a[:, None]
    b = b_q.float() * s_b[..., None]  # [E, N, K]
    return _grouped_mm_loop(a, b.transpose(1, 2), offs_e)


def _scaled_grouped(a_q, s_a, b_q, s_b, offs_e, path):
    if path == "grouped_mm":
        return torch._scaled_grouped_mm(a_q, b_q.transpose(1, 2), s_a, s_b, offs=offs_e,
                                        out_dtype=torch.bfloat16)
    return _scaled_loop(a_q, s_a, b_q, s_b, offs_e).bfloat16()


def torch_fp8_moe(x_TD: torch.Tensor, expert_ids_TK: torch.Tensor, scores_TK: torch.Tensor,
                  w13: tuple[torch.Tensor, torch.Tensor], w2: tuple[torch.Tensor, torch.Tensor],
                  *, path: GroupedMMPath) -> torch.Tensor:
    """The torch baseline's inference forward (EP = 1, :func:`torch_moe`'s steps) with both
    GEMMs on rowwise FP8 (``torch._scaled_grouped_mm``, issue 58's baseline provider): the
    routed rows and h2 quantised per row (:func:`rowwise_fp8`), the weights given quantised
    per output row (``w13 = (q [E, 2F, D], s [E, 2F])``, ``w2 = (q [E, D, F], s [E, D])``,
    made once per weight version by the caller); no SwiGLU epilogue (SwiGLU in PyTorch
    between the GEMMs). ``path``: :func:`scaled_grouped_mm_path`. No autograd."""
    num_experts = w13[0].shape[0]
    ffn = w13[0].shape[1] // 2
    ids_R, order_R, token_R, score_R = _sort_routes(expert_ids_TK, scores_TK, inactive_expert=0)
    offs_e = _count(ids_R, num_experts).cumsum(0).to(torch.int32)
    xq, xs = rowwise_fp8(x_TD.index_select(0, token_R))
    h1 = _scaled_grouped(xq, xs, *w13, offs_e, path)
    h2 = F.silu(h1[:, :ffn].float()) * h1[:, ffn:].float()
    hq, hs = rowwise_fp8(h2)
    h3 = _scaled_grouped(hq, hs, *w2, offs_e, path)
    return _combine(h3, token_R, score_R, x_TD)
