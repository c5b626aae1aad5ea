"""The kernel plan: same configs as the heuristics it replaced, overrides refused clearly.

``golden_plans.json.gz`` holds, for 2,376 cases (11 layer widths, 9 token bounds, EP 1-8,
inference and training, the three device classes), every config that the per-kernel
``from_heuristic`` methods of tag ``pre-restructure-57`` picked, with the device class
emulated there (Gluon available or not, device memory 80 or 141 GiB). The plan must give the
same configs: the restructure moved the rules, it did not change them.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import pytest

import distmoe as dm
from distmoe.plan import KernelPlan, plan_kernels, thresholds

GOLDEN = Path(__file__).with_name("golden_plans.json.gz")


def _cases():
    with gzip.open(GOLDEN, "rt") as f:
        return json.load(f)


def _cfg(case) -> dm.MoEConfig:
    return dm.MoEConfig(hidden=case["hidden"], ffn=case["ffn"],
                        num_experts=case["num_experts"], top_k=case["top_k"],
                        max_tokens=case["max_tokens"], precision="bf16",
                        training=case["training"])


def test_plan_matches_pre_restructure_heuristics():
    cases = _cases()
    assert len(cases) == 2376
    mismatches = []
    for case in cases:
        plan = plan_kernels(_cfg(case), ep_size=case["ep_size"],
                            device_class=case["device_class"])
        got = {k: dataclasses.asdict(v) for k, v in plan.kernels().items()}
        for key, want in case["kernels"].items():
            # fields removed since (options measured slower) must have had their defaults
            have = got.get(key)
            diff = {f: (v, have.get(f)) for f, v in want.items()
                    if f in have and have[f] != v}
            if have is None or diff:
                mismatches.append((case["device_class"], case["hidden"], case["ffn"],
                                   case["num_experts"], case["max_tokens"], case["ep_size"],
                                   case["training"], key, diff))
        assert set(got) == set(case["kernels"])
    assert not mismatches, f"{len(mismatches)} configs differ, first: {mismatches[:3]}"


def _small(training=True, **kw):
    return dm.MoEConfig(hidden=256, ffn=128, num_experts=8, top_k=2, max_tokens=64,
                        precision="bf16", training=training, **kw)


def test_override_replaces_fields_and_is_recorded():
    plan = plan_kernels(_small(), overrides={"w13": {"num_stages": 2},
                                             "layer": {"pull_all": True}})
    assert plan.w13.num_stages == 2
    assert plan.layer.pull_all is True
    assert plan.overridden == ("w13", "layer.pull_all")
    assert "(override)" in plan.describe()


@pytest.mark.parametrize("overrides, error, match", [
    # unknown kernel key
    ({"w3": {}}, ValueError, r"overrides key \('w3'\) must be one of"),
    # unknown field of a known kernel
    ({"w2": {"stages": 3}}, ValueError, r"unknown field\(s\) \['stages'\] of W2Config"),
    # a value the config refuses
    ({"w13": {"num_warps": 3}}, ValueError, r"overrides\['w13'\].*num_warps \(3\) must be"),
    # Gluon where no Gluon kernel runs
    ({"w2": {"gluon": True}}, ValueError, r"gluon=True needs a Hopper device class"),
    # block_m is the layer's padding multiple
    ({"w13": {"block_m": 64}}, ValueError, r"block_m \(64\) must stay the layer's padding"),
    # not a dict
    ({"w13": 3}, TypeError, r"overrides\['w13'\] must be a dict of W13Config fields"),
    # unknown layer switch
    ({"layer": {"fused": True}}, ValueError, r"unknown switch 'fused'"),
    # wrong type of a layer switch
    ({"layer": {"pull_all": 1}}, TypeError, r"overrides\['layer'\]\['pull_all'\] must be"),
    # Mega at EP=1 / in training
    ({"layer": {"mega": True}}, ValueError, r"Mega runs in EP > 1 inference only"),
])
def test_bad_overrides_refused(overrides, error, match):
    with pytest.raises(error, match=match):
        plan_kernels(_small(), overrides=overrides)


def test_backward_override_refused_in_inference():
    # a training-only kernel in an inference plan
    with pytest.raises(ValueError, match=r"w2_dgrad kernel runs in training only"):
        plan_kernels(_small(training=False), overrides={"w2_dgrad": {"num_stages": 3}})


def test_inference_plan_has_no_backward_and_describes_per_call_choice():
    plan = plan_kernels(_small(training=False), ep_size=2, device_class="h100")
    assert isinstance(plan, KernelPlan)
    assert plan.w2_dgrad is None and "w2_dgrad" not in plan.kernels()
    text = plan.describe(_small(training=False), tokens=64)
    assert "EP=2" in text and "call with T=64" in text


def test_threshold_tables_have_reasons_and_evidence():
    for dc in ("h100", "h200", "generic"):
        for name, row in thresholds(dc).rows():
            assert row.reason and row.evidence.startswith("docs/performance.md#run-"), name
    # the one row the H200 table changes
    assert thresholds("h200").value("wgrad_wide_tile_min_rows") == 1024
    assert thresholds("h100").value("wgrad_wide_tile_min_rows") == 0
    with pytest.raises(ValueError, match=r"device_class \('a100'\) must be one of"):
        thresholds("a100")


def test_fp4_weight_gemm_swaps_tiles_at_decode_only():
    from distmoe.plan import rules

    line = thresholds("h100").value("fp4_swap_rows")
    assert line > 0  # measured (run 76): on at decode
    decode = rules.fp4_weight_gemm(k=4096, n=4096, swiglu=True, block_m=128,
                                   rows_per_expert=line - 1, device_class="h100")
    assert decode.swap_ab and decode.block_m == 32 and 128 % decode.block_m == 0
    kept = rules.fp4_weight_gemm(k=4096, n=4096, swiglu=True, block_m=128,
                                 rows_per_expert=line, device_class="h100")
    assert not kept.swap_ab and kept.block_m == 128
    # a padding multiple the transposed tile does not divide keeps the padded tiles
    odd = rules.fp4_weight_gemm(k=4096, n=4096, swiglu=True, block_m=16,
                                rows_per_expert=1, device_class="h100")
    assert not odd.swap_ab and odd.block_m == 16
    # an explicit line
    assert not rules.fp4_weight_gemm(k=4096, n=4096, block_m=128, rows_per_expert=1,
                                     swap_rows=0).swap_ab


def test_fp8_operands_override_needs_128_multiples():
    cfg = dm.MoEConfig(hidden=64, ffn=32, num_experts=4, top_k=2, max_tokens=8,
                       precision="nvfp4", training=False)
    plan = plan_kernels(cfg, device_class="generic",
                        overrides={"layer": {"fp8_operands": True}})
    with pytest.raises(ValueError, match=r"overrides\['layer'\]\['fp8_operands'\]: FP8 "
                                         r"operands need hidden \(64\) and ffn \(32\)"):
        plan.fp4_fp8_operands(cfg)
    assert not plan_kernels(cfg, device_class="generic").fp4_fp8_operands(cfg)
