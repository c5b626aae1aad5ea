"""MoEConfig validation: every rule raises with the field, the rule and the value."""

import dataclasses

import pytest

from distmoe import MoEConfig

BASE = dict(hidden=256, ffn=128, num_experts=8, top_k=2, max_tokens=64)


def make(**kw):
    return MoEConfig(**{**BASE, **kw})


def test_valid_config_is_frozen_and_keyword_only():
    cfg = make()
    assert cfg.balanced_rows == 128
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden = 512
    with pytest.raises(TypeError):
        MoEConfig(256, 128, 8, 2, 64)  # positional use is refused


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(top_k=9), r"top_k \(9\) must be <= num_experts \(8\)"),
        (dict(hidden=0), r"hidden \(0\) must be >= 1"),
        (dict(max_tokens=-3), r"max_tokens \(-3\) must be >= 1"),
        (dict(precision="nvfp4", training=True),
         r"precision 'nvfp4' is inference only: training \(True\) must be False"),
        (dict(precision="mxfp8", hidden=48), r"hidden \(48\) must be a multiple of 32 for precision 'mxfp8'"),
        (dict(ffn=20), r"ffn \(20\) must be a multiple of 8 for precision 'bf16'"),
        (dict(precision="fp16"), r"precision \('fp16'\) must be one of"),
        (dict(num_experts=40000, top_k=2), r"num_experts \(40000\) must be <= 32767"),
        (dict(row_block=96), r"row_block \(96\) must be a power of two in \[16, 256\]"),
        (dict(activation_factor=-1.0), r"activation_factor \(-1.0\) must be finite and >= 0"),
        (dict(device_scratch_factor=0), r"device_scratch_factor \(0\) must be finite and > 0"),
        (dict(device_scratch_factor=4.0, total_scratch_factor=2.0),
         r"total_scratch_factor \(2.0\) must be >= device_scratch_factor \(4.0\)"),
        (dict(num_slots=0), r"num_slots \(0\) must be >= 1"),
    ],
)
def test_invalid_values_raise_value_error(kw, match):
    with pytest.raises(ValueError, match=match):
        make(**kw)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(hidden=256.0), r"hidden must be an int, got float"),
        (dict(top_k=True), r"top_k must be an int, got bool"),
        (dict(training="yes"), r"training must be a bool, got str"),
        (dict(save_gathered_rows=1), r"save_gathered_rows must be a bool or 'auto', got int"),
        (dict(save_gathered_rows=False, gathered_rows_in_place=1),
         r"gathered_rows_in_place must be a bool or None, got int"),
    ],
)
def test_wrong_types_raise_type_error(kw, match):
    with pytest.raises(TypeError, match=match):
        make(**kw)


def test_ep_size_rules():
    cfg = make(num_experts=12, top_k=2)
    assert cfg.experts_per_rank(4) == 3
    with pytest.raises(ValueError, match=r"num_experts \(12\) must be divisible by ep_size \(8\)"):
        cfg.check_ep_size(8)
    with pytest.raises(ValueError, match=r"ep_size \(0\) must be >= 1"):
        cfg.check_ep_size(0)


def test_receive_bound_is_capped_by_what_can_arrive():
    cfg = make(device_scratch_factor=100.0)
    # 2 ranks x 64 tokens x min(K=2, E_local=4) routes
    assert cfg.receive_bound(2) == 2 * 64 * 2
    assert make(device_scratch_factor=1.5).receive_bound(2) == 192
    assert make(device_scratch_factor=1.0, total_scratch_factor=2.0).receive_bound(
        2, total=True) == 256


def test_gathered_rows_in_place_needs_the_input_kept():
    assert make(save_gathered_rows=False, gathered_rows_in_place=True).gathered_rows_in_place
    with pytest.raises(ValueError, match=r"gathered_rows_in_place \(False\) applies only with "
                                         r"save_gathered_rows False or 'auto' .*got "
                                         r"save_gathered_rows=True"):
        make(gathered_rows_in_place=False)


def test_save_gathered_rows_auto():
    """'auto' is the one string, and takes gathered_rows_in_place like False."""
    assert make(save_gathered_rows="auto").save_gathered_rows == "auto"
    for in_place in (None, True, False):
        assert make(save_gathered_rows="auto",
                    gathered_rows_in_place=in_place).gathered_rows_in_place is in_place
    with pytest.raises(ValueError, match=r"save_gathered_rows must be True, False or 'auto', "
                                         r"got 'x'"):
        make(save_gathered_rows="x")
