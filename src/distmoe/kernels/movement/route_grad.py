"""Owner-side backward of the score-weighted combine, and the reduction of returned input
gradients.

Forward, on the token owner: ``y[t] = sum_k score[t, k] * h3[t, k]`` (fp32), where
``h3[t, k]`` is the bf16 row that the expert returned into route slot ``t*K + k``. Backward:

* :func:`route_grads` (before the expert backward):

      grad_scores[t, k]     = dot(grad_y[t], h3[t, k])          fp32 accumulation
      grad_routes[t*K + k]  = bf16(score[t, k] * grad_y[t])     one row per active route

  Inactive routes (expert id -1) get ``grad_scores = 0``; their ``h3`` rows are never read
  and their ``grad_routes`` rows never written. ``grad_routes`` is either a buffer that the
  experts gather from for W2 DGRAD/WGRAD (the combine buffer, docs/design.md), or, in *push*
  mode (what the layer uses), each route's row goes straight to the row its destination rank
  executes it at (:attr:`distmoe.routing.RoutingTables.dest_rows_TK`), inside that rank's
  gathered grad_h3: the expert then needs no gather, and the rows cross memory once instead
  of three times (owner write, expert read, expert write). The h3 rows are a tensor
  (``h3_routes``) or sit at a device-side byte address (``h3_addr``, e.g. the owner's combine
  buffer that still holds the routes' results), and may be exactly the rows of
  ``grad_routes`` (in place): each route row is read
  and written by one program only, and in that mode the program finishes reading every
  ``h3`` element of a column step before it writes that step's ``grad_routes`` elements (a
  CTA barrier between the loads and the stores: the stores do not depend on ``h3``, so no
  data dependency orders them).
* :func:`push_route_grads` (what the layer runs instead): the expert computes the score
  gradients, so the owner reads no ``h3``. It pushes the *unscaled* ``bf16(grad_y[t])`` to
  every active route's destination row and writes ``score[t, k]`` (fp32) at the start of its
  own route row ``t*K + k`` (the combine buffer, free during the backward). The expert's W2
  DGRAD (``scored_rows``) reads the score through its row pointer, which points at that row,
  and computes, per row and column tile ``j`` of F::

      acc           = grad_y[t] @ W2[:, tile j]         (fp32)
      grad_h2       = score * acc
      part_j        = dot(acc, h2[tile j])              (fp32, written at value 1 + j of the row)

  Since ``h3 = W2 @ h2``, ``sum_j part_j = dot(grad_y[t], h3)`` (up to the rounding of h2 and
  h3 to bf16 in the forward): the score gradient, without the ``T*K*D`` bf16 read of the
  saved h3 rows. The parts are summed in a fixed order, so the result is deterministic.
* :func:`reduce_routes` (after the expert backward): every route's expert returned one input
  gradient row into slot ``t*K + k`` (the dispatch buffer); ``grad_x[t]`` is their fp32 sum,
  rounded to bf16 once. Inactive routes are never read, so their slots may hold anything; a
  token without active routes gets exact zeros. With ``score_rows`` it also sums each active
  route's score parts, in part order (deterministic), into ``grad_scores``.

Memory: the kernels stream their rows once (``route_grads`` reads ``grad_y`` once per route,
served by L1/L2 since the K routes of a token sit in the same program). No atomics, no
host synchronisation (the in-place mode of ``route_grads`` adds one CTA barrier per column
step): the caller orders the peer writes (barrier) before ``reduce_routes``.
Grids come from the static ``T`` and ``D`` only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from distmoe.kernels.base.checks import check_devices, check_tensor, check_width
from distmoe.kernels.base.config import next_power_of_2
from distmoe.kernels.base.device import device_context

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _dest_rows(dest_rows_ptr, dest_bases_ptr, route, expert, is_active, experts_per_rank,
               HIDDEN: tl.constexpr):
    """``(is_pushed, row pointers)`` of the routes' rows at their destination ranks (peer
    addresses, 16-byte aligned: bases and D*2 are multiples of 16); a route with no
    destination row (-1) is not pushed."""
    dest_row = tl.load(dest_rows_ptr + route, mask=is_active, other=-1)
    is_pushed = is_active & (dest_row >= 0)
    base = tl.load(dest_bases_ptr + expert // experts_per_rank, mask=is_pushed, other=0)
    out_rows = tl.multiple_of(
        (base + dest_row.to(tl.int64) * (HIDDEN * 2)).to(tl.pointer_type(tl.bfloat16)), 16)
    return is_pushed, out_rows


@triton.jit
def _push_route_grads_kernel(
    grad_y_ptr,  # bf16 [T, D]
    expert_ids_ptr,  # int [T*K]
    scores_ptr,  # fp32 [T*K]
    score_rows_ptr,  # fp32 view of the bf16 route rows [>= T*K, D/2]: element 0 <- score
    dest_rows_ptr,  # int32 [T*K]: the route's row at its destination, -1 = none
    dest_bases_ptr,  # int64 [EP]: address of row 0 of every rank's destination rows
    num_routes,  # T*K
    experts_per_rank,  # destination rank = expert id // experts_per_rank
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    route = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = route < num_routes
    expert = tl.load(expert_ids_ptr + route, mask=in_range, other=-1)
    is_active = in_range & (expert >= 0)
    route64 = route.to(tl.int64)
    score = tl.load(scores_ptr + route, mask=is_active, other=0.0)
    tl.store(score_rows_ptr + route64 * (HIDDEN // 2), score, mask=is_active)
    is_pushed, out_rows = _dest_rows(dest_rows_ptr, dest_bases_ptr, route, expert, is_active,
                                     experts_per_rank, HIDDEN)
    token64 = route64 // TOP_K
    for d0 in tl.range(0, HIDDEN, BLOCK_D):
        col = d0 + tl.arange(0, BLOCK_D)
        mask = is_pushed[:, None] & (col < HIDDEN)[None, :]
        gy = tl.load(grad_y_ptr + token64[:, None] * HIDDEN + col[None, :], mask=mask, other=0.0)
        tl.store(out_rows[:, None] + col[None, :], gy, mask=mask)


@triton.jit
def _route_grads_kernel(
    grad_y_ptr,  # bf16 [T, D]
    h3_ptr,  # bf16 [>= T*K, D]: route (t, k) at row t*K + k; int64 [1] address (H3_ADDR)
    expert_ids_ptr,  # int [T*K]
    scores_ptr,  # fp32 [T*K]
    grad_routes_ptr,  # bf16 [>= T*K, D] (may be the h3 rows: IN_PLACE); unused with PUSH
    grad_scores_ptr,  # fp32 [T*K]
    dest_rows_ptr,  # int32 [T*K] (PUSH): the route's row at its destination, -1 = none
    dest_bases_ptr,  # int64 [EP] (PUSH): address of row 0 of every rank's destination rows
    num_routes,  # T*K
    experts_per_rank,  # (PUSH) destination rank = expert id // experts_per_rank
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    H3_ADDR: tl.constexpr,
    IN_PLACE: tl.constexpr,
    PUSH: tl.constexpr,
):
    if H3_ADDR:
        # Byte address of route row 0, 16-byte aligned (contract); the hint sits on the pointer
        # (divisibility in bytes) so the row loads stay 16-byte vectors.
        h3_ptr = tl.multiple_of(tl.load(h3_ptr).to(tl.pointer_type(tl.bfloat16)), 16)
    route = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = route < num_routes
    expert = tl.load(expert_ids_ptr + route, mask=in_range, other=-1)
    is_active = in_range & (expert >= 0)
    score = tl.load(scores_ptr + route, mask=is_active, other=0.0)
    route64 = route.to(tl.int64)
    token64 = route64 // TOP_K
    if PUSH:
        is_pushed, out_rows = _dest_rows(dest_rows_ptr, dest_bases_ptr, route, expert, is_active,
                                         experts_per_rank, HIDDEN)
    else:
        is_pushed = is_active
        out_rows = grad_routes_ptr + route64 * HIDDEN
    dot = tl.zeros([BLOCK_R], dtype=tl.float32)
    for d0 in tl.range(0, HIDDEN, BLOCK_D):
        col = d0 + tl.arange(0, BLOCK_D)
        mask = is_active[:, None] & (col < HIDDEN)[None, :]
        gy = tl.load(grad_y_ptr + token64[:, None] * HIDDEN + col[None, :], mask=mask, other=0.0)
        gy = gy.to(tl.float32)
        h3 = tl.load(h3_ptr + route64[:, None] * HIDDEN + col[None, :], mask=mask, other=0.0)
        dot += tl.sum(gy * h3.to(tl.float32), axis=1)
        grad_route = (gy * score[:, None]).to(tl.bfloat16)
        if IN_PLACE:
            # grad_route does not depend on h3, and the thread storing an element need not be
            # the one that loaded it: the barrier makes every h3 load of this step performed
            # before any store of it. Only this program touches these rows.
            tl.debug_barrier()
        tl.store(out_rows[:, None] + col[None, :], grad_route,
                 mask=is_pushed[:, None] & (col < HIDDEN)[None, :])
    tl.store(grad_scores_ptr + route, dot, mask=in_range)


@triton.jit
def _reduce_routes_kernel(
    route_rows_ptr,  # bf16 [>= T*K, D]
    expert_ids_ptr,  # int [T*K]
    grad_x_ptr,  # bf16 [T, D]
    score_rows_ptr,  # fp32 view of the bf16 route rows [>= T*K, D/2] (SCORE_PARTS > 0)
    grad_scores_ptr,  # fp32 [T*K] (SCORE_PARTS > 0)
    num_tokens,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SCORE_PARTS: tl.constexpr,
    PARTS_POW2: tl.constexpr,
):
    token = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    if SCORE_PARTS > 0:
        if tl.program_id(1) == 0:
            _sum_score_parts(score_rows_ptr, expert_ids_ptr, grad_scores_ptr, token, num_tokens,
                             TOP_K, HIDDEN, BLOCK_T, SCORE_PARTS, PARTS_POW2)
    col = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_range = token < num_tokens
    col_ok = col < HIDDEN
    token64 = token.to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        route64 = token64 * TOP_K + k
        expert = tl.load(expert_ids_ptr + route64, mask=in_range, other=-1)
        mask = (in_range & (expert >= 0))[:, None] & col_ok[None, :]
        row = tl.load(
            route_rows_ptr + route64[:, None] * HIDDEN + col[None, :], mask=mask, other=0.0
        )
        acc += row.to(tl.float32)
    out_mask = in_range[:, None] & col_ok[None, :]
    tl.store(
        grad_x_ptr + token64[:, None] * HIDDEN + col[None, :], acc.to(tl.bfloat16), mask=out_mask
    )


@triton.jit
def _sum_score_parts(score_rows_ptr, expert_ids_ptr, grad_scores_ptr, token, num_tokens,
                     TOP_K: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_T: tl.constexpr,
                     SCORE_PARTS: tl.constexpr, PARTS_POW2: tl.constexpr):
    """``grad_scores[t*K + k] = sum_j score_rows[t*K + k][1 + j]`` (fp32, ``j`` in order) for
    the active routes of the tokens, 0 for the inactive ones."""
    in_range = token < num_tokens
    part = tl.arange(0, PARTS_POW2)
    for k in tl.static_range(TOP_K):
        route64 = token.to(tl.int64) * TOP_K + k
        expert = tl.load(expert_ids_ptr + route64, mask=in_range, other=-1)
        is_active = in_range & (expert >= 0)
        parts = tl.load(score_rows_ptr + route64[:, None] * (HIDDEN // 2) + 1 + part[None, :],
                        mask=is_active[:, None] & (part < SCORE_PARTS)[None, :], other=0.0)
        tl.store(grad_scores_ptr + route64, tl.sum(parts, axis=1), mask=in_range)


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RouteGradConfig:
    """Launch configuration of :func:`route_grads` and :func:`reduce_routes`.

    Attributes:
        block_rows: routes (``route_grads``) or tokens (``reduce_routes``) per program; power
            of two in [1, 256].
        block_d: hidden columns per step; power of two in [16, 4096].
        num_warps: 1, 2, 4 or 8.
    """

    block_rows: int = 16
    block_d: int = 256
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name, low, high in (("block_rows", 1, 256), ("block_d", 16, 4096)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
            if value < low or value > high or value & (value - 1):
                raise ValueError(f"{name} ({value}) must be a power of two in [{low}, {high}]")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"num_warps ({self.num_warps}) must be 1, 2, 4 or 8")

    @classmethod
    def for_widths(cls, *, hidden: int) -> RouteGradConfig:
        """Tiles of about 4096 elements (16 bf16 values per thread at 4 warps): memory-bound
        rows, one 16-byte vector per load per thread and a few loads in flight."""
        block_d = min(512, max(16, next_power_of_2(hidden)))
        return cls(block_rows=max(1, 4096 // block_d), block_d=block_d, num_warps=4)

    @classmethod
    def all_configs(cls, *, hidden: int) -> list[RouteGradConfig]:
        """Candidates for tuning (all valid for any ``hidden``)."""
        widest = max(16, next_power_of_2(hidden))
        out = []
        for block_d in (128, 256, 512, 1024):
            block_d = min(block_d, widest)
            for elems in (2048, 4096, 8192):
                for num_warps in (4, 8):
                    cfg = cls(
                        block_rows=max(1, elems // block_d), block_d=block_d, num_warps=num_warps
                    )
                    if cfg not in out:
                        out.append(cfg)
        return out


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _check_ids_scores(expert_ids: object, scores: object | None) -> tuple[int, int]:
    check_tensor("expert_ids", expert_ids, dtypes=_INT_DTYPES, ndim=2, shape_text="[T, K]")
    num_tokens, top_k = expert_ids.shape
    if top_k < 1:
        raise ValueError(f"expert_ids must have K >= 1 columns, got shape {list(expert_ids.shape)}")
    if scores is not None:
        check_tensor(
            "scores",
            scores,
            dtypes=(torch.float32,),
            shape=[num_tokens, top_k],
            shape_text="[T, K] like expert_ids",
        )
    return num_tokens, top_k


def _check_grad_y(grad_y: object, num_tokens: int) -> int:
    """``grad_y`` bf16 ``[T, D]`` with ``T = num_tokens``; returns D."""
    check_tensor("grad_y", grad_y, dtypes=(torch.bfloat16,), ndim=2, shape_text="[T, D]")
    if grad_y.shape[0] != num_tokens:
        raise ValueError(
            f"grad_y must have T = {num_tokens} rows like expert_ids, got {list(grad_y.shape)}"
        )
    check_width("D (grad_y.shape[1])", grad_y.shape[1])
    return grad_y.shape[1]


def _check_push(dest_rows: object, dest_bases: object, experts_per_rank: object,
                num_tokens: int, top_k: int) -> None:
    """The destination arguments of a push (``route_grads`` push mode, ``push_route_grads``)."""
    check_tensor("dest_rows", dest_rows, dtypes=(torch.int32,),
                 shape=[num_tokens, top_k], shape_text="[T, K] like expert_ids")
    check_tensor("dest_bases", dest_bases, dtypes=(torch.int64,), ndim=1,
                 shape_text="[EP] (byte addresses of every rank's destination row 0)")
    if isinstance(experts_per_rank, bool) or not isinstance(experts_per_rank, int) \
            or experts_per_rank < 1:
        raise ValueError(f"experts_per_rank ({experts_per_rank!r}) must be an int >= 1 when "
                         "route rows are pushed")


def _check_route_rows(name: str, value: object, num_routes: int, hidden: int) -> None:
    check_tensor(name, value, dtypes=(torch.bfloat16,), ndim=2, shape_text="[T_max*K, D]")
    if value.shape[0] < num_routes or value.shape[1] != hidden:
        raise ValueError(
            f"{name} must have shape [R, {hidden}] with R >= T*K ({num_routes}), "
            f"got {list(value.shape)}"
        )


def _check_config(config: object, hidden: int) -> RouteGradConfig:
    if config is None:
        return RouteGradConfig.for_widths(hidden=hidden)
    if not isinstance(config, RouteGradConfig):
        raise TypeError(f"config must be a RouteGradConfig or None, got {type(config).__name__}")
    return config


def route_grads(
    grad_y: torch.Tensor,
    h3_routes: torch.Tensor | None,
    expert_ids: torch.Tensor,
    scores: torch.Tensor,
    grad_routes_out: torch.Tensor | None,
    grad_scores_out: torch.Tensor,
    *,
    h3_addr: torch.Tensor | None = None,
    dest_rows: torch.Tensor | None = None,
    dest_bases: torch.Tensor | None = None,
    experts_per_rank: int | None = None,
    config: RouteGradConfig | None = None,
) -> None:
    """Score and route-output gradients of the owner combine (see the module docstring).

    Args:
        grad_y: ``[T, D]`` bf16, gradient of the layer output.
        h3_routes: ``[T_max*K, D]`` bf16 (``T_max >= T``), the expert results saved in
            forward; route ``(t, k)`` at row ``t*K + k``. Rows of inactive routes are not read.
            May be ``grad_routes_out`` itself, or a view starting at the same row (in place);
            any other overlap is an error. Must be ``None`` when ``h3_addr`` is given.
        expert_ids: ``[T, K]`` any integer dtype; -1 marks an inactive route.
        scores: ``[T, K]`` fp32 routing scores.
        grad_routes_out: ``[T_max*K, D]`` bf16; row ``t*K + k`` receives
            ``bf16(scores[t, k] * grad_y[t])`` for every active route, other rows untouched.
            ``None`` when the rows are pushed to their destinations instead (``dest_rows``).
        grad_scores_out: ``[T, K]`` fp32; receives ``dot(grad_y[t], h3[t*K + k])`` (0 where
            inactive).
        h3_addr: optional int64 ``[1]`` device tensor, the absolute byte address of route row 0
            of the h3 rows (row ``t*K + k`` at ``h3_addr[0] + (t*K + k)*D*2``; 16-byte aligned,
            not checked: the value lives on the device). Those rows may be exactly the rows of
            ``grad_routes_out`` (in place: the owner reads the routes' results from its combine
            buffer and overwrites them with the route gradients): every h3 element a program
            reads is read before that program writes the same element of ``grad_routes_out``,
            and no other program writes it (module docstring). Always run in that ordered mode,
            since the host cannot tell whether the rows coincide.
        dest_rows: optional int32 ``[T, K]`` (with ``dest_bases`` and ``experts_per_rank``,
            and ``grad_routes_out=None``): push mode. The row ``bf16(scores[t, k] *
            grad_y[t])`` of an active route with ``dest_rows[t, k] >= 0`` is written to
            ``dest_bases[expert_ids[t, k] // experts_per_rank] + dest_rows[t, k]*D*2``: in
            the layer, the destination rank's gathered grad_h3 row of that route
            (:attr:`distmoe.routing.RoutingTables.dest_rows_TK`), so that the expert needs no
            gather. Addresses are not checked (they live on the device): every
            ``expert_ids // experts_per_rank`` of an active route must index ``dest_bases``,
            and the rows written must not overlap anything this call reads.
        dest_bases: int64 ``[EP]`` absolute byte addresses (16-byte aligned) of row 0 of every
            rank's destination rows (push mode).
        experts_per_rank: experts per rank (push mode), an int >= 1.
        config: launch configuration; ``None`` picks :meth:`RouteGradConfig.for_widths`.

    All tensors contiguous, on one CUDA device (CPU under the Triton interpreter).
    """
    num_tokens, top_k = _check_ids_scores(expert_ids, scores)
    hidden = _check_grad_y(grad_y, num_tokens)
    num_routes = num_tokens * top_k
    if h3_addr is None:
        if h3_routes is None:
            raise TypeError("h3_routes must be a torch.Tensor when h3_addr is not given, got None")
        _check_route_rows("h3_routes", h3_routes, num_routes, hidden)
    else:
        if h3_routes is not None:
            raise ValueError(
                "h3_routes must be None when h3_addr is given (the h3 rows are read at "
                f"h3_addr), got a tensor of shape {list(h3_routes.shape)}"
            )
        check_tensor(
            "h3_addr",
            h3_addr,
            dtypes=(torch.int64,),
            shape=[1],
            shape_text="(byte address of route row 0 of h3)",
        )
    push = dest_rows is not None or dest_bases is not None or experts_per_rank is not None
    if push:
        if grad_routes_out is not None:
            raise ValueError(
                "grad_routes_out must be None in push mode (dest_rows/dest_bases/"
                f"experts_per_rank given), got a tensor of shape {list(grad_routes_out.shape)}"
            )
        _check_push(dest_rows, dest_bases, experts_per_rank, num_tokens, top_k)
    else:
        if grad_routes_out is None:
            raise TypeError("grad_routes_out must be a torch.Tensor unless the rows are pushed "
                            "(dest_rows, dest_bases, experts_per_rank), got None")
        _check_route_rows("grad_routes_out", grad_routes_out, num_routes, hidden)
    check_tensor(
        "grad_scores_out",
        grad_scores_out,
        dtypes=(torch.float32,),
        shape=[num_tokens, top_k],
        shape_text="[T, K]",
    )
    h3_name = "h3_routes" if h3_addr is None else "h3_addr"
    named = {
        "grad_y": grad_y,
        h3_name: h3_routes if h3_addr is None else h3_addr,
        "expert_ids": expert_ids,
        "scores": scores,
        "grad_scores_out": grad_scores_out,
    }
    if push:
        named.update(dest_rows=dest_rows, dest_bases=dest_bases)
    else:
        named["grad_routes_out"] = grad_routes_out
    device = check_devices(named)
    in_place = not push and (h3_addr is not None or _rows_coincide(h3_routes, grad_routes_out))
    config = _check_config(config, hidden)
    if num_routes == 0:
        return
    grid = (triton.cdiv(num_routes, config.block_rows),)
    with device_context(device):
        _route_grads_kernel[grid](
            grad_y,
            h3_routes if h3_addr is None else h3_addr,
            expert_ids,
            scores,
            grad_y if push else grad_routes_out,  # placeholder in push mode: never written
            grad_scores_out,
            dest_rows if push else grad_scores_out,  # placeholders: never read
            dest_bases if push else grad_scores_out,
            num_routes,
            experts_per_rank if push else 1,
            TOP_K=top_k,
            HIDDEN=hidden,
            BLOCK_R=config.block_rows,
            BLOCK_D=config.block_d,
            H3_ADDR=h3_addr is not None,
            IN_PLACE=in_place,
            PUSH=push,
            num_warps=config.num_warps,
        )


def push_route_grads(
    grad_y: torch.Tensor,
    expert_ids: torch.Tensor,
    scores: torch.Tensor,
    score_rows: torch.Tensor,
    *,
    dest_rows: torch.Tensor,
    dest_bases: torch.Tensor,
    experts_per_rank: int,
    config: RouteGradConfig | None = None,
) -> None:
    """Owner side of the backward when the expert computes the score gradients (what the layer
    runs; module docstring). For every active route ``(t, k)``:

    * the unscaled row ``grad_y[t]`` (bf16, copied bit for bit) is written to
      ``dest_bases[expert_ids[t, k] // experts_per_rank] + dest_rows[t, k]*D*2``, the row the
      destination rank executes the route at (not written when ``dest_rows[t, k] < 0``);
    * ``scores[t, k]`` is written as an fp32 at the first 4 bytes of ``score_rows[t*K + k]``,
      where the expert reads it (:func:`distmoe.kernels.w2_dgrad.triton.w2_dgrad_swiglu_bwd`
      with ``scored_rows``) and then leaves its partial score gradients for
      :func:`reduce_routes`.

    Args:
        grad_y: ``[T, D]`` bf16, gradient of the layer output (``D`` a multiple of 8).
        expert_ids: ``[T, K]`` any integer dtype; -1 marks an inactive route (nothing written).
        scores: ``[T, K]`` fp32 routing scores.
        score_rows: ``[T_max*K, D]`` bf16 (``T_max >= T``): the owner's route rows (the
            combine buffer, which the backward does not otherwise use). Only the first 4 bytes
            of the active routes' rows are written.
        dest_rows: int32 ``[T, K]``, each route's row at its destination rank, -1 = none.
        dest_bases: int64 ``[EP]`` absolute byte addresses (16-byte aligned) of row 0 of every
            rank's destination rows. Addresses are not checked (they live on the device):
            every ``expert_ids // experts_per_rank`` of an active route must index it, and the
            rows written must not overlap anything this call reads.
        experts_per_rank: experts per rank, an int >= 1.
        config: launch configuration; ``None`` picks :meth:`RouteGradConfig.for_widths`.
    """
    num_tokens, top_k = _check_ids_scores(expert_ids, scores)
    hidden = _check_grad_y(grad_y, num_tokens)
    _check_route_rows("score_rows", score_rows, num_tokens * top_k, hidden)
    _check_push(dest_rows, dest_bases, experts_per_rank, num_tokens, top_k)
    device = check_devices({"grad_y": grad_y, "expert_ids": expert_ids, "scores": scores,
                            "score_rows": score_rows, "dest_rows": dest_rows,
                            "dest_bases": dest_bases})
    config = _check_config(config, hidden)
    num_routes = num_tokens * top_k
    if num_routes == 0:
        return
    with device_context(device):
        _push_route_grads_kernel[(triton.cdiv(num_routes, config.block_rows),)](
            grad_y, expert_ids, scores, score_rows.view(torch.float32), dest_rows, dest_bases,
            num_routes, experts_per_rank, TOP_K=top_k, HIDDEN=hidden,
            BLOCK_R=config.block_rows, BLOCK_D=config.block_d, num_warps=config.num_warps,
        )  # fmt: skip


def _rows_coincide(h3_routes: torch.Tensor, grad_routes_out: torch.Tensor) -> bool:
    """True when both start at the same row (in place); ``ValueError`` on any other overlap
    (a route row read by one program would be written by another)."""
    lo_a = h3_routes.data_ptr()
    hi_a = lo_a + h3_routes.numel() * h3_routes.element_size()
    lo_b = grad_routes_out.data_ptr()
    hi_b = lo_b + grad_routes_out.numel() * grad_routes_out.element_size()
    if not (lo_a < hi_b and lo_b < hi_a) or h3_routes.numel() == 0:
        return False
    if lo_a != lo_b:
        raise ValueError(
            "h3_routes and grad_routes_out must be disjoint or start at the same row (in "
            f"place), got [{lo_a:#x}, {hi_a:#x}) and [{lo_b:#x}, {hi_b:#x})"
        )
    return True


def reduce_routes(
    route_rows: torch.Tensor,
    expert_ids: torch.Tensor,
    grad_x_out: torch.Tensor,
    *,
    score_rows: torch.Tensor | None = None,
    score_parts: int = 0,
    grad_scores_out: torch.Tensor | None = None,
    config: RouteGradConfig | None = None,
) -> None:
    """``grad_x[t] = bf16(sum over active k of route_rows[t*K + k])`` with fp32 accumulation;
    with ``score_rows``, also the score gradients the experts left in the owner's route rows.

    Args:
        route_rows: ``[T_max*K, D]`` bf16 (``T_max >= T``): the input-gradient row of route
            ``(t, k)`` at row ``t*K + k``. Rows of inactive routes are never read.
        expert_ids: ``[T, K]`` any integer dtype; -1 marks an inactive route.
        grad_x_out: ``[T, D]`` bf16; every row is written (exact zeros for a token without
            active routes).
        score_rows: optional ``[T_max*K, D]`` bf16, the owner's route rows into which the
            experts wrote fp32 partial score gradients (``scored_rows`` of
            :func:`distmoe.kernels.w2_dgrad.triton.w2_dgrad_swiglu_bwd`): route ``(t, k)``'s
            parts are the fp32 values ``1 .. score_parts`` of its row. With
            ``grad_scores_out`` and ``score_parts``. Every active route's parts must have been
            written: pass the executed ids (a route no expert ran would read stale values).
        score_parts: parts per route (the W2 DGRAD's column tiles, ``ceil(F / block_n)``),
            an int in ``[1, D/2 - 1]`` with ``score_rows``.
        grad_scores_out: fp32 ``[T, K]``; receives the fp32 sum of the route's parts, in part
            order, for active routes and 0 for inactive ones (with ``score_rows``).
        config: launch configuration (``block_rows`` = tokens per program); ``None`` picks
            :meth:`RouteGradConfig.for_widths`.
    """
    num_tokens, top_k = _check_ids_scores(expert_ids, None)
    check_tensor("grad_x_out", grad_x_out, dtypes=(torch.bfloat16,), ndim=2, shape_text="[T, D]")
    if grad_x_out.shape[0] != num_tokens:
        raise ValueError(
            f"grad_x_out must have T = {num_tokens} rows like expert_ids, "
            f"got {list(grad_x_out.shape)}"
        )
    hidden = grad_x_out.shape[1]
    check_width("D (grad_x_out.shape[1])", hidden)
    _check_route_rows("route_rows", route_rows, num_tokens * top_k, hidden)
    named = {"route_rows": route_rows, "expert_ids": expert_ids, "grad_x_out": grad_x_out}
    scored = score_rows is not None or grad_scores_out is not None or score_parts != 0
    if scored:
        _check_route_rows("score_rows", score_rows, num_tokens * top_k, hidden)
        check_tensor("grad_scores_out", grad_scores_out, dtypes=(torch.float32,),
                     shape=[num_tokens, top_k], shape_text="[T, K] like expert_ids")
        if isinstance(score_parts, bool) or not isinstance(score_parts, int) \
                or not 1 <= score_parts <= hidden // 2 - 1:
            raise ValueError(f"score_parts ({score_parts!r}) must be an int in [1, D/2 - 1 = "
                             f"{hidden // 2 - 1}] with score_rows (fp32 value 0 of a route "
                             "row is its score, the parts follow)")
        named.update(score_rows=score_rows, grad_scores_out=grad_scores_out)
    device = check_devices(named)
    config = _check_config(config, hidden)
    if num_tokens == 0:
        return
    grid = (triton.cdiv(num_tokens, config.block_rows), triton.cdiv(hidden, config.block_d))
    with device_context(device):
        _reduce_routes_kernel[grid](
            route_rows,
            expert_ids,
            grad_x_out,
            score_rows.view(torch.float32) if scored else grad_x_out,  # placeholders: unused
            grad_scores_out if scored else grad_x_out,
            num_tokens,
            TOP_K=top_k,
            HIDDEN=hidden,
            BLOCK_T=config.block_rows,
            BLOCK_D=config.block_d,
            SCORE_PARTS=score_parts if scored else 0,
            PARTS_POW2=next_power_of_2(score_parts) if scored else 1,
            num_warps=config.num_warps,
        )


# --------------------------------------------------------------------------------------------
# References (plain PyTorch, any device)
# --------------------------------------------------------------------------------------------


def route_grads_ref(
    grad_y: torch.Tensor,
    h3_routes: torch.Tensor,
    expert_ids: torch.Tensor,
    scores: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`route_grads` in fp32 (fp64 if ``grad_y`` is fp64).

    Returns ``(grad_routes [T*K, D], grad_scores [T, K])``; ``grad_routes`` rows of inactive
    routes are zeros (the kernel leaves them untouched) and no rounding to bf16 is applied.
    """
    dtype = torch.float64 if grad_y.dtype == torch.float64 else torch.float32
    num_tokens, top_k = expert_ids.shape
    is_active = (expert_ids.long() >= 0).to(dtype)
    gy = grad_y.to(dtype)
    h3 = h3_routes[: num_tokens * top_k].to(dtype).reshape(num_tokens, top_k, -1)
    h3 = torch.where(is_active[..., None] > 0, h3, torch.zeros((), dtype=dtype, device=h3.device))
    grad_scores = torch.einsum("td,tkd->tk", gy, h3) * is_active
    grad_routes = gy[:, None, :] * (scores.to(dtype) * is_active)[..., None]
    return grad_routes.reshape(num_tokens * top_k, -1), grad_scores


def reduce_routes_ref(route_rows: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`reduce_routes`: ``[T, D]`` fp32 sum of the active routes' rows."""
    num_tokens, top_k = expert_ids.shape
    rows = route_rows[: num_tokens * top_k].float().reshape(num_tokens, top_k, -1)
    is_active = (expert_ids.long() >= 0)[..., None]
    return torch.where(is_active, rows, torch.zeros((), device=rows.device)).sum(dim=1)
