"""Layer configuration: :class:`MoEConfig`, a frozen, keyword-only, validated dataclass.

Every rule that can be checked without knowing the expert-parallel group size is checked at
construction; rules that need ``ep_size`` live in :meth:`MoEConfig.check_ep_size`, which the
planner and the context call where the group is known.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Precision = Literal["bf16", "mxfp8", "nvfp4", "fp8_block", "mxfp4"]
PRECISIONS: tuple[str, ...] = ("bf16", "mxfp8", "nvfp4", "fp8_block", "mxfp4")
PIPELINES: tuple[str, ...] = ("staged", "mega", "auto")

# Expert ids travel between ranks as int16 (docs/design.md, Per-rank buffers).
MAX_EXPERTS = 2**15 - 1


def _require_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} ({value}) must be >= {minimum}")


def _require_number(name: str, value: object, minimum: float, *, strict: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} ({value!r})")
    if not math.isfinite(value) or value < minimum or (strict and value == minimum):
        rule = ">" if strict else ">="
        raise ValueError(f"{name} ({value}) must be finite and {rule} {minimum}")


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Static description of one routed-expert MoE layer and its memory budget.

    Shapes of one call on one rank (README.md, Usage): ``x [T, D]`` bf16 with
    ``T <= max_tokens``, ``expert_ids [T, K]`` integer, ``scores [T, K]`` float,
    ``w13 [E_local, 2, F, D]`` bf16 and ``w2 [E_local, D, F]`` bf16 where
    ``E_local = num_experts / ep_size``.

    Attributes:
        hidden: D, the token width. bf16 needs a multiple of 8 (rows are whole 16-byte
            stores), mxfp8 and mxfp4 a multiple of 32 (one E8M0 scale per 32 values), nvfp4
            of 16, fp8_block of 128 (one float32 scale per 128 values).
        ffn: F, the expert intermediate width (same multiples as ``hidden``).
        num_experts: E, global routed experts (at most 32767: ids travel as int16).
        top_k: K, experts chosen per token, ``1 <= top_k <= num_experts``.
        max_tokens: T_max, the largest physical token count per rank; every buffer is sized
            from it.
        precision: ``"bf16"``, ``"mxfp8"``, ``"fp8_block"`` (DeepSeek-V3's block FP8),
            ``"nvfp4"`` or ``"mxfp4"`` (GPT-OSS's expert format; the two FP4 precisions are
            inference only, weights in FP4; activations bf16, except that nvfp4 at EP > 1
            packs the rows that cross between GPUs as NVFP4 too: docs/numerics.md section 8).
        training: keep state for backward.
        row_block: rows of one GEMM tile; each local expert's rows are padded to a multiple
            of it. A power of two in [16, 256].
        activation_factor: saved-state slot capacity as a multiple of the balanced
            full-save demand above the inputs-only minimum (0 = inputs only, 1 = balanced full
            save). Ignored when ``activation_bytes`` is given.
        activation_bytes: exact per-slot capacity in bytes (overrides the factor).
        device_scratch_factor: receive bound in units of the balanced rows ``T*K``: a rank
            can execute at most ``ceil(device_scratch_factor * T_max * K)`` received rows
            from device scratch.
        total_scratch_factor: optional larger receive bound whose scratch beyond the device
            tier is backed by pinned host pages (VMM tier); ``None`` = device tier only.
            A bf16 inference context on the peer transport takes it (rows past the device
            bound run from host-backed scratch, slower but not dropped); training and
            low-precision contexts refuse it (``MoEContext``), the planner models it.
        num_slots: activation slots (pipeline stage-microbatch owners alive at once).
        max_layers_per_slot: MoE layers whose state one slot holds.
        save_route_outputs: a saved layer keeps its returned route results
            ``h3 [T_max, K, D]`` bf16 in its slot (docs/memory.md section 2; the default).
            The backward does not read them (the experts compute the score gradients,
            :mod:`distmoe.ops.autograd`), so ``False`` drops them: ``align128(T_max*K*D*2)``
            fewer bytes per saved layer (a third of a bf16 layer at D = 2F), so more layers
            save whole within the same budget. Gradients are the same bits either way.
        save_gathered_rows: a saved layer keeps the rows it gathered, ``x_rows [R, D]``
            bf16 (the default: its backward reads them in place). ``False`` keeps its input
            ``x [T_max, D]`` instead, like a replayed layer, and the backward gathers the
            rows again into scratch before its weight gradients: ``align128(R*D*2) -
            align128(T_max*D*2)`` fewer bytes per saved layer wherever a rank executes more
            rows than it has tokens (at EP = 1, R = T*K: about a third of a bf16 layer at
            D = 2F), for one more copy of the rows per backward. ``"auto"``: each layer
            chooses on the device, with its rows: its gathered rows where the slot has room
            for them and for the later layers' smaller states, else x where that fits and
            is smaller, else its input alone (replay): under a tight budget, layers that would
            replay keep x instead where they can, and a regather costs far less step time
            than a replay (evidence: docs/memory.md section 4; the rule:
            :mod:`distmoe.kernels.movement.slot_cursor`). Gradients are the same bits in
            every mode.
        gathered_rows_in_place: with ``save_gathered_rows`` False or ``"auto"``, on a one-rank
            group:
            ``True``: the W13 weight gradient reads x's rows in place, through the forward's
            gather table (no copy of the rows, so the scratch holds ``2*R*D`` bytes less; a
            replayed layer's W13 stores h1 only); ``False``: the backward copies them into
            scratch first; ``None`` (the default): in place from 512 rows per local expert
            (the shape hint ``T_max*K*EP/E``), where reading in place is faster
            (:func:`distmoe.memory.rows_in_place`; evidence: docs/performance.md). Under
            ``"auto"``, ``True`` has the same kernel read a layer's rows kept in its slot in
            order, and ``None`` copies (in place is slower there). At EP > 1 the rows are
            always copied (most live on the peers). Gradients are the same bits either way.
        pipeline: how a forward runs its two GEMMs: ``"staged"`` (W13 + SwiGLU, then W2:
            two launches), ``"mega"`` (one persistent kernel whose W2 tiles start as soon as
            their h2 rows exist, storing into the owners' combine buffers; bf16 inference at
            EP > 1 with every rank on a GPU of its own, refused elsewhere when the context
            is built) or ``"auto"`` (the plan's rule, :func:`distmoe.plan.rules.
            pipeline_for`: staged until Mega is measured faster).
    """

    hidden: int
    ffn: int
    num_experts: int
    top_k: int
    max_tokens: int
    precision: Precision = "bf16"
    training: bool = True
    row_block: int = 128
    activation_factor: float = 1.0
    activation_bytes: int | None = None
    device_scratch_factor: float = 2.0
    total_scratch_factor: float | None = None
    num_slots: int = 1
    max_layers_per_slot: int = 1
    save_route_outputs: bool = True
    save_gathered_rows: bool | Literal["auto"] = True
    gathered_rows_in_place: bool | None = None
    pipeline: Literal["staged", "mega", "auto"] = "auto"

    def __post_init__(self) -> None:
        for name in ("hidden", "ffn", "num_experts", "top_k", "max_tokens"):
            _require_int(name, getattr(self, name), 1)
        if self.num_experts > MAX_EXPERTS:
            raise ValueError(
                f"num_experts ({self.num_experts}) must be <= {MAX_EXPERTS}: "
                "expert ids travel between ranks as int16"
            )
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k ({self.top_k}) must be <= num_experts ({self.num_experts})"
            )
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision ({self.precision!r}) must be one of {PRECISIONS}")
        if not isinstance(self.training, bool):
            raise TypeError(f"training must be a bool, got {type(self.training).__name__}")
        if self.precision in ("nvfp4", "mxfp4") and self.training:
            raise ValueError(
                f"precision {self.precision!r} is inference only: training (True) must be False"
            )
        multiple = {"bf16": 8, "mxfp8": 32, "nvfp4": 16, "fp8_block": 128,
                    "mxfp4": 32}[self.precision]
        for name in ("hidden", "ffn"):
            value = getattr(self, name)
            if value % multiple:
                raise ValueError(
                    f"{name} ({value}) must be a multiple of {multiple} for precision "
                    f"{self.precision!r}"
                )
        if self.pipeline not in PIPELINES:
            raise ValueError(f"pipeline ({self.pipeline!r}) must be one of {PIPELINES}")
        if self.pipeline == "mega" and (self.training or self.precision != "bf16"):
            raise ValueError(
                f"pipeline 'mega' runs bf16 inference only so far, got training="
                f"{self.training}, precision {self.precision!r}: use 'staged' or 'auto'")
        _require_int("row_block", self.row_block, 16)
        if self.row_block > 256 or self.row_block & (self.row_block - 1):
            raise ValueError(f"row_block ({self.row_block}) must be a power of two in [16, 256]")
        _require_number("activation_factor", self.activation_factor, 0.0)
        if self.activation_bytes is not None:
            _require_int("activation_bytes", self.activation_bytes, 0)
        _require_number("device_scratch_factor", self.device_scratch_factor, 0.0, strict=True)
        if self.total_scratch_factor is not None:
            _require_number("total_scratch_factor", self.total_scratch_factor, 0.0, strict=True)
            if self.total_scratch_factor < self.device_scratch_factor:
                raise ValueError(
                    f"total_scratch_factor ({self.total_scratch_factor}) must be >= "
                    f"device_scratch_factor ({self.device_scratch_factor})"
                )
        _require_int("num_slots", self.num_slots, 1)
        _require_int("max_layers_per_slot", self.max_layers_per_slot, 1)
        if not isinstance(self.save_route_outputs, bool):
            raise TypeError(f"save_route_outputs must be a bool, got "
                            f"{type(self.save_route_outputs).__name__}")
        if not isinstance(self.save_gathered_rows, bool | str):
            raise TypeError(f"save_gathered_rows must be a bool or 'auto', got "
                            f"{type(self.save_gathered_rows).__name__}")
        if isinstance(self.save_gathered_rows, str) and self.save_gathered_rows != "auto":
            raise ValueError(f"save_gathered_rows must be True, False or 'auto', got "
                             f"{self.save_gathered_rows!r}")
        if self.gathered_rows_in_place is not None:
            if not isinstance(self.gathered_rows_in_place, bool):
                raise TypeError(f"gathered_rows_in_place must be a bool or None, got "
                                f"{type(self.gathered_rows_in_place).__name__}")
            if self.save_gathered_rows is True:
                raise ValueError(f"gathered_rows_in_place ({self.gathered_rows_in_place}) "
                                 "applies only with save_gathered_rows False or 'auto' (a "
                                 "layer that may keep x instead of its rows), got "
                                 "save_gathered_rows=True")

    # ----------------------------------------------------------------- group-size rules
    def check_ep_size(self, ep_size: int) -> None:
        """Raise ``ValueError`` unless this layer can be split over ``ep_size`` ranks."""
        _require_int("ep_size", ep_size, 1)
        if self.num_experts % ep_size:
            raise ValueError(
                f"num_experts ({self.num_experts}) must be divisible by ep_size ({ep_size})"
            )

    def experts_per_rank(self, ep_size: int) -> int:
        """E_local = num_experts / ep_size (validated)."""
        self.check_ep_size(ep_size)
        return self.num_experts // ep_size

    @property
    def balanced_rows(self) -> int:
        """R at balanced routing: ``max_tokens * top_k`` rows received per rank."""
        return self.max_tokens * self.top_k

    def max_possible_rows(self, ep_size: int) -> int:
        """Most rows one rank can ever receive: every token of every rank routes
        ``min(K, E_local)`` of its routes to it."""
        return ep_size * self.max_tokens * min(self.top_k, self.experts_per_rank(ep_size))

    def receive_bound(self, ep_size: int, *, total: bool = False) -> int:
        """Executable received rows per rank: ``ceil(factor * T_max * K)``, capped at
        :meth:`max_possible_rows`. ``total=True`` uses ``total_scratch_factor`` (VMM tier)
        when set."""
        factor = self.device_scratch_factor
        if total and self.total_scratch_factor is not None:
            factor = self.total_scratch_factor
        return min(math.ceil(factor * self.balanced_rows), self.max_possible_rows(ep_size))
