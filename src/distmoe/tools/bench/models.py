"""Analytical work models of the benchmark: useful FLOPs, modeled HBM and NVLink bytes, roofline.

Everything here is pure Python arithmetic on shapes (no tensors, no device), so the numbers a
benchmark reports can be checked by hand. Notation follows shared/DESIGN.md: T tokens per rank,
D hidden width, F expert intermediate width, K experts per token, E global experts, EP ranks,
E_local = E / EP local experts, R = T*K routed rows per rank at balanced routing.

Useful FLOPs (per GPU, averaged over ranks, so R = T*K even under routing imbalance):

    forward   6*T*K*D*F     W13 (2*R*D*2F) + W2 (2*R*F*D); a multiply-add is 2 FLOPs
    backward  2 x forward   DGRAD + WGRAD of both GEMMs
    fwdbwd    3 x forward

Padding, recompute, SwiGLU, routing and communication are not counted as useful work; they
only cost time.

Modeled HBM bytes: one access of every *logical* tensor of the layer, not a measurement (no
DRAM counters) and not what any one implementation moves. The forward pass of one rank counts
(bf16 = 2 bytes unless stated):

    x            [T, D]          read              2*T*D
    expert_ids   [T, K]  int32   read              4*T*K
    scores       [T, K]  fp32    read              4*T*K
    w13, w2      [E_a, 3F, D]    read once         6*E_a*D*F         (x elem bytes, see below)
    routed rows  [R, D]          read by W13       2*R*D             (x elem bytes, see below)
    h1 = [g|u]   [R, 2F]         written           4*R*F
    h2           [R, F]          written           2*R*F
    h3           [R, D]          written (routes)  2*R*D
    y            [T, D]          written           2*T*D

``E_a`` is the local experts that receive at least one row (``active_experts``; all
``E_local`` where it is not known): a decode step of T tokens reads the weights of at most
T*K experts, not all of them. For ``precision="mxfp8"`` / ``"nvfp4"`` the weights and routed input rows are counted at their
quantised size including scales (mxfp8: 1 + 1/32 bytes per value, one E8M0 scale per 32;
nvfp4: 1/2 + 1/16 bytes per value, one E4M3 scale per 16); everything else stays as listed.
Backward is modeled as 2x the forward bytes and fwdbwd as 3x (the coarse model of the
specification seed), so the three modes share one per-tensor table.

Modeled NVLink bytes for EP > 1 (balanced routing, every expert equally likely): a fraction
(EP-1)/EP of the T*K routed rows leaves the rank. Per GPU and per direction (what it transmits;
it receives the same amount at balance):

    forward   dispatch (EP-1)/EP * T*K*D * elem  +  combine (EP-1)/EP * T*K*D * 2
    backward  the same two transfers in reverse roles (route output gradients to the experts,
              input gradients back to the owners), both bf16, so equal to a bf16 forward
    fwdbwd    forward + backward (2 x forward for bf16)

Roofline (specification seed 000, equations 89-94): a single-GPU model of the two forward GEMMs
of a dense FFN and of an MoE with the same useful FLOPs, each GEMM reading its BF16 operands
once and writing its BF16 output once; modeled time is the sum over the two GEMMs of
max(FLOPs / C, bytes / B) and the modeled rate is F_pair / time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Literal

Mode = Literal["fwd", "bwd", "fwdbwd"]
MODES: tuple[str, ...] = ("fwd", "bwd", "fwdbwd")

# Multiplier of the forward figure for each mode (FLOPs and modeled HBM bytes alike).
_MODE_FACTOR = {"fwd": 1, "bwd": 2, "fwdbwd": 3}

# Bytes per value of quantised operands (values + block scales), see the module docstring.
_ELEMENT_BYTES = {"bf16": 2.0, "mxfp8": 1.0 + 1.0 / 32.0, "fp8_block": 1.0 + 4.0 / 128.0,
                  "nvfp4": 0.5 + 1.0 / 16.0}

# Nominal H200 SXM datasheet figures (dense, decimal units). Used only where a ceiling was not
# measured in the same run; reports say which one they used.
H200_BF16_DENSE_FLOPS = 989e12
H200_FP8_DENSE_FLOPS = 1979e12
H200_HBM_BYTES_PER_S = 4.8e12
H200_NVLINK_BYTES_PER_S_PER_DIRECTION = 450e9


def _check_mode(mode: str) -> None:
    if mode not in _MODE_FACTOR:
        raise ValueError(f"mode ({mode!r}) must be one of {MODES}")


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {type(value).__name__}")
        if not value > 0:
            raise ValueError(f"{name} ({value}) must be > 0")


def element_bytes(precision: str) -> float:
    """Bytes per value of a quantised operand, scales included (bf16: 2.0)."""
    if precision not in _ELEMENT_BYTES:
        raise ValueError(f"precision ({precision!r}) must be one of {tuple(_ELEMENT_BYTES)}")
    return _ELEMENT_BYTES[precision]


# ----------------------------------------------------------------------------- useful FLOPs


def useful_flops(*, tokens: int, hidden: int, ffn: int, top_k: int, mode: Mode = "fwd") -> int:
    """Useful GEMM FLOPs of one routed layer on one GPU: 6*T*K*D*F per forward.

    Backward is twice forward (DGRAD + WGRAD), ``"fwdbwd"`` three times. The count uses the
    average rows per GPU (R = T*K), so it does not change with routing imbalance.
    """
    _check_mode(mode)
    _check_positive(tokens=tokens, hidden=hidden, ffn=ffn, top_k=top_k)
    return _MODE_FACTOR[mode] * 6 * tokens * top_k * hidden * ffn


# ----------------------------------------------------------------------------- HBM bytes


@dataclass(frozen=True, kw_only=True)
class HbmBytes:
    """Modeled forward HBM bytes of one routed layer on one rank, one field per tensor.

    Every field is a byte count (float, because quantised sizes are fractional per value);
    :attr:`total` sums them. See the module docstring for the tensor list.
    """

    x: float
    expert_ids: float
    scores: float
    weights: float
    routed_rows: float
    h1: float
    h2: float
    h3: float
    y: float

    @property
    def total(self) -> float:
        return float(sum(getattr(self, f.name) for f in fields(self)))


def forward_hbm_bytes(
    *,
    tokens: int,
    hidden: int,
    ffn: int,
    top_k: int,
    num_local_experts: int,
    rows: int | None = None,
    precision: str = "bf16",
    active_experts: int | None = None,
) -> HbmBytes:
    """Per-tensor modeled HBM bytes of one forward pass on one rank.

    Args:
        tokens, hidden, ffn, top_k: T, D, F, K.
        num_local_experts: E_local.
        rows: routed rows R this rank executes; default the balanced T*K.
        precision: operand format of the weights and routed input rows.
        active_experts: the local experts with at least one routed row, whose weights the
            rank reads (0 to E_local); default all E_local.
    """
    _check_positive(tokens=tokens, hidden=hidden, ffn=ffn, top_k=top_k)
    _check_positive(num_local_experts=num_local_experts)
    if active_experts is None:
        active_experts = num_local_experts
    elif not 0 <= active_experts <= num_local_experts:
        raise ValueError(f"active_experts ({active_experts}) must be in [0, num_local_experts "
                         f"= {num_local_experts}]")
    t, d, f, k = tokens, hidden, ffn, top_k
    r = t * k if rows is None else rows
    if r < 0:
        raise ValueError(f"rows ({r}) must be >= 0")
    q = element_bytes(precision)
    return HbmBytes(
        x=2.0 * t * d,
        expert_ids=4.0 * t * k,
        scores=4.0 * t * k,
        weights=q * active_experts * 3 * d * f,
        routed_rows=q * r * d,
        h1=2.0 * r * 2 * f,
        h2=2.0 * r * f,
        h3=2.0 * r * d,
        y=2.0 * t * d,
    )


def modeled_hbm_bytes(
    *,
    tokens: int,
    hidden: int,
    ffn: int,
    top_k: int,
    num_local_experts: int,
    mode: Mode = "fwd",
    rows: int | None = None,
    precision: str = "bf16",
    active_experts: int | None = None,
) -> float:
    """Modeled HBM bytes of one iteration: forward total x 1 (fwd), 2 (bwd) or 3 (fwdbwd)."""
    _check_mode(mode)
    fwd = forward_hbm_bytes(
        tokens=tokens,
        hidden=hidden,
        ffn=ffn,
        top_k=top_k,
        num_local_experts=num_local_experts,
        rows=rows,
        precision=precision,
        active_experts=active_experts,
    )
    return _MODE_FACTOR[mode] * fwd.total


# ----------------------------------------------------------------------------- NVLink bytes


@dataclass(frozen=True, kw_only=True)
class NvlinkBytes:
    """Modeled bytes one GPU transmits over NVLink in one iteration (it receives as much).

    Attributes:
        dispatch: routed input rows sent to other ranks (forward), or the input-gradient rows
            sent back to their owners (backward).
        combine: expert outputs returned to their owners (forward), or the route output
            gradients sent to the experts (backward).
    """

    dispatch: float
    combine: float

    @property
    def total(self) -> float:
        return self.dispatch + self.combine


def nvlink_bytes(
    *,
    tokens: int,
    hidden: int,
    top_k: int,
    ep_size: int,
    mode: Mode = "fwd",
    precision: str = "bf16",
) -> NvlinkBytes:
    """Modeled NVLink bytes per GPU and direction at balanced routing (0 for EP = 1).

    A fraction (EP-1)/EP of the T*K routed rows is remote. Forward sends the input rows
    (``precision`` element size) and returns bf16 outputs; backward moves the same volumes
    in the opposite roles; fwdbwd is twice forward.
    """
    _check_mode(mode)
    _check_positive(tokens=tokens, hidden=hidden, top_k=top_k, ep_size=ep_size)
    remote_rows = (ep_size - 1) / ep_size * tokens * top_k
    bf16_row = 2.0 * hidden
    fwd = NvlinkBytes(
        dispatch=remote_rows * element_bytes(precision) * hidden, combine=remote_rows * bf16_row
    )
    # Backward moves gradients, which stay bf16 even when the forward payload is quantised.
    bwd = NvlinkBytes(dispatch=remote_rows * bf16_row, combine=remote_rows * bf16_row)
    if mode == "fwd":
        return fwd
    if mode == "bwd":
        return bwd
    return NvlinkBytes(dispatch=fwd.dispatch + bwd.dispatch, combine=fwd.combine + bwd.combine)


# ----------------------------------------------------------------------------- roofline (eqs 89-94)


def roofline_rate(flops: float, nbytes: float, *, peak_flops: float, bytes_per_s: float) -> float:
    """Attainable FLOP/s of one operation (eq. 89): ``min(C, I * B)`` with ``I = flops/bytes``."""
    _check_positive(flops=flops, nbytes=nbytes, peak_flops=peak_flops, bytes_per_s=bytes_per_s)
    return min(peak_flops, flops / nbytes * bytes_per_s)


def projection_intensity(rows: float, d_in: float, d_out: float) -> float:
    """Arithmetic intensity (FLOP/byte) of one BF16 projection [M, d_in] x [d_in, d_out] (eq. 90).

    Both operands read once and the BF16 result written once:
    ``2*M*d_in*d_out / (2*(M*d_in + d_in*d_out + M*d_out))``.
    """
    _check_positive(rows=rows, d_in=d_in, d_out=d_out)
    return (2 * rows * d_in * d_out) / (2 * (rows * d_in + d_in * d_out + rows * d_out))


def balance_point(peak_flops: float, bytes_per_s: float) -> float:
    """Intensity (FLOP/byte) above which the roofline is compute-bound (eq. 91): ``C / B``."""
    _check_positive(peak_flops=peak_flops, bytes_per_s=bytes_per_s)
    return peak_flops / bytes_per_s


@dataclass(frozen=True, kw_only=True)
class GemmPair:
    """FLOPs and HBM bytes of the up (gate+up) and down GEMMs of one FFN forward (eqs. 92-93)."""

    up_flops: float
    down_flops: float
    up_bytes: float
    down_bytes: float

    @property
    def flops(self) -> float:
        return self.up_flops + self.down_flops

    @property
    def bytes(self) -> float:
        return self.up_bytes + self.down_bytes

    def modeled_time(self, *, peak_flops: float, bytes_per_s: float) -> float:
        """Seconds: sum over the two sequential GEMMs of max(FLOPs/C, bytes/B) (eq. 94)."""
        _check_positive(peak_flops=peak_flops, bytes_per_s=bytes_per_s)
        return max(self.up_flops / peak_flops, self.up_bytes / bytes_per_s) + max(
            self.down_flops / peak_flops, self.down_bytes / bytes_per_s
        )

    def modeled_rate(self, *, peak_flops: float, bytes_per_s: float) -> float:
        """Modeled useful FLOP/s of the pair (eq. 94): ``F_pair / t_hat``."""
        return self.flops / self.modeled_time(peak_flops=peak_flops, bytes_per_s=bytes_per_s)


def dense_gemm_pair(*, tokens: float, top_k: float, d: float, h: float) -> GemmPair:
    """Dense FFN of width K*h with the MoE's FLOPs: [T,d][d,2Kh] then [T,Kh][Kh,d]."""
    _check_positive(tokens=tokens, top_k=top_k, d=d, h=h)
    t, k = tokens, top_k
    return GemmPair(
        up_flops=4 * t * k * d * h,
        down_flops=2 * t * k * d * h,
        up_bytes=2 * (t * d + 2 * k * d * h + 2 * t * k * h),
        down_bytes=2 * (t * k * h + k * h * d + t * d),
    )


