"""W13 DGRAD for Hopper on the warp-specialised Gluon kernel of the W2 forward.

The kernel body is shared: it lives in :mod:`distmoe.kernels.w2_forward.gluon` (whose module
docstring describes it, the W13 DGRAD's case included), and this module imports it publicly
(:func:`~distmoe.kernels.w2_forward.gluon.launch_kernel`,
:func:`~distmoe.kernels.w2_forward.gluon.shape_reason`). Here are the W13 DGRAD's check and
launcher: A is grad_h1 ``[R_act, 2F]`` in activation rows, the reduction runs over 2F, and the
weight tiles come from ``w13[e]`` viewed ``[2F, D]`` as ``[64, block_n]`` blocks, N-major as
stored; the epilogue stores each route's input gradient row at ``scatter_ptrs[r]``
(:func:`distmoe.kernels.w13_dgrad.triton.w13_dgrad_scatter` launches it under
``W13DgradConfig.gluon``).
"""

from __future__ import annotations

import torch

from distmoe.kernels.base.gluon import HAVE_GLUON, gluon_device_reason, shared_layout
from distmoe.kernels.w2_forward.gluon import GLUON_W2_BLOCK_K, launch_kernel, shape_reason

if HAVE_GLUON:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

__all__ = ["gluon_w13_dgrad_reason", "launch_gluon_w13_dgrad"]


def gluon_w13_dgrad_reason(device: torch.device, *, hidden: int, ffn: int, block_m: int,
                           block_n: int, block_k: int, stages: int,
                           warps: int = 4) -> str | None:
    """``None`` when :func:`launch_gluon_w13_dgrad` can run this case on ``device``, else why
    not (a sentence)."""
    return gluon_device_reason(device) or shape_reason(
        hidden=hidden, ffn=ffn, block_m=block_m, block_n=block_n, block_k=block_k,
        stages=stages, warps=warps, w13_dgrad=True)


def launch_gluon_w13_dgrad(grad_h1: torch.Tensor, padded_offsets: torch.Tensor,
                           row_offsets: torch.Tensor, w13: torch.Tensor,
                           scatter_ptrs: torch.Tensor, *, block_n: int = 128,
                           stages: int = 5, group_m: int = 8, warps: int = 4,
                           programs: int | None = None, lockstep: bool = False,
                           expert_groups: bool = False) -> None:
    """The W13 DGRAD on this kernel: ``bf16(grad_h1[a] @ w13[e])`` (``w13[e]`` viewed ``[2F,
    D]``, read ``[64, block_n]`` at a time as stored, N-major) stored at ``scatter_ptrs[r]``
    for every live padded row ``r`` (the contract of
    :func:`~distmoe.kernels.w13_dgrad.triton.w13_dgrad_scatter`, which validates the arguments;
    :func:`gluon_w13_dgrad_reason` returned ``None``). ``grad_h1``: bf16 ``[R_act, 2F]``;
    ``w13``: bf16 ``[E, 2, F, D]`` or ``[E, 2F, D]``, contiguous. ``warps``, ``block_n``,
    ``programs``, ``lockstep``, ``expert_groups``: as
    :func:`~distmoe.kernels.w2_forward.gluon.launch_gluon_w2`."""
    num_experts, hidden = w13.shape[0], w13.shape[-1]
    depth = grad_h1.shape[1]  # 2F
    w_layout = shared_layout((GLUON_W2_BLOCK_K, block_n))
    w_desc = GluonDescriptor(w13.reshape(num_experts * depth, hidden),
                             [num_experts * depth, hidden], [hidden, 1],
                             [GLUON_W2_BLOCK_K, block_n], w_layout)
    launch_kernel(grad_h1, w_desc, scatter_ptrs, padded_offsets, row_offsets, None,
            hidden=hidden, depth=depth, num_experts=num_experts, block_n=block_n,
            stages=stages, group_m=group_m, warps=warps, programs=programs, b_k_major=False,
            lockstep=lockstep, expert_groups=expert_groups)
