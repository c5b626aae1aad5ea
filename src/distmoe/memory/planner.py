"""Activation-memory planner: capacities, save/replay decisions and the printed plan.

Pure Python; nothing is allocated. The device side allocates one activation buffer of
``MemoryPlan.activation_buffer_bytes`` bytes and carves it as::

    [ slot 0 | slot 1 | ... | slot N-1 | host scratch (VMM, optional) | device scratch ]
    0                                                                   high end ->

* A **slot** keeps the saved state of one owner (a pipeline stage-microbatch) from forward
  to backward. It holds up to ``cfg.max_layers_per_slot`` layers; each layer either saves
  its full state or keeps only its input and replays the forward in backward.
* **Scratch** holds the temporaries of one call (forward, or backward with replay). It is
  shared by every layer and slot, sized at the receive bound, and grows down from the high
  end, so small calls stay in the device tier. With ``cfg.total_scratch_factor`` the part
  beyond the device tier is backed by pinned host pages mapped into the same virtual range
  (VMM); it is not part of the device allocation.

Definitions (L = ``cfg.max_layers_per_slot``, byte costs from :mod:`distmoe.memory.costs`):

* ``input_bytes = align128(T * D * 2)``; ``full(R)`` = full-state bytes at R rows.
* ``min_slot_bytes = L * input_bytes`` (inputs only); ``balanced_slot_bytes = L *
  full(T * K)``; ``useful_max_slot_bytes = L * full(receive_bound)`` (no executable
  routing can keep more).
* ``slot_capacity_bytes``: with ``cfg.activation_bytes`` set, that value rounded down to a
  multiple of 128 (lossless: every saved size is a multiple of 128); otherwise
  ``align128(min + ceil(activation_factor * (balanced - min)))``. 0 for inference.
* ``device_receive_bound = cfg.receive_bound(ep)``; ``receive_bound =
  cfg.receive_bound(ep, total=True)`` (equal without a total scratch factor).
* ``scratch_bytes = scratch_peak(device_receive_bound)``; ``host_scratch_bytes =
  scratch_peak(receive_bound) - scratch_bytes``.
* ``activation_buffer_bytes = num_slots * slot_capacity_bytes + scratch_bytes``.

Save/replay rule (the same on every rank, evaluated on the worst one): layers of a slot are
visited in forward order; ``saved_r`` is rank r's bytes kept so far. Layer l of L saves iff
``max_r(saved_r + full_r(l)) + (L - 1 - l) * input_bytes <= capacity``; the second term
reserves the inputs of the layers still to come, so a replay can always be kept. A saved
layer adds ``full_r(l)`` to ``saved_r``, a replayed one ``input_bytes`` on every rank.

Monotonicity in the capacity does not hold in general for this greedy rule: a heavy layer
that replays at a small capacity leaves room for a light later layer, while at a larger
capacity the heavy layer saves and crowds the light one out. :func:`is_capacity_monotone`
tests the exact condition; see its docstring and docs/memory.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from distmoe.config import MoEConfig
from distmoe.memory.costs import (
    LayerCosts,
    TensorBytes,
    align128,
    full_state_bytes,
    input_bytes,
    kept_x_state_bytes,
    layer_costs,
)

# --------------------------------------------------------------------------- formatting
_UNITS = ("KiB", "MiB", "GiB", "TiB")


def format_bytes(num_bytes: int) -> str:
    """Human-readable size in binary units: ``512 B``, ``27.00 KiB``, ``1.38 GiB``."""
    if abs(num_bytes) < 1024:
        return f"{num_bytes} B"
    value = float(num_bytes)
    for unit in _UNITS:
        value /= 1024.0
        if abs(value) < 1024.0 or unit == _UNITS[-1]:
            return f"{value:.2f} {unit}"
    raise AssertionError("unreachable")


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


# --------------------------------------------------------------------------- validation
def _check_training(cfg: MoEConfig, what: str) -> None:
    if not cfg.training:
        raise ValueError(
            f"{what} needs a training config: cfg.training (False) keeps no state for "
            "backward, so there is nothing to save or replay"
        )


def _check_received_rows(cfg: MoEConfig, received_rows: Sequence[Sequence[int]]) -> int:
    """Validate ``received_rows[layer][rank]``; return the EP size it implies."""
    if isinstance(received_rows, (str, bytes)) or not isinstance(received_rows, Sequence):
        raise TypeError(
            "received_rows must be a sequence of layers, each a sequence of per-rank row "
            f"counts, got {type(received_rows).__name__}"
        )
    num_layers = len(received_rows)
    if num_layers == 0:
        raise ValueError("received_rows (0 layers) must hold at least one layer")
    if num_layers > cfg.max_layers_per_slot:
        raise ValueError(
            f"received_rows ({num_layers} layers) must have at most "
            f"cfg.max_layers_per_slot ({cfg.max_layers_per_slot}) layers: one slot holds "
            "that many"
        )
    for layer, rows in enumerate(received_rows):
        if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
            raise TypeError(
                f"received_rows[{layer}] must be a sequence of per-rank row counts, got "
                f"{type(rows).__name__} ({rows!r})"
            )
    ep_size = len(received_rows[0])
    if ep_size == 0:
        raise ValueError("received_rows[0] (0 ranks) must hold one row count per rank")
    for layer, rows in enumerate(received_rows):
        if len(rows) != ep_size:
            raise ValueError(
                f"received_rows[{layer}] ({len(rows)} ranks) must have as many ranks as "
                f"received_rows[0] ({ep_size} ranks): every layer runs on the same EP group"
            )
    cfg.check_ep_size(ep_size)
    bound = cfg.receive_bound(ep_size, total=True)
    num_routes = ep_size * cfg.max_tokens * cfg.top_k
    for layer, rows in enumerate(received_rows):
        for rank, value in enumerate(rows):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(
                    f"received_rows[{layer}][{rank}] must be an int, got "
                    f"{type(value).__name__} ({value!r})"
                )
            if value < 0:
                raise ValueError(f"received_rows[{layer}][{rank}] ({value}) must be >= 0")
            if value > bound:
                raise ValueError(
                    f"received_rows[{layer}][{rank}] ({value}) must be <= the receive bound "
                    f"({bound} rows): scratch is sized for at most that many rows per rank "
                    "(raise device_scratch_factor or total_scratch_factor)"
                )
        if sum(rows) > num_routes:
            raise ValueError(
                f"received_rows[{layer}] sums to {sum(rows)} rows, which must be <= "
                f"ep_size * max_tokens * top_k ({num_routes}): no more routes exist "
                "(is the list indexed [layer][rank]?)"
            )
    return ep_size


def _check_capacity(capacity_bytes: int, num_layers: int, in_bytes: int) -> None:
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
        raise TypeError(
            f"capacity_bytes must be an int, got {type(capacity_bytes).__name__} "
            f"({capacity_bytes!r})"
        )
    minimum = num_layers * in_bytes
    if capacity_bytes < minimum:
        raise ValueError(
            f"capacity_bytes ({capacity_bytes}) must be >= the inputs-only minimum "
            f"({minimum} B = {num_layers} layers x {in_bytes} B input): every layer must at "
            "least keep its input for replay"
        )


# --------------------------------------------------------------------------- decisions
@dataclass(frozen=True, kw_only=True)
class SaveTrace:
    """Save/replay decisions of the layers of one slot, with the bytes behind them.

    Attributes (L layers, EP ranks):
        capacity_bytes: the slot capacity the decisions were made against.
        input_bytes: bytes a replayed layer keeps on every rank.
        received_rows: ``[L][EP]`` rows received per layer and rank.
        full_bytes: ``[L][EP]`` full-state bytes per layer and rank.
        required_bytes: ``[L]`` the tested figure ``max_r(saved_r + full_r(l)) +
            (L - 1 - l) * input_bytes`` of each layer.
        decisions: ``[L]`` True = save the full state, False = keep the input and replay.
        saved_bytes: ``[L][EP]`` bytes kept per rank after each layer's decision.
        kept: ``[L]`` what each layer keeps: ``"rows"`` (its gathered rows, h1, h3),
            ``"x"`` (its input x instead of the rows; ``cfg.save_gathered_rows`` False or
            ``"auto"``) or ``"input"`` (replayed).
        x_state_bytes: ``[L][EP]`` with ``save_gathered_rows="auto"``: the state with x
            kept instead of the rows, per layer and rank (``full_bytes`` is the state with
            the rows); None in the other modes.
    """

    capacity_bytes: int
    input_bytes: int
    received_rows: tuple[tuple[int, ...], ...]
    full_bytes: tuple[tuple[int, ...], ...]
    required_bytes: tuple[int, ...]
    decisions: tuple[bool, ...]
    saved_bytes: tuple[tuple[int, ...], ...]
    kept: tuple[str, ...] = ()
    x_state_bytes: tuple[tuple[int, ...], ...] | None = None

    @property
    def num_layers(self) -> int:
        return len(self.decisions)

    @property
    def num_ranks(self) -> int:
        return len(self.full_bytes[0])


def _decide(
    full: Sequence[Sequence[int]], in_bytes: int, capacity_bytes: int,
    x_state: Sequence[Sequence[int]] | None = None, saved: Sequence[int] | None = None,
) -> tuple[list[bool], list[int], list[tuple[int, ...]], list[bool]]:
    """Core greedy rule on plain integers: ``full[l][r]`` bytes, one input size. With
    ``x_state`` (``save_gathered_rows="auto"``; ``full`` is then the state with the rows) a
    layer that cannot keep its rows may keep x (:mod:`distmoe.kernels.movement.slot_cursor` states
    the rule; the device evaluates the same). Returns the decisions, the tested bytes
    ``max_r(saved_r + full_r(l)) + reserve``, the kept bytes after each layer and, per
    layer, whether it kept x instead of the rows (auto only; else all False). ``saved``: the
    bytes each rank keeps before the first layer (0)."""
    num_layers = len(full)
    saved = [0] * len(full[0]) if saved is None else list(saved)
    decisions, required, history, kept_x = [], [], [], []
    for layer, full_r in enumerate(full):
        later = num_layers - 1 - layer
        need = max(s + f for s, f in zip(saved, full_r, strict=True)) + later * in_bytes
        keep, as_x = need <= capacity_bytes, False
        if x_state is not None:
            x_r = x_state[layer]
            n = later + 1
            small = [max(in_bytes, min(f, x)) for f, x in zip(full_r, x_r, strict=True)]
            k = min(0 if capacity_bytes - s - n * in_bytes < 0
                    else min(n, (capacity_bytes - s - n * in_bytes) // (m - in_bytes))
                    if m > in_bytes else n for s, m in zip(saved, small, strict=True))
            rows_ahead = k >= 1 and all(
                s + f + (k - 1) * m + (n - k) * in_bytes <= capacity_bytes
                for s, f, m in zip(saved, full_r, small, strict=True))
            need_x = max(s + x for s, x in zip(saved, x_r, strict=True)) + later * in_bytes
            as_x = need_x <= capacity_bytes and need_x < need and not rows_ahead
            keep = as_x or need <= capacity_bytes
            full_r = x_r if as_x else full_r
        saved = [s + (f if keep else in_bytes) for s, f in zip(saved, full_r, strict=True)]
        decisions.append(keep)
        required.append(need)
        history.append(tuple(saved))
        kept_x.append(as_x)
    return decisions, required, history, kept_x


def trace_saves(
    cfg: MoEConfig, capacity_bytes: int, received_rows: Sequence[Sequence[int]]
) -> SaveTrace:
    """Like :func:`plan_saves`, returning the bytes behind every decision."""
    return _trace(cfg, capacity_bytes, received_rows, "trace_saves")


def _trace(
    cfg: MoEConfig, capacity_bytes: int, received_rows: Sequence[Sequence[int]], what: str
) -> SaveTrace:
    _check_training(cfg, what)
    ep_size = _check_received_rows(cfg, received_rows)
    in_bytes = input_bytes(cfg)
    _check_capacity(capacity_bytes, len(received_rows), in_bytes)
    full = [tuple(full_state_bytes(cfg, ep_size, r) for r in rows) for rows in received_rows]
    auto = cfg.save_gathered_rows == "auto"
    x_state = [tuple(kept_x_state_bytes(cfg, ep_size, r) for r in rows)
               for rows in received_rows] if auto else None
    decisions, required, history, as_x = _decide(full, in_bytes, capacity_bytes, x_state)
    assert all(max(s) <= capacity_bytes for s in history), "a rank exceeded the capacity"
    what_saves = "x" if cfg.save_gathered_rows is False else "rows"
    kept = tuple("input" if not d else "x" if a else what_saves
                 for d, a in zip(decisions, as_x, strict=True))
    return SaveTrace(
        capacity_bytes=capacity_bytes,
        input_bytes=in_bytes,
        received_rows=tuple(tuple(rows) for rows in received_rows),
        full_bytes=tuple(full),
        required_bytes=tuple(required),
        decisions=tuple(decisions),
        saved_bytes=tuple(history),
        kept=kept,
        x_state_bytes=None if x_state is None else tuple(x_state),
    )


def plan_saves(
    cfg: MoEConfig, capacity_bytes: int, received_rows: Sequence[Sequence[int]]
) -> list[bool]:
    """Decide, for every layer of one slot, whether to save its full state or replay it.

    Args:
        cfg: a training config (``cfg.training`` True).
        capacity_bytes: slot capacity in bytes, at least ``L * input_bytes``.
        received_rows: ``received_rows[layer][rank]`` rows each rank receives in each of
            the slot's L layers (``L <= cfg.max_layers_per_slot``); the number of ranks is
            the EP size, the same for every layer, each count ``<=`` the receive bound.

    Returns:
        One bool per layer, the same on every rank: True = save the full state, False =
        keep the input ``x [T, D]`` and replay the forward in backward. Layer l saves iff
        ``max_r(saved_r + full_r(l)) + (L - 1 - l) * input_bytes <= capacity_bytes``.
        With ``cfg.save_gathered_rows="auto"`` a saved layer may keep x instead of its
        rows (:mod:`distmoe.kernels.movement.slot_cursor` states the rule; :func:`trace_saves`'s
        ``kept`` says which). No rank's kept bytes ever exceed ``capacity_bytes``.

    Raises:
        ValueError: capacity below the inputs-only minimum, rows above the receive bound or
            negative, layers with different rank counts, an inference config.
    """
    return list(_trace(cfg, capacity_bytes, received_rows, "plan_saves").decisions)


def is_capacity_monotone(cfg: MoEConfig, received_rows: Sequence[Sequence[int]]) -> bool:
    """Whether raising the capacity can never turn a save into a replay for these rows.

    With ``f[l][r]`` the full-state bytes, ``i`` the input bytes, ``P[l][r] = sum_{j<l}
    f[j][r]`` (rank r's bytes when every earlier layer saved) and ``g(l) = max_r(P[l][r] +
    f[l][r]) + (L - 1 - l) * i`` (the capacity that saves layers 0..l), the condition is:

        for every layer l with ``g(l) > max_{j<l} g(j)`` (l can be the first replay) and
        every later layer m: ``max_r(P[l][r] + f[m][r]) >= max_r(P[l][r] + f[l][r])``.

    In words: after any all-saved prefix, no later layer is cheaper on the worst rank than
    the first layer that did not fit. Then every capacity's decisions are a run of saves
    followed only by replays, the run growing with the capacity, so the rule is monotone.

    The condition is sufficient. It is also necessary when every full state is larger than
    the input (true whenever every rank receives at least one row in every layer): a layer
    m that violates it after layer l saves at a capacity just below ``g(l)`` (l replays) and
    replays at ``g(l)`` (l saves). A simple sufficient special case: every rank's rows never
    decrease from one layer to the next (for instance identical rows in every layer).
    """
    _check_training(cfg, "is_capacity_monotone")
    if cfg.save_gathered_rows == "auto":
        raise ValueError("is_capacity_monotone: the condition covers rules with one saved "
                         "state per layer; cfg.save_gathered_rows is 'auto' (two); scan the "
                         "capacities with trace_saves instead")
    ep_size = _check_received_rows(cfg, received_rows)
    full = [[full_state_bytes(cfg, ep_size, r) for r in rows] for rows in received_rows]
    return _capacity_monotone(full, input_bytes(cfg))


def _capacity_monotone(full: Sequence[Sequence[int]], in_bytes: int) -> bool:
    num_layers, num_ranks = len(full), len(full[0])
    prefix = [0] * num_ranks
    best_before = -math.inf
    for layer in range(num_layers):
        worst = max(p + f for p, f in zip(prefix, full[layer], strict=True))
        g = worst + (num_layers - 1 - layer) * in_bytes
        if g > best_before:
            for later in range(layer + 1, num_layers):
                if max(p + f for p, f in zip(prefix, full[later], strict=True)) < worst:
                    return False
        best_before = max(best_before, g)
        prefix = [p + f for p, f in zip(prefix, full[layer], strict=True)]
    return True


# --------------------------------------------------------------------------- the plan
@dataclass(frozen=True, kw_only=True)
class Region:
    """One region of the activation virtual range.

    Attributes:
        name: ``"slot 0"`` ..., ``"host scratch"``, ``"device scratch"``.
        offset_bytes: byte offset from the range's base.
        num_bytes: region size.
        tier: ``"device"`` (HBM) or ``"host"`` (pinned host pages mapped through VMM).
    """

    name: str
    offset_bytes: int
    num_bytes: int
    tier: Literal["device", "host"]


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """Activation-memory plan of one layer configuration on an EP group (per rank).

    Attributes:
        cfg: the configuration.
        ep_size: EP ranks.
        num_local_experts: E_local = E / EP.
        balanced_rows: R at balanced routing, ``T * K``.
        device_receive_bound: rows per rank executable from device scratch.
        receive_bound: rows per rank executable at all (device + host tier).
        input_bytes: bytes a replayed layer keeps (``align128(T*D*2)``; 0 for inference).
        min_slot_bytes: ``L * input_bytes``, the smallest valid slot.
        balanced_slot_bytes: ``L * full(T*K)``, the slot of activation factor 1.
        useful_max_slot_bytes: ``L * full(receive_bound)``; a larger slot keeps nothing more.
        slot_capacity_bytes: bytes of one slot (see the module docstring).
        scratch_bytes: device-tier scratch, the peak at ``device_receive_bound``.
        host_scratch_bytes: host-backed (VMM) scratch, the peak at ``receive_bound`` minus
            ``scratch_bytes``; 0 without ``total_scratch_factor``.
        balanced_costs / device_bound_costs / bound_costs: per-layer costs at
            ``balanced_rows``, ``device_receive_bound`` and ``receive_bound`` rows.
        saves: save/replay decisions for given received rows, or None.
    """

    cfg: MoEConfig
    ep_size: int
    num_local_experts: int
    balanced_rows: int
    device_receive_bound: int
    receive_bound: int
    input_bytes: int
    min_slot_bytes: int
    balanced_slot_bytes: int
    useful_max_slot_bytes: int
    slot_capacity_bytes: int
    scratch_bytes: int
    host_scratch_bytes: int
    balanced_costs: LayerCosts
    device_bound_costs: LayerCosts
    bound_costs: LayerCosts
    saves: SaveTrace | None = None

    # ----------------------------------------------------------------- derived numbers
    @property
    def num_slots(self) -> int:
        return self.cfg.num_slots

    @property
    def layers_per_slot(self) -> int:
        return self.cfg.max_layers_per_slot

    @property
    def slots_bytes(self) -> int:
        """``num_slots * slot_capacity_bytes``."""
        return self.num_slots * self.slot_capacity_bytes

    @property
    def activation_buffer_bytes(self) -> int:
        """Device allocation: ``num_slots * slot_capacity_bytes + scratch_bytes``."""
        return self.slots_bytes + self.scratch_bytes

    @property
    def total_scratch_bytes(self) -> int:
        """``scratch_bytes + host_scratch_bytes``, the peak at ``receive_bound``."""
        return self.scratch_bytes + self.host_scratch_bytes

    @property
    def virtual_range_bytes(self) -> int:
        """Whole virtual range: the activation buffer plus the host-backed scratch."""
        return self.activation_buffer_bytes + self.host_scratch_bytes

    @property
    def regions(self) -> tuple[Region, ...]:
        """Slots from offset 0 (none when they hold 0 bytes, as in inference), then host
        scratch (when there is any), then device scratch at the high end."""
        out = [
            Region(
                name=f"slot {s}",
                offset_bytes=s * self.slot_capacity_bytes,
                num_bytes=self.slot_capacity_bytes,
                tier="device",
            )
            for s in range(self.num_slots if self.slot_capacity_bytes else 0)
        ]
        offset = self.slots_bytes
        if self.host_scratch_bytes:
            out.append(
                Region(
                    name="host scratch",
                    offset_bytes=offset,
                    num_bytes=self.host_scratch_bytes,
                    tier="host",
                )
            )
            offset += self.host_scratch_bytes
        out.append(
            Region(
                name="device scratch",
                offset_bytes=offset,
                num_bytes=self.scratch_bytes,
                tier="device",
            )
        )
        return tuple(out)

    def full_state_bytes(self, rows: int) -> int:
        """Full-state bytes of one layer on a rank that received ``rows`` rows."""
        return layer_costs(self.cfg, self.ep_size, rows).full_state_bytes

    def layer_costs(self, rows: int) -> LayerCosts:
        """Tensor-by-tensor costs of one layer at ``rows`` received rows."""
        return layer_costs(self.cfg, self.ep_size, rows)

    def plan_saves(self, received_rows: Sequence[Sequence[int]]) -> list[bool]:
        """:func:`plan_saves` at this plan's slot capacity (checks the EP size)."""
        if received_rows and len(received_rows[0]) != self.ep_size:
            raise ValueError(
                f"received_rows[0] ({len(received_rows[0])} ranks) must have ep_size "
                f"({self.ep_size}) ranks"
            )
        return plan_saves(self.cfg, self.slot_capacity_bytes, received_rows)

    # ----------------------------------------------------------------- output
    def to_dict(self) -> dict:
        """Every number of the plan as JSON-ready builtins."""

        def costs(c: LayerCosts) -> dict:
            def rows_of(tensors: Sequence[TensorBytes]) -> list[dict]:
                return [
                    {"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "bytes": t.num_bytes}
                    for t in tensors
                ]

            out = {
                "rows": c.rows,
                "padded_rows": c.padded_rows,
                "input_bytes": c.input_bytes,
                "full_state_bytes": c.full_state_bytes,
                "forward_scratch_bytes": c.forward_scratch.peak_bytes,
                "backward_scratch_bytes": (
                    c.backward_scratch.peak_bytes if c.backward_scratch else None
                ),
                "scratch_bytes": c.scratch_bytes,
                "input": rows_of(c.input),
                "full_state": rows_of(c.full_state),
                "forward_scratch": rows_of(c.forward_scratch.tensors()),
            }
            if c.backward_scratch is not None:
                out["backward_scratch_resident"] = rows_of(c.backward_scratch.resident)
                out["backward_scratch_phases"] = [rows_of(p) for p in c.backward_scratch.phases]
            return out

        data = {
            "config": dataclasses.asdict(self.cfg),
            "ep_size": self.ep_size,
            "num_local_experts": self.num_local_experts,
            "balanced_rows": self.balanced_rows,
            "device_receive_bound": self.device_receive_bound,
            "receive_bound": self.receive_bound,
            "num_slots": self.num_slots,
            "layers_per_slot": self.layers_per_slot,
            "input_bytes": self.input_bytes,
            "min_slot_bytes": self.min_slot_bytes,
            "balanced_slot_bytes": self.balanced_slot_bytes,
            "useful_max_slot_bytes": self.useful_max_slot_bytes,
            "slot_capacity_bytes": self.slot_capacity_bytes,
            "scratch_bytes": self.scratch_bytes,
            "host_scratch_bytes": self.host_scratch_bytes,
            "total_scratch_bytes": self.total_scratch_bytes,
            "activation_buffer_bytes": self.activation_buffer_bytes,
            "virtual_range_bytes": self.virtual_range_bytes,
            "regions": [dataclasses.asdict(r) for r in self.regions],
            "costs": {
                "balanced": costs(self.balanced_costs),
                "device_bound": costs(self.device_bound_costs),
                "bound": costs(self.bound_costs),
            },
            "saves": None,
        }
        if self.saves is not None:
            s = self.saves
            data["saves"] = {
                "capacity_bytes": s.capacity_bytes,
                "input_bytes": s.input_bytes,
                "received_rows": [list(r) for r in s.received_rows],
                "full_bytes": [list(r) for r in s.full_bytes],
                "required_bytes": list(s.required_bytes),
                "decisions": list(s.decisions),
                "saved_bytes": [list(r) for r in s.saved_bytes],
                "kept": list(s.kept),
                "x_state_bytes": (None if s.x_state_bytes is None
                                  else [list(r) for r in s.x_state_bytes]),
            }
        json.dumps(data)  # fail here, not in the caller, if something is not serialisable
        return data

    def __str__(self) -> str:
        cfg = self.cfg
        mode = "training" if cfg.training else "inference"
        lines = [
            f"distmoe memory plan: {cfg.precision} {mode}, EP {self.ep_size}, "
            f"T {cfg.max_tokens}, D {cfg.hidden}, F {cfg.ffn}, "
            f"E {cfg.num_experts} ({self.num_local_experts} per rank), K {cfg.top_k}",
            f"rows per rank: balanced T*K = {self.balanced_rows:,}; device receive bound "
            f"{self.device_receive_bound:,} (device_scratch_factor {cfg.device_scratch_factor:g})"
            + (
                f"; total receive bound {self.receive_bound:,} "
                f"(total_scratch_factor {cfg.total_scratch_factor:g})"
                if cfg.total_scratch_factor is not None
                else ""
            ),
            "",
        ]
        lines += self._regions_table()
        lines.append("")
        lines += self._capacity_table()
        lines.append("")
        lines += self._costs_table()
        if self.saves is not None:
            lines.append("")
            lines += format_saves(self.saves)
        return "\n".join(lines)

    def _regions_table(self) -> list[str]:
        head = f"  {'region':<28}{'tier':<8}{'offset':>16}{'bytes':>18}{'size':>12}"
        lines = ["Regions (offsets from the base of the activation range)", head]
        for r in self.regions:
            label = r.name
            if r.name.startswith("slot"):
                label += f" ({self.layers_per_slot} layer{'s' * (self.layers_per_slot > 1)})"
            elif r.tier == "host":
                label += " (VMM)"
            lines.append(
                f"  {label:<28}{r.tier:<8}{r.offset_bytes:>16,}{r.num_bytes:>18,}"
                f"{format_bytes(r.num_bytes):>12}"
            )
        lines.append(
            f"  {'activation buffer (device)':<28}{'':<8}{'':>16}"
            f"{self.activation_buffer_bytes:>18,}{format_bytes(self.activation_buffer_bytes):>12}"
        )
        if self.host_scratch_bytes:
            lines.append(
                f"  {'virtual range (with host)':<28}{'':<8}{'':>16}"
                f"{self.virtual_range_bytes:>18,}{format_bytes(self.virtual_range_bytes):>12}"
            )
        if self.slot_capacity_bytes:
            lines.append(
                f"  = {self.num_slots} slot{'s' * (self.num_slots > 1)} x "
                f"{self.slot_capacity_bytes:,} B + device scratch {self.scratch_bytes:,} B"
            )
        else:
            lines.append(
                f"  = device scratch {self.scratch_bytes:,} B (no slots: nothing is saved)"
            )
        return lines

    def _capacity_table(self) -> list[str]:
        cfg = self.cfg
        if not cfg.training:
            return ["Slot capacity: 0 B (inference keeps no state for backward)"]
        n = self.layers_per_slot
        if cfg.activation_bytes is not None:
            chosen = f"exact cap activation_bytes {cfg.activation_bytes:,} B"
        else:
            chosen = f"activation_factor {cfg.activation_factor:g}"
        rows = [
            ("inputs-only minimum", f"{n} x input", self.min_slot_bytes),
            (
                "balanced full save",
                f"{n} x full(R={self.balanced_rows:,})",
                self.balanced_slot_bytes,
            ),
            ("useful maximum", f"{n} x full(R={self.receive_bound:,})", self.useful_max_slot_bytes),
            ("chosen capacity", chosen, self.slot_capacity_bytes),
        ]
        lines = [f"Slot capacity (one slot, {n} layer{'s' * (n > 1)})"]
        for name, how, value in rows:
            lines.append(f"  {name:<22}{how:<34}{value:>18,}{format_bytes(value):>12}")
        if self.slot_capacity_bytes > self.useful_max_slot_bytes:
            lines.append(
                "  note: the capacity exceeds the useful maximum; the excess can never be used"
            )
        return lines

    def _costs_table(self) -> list[str]:
        columns = [("balanced", self.balanced_costs), ("device bound", self.device_bound_costs)]
        if self.receive_bound != self.device_receive_bound:
            columns.append(("total bound", self.bound_costs))
        head = f"  {'per layer, one rank':<26}" + "".join(
            f"{f'{name} R={c.rows:,}':>28}" for name, c in columns
        )
        lines = ["Per-layer costs", head]

        def row(label: str, values: list[int | None]) -> str:
            cells = "".join(
                f"{'-':>28}" if v is None else f"{f'{v:,} ({format_bytes(v)})':>28}" for v in values
            )
            return f"  {label:<26}{cells}"

        cs = [c for _, c in columns]
        if self.cfg.training:
            lines.append(row("replay input", [c.input_bytes for c in cs]))
            lines.append(row("full state", [c.full_state_bytes for c in cs]))
        lines.append(row("forward scratch peak", [c.forward_scratch.peak_bytes for c in cs]))
        if self.cfg.training:
            lines.append(row("backward replay peak", [c.backward_scratch.peak_bytes for c in cs]))
        if cs[0].padded_rows != cs[0].rows:
            lines.append(
                "  (block-scaled rows padded per expert, worst case: "
                + ", ".join(f"{c.rows:,} -> {c.padded_rows:,}" for c in cs)
                + ")"
            )
        return lines


def format_breakdown(costs: LayerCosts) -> str:
    """Tensor-by-tensor table of one layer's costs (name, shape, dtype, bytes)."""
    lines = [f"Per-layer tensors at R = {costs.rows:,} (padded {costs.padded_rows:,})"]

    def block(title: str, tensors: Sequence[TensorBytes], total: int, depth: int = 1) -> None:
        pad = "  " * depth
        lines.append(f"{pad}{title}: {total:,} B ({format_bytes(total)})")
        for t in tensors:
            name = pad + "  " + t.name
            lines.append(
                f"{name:<30}{_shape(t.shape):<20}{t.dtype:<8}{t.num_bytes:>16,}"
                f"{format_bytes(t.num_bytes):>12}"
            )

    if costs.input:
        block("replay input", costs.input, costs.input_bytes)
    if costs.full_state:
        block("full state", costs.full_state, costs.full_state_bytes)
    fwd = costs.forward_scratch
    block("forward scratch (all resident)", fwd.resident, fwd.peak_bytes)
    bwd = costs.backward_scratch
    if bwd is not None:
        lines.append(
            f"  backward replay scratch: peak {bwd.peak_bytes:,} B ({format_bytes(bwd.peak_bytes)})"
            " = resident + largest phase of the shared interval"
        )
        block("resident", bwd.resident, sum(t.num_bytes for t in bwd.resident), 2)
        for i, phase in enumerate(bwd.phases):
            block(f"shared interval, phase {i}", phase, sum(t.num_bytes for t in phase), 2)
    return "\n".join(lines)


def format_saves(trace: SaveTrace) -> list[str]:
    """Lines of a save/replay table: per layer the rows, the tested bytes and the choice."""
    n = trace.num_layers
    lines = [
        f"Save/replay decisions ({n} layer{'s' * (n > 1)}, {trace.num_ranks} "
        f"rank{'s' * (trace.num_ranks > 1)}, capacity "
        f"{trace.capacity_bytes:,} B = {format_bytes(trace.capacity_bytes)}, input "
        f"{format_bytes(trace.input_bytes)})",
        f"  {'layer':<7}{'rows min..max':<22}{'worst full':>14}{'required':>18}"
        f"{'kept, worst rank':>20}  decision",
    ]
    auto = trace.x_state_bytes is not None
    for layer in range(n):
        rows = trace.received_rows[layer]
        worst_full = max(trace.full_bytes[layer])
        need = trace.required_bytes[layer]
        kept = max(trace.saved_bytes[layer])
        decision = {"rows": "save", "x": "save, keep x",
                    "input": "replay (keep input)"}[trace.kept[layer]]
        lines.append(
            f"  L{layer:<6}{f'{min(rows):,}..{max(rows):,}':<22}{format_bytes(worst_full):>14}"
            f"{format_bytes(need):>18}{format_bytes(kept):>20}  {decision}"
        )
    lines.append(
        "  required = max over ranks (kept + full state) + inputs reserved for later layers;"
        " save iff required <= capacity"
    )
    if auto:
        lines.append(
            "  save_gathered_rows='auto': a layer keeps its rows if, with the later layers' "
            "rows taken to be its own, as many layers can keep a state as if all kept the "
            "smaller one; else x (regathered in backward) if that fits and is smaller"
        )
        return lines
    monotone = _capacity_monotone(trace.full_bytes, trace.input_bytes)
    lines.append(
        "  for these rows, raising the capacity "
        + ("never turns" if monotone else "can turn")
        + f" a save into a replay (is_capacity_monotone: {monotone})"
    )
    return lines


# --------------------------------------------------------------------------- entry point
def keeps_state_in_slots(cfg: MoEConfig) -> bool:
    """Whether a training context's layers keep their saved state in the activation slots.
    bf16 layers do. The FP8 training layers keep theirs in per-call tensors until their slots
    exist (issue 58): their contexts allocate the plan's scratch only, not slots they would
    leave empty (at the example's full size, 9 GiB)."""
    return cfg.training and cfg.precision == "bf16"


def plan_memory(
    cfg: MoEConfig,
    ep_size: int,
    *,
    received_rows: Sequence[Sequence[int]] | None = None,
) -> MemoryPlan:
    """Plan the activation memory of ``cfg`` on ``ep_size`` ranks (pure, CPU only).

    Args:
        cfg: the layer configuration (capacities come from its activation and scratch
            fields, the slot count from ``num_slots`` and ``max_layers_per_slot``).
        ep_size: ranks in the EP group; ``num_experts`` must be divisible by it.
        received_rows: optional ``[layer][rank]`` received rows of one slot's layers; the
            plan then carries their save/replay decisions (training only).

    Returns:
        A frozen :class:`MemoryPlan`; ``str(plan)`` is a readable table.

    Raises:
        ValueError: bad ``ep_size``, ``cfg.activation_bytes`` below the inputs-only minimum,
            bad ``received_rows`` (see :func:`plan_saves`).
    """
    if not isinstance(cfg, MoEConfig):
        raise TypeError(f"cfg must be a MoEConfig, got {type(cfg).__name__}")
    num_local_experts = cfg.experts_per_rank(ep_size)  # validates ep_size
    num_layers = cfg.max_layers_per_slot
    balanced = layer_costs(cfg, ep_size, cfg.balanced_rows)
    device_bound = cfg.receive_bound(ep_size)
    bound = cfg.receive_bound(ep_size, total=True)
    at_device_bound = layer_costs(cfg, ep_size, device_bound)
    at_bound = layer_costs(cfg, ep_size, bound)

    in_bytes = balanced.input_bytes
    min_slot = num_layers * in_bytes
    balanced_slot = num_layers * balanced.full_state_bytes
    useful_max = num_layers * at_bound.full_state_bytes
    if not cfg.training:
        capacity = 0
    elif cfg.activation_bytes is not None:
        if cfg.activation_bytes < min_slot:
            raise ValueError(
                f"activation_bytes ({cfg.activation_bytes}) must be >= the inputs-only "
                f"minimum ({min_slot} B = {num_layers} layers x {in_bytes} B input)"
            )
        capacity = cfg.activation_bytes // 128 * 128
    else:
        extra = math.ceil(cfg.activation_factor * (balanced_slot - min_slot))
        capacity = align128(min_slot + extra)

    saves = None
    if received_rows is not None:
        _check_training(cfg, "plan_memory(received_rows=...)")
        _check_received_rows(cfg, received_rows)  # its types first, then the EP size
        if len(received_rows[0]) != ep_size:
            raise ValueError(
                f"received_rows[0] ({len(received_rows[0])} ranks) must have ep_size "
                f"({ep_size}) ranks"
            )
        saves = trace_saves(cfg, capacity, received_rows)

    scratch = at_device_bound.scratch_bytes
    return MemoryPlan(
        cfg=cfg,
        ep_size=ep_size,
        num_local_experts=num_local_experts,
        balanced_rows=cfg.balanced_rows,
        device_receive_bound=device_bound,
        receive_bound=bound,
        input_bytes=in_bytes,
        min_slot_bytes=min_slot,
        balanced_slot_bytes=balanced_slot,
        useful_max_slot_bytes=useful_max,
        slot_capacity_bytes=capacity,
        scratch_bytes=scratch,
        host_scratch_bytes=at_bound.scratch_bytes - scratch,
        balanced_costs=balanced,
        device_bound_costs=at_device_bound,
        bound_costs=at_bound,
        saves=saves,
    )
