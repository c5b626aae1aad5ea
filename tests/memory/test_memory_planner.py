"""Capacities, save/replay decisions, monotonicity in the capacity and the MemoryPlan."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distmoe.config import MoEConfig
from distmoe.memory import (
    align128,
    full_state_bytes,
    input_bytes,
    is_capacity_monotone,
    kept_x_state_bytes,
    layer_costs,
    plan_memory,
    plan_saves,
    trace_saves,
)

PROPS = settings(max_examples=120, deadline=None, derandomize=True)

# DESIGN.md worked example: EP=2, T=2, K=2, D=F=256, four layers in one slot.
WORKED_ROWS = [[4, 4], [4, 4], [5, 3], [5, 3]]


def worked_cfg(**kw) -> MoEConfig:
    base = dict(hidden=256, ffn=256, num_experts=4, top_k=2, max_tokens=2, max_layers_per_slot=4)
    base.update(kw)
    return MoEConfig(**base)


# --------------------------------------------------------------------------- worked example
def test_worked_example_28672():
    trace = trace_saves(worked_cfg(), 28_672, WORKED_ROWS)
    assert list(trace.decisions) == [True, True, True, False]
    assert plan_saves(worked_cfg(), 28_672, WORKED_ROWS) == [True, True, True, False]
    # L2's worst-rank candidate + reserve is 27,136 B; L3 would need 35,840 B
    assert trace.required_bytes == (11_264, 18_432, 27_136, 35_840)
    assert trace.saved_bytes[-1] == (26_112 + 1024, 23_040 + 1024)


def test_worked_example_24576():
    trace = trace_saves(worked_cfg(), 24_576, WORKED_ROWS)
    assert list(trace.decisions) == [True, True, False, False]
    # rank 1 alone would have fitted L2: 16,384 + 6,656 + 1,024 reserve = 24,064 <= 24,576
    assert trace.saved_bytes[1][1] + trace.full_bytes[2][1] + 1024 <= 24_576
    assert trace.required_bytes[2] == 27_136 > 24_576


# --------------------------------------------------------------------------- bad input
def test_capacity_below_minimum():
    with pytest.raises(
        ValueError,
        match=r"capacity_bytes \(1000\) must be >= the inputs-only "
        r"minimum \(4096 B = 4 layers x 1024 B input\)",
    ):
        plan_saves(worked_cfg(), 1000, WORKED_ROWS)
    with pytest.raises(TypeError, match="capacity_bytes must be an int"):
        plan_saves(worked_cfg(), 28672.0, WORKED_ROWS)


def test_rows_above_receive_bound():
    # receive bound: ceil(2.0 * T*K = 4) = 8, capped at EP*T*min(K, E_local) = 8
    with pytest.raises(
        ValueError,
        match=r"received_rows\[1\]\[0\] \(9\) must be <= the "
        r"receive bound \(8 rows\)",
    ):
        plan_saves(worked_cfg(), 28_672, [[4, 4], [9, 0]])
    cfg = worked_cfg(device_scratch_factor=1.0)
    with pytest.raises(
        ValueError,
        match=r"received_rows\[2\]\[0\] \(5\) must be <= the "
        r"receive bound \(4 rows\)",
    ):
        plan_saves(cfg, 28_672, WORKED_ROWS)


def test_mismatched_rank_counts():
    with pytest.raises(
        ValueError,
        match=r"received_rows\[2\] \(3 ranks\) must have as many "
        r"ranks as received_rows\[0\] \(2 ranks\)",
    ):
        plan_saves(worked_cfg(), 28_672, [[4, 4], [4, 4], [3, 3, 2]])


def test_other_bad_rows():
    cfg = worked_cfg()
    with pytest.raises(ValueError, match=r"received_rows\[0\]\[1\] \(-1\) must be >= 0"):
        plan_saves(cfg, 28_672, [[4, -1]])
    with pytest.raises(ValueError, match=r"received_rows \(0 layers\) must hold at least one"):
        plan_saves(cfg, 28_672, [])
    with pytest.raises(
        ValueError,
        match=r"received_rows \(5 layers\) must have at most "
        r"cfg.max_layers_per_slot \(4\)",
    ):
        plan_saves(cfg, 28_672, [[4, 4]] * 5)
    with pytest.raises(
        ValueError,
        match=r"received_rows\[0\] sums to 9 rows, which must be "
        r"<= ep_size \* max_tokens \* top_k \(8\)",
    ):
        plan_saves(cfg, 28_672, [[5, 4]])
    with pytest.raises(ValueError, match=r"num_experts \(4\) must be divisible by ep_size \(3\)"):
        plan_saves(cfg, 28_672, [[1, 1, 1]])
    with pytest.raises(TypeError, match=r"received_rows\[1\] must be a sequence of per-rank"):
        plan_saves(cfg, 28_672, [[4, 4], 8])
    with pytest.raises(TypeError, match=r"received_rows\[0\]\[0\] must be an int"):
        plan_saves(cfg, 28_672, [[4.0, 4]])


def test_inference_has_no_decisions():
    cfg = worked_cfg(training=False)
    with pytest.raises(ValueError, match=r"plan_saves needs a training config"):
        plan_saves(cfg, 28_672, WORKED_ROWS)
    with pytest.raises(ValueError, match=r"needs a training config"):
        plan_memory(cfg, 2, received_rows=WORKED_ROWS)


def test_non_positive_sizes():
    with pytest.raises(ValueError, match=r"hidden \(0\) must be >= 1"):
        worked_cfg(hidden=0)
    with pytest.raises(ValueError, match=r"ep_size \(0\) must be >= 1"):
        plan_memory(worked_cfg(), 0)
    with pytest.raises(
        ValueError,
        match=r"activation_bytes \(4000\) must be >= the "
        r"inputs-only minimum \(4096 B = 4 layers x 1024 B input\)",
    ):
        plan_memory(worked_cfg(activation_bytes=4000), 2)
    with pytest.raises(
        ValueError,
        match=r"received_rows\[0\] \(2 ranks\) must have ep_size "
        r"\(4\) ranks",
    ):
        plan_memory(worked_cfg(), 4, received_rows=WORKED_ROWS)
    with pytest.raises(TypeError, match=r"received_rows must be a sequence of layers, each a "
                                        r"sequence of per-rank row counts, got int"):
        plan_memory(worked_cfg(), 2, received_rows=5)


# --------------------------------------------------------------------------- capacities
def test_capacity_from_factor():
    cfg = worked_cfg()
    minimum, balanced = 4 * 1024, 4 * 8192
    assert plan_memory(worked_cfg(activation_factor=0.0), 2).slot_capacity_bytes == minimum
    assert plan_memory(cfg, 2).slot_capacity_bytes == balanced
    half = plan_memory(worked_cfg(activation_factor=0.5), 2)
    assert half.slot_capacity_bytes == align128(minimum + math.ceil(0.5 * (balanced - minimum)))
    third = plan_memory(worked_cfg(activation_factor=1 / 3), 2)
    assert third.slot_capacity_bytes % 128 == 0
    assert third.slot_capacity_bytes >= minimum + (balanced - minimum) / 3


def test_capacity_from_exact_bytes():
    plan = plan_memory(worked_cfg(activation_bytes=28_700), 2)
    # rounded down to 128: lossless, every saved size is a multiple of 128
    assert plan.slot_capacity_bytes == 28_672
    assert plan_saves(worked_cfg(), 28_700, WORKED_ROWS) == plan.plan_saves(WORKED_ROWS)


def test_plan_numbers_worked_shape():
    plan = plan_memory(worked_cfg(num_slots=3, activation_bytes=28_672), 2)
    assert plan.balanced_rows == 4
    assert plan.receive_bound == plan.device_receive_bound == 8
    assert plan.input_bytes == 1024
    assert plan.min_slot_bytes == 4096
    assert plan.balanced_slot_bytes == 4 * 8192
    assert plan.useful_max_slot_bytes == 4 * full_state_bytes(worked_cfg(), 2, 8) == 57_344
    # D <= F: 2R(D + 5F) at the receive bound R = 8
    assert plan.scratch_bytes == 2 * 8 * (256 + 5 * 256) == 24_576
    assert plan.host_scratch_bytes == 0
    assert plan.activation_buffer_bytes == 3 * 28_672 + 24_576
    assert plan.full_state_bytes(5) == 9728
    assert [(r.name, r.offset_bytes, r.num_bytes) for r in plan.regions] == [
        ("slot 0", 0, 28_672),
        ("slot 1", 28_672, 28_672),
        ("slot 2", 57_344, 28_672),
        ("device scratch", 86_016, 24_576),
    ]


def test_vmm_tier():
    cfg = MoEConfig(
        hidden=2048,
        ffn=768,
        num_experts=128,
        top_k=8,
        max_tokens=4096,
        device_scratch_factor=2.0,
        total_scratch_factor=4.0,
        num_slots=2,
        max_layers_per_slot=4,
        activation_factor=0.5,
    )
    plan = plan_memory(cfg, 8)
    assert plan.device_receive_bound == 65_536 and plan.receive_bound == 131_072
    device = layer_costs(cfg, 8, 65_536).scratch_bytes
    total = layer_costs(cfg, 8, 131_072).scratch_bytes
    assert plan.scratch_bytes == device
    assert plan.host_scratch_bytes == total - device > 0
    assert plan.activation_buffer_bytes == 2 * plan.slot_capacity_bytes + device
    assert plan.virtual_range_bytes == plan.activation_buffer_bytes + total - device
    # D > F: 4RD + 8RF at the device bound
    assert device == 4 * 65_536 * 2048 + 8 * 65_536 * 768
    regions = plan.regions
    assert [r.name for r in regions] == ["slot 0", "slot 1", "host scratch", "device scratch"]
    assert [r.tier for r in regions] == ["device", "device", "host", "device"]
    for a, b in zip(regions[:-1], regions[1:], strict=True):
        assert a.offset_bytes + a.num_bytes == b.offset_bytes
    assert regions[-1].offset_bytes + regions[-1].num_bytes == plan.virtual_range_bytes
    # the useful maximum uses the total (executable) receive bound
    assert plan.useful_max_slot_bytes == 4 * full_state_bytes(cfg, 8, 131_072)


def test_inference_plan():
    cfg = MoEConfig(
        hidden=2048,
        ffn=768,
        num_experts=128,
        top_k=8,
        max_tokens=4096,
        precision="nvfp4",
        training=False,
        num_slots=4,
    )
    plan = plan_memory(cfg, 8)
    assert plan.slot_capacity_bytes == plan.input_bytes == plan.min_slot_bytes == 0
    assert plan.activation_buffer_bytes == plan.scratch_bytes > 0
    assert [r.name for r in plan.regions] == ["device scratch"]
    assert "inference keeps no state" in str(plan)


def test_plan_table_and_json():
    plan = plan_memory(worked_cfg(activation_bytes=28_672), 2, received_rows=WORKED_ROWS)
    text = str(plan)
    for piece in (
        "slot 0 (4 layers)",
        "device scratch",
        "28,672",
        "28.00 KiB",
        "24,576",
        "inputs-only minimum",
        "useful maximum",
        "56.00 KiB",
        "backward replay peak",
        "replay (keep input)",
        "53,248",
        "52.00 KiB",
    ):
        assert piece in text, piece
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["activation_buffer_bytes"] == 28_672 + 24_576
    assert data["saves"]["decisions"] == [True, True, True, False]
    assert data["costs"]["balanced"]["full_state"][1] == {
        "name": "h1",
        "shape": [4, 512],
        "dtype": "bf16",
        "bytes": 4096,
    }


def test_plan_is_frozen():
    plan = plan_memory(worked_cfg(), 2)
    with pytest.raises(AttributeError):
        plan.slot_capacity_bytes = 0


# --------------------------------------------------------------------------- properties
@st.composite
def instances(draw, precision: str = "bf16", min_rows: int = 0):
    """A small config and received rows [layer][rank] that respect every rule, each count
    at least ``min_rows`` (0 or 1)."""
    unit = 8 if precision == "bf16" else 32
    d = unit * draw(st.integers(1, 4))
    f = unit * draw(st.integers(1, 4))
    ep = draw(st.integers(1, 4))
    num_local = draw(st.integers(1, 3))
    k = draw(st.integers(1, min(3, ep * num_local)))
    t = draw(st.integers(1, 6))
    layers = draw(st.integers(1, 5))
    cfg = MoEConfig(
        hidden=d,
        ffn=f,
        num_experts=ep * num_local,
        top_k=k,
        max_tokens=t,
        precision=precision,
        row_block=32,
        max_layers_per_slot=layers,
    )
    bound = cfg.receive_bound(ep, total=True)
    total = ep * t * k
    rows = []
    for _ in range(layers):
        layer = draw(st.lists(st.integers(min_rows, bound), min_size=ep, max_size=ep))
        while sum(layer) > total:  # trim the largest until the routes exist
            i = layer.index(max(layer))
            layer[i] -= min(layer[i] - min_rows, sum(layer) - total)
        rows.append(layer)
    return cfg, rows


def _capacity_range(cfg, rows):
    """Every capacity that can matter: the minimum up to an all-save budget, in 128 B steps
    (all byte sizes are multiples of 128, so decisions only change on those)."""
    ep = len(rows[0])
    low = len(rows) * input_bytes(cfg)
    high = max(sum(full_state_bytes(cfg, ep, layer[r]) for layer in rows) for r in range(ep))
    return range(low, high + 129, 128)


def _oracle(cfg, capacity, rows):
    """The rule written out again, rank by rank."""
    ep, num_layers = len(rows[0]), len(rows)
    i = input_bytes(cfg)
    saved = [0] * ep
    out = []
    for layer, per_rank in enumerate(rows):
        full = [full_state_bytes(cfg, ep, r) for r in per_rank]
        fits_everywhere = all(
            saved[r] + full[r] + (num_layers - 1 - layer) * i <= capacity for r in range(ep)
        )
        out.append(fits_everywhere)
        for r in range(ep):
            saved[r] += full[r] if fits_everywhere else i
    return out


@PROPS
@given(data=st.data(), precision=st.sampled_from(["bf16", "mxfp8"]))
def test_decisions_follow_the_rule_and_fit(data, precision):
    cfg, rows = data.draw(instances(precision))
    capacity = data.draw(st.sampled_from(_capacity_range(cfg, rows)))
    trace = trace_saves(cfg, capacity, rows)
    # one list for all ranks, equal to the rule evaluated rank by rank
    assert list(trace.decisions) == _oracle(cfg, capacity, rows)
    # no rank's kept bytes ever exceed the capacity, the later inputs' reserve included
    i = input_bytes(cfg)
    for layer, saved in enumerate(trace.saved_bytes):
        assert max(saved) + (len(rows) - 1 - layer) * i <= capacity
    # every rank computing from the same gathered rows agrees, whatever order ranks come in
    perm = data.draw(st.permutations(range(len(rows[0]))))
    shuffled = [[layer[p] for p in perm] for layer in rows]
    assert plan_saves(cfg, capacity, shuffled) == list(trace.decisions)


@PROPS
@given(data=st.data())
def test_extreme_capacities(data):
    cfg, rows = data.draw(instances())
    span = _capacity_range(cfg, rows)
    assert all(plan_saves(cfg, span[-1], rows))
    if all(r >= 1 for layer in rows for r in layer):  # full state > input on every rank
        assert not any(plan_saves(cfg, span[0], rows))


def _first_flip(cfg, rows):
    """(low, high, layer) with layer saved at capacity low and replayed at high > low, over
    every capacity that matters; None when raising the capacity never flips a save."""
    ep, num_layers, i = len(rows[0]), len(rows), input_bytes(cfg)
    full = [[full_state_bytes(cfg, ep, r) for r in layer] for layer in rows]
    saved_at: dict[int, int] = {}
    for capacity in _capacity_range(cfg, rows):
        kept = [0] * ep
        for layer in range(num_layers):
            reserve = (num_layers - 1 - layer) * i
            save = max(k + f for k, f in zip(kept, full[layer], strict=True)) + reserve <= capacity
            kept = [k + (f if save else i) for k, f in zip(kept, full[layer], strict=True)]
            if save:
                saved_at.setdefault(layer, capacity)
            elif layer in saved_at:
                return saved_at[layer], capacity, layer
    return None


@PROPS
@given(data=st.data(), precision=st.sampled_from(["bf16", "mxfp8"]))
def test_monotone_when_the_condition_holds(data, precision):
    cfg, rows = data.draw(instances(precision))
    if is_capacity_monotone(cfg, rows):
        assert _first_flip(cfg, rows) is None  # sufficient, zero-row ranks included


@PROPS
@given(data=st.data(), precision=st.sampled_from(["bf16", "mxfp8"]))
def test_monotone_exactly_when_the_condition_holds(data, precision):
    # with at least one row per rank and layer every full state outgrows the input, and the
    # condition is also necessary: it fails exactly when some capacity increase flips a save
    cfg, rows = data.draw(instances(precision, min_rows=1))
    assert is_capacity_monotone(cfg, rows) == (_first_flip(cfg, rows) is None)


@PROPS
@given(data=st.data())
def test_non_decreasing_rows_are_monotone(data):
    cfg, rows = data.draw(instances())
    # every rank's rows never decrease over the layers (a simple sufficient case): keep the
    # last layer, draw each earlier layer below the next one, rank by rank
    for layer in range(len(rows) - 2, -1, -1):
        rows[layer] = [data.draw(st.integers(0, r)) for r in rows[layer + 1]]
    assert is_capacity_monotone(cfg, rows)
    assert _first_flip(cfg, rows) is None


@PROPS
@given(data=st.data())
def test_first_difference_always_favours_the_larger_capacity(data):
    # what does hold in general: the decision lists are lexicographically ordered
    cfg, rows = data.draw(instances())
    span = _capacity_range(cfg, rows)
    low = data.draw(st.sampled_from(span))
    high = data.draw(st.sampled_from(span).filter(lambda c: c >= low))
    a, b = plan_saves(cfg, low, rows), plan_saves(cfg, high, rows)
    diff = [layer for layer in range(len(a)) if a[layer] != b[layer]]
    if diff:
        assert (a[diff[0]], b[diff[0]]) == (False, True)


def test_counterexample_to_monotonicity():
    # A heavy layer then a light one (worked-example shape, two layers): at 12,288 B the
    # heavy L0 replays and L1 fits; at 15,360 B L0 saves and crowds L1 out.
    cfg = worked_cfg(max_layers_per_slot=2)
    rows = [[8, 0], [2, 6]]
    assert plan_saves(cfg, 12_288, rows) == [False, True]
    assert plan_saves(cfg, 15_360, rows) == [True, False]
    assert not is_capacity_monotone(cfg, rows)
    assert is_capacity_monotone(worked_cfg(), WORKED_ROWS)
    assert _first_flip(worked_cfg(), WORKED_ROWS) is None


# --------------------------------------------------------------------------- "auto"
def _modes(cfg):
    return {mode: dataclasses.replace(cfg, save_gathered_rows=mode)
            for mode in (True, False, "auto")}


@PROPS
@given(data=st.data(), precision=st.sampled_from(["bf16", "mxfp8"]))
def test_auto_fits_and_keeps_what_it_says(data, precision):
    """save_gathered_rows='auto': every layer keeps its rows, x or its input, the bytes kept
    are that state's, and no rank ever passes the capacity with the later inputs reserved."""
    cfg, rows = data.draw(instances(precision))
    auto = _modes(cfg)["auto"]
    capacity = data.draw(st.sampled_from(_capacity_range(cfg, rows)))
    trace = trace_saves(auto, capacity, rows)
    ep, i = len(rows[0]), input_bytes(cfg)
    kept = [0] * ep
    for layer, what in enumerate(trace.kept):
        assert trace.decisions[layer] == (what != "input")
        per_rank = [full_state_bytes(cfg, ep, r) if what == "rows" else
                    kept_x_state_bytes(cfg, ep, r) if what == "x" else i
                    for r in rows[layer]]
        kept = [k + b for k, b in zip(kept, per_rank, strict=True)]
        assert tuple(kept) == trace.saved_bytes[layer]
        assert max(kept) + (len(rows) - 1 - layer) * i <= capacity
    assert trace.x_state_bytes == tuple(
        tuple(kept_x_state_bytes(cfg, ep, r) for r in layer) for layer in rows)
    assert plan_saves(auto, capacity, rows) == list(trace.decisions)


