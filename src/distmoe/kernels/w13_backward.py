"""W13 backward: DGRAD with a scatter epilogue that returns route input gradients, and WGRAD.

Per routed row (padded expert-major layout, see :mod:`distmoe.kernels._common`), with
``grad_h1 = [grad_g | grad_u]`` from :func:`distmoe.kernels.w2_backward.w2_dgrad_swiglu_bwd`
and ``W13 = w13[e]`` viewed ``[2F, D]``:

    grad_x_route = grad_h1 @ W13              [R, 2F] @ [2F, D], fp32 accumulation -> bf16
    grad_W13[e] += grad_h1_e^T @ x_e          fp32 [2F, D] (= [2, F, D])

:func:`w13_dgrad_scatter`
    One program per (row tile, ``block_n`` columns of D) of the ``R_cap`` bound; idle tiles
    exit at once. ``grad_h1`` (local, contiguous) and the weights come through TMA
    descriptors (``[R_cap, 2F]`` and ``[E, 2F, D]``; encoded on the host at launch by default,
    or built in every program). The epilogue stores each bf16 row with a
    plain ``tl.store`` to ``scatter_ptrs[row]``, an absolute address (usually route slot
    ``t*K + k`` of the token owner's dispatch buffer, possibly in a peer's memory); 0 = skip.
    Never a TMA store: the owner reads these rows after a release/acquire signal, and in
    triton 3.6 a later release does not order a TMA store. Every destination row is written
    by exactly one program per column tile, so no atomics.

:func:`w13_wgrad`
    The grouped WGRAD kernel of :mod:`distmoe.kernels.w2_backward` with ``A = grad_h1``
    (P = 2F) and ``B = x_gathered`` (Q = D), accumulated in place into fp32
    ``grad_w13 [E, 2, F, D]`` viewed ``[E, 2F, D]``.

Sync points: none inside. The caller signals the owners after ``w13_dgrad_scatter``
(barrier) before they run ``reduce_routes``. Grids come from ``R_cap`` and weight shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from distmoe.kernels._common import (
    GemmConfig,
    check_devices,
    check_tensor,
    check_tma_aligned,
    check_width,
    device_context,
    ensure_tma_allocator,
    expert_segments,
    next_power_of_2,
    swizzle_tile,
    tile_expert,
)
from distmoe.kernels.w2_backward import (
    WgradConfig,
    check_backward_gemm_config,
    check_disjoint,
    check_padded_offsets,
    check_row_table,
    check_rows_cap,
    check_wgrad_config,
    launch_grouped_wgrad,
)


def _pow2_clamped(n: int, low: int, high: int) -> int:
    return min(high, max(low, next_power_of_2(n)))


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _w13_dgrad_scatter_kernel(
    grad_h1,  # bf16 [R_cap, 2F], or its TMA descriptor (HOST_DESC)
    padded_offsets_ptr,  # int32 [E + 1]
    w13,  # bf16 [E, 2F, D], or its TMA descriptor (HOST_DESC)
    scatter_ptrs_ptr,  # int64 [R_cap]: destination addresses of bf16 [D] rows (0 = skip)
    num_rows,  # R_cap
    HIDDEN: tl.constexpr,
    FFN: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    HOST_DESC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    num_pid_m = num_rows // BLOCK_M
    num_pid_n = tl.cdiv(HIDDEN, BLOCK_N)
    pid_m, pid_n = swizzle_tile(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
    row0 = pid_m * BLOCK_M
    if row0 >= tl.load(padded_offsets_ptr + NUM_EXPERTS):
        return  # idle tile
    expert = tile_expert(padded_offsets_ptr, row0, NUM_EXPERTS, EXPERTS_POW2)
    n0 = pid_n * BLOCK_N
    if HOST_DESC:
        a_desc = grad_h1
        w_desc = w13
    else:
        a_desc = tl.make_tensor_descriptor(
            grad_h1, shape=[num_rows, 2 * FFN], strides=[2 * FFN, 1], block_shape=[BLOCK_M, BLOCK_K]
        )
        w_desc = tl.make_tensor_descriptor(
            w13,
            shape=[NUM_EXPERTS, 2 * FFN, HIDDEN],
            strides=[2 * FFN * HIDDEN, HIDDEN, 1],
            block_shape=[1, BLOCK_K, BLOCK_N],
        )
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, 2 * FFN, BLOCK_K):
        a = a_desc.load([row0, k0])
        b = w_desc.load([expert, k0, n0]).reshape(BLOCK_K, BLOCK_N)
        acc = tl.dot(a, b, acc)

    rows = row0 + tl.arange(0, BLOCK_M)
    addr = tl.load(scatter_ptrs_ptr + rows)
    is_row = addr != 0
    # Destination rows are 16-byte aligned (contract): 16-byte vector stores. The hint goes on
    # the pointer (divisibility in bytes); on the int64 before the cast it would be lost.
    dst = tl.multiple_of(addr.to(tl.pointer_type(tl.bfloat16)), 16)
    col = n0 + tl.arange(0, BLOCK_N)
    tl.store(
        dst[:, None] + col[None, :],
        acc.to(tl.bfloat16),
        mask=is_row[:, None] & (col < HIDDEN)[None, :],
    )


# --------------------------------------------------------------------------------------------
# Launch configuration and launchers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class W13DgradConfig(GemmConfig):
    """Launch configuration of :func:`w13_dgrad_scatter` (see :class:`GemmConfig`).

    ``block_m`` rows (the padding multiple), ``block_n`` columns of D per tile, ``block_k``
    step over 2F. ``persistent`` is not supported yet. ``host_descriptors``: the grad_h1 and
    w13 TMA descriptors are encoded on the host at launch (True) or built in every program.
    """

    host_descriptors: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_backward_gemm_config(self)

    @classmethod
    def from_heuristic(cls, *, hidden: int, ffn: int, block_m: int = 128) -> W13DgradConfig:
        """128 x 128 x 64 tiles, 8 warps, 3 stages (96 KiB of SMEM); narrower tiles for
        narrow D/F. The plain scatter epilogue needs about 90 registers per thread (sm_90
        build), so two CTAs fit on an SM (registers and 2 x 96 KiB of SMEM): one CTA's
        epilogue and scatter stores overlap the other's main loop."""
        block_n = _pow2_clamped(hidden, 16, 128)
        block_k = _pow2_clamped(2 * ffn, 16, 64)
        num_warps = 8 if block_m * block_n >= 128 * 128 else 4
        return cls(
            block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=3
        )

    @classmethod
    def all_configs(cls, *, hidden: int, ffn: int, block_m: int = 128) -> list[W13DgradConfig]:
        """Tuning candidates that fit an SM90."""
        out = []
        for block_n in (64, 128, 256):
            for block_k in (32, 64, 128):
                for num_warps in (4, 8):
                    for num_stages in (3, 4, 5):
                        cfg = cls(
                            block_m=block_m,
                            block_n=min(block_n, _pow2_clamped(hidden, 16, 256)),
                            block_k=min(block_k, _pow2_clamped(2 * ffn, 16, 256)),
                            num_warps=num_warps,
                            num_stages=num_stages,
                        )
                        if cfg.fits_hopper() and cfg not in out:
                            out.append(cfg)
        return out


