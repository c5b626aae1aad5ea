"""Owner-side combine: score-weighted sum of each token's returned expert rows (forward).

For every token ``t < T`` (``T = expert_ids.shape[0]``)::

    y[t] = sum over k with expert_ids[t, k] >= 0 of  scores[t, k] * combine_rows[t*K + k]

accumulated in fp32 and rounded to bf16 once. A route with a negative expert id (-1 =
inactive) is never read (its row and score may hold anything, NaN included); a token whose
routes are all inactive gets exact zeros.

The rows are a tensor (``combine_rows``) or sit at a device-side byte address
(``rows_addr``): the training layer returns a saved layer's h3 rows straight into the owner's
activation slot, and the combine reads them there.

Algorithm: one program owns ``block_t`` tokens x ``block_d`` columns; the K routes are
unrolled so their row loads are in flight together. Memory-bound: reads ``T*K*D`` bf16 (only
active routes) and writes ``T*D`` bf16. Nothing is allocated.

Sync points: none on the host. The returned rows must be complete before the launch (the
caller waits for the experts' signal or barrier first).

Requirements (not checked: the values live on the device): ``rows_addr`` is 16-byte aligned
and ``T*K*D`` elements are readable from there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from distmoe.kernels.base.checks import check_devices, check_tensor
from distmoe.kernels.base.config import is_power_of_2, next_power_of_2
from distmoe.kernels.base.device import device_context

_ID_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
_SCORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _combine_kernel(
    rows_ptr,
    expert_ids_ptr,
    scores_ptr,
    y_ptr,
    num_tokens,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS_ADDR: tl.constexpr,
):
    """``ROWS_ADDR``: ``rows_ptr`` is an int64 ``[1]`` holding the rows' byte address."""
    if ROWS_ADDR:
        rows_ptr = tl.load(rows_ptr).to(tl.pointer_type(tl.bfloat16))
        if HIDDEN % 8 == 0:
            rows_ptr = tl.multiple_of(rows_ptr, 16)  # 16-byte aligned rows (requirement)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    is_token = tokens < num_tokens
    col_mask = (cols < HIDDEN)[None, :]
    routes0 = tokens.to(tl.int64) * TOP_K
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        route = routes0 + k
        expert = tl.load(expert_ids_ptr + route, mask=is_token, other=-1)
        is_active = is_token & (expert >= 0)
        score = tl.load(scores_ptr + route, mask=is_active, other=0.0).to(tl.float32)
        row_mask = is_active[:, None] & col_mask
        row = tl.load(rows_ptr + route[:, None] * HIDDEN + cols[None, :], mask=row_mask, other=0.0)
        acc += score[:, None] * row.to(tl.float32)
    y_tile = y_ptr + tokens.to(tl.int64)[:, None] * HIDDEN + cols[None, :]
    tl.store(y_tile, acc.to(tl.bfloat16), mask=is_token[:, None] & col_mask)


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class CombineConfig:
    """Launch configuration of :func:`combine`.

    Attributes:
        block_t: tokens per program (power of two).
        block_d: columns per program (power of two).
        num_warps: warps per program.
    """

    block_t: int = 4
    block_d: int = 1024
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_t", "block_d"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not is_power_of_2(value):
                raise ValueError(f"{name} ({value!r}) must be a power-of-two int")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps ({self.num_warps}) must be 1, 2, 4, 8 or 16")

    @classmethod
    def for_widths(cls, *, hidden: int) -> CombineConfig:
        """A config that fits D = ``hidden``: up to 1024 columns per program, more tokens per
        program below (1024 elements in all), 4 warps. :mod:`distmoe.plan` picks the tuned
        one."""
        block_d = min(1024, next_power_of_2(hidden))
        return cls(block_t=max(1, 1024 // block_d), block_d=block_d, num_warps=4)

    @classmethod
    def all_configs(cls) -> list[CombineConfig]:
        """Candidates for a benchmark sweep."""
        return [
            cls(block_t=block_t, block_d=block_d, num_warps=num_warps)
            for block_d in (256, 512, 1024, 2048)
            for block_t in (1, 2, 4, 8, 16)
            for num_warps in (4, 8)
            if 1024 <= block_t * block_d <= 16384
        ]


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


def _check_rows(combine_rows, num_tokens: int, top_k: int, hidden: int) -> torch.Tensor:
    check_tensor("combine_rows", combine_rows, dtypes=(torch.bfloat16,))
    if combine_rows.dim() == 3:
        ok = combine_rows.shape[1] == top_k and combine_rows.shape[2] == hidden
        rows = combine_rows.reshape(-1, hidden) if ok else combine_rows
    elif combine_rows.dim() == 2:
        ok = combine_rows.shape[1] == hidden and combine_rows.shape[0] % top_k == 0
        rows = combine_rows
    else:
        ok, rows = False, combine_rows
    if not ok or rows.shape[0] < num_tokens * top_k:
        raise ValueError(
            f"combine_rows must have shape [T_max*K, D] or [T_max, K, D] with K={top_k}, "
            f"D={hidden} and T_max >= T={num_tokens}, got {list(combine_rows.shape)}"
        )
    return rows


def _check_combine_args(
    combine_rows, expert_ids, scores, y_out, *, rows_addr=None, for_kernel: bool,
) -> tuple[torch.Tensor, int, int, int]:
    check_tensor("expert_ids", expert_ids, dtypes=_ID_DTYPES, ndim=2, shape_text="[T, K]")
    num_tokens, top_k = expert_ids.shape
    if top_k < 1:
        raise ValueError(f"expert_ids must have K >= 1 columns, got shape {list(expert_ids.shape)}")
    check_tensor(
        "scores", scores, dtypes=_SCORE_DTYPES, shape=[num_tokens, top_k], shape_text="[T, K]"
    )
    check_tensor("y_out", y_out, dtypes=(torch.bfloat16,), ndim=2, shape_text="[T, D]")
    if y_out.shape[0] != num_tokens:
        raise ValueError(
            f"y_out must have T={num_tokens} rows (T from expert_ids), got {list(y_out.shape)}"
        )
    hidden = y_out.shape[1]
    named = {}
    if rows_addr is not None:
        if combine_rows is not None:
            raise ValueError("combine_rows must be None when rows_addr is given (the rows are "
                             f"read at rows_addr), got shape {list(combine_rows.shape)}")
        check_tensor("rows_addr", rows_addr, dtypes=(torch.int64,), shape=[1],
                     shape_text="(byte address of route row 0)")
        named["rows_addr"] = rows_addr
        rows = rows_addr
    elif combine_rows is None:
        raise TypeError("combine_rows must be a torch.Tensor unless rows_addr is given, got None")
    else:
        rows = _check_rows(combine_rows, num_tokens, top_k, hidden)
        named["combine_rows"] = combine_rows
    named.update(expert_ids=expert_ids, scores=scores, y_out=y_out)
    check_devices(named, for_kernel=for_kernel)
    return rows, num_tokens, top_k, hidden


def combine(
    combine_rows: torch.Tensor | None,
    expert_ids: torch.Tensor,
    scores: torch.Tensor,
    y_out: torch.Tensor,
    *,
    rows_addr: torch.Tensor | None = None,
    config: CombineConfig | None = None,
) -> torch.Tensor:
    """Score-weighted fp32 sum of each token's K returned rows, into ``y_out``.

    Args:
        combine_rows: bf16 ``[T_max*K, D]`` (or ``[T_max, K, D]``) contiguous: route
            ``(t, k)`` at row ``t*K + k``. ``None`` with ``rows_addr``.
        expert_ids: integer ``[T, K]`` contiguous (int8/16/32/64, uint8); negative = inactive.
        scores: float32 / bf16 / fp16 ``[T, K]`` contiguous.
        y_out: bf16 ``[T, D]`` contiguous; every row is written.
        rows_addr: optional int64 ``[1]`` on the device: the byte address of route row 0 of
            the rows to read (16-byte aligned, and ``T*K*D`` elements from there; not checked,
            the value lives on the device), instead of ``combine_rows``. The training layer
            reads a saved layer's rows where the experts wrote them, in its activation slot.
        config: launch configuration; default :meth:`CombineConfig.for_widths`.

    Returns ``y_out``.
    """
    rows, num_tokens, top_k, hidden = _check_combine_args(
        combine_rows, expert_ids, scores, y_out, rows_addr=rows_addr, for_kernel=True,
    )
    if config is None:
        config = CombineConfig.for_widths(hidden=hidden)
    elif not isinstance(config, CombineConfig):
        raise TypeError(f"config must be a CombineConfig, got {type(config).__name__}")
    if num_tokens == 0 or hidden == 0:
        return y_out
    grid = (triton.cdiv(num_tokens, config.block_t), triton.cdiv(hidden, config.block_d))
    with device_context(y_out.device):
        _combine_kernel[grid](
            rows,
            expert_ids,
            scores,
            y_out,
            num_tokens,
            TOP_K=top_k,
            HIDDEN=hidden,
            BLOCK_T=config.block_t,
            BLOCK_D=config.block_d,
            ROWS_ADDR=rows_addr is not None,
            num_warps=config.num_warps,
        )
    return y_out


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------


def combine_ref(
    combine_rows: torch.Tensor,
    expert_ids: torch.Tensor,
    scores: torch.Tensor,
    y_out: torch.Tensor,
) -> torch.Tensor:
    """Plain-PyTorch :func:`combine` (any device): fp32 sum, bf16 result into ``y_out``."""
    rows, num_tokens, top_k, hidden = _check_combine_args(
        combine_rows, expert_ids, scores, y_out, for_kernel=False
    )
    routes = rows[: num_tokens * top_k].reshape(num_tokens, top_k, hidden).float()
    is_active = expert_ids >= 0
    # where(), not a product with a zero score: inactive rows and scores may hold NaN.
    routes = torch.where(is_active[..., None], routes, 0.0)
    weights = torch.where(is_active, scores.float(), 0.0)
    y_out.copy_((weights[..., None] * routes).sum(dim=1).to(torch.bfloat16))
    return y_out