@PROPS
@given(data=st.data(), precision=st.sampled_from(["bf16", "mxfp8"]))
def test_auto_keeps_as_many_layers_as_either_mode_under_steady_rows(data, precision):
    """The same rows in every layer (the rule's estimate is then exact): 'auto' replays no
    more layers than True or False at any capacity, and keeps every layer's rows where they
    all fit."""
    cfg, rows = data.draw(instances(precision))
    rows = [list(rows[0]) for _ in rows]
    modes = _modes(cfg)
    capacity = data.draw(st.sampled_from(_capacity_range(cfg, rows)))
    traces = {m: trace_saves(c, capacity, rows) for m, c in modes.items()}
    kept = {m: sum(t.decisions) for m, t in traces.items()}
    assert kept["auto"] >= max(kept[True], kept[False]), (kept, traces["auto"].kept)
    if all(traces[True].decisions):  # every layer's rows fit: all keep them
        assert set(traces["auto"].kept) == {"rows"}


def test_auto_on_the_worked_example():
    """DESIGN.md's rows: at 28,672 B the first two layers estimate that all four could keep
    x (the later layers' rows taken to be theirs) and keep x; L2 keeps its rows, L3 replays.
    At 40,960 B (every layer's rows fit) all keep their rows. At 24,576 B it replays L2 and L3
    as the default does, though x in L0-L2 would have fitted: from L0's rows it expected
    three kept layers, one of them with its rows, and rank 0's heavier L2 and L3 were not
    foreseen (the rule knows only the current layer's rows)."""
    auto = worked_cfg(save_gathered_rows="auto")
    assert trace_saves(auto, 28_672, WORKED_ROWS).kept == ("x", "x", "rows", "input")
    assert trace_saves(auto, 40_960, WORKED_ROWS).kept == ("rows",) * 4
    assert plan_saves(worked_cfg(), 24_576, WORKED_ROWS) == [True, True, False, False]
    assert trace_saves(auto, 24_576, WORKED_ROWS).kept == ("rows", "rows", "input", "input")
    assert trace_saves(worked_cfg(save_gathered_rows=False), 24_576,
                       WORKED_ROWS).kept == ("x", "x", "x", "input")
    with pytest.raises(ValueError, match="is_capacity_monotone: .*'auto'"):
        is_capacity_monotone(auto, WORKED_ROWS)