def w13_dgrad_scatter(
    grad_h1: torch.Tensor,
    padded_offsets: torch.Tensor,
    w13: torch.Tensor,
    scatter_ptrs: torch.Tensor,
    *,
    config: W13DgradConfig | None = None,
) -> None:
    """``grad_x_route = bf16(grad_h1 @ W13)`` stored to ``scatter_ptrs[row]`` (module docstring).

    Args:
        grad_h1: bf16 ``[R_cap, 2F]`` (``[grad_g | grad_u]``).
        padded_offsets: int32 ``[E_local + 1]`` (segments multiples of ``config.block_m``).
        w13: bf16 ``[E_local, 2, F, D]``.
        scatter_ptrs: int64 ``[R_cap]`` absolute byte addresses of bf16 rows of ``D`` values
            (16-byte aligned; 0 = skip). Only live, non-null rows are written; nothing else is
            touched.
        config: :class:`W13DgradConfig`; ``None`` = ``from_heuristic`` with ``block_m`` 128.
    """
    check_tensor("w13", w13, dtypes=(torch.bfloat16,), ndim=4, shape_text="[E_local, 2, F, D]")
    num_experts, two, ffn, hidden = w13.shape
    if two != 2:
        raise ValueError(f"w13 must have shape [E_local, 2, F, D], got {list(w13.shape)}")
    if num_experts < 1:
        raise ValueError(f"w13 must hold at least one expert, got shape {list(w13.shape)}")
    check_width("D (w13.shape[3])", hidden)
    check_width("F (w13.shape[2])", ffn)
    num_rows = check_row_table("scatter_ptrs", scatter_ptrs)
    check_padded_offsets(padded_offsets, num_experts)
    check_tensor(
        "grad_h1",
        grad_h1,
        dtypes=(torch.bfloat16,),
        shape=[num_rows, 2 * ffn],
        shape_text="[R_cap, 2F]",
    )
    check_tma_aligned("grad_h1", grad_h1)
    check_tma_aligned("w13", w13)
    device = check_devices(
        {
            "grad_h1": grad_h1,
            "padded_offsets": padded_offsets,
            "w13": w13,
            "scatter_ptrs": scatter_ptrs,
        }
    )
    if config is None:
        config = W13DgradConfig.from_heuristic(hidden=hidden, ffn=ffn)
    elif not isinstance(config, W13DgradConfig):
        raise TypeError(f"config must be a W13DgradConfig or None, got {type(config).__name__}")
    check_rows_cap(num_rows, config.block_m)
    if num_rows == 0:
        return
    grad_h1_arg, w13_arg = grad_h1, w13
    if config.host_descriptors:
        grad_h1_arg = TensorDescriptor(
            grad_h1,
            shape=[num_rows, 2 * ffn],
            strides=[2 * ffn, 1],
            block_shape=[config.block_m, config.block_k],
        )
        w13_arg = TensorDescriptor(
            w13,
            shape=[num_experts, 2 * ffn, hidden],
            strides=[2 * ffn * hidden, hidden, 1],
            block_shape=[1, config.block_k, config.block_n],
        )
    else:
        ensure_tma_allocator()
    grid = ((num_rows // config.block_m) * triton.cdiv(hidden, config.block_n),)
    with device_context(device):
        _w13_dgrad_scatter_kernel[grid](
            grad_h1_arg,
            padded_offsets,
            w13_arg,
            scatter_ptrs,
            num_rows,
            HIDDEN=hidden,
            FFN=ffn,
            NUM_EXPERTS=num_experts,
            EXPERTS_POW2=next_power_of_2(num_experts),
            HOST_DESC=config.host_descriptors,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            GROUP_M=config.group_m,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )


def w13_wgrad(
    grad_h1: torch.Tensor,
    x_gathered: torch.Tensor,
    padded_offsets: torch.Tensor,
    grad_w13: torch.Tensor,
    *,
    config: WgradConfig | None = None,
) -> None:
    """``grad_w13[e] += grad_h1_e^T @ x_e`` over every local expert's rows (fp32, in place).

    Args:
        grad_h1: bf16 ``[R_cap, 2F]``.
        x_gathered: bf16 ``[R_cap, D]``, the forward's gathered input rows (null rows zeros).
        padded_offsets: int32 ``[E_local + 1]`` (segments multiples of ``config.block_m``).
        grad_w13: fp32 ``[E_local, 2, F, D]``, accumulated into (experts without rows
            untouched).
        config: :class:`WgradConfig` (output tile over ``[2F, D]``); ``None`` =
            ``from_heuristic`` with ``block_m`` 128.
    """
    check_tensor(
        "grad_w13", grad_w13, dtypes=(torch.float32,), ndim=4, shape_text="[E_local, 2, F, D]"
    )
    num_experts, two, ffn, hidden = grad_w13.shape
    if two != 2:
        raise ValueError(f"grad_w13 must have shape [E_local, 2, F, D], got {list(grad_w13.shape)}")
    check_width("D (grad_w13.shape[3])", hidden)
    check_width("F (grad_w13.shape[2])", ffn)
    check_tensor("grad_h1", grad_h1, dtypes=(torch.bfloat16,), ndim=2, shape_text="[R_cap, 2F]")
    num_rows = grad_h1.shape[0]
    if grad_h1.shape[1] != 2 * ffn:
        raise ValueError(f"grad_h1 must have shape [R_cap, {2 * ffn}], got {list(grad_h1.shape)}")
    check_tensor(
        "x_gathered",
        x_gathered,
        dtypes=(torch.bfloat16,),
        shape=[num_rows, hidden],
        shape_text="[R_cap, D] like grad_h1",
    )
    check_padded_offsets(padded_offsets, num_experts)
    check_tma_aligned("grad_h1", grad_h1)
    check_tma_aligned("x_gathered", x_gathered)
    named = {
        "grad_h1": grad_h1,
        "x_gathered": x_gathered,
        "padded_offsets": padded_offsets,
        "grad_w13": grad_w13,
    }
    device = check_devices(named)
    check_disjoint(named)
    config = check_wgrad_config(config, out_rows=2 * ffn, out_cols=hidden)
    launch_grouped_wgrad(
        grad_h1,
        x_gathered,
        padded_offsets,
        grad_w13.view(num_experts, 2 * ffn, hidden),
        config,
        device,
    )


# --------------------------------------------------------------------------------------------
# References (plain PyTorch; they read padded_offsets on the host)
# --------------------------------------------------------------------------------------------


def w13_dgrad_scatter_ref(
    grad_h1: torch.Tensor, padded_offsets: torch.Tensor, w13: torch.Tensor
) -> torch.Tensor:
    """Reference of :func:`w13_dgrad_scatter`: the fp32 ``[R_cap, D]`` rows that the kernel
    stores (row ``i`` goes to ``scatter_ptrs[i]`` unless that is 0); idle rows are zeros."""
    num_experts, _, ffn, hidden = w13.shape
    out = torch.zeros(grad_h1.shape[0], hidden, dtype=torch.float32, device=grad_h1.device)
    for e, (start, end) in enumerate(expert_segments(padded_offsets)):
        if end > start:
            out[start:end] = grad_h1[start:end].float() @ w13[e].reshape(2 * ffn, hidden).float()
    return out


def w13_wgrad_ref(
    grad_h1: torch.Tensor,
    x_gathered: torch.Tensor,
    padded_offsets: torch.Tensor,
    grad_w13: torch.Tensor,
) -> torch.Tensor:
    """Reference of :func:`w13_wgrad`: returns ``grad_w13 + sum`` as a new fp32 tensor."""
    num_experts, _, ffn, hidden = grad_w13.shape
    out = grad_w13.float().clone()
    for e, (start, end) in enumerate(expert_segments(padded_offsets)):
        if end > start:
            grad = grad_h1[start:end].float().t() @ x_gathered[start:end].float()
            out[e] += grad.reshape(2, ffn, hidden)
    return out
