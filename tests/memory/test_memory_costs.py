"""Per-layer byte costs: the formulas of DESIGN.md, hand-computed breakdowns, padding."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distmoe.config import MoEConfig
from distmoe.memory import (
    TensorBytes,
    align128,
    full_state_breakdown,
    full_state_bytes,
    input_bytes,
    layer_costs,
    padded_rows,
    plan_memory,
    row_multiple,
    rows_in_place,
)

FAST = settings(max_examples=60, deadline=None, derandomize=True)


def bf16_cfg(**kw) -> MoEConfig:
    base = dict(hidden=256, ffn=256, num_experts=4, top_k=2, max_tokens=2)
    base.update(kw)
    return MoEConfig(**base)


def test_align128():
    assert [align128(n) for n in (0, 1, 127, 128, 129, 256, 257)] == [
        0,
        128,
        128,
        128,
        256,
        256,
        384,
    ]


def test_bf16_worked_example_bytes():
    # DESIGN.md's example: T=2, K=2, D=F=256; R rows -> 1536 R + 2048 bytes.
    cfg = bf16_cfg()
    assert input_bytes(cfg) == 1024
    assert [full_state_bytes(cfg, 2, r) for r in (3, 4, 5)] == [6656, 8192, 9728]
    assert full_state_breakdown(cfg, 2, 4) == (
        TensorBytes("x_gathered", (4, 256), "bf16", 2048),
        TensorBytes("h1", (4, 512), "bf16", 4096),
        TensorBytes("h3_routes", (2, 2, 256), "bf16", 2048),
    )


@FAST
@given(
    d=st.integers(1, 64).map(lambda v: 8 * v),
    f=st.integers(1, 64).map(lambda v: 8 * v),
    t=st.integers(1, 64),
    k=st.integers(1, 4),
    rows=st.integers(0, 512),
)
def test_bf16_full_state_formula(d, f, t, k, rows):
    cfg = MoEConfig(hidden=d, ffn=f, num_experts=8, top_k=k, max_tokens=t)
    expected = align128(rows * d * 2) + align128(rows * 2 * f * 2) + align128(t * k * d * 2)
    assert full_state_bytes(cfg, 2, rows) == expected
    assert input_bytes(cfg) == align128(t * d * 2)
    # without the route results (save_route_outputs=False): gathered x and h1 only
    lean = MoEConfig(hidden=d, ffn=f, num_experts=8, top_k=k, max_tokens=t,
                     save_route_outputs=False)
    assert full_state_bytes(lean, 2, rows) == expected - align128(t * k * d * 2)
    # the input instead of the gathered rows (save_gathered_rows=False)
    kept = MoEConfig(hidden=d, ffn=f, num_experts=8, top_k=k, max_tokens=t,
                     save_gathered_rows=False)
    assert full_state_bytes(kept, 2, rows) == (
        expected - align128(rows * d * 2) + align128(t * d * 2))
    assert full_state_breakdown(kept, 2, rows)[0] == TensorBytes("x", (t, d), "bf16",
                                                                  align128(t * d * 2))


@FAST
@given(
    d=st.integers(1, 64).map(lambda v: 8 * v),
    f=st.integers(1, 64).map(lambda v: 8 * v),
    rows=st.integers(0, 64).map(lambda v: 8 * v),  # R % 8 == 0: every tensor is aligned
)
def test_bf16_scratch_formulas(d, f, rows):
    cfg = MoEConfig(hidden=d, ffn=f, num_experts=8, top_k=2, max_tokens=4)
    costs = layer_costs(cfg, 1, rows)
    assert costs.forward_scratch.peak_bytes == 2 * rows * (d + 3 * f)
    backward = costs.backward_scratch.peak_bytes
    if d <= f:
        assert backward == 2 * rows * (d + 5 * f)
    else:
        # the extra region: gathered grad_h3 outgrows what grad_h1 leaves free
        assert backward == 2 * rows * (d + 5 * f) + 2 * rows * (d - f)
    assert costs.scratch_bytes == backward
    # a kept input's rows read in place (EP = 1): no gathered x in the backward scratch
    kept = MoEConfig(hidden=d, ffn=f, num_experts=8, top_k=2, max_tokens=4, training=True,
                     save_gathered_rows=False, gathered_rows_in_place=True)
    in_place = layer_costs(kept, 1, rows)
    assert in_place.backward_scratch.peak_bytes == backward - 2 * rows * d
    assert in_place.scratch_bytes == max(in_place.backward_scratch.peak_bytes,
                                         in_place.forward_scratch.peak_bytes)
    assert layer_costs(kept, 2, rows).backward_scratch.peak_bytes == backward  # EP > 1


def test_rows_in_place_rule():
    """In place only at EP = 1, in bf16 training with the input kept: forced by
    ``gathered_rows_in_place``, else from 512 rows per local expert (T*K/E)."""
    def cfg(**kw):
        base = dict(hidden=2048, ffn=768, num_experts=128, top_k=8, max_tokens=4096,
                    training=True, save_gathered_rows=False)
        return MoEConfig(**{**base, **kw})

    assert not rows_in_place(cfg(), 1)  # 256 rows per expert: copied
    assert rows_in_place(cfg(num_experts=64), 1)  # 512
    assert not rows_in_place(cfg(num_experts=64, max_tokens=4095), 1)  # 511
    assert rows_in_place(cfg(gathered_rows_in_place=True), 1)
    assert not rows_in_place(cfg(num_experts=64, gathered_rows_in_place=False), 1)
    assert not rows_in_place(cfg(num_experts=64, gathered_rows_in_place=True), 2)
    assert not rows_in_place(cfg(num_experts=64, save_gathered_rows=True), 1)
    assert not rows_in_place(cfg(num_experts=64, training=False), 1)
    # the plan's scratch: the gathered copy of x left out, 2*R*D bytes at the device bound
    copy = plan_memory(cfg(num_experts=64, gathered_rows_in_place=False), 1)
    place = plan_memory(cfg(num_experts=64), 1)
    rows = copy.device_receive_bound
    assert copy.scratch_bytes - place.scratch_bytes == align128(rows * 2048 * 2)
    assert place.slot_capacity_bytes == copy.slot_capacity_bytes


def test_bf16_scratch_hand_values():
    # D <= F: R=64, D=64, F=128 -> forward 2R(D+3F), backward 2R(D+5F)
    c = layer_costs(MoEConfig(hidden=64, ffn=128, num_experts=2, top_k=1, max_tokens=64), 1, 64)
    assert (c.forward_scratch.peak_bytes, c.backward_scratch.peak_bytes) == (57344, 90112)
    # D > F: R=64, D=128, F=64 -> x 16384 + h1 16384 + grad_h2 8192 + (h2 8192 + grad_h3 16384)
    c = layer_costs(MoEConfig(hidden=128, ffn=64, num_experts=2, top_k=1, max_tokens=64), 1, 64)
    assert c.backward_scratch.peak_bytes == 65536
    names = [[t.name for t in p] for p in c.backward_scratch.phases]
    assert names == [["h2", "grad_h3"], ["grad_h1"]]


def test_mxfp8_full_state_hand_computed():
    # D=64, F=32, T=4, K=2, E_local=2, row_block 16 -> P = max(16, 32) = 32; R=8 -> Rp=64
    cfg = MoEConfig(
        hidden=64, ffn=32, num_experts=4, top_k=2, max_tokens=4, precision="mxfp8", row_block=16
    )
    assert row_multiple(cfg) == 32
    assert padded_rows(cfg, 2, 8) == 64
    assert full_state_breakdown(cfg, 2, 8) == (
        TensorBytes("x_col.qdata", (64, 64), "e4m3", 4096),
        TensorBytes("x_col.scale", (64, 2), "e8m0", 128),
        TensorBytes("h1", (64, 64), "bf16", 8192),
        TensorBytes("h2_col.qdata", (32, 64), "e4m3", 2048),
        TensorBytes("h2_col.scale", (32, 2), "e8m0", 128),
        TensorBytes("h3_routes", (4, 2, 64), "bf16", 1024),
    )
    assert full_state_bytes(cfg, 2, 8) == 15616
    assert input_bytes(cfg) == align128(4 * 64 * 2)  # source rows stay bf16


def test_mxfp8_scratch_layouts():
    cfg = MoEConfig(
        hidden=64, ffn=32, num_experts=4, top_k=2, max_tokens=4, precision="mxfp8", row_block=16
    )
    c = layer_costs(cfg, 2, 8)
    # forward: x row bundle 4096+128, h1 8192, h2 row bundle 2048+128
    assert c.forward_scratch.peak_bytes == 4096 + 128 + 8192 + 2048 + 128
    bwd = c.backward_scratch
    assert [t.name for t in bwd.resident] == ["x_col.qdata", "x_col.scale", "h1", "grad_h2"]
    resident = 4096 + 128 + 8192 + 4096
    phase_bytes = [sum(t.num_bytes for t in p) for p in bwd.phases]
    # x_row; h2_col + grad_h3 row + col; grad_h1 row + col
    assert phase_bytes == [4224, 2176 + 4224 + 4224, 2 * (4096 + 128)]
    assert bwd.peak_bytes == resident + max(phase_bytes)


def test_nvfp4_inference_hand_computed():
    # P = row_block = 16; R=8 over E_local=2 -> Rp = 16 * (2 + 6 // 16) = 32
    cfg = MoEConfig(
        hidden=64,
        ffn=32,
        num_experts=4,
        top_k=2,
        max_tokens=4,
        precision="nvfp4",
        training=False,
        row_block=16,
    )
    c = layer_costs(cfg, 2, 8)
    assert c.padded_rows == 32
    assert c.input == () and c.full_state == () and c.backward_scratch is None
    assert c.forward_scratch.resident == (
        TensorBytes("x_row.qdata", (32, 32), "e2m1x2", 1024),
        TensorBytes("x_row.scale", (32, 4), "e4m3", 128),
        TensorBytes("x_row.global_scale", (32,), "fp32", 128),
        TensorBytes("h1", (32, 64), "bf16", 4096),
        TensorBytes("h2_row.qdata", (32, 16), "e2m1x2", 512),
        TensorBytes("h2_row.scale", (32, 2), "e4m3", 128),
        TensorBytes("h2_row.global_scale", (32,), "fp32", 128),
    )
    assert c.scratch_bytes == 6144


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_inference_keeps_nothing(precision):
    cfg = MoEConfig(
        hidden=64, ffn=64, num_experts=4, top_k=2, max_tokens=4, precision=precision, training=False
    )
    c = layer_costs(cfg, 2, 8)
    assert (c.input_bytes, c.full_state_bytes, c.backward_scratch) == (0, 0, None)
    assert c.scratch_bytes == c.forward_scratch.peak_bytes > 0


def _worst_padding_brute_force(rows: int, num_experts: int, multiple: int) -> int:
    best = 0
    for split in itertools.product(range(rows + 1), repeat=num_experts):
        if sum(split) == rows:
            best = max(best, sum(-(-n // multiple) * multiple for n in split))
    return best


@pytest.mark.parametrize("num_local", [1, 2, 3])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 31, 32, 33, 34, 40, 65, 97])
def test_padded_rows_is_the_worst_split(num_local, rows):
    cfg = MoEConfig(
        hidden=64,
        ffn=64,
        num_experts=2 * num_local,
        top_k=1,
        max_tokens=64,
        precision="mxfp8",
        row_block=16,
    )
    expected = _worst_padding_brute_force(rows, num_local, 32)
    assert padded_rows(cfg, 2, rows) == expected


def test_padded_rows_bf16_unpadded_and_rules():
    assert padded_rows(bf16_cfg(), 2, 5) == 5
    assert (
        row_multiple(
            MoEConfig(
                hidden=64,
                ffn=64,
                num_experts=4,
                top_k=1,
                max_tokens=4,
                precision="mxfp8",
                row_block=128,
            )
        )
        == 128
    )
    assert (
        row_multiple(
            MoEConfig(
                hidden=64,
                ffn=64,
                num_experts=4,
                top_k=1,
                max_tokens=4,
                precision="nvfp4",
                training=False,
                row_block=16,
            )
        )
        == 16
    )


def test_breakdown_rows_are_consistent():
    # every tensor's bytes are align128(prod(shape) * element size)
    sizes = {"bf16": 2, "fp32": 4, "e4m3": 1, "e8m0": 1, "e2m1x2": 1}
    for precision, training in [("bf16", True), ("mxfp8", True), ("nvfp4", False)]:
        cfg = MoEConfig(
            hidden=96 if precision == "bf16" else 64,
            ffn=160 if precision == "bf16" else 96,
            num_experts=8,
            top_k=3,
            max_tokens=5,
            precision=precision,
            training=training,
            row_block=32,
        )
        c = layer_costs(cfg, 4, 37)
        tensors = [*c.input, *c.full_state, *c.forward_scratch.tensors()]
        if c.backward_scratch is not None:
            tensors += c.backward_scratch.tensors()
        for name, shape, dtype, num_bytes in tensors:
            numel = 1
            for s in shape:
                numel *= s
            assert num_bytes == align128(numel * sizes[dtype]), name


def test_layer_costs_rejects_bad_rows():
    with pytest.raises(ValueError, match=r"rows \(-1\) must be >= 0"):
        layer_costs(bf16_cfg(), 2, -1)
    with pytest.raises(TypeError, match="rows must be an int"):
        layer_costs(bf16_cfg(), 2, 2.5)
    with pytest.raises(ValueError, match=r"num_experts \(4\) must be divisible by ep_size \(3\)"):
        layer_costs(bf16_cfg(), 3, 4)
