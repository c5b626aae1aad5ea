"""FP8 weight gradients: a grouped GEMM over experts whose reduction runs along tokens (SM90;
Triton), on operands quantised along the token axis (:mod:`distmoe.kernels.scaled.token_quant`).

For every expert ``e`` with padded rows ``[padded_offsets[e], padded_offsets[e+1])`` (multiples
of 128, :mod:`distmoe.kernels.base.rows`) and every ``m < M``, ``n < N``::

    acc[e, m, n] = sum over token blocks b of the segment of  P_b * sa[b, m] * sb[b, n]
    P_b          = sum_{r in [128 b, 128 b + 128)} at[m, r] * bt[n, r]          (one FP8 dot)
    out[e, m, n] = acc (rounded to out's dtype), or out[e, m, n] += acc (``accumulate``, fp32)

``at [M, R_cap]`` and ``bt [N, R_cap]`` hold each column's values of every padded row (token-
contiguous, E4M3; padding rows quantised as zeros), ``sa [R_cap/128, M]`` and ``sb [R_cap/128,
N]`` one scale per 128-token block and column (float32, or E8M0 bytes). An expert
with no rows gets zeros (or is left as it is with ``accumulate``). In the MoE layer's
backward, ``grad_w2[e] = gh3_e^T h2_e`` (M = D, N = F) and ``grad_w13[e] = gh1_e^T x_e``
(M = 2F, N = D).

Arithmetic: the 128-group scheme of :mod:`distmoe.kernels.scaled.triton` with K the
expert's tokens: one FP8 dot per 128-token block into a fresh fp32 partial, promoted with
both scales (``sa * sb`` rounded once for float32 scales; exact for E8M0). Error against the
float64 product of the dequantised operands: ``(127 + n_b + 3) * 2^-24 * S`` (``n_b`` the
expert's token blocks, ``S`` the sum of |products|), plus on SM90 the FP8 MMA chain's own
accumulation per block (docs/numerics.md section 6), then the output rounding.

Grid: one program per (expert, 128-row tile of M or less, tile of N), ``E * cdiv(M, BLOCK_M) *
cdiv(N, BLOCK_N)``, from shapes only; each program walks its expert's token blocks (a device
value: no host synchronisation). Memory: nothing allocated. The warp-specialised Gluon form
(:mod:`distmoe.kernels.scaled.wgrad_gluon`) runs where the config asks for it on Hopper.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from distmoe.kernels.base.checks import check_devices, check_expert_count, check_tensor
from distmoe.kernels.base.config import is_power_of_2
from distmoe.kernels.base.device import device_context, warn_gluon_fallback
from distmoe.kernels.base.interpreter import interpreter_active
from distmoe.kernels.scaled import wgrad_gluon
from distmoe.kernels.scaled.token_quant import TOKEN_BLOCK, TOKEN_FORMATS
from distmoe.kernels.scaled.triton import dot_step
from distmoe.quant.formats import e8m0_to_fp32
from distmoe.quant.mxfp8 import e8m0_to_float

__all__ = ["ScaledWgradConfig", "scaled_wgrad", "scaled_wgrad_ref"]


@dataclass(frozen=True, kw_only=True)
class ScaledWgradConfig:
    """Launch configuration of :func:`scaled_wgrad` (frozen; from shapes only).

    Attributes:
        block_m / block_n: output rows / columns per tile (powers of two, 16-256).
        num_warps: 4 or 8; num_stages: the K loop's pipeline depth (>= 1).
        gluon: run the warp-specialised Gluon kernel
            (:func:`~distmoe.kernels.scaled.wgrad_gluon.gluon_wgrad_reason`: Hopper, 128 x 128
            tiles, M and N multiples of 128, ``num_stages`` one of its ring depths); elsewhere
            the Triton kernel runs this config with a ``RuntimeWarning`` saying why.
    """

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    gluon: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not is_power_of_2(v) \
                    or not 16 <= v <= 256:
                raise ValueError(f"{name} ({v!r}) must be a power of two in [16, 256]")
        if self.num_warps not in (4, 8) or isinstance(self.num_warps, bool):
            raise ValueError(f"num_warps ({self.num_warps!r}) must be 4 or 8")
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) \
                or self.num_stages < 1:
            raise ValueError(f"num_stages ({self.num_stages!r}) must be an int >= 1")
        if not isinstance(self.gluon, bool):
            raise TypeError(f"gluon must be a bool, got {type(self.gluon).__name__}")


@triton.jit
def _scaled_wgrad_kernel(at_ptr, sa_ptr, bt_ptr, sb_ptr, padded_offsets_ptr, out_ptr, R_CAP,
                         M: tl.constexpr, N: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         INTERPRET: tl.constexpr, SCALE_FP32: tl.constexpr,
                         ACCUMULATE: tl.constexpr):
    TM: tl.constexpr = (M + BLOCK_M - 1) // BLOCK_M
    TN: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    pid = tl.program_id(0)
    expert = pid // (TM * TN)
    tile = pid % (TM * TN)
    m = (tile // TN) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = (tile % TN) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_m = m < M
    in_n = n < N
    kk = tl.arange(0, 128)
    k_lo = tl.load(padded_offsets_ptr + expert) // 128
    k_hi = tl.load(padded_offsets_ptr + expert + 1) // 128
    a_rows = at_ptr + m.to(tl.int64)[:, None] * R_CAP
    b_rows = bt_ptr + n.to(tl.int64)[:, None] * R_CAP
    if SCALE_FP32:
        one = 1.0
    else:
        one = 127
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kb = k_lo
    while kb < k_hi:  # (a while loop: device bounds work under the interpreter too)
        cols = (kb * 128 + kk)[None, :]
        a = tl.load(a_rows + cols, mask=in_m[:, None], other=0.0)
        b = tl.load(b_rows + cols, mask=in_n[:, None], other=0.0)
        sa = tl.load(sa_ptr + kb * M + m, mask=in_m, other=one)
        sb = tl.load(sb_ptr + kb * N + n, mask=in_n, other=one)
        if not SCALE_FP32:
            sa = e8m0_to_fp32(sa.to(tl.int32))
            sb = e8m0_to_fp32(sb.to(tl.int32))
        acc += dot_step(a, b, INTERPRET) * (sa[:, None] * sb[None, :])
        kb += 1
    ptrs = out_ptr + expert.to(tl.int64) * (M * N) + m[:, None] * N + n[None, :]
    ok = in_m[:, None] & in_n[None, :]
    if ACCUMULATE:
        acc += tl.load(ptrs, mask=ok, other=0.0)
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _check(at_q, at_s, bt_q, bt_s, padded_offsets, out, format, accumulate):
    if format not in TOKEN_FORMATS:
        raise ValueError(f"format ({format!r}) must be one of {list(TOKEN_FORMATS)}")
    sd = TOKEN_FORMATS[format]
    check_tensor("at_q", at_q, dtypes=(torch.float8_e4m3fn,), ndim=2, shape_text="[M, R_cap]")
    m, r_cap = at_q.shape
    if r_cap % TOKEN_BLOCK:
        raise ValueError(f"R_cap ({r_cap}, at_q.shape[1]) must be a multiple of {TOKEN_BLOCK}")
    check_tensor("at_s", at_s, dtypes=(sd,), shape=[r_cap // TOKEN_BLOCK, m],
                 shape_text=f"[R_cap/{TOKEN_BLOCK}, M] ({format} scales)")
    check_tensor("bt_q", bt_q, dtypes=(torch.float8_e4m3fn,), ndim=2, shape_text="[N, R_cap]")
    n = bt_q.shape[0]
    if bt_q.shape[1] != r_cap:
        raise ValueError(f"bt_q must have R_cap = {r_cap} (at_q.shape[1]) columns, got shape "
                         f"{list(bt_q.shape)}")
    check_tensor("bt_s", bt_s, dtypes=(sd,), shape=[r_cap // TOKEN_BLOCK, n],
                 shape_text=f"[R_cap/{TOKEN_BLOCK}, N] ({format} scales)")
    num_experts = check_expert_count(padded_offsets)
    if not isinstance(accumulate, bool):
        raise TypeError(f"accumulate must be a bool, got {type(accumulate).__name__}")
    dtypes = (torch.float32,) if accumulate else (torch.bfloat16, torch.float32)
    check_tensor("out", out, dtypes=dtypes, shape=[num_experts, m, n],
                 shape_text="[E, M, N]" + (" (fp32: accumulate)" if accumulate else ""))
    check_devices(dict(at_q=at_q, at_s=at_s, bt_q=bt_q, bt_s=bt_s,
                       padded_offsets=padded_offsets, out=out))
    return m, n, r_cap, num_experts


def scaled_wgrad(at_q: torch.Tensor, at_s: torch.Tensor, bt_q: torch.Tensor,
                 bt_s: torch.Tensor, padded_offsets: torch.Tensor, out: torch.Tensor, *,
                 format: str, accumulate: bool = False,
                 config: ScaledWgradConfig | None = None) -> torch.Tensor:
    """``out[e] (+)= dequant(at)[:, seg_e] @ dequant(bt)[:, seg_e]^T`` per expert (module
    docstring).

    Args:
        at_q / bt_q: float8_e4m3fn ``[M, R_cap]`` / ``[N, R_cap]``, token-contiguous
            (:func:`~distmoe.kernels.scaled.token_quant.quantize_tokens`).
        at_s / bt_s: their scales ``[R_cap/128, M]`` / ``[R_cap/128, N]``: float32
            (``format="fp8_block"``) or uint8 E8M0 (``"mxfp8_rebased"``).
        padded_offsets: int32 ``[E + 1]`` (device): each expert's padded rows (multiples of
            128, ``padded_offsets[E] <= R_cap``: device values, not checked).
        out: ``[E, M, N]`` bf16 or fp32 (written), or fp32 with ``accumulate`` (added to).
        format: the operands' format (:data:`~distmoe.kernels.scaled.token_quant.TOKEN_FORMATS`).
        config: :class:`ScaledWgradConfig` (default: 128 x 128 tiles, 8 warps).

    Returns ``out``. No host synchronisation.
    """
    m, n, r_cap, num_experts = _check(at_q, at_s, bt_q, bt_s, padded_offsets, out, format,
                                      accumulate)
    if config is None:
        config = ScaledWgradConfig()
    elif not isinstance(config, ScaledWgradConfig):
        raise TypeError(f"config must be a ScaledWgradConfig, got {type(config).__name__}")
    if config.gluon:
        reason = wgrad_gluon.gluon_wgrad_reason(
            at_q.device, m=m, n=n, block_m=config.block_m, block_n=config.block_n,
            stages=config.num_stages)
        if reason is None:
            wgrad_gluon.launch_gluon_scaled_wgrad(
                at_q, at_s, bt_q, bt_s, padded_offsets, out, scale_fp32=format == "fp8_block",
                accumulate=accumulate, stages=config.num_stages)
            return out
        warn_gluon_fallback("scaled_wgrad", reason)
    bm, bn = config.block_m, config.block_n
    grid = (num_experts * triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    with device_context(at_q.device):
        _scaled_wgrad_kernel[grid](
            at_q, at_s, bt_q, bt_s, padded_offsets, out, r_cap, M=m, N=n,
            NUM_EXPERTS=num_experts, BLOCK_M=bm, BLOCK_N=bn, INTERPRET=interpreter_active(),
            SCALE_FP32=format == "fp8_block", ACCUMULATE=accumulate,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )  # fmt: skip
    return out


def _dequantize_tokens(q: torch.Tensor, s: torch.Tensor, format: str) -> torch.Tensor:
    sv = s.double() if format == "fp8_block" else e8m0_to_float(s).double()
    return q.double() * sv.T.repeat_interleave(TOKEN_BLOCK, -1)


def scaled_wgrad_ref(at_q, at_s, bt_q, bt_s, padded_offsets, out, *, format: str,
                     accumulate: bool = False) -> torch.Tensor:
    """Plain-PyTorch :func:`scaled_wgrad` (synchronises; for tests): both operands dequantised
    exactly (float64), one float64 product per expert over its padded rows, rounded to fp32,
    then to ``out``'s dtype (after the fp32 add with ``accumulate``)."""
    _check(at_q, at_s, bt_q, bt_s, padded_offsets, out, format, accumulate)
    a = _dequantize_tokens(at_q, at_s, format)
    b = _dequantize_tokens(bt_q, bt_s, format)
    po = padded_offsets.tolist()
    for e in range(len(po) - 1):
        acc = (a[:, po[e]:po[e + 1]] @ b[:, po[e]:po[e + 1]].T).float()
        if accumulate:
            acc = acc + out[e]
        out[e] = acc.to(out.dtype)
    return out
