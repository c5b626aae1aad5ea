"""Activation memory: per-layer byte costs, slot capacities, save/replay decisions, slots.

Pure Python (no tensors, no device). ``plan_memory(cfg, ep_size)`` sizes the activation
buffer; ``plan_saves`` decides which layers of a slot keep their full state; and
``assign_slots`` maps pipeline lifetimes onto slots. docs/memory.md explains the model.
"""

from distmoe.memory.costs import (
    LayerCosts,
    ScratchLayout,
    TensorBytes,
    align128,
    full_state_breakdown,
    full_state_bytes,
    input_bytes,
    kept_x_state_bytes,
    layer_costs,
    padded_rows,
    row_multiple,
    rows_in_place,
    scratch_bytes,
)
from distmoe.memory.planner import (
    MemoryPlan,
    Region,
    SaveTrace,
    format_breakdown,
    format_bytes,
    format_saves,
    is_capacity_monotone,
    keeps_state_in_slots,
    plan_memory,
    plan_saves,
    trace_saves,
)
from distmoe.memory.slots import (
    Action,
    SlotAssignment,
    assign_slots,
    interleaved_1f1b,
    live_counts,
    microbatch_lifetimes,
    stage_lifetimes,
)

__all__ = [
    "Action",
    "LayerCosts",
    "MemoryPlan",
    "Region",
    "SaveTrace",
    "ScratchLayout",
    "SlotAssignment",
    "TensorBytes",
    "align128",
    "assign_slots",
    "format_breakdown",
    "format_bytes",
    "format_saves",
    "full_state_breakdown",
    "full_state_bytes",
    "input_bytes",
    "interleaved_1f1b",
    "is_capacity_monotone",
    "keeps_state_in_slots",
    "kept_x_state_bytes",
    "layer_costs",
    "live_counts",
    "microbatch_lifetimes",
    "padded_rows",
    "plan_memory",
    "plan_saves",
    "row_multiple",
    "rows_in_place",
    "scratch_bytes",
    "stage_lifetimes",
    "trace_saves",
]
