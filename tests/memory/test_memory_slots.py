"""Slot assignment over pipeline lifetimes, on an interleaved 1F1B schedule."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distmoe.memory import (
    assign_slots,
    interleaved_1f1b,
    live_counts,
    microbatch_lifetimes,
    stage_lifetimes,
)

PROPS = settings(max_examples=150, deadline=None, derandomize=True)

# Rank 0 of 2 with two chunks owns virtual stages 0 and 2 (of 4); 4 microbatches.
SCHEDULE = ("0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3").split()
SPLIT_SCHEDULE = (
    "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2W0 2F2 0B0 2W1 2F3 0B1 0W0 2B2 0W1 2B3 2W2 0B2 2W3 "
    "0B3 0W2 0W3"
).split()


def rank0(split_backward: bool = False, num_microbatches: int = 4):
    return interleaved_1f1b(
        num_ranks=2,
        num_chunks=2,
        num_microbatches=num_microbatches,
        rank=0,
        split_backward=split_backward,
    )


def _sorted_lifetimes(actions):
    spans = stage_lifetimes(actions)
    keys = sorted(spans, key=lambda key: spans[key][0])
    return keys, [spans[key] for key in keys]


def test_schedule_order():
    assert [str(a) for a in rank0()] == SCHEDULE
    assert [str(a) for a in rank0(split_backward=True)] == SPLIT_SCHEDULE
    # the 32-action schedule: 8 microbatches x 2 local stages x (F + B)
    long = rank0(num_microbatches=8)
    assert len(long) == 32
    assert {a.stage for a in long} == {0, 2}


def test_stage_microbatch_slots():
    keys, spans = _sorted_lifetimes(rank0())
    assert keys == [(0, 0), (0, 1), (2, 0), (2, 1), (0, 2), (0, 3), (2, 2), (2, 3)]
    assert spans == [(0, 9), (1, 11), (2, 5), (3, 7), (4, 14), (6, 15), (8, 12), (10, 13)]
    result = assign_slots(spans)
    # 2F0's slot (2) frees after 2B0 at 5, so 0F3 (at 6) takes it; 2F2 takes 2F1's slot 3;
    # 2F3 (at 10) takes slot 0 after 0B0 (at 9)
    assert result.slot_ids == (0, 1, 2, 3, 4, 2, 3, 0)
    assert result.num_live_peak == result.num_slots == 5


def test_whole_microbatch_slots():
    spans = microbatch_lifetimes(rank0())
    assert spans == {0: (0, 9), 1: (1, 11), 2: (4, 14), 3: (6, 15)}
    result = assign_slots(list(spans.values()))
    assert result.slot_ids == (0, 1, 2, 3)
    assert result.num_live_peak == 4
    # a stage slot holds one stage's layers, a microbatch slot both local stages' layers:
    # five stage slots cost less than four microbatch slots despite the higher live count
    layers_per_stage = 3
    stage_peak = assign_slots(_sorted_lifetimes(rank0())[1]).num_live_peak
    assert stage_peak * layers_per_stage < result.num_live_peak * 2 * layers_per_stage


def test_split_backward_extends_lifetimes():
    keys, spans = _sorted_lifetimes(rank0(split_backward=True))
    assert keys == [(0, 0), (0, 1), (2, 0), (2, 1), (0, 2), (0, 3), (2, 2), (2, 3)]
    # state lives until the weight-backward action
    assert spans == [(0, 14), (1, 16), (2, 8), (3, 11), (4, 22), (6, 23), (9, 18), (12, 20)]
    result = assign_slots(spans)
    assert result.slot_ids == (0, 1, 2, 3, 4, 5, 2, 3)
    assert result.num_live_peak == 6
    whole = assign_slots(list(microbatch_lifetimes(rank0(split_backward=True)).values()))
    assert whole.slot_ids == (0, 1, 2, 3) and whole.num_live_peak == 4


@pytest.mark.parametrize("split_backward", [False, True])
@pytest.mark.parametrize(
    "num_ranks,num_chunks,num_microbatches",
    [(2, 2, 4), (2, 2, 8), (4, 2, 8), (3, 3, 6), (4, 1, 8), (1, 2, 3)],
)
def test_generated_schedules_are_complete(split_backward, num_ranks, num_chunks, num_microbatches):
    for rank in range(num_ranks):
        actions = interleaved_1f1b(
            num_ranks=num_ranks,
            num_chunks=num_chunks,
            num_microbatches=num_microbatches,
            rank=rank,
            split_backward=split_backward,
        )
        stages = {rank + c * num_ranks for c in range(num_chunks)}
        kinds = "FBW" if split_backward else "FB"
        expected = {(k, s, m) for k in kinds for s in stages for m in range(num_microbatches)}
        assert sorted(actions) == sorted(expected)  # each action exactly once
        index = {(a.kind, a.stage, a.microbatch): i for i, a in enumerate(actions)}
        for s in stages:
            for m in range(num_microbatches):
                assert index["F", s, m] < index["B", s, m]
                if split_backward:
                    assert index["B", s, m] < index["W", s, m]
        spans = list(stage_lifetimes(actions).values())
        result = assign_slots(spans)
        assert result.num_slots == result.num_live_peak == max(live_counts(spans))


def test_bad_lifetimes():
    with pytest.raises(ValueError, match=r"lifetimes\[1\] \(5, 3\) must satisfy 0 <= start <= end"):
        assign_slots([(0, 1), (5, 3)])
    with pytest.raises(ValueError, match=r"lifetimes\[0\] \(-1, 3\) must satisfy"):
        assign_slots([(-1, 3)])
    with pytest.raises(TypeError, match=r"lifetimes\[0\] start must be an int"):
        assign_slots([(0.5, 3)])
    with pytest.raises(
        ValueError,
        match=r"num_microbatches \(3\) must be divisible by "
        r"num_ranks \(2\)",
    ):
        interleaved_1f1b(num_ranks=2, num_chunks=2, num_microbatches=3, rank=0)
    assert assign_slots([]).slot_ids == () and assign_slots([]).num_live_peak == 0


@PROPS
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 12)), max_size=30))
def test_assignment_properties(pairs):
    lifetimes = [(start, start + length) for start, length in pairs]
    result = assign_slots(lifetimes)
    ids = result.slot_ids
    # owners of one slot never overlap (a slot frees after its owner's end action)
    for i, (si, ei) in enumerate(lifetimes):
        for j, (sj, ej) in enumerate(lifetimes):
            if i < j and ids[i] == ids[j]:
                assert ei < sj or ej < si
    # lowest free slot: every lower slot is held, at this start, by an overlapping owner
    for i, (start, _) in enumerate(lifetimes):
        for lower in range(ids[i]):
            assert any(
                ids[j] == lower and s <= start <= e for j, (s, e) in enumerate(lifetimes) if j != i
            )
    # the greedy uses exactly the peak number of live owners
    assert result.num_slots == result.num_live_peak == max(live_counts(lifetimes), default=0)