def moe_gemm_pair(
    *, tokens: float, top_k: float, num_experts: float, d: float, h: float
) -> GemmPair:
    """N experts of width h, K per token, balanced: N pairs [TK/N,d][d,2h] and [TK/N,h][h,d]."""
    _check_positive(tokens=tokens, top_k=top_k, num_experts=num_experts, d=d, h=h)
    t, k, n = tokens, top_k, num_experts
    return GemmPair(
        up_flops=4 * t * k * d * h,
        down_flops=2 * t * k * d * h,
        up_bytes=2 * (t * k * d + 2 * n * d * h + 2 * t * k * h),
        down_bytes=2 * (t * k * h + n * h * d + t * k * d),
    )


@dataclass(frozen=True, kw_only=True)
class RooflinePoint:
    """Modeled rates at one token count, as fractions of the compute ceiling C."""

    tokens: int
    dense_fraction: float
    moe_fraction: float


def roofline_curve(
    token_counts: Sequence[int],
    *,
    top_k: int,
    num_experts: int,
    d: int,
    h: int,
    peak_flops: float,
    bytes_per_s: float,
) -> list[RooflinePoint]:
    """Eq. 94 for the dense and MoE GEMM pairs over ``token_counts``: rate / C for each."""
    points = []
    for t in token_counts:
        dense = dense_gemm_pair(tokens=t, top_k=top_k, d=d, h=h)
        moe = moe_gemm_pair(tokens=t, top_k=top_k, num_experts=num_experts, d=d, h=h)
        kw = {"peak_flops": peak_flops, "bytes_per_s": bytes_per_s}
        points.append(
            RooflinePoint(
                tokens=int(t),
                dense_fraction=dense.modeled_rate(**kw) / peak_flops,
                moe_fraction=moe.modeled_rate(**kw) / peak_flops,
            )
        )
    return points


# ----------------------------------------------------------------------------- rates


def per_second(amount: float, milliseconds: float) -> float:
    """``amount / seconds``; NaN when the time is not positive or not finite."""
    if not (milliseconds > 0 and math.isfinite(milliseconds)):
        return math.nan
    return amount / (milliseconds * 1e-3)
