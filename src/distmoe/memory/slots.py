"""Activation slots for pipeline schedules: lifetimes, slot assignment, a 1F1B generator.

A slot holds the saved state of one owner from its forward until its terminal backward.
An owner is either a stage-microbatch (one local pipeline stage of one microbatch) or a
whole microbatch (all local stages of that microbatch). With split backward the input
gradient (B) and the weight gradient (W) are separate actions and the state lives until W.

Times are action indices in one rank's schedule. A lifetime ``(start, end)`` occupies its
slot for actions ``start`` through ``end`` inclusive; after action ``end`` completes the
slot is free, so an owner whose forward is at index ``end + 1`` or later may take it.

:func:`assign_slots` gives each lifetime, in order of start, the lowest slot whose previous
owner has finished. On intervals this greedy colouring uses exactly as many slots as the
peak number of owners alive at once. The framework that owns the schedule runs it once on
the finalised lifetimes and hands each forward its slot id; the backward reuses the id its
forward saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

ActionKind = Literal["F", "B", "W"]


@dataclass(frozen=True, kw_only=True)
class SlotAssignment:
    """Result of :func:`assign_slots`.

    Attributes:
        slot_ids: slot of each lifetime, in the order the lifetimes were given.
        num_live_peak: most lifetimes alive at one action; equals the number of slots used.
    """

    slot_ids: tuple[int, ...]
    num_live_peak: int

    @property
    def num_slots(self) -> int:
        """Distinct slots used (``max(slot_ids) + 1``; 0 for no lifetimes)."""
        return max(self.slot_ids, default=-1) + 1


def _check_lifetimes(lifetimes: Sequence[tuple[int, int]]) -> None:
    for i, item in enumerate(lifetimes):
        if len(item) != 2:
            raise ValueError(f"lifetimes[{i}] ({item!r}) must be a (start, end) pair")
        start, end = item
        for name, value in (("start", start), ("end", end)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"lifetimes[{i}] {name} must be an int, got {type(value).__name__}")
        if start < 0 or end < start:
            raise ValueError(f"lifetimes[{i}] ({start}, {end}) must satisfy 0 <= start <= end")


def live_counts(lifetimes: Sequence[tuple[int, int]]) -> list[int]:
    """Number of lifetimes alive after each action ``0 .. max end`` (inclusive bounds)."""
    _check_lifetimes(lifetimes)
    horizon = max((end for _, end in lifetimes), default=-1) + 1
    delta = [0] * (horizon + 1)
    for start, end in lifetimes:
        delta[start] += 1
        delta[end + 1] -= 1
    counts, running = [], 0
    for t in range(horizon):
        running += delta[t]
        counts.append(running)
    return counts


def assign_slots(lifetimes: Sequence[tuple[int, int]]) -> SlotAssignment:
    """Give every lifetime the lowest slot whose previous owner has finished.

    Args:
        lifetimes: ``(start, end)`` action indices, ``0 <= start <= end``; the owner holds
            its slot through action ``end`` inclusive.

    Returns:
        :class:`SlotAssignment` with one slot id per lifetime (input order) and the peak
        live count. Lifetimes are visited by ``start`` (ties in input order), so a slot
        freed at ``end`` can be taken by a lifetime starting at ``end + 1``.
    """
    _check_lifetimes(lifetimes)
    slot_end: list[int] = []  # end of the current owner of each slot
    slot_ids = [0] * len(lifetimes)
    for i in sorted(range(len(lifetimes)), key=lambda j: lifetimes[j][0]):
        start, end = lifetimes[i]
        free = [s for s, last in enumerate(slot_end) if last < start]
        if free:
            slot = free[0]
            slot_end[slot] = end
        else:
            slot = len(slot_end)
            slot_end.append(end)
        slot_ids[i] = slot
    peak = max(live_counts(lifetimes), default=0)
    assert len(slot_end) == peak, f"greedy used {len(slot_end)} slots for peak {peak}"
    return SlotAssignment(slot_ids=tuple(slot_ids), num_live_peak=peak)


# --------------------------------------------------------------------------- schedules
class Action(NamedTuple):
    """One pipeline action: ``kind`` F (forward), B (backward, or input gradient with split
    backward) or W (weight gradient), on virtual ``stage`` for ``microbatch``. ``str`` gives
    the short form ``"2B0"`` (stage 2, backward, microbatch 0)."""

    kind: ActionKind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def interleaved_1f1b(
    *,
    num_ranks: int,
    num_chunks: int,
    num_microbatches: int,
    rank: int,
    split_backward: bool = False,
    weight_delay: int = 1,
) -> list[Action]:
    """Actions of one rank in an interleaved one-forward-one-backward pipeline schedule.

    Rank ``rank`` of ``num_ranks`` owns the virtual stages ``rank + c * num_ranks`` for
    ``c < num_chunks`` (rank 0 of 2 with 2 chunks owns stages 0 and 2). The order follows
    Megatron-LM's interleaved schedule: ``(num_ranks - rank - 1) * 2 + (num_chunks - 1) *
    num_ranks`` warm-up forwards, then alternating forward / backward, then the remaining
    backwards. Forward number k runs chunk ``(k // num_ranks) % num_chunks`` and backward
    number k chunk ``num_chunks - 1 - (k // num_ranks) % num_chunks``, both for microbatch
    ``(k // (num_ranks * num_chunks)) * num_ranks + k % num_ranks``.

    With ``split_backward`` each B (input gradient) is followed by the W (weight gradient)
    of the backward issued ``weight_delay`` B actions earlier; the rest are flushed at the
    end, so saved state lives past its B.
    """
    for name, value in (
        ("num_ranks", num_ranks),
        ("num_chunks", num_chunks),
        ("num_microbatches", num_microbatches),
    ):
        if value < 1:
            raise ValueError(f"{name} ({value}) must be >= 1")
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank ({rank}) must be in [0, num_ranks ({num_ranks}))")
    if num_microbatches % num_ranks:
        raise ValueError(
            f"num_microbatches ({num_microbatches}) must be divisible by num_ranks "
            f"({num_ranks}) for the interleaved schedule"
        )
    if weight_delay < 0:
        raise ValueError(f"weight_delay ({weight_delay}) must be >= 0")
    total = num_microbatches * num_chunks
    group = num_ranks * num_chunks

    def microbatch(k: int) -> int:
        return (k // group) * num_ranks + k % num_ranks

    def forward(k: int) -> Action:
        chunk = (k // num_ranks) % num_chunks
        return Action("F", rank + chunk * num_ranks, microbatch(k))

    def backward(k: int) -> Action:
        chunk = num_chunks - 1 - (k // num_ranks) % num_chunks
        return Action("B", rank + chunk * num_ranks, microbatch(k))

    if num_chunks == 1:
        num_warmup = min(num_ranks - rank - 1, total)
    else:
        num_warmup = min((num_ranks - rank - 1) * 2 + (num_chunks - 1) * num_ranks, total)
    order = [forward(k) for k in range(num_warmup)]
    for k in range(total - num_warmup):
        order.append(forward(num_warmup + k))
        order.append(backward(k))
    order.extend(backward(k) for k in range(total - num_warmup, total))
    if not split_backward:
        return order

    actions: list[Action] = []
    pending: list[Action] = []
    for action in order:
        actions.append(action)
        if action.kind == "B":
            pending.append(Action("W", action.stage, action.microbatch))
            if len(pending) > weight_delay:
                actions.append(pending.pop(0))
    actions.extend(pending)
    return actions


def stage_lifetimes(actions: Sequence[Action]) -> dict[tuple[int, int], tuple[int, int]]:
    """Lifetime of each (stage, microbatch): its F index to its terminal backward index
    (the W when the schedule has one for it, else the B)."""
    start: dict[tuple[int, int], int] = {}
    end: dict[tuple[int, int], int] = {}
    for i, action in enumerate(actions):
        key = (action.stage, action.microbatch)
        if action.kind == "F":
            start[key] = i
        elif action.kind == "W" or key not in end or actions[end[key]].kind != "W":
            end[key] = i
    missing = sorted(set(start) ^ set(end))
    if missing:
        raise ValueError(f"actions lack a forward or a backward for (stage, microbatch) {missing}")
    return {key: (start[key], end[key]) for key in start}


def microbatch_lifetimes(actions: Sequence[Action]) -> dict[int, tuple[int, int]]:
    """Lifetime of each whole microbatch: first local forward to last terminal backward."""
    spans: dict[int, tuple[int, int]] = {}
    for (_, mb), (start, end) in stage_lifetimes(actions).items():
        lo, hi = spans.get(mb, (start, end))
        spans[mb] = (min(lo, start), max(hi, end))
    return spans
